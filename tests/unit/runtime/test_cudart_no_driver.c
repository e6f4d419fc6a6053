/* On a machine with no GPU and no NVIDIA driver (no /dev/nvidia*, no
 * libcuda.so.1) but a CUDA runtime installed, the real runtime answers
 * cudaErrorInsufficientDriver; ofl must say "no GPU or driver", not "the
 * driver is too old" (which sends people to upgrade a driver they do not
 * have). Runs against the real runtime, without the stand-in; skips on a
 * machine with a driver or without a runtime. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "runtime/cuda_api.h"

static void needs_a_machine_without_driver(void) {
  if (access("/dev/nvidiactl", F_OK) == 0 || access("/dev/nvidia0", F_OK) == 0)
    cr_skip_test("this machine has /dev/nvidia*");
  void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (drv != NULL) {
    dlclose(drv);
    cr_skip_test("this machine has the driver library libcuda.so.1");
  }
}

Test(cudart_no_driver, no_gpu_and_no_driver_is_not_called_a_driver_too_old) {
  needs_a_machine_without_driver();
  int n = -1;
  char why[512] = "";
  ofl_status_t st = ofl_backend_probe(OFL_BACKEND_CUDA, &n, why, sizeof why);
  char c[512] = "";
  ofl__cudart_choice(c, sizeof c);
  if (strstr(why, "cuda runtime was not found") != NULL)
    cr_skip_test("no CUDA runtime installed: %s", why);
  void *sim = NULL;
  *(void **)&sim = dlsym(RTLD_DEFAULT, "cudasim_get_stats");
  if (sim != NULL)
    cr_skip_test("the stand-in is loaded, not the real runtime");
  cr_log_info("runtime %s; reason: %s", c, why);
  cr_assert(eq(int, st, OFL_ERR_NO_DEVICE));
  cr_assert(ne(ptr, strstr(why, "no NVIDIA GPU or driver"), NULL), "%s", why);
  cr_assert(ne(ptr, strstr(why, "no libcuda.so.1"), NULL), "%s", why);
  cr_assert(eq(ptr, strstr(why, "too old"), NULL), "%s", why);
  /* auto falls back to the host backend and gives the same reason */
  setenv("OFL_BACKEND", "auto", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_device_t *dev = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_device_backend(dev), OFL_BACKEND_HOST));
  const char *r = ofl_device_selection_reason(dev);
  cr_assert(ne(ptr, strstr(r, "no NVIDIA GPU or driver"), NULL), "%s", r);
  ofl_device_close(dev);
}
