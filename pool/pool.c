/* ofl: the keyed pool (the reference pool's contract: exact key, FIFO free
 * list, hits and misses, reset, clear) with O(1) ownership through a
 * host-memory block header, byte-size keys, a budget, a reserve and
 * stream-ordered reuse (docs/DESIGN.md section 4): creation, handles and
 * allocation. Blocks come back in pool/pool_free.c; their memory comes from
 * pool/reclaim.c (segments of pool/arena.c, or the backend); the shared
 * bookkeeping is pool/block.c. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool/block.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"
#include "runtime/queue.h"

/* ---- create / destroy ---------------------------------------------------- */

static ofl_status_t budget_from_env(ofl_pool_kind_t kind, size_t *out) {
  return ofl__config_size(kind == OFL_POOL_PINNED ? "OFL_HOST_BUDGET"
                                                  : "OFL_DEVICE_POOL_BUDGET",
                          out);
}

/* params.allocator (pool.h): complete, without a reserve or forced
 * segments, and on the host backend a device pool needs the device to take
 * the application's memory as its own. */
static ofl_status_t check_allocator(ofl_device_t *dev,
                                    const ofl_pool_params_t *prm) {
  const ofl_allocator_t *a = prm->allocator;
  if (a == NULL)
    return OFL_SUCCESS;
  if (a->alloc == NULL || a->free == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: the allocator's alloc and free must "
                      "not be NULL");
  if (prm->reserve_bytes != 0 || prm->segments == OFL_POOL_SEGMENTS_ALL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: a pool with an allocator takes one "
                      "block per allocator call: reserve_bytes must be 0 and "
                      "segments not OFL_POOL_SEGMENTS_ALL");
  /* A fresh heap address lies in no block of ofl's: the device owns it
   * only when it adopts the application's memory. */
  if (prm->kind != OFL_POOL_DEVICE ||
      ofl_device_backend(dev) != OFL_BACKEND_HOST)
    return OFL_SUCCESS;
  void *probe = malloc(1);
  bool adopted = probe != NULL && ofl__device_owns(dev, probe, 1);
  free(probe);
  if (!adopted)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: a device pool with an allocator on "
                      "the host backend needs the device to take the "
                      "application's memory as device memory: call "
                      "ofl_device_adopt_host_memory(dev, 1) first");
  return OFL_SUCCESS;
}

ofl_status_t ofl_pool_create(ofl_device_t *dev, const ofl_pool_params_t *params,
                             ofl_pool_t **out) {
  ofl_pool_params_t prm = OFL_POOL_PARAMS_INIT;
  if (params != NULL)
    prm = *params;
  if (dev == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: dev and out must not be NULL");
  if (prm.segments < OFL_POOL_SEGMENTS_OFF ||
      prm.segments > OFL_POOL_SEGMENTS_ALL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: segments %d is not an "
                      "ofl_pool_segments_t",
                      (int)prm.segments);
  if (prm.kind != OFL_POOL_DEVICE && prm.kind != OFL_POOL_PINNED)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: kind %d is not OFL_POOL_DEVICE or "
                      "OFL_POOL_PINNED",
                      (int)prm.kind);
  OFL_CHECK(check_allocator(dev, &prm));
  size_t budget = prm.budget_bytes;
  if (budget == OFL_POOL_BUDGET_FROM_ENV)
    OFL_CHECK(budget_from_env(prm.kind, &budget));
  if (budget != 0 && prm.reserve_bytes > budget)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: reserve %zu bytes exceeds the budget "
                      "%zu bytes; lower the reserve or raise the budget",
                      prm.reserve_bytes, budget);
  ofl_pool_t *p = calloc(1, sizeof *p);
  if (p == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                      "cannot allocate a pool");
  pthread_mutex_init(&p->mu, NULL);
  pthread_mutex_init(&p->order_stream_mu, NULL);
  p->dev = dev;
  p->kind = prm.kind;
  p->loc = prm.kind == OFL_POOL_PINNED ? OFL_LOC_PINNED : OFL_LOC_DEVICE;
  p->strict = ofl_device_is_strict(dev) != 0;
  p->evict = prm.evict != 0;
  p->segments = prm.segments;
  if (prm.allocator != NULL) { /* one allocator call per block */
    p->has_allocator = true;
    p->allocator = *prm.allocator;
    p->segments = OFL_POOL_SEGMENTS_OFF;
  }
  snprintf(p->name, sizeof p->name, "%s",
           prm.name != NULL
               ? prm.name
               : (prm.kind == OFL_POOL_PINNED ? "pinned" : "device"));
  p->stats.budget_bytes = budget;
  ofl__arena_init(&p->arena, dev, prm.kind);
  ofl__place_init(p);
  if (prm.reserve_bytes > 0) {
    ofl_status_t s =
        ofl__arena_backend_alloc(&p->arena, prm.reserve_bytes, &p->reserve);
    if (s != OFL_SUCCESS) {
      pthread_mutex_destroy(&p->order_stream_mu);
      pthread_mutex_destroy(&p->mu);
      free(p);
      return s;
    }
    p->reserve_bytes = prm.reserve_bytes;
    p->stats.reserve_bytes = prm.reserve_bytes;
    p->stats.backend_allocs = 1;
  }
  ofl__pool_register(p);
  ofl__device_pool_created(dev);
  OFL_INFO(OFL_SUBSYS_POOL, "pool %s created kind %s budget %zu reserve %zu",
           p->name, prm.kind == OFL_POOL_PINNED ? "pinned" : "device", budget,
           prm.reserve_bytes);
  *out = p;
  return OFL_SUCCESS;
}

