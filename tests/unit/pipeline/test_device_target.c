/* The device-level memory target (params.device_memory_target_bytes,
 * OFL_DEVICE_MEMORY_TARGET) of the auto plan: the warmup's device peak less
 * its activation peak with every group offloaded is what is not activations
 * (here "weights" the test allocates from the device before the warmup), and
 * the plan aims the activations at the rest of the target. The figures are
 * checked against the device's stats; a target at or below the rest fails
 * the warmup's reset with both figures and offloads everything; the tighter
 * of the two targets wins; an application's own peak replaces the device's
 * stats; every popped tensor is bit-exact. */
#include "tests/support/harness.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#define PP 4
#define RANK 0
#define MBS 6
#define LAYERS 2
#define NG 3
#define MAXT 2
#define WEIGHTS (3u << 20)

typedef struct {
  const char *name;
  size_t bytes; /* per tensor */
  int tensors;
} gdef_t;

static const gdef_t WORKLOAD[NG] = {
    {"core_attn", 256 << 10, 2},
    {"mlp", 192 << 10, 1},
    {"moe_act", 64 << 10, 1},
};

typedef struct {
  h_env_t e;
  void *weights;
  ofl_tag_t tag[MBS][LAYERS][NG][MAXT];
  uint64_t seed[MBS][LAYERS][NG][MAXT];
  size_t wrong;
  int iter;
} run_t;

static void forward(run_t *r, int mb) {
  ofl_manager_t *m = r->e.m;
  H_OK(ofl_manager_chunk_begin(m, 1, 0));
  for (int l = 0; l < LAYERS; l++)
    for (int k = 0; k < NG; k++) {
      const gdef_t *d = &WORKLOAD[k];
      H_OK(ofl_manager_group_start(m, d->name));
      for (int t = 0; t < d->tensors; t++) {
        uint64_t s = ((uint64_t)r->iter << 32) ^ ((uint64_t)mb << 20) ^
                     ((uint64_t)l << 12) ^ ((uint64_t)k << 4) ^ (uint64_t)t;
        r->seed[mb][l][k][t] = s;
        ofl_tensor_t *x = h_tensor(&r->e, d->bytes, s);
        H_OK(ofl_manager_tensor_push(m, x, &r->tag[mb][l][k][t]));
      }
      H_OK(ofl_manager_group_commit(m, d->name, NULL, 0, 0));
    }
}

static void backward(run_t *r, int mb) {
  ofl_manager_t *m = r->e.m;
  for (int l = LAYERS; l-- > 0;)
    for (int k = NG; k-- > 0;) {
      const gdef_t *d = &WORKLOAD[k];
      H_OK(ofl_manager_group_backward_begin(m, d->name));
      for (int t = d->tensors; t-- > 0;)
        r->wrong += h_pop_check(&r->e, r->tag[mb][l][k][t], d->bytes,
                                r->seed[mb][l][k][t]);
      H_OK(ofl_manager_group_backward_end(m, d->name));
    }
}

/* The forwards and backwards of one iteration of a 1F1B schedule. */
static void steps_of(run_t *r) {
  drv_step_t steps[2 * MBS];
  int n = drv_schedule(PP, RANK, 1, MBS, steps);
  for (int i = 0; i < n; i++) {
    if (steps[i].fwd)
      forward(r, steps[i].mb);
    else
      backward(r, steps[i].mb);
  }
  r->iter++;
}

/* One iteration; returns the reset's status. */
static ofl_status_t iteration(run_t *r) {
  steps_of(r);
  return ofl_manager_reset(r->e.m);
}

/* The bytes that are not activations, as the warmup's reset reads them:
 * the device's peak less the activation pool's (read before that reset,
 * which starts the pool's steady-state peak). */
static uint64_t rest_now(run_t *r) {
  ofl_device_stats_t ds;
  ofl_pool_stats_t ps;
  ofl_device_get_stats(r->e.dev, &ds);
  ofl_pool_get_stats(r->e.pool, &ps);
  return ds.device_bytes_peak - ps.peak_in_use_bytes;
}

