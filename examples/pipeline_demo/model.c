/* ofl pipeline demo: the model and its arithmetic. A layer is the seven
 * named groups of a transformer layer (RMSNorm, QKV projection, softmax
 * attention, output projection, RMSNorm, MLP with SiLU), each one's saved
 * tensors handed to ofl between the group's start and commit, forward and
 * backward; the arithmetic runs on the CPU (kernels.c) or as GPU kernels
 * (kernels_cuda.h). */
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"
#include "kernels.h"

/* ---- where the arithmetic runs ---------------------------------------------
 * On the host backend the layer arithmetic is kernels.c's, on the CPU, on
 * the memory of ofl's host "device". On a cuda device it is kernels_cuda.h's
 * GPU kernels (a module dlopened by choose_backend: g_kc), launched on the
 * demo's own non-blocking stream, which ofl is given as the compute stream
 * (ofl_stream_wrap_native + ofl_device_set_compute_stream), as a training
 * program's stream would be. The x_* functions below run one or the other;
 * what the host reads or writes of device memory (inputs, messages, the
 * loss, the compared state) crosses through the run's host buffers, on the
 * compute stream, synchronously. */
const kc_api_t *g_kc;
void *g_kc_module;
ofl_stream_t *g_ocs; /* the running run's compute stream (cuda) */

/* Host buffer i (0 or 1) of at least n floats. */
static float *hbuf(run_t *r, int i, size_t n) {
  if (r->hcap[i] < n) {
    free(r->hbuf[i]);
    r->hbuf[i] = malloc(n * sizeof(float));
    if (r->hbuf[i] == NULL)
      die(r, "out of host memory (%zu bytes)", n * sizeof(float));
    r->hcap[i] = n;
  }
  return r->hbuf[i];
}

/* The n floats at device address src, readable by the host (src itself on
 * the host backend; host buffer `i` after a copy on the cuda path). */
const float *dev_read(run_t *r, const float *src, size_t n, int i) {
  if (g_kc == NULL)
    return src;
  float *h = hbuf(r, i, n);
  KC(r, g_kc->d2h(h, src, n * sizeof(float), r->cs));
  return h;
}

/* Where the host writes n floats bound for dst: dst itself on the host
 * backend, else host buffer `i`, which dev_commit then copies to dst. */
float *dev_stage(run_t *r, float *dst, size_t n, int i) {
  return g_kc == NULL ? dst : hbuf(r, i, n);
}

void dev_commit(run_t *r, float *dst, const float *staged, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->h2d(dst, staged, n * sizeof(float), r->cs));
}

void x_fill(run_t *r, float *dst, size_t n, unsigned long long seed,
            float scale) {
  float *h = dev_stage(r, dst, n, 0);
  k_fill(h, n, seed, scale);
  dev_commit(r, dst, h, n);
}

static void x_matmul(run_t *r, float *c, const float *a, const float *b, int m,
                     int k, int n, int acc) {
  if (g_kc != NULL)
    KC(r, g_kc->matmul(c, a, b, m, k, n, acc, r->cs));
  else
    k_matmul(c, a, b, m, k, n, acc);
}

static void x_matmul_tn(run_t *r, float *c, const float *a, const float *b,
                        int m, int k, int n, int acc) {
  if (g_kc != NULL)
    KC(r, g_kc->matmul_tn(c, a, b, m, k, n, acc, r->cs));
  else
    k_matmul_tn(c, a, b, m, k, n, acc);
}

static void x_matmul_nt(run_t *r, float *c, const float *a, const float *b,
                        int m, int k, int n, int acc) {
  if (g_kc != NULL)
    KC(r, g_kc->matmul_nt(c, a, b, m, k, n, acc, r->cs));
  else
    k_matmul_nt(c, a, b, m, k, n, acc);
}

