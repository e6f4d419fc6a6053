/* ofl: block bookkeeping shared by the keyed pool and its memory
 * (pool/block.h): the key table, free lists, block headers, and the events
 * that order a block's reuse after its last use (docs/DESIGN.md section 5
 * rule 2). */
#include <stdlib.h>

#include "pool/block.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"
#include "runtime/queue.h"

/* ---- keys ---------------------------------------------------------------- */

static uint64_t key_hash(bool dynamic, const int64_t *shape, int ndim,
                         ofl_dtype_t dtype, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  if (dynamic)
    return (h ^ bytes) * 1099511628211ull ^ 0x9e3779b97f4a7c15ull;
  h = (h ^ (uint64_t)dtype) * 1099511628211ull;
  h = (h ^ (uint64_t)ndim) * 1099511628211ull;
  for (int i = 0; i < ndim; ++i)
    h = (h ^ (uint64_t)shape[i]) * 1099511628211ull;
  return h;
}

static bool key_equal(const pool_key_t *k, uint64_t hash, bool dynamic,
                      const int64_t *shape, int ndim, ofl_dtype_t dtype,
                      size_t bytes) {
  if (k->hash != hash || k->dynamic != dynamic)
    return false;
  if (dynamic)
    return k->block_bytes == bytes;
  if (k->dtype != dtype || k->ndim != ndim)
    return false;
  for (int i = 0; i < ndim; ++i)
    if (k->shape[i] != shape[i])
      return false;
  return true;
}

pool_key_t *ofl__key_find(const ofl_pool_t *p, bool dynamic,
                          const int64_t *shape, int ndim, ofl_dtype_t dtype,
                          size_t bytes) {
  uint64_t h = key_hash(dynamic, shape, ndim, dtype, bytes);
  for (pool_key_t *k = p->buckets[h % OFL__POOL_NBUCKETS]; k != NULL;
       k = k->hnext)
    if (key_equal(k, h, dynamic, shape, ndim, dtype, bytes))
      return k;
  return NULL;
}

pool_key_t *ofl__key_get(ofl_pool_t *p, bool dynamic, const int64_t *shape,
                         int ndim, ofl_dtype_t dtype, size_t bytes) {
  pool_key_t *k = ofl__key_find(p, dynamic, shape, ndim, dtype, bytes);
  if (k != NULL)
    return k;
  k = calloc(1, sizeof *k);
  if (k == NULL)
    return NULL;
  k->hash = key_hash(dynamic, shape, ndim, dtype, bytes);
  k->dynamic = dynamic;
  p->byte_keys_made += dynamic;
  p->keys_made++;
  k->block_bytes = bytes;
  if (!dynamic) {
    k->dtype = dtype;
    k->ndim = ndim;
    for (int i = 0; i < ndim; ++i)
      k->shape[i] = shape[i];
  }
  k->hnext = p->buckets[k->hash % OFL__POOL_NBUCKETS];
  p->buckets[k->hash % OFL__POOL_NBUCKETS] = k;
  k->lnext = p->keys;
  p->keys = k;
  return k;
}

void ofl__key_unlink(ofl_pool_t *p, pool_key_t *k) {
  pool_key_t **pp = &p->buckets[k->hash % OFL__POOL_NBUCKETS];
  while (*pp != k)
    pp = &(*pp)->hnext;
  *pp = k->hnext;
  pp = &p->keys;
  while (*pp != k)
    pp = &(*pp)->lnext;
  *pp = k->lnext;
}

void ofl__keys_prune(ofl_pool_t *p) {
  pool_key_t *k = p->keys;
  while (k != NULL) {
    pool_key_t *kn = k->lnext;
    if (k->total == 0 && k->creating == 0) {
      ofl__key_unlink(p, k);
      free(k);
    }
    k = kn;
  }
}

void ofl__free_push(pool_key_t *k, pool_block_t *b) {
  OFL_FIFO_PUSH(k->free_head, k->free_tail, b, next);
  k->nfree++;
}

void ofl__free_unlink(pool_key_t *k, pool_block_t *prev, pool_block_t *b) {
  OFL_FIFO_REMOVE(k->free_head, k->free_tail, prev, b, next);
  k->nfree--;
}

void ofl__key_forget(ofl_pool_t *p, pool_block_t *b) {
  pool_key_t *k = b->key;
  pool_block_t *prev = NULL;
  for (pool_block_t *x = k->all_head; x != b; prev = x, x = x->key_next) {
  }
  OFL_FIFO_REMOVE(k->all_head, k->all_tail, prev, b, key_next);
  k->total--;
  p->stats.blocks_total--;
  p->stats.total_bytes -= b->st.bytes;
  if (b->carved) {
    p->reserve_live--;
    p->carved_bytes -= b->st.bytes;
  } else if (b->range == NULL) {
    p->own_bytes -= b->st.bytes;
  }
}

bool ofl__block_idle(pool_block_t *b) {
  return !b->carved &&
         (!atomic_load(&b->pending) || ofl_event_query(b->ev) == OFL_SUCCESS);
}

/* ---- headers ------------------------------------------------------------- */

/* A spare header (its generation moves on; its pool, kind, lock and event
 * stay, since stale handles may read them at any time) or a new one. */
pool_block_t *ofl__header_take(ofl_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  pool_block_t *b = p->spare_headers;
  if (b != NULL) {
    p->spare_headers = b->next;
    b->st.gen++;
    b->next = b->key_next = NULL;
    b->key = NULL;
    b->held = b->carved = false;
    b->range = NULL;
    b->alloc_stream = NULL;
    b->slot1 = 0;
    b->ord_seq = 0;
  }
  pthread_mutex_unlock(&p->mu);
  if (b == NULL && (b = calloc(1, sizeof *b)) != NULL) {
    pthread_mutex_init(&b->order_mu, NULL);
    b->pool = p;
    b->st.kind = OFL__STORAGE_BLOCK;
  }
  return b;
}