void ofl_pool_destroy(ofl_pool_t *pool) {
  if (pool == NULL)
    return;
  ofl_pool_t *p = pool;
  ofl__pool_unregister(p); /* no out-of-memory retry reaches it from here */
  if (p->stats.blocks_in_use > 0)
    OFL_WARN(OFL_SUBSYS_POOL,
             "pool %s destroyed with %llu blocks still held (%zu bytes); "
             "the handles on them must not be used",
             p->name, (unsigned long long)p->stats.blocks_in_use,
             p->stats.in_use_bytes);
  if (p->order_stream != NULL)
    ofl_stream_destroy(p->order_stream); /* drains the block records on it */
  pool_key_t *k = p->keys;
  while (k != NULL) {
    pool_key_t *kn = k->lnext;
    pool_block_t *b = k->all_head;
    while (b != NULL) {
      pool_block_t *bn = b->key_next;
      bool over = ofl__block_quiesce(b);
      if (!over && p->has_allocator) {
        /* The allocator's free promises the use is over: leave it. */
        OFL_WARN(OFL_SUBSYS_POOL,
                 "pool %s: last use of block %p did not complete; not "
                 "given back to the allocator at destroy",
                 p->name, b->st.base);
        b->st.base = NULL;
      } else if (!over) {
        OFL_WARN(OFL_SUBSYS_POOL,
                 "pool %s: last use of block %p did not complete; freeing "
                 "it anyway at destroy",
                 p->name, b->st.base);
      }
      ofl__block_destroy(p, b);
      b = bn;
    }
    free(k);
    k = kn;
  }
  if (p->reserve != NULL)
    (void)ofl__arena_backend_free(&p->arena, p->reserve);
  ofl__place_free(p);
  (void)ofl__arena_destroy(&p->arena);
  while (p->spare_headers != NULL) {
    pool_block_t *b = p->spare_headers;
    p->spare_headers = b->next;
    if (b->ev != NULL)
      ofl_event_destroy(b->ev);
    pthread_mutex_destroy(&b->order_mu);
    free(b);
  }
  ofl_tensor_t *t = p->handles_all;
  while (t != NULL) {
    ofl_tensor_t *tn = t->all_next;
    t->state = OFL__TENSOR_DEAD;
    free(t);
    t = tn;
  }
  pthread_mutex_destroy(&p->order_stream_mu);
  pthread_mutex_destroy(&p->mu);
  ofl_device_t *dev = p->dev;
  free(p);
  ofl__device_pool_destroyed(dev); /* may run a deferred device close */
}

void ofl__pool_finish(ofl_pool_t *p) {
  void (*then)(void *) = p->then;
  void *arg = p->then_arg;
  ofl_pool_destroy(p);
  if (then != NULL)
    then(arg);
}

