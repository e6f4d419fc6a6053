/* ofl: the NCCL comm. The gather is two all-gathers on the caller's stream
 * through device buffers: first every rank's size, then every payload padded
 * to the largest. The stream is polled against the deadline (and NCCL's
 * asynchronous error checked) instead of synchronised, so a rank that died or
 * never calls becomes OFL_ERR_TIMEOUT here rather than a hang. NCCL cannot
 * say which rank is missing; after a timeout the application should abort the
 * NCCL communicator (ncclCommAbort). Device buffers of an operation that
 * timed out are left allocated: freeing them would wait for the stuck
 * kernel. */
#include <ofl/version.h>

#if OFL_HAVE_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/comm_internal.h"

typedef struct nccl_impl {
  ncclComm_t comm; /* owned by the application */
  cudaStream_t stream;
  int device;
} nccl_impl_t;

static ofl_status_t cuda_fail(cudaError_t e, const char *what) {
  (void)cudaGetLastError(); /* ofl reports it; not the application's */
  return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_COLL, "nccl comm: %s: %s", what,
                    cudaGetErrorString(e));
}

static ofl_status_t nccl_fail(ncclResult_t r, const char *what) {
  return ofl__error(OFL_ERR_NCCL, OFL_SUBSYS_COLL,
                    "nccl comm: %s: %s; the NCCL communicator may be "
                    "unusable (ncclCommAbort it)",
                    what, ncclGetErrorString(r));
}

/* Polls until the work enqueued up to `done` completed or the deadline
 * passes. With a nonblocking communicator the collective may still be
 * ncclInProgress (not yet on the stream): the event is recorded only once
 * NCCL reports ncclSuccess, so an idle stream is never taken for a finished
 * collective. Only the operation's own event is waited for, not the rest of
 * the caller's stream (other work may keep it busy). */
static ofl_status_t wait_done(ofl_comm_t *c, nccl_impl_t *m, cudaEvent_t done,
                              const char *what) {
  uint64_t deadline = ofl__now_ns() + (uint64_t)c->timeout_ms * 1000000ull;
  unsigned round = 0;
  bool recorded = false;
  for (;;) {
    if (recorded) {
      cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess)
        return OFL_SUCCESS;
      if (e != cudaErrorNotReady)
        return cuda_fail(e, what);
      if (cudaPeekAtLastError() == cudaErrorNotReady)
        (void)cudaGetLastError();
    }
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(m->comm, &async);
    if (r != ncclSuccess)
      return nccl_fail(r, "ncclCommGetAsyncError");
    if (async != ncclSuccess && async != ncclInProgress)
      return nccl_fail(async, what);
    if (!recorded && async == ncclSuccess) {
      cudaError_t e = cudaEventRecord(done, m->stream);
      if (e != cudaSuccess)
        return cuda_fail(e, "recording the completion event");
      recorded = true;
      continue;
    }
    if (ofl__now_ns() >= deadline)
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_COLL,
                        "nccl comm: %s did not complete within %lld ms on "
                        "rank %d of %d (a rank died, never called, or is "
                        "stuck); abort the NCCL communicator",
                        what, (long long)c->timeout_ms, c->rank, c->size);
    ofl__comm_poll_pause(&round);
  }
}

/* One all-gather of count bytes per rank, in place in dev (n * count bytes),
 * own part taken from host (pinned, n * count bytes, result written back). */
static ofl_status_t allgather_bytes(ofl_comm_t *c, nccl_impl_t *m,
                                    unsigned char *host, size_t count,
                                    const char *what) {
  unsigned char *dev = NULL;
  size_t total = count * (size_t)c->size;
  cudaError_t e = cudaMalloc((void **)&dev, total);
  if (e != cudaSuccess)
    return cuda_fail(e, "cudaMalloc of the gather buffer");
  cudaEvent_t done = NULL;
  e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    cudaFree(dev);
    return cuda_fail(e, "cudaEventCreateWithFlags");
  }
  unsigned char *own = dev + count * (size_t)c->rank;
  e = cudaMemcpyAsync(own, host + count * (size_t)c->rank, count,
                      cudaMemcpyHostToDevice, m->stream);
  if (e != cudaSuccess) {
    cudaEventDestroy(done);
    cudaFree(dev);
    return cuda_fail(e, "copying the table to the device");
  }
  ncclResult_t r =
      ncclAllGather(own, dev, count, ncclUint8, m->comm, m->stream);
  /* A nonblocking communicator answers ncclInProgress: the collective is
   * being enqueued; wait_done polls ncclCommGetAsyncError until it is. */
  if (r != ncclSuccess && r != ncclInProgress) {
    c->broken = true;
    cudaEventDestroy(done);
    return nccl_fail(r, "ncclAllGather"); /* dev: the H2D copy may be queued */
  }
  ofl_status_t st = wait_done(c, m, done, what);
  if (st != OFL_SUCCESS) {
    c->broken = true;
    cudaEventDestroy(done);
    return st; /* dev stays allocated: see the top of the file */
  }
  /* Stream-ordered and polled: cudaMemcpy would run on the legacy default
   * stream and wait, without a deadline, for every blocking stream. */
  e = cudaMemcpyAsync(host, dev, total, cudaMemcpyDeviceToHost, m->stream);
  if (e != cudaSuccess) {
    cudaEventDestroy(done);
    c->broken = true;
    return cuda_fail(e, "copying the gathered tables to the host");
  }
  st = wait_done(c, m, done, what); /* records done after the copy */
  cudaEventDestroy(done);
  if (st != OFL_SUCCESS) {
    c->broken = true;
    return st;
  }
  cudaFree(dev);
  return OFL_SUCCESS;
}

