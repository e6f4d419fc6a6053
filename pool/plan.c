/* ofl: the placement plan of a device pool of changing sizes
 * (pool/block.h; docs/design/memory.md, "The placement plan").
 *
 * A training iteration makes the same requests in the same order each
 * time, at sizes that may change (MoE expert blocks drawn anew). Placed one
 * at a time (best fit), blocks of a third of a segment end up wherever the
 * blocks before them left room, and a draw whose large blocks fall between
 * others finds its free bytes in pieces too small: the pool grows inside
 * the steady iterations (soak seed 1, draw 827: 696 KB asked, free ranges
 * of 576 and 678 KB). So while it learns, the pool records each request's
 * ordinal (its place in the iteration), the least and most bytes asked
 * there (the warmup's too, where it made as many requests), and how long
 * its block stayed busy, in requests: until freed, or, freed behind queued
 * work (a copy that reads it), until that work was seen complete (queried
 * at each request, never waited for). At the end of learning:
 * - ordinals whose ranges look alike (a name's tensors) form a class; each
 *   takes the class's most and a margin for the top of the range a dozen
 *   iterations did not draw (widen_classes);
 * - the ordinals are laid out in slots, each a fixed range of one new
 *   segment, shared by ordinals whose busy times never meet, greedy by
 *   size (lay_out): busy as in the slowest iteration recorded, or, where
 *   that needs more than the waste bound, as in the median one;
 * - past the slots the segment keeps room for requests the plan does not
 *   place.
 * From then on a request takes its ordinal's slot, its stream made to wait
 * for the last use still queued on the slot's previous block (section 5
 * rule 2). A request whose slot is held or too small, or past the learned
 * count, borrows another free slot, else the room; a request that finds
 * neither ends the plan, and best fit over the segment takes over (a
 * growth then, as without a plan). No plan where the iterations made
 * different numbers of requests, something was held across the end of
 * learning, or even the median slots pass the waste bound: best fit alone,
 * as before. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool/block.h"
#include "pool/tuning.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"

/* The constants (OFL__PLAN_MAX_ORDS, _WARM, _ALIKE_DIV, _GAP_K, _ROOM_DIV)
 * are in pool/tuning.h. A pool no manager reports to keeps the warmup's
 * sizes (8 KiB) until it is destroyed or they overflow. */

static bool eligible(const ofl_pool_t *p) {
  return p->kind == OFL_POOL_DEVICE && !p->has_allocator &&
         p->stats.budget_bytes == 0 && p->segments != OFL_POOL_SEGMENTS_OFF;
}

void ofl__place_init(ofl_pool_t *p) {
  if (!eligible(p))
    p->plan.nwarm = UINT32_MAX; /* nothing to record, ever */
}

static void stop_recording(ofl__place_t *pl) {
  pl->recording = false;
  free(pl->watch);
  pl->watch = NULL;
  pl->nwatch = pl->capwatch = 0;
}

/* The records go: nothing more follows from them (no plan was made, or it
 * ended). */
static void forget_records(ofl__place_t *pl) {
  free(pl->ords);
  pl->ords = NULL;
  pl->cap = pl->n = 0;
}

/* An ordinal's range of sizes takes in a request of need bytes. */
static void note_size(ofl__place_ord_t *o, size_t need) {
  if (need > o->bytes)
    o->bytes = need;
  if (o->lo == 0 || need < o->lo)
    o->lo = need;
}

static bool ords_room(ofl__place_t *pl, uint32_t need) {
  if (need <= pl->cap)
    return true;
  if (need > OFL__PLAN_MAX_ORDS)
    return false;
  uint32_t cap = pl->cap != 0 ? pl->cap : 64;
  while (cap < need)
    cap *= 2;
  ofl__place_ord_t *o = realloc(pl->ords, cap * sizeof *o);
  if (o == NULL)
    return false;
  memset(o + pl->cap, 0, (cap - pl->cap) * sizeof *o);
  pl->ords = o;
  pl->cap = cap;
  return true;
}

/* Lock held: the record of ordinal ord, made in iteration cycle, closes at
 * the request under way: its block was busy until then. */
