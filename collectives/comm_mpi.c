/* ofl: the MPI comm. Works on a duplicate of the application's communicator
 * (any sub-communicator) with MPI_ERRORS_RETURN, and only with nonblocking
 * point-to-point calls polled against a deadline, so that a rank that died or
 * never calls is reported by name instead of hanging the others.
 *
 * Gather protocol (one round per operation, numbered by comm->seq):
 *   every rank r > 0 sends rank 0 a header {magic, seq, flags, len} and then
 *   len bytes; rank 0 receives the headers first, then each payload of the
 *   announced size; then rank 0 replies to every rank with {magic, seq,
 *   status, len} and either every rank's table (to_all), nothing (root only)
 *   or, on failure, its error message. So every rank learns the outcome, and
 *   the others wait for rank 0 up to twice the timeout. */
#include <ofl/version.h>

#if OFL_HAVE_MPI

#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/comm_internal.h"

enum {
  TAG_HDR = 0x0f11,
  TAG_DATA = 0x0f12,
  TAG_REPLY_HDR = 0x0f13,
  TAG_REPLY_DATA = 0x0f14,
  TAG_GAVE_UP = 0x0f15
};

#define WIRE_MAGIC 0x434c464fu /* "OFLC" */
#define HDR_BYTES 24
#define FLAG_TO_ALL 1u
/* Tables are small; anything larger than this is a corrupt header. */
#define MAX_PAYLOAD ((uint64_t)(INT_MAX / 2))

typedef struct mpi_impl {
  MPI_Comm comm;
  /* Buffers of requests abandoned after a failure: MPI may still read or
   * write them (a late peer), so they outlive the comm (see kept_forever). */
  void **graveyard;
  size_t ngrave;
} mpi_impl_t;

/* Buffers of abandoned requests of destroyed comms: a late peer may still
 * complete a transfer into or out of them, so they are never freed (they
 * exist only after a fault), and stay reachable. */
static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;
static void **kept_forever;
static size_t nkept_forever;

static void keep_forever(void **bufs, size_t n) {
  pthread_mutex_lock(&kept_mu);
  void **k = realloc(kept_forever, (nkept_forever + n) * sizeof(void *));
  if (k != NULL) { /* else: leaked, which is as safe */
    kept_forever = k;
    memcpy(k + nkept_forever, bufs, n * sizeof(void *));
    nkept_forever += n;
  }
  pthread_mutex_unlock(&kept_mu);
}

typedef struct wire_hdr {
  uint32_t magic, seq;
  int32_t status; /* replies: an ofl_status_t */
  uint32_t flags; /* requests: FLAG_TO_ALL */
  uint64_t len;
} wire_hdr_t;

static void hdr_encode(unsigned char *p, const wire_hdr_t *h) {
  ofl__put_u32(p, h->magic);
  ofl__put_u32(p + 4, h->seq);
  ofl__put_u32(p + 8, (uint32_t)h->status);
  ofl__put_u32(p + 12, h->flags);
  ofl__put_u64(p + 16, h->len);
}

static void hdr_decode(const unsigned char *p, wire_hdr_t *h) {
  h->magic = ofl__get_u32(p);
  h->seq = ofl__get_u32(p + 4);
  h->status = (int32_t)ofl__get_u32(p + 8);
  h->flags = ofl__get_u32(p + 12);
  h->len = ofl__get_u64(p + 16);
}

static ofl_status_t mpi_fail(int rc, const char *what, int peer) {
  char text[MPI_MAX_ERROR_STRING] = "";
  int n = 0;
  if (MPI_Error_string(rc, text, &n) != MPI_SUCCESS)
    strcpy(text, "unknown mpi error");
  if (peer >= 0)
    return ofl__error(OFL_ERR_MPI, OFL_SUBSYS_COLL,
                      "mpi comm: %s with rank %d failed: %s (the peer may "
                      "have died; the comm is now unusable)",
                      what, peer, text);
  return ofl__error(OFL_ERR_MPI, OFL_SUBSYS_COLL, "mpi comm: %s failed: %s",
                    what, text);
}

static uint64_t deadline_after(int64_t ms) { return ofl__comm_deadline(ms); }

