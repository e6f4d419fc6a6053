/* The NCCL comm on GPUs: one rank per device (up to 4, one thread each),
 * every rank's table gathered through device buffers, every cell compared
 * with the expected value; then the same communicators once more with the
 * summaries on rank 0 only, and a barrier. Then a collective that only one
 * rank calls: it waits on its stream for the others (the stream stays busy,
 * as with NCCL) until ncclCommAbort, which returns at once and ends it. The
 * fresh communicators of that check first make one all-gather on every rank,
 * each rank from its own thread: NCCL 2.22+ connects lazily, at a
 * communicator's first collective, and a blocking communicator's first call
 * waits there for its peers, so a first collective that one rank called
 * alone (from the thread that must then abort) would never return.
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

/* ---- the lone collective ------------------------------------------------- */

#define LONE_BYTES 4096

typedef struct {
  int rank, n;
  ncclComm_t nccl;
  cudaStream_t stream;
  unsigned char *buf; /* n * LONE_BYTES on the rank's device */
  long wrong;
} lone_rank_t;

static unsigned char lone_byte(int rank, size_t i) {
  return (unsigned char)(rank * 31 + (int)(i % 251) + 1);
}

/* Bounded wait for a stream (30 s): 0 when it drained without error. */
static int stream_done(cudaStream_t st) {
  double until = gpu_now_s() + 30.0;
  cudaError_t e;
  while ((e = cudaStreamQuery(st)) == cudaErrorNotReady &&
         gpu_now_s() < until) {
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  (void)cudaGetLastError();
  return e == cudaSuccess ? 0 : 1;
}

/* On the rank's own thread: its device, stream and buffer, then its first
 * all-gather on the fresh communicator (connections are made here, with
 * every rank in the call), checked byte by byte. */
static void *lone_first_collective(void *arg) {
  lone_rank_t *r = arg;
  size_t total = LONE_BYTES * (size_t)r->n;
  unsigned char *host = malloc(total);
  r->wrong = 1;
  if (host == NULL || cudaSetDevice(r->rank) != cudaSuccess ||
      cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking) !=
          cudaSuccess ||
      cudaMalloc((void **)&r->buf, total) != cudaSuccess) {
    free(host);
    return NULL;
  }
  unsigned char *own = r->buf + LONE_BYTES * (size_t)r->rank;
  for (size_t i = 0; i < LONE_BYTES; i++)
    host[i] = lone_byte(r->rank, i);
  long wrong = cudaMemcpyAsync(own, host, LONE_BYTES, cudaMemcpyHostToDevice,
                               r->stream) != cudaSuccess;
  wrong += ncclAllGather(own, r->buf, LONE_BYTES, ncclUint8, r->nccl,
                         r->stream) != ncclSuccess;
  wrong += cudaMemcpyAsync(host, r->buf, total, cudaMemcpyDeviceToHost,
                           r->stream) != cudaSuccess;
  wrong += stream_done(r->stream);
  for (int q = 0; q < r->n && wrong == 0; q++)
    for (size_t i = 0; i < LONE_BYTES; i++)
      wrong += host[LONE_BYTES * (size_t)q + i] != lone_byte(q, i);
  r->wrong = wrong;
  free(host);
  return NULL;
}

/* Fresh communicators, a first all-gather on every rank (own threads), then
 * one that rank 0 alone calls: it keeps rank 0's stream busy until
 * ncclCommAbort, which returns at once and ends it. Wrong answers. */
static long lone_collective(int n, const int *devs) {
  ncclComm_t c[MAX_DEV];
  if (ncclCommInitAll(c, n, devs) != ncclSuccess)
    return 1;
  lone_rank_t r[MAX_DEV];
  pthread_t th[MAX_DEV];
  long wrong = 0;
  for (int i = 0; i < n; i++) {
    r[i] = (lone_rank_t){i, n, c[i], NULL, NULL, 0};
    pthread_create(&th[i], NULL, lone_first_collective, &r[i]);
  }
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    wrong += r[i].wrong;
  }
  tap_diag("first all-gather on every rank of the fresh communicators: %ld "
           "wrong",
           wrong);
  if (wrong == 0) {
    cudaSetDevice(0);
    /* connected now: the lone call only enqueues */
    wrong += ncclAllGather(r[0].buf, r[0].buf, LONE_BYTES, ncclUint8, c[0],
                           r[0].stream) != ncclSuccess;
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL);
    wrong += cudaStreamQuery(r[0].stream) != cudaErrorNotReady; /* waiting */
    (void)cudaGetLastError();
  }
  double t0 = gpu_now_s();
  for (int i = 0; i < n; i++)
    wrong += ncclCommAbort(c[i]) != ncclSuccess;
  double abort_s = gpu_now_s() - t0;
  wrong += abort_s > 5.0;
  tap_diag("ncclCommAbort of %d communicators took %.3f s", n, abort_s);
  for (int i = 0; i < n; i++) {
    cudaSetDevice(i);
    if (r[i].stream != NULL)
      wrong += stream_done(r[i].stream); /* the lone all-gather ended */
    cudaFree(r[i].buf);
    if (r[i].stream != NULL)
      cudaStreamDestroy(r[i].stream);
  }
  (void)cudaGetLastError();
  return wrong;
}

/* ---- the summary over every rank ----------------------------------------- */

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
    long lone = lone_collective(n, devs);
    tap_ok(lone == 0,
           "a collective only rank 0 calls (after every rank's first one) "
           "keeps its stream busy until ncclCommAbort, which returns at once "
           "and ends it (%ld wrong)",
           lone);
  }
  return tap_done();
}
