/* ofl: the auto plan's private state, shared by pipeline/plan_measure.c
 * (the warmup's measurements, the instance), pipeline/plan_ledger.c (the
 * choice and the ledger), pipeline/plan_feedback.c (the steady
 * iterations' feedback) and pipeline/report.c (the printed
 * plan and its readings). The plan's per-group state is meas_t, in an
 * array indexed by the plan's own index (group_t.pidx). Not installed. */
#ifndef OFL_PIPELINE_PLAN_H
#define OFL_PIPELINE_PLAN_H

#include "pipeline/pipeline_internal.h"
#include "pipeline/plan_solve.h"

#define LEAD_MAX 16
/* raise_aim: the whole error, then a bisection of the aims below it down
 * to RAISE_STEP apart */
#define RAISE_TRIES 8
#define RAISE_STEP (64u << 10)
/* Solves after the first, when the measured peak goes over the target. */
#define REPLAN_MAX 8
/* The plan has settled when it ran this many steady iterations unchanged:
 * one more than a raise needs, so that the raise had its chance first. */
#define SETTLE_AFTER (OFL__PLAN_RAISE_AFTER + 1)
/* The measured recompute cost's feedback (plan_feedback.c): each steady
 * iteration's measurement of a recomputed group (its backward less the
 * warmup's backward of it) moves its estimate this far towards it (an
 * exponential average); the plan solves again when an estimate moved by
 * more than RC_MOVE of the one it was solved with (that one at least
 * RC_FLOOR_NS: smaller moves are the CPU clock's noise). */
#define RC_EMA 0.5
#define RC_MOVE 0.5
#define RC_FLOOR_NS 100000.0

typedef struct stamp {
  uint64_t cpu;    /* ofl__now_ns() at the call */
  ofl_event_t *ev; /* timed event, where the backend has them */
  uint32_t waits;  /* backward waits for reloads before it (bwd_seq) */
  bool set;
} stamp_t;

typedef struct meas {
  group_t *g;
  stamp_t start; /* group_start, on compute: its forward runs to commit */
  stamp_t commit, bwd_begin, bwd_end; /* compute stream */
  stamp_t d2h_a, d2h_b, h2d_a, h2d_b; /* copy streams */
  uint64_t kept_bytes; /* device bytes of the group its commit kept */
  uint64_t late;       /* CPU ns when its copies were last seen unfinished
                          (0: never): the bytes were on the device then */
  int32_t late_ms;     /* the marker that saw that: its group's place in
                          ms (-1: none) and which of its compute stamps */
  uint8_t late_kind;   /* (0 commit, 1 backward begin, 2 backward end) */
  bool rel_pending;
  uint32_t bwd_seq;       /* 1 + place of its backward in the iteration */
  uint64_t bwd_cpu_ns;    /* the warmup's backward, begin to end, CPU clock */
  uint64_t rc_bwd_cpu;    /* steady: its backward's begin (CPU clock) */
  uint64_t rc_bwd_ns;     /* steady: the last recomputed backward's time */
  bool rc_fresh;          /* rc_bwd_ns measured in this iteration */
  bool rc_back;           /* steady, recomputed: its rerun's bytes are
                             counted back (its backward began, or the
                             rerun of a group whose input it holds) */
  double rc_solved_ns;    /* the recompute estimate the plan was last
                             solved with (inst's recompute_ns then) */
  group_t *input;         /* the group that holds the input a recompute
                             keeps (ofl_manager_group_start_recompute;
                             NULL: none): the instance's input_of */
  uint64_t warm_pop_ns;   /* the warmup: time inside tensor_pop for its
                             tensors within its backward (waits for their
                             reload, inline reloads on the calling thread) */
  uint64_t warm_stall_ns; /* how long its backward waited for its reload in
                             the warmup (taken out of the warmup's
                             timeline) */
  /* The feedback (plan_ledger.c, plan_feedback.c). */
  uint8_t lead;       /* learned prefetch lead (reloads issued this many
                         groups ahead of its backward) */
  uint8_t lead_cap;   /* the lead it may grow to (lowered where a deeper one
                         put the measured peak over the target) */
  bool stalled;       /* its reload stalled compute in this iteration */
  uint64_t dev_bytes; /* bytes on the device at its commit (ledger) */
} meas_t;

/* What a recompute of x's group costs, measured: its steady backward with
 * the rerun (rc_bwd_ns) less the warmup's backward of it without the time
 * its pops took there (bwd_cpu_ns - warm_pop_ns: waiting for or doing the
 * warmup's reload is not compute a recompute adds to; the wait at the
 * backward's begin comes before its stamp); 0 when not above it. CPU
 * clock: on a GPU both hold only what the thread waited for. */
static inline double ofl__plan_rc_measured_ns(const meas_t *x) {
  uint64_t base =
      x->bwd_cpu_ns > x->warm_pop_ns ? x->bwd_cpu_ns - x->warm_pop_ns : 0;
  return x->rc_bwd_ns > base ? (double)(x->rc_bwd_ns - base) : 0;
}

struct ofl__plan {
  bool timed;       /* stamps carry timing events */
  bool timing_lost; /* an event failed: the CPU clock for everything */
  stamp_t base;     /* the first stamp of the warmup, on compute */
  meas_t *ms;
  uint32_t nms, capms, bwd_seq;

