/* Tensor pools: exact and byte-size keys, FIFO reuse, hits and misses,
 * ownership checks, reset, clear, budget, reserve, handles. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"

/* On the backend under test (OFLTEST_BACKEND). Pinned blocks are touched by
 * the CPU; device blocks only through copies (fill, wrong_bytes). Tests
 * named host_only_ are about the host backend's strict mode and skip on
 * cuda. */
static ofl_device_t *dev;

static void open_dev(void) {
  ofl_device_params_t p = t_device_params(50, 0);
  p.device_capacity_bytes = (size_t)256 << 20; /* host backend only */
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(pool, .init = open_dev, .fini = close_dev);

static ofl_pool_t *make_pool(ofl_pool_kind_t kind, size_t budget,
                             size_t reserve) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.kind = kind;
  p.budget_bytes = budget;
  p.reserve_bytes = reserve;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_SUCCESS), "%s",
            ofl_last_error());
  return pool;
}

static ofl_pool_stats_t stats_of(const ofl_pool_t *pool) {
  ofl_pool_stats_t s;
  memset(&s, 0, sizeof s);
  ofl_pool_get_stats(pool, &s);
  return s;
}

static ofl_device_stats_t dev_stats(void) {
  ofl_device_stats_t s;
  ofl_device_get_stats(dev, &s);
  return s;
}

/* More than the device can hold: the host backend's 256 MiB capacity set
 * above, twice the memory of a cuda device. */
static int64_t past_capacity(void) {
  ofl_device_stats_t s = dev_stats();
  size_t cap = s.device_capacity_bytes ? s.device_capacity_bytes
                                       : (size_t)256 << 20;
  return (int64_t)(2 * cap);
}

/* Writes the pattern of seed into a tensor: with the CPU in pinned memory,
 * through a copy in device memory. */
static void fill(ofl_tensor_t *t, uint8_t seed) {
  size_t n = ofl_tensor_bytes(t);
  int on_device = ofl_tensor_location(t) == OFL_LOC_DEVICE;
  uint8_t *d = on_device ? malloc(n ? n : 1) : ofl_tensor_data(t);
  cr_assert(not(eq(ptr, d, NULL)));
  for (size_t i = 0; i < n; ++i)
    d[i] = (uint8_t)(seed + i * 13);
  if (on_device) {
    cr_assert(eq(int, t_write(dev, ofl_tensor_data(t), d, n), OFL_SUCCESS),
              "%s", ofl_last_error());
    free(d);
  }
}

/* Bytes of a tensor differing from the pattern of seed (SIZE_MAX when a
 * device tensor could not be read back). */
static size_t wrong_bytes(const ofl_tensor_t *t, uint8_t seed) {
  size_t n = ofl_tensor_bytes(t);
  int on_device = ofl_tensor_location(t) == OFL_LOC_DEVICE;
  uint8_t *h = on_device ? malloc(n ? n : 1) : NULL;
  const uint8_t *d = on_device ? h : ofl_tensor_data(t);
  if (on_device &&
      t_read(dev, h, ofl_tensor_data(t), n) != OFL_SUCCESS) {
    free(h);
    return SIZE_MAX;
  }
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i)
    wrong += d[i] != (uint8_t)(seed + i * 13);
  free(h);
  return wrong;
}

Test(pool, alloc_gives_writable_device_storage_owned_by_the_pool) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[2] = {16, 33};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 2, OFL_DTYPE_BF16, NULL, &t),
               OFL_SUCCESS));
  cr_assert(eq(sz, ofl_tensor_bytes(t), 16 * 33 * 2));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_DEVICE));
  cr_assert(eq(int, ofl_tensor_dtype(t), OFL_DTYPE_BF16));
  cr_assert(eq(i64, ofl_tensor_shape(t)[1], 33));
  cr_assert(eq(ptr, ofl_tensor_pool(t), pool));
  cr_assert(eq(int, ofl_pool_owns(pool, t), 1));
  fill(t, 5);
  cr_assert(eq(sz, wrong_bytes(t, 5), 0));
  cr_assert(eq(int, ofl_pool_location(pool), OFL_LOC_DEVICE));
  cr_assert(eq(str, (char *)ofl_pool_name(pool), "device"));
  cr_assert(eq(int, ofl_pool_free(pool, t), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

Test(pool, pinned_pool_uses_pinned_memory) {
  ofl_device_stats_t before = dev_stats();
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, 0, 0);
  int64_t shape[1] = {1000};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_I64, NULL, &t),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_PINNED));
  ofl_device_stats_t after = dev_stats();
  cr_assert(eq(u64, after.pinned_allocs - before.pinned_allocs, 1));
  cr_assert(eq(u64, after.device_allocs - before.device_allocs, 0));
  cr_assert(
      eq(sz, after.pinned_bytes_in_use - before.pinned_bytes_in_use, 8000));
  fill(t, 9);
  cr_assert(eq(sz, wrong_bytes(t, 9), 0));
  ofl_pool_free(pool, t);
  ofl_pool_destroy(pool);
  cr_assert(
      eq(sz, dev_stats().pinned_bytes_in_use, before.pinned_bytes_in_use));
}

/* Three keys, four tensors each, ten iterations: the first is all misses,
 * the rest all hits, and steady state never reaches the backend. */
