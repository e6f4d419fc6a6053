/* ofl: what the device layer offers the other layers of the library (pool,
 * pipeline, disk, staging, collectives) beyond the public API: deferred
 * releases, timed events, capture and ownership queries, test hooks, the
 * backend's link rate. struct ofl_device is opaque here; the backends'
 * interface is runtime/backend.h, private to runtime/. Not installed. */
#ifndef OFL_RUNTIME_DEVICE_INTERNAL_H
#define OFL_RUNTIME_DEVICE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ofl/device.h>
#include <ofl/version.h>

#include "runtime/internal.h"

/* ---- the device's pools --------------------------------------------------
 * Counts a pool created on dev / destroyed; the destroy of the last pool of
 * a device whose close was deferred closes it. */
void ofl__device_pool_created(ofl_device_t *dev);
void ofl__device_pool_destroyed(ofl_device_t *dev);

/* ---- deferred work (runtime/defer.c) --------------------------------------
 * fn(arg) runs once the work queued on stream so far has completed, on an
 * ofl thread of the device (or on the thread that synchronises that stream,
 * whichever comes first), never inside a stream's host function: user
 * callbacks and CUDA calls are allowed in fn (docs/DESIGN.md section 3.1).
 * Steady state allocates nothing: entries and their events are reused. */
ofl_status_t ofl__device_defer(ofl_stream_t *stream, void (*fn)(void *),
                               void *arg);
/* fn(arg) once the work queued on stream so far completed, where fn may run
 * on any thread: it calls no CUDA and no ofl function and takes no lock (a
 * release of storage wrapped with OFL_WRAP_RELEASE_IN_HOST_FN). On the host
 * backend it is an operation of the stream, which a thread waiting on the
 * stream may run as it runs the copies before it (steal), and which runs at
 * once on the calling thread when the stream is idle; elsewhere (cuda,
 * where a host function would hold up the stream) ofl__device_defer. */
ofl_status_t ofl__stream_launch_release(ofl_stream_t *stream, ofl_host_fn fn,
                                        void *arg);

/* ---- timed events ----------------------------------------------------------
 * An event that records when its stream reached it; OFL_ERR_NOT_SUPPORTED
 * where the backend has none (host). */
ofl_status_t ofl__event_create_timed(ofl_device_t *dev, ofl_event_t **out);
/* Time between two completed timed events; OFL_ERR_NOT_READY while either
 * has not completed. */
ofl_status_t ofl__event_elapsed_ns(ofl_event_t *a, ofl_event_t *b,
                                   uint64_t *ns);

/* ---- device queries ------------------------------------------------------ */
/* Whether the stream is being captured into a CUDA graph (false on
 * backends without graphs, and when the query fails). */
bool ofl__stream_capturing(ofl_stream_t *s);
/* Whether [ptr, ptr+bytes) is device memory of dev: inside one of its
 * device blocks (host backend), or device memory of its ordinal by
 * cudaPointerGetAttributes (cuda). The pipeline checks pushes with it. */
bool ofl__device_owns(ofl_device_t *dev, const void *ptr, size_t bytes);
/* Number of operations queued or running that read or write [ptr, ptr+bytes)
 * (host backend; 0 on other backends). Pools use it in strict mode. */
size_t ofl__device_inflight(ofl_device_t *dev, const void *ptr, size_t bytes);
/* Fills [ptr, ptr+bytes) with the strict-mode poison byte (host backend). */
void ofl__device_poison(ofl_device_t *dev, void *ptr, size_t bytes);
#define OFL__POISON_BYTE 0xDB
/* Where the backend's link rates come from. */
typedef enum {
  OFL__LINK_NONE,  /* no rate (a measurement failed): the caller's default */
  OFL__LINK_MODEL, /* the link model configured (OFL_LINK_*_GBPS); a
                      direction without a rate of its own, nor the total,
                      is timed */
  OFL__LINK_TIMED, /* the backend timed its own copies: host memcpy (the host
                      backend's copies without a model), cuda a pinned<->device
                      cudaMemcpyAsync (runtime/cuda_link.c) */
} ofl__link_source_t;
/* The rates of the device's link to host memory as its backend knows them,
 * in bytes/s, and where they come from: the link model (OFL_LINK_*_GBPS, a
 * direction without its own rate taking the total), else the backend's own
 * timing of its copies, made once and kept (the host backend: memcpy, once
 * per process; cuda: once per cuda device). A rate is 0 only with
 * OFL__LINK_NONE or beside a modelled one whose other direction could not be
 * timed. OFL_ERR_INVALID_ARG on a NULL argument; the outputs are set only on
 * success. */
ofl_status_t ofl__device_link_rate(ofl_device_t *dev, double *d2h_bytes_per_s,
                                   double *h2d_bytes_per_s,
                                   ofl__link_source_t *source);

/* ---- threads -------------------------------------------------------------
 * Threads that ofl starts (release, save, disk threads) mark themselves:
 * the cuda backend selects its device on them and leaves it selected, while
 * on the application's threads it restores the caller's device. */
void ofl__thread_mark_owned(void);
bool ofl__thread_is_owned(void);

#if OFL_HAVE_CUDA
/* Selects cuda device `device` on the calling thread when it sits on
 * another, remembering whether leave must give the caller's back (see
 * runtime/cuda_guard.c: never to a device without a primary context, never
 * on ofl's own threads). */
typedef struct {
  int prev;
  bool restore;
  int capture_mode; /* the thread's capture mode, given back by leave */
} ofl__cuda_guard_t;
ofl_status_t ofl__cuda_enter(int device, ofl__cuda_guard_t *g);
void ofl__cuda_leave(const ofl__cuda_guard_t *g);
#endif

/* ---- trace (runtime/trace.c) ---------------------------------------------
 * Chrome trace events, one track per stream; written at device close. */
/* A name as the inside of a JSON string in at most cap-1 bytes: escaped,
 * valid UTF-8 (other bytes become U+FFFD), never cut inside a character. */
void ofl__trace_json_escape(char *dst, size_t cap, const char *src);
/* Copies src into dst (at most cap-1 bytes and a NUL), never cutting a
 * UTF-8 character. */
void ofl__utf8_copy(char *dst, size_t cap, const char *src);
/* A complete event ("X") on a stream's track; args_json may be NULL or a
 * JSON object body such as "\"bytes\":4096". Nothing without a trace. */
void ofl__trace_complete(ofl_device_t *dev, int track, const char *name,
                         const char *cat, uint64_t start_ns, uint64_t end_ns,
                         const char *args_json);
void ofl__trace_name_track(ofl_device_t *dev, int track, const char *name);

/* ---- host backend test hooks (runtime/host_stream.c) ----------------------
 * Tests of the host backend's work stealing: hold keeps a worker stream's
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

#endif /* OFL_RUNTIME_DEVICE_INTERNAL_H */
