/* ofl: tensor pools. One implementation for device memory and for pinned
 * host memory: blocks are reused by exact (shape, dtype) key, or by byte
 * size rounded to the page for dynamic shapes, from a FIFO free list per
 * key; a miss creates a block. Ownership is O(1) through a block header kept
 * in host memory. Pools are thread-safe (one mutex per pool; the hit path
 * takes it once and allocates nothing).
 *
 * Stream-ordered reuse (docs/DESIGN.md section 4, section 5 rule 2): a block
 * freed with ofl_pool_free_after / ofl_pool_free_after_event carries the pool's
 * own event for its last use. Allocation then hands it out only when that use
 * is complete, or, when the caller names a stream, at once with that stream
 * made to wait on the event:
 *   - stream == NULL: free blocks of the key whose last use is still queued
 *     are skipped (the next free block is taken, or a block is created). If
 *     creating is refused by the budget and a skipped block exists, the
 *     oldest one is waited for (bounded by OFL_WAIT_TIMEOUT_MS) and handed
 *     out.
 *   - stream != NULL: the oldest free block whose last use is complete is
 *     handed out; when there is none, the oldest free block is handed out at
 *     once and ofl_stream_wait_event(stream, ...) orders everything the
 *     caller queues on stream after its last use. Touching the memory from
 *     the host before that stream reaches the wait is the caller's hazard
 *     (on the host backend a wait on the compute stream blocks the caller
 *     until the last use is over, so the host may touch it at once).
 *
 * Memory (docs/DESIGN.md section 4): while the budget is unlimited, blocks
 * are carved from segments, large regions each made by one backend call (one
 * registration for pinned memory) and grown geometrically; a block's memory
 * goes back to its segment, merged with free neighbours, when the pool
 * releases idle cached blocks to make room, so sizes that change every
 * microbatch reuse the same segments. Which blocks come from segments is
 * params.segments (by default those of pools whose byte sizes change).
 * With a budget, each block
 * is one backend allocation and eviction makes room, as before, except in
 * a pool with OFL_POOL_SEGMENTS_ALL: its segments grow only within the
 * budget, and a request that fits neither a free range nor a segment within
 * it is refused (OFL_ERR_NO_MEMORY, counted in budget_refusals).
 *
 * Out of memory: when the backend refuses, the pool releases its cached
 * blocks and those of the device's other pools of the same kind (waiting,
 * bounded, for last uses still queued, as PyTorch does), frees segments
 * left empty, and tries again; only then
 * OFL_ERR_NO_MEMORY, with a message giving the request and, per pool, the
 * bytes held, in use and cached.
 *
 * Counting: every request is a hit (a free block reused) or a miss (a block
 * created); backend_allocs counts calls that reached ofl_device_malloc /
 * ofl_pinned_malloc (or the pool's allocator), so steady state can be
 * checked to allocate nothing.
 *
 * Application memory (params.allocator): a program that owns its GPU memory
 * (PyTorch's caching allocator, a C++ engine's own) gives the pool an
 * allocator, and the pool takes its blocks from it instead of the backend:
 * one alloc call per block (no reserve, no segments: the application's
 * allocator does its own caching), cached and reused by key as any block,
 * and one free call when the pool releases the block (clear, destroy,
 * eviction, the out-of-memory release), only once every use queued on it
 * with ofl_pool_free_after[_event] has completed (the pool waits for the
 * block's event first, as it does before it frees its own memory). A
 * refused alloc takes the out-of-memory retry above. The memory must be
 * the device's memory for a device pool (cuda: the GPU's; the host
 * backend: only when the device adopts memory outside ofl's blocks,
 * ofl_device_adopt_host_memory(dev, 1), which ofl_pool_create checks) and
 * page-locked host memory for a pinned pool on cuda. The offload manager
 * reloads into such memory when it is given the pool as
 * ofl_manager_params_t.device_pool. */
#ifndef OFL_POOL_H
#define OFL_POOL_H

#include <stddef.h>
#include <stdint.h>

#include <ofl/device.h>
#include <ofl/export.h>
#include <ofl/status.h>
#include <ofl/tensor.h>

OFL_EXTERN_C_BEGIN

typedef enum ofl_pool_kind {
  OFL_POOL_DEVICE = 0, /* ofl_device_malloc; tensors at OFL_LOC_DEVICE */
  OFL_POOL_PINNED = 1  /* ofl_pinned_malloc; tensors at OFL_LOC_PINNED */
} ofl_pool_kind_t;

/* Byte keys (dynamic shapes) round up to this; never to a power of two. */
#define OFL_POOL_PAGE_BYTES OFL__SIZE_C(4096)

