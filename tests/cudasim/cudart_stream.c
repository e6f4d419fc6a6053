/* cudasim: operations, the one host-function thread, streams (a worker
 * thread each, with jitter) and the stream API. */
#include "cudart_internal.h"

/* ---- operations and the host-function thread ------------------------------
 */

op_t *op_new(enum op_kind kind, const char *what) {
  op_t *op = xcalloc(1, sizeof *op);
  op->kind = kind;
  op->what = what;
  op->dst_dev = op->src_dev = -1;
  return op;
}

void op_free(op_t *op) {
  for (int i = 0; i < op->npre; i++)
    marker_unref(op->pre[i]);
  free(op->pre);
  free(op->staging);
  free(op->kargs);
  marker_unref(op->marker);
  free(op);
}

void op_add_pre(op_t *op, marker_t *m) {
  op->pre = realloc(op->pre, (size_t)(op->npre + 1) * sizeof *op->pre);
  if (!op->pre)
    abort();
  op->pre[op->npre++] = marker_ref(m);
}

op_t *op_clone(const op_t *t) {
  op_t *op = xcalloc(1, sizeof *op);
  *op = *t;
  op->next = NULL;
  op->marker = NULL;
  op->pre = NULL;
  op->npre = 0;
  op->staging = NULL;
  op->abort_flag = 0;
  if (t->kargs) {
    op->kargs = xcalloc(1, t->kargs_bytes ? t->kargs_bytes : 1);
    memcpy(op->kargs, t->kargs, t->kargs_bytes);
  }
  return op;
}

typedef struct cb_item {
  struct cb_item *next;
  op_t *op;
  int done;
} cb_item_t;
static cb_item_t *cb_head, *cb_tail; /* g.cb_mu */

/* The one host-function thread: host functions run there, one at a time, in
 * the order the streams reach them; it may not call CUDA (t_in_cb). */
static void *cb_main(void *unused) {
  (void)unused;
  t_in_cb = 1;
  pthread_mutex_lock(&g.cb_mu);
  for (;;) {
    while (!cb_head)
      pthread_cond_wait(&g.cb_cv, &g.cb_mu);
    cb_item_t *it = cb_head;
    cb_head = it->next;
    if (!cb_head)
      cb_tail = NULL;
    pthread_mutex_unlock(&g.cb_mu);
    it->op->fn(it->op->arg);
    STAT_ADD(host_fn_calls, 1);
    pthread_mutex_lock(&g.cb_mu);
    it->done = 1;
    pthread_cond_broadcast(&g.cb_cv);
  }
  return NULL;
}

static void run_host_fn(op_t *op) {
  cb_item_t it = {NULL, op, 0};
  pthread_mutex_lock(&g.cb_mu);
  if (!g.cb_started) {
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, cb_main, NULL) != 0)
      abort();
    pthread_attr_destroy(&at);
    g.cb_started = 1;
  }
  if (cb_tail)
    cb_tail->next = &it;
  else
    cb_head = &it;
  cb_tail = &it;
  pthread_cond_broadcast(&g.cb_cv);
  while (!it.done)
    pthread_cond_wait(&g.cb_cv, &g.cb_mu);
  pthread_mutex_unlock(&g.cb_mu);
}

/* Resolves one side of a copy at execution time: its memory must still be
 * live (device) or still pinned (pinned host). */
static char *exec_side(void *p, size_t bytes, int dev, int pinned,
                       const char *side, const op_t *op) {
  if (dev < 0 && !pinned)
    return p;
  char *r = p;
  pthread_mutex_lock(&g.mu);
  if (dev >= 0)
    r = shadow_of((uintptr_t)p, bytes, NULL);
  else if (!host_pinned((uintptr_t)p, bytes))
    r = NULL;
  pthread_mutex_unlock(&g.mu);
  if (!r)
    misuse("%s: %s %p (%zu bytes) was freed or unregistered before the queued "
           "operation ran",
           op->what, side, p, bytes);
  return r;
}

static int busy_other_locked(uintptr_t p, size_t size, const cstream_t *skip);

/* Runs an emulated kernel: every span must still lie in one live allocation
 * of the stream's device; the emulation's thread function then runs once
 * per thread index, in order, on a copy of the arguments whose pointer
 * parameters are the spans' CPU-side addresses. A freed span is misuse and
 * the stream's error becomes cudaErrorIllegalAddress (a GPU faults). */
