/* Work stealing by the waiter on the host backend: a thread that waits for
 * an event or a stream runs the queued operations the worker has not
 * started itself. They run once each, in stream order, only up to what the
 * wait needs, never a host function (those stay on the stream's thread;
 * releases that may run on any thread excepted), first the work of another
 * stream that a wait in the queue is for, and
 * never an operation before the event it waits for; after the wait the
 * event's semantics hold (bytes arrived, the blocks are free to free in
 * strict mode). A held worker (ofl__host_stream_hold) plays one that has not
 * woken up yet. Host backend only. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ofl/ofl.h>
#include "runtime/device_internal.h"

#define OK(call) cr_assert(eq(int, (call), OFL_SUCCESS), "%s", ofl_last_error())
#define N 4096

static ofl_device_t *dev;

/* A strict host device: jitter_us and link_gbps as ofl_device_params_t
 * takes them (-1: from the environment), inline_limit the
 * OFL_HOST_INLINE_BYTES it opens with (NULL: the environment's). */
static ofl_device_t *open_host(int jitter_us, double link_gbps,
                               const char *inline_limit) {
  setenv("OFL_BACKEND", "host", 1);
  if (inline_limit != NULL)
    setenv("OFL_HOST_INLINE_BYTES", inline_limit, 1);
  ofl_config_reload();
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  p.strict = 1;
  p.jitter_max_us = jitter_us;
  p.link_h2d_gbps = link_gbps;
  p.link_d2h_gbps = link_gbps;
  ofl_device_t *d = NULL;
  OK(ofl_device_open(&p, &d));
  if (inline_limit != NULL) {
    unsetenv("OFL_HOST_INLINE_BYTES");
    ofl_config_reload();
  }
  ofl_log_set_level(OFL_LOG_NONE);
  return d;
}

static void open_dev(void) { dev = open_host(-1, -1.0, NULL); }
static void close_dev(void) { ofl_device_close(dev); }
TestSuite(host_steal, .init = open_dev, .fini = close_dev);

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    p[i] = (unsigned char)(i * 31u + seed);
}

/* The chain of order-dependent operations the tests queue, and the bytes it
 * leaves in out: src -> d1, a memset over part of d1, d1 -> d2, src is
 * overwritten (a copy of src run again after this would show), d2 -> out.
 * Returns the number of operations queued. */
static int queue_chain(ofl_stream_t *s, unsigned char *src, void *d1,
                       void *d2, unsigned char *out) {
  OK(ofl_memcpy_async(d1, src, N, OFL_COPY_H2D, s));
  OK(ofl_memset_async((char *)d1 + 100, 0xAB, 300, s));
  OK(ofl_memcpy_async(d2, d1, N, OFL_COPY_D2D, s));
  OK(ofl_memset_async(d1, 0xCD, N, s));
  OK(ofl_memcpy_async(out, d2, N, OFL_COPY_D2H, s));
  return 5;
}

static void expect_chain(const unsigned char *src0, const unsigned char *out) {
  size_t wrong = 0;
  for (size_t i = 0; i < N; i++) {
    unsigned char want = (i >= 100 && i < 400) ? 0xAB : src0[i];
    wrong += out[i] != want;
  }
  cr_assert(eq(sz, wrong, 0), "%zu of %d bytes wrong", wrong, N);
}

static atomic_int fn_calls;
static pthread_t fn_thread;
static void host_fn(void *arg) {
  (void)arg;
  fn_thread = pthread_self();
  atomic_fetch_add(&fn_calls, 1);
}

/* The compute stream's wait takes the operations before the event off the
 * held worker's queue and runs them, once each and in order; what was
 * queued after the event is left to the worker. */
