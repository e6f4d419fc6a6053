/* What the configuration says when it is wrong: the unknown-variable
 * warning names the closest known variable and ofl-info, ofl_config_check
 * lists every problem with the library's own rules (the offload fraction's
 * range included), and a log file that cannot be opened is said on stderr
 * with its errno, as a trace file's is. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* ofl_config_check's lines, in a string the caller frees. */
static char *check_text(size_t *problems) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  cr_assert(ne(ptr, f, NULL));
  *problems = ofl_config_check(f);
  fclose(f);
  return text;
}

Test(config_check, unknown_variable_warning_names_the_closest_and_ofl_info) {
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_OFFLOAD_GROUP", "core_attn", 1);
  ofl_config_reload();
  ofl_log_set_handler(NULL, NULL);
  cr_assert(eq(int, c.warnings, 1));
  cr_assert(ne(ptr,
               strstr(c.last, "unknown variable OFL_OFFLOAD_GROUP is ignored "
                              "(did you mean OFL_OFFLOAD_GROUPS?)"),
               NULL),
            "%s", c.last);
  cr_assert(ne(ptr, strstr(c.last, "`ofl-info`"), NULL), "%s", c.last);
  cr_assert(eq(ptr, strstr(c.last, "ofl_config_print"), NULL), "%s", c.last);
}

Test(config_check, a_name_near_none_gets_no_guess) {
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_ZZZZZZZZZZZZZZZZ", "1", 1);
  ofl_config_reload();
  ofl_log_set_handler(NULL, NULL);
  cr_assert(eq(int, c.warnings, 1));
  cr_assert(ne(ptr, strstr(c.last, "OFL_ZZZZZZZZZZZZZZZZ"), NULL));
  cr_assert(eq(ptr, strstr(c.last, "did you mean"), NULL), "%s", c.last);
}

Test(config_check, lists_every_invalid_value_and_unknown_name) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_BACKEND", "gpu", 1);
  setenv("OFL_OFFLOAD_FRACTION", "1.5", 1);
  setenv("OFL_PREFETCH_GROUP", "2", 1);
  size_t n = 0;
  char *text = check_text(&n);
  cr_assert(eq(sz, n, 3), "%s", text);
  cr_assert(ne(ptr, strstr(text, "OFL_BACKEND='gpu' is invalid"), NULL));
  cr_assert(ne(ptr,
               strstr(text, "OFL_OFFLOAD_FRACTION='1.5' is invalid; it takes "
                            "a number in [0, 1]"),
               NULL),
            "%s", text);
  cr_assert(ne(ptr,
               strstr(text, "unknown variable OFL_PREFETCH_GROUP (did you "
                            "mean OFL_PREFETCH_GROUPS?)"),
               NULL),
            "%s", text);
  free(text);
  /* The library reads the fraction by the same rule. */
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  unsetenv("OFL_BACKEND");
  unsetenv("OFL_PREFETCH_GROUP");
  cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG));
  cr_assert(ne(ptr, strstr(ofl_last_error(), "OFL_OFFLOAD_FRACTION"), NULL));
  setenv("OFL_OFFLOAD_FRACTION", "0", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  setenv("OFL_OFFLOAD_FRACTION", "1", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  text = check_text(&n);
  cr_assert(eq(sz, n, 0), "%s", text);
  cr_assert(eq(sz, strlen(text), 0));
  free(text);
}

Test(config_check, tool_variables_are_no_problem) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_LIBRARY", "/x/libofl.so.0", 1);
  setenv("OFL_BUNDLE_LIBRARY", "/x/libofl.so.0", 1);
  setenv("OFL_DEMO_RANKS", "2", 1);
  setenv("OFL_TEST_LONG_STEPS", "10", 1);
  size_t n = 9;
  char *text = check_text(&n);
  cr_assert(eq(sz, n, 0), "%s", text);
  free(text);
}

/* stderr into a temporary file for the length of a call. */
static int stderr_to(FILE *tmp) {
  fflush(stderr);
  int saved = dup(2);
  dup2(fileno(tmp), 2);
  return saved;
}

static void stderr_back(int saved) {
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
}

Test(config_check, an_unwritable_log_file_is_said_once_with_errno) {
  FILE *tmp = tmpfile();
  cr_assert(ne(ptr, tmp, NULL));
  setenv("OFL_DEBUG", "WARN", 1);
  setenv("OFL_DEBUG_FILE", "/nonexistent/dir/ofl.log", 1);
  ofl_log_reload();
  int saved = stderr_to(tmp);
  OFL_WARN(OFL_SUBSYS_DISK, "first message");
  OFL_WARN(OFL_SUBSYS_DISK, "second message");
  stderr_back(saved);
  unsetenv("OFL_DEBUG_FILE");
  ofl_log_reload();
  char text[4096] = {0};
  rewind(tmp);
  size_t got = fread(text, 1, sizeof text - 1, tmp);
  fclose(tmp);
  text[got] = '\0';
  char *w = strstr(text, "cannot open log file /nonexistent/dir/ofl.log: "
                               "No such file or directory (errno 2)");
  cr_assert(ne(ptr, w, NULL), "%s", text);
  cr_assert(ne(ptr, strstr(w, "fix OFL_DEBUG_FILE"), NULL), "%s", text);
  cr_assert(eq(ptr, strstr(w + 1, "cannot open log file"), NULL),
            "said once: %s", text);
  /* The messages themselves still reach stderr. */
  cr_assert(ne(ptr, strstr(text, "first message"), NULL), "%s", text);
  cr_assert(ne(ptr, strstr(text, "second message"), NULL), "%s", text);
}
