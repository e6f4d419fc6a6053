/* GPU copy throughput through ofl's streams against a plain
 * cudaMemcpyAsync loop on pinned memory, in the same run: D2H, H2D and both
 * directions at once (the goal: ofl / plain >= 0.95), and pinned allocation
 * through ofl (malloc + page touch + cudaHostRegister) against cudaHostAlloc
 * of the same bytes. Without a usable GPU (the host backend) it prints one
 * line saying why it skips and exits 0.
 *
 * Usage: ofl_bench_gpu [MiB per copy, default 64] [repetitions, default 10]
 * Not verified here: this machine has no GPU (the test stand-in runs no
 * kernels and its copies are memcpy, so its figures say nothing). */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <ofl/ofl.h>

#include "bench/bench.h"

#define CU(call)                                                               \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_));       \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Seconds for reps copies per direction through ofl (dirs: 1 D2H, 2 H2D,
 * 3 both at once on the two streams). */
static double time_ofl(ofl_stream_t *d2h, ofl_stream_t *h2d, void *dev_a,
                       void *dev_b, void *host_a, void *host_b, size_t bytes,
                       int reps, int dirs) {
  double t0 = now_s();
  for (int i = 0; i < reps; i++) {
    if (dirs & 1)
      CHECK(ofl_memcpy_async(host_a, dev_a, bytes, OFL_COPY_D2H, d2h));
    if (dirs & 2)
      CHECK(ofl_memcpy_async(dev_b, host_b, bytes, OFL_COPY_H2D, h2d));
  }
  CHECK(ofl_stream_synchronize(d2h, OFL_TIMEOUT_DEFAULT));
  CHECK(ofl_stream_synchronize(h2d, OFL_TIMEOUT_DEFAULT));
  return now_s() - t0;
}

