/* A pool's merged segment learns from the growths it could not avoid: a
 * merge after a growth is never the segment that proved too small, so a
 * workload that fragmented it once fits the next one, and the pool makes
 * no more backend calls however often the workload repeats. Before, the
 * merge was sized for the same most in use again, met the same gaps, and
 * the pool grew and merged (two allocations, two frees) every round while
 * the bytes it held stayed flat. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdint.h>
#include <stdlib.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"
#include "tests/support/driver.h"

#define KIB ((size_t)1024)
#define MIB ((size_t)1 << 20)

static ofl_device_t *dev;

static void open_dev(void) {
  ofl_device_params_t p = t_device_params(0, 5);
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(pool_learning, .init = open_dev, .fini = close_dev);

#define OK(call)                                                               \
  cr_assert(eq(int, (call), OFL_SUCCESS), "%s: %s", #call, ofl_last_error())

/* A byte-keyed block of n bytes filled with the pattern of seed. */
static ofl_tensor_t *take(ofl_pool_t *pool, size_t n, uint64_t seed) {
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL;
  OK(ofl_pool_alloc_dynamic(pool, shape, 1, OFL_DTYPE_U8, NULL, &t));
  OK(t_fill(dev, ofl_tensor_data(t), n, seed));
  return t;
}

/* The pattern of seed is still in t, then t goes back. */
static void give(ofl_pool_t *pool, ofl_tensor_t *t, uint64_t seed) {
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(t), ofl_tensor_bytes(t), seed),
               0));
  OK(ofl_pool_free(pool, t));
}

/* Two requests with nothing in use: idle points, where a pool that grew
 * merges its segments. */
static void idle_points(ofl_pool_t *pool) {
  for (int i = 0; i < 2; i++)
    give(pool, take(pool, 256 * KIB, 900 + (uint64_t)i), 900 + (uint64_t)i);
}

/* One round of the workload: 16 blocks of 256 KiB (4 MiB in use, the most
 * the pool ever had), every other one freed, then a 1280 KiB block, which
 * fits no gap between the 256 KiB ones: it needs the segment's tail. */
static void round_trip(ofl_pool_t *pool, uint64_t seed) {
  ofl_tensor_t *b[16];
  for (int i = 0; i < 16; i++)
    b[i] = take(pool, 256 * KIB, seed + (uint64_t)i);
  for (int i = 0; i < 16; i += 2)
    give(pool, b[i], seed + (uint64_t)i);
  ofl_tensor_t *big = take(pool, 1280 * KIB, seed + 100);
  give(pool, big, seed + 100);
  for (int i = 1; i < 16; i += 2)
    give(pool, b[i], seed + (uint64_t)i);
}

Test(pool_learning, a_merge_after_a_growth_is_larger_than_the_segment_that_failed) {
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  pp.name = "learning";
  ofl_pool_t *pool = NULL;
  OK(ofl_pool_create(dev, &pp, &pool));
  /* Two byte sizes: the pool carves from segments. */
  give(pool, take(pool, 256 * KIB, 1), 1);
  give(pool, take(pool, 512 * KIB, 2), 2);
  /* 4 MiB in use, then merged into one segment for it and its margin. */
  ofl_tensor_t *b[16];
  for (int i = 0; i < 16; i++)
    b[i] = take(pool, 256 * KIB, 10 + (uint64_t)i);
  for (int i = 0; i < 16; i++)
    give(pool, b[i], 10 + (uint64_t)i);
  idle_points(pool);
  idle_points(pool);
  ofl_pool_stats_t s0;
  ofl_pool_get_stats(pool, &s0);
  cr_assert(eq(u64, s0.segments, 1));
  cr_assert(lt(sz, s0.segment_bytes, 4 * MIB + 1280 * KIB),
            "merged into %zu bytes", s0.segment_bytes);

  /* The first round does not fit the merged segment: it grows, and the
   * merge that follows makes a larger segment. */
  round_trip(pool, 1000);
  idle_points(pool);
  idle_points(pool);
  ofl_pool_stats_t s1;
  ofl_pool_get_stats(pool, &s1);
  cr_assert(gt(u64, s1.backend_allocs, s0.backend_allocs));
  cr_assert(eq(u64, s1.segments, 1));
  cr_assert(ge(sz, s1.segment_bytes, s0.segment_bytes + 1280 * KIB),
            "merged again into %zu bytes after %zu proved too small",
            s1.segment_bytes, s0.segment_bytes);
  cr_assert(eq(sz, s1.peak_in_use_bytes, s0.peak_in_use_bytes));

  /* Every later round fits: no backend call at all. */
  for (int r = 0; r < 8; r++) {
    round_trip(pool, 2000 + (uint64_t)r * 200);
    idle_points(pool);
    idle_points(pool);
  }
  ofl_pool_stats_t s2;
  ofl_pool_get_stats(pool, &s2);
  cr_assert(eq(u64, s2.backend_allocs, s1.backend_allocs),
            "%llu backend allocations in 8 rounds after the pool learned",
            (unsigned long long)(s2.backend_allocs - s1.backend_allocs));
  cr_assert(eq(u64, s2.backend_frees, s1.backend_frees));
  cr_assert(eq(sz, s2.held_bytes, s1.held_bytes));
  ofl_pool_destroy(pool);
}

