/* The summary gather under mpirun (1 to 4 ranks): rank-specific tables with
 * disjoint and overlapping names and an empty rank, compared cell by cell
 * with values computed here independently of the library; the result on rank
 * 0 only and on every rank; sub-communicators (groups of two); tables large
 * enough for MPI's rendezvous protocol; repeated gathers and barriers. Wrong
 * values are counted on every rank and summed on rank 0, which prints TAP.
 *
 * --comm mpi (default): the ofl comms are MPI comms. --comm nccl: NCCL comms
 * (rank 0 makes a ncclUniqueId, MPI_Bcast sends it, every rank runs on
 * device rank % device_count with a nonblocking stream and
 * ncclCommInitRank); --comm nccl-nb: the same with ncclCommInitRankConfig
 * and blocking = 0 (init and collectives answer ncclInProgress). Same
 * checks; the NCCL modes add the application's own NCCL collective on the
 * communicator ofl used, and (on the cudasim stand-in) that no shared
 * memory object of the job is left in /dev/shm.
 *
 * Device memory is only touched through copies (tests/support/devmem.h), so the
 * manager check runs on the backend under test (OFLTEST_BACKEND). */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "tests/support/devmem.h"
#include "tests/support/tap.h"

#if T_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <ofl/comm.h> /* again, after nccl.h: ofl_comm_create_nccl */
#include <time.h>
#endif

/* ---- the comm under test: MPI or NCCL -------------------------------------
 */
enum { COMM_MPI = 0, COMM_NCCL = 1, COMM_NCCL_NB = 2 };
static int g_mode = COMM_MPI;

typedef struct {
  ofl_comm_t *comm;
#if T_HAVE_NCCL
  ncclComm_t nccl;
  cudaStream_t stream;
  char shm_name[128]; /* the stand-in's object for this id ("" otherwise) */
  int nccl_gone;      /* ofl aborted it (after a timeout): not ours to end */
#endif
} tcomm_t;

static long g_shm_left; /* stand-in objects of this job still in /dev/shm */

#if T_HAVE_NCCL
static double t_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* A NCCL communicator over the ranks of mc on device rank % count (world
 * rank), plus a nonblocking stream. 0 or -1 (message on stderr). */
static int nccl_open(MPI_Comm mc, tcomm_t *t) {
  int r, n, wr, ndev = 0;
  MPI_Comm_rank(mc, &r);
  MPI_Comm_size(mc, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  ncclResult_t nr = ncclSuccess;
  if (r == 0)
    nr = ncclGetUniqueId(&id);
  MPI_Bcast(&id, (int)sizeof(id), MPI_BYTE, 0, mc);
  if (nr != ncclSuccess || cudaGetDeviceCount(&ndev) != cudaSuccess ||
      ndev < 1 || cudaSetDevice(wr % ndev) != cudaSuccess ||
      cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking) !=
          cudaSuccess) {
    fprintf(stderr, "rank %d: CUDA/NCCL setup failed (%d devices)\n", wr, ndev);
    return -1;
  }
  if (strncmp(id.internal + 16, "/cudasim-nccl-", 14) == 0)
    snprintf(t->shm_name, sizeof(t->shm_name), "/dev/shm%.100s",
             id.internal + 16);
  if (g_mode == COMM_NCCL) {
    nr = ncclCommInitRank(&t->nccl, n, id, r);
  } else {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    nr = ncclCommInitRankConfig(&t->nccl, n, id, r, &cfg);
    double deadline = t_now_ms() + 20000;
    while (nr == ncclInProgress && t_now_ms() < deadline) {
      ncclResult_t a = ncclInProgress;
      if (ncclCommGetAsyncError(t->nccl, &a) != ncclSuccess)
        break;
      nr = a;
    }
  }
  if (nr != ncclSuccess) {
    fprintf(stderr, "rank %d: NCCL init: %s\n", wr, ncclGetErrorString(nr));
    return -1;
  }
  return 0;
}
#endif

