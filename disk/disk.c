/* ofl: the disk store (docs/DESIGN.md section 4): one private file per store,
 * space for extents inside it, bounce buffers from a pinned pool, the state
 * of each extent, faults and counters. The I/O itself is in disk_io.c. */
#include "disk/disk_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "runtime/internal.h"

#define DEFAULT_GROW ((uint64_t)64 << 20)

/* ---- small helpers ---------------------------------------------------------
 */

static void lock(const ofl_disk_t *d) {
  pthread_mutex_lock((pthread_mutex_t *)&d->mu);
}
static void unlock(const ofl_disk_t *d) {
  pthread_mutex_unlock((pthread_mutex_t *)&d->mu);
}

/* Lock held. false when the deadline passed. */
static bool wait_until(ofl_disk_t *d, uint64_t deadline_ns) {
  uint64_t now = ofl__now_ns();
  if (now >= deadline_ns)
    return false;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t left = deadline_ns - now;
  uint64_t ns = (uint64_t)ts.tv_nsec + left % 1000000000ull;
  ts.tv_sec += (time_t)(left / 1000000000ull + ns / 1000000000ull);
  ts.tv_nsec = (long)(ns % 1000000000ull);
  pthread_cond_timedwait(&d->done_cv, &d->mu, &ts);
  return true;
}

/* Saturating: a timeout too long for the clock means "wait". */
static uint64_t deadline_of(int64_t timeout_ms) {
  return ofl__deadline_ns(timeout_ms);
}

/* A file-size limit (EFBIG) and a quota (EDQUOT) are no space too: same
 * status and same counter (faults_enospc) as ENOSPC. */
static ofl_status_t status_of_errno(int err) {
  return err == ENOSPC || err == EDQUOT || err == EFBIG ? OFL_ERR_NO_SPACE
                                                        : OFL_ERR_IO;
}

/* Lock held: writes queued or in flight whose buffer goes back to the pool
 * (or the keep list, which gives it up on demand) when they complete; a
 * write a reload is serving from keeps its buffer. */
static unsigned writes_returning_buffers(const ofl_disk_t *d) {
  unsigned n = 0;
  for (const ofl_disk_extent_t *e = d->live; e != NULL; e = e->next)
    n += e->op == DISK_OP_WRITE && !e->keep_buffer;
  return n;
}

/* Lock held: a bounce buffer went back; wake reloads waiting for one. */
static void buffer_returned(ofl_disk_t *d) {
  d->buf_gen++;
  pthread_cond_broadcast(&d->done_cv);
}

/* ---- the file
 * ---------------------------------------------------------------- */

/* An unnamed file: O_TMPFILE, else a named one unlinked at once (a crash
 * between the two leaves the name only for that instant). */
int ofl__disk_no_tmpfile;

static ofl_status_t open_private(ofl_disk_t *d, const char **how) {
  int fd = ofl__disk_no_tmpfile
               ? -1
               : open(d->dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) {
    d->fd = fd;
    *how = "O_TMPFILE";
    return OFL_SUCCESS;
  }
  int e1 = ofl__disk_no_tmpfile ? EOPNOTSUPP : errno;
  char path[4200];
  snprintf(path, sizeof path, "%s/ofl-disk-XXXXXX", d->dir);
  fd = mkostemp(path, O_CLOEXEC);
  if (fd < 0)
    return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_DISK,
                      "disk store: cannot create a file in %s (O_TMPFILE: "
                      "%s; mkostemp: %s); set OFL_DISK_DIR to a writable "
                      "directory",
                      d->dir, strerror(e1), strerror(errno));
  unlink(path);
  fchmod(fd, 0600);
  d->fd = fd;
  *how = "unlinked";
  return OFL_SUCCESS;
}

/* Tests: when nonzero, the O_DIRECT probe write fails with this errno. */
int ofl__disk_probe_errno;

static bool is_space_errno(int err) {
  return err == ENOSPC || err == EDQUOT || err == EFBIG;
}

/* O_DIRECT when asked and taken: the flag, then one aligned write, since
 * some file systems accept the flag and refuse the I/O (EINVAL). A probe
 * that fails for want of space says nothing about O_DIRECT: that is a full
 * disk, an error with "on" and a WARN with "auto" (which runs buffered). */
