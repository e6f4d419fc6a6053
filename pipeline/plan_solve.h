/* ofl: the auto offload plan's solver (docs/DESIGN.md section 5.4). A pure
 * function over numbers the warmup measured: which groups to offload so that
 * the predicted peak of activation bytes on the device stays within a
 * target, with the least predicted exposed copy time. Not installed; the
 * manager (pipeline/plan_measure.c) builds the instance, the tests call it
 * directly.
 *
 * Decision space: per group name n, a count x_n of its offloadable groups
 * that are offloaded, taken in split_rank order (0 first); every name is
 * either whole (x_n = 0 or all of them) or split, and at most one name is
 * split. The solver is exact over that space. */
#ifndef OFL_PLAN_SOLVE_H
#define OFL_PLAN_SOLVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ofl/status.h>

/* One group of the warmup record. Times are nanoseconds on the compute
 * stream's clock of the warmup iteration (any common origin). */
typedef struct ofl__plan_group {
  int name;            /* 0 .. nnames-1 */
  int split_rank;      /* 0 .. (offloadable groups of its name) - 1, distinct
                          per name among offloadable groups; ignored when not
                          offloadable */
  bool offloadable;    /* false: stays on the device whatever the plan */
  uint64_t bytes;      /* bytes an offload moves off the device */
  uint64_t kept_bytes; /* bytes of the group that stay on the device in any
                          case (small, not offloadable, or all of it when
                          !offloadable) */
  int64_t t_alloc;     /* the commit: bytes + kept_bytes are on the device */
  int64_t t_reload;    /* the reload is issued: an offloaded group's bytes are
                          back on the device (>= t_alloc) */
  int64_t t_free; /* backward ends: everything of it leaves (>= t_reload) */
  double d2h_ns;  /* copy time of bytes, each direction */
  double h2d_ns;
  double fwd_window_ns; /* compute the D2H copy can hide behind */
  double bwd_window_ns; /* compute the H2D copy can hide behind */
  double release_ns; /* the bytes leave this long after the copy's end
                        (latency the copy queue does not model: a copy
                        worker that woke late); the same for every
                        offloadable group of an instance */
  bool d2h_free;     /* the D2H part (d2h_ns past fwd_window_ns) is left out
                        of the exposed time: a three-way plan minimises the
                        step time, and a D2H copy past its window delays no
                        compute by itself (it shows through the reloads that
                        wait for it, and through the peak). Offload-only
                        plans count it (their order among choices). The
                        same for every group of an instance */
  /* Where the reload is issued under a choice (the reload queue of the
   * exposed time). The runtime issues reloads at the end of a backward, in
   * backward order, as deep as the deepest lead asks (a group at depth d
   * goes when some group at depth >= d has a lead that reaches its own
   * depth), and at most one chunk ahead: with lead > 0 the reload is
   * issued at the end of the backward of the lead-th chosen group before
   * it in backward order, or of the group at gate_pos where that is later,
   * or as early as a chosen group after it is issued, never before t_alloc
   * nor after its own backward begins (t_reload + bwd_window_ns); groups
   * kept between widen the window; reloads issued at once queue in
   * backward order. t_reload is the place with every group chosen and
   * each by its own lead (the peak simulation's: the peak does not move
   * the reloads a choice moves earlier). lead 0: the reload is issued at
   * t_reload whatever the choice. */
  uint32_t lead;
  int32_t bwd_pos;  /* place in backward order (0-based, distinct, < n) */
  int32_t gate_pos; /* the earliest place whose end may issue it (<= bwd_pos;
                       bwd_pos itself: none, the reload is issued as its
                       backward begins) */
  double bwd_window_max_ns; /* lead > 0: the longest window any choice
                               gives (issued at gate_pos's end); the
                               search's bound takes it */
  /* Recompute (the application reruns the group's forward in its backward
   * from an input it keeps): the third action, considered only by
   * ofl__plan_solve_actions with recompute on, and only for a name whose
   * every group is recomputable (the decision is per name, whole). */
  bool recomputable;
  uint64_t recompute_bytes; /* of bytes + kept_bytes, those a recompute
                               frees from the commit until its backward
                               begins (the group's bytes less the input the
                               application keeps) */
  double recompute_ns;      /* the forward's time, paid again in its
                               backward */
  /* The group that produced the input the recompute keeps, where that
   * input is a tensor of another group (has_input; input_of: its index,
   * not this group's). Where the plan recomputes this group and offloads
   * that one, the rerun needs the producer's bytes back as its backward
   * begins: they return then (not at the producer's own t_reload) and the
   * rerun waits for the part of the producer's H2D copy that this group's
   * backward window does not cover (ofl__plan_input_wait). */
  bool has_input;
  uint32_t input_of;
  /* The forwards recompute_ns counts (rerun_own: this group's own;
   * rerun_input: input_of's, where has_input) and this group's own forward
   * time (fwd_ns: commit less start). Where two recomputed groups count the
   * same forward, the application runs it once, in the first backward that
   * needs it (the lower bwd_pos), and holds what it made for the other,
   * whose cost leaves it out (ofl__plan_rerun_credit). All 0: no sharing. */
  bool rerun_own, rerun_input;
  double fwd_ns;
} ofl__plan_group_t;

