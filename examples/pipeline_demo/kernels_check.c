/* ofl pipeline demo: checks the GPU kernels (kernels_cuda.h, loaded from
 * the module given as argv[1]) against the CPU arithmetic (kernels.c): each
 * kernel on odd sizes, within a relative tolerance (the order of the sums
 * and exp differ, so the bits do), and bit for bit against itself on a
 * second run (deterministic). On a GPU it checks the kernels; over the test
 * stand-in of the CUDA runtime, their CPU emulation (the same bodies, with
 * every pointer span checked against live allocations). TAP; exits 77
 * without a cuda device. */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

#include "kernels.h"
#include "kernels_cuda.h"

static const kc_api_t *kc;
static ofl_device_t *dev;
static void *stream;
static int failures, checks;

static void ok(int cond, const char *what) {
  checks++;
  if (!cond)
    failures++;
  printf("%s %d - %s\n", cond ? "ok" : "not ok", checks, what);
  fflush(stdout);
}

static float *dmalloc(size_t n) {
  void *p = NULL;
  if (ofl_device_malloc(dev, n * sizeof(float), &p) != OFL_SUCCESS) {
    printf("Bail out! ofl_device_malloc(%zu floats): %s\n", n,
           ofl_last_error());
    exit(1);
  }
  return p;
}

/* Device copy of host floats. */
static float *up(const float *h, size_t n) {
  float *d = dmalloc(n);
  if (kc->h2d(d, h, n * sizeof(float), stream) != 0)
    exit(1);
  return d;
}

static float *down(const float *d, size_t n) {
  float *h = malloc(n * sizeof(float));
  if (h == NULL || kc->d2h(h, d, n * sizeof(float), stream) != 0)
    exit(1);
  return h;
}

static float *rnd(size_t n, unsigned long long seed, float scale) {
  float *h = malloc(n * sizeof(float));
  k_fill(h, n, seed, scale);
  return h;
}

/* Largest |gpu - cpu| / (1 + |cpu|) over n floats, as a check. */
static void close_to(const char *what, const float *dgpu, const float *cpu,
                     size_t n) {
  float *g = down(dgpu, n);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)g[i] - (double)cpu[i]) / (1.0 + fabs(cpu[i]));
    if (!(e <= worst)) { /* NaN counts as worst */
      worst = isnan(e) ? INFINITY : e;
      at = i;
    }
  }
  char msg[256];
  snprintf(msg, sizeof msg,
           "%s matches the CPU within 1e-4 (worst %.2e at %zu: gpu %.7g cpu "
           "%.7g)",
           what, worst, at, (double)g[at], (double)cpu[at]);
  ok(worst <= 1e-4, msg);
  free(g);
}

static void same_bits(const char *what, const float *d1, const float *d2,
                      size_t n) {
  float *a = down(d1, n), *b = down(d2, n);
  char msg[200];
  snprintf(msg, sizeof msg, "%s: two runs give the same bits", what);
  ok(memcmp(a, b, n * sizeof(float)) == 0, msg);
  free(a);
  free(b);
}