static void end_at(ofl__place_t *pl, uint32_t ord, uint64_t cycle, uint64_t e) {
  /* recording starts with the iteration after the warmup (cycle 1) */
  if (ord >= pl->cap || cycle == 0 || cycle > OFL__LEARN_CYCLES)
    return;
  uint32_t e32 = e >= UINT32_MAX ? UINT32_MAX : (uint32_t)e;
  uint32_t *slot = &pl->ords[ord].ends[cycle - 1];
  if (e32 > *slot)
    *slot = e32;
}

/* Lock held: the request under way, counted from the start of iteration
 * cycle (UINT64_MAX: two or more iterations later). */
static uint64_t clock_since(const ofl_pool_t *p, uint64_t cycle) {
  const ofl__place_t *pl = &p->plan;
  if (cycle == p->cycles)
    return pl->clock;
  if (cycle + 1 == p->cycles)
    return (uint64_t)pl->prev_n + pl->clock;
  return UINT64_MAX;
}

static void close_at(ofl_pool_t *p, uint32_t ord, uint64_t cycle) {
  end_at(&p->plan, ord, cycle, clock_since(p, cycle));
}

/* Lock held: the watched blocks whose last use completed (queried, never
 * waited for), or that were taken again or destroyed, close their
 * records. */
static void poll_watch(ofl_pool_t *p) {
  ofl__place_t *pl = &p->plan;
  uint32_t j = 0;
  for (uint32_t i = 0; i < pl->nwatch; i++) {
    ofl__place_watch_t w = pl->watch[i];
    pool_block_t *b = w.b;
    bool done = b->ord_seq != w.seq || b->held || !atomic_load(&b->pending) ||
                ofl_event_query(b->ev) == OFL_SUCCESS;
    if (done)
      close_at(p, w.ord, w.cycle);
    else
      pl->watch[j++] = w;
  }
  pl->nwatch = j;
}

/* Lock held: the warmup's request of bytes (the first iteration of a
 * pool the plan may serve). */
static void note_warm(ofl_pool_t *p, size_t bytes) {
  ofl__place_t *pl = &p->plan;
  if (pl->nwarm == UINT32_MAX)
    return;
  if (pl->warm == NULL &&
      (pl->warm = malloc(OFL__PLAN_WARM * sizeof *pl->warm)) == NULL) {
    pl->nwarm = UINT32_MAX;
    return;
  }
  if (pl->nwarm == OFL__PLAN_WARM) {
    pl->nwarm = UINT32_MAX; /* too many to keep */
    free(pl->warm);
    pl->warm = NULL;
    return;
  }
  pl->warm[pl->nwarm++] = bytes;
}

uint32_t ofl__place_tick(ofl_pool_t *p) {
  ofl__place_t *pl = &p->plan;
  if (!pl->recording && !pl->active)
    return UINT32_MAX;
  if (pl->recording)
    poll_watch(p);
  if (pl->clock >= OFL__PLAN_MAX_ORDS) {
    pl->uneven |= pl->recording; /* too many requests to plan */
    return UINT32_MAX;
  }
  return pl->clock++;
}

void ofl__place_note_alloc(ofl_pool_t *p, pool_block_t *b, uint32_t ord,
                           size_t bytes, bool dynamic) {
  ofl__place_t *pl = &p->plan;
  /* The bytes asked, not the block's (whole pages for a byte key): a
   * range of draws that rounded to one page in learning reaches the next
   * one later, and the margin comes from the draws' own spread (seed 31,
   * draw 888: 266240 bytes at one place in five iterations, 270336
   * later). A request of none counts as one byte (0 means none yet). */
  size_t need = bytes != 0 ? bytes : 1;
  if (!pl->recording && !pl->active && p->cycles == 0 &&
      p->learned_cycle == 0 && eligible(p)) {
    note_warm(p, need);
    return;
  }
  if (!pl->recording || ord == UINT32_MAX) {
    b->ord_seq = 0; /* no record on this block */
    return;
  }
  if (!ords_room(pl, ord + 1)) {
    pl->uneven = true; /* too many to plan: the pool places as before */
    b->ord_seq = 0;
    return;
  }
  note_size(&pl->ords[ord], need);
  pl->ords[ord].dynamic |= dynamic;
  end_at(pl, ord, p->cycles, (uint64_t)ord + 1);
  b->ord = ord;
  b->ord_cycle = p->cycles;
  b->ord_seq = ++pl->seq;
}