/* The D2H part of a group's exposed time: d2h_ns past fwd_window_ns, or 0
 * where the instance leaves it out (d2h_free). */
static inline double ofl__plan_d2h_part(const ofl__plan_group_t *g) {
  if (g->d2h_free || !(g->d2h_ns > g->fwd_window_ns))
    return 0.0;
  return g->d2h_ns - g->fwd_window_ns;
}

/* A group's action under a plan (ofl__plan_solve_actions). */
enum { OFL__PLAN_KEEP = 0, OFL__PLAN_OFFLOAD = 1, OFL__PLAN_RECOMPUTE = 2 };

typedef struct ofl__plan_result {
  uint64_t predicted_peak; /* bytes, with the chosen set */
  uint64_t peak_all;       /* with every offloadable group offloaded */
  uint64_t peak_none;      /* with none offloaded */
  double exposed_ns;       /* predicted exposed copy time of the chosen set */
  uint64_t moved_bytes;    /* bytes of the chosen groups */
  bool met;                /* predicted_peak <= target */
  int split_name;          /* the split name, or -1 */
  uint32_t evaluated;      /* peak evaluations made (for the tests) */
  bool exact;              /* the exact search ran (<= 16 names) */
  double recompute_ns;     /* the recomputed groups' forward times */
  uint64_t recomputed_bytes; /* their recompute_bytes */
  double cost_ns;          /* exposed_ns + recompute_ns: what the search
                              minimises */
  bool lowest;             /* no choice met the target and the three-way
                              search chose the lowest predicted peak
                              (ofl__plan_solve_actions with recompute) */
  bool cut;                /* that lowest-peak search ran out of its
                              budget (OFL__PLAN_LOWEST_BUDGET): the lowest
                              peak it found, not necessarily the lowest */
  uint32_t lowest_nodes;   /* peak evaluations of that search */
} ofl__plan_result_t;

/* The lowest-peak search (a target no three-way choice meets) evaluates at
 * most this many choices; then it stops with the lowest found (its first
 * tries are the likeliest: recompute subsets in the order of their bound,
 * offload subsets from every name down). 16 offloadable and 8 recomputable
 * names are 2^24 subsets before any split. */
#define OFL__PLAN_LOWEST_BUDGET 100000u

/* What recomputed group i's cost leaves out under the recomputed set rec
 * (by group), ns: its own forward where a recomputed consumer of its
 * output (rerun_input) has a lower bwd_pos, and its input group's forward
 * where that group (rerun_own) or another of its consumers reruns it at a
 * lower bwd_pos; never more than recompute_ns. 0 where !rec[i]. */
double ofl__plan_rerun_credit(const ofl__plan_group_t *g, size_t n,
                              const bool *rec, size_t i);
/* The recomputed groups' forward times under rec, each forward once:
 * their recompute_ns less their ofl__plan_rerun_credit. */
double ofl__plan_rerun_ns(const ofl__plan_group_t *g, size_t n,
                          const bool *rec);

/* The wait of recomputed group i's rerun for its input's reload, ns: where
 * g[i].has_input and the producer g[g[i].input_of] is offloaded (offloaded
 * true), the part of the producer's H2D copy that g[i]'s backward window
 * does not cover, else 0. Part of a recompute's cost. */
double ofl__plan_input_wait(const ofl__plan_group_t *g, size_t i,
                            bool offloaded);

/* Exposed copy time of one group when offloaded, at least: the part of each
 * direction's copy that its window does not cover, the backward's window
 * the longest any choice gives it (bwd_window_max_ns where lead > 0). The
 * search's bound: over any choice the sum of its groups' is never above
 * ofl__plan_exposed (one group's part can be below its own: a wait is
 * charged to the group that waits, also where its reload queued behind
 * another's). */
double ofl__plan_group_exposed(const ofl__plan_group_t *g);

/* Exposed copy time of the choice chosen[i] (1: group i offloaded; ignored
 * where !offloadable), ns: the D2H part per group as
 * ofl__plan_group_exposed; the H2D part from the reloads queued on one
 * stream in issue order (t_reload), each after its own D2H copy (those
 * queued in t_alloc order), and a backward that begins
 * (t_reload + bwd_window_ns) before its reload ended waits, delaying
 * everything after it. Never below the sum of ofl__plan_group_exposed
 * over the choice (the solver's bound). INFINITY where it cannot allocate
 * its scratch. */
