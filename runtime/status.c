/* ofl: status codes and the thread's last-error message. */
#include <stdarg.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

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

uint64_t ofl__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int64_t ofl__timeout_ms(int64_t timeout_ms) {
  if (timeout_ms >= 0)
    return timeout_ms;
  /* Every wait resolves it: the value parsed under the configuration's
   * current generation is kept (a reload changes the generation). */
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  static unsigned seen_gen; /* 0: nothing kept */
  static int64_t seen_v;
  unsigned gen = ofl__config_generation();
  int64_t v = 0;
  pthread_mutex_lock(&mu);
  bool hit = gen != 0 && seen_gen == gen;
  if (hit)
    v = seen_v;
  pthread_mutex_unlock(&mu);
  if (hit)
    return v;
  if (ofl__config_int("OFL_WAIT_TIMEOUT_MS", &v) != OFL_SUCCESS || v <= 0)
    v = 120000;
  pthread_mutex_lock(&mu);
  seen_gen = gen; /* a reload since gen was read: the next call parses */
  seen_v = v;
  pthread_mutex_unlock(&mu);
  return v;
}

uint64_t ofl__deadline_ns(int64_t timeout_ms) {
  uint64_t ms = (uint64_t)ofl__timeout_ms(timeout_ms);
  uint64_t now = ofl__now_ns();
  if (ms > (UINT64_MAX - now) / 1000000ull)
    return UINT64_MAX;
  return now + ms * 1000000ull;
}

void ofl__thread_name(const char *what) {
  char name[16]; /* TASK_COMM_LEN, the terminating byte included */
  snprintf(name, sizeof name, "ofl %s", what);
  (void)pthread_setname_np(pthread_self(), name);
}
