/* ofl: the host backend. "Device" memory is CPU memory counted against a
 * capacity; the compute stream executes each operation on the calling thread
 * when it is enqueued; every other stream is a worker thread with a FIFO.
 * Strict mode poisons memory, adds seeded jitter before each worker operation
 * and reports frees of blocks that queued operations still use. */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/backend.h"

#define DEVICE_ALIGN 256
#define PINNED_ALIGN 4096
#define LINK_SLICE (1u << 20)
#define WAIT_SLICE_NS 20000000ull /* a waiting worker checks for stop */
#define DOZE_WINDOW_NS 20000000ull /* worker_main: dozes this long at most */
#define DOZES_BEFORE_BACKOFF 9     /* worker_main: dozes of OFL_HOST_DOZE_US */

/* The condition variables here time their waits on CLOCK_MONOTONIC, the
 * clock of ofl__now_ns and of every deadline: a wall-clock step (NTP, a
 * resumed virtual machine) must not stretch a wait (a doze that nobody
 * signals, POSIX pthread_condattr_setclock). */
static void cond_init(pthread_cond_t *cv) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &a);
  pthread_condattr_destroy(&a);
}

/* One slice of a bounded wait on cv (mu held; cv made by cond_init): until
 * deadline_ns or WAIT_SLICE_NS from now, whichever is first, so that
 * callers re-check their condition, the deadline and stop flags in
 * slices. */
static void cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu,
                            uint64_t now_ns, uint64_t deadline_ns) {
  uint64_t slice = deadline_ns > now_ns ? deadline_ns - now_ns : 0;
  if (slice > WAIT_SLICE_NS)
    slice = WAIT_SLICE_NS;
  uint64_t until = ofl__now_ns() + slice;
  struct timespec ts = {(time_t)(until / 1000000000ull),
                        (long)(until % 1000000000ull)};
  pthread_cond_timedwait(cv, mu, &ts);
}

/* ---- memory blocks ------------------------------------------------------ */

typedef struct hblock {
  char *base;
  size_t bytes;
  bool pinned;
  /* Queued or running operations that use the block: raised under
   * reg_lock (so the block cannot leave the registry meanwhile), lowered
   * without it when an operation finishes. */
  _Atomic size_t inflight;
} hblock_t;

typedef struct host_dev {
  pthread_mutex_t reg_lock;
  pthread_cond_t reg_cond; /* an inflight count reached 0 */
  atomic_int free_waiters; /* frees waiting on reg_cond */
  hblock_t **blocks;       /* sorted by base */
  size_t nblocks, cap;
  atomic_int active_dir[2]; /* link model: copies running per direction */
  /* ofl_device_adopt_host_memory: memory outside every block is device
   * memory too (the application's, never freed by ofl). */
  atomic_bool adopt;
  /* Device bytes allocated or being allocated: the capacity check and this
   * count are one atomic step, so concurrent allocations cannot together
   * pass the capacity. */
  _Atomic size_t device_reserved;
} host_dev_t;

static host_dev_t *HD(ofl_device_t *dev) { return dev->impl; }

/* The block containing p, or NULL. Caller holds reg_lock. */
static hblock_t *find_block(host_dev_t *h, const void *p) {
  const char *c = p;
  size_t lo = 0, hi = h->nblocks;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (h->blocks[mid]->base <= c)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return NULL;
  hblock_t *b = h->blocks[lo - 1];
  return c < b->base + b->bytes ? b : NULL;
}

static ofl_status_t insert_block(host_dev_t *h, hblock_t *b) {
  pthread_mutex_lock(&h->reg_lock);
  if (h->nblocks == h->cap) {
    size_t ncap = h->cap ? h->cap * 2 : 64;
    hblock_t **nb = realloc(h->blocks, ncap * sizeof *nb);
    if (nb == NULL) {
      pthread_mutex_unlock(&h->reg_lock);
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                        "cannot grow the host backend block registry");
    }
    h->blocks = nb;
    h->cap = ncap;
  }
  size_t i = h->nblocks;
  while (i > 0 && h->blocks[i - 1]->base > b->base) {
    h->blocks[i] = h->blocks[i - 1];
    i--;
  }
  h->blocks[i] = b;
  h->nblocks++;
  pthread_mutex_unlock(&h->reg_lock);
  return OFL_SUCCESS;
}

static void remove_block_locked(host_dev_t *h, hblock_t *b) {
  for (size_t i = 0; i < h->nblocks; i++)
    if (h->blocks[i] == b) {
      memmove(&h->blocks[i], &h->blocks[i + 1],
              (h->nblocks - i - 1) * sizeof *h->blocks);
      h->nblocks--;
      return;
    }
}

static ofl_status_t block_alloc(ofl_device_t *dev, size_t bytes, bool pinned,
                                void **out) {
  host_dev_t *h = HD(dev);
  if (!pinned) {
    size_t cap = dev->cfg.capacity_bytes;
    size_t used = atomic_load(&h->device_reserved);
    do {
      if (cap != 0 && (used > cap || bytes > cap - used))
        return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                          "device memory exhausted: %zu bytes requested, %zu "
                          "of %zu in use; offload more or raise "
                          "OFL_DEVICE_CAPACITY",
                          bytes, used, cap);
    } while (!atomic_compare_exchange_weak(&h->device_reserved, &used,
                                           used + bytes));
  }
  hblock_t *b = calloc(1, sizeof *b);
  void *mem = NULL;
  size_t align = pinned ? PINNED_ALIGN : DEVICE_ALIGN;
  size_t rounded = (bytes + align - 1) / align * align;
  if (b == NULL || posix_memalign(&mem, align, rounded) != 0) {
    free(b);
    if (!pinned)
      atomic_fetch_sub(&h->device_reserved, bytes);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "host backend cannot allocate %zu bytes of %s memory",
                      bytes, pinned ? "pinned" : "device");
  }
  b->base = mem;
  b->bytes = bytes;
  b->pinned = pinned;
  if (dev->cfg.strict)
    memset(mem, OFL__POISON_BYTE, rounded); /* uninitialised reads show */
  ofl_status_t st = insert_block(h, b);
  if (st != OFL_SUCCESS) {
    free(mem);
    free(b);
    if (!pinned)
      atomic_fetch_sub(&h->device_reserved, bytes);
    return st;
  }
  *out = mem;
  return OFL_SUCCESS;
}

static ofl_status_t block_free(ofl_device_t *dev, void *ptr, bool pinned,
                               size_t *bytes) {
  host_dev_t *h = HD(dev);
  const char *what = pinned ? "pinned" : "device";
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, ptr);
  if (b == NULL || b->base != (char *)ptr || b->pinned != pinned) {
    pthread_mutex_unlock(&h->reg_lock);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "%p is not the start of a %s block of this device "
                      "(freed twice, foreign, or freed with the wrong "
                      "function)",
                      ptr, what);
  }
  size_t n = atomic_load(&b->inflight);
  if (n > 0 && dev->cfg.strict) {
    pthread_mutex_unlock(&h->reg_lock);
    pthread_mutex_lock(&dev->stats_lock);
    dev->stats.strict_violations++;
    pthread_mutex_unlock(&dev->stats_lock);
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_DEVICE,
                      "%s block %p (%zu bytes) freed while %zu queued "
                      "operation(s) still use it; synchronize the stream or "
                      "wait on an event recorded after them first",
                      what, ptr, b->bytes, n);
  }
  /* Outside strict mode a free waits for the queued users, as cudaFree
   * synchronizes the device. */
  uint64_t deadline = n > 0 ? ofl__deadline_ns(-1) : 0;
  /* Announced before the count is read again: an op that lowers it to 0
   * then sees the waiter and wakes it (both sequentially consistent). */
  atomic_fetch_add(&h->free_waiters, 1);
  while (atomic_load(&b->inflight) > 0) {
    uint64_t now = ofl__now_ns();
    if (now > deadline) {
      atomic_fetch_sub(&h->free_waiters, 1);
      pthread_mutex_unlock(&h->reg_lock);
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                        "%s block %p: queued operations did not finish "
                        "before OFL_WAIT_TIMEOUT_MS; not freed",
                        what, ptr);
    }
    cond_wait_until(&h->reg_cond, &h->reg_lock, now, deadline);
  }
  atomic_fetch_sub(&h->free_waiters, 1);
  remove_block_locked(h, b);
  pthread_mutex_unlock(&h->reg_lock);
  if (dev->cfg.strict)
    memset(b->base, OFL__POISON_BYTE, b->bytes);
  *bytes = b->bytes;
  if (!pinned)
    atomic_fetch_sub(&h->device_reserved, b->bytes);
  free(b->base);
  free(b);
  return OFL_SUCCESS;
}

