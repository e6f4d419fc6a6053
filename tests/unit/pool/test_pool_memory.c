/* Where a pool's memory comes from: segments registered once and shared by
 * changing sizes (the MoE workload makes no backend call in steady state,
 * and holds at most 1.3 x its peak in use), coalescing of freed ranges,
 * segments merged into one once the pool stops growing, and the
 * out-of-memory retry: a device that runs out while pools cache blocks
 * of other sizes serves the request after they are released, in the pool,
 * across the device's pools, and in the manager's reload. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"
#include "pool/pool_internal.h"
#include "tests/support/driver.h"
#include "tests/support/fixture.h"

#define KIB ((size_t)1024)
#define MIB ((size_t)1 << 20)
#define CAPACITY (8 * MIB)

static ofl_device_t *dev;

/* A small device: the host backend's capacity, the stand-in's memory. */
static void open_dev(void) {
  setenv("CUDASIM_DEVICE_MEMORY", "8M", 1);
  ofl_device_params_t p = t_device_params(20, 3);
  p.device_capacity_bytes = CAPACITY;
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(pool_memory, .init = open_dev, .fini = close_dev);

static ofl_pool_t *make_pool(ofl_pool_kind_t kind, ofl_pool_segments_t seg,
                             const char *name) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.kind = kind;
  p.budget_bytes = 0;
  p.segments = seg;
  p.name = name;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_SUCCESS), "%s",
            ofl_last_error());
  return pool;
}

static ofl_pool_stats_t stats_of(const ofl_pool_t *pool) {
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  return s;
}

static ofl_tensor_t *alloc_bytes(ofl_pool_t *pool, size_t n, int dynamic) {
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL;
  ofl_status_t s =
      dynamic ? ofl_pool_alloc_dynamic(pool, shape, 1, OFL_DTYPE_U8, NULL, &t)
              : ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t);
  cr_assert(eq(int, s, OFL_SUCCESS), "%zu bytes: %s", n, ofl_last_error());
  return t;
}

/* Pinned blocks of a hundred sizes come from a few registrations, never
 * one per tensor, and hold their bytes (checked by the CPU). */
Test(pool_memory, pinned_blocks_of_many_sizes_share_a_few_registrations) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_ALL, "pin");
  ofl_device_stats_t d0;
  ofl_device_get_stats(dev, &d0);
  cudasim_stats_t c0, c1;
  int sim = t_sim_stats(&c0);
  ofl_tensor_t *t[100];
  for (int i = 0; i < 100; i++) {
    t[i] = alloc_bytes(pool, 1000 + (size_t)i * 797, i % 2);
    t_pattern(ofl_tensor_data(t[i]), ofl_tensor_bytes(t[i]), (uint64_t)i);
  }
  for (int i = 0; i < 100; i++) {
    cr_assert(eq(sz,
                 t_pattern_wrong(ofl_tensor_data(t[i]), ofl_tensor_bytes(t[i]),
                                 (uint64_t)i),
                 0));
    cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
  }
  ofl_device_stats_t d1;
  ofl_device_get_stats(dev, &d1);
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(le(u64, d1.pinned_allocs - d0.pinned_allocs, 3));
  cr_assert(eq(u64, s.segments, d1.pinned_allocs - d0.pinned_allocs));
  cr_assert(ge(sz, s.held_bytes, s.total_bytes));
  if (sim) {
    t_sim_stats(&c1);
    cr_assert(eq(u64, c1.host_registers - c0.host_registers, s.segments));
  }
  ofl_pool_destroy(pool);
}

/* Freed neighbours merge: two freed 1 MiB blocks serve a 2 MiB block of a
 * new size without a backend call. */
Test(pool_memory, freed_ranges_coalesce_for_a_larger_size) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  ofl_tensor_t *a = alloc_bytes(pool, MIB, 1);
  ofl_tensor_t *b = alloc_bytes(pool, MIB, 1);
  uint64_t allocs = stats_of(pool).backend_allocs;
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  ofl_tensor_t *c = alloc_bytes(pool, 2 * MIB - 4 * KIB, 1);
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(c), 2 * MIB - 4 * KIB, 9),
               OFL_SUCCESS));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(c), 2 * MIB - 4 * KIB, 9), 0));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.backend_allocs, allocs));
  cr_assert(eq(u64, s.releases, 2));
  cr_assert(eq(int, ofl_pool_free(pool, c), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

/* The pattern of seed written into all of t, and t's bytes that differ
 * from it (tests/support/devmem.h: by the CPU in pinned memory, by copies
 * in device memory). */
static void fill_any(ofl_tensor_t *t, uint64_t seed) {
  cr_assert(eq(int, t_tensor_fill(dev, t, ofl_tensor_bytes(t), seed),
               OFL_SUCCESS));
}

static size_t wrong_any(const ofl_tensor_t *t, uint64_t seed) {
  return t_tensor_wrong(dev, t, ofl_tensor_bytes(t), seed);
}

/* A small block keeps out of the large ones' way: it is carved from the
 * top of the highest free range, so the ranges two freed neighbours leave
 * merge into one. Five blocks fill a 2 MiB segment (512 KiB, 16 KiB,
 * 512 KiB, 512 KiB, 496 KiB, in that order); the first and third freed,
 * a 1 MiB block fits without a backend call, and every block holds its
 * bytes. Best fit put the 16 KiB block between the first two, whose
 * ranges then stayed apart (two of 512 KiB), and the pool grew: an
 * application's device pool, and the manager's pinned pool (16 KB blocks
 * between blocks of 264-300 KB, none of six holes of 216-276 KB fitting
 * 280 KB), after learning. */
static void small_blocks_leave_room(ofl_pool_kind_t kind) {
  ofl_pool_t *pool = make_pool(kind, OFL_POOL_SEGMENTS_ALL, "small");
  static const size_t n[5] = {512 * KIB, 16 * KIB, 512 * KIB, 512 * KIB,
                              496 * KIB};
  ofl_tensor_t *t[5];
  for (int i = 0; i < 5; i++) {
    t[i] = alloc_bytes(pool, n[i], 1);
    fill_any(t[i], 50 + (uint64_t)i);
  }
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.segments, 1));
  cr_assert(eq(sz, s0.segment_bytes, 2 * MIB));
  cr_assert(eq(int, ofl_pool_free(pool, t[0]), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, t[2]), OFL_SUCCESS));
  ofl_tensor_t *e = alloc_bytes(pool, MIB, 1);
  fill_any(e, 60);
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.backend_allocs, s0.backend_allocs),
            "the pool grew for a 1 MiB block with 1 MiB free");
  cr_assert(eq(u64, s1.segments, 1));
  cr_assert(eq(sz, wrong_any(e, 60), 0));
  static const int kept[3] = {1, 3, 4};
  for (int j = 0; j < 3; j++) {
    int i = kept[j];
    cr_assert(eq(sz, wrong_any(t[i], 50 + (uint64_t)i), 0));
    cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
  }
  cr_assert(eq(int, ofl_pool_free(pool, e), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

Test(pool_memory, small_blocks_leave_the_large_ones_room_whole) {
  small_blocks_leave_room(OFL_POOL_DEVICE);
}

Test(pool_memory, small_pinned_blocks_leave_the_large_ones_room_whole) {
  small_blocks_leave_room(OFL_POOL_PINNED);
}

/* Blocks of comparable sizes keep best fit: a 4 KiB block beside 20 KiB
 * ones is not small (an eighth of the largest or less), so it takes the
 * smallest hole that fits (8 KiB, at the segment's bottom) rather than the
 * top of a 20 KiB hole, and the next 20 KiB block fits there without a
 * backend call. Taken for small (a quarter), 4 KiB blocks split the 12-16
 * KiB holes of the manager's pinned pool under a tight budget, which then
 * refused blocks after learning (pool property test, seed 7, draw 127).
 * The segment: two 8 KiB blocks, 101 of 20 KiB, one of 12 KiB (2 MiB). */
#define COMPARABLE_N 101
static void comparable_sizes_fill_holes(ofl_pool_kind_t kind) {
  ofl_pool_t *pool = make_pool(kind, OFL_POOL_SEGMENTS_ALL, "comparable");
  ofl_tensor_t *eight[2], *t[COMPARABLE_N];
  for (int i = 0; i < 2; i++) {
    eight[i] = alloc_bytes(pool, 8 * KIB, 1);
    fill_any(eight[i], 70 + (uint64_t)i);
  }
  for (int i = 0; i < COMPARABLE_N; i++) {
    t[i] = alloc_bytes(pool, 20 * KIB, 1);
    fill_any(t[i], 100 + (uint64_t)i);
  }
  ofl_tensor_t *last = alloc_bytes(pool, 12 * KIB, 1);
  fill_any(last, 80);
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.segments, 1));
  cr_assert(eq(sz, s0.segment_bytes, 2 * MIB));
  const int high = COMPARABLE_N - 2; /* a 20 KiB hole near the top */
  cr_assert(eq(int, ofl_pool_free(pool, eight[0]), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, t[high]), OFL_SUCCESS));
  /* A new size: the cached blocks give their ranges back first. */
  ofl_tensor_t *a = alloc_bytes(pool, 4 * KIB, 1);
  fill_any(a, 90);
  ofl_tensor_t *b = alloc_bytes(pool, 20 * KIB, 1);
  fill_any(b, 91);
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.backend_allocs, s0.backend_allocs),
            "the pool grew for a 20 KiB block with a 20 KiB hole");
  cr_assert(eq(sz, wrong_any(a, 90), 0));
  cr_assert(eq(sz, wrong_any(b, 91), 0));
  cr_assert(eq(sz, wrong_any(eight[1], 71), 0));
  cr_assert(eq(sz, wrong_any(last, 80), 0));
  for (int i = 0; i < COMPARABLE_N; i++)
    if (i != high) {
      cr_assert(eq(sz, wrong_any(t[i], 100 + (uint64_t)i), 0));
      cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
    }
  cr_assert(eq(int, ofl_pool_free(pool, eight[1]), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, last), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

Test(pool_memory, blocks_of_comparable_sizes_fill_holes_best_fit) {
  comparable_sizes_fill_holes(OFL_POOL_DEVICE);
}

Test(pool_memory, pinned_blocks_of_comparable_sizes_fill_holes_best_fit) {
  comparable_sizes_fill_holes(OFL_POOL_PINNED);
}

/* The device runs out while the pool caches blocks of another size: the
 * pool releases them and the request succeeds (one backend call per block:
 * the cached blocks are memory of their own). */
Test(pool_memory, out_of_memory_releases_the_pools_cache_and_retries) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_OFF, "dev");
  ofl_tensor_t *t[6];
  for (int i = 0; i < 6; i++)
    t[i] = alloc_bytes(pool, MIB + 4 * KIB, 0);
  for (int i = 0; i < 6; i++)
    cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
  ofl_tensor_t *big = alloc_bytes(pool, 3 * MIB, 0);
  cr_assert(
      eq(int, t_fill(dev, ofl_tensor_data(big), 3 * MIB, 4), OFL_SUCCESS));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(big), 3 * MIB, 4), 0));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.oom_retries, 1));
  cr_assert(eq(u64, s.releases, 6));
  cr_assert(eq(u64, s.blocks_total, 1));
  cr_assert(eq(sz, s.held_bytes, 3 * MIB));
  cr_assert(eq(int, ofl_pool_free(pool, big), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

/* The same across pools: another pool of the device caches segments; a
 * pool that runs out releases them and gets its block. */
Test(pool_memory, out_of_memory_releases_the_cache_of_the_devices_pools) {
  ofl_pool_t *other = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "a");
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_OFF, "b");
  ofl_tensor_t *t[6];
  for (int i = 0; i < 6; i++)
    t[i] = alloc_bytes(other, MIB, 1);
  for (int i = 0; i < 6; i++)
    cr_assert(eq(int, ofl_pool_free(other, t[i]), OFL_SUCCESS));
  cr_assert(ge(sz, stats_of(other).held_bytes, 6 * MIB));
  ofl_tensor_t *big = alloc_bytes(pool, 4 * MIB, 0);
  cr_assert(eq(u64, stats_of(pool).oom_retries, 1));
  ofl_pool_stats_t o = stats_of(other);
  cr_assert(eq(u64, o.releases, 6));
  cr_assert(eq(sz, o.held_bytes, 0));
  cr_assert(eq(u64, o.segments, 0));
  cr_assert(eq(int, ofl_pool_free(pool, big), OFL_SUCCESS));
  ofl_pool_destroy(pool);
  ofl_pool_destroy(other);
}

