/* Shared bits of the tests/gpu programs: they need nothing beyond the CUDA
 * toolkit (no Criterion, no MPI), run unchanged on a real GPU and on the
 * cudasim stand-in, print TAP (tests/support/tap.h) and exit 77 (skip) when no CUDA
 * device can be used. Device bytes are only touched through copies. */
#ifndef OFL_TESTS_GPU_COMMON_H
#define OFL_TESTS_GPU_COMMON_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <time.h>

#include <ofl/ofl.h>

#include "tests/support/devmem.h"
#include "tests/support/tap.h"

/* The number of usable devices, or exits 77 after a TAP skip line. */
static inline int gpu_require_device(void) {
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev < 1) {
    printf("1..0 # SKIP no usable CUDA device (%s)\n",
           e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    exit(77);
  }
  return ndev;
}

/* 1 when the cudasim stand-in is the loaded runtime. */
static inline int gpu_on_stand_in(void) {
  return dlsym(RTLD_DEFAULT, "cudasim_get_stats") != NULL;
}

static inline double gpu_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A cuda-backend device on ordinal index. */
static inline ofl_status_t gpu_open_device(int index, ofl_device_t **out) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_CUDA;
  dp.device_index = index;
  return ofl_device_open(&dp, out);
}

#endif
