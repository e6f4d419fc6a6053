/* The placement plan of a device pool of changing sizes (pool/plan.c): an
 * iteration that repeats its requests, at sizes drawn anew each time within
 * the ranges its first iterations saw, is placed without a backend call
 * once the pool learned, with its bytes intact and within the waste bound,
 * over randomly drawn workloads (request counts, sizes, lifetimes, frees
 * ordered after a copy that reads the block) and through a long run. Best
 * fit alone fragmented here: blocks of a third of a segment, placed where
 * the blocks before them left room, split the free bytes into pieces too
 * small for the next large block, and the pool grew inside the steady
 * iterations. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "pool/pool_internal.h"
#include "tests/support/devmem.h"

#define KIB ((size_t)1024)
#define MIB ((size_t)1 << 20)
#define MAX_REQ 40
#ifndef PLAN_SEED
#define PLAN_SEED 13
#endif
#define LEARN_MAX 14 /* the warmup and at most twelve learning iterations */

static ofl_device_t *dev;

static void open_dev(void) {
  setenv("CUDASIM_DEVICE_MEMORY", "64M", 1);
  ofl_device_params_t p = t_device_params(20, 5);
  p.device_capacity_bytes = 64 * MIB;
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(pool_plan, .init = open_dev, .fini = close_dev, .timeout = 600);

/* ---- a workload: the requests of one iteration --------------------------- */

typedef struct req {
  bool big;      /* byte-keyed, size drawn each iteration in [lo, hi] */
  size_t lo, hi; /* a small one: one shape, lo == hi */
  int life;      /* freed after this many more requests; -1: at the end */
  bool copied;   /* a copy reads it first; freed ordered after the copy */
} req_t;

typedef struct work {
  int n;
  req_t r[MAX_REQ];
  size_t seen_lo[MAX_REQ], seen_hi[MAX_REQ]; /* what learning drew */
} work_t;

static uint64_t rng_next(uint64_t *s) {
  *s += 0x9e3779b97f4a7c15ull;
  return t_mix(*s);
}
static size_t rng_in(uint64_t *s, size_t lo, size_t hi) {
  return lo + (size_t)(rng_next(s) % (hi - lo + 1));
}

/* copies: half the blocks are read by a copy and freed behind it; without,
 * every block's busy time is its program order's, and the plan the same on
 * every run. */
static void work_draw(uint64_t seed, bool copies, work_t *w) {
  memset(w, 0, sizeof *w);
  uint64_t s = seed;
  w->n = (int)rng_in(&s, 8, 32);
  for (int i = 0; i < w->n; i++) {
    req_t *r = &w->r[i];
    r->big = rng_next(&s) % 3 != 0;
    if (r->big) {
      r->lo = rng_in(&s, 64, 384) * KIB;
      r->hi = r->lo + rng_in(&s, 0, 2 * r->lo);
    } else {
      r->lo = r->hi = rng_in(&s, 1, 24) * KIB + rng_in(&s, 0, 255);
    }
    r->life = rng_next(&s) % 4 == 0 ? -1 : (int)rng_in(&s, 0, 6);
    r->copied = rng_next(&s) % 2 == 0 && copies;
    w->seen_lo[i] = SIZE_MAX;
  }
}

/* ---- one iteration ------------------------------------------------------- */

typedef struct live {
  ofl_tensor_t *t;
  size_t bytes;
  uint64_t seed;
  int free_at;
  bool copied;
} live_t;

typedef struct copy {
  void *host;
  size_t bytes;
  uint64_t seed;
} copy_t;

typedef struct run {
  ofl_pool_t *pool;
  bool check; /* this iteration fills and checks its blocks' bytes */
  ofl_stream_t *copy_stream;
  size_t wrong; /* bytes that differed from what was written */
  int copies;   /* copies checked */
  size_t most;  /* the largest request made */
  char why[256];
} run_t;

/* Frees l: its bytes checked first; a copied one is read by a D2H copy on
 * the copy stream and freed ordered after it (the pool hands its range to a
 * later request only behind that copy). */
static void live_free(run_t *r, live_t *l, copy_t *cp, int *ncp) {
  if (r->check)
    r->wrong += t_wrong(dev, ofl_tensor_data(l->t), l->bytes, l->seed);
  if (l->copied) {
    copy_t *c = &cp[(*ncp)++];
    c->host = malloc(l->bytes);
    cr_assert(not(eq(ptr, c->host, NULL)));
    c->bytes = l->bytes;
    c->seed = l->seed;
    cr_assert(eq(int,
                 ofl_memcpy_async(c->host, ofl_tensor_data(l->t), l->bytes,
                                  OFL_COPY_D2H, r->copy_stream),
                 OFL_SUCCESS),
              "%s", ofl_last_error());
    cr_assert(eq(int, ofl_pool_free_after(r->pool, l->t, r->copy_stream),
                 OFL_SUCCESS),
              "%s", ofl_last_error());
  } else {
    cr_assert(eq(int, ofl_pool_free(r->pool, l->t), OFL_SUCCESS), "%s",
              ofl_last_error());
  }
  l->t = NULL;
}

/* One iteration of w: sizes drawn in each request's range (learning: the
 * whole range, noted; counted: within what learning saw), every block
 * filled, checked and freed, the copies checked; then the iteration's end
 * the manager would report. */
static void iteration(run_t *r, work_t *w, uint64_t seed, bool counted) {
  live_t live[MAX_REQ];
  copy_t cp[MAX_REQ];
  int ncp = 0;
  uint64_t s = seed;
  ofl_stream_t *compute = ofl_device_compute_stream(dev);
  for (int i = 0; i < w->n; i++) {
    for (int j = 0; j < i; j++)
      if (live[j].t != NULL && live[j].free_at == i)
        live_free(r, &live[j], cp, &ncp);
    const req_t *q = &w->r[i];
    size_t lo = counted ? w->seen_lo[i] : q->lo;
    size_t hi = counted ? w->seen_hi[i] : q->hi;
    size_t n = rng_in(&s, lo, hi);
    if (!counted) {
      w->seen_lo[i] = n < w->seen_lo[i] ? n : w->seen_lo[i];
      w->seen_hi[i] = n > w->seen_hi[i] ? n : w->seen_hi[i];
    }
    r->most = n > r->most ? n : r->most;
    int64_t shape[1] = {(int64_t)n};
    ofl_tensor_t *t = NULL;
    ofl_status_t st =
        q->big ? ofl_pool_alloc_dynamic(r->pool, shape, 1, OFL_DTYPE_U8,
                                        compute, &t)
               : ofl_pool_alloc(r->pool, shape, 1, OFL_DTYPE_U8, compute, &t);
    cr_assert(eq(int, st, OFL_SUCCESS), "request %d of %zu bytes: %s", i, n,
              ofl_last_error());
    live[i] = (live_t){.t = t,
                       .bytes = n,
                       .seed = rng_next(&s),
                       .free_at = q->life < 0 ? w->n : i + 1 + q->life,
                       .copied = q->copied};
    if (r->check)
      cr_assert(eq(int, t_fill(dev, ofl_tensor_data(t), n, live[i].seed),
                   OFL_SUCCESS));
  }
  for (int j = 0; j < w->n; j++)
    if (live[j].t != NULL)
      live_free(r, &live[j], cp, &ncp);
  cr_assert(eq(int, ofl_stream_synchronize(r->copy_stream, OFL_TIMEOUT_DEFAULT),
               OFL_SUCCESS));
  for (int c = 0; c < ncp; c++) {
    if (r->check)
      r->wrong += t_pattern_wrong(cp[c].host, cp[c].bytes, cp[c].seed);
    free(cp[c].host);
  }
  r->copies += r->check ? ncp : 0;
  ofl__pool_cycle_end(r->pool);
}

static ofl_pool_t *app_pool(void) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT; /* as an application makes it */
  p.name = "plan";
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_SUCCESS), "%s",
            ofl_last_error());
  return pool;
}

