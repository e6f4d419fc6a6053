/* ofl: the arena of a pool (pool/arena.h): segments from the backend, best
 * fit over the free ranges (small requests from the top), coalescing on the way
 * back. Free ranges are few (their neighbours are merged), so one list scanned
 * whole is the index. */
#include <stdlib.h>

#include "pool/arena.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"

/* The granules, growth and merge margin are in pool/tuning.h. */

void ofl__arena_init(ofl__arena_t *a, ofl_device_t *dev, ofl_pool_kind_t kind) {
  *a = (ofl__arena_t){.dev = dev, .kind = kind};
  a->granule =
      kind == OFL_POOL_PINNED ? OFL__GRANULE_PINNED : OFL__GRANULE_DEVICE;
}

static ofl__range_t *record_get(ofl__arena_t *a) {
  ofl__range_t *r = a->spare;
  if (r != NULL) {
    a->spare = r->next;
    return r;
  }
  return malloc(sizeof *r);
}

static void record_put(ofl__arena_t *a, ofl__range_t *r) {
  r->next = a->spare;
  a->spare = r;
}

static void free_link(ofl__arena_t *a, ofl__range_t *r) {
  r->free = true;
  r->fprev = NULL;
  r->fnext = a->free_ranges;
  if (a->free_ranges != NULL)
    a->free_ranges->fprev = r;
  a->free_ranges = r;
  a->free_bytes += r->bytes;
}

static void free_unlink(ofl__arena_t *a, ofl__range_t *r) {
  if (r->fprev != NULL)
    r->fprev->fnext = r->fnext;
  else
    a->free_ranges = r->fnext;
  if (r->fnext != NULL)
    r->fnext->fprev = r->fprev;
  r->fprev = r->fnext = NULL;
  r->free = false;
  a->free_bytes -= r->bytes;
}

/* Whether a request is small beside the blocks the arena hands out: an
 * eighth of the largest range or less (OFL__ARENA_SMALL_DIV). */
static bool small_request(const ofl__arena_t *a, size_t need) {
  return need <= a->largest / OFL__ARENA_SMALL_DIV;
}

/* Lock held: the free range a request of need takes. A large one: best
 * fit. A small one: the fitting range highest in memory, carved from its
 * top, so that small blocks stack at the segment's top end and the large
 * ones' gaps stay whole below them (best fit put a 4 KB block into the
 * hole a 256 KB block left, and the next 256 KB block found two holes of
 * 241 and 244 KB). */
static ofl__range_t *range_pick(ofl__arena_t *a, size_t need, bool small) {
  ofl__range_t *best = NULL;
  for (ofl__range_t *r = a->free_ranges; r != NULL; r = r->fnext) {
    if (r->bytes < need)
      continue;
    if (small) {
      if (best == NULL || (uintptr_t)r->base > (uintptr_t)best->base)
        best = r;
    } else if (best == NULL || r->bytes < best->bytes) {
      best = r;
      if (r->bytes == need)
        break;
    }
  }
  return best;
}

/* Lock held: r keeps its first low bytes, and a new record after it in
 * address order holds the rest (not linked as free); NULL, with nothing
 * changed, when no record could be made. */
static ofl__range_t *split_after(ofl__arena_t *a, ofl__range_t *r, size_t low) {
  ofl__range_t *n = record_get(a);
  if (n == NULL)
    return NULL;
  *n = (ofl__range_t){.base = r->base + low,
                      .bytes = r->bytes - low,
                      .seg = r->seg,
                      .prev = r,
                      .next = r->next};
  if (r->next != NULL)
    r->next->prev = n;
  r->next = n;
  r->bytes = low;
  return n;
}

/* Lock held: splits need bytes off free range r, from its top (top) or its
 * bottom; the rest stays free in r's place; returns the range handed out,
 * or NULL when no record could be made. */
static ofl__range_t *range_split(ofl__arena_t *a, ofl__range_t *r, size_t need,
                                 bool top) {
  size_t low = top ? r->bytes - need : need;
  free_unlink(a, r);
  ofl__range_t *n = split_after(a, r, low);
  if (n == NULL) {
    free_link(a, r); /* still free, whole */
    return NULL;
  }
  free_link(a, top ? r : n);
  return top ? n : r;
}

