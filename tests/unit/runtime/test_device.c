/* The device layer on the backend under test (OFLTEST_BACKEND: host, or
 * cuda over a GPU or the cudasim stand-in): ordering, events, copies,
 * memory. Device bytes are only ever reached through copies. Tests named
 * host_only_ are about the host backend itself (its compute stream running
 * on the calling thread, its capacity, link model and trace file) and skip
 * on cuda. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "runtime/device_internal.h"
#include "runtime/internal.h"
#include "tests/support/devmem.h"

#define HOST_ONLY()                                                            \
  do {                                                                         \
    if (t_on_cuda())                                                           \
      cr_skip_test("host backend only");                                       \
  } while (0)

static ofl_device_t *dev;

static void open_dev(void) {
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_device_params_t p = t_device_params(100, 0);
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_device_backend(dev), t_backend()));
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(device, .init = open_dev, .fini = close_dev);

typedef struct {
  atomic_int n;
  int order[256];
} seq_t;
typedef struct {
  seq_t *seq;
  int value;
} step_t;

static void append(void *arg) {
  step_t *st = arg;
  int i = atomic_fetch_add(&st->seq->n, 1);
  st->seq->order[i] = st->value;
}

Test(device, operations_on_one_stream_run_in_fifo_order) {
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "worker", &s), OFL_SUCCESS));
  seq_t seq = {0};
  step_t steps[200];
  for (int i = 0; i < 200; i++) {
    steps[i] = (step_t){&seq, i};
    cr_assert(eq(int, ofl_stream_launch_host_func(s, append, &steps[i]),
                 OFL_SUCCESS));
  }
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&seq.n), 200));
  for (int i = 0; i < 200; i++)
    cr_assert(eq(int, seq.order[i], i));
  cr_assert(eq(int, ofl_stream_query(s), OFL_SUCCESS));
  ofl_stream_destroy(s);
}

Test(device, copy_waiting_on_event_sees_data_written_before_record) {
  ofl_stream_t *a = NULL, *b = NULL;
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "a", &a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "b", &b), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  const size_t n = 64 * 1024;
  void *d = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, n, &d), OFL_SUCCESS));
  unsigned char *h = malloc(n);
  for (int it = 0; it < 100; it++) {
    int value = (it * 37 + 1) & 0xff;
    cr_assert(eq(int, ofl_memset_async(d, value, n, a), OFL_SUCCESS));
    cr_assert(eq(int, ofl_event_record(ev, a), OFL_SUCCESS));
    cr_assert(eq(int, ofl_stream_wait_event(b, ev), OFL_SUCCESS));
    cr_assert(eq(int, ofl_memcpy_async(h, d, n, OFL_COPY_D2H, b), OFL_SUCCESS));
    cr_assert(eq(int, ofl_stream_synchronize(b, 10000), OFL_SUCCESS));
    size_t wrong = 0;
    for (size_t i = 0; i < n; i++)
      wrong += h[i] != value;
    cr_assert(eq(sz, wrong, 0), "iteration %d", it);
    cr_assert(eq(int, ofl_stream_synchronize(a, 10000), OFL_SUCCESS));
  }
  free(h);
  ofl_device_free(dev, d);
  ofl_event_destroy(ev);
  ofl_stream_destroy(a);
  ofl_stream_destroy(b);
}

static void wait_flag(void *arg) {
  atomic_int *flag = arg;
  while (!atomic_load(flag))
    usleep(1000);
}

Test(device, event_query_reports_not_ready_until_its_stream_reaches_it) {
  ofl_stream_t *s = NULL;
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "gate", &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_query(ev), OFL_SUCCESS), "never recorded");
  atomic_int flag = 0;
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, wait_flag, &flag), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_query(ev), OFL_ERR_NOT_READY));
  cr_assert(eq(int, ofl_stream_query(s), OFL_ERR_NOT_READY));
  cr_assert(eq(int, ofl_event_synchronize(ev, 30), OFL_ERR_TIMEOUT));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "not complete"), NULL));
  cr_assert(eq(int, ofl_stream_synchronize(s, 30), OFL_ERR_TIMEOUT));
  atomic_store(&flag, 1);
  cr_assert(eq(int, ofl_event_synchronize(ev, 10000), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_query(ev), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  ofl_event_destroy(ev);
  ofl_stream_destroy(s);
}

/* The host compute stream runs a wait on the calling thread, bounded by
 * OFL_WAIT_TIMEOUT_MS; on cuda the wait is queued on the device. */
