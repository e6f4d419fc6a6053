/* ofl: the device layer's common front. Backend selection, argument checks,
 * statistics and trace hooks; the backends do the work. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/backend.h"

/* No allocation or copy can span more than half the address space; larger
 * sizes would wrap when a backend rounds them up or adds them to a pointer. */
#define MAX_BYTES ((size_t)PTRDIFF_MAX)

/* Devices and streams are numbered once per process: an override that
 * names a closed device or a destroyed stream is never taken for a new one
 * at the same address. */
static atomic_uint_fast64_t next_uid = 1;

/* The calling thread's compute-stream override, and the device's
 * streams_gone when the stream was last seen alive. */
static _Thread_local bool owned_thread;
void ofl__thread_mark_owned(void) { owned_thread = true; }
bool ofl__thread_is_owned(void) { return owned_thread; }

static _Thread_local struct {
  ofl_device_t *dev;
  uint64_t dev_uid;
  ofl_stream_t *s;
  uint64_t s_uid;
  uint64_t gone;
} tl;

const char *ofl_backend_name(ofl_backend_t backend) {
  switch (backend) {
  case OFL_BACKEND_AUTO:
    return "auto";
  case OFL_BACKEND_HOST:
    return "host";
  case OFL_BACKEND_CUDA:
    return "cuda";
  }
  return "unknown";
}

static ofl_status_t resolve_config(const ofl_device_params_t *p,
                                   ofl__device_config_t *c) {
  ofl_device_params_t def = OFL_DEVICE_PARAMS_INIT;
  if (p == NULL)
    p = &def;
  memset(c, 0, sizeof *c);
  int e = 0;
  OFL_CHECK(ofl__config_enum("OFL_BACKEND", &e));
  c->backend = p->backend != OFL_BACKEND_AUTO ? p->backend : (ofl_backend_t)e;
  if (c->backend > OFL_BACKEND_CUDA)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "backend %d is not one of auto, host, cuda",
                      (int)c->backend);
  c->device_index = p->device_index;
  size_t cap = 0;
  OFL_CHECK(ofl__config_size("OFL_DEVICE_CAPACITY", &cap));
  c->capacity_bytes = p->device_capacity_bytes ? p->device_capacity_bytes : cap;
  bool strict = false;
  OFL_CHECK(ofl__config_bool("OFL_STRICT", &strict));
  c->strict = p->strict >= 0 ? p->strict != 0 : strict;
  int64_t seed = 1, jitter = 0;
  OFL_CHECK(ofl__config_int("OFL_JITTER_SEED", &seed));
  OFL_CHECK(ofl__config_int("OFL_JITTER_MAX_US", &jitter));
  c->jitter_seed = p->jitter_seed ? p->jitter_seed : (uint64_t)seed;
  c->jitter_max_us = p->jitter_max_us >= 0 ? p->jitter_max_us : (int)jitter;
  int64_t spin = 0;
  OFL_CHECK(ofl__config_int("OFL_HOST_SPIN_US", &spin));
  c->spin_us = spin < 0 ? 0 : spin > 100000 ? 100000 : (int)spin;
  int64_t doze = 0;
  OFL_CHECK(ofl__config_int("OFL_HOST_DOZE_US", &doze));
  c->doze_us = doze < 0 ? 0 : doze > 1000000 ? 1000000 : (int)doze;
  OFL_CHECK(ofl__config_size("OFL_HOST_INLINE_BYTES", &c->inline_bytes));
  if (c->jitter_max_us < 0)
    c->jitter_max_us = 0;
  double h2d = 0, d2h = 0, tot = 0;
  OFL_CHECK(ofl__config_double("OFL_LINK_H2D_GBPS", &h2d));
  OFL_CHECK(ofl__config_double("OFL_LINK_D2H_GBPS", &d2h));
  OFL_CHECK(ofl__config_double("OFL_LINK_TOTAL_GBPS", &tot));
  c->link_h2d_bps = (p->link_h2d_gbps >= 0 ? p->link_h2d_gbps : h2d) * 1e9;
  c->link_d2h_bps = (p->link_d2h_gbps >= 0 ? p->link_d2h_gbps : d2h) * 1e9;
  c->link_total_bps =
      (p->link_total_gbps >= 0 ? p->link_total_gbps : tot) * 1e9;
  return OFL_SUCCESS;
}

