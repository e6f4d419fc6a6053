/* ofl: groups (the tensors of one named module call inside a chunk): start,
 * push, commit (bulk offload), backward markers (bulk reload, prefetch) and
 * pop (inline reload). The stream-ordering rules of docs/DESIGN.md section 5 are
 * enforced here; each line that does so cites its rule. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"
#include "pool/pool_internal.h"
#include "runtime/device_internal.h"

/* ---- tags -------------------------------------------------------------------
 * bit 63: held outside a group; bits 55..62: the manager's tag id (a tag
 * pops only on the manager that made it); bits 40..54: iteration; managed:
 * bits 24..39 chunk, 12..23 group, 0..11 entry + 1; held: bits 0..39
 * slot + 1. The low field is never 0, so neither is a tag. */
#define TAG_HELD (UINT64_C(1) << 63)
#define TAG_ID_SHIFT 55
#define TAG_ID(m) ((uint64_t)(m)->tag_id << TAG_ID_SHIFT)
#define TAG_GEN_MASK (UINT64_C(0x7fff) << 40)
#define TAG_GEN(m) ((uint64_t)((m)->gen & 0x7fffu) << 40)
#define TAG_SLOT_MASK ((UINT64_C(1) << 40) - 1)
#define TAG_MAX_GROUPS 0xfffu  /* per chunk */
#define TAG_MAX_ENTRIES 0xffeu /* per group (entry + 1 fits 12 bits) */

static ofl_tag_t tag_make(const ofl_manager_t *m, uint32_t c, uint32_t g,
                          uint32_t k) {
  return TAG_ID(m) | TAG_GEN(m) | ((uint64_t)c << 24) | ((uint64_t)g << 12) |
         (uint64_t)(k + 1);
}

/* OFL_SUCCESS when tag was made by m; else why not, naming it. */
static ofl_status_t tag_check_owner(const ofl_manager_t *m, ofl_tag_t tag) {
  if (tag == OFL_TAG_INVALID)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: tensor_pop of tag 0 (OFL_TAG_INVALID, never "
                      "a pushed tensor's); pass the tag tensor_push returned",
                      m->rank);
  unsigned id = (unsigned)(tag >> TAG_ID_SHIFT) & 0xffu;
  if (id != m->tag_id)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: tensor_pop of tag 0x%llx made by another "
                      "manager (its id %u, this manager's %u); pop a tag on "
                      "the manager whose tensor_push returned it",
                      m->rank, (unsigned long long)tag, id, m->tag_id);
  return OFL_SUCCESS;
}

/* ---- group records --------------------------------------------------------
 */

void ofl__group_free(group_t *g) {
  if (g == NULL)
    return;
  ofl_event_destroy(g->offload_ev);
  ofl_event_destroy(g->reload_ev);
  free(g->entries);
  free(g);
}

static ofl_status_t group_new(ofl_manager_t *m, chunk_t *c, int nid,
                              group_t **out) {
  if (c->ngroups >= TAG_MAX_GROUPS) /* tags hold the group in 12 bits */
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, c, m->names[nid].name,
                     "more than %u groups in one chunk", TAG_MAX_GROUPS);
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
    ofl__group_free(g);
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
      OFL_CHECK(group_new(m, c, nid, &g));
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

ofl_status_t ofl_manager_group_start_flags(ofl_manager_t *m, const char *name,
                                           unsigned flags,
                                           size_t kept_input_bytes) {
  if (m != NULL && (flags & ~OFL_GROUP_RECOMPUTABLE) != 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: group_start_flags %s: unknown flags 0x%x "
                      "(OFL_GROUP_RECOMPUTABLE is 0x%x)",
                      m->rank, name ? name : "(null)", flags,
                      OFL_GROUP_RECOMPUTABLE);
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
    if (rc)
      ofl__plan_on_start(m, g);
  } else if (g->action == OFL_ACTION_RECOMPUTE) {
    g->rc_input_bytes = kept_input_bytes; /* the ledger counts what it is */
  }
  return OFL_SUCCESS;
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
  *tag = TAG_HELD | TAG_ID(m) | TAG_GEN(m) | (uint64_t)(m->nheld + 1);
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
  if (g->n >= TAG_MAX_ENTRIES)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, g->chunk, ofl__gname(m, g),
                     "more than %u tensors pushed in one group",
                     TAG_MAX_ENTRIES);
  OFL_CHECK(
      ofl__grow((void **)&g->entries, &g->cap, g->n + 1, sizeof *g->entries));
  entry_t *e = &g->entries[g->n];
  memset(e, 0, sizeof *e);
  e->t = t;
  e->leader = g->n;
  e->state = E_HELD;
  *tag = tag_make(m, g->chunk->index, g->index, g->n);
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