static ofl_status_t host_device_malloc(ofl_device_t *dev, size_t bytes,
                                       void **out) {
  return block_alloc(dev, bytes, false, out);
}
static ofl_status_t host_device_free(ofl_device_t *dev, void *ptr,
                                     size_t *bytes) {
  return block_free(dev, ptr, false, bytes);
}
static ofl_status_t host_pinned_malloc(ofl_device_t *dev, size_t bytes,
                                       void **out) {
  return block_alloc(dev, bytes, true, out);
}
static ofl_status_t host_pinned_free(ofl_device_t *dev, void *ptr,
                                     size_t *bytes) {
  return block_free(dev, ptr, true, bytes);
}

static size_t ops_touching(ofl_device_t *dev, const char *lo, size_t bytes);

static size_t host_inflight(ofl_device_t *dev, const void *ptr, size_t bytes) {
  host_dev_t *h = HD(dev);
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, ptr);
  size_t n = b ? atomic_load(&b->inflight) : 0;
  bool whole = b != NULL && b->base == (const char *)ptr && bytes >= b->bytes;
  pthread_mutex_unlock(&h->reg_lock);
  /* Part of a block (a pool's reserve carved into blocks): the block's
   * count covers every part, so look at the queued ranges themselves. */
  if (n > 0 && !whole)
    n = ops_touching(dev, ptr, bytes);
  return n;
}

static bool host_device_owns(ofl_device_t *dev, const void *ptr,
                             size_t bytes) {
  host_dev_t *h = HD(dev);
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, ptr);
  bool own = b != NULL && !b->pinned &&
             bytes <= (size_t)(b->base + b->bytes - (const char *)ptr);
  if (b == NULL && atomic_load(&h->adopt))
    own = true; /* the application's memory, adopted */
  pthread_mutex_unlock(&h->reg_lock);
  return own;
}

static void host_adopt_host_memory(ofl_device_t *dev, bool on) {
  atomic_store(&HD(dev)->adopt, on);
}

/* ---- events ------------------------------------------------------------- */

typedef struct host_event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  /* Both written under mu; atomic so that query and the wait fast paths
   * read them without it. */
  _Atomic uint64_t recorded;  /* records enqueued */
  _Atomic uint64_t completed; /* every record <= completed reached */
  /* Records > completed + 1 reached out of order, sorted. Room for every
   * record in flight is made when it is recorded, so completing one never
   * allocates. */
  uint64_t *ahead;
  size_t n_ahead, cap_ahead;
  atomic_size_t n_ahead_seen; /* n_ahead, stored after completed */
  int sleepers;               /* threads in a wait on cv (mu held) */
  /* The handle and every queued record or wait that names the event: as
   * with cudaEventDestroy, the event may be destroyed while they are still
   * queued, and is freed when the last of them has run. */
  atomic_int refs;
  /* The worker stream of the latest record (a reference on it; NULL when
   * it was on the compute stream): where a waiter can take the operations
   * the record waits for (mu). */
  struct host_stream *last_stream;
  /* Timing events (ofl__event_create_timed): when the latest record
   * completed, on the CPU clock (the host backend's device clock), and which
   * record that was (mu). */
  bool timed;
  uint64_t done_target, done_ns;
} host_event_t;

static void stream_unref(struct host_stream *hs);