void ofl__place_note_free(ofl_pool_t *p, pool_block_t *b) {
  ofl__place_t *pl = &p->plan;
  if (!pl->recording || b->ord_seq == 0)
    return;
  if (!atomic_load(&b->pending)) {
    close_at(p, b->ord, b->ord_cycle);
    return;
  }
  if (pl->nwatch == pl->capwatch) {
    uint32_t cap = pl->capwatch != 0 ? pl->capwatch * 2 : 32;
    ofl__place_watch_t *w = realloc(pl->watch, cap * sizeof *w);
    if (w == NULL) {
      pl->uneven = true;
      return;
    }
    pl->watch = w;
    pl->capwatch = cap;
  }
  pl->watch[pl->nwatch++] = (ofl__place_watch_t){
      .b = b, .seq = b->ord_seq, .cycle = b->ord_cycle, .ord = b->ord};
}

void ofl__place_cycle_end(ofl_pool_t *p) {
  ofl__place_t *pl = &p->plan;
  if (pl->active) {
    /* An iteration whose requests the plan did not fit (other requests
     * than the learned ones, other lifetimes: a tight pinned budget
     * changes what stays on the device) ends it here, with nothing in
     * use, rather than once a request finds no place: best fit then
     * starts from a whole segment. Not fitting: more than an eighth of
     * the requests missed their slots, or some did in two iterations in a
     * row (seed 32, draw 818: four or five of 72 an iteration, lent
     * slots, until one found none in iteration 10, and best fit among the
     * slots' blocks grew). */
    uint64_t missed = pl->misses - pl->misses_before;
    bool again = missed > 0 && pl->missed_last > 0;
    pl->missed_last = missed;
    pl->misses_before = pl->misses;
    pl->clock = 0;
    if (((missed > 1 && missed * OFL__PLAN_MISS_DIV > pl->n) || again) &&
        p->stats.blocks_in_use == 0)
      ofl__place_drop(p);
    return;
  }
  if (pl->recording && p->learned_cycle != 0) {
    stop_recording(pl); /* learning ended without a plan */
    forget_records(pl);
    return;
  }
  if (pl->recording) {
    if (pl->iters == 0) {
      pl->n = pl->clock;
      /* The warmup made as many requests: its sizes join the ranges. */
      pl->warm_used = pl->nwarm == pl->n && pl->n <= pl->cap;
      for (uint32_t i = 0; pl->warm_used && i < pl->n; i++)
        note_size(&pl->ords[i], pl->warm[i]);
      free(pl->warm);
      pl->warm = NULL;
      pl->nwarm = UINT32_MAX;
    } else if (pl->clock != pl->n) {
      pl->uneven = true; /* the iterations differ: no plan */
    }
    pl->iters++;
    pl->prev_n = pl->clock;
    pl->clock = 0;
    return;
  }
  /* The warmup ends (cycles counts it next): the iterations after it are
   * the ones that repeat. */
  if (p->cycles == 0 && p->learned_cycle == 0 && eligible(p)) {
    pl->recording = true;
    pl->clock = 0;
  }
}

/* Lock held: whether some ordinal was asked different sizes (records of
 * pl->n ordinals). */
static bool sizes_varied(const ofl__place_t *pl) {
  for (uint32_t i = 0; i < pl->n; i++)
    if (pl->ords[i].lo != pl->ords[i].bytes)
      return true;
  return false;
}

/* Lock held: whether the records ask for more learning iterations: the
 * requests' sizes changed from one iteration to another (the warmup's
 * included where it joined), and fewer than OFL__PLAN_MIN_ITERS were
 * recorded. A margin for the top of a range estimated from one or two
 * draws misses it: seed 31, draw 888, learning ended after two recorded
 * iterations, and five requests of the next two passed their slots. */
bool ofl__place_learning(const ofl_pool_t *p) {
  const ofl__place_t *pl = &p->plan;
  return pl->recording && !pl->uneven && pl->iters < OFL__PLAN_MIN_ITERS &&
         pl->n <= pl->cap && sizes_varied(pl);
}

/* ---- making the plan ----------------------------------------------------- */

