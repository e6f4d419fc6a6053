/* ofl: the disk store's I/O engines. Both cut each extent operation into
 * requests of at most block_bytes, keep at most queue_depth of them in
 * flight, and hand finished operations to ofl__disk_finish:
 *   - uring: requests are submitted under the store lock by whoever queued
 *     them; one completion thread reaps completions (timed waits, 100 ms, so
 *     it notices a stop) and tops the queue up;
 *   - threads: min(queue_depth, 4) workers doing pread/pwrite. */
#include "disk/disk_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "runtime/device_internal.h"
#include "runtime/internal.h"
#include "runtime/queue.h"

#define IDLE_WAIT_NS (100 * 1000000L)

/* Under valgrind (3.19) io_uring_enter ignores the timed-wait argument and
 * the completion thread blocks for good, holding valgrind's thread lock:
 * the store would hang. The thread engine is used there instead. */
#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define UNDER_VALGRIND() (RUNNING_ON_VALGRIND != 0)
#endif
#endif
#ifndef UNDER_VALGRIND
#define UNDER_VALGRIND() 0
#endif

/* ---- requests (shared by the engines) ------------------------------------ */

static ofl__disk_fault_t pick_fault(ofl_disk_t *d, int write) {
  ofl__disk_fault_t k = d->inj_kind;
  if (k == OFL__DISK_FAULT_NONE || d->inj_count == 0)
    return OFL__DISK_FAULT_NONE;
  bool is_write = k == OFL__DISK_FAULT_WRITE_EIO ||
                  k == OFL__DISK_FAULT_WRITE_ENOSPC ||
                  k == OFL__DISK_FAULT_WRITE_SHORT;
  if (is_write != (write != 0))
    return OFL__DISK_FAULT_NONE;
  if (d->inj_after > 0) {
    d->inj_after--;
    return OFL__DISK_FAULT_NONE;
  }
  d->inj_count--;
  return k;
}

static void busy_begin(ofl_disk_t *d, int w) {
  if (d->busy_dir[w]++ == 0)
    d->busy_since[w] = ofl__now_ns();
}

static void busy_end(ofl_disk_t *d, int w) {
  if (--d->busy_dir[w] == 0)
    d->busy_ns[w] += ofl__now_ns() - d->busy_since[w];
}

static void queue_pop(ofl_disk_t *d, int w) {
  ofl_disk_extent_t *e;
  OFL_FIFO_POP(d->q_head[w], d->q_tail[w], e, next_queued);
}

void ofl__disk_queue_push(ofl_disk_t *d, ofl_disk_extent_t *e) {
  int w = e->op == DISK_OP_WRITE;
  OFL_FIFO_PUSH(d->q_head[w], d->q_tail[w], e, next_queued);
}

bool ofl__disk_queue_cancel(ofl_disk_t *d, ofl_disk_extent_t *e) {
  if (!e->submitted || e->carved != 0)
    return false;
  int w = e->op == DISK_OP_WRITE;
  ofl_disk_extent_t *prev = NULL, *q = d->q_head[w];
  while (q != NULL && q != e) {
    prev = q;
    q = q->next_queued;
  }
  if (q == NULL)
    return false;
  OFL_FIFO_REMOVE(d->q_head[w], d->q_tail[w], prev, e, next_queued);
  return true;
}

disk_req_t *ofl__disk_next_req(ofl_disk_t *d) {
  int w = d->q_head[0] == NULL; /* reads first */
  ofl_disk_extent_t *e = d->q_head[w];
  if (e == NULL || d->reqs_busy >= d->queue_depth || d->paused)
    return NULL;
  disk_req_t *r = NULL;
  for (int i = 0; i < d->queue_depth; i++)
    if (!d->reqs[i].busy) {
      r = &d->reqs[i];
      break;
    }
  if (r == NULL)
    return NULL;
  size_t left = e->span - e->carved;
  r->ext = e;
  r->len = left < d->block_bytes ? left : d->block_bytes;
  r->buf_off = e->carved;
  r->file_off = e->off + e->carved;
  r->write = e->op == DISK_OP_WRITE;
  r->fault = pick_fault(d, r->write);
  r->busy = true;
  e->carved += r->len;
  e->inflight++;
  if (e->carved == e->span)
    queue_pop(d, w);
  d->reqs_busy++;
  if (d->reqs_busy > d->st.queue_depth_max)
    d->st.queue_depth_max = d->reqs_busy;
  busy_begin(d, r->write);
  return r;
}