Test(host_steal, compute_wait_runs_the_ops_before_the_event_once_in_order) {
  ofl_stream_t *s = NULL, *c = ofl_device_compute_stream(dev);
  ofl_event_t *e = NULL;
  void *d1 = NULL, *d2 = NULL, *d3 = NULL;
  unsigned char src[N], src0[N], out[N], late[N];
  fill(src, N, 7);
  memcpy(src0, src, N);
  memset(out, 0, N);
  memset(late, 0, N);
  OK(ofl_stream_create(dev, "h2d", &s));
  OK(ofl_event_create(dev, &e));
  OK(ofl_device_malloc(dev, N, &d1));
  OK(ofl_device_malloc(dev, N, &d2));
  OK(ofl_device_malloc(dev, N, &d3));
  ofl__host_stream_hold(s, true);
  int before = queue_chain(s, src, d1, d2, out);
  OK(ofl_event_record(e, s));
  OK(ofl_memset_async(d3, 0x5A, N, s));
  OK(ofl_memcpy_async(late, d3, N, OFL_COPY_D2H, s));

  OK(ofl_stream_wait_event(c, e));
  expect_chain(src0, out);
  cr_assert(eq(u64, ofl__host_stream_stolen(s), (uint64_t)before + 1));
  cr_assert(eq(int, ofl_event_query(e), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_query(s), OFL_ERR_NOT_READY));
  for (size_t i = 0; i < N; i++)
    cr_assert(eq(u8, late[i], 0), "an op after the event ran");
  /* Event semantics in strict mode: the blocks the ops before it used are
   * no longer in use (a free with queued users is refused). */
  OK(ofl_device_free(dev, d1));
  OK(ofl_device_free(dev, d2));

  ofl__host_stream_hold(s, false);
  OK(ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT));
  for (size_t i = 0; i < N; i++)
    cr_assert(eq(u8, late[i], 0x5A));
  expect_chain(src0, out); /* nothing of the chain ran a second time */
  OK(ofl_device_free(dev, d3));
  ofl_event_destroy(e);
  OK(ofl_stream_destroy(s));
}

/* A host function is never taken: the waiter runs what comes before it and
 * leaves it, and everything after it, to the worker, on whose thread it
 * runs once. */
/* On a new held stream *s: src -> *d1, host_fn (a release that may run on
 * any thread when release), *d1 -> out, a record of a new *e. */
static void fn_between_copies(ofl_stream_t **s, ofl_event_t **e, void **d1,
                              const unsigned char *src, unsigned char *out,
                              bool release) {
  atomic_store(&fn_calls, 0);
  OK(ofl_stream_create(dev, "d2h", s));
  OK(ofl_event_create(dev, e));
  OK(ofl_device_malloc(dev, N, d1));
  ofl__host_stream_hold(*s, true);
  OK(ofl_memcpy_async(*d1, src, N, OFL_COPY_H2D, *s));
  OK(release ? ofl__stream_launch_release(*s, host_fn, NULL)
             : ofl_stream_launch_host_func(*s, host_fn, NULL));
  OK(ofl_memcpy_async(out, *d1, N, OFL_COPY_D2H, *s));
  OK(ofl_event_record(*e, *s));
}

Test(host_steal, host_function_stays_on_the_stream_thread) {
  ofl_stream_t *s = NULL;
  ofl_event_t *e = NULL;
  void *d1 = NULL;
  unsigned char src[N], out[N];
  fill(src, N, 3);
  memset(out, 0, N);
  fn_between_copies(&s, &e, &d1, src, out, false);

  /* The worker is held: the waiter runs the first copy, stops at the host
   * function and times out. */
  cr_assert(eq(int, ofl_event_synchronize(e, 50), OFL_ERR_TIMEOUT));
  cr_assert(eq(u64, ofl__host_stream_stolen(s), 1));
  cr_assert(eq(int, atomic_load(&fn_calls), 0));
  cr_assert(eq(int, out[0], 0), "an op after the host function ran");

  ofl__host_stream_hold(s, false);
  OK(ofl_event_synchronize(e, OFL_TIMEOUT_DEFAULT));
  OK(ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT));
  cr_assert(eq(int, atomic_load(&fn_calls), 1));
  cr_assert(not(pthread_equal(fn_thread, pthread_self())),
            "the host function ran on the waiting thread");
  cr_assert(eq(int, memcmp(out, src, N), 0));
  OK(ofl_device_free(dev, d1));
  ofl_event_destroy(e);
  OK(ofl_stream_destroy(s));
}