/* budget_bytes value meaning "read OFL_DEVICE_POOL_BUDGET (device pools) or
 * OFL_HOST_BUDGET (pinned pools)"; 0 there means unlimited. */
#define OFL_POOL_BUDGET_FROM_ENV OFL__SIZE_C(-1)

/* Which blocks a pool with an unlimited budget carves from segments. AUTO:
 * every new block once a device pool has served a byte-keyed block (a pool
 * for changing sizes, as a caching allocator's: blocks cached for one
 * microbatch's sizes make room for the next one's), a pinned pool
 * byte-keyed blocks of two sizes; a pool of fixed shapes keeps one backend
 * call per block, reused by its key. */
typedef enum ofl_pool_segments {
  OFL_POOL_SEGMENTS_OFF = 0, /* none: one backend call per block */
  OFL_POOL_SEGMENTS_AUTO = 1,
  OFL_POOL_SEGMENTS_ALL = 2 /* every block */
} ofl_pool_segments_t;

/* Where a pool's blocks come from when the application owns the memory.
 * alloc: bytes for one block on stream (the stream the block is first used
 * on: the one passed to the allocation, NULL when none); anything but
 * OFL_SUCCESS (or a NULL *ptr) is a refusal. free: gives a block back, with
 * the bytes and stream of its alloc; called only after every queued use of
 * the block completed, never from a copy thread. Both are called without
 * the pool's lock, possibly from several threads; ctx and the functions
 * must stay valid until ofl_pool_destroy returns (the pool copies the
 * struct). A stream given to an allocation must outlive the blocks made
 * for it (ofl_pool_clear releases them). */
typedef struct ofl_allocator {
  void *ctx;
  ofl_status_t (*alloc)(void *ctx, size_t bytes, ofl_stream_t *stream,
                        void **ptr);
  void (*free)(void *ctx, void *ptr, size_t bytes, ofl_stream_t *stream);
} ofl_allocator_t;

typedef struct ofl_pool_params {
  ofl_pool_kind_t kind;
  const char *name;     /* for log lines; NULL: "device" or "pinned" */
  size_t budget_bytes;  /* cap on the bytes of all blocks; 0: unlimited */
  size_t reserve_bytes; /* preallocated at creation (one backend call);
                           blocks are carved from it before the backend is
                           asked again. Must fit the budget. 0: none */
  int evict;            /* 1: when the budget refuses a new block, release
                           free blocks of other keys (whose last use is over)
                           if that makes room; dynamic shapes otherwise fill
                           the budget with sizes never asked for again.
                           0: refuse */
  ofl_pool_segments_t segments; /* while the budget is 0 (unlimited);
                                   ALL: under a budget too */
  /* The application's allocator for every block (top of this file); NULL:
   * the backend's. With one, reserve_bytes must be 0 and segments is
   * treated as OFL_POOL_SEGMENTS_OFF (OFL_POOL_SEGMENTS_ALL is refused). */
  const ofl_allocator_t *allocator;
} ofl_pool_params_t;

#define OFL_POOL_PARAMS_INIT                                                   \
  {                                                                            \
    OFL_POOL_DEVICE, NULL, OFL_POOL_BUDGET_FROM_ENV, 0, 1,                     \
        OFL_POOL_SEGMENTS_AUTO, NULL                                           \
  }

/* Global counters of a pool. Bytes are block bytes (a byte-keyed block is
 * rounded to the page). */