static void kernel_run(cstream_t *s, op_t *op) {
  unsigned char *a = xcalloc(1, op->kargs_bytes ? op->kargs_bytes : 1);
  memcpy(a, op->kargs, op->kargs_bytes);
  void *args[CUDASIM_KERNEL_MAX_PARAMS];
  for (int i = 0; i < op->kemu->nparams; i++)
    args[i] = a + op->koff[i];
  int bad = -1;
  pthread_mutex_lock(&g.mu);
  for (int i = 0; i < op->nkspans && bad < 0; i++) {
    if (op->kspans[i].bytes == 0)
      continue;
    int dev = -1;
    char *sh = shadow_of(op->kptr[i], op->kspans[i].bytes, &dev);
    if (!sh || dev != s->dev)
      bad = i;
    else
      memcpy(a + op->koff[op->kspans[i].param], &sh, sizeof sh);
  }
  pthread_mutex_unlock(&g.mu);
  if (bad >= 0) {
    misuse("kernel %s: parameter %d, %p (%zu bytes), was freed before the "
           "kernel ran (a GPU faults: cudaErrorIllegalAddress)",
           op->kemu->name, op->kspans[bad].param, (void *)op->kptr[bad],
           op->kspans[bad].bytes);
    pthread_mutex_lock(&s->mu);
    if (!s->error)
      s->error = cudaErrorIllegalAddress;
    pthread_mutex_unlock(&s->mu);
  } else {
    for (unsigned long long i = 0; i < op->kthreads; i++)
      op->kemu->thread(args, (long long)i);
  }
  free(a);
}

static void op_run(cstream_t *s, op_t *op) {
  switch (op->kind) {
  case OP_COPY: {
    const char *src = op->staging
                          ? op->staging
                          : exec_side((void *)op->src, op->bytes, op->src_dev,
                                      op->src_pinned, "source", op);
    char *dst = exec_side(op->dst, op->bytes, op->dst_dev, op->dst_pinned,
                          "destination", op);
    if (src && dst)
      memmove(dst, src, op->bytes);
    break;
  }
  case OP_MEMSET: {
    char *dst =
        exec_side(op->dst, op->bytes, op->dst_dev, 0, "destination", op);
    if (dst)
      memset(dst, op->value, op->bytes);
    break;
  }
  case OP_HOSTFN:
    run_host_fn(op);
    break;
  case OP_EXT: {
    int r = op->xfn(op->arg, &op->abort_flag);
    if (r) {
      pthread_mutex_lock(&s->mu);
      if (!s->error)
        s->error = r;
      pthread_mutex_unlock(&s->mu);
    }
    break;
  }
  case OP_KERNEL:
    kernel_run(s, op);
    break;
  case OP_FREE: {
    pthread_mutex_lock(&g.mu);
    /* Work of other streams that still uses the memory (queued, or running
     * as this free runs): nothing ordered it before the free. */
    size_t size = 0;
    int busy = alloc_start_locked(op->dst, &size) >= 0 &&
               busy_other_locked((uintptr_t)op->dst, size, s);
    if (busy) {
      pthread_mutex_unlock(&g.mu);
      misuse("cudaFreeAsync(%p): when the free ran, work queued on another "
             "stream still used this memory (order the free after it: an "
             "event, cudaStreamWaitEvent)",
             op->dst);
      pthread_mutex_lock(&g.mu);
    }
    if (device_release(op->dst_dev, (uintptr_t)op->dst) != 0) {
      pthread_mutex_unlock(&g.mu);
      misuse("cudaFreeAsync: %p is no longer a live allocation when the free "
             "runs",
             op->dst);
      break;
    }
    pthread_mutex_unlock(&g.mu);
    break;
  }
  case OP_NOP:
    break;
  }
}

/* ---- streams --------------------------------------------------------------
 */

