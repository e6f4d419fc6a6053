/* cudasim: stream capture into graphs (the basic model: a graph is its
 * captured operations in record order) and graph launch. */
#include "cudart_internal.h"

/* ---- graph capture (basic model)
 * ----------------------------------------------- Operations queued on a
 * capturing stream (and on streams that joined it by waiting for an event
 * recorded in it) become graph nodes in record order; a launch queues clones of
 * them, in that order, on the launch stream. */

EXPORT cudaError_t cudaStreamBeginCapture(cudaStream_t stream,
                                          enum cudaStreamCaptureMode mode) {
  ENTER("cudaStreamBeginCapture");
  NEED_CTX();
  if (stream == NULL || stream == cudaStreamLegacy)
    return fail(cudaErrorStreamCaptureUnsupported);
  if (mode != cudaStreamCaptureModeGlobal &&
      mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed)
    return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int r = stream_get_locked(stream, &s, "cudaStreamBeginCapture");
  if (!r && s->cap)
    r = cudaErrorIllegalState;
  if (!r) {
    capture_t *c = xcalloc(1, sizeof *c);
    c->mode = mode;
    c->active = 1;
    c->id = ++g.capture_ids;
    c->origin = s;
    c->thread = pthread_self();
    c->graph = xcalloc(1, sizeof *c->graph);
    c->graph->magic = GRAPH_MAGIC;
    c->next = g.captures; /* kept (inactive) after the end: events point here */
    g.captures = c;
    s->cap = c;
  }
  pthread_mutex_unlock(&g.mu);
  return fail(r);
}

static void graph_free(cgraph_t *gr) {
  for (int i = 0; i < gr->n; i++)
    op_free(gr->ops[i]);
  free(gr->ops);
  gr->magic = DEAD_MAGIC;
  free(gr);
}

EXPORT cudaError_t cudaStreamEndCapture(cudaStream_t stream,
                                        cudaGraph_t *pGraph) {
  ENTER("cudaStreamEndCapture");
  NEED_CTX();
  if (!pGraph)
    return fail(cudaErrorInvalidValue);
  *pGraph = NULL;
  if (stream == NULL || stream == cudaStreamLegacy)
    return fail(cudaErrorIllegalState);
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int r = stream_get_locked(stream, &s, "cudaStreamEndCapture");
  capture_t *c = r ? NULL : s->cap;
  if (!r && !c)
    r = cudaErrorIllegalState;
  else if (!r && c->origin != s)
    c->invalidated = 1, r = cudaErrorStreamCaptureUnmatched;
  else if (!r && c->mode == cudaStreamCaptureModeThreadLocal &&
           !pthread_equal(c->thread, pthread_self()))
    r = cudaErrorStreamCaptureWrongThread;
  if (!r) {
    for (cstream_t *t = g.streams; t; t = t->next_all)
      if (t->cap == c)
        t->cap = NULL;
    c->active = 0;
    if (c->invalidated) {
      graph_free(c->graph);
      r = cudaErrorStreamCaptureInvalidated;
    } else {
      *pGraph = (cudaGraph_t)c->graph;
    }
    c->graph = NULL;
  }
  pthread_mutex_unlock(&g.mu);
  return fail(r);
}

static int capture_status(cudaStream_t stream, enum cudaStreamCaptureStatus *st,
                          unsigned long long *id, cudaGraph_t *graph,
                          const char *api) {
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int r = stream_get_locked(stream, &s, api);
  if (!r) {
    capture_t *c = s->cap;
    *st = !c               ? cudaStreamCaptureStatusNone
          : c->invalidated ? cudaStreamCaptureStatusInvalidated
                           : cudaStreamCaptureStatusActive;
    if (id)
      *id = c ? c->id : 0;
    if (graph)
      *graph = c ? (cudaGraph_t)c->graph : NULL;
  }
  pthread_mutex_unlock(&g.mu);
  return r;
}

EXPORT cudaError_t
cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  ENTER("cudaThreadExchangeStreamCaptureMode");
  if (!mode || (*mode != cudaStreamCaptureModeGlobal &&
                *mode != cudaStreamCaptureModeThreadLocal &&
                *mode != cudaStreamCaptureModeRelaxed))
    return fail(cudaErrorInvalidValue);
  int prev = t_capture_mode;
  t_capture_mode = (int)*mode;
  *mode = (enum cudaStreamCaptureMode)prev;
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                         enum cudaStreamCaptureStatus *status) {
  ENTER("cudaStreamIsCapturing");
  NEED_CTX();
  if (!status)
    return fail(cudaErrorInvalidValue);
  return fail(
      capture_status(stream, status, NULL, NULL, "cudaStreamIsCapturing"));
}

EXPORT cudaError_t cudaStreamGetCaptureInfo(
    cudaStream_t stream, enum cudaStreamCaptureStatus *captureStatus_out,
    unsigned long long *id_out, cudaGraph_t *graph_out,
    const cudaGraphNode_t **dependencies_out,
    const cudaGraphEdgeData **edgeData_out, size_t *numDependencies_out) {
  ENTER("cudaStreamGetCaptureInfo");
  NEED_CTX();
  if (!captureStatus_out)
    return fail(cudaErrorInvalidValue);
  if (dependencies_out)
    *dependencies_out = NULL; /* nodes are not modelled */
  if (edgeData_out)
    *edgeData_out = NULL;
  if (numDependencies_out)
    *numDependencies_out = 0;
  return fail(capture_status(stream, captureStatus_out, id_out, graph_out,
                             "cudaStreamGetCaptureInfo"));
}

EXPORT cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec,
                                        cudaGraph_t graph,
                                        unsigned long long flags) {
  ENTER("cudaGraphInstantiate");
  NEED_CTX();
  (void)flags;
  cgraph_t *gr = (cgraph_t *)graph;
  if (!pGraphExec || !gr || gr->magic != GRAPH_MAGIC)
    return fail(cudaErrorInvalidValue);
  cgraph_t *x = xcalloc(1, sizeof *x);
  x->magic = GRAPH_MAGIC;
  for (int i = 0; i < gr->n; i++)
    graph_append(x, op_clone(gr->ops[i]));
  *pGraphExec = (cudaGraphExec_t)x;
  return cudaSuccess;
}

EXPORT cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec,
                                   cudaStream_t stream) {
  ENTER("cudaGraphLaunch");
  NEED_CTX();
  cgraph_t *x = (cgraph_t *)graphExec;
  if (!x || x->magic != GRAPH_MAGIC)
    return fail(cudaErrorInvalidResourceHandle);
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int r = stream_get_locked(stream, &s, "cudaGraphLaunch");
  for (int i = 0; !r && i < x->n; i++)
    push_locked(s, op_clone(x->ops[i]));
  pthread_mutex_unlock(&g.mu);
  return fail(r);
}

EXPORT cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  ENTER("cudaGraphExecDestroy");
  cgraph_t *x = (cgraph_t *)graphExec;
  if (!x || x->magic != GRAPH_MAGIC)
    return fail(cudaErrorInvalidResourceHandle);
  graph_free(x);
  return cudaSuccess;
}

EXPORT cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  ENTER("cudaGraphDestroy");
  cgraph_t *gr = (cgraph_t *)graph;
  if (!gr || gr->magic != GRAPH_MAGIC)
    return fail(cudaErrorInvalidValue);
  graph_free(gr);
  return cudaSuccess;
}