/* An ordinal's busy time on the circle of the iteration's n requests, as
 * at most two pieces [lo, hi). */
typedef struct span {
  uint64_t lo[2], hi[2];
  int k;
  bool all;
} span_t;

static span_t span_of(const ofl__place_ord_t *o, uint32_t i, uint32_t n) {
  span_t s = {.k = 1};
  uint64_t e = o->end;
  if (e == UINT64_MAX || e >= (uint64_t)i + n) {
    s.all = true;
    return s;
  }
  s.lo[0] = i;
  s.hi[0] = e <= n ? e : n;
  if (e > n) {
    s.lo[1] = 0;
    s.hi[1] = e - n;
    s.k = 2;
  }
  return s;
}

static bool spans_meet(const span_t *a, const span_t *b) {
  if (a->all || b->all)
    return true;
  for (int x = 0; x < a->k; x++)
    for (int y = 0; y < b->k; y++)
      if (a->lo[x] < b->hi[y] && b->lo[y] < a->hi[x])
        return true;
  return false;
}

/* Lock held: the root of ordinal i's class (union-find, path halving). */
static uint32_t class_root(uint32_t *up, uint32_t i) {
  while (up[i] != i) {
    up[i] = up[up[i]];
    i = up[i];
  }
  return i;
}

/* Whether two ordinals' ranges of sizes look like draws of one range (a
 * name's tensors): their least and their most each within an eighth of
 * the two spans together. Fixed sizes match only their own size. */
static bool ranges_alike(const ofl__place_ord_t *a, const ofl__place_ord_t *b) {
  size_t tol = ((a->bytes - a->lo) + (b->bytes - b->lo)) / OFL__PLAN_ALIKE_DIV;
  size_t dlo = a->lo > b->lo ? a->lo - b->lo : b->lo - a->lo;
  size_t dhi = a->bytes > b->bytes ? a->bytes - b->bytes : b->bytes - a->bytes;
  return dlo <= tol && dhi <= tol;
}

/* Each ordinal's class (ordinals whose ranges look alike: a name's
 * tensors, drawn anew each iteration) gives it the class's most, so that a
 * draw any of them saw fits each of their places, and a margin past it:
 * OFL__PLAN_GAP_K times the expected gap between that most and the range's
 * true end (the span over the draws seen), which a dozen iterations leave
 * undrawn. The layout takes all, some or none of the margin (set_sizes). */
static bool widen_classes(ofl__place_t *pl, uint32_t draws) {
  uint32_t n = pl->n;
  uint32_t *up = malloc(n * sizeof *up);
  uint32_t *members = malloc(n * sizeof *members);
  size_t *lo = malloc(n * sizeof *lo), *hi = malloc(n * sizeof *hi);
  if (up == NULL || members == NULL || lo == NULL || hi == NULL) {
    free(up);
    free(members);
    free(lo);
    free(hi);
    return false;
  }
  for (uint32_t i = 0; i < n; i++) {
    up[i] = i;
    members[i] = 0;
  }
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = i + 1; j < n; j++)
      if (ranges_alike(&pl->ords[i], &pl->ords[j]))
        up[class_root(up, j)] = class_root(up, i);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t c = class_root(up, i);
    if (members[c]++ == 0) {
      lo[c] = pl->ords[i].lo;
      hi[c] = pl->ords[i].bytes;
    }
    lo[c] = pl->ords[i].lo < lo[c] ? pl->ords[i].lo : lo[c];
    hi[c] = pl->ords[i].bytes > hi[c] ? pl->ords[i].bytes : hi[c];
  }
  for (uint32_t i = 0; i < n; i++) {
    uint32_t c = class_root(up, i);
    uint64_t seen = (uint64_t)members[c] * (draws ? draws : 1);
    size_t margin = (size_t)((hi[c] - lo[c]) * OFL__PLAN_GAP_K / (seen + 1));
    margin = (margin + 255) / 256 * 256;
    pl->ords[i].most = hi[c];
    pl->ords[i].margin = margin;
    pl->ords[i].lo = lo[c];
  }
  free(up);
  free(members);
  free(lo);
  free(hi);
  return true;
}

typedef struct by_size {
  size_t bytes;
  uint32_t i;
} by_size_t;