/* Still too large after the release: OFL_ERR_NO_MEMORY, nothing changed,
 * and the message gives the request and each pool's figures. */
Test(pool_memory, out_of_memory_message_gives_request_and_pool_figures) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_OFF, "acts");
  ofl_tensor_t *held = alloc_bytes(pool, 5 * MIB, 0);
  int64_t shape[1] = {(int64_t)(4 * MIB)};
  ofl_tensor_t *x = (ofl_tensor_t *)0x1;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &x),
               OFL_ERR_NO_MEMORY));
  cr_assert(eq(ptr, x, (ofl_tensor_t *)0x1));
  const char *m = ofl_last_error();
  cr_assert(ne(ptr, strstr(m, "4194304 bytes requested"), NULL), "%s", m);
  cr_assert(ne(ptr,
               strstr(m, "pool acts (device) held 5242880 in use "
                         "5242880 cached 0"),
               NULL),
            "%s", m);
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.blocks_total, 1));
  cr_assert(eq(int, ofl_pool_free(pool, held), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

/* The manager's reload takes the same retry: the reload pool caches blocks
 * of another size that fill the device; the pop still gets its bytes. */
Test(pool_memory, reload_succeeds_after_releasing_cached_blocks) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_OFF, "app");
  ofl_manager_params_t mp = t_env_manager_params(dev, pool);
  ofl_manager_t *m = NULL;
  cr_assert(eq(int, ofl_manager_create(&mp, &m), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_tensor_t *t = alloc_bytes(pool, 2 * MIB, 0);
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(t), 2 * MIB, 21), OFL_SUCCESS));
  ofl_tag_t tag;
  cr_assert(eq(int, ofl_manager_chunk_begin(m, 1, 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_start(m, "mlp_norm"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_tensor_push(m, t, &tag), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_commit(m, "mlp_norm", NULL, 0, 0),
               OFL_SUCCESS));
  cr_assert(eq(int,
               ofl_stream_synchronize(ofl_device_compute_stream(dev),
                                      OFL_TIMEOUT_DEFAULT),
               OFL_SUCCESS));
  /* The offload released t's block to the pool's cache. Six blocks of
   * another size fill the device (the sixth after t's cached block is
   * released) and go back to the cache: the reload finds no free memory. */
  ofl_tensor_t *f[6];
  for (int i = 0; i < 6; i++)
    f[i] = alloc_bytes(pool, MIB + 8 * KIB, 0);
  cr_assert(eq(u64, stats_of(pool).oom_retries, 1));
  for (int i = 0; i < 6; i++)
    cr_assert(eq(int, ofl_pool_free(pool, f[i]), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_manager_group_backward_begin(m, "mlp_norm"), OFL_SUCCESS),
      "%s", ofl_last_error());
  ofl_tensor_t *back = NULL;
  cr_assert(eq(int, ofl_manager_tensor_pop(m, tag, &back), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(back), 2 * MIB, 21), 0));
  cr_assert(eq(u64, stats_of(pool).oom_retries, 2));
  cr_assert(eq(int, ofl_tensor_destroy(back), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_manager_group_backward_end(m, "mlp_norm"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_reset(m), OFL_SUCCESS), "%s", ofl_last_error());
  ofl_manager_destroy(m);
  ofl_pool_destroy(pool);
}

/* ---- merging segments ---------------------------------------------------- */

/* Two blocks of new sizes, each too large for the other's segment: the
 * device pool grows by two segments. */
static void grow_two_segments(ofl_pool_t *pool, ofl_tensor_t **a,
                              ofl_tensor_t **b) {
  *a = alloc_bytes(pool, 1536 * KIB, 1);
  *b = alloc_bytes(pool, 1540 * KIB, 1);
  cr_assert(
      eq(int, t_fill(dev, ofl_tensor_data(*a), 1536 * KIB, 1), OFL_SUCCESS));
  cr_assert(
      eq(int, t_fill(dev, ofl_tensor_data(*b), 1540 * KIB, 2), OFL_SUCCESS));
  cr_assert(eq(u64, stats_of(pool).segments, 2));
}

/* grow_two_segments, then both blocks freed; returns their bytes (the most
 * in use). */
static size_t grow_two_and_free(ofl_pool_t *pool) {
  ofl_tensor_t *a, *b;
  grow_two_segments(pool, &a, &b);
  size_t most = ofl_tensor_bytes(a) + ofl_tensor_bytes(b);
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  return most;
}

/* A block of n bytes allocated, written, read back and freed: one idle
 * point, no growth. */
static void cycle_of(ofl_pool_t *pool, size_t n, uint64_t seed) {
  ofl_tensor_t *c = alloc_bytes(pool, n, 1);
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(c), n, seed), OFL_SUCCESS));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(c), n, seed), 0));
  cr_assert(eq(int, ofl_pool_free(pool, c), OFL_SUCCESS));
}

/* The same with a small block of a size seen before: an iteration of
 * these alone teaches the pool nothing. */
static void small_cycle(ofl_pool_t *pool, uint64_t seed) {
  cycle_of(pool, 4 * KIB, seed);
}

/* A small block of a byte size no other call of it used (a new key,
 * pages 300 + i): learning (ofl_pool_stats_t.learned_iteration) ends after
 * an iteration with no new key and no backend call, so an iteration that
 * must leave the pool learning makes one. */
