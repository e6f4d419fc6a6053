/* ofl: chunks (one per microbatch x virtual stage), their group records
 * and the backward order.
 *
 * Warmup records the chunks in forward order and builds the backward order
 * as the reference does: a chunk of the last virtual stage is placed at its
 * creation (its backward follows its forward in 1F1B); the chunks of the
 * other stages wait in per-stage lists and are placed, in reverse stage
 * order and microbatch order inside a stage, once the last stage has as many
 * chunks as the first. After warmup, chunk_begin walks the record. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"

static void group_free(group_t *g) {
  if (g == NULL)
    return;
  ofl_event_destroy(g->offload_ev);
  ofl_event_destroy(g->reload_ev);
  free(g->entries);
  free(g);
}

ofl_status_t ofl__chunk_new(ofl_manager_t *m, int vp_stage, chunk_t **out) {
  if (m->nfwd >= 0xffffu) /* tags hold the chunk index in 16 bits */
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_PIPELINE,
                      "rank %d: more than %u chunks in one iteration", m->rank,
                      0xffffu);
  chunk_t *c = calloc(1, sizeof *c);
  if (c == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "rank %d: no memory for a chunk record", m->rank);
  c->index = m->nfwd;
  c->vp_stage = vp_stage;
  c->mb = (int)m->stage_count[vp_stage];
  *out = c;
  return OFL_SUCCESS;
}

void ofl__chunk_free(chunk_t *c) {
  if (c == NULL)
    return;
  for (uint32_t i = 0; i < c->ngroups; i++)
    group_free(c->groups[i]);
  free(c->groups);
  free(c->commit_order);
  free(c->stack);
  free(c);
}

ofl_status_t ofl__chunk_add_group(ofl_manager_t *m, chunk_t *c, int nid,
                                  group_t **out) {
  if (c->ngroups >= OFL__TAG_MAX_GROUPS) /* tags hold the group in 12 bits */
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, c, m->names[nid].name,
                     "more than %u groups in one chunk", OFL__TAG_MAX_GROUPS);
  OFL_CHECK(ofl__grow((void **)&c->groups, &c->cap, c->ngroups + 1,
                      sizeof *c->groups));
  group_t *g = calloc(1, sizeof *g);
  uint32_t *order = realloc(c->commit_order, c->cap * sizeof *order);
  group_t **stack = realloc(c->stack, c->cap * sizeof *stack);
  if (order != NULL)
    c->commit_order = order;
  if (stack != NULL)
    c->stack = stack;
  if (g == NULL || order == NULL || stack == NULL) {
    free(g);
    return OFL__PERR(OFL_ERR_NO_MEMORY, m, c, m->names[nid].name,
                     "no memory for a group record%s", "");
  }
  ofl_status_t s = ofl_event_create(m->dev, &g->offload_ev);
  if (s == OFL_SUCCESS)
    s = ofl_event_create(m->dev, &g->reload_ev);
  if (s != OFL_SUCCESS) {
    group_free(g);
    return s;
  }
  g->chunk = c;
  g->index = c->ngroups;
  g->nid = nid;
  g->policy_offload = true;
  c->groups[c->ngroups++] = g;
  c->name_mask |= UINT64_C(1) << nid;
  *out = g;
  return OFL_SUCCESS;
}

static ofl_status_t push_backward(ofl_manager_t *m, chunk_t *c) {
  OFL_CHECK(
      ofl__grow((void **)&m->bwd, &m->capbwd, m->nbwd + 1, sizeof *m->bwd));
  c->bwd_pos = m->nbwd;
  c->in_bwd = true;
  m->bwd[m->nbwd++] = c;
  OFL__PLOG(OFL_LOG_TRACE, m, c, "-", "backward position %u", c->bwd_pos);
  return OFL_SUCCESS;
}

/* Places the waiting chunks once the last stage has caught up with the first
 * (force: at the end of warmup, whatever the counts). */
ofl_status_t ofl__order_flush(ofl_manager_t *m, bool force) {
  if (m->vpp <= 1)
    return OFL_SUCCESS;
  int last = m->vpp - 1;
  if (!force && m->nstage[0] != m->nstage[last])
    return OFL_SUCCESS;
  m->nstage[last] = 0; /* already placed one by one */
  for (int s = last - 1; s >= 0; s--) {
    for (uint32_t i = 0; i < m->nstage[s]; i++)
      OFL_CHECK(push_backward(m, m->stages[s][i]));
    m->nstage[s] = 0;
  }
  return OFL_SUCCESS;
}

static ofl_status_t stages_init(ofl_manager_t *m, int vpp) {
  m->stages = calloc((size_t)vpp, sizeof *m->stages);
  m->nstage = calloc((size_t)vpp, sizeof *m->nstage);
  m->capstage = calloc((size_t)vpp, sizeof *m->capstage);
  m->stage_count = calloc((size_t)vpp, sizeof *m->stage_count);
  if (!m->stages || !m->nstage || !m->capstage || !m->stage_count)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "rank %d: no memory for %d virtual stages", m->rank, vpp);
  m->vpp = vpp;
  return OFL_SUCCESS;
}

