/* ofl: the disk store's extents (docs/DESIGN.md section 4): create, write,
 * prefetch, reload, evict and destroy, and the state machine that the
 * engine's completions drive (STAGED -> WRITING -> ON_DISK or RESIDENT or
 * HOST_ONLY; ON_DISK -> READING -> RESIDENT; RESIDENT -> ON_DISK). */
#include "disk/disk_internal.h"

#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"
#include "runtime/queue.h"

/* Lock held: writes queued or in flight whose buffer goes back to the pool
 * (or the keep list, which gives it up on demand) when they complete; a
 * write a reload is serving from keeps its buffer. */
static unsigned writes_returning_buffers(const ofl_disk_t *d) {
  unsigned n = 0;
  for (const ofl_disk_extent_t *e = d->live; e != NULL; e = e->next)
    n += e->op == DISK_OP_WRITE && !e->keep_buffer;
  return n;
}

ofl_status_t ofl_disk_extent_create(ofl_disk_t *d, size_t bytes,
                                    ofl_disk_extent_t **out) {
  if (d == NULL || out == NULL || bytes == 0 || bytes > ((size_t)1 << 46))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_create: a store, 1 to 2^46 bytes and "
                      "out are required (bytes %zu)",
                      bytes);
  size_t span = ofl__disk_round(bytes);
  ofl_disk_extent_t *e = calloc(1, sizeof *e);
  if (e == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_create: out of memory");
  ofl__disk_lock(d);
  ofl_status_t st;
  if (d->degraded)
    st = ofl__error_quiet(OFL_ERR_NO_SPACE,
                          "disk store degraded after a write fault: new "
                          "extents are refused; keep the data in memory, or "
                          "fix the disk and call ofl_disk_clear_degraded");
  else
    st = ofl__disk_file_alloc(d, span, &e->off);
  ofl__disk_unlock(d);
  if (st != OFL_SUCCESS) {
    free(e);
    return st;
  }
  st = ofl__disk_buffer_alloc(d, span, &e->buf);
  if (st != OFL_SUCCESS) {
    ofl__disk_lock(d);
    ofl__disk_space_give(&d->space, e->off, span);
    ofl__disk_unlock(d);
    free(e);
    return st;
  }
  e->disk = d;
  e->bytes = bytes;
  e->span = span;
  e->data = ofl_tensor_data(e->buf);
  e->state = OFL_DISK_EXTENT_STAGED;
  memset((char *)e->data + bytes, 0, span - bytes); /* defined padding */
  ofl__disk_lock(d);
  OFL_DLIST_PUSH_HEAD(d->live, e, prev, next);
  d->st.extents++;
  d->st.extent_bytes += span;
  if (d->st.extent_bytes > d->st.peak_extent_bytes)
    d->st.peak_extent_bytes = d->st.extent_bytes;
  ofl__disk_unlock(d);
  *out = e;
  return OFL_SUCCESS;
}

void *ofl_disk_extent_data(const ofl_disk_extent_t *e) {
  if (e == NULL)
    return NULL;
  ofl__disk_lock(e->disk);
  void *p = e->data;
  ofl__disk_unlock(e->disk);
  return p;
}
size_t ofl_disk_extent_bytes(const ofl_disk_extent_t *e) {
  return e != NULL ? e->bytes : 0;
}
size_t ofl_disk_extent_capacity(const ofl_disk_extent_t *e) {
  return e != NULL ? e->span : 0;
}
ofl_disk_extent_state_t ofl_disk_extent_state(const ofl_disk_extent_t *e) {
  if (e == NULL)
    return OFL_DISK_EXTENT_STAGED;
  ofl__disk_lock(e->disk);
  ofl_disk_extent_state_t s = e->state;
  ofl__disk_unlock(e->disk);
  return s;
}

/* Lock held: queues the requests of e's operation and wakes the engine. */
static void queue_op(ofl_disk_t *d, ofl_disk_extent_t *e) {
  e->carved = 0;
  e->inflight = 0;
  e->err = 0;
  e->short_io = false;
  e->submitted = true;
  ofl__disk_queue_push(d, e);
  d->eng->kick(d);
}