Test(pool, warmup_misses_then_steady_state_hits_without_backend_calls) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shapes[3][2] = {{8, 128}, {64, 64}, {3, 7}};
  ofl_dtype_t dtypes[3] = {OFL_DTYPE_F32, OFL_DTYPE_F16, OFL_DTYPE_I8};
  ofl_tensor_t *held[12];
  ofl_device_stats_t warm = {0};
  for (int it = 0; it < 10; ++it) {
    if (it == 1)
      warm = dev_stats();
    for (int i = 0; i < 12; ++i) {
      cr_assert(eq(
          int,
          ofl_pool_alloc(pool, shapes[i % 3], 2, dtypes[i % 3], NULL, &held[i]),
          OFL_SUCCESS));
      fill(held[i], (uint8_t)(it * 12 + i));
    }
    for (int i = 0; i < 12; ++i) {
      cr_assert(eq(sz, wrong_bytes(held[i], (uint8_t)(it * 12 + i)), 0));
      cr_assert(eq(int, ofl_pool_free(pool, held[i]), OFL_SUCCESS));
    }
    ofl_pool_stats_t s = stats_of(pool);
    cr_assert(eq(u64, s.misses, 12));
    cr_assert(eq(u64, s.hits, (uint64_t)it * 12));
    cr_assert(eq(u64, s.requests, (uint64_t)(it + 1) * 12));
    cr_assert(eq(u64, s.blocks_in_use, 0));
  }
  ofl_device_stats_t end = dev_stats();
  cr_assert(eq(u64, end.device_allocs - warm.device_allocs, 0));
  cr_assert(eq(u64, end.device_frees - warm.device_frees, 0));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.backend_allocs, 12));
  cr_assert(eq(u64, s.blocks_total, 12));
  cr_assert(eq(sz, s.total_bytes, 4 * (8 * 128 * 4 + 64 * 64 * 2 + 3 * 7)));
  cr_assert(eq(sz, s.peak_in_use_bytes, s.total_bytes));
  ofl_pool_destroy(pool);
}

Test(pool, free_list_is_fifo_per_key) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, 0, 0);
  int64_t shape[1] = {256};
  ofl_tensor_t *a, *b, *c;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &a),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &b),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &c),
               OFL_SUCCESS));
  void *pa = ofl_tensor_data(a), *pb = ofl_tensor_data(b),
       *pc = ofl_tensor_data(c);
  ofl_pool_free(pool, b);
  ofl_pool_free(pool, c);
  ofl_pool_free(pool, a);
  ofl_tensor_t *x, *y, *z;
  ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &x);
  ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &y);
  ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &z);
  cr_assert(eq(ptr, ofl_tensor_data(x), pb));
  cr_assert(eq(ptr, ofl_tensor_data(y), pc));
  cr_assert(eq(ptr, ofl_tensor_data(z), pa));
  /* Same bytes, different key: not shared. */
  int64_t other[2] = {16, 16};
  ofl_tensor_t *o;
  ofl_pool_alloc(pool, other, 2, OFL_DTYPE_F32, NULL, &o);
  cr_assert(eq(u64, stats_of(pool).misses, 4));
  ofl_pool_destroy(pool);
}

Test(pool, key_status_reports_total_allocated_free_and_utilization) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[3] = {2, 3, 4};
  ofl_tensor_t *t[4];
  for (int i = 0; i < 4; ++i)
    ofl_pool_alloc(pool, shape, 3, OFL_DTYPE_I32, NULL, &t[i]);
  ofl_pool_free(pool, t[0]);
  ofl_pool_key_status_t ks;
  cr_assert(eq(int, ofl_pool_key_status(pool, shape, 3, OFL_DTYPE_I32, &ks),
               OFL_SUCCESS));
  cr_assert(eq(sz, ks.block_bytes, 96));
  cr_assert(eq(u64, ks.total, 4));
  cr_assert(eq(u64, ks.allocated, 3));
  cr_assert(eq(u64, ks.free, 1));
  cr_assert(eq(dbl, ks.utilization, 75.0));
  ofl_pool_key_status_t untouched = ks;
  cr_assert(eq(int, ofl_pool_key_status(pool, shape, 3, OFL_DTYPE_F32, &ks),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(u64, ks.total, untouched.total));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "no key"), NULL));
  ofl_pool_destroy(pool);
}

Test(pool, list_keys_reports_every_key_with_its_status) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t a[2] = {3, 5}, b[1] = {7000};
  ofl_tensor_t *t1, *t2, *t3;
  ofl_pool_alloc(pool, a, 2, OFL_DTYPE_F16, NULL, &t1);
  ofl_pool_alloc(pool, a, 2, OFL_DTYPE_F16, NULL, &t2);
  ofl_pool_alloc_dynamic(pool, b, 1, OFL_DTYPE_U8, NULL, &t3);
  ofl_pool_free(pool, t2);
  size_t n = 0;
  cr_assert(eq(int, ofl_pool_list_keys(pool, NULL, 0, &n), OFL_SUCCESS));
  cr_assert(eq(sz, n, 2));
  ofl_pool_key_info_t info[2];
  cr_assert(eq(int, ofl_pool_list_keys(pool, info, 2, &n), OFL_SUCCESS));
  int seen_exact = 0, seen_dynamic = 0;
  for (int i = 0; i < 2; ++i) {
    if (info[i].dynamic) {
      seen_dynamic = 1;
      cr_assert(eq(sz, info[i].status.block_bytes, 8192));
      cr_assert(eq(u64, info[i].status.allocated, 1));
    } else {
      seen_exact = 1;
      cr_assert(eq(int, info[i].ndim, 2));
      cr_assert(eq(i64, info[i].shape[1], 5));
      cr_assert(eq(int, info[i].dtype, OFL_DTYPE_F16));
      cr_assert(eq(u64, info[i].status.total, 2));
      cr_assert(eq(u64, info[i].status.free, 1));
      cr_assert(eq(dbl, info[i].status.utilization, 50.0));
    }
  }
  cr_assert(seen_exact && seen_dynamic);
  cr_assert(
      eq(int, ofl_pool_list_keys(pool, NULL, 2, &n), OFL_ERR_INVALID_ARG));
  ofl_pool_destroy(pool);
}

