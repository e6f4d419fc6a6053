/* ofl pipeline demo: CPU emulations of kernels_cuda.cu's kernels for the
 * test stand-in of libcudart (tests/cudasim/cudasim.h, "kernels"). When the
 * loaded runtime is the stand-in, ofl_demo_kernels_emu_register gives it,
 * for each kernel, the sizes of its parameters, the bytes each pointer
 * parameter touches (checked against live device allocations at the launch
 * and again when the kernel runs) and the per-thread body, which is
 * kernels_body.h's, the one the GPU runs. With the real runtime it does
 * nothing: the kernels run on the GPU. */
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#include "cudasim.h"
#include "kernels_body.h"

#define P(type, i) (*(type const *)args[i])
#define PTR(i) (*(float *const *)args[i])
#define CPTR(i) (*(const float *const *)args[i])

static size_t fl(long long n) { return n > 0 ? (size_t)n * sizeof(float) : 0; }

static int span(cudasim_kernel_span_t *o, int *n, int max, int param,
                size_t bytes) {
  if (*n >= max)
    return -1;
  o[*n].param = param;
  o[*n].bytes = bytes;
  (*n)++;
  return 0;
}

/* ofl_demo_k_matmul(c, a, b, m, k, n, sai, sap, sbp, sbj, ldc, acc) */
static int matmul_spans(void *const *args, cudasim_kernel_span_t *o, int max) {
  int m = P(int, 3), k = P(int, 4), n = P(int, 5), cnt = 0;
  long long sai = P(long long, 6), sap = P(long long, 7);
  long long sbp = P(long long, 8), sbj = P(long long, 9);
  long long ldc = P(long long, 10);
  int any = m > 0 && n > 0;
  span(o, &cnt, max, 0, any ? fl((m - 1) * ldc + n) : 0);
  span(o, &cnt, max, 1,
       any && k > 0 ? fl((m - 1) * sai + (long long)(k - 1) * sap + 1) : 0);
  span(o, &cnt, max, 2,
       any && k > 0 ? fl((long long)(k - 1) * sbp + (n - 1) * sbj + 1) : 0);
  return cnt;
}
static void matmul_thread(void *const *args, long long t) {
  kb_matmul(t, PTR(0), CPTR(1), CPTR(2), P(int, 3), P(int, 4), P(int, 5),
            P(long long, 6), P(long long, 7), P(long long, 8),
            P(long long, 9), P(long long, 10), P(int, 11));
}

/* ofl_demo_k_rmsnorm(y, x, g, rows, h) */
static int rmsnorm_spans(void *const *args, cudasim_kernel_span_t *o,
                         int max) {
  long long rows = P(int, 3), h = P(int, 4);
  int cnt = 0;
  span(o, &cnt, max, 0, fl(rows * h));
  span(o, &cnt, max, 1, fl(rows * h));
  span(o, &cnt, max, 2, rows > 0 ? fl(h) : 0);
  return cnt;
}
static void rmsnorm_thread(void *const *args, long long t) {
  kb_rmsnorm_row(t, PTR(0), CPTR(1), CPTR(2), P(int, 3), P(int, 4));
}

/* ofl_demo_k_rmsnorm_bw_rows(dx, inv, x, g, dy, rows, h) */
static int rms_rows_spans(void *const *args, cudasim_kernel_span_t *o,
                          int max) {
  long long rows = P(int, 5), h = P(int, 6);
  int cnt = 0;
  span(o, &cnt, max, 0, fl(rows * h));
  span(o, &cnt, max, 1, fl(rows));
  span(o, &cnt, max, 2, fl(rows * h));
  span(o, &cnt, max, 3, rows > 0 ? fl(h) : 0);
  span(o, &cnt, max, 4, fl(rows * h));
  return cnt;
}
static void rms_rows_thread(void *const *args, long long t) {
  kb_rmsnorm_backward_row(t, PTR(0), PTR(1), CPTR(2), CPTR(3), CPTR(4),
                          P(int, 5), P(int, 6));
}

/* ofl_demo_k_rmsnorm_bw_cols(dg, inv, x, dy, rows, h) */
static int rms_cols_spans(void *const *args, cudasim_kernel_span_t *o,
                          int max) {
  long long rows = P(int, 4), h = P(int, 5);
  int cnt = 0;
  span(o, &cnt, max, 0, fl(h));
  span(o, &cnt, max, 1, h > 0 ? fl(rows) : 0);
  span(o, &cnt, max, 2, fl(rows * h));
  span(o, &cnt, max, 3, fl(rows * h));
  return cnt;
}
static void rms_cols_thread(void *const *args, long long t) {
  kb_rmsnorm_backward_col(t, PTR(0), CPTR(1), CPTR(2), CPTR(3), P(int, 4),
                          P(int, 5));
}

/* ofl_demo_k_attention(out, probs, qkv, s, h) */
static int attn_spans(void *const *args, cudasim_kernel_span_t *o, int max) {
  long long s = P(int, 3), h = P(int, 4);
  int cnt = 0;
  if (PTR(0) != NULL) /* either output may be NULL (kernels.h) */
    span(o, &cnt, max, 0, fl(s * h));
  if (PTR(1) != NULL)
    span(o, &cnt, max, 1, fl(s * s));
  span(o, &cnt, max, 2, fl(3 * s * h));
  return cnt;
}
static void attn_thread(void *const *args, long long t) {
  kb_attention_row(t, PTR(0), PTR(1), CPTR(2), P(int, 3), P(int, 4));
}

