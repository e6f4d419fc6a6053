/* cudasim: the NCCL half of the strict CPU stand-in (libnccl.so.2), over the
 * stand-in's libcudart (tests/cudasim/cudasim.h is the contract).
 *
 * Model
 * - A ncclUniqueId names a POSIX shared-memory object ("/cudasim-nccl-<hex>").
 *   Every rank (a process of an mpirun job, or a thread of one process) maps
 *   it (one mapping per process, shared by its ranks), claims its rank and
 *   counts itself in; the rank that completes the count unlinks the name, so
 *   nothing stays in /dev/shm once every rank joined, even if a rank crashes
 *   later. A blocking init waits (forever, like NCCL) for every rank, polling
 *   the abort flag that ncclCommAbort from another thread sets (*comm is
 *   written before the wait). A nonblocking init (config->blocking == 0)
 *   answers ncclInProgress; ncclCommGetAsyncError says ncclInProgress until
 *   every rank joined, then ncclSuccess. Attribute queries and collectives on
 *   a communicator that is not ready are ncclInvalidArgument, as in NCCL.
 * - Each rank numbers its collectives (1, 2, ...) in call order. A
 *   collective is an operation on the caller's CUDA stream (cudasim__enqueue);
 *   when the stream reaches it, it waits until its own previous collective
 *   finished and every rank finished reading the slot it is about to reuse
 *   (two slots per rank), copies its send buffer (device memory of the
 *   communicator's device, read through cudasim__shadow) into its slot,
 *   publishes the sequence number, waits until every rank published it,
 *   checks that they all called the same collective with the same count,
 *   type, op and root, computes the result into recvbuff, and marks the slot
 *   read. A rank that never calls leaves the others' stream operations
 *   waiting forever (cudaStreamQuery/cudaEventQuery answer NotReady), as NCCL
 *   does; ncclCommAbort ends them.
 * - Collectives are enqueued when called, also between ncclGroupStart and
 *   ncclGroupEnd (the group only changes what nonblocking communicators
 *   answer). On a nonblocking communicator a collective answers
 *   ncclInProgress (ncclSuccess inside a group; ncclGroupEnd then answers
 *   ncclInProgress) and is put on the stream only at the next
 *   ncclCommGetAsyncError (or Finalize/Destroy) of that communicator, which
 *   then answers ncclSuccess: a caller that records an event before NCCL said
 *   ncclSuccess records it before the collective, and sees wrong data.
 * - ncclCommAbort returns at once: it sets the abort flag of the
 *   communicator's queued and running operations (cudasim__abort_ops); they
 *   return without writing recvbuff and without a CUDA error (an aborted NCCL
 *   kernel leaves no CUDA error either). It also marks the shared object
 *   aborted: the peers' operations that are (or start) waiting end with
 *   ncclRemoteError as their communicator's asynchronous error (a network
 *   transport sees the connection close), CUDASIM_NCCL_REMOTE_MS (default
 *   500) after the abort. The aborted handle stays valid in
 *   the stand-in: ncclCommGetAsyncError answers ncclSystemError in
 *   *asyncError and every other call ncclInvalidArgument. Using a handle
 *   after ncclCommDestroy (a use after free with NCCL), and destroying or
 *   aborting a handle already destroyed or aborted (a double free), are
 *   misuse.
 * - Errors found while an operation runs (different collectives or counts on
 *   different ranks: ncclInvalidUsage; an aborted peer: ncclRemoteError)
 *   become the communicator's asynchronous error and a message on stderr
 *   (ncclGetLastError). A count * type size beyond a slot
 *   (CUDASIM_NCCL_SLOT_BYTES, default 4 MiB per rank) is ncclInvalidUsage at
 *   the call, with a message on stderr.
 * - Every call goes through cudasim__enter first (error injection, no NCCL
 *   call inside a host function: ncclInvalidUsage there, and
 *   ncclUnhandledCudaError for an injected error), except ncclGetErrorString
 *   and ncclGetLastError, which cannot fail.
 * - CUDASIM_NCCL_LAZY_CONNECT=1 models NCCL 2.22+'s lazy connection
 *   (NCCL_RUNTIME_CONNECT): a blocking communicator's first collective
 *   called outside a group waits in the call until every rank has called
 *   its first one (or the communicator is aborted). A rank still waiting
 *   after CUDASIM_NCCL_CONNECT_MS (default 10000) is reported as misuse
 *   instead of hanging as NCCL would.
 * Not modelled: ncclCommSplit/Shrink, ncclReduce, ReduceScatter, AlltoAll,
 * Send/Recv, user buffer registration, fp16/bf16/fp8 reductions (gather and
 * broadcast move any type), NCCL_* environment variables. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <nccl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tests/cudasim/cudasim.h"

#define API __attribute__((visibility("default")))

#define MAX_RANKS 64
#define NSLOT 2
#define ID_MAGIC "cudasim-nccl-id1"
#define SHM_MAGIC 0x63756461736e636cull /* "cudasncl" */
#define DEFAULT_SLOT_BYTES ((uint64_t)4 << 20)

/* ---- the shared object ----------------------------------------------------
 * All fields start as zero (a fresh shm object is zero-filled), so whichever
 * rank arrives first needs no initialisation step: values are claimed with
 * compare-and-swap. */
typedef struct {
  _Atomic uint64_t posted;   /* last sequence number deposited */
  _Atomic uint64_t consumed; /* last sequence number fully read */
  char pad[48];
} rank_state_t;

typedef struct {
  uint32_t kind, dtype, op, root;
  uint64_t count, bytes, seq;
} slot_meta_t;

#define META_BYTES 64 /* slot_meta_t padded: data stays 64-byte aligned */

typedef struct {
  _Atomic uint64_t magic;
  _Atomic uint32_t nranks;
  _Atomic uint32_t joined;
  _Atomic uint32_t connected; /* ranks that made their first collective */
  _Atomic uint32_t aborted_by; /* rank + 1 of the first rank that aborted */
  _Atomic uint32_t failed;     /* a rank gave up before every rank joined */
  _Atomic uint64_t aborted_ns; /* CLOCK_MONOTONIC of that abort */
  _Atomic uint64_t slot_bytes;
  _Atomic uint32_t taken[MAX_RANKS];
  rank_state_t rs[MAX_RANKS];
  /* then nranks * NSLOT slots of META_BYTES + slot_bytes */
} shm_hdr_t;

static size_t hdr_bytes(void) { return (sizeof(shm_hdr_t) + 63) & ~(size_t)63; }

/* One mapping per process and name, shared by the process's ranks (so that
 * ThreadSanitizer sees the same addresses on both sides of an atomic). */