/* An ofl comm of the mode under test over the ranks of mc (collective). */
static ofl_status_t tcomm_open(MPI_Comm mc, const ofl_comm_params_t *p,
                               tcomm_t *t) {
  memset(t, 0, sizeof(*t));
  if (g_mode == COMM_MPI)
    return ofl_comm_create_mpi(mc, p, &t->comm);
#if T_HAVE_NCCL
  if (nccl_open(mc, t) != 0)
    return OFL_ERR_NCCL;
  ofl_comm_params_t q = *p;
  q.nccl_nonblocking = g_mode == COMM_NCCL_NB;
  ofl_status_t st = ofl_comm_create_nccl(t->nccl, t->stream, &q, &t->comm);
  if (t->shm_name[0]) {
    MPI_Barrier(mc); /* every rank joined */
    g_shm_left += access(t->shm_name, F_OK) == 0;
  }
  return st;
#else
  return OFL_ERR_NOT_SUPPORTED;
#endif
}

static void tcomm_close(tcomm_t *t) {
  ofl_comm_destroy(t->comm);
  t->comm = NULL;
#if T_HAVE_NCCL
  if (t->nccl && !t->nccl_gone)
    ncclCommDestroy(t->nccl);
  if (t->stream)
    cudaStreamDestroy(t->stream);
  t->nccl = NULL;
  t->stream = NULL;
#endif
}

/* Watchdog: a hang anywhere (in MPI too) becomes a failure with a message,
 * well before meson's timeout. */
static void on_alarm(int sig) {
  static const char msg[] = "Bail out! watchdog: no progress in 25 s\n";
  (void)sig;
  (void)!write(STDOUT_FILENO, msg, sizeof(msg) - 1);
  _exit(124);
}

#define MAX_NAMES 1024 /* per rank and in the union */

/* ---- the tables each rank contributes, as plain data ----------------------
 * Rank r of a comm of n ranks (case c) holds:
 *   "shared"          (r + 1) * 1 MiB          on every rank but the empty one
 *   "only_r<r>"       r * 1000 + 7             disjoint names
 *   "pair_<r/2>"      2^(32 + r) + c           overlapping between neighbours
 *   "big_<k>" k < nbig(c): a long name         many names (rendezvous sizes)
 * and rank 2 (when n > 2) holds nothing at all. */
typedef struct {
  char name[200];
  uint64_t bytes;
} entry_t;

static int nbig(int c) { return c == 2 ? 300 : 0; }

static int rank_entries(int r, int n, int c, entry_t *e) {
  int k = 0;
  if (n > 2 && r == 2)
    return 0;
  snprintf(e[k].name, sizeof(e[k].name), "shared");
  e[k++].bytes = (uint64_t)(r + 1) << 20;
  snprintf(e[k].name, sizeof(e[k].name), "only_r%d", r);
  e[k++].bytes = (uint64_t)r * 1000u + 7u;
  snprintf(e[k].name, sizeof(e[k].name), "pair_%d", r / 2);
  e[k++].bytes = (1ull << (32 + r)) + (uint64_t)c;
  for (int b = 0; b < nbig(c); b++) {
    snprintf(e[k].name, sizeof(e[k].name),
             "big_%03d_a_rather_long_group_name_to_make_the_payload_large_%d",
             b, r % 2);
    e[k++].bytes = (uint64_t)b * 4096u + (uint64_t)r;
  }
  return k;
}

/* Expected matrix: names sorted (insertion into a sorted list), cells. */
typedef struct {
  int nnames;
  char names[MAX_NAMES + 8][200];
  uint64_t cell[4][MAX_NAMES + 8];
} expect_t;

static void expect_build(int n, int c, expect_t *x) {
  static entry_t e[MAX_NAMES];
  memset(x, 0, sizeof(*x));
  for (int r = 0; r < n; r++) {
    int k = rank_entries(r, n, c, e);
    for (int i = 0; i < k; i++) {
      int at = 0;
      while (at < x->nnames && strcmp(x->names[at], e[i].name) < 0)
        at++;
      if (at == x->nnames || strcmp(x->names[at], e[i].name) != 0) {
        if (x->nnames == MAX_NAMES) {
          fprintf(stderr, "test bug: more than %d names\n", MAX_NAMES);
          exit(2);
        }
        memmove(x->names[at + 1], x->names[at],
                sizeof(x->names[0]) * (size_t)(x->nnames - at));
        for (int q = 0; q < 4; q++)
          memmove(&x->cell[q][at + 1], &x->cell[q][at],
                  sizeof(uint64_t) * (size_t)(x->nnames - at));
        strcpy(x->names[at], e[i].name);
        for (int q = 0; q < 4; q++)
          x->cell[q][at] = 0;
        x->nnames++;
      }
      x->cell[r][at] = e[i].bytes;
    }
  }
}

