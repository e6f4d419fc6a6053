/* ofl: the tensor handle. A tensor is bytes with a shape and a dtype, living
 * on the device, in pinned host memory or on disk. Its storage is a pool
 * block or external memory wrapped with a release callback; storage can be
 * released while the handle lives (offload) and given back later (reload). */
#ifndef OFL_TENSOR_H
#define OFL_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include <ofl/export.h>
#include <ofl/status.h>

OFL_EXTERN_C_BEGIN

#define OFL_MAX_DIMS 8

typedef enum ofl_dtype {
  OFL_DTYPE_F32 = 0,
  OFL_DTYPE_F16,
  OFL_DTYPE_BF16,
  OFL_DTYPE_F8_E4M3,
  OFL_DTYPE_F8_E5M2,
  OFL_DTYPE_I64,
  OFL_DTYPE_I32,
  OFL_DTYPE_I16,
  OFL_DTYPE_I8,
  OFL_DTYPE_U8,
  OFL_DTYPE_BOOL,
  OFL_DTYPE_F64, /* added after the first release: values at the end */
  OFL_DTYPE_U16,
  OFL_DTYPE_U32,
  OFL_DTYPE_U64,
  OFL_DTYPE_COUNT
} ofl_dtype_t;

typedef enum ofl_location {
  OFL_LOC_NONE = 0, /* no storage (released) */
  OFL_LOC_DEVICE,
  OFL_LOC_PINNED,
  OFL_LOC_DISK
} ofl_location_t;

enum ofl_tensor_flags {
  OFL_TENSOR_NOT_OFFLOADABLE = 1u << 0
};

typedef struct ofl_pool ofl_pool_t;

/* A tensor handle (opaque). Read its fields through the accessors.
 *
 * Handle and storage are separate: a handle names bytes with a shape, a dtype
 * and a location; its storage is a pool block or external memory. Several
 * handles may share one storage (ofl_tensor_view / ofl_tensor_alias); the
 * storage is released when the last handle on it lets go (a reference
 * count). A handle can lose its storage (ofl_tensor_release_storage: location
 * becomes OFL_LOC_NONE, data NULL, shape and dtype kept) and be given new
 * storage later (ofl_pool_alloc_into, ofl_tensor_attach). */
typedef struct ofl_tensor ofl_tensor_t;
typedef struct ofl_stream ofl_stream_t;

/* Called when external storage wrapped by ofl_tensor_wrap is released.
 * Which thread, and when:
 * - an unordered release (ofl_tensor_release_storage, ofl_tensor_destroy of
 *   the last handle): on the calling thread, before the call returns;
 * - an ordered release (ofl_tensor_release_storage_after, and the manager's
 *   offload of forced-release tensors, which orders after the D2H copy): once
 *   the work queued on the stream before the release completed, on an
 *   ofl-owned thread of the device, or on the thread that synchronises that
 *   stream (ofl_stream_synchronize returns after it ran), whichever comes
 *   first; never inside a stream's host function, so the callback may call
 *   CUDA (cudaFree) and take its own locks, but it must not wait for the
 *   thread that released. If the stream never completes (a stuck device),
 *   the callback never runs and device close leaks the memory, saying so.
 *   Storage wrapped with OFL_WRAP_RELEASE_IN_HOST_FN is the exception: its
 *   ordered release runs as a host function of that stream. */
typedef void (*ofl_release_fn)(void *data, size_t bytes, void *user);

OFL_API size_t ofl_dtype_size(ofl_dtype_t dtype); /* 0 for an invalid dtype */
OFL_API const char *ofl_dtype_name(ofl_dtype_t dtype);
/* Parses "f32", "bf16", ... (safetensors names "F32", "BF16" also). */
OFL_API ofl_status_t ofl_dtype_parse(const char *name, ofl_dtype_t *out);

/* Number of bytes of a (shape, dtype); OFL_ERR_INVALID_ARG on a bad dtype,
 * ndim > OFL_MAX_DIMS, a negative dim or overflow. ndim 0 is a scalar. */
OFL_API ofl_status_t ofl_shape_bytes(const int64_t *shape, int ndim,
                                     ofl_dtype_t dtype, size_t *out);

/* Wraps external memory (device or pinned) in a new handle. release may be
 * NULL (the caller keeps ownership). */
OFL_API ofl_status_t ofl_tensor_wrap(void *data, const int64_t *shape,
                                     int ndim, ofl_dtype_t dtype,
                                     ofl_location_t loc, ofl_release_fn release,
                                     void *release_user, ofl_tensor_t **out);

/* Flags of ofl_tensor_wrap_flags. */
enum {
  /* release calls no CUDA and no ofl function and takes no lock at all
   * (pushing the memory onto a lock-free list for the owner to free later
   * qualifies), so it may run on any thread: on the host backend an ordered
   * release then runs as an operation of the stream right after the work
   * queued before it, on the stream's worker, on an application thread
   * that waits on a stream and runs the queued work itself, or on the
   * releasing thread before the release call returns when the stream has
   * nothing queued; no event and no hand-off to the device's release
   * thread. On cuda the release thread runs it as before (a host function
   * there would hold up the stream's later copies until the driver's
   * callback thread ran it). Unordered releases are unchanged. */
  OFL_WRAP_RELEASE_IN_HOST_FN = 1u
};
/* ofl_tensor_wrap with flags (0: the same as ofl_tensor_wrap); an unknown
 * flag is OFL_ERR_INVALID_ARG. */