/* A release that may run on any thread (ofl__stream_launch_release: storage
 * wrapped with OFL_WRAP_RELEASE_IN_HOST_FN) does not stop the waiter: with
 * the worker held, a waiter runs the copy, the release and the copy behind
 * it, in order, on its own thread. On an idle stream the release runs at
 * once on the submitting thread. */
Test(host_steal, a_release_host_function_is_taken_by_the_waiter) {
  ofl_stream_t *s = NULL;
  ofl_event_t *e = NULL;
  void *d1 = NULL;
  unsigned char src[N], out[N];
  fill(src, N, 5);
  memset(out, 0, N);
  fn_between_copies(&s, &e, &d1, src, out, true);
  cr_assert(eq(int, atomic_load(&fn_calls), 0), "ran before its copy");
  OK(ofl_event_synchronize(e, 2000));
  cr_assert(eq(u64, ofl__host_stream_stolen(s), 4));
  cr_assert(eq(int, atomic_load(&fn_calls), 1));
  cr_assert(pthread_equal(fn_thread, pthread_self()));
  cr_assert(eq(int, memcmp(out, src, N), 0));
  ofl__host_stream_hold(s, false);
  OK(ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT));
  OK(ofl_device_free(dev, d1));
  ofl_event_destroy(e);
  OK(ofl_stream_destroy(s));

  /* Idle stream of a device without jitter: at once, here. */
  ofl_device_t *quiet = open_host(0, -1.0, NULL);
  OK(ofl_stream_create(quiet, "d2h", &s));
  OK(ofl__stream_launch_release(s, host_fn, NULL));
  cr_assert(eq(int, atomic_load(&fn_calls), 2));
  cr_assert(pthread_equal(fn_thread, pthread_self()));
  cr_assert(eq(u64, ofl__host_stream_inlined(s), 1));
  OK(ofl_stream_destroy(s));
  ofl_device_close(quiet);
}

/* A stream wait is taken only once its event completed: stream a waits for
 * b's event, both held. Where b's queue starts with a host function (which
 * stays with b's worker), a waiter on a runs a's first copy and stops at the
 * wait; after b completes (its synchronize takes b's ops), a waiter takes
 * the wait and what follows. Where b's queue can be taken, a waiter on a
 * runs b's work up to the event first, then a's (transitive steal). Either
 * way the bytes a reads are b's. */
