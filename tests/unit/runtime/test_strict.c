/* Strict mode of the host backend: missing waits show, misuse is reported.
 * Host backend only (registered for the host pass as host_only_runtime_strict):
 * the poison, the queued-use checks on free, the copy-kind checks and the
 * worker's bounded stream waits are the host backend's own; on cuda the
 * same misuse is the CUDA runtime's (the cudasim stand-in aborts on it).
 * The backend-neutral part (foreign and double frees) is in test_device.c. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>

static ofl_device_t *dev;

static void open_dev(void) {
  setenv("OFL_BACKEND", "host", 1);
  ofl_config_reload();
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.strict = 1;
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS));
  ofl_log_set_level(OFL_LOG_NONE);
}
static void close_dev(void) { ofl_device_close(dev); }
TestSuite(strict, .init = open_dev, .fini = close_dev);

static void slow(void *arg) {
  (void)arg;
  usleep(20000);
}

/* Writer stream: slow work, then memset. Reader stream copies the block out
 * with or without waiting on the writer's event; returns wrong bytes. */
static size_t run_pair(bool with_wait) {
  ofl_stream_t *w = NULL, *r = NULL;
  ofl_event_t *ev = NULL;
  ofl_stream_create(dev, "writer", &w);
  ofl_stream_create(dev, "reader", &r);
  ofl_event_create(dev, &ev);
  const size_t n = 1 << 16;
  void *d = NULL;
  unsigned char *h = calloc(1, n);
  ofl_device_malloc(dev, n, &d);
  ofl_stream_launch_host_func(w, slow, NULL);
  ofl_memset_async(d, 0x11, n, w);
  ofl_event_record(ev, w);
  if (with_wait)
    ofl_stream_wait_event(r, ev);
  ofl_memcpy_async(h, d, n, OFL_COPY_D2H, r);
  ofl_stream_synchronize(r, 10000);
  ofl_stream_synchronize(w, 10000);
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++)
    wrong += h[i] != 0x11;
  free(h);
  ofl_device_free(dev, d);
  ofl_event_destroy(ev);
  ofl_stream_destroy(w);
  ofl_stream_destroy(r);
  return wrong;
}

Test(strict, missing_wait_shows_as_wrong_data_and_the_wait_fixes_it) {
  cr_assert(gt(sz, run_pair(false), 0),
            "without the wait the reader must see poisoned bytes");
  cr_assert(eq(sz, run_pair(true), 0));
}

Test(strict, fresh_device_memory_is_poisoned) {
  ofl_stream_t *s = NULL;
  ofl_stream_create(dev, "s", &s);
  void *d = NULL;
  unsigned char h[512];
  ofl_device_malloc(dev, sizeof h, &d);
  ofl_memcpy_async(h, d, sizeof h, OFL_COPY_D2H, s);
  ofl_stream_synchronize(s, 10000);
  for (size_t i = 0; i < sizeof h; i++)
    cr_assert(eq(u8, h[i], 0xDB));
  ofl_device_free(dev, d);
  ofl_stream_destroy(s);
}

static void wait_flag(void *arg) {
  atomic_int *flag = arg;
  while (!atomic_load(flag))
    usleep(500);
}

Test(strict, freeing_a_block_used_by_a_queued_copy_is_an_error) {
  ofl_stream_t *s = NULL;
  ofl_stream_create(dev, "d2h", &s);
  atomic_int flag = 0;
  void *d = NULL, *pin = NULL;
  ofl_device_malloc(dev, 4096, &d);
  ofl_pinned_malloc(dev, 4096, &pin);
  ofl_memset_async(d, 0x5A, 4096, ofl_device_compute_stream(dev));
  ofl_stream_launch_host_func(s, wait_flag, &flag);
  ofl_memcpy_async(pin, d, 4096, OFL_COPY_D2H, s);
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_ERR_INVALID_USAGE));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "still use it"), NULL));
  cr_assert(eq(int, ofl_pinned_free(dev, pin), OFL_ERR_INVALID_USAGE));
  ofl_device_stats_t st;
  ofl_device_get_stats(dev, &st);
  cr_assert(eq(u64, st.strict_violations, 2));
  atomic_store(&flag, 1);
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  for (int i = 0; i < 4096; i++)
    cr_assert(eq(u8, ((unsigned char *)pin)[i], 0x5A), "data intact");
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_free(dev, pin), OFL_SUCCESS));
  ofl_stream_destroy(s);
}

Test(strict, foreign_and_double_frees_and_wrong_copy_kinds_are_rejected) {
  void *d = NULL;
  ofl_device_malloc(dev, 128, &d);
  char host[128];
  cr_assert(eq(int, ofl_device_free(dev, host), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_pinned_free(dev, d), OFL_ERR_INVALID_ARG));
  ofl_stream_t *s = ofl_device_compute_stream(dev);
  cr_assert(eq(int, ofl_memcpy_async(host, d, 128, OFL_COPY_H2D, s),
               OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "not device memory"), NULL));
  cr_assert(eq(int, ofl_memcpy_async(d, host, 256, OFL_COPY_H2D, s),
               OFL_ERR_INVALID_ARG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "overruns"), NULL));
  cr_assert(eq(int, ofl_memcpy_async(d, host, 128, (ofl_copy_kind_t)9, s),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_device_malloc(dev, 0, &d), OFL_ERR_INVALID_ARG));
}

