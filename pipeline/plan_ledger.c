/* ofl: the auto plan's choice and its ledger (groups "auto",
 * docs/design/pipeline.md section 5.4). End of warmup: the instance
 * (plan_measure.c) is solved, the solver picks the groups, the rest stay
 * on the device (OFL_KEEP_AUTO_PLAN).
 *
 * Steady state: a ledger of the activation bytes on the device (pushed
 * tensors of groups, between their commit and their backward's end; an
 * offloaded group's bytes leave when its copy is seen complete, and come
 * back when its reload is issued) measures the peak the plan predicted;
 * each group's prefetch lead learns from its stalls (Capuchin's feedback:
 * a reload that stalled is issued one group earlier in the next iteration,
 * while the predicted peak stays within the target; one that has not
 * stalled for a while goes back one group when the measured peak is above
 * the target); a measured peak over the target solves again (replan). The
 * group code calls the hooks here (ofl__plan_on_*); the warmup's go to
 * plan_measure.c; the end of each steady iteration (its feedback: the
 * measured recompute cost, the raise) is plan_feedback.c's. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/plan.h"

/* g is a group of the warmup record that the ledger follows. */
static bool followed(const ofl_manager_t *m, const group_t *g) {
  return ofl__plan_ledger_runs(m) && g->pidx < m->ap->nms &&
         m->ap->ms[g->pidx].g == g;
}

/* The prefetch lead of g (0: a group the plan does not follow). */
static uint8_t lead_of(const ofl_manager_t *m, const group_t *g) {
  return followed(m, g) ? m->ap->ms[g->pidx].lead : 0;
}

/* ---- the ledger -----------------------------------------------------------
 */

static void ledger_add(ofl__plan_t *p, int64_t bytes) {
  p->touched = true;
  p->live += bytes;
  if (p->live > p->peak)
    p->peak = p->live;
}

/* Offloaded groups whose copies completed leave the device (D2H is one
 * stream: they complete in commit order). */
void ofl__plan_ledger_poll(ofl_manager_t *m) {
  ofl__plan_t *p = m->ap;
  while (p->fifo_len > 0) {
    uint32_t k = p->fifo[p->fifo_head];
    if (p->pending[k]) {
      group_t *g = p->ms[k].g;
      if (ofl_event_query(g->offload_ev) != OFL_SUCCESS)
        return;
      p->pending[k] = false;
      ledger_add(p, -(int64_t)p->off_now[k]);
    }
    p->fifo_head = (p->fifo_head + 1) % p->nms;
    p->fifo_len--;
  }
}

ofl_status_t ofl_manager_set_plan_recompute(ofl_manager_t *m, int on) {
  if (m == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_set_plan_recompute: manager is NULL");
  if (m->ap != NULL && m->ap->inst != NULL)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_PIPELINE,
                      "rank %d: set_plan_recompute after the warmup's end: "
                      "the plan is made; call it before the first reset",
                      m->rank);
  m->plan_recompute = on != 0;
  return OFL_SUCCESS;
}

void ofl__plan_on_commit(ofl_manager_t *m, group_t *g, int phase) {
  if (g == NULL || !m->offload)
    return;
  if (m->warmup) {
    ofl__plan_warm_commit(m, g, phase);
    return;
  }
  if (!followed(m, g) || phase < 2)
    return;
  ofl__plan_t *p = m->ap;
  meas_t *x = &p->ms[g->pidx];
  ofl__plan_ledger_poll(m);
  uint64_t off;
  x->dev_bytes = ofl__plan_group_bytes(g, &off);
  x->rc_back = false;
  if (g->action == OFL_ACTION_RECOMPUTE) /* the input the application keeps */
    x->dev_bytes += g->rc_input_bytes;
  ledger_add(p, (int64_t)x->dev_bytes);
  off = phase == 2 ? off : 0;
  p->off_now[g->pidx] = off;
  if (off > 0 && p->fifo_len < p->nms) {
    p->pending[g->pidx] = true;
    p->fifo[(p->fifo_head + p->fifo_len) % p->nms] = g->pidx;
    p->fifo_len++;
  }
}