static ofl_pool_stats_t stats_of(const ofl_pool_t *pool) {
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  return s;
}

/* A workload's run: learned (at most LEARN_MAX iterations, blocks checked),
 * its stats at the end of learning in *learned. */
static void learn(run_t *r, work_t *w, uint64_t seed,
                  ofl_pool_stats_t *learned) {
  r->pool = app_pool();
  r->check = true;
  cr_assert(eq(int, ofl_stream_create(dev, "plan-copy", &r->copy_stream),
               OFL_SUCCESS));
  for (int it = 0; it < LEARN_MAX && stats_of(r->pool).learned_iteration == 0;
       it++)
    iteration(r, w, seed * 1000 + (uint64_t)it, false);
  *learned = stats_of(r->pool);
  ofl_pool_reset_peak(r->pool);
}

static void run_end(run_t *r) {
  ofl_stream_destroy(r->copy_stream);
  ofl_pool_destroy(r->pool);
}

/* Between a (learning's end) and b: no backend call, no wrong byte, and at
 * most the waste bound of the peak in use since (1.3 times, or a minimum
 * segment of 2 MiB more for a small pool). False with why filled. */
static bool steady(const run_t *r, const ofl_pool_stats_t *a,
                   const ofl_pool_stats_t *b, uint64_t seed, int counted,
                   char *why, size_t cap) {
  size_t peak = b->peak_in_use_bytes, held = b->held_bytes;
  size_t bound =
      peak / 10 * 13 > peak + 2 * MIB ? peak / 10 * 13 : peak + 2 * MIB;
  uint64_t calls = (b->backend_allocs - a->backend_allocs) +
                   (b->backend_frees - a->backend_frees);
  if (a->learned_iteration == 0) {
    snprintf(why, cap, "seed %llu: still learning after %d iterations",
             (unsigned long long)seed, LEARN_MAX);
    return false;
  }
  if (calls == 0 && r->wrong == 0 && held <= bound)
    return true;
  snprintf(why, cap,
           "seed %llu (learned after %llu, %llu slots): %llu backend calls "
           "in %d iterations after learning, %zu wrong bytes, holds %zu for "
           "a peak of %zu",
           (unsigned long long)seed, (unsigned long long)a->learned_iteration,
           (unsigned long long)a->placement_slots, (unsigned long long)calls,
           counted, r->wrong, held, peak);
  return false;
}