static ofl_status_t set_direct(ofl_disk_t *d, ofl_disk_direct_t mode) {
  d->direct = false;
  if (mode == OFL_DISK_DIRECT_OFF)
    return OFL_SUCCESS;
  int fl = fcntl(d->fd, F_GETFL);
  int err = 0;
  if (fl < 0 || fcntl(d->fd, F_SETFL, fl | O_DIRECT) != 0) {
    err = errno;
  } else {
    void *probe = NULL;
    if (posix_memalign(&probe, OFL__DISK_ALIGN, OFL__DISK_ALIGN) != 0)
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                        "disk store: cannot allocate 4 KiB");
    memset(probe, 0, OFL__DISK_ALIGN);
    ssize_t n = pwrite(d->fd, probe, OFL__DISK_ALIGN, 0);
    /* A short probe write is the file system running out of room. */
    err = n == (ssize_t)OFL__DISK_ALIGN ? 0 : (n < 0 ? errno : ENOSPC);
    free(probe);
    if (ftruncate(d->fd, 0) != 0 && err == 0)
      err = errno;
    if (err != 0)
      fcntl(d->fd, F_SETFL, fl);
  }
  if (ofl__disk_probe_errno != 0 && fl >= 0) { /* tests: the probe's fate */
    err = ofl__disk_probe_errno;
    fcntl(d->fd, F_SETFL, fl);
  }
  if (err == 0) {
    d->direct = true;
    return OFL_SUCCESS;
  }
  if (is_space_errno(err)) {
    if (mode == OFL_DISK_DIRECT_ON)
      return ofl__error(OFL_ERR_NO_SPACE, OFL_SUBSYS_DISK,
                        "rank %d disk store: no space in %s for a 4 KiB "
                        "write (%s), so O_DIRECT could not be checked; free "
                        "space there or set OFL_DISK_DIR to another "
                        "directory",
                        d->rank, d->dir, strerror(err));
    OFL_WARN(OFL_SUBSYS_DISK,
             "rank %d disk store: no space in %s for a 4 KiB write (%s); "
             "O_DIRECT not checked, running buffered, and writes will fail "
             "(the data stays in memory) until space is freed there",
             d->rank, d->dir, strerror(err));
    return OFL_SUCCESS;
  }
  if (mode == OFL_DISK_DIRECT_ON)
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_DISK,
                      "disk store: the file system of %s refuses O_DIRECT "
                      "(%s); set OFL_DISK_DIRECT=auto or off, or choose "
                      "another OFL_DISK_DIR",
                      d->dir, strerror(err));
  return OFL_SUCCESS;
}

/* Lock held. Makes [off, off + len) of the file usable. */
static int grow_file(ofl_disk_t *d, uint64_t off, uint64_t len) {
  if (d->preallocate) {
    if (fallocate(d->fd, 0, (off_t)off, (off_t)len) == 0)
      return 0;
    if (errno != EOPNOTSUPP && errno != ENOSYS)
      return errno;
    d->preallocate = false; /* file system without fallocate: sparse */
  }
  return ftruncate(d->fd, (off_t)(off + len)) == 0 ? 0 : errno;
}

/* Lock held. Space of span bytes: first fit, else the file grows (by at
 * least d->grow, within the budget). */
static ofl_status_t space_alloc(ofl_disk_t *d, uint64_t span, uint64_t *out) {
  disk_space_t *s = &d->space;
  if (ofl__disk_space_take(s, span, out))
    return OFL_SUCCESS;
  uint64_t need = span - ofl__disk_space_tail_free(s);
  if (d->budget != 0 &&
      (s->file_bytes > d->budget || need > d->budget - s->file_bytes)) {
    d->st.budget_refusals++;
    return ofl__error_quiet(OFL_ERR_NO_SPACE,
                            "disk store: %llu bytes do not fit the budget "
                            "(file %llu of %llu bytes); raise "
                            "OFL_DISK_BUDGET or free extents",
                            (unsigned long long)span,
                            (unsigned long long)s->file_bytes,
                            (unsigned long long)d->budget);
  }
  uint64_t grow = need > d->grow ? need : d->grow;
  if (d->budget != 0 && grow > d->budget - s->file_bytes)
    grow = d->budget - s->file_bytes;
  int err = grow_file(d, s->file_bytes, grow);
  if (is_space_errno(err) && grow > need) {
    grow = need;
    err = grow_file(d, s->file_bytes, grow);
  }
  if (err != 0) {
    ofl_status_t st = status_of_errno(err);
    if (st == OFL_ERR_NO_SPACE)
      d->st.faults_enospc++;
    else
      d->st.faults_eio++;
    d->degraded = true;
    return ofl__error(st, OFL_SUBSYS_DISK,
                      "rank %d disk store: cannot grow the file in %s to "
                      "%llu bytes: %s; the data stays in the tier it came "
                      "from and the store is degraded; free space there or "
                      "set OFL_DISK_DIR elsewhere",
                      d->rank, d->dir,
                      (unsigned long long)(s->file_bytes + grow),
                      strerror(err));
  }
  if (!ofl__disk_space_give(s, s->file_bytes, grow))
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                      "disk store: out of memory for the free-space list");
  s->file_bytes += grow;
  d->st.file_bytes = s->file_bytes;
  if (!ofl__disk_space_take(s, span, out))
    return ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_DISK,
                      "disk store: grown file has no room for %llu bytes",
                      (unsigned long long)span);
  return OFL_SUCCESS;
}

