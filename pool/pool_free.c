/* ofl: blocks coming back to a pool: frees (plain, stream-ordered, after an
 * event), ownership, and the end-of-iteration calls reset and clear. */
#include <stdio.h>
#include <stdlib.h>

#include "pool/block.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"

/* ---- release ------------------------------------------------------------- */

/* Lock held: why t cannot be released into expect, or OFL_SUCCESS. */
static ofl_status_t release_check(const ofl_pool_t *expect,
                                  const ofl_tensor_t *t) {
  const char *pn = expect != NULL ? expect->name : "";
  if (t->state != OFL__TENSOR_LIVE)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s: tensor %p was already freed (double free)", pn,
                      (const void *)t);
  if (t->st == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s: tensor %p has no storage (already freed or "
                      "released)",
                      pn, (const void *)t);
  if (t->st->kind != OFL__STORAGE_BLOCK)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s: tensor %p wraps external memory, not a pool "
                      "block; end it with ofl_tensor_destroy",
                      pn, (const void *)t);
  const pool_block_t *b = (const pool_block_t *)t->st;
  if (expect != NULL && b->pool != expect)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s: tensor %p belongs to pool %s; free it there",
                      pn, (const void *)t, b->pool->name);
  if (t->st_gen != b->st.gen || !b->held)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s: tensor %p is stale: its block was reclaimed "
                      "by ofl_pool_reset or already freed",
                      b->pool->name, (const void *)t);
  return OFL_SUCCESS;
}

ofl_status_t ofl__pool_release(ofl_pool_t *expect, ofl_tensor_t *t,
                               ofl_stream_t *stream, bool end_handle) {
  if (t == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s: tensor is NULL", expect ? expect->name : "");
  /* The block's pool; for an unchecked release the handle names it. */
  ofl_pool_t *p = expect;
  if (p == NULL) {
    if (t->state != OFL__TENSOR_LIVE || t->st == NULL ||
        t->st->kind != OFL__STORAGE_BLOCK)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                        "tensor %p has no pool block to release", (void *)t);
    p = ((pool_block_t *)t->st)->pool;
  }
  pthread_mutex_lock(&p->mu);
  ofl_status_t s = release_check(expect, t);
  if (s != OFL_SUCCESS && expect == NULL && t->state == OFL__TENSOR_LIVE &&
      t->st != NULL) {
    /* A stale handle (reset reclaimed its block): it just lets go. */
    t->st = NULL;
    t->data = NULL;
    t->loc = OFL_LOC_NONE;
    s = OFL_SUCCESS;
    if (end_handle) {
      pthread_mutex_unlock(&p->mu);
      goto end;
    }
    pthread_mutex_unlock(&p->mu);
    return s;
  }
  if (s != OFL_SUCCESS) {
    pthread_mutex_unlock(&p->mu);
    return s;
  }
  pool_block_t *b = (pool_block_t *)t->st;
  bool last = atomic_load(&b->st.refs) == 1;
  if (last && stream == NULL && p->strict) {
    /* An ordered release (a view's) recorded the block's event after its
     * queued uses: those are over once it completes. Other uses still
     * queued (on other streams) make the free an error. */
    if (atomic_load(&b->pending)) {
      pthread_mutex_unlock(&p->mu);
      (void)ofl__block_quiesce(b);
      pthread_mutex_lock(&p->mu);
      s = release_check(expect, t);
      if (s != OFL_SUCCESS) {
        pthread_mutex_unlock(&p->mu);
        return s;
      }
      last = atomic_load(&b->st.refs) == 1;
    }
    size_t n = last ? ofl__device_inflight(p->dev, b->st.base, b->st.bytes) : 0;
    if (n > 0) {
      pthread_mutex_unlock(&p->mu);
      return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_POOL,
                        "pool %s: block %p is still used by %zu queued "
                        "operations; free it with ofl_pool_free_after on "
                        "the stream of its last use",
                        p->name, b->st.base, n);
    }
  }
  uint32_t gen = b->st.gen;
  pthread_mutex_unlock(&p->mu);

  if (stream != NULL) {
    s = ofl__block_order(p, b, stream, last);
    if (s != OFL_SUCCESS)
      return s; /* nothing changed: the handle still holds the block */
  } else if (last && p->strict) {
    ofl__device_poison(p->dev, b->st.base, b->st.bytes);
  }

  pthread_mutex_lock(&p->mu);
  t->st = NULL;
  t->data = NULL;
  t->offset = 0;
  t->loc = OFL_LOC_NONE;
  /* A reset between the two locks already made the block free. */
  if (b->st.gen == gen && b->held && atomic_fetch_sub(&b->st.refs, 1) == 1) {
    b->held = false;
    b->key->allocated--;
    p->stats.frees++;
    p->stats.blocks_in_use--;
    ofl__pool_in_use_sub(p, b);
    ofl__free_push(b->key, b);
    ofl__place_note_free(p, b);
  }
  /* The last block of a pool whose owner is gone: the pool goes now. */
  bool finish = p->doomed && p->stats.blocks_in_use == 0;
  if (finish)
    p->doomed = false;
  if (end_handle && t->home == p) {
    ofl__handle_cache_push(p, t);
    end_handle = false;
  }
  pthread_mutex_unlock(&p->mu);
  if (finish) {
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: its last block came back; the pool is destroyed",
             p->name);
    ofl__pool_finish(p);
  }