static void x_rmsnorm(run_t *r, float *y, const float *x, const float *g,
                      int rows, int h) {
  if (g_kc != NULL)
    KC(r, g_kc->rmsnorm(y, x, g, rows, h, r->cs));
  else
    k_rmsnorm(y, x, g, rows, h);
}

static void x_attention(run_t *r, float *out, float *probs, const float *qkv,
                        int s, int h) {
  if (g_kc != NULL)
    KC(r, g_kc->attention(out, probs, qkv, s, h, r->cs));
  else
    k_attention(out, probs, qkv, s, h);
}

static void x_silu(run_t *r, float *act, const float *u, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->silu(act, u, n, r->cs));
  else
    k_silu(act, u, n);
}

static void x_silu_backward(run_t *r, float *du, const float *dact,
                            const float *u, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->silu_backward(du, dact, u, n, r->cs));
  else
    k_silu_backward(du, dact, u, n);
}

static void x_add(run_t *r, float *y, const float *x, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->add(y, x, n, r->cs));
  else
    k_add(y, x, n);
}

/* The tensor handles the demo's code holds (not the manager's): after an
 * out-of-memory in the middle of a step (--preset oom's baseline) they are
 * destroyed before the run's manager, pool and device. */
ofl_tensor_t **g_live;
size_t g_nlive;
static size_t g_caplive;

/* Per handle of g_live: 1 when it is a saved activation the manager handed
 * back (load), 0 for the demo's own tensors (inputs, outputs, gradients,
 * scratch): what the activation peak leaves out. */
static unsigned char *g_live_act;

static ofl_tensor_t *live_add_as(ofl_tensor_t *t, int activation) {
  if (g_nlive == g_caplive) {
    g_caplive = g_caplive ? 2 * g_caplive : 256;
    ofl_tensor_t **n = realloc(g_live, g_caplive * sizeof *g_live);
    unsigned char *a = realloc(g_live_act, g_caplive);
    if (n != NULL)
      g_live = n;
    if (a != NULL)
      g_live_act = a;
    if (n == NULL || a == NULL) {
      fprintf(stderr, DEMO_NAME ": out of host memory\n");
      exit(2);
    }
  }
  g_live_act[g_nlive] = (unsigned char)activation;
  g_live[g_nlive++] = t;
  return t;
}

static ofl_tensor_t *live_add(ofl_tensor_t *t) { return live_add_as(t, 0); }

static void live_remove(ofl_tensor_t *t) {
  for (size_t i = g_nlive; i-- > 0;)
    if (g_live[i] == t) {
      g_nlive--;
      g_live[i] = g_live[g_nlive];
      g_live_act[i] = g_live_act[g_nlive];
      return;
    }
}

/* Device bytes of the demo's own tensors that are not saved activations,
 * each storage once (an alias handed to the manager shares its storage
 * with the demo's handle, which is then counted here: the figure errs
 * towards fewer activation bytes). */
static size_t own_bytes(void) {
  size_t b = 0;
  for (size_t i = 0; i < g_nlive; i++) {
    const void *id = ofl_tensor_storage_id(g_live[i]);
    if (g_live_act[i] || id == NULL ||
        ofl_tensor_location(g_live[i]) != OFL_LOC_DEVICE)
      continue;
    int seen = 0;
    for (size_t k = 0; k < i && !seen; k++)
      seen = !g_live_act[k] && ofl_tensor_storage_id(g_live[k]) == id;
    if (!seen)
      b += ofl_tensor_storage_bytes(g_live[i]);
  }
  return b;
}

/* Where an allocation that runs out of device memory jumps to when the run
 * expects it (--preset oom's baseline); NULL: it is an error. */

jmp_buf *g_oom_jump;
char g_oom_msg[512];