static void new_size_cycle(ofl_pool_t *pool, int i, uint64_t seed) {
  cycle_of(pool, (300 + (size_t)i) * 4 * KIB, seed);
}

/* Between a and b the pool's segments gave way to one (a free each, one
 * allocation) sized for most bytes in use and a margin under a quarter. */
static void assert_merged(const ofl_pool_stats_t *a, const ofl_pool_stats_t *b,
                          size_t most) {
  cr_assert(eq(u64, b->segments, 1));
  cr_assert(eq(u64, b->backend_frees - a->backend_frees, a->segments));
  cr_assert(eq(u64, b->backend_allocs - a->backend_allocs, 1));
  cr_assert(ge(sz, b->held_bytes, most));
  cr_assert(le(sz, b->held_bytes, most + most / 4));
}

/* Between a and b the pool made no backend call and kept its segments. */
static void assert_no_call(const ofl_pool_stats_t *a,
                           const ofl_pool_stats_t *b) {
  cr_assert(eq(u64, b->backend_allocs, a->backend_allocs));
  cr_assert(eq(u64, b->backend_frees, a->backend_frees));
  cr_assert(eq(u64, b->segments, a->segments));
}

/* A device pool whose sizes change grew, then went a whole cycle (from a
 * request that found nothing in use to the next) without growing: at the
 * next such request its two segments give way to one sized for the most
 * bytes it had in use and a margin, and the blocks it hands out hold their
 * bytes. */
Test(pool_memory, idle_pool_merges_its_segments_after_a_cycle_without_growth) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  ofl_tensor_t *a, *b;
  grow_two_segments(pool, &a, &b);
  size_t most = ofl_tensor_bytes(a) + ofl_tensor_bytes(b);
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(a), 1536 * KIB, 1), 0));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(b), 1540 * KIB, 2), 0));
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  small_cycle(pool, 3); /* the cycle that follows the growth */
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.segments, 2));
  small_cycle(pool, 4); /* a whole cycle without growth: merged first */
  ofl_pool_stats_t s1 = stats_of(pool);
  assert_merged(&s0, &s1, most);
  /* Nothing grows again: no more backend calls. */
  for (int i = 0; i < 4; i++)
    small_cycle(pool, 5 + (uint64_t)i);
  ofl_pool_stats_t s2 = stats_of(pool);
  cr_assert(eq(u64, s2.backend_allocs, s1.backend_allocs));
  cr_assert(eq(u64, s2.backend_frees, s1.backend_frees));
  ofl_pool_destroy(pool);
}

/* A peak of bytes (one block, written and read back) that fits the merged
 * segment without a backend call (stats before: b), and the resize at the
 * next idle point: one free, one allocation, a segment sized for it and
 * more than an eighth. Returns the stats after the resize. */
static ofl_pool_stats_t fits_then_resizes(ofl_pool_t *pool, size_t bytes,
                                          uint64_t seed,
                                          const ofl_pool_stats_t *b) {
  ofl_tensor_t *c = alloc_bytes(pool, bytes, 1);
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(c), bytes, seed), OFL_SUCCESS));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(c), bytes, seed), 0));
  ofl_pool_stats_t fit = stats_of(pool);
  cr_assert(eq(u64, fit.backend_allocs, b->backend_allocs)); /* it fit */
  cr_assert(eq(int, ofl_pool_free(pool, c), OFL_SUCCESS));
  small_cycle(pool, seed + 1);
  ofl_pool_stats_t after = stats_of(pool);
  cr_assert(eq(u64, after.backend_frees - fit.backend_frees, 1));
  cr_assert(eq(u64, after.backend_allocs - fit.backend_allocs, 1));
  cr_assert(ge(sz, after.held_bytes, bytes + bytes / 8));
  return after;
}

/* Under an offload manager (which reports each iteration's end,
 * ofl__pool_cycle_end), a pool of a few sizes that grew merges at the
 * iteration's end, and while it learns (here each iteration makes a key:
 * through its twelfth) a peak in use more than a 32nd above the one the
 * merged segment was sized for resizes it at the next idle point, however
 * long after the merge (in the 3rd and in the 12th iteration here); once
 * learning ended, after the twelfth, a peak that fits changes nothing. */
Test(pool_memory, pool_under_a_manager_resizes_through_its_first_iterations) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  size_t most = grow_two_and_free(pool);
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.segments, 2));
  ofl__pool_cycle_end(pool); /* the warmup: it grew, merged at its end */
  ofl_pool_stats_t s2 = stats_of(pool);
  assert_merged(&s1, &s2, most);
  cr_assert(eq(u64, s2.iterations, 1));
  cr_assert(eq(u64, s2.learned_iteration, 0));
  new_size_cycle(pool, 1, 10); /* iteration 2 */
  small_cycle(pool, 11);
  /* In the third iteration (two ended), well after the merge (8 idle
   * points): a peak a tenth higher (a new key) that still fits the merged
   * segment resizes it at the next idle point. */
  ofl__pool_cycle_end(pool);
  for (int i = 0; i < 8; i++)
    small_cycle(pool, 31 + (uint64_t)i);
  size_t big = most + most / 10;
  ofl_pool_stats_t s4 = fits_then_resizes(pool, big, 40, &s2);
  /* In the twelfth (eleven ended), still learning: a peak a tenth higher
   * again resizes. */
  for (int it = 3; it <= 11; it++) {
    ofl__pool_cycle_end(pool);
    new_size_cycle(pool, it, 50 + (uint64_t)it);
  }
  cr_assert(eq(u64, stats_of(pool).learned_iteration, 0));
  size_t big2 = big + big / 10;
  s4 = fits_then_resizes(pool, big2, 45, &s4);
  /* Learning ends after the twelfth at the latest; later (and more than
   * six idle points after the merge), a higher peak that fits changes
   * nothing. */
  for (int it = 12; it <= 13; it++) {
    ofl__pool_cycle_end(pool);
    for (int i = 0; i < 4; i++)
      small_cycle(pool, 50 + (uint64_t)(it * 4 + i));
  }
  cr_assert(eq(u64, stats_of(pool).learned_iteration, 12));
  size_t bigger = big2 + big2 / 16;
  ofl_tensor_t *d = alloc_bytes(pool, bigger, 1);
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(d), bigger, 60), OFL_SUCCESS));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(d), bigger, 60), 0));
  cr_assert(eq(int, ofl_pool_free(pool, d), OFL_SUCCESS));
  for (int i = 0; i < 4; i++)
    small_cycle(pool, 70 + (uint64_t)i);
  ofl_pool_stats_t s5 = stats_of(pool);
  cr_assert(eq(u64, s5.backend_allocs, s4.backend_allocs));
  cr_assert(eq(u64, s5.backend_frees, s4.backend_frees));
  cr_assert(eq(u64, s5.segments, 1));
  ofl_pool_destroy(pool);
}

/* Learning ends early: after the warmup's merge, an iteration of sizes the
 * pool has seen (no new key, no backend call) whose peak did not rise past
 * the iterations' before it ends it. The first iteration after the warmup
 * has none before it, and a pool of changing sizes learns on through it
 * (its peak moves with the sizes drawn and with copy timing: one iteration
 * said nothing of that, and a pool that stopped there grew after learning);
 * so does one whose peak rose. Then a peak a tenth higher that fits the
 * merged segment is not a resize (an allocation and a free inside the
 * steady iterations), in this iteration or any later. */
static ofl_pool_stats_t hold_two(ofl_pool_t *pool, size_t na, size_t nb,
                                 uint64_t seed);

Test(pool_memory, pool_under_a_manager_stops_learning_after_a_quiet_iteration) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  size_t most = grow_two_and_free(pool);
  ofl__pool_cycle_end(pool); /* the warmup: merged at its end */
  cr_assert(eq(u64, stats_of(pool).learned_iteration, 0));
  cycle_of(pool, 1536 * KIB, 10); /* iteration 2: sizes seen before */
  cycle_of(pool, 1540 * KIB, 11);
  ofl__pool_cycle_end(pool);
  cr_assert(eq(u64, stats_of(pool).learned_iteration, 0));
  (void)hold_two(pool, 1536 * KIB, 1536 * KIB, 12); /* iteration 3: rose */
  ofl__pool_cycle_end(pool);
  cr_assert(eq(u64, stats_of(pool).learned_iteration, 0));
  cycle_of(pool, 1536 * KIB, 13); /* iteration 4: quiet, no higher */
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.segments, 1));
  cr_assert(eq(u64, s1.iterations, 4));
  cr_assert(eq(u64, s1.learned_iteration, 4));
  size_t big = most + most / 10;
  for (int it = 5; it <= 7; it++) {
    cycle_of(pool, big, 20 + (uint64_t)it);
    for (int i = 0; i < 8; i++)
      cycle_of(pool, 1536 * KIB, 30 + (uint64_t)(it * 8 + i));
    ofl__pool_cycle_end(pool);
  }
  ofl_pool_stats_t s2 = stats_of(pool);
  assert_no_call(&s1, &s2);
  cr_assert(eq(u64, s2.learned_iteration, 4));
  cr_assert(eq(u64, s2.iterations, 7));
  ofl_pool_destroy(pool);
}

