/* cudasim, runtime half (cudart_internal.h describes the stand-in and
 * its locking): the state, error names, misuse reports, initialisation
 * from the environment, stream markers, the device and error API, and
 * the interfaces to the NCCL half and to tests. */
#include "cudart_internal.h"

cudasim_state_t g = {.once = PTHREAD_ONCE_INIT,
                     .mu = PTHREAD_MUTEX_INITIALIZER,
                     .mk_mu = PTHREAD_MUTEX_INITIALIZER,
                     .mk_cv = PTHREAD_COND_INITIALIZER,
                     .mis_mu = PTHREAD_MUTEX_INITIALIZER,
                     .cb_mu = PTHREAD_MUTEX_INITIALIZER,
                     .cb_cv = PTHREAD_COND_INITIALIZER,
                     .misuse_abort = 1};

__thread int t_dev;        /* current device */
__thread int t_last_error; /* cudaGetLastError */
__thread int t_in_cb;      /* the host-function thread */
__thread int t_capture_mode = cudaStreamCaptureModeGlobal;

/* ---- error names -------------------------------------------------------- */

#define CUDASIM_ERRORS(X)                                                      \
  X(cudaSuccess, "no error")                                                   \
  X(cudaErrorInvalidValue, "invalid argument")                                 \
  X(cudaErrorMemoryAllocation, "out of memory")                                \
  X(cudaErrorInitializationError, "initialization error")                      \
  X(cudaErrorCudartUnloading, "driver shutting down")                          \
  X(cudaErrorInvalidDevicePointer, "invalid device pointer")                   \
  X(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")      \
  X(cudaErrorInsufficientDriver,                                               \
    "CUDA driver version is insufficient for CUDA runtime version")            \
  X(cudaErrorNoDevice, "no CUDA-capable device is detected")                   \
  X(cudaErrorInvalidDevice, "invalid device ordinal")                          \
  X(cudaErrorInvalidResourceHandle, "invalid resource handle")                 \
  X(cudaErrorIllegalState,                                                     \
    "the operation cannot be performed in the present state")                  \
  X(cudaErrorNotReady, "device not ready")                                     \
  X(cudaErrorInvalidConfiguration, "invalid configuration argument")           \
  X(cudaErrorMissingConfiguration, "__global__ function call is not "          \
                                   "configured")                               \
  X(cudaErrorInvalidDeviceFunction, "invalid device function")                 \
  X(cudaErrorNoKernelImageForDevice,                                           \
    "no kernel image is available for execution on the device")                \
  X(cudaErrorIllegalAddress, "an illegal memory access was encountered")       \
  X(cudaErrorHostMemoryAlreadyRegistered,                                      \
    "part or all of the requested memory range is already mapped")             \
  X(cudaErrorHostMemoryNotRegistered,                                          \
    "pointer does not correspond to a registered memory region")               \
  X(cudaErrorLaunchFailure, "unspecified launch failure")                      \
  X(cudaErrorNotPermitted, "operation not permitted")                          \
  X(cudaErrorNotSupported, "operation not supported")                          \
  X(cudaErrorStreamCaptureUnsupported,                                         \
    "operation not permitted when stream is capturing")                        \
  X(cudaErrorStreamCaptureInvalidated,                                         \
    "operation failed due to a previous error during capture")                 \
  X(cudaErrorStreamCaptureUnmatched,                                           \
    "capture was not initiated in this stream")                                \
  X(cudaErrorStreamCaptureUnjoined, "capturing stream has unjoined work")      \
  X(cudaErrorStreamCaptureIsolation,                                           \
    "dependency created on uncaptured work in another stream")                 \
  X(cudaErrorStreamCaptureImplicit,                                            \
    "operation would make the legacy stream depend on a capturing blocking "   \
    "stream")                                                                  \
  X(cudaErrorStreamCaptureWrongThread,                                         \
    "attempt to terminate a thread-local capture sequence from another "       \
    "thread")                                                                  \
  X(cudaErrorUnknown, "unknown error")

EXPORT const char *cudaGetErrorString(cudaError_t e) {
  switch ((int)e) {
#define X(code, text)                                                          \
  case code:                                                                   \
    return text;
    CUDASIM_ERRORS(X)
#undef X
  }
  return "unrecognized error code";
}

EXPORT const char *cudaGetErrorName(cudaError_t e) {
  switch ((int)e) {
#define X(code, text)                                                          \
  case code:                                                                   \
    return #code;
    CUDASIM_ERRORS(X)
#undef X
  }
  return "cudaErrorUnknown";
}

/* ---- misuse ------------------------------------------------------------- */

static void misuse_atexit(void) {
  uint64_t n = A_LOAD(&g.misuse_pending);
  if (n) {
    pthread_mutex_lock(&g.mis_mu);
    fprintf(stderr,
            "cudasim: %llu misuse report(s) not reset (last: %s); exiting "
            "with status 3\n",
            (unsigned long long)n, g.last_misuse);
    pthread_mutex_unlock(&g.mis_mu);
    fflush(stdout);
    _exit(3);
  }
}

static void misuse_v(const char *fmt, va_list ap) {
  char text[512];
  vsnprintf(text, sizeof text, fmt, ap);
  fprintf(stderr, "cudasim: misuse: %s\n", text);
  if (A_LOAD(&g.misuse_abort)) {
    void *frames[32];
    int n = backtrace(frames, 32);
    backtrace_symbols_fd(frames, n, 2);
    abort();
  }
  pthread_mutex_lock(&g.mis_mu);
  snprintf(g.last_misuse, sizeof g.last_misuse, "%s", text);
  pthread_mutex_unlock(&g.mis_mu);
  STAT_ADD(misuse, 1);
  A_ADD(&g.misuse_pending, 1);
}

EXPORT void cudasim__misuse(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  misuse_v(fmt, ap);
  va_end(ap);
}

/* ---- initialisation ------------------------------------------------------ */

static size_t parse_size(const char *s, size_t dflt) {
  if (!s || !*s)
    return dflt;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  switch (*end) {
  case 'k':
  case 'K':
    v <<= 10;
    break;
  case 'm':
  case 'M':
    v <<= 20;
    break;
  case 'g':
  case 'G':
    v <<= 30;
    break;
  case 't':
  case 'T':
    v <<= 40;
    break;
  default:
    break;
  }
  return (size_t)v;
}

static long env_long(const char *name, long dflt) {
  const char *s = getenv(name);
  return s && *s ? strtol(s, NULL, 0) : dflt;
}

static void init_once(void) {
  g.ndev = (int)env_long("CUDASIM_DEVICES", 2);
  if (g.ndev < 0)
    g.ndev = 0;
  if (g.ndev > CUDASIM_MAX_DEVICES)
    g.ndev = CUDASIM_MAX_DEVICES;
  g.dev_memory = parse_size(getenv("CUDASIM_DEVICE_MEMORY"), (size_t)8 << 30);
  g.seed = (uint64_t)env_long("CUDASIM_SEED", 1);
  g.jitter_us = (unsigned)env_long("CUDASIM_JITTER_US", 50);
  const char *m = getenv("CUDASIM_MISUSE");
  if (m && strcmp(m, "count") == 0)
    A_STORE(&g.misuse_abort, 0);
  g.fail_at = (uint64_t)env_long("CUDASIM_FAIL_AT", 0);
  g.fail_error = (int)env_long("CUDASIM_FAIL_ERROR", cudaErrorLaunchFailure);
  g.driver_version = (int)env_long("CUDASIM_DRIVER_VERSION", 13000);
  for (int d = 0; d < g.ndev; d++)
    g.dev[d].capacity = g.dev_memory;
  atexit(misuse_atexit);
}

void ensure_init(void) { pthread_once(&g.once, init_once); }

/* Sets the thread's last error (every failing call does, NotReady included,
 * as the real runtime does). */
cudaError_t fail(int e) {
  if (e != cudaSuccess)
    t_last_error = e;
  return (cudaError_t)e;
}

EXPORT int cudasim__enter(const char *api) {
  ensure_init();
  if (t_in_cb) {
    misuse("%s called inside a host function (cudaLaunchHostFunc): the real "
           "driver deadlocks or fails",
           api);
    return cudaErrorNotPermitted;
  }
  uint64_t n = A_ADD(&g.calls, 1);
  if (g.fail_at && n == g.fail_at)
    A_STORE(&g.sticky, g.fail_error);
  if (A_LOAD(&g.inject_at) == n) {
    int e = A_LOAD(&g.inject_error);
    if (A_LOAD(&g.inject_sticky))
      A_STORE(&g.sticky, e);
    return e;
  }
  return A_LOAD(&g.sticky);
}

/* The primary context of the current device: created by the first call that
 * needs one. */
int need_ctx(void) {
  if (g.driver_version < RUNTIME_VERSION)
    return cudaErrorInsufficientDriver;
  if (g.ndev == 0)
    return cudaErrorNoDevice;
  A_STORE(&g.stats.contexts[t_dev], 1);
  return cudaSuccess;
}

/* ---- markers ------------------------------------------------------------ */

marker_t *marker_new(void) {
  marker_t *m = xcalloc(1, sizeof *m);
  m->refs = 1;
  return m;
}

marker_t *marker_ref(marker_t *m) {
  if (m)
    A_ADD(&m->refs, 1);
  return m;
}

void marker_unref(marker_t *m) {
  if (m && A_ADD(&m->refs, -1) == 0)
    free(m);
}

int marker_done(marker_t *m) { return !m || A_LOAD(&m->done); }

void marker_complete(marker_t *m) {
  pthread_mutex_lock(&g.mk_mu);
  m->t_ns = now_ns();
  A_STORE(&m->done, 1);
  pthread_cond_broadcast(&g.mk_cv);
  pthread_mutex_unlock(&g.mk_mu);
}

void marker_wait(marker_t *m) {
  if (marker_done(m))
    return;
  pthread_mutex_lock(&g.mk_mu);
  while (!A_LOAD(&m->done))
    pthread_cond_wait(&g.mk_cv, &g.mk_mu);
  pthread_mutex_unlock(&g.mk_mu);
}

/* ---- devices and errors ---------------------------------------------------
 */

EXPORT cudaError_t cudaGetDeviceCount(int *count) {
  ENTER("cudaGetDeviceCount");
  if (!count)
    return fail(cudaErrorInvalidValue);
  *count = 0;
  if (g.driver_version < RUNTIME_VERSION)
    return fail(cudaErrorInsufficientDriver);
  if (g.ndev == 0)
    return fail(cudaErrorNoDevice);
  *count = g.ndev;
  return cudaSuccess;
}

EXPORT cudaError_t cudaGetDevice(int *device) {
  ENTER("cudaGetDevice");
  if (!device)
    return fail(cudaErrorInvalidValue);
  *device = t_dev;
  return cudaSuccess;
}

EXPORT cudaError_t cudaSetDevice(int device) {
  ENTER("cudaSetDevice");
  if (g.driver_version < RUNTIME_VERSION)
    return fail(cudaErrorInsufficientDriver);
  if (g.ndev == 0)
    return fail(cudaErrorNoDevice);
  if (device < 0 || device >= g.ndev)
    return fail(cudaErrorInvalidDevice);
  t_dev = device;
  A_STORE(&g.stats.contexts[device], 1);
  return cudaSuccess;
}

/* Returns and clears the thread's last error; a sticky error stays. */
EXPORT cudaError_t cudaGetLastError(void) {
  int e = cudasim__enter("cudaGetLastError");
  if (e)
    return (cudaError_t)e;
  e = t_last_error;
  t_last_error = cudaSuccess;
  return (cudaError_t)e;
}

EXPORT cudaError_t cudaPeekAtLastError(void) {
  int e = cudasim__enter("cudaPeekAtLastError");
  return (cudaError_t)(e ? e : t_last_error);
}

EXPORT cudaError_t cudaDriverGetVersion(int *v) {
  ENTER("cudaDriverGetVersion");
  if (!v)
    return fail(cudaErrorInvalidValue);
  *v = g.driver_version;
  return cudaSuccess;
}

EXPORT cudaError_t cudaRuntimeGetVersion(int *v) {
  ENTER("cudaRuntimeGetVersion");
  if (!v)
    return fail(cudaErrorInvalidValue);
  *v = RUNTIME_VERSION;
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr,
                                          int device) {
  ENTER("cudaDeviceGetAttribute");
  if (!value)
    return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= g.ndev)
    return fail(cudaErrorInvalidDevice);
  int v;
  switch (attr) {
  case cudaDevAttrMaxThreadsPerBlock:
    v = 1024;
    break;
  case cudaDevAttrWarpSize:
    v = 32;
    break;
  case cudaDevAttrMultiProcessorCount:
    v = 132;
    break;
  case cudaDevAttrIntegrated:
    v = 0;
    break;
  case cudaDevAttrCanMapHostMemory:
    v = 1;
    break;
  case cudaDevAttrPciBusId:
    v = device + 1;
    break;
  case cudaDevAttrL2CacheSize:
    v = 50 << 20;
    break;
  case cudaDevAttrAsyncEngineCount:
    v = 2;
    break;
  case cudaDevAttrUnifiedAddressing:
    v = 1;
    break;
  case cudaDevAttrComputeCapabilityMajor:
    v = 9;
    break;
  case cudaDevAttrComputeCapabilityMinor:
    v = 0;
    break;
  case cudaDevAttrPageableMemoryAccess:
    v = 0;
    break;
  case cudaDevAttrConcurrentManagedAccess:
    v = 0;
    break;
  case cudaDevAttrHostRegisterSupported:
    v = 1;
    break;
  case cudaDevAttrMemoryPoolsSupported:
    v = 1;
    break;
  default:
    return fail(cudaErrorInvalidValue);
  }
  *value = v;
  return cudaSuccess;
}