static void jitter(cstream_t *s) {
  if (!g.jitter_us)
    return;
  uint64_t us = splitmix64(&s->rng) % ((uint64_t)g.jitter_us + 1);
  struct timespec ts = {0, (long)(us * 1000)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static void *worker_main(void *arg) {
  cstream_t *s = arg;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    while (!s->head && !s->destroyed)
      pthread_cond_wait(&s->cv, &s->mu);
    op_t *op = s->head;
    pthread_mutex_unlock(&s->mu);
    if (!op)
      break; /* destroyed and drained */
    jitter(s);
    for (int i = 0; i < op->npre; i++)
      marker_wait(op->pre[i]);
    op_run(s, op);
    pthread_mutex_lock(&s->mu);
    s->head = op->next;
    if (!s->head)
      s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    marker_complete(op->marker);
    op_free(op);
  }
  return NULL;
}

/* A new stream with its worker. g.mu held. The struct is never freed, so a
 * destroyed handle is recognised (magic) instead of being a wild read. */
static cstream_t *stream_new_locked(int dev, unsigned flags, int legacy) {
  cstream_t *s = xcalloc(1, sizeof *s);
  s->magic = STREAM_MAGIC;
  s->dev = dev;
  s->flags = flags;
  s->legacy = legacy;
  s->index = g.nstreams_created++;
  s->rng = g.seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(s->index + 1));
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  pthread_t t;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&t, &at, worker_main, s) != 0) {
    pthread_attr_destroy(&at);
    free(s);
    return NULL;
  }
  pthread_attr_destroy(&at);
  s->next_all = g.streams;
  g.streams = s;
  return s;
}

/* The current device's legacy stream (created at first use). g.mu held. */
static cstream_t *legacy_locked(int dev) {
  if (!g.dev[dev].legacy)
    g.dev[dev].legacy = stream_new_locked(dev, 0, 1);
  return g.dev[dev].legacy;
}

/* Whether a capture forbids a potentially unsafe call from this thread;
 * such a call invalidates the capture and fails (global mode: any thread;
 * thread-local mode: the capturing thread; relaxed: never). g.mu held. */
static int capture_forbids_locked(int err) {
  int hit = 0;
  /* Relaxed threads may make unsafe calls (the legacy stream's implicit
   * synchronisation is another rule: legacy_joins_capture_locked). */
  if (t_capture_mode == cudaStreamCaptureModeRelaxed)
    return cudaSuccess;
  for (capture_t *c = g.captures; c; c = c->next) {
    if (!c->active)
      continue;
    if (c->mode == cudaStreamCaptureModeGlobal ||
        (c->mode == cudaStreamCaptureModeThreadLocal &&
         pthread_equal(c->thread, pthread_self()))) {
      c->invalidated = 1;
      hit = 1;
    }
  }
  return hit ? err : cudaSuccess;
}

int capture_forbids(int err) {
  pthread_mutex_lock(&g.mu);
  int e = capture_forbids_locked(err);
  pthread_mutex_unlock(&g.mu);
  return e;
}

/* CUDA's rule for the legacy stream, whatever the capture mode: while a
 * blocking stream (created without cudaStreamNonBlocking) of the same device
 * captures, using the legacy stream would make it wait for captured work,
 * which fails with cudaErrorStreamCaptureImplicit and invalidates that
 * capture; a query of the legacy stream answers the same error without
 * invalidating. Captures of non-blocking streams do not concern it. */
static int legacy_joins_capture_locked(int dev, int invalidate) {
  int hit = 0;
  for (capture_t *c = g.captures; c; c = c->next) {
    if (!c->active || c->origin == NULL || c->origin->dev != dev ||
        (c->origin->flags & cudaStreamNonBlocking))
      continue;
    if (invalidate)
      c->invalidated = 1;
    hit = 1;
  }
  return hit;
}

/* Resolves a stream handle (NULL, cudaStreamLegacy: the current device's
 * legacy stream). g.mu held. Returns 0 or the error to return. */
int stream_get_locked(cudaStream_t h, cstream_t **out, const char *api) {
  if (h == NULL || h == cudaStreamLegacy) {
    int e = need_ctx();
    if (e)
      return e;
    int query = strcmp(api, "cudaStreamIsCapturing") == 0 ||
                strcmp(api, "cudaStreamGetCaptureInfo") == 0;
    if (legacy_joins_capture_locked(t_dev, !query))
      return cudaErrorStreamCaptureImplicit;
    *out = legacy_locked(t_dev);
    return *out ? 0 : cudaErrorMemoryAllocation;
  }
  if (h == cudaStreamPerThread) {
    misuse("%s: cudaStreamPerThread is not modelled by cudasim (ofl must not "
           "use it)",
           api);
    return cudaErrorInvalidResourceHandle;
  }
  cstream_t *s = (cstream_t *)h;
  if (s->magic != STREAM_MAGIC || s->destroyed) {
    misuse("%s: stream %p is not a live stream (destroyed?)", api, (void *)h);
    return cudaErrorInvalidResourceHandle;
  }
  *out = s;
  return 0;
}