void ofl__pool_destroy_when_idle(ofl_pool_t *pool, void (*then)(void *),
                                 void *arg) {
  if (pool == NULL) {
    if (then != NULL)
      then(arg);
    return;
  }
  ofl_pool_t *p = pool;
  (void)ofl_pool_clear(p); /* the free blocks' memory goes at once */
  pthread_mutex_lock(&p->mu);
  bool now = p->stats.blocks_in_use == 0;
  if (!now) {
    p->doomed = true;
    p->then = then;
    p->then_arg = arg;
    /* Logged under the lock: once it is dropped, the release of the last
     * block may destroy p on another thread. */
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: %llu blocks still held by tensors handed out; the "
             "pool is destroyed when the last of them is released",
             p->name, (unsigned long long)p->stats.blocks_in_use);
  }
  pthread_mutex_unlock(&p->mu);
  if (now) {
    p->then = then;
    p->then_arg = arg;
    ofl__pool_finish(p);
  }
}

ofl_pool_kind_t ofl_pool_kind(const ofl_pool_t *pool) {
  return pool ? pool->kind : OFL_POOL_DEVICE;
}
ofl_device_t *ofl_pool_device(const ofl_pool_t *pool) {
  return pool ? pool->dev : NULL;
}
const char *ofl_pool_name(const ofl_pool_t *pool) {
  return pool ? pool->name : "";
}
ofl_location_t ofl_pool_location(const ofl_pool_t *pool) {
  return pool ? pool->loc : OFL_LOC_NONE;
}

/* ---- handles ------------------------------------------------------------- */

static void handle_reset(ofl_tensor_t *t, ofl_pool_t *home) {
  t->data = NULL;
  t->offset = 0;
  t->st = NULL;
  t->st_gen = 0;
  t->flags = 0;
  t->loc = OFL_LOC_NONE;
  t->home = home;
  t->owner = NULL;
  t->cache_next = NULL;
  t->state = OFL__TENSOR_LIVE;
}

/* Lock held. */
void ofl__handle_cache_push(ofl_pool_t *p, ofl_tensor_t *t) {
  t->state = OFL__TENSOR_DEAD;
  t->st = NULL;
  t->data = NULL;
  t->owner = NULL;
  t->loc = OFL_LOC_NONE;
  OFL_FIFO_PUSH(p->handle_cache, p->handle_cache_tail, t, cache_next);
  p->handle_cache_n++;
}

void ofl__pool_handle_put(ofl_tensor_t *t) {
  ofl_pool_t *p = t->home;
  pthread_mutex_lock(&p->mu);
  ofl__handle_cache_push(p, t);
  pthread_mutex_unlock(&p->mu);
}

static ofl_tensor_t *handle_make(ofl_pool_t *p) {
  ofl_tensor_t *t = calloc(1, sizeof *t);
  if (t == NULL)
    return NULL;
  pthread_mutex_lock(&p->mu);
  t->all_next = p->handles_all;
  p->handles_all = t;
  pthread_mutex_unlock(&p->mu);
  return t;
}

/* ---- allocation ---------------------------------------------------------- */

/* Lock held: takes a block for the new owner and counts it. */
static void block_take(ofl_pool_t *p, pool_key_t *k, pool_block_t *prev,
                       pool_block_t *b) {
  ofl__free_unlink(k, prev, b);
  b->held = true;
  atomic_store(&b->st.refs, 1);
  k->allocated++;
  p->stats.hits++;
  p->stats.blocks_in_use++;
  ofl__pool_in_use_add(p, b);
}

/* Lock held: undoes block_take (a later step failed). */
static void block_untake(ofl_pool_t *p, pool_key_t *k, pool_block_t *b) {
  b->held = false;
  atomic_store(&b->st.refs, 0);
  k->allocated--;
  p->stats.hits--;
  p->stats.blocks_in_use--;
  ofl__pool_in_use_sub(p, b);
  /* Back at the head: it was the oldest. */
  b->next = k->free_head;
  k->free_head = b;
  if (k->free_tail == NULL)
    k->free_tail = b;
  k->nfree++;
}

typedef enum pick {
  PICK_NONE,  /* nothing usable: create */
  PICK_READY, /* last use complete */
  PICK_WAIT,  /* requester's stream must wait on the block's event */
  PICK_SYNC   /* budget full: wait for the block's last use on the host */
} pick_t;

/* Lock held. Chooses a free block of k following the rules at the top of
 * pool.h (docs/DESIGN.md section 5 rule 2: a block is reused only after the
 * copy that used it has completed). */
