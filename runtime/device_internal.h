/* ofl: the device layer's internal interface. device.c holds the common
 * front (selection, argument checks, stats, trace); each backend fills an ops
 * table. Not installed. */
#ifndef OFL_RUNTIME_DEVICE_INTERNAL_H
#define OFL_RUNTIME_DEVICE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include <ofl/device.h>
#include <ofl/version.h>

#include "runtime/internal.h"

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
  int spin_us; /* host backend: worker poll before sleeping */
  int doze_us; /* host backend: worker's timed doze after recent work */
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

/* Counts a pool created on dev / destroyed; the destroy of the last pool of
 * a device whose close was deferred closes it. */
void ofl__device_pool_created(ofl_device_t *dev);
void ofl__device_pool_destroyed(ofl_device_t *dev);

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
  ofl_status_t (*open)(ofl_device_t *dev);
  void (*close)(ofl_device_t *dev);
  ofl_status_t (*device_malloc)(ofl_device_t *dev, size_t bytes, void **out);
  ofl_status_t (*device_free)(ofl_device_t *dev, void *ptr, size_t *bytes);
  ofl_status_t (*pinned_malloc)(ofl_device_t *dev, size_t bytes, void **out);
  ofl_status_t (*pinned_free)(ofl_device_t *dev, void *ptr, size_t *bytes);
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
/* OFL_SUCCESS when a CUDA device can be used; else the reason in why. A
 * *device_index of -1 is resolved first (OFL_DEVICE, else the calling
 * thread's current device); OFL_ERR_CONFIG for an invalid OFL_DEVICE. */
ofl_status_t ofl__cuda_probe(int *device_index, char *why, size_t cap);
/* Loads the CUDA runtime (runtime/cuda_api.h) and counts the devices:
 * OFL_ERR_NO_DEVICE with why when it is not found, the driver is missing or
 * too old, or there is no device. */
ofl_status_t ofl__cuda_device_count(int *count, char *why, size_t cap);
/* Selects cuda device `device` on the calling thread when it sits on
 * another, remembering whether leave must give the caller's back (see
 * runtime/device_cuda.c: never to a device without a primary context, never
 * on ofl's own threads). */
typedef struct {
  int prev;
  bool restore;
  int capture_mode; /* the thread's capture mode, given back by leave */
} ofl__cuda_guard_t;
ofl_status_t ofl__cuda_enter(int device, ofl__cuda_guard_t *g);
/* Puts the calling (ofl-owned) thread in relaxed capture mode for good:
 * release callbacks run there may call cudaFree while the application
 * captures a graph on another thread. */
void ofl__cuda_thread_relax_capture(void);
void ofl__cuda_leave(const ofl__cuda_guard_t *g);
#endif

/* ---- deferred work (runtime/defer.c) --------------------------------------
 * fn(arg) runs once the work queued on stream so far has completed, on an
 * ofl thread of the device (or on the thread that synchronises that stream,
 * whichever comes first), never inside a stream's host function: user
 * callbacks and CUDA calls are allowed in fn (docs/DESIGN.md section 3.1).
 * Steady state allocates nothing: entries and their events are reused. */
ofl_status_t ofl__defer_init(ofl_device_t *dev);
/* fn(arg) once the work queued on stream so far completed, where fn may run
 * on any thread: it calls no CUDA and no ofl function and takes no lock (a
 * release of storage wrapped with OFL_WRAP_RELEASE_IN_HOST_FN). On the host
 * backend it is an operation of the stream, which a thread waiting on the
 * stream may run as it runs the copies before it (steal), and which runs at
 * once on the calling thread when the stream is idle; elsewhere (cuda,
 * where a host function would hold up the stream) ofl__device_defer. */
ofl_status_t ofl__stream_launch_release(ofl_stream_t *stream, ofl_host_fn fn,
                                        void *arg);
ofl_status_t ofl__device_defer(ofl_stream_t *stream, void (*fn)(void *),
                               void *arg);
/* Runs the deferred work of stream whose event completed, on the calling
 * thread, and waits for any of it the device thread is running (called by
 * ofl_stream_synchronize after the stream drained). */
void ofl__defer_run_stream(ofl_stream_t *stream);
/* Device close, streams drained (or not: then pending work is leaked and
 * said so). Stops the device thread. */
void ofl__defer_close(ofl_device_t *dev);

