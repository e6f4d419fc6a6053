/* ofl: the bookkeeping the keyed pool (pool/pool.c) and its memory
 * (pool/arena.c, pool/reclaim.c) share: blocks, keys with their free lists,
 * the pool itself, block headers and the events of stream-ordered reuse.
 * Not installed.
 *
 * Locking: one mutex per pool guards keys, free lists, counters, the arena
 * and the handle cache. Device calls that may block (stream waits, event
 * synchronisation, backend allocation) run outside it; event queries (a leaf
 * lock in the device layer) run inside it. A block's order_mu serialises the
 * event records of handles that share the block. */
#ifndef OFL_POOL_BLOCK_H
#define OFL_POOL_BLOCK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "pool/arena.h"
#include "pool/tuning.h"
#include "pool/pool_internal.h"

typedef struct pool_key pool_key_t;

typedef struct pool_block {
  ofl__storage_t st; /* first: a handle's storage pointer is the block */
  ofl_pool_t *pool;
  pool_key_t *key;
  struct pool_block *next;     /* key's free list */
  struct pool_block *key_next; /* key's blocks in creation order */
  bool held;
  bool carved;                /* from the reserve */
  ofl__range_t *range;        /* from a segment of the arena; NULL: its own */
  ofl_stream_t *alloc_stream; /* the stream its allocator call named */
  /* Stream-ordered reuse: the pool's own event for the block's last use. */
  pthread_mutex_t order_mu;
  ofl_event_t *ev;
  atomic_bool pending; /* ev recorded and not yet known complete */
  /* The placement plan (pool/plan.c): the slot the block lies in (its
   * index + 1; 0: none), and while the pool records, the request it
   * serves (its place in the iteration, the iteration, and a sequence
   * number; ord_seq 0: no record open). */
  uint32_t slot1;
  uint32_t ord;
  uint64_t ord_cycle, ord_seq;
  /* What the block added to the pool's in_use_need while held. */
  size_t need;
} pool_block_t;

/* ---- the placement plan (pool/plan.c) ------------------------------------
 * A device pool of changing sizes under a manager records, while it
 * learns, each request's place in the iteration (its ordinal), the most
 * bytes asked at that place, and how long the block stayed busy (until
 * freed, or until its last use was seen complete, in requests of the
 * iteration); at the end of learning it lays the ordinals out in slots,
 * fixed ranges of one segment shared by ordinals whose busy times do not
 * meet, and from then on serves each request from its ordinal's slot. */
typedef struct ofl__place_ord {
  size_t lo;           /* the least asked at this place (as asked) */
  size_t bytes;        /* the most asked at this place; while the plan is laid
                          out, the size its slot needs (the arena's) */
  size_t most, margin; /* its class's most, and the margin past it */
  /* Busy until this request (past n: into the next iteration;
   * UINT32_MAX: throughout), in each iteration recorded (0: none yet), and
   * the one the layout uses. */
  uint32_t ends[OFL__LEARN_CYCLES];
  uint64_t end;
  uint32_t slot; /* after the plan is made */
  bool dynamic;  /* byte-keyed requests: blocks of whole pages */
} ofl__place_ord_t;

typedef struct ofl__place_watch {
  struct pool_block *b;
  uint64_t seq, cycle;
  uint32_t ord;
} ofl__place_watch_t;

typedef struct ofl__place_slot {
  ofl__range_t *range;      /* reserved in the arena */
  struct pool_block *block; /* the block made on it (NULL: none) */
  bool making;              /* a block is being made on it */
} ofl__place_slot_t;