/* Without a manager no iteration ends: the learning fields stay 0. */
Test(pool_learning, a_pool_on_its_own_reports_no_iterations) {
  ofl_pool_t *pool = NULL;
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  OK(ofl_pool_create(dev, &pp, &pool));
  give(pool, take(pool, 4 * KIB, 3), 3);
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.iterations, 0));
  cr_assert(eq(u64, s.learned_iteration, 0));
  ofl_pool_destroy(pool);
}

/* ---- a fixed-shape workload ---------------------------------------------- */

/* 1F1B, pp 4, rank 0, 8 microbatches, 2 layers, five names whose tensors
 * never change size (1 KiB to 1 MiB, shape-keyed), a 4096-byte threshold,
 * strict mode with or without stream jitter, the application's pool for
 * reloads or the manager's own. A pool that has seen every size it will
 * see does not resize: the manager's pools (its reload pool, its pinned
 * pool) make no backend call from the first iteration after the warmup.
 * The application's pool adds blocks of sizes it has seen in that first
 * iteration, once: the plan that starts there keeps the last group of a
 * name on the device when its chunk is next in backward, so the
 * application holds more of its tensors at once than in the warmup, which
 * offloads every group. From the iteration after it, for 20 iterations,
 * no pool makes a call, nor does the stand-in see a cudaMalloc, a cudaFree
 * or a registration; every popped byte is the one pushed. With the
 * twelve-iteration learning window, the pools resized inside those
 * iterations for peaks a little higher (10 cudaMalloc and 10 cudaFree in
 * 20 iterations). */
#define FIXED_COUNTED 20

static const size_t fixed_bytes[5] = {1 * KIB, 4 * KIB, 16 * KIB, 256 * KIB,
                                      1 * MIB};

/* Backend allocations and frees of pool between a and b. */
static uint64_t calls_between(const ofl_pool_stats_t *a,
                              const ofl_pool_stats_t *b) {
  return b->backend_allocs - a->backend_allocs + b->backend_frees -
         a->backend_frees;
}