/* The ops table of a backend this build has; NULL for one it has not. */
static const ofl__device_ops_t *backend_ops(ofl_backend_t backend) {
  switch (backend) {
  case OFL_BACKEND_HOST:
    return &ofl__host_ops;
  case OFL_BACKEND_CUDA:
#if OFL_HAVE_CUDA
    return &ofl__cuda_ops;
#else
    return NULL;
#endif
  case OFL_BACKEND_AUTO:
    break;
  }
  return NULL;
}

#define NO_CUDA_BUILD "this build has no cuda backend (toolkit not found)"

/* Chooses the backend; with auto and no usable GPU, host and the reason
 * (at INFO: a machine without a GPU is normal for auto). NULL on an error
 * (ofl_last_error says it). */
static const ofl__device_ops_t *select_backend(ofl_device_t *dev,
                                               ofl_status_t *err) {
  *err = OFL_SUCCESS;
  if (dev->cfg.backend == OFL_BACKEND_HOST)
    return &ofl__host_ops;
  const ofl__device_ops_t *gpu = backend_ops(OFL_BACKEND_CUDA);
  char why[300] = NO_CUDA_BUILD;
  if (gpu != NULL) {
    ofl_status_t st = gpu->probe(&dev->cfg.device_index, why, sizeof why);
    if (st == OFL_SUCCESS) {
      if (dev->cfg.backend == OFL_BACKEND_AUTO)
        snprintf(dev->reason, sizeof dev->reason,
                 "auto: %s device %d is available", gpu->name,
                 dev->cfg.device_index);
      return gpu;
    }
    if (st == OFL_ERR_CONFIG) {
      *err = st;
      return NULL;
    }
  }
  if (dev->cfg.backend == OFL_BACKEND_CUDA) {
    *err = ofl__error(OFL_ERR_NO_DEVICE, OFL_SUBSYS_DEVICE,
                      "OFL_BACKEND=cuda but no cuda device can be used (%s); "
                      "use OFL_BACKEND=host or auto to run on the CPU",
                      why);
    return NULL;
  }
  snprintf(dev->reason, sizeof dev->reason, "auto: host backend, since %.200s",
           why);
  static atomic_flag logged = ATOMIC_FLAG_INIT;
  if (!atomic_flag_test_and_set(&logged))
    OFL_INFO(OFL_SUBSYS_DEVICE, "%s", dev->reason);
  return &ofl__host_ops;
}

