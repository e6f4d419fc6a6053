/* The tensor handle: dtypes, shapes, wrapped storage, views, release and
 * attach of storage. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"

/* On the backend under test (OFLTEST_BACKEND). Tensors wrapping host
 * buffers only look at the handle; device bytes are reached through
 * copies. */
static ofl_device_t *dev;

static void open_dev(void) {
  ofl_device_params_t p = t_device_params(50, 0);
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(tensor, .init = open_dev, .fini = close_dev);

typedef struct {
  atomic_int calls;
  void *data;
  size_t bytes;
  void *user;
} release_log_t;

static void log_release(void *data, size_t bytes, void *user) {
  release_log_t *log = user;
  log->data = data;
  log->bytes = bytes;
  log->user = user;
  atomic_fetch_add(&log->calls, 1);
}

Test(tensor, dtype_sizes_and_names_round_trip) {
  const size_t sizes[OFL_DTYPE_COUNT] = {4, 2, 2, 1, 1, 8, 4, 2, 1, 1, 1, 8, 2, 4, 8};
  for (int i = 0; i < OFL_DTYPE_COUNT; ++i) {
    cr_assert(eq(sz, ofl_dtype_size((ofl_dtype_t)i), sizes[i]));
    ofl_dtype_t d = OFL_DTYPE_COUNT;
    cr_assert(eq(int, ofl_dtype_parse(ofl_dtype_name((ofl_dtype_t)i), &d),
                 OFL_SUCCESS));
    cr_assert(eq(int, (int)d, i));
  }
  ofl_dtype_t d = OFL_DTYPE_COUNT;
  cr_assert(eq(int, ofl_dtype_parse("BF16", &d), OFL_SUCCESS));
  cr_assert(eq(int, (int)d, OFL_DTYPE_BF16));
  cr_assert(eq(int, ofl_dtype_parse("F8_E4M3", &d), OFL_SUCCESS));
  cr_assert(eq(int, (int)d, OFL_DTYPE_F8_E4M3));
  cr_assert(eq(sz, ofl_dtype_size((ofl_dtype_t)99), 0));
  cr_assert(eq(str, (char *)ofl_dtype_name((ofl_dtype_t)-1), "invalid"));
}

Test(tensor, unknown_dtype_name_is_rejected_with_message) {
  ofl_dtype_t d = OFL_DTYPE_I8;
  cr_assert(eq(int, ofl_dtype_parse("f12", &d), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, (int)d, OFL_DTYPE_I8)); /* output untouched */
  cr_assert(ne(ptr, strstr(ofl_last_error(), "f12"), NULL));
  cr_assert(eq(int, ofl_dtype_parse(NULL, &d), OFL_ERR_INVALID_ARG));
}

Test(tensor, shape_bytes_counts_scalars_zero_dims_and_products) {
  size_t b = 7;
  cr_assert(eq(int, ofl_shape_bytes(NULL, 0, OFL_DTYPE_I64, &b), OFL_SUCCESS));
  cr_assert(eq(sz, b, 8));
  int64_t s3[3] = {2, 3, 5};
  cr_assert(eq(int, ofl_shape_bytes(s3, 3, OFL_DTYPE_BF16, &b), OFL_SUCCESS));
  cr_assert(eq(sz, b, 60));
  int64_t z[2] = {4, 0};
  cr_assert(eq(int, ofl_shape_bytes(z, 2, OFL_DTYPE_F32, &b), OFL_SUCCESS));
  cr_assert(eq(sz, b, 0));
}

Test(tensor, invalid_shapes_dtypes_and_overflow_are_rejected) {
  size_t b = 123;
  int64_t neg[2] = {4, -1};
  cr_assert(
      eq(int, ofl_shape_bytes(neg, 2, OFL_DTYPE_F32, &b), OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "negative"), NULL));
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  cr_assert(eq(int, ofl_shape_bytes(nine, 9, OFL_DTYPE_F32, &b),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_shape_bytes(nine, -1, OFL_DTYPE_F32, &b),
               OFL_ERR_INVALID_ARG));
  int64_t big[3] = {INT64_MAX / 2, 4, 4};
  cr_assert(
      eq(int, ofl_shape_bytes(big, 3, OFL_DTYPE_F32, &b), OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "overflow"), NULL));
  int64_t one[1] = {1};
  cr_assert(eq(int, ofl_shape_bytes(one, 1, (ofl_dtype_t)42, &b),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_shape_bytes(NULL, 2, OFL_DTYPE_F32, &b),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_shape_bytes(one, 1, OFL_DTYPE_F32, NULL),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(sz, b, 123)); /* never written on failure */
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_tensor_create(neg, 2, OFL_DTYPE_F32, &t),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(ptr, t, NULL));
  cr_assert(eq(int, ofl_tensor_create(one, 1, OFL_DTYPE_F32, NULL),
               OFL_ERR_INVALID_ARG));
}

