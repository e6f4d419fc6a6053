/* ofl: where a pool's memory comes from and how it is given back
 * (docs/DESIGN.md section 4): segments grown for new blocks, idle cached
 * blocks released to make room, and the out-of-memory retry: when the
 * backend refuses, the cached memory of every pool of the device's kind
 * goes back before the request is tried again (as PyTorch's caching
 * allocator frees its cache before it reports out of memory). The learning
 * and the resize at an iteration's end, and the merge of segments at idle
 * points: pool/resize.c. */
#include <stdio.h>
#include <stdlib.h>

#include "pool/block.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"

/* The pools of the process, so that an allocation that ran out can release
 * the idle cache of its device's other pools. Never taken while a pool's
 * lock is held. */
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t registry_cv = PTHREAD_COND_INITIALIZER;
static ofl_pool_t *registry;

void ofl__pool_register(ofl_pool_t *p) {
  pthread_mutex_lock(&registry_mu);
  p->reg_next = registry;
  registry = p;
  pthread_mutex_unlock(&registry_mu);
}

void ofl__pool_unregister(ofl_pool_t *p) {
  pthread_mutex_lock(&registry_mu);
  while (p->pins > 0) /* an iteration's end reported to it (follow_cycle) */
    pthread_cond_wait(&registry_cv, &registry_mu);
  for (ofl_pool_t **pp = &registry; *pp != NULL; pp = &(*pp)->reg_next)
    if (*pp == p) {
      *pp = p->reg_next;
      break;
    }
  pthread_mutex_unlock(&registry_mu);
}

/* A resize at an iteration's end reaches the device's pools that no
 * manager reports to (pool/resize.c, follow_cycle) through these. */
int ofl__pool_pin_followers(ofl_pool_t *p, ofl_pool_t **q, int max) {
  int n = 0;
  pthread_mutex_lock(&registry_mu);
  for (ofl_pool_t *o = registry; o != NULL && n < max; o = o->reg_next)
    if (o != p && o->dev == p->dev && o->kind == OFL_POOL_DEVICE &&
        !atomic_load(&o->reported)) {
      o->pins++;
      q[n++] = o;
    }
  pthread_mutex_unlock(&registry_mu);
  return n;
}

void ofl__pool_unpin(ofl_pool_t **q, int n) {
  if (n == 0)
    return;
  pthread_mutex_lock(&registry_mu);
  for (int i = 0; i < n; i++)
    q[i]->pins--;
  pthread_cond_broadcast(&registry_cv);
  pthread_mutex_unlock(&registry_mu);
}

size_t ofl__pool_held(const ofl_pool_t *p) {
  return p->reserve_bytes + p->own_bytes + p->arena.held_bytes;
}

/* ---- idle cached blocks -------------------------------------------------- */

size_t ofl__pool_take_idle(ofl_pool_t *p, bool segs_only,
                           pool_block_t **victims) {
  size_t got = 0;
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext) {
    pool_block_t *prev = NULL, *b = k->free_head;
    while (b != NULL) {
      pool_block_t *next = b->next;
      /* A block in a placement plan's slot gives no range back (the slot
       * keeps it): not for room. */
      if ((!segs_only || (b->range != NULL && b->slot1 == 0)) &&
          ofl__block_idle(b)) {
        ofl__free_unlink(k, prev, b);
        ofl__key_forget(p, b);
        got += b->st.bytes;
        p->stats.releases++;
        b->next = *victims;
        *victims = b;
      } else {
        prev = b;
      }
      b = next;
    }
  }
  return got;
}

void ofl__pool_destroy_victims(ofl_pool_t *p, pool_block_t *victims) {
  while (victims != NULL) { /* their last uses are over */
    pool_block_t *v = victims;
    victims = v->next;
    ofl__block_destroy(p, v);
  }
}

/* Frees the memory of unlinked segments, counting the backend calls. Lock
 * not held. */