static pick_t block_pick(ofl_pool_t *p, pool_key_t *k, ofl_stream_t *stream,
                         pool_block_t **prev_out, pool_block_t **out) {
  pool_block_t *prev = NULL, *oldest = NULL, *oldest_prev = NULL;
  /* A pool whose layout follows its calls alone (ofl__pool_ordered) takes
   * the oldest free block of the key, whether or not its last use is done
   * (a stream wait then): which of two blocks of a key was ready first is
   * timing, and so is where the next miss is carved. */
  bool oldest_only = stream != NULL && ofl__pool_ordered(p);
  for (pool_block_t *b = k->free_head; b != NULL; prev = b, b = b->next) {
    if (b->slot1 != 0) /* kept for its slot's ordinals (pool/plan.c) */
      continue;
    if (!atomic_load(&b->pending) || ofl_event_query(b->ev) == OFL_SUCCESS) {
      atomic_store(&b->pending, false);
      *prev_out = prev;
      *out = b;
      return PICK_READY;
    }
    if (oldest_only) {
      *prev_out = prev;
      *out = b;
      return PICK_WAIT;
    }
    if (oldest == NULL) {
      oldest = b;
      oldest_prev = prev;
    }
    p->stats.pending_skips++;
  }
  if (stream != NULL && oldest != NULL) {
    p->stats.pending_skips--; /* handed out after all */
    *prev_out = oldest_prev;
    *out = oldest;
    return PICK_WAIT;
  }
  return PICK_NONE;
}

/* Lock held: where a block of bytes would start in the reserve; false
 * when the reserve has no room for it. */
static bool reserve_fits(const ofl_pool_t *p, size_t bytes, size_t *off) {
  if (p->reserve == NULL)
    return false;
  *off = (p->reserve_used + OFL__RESERVE_ALIGN - 1) & ~(OFL__RESERVE_ALIGN - 1);
  return *off <= p->reserve_bytes && bytes <= p->reserve_bytes - *off;
}

/* Lock held: memory the pool holds against its budget: the whole reserve,
 * segments, and the blocks of their own (made or being made). */
static size_t budget_used(const ofl_pool_t *p) {
  return ofl__pool_held(p) + p->creating_bytes;
}

static bool budget_allows(const ofl_pool_t *p, size_t bytes) {
  size_t b = p->stats.budget_bytes, off;
  if (b == 0 || reserve_fits(p, bytes, &off))
    return true;
  size_t used = budget_used(p);
  return used <= b && bytes <= b - used;
}

/* Lock held: carves from the reserve; NULL when it has no room. */
static void *reserve_carve(ofl_pool_t *p, size_t bytes) {
  size_t off;
  if (!reserve_fits(p, bytes, &off))
    return NULL;
  p->reserve_used = off + bytes;
  p->reserve_live++;
  p->carved_bytes += bytes;
  return (char *)p->reserve + off;
}

/* Lock held: whether a new block comes from a segment (pool.h). */
static bool from_segment(const ofl_pool_t *p) {
  /* A pool that carves every block (the manager's pinned pool) carves
   * under a budget too, its segments counted against it (reclaim.c): with
   * blocks of their own, sizes that change evicted and made blocks again in
   * every iteration under a tight budget. Other pools with a budget keep
   * blocks of their own, evicted to make room. */
  if (p->segments == OFL_POOL_SEGMENTS_ALL)
    return true;
  if (p->stats.budget_bytes != 0 || p->segments != OFL_POOL_SEGMENTS_AUTO)
    return false;
  /* A device pool from its first byte-keyed block (a caching allocator's):
   * switching at the second size made the first segment wherever that size
   * was first drawn, after the pool learned (a name's sizes within one page
   * through the warmup, two pages later). A pinned one (the disk tier's
   * bounce buffers, of one size) at the second size. */
  if (p->kind == OFL_POOL_DEVICE && p->expects_byte_keys)
    return true;
  return p->byte_keys_made > (p->kind == OFL_POOL_DEVICE ? 0u : 1u);
}

void ofl__pool_expect_byte_keys(ofl_pool_t *p) {
  if (p == NULL || p->kind != OFL_POOL_DEVICE)
    return;
  pthread_mutex_lock(&p->mu);
  p->expects_byte_keys = true;
  pthread_mutex_unlock(&p->mu);
}

/* Lock held. Makes room for bytes by taking free blocks of keys other than
 * k whose last use is over, oldest first per key; returns them in *victims
 * for ofl__block_destroy outside the lock. Takes nothing when that cannot make
 * enough room (the refusal then changes nothing). */