Test(tensor, wrap_exposes_fields_and_releases_once_on_destroy) {
  float *mem = malloc(6 * sizeof(float));
  for (int i = 0; i < 6; ++i)
    mem[i] = (float)i * 1.5f;
  release_log_t log = {0};
  int64_t shape[2] = {2, 3};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap(mem, shape, 2, OFL_DTYPE_F32, OFL_LOC_PINNED,
                               log_release, &log, &t),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(t), mem));
  cr_assert(eq(sz, ofl_tensor_bytes(t), 24));
  cr_assert(eq(sz, ofl_tensor_nelem(t), 6));
  cr_assert(eq(int, ofl_tensor_ndim(t), 2));
  cr_assert(eq(i64, ofl_tensor_shape(t)[0], 2));
  cr_assert(eq(i64, ofl_tensor_shape(t)[1], 3));
  cr_assert(eq(int, ofl_tensor_dtype(t), OFL_DTYPE_F32));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_PINNED));
  cr_assert(eq(ptr, ofl_tensor_pool(t), NULL));
  cr_assert(eq(sz, ofl_tensor_storage_bytes(t), 24));
  ofl_tensor_set_flags(t, OFL_TENSOR_NOT_OFFLOADABLE);
  cr_assert(eq(u32, ofl_tensor_flags(t), OFL_TENSOR_NOT_OFFLOADABLE));
  float *d = ofl_tensor_data(t);
  cr_assert(eq(flt, d[5], 7.5f));
  cr_assert(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log.calls), 1));
  cr_assert(eq(ptr, log.data, mem));
  cr_assert(eq(sz, log.bytes, 24));
  cr_assert(eq(ptr, log.user, &log));
  cr_assert(eq(int, ofl_tensor_destroy(NULL), OFL_SUCCESS));
  free(mem);
}

Test(tensor, wrap_rejects_null_data_and_bad_location) {
  int64_t shape[1] = {4};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap(NULL, shape, 1, OFL_DTYPE_F32, OFL_LOC_DEVICE,
                               NULL, NULL, &t),
               OFL_ERR_INVALID_ARG));
  char buf[16];
  cr_assert(eq(int,
               ofl_tensor_wrap(buf, shape, 1, OFL_DTYPE_F32, OFL_LOC_NONE, NULL,
                               NULL, &t),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int,
               ofl_tensor_wrap(buf, shape, 1, OFL_DTYPE_F32, OFL_LOC_DEVICE,
                               NULL, NULL, NULL),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(ptr, t, NULL));
}

Test(tensor, views_share_storage_and_the_last_handle_releases_it) {
  uint8_t *mem = malloc(64);
  for (int i = 0; i < 64; ++i)
    mem[i] = (uint8_t)i;
  release_log_t log = {0};
  int64_t shape[1] = {64};
  ofl_tensor_t *base = NULL, *view = NULL, *alias = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap(mem, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE,
                               log_release, &log, &base),
               OFL_SUCCESS));
  int64_t vs[2] = {4, 4};
  cr_assert(eq(int, ofl_tensor_view(base, 16, vs, 2, OFL_DTYPE_U8, &view),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_alias(base, &alias), OFL_SUCCESS));
  cr_assert(eq(ptr, (void *)ofl_tensor_storage_id(view),
               (void *)ofl_tensor_storage_id(base)));
  cr_assert(eq(ptr, (void *)ofl_tensor_storage_id(alias),
               (void *)ofl_tensor_storage_id(base)));
  uint8_t *vd = ofl_tensor_data(view);
  cr_assert(eq(u8, vd[0], 16));
  cr_assert(eq(u8, vd[15], 31));
  cr_assert(eq(ptr, ofl_tensor_data(alias), mem));
  cr_assert(eq(int, ofl_tensor_destroy(base), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage(alias), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log.calls), 0)); /* view still holds it */
  cr_assert(eq(u8, vd[3], 19));
  cr_assert(eq(int, ofl_tensor_destroy(view), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log.calls), 1));
  cr_assert(eq(int, ofl_tensor_destroy(alias), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log.calls), 1));
  free(mem);
}

