/* OFL_BACKEND=auto on a machine where CUDA cannot be used picks the host
 * backend and says why at INFO (a machine without a GPU is normal), telling
 * "no device" apart from "driver too old". Needs the cudasim stand-in to
 * play those machines (registered for the cudasim pass only; skips where
 * the real runtime or none is loaded). Each test sets the stand-in's
 * variables before the process's first CUDA call (the device open). */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

#include "tests/support/devmem.h"

typedef struct {
  int info, warn;
  char last[1024];
} capture_t;

static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  (void)subsys;
  capture_t *c = user;
  if (strstr(msg, "auto: host backend") == NULL)
    return;
  c->info += level == OFL_LOG_INFO;
  c->warn += level == OFL_LOG_WARN;
  snprintf(c->last, sizeof c->last, "%s", msg);
}

/* Opens with auto and checks the fallback and its reason. */
static void expect_host_because(const char *why) {
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_INFO);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_BACKEND", "auto", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_device_t *dev = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  /* Asked after the open: the library may load the CUDA runtime lazily
   * (RTLD_GLOBAL), so the stand-in's symbols show only once it probed. */
  cudasim_stats_t st;
  if (!t_sim_stats(&st)) {
    ofl_device_close(dev);
    ofl_log_set_handler(NULL, NULL);
    cr_skip_test("needs the cudasim stand-in");
  }
  cr_assert(eq(int, ofl_device_backend(dev), OFL_BACKEND_HOST));
  const char *reason = ofl_device_selection_reason(dev);
  cr_assert(ne(ptr, strstr(reason, why), NULL), "reason: %s", reason);
  cr_assert(eq(int, c.info, 1), "the reason is logged once at INFO");
  cr_assert(eq(int, c.warn, 0), "a machine without a GPU is no warning");
  cr_assert(ne(ptr, strstr(c.last, why), NULL), "%s", c.last);
  ofl_device_close(dev);
  ofl_log_set_handler(NULL, NULL);
}

Test(backend_reason, no_device_says_no_cuda_device) {
  setenv("CUDASIM_DEVICES", "0", 1);
  expect_host_because("no cuda device");
}

Test(backend_reason, old_driver_says_too_old) {
  setenv("CUDASIM_DRIVER_VERSION", "12000", 1);
  expect_host_because("too old");
}