/* ---- configuration ----------------------------------------------------------
 */

/* dir may list several directories (comma separated, one per disk): the
 * store takes entry local_rank % count, so that the ranks of a node spread
 * over the disks. */
static ofl_status_t pick_dir(ofl_disk_t *d, const char *dir, int rank) {
  size_t count = 1;
  for (const char *c = dir; *c != '\0'; c++)
    count += *c == ',';
  size_t want = (size_t)ofl__local_rank(rank) % count;
  const char *start = dir;
  for (size_t i = 0; i < want; i++)
    start = strchr(start, ',') + 1;
  const char *end = strchr(start, ',');
  size_t len = end != NULL ? (size_t)(end - start) : strlen(start);
  if (len == 0)
    return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_DISK,
                      "disk store: entry %zu of the directory list '%.200s' "
                      "is empty; list directories separated by single "
                      "commas (OFL_DISK_DIR)",
                      want, dir);
  if (len >= sizeof d->dir)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "disk store: directory path longer than %zu bytes",
                      sizeof d->dir - 1);
  memcpy(d->dir, start, len);
  d->dir[len] = '\0';
  return OFL_SUCCESS;
}

static ofl_status_t read_config(const ofl_disk_params_t *p, ofl_disk_t *d,
                                ofl_disk_direct_t *direct) {
  const char *dir = p->dir;
  if (dir == NULL || dir[0] == '\0') {
    OFL_CHECK(ofl__config_str("OFL_DISK_DIR", &dir));
    if (dir == NULL || dir[0] == '\0')
      dir = getenv("TMPDIR");
    if (dir == NULL || dir[0] == '\0')
      dir = "/tmp";
  }
  OFL_CHECK(pick_dir(d, dir, p->rank));

  size_t budget = p->budget_bytes;
  if (budget == OFL_DISK_FROM_ENV)
    OFL_CHECK(ofl__config_size("OFL_DISK_BUDGET", &budget));
  d->budget = ofl__disk_round(budget);
  if (budget != 0 && d->budget > budget)
    d->budget -= OFL__DISK_ALIGN; /* round the cap down, not up */
  /* 0 means no cap: a small cap must not round down to it. */
  if (budget != 0 && d->budget == 0)
    return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_DISK,
                      "disk store: budget of %zu bytes holds no extent (the "
                      "unit is 4 KiB); use 0 for no cap or at least 4K "
                      "(OFL_DISK_BUDGET)",
                      budget);

  int64_t qd = p->queue_depth;
  if (qd <= 0)
    OFL_CHECK(ofl__config_int("OFL_DISK_QUEUE_DEPTH", &qd));
  if (qd < 1 || qd > 4096)
    return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_DISK,
                      "disk store: queue depth %lld out of range; use 1 to "
                      "4096 (OFL_DISK_QUEUE_DEPTH)",
                      (long long)qd);
  d->queue_depth = (int)qd;

  size_t block = p->block_bytes;
  if (block == 0 || block == OFL_DISK_FROM_ENV)
    OFL_CHECK(ofl__config_size("OFL_DISK_BLOCK", &block));
  if (block == 0 || block > ((size_t)1 << 30))
    return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_DISK,
                      "disk store: block size %zu out of range; use 4K to "
                      "1G (OFL_DISK_BLOCK)",
                      block);
  d->block_bytes = ofl__disk_round(block);

  int64_t pf = p->prefetch_groups;
  if (pf < 0)
    OFL_CHECK(ofl__config_int("OFL_DISK_PREFETCH", &pf));
  d->prefetch_groups = pf < 0 ? 0 : (pf > 1024 ? 1024 : (int)pf);

  bool ck = p->checksum > 0;
  if (p->checksum < 0)
    OFL_CHECK(ofl__config_bool("OFL_DISK_CHECKSUM", &ck));
  d->checksum = ck;

  int dm = (int)p->direct;
  if (p->direct == OFL_DISK_DIRECT_FROM_ENV)
    OFL_CHECK(ofl__config_enum("OFL_DISK_DIRECT", &dm));
  if (dm < OFL_DISK_DIRECT_AUTO || dm > OFL_DISK_DIRECT_OFF)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "disk store: direct mode %d; use auto, on or off", dm);
  *direct = (ofl_disk_direct_t)dm;

  const char *groups = p->groups;
  if (groups == NULL)
    OFL_CHECK(ofl__config_str("OFL_DISK_GROUPS", &groups));
  d->groups = strdup(groups != NULL ? groups : "");
  if (d->groups == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                      "disk store: out of memory");

  d->grow = p->grow_bytes ? ofl__disk_round(p->grow_bytes) : DEFAULT_GROW;
  d->preallocate = p->preallocate != 0;
  d->rank = p->rank;
  return OFL_SUCCESS;
}