/* Learning does not end in an iteration whose peak rose more than a 32nd
 * past the one the merged segment was sized for, though it made no key and
 * no backend call: the merge's margin is that much smaller, and the pool
 * learns on and resizes at the next idle point. After the warmup (1536 and
 * 1540 KiB held, merged at its end), the second iteration holds them and a
 * 128 KiB block of a size seen before (4% more); the third's first request
 * resizes (one free, one allocation) for it; the fourth, the same as the
 * second, makes no call and ends learning. Before, learning ended after the
 * second, and the pool kept a segment whose margin no longer held a block
 * (a byte-keyed workload grew after learning). */
static void hold_three(ofl_pool_t *pool, uint64_t seed) {
  static const size_t n[3] = {1536 * KIB, 1540 * KIB, 128 * KIB};
  ofl_tensor_t *t[3];
  for (int i = 0; i < 3; i++) {
    t[i] = alloc_bytes(pool, n[i], 1);
    cr_assert(eq(int,
                 t_fill(dev, ofl_tensor_data(t[i]), n[i], seed + (uint64_t)i),
                 OFL_SUCCESS));
  }
  for (int i = 0; i < 3; i++) {
    cr_assert(eq(
        sz, t_wrong(dev, ofl_tensor_data(t[i]), n[i], seed + (uint64_t)i), 0));
    cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
  }
}

Test(pool_memory,
     pool_under_a_manager_learns_on_while_its_peak_outgrows_the_merge) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  cycle_of(pool, 128 * KIB, 5); /* a size the second iteration reuses */
  size_t most = grow_two_and_free(pool);
  ofl__pool_cycle_end(pool); /* the warmup: merged at its end */
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.segments, 1));
  cr_assert(lt(sz, s1.segment_bytes, most + most / 4));
  hold_three(pool, 10); /* iteration 2: no new key, no call, a higher peak */
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s2 = stats_of(pool);
  assert_no_call(&s1, &s2);
  cr_assert(eq(u64, s2.learned_iteration, 0),
            "learning ended after an iteration whose peak outgrew the merge");
  cycle_of(pool, 128 * KIB, 20); /* iteration 3: resized at its first */
  ofl_pool_stats_t s3 = stats_of(pool);
  cr_assert(eq(u64, s3.backend_allocs - s2.backend_allocs, 1));
  cr_assert(eq(u64, s3.backend_frees - s2.backend_frees, 1));
  cr_assert(eq(u64, s3.segments, 1));
  size_t peak = most + 128 * KIB;
  cr_assert(ge(sz, s3.segment_bytes, peak + peak / 16 * 3));
  ofl__pool_cycle_end(pool);
  hold_three(pool, 30); /* iteration 4: as the second */
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s4 = stats_of(pool);
  assert_no_call(&s3, &s4);
  cr_assert(eq(u64, s4.learned_iteration, 4));
  ofl_pool_destroy(pool);
}

/* A device pool under a manager whose sizes keep changing: 70 byte sizes
 * allocated and freed one at a time (more than the 64 of a pool of many
 * sizes). */
static ofl_pool_t *many_sizes_pool(void) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  for (size_t i = 1; i <= 70; i++)
    cr_assert(eq(int, ofl_pool_free(pool, alloc_bytes(pool, i * 4 * KIB, 1)),
                 OFL_SUCCESS));
  return pool;
}

/* Iterations first..last ended, each followed by two small cycles, one of
 * a new size (a pool of many sizes sees new ones in every iteration): no
 * growth, and the pool still learns. */
static void quiet_iterations(ofl_pool_t *pool, int first, int last,
                             uint64_t seed) {
  for (int it = first; it <= last; it++) {
    ofl__pool_cycle_end(pool);
    small_cycle(pool, seed + (uint64_t)it);
    new_size_cycle(pool, it, seed + 100 + (uint64_t)it);
  }
}

/* Two blocks of na and nb bytes held at once, written and read back, then
 * freed; returns the pool's stats while both were held. */
static ofl_pool_stats_t hold_two(ofl_pool_t *pool, size_t na, size_t nb,
                                 uint64_t seed) {
  ofl_tensor_t *a = alloc_bytes(pool, na, 1);
  ofl_tensor_t *b = alloc_bytes(pool, nb, 1);
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(a), na, seed), OFL_SUCCESS));
  cr_assert(
      eq(int, t_fill(dev, ofl_tensor_data(b), nb, seed + 1), OFL_SUCCESS));
  ofl_pool_stats_t held = stats_of(pool);
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(a), na, seed), 0));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(b), nb, seed + 1), 0));
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  return held;
}

/* A device pool whose sizes keep changing (more than 64 byte sizes seen)
 * under a manager merges only once three iterations ended without growth,
 * so that its merged segment is sized for more iterations' peaks. */
Test(pool_memory, pool_of_many_sizes_merges_after_three_quiet_iterations) {
  ofl_pool_t *pool = many_sizes_pool();
  /* Two blocks too large for the first segment's room: it grows. */
  ofl_tensor_t *a = alloc_bytes(pool, 1536 * KIB, 1);
  ofl_tensor_t *b = alloc_bytes(pool, 1540 * KIB, 1);
  cr_assert(ge(u64, stats_of(pool).segments, 2));
  size_t most = ofl_tensor_bytes(a) + ofl_tensor_bytes(b);
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  ofl_pool_stats_t s0 = stats_of(pool);
  quiet_iterations(pool, 1, 2, 80); /* two quiet iterations: no merge */
  ofl_pool_stats_t s1 = stats_of(pool);
  assert_no_call(&s0, &s1);
  cr_assert(eq(u64, s1.learned_iteration, 0));
  ofl__pool_cycle_end(pool); /* the third: merged at the next idle point */
  small_cycle(pool, 100);
  ofl_pool_stats_t s2 = stats_of(pool);
  assert_merged(&s1, &s2, most);
  ofl_pool_destroy(pool);
}

/* A pool of many sizes under a manager that grows after its first twelve
 * iterations keeps the new segment: no merge (an allocation and a free per
 * segment) inside the steady iterations; the same peak then fits without a
 * call. */
Test(pool_memory, pool_of_many_sizes_keeps_a_segment_grown_after_learning) {
  ofl_pool_t *pool = many_sizes_pool();
  for (int it = 1; it <= 12; it++) { /* the learning iterations */
    ofl__pool_cycle_end(pool);
    new_size_cycle(pool, it, 200 + (uint64_t)it);
  }
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.learned_iteration, 12));
  /* Iteration 13: two blocks too large for what it holds: it grows. */
  size_t na = s0.held_bytes, nb = s0.held_bytes / 2 + 4 * KIB;
  ofl_pool_stats_t s1 = hold_two(pool, na, nb, 21);
  cr_assert(gt(u64, s1.backend_allocs, s0.backend_allocs));
  cr_assert(gt(u64, s1.segments, s0.segments));
  quiet_iterations(pool, 14, 20, 300); /* quiet iterations: no merge */
  /* The same peak again: no call. */
  ofl_pool_stats_t s2 = hold_two(pool, na, nb, 23);
  ofl_pool_stats_t s3 = stats_of(pool); /* after the frees */
  assert_no_call(&s1, &s2);
  assert_no_call(&s1, &s3);
  ofl_pool_destroy(pool);
}

/* A device pool under a manager whose learning iterations' peaks spread
 * widely (two byte-keyed blocks of sizes new in every iteration, 1.6 to 2.2
 * MiB at once) keeps room for that spread in its merged segment (twice the
 * peaks' standard deviation above the margin, the margin at most 1 MiB):
 * later iterations that hold 2.7 MiB, within the spread, make no backend
 * call. Before, the segment held the most in use and 3/16 (2.6 MiB), and
 * the pool grew after learning (a byte-keyed soak draw: 2.52 MB learned,
 * 3.21 MB later). */
Test(pool_memory, pool_whose_peaks_spread_keeps_room_for_them_after_learning) {
  static const size_t peak_kib[12] = {2000, 1600, 2040, 1700, 2100, 1800,
                                      2200, 1640, 2060, 1720, 2120, 1900};
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  for (int it = 0; it < 12; it++) { /* the warmup and eleven iterations */
    size_t half = peak_kib[it] / 2 * KIB;
    (void)hold_two(pool, half - 8 * KIB, half + 8 * KIB, 300 + 2 * (size_t)it);
    ofl__pool_cycle_end(pool);
  }
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.learned_iteration, 12));
  cr_assert(eq(u64, s0.segments, 1));
  size_t most = 2200 * KIB;
  cr_assert(le(sz, s0.held_bytes, most + MIB + 64 * KIB));
  for (int it = 0; it < 3; it++) { /* 2.7 MiB at once, new sizes */
    size_t a = 1380 * KIB - 4 * KIB * (size_t)it, b = 2760 * KIB - a;
    (void)hold_two(pool, a, b, 400 + 2 * (size_t)it);
    ofl__pool_cycle_end(pool);
  }
  ofl_pool_stats_t s1 = stats_of(pool);
  assert_no_call(&s0, &s1);
  cr_assert(ge(sz, s1.peak_in_use_bytes, 2760 * KIB));
  ofl_pool_destroy(pool);
}