static int by_bytes_desc(const void *x, const void *y) {
  const by_size_t *a = x, *b = y;
  if (a->bytes != b->bytes)
    return a->bytes > b->bytes ? -1 : 1;
  return a->i < b->i ? -1 : (a->i > b->i);
}

/* Lay the n ordinals out in slots (greedy by size); returns the number of
 * slots and their sizes in *sizes (malloc'd), 0 on failure. */
static uint32_t lay_out(ofl__place_t *pl, size_t **sizes_out, size_t *total) {
  uint32_t n = pl->n;
  by_size_t *order = malloc(n * sizeof *order);
  uint32_t *next = malloc(n * sizeof *next); /* members of a slot */
  uint32_t *head = malloc(n * sizeof *head);
  size_t *sizes = malloc(n * sizeof *sizes);
  span_t *spans = malloc(n * sizeof *spans);
  if (order == NULL || next == NULL || head == NULL || sizes == NULL ||
      spans == NULL) {
    free(order);
    free(next);
    free(head);
    free(sizes);
    free(spans);
    return 0;
  }
  for (uint32_t i = 0; i < n; i++) {
    order[i] = (by_size_t){.bytes = pl->ords[i].bytes, .i = i};
    spans[i] = span_of(&pl->ords[i], i, n);
  }
  qsort(order, n, sizeof *order, by_bytes_desc);
  uint32_t nslots = 0;
  *total = 0;
  for (uint32_t x = 0; x < n; x++) {
    uint32_t i = order[x].i;
    uint32_t best = UINT32_MAX;
    for (uint32_t s = 0; s < nslots; s++) {
      if (sizes[s] < pl->ords[i].bytes ||
          (best != UINT32_MAX && sizes[s] >= sizes[best]))
        continue;
      bool clash = false;
      for (uint32_t j = head[s]; j != UINT32_MAX && !clash; j = next[j])
        clash = spans_meet(&spans[i], &spans[j]);
      if (!clash)
        best = s;
    }
    if (best == UINT32_MAX) {
      best = nslots++;
      sizes[best] = pl->ords[i].bytes;
      head[best] = UINT32_MAX;
      *total += sizes[best];
    }
    pl->ords[i].slot = best;
    next[i] = head[best];
    head[best] = i;
  }
  free(order);
  free(next);
  free(head);
  free(spans);
  *sizes_out = sizes;
  return nslots;
}

/* The sizes the layout uses: each class's most and num/den of its margin,
 * as the block of a request of that many bytes takes them (whole pages for
 * a byte key, then the arena's rounding). */
static void set_sizes(ofl_pool_t *p, size_t num, size_t den) {
  ofl__place_t *pl = &p->plan;
  size_t page = OFL_POOL_PAGE_BYTES;
  for (uint32_t i = 0; i < pl->n; i++) {
    size_t m = pl->ords[i].margin / den * num;
    size_t want = pl->ords[i].most + m;
    if (pl->ords[i].dynamic)
      want = (want + page - 1) / page * page;
    pl->ords[i].bytes = ofl__arena_need(&p->arena, want);
  }
}

/* The ends the layout uses: each ordinal's latest over the iterations
 * recorded (how 0), their median (the upper one; how 1) or their earliest
 * (how 2). Not only until freed where the layout allows: the next request
 * on the slot would then wait for every copy that reads the block, and
 * compute would queue behind the offload. The earliest is never before
 * the block was freed (its program order), so a slot's block is never
 * still held when its next ordinal comes, only still read by a copy. */
static void choose_ends(ofl__place_t *pl, int how) {
  uint32_t n = pl->iters < OFL__LEARN_CYCLES ? pl->iters : OFL__LEARN_CYCLES;
  for (uint32_t i = 0; i < pl->n; i++) {
    uint32_t v[OFL__LEARN_CYCLES], k = 0;
    for (uint32_t j = 0; j < n; j++) {
      uint32_t e = pl->ords[i].ends[j];
      if (e == 0)
        continue;
      uint32_t x = k++;
      while (x > 0 && v[x - 1] > e) { /* insertion */
        v[x] = v[x - 1];
        x--;
      }
      v[x] = e;
    }
    uint32_t e = k == 0     ? i + 1
                 : how == 1 ? v[k / 2]
                 : how == 2 ? v[0]
                            : v[k - 1];
    pl->ords[i].end = e == UINT32_MAX ? UINT64_MAX : e;
  }
}

