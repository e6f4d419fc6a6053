/* ofl: background checkpoint saves. Each save is a thread that joins the
 * set's stage, writes it with the safetensors writer (temporary file, fsync,
 * rename) and completes a future. At most max_inflight_saves run at once per
 * stager. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "runtime/device_internal.h"
#include "staging/staging_internal.h"

struct ofl_save_future {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  atomic_int refs; /* the caller and the save thread */
  bool done;
  ofl_status_t status;
  uint64_t bytes;
  char message[1024];
};

typedef struct {
  ofl_stager_t *stager;
  ofl_staged_t *set;
  ofl_save_future_t *future;
  char *path;
  ofl_safetensors_kv_t *meta;
  size_t n_meta;
} save_job_t;

static void future_unref(ofl_save_future_t *f) {
  if (atomic_fetch_sub(&f->refs, 1) != 1)
    return;
  pthread_cond_destroy(&f->cond);
  pthread_mutex_destroy(&f->lock);
  free(f);
}

static void job_free(save_job_t *job) {
  for (size_t i = 0; i < job->n_meta; i++) {
    free((char *)job->meta[i].key);
    free((char *)job->meta[i].value);
  }
  free(job->meta);
  free(job->path);
  free(job);
}

/* Writes the joined set; the entries point into the staged buffer. */
static ofl_status_t write_set(const save_job_t *job) {
  const ofl_staged_t *set = job->set;
  ofl_safetensors_entry_t *e = malloc((set->n ? set->n : 1) * sizeof *e);
  if (e == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "save: out of host memory for %zu entries", set->n);
  for (size_t i = 0; i < set->n; i++) {
    const ofl__stage_slot_t *sl = &set->slots[i];
    e[i] = (ofl_safetensors_entry_t){.name = set->names[i],
                                     .dtype = sl->dtype,
                                     .ndim = sl->ndim,
                                     .data = ofl_tensor_data(set->tensors[i]),
                                     .bytes = sl->bytes};
    memcpy(e[i].shape, sl->shape, sizeof e[i].shape);
  }
  ofl_status_t st =
      ofl_safetensors_write(job->path, e, set->n, job->meta, job->n_meta);
  free(e);
  return st;
}

static void *save_main(void *arg) {
  save_job_t *job = arg;
  ofl__thread_mark_owned(); /* keeps the device it selects (runtime/) */
  ofl__thread_name("save");
  uint64_t t0 = ofl__now_ns();
  ofl_status_t st = ofl__staged_join(job->set, OFL_TIMEOUT_DEFAULT);
  if (st != OFL_SUCCESS)
    st = ofl__error(st, OFL_SUBSYS_STAGING,
                    "save of '%s' not started, nothing written: %s", job->path,
                    job->set->message[0] ? job->set->message
                                         : "staging did not complete");
  else
    st = write_set(job);
  uint64_t bytes = 0;
  struct stat sb;
  if (st == OFL_SUCCESS && stat(job->path, &sb) == 0)
    bytes = (uint64_t)sb.st_size;

  ofl_stager_t *s = job->stager;
  /* The slot is freed and the future completed under the stager's lock, so
   * both are seen together: a caller whose wait returned may start the next
   * save at once, and a save that got the slot finds this one complete.
   * (Lock order: stager, then future.) */
  ofl_save_future_t *f = job->future;
  pthread_mutex_lock(&s->lock);
  if (st == OFL_SUCCESS)
    s->stats.saves_completed++;
  else
    s->stats.saves_failed++;
  s->inflight--;
  atomic_fetch_sub(&job->set->saves, 1);
  pthread_mutex_lock(&f->lock);
  f->status = st;
  f->bytes = bytes;
  if (st != OFL_SUCCESS)
    snprintf(f->message, sizeof f->message, "%s", ofl_last_error());
  f->done = true;
  pthread_cond_broadcast(&f->cond);
  pthread_mutex_unlock(&f->lock);
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  if (st == OFL_SUCCESS)
    OFL_INFO(OFL_SUBSYS_STAGING, "save done path %s bytes %llu ms %.1f",
             job->path, (unsigned long long)bytes,
             (double)(ofl__now_ns() - t0) / 1e6);

  ofl_staged_release(job->set);
  future_unref(f);
  job_free(job);
  /* Last: ofl_stager_destroy waits for threads to reach zero, so once it
   * returns no save thread touches the set, the stager or the device. The
   * reference is dropped under the lock; only a destroy that timed out
   * leaves the final free to this thread. */
  pthread_mutex_lock(&s->lock);
  s->threads--;
  bool last = atomic_fetch_sub(&s->refs, 1) == 1;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
  if (last)
    ofl__stager_free(s);
  return NULL;
}