void ofl__pool_free_segments(ofl_pool_t *p, ofl__segment_t *segs) {
  if (segs == NULL)
    return;
  uint64_t n = ofl__arena_free_segments(&p->arena, segs);
  pthread_mutex_lock(&p->mu);
  p->stats.backend_frees += n;
  pthread_mutex_unlock(&p->mu);
}

/* Releases p's cached blocks outside the reserve, waiting (bounded) for
 * the last uses still queued, as PyTorch synchronises its events before it
 * frees its cache, and frees the segments left empty; returns the bytes
 * given back to the backend. Lock not held. */
static size_t release_cached(ofl_pool_t *p) {
  pool_block_t *victims = NULL;
  pthread_mutex_lock(&p->mu);
  ofl__place_drop(p); /* out of memory: a plan's slots hold none back */
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext) {
    pool_block_t *prev = NULL, *b = k->free_head;
    while (b != NULL) {
      pool_block_t *next = b->next;
      if (!b->carved) {
        ofl__free_unlink(k, prev, b);
        ofl__key_forget(p, b);
        b->next = victims;
        victims = b;
      } else {
        prev = b;
      }
      b = next;
    }
  }
  pthread_mutex_unlock(&p->mu);
  size_t own = 0;
  while (victims != NULL) {
    pool_block_t *b = victims;
    victims = b->next;
    if (!ofl__block_quiesce(b)) { /* still queued: it stays cached */
      ofl__block_relink(p, b);
      continue;
    }
    own += b->range == NULL ? b->st.bytes : 0;
    pthread_mutex_lock(&p->mu);
    p->stats.releases++;
    pthread_mutex_unlock(&p->mu);
    ofl__block_destroy(p, b);
  }
  size_t seg_bytes = 0;
  pthread_mutex_lock(&p->mu);
  ofl__segment_t *segs = ofl__arena_take_idle(&p->arena, &seg_bytes);
  pthread_mutex_unlock(&p->mu);
  ofl__pool_free_segments(p, segs);
  return own + seg_bytes;
}

/* Releases the idle cache of p and of the device's other pools of p's kind;
 * returns the bytes given back to the backend. */
static size_t release_device(ofl_pool_t *p) {
  size_t got = release_cached(p);
  pthread_mutex_lock(&registry_mu);
  for (ofl_pool_t *q = registry; q != NULL; q = q->reg_next)
    if (q != p && q->dev == p->dev && q->kind == p->kind)
      got += release_cached(q);
  pthread_mutex_unlock(&registry_mu);
  return got;
}

/* The figures of every pool of the device for an out-of-memory message. */
static void describe_device(const ofl_pool_t *p, char *buf, size_t cap) {
  size_t n = 0;
  buf[0] = '\0';
  pthread_mutex_lock(&registry_mu);
  for (ofl_pool_t *q = registry; q != NULL && n < cap; q = q->reg_next) {
    if (q->dev != p->dev)
      continue;
    pthread_mutex_lock(&q->mu);
    size_t held = ofl__pool_held(q), used = q->stats.in_use_bytes;
    size_t cached = q->stats.total_bytes - used;
    pthread_mutex_unlock(&q->mu);
    int w = snprintf(
        buf + n, cap - n, "%spool %s (%s) held %zu in use %zu cached %zu",
        n ? "; " : "", q->name,
        q->kind == OFL_POOL_PINNED ? "pinned" : "device", held, used, cached);
    if (w < 0)
      break;
    n += (size_t)w;
  }
  pthread_mutex_unlock(&registry_mu);
}

static ofl_status_t out_of_memory(ofl_pool_t *p, size_t bytes,
                                  size_t released) {
  char figures[768];
  describe_device(p, figures, sizeof figures);
  return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                    "pool %s: out of %s memory: %zu bytes requested, refused "
                    "again after releasing %zu cached bytes of the device's "
                    "pools; %s. Free tensors, offload more or lower the batch",
                    p->name, p->kind == OFL_POOL_PINNED ? "pinned" : "device",
                    bytes, released, figures);
}

/* ---- memory for a new block ---------------------------------------------- */