ofl_status_t ofl_device_open(const ofl_device_params_t *params,
                             ofl_device_t **out) {
  if (out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_device_open: out is NULL");
  ofl_device_t *dev = calloc(1, sizeof *dev);
  if (dev == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate the device object");
  pthread_mutex_init(&dev->stats_lock, NULL);
  pthread_mutex_init(&dev->streams_lock, NULL);
  dev->uid = atomic_fetch_add(&next_uid, 1);
  ofl_status_t st = ofl__defer_init(dev);
  if (st == OFL_SUCCESS)
    st = resolve_config(params, &dev->cfg);
  if (st != OFL_SUCCESS)
    goto fail;
  dev->ops = select_backend(dev, &st);
  if (dev->ops == NULL)
    goto fail;
  dev->backend = dev->ops->backend;
  dev->stats.device_capacity_bytes = dev->cfg.capacity_bytes;
  const char *trace = NULL;
  if (ofl__config_str("OFL_TRACE_FILE", &trace) == OFL_SUCCESS && trace[0])
    ofl__trace_open(dev, trace);
  st = dev->ops->open(dev);
  if (st != OFL_SUCCESS)
    goto fail;
  st = ofl_stream_create(dev, "compute", &dev->compute);
  if (st != OFL_SUCCESS) {
    dev->ops->close(dev);
    goto fail;
  }
  OFL_INFO(OFL_SUBSYS_DEVICE,
           "device open backend %s strict %d jitter_max_us %d", dev->ops->name,
           (int)dev->cfg.strict, dev->cfg.jitter_max_us);
  *out = dev;
  return OFL_SUCCESS;
fail:
  ofl__trace_close(dev);
  ofl__defer_close(dev);
  pthread_mutex_destroy(&dev->streams_lock);
  pthread_mutex_destroy(&dev->stats_lock);
  free(dev);
  return st;
}

/* Takes the first stream of the device other than the default compute
 * stream off its list; NULL when there is none. */
static ofl_stream_t *take_open_stream(ofl_device_t *dev) {
  pthread_mutex_lock(&dev->streams_lock);
  ofl_stream_t **pp = &dev->streams;
  while (*pp != NULL && *pp == dev->compute)
    pp = &(*pp)->dev_next;
  ofl_stream_t *s = *pp;
  if (s != NULL) {
    *pp = s->dev_next;
    atomic_fetch_add(&dev->streams_gone, 1);
  }
  pthread_mutex_unlock(&dev->streams_lock);
  return s;
}

static void forget_stream(ofl_stream_t *s) {
  ofl_device_t *dev = s->dev;
  pthread_mutex_lock(&dev->streams_lock);
  for (ofl_stream_t **pp = &dev->streams; *pp != NULL; pp = &(*pp)->dev_next)
    if (*pp == s) {
      *pp = s->dev_next;
      break;
    }
  atomic_fetch_add(&dev->streams_gone, 1);
  pthread_mutex_unlock(&dev->streams_lock);
}

void ofl__device_pool_created(ofl_device_t *dev) {
  pthread_mutex_lock(&dev->stats_lock);
  dev->live_pools++;
  pthread_mutex_unlock(&dev->stats_lock);
}

void ofl__device_pool_destroyed(ofl_device_t *dev) {
  pthread_mutex_lock(&dev->stats_lock);
  bool close_now = --dev->live_pools == 0 && dev->close_pending;
  pthread_mutex_unlock(&dev->stats_lock);
  if (close_now) {
    OFL_INFO(OFL_SUBSYS_DEVICE, "device close: the last pool of the device "
                                "was destroyed; the deferred close runs now");
    ofl_device_close(dev);
  }
}

void ofl_device_close(ofl_device_t *dev) {
  if (dev == NULL)
    return;
  pthread_mutex_lock(&dev->stats_lock);
  int pools = dev->live_pools;
  if (pools > 0)
    dev->close_pending = true;
  pthread_mutex_unlock(&dev->stats_lock);
  if (pools > 0) {
    /* Misuse: closing would leave the pools on freed memory. */
    OFL_WARN(OFL_SUBSYS_DEVICE,
              "device close: %d pool(s) created on this device are still "
              "alive; the close is deferred until the last one is destroyed "
              "(destroy pools before their device: ofl_pool_destroy)",
              pools);
    return;
  }
  if (tl.dev == dev)
    tl.s = NULL;
  /* Streams the application did not destroy: drain (bounded) and stop
   * them, as the header promises, so no worker outlives the device. */
  for (ofl_stream_t *s; (s = take_open_stream(dev)) != NULL;) {
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "device close: stream '%s' was not destroyed; "
             "draining and destroying it now",
             s->name);
    ofl_status_t st = dev->ops->stream_destroy(s);
    if (st != OFL_SUCCESS) {
      dev->drain_failed = true;
      OFL_WARN(OFL_SUBSYS_DEVICE,
               "device close: stream '%s' did not drain: "
               "%s",
               s->name, ofl_status_str(st));
    }
    free(s);
  }
  if (dev->compute != NULL) {
    forget_stream(dev->compute);
    if (dev->ops->stream_destroy(dev->compute) != OFL_SUCCESS)
      dev->drain_failed = true;
    free(dev->compute);
    dev->compute = NULL;
  }
  /* Releases ordered after the drained work run now; those after work that
   * did not drain are leaked (their copies may still run). */
  ofl__defer_close(dev);
  dev->ops->close(dev);
  ofl__trace_close(dev);
  pthread_mutex_destroy(&dev->streams_lock);
  pthread_mutex_destroy(&dev->stats_lock);
  free(dev);
}

ofl_backend_t ofl_device_backend(const ofl_device_t *dev) {
  return dev ? dev->backend : OFL_BACKEND_AUTO;
}
int ofl_device_ordinal(const ofl_device_t *dev) {
  return dev && dev->backend == OFL_BACKEND_CUDA ? dev->cfg.device_index : -1;
}
const char *ofl_device_selection_reason(const ofl_device_t *dev) {
  return dev ? dev->reason : "";
}
int ofl_device_is_strict(const ofl_device_t *dev) {
  return dev && dev->backend == OFL_BACKEND_HOST && dev->cfg.strict;
}

ofl_status_t ofl_device_adopt_host_memory(ofl_device_t *dev, int on) {
  if (dev == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_device_adopt_host_memory: device is NULL");
  if (dev->ops->adopt_host_memory == NULL)
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_DEVICE,
                      "ofl_device_adopt_host_memory: the %s backend's device "
                      "memory is the GPU's; only the host backend can take "
                      "the application's memory as device memory",
                      dev->ops->name);
  dev->ops->adopt_host_memory(dev, on != 0);
  return OFL_SUCCESS;
}

void ofl_device_get_stats(const ofl_device_t *dev, ofl_device_stats_t *out) {
  if (dev == NULL || out == NULL)
    return;
  ofl_device_t *d = (ofl_device_t *)dev;
  pthread_mutex_lock(&d->stats_lock);
  *out = d->stats;
  pthread_mutex_unlock(&d->stats_lock);
  out->copies = atomic_load(&d->copies);
  for (int i = 0; i < 4; i++)
    out->copy_bytes[i] = atomic_load(&d->copy_bytes[i]);
}

void ofl_device_reset_peak(ofl_device_t *dev) {
  if (dev == NULL)
    return;
  pthread_mutex_lock(&dev->stats_lock);
  dev->stats.device_bytes_peak = dev->stats.device_bytes_in_use;
  pthread_mutex_unlock(&dev->stats_lock);
}

ofl_status_t ofl_device_malloc(ofl_device_t *dev, size_t bytes, void **out) {
  if (dev == NULL || out == NULL || bytes == 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_device_malloc: %s",
                      bytes == 0 ? "zero bytes requested" : "NULL argument");
  if (bytes > MAX_BYTES)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "ofl_device_malloc: %zu bytes is more than any device "
                      "can hold; check the size computation",
                      bytes);
  void *p = NULL;
  OFL_CHECK(dev->ops->device_malloc(dev, bytes, &p));
  pthread_mutex_lock(&dev->stats_lock);
  dev->stats.device_bytes_in_use += bytes;
  if (dev->stats.device_bytes_in_use > dev->stats.device_bytes_peak)
    dev->stats.device_bytes_peak = dev->stats.device_bytes_in_use;
  dev->stats.device_allocs++;
  pthread_mutex_unlock(&dev->stats_lock);
  *out = p;
  return OFL_SUCCESS;
}