static bool evict_for(ofl_pool_t *p, pool_key_t *k, size_t bytes,
                      pool_block_t **victims) {
  size_t budget = p->stats.budget_bytes;
  size_t used = budget_used(p);
  if (bytes > budget)
    return false;
  size_t need = used + bytes > budget ? used + bytes - budget : 0;
  size_t avail = 0;
  for (pool_key_t *o = p->keys; o != NULL && avail < need; o = o->lnext) {
    if (o == k)
      continue;
    for (pool_block_t *b = o->free_head; b != NULL && avail < need; b = b->next)
      if (ofl__block_idle(b))
        avail += b->st.bytes;
  }
  if (avail < need)
    return false;
  size_t got = 0;
  for (pool_key_t *o = p->keys; o != NULL && got < need; o = o->lnext) {
    if (o == k)
      continue;
    pool_block_t *prev = NULL, *b = o->free_head;
    while (b != NULL && got < need) {
      pool_block_t *next = b->next;
      if (ofl__block_idle(b)) {
        ofl__free_unlink(o, prev, b);
        ofl__key_forget(p, b);
        got += b->st.bytes;
        p->stats.evictions++;
        b->next = *victims;
        *victims = b;
      } else {
        prev = b;
      }
      b = next;
    }
  }
  return true;
}

/* Where the placement plan puts a request (pool/plan.c): on its slot's
 * range (no block there yet), or the free block lying in the slot (off its
 * key); slot1: the slot's index + 1, 0: the plan does not place it. */
typedef struct plan_use {
  ofl__range_t *range;
  pool_block_t *block;
  pool_key_t *old_key; /* block's key before, kept (creating) meanwhile */
  uint32_t slot1, gen;
} plan_use_t;

/* Creates a block of k outside the lock: carved from the reserve, from a
 * segment (seg), or memory of its own, whose budget was already held in
 * creating_bytes. k->creating counts it meanwhile. Lock not held on entry or
 * exit. */
static ofl_status_t block_create(ofl_pool_t *p, pool_key_t *k, void *carved,
                                 bool seg, ofl_stream_t *stream,
                                 const plan_use_t *plan, pool_block_t **out) {
  size_t bytes = k->block_bytes;
  ofl_status_t s = OFL_SUCCESS;
  void *mem = carved;
  ofl__range_t *range = plan->range;
  pool_block_t *b = NULL, *reuse = plan->block;
  if (mem == NULL && range == NULL && reuse == NULL)
    s = ofl__pool_memory(p, bytes > 0 ? bytes : 1, seg, stream, &range, &mem,
                         &reuse);
  if (reuse != NULL) {
    /* Another key's queued block: it keeps its event (still pending, as
     * after a same-key stream wait); handles on its past are stale. */
    b = reuse;
    b->st.gen++;
    range = b->range;
  } else if (s == OFL_SUCCESS && (b = ofl__header_take(p)) == NULL) {
    s = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                   "pool %s: cannot allocate a block header", p->name);
    pthread_mutex_lock(&p->mu);
    if (range != NULL && plan->slot1 != 0 && plan->block == NULL)
      ofl__place_made(p, NULL, range, plan->slot1, plan->gen);
    else if (range != NULL && plan->slot1 == 0)
      ofl__arena_give(&p->arena, range);
    pthread_mutex_unlock(&p->mu);
    if (range == NULL && mem != NULL && carved == NULL && p->has_allocator) {
      p->allocator.free(p->allocator.ctx, mem, bytes > 0 ? bytes : 1, stream);
      pthread_mutex_lock(&p->mu);
      p->stats.backend_frees++;
      pthread_mutex_unlock(&p->mu);
    } else if (range == NULL && mem != NULL && carved == NULL)
      (void)ofl__arena_backend_free(&p->arena, mem);
  }
  if (range != NULL)
    mem = range->base;
  bool own = carved == NULL && !seg;
  pthread_mutex_lock(&p->mu);
  if (own)
    p->creating_bytes -= bytes;
  k->creating--;
  if (s != OFL_SUCCESS) {
    if (carved != NULL) {
      p->reserve_live--;
      p->carved_bytes -= bytes;
    }
    pthread_mutex_unlock(&p->mu);
    if (b != NULL)
      ofl__header_retire(p, b);
    return s;
  }
  b->st.base = mem;
  b->st.bytes = bytes;
  b->st.loc = p->loc;
  b->st.kind = OFL__STORAGE_BLOCK;
  b->st.ops = &ofl__block_storage_ops;
  atomic_init(&b->st.refs, 1);
  if (reuse == NULL)
    atomic_init(&b->pending, false);
  b->pool = p;
  b->key = k;
  b->carved = carved != NULL;
  b->range = range;
  b->alloc_stream = stream;
  b->held = true;
  if (plan->slot1 != 0) { /* made or taken over on its slot's range */
    ofl__place_made(p, b, range, plan->slot1, plan->gen);
    if (plan->old_key != NULL)
      plan->old_key->creating--;
  }
  if (own)
    p->own_bytes += bytes;
  OFL_FIFO_PUSH(k->all_head, k->all_tail, b, key_next);
  k->total++;
  k->allocated++;
  if (plan->block != NULL)
    p->stats.hits++; /* the plan's slot: no memory made */
  else
    p->stats.misses++;
  p->stats.blocks_total++;
  p->stats.blocks_in_use++;
  p->stats.total_bytes += bytes;
  ofl__pool_in_use_add(p, b);
  pthread_mutex_unlock(&p->mu);
  *out = b;
  return OFL_SUCCESS;
}