static ofl_status_t start_engine(ofl_disk_t *d, ofl_disk_engine_t want) {
  /* Buffered writes through io_uring are handed to one kernel worker per
   * file on ext4 (0.35 GB/s measured against 5.5 GB/s with pwrite threads),
   * so auto picks the threads for buffered I/O. */
  if (want == OFL_DISK_ENGINE_THREADS ||
      (want == OFL_DISK_ENGINE_AUTO && !d->direct)) {
    d->eng = &ofl__disk_engine_threads;
    return d->eng->start(d);
  }
#if OFL_HAVE_LIBURING
  if (want == OFL_DISK_ENGINE_URING || ofl__disk_uring_usable()) {
    d->eng = &ofl__disk_engine_uring;
    ofl_status_t st = d->eng->start(d);
    if (st == OFL_SUCCESS || want == OFL_DISK_ENGINE_URING)
      return st;
  }
#else
  if (want == OFL_DISK_ENGINE_URING)
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_DISK,
                      "disk store: built without liburing; rebuild with "
                      "-Dliburing=enabled or use the thread engine");
#endif
  d->eng = &ofl__disk_engine_threads;
  return d->eng->start(d);
}

/* ---- open / close
 * ------------------------------------------------------------- */

static void free_store(ofl_disk_t *d) {
  if (d->fd >= 0)
    close(d->fd);
  if (d->own_pool)
    ofl_pool_destroy(d->pool);
  ofl__disk_space_fini(&d->space);
  free(d->reqs);
  free(d->groups);
  pthread_cond_destroy(&d->done_cv);
  pthread_cond_destroy(&d->work_cv);
  pthread_mutex_destroy(&d->mu);
  free(d);
}

ofl_status_t ofl_disk_open(const ofl_disk_params_t *params, ofl_disk_t **out) {
  if (params == NULL || params->dev == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_open: params with a device and out are "
                      "required");
  ofl_disk_t *d = calloc(1, sizeof *d);
  if (d == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                      "ofl_disk_open: out of memory");
  d->fd = -1;
  d->dev = params->dev;
  pthread_mutex_init(&d->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&d->done_cv, &ca);
  pthread_cond_init(&d->work_cv, &ca);
  pthread_condattr_destroy(&ca);
  ofl__disk_space_init(&d->space);

  ofl_status_t st;
  ofl_disk_direct_t direct = OFL_DISK_DIRECT_AUTO;
  const char *how = "";
  OFL_CHECK_GOTO(read_config(params, d, &direct), st, fail);
  d->reqs = calloc((size_t)d->queue_depth, sizeof *d->reqs);
  if (d->reqs == NULL) {
    st = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DISK,
                    "ofl_disk_open: out of memory");
    goto fail;
  }
  OFL_CHECK_GOTO(open_private(d, &how), st, fail);
  OFL_CHECK_GOTO(set_direct(d, direct), st, fail);

  if (params->initial_bytes > 0) {
    uint64_t want = ofl__disk_round(params->initial_bytes);
    if (d->budget != 0 && want > d->budget)
      want = d->budget;
    int err = grow_file(d, 0, want);
    if (err != 0) {
      st = ofl__error(status_of_errno(err), OFL_SUBSYS_DISK,
                      "ofl_disk_open: cannot preallocate %llu bytes in %s: "
                      "%s; lower initial_bytes or free space there",
                      (unsigned long long)want, d->dir, strerror(err));
      goto fail;
    }
    ofl__disk_space_give(&d->space, 0, want);
    d->space.file_bytes = want;
  }

  size_t bounce_cap = 0; /* 0: none known */
  if (params->bounce_pool != NULL) {
    if (ofl_pool_kind(params->bounce_pool) != OFL_POOL_PINNED) {
      st = ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_open: bounce_pool must be a pinned pool");
      goto fail;
    }
    d->pool = params->bounce_pool;
  } else {
    ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
    pp.kind = OFL_POOL_PINNED;
    pp.name = "disk-bounce";
    pp.budget_bytes = params->bounce_budget_bytes;
    if (pp.budget_bytes == OFL_DISK_FROM_ENV)
      OFL_CHECK_GOTO(
          ofl__config_size("OFL_DISK_BOUNCE_BUDGET", &pp.budget_bytes), st,
          fail);
    OFL_CHECK_GOTO(ofl_pool_create(d->dev, &pp, &d->pool), st, fail);
    d->own_pool = true;
    bounce_cap = pp.budget_bytes;
  }
  size_t keep = params->keep_bytes;
  if (keep == OFL_DISK_FROM_ENV) {
    keep = 0; /* an external pool's memory is its owner's to manage */
    if (d->own_pool)
      OFL_CHECK_GOTO(ofl__config_size("OFL_DISK_KEEP", &keep), st, fail);
  }
  d->keep_cap = bounce_cap != 0 && keep > bounce_cap ? bounce_cap : keep;
  OFL_CHECK_GOTO(start_engine(d, params->engine), st, fail);

  d->st.queue_depth = d->queue_depth;
  d->st.file_bytes = d->space.file_bytes;
  d->st.budget_bytes = d->budget;
  d->st.keep_bytes = d->keep_cap;
  OFL_INFO(OFL_SUBSYS_DISK,
           "rank %d disk store dir %s file %s io %s engine %s queue_depth %d "
           "block %zu budget %llu checksum %d keep %zu",
           d->rank, d->dir, how,
           d->direct ? "O_DIRECT" : "buffered (no O_DIRECT here)", d->eng->name,
           d->queue_depth, d->block_bytes, (unsigned long long)d->budget,
           (int)d->checksum, d->keep_cap);
  *out = d;
  return OFL_SUCCESS;
