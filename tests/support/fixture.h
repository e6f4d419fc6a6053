/* The manager tests' fixture: one device, its activation pool (device
 * memory, no budget) and one manager over them with the settings the tests
 * start from (every tensor of a byte or more, of every group, offloaded to
 * pinned memory without a budget), and the disk tier the schedule tests
 * add. Written once for the manager's Criterion tests (harness.h), the
 * schedule driver (driver.h) and the GPU schedule test (tests/gpu). Calls
 * return a status rather than assert: each caller reports in its own way. */
#ifndef OFL_TEST_FIXTURE_H
#define OFL_TEST_FIXTURE_H

#include <string.h>

#include <ofl/ofl.h>

typedef struct {
  ofl_device_t *dev;
  ofl_pool_t *pool; /* the activation pool */
  ofl_manager_t *m;
} t_env_t;

/* The activation pool of dev: device memory, no budget. */
static inline ofl_status_t t_env_open_pool(ofl_device_t *dev,
                                           ofl_pool_t **out) {
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  pp.name = "activations";
  return ofl_pool_create(dev, &pp, out);
}

/* The manager's settings the tests start from, on dev and pool. */
static inline ofl_manager_params_t t_env_manager_params(ofl_device_t *dev,
                                                        ofl_pool_t *pool) {
  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
  mp.device = dev;
  mp.device_pool = pool;
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

/* The disk tier of the schedule tests: files under /tmp for groups, no
 * budgets, checksums on, nothing kept in memory (every reload reads its file
 * and checks its checksum), the thread engine without O_DIRECT. */
static inline ofl_disk_params_t
t_env_disk_params(ofl_device_t *dev, const char *groups, int rank) {
  ofl_disk_params_t kp = OFL_DISK_PARAMS_INIT;
  kp.dev = dev;
  kp.dir = "/tmp";
  kp.budget_bytes = 0;
  kp.groups = groups;
  kp.bounce_budget_bytes = 0;
  kp.prefetch_groups = 2;
  kp.checksum = 1;
  kp.keep_bytes = 0;
  kp.direct = OFL_DISK_DIRECT_OFF;
  kp.engine = OFL_DISK_ENGINE_THREADS;
  kp.rank = rank;
  return kp;
}

/* Opens e's device with dp and its activation pool; no manager yet. On
 * failure e holds what was opened (t_env_close closes it). */
static inline ofl_status_t t_env_open(t_env_t *e,
                                      const ofl_device_params_t *dp) {
  memset(e, 0, sizeof *e);
  ofl_status_t s = ofl_device_open(dp, &e->dev);
  if (s != OFL_SUCCESS)
    return s;
  return t_env_open_pool(e->dev, &e->pool);
}

/* Closes what e holds, the manager first. */
static inline void t_env_close(t_env_t *e) {
  ofl_manager_destroy(e->m);
  ofl_pool_destroy(e->pool);
  ofl_device_close(e->dev);
}

#endif
