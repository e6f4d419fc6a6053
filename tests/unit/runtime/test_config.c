/* The OFL_* configuration table. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
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
  const char *bad_sizes[] = {"-1", "12Q", " ", "1.5G", "99999999999T"};
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
  setenv("OFL_NO_TORCH_INSTALL", "1", 1); /* ofl.sh's */
  setenv("OFL_LIBRARY", "/x/libofl.so", 1); /* the Python package's */
  setenv("OFL_SOAK_DRAWS", "10", 1);         /* ./ofl.sh soak's */
  setenv("OFL_SWEEP_FULL", "1", 1);
  setenv("OFL_TEST_LOAD_STEPS", "5", 1);
  setenv("OFL_STAGER_UNDER_TEST", "torch", 1);
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

/* ---- every invalid value is OFL_ERR_CONFIG at first use -------------------
 * Each test runs in its own process, so the first ofl call below is the
 * first read of the configuration (no ofl_config_reload beforehand). */

typedef struct {
  int warnings;     /* WARN lines naming the variable */
  const char *name; /* the variable looked for */
  char last[1024];
} var_capture_t;

static void capture_var(ofl_log_level_t level, unsigned subsys, const char *msg,
                        void *user) {
  (void)subsys;
  var_capture_t *c = user;
  if (level == OFL_LOG_WARN && strstr(msg, c->name) != NULL) {
    c->warnings++;
    snprintf(c->last, sizeof c->last, "%s", msg);
  }
}

/* The first configuration read in this process with name=value set: a
 * device open fails with OFL_ERR_CONFIG naming the variable, and so does a
 * typed read of any other variable. */
static void first_use_fails(const char *name, const char *value) {
  setenv(name, value, 1);
  ofl_device_t *dev = NULL;
  cr_assert(eq(int, ofl_device_open(NULL, &dev), OFL_ERR_CONFIG),
            "%s='%s' accepted at first use", name, value);
  cr_assert(eq(ptr, dev, NULL));
  cr_assert(ne(ptr, strstr(ofl_last_error(), name), NULL), "%s",
            ofl_last_error());
  bool b = false;
  cr_assert(eq(int, ofl__config_bool("OFL_OFFLOAD", &b), OFL_ERR_CONFIG));
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), name), NULL), "%s",
            ofl_last_error());
}

Test(config, debug_level_typo_is_an_error_at_first_use_warned_once) {
  var_capture_t c = {.name = "OFL_DEBUG="};
  ofl_log_set_handler(capture_var, &c);
  first_use_fails("OFL_DEBUG", "VERBOSE");
  int level = -1;
  cr_assert(eq(int, ofl__config_enum("OFL_DEBUG", &level), OFL_ERR_CONFIG));
  /* Found at the first read, warned about then and never again. */
  cr_assert(eq(int, c.warnings, 1), "warned %d times", c.warnings);
  cr_assert(ne(ptr, strstr(c.last, "NONE|WARN|INFO|TRACE"), NULL), "%s",
            c.last);
  /* The logger falls back to WARN, so that the warning shows. */
  cr_assert(eq(int, ofl_log_get_level(), OFL_LOG_WARN));
  setenv("OFL_DEBUG", "INFO", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  cr_assert(eq(int, ofl_log_get_level(), OFL_LOG_INFO));
  ofl_log_set_handler(NULL, NULL);
}

Test(config, wait_timeout_negative_zero_or_garbage_is_an_error) {
  ofl_log_set_level(OFL_LOG_NONE);
  first_use_fails("OFL_WAIT_TIMEOUT_MS", "-1");
  static const char *bad[] = {"0", "abc", "12s", " 5", "+5", "0x10", " "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("OFL_WAIT_TIMEOUT_MS", bad[i], 1);
    cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG), "'%s'", bad[i]);
    int64_t v = 7;
    cr_assert(
        eq(int, ofl__config_int("OFL_WAIT_TIMEOUT_MS", &v), OFL_ERR_CONFIG));
    cr_assert(eq(i64, v, 7));
  }
  setenv("OFL_WAIT_TIMEOUT_MS", "2500", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  int64_t v = 0;
  cr_assert(eq(int, ofl__config_int("OFL_WAIT_TIMEOUT_MS", &v), OFL_SUCCESS));
  cr_assert(eq(i64, v, 2500));
}