/* Lock held, nothing in use: whether the cached blocks give their ranges
 * back before the next request, so that the cycle it starts places its
 * blocks as the one before did. In a pool that carves every block under a
 * budget (the manager's pinned pool with a host budget) the key caches
 * carried the layout from one iteration into the next: a freed block
 * waits in its key's list, the next request of that key takes the first
 * one ready, and a miss is carved from whatever the cached blocks leave
 * free, so an iteration whose calls repeated the last one's exactly
 * placed its blocks elsewhere every time. Near the budget one of those
 * layouts had no range for a cluster that the manager's count admitted
 * (soak seed 3, draw 32: 60 KB free in a 320 KiB segment, in pieces of at
 * most 12 KiB, for a 16 KiB cluster, in iterations 12 and 15 of a run
 * whose pools had learned by iteration 3), and the cluster stayed on the
 * device. From bare segments, each iteration's layout is a function of
 * its own calls: the last uses still queued are waited for first (a block
 * that kept its range because its reload's copy was late moved the
 * layout: seed 32, draw 65, a refusal in iteration 9 after eight alike);
 * giving a range back is no backend call. Other pools keep their caches:
 * a fixed-shape pool stays all hits, and a pool without a budget grows
 * instead of refusing. */
static bool restart_due(const ofl_pool_t *p) {
  return ofl__pool_ordered(p) && p->arena.nsegs > 0 &&
         p->stats.blocks_total > 0;
}

bool ofl__pool_ordered(const ofl_pool_t *p) {
  return p->stats.budget_bytes != 0 && from_segment(p);
}

/* Gets a block of the key for t's shape (fields already set in *shape_of)
 * and attaches it to t; t == NULL: a handle from the cache. */