end:
  if (end_handle) {
    if (t->home != NULL) {
      ofl__pool_handle_put(t);
    } else {
      t->state = OFL__TENSOR_DEAD;
      free(t);
    }
  }
  return OFL_SUCCESS;
}

ofl_status_t ofl__pool_block_ref(const ofl_tensor_t *t) {
  pool_block_t *b = (pool_block_t *)t->st;
  ofl_pool_t *p = b->pool;
  pthread_mutex_lock(&p->mu);
  ofl_status_t s = release_check(NULL, t);
  if (s == OFL_SUCCESS)
    atomic_fetch_add(&b->st.refs, 1);
  pthread_mutex_unlock(&p->mu);
  return s;
}

/* A handle on a block lets go through its storage (pool/tensor.c): the
 * pool the handle names takes it back. */
static ofl_status_t block_storage_release(ofl_tensor_t *t, ofl_stream_t *stream,
                                          bool end_handle) {
  return ofl__pool_release(NULL, t, stream, end_handle);
}

const ofl__storage_ops_t ofl__block_storage_ops = {
    .release = block_storage_release,
    .ref = ofl__pool_block_ref,
};

ofl_status_t ofl_pool_free(ofl_pool_t *pool, ofl_tensor_t *t) {
  if (pool == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_free: pool is NULL");
  return ofl__pool_release(pool, t, NULL, true);
}

ofl_status_t ofl_pool_free_after(ofl_pool_t *pool, ofl_tensor_t *t,
                                 ofl_stream_t *stream) {
  if (pool == NULL || stream == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_free_after: pool and stream must not be NULL "
                      "(use ofl_pool_free for an unordered free)");
  return ofl__pool_release(pool, t, stream, true);
}

static ofl_status_t order_stream_get(ofl_pool_t *p, ofl_stream_t **out) {
  ofl_status_t s = OFL_SUCCESS;
  pthread_mutex_lock(&p->order_stream_mu);
  if (p->order_stream == NULL) {
    char name[48];
    snprintf(name, sizeof name, "pool-%s-order", p->name);
    s = ofl_stream_create(p->dev, name, &p->order_stream);
  }
  if (s == OFL_SUCCESS)
    *out = p->order_stream;
  pthread_mutex_unlock(&p->order_stream_mu);
  return s;
}

ofl_status_t ofl_pool_free_after_event(ofl_pool_t *pool, ofl_tensor_t *t,
                                       ofl_event_t *last_use) {
  if (pool == NULL || last_use == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_free_after_event: pool and event must not be "
                      "NULL");
  pthread_mutex_lock(&pool->mu);
  ofl_status_t s = release_check(pool, t);
  pthread_mutex_unlock(&pool->mu);
  if (s != OFL_SUCCESS)
    return s;
  ofl_stream_t *os;
  OFL_CHECK(order_stream_get(pool, &os));
  /* The wait captures the event's current record, so the caller may record
   * it again at once; the block's own event then follows it on os. */
  OFL_CHECK(ofl_stream_wait_event(os, last_use));
  return ofl__pool_release(pool, t, os, true);
}

int ofl_pool_owns(const ofl_pool_t *pool, const ofl_tensor_t *t) {
  if (pool == NULL || t == NULL || t->state != OFL__TENSOR_LIVE ||
      t->st == NULL || t->st->kind != OFL__STORAGE_BLOCK)
    return 0;
  const pool_block_t *b = (const pool_block_t *)t->st;
  if (b->pool != pool)
    return 0;
  ofl_pool_t *p = (ofl_pool_t *)pool;
  pthread_mutex_lock(&p->mu);
  int own = b->held && t->st_gen == b->st.gen;
  pthread_mutex_unlock(&p->mu);
  return own;
}

ofl_pool_t *ofl_tensor_pool(const ofl_tensor_t *t) {
  if (t == NULL || t->st == NULL || t->st->kind != OFL__STORAGE_BLOCK)
    return NULL;
  return ((const pool_block_t *)t->st)->pool;
}

/* ---- reset / clear ------------------------------------------------------- */

ofl_status_t ofl_pool_reset(ofl_pool_t *pool) {
  if (pool == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_reset: pool is NULL");
  ofl_pool_t *p = pool;
  pthread_mutex_lock(&p->mu);
  uint64_t reclaimed = 0;
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext) {
    /* Every block free again, in creation order (the reference refills its
     * free deque from its list of all tensors). */
    k->free_head = k->free_tail = NULL;
    k->nfree = 0;
    for (pool_block_t *b = k->all_head; b != NULL; b = b->key_next) {
      if (b->held) {
        b->held = false;
        b->st.gen++; /* handles still on it are stale now */
        atomic_store(&b->st.refs, 0);
        reclaimed++;
      }
      ofl__free_push(k, b);
    }
    k->allocated = 0;
  }
  p->stats.blocks_in_use = 0;
  p->stats.in_use_bytes = 0;
  p->in_use_need = 0;
  pthread_mutex_unlock(&p->mu);
  if (reclaimed > 0)
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s reset reclaimed %llu blocks still held; their handles "
             "are stale",
             p->name, (unsigned long long)reclaimed);
  return OFL_SUCCESS;
}