OFL_API ofl_status_t ofl_tensor_wrap_flags(void *data, const int64_t *shape,
                                           int ndim, ofl_dtype_t dtype,
                                           ofl_location_t loc,
                                           ofl_release_fn release,
                                           void *release_user, unsigned flags,
                                           ofl_tensor_t **out);
/* A handle with a shape and dtype and no storage (location OFL_LOC_NONE),
 * to be given storage by ofl_pool_alloc_into or ofl_tensor_attach. */
OFL_API ofl_status_t ofl_tensor_create(const int64_t *shape, int ndim,
                                       ofl_dtype_t dtype, ofl_tensor_t **out);
/* Destroys the handle, releasing its share of the storage (the last handle
 * on a storage returns a pool block to its pool, or calls the release
 * callback of external memory). A handle from ofl_pool_alloc may be ended
 * here or by ofl_pool_free. NULL is accepted. */
OFL_API ofl_status_t ofl_tensor_destroy(ofl_tensor_t *t);
/* Ends the handle in *slot and sets *slot to NULL, in one call: a caller
 * that can be interrupted between two of its calls (Python's
 * KeyboardInterrupt) never holds a handle that was destroyed, and calling
 * it again on the same slot does nothing. after != NULL: the storage is
 * released after the work queued on that stream so far
 * (ofl_tensor_release_storage_after), then the handle destroyed. slot NULL
 * or *slot NULL: nothing to do. On failure *slot is unchanged. */
OFL_API ofl_status_t ofl_tensor_destroy_slot(ofl_tensor_t **slot,
                                             ofl_stream_t *after);

/* A new handle on the storage of base, starting offset_bytes into base's
 * data, with its own shape and dtype (which must fit inside the storage).
 * ofl_tensor_storage_id is equal for both handles. Destroy it with
 * ofl_tensor_destroy. */
OFL_API ofl_status_t ofl_tensor_view(const ofl_tensor_t *base,
                                     size_t offset_bytes, const int64_t *shape,
                                     int ndim, ofl_dtype_t dtype,
                                     ofl_tensor_t **out);
/* Same shape, dtype, data and storage as t (a view at offset 0). */
OFL_API ofl_status_t ofl_tensor_alias(const ofl_tensor_t *t,
                                      ofl_tensor_t **out);

/* Lets go of t's storage now; the handle lives on with location
 * OFL_LOC_NONE and data NULL (the reference's resize_(0)). The storage is
 * released when no other handle shares it. OFL_ERR_INVALID_ARG when t has
 * no storage. */
OFL_API ofl_status_t ofl_tensor_release_storage(ofl_tensor_t *t);
/* Stream-ordered release: like ofl_tensor_release_storage, but the memory
 * is reused or released only after the work queued on stream so far has
 * completed; the call never waits. A pool block goes back to its pool at
 * once, marked with an event the pool owns (see ofl_pool_free_after).
 * External memory's share is dropped once that work completed (see
 * ofl_release_fn for where its callback runs). */
OFL_API ofl_status_t ofl_tensor_release_storage_after(ofl_tensor_t *t,
                                                      ofl_stream_t *stream);
/* Gives a handle without storage external memory of storage_bytes
 * (>= ofl_tensor_bytes(t)) at data. release may be NULL. For OFL_LOC_DISK
 * data is an opaque token of the disk store. OFL_ERR_INVALID_USAGE when t
 * already has storage. */
OFL_API ofl_status_t ofl_tensor_attach(ofl_tensor_t *t, void *data,
                                       size_t storage_bytes,
                                       ofl_location_t loc,
                                       ofl_release_fn release,
                                       void *release_user);

OFL_API void *ofl_tensor_data(const ofl_tensor_t *t);
OFL_API size_t ofl_tensor_bytes(const ofl_tensor_t *t);
OFL_API size_t ofl_tensor_nelem(const ofl_tensor_t *t);
OFL_API int ofl_tensor_ndim(const ofl_tensor_t *t);
OFL_API const int64_t *ofl_tensor_shape(const ofl_tensor_t *t);
OFL_API ofl_dtype_t ofl_tensor_dtype(const ofl_tensor_t *t);
OFL_API ofl_location_t ofl_tensor_location(const ofl_tensor_t *t);
OFL_API unsigned ofl_tensor_flags(const ofl_tensor_t *t);
OFL_API void ofl_tensor_set_flags(ofl_tensor_t *t, unsigned flags);
/* The pool the storage came from, NULL for wrapped or released storage. */
OFL_API ofl_pool_t *ofl_tensor_pool(const ofl_tensor_t *t);
/* The identity of the storage, equal for two handles that share it and
 * distinct among storages alive at the same time; NULL without storage. */
OFL_API const void *ofl_tensor_storage_id(const ofl_tensor_t *t);
/* Bytes of the whole storage (a pool block may be larger than the tensor);
 * 0 without storage. */
OFL_API size_t ofl_tensor_storage_bytes(const ofl_tensor_t *t);
/* 1 when t has storage (location is not OFL_LOC_NONE). */
OFL_API int ofl_tensor_has_storage(const ofl_tensor_t *t);

OFL_EXTERN_C_END

#endif /* OFL_TENSOR_H */