void ofl__plan_on_reload(ofl_manager_t *m, group_t *g, int phase) {
  if (g == NULL)
    return;
  if (m->warmup) {
    ofl__plan_warm_reload(m, g, phase);
    return;
  }
  if (!followed(m, g) || phase == 0)
    return;
  ofl__plan_t *p = m->ap;
  ofl__plan_ledger_poll(m);
  if (p->pending[g->pidx])
    p->pending[g->pidx] = false; /* its bytes never left */
  else
    ledger_add(p, (int64_t)p->off_now[g->pidx]);
}

/* Recomputed group i's rerun bytes are back on the ledger, once per
 * iteration (its own backward's begin, or a chain's rerun before it). */
static void rerun_back(ofl__plan_t *p, uint32_t i) {
  meas_t *x = &p->ms[i];
  if (x->rc_back)
    return;
  x->rc_back = true;
  x->dev_bytes += p->inst[i].recompute_bytes;
  ledger_add(p, (int64_t)p->inst[i].recompute_bytes);
}

void ofl__plan_on_backward(ofl_manager_t *m, group_t *g, int end) {
  if (g == NULL)
    return;
  if (m->warmup) {
    ofl__plan_warm_backward(m, g, end);
    return;
  }
  if (!followed(m, g))
    return;
  ofl__plan_t *p = m->ap;
  meas_t *x = &p->ms[g->pidx];
  ofl__plan_ledger_poll(m);
  bool rc = g->action == OFL_ACTION_RECOMPUTE && p->inst != NULL;
  if (!end) {
    if (g->inline_reload) /* reloaded at its pops, inside this backward */
      ofl__plan_on_reload(m, g, 1);
    if (rc) { /* the rerun forward's bytes are back */
      rerun_back(p, g->pidx);
      /* a chain: its input's group, recomputed too, is rerun for it now
       * and held until that group's backward ends */
      const ofl__plan_group_t *q = &p->inst[g->pidx];
      if (q->has_input && q->input_of < p->nms &&
          p->ms[q->input_of].g->action == OFL_ACTION_RECOMPUTE)
        rerun_back(p, q->input_of);
      x->rc_bwd_cpu = ofl__now_ns();
    }
    return;
  }
  if (rc && x->rc_bwd_cpu != 0) {
    x->rc_bwd_ns = ofl__now_ns() - x->rc_bwd_cpu;
    x->rc_fresh = true;
  }
  ledger_add(p, -(int64_t)x->dev_bytes);
}

/* ---- prefetch depth -------------------------------------------------------
 */

uint32_t ofl__plan_prefetch_depth(const ofl_manager_t *m, const chunk_t *c,
                                  const chunk_t *next, uint32_t ahead) {
  if (!m->auto_plan || !ofl__plan_ledger_runs(m) || m->ap->inst == NULL)
    return m->prefetch_groups;
  uint32_t depth = 0, pos = ahead;
  const chunk_t *order[2] = {c, next != c ? next : NULL};
  for (int k = 0; k < 2; k++) {
    const chunk_t *x = order[k];
    for (uint32_t i = x ? x->nstack : 0; i-- > 0 && pos < LEAD_MAX;) {
      pos++;
      if (lead_of(m, x->stack[i]) >= pos)
        depth = pos;
    }
  }
  return depth;
}

/* ---- end of warmup: the plan -------------------------------------------- */

/* Each name's exposed_ms: its chosen groups' parts of the plan's exposed
 * time (part, from ofl__plan_exposure: the reload queue included); where
 * part is NULL (no memory for it), each group's bound alone. */
static void name_exposure(ofl__plan_t *p, const double *part) {
  for (size_t k = 0; k < p->out.nnames; k++)
    p->names[k].exposed_ms = 0;
  for (uint32_t i = 0; i < p->nms; i++)
    if (p->chosen[i])
      p->names[p->inst[i].name].exposed_ms +=
          (part != NULL ? part[i] : ofl__plan_group_exposed(&p->inst[i])) / 1e6;
}