typedef struct ofl__plan {
  bool recording, active, uneven;
  uint32_t clock;      /* requests of the iteration under way */
  uint32_t n, prev_n;  /* requests per iteration; the last one's */
  uint32_t iters, cap; /* iterations recorded; ords allocated */
  uint64_t seq;
  ofl__place_ord_t *ords;
  /* The warmup's sizes, by ordinal (at most OFL__PLACE_WARM of them):
   * they join the ranges once the first iteration after it proves it made
   * as many requests. */
  size_t *warm;
  uint32_t nwarm;
  bool warm_used;            /* the warmup's sizes joined the ranges */
  ofl__place_watch_t *watch; /* freed blocks whose last use is queued */
  uint32_t nwatch, capwatch;
  ofl__place_slot_t *slots;
  uint32_t nslots;
  size_t bytes;           /* the slots' */
  uint64_t misses;        /* requests not in their ordinal's slot */
  uint64_t misses_before; /* at the last iteration's end */
  uint64_t missed_last;   /* in the last iteration */
  uint32_t gen;           /* plans made and dropped: a block being made on a
                             slot of an ended plan owns its range */
} ofl__place_t;

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
  ofl_pool_segments_t segments;
  /* params.allocator (copied): blocks come from it, not the backend. */
  bool has_allocator;
  ofl_allocator_t allocator;
  uint64_t byte_keys_made; /* byte-size keys ever created */
  /* ofl__pool_expect_byte_keys: a device pool told that byte-keyed blocks
   * will come takes its segments from then on (from_segment). */
  bool expects_byte_keys;
  uint64_t keys_made;      /* keys of either kind ever created */
  char name[32];
  pool_key_t *buckets[OFL__POOL_NBUCKETS];
  pool_key_t *keys;
  ofl_pool_stats_t stats;
  size_t creating_bytes; /* budget held by blocks being created */
  size_t carved_bytes;   /* bytes of blocks in (or being carved from) the
                            reserve: the reserve already counts them */
  size_t own_bytes;      /* bytes of blocks of their own (not carved from
                            the reserve or a segment) */
  /* The reserve: one backend allocation carved by a bump pointer. */
  void *reserve;
  size_t reserve_bytes, reserve_used;
  uint64_t reserve_live;
  /* Segments for the blocks params.segments names (pool/arena.h). */
  ofl__arena_t arena;
  size_t growing_bytes; /* segments being allocated outside the lock */
  /* The bytes the held blocks take: a block carved from a segment its
   * range (whole granules, ofl__arena_need), one of its own its bytes.
   * What the pool sizes its segments for (most_in_use_bytes and the cycle
   * peaks below count it): a pinned pool of tensors smaller than its 4 KiB
   * granule takes a page for each (eight times 512 bytes), and a segment
   * sized for the bytes asked had no room left (soak seed 35, draw 438:
   * 2.55 MB in use in ranges of 3.37 MB, a 3.74 MB segment for 2.63 MB,
   * and a growth after learning). */
  size_t in_use_need;
  /* Merging segments (ofl__pool_merge): the most bytes ever in use (in
   * in_use_need's count; never reset, unlike stats.peak_in_use_bytes), the
   * requests that found nothing in use, the count of those at the last
   * growth, whether the arena grew since the last merge, and a merge under
   * way. */
  size_t most_in_use_bytes;
  /* Under a manager: the most in use in the iteration under way, and the
   * most in any iteration after the warmup (the first), which the steady
   * iterations repeat; the warmup's may be higher (its reloads are not
   * planned yet) and is not what a pinned pool keeps room for. */
  size_t cycle_most_bytes, steady_most_bytes;
  /* The learning iterations' peaks in use after the warmup (each one's
   * cycle_most_bytes): how many, their mean and their sum of squared
   * deviations from it (Welford), for the spread a merged segment keeps
   * room for (pool/resize.c, spread_of). */
  uint64_t peaks_n;
  double peaks_mean, peaks_m2;
  uint64_t idle_points, grown_at;
  bool grew, merging;
  /* Training iterations the offload manager reported ended
   * (ofl__pool_cycle_end; 0: none, the pool is used on its own), and the
   * count at the last growth. */
  uint64_t cycles, grown_cycle;
  /* The last merge: the most in use it was sized for, and the idle point
   * it happened at (0: none yet). */
  size_t merged_most_bytes;
  uint64_t merged_at;
  /* The least bytes a merge may make: after a merged segment proved too
   * small (the pool grew while it had one), its size and the request it
   * could not place, so that the next merge does not make the same
   * segment again (pool/reclaim.c, pool/resize.c). 0: none. */
  size_t merge_floor_bytes;
  size_t merged_bytes; /* the last merged segment's (0: none) */
  /* The last merge made its segment (false: it kept the one segment the
   * pool had, already as large). */
  bool merge_made;
  /* Learning (under a manager): the iteration whose end ended it (0: still
   * learning), and the keys made and backend calls counted at the last
   * iteration's end, to see whether an iteration changed anything. */
  uint64_t learned_cycle;
  uint64_t cycle_keys, cycle_calls;
  /* The manager's placement moved in the iteration that ends (its pinned
   * admission limit dropped): the next one differs, nothing is learned. */
  bool cycle_moved;
  /* The iteration that ends rose past every earlier one's peak in use
   * after the warmup (pool/resize.c, learning_check). */
  bool cycle_rose;
  /* Ended handles, reused first in, first out and only once more than
   * OFL__HANDLE_QUARANTINE wait: a handle freed twice with allocations
   * between is still found ended rather than taken for its next owner's. */
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
  ofl_pool_t *reg_next; /* the pools of the process (pool/reclaim.c) */
  /* A manager reports its iterations to this pool (ofl__pool_cycle_end);
   * until one does, the pool follows the iterations its device's managers
   * report to their device pools. pins: such a report under way (the
   * pool's destroy waits for it). Guarded by the registry's lock. */
  atomic_bool reported;
  unsigned pins;
  ofl__place_t plan;
};

