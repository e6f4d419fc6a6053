/* The auto offload plan (groups "auto", params.memory_target_bytes): a 1F1B
 * schedule of one pipeline rank whose groups differ in bytes and in the
 * compute around them (a sleep on the training thread plays the kernels);
 * the plan meets a target between "nothing offloaded" and "everything",
 * every popped tensor is bit-exact, the measured activation peak stays
 * within the target; a target below what full offload reaches offloads
 * everything and reports the shortfall; a reload that stalls is issued
 * earlier in later iterations; thousands of steady iterations keep the
 * counters and the pools flat. */
#include "tests/support/harness.h"

#include <math.h>
#include <pthread.h>
#include <time.h>

#include "pipeline/plan.h"
#include "pipeline/plan_solve.h"
#include "runtime/device_internal.h"

#define PP 4
#define RANK 0
#define MBS 6
#define LAYERS 2
#define NG 3
#define MAXT 2

typedef struct {
  const char *name;
  size_t bytes; /* per tensor */
  int tensors;
  unsigned fwd_us; /* compute after its commit (forward) */
  unsigned bwd_us; /* compute of its backward */
} gdef_t;

typedef struct {
  ofl_tag_t tag[MAXT];
  uint64_t seed[MAXT];
} grec_t;

typedef struct {
  h_env_t e;
  const gdef_t *g;
  unsigned gap_us; /* compute between two groups' backward */
  grec_t rec[MBS][LAYERS][NG];
  size_t wrong;
  int iter;
  /* Recompute (0: none): the groups k of bit k start recomputable (kept
   * input 0 bytes) and their forward computes rc_fwd_us between start and
   * commit; a group the plan recomputes pushes nothing and its backward
   * reruns that forward for rc_bwd_us[k]. */
  unsigned rc_mask;
  unsigned rc_fwd_us, rc_bwd_us[NG];
  /* The group whose output a recompute of group k reruns from (NULL:
   * none): ofl_manager_group_start_recompute's input_group. */
  const char *rc_input[NG];
  /* Per group k: its own forward between start and commit (0: rc_fwd_us),
   * and what its recompute reruns (0: ofl_manager_group_start_recompute's
   * own forward; else ofl_manager_group_start_rerun's mask). */
  unsigned rc_fwd_k_us[NG], rc_reruns[NG];
  ofl_group_action_t act[MBS][LAYERS][NG];
  /* 1: backward pops without reading back (a read-back over a slow link
   * is the test's own time inside the backward); the popped tensors are
   * read back and compared after the iteration. */
  int late_check;
  ofl_tensor_t *popped[MBS * LAYERS * NG * MAXT];
  uint64_t popped_seed[MBS * LAYERS * NG * MAXT];
  size_t popped_bytes[MBS * LAYERS * NG * MAXT], npopped;
} run_t;

