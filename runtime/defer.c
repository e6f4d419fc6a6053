/* ofl: work ordered after a stream without a host function. A release that
 * must follow queued copies (external storage whose last handle let go, a
 * reference held by queued work) records a reused event on the stream and
 * is run by the device's ofl thread once that event completed, or by the
 * thread that synchronises the stream, whichever comes first. Host functions
 * may not call CUDA and must not run user code (they can deadlock the
 * driver, or take a lock the training thread holds: docs/DESIGN.md
 * section 3.1), so nothing user-visible runs inside one. */
#include <stdlib.h>
#include <time.h>

#include "runtime/backend.h"
#include "runtime/queue.h"

typedef struct entry {
  ofl_event_t *ev; /* kept with the entry: steady state creates no event */
  uint64_t stream_uid;
  void (*fn)(void *);
  void *arg;
  pthread_t runner; /* while in flight: the thread running fn */
  struct entry *next;
} entry_t;

struct ofl__defer {
  pthread_mutex_t lock;
  pthread_cond_t work_cv; /* work queued, or stop */
  pthread_cond_t done_cv; /* the device thread finished an entry */
  entry_t *head, *tail;   /* pending, oldest first */
  entry_t *free;          /* done entries, reused */
  entry_t *inflight;      /* taken by a runner, fn not yet done */
  size_t failed;          /* entries whose event query failed: leaked */
  pthread_t thread;
  bool started;
  atomic_bool stop;
};

ofl_status_t ofl__defer_init(ofl_device_t *dev) {
  struct ofl__defer *d = calloc(1, sizeof *d);
  if (d == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate the device's release queue");
  pthread_mutex_init(&d->lock, NULL);
  pthread_cond_init(&d->work_cv, NULL);
  pthread_cond_init(&d->done_cv, NULL);
  atomic_init(&d->stop, false);
  dev->defer = d;
  return OFL_SUCCESS;
}

static void unlink_entry(struct ofl__defer *d, entry_t *prev, entry_t *e) {
  OFL_FIFO_REMOVE(d->head, d->tail, prev, e, next);
}

/* The first pending entry whose event completed (of one stream when uid is
 * not 0), unlinked and marked in flight for the calling thread. An entry
 * whose query fails (an event captured into a graph, a device error) can
 * never be known complete: it is dropped and its release leaked, said once,
 * rather than polled for ever. */
static entry_t *take_complete(struct ofl__defer *d, uint64_t uid) {
  entry_t *prev = NULL;
  for (entry_t *e = d->head; e != NULL;) {
    if (uid != 0 && e->stream_uid != uid) {
      prev = e;
      e = e->next;
      continue;
    }
    ofl_status_t q = ofl_event_query(e->ev);
    if (q == OFL_SUCCESS) {
      unlink_entry(d, prev, e);
      e->runner = pthread_self();
      e->next = d->inflight;
      d->inflight = e;
      return e;
    }
    if (q != OFL_ERR_NOT_READY) {
      entry_t *next = e->next;
      unlink_entry(d, prev, e);
      if (d->failed++ == 0)
        OFL_WARN(OFL_SUBSYS_DEVICE,
                 "a release ordered after stream work can never run: its "
                 "event cannot be queried (%s); the memory is leaked",
                 ofl_status_str(q));
      e->fn = NULL;
      e->next = d->free;
      d->free = e;
      e = next;
      continue;
    }
    prev = e;
    e = e->next;
  }
  return NULL;
}

/* Whether another thread runs a release of this stream right now. */
static bool inflight_elsewhere(struct ofl__defer *d, uint64_t uid) {
  for (entry_t *e = d->inflight; e != NULL; e = e->next)
    if (e->stream_uid == uid && !pthread_equal(e->runner, pthread_self()))
      return true;
  return false;
}

static void recycle(struct ofl__defer *d, entry_t *e) {
  for (entry_t **pp = &d->inflight; *pp != NULL; pp = &(*pp)->next)
    if (*pp == e) {
      *pp = e->next;
      break;
    }
  e->fn = NULL;
  e->arg = NULL;
  e->next = d->free;
  d->free = e;
}

/* Runs a taken entry's release outside the lock (d->lock held on entry and
 * on return), then recycles it and wakes the waiters for it. */
static void run_entry(struct ofl__defer *d, entry_t *e) {
  pthread_mutex_unlock(&d->lock);
  e->fn(e->arg);
  pthread_mutex_lock(&d->lock);
  recycle(d, e);
  pthread_cond_broadcast(&d->done_cv);
}

static void *defer_main(void *arg) {
  ofl_device_t *dev = arg;
  struct ofl__defer *d = dev->defer;
  ofl__thread_mark_owned();
  ofl__thread_name("release");
  /* Callbacks here may call cudaFree while the application captures. */
  if (dev->ops->release_thread_init != NULL)
    dev->ops->release_thread_init(dev);
  long pause_ns = 20000;
  pthread_mutex_lock(&d->lock);
  while (!atomic_load(&d->stop)) {
    if (d->head == NULL) {
      pthread_cond_wait(&d->work_cv, &d->lock);
      continue;
    }
    entry_t *e = take_complete(d, 0);
    if (e == NULL) {
      /* Nothing finished yet: poll again soon (quietly: a synchronize
       * with a short timeout would log each timeout). */
      pthread_mutex_unlock(&d->lock);
      struct timespec ts = {0, pause_ns};
      nanosleep(&ts, NULL);
      pause_ns = pause_ns < 1000000 ? pause_ns * 2 : 1000000;
      pthread_mutex_lock(&d->lock);
      continue;
    }
    pause_ns = 20000;
    run_entry(d, e);
  }
  pthread_mutex_unlock(&d->lock);
  return NULL;
}

ofl_status_t ofl__device_defer(ofl_stream_t *stream, void (*fn)(void *),
                               void *arg) {
  ofl_device_t *dev = stream->dev;
  struct ofl__defer *d = dev->defer;
  /* An event recorded into a graph capture can never be queried: the
   * release would never run. */
  if (ofl__stream_capturing(stream))
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_DEVICE,
                      "a release ordered after stream '%s' while that stream "
                      "is captured into a CUDA graph; release before or "
                      "after the capture",
                      stream->name);
  pthread_mutex_lock(&d->lock);
  entry_t *e = d->free;
  if (e != NULL)
    d->free = e->next;
  pthread_mutex_unlock(&d->lock);
  if (e == NULL) {
    e = calloc(1, sizeof *e);
    if (e == NULL)
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                        "cannot allocate a deferred release");
    ofl_status_t st = ofl_event_create(dev, &e->ev);
    if (st != OFL_SUCCESS) {
      free(e);
      return st;
    }
  }
  ofl_status_t st = ofl_event_record(e->ev, stream);
  pthread_mutex_lock(&d->lock);
  if (st == OFL_SUCCESS && !d->started) {
    if (pthread_create(&d->thread, NULL, defer_main, dev) == 0)
      d->started = true;
    else
      st = ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_DEVICE,
                      "cannot start the device's release thread");
  }
  if (st != OFL_SUCCESS) {
    recycle(d, e);
    pthread_mutex_unlock(&d->lock);
    return st;
  }
  e->stream_uid = stream->uid;
  e->fn = fn;
  e->arg = arg;
  OFL_FIFO_PUSH(d->head, d->tail, e, next);
  pthread_cond_signal(&d->work_cv);
  pthread_mutex_unlock(&d->lock);
  return OFL_SUCCESS;
}

