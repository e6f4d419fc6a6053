/* ofl pipeline demo: the layer arithmetic on the GPU (see kernels_cuda.h).
 * COMPILE-ONLY: never run (the stand-in cannot run kernels) and not called
 * by the demo yet. Deterministic: every output element is computed by one
 * thread in a fixed order; no atomics. */
#include <cuda_runtime.h>

#include "kernels_cuda.h"

namespace {

constexpr int kThreads = 256;

inline unsigned blocks_for(size_t n) {
  return static_cast<unsigned>((n + kThreads - 1) / kThreads);
}

inline cudaStream_t as_stream(void *s) { return static_cast<cudaStream_t>(s); }

inline int launched() { return static_cast<int>(cudaGetLastError()); }

/* C[m,n] (+)= sum_p A(i,p) B(p,j), where A(i,p) = a[i*sai + p*sap] and
 * B(p,j) = b[p*sbp + j*sbj]: the three products of kernels.h by strides.
 * One thread per element of C, p ascending. */
__global__ void matmul_strided(float *c, const float *a, const float *b,
                               int m, int k, int n, long long sai,
                               long long sap, long long sbp, long long sbj,
                               long long ldc, int acc) {
  long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long long>(m) * n)
    return;
  int i = static_cast<int>(idx / n), j = static_cast<int>(idx % n);
  float s = 0.0f;
  for (int p = 0; p < k; p++)
    s = fmaf(a[i * sai + p * sap], b[p * sbp + j * sbj], s);
  float *cp = c + i * ldc + j;
  *cp = acc ? *cp + s : s;
}

int launch_matmul(float *c, const float *a, const float *b, int m, int k,
                  int n, long long sai, long long sap, long long sbp,
                  long long sbj, long long ldc, int acc, void *stream) {
  size_t total = static_cast<size_t>(m) * static_cast<size_t>(n);
  if (total == 0)
    return 0;
  matmul_strided<<<blocks_for(total), kThreads, 0, as_stream(stream)>>>(
      c, a, b, m, k, n, sai, sap, sbp, sbj, ldc, acc);
  return launched();
}

__device__ float row_inv_rms(const float *x, int h) {
  float ss = 0.0f;
  for (int j = 0; j < h; j++)
    ss = fmaf(x[j], x[j], ss);
  return 1.0f / sqrtf(ss / static_cast<float>(h) + 1e-5f);
}

__global__ void rmsnorm_rows(float *y, const float *x, const float *g,
                             int rows, int h) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const float *xr = x + static_cast<size_t>(r) * h;
  float inv = row_inv_rms(xr, h);
  for (int j = 0; j < h; j++)
    y[static_cast<size_t>(r) * h + j] = xr[j] * inv * g[j];
}

/* dx per row (one thread a row); the rows' 1/rms go to inv for dg. */
__global__ void rmsnorm_backward_rows(float *dx, float *inv_out,
                                      const float *x, const float *g,
                                      const float *dy, int rows, int h) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const float *xr = x + static_cast<size_t>(r) * h;
  const float *dyr = dy + static_cast<size_t>(r) * h;
  float inv = row_inv_rms(xr, h);
  inv_out[r] = inv;
  float dot = 0.0f;
  for (int j = 0; j < h; j++)
    dot += dyr[j] * g[j] * xr[j];
  float c = dot * inv * inv * inv / static_cast<float>(h);
  for (int j = 0; j < h; j++)
    dx[static_cast<size_t>(r) * h + j] += dyr[j] * g[j] * inv - xr[j] * c;
}

/* dg per column (one thread a column), rows ascending. */
__global__ void rmsnorm_backward_cols(float *dg, const float *inv,
                                      const float *x, const float *dy,
                                      int rows, int h) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= h)
    return;
  float s = 0.0f;
  for (int r = 0; r < rows; r++)
    s += dy[static_cast<size_t>(r) * h + j] * x[static_cast<size_t>(r) * h + j] *
         inv[r];
  dg[j] += s;
}

/* One thread a query row: scores, softmax, then out = probs v. */
__global__ void attention_rows(float *out, float *probs, const float *qkv,
                               int s, int h) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s)
    return;
  int w = 3 * h;
  float scale = 1.0f / sqrtf(static_cast<float>(h));
  const float *q = qkv + static_cast<size_t>(i) * w;
  float *pr = probs + static_cast<size_t>(i) * s;
  float mx = -INFINITY;
  for (int j = 0; j < s; j++) {
    const float *kr = qkv + static_cast<size_t>(j) * w + h;
    float d = 0.0f;
    for (int p = 0; p < h; p++)
      d = fmaf(q[p], kr[p], d);
    pr[j] = d * scale;
    mx = fmaxf(mx, pr[j]);
  }
  float sum = 0.0f;
  for (int j = 0; j < s; j++) {
    pr[j] = expf(pr[j] - mx);
    sum += pr[j];
  }
  for (int j = 0; j < s; j++)
    pr[j] /= sum;
  float *o = out + static_cast<size_t>(i) * h;
  for (int p = 0; p < h; p++) {
    float acc = 0.0f;
    for (int j = 0; j < s; j++)
      acc = fmaf(pr[j], qkv[static_cast<size_t>(j) * w + 2 * h + p], acc);
    o[p] = acc;
  }
}

