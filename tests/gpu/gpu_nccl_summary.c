/* The NCCL comm on real GPUs: one rank per device (up to 4, one thread
 * each), every rank's table gathered through device buffers, every cell
 * compared with the expected value. Exits 77 (skip) when no CUDA device can
 * be used, which is the case on the project's build machines. */
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include <ofl/comm.h> /* again, after nccl.h: declares ofl_comm_create_nccl */

#define MAX_DEV 4

typedef struct {
  int rank, n;
  ncclComm_t nccl;
  long wrong;
} rank_t;

static uint64_t bytes_of(int rank, int g) {
  return ((uint64_t)(rank + 1) << 20) + (uint64_t)g * 4096u;
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
  p.timeout_ms = 30000;
  ofl_comm_t *comm = NULL;
  ofl_byte_table_t *t = NULL;
  ofl_summary_t *s = NULL;
  char name[32];
  if (ofl_comm_create_nccl(r->nccl, stream, &p, &comm) != OFL_SUCCESS ||
      ofl_byte_table_create(&t) != OFL_SUCCESS)
    goto done;
  /* rank k has groups g0..gk: overlapping names, different counts */
  for (int g = 0; g <= r->rank; g++) {
    snprintf(name, sizeof(name), "g%d", g);
    ofl_byte_table_add(t, name, bytes_of(r->rank, g));
  }
  if (ofl_summary_gather(comm, t, 0, &s) != OFL_SUCCESS) {
    fprintf(stderr, "rank %d: %s\n", r->rank, ofl_last_error());
    goto done;
  }
  long wrong = ofl_comm_kind(comm) != OFL_COMM_NCCL ||
               ofl_summary_nranks(s) != r->n ||
               (int)ofl_summary_ngroups(s) != r->n;
  for (int q = 0; q < r->n && !wrong; q++)
    for (int g = 0; g < r->n; g++)
      wrong +=
          ofl_summary_bytes(s, q, (size_t)g) != (g <= q ? bytes_of(q, g) : 0);
  r->wrong = wrong;
done:
  ofl_summary_destroy(s);
  ofl_byte_table_destroy(t);
  ofl_comm_destroy(comm);
  cudaStreamDestroy(stream);
  return NULL;
}

int main(void) {
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev < 1) {
    printf("skip: no usable CUDA device (%s)\n",
           e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  int n = ndev < MAX_DEV ? ndev : MAX_DEV;
  ncclComm_t comms[MAX_DEV];
  int devs[MAX_DEV];
  for (int i = 0; i < n; i++)
    devs[i] = i;
  ncclResult_t nr = ncclCommInitAll(comms, n, devs);
  if (nr != ncclSuccess) {
    printf("FAIL ncclCommInitAll: %s\n", ncclGetErrorString(nr));
    return 1;
  }
  rank_t ranks[MAX_DEV];
  pthread_t th[MAX_DEV];
  for (int i = 0; i < n; i++) {
    ranks[i] = (rank_t){i, n, comms[i], 0};
    pthread_create(&th[i], NULL, run_rank, &ranks[i]);
  }
  long wrong = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    wrong += ranks[i].wrong;
  }
  for (int i = 0; i < n; i++)
    ncclCommDestroy(comms[i]);
  printf("%s: nccl summary over %d devices, %ld wrong values\n",
         wrong ? "FAIL" : "ok", n, wrong);
  return wrong ? 1 : 0;
}