/* A drawn workload through learning and `counted` iterations after it.
 * *planned: whether its pool made a placement plan. */
static bool workload(uint64_t seed, int counted, bool *planned, char *why,
                     size_t cap) {
  /* Under valgrind (OFLTEST_SLOW 20) the copy worker runs when valgrind's
   * one thread at a time lets it: copies end iterations late, and their
   * busy times say nothing of a workload's. */
  const char *slow = getenv("OFLTEST_SLOW");
  work_t w;
  work_draw(seed, slow == NULL || atoi(slow) < 10, &w);
  run_t r = {0};
  ofl_pool_stats_t a;
  learn(&r, &w, seed, &a);
  *planned = a.placement_slots > 0;
  for (int k = 0; a.learned_iteration != 0 && k < counted; k++)
    iteration(&r, &w, seed * 1000 + 100 + (uint64_t)k, true);
  ofl_pool_stats_t b = stats_of(r.pool);
  bool ok = steady(&r, &a, &b, seed, counted, why, cap);
  if (slow == NULL || atoi(slow) < 10)
    cr_assert(gt(int, r.copies, 0));
  run_end(&r);
  return ok;
}

/* Randomly drawn workloads, 40 iterations each after learning; best fit
 * alone failed 2 to 4 of these 24, by timing (a growth, or a pool grown
 * past the bound). OFLTEST_PLAN_SEED=N runs workload N alone. */
Test(pool_plan, drawn_workloads_are_placed_without_a_call_after_learning) {
  int failed = 0, planned = 0, ran = 0;
  char why[320] = "", first[320] = "";
  const char *only = getenv("OFLTEST_PLAN_SEED");
  for (uint64_t seed = 1; seed <= 24; seed++) {
    if (only != NULL && strtoull(only, NULL, 10) != seed)
      continue;
    bool p = false;
    ran++;
    if (!workload(seed, 40, &p, why, sizeof why) && failed++ == 0)
      snprintf(first, sizeof first, "%s", why);
    planned += p;
  }
  cr_assert(eq(int, failed, 0), "%d of %d workloads failed; first: %s", failed,
            ran, first);
  /* the plan served them (not best fit that happened to pass) */
  cr_assert(ge(int, planned * 4, ran * 3), "%d of %d workloads planned",
            planned, ran);
}

