/* ofl: the tensor handle: dtypes, shapes, wrapped external storage, views,
 * and the release/attach of storage while a handle lives. Pool blocks are
 * handled by pool/pool.c. */
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "pool/pool_internal.h"
#include "runtime/device_internal.h"
#include "runtime/internal.h"

static const struct {
  const char *name;
  const char *st_name; /* safetensors */
  size_t size;
} dtype_info[OFL_DTYPE_COUNT] = {
    [OFL_DTYPE_F32] = {"f32", "F32", 4},
    [OFL_DTYPE_F16] = {"f16", "F16", 2},
    [OFL_DTYPE_BF16] = {"bf16", "BF16", 2},
    [OFL_DTYPE_F8_E4M3] = {"f8_e4m3", "F8_E4M3", 1},
    [OFL_DTYPE_F8_E5M2] = {"f8_e5m2", "F8_E5M2", 1},
    [OFL_DTYPE_I64] = {"i64", "I64", 8},
    [OFL_DTYPE_I32] = {"i32", "I32", 4},
    [OFL_DTYPE_I16] = {"i16", "I16", 2},
    [OFL_DTYPE_I8] = {"i8", "I8", 1},
    [OFL_DTYPE_U8] = {"u8", "U8", 1},
    [OFL_DTYPE_BOOL] = {"bool", "BOOL", 1},
    [OFL_DTYPE_F64] = {"f64", "F64", 8},
    [OFL_DTYPE_U16] = {"u16", "U16", 2},
    [OFL_DTYPE_U32] = {"u32", "U32", 4},
    [OFL_DTYPE_U64] = {"u64", "U64", 8},
};

static bool dtype_valid(ofl_dtype_t dtype) {
  return (int)dtype >= 0 && dtype < OFL_DTYPE_COUNT;
}

size_t ofl_dtype_size(ofl_dtype_t dtype) {
  return dtype_valid(dtype) ? dtype_info[dtype].size : 0;
}

const char *ofl_dtype_name(ofl_dtype_t dtype) {
  return dtype_valid(dtype) ? dtype_info[dtype].name : "invalid";
}

ofl_status_t ofl_dtype_parse(const char *name, ofl_dtype_t *out) {
  static const struct {
    const char *alias;
    ofl_dtype_t dtype;
  } aliases[] = {
      {"float32", OFL_DTYPE_F32},   {"float16", OFL_DTYPE_F16},
      {"bfloat16", OFL_DTYPE_BF16}, {"int64", OFL_DTYPE_I64},
      {"int32", OFL_DTYPE_I32},     {"int16", OFL_DTYPE_I16},
      {"int8", OFL_DTYPE_I8},       {"uint8", OFL_DTYPE_U8},
      {"float64", OFL_DTYPE_F64},   {"uint16", OFL_DTYPE_U16},
      {"uint32", OFL_DTYPE_U32},    {"uint64", OFL_DTYPE_U64},
  };
  if (name == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_dtype_parse: name and out must not be NULL");
  for (int i = 0; i < OFL_DTYPE_COUNT; ++i) {
    if (strcasecmp(name, dtype_info[i].name) == 0) {
      *out = (ofl_dtype_t)i;
      return OFL_SUCCESS;
    }
  }
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; ++i) {
    if (strcasecmp(name, aliases[i].alias) == 0) {
      *out = aliases[i].dtype;
      return OFL_SUCCESS;
    }
  }
  return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                    "unknown dtype '%s'; use one of f64 f32 f16 bf16 "
                    "f8_e4m3 f8_e5m2 i64 i32 i16 i8 u64 u32 u16 u8 bool",
                    name);
}

ofl_status_t ofl_shape_bytes(const int64_t *shape, int ndim, ofl_dtype_t dtype,
                             size_t *out) {
  if (!dtype_valid(dtype))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "invalid dtype %d; use an ofl_dtype_t value", (int)dtype);
  if (ndim < 0 || ndim > OFL_MAX_DIMS)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ndim %d out of range; a tensor has 0 to %d dims", ndim,
                      OFL_MAX_DIMS);
  if (ndim > 0 && shape == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "shape is NULL with ndim %d", ndim);
  if (out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_shape_bytes: out must not be NULL");
  size_t bytes = dtype_info[dtype].size;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] < 0)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                        "dim %d is negative (%lld); dims must be >= 0", i,
                        (long long)shape[i]);
    if ((uint64_t)shape[i] > SIZE_MAX ||
        __builtin_mul_overflow(bytes, (size_t)shape[i], &bytes))
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                        "byte size of the shape overflows size_t at dim %d "
                        "(%lld); the tensor is too large",
                        i, (long long)shape[i]);
  }
  *out = bytes;
  return OFL_SUCCESS;
}