/* A block from the application's allocator (pool.h). Any refusal is out
 * of memory for the retry; memory the device does not take as its own is
 * given back and refused with what to do. */
static ofl_status_t allocator_alloc(ofl_pool_t *p, size_t bytes,
                                    ofl_stream_t *stream, void **out) {
  void *mem = NULL;
  ofl_status_t s = p->allocator.alloc(p->allocator.ctx, bytes, stream, &mem);
  pthread_mutex_lock(&p->mu);
  p->stats.backend_allocs++; /* a call reached the allocator */
  pthread_mutex_unlock(&p->mu);
  if (s != OFL_SUCCESS || mem == NULL) {
    OFL_INFO(OFL_SUBSYS_POOL, "pool %s: allocator refused %zu bytes (%s)",
             p->name, bytes,
             s != OFL_SUCCESS ? ofl_status_str(s) : "NULL pointer");
    return OFL_ERR_NO_MEMORY; /* quiet: the retry or out_of_memory says */
  }
  if (p->kind == OFL_POOL_DEVICE && !ofl__device_owns(p->dev, mem, bytes)) {
    p->allocator.free(p->allocator.ctx, mem, bytes, stream);
    pthread_mutex_lock(&p->mu);
    p->stats.backend_frees++;
    pthread_mutex_unlock(&p->mu);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "pool %s: the allocator's block %p (%zu bytes) is not "
                      "memory of the pool's device (host backend: call "
                      "ofl_device_adopt_host_memory(dev, 1) first)",
                      p->name, mem, bytes);
  }
  *out = mem;
  return OFL_SUCCESS;
}

static ofl_status_t backend_alloc(ofl_pool_t *p, size_t bytes, void **out) {
  ofl_status_t s = ofl__arena_backend_alloc(&p->arena, bytes, out);
  pthread_mutex_lock(&p->mu);
  p->stats.backend_allocs++; /* a call reached the backend */
  pthread_mutex_unlock(&p->mu);
  return s;
}

/* A block's own memory: the allocator's, else the backend's. */
static ofl_status_t own_alloc(ofl_pool_t *p, size_t bytes, ofl_stream_t *stream,
                              void **out) {
  if (p->has_allocator)
    return allocator_alloc(p, bytes, stream, out);
  return backend_alloc(p, bytes, out);
}

/* Lock not held: for the growth message, where the pool's memory was when
 * a request found no free range large enough. */
static void describe_arena(ofl_pool_t *p, char *buf, size_t cap) {
  size_t largest = 0, slack = 0, cached = 0;
  pthread_mutex_lock(&p->mu);
  for (ofl__range_t *r = p->arena.free_ranges; r != NULL; r = r->fnext)
    largest = r->bytes > largest ? r->bytes : largest;
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext)
    for (pool_block_t *b = k->all_head; b != NULL; b = b->key_next) {
      if (b->range == NULL)
        continue;
      if (b->held)
        slack += b->range->bytes - b->st.bytes;
      else
        cached += b->range->bytes;
    }
  snprintf(buf, cap,
           "%zu in use (and %zu more in their ranges), %zu in cached blocks, "
           "%zu in free ranges (the largest %zu)",
           p->stats.in_use_bytes, slack, cached, p->arena.free_bytes, largest);
  pthread_mutex_unlock(&p->mu);
}

/* A new segment of seg_bytes (merged: the one that replaces the others,
 * else grown for a request); the memory is freed again when its records
 * cannot be made. */
