/* Teardown in any order: a device closed before the pools and the manager
 * that live on it (the close is deferred until the last of them is gone),
 * pools destroyed before or after the manager that uses them. Each order
 * ends cleanly and leaks nothing (the valgrind setup runs these). */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdint.h>
#include <string.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"
#include "tests/support/fixture.h"

TestSuite(pool_teardown);

/* The fixture's device, pool (here the application's reload pool) and
 * manager. */
typedef t_env_t env_t;

/* A device, an application pool given to a manager as its reload pool, and
 * one iteration that offloads and reloads a group, so that streams, events
 * and blocks of both pools are in use. */
static void open_env(env_t *e, int own_pool) {
  memset(e, 0, sizeof *e);
  ofl_device_params_t dp = t_device_params(20, 7);
  cr_assert(eq(int, ofl_device_open(&dp, &e->dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  if (own_pool) {
    ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
    pp.budget_bytes = 0;
    pp.name = "app";
    cr_assert(eq(int, ofl_pool_create(e->dev, &pp, &e->pool), OFL_SUCCESS));
  }
  ofl_manager_params_t mp = t_env_manager_params(e->dev, e->pool);
  cr_assert(eq(int, ofl_manager_create(&mp, &e->m), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_pool_t *src = e->pool != NULL ? e->pool : ofl_manager_device_pool(e->m);
  int64_t shape[1] = {64 * 1024};
  ofl_tensor_t *t = NULL;
  ofl_stream_t *cs = ofl_device_compute_stream(e->dev);
  cr_assert(eq(int, ofl_pool_alloc(src, shape, 1, OFL_DTYPE_U8, cs, &t),
               OFL_SUCCESS));
  cr_assert(
      eq(int, t_fill(e->dev, ofl_tensor_data(t), 64 * 1024, 5), OFL_SUCCESS));
  ofl_tag_t tag;
  cr_assert(eq(int, ofl_manager_chunk_begin(e->m, 1, 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_start(e->m, "mlp_norm"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_tensor_push(e->m, t, &tag), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_commit(e->m, "mlp_norm", NULL, 0, 0),
               OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_manager_group_backward_begin(e->m, "mlp_norm"), OFL_SUCCESS));
  ofl_tensor_t *back = NULL;
  cr_assert(eq(int, ofl_manager_tensor_pop(e->m, tag, &back), OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_assert(eq(sz, t_wrong(e->dev, ofl_tensor_data(back), 64 * 1024, 5), 0));
  cr_assert(eq(int, ofl_tensor_destroy(back), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_manager_group_backward_end(e->m, "mlp_norm"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_reset(e->m), OFL_SUCCESS), "%s",
            ofl_last_error());
}

/* As a new user would: the device first, then the pool, then the manager. */
Test(pool_teardown, device_then_pool_then_manager_ends_cleanly) {
  env_t e;
  open_env(&e, 1);
  ofl_device_close(e.dev);
  ofl_pool_destroy(e.pool);
  ofl_manager_destroy(e.m);
}

Test(pool_teardown, device_then_manager_then_pool_ends_cleanly) {
  env_t e;
  open_env(&e, 1);
  ofl_device_close(e.dev);
  ofl_manager_destroy(e.m);
  ofl_pool_destroy(e.pool);
}

Test(pool_teardown, pool_then_manager_then_device_ends_cleanly) {
  env_t e;
  open_env(&e, 1);
  ofl_pool_destroy(e.pool);
  ofl_manager_destroy(e.m);
  ofl_device_close(e.dev);
}

Test(pool_teardown, manager_then_device_then_pool_ends_cleanly) {
  env_t e;
  open_env(&e, 1);
  ofl_manager_destroy(e.m);
  ofl_device_close(e.dev);
  ofl_pool_destroy(e.pool);
}

/* The manager's own reload pool: the device closed before the manager. */
Test(pool_teardown, device_then_manager_with_its_own_pool_ends_cleanly) {
  env_t e;
  open_env(&e, 0);
  ofl_device_close(e.dev);
  ofl_manager_destroy(e.m);
}

/* A tensor popped from the manager's own pool outlives the manager and the
 * device close: the last release ends the pool, then the device. */
Test(pool_teardown, popped_tensor_outlives_manager_and_device) {
  env_t e;
  open_env(&e, 0);
  ofl_pool_t *own = ofl_manager_device_pool(e.m);
  int64_t shape[1] = {4096};
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(own, shape, 1, OFL_DTYPE_U8, NULL, &t),
               OFL_SUCCESS));
  ofl_device_close(e.dev);
  ofl_manager_destroy(e.m);
  cr_assert(eq(int, ofl_tensor_destroy(t), OFL_SUCCESS));
}
