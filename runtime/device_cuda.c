/* ofl: the cuda backend, on the CUDA runtime API. Non-blocking streams,
 * events with timing disabled, pinned memory by malloc + page touch +
 * cudaHostRegister (exact size), NVTX ranges. Compiled whenever the toolkit
 * is found, so it cannot rot on machines without a GPU. */
#include <ofl/version.h>

#if OFL_HAVE_CUDA

#include <nvtx3/nvToolsExt.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* cudaX(...) calls go through the table that the probe fills by dlopen:
 * libofl does not link the CUDA runtime. */
#include "runtime/cuda_api.h"
#include "runtime/backend.h"

/* A failed runtime call also sets the calling thread's last error, which the
 * application's own cudaGetLastError checks would report at an unrelated
 * launch: ofl reports the error itself, so it clears it (sticky errors stay,
 * as cudaGetLastError cannot clear them). */
#define CUDA_TRY(call, what)                                                   \
  do {                                                                         \
    cudaError_t ofl__ce = (call);                                              \
    if (ofl__ce != cudaSuccess) {                                              \
      (void)cudaGetLastError();                                                \
      return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE, "%s: %s (%s)", what,  \
                        cudaGetErrorString(ofl__ce), #call);                   \
    }                                                                          \
  } while (0)

/* cudaErrorNotReady from a query is an answer, not an error, but the runtime
 * records it as the thread's last error: clear it, or the application's next
 * cudaGetLastError() (PyTorch's launch check) fails with "device not ready".
 * Only a NotReady is cleared, never an error the application has not read. */
static void clear_not_ready(void) {
  if (cudaPeekAtLastError() == cudaErrorNotReady)
    (void)cudaGetLastError();
}

/* The device a device opened without an index uses: OFL_DEVICE (an ordinal,
 * or `local`: the launcher's local rank modulo the device count), else the
 * calling thread's current device. */
static ofl_status_t resolve_index(int count, int *index) {
  const char *v = "";
  OFL_CHECK(ofl__config_str("OFL_DEVICE", &v));
  if (v[0] == '\0') {
    int cur = 0;
    if (cudaGetDevice(&cur) != cudaSuccess) {
      (void)cudaGetLastError();
      cur = 0;
    }
    *index = cur;
    return OFL_SUCCESS;
  }
  if (strcmp(v, "local") == 0) {
    *index = ofl__local_rank(-1) % count;
    return OFL_SUCCESS;
  }
  char *end = NULL;
  long n = strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < 0 || n >= count)
    return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_CONFIG,
                      "OFL_DEVICE=%s is not a device of this node (0..%d, or "
                      "local)",
                      v, count - 1);
  *index = (int)n;
  return OFL_SUCCESS;
}

/* The CUDA runtime is loaded here, at the first device open (or probe):
 * without it the answer is OFL_ERR_NO_DEVICE saying it was not found. */
static ofl_status_t cuda_device_count(int *count, char *why, size_t cap) {
  *count = 0;
  if (ofl__cudart_load(why, cap) != OFL_SUCCESS)
    return OFL_ERR_NO_DEVICE;
  int n = 0;
  cudaError_t ce = cudaGetDeviceCount(&n);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(why, cap, "%s: %s",
             ce == cudaErrorInsufficientDriver ? "the driver is too old for "
                                                 "this CUDA runtime"
             : ce == cudaErrorNoDevice         ? "no cuda device"
                                               : "no usable cuda driver",
             cudaGetErrorString(ce));
    return OFL_ERR_NO_DEVICE;
  }
  if (n <= 0) {
    snprintf(why, cap, "no cuda device");
    return OFL_ERR_NO_DEVICE;
  }
  *count = n;
  why[0] = '\0';
  return OFL_SUCCESS;
}

