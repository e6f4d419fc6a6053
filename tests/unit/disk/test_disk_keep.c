/* Disk store: bounce buffers kept after their write. A reload of a kept
 * extent is served from memory (no read), the newest are kept, kept
 * buffers give way when the bounce pool is full, and every byte is checked
 * whichever way it came back. */
#include "tests/support/disk_test_util.h"

TestSuite(disk_keep, .init = disk_setup, .fini = disk_teardown);

#define SPAN ((size_t)64 << 10)

static ofl_disk_t *open_keep(size_t keep, size_t bounce_budget) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.keep_bytes = keep;
  p.bounce_budget_bytes = bounce_budget;
  return open_with(&p);
}

/* Writes n extents of bytes each (seeds 100+i) and waits for each. */
static void write_all(ofl_disk_t *d, ofl_disk_extent_t **e, int n,
                      size_t bytes) {
  for (int i = 0; i < n; i++) {
    e[i] = put(d, bytes, 100 + (uint64_t)i);
    cr_assert(eq(int, ofl_disk_extent_wait(e[i], -1), OFL_SUCCESS), "%s",
              ofl_last_error());
    cr_assert(eq(int, ofl_disk_extent_state(e[i]), OFL_DISK_EXTENT_ON_DISK));
    cr_assert(eq(ptr, ofl_disk_extent_data(e[i]), NULL));
  }
}

static size_t reload_wrong(ofl_disk_extent_t *e, size_t bytes, int i) {
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS), "%s",
            ofl_last_error());
  return count_wrong(p, bytes, 100 + (uint64_t)i);
}

Test(disk_keep, a_kept_buffer_serves_the_reload_without_a_read) {
  ofl_disk_t *d = open_keep(1 << 20, 0);
  ofl_disk_extent_t *e[1];
  size_t bytes = SPAN - 123; /* unaligned payload */
  write_all(d, e, 1, bytes);
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(sz, s.keep_bytes, (size_t)1 << 20));
  cr_expect(eq(sz, s.kept_bytes, SPAN));
  cr_expect(eq(sz, reload_wrong(e[0], bytes, 0), 0));
  s = disk_stats(d);
  cr_expect(eq(u64, s.bytes_written, bytes));
  cr_expect(eq(u64, s.bytes_read, 0));
  cr_expect(eq(u64, s.keep_hits, 1));
  cr_expect(eq(u64, s.stalls, 0));
  cr_expect(eq(sz, s.kept_bytes, 0));
  cr_expect(eq(int, ofl_disk_extent_state(e[0]), OFL_DISK_EXTENT_RESIDENT));
  /* evicted, it is read from the file again, byte for byte */
  cr_assert(eq(int, ofl_disk_extent_evict(e[0]), OFL_SUCCESS));
  cr_expect(eq(sz, disk_stats(d).kept_bytes, 0));
  cr_expect(eq(sz, reload_wrong(e[0], bytes, 0), 0));
  s = disk_stats(d);
  cr_expect(eq(u64, s.bytes_read, bytes));
  cr_expect(eq(u64, s.keep_hits, 1));
  ofl_disk_extent_destroy(e[0]);
  ofl_disk_close(d);
}

Test(disk_keep, the_newest_are_kept_and_the_rest_read_back) {
  ofl_disk_t *d = open_keep(2 * SPAN, 0);
  enum { N = 5 };
  ofl_disk_extent_t *e[N];
  write_all(d, e, N, SPAN);
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(sz, s.kept_bytes, 2 * SPAN));
  cr_expect(eq(u64, s.keep_drops, N - 2));
  /* reverse order, prefetching the next one, as in backward */
  for (int i = N - 1; i >= 0; i--) {
    if (i > 0)
      cr_assert(eq(int, ofl_disk_extent_prefetch(e[i - 1]), OFL_SUCCESS));
    cr_expect(eq(sz, reload_wrong(e[i], SPAN, i), 0), "extent %d", i);
    ofl_disk_extent_destroy(e[i]);
  }
  s = disk_stats(d);
  cr_expect(eq(u64, s.keep_hits, 2));
  cr_expect(eq(u64, s.bytes_read, (uint64_t)(N - 2) * SPAN));
  cr_expect(eq(u64, s.faults_corrupt, 0));
  cr_expect(eq(sz, s.kept_bytes, 0));
  ofl_disk_close(d);
}

Test(disk_keep, kept_buffers_give_way_when_the_bounce_pool_is_full) {
  /* a bounce budget of four buffers, all of them may be kept */
  ofl_disk_t *d = open_keep((size_t)1 << 30, 4 * SPAN);
  cr_expect(eq(sz, disk_stats(d).keep_bytes, 4 * SPAN)); /* capped */
  enum { N = 4 };
  ofl_disk_extent_t *e[N], *f[2];
  write_all(d, e, N, SPAN);
  cr_expect(eq(sz, disk_stats(d).kept_bytes, 4 * SPAN));
  /* two new extents (filled, not written) need two buffers: the two
   * oldest kept go */
  for (int i = 0; i < 2; i++) {
    cr_assert(eq(int, ofl_disk_extent_create(d, SPAN, &f[i]), OFL_SUCCESS),
              "%s", ofl_last_error());
    fill(ofl_disk_extent_data(f[i]), SPAN, 7 + (uint64_t)i);
  }
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(u64, s.buffer_refusals, 0));
  cr_expect(eq(u64, s.keep_drops, 2));
  cr_expect(eq(sz, s.kept_bytes, 2 * SPAN));
  cr_expect(eq(sz, count_wrong(ofl_disk_extent_data(f[0]), SPAN, 7), 0));
  cr_expect(eq(sz, count_wrong(ofl_disk_extent_data(f[1]), SPAN, 8), 0));
  ofl_disk_extent_destroy(f[0]);
  ofl_disk_extent_destroy(f[1]);
  for (int i = 0; i < N; i++) {
    cr_expect(eq(sz, reload_wrong(e[i], SPAN, i), 0), "extent %d", i);
    ofl_disk_extent_destroy(e[i]);
  }
  s = disk_stats(d);
  cr_expect(eq(u64, s.keep_hits, 2));                   /* e[2], e[3] */
  cr_expect(eq(u64, s.bytes_read, (uint64_t)2 * SPAN)); /* e[0], e[1] */
  /* with nothing kept and the pool full, a create is refused as before */
  ofl_disk_extent_t *g[5] = {0};
  int made = 0;
  while (made < 5 && ofl_disk_extent_create(d, SPAN, &g[made]) == OFL_SUCCESS)
    made++;
  cr_expect(eq(int, made, 4));
  cr_expect(eq(u64, disk_stats(d).buffer_refusals, 1));
  for (int i = 0; i < made; i++)
    ofl_disk_extent_destroy(g[i]);
  ofl_disk_close(d);
}

