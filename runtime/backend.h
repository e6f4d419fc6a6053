/* ofl: the backends' interface, private to runtime/. device.c holds the
 * common front (selection, argument checks, stats, trace) and calls a
 * backend only through its ops table; each backend (device_host.c and the
 * host_*.c files, device_cuda.c) fills one. The other layers see the device
 * through runtime/device_internal.h, where struct ofl_device is opaque. Not
 * installed. */
#ifndef OFL_RUNTIME_BACKEND_H
#define OFL_RUNTIME_BACKEND_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "runtime/device_internal.h"

typedef struct ofl__device_ops ofl__device_ops_t;
typedef struct ofl__trace ofl__trace_t;

/* Parameters after the environment filled what the caller left unset. */
typedef struct ofl__device_config {
  ofl_backend_t backend;
  int device_index; /* -1 until resolved: cuda takes the caller's current
                       device at open (or OFL_DEVICE) */
  size_t capacity_bytes;
  bool strict;
  uint64_t jitter_seed;
  int jitter_max_us;
  int spin_us;         /* host backend: worker poll before sleeping */
  int doze_us;         /* host backend: worker's timed doze after recent work */
  size_t inline_bytes; /* host backend: copies up to this size run on the
                          submitting thread when their stream is idle */
  double link_h2d_bps, link_d2h_bps, link_total_bps; /* bytes/s; 0: off */
} ofl__device_config_t;

struct ofl_device {
  const ofl__device_ops_t *ops;
  ofl_backend_t backend;
  ofl__device_config_t cfg;
  char reason[256];
  void *impl;
  ofl_stream_t *compute; /* the default compute stream */
  ofl__trace_t *trace;   /* NULL unless OFL_TRACE_FILE */

  pthread_mutex_t stats_lock;
  ofl_device_stats_t stats;
  atomic_uint_fast64_t copies;
  atomic_uint_fast64_t copy_bytes[4];
  atomic_int next_stream_id;
  /* Every stream of the device, so that close can stop those left open. */
  pthread_mutex_t streams_lock;
  ofl_stream_t *streams;
  /* A thread's compute-stream override names the device and the stream by
   * uid as well as by pointer (a pointer may come back from malloc after a
   * close); streams_gone counts destroyed streams, so that an override is
   * checked against the list only after one went. */
  uint64_t uid;
  atomic_uint_fast64_t streams_gone;
  /* A stream did not drain at close: memory DMA may still use is leaked
   * instead of freed. */
  bool drain_failed;
  /* Releases ordered after stream work (runtime/defer.c). */
  struct ofl__defer *defer;
  /* Pools created on the device and not destroyed (stats_lock): a close
   * while some live is deferred until the last one is destroyed
   * (close_pending), so that no pool is left on a freed device. */
  int live_pools;
  bool close_pending;
};

struct ofl_stream {
  ofl_device_t *dev;
  char name[32];
  int id;          /* trace track */
  bool is_compute; /* executes on the calling thread (host backend) */
  bool wrapped;    /* the application's native stream: never destroyed */
  void *impl;
  ofl_stream_t *dev_next; /* the device's list of streams */
  uint64_t uid;           /* unique in the process */
};

struct ofl_event {
  ofl_device_t *dev;
  void *impl;
};