static ofl_status_t cuda_probe(int *device_index, char *why, size_t cap) {
  int n = 0;
  OFL_CHECK(cuda_device_count(&n, why, cap));
  if (*device_index < 0) {
    ofl_status_t st = resolve_index(n, device_index);
    if (st != OFL_SUCCESS) {
      snprintf(why, cap, "%s", ofl_last_error());
      return st;
    }
  }
  if (n <= *device_index) {
    snprintf(why, cap, "cuda device %d requested, %d present", *device_index,
             n);
    return OFL_ERR_NO_DEVICE;
  }
  why[0] = '\0';
  return OFL_SUCCESS;
}

/* ---- the caller's device stays the caller's ------------------------------
 * Every call selects ofl's device and gives the caller's back afterwards
 * (ofl__cuda_enter / ofl__cuda_leave, runtime/cuda_guard.c). */
typedef ofl__cuda_guard_t dev_guard_t;

static ofl_status_t enter(const ofl_device_t *dev, dev_guard_t *g) {
  return ofl__cuda_enter(dev->cfg.device_index, g);
}
static void leave(const dev_guard_t *g) { ofl__cuda_leave(g); }

/* Runs `call` (a cudaError_t expression) with ofl's device selected; on
 * failure returns an OFL_ERR_CUDA naming `what` (after the caller's device
 * is back). */
#define ON_DEVICE(dev, call, what)                                             \
  do {                                                                         \
    dev_guard_t ofl__g;                                                        \
    OFL_CHECK(enter((dev), &ofl__g));                                          \
    cudaError_t ofl__e = (call);                                               \
    leave(&ofl__g);                                                            \
    CUDA_TRY(ofl__e, what);                                                    \
  } while (0)

static ofl_status_t cuda_open(ofl_device_t *dev) {
  dev_guard_t g;
  OFL_CHECK(enter(dev, &g));
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    dev->stats.device_capacity_bytes = total_b;
  else
    (void)cudaGetLastError();
  leave(&g);
  return OFL_SUCCESS;
}

/* Sizes of live device allocations, for the statistics and to reject
 * foreign or double frees before they reach cudaFree; each tagged with its
 * device, whose close releases what is left. */
typedef struct size_node {
  void *ptr;
  size_t bytes;
  const ofl_device_t *dev;
  bool pinned;      /* pinned host memory (ptr is the registered range) */
  size_t reg_bytes; /* pinned: bytes registered (whole pages) */
  struct size_node *next;
} size_node_t;

#define SIZE_BUCKETS 1024
static pthread_mutex_t sizes_lock = PTHREAD_MUTEX_INITIALIZER;
static size_node_t *sizes[SIZE_BUCKETS];

static size_t page_bytes(void) {
  long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? (size_t)page : 4096;
}

/* Device close: blocks still allocated on this device are released, as on
 * the host backend, once the streams drained. If one did not (a copy stuck
 * behind work that never completes), DMA may still read or write them:
 * they are leaked instead, and said so. */