Test(device, host_only_compute_stream_wait_times_out_instead_of_hanging) {
  HOST_ONLY();
  setenv("OFL_WAIT_TIMEOUT_MS", "50", 1);
  ofl_config_reload();
  ofl_stream_t *s = NULL;
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "stuck", &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  atomic_int flag = 0;
  ofl_stream_launch_host_func(s, wait_flag, &flag);
  ofl_event_record(ev, s);
  ofl_stream_t *compute = ofl_device_compute_stream(dev);
  cr_assert(eq(int, ofl_stream_wait_event(compute, ev), OFL_ERR_TIMEOUT));
  atomic_store(&flag, 1);
  setenv("OFL_WAIT_TIMEOUT_MS", "10000", 1);
  ofl_config_reload();
  cr_assert(eq(int, ofl_stream_wait_event(compute, ev), OFL_SUCCESS));
  ofl_event_destroy(ev);
  ofl_stream_destroy(s);
}

Test(device, host_only_compute_stream_runs_on_the_calling_thread) {
  HOST_ONLY();
  ofl_stream_t *c = ofl_device_compute_stream(dev);
  cr_assert(ne(ptr, c, NULL));
  seq_t seq = {0};
  step_t st = {&seq, 7};
  cr_assert(eq(int, ofl_stream_launch_host_func(c, append, &st), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&seq.n), 1), "ran before the call returned");
  cr_assert(eq(int, seq.order[0], 7));
}

/* The compute stream runs host functions in order (on the calling thread on
 * the host backend, asynchronously on cuda) and is looked up per thread at
 * each call. */
Test(device, compute_stream_runs_host_functions_and_can_be_overridden) {
  ofl_stream_t *c = ofl_device_compute_stream(dev);
  cr_assert(ne(ptr, c, NULL));
  seq_t seq = {0};
  step_t st[3] = {{&seq, 7}, {&seq, 8}, {&seq, 9}};
  for (int i = 0; i < 3; i++)
    cr_assert(
        eq(int, ofl_stream_launch_host_func(c, append, &st[i]), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(c, 10000), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&seq.n), 3));
  for (int i = 0; i < 3; i++)
    cr_assert(eq(int, seq.order[i], 7 + i));
  ofl_stream_t *other = NULL;
  ofl_stream_create(dev, "other", &other);
  ofl_device_set_compute_stream(dev, other);
  cr_assert(eq(ptr, ofl_device_compute_stream(dev), other));
  ofl_device_set_compute_stream(dev, NULL);
  cr_assert(eq(ptr, ofl_device_compute_stream(dev), c));
  ofl_stream_destroy(other);
}

static void fill_pattern(unsigned char *p, size_t n, unsigned seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = (unsigned char)x;
  }
}

Test(device, copies_are_byte_exact_for_all_kinds_sizes_and_alignments) {
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "copy", &s), OFL_SUCCESS));
  const size_t sizes[] = {
      1, 3, 7, 4095, 4097, 65536 + 13, 1u << 20, (16u << 20) + 5, 64u << 20};
  const size_t offs[] = {0, 1, 3, 7};
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    size_t n = sizes[si];
    size_t o = offs[si % 4];
    unsigned char *src = malloc(n + 8), *back = malloc(n + 8), *pin = NULL;
    void *d1 = NULL, *d2 = NULL;
    cr_assert(eq(int, ofl_device_malloc(dev, n + 8, &d1), OFL_SUCCESS));
    cr_assert(eq(int, ofl_device_malloc(dev, n + 8, &d2), OFL_SUCCESS));
    cr_assert(
        eq(int, ofl_pinned_malloc(dev, n + 8, (void **)&pin), OFL_SUCCESS));
    fill_pattern(src + o, n, (unsigned)si);
    memset(back, 0, n + 8);
    char *dd1 = (char *)d1 + (o + 1) % 8, *dd2 = (char *)d2 + (o + 2) % 8;
    cr_assert(eq(int, ofl_memcpy_async(dd1, src + o, n, OFL_COPY_H2D, s),
                 OFL_SUCCESS));
    cr_assert(
        eq(int, ofl_memcpy_async(dd2, dd1, n, OFL_COPY_D2D, s), OFL_SUCCESS));
    cr_assert(eq(int, ofl_memcpy_async(pin + o, dd2, n, OFL_COPY_D2H, s),
                 OFL_SUCCESS));
    cr_assert(eq(int,
                 ofl_memcpy_async(back + 8 - o, pin + o, n, OFL_COPY_H2H, s),
                 OFL_SUCCESS));
    cr_assert(eq(int, ofl_stream_synchronize(s, 60000), OFL_SUCCESS));
    cr_assert(eq(int, memcmp(back + 8 - o, src + o, n), 0),
              "size %zu offset %zu", n, o);
    free(src);
    free(back);
    cr_assert(eq(int, ofl_device_free(dev, d1), OFL_SUCCESS));
    cr_assert(eq(int, ofl_device_free(dev, d2), OFL_SUCCESS));
    cr_assert(eq(int, ofl_pinned_free(dev, pin), OFL_SUCCESS));
  }
  ofl_device_stats_t stats;
  ofl_device_get_stats(dev, &stats);
  cr_assert(eq(u64, stats.device_allocs, 18));
  cr_assert(eq(u64, stats.device_frees, 18));
  cr_assert(eq(sz, stats.device_bytes_in_use, 0));
  cr_assert(eq(u64, stats.copies, 36));
  ofl_stream_destroy(s);
}

