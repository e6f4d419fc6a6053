/* A schedule driver for the manager tests: plays 1F1B or interleaved 1F1B
 * for one pipeline stage with layers made of named groups, pushes tensors
 * filled with a pattern, pops them in backward and counts wrong bytes.
 * Header-only (static) so each test program includes it.
 *
 * Device bytes are written and checked through copies (tests/support/devmem.h),
 * never by the CPU, on the backend under test (OFLTEST_BACKEND): the same
 * schedules run on the host backend and on the cuda backend (the cudasim
 * stand-in, whose device memory the CPU cannot touch, or a real GPU). */
#ifndef OFL_TEST_PIPELINE_DRIVER_H
#define OFL_TEST_PIPELINE_DRIVER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

#include "pipeline/pipeline_internal.h"
#include "tests/support/devmem.h"
#include "tests/support/fixture.h"
#include "tests/support/schedule.h"

static inline uint64_t drv_mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static inline uint64_t drv_hash(uint64_t a, uint64_t b, uint64_t c,
                                uint64_t d) {
  return drv_mix(a ^ drv_mix(b ^ drv_mix(c ^ drv_mix(d))));
}

/* drv_fill and drv_wrong touch memory with the CPU: only host buffers and
 * pinned memory. Device memory goes through t_tensor_fill / t_tensor_wrong;
 * those and the pattern are tests/support/devmem.h's. */
static inline void drv_fill(void *p, size_t n, uint64_t seed) {
  t_pattern(p, n, seed);
}

static inline size_t drv_wrong(const void *p, size_t n, uint64_t seed) {
  return t_pattern_wrong(p, n, seed);
}

/* ---- driver -------------------------------------------------------------- */

/* One name's tensors when drv_cfg_t.names[g].set: tensors per group, their
 * size range, whether the size is drawn again per microbatch and iteration
 * (vary 1), per microbatch only, the same in every iteration (vary 2: a
 * shape-keyed name whose shapes repeat from those the warmup saw), or once
 * per chunk, layer and tensor (vary 0), whether the application takes
 * them from byte-keyed blocks (ofl_pool_alloc_dynamic, as a caching
 * allocator gives) or shape-keyed ones, and the layers that have the name
 * (bit l; 0: every layer). */
typedef struct {
  int set;
  int tensors;
  size_t lo, hi;
  int vary;
  int by_bytes;
  unsigned layers_mask;
} drv_name_cfg_t;

typedef struct {
  int pp, rank, vpp, mbs, layers;
  unsigned names_mask; /* bit i: drv_names[i] */
  int tensors_max;     /* tensors per group, 1.. (plus aliases) */
  size_t thresh;       /* min offload bytes */
  size_t size_lo, size_hi;
  int iterations;
  uint64_t seed;
  int jitter_us;
  int tricks; /* aliases with forced release, duplicates, not-offloadable */
  int offload;
  ofl_pool_t *act_pool;       /* NULL: one per run */
  ofl_device_t *dev;          /* NULL: one per run */
  const char *disk_groups;    /* non-NULL: a disk tier with these groups */
  int64_t host_budget;        /* pinned budget (0: none) */
  int keyed_by_bytes;         /* 1: the schedule's own tensors of dynamic names
                                 (expert_fc1, moe_act) come from byte-keyed
                                 blocks, as a caching allocator would give */
  drv_name_cfg_t names[7];    /* per name; set 0: the fields above decide */
  int own_reload_pool;        /* 1: the manager reloads into a pool of its own,
                                 not the application's act_pool */
  const char *dynamic_groups; /* the manager's dynamic_groups (NULL: its
                                 default, expert_fc1 and moe_act) */
} drv_cfg_t;

#define DRV_MAX_T 8

typedef struct {
  ofl_tag_t tag[DRV_MAX_T];
  uint64_t seed[DRV_MAX_T];
  size_t bytes[DRV_MAX_T];
  int n;
} drv_group_rec_t;

typedef struct {
  drv_cfg_t cfg;
  ofl_device_t *dev;
  ofl_pool_t *pool;
  ofl_manager_t *m;
  ofl_disk_t *disk;
  drv_group_rec_t *rec; /* [vpp][mbs][layers][7] */
  int iter;
  size_t wrong_bytes;
  size_t checked_tensors;
  size_t eligible_pushes; /* pushes the manager may offload: offload on, at
                             least thresh bytes, not marked not-offloadable */
  ofl_status_t err;
  char msg[512];
  int order_errors;
} drv_t;