/* Lock held: the checks shared by write and write_after. */
static ofl_status_t begin_write(ofl_disk_extent_t *e, const char *who) {
  if (e->state != OFL_DISK_EXTENT_STAGED)
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_DISK,
                      "%s: extent state %d is not STAGED; write each extent "
                      "once, after filling its buffer",
                      who, (int)e->state);
  e->state = OFL_DISK_EXTENT_WRITING;
  e->op = DISK_OP_WRITE;
  e->submitted = false;
  e->keep_buffer = false;
  e->last = OFL_ERR_NOT_READY;
  e->disk->ops_inflight++;
  return OFL_SUCCESS;
}

/* Queues the write once the buffer holds the data (after the D2H copy for
 * write_after, where this runs as the stream's host function: it stays
 * short, the checksum is taken by the engine when the write completes). */
static void submit_write(ofl_disk_extent_t *e) {
  ofl_disk_t *d = e->disk;
  ofl__disk_lock(d);
  queue_op(d, e);
  ofl__disk_unlock(d);
}

ofl_status_t ofl_disk_extent_write(ofl_disk_extent_t *e) {
  if (e == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_write: extent is NULL");
  ofl__disk_lock(e->disk);
  ofl_status_t st = begin_write(e, "ofl_disk_extent_write");
  ofl__disk_unlock(e->disk);
  if (st == OFL_SUCCESS)
    submit_write(e);
  return st;
}

static void write_host_fn(void *arg) { submit_write(arg); }

ofl_status_t ofl_disk_extent_write_after(ofl_disk_extent_t *e,
                                         ofl_stream_t *stream) {
  if (e == NULL || stream == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_write_after: extent and stream are "
                      "required");
  ofl_disk_t *d = e->disk;
  ofl__disk_lock(d);
  ofl_status_t st = begin_write(e, "ofl_disk_extent_write_after");
  ofl__disk_unlock(d);
  if (st != OFL_SUCCESS)
    return st;
  st = ofl_stream_launch_host_func(stream, write_host_fn, e);
  if (st != OFL_SUCCESS) { /* nothing was queued: back to STAGED */
    ofl__disk_lock(d);
    e->state = OFL_DISK_EXTENT_STAGED;
    e->op = DISK_OP_NONE;
    e->last = OFL_SUCCESS;
    d->ops_inflight--;
    pthread_cond_broadcast(&d->done_cv);
    ofl__disk_unlock(d);
  }
  return st;
}

ofl_status_t ofl_disk_extent_query(const ofl_disk_extent_t *e) {
  if (e == NULL)
    return OFL_ERR_INVALID_ARG;
  ofl__disk_lock(e->disk);
  ofl_status_t st = e->op != DISK_OP_NONE ? OFL_ERR_NOT_READY : e->last;
  ofl__disk_unlock(e->disk);
  return st;
}

static ofl_status_t report_last(const ofl_disk_extent_t *e, ofl_status_t st) {
  if (st == OFL_SUCCESS || st == OFL_ERR_NOT_READY)
    return st;
  /* The engine logged the fault when it happened; this sets the caller's
   * last-error message. */
  return ofl__error_quiet(st,
                          "disk extent of %zu bytes at offset %llu: %s; a "
                          "failed write keeps the data in host memory, a "
                          "failed read returns no data",
                          e->bytes, (unsigned long long)e->off,
                          ofl_status_str(st));
}

ofl_status_t ofl_disk_extent_wait(ofl_disk_extent_t *e, int64_t timeout_ms) {
  if (e == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_wait: extent is NULL");
  ofl_disk_t *d = e->disk;
  uint64_t deadline = ofl__deadline_ns(timeout_ms);
  ofl__disk_lock(d);
  while (e->op != DISK_OP_NONE && ofl__disk_wait_until(d, deadline)) {
  }
  bool busy = e->op != DISK_OP_NONE;
  ofl_status_t st = e->last;
  ofl__disk_unlock(d);
  if (busy)
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_wait: i/o of %zu bytes not done "
                      "after %lld ms; the disk is slow or stuck, raise "
                      "OFL_WAIT_TIMEOUT_MS or check the device",
                      e->bytes, (long long)ofl__timeout_ms(timeout_ms));
  return report_last(e, st);
}

/* Lock not held. Starts a read of an ON_DISK extent into a new buffer. */
static ofl_status_t start_read(ofl_disk_extent_t *e) {
  ofl_disk_t *d = e->disk;
  ofl_tensor_t *t = NULL;
  OFL_CHECK(ofl__disk_buffer_alloc(d, e->span, &t));
  ofl__disk_lock(d);
  e->buf = t;
  e->data = ofl_tensor_data(t);
  e->state = OFL_DISK_EXTENT_READING;
  e->op = DISK_OP_READ;
  e->pending = OFL_SUCCESS;
  e->last = OFL_ERR_NOT_READY;
  d->ops_inflight++;
  queue_op(d, e);
  ofl__disk_unlock(d);
  return OFL_SUCCESS;
}

ofl_status_t ofl_disk_extent_prefetch(ofl_disk_extent_t *e) {
  if (e == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_prefetch: extent is NULL");
  ofl_disk_t *d = e->disk;
  ofl__disk_lock(d);
  ofl_disk_extent_state_t s = e->state;
  if (s == OFL_DISK_EXTENT_WRITING)
    e->keep_buffer = true; /* the bytes are still in host memory */
  else if (s == OFL_DISK_EXTENT_ON_DISK && ofl__disk_keep_take(d, e))
    s = OFL_DISK_EXTENT_RESIDENT; /* a kept buffer: no read */
  ofl__disk_unlock(d);
  if (s != OFL_DISK_EXTENT_ON_DISK)
    return OFL_SUCCESS;
  return start_read(e);
}

ofl_status_t ofl_disk_extent_reload(ofl_disk_extent_t *e, int64_t timeout_ms,
                                    void **data) {
  if (e == NULL || data == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_reload: extent and data are required");
  ofl_disk_t *d = e->disk;
  uint64_t t0 = ofl__now_ns(), deadline = ofl__deadline_ns(timeout_ms);
  bool stalled = false, no_buffer = false;
  ofl_status_t st = OFL_SUCCESS;
  ofl__disk_lock(d);
  for (;;) {
    ofl_disk_extent_state_t s = e->state;
    if (s == OFL_DISK_EXTENT_RESIDENT || s == OFL_DISK_EXTENT_HOST_ONLY)
      break;
    if (s == OFL_DISK_EXTENT_WRITING) {
      /* Both the write and the caller's H2D only read the buffer; keeping
       * it spares a read. */
      e->keep_buffer = true;
      break;
    }
    if (s == OFL_DISK_EXTENT_STAGED) {
      st = ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_reload: extent of %zu bytes was "
                      "never written; call ofl_disk_extent_write first",
                      e->bytes);
      break;
    }
    if (s == OFL_DISK_EXTENT_ON_DISK && e->pending != OFL_SUCCESS) {
      st = e->pending; /* a prefetch failed: report it once */
      e->pending = OFL_SUCCESS;
      break;
    }
    if (s == OFL_DISK_EXTENT_ON_DISK && ofl__disk_keep_take(d, e))
      break;
    stalled = true;
    if (s == OFL_DISK_EXTENT_ON_DISK) {
      uint64_t gen = d->buf_gen;
      ofl__disk_unlock(d);
      st = start_read(e);
      ofl__disk_lock(d);
      if (st == OFL_ERR_NO_MEMORY) {
        /* The budget is held, but writes in flight give their buffers back
         * when they complete: wait for them (bounded) rather than fail a
         * read that would succeed a moment later. */
        if (d->buf_gen != gen) {
          st = OFL_SUCCESS; /* a buffer came back meanwhile: try again */
          continue;
        }
        unsigned writers = writes_returning_buffers(d);
        if (writers == 0) {
          no_buffer = true;
          break;
        }
        if (!ofl__disk_wait_until(d, deadline)) {
          no_buffer = true;
          st = OFL_ERR_TIMEOUT;
          break;
        }
        st = OFL_SUCCESS;
        continue;
      }
      if (st != OFL_SUCCESS)
        break;
      continue;
    }
    /* READING */
    if (!ofl__disk_wait_until(d, deadline) &&
        e->state == OFL_DISK_EXTENT_READING) {
      st = OFL_ERR_TIMEOUT;
      break;
    }
    if (e->state == OFL_DISK_EXTENT_ON_DISK && e->pending != OFL_SUCCESS) {
      st = e->pending;
      e->pending = OFL_SUCCESS;
      break;
    }
  }
  d->st.reloads++;
  if (stalled) {
    d->st.stalls++;
    d->st.stall_ns += ofl__now_ns() - t0;
  } else if (st == OFL_SUCCESS) {
    d->st.prefetch_hits++;
  }
  void *p = e->data;
  size_t kept = d->kept_bytes;
  unsigned writers = writes_returning_buffers(d);
  ofl__disk_unlock(d);
  if (no_buffer && st == OFL_ERR_TIMEOUT)
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DISK,
                      "rank %d ofl_disk_extent_reload: no bounce buffer for "
                      "%zu bytes after %lld ms; %u writes in flight still "
                      "hold theirs (the disk is slow or stuck); raise "
                      "OFL_DISK_BOUNCE_BUDGET or OFL_WAIT_TIMEOUT_MS",
                      d->rank, e->span, (long long)ofl__timeout_ms(timeout_ms),
                      writers);
  if (no_buffer)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                      "rank %d ofl_disk_extent_reload: no bounce buffer for "
                      "%zu bytes and no write in flight that would return "
                      "one (%zu bytes kept); the buffers are held by extents "
                      "in memory: destroy or evict some, or raise "
                      "OFL_DISK_BOUNCE_BUDGET",
                      d->rank, e->span, kept);
  if (st == OFL_ERR_TIMEOUT)
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DISK,
                      "rank %d ofl_disk_extent_reload: read of %zu bytes not "
                      "done after %lld ms; the disk is slow or stuck",
                      d->rank, e->bytes,
                      (long long)ofl__timeout_ms(timeout_ms));
  if (st != OFL_SUCCESS)
    return st == OFL_ERR_INVALID_USAGE || st == OFL_ERR_NO_MEMORY
               ? st
               : report_last(e, st);
  *data = p;
  return OFL_SUCCESS;
}

