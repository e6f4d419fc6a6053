/* ofl: the clock of every deadline (CLOCK_MONOTONIC) and the default wait
 * timeout (OFL_WAIT_TIMEOUT_MS), which each wait without its own resolves. */
#include <pthread.h>
#include <time.h>

#include "runtime/clock.h"
#include "runtime/internal.h"

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
