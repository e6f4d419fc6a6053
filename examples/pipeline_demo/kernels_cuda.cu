/* ofl pipeline demo: the layer arithmetic on the GPU (kernels_cuda.h). The
 * kernels are extern "C" so that their device names are their own names,
 * under which kernels_emu.c registers their CPU emulation with the test
 * stand-in; their bodies are kernels_body.h's. */
#include <cuda_runtime.h>

#include "kernels_body.h"
#include "kernels_cuda.h"

#define KC_GLOBAL_INDEX                                                        \
  (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x)

extern "C" {

__global__ void ofl_demo_k_matmul(float *c, const float *a, const float *b,
                                  int m, int k, int n, long long sai,
                                  long long sap, long long sbp, long long sbj,
                                  long long ldc, int acc) {
  kb_matmul(KC_GLOBAL_INDEX, c, a, b, m, k, n, sai, sap, sbp, sbj, ldc, acc);
}

__global__ void ofl_demo_k_rmsnorm(float *y, const float *x, const float *g,
                                   int rows, int h) {
  kb_rmsnorm_row(KC_GLOBAL_INDEX, y, x, g, rows, h);
}

__global__ void ofl_demo_k_rmsnorm_bw_rows(float *dx, float *inv,
                                           const float *x, const float *g,
                                           const float *dy, int rows, int h) {
  kb_rmsnorm_backward_row(KC_GLOBAL_INDEX, dx, inv, x, g, dy, rows, h);
}

__global__ void ofl_demo_k_rmsnorm_bw_cols(float *dg, const float *inv,
                                           const float *x, const float *dy,
                                           int rows, int h) {
  kb_rmsnorm_backward_col(KC_GLOBAL_INDEX, dg, inv, x, dy, rows, h);
}

__global__ void ofl_demo_k_attention(float *out, float *probs,
                                     const float *qkv, int s, int h) {
  kb_attention_row(KC_GLOBAL_INDEX, out, probs, qkv, s, h);
}

__global__ void ofl_demo_k_attention_ds(float *ds, const float *dout,
                                        const float *qkv, const float *probs,
                                        int s, int h) {
  kb_attention_ds_row(KC_GLOBAL_INDEX, ds, dout, qkv, probs, s, h);
}

__global__ void ofl_demo_k_silu(float *act, const float *u, size_t n) {
  kb_silu(KC_GLOBAL_INDEX, act, u, n);
}

__global__ void ofl_demo_k_silu_bw(float *du, const float *dact,
                                   const float *u, size_t n) {
  kb_silu_backward(KC_GLOBAL_INDEX, du, dact, u, n);
}

__global__ void ofl_demo_k_add(float *y, const float *x, size_t n) {
  kb_add(KC_GLOBAL_INDEX, y, x, n);
}

__global__ void ofl_demo_k_sgd(float *w, float *dw, size_t n, float lr) {
  kb_sgd(KC_GLOBAL_INDEX, w, dw, n, lr);
}

} // extern "C"

/* Registers kernels_emu.c's emulations with the stand-in when it is the
 * loaded runtime (kernels_emu.c); 1 when it did. */
extern "C" int ofl_demo_kernels_emu_register(void);

