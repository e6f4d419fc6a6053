/* ofl pipeline demo: the 1F1B / interleaved 1F1B order of one rank, as the
 * Megatron-style schedules run it: a warmup of forwards, then one forward and
 * one backward in turn, then the remaining backwards. */
#include "schedule.h"

static void step_of(int k, int pp, int vpp, int forward, sched_step_t *out) {
  int round = pp * vpp;
  int in_round = k % round;
  int chunk = in_round / pp;
  out->forward = forward;
  out->chunk = forward ? chunk : vpp - 1 - chunk;
  out->microbatch = (k / round) * pp + in_round % pp;
}

int sched_build(int pp, int rank, int vpp, int microbatches,
                sched_step_t *steps) {
  if (pp < 1 || rank < 0 || rank >= pp || vpp < 1 || microbatches < 1)
    return -1;
  if (vpp > 1 && microbatches % pp != 0)
    return -1;
  int total = microbatches * vpp;
  int warmup;
  if (vpp == 1) {
    warmup = pp - rank - 1;
  } else {
    warmup = (pp - rank - 1) * 2 + (vpp - 1) * pp;
  }
  if (warmup > total)
    warmup = total;
  int n = 0, f = 0, b = 0;
  for (; f < warmup; f++)
    step_of(f, pp, vpp, 1, &steps[n++]);
  while (f < total) {
    step_of(f++, pp, vpp, 1, &steps[n++]);
    step_of(b++, pp, vpp, 0, &steps[n++]);
  }
  while (b < total)
    step_of(b++, pp, vpp, 0, &steps[n++]);
  return n;
}