static void wait_on_another_stream(bool host_fn_first) {
  ofl_stream_t *a = NULL, *b = NULL;
  ofl_event_t *eb = NULL, *ea = NULL;
  void *d = NULL, *x = NULL;
  unsigned char src[N], out[N], xout[N];
  fill(src, N, 11);
  memset(out, 0, N);
  memset(xout, 0, N);
  atomic_store(&fn_calls, 0);
  OK(ofl_stream_create(dev, "a", &a));
  OK(ofl_stream_create(dev, "b", &b));
  OK(ofl_event_create(dev, &ea));
  OK(ofl_event_create(dev, &eb));
  OK(ofl_device_malloc(dev, N, &d));
  OK(ofl_device_malloc(dev, N, &x));
  ofl__host_stream_hold(a, true);
  ofl__host_stream_hold(b, true);
  if (host_fn_first)
    OK(ofl_stream_launch_host_func(b, host_fn, NULL));
  OK(ofl_memset_async(d, 0x00, N, b));
  OK(ofl_memcpy_async(d, src, N, OFL_COPY_H2D, b));
  OK(ofl_event_record(eb, b));
  OK(ofl_memset_async(x, 0x77, N, a));
  OK(ofl_stream_wait_event(a, eb));
  OK(ofl_memcpy_async(out, d, N, OFL_COPY_D2H, a));
  OK(ofl_memcpy_async(xout, x, N, OFL_COPY_D2H, a));
  OK(ofl_event_record(ea, a));

  if (host_fn_first) {
    cr_assert(eq(int, ofl_event_synchronize(ea, 50), OFL_ERR_TIMEOUT));
    cr_assert(eq(u64, ofl__host_stream_stolen(a), 1), "stole past the wait");
    cr_assert(eq(int, out[0], 0));
    cr_assert(eq(u64, ofl__host_stream_stolen(b), 0));
    cr_assert(eq(int, atomic_load(&fn_calls), 0));
    ofl__host_stream_hold(b, false); /* b's worker runs the host function */
    OK(ofl_stream_synchronize(b, OFL_TIMEOUT_DEFAULT));
    cr_assert(eq(int, atomic_load(&fn_calls), 1));
    OK(ofl_event_synchronize(ea, OFL_TIMEOUT_DEFAULT));
    cr_assert(eq(u64, ofl__host_stream_stolen(a), 5));
  } else {
    OK(ofl_event_synchronize(ea, 2000));
    cr_assert(eq(u64, ofl__host_stream_stolen(b), 3));
    cr_assert(eq(u64, ofl__host_stream_stolen(a), 5));
  }
  cr_assert(eq(int, memcmp(out, src, N), 0));
  for (size_t i = 0; i < N; i++)
    cr_assert(eq(u8, xout[i], 0x77));
  ofl__host_stream_hold(a, false);
  ofl__host_stream_hold(b, false);
  OK(ofl_device_free(dev, d));
  OK(ofl_device_free(dev, x));
  ofl_event_destroy(ea);
  ofl_event_destroy(eb);
  OK(ofl_stream_destroy(a));
  OK(ofl_stream_destroy(b));
}

Test(host_steal, never_runs_an_op_before_the_event_it_waits_for) {
  wait_on_another_stream(true);
}

Test(host_steal, a_waiter_runs_the_work_its_stream_waits_for_first) {
  wait_on_another_stream(false);
}

/* Worker and waiters race for the same queue (no hold): a waiter on the
 * compute stream and one synchronizing the stream, round after round; each
 * round's chain of order-dependent ops must leave exactly its bytes. */
Test(host_steal, worker_and_waiters_racing_run_each_op_once, .timeout = 120) {
  ofl_stream_t *s = NULL, *c = ofl_device_compute_stream(dev);
  ofl_event_t *e = NULL;
  void *d1 = NULL, *d2 = NULL;
  static unsigned char src[N], src0[N], out[N];
  OK(ofl_stream_create(dev, "race", &s));
  OK(ofl_event_create(dev, &e));
  OK(ofl_device_malloc(dev, N, &d1));
  OK(ofl_device_malloc(dev, N, &d2));
  for (unsigned round = 0; round < 400; round++) {
    fill(src, N, round);
    memcpy(src0, src, N);
    memset(out, 0, N);
    queue_chain(s, src, d1, d2, out);
    OK(ofl_event_record(e, s));
    if (round % 3 == 0)
      OK(ofl_event_synchronize(e, OFL_TIMEOUT_DEFAULT));
    else if (round % 3 == 1)
      OK(ofl_stream_wait_event(c, e));
    else
      OK(ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT));
    expect_chain(src0, out);
  }
  OK(ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT));
  OK(ofl_device_free(dev, d1));
  OK(ofl_device_free(dev, d2));
  ofl_event_destroy(e);
  OK(ofl_stream_destroy(s));
}

/* An event outlives the stream of its latest record: a wait after the
 * destroy sees it complete, and a record elsewhere lets the stream go. */