static ofl_status_t host_event_create(ofl_event_t *e) {
  host_event_t *he = calloc(1, sizeof *he);
  if (he == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate an event");
  pthread_mutex_init(&he->mu, NULL);
  cond_init(&he->cv);
  atomic_init(&he->recorded, 0);
  atomic_init(&he->completed, 0);
  atomic_init(&he->refs, 1);
  e->impl = he;
  return OFL_SUCCESS;
}

static void event_unref(host_event_t *he) {
  if (atomic_fetch_sub(&he->refs, 1) != 1)
    return;
  if (he->last_stream != NULL)
    stream_unref(he->last_stream);
  pthread_mutex_destroy(&he->mu);
  pthread_cond_destroy(&he->cv);
  free(he->ahead);
  free(he);
}

static void host_event_destroy(ofl_event_t *e) { event_unref(e->impl); }

static uint64_t ev_completed(const host_event_t *he) {
  return atomic_load_explicit(&he->completed, memory_order_acquire);
}

/* Index of the first entry of he->ahead >= target (mu held). */
static size_t ahead_lower(const host_event_t *he, uint64_t target) {
  size_t lo = 0, hi = he->n_ahead;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (he->ahead[mid] < target)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Record `target` reached (mu held). */
static bool event_reached(const host_event_t *he, uint64_t target) {
  if (target <= ev_completed(he))
    return true;
  size_t i = ahead_lower(he, target);
  return i < he->n_ahead && he->ahead[i] == target;
}

/* Record `target` reached; without mu unless records completed out of
 * order (one event recorded on several streams). */
static bool event_reached_now(host_event_t *he, uint64_t target) {
  if (target <= ev_completed(he))
    return true;
  /* No record ahead: reached iff within the prefix. completed is stored
   * before n_ahead_seen, so an empty list seen here comes with a prefix
   * that covers every record it held. */
  if (atomic_load(&he->n_ahead_seen) == 0)
    return target <= atomic_load(&he->completed);
  pthread_mutex_lock(&he->mu);
  bool done = event_reached(he, target);
  pthread_mutex_unlock(&he->mu);
  return done;
}

/* Records on different streams can complete out of order; a wait captured
 * on an older record must not be released by newer ones (re-recorded on a
 * faster stream, however many), so completion advances only over a
 * contiguous prefix. Called with mu held; true when a thread sleeps on cv
 * (the caller wakes it after unlocking, so it does not wake into a held
 * lock). */
static bool event_complete_locked(host_event_t *he, uint64_t target) {
  if (he->timed && target == atomic_load_explicit(&he->recorded,
                                                  memory_order_relaxed)) {
    he->done_target = target;
    he->done_ns = ofl__now_ns();
  }
  uint64_t c = atomic_load_explicit(&he->completed, memory_order_relaxed);
  if (target == c + 1) {
    c++;
    size_t k = 0;
    while (k < he->n_ahead && he->ahead[k] == c + 1) {
      c++;
      k++;
    }
    if (k > 0) {
      memmove(he->ahead, he->ahead + k, (he->n_ahead - k) * sizeof *he->ahead);
      he->n_ahead -= k;
    }
    /* A reader that sees the count sees the op's writes. */
    atomic_store(&he->completed, c);
    atomic_store(&he->n_ahead_seen, he->n_ahead);
  } else if (target > c && !event_reached(he, target)) {
    /* Room was made at record time (event_make_room). */
    size_t i = ahead_lower(he, target);
    memmove(he->ahead + i + 1, he->ahead + i,
            (he->n_ahead - i) * sizeof *he->ahead);
    he->ahead[i] = target;
    he->n_ahead++;
    atomic_store(&he->n_ahead_seen, he->n_ahead);
  }
  return he->sleepers > 0;
}

/* Makes room in he->ahead for every record in flight plus one more (mu
 * held); false when out of memory. */
static bool event_make_room(host_event_t *he) {
  uint64_t inflight =
      atomic_load_explicit(&he->recorded, memory_order_relaxed) + 1 -
      ev_completed(he);
  if (inflight <= he->cap_ahead)
    return true;
  size_t cap = he->cap_ahead ? he->cap_ahead * 2 : 16;
  while (cap < inflight)
    cap *= 2;
  uint64_t *a = realloc(he->ahead, cap * sizeof *a);
  if (a == NULL)
    return false;
  he->ahead = a;
  he->cap_ahead = cap;
  return true;
}

static void steal(struct host_stream *hs, host_event_t *he, uint64_t target,
                  uint64_t deadline, int depth);
static struct host_stream *record_stream(host_event_t *he, uint64_t target);

/* Waits until record `target` completed; false on timeout or stop. The
 * deadline (timeout_ms < 0: OFL_WAIT_TIMEOUT_MS) is resolved only when the
 * record is not complete yet. Polls for up to spin_ns before sleeping:
 * a copy of a small tensor completes in less than a futex round trip. A
 * waiter that is not a worker names the stream of the record (from, else
 * NULL) and runs the operations the record waits for itself while that
 * stream's worker has not started them (steal): the waiter does not pay the
 * worker's wake-up. */
static bool event_wait_target(host_event_t *he, uint64_t target,
                              int64_t timeout_ms, uint64_t spin_ns,
                              const atomic_bool *stop,
                              struct host_stream *from) {
  if (event_reached_now(he, target))
    return true;
  uint64_t deadline = ofl__deadline_ns(timeout_ms);
  if (from != NULL) {
    steal(from, he, target, deadline, 0);
    if (event_reached_now(he, target))
      return true;
  }
  if (spin_ns > 0) {
    uint64_t until = ofl__now_ns() + spin_ns;
    while (!event_reached_now(he, target) &&
           (stop == NULL || !atomic_load(stop)) && ofl__now_ns() < until) {
      if (from != NULL)
        steal(from, he, target, deadline, 0);
      sched_yield();
    }
  }
  pthread_mutex_lock(&he->mu);
  while (!event_reached(he, target)) {
    uint64_t now = ofl__now_ns();
    if (now >= deadline || (stop != NULL && atomic_load(stop))) {
      pthread_mutex_unlock(&he->mu);
      return false;
    }
    he->sleepers++;
    cond_wait_until(&he->cv, &he->mu, now, deadline);
    he->sleepers--;
  }
  pthread_mutex_unlock(&he->mu);
  return true;
}

static uint64_t ev_recorded(const host_event_t *he) {
  return atomic_load_explicit(&he->recorded, memory_order_acquire);
}

static ofl_status_t host_event_create_timed(ofl_event_t *e) {
  OFL_CHECK(host_event_create(e));
  ((host_event_t *)e->impl)->timed = true;
  return OFL_SUCCESS;
}

/* When e's latest record completed; false while it has not (or e is not
 * a timing event, or was never recorded). */
static bool event_done_ns(host_event_t *he, uint64_t *ns) {
  pthread_mutex_lock(&he->mu);
  uint64_t rec = ev_recorded(he);
  bool done = he->timed && rec > 0 && he->done_target == rec;
  *ns = he->done_ns;
  pthread_mutex_unlock(&he->mu);
  return done;
}

/* As cudaEventElapsedTime: both events' latest records completed (else
 * OFL_ERR_NOT_READY); a b that completed before a gives 0. */
static ofl_status_t host_event_elapsed_ns(ofl_event_t *a, ofl_event_t *b,
                                          uint64_t *ns) {
  uint64_t ta, tb;
  if (!event_done_ns(a->impl, &ta) || !event_done_ns(b->impl, &tb))
    return OFL_ERR_NOT_READY;
  *ns = tb > ta ? tb - ta : 0;
  return OFL_SUCCESS;
}

static ofl_status_t host_event_query(ofl_event_t *e) {
  host_event_t *he = e->impl;
  return event_reached_now(he, ev_recorded(he)) ? OFL_SUCCESS
                                                : OFL_ERR_NOT_READY;
}

static uint64_t spin_ns_of(const ofl_device_t *dev) {
  return (uint64_t)dev->cfg.spin_us * 1000u;
}

static uint64_t doze_ns_of(const ofl_device_t *dev) {
  return (uint64_t)dev->cfg.doze_us * 1000u;
}

/* ---- streams ------------------------------------------------------------ */

typedef enum { OP_COPY, OP_MEMSET, OP_RECORD, OP_WAIT, OP_HOSTFN } op_type_t;

typedef struct op {
  op_type_t type;
  ofl_copy_kind_t kind;
  void *dst;
  const void *src;
  size_t bytes;
  int value;
  host_event_t *ev;
  uint64_t target;
  ofl_host_fn fn;
  void *arg;
  bool any_thread; /* OP_HOSTFN: may run on a waiter or the submitter */
  hblock_t *blk[2]; /* blocks whose inflight count this op holds */
  struct op *next;
} op_t;

typedef struct host_stream {
  ofl_stream_t *s;
  pthread_t thread;
  pthread_mutex_t mu;
  /* worker_cv: the worker's sleep (only the worker waits on it); work_cv:
   * the pauses of jitter and the link model (woken by destroy) */
  pthread_cond_t worker_cv, work_cv, idle_cv;
  op_t *head, *tail, *free_ops;
  uint64_t enqueued, completed;
  atomic_uint_fast64_t enqueued_seen; /* enqueued, readable without mu */
  atomic_uint_fast64_t completed_seen; /* completed, readable without mu */
  atomic_bool stop;
  bool has_thread;
  /* On worker_cv and not yet woken (mu held): whoever wakes it clears the
   * flag, so that the operations queued before it runs cost one wake-up
   * (one futex call), not one each. */
  bool worker_sleeping;
  /* On worker_cv in a doze (a timed wait, see worker_main) that ends at
   * doze_until: a submitter leaves it to wake on its own unless the doze
   * has more than cfg.doze_us left (wake_worker_locked). */
  bool worker_dozing;
  uint64_t doze_until;
  int idle_waiters;     /* threads on idle_cv (mu held) */
  uint64_t rng;
  /* An operation of the stream runs (on the worker or on a waiter that took
   * it, see steal): the other leaves the head alone. Written under mu. */
  atomic_bool busy;
  /* Strict mode: the jitter drawn for the head, kept until it starts, so
   * that whichever thread runs it pauses as long (mu). */
  bool jitter_drawn;
  uint64_t jitter_ns;
  /* The stream's handle and each event whose latest record is on it: the
   * struct outlives a destroy while an event still names it. */
  atomic_int refs;
  bool held; /* tests: the worker starts nothing (ofl__host_stream_hold) */
  atomic_uint_fast64_t stolen; /* operations waiters ran */
  atomic_uint_fast64_t inlined; /* operations their submitters ran */
  atomic_uint_fast64_t wakes;   /* signals to a sleeping or dozing worker */
  atomic_uint_fast64_t dozes;   /* dozes the worker began */
  ofl_status_t error;    /* first asynchronous error (first wins) */
  atomic_bool has_error; /* error set; read without mu */
  char error_msg[512];
} host_stream_t;

static uint64_t next_rand(uint64_t *s) {
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

/* Sleeps up to ns for an operation of the stream (on its worker, or on a
 * waiter that took the operation: steal), waking early when the stream is
 * destroyed (destroy sets stop and broadcasts work_cv under mu): a jitter or
 * link-model pause of minutes must not make destroy hang. Other wake-ups of
 * work_cv (a producer's, a waiter's hand-back to the worker) only make it
 * check the time again. Returns false when stopped. */
static bool worker_pause(host_stream_t *hs, uint64_t ns) {
  if (ns == 0)
    return !atomic_load(&hs->stop);
  if (!hs->has_thread) {
    /* The compute stream is the caller's thread: nothing can destroy it
     * meanwhile, and paced_copy bounds the pause by the wait timeout. */
    struct timespec ts = {(time_t)(ns / 1000000000ull),
                          (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    return true;
  }
  uint64_t now = ofl__now_ns();
  uint64_t until = ns > UINT64_MAX - now ? UINT64_MAX : now + ns;
  pthread_mutex_lock(&hs->mu);
  while (!atomic_load(&hs->stop) && (now = ofl__now_ns()) < until)
    cond_wait_until(&hs->work_cv, &hs->mu, now, until);
  pthread_mutex_unlock(&hs->mu);
  return !atomic_load(&hs->stop);
}

static void set_async_error(host_stream_t *hs, ofl_status_t st,
                            const char *msg) {
  pthread_mutex_lock(&hs->mu);
  if (hs->error == OFL_SUCCESS) {
    hs->error = st;
    snprintf(hs->error_msg, sizeof hs->error_msg, "%s", msg);
    atomic_store(&hs->has_error, true);
  }
  pthread_mutex_unlock(&hs->mu);
  OFL_WARN(OFL_SUBSYS_DEVICE, "stream %s: %s", hs->s->name, msg);
}

static const char *copy_name(ofl_copy_kind_t k) {
  static const char *names[] = {"h2d", "d2h", "d2d", "h2h"};
  return names[k];
}

/* Copy with the link model: pace slices so that the copy takes bytes/rate,
 * with the total rate shared when both directions run. Time is kept in
 * double seconds and converted only once clamped: bytes/rate can be
 * minutes (rates down to OFL__LINK_MIN_BPS are valid), which must not
 * overflow a nanosecond count. A pause ends early when the stream is
 * destroyed; the pacing of one copy stops after the wait timeout (a copy
 * slower than that makes every wait on it fail anyway), and the rest of
 * the copy runs at memcpy speed. */
static void paced_copy(host_stream_t *hs, op_t *op) {
  ofl_device_t *dev = hs->s->dev;
  const ofl__device_config_t *c = &dev->cfg;
  double rate = 0;
  int dir = -1;
  if (op->kind == OFL_COPY_H2D) {
    rate = c->link_h2d_bps;
    dir = 0;
  } else if (op->kind == OFL_COPY_D2H) {
    rate = c->link_d2h_bps;
    dir = 1;
  }
  if (dir < 0 || (rate <= 0 && c->link_total_bps <= 0)) {
    memcpy(op->dst, op->src, op->bytes);
    return;
  }
  host_dev_t *h = HD(dev);
  atomic_fetch_add(&h->active_dir[dir], 1);
  uint64_t start = ofl__now_ns();
  double limit_s = (double)ofl__timeout_ms(-1) / 1e3;
  double due_s = 0;
  bool pacing = true;
  for (size_t done = 0; done < op->bytes;) {
    size_t n = op->bytes - done < LINK_SLICE ? op->bytes - done : LINK_SLICE;
    memcpy((char *)op->dst + done, (const char *)op->src + done, n);
    done += n;
    if (!pacing)
      continue;
    double r = rate > 0 ? rate : c->link_total_bps;
    if (c->link_total_bps > 0 && atomic_load(&h->active_dir[1 - dir]) > 0 &&
        r > c->link_total_bps / 2)
      r = c->link_total_bps / 2;
    due_s += (double)n / r; /* r >= OFL__LINK_MIN_BPS / 2 (host_open) */
    double target_s = due_s < limit_s ? due_s : limit_s;
    double wait_s = target_s - (double)(ofl__now_ns() - start) / 1e9;
    if (wait_s > 0)
      pacing = worker_pause(hs, (uint64_t)(wait_s * 1e9) + 1);
    if (due_s >= limit_s)
      pacing = false;
  }
  atomic_fetch_sub(&h->active_dir[dir], 1);
}

static void execute(host_stream_t *hs, op_t *op) {
  ofl_device_t *dev = hs->s->dev;
  bool traced = ofl__trace_on(dev);
  uint64_t t0 = traced ? ofl__now_ns() : 0;
  const char *tname = "op";
  switch (op->type) {
  case OP_COPY:
    paced_copy(hs, op);
    tname = copy_name(op->kind);
    break;
  case OP_MEMSET:
    memset(op->dst, op->value, op->bytes);
    tname = "memset";
    break;
  case OP_RECORD: /* reached by the worker, with the stream's count */
    return;
  case OP_WAIT: {
    /* A worker runs only its own stream's operations (docs/DESIGN.md
     * section 3.2): it waits, it does not take the other stream's. */
    if (!event_wait_target(op->ev, op->target, -1, spin_ns_of(dev),
                           &hs->stop, NULL)) {
      char msg[256];
      snprintf(msg, sizeof msg,
               "a wait on an event did not complete within "
               "OFL_WAIT_TIMEOUT_MS (or the stream was destroyed); the work "
               "after it ran unordered");
      set_async_error(hs, OFL_ERR_TIMEOUT, msg);
    }
    tname = "wait";
    break;
  }
  case OP_HOSTFN:
    op->fn(op->arg);
    tname = "host_fn";
    break;
  }
  if (!traced || tname == NULL)
    return;
  /* Formatting costs more than a small copy: only when tracing. */
  char args[64] = "";
  if (op->type == OP_COPY || op->type == OP_MEMSET)
    snprintf(args, sizeof args, "\"bytes\":%zu", op->bytes);
  ofl__trace_complete(dev, hs->s->id, tname, "stream", t0, ofl__now_ns(),
                      args[0] ? args : NULL);
}

/* Drops what a finished op held: its event reference and the inflight
 * counts of its blocks. */
static void release_blocks(ofl_device_t *dev, op_t *op) {
  if (op->ev != NULL) {
    event_unref(op->ev);
    op->ev = NULL;
  }
  bool drained = false;
  for (int i = 0; i < 2; i++)
    if (op->blk[i] != NULL) /* the block may be freed right after this */
      drained |= atomic_fetch_sub(&op->blk[i]->inflight, 1) == 1;
  host_dev_t *h = HD(dev);
  if (drained && atomic_load(&h->free_waiters) > 0) {
    /* Under the lock, so that a free between its check and its wait
     * cannot miss the wake-up. */
    pthread_mutex_lock(&h->reg_lock);
    pthread_cond_broadcast(&h->reg_cond);
    pthread_mutex_unlock(&h->reg_lock);
  }
}

/* The strict-mode jitter of the head (mu held): drawn once per operation,
 * so that a waiter that looks at the head and leaves it does not change the
 * pause the worker then takes. */
static uint64_t head_jitter_locked(host_stream_t *hs) {
  const ofl__device_config_t *c = &hs->s->dev->cfg;
  if (!c->strict || c->jitter_max_us <= 0)
    return 0;
  if (!hs->jitter_drawn) {
    hs->jitter_ns =
        next_rand(&hs->rng) % ((uint64_t)c->jitter_max_us * 1000u + 1);
    hs->jitter_drawn = true;
  }
  return hs->jitter_ns;
}

/* Marks the head started by the calling thread (mu held; busy was clear) and
 * returns its jitter. */
static uint64_t start_head_locked(host_stream_t *hs) {
  uint64_t jitter = head_jitter_locked(hs);
  hs->jitter_drawn = false;
  atomic_store(&hs->busy, true);
  return jitter;
}

/* Runs op, the stream's head, without mu: the jitter first (interruptible:
 * it may be set to minutes, OFL_JITTER_MAX_US), then the operation. A
 * record is not reached here but by finish_head_locked, together with the
 * stream's count, so that whoever sees the event complete also sees the
 * stream past it (a stream query right after a wait on its event says
 * idle); *reached takes the record's event and its reference. */
static void run_head(host_stream_t *hs, op_t *op, uint64_t jitter_ns,
                     host_event_t **reached) {
  if (jitter_ns > 0 && !atomic_load(&hs->stop))
    worker_pause(hs, jitter_ns);
  *reached = NULL;
  if (op->type == OP_RECORD) {
    *reached = op->ev; /* its reference is dropped by finish_head_locked */
    op->ev = NULL;
  } else {
    execute(hs, op);
  }
  release_blocks(hs->s->dev, op);
}

/* Takes the finished head off the queue (mu held), reaches its record and
 * wakes whoever waits for it (synchronize: for an empty queue). */
static void finish_head_locked(host_stream_t *hs, op_t *op,
                               host_event_t *reached, uint64_t target) {
  hs->head = op->next;
  if (hs->head == NULL)
    hs->tail = NULL;
  op->next = hs->free_ops;
  hs->free_ops = op;
  hs->completed++;
  atomic_store_explicit(&hs->completed_seen, hs->completed,
                        memory_order_release);
  atomic_store(&hs->busy, false);
  if (reached != NULL) { /* lock order: stream, then event */
    pthread_mutex_lock(&reached->mu);
    bool wake = event_complete_locked(reached, target);
    pthread_mutex_unlock(&reached->mu);
    if (wake)
      pthread_cond_broadcast(&reached->cv);
    event_unref(reached);
  }
  if (hs->head == NULL && hs->idle_waiters > 0)
    pthread_cond_broadcast(&hs->idle_cv);
}

/* Starts, runs and finishes the head op (mu held on entry and exit; busy
 * was clear): the one step of the worker and of a waiter that steals. */
static void run_head_locked(host_stream_t *hs, op_t *op) {
  uint64_t jitter = start_head_locked(hs);
  pthread_mutex_unlock(&hs->mu);
  host_event_t *reached;
  uint64_t target = op->target;
  run_head(hs, op, jitter, &reached);
  pthread_mutex_lock(&hs->mu);
  finish_head_locked(hs, op, reached, target);
}

static void *worker_main(void *arg) {
  host_stream_t *hs = arg;
  ofl_device_t *dev = hs->s->dev;
  uint64_t spin_ns = spin_ns_of(dev);
  /* The last idle periods, newest in bit 0: 1 when the next operation came
   * within spin_ns. The worker polls only while one of the last four did:
   * where operations come further apart (one tensor's copies per layer of
   * a forward), every poll would end in the sleep anyway, and only take a
   * core from the thread that computes. */
  unsigned short_idles = 0xf;
  /* Within DOZE_WINDOW_NS of its last operation the worker sleeps in
   * timed dozes and finds new work itself: a submitter then pays no
   * wake-up (a futex call, and on a virtual machine an interprocessor
   * interrupt, several microseconds each) for every copy of a burst spread
   * over a forward pass. The first DOZES_BEFORE_BACKOFF dozes last
   * doze_ns (the gaps between one tensor's copies and the next), each
   * empty one after them doubles the next: an idle worker wakes a few
   * times, not every doze_ns (on cores that the training threads fill,
   * each wake-up takes one from them), and a submitter signals a doze with
   * more than doze_ns left, so work never waits longer than that for its
   * start. Idle past the window: a sleep until signalled. */
  uint64_t doze_ns = doze_ns_of(dev);
  uint64_t last_work_ns = 0, next_doze_ns = doze_ns;
  unsigned empty_dozes = 0;
  ofl__thread_name(hs->s->name);
  pthread_mutex_lock(&hs->mu);
  for (;;) {
    /* Idle periods are timed only where there is a poll to decide on. */
    bool idle = spin_ns > 0 && hs->head == NULL && !atomic_load(&hs->stop);
    uint64_t idle_t0 = idle ? ofl__now_ns() : 0;
    bool caught = false;
    if (idle && (short_idles & 0xf) != 0) {
      /* Streams get bursts of small operations (one copy per tensor of a
       * group): poll briefly before sleeping, so that the next operation of
       * the burst does not pay a futex wake-up on each side. */
      uint64_t done = hs->completed;
      pthread_mutex_unlock(&hs->mu);
      uint64_t until = idle_t0 + spin_ns;
      while (!(caught = atomic_load_explicit(&hs->enqueued_seen,
                                             memory_order_acquire) != done) &&
             !atomic_load(&hs->stop) && ofl__now_ns() < until)
        sched_yield();
      pthread_mutex_lock(&hs->mu);
    }
    /* A waiter running the head (busy) keeps it even after stop: the
     * worker must not run it a second time. */
    bool slept = false;
    while (((hs->head == NULL || hs->held) && !atomic_load(&hs->stop)) ||
           atomic_load(&hs->busy)) {
      uint64_t now = doze_ns > 0 ? ofl__now_ns() : 0;
      if (doze_ns > 0 && !hs->held && now - last_work_ns < DOZE_WINDOW_NS) {
        hs->worker_dozing = true;
        atomic_fetch_add_explicit(&hs->dozes, 1, memory_order_relaxed);
        hs->doze_until = now + next_doze_ns;
        cond_wait_until(&hs->worker_cv, &hs->mu, now, hs->doze_until);
        hs->worker_dozing = false;
        if (++empty_dozes >= DOZES_BEFORE_BACKOFF &&
            next_doze_ns < DOZE_WINDOW_NS)
          next_doze_ns *= 2;
      } else {
        hs->worker_sleeping = true;
        pthread_cond_wait(&hs->worker_cv, &hs->mu);
        hs->worker_sleeping = false;
      }
      slept = true;
    }
    if (idle)
      short_idles = (short_idles << 1) |
                    (caught || (slept && ofl__now_ns() - idle_t0 < spin_ns));
    if (hs->head == NULL)
      break;
    run_head_locked(hs, hs->head);
    if (doze_ns > 0) {
      last_work_ns = ofl__now_ns();
      next_doze_ns = doze_ns;
      empty_dozes = 0;
    }
  }
  pthread_mutex_unlock(&hs->mu);
  return NULL;
}

/* Whether a waiter may run op, the head, on its own thread before deadline
 * (mu held). Never a host function: those run on the stream's thread
 * (docs/DESIGN.md section 3.2), where they may take locks the waiter holds;
 * except a release that may run on any thread (ofl__stream_launch_release):
 * left to the worker, it would keep the waiter from the copies behind it.
 * A wait only once its event completed: an operation never starts before
 * what it waits for. Nor one whose jitter or link-model pacing would keep
 * the waiter past its deadline: the worker runs those. */
static bool stealable_locked(host_stream_t *hs, const op_t *op,
                             uint64_t deadline) {
  if (op->type == OP_HOSTFN && !op->any_thread)
    return false;
  if (op->type == OP_WAIT && !event_reached_now(op->ev, op->target))
    return false;
  const ofl__device_config_t *c = &hs->s->dev->cfg;
  double need_s = (double)head_jitter_locked(hs) / 1e9;
  if (op->type == OP_COPY &&
      (op->kind == OFL_COPY_H2D || op->kind == OFL_COPY_D2H)) {
    double r = op->kind == OFL_COPY_H2D ? c->link_h2d_bps : c->link_d2h_bps;
    if (r <= 0)
      r = c->link_total_bps;
    if (c->link_total_bps > 0 && r > c->link_total_bps / 2)
      r = c->link_total_bps / 2; /* the other direction may share it */
    if (r > 0)
      need_s += (double)op->bytes / r;
  }
  uint64_t now = ofl__now_ns();
  return deadline > now && need_s <= (double)(deadline - now) / 1e9;
}

/* Work stealing by the waiter: an application thread that waits for record
 * `target` of he (he NULL: for the stream to drain) runs the stream's queued
 * operations itself, in queue order, one at a time and only while no other
 * operation of the stream runs, stopping once the goal is reached or the
 * head must be left to the worker (stealable_locked). The stream order is
 * the worker's: each op starts after the previous one finished, as there.
 * A head that waits for another stream's record not reached yet sends the
 * waiter to that stream first, to run what the record follows (depth: how
 * many such hops led here; at most STEAL_HOPS): a reload queued behind its
 * own offload is not left to two workers that may both be descheduled.
 * mu held on entry and return (dropped during a hop). */
enum { STEAL_HOPS = 2 };

static void steal_locked(host_stream_t *hs, host_event_t *he, uint64_t target,
                         uint64_t deadline, int depth) {
  while (hs->head != NULL && !atomic_load(&hs->busy) &&
         !atomic_load(&hs->stop)) {
    if (he != NULL && event_reached_now(he, target))
      return;
    op_t *op = hs->head;
    if (stealable_locked(hs, op, deadline)) {
      atomic_fetch_add_explicit(&hs->stolen, 1, memory_order_relaxed);
      run_head_locked(hs, op);
      continue;
    }
    if (op->type != OP_WAIT || depth >= STEAL_HOPS ||
        event_reached_now(op->ev, op->target))
      return;
    host_event_t *up_ev = op->ev;
    uint64_t up_target = op->target;
    host_stream_t *up = record_stream(up_ev, up_target);
    if (up == NULL || up == hs) {
      if (up != NULL)
        stream_unref(up);
      return;
    }
    atomic_fetch_add(&up_ev->refs, 1); /* the op may complete meanwhile */
    pthread_mutex_unlock(&hs->mu);
    steal(up, up_ev, up_target, deadline, depth + 1);
    bool reached = event_reached_now(up_ev, up_target);
    event_unref(up_ev);
    stream_unref(up);
    pthread_mutex_lock(&hs->mu);
    if (!reached)
      return; /* that stream's worker has it: wait for it */
  }
}

/* Wakes the worker if it sleeps and nobody woke it yet, or if it dozes
 * with more than cfg.doze_us left (mu held): a start waits no longer. */
static void wake_worker_locked(host_stream_t *hs) {
  bool signal = hs->worker_sleeping;
  if (!signal && hs->worker_dozing) {
    uint64_t now = ofl__now_ns();
    signal =
        hs->doze_until > now && hs->doze_until - now > doze_ns_of(hs->s->dev);
    if (signal)
      hs->doze_until = now; /* signalled once */
  }
  if (signal) {
    hs->worker_sleeping = false;
    atomic_fetch_add_explicit(&hs->wakes, 1, memory_order_relaxed);
    pthread_cond_signal(&hs->worker_cv);
  }
}

/* A waiter done taking work hands what is left back to the worker, which
 * may have gone to sleep on busy: woken once here, not after each op
 * (mu held); after a stop too, so that it ends. */
static void steal_end_locked(host_stream_t *hs) {
  if (hs->head != NULL || atomic_load(&hs->stop))
    wake_worker_locked(hs);
}

static void steal(host_stream_t *hs, host_event_t *he, uint64_t target,
                  uint64_t deadline, int depth) {
  /* A peek without the lock: the worker holds it from one op to the next,
   * and a waiter that spins must not slow it down. */
  if (atomic_load(&hs->busy) ||
      atomic_load_explicit(&hs->enqueued_seen, memory_order_acquire) ==
          atomic_load_explicit(&hs->completed_seen, memory_order_acquire))
    return;
  pthread_mutex_lock(&hs->mu);
  steal_locked(hs, he, target, deadline, depth);
  steal_end_locked(hs);
  pthread_mutex_unlock(&hs->mu);
}

void ofl__host_stream_hold(ofl_stream_t *s, bool hold) {
  host_stream_t *hs = s->impl;
  if (s->dev->backend != OFL_BACKEND_HOST || !hs->has_thread)
    return;
  pthread_mutex_lock(&hs->mu);
  hs->held = hold;
  if (!hold)
    wake_worker_locked(hs);
  pthread_mutex_unlock(&hs->mu);
}

uint64_t ofl__host_stream_stolen(ofl_stream_t *s) {
  if (s->dev->backend != OFL_BACKEND_HOST)
    return 0;
  host_stream_t *hs = s->impl;
  return atomic_load(&hs->stolen);
}

uint64_t ofl__host_stream_inlined(ofl_stream_t *s) {
  if (s->dev->backend != OFL_BACKEND_HOST)
    return 0;
  host_stream_t *hs = s->impl;
  return atomic_load(&hs->inlined);
}

uint64_t ofl__host_stream_wakes(ofl_stream_t *s) {
  if (s->dev->backend != OFL_BACKEND_HOST)
    return 0;
  host_stream_t *hs = s->impl;
  return atomic_load(&hs->wakes);
}

uint64_t ofl__host_stream_dozes(ofl_stream_t *s) {
  if (s->dev->backend != OFL_BACKEND_HOST)
    return 0;
  host_stream_t *hs = s->impl;
  return atomic_load(&hs->dozes);
}

static void stream_unref(host_stream_t *hs) {
  if (atomic_fetch_sub(&hs->refs, 1) != 1)
    return;
  for (op_t *op = hs->free_ops; op != NULL;) {
    op_t *next = op->next;
    free(op);
    op = next;
  }
  pthread_mutex_destroy(&hs->mu);
  pthread_cond_destroy(&hs->worker_cv);
  pthread_cond_destroy(&hs->work_cv);
  pthread_cond_destroy(&hs->idle_cv);
  free(hs);
}

/* Record `target` of he and the worker stream it was queued on (a
 * reference the caller drops with stream_unref; NULL when it was on the
 * compute stream or the record is not the latest any more). */
static host_stream_t *record_stream(host_event_t *he, uint64_t target) {
  pthread_mutex_lock(&he->mu);
  host_stream_t *hs = ev_recorded(he) == target ? he->last_stream : NULL;
  if (hs != NULL)
    atomic_fetch_add(&hs->refs, 1);
  pthread_mutex_unlock(&he->mu);
  return hs;
}

/* An application thread's wait for record `target` of he, taking the
 * operations it waits for off their stream when the worker has not started
 * them. */
static bool wait_record(host_event_t *he, uint64_t target, int64_t timeout_ms,
                        uint64_t spin_ns) {
  if (event_reached_now(he, target))
    return true;
  host_stream_t *from = record_stream(he, target);
  bool done = event_wait_target(he, target, timeout_ms, spin_ns, NULL, from);
  if (from != NULL)
    stream_unref(from);
  return done;
}

static ofl_status_t host_event_synchronize(ofl_event_t *e, int64_t timeout_ms) {
  host_event_t *he = e->impl;
  if (!wait_record(he, ev_recorded(he), timeout_ms, spin_ns_of(e->dev)))
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                      "event not complete after %lld ms; is its stream "
                      "blocked on a wait that never completes?",
                      (long long)timeout_ms);
  return OFL_SUCCESS;
}

static bool ranges_overlap(const void *a, size_t an, const char *lo,
                           size_t bytes) {
  const char *p = a;
  return an > 0 && bytes > 0 && p < lo + bytes && lo < p + an;
}

/* Queued or running copies and memsets on the device's worker streams
 * whose ranges overlap [lo, lo + bytes) (strict-mode checks only). Takes
 * the device's stream list lock, then each stream's lock. */
static size_t ops_touching(ofl_device_t *dev, const char *lo, size_t bytes) {
  size_t n = 0;
  pthread_mutex_lock(&dev->streams_lock);
  for (ofl_stream_t *s = dev->streams; s != NULL; s = s->dev_next) {
    host_stream_t *hs = s->impl;
    if (hs == NULL || !hs->has_thread)
      continue;
    pthread_mutex_lock(&hs->mu);
    for (const op_t *op = hs->head; op != NULL; op = op->next) {
      if (op->type == OP_COPY)
        n += ranges_overlap(op->dst, op->bytes, lo, bytes) ||
             ranges_overlap(op->src, op->bytes, lo, bytes);
      else if (op->type == OP_MEMSET)
        n += ranges_overlap(op->dst, op->bytes, lo, bytes);
    }
    pthread_mutex_unlock(&hs->mu);
  }
  pthread_mutex_unlock(&dev->streams_lock);
  return n;
}

static ofl_status_t host_stream_create(ofl_stream_t *s) {
  host_stream_t *hs = calloc(1, sizeof *hs);
  if (hs == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate stream '%s'", s->name);
  hs->s = s;
  pthread_mutex_init(&hs->mu, NULL);
  cond_init(&hs->worker_cv);
  cond_init(&hs->work_cv);
  cond_init(&hs->idle_cv);
  hs->rng = s->dev->cfg.jitter_seed * 0x9E3779B97F4A7C15ull +
            (uint64_t)s->id * 7919u + 1;
  atomic_init(&hs->refs, 1);
  s->impl = hs;
  if (!s->is_compute) {
    int rc = pthread_create(&hs->thread, NULL, worker_main, hs);
    if (rc != 0) {
      pthread_mutex_destroy(&hs->mu);
      pthread_cond_destroy(&hs->worker_cv);
      pthread_cond_destroy(&hs->work_cv);
      pthread_cond_destroy(&hs->idle_cv);
      free(hs);
      return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_DEVICE,
                        "cannot start the worker thread of stream '%s': %s",
                        s->name, strerror(rc));
    }
    hs->has_thread = true;
  }
  return OFL_SUCCESS;
}

/* Returns the stream's first asynchronous error, raised on this thread. */
static ofl_status_t take_async_error(host_stream_t *hs) {
  if (!atomic_load(&hs->has_error))
    return OFL_SUCCESS;
  pthread_mutex_lock(&hs->mu);
  ofl_status_t st = hs->error;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", hs->error_msg);
  pthread_mutex_unlock(&hs->mu);
  if (st == OFL_SUCCESS)
    return st;
  return ofl__error_quiet(st, "stream '%s': %s", hs->s->name, msg);
}

static ofl_status_t host_stream_synchronize(ofl_stream_t *s,
                                            int64_t timeout_ms) {
  host_stream_t *hs = s->impl;
  uint64_t deadline = ofl__deadline_ns(timeout_ms);
  pthread_mutex_lock(&hs->mu);
  while (hs->completed < hs->enqueued && hs->has_thread) {
    /* The queue's operations that the worker has not started yet run here
     * (steal_locked); what is left is the worker's. */
    steal_locked(hs, NULL, 0, deadline, 0);
    steal_end_locked(hs);
    if (hs->completed >= hs->enqueued)
      break;
    uint64_t now = ofl__now_ns();
    if (now >= deadline) {
      uint64_t pending = hs->enqueued - hs->completed;
      pthread_mutex_unlock(&hs->mu);
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                        "stream '%s' still has %llu operation(s) after %lld "
                        "ms; is it waiting on an event never recorded on a "
                        "running stream?",
                        s->name, (unsigned long long)pending,
                        (long long)timeout_ms);
    }
    hs->idle_waiters++;
    cond_wait_until(&hs->idle_cv, &hs->mu, now, deadline);
    hs->idle_waiters--;
  }
  pthread_mutex_unlock(&hs->mu);
  return take_async_error(hs);
}

static ofl_status_t host_stream_query(ofl_stream_t *s) {
  host_stream_t *hs = s->impl;
  pthread_mutex_lock(&hs->mu);
  bool idle = hs->completed >= hs->enqueued;
  pthread_mutex_unlock(&hs->mu);
  ofl_status_t st = take_async_error(hs);
  if (st != OFL_SUCCESS)
    return st;
  return idle ? OFL_SUCCESS : OFL_ERR_NOT_READY;
}

/* Drains for at most the wait timeout, then stops the worker: stop cuts
 * short its pauses (jitter, link pacing) and its event waits, so the
 * operations still queued run at once and the join is short. (A host
 * function the application queued is the one thing that can still hold it.)
 * The stop is set and broadcast under mu: a pause checks it under mu before
 * each timed wait, so the wake-up cannot fall between check and wait. */
static ofl_status_t host_stream_destroy(ofl_stream_t *s) {
  host_stream_t *hs = s->impl;
  ofl_status_t st = OFL_SUCCESS;
  if (hs->has_thread) {
    st = host_stream_synchronize(s, ofl__timeout_ms(-1));
    pthread_mutex_lock(&hs->mu);
    atomic_store(&hs->stop, true);
    pthread_cond_broadcast(&hs->work_cv);
    if (hs->worker_dozing)
      pthread_cond_signal(&hs->worker_cv);
    wake_worker_locked(hs);
    pthread_mutex_unlock(&hs->mu);
    pthread_join(hs->thread, NULL);
  }
  /* Events whose latest record was here keep the struct (stopped: no
   * waiter takes work from it) until they are recorded again or freed. */
  stream_unref(hs);
  return st;
}

/* A queue entry from the stream's free list, or a new one until the list
 * covers the queue depth (mu held); NULL when out of memory. */
static op_t *slot_locked(host_stream_t *hs) {
  op_t *q = hs->free_ops;
  if (q != NULL)
    hs->free_ops = q->next;
  else
    q = malloc(sizeof *q);
  return q;
}

/* Appends q (mu held), waking the worker if it sleeps unless the caller
 * runs q itself (enqueue_locked). */
static void link_quiet_locked(host_stream_t *hs, op_t *q, bool wake) {
  q->next = NULL;
  if (hs->tail != NULL)
    hs->tail->next = q;
  else
    hs->head = q;
  hs->tail = q;
  hs->enqueued++;
  atomic_store_explicit(&hs->enqueued_seen, hs->enqueued, memory_order_release);
  if (wake)
    wake_worker_locked(hs);
}

/* Whether op, about to be queued on an idle worker stream, may run on the
 * submitting thread instead (mu held): the stream has nothing queued or
 * running, so the worker would start it at once; a hand-off to the worker
 * (a wake-up, a context switch, its poll) costs more than a small copy on
 * a machine with few cores. Copies up to cfg.inline_bytes and records; not
 * with strict-mode jitter (each operation must be delayed) nor a link model
 * (a copy takes its modelled time on the worker), nor while a test holds
 * the stream. The order is the stream's: nothing is before it. A release
 * that may run on any thread runs here whatever cfg.inline_bytes says: all
 * the work it follows is done. */
static bool inline_ok_locked(host_stream_t *hs, const op_t *op) {
  const ofl__device_config_t *c = &hs->s->dev->cfg;
  if (hs->head != NULL || atomic_load(&hs->busy) || hs->held ||
      atomic_load(&hs->stop) || (c->strict && c->jitter_max_us > 0))
    return false;
  if (op->type == OP_HOSTFN && op->any_thread)
    return true; /* everything before it completed: nothing to wait for */
  if (c->inline_bytes == 0)
    return false;
  if (op->type == OP_RECORD)
    return true;
  if (op->type != OP_COPY || op->bytes > c->inline_bytes)
    return false;
  return !(c->link_h2d_bps > 0 || c->link_d2h_bps > 0 ||
           c->link_total_bps > 0);
}

static ofl_status_t no_slot(ofl_stream_t *s) {
  return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                    "cannot queue an operation on stream '%s'", s->name);
}

/* Runs q, just queued as the head of an idle stream, on the calling thread
 * (inline_ok_locked; mu held on entry and exit). What other threads queued
 * behind it meanwhile found the stream busy: the worker, which may have
 * gone to sleep on busy, is woken for it (steal_end_locked). */
static void run_inline_locked(host_stream_t *hs, op_t *q) {
  atomic_fetch_add_explicit(&hs->inlined, 1, memory_order_relaxed);
  run_head_locked(hs, q);
  steal_end_locked(hs);
}

/* Appends q (mu held) and runs it on the calling thread where
 * inline_ok_locked allows, else leaves it to the worker (woken if it
 * sleeps). */
static void enqueue_locked(host_stream_t *hs, op_t *q) {
  bool here = inline_ok_locked(hs, q);
  link_quiet_locked(hs, q, !here);
  if (here)
    run_inline_locked(hs, q);
}

/* Runs op now (compute stream) or queues a copy of it (worker stream),
 * taking the stream's lock once; op may live on the caller's stack. On
 * failure drops the references op holds. */
static ofl_status_t submit(ofl_stream_t *s, op_t *op) {
  host_stream_t *hs = s->impl;
  if (s->is_compute) {
    execute(hs, op);
    release_blocks(s->dev, op);
    return OFL_SUCCESS;
  }
  pthread_mutex_lock(&hs->mu);
  op_t *q = slot_locked(hs);
  if (q != NULL) {
    *q = *op;
    enqueue_locked(hs, q);
  }
  pthread_mutex_unlock(&hs->mu);
  if (q != NULL)
    return OFL_SUCCESS;
  release_blocks(s->dev, op);
  return no_slot(s);
}

/* Checks that [p, p+bytes) lies in a device block (want_device) or outside
 * any device block, and takes an inflight reference on the block. */
static ofl_status_t claim(ofl_stream_t *s, const void *p, size_t bytes,
                          bool want_device, const char *role, hblock_t **out) {
  host_dev_t *h = HD(s->dev);
  hblock_t *b = find_block(h, p);
  bool is_device = b != NULL && !b->pinned;
  /* adopted memory is the application's: device memory as well as host,
   * the copy kind says which it plays */
  if (b == NULL && want_device && atomic_load(&h->adopt)) {
    *out = NULL;
    return OFL_SUCCESS;
  }
  if (want_device && !is_device)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': %s %p is not device memory of this "
                      "device; allocate it with ofl_device_malloc or use "
                      "another copy kind",
                      s->name, role, p);
  if (!want_device && is_device)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': %s %p is device memory but the copy kind "
                      "says host",
                      s->name, role, p);
  if (b != NULL && bytes > (size_t)(b->base + b->bytes - (const char *)p))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': %s range of %zu bytes at %p overruns its "
                      "block of %zu bytes",
                      s->name, role, bytes, p, b->bytes);
  *out = b;
  return OFL_SUCCESS;
}

