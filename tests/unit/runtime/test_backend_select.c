/* Backend selection on a machine without a GPU. */
#include <criterion/criterion.h>
#include <criterion/new/assert.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

typedef struct {
  int warnings;
  char last[1024];
} capture_t;

static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  (void)subsys;
  capture_t *c = user;
  if (level == OFL_LOG_WARN) {
    c->warnings++;
    snprintf(c->last, sizeof c->last, "%s", msg);
  }
}

Test(backend_select, auto_falls_back_to_host_and_logs_why_once) {
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_BACKEND", "auto", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_device_t *d1 = NULL, *d2 = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &d1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_backend(d1), OFL_BACKEND_HOST));
  cr_assert(
      ne(ptr, strstr(ofl_device_selection_reason(d1), "host backend"), NULL));
#if OFL_HAVE_CUDA
  cr_assert(ne(ptr,
               strstr(ofl_device_selection_reason(d1), "cudaGetDeviceCount"),
               NULL));
#endif
  cr_assert(eq(int, c.warnings, 1));
  cr_assert(eq(int, ofl_device_open(NULL, &d2), OFL_SUCCESS));
  cr_assert(eq(int, c.warnings, 1), "the reason is logged once per process");
  ofl_device_close(d1);
  ofl_device_close(d2);
  ofl_log_set_handler(NULL, NULL);
}

Test(backend_select, explicit_cuda_without_a_device_is_a_clear_error) {
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

Test(backend_select, invalid_backend_variable_fails_open_with_config_error) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_BACKEND", "tpu", 1);
  ofl_config_reload();
  ofl_device_t *d = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &d), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "auto|host|cuda"), NULL));
}
