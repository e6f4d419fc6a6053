/* ofl: the disk store, the tier below pinned host memory (docs/DESIGN.md
 * section 4). One private file per store (per manager, per rank) in
 * OFL_DISK_DIR: created 0600 with O_TMPFILE, or unlinked right after open,
 * so that nothing is left behind even when the process is killed. O_DIRECT
 * where the file system allows it, buffered I/O where not (the log says
 * which). I/O through io_uring (liburing) with a configurable queue depth
 * and block size, or through a small pread/pwrite thread pool.
 *
 * The unit is the extent: the bytes of one tensor, with a place in the file
 * and, while they are in host memory, a pinned 4 KiB-aligned bounce buffer
 * from a pinned pool. Life of an extent as the offload manager sees it:
 *
 *   offload   ofl_disk_extent_create(disk, bytes, &e)   file space + buffer
 *             D2H copy into ofl_disk_extent_data(e) on the D2H stream
 *             ofl_disk_extent_write_after(e, d2h)        write once the copy
 *                                                        is done; the buffer
 *                                                        is kept (below) or
 *                                                        returns to the pool
 *                                                        when the write is
 *   prefetch  ofl_disk_extent_prefetch(e)                read into a buffer,
 *                                                        in reload order
 *   reload    ofl_disk_extent_reload(e, timeout, &data)  waits (a stall) only
 *                                                        for bytes not there
 *             H2D copy from data on the H2D stream
 *             ofl_disk_extent_destroy_after(e, h2d)      space and buffer
 *                                                        back after the H2D
 *
 * Faults never lose data. A write that fails (ENOSPC, EIO, short write)
 * keeps the bytes in the bounce buffer: the extent is then HOST_ONLY, reload
 * returns the buffer, the fault is counted and logged, and the store is
 * marked degraded (new extents are refused until ofl_disk_clear_degraded).
 * A read that fails, or whose CRC32C does not match (OFL_DISK_CHECKSUM, on
 * by default), is an error returned by reload; the buffer is never handed
 * out then.
 *
 * Kept buffers (keep_bytes, OFL_DISK_KEEP): after a write the buffer, which
 * still holds the bytes, is kept up to that many bytes, newest first; a
 * prefetch or reload of such an extent takes it back without a read (the
 * backward pass reloads the newest offloads first). Kept buffers go back to
 * the pool, oldest first, whenever the store needs a buffer the pool
 * refuses, and all at once with ofl_disk_drop_kept.
 *
 * Reads are issued before queued writes. Destroying an extent whose write
 * has not started drops the write.
 *
 * Threads: calls on different extents may come from any thread; one extent
 * is driven by one thread at a time (the engine completes its I/O in the
 * background). Every wait has a timeout (OFL_TIMEOUT_DEFAULT: the default
 * OFL_WAIT_TIMEOUT_MS). */
#ifndef OFL_DISK_H
#define OFL_DISK_H

#include <stddef.h>
#include <stdint.h>

#include <ofl/device.h>
#include <ofl/export.h>
#include <ofl/pool.h>
#include <ofl/status.h>

OFL_EXTERN_C_BEGIN

typedef struct ofl_disk ofl_disk_t;
typedef struct ofl_disk_extent ofl_disk_extent_t;

/* Same order as the words of OFL_DISK_DIRECT (auto|on|off). */
typedef enum ofl_disk_direct {
  OFL_DISK_DIRECT_AUTO = 0, /* O_DIRECT when the file system takes it */
  OFL_DISK_DIRECT_ON = 1,   /* O_DIRECT or fail with OFL_ERR_NOT_SUPPORTED */
  OFL_DISK_DIRECT_OFF = 2,  /* buffered I/O */
  OFL_DISK_DIRECT_FROM_ENV = -1
} ofl_disk_direct_t;

typedef enum ofl_disk_engine {
  OFL_DISK_ENGINE_AUTO = 0,   /* io_uring for O_DIRECT when built and
                                 usable; threads for buffered I/O */
  OFL_DISK_ENGINE_URING = 1,  /* io_uring or fail with OFL_ERR_NOT_SUPPORTED */
  OFL_DISK_ENGINE_THREADS = 2 /* pread/pwrite worker threads */
} ofl_disk_engine_t;

