/* Bookkeeping of the pipeline offload manager per offloaded tensor: push,
 * commit (D2H enqueue), backward begin, pop, backward end (H2D enqueue of
 * the prefetch) and reset, with copies made negligible (64-byte tensors,
 * threshold 0, host backend without strict mode or jitter). Steady-state
 * iterations of one pipeline stage (4 microbatches x 8 groups), in ns per
 * tensor and per group, for 1, 16 and 64 tensors per group, beside the cost
 * of the device layer's own calls that one offloaded tensor needs (the
 * floor). A second row per size keeps every tensor under the threshold:
 * the manager's own bookkeeping (push, commit decision, backward markers,
 * pop, reset) without any stream operation. Goal: <= 1 us per tensor and
 * <= 20 us per group. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"
#include "bench/bench.h"

enum { MBS = 4, GROUPS = 8, BYTES = 64, REPS = 5 };
static const char *const names[2] = {"core_attn", "attn_proj"};

typedef struct {
  ofl_manager_t *m;
  int per_group;
  ofl_tensor_t **t; /* [MBS][GROUPS][per_group] */
  ofl_tag_t *tag;
} run_t;

static ofl_tensor_t **slot(run_t *r, int mb, int g, int k) {
  return &r->t[((size_t)mb * GROUPS + g) * r->per_group + k];
}

/* One 1F1B iteration of the last stage: F0 B0 F1 B1 ... */
static void iteration(run_t *r) {
  for (int mb = 0; mb < MBS; mb++) {
    CHECK(ofl_manager_chunk_begin(r->m, 1, 0));
    for (int g = 0; g < GROUPS; g++) {
      CHECK(ofl_manager_group_start(r->m, names[g & 1]));
      for (int k = 0; k < r->per_group; k++)
        CHECK(ofl_manager_tensor_push(
            r->m, *slot(r, mb, g, k),
            &r->tag[((size_t)mb * GROUPS + g) * r->per_group + k]));
      CHECK(ofl_manager_group_commit(r->m, names[g & 1], NULL, 0, 0));
    }
    for (int g = GROUPS - 1; g >= 0; g--) {
      CHECK(ofl_manager_group_backward_begin(r->m, names[g & 1]));
      for (int k = r->per_group - 1; k >= 0; k--)
        CHECK(ofl_manager_tensor_pop(
            r->m, r->tag[((size_t)mb * GROUPS + g) * r->per_group + k],
            slot(r, mb, g, k)));
      CHECK(ofl_manager_group_backward_end(r->m, names[g & 1]));
    }
  }
  CHECK(ofl_manager_reset(r->m));
}

/* The device calls one offloaded tensor costs at least: a D2H and an H2D
 * enqueue, two pool hits (pinned, device) and their frees after a stream. */
static double floor_ns(ofl_device_t *dev, ofl_pool_t *hp, ofl_pool_t *dp,
                       ofl_stream_t *d2h, ofl_stream_t *h2d) {
  enum { N = 20000 };
  int64_t shape[1] = {BYTES};
  double best = 1e30;
  for (int rep = 0; rep < REPS; rep++) {
    uint64_t t0 = ofl__now_ns();
    for (int i = 0; i < N; i++) {
      ofl_tensor_t *h, *d;
      CHECK(ofl_pool_alloc(hp, shape, 1, OFL_DTYPE_U8, d2h, &h));
      CHECK(ofl_pool_alloc(dp, shape, 1, OFL_DTYPE_U8, h2d, &d));
      CHECK(ofl_memcpy_async(ofl_tensor_data(h), ofl_tensor_data(d), BYTES,
                             OFL_COPY_D2H, d2h));
      CHECK(ofl_memcpy_async(ofl_tensor_data(d), ofl_tensor_data(h), BYTES,
                             OFL_COPY_H2D, h2d));
      CHECK(ofl_pool_free_after(hp, h, h2d));
      CHECK(ofl_pool_free_after(dp, d, d2h));
    }
    CHECK(ofl_stream_synchronize(d2h, -1));
    CHECK(ofl_stream_synchronize(h2d, -1));
    double ns = (double)(ofl__now_ns() - t0) / N;
    if (ns < best)
      best = ns;
  }
  (void)dev;
  return best;
}