static void fill_names(ofl_manager_t *m) {
  ofl__plan_t *p = m->ap;
  p->names = calloc((size_t)(m->nnames ? m->nnames : 1), sizeof *p->names);
  if (p->names == NULL)
    return;
  for (int k = 0; k < m->nnames; k++)
    p->names[k].name = m->names[k].name;
  for (uint32_t i = 0; i < p->nms; i++) {
    const ofl__plan_group_t *q = &p->inst[i];
    ofl_plan_name_t *x = &p->names[q->name];
    x->groups++;
    x->bytes += q->bytes;
    x->copy_ms += (q->d2h_ns + q->h2d_ns) / 1e6;
    x->window_ms += (q->fwd_window_ns + q->bwd_window_ns) / 1e6;
    if (p->chosen[i]) {
      x->chosen++;
      x->chosen_bytes += q->bytes;
    }
    if (p->ms[i].lead > x->prefetch_lead_max)
      x->prefetch_lead_max = p->ms[i].lead;
  }
  p->out.nnames = (size_t)m->nnames;
  p->out.names = p->names;
}

const bool *ofl__plan_rec(ofl__plan_t *p) {
  if (p->action == NULL || p->rec == NULL)
    return NULL;
  for (uint32_t i = 0; i < p->nms; i++)
    p->rec[i] = p->action[i] == OFL__PLAN_RECOMPUTE;
  return p->rec;
}

/* Each name's action and costs (ofl_manager_plan_action), from the plan's
 * actions and the names' exposure (fill_names, ofl__plan_predict). */
void ofl__plan_fill_acts(ofl_manager_t *m) {
  ofl__plan_t *p = m->ap;
  if (p->acts == NULL) {
    p->acts = calloc((size_t)(m->nnames ? m->nnames : 1), sizeof *p->acts);
    p->stall0 = calloc((size_t)(m->nnames ? m->nnames : 1), sizeof *p->stall0);
    if (p->acts == NULL || p->stall0 == NULL)
      return;
    for (int k = 0; k < m->nnames; k++) {
      p->acts[k].recomputable = 1;
      p->stall0[k] = m->names[k].st.stall_ns;
    }
  }
  for (int k = 0; k < m->nnames; k++) {
    ofl_plan_action_t *a = &p->acts[k];
    int rc = a->recomputable;
    memset(a, 0, sizeof *a);
    a->name = m->names[k].name;
    a->recomputable = rc;
  }
  p->recompute_ms = 0;
  /* the recomputed groups, for the forwards two of them share (each is
   * paid once, by the first backward: ofl__plan_rerun_credit) */
  const bool *rec = ofl__plan_rec(p);
  for (uint32_t i = 0; i < p->nms; i++) {
    const ofl__plan_group_t *q = &p->inst[i];
    ofl_plan_action_t *a = &p->acts[q->name];
    bool rc = p->action != NULL && p->action[i] == OFL__PLAN_RECOMPUTE;
    a->groups++;
    a->bytes += q->bytes + q->kept_bytes;
    a->recomputable = a->recomputable && q->recomputable;
    a->recompute_bytes += q->recompute_bytes;
    /* a recompute whose input's holder is offloaded waits for its reload */
    double wait =
        rc && q->has_input
            ? ofl__plan_input_wait(p->inst, i, p->chosen[q->input_of]) / 1e6
            : 0;
    double shared =
        rc && rec != NULL ? ofl__plan_rerun_credit(p->inst, p->nms, rec, i) : 0;
    a->recompute_ms += (q->recompute_ns - shared) / 1e6 + wait;
    a->offloaded += p->chosen[i];
    a->recomputed += rc;
    if (rc)
      p->recompute_ms += (q->recompute_ns - shared) / 1e6 + wait;
  }
  for (int k = 0; k < m->nnames; k++) {
    ofl_plan_action_t *a = &p->acts[k];
    if (a->groups == 0)
      a->recomputable = 0;
    a->action = a->recomputed > 0  ? OFL_ACTION_RECOMPUTE
                : a->offloaded > 0 ? OFL_ACTION_OFFLOAD
                                   : OFL_ACTION_KEEP;
    a->predicted_ms = a->recomputed > 0  ? a->recompute_ms
                      : p->names != NULL ? p->names[k].exposed_ms
                                         : 0;
  }
}

