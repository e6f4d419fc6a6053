/* Stream-ordered reuse of pool blocks (docs/DESIGN.md section 5 rule 2): a block
 * whose last use is still queued is not handed out unordered. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"

/* On the backend under test (OFLTEST_BACKEND). Pinned blocks are touched by
 * the CPU; device memory only through copies (dfill, dwrong). Tests named
 * host_only_ are about the host backend's strict-mode checks and skip on
 * cuda. */
static ofl_device_t *dev;

static ofl_device_t *open_device(int strict) {
  ofl_device_params_t p = t_device_params(50, 20261122);
  p.strict = strict;
  ofl_device_t *d = NULL;
  cr_assert(eq(int, ofl_device_open(&p, &d), OFL_SUCCESS), "%s",
            ofl_last_error());
  return d;
}
static void open_dev(void) { dev = open_device(1); }
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(pool_stream, .init = open_dev, .fini = close_dev);

static ofl_pool_t *make_pool(ofl_device_t *d, ofl_pool_kind_t kind) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.kind = kind;
  p.budget_bytes = 0;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(d, &p, &pool), OFL_SUCCESS), "%s",
            ofl_last_error());
  return pool;
}

static ofl_stream_t *make_stream(ofl_device_t *d, const char *name) {
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(d, name, &s), OFL_SUCCESS));
  return s;
}

static void sleep_ms(void *arg) { usleep((useconds_t)(uintptr_t)arg * 1000); }

static uint8_t pattern(uint64_t seed, size_t i) {
  return (uint8_t)((seed * 2654435761u) >> 7 ^ (i * 31 + seed));
}

static void fill(void *p, size_t n, uint64_t seed) {
  uint8_t *d = p;
  for (size_t i = 0; i < n; ++i)
    d[i] = pattern(seed, i);
}

static size_t wrong(const void *p, size_t n, uint64_t seed) {
  const uint8_t *d = p;
  size_t w = 0;
  for (size_t i = 0; i < n; ++i)
    w += d[i] != pattern(seed, i);
  return w;
}

/* The same through copies, for device memory of d. */
static void dfill(ofl_device_t *d, void *dptr, size_t n, uint64_t seed) {
  uint8_t *h = malloc(n);
  cr_assert(not(eq(ptr, h, NULL)));
  fill(h, n, seed);
  cr_assert(eq(int, t_write(d, dptr, h, n), OFL_SUCCESS), "%s",
            ofl_last_error());
  free(h);
}

/* SIZE_MAX when the bytes could not be read back. */
static size_t dwrong(ofl_device_t *d, const void *dptr, size_t n,
                     uint64_t seed) {
  uint8_t *h = malloc(n);
  cr_assert(not(eq(ptr, h, NULL)));
  size_t w = t_read(d, h, dptr, n) == OFL_SUCCESS ? wrong(h, n, seed)
                                                  : SIZE_MAX;
  free(h);
  return w;
}

#define N ((size_t)1 << 16)

/* A pinned block filled with pattern 1 is being copied to device memory by
 * a held-back H2D stream; returns the block. */
static ofl_tensor_t *queue_upload(ofl_device_t *d, ofl_pool_t *pool,
                                  ofl_stream_t *h2d, void *dst) {
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *src = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &src),
               OFL_SUCCESS));
  fill(ofl_tensor_data(src), N, 1);
  /* Hold the stream so the copy is still queued when the block is freed. */
  cr_assert(eq(int, ofl_stream_launch_host_func(h2d, sleep_ms, (void *)40),
               OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_memcpy_async(dst, ofl_tensor_data(src), N, OFL_COPY_H2D, h2d),
         OFL_SUCCESS));
  (void)d;
  return src;
}

Test(pool_stream,
     host_only_strict_mode_reports_an_unordered_free_of_a_block_in_use) {
  if (t_on_cuda())
    cr_skip_test("host backend only");
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  ofl_pool_stats_t before;
  ofl_pool_get_stats(pool, &before);
  cr_assert(eq(int, ofl_pool_free(pool, src), OFL_ERR_INVALID_USAGE));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "ofl_pool_free_after"), NULL));
  ofl_pool_stats_t after;
  ofl_pool_get_stats(pool, &after);
  cr_assert(eq(int, memcmp(&before, &after, sizeof before), 0));
  cr_assert(eq(int, ofl_pool_owns(pool, src), 1));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  cr_assert(eq(int, ofl_pool_free(pool, src), OFL_SUCCESS));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

