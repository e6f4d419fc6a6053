/* Backend selection, on a machine with or without a usable CUDA device (a
 * GPU, the cudasim stand-in, or neither): auto picks cuda when a device is
 * usable and falls back to the host backend, saying why, when none is;
 * explicit cuda without a device is a clear error. Devices are hidden from
 * a test process (before its first CUDA call) with CUDA_VISIBLE_DEVICES=""
 * and, for the stand-in, CUDASIM_DEVICES=0, so that the fallback is tested
 * on every machine. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

/* Counts the log lines that give auto's fallback reason (at whatever level
 * the library logs it: INFO, a machine without a GPU being normal). */
typedef struct {
  int reasons;
  char last[1024];
} capture_t;

static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  (void)subsys;
  (void)level;
  capture_t *c = user;
  if (strstr(msg, "auto: host backend") != NULL) {
    c->reasons++;
    snprintf(c->last, sizeof c->last, "%s", msg);
  }
}

/* Whether the CUDA runtime (none in a build without the toolkit) sees a
 * device, asked directly rather than through ofl. libofl loads the runtime
 * itself at its first cuda open (dlopen, runtime/cuda_api.h): the test
 * loads the same soname first. */
static int cuda_device_usable(void) {
  int (*count)(int *) = NULL;
#if OFL_HAVE_CUDA
  if (dlopen("libcudart.so.13", RTLD_NOW | RTLD_GLOBAL) == NULL)
    (void)dlopen("libcudart.so.12", RTLD_NOW | RTLD_GLOBAL);
#endif
  *(void **)&count = dlsym(RTLD_DEFAULT, "cudaGetDeviceCount");
  int n = 0;
  return count != NULL && count(&n) == 0 && n > 0;
}

/* Hides every device from this process; only effective before its first
 * CUDA call, which is why each test process calls it first. */
static void hide_devices(void) {
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  setenv("CUDASIM_DEVICES", "0", 1);
}

Test(backend_select, auto_falls_back_to_host_and_logs_why_once) {
  hide_devices();
  cr_assert(eq(int, cuda_device_usable(), 0), "devices are hidden");
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_INFO);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_BACKEND", "auto", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_device_t *d1 = NULL, *d2 = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &d1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_backend(d1), OFL_BACKEND_HOST));
  cr_assert(eq(int, ofl_device_ordinal(d1), -1), "no GPU ordinal on host");
  cr_assert(eq(int, ofl_device_ordinal(NULL), -1));
  cr_assert(
      ne(ptr, strstr(ofl_device_selection_reason(d1), "host backend"), NULL));
#if OFL_HAVE_CUDA
  /* why the runtime refused: no device (the stand-in, a GPU machine with
   * its devices hidden) or no usable driver (a machine without a GPU: no
   * GPU or driver at all) */
  const char *why = ofl_device_selection_reason(d1);
  cr_assert(strstr(why, "no cuda device") != NULL ||
                strstr(why, "no NVIDIA GPU or driver") != NULL ||
                strstr(why, "the driver is too old") != NULL ||
                strstr(why, "no usable cuda driver") != NULL,
            "%s", why);
#endif
  cr_assert(eq(int, c.reasons, 1));
  cr_assert(eq(int, ofl_device_open(NULL, &d2), OFL_SUCCESS));
  cr_assert(eq(int, c.reasons, 1), "the reason is logged once per process");
  ofl_device_close(d1);
  ofl_device_close(d2);
  ofl_log_set_handler(NULL, NULL);
}

/* auto with the machine as it is: cuda when a device is usable (a GPU, the
 * stand-in), else the host backend. */
Test(backend_select, auto_picks_cuda_exactly_when_a_device_is_usable) {
  int usable = cuda_device_usable();
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_INFO);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_BACKEND", "auto", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_device_t *d = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &d), OFL_SUCCESS), "%s",
            ofl_last_error());
  const char *why = ofl_device_selection_reason(d);
  if (usable) {
    cr_assert(eq(int, ofl_device_backend(d), OFL_BACKEND_CUDA));
    cr_assert(ne(ptr, strstr(why, "cuda device 0 is available"), NULL), "%s",
              why);
    cr_assert(eq(int, c.reasons, 0), "no fallback: %s", c.last);
  } else {
    cr_assert(eq(int, ofl_device_backend(d), OFL_BACKEND_HOST));
    cr_assert(ne(ptr, strstr(why, "host backend"), NULL), "%s", why);
    cr_assert(eq(int, c.reasons, 1));
  }
  ofl_device_close(d);
  ofl_log_set_handler(NULL, NULL);
}

Test(backend_select, explicit_cuda_without_a_device_is_a_clear_error) {
  hide_devices();
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_BACKEND", "cuda", 1);
  ofl_config_reload();
  ofl_device_t *d = (ofl_device_t *)0x1;
  cr_assert(eq(int, ofl_device_open(NULL, &d), OFL_ERR_NO_DEVICE));
  cr_assert(eq(ptr, d, (ofl_device_t *)0x1));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "no cuda device"), NULL));
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST; /* the params struct wins over the variable */
  cr_assert(eq(int, ofl_device_open(&p, &d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_backend(d), OFL_BACKEND_HOST));
  ofl_device_close(d);
}

/* Explicit cuda with the machine as it is: opens where a device is usable,
 * is OFL_ERR_NO_DEVICE where none is; the params struct wins either way. */
Test(backend_select, explicit_cuda_opens_exactly_when_a_device_is_usable) {
  int usable = cuda_device_usable();
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_BACKEND", "cuda", 1);
  ofl_config_reload();
  ofl_device_t *d = NULL;
  if (usable) {
    cr_assert(eq(int, ofl_device_open(NULL, &d), OFL_SUCCESS), "%s",
              ofl_last_error());
    cr_assert(eq(int, ofl_device_backend(d), OFL_BACKEND_CUDA));
    cr_assert(eq(str, (char *)ofl_device_selection_reason(d), ""),
              "explicit: no reason");
    ofl_device_close(d);
  } else {
    cr_assert(eq(int, ofl_device_open(NULL, &d), OFL_ERR_NO_DEVICE));
    cr_assert(eq(ptr, d, NULL));
  }
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  cr_assert(eq(int, ofl_device_open(&p, &d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_backend(d), OFL_BACKEND_HOST));
  ofl_device_close(d);
}

Test(backend_select, invalid_backend_variable_fails_open_with_config_error) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_BACKEND", "tpu", 1);
  ofl_config_reload();
  ofl_device_t *d = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &d), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "auto|host|cuda"), NULL));
}
