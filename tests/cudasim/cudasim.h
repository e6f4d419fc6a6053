/* cudasim: a strict CPU stand-in for the CUDA runtime (libcudart.so.13) and
 * NCCL (libnccl.so.2), test-only. A test setup puts build/tests/cudasim first
 * on LD_LIBRARY_PATH so that libofl and the test programs load it instead of
 * the real libraries; nothing else changes.
 *
 * This header is the stand-in's own control interface. Test programs link
 * against the real runtime at build time, so they reach these functions with
 * dlsym(RTLD_DEFAULT, "cudasim_...") (tests/support/devmem.h wraps that): a NULL
 * answer means the real runtime is loaded.
 *
 * Environment (read once, at the first call):
 *   CUDASIM_DEVICES        number of devices (default 2; 0: cudaErrorNoDevice)
 *   CUDASIM_DEVICE_MEMORY  bytes per device, K/M/G suffixes (default 8G)
 *   CUDASIM_SEED           seed of the per-stream jitter (default 1)
 *   CUDASIM_JITTER_US      largest jitter before each stream operation, in
 *                          microseconds (default 50; 0: none)
 *   CUDASIM_MISUSE         abort (default): a misuse prints what and where
 *                          and aborts the process; count: it is counted, the
 *                          call returns its CUDA error, and the process exits
 *                          non-zero at exit unless cudasim_reset_misuse ran
 *   CUDASIM_FAIL_AT        the Nth runtime call (1-based, counting every
 *                          cuda* and nccl* call) fails with CUDASIM_FAIL_ERROR
 *                          (default 719, cudaErrorLaunchFailure), which is
 *                          sticky: every later call fails with it too
 *   CUDASIM_DRIVER_VERSION what cudaDriverGetVersion answers (default 13000);
 *                          below the runtime's 13000 cudaGetDeviceCount answers
 *                          cudaErrorInsufficientDriver
 */
#ifndef OFL_TESTS_CUDASIM_H
#define OFL_TESTS_CUDASIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUDASIM_MAX_DEVICES 8

typedef struct cudasim_stats {
  uint64_t device_mallocs;   /* cudaMalloc, cudaMallocAsync */
  uint64_t device_frees;     /* cudaFree, cudaFreeAsync */
  uint64_t host_allocs;      /* cudaMallocHost, cudaHostAlloc */
  uint64_t host_frees;       /* cudaFreeHost */
  uint64_t host_registers;   /* cudaHostRegister */
  uint64_t host_unregisters; /* cudaHostUnregister */
  uint64_t implicit_syncs;   /* calls that synchronised a device (cudaFree,
                                cudaHostRegister/Unregister, cudaFreeHost) */
  uint64_t copies, copy_bytes;
  uint64_t host_fn_calls;
  uint64_t nccl_collectives;
  uint64_t misuse; /* misuse reports (only non-zero in count mode) */
  uint64_t kernel_launches; /* kernels launched (emulated, see below) */
  /* 1 once the primary context of device d was created (the first call that
   * needed device d: cudaSetDevice, or any call on a thread whose current
   * device is d, including a thread that never chose one: device 0). */
  uint64_t contexts[CUDASIM_MAX_DEVICES];
  uint64_t device_bytes_in_use[CUDASIM_MAX_DEVICES];
} cudasim_stats_t;

/* Counters since the process started (or the last reset). Returns 0. */
int cudasim_get_stats(cudasim_stats_t *out);
/* Zeroes the counters (not contexts, not bytes in use). */
void cudasim_reset_stats(void);
/* 1: abort at a misuse (default), 0: count it. */
void cudasim_set_misuse_abort(int on);
/* The text of the last misuse report ("" if none). */
const char *cudasim_last_misuse(void);
/* Forgets reported misuse (a test that provokes misuse on purpose). */
void cudasim_reset_misuse(void);
/* The call `n` calls from now (1: the next one) fails with `error`; sticky
 * errors stay, as a real sticky error does, until the process ends. */