fail:
  free_store(d);
  return st;
}

/* Lock held: waits until no extent operation is in flight. */
static bool drain(ofl_disk_t *d, uint64_t deadline) {
  while (d->ops_inflight > 0)
    if (!wait_until(d, deadline))
      return d->ops_inflight == 0;
  return true;
}

static void extent_release(ofl_disk_t *d, ofl_disk_extent_t *e,
                           ofl_stream_t *after);

void ofl_disk_close(ofl_disk_t *d) {
  if (d == NULL)
    return;
  lock(d);
  bool drained = drain(d, deadline_of(OFL_TIMEOUT_DEFAULT));
  unsigned left = d->ops_inflight;
  unlock(d);
  if (!drained) {
    /* The kernel may still write into the buffers: keep everything. */
    OFL_WARN(OFL_SUBSYS_DISK,
             "rank %d disk store close: %u operations still in flight after "
             "the timeout; the store is leaked rather than freed under them",
             d->rank, left);
    return;
  }
  d->eng->stop(d);
  unsigned n = 0;
  while (d->live != NULL) {
    extent_release(d, d->live, NULL);
    n++;
  }
  if (n > 0)
    OFL_WARN(OFL_SUBSYS_DISK,
             "rank %d disk store close: %u extents were still alive; "
             "destroyed them",
             d->rank, n);
  OFL_INFO(OFL_SUBSYS_DISK,
           "rank %d disk store closed written %llu read %llu reloads %llu "
           "stalls %llu from kept buffers %llu faults %llu",
           d->rank, (unsigned long long)d->st.bytes_written,
           (unsigned long long)d->st.bytes_read,
           (unsigned long long)d->st.reloads, (unsigned long long)d->st.stalls,
           (unsigned long long)d->st.keep_hits,
           (unsigned long long)(d->st.faults_enospc + d->st.faults_eio +
                                d->st.faults_short + d->st.faults_corrupt));
  free_store(d);
}

/* ---- queries on the store ---------------------------------------------------
 */

void ofl_disk_get_stats(const ofl_disk_t *d, ofl_disk_stats_t *out) {
  if (d == NULL || out == NULL)
    return;
  lock(d);
  ofl_disk_stats_t s = d->st;
  s.kept_bytes = d->kept_bytes;
  uint64_t now = ofl__now_ns();
  uint64_t ns[2];
  for (int w = 0; w < 2; w++)
    ns[w] = d->busy_ns[w] + (d->busy_dir[w] > 0 ? now - d->busy_since[w] : 0);
  s.write_gbps = ns[1] ? (double)s.bytes_written / (double)ns[1] : 0.0;
  s.read_gbps = ns[0] ? (double)s.bytes_read / (double)ns[0] : 0.0;
  s.direct = d->direct;
  s.uring = d->eng != &ofl__disk_engine_threads;
  s.checksum = d->checksum;
  s.degraded = d->degraded;
  unlock(d);
  *out = s;
}

int ofl_disk_is_degraded(const ofl_disk_t *d) {
  if (d == NULL)
    return 0;
  lock(d);
  int v = d->degraded;
  unlock(d);
  return v;
}

void ofl_disk_clear_degraded(ofl_disk_t *d) {
  if (d == NULL)
    return;
  lock(d);
  d->degraded = false;
  unlock(d);
  OFL_INFO(OFL_SUBSYS_DISK, "rank %d disk store degraded flag cleared",
           d->rank);
}

