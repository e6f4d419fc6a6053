/* Disk store faults: injected EIO, ENOSPC and short writes keep the data in
 * host memory; read errors and checksum mismatches are errors, never data;
 * a real full file system (a 1 MiB tmpfs, or RLIMIT_FSIZE where mounting
 * is not allowed). Zero wrong bytes in every case. */
#include <errno.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>

#include "tests/support/disk_test_util.h"

TestSuite(disk_faults, .init = disk_setup, .fini = disk_teardown);

static void write_fault_keeps_data(ofl_disk_engine_t engine,
                                   ofl__disk_fault_t kind,
                                   ofl_status_t expect) {
  ofl_disk_t *d = open_store(engine, 1);
  const size_t n = (4u << 20) + 123; /* five 1 MiB requests */
  ofl_disk_extent_t *ok1 = put(d, 70000, 1);
  cr_assert(eq(int, ofl_disk_extent_wait(ok1, -1), OFL_SUCCESS));
  ofl__disk_inject_fault(d, kind, 2, 1); /* the third request fails */
  ofl_disk_extent_t *e = put(d, n, 2);
  cr_expect(eq(int, ofl_disk_extent_wait(e, -1), expect));
  cr_expect(gt(sz, strlen(ofl_last_error()), 0));
  cr_expect(eq(int, ofl_disk_extent_query(e), expect));
  cr_expect(eq(int, ofl_disk_extent_state(e), OFL_DISK_EXTENT_HOST_ONLY));
  /* the bytes are still in host memory and reload hands them out */
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, n, 2), 0));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(int, s.degraded, 1));
  cr_expect(eq(u64, s.faults_eio, kind == OFL__DISK_FAULT_WRITE_EIO));
  cr_expect(eq(u64, s.faults_enospc, kind == OFL__DISK_FAULT_WRITE_ENOSPC));
  cr_expect(eq(u64, s.faults_short, kind == OFL__DISK_FAULT_WRITE_SHORT));
  cr_expect(eq(u64, s.stalls, 0));
  /* degraded: new extents are refused until cleared */
  ofl_disk_extent_t *x = NULL;
  cr_expect(eq(int, ofl_disk_extent_create(d, 4096, &x), OFL_ERR_NO_SPACE));
  ofl_disk_clear_degraded(d);
  ofl_disk_extent_t *ok2 = put(d, 5000, 3);
  cr_assert(eq(int, ofl_disk_extent_wait(ok2, -1), OFL_SUCCESS));
  /* the extents written before and after still read back */
  cr_assert(eq(int, ofl_disk_extent_reload(ok1, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, 70000, 1), 0));
  cr_assert(eq(int, ofl_disk_extent_reload(ok2, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, 5000, 3), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_extent_destroy(ok1);
  ofl_disk_extent_destroy(ok2);
  ofl_disk_close(d);
}

#if OFL_HAVE_LIBURING
Test(disk_faults, write_eio_keeps_data_in_host_memory_io_uring) {
  write_fault_keeps_data(OFL_DISK_ENGINE_URING, OFL__DISK_FAULT_WRITE_EIO,
                         OFL_ERR_IO);
}
Test(disk_faults, short_write_keeps_data_in_host_memory_io_uring) {
  write_fault_keeps_data(OFL_DISK_ENGINE_URING, OFL__DISK_FAULT_WRITE_SHORT,
                         OFL_ERR_IO);
}
Test(disk_faults, enospc_write_keeps_data_in_host_memory_io_uring) {
  write_fault_keeps_data(OFL_DISK_ENGINE_URING, OFL__DISK_FAULT_WRITE_ENOSPC,
                         OFL_ERR_NO_SPACE);
}
#endif
Test(disk_faults, write_eio_keeps_data_in_host_memory_threads) {
  write_fault_keeps_data(OFL_DISK_ENGINE_THREADS, OFL__DISK_FAULT_WRITE_EIO,
                         OFL_ERR_IO);
}
Test(disk_faults, short_write_keeps_data_in_host_memory_threads) {
  write_fault_keeps_data(OFL_DISK_ENGINE_THREADS, OFL__DISK_FAULT_WRITE_SHORT,
                         OFL_ERR_IO);
}
Test(disk_faults, enospc_write_keeps_data_in_host_memory_threads) {
  write_fault_keeps_data(OFL_DISK_ENGINE_THREADS, OFL__DISK_FAULT_WRITE_ENOSPC,
                         OFL_ERR_NO_SPACE);
}

static void read_fault_is_an_error(ofl_disk_engine_t engine,
                                   ofl__disk_fault_t kind, ofl_status_t expect,
                                   int prefetch) {
  ofl_disk_t *d = open_store(engine, 1);
  const size_t n = (3u << 20) + 77;
  ofl_disk_extent_t *e = put(d, n, 4);
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  ofl__disk_inject_fault(d, kind, 1, 1);
  if (prefetch)
    cr_assert(eq(int, ofl_disk_extent_prefetch(e), OFL_SUCCESS));
  void *p = (void *)&p; /* must stay untouched on failure */
  void *sentinel = p;
  cr_expect(eq(int, ofl_disk_extent_reload(e, -1, &p), expect));
  cr_expect(eq(ptr, p, sentinel));
  cr_expect(gt(sz, strlen(ofl_last_error()), 0));
  cr_expect(eq(int, ofl_disk_extent_state(e), OFL_DISK_EXTENT_ON_DISK));
  cr_expect(eq(ptr, ofl_disk_extent_data(e), NULL));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(u64, s.faults_eio, kind == OFL__DISK_FAULT_READ_EIO));
  cr_expect(eq(u64, s.faults_short, kind == OFL__DISK_FAULT_READ_SHORT));
  cr_expect(eq(u64, s.faults_corrupt, kind == OFL__DISK_FAULT_READ_CORRUPT));
  cr_expect(eq(int, s.degraded, 0)); /* the file still holds good data */
  /* the fault was one request: a retry reads the right bytes */
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_expect(eq(sz, count_wrong(p, n, 4), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
}

#if OFL_HAVE_LIBURING
Test(disk_faults, read_eio_is_returned_not_data_io_uring) {
  read_fault_is_an_error(OFL_DISK_ENGINE_URING, OFL__DISK_FAULT_READ_EIO,
                         OFL_ERR_IO, 1);
}
Test(disk_faults, short_read_is_returned_not_data_io_uring) {
  read_fault_is_an_error(OFL_DISK_ENGINE_URING, OFL__DISK_FAULT_READ_SHORT,
                         OFL_ERR_IO, 0);
}
Test(disk_faults, corrupt_read_fails_the_checksum_io_uring) {
  read_fault_is_an_error(OFL_DISK_ENGINE_URING, OFL__DISK_FAULT_READ_CORRUPT,
                         OFL_ERR_CORRUPT, 1);
}
#endif
Test(disk_faults, read_eio_is_returned_not_data_threads) {
  read_fault_is_an_error(OFL_DISK_ENGINE_THREADS, OFL__DISK_FAULT_READ_EIO,
                         OFL_ERR_IO, 0);
}
Test(disk_faults, corrupt_read_fails_the_checksum_threads) {
  read_fault_is_an_error(OFL_DISK_ENGINE_THREADS, OFL__DISK_FAULT_READ_CORRUPT,
                         OFL_ERR_CORRUPT, 1);
}

/* Flips one byte of the file behind the store's back (aligned I/O, since
 * the descriptor may be O_DIRECT). */
static void corrupt_file(ofl_disk_t *d, uint64_t off) {
  unsigned char *blk = NULL;
  cr_assert(eq(int, posix_memalign((void **)&blk, 4096, 4096), 0));
  uint64_t base = off & ~(uint64_t)4095;
  cr_assert(
      eq(long, (long)pread(ofl__disk_fd(d), blk, 4096, (off_t)base), 4096));
  blk[off - base] ^= 0x01;
  cr_assert(
      eq(long, (long)pwrite(ofl__disk_fd(d), blk, 4096, (off_t)base), 4096));
  free(blk);
}

Test(disk_faults, corrupted_extent_on_disk_is_detected_every_time) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  const size_t n = (2u << 20) + 5;
  ofl_disk_extent_t *e = put(d, n, 6), *f = put(d, 9999, 7);
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_wait(f, -1), OFL_SUCCESS));
  corrupt_file(d, ofl__disk_extent_offset(e) + n - 1); /* last payload byte */
  void *p = NULL;
  for (int i = 0; i < 2; i++) {
    cr_expect(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_ERR_CORRUPT));
    cr_expect(eq(ptr, p, NULL));
  }
  cr_expect(eq(u64, disk_stats(d).faults_corrupt, 2));
  /* the neighbour is intact */
  cr_assert(eq(int, ofl_disk_extent_reload(f, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, 9999, 7), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_extent_destroy(f);
  ofl_disk_close(d);
}

Test(disk_faults, corruption_in_the_padding_is_not_payload) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  ofl_disk_extent_t *e = put(d, 100, 8);
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  corrupt_file(d, ofl__disk_extent_offset(e) + 200);
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, 100, 8), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
}

