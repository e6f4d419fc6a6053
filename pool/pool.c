/* ofl: tensor pools (device and pinned host), the reference pool's
 * contract (exact key, FIFO free list, hits and misses, reset, clear) with
 * O(1) ownership through a host-memory block header, byte-size keys, a
 * budget, a reserve and stream-ordered reuse (docs/DESIGN.md section 4).
 *
 * Locking: one mutex per pool guards keys, free lists, counters and the
 * handle cache. Device calls that may block (stream waits, event
 * synchronisation, backend allocation) run outside it; event queries (a leaf
 * lock in the device layer) run inside it. A block's order_mu serialises the
 * event records of handles that share the block. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool/pool_internal.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"

#define ARENA_ALIGN ((size_t)256)
#define NBUCKETS 256u
#define HANDLE_QUARANTINE ((size_t)32) /* ended handles before reuse */

typedef struct pool_key pool_key_t;

typedef struct pool_block {
  ofl__storage_t st; /* first: a handle's storage pointer is the block */
  ofl_pool_t *pool;
  pool_key_t *key;
  struct pool_block *next;     /* key's free list */
  struct pool_block *key_next; /* key's blocks in creation order */
  bool held;
  bool carved; /* from the reserve */
  /* Stream-ordered reuse: the pool's own event for the block's last use. */
  pthread_mutex_t order_mu;
  ofl_event_t *ev;
  atomic_bool pending; /* ev recorded and not yet known complete */
} pool_block_t;

struct pool_key {
  pool_key_t *hnext; /* hash chain */
  pool_key_t *lnext; /* list of all keys */
  uint64_t hash;
  bool dynamic;
  ofl_dtype_t dtype;
  int ndim;
  int64_t shape[OFL_MAX_DIMS];
  size_t block_bytes;
  pool_block_t *free_head, *free_tail;
  pool_block_t *all_head, *all_tail;
  uint64_t total, allocated, nfree;
  int creating; /* blocks being created outside the lock */
};

struct ofl_pool {
  pthread_mutex_t mu;
  ofl_device_t *dev;
  ofl_pool_kind_t kind;
  ofl_location_t loc;
  bool strict;
  bool evict;
  char name[32];
  pool_key_t *buckets[NBUCKETS];
  pool_key_t *keys;
  ofl_pool_stats_t stats;
  size_t creating_bytes; /* budget held by blocks being created */
  size_t carved_bytes;   /* bytes of blocks in (or being carved from) the
                            reserve: the reserve already counts them */
  /* The reserve: one backend allocation carved by a bump pointer. */
  void *arena;
  size_t arena_bytes, arena_used;
  uint64_t arena_live;
  /* Ended handles, reused first in, first out and only once more than
   * HANDLE_QUARANTINE wait: a handle freed twice with allocations between
   * is still found ended rather than taken for its next owner's. */
  ofl_tensor_t *handle_cache, *handle_cache_tail;
  size_t handle_cache_n;
  ofl_tensor_t *handles_all; /* every handle made */
  /* Headers of destroyed blocks, kept for new blocks until the pool is
   * destroyed: a stale handle (its block reclaimed by reset, then freed by
   * clear or eviction) still points at its header and finds another
   * generation there, never freed memory. */
  pool_block_t *spare_headers;
  /* Stream that turns a caller's event into a block event (lazy). */
  pthread_mutex_t order_stream_mu;
  ofl_stream_t *order_stream;
  /* ofl__pool_destroy_when_idle: destroyed (then `then` runs) when the
   * last held block comes back, since handles outside still use them. */
  bool doomed;
  void (*then)(void *);
  void *then_arg;
};

/* ---- backend memory ------------------------------------------------------ */

static ofl_status_t backend_alloc(ofl_pool_t *p, size_t bytes, void **out) {
  if (p->kind == OFL_POOL_PINNED)
    return ofl_pinned_malloc(p->dev, bytes, out);
  return ofl_device_malloc(p->dev, bytes, out);
}

static ofl_status_t backend_free(ofl_pool_t *p, void *ptr) {
  if (p->kind == OFL_POOL_PINNED)
    return ofl_pinned_free(p->dev, ptr);
  return ofl_device_free(p->dev, ptr);
}

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

