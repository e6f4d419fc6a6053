/* ofl: a group's forward (a group: the tensors of one named module call
 * inside a chunk): start, push and commit (the bulk offload into the
 * storage tier, tier.c). The stream-ordering rules of docs/design/
 * pipeline.md section 5 are enforced here and in group_backward.c; each
 * line that does so cites its rule. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"
#include "pool/pool_internal.h"

/* ---- start --------------------------------------------------------------
 */

ofl_status_t ofl_manager_group_start(ofl_manager_t *m, const char *name) {
  if (m == NULL || name == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_start: manager and name must not be "
                      "NULL");
  if (!ofl__manager_active(m))
    return OFL_SUCCESS;
  OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_group_start"));
  chunk_t *c = m->cur_fwd;
  if (c == NULL)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, c, name,
                     "group_start without a chunk; call "
                     "ofl_manager_chunk_begin at the start of each "
                     "microbatch's forward%s",
                     "");
  int nid;
  OFL_CHECK(ofl__name_intern(m, name, &nid));
  OFL_CHECK(
      ofl__grow((void **)&m->open, &m->capopen, m->nopen + 1, sizeof *m->open));
  if (m->warmup)
    OFL_CHECK(ofl__grow((void **)&m->plan, &m->capplan, m->nplan + 1,
                        sizeof *m->plan));
  group_t *g = NULL;
  if (m->names[nid].selected) {
    if (m->warmup) {
      OFL_CHECK(ofl__chunk_add_group(m, c, nid, &g));
    } else {
      if (c->fwd_cursor >= c->ngroups)
        return OFL__PERR(OFL_ERR_MISMATCH, m, c, name,
                         "group %u of this chunk started, the warmup "
                         "recorded %u groups here",
                         c->fwd_cursor + 1, c->ngroups);
      g = c->groups[c->fwd_cursor];
      if (g->nid != nid) /* rule 5: never realign silently */
        return OFL__PERR(OFL_ERR_MISMATCH, m, c, name,
                         "group %u of this chunk is %s in the warmup record; "
                         "the schedule must repeat the warmup's structure",
                         c->fwd_cursor, m->names[g->nid].name);
    }
    c->fwd_cursor++;
    g->open = true;
  }
  m->open[m->nopen++] = (open_group_t){g, nid};
  if (m->warmup)
    m->plan[m->nplan++] = (plan_rec_t){c, g, nid};
  OFL__PLOG(OFL_LOG_TRACE, m, c, name, "start%s", g ? "" : " (not offloaded)");
  return OFL_SUCCESS;
}

/* The most recent open group of name (NULL: none, or a name that is not
 * offloaded); *found whether the name is open at all. */
static group_t *open_group(const ofl_manager_t *m, const char *name,
                           bool *found) {
  int nid = ofl__name_find(m, name);
  *found = false;
  for (uint32_t i = m->nopen; nid >= 0 && i-- > 0;)
    if (m->open[i].nid == nid) {
      *found = true;
      return m->open[i].g;
    }
  return NULL;
}

/* The most recent group of input_group started before g in g's chunk
 * (NULL: none, or a name that is not offloaded). */
static group_t *input_producer(const ofl_manager_t *m, const group_t *g,
                               const char *input_group) {
  if (input_group == NULL || input_group[0] == '\0')
    return NULL;
  int nid = ofl__name_find(m, input_group);
  const chunk_t *c = g->chunk;
  for (uint32_t k = g->index; nid >= 0 && k-- > 0;)
    if (c->groups[k]->nid == nid)
      return c->groups[k];
  return NULL;
}

