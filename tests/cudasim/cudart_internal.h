/* cudasim, runtime half: what its files share (cudart*.c, listed in
 * tests/cudasim/meson.build as cudart_sources): the objects, the
 * process-wide state g, and the functions one file calls in another.
 * Internal to the library (hidden; cudart.map exports only the CUDA
 * API and the cudasim_ interface). */
#ifndef CUDASIM_CUDART_INTERNAL_H
#define CUDASIM_CUDART_INTERNAL_H

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

static inline void *xcalloc(size_t n, size_t sz) {
  void *p = calloc(n, sz);
  if (!p) {
    fprintf(stderr, "cudasim: out of host memory\n");
    abort();
  }
  return p;
}

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static inline int ranges_overlap(uintptr_t a, size_t an, uintptr_t b,
                                 size_t bn) {
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

enum op_kind {
  OP_COPY,
  OP_MEMSET,
  OP_NOP,
  OP_HOSTFN,
  OP_EXT,
  OP_FREE,
  OP_KERNEL
};

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

typedef struct {
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
} cudasim_state_t;

/* The process-wide state (cudart.c). */
extern cudasim_state_t g;

extern __thread int t_dev;        /* current device */
extern __thread int t_last_error; /* cudaGetLastError */
extern __thread int t_in_cb;      /* the host-function thread */
/* cudaThreadExchangeStreamCaptureMode: this thread's interaction mode with
 * captures (global by default; relaxed: its unsafe calls break none). */
extern __thread int t_capture_mode;

#define STAT_ADD(field, v) A_ADD(&g.stats.field, (uint64_t)(v))

#define misuse(...) cudasim__misuse(__VA_ARGS__)

#define ENTER(api)                                                             \
  do {                                                                         \
    int enter_e_ = cudasim__enter(api);                                        \
    if (enter_e_)                                                              \
      return fail(enter_e_);                                                   \
  } while (0)

#define NEED_CTX()                                                             \
  do {                                                                         \
    int ctx_e_ = need_ctx();                                                   \
    if (ctx_e_)                                                                \
      return fail(ctx_e_);                                                     \
  } while (0)

/* error names, misuse, initialisation, markers, devices (cudart.c) */
void ensure_init(void);
cudaError_t fail(int e);
int need_ctx(void);
marker_t *marker_new(void);
marker_t *marker_ref(marker_t *m);
void marker_unref(marker_t *m);
int marker_done(marker_t *m);
void marker_complete(marker_t *m);
void marker_wait(marker_t *m);

/* device memory and pinned host ranges (cudart_memory.c) */
int device_of_addr(uintptr_t p);
alloc_t *alloc_find(int dev, uintptr_t p);
int device_release(int dev, uintptr_t p);
char *shadow_of(uintptr_t p, size_t bytes, int *dev_out);
int host_pinned(uintptr_t p, size_t bytes);
int alloc_start_locked(const void *p, size_t *size);

/* operations, the host-function thread, streams (cudart_stream.c) */
op_t *op_new(enum op_kind kind, const char *what);
void op_free(op_t *op);
void op_add_pre(op_t *op, marker_t *m);
op_t *op_clone(const op_t *t);
int capture_forbids(int err);
int stream_get_locked(cudaStream_t h, cstream_t **out, const char *api);
int stream_get(cudaStream_t h, cstream_t **out, const char *api);
int stream_get_uncaptured(cudaStream_t h, cstream_t **out, const char *api);
void graph_append(cgraph_t *gr, op_t *op);
int push_locked(cstream_t *s, op_t *op);
int busy_locked(uintptr_t p, size_t size);
void sync_device(int dev);

#endif