static ofl_status_t host_alloc(ofl_manager_t *m, group_t *g, entry_t *l,
                               ofl_tensor_t **out) {
  const ofl_tensor_t *t = l->t;
  if (l->nmembers == 1 && !m->names[g->nid].dynamic)
    return ofl_pool_alloc(m->host_pool, ofl_tensor_shape(t), ofl_tensor_ndim(t),
                          ofl_tensor_dtype(t), m->d2h, out);
  int64_t shape[1] = {(int64_t)l->span};
  return ofl_pool_alloc_dynamic(m->host_pool, shape, 1, OFL_DTYPE_U8, m->d2h,
                                out);
}

/* Copies one eligible cluster to the disk tier: a D2H copy into the
 * extent's bounce buffer, written to the file once the copy is done.
 * *done is false when the store refused (budget, space, no buffer). */
static ofl_status_t offload_to_disk(ofl_manager_t *m, entry_t *l,
                                    const char *src, bool *done) {
  ofl_disk_extent_t *e = NULL;
  ofl_status_t s = ofl_disk_extent_create(m->disk, l->span, &e);
  if (s == OFL_ERR_NO_SPACE || s == OFL_ERR_NO_MEMORY) {
    *done = false;
    return OFL_SUCCESS;
  }
  OFL_CHECK(s);
  s = ofl_memcpy_async(ofl_disk_extent_data(e), src, l->span, OFL_COPY_D2H,
                       m->d2h);
  if (s == OFL_SUCCESS)
    s = ofl_disk_extent_write_after(e, m->d2h);
  if (s != OFL_SUCCESS) {
    ofl_disk_extent_destroy_after(e, m->d2h);
    return s;
  }
  l->ext = e;
  m->st.disk_tensors++;
  m->st.disk_bytes += l->span;
  *done = true;
  return OFL_SUCCESS;
}

/* Copies one eligible cluster to pinned memory on the D2H stream, or to the
 * disk tier for the groups it selects. When the host budget is full the
 * cluster falls to the disk tier, and stays on the device when there is
 * none or it refuses too (*done false, counted; nothing is dropped). */
static ofl_status_t offload_cluster(ofl_manager_t *m, group_t *g, entry_t *l,
                                    bool *done) {
  const char *src = (const char *)l->t->st->base + l->lo;
  *done = false;
  if (ofl__manager_test_fail_offload(m))
    return ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_PIPELINE,
                      "injected offload fault (tests)");
  bool disk_first =
      m->disk != NULL && ofl_disk_group_selected(m->disk, ofl__gname(m, g));
  if (disk_first) {
    OFL_CHECK(offload_to_disk(m, l, src, done));
    if (*done) {
      g->warm_disk_bytes += m->warmup ? l->span : 0;
      return OFL_SUCCESS;
    }
  }
  ofl_tensor_t *h = NULL;
  ofl_status_t s = host_alloc(m, g, l, &h);
  if (s == OFL_ERR_NO_MEMORY) {
    if (m->disk != NULL && !disk_first) {
      OFL_CHECK(offload_to_disk(m, l, src, done));
      if (*done) {
        g->warm_disk_bytes += m->warmup ? l->span : 0;
        return OFL_SUCCESS;
      }
    }
    g->warm_budget_bytes += m->warmup ? l->span : 0;
    m->st.budget_kept_tensors += l->nmembers;
    m->st.budget_kept_bytes += l->span;
    m->names[g->nid].st.budget_kept_bytes += l->span;
    OFL__PLOG(OFL_LOG_INFO, m, g->chunk, ofl__gname(m, g),
              "host budget full%s: %zu bytes stay on the device",
              m->disk ? " and the disk tier refused" : "", l->span);
    return OFL_SUCCESS;
  }
  OFL_CHECK(s);
  s = ofl_memcpy_async(ofl_tensor_data(h), src, l->span, OFL_COPY_D2H, m->d2h);
  if (s != OFL_SUCCESS) {
    ofl_pool_free(m->host_pool, h);
    return s;
  }
  l->host = h;
  *done = true;
  return OFL_SUCCESS;
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
    if (l->host != NULL) {
      if (!recorded ||
          ofl_pool_free_after_event(m->host_pool, l->host, g->offload_ev) !=
              OFL_SUCCESS) {
        (void)ofl_stream_synchronize(m->d2h, OFL_TIMEOUT_DEFAULT);
        ofl_pool_free(m->host_pool, l->host);
      }
      l->host = NULL;
    }
    if (l->ext != NULL) {
      if (ofl_disk_extent_destroy_after(l->ext, m->d2h) != OFL_SUCCESS)
        OFL_WARN(OFL_SUBSYS_PIPELINE,
                 "rank %d group %s: disk extent not "
                 "released",
                 m->rank, ofl__gname(m, g));
      l->ext = NULL;
      m->st.disk_tensors--;
      m->st.disk_bytes -= l->span;
      g->warm_disk_bytes -= m->warmup ? l->span : 0;
    }
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
    ofl_status_t st = offload_cluster(m, g, l, &done);
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
  return ofl__group_commit_now(m, g, forced_release, n);
}