/* The hazard the rule exists for: without the event, the block is handed
 * out again and overwritten before the queued copy reads it. */
Test(pool_stream, omitting_the_event_lets_reuse_corrupt_a_queued_copy) {
  ofl_device_t *lax = open_device(0);
  ofl_pool_t *pool = make_pool(lax, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(lax, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(lax, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(lax, pool, h2d, dst);
  void *block = ofl_tensor_data(src);
  cr_assert(eq(int, ofl_pool_free(pool, src), OFL_SUCCESS)); /* no event */
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *again = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &again),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(again), block));
  fill(ofl_tensor_data(again), N, 2);
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(
      eq(sz, dwrong(lax, dst, N, 1), wrong(ofl_tensor_data(again), N, 1)));
  cr_assert(gt(sz, dwrong(lax, dst, N, 1), N / 2));
  ofl_stream_destroy(h2d);
  ofl_device_free(lax, dst);
  ofl_pool_destroy(pool);
  ofl_device_close(lax);
}

Test(pool_stream, free_after_skips_the_block_until_its_copy_completes) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  void *block = ofl_tensor_data(src);
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *other = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &other),
               OFL_SUCCESS));
  cr_assert(ne(ptr, ofl_tensor_data(other), block));
  fill(ofl_tensor_data(other), N, 2);
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.pending_skips, 1));
  cr_assert(eq(u64, s.misses, 2));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  /* Complete now: the block is a hit again. */
  ofl_tensor_t *again = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &again),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(again), block));
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.hits, 1));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

Test(pool_stream, alloc_on_a_stream_hands_out_the_block_behind_a_wait) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  ofl_stream_t *work = make_stream(dev, "work");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  void *block = ofl_tensor_data(src);
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *again = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, work, &again),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(again), block));
  /* The block is host memory: written on work by a copy from pinned 0x55s
   * (a memset is for device memory). */
  uint8_t *fives_src = NULL;
  cr_assert(
      eq(int, ofl_pinned_malloc(dev, N, (void **)&fives_src), OFL_SUCCESS));
  memset(fives_src, 0x55, N);
  cr_assert(eq(int, ofl_memcpy_async(block, fives_src, N, OFL_COPY_H2H, work),
               OFL_SUCCESS));
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.stream_waits, 1));
  cr_assert(eq(u64, s.hits, 1));
  cr_assert(eq(int, ofl_stream_synchronize(work, 10000), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  size_t fives = 0;
  for (size_t i = 0; i < N; ++i)
    fives += ((uint8_t *)block)[i] == 0x55;
  cr_assert(eq(sz, fives, N));
  ofl_pinned_free(dev, fives_src);
  ofl_pool_free(pool, again);
  ofl_stream_destroy(work);
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

/* A block handed out behind a stream wait and returned unused still
 * carries the earlier last use. */
Test(pool_stream, a_block_returned_unused_after_a_stream_wait_keeps_its_order) {
  ofl_device_t *lax = open_device(0);
  ofl_pool_t *pool = make_pool(lax, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(lax, "h2d");
  ofl_stream_t *work = make_stream(lax, "work");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(lax, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(lax, pool, h2d, dst);
  void *block = ofl_tensor_data(src);
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, work, &t),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(t), block));
  cr_assert(eq(int, ofl_pool_free(pool, t), OFL_SUCCESS)); /* unused */
  ofl_tensor_t *other = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &other),
               OFL_SUCCESS));
  cr_assert(ne(ptr, ofl_tensor_data(other), block));
  fill(ofl_tensor_data(other), N, 9);
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(lax, dst, N, 1), 0));
  ofl_stream_destroy(work);
  ofl_stream_destroy(h2d);
  ofl_device_free(lax, dst);
  ofl_pool_destroy(pool);
  ofl_device_close(lax);
}

