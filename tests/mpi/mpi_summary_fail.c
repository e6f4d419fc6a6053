/* A rank that never calls the summary gather, or dies, shows up as an error
 * on the others within the timeout, naming the missing rank, never as a hang.
 *   skip   the last rank does not call; it calls late, after the others
 *          failed, and gets rank 0's failure at once
 *   skip0  rank 0 does not call; the others time out after twice the
 *          timeout; rank 0, calling late, learns that they gave up
 *   exit   the last rank exits with status 3 without MPI_Finalize after the
 *          comm was created (run with --mca orte_abort_on_non_zero_status 0
 *          so that mpirun lets the others report)
 * The ranks still alive count their wrong outcomes over a communicator
 * without the dead rank; world rank 0 prints TAP. */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "tests/tap.h"

/* Watchdog: a hang anywhere (in MPI too) becomes a failure with a message,
 * well before meson's timeout. */
static void on_alarm(int sig) {
  static const char msg[] = "Bail out! watchdog: no progress in 25 s\n";
  (void)sig;
  (void)!write(STDOUT_FILENO, msg, sizeof(msg) - 1);
  _exit(124);
}

#define TIMEOUT_MS 1000
/* Scheduling slack on an oversubscribed 2-core machine. */
#define SLACK_MS 1500

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static ofl_byte_table_t *table_of(int rank) {
  ofl_byte_table_t *t = NULL;
  ofl_byte_table_create(&t);
  ofl_byte_table_add(t, "core_attn", (uint64_t)(rank + 1) << 20);
  return t;
}

typedef struct {
  ofl_status_t st;
  double ms;
  int names_missing; /* the message names the rank that is missing */
  int broken_after;  /* the comm refuses the next call */
} outcome_t;

static outcome_t gather_once(ofl_comm_t *comm, int rank, int missing) {
  outcome_t o = {0};
  ofl_byte_table_t *t = table_of(rank);
  ofl_summary_t *s = NULL;
  double t0 = now_ms();
  o.st = ofl_summary_gather(comm, t, 0, &s);
  o.ms = now_ms() - t0;
  char want[32];
  snprintf(want, sizeof(want), "rank %d ", missing);
  o.names_missing = strstr(ofl_last_error(), want) != NULL;
  if (!o.names_missing)
    fprintf(stderr, "rank %d: message does not name rank %d: %s\n", rank,
            missing, ofl_last_error());
  ofl_summary_destroy(s);
  ofl_summary_t *again = NULL;
  o.broken_after =
      ofl_summary_gather(comm, t, 0, &again) == OFL_ERR_INVALID_USAGE &&
      ofl_comm_is_broken(comm);
  ofl_summary_destroy(again);
  ofl_byte_table_destroy(t);
  return o;
}

int main(int argc, char **argv) {
  signal(SIGALRM, on_alarm);
  alarm(25);
  MPI_Init(&argc, &argv);
  int wr, wn;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  MPI_Comm_size(MPI_COMM_WORLD, &wn);
  ofl_log_set_rank(wr);
  ofl_log_set_level(OFL_LOG_NONE); /* the failures are expected */
  const char *mode = argc > 1 ? argv[1] : "skip";
  int is_exit = strcmp(mode, "exit") == 0;
  int is_skip0 = strcmp(mode, "skip0") == 0;
  int odd = is_skip0 ? 0 : wn - 1; /* the rank that misbehaves */
  if (wn < 2 || (!is_exit && !is_skip0 && strcmp(mode, "skip") != 0)) {
    if (wr == 0)
      printf("usage: mpirun -n N>=2 %s skip|skip0|exit\n", argv[0]);
    MPI_Finalize();
    return 2;
  }

  /* The survivors' communicator, made while every rank is alive. */
  MPI_Comm alive;
  MPI_Comm_split(MPI_COMM_WORLD, is_exit && wr == odd ? MPI_UNDEFINED : 0, wr,
                 &alive);

  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = TIMEOUT_MS;
  ofl_comm_t *comm = NULL;
  if (ofl_comm_create_mpi(MPI_COMM_WORLD, &p, &comm) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: create failed: %s\n", wr, ofl_last_error());
    return 1; /* without MPI_Finalize: mpirun reports the job as failed */
  }
  if (wr == 0)
    tap_plan(is_exit ? 3 : 4);

  if (is_exit && wr == odd) {
    usleep(100 * 1000);
    _exit(3); /* dies: no gather, no MPI_Finalize */
  }

  long bad[4] = {0, 0, 0, 0};
  double worst = 0;
  if (wr != odd) {
    outcome_t o = gather_once(comm, wr, odd);
    /* Rank 0 waits one timeout; the others up to two when rank 0 itself is
     * the one missing. */
    double limit = (wr == 0 || !is_skip0 ? 1 : 2) * TIMEOUT_MS + SLACK_MS;
    int code_ok = o.st == OFL_ERR_TIMEOUT || (is_exit && o.st == OFL_ERR_MPI);
    bad[0] += !code_ok;
    bad[1] += o.ms > limit || (is_skip0 && o.ms < 2 * TIMEOUT_MS - 50);
    bad[2] += !o.names_missing || !o.broken_after;
    worst = o.ms;
    if (!code_ok || o.ms > limit)
      fprintf(stderr, "rank %d: %s after %.0f ms: %s\n", wr,
              ofl_status_str(o.st), o.ms, ofl_last_error());
  }
  /* The others are done (failed) before the late rank calls. */
  MPI_Barrier(alive);
  if (!is_exit && wr == odd) {
    ofl_byte_table_t *t = table_of(wr);
    ofl_summary_t *s = NULL;
    double t0 = now_ms();
    ofl_status_t st = ofl_summary_gather(comm, t, 0, &s);
    double ms = now_ms() - t0;
    const char *want =
        is_skip0 ? "gave up waiting for rank 0" : "failed on rank 0";
    bad[3] += st != OFL_ERR_TIMEOUT || s != NULL || ms > SLACK_MS ||
              strstr(ofl_last_error(), want) == NULL;
    if (bad[3])
      fprintf(stderr, "late rank %d: %s after %.0f ms: %s\n", wr,
              ofl_status_str(st), ms, ofl_last_error());
    ofl_summary_destroy(s);
    ofl_byte_table_destroy(t);
  }

  long total[4];
  double slowest = 0;
  MPI_Reduce(bad, total, 4, MPI_LONG, MPI_SUM, 0, alive);
  MPI_Reduce(&worst, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, alive);
  if (wr == 0) {
    tap_ok(total[0] == 0,
           "%s: every surviving rank reports OFL_ERR_TIMEOUT (%ld wrong)", mode,
           total[0]);
    tap_ok(total[1] == 0,
           "%s: within the bound (slowest %.0f ms, timeout %d ms)", mode,
           slowest, TIMEOUT_MS);
    tap_ok(total[2] == 0,
           "%s: the message names rank %d and the comm is then refused "
           "(%ld wrong)",
           mode, odd, total[2]);
    if (!is_exit)
      tap_ok(total[3] == 0,
             "%s: the late rank %d gets an error at once, not a summary", mode,
             odd);
  }
  ofl_comm_destroy(comm);
  MPI_Comm_free(&alive);
  int rc = wr == 0 ? tap_done() : 0;
  MPI_Finalize();
  return rc;
}