/* Lock held: takes every free block off its key for clear; in reserve
 * blocks are counted out of the reserve. */
static pool_block_t *take_free_blocks(ofl_pool_t *p) {
  pool_block_t *victims = NULL;
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext) {
    pool_block_t *b;
    while ((b = k->free_head) != NULL) {
      ofl__free_unlink(k, NULL, b);
      ofl__key_forget(p, b);
      b->next = victims;
      victims = b;
    }
  }
  return victims;
}

ofl_status_t ofl_pool_clear(ofl_pool_t *pool) {
  if (pool == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_clear: pool is NULL");
  ofl_pool_t *p = pool;
  pthread_mutex_lock(&p->mu);
  ofl__place_drop(p); /* its slots' memory goes too */
  pool_block_t *victims = take_free_blocks(p);
  pthread_mutex_unlock(&p->mu);

  /* Wait for queued last uses before the memory goes (section 5 rule 2). */
  ofl_status_t st = OFL_SUCCESS;
  while (victims != NULL) {
    pool_block_t *b = victims;
    victims = b->next;
    if (!ofl__block_quiesce(b)) {
      st = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_POOL,
                      "pool %s: block %p still used by a queued operation "
                      "after OFL_WAIT_TIMEOUT_MS; kept in the pool",
                      p->name, b->st.base);
      ofl__block_relink(p, b);
      continue;
    }
    ofl__block_destroy(p, b);
  }

  /* The reserve once nothing is carved from it, and empty segments. */
  void *reserve = NULL;
  size_t seg_bytes = 0;
  pthread_mutex_lock(&p->mu);
  if (p->reserve != NULL && p->reserve_live == 0) {
    reserve = p->reserve;
    p->reserve = NULL;
    p->reserve_bytes = p->reserve_used = 0;
  }
  ofl__segment_t *segs = ofl__arena_take_idle(&p->arena, &seg_bytes);
  ofl__keys_prune(p);
  pthread_mutex_unlock(&p->mu);
  uint64_t n = ofl__arena_free_segments(&p->arena, segs);
  if (reserve != NULL && ofl__arena_backend_free(&p->arena, reserve))
    n++;
  pthread_mutex_lock(&p->mu);
  p->stats.backend_frees += n;
  pthread_mutex_unlock(&p->mu);
  return st;
}