typedef struct mapping {
  struct mapping *next;
  char name[64];
  shm_hdr_t *hdr;
  size_t size;
  int refs;
} mapping_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static mapping_t *g_maps;

/* ---- communicators -------------------------------------------------------- */
enum { K_ALLGATHER = 1, K_ALLREDUCE = 2, K_BROADCAST = 3 };
static const char *kind_name(uint32_t k) {
  return k == K_ALLGATHER   ? "ncclAllGather"
         : k == K_ALLREDUCE ? "ncclAllReduce"
         : k == K_BROADCAST ? "ncclBroadcast"
                            : "?";
}

typedef struct op {
  struct op *next;
  struct ncclComm *comm;
  _Atomic int done;
  int pending; /* nonblocking: not yet on its stream */
  cudaStream_t stream;
  uint32_t kind, dtype, redop, root;
  uint64_t count, bytes, seq;
  const void *send;
  void *recv;
} op_t;

enum { ST_LIVE = 0, ST_ABORTED = 1, ST_DESTROYED = 2 };

struct ncclComm {
  uint64_t magic;
  struct ncclComm *all_next; /* every handle ever made: tombstones stay */
  _Atomic int state;
  _Atomic int aborted; /* set by ncclCommAbort: the ops' own flag */
  _Atomic int ready;   /* every rank joined */
  _Atomic int async;   /* the asynchronous error (ncclSuccess, or sticky) */
  _Atomic int refs;    /* the user's + one per operation not yet finished */
  int blocking, finalized;
  int connected; /* this rank made its first collective (lazy connection) */
  int nranks, rank, device;
  char name[64];
  mapping_t *map;
  pthread_mutex_t mu; /* ops list, seq */
  op_t *ops;          /* operations not yet swept (done or not) */
  uint64_t next_seq;
};
#define COMM_MAGIC 0x636f6d6d6e63636cull

static struct ncclComm *g_comms; /* under g_lock */

/* ---- messages --------------------------------------------------------------
 */
static char g_last[512];
static pthread_mutex_t g_last_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local char t_last[512];

__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  fprintf(stderr, "cudasim nccl: %s\n", buf);
  pthread_mutex_lock(&g_last_lock);
  memcpy(g_last, buf, sizeof(g_last));
  pthread_mutex_unlock(&g_last_lock);
}

/* CUDASIM_NCCL_TRACE=1: one stderr line per collective step. */
static int trace_on(void) {
  static _Atomic int on = -1;
  int v = atomic_load(&on);
  if (v < 0) {
    const char *e = getenv("CUDASIM_NCCL_TRACE");
    v = e != NULL && *e != 0 && *e != '0';
    atomic_store(&on, v);
  }
  return v;
}
#define TRACE(...)                                                             \
  do {                                                                         \
    if (trace_on())                                                            \
      fprintf(stderr, "cudasim nccl trace: " __VA_ARGS__);                     \
  } while (0)

static ncclResult_t enter(const char *api) {
  if (cudasim__enter(api) != 0)
    return cudasim_in_host_fn() ? ncclInvalidUsage : ncclUnhandledCudaError;
  return ncclSuccess;
}
#define ENTER(api)                                                             \
  do {                                                                         \
    ncclResult_t e_ = enter(api);                                              \
    if (e_ != ncclSuccess)                                                     \
      return e_;                                                               \
  } while (0)

static void set_async(struct ncclComm *c, ncclResult_t r) {
  int expect = ncclSuccess;
  atomic_compare_exchange_strong(&c->async, &expect, (int)r);
}

static size_t type_size(int t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
  case ncclFloat8e4m3:
  case ncclFloat8e5m2:
    return 1;
  case ncclFloat16:
  case ncclBfloat16:
    return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    return 0;
  }
}

static uint64_t slot_bytes_env(void) {
  const char *s = getenv("CUDASIM_NCCL_SLOT_BYTES");
  if (s == NULL || *s == 0)
    return DEFAULT_SLOT_BYTES;
  char *end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  if (end && (*end == 'K' || *end == 'k'))
    v <<= 10;
  else if (end && (*end == 'M' || *end == 'm'))
    v <<= 20;
  else if (end && (*end == 'G' || *end == 'g'))
    v <<= 30;
  if (v < 4096)
    v = 4096;
  return (v + 63) & ~63ull;
}

static void pause_round(unsigned *round) {
  unsigned r = (*round)++;
  if (r < 64) {
    sched_yield();
    return;
  }
  long us = r < 200 ? 20 : r < 1000 ? 100 : 500;
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

/* ---- mappings ----------------------------------------------------------- */
static size_t map_size(int nranks, uint64_t slot) {
  return hdr_bytes() + (size_t)nranks * NSLOT * (META_BYTES + (size_t)slot);
}

/* Maps (creating if needed) the object `name` for nranks; NULL on failure
 * (message said). */
static mapping_t *map_get(const char *name, int nranks, ncclResult_t *err) {
  uint64_t slot = slot_bytes_env();
  size_t size = map_size(nranks, slot);
  pthread_mutex_lock(&g_lock);
  for (mapping_t *m = g_maps; m; m = m->next)
    if (strcmp(m->name, name) == 0) {
      if (m->size != size) {
        pthread_mutex_unlock(&g_lock);
        say("ncclCommInitRank: nranks %d differs from another rank's", nranks);
        *err = ncclInvalidArgument;
        return NULL;
      }
      m->refs++;
      pthread_mutex_unlock(&g_lock);
      return m;
    }
  mapping_t *m = calloc(1, sizeof(*m));
  int fd = -1;
  void *p = MAP_FAILED;
  if (m == NULL)
    goto fail;
  fd = shm_open(name, O_CREAT | O_RDWR, 0600);
  if (fd < 0) {
    say("shm_open(%s): %s", name, strerror(errno));
    goto fail;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    say("fstat(%s): %s", name, strerror(errno));
    goto fail;
  }
  if ((size_t)st.st_size != size) {
    if (st.st_size != 0) {
      say("ncclCommInitRank: the ranks of %s disagree on nranks (or "
          "CUDASIM_NCCL_SLOT_BYTES)",
          name);
      *err = ncclInvalidArgument;
      close(fd);
      free(m);
      pthread_mutex_unlock(&g_lock);
      return NULL;
    }
    if (ftruncate(fd, (off_t)size) != 0) {
      say("ftruncate(%s): %s", name, strerror(errno));
      goto fail;
    }
  }
  p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    say("mmap(%s): %s", name, strerror(errno));
    goto fail;
  }
  close(fd);
  snprintf(m->name, sizeof(m->name), "%s", name);
  m->hdr = p;
  m->size = size;
  m->refs = 1;
  m->next = g_maps;
  g_maps = m;
  pthread_mutex_unlock(&g_lock);
  /* whoever comes first stamps the header; the others check it */
  uint64_t zero = 0;
  if (!atomic_compare_exchange_strong(&m->hdr->slot_bytes, &zero, slot) &&
      zero != slot) {
    say("ncclCommInitRank: ranks disagree on CUDASIM_NCCL_SLOT_BYTES");
    *err = ncclInvalidArgument;
    return NULL; /* mapping stays registered; released with the comm */
  }
  atomic_store(&m->hdr->magic, SHM_MAGIC);
  return m;
fail:
  if (fd >= 0)
    close(fd);
  free(m);
  pthread_mutex_unlock(&g_lock);
  *err = ncclSystemError;
  return NULL;
}