static ofl_byte_table_t *my_table(int r, int n, int c) {
  static entry_t e[MAX_NAMES];
  ofl_byte_table_t *t = NULL;
  if (ofl_byte_table_create(&t) != OFL_SUCCESS)
    return NULL;
  int k = rank_entries(r, n, c, e);
  for (int i = 0; i < k; i++)
    if (ofl_byte_table_add(t, e[i].name, e[i].bytes) != OFL_SUCCESS) {
      ofl_byte_table_destroy(t);
      return NULL;
    }
  return t;
}

/* Number of wrong values in s against x (every cell and total). */
static long count_wrong(const ofl_summary_t *s, int n, const expect_t *x) {
  long bad = 0;
  if (ofl_summary_nranks(s) != n || (int)ofl_summary_ngroups(s) != x->nnames)
    return 1000000;
  uint64_t grand = 0;
  for (int g = 0; g < x->nnames; g++) {
    bad += strcmp(ofl_summary_group_name(s, (size_t)g), x->names[g]) != 0;
    uint64_t col = 0;
    for (int r = 0; r < n; r++) {
      bad += ofl_summary_bytes(s, r, (size_t)g) != x->cell[r][g];
      col += x->cell[r][g];
    }
    bad += ofl_summary_group_total(s, (size_t)g) != col;
    grand += col;
  }
  for (int r = 0; r < n; r++) {
    uint64_t row = 0;
    for (int g = 0; g < x->nnames; g++)
      row += x->cell[r][g];
    bad += ofl_summary_rank_total(s, r) != row;
  }
  bad += ofl_summary_total(s) != grand;
  return bad;
}

static expect_t g_expect;

/* One gather on comm (case c); wrong values and failures counted into *bad.
 * Returns whether this rank got a summary. */
static int run_case(MPI_Comm mc, int c, int root_only, long *bad,
                    char **text_out) {
  int r, n;
  MPI_Comm_rank(mc, &r);
  MPI_Comm_size(mc, &n);
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = 20000;
  tcomm_t tc;
  if (tcomm_open(mc, &p, &tc) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: create: %s\n", r, ofl_last_error());
    tcomm_close(&tc);
    *bad += 1000;
    return 0;
  }
  ofl_comm_t *comm = tc.comm;
  *bad += ofl_comm_rank(comm) != r || ofl_comm_size(comm) != n ||
          ofl_comm_kind(comm) !=
              (g_mode == COMM_MPI ? OFL_COMM_MPI : OFL_COMM_NCCL);
  ofl_byte_table_t *t = my_table(r, n, c);
  ofl_summary_t *s = NULL;
  ofl_status_t st = ofl_summary_gather(comm, t, root_only, &s);
  int got = s != NULL;
  if (st != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: gather: %s\n", r, ofl_last_error());
    *bad += 1000;
  } else if (root_only && r != 0) {
    *bad += s != NULL; /* nothing on the other ranks */
  } else {
    expect_build(n, c, &g_expect);
    *bad += count_wrong(s, n, &g_expect);
    if (text_out)
      ofl_summary_render(s, OFL_SUMMARY_TEXT, text_out, NULL);
  }
  ofl_summary_destroy(s);
  ofl_byte_table_destroy(t);
  tcomm_close(&tc);
  return got;
}

/* One iteration of two "core_attn" groups of 8 KiB per rank through a
 * manager on comm; offload is off on the last rank. Returns wrong things. */