/* A block of a byte size new to a pinned pool (pages 20 + i), written,
 * checked and freed: an iteration that leaves the pool learning. */
static void pinned_new_size(ofl_pool_t *pool, int i) {
  size_t n = (20 + (size_t)i) * 4 * KIB;
  ofl_tensor_t *t = alloc_bytes(pool, n, 1);
  t_pattern(ofl_tensor_data(t), n, 500 + (uint64_t)i);
  cr_assert(
      eq(sz, t_pattern_wrong(ofl_tensor_data(t), n, 500 + (uint64_t)i), 0));
  cr_assert(eq(int, ofl_pool_free(pool, t), OFL_SUCCESS));
}

/* A pinned pool under a manager: an iteration's end that finds less than
 * a twelfth of its most bytes in use free adds a segment for the room
 * missing (whole 2 MiB) while the pool learns (here each iteration makes a
 * key: through its twelfth; the registration happens between iterations,
 * not in the next one's request); with room, or later, nothing. */
Test(pool_memory, pinned_pool_makes_room_between_its_first_iterations) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_ALL, "pin");
  /* 1.9 MiB of the first 2 MiB segment: under a twelfth free. */
  ofl_tensor_t *a = alloc_bytes(pool, 1900 * KIB, 1);
  t_pattern(ofl_tensor_data(a), 1900 * KIB, 7);
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.segments, 1));
  cr_assert(eq(sz, s0.held_bytes, 2 * MIB));
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.segments, 2));
  cr_assert(eq(u64, s1.backend_allocs - s0.backend_allocs, 1));
  cr_assert(eq(sz, t_pattern_wrong(ofl_tensor_data(a), 1900 * KIB, 7), 0));
  /* Room now: the next ends add nothing, and a peak a tenth higher fits. */
  pinned_new_size(pool, 2);
  ofl__pool_cycle_end(pool);
  cr_assert(eq(u64, stats_of(pool).learned_iteration, 0));
  ofl_tensor_t *b = alloc_bytes(pool, 190 * KIB, 0);
  t_pattern(ofl_tensor_data(b), 190 * KIB, 8);
  cr_assert(eq(sz, t_pattern_wrong(ofl_tensor_data(a), 1900 * KIB, 7), 0));
  cr_assert(eq(sz, t_pattern_wrong(ofl_tensor_data(b), 190 * KIB, 8), 0));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  ofl_pool_stats_t s2 = stats_of(pool);
  cr_assert(eq(u64, s2.backend_allocs, s1.backend_allocs));
  /* At the end of the eleventh iteration, still learning, short of room
   * again: it makes room. */
  for (int it = 3; it <= 10; it++) {
    ofl__pool_cycle_end(pool);
    pinned_new_size(pool, it);
  }
  ofl_tensor_t *c = alloc_bytes(pool, 1900 * KIB, 1);
  t_pattern(ofl_tensor_data(c), 1900 * KIB, 9);
  ofl_pool_stats_t s3 = stats_of(pool);
  cr_assert(
      lt(sz, s3.held_bytes, s3.peak_in_use_bytes + s3.peak_in_use_bytes / 12));
  ofl__pool_cycle_end(pool); /* the eleventh */
  ofl_pool_stats_t s4 = stats_of(pool);
  cr_assert(eq(u64, s4.backend_allocs - s3.backend_allocs, 1));
  cr_assert(
      ge(sz, s4.held_bytes, s4.peak_in_use_bytes + s4.peak_in_use_bytes / 12));
  cr_assert(eq(u64, s4.learned_iteration, 0));
  /* After the twelfth (learning ends there at the latest), a pool short of
   * room is left as it is. */
  pinned_new_size(pool, 12);
  ofl__pool_cycle_end(pool); /* the twelfth */
  cr_assert(eq(u64, stats_of(pool).learned_iteration, 12));
  ofl_tensor_t *more[64];
  int nmore = 0;
  ofl_pool_stats_t s5 = stats_of(pool);
  while (nmore < 64 &&
         s5.held_bytes >= s5.peak_in_use_bytes + s5.peak_in_use_bytes / 12) {
    more[nmore] = alloc_bytes(pool, 64 * KIB, 1);
    t_pattern(ofl_tensor_data(more[nmore]), 64 * KIB, 100 + (uint64_t)nmore);
    nmore++;
    s5 = stats_of(pool);
  }
  cr_assert(
      lt(sz, s5.held_bytes, s5.peak_in_use_bytes + s5.peak_in_use_bytes / 12));
  ofl__pool_cycle_end(pool); /* the thirteenth */
  ofl_pool_stats_t s6 = stats_of(pool);
  cr_assert(eq(u64, s6.backend_allocs, s5.backend_allocs));
  cr_assert(eq(sz, t_pattern_wrong(ofl_tensor_data(c), 1900 * KIB, 9), 0));
  for (int i = 0; i < nmore; i++) {
    cr_assert(eq(
        sz,
        t_pattern_wrong(ofl_tensor_data(more[i]), 64 * KIB, 100 + (uint64_t)i),
        0));
    cr_assert(eq(int, ofl_pool_free(pool, more[i]), OFL_SUCCESS));
  }
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, c), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

/* Holds its stream until *arg is set (10 s at most: a failed assertion
 * leaves it closed, and the stream's destroy waits for it). */
static void gate_fn(void *arg) {
  atomic_int *open = arg;
  for (int i = 0; i < 50000 && !atomic_load(open); i++)
    usleep(200);
}

/* Section 5 rule 2: a merge frees segments, so it waits until the last use
 * of every cached block is known complete. A block freed after work still
 * queued on a stream keeps the segments as they are (no backend call, no
 * wait at the request); once the work ran, the next idle request merges. */
Test(pool_memory, merge_waits_for_the_queued_last_use_of_a_cached_block) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_ALL, "dev");
  ofl_stream_t *st = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "gate", &st), OFL_SUCCESS));
  static atomic_int open; /* outlives the test's frame for gate_fn */
  atomic_store(&open, 0);
  cr_assert(
      eq(int, ofl_stream_launch_host_func(st, gate_fn, &open), OFL_SUCCESS));
  ofl_tensor_t *a, *b;
  grow_two_segments(pool, &a, &b);
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free_after(pool, b, st), OFL_SUCCESS));
  small_cycle(pool, 3);
  ofl_pool_stats_t s0 = stats_of(pool);
  small_cycle(pool, 4); /* due, but b's last use is still queued */
  small_cycle(pool, 5);
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.segments, 2));
  cr_assert(eq(u64, s1.backend_frees, s0.backend_frees));
  cr_assert(eq(u64, s1.backend_allocs, s0.backend_allocs));
  atomic_store(&open, 1);
  cr_assert(
      eq(int, ofl_stream_synchronize(st, OFL_TIMEOUT_DEFAULT), OFL_SUCCESS));
  small_cycle(pool, 6);
  ofl_pool_stats_t s2 = stats_of(pool);
  cr_assert(eq(u64, s2.segments, 1));
  cr_assert(eq(u64, s2.backend_frees - s1.backend_frees, 2));
  ofl_pool_destroy(pool);
  ofl_stream_destroy(st);
}

/* ---- the MoE workload (issue 25) ---------------------------------------- */

/* The tests' 1F1B driver as the issue states it: pp 4, rank 0, 8
 * microbatches, 2 layers, the seven names, expert sizes changing every
 * microbatch from byte-keyed blocks; a warmup and 12 settling iterations,
 * then 20 counted ones. */
enum { MOE_SETTLE = 12, MOE_COUNTED = 20 };

/* Draws of the sizes: the (2024) and others. The pinned side runs
 * 3 and 11, whose counted iterations peak furthest above and below their
 * settling ones on the device side. The device side runs 11, whose merged
 * segment comes closest to 1.3 x the counted peak in use: on draws whose
 * counted peak rises to or above the settling ones, best fit among blocks
 * of up to 1 MiB sometimes needs more room than the merge's margin leaves,
 * and the activation pool still grows on some runs (docs/DESIGN.md section
 * 4). Under the valgrind and sanitizer setups (OFLTEST_SLOW) only 2024
 * runs: the others check figures, which plain runs do. */
static bool moe_seed_skipped(uint64_t seed) {
  const char *slow = getenv("OFLTEST_SLOW");
  return seed != 2024 && slow != NULL && atoi(slow) > 1;
}

static drv_cfg_t moe_cfg(uint64_t seed, int tensors_max, size_t size_hi) {
  drv_cfg_t cfg = {0};
  cfg.pp = 4;
  cfg.rank = 0;
  cfg.vpp = 1;
  cfg.mbs = 8;
  cfg.layers = 2;
  cfg.names_mask = 0x7f;
  cfg.tensors_max = tensors_max;
  cfg.thresh = 1024;
  cfg.size_lo = 1024;
  cfg.size_hi = size_hi;
  cfg.seed = seed;
  cfg.offload = 1;
  cfg.keyed_by_bytes = 1;
  cfg.dev = dev;
  return cfg;
}

