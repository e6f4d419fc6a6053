/* ofl pipeline demo: the layer arithmetic of kernels.h as CUDA kernels
 * (kernels_cuda.cu), on a stream the caller gives (a cudaStream_t as void *:
 * the demo's own non-blocking compute stream, wrapped for ofl with
 * ofl_stream_wrap_native + ofl_device_set_compute_stream).
 *
 * COMPILE-ONLY: these are compiled with nvcc (warnings as errors) in every
 * build that finds the toolkit, so they cannot rot, but they have never run:
 * the test stand-in of libcudart cannot run kernels, and the demo does not
 * call them yet (its --backend cuda says so and stops).
 *
 * Deterministic: one thread per output element or per row, each summing in
 * a fixed order; no atomics, no reductions split across threads, so two runs
 * give the same bits (not the CPU's bits: the order differs from kernels.c).
 * Every function returns the cudaError_t of its launches as an int (0: ok).
 * Pointers are device pointers; row-major as in kernels.h. */
#ifndef OFL_DEMO_KERNELS_CUDA_H
#define OFL_DEMO_KERNELS_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

int kc_matmul(float *c, const float *a, const float *b, int m, int k, int n,
              int acc, void *stream);
int kc_matmul_tn(float *c, const float *a, const float *b, int m, int k,
                 int n, int acc, void *stream);
int kc_matmul_nt(float *c, const float *a, const float *b, int m, int k,
                 int n, int acc, void *stream);
int kc_rmsnorm(float *y, const float *x, const float *g, int rows, int h,
               void *stream);
/* scratch: rows floats (the rows' 1/rms). */
int kc_rmsnorm_backward(float *dx, float *dg, const float *x, const float *g,
                        const float *dy, float *scratch, int rows, int h,
                        void *stream);
int kc_attention(float *out, float *probs, const float *qkv, int s, int h,
                 void *stream);
/* scratch: s * s + s floats (dS and the rows' sum of dP * P). */
int kc_attention_backward(float *dqkv, const float *dout, const float *qkv,
                          const float *probs, float *scratch, int s, int h,
                          void *stream);
int kc_silu(float *act, const float *u, size_t n, void *stream);
int kc_silu_backward(float *du, const float *dact, const float *u, size_t n,
                     void *stream);
int kc_add(float *y, const float *x, size_t n, void *stream);
/* w -= lr * dw, then dw = 0. */
int kc_sgd(float *w, float *dw, size_t n, float lr, void *stream);

#ifdef __cplusplus
}
#endif

#endif