ofl_tensor_t *act(run_t *r, int rows, int cols) {
  int64_t shape[2] = {rows, cols};
  ofl_tensor_t *t = NULL;
  /* cuda: a block whose last use is still queued is handed out at once,
   * the compute stream made to wait for that use (ofl_pool_alloc). */
  int st = ofl_pool_alloc(r->pool, shape, 2, OFL_DTYPE_F32,
                          g_kc != NULL ? r->ocs : NULL, &t);
  if (st == OFL_ERR_NO_MEMORY && g_oom_jump != NULL) {
    snprintf(g_oom_msg, sizeof g_oom_msg, "%s: %s", ofl_status_str(st),
             ofl_last_error());
    longjmp(*g_oom_jump, 1);
  }
  OK(r, st);
  return live_add(t);
}

static ofl_tensor_t *alias(run_t *r, ofl_tensor_t *t) {
  ofl_tensor_t *a = NULL;
  OK(r, ofl_tensor_alias(t, &a));
  return live_add(a);
}

/* Ends a handle of the demo's. On the cuda path the storage is let go
 * after the work queued on the compute stream (its last use: the kernels
 * that read it may not have run yet), so the pool cannot hand the block to
 * another stream's work before they did. ofl's own reloads into this pool
 * are safe without it (the H2D stream waits for the compute stream before
 * each reload, docs/DESIGN.md section 5), so no test can see it missing;
 * it is what any other user of the pool on another stream relies on. */
void drop(ofl_tensor_t *t) {
  live_remove(t);
  if (g_kc != NULL && g_ocs != NULL && ofl_tensor_data(t) != NULL)
    (void)ofl_tensor_release_storage_after(t, g_ocs);
  ofl_tensor_destroy(t);
}

/* A handle of the demo's that is from here on a saved activation (held for
 * a backward: kept inputs, recomputed tensors), counted as one. The
 * activation bytes rise here, so memory is sampled: a backward that reruns
 * a tensor drops it before the backward ends (moe_act's u), and the samples
 * at group and backward ends alone missed that peak (1.031 MiB reported
 * for a recompute whose ledger, right, said 1.094). */
static ofl_tensor_t *as_activation(run_t *r, ofl_tensor_t *t) {
  live_remove(t);
  live_add_as(t, 1);
  sample_memory(r);
  return t;
}

/* Hands t, saved under *tag (a field of sv), to the manager: from here on
 * it is the manager's handle. In full recompute's rerun it is held in
 * sv->loc instead. */
static void save(run_t *r, saved_t *sv, ofl_tensor_t *t, uint64_t *tag) {
  if (r->rerun) {
    sv->loc[tag - &sv->x] = as_activation(r, t);
    *tag = 0;
    return;
  }
  live_remove(t);
  OK(r, glue_save(r->glue, t, tag));
}

/* A tensor saved under *tag, or dropped where its group is recomputed
 * (rc: its backward reruns it). */
static void save_unless(run_t *r, saved_t *sv, int rc, ofl_tensor_t *t,
                        uint64_t *tag) {
  if (rc)
    drop(t);
  else
    save(r, sv, t, tag);
}

void sample_memory(run_t *r) {
  if (r->nmem == r->capmem) {
    r->capmem = r->capmem ? r->capmem * 2 : 1024;
    r->mem_t = realloc(r->mem_t, r->capmem * sizeof *r->mem_t);
    r->mem_b = realloc(r->mem_b, r->capmem * sizeof *r->mem_b);
  }
  /* Device memory allocated (as torch's memory_allocated): weights plus the
   * activation pool's blocks in use; free pool blocks are cache, not use. */
  ofl_pool_stats_t st;
  ofl_pool_get_stats(r->pool, &st);
  r->mem_t[r->nmem] = now_s() - r->t0;
  r->mem_b[r->nmem] = (double)(r->weight_bytes + st.in_use_bytes);
  r->nmem++;
  /* The activation bytes on the device, as far as the demo can tell: the
   * pool's blocks in use (saved tensors, reload buffers) less its own
   * tensors; steady state only, as the plan's measured peak. */
  size_t own = own_bytes();
  size_t act_now = st.in_use_bytes > own ? st.in_use_bytes - own : 0;
  if ((r->iter >= 1 || r->o->iters == 1) && act_now > r->act_peak)
    r->act_peak = act_now;
  /* The GPU's own figure: everything allocated on it (this process's pools
   * and weights, ofl's buffers, the runtime's, other processes'). Asked
   * only when the pool's memory changed since the last sample (it moves
   * with allocations, and the pool is what allocates during a step), so
   * that the step does not pay a driver call per group. */
  size_t fr = 0, tot = 0;
  if (g_kc != NULL && st.total_bytes != r->pool_total_seen &&
      g_kc->mem_info(&fr, &tot) == 0) {
    r->pool_total_seen = st.total_bytes;
    if (tot - fr > r->gpu_used_peak)
      r->gpu_used_peak = tot - fr;
  }
}