void ofl__defer_run_stream(ofl_stream_t *stream) {
  struct ofl__defer *d = stream->dev->defer;
  if (d == NULL)
    return;
  pthread_mutex_lock(&d->lock);
  for (;;) {
    /* Releases of this stream another thread is running finish first (a
     * callback that synchronises its own stream does not wait for itself). */
    while (inflight_elsewhere(d, stream->uid))
      pthread_cond_wait(&d->done_cv, &d->lock);
    entry_t *e = take_complete(d, stream->uid);
    if (e == NULL)
      break;
    run_entry(d, e);
  }
  pthread_mutex_unlock(&d->lock);
}

void ofl__defer_close(ofl_device_t *dev) {
  struct ofl__defer *d = dev->defer;
  if (d == NULL)
    return;
  pthread_mutex_lock(&d->lock);
  atomic_store(&d->stop, true);
  pthread_cond_broadcast(&d->work_cv);
  bool started = d->started;
  pthread_mutex_unlock(&d->lock);
  if (started)
    pthread_join(d->thread, NULL);
  /* The streams are drained: run what completed; what did not (a stream
   * that did not drain) is leaked, since its copies may still run. */
  size_t leaked = 0;
  for (entry_t *e; (e = take_complete(d, 0)) != NULL;) {
    e->fn(e->arg);
    recycle(d, e);
  }
  for (entry_t *e = d->head, *next; e != NULL; e = next) {
    next = e->next;
    leaked++;
    ofl_event_destroy(e->ev); /* legal while pending; fn's arg is leaked */
    free(e);
  }
  if (leaked > 0)
    OFL_WARN(OFL_SUBSYS_DEVICE,
             "device close: %zu release(s) still wait for stream work that "
             "did not complete; their memory is leaked, not freed under "
             "running copies",
             leaked);
  for (entry_t *e = d->free, *next; e != NULL; e = next) {
    next = e->next;
    ofl_event_destroy(e->ev);
    free(e);
  }
  pthread_cond_destroy(&d->done_cv);
  pthread_cond_destroy(&d->work_cv);
  pthread_mutex_destroy(&d->lock);
  free(d);
  dev->defer = NULL;
}
