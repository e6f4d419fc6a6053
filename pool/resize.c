/* ofl: a pool's learning and its resize (docs/DESIGN.md section 4,
 * docs/design/memory.md): at each iteration's end a manager reports
 * (ofl__pool_cycle_end) the pool learns its sizes and the variation of its
 * peaks and gaps, resizes its segments to one sized for the most in use
 * and that variation, gives back what the iterations after the warmup did
 * not use, or makes room ahead of the next iteration; at idle
 * points a device pool of changing sizes merges its segments
 * (ofl__pool_idle_point, ofl__pool_merge). Where the memory comes from and
 * how it goes back on a release or out of memory: pool/reclaim.c. */
#include <math.h>
#include <stdint.h>

#include "pool/block.h"
#include "pool/tuning.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"

/* ---- merging segments ---------------------------------------------------- */

/* The constants (RESIZE_DIV, LEARN_CYCLES, MANY_SIZES, MERGE_CYCLES,
 * ROOM_DIV, SPREAD_K, SPREAD_MIN_N) are in pool/tuning.h; why these values,
 * in docs/design/memory.md ("Tuning constants"). */

/* Lock held: whether the pool is in its learning iterations, under a
 * manager (cycles > 0) only. */
static bool learning(const ofl_pool_t *p) {
  return p->cycles > 0 && p->learned_cycle == 0;
}

/* Lock held: the most in use a pool sizes its segments for. A pinned pool
 * under a manager, once an iteration after the warmup ended: the most of
 * those iterations (the one under way included), not the warmup's, which
 * offloads every group before the plan keeps some on the device and is
 * higher by up to a half (a pool sized for it held 2.7 times the steady
 * peak). Else the most it ever had in use: a device pool's peaks move with
 * the sizes drawn (MoE), and the warmup's is one of those draws. */
static size_t most_of(const ofl_pool_t *p) {
  if (p->cycles < 2 || p->kind != OFL_POOL_PINNED)
    return p->most_in_use_bytes;
  return p->cycle_most_bytes > p->steady_most_bytes ? p->cycle_most_bytes
                                                    : p->steady_most_bytes;
}

/* Lock held, at the end of a learning iteration after the warmup: its
 * peak in use joins the ones spread_of reads (Welford's update). An
 * iteration that used nothing says nothing of the spread. */
static void note_peak(ofl_pool_t *p, size_t peak) {
  if (peak == 0)
    return;
  p->peaks_n++;
  double d = (double)peak - p->peaks_mean;
  p->peaks_mean += d / (double)p->peaks_n;
  p->peaks_m2 += d * ((double)peak - p->peaks_mean);
}

/* Lock held: the room a device pool keeps for its peaks to spread,
 * OFL__SPREAD_K standard deviations of its learning iterations' peaks once
 * OFL__SPREAD_MIN_N of them ended (0 before, and for a pinned pool, whose
 * room is OFL__ROOM_DIV's). */
static size_t spread_of(const ofl_pool_t *p) {
  if (p->kind != OFL_POOL_DEVICE || p->peaks_n < OFL__SPREAD_MIN_N)
    return 0;
  double sd = sqrt(p->peaks_m2 / (double)(p->peaks_n - 1));
  double room = sd * OFL__SPREAD_K;
  return room < (double)(SIZE_MAX / 4) ? (size_t)room : SIZE_MAX / 4;
}