/* The plan's predicted exposed time, its reload waits and each name's
 * share, for the choice in p->chosen with the prefetch leads now in force
 * (each lead sets its group's modelled reload time: set_lead), from one
 * simulation; 0 where its scratch cannot be allocated. Returns the exposed
 * ns. */
double ofl__plan_predict(ofl__plan_t *p) {
  double *part =
      p->names != NULL ? calloc(p->nms ? p->nms : 1, sizeof *part) : NULL;
  double waits = 0;
  double exposed = ofl__plan_exposure(p->inst, p->nms, p->chosen, &waits, part);
  if (!isfinite(exposed)) {
    exposed = waits = 0;
    free(part);
    part = NULL;
  }
  p->out.predicted_stall_ms = waits / 1e6;
  p->out.predicted_exposed_ms = exposed / 1e6;
  if (p->names != NULL)
    name_exposure(p, part);
  free(part);
  return exposed;
}

/* The chosen groups offload in steady state, the other offloadable ones
 * stay (OFL_KEEP_AUTO_PLAN). Returns the predicted exposed ns
 * (ofl__plan_predict). */
static double apply(ofl__plan_t *p) {
  for (uint32_t i = 0; i < p->nms; i++) {
    group_t *g = p->ms[i].g;
    bool rc = p->action != NULL && p->action[i] == OFL__PLAN_RECOMPUTE;
    g->action = rc             ? OFL_ACTION_RECOMPUTE
                : p->chosen[i] ? OFL_ACTION_OFFLOAD
                               : OFL_ACTION_KEEP;
    if (!p->inst[i].offloadable)
      continue;
    g->policy_offload = p->chosen[i];
    g->keep_why = p->chosen[i] ? OFL_KEEP_NONE : OFL_KEEP_AUTO_PLAN;
  }
  return ofl__plan_predict(p);
}

/* Solves for aim into p->chosen and p->action: keep, offload or recompute
 * where the manager may recompute, else offload-only. */