/* One iteration, then a wait for the streams: each iteration starts with
 * the previous one's copies done, however loaded the machine, so that the
 * pools see the same idle points (ofl__pool_merge) on every run. */
static void moe_iteration(drv_t *d) {
  cr_assert(eq(int, drv_iteration(d), OFL_SUCCESS), "%s", d->msg);
  ofl_stream_t *s[3] = {ofl_device_compute_stream(dev),
                        ofl_manager_d2h_stream(d->m),
                        ofl_manager_h2d_stream(d->m)};
  for (int i = 0; i < 3; i++)
    cr_assert(eq(int, ofl_stream_synchronize(s[i], OFL_TIMEOUT_DEFAULT),
                 OFL_SUCCESS));
}

/* The pool's figures over the counted iterations: no backend call, at most
 * 1.3 x their peak in use held, and sizes that did change. */
static void check_steady(const char *what, uint64_t seed,
                         const ofl_pool_stats_t *a, const ofl_pool_stats_t *b) {
  cr_assert(eq(u64, b->backend_allocs, a->backend_allocs),
            "seed %llu: %s: %llu backend allocations in the counted "
            "iterations",
            (unsigned long long)seed, what,
            (unsigned long long)(b->backend_allocs - a->backend_allocs));
  cr_assert(eq(u64, b->backend_frees, a->backend_frees),
            "seed %llu: %s: %llu backend frees in the counted iterations",
            (unsigned long long)seed, what,
            (unsigned long long)(b->backend_frees - a->backend_frees));
  cr_assert(gt(u64, b->misses, a->misses)); /* sizes did change */
  double ratio = (double)b->held_bytes / (double)b->peak_in_use_bytes;
  cr_log_info("seed %llu: %s held %zu peak in use %zu ratio %.3f",
              (unsigned long long)seed, what, b->held_bytes,
              b->peak_in_use_bytes, ratio);
  cr_assert(le(dbl, ratio, 1.3), "seed %llu: %s held %zu peak in use %zu",
            (unsigned long long)seed, what, b->held_bytes,
            b->peak_in_use_bytes);
}

/* The pinned side (sizes up to 256 KiB, two tensors a group, on the small
 * device): the counted iterations register, unregister and allocate no
 * pinned memory, the offload pool holds at most 1.3 x its peak in use, and
 * every popped byte is right. */
static void check_moe_pinned(uint64_t seed) {
  if (moe_seed_skipped(seed))
    cr_skip_test("seed %llu: statistics only, checked by plain runs",
                 (unsigned long long)seed);
  drv_cfg_t cfg = moe_cfg(seed, 2, 256 * KIB);
  drv_t d;
  cr_assert(eq(int, drv_open(&d, &cfg), OFL_SUCCESS), "%s", d.msg);
  for (int it = 0; it < 1 + MOE_SETTLE; it++)
    moe_iteration(&d);
  ofl_pool_t *host = ofl_manager_host_pool(d.m);
  ofl_pool_reset_peak(host);
  ofl_pool_stats_t h0 = stats_of(host), h1;
  ofl_device_stats_t d0, d1;
  ofl_device_get_stats(dev, &d0);
  cudasim_stats_t c0, c1;
  int sim = t_sim_stats(&c0);
  for (int it = 0; it < MOE_COUNTED; it++)
    moe_iteration(&d);
  h1 = stats_of(host);
  ofl_device_get_stats(dev, &d1);
  cr_assert(eq(sz, d.wrong_bytes, 0), "seed %llu", (unsigned long long)seed);
  check_steady("offload-host", seed, &h0, &h1);
  cr_assert(eq(u64, d1.pinned_allocs, d0.pinned_allocs));
  cr_assert(eq(u64, d1.pinned_frees, d0.pinned_frees));
  if (sim) {
    t_sim_stats(&c1);
    cr_assert(eq(u64, c1.host_registers, c0.host_registers));
    cr_assert(eq(u64, c1.host_unregisters, c0.host_unregisters));
    cr_assert(eq(u64, c1.host_allocs, c0.host_allocs));
  }
  drv_close(&d);
}

/* Criterion's limit is above meson's (300 s, 20 times that under
 * valgrind), which bounds these tests. */
#define MOE_TIMEOUT 6000

Test(pool_memory, moe_workload_registers_nothing_in_steady_state,
     .timeout = MOE_TIMEOUT) {
  check_moe_pinned(2024);
}
Test(pool_memory, moe_workload_registers_nothing_in_steady_state_seed_3,
     .timeout = MOE_TIMEOUT) {
  check_moe_pinned(3);
}
Test(pool_memory, moe_workload_registers_nothing_in_steady_state_seed_11,
     .timeout = MOE_TIMEOUT) {
  check_moe_pinned(11);
}

/* This workload needs more than CAPACITY: a device of its own. */
static void open_big_dev(void) {
  setenv("CUDASIM_DEVICE_MEMORY", "256M", 1);
  ofl_device_params_t p = t_device_params(0, 3);
  p.device_capacity_bytes = 256 * MIB;
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}

/* The device side (sizes up to 1 MiB, three tensors a group): the counted
 * iterations allocate and free no device memory, both pools hold at most
 * 1.3 x their peak in use, and every popped byte is right. The pools
 * merged their segments during the settling iterations, sized for the
 * most bytes they had in use and a margin (pool/reclaim.c). */
static void check_moe_device(uint64_t seed) {
  if (moe_seed_skipped(seed))
    cr_skip_test("seed %llu: statistics only, checked by plain runs",
                 (unsigned long long)seed);
  drv_cfg_t cfg = moe_cfg(seed, 3, MIB);
  drv_t d;
  cr_assert(eq(int, drv_open(&d, &cfg), OFL_SUCCESS), "%s", d.msg);
  for (int it = 0; it < 1 + MOE_SETTLE; it++)
    moe_iteration(&d);
  ofl_pool_t *host = ofl_manager_host_pool(d.m);
  ofl_pool_reset_peak(d.pool);
  ofl_pool_reset_peak(host);
  ofl_pool_stats_t a0 = stats_of(d.pool), a1, h0 = stats_of(host), h1;
  ofl_device_stats_t d0, d1;
  ofl_device_get_stats(dev, &d0);
  cudasim_stats_t c0, c1;
  int sim = t_sim_stats(&c0);
  for (int it = 0; it < MOE_COUNTED; it++)
    moe_iteration(&d);
  a1 = stats_of(d.pool);
  h1 = stats_of(host);
  ofl_device_get_stats(dev, &d1);
  cr_assert(eq(sz, d.wrong_bytes, 0), "seed %llu", (unsigned long long)seed);
  check_steady("activations", seed, &a0, &a1);
  check_steady("offload-host", seed, &h0, &h1);
  cr_assert(eq(u64, d1.device_allocs, d0.device_allocs));
  cr_assert(eq(u64, d1.device_frees, d0.device_frees));
  cr_assert(eq(u64, d1.pinned_allocs, d0.pinned_allocs));
  cr_assert(eq(u64, d1.pinned_frees, d0.pinned_frees));
  if (sim) {
    t_sim_stats(&c1);
    cr_assert(eq(u64, c1.device_mallocs, c0.device_mallocs));
    cr_assert(eq(u64, c1.device_frees, c0.device_frees));
    cr_assert(eq(u64, c1.host_registers, c0.host_registers));
    cr_assert(eq(u64, c1.host_unregisters, c0.host_unregisters));
  }
  drv_close(&d);
}

Test(pool_moe, moe_workload_allocates_no_device_memory_in_steady_state,
     .init = open_big_dev, .fini = close_dev, .timeout = MOE_TIMEOUT) {
  check_moe_device(2024);
}
Test(pool_moe, moe_workload_allocates_no_device_memory_seed_11,
     .init = open_big_dev, .fini = close_dev, .timeout = MOE_TIMEOUT) {
  check_moe_device(11);
}

/* A pinned pool under a manager whose warmup held more at once than the
 * iterations after it (the warmup offloads every group before the plan
 * keeps some on the device): at the end of the first iteration after the
 * warmup, with nothing in use, its segments give way to one sized for the
 * steady peak and its margin (a free per segment, one registration); the
 * iterations after it make no call, and learning ends. */