void init_layers(run_t *r, int nlayers) {
  dims_t d = r->d;
  for (int i = 0; i < nlayers; i++) {
    layer_t *L = &r->layers[i];
    size_t n[NW] = {(size_t)d.h, (size_t)d.h * 3 * d.h, (size_t)d.h * d.h,
                    (size_t)d.h, (size_t)d.h * d.f,     (size_t)d.f * d.h};
    for (int k = 0; k < NW; k++) {
      L->n[k] = n[k];
      OK(r, ofl_device_malloc(r->dev, n[k] * sizeof(float), (void **)&L->w[k]));
      OK(r,
         ofl_device_malloc(r->dev, n[k] * sizeof(float), (void **)&L->dw[k]));
      r->weight_bytes += 2 * n[k] * sizeof(float);
      unsigned long long seed = ((unsigned long long)r->rank << 32) ^
                                ((unsigned long long)i << 8) ^ (unsigned)k;
      if (k == W_G1 || k == W_G2) {
        float *h = dev_stage(r, L->w[k], n[k], 0);
        for (size_t j = 0; j < n[k]; j++)
          h[j] = 1.0f;
        dev_commit(r, L->w[k], h, n[k]);
      } else {
        x_fill(r, L->w[k], n[k], seed, 1.0f / sqrtf((float)d.h));
      }
      if (g_kc != NULL)
        KC(r, g_kc->memset0(L->dw[k], n[k] * sizeof(float), r->cs));
      else
        memset(L->dw[k], 0, n[k] * sizeof(float));
    }
  }
}

static void x_rmsnorm_backward(run_t *r, float *dx, float *dg, const float *x,
                               const float *g, const float *dy, int rows,
                               int h) {
  if (g_kc == NULL) {
    k_rmsnorm_backward(dx, dg, x, g, dy, rows, h);
    return;
  }
  ofl_tensor_t *scratch = act(r, rows, 1); /* the rows' 1/rms */
  KC(r, g_kc->rmsnorm_backward(dx, dg, x, g, dy, F(scratch), rows, h, r->cs));
  drop(scratch);
}

static void x_attention_backward(run_t *r, float *dqkv, const float *dout,
                                 const float *qkv, const float *probs, int s,
                                 int h) {
  if (g_kc == NULL) {
    k_attention_backward(dqkv, dout, qkv, probs, s, h);
    return;
  }
  ofl_tensor_t *scratch = act(r, s, s); /* dS */
  KC(r,
     g_kc->attention_backward(dqkv, dout, qkv, probs, F(scratch), s, h, r->cs));
  drop(scratch);
}

enum {
  G_ATTN_NORM,
  G_QKV,
  G_CORE_ATTN,
  G_ATTN_PROJ,
  G_MLP_NORM,
  G_FC1,
  G_ACT,
  G_COUNT
};

/* Starts group gi of the forward; 1 when this iteration recomputes it (the
 * caller then pushes nothing and keeps what its backward reruns from):
 * --recompute-modules in the offload run, else the plan's choice with
 * --recompute (kept: the device bytes of the input the group keeps itself;
 * input: the group whose tensor the rerun starts from, or NULL). No group
 * in full recompute's rerun. */