static void map_put(mapping_t *m) {
  if (m == NULL)
    return;
  pthread_mutex_lock(&g_lock);
  if (--m->refs > 0) {
    pthread_mutex_unlock(&g_lock);
    return;
  }
  for (mapping_t **pp = &g_maps; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      break;
    }
  pthread_mutex_unlock(&g_lock);
  munmap(m->hdr, m->size);
  free(m);
}

static slot_meta_t *slot_meta(struct ncclComm *c, int rank, uint64_t seq) {
  uint64_t sb = atomic_load(&c->map->hdr->slot_bytes);
  size_t i = (size_t)rank * NSLOT + (size_t)(seq % NSLOT);
  return (slot_meta_t *)((char *)c->map->hdr + hdr_bytes() +
                         i * (META_BYTES + (size_t)sb));
}
static unsigned char *slot_data(struct ncclComm *c, int rank, uint64_t seq) {
  return (unsigned char *)slot_meta(c, rank, seq) + META_BYTES;
}

/* ---- handles ---------------------------------------------------------------
 */
static void comm_unref(struct ncclComm *c) {
  if (atomic_fetch_sub(&c->refs, 1) != 1)
    return;
  /* the last reference: the user's is gone and every op finished */
  pthread_mutex_lock(&c->mu);
  op_t *o = c->ops;
  c->ops = NULL;
  pthread_mutex_unlock(&c->mu);
  while (o) {
    op_t *n = o->next;
    free(o);
    o = n;
  }
  mapping_t *m = c->map;
  c->map = NULL;
  map_put(m);
}

/* 1 when c is a handle made here (tombstones included). */
static int comm_known(const struct ncclComm *c) {
  int known = 0;
  pthread_mutex_lock(&g_lock);
  for (struct ncclComm *k = g_comms; k; k = k->all_next)
    if (k == c) {
      known = 1;
      break;
    }
  pthread_mutex_unlock(&g_lock);
  return known && c->magic == COMM_MAGIC;
}

/* Checks a handle: 0 when usable; else the error to return. live_only: also
 * refuse aborted handles. */