static pool_key_t *key_find(const ofl_pool_t *p, bool dynamic,
                            const int64_t *shape, int ndim, ofl_dtype_t dtype,
                            size_t bytes) {
  uint64_t h = key_hash(dynamic, shape, ndim, dtype, bytes);
  for (pool_key_t *k = p->buckets[h % NBUCKETS]; k != NULL; k = k->hnext)
    if (key_equal(k, h, dynamic, shape, ndim, dtype, bytes))
      return k;
  return NULL;
}

/* Called with the lock held; allocates only on a key's first use. */
static pool_key_t *key_get(ofl_pool_t *p, bool dynamic, const int64_t *shape,
                           int ndim, ofl_dtype_t dtype, size_t bytes) {
  pool_key_t *k = key_find(p, dynamic, shape, ndim, dtype, bytes);
  if (k != NULL)
    return k;
  k = calloc(1, sizeof *k);
  if (k == NULL)
    return NULL;
  k->hash = key_hash(dynamic, shape, ndim, dtype, bytes);
  k->dynamic = dynamic;
  k->block_bytes = bytes;
  if (!dynamic) {
    k->dtype = dtype;
    k->ndim = ndim;
    for (int i = 0; i < ndim; ++i)
      k->shape[i] = shape[i];
  }
  k->hnext = p->buckets[k->hash % NBUCKETS];
  p->buckets[k->hash % NBUCKETS] = k;
  k->lnext = p->keys;
  p->keys = k;
  return k;
}

static void key_unlink(ofl_pool_t *p, pool_key_t *k) {
  pool_key_t **pp = &p->buckets[k->hash % NBUCKETS];
  while (*pp != k)
    pp = &(*pp)->hnext;
  *pp = k->hnext;
  pp = &p->keys;
  while (*pp != k)
    pp = &(*pp)->lnext;
  *pp = k->lnext;
}

static void free_push(pool_key_t *k, pool_block_t *b) {
  b->next = NULL;
  if (k->free_tail != NULL)
    k->free_tail->next = b;
  else
    k->free_head = b;
  k->free_tail = b;
  k->nfree++;
}

static void free_unlink(pool_key_t *k, pool_block_t *prev, pool_block_t *b) {
  if (prev != NULL)
    prev->next = b->next;
  else
    k->free_head = b->next;
  if (k->free_tail == b)
    k->free_tail = prev;
  b->next = NULL;
  k->nfree--;
}

/* ---- create / destroy ---------------------------------------------------- */

static ofl_status_t budget_from_env(ofl_pool_kind_t kind, size_t *out) {
  return ofl__config_size(kind == OFL_POOL_PINNED ? "OFL_HOST_BUDGET"
                                                  : "OFL_DEVICE_POOL_BUDGET",
                          out);
}

ofl_status_t ofl_pool_create(ofl_device_t *dev, const ofl_pool_params_t *params,
                             ofl_pool_t **out) {
  ofl_pool_params_t prm = OFL_POOL_PARAMS_INIT;
  if (params != NULL)
    prm = *params;
  if (dev == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: dev and out must not be NULL");
  if (prm.kind != OFL_POOL_DEVICE && prm.kind != OFL_POOL_PINNED)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_create: kind %d is not OFL_POOL_DEVICE or "
                      "OFL_POOL_PINNED",
                      (int)prm.kind);
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
  snprintf(p->name, sizeof p->name, "%s",
           prm.name != NULL
               ? prm.name
               : (prm.kind == OFL_POOL_PINNED ? "pinned" : "device"));
  p->stats.budget_bytes = budget;
  if (prm.reserve_bytes > 0) {
    ofl_status_t s = backend_alloc(p, prm.reserve_bytes, &p->arena);
    if (s != OFL_SUCCESS) {
      pthread_mutex_destroy(&p->order_stream_mu);
      pthread_mutex_destroy(&p->mu);
      free(p);
      return s;
    }
    p->arena_bytes = prm.reserve_bytes;
    p->stats.reserve_bytes = prm.reserve_bytes;
    p->stats.backend_allocs = 1;
  }
  ofl__device_pool_created(dev);
  OFL_INFO(OFL_SUBSYS_POOL, "pool %s created kind %s budget %zu reserve %zu",
           p->name, prm.kind == OFL_POOL_PINNED ? "pinned" : "device", budget,
           prm.reserve_bytes);
  *out = p;
  return OFL_SUCCESS;
}

