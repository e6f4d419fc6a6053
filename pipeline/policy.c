/* ofl: the end of warmup (the reference's post_warmup_callback). From the
 * recorded structure it decides which groups stay on the device in steady
 * state and computes offload_summary_bytes per group name:
 *   1. margin = the largest number of distinct names in one chunk; for each
 *      name (up to margin names) the first group of that name to run
 *      backward stays on the device, since nothing is prefetched for it;
 *   2. per-pipeline-rank delta: pp_rank x delta bytes stay on the device,
 *      whole groups, chunks in backward order;
 *   3. fraction: per chunk, the latest (1 - fraction) of the offloaded
 *      groups stay on the device;
 *   4. summary: bytes of the groups still offloaded, per name, over the
 *      chunks in forward order that began before the first backward (the
 *      estimate of device bytes removed from the peak; see summarize()). */
#include <string.h>

#include "pipeline/pipeline_internal.h"

static int popcount64(uint64_t x) {
  int n = 0;
  for (; x; x &= x - 1)
    n++;
  return n;
}

static void keep_first_backward_groups(ofl_manager_t *m) {
  int margin = 0;
  for (uint32_t i = 0; i < m->nfwd; i++) {
    int d = popcount64(m->fwd[i]->name_mask);
    if (d > margin)
      margin = d;
  }
  /* name -> last group (forward order) of the earliest backward chunk that
   * has the name; names in order of first sight walking backward order in
   * reverse, as the reference's dict. */
  group_t *pick[OFL__MAX_NAMES] = {0};
  int order[OFL__MAX_NAMES];
  int norder = 0;
  for (uint32_t i = m->nbwd; i-- > 0;) {
    chunk_t *c = m->bwd[i];
    for (uint32_t j = 0; j < c->ngroups; j++) {
      group_t *g = c->groups[j];
      bool seen = false;
      for (int k = 0; k < norder; k++)
        seen |= order[k] == g->nid;
      if (!seen)
        order[norder++] = g->nid;
      pick[g->nid] = g;
    }
  }
  for (int k = 0; k < norder && margin > 0; k++, margin--) {
    group_t *g = pick[order[k]];
    g->policy_offload = false;
    g->keep_why = OFL_KEEP_FIRST_BACKWARD;
    OFL__PLOG(OFL_LOG_INFO, m, g->chunk, ofl__gname(m, g),
              "stays on the device (first of its name to run backward, %llu "
              "bytes)",
              (unsigned long long)g->warm_bytes);
  }
}

static void keep_rank_delta(ofl_manager_t *m) {
  uint64_t keep = (uint64_t)m->pp_rank * m->rank_delta_bytes;
  for (uint32_t i = 0; i < m->nbwd && keep > 0; i++) {
    chunk_t *c = m->bwd[i];
    for (uint32_t j = 0; j < c->ngroups && keep > 0; j++) {
      group_t *g = c->groups[j];
      if (!g->policy_offload || g->warm_bytes == 0)
        continue;
      /* As the reference: a group is kept while any budget is left, so the
       * last one may go past it (a budget below one group keeps one). */
      g->policy_offload = false;
      g->keep_why = OFL_KEEP_RANK_DELTA;
      keep = g->warm_bytes >= keep ? 0 : keep - g->warm_bytes;
      OFL__PLOG(OFL_LOG_INFO, m, c, ofl__gname(m, g),
                "stays on the device (pp rank delta, %llu bytes)",
                (unsigned long long)g->warm_bytes);
    }
  }
}

static void keep_fraction(ofl_manager_t *m) {
  if (m->fraction >= 1.0)
    return;
  for (uint32_t i = 0; i < m->nfwd; i++) {
    chunk_t *c = m->fwd[i];
    uint32_t eligible = 0;
    for (uint32_t j = 0; j < c->ngroups; j++)
      eligible += c->groups[j]->policy_offload && c->groups[j]->warm_bytes > 0;
    uint32_t drop = (uint32_t)((double)eligible * (1.0 - m->fraction));
    for (uint32_t j = c->ngroups; j-- > 0 && drop > 0;) {
      group_t *g = c->groups[j];
      if (g->policy_offload && g->warm_bytes > 0) {
        g->policy_offload = false;
        g->keep_why = OFL_KEEP_FRACTION;
        drop--;
      }
    }
  }
}