static ofl_status_t host_memcpy_async(void *dst, const void *src, size_t bytes,
                                      ofl_copy_kind_t kind, ofl_stream_t *s) {
  host_dev_t *h = HD(s->dev);
  bool dst_dev = kind == OFL_COPY_H2D || kind == OFL_COPY_D2D;
  bool src_dev = kind == OFL_COPY_D2H || kind == OFL_COPY_D2D;
  hblock_t *bd = NULL, *bs = NULL;
  pthread_mutex_lock(&h->reg_lock);
  ofl_status_t st = claim(s, dst, bytes, dst_dev, "destination", &bd);
  if (st == OFL_SUCCESS)
    st = claim(s, src, bytes, src_dev, "source", &bs);
  if (st == OFL_SUCCESS) {
    if (bd)
      atomic_fetch_add_explicit(&bd->inflight, 1, memory_order_relaxed);
    if (bs)
      atomic_fetch_add_explicit(&bs->inflight, 1, memory_order_relaxed);
  }
  pthread_mutex_unlock(&h->reg_lock);
  if (st != OFL_SUCCESS)
    return st;
  op_t op = {.type = OP_COPY,
             .kind = kind,
             .dst = dst,
             .src = src,
             .bytes = bytes,
             .blk = {bd, bs}};
  return submit(s, &op);
}