/* A file system that fills up: a 1 MiB tmpfs, or the file-size limit
 * where mounting is not allowed (then writes fail with EFBIG). */
static char mnt[256];
static int mounted;

static const char *small_fs(void) {
  snprintf(mnt, sizeof mnt, "/tmp/ofl-disk-full-XXXXXX");
  cr_assert(not(eq(ptr, mkdtemp(mnt), NULL)));
  if (mount("tmpfs", mnt, "tmpfs", 0, "size=1m") == 0) {
    mounted = 1;
    return mnt;
  }
  cr_log_warn("mount tmpfs: %s; using RLIMIT_FSIZE 1 MiB instead",
              strerror(errno));
  signal(SIGXFSZ, SIG_IGN);
  struct rlimit rl = {1 << 20, 1 << 20};
  cr_assert(eq(int, setrlimit(RLIMIT_FSIZE, &rl), 0));
  return mnt;
}

static void small_fs_done(void) {
  cr_expect(eq(int, dir_entries(mnt), 0), "files left in %s", mnt);
  if (mounted)
    umount(mnt);
  rmdir(mnt);
}

Test(disk_faults, full_file_system_refuses_at_create_with_preallocation) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.dir = small_fs();
  p.preallocate = 1;
  ofl_disk_t *d = open_with(&p);
  ofl_disk_extent_t *a = put(d, 300000, 1), *b = NULL;
  cr_assert(eq(int, ofl_disk_extent_wait(a, -1), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_create(d, 2 << 20, &b), OFL_ERR_NO_SPACE));
  cr_expect(eq(ptr, b, NULL));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(u64, s.faults_enospc, 1));
  cr_expect(eq(int, s.degraded, 1));
  void *data = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(a, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, 300000, 1), 0));
  ofl_disk_extent_destroy(a);
  ofl_disk_close(d);
  small_fs_done();
}