static void fixed_shapes_are_steady(int jitter_us, int own_reload_pool) {
  drv_cfg_t c;
  memset(&c, 0, sizeof c);
  c.pp = 4;
  c.rank = 0;
  c.vpp = 1;
  c.mbs = 8;
  c.layers = 2;
  c.names_mask = 0x1f;
  c.tensors_max = 1;
  c.thresh = 4096;
  c.seed = 77;
  c.jitter_us = jitter_us;
  c.offload = 1;
  /* c.dev NULL: a device of its own, with the jitter asked for. */
  c.own_reload_pool = own_reload_pool;
  for (int g = 0; g < 5; g++) {
    c.names[g].set = 1;
    c.names[g].tensors = 1 + g % 2;
    c.names[g].lo = c.names[g].hi = fixed_bytes[g];
  }
  drv_t d;
  cr_assert(eq(int, drv_open(&d, &c), OFL_SUCCESS), "%s", d.msg);
  ofl_pool_t *pools[3];
  int np = 0;
  pools[np++] = d.pool;
  ofl_pool_t *reload = ofl_manager_device_pool(d.m);
  if (reload != d.pool)
    pools[np++] = reload;
  pools[np++] = ofl_manager_host_pool(d.m);
  cr_assert(eq(int, np, own_reload_pool ? 3 : 2));
  ofl_pool_stats_t warm[3], first[3], after[3];
  cr_assert(eq(int, drv_iteration(&d), OFL_SUCCESS), "warmup: %s", d.msg);
  for (int i = 0; i < np; i++)
    ofl_pool_get_stats(pools[i], &warm[i]);
  cr_assert(eq(int, drv_iteration(&d), OFL_SUCCESS), "iteration 1: %s",
            d.msg);
  for (int i = 0; i < np; i++) {
    ofl_pool_get_stats(pools[i], &first[i]);
    if (pools[i] != d.pool) /* the manager's own pools */
      cr_assert(eq(u64, calls_between(&warm[i], &first[i]), 0),
                "pool %s: %llu backend calls in the first iteration after "
                "the warmup",
                ofl_pool_name(pools[i]),
                (unsigned long long)calls_between(&warm[i], &first[i]));
  }
  /* The application's pool: blocks added, none freed, no new size. */
  cr_assert(eq(u64, first[0].backend_frees, warm[0].backend_frees));
  cudasim_stats_t c0, c1;
  int sim = t_sim_stats(&c0);
  for (int it = 0; it < FIXED_COUNTED; it++)
    cr_assert(eq(int, drv_iteration(&d), OFL_SUCCESS), "iteration %d: %s",
              it + 2, d.msg);
  for (int i = 0; i < np; i++) {
    ofl_pool_get_stats(pools[i], &after[i]);
    cr_assert(eq(u64, calls_between(&first[i], &after[i]), 0),
              "pool %s: %llu backend allocations and %llu frees in the %d "
              "iterations from the second after the warmup",
              ofl_pool_name(pools[i]),
              (unsigned long long)(after[i].backend_allocs -
                                   first[i].backend_allocs),
              (unsigned long long)(after[i].backend_frees -
                                   first[i].backend_frees),
              FIXED_COUNTED);
    cr_assert(eq(sz, after[i].held_bytes, first[i].held_bytes));
  }
  if (sim) {
    t_sim_stats(&c1);
    cr_assert(eq(u64, c1.device_mallocs - c0.device_mallocs, 0));
    cr_assert(eq(u64, c1.device_frees - c0.device_frees, 0));
    cr_assert(eq(u64, c1.host_registers - c0.host_registers, 0));
    cr_assert(eq(u64, c1.host_unregisters - c0.host_unregisters, 0));
  }
  /* The manager's pools ended their learning, and their stats say when. */
  for (int i = 0; i < np; i++)
    if (pools[i] != d.pool || !own_reload_pool) {
      cr_assert(gt(u64, after[i].learned_iteration, 0), "pool %s",
                ofl_pool_name(pools[i]));
      cr_assert(le(u64, after[i].learned_iteration, 3), "pool %s",
                ofl_pool_name(pools[i]));
    }
  cr_assert(gt(sz, d.checked_tensors, 0));
  cr_assert(eq(sz, d.wrong_bytes, 0));
  drv_close(&d);
}

Test(pool_learning, fixed_shapes_make_no_call_after_the_warmup_manager_pools) {
  fixed_shapes_are_steady(0, 1);
}

Test(pool_learning,
     fixed_shapes_make_no_call_after_the_warmup_manager_pools_jitter) {
  fixed_shapes_are_steady(40, 1);
}

Test(pool_learning, fixed_shapes_make_no_call_after_the_warmup_app_pool) {
  fixed_shapes_are_steady(0, 0);
}

Test(pool_learning, fixed_shapes_make_no_call_after_the_warmup_app_pool_jitter) {
  fixed_shapes_are_steady(40, 0);
}