ofl_status_t ofl_disk_extent_evict(ofl_disk_extent_t *e) {
  if (e == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_evict: extent is NULL");
  ofl_disk_t *d = e->disk;
  ofl__disk_lock(d);
  if (e->state != OFL_DISK_EXTENT_RESIDENT) {
    int s = (int)e->state;
    ofl__disk_unlock(d);
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_evict: extent state %d is not "
                      "RESIDENT; only a buffer with a copy on disk can go",
                      s);
  }
  ofl_tensor_t *t = e->buf;
  e->buf = NULL;
  e->data = NULL;
  e->state = OFL_DISK_EXTENT_ON_DISK;
  ofl__disk_unlock(d);
  ofl_status_t st = ofl_pool_free(d->pool, t);
  ofl__disk_lock(d);
  ofl__disk_buffer_returned(d);
  ofl__disk_unlock(d);
  return st;
}

/* Frees space, buffer and handle (no operation in flight). */
void ofl__disk_extent_release(ofl_disk_t *d, ofl_disk_extent_t *e,
                              ofl_stream_t *after) {
  ofl__disk_lock(d);
  OFL_DLIST_UNLINK(d->live, e, prev, next);
  ofl__disk_space_give(&d->space, e->off, e->span);
  d->st.extents--;
  d->st.extent_bytes -= e->span;
  ofl_tensor_t *t = e->buf;
  if (e->kept != NULL) {
    t = ofl__disk_keep_unlink(d, e); /* an ON_DISK extent has no other buffer */
    d->st.keep_drops++;              /* given back unused */
  }
  ofl__disk_unlock(d);
  if (t != NULL) {
    ofl_status_t st = after != NULL ? ofl_pool_free_after(d->pool, t, after)
                                    : ofl_pool_free(d->pool, t);
    if (st != OFL_SUCCESS && after != NULL)
      ofl_pool_free(d->pool, t); /* could not queue: the caller synced */
    ofl__disk_lock(d);
    ofl__disk_buffer_returned(d);
    ofl__disk_unlock(d);
  }
  free(e);
}

