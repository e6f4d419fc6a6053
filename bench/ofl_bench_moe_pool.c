/* Pools under a sparse MoE workload: expert_fc1 and moe_act change size
 * every microbatch. The tests' 1F1B driver (pp 4, rank 0, 8 microbatches,
 * 2 layers, the seven group names, sizes in [1 KiB, 1 MiB], byte-keyed
 * blocks for the two expert groups) runs a warmup and 12 settling
 * iterations, then 20 counted ones. Per pool it prints the backend calls in
 * the counted iterations, the bytes held, the peak bytes in use and their
 * ratio (goal: 0 calls, ratio <= 1.3); per device the allocations and, on
 * the cudasim stand-in, cudaMalloc/cudaFree/cudaHostRegister/Unregister.
 * Then the pool hit path (allocate+free of a cached block), ns per pair.
 *
 * OFL_BENCH_SEED picks another draw of the sizes (default 2024).
 *
 * Without arguments it runs on the host backend, then runs itself again on
 * the cuda backend over the stand-in (OFL_BENCH_CUDASIM_DIR, set by meson)
 * when that was built; `host` or `cuda` runs one backend in this process. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "bench/bench.h"
#include "runtime/internal.h"
#include "tests/support/driver.h"

enum { SETTLE = 12, COUNTED = 20, HIT_PAIRS = 200000, HIT_REPS = 5 };

static void print_pool(const char *name, const ofl_pool_stats_t *a,
                       const ofl_pool_stats_t *b) {
  size_t held = b->held_bytes;
  double ratio =
      b->peak_in_use_bytes ? (double)held / (double)b->peak_in_use_bytes : 0;
  printf("  pool %-14s backend allocs %4llu frees %4llu  held %10zu  peak in "
         "use %10zu  held/peak %.3f  segments %llu (%zu bytes)  misses "
         "%llu\n",
         name, (unsigned long long)(b->backend_allocs - a->backend_allocs),
         (unsigned long long)(b->backend_frees - a->backend_frees), held,
         b->peak_in_use_bytes, ratio, (unsigned long long)b->segments,
         b->segment_bytes, (unsigned long long)(b->misses - a->misses));
}

static void run_moe(ofl_backend_t be) {
  drv_cfg_t cfg = {0};
  cfg.pp = 4;
  cfg.rank = 0;
  cfg.vpp = 1;
  cfg.mbs = 8;
  cfg.layers = 2;
  cfg.names_mask = 0x7f;
  cfg.tensors_max = 3;
  cfg.thresh = 1024;
  cfg.size_lo = 1024;
  cfg.size_hi = 1u << 20;
  cfg.seed = getenv("OFL_BENCH_SEED")
                 ? strtoull(getenv("OFL_BENCH_SEED"), NULL, 10)
                 : 2024;
  cfg.offload = 1;
  cfg.keyed_by_bytes = 1;
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = be;
  dp.strict = 0;
  dp.jitter_max_us = 0;
  CHECK(ofl_device_open(&dp, &cfg.dev));
  drv_t d;
  if (drv_open(&d, &cfg) != OFL_SUCCESS) {
    fprintf(stderr, "driver: %s\n", d.msg);
    exit(1);
  }
  for (int it = 0; it < 1 + SETTLE; it++)
    if (drv_iteration(&d) != OFL_SUCCESS) {
      fprintf(stderr, "iteration %d: %s\n", it, d.msg);
      exit(1);
    }
  ofl_pool_t *act = d.pool, *host = ofl_manager_host_pool(d.m);
  ofl_pool_stats_t w0, w1;
  ofl_pool_get_stats(act, &w0);
  ofl_pool_get_stats(host, &w1);
  ofl_pool_reset_peak(act);
  ofl_pool_reset_peak(host);
  ofl_pool_stats_t a0, a1, h0, h1;
  ofl_device_stats_t d0, d1;
  cudasim_stats_t c0, c1;
  /* The stand-in is what was loaded when its counters are there (a real
   * libcudart has no cudasim_get_stats), whichever way it got loaded. */
  int sim = t_sim_stats(&c0);
  ofl_pool_get_stats(act, &a0);
  ofl_pool_get_stats(host, &h0);
  ofl_device_get_stats(cfg.dev, &d0);
  uint64_t t0 = ofl__now_ns();
  for (int it = 0; it < COUNTED; it++)
    if (drv_iteration(&d) != OFL_SUCCESS) {
      fprintf(stderr, "iteration %d: %s\n", it, d.msg);
      exit(1);
    }
  double ms = (double)(ofl__now_ns() - t0) / 1e6 / COUNTED;
  ofl_pool_get_stats(act, &a1);
  ofl_pool_get_stats(host, &h1);
  ofl_device_get_stats(cfg.dev, &d1);
  if (sim)
    t_sim_stats(&c1);
  printf("moe workload, %s backend: 1F1B pp 4 rank 0, 8 microbatches, 2 "
         "layers, 7 groups, sizes 1 KiB..1 MiB (seed %llu); %d counted "
         "iterations after 1 + %d (%.1f ms each), wrong bytes %zu\n",
         be != OFL_BACKEND_CUDA ? "host"
         : sim                  ? "cuda (stand-in)"
                                : "cuda",
         (unsigned long long)cfg.seed, COUNTED, SETTLE, ms, d.wrong_bytes);
  print_pool("activations", &a0, &a1);
  print_pool("offload-host", &h0, &h1);
  printf("  peak in use before the counted iterations (warmup included): "
         "activations %zu, offload-host %zu\n",
         w0.peak_in_use_bytes, w1.peak_in_use_bytes);
  printf("  device: device allocs %llu frees %llu, pinned allocs %llu frees "
         "%llu\n",
         (unsigned long long)(d1.device_allocs - d0.device_allocs),
         (unsigned long long)(d1.device_frees - d0.device_frees),
         (unsigned long long)(d1.pinned_allocs - d0.pinned_allocs),
         (unsigned long long)(d1.pinned_frees - d0.pinned_frees));
  if (sim)
    printf("  stand-in: cudaMalloc %llu cudaFree %llu cudaHostRegister %llu "
           "cudaHostUnregister %llu cudaMallocHost %llu\n",
           (unsigned long long)(c1.device_mallocs - c0.device_mallocs),
           (unsigned long long)(c1.device_frees - c0.device_frees),
           (unsigned long long)(c1.host_registers - c0.host_registers),
           (unsigned long long)(c1.host_unregisters - c0.host_unregisters),
           (unsigned long long)(c1.host_allocs - c0.host_allocs));
  drv_close(&d);
  ofl_device_close(cfg.dev);
}

