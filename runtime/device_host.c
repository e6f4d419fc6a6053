/* ofl: the host backend's front: open and close, the link's rates (its
 * model, else memcpy's), ranges for the trace, and the ops table (the parts:
 * runtime/host.h). */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/host.h"

/* ---- ranges (trace only) ------------------------------------------------ */

/* Names are copied: the caller's buffer may change before the pop. */
static _Thread_local struct {
  char name[48];
  uint64_t t0;
} range_stack[16];
static _Thread_local int range_depth;

static void host_range_push(ofl_device_t *dev, const char *name) {
  /* Without a trace file only the depth matters (the trace is chosen at
   * device open, so a pop sees the same setting as its push). */
  if (range_depth < 16 && ofl__trace_on(dev)) {
    ofl__utf8_copy(range_stack[range_depth].name,
                   sizeof range_stack[range_depth].name, name);
    range_stack[range_depth].t0 = ofl__now_ns();
  }
  range_depth++;
}

static void host_range_pop(ofl_device_t *dev) {
  if (range_depth == 0)
    return;
  range_depth--;
  if (range_depth < 16 && ofl__trace_on(dev))
    ofl__trace_complete(dev, dev->compute ? dev->compute->id : 0,
                        range_stack[range_depth].name, "range",
                        range_stack[range_depth].t0, ofl__now_ns(), NULL);
}

/* ---- device ------------------------------------------------------------- */

/* A link-model rate of bytes/s: 0 (off) or one that paces a byte in at
 * most a day (OFL__LINK_MIN_BPS); the table checks the variables, this the
 * params fields too. */
static ofl_status_t check_link_rate(double bps, const char *var,
                                    const char *field) {
  if (bps == 0 || (isfinite(bps) && bps >= OFL__LINK_MIN_BPS))
    return OFL_SUCCESS;
  return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_DEVICE,
                    "link model rate %g GB/s (%s or ofl_device_params_t.%s) "
                    "is invalid: it takes 0 (off) or at least %.3g GB/s (one "
                    "byte a day)",
                    bps / 1e9, var, field, OFL__LINK_MIN_BPS / 1e9);
}

static ofl_status_t host_open(ofl_device_t *dev) {
  const ofl__device_config_t *c = &dev->cfg;
  OFL_CHECK(
      check_link_rate(c->link_h2d_bps, "OFL_LINK_H2D_GBPS", "link_h2d_gbps"));
  OFL_CHECK(
      check_link_rate(c->link_d2h_bps, "OFL_LINK_D2H_GBPS", "link_d2h_gbps"));
  OFL_CHECK(check_link_rate(c->link_total_bps, "OFL_LINK_TOTAL_GBPS",
                            "link_total_gbps"));
  return ofl__host_registry_open(dev);
}

/* The host backend's copies without a link model run at memcpy speed: one
 * 8 MiB copy, the best of three, timed once per process (the first
 * question) and kept. */
static double memcpy_rate(void) {
  size_t n = (size_t)8 << 20;
  char *a = malloc(n), *b = malloc(n);
  double best = 0;
  if (a != NULL && b != NULL) {
    memset(a, 1, n);
    memset(b, 2, n);
    for (int i = 0; i < 3; i++) {
      uint64_t t0 = ofl__now_ns();
      memcpy(b, a, n);
      uint64_t dt = ofl__now_ns() - t0;
      double r = dt > 0 ? (double)n * 1e9 / (double)dt : 0;
      if (r > best)
        best = r;
    }
  }
  free(a);
  free(b);
  return best > 0 ? best : 10e9;
}

static pthread_once_t memcpy_once = PTHREAD_ONCE_INIT;
static double memcpy_bps;
static void time_memcpy(void) { memcpy_bps = memcpy_rate(); }

/* The link model's rates, a direction without its own taking the total;
 * a direction without either, the memcpy rate. */
static ofl_status_t host_link_rate(ofl_device_t *dev, double *d2h_bytes_per_s,
                                   double *h2d_bytes_per_s,
                                   ofl__link_source_t *source) {
  const ofl__device_config_t *c = &dev->cfg;
  double d2h = c->link_d2h_bps > 0 ? c->link_d2h_bps : c->link_total_bps;
  double h2d = c->link_h2d_bps > 0 ? c->link_h2d_bps : c->link_total_bps;
  *source = d2h > 0 || h2d > 0 ? OFL__LINK_MODEL : OFL__LINK_TIMED;
  if (d2h <= 0 || h2d <= 0)
    pthread_once(&memcpy_once, time_memcpy);
  *d2h_bytes_per_s = d2h > 0 ? d2h : memcpy_bps;
  *h2d_bytes_per_s = h2d > 0 ? h2d : memcpy_bps;
  return OFL_SUCCESS;
}

const ofl__device_ops_t ofl__host_ops = {
    .name = "host",
    .backend = OFL_BACKEND_HOST,
    .open = host_open,
    .close = ofl__host_registry_close,
    .device_malloc = ofl__host_device_malloc,
    .device_free = ofl__host_device_free,
    .pinned_malloc = ofl__host_pinned_malloc,
    .pinned_free = ofl__host_pinned_free,
    .device_owns = ofl__host_device_owns,
    .inflight = ofl__host_inflight,
    .adopt_host_memory = ofl__host_adopt_host_memory,
    .link_rate = host_link_rate,
    .stream_create = ofl__host_stream_create,
    .stream_destroy = ofl__host_stream_destroy,
    .stream_synchronize = ofl__host_stream_synchronize,
    .stream_query = ofl__host_stream_query,
    .event_create = ofl__host_event_create,
    .event_destroy = ofl__host_event_destroy,
    .event_record = ofl__host_event_record,
    .event_query = ofl__host_event_query,
    .event_create_timed = ofl__host_event_create_timed,
    .event_elapsed_ns = ofl__host_event_elapsed_ns,
    .event_synchronize = ofl__host_event_synchronize,
    .stream_wait_event = ofl__host_stream_wait_event,
    .memcpy_async = ofl__host_memcpy_async,
    .memset_async = ofl__host_memset_async,
    .launch_host_func = ofl__host_launch_host_func,
    .launch_release = ofl__host_launch_release,
    .range_push = host_range_push,
    .range_pop = host_range_pop,
};
