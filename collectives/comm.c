/* ofl: the comm handle (common part) and the self comm (one rank). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "collectives/comm_internal.h"

/* nccl_abort_on_timeout took what was tail padding: programs built against
 * the two-field struct pass the same size (LP64). */
_Static_assert(sizeof(void *) != 8 || sizeof(ofl_comm_params_t) == 16,
               "ofl_comm_params_t changed size");

/* ---- blobs -----------------------------------------------------------------
 */

void ofl__blobs_free(ofl__blobs_t *b) {
  if (!b)
    return;
  free(b->lens);
  free(b->offsets);
  free(b->data);
  memset(b, 0, sizeof(*b));
}

ofl_status_t ofl__blobs_alloc(ofl__blobs_t *b, int nranks) {
  memset(b, 0, sizeof(*b));
  b->lens = calloc((size_t)nranks, sizeof(size_t));
  b->offsets = calloc((size_t)nranks, sizeof(size_t));
  if (!b->lens || !b->offsets) {
    ofl__blobs_free(b);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "comm: cannot allocate the gather index of %d ranks",
                      nranks);
  }
  b->nranks = nranks;
  return OFL_SUCCESS;
}

ofl_status_t ofl__blobs_pack(ofl__blobs_t *b) {
  size_t total = 0;
  for (int r = 0; r < b->nranks; r++) {
    b->offsets[r] = total;
    if (b->lens[r] > SIZE_MAX - total)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                        "comm: gathered sizes overflow size_t");
    total += b->lens[r];
  }
  b->data = malloc(total ? total : 1);
  if (!b->data)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "comm: cannot allocate %zu bytes for gathered tables",
                      total);
  return OFL_SUCCESS;
}

/* ---- helpers shared by the kinds ------------------------------------------
 */

void ofl__comm_format_ranks(const int *ranks, int n, char *buf, size_t cap) {
  enum { SHOWN = 8 };
  size_t used = 0;
  if (cap == 0)
    return;
  buf[0] = '\0';
  for (int i = 0; i < n && i < SHOWN && used < cap; i++) {
    int w = snprintf(buf + used, cap - used, "%s%d", i ? ", " : "", ranks[i]);
    if (w < 0)
      return;
    used += (size_t)w;
  }
  if (n > SHOWN && used < cap)
    snprintf(buf + used, cap - used, " and %d more", n - SHOWN);
}

void ofl__comm_poll_pause(unsigned *round) {
  /* Spin briefly, then back off to 1 ms: on an oversubscribed node the peers
   * need the core more than the poller does. */
  long ns = *round < 64 ? 0 : *round < 256 ? 20000 : 1000000;
  if (*round < UINT32_MAX)
    (*round)++;
  if (ns) {
    struct timespec ts = {0, ns};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
}

ofl_status_t ofl__comm_alloc(ofl_comm_kind_t kind,
                             const ofl_comm_params_t *params,
                             ofl_comm_t **out) {
  ofl_comm_t *c = calloc(1, sizeof(*c));
  if (!c)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "comm: cannot allocate a %s comm",
                      ofl_comm_kind_name(kind));
  c->kind = kind;
  c->rank = 0;
  c->size = 1;
  c->timeout_ms = ofl__timeout_ms(params ? params->timeout_ms : -1);
  *out = c;
  return OFL_SUCCESS;
}

/* ---- self ------------------------------------------------------------------
 */

static ofl_status_t self_gather(ofl_comm_t *comm, const void *mine, size_t len,
                                bool to_all, ofl__blobs_t *out) {
  (void)comm;
  (void)to_all;
  OFL_CHECK(ofl__blobs_alloc(out, 1));
  out->lens[0] = len;
  ofl_status_t st = ofl__blobs_pack(out);
  if (st != OFL_SUCCESS) {
    ofl__blobs_free(out);
    return st;
  }
  if (len)
    memcpy(out->data, mine, len);
  return OFL_SUCCESS;
}

static ofl_status_t self_barrier(ofl_comm_t *comm) {
  (void)comm;
  return OFL_SUCCESS;
}

static void self_destroy(ofl_comm_t *comm) { (void)comm; }

static const ofl__comm_ops_t self_ops = {self_gather, self_barrier,
                                         self_destroy};

ofl_status_t ofl_comm_create_self(const ofl_comm_params_t *params,
                                  ofl_comm_t **out) {
  if (!out)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_comm_create_self: out is NULL");
  ofl_comm_t *c = NULL;
  OFL_CHECK(ofl__comm_alloc(OFL_COMM_SELF, params, &c));
  c->ops = &self_ops;
  *out = c;
  return OFL_SUCCESS;
}

/* ---- common entry points ---------------------------------------------------
 */

void ofl_comm_destroy(ofl_comm_t *comm) {
  if (!comm)
    return;
  if (comm->ops && comm->ops->destroy)
    comm->ops->destroy(comm);
  free(comm);
}

int ofl_comm_rank(const ofl_comm_t *comm) { return comm ? comm->rank : -1; }
int ofl_comm_size(const ofl_comm_t *comm) { return comm ? comm->size : 0; }
ofl_comm_kind_t ofl_comm_kind(const ofl_comm_t *comm) {
  return comm ? comm->kind : OFL_COMM_SELF;
}
int64_t ofl_comm_timeout_ms(const ofl_comm_t *comm) {
  return comm ? comm->timeout_ms : ofl__timeout_ms(-1);
}
int ofl_comm_is_broken(const ofl_comm_t *comm) {
  return comm ? comm->broken : 0;
}

