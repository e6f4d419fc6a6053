/* ofl: async checkpoint staging (the AsyncStager / BlockingAsyncStager
 * contract of PyTorch distributed checkpointing) and the background
 * checkpoint writer.
 *
 * ofl_stager_stage() takes a set of named tensors (device or pinned host) and
 * returns a host copy that later updates of the source tensors cannot
 * change. The copies run on the stager's D2H stream, ordered after the work
 * queued so far on the caller's compute stream:
 *   - blocking staging (default): stage returns once the copy is complete;
 *     ofl_stager_should_synchronize_after_execute() is 0.
 *   - async staging: stage returns after queuing the copies; the caller
 *     must not modify or free the source tensors until
 *     ofl_stager_synchronize() returns (should_synchronize... is 1). A
 *     source whose storage is let go of by every other handle in that window
 *     (ofl_tensor_destroy, ofl_pool_free, ofl_tensor_release_storage) or
 *     reclaimed by ofl_pool_reset is reported by ofl_stager_synchronize
 *     (OFL_ERR_INVALID_USAGE naming the tensor), and a save of that set
 *     fails without writing a file. The stager keeps a reference on every
 *     source storage until the join, so freed memory is never read.
 * Tensors that share storage (views, aliases) are copied once, and their
 * staged copies share storage in the same way.
 *
 * With cache_staged the host copy is allocated once and reused by later
 * calls with the same layout (no allocation from the second call on); the
 * same ofl_staged_t is returned each time, its contents replaced. A later
 * call with a different layout is an error naming the tensor when
 * type_check is on, and otherwise rebuilds the cache.
 *
 * ofl_stager_save() writes a staged set as a .safetensors file on a
 * background thread (see ofl_safetensors_write in <ofl/safetensors.h>) and
 * returns a future. At most max_inflight_saves saves run at once per
 * stager; one more waits or is refused (when_busy).
 *
 * A save killed with its process leaves no name behind where the file
 * system has O_TMPFILE (ext4, xfs, btrfs, tmpfs): the file is written
 * unnamed in the target directory and linked in (linkat) once complete and
 * fsynced. Where it has not (NFS, most FUSE), a named temporary
 * ".NAME.tmp.XXXXXX" is written, flock'ed while the save lives, and
 * renamed; one left by a killed save is removed by the next save into that
 * directory (same NAME, or another "*.safetensors" name when older than the
 * process; never a temporary whose writer still holds its lock).
 *
 * A stager is not thread-safe: one thread calls stage, synchronize and save
 * (futures may be waited on from any thread). */
#ifndef OFL_STAGING_H
#define OFL_STAGING_H

#include <stddef.h>
#include <stdint.h>

#include <ofl/device.h>
#include <ofl/export.h>
#include <ofl/safetensors.h>
#include <ofl/status.h>
#include <ofl/tensor.h>

OFL_EXTERN_C_BEGIN

typedef struct ofl_stager ofl_stager_t;
typedef struct ofl_staged ofl_staged_t;
typedef struct ofl_save_future ofl_save_future_t;

/* One entry of a state dict: a unique name and a tensor with storage. */
typedef struct ofl_named_tensor {
  const char *name;
  const ofl_tensor_t *tensor;
} ofl_named_tensor_t;

typedef enum ofl_save_when_busy {
  OFL_SAVE_WHEN_BUSY_WAIT = 0, /* wait (bounded) for a running save to end */
  OFL_SAVE_WHEN_BUSY_ERROR = 1 /* refuse with OFL_ERR_INVALID_USAGE */
} ofl_save_when_busy_t;

typedef struct ofl_stager_params {
  int cache_staged;  /* keep the host copy between calls (reference:
                        cache_staged_state_dict) */
  int pin_memory;    /* page-locked host copy (ofl_pinned_malloc) */
  int type_check;    /* with cache_staged: a different name set, shape or
                        dtype is an error rather than a rebuild */
  int async_staging; /* stage returns after queuing the copies (on cuda only
                        with pin_memory: a copy into pageable memory is
                        synchronous there, which the stager warns about) */
  ofl_stream_t *stream; /* D2H stream for the copies; NULL: the stager
                           creates its own */
  int max_inflight_saves; /* 0: OFL_STAGING_MAX_INFLIGHT */
  ofl_save_when_busy_t when_busy;
} ofl_stager_params_t;

#define OFL_STAGER_PARAMS_INIT { 0, 1, 0, 0, NULL, 0, OFL_SAVE_WHEN_BUSY_WAIT }