static long manager_case(ofl_comm_t *comm, int r, int n) {
  long bad = 0;
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = t_backend(); /* cuda: the calling thread's current device */
  ofl_device_t *dev = NULL;
  if (ofl_device_open(&dp, &dev) != OFL_SUCCESS)
    return 1000;
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  ofl_pool_t *pool = NULL;
  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
  mp.device = dev;
  mp.offload = r != n - 1;
  mp.groups = "";
  mp.min_offload_bytes = 1;
  mp.comm = comm;
  mp.rank = r;
  ofl_manager_t *m = NULL;
  if (ofl_pool_create(dev, &pp, &pool) != OFL_SUCCESS ||
      ofl_manager_create(&mp, &m) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: manager: %s\n", r, ofl_last_error());
    ofl_pool_destroy(pool);
    ofl_device_close(dev);
    return 1000;
  }
  ofl_stream_t *c = ofl_device_compute_stream(dev);
  ofl_tag_t tag[2];
  int64_t shape[1] = {8192};
  bad += ofl_manager_chunk_begin(m, 1, 0) != OFL_SUCCESS;
  for (int l = 0; l < 2; l++) {
    ofl_tensor_t *t = NULL;
    bad += ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, c, &t) != OFL_SUCCESS;
    if (t == NULL)
      continue;
    bad += t_set(dev, ofl_tensor_data(t), 0x40 + l + r, 8192) != OFL_SUCCESS;
    bad += ofl_manager_group_start(m, "core_attn") != OFL_SUCCESS;
    bad += ofl_manager_tensor_push(m, t, &tag[l]) != OFL_SUCCESS;
    bad += ofl_manager_group_commit(m, "core_attn", NULL, 0, 0) != OFL_SUCCESS;
  }
  for (int l = 1; l >= 0; l--) {
    ofl_tensor_t *t = NULL;
    bad += ofl_manager_group_backward_begin(m, "core_attn") != OFL_SUCCESS;
    bad += ofl_manager_tensor_pop(m, tag[l], &t) != OFL_SUCCESS;
    bad += ofl_stream_synchronize(c, -1) != OFL_SUCCESS;
    if (t != NULL) {
      size_t w = t_wrong_value(dev, ofl_tensor_data(t), 8192, 0x40 + l + r);
      bad += w == SIZE_MAX ? 8192 : (long)w;
      ofl_tensor_destroy(t);
    }
    bad += ofl_manager_group_backward_end(m, "core_attn") != OFL_SUCCESS;
  }
  if (ofl_manager_reset(m) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: reset: %s\n", r, ofl_last_error());
    bad += 1000;
  }
  const ofl_summary_t *s = ofl_manager_summary(m);
  if (s == NULL || ofl_summary_nranks(s) != n) {
    bad += 100;
  } else {
    uint64_t mine = ofl_manager_summary_total_bytes(m);
    bad += ofl_summary_rank_total(s, r) != mine;
    bad += r == n - 1 ? mine != 0 : mine == 0;
    bad += ofl_summary_rank_total(s, n - 1) != 0;
  }
  ofl_manager_destroy(m);
  ofl_pool_destroy(pool);
  ofl_device_close(dev);
  return bad;
}

#if T_HAVE_NCCL
/* Waits for a collective issued on t: polls ncclCommGetAsyncError while
 * it answers ncclInProgress (nonblocking communicator), then the stream. */
static long nccl_settle(tcomm_t *t, ncclResult_t r) {
  double deadline = t_now_ms() + 20000;
  while (r == ncclInProgress && t_now_ms() < deadline) {
    ncclResult_t a = ncclInProgress;
    if (ncclCommGetAsyncError(t->nccl, &a) != ncclSuccess)
      return 1;
    r = a;
  }
  if (r != ncclSuccess) {
    fprintf(stderr, "NCCL collective: %s\n", ncclGetErrorString(r));
    return 1;
  }
  return cudaStreamSynchronize(t->stream) != cudaSuccess;
}

