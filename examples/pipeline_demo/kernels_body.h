/* ofl pipeline demo: the per-thread bodies of the GPU kernels, shared by
 * kernels_cuda.cu (nvcc: device functions called by the __global__ kernels)
 * and kernels_emu.c (C: the CPU emulation the test stand-in of libcudart
 * runs in stream order when the demo launches those kernels there). One
 * source, so that what the stand-in checks is the arithmetic the GPU runs.
 *
 * Each body computes what one GPU thread computes: thread `t` of a launch
 * with at least `count` threads (bodies return for t >= count). Every
 * reduction runs in a fixed order inside one thread: no atomics, no sums
 * split across threads, so a run is deterministic on a given device (the
 * CPU path's bits differ: other order, other exp). Row-major floats; the
 * functions of kernels.h by name. Valid C11 and CUDA C++. */
#ifndef OFL_DEMO_KERNELS_BODY_H
#define OFL_DEMO_KERNELS_BODY_H

#ifdef __CUDACC__
#define KB_FN static __device__ __forceinline__
#else
#include <math.h>
#include <stddef.h>
#define KB_FN static inline
#endif

/* C[m,n] (+)= sum_p A(i,p) B(p,j), with A(i,p) = a[i*sai + p*sap] and
 * B(p,j) = b[p*sbp + j*sbj], C(i,j) = c[i*ldc + j]: the three products of
 * kernels.h (and the attention backward's) by strides. One thread per
 * element of C, p ascending. */
KB_FN void kb_matmul(long long t, float *c, const float *a, const float *b,
                     int m, int k, int n, long long sai, long long sap,
                     long long sbp, long long sbj, long long ldc, int acc) {
  if (t >= (long long)m * n)
    return;
  long long i = t / n, j = t % n;
  float s = 0.0f;
  for (int p = 0; p < k; p++)
    s = fmaf(a[i * sai + p * sap], b[p * sbp + j * sbj], s);
  float *cp = c + i * ldc + j;
  *cp = acc ? *cp + s : s;
}

KB_FN float kb_row_inv_rms(const float *x, int h) {
  float ss = 0.0f;
  for (int j = 0; j < h; j++)
    ss = fmaf(x[j], x[j], ss);
  return 1.0f / sqrtf(ss / (float)h + 1e-5f);
}

/* y = x / rms(x) * g; one thread a row. */
KB_FN void kb_rmsnorm_row(long long r, float *y, const float *x,
                          const float *g, int rows, int h) {
  if (r >= rows)
    return;
  const float *xr = x + r * h;
  float inv = kb_row_inv_rms(xr, h);
  for (int j = 0; j < h; j++)
    y[r * h + j] = xr[j] * inv * g[j];
}

/* dx += d/dx per row (one thread a row); the row's 1/rms goes to inv[r]
 * for kb_rmsnorm_backward_col. */
KB_FN void kb_rmsnorm_backward_row(long long r, float *dx, float *inv_out,
                                   const float *x, const float *g,
                                   const float *dy, int rows, int h) {
  if (r >= rows)
    return;
  const float *xr = x + r * h;
  const float *dyr = dy + r * h;
  float inv = kb_row_inv_rms(xr, h);
  inv_out[r] = inv;
  float dot = 0.0f;
  for (int j = 0; j < h; j++)
    dot = fmaf(dyr[j] * g[j], xr[j], dot);
  float c = dot * inv * inv * inv / (float)h;
  for (int j = 0; j < h; j++)
    dx[r * h + j] += dyr[j] * g[j] * inv - xr[j] * c;
}

/* dg += d/dg per column (one thread a column), rows ascending. */
KB_FN void kb_rmsnorm_backward_col(long long j, float *dg, const float *inv,
                                   const float *x, const float *dy, int rows,
                                   int h) {
  if (j >= h)
    return;
  float s = 0.0f;
  for (int r = 0; r < rows; r++)
    s = fmaf(dy[(long long)r * h + j] * x[(long long)r * h + j], inv[r], s);
  dg[j] += s;
}

