/* The disk store leaves no file behind: not while it is open (the file has
 * no name), not after a normal close, not after the process is killed. */
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "disk/private_file.h"
#include "tests/support/disk_test_util.h"

static void dir_setup(void) {
  snprintf(tdir, sizeof tdir, "/tmp/ofl-disk-clean-XXXXXX");
  cr_assert(not(eq(ptr, mkdtemp(tdir), NULL)));
}
static void dir_teardown(void) {
  int n = dir_entries(tdir);
  rmdir(tdir);
  cr_expect(eq(int, n, 0), "files left in %s", tdir);
}

TestSuite(disk_cleanup, .init = dir_setup, .fini = dir_teardown);

static void open_device(void) {
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = t_backend();
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}

Test(disk_cleanup, open_store_has_no_name_and_close_leaves_nothing) {
  open_device();
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  ofl_disk_extent_t *e = put(d, 5 << 20, 1);
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(ge(sz, s.file_bytes, 5 << 20)); /* the bytes are in a file... */
  cr_expect(eq(int, dir_entries(tdir), 0)); /* ...that has no name */
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, 5 << 20, 1), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
  cr_expect(eq(int, dir_entries(tdir), 0));
  ofl_device_close(dev);
}

/* The child opens a store in OFL_DISK_DIR (read from the environment),
 * writes, reports, then waits to be killed. */
static void child(int wfd) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = t_backend(); /* the parent opened no device before fork */
  char ok = 'n';
  ofl_device_t *cdev = NULL;
  ofl_disk_t *d = NULL;
  if (ofl_device_open(&dp, &cdev) == OFL_SUCCESS) {
    ofl_disk_params_t p = OFL_DISK_PARAMS_INIT;
    p.dev = cdev;
    p.budget_bytes = 0;
    if (ofl_disk_open(&p, &d) == OFL_SUCCESS &&
        strcmp(ofl_disk_dir(d), tdir) == 0) {
      ok = 'y';
      for (int i = 0; i < 8 && ok == 'y'; i++) {
        ofl_disk_extent_t *e = NULL;
        if (ofl_disk_extent_create(d, 4 << 20, &e) != OFL_SUCCESS ||
            ofl_disk_extent_write(e) != OFL_SUCCESS ||
            ofl_disk_extent_wait(e, -1) != OFL_SUCCESS)
          ok = 'n';
      }
    }
  }
  if (write(wfd, &ok, 1) != 1)
    _exit(2);
  for (;;)
    pause();
}

Test(disk_cleanup, killed_process_leaves_nothing) {
  setenv("OFL_DISK_DIR", tdir, 1);
  int fds[2];
  cr_assert(eq(int, pipe(fds), 0));
  pid_t pid = fork();
  cr_assert(ge(int, pid, 0));
  if (pid == 0) {
    close(fds[0]);
    child(fds[1]);
  }
  close(fds[1]);
  char ok = 0;
  ssize_t n = read(fds[0], &ok, 1);
  close(fds[0]);
  /* killed with writes done and the store open */
  kill(pid, SIGKILL);
  int status = 0;
  cr_assert(eq(int, waitpid(pid, &status, 0), pid));
  cr_expect(eq(long, (long)n, 1));
  cr_expect(eq(chr, ok, 'y'), "the child could not write its store");
  cr_expect(eq(int, WIFSIGNALED(status) ? WTERMSIG(status) : -1, SIGKILL));
  cr_expect(eq(int, dir_entries(tdir), 0));
}

Test(disk_cleanup, fallback_file_is_unlinked_at_once) {
  open_device();
  ofl__no_tmpfile = 1; /* as on a file system without O_TMPFILE */
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  ofl_disk_extent_t *e = put(d, 3 << 20, 4);
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  cr_expect(eq(int, dir_entries(tdir), 0));
  struct stat sb;
  cr_assert(eq(int, fstat(ofl__disk_fd(d), &sb), 0));
  cr_expect(eq(int, (int)(sb.st_mode & 0777), 0600));
  cr_expect(eq(int, (int)sb.st_nlink, 0)); /* no name anywhere */
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, 3 << 20, 4), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
  ofl_device_close(dev);
}