void cudasim_inject_error(uint64_t n, int error, int sticky);
/* 1 when ptr lies in a live device allocation (device in *device). */
int cudasim_is_device_memory(const void *ptr, int *device);
/* ---- kernels -------------------------------------------------------------
 * The stand-in cannot run device code. It answers the registration calls an
 * nvcc-compiled object makes at load (__cudaRegisterFatBinary,
 * __cudaRegisterFunction, ...) and the launches (<<<>>>, cudaLaunchKernel):
 * a launch runs on its stream, in stream order, a CPU emulation of the
 * kernel that the program registered under the kernel's device name (an
 * extern "C" __global__ function: its own name). A kernel without an
 * emulation fails its launch with cudaErrorNoKernelImageForDevice.
 *
 * An emulation declares its parameters' sizes (as the kernel's), and which
 * parameters are device pointers with how many bytes from each the launch
 * may touch (`spans`, called at the launch with the argument values): each
 * span must lie in one live allocation of the stream's device at the launch
 * (else misuse, as a GPU would fault) and still when the kernel runs; frees
 * of memory a queued kernel spans are misuse, as for copies. Only 1-D grids
 * are emulated: the emulation's `thread` runs once per thread index
 * blockIdx.x * blockDim.x + threadIdx.x, in order, with the pointer
 * parameters replaced by the CPU-side addresses of their spans. Kernels that
 * use shared memory, synchronise threads or use atomics across threads
 * cannot be emulated this way. What the spans do not declare is not
 * checked: a body that touches more than its spans reads or writes the
 * bytes of whatever lies there (spans are checked against allocations
 * rounded up to 256 bytes, as the stand-in allocates them). */
#define CUDASIM_KERNEL_MAX_PARAMS 16
typedef struct cudasim_kernel_span {
  int param;    /* index of a pointer parameter */
  size_t bytes; /* bytes from that pointer the launch touches (0: none) */
} cudasim_kernel_span_t;
typedef struct cudasim_kernel_emu {
  const char *name; /* the kernel's device name */
  int nparams;
  size_t param_size[CUDASIM_KERNEL_MAX_PARAMS];
  /* args[i] points at the value of parameter i. Returns the number of
   * spans written (<= max). */
  int (*spans)(void *const *args, cudasim_kernel_span_t *out, int max);
  void (*thread)(void *const *args, long long idx);
} cudasim_kernel_emu_t;
/* Registers (or replaces) the emulation of the kernel emu->name; *emu and
 * the name must outlive the process's launches. Returns 0 or EINVAL. */
int cudasim_register_kernel(const cudasim_kernel_emu_t *emu);

/* 1 while the calling thread is the host-function thread. */
int cudasim_in_host_fn(void);

/* ---- between the cudart and NCCL halves of the stand-in ------------------
 * (libnccl.so.2 links the stand-in's libcudart.so.13 and calls these.) */

/* An operation run by the stream's worker in stream order; it may block
 * (an NCCL collective waiting for its peers) and should return when *abort
 * becomes non-zero (cudasim__abort_ops). Returns 0 on success, or a CUDA
 * error code which becomes the stream's sticky error. *abort is written with
 * __atomic_store_n by another thread: read it with __atomic_load_n (a plain
 * volatile read is a data race under ThreadSanitizer). */
typedef int (*cudasim_op_fn)(void *arg, volatile int *abort);
/* Enqueues fn(arg) on stream (a cudaStream_t; NULL: the legacy stream of
 * the current device). Returns 0 or a CUDA error (misuse reported). */
int cudasim__enqueue(void *stream, cudasim_op_fn fn, void *arg,
                     const char *what);
/* Sets the abort flag of every queued or running cudasim__enqueue operation
 * whose arg is `arg` (ncclCommAbort). */
void cudasim__abort_ops(void *arg);
/* The CPU-side address of [ptr, ptr+bytes) when it lies in one live device
 * allocation, else NULL (misuse reported, naming `what`). */
void *cudasim__shadow(const void *ptr, size_t bytes, const char *what);
/* Device of a stream (NULL: the current device's legacy stream). */
int cudasim__stream_device(void *stream);
/* Reports a misuse (printf format): aborts or counts per CUDASIM_MISUSE. */
void cudasim__misuse(const char *fmt, ...);
/* Counts one runtime call for CUDASIM_FAIL_AT / injected errors, and checks
 * the host-function rule; returns 0 or the error the call must return. */
int cudasim__enter(const char *api);

#ifdef __cplusplus
}
#endif
#endif