static ofl_status_t pool_get(ofl_pool_t *p, bool dynamic, const int64_t *shape,
                             int ndim, ofl_dtype_t dtype, ofl_stream_t *stream,
                             ofl_tensor_t *into, ofl_tensor_t **out) {
  size_t bytes;
  OFL_CHECK(ofl_shape_bytes(shape, ndim, dtype, &bytes));
  size_t key_bytes = bytes;
  if (dynamic) {
    key_bytes = (bytes + OFL_POOL_PAGE_BYTES - 1) & ~(OFL_POOL_PAGE_BYTES - 1);
    if (key_bytes < bytes)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                        "pool %s: %zu bytes overflow when rounded to the page",
                        p->name, bytes);
    if (key_bytes == 0)
      key_bytes = OFL_POOL_PAGE_BYTES;
  }

  pthread_mutex_lock(&p->mu);
  if (p->stats.blocks_in_use == 0 && restart_due(p)) {
    /* Bare segments whatever the copies' pace: the cached blocks' last
     * uses still queued are waited for (the last reloads of the iteration
     * before, which its backward already waited for on the device), so
     * that none keeps its range by timing. */
    pthread_mutex_unlock(&p->mu);
    (void)ofl__pool_settle_pending(p); /* the idle ones go back at once */
    pthread_mutex_lock(&p->mu);
  }
  /* Nothing in use: an idle point, where the segments may merge first. */
  if (p->stats.blocks_in_use == 0 && ofl__pool_idle_point(p)) {
    pthread_mutex_unlock(&p->mu);
    ofl__pool_merge(p);
    pthread_mutex_lock(&p->mu);
  }
  p->stats.requests++;
  pool_key_t *k = ofl__key_get(p, dynamic, shape, ndim, dtype, key_bytes);
  if (k == NULL) {
    pthread_mutex_unlock(&p->mu);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                      "pool %s: cannot allocate a key record", p->name);
  }
  pool_block_t *prev = NULL, *b = NULL, *victims = NULL;
  uint32_t ord = ofl__place_tick(p);
  /* The plan's records: while it records, and the warmup's sizes. */
  bool note = p->plan.recording || (p->cycles == 0 && !p->plan.active &&
                                    p->plan.nwarm != UINT32_MAX);
  plan_use_t plan = {.gen = p->plan.gen};
  bool planned =
      p->plan.active &&
      ofl__place_pick(p, ord, key_bytes, &plan.range, &plan.block, &plan.slot1);
  if (plan.block != NULL)
    plan.old_key = plan.block->key;
  pick_t pick = planned ? PICK_NONE : block_pick(p, k, stream, &prev, &b);
  bool seg = planned || from_segment(p);
  if (pick == PICK_NONE && !seg && !budget_allows(p, key_bytes)) {
    /* Budget full: rather than fail, wait for the oldest queued last use of
     * this key, or release free blocks of other keys. */
    if (k->free_head != NULL) {
      pick = PICK_SYNC;
      prev = NULL;
      b = k->free_head;
    } else if (!p->evict || !evict_for(p, k, key_bytes, &victims)) {
      p->stats.budget_refusals++;
      size_t total = budget_used(p), budget = p->stats.budget_bytes;
      pthread_mutex_unlock(&p->mu);
      return ofl__error_quiet(OFL_ERR_NO_MEMORY,
                              "pool %s: budget exhausted (%zu of %zu bytes "
                              "held, the reserve included, %zu more "
                              "requested); free blocks or raise the budget",
                              p->name, total, budget, key_bytes);
    }
  }
  ofl_tensor_t *t = into;
  if (t == NULL && p->handle_cache_n > OFL__HANDLE_QUARANTINE) {
    OFL_FIFO_POP(p->handle_cache, p->handle_cache_tail, t, cache_next);
    p->handle_cache_n--;
  }
  void *carved = NULL;
  if (pick != PICK_NONE) {
    block_take(p, k, prev, b);
    if (pick == PICK_WAIT)
      p->stats.stream_waits++;
  } else {
    k->creating++;
    carved = planned ? NULL : reserve_carve(p, key_bytes);
    if (carved == NULL && !seg)
      p->creating_bytes += key_bytes;
  }
  pthread_mutex_unlock(&p->mu);

  ofl__pool_destroy_victims(p, victims); /* last uses over (evict_for) */
  ofl_status_t s = OFL_SUCCESS;
  if (plan.block != NULL && atomic_load(&plan.block->pending) &&
      ofl_event_query(plan.block->ev) != OFL_SUCCESS) {
    /* The slot's last block is still read by queued work (a copy): the
     * requester's stream waits for it (section 5 rule 2), or the host
     * without a stream. */
    if (stream != NULL) {
      s = ofl_stream_wait_event(stream, plan.block->ev);
      pthread_mutex_lock(&p->mu);
      p->stats.stream_waits++;
      pthread_mutex_unlock(&p->mu);
    } else if (!ofl__block_quiesce(plan.block)) {
      s = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_POOL,
                     "pool %s: the last use of block %p did not complete",
                     p->name, plan.block->st.base);
    }
    if (s != OFL_SUCCESS) {
      pthread_mutex_lock(&p->mu);
      ofl__place_made(p, plan.block, plan.block->range, plan.slot1, plan.gen);
      k->creating--;
      if (t != NULL && t != into)
        ofl__handle_cache_push(p, t);
      pthread_mutex_unlock(&p->mu);
      ofl__block_relink(p, plan.block); /* back on its key, free */
      pthread_mutex_lock(&p->mu);
      plan.old_key->creating--;
      pthread_mutex_unlock(&p->mu);
      return s;
    }
  }
  if (pick == PICK_NONE) {
    s = block_create(p, k, carved, seg && carved == NULL, stream, &plan, &b);
  } else if (pick == PICK_WAIT) {
    s = ofl_stream_wait_event(stream, b->ev);
  } else if (pick == PICK_SYNC) {
    s = ofl_event_synchronize(b->ev, OFL_TIMEOUT_DEFAULT);
  }
  /* After a host wait the last use is over. After a stream wait it may
   * still be queued: pending stays set, so that the next release chains on
   * it (block_order) and an unordered reuse still queries it. */
  if (s == OFL_SUCCESS && pick == PICK_SYNC)
    atomic_store(&b->pending, false);
  if (s == OFL_SUCCESS && t == NULL) {
    t = handle_make(p);
    if (t == NULL)
      s = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                     "pool %s: cannot allocate a tensor handle", p->name);
  }
  if (s != OFL_SUCCESS) {
    pthread_mutex_lock(&p->mu);
    if (b != NULL && pick != PICK_NONE)
      block_untake(p, k, b);
    else if (b != NULL) { /* created: keep it, free */
      b->held = false;
      atomic_store(&b->st.refs, 0);
      k->allocated--;
      if (plan.block != NULL)
        p->stats.hits--;
      else
        p->stats.misses--;
      p->stats.blocks_in_use--;
      ofl__pool_in_use_sub(p, b);
      ofl__free_push(k, b);
    }
    if (t != NULL && t != into)
      ofl__handle_cache_push(p, t);
    pthread_mutex_unlock(&p->mu);
    return s;
  }
  if (t != into) {
    handle_reset(t, p);
    ofl__tensor_set_shape(t, shape, ndim, dtype); /* validated above */
  }
  t->st = &b->st;
  t->st_gen = b->st.gen;
  t->offset = 0;
  t->data = b->st.base;
  if (note) {
    pthread_mutex_lock(&p->mu);
    ofl__place_note_alloc(p, b, ord, bytes, dynamic);
    pthread_mutex_unlock(&p->mu);
  }
  t->loc = p->loc;
  if (out != NULL)
    *out = t;
  return OFL_SUCCESS;
}

