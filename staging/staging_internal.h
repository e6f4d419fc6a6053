/* ofl: staging/ internals shared by the safetensors writer, the reader, the
 * stager and the background saves. Not installed. */
#ifndef OFL_STAGING_INTERNAL_H
#define OFL_STAGING_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>
#include <time.h>

#include <ofl/safetensors.h>

#include "runtime/internal.h"

/* The write(2) the writer calls; tests swap it to inject faults (short
 * writes, ENOSPC, EIO). NULL restores the system call. Not thread-safe:
 * set it before starting saves. */
typedef ssize_t (*ofl__write_fn)(int fd, const void *buf, size_t bytes);
void ofl__safetensors_set_write_hook(ofl__write_fn fn);
/* Tests: ofl__no_tmpfile (disk/private_file.h, the one hook for staging/
 * and the disk store) makes the writer skip O_TMPFILE and take its fallback
 * (a named, locked temporary renamed into place). */
#include "disk/private_file.h"

/* Element size of a dtype (0 when invalid) and the bytes of a shape; the
 * staging code does not depend on pool/ for these. */
size_t ofl__st_elem_size(ofl_dtype_t dtype);
ofl_status_t ofl__st_shape_bytes(const int64_t *shape, int ndim,
                                 ofl_dtype_t dtype, size_t *out);

/* true when s[0..len) is valid UTF-8 without NUL bytes. */
bool ofl__utf8_valid(const char *s, size_t len);

/* Checks a tensor name for the format: non-empty, at most
 * OFL_SAFETENSORS_NAME_MAX bytes, valid UTF-8, not "__metadata__". Reports
 * the error (what names the caller: "stage", "write"). */
ofl_status_t ofl__safetensors_check_name(const char *name, const char *what);


/* ---- the stager (stager.c) and its saves (save.c) ------------------------ */

#include <pthread.h>
#include <stdatomic.h>

#include <ofl/staging.h>

/* One copy: a span of one source storage into the host buffer. */
typedef struct {
  const void *storage_id;
  const char *src;   /* lowest source address of the tensors in the group */
  size_t span_bytes; /* up to the highest end */
  size_t buf_off;    /* where the span lands in the host buffer */
  ofl_copy_kind_t kind;
} ofl__stage_group_t;

/* Where one tensor of a set lives. */
typedef struct {
  ofl_dtype_t dtype;
  int ndim;
  int64_t shape[OFL_MAX_DIMS];
  size_t group;
  size_t off_in_span;
  size_t bytes;
} ofl__stage_slot_t;

struct ofl_staged {
  ofl_device_t *dev;
  const ofl_stager_t *owner;
  atomic_int refs;   /* caller, the stager's cache or pending join, saves */
  size_t n, n_groups;
  char **names;      /* n copies */
  size_t *by_name;   /* indices sorted by name */
  ofl__stage_slot_t *slots;
  ofl__stage_group_t *groups;
  ofl_tensor_t **tensors; /* views into buf */
  void *buf;
  size_t buf_bytes;
  bool pinned;
  ofl_event_t *done;      /* recorded after the copies */
  /* Join state, under join_lock. */
  pthread_mutex_t join_lock;
  bool pending;           /* copies queued, not yet joined */
  uint64_t stage_gen;     /* bumped by every stage into the set */
  ofl_tensor_t **keep;    /* one alias per group: source storage held */
  const char **keep_name; /* a tensor name of each group, for messages */
  ofl_status_t status;
  char message[512];
  atomic_int saves;       /* saves in flight reading buf */
};

struct ofl_stager {
  ofl_device_t *dev;
  ofl_stager_params_t p;
  ofl_stream_t *stream;
  bool own_stream;
  ofl_event_t *compute_done;
  ofl_staged_t *cached;  /* cache_staged: the reused set (a reference) */
  ofl_staged_t *last;    /* the last stage, while not joined (a reference) */
  /* Scratch reused across calls so that a cached stage allocates nothing. */
  size_t *scratch;
  size_t scratch_cap;
  ofl__stage_slot_t *plan_slots;
  ofl__stage_group_t *plan_groups;
  size_t plan_cap;
  atomic_int refs;       /* the caller and every save in flight */
  pthread_mutex_t lock;  /* inflight, stats, save bookkeeping */
  pthread_cond_t cond;
  int inflight;
  int threads;           /* save threads not yet past their last release */
  int max_inflight;
  ofl_stager_stats_t stats;
};

/* Waits (bounded) for set's copies, checks its sources, drops the source
 * references; records and returns the outcome. Idempotent. */
ofl_status_t ofl__staged_join(ofl_staged_t *set, int64_t timeout_ms);
void ofl__staged_ref(ofl_staged_t *set);
void ofl__stager_ref(ofl_stager_t *s);
void ofl__stager_unref(ofl_stager_t *s);
/* Writes shape as "[a,b,c]" into out (cut to cap). */
void ofl__shape_str(const int64_t *shape, int ndim, char *out, size_t cap);
/* Frees s; for the holder of its last reference. */
void ofl__stager_free(ofl_stager_t *s);
/* Absolute CLOCK_MONOTONIC deadline timeout_ms from now (resolved). */
void ofl__deadline(int64_t timeout_ms, struct timespec *ts);

#endif /* OFL_STAGING_INTERNAL_H */