/* ---- keys and free lists (lock held) ------------------------------------ */
pool_key_t *ofl__key_find(const ofl_pool_t *p, bool dynamic,
                          const int64_t *shape, int ndim, ofl_dtype_t dtype,
                          size_t bytes);
/* Allocates only on a key's first use; NULL when that fails. */
pool_key_t *ofl__key_get(ofl_pool_t *p, bool dynamic, const int64_t *shape,
                         int ndim, ofl_dtype_t dtype, size_t bytes);
void ofl__key_unlink(ofl_pool_t *p, pool_key_t *k);
/* Frees the records of keys with no block left. */
void ofl__keys_prune(ofl_pool_t *p);
void ofl__free_push(pool_key_t *k, pool_block_t *b);
/* Lock held: block b, just taken or made, counts in use: its bytes in the
 * stats' count and what it takes in in_use_need (b->need), and the peaks
 * after the rise: the stats' since the last reset, and the pool's ever and
 * this iteration's in in_use_need's count. */
void ofl__pool_in_use_add(ofl_pool_t *p, pool_block_t *b);
/* Lock held: held block b's bytes leave those in use (the stats' count and
 * in_use_need). */
void ofl__pool_in_use_sub(ofl_pool_t *p, pool_block_t *b);
void ofl__free_unlink(pool_key_t *k, pool_block_t *prev, pool_block_t *b);
/* Removes b (free, off its free list) from its key's blocks and the
 * counters. */
void ofl__key_forget(ofl_pool_t *p, pool_block_t *b);
/* A free block whose memory may go: its last use is over, and it lies
 * outside the reserve (a block there gives no memory back). */
bool ofl__block_idle(pool_block_t *b);

/* ---- headers and memory (lock not held) --------------------------------- */
pool_block_t *ofl__header_take(ofl_pool_t *p);
void ofl__header_retire(ofl_pool_t *p, pool_block_t *b);
/* Gives a block's memory back (to its segment, or the backend) and retires
 * its header. The block is unlinked already and its last use is over. */
void ofl__block_destroy(ofl_pool_t *p, pool_block_t *b);
/* Waits for a block's last use; false when it did not complete in time. */
bool ofl__block_quiesce(pool_block_t *b);
/* Records the block's last use on stream (section 5 rule 2); chains a
 * record of another handle on the same block first; poisons in strict
 * mode. */