static bool past(uint64_t deadline) { return ofl__now_ns() >= deadline; }

static void bury(mpi_impl_t *m, void *buf) {
  if (!buf)
    return;
  void **g = realloc(m->graveyard, (m->ngrave + 1) * sizeof(void *));
  if (g) {
    m->graveyard = g;
    m->graveyard[m->ngrave++] = buf;
  } /* else: leak it rather than free memory MPI may still use */
}

/* Gives up on a request after a failure and takes ownership of buf, the
 * memory it reads or writes: a receive is cancelled; once the request is
 * finished buf is freed. A send, or a receive whose cancel does not finish
 * promptly, is freed as a request and buf kept until the comm is destroyed,
 * since MPI may still use it. */
static void abandon(mpi_impl_t *m, MPI_Request *req, void *buf, bool send) {
  if (*req != MPI_REQUEST_NULL && !send) {
    MPI_Cancel(req);
    uint64_t until = deadline_after(100);
    unsigned round = 0;
    int done = 0;
    while (!done && !past(until)) {
      if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        break;
      if (!done)
        ofl__comm_poll_pause(&round);
    }
  }
  if (*req == MPI_REQUEST_NULL) {
    free(buf);
    return;
  }
  MPI_Request_free(req);
  bury(m, buf);
}

/* Polls one request until it completes or the deadline passes. */
static ofl_status_t wait_one(MPI_Request *req, uint64_t deadline,
                             const char *what, int peer, bool *timed_out) {
  unsigned round = 0;
  *timed_out = false;
  for (;;) {
    int done = 0;
    int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS)
      return mpi_fail(rc, what, peer);
    if (done)
      return OFL_SUCCESS;
    if (past(deadline)) {
      *timed_out = true;
      return OFL_ERR_TIMEOUT;
    }
    ofl__comm_poll_pause(&round);
  }
}

/* ---- rank 0 ----------------------------------------------------------------
 */

typedef enum { WAIT_HDR, WAIT_DATA, DONE, FAILED } peer_state_t;

typedef struct root_peer {
  peer_state_t state;
  unsigned char *hdr; /* HDR_BYTES */
  MPI_Request req;
  unsigned char *data;
  size_t len;
} root_peer_t;

/* Advances one peer: header received -> post the table receive; table
 * received -> done. A bad header or an MPI error marks the peer FAILED. */
static ofl_status_t root_poll_peer(ofl_comm_t *c, mpi_impl_t *m, int r,
                                   root_peer_t *p, bool to_all) {
  int done = 0;
  int rc = MPI_Test(&p->req, &done, MPI_STATUS_IGNORE);
  if (rc != MPI_SUCCESS) {
    const char *what =
        p->state == WAIT_HDR ? "receiving the header" : "receiving the table";
    p->state = FAILED;
    return mpi_fail(rc, what, r);
  }
  if (!done)
    return OFL_SUCCESS;
  if (p->state == WAIT_DATA) {
    p->state = DONE;
    return OFL_SUCCESS;
  }
  wire_hdr_t h;
  hdr_decode(p->hdr, &h);
  if (h.magic != WIRE_MAGIC || h.len > MAX_PAYLOAD) {
    p->state = FAILED;
    return ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                      "mpi comm: malformed header from rank %d (magic "
                      "0x%08x, %llu bytes)",
                      r, h.magic, (unsigned long long)h.len);
  }
  if (h.seq != c->seq) {
    p->state = FAILED;
    return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_COLL,
                      "mpi comm: rank %d is at collective operation %u and "
                      "rank 0 at %u: the ranks did not make the same "
                      "sequence of calls on this comm",
                      r, h.seq, c->seq);
  }
  if (((h.flags & FLAG_TO_ALL) != 0) != to_all) {
    p->state = FAILED;
    return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_COLL,
                      "mpi comm: rank %d asked for the result %s and rank "
                      "0 %s: pass the same root_only on every rank",
                      r, (h.flags & FLAG_TO_ALL) ? "on all ranks" : "on rank 0",
                      to_all ? "on all ranks" : "on rank 0");
  }
  p->len = (size_t)h.len;
  if (p->len == 0) {
    p->state = DONE;
    return OFL_SUCCESS;
  }
  p->data = malloc(p->len);
  if (!p->data) {
    p->state = FAILED;
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "mpi comm: cannot allocate %zu bytes for rank %d's "
                      "table",
                      p->len, r);
  }
  rc = MPI_Irecv(p->data, (int)p->len, MPI_BYTE, r, TAG_DATA, m->comm, &p->req);
  if (rc != MPI_SUCCESS) {
    p->state = FAILED;
    return mpi_fail(rc, "posting the table receive", r);
  }
  p->state = WAIT_DATA;
  return OFL_SUCCESS;
}