/* Lock held: the bytes of the merged segment for most bytes in use, bytes
 * as the merge rules size it (ofl__arena_merge_bytes: most, a margin of
 * 3/16, a minimum segment; the floor a segment too small set), and room
 * for the variation the pool's learning showed, added to the margin up to
 * OFL__MERGE_SLACK_MIN, never past it:
 * - the spread of its learning iterations' peaks (spread_of): a small pool
 *   of few large blocks whose peaks varied widely (2.52 MB most in use in a
 *   3.01 MB segment, 3.21 MB later, blocks up to 1.37 MB);
 * - gaps: a take while it learned left no free range whole for its largest
 *   block though the free ranges held that much in all (the arena's
 *   short_bytes): all of OFL__MERGE_SLACK_MIN, the least a resize keeps
 *   free, since the shortfall seen is one layout's and the next
 *   iterations' differ (123 KB short seen while learning; 770 KB free in
 *   pieces of at most 324 KB for a 336 KB block later).
 * A large pool's 3/16 is already wider (the MoE benchmark's, at 1.28 times
 * its peak in use, had no room for more), and a pool of fixed shapes shows
 * neither. 0 on overflow. */
static size_t merge_size(const ofl_pool_t *p, size_t most, size_t bytes) {
  size_t spread = spread_of(p);
  bool gaps = p->arena.short_bytes != 0;
  size_t step = OFL__ARENA_MERGE_ROUND;
  if (bytes == 0 || (spread == 0 && !gaps) ||
      most > SIZE_MAX - OFL__MERGE_SLACK_MIN - step)
    return bytes;
  size_t cap = most + OFL__MERGE_SLACK_MIN;
  if (bytes >= cap)
    return bytes;
  size_t want = !gaps && spread < cap - bytes ? bytes + spread : cap;
  return (want + step - 1) / step * step;
}

static bool remerge_due(const ofl_pool_t *p);

/* Whether a pool holding held bytes is past the waste bound of most bytes
 * in use (OFL__WASTE_NUM / OFL__WASTE_DEN times it). */
static bool past_waste(size_t held, size_t most) {
  return held > most / OFL__WASTE_DEN * OFL__WASTE_NUM;
}

/* Lock held, at an iteration's end: learning ends after an iteration that
 * made no new key and no backend call (a pool that has seen every size it
 * will see has nothing left to learn, and a resize for a peak a little
 * higher would be an allocation and a free inside the steady iterations:
 * fixed shapes, 1F1B pp 4, made 10 of each in the 20 after the warmup),
 * nor in which the manager's placement moved (the next iteration's
 * differs: pipeline/tier.c's pinned admission), nor in which the peak in
 * use outgrew the merged segment (remerge_due), nor, for a device pool that
 * merges, in which its peak rose past every earlier iteration's after the
 * warmup (the first after the warmup has none before it): such a pool's
 * peak moves with the sizes drawn and with copy timing (blocks go back as
 * their copies are seen done), and one that stopped after the first
 * iteration past the warmup had learned no spread and grew when a later
 * peak came 7% higher (2.13 MB learned in a 2.49 MB segment, 2.28 MB
 * later, its free bytes in pieces of at most 64 KB), nor while a pool the
 * placement plan may serve, whose requests change size, has recorded
 * fewer than OFL__PLAN_MIN_ITERS iterations (ofl__place_learning). At the
 * latest after OFL__LEARN_CYCLES iterations. */
static void learning_check(ofl_pool_t *p) {
  uint64_t calls = p->stats.backend_allocs + p->stats.backend_frees;
  /* A device pool that merges (byte keys of changing sizes, no budget). */
  bool merges = p->kind == OFL_POOL_DEVICE && p->byte_keys_made >= 2 &&
                p->stats.budget_bytes == 0;
  bool changed = p->keys_made != p->cycle_keys || calls != p->cycle_calls ||
                 p->cycle_moved || remerge_due(p) ||
                 (merges && p->cycle_rose) || ofl__place_learning(p);
  /* The gaps are watched while a device pool that merges learns. */
  p->arena.watch = p->learned_cycle == 0 && merges;
  p->cycle_keys = p->keys_made;
  p->cycle_calls = calls;
  if (p->learned_cycle != 0 || (changed && p->cycles < OFL__LEARN_CYCLES))
    return;
  p->learned_cycle = p->cycles;
  p->arena.watch = false;
  OFL_INFO(OFL_SUBSYS_POOL,
           "pool %s: learning ended after iteration %llu: %zu held, most in "
           "use %zu, spread %zu (%llu peaks, mean %.0f), gaps %zu",
           p->name, (unsigned long long)p->cycles, ofl__pool_held(p),
           most_of(p), spread_of(p), (unsigned long long)p->peaks_n,
           p->peaks_mean, p->arena.short_bytes);
}