/* ofl_demo_k_attention_ds(ds, dout, qkv, probs, s, h) */
static int attn_ds_spans(void *const *args, cudasim_kernel_span_t *o,
                         int max) {
  long long s = P(int, 4), h = P(int, 5);
  int cnt = 0;
  span(o, &cnt, max, 0, fl(s * s));
  span(o, &cnt, max, 1, fl(s * h));
  span(o, &cnt, max, 2, fl(3 * s * h));
  span(o, &cnt, max, 3, fl(s * s));
  return cnt;
}
static void attn_ds_thread(void *const *args, long long t) {
  kb_attention_ds_row(t, PTR(0), CPTR(1), CPTR(2), CPTR(3), P(int, 4),
                      P(int, 5));
}

/* The elementwise kernels: (out, in..., n[, lr]); nptr pointers of n
 * floats each, n at index nptr. */
static int elem_spans(void *const *args, cudasim_kernel_span_t *o, int max,
                      int nptr) {
  size_t n = P(size_t, nptr);
  int cnt = 0;
  for (int i = 0; i < nptr; i++)
    span(o, &cnt, max, i, n * sizeof(float));
  return cnt;
}
static int silu_spans(void *const *a, cudasim_kernel_span_t *o, int max) {
  return elem_spans(a, o, max, 2);
}
static void silu_thread(void *const *args, long long t) {
  kb_silu(t, PTR(0), CPTR(1), P(size_t, 2));
}
static int silu_bw_spans(void *const *a, cudasim_kernel_span_t *o, int max) {
  return elem_spans(a, o, max, 3);
}
static void silu_bw_thread(void *const *args, long long t) {
  kb_silu_backward(t, PTR(0), CPTR(1), CPTR(2), P(size_t, 3));
}
static int add_spans(void *const *a, cudasim_kernel_span_t *o, int max) {
  return elem_spans(a, o, max, 2);
}
static void add_thread(void *const *args, long long t) {
  kb_add(t, PTR(0), CPTR(1), P(size_t, 2));
}
static int sgd_spans(void *const *a, cudasim_kernel_span_t *o, int max) {
  return elem_spans(a, o, max, 2);
}
static void sgd_thread(void *const *args, long long t) {
  kb_sgd(t, PTR(0), PTR(1), P(size_t, 2), P(float, 3));
}

#define PT sizeof(void *)
#define I sizeof(int)
#define LL sizeof(long long)
#define SZ sizeof(size_t)
static const cudasim_kernel_emu_t emus[] = {
    {"ofl_demo_k_matmul", 12, {PT, PT, PT, I, I, I, LL, LL, LL, LL, LL, I},
     matmul_spans, matmul_thread},
    {"ofl_demo_k_rmsnorm", 5, {PT, PT, PT, I, I}, rmsnorm_spans,
     rmsnorm_thread},
    {"ofl_demo_k_rmsnorm_bw_rows", 7, {PT, PT, PT, PT, PT, I, I},
     rms_rows_spans, rms_rows_thread},
    {"ofl_demo_k_rmsnorm_bw_cols", 6, {PT, PT, PT, PT, I, I}, rms_cols_spans,
     rms_cols_thread},
    {"ofl_demo_k_attention", 5, {PT, PT, PT, I, I}, attn_spans, attn_thread},
    {"ofl_demo_k_attention_ds", 6, {PT, PT, PT, PT, I, I}, attn_ds_spans,
     attn_ds_thread},
    {"ofl_demo_k_silu", 3, {PT, PT, SZ}, silu_spans, silu_thread},
    {"ofl_demo_k_silu_bw", 4, {PT, PT, PT, SZ}, silu_bw_spans,
     silu_bw_thread},
    {"ofl_demo_k_add", 3, {PT, PT, SZ}, add_spans, add_thread},
    {"ofl_demo_k_sgd", 4, {PT, PT, SZ, sizeof(float)}, sgd_spans, sgd_thread},
};

int ofl_demo_kernels_emu_register(void);

int ofl_demo_kernels_emu_register(void) {
  /* The runtime this module was linked against, already loaded: the
   * stand-in exports cudasim_register_kernel, the real one does not. */
  void *rt = dlopen("libcudart.so.13", RTLD_LAZY | RTLD_NOLOAD);
  if (rt == NULL)
    return 0;
  int (*reg)(const cudasim_kernel_emu_t *) = NULL;
  void *sym = dlsym(rt, "cudasim_register_kernel");
  if (sym != NULL) /* ISO C has no object-to-function pointer cast */
    memcpy(&reg, &sym, sizeof reg);
  int ok = reg != NULL;
  for (size_t i = 0; ok && i < sizeof emus / sizeof emus[0]; i++)
    ok = reg(&emus[i]) == 0;
  dlclose(rt);
  return ok;
}