int stream_get(cudaStream_t h, cstream_t **out, const char *api) {
  pthread_mutex_lock(&g.mu);
  int e = stream_get_locked(h, out, api);
  pthread_mutex_unlock(&g.mu);
  return e;
}

/* The same for the calls a capture does not allow on its own stream (a
 * query, a synchronisation, an allocation): while the stream captures, the
 * capture is invalidated and cudaErrorStreamCaptureUnsupported returned. */
int stream_get_uncaptured(cudaStream_t h, cstream_t **out, const char *api) {
  pthread_mutex_lock(&g.mu);
  int e = stream_get_locked(h, out, api);
  if (!e && (*out)->cap) {
    (*out)->cap->invalidated = 1;
    e = cudaErrorStreamCaptureUnsupported;
  }
  pthread_mutex_unlock(&g.mu);
  return e;
}

void graph_append(cgraph_t *gr, op_t *op) {
  if (gr->n == gr->cap) {
    gr->cap = gr->cap ? gr->cap * 2 : 16;
    gr->ops = realloc(gr->ops, (size_t)gr->cap * sizeof *gr->ops);
    if (!gr->ops)
      abort();
  }
  gr->ops[gr->n++] = op;
}

static void add_last_locked(op_t *op, cstream_t *t) {
  pthread_mutex_lock(&t->mu);
  if (!marker_done(t->last))
    op_add_pre(op, t->last);
  pthread_mutex_unlock(&t->mu);
}

/* Queues op on s, in stream order, after the legacy-stream dependencies:
 * legacy work waits for every blocking stream of its device, blocking-stream
 * work waits for the legacy stream. On a capturing stream the op goes into
 * the graph instead (returns 1). Takes ownership of op. g.mu held. */
int push_locked(cstream_t *s, op_t *op) {
  if (s->cap) {
    graph_append(s->cap->graph, op);
    return 1;
  }
  if (s->legacy) {
    for (cstream_t *t = g.streams; t; t = t->next_all)
      if (t != s && t->dev == s->dev && !t->legacy &&
          !(t->flags & cudaStreamNonBlocking))
        add_last_locked(op, t);
  } else if (!(s->flags & cudaStreamNonBlocking) && g.dev[s->dev].legacy) {
    add_last_locked(op, g.dev[s->dev].legacy);
  }
  if (!op->marker)
    op->marker = marker_new();
  pthread_mutex_lock(&s->mu);
  if (s->tail)
    s->tail->next = op;
  else
    s->head = op;
  s->tail = op;
  marker_unref(s->last);
  s->last = marker_ref(op->marker);
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return 0;
}

/* Whether queued (or running) work still uses [p, p+size). g.mu held. */
int busy_locked(uintptr_t p, size_t size) {
  return busy_other_locked(p, size, NULL);
}

/* The same, leaving out the work of stream `skip` (NULL: none). */
static int busy_other_locked(uintptr_t p, size_t size, const cstream_t *skip) {
  for (cstream_t *t = g.streams; t; t = t->next_all) {
    if (t == skip)
      continue;
    pthread_mutex_lock(&t->mu);
    int hit = 0;
    for (op_t *op = t->head; op && !hit; op = op->next) {
      if (op->kind == OP_COPY || op->kind == OP_MEMSET)
        hit = ranges_overlap((uintptr_t)op->dst, op->bytes, p, size) ||
              (op->kind == OP_COPY && !op->staging &&
               ranges_overlap((uintptr_t)op->src, op->bytes, p, size));
      else if (op->kind == OP_FREE)
        hit = (uintptr_t)op->dst >= p && (uintptr_t)op->dst < p + size;
      else if (op->kind == OP_KERNEL)
        for (int i = 0; i < op->nkspans && !hit; i++)
          hit = ranges_overlap(op->kptr[i], op->kspans[i].bytes, p, size);
    }
    pthread_mutex_unlock(&t->mu);
    if (hit)
      return 1;
  }
  return 0;
}

static marker_t *stream_last(cstream_t *s) {
  pthread_mutex_lock(&s->mu);
  marker_t *m = marker_ref(s->last);
  pthread_mutex_unlock(&s->mu);
  return m;
}