static ofl_status_t start_with(ofl_manager_t *m, const char *name,
                               unsigned flags, size_t kept_input_bytes,
                               const char *input_group, unsigned reruns) {
  if (m != NULL && (flags & ~OFL_GROUP_RECOMPUTABLE) != 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: group_start_flags %s: unknown flags 0x%x "
                      "(OFL_GROUP_RECOMPUTABLE is 0x%x)",
                      m->rank, name ? name : "(null)", flags,
                      OFL_GROUP_RECOMPUTABLE);
  bool has_input = input_group != NULL && input_group[0] != '\0';
  if (m != NULL &&
      (reruns == 0 || (reruns & ~(OFL_RERUN_OWN | OFL_RERUN_INPUT)) != 0 ||
       ((reruns & OFL_RERUN_INPUT) != 0 && !has_input)))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: group_start_rerun %s: reruns 0x%x must be a "
                      "non-zero mask of OFL_RERUN_OWN (0x%x) and "
                      "OFL_RERUN_INPUT (0x%x), and OFL_RERUN_INPUT needs an "
                      "input_group (%s)",
                      m->rank, name ? name : "(null)", reruns, OFL_RERUN_OWN,
                      OFL_RERUN_INPUT, has_input ? input_group : "none given");
  OFL_CHECK(ofl_manager_group_start(m, name));
  if (!ofl__manager_active(m))
    return OFL_SUCCESS;
  bool found;
  group_t *g = open_group(m, name, &found);
  if (g == NULL)
    return OFL_SUCCESS;
  bool rc = (flags & OFL_GROUP_RECOMPUTABLE) != 0;
  if (m->warmup) {
    g->recomputable = rc;
    g->rc_seen = true;
    g->rc_input_bytes = rc ? kept_input_bytes : 0;
    g->rc_reruns = (uint8_t)reruns;
    /* every start with flags is stamped: its forward time may be a
     * recompute's of another group (OFL_RERUN_INPUT) */
    ofl__plan_on_start(m, g, rc ? input_producer(m, g, input_group) : NULL);
  } else if (g->action == OFL_ACTION_RECOMPUTE) {
    g->rc_input_bytes = kept_input_bytes; /* the ledger counts what it is */
  }
  return OFL_SUCCESS;
}

ofl_status_t ofl_manager_group_start_flags(ofl_manager_t *m, const char *name,
                                           unsigned flags,
                                           size_t kept_input_bytes) {
  return start_with(m, name, flags, kept_input_bytes, NULL, OFL_RERUN_OWN);
}

ofl_status_t ofl_manager_group_start_recompute(ofl_manager_t *m,
                                               const char *name,
                                               size_t kept_input_bytes,
                                               const char *input_group) {
  return start_with(m, name, OFL_GROUP_RECOMPUTABLE, kept_input_bytes,
                    input_group, OFL_RERUN_OWN);
}

ofl_status_t ofl_manager_group_start_rerun(ofl_manager_t *m, const char *name,
                                           size_t kept_input_bytes,
                                           const char *input_group,
                                           unsigned reruns) {
  return start_with(m, name, OFL_GROUP_RECOMPUTABLE, kept_input_bytes,
                    input_group, reruns);
}

ofl_status_t ofl_manager_group_action(const ofl_manager_t *m, const char *name,
                                      ofl_group_action_t *action) {
  if (m == NULL || name == NULL || action == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_action: manager, name and action "
                      "must not be NULL");
  if (!ofl__manager_active(m)) {
    *action = OFL_ACTION_KEEP;
    return OFL_SUCCESS;
  }
  bool found;
  const group_t *g = open_group(m, name, &found);
  if (!found)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_PIPELINE,
                      "rank %d: group_action %s: no open group of that name; "
                      "ask after its group_start, before its commit",
                      m->rank, name);
  if (g == NULL)
    *action = OFL_ACTION_KEEP;
  else if (m->warmup)
    *action = OFL_ACTION_OFFLOAD;
  else if (g->action == OFL_ACTION_RECOMPUTE && g->recomputable)
    *action = OFL_ACTION_RECOMPUTE;
  else
    *action = g->policy_offload ? OFL_ACTION_OFFLOAD : OFL_ACTION_KEEP;
  return OFL_SUCCESS;
}

/* ---- push -----------------------------------------------------------------
 */