double ofl__plan_exposed(const ofl__plan_group_t *g, size_t n,
                         const bool *chosen);

/* ofl__plan_exposed with its parts, from the same simulation: returns the
 * exposed ns (INFINITY where it cannot allocate its scratch); where not
 * NULL, *waits gets the H2D part alone, the backward's predicted waits for
 * reloads (the figure a run measures as its reload stalls; the D2H part
 * past a forward window delays nothing by itself: it shows through the
 * reloads that wait for their copies), and part[n] each chosen group's
 * part (its D2H copy past its forward window and the backward's wait for
 * its reload; 0 for the others). */
double ofl__plan_exposure(const ofl__plan_group_t *g, size_t n,
                          const bool *chosen, double *waits, double *part);

/* Predicted peak of the device bytes for the choice chosen[i] (1: group i
 * offloaded; ignored where !offloadable). The D2H copies of chosen groups
 * run one after another in t_alloc order (one stream): a group's bytes leave
 * the device when its copy ends, max(t_alloc, previous copy's end) + d2h_ns;
 * they return at t_reload and leave at t_free. At equal times additions
 * count before removals (the conservative side). An offloaded group's
 * bytes leave release_ns after its copy's end; when that is not before
 * t_reload they never leave (counted once: the reload finds them there).
 * chosen NULL: nothing offloaded. O(n log n); UINT64_MAX where it cannot
 * allocate its scratch. */
uint64_t ofl__plan_peak(const ofl__plan_group_t *g, size_t n,
                        const bool *chosen);

/* The exact solver. chosen (n entries) receives the choice, out the
 * figures; both only on success. A target met with nothing offloaded
 * chooses nothing. A target that no choice meets (the peak is not monotone
 * in the choice, so offloading everything is not always the lowest) returns
 * every offloadable group offloaded with met false. Ties in exposed time
 * (within 1 ns) go to fewer moved bytes, then to the lower peak.
 * OFL_ERR_INVALID_ARG on a malformed instance (name out of range, duplicate
 * or missing split ranks, t_alloc > t_reload or t_reload > t_free, an
 * offloadable group's copy time or window negative, NaN or infinite, byte
 * totals past 64 bits, nnames < 0, NULL pointers where n > 0).
 * Exact for up to 16 names that have offloadable groups; above that whole
 * names are added greedily by bytes per exposed ns (then dropped again where
 * not needed) and the result says so (exact false). n == 0 is valid. */
ofl_status_t ofl__plan_solve(const ofl__plan_group_t *g, size_t n, int nnames,
                             uint64_t target, bool *chosen,
                             ofl__plan_result_t *out);

/* The three-way solver: per group keep, offload or recompute (action[i],
 * OFL__PLAN_*), minimising the predicted cost (the exposed copy time of the
 * offloaded groups, as ofl__plan_exposed, plus the recomputed groups'
 * recompute_ns) with the peak within the target. Recompute is a per-name
 * decision (every group of the name recomputed, none offloaded) for names
 * whose every group is recomputable; the offload decision of the other
 * names is ofl__plan_solve's. Exact (every subset of recomputable names,
 * each with the exact offload search, subsets in order of recompute cost
 * and cut where that cost alone cannot beat the best) for up to 8
 * recomputable names and 16 offloadable ones; above 8 recomputable names
 * nothing is recomputed and exact is false. Ties (1 ns) go to fewer bytes
 * off the device (offloaded and recomputed), then the lower peak.
 * recompute false: ofl__plan_solve's choice, as actions (a target no
 * choice meets: every offloadable group offloaded, met false). recompute
 * true and a target no choice meets: the choice of the same space (every
 * subset of the recomputable names, each with every offload choice of the
 * others) with the lowest predicted peak, ties to the least predicted cost
 * (1 ns), then to fewer bytes off the device; met false, lowest true (a
 * search over that whole space, cut only where the peak with copies that
 * take no time, a lower bound, cannot reach the lowest found; at most
 * OFL__PLAN_LOWEST_BUDGET evaluations, then the lowest found and cut
 * true). A recompute's cost includes its input's reload wait
 * (ofl__plan_input_wait): that only adds to the cost, so the bounds
 * (recompute_ns and the per-group exposed times) stay below it and the
 * search stays exact. Errors as ofl__plan_solve's, and a recomputable
 * group whose recompute_bytes exceed bytes + kept_bytes, whose
 * recompute_ns is negative, NaN or infinite, or whose input_of is itself
 * or not below n. */
ofl_status_t ofl__plan_solve_actions(const ofl__plan_group_t *g, size_t n,
                                     int nnames, uint64_t target,
                                     bool recompute, uint8_t *action,
                                     ofl__plan_result_t *out);