/* One group of its own for nbytes at data, in one call, so that an
 * interrupt of the caller (Python's KeyboardInterrupt lands between two of
 * its calls) never leaves the group open nor a handle unowned. */
ofl_status_t ofl_manager_group_push_bytes(ofl_manager_t *m, const char *name,
                                          void *data, size_t nbytes, int copy,
                                          ofl_tag_t *tag,
                                          ofl_tensor_t **pushed) {
  if (m == NULL || name == NULL || data == NULL || nbytes == 0 ||
      tag == NULL || pushed == NULL)
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
    ofl_status_t s = ofl__group_commit_now(m, d->g, d->forced, d->n);
    if (s != OFL_SUCCESS && first == OFL_SUCCESS)
      first = s;
  }
  m->ndelayed = 0;
  return first;
}

/* ---- reload ---------------------------------------------------------------
 */

/* Gives the cluster of leader l device storage and queues the H2D copy on
 * stream (h2d for a prefetch, compute for an inline reload). */
static ofl_status_t reload_cluster(ofl_manager_t *m, group_t *g, entry_t *l,
                                   ofl_stream_t *stream) {
  bool dyn = m->names[g->nid].dynamic;
  ofl_tensor_t *dst = l->t;
  ofl_tensor_t *carrier = NULL;
  if (l->nmembers == 1) {
    OFL_CHECK(dyn ? ofl_pool_alloc_into_dynamic(m->dev_pool, dst, stream)
                  : ofl_pool_alloc_into(m->dev_pool, dst, stream));
  } else {
    int64_t shape[1] = {(int64_t)l->span};
    OFL_CHECK(ofl_pool_alloc_dynamic(m->dev_pool, shape, 1, OFL_DTYPE_U8,
                                     stream, &carrier));
    dst = carrier;
  }
  const void *src = NULL;
  ofl_status_t s = OFL_SUCCESS;
  if (l->ext != NULL) {
    /* The disk tier: the bytes are read back into the extent's buffer
     * (at once after a prefetch; a wait counted by the store otherwise). */
    void *data = NULL;
    s = ofl_disk_extent_reload(l->ext, OFL_TIMEOUT_DEFAULT, &data);
    src = data;
  } else {
    src = ofl_tensor_data(l->host);
  }
  if (s == OFL_SUCCESS)
    s = ofl_memcpy_async(ofl_tensor_data(dst), src, l->span, OFL_COPY_H2D,
                         stream);
  if (s != OFL_SUCCESS) {
    if (carrier != NULL)
      ofl_tensor_destroy(carrier);
    else
      ofl_tensor_release_storage(dst);
    return s;
  }
  uint32_t li = (uint32_t)(l - g->entries);
  for (uint32_t i = li; carrier != NULL && i < g->n; i++) {
    entry_t *e = &g->entries[i];
    if (e->leader != li || e->state != E_OFFLOADED)
      continue;
    /* Members become views of the one reloaded block (rule 6). */
    ofl_tensor_t *t = e->t;
    OFL_CHECK(ofl__pool_block_ref(carrier));
    t->st = carrier->st;
    t->st_gen = carrier->st_gen;
    t->offset = carrier->offset + (e->off - l->lo);
    t->data = (char *)t->st->base + t->offset;
    t->loc = t->st->loc;
  }
  if (carrier != NULL)
    OFL_CHECK(ofl_tensor_destroy(carrier));
  /* Rule 2: the pinned block returns to its pool only after this H2D. */
  if (l->ext != NULL)
    s = ofl_disk_extent_destroy_after(l->ext, stream);
  else if (m->test.rules_off & OFL__RULE2_OFF)
    s = ofl_pool_free(m->host_pool, l->host);
  else
    s = ofl_pool_free_after(m->host_pool, l->host, stream);
  l->host = NULL;
  l->ext = NULL;
  /* The copy is queued: the tensors are reloaded even when the pinned
   * block could not be given back (reported). */
  for (uint32_t i = li; i < g->n; i++)
    if (g->entries[i].leader == li && g->entries[i].state == E_OFFLOADED)
      g->entries[i].state = E_RELOADED;
  name_info_t *ni = &m->names[g->nid];
  m->st.reloaded_tensors++;
  m->st.reloaded_bytes += l->span;
  ni->st.reloaded_tensors++;
  ni->st.reloaded_bytes += l->span;
  return s;
}