typedef struct ofl_pool_stats {
  size_t total_bytes;       /* bytes of every block the pool holds */
  size_t in_use_bytes;      /* bytes of blocks handed out */
  size_t peak_in_use_bytes; /* high-water mark of in_use_bytes */
  size_t budget_bytes;      /* 0: unlimited */
  size_t reserve_bytes;     /* bytes preallocated at creation */
  uint64_t blocks_total;
  uint64_t blocks_in_use;
  uint64_t requests;        /* allocation requests (hits + misses + failed) */
  uint64_t hits;            /* served from a free list */
  uint64_t misses;          /* served by creating a block */
  uint64_t frees;           /* blocks returned */
  uint64_t budget_refusals; /* requests refused with OFL_ERR_NO_MEMORY */
  uint64_t pending_skips;   /* free blocks skipped: last use still queued */
  uint64_t stream_waits;    /* blocks handed out with a stream wait */
  uint64_t backend_allocs;  /* calls to ofl_device_malloc/ofl_pinned_malloc,
                               or to params.allocator's alloc */
  uint64_t backend_frees;   /* and to their free */
  uint64_t evictions;   /* free blocks released to make room in the budget */
  size_t held_bytes;    /* memory the pool holds from the backend: blocks
                           of their own, segments and the reserve */
  size_t cached_bytes;  /* bytes of free blocks (total - in use) */
  size_t segment_bytes; /* bytes of segments */
  uint64_t segments;
  uint64_t releases;    /* idle cached blocks given back to their segment or
                           the backend to make room (not budget evictions) */
  uint64_t oom_retries; /* backend refusals retried after releasing */
  /* Under an offload manager (which reports where each training iteration
   * ends; 0 for a pool used on its own): the iterations ended, and the one
   * at whose end the pool's learning ended (0: still learning). Learning
   * (docs/DESIGN.md section 4) resizes merged segments for higher peaks and
   * makes room in the pinned pool; it ends after an iteration that made no
   * new key and no backend call (for a device pool of changing byte sizes,
   * also no peak in use above every earlier one's after the warmup; the
   * first iteration after the warmup counts as above), and at the latest
   * after the twelfth.
   * From then on a workload that repeats sizes the pool has seen makes no
   * backend call: backend_allocs and backend_frees stay as they are. */
  uint64_t iterations;
  uint64_t learned_iteration;
  /* The placement plan of a device pool of changing sizes under a manager
   * (from the end of its learning; docs/design/memory.md): its slots (0:
   * none: no plan was made, or it ended), their bytes, and the requests
   * since it was made that their own slot did not take (another free slot
   * or the room past the slots did; a request that finds neither ends the
   * plan, and best fit over the segment takes over). */
  uint64_t placement_slots;
  size_t placement_bytes;
  uint64_t placement_misses;
  /* High-water mark (since ofl_pool_reset_peak, as peak_in_use_bytes) of
   * the bytes the blocks in use take: a block carved from a segment takes
   * whole granules (256 bytes on the device, a 4 KiB page pinned), one of
   * its own its bytes. What the pool sizes its segments for: in a pinned
   * pool a tensor of 512 bytes takes a page, eight times its bytes. */
  size_t peak_taken_bytes;
} ofl_pool_stats_t;

/* Status of one key (the reference pool's get_pool_status(shape, dtype)). */
/* No struct tag: it would be hidden by the function of the same name
 * (C++ -Wshadow). */
typedef struct {
  size_t block_bytes;
  uint64_t total;     /* blocks created for the key */
  uint64_t allocated; /* handed out */
  uint64_t free;      /* in the free list */
  double utilization; /* allocated / total * 100; 0 when total is 0 */
} ofl_pool_key_status_t;

/* Creates a pool on dev. params NULL: a device pool with the budget from
 * the environment and no reserve. */
OFL_API ofl_status_t ofl_pool_create(ofl_device_t *dev,
                                     const ofl_pool_params_t *params,
                                     ofl_pool_t **out);
/* Waits (bounded) for the last uses of free blocks, releases all memory and
 * the pool's cached handles. Handles still holding its blocks must not be
 * used afterwards (a WARN line counts them). NULL is accepted. */
OFL_API void ofl_pool_destroy(ofl_pool_t *pool);

OFL_API ofl_pool_kind_t ofl_pool_kind(const ofl_pool_t *pool);
OFL_API ofl_device_t *ofl_pool_device(const ofl_pool_t *pool);
OFL_API const char *ofl_pool_name(const ofl_pool_t *pool);
/* Location of the pool's tensors (OFL_LOC_DEVICE or OFL_LOC_PINNED). */
OFL_API ofl_location_t ofl_pool_location(const ofl_pool_t *pool);

/* A new handle on a block of key (shape, dtype). stream may be NULL (see the
 * top of this file). OFL_ERR_NO_MEMORY (quiet: the caller falls back) when
 * the budget (after eviction, when enabled) or the backend refuses; nothing
 * changes then. End the handle
 * with ofl_pool_free[_after] or ofl_tensor_destroy. Handles come from a
 * per-pool cache: the hit path does not call malloc. */
OFL_API ofl_status_t ofl_pool_alloc(ofl_pool_t *pool, const int64_t *shape,
                                    int ndim, ofl_dtype_t dtype,
                                    ofl_stream_t *stream, ofl_tensor_t **out);
/* Same, keyed by the byte size rounded up to OFL_POOL_PAGE_BYTES (dynamic
 * shapes: any shape of the same rounded size shares blocks). */
OFL_API ofl_status_t ofl_pool_alloc_dynamic(ofl_pool_t *pool,
                                            const int64_t *shape, int ndim,
                                            ofl_dtype_t dtype,
                                            ofl_stream_t *stream,
                                            ofl_tensor_t **out);
/* Gives a handle without storage (after ofl_tensor_create or
 * ofl_tensor_release_storage) a block of its own (shape, dtype) key. The
 * handle keeps its identity; release the block with
 * ofl_tensor_release_storage[_after] (handle kept) or ofl_pool_free (handle
 * ended). OFL_ERR_INVALID_USAGE when t already has storage. */
