/* ofl: the storage tier below the device: where an offloaded cluster's
 * bytes wait for their reload, pinned memory (the host pool) or the disk
 * tier (params.disk), behind three calls: offload (a D2H copy into the
 * tier), reload (an H2D copy back, the tier's storage let go after it)
 * and drop (let go without a reload), and a hint, read-ahead. The group
 * code never asks which tier holds a cluster. */
#include "pipeline/pipeline_internal.h"
#include "pool/pool_internal.h"

/* A pinned block for cluster l of g. Under a host budget a dynamic name's
 * block has the bytes it is charged (the largest span of the name seen,
 * pin_charge), not its own: the pool, which restarts every iteration from
 * bare segments and places in call order, then meets the same requests in
 * every iteration and lays them out alike, where sizes drawn anew each
 * iteration fragmented it differently and an admitted cluster was refused
 * in some iteration after the pools learned; the admission limit went down
 * there and more stayed on the device than the device pool had learned
 * (soak seed 34, draw 5). */
static ofl_status_t host_alloc(ofl_manager_t *m, group_t *g, entry_t *l,
                               ofl_tensor_t **out) {
  const ofl_tensor_t *t = l->t;
  const name_info_t *ni = &m->names[g->nid];
  if (l->nmembers == 1 && !ni->dynamic)
    return ofl_pool_alloc(m->host_pool, ofl_tensor_shape(t), ofl_tensor_ndim(t),
                          ofl_tensor_dtype(t), m->d2h, out);
  uint64_t bytes = l->span;
  if (ni->dynamic && m->pin_budget != 0 && ni->pin_span_max > bytes)
    bytes = ni->pin_span_max;
  int64_t shape[1] = {(int64_t)bytes};
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

/* ---- pinned admission ------------------------------------------------------
 *
 * Under a host budget whether the pinned pool has room for a cluster at
 * its commit depends on timing: a block let go after a reload's H2D is
 * free again, merged with its neighbours, only once that copy ended, and
 * which cached blocks go back to the segments, where the next blocks are
 * carved, follows from that too. A placement taken from the pool's room
 * changed from one iteration to the next, and the pools met sizes their
 * learning never saw. So after the warmup the manager admits a cluster to
 * pinned memory by its own count: the bytes of the clusters in pinned
 * memory, charged at their offload and given back at their reload or drop
 * (both in call order, the same in every iteration), within a limit. The
 * limit starts an eighth under the budget (PIN_MARGIN_DIV: room for the
 * segments' fragmentation); a refusal of the pool for an admitted cluster
 * (after the reloads in flight ended) lowers it to the bytes charged then
 * (with nothing charged, caps the size of one cluster instead), so that
 * the next iterations stop before that point, at the same cluster in every
 * iteration, and that iteration does not end the pools' learning
 * (pin_moved). A dynamic name's clusters, whose sizes change in every
 * iteration, are charged the largest of the name seen. The pool's layout
 * repeats as well: under a budget it starts each iteration from bare
 * segments (restart_due, pool/pool.c), where its key caches used to carry
 * the layout over and a refusal came late, after the pools learned. */
#define PIN_MARGIN_DIV 8

/* The bytes cluster l of g is charged: its pinned block, whole pages. */
static uint64_t pin_charge(ofl_manager_t *m, const group_t *g,
                           const entry_t *l) {
  name_info_t *ni = &m->names[g->nid];
  uint64_t bytes = l->span;
  if (ni->dynamic) {
    if (bytes > ni->pin_span_max)
      ni->pin_span_max = bytes;
    bytes = ni->pin_span_max;
  }
  uint64_t page = OFL_POOL_PAGE_BYTES;
  return (bytes + page - 1) / page * page;
}

static bool pin_admits(const ofl_manager_t *m, uint64_t charge) {
  if (m->warmup)
    return true; /* the warmup offloads what the pool takes */
  return charge <= m->pin_cluster_max && m->pin_charged <= m->pin_limit &&
         charge <= m->pin_limit - m->pin_charged;
}

/* The pool refused an admitted cluster of charge bytes: the limits go
 * down so that the same point is not admitted again. */
static void pin_refused(ofl_manager_t *m, group_t *g, uint64_t charge) {
  if (m->warmup || m->pin_budget == 0)
    return;
  if (m->pin_charged > 0)
    m->pin_limit = m->pin_charged;
  else if (charge > 0)
    m->pin_cluster_max = charge - 1;
  m->pin_moved = true;
  OFL__PLOG(OFL_LOG_INFO, m, g->chunk, ofl__gname(m, g),
            "iteration %llu: pinned pool refused %llu bytes with %llu "
            "charged: admission limit %llu bytes, clusters up to %llu",
            (unsigned long long)m->st.iterations, (unsigned long long)charge,
            (unsigned long long)m->pin_charged,
            (unsigned long long)m->pin_limit,
            (unsigned long long)m->pin_cluster_max);
}

static void pin_release(ofl_manager_t *m, entry_t *l) {
  m->pin_charged -= l->pin_charge;
  l->pin_charge = 0;
}

void ofl__tier_end_iteration(ofl_manager_t *m) {
  ofl_pool_stats_t s;
  ofl_pool_get_stats(m->host_pool, &s);
  if (s.budget_bytes == m->pin_budget)
    return;
  /* A new budget (or the first): the limits start again from it. */
  m->pin_budget = s.budget_bytes;
  m->pin_limit = s.budget_bytes == 0
                     ? UINT64_MAX
                     : s.budget_bytes - s.budget_bytes / PIN_MARGIN_DIV;
  m->pin_cluster_max = UINT64_MAX;
}

/* Copies one eligible cluster to pinned memory on the D2H stream, or to the
 * disk tier for the groups it selects. When the host budget is full (after
 * the warmup: when the admission says so) the cluster falls to the disk
 * tier, and stays on the device when there is none or it refuses too
 * (*done false, counted; nothing is dropped). */
ofl_status_t ofl__tier_offload(ofl_manager_t *m, group_t *g, entry_t *l,
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
  uint64_t charge = pin_charge(m, g, l);
  bool admitted = pin_admits(m, charge);
  ofl_status_t s = admitted ? host_alloc(m, g, l, &h) : OFL_ERR_NO_MEMORY;
  if (s == OFL_ERR_NO_MEMORY && admitted && !m->warmup) {
    /* The blocks the reloads let go are free once their H2D copies ended:
     * with none in flight the pool's answer depends less on the copies'
     * timing. */
    OFL_CHECK(ofl_stream_synchronize(m->h2d, OFL_TIMEOUT_DEFAULT));
    s = host_alloc(m, g, l, &h);
  }
  if (s == OFL_ERR_NO_MEMORY) {
    if (admitted)
      pin_refused(m, g, charge);
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
  l->pin_charge = charge;
  m->pin_charged += charge;
  *done = true;
  return OFL_SUCCESS;
}

ofl_status_t ofl__tier_reload(ofl_manager_t *m, entry_t *l, void *dst,
                              ofl_stream_t *stream, ofl_status_t *released) {
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
    s = ofl_memcpy_async(dst, src, l->span, OFL_COPY_H2D, stream);
  if (s != OFL_SUCCESS)
    return s;
  /* Rule 2: the pinned block returns to its pool only after this H2D. */
  if (l->ext != NULL)
    *released = ofl_disk_extent_destroy_after(l->ext, stream);
  else if (m->test.rules_off & OFL__RULE2_OFF)
    *released = ofl_pool_free(m->host_pool, l->host);
  else
    *released = ofl_pool_free_after(m->host_pool, l->host, stream);
  if (l->host != NULL)
    pin_release(m, l);
  l->host = NULL;
  l->ext = NULL;
  return OFL_SUCCESS;
}

void ofl__tier_drop(ofl_manager_t *m, group_t *g, entry_t *l,
                    ofl__tier_drop_t how) {
  if (l->ext != NULL) {
    if (ofl_disk_extent_destroy_after(l->ext, m->d2h) != OFL_SUCCESS)
      OFL_WARN(OFL_SUBSYS_PIPELINE,
               "rank %d group %s: disk extent not released", m->rank,
               ofl__gname(m, g));
    l->ext = NULL;
    if (how != OFL__TIER_DROP) {
      m->st.disk_tensors--;
      m->st.disk_bytes -= l->span;
      g->warm_disk_bytes -= m->warmup ? l->span : 0;
    }
  }
  if (l->host != NULL) {
    if (how == OFL__TIER_DROP) {
      /* Its D2H may still be queued: reuse waits for the offload event. */
      if (ofl_pool_free_after_event(m->host_pool, l->host, g->offload_ev) !=
          OFL_SUCCESS)
        OFL_WARN(OFL_SUBSYS_PIPELINE,
                 "rank %d group %s: pinned copy not returned to its pool",
                 m->rank, ofl__gname(m, g));
    } else if (how == OFL__TIER_UNDO_UNRECORDED ||
               ofl_pool_free_after_event(m->host_pool, l->host,
                                         g->offload_ev) != OFL_SUCCESS) {
      (void)ofl_stream_synchronize(m->d2h, OFL_TIMEOUT_DEFAULT);
      ofl_pool_free(m->host_pool, l->host);
    }
    pin_release(m, l);
    l->host = NULL;
  }
}

/* Starts the disk reads of the groups that follow the next one in reload
 * order (OFL_DISK_PREFETCH groups), so their bytes are in memory when their
 * H2D is issued. */
void ofl__tier_read_ahead(ofl_manager_t *m, const chunk_t *c) {
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
