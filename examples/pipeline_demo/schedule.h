/* Megatron-Core's 1F1B and interleaved 1F1B order of steps for one pipeline
 * rank: the one generator of the project, used by the pipeline demo and by
 * the tests that play whole schedules (tests/support/schedule.h). Its order
 * is checked against Megatron-Core's own by
 * tests/unit/pipeline/check_megatron_schedule.py. */
#ifndef OFL_DEMO_SCHEDULE_H
#define OFL_DEMO_SCHEDULE_H

typedef struct {
  int fwd;   /* 1: forward step, 0: backward step */
  int chunk; /* virtual stage on this rank (model chunk), 0 .. vpp-1 */
  int mb;    /* microbatch */
} sched_step_t;

/* Fills steps (2 * microbatches * vpp entries) with the order in which rank
 * `rank` of `pp` runs its forward and backward steps. vpp 1 is 1F1B
 * (forward_backward_pipelining_without_interleaving); vpp > 1 is interleaved
 * 1F1B (forward_backward_pipelining_with_interleaving with Megatron's
 * default microbatch_group_size_per_vp_stage, pp), where microbatches must
 * be a multiple of pp. Returns the number of steps, or -1 on invalid
 * arguments. */
int sched_build(int pp, int rank, int vpp, int microbatches,
                sched_step_t *steps);

#endif