/* Value of budget_bytes / block_bytes meaning "from the environment". */
#define OFL_DISK_FROM_ENV OFL__SIZE_C(-1)

typedef struct ofl_disk_params {
  ofl_device_t *dev;       /* required: bounce buffers are its pinned memory */
  ofl_pool_t *bounce_pool; /* pinned pool the bounce buffers come from; NULL:
                              the store makes its own (bounce_budget_bytes) */
  size_t bounce_budget_bytes; /* budget of the store's own pool; 0: none;
                                 OFL_DISK_FROM_ENV: OFL_DISK_BOUNCE_BUDGET */
  const char *dir;            /* NULL: OFL_DISK_DIR, else TMPDIR, else /tmp;
                                 a comma list (one directory per disk): the
                                 store takes entry local rank % count, the
                                 local rank from the launcher
                                 (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
                                 SLURM_LOCALID, LOCAL_RANK), else rank */
  size_t budget_bytes;  /* file size cap, rounded down to 4 KiB; extents
                           that would grow the file past it are refused
                           (OFL_ERR_NO_SPACE, budget_refusals);
                           OFL_DISK_FROM_ENV: OFL_DISK_BUDGET; 0 (also the
                           variable's default): no cap, the file grows
                           until the file system refuses (ENOSPC); 1 to
                           4095: OFL_ERR_CONFIG at open */
  size_t initial_bytes; /* preallocated at open (<= budget); 0: none */
  size_t grow_bytes;    /* the file grows by at least this; 0: 64 MiB */
  int preallocate;      /* 1: fallocate new space (ENOSPC shows at create);
                           0: sparse growth (ENOSPC shows at write);
                           -1: 1 */
  int queue_depth;      /* requests in flight; 0: OFL_DISK_QUEUE_DEPTH */
  size_t block_bytes;   /* request size; 0 or FROM_ENV: OFL_DISK_BLOCK;
                           rounded up to 4 KiB */
  int prefetch_groups;  /* read-ahead distance for the manager; -1: env */
  int checksum;         /* CRC32C per extent, taken at write and checked
                           at read (a mismatch is OFL_ERR_CORRUPT, never
                           data); -1: OFL_DISK_CHECKSUM (default on);
                           0: off, a write the file system acknowledged
                           and lost later reads back as wrong bytes */
  ofl_disk_direct_t direct;
  ofl_disk_engine_t engine;
  const char *groups; /* group names on disk (comma list, "*" all);
                         NULL: OFL_DISK_GROUPS */
  int rank;           /* for log lines; -1: unknown */
  size_t keep_bytes;  /* bounce buffers kept after their write, so that a
                         reload of a recent extent needs no read; given back
                         oldest first whenever the store needs a buffer.
                         OFL_DISK_FROM_ENV: OFL_DISK_KEEP (and 0 with an
                         external bounce_pool); capped at the bounce
                         budget; 0: none */
} ofl_disk_params_t;

#define OFL_DISK_PARAMS_INIT                                                   \
  {                                                                            \
    NULL, NULL, OFL_DISK_FROM_ENV, NULL, OFL_DISK_FROM_ENV, 0, 0, -1, 0, 0,    \
        -1, -1, OFL_DISK_DIRECT_FROM_ENV, OFL_DISK_ENGINE_AUTO, NULL, -1,      \
        OFL_DISK_FROM_ENV                                                      \
  }

typedef enum ofl_disk_extent_state {
  OFL_DISK_EXTENT_STAGED = 0, /* buffer filled by the caller, not written */
  OFL_DISK_EXTENT_WRITING,    /* write queued or in flight */
  OFL_DISK_EXTENT_ON_DISK,    /* in the file only */
  OFL_DISK_EXTENT_READING,    /* read queued or in flight */
  OFL_DISK_EXTENT_RESIDENT,   /* in the file and in the buffer (verified) */
  OFL_DISK_EXTENT_HOST_ONLY   /* write failed: the buffer is the only copy */
} ofl_disk_extent_state_t;