ofl_status_t ofl__pool_grow(ofl_pool_t *p, size_t seg_bytes, bool merged) {
  char before[192] = "";
  if (!merged && ofl__log_enabled(OFL_LOG_INFO, OFL_SUBSYS_POOL))
    describe_arena(p, before, sizeof before);
  void *mem = NULL;
  OFL_CHECK(backend_alloc(p, seg_bytes, &mem));
  pthread_mutex_lock(&p->mu);
  bool ok = ofl__arena_add(&p->arena, mem, seg_bytes);
  if (ok && !merged) {
    p->grew = true;
    p->grown_at = p->idle_points;
    p->grown_cycle = p->cycles;
  }
  pthread_mutex_unlock(&p->mu);
  if (!ok) {
    if (ofl__arena_backend_free(&p->arena, mem)) {
      pthread_mutex_lock(&p->mu);
      p->stats.backend_frees++;
      pthread_mutex_unlock(&p->mu);
    }
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                      "pool %s: cannot allocate the records of a segment",
                      p->name);
  }
  OFL_INFO(OFL_SUBSYS_POOL,
           "pool %s: segment of %zu bytes added (iteration %llu): %zu held in "
           "%llu segments; before it %s",
           p->name, seg_bytes, (unsigned long long)p->cycles + 1,
           p->arena.held_bytes, (unsigned long long)p->arena.nsegs, before);
  return OFL_SUCCESS;
}

/* A range of bytes from the arena for a miss. In a pool whose sizes change
 * (two byte-size keys seen, as for OFL_POOL_SEGMENTS_AUTO), the pool's idle
 * cached blocks carved from segments give their ranges back first, so that
 * best fit chooses among the free memory merged with its neighbours rather
 * than among the gaps that stale blocks of sizes no longer asked for leave
 * between them (on the MoE benchmark those gaps put blocks in the middle of
 * segments, and the arena later grew with a quarter of it free). A pool of
 * fixed shapes keeps its cache, so that it stays all hits in steady state
 * (there, releasing on a miss makes the released keys miss in turn). A block
 * whose last use is still queued keeps its range. When still no free range
 * fits, every idle cached block carved from a segment goes back; blocks of
 * their own (made before the pool carved) stay cached for their keys: they
 * free no range, and giving them back to the backend here was a backend
 * call inside the steady iterations (a merge or the out-of-memory release
 * gives them back). Lock not held. */
static ofl__range_t *take_range(ofl_pool_t *p, size_t bytes) {
  pool_block_t *victims = NULL;
  pthread_mutex_lock(&p->mu);
  /* A pool whose layout follows its calls alone (ofl__pool_ordered) gives
   * no idle block back here: which blocks are idle is timing. Its cached
   * blocks keep their ranges until a request finds no room, then all go
   * back at once (reuse_pending, ofl__pool_settle_pending). */
  bool ordered = ofl__pool_ordered(p);
  if (!ordered && p->byte_keys_made > 1 && p->arena.nsegs > 0 &&
      p->stats.blocks_total > p->stats.blocks_in_use)
    (void)ofl__pool_take_idle(p, true, &victims);
  pthread_mutex_unlock(&p->mu);
  ofl__pool_destroy_victims(p, victims);
  pthread_mutex_lock(&p->mu);
  ofl__range_t *r = ofl__arena_take(&p->arena, bytes);
  if (r != NULL || p->arena.nsegs == 0 || ordered) {
    pthread_mutex_unlock(&p->mu);
    return r;
  }
  victims = NULL;
  (void)ofl__pool_take_idle(p, true, &victims);
  pthread_mutex_unlock(&p->mu);
  if (victims == NULL)
    return NULL;
  ofl__pool_destroy_victims(p, victims);
  pthread_mutex_lock(&p->mu);
  r = ofl__arena_take(&p->arena, bytes);
  pthread_mutex_unlock(&p->mu);
  return r;
}

/* Lock held: the free block carved from a segment whose range fits bytes
 * best among the cached ones (those whose last use completed went back
 * before, except in a pool whose layout follows its calls alone:
 * ofl__pool_ordered); NULL when none. */
static pool_block_t *pending_fit(ofl_pool_t *p, size_t bytes, pool_key_t **key,
                                 pool_block_t **prev_out) {
  pool_block_t *best = NULL;
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext) {
    pool_block_t *prev = NULL;
    for (pool_block_t *b = k->free_head; b != NULL; prev = b, b = b->next)
      if (b->range != NULL && b->slot1 == 0 && b->range->bytes >= bytes &&
          (best == NULL || b->range->bytes < best->range->bytes)) {
        best = b;
        *key = k;
        *prev_out = prev;
      }
  }
  return best;
}