namespace {

constexpr unsigned kThreads = 256;

unsigned blocks_for(size_t n) {
  return static_cast<unsigned>((n + kThreads - 1) / kThreads);
}

cudaStream_t as_stream(void *s) { return static_cast<cudaStream_t>(s); }

/* The launch's error: a bad configuration or argument is reported at the
 * launch by cudaGetLastError (which also clears it). Every launcher first
 * clears an error an earlier call of the thread left (prelaunch), so that
 * it is not taken for the launch's. */
void prelaunch() { (void)cudaGetLastError(); }
int launched() { return static_cast<int>(cudaGetLastError()); }

int launch_matmul(float *c, const float *a, const float *b, int m, int k,
                  int n, long long sai, long long sap, long long sbp,
                  long long sbj, long long ldc, int acc, void *stream) {
  size_t total = static_cast<size_t>(m) * static_cast<size_t>(n);
  if (m <= 0 || n <= 0)
    return 0;
  prelaunch();
  ofl_demo_k_matmul<<<blocks_for(total), kThreads, 0, as_stream(stream)>>>(
      c, a, b, m, k, n, sai, sap, sbp, sbj, ldc, acc);
  return launched();
}

int kc_matmul(float *c, const float *a, const float *b, int m, int k, int n,
              int acc, void *stream) {
  return launch_matmul(c, a, b, m, k, n, k, 1, n, 1, n, acc, stream);
}

int kc_matmul_tn(float *c, const float *a, const float *b, int m, int k, int n,
                 int acc, void *stream) {
  return launch_matmul(c, a, b, m, k, n, 1, m, n, 1, n, acc, stream);
}

int kc_matmul_nt(float *c, const float *a, const float *b, int m, int k, int n,
                 int acc, void *stream) {
  return launch_matmul(c, a, b, m, k, n, k, 1, 1, k, n, acc, stream);
}

int kc_rmsnorm(float *y, const float *x, const float *g, int rows, int h,
               void *stream) {
  if (rows <= 0 || h <= 0)
    return 0;
  prelaunch();
  ofl_demo_k_rmsnorm<<<blocks_for(static_cast<size_t>(rows)), kThreads, 0,
                       as_stream(stream)>>>(y, x, g, rows, h);
  return launched();
}

int kc_rmsnorm_backward(float *dx, float *dg, const float *x, const float *g,
                        const float *dy, float *scratch, int rows, int h,
                        void *stream) {
  if (rows <= 0 || h <= 0)
    return 0;
  prelaunch();
  ofl_demo_k_rmsnorm_bw_rows<<<blocks_for(static_cast<size_t>(rows)), kThreads,
                               0, as_stream(stream)>>>(dx, scratch, x, g, dy,
                                                       rows, h);
  int e = launched();
  if (e != 0)
    return e;
  prelaunch();
  ofl_demo_k_rmsnorm_bw_cols<<<blocks_for(static_cast<size_t>(h)), kThreads, 0,
                               as_stream(stream)>>>(dg, scratch, x, dy, rows,
                                                    h);
  return launched();
}

int kc_attention(float *out, float *probs, const float *qkv, int s, int h,
                 void *stream) {
  if (s <= 0 || h <= 0)
    return 0;
  prelaunch();
  ofl_demo_k_attention<<<blocks_for(static_cast<size_t>(s)), kThreads, 0,
                         as_stream(stream)>>>(out, probs, qkv, s, h);
  return launched();
}

int kc_attention_backward(float *dqkv, const float *dout, const float *qkv,
                          const float *probs, float *scratch, int s, int h,
                          void *stream) {
  if (s <= 0 || h <= 0)
    return 0;
  long long w = 3LL * h;
  float *ds = scratch; /* s x s */
  prelaunch();
  ofl_demo_k_attention_ds<<<blocks_for(static_cast<size_t>(s)), kThreads, 0,
                            as_stream(stream)>>>(ds, dout, qkv, probs, s, h);
  int e = launched();
  /* dq = dS k: A = dS [s,s], B(p,j) = k[p,j] (row stride w) */
  if (e == 0)
    e = launch_matmul(dqkv, ds, qkv + h, s, s, h, s, 1, w, 1, w, 0, stream);
  /* dk = dS^T q: A(i,p) = dS[p,i], B(p,j) = q[p,j] */
  if (e == 0)
    e = launch_matmul(dqkv + h, ds, qkv, s, s, h, 1, s, w, 1, w, 0, stream);
  /* dv = P^T dout: A(i,p) = P[p,i], B(p,j) = dout[p,j] */
  if (e == 0)
    e = launch_matmul(dqkv + 2 * h, probs, dout, s, s, h, 1, s, h, 1, w, 0,
                      stream);
  return e;
}

int kc_silu(float *act, const float *u, size_t n, void *stream) {
  if (n == 0)
    return 0;
  prelaunch();
  ofl_demo_k_silu<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(act, u,
                                                                     n);
  return launched();
}

int kc_silu_backward(float *du, const float *dact, const float *u, size_t n,
                     void *stream) {
  if (n == 0)
    return 0;
  prelaunch();
  ofl_demo_k_silu_bw<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(
      du, dact, u, n);
  return launched();
}

int kc_add(float *y, const float *x, size_t n, void *stream) {
  if (n == 0)
    return 0;
  prelaunch();
  ofl_demo_k_add<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(y, x, n);
  return launched();
}

int kc_sgd(float *w, float *dw, size_t n, float lr, void *stream) {
  if (n == 0)
    return 0;
  prelaunch();
  ofl_demo_k_sgd<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(w, dw, n,
                                                                    lr);
  return launched();
}

int kc_device_count(int *count) {
  return static_cast<int>(cudaGetDeviceCount(count));
}

int kc_set_device(int device) {
  return static_cast<int>(cudaSetDevice(device));
}

int kc_stream_create(void **stream) {
  cudaStream_t s = nullptr;
  int e = static_cast<int>(
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *stream = e == 0 ? static_cast<void *>(s) : nullptr;
  return e;
}

int kc_stream_destroy(void *stream) {
  return static_cast<int>(cudaStreamDestroy(as_stream(stream)));
}

int kc_stream_sync(void *stream) {
  return static_cast<int>(cudaStreamSynchronize(as_stream(stream)));
}

int kc_h2d(void *dst, const void *src, size_t bytes, void *stream) {
  int e = static_cast<int>(cudaMemcpyAsync(dst, src, bytes,
                                           cudaMemcpyHostToDevice,
                                           as_stream(stream)));
  return e != 0 ? e : kc_stream_sync(stream);
}

int kc_d2h(void *dst, const void *src, size_t bytes, void *stream) {
  int e = static_cast<int>(cudaMemcpyAsync(dst, src, bytes,
                                           cudaMemcpyDeviceToHost,
                                           as_stream(stream)));
  return e != 0 ? e : kc_stream_sync(stream);
}

int kc_memset0(void *dst, size_t bytes, void *stream) {
  return static_cast<int>(cudaMemsetAsync(dst, 0, bytes, as_stream(stream)));
}

int kc_mem_info(size_t *free_bytes, size_t *total_bytes) {
  return static_cast<int>(cudaMemGetInfo(free_bytes, total_bytes));
}

const char *kc_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

kc_api_t g_api = {
    KC_API_VERSION,      0,
    kc_matmul,           kc_matmul_tn,
    kc_matmul_nt,        kc_rmsnorm,
    kc_rmsnorm_backward, kc_attention,
    kc_attention_backward, kc_silu,
    kc_silu_backward,    kc_add,
    kc_sgd,              kc_device_count,
    kc_set_device,       kc_stream_create,
    kc_stream_destroy,   kc_stream_sync,
    kc_h2d,              kc_d2h,
    kc_memset0,          kc_mem_info,
    kc_error_string,
};

} // namespace

extern "C" const kc_api_t *ofl_demo_kernels_cuda_api(void) {
  g_api.emulated = ofl_demo_kernels_emu_register();
  return &g_api;
}
