/* ofl: what the manager reports at the end of the warmup and after it:
 * the summary (bytes per group name, gathered on the comm: rule 7), the
 * per-group placement table (ofl_manager_group_plan), and the auto plan
 * as printed on rank 0 and read back (ofl_manager_plan_get,
 * ofl_manager_plan_action). It reads what policy.c and the plan (plan_ledger.c)
 * decided and decides nothing. */
#include <math.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"
#include "pipeline/plan.h"

/* ---- the summary ------------------------------------------------------- */

static void plan_one(const ofl_manager_t *m, const plan_rec_t *r,
                     ofl_group_plan_t *out) {
  memset(out, 0, sizeof *out);
  out->chunk = r->c->index;
  out->vp_stage = r->c->vp_stage;
  out->microbatch = r->c->mb;
  out->name = m->names[r->nid].name;
  out->placement = OFL_GROUP_DEVICE;
  const group_t *g = r->g;
  if (g == NULL) {
    out->reason = OFL_KEEP_NOT_SELECTED;
    return;
  }
  out->bytes = g->warm_bytes;
  out->disk_bytes = g->warm_disk_bytes;
  if (g->warm_bytes == 0)
    out->reason = g->warm_budget_bytes > 0 ? OFL_KEEP_HOST_BUDGET
                  : g->warm_small > 0 || g->warm_flagged == 0
                      ? OFL_KEEP_SIZE
                      : OFL_KEEP_NOT_OFFLOADABLE;
  else if (!g->policy_offload)
    out->reason = (ofl_group_keep_reason_t)g->keep_why;
  else if (g->next_in_bwd)
    out->reason = OFL_KEEP_NEXT_BACKWARD;
  else
    out->placement =
        g->warm_disk_bytes == g->warm_bytes ? OFL_GROUP_DISK : OFL_GROUP_PINNED;
}

size_t ofl_manager_group_plan_count(const ofl_manager_t *m) {
  return m != NULL && !m->warmup ? m->nplan : 0;
}

ofl_status_t ofl_manager_group_plan(const ofl_manager_t *m, size_t i,
                                    ofl_group_plan_t *out) {
  if (m == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_plan: manager and out must not be "
                      "NULL");
  if (m->warmup)
    return ofl__error_quiet(OFL_ERR_NOT_READY,
                            "rank %d: the group plan exists after the warmup "
                            "iteration's reset",
                            m->rank);
  if (i >= m->nplan)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_plan: index %zu out of range (%u "
                      "groups in the record; see "
                      "ofl_manager_group_plan_count)",
                      i, m->nplan);
  plan_one(m, &m->plan[i], out);
  return OFL_SUCCESS;
}

/* A byte table gathered over params.comm (collective: every rank of it
 * calls), or this rank's alone without a comm. */
static ofl_status_t gather_table(ofl_manager_t *m, const ofl_byte_table_t *t,
                                 ofl_summary_t **out) {
  if (m->comm != NULL)
    return ofl_summary_gather(m->comm, t, 0, out);
  const ofl_byte_table_t *one[1] = {t};
  return ofl_summary_from_tables(one, 1, out);
}

/* Rule 7: the per-name table is gathered on the user's comm (collective:
 * every rank of it resets), an empty table still making a row. */
ofl_status_t ofl__report_summary(ofl_manager_t *m) {
  ofl_byte_table_t *table = NULL;
  OFL_CHECK(ofl_byte_table_create(&table));
  ofl_status_t s = OFL_SUCCESS;
  for (int k = 0; k < m->nnames && s == OFL_SUCCESS; k++)
    if (m->names[k].summary_bytes > 0)
      s = ofl_byte_table_set(table, m->names[k].name,
                             m->names[k].summary_bytes);
  ofl_summary_t *sum = NULL;
  if (s == OFL_SUCCESS)
    s = gather_table(m, table, &sum);
  ofl_byte_table_destroy(table);
  if (s != OFL_SUCCESS)
    return s;
  ofl_summary_destroy(m->summary);
  m->summary = sum;
  bool root = m->comm == NULL || ofl_comm_rank(m->comm) == 0;
  if (root && m->summary_out != NULL)
    s = ofl_summary_write(sum, OFL_SUMMARY_TEXT, m->summary_out);
  return s;
}