static ncclResult_t check_comm(struct ncclComm *c, const char *api) {
  if (c == NULL) {
    say("%s: comm is NULL", api);
    return ncclInvalidArgument;
  }
  if (!comm_known(c)) {
    cudasim__misuse("%s: %p is not a communicator made by ncclCommInit*", api,
                    (void *)c);
    return ncclInvalidArgument;
  }
  int st = atomic_load(&c->state);
  if (st == ST_DESTROYED) {
    cudasim__misuse("%s: the communicator (rank %d) was destroyed (a use "
                    "after free with NCCL)",
                    api, c->rank);
    return ncclInvalidArgument;
  }
  if (st == ST_ABORTED) {
    if (strcmp(api, "ncclCommDestroy") == 0 ||
        strcmp(api, "ncclCommAbort") == 0) {
      cudasim__misuse("%s: the communicator (rank %d) was already aborted, "
                      "which freed it (a double free with NCCL)",
                      api, c->rank);
      return ncclInvalidArgument;
    }
    say("%s: the communicator (rank %d) was aborted", api, c->rank);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

static int joined_all(struct ncclComm *c) {
  if (atomic_load(&c->ready))
    return 1;
  if (c->map &&
      atomic_load(&c->map->hdr->joined) >= (uint32_t)c->nranks) {
    atomic_store(&c->ready, 1);
    return 1;
  }
  return 0;
}

/* NCCL's ncclCommEnsureReady: a communicator still initialising (or with
 * collectives not yet launched) cannot be used. */
static ncclResult_t ensure_ready(struct ncclComm *c, const char *api) {
  int a = atomic_load(&c->async);
  if (a != ncclSuccess && a != ncclInProgress)
    return (ncclResult_t)a;
  if (!joined_all(c)) {
    say("%s: the communicator (rank %d) is still initialising: wait until "
        "ncclCommGetAsyncError answers ncclSuccess",
        api, c->rank);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

static int random_hex(char *out, size_t nbytes) {
  unsigned char b[32];
  if (nbytes > sizeof(b))
    nbytes = sizeof(b);
  size_t got = 0;
  while (got < nbytes) {
    ssize_t r = getrandom(b + got, nbytes - got, 0);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    got += (size_t)r;
  }
  for (size_t i = 0; i < nbytes; i++)
    sprintf(out + 2 * i, "%02x", b[i]);
  return 0;
}

API ncclResult_t ncclGetVersion(int *version) {
  ENTER("ncclGetVersion");
  if (version == NULL)
    return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

API ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  ENTER("ncclGetUniqueId");
  if (uniqueId == NULL) {
    say("ncclGetUniqueId: uniqueId is NULL");
    return ncclInvalidArgument;
  }
  memset(uniqueId, 0, sizeof(*uniqueId));
  char hex[65];
  if (random_hex(hex, 16) != 0) {
    say("ncclGetUniqueId: getrandom: %s", strerror(errno));
    return ncclSystemError;
  }
  memcpy(uniqueId->internal, ID_MAGIC, sizeof(ID_MAGIC) - 1);
  snprintf(uniqueId->internal + 16, sizeof(uniqueId->internal) - 16,
           "/cudasim-nccl-%s", hex);
  return ncclSuccess;
}

/* Gives the handle's shm object up before every rank joined: the name goes
 * too (the job cannot complete any more). */
static void give_up_join(struct ncclComm *c) {
  if (c->map && !joined_all(c)) {
    atomic_store(&c->map->hdr->failed, 1);
    shm_unlink(c->name);
  }
}

/* Creates the handle and joins; blocking: waits for every rank. */
static ncclResult_t comm_init(ncclComm_t *out, int nranks,
                              const ncclUniqueId *id, int rank, int device,
                              int blocking, int wait, const char *api) {
  if (out == NULL) {
    say("%s: comm is NULL", api);
    return ncclInvalidArgument;
  }
  *out = NULL;
  if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) {
    say("%s: rank %d of %d is invalid (the stand-in allows up to %d ranks)",
        api, rank, nranks, MAX_RANKS);
    return ncclInvalidArgument;
  }
  if (memcmp(id->internal, ID_MAGIC, sizeof(ID_MAGIC) - 1) != 0 ||
      strncmp(id->internal + 16, "/cudasim-nccl-", 14) != 0) {
    say("%s: the unique id was not made by ncclGetUniqueId", api);
    return ncclInvalidArgument;
  }
  struct ncclComm *c = calloc(1, sizeof(*c));
  if (c == NULL)
    return ncclSystemError;
  c->magic = COMM_MAGIC;
  c->nranks = nranks;
  c->rank = rank;
  c->device = device;
  c->blocking = blocking;
  atomic_init(&c->refs, 1);
  atomic_init(&c->async, ncclSuccess);
  pthread_mutex_init(&c->mu, NULL);
  snprintf(c->name, sizeof(c->name), "%.63s", id->internal + 16);
  ncclResult_t err = ncclSystemError;
  c->map = map_get(c->name, nranks, &err);
  if (c->map == NULL) {
    free(c);
    return err;
  }
  shm_hdr_t *h = c->map->hdr;
  uint32_t zero = 0;
  if (!atomic_compare_exchange_strong(&h->nranks, &zero, (uint32_t)nranks) &&
      zero != (uint32_t)nranks) {
    say("%s: rank %d says %d ranks, another rank said %u", api, rank, nranks,
        zero);
    map_put(c->map);
    free(c);
    return ncclInvalidArgument;
  }
  uint32_t none = 0;
  if (!atomic_compare_exchange_strong(&h->taken[rank], &none, 1)) {
    say("%s: rank %d of this unique id joined twice", api, rank);
    map_put(c->map);
    free(c);
    return ncclInvalidUsage;
  }
  pthread_mutex_lock(&g_lock);
  c->all_next = g_comms;
  g_comms = c;
  pthread_mutex_unlock(&g_lock);
  *out = c;
  if (atomic_fetch_add(&h->joined, 1) + 1 == (uint32_t)nranks)
    shm_unlink(c->name); /* everyone has it mapped: the name can go */
  if (!blocking)
    return ncclInProgress;
  if (!wait)
    return ncclSuccess;
  unsigned round = 0;
  while (!joined_all(c)) {
    if (atomic_load(&c->aborted)) {
      say("%s: rank %d: aborted while waiting for the other ranks", api,
          rank);
      return ncclInvalidUsage; /* handle already aborted */
    }
    if (atomic_load(&h->aborted_by) || atomic_load(&h->failed)) {
      say("%s: rank %d: another rank gave up before every rank joined", api,
          rank);
      set_async(c, ncclRemoteError);
      return ncclRemoteError;
    }
    pause_round(&round);
    if (round > 2000)
      round = 1000;
  }
  return ncclSuccess;
}

API ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks,
                                  ncclUniqueId commId, int rank) {
  ENTER("ncclCommInitRank");
  return comm_init(comm, nranks, &commId, rank, cudasim__stream_device(NULL),
                   1, 1, "ncclCommInitRank");
}

API ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks,
                                        ncclUniqueId commId, int rank,
                                        ncclConfig_t *config) {
  ENTER("ncclCommInitRankConfig");
  int blocking = 1;
  if (config != NULL) {
    if (config->magic != 0xcafebeef || config->size < offsetof(ncclConfig_t, cgaClusterSize)) {
      say("ncclCommInitRankConfig: config was not initialised with "
          "NCCL_CONFIG_INITIALIZER");
      return ncclInvalidArgument;
    }
    if (config->blocking != NCCL_CONFIG_UNDEF_INT) {
      if (config->blocking != 0 && config->blocking != 1) {
        say("ncclCommInitRankConfig: blocking must be 0 or 1, not %d",
            config->blocking);
        return ncclInvalidArgument;
      }
      blocking = config->blocking;
    }
  }
  return comm_init(comm, nranks, &commId, rank, cudasim__stream_device(NULL),
                   blocking, 1, "ncclCommInitRankConfig");
}

API ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev,
                                 const int *devlist) {
  ENTER("ncclCommInitAll");
  if (comms == NULL || ndev < 1) {
    say("ncclCommInitAll: comms is NULL or ndev %d < 1", ndev);
    return ncclInvalidArgument;
  }
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  char hex[65];
  if (random_hex(hex, 16) != 0)
    return ncclSystemError;
  memcpy(id.internal, ID_MAGIC, sizeof(ID_MAGIC) - 1);
  snprintf(id.internal + 16, sizeof(id.internal) - 16, "/cudasim-nccl-%s", hex);
  for (int i = 0; i < ndev; i++) {
    int dev = devlist ? devlist[i] : i;
    ncclResult_t r = comm_init(&comms[i], ndev, &id, i, dev, 1, 0,
                               "ncclCommInitAll");
    if (r != ncclSuccess) {
      for (int k = 0; k < i; k++) {
        give_up_join(comms[k]);
        atomic_store(&comms[k]->state, ST_DESTROYED);
        comm_unref(comms[k]);
      }
      return r;
    }
  }
  return ncclSuccess;
}

/* ---- operations ------------------------------------------------------------
 */
#define RED_LOOP(T)                                                            \
  do {                                                                         \
    T *d = (T *)dst;                                                           \
    const T *s = (const T *)src;                                               \
    for (uint64_t i = 0; i < n; i++)                                           \
      switch (op) {                                                            \
      case ncclSum:                                                            \
      case ncclAvg:                                                            \
        d[i] = (T)(d[i] + s[i]);                                               \
        break;                                                                 \
      case ncclProd:                                                           \
        d[i] = (T)(d[i] * s[i]);                                               \
        break;                                                                 \
      case ncclMax:                                                            \
        d[i] = s[i] > d[i] ? s[i] : d[i];                                      \
        break;                                                                 \
      default:                                                                 \
        d[i] = s[i] < d[i] ? s[i] : d[i];                                      \
        break;                                                                 \
      }                                                                        \
  } while (0)

static void reduce_into(void *dst, const void *src, uint64_t n, int type,
                        int op) {
  switch (type) {
  case ncclInt8:
    RED_LOOP(int8_t);
    break;
  case ncclUint8:
    RED_LOOP(uint8_t);
    break;
  case ncclInt32:
    RED_LOOP(int32_t);
    break;
  case ncclUint32:
    RED_LOOP(uint32_t);
    break;
  case ncclInt64:
    RED_LOOP(int64_t);
    break;
  case ncclUint64:
    RED_LOOP(uint64_t);
    break;
  case ncclFloat32:
    RED_LOOP(float);
    break;
  case ncclFloat64:
    RED_LOOP(double);
    break;
  default:
    break;
  }
}