Test(pool, foreign_wrapped_and_double_free_are_rejected_and_change_nothing) {
  ofl_pool_t *p1 = make_pool(OFL_POOL_DEVICE, 0, 0);
  ofl_pool_t *p2 = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[1] = {100};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(p1, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  fill(t, 77);
  ofl_pool_stats_t s1 = stats_of(p1), s2 = stats_of(p2);

  cr_assert(eq(int, ofl_pool_free(p2, t), OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "belongs to pool"), NULL));
  ofl_pool_stats_t a1 = stats_of(p1), a2 = stats_of(p2);
  cr_assert(eq(int, memcmp(&s1, &a1, sizeof s1), 0));
  cr_assert(eq(int, memcmp(&s2, &a2, sizeof s2), 0));
  cr_assert(eq(int, ofl_pool_owns(p1, t), 1));
  cr_assert(eq(int, ofl_pool_owns(p2, t), 0));
  cr_assert(eq(sz, wrong_bytes(t, 77), 0)); /* tensor still intact */

  char mem[100];
  ofl_tensor_t *w = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap(mem, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE,
                               NULL, NULL, &w),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(p1, w), OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "external"), NULL));
  a1 = stats_of(p1);
  cr_assert(eq(int, memcmp(&s1, &a1, sizeof s1), 0));
  ofl_tensor_destroy(w);

  cr_assert(eq(int, ofl_pool_free(p1, t), OFL_SUCCESS));
  s1 = stats_of(p1);
  cr_assert(eq(int, ofl_pool_free(p1, t), OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "already freed"), NULL));
  a1 = stats_of(p1);
  cr_assert(eq(int, memcmp(&s1, &a1, sizeof s1), 0));
  ofl_pool_key_status_t ks;
  ofl_pool_key_status(p1, shape, 1, OFL_DTYPE_U8, &ks);
  cr_assert(eq(u64, ks.free, 1)); /* not listed twice */
  ofl_tensor_t *x, *y;
  ofl_pool_alloc(p1, shape, 1, OFL_DTYPE_U8, NULL, &x);
  ofl_pool_alloc(p1, shape, 1, OFL_DTYPE_U8, NULL, &y);
  cr_assert(ne(ptr, ofl_tensor_data(x), ofl_tensor_data(y)));
  cr_assert(eq(int, ofl_pool_free(NULL, x), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pool_free(p1, NULL), OFL_ERR_INVALID_ARG));
  ofl_pool_destroy(p1);
  ofl_pool_destroy(p2);
}

Test(pool, reset_frees_everything_and_keeps_the_memory) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[1] = {4096};
  ofl_tensor_t *t[4];
  void *ptrs[4];
  for (int i = 0; i < 4; ++i) {
    ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &t[i]);
    ptrs[i] = ofl_tensor_data(t[i]);
  }
  ofl_pool_free(pool, t[2]);
  ofl_device_stats_t before = dev_stats();
  cr_assert(eq(int, ofl_pool_reset(pool), OFL_SUCCESS));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.blocks_in_use, 0));
  cr_assert(eq(sz, s.in_use_bytes, 0));
  cr_assert(eq(u64, s.blocks_total, 4));
  cr_assert(eq(sz, s.total_bytes, 4 * 16384));
  cr_assert(eq(u64, s.misses, 4)); /* counters kept */
  ofl_pool_key_status_t ks;
  ofl_pool_key_status(pool, shape, 1, OFL_DTYPE_F32, &ks);
  cr_assert(eq(u64, ks.free, 4));
  cr_assert(eq(u64, ks.allocated, 0));
  /* Handles held across the reset are stale: freeing them is refused. */
  cr_assert(eq(int, ofl_pool_owns(pool, t[0]), 0));
  cr_assert(eq(int, ofl_pool_free(pool, t[0]), OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "stale"), NULL));
  cr_assert(eq(int, ofl_tensor_destroy(t[1]), OFL_SUCCESS));
  /* Reuse in creation order, no backend calls. */
  for (int i = 0; i < 4; ++i) {
    ofl_tensor_t *x;
    cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &x),
                 OFL_SUCCESS));
    cr_assert(eq(ptr, ofl_tensor_data(x), ptrs[i]));
  }
  ofl_device_stats_t after = dev_stats();
  cr_assert(eq(u64, after.device_allocs, before.device_allocs));
  cr_assert(eq(u64, after.device_frees, before.device_frees));
  cr_assert(eq(u64, stats_of(pool).hits, 4));
  ofl_pool_destroy(pool);
}

Test(pool, clear_releases_free_memory_and_keeps_held_blocks) {
  ofl_device_stats_t base = dev_stats();
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[1] = {1 << 16};
  ofl_tensor_t *t[3];
  for (int i = 0; i < 3; ++i)
    ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t[i]);
  fill(t[1], 3);
  ofl_pool_free(pool, t[0]);
  ofl_pool_free(pool, t[2]);
  cr_assert(eq(sz, dev_stats().device_bytes_in_use - base.device_bytes_in_use,
               3u << 16));
  cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
  ofl_device_stats_t after = dev_stats();
  cr_assert(
      eq(sz, after.device_bytes_in_use - base.device_bytes_in_use, 1u << 16));
  cr_assert(eq(u64, after.device_frees - base.device_frees, 2));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.blocks_total, 1));
  cr_assert(eq(sz, s.total_bytes, 1u << 16));
  cr_assert(eq(u64, s.backend_frees, 2));
  cr_assert(eq(sz, wrong_bytes(t[1], 3), 0)); /* held block untouched */
  cr_assert(eq(int, ofl_pool_free(pool, t[1]), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
  cr_assert(eq(sz, dev_stats().device_bytes_in_use, base.device_bytes_in_use));
  ofl_pool_key_status_t ks;
  cr_assert(eq(int, ofl_pool_key_status(pool, shape, 1, OFL_DTYPE_U8, &ks),
               OFL_ERR_INVALID_ARG)); /* key gone with its blocks */
  ofl_tensor_t *x;
  ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &x);
  cr_assert(eq(u64, stats_of(pool).misses, 4));
  ofl_pool_destroy(pool);
  cr_assert(eq(sz, dev_stats().device_bytes_in_use, base.device_bytes_in_use));
}

