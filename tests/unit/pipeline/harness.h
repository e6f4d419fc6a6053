/* Small helpers for the manager's direct tests (one device, one activation
 * pool, one manager). */
#ifndef OFL_TEST_PIPELINE_HARNESS_H
#define OFL_TEST_PIPELINE_HARNESS_H

#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "tests/unit/pipeline/driver.h"

typedef struct {
  ofl_device_t *dev;
  ofl_pool_t *pool;
  ofl_manager_t *m;
} h_env_t;

static inline ofl_manager_params_t h_params(h_env_t *e) {
  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
  mp.device = e->dev;
  mp.device_pool = e->pool;
  mp.offload = 1;
  mp.groups = "";
  mp.min_offload_bytes = 1;
  mp.min_offload_elems = 0;
  mp.fraction = 1.0;
  mp.rank_delta_bytes = 0;
  mp.max_inflight = 0;
  mp.host_budget_bytes = 0;
  mp.rank = 0;
  return mp;
}

static inline void h_open_dev(h_env_t *e, int jitter_us, uint64_t seed) {
  memset(e, 0, sizeof *e);
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  dp.strict = 1;
  dp.jitter_seed = seed;
  dp.jitter_max_us = jitter_us;
  cr_assert(eq(int, ofl_device_open(&dp, &e->dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  pp.name = "activations";
  cr_assert(eq(int, ofl_pool_create(e->dev, &pp, &e->pool), OFL_SUCCESS));
}

static inline void h_open(h_env_t *e, int jitter_us, uint64_t seed) {
  h_open_dev(e, jitter_us, seed);
  ofl_manager_params_t mp = h_params(e);
  cr_assert(eq(int, ofl_manager_create(&mp, &e->m), OFL_SUCCESS), "%s",
            ofl_last_error());
}

static inline void h_close(h_env_t *e) {
  ofl_manager_destroy(e->m);
  ofl_pool_destroy(e->pool);
  ofl_device_close(e->dev);
}

static inline ofl_tensor_t *h_tensor(h_env_t *e, size_t bytes, uint64_t seed) {
  ofl_tensor_t *t = NULL;
  int64_t shape[1] = {(int64_t)bytes};
  cr_assert(eq(int,
               ofl_pool_alloc(e->pool, shape, 1, OFL_DTYPE_U8,
                              ofl_device_compute_stream(e->dev), &t),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  drv_fill(ofl_tensor_data(t), bytes, seed);
  return t;
}

#define H_OK(call)                                                             \
  cr_assert(eq(int, (call), OFL_SUCCESS), "%s: %s", #call, ofl_last_error())

static void h_sleep_fn(void *arg) { usleep((useconds_t)(uintptr_t)arg * 1000); }

/* Makes the stream busy for ms milliseconds (a slow copy engine). */
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
  size_t w = drv_wrong(ofl_tensor_data(t), bytes, seed);
  H_OK(ofl_tensor_destroy(t));
  return w;
}

#endif