ofl_status_t ofl_manager_summary_bytes(const ofl_manager_t *m, const char *name,
                                       uint64_t *out) {
  if (m == NULL || name == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_summary_bytes: arguments must not be NULL");
  if (m->warmup)
    return ofl__error_quiet(OFL_ERR_NOT_READY,
                            "rank %d: the summary exists after the warmup "
                            "iteration's reset",
                            m->rank);
  int i = ofl__name_find(m, name);
  *out = i < 0 ? 0 : m->names[i].summary_bytes;
  return OFL_SUCCESS;
}

uint64_t ofl_manager_summary_total_bytes(const ofl_manager_t *m) {
  uint64_t total = 0;
  for (int i = 0; m != NULL && !m->warmup && i < m->nnames; i++)
    total += m->names[i].summary_bytes;
  return total;
}

const ofl_summary_t *ofl_manager_summary(const ofl_manager_t *m) {
  return m != NULL && !m->warmup ? m->summary : NULL;
}

/* ---- the printed plan -----------------------------------------------------
 */

static const char *const FIELDS[] = {"bytes", "groups", "chosen",
                                     "copy",  "window", "exposed"};
enum { F_BYTES, F_GROUPS, F_CHOSEN, F_COPY, F_WINDOW, F_EXPOSED, NF };
static const char *const SCALARS[] = {"target", "peak", "all", "none", "expo",
                                      "stall",  "d2h",  "h2d", "met",  "low"};
enum {
  S_TARGET,
  S_PEAK,
  S_ALL,
  S_NONE,
  S_EXPO,
  S_STALL,
  S_D2H,
  S_H2D,
  S_MET,
  S_LOW, /* no plan meets the target: the lowest peak (three-way) */
  NS
};

static ofl_status_t encode(const ofl_manager_t *m, ofl_byte_table_t *t) {
  const ofl__plan_t *p = m->ap;
  char key[OFL_BYTE_TABLE_NAME_MAX + 1];
  if (p == NULL || p->names == NULL)
    return OFL_SUCCESS;
  const ofl_manager_plan_t *o = &p->out;
  uint64_t sc[NS] = {o->target_bytes,
                     o->predicted_peak_bytes,
                     o->peak_all_bytes,
                     o->peak_none_bytes,
                     (uint64_t)llround(o->predicted_exposed_ms * 1e6),
                     (uint64_t)llround(o->predicted_stall_ms * 1e6),
                     (uint64_t)llround(o->d2h_gbps * 1e3),
                     (uint64_t)llround(o->h2d_gbps * 1e3),
                     (uint64_t)o->met,
                     (uint64_t)(!o->met && p->lowest)};
  for (int k = 0; k < NS; k++) {
    snprintf(key, sizeof key, "|%s", SCALARS[k]);
    OFL_CHECK(ofl_byte_table_set(t, key, sc[k]));
  }
  for (size_t k = 0; k < o->nnames; k++) {
    const ofl_plan_name_t *x = &o->names[k];
    if (x->groups == 0)
      continue;
    uint64_t v[NF] = {x->bytes,
                      x->groups,
                      x->chosen,
                      (uint64_t)llround(x->copy_ms * 1e6),
                      (uint64_t)llround(x->window_ms * 1e6),
                      (uint64_t)llround(x->exposed_ms * 1e6)};
    for (int f = 0; f < NF; f++) {
      snprintf(key, sizeof key, "%s|%.900s", FIELDS[f], x->name);
      OFL_CHECK(ofl_byte_table_set(t, key, v[f]));
    }
    if (!m->plan_recompute || p->acts == NULL)
      continue;
    /* Three-way plans: the action (+1: 0 is absent; 8: recomputable),
     * what a recompute frees, the predicted cost of the action. */
    const ofl_plan_action_t *a = &p->acts[k];
    uint64_t w[3] = {(uint64_t)a->action + 1 + (a->recomputable ? 8 : 0),
                     a->recompute_bytes,
                     (uint64_t)llround(a->predicted_ms * 1e6)};
    const char *wk[3] = {"action", "rcbytes", "cost"};
    for (int f = 0; f < 3; f++) {
      snprintf(key, sizeof key, "%s|%.900s", wk[f], x->name);
      OFL_CHECK(ofl_byte_table_set(t, key, w[f]));
    }
  }
  if (m->plan_recompute)
    OFL_CHECK(ofl_byte_table_set(t, "|rcms",
                                 (uint64_t)llround(p->recompute_ms * 1e6)));
  return OFL_SUCCESS;
}

static uint64_t get(const ofl_summary_t *s, int rank, const char *key) {
  size_t i;
  if (ofl_summary_find_group(s, key, &i) != OFL_SUCCESS)
    return 0;
  return ofl_summary_bytes(s, rank, i);
}

/* Three-way plans (OFL_PLAN_RECOMPUTE): per name its action, what a
 * recompute frees and the predicted cost of the action. */
static void render_actions(const ofl_summary_t *s, int r, FILE *f) {
  static const char *const act[] = {"keep", "offload", "recompute"};
  char key[OFL_BYTE_TABLE_NAME_MAX + 32];
  bool head = false;
  for (size_t i = 0; i < ofl_summary_ngroups(s); i++) {
    const char *k = ofl_summary_group_name(s, i);
    if (k == NULL || strncmp(k, "action|", 7) != 0)
      continue;
    const char *name = k + 7;
    uint64_t a = get(s, r, k);
    if (a == 0)
      continue;
    if (!head) {
      fprintf(f, "%-5s %-20s %-10s %12s %15s %10s\n", "rank", "group", "action",
              "recomputable", "recompute MiB", "cost ms");
      head = true;
    }
    snprintf(key, sizeof key, "rcbytes|%s", name);
    uint64_t rb = get(s, r, key);
    snprintf(key, sizeof key, "cost|%s", name);
    uint64_t cost = get(s, r, key);
    uint64_t ai = (a - 1) & 7;
    fprintf(f, "%-5d %-20s %-10s %12s %15.2f %10.3f\n", r, name,
            act[ai < 3 ? ai : 0], (a & 8) ? "yes" : "no", ofl__mib(rb),
            (double)cost / 1e6);
  }
  if (head)
    fprintf(f,
            "rank %d: predicted recompute %.3f ms per iteration (the "
            "recomputed groups' forward time, measured in the warmup, and "
            "their waits for the reloads of offloaded inputs)\n",
            r, (double)get(s, r, "|rcms") / 1e6);
}

static void render(const ofl_summary_t *s, FILE *f) {
  int nranks = ofl_summary_nranks(s);
  /* Printed once, at the end of the warmup: every figure is the model's
   * prediction (the steady iterations measure, and may solve again), and
   * says so, since a demo or an application prints measured peaks later. */
  fprintf(f, "ofl offload plan (groups auto), every rank: chosen at the end "
             "of the warmup; its peaks and times are predicted (the steady "
             "iterations measure them, and may solve again)\n");
  fprintf(f, "%-5s %-20s %10s %7s %7s %9s %10s %11s\n", "rank", "group",
          "bytes MiB", "groups", "chosen", "copy ms", "window ms",
          "exposed ms");
  char key[OFL_BYTE_TABLE_NAME_MAX + 32];
  for (int r = 0; r < nranks; r++) {
    for (size_t i = 0; i < ofl_summary_ngroups(s); i++) {
      const char *k = ofl_summary_group_name(s, i);
      if (k == NULL || strncmp(k, "bytes|", 6) != 0)
        continue;
      const char *name = k + 6;
      snprintf(key, sizeof key, "groups|%s", name);
      uint64_t groups = get(s, r, key);
      if (groups == 0)
        continue;
      uint64_t v[NF];
      for (int fi = 0; fi < NF; fi++) {
        snprintf(key, sizeof key, "%s|%s", FIELDS[fi], name);
        v[fi] = get(s, r, key);
      }
      fprintf(f, "%-5d %-20s %10.2f %7llu %7llu %9.3f %10.3f %11.3f\n", r, name,
              ofl__mib(v[F_BYTES]), (unsigned long long)v[F_GROUPS],
              (unsigned long long)v[F_CHOSEN], (double)v[F_COPY] / 1e6,
              (double)v[F_WINDOW] / 1e6, (double)v[F_EXPOSED] / 1e6);
    }
    render_actions(s, r, f);
    uint64_t sc[NS];
    for (int k = 0; k < NS; k++) {
      snprintf(key, sizeof key, "|%s", SCALARS[k]);
      sc[k] = get(s, r, key);
    }
    if (sc[S_TARGET] > 0)
      fprintf(f,
              "rank %d: predicted activation peak %.2f MiB against the "
              "memory target %.2f MiB: %s; predicted with all offloaded "
              "%.2f, with none %.2f; predicted exposed %.3f ms (reload "
              "waits %.3f); links measured in the warmup d2h %.2f h2d %.2f "
              "GB/s\n",
              r, ofl__mib(sc[S_PEAK]), ofl__mib(sc[S_TARGET]),
              sc[S_MET]   ? "predicted met"
              : sc[S_LOW] ? "predicted NOT met (no plan meets it: target not "
                            "met, lowest peak chosen)"
                          : "predicted NOT met",
              ofl__mib(sc[S_ALL]), ofl__mib(sc[S_NONE]),
              (double)sc[S_EXPO] / 1e6, (double)sc[S_STALL] / 1e6,
              (double)sc[S_D2H] / 1e3, (double)sc[S_H2D] / 1e3);
    else
      fprintf(f,
              "rank %d: no memory target: copies that hide are offloaded; "
              "predicted activation peak %.2f MiB (predicted with all "
              "offloaded %.2f, with none %.2f); predicted exposed %.3f ms "
              "(reload waits %.3f); links measured in the warmup d2h %.2f "
              "h2d %.2f GB/s\n",
              r, ofl__mib(sc[S_PEAK]), ofl__mib(sc[S_ALL]),
              ofl__mib(sc[S_NONE]), (double)sc[S_EXPO] / 1e6,
              (double)sc[S_STALL] / 1e6, (double)sc[S_D2H] / 1e3,
              (double)sc[S_H2D] / 1e3);
  }
}

ofl_status_t ofl__report_plan(ofl_manager_t *m) {
  if (!m->auto_plan)
    return OFL_SUCCESS;
  ofl_byte_table_t *table = NULL;
  OFL_CHECK(ofl_byte_table_create(&table));
  ofl_status_t s = encode(m, table);
  ofl_summary_t *sum = NULL;
  if (s == OFL_SUCCESS)
    s = gather_table(m, table, &sum);
  ofl_byte_table_destroy(table);
  bool root = m->comm == NULL || ofl_comm_rank(m->comm) == 0;
  if (s == OFL_SUCCESS && root && m->summary_out != NULL) {
    render(sum, m->summary_out);
    fflush(m->summary_out);
  }
  ofl_summary_destroy(sum);
  return s;
}

/* ---- the plan read back -------------------------------------------------- */

ofl_status_t ofl_manager_plan_get(const ofl_manager_t *m,
                                  ofl_manager_plan_t *out) {
  if (m == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_plan_get: manager and out must not be NULL");
  memset(out, 0, sizeof *out);
  if (!m->auto_plan && (m->warmup || !ofl__plan_ledger_runs(m)))
    return ofl__error_quiet(OFL_ERR_NOT_READY,
                            "rank %d: no auto plan (the offloaded groups are "
                            "configured: OFL_OFFLOAD_GROUPS=auto or "
                            "params.groups \"auto\" makes one), and the "
                            "measured activation peaks exist after the "
                            "warmup iteration's reset",
                            m->rank);
  if (m->auto_plan && (m->warmup || m->ap == NULL || m->ap->inst == NULL))
    return ofl__error_quiet(OFL_ERR_NOT_READY,
                            "rank %d: the auto plan exists after the warmup "
                            "iteration's reset",
                            m->rank);
  *out = m->ap->out;
  return OFL_SUCCESS;
}

ofl_status_t ofl_manager_plan_action(const ofl_manager_t *m, size_t i,
                                     ofl_plan_action_t *out) {
  if (m == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_plan_action: manager and out must not be "
                      "NULL");
  const ofl__plan_t *p = m->ap;
  if (!m->auto_plan || m->warmup || p == NULL || p->inst == NULL ||
      p->acts == NULL)
    return ofl__error_quiet(OFL_ERR_NOT_READY,
                            "rank %d: the auto plan's actions exist after "
                            "the warmup iteration's reset, with groups "
                            "\"auto\"",
                            m->rank);
  if (i >= p->out.nnames)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: plan action %zu of %zu names", m->rank, i,
                      p->out.nnames);
  ofl_plan_action_t a = p->acts[i];
  /* Measured: a recompute's backward less the warmup's backward of the same
   * groups without the time their pops took (the last iteration, CPU
   * clock); an offload's reload stalls, per
   * steady iteration. */
  for (uint32_t k = 0; k < p->nms; k++) {
    const meas_t *x = &p->ms[k];
    if (p->inst[k].name != (int)i || x->g->action != OFL_ACTION_RECOMPUTE ||
        x->rc_bwd_ns == 0)
      continue;
    a.measured_ms += ofl__plan_rc_measured_ns(x) / 1e6;
  }
  if (a.action == OFL_ACTION_OFFLOAD && p->out.iterations > 0)
    a.measured_ms = (double)(m->names[i].st.stall_ns - p->stall0[i]) / 1e6 /
                    (double)p->out.iterations;
  *out = a;
  return OFL_SUCCESS;
}