Test(pool, dynamic_key_rounds_to_the_page_not_a_power_of_two) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, 0, 0);
  int64_t s1[1] = {5000};     /* f32: 20000 bytes -> 20480 */
  int64_t s2[2] = {100, 100}; /* bf16: 20000 bytes -> 20480 */
  int64_t s3[1] = {20481};    /* u8: 20481 bytes -> 24576 */
  ofl_tensor_t *a, *b, *c;
  cr_assert(eq(int,
               ofl_pool_alloc_dynamic(pool, s1, 1, OFL_DTYPE_F32, NULL, &a),
               OFL_SUCCESS));
  cr_assert(eq(sz, ofl_tensor_bytes(a), 20000));
  cr_assert(eq(sz, ofl_tensor_storage_bytes(a), 20480));
  void *pa = ofl_tensor_data(a);
  ofl_pool_free(pool, a);
  cr_assert(eq(int,
               ofl_pool_alloc_dynamic(pool, s2, 2, OFL_DTYPE_BF16, NULL, &b),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(b), pa)); /* shared by byte size */
  cr_assert(eq(int, ofl_tensor_dtype(b), OFL_DTYPE_BF16));
  cr_assert(eq(i64, ofl_tensor_shape(b)[1], 100));
  cr_assert(eq(int, ofl_pool_alloc_dynamic(pool, s3, 1, OFL_DTYPE_U8, NULL, &c),
               OFL_SUCCESS));
  cr_assert(eq(sz, ofl_tensor_storage_bytes(c), 24576));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.hits, 1));
  cr_assert(eq(u64, s.misses, 2));
  cr_assert(eq(sz, s.total_bytes, 20480 + 24576));
  ofl_pool_key_status_t ks;
  cr_assert(
      eq(int, ofl_pool_dynamic_key_status(pool, 20000, &ks), OFL_SUCCESS));
  cr_assert(eq(sz, ks.block_bytes, 20480));
  cr_assert(eq(u64, ks.total, 1));
  cr_assert(eq(u64, ks.allocated, 1));
  fill(c, 1);
  cr_assert(eq(sz, wrong_bytes(c, 1), 0));
  ofl_pool_destroy(pool);
}

Test(pool, budget_exhaustion_returns_no_memory_and_changes_nothing) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, 3 * 4096, 0);
  int64_t shape[1] = {1024};
  ofl_tensor_t *t[3];
  for (int i = 0; i < 3; ++i)
    cr_assert(eq(int,
                 ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &t[i]),
                 OFL_SUCCESS));
  ofl_device_stats_t d0 = dev_stats();
  ofl_pool_stats_t s0 = stats_of(pool);
  ofl_tensor_t *x = (ofl_tensor_t *)0x1;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &x),
               OFL_ERR_NO_MEMORY));
  cr_assert(eq(ptr, x, (ofl_tensor_t *)0x1)); /* output untouched */
  cr_assert(ne(ptr, strstr(ofl_last_error(), "budget"), NULL));
  int64_t small[1] = {1};
  cr_assert(eq(int, ofl_pool_alloc(pool, small, 1, OFL_DTYPE_U8, NULL, &x),
               OFL_ERR_NO_MEMORY));
  ofl_pool_stats_t s1 = stats_of(pool);
  ofl_device_stats_t d1 = dev_stats();
  cr_assert(eq(sz, s1.total_bytes, s0.total_bytes));
  cr_assert(eq(u64, s1.blocks_total, s0.blocks_total));
  cr_assert(eq(u64, s1.blocks_in_use, 3));
  cr_assert(eq(u64, s1.budget_refusals, 2));
  cr_assert(eq(u64, d1.pinned_allocs, d0.pinned_allocs));
  /* A freed block of the key is still served. */
  ofl_pool_free(pool, t[1]);
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &x),
               OFL_SUCCESS));
  /* Raising the budget lets new blocks in. */
  cr_assert(eq(int, ofl_pool_set_budget(pool, 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc(pool, small, 1, OFL_DTYPE_U8, NULL, &x),
               OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

Test(pool, full_budget_releases_free_blocks_of_other_keys_to_make_room) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, 3 * 4096, 0);
  int64_t one[1] = {4096}, two[1] = {8192}, three[1] = {12288};
  ofl_tensor_t *a, *b, *c;
  cr_assert(eq(int,
               ofl_pool_alloc_dynamic(pool, one, 1, OFL_DTYPE_U8, NULL, &a),
               OFL_SUCCESS));
  cr_assert(eq(int,
               ofl_pool_alloc_dynamic(pool, two, 1, OFL_DTYPE_U8, NULL, &b),
               OFL_SUCCESS));
  ofl_pool_free(pool, a);
  /* 4096 free + 8192 held: a 12288-byte block cannot fit even by evicting. */
  ofl_pool_stats_t s0 = stats_of(pool);
  cr_assert(eq(int,
               ofl_pool_alloc_dynamic(pool, three, 1, OFL_DTYPE_U8, NULL, &c),
               OFL_ERR_NO_MEMORY));
  ofl_pool_stats_t s1 = stats_of(pool);
  cr_assert(eq(u64, s1.evictions, 0));
  cr_assert(eq(u64, s1.blocks_total, s0.blocks_total));
  ofl_pool_free(pool, b);
  ofl_device_stats_t d0 = dev_stats();
  cr_assert(eq(int,
               ofl_pool_alloc_dynamic(pool, three, 1, OFL_DTYPE_U8, NULL, &c),
               OFL_SUCCESS));
  fill(c, 6);
  cr_assert(eq(sz, wrong_bytes(c, 6), 0));
  ofl_device_stats_t d1 = dev_stats();
  ofl_pool_stats_t s2 = stats_of(pool);
  cr_assert(eq(u64, s2.evictions, 2));
  cr_assert(eq(u64, s2.blocks_total, 1));
  cr_assert(eq(sz, s2.total_bytes, 12288));
  cr_assert(eq(u64, d1.pinned_frees - d0.pinned_frees, 2));
  /* 12288 bytes released, 12288 allocated. */
  cr_assert(eq(sz, d1.pinned_bytes_in_use, d0.pinned_bytes_in_use));
  ofl_pool_key_status_t ks;
  cr_assert(eq(int, ofl_pool_dynamic_key_status(pool, 4096, &ks), OFL_SUCCESS));
  cr_assert(eq(u64, ks.total, 0));
  ofl_pool_destroy(pool);
}

Test(pool, eviction_can_be_turned_off) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.kind = OFL_POOL_PINNED;
  p.budget_bytes = 8192;
  p.evict = 0;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_SUCCESS));
  int64_t one[1] = {8192}, other[1] = {100};
  ofl_tensor_t *a, *b;
  cr_assert(eq(int, ofl_pool_alloc(pool, one, 1, OFL_DTYPE_U8, NULL, &a),
               OFL_SUCCESS));
  ofl_pool_free(pool, a);
  cr_assert(eq(int, ofl_pool_alloc(pool, other, 1, OFL_DTYPE_U8, NULL, &b),
               OFL_ERR_NO_MEMORY));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.evictions, 0));
  cr_assert(eq(u64, s.blocks_total, 1));
  ofl_pool_destroy(pool);
}