static void stack_remove(chunk_t *c, group_t *g) {
  for (uint32_t i = c->nstack; i-- > 0;) {
    if (c->stack[i] == g) {
      memmove(&c->stack[i], &c->stack[i + 1],
              (c->nstack - i - 1) * sizeof *c->stack);
      c->nstack--;
      return;
    }
  }
}

/* Bulk reload of a group on the H2D stream (prefetch). */
static ofl_status_t reload_group(ofl_manager_t *m, group_t *g) {
  stack_remove(g->chunk, g);
  /* Rule 1: the H2D reads the pinned copy only after the D2H filled it. */
  if (!(m->test.rules_off & OFL__RULE1_OFF))
    OFL_CHECK(ofl_stream_wait_event(m->h2d, g->offload_ev));
  ofl__plan_on_reload(m, g, 0);
  ofl_status_t s = OFL_SUCCESS;
  uint32_t queued = 0;
  for (uint32_t i = 0; i < g->n && s == OFL_SUCCESS; i++) {
    entry_t *l = &g->entries[i];
    if (l->leader == i && l->state == E_OFFLOADED &&
        (l->host != NULL || l->ext != NULL)) {
      s = reload_cluster(m, g, l, m->h2d);
      queued += s == OFL_SUCCESS;
    }
  }
  /* Even when a cluster failed (no device memory), the copies already
   * queued are joined through the event before their tensors are handed
   * out; the clusters left offloaded reload inline at their pop. */
  ofl_status_t r = ofl_event_record(g->reload_ev, m->h2d);
  if (r == OFL_SUCCESS) {
    g->reload_issued = true;
    g->reload_joined = false;
    ofl__plan_on_reload(m, g, 1);
  } else if (queued > 0) {
    /* No event to join: wait here (bounded) for the queued copies. */
    ofl_status_t w = ofl_stream_synchronize(m->h2d, OFL_TIMEOUT_DEFAULT);
    if (s == OFL_SUCCESS)
      s = w;
  }
  if (s == OFL_SUCCESS)
    s = r;
  if (s != OFL_SUCCESS)
    return s;
  OFL__PLOG(OFL_LOG_TRACE, m, g->chunk, ofl__gname(m, g), "prefetch on h2d%s",
            "");
  return OFL_SUCCESS;
}

/* A named range around each bulk offload and reload: NVTX on cuda (Nsight
 * Systems), the compute track of the Chrome trace on the host backend. */
ofl_status_t ofl__group_commit_now(ofl_manager_t *m, group_t *g,
                                   ofl_tensor_t *const *forced, size_t n) {
  ofl_range_push(m->dev, m->names[g->nid].range_offload);
  ofl_status_t st = commit_group(m, g, forced, n);
  ofl_range_pop(m->dev);
  return st;
}

