/* ofl: the cuda backend, on the CUDA runtime API. Non-blocking streams,
 * events with timing disabled, pinned memory by malloc + page touch +
 * cudaHostRegister (exact size), NVTX ranges. Compiled whenever the toolkit
 * is found, so it cannot rot on machines without a GPU. */
#include <ofl/version.h>

#if OFL_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "runtime/device_internal.h"

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

ofl_status_t ofl__cuda_probe(int device_index, char *why, size_t cap) {
  int n = 0;
  cudaError_t ce = cudaGetDeviceCount(&n);
  if (ce != cudaSuccess) {
    snprintf(why, cap, "cudaGetDeviceCount failed: %s", cudaGetErrorString(ce));
    return OFL_ERR_NO_DEVICE;
  }
  if (n <= device_index) {
    snprintf(why, cap, "cuda device %d requested, %d present", device_index, n);
    return OFL_ERR_NO_DEVICE;
  }
  why[0] = '\0';
  return OFL_SUCCESS;
}

/* cudaSetDevice is per host thread: memory, streams, events and pinned
 * registrations go to the calling thread's current device. Any thread may
 * call ofl (the one that opened the device, pipeline and staging threads),
 * so every call that creates something selects the device first (a cheap
 * call when it is already current). */
static ofl_status_t use_device(const ofl_device_t *dev) {
  CUDA_TRY(cudaSetDevice(dev->cfg.device_index), "cannot select the device");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_open(ofl_device_t *dev) {
  CUDA_TRY(cudaSetDevice(dev->cfg.device_index), "cannot select the device");
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    dev->stats.device_capacity_bytes = total_b;
  return OFL_SUCCESS;
}

/* Sizes of live device allocations, for the statistics and to reject
 * foreign or double frees before they reach cudaFree; each tagged with its
 * device, whose close releases what is left. */
typedef struct size_node {
  void *ptr;
  size_t bytes;
  const ofl_device_t *dev;
  bool pinned; /* pinned host memory (ptr is the registered range) */
  struct size_node *next;
} size_node_t;

#define SIZE_BUCKETS 1024
static pthread_mutex_t sizes_lock = PTHREAD_MUTEX_INITIALIZER;
static size_node_t *sizes[SIZE_BUCKETS];

static size_t page_bytes(void) {
  long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? (size_t)page : 4096;
}

/* Device close (the streams are drained): blocks still allocated on this
 * device are released, as on the host backend. */
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
  bool selected = cudaSetDevice(dev->cfg.device_index) == cudaSuccess;
  size_t n = 0, bytes = 0;
  while (left != NULL) {
    size_node_t *next = left->next;
    if (left->pinned) {
      if (cudaHostUnregister(left->ptr) != cudaSuccess)
        (void)cudaGetLastError();
      free(left->ptr);
    } else if (selected && cudaFree(left->ptr) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    n++;
    bytes += left->bytes;
    free(left);
    left = next;
  }
  if (!selected)
    (void)cudaGetLastError();
  OFL_INFO(OFL_SUBSYS_DEVICE,
           "device close: %zu block(s) of %zu bytes still allocated; "
           "released now",
           n, bytes);
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
  OFL_CHECK(use_device(dev));
  size_node_t *node = malloc(sizeof *node);
  if (node == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate bookkeeping for a device block");
  void *p = NULL;
  cudaError_t ce = cudaMalloc(&p, bytes);
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
  node_add(node);
  *out = p;
  return OFL_SUCCESS;
}

static ofl_status_t cuda_device_free(ofl_device_t *dev, void *ptr,
                                     size_t *bytes) {
  OFL_CHECK(use_device(dev));
  size_node_t *node = node_take(ptr, false);
  if (node == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "%p is not a device block of ofl (freed twice or "
                      "foreign)",
                      ptr);
  cudaError_t ce = cudaFree(ptr);
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

/* Pinned memory: page-aligned malloc, touch every page, register the exact
 * size (faster to set up than cudaHostAlloc and sized exactly). The block is
 * recorded like a device block, so that a foreign or second free is refused
 * before anything is touched. */
static ofl_status_t cuda_pinned_malloc(ofl_device_t *dev, size_t bytes,
                                       void **out) {
  OFL_CHECK(use_device(dev));
  size_t pg = page_bytes();
  size_node_t *node = malloc(sizeof *node);
  void *mem = NULL;
  if (node == NULL || posix_memalign(&mem, pg, bytes) != 0) {
    free(node);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate %zu bytes of host memory to pin", bytes);
  }
  char *user = mem;
  for (size_t off = 0; off < bytes; off += pg)
    user[off] = 0;
  cudaError_t ce = cudaHostRegister(user, bytes, cudaHostRegisterDefault);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    free(node);
    free(mem);
    return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE,
                      "cudaHostRegister of %zu bytes failed: %s; check the "
                      "locked-memory limit (ulimit -l)",
                      bytes, cudaGetErrorString(ce));
  }
  *node =
      (size_node_t){.ptr = user, .bytes = bytes, .dev = dev, .pinned = true};
  node_add(node);
  *out = user;
  return OFL_SUCCESS;
}

static ofl_status_t cuda_pinned_free(ofl_device_t *dev, void *ptr,
                                     size_t *bytes) {
  OFL_CHECK(use_device(dev));
  size_node_t *node = node_take(ptr, true);
  if (node == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "%p is not pinned memory of ofl (freed twice or "
                      "foreign)",
                      ptr);
  cudaError_t ce = cudaHostUnregister(ptr);
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

/* The compute stream is the legacy default stream (NULL), which names the
 * calling thread's current device: select ours before using it. Other
 * streams need it too: on a thread without a current device (a save or disk
 * thread, a thread of the application) any runtime call initialises device
 * 0's primary context, an extra context on GPU 0 per process. */
static ofl_status_t use_stream(const ofl_stream_t *s) {
  return use_device(s->dev);
}

static ofl_status_t cuda_stream_create(ofl_stream_t *s) {
  if (s->is_compute) {
    s->impl = NULL; /* the legacy default stream */
    return OFL_SUCCESS;
  }
  OFL_CHECK(use_device(s->dev));
  cudaStream_t cs = NULL;
  CUDA_TRY(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking),
           "cannot create a stream");
  s->impl = cs;
  return OFL_SUCCESS;
}

/* Polls until done() is not cudaErrorNotReady or the deadline passes. */
static ofl_status_t poll_until(cudaError_t (*query)(void *), void *h,
                               int64_t timeout_ms, const char *what) {
  uint64_t deadline = ofl__deadline_ns(timeout_ms);
  uint64_t sleep_ns = 1000;
  for (;;) {
    cudaError_t ce = query(h);
    if (ce == cudaSuccess)
      return OFL_SUCCESS;
    if (ce != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE, "%s: %s", what,
                        cudaGetErrorString(ce));
    }
    clear_not_ready();
    if (ofl__now_ns() >= deadline)
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                        "%s: not complete after %lld ms", what,
                        (long long)timeout_ms);
    struct timespec ts = {0, (long)sleep_ns};
    nanosleep(&ts, NULL);
    if (sleep_ns < 1000000)
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
  OFL_CHECK(use_stream(s));
  return poll_until(query_stream, s->impl, timeout_ms, "stream synchronize");
}