Test(host_steal, event_outlives_the_stream_it_was_recorded_on) {
  ofl_stream_t *s = NULL;
  ofl_event_t *e = NULL, *f = NULL;
  OK(ofl_stream_create(dev, "gone", &s));
  OK(ofl_event_create(dev, &e));
  OK(ofl_event_create(dev, &f));
  OK(ofl_event_record(e, s));
  OK(ofl_event_record(f, s));
  OK(ofl_stream_destroy(s));
  OK(ofl_event_synchronize(e, OFL_TIMEOUT_DEFAULT));
  OK(ofl_stream_wait_event(ofl_device_compute_stream(dev), f));
  OK(ofl_event_record(e, ofl_device_compute_stream(dev)));
  ofl_event_destroy(e);
  ofl_event_destroy(f);
}

/* ---- inline submission (OFL_HOST_INLINE_BYTES) ---------------------------
 * A copy up to the limit, or a record, submitted to an idle worker stream
 * runs on the submitting thread; anything queued or running before it, a
 * larger copy, strict-mode jitter, a link model or a held stream leave it to
 * the worker. The bytes and the event semantics are the worker's. */

static ofl_device_t *open_inline(int jitter_us, double link_gbps) {
  return open_host(jitter_us, link_gbps, "8K");
}

Test(host_inline, a_small_copy_to_an_idle_stream_runs_on_the_submitter) {
  ofl_device_t *d = open_inline(0, 0);
  ofl_stream_t *s = NULL;
  ofl_event_t *e = NULL;
  void *dv = NULL;
  unsigned char src[N], out[N];
  fill(src, N, 3);
  memset(out, 0, N);
  OK(ofl_stream_create(d, "d2h", &s));
  OK(ofl_event_create(d, &e));
  OK(ofl_device_malloc(d, N, &dv));
  OK(ofl_memcpy_async(dv, src, N, OFL_COPY_H2D, s));
  cr_assert(eq(u64, ofl__host_stream_inlined(s), 1));
  OK(ofl_memcpy_async(out, dv, N, OFL_COPY_D2H, s));
  OK(ofl_event_record(e, s));
  cr_assert(eq(u64, ofl__host_stream_inlined(s), 3));
  /* done when the calls return: the event too, and the stream idle */
  cr_assert(eq(int, ofl_event_query(e), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_query(s), OFL_SUCCESS));
  cr_assert(eq(int, memcmp(out, src, N), 0));
  /* a block whose copies ran inline is free to free at once (strict mode
   * reports frees of blocks in flight) */
  OK(ofl_device_free(d, dv));
  ofl_event_destroy(e);
  OK(ofl_stream_destroy(s));
  ofl_device_close(d);
}

Test(host_inline, the_worker_keeps_what_is_large_queued_jittered_paced_or_held) {
  enum { BIG = 3 * N }; /* above the 8K limit */
  static unsigned char src[BIG], out[BIG];
  fill(src, BIG, 9);
  /* too large */
  ofl_device_t *d = open_inline(0, 0);
  ofl_stream_t *s = NULL;
  void *dv = NULL;
  OK(ofl_stream_create(d, "s", &s));
  OK(ofl_device_malloc(d, BIG, &dv));
  OK(ofl_memcpy_async(dv, src, BIG, OFL_COPY_H2D, s));
  cr_assert(eq(u64, ofl__host_stream_inlined(s), 0));
  /* queued behind a held worker: stream order first */
  ofl__host_stream_hold(s, true);
  OK(ofl_memcpy_async(out, dv, N, OFL_COPY_D2H, s));
  cr_assert(eq(u64, ofl__host_stream_inlined(s), 0));
  ofl__host_stream_hold(s, false);
  OK(ofl_stream_synchronize(s, 10000));
  cr_assert(eq(int, memcmp(out, src, N), 0));
  OK(ofl_device_free(d, dv));
  OK(ofl_stream_destroy(s));
  ofl_device_close(d);
  /* strict-mode jitter, and a link model: every operation on the worker */
  for (int k = 0; k < 2; k++) {
    d = k == 0 ? open_inline(50, 0) : open_inline(0, 1.0);
    OK(ofl_stream_create(d, "s", &s));
    OK(ofl_device_malloc(d, N, &dv));
    memset(out, 0, N);
    OK(ofl_memcpy_async(dv, src, N, OFL_COPY_H2D, s));
    OK(ofl_memcpy_async(out, dv, N, OFL_COPY_D2H, s));
    OK(ofl_stream_synchronize(s, 10000));
    cr_assert(eq(u64, ofl__host_stream_inlined(s), 0), "case %d", k);
    cr_assert(eq(int, memcmp(out, src, N), 0));
    OK(ofl_device_free(d, dv));
    OK(ofl_stream_destroy(s));
    ofl_device_close(d);
  }
}

