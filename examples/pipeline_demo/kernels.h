/* ofl pipeline demo: the CPU arithmetic of one transformer-like layer.
 * Row-major float matrices; every function is deterministic (fixed loop
 * order), so a run with offload must match a run without bit for bit. */
#ifndef OFL_DEMO_KERNELS_H
#define OFL_DEMO_KERNELS_H

#include <stddef.h>

/* c[m,n] (+)= a[m,k] @ b[k,n]; accumulate when acc != 0. */
void k_matmul(float *c, const float *a, const float *b, int m, int k, int n,
              int acc);
/* c[m,n] (+)= a[k,m]^T @ b[k,n] */
void k_matmul_tn(float *c, const float *a, const float *b, int m, int k, int n,
                 int acc);
/* c[m,n] (+)= a[m,k] @ b[n,k]^T */
void k_matmul_nt(float *c, const float *a, const float *b, int m, int k, int n,
                 int acc);

/* y = x / rms(x) * g per row of x[rows, h]. */
void k_rmsnorm(float *y, const float *x, const float *g, int rows, int h);
/* dx (+)= d/dx, dg += d/dg of k_rmsnorm given dy. */
void k_rmsnorm_backward(float *dx, float *dg, const float *x, const float *g,
                        const float *dy, int rows, int h);

/* Single-head attention from qkv[s, 3h]: probs[s,s] = softmax(q k^T / sqrt h),
 * out[s,h] = probs v. Either output may be NULL: a rerun that needs only
 * one of them allocates nothing for the other, and gets the same bits. */
void k_attention(float *out, float *probs, const float *qkv, int s, int h);
/* dqkv[s,3h] from dout[s,h], the saved qkv and probs. */
void k_attention_backward(float *dqkv, const float *dout, const float *qkv,
                          const float *probs, int s, int h);

/* act = u * sigmoid(u); du = dact * silu'(u). */
void k_silu(float *act, const float *u, size_t n);
void k_silu_backward(float *du, const float *dact, const float *u, size_t n);

void k_add(float *y, const float *x, size_t n); /* y += x */
/* Deterministic pseudo-random fill in [-scale, scale). */
void k_fill(float *x, size_t n, unsigned long long seed, float scale);

#endif
