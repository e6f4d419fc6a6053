/* One CUDA runtime per process, and why a runtime cannot be used. On the
 * cudasim stand-in, whose copy in tests/cudasim/cu12 plays libcudart.so.12
 * (CUDA 12.8) beside the usual libcudart.so.13: the cudasim pass only, with
 * both folders on the library path. This program links no CUDA runtime: ofl
 * loads one at the first cuda open, or uses the one a test loaded first (as
 * PyTorch would have). Each test sets the stand-in's variables before the
 * process's first CUDA call. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

#include "runtime/cuda_api.h"
#include "tests/cudasim/cudasim.h"

#define OK(call)                                                               \
  cr_assert(eq(int, (call), OFL_SUCCESS), "%s: %s", #call, ofl_last_error())

/* The stand-in's counters in the runtime loaded under soname, or skips when
 * it is not loaded or not the stand-in. */
static cudasim_stats_t stats_of(const char *soname) {
  void *h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
  cr_assert(ne(ptr, h, NULL), "%s is not loaded", soname);
  int (*get)(cudasim_stats_t *) = NULL;
  *(void **)&get = dlsym(h, "cudasim_get_stats");
  if (get == NULL)
    cr_skip_test("%s is not the cudasim stand-in", soname);
  cudasim_stats_t s;
  memset(&s, 0, sizeof s);
  cr_assert(eq(int, get(&s), 0));
  dlclose(h);
  return s;
}

static int loaded(const char *soname) {
  void *h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
  if (h != NULL)
    dlclose(h);
  return h != NULL;
}

/* Opens cuda device 0 and allocates through it: the allocation shows in the
 * counters of the runtime ofl uses. */
static void open_and_allocate(void) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_CUDA;
  dp.device_index = 0;
  ofl_device_t *dev = NULL;
  OK(ofl_device_open(&dp, &dev));
  void *d = NULL;
  OK(ofl_device_malloc(dev, 1 << 16, &d));
  OK(ofl_device_free(dev, d));
  ofl_device_close(dev);
}

static void choice(char *buf, size_t cap) {
  ofl__cudart_choice(buf, cap);
  cr_log_info("cuda runtime: %s", buf);
}

Test(cudart_load, a_runtime_the_process_loaded_is_used_not_a_second_one) {
  /* The application (PyTorch) brought its CUDA 12 runtime first. */
  void *app = dlopen("libcudart.so.12", RTLD_NOW | RTLD_LOCAL);
  cr_assert(ne(ptr, app, NULL), "the libcudart.so.12 stand-in: %s", dlerror());
  cr_assert(not(loaded("libcudart.so.13")));
  open_and_allocate();
  cr_assert(not(loaded("libcudart.so.13")),
            "ofl loaded a second CUDA runtime beside the process's");
  cudasim_stats_t s = stats_of("libcudart.so.12");
  cr_assert(eq(u64, s.device_mallocs, 1), "ofl allocated through the "
                                          "process's runtime");
  char c[512];
  choice(c, sizeof c);
  cr_assert(ne(ptr, strstr(c, "libcudart.so.12"), NULL), "%s", c);
  cr_assert(ne(ptr, strstr(c, "already loaded by the process"), NULL), "%s", c);
  dlclose(app);
}

Test(cudart_load, a_runtime_13_the_driver_refuses_gives_way_to_12) {
  /* A driver for CUDA 12.8 (older than r580): the .so.13 answers
   * cudaErrorInsufficientDriver at its first call, the .so.12 works. */
  setenv("CUDASIM_DRIVER_VERSION", "12080", 1);
  int n = 0;
  char why[512] = "";
  cr_assert(eq(int, ofl_backend_probe(OFL_BACKEND_CUDA, &n, why, sizeof why),
               OFL_SUCCESS),
            "%s", why);
  cr_assert(eq(int, n, 2), "the stand-in's two devices");
  open_and_allocate();
  cudasim_stats_t s = stats_of("libcudart.so.12");
  cr_assert(eq(u64, s.device_mallocs, 1));
  char c[512];
  choice(c, sizeof c);
  cr_assert(ne(ptr, strstr(c, "libcudart.so.12"), NULL), "%s", c);
  cr_assert(ne(ptr, strstr(c, "refused libcudart.so.13"), NULL), "%s", c);
}

