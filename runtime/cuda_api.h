/* ofl: the CUDA runtime and NCCL, loaded at run time. libofl is compiled
 * against their headers but links neither: the first cuda device open
 * (ofl__cudart_load, from the backend probe) and the first NCCL comm
 * creation (ofl__nccl_load) dlopen them and fill one table of function
 * pointers each, so that `ldd libofl.so` names neither library and a
 * CPU-only node without them runs the host backend.
 *
 * One CUDA runtime per process. The runtime used: OFL_CUDART_LIBRARY when
 * set; else one the process has loaded already (libcudart.so.13, .so.12,
 * .so.11.0, .so, or any loaded libcudart*.so* such as a wheel's renamed
 * copy), never a second one beside it; else libcudart.so.13, or
 * libcudart.so.12 when the driver refuses the .so.13
 * (cudaErrorInsufficientDriver from its first call) and the .so.12 works.
 * ofl__cudart_choice says which and why (ofl-info prints it). NCCL:
 * OFL_NCCL_LIBRARY, else libnccl.so.2. The library used is made RTLD_GLOBAL,
 * as if linked: the driver's helpers that look symbols up in the global
 * scope find it.
 *
 * The source that includes this header calls cudaX(...) / ncclX(...) as
 * before: each name below is a function-like macro that goes through the
 * table. A call to a function missing from the lists fails the link of
 * libofl (undefined symbol), so the lists cannot fall behind the code. */
#ifndef OFL_RUNTIME_CUDA_API_H
#define OFL_RUNTIME_CUDA_API_H

#include <ofl/version.h>

#if OFL_HAVE_CUDA

#include <stddef.h>

#include <cuda_runtime_api.h>
#if OFL_HAVE_NCCL
#include <nccl.h>
#endif

#include <ofl/status.h>

/* Every CUDA runtime function libofl calls. */
#define OFL__CUDART_FUNCS(X)                                                   \
  X(cudaGetLastError)                                                          \
  X(cudaPeekAtLastError)                                                       \
  X(cudaGetErrorString)                                                        \
  X(cudaGetDeviceCount)                                                        \
  X(cudaDriverGetVersion)                                                      \
  X(cudaRuntimeGetVersion)                                                     \
  X(cudaGetDevice)                                                             \
  X(cudaSetDevice)                                                             \
  X(cudaMemGetInfo)                                                            \
  X(cudaMalloc)                                                                \
  X(cudaFree)                                                                  \
  X(cudaMallocHost)                                                            \
  X(cudaFreeHost)                                                              \
  X(cudaHostRegister)                                                          \
  X(cudaHostUnregister)                                                        \
  X(cudaPointerGetAttributes)                                                  \
  X(cudaStreamCreateWithFlags)                                                 \
  X(cudaStreamDestroy)                                                         \
  X(cudaStreamQuery)                                                           \
  X(cudaStreamGetDevice)                                                       \
  X(cudaStreamWaitEvent)                                                       \
  X(cudaStreamIsCapturing)                                                     \
  X(cudaThreadExchangeStreamCaptureMode)                                       \
  X(cudaEventCreateWithFlags)                                                  \
  X(cudaEventDestroy)                                                          \
  X(cudaEventRecord)                                                           \
  X(cudaEventQuery)                                                            \
  X(cudaEventElapsedTime)                                                      \
  X(cudaMemcpyAsync)                                                           \
  X(cudaMemsetAsync)                                                           \
  X(cudaLaunchHostFunc)

/* Every NCCL function libofl calls. */
#define OFL__NCCL_FUNCS(X)                                                     \
  X(ncclGetErrorString)                                                        \
  X(ncclCommCount)                                                             \
  X(ncclCommUserRank)                                                          \
  X(ncclCommCuDevice)                                                          \
  X(ncclCommGetAsyncError)                                                     \
  X(ncclCommAbort)                                                             \
  X(ncclAllGather)

#define OFL__API_FIELD(name) __typeof__(&name) name;

typedef struct ofl__cudart_api {
  OFL__CUDART_FUNCS(OFL__API_FIELD)
} ofl__cudart_api_t;
extern ofl__cudart_api_t ofl__cu;

/* Loads the CUDA runtime once per process (later calls answer at once) and
 * makes its first call (cudaGetDeviceCount). OFL_SUCCESS, or
 * OFL_ERR_NO_DEVICE with why (cap bytes) telling apart: the runtime not
 * found (the libraries tried and what dlopen answered) or lacking an entry
 * point; no GPU or no driver installed (libcuda.so.1 absent, no
 * /dev/nvidia*); a driver too old for the runtime (with both versions); no
 * device visible (CUDA_VISIBLE_DEVICES named when set). No error is recorded
 * as the thread's last error: the caller decides. */
ofl_status_t ofl__cudart_load(char *why, size_t cap);
/* Which runtime the table uses and why, e.g. "libcudart.so.12
 * (/path/libcudart.so.12), already loaded by the process"; "" before a load
 * or when none was found. Also logged at INFO as "cuda runtime: ...". */
void ofl__cudart_choice(char *buf, size_t cap);