static ofl_status_t nccl_gather(ofl_comm_t *c, const void *mine, size_t len,
                                bool to_all, ofl__blobs_t *out) {
  nccl_impl_t *m = c->impl;
  int n = c->size;
  int prev = -1;
  cudaGetDevice(&prev);
  cudaError_t e = cudaSetDevice(m->device);
  if (e != cudaSuccess)
    return cuda_fail(e, "cudaSetDevice");
  unsigned char *sizes = NULL, *data = NULL;
  ofl_status_t st = OFL_SUCCESS;
  e = cudaMallocHost((void **)&sizes, 8 * (size_t)n);
  if (e != cudaSuccess) {
    st = cuda_fail(e, "cudaMallocHost");
    goto done;
  }
  ofl__put_u64(sizes + 8 * (size_t)c->rank, len);
  OFL_CHECK_GOTO(allgather_bytes(c, m, sizes, 8, "the size all-gather"), st,
                 done);
  size_t max = 0;
  for (int r = 0; r < n; r++) {
    uint64_t l = ofl__get_u64(sizes + 8 * (size_t)r);
    if (l > (uint64_t)SIZE_MAX / (size_t)n) {
      st = ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                      "nccl comm: rank %d announced %llu bytes", r,
                      (unsigned long long)l);
      goto done;
    }
    max = (size_t)l > max ? (size_t)l : max;
  }
  if (max > 0) {
    e = cudaMallocHost((void **)&data, max * (size_t)n);
    if (e != cudaSuccess) {
      st = cuda_fail(e, "cudaMallocHost");
      goto done;
    }
    if (len)
      memcpy(data + max * (size_t)c->rank, mine, len);
    OFL_CHECK_GOTO(allgather_bytes(c, m, data, max, "the table all-gather"), st,
                   done);
  }
  if (to_all || c->rank == 0) {
    ofl__blobs_t b;
    OFL_CHECK_GOTO(ofl__blobs_alloc(&b, n), st, done);
    for (int r = 0; r < n; r++)
      b.lens[r] = (size_t)ofl__get_u64(sizes + 8 * (size_t)r);
    st = ofl__blobs_pack(&b);
    if (st != OFL_SUCCESS) {
      ofl__blobs_free(&b);
      goto done;
    }
    for (int r = 0; r < n; r++)
      if (b.lens[r])
        memcpy(b.data + b.offsets[r], data + max * (size_t)r, b.lens[r]);
    *out = b;
  }
done:
  if (!c->broken) {
    cudaFreeHost(data);
    cudaFreeHost(sizes);
  }
  if (prev >= 0)
    cudaSetDevice(prev);
  return st;
}

static ofl_status_t nccl_barrier(ofl_comm_t *c) {
  ofl__blobs_t b = {0};
  ofl_status_t st = nccl_gather(c, NULL, 0, false, &b);
  ofl__blobs_free(&b);
  return st;
}

static void nccl_destroy(ofl_comm_t *c) { free(c->impl); }

static const ofl__comm_ops_t nccl_ops = {nccl_gather, nccl_barrier,
                                         nccl_destroy};

ofl_status_t ofl_comm_create_nccl_handle(const void *nccl_comm,
                                         void *cuda_stream,
                                         const ofl_comm_params_t *params,
                                         ofl_comm_t **out) {
  if (!nccl_comm || !out || !*(const ncclComm_t *)nccl_comm)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_comm_create_nccl: %s is NULL",
                      !out ? "out" : "the ncclComm_t");
  ncclComm_t nc = *(const ncclComm_t *)nccl_comm;
  int count = 0, rank = 0, device = 0;
  ncclResult_t r = ncclCommCount(nc, &count);
  if (r == ncclSuccess)
    r = ncclCommUserRank(nc, &rank);
  if (r == ncclSuccess)
    r = ncclCommCuDevice(nc, &device);
  if (r != ncclSuccess)
    return nccl_fail(r, "reading the communicator's rank and size");
  ofl_comm_t *c;
  OFL_CHECK(ofl__comm_alloc(OFL_COMM_NCCL, params, &c));
  nccl_impl_t *m = calloc(1, sizeof(*m));
  if (!m) {
    free(c);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "ofl_comm_create_nccl: out of memory");
  }
  m->comm = nc;
  m->stream = (cudaStream_t)cuda_stream;
  m->device = device;
  c->rank = rank;
  c->size = count;
  c->impl = m;
  c->ops = &nccl_ops;
  *out = c;
  return OFL_SUCCESS;
}

#else
typedef int ofl__comm_nccl_not_built; /* ISO C wants a non-empty unit */
#endif /* OFL_HAVE_NCCL */
