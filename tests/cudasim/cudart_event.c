/* cudasim: events (markers in a stream) and cross-stream waits. */
#include "cudart_internal.h"

/* ---- events
 * ------------------------------------------------------------------ */

/* Destroyed events wait in a quarantine before their memory is reused, so
 * that a use after cudaEventDestroy is reported rather than aliased. */
#define EVENT_QUARANTINE 1024
static cevent_t *ev_quarantine[EVENT_QUARANTINE]; /* g.mu */
static unsigned ev_quarantine_pos;

static int event_get_locked(cudaEvent_t h, cevent_t **out, const char *api) {
  cevent_t *e = (cevent_t *)h;
  if (!e || e->magic != EVENT_MAGIC) {
    misuse("%s: event %p is not a live event (destroyed?)", api, (void *)h);
    return cudaErrorInvalidResourceHandle;
  }
  *out = e;
  return 0;
}

EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event,
                                            unsigned int flags) {
  ENTER("cudaEventCreateWithFlags");
  NEED_CTX();
  unsigned known =
      cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (!event || (flags & ~known) ||
      ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)))
    return fail(cudaErrorInvalidValue);
  cevent_t *e = xcalloc(1, sizeof *e);
  e->magic = EVENT_MAGIC;
  e->dev = t_dev;
  e->flags = flags;
  *event = (cudaEvent_t)e;
  return cudaSuccess;
}

EXPORT cudaError_t cudaEventCreate(cudaEvent_t *event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) {
  ENTER("cudaEventDestroy");
  NEED_CTX();
  pthread_mutex_lock(&g.mu);
  cevent_t *e;
  int r = event_get_locked(event, &e, "cudaEventDestroy");
  if (!r) {
    e->magic = DEAD_MAGIC;
    marker_unref(e->marker);
    e->marker = NULL;
    unsigned i = ev_quarantine_pos++ % EVENT_QUARANTINE;
    free(ev_quarantine[i]);
    ev_quarantine[i] = e;
  }
  pthread_mutex_unlock(&g.mu);
  return fail(r);
}

EXPORT cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  ENTER("cudaEventRecord");
  NEED_CTX();
  pthread_mutex_lock(&g.mu);
  cevent_t *e;
  cstream_t *s;
  int r = event_get_locked(event, &e, "cudaEventRecord");
  if (!r)
    r = stream_get_locked(stream, &s, "cudaEventRecord");
  if (!r && e->dev != s->dev) {
    misuse("cudaEventRecord: event of device %d recorded on a stream of "
           "device %d",
           e->dev, s->dev);
    r = cudaErrorInvalidResourceHandle;
  }
  if (!r && s->cap) {
    e->cap = s->cap; /* a fork/join point of the capture, not a node */
  } else if (!r) {
    op_t *op = op_new(OP_NOP, "cudaEventRecord");
    op->marker = marker_new();
    marker_unref(e->marker);
    e->marker = marker_ref(op->marker);
    e->cap = NULL;
    push_locked(s, op);
  }
  pthread_mutex_unlock(&g.mu);
  return fail(r);
}

/* The marker of an event for a query or a synchronize; an event recorded in
 * an active capture cannot be waited for (invalidates it). */
static int event_marker(cudaEvent_t event, marker_t **m, const char *api) {
  pthread_mutex_lock(&g.mu);
  cevent_t *e;
  int r = event_get_locked(event, &e, api);
  if (!r && e->cap && e->cap->active) {
    e->cap->invalidated = 1;
    r = cudaErrorStreamCaptureUnsupported;
  }
  if (!r)
    *m = marker_ref(e->marker);
  pthread_mutex_unlock(&g.mu);
  return r;
}

EXPORT cudaError_t cudaEventQuery(cudaEvent_t event) {
  ENTER("cudaEventQuery");
  NEED_CTX();
  marker_t *m;
  int r = event_marker(event, &m, "cudaEventQuery");
  if (r)
    return fail(r);
  r = marker_done(m) ? cudaSuccess : cudaErrorNotReady;
  marker_unref(m);
  return fail(r);
}

EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  ENTER("cudaEventSynchronize");
  NEED_CTX();
  marker_t *m;
  int r = event_marker(event, &m, "cudaEventSynchronize");
  if (r)
    return fail(r);
  marker_wait(m);
  marker_unref(m);
  return cudaSuccess;
}

EXPORT cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start,
                                        cudaEvent_t end) {
  ENTER("cudaEventElapsedTime");
  NEED_CTX();
  if (!ms)
    return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&g.mu);
  cevent_t *a, *b;
  int r = event_get_locked(start, &a, "cudaEventElapsedTime");
  if (!r)
    r = event_get_locked(end, &b, "cudaEventElapsedTime");
  if (!r && ((a->flags | b->flags) & cudaEventDisableTiming))
    r = cudaErrorInvalidResourceHandle;
  else if (!r && (!a->marker || !b->marker))
    r = cudaErrorInvalidResourceHandle;
  else if (!r && (!marker_done(a->marker) || !marker_done(b->marker)))
    r = cudaErrorNotReady;
  if (!r)
    *ms =
        (float)((double)((int64_t)b->marker->t_ns - (int64_t)a->marker->t_ns) /
                1e6);
  pthread_mutex_unlock(&g.mu);
  return fail(r);
}

/* Waits for the event's marker as of this call: a later re-record does not
 * change what is waited for; a never-recorded event is no wait at all. */
EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                       unsigned int flags) {
  ENTER("cudaStreamWaitEvent");
  NEED_CTX();
  if (flags & ~(unsigned)cudaEventWaitExternal)
    return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&g.mu);
  cevent_t *e;
  cstream_t *s;
  int r = event_get_locked(event, &e, "cudaStreamWaitEvent");
  if (!r)
    r = stream_get_locked(stream, &s, "cudaStreamWaitEvent");
  if (!r && e->cap && e->cap->active) {
    if (!s->cap)
      s->cap = e->cap; /* joins the capture (fork) */
    else if (s->cap != e->cap)
      s->cap->invalidated = 1, r = cudaErrorStreamCaptureIsolation;
    /* same capture: graph order is record order, nothing to add */
  } else if (!r && s->cap && e->marker) {
    s->cap->invalidated = 1;
    r = cudaErrorStreamCaptureIsolation;
  } else if (!r && e->marker) {
    op_t *op = op_new(OP_NOP, "cudaStreamWaitEvent");
    op_add_pre(op, e->marker);
    push_locked(s, op);
  }
  pthread_mutex_unlock(&g.mu);
  return fail(r);
}