/* The warmup: returns its reset's status, *rest as rest_now saw it. */
static ofl_status_t warmup(run_t *r, uint64_t *rest) {
  steps_of(r);
  *rest = rest_now(r);
  return ofl_manager_reset(r->e.m);
}

/* A device with WEIGHTS bytes of it taken before the manager exists. */
static void open_run(run_t *r, int64_t device_target, int64_t act_target) {
  memset(r, 0, sizeof *r);
  h_open_dev(&r->e, 0, 1);
  H_OK(ofl_device_malloc(r->e.dev, WEIGHTS, &r->weights));
  ofl_manager_params_t mp = h_params(&r->e);
  mp.groups = "auto";
  mp.memory_target_bytes = act_target;
  mp.device_memory_target_bytes = device_target;
  mp.pp_rank = RANK;
  H_OK(ofl_manager_create(&mp, &r->e.m));
}

static void close_run(run_t *r) {
  ofl_manager_destroy(r->e.m);
  r->e.m = NULL;
  H_OK(ofl_device_free(r->e.dev, r->weights));
  ofl_pool_destroy(r->e.pool);
  ofl_device_close(r->e.dev);
}

static void plan_of(run_t *r, ofl_manager_plan_t *p) {
  H_OK(ofl_manager_plan_get(r->e.m, p));
  cr_assert(eq(int, p->automatic, 1));
}

/* The non-activation bytes a warmup measured, and the plan's extremes. */
typedef struct {
  uint64_t rest, all, none;
} figures_t;

static figures_t warmup_figures(void) {
  run_t r;
  open_run(&r, INT64_C(1) << 40, 0); /* a target that is always met */
  figures_t f;
  H_OK(warmup(&r, &f.rest));
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  f.all = p.peak_all_bytes;
  f.none = p.peak_none_bytes;
  cr_assert(eq(u64, p.target_bytes, (UINT64_C(1) << 40) - f.rest),
            "activation target %" PRIu64 ", rest %" PRIu64, p.target_bytes,
            f.rest);
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
  return f;
}

Test(device_target, the_rest_of_the_target_goes_to_activations) {
  figures_t f = warmup_figures();
  /* The weights are not activations: the rest holds them (and the pool's
   * blocks beyond the activations' modelled peak, if any). */
  cr_assert(ge(u64, f.rest, WEIGHTS), "rest %" PRIu64 " below the weights",
            f.rest);
  cr_assert(lt(u64, f.rest, (uint64_t)WEIGHTS + f.none),
            "rest %" PRIu64 " holds more than weights and activations", f.rest);
  cr_assert(lt(u64, f.all, f.none));
  /* A device target leaving the activations two thirds of the way from
   * "everything offloaded" to "nothing". */
  uint64_t act = f.all + (f.none - f.all) * 2 / 3;
  uint64_t dev = f.rest + act;
  run_t r;
  open_run(&r, (int64_t)dev, 0);
  uint64_t rest;
  H_OK(warmup(&r, &rest));
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  cr_assert(eq(u64, p.target_bytes, dev - rest));
  cr_assert(eq(int, p.met, 1));
  cr_assert(le(u64, p.predicted_peak_bytes, dev - rest));
  size_t kept = 0;
  for (size_t i = 0; i < ofl_manager_group_plan_count(r.e.m); i++) {
    ofl_group_plan_t gp;
    H_OK(ofl_manager_group_plan(r.e.m, i, &gp));
    kept += gp.reason == OFL_KEEP_AUTO_PLAN;
  }
  cr_assert(gt(sz, kept, 0), "room for activations, and nothing kept");
  for (int i = 0; i < 8; i++)
    H_OK(iteration(&r));
  plan_of(&r, &p);
  /* Weights plus the activations the ledger measured stay within the
   * device target once the plan's feedback settled. */
  cr_assert(le(u64, p.measured_peak_settled_bytes + WEIGHTS, dev),
            "settled activation peak %" PRIu64 " + weights over %" PRIu64,
            p.measured_peak_settled_bytes, dev);
  cr_assert(eq(sz, r.wrong, 0), "%zu wrong bytes", r.wrong);
  close_run(&r);
}