/* Work another thread queues while a copy runs inline finds the stream
 * busy and goes to the worker, which must be woken when the inline copy
 * ends: polling the event (no wait, so no stealing) sees it complete. */
static struct {
  ofl_stream_t *s;
  ofl_event_t *e;
  void *dv;
  unsigned char out[N];
  atomic_int started;
  int done;
} race;

static void *second_submitter(void *arg) {
  (void)arg;
  while (!atomic_load(&race.started))
    ;
  struct timespec ts = {0, 2000000}; /* inside the first thread's copy */
  nanosleep(&ts, NULL);
  if (ofl_memcpy_async(race.out, race.dv, N, OFL_COPY_D2H, race.s) !=
          OFL_SUCCESS ||
      ofl_event_record(race.e, race.s) != OFL_SUCCESS)
    return NULL;
  for (int i = 0; i < 5000; i++) { /* 5 s */
    if (ofl_event_query(race.e) == OFL_SUCCESS) {
      race.done = 1;
      return NULL;
    }
    nanosleep(&(struct timespec){0, 1000000}, NULL);
  }
  return NULL;
}

Test(host_inline, work_queued_behind_an_inline_copy_reaches_the_worker) {
  enum { BIG = 64 << 20 };
  ofl_device_t *d = open_host(0, 0, "1G");
  void *big_d = NULL;
  unsigned char *big_h = malloc(BIG), src[N];
  cr_assert(big_h != NULL);
  memset(big_h, 0x11, BIG);
  fill(src, N, 5);
  OK(ofl_stream_create(d, "s", &race.s));
  OK(ofl_event_create(d, &race.e));
  OK(ofl_device_malloc(d, BIG, &big_d));
  OK(ofl_device_malloc(d, N, &race.dv));
  OK(ofl_memcpy_async(race.dv, src, N, OFL_COPY_H2D, race.s));
  OK(ofl_stream_synchronize(race.s, 10000));
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, second_submitter, NULL), 0));
  atomic_store(&race.started, 1);
  OK(ofl_memcpy_async(big_d, big_h, BIG, OFL_COPY_H2D, race.s)); /* inline */
  pthread_join(t, NULL);
  cr_assert(race.done, "the copy queued behind the inline one never ran");
  cr_assert(eq(int, memcmp(race.out, src, N), 0));
  cr_assert(ge(u64, ofl__host_stream_inlined(race.s), 2));
  OK(ofl_stream_synchronize(race.s, 10000));
  OK(ofl_device_free(d, big_d));
  OK(ofl_device_free(d, race.dv));
  ofl_event_destroy(race.e);
  OK(ofl_stream_destroy(race.s));
  ofl_device_close(d);
  free(big_h);
}

/* ---- dozing workers (OFL_HOST_DOZE_US) ---------------------------------
 * Within 20 ms of its last operation a worker sleeps in timed dozes and finds
 * new work itself: queueing onto it signals nobody. Its first nine dozes
 * after an operation last OFL_HOST_DOZE_US, each later one twice the one
 * before; a doze with more than OFL_HOST_DOZE_US left is signalled. Idle
 * past the window, it sleeps until signalled; a destroy ends a doze at
 * once. Polling with ofl_event_query (no wait, so no stealing) leaves every
 * copy to the worker. */