static ofl_status_t hold(ofl_manager_t *m, ofl_tensor_t *t, ofl_tag_t *tag) {
  if (m->nheld >= (UINT32_C(1) << 30))
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_PIPELINE,
                      "rank %d: %u tensors held without a reset", m->rank,
                      m->nheld);
  OFL_CHECK(
      ofl__grow((void **)&m->held, &m->capheld, m->nheld + 1, sizeof *m->held));
  m->held[m->nheld] = t;
  *tag = OFL__TAG_HELD | OFL__TAG_ID(m) | OFL__TAG_GEN(m) |
         (uint64_t)(m->nheld + 1);
  m->nheld++;
  t->owner = m;
  return OFL_SUCCESS;
}

/* A tensor that says device memory must be memory of m's device: the D2H
 * copy of its commit reads it, and could not otherwise. A block of a
 * device pool on m's device is known at once; wrapped memory is asked of
 * the backend. */
static bool device_memory_ok(const ofl_manager_t *m, const ofl_tensor_t *t) {
  if (ofl_tensor_location(t) != OFL_LOC_DEVICE)
    return true; /* never copied: it stays where it is */
  const ofl_pool_t *p = ofl_tensor_pool(t);
  if (p != NULL && ofl_pool_kind(p) == OFL_POOL_DEVICE &&
      ofl_pool_device(p) == m->dev)
    return true;
  /* Another handle on the same GPU (cuda) is fine; the host backend's
   * devices have separate memories. */
  return ofl__device_owns(m->dev, ofl_tensor_data(t), ofl_tensor_bytes(t));
}

ofl_status_t ofl_manager_tensor_push(ofl_manager_t *m, ofl_tensor_t *t,
                                     ofl_tag_t *tag) {
  if (m == NULL || t == NULL || tag == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_tensor_push: manager, tensor and tag must "
                      "not be NULL");
  group_t *g = m->nopen > 0 ? m->open[m->nopen - 1].g : NULL;
  if (t->owner != NULL) /* held, or in this group or an earlier one */
    return OFL__PERR(OFL_ERR_INVALID_ARG, m, g ? g->chunk : m->cur_fwd,
                     ofl__gname(m, g),
                     "tensor %p pushed twice: %s manager owns it from its "
                     "first push until its pop; push an alias "
                     "(ofl_tensor_alias) to save it under a second tag",
                     (void *)t, t->owner == m ? "this" : "another");
  if (!ofl__manager_active(m) || g == NULL)
    return hold(m, t, tag);
  OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_tensor_push"));
  if (!ofl_tensor_has_storage(t))
    return OFL__PERR(OFL_ERR_INVALID_ARG, m, g->chunk, ofl__gname(m, g),
                     "pushed tensor %p has no storage", (void *)t);
  if (!device_memory_ok(m, t))
    return OFL__PERR(OFL_ERR_INVALID_ARG, m, g->chunk, ofl__gname(m, g),
                     "pushed tensor %p (%zu bytes at %p) says device memory "
                     "but is not memory of this manager's device: a tensor "
                     "of another device, or host memory wrapped as "
                     "OFL_LOC_DEVICE; push tensors of ofl_manager_device() "
                     "(host memory: wrap it as OFL_LOC_PINNED, it is then "
                     "never copied)",
                     (void *)t, ofl_tensor_bytes(t), ofl_tensor_data(t));
  if (g->n >= OFL__TAG_MAX_ENTRIES)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, g->chunk, ofl__gname(m, g),
                     "more than %u tensors pushed in one group",
                     OFL__TAG_MAX_ENTRIES);
  OFL_CHECK(
      ofl__grow((void **)&g->entries, &g->cap, g->n + 1, sizeof *g->entries));
  entry_t *e = &g->entries[g->n];
  memset(e, 0, sizeof *e);
  e->t = t;
  e->leader = g->n;
  e->state = E_HELD;
  *tag = ofl__tag_make(m, g->chunk->index, g->index, g->n);
  g->n++;
  t->owner = m;
  return OFL_SUCCESS;
}

/* ---- commit ---------------------------------------------------------------
 */