typedef struct ofl_disk_stats {
  uint64_t bytes_written;  /* payload bytes of completed writes */
  uint64_t bytes_read;     /* payload bytes of completed reads */
  double write_gbps;       /* bytes written / time with a write in flight */
  double read_gbps;        /* bytes read / time with a read in flight */
  uint64_t writes, reads;  /* extent operations completed (ok or not) */
  uint64_t writes_skipped; /* queued writes dropped: the extent was
                              destroyed before its write started */
  uint64_t bytes_skipped;  /* their payload bytes (written + skipped +
                              those of failed writes = all bytes given to
                              the store) */
  uint64_t requests;       /* I/O requests (blocks) completed */
  int queue_depth;         /* configured */
  int queue_depth_max;     /* requests in flight at once, high-water mark */
  uint64_t reloads;
  uint64_t prefetch_hits;   /* reloads that found the bytes in memory */
  uint64_t stalls;          /* reloads that had to wait for a read */
  uint64_t stall_ns;        /* time spent in those waits */
  uint64_t faults_enospc;   /* out of space, at growth or at write: ENOSPC,
                               EDQUOT and EFBIG (a file-size limit), every
                               fault whose status is OFL_ERR_NO_SPACE */
  uint64_t faults_eio;      /* other write or read errors from the kernel
                               (status OFL_ERR_IO) */
  uint64_t faults_short;    /* short writes or reads */
  uint64_t faults_corrupt;  /* CRC32C mismatches on read */
  uint64_t budget_refusals; /* creates refused by budget_bytes */
  uint64_t buffer_refusals; /* creates/prefetches refused: no bounce buffer */
  uint64_t keep_hits;       /* reloads/prefetches served by a kept buffer,
                               without a read */
  uint64_t keep_drops;      /* kept buffers given back unused (also at
                               destroy and close) */
  size_t keep_bytes;        /* configured cap */
  size_t kept_bytes;        /* bytes of kept buffers now */
  size_t file_bytes;        /* current file size */
  size_t budget_bytes;      /* 0: none */
  size_t extent_bytes;      /* file bytes held by live extents (4 KiB units) */
  size_t peak_extent_bytes;
  uint64_t extents; /* live extents */
  int direct;       /* 1: O_DIRECT, 0: buffered */
  int uring;        /* 1: io_uring, 0: threads */
  int checksum;
  int degraded;
} ofl_disk_stats_t;

/* Opens a store: creates and opens the private file, starts the engine.
 * OFL_ERR_INVALID_ARG without params->dev; OFL_ERR_SYSTEM when the
 * directory cannot hold the file; OFL_ERR_NOT_SUPPORTED when O_DIRECT or
 * io_uring was demanded and is not available.
 * O_DIRECT is checked with one 4 KiB write: EINVAL (or the flag refused) is
 * "not supported" (OFL_ERR_NOT_SUPPORTED with direct on, buffered I/O with
 * auto); ENOSPC, EDQUOT or EFBIG is a full file system, not a verdict on
 * O_DIRECT: OFL_ERR_NO_SPACE naming the directory with direct on, a WARN
 * and buffered I/O with auto. */
OFL_API ofl_status_t ofl_disk_open(const ofl_disk_params_t *params,
                                   ofl_disk_t **out);
/* Waits (bounded) for I/O in flight, destroys the extents still alive (a
 * WARN line counts them), closes the file (nothing remains on disk). NULL
 * is accepted. */
OFL_API void ofl_disk_close(ofl_disk_t *disk);

OFL_API void ofl_disk_get_stats(const ofl_disk_t *disk, ofl_disk_stats_t *out);
/* 1 after a write fault; new extents are refused until cleared. */
OFL_API int ofl_disk_is_degraded(const ofl_disk_t *disk);
OFL_API void ofl_disk_clear_degraded(ofl_disk_t *disk);
/* 1 when the group name is placed on disk (params->groups / OFL_DISK_GROUPS;
 * "*" selects every group). */
OFL_API int ofl_disk_group_selected(const ofl_disk_t *disk, const char *group);
/* How many groups ahead the manager should prefetch (OFL_DISK_PREFETCH). */
OFL_API int ofl_disk_prefetch_groups(const ofl_disk_t *disk);
/* The path of the directory that holds the (unnamed) file. */
OFL_API const char *ofl_disk_dir(const ofl_disk_t *disk);
/* Gives every kept buffer back to the bounce pool (host memory is needed
 * elsewhere); their extents stay ON_DISK. Returns the bytes given back. */
OFL_API size_t ofl_disk_drop_kept(ofl_disk_t *disk);