/* Lock held, after a take while the arena is watched: how far the gaps
 * left the largest free range short of the largest range handed out, when
 * the free ranges hold that much in all. */
static void note_short(ofl__arena_t *a) {
  if (a->free_bytes < a->largest)
    return;
  size_t most = 0;
  for (ofl__range_t *r = a->free_ranges; r != NULL; r = r->fnext) {
    if (r->bytes >= a->largest)
      return; /* the largest block still fits whole */
    if (r->bytes > most)
      most = r->bytes;
  }
  if (a->largest - most > a->short_bytes)
    a->short_bytes = a->largest - most;
}

size_t ofl__arena_need(const ofl__arena_t *a, size_t bytes) {
  size_t need = (bytes + a->granule - 1) / a->granule * a->granule;
  return need < bytes || need == 0 ? a->granule : need;
}

/* Lock held: need bytes of free range r handed out, from its top (top) or
 * its bottom; NULL when no record could be made. */
static ofl__range_t *hand_out(ofl__arena_t *a, ofl__range_t *r, size_t need,
                              bool top) {
  if (r->bytes > need) {
    r = range_split(a, r, need, top);
    if (r == NULL)
      return NULL;
  } else {
    free_unlink(a, r);
  }
  r->seg->used++;
  if (need > a->largest)
    a->largest = need;
  return r;
}

ofl__range_t *ofl__arena_take(ofl__arena_t *a, size_t bytes) {
  size_t need = ofl__arena_need(a, bytes);
  bool small = small_request(a, need);
  ofl__range_t *best = range_pick(a, need, small);
  if (best == NULL || (best = hand_out(a, best, need, small)) == NULL)
    return NULL;
  if (a->watch)
    note_short(a);
  return best;
}

ofl__range_t *ofl__arena_take_low(ofl__arena_t *a, size_t bytes) {
  size_t need = ofl__arena_need(a, bytes);
  ofl__range_t *best = NULL;
  for (ofl__range_t *r = a->free_ranges; r != NULL; r = r->fnext)
    if (r->bytes >= need &&
        (best == NULL || (uintptr_t)r->base < (uintptr_t)best->base))
      best = r;
  return best == NULL ? NULL : hand_out(a, best, need, false);
}

/* Lock held: r absorbs its next neighbour (free, unlinked from the free
 * list already). */
static void absorb_next(ofl__arena_t *a, ofl__range_t *r) {
  ofl__range_t *n = r->next;
  r->bytes += n->bytes;
  r->next = n->next;
  if (n->next != NULL)
    n->next->prev = r;
  record_put(a, n);
}

void ofl__arena_trim(ofl__arena_t *a, ofl__range_t *r, size_t bytes) {
  size_t keep = ofl__arena_need(a, bytes);
  ofl__range_t *n = keep < r->bytes ? split_after(a, r, keep) : NULL;
  if (n == NULL)
    return; /* nothing to trim, or no record: the range stays whole */
  if (n->next != NULL && n->next->free) {
    free_unlink(a, n->next);
    absorb_next(a, n);
  }
  free_link(a, n);
}

void ofl__arena_give(ofl__arena_t *a, ofl__range_t *r) {
  r->seg->used--;
  if (r->next != NULL && r->next->free) {
    free_unlink(a, r->next);
    absorb_next(a, r);
  }
  if (r->prev != NULL && r->prev->free) {
    ofl__range_t *p = r->prev;
    free_unlink(a, p);
    absorb_next(a, p);
    r = p;
  }
  free_link(a, r);
}

size_t ofl__arena_grow_bytes(const ofl__arena_t *a, size_t bytes, size_t room) {
  const size_t step = OFL__ARENA_SEGMENT_MIN;
  size_t want = a->held_bytes / OFL__GROWTH_DIV;
  if (want < bytes)
    want = bytes;
  if (want > SIZE_MAX - step)
    return 0;
  want = (want + step - 1) / step * step;
  if (room != 0 && want > room)
    want = room;
  return want >= bytes ? want : 0;
}