static ofl_status_t cuda_stream_destroy(ofl_stream_t *s) {
  /* The compute stream (legacy default) is not destroyed, but it is drained
   * like the others: device close promises that no work is left in flight
   * (on the host backend the compute stream never has any). */
  ofl_status_t st = cuda_stream_synchronize(s, ofl__timeout_ms(-1));
  if (s->impl != NULL)
    cudaStreamDestroy((cudaStream_t)s->impl);
  return st;
}

static ofl_status_t cuda_stream_query(ofl_stream_t *s) {
  OFL_CHECK(use_stream(s));
  cudaError_t ce = cudaStreamQuery((cudaStream_t)s->impl);
  if (ce == cudaErrorNotReady) {
    clear_not_ready();
    return OFL_ERR_NOT_READY;
  }
  CUDA_TRY(ce, "stream query");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_event_create(ofl_event_t *e) {
  OFL_CHECK(use_device(e->dev));
  cudaEvent_t ev = NULL;
  CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
           "cannot create an event");
  e->impl = ev;
  return OFL_SUCCESS;
}

static void cuda_event_destroy(ofl_event_t *e) {
  if (use_device(e->dev) == OFL_SUCCESS)
    cudaEventDestroy((cudaEvent_t)e->impl);
}

static ofl_status_t cuda_event_record(ofl_event_t *e, ofl_stream_t *s) {
  OFL_CHECK(use_stream(s));
  CUDA_TRY(cudaEventRecord((cudaEvent_t)e->impl, (cudaStream_t)s->impl),
           "event record");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_event_query(ofl_event_t *e) {
  OFL_CHECK(use_device(e->dev));
  cudaError_t ce = cudaEventQuery((cudaEvent_t)e->impl);
  if (ce == cudaErrorNotReady) {
    clear_not_ready();
    return OFL_ERR_NOT_READY;
  }
  CUDA_TRY(ce, "event query");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_event_synchronize(ofl_event_t *e, int64_t timeout_ms) {
  OFL_CHECK(use_device(e->dev));
  return poll_until(query_event, e->impl, timeout_ms, "event synchronize");
}

static ofl_status_t cuda_stream_wait_event(ofl_stream_t *s, ofl_event_t *e) {
  OFL_CHECK(use_stream(s));
  CUDA_TRY(cudaStreamWaitEvent((cudaStream_t)s->impl, (cudaEvent_t)e->impl, 0),
           "stream wait event");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_memcpy_async(void *dst, const void *src, size_t bytes,
                                      ofl_copy_kind_t kind, ofl_stream_t *s) {
  OFL_CHECK(use_stream(s));
  static const enum cudaMemcpyKind kinds[] = {
      cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice,
      cudaMemcpyHostToHost};
  CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, kinds[kind], (cudaStream_t)s->impl),
           "async copy");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_memset_async(void *dst, int value, size_t bytes,
                                      ofl_stream_t *s) {
  OFL_CHECK(use_stream(s));
  CUDA_TRY(cudaMemsetAsync(dst, value, bytes, (cudaStream_t)s->impl),
           "async memset");
  return OFL_SUCCESS;
}

static ofl_status_t cuda_launch_host_func(ofl_stream_t *s, ofl_host_fn fn,
                                          void *arg) {
  OFL_CHECK(use_stream(s));
  CUDA_TRY(cudaLaunchHostFunc((cudaStream_t)s->impl, fn, arg),
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

const ofl__device_ops_t ofl__cuda_ops = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .device_malloc = cuda_device_malloc,
    .device_free = cuda_device_free,
    .pinned_malloc = cuda_pinned_malloc,
    .pinned_free = cuda_pinned_free,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_synchronize = cuda_stream_synchronize,
    .stream_query = cuda_stream_query,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .stream_wait_event = cuda_stream_wait_event,
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