static void cuda_close(ofl_device_t *dev) {
  size_node_t *left = NULL;
  pthread_mutex_lock(&sizes_lock);
  for (size_t b = 0; b < SIZE_BUCKETS; b++) {
    size_node_t **pp = &sizes[b];
    while (*pp != NULL) {
      size_node_t *n = *pp;
      if (n->dev == dev) {
        *pp = n->next;
        n->next = left;
        left = n;
      } else {
        pp = &n->next;
      }
    }
  }
  pthread_mutex_unlock(&sizes_lock);
  if (left == NULL)
    return;
  size_t n = 0, bytes = 0;
  dev_guard_t g;
  bool selected = !dev->drain_failed && enter(dev, &g) == OFL_SUCCESS;
  while (left != NULL) {
    size_node_t *next = left->next;
    if (selected) {
      if (left->pinned) {
        if (cudaHostUnregister(left->ptr) != cudaSuccess)
          (void)cudaGetLastError();
        free(left->ptr);
      } else if (cudaFree(left->ptr) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    n++;
    bytes += left->bytes;
    free(left);
    left = next;
  }
  if (selected) {
    leave(&g);
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "device close: %zu block(s) of %zu bytes still allocated; "
             "released now",
             n, bytes);
  } else {
    OFL_WARN(OFL_SUBSYS_DEVICE,
             "device close: %zu block(s) of %zu bytes still allocated are "
             "leaked, not freed: a stream did not drain, so copies may still "
             "use them",
             n, bytes);
  }
}

static size_t bucket(const void *p) {
  return (size_t)(((uintptr_t)p >> 8) * 11400714819323198485ull >> 54) %
         SIZE_BUCKETS;
}

static void node_add(size_node_t *node) {
  pthread_mutex_lock(&sizes_lock);
  node->next = sizes[bucket(node->ptr)];
  sizes[bucket(node->ptr)] = node;
  pthread_mutex_unlock(&sizes_lock);
}

/* Takes the record of ptr if it is a live block of that kind; NULL for a
 * foreign pointer or a second free (nothing is touched then). */
static size_node_t *node_take(const void *ptr, bool pinned) {
  pthread_mutex_lock(&sizes_lock);
  size_node_t **pp = &sizes[bucket(ptr)];
  while (*pp != NULL && ((*pp)->ptr != ptr || (*pp)->pinned != pinned))
    pp = &(*pp)->next;
  size_node_t *node = *pp;
  if (node != NULL)
    *pp = node->next;
  pthread_mutex_unlock(&sizes_lock);
  return node;
}

static ofl_status_t cuda_device_malloc(ofl_device_t *dev, size_t bytes,
                                       void **out) {
  size_node_t *node = malloc(sizeof *node);
  if (node == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate bookkeeping for a device block");
  dev_guard_t g;
  ofl_status_t gs = enter(dev, &g);
  if (gs != OFL_SUCCESS) {
    free(node);
    return gs;
  }
  void *p = NULL;
  cudaError_t ce = cudaMalloc(&p, bytes);
  leave(&g);
  if (ce != cudaSuccess) {
    free(node);
    (void)cudaGetLastError();
    return ofl__error(ce == cudaErrorMemoryAllocation ? OFL_ERR_NO_MEMORY
                                                      : OFL_ERR_CUDA,
                      OFL_SUBSYS_DEVICE,
                      "cudaMalloc of %zu bytes failed: %s; offload more or "
                      "lower the batch",
                      bytes, cudaGetErrorString(ce));
  }
  node->ptr = p;
  node->bytes = bytes;
  node->dev = dev;
  node->pinned = false;
  node->reg_bytes = 0;
  node_add(node);
  *out = p;
  return OFL_SUCCESS;
}

static ofl_status_t cuda_device_free(ofl_device_t *dev, void *ptr,
                                     size_t *bytes) {
  size_node_t *node = node_take(ptr, false);
  if (node == NULL || node->dev != dev) {
    if (node != NULL)
      node_add(node);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "%p is not a device block of this ofl device (freed "
                      "twice, foreign, or another device's)",
                      ptr);
  }
  dev_guard_t g;
  ofl_status_t gs = enter(dev, &g);
  if (gs != OFL_SUCCESS) {
    node_add(node);
    return gs;
  }
  cudaError_t ce = cudaFree(ptr);
  leave(&g);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    /* Nothing changed: the block stays known (a failed call has no side
     * effects). */
    node_add(node);
    return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE,
                      "cudaFree of %p failed: %s; the block is kept", ptr,
                      cudaGetErrorString(ce));
  }
  *bytes = node->bytes;
  free(node);
  return OFL_SUCCESS;
}

/* Pinned memory: page-aligned malloc, touch every page, register whole
 * pages (a registration that ended inside a page would share that page with
 * heap data, and an application registering its neighbour would fail). The
 * block is recorded like a device block, so that a foreign or second free is
 * refused before anything is touched. */