typedef struct ofl_stager_stats {
  uint64_t stages;           /* successful ofl_stager_stage calls */
  uint64_t tensors_staged;
  uint64_t storages_copied;  /* one copy per distinct storage */
  uint64_t shared_tensors;   /* tensors whose storage was already copied */
  uint64_t bytes_copied;
  uint64_t buffer_allocs;    /* host copy buffers allocated */
  uint64_t buffer_bytes;     /* bytes of those buffers */
  uint64_t cache_reuses;     /* stages served by the cached copy */
  uint64_t cache_rebuilds;   /* cached copy replaced (layout changed) */
  uint64_t saves_started;
  uint64_t saves_completed;  /* finished without error */
  uint64_t saves_failed;
  uint64_t save_busy_waits;  /* saves that waited for a running one */
} ofl_stager_stats_t;

/* params NULL: OFL_STAGER_PARAMS_INIT. */
OFL_API ofl_status_t ofl_stager_create(ofl_device_t *dev,
                                       const ofl_stager_params_t *params,
                                       ofl_stager_t **out);
/* Joins a pending stage, waits (bounded by OFL_WAIT_TIMEOUT_MS) for the
 * saves in flight, and releases the cached copy. Staged sets the caller
 * still holds stay valid until released. OFL_ERR_TIMEOUT when saves did not
 * finish (they complete later; their futures stay valid). NULL accepted. */
OFL_API ofl_status_t ofl_stager_destroy(ofl_stager_t *stager);

/* Stages n named tensors (names unique, valid safetensors names; tensors
 * with storage on the device or in pinned memory). On success *out is a
 * set the caller releases with ofl_staged_release. On failure nothing was
 * queued and *out is unchanged. */
OFL_API ofl_status_t ofl_stager_stage(ofl_stager_t *stager,
                                      const ofl_named_tensor_t *tensors,
                                      size_t n, ofl_staged_t **out);
/* 1 when the caller must call ofl_stager_synchronize after stage (async
 * staging), 0 when stage is blocking. */
OFL_API int ofl_stager_should_synchronize_after_execute(
    const ofl_stager_t *stager);
/* Waits for the copies of the last stage (timeout_ms < 0: the default) and
 * returns its outcome. OFL_SUCCESS at once when nothing is pending. */
OFL_API ofl_status_t ofl_stager_synchronize(ofl_stager_t *stager,
                                            int64_t timeout_ms);
OFL_API void ofl_stager_get_stats(const ofl_stager_t *stager,
                                  ofl_stager_stats_t *out);

/* A staged set: host tensors (location OFL_LOC_PINNED, also when not
 * pinned) in the order they were given. Their data is complete once the
 * stage is joined. */
OFL_API size_t ofl_staged_count(const ofl_staged_t *set);
OFL_API const char *ofl_staged_name(const ofl_staged_t *set, size_t index);
OFL_API const ofl_tensor_t *ofl_staged_tensor(const ofl_staged_t *set,
                                              size_t index);
/* NULL when no tensor has that name. */
OFL_API const ofl_tensor_t *ofl_staged_find(const ofl_staged_t *set,
                                            const char *name);
/* OFL_SUCCESS when the set's copies are complete and valid; the staging
 * error otherwise (OFL_ERR_NOT_READY while pending). */
OFL_API ofl_status_t ofl_staged_status(const ofl_staged_t *set);
/* Drops the caller's reference; saves in flight keep theirs. NULL accepted. */
OFL_API void ofl_staged_release(ofl_staged_t *set);

/* Saves set (staged by this stager) to path as safetensors, on a background
 * thread, after its stage is complete. metadata (may be NULL) is copied; a
 * "format":"pt" pair is added when it has no "format" key (what Hugging
 * Face loaders expect). The set is kept alive until the save ends. */
OFL_API ofl_status_t ofl_stager_save(ofl_stager_t *stager, ofl_staged_t *set,
                                     const char *path,
                                     const ofl_safetensors_kv_t *metadata,
                                     size_t n_metadata,
                                     ofl_save_future_t **out);

/* The save's outcome once it ended; OFL_ERR_TIMEOUT (future unchanged)
 * when it did not end within timeout_ms (< 0: the default). On error the
 * calling thread's last error is the save's message. */
OFL_API ofl_status_t ofl_save_wait(ofl_save_future_t *future,
                                   int64_t timeout_ms);
/* OFL_ERR_NOT_READY while running, else the outcome. Does not block. */
OFL_API ofl_status_t ofl_save_query(ofl_save_future_t *future);
/* The save's error message ("" when none or still running). Valid until
 * the future is released. */
OFL_API const char *ofl_save_error(const ofl_save_future_t *future);
/* Bytes of the file written (0 until success). */
OFL_API uint64_t ofl_save_bytes(const ofl_save_future_t *future);
/* Drops the caller's handle; a running save continues. NULL accepted. */
OFL_API void ofl_save_release(ofl_save_future_t *future);

OFL_EXTERN_C_END

#endif /* OFL_STAGING_H */