int ofl_disk_group_selected(const ofl_disk_t *d, const char *group) {
  if (d == NULL || group == NULL || group[0] == '\0')
    return 0;
  size_t gl = strlen(group);
  const char *p = d->groups;
  while (*p != '\0') {
    while (*p == ',' || *p == ' ')
      p++;
    const char *q = p;
    while (*q != '\0' && *q != ',' && *q != ' ')
      q++;
    size_t n = (size_t)(q - p);
    if ((n == 1 && *p == '*') || (n == gl && memcmp(p, group, n) == 0))
      return 1;
    p = q;
  }
  return 0;
}

int ofl_disk_prefetch_groups(const ofl_disk_t *d) {
  return d != NULL ? d->prefetch_groups : 0;
}

const char *ofl_disk_dir(const ofl_disk_t *d) {
  return d != NULL ? d->dir : "";
}

/* ---- extents
 * ----------------------------------------------------------------- */

/* ---- kept buffers: written extents whose bytes are still in memory ------- */

/* Lock held: takes e off the keep list; returns its buffer. */
static ofl_tensor_t *keep_unlink(ofl_disk_t *d, ofl_disk_extent_t *e) {
  if (e->keep_prev != NULL)
    e->keep_prev->keep_next = e->keep_next;
  else
    d->keep_head = e->keep_next;
  if (e->keep_next != NULL)
    e->keep_next->keep_prev = e->keep_prev;
  else
    d->keep_tail = e->keep_prev;
  e->keep_prev = e->keep_next = NULL;
  d->kept_bytes -= e->span;
  ofl_tensor_t *t = e->kept;
  e->kept = NULL;
  return t;
}

/* Lock held: gives the oldest kept buffer back to the pool; false when
 * none is kept. */
static bool keep_drop_oldest(ofl_disk_t *d) {
  if (d->keep_head == NULL)
    return false;
  ofl_pool_free(d->pool, keep_unlink(d, d->keep_head));
  d->st.keep_drops++;
  return true;
}

/* Lock held: a write of e completed; keeps its buffer when the cap allows
 * (dropping older ones) and returns NULL, else returns the buffer to free. */
static ofl_tensor_t *keep_add(ofl_disk_t *d, ofl_disk_extent_t *e,
                              ofl_tensor_t *t) {
  if (e->span > d->keep_cap)
    return t;
  while (d->kept_bytes + e->span > d->keep_cap)
    keep_drop_oldest(d);
  e->kept = t;
  e->keep_prev = d->keep_tail;
  e->keep_next = NULL;
  if (d->keep_tail != NULL)
    d->keep_tail->keep_next = e;
  else
    d->keep_head = e;
  d->keep_tail = e;
  d->kept_bytes += e->span;
  return NULL;
}

/* Lock held: an ON_DISK extent with a kept buffer becomes RESIDENT without
 * a read; false when it has none. */
static bool keep_take(ofl_disk_t *d, ofl_disk_extent_t *e) {
  if (e->kept == NULL)
    return false;
  e->buf = keep_unlink(d, e);
  e->data = ofl_tensor_data(e->buf);
  e->state = OFL_DISK_EXTENT_RESIDENT;
  d->st.keep_hits++;
  return true;
}

size_t ofl_disk_drop_kept(ofl_disk_t *d) {
  if (d == NULL)
    return 0;
  lock(d);
  size_t bytes = d->kept_bytes;
  while (keep_drop_oldest(d)) {
  }
  buffer_returned(d);
  unlock(d);
  return bytes;
}

/* A bounce buffer; when the pool refuses, kept buffers go back to it,
 * oldest first, until it gives one or none is left. */