ofl_status_t ofl_device_free(ofl_device_t *dev, void *ptr) {
  if (dev == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_device_free: device is NULL");
  if (ptr == NULL)
    return OFL_SUCCESS;
  size_t bytes = 0;
  OFL_CHECK(dev->ops->device_free(dev, ptr, &bytes));
  pthread_mutex_lock(&dev->stats_lock);
  dev->stats.device_bytes_in_use -= bytes;
  dev->stats.device_frees++;
  pthread_mutex_unlock(&dev->stats_lock);
  return OFL_SUCCESS;
}

ofl_status_t ofl_pinned_malloc(ofl_device_t *dev, size_t bytes, void **out) {
  if (dev == NULL || out == NULL || bytes == 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_pinned_malloc: %s",
                      bytes == 0 ? "zero bytes requested" : "NULL argument");
  if (bytes > MAX_BYTES)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "ofl_pinned_malloc: %zu bytes is more than the host "
                      "can hold; check the size computation",
                      bytes);
  void *p = NULL;
  OFL_CHECK(dev->ops->pinned_malloc(dev, bytes, &p));
  pthread_mutex_lock(&dev->stats_lock);
  dev->stats.pinned_bytes_in_use += bytes;
  dev->stats.pinned_allocs++;
  pthread_mutex_unlock(&dev->stats_lock);
  *out = p;
  return OFL_SUCCESS;
}