ofl_status_t ofl__block_order(ofl_pool_t *p, pool_block_t *b,
                              ofl_stream_t *stream, bool last);

/* ---- blocks coming back (pool/pool_free.c) ------------------------------ */
/* Detaches t from its block and, when end_handle, ends the handle. expect
 * non-NULL: t's block must belong to expect (ofl_pool_free); stream
 * non-NULL: stream-ordered. Returns OFL_ERR_INVALID_ARG with nothing
 * changed for a foreign, wrapped, stale or already freed tensor. */
ofl_status_t ofl__pool_release(ofl_pool_t *expect, ofl_tensor_t *t,
                               ofl_stream_t *stream, bool end_handle);
/* A block's storage interface (pool_internal.h), set on every block. */
extern const ofl__storage_ops_t ofl__block_storage_ops;

/* ---- the pool (pool/pool.c) -------------------------------------------- */
/* Lock held: an ended handle goes to p's cache. */
void ofl__handle_cache_push(ofl_pool_t *p, ofl_tensor_t *t);
/* Destroys p and runs its ofl__pool_destroy_when_idle continuation. */
void ofl__pool_finish(ofl_pool_t *p);

/* ---- memory of the pool (pool/reclaim.c; the resize: pool/resize.c) ---- */
/* Registers a new pool / forgets a destroyed one. */
void ofl__pool_register(ofl_pool_t *p);
void ofl__pool_unregister(ofl_pool_t *p);
/* Lock held: takes the idle cached blocks of p off their keys into
 * *victims (only those carved from segments when segs_only: releasing a
 * block of its own gives the arena nothing), counting each a release;
 * returns their bytes. */
size_t ofl__pool_take_idle(ofl_pool_t *p, bool segs_only,
                           pool_block_t **victims);
/* Lock not held: destroys the blocks ofl__pool_take_idle took. */
void ofl__pool_destroy_victims(ofl_pool_t *p, pool_block_t *victims);
/* Memory for a block of bytes: a range of a segment (*range) when seg is
 * true, else memory of its own (*mem); grows the arena as needed. With a
 * stream, before growing it may hand back *reuse instead: a free block of
 * another key, carved from a segment, whose last use is still queued; its
 * range is large enough and stream waits for that use (as a same-key block
 * is handed out, pool.h), and it is off its key. On a backend refusal
 * releases the cached blocks of p and of the device's other pools of its
 * kind (waiting for their queued last uses) and their empty segments, and
 * tries once more; then OFL_ERR_NO_MEMORY with the pools' figures.
 * Lock not held. */
ofl_status_t ofl__pool_memory(ofl_pool_t *p, size_t bytes, bool seg,
                              ofl_stream_t *stream, ofl__range_t **range,
                              void **mem, pool_block_t **reuse);
/* Lock held, at a request that finds nothing in use: counts the idle point
 * and says whether a merge of the segments is due (ofl__pool_merge). */
bool ofl__pool_idle_point(ofl_pool_t *p);
/* Once a device pool whose sizes change (two byte sizes seen) grew and then
 * went a whole cycle, idle point to idle point, without growing (under a
 * manager, a pool of many sizes: three iterations, and only until its
 * twelfth iteration ended; see ofl__pool_idle_point), its segments
 * give way to one sized for the most bytes it ever had in use and a
 * margin: a block never spans two segments, and on the MoE benchmark the
 * gaps at the ends of 2 MiB segments held up to 1.55 times the peak in
 * use and made the pool grow in steady state. Section 5 rule 2: only when
 * every cached block's last use is known complete (queried, never waited
 * for); otherwise at a later idle point. Lock not held. */
