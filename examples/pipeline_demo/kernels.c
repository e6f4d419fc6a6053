/* ofl pipeline demo: layer arithmetic (see kernels.h). */
#include "kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void k_matmul(float *c, const float *a, const float *b, int m, int k, int n,
              int acc) {
  if (!acc)
    memset(c, 0, sizeof(float) * (size_t)m * (size_t)n);
  for (int i = 0; i < m; i++)
    for (int p = 0; p < k; p++) {
      float av = a[(size_t)i * k + p];
      const float *br = b + (size_t)p * n;
      float *cr = c + (size_t)i * n;
      for (int j = 0; j < n; j++)
        cr[j] += av * br[j];
    }
}

void k_matmul_tn(float *c, const float *a, const float *b, int m, int k, int n,
                 int acc) {
  if (!acc)
    memset(c, 0, sizeof(float) * (size_t)m * (size_t)n);
  for (int p = 0; p < k; p++)
    for (int i = 0; i < m; i++) {
      float av = a[(size_t)p * m + i];
      const float *br = b + (size_t)p * n;
      float *cr = c + (size_t)i * n;
      for (int j = 0; j < n; j++)
        cr[j] += av * br[j];
    }
}

void k_matmul_nt(float *c, const float *a, const float *b, int m, int k, int n,
                 int acc) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      const float *ar = a + (size_t)i * k, *br = b + (size_t)j * k;
      float s = 0;
      for (int p = 0; p < k; p++)
        s += ar[p] * br[p];
      c[(size_t)i * n + j] = acc ? c[(size_t)i * n + j] + s : s;
    }
}

static float inv_rms(const float *x, int h) {
  float ss = 0;
  for (int j = 0; j < h; j++)
    ss += x[j] * x[j];
  return 1.0f / sqrtf(ss / (float)h + 1e-5f);
}

void k_rmsnorm(float *y, const float *x, const float *g, int rows, int h) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * h;
    float inv = inv_rms(xr, h);
    for (int j = 0; j < h; j++)
      y[(size_t)r * h + j] = xr[j] * inv * g[j];
  }
}

void k_rmsnorm_backward(float *dx, float *dg, const float *x, const float *g,
                        const float *dy, int rows, int h) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * h, *dyr = dy + (size_t)r * h;
    float inv = inv_rms(xr, h);
    float dot = 0; /* sum(dy * g * x) */
    for (int j = 0; j < h; j++) {
      dot += dyr[j] * g[j] * xr[j];
      dg[j] += dyr[j] * xr[j] * inv;
    }
    float c = dot * inv * inv * inv / (float)h;
    for (int j = 0; j < h; j++)
      dx[(size_t)r * h + j] += dyr[j] * g[j] * inv - xr[j] * c;
  }
}

void k_attention(float *out, float *probs, const float *qkv, int s, int h) {
  float scale = 1.0f / sqrtf((float)h);
  int w = 3 * h;
  /* Without probs (a rerun that needs only out): one row of them at a time,
   * the same arithmetic. */
  float *row = probs == NULL ? malloc(sizeof(float) * (size_t)s) : NULL;
  if (probs == NULL && row == NULL) {
    fprintf(stderr, "k_attention: out of host memory\n");
    exit(2);
  }
  for (int i = 0; i < s; i++) {
    const float *q = qkv + (size_t)i * w;
    float *pr = probs != NULL ? probs + (size_t)i * s : row;
    float mx = -INFINITY;
    for (int j = 0; j < s; j++) {
      const float *k = qkv + (size_t)j * w + h;
      float d = 0;
      for (int p = 0; p < h; p++)
        d += q[p] * k[p];
      pr[j] = d * scale;
      if (pr[j] > mx)
        mx = pr[j];
    }
    float sum = 0;
    for (int j = 0; j < s; j++) {
      pr[j] = expf(pr[j] - mx);
      sum += pr[j];
    }
    for (int j = 0; j < s; j++)
      pr[j] /= sum;
    if (out == NULL)
      continue;
    float *o = out + (size_t)i * h;
    memset(o, 0, sizeof(float) * (size_t)h);
    for (int j = 0; j < s; j++) {
      const float *v = qkv + (size_t)j * w + 2 * h;
      for (int p = 0; p < h; p++)
        o[p] += pr[j] * v[p];
    }
  }
  free(row);
}

void k_attention_backward(float *dqkv, const float *dout, const float *qkv,
                          const float *probs, int s, int h) {
  float scale = 1.0f / sqrtf((float)h);
  int w = 3 * h;
  memset(dqkv, 0, sizeof(float) * (size_t)s * (size_t)w);
  for (int i = 0; i < s; i++) {
    const float *pr = probs + (size_t)i * s, *dor = dout + (size_t)i * h;
    /* dP[i,j] = dout_i . v_j ; dS = P * (dP - sum_j dP P) */
    float dps[4096];
    float *dp = s <= 4096 ? dps : NULL;
    if (dp == NULL)
      return;
    float rowdot = 0;
    for (int j = 0; j < s; j++) {
      const float *v = qkv + (size_t)j * w + 2 * h;
      float d = 0;
      for (int p = 0; p < h; p++)
        d += dor[p] * v[p];
      dp[j] = d;
      rowdot += d * pr[j];
    }
    const float *q = qkv + (size_t)i * w;
    float *dq = dqkv + (size_t)i * w;
    for (int j = 0; j < s; j++) {
      float ds = pr[j] * (dp[j] - rowdot) * scale;
      const float *k = qkv + (size_t)j * w + h;
      float *dk = dqkv + (size_t)j * w + h;
      float *dv = dqkv + (size_t)j * w + 2 * h;
      for (int p = 0; p < h; p++) {
        dq[p] += ds * k[p];
        dk[p] += ds * q[p];
        dv[p] += pr[j] * dor[p];
      }
    }
  }
}

void k_silu(float *act, const float *u, size_t n) {
  for (size_t i = 0; i < n; i++)
    act[i] = u[i] / (1.0f + expf(-u[i]));
}

void k_silu_backward(float *du, const float *dact, const float *u, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float sg = 1.0f / (1.0f + expf(-u[i]));
    du[i] = dact[i] * (sg + u[i] * sg * (1.0f - sg));
  }
}

void k_add(float *y, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    y[i] += x[i];
}

void k_fill(float *x, size_t n, unsigned long long seed, float scale) {
  unsigned long long s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (size_t i = 0; i < n; i++) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    unsigned long long r = s * 2685821657736338717ull;
    x[i] = ((float)(r >> 40) / (float)(1ull << 24) * 2.0f - 1.0f) * scale;
  }
}