ofl_status_t ofl__plan_choose(ofl_manager_t *m, uint64_t aim,
                              ofl__plan_result_t *r) {
  ofl__plan_t *p = m->ap;
  if (p->action == NULL)
    p->action = calloc(p->nms ? p->nms : 1, sizeof *p->action);
  if (p->rec == NULL)
    p->rec = calloc(p->nms ? p->nms : 1, sizeof *p->rec);
  if (p->action == NULL || p->rec == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the auto plan's actions");
  OFL_CHECK(ofl__plan_solve_actions(p->inst, p->nms, m->nnames, aim,
                                    m->plan_recompute, p->action, r));
  ofl__plan_take_actions(m, r);
  return OFL_SUCCESS;
}

void ofl__plan_take_actions(ofl_manager_t *m, const ofl__plan_result_t *r) {
  ofl__plan_t *p = m->ap;
  for (uint32_t i = 0; i < p->nms; i++) {
    p->chosen[i] = p->action[i] == OFL__PLAN_OFFLOAD;
    p->ms[i].rc_solved_ns = p->inst[i].recompute_ns;
  }
  p->lowest = r->lowest;
  if (r->cut)
    OFL_INFO(OFL_SUBSYS_PIPELINE,
             "rank %d: auto plan: the lowest-peak search was cut after %u "
             "evaluations (OFL__PLAN_LOWEST_BUDGET): the lowest peak it "
             "found, %.2f MiB, may not be the lowest",
             m->rank, r->lowest_nodes, ofl__mib(r->predicted_peak));
}

/* The ledger's arrays, one entry per group of the record. */
static ofl_status_t ledger_alloc(ofl__plan_t *p) {
  uint32_t n = p->nms ? p->nms : 1;
  p->off_now = calloc(n, sizeof *p->off_now);
  p->pending = calloc(n, sizeof *p->pending);
  p->fifo = calloc(n, sizeof *p->fifo);
  if (!p->off_now || !p->pending || !p->fifo)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the activation ledger");
  p->ledger = true;
  return OFL_SUCCESS;
}

ofl_status_t ofl__plan_end_warmup(ofl_manager_t *m) {
  if (m->ap != NULL && !m->auto_plan)
    return ledger_alloc(m->ap); /* measured peaks only */
  if (!m->auto_plan)
    return OFL_SUCCESS;
  OFL_CHECK(ofl__plan_alloc(m));
  ofl__plan_t *p = m->ap;
  p->base_lead =
      (uint8_t)(m->prefetch_groups > LEAD_MAX ? LEAD_MAX : m->prefetch_groups);
  /* The stamps are read once: the warmup's work must have finished, and
   * its reload waits measured (on cuda by timing events, read here). */
  ofl_status_t s = ofl_stream_synchronize(ofl__compute(m), OFL_TIMEOUT_DEFAULT);
  if (s == OFL_SUCCESS)
    s = ofl_stream_synchronize(m->d2h, OFL_TIMEOUT_DEFAULT);
  if (s == OFL_SUCCESS)
    s = ofl_stream_synchronize(m->h2d, OFL_TIMEOUT_DEFAULT);
  if (s != OFL_SUCCESS)
    return s;
  ofl__stall_harvest(m, true);
  int nnames = 0;
  OFL_CHECK(ofl__plan_build_instance(m, &nnames));
  OFL_CHECK(ledger_alloc(p));
  ofl_status_t dts = ofl__plan_device_target(m);
  ofl__plan_result_t r;
  (void)nnames;
  if (m->mem_target > 0) {
    OFL_CHECK(ofl__plan_choose(m, m->mem_target, &r));
  } else {
    /* No target: every group whose copies hide entirely (memory saved at
     * no predicted cost), each in the window it has with every group
     * offloaded (the shortest: the choice only widens them). */
    for (uint32_t i = 0; i < p->nms; i++) {
      const ofl__plan_group_t *q = &p->inst[i];
      p->chosen[i] =
          q->offloadable && fmax(0.0, q->d2h_ns - q->fwd_window_ns) +
                                    fmax(0.0, q->h2d_ns - q->bwd_window_ns) <
                                1.0;
    }
    memset(&r, 0, sizeof r);
    r.predicted_peak = ofl__plan_peak(p->inst, p->nms, p->chosen);
    r.met = true;
    r.exact = true;
    bool *all = calloc(p->nms ? p->nms : 1, sizeof *all);
    if (all != NULL) {
      r.peak_none = ofl__plan_peak(p->inst, p->nms, all);
      for (uint32_t i = 0; i < p->nms; i++)
        all[i] = p->inst[i].offloadable;
      r.peak_all = ofl__plan_peak(p->inst, p->nms, all);
      free(all);
    }
  }
  fill_names(m); /* before apply: its prediction fills their exposure */
  double exposed = apply(p);
  ofl__plan_fill_acts(m);
  p->solve_target = m->mem_target;
  p->out.automatic = 1;
  p->out.met = r.met;
  p->out.exact = r.exact;
  p->out.target_bytes = m->mem_target;
  p->out.predicted_peak_bytes = r.predicted_peak;
  p->out.peak_all_bytes = r.peak_all;
  p->out.peak_none_bytes = r.peak_none;
  p->out.shortfall_bytes =
      r.met || m->mem_target == 0 ? 0 : r.predicted_peak - m->mem_target;
  if (m->mem_target > 0 && !r.met && r.lowest)
    OFL_WARN(OFL_SUBSYS_PIPELINE,
             "rank %d: memory target %.2f MiB cannot be met: no plan that "
             "keeps, offloads or recomputes leaves the predicted activation "
             "peak within it; target not met, lowest peak chosen: %.2f MiB, "
             "%.2f MiB over the target (offloading every group that may go "
             "leaves %.2f)%s. Raise OFL_MEMORY_TARGET "
             "(params.memory_target_bytes), offload more (smaller "
             "OFL_MIN_OFFLOAD_BYTES) or make more groups recomputable",
             m->rank, ofl__mib(m->mem_target), ofl__mib(r.predicted_peak),
             ofl__mib(p->out.shortfall_bytes), ofl__mib(r.peak_all),
             r.cut ? "; the search for it was cut at its budget, a lower one "
                     "may exist"
                   : "");
  else if (m->mem_target > 0 && !r.met)
    OFL_WARN(OFL_SUBSYS_PIPELINE,
             "rank %d: memory target %.2f MiB cannot be met: offloading every "
             "group that may go leaves a predicted activation peak of %.2f "
             "MiB, %.2f MiB over the target; everything that may go is "
             "offloaded. Raise OFL_MEMORY_TARGET (params.memory_target_bytes) "
             "or offload more (smaller OFL_MIN_OFFLOAD_BYTES)",
             m->rank, ofl__mib(m->mem_target), ofl__mib(r.predicted_peak),
             ofl__mib(p->out.shortfall_bytes));
  OFL_INFO(OFL_SUBSYS_PIPELINE,
           "rank %d: auto plan: %s search, predicted peak %.2f MiB (target "
           "%.2f%s, all offloaded %.2f, none %.2f), predicted exposed %.3f ms "
           "(reload waits %.3f), "
           "links d2h %.2f h2d %.2f GB/s (%s), release latency %.3f ms, "
           "the warmup's reload waits (%.3f ms) out of its timeline",
           m->rank, r.exact ? "exact" : "greedy", ofl__mib(r.predicted_peak),
           ofl__mib(m->mem_target),
           r.lowest ? ": target not met, lowest peak chosen" : "",
           ofl__mib(r.peak_all), ofl__mib(r.peak_none), exposed / 1e6,
           p->out.predicted_stall_ms, p->out.d2h_gbps, p->out.h2d_gbps,
           p->out.rate_source, p->out.release_ms, p->out.warmup_stall_ms);
  p->stall_ns_start = m->st.stall_ns;
  return dts;
}

/* ---- steady iterations ----------------------------------------------------
 */

/* Moves group g's reload to lead want (recomputing its modelled reload
 * time and backward window). An earlier reload is refused when the
 * predicted peak with it goes over the target. */
static bool set_lead(ofl_manager_t *m, group_t *g, uint8_t want,
                     const char *why) {
  ofl__plan_t *p = m->ap;
  uint32_t i = g->pidx;
  meas_t *x = &p->ms[i];
  ofl__plan_group_t *q = &p->inst[i];
  int64_t begin = ofl__plan_at_ns(p, &p->ms[i].bwd_begin);
  if (begin < q->t_alloc || begin > q->t_free)
    begin = q->t_free;
  if (q->bwd_pos < 0)
    return false;
  int64_t old = q->t_reload;
  q->t_reload = ofl__plan_reload_time(p, (uint32_t)q->bwd_pos, want,
                                      (uint32_t)q->gate_pos, q->t_alloc, begin);
  if (want > x->lead && m->mem_target > 0 &&
      ofl__plan_peak(p->inst, p->nms, p->chosen) > m->mem_target) {
    q->t_reload = old; /* the target leaves no room for it */
    return false;
  }
  q->lead = want;
  q->bwd_window_ns = (double)(begin - q->t_reload);
  OFL__PLOG(OFL_LOG_INFO, m, g->chunk, ofl__gname(m, g),
            "prefetch lead %u -> %u (%s)", x->lead, want, why);
  if (want < x->lead)
    x->lead_cap = want; /* it went over once: never that deep again */
  x->lead = want;
  p->out.lead_changes++;
  return true;
}

/* Capuchin's feedback, bounded by the target. Under the target: a reload
 * that stalled is issued one group earlier while the predicted peak with
 * it stays within the target and its bytes fit in the room the measured
 * peak leaves under the target. Over it: the leads that grew go back one
 * group (those whose reloads did not stall first) and never grow that far
 * again; with none grown, the plan solves again (ofl__plan_replan). Returns
 * true when a lead went back. */
bool ofl__plan_learn(ofl_manager_t *m, bool over) {
  ofl__plan_t *p = m->ap;
  if (over) {
    bool back = false;
    for (int pass = 0; pass < 2 && !back; pass++)
      for (uint32_t i = 0; i < p->nms; i++) {
        meas_t *x = &p->ms[i];
        if (p->chosen[i] && x->lead > p->base_lead &&
            (pass == 1 || !x->stalled))
          back |= set_lead(m, x->g, (uint8_t)(x->lead - 1),
                           "the measured peak is over the target");
      }
    return back;
  }
  /* A reload issued one group earlier holds its bytes over one more
   * backward, where the peak may be: each lead that grows takes its
   * group's bytes from the room the measured peak leaves under the target,
   * and none grows beyond it. */
  const ofl_manager_plan_t *o = &p->out;
  uint64_t room = o->target_bytes == 0 ? UINT64_MAX
                  : o->target_bytes > o->measured_peak_bytes
                      ? o->target_bytes - o->measured_peak_bytes
                      : 0;
  for (uint32_t i = 0; i < p->nms; i++) {
    meas_t *x = &p->ms[i];
    if (p->chosen[i] && x->stalled && x->lead < x->lead_cap &&
        p->inst[i].bytes <= room) {
      if (set_lead(m, x->g, (uint8_t)(x->lead + 1), "its reload stalled") &&
          room != UINT64_MAX)
        room -= p->inst[i].bytes;
    }
  }
  return false;
}

/* The choice in p->chosen, solved for aim with peak predicted_peak,
 * becomes the plan: applied to the groups, and its figures published. */
void ofl__plan_adopt(ofl_manager_t *m, uint64_t aim, uint64_t predicted_peak) {
  ofl__plan_t *p = m->ap;
  ofl_manager_plan_t *o = &p->out;
  p->solve_target = aim;
  o->predicted_exposed_ms = apply(p) / 1e6;
  o->predicted_peak_bytes = predicted_peak;
  o->met = predicted_peak <= o->target_bytes;
  o->shortfall_bytes = o->met ? 0 : predicted_peak - o->target_bytes;
  for (size_t k = 0; k < o->nnames; k++) {
    p->names[k].chosen = 0;
    p->names[k].chosen_bytes = 0;
  }
  for (uint32_t i = 0; i < p->nms; i++) {
    if (!p->chosen[i])
      continue;
    ofl_plan_name_t *x = &p->names[p->inst[i].name];
    x->chosen++;
    x->chosen_bytes += p->inst[i].bytes;
  }
  ofl__plan_fill_acts(m);
}

/* The measured peak went over the target: the model missed (copies that
 * left later than the warmup saw, reloads that came earlier; on a GPU the
 * CPU runs ahead of the device, so a group's bytes leave at a later marker
 * than its copy's end). Solve again for the aim ofl__plan_replan_aim gives
 * (the target less the model's error, or the last aim less the
 * overshoot); the next iterations offload the new choice. Returns whether
 * it solved. */
bool ofl__plan_replan(ofl_manager_t *m) {
  ofl__plan_t *p = m->ap;
  ofl_manager_plan_t *o = &p->out;
  uint64_t aim =
      ofl__plan_replan_aim(o->target_bytes, p->solve_target,
                           o->measured_peak_bytes, o->predicted_peak_bytes);
  ofl__plan_result_t r;
  if (m->plan_recompute && p->action != NULL) {
    /* three-way: a choice that carries less of the error may aim higher */
    if (ofl__plan_replan_actions(p->inst, p->nms, m->nnames, o->target_bytes,
                                 p->solve_target, o->measured_peak_bytes,
                                 o->predicted_peak_bytes,
                                 ofl__plan_chosen_bytes(p), p->action, &r,
                                 &aim) != OFL_SUCCESS)
      return false;
    ofl__plan_take_actions(m, &r);
  } else if (ofl__plan_choose(m, aim, &r) != OFL_SUCCESS) {
    return false;
  }
  o->replans++;
  ofl__plan_adopt(m, aim, r.predicted_peak);
  OFL_INFO(OFL_SUBSYS_PIPELINE,
           "rank %d: auto plan %llu: measured peak %.2f MiB over the target "
           "%.2f MiB; solved again for %.2f MiB: predicted %.2f MiB%s, "
           "exposed %.3f ms",
           m->rank, (unsigned long long)o->replans,
           ofl__mib(o->measured_peak_bytes), ofl__mib(o->target_bytes),
           ofl__mib(aim), ofl__mib(r.predicted_peak),
           r.lowest ? " (no plan meets it: lowest peak chosen)" : "",
           o->predicted_exposed_ms);
  return true;
}