#define AVG_LOOP(T)                                                            \
  do {                                                                         \
    T *d = (T *)dst;                                                           \
    for (uint64_t i = 0; i < n; i++)                                           \
      d[i] = (T)(d[i] / (T)nranks);                                            \
  } while (0)
static void average(void *dst, uint64_t n, int type, int nranks) {
  switch (type) {
  case ncclInt8:
    AVG_LOOP(int8_t);
    break;
  case ncclUint8:
    AVG_LOOP(uint8_t);
    break;
  case ncclInt32:
    AVG_LOOP(int32_t);
    break;
  case ncclUint32:
    AVG_LOOP(uint32_t);
    break;
  case ncclInt64:
    AVG_LOOP(int64_t);
    break;
  case ncclUint64:
    AVG_LOOP(uint64_t);
    break;
  case ncclFloat32:
    AVG_LOOP(float);
    break;
  case ncclFloat64:
    AVG_LOOP(double);
    break;
  default:
    break;
  }
}

/* Why an op must stop waiting: 0 none, else the async error. */
static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* How long after a peer's abort the others' waiting operations notice it
 * (a transport seeing its connection close): CUDASIM_NCCL_REMOTE_MS,
 * default 500 ms. */
static uint64_t remote_delay_ns(void) {
  static _Atomic int64_t v = -1;
  int64_t x = atomic_load(&v);
  if (x < 0) {
    const char *e = getenv("CUDASIM_NCCL_REMOTE_MS");
    x = e != NULL && *e != 0 ? (int64_t)strtoll(e, NULL, 10) : 500;
    if (x < 0)
      x = 0;
    atomic_store(&v, x);
  }
  return (uint64_t)x * 1000000ull;
}

static int64_t env_ms(const char *name, int64_t def) {
  const char *e = getenv(name);
  int64_t x = e != NULL && *e != 0 ? (int64_t)strtoll(e, NULL, 10) : def;
  return x < 0 ? 0 : x;
}

/* CUDASIM_NCCL_LAZY_CONNECT=1: a blocking communicator's first collective
 * outside a group waits in the call for every rank's first one, as NCCL
 * 2.22+ connects there; 0 when connected, else the error to return. */
static ncclResult_t lazy_connect(struct ncclComm *c, const char *api) {
  static _Atomic int on = -1;
  if (atomic_load(&on) < 0)
    atomic_store(&on, (int)env_ms("CUDASIM_NCCL_LAZY_CONNECT", 0) != 0);
  if (!atomic_load(&on) || !c->blocking || c->connected || c->map == NULL)
    return ncclSuccess;
  shm_hdr_t *h = c->map->hdr;
  atomic_fetch_add(&h->connected, 1);
  c->connected = 1;
  uint64_t limit = (uint64_t)env_ms("CUDASIM_NCCL_CONNECT_MS", 10000) *
                   1000000ull;
  uint64_t t0 = mono_ns();
  unsigned round = 0;
  while (atomic_load(&h->connected) < (uint32_t)c->nranks) {
    if (atomic_load(&c->aborted) || atomic_load(&h->aborted_by))
      return ncclRemoteError;
    if (mono_ns() - t0 > limit) {
      cudasim__misuse("%s: rank %d's first collective on a blocking "
                      "communicator waited %llu ms in the call for the other "
                      "ranks' first collectives (NCCL 2.22+ connects there: "
                      "a rank that calls it alone hangs)",
                      api, c->rank,
                      (unsigned long long)((mono_ns() - t0) / 1000000ull));
      return ncclInvalidUsage;
    }
    pause_round(&round);
    if (round > 2000)
      round = 1000;
  }
  return ncclSuccess;
}

static ncclResult_t op_stop(op_t *o, volatile int *abort) {
  struct ncclComm *c = o->comm;
  /* written by cudasim__abort_ops with an atomic store */
  if (__atomic_load_n(abort, __ATOMIC_ACQUIRE) || atomic_load(&c->aborted))
    return ncclSystemError;
  shm_hdr_t *h = c->map->hdr;
  uint32_t by = atomic_load(&h->aborted_by);
  if (by != 0 && by != (uint32_t)c->rank + 1 &&
      mono_ns() - atomic_load(&h->aborted_ns) >= remote_delay_ns())
    return ncclRemoteError;
  return ncclSuccess;
}

