/* ofl: the arena of a pool: segments of device or pinned memory, each one
 * backend call (one registration for pinned memory), sub-allocated best fit
 * (a small request from the top of the highest free range that fits) in
 * ranges that coalesce with their free neighbours when they come back
 * (docs/DESIGN.md section 4). The arena knows nothing of keys or streams:
 * the pool hands a range back only once its block's last use completed.
 *
 * Locking: the caller's lock (the pool's) guards every call except
 * ofl__arena_backend_alloc / _free, which reach the backend and run outside
 * it. Not installed. */
#ifndef OFL_POOL_ARENA_H
#define OFL_POOL_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ofl/pool.h>

#include "pool/tuning.h"

typedef struct ofl__segment ofl__segment_t;

/* A piece of a segment, free or handed out. Records are reused, never
 * freed before the arena: steady state allocates nothing. */
typedef struct ofl__range {
  char *base;
  size_t bytes;
  ofl__segment_t *seg;
  struct ofl__range *prev, *next;   /* the segment's ranges, by address */
  struct ofl__range *fprev, *fnext; /* the arena's free ranges */
  bool free;
} ofl__range_t;

struct ofl__segment {
  void *base;
  size_t bytes;
  size_t used; /* ranges handed out */
  ofl__range_t *first;
  ofl__segment_t *prev, *next;
};

typedef struct ofl__arena {
  ofl_device_t *dev;
  ofl_pool_kind_t kind;
  size_t granule; /* range starts and sizes are multiples of it */
  ofl__segment_t *segs;
  ofl__range_t *free_ranges;
  ofl__range_t *spare; /* records for splits */
  size_t held_bytes;   /* bytes of all segments */
  size_t free_bytes;   /* bytes of free ranges */
  uint64_t nsegs;
  size_t largest; /* the largest range handed out */
  /* While watch (a device pool that learns, pool/resize.c): the most a take
   * left the largest free range short of largest while the free ranges held
   * that much in all, gaps rather than a lack of room. */
  bool watch;
  size_t short_bytes;
} ofl__arena_t;

void ofl__arena_init(ofl__arena_t *a, ofl_device_t *dev, ofl_pool_kind_t kind);
/* A range of at least bytes (rounded to the granule), best fit (a small
 * request: the top of the highest free range that fits); NULL when no
 * free range is large enough (or no record could be made). */
ofl__range_t *ofl__arena_take(ofl__arena_t *a, size_t bytes);
/* The bytes a request of bytes takes: whole granules, at least one. */
size_t ofl__arena_need(const ofl__arena_t *a, size_t bytes);
/* A range of bytes (rounded to the granule) from the bottom of the lowest
 * free range that fits (the placement plan's slots, laid out in order);
 * NULL when none fits. */
ofl__range_t *ofl__arena_take_low(ofl__arena_t *a, size_t bytes);
/* A range handed out keeps its first bytes (rounded to the granule); the
 * rest becomes free, merged with a free next neighbour. Nothing changes
 * when no record can be made. */
void ofl__arena_trim(ofl__arena_t *a, ofl__range_t *r, size_t bytes);
/* Gives r back; it merges with free neighbours. */
void ofl__arena_give(ofl__arena_t *a, ofl__range_t *r);
/* The bytes of the segment to add for a request of bytes: geometric growth
 * in steps of an eighth of what the arena holds (at least
 * OFL__ARENA_SEGMENT_MIN), never past room (bytes the budget leaves; 0:
 * no limit) nor below the request. 0 when the request does not fit room. */
size_t ofl__arena_grow_bytes(const ofl__arena_t *a, size_t bytes, size_t room);
/* The bytes of the one segment that replaces all of them
 * (ofl__pool_merge): most_bytes (the most in use it is sized for) and a
 * margin for the gaps between blocks of changing sizes and for the peaks of
 * cycles still to come (3/16 of it), at least the largest range handed
 * out and a minimum segment, in whole granules of OFL__ARENA_MERGE_ROUND.
 * 0 on overflow. */
size_t ofl__arena_merge_bytes(const ofl__arena_t *a, size_t most_bytes);
/* The backend calls, lock not held. */
ofl_status_t ofl__arena_backend_alloc(ofl__arena_t *a, size_t bytes,
                                      void **out);
bool ofl__arena_backend_free(ofl__arena_t *a, void *base);
/* Adds memory from ofl__arena_backend_alloc as a segment; false when its
 * records cannot be made (the caller frees the memory). */
bool ofl__arena_add(ofl__arena_t *a, void *base, size_t bytes);
/* Unlinks the segments with nothing handed out and returns them in a list
 * (next) for ofl__arena_free_segments outside the lock; *bytes gets their
 * size. */
ofl__segment_t *ofl__arena_take_idle(ofl__arena_t *a, size_t *bytes);
/* Frees the memory of unlinked segments (lock not held); returns how many
 * backend calls succeeded. */
uint64_t ofl__arena_free_segments(ofl__arena_t *a, ofl__segment_t *list);
/* Frees every segment and record (pool destroy); returns the backend calls
 * that succeeded. */
uint64_t ofl__arena_destroy(ofl__arena_t *a);

#endif /* OFL_POOL_ARENA_H */