ofl_status_t ofl_pinned_free(ofl_device_t *dev, void *ptr) {
  if (dev == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_pinned_free: device is NULL");
  if (ptr == NULL)
    return OFL_SUCCESS;
  size_t bytes = 0;
  OFL_CHECK(dev->ops->pinned_free(dev, ptr, &bytes));
  pthread_mutex_lock(&dev->stats_lock);
  dev->stats.pinned_bytes_in_use -= bytes;
  dev->stats.pinned_frees++;
  pthread_mutex_unlock(&dev->stats_lock);
  return OFL_SUCCESS;
}

ofl_stream_t *ofl_device_compute_stream(ofl_device_t *dev) {
  if (dev == NULL)
    return NULL;
  if (tl.s == NULL || tl.dev != dev || tl.dev_uid != dev->uid)
    return dev->compute;
  uint64_t gone = atomic_load(&dev->streams_gone);
  if (gone == tl.gone)
    return tl.s;
  /* A stream of the device went (on any thread): is ours still listed? */
  bool alive = false;
  pthread_mutex_lock(&dev->streams_lock);
  for (ofl_stream_t *s = dev->streams; s != NULL && !alive; s = s->dev_next)
    alive = s == tl.s && s->uid == tl.s_uid;
  pthread_mutex_unlock(&dev->streams_lock);
  if (!alive) {
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "this thread's compute stream was destroyed; back to the "
             "device's default compute stream");
    tl.s = NULL;
    return dev->compute;
  }
  tl.gone = gone;
  return tl.s;
}

void ofl_device_set_compute_stream(ofl_device_t *dev, ofl_stream_t *stream) {
  if (dev != NULL && stream != NULL && stream->dev != dev) {
    ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
               "ofl_device_set_compute_stream: stream '%s' belongs to "
               "another device; the override is cleared",
               stream->name);
    stream = NULL;
  }
  tl.dev = dev;
  tl.dev_uid = dev != NULL ? dev->uid : 0;
  tl.s = stream;
  tl.s_uid = stream != NULL ? stream->uid : 0;
  tl.gone = dev != NULL ? atomic_load(&dev->streams_gone) : 0;
}

/* A stream object on dev, made by the backend (a new stream, or the
 * application's native one when wrapped), listed on the device. */