/* The segment for slots of total bytes: a sixteenth more, for requests the
 * plan does not place. */
static size_t plan_segment(size_t total) {
  size_t step = OFL__ARENA_MERGE_ROUND;
  size_t seg = total + total / OFL__PLAN_ROOM_DIV;
  return (seg + step - 1) / step * step;
}

/* The most a planned pool holds for most bytes in use at once: the waste
 * bound's 13/10, or a minimum segment more for a small pool (whose
 * segments were never smaller). */
static size_t waste_bound(size_t most) {
  size_t a = most / OFL__WASTE_DEN * OFL__WASTE_NUM;
  size_t b = most + OFL__ARENA_SEGMENT_MIN;
  return a > b ? a : b;
}

bool ofl__place_install(ofl_pool_t *p, size_t room) {
  ofl__place_t *pl = &p->plan;
  pthread_mutex_lock(&p->mu);
  bool carves = p->byte_keys_made >= 2 && p->arena.nsegs > 0;
  bool ok = pl->recording && !pl->uneven && pl->iters >= 2 && pl->n > 0 &&
            pl->n <= pl->cap && carves && p->stats.blocks_in_use == 0 &&
            !p->merging && eligible(p);
  const char *why_not =
      !carves || !eligible(p) ? NULL
      : pl->uneven
          ? "its iterations made different numbers of requests, or too many"
      : pl->iters < 2               ? "fewer than two iterations learned"
      : p->stats.blocks_in_use != 0 ? "blocks in use at the end of learning"
                                    : "a merge under way";
  /* Blocks still queued at the end of the last iteration stay busy into
   * the next one's first request; older ones throughout. */
  for (uint32_t i = 0; ok && i < pl->nwatch; i++) {
    ofl__place_watch_t w = pl->watch[i];
    end_at(pl, w.ord, w.cycle,
           w.cycle + 1 == p->cycles ? (uint64_t)pl->prev_n + 1 : UINT64_MAX);
  }
  stop_recording(pl);
  /* A pool whose requests never changed size repeats its layout as it is
   * (and must not make a call after the warmup: fixed shapes). */
  if (ok && !sizes_varied(pl)) {
    ok = false;
    why_not = NULL;
  }
  ok = ok && widen_classes(pl, pl->iters + (pl->warm_used ? 1u : 0u));
  /* The bound is the waste bound of a typical iteration's peak (the mean
   * of the learning iterations'), not of the highest: the iterations after
   * learning are held to their own peak. */
  size_t most = p->most_in_use_bytes, seg = 0;
  if (p->peaks_n > 0 && p->peaks_mean < (double)most)
    most = (size_t)p->peaks_mean;
  size_t *sizes = NULL, total = 0;
  uint32_t nslots = 0;
  /* Each ordinal busy as long as in its slowest iteration, its slot as
   * large as its class's most and margin; where that passes the waste
   * bound, less of the margin, then busy as in its median iteration, then
   * as in its fastest (a request that finds its slot's last block still
   * read by a copy makes its stream wait for the copy). With the median
   * alone, a drawn workload whose slots sat at the bound (4.60-4.72 MB
   * for 4.73) got no plan when a loaded machine slowed its copies, and
   * best fit grew (test_pool_plan, workload 16, in CI). */
  static const size_t quarters[] = {4, 2, 1, 0};
  for (int k = 0; ok && k < 12 && nslots == 0; k++) {
    choose_ends(pl, k / 4);
    set_sizes(p, quarters[k % 4], 4);
    nslots = lay_out(pl, &sizes, &total);
    /* The slots within the waste bound; past them, room for the requests
     * the plan does not place: a sixteenth, or as much as the merged
     * segment of the pool's learning would keep, within the bound. */
    size_t cap = waste_bound(most);
    seg = plan_segment(total);
    if (room > seg)
      seg = room;
    if (seg > cap)
      seg = cap > total ? cap / OFL__ARENA_MERGE_ROUND * OFL__ARENA_MERGE_ROUND
                        : total;
    if (seg < total)
      seg = total;
    if (nslots != 0 && total > cap) {
      free(sizes);
      sizes = NULL;
      nslots = 0;
    }
  }
  if (nslots == 0) {
    if (ok)
      why_not = "its slots pass the waste bound";
    if (why_not != NULL && pl->n > 0)
      OFL_INFO(OFL_SUBSYS_POOL,
               "pool %s: no placement plan (%s; %u requests an iteration, "
               "%zu bytes of slots at the least, bound %zu): best fit as "
               "before",
               p->name, why_not, pl->n, total, waste_bound(most));
    forget_records(pl);
    pthread_mutex_unlock(&p->mu);
    free(sizes);
    return false;
  }
  p->merging = true; /* no merge at an idle point meanwhile */
  pthread_mutex_unlock(&p->mu);
  /* Between iterations: the cached blocks' last uses are waited for, so
   * that every range can go back. */
  (void)ofl__pool_settle_pending(p);
  pool_block_t *victims = NULL;
  pthread_mutex_lock(&p->mu);
  (void)ofl__pool_take_idle(p, false, &victims);
  pthread_mutex_unlock(&p->mu);
  ofl__pool_destroy_victims(p, victims);
  size_t old = 0;
  pthread_mutex_lock(&p->mu);
  ofl__segment_t *segs = ofl__arena_take_idle(&p->arena, &old);
  bool bare = p->arena.nsegs == 0 && p->stats.blocks_in_use == 0;
  pthread_mutex_unlock(&p->mu);
  ofl__pool_free_segments(p, segs);
  ofl_status_t s = bare ? ofl__pool_grow(p, seg, true) : OFL_ERR_INVALID_USAGE;
  pthread_mutex_lock(&p->mu);
  p->merging = false;
  ofl__place_slot_t *slots =
      s == OFL_SUCCESS ? calloc(nslots, sizeof *slots) : NULL;
  bool placed = slots != NULL;
  for (uint32_t i = 0; placed && i < nslots; i++)
    placed =
        (slots[i].range = ofl__arena_take_low(&p->arena, sizes[i])) != NULL;
  if (!placed && slots != NULL) {
    for (uint32_t i = 0; i < nslots && slots[i].range != NULL; i++)
      ofl__arena_give(&p->arena, slots[i].range);
    free(slots);
    slots = NULL;
  }
  if (slots != NULL) {
    pl->slots = slots;
    pl->nslots = nslots;
    pl->bytes = total;
    pl->active = true;
    pl->clock = 0;
    p->merged_bytes = seg;
    p->merge_made = true;
  }
  pthread_mutex_unlock(&p->mu);
  free(sizes);
  if (slots != NULL)
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: placement plan of %u requests an iteration in %u "
             "slots, %zu bytes, in a segment of %zu (most in use %zu)",
             p->name, pl->n, nslots, total, seg, most);
  return slots != NULL;
}