ofl_status_t ofl__tensor_set_shape(ofl_tensor_t *t, const int64_t *shape,
                                   int ndim, ofl_dtype_t dtype) {
  size_t bytes;
  OFL_CHECK(ofl_shape_bytes(shape, ndim, dtype, &bytes));
  t->bytes = bytes;
  t->ndim = ndim;
  t->dtype = dtype;
  for (int i = 0; i < OFL_MAX_DIMS; ++i)
    t->shape[i] = i < ndim ? shape[i] : 0;
  return OFL_SUCCESS;
}

static ofl_status_t handle_new(const int64_t *shape, int ndim,
                               ofl_dtype_t dtype, ofl_tensor_t **out) {
  ofl_tensor_t tmp;
  memset(&tmp, 0, sizeof tmp);
  OFL_CHECK(ofl__tensor_set_shape(&tmp, shape, ndim, dtype));
  ofl_tensor_t *t = malloc(sizeof *t);
  if (t == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                      "cannot allocate a tensor handle");
  *t = tmp;
  t->loc = OFL_LOC_NONE;
  t->state = OFL__TENSOR_LIVE;
  *out = t;
  return OFL_SUCCESS;
}

static bool is_live(const ofl_tensor_t *t) {
  return t != NULL && t->state == OFL__TENSOR_LIVE;
}

ofl_status_t ofl_tensor_create(const int64_t *shape, int ndim,
                               ofl_dtype_t dtype, ofl_tensor_t **out) {
  if (out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_create: out must not be NULL");
  return handle_new(shape, ndim, dtype, out);
}

static ofl_status_t check_loc(ofl_location_t loc) {
  if (loc != OFL_LOC_DEVICE && loc != OFL_LOC_PINNED && loc != OFL_LOC_DISK)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "invalid location %d for storage; use OFL_LOC_DEVICE, "
                      "OFL_LOC_PINNED or OFL_LOC_DISK",
                      (int)loc);
  return OFL_SUCCESS;
}

/* External storage's release interface (below). */
static const ofl__storage_ops_t external_ops;

static ofl_status_t external_new(void *data, size_t bytes, ofl_location_t loc,
                                 ofl_release_fn release, void *user,
                                 ofl__storage_t **out) {
  ofl__storage_t *st = calloc(1, sizeof *st);
  if (st == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_POOL,
                      "cannot allocate a storage record");
  st->base = data;
  st->bytes = bytes;
  st->loc = loc;
  st->kind = OFL__STORAGE_EXTERNAL;
  st->ops = &external_ops;
  atomic_init(&st->refs, 1);
  st->release = release;
  st->release_user = user;
  *out = st;
  return OFL_SUCCESS;
}

static void attach(ofl_tensor_t *t, ofl__storage_t *st, size_t offset) {
  t->st = st;
  t->st_gen = st->gen;
  t->offset = offset;
  t->data = st->base == NULL ? NULL : (char *)st->base + offset;
  t->loc = st->loc;
}

ofl_status_t ofl_tensor_wrap(void *data, const int64_t *shape, int ndim,
                             ofl_dtype_t dtype, ofl_location_t loc,
                             ofl_release_fn release, void *release_user,
                             ofl_tensor_t **out) {
  return ofl_tensor_wrap_flags(data, shape, ndim, dtype, loc, release,
                               release_user, 0, out);
}

ofl_status_t ofl_tensor_wrap_flags(void *data, const int64_t *shape, int ndim,
                                   ofl_dtype_t dtype, ofl_location_t loc,
                                   ofl_release_fn release, void *release_user,
                                   unsigned flags, ofl_tensor_t **out) {
  if (out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_wrap: out must not be NULL");
  if ((flags & ~(unsigned)OFL_WRAP_RELEASE_IN_HOST_FN) != 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_wrap_flags: unknown flags 0x%x (known: "
                      "OFL_WRAP_RELEASE_IN_HOST_FN)",
                      flags & ~(unsigned)OFL_WRAP_RELEASE_IN_HOST_FN);
  OFL_CHECK(check_loc(loc));
  ofl_tensor_t *t;
  OFL_CHECK(handle_new(shape, ndim, dtype, &t));
  if (data == NULL && t->bytes > 0) {
    size_t tb = t->bytes;
    free(t);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_wrap: data is NULL for %zu bytes", tb);
  }
  ofl__storage_t *st = NULL;
  ofl_status_t s =
      external_new(data, t->bytes, loc, release, release_user, &st);
  if (s != OFL_SUCCESS) {
    free(t);
    return s;
  }
  st->release_in_host_fn = (flags & OFL_WRAP_RELEASE_IN_HOST_FN) != 0;
  attach(t, st, 0);
  *out = t;
  return OFL_SUCCESS;
}

ofl_status_t ofl_tensor_attach(ofl_tensor_t *t, void *data,
                               size_t storage_bytes, ofl_location_t loc,
                               ofl_release_fn release, void *release_user) {
  if (!is_live(t))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_attach: tensor is NULL or already destroyed");
  OFL_CHECK(check_loc(loc));
  if (t->st != NULL)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_POOL,
                      "ofl_tensor_attach: tensor already has storage; release "
                      "it first (ofl_tensor_release_storage)");
  if (storage_bytes < t->bytes)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_attach: storage of %zu bytes is smaller "
                      "than the tensor's %zu bytes",
                      storage_bytes, t->bytes);
  if (data == NULL && storage_bytes > 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_attach: data is NULL for %zu bytes",
                      storage_bytes);
  ofl__storage_t *st = NULL;
  OFL_CHECK(external_new(data, storage_bytes, loc, release, release_user, &st));
  attach(t, st, 0);
  return OFL_SUCCESS;
}

