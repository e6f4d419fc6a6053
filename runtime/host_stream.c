/* ofl: the host backend's streams: a worker thread per stream that runs
 * its FIFO (with a poll, timed dozes and a sleep between bursts), the
 * strict-mode jitter before each operation, the link model's pacing of
 * copies, and the waits on a stream or an event with work stealing: a
 * thread that waits runs the operations the worker has not started. */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/host.h"
#include "runtime/queue.h"

#define LINK_SLICE (1u << 20)
#define DOZE_WINDOW_NS 20000000ull /* worker_main: dozes this long at most */
#define DOZES_BEFORE_BACKOFF 9     /* worker_main: dozes of OFL_HOST_DOZE_US */

static bool event_wait(host_event_t *he, uint64_t target, int64_t timeout_ms,
                       uint64_t spin_ns, const atomic_bool *stop,
                       host_stream_t *from);
static host_stream_t *record_stream(host_event_t *he, uint64_t target);
static void steal(host_stream_t *hs, host_event_t *he, uint64_t target,
                  uint64_t deadline, int depth);

static uint64_t next_rand(uint64_t *s) {
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

/* Sleeps up to ns for an operation of the stream (on its worker, or on a
 * waiter that took the operation: steal), waking early when the
 * stream is destroyed (destroy sets stop and broadcasts work_cv under mu): a
 * jitter or link-model pause of minutes must not make destroy hang. Other
 * wake-ups of work_cv (a producer's, a waiter's hand-back to the worker) only
 * make it check the time again. Returns false when stopped. */
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
    ofl__host_cond_wait_until(&hs->work_cv, &hs->mu, now, until);
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

void ofl__host_execute(host_stream_t *hs, op_t *op) {
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
    if (!event_wait(op->ev, op->target, -1, spin_ns_of(dev), &hs->stop, NULL)) {
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
void ofl__host_op_release(ofl_device_t *dev, op_t *op) {
  if (op->ev != NULL) {
    ofl__host_event_unref(op->ev);
    op->ev = NULL;
  }
  ofl__host_unclaim(dev, op->blk);
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
    ofl__host_execute(hs, op);
  }
  ofl__host_op_release(hs->s->dev, op);
}

/* Takes the finished head off the queue (mu held), reaches its record and
 * wakes whoever waits for it (synchronize: for an empty queue). */
static void finish_head_locked(host_stream_t *hs, op_t *op,
                               host_event_t *reached, uint64_t target) {
  OFL_FIFO_POP(hs->head, hs->tail, op, next); /* op is the head */
  op->next = hs->free_ops;
  hs->free_ops = op;
  hs->completed++;
  atomic_store_explicit(&hs->completed_seen, hs->completed,
                        memory_order_release);
  atomic_store(&hs->busy, false);
  if (reached != NULL) { /* lock order: stream, then event */
    pthread_mutex_lock(&reached->mu);
    bool wake = ofl__host_event_complete_locked(reached, target);
    pthread_mutex_unlock(&reached->mu);
    if (wake)
      pthread_cond_broadcast(&reached->cv);
    ofl__host_event_unref(reached);
  }
  if (hs->head == NULL && hs->idle_waiters > 0)
    pthread_cond_broadcast(&hs->idle_cv);
}

/* Starts, runs and finishes the head op (mu held on entry and exit; busy
 * was clear): the one step of the worker and of a waiter that steals. */
void ofl__host_run_head_locked(host_stream_t *hs, op_t *op) {
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
        ofl__host_cond_wait_until(&hs->worker_cv, &hs->mu, now, hs->doze_until);
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
    ofl__host_run_head_locked(hs, hs->head);
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
  if (op->type == OP_WAIT && !ofl__host_event_reached_now(op->ev, op->target))
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
    if (he != NULL && ofl__host_event_reached_now(he, target))
      return;
    op_t *op = hs->head;
    if (stealable_locked(hs, op, deadline)) {
      atomic_fetch_add_explicit(&hs->stolen, 1, memory_order_relaxed);
      ofl__host_run_head_locked(hs, op);
      continue;
    }
    if (op->type != OP_WAIT || depth >= STEAL_HOPS ||
        ofl__host_event_reached_now(op->ev, op->target))
      return;
    host_event_t *up_ev = op->ev;
    uint64_t up_target = op->target;
    host_stream_t *up = record_stream(up_ev, up_target);
    if (up == NULL || up == hs) {
      if (up != NULL)
        ofl__host_stream_unref(up);
      return;
    }
    atomic_fetch_add(&up_ev->refs, 1); /* the op may complete meanwhile */
    pthread_mutex_unlock(&hs->mu);
    steal(up, up_ev, up_target, deadline, depth + 1);
    bool reached = ofl__host_event_reached_now(up_ev, up_target);
    ofl__host_event_unref(up_ev);
    ofl__host_stream_unref(up);
    pthread_mutex_lock(&hs->mu);
    if (!reached)
      return; /* that stream's worker has it: wait for it */
  }
}

/* Wakes the worker if it sleeps and nobody woke it yet, or if it dozes
 * with more than cfg.doze_us left (mu held): a start waits no longer. */
void ofl__host_wake_worker_locked(host_stream_t *hs) {
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
void ofl__host_steal_end_locked(host_stream_t *hs) {
  if (hs->head != NULL || atomic_load(&hs->stop))
    ofl__host_wake_worker_locked(hs);
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
  ofl__host_steal_end_locked(hs);
  pthread_mutex_unlock(&hs->mu);
}

void ofl__host_stream_hold(ofl_stream_t *s, bool hold) {
  host_stream_t *hs = s->impl;
  if (s->dev->backend != OFL_BACKEND_HOST || !hs->has_thread)
    return;
  pthread_mutex_lock(&hs->mu);
  hs->held = hold;
  if (!hold)
    ofl__host_wake_worker_locked(hs);
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

void ofl__host_stream_unref(host_stream_t *hs) {
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

ofl_status_t ofl__host_stream_create(ofl_stream_t *s) {
  host_stream_t *hs = calloc(1, sizeof *hs);
  if (hs == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate stream '%s'", s->name);
  hs->s = s;
  pthread_mutex_init(&hs->mu, NULL);
  ofl__host_cond_init(&hs->worker_cv);
  ofl__host_cond_init(&hs->work_cv);
  ofl__host_cond_init(&hs->idle_cv);
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

ofl_status_t ofl__host_stream_synchronize(ofl_stream_t *s, int64_t timeout_ms) {
  host_stream_t *hs = s->impl;
  uint64_t deadline = ofl__deadline_ns(timeout_ms);
  pthread_mutex_lock(&hs->mu);
  while (hs->completed < hs->enqueued && hs->has_thread) {
    /* The queue's operations that the worker has not started yet run here
     * (steal_locked); what is left is the worker's. */
    steal_locked(hs, NULL, 0, deadline, 0);
    ofl__host_steal_end_locked(hs);
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
    ofl__host_cond_wait_until(&hs->idle_cv, &hs->mu, now, deadline);
    hs->idle_waiters--;
  }
  pthread_mutex_unlock(&hs->mu);
  return take_async_error(hs);
}

ofl_status_t ofl__host_stream_query(ofl_stream_t *s) {
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
ofl_status_t ofl__host_stream_destroy(ofl_stream_t *s) {
  host_stream_t *hs = s->impl;
  ofl_status_t st = OFL_SUCCESS;
  if (hs->has_thread) {
    st = ofl__host_stream_synchronize(s, ofl__timeout_ms(-1));
    pthread_mutex_lock(&hs->mu);
    atomic_store(&hs->stop, true);
    pthread_cond_broadcast(&hs->work_cv);
    if (hs->worker_dozing)
      pthread_cond_signal(&hs->worker_cv);
    ofl__host_wake_worker_locked(hs);
    pthread_mutex_unlock(&hs->mu);
    pthread_join(hs->thread, NULL);
  }
  /* Events whose latest record was here keep the struct (stopped: no
   * waiter takes work from it) until they are recorded again or freed. */
  ofl__host_stream_unref(hs);
  return st;
}

/* ---- waits on events ------------------------------------------------ */

/* Waits until record `target` completed; false on timeout or stop. The
 * deadline (timeout_ms < 0: OFL_WAIT_TIMEOUT_MS) is resolved only when the
 * record is not complete yet. Polls for up to spin_ns before sleeping:
 * a copy of a small tensor completes in less than a futex round trip. A
 * waiter that is not a worker names the stream of the record (from, else
 * NULL) and runs the operations the record waits for itself while that
 * stream's worker has not started them (steal): the waiter does not
 * pay the worker's wake-up. */
static bool event_wait(host_event_t *he, uint64_t target, int64_t timeout_ms,
                       uint64_t spin_ns, const atomic_bool *stop,
                       struct host_stream *from) {
  if (ofl__host_event_reached_now(he, target))
    return true;
  uint64_t deadline = ofl__deadline_ns(timeout_ms);
  if (from != NULL) {
    steal(from, he, target, deadline, 0);
    if (ofl__host_event_reached_now(he, target))
      return true;
  }
  if (spin_ns > 0) {
    uint64_t until = ofl__now_ns() + spin_ns;
    while (!ofl__host_event_reached_now(he, target) &&
           (stop == NULL || !atomic_load(stop)) && ofl__now_ns() < until) {
      if (from != NULL)
        steal(from, he, target, deadline, 0);
      sched_yield();
    }
  }
  pthread_mutex_lock(&he->mu);
  while (!ofl__host_event_reached_locked(he, target)) {
    uint64_t now = ofl__now_ns();
    if (now >= deadline || (stop != NULL && atomic_load(stop))) {
      pthread_mutex_unlock(&he->mu);
      return false;
    }
    he->sleepers++;
    ofl__host_cond_wait_until(&he->cv, &he->mu, now, deadline);
    he->sleepers--;
  }
  pthread_mutex_unlock(&he->mu);
  return true;
}

/* Record `target` of he and the worker stream it was queued on (a
 * reference the caller drops with ofl__host_stream_unref; NULL when it was on
 * the compute stream or the record is not the latest any more). */
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
bool ofl__host_wait_record(host_event_t *he, uint64_t target,
                           int64_t timeout_ms, uint64_t spin_ns) {
  if (ofl__host_event_reached_now(he, target))
    return true;
  host_stream_t *from = record_stream(he, target);
  bool done = event_wait(he, target, timeout_ms, spin_ns, NULL, from);
  if (from != NULL)
    ofl__host_stream_unref(from);
  return done;
}

ofl_status_t ofl__host_event_synchronize(ofl_event_t *e, int64_t timeout_ms) {
  host_event_t *he = e->impl;
  if (!ofl__host_wait_record(he, ev_recorded(he), timeout_ms,
                             spin_ns_of(e->dev)))
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                      "event not complete after %lld ms; is its stream "
                      "blocked on a wait that never completes?",
                      (long long)timeout_ms);
  return OFL_SUCCESS;
}
