/* ofl: the comm's internal interface. Each kind (self, mpi, nccl) fills an ops
 * table; comm.c checks arguments and the broken flag, then dispatches. */
#ifndef OFL_COLLECTIVES_COMM_INTERNAL_H
#define OFL_COLLECTIVES_COMM_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ofl/comm.h>
#include <ofl/version.h>

#include "runtime/internal.h"

/* What a variable-size gather hands back: one blob per rank, packed in data
 * (rank r at offsets[r], lens[r] bytes). Owned by the caller of gather. */
typedef struct ofl__blobs {
  int nranks;
  size_t *lens;
  size_t *offsets;
  unsigned char *data;
} ofl__blobs_t;

void ofl__blobs_free(ofl__blobs_t *b);
/* Allocates lens/offsets for nranks and data for the sum of lens (set by the
 * caller before calling ofl__blobs_pack). */
ofl_status_t ofl__blobs_alloc(ofl__blobs_t *b, int nranks);
ofl_status_t ofl__blobs_pack(ofl__blobs_t *b);

typedef struct ofl__comm_ops {
  /* Variable-size gather of one blob per rank. On rank 0 (and on every rank
   * when to_all) *out receives every rank's blob; elsewhere *out is left
   * empty. Every rank returns the same status when the failure is detected
   * by rank 0 (rank 0 tells the others). */
  ofl_status_t (*gather)(ofl_comm_t *comm, const void *mine, size_t len,
                         bool to_all, ofl__blobs_t *out);
  ofl_status_t (*barrier)(ofl_comm_t *comm);
  void (*destroy)(ofl_comm_t *comm);
} ofl__comm_ops_t;

struct ofl_comm {
  ofl_comm_kind_t kind;
  int rank;
  int size;
  int64_t timeout_ms;
  bool broken;
  bool native_aborted; /* NCCL: ofl called ncclCommAbort on the user's
                          communicator (which that freed) */
  uint32_t seq; /* operations issued, checked across ranks */
  const ofl__comm_ops_t *ops;
  void *impl;
};

/* Allocates the common part of a comm (timeout resolved from params). */
ofl_status_t ofl__comm_alloc(ofl_comm_kind_t kind,
                             const ofl_comm_params_t *params, ofl_comm_t **out);

/* Formats up to a few rank numbers ("1, 3, 5 and 2 more") into buf. */
void ofl__comm_format_ranks(const int *ranks, int n, char *buf, size_t cap);

/* Deadline arithmetic saturates (a timeout of INT64_MAX ms means "wait",
 * never a sum that wraps into the past): the deadline ms from now, and
 * twice a timeout (what ranks other than 0 wait for rank 0). */
static inline uint64_t ofl__comm_deadline(int64_t ms) {
  return ofl__deadline_ns(ms < 0 ? 0 : ms);
}
static inline int64_t ofl__comm_twice_ms(int64_t ms) {
  return ms > INT64_MAX / 2 ? INT64_MAX : 2 * ms;
}

/* Sleeps a little between polls: short at first, up to 1 ms. */
void ofl__comm_poll_pause(unsigned *round);

/* Little-endian wire encoding shared by the kinds and the table format. */
static inline void ofl__put_u32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (unsigned char)(v >> (8 * i));
}
static inline void ofl__put_u64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint32_t ofl__get_u32(const unsigned char *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++)
    v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static inline uint64_t ofl__get_u64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* Encodes blobs as one buffer: u32 nranks, u64 len per rank, the data. */
ofl_status_t ofl__blobs_encode(const ofl__blobs_t *b, unsigned char **out,
                               size_t *out_len);
/* Decodes such a buffer; OFL_ERR_CORRUPT when it is malformed. */
ofl_status_t ofl__blobs_decode(const unsigned char *buf, size_t len,
                               int expect_nranks, ofl__blobs_t *out);

ofl_status_t ofl__comm_gather(ofl_comm_t *comm, const void *mine, size_t len,
                              bool to_all, ofl__blobs_t *out);

#endif /* OFL_COLLECTIVES_COMM_INTERNAL_H */
