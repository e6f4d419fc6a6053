/* ofl pipeline demo: the backend the runs use and why (--backend, the GPU
 * module of kernels_cuda.h), and --preset oom's model sized from the
 * device's capacity. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "demo.h"

/* ---- the backend and --preset oom ----------------------------------------- */

/* Opens a device as the runs will (--backend, OFL_BACKEND), says on the
 * first line which backend and why, and resolves o->backend to it. The
 * demo's arithmetic runs on the CPU: the cuda backend would need the GPU
 * kernels, which this demo does not run (see --help), so an explicit cuda
 * fails here and auto falls back to the host backend, saying so. *capacity
 * is the device's capacity (0: unlimited). Returns 0, or 2 after a message. */
/* Loads the demo's GPU module (kernels_cuda.h): OFL_DEMO_KERNELS_CUDA, else
 * next to the executable, else the loader's path. NULL with the reason in
 * why. Called after a cuda device was opened, so that the module's
 * libcudart.so.13 is the runtime ofl loaded. */
static const kc_api_t *load_kernels(char *why, size_t why_bytes) {
  if (!DEMO_CUDA_KERNELS_COMPILED) {
    snprintf(why, why_bytes,
             "they are not compiled into this build (no CUDA toolkit with "
             "nvcc found at setup)");
    return NULL;
  }
  char path[4096];
  const char *env = getenv("OFL_DEMO_KERNELS_CUDA");
  const char *tried = NULL;
  void *h = NULL;
  if (env != NULL && env[0] != '\0') {
    tried = env;
    h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
  } else {
    char exe[3072];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      exe[n] = '\0';
      char *slash = strrchr(exe, '/');
      if (slash != NULL)
        *slash = '\0';
      snprintf(path, sizeof path, "%s/libofl_demo_kernels_cuda.so", exe);
      tried = path;
      h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (h == NULL) {
      tried = "libofl_demo_kernels_cuda.so";
      h = dlopen(tried, RTLD_NOW | RTLD_LOCAL);
    }
  }
  if (h == NULL) {
    const char *e = dlerror();
    snprintf(why, why_bytes,
             "the module of the GPU kernels did not load (%.200s: %.300s); "
             "set OFL_DEMO_KERNELS_CUDA to its path",
             tried ? tried : "?", e ? e : "unknown error");
    return NULL;
  }
  const kc_api_t *(*get)(void) = NULL;
  void *sym = dlsym(h, KC_API_SYMBOL);
  if (sym != NULL) /* ISO C has no object-to-function pointer cast */
    memcpy(&get, &sym, sizeof get);
  const kc_api_t *api = get != NULL ? get() : NULL;
  if (api == NULL || api->version != KC_API_VERSION) {
    snprintf(why, why_bytes, "%.300s is not this demo's module of GPU kernels",
             tried);
    /* not closed: get() may have registered emulations that point into it */
    return NULL;
  }
  g_kc_module = h;
  return api;
}

/* Resolves --backend: opens a device as the runs will (auto: cuda when a
 * GPU is usable), and on cuda loads the GPU kernels, without which the
 * demo cannot compute there (auto then falls back to the host backend,
 * saying why; an explicit cuda fails). Prints the first line. */
int choose_backend(opts_t *o, int leader, size_t *capacity) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = o->backend;
  ofl_device_t *dev = NULL;
  ofl_status_t st = ofl_device_open(&dp, &dev);
  if (st != OFL_SUCCESS) {
    if (leader)
      fprintf(stderr, DEMO_NAME ": cannot open a %s device: %s (%s)\n",
              ofl_backend_name(o->backend), ofl_status_str(st),
              ofl_last_error());
    return 2;
  }
  ofl_backend_t got = ofl_device_backend(dev);
  char why[400];
  snprintf(why, sizeof why, "%s", ofl_device_selection_reason(dev));
  ofl_device_stats_t ds;
  ofl_device_get_stats(dev, &ds);
  *capacity = ds.device_capacity_bytes;
  int explicit_ = why[0] == '\0'; /* --backend or OFL_BACKEND named it */
  if (got == OFL_BACKEND_CUDA) {
    /* the GPU ofl chose (device_index, OFL_DEVICE, the current device):
     * the runs open it again and the kernels run on it */
    o->gpu_ordinal = ofl_device_ordinal(dev);
    char kwhy[600];
    const kc_api_t *kc = load_kernels(kwhy, sizeof kwhy);
    ofl_device_close(dev);
    if (kc == NULL && explicit_) {
      if (leader)
        fprintf(stderr,
                DEMO_NAME ": the cuda backend needs the demo's GPU kernels: "
                          "%s. Use --backend host or auto.\n",
                kwhy);
      return 2;
    }
    if (kc == NULL) {
      if (leader)
        printf("ofl pipeline demo: backend host (%s, but the demo's GPU "
               "kernels cannot be used: %s)\n",
               why, kwhy);
      o->backend = OFL_BACKEND_HOST;
      dp.backend = OFL_BACKEND_HOST;
      if (ofl_device_open(&dp, &dev) == OFL_SUCCESS) {
        ofl_device_get_stats(dev, &ds);
        *capacity = ds.device_capacity_bytes;
        ofl_device_close(dev);
      }
      return 0;
    }
    g_kc = kc;
    if (leader)
      printf("ofl pipeline demo: backend cuda (%s); the layer arithmetic "
             "runs as GPU kernels on the demo's own stream%s\n",
             explicit_ ? (o->backend == OFL_BACKEND_CUDA ? "--backend cuda"
                                                         : "OFL_BACKEND names it")
                       : why,
             kc->emulated ? " (here the test stand-in of the CUDA runtime, "
                            "which runs their CPU emulation)"
                          : "");
    o->backend = OFL_BACKEND_CUDA;
    return 0;
  }
  ofl_device_close(dev);
  if (leader)
    printf("ofl pipeline demo: backend %s (%s)\n", ofl_backend_name(got),
           explicit_ ? (o->backend == OFL_BACKEND_HOST
                            ? "--backend host"
                            : "OFL_BACKEND names it")
                     : why);
  o->backend = got;
  return 0;
}

