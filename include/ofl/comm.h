/* ofl: communicators for what ranks tell each other (the offload summary).
 * Three kinds, each a build feature: self (one rank, always there), MPI (any
 * MPI_Comm, e.g. the data-parallel group of one pipeline stage) and NCCL (a
 * ncclComm_t plus a CUDA stream; payloads go through device buffers).
 *
 * This header needs neither mpi.h nor nccl.h. The typed constructors
 * ofl_comm_create_mpi() and ofl_comm_create_nccl() are declared when mpi.h /
 * nccl.h were included before this header (or when it is included again
 * after them); the
 * handle forms taking pointers are always declared and return
 * OFL_ERR_NOT_SUPPORTED in builds without the feature.
 *
 * Every operation on a multi-rank comm is collective over that comm and has a
 * deadline: a rank that died or never calls shows up as OFL_ERR_TIMEOUT (or
 * OFL_ERR_MPI / OFL_ERR_NCCL) on the others, with a message naming the ranks
 * that did not answer, never as a hang. After such a failure the comm refuses
 * further operations; destroy it and create a new one. A timeout can leave
 * the application's NCCL communicator with a collective pending on its
 * stream: see nccl_abort_on_timeout for what the application must do. */
#ifndef OFL_COMM_H
#define OFL_COMM_H

#include <stdint.h>

#include <ofl/export.h>
#include <ofl/status.h>

OFL_EXTERN_C_BEGIN

typedef struct ofl_comm ofl_comm_t;

typedef enum ofl_comm_kind {
  OFL_COMM_SELF = 0,
  OFL_COMM_MPI = 1,
  OFL_COMM_NCCL = 2
} ofl_comm_kind_t;

typedef struct ofl_comm_params {
  /* Deadline of each collective operation (and of the creation of an MPI
   * comm), in ms; < 0: OFL_WAIT_TIMEOUT_MS. Ranks other than rank 0 wait up to
   * twice this long for rank 0's answer, so that rank 0 can tell them which
   * rank was missing. Any value up to INT64_MAX (no practical limit) is
   * taken as is: deadlines saturate, they never wrap. */
  int64_t timeout_ms;
  /* NCCL comms: 1 when the communicator was created nonblocking
   * (ncclConfig_t.blocking = 0), 0 when blocking, -1 unknown (taken as
   * blocking; NCCL has no call that tells). With a nonblocking communicator
   * a gather (all its rounds together) is bounded by timeout_ms; with a blocking one the
   * NCCL call itself may block before ofl's deadline can act (while it
   * connects to its peers), so create it with blocking = 0 for bounded
   * waits. */
  int nccl_nonblocking;
  /* NCCL comms: what happens to the application's communicator when an
   * operation times out. ofl aborts only communicators it created (none
   * today: it wraps the application's) or, with 1 here, the application's
   * (ncclCommAbort, which frees it: the application must not destroy or use
   * it again; ofl_comm_nccl_aborted says it happened). Otherwise (0, or -1:
   * the default) ofl leaves it alone, since the application may share it:
   * the timed-out all-gather may still be pending on the comm's stream, so
   * the communicator and that stream may be unusable. The application then
   * aborts the communicator itself (ncclCommAbort, on every rank that
   * timed out) before it uses the stream or the communicator again, or
   * waits for the missing ranks. Either way it destroys this ofl comm and,
   * to go on, creates a new communicator. Appended after the others: it lies in
   * what was the struct's tail padding (its size is unchanged on LP64), and
   * only the value 1 turns it on. */
  int nccl_abort_on_timeout;
} ofl_comm_params_t;

#define OFL_COMM_PARAMS_INIT                                                   \
  { -1, -1, -1 }

/* A one-rank comm (rank 0 of 1). params may be NULL. */
OFL_API ofl_status_t ofl_comm_create_self(const ofl_comm_params_t *params,
                                          ofl_comm_t **out);

