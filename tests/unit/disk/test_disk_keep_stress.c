/* Stress: user threads drive their own extents (write_after on a
 * stream, prefetch racing the write, reload, evict, destroy) while the pool
 * is small, so kept buffers are dropped across threads; another thread calls
 * ofl_disk_drop_kept. */
#include <pthread.h>
#include "tests/support/disk_test_util.h"

TestSuite(disk_keep_stress, .init = disk_setup, .fini = disk_teardown);

#define SP ((size_t)16 << 10)
enum { T = 4, ITERS = 300, K = 6 };
static ofl_disk_t *D;
static atomic_int stop_drop, bad, rerr;

static void *dropper(void *a) {
  (void)a;
  while (!atomic_load(&stop_drop)) {
    static unsigned c;
    c++;
    if (c % 3 == 0)
      ofl_disk_drop_kept(D);
    if (c % 7 == 0)
      ofl__disk_inject_fault(D, OFL__DISK_FAULT_WRITE_EIO, c % 5, 1);
    if (c % 11 == 0)
      ofl__disk_inject_fault(D, OFL__DISK_FAULT_READ_CORRUPT, c % 3, 1);
    if (c % 13 == 0)
      ofl__disk_inject_fault(D, OFL__DISK_FAULT_READ_EIO, c % 3, 1);
    ofl_disk_clear_degraded(D);
    usleep(200);
  }
  return NULL;
}

static void *worker(void *a) {
  int id = (int)(intptr_t)a;
  ofl_stream_t *s = NULL;
  if (ofl_stream_create(dev, "w", &s) != OFL_SUCCESS) {
    atomic_fetch_add(&bad, 1);
    return NULL;
  }
  unsigned r = (unsigned)id * 7919u + 1;
  for (int it = 0; it < ITERS; it++) {
    ofl_disk_extent_t *e[K] = {0};
    size_t bytes[K];
    int n = 0;
    for (int k = 0; k < K; k++) {
      r = r * 1103515245u + 12345u;
      bytes[k] = SP - (r % 1000) * (k & 1);
      if (ofl_disk_extent_create(D, bytes[k], &e[k]) != OFL_SUCCESS) {
        e[k] = NULL;
        continue;
      }
      if (r % 17 == 0) {
        fill(ofl_disk_extent_data(e[k]), bytes[k], 1);
        ofl_disk_extent_write(e[k]);
        ofl_disk_extent_destroy(e[k]);
        e[k] = NULL;
        continue;
      }
      fill(ofl_disk_extent_data(e[k]), bytes[k],
           (uint64_t)id * 100000 + it * 10 + k);
      if (k & 1)
        ofl_disk_extent_write(e[k]);
      else
        ofl_disk_extent_write_after(e[k], s);
      if (r % 3 == 0)
        ofl_disk_extent_prefetch(e[k]);
      n++;
    }
    for (int k = K - 1; k >= 0; k--) {
      if (!e[k])
        continue;
      r = r * 1103515245u + 12345u;
      if (r % 4 == 0) {
        ofl_disk_extent_wait(e[k], -1);
        if (ofl_disk_extent_state(e[k]) == OFL_DISK_EXTENT_RESIDENT)
          ofl_disk_extent_evict(e[k]);
      }
      if (r % 5 == 0)
        ofl_disk_extent_prefetch(e[k]);
      void *p = NULL;
      ofl_status_t st;
      do {
        st = ofl_disk_extent_reload(e[k], -1, &p);
        if (st == OFL_ERR_NO_MEMORY)
          usleep(100);
        if (st == OFL_ERR_IO || st == OFL_ERR_CORRUPT)
          atomic_fetch_add(&rerr, 1);
      } while (st == OFL_ERR_NO_MEMORY || st == OFL_ERR_IO ||
               st == OFL_ERR_CORRUPT);
      if (st != OFL_SUCCESS) {
        fprintf(stderr, "reload %d\n", st);
        atomic_fetch_add(&bad, 1);
      } else if (count_wrong(p, bytes[k],
                             (uint64_t)id * 100000 + it * 10 + k)) {
        fprintf(stderr, "wrong bytes t%d it%d k%d\n", id, it, k);
        atomic_fetch_add(&bad, 1);
      }
      if (r % 2)
        ofl_disk_extent_destroy(e[k]);
      else {
        ofl_disk_extent_destroy_after(e[k], s);
      }
    }
    ofl_stream_synchronize(s, -1);
  }
  ofl_stream_synchronize(s, -1);
  ofl_stream_destroy(s);
  return NULL;
}

static void run(ofl_disk_engine_t eng) {
  ofl_disk_params_t p = params_for(eng, 1);
  p.keep_bytes = 5 * SP;
  p.bounce_budget_bytes = 3 * T * SP;
  D = open_with(&p);
  atomic_store(&stop_drop, 0);
  atomic_store(&bad, 0);
  pthread_t th[T], dt;
  pthread_create(&dt, NULL, dropper, NULL);
  for (int i = 0; i < T; i++)
    pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i);
  for (int i = 0; i < T; i++)
    pthread_join(th[i], NULL);
  atomic_store(&stop_drop, 1);
  pthread_join(dt, NULL);
  ofl_disk_stats_t s = disk_stats(D);
  fprintf(stderr,
          "read faults %d engine %d keep_hits %llu drops %llu kept %zu "
          "refusals %llu extents %llu\n",
          atomic_load(&rerr), (int)eng, (unsigned long long)s.keep_hits,
          (unsigned long long)s.keep_drops, s.kept_bytes,
          (unsigned long long)s.buffer_refusals, (unsigned long long)s.extents);
  cr_expect(eq(sz, s.kept_bytes, 0));
  cr_expect(eq(u64, s.extents, 0));
  cr_expect(gt(u64, s.keep_hits, 0)); /* the paths under test were taken */
  cr_expect(gt(u64, s.keep_drops, 0));
  cr_expect(eq(int, atomic_load(&bad), 0));
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(D->pool, &ps);
  cr_expect(eq(u64, ps.blocks_in_use, 0), "pool blocks in use %llu",
            (unsigned long long)ps.blocks_in_use);
  ofl_disk_close(D);
}

Test(disk_keep_stress, threads) { run(OFL_DISK_ENGINE_THREADS); }
#if OFL_HAVE_LIBURING
Test(disk_keep_stress, uring) { run(OFL_DISK_ENGINE_URING); }
#endif
