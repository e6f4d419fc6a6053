/* ofl: the device layer. One interface over two backends: cuda (the CUDA
 * runtime) and host (everything on the CPU, for machines without a GPU and
 * for tests). Streams, events, device and pinned host memory, async copies.
 *
 * Host backend semantics: the compute stream runs each operation on the
 * calling thread when it is enqueued; every other stream is a worker thread
 * with a FIFO. An event completes when its stream reaches the point where it
 * was recorded. Strict mode poisons freed blocks, adds seeded jitter to the
 * worker streams and reports frees of blocks still used by queued copies. */
#ifndef OFL_DEVICE_H
#define OFL_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include <ofl/export.h>
#include <ofl/status.h>

OFL_EXTERN_C_BEGIN

typedef struct ofl_device ofl_device_t;
typedef struct ofl_stream ofl_stream_t;
typedef struct ofl_event ofl_event_t;

typedef enum ofl_backend {
  OFL_BACKEND_AUTO = 0, /* cuda when a device is present, else host */
  OFL_BACKEND_HOST = 1,
  OFL_BACKEND_CUDA = 2
} ofl_backend_t;

typedef enum ofl_copy_kind {
  OFL_COPY_H2D = 0,
  OFL_COPY_D2H = 1,
  OFL_COPY_D2D = 2,
  OFL_COPY_H2H = 3
} ofl_copy_kind_t;

/* Timeout value meaning "use OFL_WAIT_TIMEOUT_MS". Every wait has a timeout. */
#define OFL_TIMEOUT_DEFAULT (-1)

/* Parameters for ofl_device_open. Fields left at their *_INIT value are taken
 * from the OFL_* environment (see ofl_config_print). */
typedef struct ofl_device_params {
  ofl_backend_t backend;        /* OFL_BACKEND */
  int device_index;             /* cuda device ordinal; -1: OFL_DEVICE, else
                                   the calling thread's current device */
  size_t device_capacity_bytes; /* host backend "device" memory; 0: env */
  int strict;                   /* host backend strict mode; -1: env */
  uint64_t jitter_seed;         /* 0: env (OFL_JITTER_SEED) */
  int jitter_max_us;            /* max jitter per op on worker streams; -1: env */
  double link_h2d_gbps;         /* host link model, GB/s; <0: env, 0: off */
  double link_d2h_gbps;         /* host link model, GB/s; <0: env, 0: off */
  double link_total_gbps;       /* both directions together; <0: env, 0: sum */
} ofl_device_params_t;

#define OFL_DEVICE_PARAMS_INIT                                                 \
  { OFL_BACKEND_AUTO, -1, 0, -1, 0, -1, -1.0, -1.0, -1.0 }

/* Counters of one device; bytes are "device" memory unless named pinned. */
typedef struct ofl_device_stats {
  size_t device_bytes_in_use;
  size_t device_bytes_peak;
  size_t device_capacity_bytes; /* 0: unknown / unlimited */
  size_t pinned_bytes_in_use;
  uint64_t device_allocs; /* calls that reached the backend allocator */
  uint64_t device_frees;
  uint64_t pinned_allocs;
  uint64_t pinned_frees;
  uint64_t copies;
  uint64_t copy_bytes[4]; /* by ofl_copy_kind_t */
  uint64_t strict_violations; /* frees of blocks still used by queued ops */
} ofl_device_stats_t;

/* Opens a device. With OFL_BACKEND_AUTO and no GPU it falls back to the host
 * backend and logs why once; with OFL_BACKEND_CUDA and no GPU it fails with
 * OFL_ERR_NO_DEVICE. params may be NULL (all from the environment).
 *
 * cuda: the GPU is params->device_index when set (>= 0), else OFL_DEVICE
 * (an ordinal, or `local` for the launcher's local rank modulo the device
 * count), else the calling thread's current device at open. ofl never leaves
 * a thread's current device changed: a call that needs its device on a
 * thread that sits on another one selects it and restores the caller's. */
OFL_API ofl_status_t ofl_device_open(const ofl_device_params_t *params,
                                     ofl_device_t **out);
/* Waits for all streams (bounded), stops workers, writes the trace file if
 * any, releases everything. NULL is accepted. Pools created on the device
 * must be destroyed first: while any is alive the close is deferred (with a
 * warning) and runs when the last one is destroyed, so a pool never outlives
 * its device's memory. */