Test(strict, a_wait_that_never_completes_becomes_a_stream_error) {
  setenv("OFL_WAIT_TIMEOUT_MS", "60", 1);
  ofl_config_reload();
  ofl_stream_t *a = NULL, *b = NULL;
  ofl_event_t *ev = NULL;
  ofl_stream_create(dev, "a", &a);
  ofl_stream_create(dev, "b", &b);
  ofl_event_create(dev, &ev);
  atomic_int flag = 0;
  ofl_stream_launch_host_func(a, wait_flag, &flag);
  ofl_event_record(ev, a);
  ofl_stream_wait_event(b, ev);
  cr_assert(eq(int, ofl_stream_synchronize(b, 5000), OFL_ERR_TIMEOUT));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "stream 'b'"), NULL));
  atomic_store(&flag, 1);
  ofl_stream_synchronize(a, 5000);
  ofl_event_destroy(ev);
  ofl_stream_destroy(a);
  ofl_stream_destroy(b);
  setenv("OFL_WAIT_TIMEOUT_MS", "120000", 1);
  ofl_config_reload();
}

static void count_release(void *data, size_t bytes, void *user) {
  (void)data;
  (void)bytes;
  atomic_fetch_add((atomic_int *)user, 1);
}

/* ofl_device_adopt_host_memory: the application's memory (here malloc'd)
 * is device memory for copies and for the manager's offload, which then
 * reads it in place (no copy into ofl's memory first) and releases it
 * through the wrap's callback after the D2H copy; refused again when off. */
Test(strict, adopted_host_memory_is_device_memory) {
  const size_t n = 3000;
  unsigned char *app = malloc(n), *back = malloc(n);
  for (size_t i = 0; i < n; i++)
    app[i] = (unsigned char)(i * 7 + 3);
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "s", &s), OFL_SUCCESS));
  void *pin = NULL;
  cr_assert(eq(int, ofl_pinned_malloc(dev, n, &pin), OFL_SUCCESS));
  /* not adopted: a D2H copy refuses host memory as its source */
  cr_assert(eq(int, ofl_memcpy_async(pin, app, n, OFL_COPY_D2H, s),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_device_adopt_host_memory(NULL, 1), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_device_adopt_host_memory(dev, 1), OFL_SUCCESS));
  memset(pin, 0, n);
  cr_assert(eq(int, ofl_memcpy_async(pin, app, n, OFL_COPY_D2H, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(back, pin, n, OFL_COPY_H2D, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  cr_assert(eq(int, memcmp(back, app, n), 0));
  /* ofl's pinned blocks stay host memory */
  cr_assert(eq(int, ofl_memcpy_async(back, pin, n, OFL_COPY_D2H, s),
               OFL_ERR_INVALID_ARG));

  /* the manager offloads adopted memory in place and reloads it */
  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
  mp.device = dev;
  mp.groups = "";
  mp.min_offload_bytes = 1;
  ofl_manager_t *m = NULL;
  cr_assert(eq(int, ofl_manager_create(&mp, &m), OFL_SUCCESS));
  atomic_int released = 0;
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL, *r = NULL;
  cr_assert(eq(int, ofl_tensor_wrap(app, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE,
                                    count_release, &released, &t),
               OFL_SUCCESS));
  ofl_tag_t tag = 0;
  cr_assert(eq(int, ofl_manager_chunk_begin(m, 1, 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_start(m, "g"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_tensor_push(m, t, &tag), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_commit(m, "g", NULL, 0, 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_synchronize(m, 10000), OFL_SUCCESS));
  ofl_manager_stats_t st;
  ofl_manager_get_stats(m, &st);
  cr_assert(eq(u64, st.offloaded_bytes, (uint64_t)n));
  cr_assert(eq(int, atomic_load(&released), 1)); /* after the D2H copy */
  cr_assert(eq(int, ofl_manager_group_backward_begin(m, "g"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_tensor_pop(m, tag, &r), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_backward_end(m, "g"), OFL_SUCCESS));
  cr_assert(ne(ptr, ofl_tensor_data(r), (void *)app)); /* reloaded */
  cr_assert(eq(int, ofl_memcpy_async(back, ofl_tensor_data(r), n, OFL_COPY_D2H, s),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  cr_assert(eq(int, memcmp(back, app, n), 0));
  ofl_tensor_destroy(r);
  cr_assert(eq(int, ofl_manager_reset(m), OFL_SUCCESS));
  ofl_manager_destroy(m);

  cr_assert(eq(int, ofl_device_adopt_host_memory(dev, 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(pin, app, n, OFL_COPY_D2H, s),
               OFL_ERR_INVALID_ARG));
  ofl_pinned_free(dev, pin);
  ofl_stream_destroy(s);
  free(app);
  free(back);
}