static ofl_status_t destroy(ofl_disk_extent_t *e, ofl_stream_t *after,
                            const char *who) {
  if (e == NULL)
    return OFL_SUCCESS;
  ofl_disk_t *d = e->disk;
  uint64_t deadline = ofl__deadline_ns(OFL_TIMEOUT_DEFAULT);
  ofl__disk_lock(d);
  /* A write that has not started is dropped: nobody will read the bytes
   * (a reload before this served them from the buffer). */
  if (e->op == DISK_OP_WRITE && ofl__disk_queue_cancel(d, e)) {
    e->op = DISK_OP_NONE;
    d->ops_inflight--;
    d->st.writes_skipped++;
    d->st.bytes_skipped += e->bytes;
    pthread_cond_broadcast(&d->done_cv);
  }
  while (e->op != DISK_OP_NONE && ofl__disk_wait_until(d, deadline)) {
  }
  bool busy = e->op != DISK_OP_NONE;
  ofl__disk_unlock(d);
  if (busy)
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DISK,
                      "%s: i/o of %zu bytes still in flight after the "
                      "timeout; the extent is kept, call again later",
                      who, e->bytes);
  ofl__disk_extent_release(d, e, after);
  return OFL_SUCCESS;
}

ofl_status_t ofl_disk_extent_destroy(ofl_disk_extent_t *e) {
  return destroy(e, NULL, "ofl_disk_extent_destroy");
}