struct ofl__device_ops {
  const char *name;
  ofl_backend_t backend;
  /* Whether the backend can open a device: OFL_SUCCESS, else the reason in
   * why. A *device_index of -1 is resolved first; OFL_ERR_CONFIG for an
   * invalid setting (NULL op: always). */
  ofl_status_t (*probe)(int *device_index, char *why, size_t cap);
  /* Counts the devices: OFL_ERR_NO_DEVICE with why when there is none
   * (ofl_backend_probe; NULL op: one). */
  ofl_status_t (*device_count)(int *count, char *why, size_t cap);
  ofl_status_t (*open)(ofl_device_t *dev);
  void (*close)(ofl_device_t *dev);
  ofl_status_t (*device_malloc)(ofl_device_t *dev, size_t bytes, void **out);
  ofl_status_t (*device_free)(ofl_device_t *dev, void *ptr, size_t *bytes);
  ofl_status_t (*pinned_malloc)(ofl_device_t *dev, size_t bytes, void **out);
  ofl_status_t (*pinned_free)(ofl_device_t *dev, void *ptr, size_t *bytes);
  /* ofl__device_owns, dev and ptr not NULL. */
  bool (*device_owns)(ofl_device_t *dev, const void *ptr, size_t bytes);
  /* ofl__device_inflight, ptr not NULL (NULL op: 0). */
  size_t (*inflight)(ofl_device_t *dev, const void *ptr, size_t bytes);
  /* ofl_device_adopt_host_memory (NULL op: not supported). */
  void (*adopt_host_memory)(ofl_device_t *dev, bool on);
  /* ofl__device_link_rate, arguments not NULL (NULL op: 0, unknown). */
  ofl_status_t (*link_rate)(ofl_device_t *dev, double *d2h_bytes_per_s,
                            double *h2d_bytes_per_s,
                            ofl__link_source_t *source);
  /* Prepares the device's release thread (runtime/defer.c) as it starts
   * (NULL op: nothing to do). */
  void (*release_thread_init)(ofl_device_t *dev);
  ofl_status_t (*stream_create)(ofl_stream_t *s);
  /* Wraps the application's native stream (NULL op: not supported). */
  ofl_status_t (*stream_wrap)(ofl_stream_t *s, void *native);
  /* The native handle of a stream (NULL op or answer: none). */
  void *(*stream_native)(const ofl_stream_t *s);
  /* Whether a graph capture records the stream's work (NULL op: never). */
  ofl_status_t (*stream_capturing)(ofl_stream_t *s, bool *capturing);
  ofl_status_t (*stream_destroy)(ofl_stream_t *s);
  ofl_status_t (*stream_synchronize)(ofl_stream_t *s, int64_t timeout_ms);
  ofl_status_t (*stream_query)(ofl_stream_t *s);
  ofl_status_t (*event_create)(ofl_event_t *e);
  void (*event_destroy)(ofl_event_t *e);
  ofl_status_t (*event_record)(ofl_event_t *e, ofl_stream_t *s);
  ofl_status_t (*event_query)(ofl_event_t *e);
  ofl_status_t (*event_synchronize)(ofl_event_t *e, int64_t timeout_ms);
  ofl_status_t (*stream_wait_event)(ofl_stream_t *s, ofl_event_t *e);
  /* Events that time (NULL ops: the backend's waits are measured on the
   * CPU, as the host compute stream runs on the calling thread). */
  ofl_status_t (*event_create_timed)(ofl_event_t *e);
  ofl_status_t (*event_elapsed_ns)(ofl_event_t *a, ofl_event_t *b,
                                   uint64_t *ns);
  ofl_status_t (*memcpy_async)(void *dst, const void *src, size_t bytes,
                               ofl_copy_kind_t kind, ofl_stream_t *s);
  ofl_status_t (*memset_async)(void *dst, int value, size_t bytes,
                               ofl_stream_t *s);
  ofl_status_t (*launch_host_func)(ofl_stream_t *s, ofl_host_fn fn, void *arg);
  /* A host function that may run on any thread (ofl__stream_launch_release);
   * NULL: the device's release thread runs it (ofl__device_defer). */
  ofl_status_t (*launch_release)(ofl_stream_t *s, ofl_host_fn fn, void *arg);
  void (*range_push)(ofl_device_t *dev, const char *name);
  void (*range_pop)(ofl_device_t *dev);
};

extern const ofl__device_ops_t ofl__host_ops;
#if OFL_HAVE_CUDA
extern const ofl__device_ops_t ofl__cuda_ops;
/* The cuda backend's link_rate op (runtime/cuda_link.c). */
ofl_status_t ofl__cuda_link_rate(ofl_device_t *dev, double *d2h_bytes_per_s,
                                 double *h2d_bytes_per_s,
                                 ofl__link_source_t *source);
#endif

/* ---- deferred work (runtime/defer.c) ------------------------------------ */
ofl_status_t ofl__defer_init(ofl_device_t *dev);
/* Runs the deferred work of stream whose event completed, on the calling
 * thread, and waits for any of it the device thread is running (called by
 * ofl_stream_synchronize after the stream drained). */
void ofl__defer_run_stream(ofl_stream_t *stream);
/* Device close, streams drained (or not: then pending work is leaked and
 * said so). Stops the device thread. */
void ofl__defer_close(ofl_device_t *dev);

/* ---- trace (runtime/trace.c) -------------------------------------------- */
ofl_status_t ofl__trace_open(ofl_device_t *dev, const char *path);
void ofl__trace_close(ofl_device_t *dev);
static inline bool ofl__trace_on(const ofl_device_t *dev) {
  return dev != NULL && dev->trace != NULL;
}

#endif /* OFL_RUNTIME_BACKEND_H */