/* Copies the metadata, adding "format":"pt" when absent. */
static ofl_status_t copy_meta(save_job_t *job, const ofl_safetensors_kv_t *m,
                              size_t n) {
  bool has_format = false;
  for (size_t i = 0; i < n; i++) {
    if (m[i].key == NULL || m[i].value == NULL)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                        "save: metadata pair %zu has a NULL key or value", i);
    has_format |= strcmp(m[i].key, "format") == 0;
  }
  size_t total = n + (has_format ? 0 : 1);
  job->meta = calloc(total ? total : 1, sizeof *job->meta);
  if (job->meta == NULL)
    goto oom;
  for (size_t i = 0; i < total; i++) {
    const char *k = i < n ? m[i].key : "format";
    const char *v = i < n ? m[i].value : "pt";
    job->meta[i].key = strdup(k);
    job->meta[i].value = strdup(v);
    job->n_meta = i + 1;
    if (job->meta[i].key == NULL || job->meta[i].value == NULL)
      goto oom;
  }
  return OFL_SUCCESS;
oom:
  return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                    "save: out of host memory for the metadata");
}

/* Takes a save slot, waiting or refusing when all are taken. */
static ofl_status_t take_slot(ofl_stager_t *s) {
  struct timespec dl;
  ofl__deadline(OFL_TIMEOUT_DEFAULT, &dl);
  pthread_mutex_lock(&s->lock);
  if (s->inflight >= s->max_inflight) {
    if (s->p.when_busy == OFL_SAVE_WHEN_BUSY_ERROR) {
      int n = s->inflight;
      pthread_mutex_unlock(&s->lock);
      return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_STAGING,
                        "save: %d saves already in flight (max %d per "
                        "stager); wait for a future first, or raise "
                        "max_inflight_saves / use OFL_SAVE_WHEN_BUSY_WAIT",
                        n, s->max_inflight);
    }
    s->stats.save_busy_waits++;
    int rc = 0;
    while (s->inflight >= s->max_inflight && rc != ETIMEDOUT)
      rc = pthread_cond_timedwait(&s->cond, &s->lock, &dl);
    if (s->inflight >= s->max_inflight) {
      pthread_mutex_unlock(&s->lock);
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_STAGING,
                        "save: the running save did not finish within the "
                        "wait timeout (OFL_WAIT_TIMEOUT_MS); check the "
                        "disk");
    }
  }
  s->inflight++;
  pthread_mutex_unlock(&s->lock);
  return OFL_SUCCESS;
}

static void give_slot(ofl_stager_t *s) {
  pthread_mutex_lock(&s->lock);
  s->inflight--;
  pthread_cond_broadcast(&s->cond);
  pthread_mutex_unlock(&s->lock);
}