Test(pool_memory, pinned_pool_resizes_for_the_steady_iterations) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_ALL, "pin");
  ofl_tensor_t *a = alloc_bytes(pool, 1536 * KIB, 1); /* the warmup: 3 MiB */
  ofl_tensor_t *b = alloc_bytes(pool, 1536 * KIB, 1);
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.segments, 2));
  cr_assert(ge(sz, s0.held_bytes, 4 * MIB));
  pinned_new_size(pool, 236); /* the steady iterations: 1 MiB at once */
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.segments, 1));
  cr_assert(eq(u64, s1.backend_frees - s0.backend_frees, 2));
  cr_assert(eq(u64, s1.backend_allocs - s0.backend_allocs, 1));
  cr_assert(ge(sz, s1.held_bytes, 2 * MIB)); /* 1 MiB and 1 MiB free */
  cr_assert(lt(sz, s1.held_bytes, s0.held_bytes));
  cr_assert(eq(u64, s1.learned_iteration, 0)); /* the resize: a change */
  for (int it = 3; it <= 6; it++) {
    pinned_new_size(pool, 236);
    ofl__pool_cycle_end(pool);
  }
  ofl_pool_stats_t s2 = stats_of(pool);
  assert_no_call(&s1, &s2);
  cr_assert(eq(u64, s2.learned_iteration, 3));
  ofl_pool_destroy(pool);
}

/* n pinned blocks of bytes[i] held at once (byte-keyed where dynamic),
 * each written and read back, then freed. */
static void hold_blocks(ofl_pool_t *pool, int n, const size_t *bytes,
                        int dynamic, uint64_t seed) {
  ofl_tensor_t *t[640];
  cr_assert(le(int, n, 640));
  for (int i = 0; i < n; i++) {
    t[i] = alloc_bytes(pool, bytes[i], dynamic);
    t_pattern(ofl_tensor_data(t[i]), bytes[i], seed + (uint64_t)i);
  }
  for (int i = 0; i < n; i++) {
    uint64_t si = seed + (uint64_t)i;
    cr_assert(eq(sz, t_pattern_wrong(ofl_tensor_data(t[i]), bytes[i], si), 0));
    cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
  }
}

/* k pinned blocks of 1200 KiB held at once (one per 2 MiB segment while
 * the pool grows: the rest of a segment holds no other). */
static void hold_pinned(ofl_pool_t *pool, int k, uint64_t seed) {
  const size_t n[4] = {1200 * KIB, 1200 * KIB, 1200 * KIB, 1200 * KIB};
  cr_assert(le(int, k, 4));
  hold_blocks(pool, k, n, 1, seed);
}

/* A pinned pool under a manager whose warmup fragmented it past the waste
 * bound of the warmup's own peak (four 2 MiB segments for 4.7 MiB at
 * once) resizes at the warmup's end, to one segment for that peak and its
 * margin: the iterations after the warmup, which hold the same blocks,
 * make no call. Before, the resize came at the first iteration's end,
 * inside the iterations a fixed-shape workload must pass without a call
 * (fixed shapes under valgrind, whose slow copies fragmented the warmup:
 * 9 calls in the first iteration after it). */
Test(pool_memory, pinned_pool_fragmented_by_the_warmup_resizes_at_its_end) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_ALL, "pin");
  hold_pinned(pool, 4, 800); /* the warmup */
  ofl_pool_stats_t w = stats_of(pool);
  cr_assert(eq(u64, w.segments, 4));
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.segments, 1));
  cr_assert(eq(u64, s0.backend_frees - w.backend_frees, 4));
  cr_assert(eq(u64, s0.backend_allocs - w.backend_allocs, 1));
  cr_assert(le(sz, s0.held_bytes, 4 * 1200 * KIB / 10 * 13));
  for (int it = 2; it <= 6; it++) {
    hold_pinned(pool, 4, 800 + 4 * (uint64_t)it);
    ofl__pool_cycle_end(pool);
  }
  ofl_pool_stats_t s1 = stats_of(pool);
  assert_no_call(&s0, &s1);
  cr_assert(eq(u64, s1.learned_iteration, 2));
  ofl_pool_destroy(pool);
}

/* The same warmup, then iterations that hold three of the blocks (the plan
 * keeps the fourth on the device): the one segment the warmup's end made
 * for four is past the waste bound of three (5.8 MiB for 3.5), and the
 * first iteration's end resizes it, though it is less than a minimum
 * segment above the one it resizes to. Before, a single segment that close
 * stayed (soak, seed 3: 3.3 MB held for a steady peak of 1.1 MB). */
Test(pool_memory, pinned_pool_resized_at_the_warmups_end_resizes_for_less) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_ALL, "pin");
  hold_pinned(pool, 4, 900); /* the warmup */
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(u64, s0.segments, 1));
  hold_pinned(pool, 3, 910);
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s1 = stats_of(pool);
  size_t most = 3 * 1200 * KIB;
  cr_assert(eq(u64, s1.segments, 1));
  cr_assert(le(sz, s1.held_bytes, most + MIB + 64 * KIB));
  cr_assert(eq(u64, s1.backend_frees - s0.backend_frees, 1));
  cr_assert(eq(u64, s1.backend_allocs - s0.backend_allocs, 1));
  for (int it = 3; it <= 6; it++) {
    hold_pinned(pool, 3, 900 + 4 * (uint64_t)it);
    ofl__pool_cycle_end(pool);
  }
  ofl_pool_stats_t s2 = stats_of(pool);
  assert_no_call(&s1, &s2);
  ofl_pool_destroy(pool);
}

/* The bytes of the i-th of the small pinned blocks: 700-1015 bytes, a
 * tensor under the pool's 4 KiB granule each. */
static size_t small_bytes(int i) { return 700 + (size_t)(i % 64) * 5; }

static void hold_small_pinned(ofl_pool_t *pool, int n, uint64_t seed) {
  size_t bytes[640];
  cr_assert(le(int, n, 640));
  for (int i = 0; i < n; i++)
    bytes[i] = small_bytes(i);
  hold_blocks(pool, n, bytes, 0, seed); /* shape keys */
}

/* A pinned pool of tensors smaller than its granule (whole pages: 640
 * blocks of under 1 KiB take 2.5 MiB of ranges for 550 KB asked) sizes its
 * segment for the ranges its blocks take, not for the bytes asked: sized
 * for those, the segment the resize made at the warmup's end had room for
 * a fifth of them, and the pool grew again (the manager's pinned pool in
 * soak seed 35, draw 438: 2.55 MB asked in 3.37 MB of ranges, a 3.74 MB
 * segment for the 2.63 MB asked at most, a growth after learning). 200
 * iterations: no call after the warmup's end, bytes intact. */
Test(pool_memory, pinned_pool_of_tensors_under_a_page_sizes_for_their_pages) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_ALL, "pin");
  hold_small_pinned(pool, 640, 1000); /* the warmup */
  ofl__pool_cycle_end(pool);
  ofl_pool_stats_t s0 = stats_of(pool);
  for (int it = 1; it <= 200; it++) {
    hold_small_pinned(pool, 640, 1000 + 640 * (uint64_t)it);
    ofl__pool_cycle_end(pool);
  }
  ofl_pool_stats_t s1 = stats_of(pool);
  assert_no_call(&s0, &s1);
  cr_assert(ne(u64, s1.learned_iteration, 0));
  /* The stats give both peaks: the bytes asked, and the pages taken. */
  size_t asked = 0;
  for (int i = 0; i < 640; i++)
    asked += small_bytes(i);
  cr_assert(eq(sz, s1.peak_in_use_bytes, asked));
  cr_assert(eq(sz, s1.peak_taken_bytes, 640 * 4 * KIB));
  ofl_pool_reset_peak(pool);
  ofl_pool_stats_t s2 = stats_of(pool);
  cr_assert(eq(sz, s2.peak_in_use_bytes, 0));
  cr_assert(eq(sz, s2.peak_taken_bytes, 0));
  /* Room for every page, and no more than a resize keeps free (at least
   * OFL__MERGE_SLACK_MIN, whole 64 KiB) above them. */
  cr_assert(ge(sz, s1.held_bytes, 640 * 4 * KIB));
  cr_assert(le(sz, s1.held_bytes, 640 * 4 * KIB + MIB + 64 * KIB));
  ofl_pool_destroy(pool);
}

/* A device pool no manager reports to (an application's pool whose tensors
 * a manager offloads while it reloads into a pool of its own) ends an
 * iteration with each one a manager reports to a device pool of its
 * device, until a manager reports to it itself. */
Test(pool_memory, pool_no_manager_reports_to_follows_the_devices_iterations) {
  ofl_pool_t *reload =
      make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_AUTO, "reload");
  ofl_pool_t *app = make_pool(OFL_POOL_DEVICE, OFL_POOL_SEGMENTS_AUTO, "app");
  ofl_pool_t *pin = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_AUTO, "pin");
  ofl__pool_cycle_end(reload);
  ofl__pool_cycle_end(pin); /* a pinned pool's iterations lead none */
  cr_assert(eq(u64, stats_of(reload).iterations, 1));
  cr_assert(eq(u64, stats_of(app).iterations, 1));
  cr_assert(eq(u64, stats_of(pin).iterations, 1));
  ofl__pool_cycle_end(app); /* reported to: it follows no more */
  ofl__pool_cycle_end(reload);
  cr_assert(eq(u64, stats_of(reload).iterations, 2));
  cr_assert(eq(u64, stats_of(app).iterations, 2));
  ofl_pool_destroy(app); /* a follower goes: the reports go on */
  ofl__pool_cycle_end(reload);
  cr_assert(eq(u64, stats_of(reload).iterations, 3));
  ofl_pool_destroy(pin);
  ofl_pool_destroy(reload);
}

