/* ofl: the NCCL comm. The gather is two all-gathers on the caller's stream
 * through device buffers: first every rank's size, then every payload padded
 * to the largest. The operation's own event is polled against the deadline
 * (and NCCL's asynchronous error checked) instead of synchronised, so a rank
 * that died or never calls becomes OFL_ERR_TIMEOUT here rather than a hang.
 * NCCL cannot say which rank is missing. After a timeout ofl aborts the
 * communicator (ncclCommAbort, which ends the collective left on the stream)
 * only when it created it or the application asked for it
 * (ofl_comm_params_t.nccl_abort_on_timeout): the communicator is the
 * application's and may be shared, so otherwise the message tells the
 * application to abort it. The buffers of a failed gather are leaked (a
 * kernel may still write them). Buffers and the event are
 * kept between gathers and grow only when a larger table comes: steady state
 * allocates nothing (docs/DESIGN.md section 3.1). */
#include <ofl/version.h>

#if OFL_HAVE_NCCL

#include <stdlib.h>
#include <string.h>

/* cudaX / ncclX calls go through the tables filled by dlopen at the first
 * comm creation: libofl links neither library. */
#include "collectives/comm_internal.h"
#include "runtime/cuda_api.h"
#include "runtime/device_internal.h"

/* Buffers outgrown by a larger table. Freed only at destroy: cudaFree and
 * cudaFreeHost synchronise the device (and, NCCL's issues say, peer GPUs),
 * which between the two all-gathers of a gather could wait for a peer that
 * waits for this rank. */
typedef struct retired {
  void *ptr;
  bool pinned;
  struct retired *next;
} retired_t;

typedef struct nccl_impl {
  ncclComm_t comm; /* owned by the application */
  cudaStream_t stream;
  int device;
  bool nonblocking;
  bool may_abort; /* after a timeout: ofl created comm, or was told to */
  bool aborted;
  cudaEvent_t done;   /* created at the first gather, kept */
  unsigned char *dev; /* device buffer, dev_cap bytes */
  size_t dev_cap;
  unsigned char *host; /* pinned, host_cap bytes: sizes then payloads */
  size_t host_cap;
  retired_t *retired;
} nccl_impl_t;

static bool retire(nccl_impl_t *m, void *ptr, bool pinned) {
  retired_t *r = malloc(sizeof *r);
  if (r == NULL)
    return false;
  *r = (retired_t){ptr, pinned, m->retired};
  m->retired = r;
  return true;
}

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

/* The collective stays on the stream until the communicator is aborted.
 * ofl aborts it only when it may (a communicator it created, or the
 * application asked for it): else the application, which may share it, is
 * told to. */
static ofl_status_t timed_out(ofl_comm_t *c, nccl_impl_t *m,
                              const char *what) {
  const char *fate = "was not aborted, since it is the application's: the "
                     "all-gather may still be pending on the comm's stream; "
                     "abort it (ncclCommAbort) before using that stream or "
                     "the communicator again";
  if (m->may_abort) {
    ncclResult_t ar = ncclCommAbort(m->comm);
    m->aborted = ar == ncclSuccess;
    c->native_aborted = m->aborted;
    fate = m->aborted ? "was aborted (ncclCommAbort), which freed it"
                      : "could not be aborted";
  }
  return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_COLL,
                    "nccl comm: %s did not complete within the gather's %lld "
                    "ms on rank %d of %d (a rank died, never called, or is "
                    "stuck); the NCCL communicator %s; destroy this comm and "
                    "create a new communicator",
                    what, (long long)c->timeout_ms, c->rank, c->size, fate);
}

/* Polls until the work enqueued up to `done` completed or the deadline (of
 * the whole gather: its rounds share one, so that a gather fails within the
 * comm's timeout however its rounds split it) passes. With a nonblocking communicator the collective may still be
 * ncclInProgress (not yet on the stream): the event is recorded only once
 * NCCL reports ncclSuccess, so an idle stream is never taken for a finished
 * collective. Only the operation's own event is waited for, not the rest of
 * the caller's stream (other work may keep it busy). */
static ofl_status_t wait_done(ofl_comm_t *c, nccl_impl_t *m, cudaEvent_t done,
                              uint64_t deadline, const char *what) {
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
      return timed_out(c, m, what);
    ofl__comm_poll_pause(&round);
  }
}

/* Makes the kept buffers at least dev_bytes (device) and host_bytes
 * (pinned); they only grow, so repeated gathers of the same tables allocate
 * nothing. */