/* Replaces the segments by one of bytes sized for most in use (0: by none)
 * (ofl__pool_merge; shrink: a resize at an iteration's end, which also
 * replaces a single segment a minimum segment larger than bytes). */
static void merge_into(ofl_pool_t *p, size_t most, size_t bytes, bool shrink);

/* Lock held, at an iteration's end (cycles counts it already): whether a
 * learning pool with nothing in use resizes its segments to one of *bytes
 * for its most in use (most_of; a pinned pool's: of the iterations after
 * the warmup, whose peak may be higher). After the warmup alone, only a
 * pool past the waste bound of the warmup's own peak (last item).
 * Due:
 * - when the iterations after the warmup used none of it (a reload pool
 *   the plan stopped using): everything goes back, *bytes 0;
 * - when its segments came from growth alone (no merge sized them) and it
 *   holds less than its most in use and three quarters of a merged
 *   segment's margin: a pool of changing sizes fragments, and with a
 *   twelfth free (a pinned pool's room) or a first 2 MiB segment for
 *   1.6 MB (an application's pool under a tight pinned budget, whose peak
 *   moves with what stays on the device) grew after learning; the segment
 *   it resizes to keeps at least OFL__MERGE_SLACK_MIN free;
 * - a pool that holds more than that segment and more than the waste
 *   bound (OFL__WASTE_NUM / OFL__WASTE_DEN times its most). Already at the
 *   warmup's end, for the warmup's peak: a pinned pool's blocks' ranges
 *   come back as their copies end, so slow copies fragment it (fixed
 *   shapes under valgrind: eight 2 MiB segments for a 12.8 MB warmup peak,
 *   seven for 11.7 MB at speed), and a resize for that at the first
 *   iteration's end was 9 calls in the iterations after the warmup, which
 *   fixed shapes must pass without one. A device pool that grew a second
 *   segment in the warmup holds two for a peak a little above one; one of
 *   shape keys never merges at idle points (a single byte size), and one
 *   whose merge waits for an idle point made it inside the steady
 *   iterations (seed 31: draw 550 held 4.33 MB for a steady peak of 1.84
 *   MB; draw 508 merged 4.19 MB into 2.69 MB in the second iteration after
 *   its learning, when a second byte size first came).
 * Under a budget (the manager's pinned pool, whose segments count against
 * it) only the first and the last, within the budget: a pinned pool that
 * the plan leaves unused (the last stage keeps its one microbatch on the
 * device) held 4 MiB for a steady peak of 0.
 * A pool within the bound and the margin (a fixed-shape workload's) makes
 * no call. */