Test(config, debug_subsys_typo_is_an_error_and_does_not_silence_warnings) {
  var_capture_t c = {.name = "OFL_DEBUG_SUBSYS"};
  ofl_log_set_handler(capture_var, &c);
  first_use_fails("OFL_DEBUG_SUBSYS", "INIT,POLL");
  cr_assert(eq(int, c.warnings, 1), "the CONFIG warning was %s",
            c.warnings ? "repeated" : "silenced");
  /* Until fixed, every subsystem logs (a typo must not hide warnings). */
  c.name = "pool test warning";
  c.warnings = 0;
  ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_POOL, "pool test warning");
  cr_assert(eq(int, c.warnings, 1), "a POOL warning was silenced");
  setenv("OFL_DEBUG_SUBSYS", "^pool,disk,", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  unsigned mask = 0;
  cr_assert(ofl__log_parse_subsys("^pool,disk,", &mask));
  cr_assert(
      eq(u32, mask, OFL_SUBSYS_ALL & ~(OFL_SUBSYS_POOL | OFL_SUBSYS_DISK)));
  ofl_log_set_handler(NULL, NULL);
}

Test(config, debug_rank_must_be_a_decimal_rank) {
  ofl_log_set_level(OFL_LOG_NONE);
  first_use_fails("OFL_DEBUG_RANK", "abc");
  static const char *bad[] = {"-1", "1x", " 1", "0x1", "99999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    setenv("OFL_DEBUG_RANK", bad[i], 1);
    cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG), "'%s'", bad[i]);
  }
  setenv("OFL_DEBUG_RANK", "010", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  int r = -2;
  cr_assert(ofl__log_parse_rank("010", &r));
  cr_assert(eq(int, r, 10), "decimal, not octal");
  cr_assert(ofl__log_parse_rank("", &r));
  cr_assert(eq(int, r, -1));
}

