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
 * without the dead rank; world rank 0 prints TAP.
 *
 * --comm nccl (after the mode): the comm is a NCCL comm over a blocking
 * ncclCommInitRank communicator (nccl-nb: ncclCommInitRankConfig with
 * blocking = 0, declared to ofl with nccl_nonblocking), one device per rank
 * (rank % device_count). NCCL cannot say which rank is missing, so every
 * survivor waits one timeout and reports OFL_ERR_TIMEOUT naming itself;
 * ofl then aborts the NCCL communicator (which frees it: the test must not
 * destroy it again), so the all-gather left on the stream ends and the
 * stream drains. The late rank then finds its peers gone: an NCCL error
 * (remote), at once; it aborts its communicator itself, which returns at
 * once. */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "tests/support/tap.h"

#if T_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <ofl/comm.h> /* again, after nccl.h: ofl_comm_create_nccl */
#endif

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

#if T_HAVE_NCCL
static ncclComm_t g_nccl;
static cudaStream_t g_stream;

/* The NCCL communicator of every world rank (collective). 0 or -1. */
static int nccl_open(int wr, int wn, int nonblocking) {
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  ncclResult_t nr = ncclSuccess;
  int ndev = 0;
  if (wr == 0)
    nr = ncclGetUniqueId(&id);
  MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (nr != ncclSuccess || cudaGetDeviceCount(&ndev) != cudaSuccess ||
      ndev < 1 || cudaSetDevice(wr % ndev) != cudaSuccess ||
      cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking) !=
          cudaSuccess)
    return -1;
  if (!nonblocking) {
    nr = ncclCommInitRank(&g_nccl, wn, id, wr);
  } else {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    nr = ncclCommInitRankConfig(&g_nccl, wn, id, wr, &cfg);
    double deadline = now_ms() + 20000;
    while (nr == ncclInProgress && now_ms() < deadline) {
      ncclResult_t a = ncclInProgress;
      if (ncclCommGetAsyncError(g_nccl, &a) != ncclSuccess)
        break;
      nr = a;
    }
  }
  if (nr != ncclSuccess)
    fprintf(stderr, "rank %d: NCCL init: %s\n", wr, ncclGetErrorString(nr));
  return nr == ncclSuccess ? 0 : -1;
}

/* cudaStreamQuery until the stream is idle or ms passed; 1 when idle. */
static int stream_drains(double ms) {
  double deadline = now_ms() + ms;
  for (;;) {
    cudaError_t e = cudaStreamQuery(g_stream);
    if (e == cudaSuccess)
      return 1;
    if (e != cudaErrorNotReady || now_ms() > deadline)
      return 0;
    usleep(2000);
  }
}