/* ---- following the plan -------------------------------------------------- */

/* Lock held: whether slot s can take a request of need bytes now: large
 * enough, and no block, or a free one still on its key's free list (one a
 * release is destroying is not). *prev_out: its predecessor there. */
static bool slot_free(ofl__place_slot_t *sl, size_t need,
                      pool_block_t **prev_out) {
  if (need > sl->range->bytes || sl->making)
    return false;
  pool_block_t *b = sl->block;
  if (b == NULL)
    return true;
  if (b->held)
    return false;
  pool_block_t *prev = NULL, *x = b->key->free_head;
  for (; x != NULL && x != b; prev = x, x = x->next) {
  }
  *prev_out = prev;
  return x != NULL;
}

/* Lock held: a free slot of the plan's lends itself to a request the plan
 * did not place (its ordinal's slot held or too small, or past the
 * iteration's count: an iteration that made other requests than the
 * learned ones). The smallest that fits, one whose block's last use
 * completed before one whose use is still queued. Its own ordinal, later,
 * may then find it held and borrow in turn; an iteration with many such
 * misses ends the plan (ofl__place_cycle_end). UINT32_MAX: none. */
static uint32_t slot_lend(ofl__place_t *pl, size_t need) {
  uint32_t best = UINT32_MAX;
  bool best_idle = false;
  for (uint32_t s = 0; s < pl->nslots; s++) {
    pool_block_t *prev = NULL;
    ofl__place_slot_t *sl = &pl->slots[s];
    if (!slot_free(sl, need, &prev))
      continue;
    bool idle = sl->block == NULL || ofl__block_idle(sl->block);
    if (best == UINT32_MAX || (idle && !best_idle) ||
        (idle == best_idle &&
         sl->range->bytes < pl->slots[best].range->bytes)) {
      best = s;
      best_idle = idle;
    }
  }
  return best;
}

