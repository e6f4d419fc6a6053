/* ofl pipeline demo: the GPU side of the demo's arithmetic, in a module of
 * its own (libofl_demo_kernels_cuda.so: kernels_cuda.cu built by nvcc,
 * kernels_emu.c by the C compiler), which the demo dlopens when it computes
 * on a cuda device. The demo itself stays plain C and links no CUDA
 * library; everything it asks of the CUDA runtime goes through this table.
 *
 * Kernels: the layer arithmetic of kernels.h on device pointers, launched
 * on the stream the caller passes (a cudaStream_t as void *: the demo's own
 * non-blocking compute stream, which it hands ofl with
 * ofl_stream_wrap_native + ofl_device_set_compute_stream). Deterministic:
 * one thread per output element or per row, each summing in a fixed order
 * (kernels_body.h), no atomics. Every function returns 0 or the
 * cudaError_t of its launch / call.
 *
 * Under the test stand-in of libcudart (tests/cudasim), which cannot run
 * device code, kernels_emu.c registers a CPU emulation of each kernel (the
 * same bodies, kernels_body.h) and the stand-in runs it on the stream, in
 * stream order, checking every pointer span against live device
 * allocations; `emulated` then says so. */
#ifndef OFL_DEMO_KERNELS_CUDA_H
#define OFL_DEMO_KERNELS_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KC_API_VERSION 1
#define KC_API_SYMBOL "ofl_demo_kernels_cuda_api"

typedef struct kc_api {
  int version;  /* KC_API_VERSION */
  int emulated; /* 1: the kernels run as the stand-in's CPU emulation */

  /* c[m,n] (+)= a[m,k] @ b[k,n]; a^T b (tn); a b^T (nt). */
  int (*matmul)(float *c, const float *a, const float *b, int m, int k, int n,
                int acc, void *stream);
  int (*matmul_tn)(float *c, const float *a, const float *b, int m, int k,
                   int n, int acc, void *stream);
  int (*matmul_nt)(float *c, const float *a, const float *b, int m, int k,
                   int n, int acc, void *stream);
  int (*rmsnorm)(float *y, const float *x, const float *g, int rows, int h,
                 void *stream);
  /* scratch: rows floats (the rows' 1/rms). */
  int (*rmsnorm_backward)(float *dx, float *dg, const float *x, const float *g,
                          const float *dy, float *scratch, int rows, int h,
                          void *stream);
  int (*attention)(float *out, float *probs, const float *qkv, int s, int h,
                   void *stream);
  /* scratch: s * s floats (dS). */
  int (*attention_backward)(float *dqkv, const float *dout, const float *qkv,
                            const float *probs, float *scratch, int s, int h,
                            void *stream);
  int (*silu)(float *act, const float *u, size_t n, void *stream);
  int (*silu_backward)(float *du, const float *dact, const float *u, size_t n,
                       void *stream);
  int (*add)(float *y, const float *x, size_t n, void *stream);
  /* w -= lr * dw, then dw = 0. */
  int (*sgd)(float *w, float *dw, size_t n, float lr, void *stream);

  /* The CUDA runtime calls the demo needs. */
  int (*device_count)(int *count);
  int (*set_device)(int device);
  int (*stream_create)(void **stream); /* cudaStreamNonBlocking */
  int (*stream_destroy)(void *stream);
  int (*stream_sync)(void *stream);
  /* Copies on the stream, then waits for the stream (the host buffer may be
   * pageable and is reused at once). */
  int (*h2d)(void *dst, const void *src, size_t bytes, void *stream);
  int (*d2h)(void *dst, const void *src, size_t bytes, void *stream);
  int (*memset0)(void *dst, size_t bytes, void *stream); /* asynchronous */
  int (*mem_info)(size_t *free_bytes, size_t *total_bytes);
  const char *(*error_string)(int error);
} kc_api_t;

/* The table (never NULL; its calls answer the CUDA runtime's errors). */
const kc_api_t *ofl_demo_kernels_cuda_api(void);

#ifdef __cplusplus
}
#endif

#endif