static inline drv_group_rec_t *drv_rec(drv_t *d, int c, int mb, int l, int g) {
  const drv_cfg_t *k = &d->cfg;
  return &d->rec[(((size_t)c * k->mbs + mb) * k->layers + l) * 7 + g];
}

#define DRV_TRY(d, call)                                                       \
  do {                                                                         \
    ofl_status_t s_ = (call);                                                  \
    if (s_ != OFL_SUCCESS) {                                                   \
      if ((d)->err == OFL_SUCCESS) {                                           \
        (d)->err = s_;                                                         \
        snprintf((d)->msg, sizeof(d)->msg, "%s: %s (%s)", #call,               \
                 ofl_status_str(s_), ofl_last_error());                        \
      }                                                                        \
      return s_;                                                               \
    }                                                                          \
  } while (0)

static inline size_t drv_size(const drv_t *d, int c, int mb, int l, int g,
                              int k) {
  const drv_cfg_t *cfg = &d->cfg;
  const drv_name_cfg_t *nc = &cfg->names[g];
  /* Dynamic names change shape every microbatch and iteration. */
  bool vary = nc->set ? nc->vary != 0 : g >= 5;
  uint64_t iter = nc->set && nc->vary == 2 ? 0 : (uint64_t)d->iter;
  uint64_t var = vary ? (uint64_t)(mb + 1) * 977 + iter : 0;
  uint64_t h = drv_hash(cfg->seed, (uint64_t)c * 131 + (uint64_t)l,
                        (uint64_t)g * 17 + (uint64_t)k, var);
  size_t lo = nc->set ? nc->lo : cfg->size_lo;
  size_t hi = nc->set ? nc->hi : cfg->size_hi;
  return lo + (size_t)(h % (hi - lo + 1));
}

/* Whether layer l has name g, and whether its tensors are byte-keyed. */
static inline bool drv_has(const drv_cfg_t *cfg, int l, int g) {
  if (!((cfg->names_mask >> g) & 1u))
    return false;
  unsigned lm = cfg->names[g].set ? cfg->names[g].layers_mask : 0;
  return lm == 0 || ((lm >> l) & 1u);
}

static inline bool drv_by_bytes(const drv_cfg_t *cfg, int g) {
  if (cfg->names[g].set)
    return cfg->names[g].by_bytes != 0;
  return g >= 5 && cfg->keyed_by_bytes;
}

static inline ofl_status_t drv_alloc(drv_t *d, size_t bytes, uint64_t seed,
                                     bool by_bytes, ofl_tensor_t **out) {
  int64_t shape[1] = {(int64_t)bytes};
  ofl_stream_t *s = ofl_device_compute_stream(d->dev);
  if (by_bytes)
    DRV_TRY(d, ofl_pool_alloc_dynamic(d->pool, shape, 1, OFL_DTYPE_U8, s, out));
  else
    DRV_TRY(d, ofl_pool_alloc(d->pool, shape, 1, OFL_DTYPE_U8, s, out));
  DRV_TRY(d, t_tensor_fill(d->dev, *out, bytes, seed));
  return OFL_SUCCESS;
}