bool ofl__place_pick(ofl_pool_t *p, uint32_t ord, size_t bytes,
                     ofl__range_t **range, pool_block_t **b_out,
                     uint32_t *slot1) {
  ofl__place_t *pl = &p->plan;
  *range = NULL;
  *b_out = NULL;
  if (!pl->active)
    return false;
  size_t need = ofl__arena_need(&p->arena, bytes);
  uint32_t s = ord < pl->n ? pl->ords[ord].slot : UINT32_MAX;
  pool_block_t *prev = NULL;
  if (s == UINT32_MAX || !slot_free(&pl->slots[s], need, &prev)) {
    pl->misses++;
    s = slot_lend(pl, need);
    if (s == UINT32_MAX || !slot_free(&pl->slots[s], need, &prev))
      return false;
  }
  ofl__place_slot_t *sl = &pl->slots[s];
  *slot1 = s + 1;
  pool_block_t *b = sl->block;
  if (b == NULL) {
    *range = sl->range;
    sl->making = true; /* until ofl__place_made */
    return true;
  }
  /* A free block lies in the slot: off its key, for the new owner (the
   * key kept until ofl__place_made, which a failed wait relinks it to). */
  sl->making = true;
  b->key->creating++;
  ofl__free_unlink(b->key, prev, b);
  ofl__key_forget(p, b);
  *b_out = b;
  return true;
}

void ofl__place_made(ofl_pool_t *p, pool_block_t *b, ofl__range_t *range,
                     uint32_t slot1, uint32_t gen) {
  ofl__place_t *pl = &p->plan;
  if (pl->active && gen == pl->gen) {
    ofl__place_slot_t *sl = &pl->slots[slot1 - 1];
    sl->making = false;
    sl->block = b;
    if (b != NULL)
      b->slot1 = slot1;
    return;
  }
  /* The plan ended meanwhile: its drop left this range taken, and a block
   * on it owns it (slot1 0). */
  if (b == NULL)
    ofl__arena_give(&p->arena, range);
  else
    b->slot1 = 0;
}

void ofl__place_drop(ofl_pool_t *p) {
  ofl__place_t *pl = &p->plan;
  if (pl->active)
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: placement plan ended (iteration %llu): its requests "
             "did not fit the learned ones; best fit over the segment "
             "from here (%llu requests placed outside their slots so far)",
             p->name, (unsigned long long)p->cycles + 1,
             (unsigned long long)pl->misses);
  for (uint32_t i = 0; i < pl->nslots; i++) {
    pool_block_t *b = pl->slots[i].block;
    if (pl->slots[i].making) {
      /* A block being made or taken over on it: ofl__place_made leaves
       * it the whole range (or gives the range back on a failure). */
      if (b != NULL)
        b->slot1 = 0;
    } else if (b != NULL) {
      /* The block owns the range now, trimmed to its bytes where no use
       * of a larger block on it may still be queued: best fit gets the
       * slot's slack. */
      b->slot1 = 0;
      if (!atomic_load(&b->pending) || ofl_event_query(b->ev) == OFL_SUCCESS)
        ofl__arena_trim(&p->arena, b->range, b->st.bytes);
    } else {
      ofl__arena_give(&p->arena, pl->slots[i].range);
    }
  }
  free(pl->slots);
  pl->slots = NULL;
  pl->nslots = 0;
  forget_records(pl);
  if (pl->active)
    pl->gen++;
  pl->active = false;
}

void ofl__place_free(ofl_pool_t *p) {
  ofl__place_t *pl = &p->plan;
  stop_recording(pl);
  free(pl->slots);
  free(pl->ords);
  free(pl->warm);
  memset(pl, 0, sizeof *pl);
}
