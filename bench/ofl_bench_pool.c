/* Tensor pool allocate+free on the hit path, in ns per pair, beside malloc +
 * free of the same size in the same run; also the byte-size key, the
 * handle-keeping path (alloc_into + release_storage), the stream-ordered
 * free, and two threads on one pool. Reports the backend allocations made
 * during the timed loops (steady state must make none). Goal: <= 100 ns per
 * pair on the hit path. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"
#include "bench/bench.h"

enum { PAIRS = 1000000, REPS = 5 };

static volatile uintptr_t sink;

static double ns_malloc(size_t n) {
  double best = 1e30;
  for (int r = 0; r < REPS; ++r) {
    uint64_t t0 = ofl__now_ns();
    for (int i = 0; i < PAIRS; ++i) {
      char *p = malloc(n);
      ((volatile char *)p)[0] = (char)i;
      sink ^= (uintptr_t)p;
      free(p);
    }
    double ns = (double)(ofl__now_ns() - t0) / PAIRS;
    if (ns < best)
      best = ns;
  }
  return best;
}

typedef enum { MODE_EXACT, MODE_DYNAMIC, MODE_INTO, MODE_AFTER } mode_t_;

typedef struct {
  ofl_pool_t *pool;
  int64_t shape[1];
  mode_t_ mode;
  ofl_stream_t *stream;
  double ns;
} job_t;

static double ns_pool_loop(job_t *j) {
  ofl_tensor_t *keep = NULL;
  if (j->mode == MODE_INTO)
    CHECK(ofl_tensor_create(j->shape, 1, OFL_DTYPE_U8, &keep));
  double best = 1e30;
  for (int r = 0; r < REPS; ++r) {
    uint64_t t0 = ofl__now_ns();
    for (int i = 0; i < PAIRS; ++i) {
      ofl_tensor_t *t = NULL;
      switch (j->mode) {
      case MODE_EXACT:
      case MODE_AFTER:
        CHECK(ofl_pool_alloc(j->pool, j->shape, 1, OFL_DTYPE_U8, NULL, &t));
        break;
      case MODE_DYNAMIC:
        CHECK(ofl_pool_alloc_dynamic(j->pool, j->shape, 1, OFL_DTYPE_U8, NULL,
                                     &t));
        break;
      case MODE_INTO:
        CHECK(ofl_pool_alloc_into(j->pool, keep, NULL));
        t = keep;
        break;
      }
      ((volatile char *)ofl_tensor_data(t))[0] = (char)i;
      sink ^= (uintptr_t)ofl_tensor_data(t);
      switch (j->mode) {
      case MODE_INTO:
        CHECK(ofl_tensor_release_storage(t));
        break;
      case MODE_AFTER:
        CHECK(ofl_pool_free_after(j->pool, t, j->stream));
        break;
      default:
        CHECK(ofl_pool_free(j->pool, t));
      }
    }
    double ns = (double)(ofl__now_ns() - t0) / PAIRS;
    if (ns < best)
      best = ns;
  }
  ofl_tensor_destroy(keep);
  return best;
}

static void *pool_thread(void *arg) {
  job_t *j = arg;
  j->ns = ns_pool_loop(j);
  return NULL;
}

int main(void) {
  setenv("OFL_BACKEND", "host", 0);
  ofl_config_reload();
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  dp.strict = 0;
  ofl_device_t *dev = NULL;
  CHECK(ofl_device_open(&dp, &dev));
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_PINNED;
  pp.budget_bytes = 0;
  ofl_pool_t *pool = NULL;
  CHECK(ofl_pool_create(dev, &pp, &pool));
  ofl_stream_t *compute = ofl_device_compute_stream(dev);

  printf("tensor pool allocate+free pairs vs malloc+free (best of %d x %d "
         "pairs, ns per pair; goal <= 100 ns on the hit path)\n",
         REPS, PAIRS);
  printf("%-10s %-22s %10s %12s %8s %14s\n", "size", "path", "pool_ns",
         "malloc_ns", "ratio", "backend_allocs");
  const size_t sizes[] = {256, 4096, 65536, 1u << 20, 16u << 20};
  const struct {
    mode_t_ mode;
    const char *name;
  } modes[] = {{MODE_EXACT, "exact key"},
               {MODE_DYNAMIC, "byte-size key"},
               {MODE_INTO, "alloc_into+release"},
               {MODE_AFTER, "free_after(compute)"}};
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; ++si) {
    size_t n = sizes[si];
    double m = ns_malloc(n);
    for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; ++mi) {
      job_t j = {pool, {(int64_t)n}, modes[mi].mode, compute, 0};
      /* Warm the key so the timed loop is all hits. */
      ofl_tensor_t *w = NULL;
      if (j.mode == MODE_DYNAMIC)
        CHECK(ofl_pool_alloc_dynamic(pool, j.shape, 1, OFL_DTYPE_U8, NULL, &w));
      else
        CHECK(ofl_pool_alloc(pool, j.shape, 1, OFL_DTYPE_U8, NULL, &w));
      CHECK(ofl_pool_free(pool, w));
      ofl_device_stats_t d0, d1;
      ofl_device_get_stats(dev, &d0);
      double ns = ns_pool_loop(&j);
      ofl_device_get_stats(dev, &d1);
      printf("%-10zu %-22s %10.1f %12.1f %8.2f %14llu\n", n, modes[mi].name, ns,
             m, ns / m,
             (unsigned long long)(d1.pinned_allocs - d0.pinned_allocs));
    }
  }

  /* Two threads on one pool, each with its own key. */
  job_t jobs[2] = {{pool, {4096}, MODE_EXACT, compute, 0},
                   {pool, {8192}, MODE_EXACT, compute, 0}};
  for (int i = 0; i < 2; ++i) {
    ofl_tensor_t *w = NULL;
    CHECK(ofl_pool_alloc(pool, jobs[i].shape, 1, OFL_DTYPE_U8, NULL, &w));
    CHECK(ofl_pool_free(pool, w));
  }
  ofl_device_stats_t d0, d1;
  ofl_device_get_stats(dev, &d0);
  pthread_t th[2];
  for (int i = 0; i < 2; ++i)
    pthread_create(&th[i], NULL, pool_thread, &jobs[i]);
  for (int i = 0; i < 2; ++i)
    pthread_join(th[i], NULL);
  ofl_device_get_stats(dev, &d1);
  double m = ns_malloc(4096);
  printf("%-10s %-22s %10.1f %12.1f %8.2f %14llu\n", "4096+8192",
         "2 threads, one pool", (jobs[0].ns + jobs[1].ns) / 2, m,
         (jobs[0].ns + jobs[1].ns) / 2 / m,
         (unsigned long long)(d1.pinned_allocs - d0.pinned_allocs));

  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  printf("pool: requests %llu hits %llu misses %llu backend_allocs %llu\n",
         (unsigned long long)s.requests, (unsigned long long)s.hits,
         (unsigned long long)s.misses, (unsigned long long)s.backend_allocs);
  ofl_pool_destroy(pool);
  ofl_device_close(dev);
  return 0;
}
