/* ofl: the host backend's private interface, shared by its files:
 * device_host.c (open, close, ranges, the ops table), host_memory.c (device
 * and pinned blocks), host_event.c (events and the waits on them),
 * host_stream.c (the worker, stealing, jitter, the link model) and
 * host_submit.c (queueing operations). "Device" memory is CPU memory
 * counted against a capacity; the compute stream executes each operation on
 * the calling thread when it is enqueued; every other stream is a worker
 * thread with a FIFO. Strict mode poisons memory, adds seeded jitter before
 * each worker operation and reports frees of blocks that queued operations
 * still use. */
#ifndef OFL_RUNTIME_HOST_H
#define OFL_RUNTIME_HOST_H

#include <time.h>

#include "runtime/backend.h"

/* A device or pinned block (host_memory.c). */
typedef struct hblock hblock_t;

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

static inline host_dev_t *HD(ofl_device_t *dev) { return dev->impl; }

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
  bool any_thread;  /* OP_HOSTFN: may run on a waiter or the submitter */
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
  atomic_uint_fast64_t enqueued_seen;  /* enqueued, readable without mu */
  atomic_uint_fast64_t completed_seen; /* completed, readable without mu */
  atomic_bool stop;
  bool has_thread;
  /* On worker_cv and not yet woken (mu held): whoever wakes it clears the
   * flag, so that the operations queued before it runs cost one wake-up
   * (one futex call), not one each. */
  bool worker_sleeping;
  /* On worker_cv in a doze (a timed wait, see worker_main) that ends at
   * doze_until: a submitter leaves it to wake on its own unless the doze
   * has more than cfg.doze_us left (ofl__host_wake_worker_locked). */
  bool worker_dozing;
  uint64_t doze_until;
  int idle_waiters; /* threads on idle_cv (mu held) */
  uint64_t rng;
  /* An operation of the stream runs (on the worker or on a waiter that took
   * it, see steal in host_stream.c): the other leaves the head alone. Written
   * under mu. */
  atomic_bool busy;
  /* Strict mode: the jitter drawn for the head, kept until it starts, so
   * that whichever thread runs it pauses as long (mu). */
  bool jitter_drawn;
  uint64_t jitter_ns;
  /* The stream's handle and each event whose latest record is on it: the
   * struct outlives a destroy while an event still names it. */
  atomic_int refs;
  bool held; /* tests: the worker starts nothing (ofl__host_stream_hold) */
  atomic_uint_fast64_t stolen;  /* operations waiters ran */
  atomic_uint_fast64_t inlined; /* operations their submitters ran */
  atomic_uint_fast64_t wakes;   /* signals to a sleeping or dozing worker */
  atomic_uint_fast64_t dozes;   /* dozes the worker began */
  ofl_status_t error;           /* first asynchronous error (first wins) */
  atomic_bool has_error;        /* error set; read without mu */
  char error_msg[512];
} host_stream_t;

static inline uint64_t spin_ns_of(const ofl_device_t *dev) {
  return (uint64_t)dev->cfg.spin_us * 1000u;
}

static inline uint64_t doze_ns_of(const ofl_device_t *dev) {
  return (uint64_t)dev->cfg.doze_us * 1000u;
}

/* ---- bounded waits ------------------------------------------------------ */
#define WAIT_SLICE_NS 20000000ull /* a waiting worker checks for stop */

/* The condition variables of the backend time their waits on CLOCK_MONOTONIC,
 * the clock of ofl__now_ns and of every deadline: a wall-clock step (NTP, a
 * resumed virtual machine) must not stretch a wait (a doze that nobody
 * signals, POSIX pthread_condattr_setclock). */
static inline void ofl__host_cond_init(pthread_cond_t *cv) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &a);
  pthread_condattr_destroy(&a);
}

/* One slice of a bounded wait on cv (mu held; cv made by ofl__host_cond_init):
 * until deadline_ns or WAIT_SLICE_NS from now, whichever is first, so that
 * callers re-check their condition, the deadline and stop flags in
 * slices. */
static inline void ofl__host_cond_wait_until(pthread_cond_t *cv,
                                             pthread_mutex_t *mu,
                                             uint64_t now_ns,
                                             uint64_t deadline_ns) {
  uint64_t slice = deadline_ns > now_ns ? deadline_ns - now_ns : 0;
  if (slice > WAIT_SLICE_NS)
    slice = WAIT_SLICE_NS;
  uint64_t until = ofl__now_ns() + slice;
  struct timespec ts = {(time_t)(until / 1000000000ull),
                        (long)(until % 1000000000ull)};
  pthread_cond_timedwait(cv, mu, &ts);
}

/* ---- memory (host_memory.c) ---------------------------------------------- */
/* The block registry: made at device open, freed with the blocks still in
 * it at close (the backend's close). */
ofl_status_t ofl__host_registry_open(ofl_device_t *dev);
void ofl__host_registry_close(ofl_device_t *dev);
ofl_status_t ofl__host_device_malloc(ofl_device_t *dev, size_t bytes,
                                     void **out);
ofl_status_t ofl__host_device_free(ofl_device_t *dev, void *ptr, size_t *bytes);
ofl_status_t ofl__host_pinned_malloc(ofl_device_t *dev, size_t bytes,
                                     void **out);
