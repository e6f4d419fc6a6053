/* The manager under 1F1B and interleaved 1F1B schedules: every popped tensor
 * equals byte for byte what was pushed, over seeded random configurations
 * with stream jitter, and the backward order is the schedule's. */
#include "tests/support/harness.h"

static drv_cfg_t random_cfg(uint64_t seed) {
  uint64_t h = drv_mix(seed * 7919 + 1);
  drv_cfg_t c = {0};
  c.pp = 1 + (int)(h % 4);
  h = drv_mix(h);
  c.rank = (int)(h % (uint64_t)c.pp);
  h = drv_mix(h);
  c.vpp = 1 + (int)(h % 4);
  h = drv_mix(h);
  if (c.vpp > 1)
    c.mbs = c.pp * (1 + (int)(h % (uint64_t)(16 / c.pp)));
  else
    c.mbs = 1 + (int)(h % 16);
  h = drv_mix(h);
  c.layers = 1 + (int)(h % 4);
  h = drv_mix(h);
  c.names_mask = 1 + (unsigned)(h % 127);
  h = drv_mix(h);
  c.tensors_max = 1 + (int)(h % 3);
  /* Bound the pushes per iteration (about 100) so that 512 jittered
   * configurations stay within a minute; every range is still reachable. */
  for (;;) {
    int names = __builtin_popcount(c.names_mask);
    int est = c.mbs * c.vpp * c.layers * names * (c.tensors_max + 1) / 2;
    if (est <= 100)
      break;
    h = drv_mix(h);
    switch (h % 4) {
    case 0:
      if (c.layers > 1)
        c.layers--;
      break;
    case 1:
      if (names > 1)
        c.names_mask &= c.names_mask - 1;
      break;
    case 2:
      if (c.tensors_max > 1)
        c.tensors_max--;
      break;
    default:
      if (c.mbs > (c.vpp > 1 ? c.pp : 1))
        c.mbs -= c.vpp > 1 ? c.pp : 1;
      break;
    }
  }
  c.thresh = 256;
  c.size_lo = 64;
  c.size_hi = 1024;
  c.iterations = 3;
  c.seed = seed;
  h = drv_mix(h);
  c.jitter_us = getenv("DRV_JIT") ? atoi(getenv("DRV_JIT")) : (int)(h % 30);
  c.tricks = 1;
  c.offload = 1;
  return c;
}

static void run_configs_tier(uint64_t first, uint64_t count, int tier);

static void run_configs(uint64_t first, uint64_t count) {
  run_configs_tier(first, count, 0);
}

/* tier 1: a disk tier that takes some group names and the clusters a small
 * host budget refuses. */
static void run_configs_tier(uint64_t first, uint64_t count, int tier) {
  size_t tensors = 0;
  uint64_t idle = 0; /* configurations with nothing to offload */
  for (uint64_t s = first; s < first + count; s++) {
    drv_cfg_t cfg = random_cfg(s);
    if (tier) {
      static const char *const sel[4] = {"*", "core_attn,expert_fc1", "moe_act",
                                         ""};
      cfg.disk_groups = sel[s % 4];
      cfg.host_budget = (int64_t)((s % 3) * 16384);
    }
    drv_t d;
    ofl_status_t st = drv_open(&d, &cfg);
    uint64_t inline_warm = 0;
    for (int it = 0; st == OFL_SUCCESS && it < cfg.iterations; it++) {
      st = drv_iteration(&d);
      if (it == 0) {
        ofl_manager_stats_t w;
        ofl_manager_get_stats(d.m, &w);
        inline_warm = w.inline_reloads;
      }
    }
    cr_assert(eq(int, st, OFL_SUCCESS),
              "seed %llu pp %d rank %d vpp %d mbs %d layers %d names 0x%x: %s",
              (unsigned long long)s, cfg.pp, cfg.rank, cfg.vpp, cfg.mbs,
              cfg.layers, cfg.names_mask, d.msg);
    cr_assert(eq(sz, d.wrong_bytes, 0),
              "seed %llu pp %d rank %d vpp %d mbs %d layers %d names 0x%x: "
              "%zu wrong bytes",
              (unsigned long long)s, cfg.pp, cfg.rank, cfg.vpp, cfg.mbs,
              cfg.layers, cfg.names_mask, d.wrong_bytes);
    cr_assert(eq(int, d.order_errors, 0), "seed %llu: backward chunk order",
              (unsigned long long)s);
    cr_assert(eq(int, drv_check_order(&d), 0), "seed %llu: recorded order",
              (unsigned long long)s);
    ofl_manager_stats_t ms;
    ofl_manager_get_stats(d.m, &ms);
    /* (A configuration may push nothing the manager may offload: every
     * tensor under the threshold or marked not offloadable.) */
    if (d.eligible_pushes > 0)
      cr_assert(gt(u64, ms.offloaded_tensors, 0),
                "seed %llu offloaded nothing of %zu eligible pushes",
                (unsigned long long)s, d.eligible_pushes);
    else
      idle++;
    cr_assert(eq(u64, ms.unpopped_tensors, 0));
    if (tier && cfg.disk_groups[0] == '*')
      cr_assert(eq(u64, ms.disk_tensors, ms.offloaded_tensors),
                "seed %llu: every offload goes to disk", (unsigned long long)s);
    if (tier)
      cr_assert(eq(u64, ms.budget_kept_tensors, 0),
                "seed %llu: the disk tier takes what the host budget refuses",
                (unsigned long long)s);
    if (!tier)
      cr_assert(eq(u64, ms.disk_tensors, 0));
    /* After warmup every reload is a prefetch, across chunks too. */
    cr_assert(eq(u64, ms.inline_reloads, inline_warm),
              "seed %llu pp %d rank %d vpp %d mbs %d: %llu inline reloads "
              "after warmup",
              (unsigned long long)s, cfg.pp, cfg.rank, cfg.vpp, cfg.mbs,
              (unsigned long long)(ms.inline_reloads - inline_warm));
    tensors += d.checked_tensors;
    drv_close(&d);
  }
  cr_log_info("%llu configurations, %zu tensors compared",
              (unsigned long long)count, tensors);
  /* Nearly every configuration offloads something. */
  cr_assert(le(u64, idle, count / 8), "%llu of %llu configurations had "
            "nothing to offload", (unsigned long long)idle,
            (unsigned long long)count);
}