Test(disk_faults, full_file_system_fails_the_write_without_preallocation) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.dir = small_fs();
  p.preallocate = 0;
  ofl_disk_t *d = open_with(&p);
  const size_t n = (3u << 20) + 1;
  ofl_disk_extent_t *e = put(d, n, 2);
  cr_expect(eq(int, ofl_disk_extent_wait(e, -1), OFL_ERR_NO_SPACE), "%s",
            ofl_last_error());
  cr_expect(eq(int, ofl_disk_extent_state(e), OFL_DISK_EXTENT_HOST_ONLY));
  void *data = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, n, 2), 0));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(ge(u64, s.faults_enospc + s.faults_short, 1));
  cr_expect(eq(int, s.degraded, 1));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
  small_fs_done();
}

Test(disk_faults, one_failed_write_among_many_loses_nothing) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  enum { N = 12 };
  ofl_disk_extent_t *e[N];
  ofl__disk_inject_fault(d, OFL__DISK_FAULT_WRITE_EIO, 7, 1);
  /* all created first: after the fault the store refuses new extents */
  for (int i = 0; i < N; i++) {
    size_t n = (size_t)(i + 1) * 300007;
    cr_assert(eq(int, ofl_disk_extent_create(d, n, &e[i]), OFL_SUCCESS));
    fill(ofl_disk_extent_data(e[i]), n, (uint64_t)(50 + i));
  }
  for (int i = 0; i < N; i++)
    cr_assert(eq(int, ofl_disk_extent_write(e[i]), OFL_SUCCESS));
  int failed = 0;
  for (int i = 0; i < N; i++) {
    ofl_status_t st = ofl_disk_extent_wait(e[i], -1);
    failed += st != OFL_SUCCESS;
    cr_expect(eq(int, ofl_disk_extent_state(e[i]),
                 st == OFL_SUCCESS ? OFL_DISK_EXTENT_ON_DISK
                                   : OFL_DISK_EXTENT_HOST_ONLY));
  }
  cr_expect(eq(int, failed, 1));
  for (int i = N; i-- > 0;) {
    void *p = NULL;
    cr_assert(eq(int, ofl_disk_extent_reload(e[i], -1, &p), OFL_SUCCESS));
    cr_expect(eq(
        sz, count_wrong(p, (size_t)(i + 1) * 300007, (uint64_t)(50 + i)), 0));
    ofl_disk_extent_destroy(e[i]);
  }
  ofl_disk_close(d);
}

/* OFL_DISK_CHECKSUM is on by default: a store opened with every setting
 * left to the environment detects bytes the file system lost or changed
 * after acknowledging the write, and reload returns OFL_ERR_CORRUPT, never
 * the wrong bytes. */