static ofl_status_t host_memset_async(void *dst, int value, size_t bytes,
                                      ofl_stream_t *s) {
  host_dev_t *h = HD(s->dev);
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, dst);
  if (b != NULL && bytes > (size_t)(b->base + b->bytes - (char *)dst)) {
    pthread_mutex_unlock(&h->reg_lock);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': memset of %zu bytes at %p overruns its "
                      "block of %zu bytes",
                      s->name, bytes, dst, b->bytes);
  }
  if (b != NULL)
    atomic_fetch_add_explicit(&b->inflight, 1, memory_order_relaxed);
  pthread_mutex_unlock(&h->reg_lock);
  op_t op = {.type = OP_MEMSET,
             .dst = dst,
             .value = value,
             .bytes = bytes,
             .blk = {b, NULL}};
  return submit(s, &op);
}

/* Numbers the next record of he (he->mu held); 0 when out of memory. */
static uint64_t record_locked(host_event_t *he, ofl_stream_t *s) {
  if (!event_make_room(he)) {
    ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
               "cannot record an event on stream '%s': no memory to track "
               "%llu records in flight",
               s->name, (unsigned long long)(ev_recorded(he) + 1));
    return 0;
  }
  uint64_t target = ev_recorded(he) + 1;
  atomic_store_explicit(&he->recorded, target, memory_order_release);
  return target;
}

