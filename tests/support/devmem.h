/* Device bytes in tests, through the device API only: every test that moves
 * bytes fills and checks device memory with copies (H2D from a host buffer,
 * D2H back, compare on the host), never by touching a device pointer with the
 * CPU, so the same test runs on the host backend, on the cudasim stand-in
 * (whose device memory the CPU cannot touch) and on a real GPU.
 *
 * The backend under test comes from OFLTEST_BACKEND (not an OFL_ name: the
 * library warns about OFL_ variables it does not know): host, the default, or
 * cuda); the meson test setups set it for the host and cudasim passes. */
#ifndef OFL_TESTS_DEVMEM_H
#define OFL_TESTS_DEVMEM_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

#include "tests/cudasim/cudasim.h"

static inline ofl_backend_t t_backend(void) {
  const char *b = getenv("OFLTEST_BACKEND");
  return b != NULL && strcmp(b, "cuda") == 0 ? OFL_BACKEND_CUDA
                                             : OFL_BACKEND_HOST;
}
static inline int t_on_cuda(void) { return t_backend() == OFL_BACKEND_CUDA; }

/* Device parameters for a test: the backend under test; on the host backend
 * strict mode with the given jitter (jitter_us < 0: from OFL_JITTER_MAX_US)
 * and seed (0: from OFL_JITTER_SEED). */
static inline ofl_device_params_t t_device_params(int jitter_us,
                                                  uint64_t seed) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = t_backend();
  dp.strict = 1;
  dp.jitter_max_us = jitter_us;
  dp.jitter_seed = seed;
  return dp;
}

/* The stand-in's counters; 0 when the real runtime (or none) is loaded. */
static inline int t_sim_stats(cudasim_stats_t *out) {
  int (*get)(cudasim_stats_t *) = NULL;
  *(void **)&get = dlsym(RTLD_DEFAULT, "cudasim_get_stats");
  if (get == NULL)
    return 0;
  return get(out) == 0;
}

/* Host <-> device through the device's compute stream, waited for. */
static inline ofl_status_t t_write(ofl_device_t *dev, void *dst,
                                   const void *src, size_t n) {
  ofl_stream_t *s = ofl_device_compute_stream(dev);
  ofl_status_t st = ofl_memcpy_async(dst, src, n, OFL_COPY_H2D, s);
  if (st == OFL_SUCCESS)
    st = ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT);
  return st;
}
static inline ofl_status_t t_read(ofl_device_t *dev, void *dst, const void *src,
                                  size_t n) {
  ofl_stream_t *s = ofl_device_compute_stream(dev);
  ofl_status_t st = ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT);
  if (st == OFL_SUCCESS)
    st = ofl_memcpy_async(dst, src, n, OFL_COPY_D2H, s);
  if (st == OFL_SUCCESS)
    st = ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT);
  return st;
}
static inline ofl_status_t t_set(ofl_device_t *dev, void *dst, int value,
                                 size_t n) {
  ofl_stream_t *s = ofl_device_compute_stream(dev);
  ofl_status_t st = ofl_memset_async(dst, value, n, s);
  if (st == OFL_SUCCESS)
    st = ofl_stream_synchronize(s, OFL_TIMEOUT_DEFAULT);
  return st;
}

/* The deterministic byte pattern of seed (the same as the pipeline
 * driver's drv_fill). */
static inline uint64_t t_mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
static inline void t_pattern(void *p, size_t n, uint64_t seed) {
  uint8_t *d = p;
  uint64_t x = seed;
  for (size_t i = 0; i < n; i++) {
    if ((i & 7) == 0)
      x = t_mix(x + i);
    d[i] = (uint8_t)(x >> ((i & 7) * 8));
  }
}
static inline size_t t_pattern_wrong(const void *p, size_t n, uint64_t seed) {
  const uint8_t *d = p;
  uint64_t x = seed;
  size_t w = 0;
  for (size_t i = 0; i < n; i++) {
    if ((i & 7) == 0)
      x = t_mix(x + i);
    w += d[i] != (uint8_t)(x >> ((i & 7) * 8));
  }
  return w;
}

/* Fills device bytes with the pattern of seed; OFL_SUCCESS or the copy's
 * status (the message in ofl_last_error). */
static inline ofl_status_t t_fill(ofl_device_t *dev, void *dptr, size_t n,
                                  uint64_t seed) {
  void *h = malloc(n ? n : 1);
  if (h == NULL)
    return OFL_ERR_NO_MEMORY;
  t_pattern(h, n, seed);
  ofl_status_t st = t_write(dev, dptr, h, n);
  free(h);
  return st;
}

/* Number of device bytes that differ from the pattern of seed; SIZE_MAX when
 * they could not be read back. */
static inline size_t t_wrong(ofl_device_t *dev, const void *dptr, size_t n,
                             uint64_t seed) {
  void *h = malloc(n ? n : 1);
  if (h == NULL)
    return SIZE_MAX;
  size_t w = SIZE_MAX;
  if (t_read(dev, h, dptr, n) == OFL_SUCCESS)
    w = t_pattern_wrong(h, n, seed);
  free(h);
  return w;
}

/* Number of device bytes that differ from `value`; SIZE_MAX on a failed
 * read. */
static inline size_t t_wrong_value(ofl_device_t *dev, const void *dptr,
                                   size_t n, int value) {
  unsigned char *h = malloc(n ? n : 1);
  if (h == NULL)
    return SIZE_MAX;
  size_t w = SIZE_MAX;
  if (t_read(dev, h, dptr, n) == OFL_SUCCESS) {
    w = 0;
    for (size_t i = 0; i < n; i++)
      w += h[i] != (unsigned char)value;
  }
  free(h);
  return w;
}

/* The bytes of tensor t (n of them) set to the pattern of seed: through an
 * H2D copy on the compute stream for device memory, by the CPU for pinned
 * memory (ordered after the compute stream's queued work). */
static inline ofl_status_t t_tensor_fill(ofl_device_t *dev, ofl_tensor_t *t,
                                         size_t n, uint64_t seed) {
  if (ofl_tensor_location(t) == OFL_LOC_PINNED) {
    ofl_status_t s = ofl_stream_synchronize(ofl_device_compute_stream(dev),
                                            OFL_TIMEOUT_DEFAULT);
    if (s == OFL_SUCCESS)
      t_pattern(ofl_tensor_data(t), n, seed);
    return s;
  }
  return t_fill(dev, ofl_tensor_data(t), n, seed);
}

/* Wrong bytes of tensor t against the pattern of seed, read after the
 * compute stream's queued work: through a D2H copy for device memory, by
 * the CPU for pinned memory. SIZE_MAX when the bytes could not be read. */
static inline size_t t_tensor_wrong(ofl_device_t *dev, const ofl_tensor_t *t,
                                    size_t n, uint64_t seed) {
  if (ofl_tensor_location(t) == OFL_LOC_PINNED) {
    if (ofl_stream_synchronize(ofl_device_compute_stream(dev),
                               OFL_TIMEOUT_DEFAULT) != OFL_SUCCESS)
      return SIZE_MAX;
    return t_pattern_wrong(ofl_tensor_data(t), n, seed);
  }
  return t_wrong(dev, ofl_tensor_data(t), n, seed);
}

#endif