ofl_status_t ofl__group_reload(ofl_manager_t *m, group_t *g) {
  ofl_range_push(m->dev, m->names[g->nid].range_reload);
  ofl_status_t st = reload_group(m, g);
  ofl_range_pop(m->dev);
  return st;
}

/* Compute waits for the group's prefetch (counted as a stall when it has not
 * finished yet). at_begin: the wait of its backward's begin (the auto plan
 * takes the warmup's out of the later stamps; a pop's wait comes after the
 * begin's stamp). */
static ofl_status_t join_reload(ofl_manager_t *m, group_t *g, bool at_begin) {
  if (!g->reload_issued)
    return OFL_SUCCESS;
  /* Rule 3: a pop on another compute stream than the one that joined
   * waits for the prefetch too. */
  ofl_stream_t *compute = ofl__compute(m);
  if (g->reload_joined && g->joined_on == compute)
    return OFL_SUCCESS;
  name_info_t *ni = &m->names[g->nid];
  /* On a backend with timing events the wait is timed on the device
   * (stall.c): a CPU query here would see nearly every reload unfinished,
   * the CPU being far ahead of the GPU. */
  ofl_status_t timed = g->reload_joined
                           ? OFL_ERR_NOT_SUPPORTED
                           : ofl__stall_timed_wait(m, g, compute, g->reload_ev,
                                                   m->warmup && at_begin);
  if (timed != OFL_SUCCESS && timed != OFL_ERR_NOT_SUPPORTED)
    return timed;
  bool late = timed == OFL_ERR_NOT_SUPPORTED && !g->reload_joined &&
              ofl_event_query(g->reload_ev) == OFL_ERR_NOT_READY;
  uint64_t t0 = late ? ofl__now_ns() : 0;
  if (timed != OFL_SUCCESS)
    OFL_CHECK(ofl_stream_wait_event(compute, g->reload_ev));
  g->joined_on = compute;
  if (late) {
    /* The host compute stream waits on the calling thread: CPU time is the
     * stall. */
    uint64_t dt =
        ofl_device_backend(m->dev) == OFL_BACKEND_HOST ? ofl__now_ns() - t0 : 0;
    m->st.stalls++;
    m->st.stall_ns += dt;
    ni->st.stalls++;
    ni->st.stall_ns += dt;
    ofl__plan_on_stall(m, g, dt, m->warmup && at_begin);
  }
  g->reload_joined = true;
  return OFL_SUCCESS;
}

/* ---- backward -------------------------------------------------------------
 */

/* The group whose commit-backward comes next: the current backward chunk's
 * next commit in reverse order, or the first chunk in backward order that
 * still has commits (rule 5: its next group must be name). */
static ofl_status_t select_backward(ofl_manager_t *m, int nid, const char *name,
                                    group_t **out) {
  /* Nothing changes until the group is known to match (a call that fails
   * leaves the backward position as it was). */
  chunk_t *c = m->cur_bwd;
  uint32_t cursor = m->bwd_cursor;
  if (c == NULL || c->bwd_left == 0) {
    c = NULL;
    while (cursor < m->nbwd) {
      chunk_t *x = m->bwd[cursor];
      if (x->ngroups == 0 || (x->ncommit > 0 && x->bwd_left == 0)) {
        cursor++; /* nothing to run backward, or done */
        continue;
      }
      if (x->bwd_left == 0)
        return OFL__PERR(OFL_ERR_MISMATCH, m, x, name,
                         "backward of this group, but the next chunk in "
                         "backward order has not run its forward in this "
                         "iteration%s",
                         "");
      cursor++;
      c = x;
      break;
    }
    if (c == NULL)
      return OFL__PERR(OFL_ERR_INVALID_USAGE, m, m->cur_bwd, name,
                       "backward of a group that no chunk has waiting (%u "
                       "chunks in backward order, all done or never "
                       "offloaded); each committed group runs backward once",
                       m->nbwd);
  }
  group_t *g = c->groups[c->commit_order[c->bwd_left - 1]];
  if (g->nid != nid)
    return OFL__PERR(OFL_ERR_MISMATCH, m, c, name,
                     "backward of this group, but the next group to run "
                     "backward in this chunk is %s (reverse commit order)",
                     m->names[g->nid].name);
  m->bwd_cursor = cursor;
  m->cur_bwd = c;
  c->bwd_left--;
  *out = g;
  return OFL_SUCCESS;
}