/* Device bytes of one run, estimated for --preset oom (4-byte floats):
 * weights and gradients, 2 x (8h^2 + 2h) per layer; saved per layer and
 * microbatch, 10sh + s^2 (x, y1, qkv 3sh, probs s^2, a, x2, y2, u 2sh);
 * without offload `inflight` microbatches keep all their layers' saved
 * tensors at the peak, with offload about two layers' worth remain (the
 * layer computing, its transients and the prefetched group). On the host
 * backend the offload estimate came out 10-25% above the measured peak and
 * the baseline's 3-5% below. */
static double est_weights(double h, double layers) {
  return layers * 2 * (8 * h * h + 2 * h) * 4;
}
static double est_saved_layer(double s, double h) {
  return (10 * s * h + s * s) * 4;
}

/* Sets the model of --preset oom from the device capacity: seq = 8 x
 * hidden (activations outweigh weights), 1F1B, 2P microbatches, enough
 * layers that the baseline's peak holds 8 layers' saved tensors (layers x
 * microbatches in flight), and hidden as large as keeps the offload run's
 * estimate within 60% of the capacity. Returns 0, or 2 after a message. */
int size_preset_oom(opts_t *o, int rank, int pp, size_t capacity,
                           int leader) {
  if (capacity == 0) {
    if (leader)
      fprintf(stderr,
              DEMO_NAME ": --preset oom needs a device capacity: on the host "
                        "backend set OFL_DEVICE_CAPACITY (e.g. 8M)\n");
    return 2;
  }
  double cap = (double)capacity;
  int inflight = pp - rank; /* 1F1B: microbatches alive at the peak */
  o->vpp = 1;
  o->microbatches = 2 * pp;
  if (inflight > o->microbatches)
    inflight = o->microbatches;
  /* Layers first: at least 8 layers' worth of saved tensors at the
   * baseline's peak against about 2 with offload. */
  int layers = (8 + inflight - 1) / inflight;
  if (layers < 2)
    layers = 2;
  int h = 0;
  for (int c = 8; c <= 512; c += 8)
    if (est_weights(c, layers) + 2 * est_saved_layer(8.0 * c, c) <=
        0.6 * cap)
      h = c;
  if (h == 0)
    h = 8;
  double s = 8.0 * h;
  o->hidden = h;
  o->seq = 8 * h;
  o->layers = layers;
  double base = est_weights(h, layers) +
                (double)inflight * layers * est_saved_layer(s, h);
  double offl = est_weights(h, layers) + 2 * est_saved_layer(s, h);
  if (leader)
    printf("preset oom: device capacity %.2f MiB; hidden %d, seq %d, %d "
           "layer(s), %d microbatches, %d in flight on stage %d: estimated "
           "peak %.2f MiB without offload, %.2f MiB with\n",
           cap / 1048576, o->hidden, o->seq, o->layers, o->microbatches,
           inflight, rank, base / 1048576, offl / 1048576);
  if (base <= 1.25 * cap || offl > 0.6 * cap) {
    if (leader)
      fprintf(stderr,
              DEMO_NAME ": --preset oom: no model of this shape fits with "
                        "offload and not without on stage %d (capacity "
                        "%.2f MiB): use an earlier stage, more stages or "
                        "another capacity\n",
              rank, cap / 1048576);
    return 2;
  }
  return 0;
}