ofl_disk_extent_t *ofl__disk_complete_req(ofl_disk_t *d, disk_req_t *r,
                                          long res) {
  ofl_disk_extent_t *e = r->ext;
  switch (r->fault) {
  case OFL__DISK_FAULT_WRITE_EIO:
  case OFL__DISK_FAULT_READ_EIO:
    res = -EIO;
    break;
  case OFL__DISK_FAULT_WRITE_ENOSPC:
    res = -ENOSPC;
    break;
  case OFL__DISK_FAULT_WRITE_SHORT:
  case OFL__DISK_FAULT_READ_SHORT:
    res = (long)(r->len / 2);
    break;
  case OFL__DISK_FAULT_READ_CORRUPT:
    if (res > 0) /* what a bit flip on the medium would look like */
      ((unsigned char *)e->data)[r->buf_off] ^= 0x5a;
    break;
  default:
    break;
  }
  if (res < 0) {
    if (e->err == 0)
      e->err = (int)-res;
  } else if ((size_t)res != r->len) {
    e->short_io = true;
  }
  d->st.requests++;
  busy_end(d, r->write);
  r->busy = false;
  r->ext = NULL;
  d->reqs_busy--;
  e->inflight--;
  /* After a fault the rest of the operation is not cut: it failed. Only
   * a queue head can be partly cut. */
  if ((e->err != 0 || e->short_io) && e->carved < e->span) {
    if (d->q_head[r->write] == e)
      queue_pop(d, r->write);
    e->carved = e->span;
  }
  return e->inflight == 0 && e->carved == e->span ? e : NULL;
}

/* ---- pread/pwrite threads -------------------------------------------------
 */

static long do_io(ofl_disk_t *d, disk_req_t *r) {
  char *buf = (char *)r->ext->data + r->buf_off;
  size_t done = 0;
  while (done < r->len) {
    ssize_t n = r->write ? pwrite(d->fd, buf + done, r->len - done,
                                  (off_t)(r->file_off + done))
                         : pread(d->fd, buf + done, r->len - done,
                                 (off_t)(r->file_off + done));
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return -(long)errno;
    }
    if (n == 0)
      break; /* short: reported by the caller */
    done += (size_t)n;
  }
  return (long)done;
}

static bool fault_skips_io(ofl__disk_fault_t f) {
  return f != OFL__DISK_FAULT_NONE && f != OFL__DISK_FAULT_READ_CORRUPT;
}

static void timed_wait(pthread_cond_t *cv, pthread_mutex_t *mu, long ns) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_nsec += ns;
  ts.tv_sec += ts.tv_nsec / 1000000000L;
  ts.tv_nsec %= 1000000000L;
  pthread_cond_timedwait(cv, mu, &ts);
}

static void *worker_main(void *arg) {
  ofl_disk_t *d = arg;
  ofl__thread_mark_owned();
  ofl__thread_name("disk io");
  pthread_mutex_lock(&d->mu);
  for (;;) {
    disk_req_t *r = ofl__disk_next_req(d);
    if (r == NULL) {
      if (d->stop)
        break;
      timed_wait(&d->work_cv, &d->mu, IDLE_WAIT_NS);
      continue;
    }
    pthread_mutex_unlock(&d->mu);
    long res = fault_skips_io(r->fault) ? 0 : do_io(d, r);
    pthread_mutex_lock(&d->mu);
    ofl_disk_extent_t *e = ofl__disk_complete_req(d, r, res);
    if (e != NULL) {
      pthread_mutex_unlock(&d->mu);
      ofl__disk_finish(d, e);
      pthread_mutex_lock(&d->mu);
    }
  }
  pthread_mutex_unlock(&d->mu);
  return NULL;
}

static ofl_status_t threads_start(ofl_disk_t *d) {
  int n = d->queue_depth < 4 ? d->queue_depth : 4;
  d->threads = calloc((size_t)n, sizeof *d->threads);
  if (d->threads == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                      "disk store: cannot allocate %d worker handles", n);
  for (int i = 0; i < n; i++) {
    int rc = pthread_create(&d->threads[i], NULL, worker_main, d);
    if (rc != 0) {
      pthread_mutex_lock(&d->mu);
      d->stop = true;
      pthread_cond_broadcast(&d->work_cv);
      pthread_mutex_unlock(&d->mu);
      for (int k = 0; k < i; k++)
        pthread_join(d->threads[k], NULL);
      free(d->threads);
      d->threads = NULL;
      d->stop = false;
      return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_DISK,
                        "disk store: cannot start an i/o thread: %s; raise "
                        "the thread limit",
                        strerror(rc));
    }
  }
  d->nthreads = n;
  return OFL_SUCCESS;
}

static void threads_kick(ofl_disk_t *d) { pthread_cond_broadcast(&d->work_cv); }

static void join_all(ofl_disk_t *d) {
  pthread_mutex_lock(&d->mu);
  d->stop = true;
  pthread_cond_broadcast(&d->work_cv);
  pthread_mutex_unlock(&d->mu);
  for (int i = 0; i < d->nthreads; i++)
    pthread_join(d->threads[i], NULL);
  free(d->threads);
  d->threads = NULL;
  d->nthreads = 0;
}

const disk_engine_ops_t ofl__disk_engine_threads = {"threads", threads_start,
                                                    threads_kick, join_all};

/* ---- io_uring --------------------------------------------------------------
 */
#if OFL_HAVE_LIBURING