static ofl_status_t cuda_pinned_malloc(ofl_device_t *dev, size_t bytes,
                                       void **out) {
  size_t pg = page_bytes();
  size_t reg = bytes + (pg - bytes % pg) % pg;
  if (reg < bytes)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "%zu bytes of pinned memory cannot be rounded to pages",
                      bytes);
  size_node_t *node = malloc(sizeof *node);
  void *mem = NULL;
  if (node == NULL || posix_memalign(&mem, pg, reg) != 0) {
    free(node);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate %zu bytes of host memory to pin", reg);
  }
  char *user = mem;
  for (size_t off = 0; off < reg; off += pg)
    user[off] = 0;
  dev_guard_t g;
  ofl_status_t gs = enter(dev, &g);
  if (gs != OFL_SUCCESS) {
    free(node);
    free(mem);
    return gs;
  }
  cudaError_t ce = cudaHostRegister(user, reg, cudaHostRegisterDefault);
  leave(&g);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    free(node);
    free(mem);
    return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE,
                      "cudaHostRegister of %zu bytes failed: %s; check the "
                      "locked-memory limit (ulimit -l)",
                      reg, cudaGetErrorString(ce));
  }
  *node = (size_node_t){.ptr = user,
                        .bytes = bytes,
                        .dev = dev,
                        .pinned = true,
                        .reg_bytes = reg};
  node_add(node);
  *out = user;
  return OFL_SUCCESS;
}

static ofl_status_t cuda_pinned_free(ofl_device_t *dev, void *ptr,
                                     size_t *bytes) {
  size_node_t *node = node_take(ptr, true);
  if (node == NULL || node->dev != dev) {
    if (node != NULL)
      node_add(node);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "%p is not pinned memory of this ofl device (freed "
                      "twice, foreign, or another device's)",
                      ptr);
  }
  dev_guard_t g;
  ofl_status_t gs = enter(dev, &g);
  if (gs != OFL_SUCCESS) {
    node_add(node);
    return gs;
  }
  cudaError_t ce = cudaHostUnregister(ptr);
  leave(&g);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    node_add(node); /* kept, as for cudaFree */
    return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE,
                      "cudaHostUnregister of %p failed: %s; the block is kept",
                      ptr, cudaGetErrorString(ce));
  }
  *bytes = node->bytes;
  free(node);
  free(ptr);
  return OFL_SUCCESS;
}

/* The device's compute stream is the legacy default stream (impl NULL): it
 * names the current device's, which enter() makes ofl's. Wrapped streams are
 * the application's (impl: its cudaStream_t, never destroyed). */
static ofl_status_t cuda_stream_create(ofl_stream_t *s) {
  if (s->is_compute) {
    s->impl = NULL;
    return OFL_SUCCESS;
  }
  cudaStream_t cs = NULL;
  ON_DEVICE(s->dev, cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking),
            "cannot create a stream");
  s->impl = cs;
  return OFL_SUCCESS;
}

static ofl_status_t cuda_stream_wrap(ofl_stream_t *s, void *native) {
  cudaStream_t cs = (cudaStream_t)native;
  /* The per-thread default stream is a different stream on every host
   * thread, ofl's own threads included: it cannot be one ofl stream. */
  if (cs == cudaStreamPerThread)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_stream_wrap_native: cudaStreamPerThread names a "
                      "different stream on each thread; wrap a stream "
                      "created with cudaStreamCreateWithFlags");
  /* Without cudaStreamGetDevice (runtimes before 12.8) the stream's device
   * cannot be checked: the caller's word is taken. Nor while the stream
   * captures: cudaStreamGetDevice is not allowed then (on CUDA 13.0 it
   * answered cudaErrorStreamCaptureUnsupported and invalidated the capture
   * of torch.cuda.graph), so a capturing stream is only checked to be a
   * stream (cudaStreamIsCapturing, which a capture allows). */
  if (cs != NULL && cs != cudaStreamLegacy &&
      ofl__cu.cudaStreamGetDevice != NULL) {
    int d = -1;
    enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    dev_guard_t g;
    OFL_CHECK(enter(s->dev, &g));
    cudaError_t ce = cudaStreamIsCapturing(cs, &cap);
    if (ce == cudaSuccess && cap == cudaStreamCaptureStatusNone)
      ce = cudaStreamGetDevice(cs, &d);
    else if (ce == cudaSuccess)
      d = s->dev->cfg.device_index;
    leave(&g);
    CUDA_TRY(ce, "ofl_stream_wrap_native: not a valid cudaStream_t");
    if (d != s->dev->cfg.device_index)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                        "ofl_stream_wrap_native: stream '%s' belongs to cuda "
                        "device %d, this ofl device is %d",
                        s->name, d, s->dev->cfg.device_index);
  }
  s->impl = cs == cudaStreamLegacy ? NULL : cs;
  return OFL_SUCCESS;
}