static bool tensor_big_enough(const ofl_manager_t *m, const ofl_tensor_t *t) {
  if (m->min_bytes > 0)
    return ofl_tensor_bytes(t) >= m->min_bytes;
  return ofl_tensor_nelem(t) >= m->min_elems;
}

/* Groups entries by storage (rule 6: one copy per storage) and decides which
 * clusters are eligible: none of its tensors marked not-offloadable and at
 * least one big enough. Eligible leaders get E_HELD, the others E_KEPT.
 * Returns the number of eligible clusters. */
static uint32_t build_clusters(ofl_manager_t *m, group_t *g) {
  bool dedup = !(m->test.rules_off & OFL__RULE6_OFF);
  for (uint32_t i = 0; i < g->n; i++) {
    entry_t *e = &g->entries[i];
    const ofl_tensor_t *t = e->t;
    e->sid = ofl_tensor_storage_id(t);
    e->leader = i;
    e->nmembers = 1;
    e->flag = 0;
    e->off = t->offset;
    e->lo = t->offset;
    e->span = t->bytes;
    for (uint32_t j = 0; dedup && j < i; j++) {
      entry_t *l = &g->entries[j];
      if (l->leader != j || l->sid != e->sid)
        continue;
      size_t hi = l->lo + l->span;
      if (t->offset + t->bytes > hi)
        hi = t->offset + t->bytes;
      if (t->offset < l->lo)
        l->lo = t->offset;
      l->span = hi - l->lo;
      l->nmembers++;
      e->leader = j;
      break;
    }
  }
  for (uint32_t i = 0; i < g->n; i++) {
    entry_t *l = &g->entries[g->entries[i].leader];
    const ofl_tensor_t *t = g->entries[i].t;
    /* Only device memory is offloaded; pinned or host tensors stay. */
    if ((ofl_tensor_flags(t) & OFL_TENSOR_NOT_OFFLOADABLE) ||
        ofl_tensor_location(t) != OFL_LOC_DEVICE)
      l->flag |= 2;
    else if (tensor_big_enough(m, g->entries[i].t))
      l->flag |= 1;
  }
  uint32_t eligible = 0;
  for (uint32_t i = 0; i < g->n; i++) {
    entry_t *e = &g->entries[i];
    e->state = E_KEPT;
    if (e->leader == i && e->flag == 1) {
      e->state = E_HELD;
      eligible++;
    } else if (e->leader == i && m->warmup) {
      /* Recorded for the end-of-warmup report and the plan. */
      if (e->flag & 2) {
        g->warm_flagged++;
      } else {
        g->warm_small++;
        m->warm_small_tensors += e->nmembers;
        m->warm_small_bytes += e->span;
      }
    }
  }
  return eligible;
}

/* The reference's should_bulk_offload after warmup: the policy switch, and
 * keep the last group of a name when this chunk is next in backward. */
static bool should_offload(ofl_manager_t *m, group_t *g) {
  if (m->warmup)
    return true;
  if (!g->policy_offload)
    return false;
  if (g->last_of_name && ofl__front_backward_chunk(m, g->nid) == g->chunk)
    return false;
  return true;
}

static void keep_all(ofl_manager_t *m, group_t *g) {
  for (uint32_t i = 0; i < g->n; i++)
    g->entries[i].state = E_KEPT;
  m->st.kept_tensors += g->n;
}

static ofl_status_t release_device(ofl_manager_t *m, ofl_tensor_t *t) {
  if (!ofl_tensor_has_storage(t))
    return OFL_SUCCESS;
  if (m->test.rules_off & OFL__RULE2D_OFF)
    return ofl_tensor_release_storage(t);
  /* Rule 2: the device block is reused only after the D2H that reads it. */
  return ofl_tensor_release_storage_after(t, m->d2h);
}

static void throttle(ofl_manager_t *m, group_t *g) {
  name_info_t *ni = &m->names[g->nid];
  if (m->max_inflight == 0 || ni->ring == NULL)
    return;
  uint32_t cap = m->max_inflight + 1;
  ni->ring[(ni->ring_head + ni->ring_len) % cap] = g;
  ni->ring_len++;
  while (ni->ring_len > m->max_inflight) {
    group_t *old = ni->ring[ni->ring_head];
    ni->ring_head = (ni->ring_head + 1) % cap;
    ni->ring_len--;
    ofl_stream_wait_event(ofl__compute(m), old->offload_ev);
  }
}