OFL_API void ofl_device_close(ofl_device_t *dev);
/* Writes the trace file (OFL_TRACE_FILE) with what the device recorded so
 * far, a complete JSON document; recording goes on and close writes it
 * again in full. For a process that never closes its device (ofl.torch
 * calls it at interpreter exit). A trace path that is not a regular file (a
 * pipe, a terminal) cannot be rewritten: it gets one document, at the first
 * flush or at close, with the events recorded until then. OFL_SUCCESS
 * without a trace; OFL_ERR_IO when the file cannot be written. */
OFL_API ofl_status_t ofl_device_trace_flush(ofl_device_t *dev);

/* Whether a backend can be used on this machine, without opening a device
 * (ofl-info reports it): OFL_SUCCESS with its device count in *count (host:
 * 1; auto: cuda's when it can be used, else host's), or OFL_ERR_NO_DEVICE
 * with the reason in why (not in this build, cuda runtime not found, no
 * driver, driver too old, no device). Loads the CUDA runtime as a cuda
 * open would. why may be NULL; the last error is not changed. */
OFL_API ofl_status_t ofl_backend_probe(ofl_backend_t backend, int *count,
                                       char *why, size_t why_bytes);

OFL_API ofl_backend_t ofl_device_backend(const ofl_device_t *dev);
OFL_API const char *ofl_backend_name(ofl_backend_t backend);
/* The CUDA device ordinal of a cuda device (the GPU it opened, however it
 * was chosen: device_index, OFL_DEVICE, the current device); -1 on the host
 * backend and for NULL. A program launching its own kernels selects it
 * (cudaSetDevice) on the threads that do. */
OFL_API int ofl_device_ordinal(const ofl_device_t *dev);
/* Why auto selection chose what it chose ("" when the backend was explicit). */
OFL_API const char *ofl_device_selection_reason(const ofl_device_t *dev);
OFL_API int ofl_device_is_strict(const ofl_device_t *dev);
/* Host backend: on != 0 makes memory outside ofl's own blocks (the
 * application's malloc'd or framework-allocated memory) count as this
 * device's memory, so that copies may read and write it as device memory
 * and the manager offloads it without a copy into ofl's memory first: a
 * CPU training program's tensors are its device's memory, as a GPU
 * program's are the GPU's (ofl.torch turns it on for CPU tensors). ofl
 * never frees such memory; the application keeps it alive until every
 * copy queued on it completed (a wrap's release callback says when). ofl's
 * pinned blocks stay host memory. cuda: OFL_ERR_NOT_SUPPORTED (the GPU's
 * memory is told apart by the driver). */
OFL_API ofl_status_t ofl_device_adopt_host_memory(ofl_device_t *dev, int on);
OFL_API void ofl_device_get_stats(const ofl_device_t *dev,
                                  ofl_device_stats_t *out);
/* Resets the peak to the bytes now in use. */
OFL_API void ofl_device_reset_peak(ofl_device_t *dev);

/* Device memory (host backend: CPU memory counted against the capacity). */
OFL_API ofl_status_t ofl_device_malloc(ofl_device_t *dev, size_t bytes,
                                       void **out);
/* Frees device memory. In strict mode a block still used by a queued
 * operation is not freed and OFL_ERR_INVALID_USAGE is returned. */
OFL_API ofl_status_t ofl_device_free(ofl_device_t *dev, void *ptr);

/* Page-locked host memory (cuda: malloc + page touch + cudaHostRegister). */
OFL_API ofl_status_t ofl_pinned_malloc(ofl_device_t *dev, size_t bytes,
                                       void **out);
OFL_API ofl_status_t ofl_pinned_free(ofl_device_t *dev, void *ptr);

/* The compute stream is the stream the application computes on: offloads
 * wait for the work queued on it before their copies, and reloads are made
 * visible to it. By default it is the device's compute stream: on cuda the
 * legacy default stream (cudaStreamLegacy), which orders against the
 * application's work on the legacy stream and on blocking streams, but NOT
 * against work on non-blocking streams (PyTorch's side streams, a C++
 * pipeline's own streams). A program computing on its own stream wraps it
 * (ofl_stream_wrap_native) and makes it the compute stream
 * (ofl_device_set_compute_stream, per thread). Work ofl was not told about
 * is not ordered.
 *
 * The compute stream of the calling thread, looked up at each call (never
 * cache it across a change of stream; docs/DESIGN.md section 5 rule 3). Defaults
 * to the device's compute stream; ofl_device_set_compute_stream overrides it
 * for the calling thread (NULL: back to the default). An override whose
 * stream was destroyed or whose device was closed, on any thread, is
 * dropped: the default is returned, never a stale stream. A stream of
 * another device is refused (OFL_ERR_INVALID_ARG as the last error, the
 * override cleared). */