/* A queued block of another key for a request on stream (section 5 rule
 * 2: stream waits for its last use; its whole range goes with it, so no
 * other request gets part of it early). NULL when none fits. */
static pool_block_t *reuse_pending(ofl_pool_t *p, size_t bytes,
                                   ofl_stream_t *stream) {
  pool_key_t *k = NULL;
  pool_block_t *prev = NULL;
  pthread_mutex_lock(&p->mu);
  pool_block_t *b = pending_fit(p, bytes, &k, &prev);
  if (b != NULL) {
    ofl__free_unlink(k, prev, b);
    ofl__key_forget(p, b);
  }
  pthread_mutex_unlock(&p->mu);
  if (b == NULL)
    return NULL;
  /* No wait for a block whose last use was never queued (freed on the
   * host: no event) or is over. */
  bool queued = atomic_load(&b->pending) && b->ev != NULL;
  if (queued && ofl_stream_wait_event(stream, b->ev) != OFL_SUCCESS) {
    ofl__block_relink(p, b);
    return NULL;
  }
  pthread_mutex_lock(&p->mu);
  p->stats.stream_waits += queued;
  pthread_mutex_unlock(&p->mu);
  return b;
}

/* Waits (bounded) for the last uses still queued of p's cached blocks
 * carved from segments and gives their ranges back, so that freed
 * neighbours merge before the pool grows: a fragmented arena otherwise
 * grows by a segment whenever copies are in flight, and keeps it. Section 5
 * rule 2: a range goes back only once its block's last use completed; a
 * block whose use did not complete in time stays cached. Returns whether
 * any range went back. Lock not held. */
bool ofl__pool_settle_pending(ofl_pool_t *p) {
  pool_block_t *queued = NULL;
  pthread_mutex_lock(&p->mu);
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext) {
    pool_block_t *prev = NULL, *b = k->free_head;
    while (b != NULL) {
      pool_block_t *next = b->next;
      if (b->range != NULL && !b->carved && b->slot1 == 0) {
        ofl__free_unlink(k, prev, b);
        ofl__key_forget(p, b);
        b->next = queued;
        queued = b;
      } else {
        prev = b;
      }
      b = next;
    }
  }
  pthread_mutex_unlock(&p->mu);
  bool any = false;
  while (queued != NULL) {
    pool_block_t *b = queued;
    queued = b->next;
    if (!ofl__block_quiesce(b)) {
      ofl__block_relink(p, b);
      continue;
    }
    pthread_mutex_lock(&p->mu);
    p->stats.releases++;
    pthread_mutex_unlock(&p->mu);
    ofl__block_destroy(p, b);
    any = true;
  }
  return any;
}

/* Lock held: a request found no room in a pool that holds a merged
 * segment, which grows now. The next merge must not make a segment of the
 * same size again: sized for the same most in use, it met the same gaps
 * and grew again, a growth and a merge (an allocation and a free per
 * segment) in iteration after iteration while the bytes held stayed flat
 * (interleaved 1F1B, byte-keyed expert blocks in an application's pool).
 * So the merged segment's size and the request it could not place become
 * the least a merge makes. */
static void note_merge_too_small(ofl_pool_t *p, size_t bytes) {
  if (p->merged_bytes == 0)
    return;
  size_t step = OFL__ARENA_MERGE_ROUND;
  size_t floor = p->merged_bytes + (bytes + step - 1) / step * step;
  if (floor > p->merge_floor_bytes)
    p->merge_floor_bytes = floor;
}