/* Receives every rank's header and table until done or the deadline. Returns
 * the first failure; ranks that did not answer make it OFL_ERR_TIMEOUT. */
static ofl_status_t root_collect(ofl_comm_t *c, mpi_impl_t *m, root_peer_t *p,
                                 bool to_all) {
  ofl_status_t first = OFL_SUCCESS;
  for (int r = 1; r < c->size; r++) {
    p[r].req = MPI_REQUEST_NULL;
    p[r].hdr = malloc(HDR_BYTES);
    if (!p[r].hdr) {
      p[r].state = FAILED;
      if (first == OFL_SUCCESS)
        first = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                           "mpi comm: out of memory for rank %d's header", r);
      continue;
    }
    int rc = MPI_Irecv(p[r].hdr, HDR_BYTES, MPI_BYTE, r, TAG_HDR, m->comm,
                       &p[r].req);
    if (rc != MPI_SUCCESS) {
      p[r].state = FAILED;
      if (first == OFL_SUCCESS)
        first = mpi_fail(rc, "posting the header receive", r);
    }
  }
  uint64_t deadline = deadline_after(c->timeout_ms);
  unsigned round = 0;
  for (;;) {
    int pending = 0;
    for (int r = 1; r < c->size; r++) {
      if (p[r].state != WAIT_HDR && p[r].state != WAIT_DATA)
        continue;
      ofl_status_t st = root_poll_peer(c, m, r, &p[r], to_all);
      if (st != OFL_SUCCESS && first == OFL_SUCCESS)
        first = st;
      pending += p[r].state == WAIT_HDR || p[r].state == WAIT_DATA;
    }
    if (pending == 0 || first != OFL_SUCCESS || past(deadline))
      break;
    ofl__comm_poll_pause(&round);
  }
  int *missing = malloc(sizeof(int) * (size_t)c->size);
  int nmissing = 0;
  for (int r = 1; r < c->size; r++) {
    if (p[r].state == WAIT_HDR || p[r].state == WAIT_DATA) {
      /* the request's buffer passes to abandon */
      if (p[r].state == WAIT_HDR) {
        abandon(m, &p[r].req, p[r].hdr, false);
        p[r].hdr = NULL;
      } else {
        abandon(m, &p[r].req, p[r].data, false);
        p[r].data = NULL;
      }
      if (missing)
        missing[nmissing] = r;
      nmissing++;
    }
  }
  if (first == OFL_SUCCESS && nmissing > 0) {
    char list[160] = "?";
    if (missing)
      ofl__comm_format_ranks(missing, nmissing, list, sizeof(list));
    first = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_COLL,
                       "mpi comm: rank%s %s of %d did not answer within %lld "
                       "ms (died, never called, or stuck); check those ranks' "
                       "logs",
                       nmissing > 1 ? "s" : "", list, c->size,
                       (long long)c->timeout_ms);
  }
  free(missing);
  return first;
}