static void spin_us(unsigned us) {
  if (us == 0)
    return;
  struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

static void forward(run_t *r, int mb) {
  ofl_manager_t *m = r->e.m;
  H_OK(ofl_manager_chunk_begin(m, 1, 0));
  for (int l = 0; l < LAYERS; l++)
    for (int k = 0; k < NG; k++) {
      const gdef_t *d = &r->g[k];
      grec_t *gr = &r->rec[mb][l][k];
      ofl_group_action_t *act = &r->act[mb][l][k];
      *act = OFL_ACTION_OFFLOAD;
      if (((r->rc_mask >> k) & 1u) && r->rc_reruns[k] != 0) {
        H_OK(ofl_manager_group_start_rerun(m, d->name, 0, r->rc_input[k],
                                           r->rc_reruns[k]));
        H_OK(ofl_manager_group_action(m, d->name, act));
        spin_us(r->rc_fwd_k_us[k]);
      } else if (((r->rc_mask >> k) & 1u) && r->rc_input[k] != NULL) {
        H_OK(ofl_manager_group_start_recompute(m, d->name, 0, r->rc_input[k]));
        H_OK(ofl_manager_group_action(m, d->name, act));
        spin_us(r->rc_fwd_us);
      } else if ((r->rc_mask >> k) & 1u) {
        H_OK(ofl_manager_group_start_flags(m, d->name, OFL_GROUP_RECOMPUTABLE,
                                           0));
        H_OK(ofl_manager_group_action(m, d->name, act));
        spin_us(r->rc_fwd_us);
      } else {
        H_OK(ofl_manager_group_start(m, d->name));
      }
      for (int t = 0; t < d->tensors && *act != OFL_ACTION_RECOMPUTE; t++) {
        gr->seed[t] = ((uint64_t)r->iter << 32) ^ ((uint64_t)mb << 20) ^
                      ((uint64_t)l << 12) ^ ((uint64_t)k << 4) ^ (uint64_t)t;
        ofl_tensor_t *x = h_tensor(&r->e, d->bytes, gr->seed[t]);
        H_OK(ofl_manager_tensor_push(m, x, &gr->tag[t]));
      }
      H_OK(ofl_manager_group_commit(m, d->name, NULL, 0, 0));
      spin_us(d->fwd_us);
    }
}

static void backward(run_t *r, int mb) {
  ofl_manager_t *m = r->e.m;
  for (int l = LAYERS; l-- > 0;)
    for (int k = NG; k-- > 0;) {
      const gdef_t *d = &r->g[k];
      grec_t *gr = &r->rec[mb][l][k];
      spin_us(r->gap_us);
      H_OK(ofl_manager_group_backward_begin(m, d->name));
      if (r->act[mb][l][k] == OFL_ACTION_RECOMPUTE)
        spin_us(r->rc_bwd_us[k]); /* the forward again */
      else if (r->late_check)
        for (int t = d->tensors; t-- > 0;) {
          ofl_tensor_t *x = NULL;
          H_OK(ofl_manager_tensor_pop(m, gr->tag[t], &x));
          r->popped[r->npopped] = x;
          r->popped_seed[r->npopped] = gr->seed[t];
          r->popped_bytes[r->npopped++] = d->bytes;
        }
      else
        for (int t = d->tensors; t-- > 0;)
          r->wrong += h_pop_check(&r->e, gr->tag[t], d->bytes, gr->seed[t]);
      spin_us(d->bwd_us);
      H_OK(ofl_manager_group_backward_end(m, d->name));
    }
}

static void iteration(run_t *r) {
  drv_step_t steps[2 * MBS];
  int n = drv_schedule(PP, RANK, 1, MBS, steps);
  for (int i = 0; i < n; i++) {
    if (steps[i].fwd)
      forward(r, steps[i].mb);
    else
      backward(r, steps[i].mb);
  }
  H_OK(ofl_manager_reset(r->e.m));
  r->iter++;
  if (r->npopped > 0)
    H_OK(ofl_stream_synchronize(ofl_device_compute_stream(r->e.dev), -1));
  for (size_t i = 0; i < r->npopped; i++) {
    ofl_tensor_t *t = r->popped[i];
    cr_assert(eq(sz, ofl_tensor_bytes(t), r->popped_bytes[i]));
    size_t w =
        t_tensor_wrong(r->e.dev, t, r->popped_bytes[i], r->popped_seed[i]);
    cr_assert(not(eq(sz, w, SIZE_MAX)), "reading the tensor back: %s",
              ofl_last_error());
    r->wrong += w;
    H_OK(ofl_tensor_destroy(t));
  }
  r->npopped = 0;
}

/* Opens the run's device and activation pool (the fixture): host link model
 * (host backend) or the stand-in's own copies, no jitter (timings are what
 * the plan reads). */
static void open_run_dev(run_t *r, const gdef_t *g, double h2d_gbps) {
  memset(r, 0, sizeof *r);
  r->g = g;
  ofl_device_params_t dp = t_device_params(0, 1);
  if (h2d_gbps > 0 && !t_on_cuda()) {
    dp.link_h2d_gbps = h2d_gbps;
    dp.link_d2h_gbps = h2d_gbps;
  }
  cr_assert(eq(int, t_env_open(&r->e, &dp), OFL_SUCCESS), "%s",
            ofl_last_error());
}

/* The run's manager settings: the fixture's, with groups and the target. */
static ofl_manager_params_t run_params(run_t *r, const char *groups,
                                       int64_t target) {
  ofl_manager_params_t mp = h_params(&r->e);
  mp.groups = groups;
  mp.memory_target_bytes = target;
  mp.pp_rank = RANK;
  return mp;
}

static void open_run_groups(run_t *r, const gdef_t *g, const char *groups,
                            int64_t target, double h2d_gbps) {
  open_run_dev(r, g, h2d_gbps);
  ofl_manager_params_t mp = run_params(r, groups, target);
  H_OK(ofl_manager_create(&mp, &r->e.m));
}

static void open_run(run_t *r, const gdef_t *g, int64_t target,
                     double h2d_gbps) {
  open_run_groups(r, g, "auto", target, h2d_gbps);
}

static void close_run(run_t *r) {
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(r->e.pool, &ps);
  cr_assert(eq(sz, ps.in_use_bytes, 0), "activation pool still in use");
  h_close(&r->e);
}

/* attn: big, long compute; mlp: middle; act: small, little compute. */
static const gdef_t WORKLOAD[NG] = {
    {"core_attn", 256 << 10, 2, 1500, 1500},
    {"mlp", 192 << 10, 1, 800, 800},
    {"moe_act", 64 << 10, 1, 500, 500},
};

static void plan_of(run_t *r, ofl_manager_plan_t *p) {
  H_OK(ofl_manager_plan_get(r->e.m, p));
  cr_assert(eq(int, p->automatic, 1));
}

/* The plan's extremes, from a run whose target nothing meets. */
static void extremes(uint64_t *all, uint64_t *none) {
  run_t r;
  open_run(&r, WORKLOAD, 1, 0);
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  *all = p.peak_all_bytes;
  *none = p.peak_none_bytes;
  close_run(&r);
}

/* Opens a run at a target between the plan's extremes, all + (none - all)
 * * num / den, and runs its warmup; the run's plan after it in *p, the
 * target returned. The extremes and the run's plan come from two warmups,
 * each read from this machine's copy timing. Where other processes on its
 * two cores held the copy worker back (the suite runs two tests at once),
 * a group's bytes leave after the forward that outlived them: the "all
 * offloaded" peak measures as the "none" one, or the run's own warmup puts
 * the target out of reach of a plan that the first one put it within
 * (seen in CI: 6291456 for both; predicted 5242880 against 3145728). Such
 * a try says nothing of the plan: up to BETWEEN_TRIES tries, and the last
 * one's figures fail the test. */
enum { BETWEEN_TRIES = 5 };
static uint64_t open_between(run_t *r, unsigned num, unsigned den,
                             ofl_manager_plan_t *p) {
  uint64_t all = 0, none = 0, target = 0;
  for (int k = 0; k < BETWEEN_TRIES; k++) {
    extremes(&all, &none);
    if (all >= none)
      continue;
    target = all + (none - all) * num / den;
    open_run(r, WORKLOAD, (int64_t)target, 0);
    iteration(r); /* warmup */
    plan_of(r, p);
    if (p->met == 1)
      return target;
    if (k + 1 < BETWEEN_TRIES)
      close_run(r);
  }
  cr_assert(lt(u64, all, none),
            "offloading must lower the peak (%llu %llu, %d tries)",
            (unsigned long long)all, (unsigned long long)none, BETWEEN_TRIES);
  cr_assert(eq(int, p->met, 1), "predicted %llu against the target %llu",
            (unsigned long long)p->predicted_peak_bytes,
            (unsigned long long)target);
  return target;
}

Test(auto_plan, meets_a_target_between_none_and_all) {
  run_t r;
  ofl_manager_plan_t p;
  uint64_t target = open_between(&r, 2, 3, &p);
  cr_assert(le(u64, p.predicted_peak_bytes, target));
  cr_assert(eq(u64, p.target_bytes, target));
  /* Some groups kept by the plan, some offloaded. */
  size_t kept = 0, off = 0;
  for (size_t i = 0; i < ofl_manager_group_plan_count(r.e.m); i++) {
    ofl_group_plan_t gp;
    H_OK(ofl_manager_group_plan(r.e.m, i, &gp));
    kept += gp.reason == OFL_KEEP_AUTO_PLAN;
    off += gp.placement == OFL_GROUP_PINNED;
  }
  cr_assert(gt(sz, kept, 0), "the plan kept nothing at a middle target");
  cr_assert(gt(sz, off, 0), "the plan offloaded nothing at a middle target");
  uint32_t chosen = 0;
  for (size_t k = 0; k < p.nnames; k++)
    chosen += p.names[k].chosen;
  cr_assert(gt(u32, chosen, 0));
  /* Every iteration either stays within the target or changes the plan
   * at its end (a grown lead moves back, else the plan solves again, at
   * most 8 times): an iteration over the target that the plan lets stand
   * is the failure. How often the model misses depends on when this
   * machine's copy worker runs; where it did not, the peak was in. */
  int over = 0, kept_over = 0;
  uint64_t changes = p.replans + p.lead_changes;
  for (int i = 0; i < 24; i++) {
    iteration(&r);
    plan_of(&r, &p);
    cr_assert(gt(u64, p.measured_peak_bytes, 0));
    uint64_t now = p.replans + p.lead_changes;
    if (p.measured_peak_bytes > target) {
      over++;
      kept_over += now == changes && p.replans < 8;
    }
    changes = now;
  }
  cr_assert(eq(sz, r.wrong, 0), "%zu wrong bytes", r.wrong);
  cr_assert(eq(u64, p.iterations, 24));
  cr_assert(le(u64, p.replans, 8));
  cr_assert(le(u64, p.predicted_peak_bytes, target));
  cr_assert(eq(int, kept_over, 0),
            "%d iterations over the target left the plan as it was (%d over "
            "in all, %llu replans)",
            kept_over, over, (unsigned long long)p.replans);
  close_run(&r);
}

Test(auto_plan, target_below_full_offload_offloads_everything) {
  run_t r;
  open_run(&r, WORKLOAD, 4096, 0);
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  cr_assert(eq(int, p.met, 0));
  cr_assert(eq(u64, p.predicted_peak_bytes, p.peak_all_bytes));
  cr_assert(eq(u64, p.shortfall_bytes, p.peak_all_bytes - 4096));
  for (size_t i = 0; i < ofl_manager_group_plan_count(r.e.m); i++) {
    ofl_group_plan_t gp;
    H_OK(ofl_manager_group_plan(r.e.m, i, &gp));
    cr_assert(not(eq(int, gp.reason, OFL_KEEP_AUTO_PLAN)),
              "group %zu kept by the plan under an unmet target", i);
  }
  for (int i = 0; i < 5; i++)
    iteration(&r);
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* The measured recompute cost feeds back: core_attn and mlp are
 * recomputable, and the target, a quarter of the way from the peak with
 * everything offloaded down to the lowest three-way peak (both of a first
 * run), is met with a recompute (of mlp, or of core_attn, which frees
 * more; a run's peaks differ a little from another's, so an offload alone
 * may meet it: then the test has nothing to check and skips). The plan
 * recomputes one of them, the cheaper by the warmup's forward times (close
 * ones: on the host they hold the pushes' copies); the rerun of each
 * recomputed group in a steady backward then takes 20 ms. The
 * measurements move its estimate (half way per iteration) and its
 * predicted cost, and the plan solves again: where mlp was recomputed,
 * core_attn (which frees more, at the cost the warmup measured) or an
 * offload takes its place. (Before the feedback the estimates stayed the
 * warmup's: the first choice for good.) */
Test(auto_plan, a_measured_recompute_cost_changes_the_plan) {
  if (t_on_cuda())
    cr_skip_test("the link model is the host backend's");
  /* A first run at a target nothing meets: the lowest three-way peak
   * (both recomputed) and the peak with everything offloaded. */
  run_t r;
  open_run(&r, WORKLOAD, 1, 0);
  r.rc_mask = 3;
  r.rc_fwd_us = 50;
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  uint64_t all = p.peak_all_bytes, low = p.predicted_peak_bytes;
  close_run(&r);
  cr_assert(lt(u64, low, all));
  open_run(&r, WORKLOAD, (int64_t)(all - (all - low) / 4), 0);
  r.rc_mask = 3; /* core_attn and mlp */
  r.rc_fwd_us = 50;
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  iteration(&r); /* warmup */
  ofl_plan_action_t a0[2], a[2];
  bool rc[2];
  for (int k = 0; k < 2; k++) {
    H_OK(ofl_manager_plan_action(r.e.m, (size_t)k, &a0[k]));
    cr_assert(eq(str, (char *)a0[k].name, (char *)WORKLOAD[k].name));
    cr_assert(a0[k].recomputable);
    rc[k] = a0[k].action == OFL_ACTION_RECOMPUTE;
    /* a recomputed group's rerun: far above its estimate */
    r.rc_bwd_us[k] = rc[k] ? 20000 : 0;
  }
  cr_log_info("warmup: core_attn action %d estimate %.3f ms, mlp action %d "
              "estimate %.3f ms",
              (int)a0[0].action, a0[0].recompute_ms, (int)a0[1].action,
              a0[1].recompute_ms);
  if (!rc[0] && !rc[1]) {
    close_run(&r);
    cr_skip_test("this run's peaks let an offload alone meet the target");
  }
  plan_of(&r, &p);
  uint64_t replans0 = p.replans;
  for (int i = 0; i < 4; i++)
    iteration(&r);
  for (int k = 0; k < 2; k++)
    H_OK(ofl_manager_plan_action(r.e.m, (size_t)k, &a[k]));
  plan_of(&r, &p);
  cr_log_info("after: core_attn action %d estimate %.3f ms, mlp action %d "
              "estimate %.3f ms, replans %llu",
              (int)a[0].action, a[0].recompute_ms, (int)a[1].action,
              a[1].recompute_ms, (unsigned long long)p.replans);
  for (int k = 0; k < 2; k++) {
    if (!rc[k])
      continue;
    /* its estimate moved towards 20 ms per group (12 groups), at least
     * half way (one iteration) */
    cr_assert(gt(dbl, a[k].recompute_ms, 100.0), "%s estimate %.3f ms",
              WORKLOAD[k].name, a[k].recompute_ms);
    if (a[k].action == OFL_ACTION_RECOMPUTE)
      cr_assert(eq(dbl, a[k].predicted_ms, a[k].recompute_ms));
  }
  if (rc[1] && !rc[0]) { /* core_attn's recompute is a way out */
    cr_assert(gt(u64, p.replans, replans0));
    cr_assert(not(eq(int, a[1].action, OFL_ACTION_RECOMPUTE)),
              "mlp still recomputed, estimate %.3f ms", a[1].recompute_ms);
  }
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* A recompute's measured cost is its backward with the rerun less the
 * warmup's backward of the same group, without the time its pops took in
 * the warmup (a wait for the reload, or the reload itself, inline: not
 * compute a rerun adds to): a 3 ms rerun of moe_act over a 0.02 GB/s link
 * measures about 3 ms a group. The backward pops without reading back
 * inside the window (a read-back over that link would be the test's own
 * time there), and compares every popped tensor after the iteration. */
Test(auto_plan, a_measured_recompute_cost_is_the_reruns_time) {
  if (t_on_cuda())
    cr_skip_test("the link model is the host backend's");
  run_t r;
  open_run(&r, WORKLOAD, 1, 0.02); /* a target nothing meets: lowest peak */
  r.late_check = 1;
  r.rc_mask = 4; /* moe_act */
  r.rc_fwd_us = 50;
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  iteration(&r); /* warmup: every group offloaded */
  ofl_plan_action_t a;
  H_OK(ofl_manager_plan_action(r.e.m, 2, &a));
  cr_assert(eq(str, (char *)a.name, "moe_act"));
  if (a.action != OFL_ACTION_RECOMPUTE) {
    close_run(&r);
    cr_skip_test("this run's plan does not recompute moe_act");
  }
  const ofl__plan_t *ap = r.e.m->ap;
  uint64_t pops = 0;
  int groups = 0;
  for (uint32_t i = 0; i < ap->nms; i++)
    if (strcmp(ofl__gname(r.e.m, ap->ms[i].g), "moe_act") == 0) {
      pops += ap->ms[i].warm_pop_ns;
      groups++;
    }
  r.rc_bwd_us[2] = 3000;
  iteration(&r);
  H_OK(ofl_manager_plan_action(r.e.m, 2, &a));
  cr_log_info("moe_act: %d groups, warmup pops %.1f ms, measured recompute "
              "%.1f ms (reruns of %d x 3 ms)",
              groups, (double)pops / 1e6, a.measured_ms, groups);
  cr_assert(eq(int, groups, MBS *LAYERS));
  if (a.action == OFL_ACTION_RECOMPUTE) {
    cr_assert(ge(dbl, a.measured_ms, 0.7 * groups * 3.0),
              "measured %.2f ms for reruns of %d x 3 ms", a.measured_ms,
              groups);
    cr_assert(le(dbl, a.measured_ms, 3.0 * groups * 3.0));
  }
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* The recompute's input held by another group: mlp reruns from
 * core_attn's output (ofl_manager_group_start_recompute(m, "mlp", 0,
 * "core_attn")). The warmup links each mlp group to the core_attn group
 * before it in its chunk (the instance's input_of); solved with and
 * without those links over targets from the lowest peak to the peak with
 * nothing offloaded, the plan differs where recomputing mlp with
 * core_attn offloaded brings core_attn's bytes back at mlp's backward (a
 * higher peak) or waits for its reload (a higher cost), and never costs
 * less with them. The run's own plan is the linked one, and its
 * iterations pop every tensor intact. */
static int input_links_run(void) {
  run_t r;
  open_run(&r, WORKLOAD, 1, 0.25); /* core_attn's reload: 2 ms a group */
  r.rc_mask = 2;                   /* mlp */
  r.rc_fwd_us = 50;
  r.rc_input[1] = "core_attn";
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  iteration(&r); /* warmup */
  const ofl__plan_t *ap = r.e.m->ap;
  cr_assert_not_null(ap);
  size_t n = ap->nms, links = 0;
  int attn = -1, mlp = -1;
  for (size_t i = 0; i < n; i++) {
    const char *nm = r.e.m->names[ap->inst[i].name].name;
    if (strcmp(nm, "core_attn") == 0)
      attn = ap->inst[i].name;
    if (strcmp(nm, "mlp") == 0)
      mlp = ap->inst[i].name;
  }
  cr_assert(ge(int, attn, 0));
  cr_assert(ge(int, mlp, 0));
  for (size_t i = 0; i < n; i++) {
    const ofl__plan_group_t *q = &ap->inst[i];
    if (q->name != mlp) {
      cr_assert(not(q->has_input));
      continue;
    }
    /* the core_attn group right before it in its chunk */
    cr_assert(q->has_input, "mlp group %zu has no input link", i);
    const group_t *g = ap->ms[i].g, *in = ap->ms[q->input_of].g;
    cr_assert(eq(int, ap->inst[q->input_of].name, attn));
    cr_assert(eq(ptr, (void *)in->chunk, (void *)g->chunk));
    cr_assert(eq(u32, in->index + 1, g->index));
    links++;
  }
  cr_assert(eq(sz, links, (size_t)(MBS * LAYERS)));
  /* the same instance without its links */
  ofl__plan_group_t *bare = calloc(n, sizeof *bare);
  uint8_t *a = calloc(n, 1), *b = calloc(n, 1);
  cr_assert(bare != NULL && a != NULL && b != NULL);
  memcpy(bare, ap->inst, n * sizeof *bare);
  for (size_t i = 0; i < n; i++)
    bare[i].has_input = false;
  ofl__plan_result_t ra, rb;
  int nn = (int)r.e.m->nnames;
  H_OK(ofl__plan_solve_actions(ap->inst, n, nn, 1, true, a, &ra));
  H_OK(ofl__plan_solve_actions(bare, n, nn, 1, true, b, &rb));
  uint64_t lo = ra.predicted_peak < rb.predicted_peak ? ra.predicted_peak
                                                      : rb.predicted_peak;
  uint64_t hi = ra.peak_none;
  int differ = 0, dearer = 0, steps = 64;
  for (int k = 0; k <= steps; k++) {
    uint64_t t = lo + (hi - lo) / (uint64_t)steps * (uint64_t)k;
    H_OK(ofl__plan_solve_actions(ap->inst, n, nn, t, true, a, &ra));
    H_OK(ofl__plan_solve_actions(bare, n, nn, t, true, b, &rb));
    differ += memcmp(a, b, n) != 0;
    if (ra.met)
      cr_assert(rb.met && ra.cost_ns + 1e-3 >= rb.cost_ns,
                "target %llu: cost %.0f ns with the links, %.0f without",
                (unsigned long long)t, ra.cost_ns, rb.cost_ns);
    dearer += ra.met && rb.met && ra.cost_ns > rb.cost_ns + 1.0;
    if (k == 0)
      cr_log_info("lowest peak %.3f MiB with the links, %.3f without",
                  ofl__mib(ra.predicted_peak), ofl__mib(rb.predicted_peak));
  }
  cr_log_info("input links: %d of %d targets plan differently, %d cost "
              "more",
              differ, steps + 1, dearer);
  free(bare);
  free(a);
  free(b);
  for (int i = 0; i < 3; i++)
    iteration(&r);
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
  return differ;
}

/* Up to three runs: on a loaded machine one warmup's windows can stretch
 * until they hide every reload, and then no link changes the plan (under
 * AddressSanitizer beside another suite: 0 of 65 in one run, 7-9 in the
 * next four alone). Every run checks the links and the costs. */
Test(auto_plan, a_recompute_input_held_by_an_offloaded_group_changes_the_plan) {
  int differ = 0;
  for (int run = 0; run < 3 && differ == 0; run++)
    differ = input_links_run();
  cr_assert(gt(int, differ, 0));
}

/* The link goes to the most recent group of the named one started before
 * it in the same chunk: mlp names moe_act, which follows it in a layer, so
 * the first layer's mlp has none and the second's gets the first layer's
 * moe_act; a name never started links nothing. */
Test(auto_plan, a_recompute_input_is_the_latest_earlier_group_of_that_name) {
  cr_assert(eq(int, ofl_manager_group_start_recompute(NULL, "mlp", 0, "x"),
               OFL_ERR_INVALID_ARG));
  run_t r;
  open_run(&r, WORKLOAD, 1, 0);
  r.rc_mask = 6; /* mlp and moe_act */
  r.rc_input[1] = "moe_act";
  r.rc_input[2] = "no_such_group";
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  iteration(&r); /* warmup */
  const ofl__plan_t *ap = r.e.m->ap;
  size_t linked = 0, mlps = 0;
  for (size_t i = 0; i < ap->nms; i++) {
    const ofl__plan_group_t *q = &ap->inst[i];
    const group_t *g = ap->ms[i].g;
    const char *nm = r.e.m->names[q->name].name;
    if (strcmp(nm, "mlp") != 0) {
      cr_assert(not(q->has_input), "%s group %zu linked", nm, i);
      continue;
    }
    mlps++;
    if (g->index < NG) { /* the first layer */
      cr_assert(not(q->has_input));
      continue;
    }
    cr_assert(q->has_input);
    const group_t *in = ap->ms[q->input_of].g;
    cr_assert(eq(str, (char *)r.e.m->names[in->nid].name, "moe_act"));
    cr_assert(eq(ptr, (void *)in->chunk, (void *)g->chunk));
    cr_assert(eq(u32, in->index + 2, g->index));
    linked++;
  }
  cr_assert(eq(sz, mlps, (size_t)(MBS * LAYERS)));
  cr_assert(eq(sz, linked, (size_t)(MBS * (LAYERS - 1))));
  iteration(&r);
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* What a recompute reruns (ofl_manager_group_start_rerun): mlp saved
 * core_attn's output and reruns core_attn's forward (OFL_RERUN_INPUT, 3
 * ms) to make it again, not its own (0.3 ms); moe_act reruns both its own
 * forward (1 ms) and mlp's (OFL_RERUN_OWN | OFL_RERUN_INPUT). The warmup's
 * estimate of each is exactly the sum of those forwards' commit less
 * start; core_attn (no input) its own. Then a steady iteration with its
 * bytes checked. */
Test(auto_plan, a_rerun_of_the_input_group_costs_its_forward) {
  cr_assert(eq(int,
               ofl_manager_group_start_rerun(NULL, "mlp", 0, "core_attn",
                                             OFL_RERUN_INPUT),
               OFL_ERR_INVALID_ARG));
  run_t r;
  open_run(&r, WORKLOAD, 1, 0);
  r.rc_mask = 7;
  r.rc_fwd_k_us[0] = 3000;
  r.rc_fwd_k_us[1] = 300;
  r.rc_fwd_k_us[2] = 1000;
  r.rc_reruns[0] = OFL_RERUN_OWN;
  r.rc_reruns[1] = OFL_RERUN_INPUT;
  r.rc_reruns[2] = OFL_RERUN_OWN | OFL_RERUN_INPUT;
  r.rc_input[1] = "core_attn";
  r.rc_input[2] = "mlp";
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  /* the stamps on the CPU clock: the forwards here are the test's sleeps,
   * not work on the compute stream, which a timing event would see */
  H_OK(ofl__plan_alloc(r.e.m));
  r.e.m->ap->timed = false;
  iteration(&r); /* warmup */
  const ofl__plan_t *ap = r.e.m->ap;
  int seen[NG] = {0};
  for (uint32_t i = 0; i < ap->nms; i++) {
    const ofl__plan_group_t *q = &ap->inst[i];
    const meas_t *x = &ap->ms[i];
    int k = q->name; /* names in WORKLOAD order */
    cr_assert(q->recomputable);
    cr_assert(eq(str, (char *)r.e.m->names[k].name, (char *)WORKLOAD[k].name));
    double own =
        (double)(ofl__plan_at_ns(ap, &x->commit) - ofl__plan_at_ns(ap, &x->start));
    cr_assert(ge(dbl, own, 1e3 * r.rc_fwd_k_us[k]));
    double want = k == 1 ? 0 : own;
    if (k > 0) {
      cr_assert(q->has_input);
      const meas_t *y = &ap->ms[q->input_of];
      cr_assert(eq(int, y->g->nid, k - 1));
      double in = (double)(ofl__plan_at_ns(ap, &y->commit) -
                           ofl__plan_at_ns(ap, &y->start));
      cr_assert(ge(dbl, in, 1e3 * r.rc_fwd_k_us[k - 1]));
      want += in;
    }
    /* within 1 us: the axis begins at a stamp taken right after the
     * first commit's, which the instance takes as 0 */
    cr_assert(le(dbl, fabs(q->recompute_ns - want), 1e3),
              "%s group %u: %f against %f", WORKLOAD[k].name, i,
              q->recompute_ns, want);
    seen[k]++;
  }
  for (int k = 0; k < NG; k++)
    cr_assert(eq(int, seen[k], MBS * LAYERS));
  /* mlp's estimate is core_attn's forward: ten times its own */
  ofl_plan_action_t a;
  H_OK(ofl_manager_plan_action(r.e.m, 1, &a));
  cr_assert(ge(dbl, a.recompute_ms, MBS * LAYERS * 3.0 * 0.99));
  r.late_check = 0;
  iteration(&r);
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* WORKLOAD under groups "auto" at a 1-byte target, with a tensor threshold
 * above every tensor: the plan keeps or recomputes, no copy to time. */
static void open_run_no_copy(run_t *r) {
  open_run_dev(r, WORKLOAD, 0);
  ofl_manager_params_t mp = run_params(r, "auto", 1);
  mp.min_offload_bytes = (int64_t)1 << 30;
  H_OK(ofl_manager_create(&mp, &r->e.m));
}

/* Chains on the ledger: every group recomputable, mlp reruns from
 * core_attn's output and moe_act from mlp's; at a target nothing meets the
 * plan recomputes all three (nothing is offloadable here, a tensor
 * threshold above every tensor: no copy at all), so each
 * rerun makes its input group's tensors again first and holds them until
 * that group's backward. The ledger counts them from the rerun that made
 * them, as the model does: with no copy to time, the measured peak of every
 * steady iteration is the predicted one to the byte, and above what the
 * same plan holds without the links. */
Test(auto_plan, a_chain_of_recomputes_is_counted_from_its_first_rerun) {
  run_t r;
  open_run_no_copy(&r);
  r.rc_mask = 7;
  r.rc_input[1] = "core_attn";
  r.rc_input[2] = "mlp";
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  iteration(&r); /* warmup */
  for (int k = 0; k < NG; k++) {
    ofl_plan_action_t a;
    H_OK(ofl_manager_plan_action(r.e.m, (size_t)k, &a));
    cr_assert(eq(int, a.action, OFL_ACTION_RECOMPUTE), "%s: %d", a.name,
                 a.action);
  }
  const ofl__plan_t *ap = r.e.m->ap;
  uint64_t linked = ofl__plan_peak_actions(ap->inst, ap->nms, ap->action);
  ofl__plan_group_t *bare = malloc(ap->nms * sizeof *bare);
  cr_assert_not_null(bare);
  memcpy(bare, ap->inst, ap->nms * sizeof *bare);
  for (uint32_t i = 0; i < ap->nms; i++)
    bare[i].has_input = false;
  uint64_t unlinked = ofl__plan_peak_actions(bare, ap->nms, ap->action);
  free(bare);
  cr_assert(gt(u64, linked, unlinked));
  ofl_manager_plan_t p;
  for (int i = 0; i < 20; i++) {
    iteration(&r);
    plan_of(&r, &p);
    cr_assert(eq(u64, p.predicted_peak_bytes, linked));
    cr_assert(eq(u64, p.measured_peak_bytes, linked),
              "iteration %d: measured %llu, predicted %llu (unlinked %llu)",
              i, (unsigned long long)p.measured_peak_bytes,
              (unsigned long long)linked, (unsigned long long)unlinked);
  }
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* A forward two recomputes rerun: mlp reruns core_attn's forward (its
 * input), core_attn its own. It runs once, in mlp's backward (the earlier
 * one), so core_attn's backward measures next to nothing. The plan charges
 * it once, and the feedback adds the credit back to core_attn's measured
 * backward: its estimate stays its own forward (3 ms) instead of drifting
 * to what its backward measures here, which would make it look free where
 * it is recomputed alone. */
Test(auto_plan, a_shared_forward_keeps_each_groups_own_estimate) {
  run_t r;
  open_run_no_copy(&r);
  r.rc_mask = 3; /* core_attn and mlp */
  r.rc_fwd_k_us[0] = 3000;
  r.rc_fwd_k_us[1] = 200;
  r.rc_reruns[0] = OFL_RERUN_OWN;
  r.rc_reruns[1] = OFL_RERUN_INPUT;
  r.rc_input[1] = "core_attn";
  H_OK(ofl_manager_set_plan_recompute(r.e.m, 1));
  H_OK(ofl__plan_alloc(r.e.m));
  r.e.m->ap->timed = false; /* the forwards are the test's sleeps */
  iteration(&r);            /* warmup */
  ofl_plan_action_t a[2];
  for (int k = 0; k < 2; k++) {
    H_OK(ofl_manager_plan_action(r.e.m, (size_t)k, &a[k]));
    cr_assert(eq(int, a[k].action, OFL_ACTION_RECOMPUTE), "%s", a[k].name);
  }
  /* the attention's forward once: mlp pays it, core_attn nothing more */
  const double groups = MBS * LAYERS;
  cr_assert(ge(dbl, a[1].predicted_ms, 0.99 * groups * 3.0), "mlp %f",
            a[1].predicted_ms);
  cr_assert(le(dbl, a[0].predicted_ms, 0.1 * groups * 3.0), "core_attn %f",
            a[0].predicted_ms);
  r.rc_bwd_us[1] = 3000; /* mlp's backward reruns core_attn's forward */
  r.rc_bwd_us[0] = 0;    /* core_attn's finds it made */
  for (int i = 0; i < 12; i++)
    iteration(&r);
  const ofl__plan_t *ap = r.e.m->ap;
  int seen = 0;
  for (uint32_t i = 0; i < ap->nms; i++) {
    if (ap->inst[i].name != 0)
      continue;
    cr_assert(ge(dbl, ap->inst[i].recompute_ns, 0.6 * 3e6),
              "core_attn group %u: estimate %.0f ns, its forward 3 ms", i,
              ap->inst[i].recompute_ns);
    seen++;
  }
  cr_assert(eq(int, seen, MBS * LAYERS));
  H_OK(ofl_manager_plan_action(r.e.m, 0, &a[0]));
  cr_assert(eq(int, a[0].action, OFL_ACTION_RECOMPUTE));
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* The reruns mask is checked: zero, an unknown bit, or OFL_RERUN_INPUT
 * without an input group are invalid arguments that say which. */
Test(auto_plan, a_rerun_mask_without_its_input_is_refused) {
  run_t r;
  open_run(&r, WORKLOAD, 1, 0);
  ofl_manager_t *m = r.e.m;
  H_OK(ofl_manager_chunk_begin(m, 1, 0));
  cr_assert(eq(int, ofl_manager_group_start_rerun(m, "mlp", 0, "core_attn", 0),
               OFL_ERR_INVALID_ARG));
  cr_assert(strstr(ofl_last_error(), "non-zero mask") != NULL, "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_manager_group_start_rerun(m, "mlp", 0, "core_attn", 4),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int,
               ofl_manager_group_start_rerun(m, "mlp", 0, NULL,
                                             OFL_RERUN_INPUT),
               OFL_ERR_INVALID_ARG));
  cr_assert(strstr(ofl_last_error(), "none given") != NULL, "%s",
            ofl_last_error());
  cr_assert(eq(int,
               ofl_manager_group_start_rerun(m, "mlp", 0, "",
                                             OFL_RERUN_OWN | OFL_RERUN_INPUT),
               OFL_ERR_INVALID_ARG));
  /* refused calls open nothing: a good one opens and commits */
  H_OK(ofl_manager_group_start_rerun(m, "mlp", 0, NULL, OFL_RERUN_OWN));
  H_OK(ofl_manager_group_commit(m, "mlp", NULL, 0, 0));
  close_run(&r);
}

Test(auto_plan, target_met_without_offload_keeps_everything) {
  uint64_t all, none;
  extremes(&all, &none);
  run_t r;
  open_run(&r, WORKLOAD, (int64_t)none, 0);
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  cr_assert(eq(int, p.met, 1));
  for (size_t k = 0; k < p.nnames; k++)
    cr_assert(eq(u32, p.names[k].chosen, 0), "%s chosen", p.names[k].name);
  ofl_manager_stats_t st0, st1;
  ofl_manager_get_stats(r.e.m, &st0);
  for (int i = 0; i < 5; i++)
    iteration(&r);
  ofl_manager_get_stats(r.e.m, &st1);
  cr_assert(eq(u64, st1.offloaded_bytes, st0.offloaded_bytes),
            "steady iterations offloaded bytes with nothing chosen");
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* A warmup that copies nothing (every tensor under the size to offload)
 * times no copy: the plan's link rates are the backend's
 * (ofl__device_link_rate), the link model where one is configured, else
 * the backend's own timing of its copies (host: memcpy; cuda, the stand-in
 * here: a pinned<->device cudaMemcpyAsync timed by events). */
Test(auto_plan, without_warmup_copies_the_link_rates_are_the_backends) {
  for (int model = 0; model < 2; model++) {
    run_t r;
    memset(&r, 0, sizeof r);
    r.g = WORKLOAD;
    ofl_device_params_t dp = t_device_params(0, 1);
    if (model) {
      dp.link_d2h_gbps = 2;
      dp.link_h2d_gbps = 3;
    }
    cr_assert(eq(int, t_env_open(&r.e, &dp), OFL_SUCCESS), "%s",
              ofl_last_error());
    ofl_manager_params_t mp = run_params(&r, "auto", 0);
    mp.min_offload_bytes = (size_t)1 << 30;
    H_OK(ofl_manager_create(&mp, &r.e.m));
    iteration(&r);
    ofl_manager_plan_t p;
    plan_of(&r, &p);
    double d2h = 0, h2d = 0;
    ofl__link_source_t src = OFL__LINK_NONE;
    H_OK(ofl__device_link_rate(r.e.dev, &d2h, &h2d, &src));
    cr_assert(eq(int, (int)src, model ? OFL__LINK_MODEL : OFL__LINK_TIMED));
    cr_assert(eq(str, (char *)p.rate_source, model ? "link model" : "memcpy"));
    cr_assert(d2h > 0 && h2d > 0, "d2h %g h2d %g bytes/s", d2h, h2d);
    if (model) {
      cr_assert(eq(dbl, d2h, 2e9));
      cr_assert(eq(dbl, h2d, 3e9));
    }
    /* the same figures: the backend measured once and kept them */
    cr_assert(fabs(p.d2h_gbps - d2h / 1e9) <= 1e-9 * d2h / 1e9,
              "plan d2h %g GB/s, backend %g", p.d2h_gbps, d2h / 1e9);
    cr_assert(fabs(p.h2d_gbps - h2d / 1e9) <= 1e-9 * h2d / 1e9,
              "plan h2d %g GB/s, backend %g", p.h2d_gbps, h2d / 1e9);
    cr_assert(eq(sz, r.wrong, 0));
    close_run(&r);
  }
}

/* The warmup sees a long gap before each group's backward, so every
 * reload hides behind it and the plan (no target: what hides) offloads
 * every group with lead 1; afterwards the gap shrinks (faster kernels):
 * the reloads stall, their leads grow, the stalls go. Host backend: the
 * link model makes the copies slow. */
Test(auto_plan, a_stalled_reload_is_issued_earlier) {
  if (t_on_cuda())
    cr_skip_test("the link model is the host backend's");
  static const gdef_t slow[NG] = {
      {"core_attn", 512 << 10, 1, 3000, 6000},
      {"mlp", 512 << 10, 1, 3000, 6000},
      {"moe_act", 512 << 10, 1, 3000, 6000},
  };
  run_t r;
  /* 0.25 GB/s: 2.1 ms per 512 KiB, within one group's backward (6 ms) and
   * the warmup's gap (4 ms), far above the later gap (0.1 ms). */
  open_run(&r, slow, 0, 0.25);
  r.gap_us = 4000;
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  uint32_t chosen = 0;
  for (size_t k = 0; k < p.nnames; k++)
    chosen += p.names[k].chosen;
  cr_assert(gt(u32, chosen, 0), "no copy hid in the warmup");
  r.gap_us = 100;
  ofl_manager_stats_t a, b;
  ofl_manager_get_stats(r.e.m, &a);
  iteration(&r);
  ofl_manager_get_stats(r.e.m, &b);
  uint64_t first = b.stalls - a.stalls;
  cr_assert(gt(u64, first, 0), "no reload stalled with lead 1");
  for (int i = 0; i < 6; i++)
    iteration(&r);
  uint64_t last = UINT64_MAX; /* the fewest stalls of the next 4 */
  for (int i = 0; i < 4; i++) {
    ofl_manager_get_stats(r.e.m, &a);
    iteration(&r);
    ofl_manager_get_stats(r.e.m, &b);
    if (b.stalls - a.stalls < last)
      last = b.stalls - a.stalls;
  }
  plan_of(&r, &p);
  cr_assert(gt(u64, p.lead_changes, 0));
  uint32_t lead = 0;
  for (size_t k = 0; k < p.nnames; k++)
    if (p.names[k].prefetch_lead_max > lead)
      lead = p.names[k].prefetch_lead_max;
  cr_assert(ge(u32, lead, 2), "no lead grew");
  cr_assert(lt(u64, last, first),
            "stalls per iteration did not drop (%llu then %llu)",
            (unsigned long long)first, (unsigned long long)last);
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

/* The warmup offloads every group; here each reload (2.1 ms at 0.25 GB/s)
 * is issued 0.1 ms before its backward, so the warmup's backward waits for
 * nearly all of it. The plan takes those waits out of the warmup's timeline
 * (else each wait would widen the window of the reload that caused it, and
 * every reload would look hidden): with no target it offloads only what
 * hides, so none of these groups, and the steady iterations do not stall.
 * Host backend: the link model makes the copies slow. A reload that hides
 * behind a 3 ms forward with 0.9 ms to spare can still stall where other
 * processes hold this machine's two cores (the suite runs two tests at
 * once): a try whose steady iterations stalled runs again, up to
 * WINDOW_TRIES, and the last one's count fails the test. */
enum { WINDOW_TRIES = 3 };
static uint64_t reload_waits_try(void) {
  static const gdef_t slow[NG] = {
      {"core_attn", 512 << 10, 1, 3000, 1000},
      {"mlp", 512 << 10, 1, 3000, 1000},
      {"moe_act", 512 << 10, 1, 3000, 1000},
  };
  run_t r;
  open_run(&r, slow, 0, 0.25);
  r.gap_us = 100;
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  cr_assert(gt(dbl, p.warmup_stall_ms, 5.0), "the warmup waited %.3f ms",
            p.warmup_stall_ms);
  /* Only the groups whose backward follows a forward (a long window) hide:
   * the first of each microbatch's backward, one name in three. */
  uint32_t chosen = 0, groups = 0;
  for (size_t k = 0; k < p.nnames; k++) {
    chosen += p.names[k].chosen;
    groups += p.names[k].groups;
  }
  cr_assert(lt(u32, 3 * chosen, groups + 3),
            "%u of %u groups offloaded, their reloads hidden in the warmup's "
            "waits (predicted exposed %.3f ms)",
            chosen, groups, p.predicted_exposed_ms);
  ofl_manager_stats_t a, b;
  ofl_manager_get_stats(r.e.m, &a);
  for (int i = 0; i < 3; i++)
    iteration(&r);
  ofl_manager_get_stats(r.e.m, &b);
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
  return b.stalls - a.stalls;
}

Test(auto_plan, the_warmups_reload_waits_are_not_windows) {
  if (t_on_cuda())
    cr_skip_test("the link model is the host backend's");
  uint64_t stalls = 1;
  for (int k = 0; k < WINDOW_TRIES && stalls > 0; k++)
    stalls = reload_waits_try();
  cr_assert(eq(u64, stalls, 0), "%llu reloads stalled (%d tries)",
            (unsigned long long)stalls, WINDOW_TRIES);
}

/* Lets the D2H stream's worker go after 40 ms (times OFLTEST_SLOW under
 * the valgrind and sanitizer setups): a copy worker that woke late in the
 * warmup. */
static void *unhold_later(void *arg) {
  const char *slow = getenv("OFLTEST_SLOW");
  int k = slow != NULL && atoi(slow) > 1 ? atoi(slow) : 1;
  spin_us(40000u * (unsigned)k);
  ofl__host_stream_hold(arg, false);
  return NULL;
}

/* Opens a run at target whose warmup's D2H worker is held for its first
 * 40 ms (unhold_later) and runs the warmup. */
static void open_late_warmup(run_t *r, int64_t target, double gbps,
                             bool three_way) {
  open_run(r, WORKLOAD, target, gbps);
  H_OK(ofl_manager_set_plan_recompute(r->e.m, three_way));
  ofl_stream_t *d2h = ofl_manager_d2h_stream(r->e.m);
  ofl__host_stream_hold(d2h, true);
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, unhold_later, d2h), 0));
  iteration(r);
  pthread_join(t, NULL);
}

/* One try of the raise: the model of "all offloaded" from a run as it
 * comes and from a late warmup, then a run with the late warmup at a
 * target between the two. Asserts what holds whether or not the raise
 * came: bytes exact, at most one iteration over the target and then a
 * change of plan, the settled peak within the target, a raise that lowers
 * the predicted exposed time. Returns the iteration at whose end the aim
 * was raised, 0 where it was not. */
static int raise_try(double gbps, bool three_way) {
  run_t r;
  open_run(&r, WORKLOAD, 1, gbps);
  H_OK(ofl_manager_set_plan_recompute(r.e.m, three_way));
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  uint64_t all = p.peak_all_bytes;
  close_run(&r);
  open_late_warmup(&r, 1, gbps, three_way);
  plan_of(&r, &p);
  uint64_t all_late = p.peak_all_bytes;
  close_run(&r);
  if (all_late <= all + (64 << 10)) /* this machine's copies came late */
    return 0;                       /* in the unheld warmup too */
  uint64_t target = all + (all_late - all) / 2;
  open_late_warmup(&r, (int64_t)target, gbps, three_way);
  plan_of(&r, &p);
  double exposed0 = p.predicted_exposed_ms;
  bool late = p.met == 0; /* this warmup moved the model past the target */
  uint64_t replans = p.replans;
  int raised_at = 0, over = 0, over_kept = 0;
  for (int i = 1; i <= 10; i++) {
    iteration(&r);
    plan_of(&r, &p);
    if (p.measured_peak_bytes > target) {
      over++;
      over_kept += p.replans == replans; /* an over that changed nothing */
    }
    /* a replan at the end of an iteration within the target: the raise
     * (one over the target solves for a lower aim instead) */
    if (p.replans != replans && raised_at == 0 &&
        p.measured_peak_bytes <= target) {
      raised_at = i;
      cr_assert(getenv("OFLTEST_SLOW") != NULL ||
                    p.predicted_exposed_ms < exposed0,
                "the raise did not lower the exposed time (%.3f, was %.3f)",
                p.predicted_exposed_ms, exposed0);
    }
    replans = p.replans;
  }
  cr_assert(eq(sz, r.wrong, 0), "%zu wrong bytes", r.wrong);
  if (getenv("OFLTEST_SLOW") == NULL) {
    /* Valgrind and the sanitizers slow copies and compute by different
     * factors, and the model reads them: there the run checks the bytes
     * and the memory, not the timing-driven figures. */
    cr_assert(le(int, over, 1), "%d iterations over the target", over);
    cr_assert(eq(int, over_kept, 0),
              "an iteration over the target left the plan as it was");
    cr_assert(le(u64, p.measured_peak_settled_bytes, target),
              "settled at %llu bytes, target %llu",
              (unsigned long long)p.measured_peak_settled_bytes,
              (unsigned long long)target);
  }
  close_run(&r);
  return late ? raised_at : 0;
}

/* The warmup's first copies start 40 ms late (its D2H worker held), so the
 * plan takes every offloaded group's bytes to leave that much after its
 * copy: its "all offloaded" peak is well above what offloading everything
 * measures. A target between the two is one the plan says it cannot meet:
 * it offloads everything, and the steady iterations measure under the
 * prediction. After three of them it solves again for a raised aim (less
 * exposed copy time). The raised plan carries the error only in proportion
 * to the bytes it still moves (with the whole error carried it measured
 * 2.44-3.00 MiB against a 1.88 MiB target; in proportion 1.50-1.94 against
 * 1.84-2.12, within it in most runs): at most its first iteration may go
 * over, and then the plan before it comes back. Host backend (the held
 * worker, the link model).
 * Whether one try raises depends on this machine's timing: how late the
 * held warmup's copies were sets the model's error, and where the error
 * is small against the bytes a raised plan keeps, no raised plan is
 * predicted within the target, so none is taken. With the raise's
 * bisection of aims 12 tries in 12 raised on the 2-core VM, 16 in 18 with
 * four test processes on its cores (halving the credit: 7 in 8, and about
 * half under load, all five of one CI run not). Every try asserts the
 * safety of what happened; of up to TRIES tries one must raise, at the end
 * of its third steady iteration or later. */
Test(auto_plan, a_plan_under_its_prediction_raises_its_aim) {
  if (t_on_cuda())
    cr_skip_test("the held copy worker is the host backend's");
  enum { TRIES = 5 };
  const double gbps = 0.25; /* core_attn's 512 KiB: 2.1 ms, in 1.5 ms */
  /* under valgrind and the sanitizers: one try, its bytes and memory */
  const int most = getenv("OFLTEST_SLOW") != NULL ? 1 : TRIES;
  int raised_at = 0, tries = 0;
  while (raised_at == 0 && tries < most) {
    tries++;
    raised_at = raise_try(gbps, false);
  }
  if (getenv("OFLTEST_SLOW") != NULL)
    return;
  /* never on less evidence than the rule's; later where a prefetch lead
   * that moved restarted it */
  cr_assert(ge(int, raised_at, OFL__PLAN_RAISE_AFTER),
            "raised after %d iterations (0: never; try %d of %d)", raised_at,
            tries, TRIES);
}

/* The same with the three-way plan on (OFL_PLAN_RECOMPUTE, no group
 * recomputable: its space is the offloads, weighed by the reload waits
 * alone): a late warmup's error is the offloaded bytes', and the plan
 * raises its aim as the offload-only one does, the plan before it kept to
 * come back to; before the three-way raise its actions stayed for the
 * whole run. */
Test(auto_plan, a_three_way_plan_under_its_prediction_raises_its_aim) {
  if (t_on_cuda())
    cr_skip_test("the held copy worker is the host backend's");
  enum { TRIES = 5 };
  const int most = getenv("OFLTEST_SLOW") != NULL ? 1 : TRIES;
  int raised_at = 0, tries = 0;
  while (raised_at == 0 && tries < most) {
    tries++;
    raised_at = raise_try(0.25, true);
  }
  if (getenv("OFLTEST_SLOW") != NULL)
    return;
  cr_assert(ge(int, raised_at, OFL__PLAN_RAISE_AFTER),
            "raised after %d iterations (0: never; try %d of %d)", raised_at,
            tries, TRIES);
}

/* Thousands of steady iterations (no compute sleeps): the plan's counters
 * grow by one per iteration, the ledger returns to the same peak, no lead
 * runs away, the pools end empty and bytes are exact. */
Test(auto_plan, long_run_stays_flat) {
  static const gdef_t quick[NG] = {
      {"core_attn", 8 << 10, 2, 0, 0},
      {"mlp", 4 << 10, 1, 0, 0},
      {"moe_act", 2 << 10, 1, 0, 0},
  };
  const char *e = getenv("OFL_TEST_LONG_STEPS");
  /* The stand-in runs every copy on worker threads of its own: fewer
   * steps there keep the test under a minute on two cores. */
  int steps = e ? atoi(e) : t_on_cuda() ? 1000 : 2000;
  if (steps < 10)
    steps = 10;
  uint64_t all, none;
  run_t r;
  open_run(&r, quick, 1, 0);
  iteration(&r);
  ofl_manager_plan_t p;
  plan_of(&r, &p);
  all = p.peak_all_bytes;
  none = p.peak_none_bytes;
  close_run(&r);
  open_run(&r, quick, (int64_t)(all + (none - all) / 3), 0);
  iteration(&r);
  ofl_pool_stats_t ps0, ps1;
  ofl_manager_stats_t st0, st1;
  for (int i = 0; i < 20; i++)
    iteration(&r);
  ofl_pool_get_stats(r.e.pool, &ps0);
  ofl_manager_get_stats(r.e.m, &st0);
  plan_of(&r, &p);
  uint64_t replans = p.replans, leads = p.lead_changes;
  int over = 0, grew_unchanged = 0;
  uint64_t low = UINT64_MAX, high = 0;
  uint64_t changed_at = 0, before = p.replans + p.lead_changes;
  for (int i = 0; i < steps; i++) {
    ofl_pool_stats_t pa, pb;
    ofl_pool_get_stats(r.e.pool, &pa);
    iteration(&r);
    plan_of(&r, &p);
    ofl_pool_get_stats(r.e.pool, &pb);
    /* The pool may grow only for a plan that changed at the end of this
     * iteration or the one before (a new choice keeps other groups). */
    if (p.replans + p.lead_changes != before) {
      before = p.replans + p.lead_changes;
      changed_at = (uint64_t)i + 1;
    }
    grew_unchanged +=
        pb.total_bytes > pa.total_bytes && (uint64_t)i > changed_at + 1;
    over += p.measured_peak_bytes > p.target_bytes;
    low = p.measured_peak_bytes < low ? p.measured_peak_bytes : low;
    high = p.measured_peak_bytes > high ? p.measured_peak_bytes : high;
  }
  ofl_pool_get_stats(r.e.pool, &ps1);
  ofl_manager_get_stats(r.e.m, &st1);
  cr_assert(eq(u64, p.iterations, (uint64_t)steps + 20));
  cr_assert(eq(u64, st1.iterations - st0.iterations, (uint64_t)steps));
  /* The ledger neither drifts nor leaks: every iteration's peak lies
   * between what the plan keeps and what nothing offloaded would hold. */
  cr_assert(gt(u64, low, 0));
  cr_assert(le(u64, high, p.peak_none_bytes),
            "the ledger drifted: peak %llu above the no-offload peak %llu",
            (unsigned long long)high, (unsigned long long)p.peak_none_bytes);
  /* Every iteration over the target moved a lead back or made the plan
   * solve again (up to 8 times). (Without compute between commits, whether a
   * copy finished before the next commit is a race with the copy worker: the
   * target is not what this test checks.) */
  cr_assert(le(u64, p.replans, 8));
  cr_assert(p.replans == 8 ||
                over <= (int)(p.replans - replans + p.lead_changes - leads),
            "%d of %d iterations over the target, %llu replans, %llu lead "
            "changes",
            over, steps, (unsigned long long)(p.replans - replans),
            (unsigned long long)(p.lead_changes - leads));
  cr_assert(eq(int, grew_unchanged, 0),
            "the activation pool grew in %d steady iterations with the plan "
            "unchanged (%zu -> %zu bytes over the run)",
            grew_unchanged, ps0.total_bytes, ps1.total_bytes);
  for (size_t k = 0; k < p.nnames; k++)
    cr_assert(le(u32, p.names[k].prefetch_lead_max, 16));
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
}

Test(auto_plan, misuse_and_configuration) {
  h_env_t e;
  h_open(&e, 0, 1);
  ofl_manager_plan_t p;
  cr_assert(eq(int, ofl_manager_plan_get(e.m, &p), OFL_ERR_NOT_READY));
  cr_assert(eq(int, p.automatic, 0));
  cr_assert(eq(int, ofl_manager_plan_get(NULL, &p), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_manager_plan_get(e.m, NULL), OFL_ERR_INVALID_ARG));
  h_close(&e);
  run_t r;
  open_run(&r, WORKLOAD, 1 << 20, 0);
  /* Before the end of the warmup. */
  cr_assert(eq(int, ofl_manager_plan_get(r.e.m, &p), OFL_ERR_NOT_READY));
  char buf[8192] = {0};
  FILE *f = fmemopen(buf, sizeof buf - 1, "w");
  ofl_manager_config_print(r.e.m, f);
  fclose(f);
  cr_assert(not(eq(ptr, strstr(buf, "OFL_OFFLOAD_GROUPS"), NULL)));
  cr_assert(not(eq(ptr, strstr(buf, "auto"), NULL)), "%s", buf);
  cr_assert(not(eq(ptr, strstr(buf, "1048576"), NULL)), "%s", buf);
  close_run(&r);
}

/* Without auto the same ledger measures a configured offload (what a
 * benchmark compares the plan with): every group offloaded peaks below
 * nothing offloaded; a manager that offloads no group has no figures. */
Test(auto_plan, the_ledger_measures_a_configured_offload) {
  run_t r;
  open_run_groups(&r, WORKLOAD, "", 0, 0);
  ofl_manager_plan_t p;
  cr_assert(eq(int, ofl_manager_plan_get(r.e.m, &p), OFL_ERR_NOT_READY));
  for (int i = 0; i < 4; i++)
    iteration(&r);
  H_OK(ofl_manager_plan_get(r.e.m, &p));
  cr_assert(eq(int, p.automatic, 0));
  cr_assert(eq(u64, p.iterations, 3));
  cr_assert(eq(u64, p.target_bytes, 0));
  uint64_t peak = p.measured_peak_max_bytes;
  cr_assert(eq(sz, r.wrong, 0));
  close_run(&r);
  open_run_groups(&r, WORKLOAD, "a_name_never_started", 0, 0);
  for (int i = 0; i < 2; i++)
    iteration(&r);
  cr_assert(eq(int, ofl_manager_plan_get(r.e.m, &p), OFL_ERR_NOT_READY));
  close_run(&r);
  uint64_t all, none;
  extremes(&all, &none);
  cr_assert(gt(u64, peak, 0));
  cr_assert(lt(u64, peak, none),
            "every group offloaded measured %llu, nothing offloaded %llu",
            (unsigned long long)peak, (unsigned long long)none);
}

/* ---- what the plan says at the default level ------------------------------
 */

typedef struct {
  int over_warns, other_warns, settled, over_infos;
  char over[1024], settle[1024], other[1024];
} said_t;

static void listen(ofl_log_level_t level, unsigned subsys, const char *msg,
                   void *user) {
  (void)subsys;
  said_t *c = user;
  bool over = strstr(msg, "over the memory target") != NULL;
  if (level == OFL_LOG_WARN && over) {
    if (c->over_warns++ == 0)
      snprintf(c->over, sizeof c->over, "%s", msg);
  } else if (level == OFL_LOG_WARN) {
    c->other_warns++;
    snprintf(c->other, sizeof c->other, "%s", msg);
  } else if (level == OFL_LOG_INFO && strstr(msg, "auto plan settled")) {
    if (c->settled++ == 0)
      snprintf(c->settle, sizeof c->settle, "%s", msg);
  } else if (level == OFL_LOG_INFO && over) {
    c->over_infos++;
  }
}

/* WORKLOAD with eight times the bytes: iterations that hold more than the
 * warmup showed (a longer sequence). Over any target below WORKLOAD's
 * "nothing offloaded" whatever the plan offloads: the groups that stay on
 * the device (the first of each name to run backward: 768 KiB here) alone
 * hold 6 MiB. */
static const gdef_t WORKLOAD_BIG[NG] = {
    {"core_attn", 8 * (256 << 10), 2, 1500, 1500},
    {"mlp", 8 * (192 << 10), 1, 800, 800},
    {"moe_act", 8 * (64 << 10), 1, 500, 500},
};

/* Steady iterations that hold eight times the warmup's bytes go well over a
 * target the warmup's plan meets. At the default level (WARN) that is one
 * WARN, saying by how much and what the plan does next, however many
 * iterations in a row go over; its steps after it stay at INFO. Once the
 * plan ran unchanged for a few iterations, one line says it settled: a
 * notice, which a handler gets as INFO (not a warning). An iteration over
 * the target after the plan settled warns again; before, it does not.
 * (Whether the plan settles here depends on its prefetch leads; the
 * next test has one that always does.) */
Test(auto_plan, an_iteration_over_the_target_warns_once_with_the_next_step) {
  run_t r;
  ofl_manager_plan_t p;
  uint64_t target = open_between(&r, 1, 3, &p);
  said_t c;
  memset(&c, 0, sizeof c);
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(listen, &c);
  int over = 0;
  r.g = WORKLOAD_BIG;
  for (int i = 0; i < 3; i++) { /* three big iterations in a row */
    iteration(&r);
    plan_of(&r, &p);
    over += p.measured_peak_bytes > target;
  }
  int warns_big = c.over_warns, infos_big = c.over_infos;
  char first[sizeof c.over];
  memcpy(first, c.over, sizeof first);
  /* then the warmup's sizes until the plan settles (where reloads keep
   * stalling, as on the stand-in, prefetch leads keep moving and it may
   * not within these iterations) */
  r.g = WORKLOAD;
  for (int i = 0; i < 24 && c.settled == 0; i++)
    iteration(&r);
  int settled = c.settled;
  /* after it settled, one more big iteration: news again */
  r.g = WORKLOAD_BIG;
  iteration(&r);
  plan_of(&r, &p);
  bool over_again = p.measured_peak_bytes > target;
  ofl_log_set_handler(NULL, NULL);

  cr_assert(eq(sz, r.wrong, 0));
  cr_assert(eq(int, over, 3), "the big iterations went over %d times", over);
  cr_assert(eq(int, warns_big, 1),
            "%d over-target WARNs for %d iterations over the target in a "
            "row (want one): %s",
            warns_big, over, first);
  cr_assert(eq(int, infos_big, 0),
            "INFO lines reached a handler at level WARN");
  cr_assert(eq(int, c.other_warns, 0), "%s", c.other);
  cr_assert(ne(ptr, strstr(first, "rank 0: auto plan, iteration "), NULL), "%s",
            first);
  cr_assert(ne(ptr, strstr(first, ": measured activation peak "), NULL), "%s",
            first);
  cr_assert(ne(ptr, strstr(first, "% over the memory target "), NULL), "%s",
            first);
  cr_assert(ne(ptr, strstr(first, " MiB (predicted "), NULL), "%s", first);
  /* what it does next: the first over, with no lead grown, solves again */
  cr_assert(
      ne(ptr, strstr(first, "; the plan solves again for a lower aim, "), NULL),
      "%s", first);
  cr_assert(le(int, settled, 1), "%d settle lines for one plan", settled);
  if (settled == 0) { /* the plan still learns: still no second WARN */
    cr_assert(over_again, "the big iteration after: %llu against %llu",
              (unsigned long long)p.measured_peak_bytes,
              (unsigned long long)target);
    cr_assert(eq(int, c.over_warns, 1),
              "%d over-target WARNs before the plan settled", c.over_warns);
    close_run(&r);
    return;
  }
  cr_assert(ne(ptr,
               strstr(c.settle, "rank 0: auto plan settled at "
                                "iteration "),
               NULL),
            "%s", c.settle);
  cr_assert(ne(ptr, strstr(c.settle, "; measured activation peak "), NULL),
            "%s", c.settle);
  cr_assert(ne(ptr, strstr(c.settle, ", predicted "), NULL), "%s", c.settle);
  cr_assert(ne(ptr, strstr(c.settle, ": within"), NULL), "%s", c.settle);
  cr_assert(over_again, "the big iteration after it settled: %llu against %llu",
            (unsigned long long)p.measured_peak_bytes,
            (unsigned long long)target);
  cr_assert(eq(int, c.over_warns, 2),
            "%d over-target WARNs (want a second after the plan settled)",
            c.over_warns);
  close_run(&r);
}

/* The notice's route: at the default level the default sink prints it
 * (level name NOTE, not WARN); OFL_DEBUG=NONE silences it; a handler gets
 * it as OFL_LOG_INFO (above). */
Test(auto_plan, the_settle_line_prints_at_the_default_level_as_a_note) {
  char path[] = "/tmp/ofl-note-XXXXXX";
  int fd = mkstemp(path);
  cr_assert(ge(int, fd, 0));
  close(fd);
  setenv("OFL_DEBUG_FILE", path, 1);
  setenv("OFL_DEBUG", "WARN", 1);
  ofl_log_reload();
  run_t r;
  open_run(&r, WORKLOAD, 1 << 30, 0); /* met without offload: settles */
  for (int i = 0; i < 8; i++)
    iteration(&r);
  setenv("OFL_DEBUG", "NONE", 1);
  ofl_log_reload();
  for (int i = 0; i < 8; i++) /* nothing changes: no second line anyway */
    iteration(&r);
  close_run(&r);
  unsetenv("OFL_DEBUG_FILE");
  unsetenv("OFL_DEBUG");
  ofl_log_reload();
  char buf[8192] = {0};
  FILE *f = fopen(path, "r");
  cr_assert(not(eq(ptr, f, NULL)));
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  buf[n] = '\0';
  const char *line = strstr(buf, " ofl NOTE PIPELINE rank 0: auto plan "
                                 "settled at iteration ");
  cr_assert(ne(ptr, (void *)line, NULL), "%s", buf);
  const char *eol = strchr(line, '\n');
  cr_assert(ne(ptr, (void *)eol, NULL), "%s", buf);
  cr_assert(eq(ptr, strstr(eol, "auto plan settled"), NULL),
            "two settle lines for one plan: %s", buf);
  cr_assert(ne(ptr, strstr(line, ": within"), NULL), "%s", buf);
  cr_assert(eq(ptr, strstr(buf, "WARN PIPELINE"), NULL), "%s", buf);
}