OFL_API ofl_status_t ofl_pool_alloc_into(ofl_pool_t *pool, ofl_tensor_t *t,
                                         ofl_stream_t *stream);
/* Same with the byte-size key. */
OFL_API ofl_status_t ofl_pool_alloc_into_dynamic(ofl_pool_t *pool,
                                                 ofl_tensor_t *t,
                                                 ofl_stream_t *stream);

/* Returns t's block to pool and ends the handle t (like ofl_tensor_destroy).
 * The block goes back to its key's free list when no other handle (a view)
 * shares it. OFL_ERR_INVALID_ARG with a message, and pool and t unchanged,
 * when t's storage is not a block of this pool (another pool's, wrapped
 * memory, none) or t was already freed (detected while the pool lives for
 * handles from ofl_pool_alloc: an ended handle is reused only after 32 more
 * have ended, so a second free after a few allocations is still found). */
OFL_API ofl_status_t ofl_pool_free(ofl_pool_t *pool, ofl_tensor_t *t);
/* Stream-ordered free: the block is reused only after the work queued on
 * stream so far (its last use) has completed. The pool records its own
 * per-block event on stream, so nothing of the caller's is kept. */
OFL_API ofl_status_t ofl_pool_free_after(ofl_pool_t *pool, ofl_tensor_t *t,
                                         ofl_stream_t *stream);
/* Stream-ordered free after the caller's event: the pool captures the
 * event's last record now (through an internal ordering stream), so the
 * caller may record or destroy its event right after this call. */
OFL_API ofl_status_t ofl_pool_free_after_event(ofl_pool_t *pool,
                                               ofl_tensor_t *t,
                                               ofl_event_t *last_use);
/* 1 when t's storage is a live block of pool. */
OFL_API int ofl_pool_owns(const ofl_pool_t *pool, const ofl_tensor_t *t);

/* Marks every block free and keeps the memory (the reference's reset()).
 * Reset and clear are end-of-iteration calls: they must not run while other
 * threads allocate or free on the same pool (every other call is
 * thread-safe).
 * Blocks still held become free too: handles on them go stale (their data
 * must not be used; freeing them is OFL_ERR_INVALID_ARG, destroying them
 * just ends the handle). Counters other than in-use are kept. */
OFL_API ofl_status_t ofl_pool_reset(ofl_pool_t *pool);
/* Releases the memory of every free block (waiting, bounded, for queued
 * last uses) and of the reserve when nothing is carved from it. Blocks still
 * held are kept. Counters are kept. */
OFL_API ofl_status_t ofl_pool_clear(ofl_pool_t *pool);

/* Changes the budget (0: unlimited). Blocks already created are kept even
 * when they exceed the new budget; only new blocks are refused. */
OFL_API ofl_status_t ofl_pool_set_budget(ofl_pool_t *pool, size_t budget_bytes);

OFL_API void ofl_pool_get_stats(const ofl_pool_t *pool, ofl_pool_stats_t *out);
/* Sets peak_in_use_bytes and peak_taken_bytes to the bytes in use and
 * taken now (a new measuring window). */
OFL_API void ofl_pool_reset_peak(ofl_pool_t *pool);
/* Status of the exact key (shape, dtype); OFL_ERR_INVALID_ARG for a key the
 * pool has never seen. */
OFL_API ofl_status_t ofl_pool_key_status(const ofl_pool_t *pool,
                                         const int64_t *shape, int ndim,
                                         ofl_dtype_t dtype,
                                         ofl_pool_key_status_t *out);
/* One key and its status (the reference's get_pool_status() without a key
 * lists every key). For a byte-size key, dynamic is 1 and shape/dtype are
 * unused. */
typedef struct ofl_pool_key_info {
  int dynamic;
  int ndim;
  ofl_dtype_t dtype;
  int64_t shape[OFL_MAX_DIMS];
  ofl_pool_key_status_t status;
} ofl_pool_key_info_t;

/* Copies up to cap keys into out (most recently created first) and sets
 * *count to the number of keys the pool has (which may exceed cap). out may
 * be NULL when cap is 0. */
OFL_API ofl_status_t ofl_pool_list_keys(const ofl_pool_t *pool,
                                        ofl_pool_key_info_t *out, size_t cap,
                                        size_t *count);

/* Status of the byte-size key that bytes rounds to. */
OFL_API ofl_status_t ofl_pool_dynamic_key_status(const ofl_pool_t *pool,
                                                 size_t bytes,
                                                 ofl_pool_key_status_t *out);

OFL_EXTERN_C_END

#endif /* OFL_POOL_H */
