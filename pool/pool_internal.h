/* ofl: private structures of the tensor handle and the tensor pools, shared
 * by pool/tensor.c and the pool (pool/pool.c, pool/pool_free.c). Not
 * installed. */
#ifndef OFL_POOL_INTERNAL_H
#define OFL_POOL_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <ofl/pool.h>
#include <ofl/tensor.h>

enum ofl__storage_kind {
  OFL__STORAGE_BLOCK = 1,   /* a pool block (pool/pool.c) */
  OFL__STORAGE_EXTERNAL = 2 /* wrapped memory with a release callback */
};

/* How a kind of storage lets go of a handle: the release interface that
 * pool/tensor.c calls, so that it needs nothing of the pool's (pool/
 * pool_free.c gives a block's; pool/tensor.c its own, external storage's). */
typedef struct ofl__storage_ops {
  /* Detaches t from its storage (stream non-NULL: stream-ordered) and, when
   * end_handle, ends the handle; the last handle gives the memory back.
   * OFL_ERR_INVALID_ARG with nothing changed when t cannot let go. */
  ofl_status_t (*release)(ofl_tensor_t *t, ofl_stream_t *stream,
                          bool end_handle);
  /* One more handle (a view) on t's storage; fails on a stale handle. */
  ofl_status_t (*ref)(const ofl_tensor_t *t);
} ofl__storage_ops_t;

/* The memory one or more handles share. A pool block embeds it as its first
 * member; external storage is allocated on its own. */
typedef struct ofl__storage {
  const ofl__storage_ops_t *ops;
  void *base;
  size_t bytes;
  ofl_location_t loc;
  int kind;
  /* Handles attached. Blocks change it under their pool's lock; external
   * storage atomically. */
  atomic_int refs;
  /* Pool blocks: bumped when ofl_pool_reset reclaims a held block, so that
   * the handles still on it are recognised as stale. */
  uint32_t gen;
  ofl_release_fn release;
  void *release_user;
  /* External storage: an ordered release runs in a host function of its
   * stream (OFL_WRAP_RELEASE_IN_HOST_FN) instead of the release thread. */
  bool release_in_host_fn;
} ofl__storage_t;

#define OFL__TENSOR_LIVE 0x7e45011eu
#define OFL__TENSOR_DEAD 0xdeadbeefu

struct ofl_tensor {
  void *data; /* base + offset; NULL without storage */
  size_t bytes;
  size_t offset; /* into the storage */
  ofl__storage_t *st;
  uint32_t st_gen;
  uint32_t state; /* OFL__TENSOR_LIVE or _DEAD */
  ofl_dtype_t dtype;
  ofl_location_t loc;
  unsigned flags;
  int ndim;
  int64_t shape[OFL_MAX_DIMS];
  /* The pool whose handle cache this handle returns to when it ends; NULL
   * for a handle from malloc (create, wrap, view). */
  ofl_pool_t *home;
  /* The offload manager that owns the handle between its push and its pop
   * (pipeline/); NULL otherwise. */
  const void *owner;
  ofl_tensor_t *cache_next; /* home's cache of ended handles */
  ofl_tensor_t *all_next;   /* every handle home ever made */
};

/* Validates (shape, ndim, dtype) and fills the handle's shape fields and
 * bytes; the storage fields are left alone. */
ofl_status_t ofl__tensor_set_shape(ofl_tensor_t *t, const int64_t *shape,
                                   int ndim, ofl_dtype_t dtype);

/* Takes one more reference on a block for a view; fails on a stale handle
 * (the block storage's ref). */
ofl_status_t ofl__pool_block_ref(const ofl_tensor_t *t);
/* Returns an ended handle to the cache of its home pool. */
void ofl__pool_handle_put(ofl_tensor_t *t);

/* Destroys pool now when none of its blocks is held, else when the last
 * held block is released (the offload manager's own reload pool: tensors it
 * popped belong to the caller and outlive it); then(arg), when non-NULL,
 * runs right after the pool is gone. The free blocks' memory goes at once.
 * The caller must not use pool afterwards. */
void ofl__pool_destroy_when_idle(ofl_pool_t *pool, void (*then)(void *),
                                 void *arg);

/* The offload manager ended a training iteration whose tensors came from
 * pool: through its first iterations a device pool resizes its merged
 * segment for higher peaks, and a pinned pool short of room grows between
 * iterations (pool/resize.c). NULL: nothing. */
void ofl__pool_cycle_end(ofl_pool_t *pool);
/* The same, and moved: the manager's placement of tensors moved in that
 * iteration (tensors it kept on the device, or pinned memory it used, will
 * differ in the next one), so that it does not end the pool's learning. */
void ofl__pool_cycle_end_moved(ofl_pool_t *pool, bool moved);

/* The offload manager will reload byte-keyed tensors into pool (a name in
 * dynamic_groups): a device pool with segments AUTO carves its new blocks
 * from segments from now on, as it would from its first byte-keyed block.
 * The manager reloads only the tensors over its size threshold, so a name
 * whose sizes straddle it may send its first byte-keyed block after the
 * pool learned; switching then made a segment in a steady iteration. NULL
 * or another pool: nothing. */
void ofl__pool_expect_byte_keys(ofl_pool_t *pool);

#endif /* OFL_POOL_INTERNAL_H */