static bool resize_due(const ofl_pool_t *p, bool learn, size_t *most_out,
                       size_t *bytes) {
  /* The warmup's end (cycles counts it already): a pool past the waste
   * bound of the warmup's own peak. */
  bool warm_end = p->cycles == 1;
  if (!learn || p->arena.nsegs == 0 || (p->cycles < 2 && !warm_end) ||
      p->stats.blocks_in_use != 0 || p->merging)
    return false;
  size_t budget = p->stats.budget_bytes; /* 0: none */
  size_t held = p->arena.held_bytes;
  *bytes = 0;
  *most_out = 0;
  if (!warm_end && p->steady_most_bytes == 0)
    return true;
  size_t most = most_of(p);
  size_t want = ofl__arena_merge_bytes(&p->arena, most);
  /* A resize for the steady iterations keeps at least the slack: a small
   * pool's gaps are a larger share of it. */
  size_t step = OFL__ARENA_MERGE_ROUND;
  if (want == 0 || most > SIZE_MAX - OFL__MERGE_SLACK_MIN - step)
    return false;
  size_t least = (most + OFL__MERGE_SLACK_MIN + step - 1) / step * step;
  if (want < least)
    want = least;
  if (want < p->merge_floor_bytes)
    want = p->merge_floor_bytes;
  *bytes = want;
  *most_out = most;
  /* Past the waste bound, and more than the resized segment. */
  if (past_waste(held, most) && held > want + OFL__ARENA_MERGE_ROUND &&
      (budget == 0 || want <= budget))
    return true;
  /* Under a budget it grows only for a request, within the budget; at the
   * warmup's end only the waste bound applies. */
  if (budget != 0 || warm_end)
    return false;
  /* Short of margin: only a pool whose segments came from growth alone
   * (never sized by a merge or a resize; a merged one resizes for higher
   * peaks by its own rules). */
  return p->merged_bytes == 0 && held < most + (want - most) / 4 * 3;
}

/* Lock held, at the iteration's end that ended learning at its latest
 * (OFL__LEARN_CYCLES: the pool still changed, its merges sized from the
 * iterations before them): whether a device pool that merges (changing
 * sizes, no budget) and holds a merged segment, with nothing in use, holds
 * less than the merged segment its learning asks for, the variation it
 * showed included (merge_size), by more than a 32nd (OFL__RESIZE_DIV). Not
 * a pool whose segments came from growth alone, nor one whose last merge
 * kept the segment it grew: resize_due sizes those, and a larger segment
 * is not a safer one (a 2 MiB segment held a 1.42 MB peak through the
 * steady iterations; resized to 2.49 MB, its gaps left 1.81 MB free in
 * pieces of at most 672 KB at 677 KB in use; soak seed 3, draw 191, gaps
 * seen while learning. Another kept 2 MiB segment that had seen gaps grew
 * after learning, and resized it passed: seed 1, draw 827. Which layout
 * fails is luck, so the rule stays as it was). A resize now, between
 * iterations and before the steady ones, is its last call. A pool whose
 * learning ended on a quiet iteration (fixed shapes) makes none: its last
 * call stays where it was. *bytes: that segment's, *most_out: most_of. */
static bool widen_due(const ofl_pool_t *p, size_t *most_out, size_t *bytes) {
  if (p->learned_cycle < OFL__LEARN_CYCLES || p->learned_cycle != p->cycles ||
      p->kind != OFL_POOL_DEVICE || p->byte_keys_made < 2 ||
      p->stats.budget_bytes != 0 || p->stats.blocks_in_use != 0 || p->merging ||
      p->merged_bytes == 0 || !p->merge_made ||
      (spread_of(p) == 0 && p->arena.short_bytes == 0))
    return false;
  *most_out = most_of(p);
  *bytes =
      merge_size(p, *most_out, ofl__arena_merge_bytes(&p->arena, *most_out));
  return *bytes != 0 && p->arena.held_bytes + *bytes / OFL__RESIZE_DIV < *bytes;
}

/* Lock held: whether learning ended while the pool recorded its requests
 * (the placement plan is made now, pool/plan.c); *room: the segment a
 * merge at this point would make, the room the plan keeps at least. */
static bool plan_due(const ofl_pool_t *p, size_t *room) {
  if (!p->plan.recording || p->learned_cycle == 0)
    return false;
  size_t most = most_of(p);
  size_t bytes = ofl__arena_merge_bytes(&p->arena, most);
  if (bytes != 0 && bytes < p->merge_floor_bytes)
    bytes = p->merge_floor_bytes;
  *room = merge_size(p, most, bytes);
  return true;
}

