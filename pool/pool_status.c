/* ofl: what a pool reports: its counters, the status of a key, the list of
 * its keys; and its budget. */
#include <stdlib.h>
#include <string.h>

#include "pool/block.h"
#include "runtime/internal.h"

ofl_status_t ofl_pool_set_budget(ofl_pool_t *pool, size_t budget_bytes) {
  if (pool == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_set_budget: pool is NULL");
  pthread_mutex_lock(&pool->mu);
  pool->stats.budget_bytes = budget_bytes;
  pthread_mutex_unlock(&pool->mu);
  return OFL_SUCCESS;
}

/* ---- status -------------------------------------------------------------- */

void ofl_pool_get_stats(const ofl_pool_t *pool, ofl_pool_stats_t *out) {
  if (pool == NULL || out == NULL)
    return;
  ofl_pool_t *p = (ofl_pool_t *)pool;
  pthread_mutex_lock(&p->mu);
  *out = p->stats;
  out->held_bytes = ofl__pool_held(p);
  out->cached_bytes = p->stats.total_bytes - p->stats.in_use_bytes;
  out->segment_bytes = p->arena.held_bytes;
  out->segments = p->arena.nsegs;
  out->iterations = p->cycles;
  out->learned_iteration = p->learned_cycle;
  out->placement_slots = p->plan.active ? p->plan.nslots : 0;
  out->placement_bytes = p->plan.active ? p->plan.bytes : 0;
  out->placement_misses = p->plan.misses;
  pthread_mutex_unlock(&p->mu);
}

void ofl_pool_reset_peak(ofl_pool_t *pool) {
  if (pool == NULL)
    return;
  pthread_mutex_lock(&pool->mu);
  pool->stats.peak_in_use_bytes = pool->stats.in_use_bytes;
  pool->stats.peak_taken_bytes = pool->in_use_need;
  pthread_mutex_unlock(&pool->mu);
}

static ofl_pool_key_status_t status_of(const pool_key_t *k) {
  ofl_pool_key_status_t r;
  r.block_bytes = k->block_bytes;
  r.total = k->total;
  r.allocated = k->allocated;
  r.free = k->nfree;
  r.utilization =
      k->total ? 100.0 * (double)k->allocated / (double)k->total : 0.0;
  return r;
}

ofl_status_t ofl_pool_list_keys(const ofl_pool_t *pool,
                                ofl_pool_key_info_t *out, size_t cap,
                                size_t *count) {
  if (pool == NULL || count == NULL || (out == NULL && cap > 0))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_list_keys: pool and count must not be NULL, "
                      "nor out when cap > 0");
  ofl_pool_t *p = (ofl_pool_t *)pool;
  size_t n = 0;
  pthread_mutex_lock(&p->mu);
  for (const pool_key_t *k = p->keys; k != NULL; k = k->lnext, ++n) {
    if (n >= cap)
      continue;
    ofl_pool_key_info_t *ki = &out[n];
    memset(ki, 0, sizeof *ki);
    ki->dynamic = k->dynamic;
    ki->ndim = k->ndim;
    ki->dtype = k->dtype;
    memcpy(ki->shape, k->shape, sizeof ki->shape);
    ki->status = status_of(k);
  }
  pthread_mutex_unlock(&p->mu);
  *count = n;
  return OFL_SUCCESS;
}

static ofl_status_t key_status(const ofl_pool_t *pool, bool dynamic,
                               const int64_t *shape, int ndim,
                               ofl_dtype_t dtype, size_t bytes,
                               ofl_pool_key_status_t *out) {
  ofl_pool_t *p = (ofl_pool_t *)pool;
  pthread_mutex_lock(&p->mu);
  pool_key_t *k = ofl__key_find(p, dynamic, shape, ndim, dtype, bytes);
  ofl_pool_key_status_t r = {0, 0, 0, 0, 0.0};
  if (k != NULL)
    r = status_of(k);
  pthread_mutex_unlock(&p->mu);
  if (k == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s has no key for %s; it was never allocated "
                      "(or was cleared)",
                      pool->name,
                      dynamic ? "these bytes"
                              : "this shape and "
                                "dtype");
  *out = r;
  return OFL_SUCCESS;
}

ofl_status_t ofl_pool_key_status(const ofl_pool_t *pool, const int64_t *shape,
                                 int ndim, ofl_dtype_t dtype,
                                 ofl_pool_key_status_t *out) {
  size_t bytes;
  if (pool == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_key_status: pool and out must not be NULL");
  OFL_CHECK(ofl_shape_bytes(shape, ndim, dtype, &bytes));
  return key_status(pool, false, shape, ndim, dtype, bytes, out);
}

ofl_status_t ofl_pool_dynamic_key_status(const ofl_pool_t *pool, size_t bytes,
                                         ofl_pool_key_status_t *out) {
  if (pool == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_dynamic_key_status: pool and out must not be "
                      "NULL");
  size_t kb = (bytes + OFL_POOL_PAGE_BYTES - 1) & ~(OFL_POOL_PAGE_BYTES - 1);
  if (kb == 0)
    kb = OFL_POOL_PAGE_BYTES;
  return key_status(pool, true, NULL, 0, OFL_DTYPE_U8, kb, out);
}