ofl_status_t ofl_tensor_view(const ofl_tensor_t *base, size_t offset_bytes,
                             const int64_t *shape, int ndim, ofl_dtype_t dtype,
                             ofl_tensor_t **out) {
  if (!is_live(base) || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_view: base must be a live tensor and out "
                      "non-NULL");
  if (base->st == NULL)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_POOL,
                      "ofl_tensor_view: base has no storage (released); give "
                      "it storage before making views");
  ofl_tensor_t *t;
  OFL_CHECK(handle_new(shape, ndim, dtype, &t));
  ofl__storage_t *st = base->st;
  size_t off = base->offset;
  if (__builtin_add_overflow(off, offset_bytes, &off) || off > st->bytes ||
      t->bytes > st->bytes - off) {
    size_t tb = t->bytes;
    free(t);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_view: %zu bytes at offset %zu do not fit "
                      "in the storage of %zu bytes",
                      tb, offset_bytes, st->bytes - base->offset);
  }
  if (st->loc == OFL_LOC_DISK && off != 0) {
    free(t);
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_POOL,
                      "ofl_tensor_view: views at an offset of disk storage "
                      "are not supported");
  }
  ofl_status_t s = st->ops->ref(base);
  if (s != OFL_SUCCESS) {
    free(t);
    return s;
  }
  attach(t, st, off);
  t->st_gen = base->st_gen;
  t->flags = base->flags;
  *out = t;
  return OFL_SUCCESS;
}

ofl_status_t ofl_tensor_alias(const ofl_tensor_t *t, ofl_tensor_t **out) {
  if (!is_live(t))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_alias: tensor is NULL or destroyed");
  return ofl_tensor_view(t, 0, t->shape, t->ndim, t->dtype, out);
}

static void detach_fields(ofl_tensor_t *t) {
  t->st = NULL;
  t->data = NULL;
  t->offset = 0;
  t->loc = OFL_LOC_NONE;
}

static void external_free(ofl__storage_t *st) {
  if (st->release != NULL)
    st->release(st->base, st->bytes, st->release_user);
  free(st);
}

/* Drops one reference; the last one releases the memory. */
static void external_unref(void *arg) {
  ofl__storage_t *st = arg;
  if (atomic_fetch_sub(&st->refs, 1) == 1)
    external_free(st);
}

/* External storage: detaches t (the last handle releases the memory,
 * through the stream's timeline when stream is non-NULL). */
static ofl_status_t release_external(ofl_tensor_t *t, ofl_stream_t *stream) {
  ofl__storage_t *st = t->st;
  detach_fields(t);
  if (stream == NULL) {
    external_unref(st);
    return OFL_SUCCESS;
  }
  /* This handle's reference goes only once the work queued on stream (the
   * copies that read the memory) completed, whether or not other handles
   * share the storage: so the caller never waits, and whoever drops the
   * last reference frees it after every use it queued. The release callback
   * runs on an ofl thread or at a synchronize of the stream, never inside a
   * host function (include/ofl/tensor.h), unless its owner said it may. */
  ofl_status_t s = st->release_in_host_fn
                       ? ofl__stream_launch_release(stream, external_unref, st)
                       : ofl__device_defer(stream, external_unref, st);
  if (s == OFL_SUCCESS)
    return OFL_SUCCESS;
  /* Could not defer: order it by waiting instead. */
  s = ofl_stream_synchronize(stream, OFL_TIMEOUT_DEFAULT);
  if (s != OFL_SUCCESS) {
    OFL_WARN(OFL_SUBSYS_POOL,
             "external storage %p bytes %zu not released: its stream did "
             "not drain",
             st->base, st->bytes);
    return s;
  }
  external_unref(st);
  return OFL_SUCCESS;
}

