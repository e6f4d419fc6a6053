/* The NCCL comm on GPUs: one rank per device (up to 4, one thread each),
 * every rank's table gathered through device buffers, every cell compared
 * with the expected value; then the same communicators once more with the
 * summaries on rank 0 only, and a barrier. Then a collective that only one
 * rank calls: it waits on its stream for the others (the stream stays busy,
 * as with NCCL) until ncclCommAbort, which returns at once and ends it.
 * Runs on real GPUs and on the cudasim stand-in (2 devices by default);
 * exits 77 (skip) when no CUDA device can be used. */
#include <nccl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/gpu/gpu_common.h"
#include <ofl/comm.h> /* again, after nccl.h: declares ofl_comm_create_nccl */

#define MAX_DEV 4

typedef struct {
  int rank, n;
  ncclComm_t nccl;
  long wrong;
  int gone; /* ofl aborted the communicator after a timeout (freed it) */
} rank_t;

static uint64_t bytes_of(int rank, int g) {
  return ((uint64_t)(rank + 1) << 20) + (uint64_t)g * 4096u;
}

static long check(const ofl_summary_t *s, int n) {
  long wrong = ofl_summary_nranks(s) != n || (int)ofl_summary_ngroups(s) != n;
  for (int q = 0; q < n && !wrong; q++)
    for (int g = 0; g < n; g++)
      wrong +=
          ofl_summary_bytes(s, q, (size_t)g) != (g <= q ? bytes_of(q, g) : 0);
  return wrong;
}

static void *run_rank(void *arg) {
  rank_t *r = arg;
  r->wrong = 1000;
  if (cudaSetDevice(r->rank) != cudaSuccess)
    return NULL;
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    return NULL;
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = 10000;
  ofl_comm_t *comm = NULL;
  ofl_byte_table_t *t = NULL;
  ofl_summary_t *s = NULL, *s2 = NULL;
  char name[32];
  if (ofl_comm_create_nccl(r->nccl, stream, &p, &comm) != OFL_SUCCESS ||
      ofl_byte_table_create(&t) != OFL_SUCCESS)
    goto done;
  /* rank k has groups g0..gk: overlapping names, different counts */
  for (int g = 0; g <= r->rank; g++) {
    snprintf(name, sizeof(name), "g%d", g);
    ofl_byte_table_add(t, name, bytes_of(r->rank, g));
  }
  if (ofl_summary_gather(comm, t, 0, &s) != OFL_SUCCESS ||
      ofl_summary_gather(comm, t, 1, &s2) != OFL_SUCCESS ||
      ofl_comm_barrier(comm) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: %s\n", r->rank, ofl_last_error());
    r->gone = strstr(ofl_last_error(), "was aborted") != NULL;
    goto done;
  }
  long wrong = ofl_comm_kind(comm) != OFL_COMM_NCCL ||
               ofl_comm_rank(comm) != r->rank || ofl_comm_size(comm) != r->n;
  wrong += check(s, r->n);
  if (r->rank == 0)
    wrong += s2 == NULL ? 1 : check(s2, r->n);
  else
    wrong += s2 != NULL;
  r->wrong = wrong;
done:
  ofl_summary_destroy(s);
  ofl_summary_destroy(s2);
  ofl_byte_table_destroy(t);
  ofl_comm_destroy(comm);
  cudaStreamDestroy(stream);
  return NULL;
}

int main(void) {
  int ndev = gpu_require_device();
  int n = ndev < MAX_DEV ? ndev : MAX_DEV;
  tap_plan(n > 1 ? 3 : 2);
  ncclComm_t comms[MAX_DEV];
  int devs[MAX_DEV];
  for (int i = 0; i < n; i++)
    devs[i] = i;
  ncclResult_t nr = ncclCommInitAll(comms, n, devs);
  if (nr != ncclSuccess) {
    printf("Bail out! ncclCommInitAll: %s\n", ncclGetErrorString(nr));
    return 1;
  }
  rank_t ranks[MAX_DEV];
  pthread_t th[MAX_DEV];
  for (int i = 0; i < n; i++) {
    ranks[i] = (rank_t){i, n, comms[i], 0, 0};
    pthread_create(&th[i], NULL, run_rank, &ranks[i]);
  }
  long wrong = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    wrong += ranks[i].wrong;
  }
  tap_ok(wrong == 0,
         "nccl summary over %d devices (one thread each), on every rank and "
         "on rank 0 only, then a barrier: %ld wrong values",
         n, wrong);
  long bad = 0;
  for (int i = 0; i < n; i++) /* an aborted one is freed already */
    if (!ranks[i].gone)
      bad += ncclCommDestroy(comms[i]) != ncclSuccess;
  tap_ok(bad == 0, "every communicator destroyed (%ld failed)", bad);
  if (n > 1) {
    /* rank 0 alone calls an all-gather */
    long lone = 0;
    ncclComm_t c2[MAX_DEV];
    nr = ncclCommInitAll(c2, n, devs);
    void *buf = NULL;
    cudaStream_t st = NULL;
    lone += nr != ncclSuccess;
    lone += cudaSetDevice(0) != cudaSuccess;
    lone += cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess;
    lone += cudaMalloc(&buf, 4096 * (size_t)n) != cudaSuccess;
    if (lone == 0) {
      lone += ncclAllGather(buf, buf, 4096, ncclUint8, c2[0], st) != ncclSuccess;
      struct timespec ts = {0, 300 * 1000 * 1000};
      nanosleep(&ts, NULL);
      lone += cudaStreamQuery(st) != cudaErrorNotReady; /* still waiting */
      (void)cudaGetLastError();
      double t0 = gpu_now_s();
      for (int i = 0; i < n; i++)
        lone += ncclCommAbort(c2[i]) != ncclSuccess;
      double abort_s = gpu_now_s() - t0;
      lone += abort_s > 5.0;
      lone += cudaStreamSynchronize(st) != cudaSuccess; /* ended */
      tap_diag("ncclCommAbort of %d communicators took %.3f s", n, abort_s);
    }
    cudaFree(buf);
    if (st)
      cudaStreamDestroy(st);
    (void)cudaGetLastError();
    tap_ok(lone == 0,
           "a collective only rank 0 calls keeps its stream busy until "
           "ncclCommAbort, which returns at once and ends it (%ld wrong)",
           lone);
  }
  return tap_done();
}