static ofl_status_t host_event_record(ofl_event_t *e, ofl_stream_t *s) {
  host_event_t *he = e->impl;
  host_stream_t *hs = s->impl;
  if (s->is_compute) {
    /* Everything before it on this stream has run: number the record and
     * reach it in one step. */
    pthread_mutex_lock(&he->mu);
    uint64_t target = record_locked(he, s);
    bool wake = target != 0 && event_complete_locked(he, target);
    host_stream_t *old = NULL;
    if (target != 0) {
      old = he->last_stream;
      he->last_stream = NULL;
    }
    pthread_mutex_unlock(&he->mu);
    if (wake)
      pthread_cond_broadcast(&he->cv);
    if (old != NULL)
      stream_unref(old);
    return target != 0 ? OFL_SUCCESS : OFL_ERR_NO_MEMORY;
  }
  /* The queue entry first, so that a failure leaves the event as it was.
   * Lock order: stream, then event (the worker takes them one at a time). */
  pthread_mutex_lock(&hs->mu);
  op_t *q = slot_locked(hs);
  uint64_t target = 0;
  host_stream_t *old = NULL;
  if (q != NULL) {
    pthread_mutex_lock(&he->mu);
    target = record_locked(he, s);
    if (target != 0) { /* where a waiter for this record finds its work */
      old = he->last_stream;
      atomic_fetch_add(&hs->refs, 1);
      he->last_stream = hs;
    }
    pthread_mutex_unlock(&he->mu);
    if (target != 0) {
      atomic_fetch_add(&he->refs, 1);
      *q = (op_t){.type = OP_RECORD, .ev = he, .target = target};
      enqueue_locked(hs, q);
    } else {
      q->next = hs->free_ops;
      hs->free_ops = q;
    }
  }
  pthread_mutex_unlock(&hs->mu);
  if (old != NULL) /* after the locks: this may free a destroyed stream */
    stream_unref(old);
  if (q == NULL)
    return no_slot(s);
  return target != 0 ? OFL_SUCCESS : OFL_ERR_NO_MEMORY;
}