static void cycle_end(ofl_pool_t *p, bool moved) {
  pthread_mutex_lock(&p->mu);
  p->cycle_moved = moved;
  ofl__place_cycle_end(p);
  bool learn = p->cycles == 0 || learning(p);
  /* The first iteration after the warmup has no peak before it: it
   * counts as a rise. */
  p->cycle_rose =
      p->cycles == 1 ||
      (p->cycles >= 2 && p->cycle_most_bytes > p->steady_most_bytes);
  if (p->cycles >= 1 && p->cycle_most_bytes > p->steady_most_bytes)
    p->steady_most_bytes = p->cycle_most_bytes; /* not the warmup's */
  if (p->cycles >= 1 && learn)
    note_peak(p, p->cycle_most_bytes);
  p->cycle_most_bytes = p->in_use_need;
  p->cycles++;
  size_t resize = 0, most = 0;
  if (resize_due(p, learn, &most, &resize)) {
    pthread_mutex_unlock(&p->mu);
    /* Between iterations: the cached blocks' last uses (the reloads'
     * copies) are waited for, so that every range can go back. */
    (void)ofl__pool_settle_pending(p);
    merge_into(p, most, resize, true);
    pthread_mutex_lock(&p->mu);
    learning_check(p); /* the resize counts as a change */
    size_t room = 0;
    bool plan = plan_due(p, &room);
    pthread_mutex_unlock(&p->mu);
    if (plan)
      (void)ofl__place_install(p, room);
    return;
  }
  most = most_of(p);
  size_t held = p->arena.held_bytes;
  bool room = p->kind == OFL_POOL_PINNED && p->arena.nsegs > 0 &&
              p->stats.budget_bytes == 0 && learn &&
              held < most + most / OFL__ROOM_DIV;
  /* Just the room missing, in whole minimum segments (an eighth of what
   * it holds, the growth of a request, took the stand-in's pinned pool to
   * 1.27 times its peak in use on one draw). */
  size_t want = 0;
  if (room) {
    size_t step = OFL__ARENA_SEGMENT_MIN;
    want = (most + most / OFL__ROOM_DIV - held + step - 1) / step * step;
  }
  pthread_mutex_unlock(&p->mu);
  if (want != 0 && ofl__pool_grow(p, want, false) != OFL_SUCCESS)
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: no room made ahead of the next iteration (%s)", p->name,
             ofl_last_error());
  /* A device pool of a few sizes that grew in this iteration merges now,
   * between iterations, rather than at an idle point of the next one:
   * there the merge (a free per segment and an allocation) falls inside
   * the iterations that follow the warmup, which a pool of fixed sizes
   * must pass without a call. */
  pthread_mutex_lock(&p->mu);
  bool merge = p->kind == OFL_POOL_DEVICE && p->grew && !p->merging &&
               !p->plan.active && p->byte_keys_made >= 2 &&
               p->byte_keys_made <= OFL__MANY_SIZES &&
               p->stats.budget_bytes == 0 && p->stats.blocks_in_use == 0;
  pthread_mutex_unlock(&p->mu);
  if (merge)
    ofl__pool_merge(p);
  pthread_mutex_lock(&p->mu);
  learning_check(p); /* a room made or a merge counts as a change */
  size_t plan_bytes = 0;
  bool plan = plan_due(p, &plan_bytes);
  pthread_mutex_unlock(&p->mu);
  /* Learning ended: the placement plan replaces the segments when the
   * records allow one (pool/plan.c). */
  if (plan && ofl__place_install(p, plan_bytes))
    return;
  pthread_mutex_lock(&p->mu);
  bool widen = widen_due(p, &most, &resize);
  pthread_mutex_unlock(&p->mu);
  if (widen) {
    (void)ofl__pool_settle_pending(p);
    merge_into(p, most, resize, false);
  }
}

/* The device pools of p's device that no manager reports to (an
 * application's pool whose tensors a manager offloads while it reloads
 * into a pool of its own) end an iteration with p: without it such a pool
 * never learned, its merges came at idle points two iterations after a
 * growth, inside the steady iterations. At most FOLLOW_MAX of them. */