static ofl_status_t record_chunk(ofl_manager_t *m, int vpp, int stage) {
  if (m->vpp == 0)
    OFL_CHECK(stages_init(m, vpp));
  else if (vpp != m->vpp)
    return OFL__PERR(OFL_ERR_INVALID_ARG, m, m->cur_fwd, "-",
                     "chunk_begin with vp_size %d, earlier chunks had %d; "
                     "pass the same vp_size for every chunk",
                     vpp, m->vpp);
  int last = vpp - 1;
  if (stage == last)
    OFL_CHECK(ofl__order_flush(m, false));
  OFL_CHECK(
      ofl__grow((void **)&m->fwd, &m->capfwd, m->nfwd + 1, sizeof *m->fwd));
  OFL_CHECK(ofl__grow((void **)&m->stages[stage], &m->capstage[stage],
                      m->nstage[stage] + 1, sizeof **m->stages));
  chunk_t *c = NULL;
  OFL_CHECK(ofl__chunk_new(m, stage, &c));
  m->fwd[m->nfwd++] = c;
  m->stage_count[stage]++;
  m->stages[stage][m->nstage[stage]++] = c;
  if (stage == last) {
    OFL_CHECK(push_backward(m, c));
    OFL_CHECK(ofl__order_flush(m, false));
  }
  m->cur_fwd = c;
  OFL__PLOG(OFL_LOG_TRACE, m, c, "-", "chunk recorded (vp_size %d)", vpp);
  return OFL_SUCCESS;
}

/* Rule 5: a chunk that ran fewer groups than the warmup recorded. */
ofl_status_t ofl__chunk_check_done(ofl_manager_t *m, chunk_t *c) {
  if (m->warmup || c == NULL || c->fwd_cursor == c->ngroups)
    return OFL_SUCCESS;
  group_t *next = c->groups[c->fwd_cursor];
  return OFL__PERR(OFL_ERR_MISMATCH, m, c, ofl__gname(m, next),
                   "the forward ran %u groups of this chunk, the warmup "
                   "recorded %u (this group was expected next); the schedule "
                   "must repeat the warmup's structure",
                   c->fwd_cursor, c->ngroups);
}

ofl_status_t ofl_manager_chunk_begin(ofl_manager_t *m, int vp_size,
                                     int vp_stage) {
  if (m == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_chunk_begin: manager is NULL");
  if (!m->offload && m->enabled && !m->forward_only)
    m->off_trained = true; /* joins the summary gather at the next reset */
  if (!ofl__manager_active(m))
    return OFL_SUCCESS;
  OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_chunk_begin"));
  int vpp = vp_size > 0 ? vp_size : 1;
  if (vp_stage < 0 || vp_stage >= vpp)
    return OFL__PERR(OFL_ERR_INVALID_ARG, m, m->cur_fwd, "-",
                     "chunk_begin: vp_stage %d outside 0..%d (vp_size %d)",
                     vp_stage, vpp - 1, vp_size);
  if (m->nopen > 0) {
    open_group_t *o = &m->open[m->nopen - 1];
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, m->cur_fwd,
                     m->names[o->nid].name,
                     "chunk_begin while this group is still open; commit "
                     "it first (%u open)",
                     m->nopen);
  }
  OFL_CHECK(ofl__chunk_check_done(m, m->cur_fwd));
  /* The previous chunk's forward ends only when this call succeeds. */
  chunk_t *prev = m->cur_fwd;
  if (m->warmup) {
    OFL_CHECK(record_chunk(m, vpp, vp_stage));
    if (prev != NULL)
      prev->fwd_done = true;
    return OFL_SUCCESS;
  }

  if (m->fwd_cursor >= m->nfwd)
    return OFL__PERR(OFL_ERR_MISMATCH, m, m->cur_fwd, "-",
                     "chunk_begin for a chunk %u of the iteration, the warmup "
                     "recorded %u chunks; run forward-only passes with "
                     "ofl_manager_set_forward_only",
                     m->fwd_cursor + 1, m->nfwd);
  chunk_t *c = m->fwd[m->fwd_cursor];
  if (c->vp_stage != vp_stage || vpp != m->vpp)
    return OFL__PERR(OFL_ERR_MISMATCH, m, c, "-",
                     "chunk_begin(vp_size %d, vp_stage %d), the warmup "
                     "recorded (vp_size %d, vp_stage %d) at this place",
                     vpp, vp_stage, m->vpp, c->vp_stage);
  if (prev != NULL)
    prev->fwd_done = true;
  m->fwd_cursor++;
  m->cur_fwd = c;
  OFL__PLOG(OFL_LOG_TRACE, m, c, "-", "chunk begins%s", "");
  return OFL_SUCCESS;
}

/* The next chunk in backward order (from the cursor) that has a group of
 * name nid, or any group when nid < 0; NULL when none. */
chunk_t *ofl__front_backward_chunk(ofl_manager_t *m, int nid) {
  for (uint32_t i = m->bwd_cursor; i < m->nbwd; i++) {
    chunk_t *c = m->bwd[i];
    if (nid < 0 ? c->ngroups > 0 : (c->name_mask >> nid) & 1u)
      return c;
  }
  return NULL;
}