/* Counts leader l's cluster as offloaded (undo: takes it back out after
 * an abandoned offload); the warm-up counters of g too. */
static void count_offload(ofl_manager_t *m, group_t *g, const entry_t *l,
                          bool undo) {
  name_info_t *ni = &m->names[g->nid];
  uint64_t n = undo ? UINT64_MAX : 1; /* +1 or -1, modulo 2^64 */
  m->st.offloaded_tensors += n;
  m->st.offloaded_bytes += n * l->span;
  ni->st.offloaded_tensors += n;
  ni->st.offloaded_bytes += n * l->span;
  m->st.dedup_tensors += n * (l->nmembers - 1);
  if (m->warmup) {
    g->warm_bytes += n * l->span;
    g->warm_tensors += n;
  }
}

/* An offload failed half-way (st): the copies already queued are let go
 * after the D2H stream reaches this point, every tensor stays on the device
 * (none was released yet) and the group is committed as kept, so each tag
 * pops its own untouched tensor. Returns st. */
static ofl_status_t abandon_offload(ofl_manager_t *m, group_t *g,
                                    ofl_status_t st, uint32_t queued) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", ofl_last_error());
  bool recorded = ofl_event_record(g->offload_ev, m->d2h) == OFL_SUCCESS;
  /* The queued D2H copies read the tensors' device blocks: whatever the
   * caller does with a popped tensor on compute comes after them. */
  if (!recorded ||
      ofl_stream_wait_event(ofl__compute(m), g->offload_ev) != OFL_SUCCESS)
    (void)ofl_stream_synchronize(m->d2h, OFL_TIMEOUT_DEFAULT);
  for (uint32_t i = 0; i < g->n; i++) {
    entry_t *l = &g->entries[i];
    ofl__tier_drop(m, g, l,
                   recorded ? OFL__TIER_UNDO : OFL__TIER_UNDO_UNRECORDED);
    if (l->leader == i && l->state == E_OFFLOADED)
      count_offload(m, g, l, true);
  }
  keep_all(m, g);
  return OFL__PERR(st, m, g->chunk, ofl__gname(m, g),
                   "commit: offload failed with %u of the group's copies "
                   "queued (%s); every tensor of the group stays on the "
                   "device",
                   queued, msg);
}