static inline ofl_status_t drv_forward(drv_t *d, int c, int mb) {
  const drv_cfg_t *cfg = &d->cfg;
  ofl_manager_t *m = d->m;
  DRV_TRY(d, ofl_manager_chunk_begin(m, cfg->vpp, c));
  for (int l = 0; l < cfg->layers; l++) {
    for (int g = 0; g < 7; g++) {
      if (!drv_has(cfg, l, g))
        continue;
      drv_group_rec_t *r = drv_rec(d, c, mb, l, g);
      r->n = 0;
      DRV_TRY(d, ofl_manager_group_start(m, drv_names[g]));
      uint64_t hs = drv_hash(cfg->seed, (uint64_t)c, (uint64_t)l, (uint64_t)g);
      int nt = cfg->names[g].set ? cfg->names[g].tensors
                                 : 1 + (int)(hs % (uint64_t)cfg->tensors_max);
      ofl_tensor_t *forced[DRV_MAX_T];
      size_t nforced = 0;
      for (int k = 0; k < nt && r->n < DRV_MAX_T - 1; k++) {
        size_t bytes = drv_size(d, c, mb, l, g, k);
        uint64_t seed = drv_hash(cfg->seed + (uint64_t)d->iter,
                                 (uint64_t)c * 1000 + (uint64_t)mb,
                                 (uint64_t)l * 10 + (uint64_t)g, (uint64_t)k);
        ofl_tensor_t *t;
        if (drv_alloc(d, bytes, seed, drv_by_bytes(cfg, g), &t) != OFL_SUCCESS)
          return d->err;
        uint64_t trick = cfg->tricks ? drv_hash(hs, (uint64_t)k, 5, 7) % 8 : 0;
        if (trick == 1)
          ofl_manager_mark_not_offloadable(t);
        else if (cfg->offload && bytes >= cfg->thresh)
          d->eligible_pushes++;
        if (trick == 2 || trick == 3) {
          /* The module keeps t (e.g. the residual) and saves an alias; t is
           * released with the group. */
          ofl_tensor_t *a;
          DRV_TRY(d, ofl_tensor_alias(t, &a));
          forced[nforced++] = t;
          t = a;
        }
        r->seed[r->n] = seed;
        r->bytes[r->n] = bytes;
        DRV_TRY(d, ofl_manager_tensor_push(m, t, &r->tag[r->n]));
        r->n++;
        if (trick == 4) {
          /* The same storage saved twice. */
          ofl_tensor_t *a;
          DRV_TRY(d, ofl_tensor_alias(t, &a));
          r->seed[r->n] = seed;
          r->bytes[r->n] = bytes;
          DRV_TRY(d, ofl_manager_tensor_push(m, a, &r->tag[r->n]));
          r->n++;
        }
      }
      DRV_TRY(d, ofl_manager_group_commit(m, drv_names[g], forced, nforced, 0));
      for (size_t i = 0; i < nforced; i++)
        DRV_TRY(d, ofl_tensor_destroy(forced[i]));
    }
  }
  return OFL_SUCCESS;
}

static inline ofl_status_t drv_backward(drv_t *d, int c, int mb) {
  const drv_cfg_t *cfg = &d->cfg;
  ofl_manager_t *m = d->m;
  int first = 1;
  for (int l = cfg->layers - 1; l >= 0; l--) {
    for (int g = 6; g >= 0; g--) {
      if (!drv_has(cfg, l, g))
        continue;
      drv_group_rec_t *r = drv_rec(d, c, mb, l, g);
      DRV_TRY(d, ofl_manager_group_backward_begin(m, drv_names[g]));
      if (first && cfg->offload) {
        first = 0;
        /* The manager selected the chunk the schedule runs. */
        chunk_t *cb = m->cur_bwd;
        if (cb == NULL || cb->vp_stage != c || cb->mb != mb)
          d->order_errors++;
      }
      for (int k = r->n - 1; k >= 0; k--) {
        ofl_tensor_t *t = NULL;
        DRV_TRY(d, ofl_manager_tensor_pop(m, r->tag[k], &t));
        if (ofl_tensor_bytes(t) != r->bytes[k] || !ofl_tensor_has_storage(t)) {
          d->wrong_bytes += r->bytes[k];
        } else {
          size_t w = t_tensor_wrong(d->dev, t, r->bytes[k], r->seed[k]);
          if (w == SIZE_MAX) { /* the read-back copy failed */
            d->wrong_bytes += r->bytes[k];
            if (d->err == OFL_SUCCESS) {
              d->err = OFL_ERR_INTERNAL;
              snprintf(d->msg, sizeof d->msg,
                       "reading back a popped tensor "
                       "failed: %s",
                       ofl_last_error());
            }
            return d->err;
          }
          d->wrong_bytes += w;
        }
        d->checked_tensors++;
        DRV_TRY(d, ofl_tensor_destroy(t));
      }
      DRV_TRY(d, ofl_manager_group_backward_end(m, drv_names[g]));
    }
  }
  return OFL_SUCCESS;
}

