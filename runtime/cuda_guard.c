/* ofl: the cuda backend's device guard (ofl__cuda_enter, ofl__cuda_leave;
 * runtime/device_internal.h), which every CUDA call of ofl goes through: the
 * backend (runtime/device_cuda.c, cuda_link.c) and the NCCL comm. */
#include <ofl/version.h>

#if OFL_HAVE_CUDA

#include <dlfcn.h>
#include <stdatomic.h>

#include "runtime/backend.h"
#include "runtime/cuda_api.h"

/* ---- the caller's device stays the caller's ------------------------------
 * cudaSetDevice is per host thread, and memory, streams, events and
 * registrations go to the calling thread's current device; any runtime call
 * on a thread that never chose one initialises device 0's primary context.
 * So every call selects ofl's device when the thread sits elsewhere, and
 * gives the caller's device back afterwards (docs/DESIGN.md section 3.1). It is
 * not given back on ofl's own threads, nor to a device whose primary context
 * does not exist (the thread had never used it: cudaGetDevice answers 0 for
 * a thread that chose nothing, and selecting device 0 would create a
 * context there, hundreds of MiB on a GPU the process does not use). */

typedef int (*cu_device_get_fn)(int *dev, int ordinal);
typedef int (*cu_ctx_state_fn)(int dev, unsigned *flags, int *active);

/* Whether device `ordinal` has an active primary context, through the
 * driver API (libcuda, which the runtime has loaded already when a device
 * works); when it cannot be asked, true (restoring is the safe answer for
 * the caller). */
static bool primary_ctx_active(int ordinal) {
  static cu_device_get_fn get;
  static cu_ctx_state_fn state;
  static atomic_int looked;
  if (atomic_load(&looked) == 0) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW); /* kept for the process */
    if (h != NULL) {
      *(void **)&get = dlsym(h, "cuDeviceGet");
      *(void **)&state = dlsym(h, "cuDevicePrimaryCtxGetState");
    }
    atomic_store(&looked, 1);
  }
  if (get == NULL || state == NULL)
    return true;
  int d = 0, active = 1;
  unsigned flags = 0;
  if (get(&d, ordinal) != 0 || state(d, &flags, &active) != 0)
    return true;
  return active != 0;
}

/* Every call also runs in relaxed capture mode: an allocation, a
 * registration or a query that ofl makes while the application captures a
 * graph on another stream (global mode forbids those from any thread) must
 * not invalidate the application's capture (docs/DESIGN.md section 3.1). Work
 * ofl queues on a capturing stream is still captured. */
static void relax_capture(ofl__cuda_guard_t *g) {
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess)
    g->capture_mode = (int)mode;
  else {
    (void)cudaGetLastError();
    g->capture_mode = -1;
  }
}

static void restore_capture(const ofl__cuda_guard_t *g) {
  if (g->capture_mode < 0 || g->capture_mode == cudaStreamCaptureModeRelaxed)
    return;
  enum cudaStreamCaptureMode mode = (enum cudaStreamCaptureMode)g->capture_mode;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess)
    (void)cudaGetLastError();
}

ofl_status_t ofl__cuda_enter(int device, ofl__cuda_guard_t *g) {
  g->restore = false;
  relax_capture(g);
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess) {
    (void)cudaGetLastError();
    cur = -1;
  }
  if (cur == device)
    return OFL_SUCCESS;
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    restore_capture(g);
    (void)cudaGetLastError(); /* ofl reports it (device_cuda.c, CUDA_TRY) */
    return ofl__error(OFL_ERR_CUDA, OFL_SUBSYS_DEVICE,
                      "cannot select the device: %s (ce)",
                      cudaGetErrorString(ce));
  }
  if (cur >= 0 && !ofl__thread_is_owned() && primary_ctx_active(cur)) {
    g->prev = cur;
    g->restore = true;
  }
  return OFL_SUCCESS;
}

void ofl__cuda_leave(const ofl__cuda_guard_t *g) {
  if (g->restore && cudaSetDevice(g->prev) != cudaSuccess)
    (void)cudaGetLastError();
  restore_capture(g);
}

#else
/* ISO C forbids an empty translation unit. */
typedef int ofl__no_cuda_guard;
#endif