static ofl_status_t buffer_alloc(ofl_disk_t *d, size_t span, ofl_tensor_t **t) {
  int64_t shape[1] = {(int64_t)span};
  ofl_status_t st;
  for (;;) {
    st = ofl_pool_alloc_dynamic(d->pool, shape, 1, OFL_DTYPE_U8, NULL, t);
    if (st != OFL_ERR_NO_MEMORY)
      break;
    lock(d);
    bool dropped = keep_drop_oldest(d);
    unlock(d);
    if (!dropped)
      break;
  }
  if (st != OFL_SUCCESS) {
    lock(d);
    d->st.buffer_refusals++;
    unlock(d);
    return st;
  }
  if (((uintptr_t)ofl_tensor_data(*t) & (OFL__DISK_ALIGN - 1)) != 0) {
    ofl_pool_free(d->pool, *t);
    return ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_DISK,
                      "disk store: bounce buffer %p is not 4 KiB aligned; "
                      "the pinned pool must hand out page-aligned blocks",
                      ofl_tensor_data(*t));
  }
  return OFL_SUCCESS;
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
  lock(d);
  ofl_status_t st;
  if (d->degraded)
    st = ofl__error_quiet(OFL_ERR_NO_SPACE,
                          "disk store degraded after a write fault: new "
                          "extents are refused; keep the data in memory, or "
                          "fix the disk and call ofl_disk_clear_degraded");
  else
    st = space_alloc(d, span, &e->off);
  unlock(d);
  if (st != OFL_SUCCESS) {
    free(e);
    return st;
  }
  st = buffer_alloc(d, span, &e->buf);
  if (st != OFL_SUCCESS) {
    lock(d);
    ofl__disk_space_give(&d->space, e->off, span);
    unlock(d);
    free(e);
    return st;
  }
  e->disk = d;
  e->bytes = bytes;
  e->span = span;
  e->data = ofl_tensor_data(e->buf);
  e->state = OFL_DISK_EXTENT_STAGED;
  memset((char *)e->data + bytes, 0, span - bytes); /* defined padding */
  lock(d);
  e->next = d->live;
  if (d->live != NULL)
    d->live->prev = e;
  d->live = e;
  d->st.extents++;
  d->st.extent_bytes += span;
  if (d->st.extent_bytes > d->st.peak_extent_bytes)
    d->st.peak_extent_bytes = d->st.extent_bytes;
  unlock(d);
  *out = e;
  return OFL_SUCCESS;
}

void *ofl_disk_extent_data(const ofl_disk_extent_t *e) {
  if (e == NULL)
    return NULL;
  lock(e->disk);
  void *p = e->data;
  unlock(e->disk);
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
  lock(e->disk);
  ofl_disk_extent_state_t s = e->state;
  unlock(e->disk);
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
  lock(d);
  queue_op(d, e);
  unlock(d);
}