ofl_status_t ofl_stager_save(ofl_stager_t *s, ofl_staged_t *set,
                             const char *path,
                             const ofl_safetensors_kv_t *metadata,
                             size_t n_metadata, ofl_save_future_t **out) {
  if (s == NULL || set == NULL || path == NULL || path[0] == '\0' ||
      out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_save: stager, set, path and out must be "
                      "given");
  if (set->owner != s)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_save: the set was staged by another stager; "
                      "save it with that one");
  if (n_metadata > 0 && metadata == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_save: metadata is NULL with n_metadata %zu",
                      n_metadata);
  save_job_t *job = calloc(1, sizeof *job);
  ofl_save_future_t *f = calloc(1, sizeof *f);
  if (job == NULL || f == NULL || (job->path = strdup(path)) == NULL) {
    free(f);
    if (job != NULL)
      job_free(job);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "ofl_stager_save: out of host memory");
  }
  ofl_status_t st = copy_meta(job, metadata, n_metadata);
  if (st == OFL_SUCCESS)
    st = take_slot(s);
  if (st != OFL_SUCCESS) {
    free(f);
    job_free(job);
    return st;
  }
  pthread_mutex_init(&f->lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&f->cond, &ca);
  pthread_condattr_destroy(&ca);
  atomic_init(&f->refs, 2);
  f->status = OFL_ERR_NOT_READY;
  job->stager = s;
  job->set = set;
  job->future = f;
  pthread_mutex_lock(&s->lock);
  s->threads++;
  pthread_mutex_unlock(&s->lock);
  ofl__stager_ref(s);
  ofl__staged_ref(set);
  atomic_fetch_add(&set->saves, 1);

  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t tid;
  int rc = pthread_create(&tid, &attr, save_main, job);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    atomic_fetch_sub(&set->saves, 1);
    ofl_staged_release(set);
    pthread_mutex_lock(&s->lock);
    s->threads--;
    pthread_mutex_unlock(&s->lock);
    give_slot(s);
    ofl__stager_unref(s);
    pthread_cond_destroy(&f->cond);
    pthread_mutex_destroy(&f->lock);
    free(f);
    job_free(job);
    return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                      "ofl_stager_save: cannot start the save thread: %s",
                      strerror(rc));
  }
  pthread_mutex_lock(&s->lock);
  s->stats.saves_started++;
  pthread_mutex_unlock(&s->lock);
  *out = f;
  return OFL_SUCCESS;
}

ofl_status_t ofl_save_wait(ofl_save_future_t *f, int64_t timeout_ms) {
  if (f == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_save_wait: future is NULL");
  struct timespec dl;
  ofl__deadline(timeout_ms, &dl);
  pthread_mutex_lock(&f->lock);
  int rc = 0;
  while (!f->done && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&f->cond, &f->lock, &dl);
  bool done = f->done;
  ofl_status_t st = f->status;
  pthread_mutex_unlock(&f->lock);
  if (!done)
    return ofl__error_quiet(OFL_ERR_TIMEOUT,
                            "ofl_save_wait: the save is still running after "
                            "%lld ms",
                            (long long)ofl__timeout_ms(timeout_ms));
  if (st != OFL_SUCCESS)
    return ofl__error_quiet(st, "%s", f->message);
  return OFL_SUCCESS;
}

ofl_status_t ofl_save_query(ofl_save_future_t *f) {
  if (f == NULL)
    return OFL_ERR_INVALID_ARG;
  pthread_mutex_lock(&f->lock);
  ofl_status_t st = f->done ? f->status : OFL_ERR_NOT_READY;
  pthread_mutex_unlock(&f->lock);
  return st;
}

const char *ofl_save_error(const ofl_save_future_t *f) {
  if (f == NULL)
    return "";
  ofl_save_future_t *m = (ofl_save_future_t *)f;
  pthread_mutex_lock(&m->lock);
  const char *msg = m->done ? m->message : "";
  pthread_mutex_unlock(&m->lock);
  return msg;
}

uint64_t ofl_save_bytes(const ofl_save_future_t *f) {
  if (f == NULL)
    return 0;
  ofl_save_future_t *m = (ofl_save_future_t *)f;
  pthread_mutex_lock(&m->lock);
  uint64_t b = m->done ? m->bytes : 0;
  pthread_mutex_unlock(&m->lock);
  return b;
}

void ofl_save_release(ofl_save_future_t *f) {
  if (f != NULL)
    future_unref(f);
}
