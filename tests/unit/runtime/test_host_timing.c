/* Timing events on the host backend (ofl__event_create_timed and
 * ofl__event_elapsed_ns, as cudaEventCreate / cudaEventElapsedTime): the
 * time between two records is the time between their completions on the
 * streams (a host function that sleeps on a worker stream lies between
 * them); a record not yet reached is OFL_ERR_NOT_READY, as is an event
 * never recorded or an event created without timing; a re-recorded event
 * answers for its latest record only. Host backend only. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "runtime/device_internal.h"

#define OK(call) cr_assert(eq(int, (call), OFL_SUCCESS), "%s", ofl_last_error())

static ofl_device_t *dev;

static void open_dev(void) {
  setenv("OFL_BACKEND", "host", 1);
  ofl_config_reload();
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  OK(ofl_device_open(&p, &dev));
  ofl_log_set_level(OFL_LOG_NONE);
}
static void close_dev(void) { ofl_device_close(dev); }
TestSuite(host_timing, .init = open_dev, .fini = close_dev);

static void sleep_ms(void *arg) {
  struct timespec ts = {0, (long)(uintptr_t)arg * 1000000L};
  nanosleep(&ts, NULL);
}

/* A gate the worker waits on, so that a record is known not to be
 * reached. */
static volatile int gate;
static void wait_gate(void *arg) {
  (void)arg;
  while (!gate)
    usleep(100);
}

Test(host_timing, elapsed_spans_the_work_between_the_records) {
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "timed", &s));
  ofl_event_t *a = NULL, *b = NULL;
  OK(ofl__event_create_timed(dev, &a));
  OK(ofl__event_create_timed(dev, &b));
  uint64_t ns = 0;
  cr_assert(eq(int, ofl__event_elapsed_ns(a, b, &ns), OFL_ERR_NOT_READY),
            "never recorded");
  OK(ofl_event_record(a, s));
  OK(ofl_stream_launch_host_func(s, sleep_ms, (void *)(uintptr_t)20));
  OK(ofl_event_record(b, s));
  OK(ofl_event_synchronize(b, 10000));
  OK(ofl__event_elapsed_ns(a, b, &ns));
  cr_assert(ge(u64, ns, 20000000), "%llu ns", (unsigned long long)ns);
  cr_assert(lt(u64, ns, 2000000000), "%llu ns", (unsigned long long)ns);
  /* reversed: 0, as a negative time is no duration */
  uint64_t back = 1;
  OK(ofl__event_elapsed_ns(b, a, &back));
  cr_assert(eq(u64, back, 0));
  /* the compute stream (the calling thread) reaches its records at once */
  ofl_event_t *c = NULL;
  OK(ofl__event_create_timed(dev, &c));
  OK(ofl_event_record(c, ofl_device_compute_stream(dev)));
  OK(ofl__event_elapsed_ns(a, c, &ns));
  cr_assert(ge(u64, ns, 20000000));
  ofl_event_destroy(a);
  ofl_event_destroy(b);
  ofl_event_destroy(c);
  OK(ofl_stream_destroy(s));
}

Test(host_timing, a_record_not_reached_is_not_ready) {
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "gated", &s));
  ofl_event_t *a = NULL, *b = NULL, *plain = NULL;
  OK(ofl__event_create_timed(dev, &a));
  OK(ofl__event_create_timed(dev, &b));
  OK(ofl_event_create(dev, &plain));
  OK(ofl_event_record(a, s));
  OK(ofl_event_synchronize(a, 10000));
  gate = 0;
  OK(ofl_stream_launch_host_func(s, wait_gate, NULL));
  OK(ofl_event_record(b, s));
  uint64_t ns = 0;
  cr_assert(eq(int, ofl__event_elapsed_ns(a, b, &ns), OFL_ERR_NOT_READY));
  /* re-recorded behind the gate: a answers for the new record only */
  OK(ofl_event_record(a, s));
  cr_assert(eq(int, ofl__event_elapsed_ns(a, a, &ns), OFL_ERR_NOT_READY));
  gate = 1;
  OK(ofl_stream_synchronize(s, 10000));
  OK(ofl__event_elapsed_ns(b, a, &ns));
  /* an event made without timing never answers */
  OK(ofl_event_record(plain, s));
  OK(ofl_event_synchronize(plain, 10000));
  cr_assert(eq(int, ofl__event_elapsed_ns(plain, b, &ns), OFL_ERR_NOT_READY));
  ofl_event_destroy(a);
  ofl_event_destroy(b);
  ofl_event_destroy(plain);
  OK(ofl_stream_destroy(s));
}