/* For the legacy stream CUDA answers cudaErrorStreamCaptureImplicit while
 * a blocking stream of the device captures: any use of it would join (and
 * break) that capture, so that answer is "capturing" too. */
static ofl_status_t cuda_stream_capturing(ofl_stream_t *s, bool *capturing) {
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  dev_guard_t g;
  OFL_CHECK(enter(s->dev, &g));
  cudaError_t ce = cudaStreamIsCapturing((cudaStream_t)s->impl, &cs);
  if (ce != cudaSuccess)
    (void)cudaGetLastError();
  leave(&g);
  if (ce == cudaErrorStreamCaptureImplicit) {
    *capturing = true;
    return OFL_SUCCESS;
  }
  CUDA_TRY(ce, "stream capture query");
  *capturing = cs != cudaStreamCaptureStatusNone;
  return OFL_SUCCESS;
}

static void *cuda_stream_native(const ofl_stream_t *s) {
  return s->impl != NULL ? s->impl : (void *)cudaStreamLegacy;
}

/* Polls until the query is not cudaErrorNotReady or the deadline passes.
 * Sleeps grow from 1 to 50 us: a synchronize returns at most ~50 us late. */
static ofl_status_t poll_until(const ofl_device_t *dev,
                               cudaError_t (*query)(void *), void *h,
                               int64_t timeout_ms, const char *what) {
  uint64_t deadline = ofl__deadline_ns(timeout_ms);
  uint64_t sleep_ns = 1000;
  for (;;) {
    dev_guard_t g;
    OFL_CHECK(enter(dev, &g));
    cudaError_t ce = query(h);
    if (ce == cudaErrorNotReady)
      clear_not_ready();
    else if (ce != cudaSuccess)
      (void)cudaGetLastError();
    leave(&g);
    if (ce == cudaSuccess)
      return OFL_SUCCESS;
    if (ce != cudaErrorNotReady)
      return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE, "%s: %s", what,
                        cudaGetErrorString(ce));
    if (ofl__now_ns() >= deadline)
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                        "%s: not complete after %lld ms", what,
                        (long long)timeout_ms);
    struct timespec ts = {0, (long)sleep_ns};
    nanosleep(&ts, NULL);
    if (sleep_ns < 50000)
      sleep_ns *= 2;
  }
}

static cudaError_t query_stream(void *h) {
  return cudaStreamQuery((cudaStream_t)h);
}
static cudaError_t query_event(void *h) {
  return cudaEventQuery((cudaEvent_t)h);
}

static ofl_status_t cuda_stream_synchronize(ofl_stream_t *s,
                                            int64_t timeout_ms) {
  return poll_until(s->dev, query_stream, s->impl, timeout_ms,
                    "stream synchronize");
}