Test(pool, budget_comes_from_the_environment_when_asked) {
  setenv("OFL_HOST_BUDGET", "8K", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, OFL_POOL_BUDGET_FROM_ENV, 0);
  cr_assert(eq(sz, stats_of(pool).budget_bytes, 8192));
  int64_t shape[1] = {8192};
  ofl_tensor_t *a, *b;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &a),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &b),
               OFL_ERR_NO_MEMORY));
  ofl_pool_destroy(pool);
  ofl_pool_t *dp = make_pool(OFL_POOL_DEVICE, OFL_POOL_BUDGET_FROM_ENV, 0);
  cr_assert(eq(sz, stats_of(dp).budget_bytes, 0)); /* its own variable */
  ofl_pool_destroy(dp);
}

Test(pool, reserve_is_one_backend_call_and_serves_later_misses) {
  ofl_device_stats_t d0 = dev_stats();
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, (size_t)1 << 20);
  ofl_device_stats_t d1 = dev_stats();
  cr_assert(eq(u64, d1.device_allocs - d0.device_allocs, 1));
  ofl_tensor_t *t[12];
  for (int i = 0; i < 12; ++i) {
    int64_t shape[1] = {(int64_t)(1000 * (i % 4 + 1))};
    cr_assert(eq(int,
                 ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_F32, NULL, &t[i]),
                 OFL_SUCCESS));
    fill(t[i], (uint8_t)i);
  }
  for (int i = 0; i < 12; ++i) {
    cr_assert(eq(sz, wrong_bytes(t[i], (uint8_t)i), 0));
    /* Carved blocks are aligned and do not overlap. */
    cr_assert(eq(u64, (uintptr_t)ofl_tensor_data(t[i]) % 256, 0));
  }
  ofl_device_stats_t d2 = dev_stats();
  cr_assert(eq(u64, d2.device_allocs, d1.device_allocs));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.misses, 12));
  cr_assert(eq(u64, s.backend_allocs, 1));
  cr_assert(eq(sz, s.reserve_bytes, (size_t)1 << 20));
  /* Past the reserve, the backend is asked. */
  int64_t big[1] = {1 << 20};
  ofl_tensor_t *b;
  cr_assert(eq(int, ofl_pool_alloc(pool, big, 1, OFL_DTYPE_U8, NULL, &b),
               OFL_SUCCESS));
  cr_assert(eq(u64, dev_stats().device_allocs - d1.device_allocs, 1));
  for (int i = 0; i < 12; ++i)
    ofl_pool_free(pool, t[i]);
  ofl_pool_free(pool, b);
  cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
  cr_assert(eq(sz, dev_stats().device_bytes_in_use, d0.device_bytes_in_use));
  ofl_pool_destroy(pool);
}

Test(pool, reserve_larger_than_budget_is_rejected) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.budget_bytes = 4096;
  p.reserve_bytes = 8192;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_ERR_INVALID_ARG));
  cr_assert(eq(ptr, pool, NULL));
  p.reserve_bytes = 0;
  p.kind = (ofl_pool_kind_t)7;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pool_create(NULL, NULL, &pool), OFL_ERR_INVALID_ARG));
}

Test(pool, alloc_into_reuses_the_callers_handle) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[2] = {32, 32};
  ofl_tensor_t *t = NULL;
  cr_assert(
      eq(int, ofl_tensor_create(shape, 2, OFL_DTYPE_F16, &t), OFL_SUCCESS));
  ofl_tensor_set_flags(t, OFL_TENSOR_NOT_OFFLOADABLE);
  cr_assert(eq(int, ofl_pool_alloc_into(pool, t, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_DEVICE));
  cr_assert(eq(int, ofl_pool_alloc_into(pool, t, NULL), OFL_ERR_INVALID_USAGE));
  fill(t, 4);
  void *p1 = ofl_tensor_data(t);
  cr_assert(eq(int, ofl_tensor_release_storage(t), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_NONE));
  cr_assert(eq(u64, stats_of(pool).blocks_in_use, 0));
  cr_assert(eq(int, ofl_pool_alloc_into(pool, t, NULL), OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(t), p1)); /* a hit on its key */
  cr_assert(eq(u32, ofl_tensor_flags(t), OFL_TENSOR_NOT_OFFLOADABLE));
  cr_assert(eq(u64, stats_of(pool).hits, 1));
  cr_assert(eq(int, ofl_tensor_release_storage(t), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc_into_dynamic(pool, t, NULL), OFL_SUCCESS));
  cr_assert(eq(sz, ofl_tensor_storage_bytes(t), 4096));
  cr_assert(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS));
  cr_assert(eq(u64, stats_of(pool).blocks_in_use, 0));
  ofl_pool_destroy(pool);
}