Test(tensor, view_outside_the_storage_is_rejected) {
  char mem[32];
  int64_t shape[1] = {32};
  ofl_tensor_t *base = NULL, *view = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap(mem, shape, 1, OFL_DTYPE_U8, OFL_LOC_PINNED,
                               NULL, NULL, &base),
               OFL_SUCCESS));
  int64_t vs[1] = {8};
  cr_assert(eq(int, ofl_tensor_view(base, 25, vs, 1, OFL_DTYPE_U8, &view),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_tensor_view(base, SIZE_MAX, vs, 1, OFL_DTYPE_U8, &view),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_tensor_view(base, 24, vs, 1, OFL_DTYPE_U8, &view),
               OFL_SUCCESS));
  cr_assert(eq(ptr, ofl_tensor_data(view), mem + 24));
  ofl_tensor_destroy(view);
  ofl_tensor_destroy(base);
}

Test(tensor, release_keeps_the_handle_and_attach_gives_new_storage) {
  release_log_t log1 = {0}, log2 = {0};
  int32_t *a = malloc(40), *b = malloc(40);
  for (int i = 0; i < 10; ++i) {
    a[i] = i;
    b[i] = 100 + i;
  }
  int64_t shape[1] = {10};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap(a, shape, 1, OFL_DTYPE_I32, OFL_LOC_DEVICE,
                               log_release, &log1, &t),
               OFL_SUCCESS));
  cr_assert(ne(ptr, (void *)ofl_tensor_storage_id(t), NULL));
  cr_assert(eq(int, ofl_tensor_release_storage(t), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log1.calls), 1));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_NONE));
  cr_assert(eq(ptr, ofl_tensor_data(t), NULL));
  cr_assert(eq(int, ofl_tensor_has_storage(t), 0));
  cr_assert(eq(ptr, (void *)ofl_tensor_storage_id(t), NULL));
  cr_assert(eq(sz, ofl_tensor_bytes(t), 40)); /* shape kept */
  cr_assert(eq(i64, ofl_tensor_shape(t)[0], 10));
  cr_assert(eq(int, ofl_tensor_release_storage(t), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_tensor_attach(t, b, 8, OFL_LOC_PINNED, NULL, NULL),
               OFL_ERR_INVALID_ARG)); /* too small */
  cr_assert(eq(int,
               ofl_tensor_attach(t, b, 40, OFL_LOC_PINNED, log_release, &log2),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_attach(t, a, 40, OFL_LOC_PINNED, NULL, NULL),
               OFL_ERR_INVALID_USAGE));
  cr_assert(ne(ptr, (void *)ofl_tensor_storage_id(t), NULL));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_PINNED));
  int32_t *d = ofl_tensor_data(t);
  cr_assert(eq(i32, d[9], 109));
  cr_assert(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log2.calls), 1));
  cr_assert(eq(int, atomic_load(&log1.calls), 1));
  free(a);
  free(b);
}

static void sleep_ms(void *arg) { usleep((useconds_t)(uintptr_t)arg * 1000); }

/* n device bytes (i * mul + add) in *src and n pinned bytes in *dst: dst
 * pinned, since a copy to pageable memory may complete before the call
 * returns on a GPU, and the copy must still be queued at the release. */
static void copy_pair(size_t n, unsigned mul, unsigned add, uint8_t **src,
                      uint8_t **dst) {
  uint8_t *h = malloc(n);
  cr_assert(eq(int, ofl_pinned_malloc(dev, n, (void **)dst), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_malloc(dev, n, (void **)src), OFL_SUCCESS));
  for (size_t i = 0; i < n; ++i)
    h[i] = (uint8_t)(i * mul + add);
  cr_assert(eq(int, t_write(dev, *src, h, n), OFL_SUCCESS), "%s",
            ofl_last_error());
  free(h);
}

Test(tensor, stream_ordered_release_waits_for_the_queued_copy) {
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "d2h", &s), OFL_SUCCESS));
  size_t n = 1 << 16;
  uint8_t *src = NULL, *dst = NULL;
  copy_pair(n, 7, 3, &src, &dst);
  release_log_t log = {0};
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap(src, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE,
                               log_release, &log, &t),
               OFL_SUCCESS));
  /* Hold the stream so that the copy is still queued at the release. */
  cr_assert(eq(int, ofl_stream_launch_host_func(s, sleep_ms, (void *)30),
               OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_memcpy_async(dst, src, n, OFL_COPY_D2H, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage_after(t, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_NONE));
  cr_assert(eq(int, atomic_load(&log.calls), 0));
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log.calls), 1));
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i)
    wrong += dst[i] != (uint8_t)(i * 7 + 3);
  cr_assert(eq(sz, wrong, 0));
  cr_assert(
      eq(int, ofl_tensor_release_storage_after(t, NULL), OFL_ERR_INVALID_ARG));
  ofl_tensor_destroy(t);
  ofl_device_free(dev, src);
  ofl_stream_destroy(s);
  ofl_pinned_free(dev, dst);
}