int ofl__disk_uring_usable(void) {
  if (UNDER_VALGRIND())
    return 0;
  struct io_uring ring;
  if (io_uring_queue_init(2, &ring, 0) != 0)
    return 0;
  /* Timed waits without a timeout SQE: the completion thread must never
   * touch the submission queue, which callers fill under the lock. */
  int ok = (ring.features & IORING_FEAT_EXT_ARG) != 0;
  io_uring_queue_exit(&ring);
  return ok;
}

static void uring_kick(ofl_disk_t *d) {
  int n = 0;
  disk_req_t *r;
  /* Ring entries >= queue_depth, so a request that was cut has an entry
   * unless a failed submit left some queued (then wait for the retry). */
  while (io_uring_sq_space_left(&d->ring) > 0 &&
         (r = ofl__disk_next_req(d)) != NULL) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&d->ring);
    char *buf = (char *)r->ext->data + r->buf_off;
    if (fault_skips_io(r->fault))
      io_uring_prep_nop(sqe);
    else if (r->write)
      io_uring_prep_write(sqe, d->fd, buf, (unsigned)r->len, r->file_off);
    else
      io_uring_prep_read(sqe, d->fd, buf, (unsigned)r->len, r->file_off);
    io_uring_sqe_set_data(sqe, r);
    n++;
  }
  if (n > 0) {
    int rc;
    do
      rc = io_uring_submit(&d->ring);
    while (rc == -EINTR);
    if (rc < 0) /* the entries stay queued; the completion loop retries */
      OFL_WARN(OFL_SUBSYS_DISK, "rank %d io_uring submit failed: %s", d->rank,
               strerror(-rc));
  }
}

static void *reaper_main(void *arg) {
  ofl_disk_t *d = arg;
  ofl__thread_mark_owned();
  ofl__thread_name("disk reap");
  ofl_disk_extent_t **done = calloc((size_t)d->queue_depth, sizeof *done);
  for (;;) {
    struct io_uring_cqe *cqe = NULL;
    struct __kernel_timespec ts = {0, IDLE_WAIT_NS};
    int rc = io_uring_wait_cqe_timeout(&d->ring, &cqe, &ts);
    int ndone = 0;
    pthread_mutex_lock(&d->mu);
    if (rc == 0) {
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&d->ring, head, cqe) {
        disk_req_t *r = io_uring_cqe_get_data(cqe);
        seen++;
        if (r == NULL)
          continue;
        long res = fault_skips_io(r->fault) ? 0 : cqe->res;
        /* A short O_DIRECT request is reported short, not continued: it
         * means the file system could not take the bytes (DESIGN 4). */
        ofl_disk_extent_t *e = ofl__disk_complete_req(d, r, res);
        if (e != NULL && done != NULL)
          done[ndone++] = e;
        else if (e != NULL) {
          pthread_mutex_unlock(&d->mu);
          ofl__disk_finish(d, e);
          pthread_mutex_lock(&d->mu);
        }
      }
      io_uring_cq_advance(&d->ring, seen);
    }
    if (io_uring_sq_ready(&d->ring) > 0)
      io_uring_submit(&d->ring);
    uring_kick(d);
    bool quit = d->stop && d->reqs_busy == 0;
    pthread_mutex_unlock(&d->mu);
    for (int i = 0; i < ndone; i++)
      ofl__disk_finish(d, done[i]);
    if (quit)
      break;
  }
  free(done);
  return NULL;
}

static ofl_status_t uring_start(ofl_disk_t *d) {
  if (UNDER_VALGRIND())
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_DISK,
                      "disk store: io_uring's timed waits do not work under "
                      "valgrind (the completion thread would block for "
                      "good); use the thread engine there");
  int rc = io_uring_queue_init((unsigned)d->queue_depth, &d->ring, 0);
  if (rc != 0)
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_DISK,
                      "disk store: io_uring_queue_init(%d) failed: %s; lower "
                      "OFL_DISK_QUEUE_DEPTH or use the thread engine",
                      d->queue_depth, strerror(-rc));
  if ((d->ring.features & IORING_FEAT_EXT_ARG) == 0) {
    io_uring_queue_exit(&d->ring);
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_DISK,
                      "disk store: the kernel's io_uring has no timed waits "
                      "(IORING_FEAT_EXT_ARG, linux 5.11); use the thread "
                      "engine");
  }
  d->threads = calloc(1, sizeof *d->threads);
  if (d->threads == NULL ||
      (rc = pthread_create(&d->threads[0], NULL, reaper_main, d)) != 0) {
    free(d->threads);
    d->threads = NULL;
    io_uring_queue_exit(&d->ring);
    return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_DISK,
                      "disk store: cannot start the io_uring completion "
                      "thread; raise the thread limit");
  }
  d->nthreads = 1;
  d->ring_ok = true;
  return OFL_SUCCESS;
}

static void uring_stop(ofl_disk_t *d) {
  join_all(d);
  if (d->ring_ok)
    io_uring_queue_exit(&d->ring);
  d->ring_ok = false;
}

const disk_engine_ops_t ofl__disk_engine_uring = {"io_uring", uring_start,
                                                  uring_kick, uring_stop};
#endif /* OFL_HAVE_LIBURING */