#define FOLLOW_MAX 16
static void follow_cycle(ofl_pool_t *p, bool moved) {
  ofl_pool_t *q[FOLLOW_MAX];
  int n = ofl__pool_pin_followers(p, q, FOLLOW_MAX);
  for (int i = 0; i < n; i++)
    cycle_end(q[i], moved);
  ofl__pool_unpin(q, n);
}

void ofl__pool_cycle_end_moved(ofl_pool_t *p, bool moved) {
  if (p == NULL)
    return;
  atomic_store(&p->reported, true);
  cycle_end(p, moved);
  if (p->kind == OFL_POOL_DEVICE)
    follow_cycle(p, moved);
}

void ofl__pool_cycle_end(ofl_pool_t *p) { ofl__pool_cycle_end_moved(p, false); }

bool ofl__pool_idle_point(ofl_pool_t *p) {
  p->idle_points++;
  /* Not in a pool of fixed sizes, whose cached blocks would all miss once
   * after it, nor with a budget (blocks of their own). Nor in a pinned
   * pool: each new segment is an eighth of what it holds, so its ends
   * waste little where it holds much (the MoE benchmark's pinned pool
   * holds tens of MB in 8 MiB segments, 1.04 to 1.21 times its peak in
   * use), and a registration costs far more than a device allocation. */
  if (p->merging || p->kind != OFL_POOL_DEVICE || p->byte_keys_made < 2 ||
      p->stats.budget_bytes != 0 || p->plan.active)
    return false;
  /* After a growth, once a whole cycle went without one: a merge costs a
   * free per segment and an allocation, not to be paid every cycle while
   * the pool still grows. */
  if (p->grew) {
    /* A pool of many sizes under a manager merges only while it learns
     * (learning_check). Later its segments stay as they are: a merge then
     * would cost an allocation and a free per segment inside the steady
     * iterations to save a grown segment's slack (MoE bench, seed 22, host
     * backend: a growth in iteration 13 with 15% of the merged segment free
     * in pieces, its merge in iteration 16). A pool of a few sizes merges
     * after any growth, at least to the size the growth proved missing
     * (note_merge_too_small). */
    if (p->cycles > 0 && p->byte_keys_made > OFL__MANY_SIZES)
      return learning(p) && p->cycles >= p->grown_cycle + OFL__MERGE_CYCLES;
    return p->idle_points >= p->grown_at + 2;
  }
  /* Within a few idle points of a merge (under a manager: while it learns,
   * learning_check), a peak in use that rose past the one it was sized for
   * merges again: the cycles that follow the last growth often climb a
   * little further. */
  bool resize = p->cycles > 0
                    ? learning(p)
                    : p->idle_points <= p->merged_at + OFL__RESIZE_IDLE;
  return resize && remerge_due(p);
}

/* Lock held: whether the most in use rose past the peak the last merge
 * sized the segment for (a device pool of changing sizes, no budget). Under
 * a manager such a pool has not learned yet: its next idle point merges
 * again (ofl__pool_idle_point). Learning that ended in the iteration whose
 * peak rose left the segment's margin below a block (2.2 MB in use in a
 * 2.6 MB segment of blocks up to 337 KB), and the pool grew after it. */
static bool remerge_due(const ofl_pool_t *p) {
  return p->kind == OFL_POOL_DEVICE && p->merged_at != 0 &&
         p->byte_keys_made >= 2 && p->stats.budget_bytes == 0 &&
         most_of(p) >
             p->merged_most_bytes + p->merged_most_bytes / OFL__RESIZE_DIV;
}

/* Lock held: whether every free block outside the reserve has its last
 * use complete (event queries only: no wait). */
