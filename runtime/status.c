/* ofl: status codes and the thread's last-error message. */
#include <stdarg.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>

#include "runtime/internal.h"

static _Thread_local char last_error[1024];
/* 0: the caller reports returned errors itself (ofl_error_logging_set). */
static atomic_int error_warn = 1;

void ofl_error_logging_set(int warn) { atomic_store(&error_warn, warn != 0); }

const char *ofl_status_str(ofl_status_t status) {
  switch (status) {
#define OFL__STATUS_CASE(name, value, text)                                    \
  case name:                                                                   \
    return text;
    OFL_STATUS_LIST(OFL__STATUS_CASE)
#undef OFL__STATUS_CASE
  }
  return "unknown status";
}

const char *ofl_last_error(void) { return last_error; }

void ofl_clear_error(void) { last_error[0] = '\0'; }

static void set_last_error(const char *fmt, va_list ap) {
  vsnprintf(last_error, sizeof last_error, fmt, ap);
}

ofl_status_t ofl__error(ofl_status_t status, unsigned subsys, const char *fmt,
                        ...) {
  va_list ap;
  va_start(ap, fmt);
  set_last_error(fmt, ap);
  va_end(ap);
  if (atomic_load(&error_warn))
    OFL_WARN(subsys, "%s: %s", ofl_status_str(status), last_error);
  else
    OFL_INFO(subsys, "%s: %s", ofl_status_str(status), last_error);
  return status;
}

ofl_status_t ofl__error_quiet(ofl_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_last_error(fmt, ap);
  va_end(ap);
  return status;
}

void ofl__thread_name(const char *what) {
  char name[16]; /* TASK_COMM_LEN, the terminating byte included */
  snprintf(name, sizeof name, "ofl %s", what);
  (void)pthread_setname_np(pthread_self(), name);
}
