/* The part of libofl's C API that the extension module ofl._ext calls, declared
 * here so that the extension builds without ofl's headers or library (a pip
 * install of python/ alone). libofl is loaded at run time by ofl._lib
 * (ctypes); ofl._ext receives the addresses of these functions from it.
 *
 * The declarations must match ofl's public headers. tests/python/ext_abi_check.c
 * includes this file after <ofl/ofl.h> with OFL_EXT_ABI_WITH_OFL_HEADERS
 * defined (the ext_* enum types are then ofl's own) and checks at compile
 * time that every function type below is the type of ofl's function, that
 * ofl's enums are int-sized and that the constants have ofl's values. */
#ifndef OFL_EXT_ABI_H
#define OFL_EXT_ABI_H

#include <stddef.h>
#include <stdint.h>

/* Opaque handles: the same tags as ofl's (a repeated typedef is valid C11). */
typedef struct ofl_tensor ofl_tensor_t;
typedef struct ofl_pool ofl_pool_t;
typedef struct ofl_stream ofl_stream_t;
typedef struct ofl_manager ofl_manager_t;
typedef uint64_t ofl_tag_t;

#ifdef OFL_EXT_ABI_WITH_OFL_HEADERS
typedef ofl_status_t ext_status_t;
typedef ofl_dtype_t ext_dtype_t;
typedef ofl_location_t ext_location_t;
typedef ofl_release_fn ext_release_fn;
#else
/* ofl's enums; int-sized (checked), passed as int. */
typedef int ext_status_t;
typedef int ext_dtype_t;
typedef int ext_location_t;
typedef void (*ext_release_fn)(void *data, size_t bytes, void *user);
#endif

#define EXT_SUCCESS 0
#define EXT_ERR_NO_MEMORY 4
#define EXT_DTYPE_U8 9
#define EXT_LOC_DEVICE 1
#define EXT_WRAP_RELEASE_IN_HOST_FN 1u

/* X(name, return type, parameter list): one entry per function. */
#define OFL_EXT_FUNCTIONS(X)                                                   \
  X(ofl_pool_alloc, ext_status_t,                                              \
    (ofl_pool_t * pool, const int64_t *shape, int ndim, ext_dtype_t dtype,     \
     ofl_stream_t *stream, ofl_tensor_t **out))                                \
  X(ofl_tensor_wrap, ext_status_t,                                             \
    (void *data, const int64_t *shape, int ndim, ext_dtype_t dtype,            \
     ext_location_t loc, ext_release_fn release, void *release_user,           \
     ofl_tensor_t **out))                                                      \
  X(ofl_tensor_wrap_flags, ext_status_t,                                       \
    (void *data, const int64_t *shape, int ndim, ext_dtype_t dtype,            \
     ext_location_t loc, ext_release_fn release, void *release_user,           \
     unsigned flags, ofl_tensor_t **out))                                      \
  X(ofl_tensor_view, ext_status_t,                                             \
    (const ofl_tensor_t *base, size_t offset_bytes, const int64_t *shape,      \
     int ndim, ext_dtype_t dtype, ofl_tensor_t **out))                         \
  X(ofl_tensor_alias, ext_status_t,                                            \
    (const ofl_tensor_t *t, ofl_tensor_t **out))                               \
  X(ofl_tensor_destroy, ext_status_t, (ofl_tensor_t * t))                      \
  X(ofl_tensor_data, void *, (const ofl_tensor_t *t))                          \
  X(ofl_tensor_has_storage, int, (const ofl_tensor_t *t))                      \
  X(ofl_tensor_release_storage_after, ext_status_t,                            \
    (ofl_tensor_t * t, ofl_stream_t *stream))                                  \
  X(ofl_manager_tensor_push, ext_status_t,                                     \
    (ofl_manager_t * m, ofl_tensor_t *t, ofl_tag_t *tag))                      \
  X(ofl_manager_tensor_pop, ext_status_t,                                      \
    (ofl_manager_t * m, ofl_tag_t tag, ofl_tensor_t **out))                    \
  X(ofl_manager_group_start, ext_status_t,                                     \
    (ofl_manager_t * m, const char *name))                                     \
  X(ofl_manager_group_commit, ext_status_t,                                    \
    (ofl_manager_t * m, const char *name, ofl_tensor_t *const *forced_release, \
     size_t n, int delay))                                                     \
  X(ofl_manager_group_backward_begin, ext_status_t,                            \
    (ofl_manager_t * m, const char *name))                                     \
  X(ofl_manager_group_backward_end, ext_status_t,                              \
    (ofl_manager_t * m, const char *name))

#define OFL_EXT__FN_TYPE(name, ret, params) typedef ret(*ext_##name##_fn) params;
OFL_EXT_FUNCTIONS(OFL_EXT__FN_TYPE)
#undef OFL_EXT__FN_TYPE

#endif /* OFL_EXT_ABI_H */