static ofl_status_t host_stream_wait_event(ofl_stream_t *s, ofl_event_t *e) {
  host_event_t *he = e->impl;
  uint64_t target = ev_recorded(he);
  if (event_reached_now(he, target))
    return OFL_SUCCESS;
  if (s->is_compute) {
    /* The compute stream is the calling thread: block it, with a timeout. */
    uint64_t t0 = ofl__now_ns();
    if (!wait_record(he, target, -1, spin_ns_of(s->dev)))
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                        "compute stream waited %lld ms for an event that "
                        "did not complete; check that its stream runs",
                        (long long)ofl__timeout_ms(-1));
    if (ofl__trace_on(s->dev))
      ofl__trace_complete(s->dev, s->id, "wait", "stream", t0, ofl__now_ns(),
                          NULL);
    return OFL_SUCCESS;
  }
  atomic_fetch_add(&he->refs, 1);
  op_t op = {.type = OP_WAIT, .ev = he, .target = target};
  return submit(s, &op);
}

static ofl_status_t host_launch_host_func(ofl_stream_t *s, ofl_host_fn fn,
                                          void *arg) {
  op_t op = {.type = OP_HOSTFN, .fn = fn, .arg = arg};
  return submit(s, &op);
}

static ofl_status_t host_launch_release(ofl_stream_t *s, ofl_host_fn fn,
                                        void *arg) {
  op_t op = {.type = OP_HOSTFN, .fn = fn, .arg = arg, .any_thread = true};
  return submit(s, &op);
}