Test(cudart_load, without_an_old_driver_ofl_loads_the_13) {
  open_and_allocate();
  cr_assert(not(loaded("libcudart.so.12")), "no second runtime tried");
  cudasim_stats_t s = stats_of("libcudart.so.13");
  cr_assert(eq(u64, s.device_mallocs, 1));
  char c[512];
  choice(c, sizeof c);
  cr_assert(ne(ptr, strstr(c, "libcudart.so.13"), NULL), "%s", c);
  cr_assert(ne(ptr, strstr(c, "loaded by ofl"), NULL), "%s", c);
}

/* ---- why a runtime cannot be used ---------------------------------------- */

static void probe_fails(char *why, size_t cap) {
  int n = -1;
  cr_assert(eq(int, ofl_backend_probe(OFL_BACKEND_CUDA, &n, why, cap),
               OFL_ERR_NO_DEVICE));
  cr_assert(eq(int, n, 0));
  cr_log_info("reason: %s", why);
}

Test(cudart_load, a_driver_too_old_for_both_runtimes_says_so_with_versions) {
  setenv("CUDASIM_DRIVER_VERSION", "12000", 1);
  char why[512];
  probe_fails(why, sizeof why);
  cr_assert(ne(ptr, strstr(why, "the driver is too old"), NULL), "%s", why);
  cr_assert(ne(ptr, strstr(why, "driver CUDA 12.0"), NULL), "%s", why);
  cr_assert(ne(ptr, strstr(why, "libcudart.so.13 CUDA 13.0"), NULL), "%s", why);
  cr_assert(ne(ptr, strstr(why, "libcudart.so.12 was refused too"), NULL), "%s",
            why);
  cr_assert(eq(ptr, strstr(why, "no NVIDIA GPU"), NULL), "%s", why);
}

Test(cudart_load, no_visible_device_names_cuda_visible_devices) {
  setenv("CUDASIM_DEVICES", "0", 1);
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  char why[512];
  probe_fails(why, sizeof why);
  cr_assert(ne(ptr, strstr(why, "no cuda device visible"), NULL), "%s", why);
  cr_assert(ne(ptr, strstr(why, "CUDA_VISIBLE_DEVICES=''"), NULL), "%s", why);
  cr_assert(eq(ptr, strstr(why, "too old"), NULL), "%s", why);
}

Test(cudart_load,
     no_device_without_cuda_visible_devices_says_the_driver_has_none) {
  unsetenv("CUDA_VISIBLE_DEVICES");
  setenv("CUDASIM_DEVICES", "0", 1);
  char why[512];
  probe_fails(why, sizeof why);
  cr_assert(ne(ptr, strstr(why, "no cuda device"), NULL), "%s", why);
  cr_assert(eq(ptr, strstr(why, "CUDA_VISIBLE_DEVICES"), NULL), "%s", why);
}

Test(cudart_load, a_runtime_not_found_says_so_and_names_the_variable) {
  setenv("OFL_CUDART_LIBRARY", "libofl-test-no-such-cudart.so.0", 1);
  char why[512];
  probe_fails(why, sizeof why);
  cr_assert(ne(ptr, strstr(why, "cuda runtime was not found"), NULL), "%s",
            why);
  cr_assert(ne(ptr, strstr(why, "OFL_CUDART_LIBRARY"), NULL), "%s", why);
  char c[64] = "x";
  ofl__cudart_choice(c, sizeof c);
  cr_assert(eq(str, c, ""), "no runtime chosen");
}
