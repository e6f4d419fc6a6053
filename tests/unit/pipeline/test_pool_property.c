/* Pools are steady in every workload, not only the benchmark's: draws of
 * whole workloads (1F1B and interleaved, pp 1-8, vpp 1-3, 1-16
 * microbatches, 1-4 layers, names of fixed, shape-keyed and byte-keyed
 * tensors of 512 B to 4 MiB, a pool budget of 0 or a tight one, the
 * application's pool or the manager's own for reloads, stream jitter on or
 * off). Once the pools' learning ended (ofl_pool_stats_t.learned_iteration),
 * 20 counted iterations must make no backend call (allocations and frees,
 * device and pinned pools), give back every popped byte as pushed, and hold
 * at most 1.3 times each pool's peak in use (the bytes its blocks took,
 * whole granules each) where segments let it (over_ratio).
 *
 * A TAP program, one check per draw. Arguments or environment:
 *   OFL_SOAK_DRAWS (default 50: the CI subset, with smaller workloads),
 *   OFL_SOAK_SEED (default 1). With OFL_SOAK_DRAWS set the workloads are
 *   drawn at full size (OFL_SOAK_SIZE=small: at the CI subset's), and the
 *   last line counts the draws that ran and those that failed, by kind. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/support/tap.h"
#include "tests/support/driver.h"

#define KIB ((size_t)1024)
#define MIB ((size_t)1 << 20)
#define COUNTED 20
#define LEARN_MAX 13 /* the warmup and twelve learning iterations */

typedef struct {
  uint64_t s;
} rng_t;

static uint64_t rnd(rng_t *r) { return drv_mix(r->s++); }
static int rnd_int(rng_t *r, int lo, int hi) {
  return lo + (int)(rnd(r) % (uint64_t)(hi - lo + 1));
}

typedef struct {
  drv_cfg_t cfg;
  int tight;     /* the manager's pinned pool has a budget */
  char dynamic[128]; /* cfg.dynamic_groups */
  char desc[256];
} draw_t;

/* Bytes one iteration pushes at most, to keep a draw's time bounded. */
static size_t draw_bytes(const drv_cfg_t *c) {
  size_t per_layer = 0;
  for (int g = 0; g < 7; g++)
    if ((c->names_mask >> g) & 1u)
      per_layer += (size_t)c->names[g].tensors * c->names[g].hi;
  return per_layer * (size_t)c->layers * (size_t)c->vpp * (size_t)c->mbs;
}