/* What each group's recompute reruns: the group saved its input group's
 * output, which the rerun makes again (qkv_linear: the norm; attn_proj:
 * the attention; expert_fc1: the norm; moe_act: the first product), and
 * core_attn's own forward too (the probabilities); the norms save their
 * own input. The plan's first estimate of a recompute is those forward
 * times. */
static const unsigned demo_reruns[G_COUNT] = {
    [G_ATTN_NORM] = OFL_RERUN_OWN,
    [G_QKV] = OFL_RERUN_INPUT,
    [G_CORE_ATTN] = OFL_RERUN_OWN | OFL_RERUN_INPUT,
    [G_ATTN_PROJ] = OFL_RERUN_INPUT,
    [G_MLP_NORM] = OFL_RERUN_OWN,
    [G_FC1] = OFL_RERUN_INPUT,
    [G_ACT] = OFL_RERUN_INPUT,
};

static int group_begin(run_t *r, saved_t *sv, int gi, size_t kept,
                       const char *input) {
  if (r->rerun)
    return 0;
  const char *name = demo_group_names[gi];
  const opts_t *o = r->o;
  int rc = 0;
  if (r->offload && (o->recompute_full || (o->recompute_fixed >> gi & 1u))) {
    OK(r, glue_group_start(r->glue, name));
    rc = 1;
  } else if (o->recompute) {
    OK(r, glue_group_start_recomputable(r->glue, name, kept, input,
                                        demo_reruns[gi], &rc));
  } else {
    OK(r, glue_group_start(r->glue, name));
  }
  if (rc) {
    sv->rc |= 1u << gi;
    r->recomputed++;
  }
  return rc;
}

static void group_end(run_t *r, int gi) {
  if (!r->rerun)
    OK(r, glue_group_commit(r->glue, demo_group_names[gi]));
  sample_memory(r);
}

/* Forward of one layer; x is consumed (the caller's handle ends here). */
ofl_tensor_t *layer_forward(run_t *r, layer_t *L, saved_t *sv,
                            ofl_tensor_t *x) {
  dims_t d = r->d;
  size_t sh = (size_t)d.s * d.h, act_b = sh * sizeof(float);
  int full = r->offload && r->o->recompute_full && !r->rerun;
  if (!r->rerun)
    sv->rc = 0;

  if (group_begin(r, sv, G_ATTN_NORM, act_b, NULL))
    sv->hx = as_activation(r, alias(r, x)); /* the layer's input, kept */
  else
    save(r, sv, alias(r, x), &sv->x);
  ofl_tensor_t *y1 = act(r, d.s, d.h);
  x_rmsnorm(r, F(y1), F(x), L->w[W_G1], d.s, d.h);
  group_end(r, G_ATTN_NORM);

  int rc = group_begin(r, sv, G_QKV, 0, "attn_norm");
  ofl_tensor_t *qkv = act(r, d.s, 3 * d.h);
  x_matmul(r, F(qkv), F(y1), L->w[W_QKV], d.s, d.h, 3 * d.h, 0);
  save_unless(r, sv, rc, y1, &sv->y1); /* rerun from attn_norm's input */
  group_end(r, G_QKV);

  rc = group_begin(r, sv, G_CORE_ATTN, 0, "qkv_linear");
  ofl_tensor_t *a = act(r, d.s, d.h);
  ofl_tensor_t *probs = act(r, d.s, d.s);
  x_attention(r, F(a), F(probs), F(qkv), d.s, d.h);
  /* recomputed: qkv and the probabilities rerun from qkv_linear's input */
  save_unless(r, sv, rc, qkv, &sv->qkv);
  save_unless(r, sv, rc, probs, &sv->probs);
  group_end(r, G_CORE_ATTN);

  rc = group_begin(r, sv, G_ATTN_PROJ, 0, "core_attn");
  ofl_tensor_t *x2 = act(r, d.s, d.h);
  x_matmul(r, F(x2), F(a), L->w[W_O], d.s, d.h, d.h, 0);
  x_add(r, F(x2), F(x), sh);
  /* the attention's output, rerun from core_attn's qkv */
  save_unless(r, sv, rc, a, &sv->a);
  group_end(r, G_ATTN_PROJ);
  drop(x);

  rc = group_begin(r, sv, G_MLP_NORM, act_b, NULL);
  if (rc && !full)
    sv->hx2 = as_activation(r, alias(r, x2)); /* the residual, kept */
  else if (!rc)
    save(r, sv, alias(r, x2), &sv->x2);
  ofl_tensor_t *y2 = act(r, d.s, d.h);
  x_rmsnorm(r, F(y2), F(x2), L->w[W_G2], d.s, d.h);
  group_end(r, G_MLP_NORM);

  rc = group_begin(r, sv, G_FC1, 0, "mlp_norm");
  ofl_tensor_t *u = act(r, d.s, d.f);
  x_matmul(r, F(u), F(y2), L->w[W_1], d.s, d.h, d.f, 0);
  save_unless(r, sv, rc, y2, &sv->y2); /* rerun from mlp_norm's residual */
  group_end(r, G_FC1);

  rc = group_begin(r, sv, G_ACT, 0, "expert_fc1");
  ofl_tensor_t *av = act(r, d.s, d.f);
  ofl_tensor_t *out = act(r, d.s, d.h);
  x_silu(r, F(av), F(u), (size_t)d.s * d.f);
  x_matmul(r, F(out), F(av), L->w[W_2], d.s, d.f, d.h, 0);
  x_add(r, F(out), F(x2), sh);
  /* the first product, rerun from expert_fc1's input */
  save_unless(r, sv, rc, u, &sv->u);
  group_end(r, G_ACT);
  drop(av);
  drop(x2);
  return out;
}