/* Sends the reply to every rank r > 0 and waits (bounded) for the sends. */
static void root_reply(ofl_comm_t *c, mpi_impl_t *m, ofl_status_t status,
                       const unsigned char *payload, size_t len) {
  int n = c->size - 1;
  MPI_Request *reqs = malloc(sizeof(MPI_Request) * 2 * (size_t)n);
  unsigned char *buf = malloc(HDR_BYTES + len);
  if (!reqs || !buf) {
    free(reqs);
    free(buf);
    return; /* the others then time out waiting for rank 0 */
  }
  wire_hdr_t h = {WIRE_MAGIC, c->seq, (int32_t)status, 0, len};
  hdr_encode(buf, &h);
  if (len)
    memcpy(buf + HDR_BYTES, payload, len);
  for (int i = 0; i < 2 * n; i++)
    reqs[i] = MPI_REQUEST_NULL;
  for (int r = 1; r < c->size; r++) {
    if (MPI_Isend(buf, HDR_BYTES, MPI_BYTE, r, TAG_REPLY_HDR, m->comm,
                  &reqs[2 * (r - 1)]) != MPI_SUCCESS)
      continue;
    if (len)
      MPI_Isend(buf + HDR_BYTES, (int)len, MPI_BYTE, r, TAG_REPLY_DATA, m->comm,
                &reqs[2 * (r - 1) + 1]);
  }
  /* Live ranks take the reply at once; a dead one must not hold us up. */
  uint64_t deadline = deadline_after(c->timeout_ms);
  unsigned round = 0;
  int all = 0;
  while (!past(deadline)) {
    if (MPI_Testall(2 * n, reqs, &all, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
      break;
    if (all)
      break;
    ofl__comm_poll_pause(&round);
  }
  if (all) {
    free(buf);
  } else {
    for (int i = 0; i < 2 * n; i++)
      if (reqs[i] != MPI_REQUEST_NULL)
        MPI_Request_free(&reqs[i]);
    bury(m, buf);
    c->broken = true;
    OFL_WARN(OFL_SUBSYS_COLL,
             "mpi comm: reply of operation %u not taken by every rank "
             "within %lld ms; the comm is now unusable",
             c->seq, (long long)c->timeout_ms);
  }
  free(reqs);
}

/* A rank that timed out waiting for rank 0 tells it so (best effort): a rank
 * 0 that arrives late must not report success while the others failed. */
static ofl_status_t root_check_gave_up(ofl_comm_t *c, mpi_impl_t *m) {
  int *who = malloc(sizeof(int) * (size_t)c->size);
  int n = 0;
  for (int r = 1; r < c->size; r++) {
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(r, TAG_GAVE_UP, m->comm, &flag, &status) != MPI_SUCCESS ||
        !flag)
      continue;
    unsigned char seq[4];
    MPI_Recv(seq, 4, MPI_BYTE, r, TAG_GAVE_UP, m->comm, MPI_STATUS_IGNORE);
    if (ofl__get_u32(seq) == c->seq && who)
      who[n++] = r;
  }
  ofl_status_t st = OFL_SUCCESS;
  if (n > 0) {
    char list[160];
    ofl__comm_format_ranks(who, n, list, sizeof(list));
    st = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_COLL,
                    "mpi comm: rank%s %s gave up waiting for rank 0 in "
                    "operation %u (rank 0 called more than %lld ms after "
                    "them)",
                    n > 1 ? "s" : "", list, c->seq,
                    (long long)ofl__comm_twice_ms(c->timeout_ms));
  }
  free(who);
  return st;
}

static ofl_status_t root_gather(ofl_comm_t *c, mpi_impl_t *m, const void *mine,
                                size_t len, bool to_all, ofl__blobs_t *out) {
  root_peer_t *p = calloc((size_t)c->size, sizeof(*p));
  if (!p)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "mpi comm: cannot allocate the state of %d ranks",
                      c->size);
  ofl_status_t st = root_collect(c, m, p, to_all);
  if (st == OFL_SUCCESS)
    st = root_check_gave_up(c, m);
  ofl__blobs_t b = {0};
  if (st == OFL_SUCCESS)
    st = ofl__blobs_alloc(&b, c->size);
  if (st == OFL_SUCCESS) {
    b.lens[0] = len;
    for (int r = 1; r < c->size; r++)
      b.lens[r] = p[r].len;
    st = ofl__blobs_pack(&b);
  }
  if (st == OFL_SUCCESS) {
    if (len)
      memcpy(b.data + b.offsets[0], mine, len);
    for (int r = 1; r < c->size; r++)
      if (p[r].len)
        memcpy(b.data + b.offsets[r], p[r].data, p[r].len);
  }
  unsigned char *reply = NULL;
  size_t reply_len = 0;
  if (st == OFL_SUCCESS && (uint64_t)len > MAX_PAYLOAD)
    st = ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                    "mpi comm: rank 0's table of %zu bytes is over the "
                    "%llu-byte limit of one message",
                    len, (unsigned long long)MAX_PAYLOAD);
  if (st == OFL_SUCCESS && to_all)
    st = ofl__blobs_encode(&b, &reply, &reply_len);
  if (st == OFL_SUCCESS && (uint64_t)reply_len > MAX_PAYLOAD)
    st = ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                    "mpi comm: the gathered tables make %zu bytes, over the "
                    "%llu-byte limit of one message; gather on rank 0 only "
                    "(root_only) or use fewer names",
                    reply_len, (unsigned long long)MAX_PAYLOAD);
  if (st != OFL_SUCCESS) {
    /* The others get rank 0's message (with its terminating NUL). */
    const char *msg = ofl_last_error();
    root_reply(c, m, st, (const unsigned char *)msg, strlen(msg) + 1);
    ofl__blobs_free(&b);
  } else {
    root_reply(c, m, OFL_SUCCESS, reply, reply_len);
    *out = b;
  }
  free(reply);
  for (int r = 1; r < c->size; r++) {
    free(p[r].data);
    free(p[r].hdr);
  }
  free(p);
  return st;
}