static void draw_make(rng_t *r, bool full, draw_t *d) {
  memset(d, 0, sizeof *d);
  drv_cfg_t *c = &d->cfg;
  size_t cap = full ? 96 * MIB : 6 * MIB;
  int log_hi = full ? 13 : 10; /* 512 B << 13 = 4 MiB */
  do {
    c->pp = rnd_int(r, 1, 8);
    c->rank = rnd_int(r, 0, c->pp - 1);
    c->vpp = rnd_int(r, 1, 3);
    if (c->pp == 1)
      c->vpp = 1; /* interleaving needs a pipeline */
    c->mbs = rnd_int(r, 1, 16);
    if (c->vpp > 1) /* interleaved: microbatches a multiple of pp */
      c->mbs = c->pp * rnd_int(r, 1, 16 / c->pp > 0 ? 16 / c->pp : 1);
    c->layers = rnd_int(r, 1, 4);
    c->names_mask = 0;
    for (int g = 0; g < 7; g++) {
      drv_name_cfg_t *n = &c->names[g];
      if (rnd(r) % 2 == 0)
        continue;
      c->names_mask |= 1u << g;
      n->set = 1;
      n->tensors = rnd_int(r, 1, 3);
      int kind = rnd_int(r, 0, 2); /* fixed, shape-keyed, byte-keyed */
      /* Byte-keyed sizes are drawn again in every microbatch and
       * iteration, within the name's range (as an MoE layer's). Shape-keyed
       * ones change per microbatch and repeat in every iteration: a shape
       * is a key, so a shape drawn anew each iteration is a new block
       * forever in any pool, outside the shapes the warmup saw. */
      n->vary = kind == 2 ? 1 : kind == 1 ? 2 : 0;
      n->by_bytes = kind == 2 || (kind == 0 && rnd(r) % 4 == 0);
      n->lo = (size_t)512 << rnd_int(r, 0, log_hi);
      n->hi = n->lo + (size_t)(rnd(r) % (n->lo * 2 + 1));
      if (n->hi > 4 * MIB)
        n->hi = 4 * MIB;
      if (kind == 0 && rnd(r) % 2 == 0)
        n->hi = n->lo; /* one size */
      n->layers_mask = rnd(r) % 3 == 0 ? 0x5u << rnd_int(r, 0, 1) : 0;
      if (n->layers_mask != 0 && !(n->layers_mask & ((1u << c->layers) - 1)))
        n->layers_mask = 0;
    }
  } while (c->names_mask == 0 || draw_bytes(c) > cap);
  /* The names whose sizes change in every iteration are the manager's
   * dynamic groups (ofl_manager_params_t.dynamic_groups): it reloads them
   * into byte-keyed blocks, as the application takes them. */
  size_t dn = 0;
  for (int g = 0; g < 7; g++)
    if ((c->names_mask >> g) & 1u && c->names[g].vary == 1)
      dn += (size_t)snprintf(d->dynamic + dn, sizeof d->dynamic - dn, "%s%s",
                             dn ? "," : "", drv_names[g]);
  c->dynamic_groups = d->dynamic;
  c->tensors_max = 1;
  c->thresh = rnd(r) % 2 ? 1 : 4096;
  c->seed = rnd(r) | 1;
  c->jitter_us = rnd(r) % 2 ? 0 : rnd_int(r, 10, 50);
  c->offload = 1;
  c->own_reload_pool = (int)(rnd(r) % 2);
  d->tight = rnd(r) % 4 == 0;
  if (d->tight) {
    /* Tight for what offload holds, never below what the application
     * itself needs: the pinned pool gets about two chunks' pushes (an
     * iteration holds up to pp of them); a group that does not fit stays on
     * the device, counted (budget_kept_bytes). */
    size_t chunk = draw_bytes(c) / (size_t)(c->mbs * c->vpp);
    size_t step = 64 * KIB;
    c->host_budget = (int64_t)((2 * chunk + step - 1) / step * step);
  }
  snprintf(d->desc, sizeof d->desc,
           "%s pp %d rank %d vpp %d mbs %d layers %d names 0x%x thresh %zu "
           "jitter %d %s pool%s",
           c->vpp > 1 ? "interleaved" : "1F1B", c->pp, c->rank, c->vpp,
           c->mbs, c->layers, c->names_mask, c->thresh, c->jitter_us,
           c->own_reload_pool ? "manager's" : "application's",
           d->tight ? " tight pinned budget" : "");
}

enum { F_CALLS, F_WRONG, F_RATIO, F_ERROR, F_KINDS };
static const char *const kind_names[F_KINDS] = {"backend calls", "wrong bytes",
                                                "held/peak ratio",
                                                "error status"};

/* The pools whose calls count: the application's, the manager's reload
 * pool when it has its own, the pinned pool. */
static int pools_of(drv_t *d, ofl_pool_t **out) {
  int n = 0;
  out[n++] = d->pool;
  ofl_pool_t *reload = ofl_manager_device_pool(d->m);
  if (reload != NULL && reload != d->pool)
    out[n++] = reload;
  out[n++] = ofl_manager_host_pool(d->m);
  return n;
}

/* The peak a pool's holding is measured against: the bytes its blocks in
 * use took at most, whole granules each (peak_taken_bytes): a pinned pool
 * of tensors under its 4 KiB page cannot hold less than their pages (seed
 * 36, draw 738: 1.83 MB asked in 3.29 MB of pages). */
static size_t ratio_peak(const ofl_pool_stats_t *s) {
#ifdef PROP_FIXED_WINDOW
  return s->peak_in_use_bytes; /* a library without peak_taken_bytes */
#else
  return s->peak_taken_bytes > s->peak_in_use_bytes ? s->peak_taken_bytes
                                                    : s->peak_in_use_bytes;
#endif
}

/* Whether a pool holds more than 1.3 times its peak in use where it could
 * do better. Not a pool smaller than a segment or two: its segments are
 * whole minimum segments (2 MiB), and the pinned pool keeps a twelfth of
 * its peak free in them, so it may hold a segment above its peak, or the
 * twelfth rounded up to whole segments (and the blocks of their own it
 * made before it carved, a few of the first sizes). Not a pool of blocks of their own
 * (no segments: shape keys): it caches one block per shape it was asked
 * for, which is what makes it call-free; its peak in use at once may be a
 * fraction of the shapes of all microbatches (pp 1, 11 microbatches of
 * their own shapes: 3.6 MB held, 218 KB at once). */