/* Reserves bytes of file space and a bounce buffer of at least bytes,
 * rounded up to 4 KiB (ofl_disk_extent_capacity). bytes may be any size > 0.
 * Refusals are quiet (the caller falls back to another tier) and leave
 * nothing behind:
 *   OFL_ERR_NO_SPACE  the budget or the file system has no room, or the
 *                     store is degraded after a write fault;
 *   OFL_ERR_NO_MEMORY no bounce buffer (pool budget). */
OFL_API ofl_status_t ofl_disk_extent_create(ofl_disk_t *disk, size_t bytes,
                                            ofl_disk_extent_t **out);
OFL_API void *ofl_disk_extent_data(const ofl_disk_extent_t *e); /* NULL: none */
OFL_API size_t ofl_disk_extent_bytes(const ofl_disk_extent_t *e);
OFL_API size_t ofl_disk_extent_capacity(const ofl_disk_extent_t *e);
OFL_API ofl_disk_extent_state_t
ofl_disk_extent_state(const ofl_disk_extent_t *e);

/* Writes the buffer (state STAGED) to the file now. Returns once queued;
 * learn the outcome with ofl_disk_extent_query / _wait. */
OFL_API ofl_status_t ofl_disk_extent_write(ofl_disk_extent_t *e);
/* Same, queued when stream reaches this point (after the D2H copy into the
 * buffer that was queued before it), through a host function. */
OFL_API ofl_status_t ofl_disk_extent_write_after(ofl_disk_extent_t *e,
                                                 ofl_stream_t *stream);
/* Outcome of the extent's last operation: OFL_ERR_NOT_READY while one is in
 * flight, OFL_SUCCESS, or the fault (OFL_ERR_NO_SPACE, OFL_ERR_IO for EIO or
 * a short write, OFL_ERR_CORRUPT). A failed write leaves the extent
 * HOST_ONLY: the data is safe in the buffer. */
OFL_API ofl_status_t ofl_disk_extent_query(const ofl_disk_extent_t *e);
/* Waits for the operation in flight; returns what query would return then,
 * or OFL_ERR_TIMEOUT. Does not count as a stall. */
OFL_API ofl_status_t ofl_disk_extent_wait(ofl_disk_extent_t *e,
                                          int64_t timeout_ms);

/* Starts reading an ON_DISK extent into a new bounce buffer; a write still
 * in flight keeps its buffer instead, and a kept buffer is taken back (no
 * read needed in either case). Does nothing for an
 * extent already in memory or being read. OFL_ERR_NO_MEMORY (quiet) when no
 * buffer is free now: try again later, or let reload read it. */
OFL_API ofl_status_t ofl_disk_extent_prefetch(ofl_disk_extent_t *e);
/* Makes the bytes available in host memory and returns the buffer: at once
 * when they are there (prefetch hit), else after the read (counted as a
 * stall; a read is issued when none was). When the bounce pool has no
 * buffer for the read but writes in flight will give theirs back, reload
 * waits for them (within timeout_ms). Errors: OFL_ERR_IO (EIO, short read),
 * OFL_ERR_CORRUPT (checksum), OFL_ERR_TIMEOUT (the read, or the writes
 * holding the buffers, did not finish in time), OFL_ERR_NO_MEMORY (no
 * buffer, and no write in flight that would return one); *data is set only
 * on success. After a read error the extent is ON_DISK again and reload may
 * be retried. */
OFL_API ofl_status_t ofl_disk_extent_reload(ofl_disk_extent_t *e,
                                            int64_t timeout_ms, void **data);
/* Drops the buffer of a RESIDENT extent (it stays in the file). */
OFL_API ofl_status_t ofl_disk_extent_evict(ofl_disk_extent_t *e);

/* Frees the file space and the buffer and ends the handle. An operation in
 * flight is waited for (bounded; OFL_ERR_TIMEOUT leaves the extent alive). */
OFL_API ofl_status_t ofl_disk_extent_destroy(ofl_disk_extent_t *e);
/* Same, with the buffer reused only after the work queued on stream so far
 * (the H2D copy that reads it) has completed (docs/DESIGN.md section 5 rule 2). */
OFL_API ofl_status_t ofl_disk_extent_destroy_after(ofl_disk_extent_t *e,
                                                   ofl_stream_t *stream);

OFL_EXTERN_C_END

#endif /* OFL_DISK_H */