Test(device, host_only_capacity_exhaustion_returns_no_memory_and_peak_is_tracked) {
  HOST_ONLY(); /* OFL_DEVICE_CAPACITY is the host backend's */
  ofl_device_t *small = NULL;
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  p.device_capacity_bytes = 1u << 20;
  cr_assert(eq(int, ofl_device_open(&p, &small), OFL_SUCCESS));
  void *a = NULL, *b = NULL, *c = (void *)0x1;
  cr_assert(eq(int, ofl_device_malloc(small, 600 * 1024, &a), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_device_malloc(small, 600 * 1024, &c), OFL_ERR_NO_MEMORY));
  cr_assert(eq(ptr, c, (void *)0x1), "output untouched on failure");
  cr_assert(ne(ptr, strstr(ofl_last_error(), "OFL_DEVICE_CAPACITY"), NULL));
  cr_assert(eq(int, ofl_device_malloc(small, 400 * 1024, &b), OFL_SUCCESS));
  ofl_device_stats_t st;
  ofl_device_get_stats(small, &st);
  cr_assert(eq(sz, st.device_bytes_in_use, 1000 * 1024));
  cr_assert(eq(sz, st.device_bytes_peak, 1000 * 1024));
  ofl_device_free(small, a);
  ofl_device_get_stats(small, &st);
  cr_assert(eq(sz, st.device_bytes_in_use, 400 * 1024));
  cr_assert(eq(sz, st.device_bytes_peak, 1000 * 1024));
  ofl_device_reset_peak(small);
  ofl_device_get_stats(small, &st);
  cr_assert(eq(sz, st.device_bytes_peak, 400 * 1024));
  ofl_device_free(small, b);
  ofl_device_close(small);
}

Test(device, host_only_link_model_paces_copies_to_the_configured_rate) {
  HOST_ONLY();
  ofl_device_t *slow = NULL;
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  p.link_h2d_gbps = 0.5; /* 8 MiB take >= 16.7 ms */
  cr_assert(eq(int, ofl_device_open(&p, &slow), OFL_SUCCESS));
  ofl_stream_t *s = NULL;
  ofl_stream_create(slow, "h2d", &s);
  size_t n = 8u << 20;
  void *d = NULL;
  unsigned char *h = malloc(n);
  fill_pattern(h, n, 9);
  ofl_device_malloc(slow, n, &d);
  uint64_t t0 = ofl__now_ns();
  ofl_memcpy_async(d, h, n, OFL_COPY_H2D, s);
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  double ms = (double)(ofl__now_ns() - t0) / 1e6;
  cr_assert(ge(dbl, ms, 0.95 * (double)n / 0.5e9 * 1e3), "took %.2f ms", ms);
  unsigned char *back = malloc(n);
  ofl_memcpy_async(back, d, n, OFL_COPY_D2H, s);
  ofl_stream_synchronize(s, 10000);
  cr_assert(eq(int, memcmp(back, h, n), 0));
  free(back);
  free(h);
  ofl_device_free(slow, d);
  ofl_stream_destroy(s);
  ofl_device_close(slow);
}