Test(pool, a_view_keeps_the_block_out_of_the_free_list) {
  ofl_pool_t *pool = make_pool(OFL_POOL_PINNED, 0, 0);
  int64_t shape[1] = {64};
  ofl_tensor_t *t, *v;
  ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t);
  fill(t, 8);
  int64_t vs[1] = {32};
  cr_assert(
      eq(int, ofl_tensor_view(t, 32, vs, 1, OFL_DTYPE_U8, &v), OFL_SUCCESS));
  cr_assert(eq(ptr, (void *)ofl_tensor_storage_id(v),
               (void *)ofl_tensor_storage_id(t)));
  cr_assert(eq(ptr, ofl_tensor_pool(v), pool));
  cr_assert(eq(int, ofl_pool_free(pool, t), OFL_SUCCESS));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.blocks_in_use, 1));
  cr_assert(eq(u64, s.frees, 0));
  const uint8_t *d = ofl_tensor_data(v);
  cr_assert(eq(u8, d[0], (uint8_t)(8 + 32 * 13)));
  cr_assert(eq(int, ofl_tensor_destroy(v), OFL_SUCCESS));
  s = stats_of(pool);
  cr_assert(eq(u64, s.blocks_in_use, 0));
  cr_assert(eq(u64, s.frees, 1));
  ofl_pool_destroy(pool);
}

/* The poison is the host backend's strict mode. */
Test(pool, host_only_strict_mode_poisons_a_freed_block) {
  if (t_on_cuda())
    cr_skip_test("host backend only");
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[1] = {512};
  ofl_tensor_t *t;
  ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t);
  fill(t, 1);
  uint8_t *d = ofl_tensor_data(t);
  ofl_pool_free(pool, t);
  cr_assert(eq(sz, t_wrong_value(dev, d, 512, 0xDB), 0));
  ofl_pool_destroy(pool);
}

Test(pool, invalid_arguments_are_rejected_with_a_message) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  ofl_tensor_t *t = NULL;
  int64_t neg[1] = {-5};
  cr_assert(eq(int, ofl_pool_alloc(pool, neg, 1, OFL_DTYPE_F32, NULL, &t),
               OFL_ERR_INVALID_ARG));
  int64_t ok[1] = {5};
  cr_assert(eq(int, ofl_pool_alloc(pool, ok, 1, (ofl_dtype_t)-3, NULL, &t),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pool_alloc(NULL, ok, 1, OFL_DTYPE_F32, NULL, &t),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pool_alloc(pool, ok, 1, OFL_DTYPE_F32, NULL, NULL),
               OFL_ERR_INVALID_ARG));
  int64_t huge[2] = {INT64_MAX / 4, 16};
  cr_assert(eq(int, ofl_pool_alloc(pool, huge, 2, OFL_DTYPE_F32, NULL, &t),
               OFL_ERR_INVALID_ARG));
  cr_assert(gt(sz, strlen(ofl_last_error()), 0));
  cr_assert(eq(ptr, t, NULL));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.blocks_total, 0));
  cr_assert(eq(int, ofl_pool_reset(NULL), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pool_clear(NULL), OFL_ERR_INVALID_ARG));
  ofl_pool_destroy(NULL);
  ofl_pool_destroy(pool);
}

Test(pool, device_pool_out_of_device_memory_is_no_memory) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[1] = {past_capacity()};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_ERR_NO_MEMORY));
  ofl_pool_stats_t s = stats_of(pool);
  cr_assert(eq(u64, s.blocks_total, 0));
  cr_assert(eq(sz, s.total_bytes, 0));
  ofl_pool_destroy(pool);
}

/* Handles left on blocks that reset reclaimed and clear (or eviction) then
 * freed: ending them reads the block's header, which the pool keeps for
 * later blocks (another generation), never freed memory (ASan catches the
 * opposite). A new block on the recycled header is not taken for theirs. */
