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

/* A tensor handle. Read its fields through the accessors; the layout is
 * public only so that it can live on the stack or inside user structs. */
typedef struct ofl_tensor ofl_tensor_t;

/* Called when external storage wrapped by ofl_tensor_wrap is released. */
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
/* Destroys the handle, releasing its storage (pool block back to its pool,
 * external memory through its release callback). NULL is accepted. */
OFL_API ofl_status_t ofl_tensor_destroy(ofl_tensor_t *t);

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
/* The identity of the storage, equal for two handles that share it. */
OFL_API const void *ofl_tensor_storage_id(const ofl_tensor_t *t);

OFL_EXTERN_C_END

#endif /* OFL_TENSOR_H */