Test(config, negative_min_offload_elems_is_an_error) {
  ofl_log_set_level(OFL_LOG_NONE);
  first_use_fails("OFL_MIN_OFFLOAD_ELEMS", "-1");
  int64_t v = 3;
  cr_assert(
      eq(int, ofl__config_int("OFL_MIN_OFFLOAD_ELEMS", &v), OFL_ERR_CONFIG));
  cr_assert(eq(i64, v, 3));
  setenv("OFL_MIN_OFFLOAD_ELEMS", "0", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  cr_assert(eq(int, ofl__config_int("OFL_MIN_OFFLOAD_ELEMS", &v), OFL_SUCCESS));
  cr_assert(eq(i64, v, 0));
}

Test(config, jitter_beyond_int_range_is_an_error_not_a_wrap) {
  ofl_log_set_level(OFL_LOG_NONE);
  first_use_fails("OFL_JITTER_MAX_US", "2147483648");
  setenv("OFL_JITTER_MAX_US", "-5", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  setenv("OFL_JITTER_MAX_US", "2147483647", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  int64_t v = 0;
  cr_assert(eq(int, ofl__config_int("OFL_JITTER_MAX_US", &v), OFL_SUCCESS));
  cr_assert(eq(i64, v, 2147483647));
}

Test(config, negative_disk_prefetch_and_spin_are_errors_not_clamped) {
  ofl_log_set_level(OFL_LOG_NONE);
  first_use_fails("OFL_DISK_PREFETCH", "-1");
  setenv("OFL_DISK_PREFETCH", "1025", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  int64_t v = 9;
  cr_assert(eq(int, ofl__config_int("OFL_DISK_PREFETCH", &v), OFL_ERR_CONFIG));
  cr_assert(eq(i64, v, 9));
  setenv("OFL_DISK_PREFETCH", "4", 1);
  setenv("OFL_HOST_SPIN_US", "-1", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "OFL_HOST_SPIN_US"), NULL));
  cr_assert(eq(int, ofl__config_int("OFL_HOST_SPIN_US", &v), OFL_ERR_CONFIG));
  setenv("OFL_HOST_SPIN_US", "100001", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  setenv("OFL_HOST_SPIN_US", "0", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  cr_assert(eq(int, ofl__config_int("OFL_DISK_PREFETCH", &v), OFL_SUCCESS));
  cr_assert(eq(i64, v, 4));
}

Test(config, staging_max_inflight_out_of_range_is_a_config_error) {
  ofl_log_set_level(OFL_LOG_NONE);
  first_use_fails("OFL_STAGING_MAX_INFLIGHT", "0");
  int64_t v = 5;
  cr_assert(
      eq(int, ofl__config_int("OFL_STAGING_MAX_INFLIGHT", &v), OFL_ERR_CONFIG));
  cr_assert(eq(i64, v, 5));
  setenv("OFL_STAGING_MAX_INFLIGHT", "1025", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "1..1024"), NULL), "%s",
            ofl_last_error());
  setenv("OFL_STAGING_MAX_INFLIGHT", "1024", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
}

Test(config, integers_are_decimal) {
  setenv("OFL_DISK_QUEUE_DEPTH", "010", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  int64_t v = 0;
  cr_assert(eq(int, ofl__config_int("OFL_DISK_QUEUE_DEPTH", &v), OFL_SUCCESS));
  cr_assert(eq(i64, v, 10), "010 read as %lld", (long long)v);
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_DISK_QUEUE_DEPTH", "0x10", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
}

Test(config, values_longer_than_511_characters_are_read_whole) {
  char zeros[700];
  memset(zeros, '0', sizeof zeros - 2);
  zeros[sizeof zeros - 2] = '7';
  zeros[sizeof zeros - 1] = '\0';
  setenv("OFL_MIN_OFFLOAD_ELEMS", zeros, 1);
  char dir[2001];
  memset(dir, 'd', sizeof dir - 1);
  dir[0] = '/';
  dir[sizeof dir - 1] = '\0';
  setenv("OFL_DISK_DIR", dir, 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  int64_t v = 0;
  cr_assert(eq(int, ofl__config_int("OFL_MIN_OFFLOAD_ELEMS", &v), OFL_SUCCESS));
  cr_assert(eq(i64, v, 7), "read as %lld", (long long)v);
  const char *s = NULL;
  cr_assert(eq(int, ofl__config_str("OFL_DISK_DIR", &s), OFL_SUCCESS));
  cr_assert(eq(sz, strlen(s), sizeof dir - 1));
}

/* ---- where each value in force comes from ---------------------------------
 */

Test(config, print_says_the_source_of_each_value) {
  setenv("OFL_DISK_PREFETCH", "5", 1);
  unsetenv("OFL_DISK_QUEUE_DEPTH");
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  cr_assert(
      eq(str, (char *)ofl__config_source("OFL_DISK_PREFETCH"), "environment"));
  cr_assert(
      eq(str, (char *)ofl__config_source("OFL_DISK_QUEUE_DEPTH"), "default"));
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ofl_config_print(f);
  fclose(f);
  char *line = strstr(buf, "OFL_DISK_PREFETCH");
  cr_assert(ne(ptr, line, NULL));
  cr_assert(eq(int, strncmp(strstr(line, "= "), "= 5 ", 4), 0), "%.80s", line);
  cr_assert(ne(ptr, strstr(line, "(environment"), NULL), "%.120s", line);
  line = strstr(buf, "OFL_DISK_QUEUE_DEPTH");
  cr_assert(ne(ptr, line, NULL));
  cr_assert(eq(int, strncmp(strstr(line, "= "), "= 8 ", 4), 0), "%.80s", line);
  cr_assert(ne(ptr, strstr(line, "(default"), NULL), "%.120s", line);
  free(buf);
  /* The one-line form for values resolved elsewhere (params). */
  buf = NULL;
  f = open_memstream(&buf, &len);
  ofl__config_print_value(f, "OFL_MAX_INFLIGHT", "4", "params");
  fclose(f);
  cr_assert(ne(ptr, strstr(buf, "OFL_MAX_INFLIGHT"), NULL));
  cr_assert(ne(ptr, strstr(buf, "= 4 "), NULL), "%s", buf);
  cr_assert(ne(ptr, strstr(buf, "(params)"), NULL), "%s", buf);
  free(buf);
}

/* ---- an empty value -------------------------------------------------------
 * NAME= (what a launcher's template leaves) is the default, for every
 * variable of the table, whatever its kind. */

/* The names of the table, from ofl_config_print's lines. */
static size_t table_names(char names[][64], size_t cap) {
  char *buf = NULL;
  size_t len = 0, n = 0;
  FILE *f = open_memstream(&buf, &len);
  ofl_config_print(f);
  fclose(f);
  char *save = NULL;
  for (char *line = strtok_r(buf, "\n", &save); line != NULL && n < cap;
       line = strtok_r(NULL, "\n", &save))
    if (sscanf(line, "%63s", names[n]) == 1 &&
        strncmp(names[n], "OFL_", 4) == 0)
      n++;
  free(buf);
  return n;
}

Test(config, an_empty_value_is_the_default_for_every_variable) {
  char names[64][64];
  size_t n = table_names(names, 64);
  cr_assert(ge(sz, n, 40), "%zu variables", n);
  char defaults[64][256];
  for (size_t i = 0; i < n; i++)
    unsetenv(names[i]);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  for (size_t i = 0; i < n; i++)
    snprintf(defaults[i], sizeof defaults[i], "%s", ofl_config_get(names[i]));
  for (size_t i = 0; i < n; i++)
    setenv(names[i], "", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS), "%s", ofl_last_error());
  cr_assert(eq(sz, ofl_config_check(NULL), 0));
  for (size_t i = 0; i < n; i++) {
    cr_assert(eq(str, (char *)ofl_config_get(names[i]), defaults[i]), "%s",
              names[i]);
    cr_assert(eq(str, (char *)ofl__config_source(names[i]),
                 "default, empty in the environment"),
              "%s", names[i]);
  }
  /* the typed reads give the defaults too */
  size_t z = 7;
  cr_assert(eq(int, ofl__config_size("OFL_DISK_KEEP", &z), OFL_SUCCESS));
  cr_assert(eq(sz, z, 256u << 20));
  int64_t v = 0;
  cr_assert(eq(int, ofl__config_int("OFL_PREFETCH_GROUPS", &v), OFL_SUCCESS));
  cr_assert(eq(i64, v, 1));
  double d = 0;
  cr_assert(
      eq(int, ofl__config_double("OFL_OFFLOAD_FRACTION", &d), OFL_SUCCESS));
  cr_assert(eq(dbl, d, 1.0));
  int e = -1;
  cr_assert(eq(int, ofl__config_enum("OFL_BACKEND", &e), OFL_SUCCESS));
  cr_assert(eq(int, e, 0));
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ofl_config_print(f);
  fclose(f);
  char *line = strstr(buf, "OFL_DISK_KEEP");
  cr_assert(ne(ptr, line, NULL));
  cr_assert(ne(ptr, strstr(line, "(default, empty in the environment;"), NULL),
            "%.120s", line);
  free(buf);
  for (size_t i = 0; i < n; i++)
    unsetenv(names[i]);
  ofl_config_reload();
}