static bool cache_quiet(ofl_pool_t *p) {
  for (pool_key_t *k = p->keys; k != NULL; k = k->lnext)
    for (pool_block_t *b = k->free_head; b != NULL; b = b->next)
      if (!b->carved && !ofl__block_idle(b))
        return false;
  return true;
}

void ofl__pool_merge(ofl_pool_t *p) {
  pthread_mutex_lock(&p->mu);
  size_t most = most_of(p);
  size_t bytes = ofl__arena_merge_bytes(&p->arena, most);
  if (bytes != 0 && bytes < p->merge_floor_bytes)
    bytes = p->merge_floor_bytes; /* a segment that proved too small */
  /* The room for learning's variation only where the merge makes a
   * segment anyway: one segment as large stays (widen_due). */
  if (bytes != 0 && !(p->arena.nsegs == 1 && p->arena.held_bytes >= bytes))
    bytes = merge_size(p, most, bytes);
  pthread_mutex_unlock(&p->mu);
  merge_into(p, most, bytes, false);
}

static void merge_into(ofl_pool_t *p, size_t most, size_t bytes, bool shrink) {
  pool_block_t *victims = NULL;
  pthread_mutex_lock(&p->mu);
  if (p->merging || p->stats.blocks_in_use != 0 || !cache_quiet(p)) {
    pthread_mutex_unlock(&p->mu); /* a later idle point tries again */
    return;
  }
  p->grew = false;
  size_t held = p->arena.held_bytes;
  /* A pinned pool's resize past the waste bound goes ahead however close:
   * the one segment the warmup's end sized for the warmup's peak held 3.3
   * MB for a steady peak of 1.1 MB. */
  if (p->arena.nsegs == 1 && held >= bytes && bytes != 0 &&
      (!shrink ||
       (held < bytes + OFL__ARENA_SEGMENT_MIN && !past_waste(held, most)))) {
    /* One segment already as large (and, for a resize, not a minimum
     * segment larger, nor past the waste bound): a merge would
     * free it and make it again (two backend calls) for nothing. */
    p->merged_most_bytes = most;
    p->merged_at = p->idle_points;
    p->merged_bytes = p->arena.held_bytes;
    p->merge_made = false;
    pthread_mutex_unlock(&p->mu);
    return;
  }
  p->merging = true;
  (void)ofl__pool_take_idle(p, false, &victims);
  pthread_mutex_unlock(&p->mu);
  ofl__pool_destroy_victims(p, victims);
  size_t old = 0;
  pthread_mutex_lock(&p->mu);
  /* Segments a concurrent request carved from meanwhile stay. */
  ofl__segment_t *segs = ofl__arena_take_idle(&p->arena, &old);
  p->merged_most_bytes = most;
  p->merged_at = p->idle_points;
  if (segs == NULL)
    p->merging = false;
  pthread_mutex_unlock(&p->mu);
  if (segs == NULL)
    return;
  ofl__pool_free_segments(p, segs);
  if (bytes == 0) { /* nothing in use to make room for */
    pthread_mutex_lock(&p->mu);
    p->merging = false;
    p->merged_bytes = 0;
    pthread_mutex_unlock(&p->mu);
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: segments of %zu bytes given back: the iterations "
             "after the warmup used none of them",
             p->name, old);
    return;
  }
  ofl_status_t s = ofl__pool_grow(p, bytes, true);
  pthread_mutex_lock(&p->mu);
  p->merging = false;
  p->merged_bytes = s == OFL_SUCCESS ? bytes : 0;
  p->merge_made = s == OFL_SUCCESS;
  pthread_mutex_unlock(&p->mu);
  if (s != OFL_SUCCESS)
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: %zu bytes of segments freed to merge them, and the "
             "merged segment of %zu refused; the pool grows again when it "
             "needs to",
             p->name, old, bytes);
  else
    OFL_INFO(OFL_SUBSYS_POOL,
             "pool %s: segments of %zu bytes merged into one of %zu (most "
             "in use %zu)",
             p->name, old, bytes, most);
}