Test(pool, stale_handles_after_reset_and_clear_end_safely) {
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_DEVICE;
  pp.budget_bytes = 8192;
  pp.evict = 1;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &pp, &pool), OFL_SUCCESS));
  int64_t shape[1] = {4096}, other[1] = {8192};
  ofl_tensor_t *t = NULL, *v = NULL, *u = NULL, *w = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_alias(t, &v), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_reset(pool), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
  /* a new block, of another key, on the recycled header */
  cr_assert(eq(int, ofl_pool_alloc(pool, other, 1, OFL_DTYPE_U8, NULL, &u),
               OFL_SUCCESS));
  cr_assert(eq(int, t_set(dev, ofl_tensor_data(u), 0x5a, 8192), OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_expect(eq(int, ofl_pool_free(pool, t), OFL_ERR_INVALID_ARG));
  cr_expect(not(eq(ptr, strstr(ofl_last_error(), "stale"), NULL)), "%s",
            ofl_last_error());
  cr_expect(eq(int, ofl_tensor_destroy(v), OFL_SUCCESS)); /* just ends */
  cr_expect(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS));
  /* u is untouched by the stale handles' ends */
  ofl_pool_stats_t s = stats_of(pool);
  cr_expect(eq(u64, s.blocks_in_use, 1));
  cr_expect(eq(sz, t_wrong_value(dev, ofl_tensor_data(u), 8192, 0x5a), 0));
  /* eviction frees a header's block the same way */
  cr_assert(eq(int, ofl_pool_reset(pool), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &w),
               OFL_SUCCESS)); /* evicts u's block (budget 8192) */
  cr_expect(ge(u64, stats_of(pool).evictions, 1));
  cr_expect(eq(int, ofl_tensor_destroy(u), OFL_SUCCESS));
  cr_expect(eq(int, ofl_pool_free(pool, w), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

/* The budget covers the reserve as a whole plus the blocks outside it: a
 * block that does not fit the reserve's room must fit next to it, and a
 * free block in the reserve gives no room outside (the reserve stays). The
 * device memory the pool holds never exceeds its budget. */
Test(pool, budget_counts_the_reserve_and_the_blocks_outside_it) {
  size_t d0 = dev_stats().device_bytes_in_use;
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_DEVICE;
  pp.budget_bytes = (size_t)192 << 10;
  pp.reserve_bytes = (size_t)64 << 10;
  pp.evict = 1;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &pp, &pool), OFL_SUCCESS));
  int64_t big[1] = {80 << 10}, small[1] = {32 << 10};
  ofl_tensor_t *a = NULL, *b = NULL, *c = NULL, *x = NULL;
  /* 64 (reserve) + 80 outside: fits */
  cr_assert(eq(int, ofl_pool_alloc(pool, big, 1, OFL_DTYPE_U8, NULL, &a),
               OFL_SUCCESS));
  fill(a, 1);
  /* 32 carved from the reserve: no new budget */
  cr_assert(eq(int, ofl_pool_alloc(pool, small, 1, OFL_DTYPE_U8, NULL, &b),
               OFL_SUCCESS));
  fill(b, 2);
  /* another 80 outside: 64 + 160 > 192, refused while a is in use */
  cr_expect(eq(int, ofl_pool_alloc(pool, big, 1, OFL_DTYPE_I8, NULL, &x),
               OFL_ERR_NO_MEMORY));
  cr_expect(le(sz, dev_stats().device_bytes_in_use - d0, (size_t)192 << 10));
  /* a free: its 80 outside the reserve can be evicted for the new key */
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc(pool, big, 1, OFL_DTYPE_I8, NULL, &c),
               OFL_SUCCESS));
  cr_expect(eq(u64, stats_of(pool).evictions, 1));
  cr_expect(le(sz, dev_stats().device_bytes_in_use - d0, (size_t)192 << 10));
  cr_expect(eq(sz, wrong_bytes(b, 2), 0));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  /* b's free block is in the reserve: no room outside for a second 80 */
  cr_expect(eq(int, ofl_pool_alloc(pool, big, 1, OFL_DTYPE_F8_E4M3, NULL, &x),
               OFL_ERR_NO_MEMORY));
  cr_expect(le(sz, dev_stats().device_bytes_in_use - d0, (size_t)192 << 10));
  cr_assert(eq(int, ofl_pool_free(pool, c), OFL_SUCCESS));
  ofl_pool_destroy(pool);

  /* budget equal to the reserve: everything lives in the reserve */
  pp.budget_bytes = pp.reserve_bytes = (size_t)64 << 10;
  cr_assert(eq(int, ofl_pool_create(dev, &pp, &pool), OFL_SUCCESS));
  int64_t full[1] = {64 << 10};
  cr_assert(eq(int, ofl_pool_alloc(pool, full, 1, OFL_DTYPE_U8, NULL, &a),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_expect(eq(int, ofl_pool_alloc(pool, full, 1, OFL_DTYPE_I8, NULL, &x),
               OFL_ERR_NO_MEMORY));
  cr_expect(le(sz, dev_stats().device_bytes_in_use - d0, (size_t)64 << 10));
  /* the same key reuses its block in the reserve */
  cr_assert(eq(int, ofl_pool_alloc(pool, full, 1, OFL_DTYPE_U8, NULL, &a),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

/* Ended handles wait in a first-in first-out quarantine before reuse: a
 * handle freed a second time after other allocations is found ended (an
 * error), not taken for the tensor that now holds it; the other tensors'
 * bytes are untouched. */
Test(pool, double_free_after_other_allocations_is_found) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[1] = {4096};
  enum { N = 40 };
  ofl_tensor_t *t = NULL, *u[N];
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, t), OFL_SUCCESS));
  for (int i = 0; i < N; i++) {
    cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &u[i]),
                 OFL_SUCCESS));
    cr_assert(not(eq(ptr, u[i], t)), "handle %d reused at once", i);
    fill(u[i], (uint8_t)i);
  }
  cr_expect(eq(int, ofl_pool_free(pool, t), OFL_ERR_INVALID_ARG));
  cr_expect(not(eq(ptr, strstr(ofl_last_error(), "double free"), NULL)), "%s",
            ofl_last_error());
  for (int i = 0; i < N; i++) {
    cr_expect(eq(sz, wrong_bytes(u[i], (uint8_t)i), 0), "tensor %d", i);
    cr_assert(eq(int, ofl_pool_free(pool, u[i]), OFL_SUCCESS));
  }
  ofl_pool_destroy(pool);
}

static void sleep_ms_fn(void *arg) {
  usleep((useconds_t)(uintptr_t)arg * 1000);
}

/* Strict pools: a view released stream-ordered after its copy, then the
 * base freed without a stream. The view's release already orders the
 * block's reuse after the copy, so the free is accepted, and the strict
 * poison is queued after the copy too: the copy reads the real bytes. */