/* Waits for all work queued so far on every stream of dev (-1: all). */
void sync_device(int dev) {
  marker_t **ms = NULL;
  int n = 0, cap = 0;
  pthread_mutex_lock(&g.mu);
  for (cstream_t *t = g.streams; t; t = t->next_all) {
    if (dev >= 0 && t->dev != dev)
      continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      ms = realloc(ms, (size_t)cap * sizeof *ms);
      if (!ms)
        abort();
    }
    ms[n++] = stream_last(t);
  }
  pthread_mutex_unlock(&g.mu);
  for (int i = 0; i < n; i++) {
    marker_wait(ms[i]);
    marker_unref(ms[i]);
  }
  free(ms);
}

static int stream_error(cstream_t *s) {
  pthread_mutex_lock(&s->mu);
  int e = s->error;
  pthread_mutex_unlock(&s->mu);
  return e;
}

/* ---- streams API ------------------------------------------------------------
 */

EXPORT cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream,
                                             unsigned int flags) {
  ENTER("cudaStreamCreateWithFlags");
  NEED_CTX();
  if (!pStream || (flags & ~(unsigned)cudaStreamNonBlocking))
    return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&g.mu);
  cstream_t *s = stream_new_locked(t_dev, flags, 0);
  pthread_mutex_unlock(&g.mu);
  if (!s)
    return fail(cudaErrorMemoryAllocation);
  *pStream = (cudaStream_t)s;
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
  return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

/* Returns at once; the worker finishes the queued work, then exits. */
EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  ENTER("cudaStreamDestroy");
  NEED_CTX();
  if (stream == NULL || stream == cudaStreamLegacy)
    return fail(cudaErrorInvalidResourceHandle);
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(stream, &s, "cudaStreamDestroy");
  if (!e) {
    if (s->cap) {
      s->cap->invalidated = 1;
      s->cap = NULL;
    }
    pthread_mutex_lock(&s->mu);
    s->destroyed = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
  }
  pthread_mutex_unlock(&g.mu);
  return fail(e);
}

EXPORT cudaError_t cudaStreamQuery(cudaStream_t stream) {
  ENTER("cudaStreamQuery");
  NEED_CTX();
  cstream_t *s;
  int e = stream_get_uncaptured(stream, &s, "cudaStreamQuery");
  if (e)
    return fail(e);
  if ((e = stream_error(s)) != 0)
    return fail(e);
  marker_t *m = stream_last(s);
  e = marker_done(m) ? cudaSuccess : cudaErrorNotReady;
  marker_unref(m);
  return fail(e);
}

EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  ENTER("cudaStreamSynchronize");
  NEED_CTX();
  cstream_t *s;
  int e = stream_get_uncaptured(stream, &s, "cudaStreamSynchronize");
  if (!e)
    e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  marker_t *m = stream_last(s);
  marker_wait(m);
  marker_unref(m);
  return fail(stream_error(s));
}

EXPORT cudaError_t cudaStreamGetFlags(cudaStream_t hStream,
                                      unsigned int *flags) {
  ENTER("cudaStreamGetFlags");
  NEED_CTX();
  cstream_t *s;
  int e = stream_get(hStream, &s, "cudaStreamGetFlags");
  if (e)
    return fail(e);
  if (!flags)
    return fail(cudaErrorInvalidValue);
  *flags = s->flags;
  return cudaSuccess;
}

/* Not allowed on a capturing stream: on an H200 (CUDA 13.0, driver
 * 580.159.04, 2026-11-26) cudaStreamGetDevice on the stream that
 * torch.cuda.graph captured (global mode) answered
 * cudaErrorStreamCaptureUnsupported and invalidated the capture. */
EXPORT cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int *device) {
  ENTER("cudaStreamGetDevice");
  NEED_CTX();
  cstream_t *s;
  int e = stream_get_uncaptured(hStream, &s, "cudaStreamGetDevice");
  if (e)
    return fail(e);
  if (!device)
    return fail(cudaErrorInvalidValue);
  *device = s->dev;
  return cudaSuccess;
}

EXPORT cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn,
                                      void *userData) {
  ENTER("cudaLaunchHostFunc");
  NEED_CTX();
  if (!fn)
    return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(stream, &s, "cudaLaunchHostFunc");
  if (!e) {
    op_t *op = op_new(OP_HOSTFN, "cudaLaunchHostFunc");
    op->fn = fn;
    op->arg = userData;
    push_locked(s, op);
  }
  pthread_mutex_unlock(&g.mu);
  return fail(e);
}
