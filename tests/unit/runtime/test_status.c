/* Status codes, the last-error message and logging. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"

Test(status, every_code_has_a_distinct_text) {
  const char *seen[64] = {0};
  int n = 0;
#define ADD(name, value, text) seen[n++] = ofl_status_str(name);
  OFL_STATUS_LIST(ADD)
#undef ADD
  for (int i = 0; i < n; i++) {
    cr_assert(ne(ptr, (void *)seen[i], NULL));
    for (int j = i + 1; j < n; j++)
      cr_assert(ne(str, (char *)seen[i], (char *)seen[j]));
  }
  cr_assert(
      eq(str, (char *)ofl_status_str((ofl_status_t)999), "unknown status"));
}

Test(status, error_sets_thread_message_and_returns_code) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_clear_error();
  cr_assert(eq(str, (char *)ofl_last_error(), ""));
  ofl_status_t st = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                               "waited %d ms for stream %s", 5, "d2h");
  cr_assert(eq(int, st, OFL_ERR_TIMEOUT));
  cr_assert(eq(str, (char *)ofl_last_error(), "waited 5 ms for stream d2h"));
}

typedef struct {
  int count;
  char last[512];
  unsigned subsys;
  ofl_log_level_t level;
} capture_t;

static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  capture_t *c = user;
  c->count++;
  c->subsys = subsys;
  c->level = level;
  snprintf(c->last, sizeof c->last, "%s", msg);
}

Test(log, handler_receives_filtered_messages) {
  capture_t c = {0};
  setenv("OFL_DEBUG", "INFO", 1);
  setenv("OFL_DEBUG_SUBSYS", "POOL", 1);
  ofl_log_reload();
  ofl_log_set_handler(capture, &c);
  OFL_INFO(OFL_SUBSYS_POOL, "bytes %d group %s", 42, "core_attn");
  OFL_INFO(OFL_SUBSYS_DISK, "filtered by subsystem");
  OFL_TRACE(OFL_SUBSYS_POOL, "filtered by level");
  cr_assert(eq(int, c.count, 1));
  cr_assert(eq(str, c.last, "bytes 42 group core_attn"));
  cr_assert(eq(int, (int)c.level, OFL_LOG_INFO));
  setenv("OFL_DEBUG_SUBSYS", "^POOL", 1);
  ofl_log_reload();
  OFL_WARN(OFL_SUBSYS_POOL, "excluded");
  OFL_WARN(OFL_SUBSYS_DISK, "included");
  cr_assert(eq(int, c.count, 2));
  cr_assert(eq(str, c.last, "included"));
  ofl_log_set_handler(NULL, NULL);
}

Test(log, debug_rank_filters_other_ranks) {
  capture_t c = {0};
  setenv("OFL_DEBUG", "WARN", 1);
  setenv("OFL_DEBUG_RANK", "1", 1);
  ofl_log_reload();
  ofl_log_set_handler(capture, &c);
  ofl_log_set_rank(0);
  OFL_WARN(OFL_SUBSYS_PIPELINE, "from rank 0");
  cr_assert(eq(int, c.count, 0));
  ofl_log_set_rank(1);
  OFL_WARN(OFL_SUBSYS_PIPELINE, "from rank 1");
  cr_assert(eq(int, c.count, 1));
  cr_assert(eq(str, c.last, "from rank 1"));
  ofl_log_set_handler(NULL, NULL);
}

Test(log, debug_file_expands_rank_and_pid) {
  char dir[] = "/tmp/ofl-log-XXXXXX";
  cr_assert(ne(ptr, mkdtemp(dir), NULL));
  char pattern[256];
  snprintf(pattern, sizeof pattern, "%s/log.%%r.%%p", dir);
  setenv("OFL_DEBUG", "WARN", 1);
  setenv("OFL_DEBUG_FILE", pattern, 1);
  ofl_log_reload();
  ofl_log_set_rank(3);
  OFL_WARN(OFL_SUBSYS_DISK, "written to the file");
  ofl_log_reload(); /* closes the file */
  char path[512];
  snprintf(path, sizeof path, "%s/log.3.%ld", dir, (long)getpid());
  FILE *f = fopen(path, "r");
  cr_assert(ne(ptr, f, NULL), "log file %s missing", path);
  char line[1024] = {0};
  cr_assert(ne(ptr, fgets(line, sizeof line, f), NULL));
  fclose(f);
  cr_assert(ne(ptr, strstr(line, "written to the file"), NULL));
  cr_assert(ne(ptr, strstr(line, "WARN DISK"), NULL));
  unlink(path);
  rmdir(dir);
}

/* A binding that raises every returned error asks for them at INFO: the
 * user reads the error once, in the binding's words; the message is the
 * same, and a public call's error too. */
Test(status, errors_the_caller_reports_are_logged_at_info_only) {
  capture_t c = {0};
  setenv("OFL_DEBUG", "INFO", 1);
  unsetenv("OFL_DEBUG_SUBSYS");
  ofl_log_reload();
  ofl_log_set_handler(capture, &c);
  ofl_error_logging_set(0);
  cr_assert(eq(int, ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL, "bad %d", 7),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, c.count, 1));
  cr_assert(eq(int, (int)c.level, OFL_LOG_INFO));
  cr_assert(ne(ptr, strstr(c.last, "bad 7"), NULL));
  cr_assert(eq(str, (char *)ofl_last_error(), "bad 7"));
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(NULL, NULL, 0, OFL_DTYPE_F32, NULL, &t),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, (int)c.level, OFL_LOG_INFO), "%s", c.last);
  cr_assert(eq(ptr, t, NULL));
  /* and at the default level nothing at all is printed */
  setenv("OFL_DEBUG", "WARN", 1);
  ofl_log_reload();
  int before = c.count;
  ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL, "quiet");
  cr_assert(eq(int, c.count, before));
  /* back to the default: a WARN where it is detected */
  ofl_error_logging_set(1);
  ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_POOL, "loud");
  cr_assert(eq(int, c.count, before + 1));
  cr_assert(eq(int, (int)c.level, OFL_LOG_WARN));
  ofl_log_set_handler(NULL, NULL);
  unsetenv("OFL_DEBUG");
  ofl_log_reload();
}