/* b goes to the spare headers; handles still on it are stale from here. */
void ofl__header_retire(ofl_pool_t *p, pool_block_t *b) {
  pthread_mutex_lock(&p->mu);
  b->st.gen++;
  b->st.base = NULL;
  b->held = false;
  b->next = p->spare_headers;
  p->spare_headers = b;
  pthread_mutex_unlock(&p->mu);
}

void ofl__block_destroy(ofl_pool_t *p, pool_block_t *b) {
  if (b->range != NULL) {
    pthread_mutex_lock(&p->mu);
    if (b->slot1 != 0) /* the plan keeps its slot's range reserved */
      p->plan.slots[b->slot1 - 1].block = NULL;
    else
      ofl__arena_give(&p->arena, b->range);
    b->slot1 = 0;
    b->range = NULL;
    pthread_mutex_unlock(&p->mu);
  } else if (!b->carved && b->st.base != NULL && p->has_allocator) {
    /* Every caller waited for the block's last use first (section 5 rule
     * 2), so the application may reuse the memory at once. */
    p->allocator.free(p->allocator.ctx, b->st.base, b->st.bytes,
                      b->alloc_stream);
    pthread_mutex_lock(&p->mu);
    p->stats.backend_frees++;
    pthread_mutex_unlock(&p->mu);
  } else if (!b->carved && b->st.base != NULL) {
    ofl_status_t s = p->kind == OFL_POOL_PINNED
                         ? ofl_pinned_free(p->dev, b->st.base)
                         : ofl_device_free(p->dev, b->st.base);
    if (s == OFL_SUCCESS) {
      pthread_mutex_lock(&p->mu);
      p->stats.backend_frees++;
      pthread_mutex_unlock(&p->mu);
    }
  }
  /* The event stays with the header for the next block made on it: its
   * last record is over (every caller waited for the last use, but the
   * pool's destruction, after which nothing is made), and a pool
   * that gives its cached blocks' ranges back at every idle point
   * (restart_due, pool.c) would otherwise create and destroy one per
   * block and iteration. The pool's destruction destroys it. */
  atomic_store(&b->pending, false);
  ofl__header_retire(p, b);
}

void ofl__block_relink(ofl_pool_t *p, pool_block_t *b) {
  pthread_mutex_lock(&p->mu);
  pool_key_t *k = b->key;
  OFL_FIFO_PUSH(k->all_head, k->all_tail, b, key_next);
  k->total++;
  p->stats.blocks_total++;
  p->stats.total_bytes += b->st.bytes;
  if (b->carved) {
    p->reserve_live++;
    p->carved_bytes += b->st.bytes;
  } else if (b->range == NULL) {
    p->own_bytes += b->st.bytes;
  }
  ofl__free_push(k, b);
  pthread_mutex_unlock(&p->mu);
}

/* ---- stream-ordered reuse ------------------------------------------------ */

bool ofl__block_quiesce(pool_block_t *b) {
  if (b->ev == NULL || !atomic_load(&b->pending))
    return true;
  if (ofl_event_synchronize(b->ev, OFL_TIMEOUT_DEFAULT) != OFL_SUCCESS)
    return false;
  atomic_store(&b->pending, false);
  return true;
}

ofl_status_t ofl__block_order(ofl_pool_t *p, pool_block_t *b,
                              ofl_stream_t *stream, bool last) {
  ofl_status_t s = OFL_SUCCESS;
  pthread_mutex_lock(&b->order_mu);
  if (b->ev == NULL)
    s = ofl_event_create(p->dev, &b->ev);
  if (s == OFL_SUCCESS && atomic_load(&b->pending))
    s = ofl_stream_wait_event(stream, b->ev);
  if (s == OFL_SUCCESS && last && p->strict)
    s = ofl_memset_async(b->st.base, OFL__POISON_BYTE, b->st.bytes, stream);
  if (s == OFL_SUCCESS)
    s = ofl_event_record(b->ev, stream);
  if (s == OFL_SUCCESS)
    atomic_store(&b->pending, true);
  pthread_mutex_unlock(&b->order_mu);
  return s;
}

/* ---- bytes in use (block.h) ---------------------------------------------- */

void ofl__pool_in_use_add(ofl_pool_t *p, pool_block_t *b) {
  /* A carved block takes its range: whole granules, or the whole cached
   * range of another key it reused (reuse_pending). In a plan's slot, whose
   * range is the slot's, its own granules: the plan counts the slots. */
  if (b->range == NULL)
    b->need = b->st.bytes;
  else if (b->slot1 != 0)
    b->need = ofl__arena_need(&p->arena, b->st.bytes);
  else
    b->need = b->range->bytes;
  p->stats.in_use_bytes += b->st.bytes;
  p->in_use_need += b->need;
  if (p->stats.in_use_bytes > p->stats.peak_in_use_bytes)
    p->stats.peak_in_use_bytes = p->stats.in_use_bytes;
  size_t n = p->in_use_need;
  if (n > p->stats.peak_taken_bytes)
    p->stats.peak_taken_bytes = n;
  if (n > p->most_in_use_bytes)
    p->most_in_use_bytes = n;
  if (n > p->cycle_most_bytes)
    p->cycle_most_bytes = n;
}

void ofl__pool_in_use_sub(ofl_pool_t *p, pool_block_t *b) {
  p->stats.in_use_bytes -= b->st.bytes;
  p->in_use_need -= b->need;
  b->need = 0;
}