ofl_status_t ofl__host_pinned_free(ofl_device_t *dev, void *ptr, size_t *bytes);
size_t ofl__host_inflight(ofl_device_t *dev, const void *ptr, size_t bytes);
bool ofl__host_device_owns(ofl_device_t *dev, const void *ptr, size_t bytes);
void ofl__host_adopt_host_memory(ofl_device_t *dev, bool on);
/* Checks a copy's ranges against its kind (device memory of this device or
 * not, within its block) and takes an inflight reference on the blocks they
 * lie in: blk[0] the destination's, blk[1] the source's (NULL: none). */
ofl_status_t ofl__host_claim_copy(ofl_stream_t *s, void *dst, const void *src,
                                  size_t bytes, ofl_copy_kind_t kind,
                                  hblock_t *blk[2]);
/* The same for a memset's range: *out its block (NULL: none). */
ofl_status_t ofl__host_claim_fill(ofl_stream_t *s, void *dst, size_t bytes,
                                  hblock_t **out);
/* Drops the inflight references of a finished operation (NULL entries:
 * none), waking a free that waits for them. */
void ofl__host_unclaim(ofl_device_t *dev, hblock_t *const blk[2]);

/* ---- events (host_event.c) ----------------------------------------------- */
ofl_status_t ofl__host_event_create(ofl_event_t *e);
ofl_status_t ofl__host_event_create_timed(ofl_event_t *e);
void ofl__host_event_destroy(ofl_event_t *e);
ofl_status_t ofl__host_event_query(ofl_event_t *e);
ofl_status_t ofl__host_event_elapsed_ns(ofl_event_t *a, ofl_event_t *b,
                                        uint64_t *ns);
/* Drops a reference (the handle's, a queued record's or wait's); the last
 * frees the event. */
void ofl__host_event_unref(host_event_t *he);
/* Numbers the next record of he (he->mu held); 0 when out of memory. */
uint64_t ofl__host_event_number_locked(host_event_t *he, ofl_stream_t *s);
/* Record `target` reached (he->mu held). */
bool ofl__host_event_reached_locked(const host_event_t *he, uint64_t target);
/* Record `target` reached; without he->mu unless records completed out of
 * order (one event recorded on several streams). */
bool ofl__host_event_reached_now(host_event_t *he, uint64_t target);
/* Reaches record `target` (he->mu held); true when a thread sleeps on
 * he->cv (the caller wakes it after unlocking). */
bool ofl__host_event_complete_locked(host_event_t *he, uint64_t target);

static inline uint64_t ev_completed(const host_event_t *he) {
  return atomic_load_explicit(&he->completed, memory_order_acquire);
}

static inline uint64_t ev_recorded(const host_event_t *he) {
  return atomic_load_explicit(&he->recorded, memory_order_acquire);
}

/* ---- streams (host_stream.c) --------------------------------------------- */
ofl_status_t ofl__host_stream_create(ofl_stream_t *s);
ofl_status_t ofl__host_stream_destroy(ofl_stream_t *s);
ofl_status_t ofl__host_stream_synchronize(ofl_stream_t *s, int64_t timeout_ms);
ofl_status_t ofl__host_stream_query(ofl_stream_t *s);
/* Drops a reference (the handle's, an event's); the last frees it. */
void ofl__host_stream_unref(host_stream_t *hs);
/* Runs op on the calling thread (not a record: finish_head reaches those). */
void ofl__host_execute(host_stream_t *hs, op_t *op);
/* Drops what a finished op held: its event reference and the inflight
 * counts of its blocks. */
void ofl__host_op_release(ofl_device_t *dev, op_t *op);
/* Starts, runs and finishes the head op (mu held on entry and exit; busy
 * was clear): the one step of the worker, of a waiter that steals and of a
 * submitter that runs its operation inline. */
void ofl__host_run_head_locked(host_stream_t *hs, op_t *op);
/* Wakes the worker if it sleeps and nobody woke it yet, or if it dozes
 * with more than cfg.doze_us left (mu held): a start waits no longer. */
void ofl__host_wake_worker_locked(host_stream_t *hs);
/* A thread done taking work hands what is left back to the worker (mu
 * held). */
void ofl__host_steal_end_locked(host_stream_t *hs);

ofl_status_t ofl__host_event_synchronize(ofl_event_t *e, int64_t timeout_ms);
/* An application thread's wait for record `target` of he, taking the
 * operations it waits for off their stream when the worker has not started
 * them. */
bool ofl__host_wait_record(host_event_t *he, uint64_t target,
                           int64_t timeout_ms, uint64_t spin_ns);

/* ---- submission (host_submit.c) ------------------------------------------ */
ofl_status_t ofl__host_memcpy_async(void *dst, const void *src, size_t bytes,
                                    ofl_copy_kind_t kind, ofl_stream_t *s);
ofl_status_t ofl__host_memset_async(void *dst, int value, size_t bytes,
                                    ofl_stream_t *s);
ofl_status_t ofl__host_event_record(ofl_event_t *e, ofl_stream_t *s);
ofl_status_t ofl__host_stream_wait_event(ofl_stream_t *s, ofl_event_t *e);
ofl_status_t ofl__host_launch_host_func(ofl_stream_t *s, ofl_host_fn fn,
                                        void *arg);
ofl_status_t ofl__host_launch_release(ofl_stream_t *s, ofl_host_fn fn,
                                      void *arg);

#endif /* OFL_RUNTIME_HOST_H */
