/* MPI comms with a timeout of INT64_MAX ms, and one whose double (what ranks
 * other than 0 wait for rank 0) passes INT64_MAX, under mpirun: deadlines
 * saturate, so the comm is created and its gathers complete with every
 * rank's bytes. In the first gather the other ranks come late, in the second
 * rank 0 does, so that each side polls its deadline while a peer is missing
 * (a deadline that wrapped into the past timed out at once there). TAP from
 * rank 0; wrong values are counted on every rank and summed on rank 0. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "tests/support/tap.h"

#define LATE_US 50000

static uint64_t bytes_of(int rank) { return 1000 + 7 * (uint64_t)rank; }

/* Wrong cells of a summary of n ranks (group "g", bytes_of(rank)). */
static long check(const ofl_summary_t *s, int n) {
  size_t g = 0;
  if (s == NULL || ofl_summary_nranks(s) != n ||
      ofl_summary_find_group(s, "g", &g) != OFL_SUCCESS)
    return 1;
  long wrong = 0;
  for (int r = 0; r < n; r++)
    wrong += ofl_summary_bytes(s, r, g) != bytes_of(r);
  return wrong;
}

/* One comm with timeout_ms: create, a gather to rank 0 with the others
 * late, a gather to all with rank 0 late. Wrong values and failed calls on
 * this rank. */
static long run(int64_t timeout_ms, int wr, int wn) {
  long bad = 0;
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = timeout_ms;
  ofl_comm_t *c = NULL;
  MPI_Comm world = MPI_COMM_WORLD;
  if (ofl_comm_create_mpi_handle(&world, &p, &c) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: create: %s\n", wr, ofl_last_error());
    return 1;
  }
  bad += ofl_comm_timeout_ms(c) != timeout_ms;
  ofl_byte_table_t *tb = NULL;
  if (ofl_byte_table_create(&tb) != OFL_SUCCESS ||
      ofl_byte_table_add(tb, "g", bytes_of(wr)) != OFL_SUCCESS) {
    ofl_comm_destroy(c);
    return 1;
  }
  for (int round = 0; round < 2; round++) {
    int root_only = round == 0;
    if ((round == 0) == (wr != 0))
      usleep(LATE_US);
    ofl_summary_t *s = NULL;
    ofl_status_t st = ofl_summary_gather(c, tb, root_only, &s);
    if (st != OFL_SUCCESS) {
      fprintf(stderr, "rank %d: gather %d: %s\n", wr, round, ofl_last_error());
      bad++;
    } else if (!root_only || wr == 0) {
      bad += check(s, wn);
    }
    ofl_summary_destroy(s);
  }
  ofl_byte_table_destroy(tb);
  ofl_comm_destroy(c);
  return bad;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int wr = 0, wn = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  MPI_Comm_size(MPI_COMM_WORLD, &wn);
  ofl_log_set_rank(wr);
  const int64_t timeouts[] = {INT64_MAX, INT64_MAX / 2 + 1};
  const int nt = (int)(sizeof timeouts / sizeof timeouts[0]);
  if (wr == 0)
    tap_plan(nt);
  for (int i = 0; i < nt; i++) {
    long bad = run(timeouts[i], wr, wn), sum = 0;
    MPI_Reduce(&bad, &sum, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    if (wr == 0)
      tap_ok(sum == 0,
             "timeout %lld ms: comm created, gathers with late ranks "
             "complete with every rank's bytes (%ld wrong)",
             (long long)timeouts[i], sum);
  }
  int rc = wr == 0 ? tap_done() : 0;
  MPI_Finalize();
  return rc;
}