static bool over_ratio(const ofl_pool_stats_t *s) {
  const size_t seg = 2 * MIB;
  size_t peak = ratio_peak(s), held = s->held_bytes;
  size_t room = (peak + peak / 12 + seg - 1) / seg * seg;
  if (s->segment_bytes == 0 || (double)held <= 1.3 * (double)peak)
    return false;
  return s->segment_bytes > peak + seg && held > room;
}

#ifdef PROP_FIXED_WINDOW
/* For a library without ofl_pool_stats_t.learned_iteration: the twelve
 * learning iterations after the warmup. */
static bool all_learned_at(drv_t *d, int it) {
  (void)d;
  return it >= 12;
}
#define all_learned(d) all_learned_at(d, it)
#else
static bool all_learned(drv_t *d) {
  ofl_pool_t *pools[3];
  int n = pools_of(d, pools);
  for (int i = 0; i < n; i++) {
    ofl_pool_stats_t s;
    ofl_pool_get_stats(pools[i], &s);
    if (s.iterations > 0 && s.learned_iteration == 0)
      return false;
  }
  return true;
}
#endif

/* OFL_SOAK_VERBOSE: each iteration's figures per pool, to debug a draw. */
static void trace_iteration(drv_t *d, int it, bool counted) {
  static int verbose = -1;
  if (verbose < 0)
    verbose = getenv("OFL_SOAK_VERBOSE") != NULL;
  if (!verbose)
    return;
  ofl_pool_t *pools[3];
  int n = pools_of(d, pools);
  for (int i = 0; i < n; i++) {
    ofl_pool_stats_t s;
    ofl_pool_get_stats(pools[i], &s);
    tap_diag("%s iteration %d pool %s: held %zu segments %zu peak %zu "
             "(taken %zu) allocs %llu frees %llu learned %llu",
             counted ? "counted" : "learning", it, ofl_pool_name(pools[i]),
             s.held_bytes, s.segment_bytes, s.peak_in_use_bytes, ratio_peak(&s),
             (unsigned long long)s.backend_allocs,
             (unsigned long long)s.backend_frees,
             (unsigned long long)s.learned_iteration);
    if (!counted) /* the counted iterations' peak is the check's */
      ofl_pool_reset_peak(pools[i]);
  }
}

/* Runs one draw; returns a mask of failure kinds and a reason in why. */
static unsigned run_draw(const draw_t *w, char *why, size_t cap) {
  drv_t d;
  why[0] = '\0';
  if (drv_open(&d, &w->cfg) != OFL_SUCCESS) {
    snprintf(why, cap, "open: %s", d.msg);
    return 1u << F_ERROR;
  }
  unsigned fail = 0;
  int it = 0;
  for (; it < LEARN_MAX && fail == 0; it++) {
    if (drv_iteration(&d) != OFL_SUCCESS) {
      snprintf(why, cap, "learning iteration %d: %s", it, d.msg);
      fail |= 1u << F_ERROR;
    }
    trace_iteration(&d, it, false);
    if (it >= 1 && all_learned(&d))
      break;
  }
  if (fail == 0 && !all_learned(&d)) {
    snprintf(why, cap, "still learning after %d iterations", it);
    fail |= 1u << F_CALLS;
  }
  ofl_pool_t *pools[3];
  ofl_pool_stats_t before[3], after[3];
  int np = pools_of(&d, pools);
  for (int i = 0; i < np; i++) {
    ofl_pool_reset_peak(pools[i]);
    ofl_pool_get_stats(pools[i], &before[i]);
  }
  size_t wrong0 = d.wrong_bytes;
  for (int k = 0; k < COUNTED && fail == 0; k++) {
    if (drv_iteration(&d) != OFL_SUCCESS) {
      snprintf(why, cap, "counted iteration %d: %s", k, d.msg);
      fail |= 1u << F_ERROR;
    }
    trace_iteration(&d, k, true);
  }
  if (fail == 0) {
    for (int i = 0; i < np; i++) {
      ofl_pool_get_stats(pools[i], &after[i]);
      uint64_t calls = after[i].backend_allocs - before[i].backend_allocs +
                       after[i].backend_frees - before[i].backend_frees;
      size_t peak = ratio_peak(&after[i]), held = after[i].held_bytes;
      if (calls != 0 && !(fail & (1u << F_CALLS))) {
        fail |= 1u << F_CALLS;
        snprintf(why, cap,
                 "pool %s: %llu backend calls in the counted iterations "
                 "(%llu allocations)",
                 ofl_pool_name(pools[i]), (unsigned long long)calls,
                 (unsigned long long)(after[i].backend_allocs -
                                      before[i].backend_allocs));
      }
      if (over_ratio(&after[i]) && !(fail & (1u << F_RATIO))) {
        fail |= 1u << F_RATIO;
        snprintf(why + strlen(why), cap - strlen(why),
                 "%spool %s: holds %zu for a peak of %zu (%zu asked)",
                 why[0] ? "; " : "", ofl_pool_name(pools[i]), held, peak,
                 after[i].peak_in_use_bytes);
      }
    }
    if (d.wrong_bytes != wrong0 || d.wrong_bytes != 0 || d.order_errors != 0) {
      fail |= 1u << F_WRONG;
      snprintf(why + strlen(why), cap - strlen(why), "%s%zu wrong bytes",
               why[0] ? "; " : "", d.wrong_bytes);
    }
  }
  drv_close(&d);
  return fail;
}