EXPORT cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop,
                                           int device) {
  ENTER("cudaGetDeviceProperties");
  if (!prop)
    return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= g.ndev)
    return fail(cudaErrorInvalidDevice);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "cudasim");
  prop->totalGlobalMem = g.dev[device].capacity;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->unifiedAddressing = 1;
  prop->asyncEngineCount = 2;
  prop->pciBusID = device + 1;
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceSynchronize(void) {
  ENTER("cudaDeviceSynchronize");
  NEED_CTX();
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  sync_device(t_dev);
  return cudaSuccess;
}

/* ---- between the cudart and NCCL halves
 * ----------------------------------------- */

EXPORT int cudasim__enqueue(void *stream, cudasim_op_fn fn, void *arg,
                            const char *what) {
  ensure_init();
  if (!fn)
    return cudaErrorInvalidValue;
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int r = stream_get_locked((cudaStream_t)stream, &s, what);
  if (!r) {
    op_t *op = op_new(OP_EXT, what);
    op->xfn = fn;
    op->arg = arg;
    push_locked(s, op);
    /* The NCCL half's collectives, for the counters tests read. */
    if (what != NULL && strncmp(what, "nccl", 4) == 0)
      A_ADD(&g.stats.nccl_collectives, 1);
  }
  pthread_mutex_unlock(&g.mu);
  return r;
}