static inline ofl_status_t drv_iteration(drv_t *d) {
  const drv_cfg_t *cfg = &d->cfg;
  drv_step_t *steps = calloc((size_t)2 * cfg->mbs * cfg->vpp, sizeof *steps);
  if (steps == NULL)
    return OFL_ERR_NO_MEMORY;
  int n = drv_schedule(cfg->pp, cfg->rank, cfg->vpp, cfg->mbs, steps);
  ofl_status_t s = OFL_SUCCESS;
  for (int i = 0; i < n && s == OFL_SUCCESS; i++)
    s = steps[i].fwd ? drv_forward(d, steps[i].chunk, steps[i].mb)
                     : drv_backward(d, steps[i].chunk, steps[i].mb);
  free(steps);
  if (s != OFL_SUCCESS)
    return s;
  DRV_TRY(d, ofl_manager_reset(d->m));
  d->iter++;
  return OFL_SUCCESS;
}

static inline ofl_status_t drv_open(drv_t *d, const drv_cfg_t *cfg) {
  memset(d, 0, sizeof *d);
  d->cfg = *cfg;
  if (cfg->dev != NULL) {
    d->dev = cfg->dev;
  } else {
    /* The backend under test; strict mode with jitter on the host one. */
    ofl_device_params_t dp = t_device_params(cfg->jitter_us, cfg->seed | 1);
    DRV_TRY(d, ofl_device_open(&dp, &d->dev));
  }
  if (cfg->act_pool != NULL)
    d->pool = cfg->act_pool;
  else
    DRV_TRY(d, t_env_open_pool(d->dev, &d->pool));
  if (cfg->disk_groups != NULL) {
    ofl_disk_params_t kp =
        t_env_disk_params(d->dev, cfg->disk_groups, cfg->rank);
    DRV_TRY(d, ofl_disk_open(&kp, &d->disk));
  }
  ofl_manager_params_t mp = t_env_manager_params(d->dev, d->pool);
  if (cfg->own_reload_pool)
    mp.device_pool = NULL;
  mp.disk = d->disk;
  mp.offload = cfg->offload;
  mp.min_offload_bytes = (int64_t)cfg->thresh;
  mp.host_budget_bytes = cfg->host_budget;
  mp.dynamic_groups = cfg->dynamic_groups;
  mp.pp_rank = cfg->rank;
  mp.rank = cfg->rank;
  DRV_TRY(d, ofl_manager_create(&mp, &d->m));
  /* Debugging aid: DRV_RULES_OFF=<mask> shows what the tests catch when a
   * rule of docs/DESIGN.md section 5 is turned off. */
  if (getenv("DRV_RULES_OFF") != NULL)
    ofl__manager_rules_off(d->m, (unsigned)atoi(getenv("DRV_RULES_OFF")));
  d->rec =
      calloc((size_t)cfg->vpp * cfg->mbs * cfg->layers * 7, sizeof *d->rec);
  return d->rec ? OFL_SUCCESS : OFL_ERR_NO_MEMORY;
}

static inline void drv_close(drv_t *d) {
  ofl_manager_destroy(d->m);
  ofl_disk_close(d->disk);
  if (d->cfg.act_pool == NULL)
    ofl_pool_destroy(d->pool);
  if (d->cfg.dev == NULL)
    ofl_device_close(d->dev);
  free(d->rec);
}

/* The recorded backward order equals the schedule's backward steps. */
static inline int drv_check_order(drv_t *d) {
  const drv_cfg_t *cfg = &d->cfg;
  drv_step_t *steps = calloc((size_t)2 * cfg->mbs * cfg->vpp, sizeof *steps);
  int n = drv_schedule(cfg->pp, cfg->rank, cfg->vpp, cfg->mbs, steps);
  int bad = 0;
  uint32_t j = 0;
  for (int i = 0; i < n; i++) {
    if (steps[i].fwd)
      continue;
    if (j >= d->m->nbwd || d->m->bwd[j]->vp_stage != steps[i].chunk ||
        d->m->bwd[j]->mb != steps[i].mb)
      bad++;
    j++;
  }
  free(steps);
  return bad + (j != d->m->nbwd);
}

#endif /* OFL_TEST_PIPELINE_DRIVER_H */