typedef struct {
  release_log_t *log;
  int seen; /* log->calls when the host function ran */
} order_probe_t;

static void probe_release(void *arg) {
  order_probe_t *p = arg;
  p->seen = atomic_load(&p->log->calls);
}

/* OFL_WRAP_RELEASE_IN_HOST_FN: the ordered release runs after the copy
 * queued before it, with the same bytes; on the host backend on the
 * stream's timeline, before the work queued after it (a host function then
 * sees it done). */
Test(tensor, release_in_host_fn_runs_in_stream_order) {
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "d2h", &s), OFL_SUCCESS));
  size_t n = 1 << 16;
  uint8_t *src = NULL, *dst = NULL;
  copy_pair(n, 13, 5, &src, &dst);
  release_log_t log = {0};
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int,
               ofl_tensor_wrap_flags(src, shape, 1, OFL_DTYPE_U8,
                                     OFL_LOC_DEVICE, log_release, &log, 2u, &t),
               OFL_ERR_INVALID_ARG)); /* an unknown flag */
  cr_assert(eq(ptr, t, NULL));
  cr_assert(eq(int,
               ofl_tensor_wrap_flags(src, shape, 1, OFL_DTYPE_U8,
                                     OFL_LOC_DEVICE, log_release, &log,
                                     OFL_WRAP_RELEASE_IN_HOST_FN, &t),
               OFL_SUCCESS), "%s", ofl_last_error());
  order_probe_t before = {&log, -1}, after = {&log, -1};
  cr_assert(eq(int, ofl_stream_launch_host_func(s, sleep_ms, (void *)30),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_launch_host_func(s, probe_release, &before),
               OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_memcpy_async(dst, src, n, OFL_COPY_D2H, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage_after(t, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_launch_host_func(s, probe_release, &after),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_NONE));
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  cr_assert(eq(int, before.seen, 0));
  /* The host backend runs it as an operation of the stream; cuda's release
   * thread runs it once the copy completed (synchronize waits for it). */
  if (ofl_device_backend(dev) == OFL_BACKEND_HOST)
    cr_assert(eq(int, after.seen, 1));
  cr_assert(eq(int, atomic_load(&log.calls), 1));
  cr_assert(eq(ptr, log.data, src));
  cr_assert(eq(sz, log.bytes, n));
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i)
    wrong += dst[i] != (uint8_t)(i * 13 + 5);
  cr_assert(eq(sz, wrong, 0));
  /* Unordered releases are unchanged: at once, on this thread. */
  ofl_tensor_t *u = NULL;
  release_log_t log2 = {0};
  cr_assert(eq(int,
               ofl_tensor_wrap_flags(src, shape, 1, OFL_DTYPE_U8,
                                     OFL_LOC_DEVICE, log_release, &log2,
                                     OFL_WRAP_RELEASE_IN_HOST_FN, &u),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage(u), OFL_SUCCESS));
  cr_assert(eq(int, atomic_load(&log2.calls), 1));
  ofl_tensor_destroy(u);
  ofl_tensor_destroy(t);
  ofl_device_free(dev, src);
  ofl_stream_destroy(s);
  ofl_pinned_free(dev, dst);
}

Test(tensor, null_and_destroyed_handles_are_rejected) {
  cr_assert(eq(int, ofl_tensor_release_storage(NULL), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int,
               ofl_tensor_attach(NULL, NULL, 0, OFL_LOC_DEVICE, NULL, NULL),
               OFL_ERR_INVALID_ARG));
  ofl_tensor_t *v = NULL;
  cr_assert(eq(int, ofl_tensor_alias(NULL, &v), OFL_ERR_INVALID_ARG));
  int64_t shape[1] = {4};
  ofl_tensor_t *t = NULL;
  cr_assert(
      eq(int, ofl_tensor_create(shape, 1, OFL_DTYPE_F16, &t), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_location(t), OFL_LOC_NONE));
  cr_assert(eq(int, ofl_tensor_view(t, 0, shape, 1, OFL_DTYPE_U8, &v),
               OFL_ERR_INVALID_USAGE)); /* no storage to view */
  cr_assert(eq(ptr, v, NULL));
  cr_assert(eq(ptr, ofl_tensor_data(NULL), NULL));
  cr_assert(eq(sz, ofl_tensor_bytes(NULL), 0));
  ofl_tensor_destroy(t);
}