static ofl_status_t reserve(nccl_impl_t *m, size_t dev_bytes,
                            size_t host_bytes) {
  cudaError_t e;
  if (m->done == NULL) {
    e = cudaEventCreateWithFlags(&m->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      m->done = NULL;
      return cuda_fail(e, "cudaEventCreateWithFlags");
    }
  }
  if (dev_bytes > m->dev_cap) {
    unsigned char *d = NULL;
    e = cudaMalloc((void **)&d, dev_bytes);
    if (e != cudaSuccess)
      return cuda_fail(e, "cudaMalloc of the gather buffer");
    if (m->dev != NULL && !retire(m, m->dev, false)) {
      cudaFree(d);
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                        "nccl comm: out of host memory");
    }
    m->dev = d;
    m->dev_cap = dev_bytes;
  }
  if (host_bytes > m->host_cap) {
    unsigned char *h = NULL;
    e = cudaMallocHost((void **)&h, host_bytes);
    if (e != cudaSuccess)
      return cuda_fail(e, "cudaMallocHost of the gather buffer");
    if (m->host != NULL && !retire(m, m->host, true)) {
      cudaFreeHost(h);
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                        "nccl comm: out of host memory");
    }
    m->host = h;
    m->host_cap = host_bytes;
  }
  return OFL_SUCCESS;
}

/* One all-gather of count bytes per rank through the kept device buffer;
 * host (pinned, n * count bytes) holds this rank's part at its offset and
 * receives every part. */
static ofl_status_t allgather_bytes(ofl_comm_t *c, nccl_impl_t *m,
                                    unsigned char *host, size_t count,
                                    uint64_t deadline, const char *what) {
  size_t total = count * (size_t)c->size;
  unsigned char *own = m->dev + count * (size_t)c->rank;
  cudaError_t e = cudaMemcpyAsync(own, host + count * (size_t)c->rank, count,
                                  cudaMemcpyHostToDevice, m->stream);
  if (e != cudaSuccess)
    return cuda_fail(e, "copying the table to the device");
  ncclResult_t r =
      ncclAllGather(own, m->dev, count, ncclUint8, m->comm, m->stream);
  /* A nonblocking communicator answers ncclInProgress: the collective is
   * being enqueued; wait_done polls ncclCommGetAsyncError until it is. */
  if (r != ncclSuccess && r != ncclInProgress) {
    c->broken = true;
    return nccl_fail(r, "ncclAllGather");
  }
  ofl_status_t st = wait_done(c, m, m->done, deadline, what);
  if (st != OFL_SUCCESS) {
    c->broken = true;
    return st;
  }
  /* Stream-ordered and polled: cudaMemcpy would run on the legacy default
   * stream and wait, without a deadline, for every blocking stream. */
  e = cudaMemcpyAsync(host, m->dev, total, cudaMemcpyDeviceToHost, m->stream);
  if (e != cudaSuccess) {
    c->broken = true;
    return cuda_fail(e, "copying the gathered tables to the host");
  }
  st = wait_done(c, m, m->done, deadline, what); /* done after the copy */
  if (st != OFL_SUCCESS)
    c->broken = true;
  return st;
}

/* The first round's record per rank: payload bytes, the operation's number
 * on this comm, and whether every rank wants the result; ranks that
 * disagree on the last two all report the mismatch, as over MPI. */
#define HDR_BYTES 16
#define HDR_TO_ALL 1u

