/* Small helpers for the manager's direct tests (one device, one activation
 * pool, one manager: tests/support/fixture.h), on the backend under test
 * (OFLTEST_BACKEND, see tests/support/devmem.h): device bytes are filled and
 * checked through copies. */
#ifndef OFL_TEST_PIPELINE_HARNESS_H
#define OFL_TEST_PIPELINE_HARNESS_H

#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "tests/support/driver.h"
#include "tests/support/fixture.h"

/* The fixture (fixture.h) under the manager tests' names. */
typedef t_env_t h_env_t;

static inline ofl_manager_params_t h_params(h_env_t *e) {
  return t_env_manager_params(e->dev, e->pool);
}

/* The device of the backend under test (strict mode with jitter on the host
 * one) and its activation pool. */
static inline void h_open_dev(h_env_t *e, int jitter_us, uint64_t seed) {
  ofl_device_params_t dp = t_device_params(jitter_us, seed);
  cr_assert(eq(int, t_env_open(e, &dp), OFL_SUCCESS), "%s", ofl_last_error());
}

static inline void h_open(h_env_t *e, int jitter_us, uint64_t seed) {
  h_open_dev(e, jitter_us, seed);
  ofl_manager_params_t mp = h_params(e);
  cr_assert(eq(int, ofl_manager_create(&mp, &e->m), OFL_SUCCESS), "%s",
            ofl_last_error());
}

static inline void h_close(h_env_t *e) { t_env_close(e); }

static inline ofl_tensor_t *h_tensor(h_env_t *e, size_t bytes, uint64_t seed) {
  ofl_tensor_t *t = NULL;
  int64_t shape[1] = {(int64_t)bytes};
  cr_assert(eq(int,
               ofl_pool_alloc(e->pool, shape, 1, OFL_DTYPE_U8,
                              ofl_device_compute_stream(e->dev), &t),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_assert(eq(int, t_tensor_fill(e->dev, t, bytes, seed), OFL_SUCCESS), "%s",
            ofl_last_error());
  return t;
}

/* Wrong bytes of tensor t (device or pinned) against the pattern of seed,
 * read after the compute stream's queued work. */
static inline size_t h_wrong(h_env_t *e, const ofl_tensor_t *t, size_t bytes,
                             uint64_t seed) {
  size_t w = t_tensor_wrong(e->dev, t, bytes, seed);
  cr_assert(not(eq(sz, w, SIZE_MAX)), "reading the tensor back: %s",
            ofl_last_error());
  return w;
}

/* Leaves a free block of `bytes` in the activation pool with no queued work
 * on it, ahead of the blocks freed later: the next allocation of that shape
 * takes it. A test of an ordering rule uses it so that a reload does not
 * get back the very block whose pending copy would order it (or overwrite
 * it) by accident, which hides a missing wait. */
static inline void h_spare(h_env_t *e, size_t bytes) {
  ofl_tensor_t *t = NULL;
  int64_t shape[1] = {(int64_t)bytes};
  cr_assert(eq(int,
               ofl_pool_alloc(e->pool, shape, 1, OFL_DTYPE_U8,
                              ofl_device_compute_stream(e->dev), &t),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_assert(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS), "%s",
            ofl_last_error());
}

/* A tensor of the activation pool holding bytes copied from src (the
 * pattern made beforehand, so that the copy follows at once). */
static inline ofl_tensor_t *h_tensor_from(h_env_t *e, const void *src,
                                          size_t bytes) {
  ofl_tensor_t *t = NULL;
  int64_t shape[1] = {(int64_t)bytes};
  cr_assert(eq(int,
               ofl_pool_alloc(e->pool, shape, 1, OFL_DTYPE_U8,
                              ofl_device_compute_stream(e->dev), &t),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_assert(
      eq(int, t_write(e->dev, ofl_tensor_data(t), src, bytes), OFL_SUCCESS),
      "%s", ofl_last_error());
  return t;
}

#define H_OK(call)                                                             \
  cr_assert(eq(int, (call), OFL_SUCCESS), "%s: %s", #call, ofl_last_error())

static inline void h_sleep_fn(void *arg) {
  usleep((useconds_t)(uintptr_t)arg * 1000);
}

/* Makes the stream busy for ms milliseconds (a slow copy engine). The host
 * function only sleeps: no ofl or CUDA call (allowed on both backends). */
static inline void h_stall(ofl_stream_t *s, unsigned ms) {
  H_OK(ofl_stream_launch_host_func(s, h_sleep_fn, (void *)(uintptr_t)ms));
}

/* Pops tag and returns the number of wrong bytes against the pattern. */
static inline size_t h_pop_check(h_env_t *e, ofl_tag_t tag, size_t bytes,
                                 uint64_t seed) {
  ofl_tensor_t *t = NULL;
  H_OK(ofl_manager_tensor_pop(e->m, tag, &t));
  cr_assert(eq(sz, ofl_tensor_bytes(t), bytes));
  cr_assert(ofl_tensor_has_storage(t));
  H_OK(ofl_stream_synchronize(ofl_device_compute_stream(e->dev), -1));
  size_t w = t_tensor_wrong(e->dev, t, bytes, seed);
  cr_assert(not(eq(sz, w, SIZE_MAX)), "reading the tensor back: %s",
            ofl_last_error());
  H_OK(ofl_tensor_destroy(t));
  return w;
}

#endif