ofl_status_t ofl_disk_extent_write(ofl_disk_extent_t *e) {
  if (e == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_write: extent is NULL");
  lock(e->disk);
  ofl_status_t st = begin_write(e, "ofl_disk_extent_write");
  unlock(e->disk);
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
  lock(d);
  ofl_status_t st = begin_write(e, "ofl_disk_extent_write_after");
  unlock(d);
  if (st != OFL_SUCCESS)
    return st;
  st = ofl_stream_launch_host_func(stream, write_host_fn, e);
  if (st != OFL_SUCCESS) { /* nothing was queued: back to STAGED */
    lock(d);
    e->state = OFL_DISK_EXTENT_STAGED;
    e->op = DISK_OP_NONE;
    e->last = OFL_SUCCESS;
    d->ops_inflight--;
    pthread_cond_broadcast(&d->done_cv);
    unlock(d);
  }
  return st;
}

ofl_status_t ofl_disk_extent_query(const ofl_disk_extent_t *e) {
  if (e == NULL)
    return OFL_ERR_INVALID_ARG;
  lock(e->disk);
  ofl_status_t st = e->op != DISK_OP_NONE ? OFL_ERR_NOT_READY : e->last;
  unlock(e->disk);
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
  uint64_t deadline = deadline_of(timeout_ms);
  lock(d);
  while (e->op != DISK_OP_NONE && wait_until(d, deadline)) {
  }
  bool busy = e->op != DISK_OP_NONE;
  ofl_status_t st = e->last;
  unlock(d);
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
  OFL_CHECK(buffer_alloc(d, e->span, &t));
  lock(d);
  e->buf = t;
  e->data = ofl_tensor_data(t);
  e->state = OFL_DISK_EXTENT_READING;
  e->op = DISK_OP_READ;
  e->pending = OFL_SUCCESS;
  e->last = OFL_ERR_NOT_READY;
  d->ops_inflight++;
  queue_op(d, e);
  unlock(d);
  return OFL_SUCCESS;
}

ofl_status_t ofl_disk_extent_prefetch(ofl_disk_extent_t *e) {
  if (e == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_prefetch: extent is NULL");
  ofl_disk_t *d = e->disk;
  lock(d);
  ofl_disk_extent_state_t s = e->state;
  if (s == OFL_DISK_EXTENT_WRITING)
    e->keep_buffer = true; /* the bytes are still in host memory */
  else if (s == OFL_DISK_EXTENT_ON_DISK && keep_take(d, e))
    s = OFL_DISK_EXTENT_RESIDENT; /* a kept buffer: no read */
  unlock(d);
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
  uint64_t t0 = ofl__now_ns(), deadline = deadline_of(timeout_ms);
  bool stalled = false, no_buffer = false;
  ofl_status_t st = OFL_SUCCESS;
  lock(d);
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
    if (s == OFL_DISK_EXTENT_ON_DISK && keep_take(d, e))
      break;
    stalled = true;
    if (s == OFL_DISK_EXTENT_ON_DISK) {
      uint64_t gen = d->buf_gen;
      unlock(d);
      st = start_read(e);
      lock(d);
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
        if (!wait_until(d, deadline)) {
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
    if (!wait_until(d, deadline) && e->state == OFL_DISK_EXTENT_READING) {
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
  unlock(d);
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
  lock(d);
  if (e->state != OFL_DISK_EXTENT_RESIDENT) {
    int s = (int)e->state;
    unlock(d);
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_DISK,
                      "ofl_disk_extent_evict: extent state %d is not "
                      "RESIDENT; only a buffer with a copy on disk can go",
                      s);
  }
  ofl_tensor_t *t = e->buf;
  e->buf = NULL;
  e->data = NULL;
  e->state = OFL_DISK_EXTENT_ON_DISK;
  unlock(d);
  ofl_status_t st = ofl_pool_free(d->pool, t);
  lock(d);
  buffer_returned(d);
  unlock(d);
  return st;
}

/* Frees space, buffer and handle (no operation in flight). */
static void extent_release(ofl_disk_t *d, ofl_disk_extent_t *e,
                           ofl_stream_t *after) {
  lock(d);
  if (e->prev != NULL)
    e->prev->next = e->next;
  else
    d->live = e->next;
  if (e->next != NULL)
    e->next->prev = e->prev;
  ofl__disk_space_give(&d->space, e->off, e->span);
  d->st.extents--;
  d->st.extent_bytes -= e->span;
  ofl_tensor_t *t = e->buf;
  if (e->kept != NULL) {
    t = keep_unlink(d, e); /* an ON_DISK extent has no other buffer */
    d->st.keep_drops++;    /* given back unused */
  }
  unlock(d);
  if (t != NULL) {
    ofl_status_t st = after != NULL ? ofl_pool_free_after(d->pool, t, after)
                                    : ofl_pool_free(d->pool, t);
    if (st != OFL_SUCCESS && after != NULL)
      ofl_pool_free(d->pool, t); /* could not queue: the caller synced */
    lock(d);
    buffer_returned(d);
    unlock(d);
  }
  free(e);
}

static ofl_status_t destroy(ofl_disk_extent_t *e, ofl_stream_t *after,
                            const char *who) {
  if (e == NULL)
    return OFL_SUCCESS;
  ofl_disk_t *d = e->disk;
  uint64_t deadline = deadline_of(OFL_TIMEOUT_DEFAULT);
  lock(d);
  /* A write that has not started is dropped: nobody will read the bytes
   * (a reload before this served them from the buffer). */
  if (e->op == DISK_OP_WRITE && ofl__disk_queue_cancel(d, e)) {
    e->op = DISK_OP_NONE;
    d->ops_inflight--;
    d->st.writes_skipped++;
    d->st.bytes_skipped += e->bytes;
    pthread_cond_broadcast(&d->done_cv);
  }
  while (e->op != DISK_OP_NONE && wait_until(d, deadline)) {
  }
  bool busy = e->op != DISK_OP_NONE;
  unlock(d);
  if (busy)
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DISK,
                      "%s: i/o of %zu bytes still in flight after the "
                      "timeout; the extent is kept, call again later",
                      who, e->bytes);
  extent_release(d, e, after);
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

/* ---- completion (engine threads)
 * ------------------------------------------------- */

void ofl__disk_finish(ofl_disk_t *d, ofl_disk_extent_t *e) {
  bool write = e->op == DISK_OP_WRITE;
  ofl_status_t st = OFL_SUCCESS;
  int err = e->err;
  bool shrt = e->short_io;
  if (err != 0)
    st = status_of_errno(err);
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

  lock(d);
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
        drop = keep_add(d, e, e->buf);
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
  buffer_returned(d); /* to the pool or the keep list; also broadcasts */
  int rank = d->rank;
  unlock(d); /* e may be destroyed by a waiter from here on */
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

/* ---- test hooks
 * ------------------------------------------------------------------- */

void ofl__disk_pause(ofl_disk_t *d, int paused) {
  lock(d);
  d->paused = paused != 0;
  if (!d->paused)
    d->eng->kick(d);
  unlock(d);
}

void ofl__disk_inject_fault(ofl_disk_t *d, ofl__disk_fault_t kind,
                            unsigned after_n, unsigned count) {
  lock(d);
  d->inj_kind = kind;
  d->inj_after = after_n;
  d->inj_count = count;
  unlock(d);
}

int ofl__disk_fd(const ofl_disk_t *d) { return d->fd; }

uint64_t ofl__disk_extent_offset(const ofl_disk_extent_t *e) { return e->off; }