/* ---- ranges (trace only) ------------------------------------------------ */

/* Names are copied: the caller's buffer may change before the pop. */
static _Thread_local struct {
  char name[48];
  uint64_t t0;
} range_stack[16];
static _Thread_local int range_depth;

static void host_range_push(ofl_device_t *dev, const char *name) {
  /* Without a trace file only the depth matters (the trace is chosen at
   * device open, so a pop sees the same setting as its push). */
  if (range_depth < 16 && ofl__trace_on(dev)) {
    ofl__utf8_copy(range_stack[range_depth].name,
                   sizeof range_stack[range_depth].name, name);
    range_stack[range_depth].t0 = ofl__now_ns();
  }
  range_depth++;
}

static void host_range_pop(ofl_device_t *dev) {
  if (range_depth == 0)
    return;
  range_depth--;
  if (range_depth < 16 && ofl__trace_on(dev))
    ofl__trace_complete(dev, dev->compute ? dev->compute->id : 0,
                        range_stack[range_depth].name, "range",
                        range_stack[range_depth].t0, ofl__now_ns(), NULL);
}

/* ---- device ------------------------------------------------------------- */

/* A link-model rate of bytes/s: 0 (off) or one that paces a byte in at
 * most a day (OFL__LINK_MIN_BPS); the table checks the variables, this the
 * params fields too. */
static ofl_status_t check_link_rate(double bps, const char *var,
                                    const char *field) {
  if (bps == 0 || (isfinite(bps) && bps >= OFL__LINK_MIN_BPS))
    return OFL_SUCCESS;
  return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_DEVICE,
                    "link model rate %g GB/s (%s or ofl_device_params_t.%s) "
                    "is invalid: it takes 0 (off) or at least %.3g GB/s (one "
                    "byte a day)",
                    bps / 1e9, var, field, OFL__LINK_MIN_BPS / 1e9);
}

static ofl_status_t host_open(ofl_device_t *dev) {
  const ofl__device_config_t *c = &dev->cfg;
  OFL_CHECK(
      check_link_rate(c->link_h2d_bps, "OFL_LINK_H2D_GBPS", "link_h2d_gbps"));
  OFL_CHECK(
      check_link_rate(c->link_d2h_bps, "OFL_LINK_D2H_GBPS", "link_d2h_gbps"));
  OFL_CHECK(check_link_rate(c->link_total_bps, "OFL_LINK_TOTAL_GBPS",
                            "link_total_gbps"));
  host_dev_t *h = calloc(1, sizeof *h);
  if (h == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate the host backend");
  pthread_mutex_init(&h->reg_lock, NULL);
  cond_init(&h->reg_cond);
  dev->impl = h;
  return OFL_SUCCESS;
}

/* The link model's rates, a direction without its own taking the total;
 * without a model 0: copies run at memcpy speed, which the caller
 * measures. */
static ofl_status_t host_link_rate(ofl_device_t *dev, double *d2h_bytes_per_s,
                                   double *h2d_bytes_per_s) {
  const ofl__device_config_t *c = &dev->cfg;
  *d2h_bytes_per_s = c->link_d2h_bps > 0 ? c->link_d2h_bps : c->link_total_bps;
  *h2d_bytes_per_s = c->link_h2d_bps > 0 ? c->link_h2d_bps : c->link_total_bps;
  return OFL_SUCCESS;
}

static void host_close(ofl_device_t *dev) {
  host_dev_t *h = HD(dev);
  if (h->nblocks > 0)
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "device close: %zu block(s) still allocated; "
             "released now",
             h->nblocks);
  for (size_t i = 0; i < h->nblocks; i++) {
    free(h->blocks[i]->base);
    free(h->blocks[i]);
  }
  free(h->blocks);
  pthread_mutex_destroy(&h->reg_lock);
  pthread_cond_destroy(&h->reg_cond);
  free(h);
  dev->impl = NULL;
}

const ofl__device_ops_t ofl__host_ops = {
    .name = "host",
    .backend = OFL_BACKEND_HOST,
    .open = host_open,
    .close = host_close,
    .device_malloc = host_device_malloc,
    .device_free = host_device_free,
    .pinned_malloc = host_pinned_malloc,
    .pinned_free = host_pinned_free,
    .device_owns = host_device_owns,
    .inflight = host_inflight,
    .adopt_host_memory = host_adopt_host_memory,
    .link_rate = host_link_rate,
    .stream_create = host_stream_create,
    .stream_destroy = host_stream_destroy,
    .stream_synchronize = host_stream_synchronize,
    .stream_query = host_stream_query,
    .event_create = host_event_create,
    .event_destroy = host_event_destroy,
    .event_record = host_event_record,
    .event_query = host_event_query,
    .event_create_timed = host_event_create_timed,
    .event_elapsed_ns = host_event_elapsed_ns,
    .event_synchronize = host_event_synchronize,
    .stream_wait_event = host_stream_wait_event,
    .memcpy_async = host_memcpy_async,
    .memset_async = host_memset_async,
    .launch_host_func = host_launch_host_func,
    .launch_release = host_launch_release,
    .range_push = host_range_push,
    .range_pop = host_range_pop,
};
