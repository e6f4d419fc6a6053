/* Prints the order of steps of the project's schedule generator
 * (examples/pipeline_demo/schedule.c) for check_megatron_schedule.py: for
 * each (pp vpp microbatches) triple on the command line and each rank, one
 * line "pp vpp mbs rank: F0.0 F0.1 ... B0.0 ..." (F or B, chunk.microbatch). */
#include <stdio.h>
#include <stdlib.h>

#include "examples/pipeline_demo/schedule.h"

int main(int argc, char **argv) {
  if (argc < 4 || (argc - 1) % 3 != 0) {
    fprintf(stderr, "usage: %s pp vpp microbatches [pp vpp microbatches ...]\n",
            argv[0]);
    return 2;
  }
  for (int a = 1; a + 2 < argc; a += 3) {
    int pp = atoi(argv[a]), vpp = atoi(argv[a + 1]), mbs = atoi(argv[a + 2]);
    sched_step_t *steps = calloc((size_t)2 * vpp * mbs + 1, sizeof *steps);
    if (steps == NULL)
      return 1;
    for (int rank = 0; rank < pp; rank++) {
      int n = sched_build(pp, rank, vpp, mbs, steps);
      printf("%d %d %d %d:", pp, vpp, mbs, rank);
      if (n < 0)
        printf(" invalid");
      for (int i = 0; i < n; i++)
        printf(" %c%d.%d", steps[i].fwd ? 'F' : 'B', steps[i].chunk,
               steps[i].mb);
      printf("\n");
    }
    free(steps);
  }
  return 0;
}