/* The trace file is written by the host backend (cuda ranges go to NVTX). */
Test(device, host_only_trace_file_has_a_track_per_stream_and_copies_with_bytes) {
  HOST_ONLY();
  char path[] = "/tmp/ofl-trace-XXXXXX";
  int fd = mkstemp(path);
  close(fd);
  setenv("OFL_TRACE_FILE", path, 1);
  ofl_config_reload();
  ofl_device_t *t = NULL;
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  cr_assert(eq(int, ofl_device_open(&p, &t), OFL_SUCCESS));
  ofl_stream_t *s = NULL;
  ofl_stream_create(t, "d2h", &s);
  void *d = NULL;
  char h[4096];
  ofl_device_malloc(t, sizeof h, &d);
  ofl_memcpy_async(h, d, sizeof h, OFL_COPY_D2H, s);
  ofl_range_push(t, "offload group core_attn");
  ofl_range_pop(t);
  ofl_stream_synchronize(s, 10000);
  ofl_device_free(t, d);
  ofl_stream_destroy(s);
  ofl_device_close(t);
  unsetenv("OFL_TRACE_FILE");
  ofl_config_reload();
  FILE *f = fopen(path, "r");
  cr_assert(ne(ptr, f, NULL));
  char buf[8192] = {0};
  size_t got = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  cr_assert(gt(sz, got, 0));
  cr_assert(ne(ptr, strstr(buf, "\"traceEvents\""), NULL));
  cr_assert(ne(ptr, strstr(buf, "{\"name\":\"d2h\"}"), NULL));
  cr_assert(ne(ptr, strstr(buf, "\"bytes\":4096"), NULL));
  cr_assert(ne(ptr, strstr(buf, "offload group core_attn"), NULL));
}

/* Trace names: escaped, valid UTF-8, never cut inside a character. */
Test(device, trace_names_are_escaped_and_cut_on_character_boundaries) {
  static const struct {
    const char *in;
    size_t cap;
    const char *out;
  } cases[] = {
      {"plain", 48, "plain"},
      {"a\"b\\c", 48, "a\\\"b\\\\c"},
      {"tab\there", 48, "tab\\u0009here"},
      /* é is 2 bytes, 漢 3, 😀 4: each fits whole or not at all */
      {"x\xc3\xa9", 4, "x\xc3\xa9"},
      {"xy\xc3\xa9", 4, "xy"},
      {"\xe6\xbc\xa2\xe6\xbc\xa2", 6, "\xe6\xbc\xa2"},
      {"\xf0\x9f\x98\x80", 4, ""},
      {"\xf0\x9f\x98\x80", 5, "\xf0\x9f\x98\x80"},
      /* an escape is not cut either */
      {"ab\"", 4, "ab"},
      /* not UTF-8: a stray continuation byte, a cut sequence, an
       * overlong '/', a surrogate, a byte above U+10FFFF */
      {"a\x80z", 48, "a\xef\xbf\xbdz"},
      {"a\xe6\xbc", 48, "a\xef\xbf\xbd\xef\xbf\xbd"},
      {"\xc0\xaf", 48, "\xef\xbf\xbd\xef\xbf\xbd"},
      {"\xed\xa0\x80", 48, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
      {"\xf4\x90\x80\x80", 48,
       "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char out[64];
    memset(out, 'Z', sizeof out);
    ofl__trace_json_escape(out, cases[i].cap, cases[i].in);
    cr_expect(eq(str, out, (char *)cases[i].out), "case %zu", i);
    cr_expect(lt(sz, strlen(out), cases[i].cap), "case %zu", i);
  }
}

/* A range name longer than the range stack keeps (47 bytes), where byte 47
 * falls inside a 3-byte character, reaches the trace cut before that
 * character. */
Test(device, host_only_long_utf8_range_name_stays_valid_utf8_in_the_trace) {
  HOST_ONLY();
  char path[] = "/tmp/ofl-trace-XXXXXX";
  int fd = mkstemp(path);
  close(fd);
  setenv("OFL_TRACE_FILE", path, 1);
  ofl_config_reload();
  ofl_device_t *t = NULL;
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  cr_assert(eq(int, ofl_device_open(&p, &t), OFL_SUCCESS));
  /* "g" then 20 x U+6F22: byte 47 falls inside the 16th character */
  char name[64] = "g";
  for (int i = 0; i < 20; i++)
    strcat(name, "\xe6\xbc\xa2");
  ofl_range_push(t, name);
  ofl_range_pop(t);
  ofl_device_close(t);
  unsetenv("OFL_TRACE_FILE");
  ofl_config_reload();
  FILE *f = fopen(path, "r");
  cr_assert(ne(ptr, f, NULL));
  char buf[8192] = {0};
  size_t got = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  cr_assert(gt(sz, got, 0));
  /* 15 whole characters, then the closing quote */
  char want[80] = "\"g";
  for (int i = 0; i < 15; i++)
    strcat(want, "\xe6\xbc\xa2");
  strcat(want, "\"");
  cr_expect(ne(ptr, strstr(buf, want), NULL), "trace: %s", buf);
  cr_expect(eq(ptr, strstr(buf, "\xef\xbf\xbd"), NULL));
}

/* Compute-stream overrides: a thread's override never outlives its stream
 * or its device, even when another thread destroys or closes them. */
typedef struct {
  ofl_device_t *dev;
  ofl_stream_t *set;
  pthread_barrier_t *bar;
  ofl_stream_t *seen[2];
} override_arg_t;

static void *override_thread(void *p) {
  override_arg_t *a = p;
  ofl_device_set_compute_stream(a->dev, a->set);
  a->seen[0] = ofl_device_compute_stream(a->dev);
  pthread_barrier_wait(a->bar); /* main destroys the stream */
  pthread_barrier_wait(a->bar);
  a->seen[1] = ofl_device_compute_stream(a->dev);
  return NULL;
}

Test(device, override_of_a_stream_destroyed_by_another_thread_is_dropped) {
  ofl_stream_t *mine = NULL, *other = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "mine", &mine), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "other", &other), OFL_SUCCESS));
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, 2);
  override_arg_t a = {.dev = dev, .set = mine, .bar = &bar};
  pthread_t th;
  cr_assert(eq(int, pthread_create(&th, NULL, override_thread, &a), 0));
  pthread_barrier_wait(&bar);
  /* this thread has no override */
  ofl_stream_t *dflt = ofl_device_compute_stream(dev);
  cr_expect(ne(ptr, dflt, mine));
  ofl_stream_destroy(mine);
  /* a stream created now may get the freed one's address */
  ofl_stream_t *again = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "again", &again), OFL_SUCCESS));
  pthread_barrier_wait(&bar);
  pthread_join(th, NULL);
  pthread_barrier_destroy(&bar);
  cr_expect(eq(ptr, a.seen[0], mine));
  cr_expect(eq(ptr, a.seen[1], dflt));
  ofl_stream_destroy(again);
  ofl_stream_destroy(other);
}

