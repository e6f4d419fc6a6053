/* cudasim, runtime half: a strict CPU stand-in for libcudart.so.13 (see
 * cudasim.h for the contract and the environment). It models what ofl relies
 * on, and is stricter than a GPU wherever that exposes a bug:
 *   - device memory lives in a PROT_NONE range, so a CPU access segfaults;
 *     the stand-in reads and writes it through a second (shadow) mapping;
 *   - every stream, the legacy default stream included, is a worker thread
 *     with a FIFO and a seeded random jitter before each operation;
 *   - host functions run on one process-wide thread that may not call CUDA;
 *   - copies are checked against their kind, one live allocation, the
 *     stream's device, and frees of memory that queued work still uses;
 *   - a basic graph-capture model refuses what a real capture refuses;
 *   - kernel launches run as the CPU emulation the program registered for
 *     the kernel (cudasim_register_kernel), once per thread of a 1-D grid,
 *     on the launch's stream in stream order, each pointer span checked
 *     against a live allocation at the launch and when it runs; a kernel
 *     with no emulation fails with cudaErrorNoKernelImageForDevice.
 * Not modelled: cudaStreamPerThread (using it is misuse); device code itself
 * (shared memory, synchronisation within a block), 2-D and 3-D launches
 * (misuse), the GPU's kernel timing and floating-point rounding; peer
 * copies (device memory of another device than the stream's is misuse);
 * graph nodes and edges (a graph is its captured operations in record order,
 * replayed on the launch stream; unjoined forks are not detected; a capturing
 * stream may only wait for events recorded in the same capture); stream
 * priorities; managed memory. Races on device or pinned memory between
 * streams are data races on the shadow: ThreadSanitizer reports them.
 *
 * Locking: g.mu guards the tables (allocations, host ranges, stream list,
 * captures); each stream's mu guards its queue; g.mk_mu guards marker
 * completion. Order: g.mu before a stream's mu; nothing is held while an
 * operation runs or a worker sleeps. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "cudasim.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <execinfo.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define ALIGN_DEV 256u
/* The CUDA version this runtime plays (13000: libcudart.so.13; the
 * libcudart.so.12 copy in cu12/ is built with 12080). */
#ifdef CUDASIM_RUNTIME_VERSION
#define RUNTIME_VERSION CUDASIM_RUNTIME_VERSION
#else
#define RUNTIME_VERSION 13000
#endif

/* ---- small helpers ------------------------------------------------------ */

#define A_LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define A_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define A_ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)

static void *xcalloc(size_t n, size_t sz) {
  void *p = calloc(n, sz);
  if (!p) {
    fprintf(stderr, "cudasim: out of host memory\n");
    abort();
  }
  return p;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int ranges_overlap(uintptr_t a, size_t an, uintptr_t b, size_t bn) {
  return an && bn && a < b + bn && b < a + an;
}

/* ---- objects ------------------------------------------------------------ */

/* A position in a stream: completes when the stream's worker has run every
 * operation up to it. Events point at their latest marker; waits hold the
 * marker they captured at the call. Refcounted. */
typedef struct marker {
  int refs; /* atomic */
  int done; /* atomic; set under g.mk_mu */
  uint64_t t_ns;
} marker_t;

enum op_kind { OP_COPY, OP_MEMSET, OP_NOP, OP_HOSTFN, OP_EXT, OP_FREE, OP_KERNEL };

typedef struct op {
  struct op *next;
  enum op_kind kind;
  marker_t *marker; /* completes with this op */
  marker_t **pre;   /* waited for before the op runs */
  int npre;
  /* copy / memset / free */
  void *dst;
  const void *src;
  size_t bytes;
  int value;
  int dst_dev, src_dev; /* device of a device pointer, -1: host */
  int dst_pinned, src_pinned;
  void *staging; /* owned copy of a pageable H2D source */
  /* host function / external op */
  cudaHostFn_t fn;
  cudasim_op_fn xfn;
  void *arg;
  volatile int abort_flag; /* written with atomics */
  const char *what;
  /* kernel: its emulation, threads (1-D), a copy of the arguments (kargs,
   * kargs_bytes; parameter i at koff[i]) and the spans it touches, with the
   * device pointer each one starts at (kptr) */
  const cudasim_kernel_emu_t *kemu;
  unsigned long long kthreads;
  unsigned char *kargs;
  size_t kargs_bytes;
  size_t koff[CUDASIM_KERNEL_MAX_PARAMS];
  cudasim_kernel_span_t kspans[CUDASIM_KERNEL_MAX_PARAMS];
  uintptr_t kptr[CUDASIM_KERNEL_MAX_PARAMS];
  int nkspans;
} op_t;

struct capture;

#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u
#define DEAD_MAGIC 0xdeadu

typedef struct cstream {
  unsigned magic;
  int dev;
  unsigned flags;
  int legacy;
  int index; /* creation index: seeds the jitter */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  op_t *head, *tail; /* head: running or next; removed after it ran */
  marker_t *last;    /* marker of the last enqueued op (NULL: none) */
  int destroyed;
  int error;                /* sticky error of an external op */
  struct capture *cap;      /* g.mu: capture this stream records into */
  struct cstream *next_all; /* g.mu */
  uint64_t rng;             /* worker only */
} cstream_t;

typedef struct cevent {
  unsigned magic;
  int dev;
  unsigned flags;
  marker_t *marker;    /* g.mu: latest record, NULL: never recorded */
  struct capture *cap; /* g.mu: recorded during this capture */
} cevent_t;

/* A recorded graph: op templates, cloned by every launch. */
#define GRAPH_MAGIC 0x47524150u
typedef struct cgraph {
  unsigned magic;
  op_t **ops;
  int n, cap;
} cgraph_t;

typedef struct capture {
  int mode;
  int invalidated;
  int active;
  unsigned long long id;
  cstream_t *origin;
  pthread_t thread;
  cgraph_t *graph;
  struct capture *next;
} capture_t;

typedef struct alloc {
  uintptr_t start;
  size_t size; /* rounded to ALIGN_DEV */
} alloc_t;

typedef struct device {
  char *base, *shadow; /* reserved lazily */
  size_t range, capacity, used, bump;
  alloc_t *allocs; /* sorted by start */
  int nallocs, cap_allocs;
  cstream_t *legacy;
} device_t;

enum { HOST_ALLOC = 1, HOST_REGISTERED = 2 };
typedef struct host_range {
  uintptr_t start;
  size_t size;
  int kind;
  int dev;
} host_range_t;

static struct {
  pthread_once_t once;
  /* configuration */
  int ndev;
  size_t dev_memory;
  uint64_t seed;
  unsigned jitter_us;
  int misuse_abort; /* atomic */
  uint64_t fail_at;
  int fail_error;
  int driver_version;
  /* tables */
  pthread_mutex_t mu;
  device_t dev[CUDASIM_MAX_DEVICES];
  host_range_t *hosts;
  int nhosts, cap_hosts;
  cstream_t *streams;
  int nstreams_created;
  capture_t *captures;
  unsigned long long capture_ids;
  /* markers */
  pthread_mutex_t mk_mu;
  pthread_cond_t mk_cv;
  /* calls and errors (atomics) */
  uint64_t calls;
  uint64_t inject_at;
  int inject_error, inject_sticky;
  int sticky;
  /* misuse */
  pthread_mutex_t mis_mu;
  char last_misuse[512];
  uint64_t misuse_pending;
  cudasim_stats_t stats; /* fields updated with atomics */
  /* host-function thread */
  pthread_mutex_t cb_mu;
  pthread_cond_t cb_cv;
  int cb_started;
  op_t *cb_op; /* handed over by a worker */
  int cb_done;
} g = {.once = PTHREAD_ONCE_INIT,
       .mu = PTHREAD_MUTEX_INITIALIZER,
       .mk_mu = PTHREAD_MUTEX_INITIALIZER,
       .mk_cv = PTHREAD_COND_INITIALIZER,
       .mis_mu = PTHREAD_MUTEX_INITIALIZER,
       .cb_mu = PTHREAD_MUTEX_INITIALIZER,
       .cb_cv = PTHREAD_COND_INITIALIZER,
       .misuse_abort = 1};

static __thread int t_dev;        /* current device */
static __thread int t_last_error; /* cudaGetLastError */
static __thread int t_in_cb;      /* the host-function thread */
/* cudaThreadExchangeStreamCaptureMode: this thread's interaction mode with
 * captures (global by default; relaxed: its unsafe calls break none). */
static __thread int t_capture_mode = cudaStreamCaptureModeGlobal;

#define STAT_ADD(field, v) A_ADD(&g.stats.field, (uint64_t)(v))

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
    "no kernel image is available for execution on the device")               \
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
#define misuse cudasim__misuse

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

