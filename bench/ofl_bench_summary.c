/* Summary gather and rendering.
 *
 * Under mpirun (or, when started alone, re-run by itself under
 * `mpiexec -n 4 --oversubscribe`; --ranks N changes the count, --ranks 1
 * stays in this process) it times, on rank 0, the median of many
 * iterations of:
 *   - ofl_summary_gather to rank 0 and to every rank (MPI comm), against the
 *     limit: blocking MPI_Gather of the sizes + MPI_Gatherv of the same
 *     encoded tables (MPI_Allgather + MPI_Allgatherv for every rank);
 *   - rendering the gathered summary as text, JSON and CSV.
 * Without MPI it times the self comm and rendering only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "collectives/summary_internal.h"
#include "runtime/internal.h"

#if OFL_HAVE_MPI
#include <mpi.h>
#include <ofl/comm.h>
#endif

#define ITERS 300

static const char *const groups[] = {"attn_norm", "qkv_linear", "core_attn",
                                     "attn_proj", "mlp_norm",   "expert_fc1",
                                     "moe_act"};

static ofl_byte_table_t *table_of(int rank) {
  ofl_byte_table_t *t = NULL;
  ofl_byte_table_create(&t);
  for (int g = 0; g < 7; g++)
    ofl_byte_table_add(t, groups[g],
                       ((uint64_t)(rank + 1) << 24) + (uint64_t)g);
  return t;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static double median_us(uint64_t *ns, int n) {
  qsort(ns, (size_t)n, sizeof(*ns), cmp_u64);
  return ns[n / 2] / 1e3;
}

static void render_rows(const ofl_summary_t *s) {
  static const char *const fmt_name[] = {"text", "json", "csv"};
  uint64_t ns[ITERS];
  for (int f = 0; f < 3; f++) {
    size_t len = 0;
    for (int i = 0; i < ITERS; i++) {
      char *out = NULL;
      uint64_t t0 = ofl__now_ns();
      ofl_summary_render(s, (ofl_summary_format_t)f, &out, &len);
      ns[i] = ofl__now_ns() - t0;
      free(out);
    }
    printf("%-34s %10.2f %10s %8s  %zu bytes\n", fmt_name[f],
           median_us(ns, ITERS), "-", "-", len);
  }
}

#if OFL_HAVE_MPI
/* Re-runs this program under mpiexec when it was started alone. */
static void maybe_respawn(int argc, char **argv) {
  int ranks = 4;
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--ranks") == 0)
      ranks = atoi(argv[i + 1]);
  if (ranks <= 1 || getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_RANK") ||
      getenv("OFL_BENCH_SPAWNED"))
    return;
  char n[16];
  snprintf(n, sizeof(n), "%d", ranks);
  setenv("OFL_BENCH_SPAWNED", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  char *args[] = {"mpiexec", "-n", n, "--oversubscribe", argv[0], NULL};
  execvp("mpiexec", args);
  fprintf(stderr, "mpiexec not found: measuring 1 rank\n");
}

typedef enum { OFL_ROOT, OFL_ALL, MPI_ROOT_LIMIT, MPI_ALL_LIMIT } kind_t;

static double time_kind(kind_t k, ofl_comm_t *comm, const ofl_byte_table_t *t,
                        const unsigned char *enc, int len, int rank, int n) {
  static uint64_t ns[ITERS];
  int *lens = malloc(sizeof(int) * (size_t)n);
  int *displs = malloc(sizeof(int) * (size_t)n);
  unsigned char *all = malloc((size_t)len * (size_t)n * 2 + 1);
  for (int i = 0; i < ITERS; i++) {
    MPI_Barrier(MPI_COMM_WORLD);
    uint64_t t0 = ofl__now_ns();
    if (k == OFL_ROOT || k == OFL_ALL) {
      ofl_summary_t *s = NULL;
      if (ofl_summary_gather(comm, t, k == OFL_ROOT, &s) != OFL_SUCCESS) {
        fprintf(stderr, "gather failed: %s\n", ofl_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      ofl_summary_destroy(s);
    } else {
      /* sizes first, then payloads, as the library does */
      if (k == MPI_ROOT_LIMIT)
        MPI_Gather(&len, 1, MPI_INT, lens, 1, MPI_INT, 0, MPI_COMM_WORLD);
      else
        MPI_Allgather(&len, 1, MPI_INT, lens, 1, MPI_INT, MPI_COMM_WORLD);
      int off = 0;
      for (int r = 0; r < n; r++) {
        displs[r] = off;
        off += (k == MPI_ROOT_LIMIT && rank != 0) ? 0 : lens[r];
      }
      if (k == MPI_ROOT_LIMIT)
        MPI_Gatherv(enc, len, MPI_BYTE, all, lens, displs, MPI_BYTE, 0,
                    MPI_COMM_WORLD);
      else
        MPI_Allgatherv(enc, len, MPI_BYTE, all, lens, displs, MPI_BYTE,
                       MPI_COMM_WORLD);
    }
    ns[i] = ofl__now_ns() - t0;
  }
  free(lens);
  free(displs);
  free(all);
  return median_us(ns, ITERS);
}

int main(int argc, char **argv) {
  maybe_respawn(argc, argv);
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = 30000;
  ofl_comm_t *comm = NULL;
  if (ofl_comm_create_mpi(MPI_COMM_WORLD, &p, &comm) != OFL_SUCCESS) {
    fprintf(stderr, "%s\n", ofl_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  ofl_byte_table_t *t = table_of(rank);
  unsigned char *enc = NULL;
  size_t len = 0;
  ofl__byte_table_encode(t, &enc, &len);

  double ofl_root = time_kind(OFL_ROOT, comm, t, enc, (int)len, rank, n);
  double lim_root = time_kind(MPI_ROOT_LIMIT, comm, t, enc, (int)len, rank, n);
  double ofl_all = time_kind(OFL_ALL, comm, t, enc, (int)len, rank, n);
  double lim_all = time_kind(MPI_ALL_LIMIT, comm, t, enc, (int)len, rank, n);
  ofl_summary_t *s = NULL;
  ofl_summary_gather(comm, t, 1, &s);
  if (rank == 0) {
    printf("summary gather over MPI: %d ranks, 7 groups, %zu bytes per "
           "rank, median of %d\n",
           n, len, ITERS);
    printf("%-34s %10s %10s %8s\n", "operation", "us", "limit_us", "ratio");
    printf("%-34s %10.2f %10.2f %8.2f\n", "gather to rank 0", ofl_root,
           lim_root, ofl_root / lim_root);
    printf("%-34s %10.2f %10.2f %8.2f\n", "gather to every rank", ofl_all,
           lim_all, ofl_all / lim_all);
    printf("render (%d ranks x 7 groups)\n", n);
    render_rows(s);
  }
  ofl_summary_destroy(s);
  free(enc);
  ofl_byte_table_destroy(t);
  ofl_comm_destroy(comm);
  MPI_Finalize();
  return 0;
}

#else

int main(void) {
  ofl_byte_table_t *t = table_of(0);
  uint64_t ns[ITERS];
  ofl_comm_t *comm = NULL;
  ofl_comm_create_self(NULL, &comm);
  for (int i = 0; i < ITERS; i++) {
    ofl_summary_t *s = NULL;
    uint64_t t0 = ofl__now_ns();
    ofl_summary_gather(comm, t, 0, &s);
    ns[i] = ofl__now_ns() - t0;
    ofl_summary_destroy(s);
  }
  printf("summary over a self comm (this build has no MPI), median of %d\n",
         ITERS);
  printf("%-34s %10s %10s %8s\n", "operation", "us", "limit_us", "ratio");
  printf("%-34s %10.2f %10s %8s\n", "gather (self)", median_us(ns, ITERS), "-",
         "-");
  ofl_summary_t *s = NULL;
  ofl_summary_gather(comm, t, 0, &s);
  render_rows(s);
  ofl_summary_destroy(s);
  ofl_comm_destroy(comm);
  ofl_byte_table_destroy(t);
  return 0;
}

#endif
