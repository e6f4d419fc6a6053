/* ofl pipeline demo: 1F1B and interleaved 1F1B schedules for one rank. */
#ifndef OFL_DEMO_SCHEDULE_H
#define OFL_DEMO_SCHEDULE_H

typedef struct {
  int forward; /* 1: forward step, 0: backward step */
  int microbatch;
  int chunk; /* virtual stage on this rank, 0 .. vpp-1 */
} sched_step_t;

/* Fills steps (2 * microbatches * vpp entries) with the order in which rank
 * `rank` of `pp` runs its forward and backward steps. With vpp > 1 the
 * schedule is interleaved and microbatches must be a multiple of pp.
 * Returns the number of steps, or -1 on invalid arguments. */
int sched_build(int pp, int rank, int vpp, int microbatches,
                sched_step_t *steps);

#endif