Test(pool_stream, alloc_on_the_compute_stream_blocks_until_the_last_use) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *again = NULL;
  cr_assert(eq(int,
               ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8,
                              ofl_device_compute_stream(dev), &again),
               OFL_SUCCESS));
  /* The block is handed out behind a wait on the compute stream: on the host
   * backend that stream is this thread, so the wait has returned after the
   * copy; on cuda it is queued, and the host joins the compute stream
   * before its CPU writes (a no-op on the host backend). */
  cr_assert(eq(int, ofl_stream_synchronize(ofl_device_compute_stream(dev),
                                           10000),
               OFL_SUCCESS));
  fill(ofl_tensor_data(again), N, 3);
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

Test(pool_stream, free_after_event_captures_the_event_when_called) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  void *block = ofl_tensor_data(src);
  cr_assert(eq(int, ofl_event_record(ev, h2d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free_after_event(pool, src, ev), OFL_SUCCESS));
  /* The caller records its event again at once, on an idle stream. */
  cr_assert(eq(int, ofl_event_record(ev, ofl_device_compute_stream(dev)),
               OFL_SUCCESS));
  /* that record completes (at once on the host backend's compute stream,
   * soon on cuda's) while the upload is still held */
  cr_assert(eq(int, ofl_event_synchronize(ev, 10000), OFL_SUCCESS));
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *other = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &other),
               OFL_SUCCESS));
  cr_assert(ne(ptr, ofl_tensor_data(other), block));
  fill(ofl_tensor_data(other), N, 4);
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  ofl_event_destroy(ev);
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

/* What the pool relies on: a wait refers to the record before it, even
 * when the event is recorded again on a faster stream. */
Test(pool_stream, a_wait_is_not_released_by_a_later_record_elsewhere) {
  ofl_stream_t *slow = make_stream(dev, "slow");
  ofl_stream_t *waiter = make_stream(dev, "waiter");
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  uint8_t *a = NULL, *b = calloc(1, 4096);
  cr_assert(eq(int, ofl_device_malloc(dev, 4096, (void **)&a), OFL_SUCCESS));
  cr_assert(eq(int, t_set(dev, a, 0x11, 4096), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_launch_host_func(slow, sleep_ms, (void *)40),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_memset_async(a, 0x22, 4096, slow), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, slow), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_wait_event(waiter, ev), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_memcpy_async(b, a, 4096, OFL_COPY_D2H, waiter), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, ofl_device_compute_stream(dev)),
               OFL_SUCCESS));
  /* the last record, on the compute stream, completes while slow is held */
  cr_assert(eq(int, ofl_event_synchronize(ev, 10000), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(waiter, 10000), OFL_SUCCESS));
  size_t w = 0;
  for (int i = 0; i < 4096; ++i)
    w += b[i] != 0x22;
  cr_assert(eq(sz, w, 0));
  ofl_event_destroy(ev);
  ofl_stream_destroy(waiter);
  ofl_stream_destroy(slow);
  cr_assert(eq(int, ofl_device_free(dev, a), OFL_SUCCESS));
  free(b);
}

Test(pool_stream, release_storage_after_orders_a_device_block) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_DEVICE);
  ofl_stream_t *d2h = make_stream(dev, "d2h");
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *t = NULL;
  cr_assert(
      eq(int, ofl_tensor_create(shape, 1, OFL_DTYPE_U8, &t), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_alloc_into(pool, t, NULL), OFL_SUCCESS));
  void *block = ofl_tensor_data(t);
  dfill(dev, block, N, 5);
  /* pinned: a copy to pageable memory may complete before the call returns
   * on a GPU, and it must still be queued at the release */
  uint8_t *host = NULL;
  cr_assert(eq(int, ofl_pinned_malloc(dev, N, (void **)&host), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_launch_host_func(d2h, sleep_ms, (void *)40),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(host, block, N, OFL_COPY_D2H, d2h),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage_after(t, d2h), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_NONE));
  /* Reload into the same handle while the offload copy is still queued. */
  cr_assert(eq(int, ofl_pool_alloc_into(pool, t, NULL), OFL_SUCCESS));
  cr_assert(ne(ptr, ofl_tensor_data(t), block));
  dfill(dev, ofl_tensor_data(t), N, 6);
  cr_assert(eq(int, ofl_stream_synchronize(d2h, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, wrong(host, N, 5), 0));
  ofl_tensor_destroy(t);
  ofl_pinned_free(dev, host);
  ofl_stream_destroy(d2h);
  ofl_pool_destroy(pool);
}