static int op_body(op_t *o, volatile int *abort) {
  struct ncclComm *c = o->comm;
  shm_hdr_t *h = c->map->hdr;
  int n = c->nranks, me = c->rank;
  uint64_t s = o->seq;
  unsigned round = 0;
  ncclResult_t stop = ncclSuccess;
  const char *what = kind_name(o->kind);
#define WAIT_UNTIL(cond)                                                       \
  do {                                                                         \
    round = 0;                                                                 \
    while (!(cond)) {                                                          \
      if ((stop = op_stop(o, abort)) != ncclSuccess)                           \
        goto stopped;                                                          \
      pause_round(&round);                                                     \
      if (round > 2000)                                                        \
        round = 1000;                                                          \
    }                                                                          \
  } while (0)
  TRACE("rank %d %s #%llu starts (%llu bytes)\n", me, what,
        (unsigned long long)s, (unsigned long long)o->bytes);
  if ((stop = op_stop(o, abort)) != ncclSuccess)
    goto stopped;
  /* own previous collective finished (operations on several streams) */
  WAIT_UNTIL(atomic_load_explicit(&h->rs[me].consumed, memory_order_acquire) ==
             s - 1);
  /* the slot's previous occupant (s - NSLOT) read by everyone */
  for (int q = 0; q < n; q++)
    WAIT_UNTIL(s <= NSLOT ||
               atomic_load_explicit(&h->rs[q].consumed,
                                    memory_order_acquire) >= s - NSLOT);
  /* deposit */
  slot_meta_t *mm = slot_meta(c, me, s);
  mm->kind = o->kind;
  mm->dtype = o->dtype;
  mm->op = o->redop;
  mm->root = o->root;
  mm->count = o->count;
  mm->bytes = o->bytes;
  mm->seq = s;
  int deposit = o->kind != K_BROADCAST || (int)o->root == me;
  if (deposit && o->bytes) {
    const void *src = cudasim__shadow(o->send, o->bytes, what);
    if (src == NULL) {
      mm->seq = 0; /* the peers see a mismatch, not stale bytes */
      set_async(c, ncclUnhandledCudaError);
      atomic_store_explicit(&h->rs[me].posted, s, memory_order_release);
      atomic_store_explicit(&h->rs[me].consumed, s, memory_order_release);
      return 700; /* cudaErrorIllegalAddress */
    }
    memcpy(slot_data(c, me, s), src, o->bytes);
  }
  atomic_store_explicit(&h->rs[me].posted, s, memory_order_release);
  TRACE("rank %d %s #%llu posted\n", me, what, (unsigned long long)s);
  for (int q = 0; q < n; q++)
    WAIT_UNTIL(atomic_load_explicit(&h->rs[q].posted, memory_order_acquire) >=
               s);
  /* every rank called the same thing */
  for (int q = 0; q < n; q++) {
    const slot_meta_t *pm = slot_meta(c, q, s);
    if (pm->seq != s || pm->kind != o->kind || pm->dtype != o->dtype ||
        pm->count != o->count || pm->op != o->redop ||
        pm->root != o->root) {
      say("collective #%llu: rank %d called %s(count %llu, type %u, op %u, "
          "root %u) but rank %d called %s(count %llu, type %u, op %u, root "
          "%u)",
          (unsigned long long)s, me, what, (unsigned long long)o->count,
          o->dtype, o->redop, o->root, q, kind_name(pm->kind),
          (unsigned long long)pm->count, pm->dtype, pm->op, pm->root);
      set_async(c, ncclInvalidUsage);
      atomic_store_explicit(&h->rs[me].consumed, s, memory_order_release);
      return 0;
    }
  }
  size_t out_bytes = o->kind == K_ALLGATHER ? o->bytes * (size_t)n : o->bytes;
  if (out_bytes) {
    unsigned char *dst = cudasim__shadow(o->recv, out_bytes, what);
    if (dst == NULL) {
      set_async(c, ncclUnhandledCudaError);
      atomic_store_explicit(&h->rs[me].consumed, s, memory_order_release);
      return 700;
    }
    switch (o->kind) {
    case K_ALLGATHER:
      for (int q = 0; q < n; q++)
        memmove(dst + (size_t)q * o->bytes, slot_data(c, q, s), o->bytes);
      break;
    case K_BROADCAST:
      memmove(dst, slot_data(c, (int)o->root, s), o->bytes);
      break;
    case K_ALLREDUCE:
      /* rank order, the same on every rank: bit-identical results */
      memmove(dst, slot_data(c, 0, s), o->bytes);
      for (int q = 1; q < n; q++)
        reduce_into(dst, slot_data(c, q, s), o->count, (int)o->dtype,
                    (int)o->redop);
      if (o->redop == ncclAvg)
        average(dst, o->count, (int)o->dtype, n);
      break;
    }
  }
  atomic_store_explicit(&h->rs[me].consumed, s, memory_order_release);
  TRACE("rank %d %s #%llu done\n", me, what, (unsigned long long)s);
  return 0;
stopped:
  if (stop == ncclRemoteError)
    say("%s #%llu on rank %d: rank %u aborted its communicator", what,
        (unsigned long long)s, me, atomic_load(&h->aborted_by) - 1);
  set_async(c, stop);
  return 0; /* NCCL's abort leaves no CUDA error on the stream */
#undef WAIT_UNTIL
}

static int op_run(void *arg, volatile int *abort) {
  op_t *o = arg;
  struct ncclComm *c = o->comm;
  int rc = op_body(o, abort);
  atomic_store_explicit(&o->done, 1, memory_order_release);
  /* o may be freed from here on */
  comm_unref(c);
  return rc;
}

/* Frees the finished operations (under c->mu). */
static void sweep(struct ncclComm *c) {
  for (op_t **pp = &c->ops; *pp;) {
    op_t *o = *pp;
    if (!o->pending && atomic_load_explicit(&o->done, memory_order_acquire)) {
      *pp = o->next;
      free(o);
    } else {
      pp = &o->next;
    }
  }
}

/* Puts the pending operations on their streams, oldest first (under
 * c->mu; the list is newest first). */
static ncclResult_t launch_pending(struct ncclComm *c) {
  size_t k = 0;
  for (op_t *o = c->ops; o; o = o->next)
    k += o->pending != 0;
  if (k == 0)
    return ncclSuccess;
  op_t **v = malloc(k * sizeof(*v));
  if (v == NULL)
    return ncclSystemError;
  size_t i = k;
  for (op_t *o = c->ops; o; o = o->next)
    if (o->pending)
      v[--i] = o;
  ncclResult_t res = ncclSuccess;
  for (i = 0; i < k; i++) {
    op_t *o = v[i];
    o->pending = 0;
    if (res == ncclSuccess) {
      atomic_fetch_add(&c->refs, 1);
      int e = cudasim__enqueue((void *)o->stream, op_run, o, kind_name(o->kind));
      if (e == 0)
        continue;
      atomic_fetch_sub(&c->refs, 1);
      say("%s: the stream refused the operation (CUDA error %d)",
          kind_name(o->kind), e);
      set_async(c, ncclUnhandledCudaError);
      res = ncclUnhandledCudaError;
    }
    atomic_store(&o->done, 1); /* never runs */
  }
  free(v);
  return res;
}

static _Thread_local int t_group_depth;
static _Thread_local int t_group_inprogress;

