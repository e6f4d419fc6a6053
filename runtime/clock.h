/* ofl: time (runtime/clock.c). Not installed. */
#ifndef OFL_RUNTIME_CLOCK_H
#define OFL_RUNTIME_CLOCK_H

#include <stdint.h>

uint64_t ofl__now_ns(void); /* CLOCK_MONOTONIC */
/* The default wait timeout (OFL_WAIT_TIMEOUT_MS) when timeout_ms < 0. */
int64_t ofl__timeout_ms(int64_t timeout_ms);
/* ofl__now_ns() + timeout_ms (resolved as above), saturating instead of
 * wrapping, so that a very long timeout means "wait", not "expired". */
uint64_t ofl__deadline_ns(int64_t timeout_ms);

#endif /* OFL_RUNTIME_CLOCK_H */