/* Ends a handle without storage: back to its pool's cache, or freed. */
static void handle_end(ofl_tensor_t *t) {
  if (t->home != NULL) {
    ofl__pool_handle_put(t);
    return;
  }
  t->state = OFL__TENSOR_DEAD;
  free(t);
}

static ofl_status_t external_release(ofl_tensor_t *t, ofl_stream_t *stream,
                                     bool end_handle) {
  OFL_CHECK(release_external(t, stream));
  if (end_handle)
    handle_end(t);
  return OFL_SUCCESS;
}

static ofl_status_t external_ref(const ofl_tensor_t *t) {
  atomic_fetch_add(&t->st->refs, 1);
  return OFL_SUCCESS;
}

static const ofl__storage_ops_t external_ops = {
    .release = external_release,
    .ref = external_ref,
};

static ofl_status_t release(ofl_tensor_t *t, ofl_stream_t *stream,
                            const char *what) {
  if (!is_live(t))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "%s: tensor is NULL or already destroyed", what);
  if (t->st == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "%s: tensor has no storage (already released)", what);
  /* The event that orders the release would be recorded into the graph
   * and could never be waited for outside it. */
  if (stream != NULL && ofl__stream_capturing(stream))
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_POOL,
                      "%s: stream '%s' is being captured into a CUDA graph; "
                      "release before or after the capture",
                      what, ofl_stream_name(stream));
  return t->st->ops->release(t, stream, false);
}

ofl_status_t ofl_tensor_release_storage(ofl_tensor_t *t) {
  return release(t, NULL, "ofl_tensor_release_storage");
}

ofl_status_t ofl_tensor_release_storage_after(ofl_tensor_t *t,
                                              ofl_stream_t *stream) {
  if (stream == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_release_storage_after: stream is NULL; use "
                      "ofl_tensor_release_storage for an unordered release");
  return release(t, stream, "ofl_tensor_release_storage_after");
}

ofl_status_t ofl_tensor_destroy(ofl_tensor_t *t) {
  if (t == NULL)
    return OFL_SUCCESS;
  if (t->state != OFL__TENSOR_LIVE)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL,
                      "ofl_tensor_destroy: tensor %p already destroyed",
                      (void *)t);
  if (t->st != NULL)
    return t->st->ops->release(t, NULL, true);
  handle_end(t);
  return OFL_SUCCESS;
}

ofl_status_t ofl_tensor_destroy_slot(ofl_tensor_t **slot, ofl_stream_t *after) {
  if (slot == NULL || *slot == NULL)
    return OFL_SUCCESS;
  ofl_tensor_t *t = *slot;
  if (after != NULL && t->st != NULL)
    OFL_CHECK(ofl_tensor_release_storage_after(t, after));
  OFL_CHECK(ofl_tensor_destroy(t));
  *slot = NULL; /* in the same call: the slot never names a dead handle */
  return OFL_SUCCESS;
}

void *ofl_tensor_data(const ofl_tensor_t *t) { return t ? t->data : NULL; }
size_t ofl_tensor_bytes(const ofl_tensor_t *t) { return t ? t->bytes : 0; }

size_t ofl_tensor_nelem(const ofl_tensor_t *t) {
  if (t == NULL)
    return 0;
  size_t n = 1;
  for (int i = 0; i < t->ndim; ++i)
    n *= (size_t)t->shape[i]; /* cannot overflow: bytes did not */
  return n;
}

int ofl_tensor_ndim(const ofl_tensor_t *t) { return t ? t->ndim : 0; }
const int64_t *ofl_tensor_shape(const ofl_tensor_t *t) {
  return t ? t->shape : NULL;
}
ofl_dtype_t ofl_tensor_dtype(const ofl_tensor_t *t) {
  return t ? t->dtype : OFL_DTYPE_COUNT;
}
ofl_location_t ofl_tensor_location(const ofl_tensor_t *t) {
  return t ? t->loc : OFL_LOC_NONE;
}
unsigned ofl_tensor_flags(const ofl_tensor_t *t) { return t ? t->flags : 0; }
void ofl_tensor_set_flags(ofl_tensor_t *t, unsigned flags) {
  if (t != NULL)
    t->flags = flags;
}

const void *ofl_tensor_storage_id(const ofl_tensor_t *t) {
  return t ? (const void *)t->st : NULL;
}
size_t ofl_tensor_storage_bytes(const ofl_tensor_t *t) {
  return t && t->st ? t->st->bytes : 0;
}
int ofl_tensor_has_storage(const ofl_tensor_t *t) {
  return t != NULL && t->st != NULL;
}