/* Runs draw w (number k of seed's) and reports it: its failure kinds. */
static unsigned run_report(const draw_t *w, long k, uint64_t seed) {
  char why[1024];
  unsigned f = run_draw(w, why, sizeof why);
  tap_ok(f == 0, "draw %ld (seed %llu): %s", k, (unsigned long long)seed,
         w->desc);
  if (f != 0)
    tap_diag("%s", why);
  return f;
}

/* Draw k of seed's sequence (0-based). */
static void draw_nth(uint64_t seed, long k, bool full, draw_t *w) {
  rng_t r = {seed * 0x9e3779b97f4a7c15ull};
  for (long i = 0; i <= k; i++)
    draw_make(&r, full, w);
}

/* --list SEED:DRAW,... (or OFL_SOAK_LIST): those draws alone, at the CI's
 * sizes: the soak's failures kept as regressions (meson.build names
 * them). */
static int run_list(const char *list) {
  long n = 1;
  for (const char *c = list; *c; c++)
    n += *c == ',';
  tap_plan((int)n);
  long failed = 0;
  const char *c = list;
  for (long i = 0; i < n; i++) {
    char *end = NULL;
    uint64_t seed = strtoull(c, &end, 10);
    long k = end != NULL && *end == ':' ? strtol(end + 1, &end, 10) : -1;
    if (k < 0 || end == NULL || (*end != ',' && *end != '\0')) {
      tap_ok(false, "draw list entry %ld: want SEED:DRAW, got \"%s\"", i, c);
      return tap_done();
    }
    draw_t w;
    draw_nth(seed, k, false, &w);
    failed += run_report(&w, k, seed) != 0;
    c = *end == ',' ? end + 1 : end;
  }
  printf("# listed draws %ld failed %ld\n", n, failed);
  return tap_done();
}

int main(int argc, char **argv) {
  const char *env_list = getenv("OFL_SOAK_LIST");
  if (argc > 2 && strcmp(argv[1], "--list") == 0)
    return run_list(argv[2]);
  if (env_list != NULL && *env_list != '\0')
    return run_list(env_list);
  const char *env_draws = getenv("OFL_SOAK_DRAWS");
  const char *env_seed = getenv("OFL_SOAK_SEED");
  bool full = env_draws != NULL || argc > 1;
  const char *env_size = getenv("OFL_SOAK_SIZE"); /* small: the CI's sizes */
  if (env_size != NULL && strcmp(env_size, "small") == 0)
    full = false;
  long draws = argc > 1 ? atol(argv[1]) : env_draws ? atol(env_draws) : 50;
  uint64_t seed = argc > 2        ? strtoull(argv[2], NULL, 10)
                  : env_seed != NULL ? strtoull(env_seed, NULL, 10)
                                     : 1;
  if (draws < 1)
    draws = 1;
  const char *env_only = getenv("OFL_SOAK_ONLY");
  long only = env_only != NULL ? atol(env_only) : -1;
  tap_plan((int)draws);
  rng_t r = {seed * 0x9e3779b97f4a7c15ull};
  long failed = 0, by_kind[F_KINDS] = {0};
  for (long i = 0; i < draws; i++) {
    draw_t w;
    draw_make(&r, full, &w);
    if (only >= 0 && i != only) { /* OFL_SOAK_ONLY: one draw, to debug */
      tap_ok(true, "draw %ld skipped", i);
      continue;
    }
    unsigned f = run_report(&w, i, seed);
    if (f != 0) {
      failed++;
      for (int k = 0; k < F_KINDS; k++)
        by_kind[k] += (f >> k) & 1u;
    }
  }
  printf("# draws %ld failed %ld: %s %ld, %s %ld, %s %ld, %s %ld\n", draws,
         failed, kind_names[0], by_kind[0], kind_names[1], by_kind[1],
         kind_names[2], by_kind[2], kind_names[3], by_kind[3]);
  return tap_done();
}