static ofl_status_t segment_memory(ofl_pool_t *p, size_t bytes,
                                   ofl_stream_t *stream, ofl__range_t **range,
                                   pool_block_t **reuse) {
  size_t released = 0;
  for (int attempt = 0; attempt < 4; attempt++) {
    ofl__range_t *r = take_range(p, bytes);
    if (r != NULL) {
      *range = r;
      return OFL_SUCCESS;
    }
    pool_block_t *b = stream != NULL ? reuse_pending(p, bytes, stream) : NULL;
    if (b != NULL) {
      *reuse = b;
      return OFL_SUCCESS;
    }
    if (ofl__pool_settle_pending(p) && (r = take_range(p, bytes)) != NULL) {
      *range = r;
      return OFL_SUCCESS;
    }
    /* A placement plan whose slots and room past them have no place for
     * the request (sizes past what it learned): its slots go back to the
     * arena, whose best fit over the whole segment takes over before the
     * pool grows (pool/plan.c). */
    pthread_mutex_lock(&p->mu);
    bool planned = p->plan.active;
    if (planned)
      ofl__place_drop(p);
    pthread_mutex_unlock(&p->mu);
    if (planned && (r = take_range(p, bytes)) != NULL) {
      *range = r;
      return OFL_SUCCESS;
    }
    /* After a refusal, no more than the request (whole granules). */
    size_t g = p->arena.granule, least = (bytes + g - 1) / g * g;
    pthread_mutex_lock(&p->mu);
    /* Under a budget, segments grow only within it (0: no cap). */
    size_t budget = p->stats.budget_bytes, room = 0;
    if (budget != 0) {
      size_t used = ofl__pool_held(p) + p->creating_bytes;
      room = used < budget ? (budget - used) / g * g : 0;
      if (room < least) {
        p->stats.budget_refusals++;
        pthread_mutex_unlock(&p->mu);
        return ofl__error_quiet(OFL_ERR_NO_MEMORY,
                                "pool %s: budget exhausted (%zu of %zu bytes "
                                "held in segments, %zu more requested, no "
                                "free range fits it); free blocks or raise "
                                "the budget",
                                p->name, used, budget, bytes);
      }
    }
    size_t want = ofl__arena_grow_bytes(&p->arena, bytes, room);
    note_merge_too_small(p, bytes);
    pthread_mutex_unlock(&p->mu);
    if (want == 0)
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                        "pool %s: %zu bytes cannot be rounded to a segment",
                        p->name, bytes);
    ofl_status_t s = ofl__pool_grow(p, want, false);
    if (s == OFL_ERR_NO_MEMORY && want > least)
      s = ofl__pool_grow(p, least, false); /* a smaller segment may still fit */
    if (s == OFL_ERR_NO_MEMORY) {
      released = release_device(p);
      pthread_mutex_lock(&p->mu);
      p->stats.oom_retries++;
      pthread_mutex_unlock(&p->mu);
      OFL_INFO(OFL_SUBSYS_POOL,
               "pool %s: out of memory for %zu bytes; %zu cached bytes "
               "released, trying again",
               p->name, bytes, released);
      r = take_range(p, bytes);
      if (r != NULL) {
        *range = r;
        return OFL_SUCCESS;
      }
      s = ofl__pool_grow(p, least, false);
      if (s == OFL_ERR_NO_MEMORY)
        return out_of_memory(p, bytes, released);
    }
    if (s != OFL_SUCCESS)
      return s;
    /* Another thread may take the new segment first: try again. */
  }
  return out_of_memory(p, bytes, released);
}

ofl_status_t ofl__pool_memory(ofl_pool_t *p, size_t bytes, bool seg,
                              ofl_stream_t *stream, ofl__range_t **range,
                              void **mem, pool_block_t **reuse) {
  if (seg)
    return segment_memory(p, bytes, stream, range, reuse);
  ofl_status_t s = own_alloc(p, bytes, stream, mem);
  if (s != OFL_ERR_NO_MEMORY)
    return s;
  size_t released = release_device(p);
  pthread_mutex_lock(&p->mu);
  p->stats.oom_retries++;
  pthread_mutex_unlock(&p->mu);
  OFL_INFO(OFL_SUBSYS_POOL,
           "pool %s: out of memory for %zu bytes; %zu cached bytes released, "
           "trying again",
           p->name, bytes, released);
  s = own_alloc(p, bytes, stream, mem);
  if (s == OFL_ERR_NO_MEMORY)
    return out_of_memory(p, bytes, released);
  return s;
}