/* A pinned pool that carves every block under a budget (the manager's,
 * with a host budget) places a cycle of requests that repeats exactly at
 * the same addresses in every cycle, and so never refuses in a later cycle
 * what the first one placed. Before, the key caches carried the layout
 * from one cycle into the next (a request took the first cached block of
 * its key, a miss was carved from what the cached blocks left free): the
 * addresses moved in every cycle, and near the budget one layout had no
 * range for a request that fitted in the others (the soak's tight pinned
 * budgets: a 16 KiB cluster refused with 60 KB free in a 320 KiB segment,
 * in pieces of at most 12 KiB). Randomly drawn cycles: sizes of 4 to 20
 * KiB by shape, after each request a drawn number of the live blocks let
 * go, the most recent first (as a backward pops its forward's pushes), at
 * most about half the budget in use; 40 cycles each, without a stream (no
 * copy timing: the layout's drift was the caches' alone). */
enum { CYC_OPS = 48, CYC_N = 40 };
typedef struct {
  size_t bytes[CYC_OPS];
  int frees_after[CYC_OPS]; /* how many live blocks go after request i */
} cycle_t;

static void cycle_draw(uint64_t seed, size_t budget, cycle_t *c) {
  size_t live = 0, live_bytes[CYC_OPS];
  for (int i = 0; i < CYC_OPS; i++) {
    c->bytes[i] = (size_t)(1 + drv_mix(seed * 131 + (uint64_t)i) % 5) * 4 *
                  KIB; /* 4-20 KiB */
    live_bytes[live++] = c->bytes[i];
    size_t in_use = 0;
    for (size_t k = 0; k < live; k++)
      in_use += live_bytes[k];
    int go = (int)(drv_mix(seed * 977 + (uint64_t)i) % 3);
    while (in_use > budget / 2 && go < (int)live)
      go++, in_use -= live_bytes[live - (size_t)go];
    if (go > (int)live)
      go = (int)live;
    c->frees_after[i] = go;
    live -= (size_t)go;
  }
}

/* A pinned pool that carves every block under a budget of budget bytes
 * (the manager's pinned pool with a host budget). */
static ofl_pool_t *budget_pinned_pool(size_t budget, const char *name) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_SEGMENTS_ALL, name);
  cr_assert(eq(int, ofl_pool_set_budget(pool, budget), OFL_SUCCESS), "%s",
            ofl_last_error());
  return pool;
}

/* Runs one cycle; each request's address in addr[]. Frees LIFO. */
static void cycle_run(ofl_pool_t *pool, const cycle_t *c, void **addr) {
  ofl_tensor_t *live[CYC_OPS];
  int n = 0;
  for (int i = 0; i < CYC_OPS; i++) {
    live[n] = alloc_bytes(pool, c->bytes[i], 0);
    addr[i] = ofl_tensor_data(live[n]);
    n++;
    for (int k = 0; k < c->frees_after[i] && n > 0; k++)
      cr_assert(eq(int, ofl_pool_free(pool, live[--n]), OFL_SUCCESS), "%s",
                ofl_last_error());
  }
  while (n > 0)
    cr_assert(eq(int, ofl_pool_free(pool, live[--n]), OFL_SUCCESS), "%s",
              ofl_last_error());
}

/* A host function on a stream that holds it for arg microseconds: the
 * last uses ordered after it end that much later. */
static void hold_stream(void *arg) { usleep((useconds_t)(uintptr_t)arg); }

/* Runs one cycle with the requests on stream req and every free ordered
 * after the work queued on slow (ofl_pool_free_after), which first holds
 * for delay_us: the blocks' last uses end late, as a reload's H2D does
 * under load. Each request's address in addr[]. */
static void cycle_run_late(ofl_pool_t *pool, const cycle_t *c, void **addr,
                           ofl_stream_t *req, ofl_stream_t *slow,
                           unsigned delay_us) {
  cr_assert(eq(int,
               ofl_stream_launch_host_func(slow, hold_stream,
                                           (void *)(uintptr_t)delay_us),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  ofl_tensor_t *live[CYC_OPS];
  int n = 0;
  for (int i = 0; i < CYC_OPS; i++) {
    int64_t shape[1] = {(int64_t)c->bytes[i]};
    cr_assert(
        eq(int,
           ofl_pool_alloc_dynamic(pool, shape, 1, OFL_DTYPE_U8, req, &live[n]),
           OFL_SUCCESS),
        "%s", ofl_last_error());
    addr[i] = ofl_tensor_data(live[n]);
    n++;
    for (int k = 0; k < c->frees_after[i] && n > 0; k++)
      cr_assert(
          eq(int, ofl_pool_free_after(pool, live[--n], slow), OFL_SUCCESS),
          "%s", ofl_last_error());
  }
  while (n > 0)
    cr_assert(eq(int, ofl_pool_free_after(pool, live[--n], slow), OFL_SUCCESS),
              "%s", ofl_last_error());
}

/* The same cycle, its frees ordered after copies that end late in every
 * other cycle (held 2 ms, far longer than a cycle's requests take) and at
 * once in the others: its layout is the first cycle's in every cycle. The
 * pool reuses a key's oldest free block (a stream wait where its last use
 * is queued), waits for the last uses still queued when nothing is in use
 * before it restarts from bare segments, and gives cached ranges back only
 * where a request finds no room, all of them. Before, a block whose last
 * use was late kept its range through the restart, the next request of its
 * key took another block, and a miss took back the idle blocks' ranges
 * alone: the layout followed the copies' pace, and under load an admitted
 * cluster found no room long after the pools learned (soak seed 32, draw
 * 65; seed 31, draw 501). */
Test(pool_memory,
     pinned_pool_under_a_budget_places_a_cycle_alike_whatever_its_copies_pace) {
  const size_t budget = 320 * KIB;
  ofl_stream_t *req = NULL, *slow = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "req", &req), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "slow", &slow), OFL_SUCCESS));
  int moved = 0, cycles = 0;
  for (uint64_t seed = 1; seed <= 6; seed++) {
    ofl_pool_t *pool = budget_pinned_pool(budget, "pin-budget-late");
    cycle_t c;
    cycle_draw(seed, budget, &c);
    void *first[CYC_OPS], *addr[CYC_OPS];
    cycle_run_late(pool, &c, first, req, slow, 0);
    ofl_pool_stats_t s0 = stats_of(pool);
    for (int k = 1; k < 12; k++) {
      cycle_run_late(pool, &c, addr, req, slow, k % 2 ? 2000u : 0u);
      for (int i = 0; i < CYC_OPS; i++)
        moved += addr[i] != first[i];
      cycles++;
    }
    cr_assert(eq(int, ofl_stream_synchronize(slow, OFL_TIMEOUT_DEFAULT),
                 OFL_SUCCESS));
    cr_assert(
        eq(int, ofl_stream_synchronize(req, OFL_TIMEOUT_DEFAULT), OFL_SUCCESS));
    ofl_pool_stats_t s1 = stats_of(pool);
    assert_no_call(&s0, &s1);
    cr_assert(eq(u64, s1.budget_refusals, 0));
    cr_assert(le(sz, s1.held_bytes, budget));
    ofl_pool_destroy(pool);
  }
  cr_assert(eq(int, moved, 0),
            "%d of %d requests placed elsewhere than in the first cycle", moved,
            cycles * CYC_OPS);
  ofl_stream_destroy(slow);
  ofl_stream_destroy(req);
}

Test(pool_memory, pinned_pool_under_a_budget_places_a_repeated_cycle_alike) {
  const size_t budget = 320 * KIB;
  for (uint64_t seed = 1; seed <= 12; seed++) {
    ofl_pool_t *pool = budget_pinned_pool(budget, "pin-budget");
    cycle_t c;
    cycle_draw(seed, budget, &c);
    void *first[CYC_OPS], *addr[CYC_OPS];
    cycle_run(pool, &c, first);
    ofl_pool_stats_t s0 = stats_of(pool);
    int moved = 0;
    for (int k = 1; k < CYC_N; k++) {
      cycle_run(pool, &c, addr);
      for (int i = 0; i < CYC_OPS; i++)
        moved += addr[i] != first[i];
    }
    ofl_pool_stats_t s1 = stats_of(pool);
    cr_assert(eq(int, moved, 0),
              "seed %llu: %d of %d requests placed elsewhere than in the "
              "first cycle",
              (unsigned long long)seed, moved, (CYC_N - 1) * CYC_OPS);
    assert_no_call(&s0, &s1);
    cr_assert(eq(u64, s1.budget_refusals, 0));
    cr_assert(le(sz, s1.held_bytes, budget));
    cr_assert(eq(sz, s1.in_use_bytes, 0));
    ofl_pool_destroy(pool);
  }
}