/* The group kept by should_offload in steady state: the last of its name in
 * a chunk that is the next of that name to run backward when it commits
 * (the schedule repeats the warmup, so the warmup's backward position at
 * the commit tells). */
static bool next_in_backward(const ofl_manager_t *m, const group_t *g) {
  if (!g->last_of_name)
    return false;
  for (uint32_t i = g->warm_bwd_cursor; i < m->nbwd; i++)
    if ((m->bwd[i]->name_mask >> g->nid) & 1u)
      return m->bwd[i] == g->chunk;
  return false;
}

/* The last group of each name in a chunk; then (that fixed) the groups
 * next_in_backward keeps, for the plan and the placement table. */
static void mark_last_of_name(ofl_manager_t *m) {
  for (uint32_t i = 0; i < m->nfwd; i++) {
    chunk_t *c = m->fwd[i];
    uint64_t seen = 0;
    for (uint32_t j = c->ngroups; j-- > 0;) {
      group_t *g = c->groups[j];
      g->last_of_name = !((seen >> g->nid) & 1u);
      seen |= UINT64_C(1) << g->nid;
    }
  }
  for (uint32_t i = 0; i < m->nfwd; i++)
    for (uint32_t j = 0; j < m->fwd[i]->ngroups; j++)
      m->fwd[i]->groups[j]->next_in_bwd =
          next_in_backward(m, m->fwd[i]->groups[j]);
}

/* The reference stops after the chunk that is first in backward order. On
 * the last pipeline stage that is the first chunk, which is exactly what the
 * peak holds; on every other stage more microbatches are in flight when the
 * first backward runs (pp - rank of them in 1F1B), and the reference's
 * figure undercounts the saving by that factor. ofl sums the chunks whose
 * forward began before the first backward of the warmup iteration — the
 * chunks alive at the peak — and never fewer than the reference's. */
static void summarize(ofl_manager_t *m) {
  for (int k = 0; k < m->nnames; k++)
    m->names[k].summary_bytes = 0;
  chunk_t *first_bwd = m->nbwd > 0 ? m->bwd[0] : NULL;
  bool reached_first_bwd = false;
  for (uint32_t i = 0; i < m->nfwd; i++) {
    chunk_t *c = m->fwd[i];
    for (uint32_t j = 0; j < c->ngroups; j++) {
      group_t *g = c->groups[j];
      if (g->policy_offload)
        m->names[g->nid].summary_bytes += g->warm_bytes;
    }
    reached_first_bwd = reached_first_bwd || c == first_bwd;
    if (reached_first_bwd && i + 1 >= m->fwd_before_bwd)
      break; /* from here on 1F1B runs: the peak does not grow */
  }
}

/* Tensors the size threshold kept on the device in the warmup: at INFO
 * always, with the threshold that applied; a WARN when it kept every one,
 * so that a first program with small tensors does not offload nothing in
 * silence. */
static void report_small_tensors(const ofl_manager_t *m) {
  if (!m->offload || m->warm_small_tensors == 0)
    return;
  char threshold[160];
  if (m->min_bytes > 0)
    snprintf(threshold, sizeof threshold,
             "min_offload_bytes %zu (OFL_MIN_OFFLOAD_BYTES)", m->min_bytes);
  else
    snprintf(threshold, sizeof threshold,
             "min_offload_elems %llu (OFL_MIN_OFFLOAD_ELEMS; "
             "OFL_MIN_OFFLOAD_BYTES unset)",
             (unsigned long long)m->min_elems);
  uint64_t offloaded = 0;
  for (uint32_t i = 0; i < m->nfwd; i++)
    for (uint32_t j = 0; j < m->fwd[i]->ngroups; j++)
      offloaded += m->fwd[i]->groups[j]->warm_bytes;
  if (offloaded == 0)
    OFL_WARN(OFL_SUBSYS_PIPELINE,
             "rank %d: warmup offloaded nothing: %llu tensors (%llu bytes) "
             "stayed on the device, each under the size threshold %s; lower "
             "it (params.%s or OFL_%s; from ofl.torch min_offload_size=, or "
             "min_offloaded_tensor_size= in Megatron's calls) to offload them",
             m->rank, (unsigned long long)m->warm_small_tensors,
             (unsigned long long)m->warm_small_bytes, threshold,
             m->min_bytes > 0 ? "min_offload_bytes" : "min_offload_elems",
             m->min_bytes > 0 ? "MIN_OFFLOAD_BYTES" : "MIN_OFFLOAD_ELEMS");
  else
    OFL_INFO(OFL_SUBSYS_PIPELINE,
             "rank %d: warmup: %llu tensors (%llu bytes) stay on the device "
             "for their size, each under the size threshold %s",
             m->rank, (unsigned long long)m->warm_small_tensors,
             (unsigned long long)m->warm_small_bytes, threshold);
}