/* A strict host device at doze_us (no poll before a sleep), one stream,
 * an event and a device block of N bytes. */
typedef struct {
  ofl_device_t *d;
  ofl_stream_t *s;
  ofl_event_t *e;
  void *dv;
} doze_t;

static doze_t open_doze(const char *doze_us) {
  setenv("OFL_BACKEND", "host", 1);
  setenv("OFL_HOST_DOZE_US", doze_us, 1);
  setenv("OFL_HOST_SPIN_US", "0", 1); /* no poll: every idle is a sleep */
  ofl_config_reload();
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  p.strict = 1;
  doze_t z = {NULL, NULL, NULL, NULL};
  OK(ofl_device_open(&p, &z.d));
  unsetenv("OFL_HOST_DOZE_US");
  unsetenv("OFL_HOST_SPIN_US");
  ofl_config_reload();
  ofl_log_set_level(OFL_LOG_NONE);
  OK(ofl_stream_create(z.d, "d2h", &z.s));
  OK(ofl_event_create(z.d, &z.e));
  OK(ofl_device_malloc(z.d, N, &z.dv));
  return z;
}

/* The event and stream first (the destroy test times them), then the
 * block and the device. */
static void close_doze(doze_t *z) {
  if (z->e != NULL)
    ofl_event_destroy(z->e);
  if (z->s != NULL)
    OK(ofl_stream_destroy(z->s));
  OK(ofl_device_free(z->d, z->dv));
  ofl_device_close(z->d);
}

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Queues a copy of round's bytes from dv to out and polls until it is done
 * (10 s at most); checks every byte. Returns when it was queued. */
static uint64_t copy_and_poll(const doze_t *z, int round) {
  unsigned char src[N], out[N];
  fill(src, N, (unsigned)round);
  memset(out, 0, N);
  memcpy(z->dv, src, N); /* host backend: device memory is CPU memory */
  uint64_t queued = mono_ns();
  OK(ofl_memcpy_async(out, z->dv, N, OFL_COPY_D2H, z->s));
  OK(ofl_event_record(z->e, z->s));
  int polls = 0;
  while (ofl_event_query(z->e) != OFL_SUCCESS && polls++ < 100000)
    nanosleep(&(struct timespec){0, 100000}, NULL);
  cr_assert(eq(int, ofl_event_query(z->e), OFL_SUCCESS), "round %d never ran",
            round);
  cr_assert(eq(int, memcmp(out, src, N), 0), "round %d", round);
  return queued;
}

Test(host_doze, queueing_onto_a_dozing_worker_signals_nobody) {
  enum { ROUNDS = 40 };
  doze_t z = open_doze("2000"); /* 18 ms of 2 ms dozes */
  /* the first copy wakes the worker if it was asleep yet */
  uint64_t last = copy_and_poll(&z, 0);
  uint64_t first = ofl__host_stream_wakes(z.s);
  cr_assert(le(u64, first, 1));
  /* A copy queued within 16 ms of the previous one finds the worker in one
   * of its first nine dozes (they begin after that copy ran): none has more
   * than 2 ms left. A longer gap (this thread descheduled) may find it in a
   * longer doze or asleep: one signal allowed for each. */
  uint64_t late = 0;
  for (int r = 1; r <= ROUNDS; r++) {
    uint64_t q = copy_and_poll(&z, r);
    late += q - last >= 16000000ull;
    last = q;
  }
  cr_assert(le(u64, ofl__host_stream_wakes(z.s), first + late),
            "%llu signals for %d copies, %llu of them after a long gap",
            (unsigned long long)ofl__host_stream_wakes(z.s), ROUNDS,
            (unsigned long long)late);
  cr_assert(eq(u64, ofl__host_stream_stolen(z.s), 0));
  /* idle past the window: asleep, and the next copy signals it */
  nanosleep(&(struct timespec){0, 60000000}, NULL);
  uint64_t before = ofl__host_stream_wakes(z.s);
  copy_and_poll(&z, ROUNDS + 1);
  cr_assert(eq(u64, ofl__host_stream_wakes(z.s), before + 1));
  close_doze(&z);
}