ofl_status_t ofl_manager_group_backward_begin(ofl_manager_t *m,
                                              const char *name) {
  if (m == NULL || name == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_backward_begin: manager and name "
                      "must not be NULL");
  if (!ofl__manager_active(m))
    return OFL_SUCCESS;
  OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_group_backward_begin"));
  int nid = ofl__name_find(m, name);
  if (nid < 0)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, m->cur_bwd, name,
                     "backward of a group never started in forward%s", "");
  group_t *g = NULL;
  if (m->names[nid].selected)
    OFL_CHECK(select_backward(m, nid, name, &g));
  /* The first backward of the warmup (a call that succeeded) fixes the
   * chunks counted by the summary (policy.c). */
  if (m->warmup && m->fwd_before_bwd == 0)
    m->fwd_before_bwd = m->nfwd;
  if (g == NULL)
    return OFL_SUCCESS;
  g->bwd = 1;
  if (g->offloaded && !g->reload_issued) {
    /* Not prefetched (first group of a chunk in warmup): tensor_pop
     * reloads each tensor inline. */
    stack_remove(g->chunk, g);
    g->inline_reload = true;
  }
  OFL_CHECK(join_reload(m, g, true));
  ofl__plan_on_backward(m, g, 0);
  OFL__PLOG(OFL_LOG_TRACE, m, g->chunk, name, "backward begins%s",
            g->inline_reload ? " (inline reload)" : "");
  return OFL_SUCCESS;
}

/* A chunk's forward has finished when a later chunk began, or when it is
 * the current forward chunk with every recorded group started (steady
 * state) and none open (the reference's index == max group count). */
static bool forward_finished(const ofl_manager_t *m, const chunk_t *c) {
  if (c->fwd_done)
    return true;
  if (c != m->cur_fwd || m->nopen > 0)
    return false;
  return m->warmup || c->fwd_cursor == c->ngroups;
}

/* Starts the disk reads of the groups that follow the next one in reload
 * order (OFL_DISK_PREFETCH groups), so their bytes are in memory when their
 * H2D is issued. */
static void disk_read_ahead(ofl_manager_t *m, chunk_t *c) {
  if (m->disk == NULL)
    return;
  int ahead = ofl_disk_prefetch_groups(m->disk);
  for (uint32_t k = c->nstack; k-- > 0 && ahead-- > 0;) {
    group_t *g = c->stack[k];
    for (uint32_t i = 0; i < g->n; i++)
      if (g->entries[i].ext != NULL)
        (void)ofl_disk_extent_prefetch(g->entries[i].ext); /* best effort */
  }
}

static ofl_status_t prefetch_one(ofl_manager_t *m, chunk_t *c) {
  if (c->nstack > 0) {
    OFL_CHECK(ofl__group_reload(m, c->stack[c->nstack - 1]));
    disk_read_ahead(m, c);
    return OFL_SUCCESS;
  }
  chunk_t *next = ofl__front_backward_chunk(m, -1);
  if (next == NULL || next == c || !forward_finished(m, next) ||
      next->nstack == 0)
    return OFL_SUCCESS;
  OFL_CHECK(ofl__group_reload(m, next->stack[next->nstack - 1]));
  disk_read_ahead(m, next);
  return OFL_SUCCESS;
}

/* Reloads issued for groups whose backward has not begun, in chunk c. */
static uint32_t issued_ahead(const chunk_t *c) {
  uint32_t n = 0;
  for (uint32_t i = 0; c != NULL && i < c->ngroups; i++)
    n += c->groups[i]->reload_issued && c->groups[i]->bwd == 0;
  return n;
}

/* Keeps prefetch_groups reloads issued ahead of the backward pass: the
 * groups next in reload order (this chunk's, then the next chunk's in
 * backward order) until that many wait for their backward. */
static ofl_status_t prefetch_next(ofl_manager_t *m, chunk_t *c) {
  for (;;) {
    chunk_t *next = ofl__front_backward_chunk(m, -1);
    uint32_t ahead = issued_ahead(c) + (next != c ? issued_ahead(next) : 0);
    if (ahead >= ofl__plan_prefetch_depth(m, c, next, ahead))
      return OFL_SUCCESS;
    uint32_t before = c->nstack, next_before = next ? next->nstack : 0;
    OFL_CHECK(prefetch_one(m, c));
    if (c->nstack == before && (next == NULL || next->nstack == next_before))
      return OFL_SUCCESS; /* nothing left to reload ahead */
  }
}