Test(device_target, below_the_rest_fails_the_warmup_with_both_figures) {
  run_t r;
  uint64_t dev = WEIGHTS / 2;
  open_run(&r, (int64_t)dev, 0);
  uint64_t rest;
  ofl_status_t s = warmup(&r, &rest);
  cr_assert(eq(int, s, OFL_ERR_CONFIG), "%s", ofl_status_str(s));
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  char want[64];
  const char *err = ofl_last_error();
  snprintf(want, sizeof want, "%" PRIu64 " bytes", dev);
  cr_assert(not(eq(ptr, strstr(err, want), NULL)), "no target in: %s", err);
  snprintf(want, sizeof want, "%" PRIu64 " bytes", rest);
  cr_assert(not(eq(ptr, strstr(err, want), NULL)), "no rest in: %s", err);
  /* Everything that may go is offloaded, and training goes on exactly. */
  cr_assert(eq(u64, p.predicted_peak_bytes, p.peak_all_bytes));
  for (size_t i = 0; i < ofl_manager_group_plan_count(r.e.m); i++) {
    ofl_group_plan_t gp;
    H_OK(ofl_manager_group_plan(r.e.m, i, &gp));
    cr_assert(not(eq(int, gp.reason, OFL_KEEP_AUTO_PLAN)), "group %zu kept", i);
  }
  for (int i = 0; i < 3; i++)
    H_OK(iteration(&r));
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

Test(device_target, the_tighter_target_wins) {
  figures_t f = warmup_figures();
  uint64_t mid = f.all + (f.none - f.all) / 2;
  /* The activation target is tighter. */
  run_t r;
  open_run(&r, (int64_t)(f.rest + f.none * 4), (int64_t)mid);
  H_OK(iteration(&r));
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  cr_assert(eq(u64, p.target_bytes, mid));
  H_OK(iteration(&r));
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
  /* The device target is tighter. */
  open_run(&r, (int64_t)(f.rest + mid), (int64_t)f.none * 4);
  uint64_t rest;
  H_OK(warmup(&r, &rest));
  plan_of(&r, &p);
  cr_assert(eq(u64, p.target_bytes, f.rest + mid - rest));
  cr_assert(lt(u64, p.target_bytes, f.none * 4));
  H_OK(iteration(&r));
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

Test(device_target, an_application_peak_replaces_the_device_stats) {
  figures_t f = warmup_figures();
  /* The application's allocator saw 64 MiB more than ofl's device. */
  uint64_t app = f.rest + f.all + (64u << 20);
  uint64_t dev = app + (f.none - f.all) / 2;
  run_t r;
  open_run(&r, (int64_t)dev, 0);
  ofl_manager_set_device_peak(r.e.m, (size_t)app);
  steps_of(&r);
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(r.e.pool, &ps);
  H_OK(ofl_manager_reset(r.e.m));
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  cr_assert(eq(u64, p.target_bytes, dev - (app - ps.peak_in_use_bytes)));
  H_OK(iteration(&r));
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

Test(device_target, read_from_the_environment) {
  figures_t f = warmup_figures();
  uint64_t dev = f.rest + f.none * 2;
  char v[32];
  snprintf(v, sizeof v, "%" PRIu64, dev);
  cr_assert(eq(int, setenv("OFL_DEVICE_MEMORY_TARGET", v, 1), 0));
  H_OK(ofl_config_reload());
  run_t r;
  open_run(&r, -1, 0);
  uint64_t rest;
  H_OK(warmup(&r, &rest));
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  cr_assert(eq(u64, p.target_bytes, dev - rest));
  close_run(&r);
  /* The empty value is the default: no device target. */
  cr_assert(eq(int, setenv("OFL_DEVICE_MEMORY_TARGET", "", 1), 0));
  H_OK(ofl_config_reload());
  open_run(&r, -1, 0);
  H_OK(iteration(&r));
  plan_of(&r, &p);
  cr_assert(eq(u64, p.target_bytes, 0));
  close_run(&r);
  unsetenv("OFL_DEVICE_MEMORY_TARGET");
  H_OK(ofl_config_reload());
}