EXPORT void cudasim__abort_ops(void *arg) {
  ensure_init();
  pthread_mutex_lock(&g.mu);
  for (cstream_t *t = g.streams; t; t = t->next_all) {
    pthread_mutex_lock(&t->mu);
    for (op_t *op = t->head; op; op = op->next)
      if (op->kind == OP_EXT && op->arg == arg)
        A_STORE(&op->abort_flag, 1);
    pthread_mutex_unlock(&t->mu);
  }
  pthread_mutex_unlock(&g.mu);
}

EXPORT void *cudasim__shadow(const void *ptr, size_t bytes, const char *what) {
  ensure_init();
  pthread_mutex_lock(&g.mu);
  char *r = shadow_of((uintptr_t)ptr, bytes, NULL);
  pthread_mutex_unlock(&g.mu);
  if (!r)
    misuse("%s: %p (%zu bytes) is not inside one live device allocation", what,
           ptr, bytes);
  return r;
}

EXPORT int cudasim__stream_device(void *stream) {
  ensure_init();
  cudaStream_t h = (cudaStream_t)stream;
  if (h == NULL || h == cudaStreamLegacy)
    return t_dev;
  cstream_t *s = (cstream_t *)h;
  if (h == cudaStreamPerThread || s->magic != STREAM_MAGIC) {
    misuse("stream %p is not a live stream", stream);
    return -1;
  }
  return s->dev;
}