/* The NCCL flavour of the test (see the top of the file). */
static int main_nccl(int wr, int wn, const char *mode, int nonblocking) {
  int is_exit = strcmp(mode, "exit") == 0;
  int is_skip0 = strcmp(mode, "skip0") == 0;
  int odd = is_skip0 ? 0 : wn - 1;
  MPI_Comm alive;
  MPI_Comm_split(MPI_COMM_WORLD, is_exit && wr == odd ? MPI_UNDEFINED : 0, wr,
                 &alive);
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = TIMEOUT_MS;
  p.nccl_nonblocking = nonblocking;
  p.nccl_abort_on_timeout = 1; /* the abort ends the pending all-gather */
  ofl_comm_t *comm = NULL;
  if (nccl_open(wr, wn, nonblocking) != 0 ||
      ofl_comm_create_nccl(g_nccl, g_stream, &p, &comm) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: create failed: %s\n", wr, ofl_last_error());
    return 1;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (wr == 0)
    tap_plan(is_exit ? 4 : 5);
  if (is_exit && wr == odd) {
    usleep(100 * 1000);
    _exit(3);
  }
  long bad[5] = {0, 0, 0, 0, 0};
  double worst = 0;
  char self[32];
  snprintf(self, sizeof(self), "rank %d of %d", wr, wn);
  if (wr != odd) {
    ofl_byte_table_t *t = table_of(wr);
    ofl_summary_t *s = NULL;
    double t0 = now_ms();
    ofl_status_t st = ofl_summary_gather(comm, t, 0, &s);
    worst = now_ms() - t0;
    bad[0] += st != OFL_ERR_TIMEOUT || s != NULL;
    bad[1] += worst > TIMEOUT_MS + SLACK_MS || worst < TIMEOUT_MS - 50;
    if (st != OFL_ERR_TIMEOUT || worst > TIMEOUT_MS + SLACK_MS)
      fprintf(stderr, "rank %d: %s after %.0f ms: %s\n", wr,
              ofl_status_str(st), worst, ofl_last_error());
    /* the message names this rank and says the communicator was aborted;
     * the comm is refused */
    const char *msg = ofl_last_error();
    int aborted = strstr(msg, "was aborted (ncclCommAbort)") != NULL;
    bad[2] += strstr(msg, self) == NULL || !aborted;
    if (bad[2])
      fprintf(stderr, "rank %d: message: %s\n", wr, msg);
    ofl_summary_destroy(s);
    ofl_summary_t *again = NULL;
    bad[2] += ofl_summary_gather(comm, t, 0, &again) != OFL_ERR_INVALID_USAGE ||
              !ofl_comm_is_broken(comm);
    ofl_summary_destroy(again);
    ofl_byte_table_destroy(t);
    /* ofl's abort ended the all-gather that waited for the missing rank */
    bad[3] += !aborted || !stream_drains(SLACK_MS);
    if (!aborted) /* not ofl's: clean up as an application would */
      ncclCommAbort(g_nccl);
    (void)cudaGetLastError();
  }
  MPI_Barrier(alive);
  if (!is_exit && wr == odd) {
    /* the late rank: its peers aborted; an NCCL error, at once */
    ofl_byte_table_t *t = table_of(wr);
    ofl_summary_t *s = NULL;
    double t0 = now_ms();
    ofl_status_t st = ofl_summary_gather(comm, t, 0, &s);
    double ms = now_ms() - t0;
    bad[4] += st != OFL_ERR_NCCL || s != NULL || ms > SLACK_MS ||
              strstr(ofl_last_error(), "remote") == NULL;
    if (bad[4])
      fprintf(stderr, "late rank %d: %s after %.0f ms: %s\n", wr,
              ofl_status_str(st), ms, ofl_last_error());
    ofl_summary_destroy(s);
    ofl_byte_table_destroy(t);
    double a0 = now_ms();
    bad[4] += ncclCommAbort(g_nccl) != ncclSuccess;
    bad[4] += now_ms() - a0 > SLACK_MS || !stream_drains(SLACK_MS);
  }
  long total[5];
  double slowest = 0;
  MPI_Reduce(bad, total, 5, MPI_LONG, MPI_SUM, 0, alive);
  MPI_Reduce(&worst, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, alive);
  if (wr == 0) {
    tap_ok(total[0] == 0,
           "%s nccl: every surviving rank reports OFL_ERR_TIMEOUT (%ld wrong)",
           mode, total[0]);
    tap_ok(total[1] == 0,
           "%s nccl: after one timeout (slowest %.0f ms, timeout %d ms)", mode,
           slowest, TIMEOUT_MS);
    tap_ok(total[2] == 0,
           "%s nccl: the message names the waiting rank and says to abort; "
           "the comm is then refused (%ld wrong)",
           mode, total[2]);
    tap_ok(total[3] == 0,
           "%s nccl: ofl aborted the NCCL communicator and the all-gather "
           "left on the stream ended (%ld wrong)",
           mode, total[3]);
    if (!is_exit)
      tap_ok(total[4] == 0,
             "%s nccl: the late rank %d gets an NCCL error (remote) at once, "
             "and its own ncclCommAbort returns at once",
             mode, odd);
  }
  ofl_comm_destroy(comm);
  cudaStreamDestroy(g_stream);
  MPI_Comm_free(&alive);
  return wr == 0 ? tap_done() : 0;
}
#endif

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
  const char *comm_kind = "mpi";
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--comm") == 0)
      comm_kind = argv[i + 1];
  int is_exit = strcmp(mode, "exit") == 0;
  int is_skip0 = strcmp(mode, "skip0") == 0;
  int odd = is_skip0 ? 0 : wn - 1; /* the rank that misbehaves */
  if (wn < 2 || (!is_exit && !is_skip0 && strcmp(mode, "skip") != 0)) {
    if (wr == 0)
      printf("usage: mpirun -n N>=2 %s skip|skip0|exit\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  if (strcmp(comm_kind, "mpi") != 0) {
#if T_HAVE_NCCL
    int rc = main_nccl(wr, wn, mode, strcmp(comm_kind, "nccl-nb") == 0);
#else
    int rc = 0;
    if (wr == 0)
      printf("1..0 # SKIP this build has no NCCL\n");
#endif
    MPI_Finalize();
    return rc;
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
