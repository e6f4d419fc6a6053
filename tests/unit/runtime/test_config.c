/* The OFL_* configuration table. */
#include <criterion/criterion.h>
#include "tests/cr_assert.h"
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"

typedef struct {
  int warnings;
  char last[1024];
} capture_t;

static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  (void)subsys;
  capture_t *c = user;
  if (level == OFL_LOG_WARN)
    c->warnings++;
  snprintf(c->last, sizeof c->last, "%s", msg);
}

Test(config, defaults_and_environment_values_parse) {
  unsetenv("OFL_HOST_BUDGET");
  setenv("OFL_DISK_BLOCK", "2M", 1);
  setenv("OFL_OFFLOAD_FRACTION", "0.5", 1);
  setenv("OFL_DISK_CHECKSUM", "yes", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  size_t z = 1;
  cr_assert(eq(int, ofl__config_size("OFL_HOST_BUDGET", &z), OFL_SUCCESS));
  cr_assert(eq(sz, z, 0));
  cr_assert(eq(int, ofl__config_size("OFL_DISK_BLOCK", &z), OFL_SUCCESS));
  cr_assert(eq(sz, z, 2u << 20));
  double d = 0;
  cr_assert(
      eq(int, ofl__config_double("OFL_OFFLOAD_FRACTION", &d), OFL_SUCCESS));
  cr_assert(eq(dbl, d, 0.5));
  bool b = false;
  cr_assert(eq(int, ofl__config_bool("OFL_DISK_CHECKSUM", &b), OFL_SUCCESS));
  cr_assert(b);
  int e = -1;
  setenv("OFL_BACKEND", "HOST", 1);
  ofl_config_reload();
  cr_assert(eq(int, ofl__config_enum("OFL_BACKEND", &e), OFL_SUCCESS));
  cr_assert(eq(int, e, 1));
  cr_assert(eq(str, (char *)ofl_config_get("OFL_DISK_BLOCK"), "2M"));
  cr_assert(eq(ptr, (void *)ofl_config_get("OFL_NO_SUCH"), NULL));
}

Test(config, invalid_value_is_an_error_naming_the_allowed_values) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_BACKEND", "rocm", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "OFL_BACKEND='rocm'"), NULL));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "auto|host|cuda"), NULL));
  int e = 7;
  cr_assert(eq(int, ofl__config_enum("OFL_BACKEND", &e), OFL_ERR_CONFIG));
  cr_assert(eq(int, e, 7), "output must be left alone on failure");

  setenv("OFL_BACKEND", "host", 1);
  const char *bad_sizes[] = {"-1", "12Q", "", "1.5G", "99999999999T"};
  for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
    setenv("OFL_HOST_BUDGET", bad_sizes[i], 1);
    cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG), "%s", bad_sizes[i]);
    size_t z = 5;
    cr_assert(eq(int, ofl__config_size("OFL_HOST_BUDGET", &z), OFL_ERR_CONFIG));
    cr_assert(eq(sz, z, 5));
  }
  setenv("OFL_HOST_BUDGET", "1G", 1);
  setenv("OFL_STRICT", "maybe", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "yes/no"), NULL));
  setenv("OFL_STRICT", "1", 1);
  setenv("OFL_MAX_INFLIGHT", "3x", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  setenv("OFL_MAX_INFLIGHT", "3", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
}

Test(config, unknown_variable_is_warned_about_once) {
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_OFLOAD_GROUPS", "core_attn", 1); /* misspelt */
  ofl_config_reload();
  cr_assert(eq(int, c.warnings, 1));
  cr_assert(ne(ptr, strstr(c.last, "OFL_OFLOAD_GROUPS"), NULL));
  ofl_config_reload();
  cr_assert(eq(int, c.warnings, 1));
  ofl_log_set_handler(NULL, NULL);
}

/* The script's, the benches' and the demo's own variables are not the
 * library's and draw no warning; a misspelt library one still does. */
Test(config, tool_variables_are_not_warned_about) {
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_BUILD_DIR", "build", 1);
  setenv("OFL_BENCH_DISK_REPS", "3", 1);
  setenv("OFL_DEMO_RANKS", "2", 1);
  setenv("OFL_BENCHMARK", "1", 1); /* not the OFL_BENCH_ prefix */
  ofl_config_reload();
  cr_assert(eq(int, c.warnings, 1));
  cr_assert(ne(ptr, strstr(c.last, "OFL_BENCHMARK"), NULL));
  ofl_log_set_handler(NULL, NULL);
}

Test(config, print_lists_every_variable_with_its_value) {
  setenv("OFL_DISK_PREFETCH", "5", 1);
  ofl_config_reload();
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ofl_config_print(f);
  fclose(f);
  cr_assert(ne(ptr, strstr(buf, "OFL_BACKEND"), NULL));
  cr_assert(ne(ptr, strstr(buf, "OFL_WAIT_TIMEOUT_MS"), NULL));
  char *line = strstr(buf, "OFL_DISK_PREFETCH");
  cr_assert(ne(ptr, line, NULL));
  cr_assert(ne(ptr, strstr(line, "= 5"), NULL));
  free(buf);
}

Test(config, a_negative_size_is_invalid_even_after_blanks) {
  static const char *bad[] = {"-1", " -1", "\t-4096", "  -2G", " +5", "1 "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("OFL_DEVICE_CAPACITY", bad[i], 1);
    cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG), "'%s' accepted",
              bad[i]);
    size_t z = 12345;
    cr_assert(
        eq(int, ofl__config_size("OFL_DEVICE_CAPACITY", &z), OFL_ERR_CONFIG),
        "'%s' parsed", bad[i]);
    cr_assert(eq(sz, z, 12345)); /* out untouched on error */
  }
  setenv("OFL_DEVICE_CAPACITY", "64M", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  size_t z = 0;
  cr_assert(eq(int, ofl__config_size("OFL_DEVICE_CAPACITY", &z), OFL_SUCCESS));
  cr_assert(eq(sz, z, (size_t)64 << 20));
  unsetenv("OFL_DEVICE_CAPACITY");
  ofl_config_reload();
}

Test(config, a_value_handed_out_stays_readable_after_reload) {
  setenv("OFL_DISK_DIR", "/first/dir", 1);
  ofl_config_reload();
  const char *before = ofl_config_get("OFL_DISK_DIR");
  cr_assert(eq(str, (char *)before, "/first/dir"));
  setenv("OFL_DISK_DIR", "/second/dir", 1);
  ofl_config_reload();
  /* Another thread may still hold the old pointer: it must not be freed
   * (AddressSanitizer reports a use after free otherwise). */
  cr_assert(eq(str, (char *)before, "/first/dir"));
  cr_assert(eq(str, (char *)ofl_config_get("OFL_DISK_DIR"), "/second/dir"));
}