static ofl_status_t gather_on_device(ofl_comm_t *c, nccl_impl_t *m,
                                     const void *mine, size_t len, bool to_all,
                                     ofl__blobs_t *out) {
  size_t n = (size_t)c->size;
  /* one deadline for the whole gather (both all-gathers, their copies) */
  uint64_t deadline = ofl__comm_deadline(c->timeout_ms);
  OFL_CHECK(reserve(m, HDR_BYTES * n, HDR_BYTES * n));
  unsigned char *hdr = m->host;
  unsigned char *own = hdr + HDR_BYTES * (size_t)c->rank;
  ofl__put_u64(own, len);
  ofl__put_u32(own + 8, c->seq);
  ofl__put_u32(own + 12, to_all ? HDR_TO_ALL : 0);
  OFL_CHECK(
      allgather_bytes(c, m, hdr, HDR_BYTES, deadline, "the size all-gather"));
  for (size_t r = 0; r < n; r++) {
    const unsigned char *h = hdr + HDR_BYTES * r;
    uint32_t seq = ofl__get_u32(h + 8);
    bool all = (ofl__get_u32(h + 12) & HDR_TO_ALL) != 0;
    if (seq != c->seq) {
      c->broken = true;
      return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_COLL,
                        "nccl comm: rank %zu is at collective operation %u "
                        "and rank %d at %u: the ranks did not make the same "
                        "sequence of calls on this comm",
                        r, seq, c->rank, c->seq);
    }
    if (all != to_all) {
      c->broken = true;
      return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_COLL,
                        "nccl comm: rank %zu asked for the result %s and "
                        "rank %d %s: pass the same root_only on every rank",
                        r, all ? "on all ranks" : "on rank 0", c->rank,
                        to_all ? "on all ranks" : "on rank 0");
    }
  }
  size_t max = 0;
  uint64_t lens[1024];
  uint64_t *lv = n <= 1024 ? lens : malloc(n * sizeof *lv);
  if (lv == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "nccl comm: out of memory for %zu sizes", n);
  ofl_status_t st = OFL_SUCCESS;
  for (size_t r = 0; r < n; r++) {
    lv[r] = ofl__get_u64(hdr + HDR_BYTES * r);
    if (lv[r] > (uint64_t)SIZE_MAX / n) {
      st = ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                      "nccl comm: rank %zu announced %llu bytes", r,
                      (unsigned long long)lv[r]);
      goto done;
    }
    max = (size_t)lv[r] > max ? (size_t)lv[r] : max;
  }
  if (max > 0) {
    OFL_CHECK_GOTO(reserve(m, max * n, max * n), st, done);
    if (len)
      memcpy(m->host + max * (size_t)c->rank, mine, len);
    OFL_CHECK_GOTO(allgather_bytes(c, m, m->host, max, deadline,
                                   "the table all-gather"),
                   st, done);
  }
  if (to_all || c->rank == 0) {
    ofl__blobs_t b;
    OFL_CHECK_GOTO(ofl__blobs_alloc(&b, (int)n), st, done);
    for (size_t r = 0; r < n; r++)
      b.lens[r] = (size_t)lv[r];
    st = ofl__blobs_pack(&b);
    if (st != OFL_SUCCESS) {
      ofl__blobs_free(&b);
      goto done;
    }
    for (size_t r = 0; r < n; r++)
      if (b.lens[r])
        memcpy(b.data + b.offsets[r], m->host + max * r, b.lens[r]);
    *out = b;
  }
done:
  if (lv != lens)
    free(lv);
  return st;
}

static ofl_status_t nccl_gather(ofl_comm_t *c, const void *mine, size_t len,
                                bool to_all, ofl__blobs_t *out) {
  nccl_impl_t *m = c->impl;
  ofl__cuda_guard_t g;
  OFL_CHECK(ofl__cuda_enter(m->device, &g));
  ofl_status_t st = gather_on_device(c, m, mine, len, to_all, out);
  ofl__cuda_leave(&g);
  return st;
}

static ofl_status_t nccl_barrier(ofl_comm_t *c) {
  ofl__blobs_t b = {0};
  ofl_status_t st = nccl_gather(c, NULL, 0, false, &b);
  ofl__blobs_free(&b);
  return st;
}

static void nccl_destroy(ofl_comm_t *c) {
  nccl_impl_t *m = c->impl;
  ofl__cuda_guard_t g;
  bool selected = ofl__cuda_enter(m->device, &g) == OFL_SUCCESS;
  /* An event may be destroyed while work it captured is pending. */
  if (selected && m->done != NULL)
    cudaEventDestroy(m->done);
  if (!c->broken && selected) {
    if (m->dev != NULL)
      cudaFree(m->dev);
    if (m->host != NULL)
      cudaFreeHost(m->host);
    for (retired_t *r = m->retired; r != NULL; r = r->next)
      if (r->pinned)
        cudaFreeHost(r->ptr);
      else
        cudaFree(r->ptr);
  } else if (m->dev != NULL || m->host != NULL) {
    OFL_INFO(OFL_SUBSYS_COLL,
             "nccl comm destroy: gather buffers of a failed operation are "
             "leaked (a collective may have been using them)");
  }
  if (selected) {
    (void)cudaGetLastError();
    ofl__cuda_leave(&g);
  }
  for (retired_t *r = m->retired, *next; r != NULL; r = next) {
    next = r->next;
    free(r);
  }
  free(m);
}

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
  char why[512];
  if (ofl__nccl_load(why, sizeof why) != OFL_SUCCESS)
    return ofl__error(OFL_ERR_NCCL, OFL_SUBSYS_COLL, "ofl_comm_create_nccl: %s",
                      why);
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
  m->nonblocking = params != NULL && params->nccl_nonblocking == 1;
  /* The communicator is the application's: aborted only when it says so. */
  m->may_abort = params != NULL && params->nccl_abort_on_timeout == 1;
  if (!m->nonblocking)
    OFL_INFO(OFL_SUBSYS_COLL,
             "nccl comm rank %d of %d: a blocking communicator (or one not "
             "declared nonblocking in ofl_comm_params_t.nccl_nonblocking): "
             "the gather's deadline holds once NCCL enqueued the collective; "
             "create the communicator with ncclConfig_t blocking = 0 for "
             "bounded waits throughout",
             rank, count);
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