int main(void) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  dp.strict = 0;
  ofl_device_t *dev = NULL;
  CHECK(ofl_device_open(&dp, &dev));
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  ofl_pool_t *act = NULL;
  CHECK(ofl_pool_create(dev, &pp, &act));

  printf("pipeline manager bookkeeping, host backend, %d-byte tensors, "
         "threshold 0, %d microbatches x %d groups, best of %d steady-state "
         "runs\n",
         BYTES, MBS, GROUPS, REPS);
  printf("%-9s %-10s %12s %12s %14s %10s %9s %9s\n", "tensors", "copies",
         "ns/tensor", "ns/group", "floor ns/t", "ratio", "offl/it", "allocs");
  const int per[3] = {1, 16, 64};
  for (int row = 0; row < 6; row++) {
    int pi = row / 2;
    int copies = !(row & 1);
    ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
    mp.device = dev;
    mp.device_pool = act;
    mp.offload = 1;
    mp.groups = "";
    mp.min_offload_bytes = copies ? 0 : BYTES + 1;
    mp.min_offload_elems = 0;
    mp.fraction = 1.0;
    mp.rank_delta_bytes = 0;
    mp.max_inflight = 0;
    mp.host_budget_bytes = 0;
    run_t r = {0};
    r.per_group = per[pi];
    CHECK(ofl_manager_create(&mp, &r.m));
    size_t n = (size_t)MBS * GROUPS * (size_t)r.per_group;
    r.t = calloc(n, sizeof *r.t);
    r.tag = calloc(n, sizeof *r.tag);
    int64_t shape[1] = {BYTES};
    for (size_t i = 0; i < n; i++)
      CHECK(ofl_pool_alloc(act, shape, 1, OFL_DTYPE_U8, NULL, &r.t[i]));
    iteration(&r); /* warmup */
    iteration(&r);
    ofl_manager_stats_t s0, s1;
    ofl_device_stats_t d0, d1;
    int iters = (pi == 0 ? 2000 : pi == 1 ? 200 : 50) * (copies ? 1 : 10);
    double best = 1e30;
    uint64_t offl = 0;
    ofl_device_get_stats(dev, &d0);
    for (int rep = 0; rep < REPS; rep++) {
      ofl_manager_get_stats(r.m, &s0);
      uint64_t t0 = ofl__now_ns();
      for (int it = 0; it < iters; it++)
        iteration(&r);
      CHECK(ofl_manager_synchronize(r.m, -1));
      double ns = (double)(ofl__now_ns() - t0) / iters;
      ofl_manager_get_stats(r.m, &s1);
      offl = (s1.offloaded_tensors - s0.offloaded_tensors) / (uint64_t)iters;
      if (ns < best)
        best = ns;
    }
    ofl_device_get_stats(dev, &d1);
    double per_tensor = best / (double)n;
    double per_group = best / (double)(MBS * GROUPS);
    double fl = copies ? floor_ns(dev, ofl_manager_host_pool(r.m), act,
                                  ofl_manager_d2h_stream(r.m),
                                  ofl_manager_h2d_stream(r.m))
                       : 0.0;
    printf("%-9d %-10s %12.0f %12.0f %14.0f %10.2f %9llu %9llu\n", r.per_group,
           copies ? "yes" : "no (bk)", per_tensor, per_group, fl,
           copies ? per_tensor / fl : 0.0, (unsigned long long)offl,
           (unsigned long long)((d1.device_allocs - d0.device_allocs) +
                                (d1.pinned_allocs - d0.pinned_allocs)));
    ofl_manager_destroy(r.m);
    for (size_t i = 0; i < n; i++)
      ofl_tensor_destroy(r.t[i]);
    free(r.t);
    free(r.tag);
  }
  printf("ns/tensor and ns/group: whole iteration (forward and backward "
         "markers, push, pop, reset) divided by tensors or groups; floor: "
         "the device and pool calls one offloaded tensor needs at least "
         "(host backend: a worker-thread handoff per stream operation); "
         "copies no (bk): every tensor under the threshold, the manager's "
         "own bookkeeping; "
         "offl/it: tensors offloaded per iteration (the policy keeps some "
         "groups); allocs: device and pinned allocations in the timed "
         "runs\n");
  ofl_pool_destroy(act);
  ofl_device_close(dev);
  return 0;
}