/* ---- control interface
 * ---------------------------------------------------------- */

EXPORT int cudasim_get_stats(cudasim_stats_t *out) {
  uint64_t *src = (uint64_t *)&g.stats, *dst = (uint64_t *)out;
  for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
    dst[i] = A_LOAD(&src[i]);
  return 0;
}

EXPORT void cudasim_reset_stats(void) {
  uint64_t *p = (uint64_t *)&g.stats;
  size_t keep = offsetof(cudasim_stats_t, contexts) / sizeof(uint64_t);
  for (size_t i = 0; i < keep; i++)
    A_STORE(&p[i], 0);
}

EXPORT void cudasim_set_misuse_abort(int on) {
  ensure_init();
  A_STORE(&g.misuse_abort, on ? 1 : 0);
}

EXPORT const char *cudasim_last_misuse(void) {
  static __thread char copy[sizeof g.last_misuse];
  pthread_mutex_lock(&g.mis_mu);
  memcpy(copy, g.last_misuse, sizeof copy);
  pthread_mutex_unlock(&g.mis_mu);
  return copy;
}

EXPORT void cudasim_reset_misuse(void) {
  pthread_mutex_lock(&g.mis_mu);
  g.last_misuse[0] = 0;
  pthread_mutex_unlock(&g.mis_mu);
  A_STORE(&g.misuse_pending, 0);
}

EXPORT void cudasim_inject_error(uint64_t n, int error, int sticky) {
  ensure_init();
  A_STORE(&g.inject_error, error);
  A_STORE(&g.inject_sticky, sticky);
  A_STORE(&g.inject_at, A_LOAD(&g.calls) + n);
}

EXPORT int cudasim_is_device_memory(const void *ptr, int *device) {
  ensure_init();
  pthread_mutex_lock(&g.mu);
  int dev = device_of_addr((uintptr_t)ptr);
  int live = dev >= 0 && alloc_find(dev, (uintptr_t)ptr) != NULL;
  pthread_mutex_unlock(&g.mu);
  if (live && device)
    *device = dev;
  return live;
}

EXPORT int cudasim_in_host_fn(void) { return t_in_cb; }