static void ensure_init(void) { pthread_once(&g.once, init_once); }

/* Sets the thread's last error (every failing call does, NotReady included,
 * as the real runtime does). */
static cudaError_t fail(int e) {
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

#define ENTER(api)                                                             \
  do {                                                                         \
    int enter_e_ = cudasim__enter(api);                                        \
    if (enter_e_)                                                              \
      return fail(enter_e_);                                                   \
  } while (0)

/* The primary context of the current device: created by the first call that
 * needs one. */
static int need_ctx(void) {
  if (g.driver_version < RUNTIME_VERSION)
    return cudaErrorInsufficientDriver;
  if (g.ndev == 0)
    return cudaErrorNoDevice;
  A_STORE(&g.stats.contexts[t_dev], 1);
  return cudaSuccess;
}

#define NEED_CTX()                                                             \
  do {                                                                         \
    int ctx_e_ = need_ctx();                                                   \
    if (ctx_e_)                                                                \
      return fail(ctx_e_);                                                     \
  } while (0)

/* ---- markers ------------------------------------------------------------ */

static marker_t *marker_new(void) {
  marker_t *m = xcalloc(1, sizeof *m);
  m->refs = 1;
  return m;
}

static marker_t *marker_ref(marker_t *m) {
  if (m)
    A_ADD(&m->refs, 1);
  return m;
}

static void marker_unref(marker_t *m) {
  if (m && A_ADD(&m->refs, -1) == 0)
    free(m);
}

static int marker_done(marker_t *m) { return !m || A_LOAD(&m->done); }

static void marker_complete(marker_t *m) {
  pthread_mutex_lock(&g.mk_mu);
  m->t_ns = now_ns();
  A_STORE(&m->done, 1);
  pthread_cond_broadcast(&g.mk_cv);
  pthread_mutex_unlock(&g.mk_mu);
}

static void marker_wait(marker_t *m) {
  if (marker_done(m))
    return;
  pthread_mutex_lock(&g.mk_mu);
  while (!A_LOAD(&m->done))
    pthread_cond_wait(&g.mk_cv, &g.mk_mu);
  pthread_mutex_unlock(&g.mk_mu);
}

/* ---- device memory --------------------------------------------------------
 */

/* Reserves the device's address range: PROT_NONE so that the CPU faults on
 * device memory, plus a shadow the stand-in itself uses. Twice the capacity
 * so that freed addresses are not reused soon; smaller where the address
 * space is limited (valgrind), down to 256 MiB. */
static int device_reserve(device_t *d) {
  if (d->base)
    return 0;
  size_t range = d->capacity * 2;
  const size_t min_range = (size_t)256 << 20;
  if (range < min_range)
    range = min_range;
  range = (range + 4095) & ~(size_t)4095;
  for (; range >= min_range; range = (range / 2 + 4095) & ~(size_t)4095) {
    int fl = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void *b = mmap(NULL, range, PROT_NONE, fl, -1, 0);
    if (b == MAP_FAILED)
      continue;
    void *s = mmap(NULL, range, PROT_READ | PROT_WRITE, fl, -1, 0);
    if (s == MAP_FAILED) {
      munmap(b, range);
      continue;
    }
    d->base = b;
    d->shadow = s;
    d->range = range;
    return 0;
  }
  return -1;
}

/* Index of the first allocation whose start is > p (binary search). */
static int alloc_upper(const device_t *d, uintptr_t p) {
  int lo = 0, hi = d->nallocs;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (d->allocs[mid].start <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The device whose range holds p, or -1. g.mu held. */
static int device_of_addr(uintptr_t p) {
  for (int i = 0; i < g.ndev; i++) {
    device_t *d = &g.dev[i];
    if (d->base && p >= (uintptr_t)d->base && p < (uintptr_t)d->base + d->range)
      return i;
  }
  return -1;
}

/* The live allocation holding p (NULL: none). g.mu held. */
static alloc_t *alloc_find(int dev, uintptr_t p) {
  device_t *d = &g.dev[dev];
  int i = alloc_upper(d, p) - 1;
  if (i >= 0 && p < d->allocs[i].start + d->allocs[i].size)
    return &d->allocs[i];
  return NULL;
}

/* Bump allocation so that freed addresses are not reused soon (a stale
 * pointer then faults or is reported); first fit once the range is used. */
static uintptr_t alloc_place(device_t *d, size_t size) {
  if (d->bump + size <= d->range)
    return (uintptr_t)d->base + (d->bump += size) - size;
  uintptr_t prev = (uintptr_t)d->base;
  for (int i = 0; i <= d->nallocs; i++) {
    uintptr_t next =
        i < d->nallocs ? d->allocs[i].start : (uintptr_t)d->base + d->range;
    if (next - prev >= size)
      return prev;
    if (i < d->nallocs)
      prev = d->allocs[i].start + d->allocs[i].size;
  }
  return 0;
}

static int device_alloc(int dev, size_t bytes, void **out) {
  device_t *d = &g.dev[dev];
  size_t size = (bytes + ALIGN_DEV - 1) & ~(size_t)(ALIGN_DEV - 1);
  if (size == 0)
    size = ALIGN_DEV;
  pthread_mutex_lock(&g.mu);
  int e = cudaErrorMemoryAllocation;
  uintptr_t p = 0;
  if (device_reserve(d) == 0 && d->used + size <= d->capacity &&
      (p = alloc_place(d, size)) != 0) {
    if (d->nallocs == d->cap_allocs) {
      d->cap_allocs = d->cap_allocs ? d->cap_allocs * 2 : 64;
      d->allocs = realloc(d->allocs, (size_t)d->cap_allocs * sizeof *d->allocs);
      if (!d->allocs)
        abort();
    }
    int i = alloc_upper(d, p);
    memmove(&d->allocs[i + 1], &d->allocs[i],
            (size_t)(d->nallocs - i) * sizeof *d->allocs);
    d->allocs[i] = (alloc_t){p, size};
    d->nallocs++;
    d->used += size;
    A_STORE(&g.stats.device_bytes_in_use[dev], (uint64_t)d->used);
    *out = (void *)p;
    e = cudaSuccess;
  }
  pthread_mutex_unlock(&g.mu);
  return e;
}

/* Removes the allocation starting at p. g.mu held. Returns 0 or -1. */
static int device_release(int dev, uintptr_t p) {
  device_t *d = &g.dev[dev];
  int i = alloc_upper(d, p) - 1;
  if (i < 0 || d->allocs[i].start != p)
    return -1;
  size_t size = d->allocs[i].size;
  /* The contents die with the allocation: a reuse reads zeros. */
  madvise(d->shadow + (p - (uintptr_t)d->base), size, MADV_DONTNEED);
  memmove(&d->allocs[i], &d->allocs[i + 1],
          (size_t)(d->nallocs - i - 1) * sizeof *d->allocs);
  d->nallocs--;
  d->used -= size;
  A_STORE(&g.stats.device_bytes_in_use[dev], (uint64_t)d->used);
  return 0;
}

/* Shadow of [p, p+bytes) if it lies in one live allocation. g.mu held. */
static char *shadow_of(uintptr_t p, size_t bytes, int *dev_out) {
  int dev = device_of_addr(p);
  if (dev < 0)
    return NULL;
  alloc_t *a = alloc_find(dev, p);
  if (!a || p + bytes > a->start + a->size)
    return NULL;
  if (dev_out)
    *dev_out = dev;
  return g.dev[dev].shadow + (p - (uintptr_t)g.dev[dev].base);
}

/* ---- pinned host ranges -------------------------------------------------- */

static int host_upper(uintptr_t p) {
  int lo = 0, hi = g.nhosts;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (g.hosts[mid].start <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The pinned range holding p (NULL: pageable). g.mu held. */
static host_range_t *host_find(uintptr_t p) {
  int i = host_upper(p) - 1;
  if (i >= 0 && p < g.hosts[i].start + g.hosts[i].size)
    return &g.hosts[i];
  return NULL;
}

static int host_overlaps(uintptr_t p, size_t size) {
  int i = host_upper(p);
  if (i > 0 &&
      ranges_overlap(g.hosts[i - 1].start, g.hosts[i - 1].size, p, size))
    return 1;
  return i < g.nhosts &&
         ranges_overlap(g.hosts[i].start, g.hosts[i].size, p, size);
}

static void host_insert(uintptr_t p, size_t size, int kind, int dev) {
  if (g.nhosts == g.cap_hosts) {
    g.cap_hosts = g.cap_hosts ? g.cap_hosts * 2 : 64;
    g.hosts = realloc(g.hosts, (size_t)g.cap_hosts * sizeof *g.hosts);
    if (!g.hosts)
      abort();
  }
  int i = host_upper(p);
  memmove(&g.hosts[i + 1], &g.hosts[i],
          (size_t)(g.nhosts - i) * sizeof *g.hosts);
  g.hosts[i] = (host_range_t){p, size, kind, dev};
  g.nhosts++;
}

static void host_remove(host_range_t *h) {
  int i = (int)(h - g.hosts);
  memmove(&g.hosts[i], &g.hosts[i + 1],
          (size_t)(g.nhosts - i - 1) * sizeof *g.hosts);
  g.nhosts--;
}

/* Whether all of [p, p+bytes) is pinned. g.mu held. */
static int host_pinned(uintptr_t p, size_t bytes) {
  host_range_t *h = host_find(p);
  return h && p + bytes <= h->start + h->size;
}

/* ---- operations and the host-function thread ------------------------------
 */

static op_t *op_new(enum op_kind kind, const char *what) {
  op_t *op = xcalloc(1, sizeof *op);
  op->kind = kind;
  op->what = what;
  op->dst_dev = op->src_dev = -1;
  return op;
}

static void op_free(op_t *op) {
  for (int i = 0; i < op->npre; i++)
    marker_unref(op->pre[i]);
  free(op->pre);
  free(op->staging);
  free(op->kargs);
  marker_unref(op->marker);
  free(op);
}

static void op_add_pre(op_t *op, marker_t *m) {
  op->pre = realloc(op->pre, (size_t)(op->npre + 1) * sizeof *op->pre);
  if (!op->pre)
    abort();
  op->pre[op->npre++] = marker_ref(m);
}

static op_t *op_clone(const op_t *t) {
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

static int alloc_start_locked(const void *p, size_t *size);
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

static int capture_forbids(int err) {
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
static int stream_get_locked(cudaStream_t h, cstream_t **out, const char *api) {
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

static int stream_get(cudaStream_t h, cstream_t **out, const char *api) {
  pthread_mutex_lock(&g.mu);
  int e = stream_get_locked(h, out, api);
  pthread_mutex_unlock(&g.mu);
  return e;
}

/* The same for the calls a capture does not allow on its own stream (a
 * query, a synchronisation, an allocation): while the stream captures, the
 * capture is invalidated and cudaErrorStreamCaptureUnsupported returned. */
static int stream_get_uncaptured(cudaStream_t h, cstream_t **out,
                                 const char *api) {
  pthread_mutex_lock(&g.mu);
  int e = stream_get_locked(h, out, api);
  if (!e && (*out)->cap) {
    (*out)->cap->invalidated = 1;
    e = cudaErrorStreamCaptureUnsupported;
  }
  pthread_mutex_unlock(&g.mu);
  return e;
}

static void graph_append(cgraph_t *gr, op_t *op) {
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
static int push_locked(cstream_t *s, op_t *op) {
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
static int busy_locked(uintptr_t p, size_t size) {
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
static void sync_device(int dev) {
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

/* ---- device memory API ----------------------------------------------------
 */

EXPORT cudaError_t cudaMalloc(void **devPtr, size_t size) {
  ENTER("cudaMalloc");
  NEED_CTX();
  if (!devPtr)
    return fail(cudaErrorInvalidValue);
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  if (size == 0) {
    *devPtr = NULL;
    return cudaSuccess;
  }
  void *p;
  e = device_alloc(t_dev, size, &p);
  if (e)
    return fail(e); /* out of memory is an answer, not misuse */
  STAT_ADD(device_mallocs, 1);
  *devPtr = p;
  return cudaSuccess;
}

/* Finds the allocation starting at p: its device, or -1. g.mu held. */
static int alloc_start_locked(const void *p, size_t *size) {
  int dev = device_of_addr((uintptr_t)p);
  alloc_t *a = dev >= 0 ? alloc_find(dev, (uintptr_t)p) : NULL;
  if (!a || a->start != (uintptr_t)p)
    return -1;
  *size = a->size;
  return dev;
}

EXPORT cudaError_t cudaFree(void *devPtr) {
  ENTER("cudaFree");
  NEED_CTX();
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  if (!devPtr)
    return cudaSuccess;
  size_t size = 0;
  pthread_mutex_lock(&g.mu);
  int dev = alloc_start_locked(devPtr, &size);
  int busy = dev >= 0 && busy_locked((uintptr_t)devPtr, size);
  pthread_mutex_unlock(&g.mu);
  if (dev < 0) {
    misuse("cudaFree(%p): not the start of a live device allocation (double "
           "free or foreign pointer)",
           devPtr);
    return fail(cudaErrorInvalidValue);
  }
  if (busy)
    misuse("cudaFree(%p): queued work still uses this memory (free it after "
           "the work's event completed)",
           devPtr);
  /* cudaFree synchronizes the device, as the real one does (all of them
   * after a misuse, so that count mode does not free memory in use). */
  STAT_ADD(implicit_syncs, 1);
  sync_device(busy ? -1 : dev);
  pthread_mutex_lock(&g.mu);
  int r = device_release(dev, (uintptr_t)devPtr);
  pthread_mutex_unlock(&g.mu);
  if (r != 0) {
    misuse("cudaFree(%p): freed twice concurrently", devPtr);
    return fail(cudaErrorInvalidValue);
  }
  STAT_ADD(device_frees, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMallocAsync(void **devPtr, size_t size,
                                   cudaStream_t hStream) {
  ENTER("cudaMallocAsync");
  NEED_CTX();
  if (!devPtr)
    return fail(cudaErrorInvalidValue);
  cstream_t *s; /* (captured allocation nodes are not modelled) */
  int e = stream_get_uncaptured(hStream, &s, "cudaMallocAsync");
  if (e)
    return fail(e);
  void *p = NULL;
  if (size && (e = device_alloc(s->dev, size, &p)) != 0)
    return fail(e);
  STAT_ADD(device_mallocs, 1);
  *devPtr = p;
  return cudaSuccess;
}

/* Stream-ordered free: the allocation dies when the stream reaches it. */
EXPORT cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream) {
  ENTER("cudaFreeAsync");
  NEED_CTX();
  cstream_t *s;
  int e = stream_get(hStream, &s, "cudaFreeAsync");
  if (e)
    return fail(e);
  if (!devPtr)
    return cudaSuccess;
  size_t size;
  pthread_mutex_lock(&g.mu);
  int dev = alloc_start_locked(devPtr, &size);
  if (dev < 0 || dev != s->dev) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaFreeAsync(%p): %s", devPtr,
           dev < 0 ? "not the start of a live device allocation"
                   : "memory of another device than the stream's");
    return fail(cudaErrorInvalidValue);
  }
  if (s->cap) {
    s->cap->invalidated = 1;
    pthread_mutex_unlock(&g.mu);
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  for (cstream_t *t = g.streams; t; t = t->next_all) {
    pthread_mutex_lock(&t->mu);
    for (op_t *op = t->head; op; op = op->next)
      if (op->kind == OP_FREE && op->dst == devPtr)
        e = 1;
    pthread_mutex_unlock(&t->mu);
  }
  if (e) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaFreeAsync(%p): already freed by a queued cudaFreeAsync",
           devPtr);
    return fail(cudaErrorInvalidValue);
  }
  op_t *op = op_new(OP_FREE, "cudaFreeAsync");
  op->dst = devPtr;
  op->dst_dev = dev;
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(device_frees, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  ENTER("cudaMemGetInfo");
  NEED_CTX();
  if (!free_bytes || !total)
    return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&g.mu);
  *total = g.dev[t_dev].capacity;
  *free_bytes = g.dev[t_dev].capacity - g.dev[t_dev].used;
  pthread_mutex_unlock(&g.mu);
  return cudaSuccess;
}

/* ---- pinned host memory API -----------------------------------------------
 */

EXPORT cudaError_t cudaHostAlloc(void **pHost, size_t size,
                                 unsigned int flags) {
  ENTER("cudaHostAlloc");
  NEED_CTX();
  if (!pHost || flags > 0xf)
    return fail(cudaErrorInvalidValue);
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  void *p = NULL;
  if (posix_memalign(&p, 4096, size ? size : 1) != 0)
    return fail(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&g.mu);
  host_insert((uintptr_t)p, size ? size : 1, HOST_ALLOC, t_dev);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(host_allocs, 1);
  *pHost = p;
  return cudaSuccess;
}

EXPORT cudaError_t cudaMallocHost(void **ptr, size_t size) {
  return cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

/* Shared by cudaFreeHost and cudaHostUnregister: the range must be of `kind`
 * and start at p; queued work that still uses it is misuse; the call
 * synchronizes (as the real one does) and forgets the range. */
static int host_release(void *p, int kind, const char *api, int not_found) {
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return e;
  pthread_mutex_lock(&g.mu);
  host_range_t *h = host_find((uintptr_t)p);
  int ok = h && h->start == (uintptr_t)p && h->kind == kind;
  size_t size = ok ? h->size : 0;
  int busy = ok && busy_locked((uintptr_t)p, size);
  pthread_mutex_unlock(&g.mu);
  if (!ok) {
    misuse("%s(%p): not %s", api, p,
           kind == HOST_ALLOC ? "a cudaMallocHost/cudaHostAlloc block"
                              : "the start of a cudaHostRegister'ed range");
    return not_found;
  }
  if (busy)
    misuse("%s(%p): queued work still uses this memory", api, p);
  /* The real call synchronizes the current device only; after a misuse all
   * of them, so that count mode does not free memory a copy is using. */
  STAT_ADD(implicit_syncs, 1);
  sync_device(busy ? -1 : t_dev);
  pthread_mutex_lock(&g.mu);
  h = host_find((uintptr_t)p);
  ok = h && h->start == (uintptr_t)p && h->kind == kind;
  if (ok)
    host_remove(h);
  pthread_mutex_unlock(&g.mu);
  if (!ok) {
    misuse("%s(%p): released twice concurrently", api, p);
    return not_found;
  }
  return cudaSuccess;
}

EXPORT cudaError_t cudaFreeHost(void *ptr) {
  ENTER("cudaFreeHost");
  NEED_CTX();
  if (!ptr)
    return cudaSuccess;
  int e = host_release(ptr, HOST_ALLOC, "cudaFreeHost", cudaErrorInvalidValue);
  if (e)
    return fail(e);
  free(ptr);
  STAT_ADD(host_frees, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaHostRegister(void *ptr, size_t size,
                                    unsigned int flags) {
  ENTER("cudaHostRegister");
  NEED_CTX();
  if (!ptr || !size || flags > 0xf)
    return fail(cudaErrorInvalidValue);
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  pthread_mutex_lock(&g.mu);
  if (device_of_addr((uintptr_t)ptr) >= 0) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaHostRegister(%p): device memory", ptr);
    return fail(cudaErrorInvalidValue);
  }
  if (host_overlaps((uintptr_t)ptr, size)) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaHostRegister(%p, %zu): overlaps pinned or registered memory",
           ptr, size);
    return fail(cudaErrorHostMemoryAlreadyRegistered);
  }
  host_insert((uintptr_t)ptr, size, HOST_REGISTERED, t_dev);
  pthread_mutex_unlock(&g.mu);
  /* Counted as the synchronizing call it is on a GPU; not waited for, so
   * that work racing with it is not hidden. */
  STAT_ADD(implicit_syncs, 1);
  STAT_ADD(host_registers, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaHostUnregister(void *ptr) {
  ENTER("cudaHostUnregister");
  NEED_CTX();
  int e = host_release(ptr, HOST_REGISTERED, "cudaHostUnregister",
                       cudaErrorHostMemoryNotRegistered);
  if (e)
    return fail(e);
  STAT_ADD(host_unregisters, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attr,
                                            const void *ptr) {
  ENTER("cudaPointerGetAttributes");
  if (!attr)
    return fail(cudaErrorInvalidValue);
  memset(attr, 0, sizeof *attr);
  attr->type = cudaMemoryTypeUnregistered;
  attr->device = -2;
  pthread_mutex_lock(&g.mu);
  int dev = device_of_addr((uintptr_t)ptr);
  host_range_t *h;
  if (dev >= 0 && alloc_find(dev, (uintptr_t)ptr)) {
    attr->type = cudaMemoryTypeDevice;
    attr->device = dev;
    attr->devicePointer = (void *)ptr;
  } else if (dev < 0 && (h = host_find((uintptr_t)ptr)) != NULL) {
    attr->type = cudaMemoryTypeHost;
    attr->device = h->dev;
    attr->devicePointer = (void *)ptr;
    attr->hostPointer = (void *)ptr;
  }
  pthread_mutex_unlock(&g.mu);
  return cudaSuccess;
}

/* ---- copies and memsets -----------------------------------------------------
 */

enum { MEM_HOST, MEM_PINNED, MEM_DEVICE, MEM_STALE };

/* What [p, p+bytes) is: device memory in one live allocation (device in
 * *dev), a device address outside one (stale: freed or overrun), pinned host
 * memory, or pageable host memory. g.mu held. */
static int classify_locked(const void *p, size_t bytes, int *dev) {
  *dev = device_of_addr((uintptr_t)p);
  if (*dev >= 0)
    return shadow_of((uintptr_t)p, bytes, NULL) ? MEM_DEVICE : MEM_STALE;
  return host_pinned((uintptr_t)p, bytes) ? MEM_PINNED : MEM_HOST;
}

static const char *kind_name(int k) {
  static const char *names[] = {"HostToHost", "HostToDevice", "DeviceToHost",
                                "DeviceToDevice", "Default"};
  return k >= 0 && k <= 4 ? names[k] : "?";
}

/* The one copy path. sync: cudaMemcpy (waits, except for a pageable H2D,
 * which returns once staged, and D2D, which never waits); async: waits only
 * where CUDA's API sync behaviour says so (D2H into pageable memory and
 * host-to-host copies). */
static cudaError_t copy_common(void *dst, const void *src, size_t bytes,
                               enum cudaMemcpyKind kind, cudaStream_t h,
                               const char *api, int sync) {
  if ((int)kind < 0 || (int)kind > cudaMemcpyDefault)
    return fail(cudaErrorInvalidMemcpyDirection);
  if (bytes == 0)
    return cudaSuccess;
  if (!dst || !src) {
    misuse("%s: NULL %s with %zu bytes", api, dst ? "source" : "destination",
           bytes);
    return fail(cudaErrorInvalidValue);
  }
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(h, &s, api);
  if (e) {
    pthread_mutex_unlock(&g.mu);
    return fail(e);
  }
  int ddev, sdev;
  int dc = classify_locked(dst, bytes, &ddev);
  int sc = classify_locked(src, bytes, &sdev);
  const char *why = NULL;
  int inferred = (sc == MEM_DEVICE ? 2 : 0) + (dc == MEM_DEVICE ? 1 : 0);
  static const int kinds[4] = {cudaMemcpyHostToHost, cudaMemcpyHostToDevice,
                               cudaMemcpyDeviceToHost,
                               cudaMemcpyDeviceToDevice};
  if (dc == MEM_STALE || sc == MEM_STALE)
    why = "range not inside one live device allocation (use after free or "
          "overrun)";
  else if (kind != cudaMemcpyDefault && (int)kind != kinds[inferred])
    why = "kind does not match the pointers";
  else if ((sc == MEM_DEVICE && sdev != s->dev) ||
           (dc == MEM_DEVICE && ddev != s->dev))
    why = "device memory of another device than the stream's";
  if (why) {
    pthread_mutex_unlock(&g.mu);
    misuse("%s(dst %p, src %p, %zu bytes, %s): %s (dst is %s, src is %s)", api,
           dst, src, bytes, kind_name((int)kind), why,
           dc == MEM_DEVICE  ? "device"
           : dc == MEM_STALE ? "stale device"
                             : "host",
           sc == MEM_DEVICE  ? "device"
           : sc == MEM_STALE ? "stale device"
                             : "host");
    return fail(cudaErrorInvalidValue);
  }
  kind = (enum cudaMemcpyKind)kinds[inferred];
  op_t *op = op_new(OP_COPY, api);
  op->dst = dst;
  op->src = src;
  op->bytes = bytes;
  op->dst_dev = dc == MEM_DEVICE ? ddev : -1;
  op->src_dev = sc == MEM_DEVICE ? sdev : -1;
  op->dst_pinned = dc == MEM_PINNED;
  op->src_pinned = sc == MEM_PINNED;
  int capturing = s->cap != NULL;
  int pageable_h2d = kind == cudaMemcpyHostToDevice && sc == MEM_HOST;
  /* A pageable source is staged at the call: the caller may reuse it once
   * the call returned (the DMA itself is still asynchronous). */
  if (pageable_h2d && !capturing) {
    op->staging = malloc(bytes);
    if (!op->staging)
      abort();
    memcpy(op->staging, src, bytes);
  }
  int wait = !capturing &&
             ((kind == cudaMemcpyDeviceToHost && dc == MEM_HOST) ||
              kind == cudaMemcpyHostToHost ||
              (sync && !pageable_h2d && kind != cudaMemcpyDeviceToDevice));
  marker_t *m = NULL;
  if (wait)
    m = marker_ref(op->marker = marker_new());
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(copies, 1);
  STAT_ADD(copy_bytes, bytes);
  if (m) {
    marker_wait(m);
    marker_unref(m);
  }
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                   enum cudaMemcpyKind kind,
                                   cudaStream_t stream) {
  ENTER("cudaMemcpyAsync");
  NEED_CTX();
  return copy_common(dst, src, count, kind, stream, "cudaMemcpyAsync", 0);
}

EXPORT cudaError_t cudaMemcpy(void *dst, const void *src, size_t count,
                              enum cudaMemcpyKind kind) {
  ENTER("cudaMemcpy");
  NEED_CTX();
  return copy_common(dst, src, count, kind, NULL, "cudaMemcpy", 1);
}

/* Memsets of device memory never wait, cudaMemset included (CUDA: they are
 * asynchronous unless the target is pinned host memory). */
static cudaError_t memset_common(void *dst, int value, size_t bytes,
                                 cudaStream_t h, const char *api) {
  if (bytes == 0)
    return cudaSuccess;
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(h, &s, api);
  if (e) {
    pthread_mutex_unlock(&g.mu);
    return fail(e);
  }
  int dev;
  int c = classify_locked(dst, bytes, &dev);
  if (c != MEM_DEVICE || dev != s->dev) {
    pthread_mutex_unlock(&g.mu);
    misuse("%s(%p, %zu bytes): %s", api, dst, bytes,
           c == MEM_DEVICE ? "device memory of another device than the stream's"
           : c == MEM_STALE
               ? "not inside one live device allocation (use after "
                 "free or overrun)"
               : "not device memory");
    return fail(cudaErrorInvalidValue);
  }
  op_t *op = op_new(OP_MEMSET, api);
  op->dst = dst;
  op->dst_dev = dev;
  op->value = value;
  op->bytes = bytes;
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count,
                                   cudaStream_t stream) {
  ENTER("cudaMemsetAsync");
  NEED_CTX();
  return memset_common(devPtr, value, count, stream, "cudaMemsetAsync");
}

EXPORT cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
  ENTER("cudaMemset");
  NEED_CTX();
  return memset_common(devPtr, value, count, NULL, "cudaMemset");
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

/* ---- kernels (cudasim.h): registration, launch configuration, launches
 * ------------------------------------------------------------------------ */

typedef struct kfunc {
  struct kfunc *next;
  void **module; /* the __cudaRegisterFatBinary handle */
  const void *host; /* the host stub nvcc generated */
  char name[256];   /* device name */
} kfunc_t;

typedef struct kemu_reg {
  struct kemu_reg *next;
  const cudasim_kernel_emu_t *emu;
} kemu_reg_t;

static pthread_mutex_t k_mu = PTHREAD_MUTEX_INITIALIZER;
static kfunc_t *k_funcs;   /* k_mu */
static kemu_reg_t *k_emus; /* k_mu */

/* The <<<>>> configurations pushed and not yet popped, per thread. */
typedef struct {
  dim3 grid, block;
  size_t shmem;
  cudaStream_t stream;
} kconf_t;
static __thread kconf_t t_kconf[8];
static __thread int t_nkconf;

EXPORT void **__cudaRegisterFatBinary(void *fatCubin) {
  ensure_init();
  void **h = xcalloc(1, sizeof *h);
  *h = fatCubin;
  return h;
}

EXPORT void __cudaRegisterFatBinaryEnd(void **handle) { (void)handle; }

EXPORT void __cudaUnregisterFatBinary(void **handle) {
  pthread_mutex_lock(&k_mu);
  for (kfunc_t **pp = &k_funcs; *pp;) {
    if ((*pp)->module == handle) {
      kfunc_t *f = *pp;
      *pp = f->next;
      free(f);
    } else {
      pp = &(*pp)->next;
    }
  }
  pthread_mutex_unlock(&k_mu);
  free(handle);
}

EXPORT void __cudaRegisterFunction(void **handle, const char *hostFun,
                                   char *deviceFun, const char *deviceName,
                                   int thread_limit, uint3 *tid, uint3 *bid,
                                   dim3 *bDim, dim3 *gDim, int *wSize) {
  (void)deviceFun, (void)thread_limit, (void)tid, (void)bid, (void)bDim;
  (void)gDim, (void)wSize;
  kfunc_t *f = xcalloc(1, sizeof *f);
  f->module = handle;
  f->host = hostFun;
  snprintf(f->name, sizeof f->name, "%s", deviceName ? deviceName : "?");
  pthread_mutex_lock(&k_mu);
  f->next = k_funcs;
  k_funcs = f;
  pthread_mutex_unlock(&k_mu);
}

/* Copies the device name of the kernel registered for host stub `host`
 * (or whose handle is `handle`) into name; 0 when there is none. Under
 * k_mu: a module may be unregistered (dlclose, exit) meanwhile. */
static kfunc_t *kfunc_find_locked(const void *host, const void *handle) {
  kfunc_t *f = k_funcs;
  while (f && f->host != host && (void *)f != handle)
    f = f->next;
  return f;
}

static int kfunc_name(const void *host, const void *handle, char *name,
                      size_t cap) {
  pthread_mutex_lock(&k_mu);
  kfunc_t *f = kfunc_find_locked(host, handle);
  if (f)
    snprintf(name, cap, "%s", f->name);
  pthread_mutex_unlock(&k_mu);
  return f != NULL;
}

EXPORT int cudasim_register_kernel(const cudasim_kernel_emu_t *emu) {
  if (!emu || !emu->name || !emu->thread || !emu->spans || emu->nparams < 0 ||
      emu->nparams > CUDASIM_KERNEL_MAX_PARAMS)
    return EINVAL;
  for (int i = 0; i < emu->nparams; i++)
    if (emu->param_size[i] == 0)
      return EINVAL;
  pthread_mutex_lock(&k_mu);
  kemu_reg_t *r = k_emus;
  while (r && strcmp(r->emu->name, emu->name) != 0)
    r = r->next;
  if (!r) {
    r = xcalloc(1, sizeof *r);
    r->next = k_emus;
    k_emus = r;
  }
  r->emu = emu;
  pthread_mutex_unlock(&k_mu);
  return 0;
}

static const cudasim_kernel_emu_t *kemu_find(const char *name) {
  pthread_mutex_lock(&k_mu);
  kemu_reg_t *r = k_emus;
  while (r && strcmp(r->emu->name, name) != 0)
    r = r->next;
  pthread_mutex_unlock(&k_mu);
  return r ? r->emu : NULL;
}

EXPORT cudaError_t __cudaGetKernel(cudaKernel_t *out, const void *hostFun) {
  ensure_init();
  pthread_mutex_lock(&k_mu);
  kfunc_t *f = hostFun ? kfunc_find_locked(hostFun, NULL) : NULL;
  pthread_mutex_unlock(&k_mu);
  if (!out || !f)
    return fail(cudaErrorInvalidDeviceFunction);
  *out = (cudaKernel_t)f;
  return cudaSuccess;
}

EXPORT unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim,
                                            size_t sharedMem,
                                            struct CUstream_st *stream) {
  if (t_nkconf == (int)(sizeof t_kconf / sizeof t_kconf[0]))
    return 1;
  t_kconf[t_nkconf++] = (kconf_t){gridDim, blockDim, sharedMem, stream};
  return 0;
}

EXPORT cudaError_t __cudaPopCallConfiguration(dim3 *gridDim, dim3 *blockDim,
                                              size_t *sharedMem,
                                              void *stream) {
  if (t_nkconf == 0)
    return fail(cudaErrorMissingConfiguration);
  kconf_t c = t_kconf[--t_nkconf];
  *gridDim = c.grid;
  *blockDim = c.block;
  *sharedMem = c.shmem;
  *(cudaStream_t *)stream = c.stream;
  return cudaSuccess;
}

static cudaError_t launch_common(const char *kname, dim3 grid, dim3 block,
                                 void **args, size_t shmem, cudaStream_t h,
                                 const char *api) {
  NEED_CTX();
  if (!kname)
    return fail(cudaErrorInvalidDeviceFunction);
  unsigned long long threads =
      (unsigned long long)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu ||
      grid.y > 65535 || grid.z > 65535 || threads == 0 || threads > 1024 ||
      block.x > 1024 || block.y > 1024 || block.z > 64)
    return fail(cudaErrorInvalidConfiguration);
  if (shmem > 48 * 1024)
    return fail(cudaErrorInvalidValue);
  const cudasim_kernel_emu_t *emu = kemu_find(kname);
  if (!emu) {
    fprintf(stderr,
            "cudasim: %s(%s): no CPU emulation of this kernel is registered "
            "(cudasim_register_kernel); the stand-in cannot run device code\n",
            api, kname);
    return fail(cudaErrorNoKernelImageForDevice);
  }
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    misuse("%s(%s): grid %ux%ux%u, block %ux%ux%u: the stand-in emulates 1-D "
           "launches only",
           api, kname, grid.x, grid.y, grid.z, block.x, block.y, block.z);
    return fail(cudaErrorNotSupported);
  }
  if (emu->nparams > 0 && !args)
    return fail(cudaErrorInvalidValue);
  op_t *op = op_new(OP_KERNEL, api);
  op->kemu = emu;
  op->kthreads = (unsigned long long)grid.x * block.x;
  size_t off = 0;
  for (int i = 0; i < emu->nparams; i++) {
    op->koff[i] = off;
    off += (emu->param_size[i] + 15) & ~(size_t)15;
  }
  op->kargs_bytes = off;
  op->kargs = xcalloc(1, off ? off : 1);
  void *copied[CUDASIM_KERNEL_MAX_PARAMS];
  for (int i = 0; i < emu->nparams; i++) {
    memcpy(op->kargs + op->koff[i], args[i], emu->param_size[i]);
    copied[i] = op->kargs + op->koff[i];
  }
  int n = emu->spans(copied, op->kspans, CUDASIM_KERNEL_MAX_PARAMS);
  if (n < 0 || n > CUDASIM_KERNEL_MAX_PARAMS) {
    misuse("%s(%s): the emulation's spans() answered %d (0 to %d)", api,
           kname, n, CUDASIM_KERNEL_MAX_PARAMS);
    op_free(op);
    return fail(cudaErrorInvalidValue);
  }
  op->nkspans = n;
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(h, &s, api);
  for (int i = 0; !e && i < n; i++) {
    const cudasim_kernel_span_t *sp = &op->kspans[i];
    if (sp->param < 0 || sp->param >= emu->nparams ||
        emu->param_size[sp->param] != sizeof(void *)) {
      pthread_mutex_unlock(&g.mu);
      misuse("%s(%s): the emulation names parameter %d as a pointer", api,
             kname, sp->param);
      op_free(op);
      return fail(cudaErrorInvalidValue);
    }
    void *p;
    memcpy(&p, op->kargs + op->koff[sp->param], sizeof p);
    op->kptr[i] = (uintptr_t)p;
    if (sp->bytes == 0)
      continue;
    int dev = -1;
    if (!shadow_of((uintptr_t)p, sp->bytes, &dev) || dev != s->dev) {
      pthread_mutex_unlock(&g.mu);
      misuse("%s(%s): parameter %d, %p, does not hold the %zu bytes the "
             "kernel touches in one live allocation of the stream's device "
             "%d (%s); a GPU would fault (cudaErrorIllegalAddress)",
             api, kname, sp->param, p, sp->bytes, s->dev,
             dev < 0 ? "not device memory, freed, or overrun"
                     : "memory of another device");
      op_free(op);
      return fail(cudaErrorIllegalAddress);
    }
  }
  if (e) {
    pthread_mutex_unlock(&g.mu);
    op_free(op);
    return fail(e);
  }
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(kernel_launches, 1);
  return cudaSuccess;
}

/* The two launch entry points: by the handle __cudaGetKernel gave (what
 * nvcc's <<<>>> calls in CUDA 13) or by the host stub. */
static cudaError_t launch_by(const void *host, const void *handle, dim3 grid,
                             dim3 block, void **args, size_t shmem,
                             cudaStream_t stream) {
  char name[256];
  int found = (host != NULL || handle != NULL) &&
              kfunc_name(host, handle, name, sizeof name);
  return launch_common(found ? name : NULL, grid, block, args, shmem, stream,
                       "cudaLaunchKernel");
}

EXPORT cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim,
                                      dim3 blockDim, void **args,
                                      size_t sharedMem, cudaStream_t stream) {
  ENTER("cudaLaunchKernel");
  return launch_by(NULL, kernel, gridDim, blockDim, args, sharedMem, stream);
}

EXPORT cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim,
                                    dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream) {
  ENTER("cudaLaunchKernel");
  return launch_by(func, NULL, gridDim, blockDim, args, sharedMem, stream);
}

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