Test(pool, strict_free_after_an_ordered_view_release) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "copy", &s), OFL_SUCCESS));
  int64_t shape[1] = {1 << 16};
  ofl_tensor_t *t = NULL, *v = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  fill(t, 9);
  cr_assert(eq(int, ofl_tensor_alias(t, &v), OFL_SUCCESS));
  uint8_t *out = NULL; /* pinned: the copy stays queued on a GPU too */
  cr_assert(eq(int, ofl_pinned_malloc(dev, 1 << 16, (void **)&out),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_launch_host_func(s, sleep_ms_fn, (void *)40),
               OFL_SUCCESS));
  cr_assert(eq(
      int, ofl_memcpy_async(out, ofl_tensor_data(v), 1 << 16, OFL_COPY_D2H, s),
      OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage_after(v, s), OFL_SUCCESS));
  cr_expect(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  size_t wrong = 0;
  for (size_t i = 0; i < (1u << 16); i++)
    wrong += out[i] != (uint8_t)(9 + i * 13);
  cr_expect(eq(sz, wrong, 0));
  cr_assert(eq(int, ofl_tensor_destroy(v), OFL_SUCCESS));
  ofl_stream_destroy(s);
  ofl_pinned_free(dev, out);
  ofl_pool_destroy(pool);
}

/* Strict pools: an ordered release of a view covers only the view's uses; the
 * base's own copy queued on another stream is not covered, so an unordered
 * free of the base must still be refused (or its poison must wait for it). */
Test(pool, strict_free_with_a_base_use_not_covered_by_a_view_release) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  ofl_stream_t *s = NULL, *s2 = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "copy", &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "copy2", &s2), OFL_SUCCESS));
  int64_t shape[1] = {1 << 16};
  ofl_tensor_t *t = NULL, *v = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  fill(t, 9);
  cr_assert(eq(int, ofl_tensor_alias(t, &v), OFL_SUCCESS));
  uint8_t *out = NULL, *out2 = NULL; /* pinned: the copies stay queued */
  cr_assert(eq(int, ofl_pinned_malloc(dev, 1 << 16, (void **)&out),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_malloc(dev, 1 << 16, (void **)&out2),
               OFL_SUCCESS));
  /* the base's own copy, late, on s2 */
  cr_assert(eq(int, ofl_stream_launch_host_func(s2, sleep_ms_fn, (void *)60),
               OFL_SUCCESS));
  cr_assert(
      eq(int,
         ofl_memcpy_async(out2, ofl_tensor_data(t), 1 << 16, OFL_COPY_D2H, s2),
         OFL_SUCCESS));
  /* the view's copy on s, released ordered on s */
  cr_assert(eq(
      int, ofl_memcpy_async(out, ofl_tensor_data(v), 1 << 16, OFL_COPY_D2H, s),
      OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage_after(v, s), OFL_SUCCESS));
  ofl_status_t st = ofl_tensor_destroy(t);
  cr_assert(eq(int, ofl_stream_synchronize(s2, 10000), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  size_t wrong = 0;
  for (size_t i = 0; i < (1u << 16); i++)
    wrong += out2[i] != (uint8_t)(9 + i * 13);
  cr_expect(st != OFL_SUCCESS || wrong == 0,
            "unordered free accepted while the base's copy on s2 was queued; "
            "%zu bytes of that copy read poison",
            wrong);
  if (st != OFL_SUCCESS)
    ofl_tensor_destroy(t);
  ofl_tensor_destroy(v);
  ofl_stream_destroy(s);
  ofl_stream_destroy(s2);
  ofl_pinned_free(dev, out);
  ofl_pinned_free(dev, out2);
  ofl_pool_destroy(pool);
}

/* A header recycled for a block whose creation failed goes back to
 * the spare list with its pool and kind: a stale handle on it is still
 * found stale, and no view of it can be made. */
Test(pool, stale_handle_on_a_header_whose_next_block_failed) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, 0, 0);
  int64_t shape[1] = {0}, huge[1] = {past_capacity()};
  ofl_tensor_t *t = NULL, *u = NULL, *v = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_reset(pool), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
  /* takes t's old header, the backend refuses, the header is retired */
  cr_assert(eq(int, ofl_pool_alloc(pool, huge, 1, OFL_DTYPE_U8, NULL, &u),
               OFL_ERR_NO_MEMORY));
  cr_expect(eq(int, ofl_pool_free(pool, t), OFL_ERR_INVALID_ARG));
  cr_expect(not(eq(ptr, strstr(ofl_last_error(), "stale"), NULL)), "%s",
            ofl_last_error());
  cr_expect(not(eq(int, ofl_tensor_alias(t, &v), OFL_SUCCESS)),
            "a view of a stale handle was made");
  if (v != NULL)
    ofl_tensor_destroy(v); /* frees the header: double free at destroy */
  cr_expect(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS));
  ofl_pool_destroy(pool);
}

/* Misuse: the device closed before its pool. The close waits for the
 * pool's destroy; the pool stays usable meanwhile (its bytes intact), and
 * its destroy closes the device (nothing leaks: valgrind setup). */
Test(pool, device_closed_before_its_pool_closes_after_it) {
  ofl_device_params_t p = t_device_params(50, 0);
  ofl_device_t *d2 = NULL;
  cr_assert(eq(int, ofl_device_open(&p, &d2), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_DEVICE;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(d2, &pp, &pool), OFL_SUCCESS));
  int64_t shape[1] = {4096};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  cr_assert(eq(int, t_fill(d2, ofl_tensor_data(t), 4096, 77), OFL_SUCCESS));
  ofl_device_close(d2); /* misuse: deferred */
  /* still usable: the bytes are there, another block can be had */
  cr_assert(eq(sz, t_wrong(d2, ofl_tensor_data(t), 4096, 77), 0));
  ofl_tensor_t *u = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &u),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, u), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, t), OFL_SUCCESS));
  ofl_pool_destroy(pool); /* the deferred close runs here */
}