/* Predicted peak under actions (NULL: every group kept). A recomputed
 * group holds bytes + kept_bytes - recompute_bytes from its commit, and
 * recompute_bytes more from its backward's begin (t_reload +
 * bwd_window_ns, at most t_free) to t_free; offloaded groups as
 * ofl__plan_peak, except that an offloaded producer of a recomputed
 * group's input (has_input) has its bytes back from that group's
 * backward's begin where that is before its own reload (held until its
 * t_free). UINT64_MAX where it cannot allocate its scratch. */
uint64_t ofl__plan_peak_actions(const ofl__plan_group_t *g, size_t n,
                                const uint8_t *action);

/* Predicted cost under actions: ofl__plan_exposed of the offloaded groups
 * plus recompute_ns and ofl__plan_input_wait of the recomputed ones;
 * *recompute_ns (not NULL) gets the second part. INFINITY where it cannot
 * allocate its scratch. */
double ofl__plan_cost(const ofl__plan_group_t *g, size_t n,
                      const uint8_t *action, double *recompute_ns);

/* The target the next solve aims at after an iteration whose measured
 * peak went over the target (measured > target; last_aim: the previous
 * solve's target, predicted: its predicted peak). The model's error is
 * measured - predicted; a plan predicted at target - error fits when that
 * error is the model's own, and the last aim less the overshoot keeps the
 * aims falling when the error grows with the offload: the lower of the two,
 * at least 1. */
uint64_t ofl__plan_replan_aim(uint64_t target, uint64_t last_aim,
                              uint64_t measured, uint64_t predicted);

/* A three-way plan's replan after an iteration over the target (the
 * arguments of ofl__plan_replan_aim; moved_before: the bytes the plan that
 * went over offloaded). The model's error (measured - predicted) is in the
 * copies' timing (a release later than the warmup's, a reload earlier),
 * so a choice carries it in proportion to the bytes it offloads, as a
 * raise's does: a recompute frees its bytes at no copy's time. The choice
 * for ofl__plan_replan_aim's aim, unless one solved for a higher aim (the
 * target less 0, 1/4, 1/2 or 3/4 of the error; or the recompute-only
 * choice for the target, which carries none) meets that aim, fits the
 * target with its share of the error added, and costs less (or the first
 * choice met nothing): without it the aim fell past a choice that met the
 * target (the demo's lowest target: every name recomputed, predicted at
 * the target, was passed over for mixes that offloaded). Where nothing was
 * offloaded, or the measured peak was not above the prediction, the aim's
 * choice alone. Where nothing meets the aim (the lowest-peak choice), the
 * offload-only fallback (everything offloaded) takes its place when it is
 * predicted no higher and takes more bytes off the device: the plan before
 * went over although the model put it at the lowest peak, so the model's
 * peaks cannot rank the choices that tie there, and bytes off the device
 * can. *aim_out: the aim of the choice taken. */
#define OFL__PLAN_REPLAN_SHARES 4u
/* The share of the model's error err a choice that offloads moved bytes
 * carries, against a plan that offloaded before: err * moved / before, at
 * most err; 0 where before is 0 (a raise's and a three-way replan's). */
static inline uint64_t ofl__plan_carried(uint64_t err, uint64_t moved,
                                         uint64_t before) {
  double share = before > 0 ? (double)moved / (double)before : 0;
  return (uint64_t)((double)err * (share < 1 ? share : 1));
}
ofl_status_t ofl__plan_replan_actions(const ofl__plan_group_t *g, size_t n,
                                     int nnames, uint64_t target,
                                     uint64_t last_aim, uint64_t measured,
                                     uint64_t predicted, uint64_t moved_before,
                                     uint8_t *action, ofl__plan_result_t *out,
                                     uint64_t *aim_out);

/* The evidence for raising the aim (a plan that measures under its
 * prediction). One iteration under the prediction says little: the first
 * steady iterations can run with copies that finish earlier than they will
 * later (measured on an H200: 7.75 MiB in the first iteration of a plan
 * that held 9.50 in every later one, so a raise on that one figure went
 * over the target). A raise needs OFL__PLAN_RAISE_AFTER consecutive
 * iterations of one plan under its prediction, and raises by the smallest
 * of their errors. */
#define OFL__PLAN_RAISE_AFTER 3

typedef struct ofl__plan_under {
  uint32_t iters; /* consecutive iterations of one plan under its prediction */
  uint64_t err;   /* the smallest predicted - measured among them */
} ofl__plan_under_t;

/* Takes one iteration's figures (fresh: the plan or a prefetch lead changed
 * at the end of the iteration before, so this is the first of a new plan);
 * returns the error to raise the aim by once the evidence is enough, else
 * 0. */
uint64_t ofl__plan_under_note(ofl__plan_under_t *u, bool fresh,
                              uint64_t predicted, uint64_t measured);

#endif /* OFL_PLAN_SOLVE_H */