/* The tensor saved under *tag (its field of sv): popped from the manager,
 * or taken from sv->loc after full recompute's rerun. The tag is spent. */
static ofl_tensor_t *load(run_t *r, saved_t *sv, uint64_t *tag) {
  ofl_tensor_t *t = sv->loc[tag - &sv->x];
  if (t != NULL) {
    sv->loc[tag - &sv->x] = NULL;
  } else {
    OK(r, glue_load(r->glue, *tag, &t));
    t = live_add_as(t, 1);
    sample_memory(r); /* a reload waited for now (as_activation) */
  }
  *tag = 0;
  return t;
}

/* A tensor the backward of this layer reads, held in *held from its first
 * use to its own group's backward: kept there by the forward, or popped now
 * from the manager (or sv->loc) by its tag. */
static ofl_tensor_t *input(run_t *r, saved_t *sv, ofl_tensor_t **held,
                           uint64_t *tag) {
  if (*held == NULL)
    *held = load(r, sv, tag);
  return *held;
}

/* The held tensor, now the caller's (its own group's backward). */
static ofl_tensor_t *take(ofl_tensor_t **held) {
  ofl_tensor_t *t = *held;
  *held = NULL;
  return t;
}

static void backward_end(run_t *r, const char *name) {
  OK(r, glue_backward_end(r->glue, name));
  sample_memory(r);
}

/* Backward of y[rows,out] = x[rows,in] @ w: dw += x^T dy; returns
 * dx = dy w^T; x (a saved activation) ends here. */
static ofl_tensor_t *linear_backward(run_t *r, ofl_tensor_t *x, const float *w,
                                     float *dw, const ofl_tensor_t *dy,
                                     int rows, int in, int out) {
  x_matmul_tn(r, dw, F(x), F(dy), in, rows, out, 1);
  ofl_tensor_t *dx = act(r, rows, in);
  x_matmul_nt(r, F(dx), F(dy), w, rows, out, in, 0);
  drop(x);
  return dx;
}