static ofl_status_t stream_new(ofl_device_t *dev, const char *name, bool wrap,
                               void *native, ofl_stream_t **out) {
  ofl_stream_t *s = calloc(1, sizeof *s);
  if (s == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate a stream object");
  s->dev = dev;
  s->uid = atomic_fetch_add(&next_uid, 1);
  s->id = atomic_fetch_add(&dev->next_stream_id, 1);
  s->wrapped = wrap;
  s->is_compute = !wrap && dev->compute == NULL; /* a device's first */
  snprintf(s->name, sizeof s->name, "%s", name ? name : "stream");
  ofl_status_t st =
      wrap ? dev->ops->stream_wrap(s, native) : dev->ops->stream_create(s);
  if (st != OFL_SUCCESS) {
    free(s);
    return st;
  }
  ofl__trace_name_track(dev, s->id, s->name);
  pthread_mutex_lock(&dev->streams_lock);
  s->dev_next = dev->streams;
  dev->streams = s;
  pthread_mutex_unlock(&dev->streams_lock);
  *out = s;
  return OFL_SUCCESS;
}

ofl_status_t ofl_stream_create(ofl_device_t *dev, const char *name,
                               ofl_stream_t **out) {
  if (dev == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_stream_create: NULL argument");
  return stream_new(dev, name, false, NULL, out);
}

ofl_status_t ofl_stream_destroy(ofl_stream_t *s) {
  if (s == NULL)
    return OFL_SUCCESS;
  ofl_device_t *dev = s->dev;
  /* The calling thread's compute stream override must not outlive the
   * stream (ofl_device_compute_stream falls back to the default). */
  if (tl.s == s)
    tl.s = NULL;
  forget_stream(s);
  ofl_status_t st = dev->ops->stream_destroy(s);
  if (st == OFL_SUCCESS)
    ofl__defer_run_stream(s);
  free(s);
  return st;
}

ofl_status_t ofl_stream_wrap_native(ofl_device_t *dev, void *native,
                                    const char *name, ofl_stream_t **out) {
  if (dev == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_stream_wrap_native: NULL argument");
  if (dev->ops->stream_wrap == NULL)
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_DEVICE,
                      "ofl_stream_wrap_native: the %s backend has no native "
                      "streams; use ofl_stream_create",
                      dev->ops->name);
  return stream_new(dev, name ? name : "native", true, native, out);
}

/* A query that fails answers "capturing": refusing is the safe side, since
 * work queued on a stream that is captured would break the capture. */
bool ofl__stream_capturing(ofl_stream_t *s) {
  bool capturing = false;
  if (s != NULL && s->dev->ops->stream_capturing != NULL &&
      s->dev->ops->stream_capturing(s, &capturing) != OFL_SUCCESS)
    return true;
  return capturing;
}

void *ofl_stream_native(const ofl_stream_t *s) {
  if (s == NULL || s->dev->ops->stream_native == NULL)
    return NULL;
  return s->dev->ops->stream_native(s);
}

#define CHECK_STREAM(s, fn)                                                    \
  do {                                                                         \
    if ((s) == NULL)                                                           \
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,                \
                        "%s: stream is NULL", fn);                             \
  } while (0)
#define CHECK_EVENT(e, fn)                                                     \
  do {                                                                         \
    if ((e) == NULL)                                                           \
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,                \
                        "%s: event is NULL", fn);                              \
  } while (0)

ofl_status_t ofl_stream_synchronize(ofl_stream_t *s, int64_t timeout_ms) {
  CHECK_STREAM(s, "ofl_stream_synchronize");
  ofl_status_t st =
      s->dev->ops->stream_synchronize(s, ofl__timeout_ms(timeout_ms));
  /* Releases ordered after this stream's work have all run when it
   * returns (on this thread, or the device's release thread). */
  if (st == OFL_SUCCESS)
    ofl__defer_run_stream(s);
  return st;
}

ofl_status_t ofl_stream_query(ofl_stream_t *s) {
  CHECK_STREAM(s, "ofl_stream_query");
  return s->dev->ops->stream_query(s);
}

const char *ofl_stream_name(const ofl_stream_t *s) { return s ? s->name : ""; }
ofl_device_t *ofl_stream_device(const ofl_stream_t *s) {
  return s ? s->dev : NULL;
}

