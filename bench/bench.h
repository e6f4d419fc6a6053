/* ofl benchmarks: shared helpers. A failed call ends the bench with the
 * library's message; numbers from a half-failed run are never printed. */
#ifndef OFL_BENCH_H
#define OFL_BENCH_H

#include <stdio.h>
#include <stdlib.h>

#include <ofl/ofl.h>

#define CHECK(call)                                                            \
  do {                                                                         \
    ofl_status_t st_ = (call);                                                 \
    if (st_ != OFL_SUCCESS) {                                                  \
      fprintf(stderr, "%s failed: %s (%s)\n", #call, ofl_status_str(st_),      \
              ofl_last_error());                                               \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

#endif