/* A norm's output rerun from its input (a recomputed activation). */
static ofl_tensor_t *norm_again(run_t *r, const ofl_tensor_t *x,
                                const float *g) {
  ofl_tensor_t *y = as_activation(r, act(r, r->d.s, r->d.h));
  x_rmsnorm(r, F(y), F(x), g, r->d.s, r->d.h);
  return y;
}

/* The inputs a recompute reruns from, each obtained once by the first
 * backward that needs it and held (sv->h*) until its own group's: the
 * residuals as kept or saved; the norms' outputs rerun from them when
 * their group is recomputed, else popped; qkv rerun from y1 when
 * core_attn is recomputed, else popped. A chain (core_attn rerun from a
 * rerun y1) reruns each link once. */
static ofl_tensor_t *get_x(run_t *r, saved_t *sv) {
  return input(r, sv, &sv->hx, &sv->x);
}

static ofl_tensor_t *get_x2(run_t *r, saved_t *sv) {
  return input(r, sv, &sv->hx2, &sv->x2);
}

static ofl_tensor_t *get_y1(run_t *r, layer_t *L, saved_t *sv) {
  if (sv->hy1 == NULL && (sv->rc >> G_QKV & 1u))
    sv->hy1 = norm_again(r, get_x(r, sv), L->w[W_G1]);
  return input(r, sv, &sv->hy1, &sv->y1);
}

static ofl_tensor_t *get_y2(run_t *r, layer_t *L, saved_t *sv) {
  if (sv->hy2 == NULL && (sv->rc >> G_FC1 & 1u))
    sv->hy2 = norm_again(r, get_x2(r, sv), L->w[W_G2]);
  return input(r, sv, &sv->hy2, &sv->y2);
}

static ofl_tensor_t *get_qkv(run_t *r, layer_t *L, saved_t *sv) {
  if (sv->hqkv == NULL && (sv->rc >> G_CORE_ATTN & 1u)) {
    ofl_tensor_t *y1 = get_y1(r, L, sv);
    ofl_tensor_t *qkv = as_activation(r, act(r, r->d.s, 3 * r->d.h));
    x_matmul(r, F(qkv), F(y1), L->w[W_QKV], r->d.s, r->d.h, 3 * r->d.h, 0);
    sv->hqkv = qkv;
  }
  return input(r, sv, &sv->hqkv, &sv->qkv);
}

/* The attention's output and/or probabilities rerun from qkv (a NULL
 * destination: that one is not made, nor held meanwhile). */
static void attention_again(run_t *r, const ofl_tensor_t *qkv, ofl_tensor_t **a,
                            ofl_tensor_t **probs) {
  ofl_tensor_t *out = a != NULL ? act(r, r->d.s, r->d.h) : NULL;
  ofl_tensor_t *p = probs != NULL ? act(r, r->d.s, r->d.s) : NULL;
  x_attention(r, out != NULL ? F(out) : NULL, p != NULL ? F(p) : NULL, F(qkv),
              r->d.s, r->d.h);
  if (a != NULL)
    *a = as_activation(r, out);
  if (probs != NULL)
    *probs = as_activation(r, p);
}