Test(disk_faults, default_store_detects_a_corrupted_extent) {
  unsetenv("OFL_DISK_CHECKSUM");
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, -1);
  ofl_disk_t *d = open_with(&p);
  cr_expect(eq(int, disk_stats(d).checksum, 1));
  const size_t n = 300001;
  ofl_disk_extent_t *e = put(d, n, 21);
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  corrupt_file(d, ofl__disk_extent_offset(e) + n / 2);
  void *p0 = NULL;
  cr_expect(eq(int, ofl_disk_extent_reload(e, -1, &p0), OFL_ERR_CORRUPT));
  cr_expect(eq(ptr, p0, NULL));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "corrupt"), NULL), "%s",
            ofl_last_error());
  cr_expect(eq(u64, disk_stats(d).faults_corrupt, 1));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
  /* the switch stays: OFL_DISK_CHECKSUM=0 turns it off */
  setenv("OFL_DISK_CHECKSUM", "0", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  d = open_with(&p);
  cr_expect(eq(int, disk_stats(d).checksum, 0));
  ofl_disk_close(d);
  unsetenv("OFL_DISK_CHECKSUM");
  ofl_config_reload();
}

/* The O_DIRECT probe at open: a full file system (ENOSPC, EDQUOT) is a
 * space problem naming the directory, not "O_DIRECT refused"; EINVAL is. */
static ofl_status_t open_direct(ofl_disk_direct_t mode, int probe_errno,
                                ofl_disk_t **out) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_THREADS, 1);
  p.direct = mode;
  ofl__disk_probe_errno = probe_errno;
  *out = NULL;
  ofl_status_t st = ofl_disk_open(&p, out);
  ofl__disk_probe_errno = 0;
  return st;
}

typedef struct {
  int warnings;
  char last[1024];
} warn_capture_t;

static void capture_warn(ofl_log_level_t level, unsigned subsys,
                         const char *msg, void *user) {
  (void)subsys;
  warn_capture_t *c = user;
  if (level == OFL_LOG_WARN) {
    c->warnings++;
    snprintf(c->last, sizeof c->last, "%s", msg);
  }
}

Test(disk_faults, direct_on_with_a_full_file_system_says_no_space) {
  int errs[] = {ENOSPC, EDQUOT};
  for (int i = 0; i < 2; i++) {
    ofl_disk_t *d = NULL;
    cr_expect(eq(int, open_direct(OFL_DISK_DIRECT_ON, errs[i], &d),
                 OFL_ERR_NO_SPACE));
    cr_expect(eq(ptr, d, NULL));
    const char *msg = ofl_last_error();
    cr_expect(ne(ptr, strstr(msg, tdir), NULL), "names the directory: %s",
              msg);
    cr_expect(ne(ptr, strstr(msg, "space"), NULL), "%s", msg);
    cr_expect(eq(ptr, strstr(msg, "refuses O_DIRECT"), NULL), "%s", msg);
  }
}

Test(disk_faults, direct_on_refused_by_the_file_system_is_not_supported) {
  ofl_disk_t *d = NULL;
  cr_expect(eq(int, open_direct(OFL_DISK_DIRECT_ON, EINVAL, &d),
               OFL_ERR_NOT_SUPPORTED));
  cr_expect(eq(ptr, d, NULL));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "O_DIRECT"), NULL), "%s",
            ofl_last_error());
}

Test(disk_faults, direct_auto_with_a_full_file_system_warns_and_runs_buffered) {
  warn_capture_t c = {0, ""};
  ofl_log_set_handler(capture_warn, &c);
  ofl_disk_t *d = NULL;
  ofl_status_t st = open_direct(OFL_DISK_DIRECT_AUTO, ENOSPC, &d);
  ofl_log_set_handler(NULL, NULL);
  cr_assert(eq(int, st, OFL_SUCCESS), "%s", ofl_last_error());
  cr_expect(eq(int, disk_stats(d).direct, 0));
  cr_expect(eq(int, c.warnings, 1));
  cr_expect(ne(ptr, strstr(c.last, tdir), NULL), "%s", c.last);
  cr_expect(ne(ptr, strstr(c.last, "no space"), NULL), "%s", c.last);
  ofl_disk_close(d);
  /* EINVAL under auto: quietly buffered, no warning */
  c.warnings = 0;
  ofl_log_set_handler(capture_warn, &c);
  st = open_direct(OFL_DISK_DIRECT_AUTO, EINVAL, &d);
  ofl_log_set_handler(NULL, NULL);
  cr_assert(eq(int, st, OFL_SUCCESS), "%s", ofl_last_error());
  cr_expect(eq(int, disk_stats(d).direct, 0));
  cr_expect(eq(int, c.warnings, 0));
  ofl_disk_close(d);
}