/* ---- ranks other than 0 ---------------------------------------------------
 */

static ofl_status_t peer_gather(ofl_comm_t *c, mpi_impl_t *m, const void *mine,
                                size_t len, bool to_all, ofl__blobs_t *out) {
  if ((uint64_t)len > MAX_PAYLOAD)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "mpi comm: a table of %zu bytes is too large to gather",
                      len);
  /* Own copies of what is sent: after a failure the requests are abandoned,
   * and MPI may read the buffers later. */
  unsigned char *hdr = malloc(HDR_BYTES);
  unsigned char *data = len ? malloc(len) : NULL;
  unsigned char *rhdr = malloc(HDR_BYTES);
  if (!hdr || (len && !data) || !rhdr) {
    free(hdr);
    free(data);
    free(rhdr);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "mpi comm: cannot allocate %zu bytes to send", len);
  }
  wire_hdr_t h = {WIRE_MAGIC, c->seq, 0, to_all ? FLAG_TO_ALL : 0, len};
  hdr_encode(hdr, &h);
  if (len)
    memcpy(data, mine, len);

  MPI_Request sreq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Request rreq = MPI_REQUEST_NULL;
  unsigned char *rdata = NULL;
  ofl_status_t st = OFL_SUCCESS;
  bool timed_out = false, rank0_said = false;
  wire_hdr_t r;
  /* Rank 0 may itself wait the full timeout for another rank before it
   * answers, so the others wait twice as long. */
  uint64_t deadline = deadline_after(ofl__comm_twice_ms(c->timeout_ms));
  int rc = MPI_Isend(hdr, HDR_BYTES, MPI_BYTE, 0, TAG_HDR, m->comm, &sreq[0]);
  if (rc == MPI_SUCCESS && len)
    rc = MPI_Isend(data, (int)len, MPI_BYTE, 0, TAG_DATA, m->comm, &sreq[1]);
  if (rc == MPI_SUCCESS)
    rc = MPI_Irecv(rhdr, HDR_BYTES, MPI_BYTE, 0, TAG_REPLY_HDR, m->comm, &rreq);
  if (rc != MPI_SUCCESS) {
    st = mpi_fail(rc, "posting the gather", 0);
    goto out;
  }
  st = wait_one(&rreq, deadline, "receiving the reply", 0, &timed_out);
  if (st != OFL_SUCCESS)
    goto out;
  hdr_decode(rhdr, &r);
  if (r.magic != WIRE_MAGIC || r.len > MAX_PAYLOAD) {
    st = ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                    "mpi comm: malformed reply from rank 0");
    goto out;
  }
  if (r.seq != c->seq) {
    st = ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_COLL,
                    "mpi comm: rank 0 answered collective operation %u while "
                    "this rank (%d) is at %u: the ranks did not make the same "
                    "sequence of calls on this comm",
                    r.seq, c->rank, c->seq);
    goto out;
  }
  if (r.len) {
    rdata = malloc((size_t)r.len);
    if (!rdata) {
      st = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "mpi comm: cannot allocate %llu bytes for the reply",
                      (unsigned long long)r.len);
      goto out;
    }
    rc = MPI_Irecv(rdata, (int)r.len, MPI_BYTE, 0, TAG_REPLY_DATA, m->comm,
                   &rreq);
    if (rc != MPI_SUCCESS) {
      st = mpi_fail(rc, "posting the reply receive", 0);
      goto out;
    }
    st = wait_one(&rreq, deadline, "receiving the reply", 0, &timed_out);
    if (st != OFL_SUCCESS)
      goto out;
  }
  if (r.status != OFL_SUCCESS) {
    const char *msg = rdata && r.len && rdata[r.len - 1] == '\0'
                          ? (const char *)rdata
                          : "(no message)";
    ofl_status_t why = r.status > 0 && r.status <= OFL_ERR_INTERNAL
                           ? (ofl_status_t)r.status
                           : OFL_ERR_INTERNAL;
    rank0_said = true;
    st = ofl__error(why, OFL_SUBSYS_COLL,
                    "mpi comm: operation %u failed on rank 0 (this is rank "
                    "%d): %s",
                    c->seq, c->rank, msg);
    goto out;
  }
  if (to_all) {
    st = ofl__blobs_decode(rdata, (size_t)r.len, c->size, out);
    if (st != OFL_SUCCESS)
      goto out;
  }
  /* Rank 0 answered after it had our table, so the sends are complete. */
  st = wait_one(&sreq[0], deadline, "sending the header", 0, &timed_out);
  if (st == OFL_SUCCESS && len)
    st = wait_one(&sreq[1], deadline, "sending the table", 0, &timed_out);
  if (st != OFL_SUCCESS)
    ofl__blobs_free(out);