Test(disk_keep, drop_kept_gives_every_buffer_back) {
  ofl_disk_t *d = open_keep(8 * SPAN, 0);
  enum { N = 3 };
  ofl_disk_extent_t *e[N];
  write_all(d, e, N, SPAN);
  cr_expect(eq(sz, ofl_disk_drop_kept(d), 3 * SPAN));
  cr_expect(eq(sz, ofl_disk_drop_kept(d), 0));
  cr_expect(eq(sz, ofl_disk_drop_kept(NULL), 0));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(sz, s.kept_bytes, 0));
  cr_expect(eq(u64, s.keep_drops, N));
  for (int i = 0; i < N; i++) {
    cr_expect(eq(sz, reload_wrong(e[i], SPAN, i), 0), "extent %d", i);
    ofl_disk_extent_destroy(e[i]);
  }
  s = disk_stats(d);
  cr_expect(eq(u64, s.keep_hits, 0));
  cr_expect(eq(u64, s.bytes_read, (uint64_t)N * SPAN));
  ofl_disk_close(d);
}

Test(disk_keep, destroy_and_close_free_kept_buffers) {
  ofl_disk_t *d = open_keep(8 * SPAN, 0);
  ofl_disk_extent_t *e[3];
  write_all(d, e, 3, SPAN);
  ofl_disk_extent_destroy(e[1]); /* the middle of the keep list */
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(sz, s.kept_bytes, 2 * SPAN));
  cr_expect(eq(u64, s.extents, 2));
  cr_expect(eq(sz, reload_wrong(e[2], SPAN, 2), 0));
  cr_expect(eq(sz, reload_wrong(e[0], SPAN, 0), 0));
  cr_expect(eq(u64, disk_stats(d).keep_hits, 2));
  ofl_disk_extent_destroy(e[0]);
  /* e[2] stays alive: close destroys it with its buffer (valgrind and
   * ASan see a leak otherwise) */
  ofl_disk_close(d);
}

Test(disk_keep, a_failed_write_keeps_nothing_and_loses_nothing) {
  ofl_disk_t *d = open_keep(8 * SPAN, 0);
  ofl__disk_inject_fault(d, OFL__DISK_FAULT_WRITE_EIO, 0, 1);
  ofl_disk_extent_t *e = put(d, SPAN, 5);
  cr_expect(eq(int, ofl_disk_extent_wait(e, -1), OFL_ERR_IO));
  cr_expect(eq(int, ofl_disk_extent_state(e), OFL_DISK_EXTENT_HOST_ONLY));
  cr_expect(eq(sz, disk_stats(d).kept_bytes, 0));
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, SPAN, 5), 0));
  cr_expect(eq(u64, disk_stats(d).keep_hits, 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
}

Test(disk_keep, keep_from_the_environment_capped_and_off_for_a_shared_pool) {
  setenv("OFL_DISK_KEEP", "3M", 1);
  ofl_config_reload();
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  p.keep_bytes = OFL_DISK_FROM_ENV;
  p.bounce_budget_bytes = 0;
  ofl_disk_t *d = open_with(&p);
  cr_expect(eq(sz, disk_stats(d).keep_bytes, (size_t)3 << 20));
  ofl_disk_close(d);
  p.bounce_budget_bytes = 1 << 20; /* capped at the bounce budget */
  d = open_with(&p);
  cr_expect(eq(sz, disk_stats(d).keep_bytes, (size_t)1 << 20));
  ofl_disk_close(d);
  /* a pool shared with others: nothing kept unless asked for */
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_PINNED;
  pp.name = "shared";
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &pp, &pool), OFL_SUCCESS));
  p.bounce_pool = pool;
  d = open_with(&p);
  cr_expect(eq(sz, disk_stats(d).keep_bytes, 0));
  ofl_disk_close(d);
  p.keep_bytes = SPAN;
  d = open_with(&p);
  cr_expect(eq(sz, disk_stats(d).keep_bytes, SPAN));
  ofl_disk_close(d);
  ofl_pool_destroy(pool);
  /* a bad value is an error naming the variable */
  setenv("OFL_DISK_KEEP", "most", 1);
  ofl_config_reload();
  p.bounce_pool = NULL;
  p.keep_bytes = OFL_DISK_FROM_ENV;
  d = NULL;
  cr_expect(ne(int, ofl_disk_open(&p, &d), OFL_SUCCESS));
  cr_expect(eq(ptr, d, NULL));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "OFL_DISK_KEEP"), NULL), "%s",
            ofl_last_error());
  unsetenv("OFL_DISK_KEEP");
  ofl_config_reload();
}