Test(host_doze, without_dozes_every_copy_to_a_sleeping_worker_signals_it) {
  doze_t z = open_doze("0");
  copy_and_poll(&z, 0); /* wakes the worker if it was asleep yet */
  nanosleep(&(struct timespec){0, 5000000}, NULL);
  uint64_t first = ofl__host_stream_wakes(z.s);
  for (int r = 1; r <= 10; r++) {
    copy_and_poll(&z, r);
    /* long enough for the worker to be back asleep */
    nanosleep(&(struct timespec){0, 5000000}, NULL);
  }
  cr_assert(eq(u64, ofl__host_stream_wakes(z.s), first + 10));
  close_doze(&z);
}

Test(host_doze, destroy_ends_a_doze_at_once) {
  doze_t z = open_doze("1000000"); /* a one-second doze */
  copy_and_poll(&z, 1);            /* the worker dozes after it */
  nanosleep(&(struct timespec){0, 2000000}, NULL);
  uint64_t t0 = mono_ns();
  ofl_event_destroy(z.e);
  OK(ofl_stream_destroy(z.s));
  uint64_t took = mono_ns() - t0;
  cr_assert(lt(u64, took, 500000000ull), "destroy took %llu ms",
            (unsigned long long)(took / 1000000));
  z.e = NULL;
  z.s = NULL;
  close_doze(&z);
}

Test(host_doze, an_idle_worker_dozes_longer_and_a_long_doze_is_signalled) {
  doze_t z = open_doze("1000");
  /* no work yet: no doze */
  nanosleep(&(struct timespec){0, 5000000}, NULL);
  cr_assert(eq(u64, ofl__host_stream_dozes(z.s), 0));
  /* after a copy: nine dozes of 1 ms (9 ms), then 2, 4 and 8 ms; the one
   * that would begin past 20 ms is a sleep (a few more where a doze ends
   * early: valgrind). At 1 ms each it would be 20. */
  copy_and_poll(&z, 1);
  nanosleep(&(struct timespec){0, 60000000}, NULL);
  uint64_t n = ofl__host_stream_dozes(z.s);
  cr_assert(ge(u64, n, 1));
  cr_assert(le(u64, n, 15), "%llu dozes in 60 ms idle", (unsigned long long)n);
  /* Wait for the twelfth doze after a copy (8 ms, from about 15 ms) and
   * queue into it: more than 1 ms left, so the copy signals it. On a loaded
   * machine the dozes end late and fewer fit in the 20 ms window: once no
   * doze began for 30 ms the worker is asleep, and the copy signals it
   * too. */
  uint64_t base = ofl__host_stream_dozes(z.s); /* asleep: fixed */
  copy_and_poll(&z, 2);
  uint64_t seen = ofl__host_stream_dozes(z.s), since = mono_ns();
  while (seen < base + 12 && mono_ns() - since < 30000000ull) {
    nanosleep(&(struct timespec){0, 20000}, NULL);
    uint64_t now_dozes = ofl__host_stream_dozes(z.s);
    if (now_dozes != seen) {
      seen = now_dozes;
      since = mono_ns();
    }
  }
  uint64_t wakes = ofl__host_stream_wakes(z.s);
  copy_and_poll(&z, 3);
  cr_assert(eq(u64, ofl__host_stream_wakes(z.s), wakes + 1),
            "a copy into doze %llu after a copy did not signal",
            (unsigned long long)(seen - base));
  close_doze(&z);
}