/* 4 x 128 = 512 seeded configurations per run. */
Test(pipeline_schedule, random_schedules_return_pushed_bytes_part1) {
  run_configs(1, 128);
}
Test(pipeline_schedule, random_schedules_return_pushed_bytes_part2) {
  run_configs(129, 128);
}
Test(pipeline_schedule, random_schedules_return_pushed_bytes_part3) {
  run_configs(257, 128);
}
Test(pipeline_schedule, random_schedules_return_pushed_bytes_part4) {
  run_configs(385, 128);
}

Test(pipeline_schedule, random_schedules_with_the_disk_tier) {
  run_configs_tier(1001, 48, 1);
}

/* Backward order for (vpp, microbatches) combinations, incl. one layer per
 * chunk (the reference's #6783 scenario), checked step by step and in the
 * recorded order, with the data. */
Test(pipeline_schedule, backward_order_matches_1f1b_and_interleaved) {
  int combos = 0;
  for (int pp = 1; pp <= 4; pp++) {
    for (int vpp = 1; vpp <= 4; vpp++) {
      for (int k = 1; k <= 4; k++) {
        int mbs = vpp > 1 ? pp * k : k * 3;
        for (int rank = 0; rank < pp; rank++) {
          drv_cfg_t cfg = {0};
          cfg.pp = pp;
          cfg.rank = rank;
          cfg.vpp = vpp;
          cfg.mbs = mbs;
          cfg.layers = 1;
          cfg.names_mask = 0x7f;
          cfg.tensors_max = 1;
          cfg.thresh = 0;
          cfg.size_lo = 32;
          cfg.size_hi = 64;
          cfg.seed = (uint64_t)(pp * 1000 + vpp * 100 + k * 10 + rank);
          cfg.jitter_us = 2;
          cfg.offload = 1;
          drv_t d;
          ofl_status_t st = drv_open(&d, &cfg);
          for (int it = 0; st == OFL_SUCCESS && it < 2; it++)
            st = drv_iteration(&d);
          cr_assert(eq(int, st, OFL_SUCCESS), "pp %d rank %d vpp %d mbs %d: %s",
                    pp, rank, vpp, mbs, d.msg);
          cr_assert(eq(int, drv_check_order(&d), 0),
                    "pp %d rank %d vpp %d mbs %d: recorded backward order "
                    "differs from the schedule",
                    pp, rank, vpp, mbs);
          cr_assert(eq(int, d.order_errors, 0),
                    "pp %d rank %d vpp %d mbs %d: backward selected another "
                    "chunk than the schedule runs",
                    pp, rank, vpp, mbs);
          cr_assert(eq(sz, d.wrong_bytes, 0));
          combos++;
          drv_close(&d);
        }
      }
    }
  }
  cr_assert(gt(int, combos, 100));
}