static ofl_status_t check_alloc_args(ofl_pool_t *pool, ofl_tensor_t **out,
                                     const char *what) {
  if (pool == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "%s: pool and out must not be NULL", what);
  return OFL_SUCCESS;
}

ofl_status_t ofl_pool_alloc(ofl_pool_t *pool, const int64_t *shape, int ndim,
                            ofl_dtype_t dtype, ofl_stream_t *stream,
                            ofl_tensor_t **out) {
  OFL_CHECK(check_alloc_args(pool, out, "ofl_pool_alloc"));
  return pool_get(pool, false, shape, ndim, dtype, stream, NULL, out);
}

ofl_status_t ofl_pool_alloc_dynamic(ofl_pool_t *pool, const int64_t *shape,
                                    int ndim, ofl_dtype_t dtype,
                                    ofl_stream_t *stream, ofl_tensor_t **out) {
  OFL_CHECK(check_alloc_args(pool, out, "ofl_pool_alloc_dynamic"));
  return pool_get(pool, true, shape, ndim, dtype, stream, NULL, out);
}

static ofl_status_t alloc_into(ofl_pool_t *pool, ofl_tensor_t *t,
                               ofl_stream_t *stream, bool dynamic,
                               const char *what) {
  if (pool == NULL || t == NULL || t->state != OFL__TENSOR_LIVE)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "%s: pool must not be NULL and the tensor must be live",
                      what);
  if (t->st != NULL)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_POOL,
                      "%s: tensor already has storage; release it first "
                      "(ofl_tensor_release_storage)",
                      what);
  return pool_get(pool, dynamic, t->shape, t->ndim, t->dtype, stream, t, NULL);
}

ofl_status_t ofl_pool_alloc_into(ofl_pool_t *pool, ofl_tensor_t *t,
                                 ofl_stream_t *stream) {
  return alloc_into(pool, t, stream, false, "ofl_pool_alloc_into");
}

ofl_status_t ofl_pool_alloc_into_dynamic(ofl_pool_t *pool, ofl_tensor_t *t,
                                         ofl_stream_t *stream) {
  return alloc_into(pool, t, stream, true, "ofl_pool_alloc_into_dynamic");
}
