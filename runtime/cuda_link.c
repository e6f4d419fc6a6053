/* ofl: the cuda backend's link rate (ofl__device_link_rate): the link model
 * the application configured (OFL_LINK_*_GBPS, which the backend does not
 * pace by), else its own measurement of the link, made once per cuda device
 * at the first question and kept for the process: a pinned->device and a
 * device->pinned cudaMemcpyAsync of LINK_PROBE_BYTES on a private stream,
 * timed by events.
 *
 * The rule followed (CUDA runtime API, cudaEventElapsedTime): "if either
 * event was last recorded in a non-NULL stream, the resulting time may be
 * greater than expected ... any number of other different stream operations
 * could execute in between the two measured events". So the events go on a
 * stream of the probe's own (non-blocking: no implicit wait on the legacy
 * stream) with nothing but the copy between them. Host memory is page-locked
 * (cudaMallocHost): a copy from pageable memory is staged by the driver and
 * times the staging, not the link. The first copy of each direction is not
 * timed (it pays the first use of the buffers), the best of LINK_PROBE_RUNS
 * is kept (other work on the device only slows a copy down). */
#include <ofl/version.h>

#if OFL_HAVE_CUDA

#include <pthread.h>
#include <time.h>

#include "runtime/backend.h"
#include "runtime/clock.h"
#include "runtime/cuda_api.h"

#define LINK_PROBE_BYTES ((size_t)4 << 20)
#define LINK_PROBE_RUNS 3
#define LINK_PROBE_DEVICES 64 /* ordinals kept; others are measured anew */

/* Measured rates per cuda ordinal, bytes/s ([0] d2h, [1] h2d); probed: a
 * probe was made (a failed one leaves 0: not retried). */
static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  bool probed;
  double bps[2];
} probes[LINK_PROBE_DEVICES];

/* Waits for ev, polling (every wait has a timeout: OFL_TIMEOUT_MS). */
static cudaError_t wait_event(cudaEvent_t ev) {
  uint64_t deadline = ofl__deadline_ns(ofl__timeout_ms(-1));
  for (;;) {
    cudaError_t ce = cudaEventQuery(ev);
    if (ce != cudaErrorNotReady)
      return ce;
    (void)cudaGetLastError(); /* NotReady is an answer, not an error */
    if (ofl__now_ns() >= deadline)
      return cudaErrorNotReady;
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
}

/* One timed copy of LINK_PROBE_BYTES on s: its rate in bytes/s. */
static cudaError_t timed_copy(void *dst, const void *src, cudaStream_t s,
                              cudaEvent_t a, cudaEvent_t b, double *bps) {
  cudaError_t ce = cudaEventRecord(a, s);
  if (ce == cudaSuccess)
    ce = cudaMemcpyAsync(dst, src, LINK_PROBE_BYTES, cudaMemcpyDefault, s);
  if (ce == cudaSuccess)
    ce = cudaEventRecord(b, s);
  if (ce == cudaSuccess)
    ce = wait_event(b);
  float ms = 0;
  if (ce == cudaSuccess)
    ce = cudaEventElapsedTime(&ms, a, b);
  *bps = ce == cudaSuccess && ms > 0
             ? (double)LINK_PROBE_BYTES * 1e3 / (double)ms
             : 0;
  return ce;
}

/* Both directions, the best of LINK_PROBE_RUNS each after an untimed
 * first copy; with the device selected. 0 where a call failed. */
static void probe_link(double bps[2]) {
  void *host = NULL, *devmem = NULL;
  cudaStream_t s = NULL;
  cudaEvent_t a = NULL, b = NULL;
  cudaError_t ce = cudaMallocHost(&host, LINK_PROBE_BYTES);
  if (ce == cudaSuccess)
    ce = cudaMalloc(&devmem, LINK_PROBE_BYTES);
  if (ce == cudaSuccess)
    ce = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (ce == cudaSuccess)
    ce = cudaEventCreateWithFlags(&a, cudaEventDefault);
  if (ce == cudaSuccess)
    ce = cudaEventCreateWithFlags(&b, cudaEventDefault);
  for (int dir = 0; dir < 2 && ce == cudaSuccess; dir++) {
    void *dst = dir == 0 ? host : devmem;
    const void *src = dir == 0 ? devmem : host;
    double r = 0;
    for (int i = 0; i <= LINK_PROBE_RUNS && ce == cudaSuccess; i++) {
      ce = timed_copy(dst, src, s, a, b, &r);
      if (i > 0 && r > bps[dir])
        bps[dir] = r;
    }
  }
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "link probe: %s; the rates measured so far are kept (d2h %g "
             "h2d %g GB/s)",
             cudaGetErrorString(ce), bps[0] / 1e9, bps[1] / 1e9);
  }
  /* The stream is drained (every copy was waited for) before its buffers
   * go; a wait that timed out leaves them to the process. */
  bool drained = ce != cudaErrorNotReady;
  if (b != NULL)
    (void)cudaEventDestroy(b);
  if (a != NULL)
    (void)cudaEventDestroy(a);
  if (s != NULL)
    (void)cudaStreamDestroy(s);
  if (devmem != NULL && drained)
    (void)cudaFree(devmem);
  if (host != NULL && drained)
    (void)cudaFreeHost(host);
  (void)cudaGetLastError();
}