/* An event that records when its stream reached it; OFL_ERR_NOT_SUPPORTED
 * where the backend has none (host). */
ofl_status_t ofl__event_create_timed(ofl_device_t *dev, ofl_event_t **out);
/* Time between two completed timed events; OFL_ERR_NOT_READY while either
 * has not completed. */
ofl_status_t ofl__event_elapsed_ns(ofl_event_t *a, ofl_event_t *b,
                                   uint64_t *ns);

/* Whether the stream is being captured into a CUDA graph (false on
 * backends without graphs, and when the query fails). */
bool ofl__stream_capturing(ofl_stream_t *s);

/* Threads that ofl starts (release, save, disk threads) mark themselves:
 * the cuda backend selects its device on them and leaves it selected, while
 * on the application's threads it restores the caller's device. */
void ofl__thread_mark_owned(void);
bool ofl__thread_is_owned(void);

/* ---- trace (runtime/trace.c) ---------------------------------------------
 * Chrome trace events, one track per stream; written at device close. */
ofl_status_t ofl__trace_open(ofl_device_t *dev, const char *path);
void ofl__trace_close(ofl_device_t *dev);
/* A name as the inside of a JSON string in at most cap-1 bytes: escaped,
 * valid UTF-8 (other bytes become U+FFFD), never cut inside a character. */
void ofl__trace_json_escape(char *dst, size_t cap, const char *src);
/* Copies src into dst (at most cap-1 bytes and a NUL), never cutting a
 * UTF-8 character. */
void ofl__utf8_copy(char *dst, size_t cap, const char *src);
/* A complete event ("X") on a stream's track; args_json may be NULL or a
 * JSON object body such as "\"bytes\":4096". */
void ofl__trace_complete(ofl_device_t *dev, int track, const char *name,
                         const char *cat, uint64_t start_ns, uint64_t end_ns,
                         const char *args_json);
void ofl__trace_name_track(ofl_device_t *dev, int track, const char *name);
static inline bool ofl__trace_on(const ofl_device_t *dev) {
  return dev != NULL && dev->trace != NULL;
}

/* ---- host backend extras (runtime/device_host.c) ------------------------- */
/* Number of operations queued or running that read or write [ptr, ptr+bytes)
 * (host backend; 0 on other backends). Pools use it in strict mode. */
size_t ofl__device_inflight(ofl_device_t *dev, const void *ptr, size_t bytes);
/* Whether [ptr, ptr+bytes) is device memory of dev: inside one of its
 * device blocks (host backend), or device memory of its ordinal by
 * cudaPointerGetAttributes (cuda). The pipeline checks pushes with it. */
bool ofl__device_owns(ofl_device_t *dev, const void *ptr, size_t bytes);
bool ofl__host_device_owns(ofl_device_t *dev, const void *ptr, size_t bytes);
/* ofl_device_adopt_host_memory on a host device. */
void ofl__host_adopt_memory(ofl_device_t *dev, bool on);
#if OFL_HAVE_CUDA
bool ofl__cuda_device_owns(ofl_device_t *dev, const void *ptr, size_t bytes);
#endif
/* Tests of the host backend's work stealing: hold keeps a worker stream's
 * worker from starting operations (as one that has not woken up yet; a
 * destroy still drains it), stolen counts the operations of the stream that
 * waiting threads ran themselves. No-ops on other streams and backends. */
void ofl__host_stream_hold(ofl_stream_t *s, bool hold);
uint64_t ofl__host_stream_stolen(ofl_stream_t *s);
/* Operations of the stream that ran on the thread that submitted them
 * (OFL_HOST_INLINE_BYTES; 0 off the host backend). */
uint64_t ofl__host_stream_inlined(ofl_stream_t *s);
/* Signals that woke the stream's worker: asleep, or in a doze with more
 * than OFL_HOST_DOZE_US left (a worker in a shorter doze after recent work
 * finds new work itself); dozes counts the dozes it began. 0 off the host
 * backend. */
uint64_t ofl__host_stream_wakes(ofl_stream_t *s);
uint64_t ofl__host_stream_dozes(ofl_stream_t *s);
/* Fills [ptr, ptr+bytes) with the strict-mode poison byte (host backend). */
void ofl__device_poison(ofl_device_t *dev, void *ptr, size_t bytes);
#define OFL__POISON_BYTE 0xDB

#endif /* OFL_RUNTIME_DEVICE_INTERNAL_H */