out:
  if (timed_out)
    st = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_COLL,
                    "mpi comm: rank 0 did not answer rank %d within %lld ms "
                    "(died, never called, or stuck); check rank 0's log",
                    c->rank, (long long)ofl__comm_twice_ms(c->timeout_ms));
  if (st != OFL_SUCCESS && !rank0_said) {
    unsigned char *note = malloc(4);
    MPI_Request nreq = MPI_REQUEST_NULL;
    if (note) {
      ofl__put_u32(note, c->seq);
      if (MPI_Isend(note, 4, MPI_BYTE, 0, TAG_GAVE_UP, m->comm, &nreq) !=
          MPI_SUCCESS)
        nreq = MPI_REQUEST_NULL;
    }
    int done = 0;
    if (nreq != MPI_REQUEST_NULL)
      MPI_Test(&nreq, &done, MPI_STATUS_IGNORE);
    abandon(m, &nreq, note, true);
  }
  /* rreq, if still pending, writes into rdata once that was posted, else
   * into rhdr; abandon takes that buffer. */
  if (rdata) {
    abandon(m, &rreq, rdata, false);
    free(rhdr);
  } else {
    abandon(m, &rreq, rhdr, false);
  }
  abandon(m, &sreq[0], hdr, true);
  abandon(m, &sreq[1], data, true);
  return st;
}

/* ---- ops -------------------------------------------------------------------
 */

static ofl_status_t mpi_gather(ofl_comm_t *c, const void *mine, size_t len,
                               bool to_all, ofl__blobs_t *out) {
  mpi_impl_t *m = c->impl;
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_COLL,
                      "mpi comm: MPI is already finalized; gather the "
                      "summary before MPI_Finalize");
  ofl_status_t st = c->rank == 0 ? root_gather(c, m, mine, len, to_all, out)
                                 : peer_gather(c, m, mine, len, to_all, out);
  if (st != OFL_SUCCESS)
    c->broken = true;
  return st;
}

static ofl_status_t mpi_barrier(ofl_comm_t *c) {
  ofl__blobs_t b = {0};
  ofl_status_t st = mpi_gather(c, NULL, 0, false, &b);
  ofl__blobs_free(&b);
  return st;
}

