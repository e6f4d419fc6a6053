/* ofl: the pool's tuning constants in one place, each with the reason in a
 * line; the measurements behind them are in docs/design/memory.md
 * ("Tuning constants"). Not installed. */
#ifndef OFL_POOL_TUNING_H
#define OFL_POOL_TUNING_H

#include <stddef.h>

/* ---- keys and handles (pool/pool.c, pool/block.c) ------------------------ */

/* Hash buckets of the key table: a model has tens to hundreds of keys. */
#define OFL__POOL_NBUCKETS 256u
/* Ended handles that wait before reuse: a double free is still found. */
#define OFL__HANDLE_QUARANTINE ((size_t)32)
/* Blocks carved from the reserve start on cudaMalloc's alignment. */
#define OFL__RESERVE_ALIGN ((size_t)256)

/* ---- segments (pool/arena.c) --------------------------------------------- */

/* Smallest segment; a segment is a whole number of these. */
#define OFL__ARENA_SEGMENT_MIN ((size_t)2 << 20)
/* A merged segment is a whole number of these. */
#define OFL__ARENA_MERGE_ROUND ((size_t)64 << 10)
/* Device ranges follow cudaMalloc's 256-byte alignment. */
#define OFL__GRANULE_DEVICE ((size_t)256)
/* Pinned ranges are whole pages: O_DIRECT bounce buffers need them. */
#define OFL__GRANULE_PINNED ((size_t)4096)
/* A request of at most 1/SMALL_DIV of the largest range handed out is
 * small: it is carved from the top of the highest free range that fits.
 * A quarter took 4 KB blocks among 20 KB ones (a full pinned pool under a
 * budget) for small: best fit packs blocks of comparable sizes better. */
#define OFL__ARENA_SMALL_DIV ((size_t)8)
/* A new segment is at least 1/GROWTH_DIV of what is held: few calls, little
 * tail. */
#define OFL__GROWTH_DIV 8u
/* A merged segment holds the most in use and 3/16 more, for the gaps (and,
 * for a small device pool whose learning showed variation, more: up to
 * OFL__MERGE_SLACK_MIN, pool/resize.c merge_size). */
#define OFL__MERGE_MARGIN_NUM 3u
#define OFL__MERGE_MARGIN_DEN 16u
/* A segment resized at an iteration's end keeps at least this much free: a
 * small pool's gaps are a larger share of it. Also the most a merged
 * segment's margin grows to for the variation a device pool's learning
 * showed (its peaks' spread, gaps), and all of it where gaps were seen:
 * within the bound of a segment above the peak that a small pool has. */
#define OFL__MERGE_SLACK_MIN (OFL__ARENA_SEGMENT_MIN / 2)

/* ---- learning and merging (pool/resize.c) -------------------------------- */

/* A merge resizes for a peak more than 1/RESIZE_DIV above its own... */
#define OFL__RESIZE_DIV 32u
/* ...within this many idle points of it (a pool with no manager). */
#define OFL__RESIZE_IDLE 6u
/* Iterations a pool under a manager learns at most: MoE peaks keep rising. */
#define OFL__LEARN_CYCLES 12u
/* More byte sizes than this: a pool of changing sizes (MoE expert blocks). */
#define OFL__MANY_SIZES 64u
/* Such a pool merges after this many iterations without growth. */
#define OFL__MERGE_CYCLES 3u
/* A learning pinned pool keeps 1/ROOM_DIV of its most in use free. */
#define OFL__ROOM_DIV 12u
/* A device pool's merged segment keeps room for this many standard
 * deviations of its learning iterations' peaks (after the warmup; from
 * SPREAD_MIN_N of them: three say little of their spread), its margin at
 * most OFL__MERGE_SLACK_MIN: with few large blocks of sizes drawn anew each
 * iteration, the twelve iterations' highest peak is not the next twenty's
 * (2.52 MB learned, 3.21 MB later, blocks up to 1.37 MB). */
#define OFL__SPREAD_K 2u
#define OFL__SPREAD_MIN_N 4u
/* The waste bound: a learning pool holding more than 13/10 of its steady
 * iterations' most in use resizes down. */
#define OFL__WASTE_NUM 13u
#define OFL__WASTE_DEN 10u

/* ---- the placement plan (pool/plan.c) ----------------------------------- */

/* Requests per iteration a plan covers at most (its records: ~100 B each;
 * laying them out is quadratic, under the pool's lock, once). */
#define OFL__PLAN_MAX_ORDS 2048u
/* The warmup's sizes are kept for this many requests at most (8 KiB). */
#define OFL__PLAN_WARM 1024u
/* Two ordinals' ranges of sizes are one class when their least and their
 * most each lie within 1/PLAN_ALIKE_DIV of their spans together: a name's
 * tensors drawn anew each iteration differ by sampling only. */
#define OFL__PLAN_ALIKE_DIV 8u
/* A class's slots are its most seen and PLAN_GAP_K times the expected gap
 * to the true end of its range (its span over the draws seen), less where
 * the waste bound asks: with three, the soak's later draws missed their
 * slots (seed 1, draw 426). */
#define OFL__PLAN_GAP_K 6u
/* A pool whose requests change size learns at least this many iterations
 * after the warmup: the margin above is a guess from the draws seen. */
#define OFL__PLAN_MIN_ITERS 4u
/* Room past the slots: a sixteenth of them at least, for requests the plan
 * does not place. */
#define OFL__PLAN_ROOM_DIV 16u
/* An iteration of which more than 1/PLAN_MISS_DIV of the requests (and two
 * or more) missed their slots, or the second in a row with any miss, ends
 * the plan at its end: its requests are not the learned ones. */
#define OFL__PLAN_MISS_DIV 8u

#endif /* OFL_POOL_TUNING_H */