#if OFL_HAVE_NCCL
typedef struct ofl__nccl_api {
  OFL__NCCL_FUNCS(OFL__API_FIELD)
} ofl__nccl_api_t;
extern ofl__nccl_api_t ofl__nccl;
/* Same for NCCL (which needs the CUDA runtime, loaded first). */
ofl_status_t ofl__nccl_load(char *why, size_t cap);
#endif

/* The calls, through the tables (OFL_CUDA_API_IMPL: the loader itself,
 * which names the real functions). */
#ifndef OFL_CUDA_API_IMPL
#define cudaGetLastError(...) ofl__cu.cudaGetLastError(__VA_ARGS__)
#define cudaPeekAtLastError(...) ofl__cu.cudaPeekAtLastError(__VA_ARGS__)
#define cudaGetErrorString(...) ofl__cu.cudaGetErrorString(__VA_ARGS__)
#define cudaGetDeviceCount(...) ofl__cu.cudaGetDeviceCount(__VA_ARGS__)
#define cudaDriverGetVersion(...) ofl__cu.cudaDriverGetVersion(__VA_ARGS__)
#define cudaRuntimeGetVersion(...) ofl__cu.cudaRuntimeGetVersion(__VA_ARGS__)
#define cudaGetDevice(...) ofl__cu.cudaGetDevice(__VA_ARGS__)
#define cudaSetDevice(...) ofl__cu.cudaSetDevice(__VA_ARGS__)
#define cudaMemGetInfo(...) ofl__cu.cudaMemGetInfo(__VA_ARGS__)
#define cudaMalloc(...) ofl__cu.cudaMalloc(__VA_ARGS__)
#define cudaFree(...) ofl__cu.cudaFree(__VA_ARGS__)
#define cudaMallocHost(...) ofl__cu.cudaMallocHost(__VA_ARGS__)
#define cudaFreeHost(...) ofl__cu.cudaFreeHost(__VA_ARGS__)
#define cudaHostRegister(...) ofl__cu.cudaHostRegister(__VA_ARGS__)
#define cudaHostUnregister(...) ofl__cu.cudaHostUnregister(__VA_ARGS__)
#define cudaPointerGetAttributes(...)                                          \
  ofl__cu.cudaPointerGetAttributes(__VA_ARGS__)
#define cudaStreamCreateWithFlags(...)                                         \
  ofl__cu.cudaStreamCreateWithFlags(__VA_ARGS__)
#define cudaStreamDestroy(...) ofl__cu.cudaStreamDestroy(__VA_ARGS__)
#define cudaStreamQuery(...) ofl__cu.cudaStreamQuery(__VA_ARGS__)
#define cudaStreamGetDevice(...) ofl__cu.cudaStreamGetDevice(__VA_ARGS__)
#define cudaStreamWaitEvent(...) ofl__cu.cudaStreamWaitEvent(__VA_ARGS__)
#define cudaStreamIsCapturing(...) ofl__cu.cudaStreamIsCapturing(__VA_ARGS__)
#define cudaThreadExchangeStreamCaptureMode(...)                               \
  ofl__cu.cudaThreadExchangeStreamCaptureMode(__VA_ARGS__)
#define cudaEventCreateWithFlags(...)                                          \
  ofl__cu.cudaEventCreateWithFlags(__VA_ARGS__)
#define cudaEventDestroy(...) ofl__cu.cudaEventDestroy(__VA_ARGS__)
#define cudaEventRecord(...) ofl__cu.cudaEventRecord(__VA_ARGS__)
#define cudaEventQuery(...) ofl__cu.cudaEventQuery(__VA_ARGS__)
#define cudaEventElapsedTime(...) ofl__cu.cudaEventElapsedTime(__VA_ARGS__)
#define cudaMemcpyAsync(...) ofl__cu.cudaMemcpyAsync(__VA_ARGS__)
#define cudaMemsetAsync(...) ofl__cu.cudaMemsetAsync(__VA_ARGS__)
#define cudaLaunchHostFunc(...) ofl__cu.cudaLaunchHostFunc(__VA_ARGS__)
#if OFL_HAVE_NCCL
#define ncclGetErrorString(...) ofl__nccl.ncclGetErrorString(__VA_ARGS__)
#define ncclCommCount(...) ofl__nccl.ncclCommCount(__VA_ARGS__)
#define ncclCommUserRank(...) ofl__nccl.ncclCommUserRank(__VA_ARGS__)
#define ncclCommCuDevice(...) ofl__nccl.ncclCommCuDevice(__VA_ARGS__)
#define ncclCommGetAsyncError(...) ofl__nccl.ncclCommGetAsyncError(__VA_ARGS__)
#define ncclCommAbort(...) ofl__nccl.ncclCommAbort(__VA_ARGS__)
#define ncclAllGather(...) ofl__nccl.ncclAllGather(__VA_ARGS__)
#endif
#endif /* OFL_CUDA_API_IMPL */

#endif /* OFL_HAVE_CUDA */

#endif /* OFL_RUNTIME_CUDA_API_H */