static long nccl_app_check(tcomm_t *t, int r, int n) {
  long bad = 0;
  int64_t *d64 = NULL;
  double *dd = NULL;
  float *df = NULL;
  if (cudaMalloc((void **)&d64, 4 * sizeof(int64_t)) != cudaSuccess ||
      cudaMalloc((void **)&dd, 2 * sizeof(double)) != cudaSuccess ||
      cudaMalloc((void **)&df, 2 * sizeof(float)) != cudaSuccess)
    return 1000;
  int64_t h64[4] = {r + 1, -(int64_t)r, (int64_t)1 << (40 + r), 0};
  double hd[2] = {0.5 * r, -1.25 * r};
  float hf[2] = {(float)r, 2.0f * (float)r};
  bad += cudaMemcpyAsync(d64, h64, sizeof(h64), cudaMemcpyHostToDevice,
                         t->stream) != cudaSuccess;
  bad += cudaMemcpyAsync(dd, hd, sizeof(hd), cudaMemcpyHostToDevice,
                         t->stream) != cudaSuccess;
  bad += cudaMemcpyAsync(df, hf, sizeof(hf), cudaMemcpyHostToDevice,
                         t->stream) != cudaSuccess;
  /* in place: three int64 sums; out of place: max of doubles into dd+1 is
   * not allowed to overlap, so max in place, min of floats in place */
  bad += nccl_settle(
      t, ncclAllReduce(d64, d64, 3, ncclInt64, ncclSum, t->nccl, t->stream));
  bad += nccl_settle(
      t, ncclAllReduce(dd, dd, 2, ncclFloat64, ncclMax, t->nccl, t->stream));
  bad += nccl_settle(
      t, ncclAllReduce(df, df, 2, ncclFloat32, ncclMin, t->nccl, t->stream));
  /* broadcast of the last rank's value into d64[3] */
  int64_t v = 1000 + r;
  bad += cudaMemcpyAsync(d64 + 3, &v, sizeof(v), cudaMemcpyHostToDevice,
                         t->stream) != cudaSuccess;
  bad += nccl_settle(t, ncclBroadcast(d64 + 3, d64 + 3, 1, ncclInt64, n - 1,
                                      t->nccl, t->stream));
  int64_t o64[4] = {0};
  double od[2] = {0};
  float of[2] = {0};
  bad += cudaMemcpyAsync(o64, d64, sizeof(o64), cudaMemcpyDeviceToHost,
                         t->stream) != cudaSuccess;
  bad += cudaMemcpyAsync(od, dd, sizeof(od), cudaMemcpyDeviceToHost,
                         t->stream) != cudaSuccess;
  bad += cudaMemcpyAsync(of, df, sizeof(of), cudaMemcpyDeviceToHost,
                         t->stream) != cudaSuccess;
  bad += cudaStreamSynchronize(t->stream) != cudaSuccess;
  int64_t want0 = (int64_t)n * (n + 1) / 2, want1 = -(int64_t)n * (n - 1) / 2,
          want2 = 0;
  for (int q = 0; q < n; q++)
    want2 += (int64_t)1 << (40 + q);
  bad += o64[0] != want0;
  bad += o64[1] != want1;
  bad += o64[2] != want2;
  bad += o64[3] != 1000 + (n - 1);
  bad += od[0] != 0.5 * (n - 1) || od[1] != 0.0;
  bad += of[0] != 0.0f || of[1] != 0.0f;
  cudaFree(d64);
  cudaFree(dd);
  cudaFree(df);
  return bad;
}
#endif