ofl_status_t ofl_manager_group_backward_end(ofl_manager_t *m,
                                            const char *name) {
  if (m == NULL || name == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_backward_end: manager and name must "
                      "not be NULL");
  if (!ofl__manager_active(m))
    return OFL_SUCCESS;
  OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_group_backward_end"));
  int nid = ofl__name_find(m, name);
  if (nid >= 0 && !m->names[nid].selected)
    return OFL_SUCCESS;
  chunk_t *c = m->cur_bwd;
  group_t *g = NULL;
  for (uint32_t i = c ? c->bwd_left : 0; c && i < c->ncommit; i++) {
    group_t *x = c->groups[c->commit_order[i]];
    if (x->nid == nid && x->bwd == 1) {
      g = x;
      break;
    }
  }
  if (g == NULL)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, c, name,
                     "backward_end without a matching backward_begin in the "
                     "current backward chunk%s",
                     "");
  g->bwd = 2;
  ofl__plan_on_backward(m, g, 1);
  /* The prefetch's device blocks may be ones compute just let go of: the
   * H2D stream starts after compute's work so far. */
  ofl_status_t s = ofl_event_record(m->ev_compute, ofl__compute(m));
  if (s == OFL_SUCCESS)
    s = ofl_stream_wait_event(m->h2d, m->ev_compute);
  if (s == OFL_SUCCESS)
    s = prefetch_next(m, c);
  /* A prefetch only gets ahead: when the device pool has no memory for its
   * buffers, the groups not reloaded stay offloaded and their tensors
   * reload inline at their pop. Device errors are still reported. */
  if (s == OFL_ERR_NO_MEMORY) {
    OFL__PLOG(OFL_LOG_INFO, m, c, name,
              "prefetch stopped, no device memory (%s); the tensors not "
              "reloaded reload at their pop",
              ofl_last_error());
    s = OFL_SUCCESS;
  }
  OFL_CHECK(s);
  OFL__PLOG(OFL_LOG_TRACE, m, c, name, "backward ends%s", "");
  return OFL_SUCCESS;
}

/* ---- pop ------------------------------------------------------------------
 */

static ofl_status_t pop_held(ofl_manager_t *m, ofl_tag_t tag,
                             ofl_tensor_t **out) {
  uint64_t slot = tag & TAG_SLOT_MASK;
  if ((tag & TAG_GEN_MASK) != TAG_GEN(m) || slot == 0 || slot > m->nheld ||
      m->held[slot - 1] == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: tensor_pop of tag 0x%llx: unknown, from an "
                      "earlier iteration or already popped (tensor held "
                      "outside any group)",
                      m->rank, (unsigned long long)tag);
  *out = m->held[slot - 1];
  m->held[slot - 1] = NULL;
  (*out)->owner = NULL;
  return OFL_SUCCESS;
}