  /* The plan (end of warmup). */
  ofl__plan_group_t *inst; /* by pidx */
  bool *chosen;
  uint32_t *bwd_order;      /* pidx in backward order */
  uint64_t *stalled_before; /* nbwd + 1: the warmup's reload waits up to
                               the k-th backward begin, summed (ns; 0 at
                               0) */
  int64_t *t_bwd_end;       /* by pidx */
  uint32_t nbwd;
  ofl_plan_name_t *names;
  ofl_plan_action_t *acts; /* by name, beside names */
  uint64_t *stall0;        /* by name: its stall_ns at the warmup's end */
  double recompute_ms;     /* predicted recompute time of the plan */
  bool lowest;             /* the last solve met no target: the three-way
                              plan with the lowest predicted peak runs */
  uint8_t *action;         /* by pidx: OFL__PLAN_* of the plan */
  bool *rec;               /* by pidx: scratch for ofl__plan_rec */
  ofl_manager_plan_t out;
  uint8_t base_lead;

  /* The ledger (steady state). */
  int64_t live, peak;
  uint64_t *off_now; /* by pidx: bytes its commit offloaded this iteration */
  bool *pending;     /* by pidx: copy not yet seen complete */
  uint32_t *fifo;    /* pidx of offloaded groups, commit order */
  uint32_t fifo_head, fifo_len;
  uint64_t stall_ns_start;
  uint64_t solve_target; /* the target the last solve aimed at */
  /* One raise (a plan predicted above its measured peak in
   * OFL__PLAN_RAISE_AFTER iterations in a row solves again for a higher
   * aim, to expose less copy time): the plan before
   * it, kept to go back to when the raised one goes over the target. */
  bool *chosen_safe;
  uint8_t *action_safe; /* a three-way plan's actions before the raise */
  bool safe_lowest;
  uint64_t safe_aim, safe_pred;
  bool raised;             /* the raised plan runs; not yet under the target */
  bool raise_done;         /* no more raises */
  bool ever_over;          /* an iteration went over the target */
  ofl__plan_under_t under; /* the evidence for a raise */
  uint64_t changes_seen;   /* replans + lead changes when last looked */
  bool ledger;             /* the ledger's arrays exist (the warmup ended) */
  bool touched;            /* the ledger moved in this iteration */
  bool warned;             /* "nothing more it can do" was said (once) */
  bool over_warned;        /* an over-target WARN since the plan last settled */
};

/* The bytes the plan's choice offloads (p->chosen's groups). */
static inline uint64_t ofl__plan_chosen_bytes(const ofl__plan_t *p) {
  uint64_t moved = 0;
  for (uint32_t i = 0; i < p->nms; i++)
    if (p->chosen[i])
      moved += p->inst[i].bytes;
  return moved;
}

/* The steady ledger runs (after the warmup, with or without auto). */
static inline bool ofl__plan_ledger_runs(const ofl_manager_t *m) {
  return m->ap != NULL && m->ap->ledger;
}

static inline double ofl__mib(uint64_t b) { return (double)b / 1048576.0; }

/* plan_measure.c: the warmup's measurements and the instance. */
ofl_status_t ofl__plan_alloc(ofl_manager_t *m);
/* g's record, made (and its index given) at its first stamp; NULL without
 * memory. */
meas_t *ofl__plan_meas(ofl_manager_t *m, group_t *g);
/* The bytes of g's storages (each cluster once) and, of them, those its
 * commit offloaded. */
uint64_t ofl__plan_group_bytes(const group_t *g, uint64_t *offloaded);
/* The warmup's parts of the hooks (ofl__plan_on_commit and the others). */
void ofl__plan_warm_commit(ofl_manager_t *m, group_t *g, int phase);
void ofl__plan_warm_reload(ofl_manager_t *m, group_t *g, int phase);
void ofl__plan_warm_backward(ofl_manager_t *m, group_t *g, int end);
/* ns of a stamp on the warmup's axis, the warmup's reload waits out. */
int64_t ofl__plan_at_ns(const ofl__plan_t *p, const stamp_t *s);
/* When the group at backward place pos reloads with lead L. */
int64_t ofl__plan_reload_time(const ofl__plan_t *p, uint32_t pos, uint32_t lead,
                              uint32_t gate, int64_t t_alloc, int64_t t_begin);
/* The instance from the stamps (link rates, windows, release latency). */
ofl_status_t ofl__plan_build_instance(ofl_manager_t *m, int *nnames);
/* params.device_memory_target_bytes: the activation target from the
 * warmup's device peak. */
ofl_status_t ofl__plan_device_target(ofl_manager_t *m);

/* plan_ledger.c: the choice, for the feedback (plan_feedback.c). */
/* Reads the copies seen complete since the last look into the ledger. */
void ofl__plan_ledger_poll(ofl_manager_t *m);
/* p->action's recomputed groups, by pidx (p->rec, filled now); NULL
 * before the first solve. */
const bool *ofl__plan_rec(ofl__plan_t *p);
/* Each name's action and costs (ofl_manager_plan_action). */
void ofl__plan_fill_acts(ofl_manager_t *m);
/* The predicted exposed and waiting times of p->chosen; the exposed ns. */
double ofl__plan_predict(ofl__plan_t *p);
/* Solves for aim into p->chosen and p->action. */
ofl_status_t ofl__plan_choose(ofl_manager_t *m, uint64_t aim,
                              ofl__plan_result_t *r);
/* The choice in p->chosen becomes the plan. */
void ofl__plan_adopt(ofl_manager_t *m, uint64_t aim, uint64_t predicted_peak);
/* The prefetch leads' step (over: the measured peak is over the target);
 * true when a lead went back. */
bool ofl__plan_learn(ofl_manager_t *m, bool over);
/* Solves again for a lower aim after a peak over the target; whether it
 * solved. */
bool ofl__plan_replan(ofl_manager_t *m);
/* p->action, solved as r says, becomes the choice: p->chosen, p->lowest
 * and the estimates it was solved with follow (ofl__plan_adopt then makes
 * it the plan). */
void ofl__plan_take_actions(ofl_manager_t *m, const ofl__plan_result_t *r);

#endif /* OFL_PIPELINE_PLAN_H */