/* An MPI comm over a duplicate of *mpi_comm (an MPI_Comm *), so that its
 * messages never mix with the application's; errors on the duplicate return
 * codes instead of aborting. Collective over mpi_comm: every rank calls it.
 * MPI must be initialised. OFL_ERR_NOT_SUPPORTED in builds without MPI. */
OFL_API ofl_status_t ofl_comm_create_mpi_handle(const void *mpi_comm,
                                                const ofl_comm_params_t *params,
                                                ofl_comm_t **out);

/* A NCCL comm over *nccl_comm (a ncclComm_t *, not duplicated, still owned by
 * the caller) with operations enqueued on cuda_stream (a cudaStream_t; NULL is
 * the legacy default stream). Device buffers are allocated on the device that
 * is current at creation. OFL_ERR_NOT_SUPPORTED in builds without NCCL. */
OFL_API ofl_status_t
ofl_comm_create_nccl_handle(const void *nccl_comm, void *cuda_stream,
                            const ofl_comm_params_t *params, ofl_comm_t **out);

/* Frees the comm (and the MPI duplicate). NULL is ignored. */
OFL_API void ofl_comm_destroy(ofl_comm_t *comm);

OFL_API int ofl_comm_rank(const ofl_comm_t *comm); /* -1 for NULL */
OFL_API int ofl_comm_size(const ofl_comm_t *comm); /* 0 for NULL */
OFL_API ofl_comm_kind_t ofl_comm_kind(const ofl_comm_t *comm);
OFL_API const char *ofl_comm_kind_name(ofl_comm_kind_t kind);
/* The deadline in force for each operation, in ms. */
OFL_API int64_t ofl_comm_timeout_ms(const ofl_comm_t *comm);

/* Nonzero when an earlier operation failed (timeout, MPI or NCCL error) and
 * the comm refuses further operations. */
OFL_API int ofl_comm_is_broken(const ofl_comm_t *comm);
/* NCCL comms: nonzero when an operation timed out and ofl aborted the
 * application's communicator (ncclCommAbort, which also frees it; only with
 * ofl_comm_params_t.nccl_abort_on_timeout = 1): the application must not
 * destroy or use that ncclComm_t again; it destroys this ofl comm and
 * creates a new communicator. 0 for other kinds, and after a timeout that
 * left the communicator to the application (see nccl_abort_on_timeout). */
OFL_API int ofl_comm_nccl_aborted(const ofl_comm_t *comm);

/* Waits until every rank of the comm has called it (deadline as above). */
OFL_API ofl_status_t ofl_comm_barrier(ofl_comm_t *comm);

OFL_EXTERN_C_END

#endif /* OFL_COMM_H */

/* The typed constructors sit outside the include guard: including this header
 * again after mpi.h or nccl.h declares them. */
#if defined(MPI_VERSION) && !defined(OFL_COMM_MPI_DECLARED)
#define OFL_COMM_MPI_DECLARED
/* Typed form of ofl_comm_create_mpi_handle (mpi.h was included first). */
static inline ofl_status_t ofl_comm_create_mpi(MPI_Comm mpi_comm,
                                               const ofl_comm_params_t *params,
                                               ofl_comm_t **out) {
  return ofl_comm_create_mpi_handle(&mpi_comm, params, out);
}
#endif

#if defined(NCCL_MAJOR) && defined(__CUDA_RUNTIME_API_H__) &&                  \
    !defined(OFL_COMM_NCCL_DECLARED)
#define OFL_COMM_NCCL_DECLARED
/* Typed form of ofl_comm_create_nccl_handle (nccl.h was included first). */
static inline ofl_status_t ofl_comm_create_nccl(ncclComm_t nccl_comm,
                                                cudaStream_t stream,
                                                const ofl_comm_params_t *params,
                                                ofl_comm_t **out) {
  return ofl_comm_create_nccl_handle(&nccl_comm, (void *)stream, params, out);
}
#endif