static void mpi_destroy(ofl_comm_t *c) {
  mpi_impl_t *m = c->impl;
  if (!m)
    return;
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin && m->comm != MPI_COMM_NULL)
    MPI_Comm_free(&m->comm);
  if (m->ngrave > 0) {
    OFL_INFO(OFL_SUBSYS_COLL,
             "mpi comm destroyed with %zu buffers of operations abandoned "
             "after a fault; kept for the life of the process, since a late "
             "rank may still transfer into or out of them",
             m->ngrave);
    keep_forever(m->graveyard, m->ngrave);
  }
  free(m->graveyard);
  free(m);
}

static const ofl__comm_ops_t mpi_ops = {mpi_gather, mpi_barrier, mpi_destroy};

ofl_status_t ofl_comm_create_mpi_handle(const void *mpi_comm,
                                        const ofl_comm_params_t *params,
                                        ofl_comm_t **out) {
  if (!mpi_comm || !out)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_comm_create_mpi: %s is NULL",
                      !mpi_comm ? "the MPI_Comm pointer" : "out");
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_COLL,
                      "ofl_comm_create_mpi: MPI is %s; create the comm "
                      "between MPI_Init and MPI_Finalize",
                      fin ? "already finalized" : "not initialized");
  MPI_Comm user = *(const MPI_Comm *)mpi_comm;
  if (user == MPI_COMM_NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_comm_create_mpi: the communicator is "
                      "MPI_COMM_NULL (a rank outside the group?)");
  int inter = 0;
  if (MPI_Comm_test_inter(user, &inter) == MPI_SUCCESS && inter)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_comm_create_mpi: an intercommunicator is not "
                      "supported; pass an intracommunicator");

  ofl_comm_t *c;
  OFL_CHECK(ofl__comm_alloc(OFL_COMM_MPI, params, &c));
  mpi_impl_t *m = calloc(1, sizeof(*m));
  if (!m) {
    free(c);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "ofl_comm_create_mpi: out of memory");
  }
  m->comm = MPI_COMM_NULL;
  /* The duplicate keeps our messages apart from the application's. It is a
   * collective: poll it against the deadline like everything else. */
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(user, &m->comm, &req);
  ofl_status_t st = OFL_SUCCESS;
  bool timed_out = false;
  if (rc != MPI_SUCCESS)
    st = mpi_fail(rc, "duplicating the communicator", -1);
  else
    st = wait_one(&req, deadline_after(c->timeout_ms),
                  "duplicating the communicator", -1, &timed_out);
  if (timed_out) {
    /* A pending nonblocking collective cannot be cancelled or freed; the
     * request is left to MPI, and m, whose comm field it may still write
     * when a late rank completes it, is kept for the life of the process. */
    void *keep[1] = {m};
    keep_forever(keep, 1);
    free(c);
    return ofl__error(
        OFL_ERR_TIMEOUT, OFL_SUBSYS_COLL,
        "ofl_comm_create_mpi: not every rank of the "
        "communicator called it within %lld ms; it is "
        "collective. The duplication is still pending on your "
        "communicator: do not start other collectives on it",
        (long long)ofl__timeout_ms(params ? params->timeout_ms : -1));
  }
  if (st == OFL_SUCCESS) {
    rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS)
      rc = MPI_Comm_rank(m->comm, &c->rank);
    if (rc == MPI_SUCCESS)
      rc = MPI_Comm_size(m->comm, &c->size);
    if (rc != MPI_SUCCESS)
      st = mpi_fail(rc, "setting up the communicator", -1);
  }
  if (st != OFL_SUCCESS) {
    if (m->comm != MPI_COMM_NULL)
      MPI_Comm_free(&m->comm);
    free(m);
    free(c);
    return st;
  }
  c->impl = m;
  c->ops = &mpi_ops;
  /* Log lines carry the world rank, which is what people grep for. */
  int world_rank = -1;
  if (ofl_log_get_rank() < 0 &&
      MPI_Comm_rank(MPI_COMM_WORLD, &world_rank) == MPI_SUCCESS)
    ofl_log_set_rank(world_rank);
  OFL_INFO(OFL_SUBSYS_COLL, "mpi comm: rank %d of %d, timeout %lld ms", c->rank,
           c->size, (long long)c->timeout_ms);
  *out = c;
  return OFL_SUCCESS;
}

#else
typedef int ofl__comm_mpi_not_built; /* ISO C wants a non-empty unit */
#endif /* OFL_HAVE_MPI */