static ofl_status_t commit_group(ofl_manager_t *m, group_t *g,
                                 ofl_tensor_t *const *forced, size_t n) {
  chunk_t *c = g->chunk;
  name_info_t *ni = &m->names[g->nid];
  g->committed = true;
  if (m->warmup) /* for the plan: should_offload's view at this commit */
    g->warm_bwd_cursor = m->bwd_cursor;
  ofl__plan_on_commit(m, g, 0);
  uint32_t eligible = build_clusters(m, g);
  if (!should_offload(m, g) || eligible == 0) {
    if (eligible > 0) {
      m->st.kept_groups++;
      ni->st.kept_groups++;
    }
    keep_all(m, g);
    ofl__plan_on_commit(m, g, 3);
    OFL__PLOG(OFL_LOG_TRACE, m, c, ofl__gname(m, g),
              "commit: kept on device (%u tensors)", g->n);
    return OFL_SUCCESS;
  }
  /* The D2H copies start after the compute stream's work so far. */
  ofl_stream_t *compute = ofl__compute(m);
  OFL_CHECK(ofl_event_record(m->ev_compute, compute));
  OFL_CHECK(ofl_stream_wait_event(m->d2h, m->ev_compute));
  ofl__plan_on_commit(m, g, 1);
  uint32_t copied = 0;
  for (uint32_t i = 0; i < g->n; i++) {
    entry_t *l = &g->entries[i];
    if (l->leader != i || l->state != E_HELD)
      continue;
    bool done = false;
    ofl_status_t st = ofl__tier_offload(m, g, l, &done);
    if (st != OFL_SUCCESS)
      return abandon_offload(m, g, st, copied);
    if (!done) {
      l->state = E_KEPT;
      continue;
    }
    copied++;
    l->state = E_OFFLOADED;
    count_offload(m, g, l, false);
  }
  ofl_status_t rec = ofl_event_record(g->offload_ev, m->d2h);
  if (rec != OFL_SUCCESS)
    return abandon_offload(m, g, rec, copied);
  /* Forced releases: tensors the caller holds whose storage went with the
   * group lose it after the copy, like the group's own tensors. */
  for (size_t f = 0; f < n; f++) {
    const void *sid = ofl_tensor_storage_id(forced[f]);
    for (uint32_t i = 0; sid != NULL && i < g->n; i++) {
      entry_t *l = &g->entries[i];
      if (l->leader == i && l->state == E_OFFLOADED && l->sid == sid) {
        OFL_CHECK(release_device(m, forced[f]));
        break;
      }
    }
  }
  for (uint32_t i = 0; i < g->n; i++) {
    entry_t *e = &g->entries[i];
    entry_t *l = &g->entries[e->leader];
    if (l->state == E_OFFLOADED) {
      e->state = E_OFFLOADED;
      OFL_CHECK(release_device(m, e->t));
    } else {
      e->state = E_KEPT;
      m->st.kept_tensors++;
    }
  }
  ofl__plan_on_commit(m, g, 2);
  if (copied > 0) {
    g->offloaded = true;
    c->stack[c->nstack++] = g;
    throttle(m, g);
  }
  OFL__PLOG(OFL_LOG_TRACE, m, c, ofl__gname(m, g),
            "commit: %u copies of %u tensors on d2h", copied, g->n);
  return OFL_SUCCESS;
}

/* A named range around each bulk offload: NVTX on cuda (Nsight Systems),
 * the compute track of the Chrome trace on the host backend. */
static ofl_status_t commit_now(ofl_manager_t *m, group_t *g,
                               ofl_tensor_t *const *forced, size_t n) {
  ofl_range_push(m->dev, m->names[g->nid].range_offload);
  ofl_status_t st = commit_group(m, g, forced, n);
  ofl_range_pop(m->dev);
  return st;
}

static int open_find(const ofl_manager_t *m, int nid) {
  for (int i = (int)m->nopen - 1; i >= 0; i--)
    if (m->open[i].nid == nid)
      return i;
  return -1;
}

static ofl_status_t delay_commit(ofl_manager_t *m, group_t *g,
                                 ofl_tensor_t *const *forced, size_t n) {
  OFL_CHECK(ofl__grow((void **)&m->delayed, &m->capdelayed, m->ndelayed + 1,
                      sizeof *m->delayed));
  delayed_t *d = &m->delayed[m->ndelayed];
  if (n > d->cap) {
    ofl_tensor_t **f = realloc(d->forced, n * sizeof *f);
    if (f == NULL)
      return OFL__PERR(OFL_ERR_NO_MEMORY, m, g->chunk, ofl__gname(m, g),
                       "no memory to delay a commit%s", "");
    d->forced = f;
    d->cap = n;
  }
  if (n > 0)
    memcpy(d->forced, forced, n * sizeof *forced);
  d->n = n;
  d->g = g;
  g->delayed = true;
  m->ndelayed++;
  return OFL_SUCCESS;
}