int ofl_comm_nccl_aborted(const ofl_comm_t *comm) {
  return comm ? comm->native_aborted : 0;
}

const char *ofl_comm_kind_name(ofl_comm_kind_t kind) {
  switch (kind) {
  case OFL_COMM_SELF:
    return "self";
  case OFL_COMM_MPI:
    return "mpi";
  case OFL_COMM_NCCL:
    return "nccl";
  }
  return "unknown";
}

static ofl_status_t check_usable(const ofl_comm_t *comm, const char *what) {
  if (!comm)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL, "%s: comm is NULL",
                      what);
  if (comm->broken)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_COLL,
                      "%s: the %s comm failed in an earlier operation (see "
                      "the first error on this rank); destroy it and create "
                      "a new one on every rank",
                      what, ofl_comm_kind_name(comm->kind));
  return OFL_SUCCESS;
}

ofl_status_t ofl__comm_gather(ofl_comm_t *comm, const void *mine, size_t len,
                              bool to_all, ofl__blobs_t *out) {
  OFL_CHECK(check_usable(comm, "comm gather"));
  if (len && !mine)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "comm gather: %zu bytes from a NULL buffer", len);
  memset(out, 0, sizeof(*out));
  comm->seq++;
  ofl_status_t st = comm->ops->gather(comm, mine, len, to_all, out);
  if (st != OFL_SUCCESS)
    ofl__blobs_free(out);
  return st;
}

ofl_status_t ofl_comm_barrier(ofl_comm_t *comm) {
  OFL_CHECK(check_usable(comm, "ofl_comm_barrier"));
  comm->seq++;
  return comm->ops->barrier(comm);
}

/* ---- kinds not built -------------------------------------------------------
 */

#if !OFL_HAVE_MPI
ofl_status_t ofl_comm_create_mpi_handle(const void *mpi_comm,
                                        const ofl_comm_params_t *params,
                                        ofl_comm_t **out) {
  (void)mpi_comm;
  (void)params;
  (void)out;
  return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_COLL,
                    "ofl_comm_create_mpi: this build of ofl has no MPI "
                    "support; rebuild with an MPI library installed "
                    "(meson -Dmpi=enabled) or use ofl_comm_create_self");
}
#endif

#if !OFL_HAVE_NCCL
ofl_status_t ofl_comm_create_nccl_handle(const void *nccl_comm,
                                         void *cuda_stream,
                                         const ofl_comm_params_t *params,
                                         ofl_comm_t **out) {
  (void)nccl_comm;
  (void)cuda_stream;
  (void)params;
  (void)out;
  return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_COLL,
                    "ofl_comm_create_nccl: this build of ofl has no NCCL "
                    "support; rebuild with CUDA and NCCL found (meson "
                    "-Dnccl=enabled) or use an MPI or self comm");
}
#endif

/* ---- blob encoding (replies that carry every rank's table) -----------------
 */

ofl_status_t ofl__blobs_encode(const ofl__blobs_t *b, unsigned char **out,
                               size_t *out_len) {
  size_t head = 4 + 8 * (size_t)b->nranks, total = head;
  for (int r = 0; r < b->nranks; r++)
    total += b->lens[r];
  unsigned char *buf = malloc(total);
  if (!buf)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "comm: cannot allocate %zu bytes for the gather reply",
                      total);
  ofl__put_u32(buf, (uint32_t)b->nranks);
  size_t at = head;
  for (int r = 0; r < b->nranks; r++) {
    ofl__put_u64(buf + 4 + 8 * (size_t)r, b->lens[r]);
    if (b->lens[r])
      memcpy(buf + at, b->data + b->offsets[r], b->lens[r]);
    at += b->lens[r];
  }
  *out = buf;
  *out_len = total;
  return OFL_SUCCESS;
}

ofl_status_t ofl__blobs_decode(const unsigned char *buf, size_t len,
                               int expect_nranks, ofl__blobs_t *out) {
  if (len < 4 || ofl__get_u32(buf) != (uint32_t)expect_nranks ||
      len - 4 < 8 * (size_t)expect_nranks)
    return ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                      "comm: malformed gather reply (%zu bytes, %d ranks "
                      "expected)",
                      len, expect_nranks);
  ofl__blobs_t b;
  OFL_CHECK(ofl__blobs_alloc(&b, expect_nranks));
  size_t avail = len - 4 - 8 * (size_t)expect_nranks;
  for (int r = 0; r < expect_nranks; r++) {
    uint64_t l = ofl__get_u64(buf + 4 + 8 * (size_t)r);
    if (l > avail) {
      ofl__blobs_free(&b);
      return ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                        "comm: malformed gather reply (rank %d's part of "
                        "%llu bytes runs past the end)",
                        r, (unsigned long long)l);
    }
    b.lens[r] = (size_t)l;
    avail -= (size_t)l;
  }
  if (avail != 0) {
    ofl__blobs_free(&b);
    return ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                      "comm: malformed gather reply (%zu trailing bytes)",
                      avail);
  }
  ofl_status_t st = ofl__blobs_pack(&b);
  if (st != OFL_SUCCESS) {
    ofl__blobs_free(&b);
    return st;
  }
  size_t head = 4 + 8 * (size_t)expect_nranks;
  memcpy(b.data, buf + head, len - head);
  *out = b;
  return OFL_SUCCESS;
}