static long sum_to_root(long v) {
  long total = 0;
  MPI_Reduce(&v, &total, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
  return total;
}

int main(int argc, char **argv) {
  signal(SIGALRM, on_alarm);
  alarm(25);
  MPI_Init(&argc, &argv);
  int wr, wn;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  MPI_Comm_size(MPI_COMM_WORLD, &wn);
  ofl_log_set_rank(wr);
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--comm") == 0)
      g_mode = strcmp(argv[i + 1], "nccl") == 0      ? COMM_NCCL
               : strcmp(argv[i + 1], "nccl-nb") == 0 ? COMM_NCCL_NB
                                                     : COMM_MPI;
#if !T_HAVE_NCCL
  if (g_mode != COMM_MPI) {
    if (wr == 0)
      printf("1..0 # SKIP this build has no NCCL\n");
    MPI_Finalize();
    return 0;
  }
#endif
  if (wr == 0)
    tap_plan(g_mode == COMM_MPI ? 10 : 12);
  long bad, total;

  /* 1, 2: tables on rank 0 only, then on every rank. */
  bad = 0;
  char *text = NULL;
  int got = run_case(MPI_COMM_WORLD, 0, 1, &bad, wr == 0 ? &text : NULL);
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0 && got,
           "root_only: rank 0's table and totals equal "
           "the expected values on %d ranks (%ld wrong)",
           wn, total);
  bad = 0;
  run_case(MPI_COMM_WORLD, 1, 0, &bad, NULL);
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0,
           "all ranks: every rank's summary equals the expected "
           "values (%ld wrong)",
           total);

  /* 3: the text rank 0 prints is the one built from the same tables
   * locally (rendering itself is unit-tested). */
  if (wr == 0) {
    ofl_byte_table_t *tabs[4] = {0};
    for (int r = 0; r < wn; r++)
      tabs[r] = my_table(r, wn, 0);
    ofl_summary_t *local = NULL;
    char *want = NULL;
    ofl_summary_from_tables((const ofl_byte_table_t *const *)tabs, wn, &local);
    ofl_summary_render(local, OFL_SUMMARY_TEXT, &want, NULL);
    tap_ok(text && want && strcmp(text, want) == 0 &&
               strstr(text, "Activation Offload Summary (MB)"),
           "rank 0's text table equals the table of the same data");
    for (char *line = text, *nl; line && (nl = strchr(line, '\n'));
         line = nl + 1)
      printf("# %.*s\n", (int)(nl - line), line);
    free(want);
    ofl_summary_destroy(local);
    for (int r = 0; r < wn; r++)
      ofl_byte_table_destroy(tabs[r]);
  }
  free(text);

  /* 4: 300 long names per rank: payloads beyond the eager limit. */
  bad = 0;
  run_case(MPI_COMM_WORLD, 2, 0, &bad, NULL);
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0,
           "large tables (%d names per rank) gathered exactly "
           "(%ld wrong)",
           nbig(2), total);

  /* 5: sub-communicators: groups of two ranks gather separately; each row
   * is the sub-rank's table, each group sees only its own ranks. */
  MPI_Comm sub;
  MPI_Comm_split(MPI_COMM_WORLD, wr / 2, wr, &sub);
  bad = 0;
  got = run_case(sub, 3, 1, &bad, NULL);
  int sr, sn;
  MPI_Comm_rank(sub, &sr);
  MPI_Comm_size(sub, &sn);
  long roots_with_summary = 0, mine = got && sr == 0;
  MPI_Reduce(&mine, &roots_with_summary, 1, MPI_LONG, MPI_SUM, 0,
             MPI_COMM_WORLD);
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0 && roots_with_summary == (wn + 1) / 2,
           "sub-communicators of two: %ld group roots got their group's "
           "exact summary (%ld wrong)",
           roots_with_summary, total);

  /* 6: several gathers and barriers in a row on one comm. */
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = 20000;
  tcomm_t main_tc;
  bad = tcomm_open(MPI_COMM_WORLD, &p, &main_tc) != OFL_SUCCESS;
  ofl_comm_t *comm = bad ? NULL : main_tc.comm;
  for (int it = 0; it < 20 && comm; it++) {
    ofl_byte_table_t *t = my_table(wr, wn, it % 2);
    ofl_summary_t *s = NULL;
    if (ofl_summary_gather(comm, t, it % 3 == 0, &s) != OFL_SUCCESS)
      bad += 1000;
    else if (s) {
      expect_build(wn, it % 2, &g_expect);
      bad += count_wrong(s, wn, &g_expect);
    }
    bad += ofl_comm_barrier(comm) != OFL_SUCCESS;
    ofl_summary_destroy(s);
    ofl_byte_table_destroy(t);
  }
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0,
           "20 gathers with barriers in between on one comm "
           "(%ld wrong)",
           total);

  /* 7: the application's communicator is not disturbed: its own messages
   * on the same tags still match, and its error handler is unchanged. */
  MPI_Errhandler eh;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &eh);
  int same = eh == MPI_ERRORS_ARE_FATAL;
  MPI_Errhandler_free(&eh);
  int token = wr, from = -1;
  MPI_Sendrecv(&token, 1, MPI_INT, (wr + 1) % wn, 0x0f11, &from, 1, MPI_INT,
               (wr + wn - 1) % wn, 0x0f11, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  bad = !same || from != (wr + wn - 1) % wn;
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0, "the application's communicator keeps its error "
                       "handler and its messages");
