/* The host backend's worker streams stop promptly: a stream destroyed while
 * its worker sleeps in link-model pacing or strict-mode jitter returns
 * within the wait timeout (the sleeps are interruptible, the waits bounded),
 * and link rates so low that one byte would take more than a day are
 * configuration errors. Host backend only (the pacing and jitter are its). */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"

#define OK(call) cr_assert(eq(int, (call), OFL_SUCCESS), "%s", ofl_last_error())

static double seconds(void) { return (double)ofl__now_ns() / 1e9; }

static ofl_device_t *open_host(int strict) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  dp.strict = strict;
  ofl_device_t *dev = NULL;
  OK(ofl_device_open(&dp, &dev));
  return dev;
}

/* Queues a D2H copy of n bytes on a new worker stream, destroys the stream
 * at once, and returns how long the destroy took; the copy's bytes must
 * have arrived (stopping cuts pauses short, it drops no work). */
static double destroy_seconds_with_copy_queued(ofl_device_t *dev, size_t n) {
  void *d = NULL, *h = NULL;
  OK(ofl_device_malloc(dev, n, &d));
  OK(ofl_pinned_malloc(dev, n, &h));
  unsigned char *pattern = malloc(n);
  for (size_t i = 0; i < n; i++)
    pattern[i] = (unsigned char)(i * 7 + 3);
  ofl_stream_t *c = ofl_device_compute_stream(dev);
  OK(ofl_memcpy_async(d, pattern, n, OFL_COPY_H2D, c));
  OK(ofl_stream_synchronize(c, OFL_TIMEOUT_DEFAULT));
  memset(h, 0, n);
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "d2h", &s));
  OK(ofl_memcpy_async(h, d, n, OFL_COPY_D2H, s));
  double t0 = seconds();
  ofl_stream_destroy(s); /* may say the drain timed out: that is the point */
  double took = seconds() - t0;
  cr_assert(eq(int, memcmp(h, pattern, n), 0), "the copy was dropped");
  free(pattern);
  OK(ofl_pinned_free(dev, h));
  OK(ofl_device_free(dev, d));
  return took;
}

/* 1e-12 GB/s is a millibyte per second: pacing a 4 KiB copy would take
 * weeks. Without interruptible pacing the destroy never returned. */
Test(host_stop, destroy_returns_within_the_wait_timeout_on_a_crawling_link,
     .timeout = 60) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_WAIT_TIMEOUT_MS", "300", 1);
  setenv("OFL_LINK_D2H_GBPS", "1e-12", 1);
  OK(ofl_config_reload());
  ofl_device_t *dev = open_host(0);
  double took = destroy_seconds_with_copy_queued(dev, 4096);
  cr_assert(lt(dbl, took, 5.0), "destroy took %.2f s", took);
  ofl_device_close(dev);
}

/* Strict-mode jitter of up to 2000 s before each operation. */
Test(host_stop, destroy_returns_within_the_wait_timeout_with_huge_jitter,
     .timeout = 60) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_WAIT_TIMEOUT_MS", "300", 1);
  setenv("OFL_JITTER_MAX_US", "2000000000", 1);
  setenv("OFL_LINK_D2H_GBPS", "0", 1);
  OK(ofl_config_reload());
  ofl_device_t *dev = open_host(1);
  double took = destroy_seconds_with_copy_queued(dev, 4096);
  cr_assert(lt(dbl, took, 5.0), "destroy took %.2f s", took);
  ofl_device_close(dev);
}

/* A device closed with such a stream still open stops it as fast. */
Test(host_stop, close_returns_with_a_paced_copy_in_flight, .timeout = 60) {
  ofl_log_set_level(OFL_LOG_NONE);
  setenv("OFL_WAIT_TIMEOUT_MS", "300", 1);
  setenv("OFL_LINK_H2D_GBPS", "1e-12", 1);
  OK(ofl_config_reload());
  ofl_device_t *dev = open_host(0);
  void *d = NULL, *h = NULL;
  OK(ofl_device_malloc(dev, 4096, &d));
  OK(ofl_pinned_malloc(dev, 4096, &h));
  memset(h, 5, 4096);
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "h2d", &s));
  OK(ofl_memcpy_async(d, h, 4096, OFL_COPY_H2D, s));
  double t0 = seconds();
  ofl_device_close(dev);
  cr_assert(lt(dbl, seconds() - t0, 5.0), "close took %.2f s", seconds() - t0);
}

/* The pacing itself still holds at an ordinary rate: 1 MiB at 0.01 GB/s
 * takes about 0.1 s. */
Test(host_stop, pacing_still_paces_at_a_sane_rate, .timeout = 60) {
  setenv("OFL_LINK_D2H_GBPS", "0.01", 1);
  OK(ofl_config_reload());
  ofl_device_t *dev = open_host(0);
  size_t n = (size_t)1 << 20;
  void *d = NULL, *h = NULL;
  OK(ofl_device_malloc(dev, n, &d));
  OK(ofl_pinned_malloc(dev, n, &h));
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "d2h", &s));
  double t0 = seconds();
  OK(ofl_memcpy_async(h, d, n, OFL_COPY_D2H, s));
  OK(ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT));
  double took = seconds() - t0;
  cr_assert(ge(dbl, took, 0.09), "1 MiB at 10 MB/s took %.3f s", took);
  OK(ofl_stream_destroy(s));
  OK(ofl_pinned_free(dev, h));
  OK(ofl_device_free(dev, d));
  ofl_device_close(dev);
}

Test(host_stop, absurd_link_rates_are_config_errors) {
  ofl_log_set_level(OFL_LOG_NONE);
  static const char *bad[] = {"1e-300", "1e-15", "1e-400", "inf", "nan", "-1"};
  static const char *vars[] = {"OFL_LINK_D2H_GBPS", "OFL_LINK_H2D_GBPS",
                               "OFL_LINK_TOTAL_GBPS"};
  for (size_t v = 0; v < 3; v++)
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
      setenv(vars[v], bad[i], 1);
      cr_assert(eq(int, ofl_config_reload(), OFL_ERR_CONFIG), "%s=%s", vars[v],
                bad[i]);
      cr_assert(ne(ptr, strstr(ofl_last_error(), vars[v]), NULL), "%s",
                ofl_last_error());
      ofl_device_t *dev = NULL;
      ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
      dp.backend = OFL_BACKEND_HOST;
      cr_assert(eq(int, ofl_device_open(&dp, &dev), OFL_ERR_CONFIG));
      cr_assert(ne(ptr, strstr(ofl_last_error(), vars[v]), NULL), "%s",
                ofl_last_error());
      setenv(vars[v], "0", 1);
    }
  /* Slow but within a byte a day: valid. */
  setenv("OFL_LINK_D2H_GBPS", "1e-12", 1);
  OK(ofl_config_reload());
  /* The params fields are checked the same way (NaN, like any value
   * that is not >= 0, means "from the environment"). */
  double bad_params[] = {1e-300, 1e-20, INFINITY};
  for (size_t i = 0; i < 3; i++) {
    ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
    dp.backend = OFL_BACKEND_HOST;
    dp.link_h2d_gbps = bad_params[i];
    ofl_device_t *dev = NULL;
    cr_assert(eq(int, ofl_device_open(&dp, &dev), OFL_ERR_CONFIG), "%g",
              bad_params[i]);
    cr_assert(eq(ptr, dev, NULL));
    cr_assert(ne(ptr, strstr(ofl_last_error(), "link_h2d_gbps"), NULL), "%s",
              ofl_last_error());
  }
}