/* " (did you mean X?)" for the name the warmup started that is closest to
 * a configured one it never saw, when it is a near miss (a third of its
 * length, at least 2 edits); "" otherwise. */
static const char *closest_name(const ofl_manager_t *m, const char *name,
                                char *buf, size_t cap) {
  size_t best = SIZE_MAX;
  const char *closest = NULL;
  for (int i = 0; i < m->nnames; i++) {
    size_t d = ofl__edit_distance(name, m->names[i].name);
    if (d < best) {
      best = d;
      closest = m->names[i].name;
    }
  }
  size_t allowed = strlen(name) / 3 < 2 ? 2 : strlen(name) / 3;
  if (closest == NULL || best > allowed)
    return "";
  snprintf(buf, cap, " (did you mean %s?)", closest);
  return buf;
}

/* The configured names the warmup never started are likely misspelt (or
 * the model calls its modules otherwise): nothing of theirs is offloaded. */
static void report_unseen_names(ofl_manager_t *m) {
  const char *item;
  size_t n;
  for (const char *p = m->offload ? m->groups_cfg : NULL;
       (p = ofl__list_next(p, &item, &n)) != NULL;) {
    char name[128];
    if (n > 0 && n < sizeof name) {
      memcpy(name, item, n);
      name[n] = '\0';
      if (ofl__name_find(m, name) < 0) {
        char hint[160];
        OFL_WARN(OFL_SUBSYS_PIPELINE,
                 "rank %d: group %s is configured for offload "
                 "(params.groups / OFL_OFFLOAD_GROUPS; offload_modules= in "
                 "ofl.torch) but the warmup never started it%s; check its "
                 "spelling against the names passed to "
                 "ofl_manager_group_start (the module names of the "
                 "offloading calls in Python)",
                 m->rank, name, closest_name(m, name, hint, sizeof hint));
      }
    }
  }
  report_small_tensors(m);
}

ofl_status_t ofl__policy_end_warmup(ofl_manager_t *m) {
  ofl_status_t s = OFL_SUCCESS;
  if (m->nbwd != m->nfwd) {
    s = OFL__PERR(OFL_ERR_MISMATCH, m, m->cur_fwd, "-",
                  "warmup ended with %u of %u chunks in backward order (the "
                  "last virtual stage never caught up with the first); the "
                  "rest are placed in reverse stage order",
                  m->nbwd, m->nfwd);
    ofl_status_t f = ofl__order_flush(m, true);
    if (f != OFL_SUCCESS)
      return f;
  }
  m->warmup = false;
  keep_first_backward_groups(m);
  if (!m->auto_plan) { /* the auto plan replaces the delta and fraction */
    keep_rank_delta(m);
    keep_fraction(m);
  }
  mark_last_of_name(m);
  ofl_status_t a = ofl__plan_end_warmup(m);
  if (s == OFL_SUCCESS)
    s = a;
  summarize(m);
  report_unseen_names(m);
  /* The steady-state peak of the reload pool starts here
   * (ofl_manager_stats_t.steady_device_pool_peak_bytes). */
  ofl_pool_reset_peak(m->dev_pool);
  uint64_t total = 0;
  for (int k = 0; k < m->nnames; k++)
    total += m->names[k].summary_bytes;
  OFL_INFO(OFL_SUBSYS_PIPELINE,
           "rank %d: warmup ended: %u chunks, %d group names, summary %llu "
           "bytes",
           m->rank, m->nfwd, m->nnames, (unsigned long long)total);
  ofl_status_t g = ofl__report_summary(m);
  /* Collective too: every rank of the comm runs it (groups "auto" is a
   * setting of the whole job). */
  ofl_status_t pr = ofl__report_plan(m);
  if (g == OFL_SUCCESS)
    g = pr;
  return s != OFL_SUCCESS ? s : g;
}
