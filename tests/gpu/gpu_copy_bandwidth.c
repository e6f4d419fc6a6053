/* Copy throughput through ofl's streams against plain CUDA in the same run:
 * D2H, H2D and both directions at once, 256 MiB (GPU_BW_MIB to change),
 * ofl_memcpy_async on ofl streams with events against cudaMemcpyAsync on
 * cudaMallocHost memory and plain nonblocking streams. Prints GB/s and the
 * ofl/plain ratio; checks only that every byte arrived (speed is for the
 * reader: on the stand-in the figures are those of memcpy). Exits 77
 * without a device. */
#include <stdlib.h>
#include <string.h>

#include "tests/gpu/gpu_common.h"

#define REPS 3

static double gbps(size_t bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0; }

int main(void) {
  gpu_require_device();
  size_t mib = 256;
  if (getenv("GPU_BW_MIB"))
    mib = (size_t)strtoull(getenv("GPU_BW_MIB"), NULL, 10);
  if (mib == 0)
    mib = 1;
  size_t n = mib << 20;
  tap_plan(6);
  tap_diag("%zu MiB per copy, best of %d%s", mib, REPS,
           gpu_on_stand_in() ? " (cudasim stand-in: CPU memcpy figures)" : "");

  /* ---- ofl ---- */
  ofl_device_t *dev = NULL;
  ofl_stream_t *d2h = NULL, *h2d = NULL;
  ofl_event_t *ev1 = NULL, *ev2 = NULL;
  void *da = NULL, *db = NULL, *ha = NULL, *hb = NULL, *hc = NULL;
  ofl_status_t st = gpu_open_device(0, &dev);
  if (st == OFL_SUCCESS)
    st = ofl_stream_create(dev, "bw_d2h", &d2h);
  if (st == OFL_SUCCESS)
    st = ofl_stream_create(dev, "bw_h2d", &h2d);
  if (st == OFL_SUCCESS)
    st = ofl_event_create(dev, &ev1);
  if (st == OFL_SUCCESS)
    st = ofl_event_create(dev, &ev2);
  if (st == OFL_SUCCESS)
    st = ofl_device_malloc(dev, n, &da);
  if (st == OFL_SUCCESS)
    st = ofl_device_malloc(dev, n, &db);
  if (st == OFL_SUCCESS)
    st = ofl_pinned_malloc(dev, n, &ha);
  if (st == OFL_SUCCESS)
    st = ofl_pinned_malloc(dev, n, &hb);
  if (st == OFL_SUCCESS)
    st = ofl_pinned_malloc(dev, n, &hc);
  if (st != OFL_SUCCESS) {
    printf("Bail out! ofl setup: %s\n", ofl_last_error());
    return 1;
  }
  t_pattern(ha, n, 11);
  double o_h2d = 1e30, o_d2h = 1e30, o_both = 1e30;
  int ofl_bad = 0;
  for (int rep = 0; rep < REPS && !ofl_bad; rep++) {
    double t0 = gpu_now_s();
    ofl_bad |= ofl_memcpy_async(da, ha, n, OFL_COPY_H2D, h2d) != OFL_SUCCESS;
    ofl_bad |= ofl_event_record(ev1, h2d) != OFL_SUCCESS;
    ofl_bad |= ofl_event_synchronize(ev1, 60000) != OFL_SUCCESS;
    double t1 = gpu_now_s();
    ofl_bad |= ofl_memcpy_async(hb, da, n, OFL_COPY_D2H, d2h) != OFL_SUCCESS;
    ofl_bad |= ofl_event_record(ev2, d2h) != OFL_SUCCESS;
    ofl_bad |= ofl_event_synchronize(ev2, 60000) != OFL_SUCCESS;
    double t2 = gpu_now_s();
    /* both at once: da -> hc while ha -> db */
    ofl_bad |= ofl_memcpy_async(hc, da, n, OFL_COPY_D2H, d2h) != OFL_SUCCESS;
    ofl_bad |= ofl_memcpy_async(db, ha, n, OFL_COPY_H2D, h2d) != OFL_SUCCESS;
    ofl_bad |= ofl_event_record(ev1, h2d) != OFL_SUCCESS;
    ofl_bad |= ofl_event_record(ev2, d2h) != OFL_SUCCESS;
    ofl_bad |= ofl_event_synchronize(ev1, 60000) != OFL_SUCCESS;
    ofl_bad |= ofl_event_synchronize(ev2, 60000) != OFL_SUCCESS;
    double t3 = gpu_now_s();
    o_h2d = t1 - t0 < o_h2d ? t1 - t0 : o_h2d;
    o_d2h = t2 - t1 < o_d2h ? t2 - t1 : o_d2h;
    o_both = t3 - t2 < o_both ? t3 - t2 : o_both;
  }
  if (ofl_bad)
    tap_diag("ofl copy failed: %s", ofl_last_error());
  size_t w_d2h = t_pattern_wrong(hb, n, 11), w_both = t_pattern_wrong(hc, n, 11);
  size_t w_dev = t_wrong(dev, db, n, 11); /* through a D2H copy */
  tap_ok(!ofl_bad && w_d2h == 0 && w_both == 0 && w_dev == 0,
         "ofl streams: H2D, D2H and both at once deliver every byte (%zu, "
         "%zu, %zu wrong)",
         w_d2h, w_both, w_dev);

  /* ---- plain CUDA ---- */
  void *pa = NULL, *pb = NULL, *pc = NULL, *qa = NULL, *qb = NULL;
  cudaStream_t s1 = NULL, s2 = NULL;
  int plain_bad = cudaMallocHost(&pa, n) != cudaSuccess ||
                  cudaMallocHost(&pb, n) != cudaSuccess ||
                  cudaMallocHost(&pc, n) != cudaSuccess ||
                  cudaMalloc(&qa, n) != cudaSuccess ||
                  cudaMalloc(&qb, n) != cudaSuccess ||
                  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) !=
                      cudaSuccess ||
                  cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) !=
                      cudaSuccess;
  if (plain_bad) {
    printf("Bail out! plain CUDA setup failed\n");
    return 1;
  }
  memcpy(pa, ha, n);
  double p_h2d = 1e30, p_d2h = 1e30, p_both = 1e30;
  for (int rep = 0; rep < REPS && !plain_bad; rep++) {
    double t0 = gpu_now_s();
    plain_bad |= cudaMemcpyAsync(qa, pa, n, cudaMemcpyHostToDevice, s2) !=
                 cudaSuccess;
    plain_bad |= cudaStreamSynchronize(s2) != cudaSuccess;
    double t1 = gpu_now_s();
    plain_bad |= cudaMemcpyAsync(pb, qa, n, cudaMemcpyDeviceToHost, s1) !=
                 cudaSuccess;
    plain_bad |= cudaStreamSynchronize(s1) != cudaSuccess;
    double t2 = gpu_now_s();
    plain_bad |= cudaMemcpyAsync(pc, qa, n, cudaMemcpyDeviceToHost, s1) !=
                 cudaSuccess;
    plain_bad |= cudaMemcpyAsync(qb, pa, n, cudaMemcpyHostToDevice, s2) !=
                 cudaSuccess;
    plain_bad |= cudaStreamSynchronize(s1) != cudaSuccess;
    plain_bad |= cudaStreamSynchronize(s2) != cudaSuccess;
    double t3 = gpu_now_s();
    p_h2d = t1 - t0 < p_h2d ? t1 - t0 : p_h2d;
    p_d2h = t2 - t1 < p_d2h ? t2 - t1 : p_d2h;
    p_both = t3 - t2 < p_both ? t3 - t2 : p_both;
  }
  size_t q_d2h = t_pattern_wrong(pb, n, 11), q_both = t_pattern_wrong(pc, n, 11);
  memset(pb, 0, n);
  plain_bad |= cudaMemcpy(pb, qb, n, cudaMemcpyDeviceToHost) != cudaSuccess;
  size_t q_dev = t_pattern_wrong(pb, n, 11);
  tap_ok(!plain_bad && q_d2h == 0 && q_both == 0 && q_dev == 0,
         "plain CUDA: H2D, D2H and both at once deliver every byte (%zu, %zu, "
         "%zu wrong)",
         q_d2h, q_both, q_dev);

  /* ---- figures ---- */
  double of[3] = {gbps(n, o_h2d), gbps(n, o_d2h), gbps(2 * n, o_both)};
  double pf[3] = {gbps(n, p_h2d), gbps(n, p_d2h), gbps(2 * n, p_both)};
  const char *what[3] = {"H2D", "D2H", "both (sum)"};
  for (int i = 0; i < 3; i++) {
    tap_ok(of[i] > 0 && pf[i] > 0,
           "%-10s ofl %7.2f GB/s  plain %7.2f GB/s  ratio %.3f", what[i], of[i],
           pf[i], pf[i] > 0 ? of[i] / pf[i] : 0.0);
  }
  int fin = ofl_device_free(dev, da) != OFL_SUCCESS;
  fin |= ofl_device_free(dev, db) != OFL_SUCCESS;
  fin |= ofl_pinned_free(dev, ha) != OFL_SUCCESS;
  fin |= ofl_pinned_free(dev, hb) != OFL_SUCCESS;
  fin |= ofl_pinned_free(dev, hc) != OFL_SUCCESS;
  ofl_event_destroy(ev1);
  ofl_event_destroy(ev2);
  fin |= ofl_stream_destroy(d2h) != OFL_SUCCESS;
  fin |= ofl_stream_destroy(h2d) != OFL_SUCCESS;
  ofl_device_close(dev);
  fin |= cudaStreamDestroy(s1) != cudaSuccess;
  fin |= cudaStreamDestroy(s2) != cudaSuccess;
  fin |= cudaFree(qa) != cudaSuccess || cudaFree(qb) != cudaSuccess;
  fin |= cudaFreeHost(pa) != cudaSuccess || cudaFreeHost(pb) != cudaSuccess ||
         cudaFreeHost(pc) != cudaSuccess;
  tap_ok(!fin, "every buffer, stream and event released");
  return tap_done();
}