/* Backward of one layer; dout is consumed; returns d(input). */
ofl_tensor_t *layer_backward(run_t *r, layer_t *L, saved_t *sv,
                             ofl_tensor_t *dout) {
  dims_t d = r->d;
  if (r->offload && r->o->recompute_full) {
    /* full recompute: the whole forward again from the kept input, its
     * saved tensors held in sv->loc (by the field of their tag), then the
     * backward as usual */
    r->rerun = 1;
    drop(layer_forward(r, L, sv, take(&sv->hx)));
    r->rerun = 0;
    sv->rc = 0;
  }
  unsigned rc = sv->rc;

  OK(r, glue_backward_begin(r->glue, "moe_act"));
  ofl_tensor_t *u;
  if (rc >> G_ACT & 1u) { /* u = y2 W1 again */
    u = as_activation(r, act(r, d.s, d.f));
    x_matmul(r, F(u), F(get_y2(r, L, sv)), L->w[W_1], d.s, d.h, d.f, 0);
  } else {
    u = load(r, sv, &sv->u);
  }
  ofl_tensor_t *av = act(r, d.s, d.f), *dact = act(r, d.s, d.f);
  x_silu(r, F(av), F(u), (size_t)d.s * d.f);
  x_matmul_tn(r, L->dw[W_2], F(av), F(dout), d.f, d.s, d.h, 1);
  x_matmul_nt(r, F(dact), F(dout), L->w[W_2], d.s, d.h, d.f, 0);
  ofl_tensor_t *du = act(r, d.s, d.f);
  x_silu_backward(r, F(du), F(dact), F(u), (size_t)d.s * d.f);
  drop(av);
  drop(dact);
  drop(u);
  backward_end(r, "moe_act");
  ofl_tensor_t *dx2 = dout; /* the residual passes the gradient through */

  OK(r, glue_backward_begin(r->glue, "expert_fc1"));
  (void)get_y2(r, L, sv);
  ofl_tensor_t *dy2 = linear_backward(r, take(&sv->hy2), L->w[W_1], L->dw[W_1],
                                      du, d.s, d.h, d.f);
  drop(du);
  backward_end(r, "expert_fc1");

  OK(r, glue_backward_begin(r->glue, "mlp_norm"));
  (void)get_x2(r, sv);
  ofl_tensor_t *x2 = take(&sv->hx2);
  x_rmsnorm_backward(r, F(dx2), L->dw[W_G2], F(x2), L->w[W_G2], F(dy2), d.s,
                     d.h);
  drop(x2);
  drop(dy2);
  backward_end(r, "mlp_norm");

  OK(r, glue_backward_begin(r->glue, "attn_proj"));
  ofl_tensor_t *a;
  if (rc >> G_ATTN_PROJ & 1u) /* the attention again, from qkv */
    attention_again(r, get_qkv(r, L, sv), &a,
                    rc >> G_CORE_ATTN & 1u ? &sv->hprobs : NULL);
  else
    a = load(r, sv, &sv->a);
  ofl_tensor_t *da =
      linear_backward(r, a, L->w[W_O], L->dw[W_O], dx2, d.s, d.h, d.h);
  backward_end(r, "attn_proj");
  ofl_tensor_t *dx = dx2;

  OK(r, glue_backward_begin(r->glue, "core_attn"));
  (void)get_qkv(r, L, sv);
  ofl_tensor_t *qkv = take(&sv->hqkv), *probs;
  if (!(rc >> G_CORE_ATTN & 1u))
    probs = load(r, sv, &sv->probs);
  else if (sv->hprobs != NULL) /* rerun with attn_proj's output */
    probs = take(&sv->hprobs);
  else /* the probabilities again, from qkv */
    attention_again(r, qkv, NULL, &probs);
  ofl_tensor_t *dqkv = act(r, d.s, 3 * d.h);
  x_attention_backward(r, F(dqkv), F(da), F(qkv), F(probs), d.s, d.h);
  drop(qkv);
  drop(probs);
  drop(da);
  backward_end(r, "core_attn");

  OK(r, glue_backward_begin(r->glue, "qkv_linear"));
  (void)get_y1(r, L, sv);
  ofl_tensor_t *dy1 = linear_backward(r, take(&sv->hy1), L->w[W_QKV],
                                      L->dw[W_QKV], dqkv, d.s, d.h, 3 * d.h);
  drop(dqkv);
  backward_end(r, "qkv_linear");

  OK(r, glue_backward_begin(r->glue, "attn_norm"));
  (void)get_x(r, sv);
  ofl_tensor_t *x = take(&sv->hx);
  x_rmsnorm_backward(r, F(dx), L->dw[W_G1], F(x), L->w[W_G1], F(dy1), d.s, d.h);
  drop(x);
  drop(dy1);
  backward_end(r, "attn_norm");
  return dx;
}