static ncclResult_t collective(uint32_t kind, const void *send, void *recv,
                               size_t count, ncclDataType_t type,
                               ncclRedOp_t redop, int root, ncclComm_t c,
                               cudaStream_t stream) {
  const char *api = kind_name(kind);
  ENTER(api);
  ncclResult_t r = check_comm(c, api);
  if (r != ncclSuccess)
    return r;
  if ((r = ensure_ready(c, api)) != ncclSuccess)
    return r;
  if (c->finalized) {
    say("%s: the communicator (rank %d) was finalized", api, c->rank);
    return ncclInvalidArgument;
  }
  if (atomic_load(&c->async) == ncclInProgress &&
      !(t_group_depth > 0 && t_group_inprogress)) {
    say("%s: rank %d's previous collective is still ncclInProgress: poll "
        "ncclCommGetAsyncError until ncclSuccess first",
        api, c->rank);
    return ncclInvalidArgument;
  }
  size_t ts = type_size((int)type);
  if (ts == 0) {
    say("%s: invalid datatype %d", api, (int)type);
    return ncclInvalidArgument;
  }
  if (kind == K_ALLREDUCE) {
    if ((int)redop < 0 || (int)redop >= ncclNumOps) {
      say("%s: reduction op %d is not modelled by the stand-in", api,
          (int)redop);
      return ncclInvalidArgument;
    }
    if (type == ncclFloat16 || type == ncclBfloat16 ||
        type == ncclFloat8e4m3 || type == ncclFloat8e5m2) {
      say("%s: reductions of datatype %d are not modelled by the stand-in",
          api, (int)type);
      return ncclInvalidArgument;
    }
  }
  if (kind == K_BROADCAST && (root < 0 || root >= c->nranks)) {
    say("%s: root %d out of range (%d ranks)", api, root, c->nranks);
    return ncclInvalidArgument;
  }
  if (count == 0)
    return ncclSuccess; /* NCCL launches nothing for an empty collective */
  if (t_group_depth == 0 && (r = lazy_connect(c, api)) != ncclSuccess)
    return r;
  uint64_t slot = atomic_load(&c->map->hdr->slot_bytes);
  if (count > slot / ts) {
    say("%s: %zu elements of %zu bytes exceed the stand-in's %llu bytes per "
        "rank (CUDASIM_NCCL_SLOT_BYTES)",
        api, count, ts, (unsigned long long)slot);
    return ncclInvalidUsage;
  }
  size_t bytes = count * ts;
  size_t out_bytes = kind == K_ALLGATHER ? bytes * (size_t)c->nranks : bytes;
  int sdev = cudasim__stream_device((void *)stream);
  if (sdev != c->device) {
    cudasim__misuse("%s: the stream belongs to device %d, the communicator "
                    "(rank %d) to device %d",
                    api, sdev, c->rank, c->device);
    return ncclInvalidArgument;
  }
  int need_send = kind != K_BROADCAST || root == c->rank;
  int dev = -1;
  if (need_send && (!cudasim_is_device_memory(send, &dev) || dev != c->device)) {
    cudasim__misuse("%s: sendbuff %p is not device memory of device %d "
                    "(rank %d's communicator)",
                    api, send, c->device, c->rank);
    return ncclInvalidArgument;
  }
  if (!cudasim_is_device_memory(recv, &dev) || dev != c->device) {
    cudasim__misuse("%s: recvbuff %p is not device memory of device %d "
                    "(rank %d's communicator)",
                    api, (void *)recv, c->device, c->rank);
    return ncclInvalidArgument;
  }
  if ((need_send && cudasim__shadow(send, bytes, api) == NULL) ||
      cudasim__shadow(recv, out_bytes, api) == NULL)
    return ncclInvalidArgument; /* misuse reported: range beyond the block */
  op_t *o = calloc(1, sizeof(*o));
  if (o == NULL)
    return ncclSystemError;
  o->comm = c;
  o->stream = stream;
  o->kind = kind;
  o->dtype = (uint32_t)type;
  o->redop = kind == K_ALLREDUCE ? (uint32_t)redop : 0;
  o->root = kind == K_BROADCAST ? (uint32_t)root : 0;
  o->count = count;
  o->bytes = bytes;
  o->send = need_send ? send : NULL;
  o->recv = recv;
  pthread_mutex_lock(&c->mu);
  sweep(c);
  o->seq = ++c->next_seq;
  TRACE("rank %d %s #%llu enqueued (%zu x type %d, stream %p)\n", c->rank,
        api, (unsigned long long)o->seq, count, (int)type, (void *)stream);
  o->next = c->ops;
  c->ops = o;
  if (!c->blocking) {
    o->pending = 1;
    atomic_store(&c->async, ncclInProgress);
    pthread_mutex_unlock(&c->mu);
    if (t_group_depth > 0) {
      t_group_inprogress = 1;
      return ncclSuccess;
    }
    return ncclInProgress;
  }
  atomic_fetch_add(&c->refs, 1);
  pthread_mutex_unlock(&c->mu);
  /* outside the lock: the operation may finish (and take it) at once */
  int e = cudasim__enqueue((void *)stream, op_run, o, api);
  if (e != 0) {
    atomic_fetch_sub(&c->refs, 1);
    atomic_store(&o->done, 1);
    say("%s: the stream refused the operation (CUDA error %d)", api, e);
    return ncclUnhandledCudaError;
  }
  return ncclSuccess;
}

API ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff,
                               size_t sendcount, ncclDataType_t datatype,
                               ncclComm_t comm, cudaStream_t stream) {
  return collective(K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype,
                    ncclSum, 0, comm, stream);
}

API ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff,
                               size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return collective(K_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, 0,
                    comm, stream);
}

API ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff,
                               size_t count, ncclDataType_t datatype, int root,
                               ncclComm_t comm, cudaStream_t stream) {
  return collective(K_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum,
                    root, comm, stream);
}

API ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return collective(K_BROADCAST, buff, buff, count, datatype, ncclSum, root,
                    comm, stream);
}

API ncclResult_t ncclGroupStart(void) {
  ENTER("ncclGroupStart");
  if (t_group_depth++ == 0)
    t_group_inprogress = 0;
  return ncclSuccess;
}

API ncclResult_t ncclGroupEnd(void) {
  ENTER("ncclGroupEnd");
  if (t_group_depth == 0) {
    say("ncclGroupEnd without ncclGroupStart");
    return ncclInvalidUsage;
  }
  if (--t_group_depth > 0)
    return ncclSuccess;
  int p = t_group_inprogress;
  t_group_inprogress = 0;
  return p ? ncclInProgress : ncclSuccess;
}

/* ---- queries --------------------------------------------------------------
 */
API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm,
                                       ncclResult_t *asyncError) {
  ENTER("ncclCommGetAsyncError");
  if (asyncError == NULL) {
    say("ncclCommGetAsyncError: asyncError is NULL");
    return ncclInvalidArgument;
  }
  if (comm_known(comm) && atomic_load(&comm->state) == ST_ABORTED) {
    int a = atomic_load(&comm->async);
    *asyncError = a != ncclSuccess && a != ncclInProgress ? (ncclResult_t)a
                                                          : ncclSystemError;
    return ncclSuccess;
  }
  ncclResult_t r = check_comm(comm, "ncclCommGetAsyncError");
  if (r != ncclSuccess)
    return r;
  int a = atomic_load(&comm->async);
  if (a != ncclSuccess && a != ncclInProgress) {
    *asyncError = (ncclResult_t)a;
    return ncclSuccess;
  }
  if (!joined_all(comm)) {
    if (comm->map && (atomic_load(&comm->map->hdr->aborted_by) ||
                      atomic_load(&comm->map->hdr->failed))) {
      set_async(comm, ncclRemoteError);
      *asyncError = ncclRemoteError;
    } else {
      *asyncError = ncclInProgress;
    }
    return ncclSuccess;
  }
  pthread_mutex_lock(&comm->mu);
  ncclResult_t lr = launch_pending(comm);
  int expect = ncclInProgress;
  if (lr == ncclSuccess)
    atomic_compare_exchange_strong(&comm->async, &expect, ncclSuccess);
  pthread_mutex_unlock(&comm->mu);
  *asyncError = (ncclResult_t)atomic_load(&comm->async);
  return ncclSuccess;
}

