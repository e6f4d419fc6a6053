/* A pool's merged segment learns from the growths it could not avoid: a
 * merge after a growth is never the segment that proved too small, so a
 * workload that fragmented it once fits the next one, and the pool makes
 * no more backend calls however often the workload repeats. Before, the
 * merge was sized for the same most in use again, met the same gaps, and
 * the pool grew and merged (two allocations, two frees) every round while
 * the bytes it held stayed flat. */
#include <criterion/criterion.h>
#include "tests/cr_assert.h"
#include <stdint.h>
#include <stdlib.h>

#include <ofl/ofl.h>
#include "tests/devmem.h"

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
    give(pool, take(pool, 64 * KIB, 900 + (uint64_t)i), 900 + (uint64_t)i);
}

/* One round of the workload: 16 blocks of 64 KiB (1 MiB in use, the most
 * the pool ever had), every other one freed, then a 320 KiB block, which
 * fits no gap between the 64 KiB ones: it needs the segment's tail. */
static void round_trip(ofl_pool_t *pool, uint64_t seed) {
  ofl_tensor_t *b[16];
  for (int i = 0; i < 16; i++)
    b[i] = take(pool, 64 * KIB, seed + (uint64_t)i);
  for (int i = 0; i < 16; i += 2)
    give(pool, b[i], seed + (uint64_t)i);
  ofl_tensor_t *big = take(pool, 320 * KIB, seed + 100);
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
  give(pool, take(pool, 64 * KIB, 1), 1);
  give(pool, take(pool, 128 * KIB, 2), 2);
  /* 1 MiB in use, then merged into one segment for it and its margin. */
  ofl_tensor_t *b[16];
  for (int i = 0; i < 16; i++)
    b[i] = take(pool, 64 * KIB, 10 + (uint64_t)i);
  for (int i = 0; i < 16; i++)
    give(pool, b[i], 10 + (uint64_t)i);
  idle_points(pool);
  idle_points(pool);
  ofl_pool_stats_t s0;
  ofl_pool_get_stats(pool, &s0);
  cr_assert(eq(u64, s0.segments, 1));
  cr_assert(lt(sz, s0.segment_bytes, 1 * MIB + 320 * KIB),
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
  cr_assert(ge(sz, s1.segment_bytes, s0.segment_bytes + 320 * KIB),
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
