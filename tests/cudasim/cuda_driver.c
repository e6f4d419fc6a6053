/* cudasim: the two driver-API calls ofl asks (libcuda.so.1), answered from
 * the runtime stand-in's state: whether a device's primary context exists.
 * ofl dlopens libcuda.so.1 and finds this one first on the library path. */
#include <dlfcn.h>
#include <stdint.h>

#include "tests/cudasim/cudasim.h"

#define EXPORT __attribute__((visibility("default")))

enum { CU_OK = 0, CU_INVALID_VALUE = 1, CU_INVALID_DEVICE = 101 };

static int stats(cudasim_stats_t *out) {
  int (*get)(cudasim_stats_t *) = NULL;
  *(void **)&get = dlsym(RTLD_DEFAULT, "cudasim_get_stats");
  return get != NULL && get(out) == 0;
}

EXPORT int cuDeviceGet(int *device, int ordinal) {
  if (device == NULL)
    return CU_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= CUDASIM_MAX_DEVICES)
    return CU_INVALID_DEVICE;
  *device = ordinal;
  return CU_OK;
}

EXPORT int cuDevicePrimaryCtxGetState(int device, unsigned *flags,
                                      int *active) {
  if (flags == NULL || active == NULL)
    return CU_INVALID_VALUE;
  if (device < 0 || device >= CUDASIM_MAX_DEVICES)
    return CU_INVALID_DEVICE;
  cudasim_stats_t s;
  if (!stats(&s))
    return CU_INVALID_VALUE;
  *flags = 0;
  *active = s.contexts[device] != 0;
  return CU_OK;
}