/* ns per allocate+free pair of cached blocks: 16 sizes allocated, then
 * freed, in rounds (every allocation a hit after the first round). */
static double hit_ns(ofl_device_t *dev, ofl_pool_kind_t kind, int dynamic) {
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = kind;
  pp.budget_bytes = 0;
  ofl_pool_t *pool = NULL;
  CHECK(ofl_pool_create(dev, &pp, &pool));
  enum { NSIZES = 16 };
  int64_t shape[NSIZES];
  for (int i = 0; i < NSIZES; i++)
    shape[i] = (int64_t)(1024 + (size_t)i * 61 * 1024);
  double best = 1e30;
  for (int r = 0; r < HIT_REPS + 1; r++) {
    uint64_t t0 = ofl__now_ns();
    for (int i = 0; i < HIT_PAIRS; i += NSIZES) {
      ofl_tensor_t *t[NSIZES];
      for (int j = 0; j < NSIZES; j++) {
        if (dynamic)
          CHECK(ofl_pool_alloc_dynamic(pool, &shape[j], 1, OFL_DTYPE_U8, NULL,
                                       &t[j]));
        else
          CHECK(ofl_pool_alloc(pool, &shape[j], 1, OFL_DTYPE_U8, NULL, &t[j]));
      }
      for (int j = 0; j < NSIZES; j++)
        CHECK(ofl_pool_free(pool, t[j]));
    }
    double ns = (double)(ofl__now_ns() - t0) / HIT_PAIRS;
    if (r > 0 && ns < best) /* round 0 creates the blocks */
      best = ns;
  }
  ofl_pool_destroy(pool);
  return best;
}

static void run_hits(void) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  dp.strict = 0;
  ofl_device_t *dev = NULL;
  CHECK(ofl_device_open(&dp, &dev));
  printf("pool hit path, host backend: allocate+free of a cached block, 16 "
         "sizes held at once, best of %d x %d pairs, ns per pair\n",
         HIT_REPS, HIT_PAIRS);
  const char *kn[2] = {"device", "pinned"};
  for (int k = 0; k < 2; k++)
    for (int dyn = 0; dyn < 2; dyn++)
      printf("  %-7s %-14s %7.1f ns\n", kn[k],
             dyn ? "byte-size key" : "shape key",
             hit_ns(dev, k ? OFL_POOL_PINNED : OFL_POOL_DEVICE, dyn));
  ofl_device_close(dev);
}

int main(int argc, char **argv) {
  const char *only = argc > 1 ? argv[1] : NULL;
  if (only == NULL || strcmp(only, "host") == 0) {
    setenv("OFL_BACKEND", "host", 1);
    ofl_config_reload();
    run_moe(OFL_BACKEND_HOST);
    run_hits();
  }
  if (only != NULL && strcmp(only, "cuda") == 0) {
    setenv("OFL_BACKEND", "cuda", 1);
    ofl_config_reload();
    run_moe(OFL_BACKEND_CUDA);
  }
#ifdef OFL_BENCH_CUDASIM_DIR
  if (only == NULL) {
    /* The stand-in replaces libcudart through the library path: a fresh
     * process. */
    fflush(stdout);
    setenv("LD_LIBRARY_PATH", OFL_BENCH_CUDASIM_DIR, 1);
    setenv("CUDASIM_JITTER_US", "0", 1);
    setenv("OFL_BACKEND", "cuda", 1);
    execl("/proc/self/exe", argv[0], "cuda", (char *)NULL);
    perror("exec of the stand-in run");
    return 1;
  }
#endif
  return 0;
}
