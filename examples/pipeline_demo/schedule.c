/* Megatron-Core's 1F1B / interleaved 1F1B order of one rank
 * (megatron/core/pipeline_parallel/schedules.py): a warmup of forwards, then
 * one forward and one backward in turn, then the remaining backwards. */
#include "schedule.h"

/* Virtual microbatch k of the rank, as Megatron's get_schedule_table lays
 * them out for microbatch groups of pp: pp microbatches on chunk 0, the same
 * pp on chunk 1, ..., then the next pp microbatches. A backward runs the
 * chunks in reverse (get_model_chunk_id with forward=False). */
static void step_of(int k, int pp, int vpp, int fwd, sched_step_t *out) {
  int round = pp * vpp;
  int in_round = k % round;
  int chunk = in_round / pp;
  out->fwd = fwd;
  out->chunk = fwd ? chunk : vpp - 1 - chunk;
  out->mb = (k / round) * pp + in_round % pp;
}

/* get_pp_rank_microbatches: the forwards a rank runs before its first
 * backward, capped at all of them. Megatron-Core has no special case for
 * microbatches == pp (older Megatron-LM ran every forward first there): the
 * cap alone makes the first ranks all-warmup and leaves the last ones in
 * 1F1B. */
static int warmup_steps(int pp, int rank, int vpp, int total) {
  int warmup = vpp == 1 ? pp - rank - 1 : (pp - rank - 1) * 2 + (vpp - 1) * pp;
  return warmup > total ? total : warmup;
}

int sched_build(int pp, int rank, int vpp, int microbatches,
                sched_step_t *steps) {
  if (pp < 1 || rank < 0 || rank >= pp || vpp < 1 || microbatches < 1)
    return -1;
  if (vpp > 1 && microbatches % pp != 0)
    return -1;
  int total = microbatches * vpp;
  int warmup = warmup_steps(pp, rank, vpp, total);
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