ofl_status_t ofl_event_create(ofl_device_t *dev, ofl_event_t **out) {
  if (dev == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_event_create: NULL argument");
  ofl_event_t *e = calloc(1, sizeof *e);
  if (e == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate an event object");
  e->dev = dev;
  ofl_status_t st = dev->ops->event_create(e);
  if (st != OFL_SUCCESS) {
    free(e);
    return st;
  }
  *out = e;
  return OFL_SUCCESS;
}

ofl_status_t ofl__event_create_timed(ofl_device_t *dev, ofl_event_t **out) {
  if (dev->ops->event_create_timed == NULL)
    return OFL_ERR_NOT_SUPPORTED;
  ofl_event_t *e = calloc(1, sizeof *e);
  if (e == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate an event object");
  e->dev = dev;
  ofl_status_t st = dev->ops->event_create_timed(e);
  if (st != OFL_SUCCESS) {
    free(e);
    return st;
  }
  *out = e;
  return OFL_SUCCESS;
}

ofl_status_t ofl__event_elapsed_ns(ofl_event_t *a, ofl_event_t *b,
                                   uint64_t *ns) {
  if (a->dev->ops->event_elapsed_ns == NULL)
    return OFL_ERR_NOT_SUPPORTED;
  return a->dev->ops->event_elapsed_ns(a, b, ns);
}

void ofl_event_destroy(ofl_event_t *e) {
  if (e == NULL)
    return;
  e->dev->ops->event_destroy(e);
  free(e);
}

ofl_status_t ofl_event_record(ofl_event_t *e, ofl_stream_t *s) {
  CHECK_EVENT(e, "ofl_event_record");
  CHECK_STREAM(s, "ofl_event_record");
  if (e->dev != s->dev)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_event_record: event and stream '%s' belong to "
                      "different devices",
                      s->name);
  return s->dev->ops->event_record(e, s);
}

ofl_status_t ofl_event_query(ofl_event_t *e) {
  CHECK_EVENT(e, "ofl_event_query");
  return e->dev->ops->event_query(e);
}

ofl_status_t ofl_event_synchronize(ofl_event_t *e, int64_t timeout_ms) {
  CHECK_EVENT(e, "ofl_event_synchronize");
  return e->dev->ops->event_synchronize(e, ofl__timeout_ms(timeout_ms));
}

ofl_status_t ofl_stream_wait_event(ofl_stream_t *s, ofl_event_t *e) {
  CHECK_STREAM(s, "ofl_stream_wait_event");
  CHECK_EVENT(e, "ofl_stream_wait_event");
  if (e->dev != s->dev)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_stream_wait_event: event and stream '%s' belong "
                      "to different devices",
                      s->name);
  return s->dev->ops->stream_wait_event(s, e);
}

ofl_status_t ofl_memcpy_async(void *dst, const void *src, size_t bytes,
                              ofl_copy_kind_t kind, ofl_stream_t *s) {
  CHECK_STREAM(s, "ofl_memcpy_async");
  if (bytes == 0)
    return OFL_SUCCESS;
  if (dst == NULL || src == NULL || (unsigned)kind > OFL_COPY_H2H)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_memcpy_async: %s on stream '%s'",
                      (unsigned)kind > OFL_COPY_H2H ? "invalid copy kind"
                                                    : "NULL pointer",
                      s->name);
  if (bytes > MAX_BYTES)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_memcpy_async: %zu bytes on stream '%s' is more "
                      "than any buffer can hold; check the length",
                      bytes, s->name);
  OFL_CHECK(s->dev->ops->memcpy_async(dst, src, bytes, kind, s));
  atomic_fetch_add(&s->dev->copies, 1);
  atomic_fetch_add(&s->dev->copy_bytes[kind], bytes);
  return OFL_SUCCESS;
}