OFL_API ofl_stream_t *ofl_device_compute_stream(ofl_device_t *dev);
OFL_API void ofl_device_set_compute_stream(ofl_device_t *dev,
                                           ofl_stream_t *stream);

/* Streams. A created stream is asynchronous (a worker thread on the host
 * backend, a non-blocking stream on cuda). */
OFL_API ofl_status_t ofl_stream_create(ofl_device_t *dev, const char *name,
                                       ofl_stream_t **out);
/* Drains the stream (bounded by the default timeout) then destroys it. A
 * wrapped native stream is neither drained nor destroyed: only the wrapper
 * is freed. */
OFL_API ofl_status_t ofl_stream_destroy(ofl_stream_t *stream);
/* Wraps the application's own stream (cuda: a cudaStream_t of the device's
 * GPU, any flags) so that ofl orders against it, for example as the compute
 * stream. ofl never destroys it. The host backend answers
 * OFL_ERR_NOT_SUPPORTED. */
OFL_API ofl_status_t ofl_stream_wrap_native(ofl_device_t *dev, void *native,
                                            const char *name,
                                            ofl_stream_t **out);
/* The native handle of any ofl stream (cuda: its cudaStream_t, the default
 * compute stream being cudaStreamLegacy); NULL on the host backend. */
OFL_API void *ofl_stream_native(const ofl_stream_t *stream);
OFL_API ofl_status_t ofl_stream_synchronize(ofl_stream_t *stream,
                                            int64_t timeout_ms);
/* OFL_SUCCESS when idle, OFL_ERR_NOT_READY when work is pending, or the first
 * asynchronous error the stream met. */
OFL_API ofl_status_t ofl_stream_query(ofl_stream_t *stream);
OFL_API const char *ofl_stream_name(const ofl_stream_t *stream);
OFL_API ofl_device_t *ofl_stream_device(const ofl_stream_t *stream);

/* Events: record captures all work enqueued on the stream so far; a wait or
 * a query refers to the last record before it. An event never recorded counts
 * as complete. */
OFL_API ofl_status_t ofl_event_create(ofl_device_t *dev, ofl_event_t **out);
OFL_API void ofl_event_destroy(ofl_event_t *event);
OFL_API ofl_status_t ofl_event_record(ofl_event_t *event,
                                      ofl_stream_t *stream);
/* OFL_SUCCESS when complete, OFL_ERR_NOT_READY otherwise. */
OFL_API ofl_status_t ofl_event_query(ofl_event_t *event);
OFL_API ofl_status_t ofl_event_synchronize(ofl_event_t *event,
                                           int64_t timeout_ms);
/* Later work on stream starts only after the event's last record completes. */
OFL_API ofl_status_t ofl_stream_wait_event(ofl_stream_t *stream,
                                           ofl_event_t *event);

/* Asynchronous copy/memset on a stream. */
OFL_API ofl_status_t ofl_memcpy_async(void *dst, const void *src, size_t bytes,
                                      ofl_copy_kind_t kind,
                                      ofl_stream_t *stream);
OFL_API ofl_status_t ofl_memset_async(void *dst, int value, size_t bytes,
                                      ofl_stream_t *stream);

typedef void (*ofl_host_fn)(void *arg);
/* Runs fn(arg) on the stream's timeline, after the work before it. On cuda fn
 * runs inside cudaLaunchHostFunc, where the driver forbids CUDA calls: fn
 * must not call CUDA or ofl functions, nor take a lock that a thread waiting
 * on the stream may hold. */
OFL_API ofl_status_t ofl_stream_launch_host_func(ofl_stream_t *stream,
                                                 ofl_host_fn fn, void *arg);

/* Named range around bulk work (NVTX on cuda, trace file on host). */
OFL_API void ofl_range_push(ofl_device_t *dev, const char *name);
OFL_API void ofl_range_pop(ofl_device_t *dev);

OFL_EXTERN_C_END

#endif /* OFL_DEVICE_H */