static double time_plain(cudaStream_t d2h, cudaStream_t h2d, void *dev_a,
                         void *dev_b, void *host_a, void *host_b, size_t bytes,
                         int reps, int dirs) {
  double t0 = now_s();
  for (int i = 0; i < reps; i++) {
    if (dirs & 1)
      CU(cudaMemcpyAsync(host_a, dev_a, bytes, cudaMemcpyDeviceToHost, d2h));
    if (dirs & 2)
      CU(cudaMemcpyAsync(dev_b, host_b, bytes, cudaMemcpyHostToDevice, h2d));
  }
  CU(cudaStreamSynchronize(d2h));
  CU(cudaStreamSynchronize(h2d));
  return now_s() - t0;
}

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 64;
  int reps = argc > 2 ? atoi(argv[2]) : 10;
  if (mib == 0 || reps < 1) {
    fprintf(stderr, "usage: ofl_bench_gpu [MiB] [repetitions]\n");
    return 2;
  }
  size_t bytes = mib << 20;
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT; /* auto */
  ofl_device_t *dev = NULL;
  ofl_status_t st = ofl_device_open(&dp, &dev);
  if (st != OFL_SUCCESS) {
    printf("ofl_bench_gpu: skipped: no device could be opened (%s)\n",
           ofl_last_error());
    return 0;
  }
  if (ofl_device_backend(dev) != OFL_BACKEND_CUDA) {
    const char *why = ofl_device_selection_reason(dev);
    printf("ofl_bench_gpu: skipped: no usable GPU, ofl runs the host backend "
           "(%s)\n",
           why[0] ? why : "OFL_BACKEND=host");
    ofl_device_close(dev);
    return 0;
  }

  /* ofl's buffers and streams. */
  void *o_dev_a, *o_dev_b, *o_host_a, *o_host_b;
  CHECK(ofl_device_malloc(dev, bytes, &o_dev_a));
  CHECK(ofl_device_malloc(dev, bytes, &o_dev_b));
  CHECK(ofl_pinned_malloc(dev, bytes, &o_host_a));
  CHECK(ofl_pinned_malloc(dev, bytes, &o_host_b));
  ofl_stream_t *o_d2h, *o_h2d;
  CHECK(ofl_stream_create(dev, "bench_d2h", &o_d2h));
  CHECK(ofl_stream_create(dev, "bench_h2d", &o_h2d));
  /* The plain loop's, on the same GPU (ofl leaves the current device as
   * it was; the device ofl chose is the current one unless OFL_DEVICE). */
  void *p_dev_a, *p_dev_b, *p_host_a, *p_host_b;
  CU(cudaMalloc(&p_dev_a, bytes));
  CU(cudaMalloc(&p_dev_b, bytes));
  CU(cudaHostAlloc(&p_host_a, bytes, cudaHostAllocDefault));
  CU(cudaHostAlloc(&p_host_b, bytes, cudaHostAllocDefault));
  cudaStream_t p_d2h, p_h2d;
  CU(cudaStreamCreateWithFlags(&p_d2h, cudaStreamNonBlocking));
  CU(cudaStreamCreateWithFlags(&p_h2d, cudaStreamNonBlocking));

  printf("ofl_bench_gpu: %zu MiB per copy, %d copies per direction, best of "
         "3; ofl streams against cudaMemcpyAsync on cudaHostAlloc memory\n",
         mib, reps);
  printf("%-10s %12s %12s %8s %6s\n", "direction", "ofl_GB/s", "plain_GB/s",
         "ratio", "goal");
  const char *names[4] = {"", "D2H", "H2D", "both"};
  int worst_ok = 1;
  for (int dirs = 1; dirs <= 3; dirs++) {
    /* warm both paths, then the best of 3 alternating rounds */
    time_ofl(o_d2h, o_h2d, o_dev_a, o_dev_b, o_host_a, o_host_b, bytes, 1,
             dirs);
    time_plain(p_d2h, p_h2d, p_dev_a, p_dev_b, p_host_a, p_host_b, bytes, 1,
               dirs);
    double best_o = 1e30, best_p = 1e30;
    for (int round = 0; round < 3; round++) {
      double to = time_ofl(o_d2h, o_h2d, o_dev_a, o_dev_b, o_host_a, o_host_b,
                           bytes, reps, dirs);
      double tp = time_plain(p_d2h, p_h2d, p_dev_a, p_dev_b, p_host_a, p_host_b,
                             bytes, reps, dirs);
      best_o = to < best_o ? to : best_o;
      best_p = tp < best_p ? tp : best_p;
    }
    double moved = (double)bytes * reps * (dirs == 3 ? 2 : 1);
    double go = moved / best_o / 1e9, gp = moved / best_p / 1e9;
    double ratio = go / gp;
    worst_ok &= ratio >= 0.95;
    printf("%-10s %12.2f %12.2f %8.3f %6s\n", names[dirs], go, gp, ratio,
           ratio >= 0.95 ? "met" : "MISSED");
  }

  /* Pinned allocation of the same bytes: ofl against cudaHostAlloc. */
  double best_o = 1e30, best_p = 1e30;
  for (int round = 0; round < 3; round++) {
    void *p = NULL;
    double t0 = now_s();
    CHECK(ofl_pinned_malloc(dev, bytes, &p));
    CHECK(ofl_pinned_free(dev, p));
    double to = now_s() - t0;
    t0 = now_s();
    CU(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    CU(cudaFreeHost(p));
    double tp = now_s() - t0;
    best_o = to < best_o ? to : best_o;
    best_p = tp < best_p ? tp : best_p;
  }
  printf("%-10s %10.2fms %10.2fms %8.3f %6s\n", "pinned", best_o * 1e3,
         best_p * 1e3, best_p / best_o, "");
  printf("# pinned: allocate + free %zu MiB, best of 3; ratio = "
         "cudaHostAlloc time / ofl time (>= 1: ofl as fast or faster)\n",
         mib);
  printf("copy ratio goal (>= 0.95) %s on every direction\n",
         worst_ok ? "met" : "NOT met");

  CU(cudaStreamDestroy(p_d2h));
  CU(cudaStreamDestroy(p_h2d));
  CU(cudaFree(p_dev_a));
  CU(cudaFree(p_dev_b));
  CU(cudaFreeHost(p_host_a));
  CU(cudaFreeHost(p_host_b));
  CHECK(ofl_stream_destroy(o_d2h));
  CHECK(ofl_stream_destroy(o_h2d));
  CHECK(ofl_pinned_free(dev, o_host_a));
  CHECK(ofl_pinned_free(dev, o_host_b));
  CHECK(ofl_device_free(dev, o_dev_a));
  CHECK(ofl_device_free(dev, o_dev_b));
  ofl_device_close(dev);
  return 0;
}