Test(pool_stream, a_stream_request_prefers_a_block_whose_last_use_is_over) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  ofl_stream_t *work = make_stream(dev, "work");
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *idle = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &idle),
               OFL_SUCCESS));
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  void *busy = ofl_tensor_data(src);
  void *ready = ofl_tensor_data(idle);
  /* FIFO order: the busy block first, then the idle one. */
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, idle), OFL_SUCCESS));
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, work, &t),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(t), ready));
  cr_assert(ne(ptr, ofl_tensor_data(t), busy));
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.stream_waits, 0));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  ofl_stream_destroy(work);
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

Test(pool_stream, full_budget_waits_on_the_host_for_a_pending_block) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.kind = OFL_POOL_PINNED;
  p.budget_bytes = N;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_SUCCESS));
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  void *block = ofl_tensor_data(src);
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(t), block));
  fill(block, N, 7); /* the copy has read it: dst must be intact */
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.blocks_total, 1));
  cr_assert(eq(u64, s.budget_refusals, 0));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

Test(pool_stream, views_released_on_two_streams_order_both_uses) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_DEVICE);
  ofl_stream_t *a = make_stream(dev, "a");
  ofl_stream_t *b = make_stream(dev, "b");
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *t = NULL, *v = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  void *block = ofl_tensor_data(t);
  dfill(dev, block, N, 8);
  cr_assert(eq(int, ofl_tensor_alias(t, &v), OFL_SUCCESS));
  uint8_t *out_a = NULL, *out_b = NULL; /* pinned: the copies stay queued */
  cr_assert(eq(int, ofl_pinned_malloc(dev, N, (void **)&out_a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_malloc(dev, N, (void **)&out_b), OFL_SUCCESS));
  /* Stream a is slow; stream b is quick. */
  cr_assert(eq(int, ofl_stream_launch_host_func(a, sleep_ms, (void *)40),
               OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_memcpy_async(out_a, block, N, OFL_COPY_D2H, a), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_memcpy_async(out_b, block, N, OFL_COPY_D2H, b), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage_after(t, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free_after(pool, v, b), OFL_SUCCESS));
  ofl_tensor_t *x = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &x),
               OFL_SUCCESS));
  cr_assert(ne(ptr, ofl_tensor_data(x), block));
  cr_assert(eq(int, ofl_stream_synchronize(b, 10000), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(a, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, wrong(out_a, N, 8), 0));
  cr_assert(eq(sz, wrong(out_b, N, 8), 0));
  ofl_tensor_destroy(t);
  ofl_pinned_free(dev, out_a);
  ofl_pinned_free(dev, out_b);
  ofl_stream_destroy(a);
  ofl_stream_destroy(b);
  ofl_pool_destroy(pool);
}

Test(pool_stream, clear_waits_for_queued_last_uses_before_freeing) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  ofl_device_stats_t d0;
  ofl_device_get_stats(dev, &d0);
  cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
  ofl_device_stats_t d1;
  ofl_device_get_stats(dev, &d1);
  cr_assert(eq(u64, d1.pinned_frees - d0.pinned_frees, 1));
  cr_assert(eq(u64, d1.strict_violations, d0.strict_violations));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