static ofl_status_t cuda_stream_destroy(ofl_stream_t *s) {
  if (s->wrapped)
    return OFL_SUCCESS; /* the application's: only the wrapper goes */
  /* The compute stream (legacy default) is not destroyed, but it is drained
   * like the others: device close promises that no work is left in flight
   * (on the host backend the compute stream never has any). */
  ofl_status_t st = cuda_stream_synchronize(s, ofl__timeout_ms(-1));
  if (s->impl != NULL) {
    dev_guard_t g;
    if (enter(s->dev, &g) == OFL_SUCCESS) {
      if (cudaStreamDestroy((cudaStream_t)s->impl) != cudaSuccess)
        (void)cudaGetLastError();
      leave(&g);
    }
  }
  return st;
}

static ofl_status_t query_status(const ofl_device_t *dev,
                                 cudaError_t (*query)(void *), void *h,
                                 const char *what) {
  dev_guard_t g;
  OFL_CHECK(enter(dev, &g));
  cudaError_t ce = query(h);
  if (ce == cudaErrorNotReady)
    clear_not_ready();
  leave(&g);
  if (ce == cudaErrorNotReady)
    return OFL_ERR_NOT_READY;
  CUDA_TRY(ce, what);
  return OFL_SUCCESS;
}

static ofl_status_t cuda_stream_query(ofl_stream_t *s) {
  return query_status(s->dev, query_stream, s->impl, "stream query");
}

static ofl_status_t cuda_event_create(ofl_event_t *e) {
  cudaEvent_t ev = NULL;
  ON_DEVICE(e->dev, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
            "cannot create an event");
  e->impl = ev;
  return OFL_SUCCESS;
}

static ofl_status_t cuda_event_create_timed(ofl_event_t *e) {
  cudaEvent_t ev = NULL;
  ON_DEVICE(e->dev, cudaEventCreateWithFlags(&ev, cudaEventDefault),
            "cannot create a timing event");
  e->impl = ev;
  return OFL_SUCCESS;
}

static ofl_status_t cuda_event_elapsed_ns(ofl_event_t *a, ofl_event_t *b,
                                          uint64_t *ns) {
  float ms = 0;
  dev_guard_t g;
  OFL_CHECK(enter(a->dev, &g));
  cudaError_t ce =
      cudaEventElapsedTime(&ms, (cudaEvent_t)a->impl, (cudaEvent_t)b->impl);
  if (ce == cudaErrorNotReady)
    clear_not_ready();
  else if (ce != cudaSuccess)
    (void)cudaGetLastError();
  leave(&g);
  if (ce == cudaErrorNotReady)
    return OFL_ERR_NOT_READY;
  CUDA_TRY(ce, "event elapsed time");
  *ns = ms > 0 ? (uint64_t)((double)ms * 1e6) : 0;
  return OFL_SUCCESS;
}

static void cuda_event_destroy(ofl_event_t *e) {
  dev_guard_t g;
  if (enter(e->dev, &g) != OFL_SUCCESS)
    return;
  if (cudaEventDestroy((cudaEvent_t)e->impl) != cudaSuccess)
    (void)cudaGetLastError();
  leave(&g);
}