/* Waits for a block's last use; false when it did not complete in time. */
static bool block_quiesce(pool_block_t *b) {
  if (b->ev == NULL || !atomic_load(&b->pending))
    return true;
  if (ofl_event_synchronize(b->ev, OFL_TIMEOUT_DEFAULT) != OFL_SUCCESS)
    return false;
  atomic_store(&b->pending, false);
  return true;
}

/* A header for a new block: a spare one (its generation moves on; its
 * pool, kind and lock stay, since stale handles may read them at any time)
 * or a new one. Lock not held. */
static pool_block_t *header_take(ofl_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  pool_block_t *b = p->spare_headers;
  if (b != NULL) {
    p->spare_headers = b->next;
    b->st.gen++;
    b->next = b->key_next = NULL;
    b->key = NULL;
    b->held = b->carved = false;
  }
  pthread_mutex_unlock(&p->mu);
  if (b == NULL && (b = calloc(1, sizeof *b)) != NULL) {
    pthread_mutex_init(&b->order_mu, NULL);
    b->pool = p;
    b->st.kind = OFL__STORAGE_BLOCK;
  }
  return b;
}

/* Lock not held: b goes to the spare headers; handles still on it are
 * stale from here on. */
static void header_retire(ofl_pool_t *p, pool_block_t *b) {
  pthread_mutex_lock(&p->mu);
  b->st.gen++;
  b->st.base = NULL;
  b->held = false;
  b->next = p->spare_headers;
  p->spare_headers = b;
  pthread_mutex_unlock(&p->mu);
}

/* Frees a block's memory; its header is kept (see spare_headers). The
 * block is unlinked already. */
static void block_destroy(ofl_pool_t *p, pool_block_t *b) {
  if (!b->carved && b->st.base != NULL) {
    if (backend_free(p, b->st.base) == OFL_SUCCESS) {
      pthread_mutex_lock(&p->mu);
      p->stats.backend_frees++;
      pthread_mutex_unlock(&p->mu);
    }
  }
  if (b->ev != NULL)
    ofl_event_destroy(b->ev);
  b->ev = NULL;
  header_retire(p, b);
}