Test(pool_stream, eviction_never_takes_a_block_whose_last_use_is_queued) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.kind = OFL_POOL_PINNED;
  p.budget_bytes = N;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_SUCCESS));
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  cr_assert(eq(int, ofl_pool_free_after(pool, src, h2d), OFL_SUCCESS));
  int64_t other[1] = {(int64_t)N / 2};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, other, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_ERR_NO_MEMORY));
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.evictions, 0));
  cr_assert(eq(u64, s.blocks_total, 1));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  /* Now over: the block may go. */
  cr_assert(eq(int, ofl_pool_alloc(pool, other, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.evictions, 1));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

typedef struct {
  ofl_pool_t *pool;
  ofl_tensor_t *t;
  ofl_status_t status;
} cb_free_t;

static void free_in_callback(void *arg) {
  cb_free_t *c = arg;
  c->status = ofl_pool_free(c->pool, c->t);
}

Test(pool_stream, a_stream_callback_can_free_a_block) {
  ofl_pool_t *pool = make_pool(dev, OFL_POOL_PINNED);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  cb_free_t c = {pool, src, OFL_ERR_INTERNAL};
  cr_assert(eq(int, ofl_stream_launch_host_func(h2d, free_in_callback, &c),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(int, c.status, OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0));
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  cr_assert(eq(u64, s.blocks_in_use, 0));
  cr_assert(eq(u64, s.frees, 1));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}

/* 1,000 seeded iterations of upload, download and immediate reuse of the
 * freed blocks (unordered scribbles from the host, ordered ones on a
 * stream), with jitter on every worker stream: zero wrong bytes. */
Test(pool_stream, seeded_reuse_with_jitter_never_corrupts_data) {
  enum { ITERS = 1000 };
  static const size_t sizes[4] = {4096, 12000, 32768, 777};
  ofl_pool_t *pinned = make_pool(dev, OFL_POOL_PINNED);
  ofl_pool_t *device = make_pool(dev, OFL_POOL_DEVICE);
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  ofl_stream_t *d2h = make_stream(dev, "d2h");
  ofl_event_t *up = NULL;
  cr_assert(eq(int, ofl_event_create(dev, &up), OFL_SUCCESS));
  uint8_t *out = calloc(ITERS, 32768);
  /* ordered scribbles on pinned blocks: a copy from pinned 0xEEs on the
   * stream (a memset is for device memory) */
  uint8_t *scribble = NULL;
  cr_assert(
      eq(int, ofl_pinned_malloc(dev, 32768, (void **)&scribble), OFL_SUCCESS));
  memset(scribble, 0xEE, 32768);
  size_t *len = calloc(ITERS, sizeof *len);
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < ITERS; ++i) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    size_t n = sizes[rng % 4];
    len[i] = n;
    int64_t shape[1] = {(int64_t)n};
    ofl_tensor_t *src = NULL, *dblk = NULL;
    cr_assert(eq(int,
                 ofl_pool_alloc(pinned, shape, 1, OFL_DTYPE_U8, NULL, &src),
                 OFL_SUCCESS));
    fill(ofl_tensor_data(src), n, (uint64_t)i + 100);
    ofl_stream_t *dev_req = (rng >> 8) % 2 ? h2d : NULL;
    cr_assert(eq(int,
                 ofl_pool_alloc(device, shape, 1, OFL_DTYPE_U8, dev_req, &dblk),
                 OFL_SUCCESS));
    cr_assert(eq(int,
                 ofl_memcpy_async(ofl_tensor_data(dblk), ofl_tensor_data(src),
                                  n, OFL_COPY_H2D, h2d),
                 OFL_SUCCESS));
    cr_assert(eq(int, ofl_pool_free_after(pinned, src, h2d), OFL_SUCCESS));
    cr_assert(eq(int, ofl_event_record(up, h2d), OFL_SUCCESS));
    cr_assert(eq(int, ofl_stream_wait_event(d2h, up), OFL_SUCCESS));
    cr_assert(eq(int,
                 ofl_memcpy_async(out + (size_t)i * 32768,
                                  ofl_tensor_data(dblk), n, OFL_COPY_D2H, d2h),
                 OFL_SUCCESS));
    cr_assert(eq(int, ofl_pool_free_after(device, dblk, d2h), OFL_SUCCESS));

    /* Reuse at once: host scribbles on blocks handed out unordered, stream
     * scribbles on blocks handed out behind a wait. */
    ofl_tensor_t *s1 = NULL, *s2 = NULL;
    bool ordered = (rng >> 16) % 3 == 0;
    ofl_stream_t *req = ordered ? d2h : NULL;
    cr_assert(eq(int, ofl_pool_alloc(pinned, shape, 1, OFL_DTYPE_U8, req, &s1),
                 OFL_SUCCESS));
    cr_assert(eq(int, ofl_pool_alloc(device, shape, 1, OFL_DTYPE_U8, req, &s2),
                 OFL_SUCCESS));
    if (ordered) {
      cr_assert(eq(int,
                   ofl_memcpy_async(ofl_tensor_data(s1), scribble, n,
                                    OFL_COPY_H2H, d2h),
                   OFL_SUCCESS));
      cr_assert(eq(int, ofl_memset_async(ofl_tensor_data(s2), 0xEE, n, d2h),
                   OFL_SUCCESS));
      cr_assert(eq(int, ofl_pool_free_after(pinned, s1, d2h), OFL_SUCCESS));
      cr_assert(eq(int, ofl_pool_free_after(device, s2, d2h), OFL_SUCCESS));
    } else {
      memset(ofl_tensor_data(s1), 0xEE, n);
      /* the device block through a copy on the compute stream, waited for
       * (on the host backend: on this thread, at once) */
      cr_assert(eq(int, t_set(dev, ofl_tensor_data(s2), 0xEE, n),
                   OFL_SUCCESS));
      cr_assert(eq(int, ofl_pool_free(pinned, s1), OFL_SUCCESS));
      cr_assert(eq(int, ofl_pool_free(device, s2), OFL_SUCCESS));
    }
  }
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 30000), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(d2h, 30000), OFL_SUCCESS));
  size_t bad = 0;
  for (int i = 0; i < ITERS; ++i)
    bad += wrong(out + (size_t)i * 32768, len[i], (uint64_t)i + 100);
  cr_assert(eq(sz, bad, 0));
  ofl_pool_stats_t ps, ds;
  ofl_pool_get_stats(pinned, &ps);
  ofl_pool_get_stats(device, &ds);
  cr_assert(eq(u64, ps.blocks_in_use, 0));
  cr_assert(eq(u64, ds.blocks_in_use, 0));
  cr_assert(eq(u64, ps.hits + ps.misses, ps.requests));
  cr_log_info("pinned hits %llu misses %llu device hits %llu misses %llu",
              (unsigned long long)ps.hits, (unsigned long long)ps.misses,
              (unsigned long long)ds.hits, (unsigned long long)ds.misses);
  cr_assert(gt(u64, ps.hits, ITERS / 2)); /* reuse actually happened */
  cr_assert(gt(u64, ds.hits, ITERS / 2));
  ofl_device_stats_t dst;
  ofl_device_get_stats(dev, &dst);
  cr_assert(eq(u64, dst.strict_violations, 0));
  ofl_event_destroy(up);
  ofl_stream_destroy(h2d);
  ofl_stream_destroy(d2h);
  ofl_pool_destroy(pinned);
  ofl_pool_destroy(device);
  ofl_pinned_free(dev, scribble);
  free(out);
  free(len);
}