Test(device, override_survives_the_destruction_of_another_stream) {
  ofl_stream_t *mine = NULL, *other = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "mine", &mine), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "other", &other), OFL_SUCCESS));
  ofl_device_set_compute_stream(dev, mine);
  ofl_stream_destroy(other);
  cr_expect(eq(ptr, ofl_device_compute_stream(dev), mine));
  ofl_device_set_compute_stream(dev, NULL);
  ofl_stream_t *dflt = ofl_device_compute_stream(dev);
  cr_expect(ne(ptr, dflt, mine));
  ofl_stream_destroy(mine);
}

Test(device, override_with_a_stream_of_another_device_is_refused) {
  ofl_device_params_t p = t_device_params(-1, 0);
  ofl_device_t *d2 = NULL;
  cr_assert(eq(int, ofl_device_open(&p, &d2), OFL_SUCCESS));
  ofl_stream_t *foreign = NULL;
  cr_assert(eq(int, ofl_stream_create(d2, "foreign", &foreign), OFL_SUCCESS));
  ofl_stream_t *dflt = ofl_device_compute_stream(dev);
  ofl_device_set_compute_stream(dev, foreign);
  cr_expect(eq(ptr, ofl_device_compute_stream(dev), dflt));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "another device"), NULL));
  ofl_stream_destroy(foreign);
  ofl_device_close(d2);
}

/* Frees of pointers that are not live blocks of the right kind are refused
 * before they reach the allocator, on every backend. */
Test(device, foreign_and_double_frees_are_rejected) {
  void *d = NULL, *pin = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, 128, &d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_malloc(dev, 128, &pin), OFL_SUCCESS));
  char host[128];
  cr_assert(eq(int, ofl_device_free(dev, host), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_device_free(dev, pin), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pinned_free(dev, d), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pinned_free(dev, host), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_device_malloc(dev, 0, &d), OFL_ERR_INVALID_ARG));
  /* Still live after the refusals: the bytes round-trip. */
  cr_assert(eq(int, t_fill(dev, d, 128, 77), OFL_SUCCESS));
  cr_assert(eq(sz, t_wrong(dev, d, 128, 77), 0));
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pinned_free(dev, pin), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_free(dev, pin), OFL_ERR_INVALID_ARG));
  ofl_device_stats_t st;
  ofl_device_get_stats(dev, &st);
  cr_assert(eq(u64, st.device_frees, 1));
  cr_assert(eq(u64, st.pinned_frees, 1));
}
