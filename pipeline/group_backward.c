/* ofl: a group's backward: the bulk reload from the storage tier
 * (tier.c) and its prefetch, the backward markers, pop (an inline reload
 * where no prefetch came) and the end of an iteration. The stream-ordering
 * rules of docs/design/pipeline.md section 5 are enforced here and in
 * group_forward.c; each line that does so cites its rule. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"
#include "pool/pool_internal.h"

/* ---- reload ---------------------------------------------------------------
 */

/* Gives the cluster of leader l device storage and queues the H2D copy
 * from the tier on stream (h2d for a prefetch, compute for an inline
 * reload). */
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
  ofl_status_t rel = OFL_SUCCESS;
  ofl_status_t s = ofl__tier_reload(m, l, ofl_tensor_data(dst), stream, &rel);
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
  return rel;
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
    if (l->leader == i && l->state == E_OFFLOADED && ofl__tier_holds(l)) {
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

/* A named range around each bulk reload: NVTX on cuda (Nsight Systems),
 * the compute track of the Chrome trace on the host backend. */
static ofl_status_t group_reload(ofl_manager_t *m, group_t *g) {
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

static ofl_status_t prefetch_one(ofl_manager_t *m, chunk_t *c) {
  if (c->nstack > 0) {
    OFL_CHECK(group_reload(m, c->stack[c->nstack - 1]));
    ofl__tier_read_ahead(m, c);
    return OFL_SUCCESS;
  }
  chunk_t *next = ofl__front_backward_chunk(m, -1);
  if (next == NULL || next == c || !forward_finished(m, next) ||
      next->nstack == 0)
    return OFL_SUCCESS;
  OFL_CHECK(group_reload(m, next->stack[next->nstack - 1]));
  ofl__tier_read_ahead(m, next);
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

/* OFL_SUCCESS when tag was made by m; else why not, naming it. */
static ofl_status_t tag_check_owner(const ofl_manager_t *m, ofl_tag_t tag) {
  if (tag == OFL_TAG_INVALID)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: tensor_pop of tag 0 (OFL_TAG_INVALID, never "
                      "a pushed tensor's); pass the tag tensor_push returned",
                      m->rank);
  unsigned id = (unsigned)(tag >> OFL__TAG_ID_SHIFT) & 0xffu;
  if (id != m->tag_id)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: tensor_pop of tag 0x%llx made by another "
                      "manager (its id %u, this manager's %u); pop a tag on "
                      "the manager whose tensor_push returned it",
                      m->rank, (unsigned long long)tag, id, m->tag_id);
  return OFL_SUCCESS;
}

static ofl_status_t pop_held(ofl_manager_t *m, ofl_tag_t tag,
                             ofl_tensor_t **out) {
  uint64_t slot = tag & OFL__TAG_SLOT_MASK;
  if ((tag & OFL__TAG_GEN_MASK) != OFL__TAG_GEN(m) || slot == 0 ||
      slot > m->nheld || m->held[slot - 1] == NULL)
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

static ofl_status_t pop_entry(ofl_manager_t *m, group_t *g, uint32_t k,
                              ofl_tag_t tag, ofl_tensor_t **out);

ofl_status_t ofl_manager_tensor_pop(ofl_manager_t *m, ofl_tag_t tag,
                                    ofl_tensor_t **out) {
  if (m == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_tensor_pop: manager and out must not be "
                      "NULL");
  OFL_CHECK(tag_check_owner(m, tag));
  if (tag & OFL__TAG_HELD)
    return pop_held(m, tag, out);
  uint32_t ci = (uint32_t)(tag >> 24) & 0xffffu;
  uint32_t gi = (uint32_t)(tag >> 12) & 0xfffu;
  uint32_t k = (uint32_t)tag & 0xfffu;
  if ((tag & OFL__TAG_GEN_MASK) != OFL__TAG_GEN(m) || k == 0 || ci >= m->nfwd ||
      gi >= m->fwd[ci]->ngroups || k > m->fwd[ci]->groups[gi]->n)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d chunk %u group %u: tensor_pop of unknown tag "
                      "0x%llx (never pushed, or pushed in an earlier "
                      "iteration)",
                      m->rank, ci, gi, (unsigned long long)tag);
  group_t *g = m->fwd[ci]->groups[gi];
  /* the auto plan's warmup: the time a pop takes (a wait for the reload, or
   * the reload itself, inline) is not the backward's compute */
  uint64_t t0 = m->warmup && m->auto_plan ? ofl__now_ns() : 0;
  ofl_status_t st = pop_entry(m, g, k, tag, out);
  if (t0 != 0)
    ofl__plan_warm_pop(m, g, ofl__now_ns() - t0);
  return st;
}

/* ofl_manager_tensor_pop of tensor k (1-based) of g, its tag checked. */
static ofl_status_t pop_entry(ofl_manager_t *m, group_t *g, uint32_t k,
                              ofl_tag_t tag, ofl_tensor_t **out) {
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
    ofl__tier_drop(m, g, e, OFL__TIER_DROP);
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