ofl_status_t ofl_disk_extent_destroy_after(ofl_disk_extent_t *e,
                                           ofl_stream_t *stream) {
  if (stream == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_destroy_after: stream is NULL");
  return destroy(e, stream, "ofl_disk_extent_destroy_after");
}

/* ---- completion (engine threads) ------------------------------------- */

void ofl__disk_finish(ofl_disk_t *d, ofl_disk_extent_t *e) {
  bool write = e->op == DISK_OP_WRITE;
  ofl_status_t st = OFL_SUCCESS;
  int err = e->err;
  bool shrt = e->short_io;
  if (err != 0)
    st = ofl__disk_status_of_errno(err);
  else if (shrt)
    st = OFL_ERR_IO;
  else if (!write && d->checksum && ofl__crc32c(0, e->data, e->bytes) != e->crc)
    st = OFL_ERR_CORRUPT;
  /* The buffer holds what was written and nobody writes into it while the
   * extent is WRITING: its checksum is that of the bytes on disk. */
  uint32_t crc = write && st == OFL_SUCCESS && d->checksum
                     ? ofl__crc32c(0, e->data, e->bytes)
                     : e->crc;
  size_t bytes = e->bytes;
  unsigned long long off = e->off;
  ofl_tensor_t *drop = NULL;

  ofl__disk_lock(d);
  if (err != 0 && st == OFL_ERR_NO_SPACE) /* ENOSPC, EDQUOT, EFBIG */
    d->st.faults_enospc++;
  else if (err != 0)
    d->st.faults_eio++;
  else if (shrt)
    d->st.faults_short++;
  else if (st == OFL_ERR_CORRUPT)
    d->st.faults_corrupt++;
  if (write) {
    d->st.writes++;
    if (st == OFL_SUCCESS) {
      e->crc = crc;
      d->st.bytes_written += bytes;
      if (e->keep_buffer) {
        e->state = OFL_DISK_EXTENT_RESIDENT;
      } else { /* the bounce buffer is reused only now */
        drop = ofl__disk_keep_add(d, e, e->buf);
        e->buf = NULL;
        e->data = NULL;
        e->state = OFL_DISK_EXTENT_ON_DISK;
      }
    } else {
      e->state = OFL_DISK_EXTENT_HOST_ONLY; /* nothing is lost */
      d->degraded = true;
    }
  } else {
    d->st.reads++;
    if (st == OFL_SUCCESS) {
      d->st.bytes_read += bytes;
      e->state = OFL_DISK_EXTENT_RESIDENT;
    } else { /* never hand out what was read */
      drop = e->buf;
      e->buf = NULL;
      e->data = NULL;
      e->state = OFL_DISK_EXTENT_ON_DISK;
      e->pending = st;
    }
  }
  e->last = st;
  e->op = DISK_OP_NONE;
  e->keep_buffer = false;
  d->ops_inflight--;
  /* The buffer is back in the pool before anyone learns the operation is
   * over (lock order: store, then pool; the pool never calls the store). */
  if (drop != NULL)
    ofl_pool_free(d->pool, drop);
  ofl__disk_buffer_returned(
      d); /* to the pool or the keep list; also broadcasts */
  int rank = d->rank;
  ofl__disk_unlock(d); /* e may be destroyed by a waiter from here on */
  if (st != OFL_SUCCESS)
    OFL_WARN(OFL_SUBSYS_DISK,
             "rank %d disk %s of %zu bytes at offset %llu failed: %s; %s", rank,
             write ? "write" : "read", bytes, off,
             err ? strerror(err)
                 : (shrt ? "short transfer" : "crc32c mismatch"),
             write ? "the data stays in host memory and the store is "
                     "degraded (no new extents)"
                   : "reload returns this error, never the data");
}

uint64_t ofl__disk_extent_offset(const ofl_disk_extent_t *e) { return e->off; }