/* dS[i,j] = P[i,j] (dP[i,j] - sum_j dP[i,j] P[i,j]) scale, with dP = dout
 * v^T; one thread a row. */
__global__ void attention_ds_rows(float *ds, const float *dout,
                                  const float *qkv, const float *probs, int s,
                                  int h) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= s)
    return;
  int w = 3 * h;
  float scale = 1.0f / sqrtf(static_cast<float>(h));
  const float *dor = dout + static_cast<size_t>(i) * h;
  const float *pr = probs + static_cast<size_t>(i) * s;
  float *dsr = ds + static_cast<size_t>(i) * s;
  float rowdot = 0.0f;
  for (int j = 0; j < s; j++) {
    const float *v = qkv + static_cast<size_t>(j) * w + 2 * h;
    float d = 0.0f;
    for (int p = 0; p < h; p++)
      d = fmaf(dor[p], v[p], d);
    dsr[j] = d; /* dP for now */
    rowdot = fmaf(d, pr[j], rowdot);
  }
  for (int j = 0; j < s; j++)
    dsr[j] = pr[j] * (dsr[j] - rowdot) * scale;
}

__global__ void silu_fw(float *act, const float *u, size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n)
    act[i] = u[i] / (1.0f + expf(-u[i]));
}

__global__ void silu_bw(float *du, const float *dact, const float *u,
                        size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    float sg = 1.0f / (1.0f + expf(-u[i]));
    du[i] = dact[i] * (sg + u[i] * sg * (1.0f - sg));
  }
}

__global__ void add_inplace(float *y, const float *x, size_t n) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n)
    y[i] += x[i];
}

__global__ void sgd_step(float *w, float *dw, size_t n, float lr) {
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    w[i] -= lr * dw[i];
    dw[i] = 0.0f;
  }
}

} // namespace

extern "C" {

int kc_matmul(float *c, const float *a, const float *b, int m, int k, int n,
              int acc, void *stream) {
  /* a[m,k] @ b[k,n] */
  return launch_matmul(c, a, b, m, k, n, k, 1, n, 1, n, acc, stream);
}

int kc_matmul_tn(float *c, const float *a, const float *b, int m, int k,
                 int n, int acc, void *stream) {
  /* a[k,m]^T @ b[k,n] */
  return launch_matmul(c, a, b, m, k, n, 1, m, n, 1, n, acc, stream);
}

int kc_matmul_nt(float *c, const float *a, const float *b, int m, int k,
                 int n, int acc, void *stream) {
  /* a[m,k] @ b[n,k]^T */
  return launch_matmul(c, a, b, m, k, n, k, 1, 1, k, n, acc, stream);
}

int kc_rmsnorm(float *y, const float *x, const float *g, int rows, int h,
               void *stream) {
  if (rows <= 0)
    return 0;
  rmsnorm_rows<<<blocks_for(static_cast<size_t>(rows)), kThreads, 0,
                 as_stream(stream)>>>(y, x, g, rows, h);
  return launched();
}

int kc_rmsnorm_backward(float *dx, float *dg, const float *x, const float *g,
                        const float *dy, float *scratch, int rows, int h,
                        void *stream) {
  if (rows <= 0 || h <= 0)
    return 0;
  rmsnorm_backward_rows<<<blocks_for(static_cast<size_t>(rows)), kThreads, 0,
                          as_stream(stream)>>>(dx, scratch, x, g, dy, rows, h);
  int e = launched();
  if (e != 0)
    return e;
  rmsnorm_backward_cols<<<blocks_for(static_cast<size_t>(h)), kThreads, 0,
                          as_stream(stream)>>>(dg, scratch, x, dy, rows, h);
  return launched();
}

int kc_attention(float *out, float *probs, const float *qkv, int s, int h,
                 void *stream) {
  if (s <= 0)
    return 0;
  attention_rows<<<blocks_for(static_cast<size_t>(s)), kThreads, 0,
                   as_stream(stream)>>>(out, probs, qkv, s, h);
  return launched();
}

int kc_attention_backward(float *dqkv, const float *dout, const float *qkv,
                          const float *probs, float *scratch, int s, int h,
                          void *stream) {
  if (s <= 0)
    return 0;
  long long w = 3LL * h;
  float *ds = scratch; /* s x s */
  attention_ds_rows<<<blocks_for(static_cast<size_t>(s)), kThreads, 0,
                      as_stream(stream)>>>(ds, dout, qkv, probs, s, h);
  int e = launched();
  /* dq = dS k: A = dS [s,s], B(p,j) = k[p, j] (row stride w) */
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
  silu_fw<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(act, u, n);
  return launched();
}

int kc_silu_backward(float *du, const float *dact, const float *u, size_t n,
                     void *stream) {
  if (n == 0)
    return 0;
  silu_bw<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(du, dact, u, n);
  return launched();
}

int kc_add(float *y, const float *x, size_t n, void *stream) {
  if (n == 0)
    return 0;
  add_inplace<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(y, x, n);
  return launched();
}

int kc_sgd(float *w, float *dw, size_t n, float lr, void *stream) {
  if (n == 0)
    return 0;
  sgd_step<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(w, dw, n, lr);
  return launched();
}

} // extern "C"