static ofl_status_t cuda_event_record(ofl_event_t *e, ofl_stream_t *s) {
  ON_DEVICE(s->dev,
            cudaEventRecord((cudaEvent_t)e->impl, (cudaStream_t)s->impl),
            "event record");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_event_query(ofl_event_t *e) {
  return query_status(e->dev, query_event, e->impl, "event query");
}

static ofl_status_t cuda_event_synchronize(ofl_event_t *e, int64_t timeout_ms) {
  return poll_until(e->dev, query_event, e->impl, timeout_ms,
                    "event synchronize");
}

static ofl_status_t cuda_stream_wait_event(ofl_stream_t *s, ofl_event_t *e) {
  ON_DEVICE(s->dev,
            cudaStreamWaitEvent((cudaStream_t)s->impl, (cudaEvent_t)e->impl, 0),
            "stream wait event");
  return OFL_SUCCESS;
}

/* cudaMemcpyDefault: with unified addressing the runtime takes the
 * direction from the pointers, so a kind that does not match them (a
 * caller's mistake) cannot make the copy wrong; the kind still counts the
 * bytes per direction in the statistics. */
static ofl_status_t cuda_memcpy_async(void *dst, const void *src, size_t bytes,
                                      ofl_copy_kind_t kind, ofl_stream_t *s) {
  (void)kind;
  ON_DEVICE(s->dev,
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                            (cudaStream_t)s->impl),
            "async copy");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_memset_async(void *dst, int value, size_t bytes,
                                      ofl_stream_t *s) {
  ON_DEVICE(s->dev, cudaMemsetAsync(dst, value, bytes, (cudaStream_t)s->impl),
            "async memset");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_launch_host_func(ofl_stream_t *s, ofl_host_fn fn,
                                          void *arg) {
  ON_DEVICE(s->dev, cudaLaunchHostFunc((cudaStream_t)s->impl, fn, arg),
            "host function launch");
  return OFL_SUCCESS;
}

static void cuda_range_push(ofl_device_t *dev, const char *name) {
  (void)dev;
  nvtxRangePushA(name);
}

static void cuda_range_pop(ofl_device_t *dev) {
  (void)dev;
  nvtxRangePop();
}

/* Both ends of the range: an allocation is contiguous, so a range that
 * starts and ends in device memory of dev lies in it (two allocations
 * side by side aside, which a tensor cannot tell apart anyway). */
static bool cuda_device_owns(ofl_device_t *dev, const void *ptr, size_t bytes) {
  const char *ends[2] = {ptr, (const char *)ptr + (bytes ? bytes - 1 : 0)};
  dev_guard_t g;
  if (enter(dev, &g) != OFL_SUCCESS)
    return false;
  bool owns = true;
  for (int i = 0; i < 2 && owns; i++) {
    struct cudaPointerAttributes a;
    cudaError_t ce = cudaPointerGetAttributes(&a, ends[i]);
    if (ce != cudaSuccess) {
      (void)cudaGetLastError(); /* an answer, not the application's error */
      owns = false;
    } else if (a.type != cudaMemoryTypeDevice ||
               a.device != dev->cfg.device_index) {
      owns = false;
    }
  }
  leave(&g);
  return owns;
}

/* The release thread is ofl's for good: it stays in relaxed capture mode,
 * so that release callbacks run there may call cudaFree while the
 * application captures a graph on another thread. */
static void cuda_release_thread_init(ofl_device_t *dev) {
  (void)dev;
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess)
    (void)cudaGetLastError();
}

const ofl__device_ops_t ofl__cuda_ops = {
    .name = "cuda",
    .backend = OFL_BACKEND_CUDA,
    .probe = cuda_probe,
    .device_count = cuda_device_count,
    .open = cuda_open,
    .close = cuda_close,
    .device_malloc = cuda_device_malloc,
    .device_free = cuda_device_free,
    .pinned_malloc = cuda_pinned_malloc,
    .pinned_free = cuda_pinned_free,
    .device_owns = cuda_device_owns,
    .link_rate = ofl__cuda_link_rate,
    .release_thread_init = cuda_release_thread_init,
    .stream_create = cuda_stream_create,
    .stream_wrap = cuda_stream_wrap,
    .stream_native = cuda_stream_native,
    .stream_capturing = cuda_stream_capturing,
    .stream_destroy = cuda_stream_destroy,
    .stream_synchronize = cuda_stream_synchronize,
    .stream_query = cuda_stream_query,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .stream_wait_event = cuda_stream_wait_event,
    .event_create_timed = cuda_event_create_timed,
    .event_elapsed_ns = cuda_event_elapsed_ns,
    .memcpy_async = cuda_memcpy_async,
    .memset_async = cuda_memset_async,
    .launch_host_func = cuda_launch_host_func,
    .range_push = cuda_range_push,
    .range_pop = cuda_range_pop,
};

#else
/* ISO C forbids an empty translation unit. */
typedef int ofl__no_cuda_backend;
#endif