#define QUERY(fn, outp, value)                                                 \
  ENTER(#fn);                                                                  \
  ncclResult_t r = check_comm(comm, #fn);                                      \
  if (r != ncclSuccess)                                                        \
    return r;                                                                  \
  if ((r = ensure_ready(comm, #fn)) != ncclSuccess)                            \
    return r;                                                                  \
  if ((outp) == NULL) {                                                        \
    say(#fn ": output pointer is NULL");                                       \
    return ncclInvalidArgument;                                                \
  }                                                                            \
  *(outp) = (value);                                                           \
  return ncclSuccess

API ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  QUERY(ncclCommCount, count, comm->nranks);
}
API ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  QUERY(ncclCommCuDevice, device, comm->device);
}
API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  QUERY(ncclCommUserRank, rank, comm->rank);
}

/* ---- ending a communicator -------------------------------------------------
 */
/* Waits until every operation launched on c finished (blocking), polling
 * the abort flag. */
static void wait_ops(struct ncclComm *c) {
  unsigned round = 0;
  for (;;) {
    int busy = 0;
    pthread_mutex_lock(&c->mu);
    sweep(c);
    for (op_t *o = c->ops; o; o = o->next)
      busy |= !atomic_load(&o->done);
    pthread_mutex_unlock(&c->mu);
    if (!busy || atomic_load(&c->aborted))
      return;
    pause_round(&round);
    if (round > 2000)
      round = 1000;
  }
}

API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  ENTER("ncclCommFinalize");
  ncclResult_t r = check_comm(comm, "ncclCommFinalize");
  if (r != ncclSuccess)
    return r;
  if (joined_all(comm)) {
    pthread_mutex_lock(&comm->mu);
    launch_pending(comm);
    pthread_mutex_unlock(&comm->mu);
    int expect = ncclInProgress;
    atomic_compare_exchange_strong(&comm->async, &expect, ncclSuccess);
  }
  comm->finalized = 1;
  if (comm->blocking)
    wait_ops(comm);
  return comm->blocking ? ncclSuccess : ncclInProgress;
}

API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  ENTER("ncclCommDestroy");
  if (comm == NULL)
    return ncclSuccess; /* NCCL ignores a NULL communicator here */
  ncclResult_t r = check_comm(comm, "ncclCommDestroy");
  if (r != ncclSuccess)
    return r;
  if (!joined_all(comm)) {
    give_up_join(comm);
  } else {
    pthread_mutex_lock(&comm->mu);
    launch_pending(comm);
    pthread_mutex_unlock(&comm->mu);
    /* as NCCL: waits for the communicator's work (forever if a peer never
     * calls: ncclCommAbort is the way out of that) */
    wait_ops(comm);
  }
  int expect = ST_LIVE;
  if (!atomic_compare_exchange_strong(&comm->state, &expect, ST_DESTROYED)) {
    cudasim__misuse("ncclCommDestroy: the communicator (rank %d) was "
                    "destroyed or aborted concurrently",
                    comm->rank);
    return ncclInvalidArgument;
  }
  comm_unref(comm);
  return ncclSuccess;
}

API ncclResult_t ncclCommAbort(ncclComm_t comm) {
  ENTER("ncclCommAbort");
  if (comm == NULL)
    return ncclSuccess;
  ncclResult_t r = check_comm(comm, "ncclCommAbort");
  if (r != ncclSuccess)
    return r;
  int expect = ST_LIVE;
  if (!atomic_compare_exchange_strong(&comm->state, &expect, ST_ABORTED)) {
    cudasim__misuse("ncclCommAbort: the communicator (rank %d) was destroyed "
                    "or aborted concurrently",
                    comm->rank);
    return ncclInvalidArgument;
  }
  atomic_store(&comm->aborted, 1);
  set_async(comm, ncclSystemError);
  if (comm->map) {
    uint32_t zero = 0;
    uint64_t zns = 0; /* the first abort's time stays, set before the rank */
    atomic_compare_exchange_strong(&comm->map->hdr->aborted_ns, &zns,
                                   mono_ns());
    atomic_compare_exchange_strong(&comm->map->hdr->aborted_by, &zero,
                                   (uint32_t)comm->rank + 1);
    give_up_join(comm);
  }
  pthread_mutex_lock(&comm->mu);
  for (op_t **pp = &comm->ops; *pp;) {
    op_t *o = *pp;
    if (o->pending) { /* never launched: dropped */
      *pp = o->next;
      free(o);
      continue;
    }
    if (!atomic_load(&o->done))
      cudasim__abort_ops(o);
    pp = &o->next;
  }
  pthread_mutex_unlock(&comm->mu);
  comm_unref(comm); /* resources go when the last operation returns */
  return ncclSuccess;
}

/* ---- strings ---------------------------------------------------------------
 */
API const char *ncclGetErrorString(ncclResult_t result) {
  switch (result) {
  case ncclSuccess:
    return "no error";
  case ncclUnhandledCudaError:
    return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
  case ncclSystemError:
    return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
  case ncclInternalError:
    return "internal error - please report this issue to the NCCL developers";
  case ncclInvalidArgument:
    return "invalid argument (run with NCCL_DEBUG=WARN for details)";
  case ncclInvalidUsage:
    return "invalid usage (run with NCCL_DEBUG=WARN for details)";
  case ncclRemoteError:
    return "remote process exited or there was a network error";
  case ncclInProgress:
    return "NCCL operation in progress";
  default:
    return "unknown result code";
  }
}

API const char *ncclGetLastError(ncclComm_t comm) {
  (void)comm; /* NCCL keeps one last error per process */
  pthread_mutex_lock(&g_last_lock);
  memcpy(t_last, g_last, sizeof(t_last));
  pthread_mutex_unlock(&g_last_lock);
  return t_last;
}

/* ---- the profiling (pnccl) names -------------------------------------------
 */
#define ALIAS(name)                                                            \
  extern __typeof__(name) p##name                                              \
      __attribute__((alias(#name), visibility("default")))
ALIAS(ncclGetVersion);
ALIAS(ncclGetUniqueId);
ALIAS(ncclCommInitRank);
ALIAS(ncclCommInitRankConfig);
ALIAS(ncclCommInitAll);
ALIAS(ncclCommFinalize);
ALIAS(ncclCommDestroy);
ALIAS(ncclCommAbort);
ALIAS(ncclCommCount);
ALIAS(ncclCommCuDevice);
ALIAS(ncclCommUserRank);
ALIAS(ncclCommGetAsyncError);
ALIAS(ncclGetErrorString);
ALIAS(ncclGetLastError);
ALIAS(ncclAllGather);
ALIAS(ncclAllReduce);
ALIAS(ncclBroadcast);
ALIAS(ncclBcast);
ALIAS(ncclGroupStart);
ALIAS(ncclGroupEnd);