/* Query i's scaled score against key j. */
KB_FN float kb_attention_score(const float *qkv, long long i, int j, int h) {
  long long w = 3LL * h;
  const float *q = qkv + i * w, *kr = qkv + j * w + h;
  float d = 0.0f;
  for (int p = 0; p < h; p++)
    d = fmaf(q[p], kr[p], d);
  return d * (1.0f / sqrtf((float)h));
}

/* Single-head attention from qkv[s,3h], one thread a query row: scores,
 * softmax into probs[i,:], then out[i,:] = probs[i,:] v. Either output may
 * be NULL (a rerun that needs only the other): without probs the row's
 * scores are computed again in each pass, the same operations in the same
 * order, so out is bitwise the same as with them. */
KB_FN void kb_attention_row(long long i, float *out, float *probs,
                            const float *qkv, int s, int h) {
  if (i >= s)
    return;
  long long w = 3LL * h;
  float *pr = probs != NULL ? probs + i * s : NULL;
  float mx = -INFINITY;
  for (int j = 0; j < s; j++) {
    float sc = kb_attention_score(qkv, i, j, h);
    if (pr != NULL)
      pr[j] = sc;
    mx = fmaxf(mx, sc);
  }
  float sum = 0.0f;
  for (int j = 0; j < s; j++) {
    float e = expf((pr != NULL ? pr[j] : kb_attention_score(qkv, i, j, h)) - mx);
    if (pr != NULL)
      pr[j] = e;
    sum += e;
  }
  if (pr != NULL)
    for (int j = 0; j < s; j++)
      pr[j] /= sum;
  if (out == NULL)
    return;
  float *o = out + i * h;
  if (pr != NULL) {
    for (int p = 0; p < h; p++) {
      float acc = 0.0f;
      for (int j = 0; j < s; j++)
        acc = fmaf(pr[j], qkv[j * w + 2 * h + p], acc);
      o[p] = acc;
    }
    return;
  }
  /* Each probability once, o[p] gathering over j in ascending order as
   * above. */
  for (int p = 0; p < h; p++)
    o[p] = 0.0f;
  for (int j = 0; j < s; j++) {
    float pj = expf(kb_attention_score(qkv, i, j, h) - mx) / sum;
    const float *v = qkv + j * w + 2 * h;
    for (int p = 0; p < h; p++)
      o[p] = fmaf(pj, v[p], o[p]);
  }
}

/* dS[i,j] = P[i,j] (dP[i,j] - sum_j dP[i,j] P[i,j]) scale with dP = dout
 * v^T; one thread a row. */
KB_FN void kb_attention_ds_row(long long i, float *ds, const float *dout,
                               const float *qkv, const float *probs, int s,
                               int h) {
  if (i >= s)
    return;
  long long w = 3LL * h;
  float scale = 1.0f / sqrtf((float)h);
  const float *dor = dout + i * h;
  const float *pr = probs + i * s;
  float *dsr = ds + i * s;
  float rowdot = 0.0f;
  for (int j = 0; j < s; j++) {
    const float *v = qkv + j * w + 2 * h;
    float d = 0.0f;
    for (int p = 0; p < h; p++)
      d = fmaf(dor[p], v[p], d);
    dsr[j] = d; /* dP for now */
    rowdot = fmaf(d, pr[j], rowdot);
  }
  for (int j = 0; j < s; j++)
    dsr[j] = pr[j] * (dsr[j] - rowdot) * scale;
}

KB_FN void kb_silu(long long i, float *act, const float *u, size_t n) {
  if (i < (long long)n)
    act[i] = u[i] / (1.0f + expf(-u[i]));
}

KB_FN void kb_silu_backward(long long i, float *du, const float *dact,
                            const float *u, size_t n) {
  if (i < (long long)n) {
    float sg = 1.0f / (1.0f + expf(-u[i]));
    du[i] = dact[i] * (sg + u[i] * sg * (1.0f - sg));
  }
}

KB_FN void kb_add(long long i, float *y, const float *x, size_t n) {
  if (i < (long long)n)
    y[i] += x[i];
}

/* w -= lr dw, then dw = 0. */
KB_FN void kb_sgd(long long i, float *w, float *dw, size_t n, float lr) {
  if (i < (long long)n) {
    w[i] = fmaf(-lr, dw[i], w[i]);
    dw[i] = 0.0f;
  }
}

#endif