void ofl__pool_merge(ofl_pool_t *p);
/* Lock not held: a free block taken off its key goes back to it. */
void ofl__block_relink(ofl_pool_t *p, pool_block_t *b);
/* What the resize (pool/resize.c) takes from reclaim.c. Lock not held in
 * each. A new segment of seg_bytes (merged: the one that replaces the
 * others, else grown for a request). */
ofl_status_t ofl__pool_grow(ofl_pool_t *p, size_t seg_bytes, bool merged);
/* Frees the memory of unlinked segments, counting the backend calls. */
void ofl__pool_free_segments(ofl_pool_t *p, ofl__segment_t *segs);
/* The ranges of idle cached blocks whose last use completed go back to
 * the arena (see reclaim.c); returns whether any did. */
bool ofl__pool_settle_pending(ofl_pool_t *p);
/* Lock held: whether p's layout follows its calls alone: a pool that
 * carves every block under a budget (the manager's pinned pool with a host
 * budget) starts each iteration from bare segments, reuses a key's oldest
 * free block, and gives cached blocks' ranges back only when a request
 * finds no room, all of them, whatever their copies' pace (pool/pool.c,
 * reclaim.c). */
bool ofl__pool_ordered(const ofl_pool_t *p);
/* The device pools of p's device that no manager reports to (at most max,
 * into q), each pinned: its unregister waits for ofl__pool_unpin. */
int ofl__pool_pin_followers(ofl_pool_t *p, ofl_pool_t **q, int max);
void ofl__pool_unpin(ofl_pool_t **q, int n);
/* Lock held: memory the pool holds from the backend. */
size_t ofl__pool_held(const ofl_pool_t *p);

/* ---- the placement plan (pool/plan.c) ----------------------------------- */
/* At the pool's creation: whether the plan may ever serve it. */
void ofl__place_init(ofl_pool_t *p);
/* Lock held, at each request: its ordinal (UINT32_MAX: the pool neither
 * records nor follows a plan); while recording, blocks whose last use
 * completed close their records. */
uint32_t ofl__place_tick(ofl_pool_t *p);
/* Lock held: b serves request ord of bytes (as asked; dynamic: byte-keyed)
 * (recording). */
void ofl__place_note_alloc(ofl_pool_t *p, pool_block_t *b, uint32_t ord,
                           size_t bytes, bool dynamic);
/* Lock held: b came back (recording). */
void ofl__place_note_free(ofl_pool_t *p, pool_block_t *b);
/* Lock held, at an iteration's end (cycles not yet counted): the records
 * roll over, and recording starts after the warmup. */
void ofl__place_cycle_end(ofl_pool_t *p);
/* Lock held: whether the records ask for more learning iterations (sizes
 * that changed, too few iterations recorded to place them). */
bool ofl__place_learning(const ofl_pool_t *p);
/* Lock not held, at the iteration's end that ended learning: makes the
 * plan and its segment when the records allow one, the segment at least
 * room bytes (what a merge would make) where the waste bound allows.
 * Returns whether it did. */
bool ofl__place_install(ofl_pool_t *p, size_t room);
/* Lock held: the slot for request ord of bytes: *range when no block lies
 * in it (a block is made on it), *b when a free block does (taken off its
 * key); false: the plan does not place it. */
bool ofl__place_pick(ofl_pool_t *p, uint32_t ord, size_t bytes,
                     ofl__range_t **range, pool_block_t **b, uint32_t *slot1);
/* Lock held: the block b made on slot slot1 of plan gen (or, on failure,
 * b NULL) settles: the slot records it, or, the plan ended meanwhile, b
 * owns the range (a failure gives it back). */
void ofl__place_made(ofl_pool_t *p, pool_block_t *b, ofl__range_t *range,
                     uint32_t slot1, uint32_t gen);
/* Lock held: the plan ends; its reserved ranges go back to the arena. */
void ofl__place_drop(ofl_pool_t *p);
/* The plan's records (pool destroy). */
void ofl__place_free(ofl_pool_t *p);

#endif /* OFL_POOL_BLOCK_H */