void ofl_pool_destroy(ofl_pool_t *pool) {
  if (pool == NULL)
    return;
  ofl_pool_t *p = pool;
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
      if (!block_quiesce(b))
        OFL_WARN(OFL_SUBSYS_POOL,
                 "pool %s: last use of block %p did not complete; freeing "
                 "it anyway at destroy",
                 p->name, b->st.base);
      block_destroy(p, b);
      b = bn;
    }
    free(k);
    k = kn;
  }
  if (p->arena != NULL)
    backend_free(p, p->arena);
  while (p->spare_headers != NULL) {
    pool_block_t *b = p->spare_headers;
    p->spare_headers = b->next;
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

static void pool_finish(ofl_pool_t *p) {
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
    pool_finish(p);
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
static void handle_cache_push(ofl_pool_t *p, ofl_tensor_t *t) {
  t->state = OFL__TENSOR_DEAD;
  t->st = NULL;
  t->data = NULL;
  t->owner = NULL;
  t->loc = OFL_LOC_NONE;
  t->cache_next = NULL;
  if (p->handle_cache_tail != NULL)
    p->handle_cache_tail->cache_next = t;
  else
    p->handle_cache = t;
  p->handle_cache_tail = t;
  p->handle_cache_n++;
}

void ofl__pool_handle_put(ofl_tensor_t *t) {
  ofl_pool_t *p = t->home;
  pthread_mutex_lock(&p->mu);
  handle_cache_push(p, t);
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
  free_unlink(k, prev, b);
  b->held = true;
  atomic_store(&b->st.refs, 1);
  k->allocated++;
  p->stats.hits++;
  p->stats.blocks_in_use++;
  p->stats.in_use_bytes += b->st.bytes;
  if (p->stats.in_use_bytes > p->stats.peak_in_use_bytes)
    p->stats.peak_in_use_bytes = p->stats.in_use_bytes;
}

/* Lock held: undoes block_take (a later step failed). */
static void block_untake(ofl_pool_t *p, pool_key_t *k, pool_block_t *b) {
  b->held = false;
  atomic_store(&b->st.refs, 0);
  k->allocated--;
  p->stats.hits--;
  p->stats.blocks_in_use--;
  p->stats.in_use_bytes -= b->st.bytes;
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
 * pool.h (docs/DESIGN.md section 5 rule 2: a block is reused only after the copy
 * that used it has completed). */
static pick_t block_pick(ofl_pool_t *p, pool_key_t *k, ofl_stream_t *stream,
                         pool_block_t **prev_out, pool_block_t **out) {
  pool_block_t *prev = NULL, *oldest = NULL, *oldest_prev = NULL;
  for (pool_block_t *b = k->free_head; b != NULL; prev = b, b = b->next) {
    if (!atomic_load(&b->pending) || ofl_event_query(b->ev) == OFL_SUCCESS) {
      atomic_store(&b->pending, false);
      *prev_out = prev;
      *out = b;
      return PICK_READY;
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
static bool arena_fits(const ofl_pool_t *p, size_t bytes, size_t *off) {
  if (p->arena == NULL)
    return false;
  *off = (p->arena_used + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1);
  return *off <= p->arena_bytes && bytes <= p->arena_bytes - *off;
}

/* Lock held: memory the pool holds against its budget: the whole reserve,
 * and the blocks outside it (made or being made). */
static size_t budget_used(const ofl_pool_t *p) {
  return (p->arena != NULL ? p->arena_bytes : 0) + p->stats.total_bytes +
         p->creating_bytes - p->carved_bytes;
}

static bool budget_allows(const ofl_pool_t *p, size_t bytes) {
  size_t b = p->stats.budget_bytes, off;
  if (b == 0 || arena_fits(p, bytes, &off))
    return true;
  size_t used = budget_used(p);
  return used <= b && bytes <= b - used;
}

/* Lock held: carves from the reserve; NULL when it has no room. */
static void *arena_carve(ofl_pool_t *p, size_t bytes) {
  size_t off;
  if (!arena_fits(p, bytes, &off))
    return NULL;
  p->arena_used = off + bytes;
  p->arena_live++;
  p->carved_bytes += bytes;
  return (char *)p->arena + off;
}

/* Lock held: removes b from its key's list of blocks (b is free and
 * unlinked from the free list already). */
static void key_forget(ofl_pool_t *p, pool_block_t *b) {
  pool_key_t *k = b->key;
  pool_block_t *prev = NULL;
  for (pool_block_t *x = k->all_head; x != b; prev = x, x = x->key_next) {
  }
  if (prev != NULL)
    prev->key_next = b->key_next;
  else
    k->all_head = b->key_next;
  if (k->all_tail == b)
    k->all_tail = prev;
  b->key_next = NULL;
  k->total--;
  p->stats.blocks_total--;
  p->stats.total_bytes -= b->st.bytes;
  if (b->carved) {
    p->arena_live--;
    p->carved_bytes -= b->st.bytes;
  }
}

/* Lock held: a free block eviction may take: its last use is over, and it
 * lies outside the reserve (a block in the reserve gives no room). */
static bool evictable(pool_block_t *b) {
  return !b->carved &&
         (!atomic_load(&b->pending) || ofl_event_query(b->ev) == OFL_SUCCESS);
}

/* Lock held. Makes room for bytes by taking free blocks of keys other than
 * k whose last use is over, oldest first per key; returns them in *victims
 * for block_destroy outside the lock. Takes nothing when that cannot make
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
      if (evictable(b))
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
      if (evictable(b)) {
        free_unlink(o, prev, b);
        key_forget(p, b);
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

/* Creates a block of k outside the lock; the budget was already held in
 * creating_bytes and k->creating. Lock not held on entry or exit. */
static ofl_status_t block_create(ofl_pool_t *p, pool_key_t *k, void *carved,
                                 pool_block_t **out) {
  size_t bytes = k->block_bytes;
  ofl_status_t s = OFL_SUCCESS;
  pool_block_t *b = header_take(p);
  void *mem = carved;
  if (b == NULL)
    s = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                   "pool %s: cannot allocate a block header", p->name);
  else if (mem == NULL)
    s = backend_alloc(p, bytes > 0 ? bytes : 1, &mem);
  pthread_mutex_lock(&p->mu);
  p->creating_bytes -= bytes;
  k->creating--;
  if (carved == NULL && b != NULL)
    p->stats.backend_allocs += 1; /* a call reached the backend */
  if (s != OFL_SUCCESS) {
    if (carved != NULL) {
      p->arena_live--;
      p->carved_bytes -= bytes;
    }
    pthread_mutex_unlock(&p->mu);
    if (b != NULL)
      header_retire(p, b);
    return s;
  }
  b->st.base = mem;
  b->st.bytes = bytes;
  b->st.loc = p->loc;
  b->st.kind = OFL__STORAGE_BLOCK;
  atomic_init(&b->st.refs, 1);
  atomic_init(&b->pending, false);
  b->pool = p;
  b->key = k;
  b->carved = carved != NULL;
  b->held = true;
  if (k->all_tail != NULL)
    k->all_tail->key_next = b;
  else
    k->all_head = b;
  k->all_tail = b;
  k->total++;
  k->allocated++;
  p->stats.misses++;
  p->stats.blocks_total++;
  p->stats.blocks_in_use++;
  p->stats.total_bytes += bytes;
  p->stats.in_use_bytes += bytes;
  if (p->stats.in_use_bytes > p->stats.peak_in_use_bytes)
    p->stats.peak_in_use_bytes = p->stats.in_use_bytes;
  pthread_mutex_unlock(&p->mu);
  *out = b;
  return OFL_SUCCESS;
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
  p->stats.requests++;
  pool_key_t *k = key_get(p, dynamic, shape, ndim, dtype, key_bytes);
  if (k == NULL) {
    pthread_mutex_unlock(&p->mu);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                      "pool %s: cannot allocate a key record", p->name);
  }
  pool_block_t *prev = NULL, *b = NULL, *victims = NULL;
  pick_t pick = block_pick(p, k, stream, &prev, &b);
  if (pick == PICK_NONE && !budget_allows(p, key_bytes)) {
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
  if (t == NULL && p->handle_cache_n > HANDLE_QUARANTINE) {
    t = p->handle_cache;
    p->handle_cache = t->cache_next;
    if (p->handle_cache == NULL)
      p->handle_cache_tail = NULL;
    p->handle_cache_n--;
  }
  void *carved = NULL;
  if (pick != PICK_NONE) {
    block_take(p, k, prev, b);
    if (pick == PICK_WAIT)
      p->stats.stream_waits++;
  } else {
    p->creating_bytes += key_bytes;
    k->creating++;
    carved = arena_carve(p, key_bytes);
  }
  pthread_mutex_unlock(&p->mu);

  while (victims != NULL) { /* their last uses are over (evict_for) */
    pool_block_t *v = victims;
    victims = v->next;
    block_destroy(p, v);
  }
  ofl_status_t s = OFL_SUCCESS;
  if (pick == PICK_NONE) {
    s = block_create(p, k, carved, &b);
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
      p->stats.misses--;
      p->stats.blocks_in_use--;
      p->stats.in_use_bytes -= b->st.bytes;
      free_push(k, b);
    }
    if (t != NULL && t != into)
      handle_cache_push(p, t);
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

/* Stream-ordered last use: the block's own event, recorded on stream; a
 * record from another handle on the same block is chained first so that
 * both uses are covered. In strict mode the block is poisoned on stream. */
static ofl_status_t block_order(ofl_pool_t *p, pool_block_t *b,
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
      (void)block_quiesce(b);
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
    s = block_order(p, b, stream, last);
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
    p->stats.in_use_bytes -= b->st.bytes;
    free_push(b->key, b);
  }
  /* The last block of a pool whose owner is gone: the pool goes now. */
  bool finish = p->doomed && p->stats.blocks_in_use == 0;
  if (finish)
    p->doomed = false;
  if (end_handle && t->home == p) {
    handle_cache_push(p, t);
    end_handle = false;
  }
  pthread_mutex_unlock(&p->mu);
  if (finish) {
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: its last block came back; the pool is destroyed",
             p->name);
    pool_finish(p);
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
      free_push(k, b);
    }
    k->allocated = 0;
  }
  p->stats.blocks_in_use = 0;
  p->stats.in_use_bytes = 0;
  pthread_mutex_unlock(&p->mu);
  if (reclaimed > 0)
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s reset reclaimed %llu blocks still held; their handles "
             "are stale",
             p->name, (unsigned long long)reclaimed);
  return OFL_SUCCESS;
}

ofl_status_t ofl_pool_clear(ofl_pool_t *pool) {
  if (pool == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_pool_clear: pool is NULL");
  ofl_pool_t *p = pool;
  pool_block_t *victims = NULL;
  pthread_mutex_lock(&p->mu);
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext) {
    pool_block_t *keep_head = NULL, *keep_tail = NULL;
    pool_block_t *b = k->all_head;
    while (b != NULL) {
      pool_block_t *bn = b->key_next;
      b->key_next = NULL;
      if (b->held) {
        if (keep_tail != NULL)
          keep_tail->key_next = b;
        else
          keep_head = b;
        keep_tail = b;
      } else {
        b->next = victims;
        victims = b;
        k->total--;
        p->stats.blocks_total--;
        p->stats.total_bytes -= b->st.bytes;
        if (b->carved)
          p->carved_bytes -= b->st.bytes;
      }
      b = bn;
    }
    k->all_head = keep_head;
    k->all_tail = keep_tail;
    k->free_head = k->free_tail = NULL;
    k->nfree = 0;
  }
  pthread_mutex_unlock(&p->mu);

  /* Wait for queued last uses before the memory goes (section 5 rule 2). */
  ofl_status_t st = OFL_SUCCESS;
  uint64_t carved_gone = 0;
  while (victims != NULL) {
    pool_block_t *b = victims;
    victims = b->next;
    if (!block_quiesce(b)) {
      st = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_POOL,
                      "pool %s: block %p still used by a queued operation "
                      "after OFL_WAIT_TIMEOUT_MS; kept in the pool",
                      p->name, b->st.base);
      pthread_mutex_lock(&p->mu);
      pool_key_t *k = b->key;
      if (k->all_tail != NULL)
        k->all_tail->key_next = b;
      else
        k->all_head = b;
      k->all_tail = b;
      k->total++;
      p->stats.blocks_total++;
      p->stats.total_bytes += b->st.bytes;
      if (b->carved)
        p->carved_bytes += b->st.bytes;
      free_push(k, b);
      pthread_mutex_unlock(&p->mu);
      continue;
    }
    if (b->carved)
      carved_gone++;
    block_destroy(p, b);
  }

  void *arena = NULL;
  pthread_mutex_lock(&p->mu);
  p->arena_live -= carved_gone;
  if (p->arena != NULL && p->arena_live == 0) {
    arena = p->arena;
    p->arena = NULL;
    p->arena_bytes = p->arena_used = 0;
  }
  pool_key_t *k = p->keys;
  while (k != NULL) {
    pool_key_t *kn = k->lnext;
    if (k->total == 0 && k->creating == 0) {
      key_unlink(p, k);
      free(k);
    }
    k = kn;
  }
  pthread_mutex_unlock(&p->mu);
  if (arena != NULL && backend_free(p, arena) == OFL_SUCCESS) {
    pthread_mutex_lock(&p->mu);
    p->stats.backend_frees++;
    pthread_mutex_unlock(&p->mu);
  }
  return st;
}

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
  pthread_mutex_unlock(&p->mu);
}

void ofl_pool_reset_peak(ofl_pool_t *pool) {
  if (pool == NULL)
    return;
  pthread_mutex_lock(&pool->mu);
  pool->stats.peak_in_use_bytes = pool->stats.in_use_bytes;
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
  pool_key_t *k = key_find(p, dynamic, shape, ndim, dtype, bytes);
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