/* The measured rates of dev's cuda device, probing at the first call. */
static ofl_status_t measured(ofl_device_t *dev, double bps[2]) {
  int ord = dev->cfg.device_index;
  bool keep = ord >= 0 && ord < LINK_PROBE_DEVICES;
  pthread_mutex_lock(&probe_lock);
  if (keep && probes[ord].probed) {
    bps[0] = probes[ord].bps[0];
    bps[1] = probes[ord].bps[1];
    pthread_mutex_unlock(&probe_lock);
    return OFL_SUCCESS;
  }
  ofl__cuda_guard_t g;
  ofl_status_t st = ofl__cuda_enter(ord, &g);
  if (st == OFL_SUCCESS) {
    bps[0] = bps[1] = 0;
    probe_link(bps);
    ofl__cuda_leave(&g);
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "device %d link measured: d2h %.2f GB/s h2d %.2f GB/s (%zu "
             "bytes, pinned memory)",
             ord, bps[0] / 1e9, bps[1] / 1e9, LINK_PROBE_BYTES);
    if (keep) {
      probes[ord].probed = true;
      probes[ord].bps[0] = bps[0];
      probes[ord].bps[1] = bps[1];
    }
  }
  pthread_mutex_unlock(&probe_lock);
  return st;
}

ofl_status_t ofl__cuda_link_rate(ofl_device_t *dev, double *d2h_bytes_per_s,
                                 double *h2d_bytes_per_s,
                                 ofl__link_source_t *source) {
  const ofl__device_config_t *c = &dev->cfg;
  double d2h = c->link_d2h_bps > 0 ? c->link_d2h_bps : c->link_total_bps;
  double h2d = c->link_h2d_bps > 0 ? c->link_h2d_bps : c->link_total_bps;
  ofl__link_source_t src =
      d2h > 0 || h2d > 0 ? OFL__LINK_MODEL : OFL__LINK_TIMED;
  if (d2h <= 0 || h2d <= 0) {
    double bps[2] = {0, 0};
    OFL_CHECK(measured(dev, bps));
    d2h = d2h > 0 ? d2h : bps[0];
    h2d = h2d > 0 ? h2d : bps[1];
    if (d2h <= 0 && h2d <= 0)
      src = OFL__LINK_NONE;
  }
  *d2h_bytes_per_s = d2h;
  *h2d_bytes_per_s = h2d;
  *source = src;
  return OFL_SUCCESS;
}

#else
/* ISO C forbids an empty translation unit. */
typedef int ofl__no_cuda_link;
#endif
