/* A minimal TAP producer for test programs that cannot run under Criterion
 * (MPI drivers, ThreadSanitizer builds: Criterion's sandbox does not start
 * under TSan). Each check prints "ok N - name" or "not ok N - name". */
#ifndef OFL_TESTS_TAP_H
#define OFL_TESTS_TAP_H

#include <stdarg.h>
#include <stdio.h>

static int tap_n, tap_failed;

static inline void tap_plan(int n) {
  printf("TAP version 13\n1..%d\n", n);
  fflush(stdout);
}

static inline int tap_ok(int cond, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("%sok %d - ", cond ? "" : "not ", ++tap_n);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  if (!cond)
    tap_failed++;
  return cond;
}

static inline int tap_diag(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("# ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  return 0;
}

/* Exit status: 0 when every check passed. */
static inline int tap_done(void) { return tap_failed == 0 ? 0 : 1; }

#endif