ofl_status_t ofl_memset_async(void *dst, int value, size_t bytes,
                              ofl_stream_t *s) {
  CHECK_STREAM(s, "ofl_memset_async");
  if (bytes == 0)
    return OFL_SUCCESS;
  if (dst == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_memset_async: NULL pointer on stream '%s'", s->name);
  if (bytes > MAX_BYTES)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_memset_async: %zu bytes on stream '%s' is more "
                      "than any buffer can hold; check the length",
                      bytes, s->name);
  return s->dev->ops->memset_async(dst, value, bytes, s);
}

ofl_status_t ofl_stream_launch_host_func(ofl_stream_t *s, ofl_host_fn fn,
                                         void *arg) {
  CHECK_STREAM(s, "ofl_stream_launch_host_func");
  if (fn == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_stream_launch_host_func: fn is NULL");
  return s->dev->ops->launch_host_func(s, fn, arg);
}

ofl_status_t ofl__stream_launch_release(ofl_stream_t *s, ofl_host_fn fn,
                                        void *arg) {
  const ofl__device_ops_t *ops = s->dev->ops;
  return ops->launch_release != NULL ? ops->launch_release(s, fn, arg)
                                     : ofl__device_defer(s, fn, arg);
}

void ofl_range_push(ofl_device_t *dev, const char *name) {
  if (dev != NULL && name != NULL)
    dev->ops->range_push(dev, name);
}

void ofl_range_pop(ofl_device_t *dev) {
  if (dev != NULL)
    dev->ops->range_pop(dev);
}

ofl_status_t ofl_backend_probe(ofl_backend_t backend, int *count, char *why,
                               size_t why_bytes) {
  char buf[512] = "";
  int n = 0;
  ofl_status_t st = OFL_ERR_NO_DEVICE;
  if (backend != OFL_BACKEND_HOST) {
    const ofl__device_ops_t *gpu = backend_ops(OFL_BACKEND_CUDA);
    if (gpu != NULL)
      st = gpu->device_count(&n, buf, sizeof buf);
    else
      snprintf(buf, sizeof buf, NO_CUDA_BUILD);
  }
  if (backend == OFL_BACKEND_HOST ||
      (backend == OFL_BACKEND_AUTO && st != OFL_SUCCESS)) {
    st = OFL_SUCCESS;
    n = 1;
  }
  if (count != NULL)
    *count = st == OFL_SUCCESS ? n : 0;
  if (why != NULL && why_bytes > 0)
    snprintf(why, why_bytes, "%s", st == OFL_SUCCESS ? "" : buf);
  return st;
}

bool ofl__device_owns(ofl_device_t *dev, const void *ptr, size_t bytes) {
  if (dev == NULL || ptr == NULL)
    return false;
  return dev->ops->device_owns(dev, ptr, bytes);
}

size_t ofl__device_inflight(ofl_device_t *dev, const void *ptr, size_t bytes) {
  if (dev == NULL || ptr == NULL || dev->ops->inflight == NULL)
    return 0;
  return dev->ops->inflight(dev, ptr, bytes);
}

/* Only the host backend's device memory is the CPU's to write. */
void ofl__device_poison(ofl_device_t *dev, void *ptr, size_t bytes) {
  if (dev != NULL && dev->backend == OFL_BACKEND_HOST && ptr != NULL)
    memset(ptr, OFL__POISON_BYTE, bytes);
}

ofl_status_t ofl__device_link_rate(ofl_device_t *dev, double *d2h_bytes_per_s,
                                   double *h2d_bytes_per_s,
                                   ofl__link_source_t *source) {
  if (dev == NULL || d2h_bytes_per_s == NULL || h2d_bytes_per_s == NULL ||
      source == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl__device_link_rate: NULL argument");
  if (dev->ops->link_rate != NULL)
    return dev->ops->link_rate(dev, d2h_bytes_per_s, h2d_bytes_per_s, source);
  *d2h_bytes_per_s = 0;
  *h2d_bytes_per_s = 0;
  *source = OFL__LINK_NONE;
  return OFL_SUCCESS;
}