#if T_HAVE_NCCL
  /* 7b: the NCCL communicator ofl used still serves the application's own
   * collectives on the same stream: sum, max and min all-reduces and a
   * broadcast, values checked exactly. */
  if (g_mode != COMM_MPI) {
    bad = comm ? nccl_app_check(&main_tc, wr, wn) : 1000;
    total = sum_to_root(bad);
    if (wr == 0)
      tap_ok(total == 0,
             "the application's own NCCL all-reduces and broadcast on the "
             "communicator ofl used are exact (%ld wrong)",
             total);
  }
#endif

  /* 9: the manager's summary gather at the end of warmup, the last rank
   * with offload switched off: it records nothing but joins the gather at
   * its first reset, so no rank waits for it; its row is zeros. */
  bad = comm ? manager_case(comm, wr, wn) : 1000;
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0,
           "manager summary with offload off on the last rank: every reset "
           "succeeds, that rank's row is zeros (%ld wrong)",
           total);

  /* 10: with root_only, rank 0 fails to build the summary (every rank holds
   * "g" = 2^63, so the group total overflows 64 bits, found only after the
   * transfer): every rank reports that failure, not only rank 0. */
  {
    ofl_byte_table_t *t = NULL;
    bad = ofl_byte_table_create(&t) != OFL_SUCCESS ||
          ofl_byte_table_set(t, "g", UINT64_C(1) << 63) != OFL_SUCCESS;
    ofl_summary_t *s = NULL;
    ofl_log_set_level(OFL_LOG_NONE);
    ofl_status_t st =
        comm ? ofl_summary_gather(comm, t, 1, &s) : OFL_ERR_INTERNAL;
    ofl_log_set_level(OFL_LOG_WARN);
    bad += wn == 1 ? st != OFL_SUCCESS : st == OFL_SUCCESS || s != NULL;
    int mine = (int)st, first = 0;
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    bad += mine != first; /* the same status everywhere */
    ofl_summary_destroy(s);
    ofl_byte_table_destroy(t);
    total = sum_to_root(bad);
    if (wr == 0)
      tap_ok(total == 0,
             "root_only: a summary rank 0 cannot build fails on every rank "
             "with the same status (%ld wrong)",
             total);
  }

  /* 8: ranks that disagree on root_only all get OFL_ERR_MISMATCH (with one
   * rank this is simply a successful gather). The NCCL modes use a comm of
   * their own with a short deadline, so that a comm that failed to compare
   * the flag times out here instead of holding the rest of the run. */
  tcomm_t mm_tc, *mt = &main_tc;
  if (g_mode != COMM_MPI) {
    ofl_comm_params_t q = OFL_COMM_PARAMS_INIT;
    q.timeout_ms = 3000;
    mt = &mm_tc;
    if (tcomm_open(MPI_COMM_WORLD, &q, mt) != OFL_SUCCESS)
      mt->comm = NULL;
  }
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_summary_t *s = NULL;
  ofl_status_t st = mt->comm
                        ? ofl_summary_gather(mt->comm, NULL, wr == wn - 1, &s)
                        : OFL_ERR_INTERNAL;
#if T_HAVE_NCCL
  if (g_mode != COMM_MPI && st == OFL_ERR_TIMEOUT)
    mt->nccl_gone = strstr(ofl_last_error(), "was aborted") != NULL;
#endif
  bad = wn == 1 ? st != OFL_SUCCESS : st != OFL_ERR_MISMATCH;
  bad += wn > 1 && !ofl_comm_is_broken(mt->comm);
  ofl_summary_destroy(s);
  total = sum_to_root(bad);
  if (wr == 0)
    tap_ok(total == 0, "ranks disagreeing on root_only: every rank reports "
                       "a mismatch and the comm is marked broken");
  if (mt != &main_tc) {
    MPI_Barrier(MPI_COMM_WORLD); /* every rank done with it */
    tcomm_close(mt);
  }

  tcomm_close(&main_tc);
  if (g_mode != COMM_MPI) {
    /* 11: the stand-in's shared memory objects are gone once every rank
     * joined (nothing to check with the real NCCL). */
    total = 0;
    MPI_Reduce(&g_shm_left, &total, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    if (wr == 0)
      tap_ok(total == 0,
             "no NCCL shared memory object of this job left in /dev/shm "
             "(%ld left)",
             total);
  }
  MPI_Comm_free(&sub);
  int rc = wr == 0 ? tap_done() : 0;
  MPI_Finalize();
  return rc;
}