ofl_status_t ofl_manager_group_commit(ofl_manager_t *m, const char *name,
                                      ofl_tensor_t *const *forced_release,
                                      size_t n, int delay) {
  if (m == NULL || name == NULL || (n > 0 && forced_release == NULL))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_commit: manager and name must not be "
                      "NULL, nor forced_release when n > 0");
  if (!ofl__manager_active(m))
    return OFL_SUCCESS;
  OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_group_commit"));
  int nid = ofl__name_find(m, name);
  int at = nid < 0 ? -1 : open_find(m, nid);
  if (at < 0)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, m->cur_fwd, name,
                     "commit without a matching group_start (%u groups "
                     "open); call ofl_manager_group_start(\"%s\") first",
                     m->nopen, name);
  group_t *g = m->open[at].g;
  memmove(&m->open[at], &m->open[at + 1],
          (m->nopen - (uint32_t)at - 1) * sizeof *m->open);
  m->nopen--;
  if (g == NULL)
    return OFL_SUCCESS;
  g->open = false;
  chunk_t *c = g->chunk;
  /* The backward of the commit marker runs in reverse commit order. */
  c->commit_order[c->ncommit++] = g->index;
  c->bwd_left++;
  if (delay)
    return delay_commit(m, g, forced_release, n);
  return commit_now(m, g, forced_release, n);
}

/* One group of its own for nbytes at data, in one call, so that an
 * interrupt of the caller (Python's KeyboardInterrupt lands between two of
 * its calls) never leaves the group open nor a handle unowned. */
ofl_status_t ofl_manager_group_push_bytes(ofl_manager_t *m, const char *name,
                                          void *data, size_t nbytes, int copy,
                                          ofl_tag_t *tag,
                                          ofl_tensor_t **pushed) {
  if (m == NULL || name == NULL || data == NULL || nbytes == 0 || tag == NULL ||
      pushed == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_push_bytes: manager, name, data, tag "
                      "and pushed must not be NULL, nor nbytes 0");
  if (copy && ofl_device_backend(m->dev) != OFL_BACKEND_HOST)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_push_bytes: copy needs the host "
                      "backend (its device memory is host memory); wrap the "
                      "memory instead (copy 0)");
  int64_t shape[1] = {(int64_t)nbytes};
  ofl_tensor_t *h = NULL;
  if (copy) {
    OFL_CHECK(ofl_pool_alloc(m->dev_pool, shape, 1, OFL_DTYPE_U8, NULL, &h));
    memcpy(ofl_tensor_data(h), data, nbytes);
  } else {
    OFL_CHECK(ofl_tensor_wrap(data, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE,
                              NULL, NULL, &h));
  }
  ofl_status_t s = ofl_manager_group_start(m, name);
  if (s != OFL_SUCCESS) {
    ofl_tensor_destroy(h);
    return s;
  }
  ofl_tag_t t = OFL_TAG_INVALID;
  s = ofl_manager_tensor_push(m, h, &t);
  if (s != OFL_SUCCESS)
    ofl_tensor_destroy(h);
  ofl_status_t c = ofl_manager_group_commit(m, name, NULL, 0, 0);
  if (s == OFL_SUCCESS)
    s = c;
  if (s != OFL_SUCCESS)
    return s; /* a failed commit: the manager still owns the pushed tensor */
  *tag = t;
  *pushed = h;
  return OFL_SUCCESS;
}

ofl_status_t ofl_manager_commit_open_groups(ofl_manager_t *m,
                                            size_t *ncommitted) {
  if (m == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_commit_open_groups: manager is NULL");
  size_t n = 0;
  while (m->nopen > 0) { /* innermost first, as their commits would run */
    const char *name = m->names[m->open[m->nopen - 1].nid].name;
    OFL_CHECK(ofl_manager_group_commit(m, name, NULL, 0, 0));
    n++;
  }
  if (ncommitted != NULL)
    *ncommitted = n;
  return OFL_SUCCESS;
}

ofl_status_t ofl_manager_flush_delayed_groups(ofl_manager_t *m) {
  if (m == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_flush_delayed_groups: manager is NULL");
  if (m->ndelayed > 0)
    OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_flush_delayed_groups"));
  ofl_status_t first = OFL_SUCCESS;
  for (uint32_t i = 0; i < m->ndelayed; i++) {
    delayed_t *d = &m->delayed[i];
    d->g->delayed = false;
    ofl_status_t s = commit_now(m, d->g, d->forced, d->n);
    if (s != OFL_SUCCESS && first == OFL_SUCCESS)
      first = s;
  }
  m->ndelayed = 0;
  return first;
}