size_t ofl__arena_merge_bytes(const ofl__arena_t *a, size_t most_bytes) {
  const size_t step = OFL__ARENA_MERGE_ROUND;
  size_t margin = most_bytes / OFL__MERGE_MARGIN_DEN * OFL__MERGE_MARGIN_NUM;
  if (most_bytes > SIZE_MAX - margin - step)
    return 0;
  size_t want = most_bytes + margin;
  if (want < a->largest)
    want = a->largest;
  /* Never below the smallest segment a growth makes: a pool of a few
   * hundred KB merged into a segment its size fragmented where the 2 MiB it
   * grew first did not, and grew and merged again (blocks of 30-120 KB
   * drawn anew each iteration: the largest free range 90 KB of 196 KB). */
  if (want < OFL__ARENA_SEGMENT_MIN)
    want = OFL__ARENA_SEGMENT_MIN;
  return (want + step - 1) / step * step;
}

ofl_status_t ofl__arena_backend_alloc(ofl__arena_t *a, size_t bytes,
                                      void **out) {
  if (a->kind == OFL_POOL_PINNED)
    return ofl_pinned_malloc(a->dev, bytes, out);
  return ofl_device_malloc(a->dev, bytes, out);
}

bool ofl__arena_backend_free(ofl__arena_t *a, void *base) {
  if (a->kind == OFL_POOL_PINNED)
    return ofl_pinned_free(a->dev, base) == OFL_SUCCESS;
  return ofl_device_free(a->dev, base) == OFL_SUCCESS;
}

bool ofl__arena_add(ofl__arena_t *a, void *base, size_t bytes) {
  ofl__segment_t *s = calloc(1, sizeof *s);
  ofl__range_t *r = record_get(a);
  if (s == NULL || r == NULL) {
    free(s);
    if (r != NULL)
      record_put(a, r);
    return false;
  }
  /* Whole granules only: a tail shorter than one is never handed out. */
  size_t usable = bytes / a->granule * a->granule;
  *r = (ofl__range_t){.base = base, .bytes = usable, .seg = s};
  s->base = base;
  s->bytes = bytes;
  s->first = r;
  s->next = a->segs;
  if (a->segs != NULL)
    a->segs->prev = s;
  a->segs = s;
  a->held_bytes += bytes;
  a->nsegs++;
  free_link(a, r);
  return true;
}

ofl__segment_t *ofl__arena_take_idle(ofl__arena_t *a, size_t *bytes) {
  ofl__segment_t *list = NULL;
  size_t got = 0;
  ofl__segment_t *s = a->segs;
  while (s != NULL) {
    ofl__segment_t *sn = s->next;
    if (s->used == 0) {
      /* One free range spans it (its neighbours merged). */
      free_unlink(a, s->first);
      record_put(a, s->first);
      s->first = NULL;
      if (s->prev != NULL)
        s->prev->next = s->next;
      else
        a->segs = s->next;
      if (s->next != NULL)
        s->next->prev = s->prev;
      a->held_bytes -= s->bytes;
      a->nsegs--;
      got += s->bytes;
      s->prev = NULL;
      s->next = list;
      list = s;
    }
    s = sn;
  }
  *bytes = got;
  return list;
}

uint64_t ofl__arena_free_segments(ofl__arena_t *a, ofl__segment_t *list) {
  uint64_t n = 0;
  while (list != NULL) {
    ofl__segment_t *s = list;
    list = s->next;
    n += ofl__arena_backend_free(a, s->base);
    free(s);
  }
  return n;
}

uint64_t ofl__arena_destroy(ofl__arena_t *a) {
  uint64_t n = 0;
  ofl__segment_t *s = a->segs;
  while (s != NULL) {
    ofl__segment_t *sn = s->next;
    ofl__range_t *r = s->first;
    while (r != NULL) {
      ofl__range_t *rn = r->next;
      free(r);
      r = rn;
    }
    n += ofl__arena_backend_free(a, s->base);
    free(s);
    s = sn;
  }
  while (a->spare != NULL) {
    ofl__range_t *r = a->spare;
    a->spare = r->next;
    free(r);
  }
  a->segs = NULL;
  a->free_ranges = NULL;
  a->held_bytes = a->free_bytes = 0;
  a->nsegs = 0;
  return n;
}
