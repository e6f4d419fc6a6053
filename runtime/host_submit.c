/* ofl: the host backend's submission: an operation runs at once on the
 * compute stream, else is queued on its worker stream, or runs on the
 * submitting thread when the stream is idle and the operation is small
 * (OFL_HOST_INLINE_BYTES); copies and memsets first take their blocks. */
#include <stdlib.h>

#include "runtime/host.h"
#include "runtime/queue.h"

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
  OFL_FIFO_PUSH(hs->head, hs->tail, q, next);
  hs->enqueued++;
  atomic_store_explicit(&hs->enqueued_seen, hs->enqueued, memory_order_release);
  if (wake)
    ofl__host_wake_worker_locked(hs);
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
  return !(c->link_h2d_bps > 0 || c->link_d2h_bps > 0 || c->link_total_bps > 0);
}

static ofl_status_t no_slot(ofl_stream_t *s) {
  return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                    "cannot queue an operation on stream '%s'", s->name);
}

/* Runs q, just queued as the head of an idle stream, on the calling thread
 * (inline_ok_locked; mu held on entry and exit). What other threads queued
 * behind it meanwhile found the stream busy: the worker, which may have
 * gone to sleep on busy, is woken for it (ofl__host_steal_end_locked). */
static void run_inline_locked(host_stream_t *hs, op_t *q) {
  atomic_fetch_add_explicit(&hs->inlined, 1, memory_order_relaxed);
  ofl__host_run_head_locked(hs, q);
  ofl__host_steal_end_locked(hs);
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
    ofl__host_execute(hs, op);
    ofl__host_op_release(s->dev, op);
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
  ofl__host_op_release(s->dev, op);
  return no_slot(s);
}

ofl_status_t ofl__host_memcpy_async(void *dst, const void *src, size_t bytes,
                                    ofl_copy_kind_t kind, ofl_stream_t *s) {
  hblock_t *blk[2];
  ofl_status_t st = ofl__host_claim_copy(s, dst, src, bytes, kind, blk);
  if (st != OFL_SUCCESS)
    return st;
  op_t op = {.type = OP_COPY,
             .kind = kind,
             .dst = dst,
             .src = src,
             .bytes = bytes,
             .blk = {blk[0], blk[1]}};
  return submit(s, &op);
}

ofl_status_t ofl__host_memset_async(void *dst, int value, size_t bytes,
                                    ofl_stream_t *s) {
  hblock_t *b;
  ofl_status_t st = ofl__host_claim_fill(s, dst, bytes, &b);
  if (st != OFL_SUCCESS)
    return st;
  op_t op = {.type = OP_MEMSET,
             .dst = dst,
             .value = value,
             .bytes = bytes,
             .blk = {b, NULL}};
  return submit(s, &op);
}

ofl_status_t ofl__host_event_record(ofl_event_t *e, ofl_stream_t *s) {
  host_event_t *he = e->impl;
  host_stream_t *hs = s->impl;
  if (s->is_compute) {
    /* Everything before it on this stream has run: number the record and
     * reach it in one step. */
    pthread_mutex_lock(&he->mu);
    uint64_t target = ofl__host_event_number_locked(he, s);
    bool wake = target != 0 && ofl__host_event_complete_locked(he, target);
    host_stream_t *old = NULL;
    if (target != 0) {
      old = he->last_stream;
      he->last_stream = NULL;
    }
    pthread_mutex_unlock(&he->mu);
    if (wake)
      pthread_cond_broadcast(&he->cv);
    if (old != NULL)
      ofl__host_stream_unref(old);
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
    target = ofl__host_event_number_locked(he, s);
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
    ofl__host_stream_unref(old);
  if (q == NULL)
    return no_slot(s);
  return target != 0 ? OFL_SUCCESS : OFL_ERR_NO_MEMORY;
}

ofl_status_t ofl__host_stream_wait_event(ofl_stream_t *s, ofl_event_t *e) {
  host_event_t *he = e->impl;
  uint64_t target = ev_recorded(he);
  if (ofl__host_event_reached_now(he, target))
    return OFL_SUCCESS;
  if (s->is_compute) {
    /* The compute stream is the calling thread: block it, with a timeout. */
    uint64_t t0 = ofl__now_ns();
    if (!ofl__host_wait_record(he, target, -1, spin_ns_of(s->dev)))
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

ofl_status_t ofl__host_launch_host_func(ofl_stream_t *s, ofl_host_fn fn,
                                        void *arg) {
  op_t op = {.type = OP_HOSTFN, .fn = fn, .arg = arg};
  return submit(s, &op);
}

ofl_status_t ofl__host_launch_release(ofl_stream_t *s, ofl_host_fn fn,
                                      void *arg) {
  op_t op = {.type = OP_HOSTFN, .fn = fn, .arg = arg, .any_thread = true};
  return submit(s, &op);
}