/* Appends src's request i, with what learning drew for it, to dst. */
static void work_push(work_t *dst, const work_t *src, int i) {
  dst->r[dst->n] = src->r[i];
  dst->seen_lo[dst->n] = src->seen_lo[i];
  dst->seen_hi[dst->n] = src->seen_hi[i];
  dst->n++;
}

/* The copy-free workload PLAN_SEED (whose plan is the same on every run)
 * learned, its plan made. */
static void learn_planned(work_t *w, run_t *r, ofl_pool_stats_t *a) {
  work_draw(PLAN_SEED, false, w);
  learn(r, w, PLAN_SEED, a);
  cr_assert(gt(u64, a->placement_slots, 0));
}

/* A long run: 3000 iterations after learning (bytes checked in every
 * 100th), no backend call, the held bytes flat, the plan in place. */
Test(pool_plan, a_long_run_stays_placed) {
  work_t w; /* best fit alone grew in this run */
  run_t r = {0};
  ofl_pool_stats_t a;
  learn_planned(&w, &r, &a);
  for (int k = 0; k < 3000; k++) {
    r.check = k % 100 == 0;
    iteration(&r, &w, 7000000 + (uint64_t)k, true);
  }
  ofl_pool_stats_t b = stats_of(r.pool);
  char why[320] = "";
  cr_assert(steady(&r, &a, &b, PLAN_SEED, 3000, why, sizeof why), "%s", why);
  cr_assert(eq(sz, b.held_bytes, a.held_bytes));
  cr_assert(eq(u64, b.placement_slots, a.placement_slots));
  cr_assert(eq(u64, b.iterations - a.iterations, 3000));
  run_end(&r);
}

/* Sizes past every one learning saw (each request twice its most): the
 * slots have no place for them, the plan ends, and best fit over the
 * segment serves them, growing as it needs to, bytes intact; later
 * iterations go on without it. */
Test(pool_plan, sizes_past_the_learned_ones_end_the_plan) {
  work_t w;
  run_t r = {0};
  ofl_pool_stats_t a;
  learn_planned(&w, &r, &a);
  for (int i = 0; i < w.n; i++)
    if (w.r[i].big)
      w.seen_lo[i] = w.seen_hi[i] = 2 * w.seen_hi[i];
  for (int k = 0; k < 5; k++)
    iteration(&r, &w, 8000 + (uint64_t)k, true);
  ofl_pool_stats_t b = stats_of(r.pool);
  cr_assert(eq(u64, b.placement_slots, 0));
  cr_assert(gt(u64, b.placement_misses, 0));
  cr_assert(eq(sz, r.wrong, 0));
  run_end(&r);
}

/* An iteration that makes one request more than the learned ones (a
 * second copy of its largest, at the end): past the learned count, it
 * borrows a free slot or the room past them; the plan stays, no backend
 * call, bytes intact, and the learned sequence is placed in its own slots
 * again. Two such iterations in a row end the plan at the second one's
 * end: its requests are no longer the learned ones. */
Test(pool_plan, a_request_past_the_learned_ones_borrows_a_free_slot) {
  work_t w;
  run_t r = {0};
  ofl_pool_stats_t a;
  learn_planned(&w, &r, &a);
  work_t more = w;
  int big = 0;
  for (int i = 1; i < w.n; i++)
    if (w.seen_hi[i] > w.seen_hi[big])
      big = i;
  work_push(&more, &w, big);
  more.r[w.n].life = 0;
  iteration(&r, &more, 9000, true);
  ofl_pool_stats_t b = stats_of(r.pool);
  cr_assert(eq(u64, b.placement_misses - a.placement_misses, 1));
  cr_assert(eq(u64, b.placement_slots, a.placement_slots));
  for (int k = 0; k < 20; k++)
    iteration(&r, &w, 9100 + (uint64_t)k, true);
  ofl_pool_stats_t c = stats_of(r.pool);
  char why[320] = "";
  cr_assert(steady(&r, &a, &c, PLAN_SEED, 21, why, sizeof why), "%s", why);
  cr_assert(eq(u64, c.placement_slots, a.placement_slots));
  cr_assert(eq(u64, c.placement_misses, b.placement_misses));
  iteration(&r, &more, 9200, true);
  cr_assert(eq(u64, stats_of(r.pool).placement_slots, a.placement_slots));
  iteration(&r, &more, 9201, true);
  cr_assert(eq(u64, stats_of(r.pool).placement_slots, 0));
  cr_assert(eq(sz, r.wrong, 0));
  run_end(&r);
}