#define CALL(x)                                                                \
  do {                                                                         \
    int e_ = (x);                                                              \
    if (e_ != 0) {                                                             \
      printf("Bail out! %s: %s\n", #x, kc->error_string(e_));                  \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

static void check_matmuls(void) {
  const int m = 37, k = 29, n = 23;
  float *a = rnd((size_t)m * k, 1, 1), *b = rnd((size_t)k * n, 2, 1);
  float *at = rnd((size_t)k * m, 3, 1), *bt = rnd((size_t)n * k, 4, 1);
  float *c0 = rnd((size_t)m * n, 5, 1);
  float *da = up(a, (size_t)m * k), *db = up(b, (size_t)k * n);
  float *dat = up(at, (size_t)k * m), *dbt = up(bt, (size_t)n * k);
  float *dc = up(c0, (size_t)m * n), *dc2 = up(c0, (size_t)m * n);
  float *c = malloc((size_t)m * n * sizeof(float));

  memcpy(c, c0, (size_t)m * n * sizeof(float));
  k_matmul(c, a, b, m, k, n, 1);
  CALL(kc->matmul(dc, da, db, m, k, n, 1, stream));
  close_to("matmul (accumulate)", dc, c, (size_t)m * n);
  CALL(kc->matmul(dc2, da, db, m, k, n, 0, stream));
  CALL(kc->matmul(dc, da, db, m, k, n, 0, stream));
  same_bits("matmul", dc, dc2, (size_t)m * n);

  k_matmul_tn(c, at, b, m, k, n, 0);
  CALL(kc->matmul_tn(dc, dat, db, m, k, n, 0, stream));
  close_to("matmul_tn", dc, c, (size_t)m * n);

  k_matmul_nt(c, a, bt, m, k, n, 0);
  CALL(kc->matmul_nt(dc, da, dbt, m, k, n, 0, stream));
  close_to("matmul_nt", dc, c, (size_t)m * n);

  float *ptrs[] = {da, db, dat, dbt, dc, dc2};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
    ofl_device_free(dev, ptrs[i]);
  free(a), free(b), free(at), free(bt), free(c0), free(c);
}

static void check_rmsnorm(void) {
  const int rows = 19, h = 33;
  size_t n = (size_t)rows * h;
  float *x = rnd(n, 10, 2), *g = rnd((size_t)h, 11, 1), *dy = rnd(n, 12, 1);
  float *dx0 = rnd(n, 13, 1), *dg0 = rnd((size_t)h, 14, 1);
  float *dxd = up(x, n), *dgd = up(g, (size_t)h), *ddy = up(dy, n);
  float *ddx = up(dx0, n), *ddg = up(dg0, (size_t)h);
  float *dy_out = dmalloc(n), *scratch = dmalloc((size_t)rows);
  float *y = malloc(n * sizeof(float));
  k_rmsnorm(y, x, g, rows, h);
  CALL(kc->rmsnorm(dy_out, dxd, dgd, rows, h, stream));
  close_to("rmsnorm", dy_out, y, n);
  k_rmsnorm_backward(dx0, dg0, x, g, dy, rows, h);
  CALL(kc->rmsnorm_backward(ddx, ddg, dxd, dgd, ddy, scratch, rows, h,
                            stream));
  close_to("rmsnorm_backward dx (accumulated)", ddx, dx0, n);
  close_to("rmsnorm_backward dg (accumulated)", ddg, dg0, (size_t)h);
  float *ptrs[] = {dxd, dgd, ddy, ddx, ddg, dy_out, scratch};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
    ofl_device_free(dev, ptrs[i]);
  free(x), free(g), free(dy), free(dx0), free(dg0), free(y);
}

static void check_attention(void) {
  const int s = 21, h = 16;
  size_t nq = (size_t)s * 3 * h, no = (size_t)s * h, np = (size_t)s * s;
  float *qkv = rnd(nq, 20, 1), *dout = rnd(no, 21, 1);
  float *out = malloc(no * sizeof(float)), *probs = malloc(np * sizeof(float));
  float *dqkv = malloc(nq * sizeof(float));
  float *dq = up(qkv, nq), *ddout = up(dout, no);
  float *dgo = dmalloc(no), *dgp = dmalloc(np), *dgd = dmalloc(nq);
  float *dgd2 = dmalloc(nq), *scratch = dmalloc(np);
  k_attention(out, probs, qkv, s, h);
  CALL(kc->attention(dgo, dgp, dq, s, h, stream));
  close_to("attention out", dgo, out, no);
  close_to("attention probs", dgp, probs, np);
  /* one output alone (a rerun's): the same bits as with both */
  float *dgo1 = dmalloc(no), *dgp1 = dmalloc(np);
  CALL(kc->attention(dgo1, NULL, dq, s, h, stream));
  CALL(kc->attention(NULL, dgp1, dq, s, h, stream));
  same_bits("attention out without probs", dgo, dgo1, no);
  same_bits("attention probs without out", dgp, dgp1, np);
  float *out1 = malloc(no * sizeof(float)), *probs1 = malloc(np * sizeof(float));
  k_attention(out1, NULL, qkv, s, h);
  k_attention(NULL, probs1, qkv, s, h);
  ok(memcmp(out1, out, no * sizeof(float)) == 0,
     "attention out without probs: the CPU's same bits");
  ok(memcmp(probs1, probs, np * sizeof(float)) == 0,
     "attention probs without out: the CPU's same bits");
  free(out1), free(probs1);
  /* the backward from the CPU's probs, so that it is checked alone */
  float *dprobs = up(probs, np);
  k_attention_backward(dqkv, dout, qkv, probs, s, h);
  CALL(kc->attention_backward(dgd, ddout, dq, dprobs, scratch, s, h, stream));
  close_to("attention_backward dqkv", dgd, dqkv, nq);
  CALL(kc->attention_backward(dgd2, ddout, dq, dprobs, scratch, s, h,
                              stream));
  same_bits("attention_backward", dgd, dgd2, nq);
  float *ptrs[] = {dq, ddout, dgo, dgp, dgd, dgd2, scratch, dprobs, dgo1, dgp1};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
    ofl_device_free(dev, ptrs[i]);
  free(qkv), free(dout), free(out), free(probs), free(dqkv);
}

static void check_elementwise(void) {
  const size_t n = 1000;
  float *u = rnd(n, 30, 4), *d = rnd(n, 31, 1), *y0 = rnd(n, 32, 1);
  float *r = malloc(n * sizeof(float));
  float *du = up(u, n), *dd = up(d, n), *dy = up(y0, n), *dout = dmalloc(n);
  k_silu(r, u, n);
  CALL(kc->silu(dout, du, n, stream));
  close_to("silu", dout, r, n);
  k_silu_backward(r, d, u, n);
  CALL(kc->silu_backward(dout, dd, du, n, stream));
  close_to("silu_backward", dout, r, n);
  memcpy(r, y0, n * sizeof(float));
  k_add(r, d, n);
  CALL(kc->add(dy, dd, n, stream));
  close_to("add", dy, r, n);
  /* sgd: w -= lr dw, dw = 0 */
  float *w = up(y0, n), *dw = up(d, n);
  for (size_t i = 0; i < n; i++)
    r[i] = y0[i] - 0.5f * d[i];
  CALL(kc->sgd(w, dw, n, 0.5f, stream));
  close_to("sgd weights", w, r, n);
  memset(r, 0, n * sizeof(float));
  float *z = down(dw, n);
  ok(memcmp(z, r, n * sizeof(float)) == 0, "sgd zeroes the gradient");
  free(z);
  float *ptrs[] = {du, dd, dy, dout, w, dw};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
    ofl_device_free(dev, ptrs[i]);
  free(u), free(d), free(y0), free(r);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s MODULE.so\n", argv[0]);
    return 2;
  }
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_CUDA;
  if (ofl_device_open(&dp, &dev) != OFL_SUCCESS) {
    printf("1..0 # SKIP no cuda device: %s\n", ofl_last_error());
    return 77;
  }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  void *sym = h ? dlsym(h, KC_API_SYMBOL) : NULL;
  const kc_api_t *(*get)(void) = NULL;
  if (sym != NULL)
    memcpy(&get, &sym, sizeof get);
  kc = get ? get() : NULL;
  if (kc == NULL || kc->version != KC_API_VERSION) {
    printf("Bail out! %s: %s\n", argv[1], h ? "no kernel table" : dlerror());
    return 1;
  }
  printf("# %s\n", kc->emulated ? "the stand-in runs the kernels' CPU "
                                  "emulation"
                                : "the kernels run on the GPU");
  if (kc->set_device(ofl_device_ordinal(dev)) != 0 ||
      kc->stream_create(&stream) != 0) {
    printf("Bail out! no stream\n");
    return 1;
  }
  check_matmuls();
  check_rmsnorm();
  check_attention();
  check_elementwise();
  CALL(kc->stream_sync(stream));
  CALL(kc->stream_destroy(stream));
  ofl_device_close(dev);
  printf("1..%d\n", checks);
  return failures ? 1 : 0;
}