/* The same for a block carved from the pool's reserve: the reserve is one
 * backend allocation, so the check has to look at the block's own range
 * (a copy queued on another block of the reserve does not count). */
Test(pool_stream,
     host_only_strict_mode_reports_an_unordered_free_of_a_reserve_block) {
  if (t_on_cuda())
    cr_skip_test("host backend only");
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_PINNED;
  pp.budget_bytes = 0;
  pp.reserve_bytes = 4 * N;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &pp, &pool), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_stream_t *h2d = make_stream(dev, "h2d");
  void *dst = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, N, &dst), OFL_SUCCESS));
  int64_t shape[1] = {(int64_t)N};
  ofl_tensor_t *idle = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &idle),
               OFL_SUCCESS));
  ofl_tensor_t *src = queue_upload(dev, pool, h2d, dst);
  ofl_pool_stats_t st;
  ofl_pool_get_stats(pool, &st);
  cr_assert(eq(u64, st.backend_allocs, 1)); /* both carved */
  /* A block of the reserve that no queued op touches frees at once. */
  cr_assert(eq(int, ofl_pool_free(pool, idle), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_pool_stats_t before;
  ofl_pool_get_stats(pool, &before);
  cr_assert(eq(int, ofl_pool_free(pool, src), OFL_ERR_INVALID_USAGE));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "ofl_pool_free_after"), NULL));
  ofl_pool_stats_t after;
  ofl_pool_get_stats(pool, &after);
  cr_assert(eq(int, memcmp(&before, &after, sizeof before), 0));
  cr_assert(eq(int, ofl_pool_owns(pool, src), 1));
  cr_assert(eq(int, ofl_stream_synchronize(h2d, 10000), OFL_SUCCESS));
  cr_assert(eq(sz, dwrong(dev, dst, N, 1), 0)); /* not poisoned under the copy */
  cr_assert(eq(int, ofl_pool_free(pool, src), OFL_SUCCESS));
  ofl_stream_destroy(h2d);
  ofl_device_free(dev, dst);
  ofl_pool_destroy(pool);
}