ofl_status_t ofl_manager_tensor_pop(ofl_manager_t *m, ofl_tag_t tag,
                                    ofl_tensor_t **out) {
  if (m == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_tensor_pop: manager and out must not be "
                      "NULL");
  OFL_CHECK(tag_check_owner(m, tag));
  if (tag & TAG_HELD)
    return pop_held(m, tag, out);
  uint32_t ci = (uint32_t)(tag >> 24) & 0xffffu;
  uint32_t gi = (uint32_t)(tag >> 12) & 0xfffu;
  uint32_t k = (uint32_t)tag & 0xfffu;
  if ((tag & TAG_GEN_MASK) != TAG_GEN(m) || k == 0 || ci >= m->nfwd ||
      gi >= m->fwd[ci]->ngroups || k > m->fwd[ci]->groups[gi]->n)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d chunk %u group %u: tensor_pop of unknown tag "
                      "0x%llx (never pushed, or pushed in an earlier "
                      "iteration)",
                      m->rank, ci, gi, (unsigned long long)tag);
  group_t *g = m->fwd[ci]->groups[gi];
  entry_t *e = &g->entries[k - 1];
  if (e->state == E_POPPED)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, g->chunk, ofl__gname(m, g),
                     "tensor_pop of tag 0x%llx (tensor %u) that was already "
                     "popped; a tag pops once",
                     (unsigned long long)tag, k - 1);
  if (e->state == E_HELD)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, g->chunk, ofl__gname(m, g),
                     "tensor_pop of tag 0x%llx before its group was "
                     "committed",
                     (unsigned long long)tag);
  if (e->state == E_OFFLOADED || e->state == E_RELOADED)
    OFL_CHECK(ofl__capture_refuse(m, "ofl_manager_tensor_pop"));
  if (e->state == E_OFFLOADED) {
    entry_t *l = &g->entries[e->leader];
    ofl_stream_t *compute = ofl__compute(m);
    /* Rule 1 (#7398): the inline H2D reads the pinned copy only after the
     * group's D2H has filled it. */
    if (!(m->test.rules_off & OFL__RULE1_OFF))
      OFL_CHECK(ofl_stream_wait_event(compute, g->offload_ev));
    stack_remove(g->chunk, g);
    ofl_status_t s = reload_cluster(m, g, l, compute);
    /* Nothing changed: the cluster stays offloaded, so the same tag pops
     * again once memory is free. */
    if (s == OFL_ERR_NO_MEMORY)
      return OFL__PERR(s, m, g->chunk, ofl__gname(m, g),
                       "tensor_pop of tag 0x%llx: no device memory to reload "
                       "tensor %u (%s); it stays offloaded: release device "
                       "memory (popped tensors no longer needed) and pop the "
                       "same tag again",
                       (unsigned long long)tag, k - 1, ofl_last_error());
    OFL_CHECK(s);
    m->st.inline_reloads++;
    m->names[g->nid].st.inline_reloads++;
    OFL__PLOG(OFL_LOG_TRACE, m, g->chunk, ofl__gname(m, g),
              "inline reload of tensor %u", k - 1);
  } else if (e->state == E_RELOADED) {
    OFL_CHECK(join_reload(m, g, false));
  }
  *out = e->t;
  e->t = NULL;
  e->state = E_POPPED;
  (*out)->owner = NULL;
  return OFL_SUCCESS;
}

/* ---- end of iteration ------------------------------------------------------
 */

/* Releases what an iteration left in the group (tensors never popped) and
 * clears the per-iteration state. */
void ofl__group_end_iteration(ofl_manager_t *m, group_t *g) {
  for (uint32_t i = 0; i < g->n; i++) {
    entry_t *e = &g->entries[i];
    if (e->ext != NULL) {
      if (ofl_disk_extent_destroy_after(e->ext, m->d2h) != OFL_SUCCESS)
        OFL_WARN(OFL_SUBSYS_PIPELINE,
                 "rank %d group %s: disk extent not released", m->rank,
                 ofl__gname(m, g));
      e->ext = NULL;
    }
    if (e->host != NULL) {
      /* Its D2H may still be queued: reuse waits for the offload event. */
      if (ofl_pool_free_after_event(m->host_pool, e->host, g->offload_ev) !=
          OFL_SUCCESS)
        OFL_WARN(OFL_SUBSYS_PIPELINE,
                 "rank %d group %s: pinned copy not returned to its pool",
                 m->rank, ofl__gname(m, g));
      e->host = NULL;
    }
    if (e->state != E_POPPED && e->t != NULL) {
      m->st.unpopped_tensors++;
      if (e->state == E_RELOADED && ofl_tensor_has_storage(e->t)) {
        /* Reloaded on h2d (prefetch), on compute (inline) or both (a
         * prefetch that failed half-way): compute joins the prefetch and
         * the block is reused after both. */
        ofl_stream_t *compute = ofl__compute(m);
        bool joined =
            !g->reload_issued ||
            (g->reload_joined && g->joined_on == compute) ||
            ofl_stream_wait_event(compute, g->reload_ev) == OFL_SUCCESS;
        ofl_tensor_release_storage_after(e->t, joined ? compute : m->h2d);
      }
      ofl_tensor_destroy(e->t);
      e->t = NULL;
    }
  }
  g->n = 0;
  g->open = g->delayed = g->committed = g->offloaded = false;
  g->reload_issued = g->reload_joined = g->inline_reload = false;
  g->joined_on = NULL;
  g->bwd = 0;
}