/* An iteration whose requests are not the learned ones (every third one
 * skipped: each later one finds its ordinal's slot sized for another)
 * ends the plan at its end, with nothing in use; best fit over the segment
 * serves the iterations after it, bytes intact. */
Test(pool_plan, other_requests_end_the_plan_at_the_iterations_end) {
  work_t w;
  run_t r = {0};
  ofl_pool_stats_t a;
  learn_planned(&w, &r, &a);
  work_t fewer = w;
  fewer.n = 0;
  for (int i = 0; i < w.n; i++)
    if (i % 3 != 2)
      work_push(&fewer, &w, i);
  iteration(&r, &fewer, 9000, true);
  ofl_pool_stats_t b = stats_of(r.pool);
  cr_assert(gt(u64, b.placement_misses, a.placement_misses));
  cr_assert(eq(u64, b.placement_slots, 0));
  for (int k = 1; k < 10; k++)
    iteration(&r, &fewer, 9000 + (uint64_t)k, true);
  cr_assert(eq(sz, r.wrong, 0));
  run_end(&r);
}

/* A byte-keyed range (265000 to 266400 bytes) whose draws all rounded to
 * one page while the pool learned (at most 266240: 65 pages) and reach the
 * next page later (66 pages), within the range. The plan records the bytes
 * asked, not the block's pages, so the draws' spread gives each slot a
 * margin past the page; recorded as pages, every draw had been 266240, the
 * sizes had not changed, and the pool had no plan (seed 31, draw 888 of
 * the soak: 266240 at one place through learning, 270336 later, its plan
 * ended and best fit grew). 50 iterations over the whole range: every
 * request in its own slot, no call, bytes intact. */
Test(pool_plan, a_range_that_rounded_to_one_page_keeps_its_slots_past_it) {
  work_t w;
  memset(&w, 0, sizeof w);
  for (int i = 0; i < 6; i++) {
    req_t *q = &w.r[w.n];
    q->big = true;
    q->lo = i < 4 ? 265000 : 64 * KIB + 1; /* two byte sizes at least */
    q->hi = i < 4 ? 266240 : 96 * KIB;
    q->life = 1 + i % 3;
    w.seen_lo[w.n++] = SIZE_MAX;
  }
  run_t r = {0};
  ofl_pool_stats_t a;
  learn(&r, &w, 4242, &a);
  cr_assert(gt(u64, a.learned_iteration, 0));
  cr_assert(gt(u64, a.placement_slots, 0), "no plan after %llu iterations",
            (unsigned long long)a.learned_iteration);
  for (int i = 0; i < 4; i++) {
    cr_assert(le(sz, w.seen_hi[i], 266240)); /* one page while learning */
    w.seen_lo[i] = 265000;
    w.seen_hi[i] = 266400;
  }
  r.most = 0;
  for (int k = 0; k < 50; k++)
    iteration(&r, &w, 4242000 + (uint64_t)k, true);
  cr_assert(gt(sz, r.most, 266240)); /* the next page was asked */
  ofl_pool_stats_t b = stats_of(r.pool);
  char why[320] = "";
  cr_assert(steady(&r, &a, &b, 4242, 50, why, sizeof why), "%s", why);
  cr_assert(eq(u64, b.placement_misses, a.placement_misses));
  cr_assert(eq(u64, b.placement_slots, a.placement_slots));
  run_end(&r);
}
