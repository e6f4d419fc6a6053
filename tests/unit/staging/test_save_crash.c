/* A checkpoint save killed half-way (SIGKILL while writing; its space was
 * reserved up front) leaves no name behind: with O_TMPFILE nothing at all;
 * on the fallback path (a named, flock'ed temporary) the next save into
 * the directory removes the temporary, but never one whose writer lives.
 * The saves run in forked children, stopped inside write(2) by the
 * writer's test hook and killed there. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "staging/staging_internal.h"

static char dir[256];

static void make_dir(void) {
  snprintf(dir, sizeof dir, "/tmp/ofl-st-crash.XXXXXX");
  cr_assert(not(eq(ptr, mkdtemp(dir), NULL)));
}
static void remove_dir(void) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  (void)!system(cmd);
}

TestSuite(save_crash, .init = make_dir, .fini = remove_dir);

enum { BIG = 64 << 20 }; /* reserved by the killed save */

/* Names in dir starting with prefix (NULL: all); the first one is copied
 * to first. */
static int count_names(const char *prefix, char *first, size_t cap) {
  DIR *dp = opendir(dir);
  cr_assert(not(eq(ptr, dp, NULL)));
  int n = 0;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    if (prefix != NULL && strncmp(e->d_name, prefix, strlen(prefix)) != 0)
      continue;
    if (n++ == 0 && first != NULL)
      snprintf(first, cap, "%s", e->d_name);
  }
  closedir(dp);
  return n;
}

static int notify_fd = -1;

/* The child's write(2): the header goes out, the parent hears of it, and
 * the child stops right there until it is killed. */
static ssize_t write_then_hang(int fd, const void *buf, size_t bytes) {
  ssize_t w = write(fd, buf, bytes < 4096 ? bytes : 4096);
  char c = 'w';
  (void)!write(notify_fd, &c, 1);
  for (;;)
    pause();
  return w;
}

/* Forks a child that saves name (BIG bytes) and hangs inside its first
 * write; returns its pid once it is there. */
static pid_t start_save(const char *name, int no_tmpfile) {
  int p[2];
  cr_assert(eq(int, pipe(p), 0));
  pid_t pid = fork();
  cr_assert(ge(int, pid, 0));
  if (pid == 0) {
    close(p[0]);
    notify_fd = p[1];
    ofl__no_tmpfile = no_tmpfile;
    ofl__safetensors_set_write_hook(write_then_hang);
    void *data = calloc(1, BIG);
    ofl_safetensors_entry_t e = {.name = "w",
                                 .dtype = OFL_DTYPE_U8,
                                 .ndim = 1,
                                 .shape = {BIG},
                                 .data = data,
                                 .bytes = BIG};
    char path[400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    ofl_safetensors_write(path, &e, 1, NULL, 0);
    _exit(3); /* not reached: the hook hangs */
  }
  close(p[1]);
  char c = 0;
  ssize_t r;
  do
    r = read(p[0], &c, 1);
  while (r < 0 && errno == EINTR);
  close(p[0]);
  cr_assert(eq(int, (int)r, 1), "the child reached its first write");
  return pid;
}

static void kill_child(pid_t pid) {
  cr_assert(eq(int, kill(pid, SIGKILL), 0));
  int status = 0;
  cr_assert(eq(int, waitpid(pid, &status, 0), pid));
  cr_assert(eq(int, WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, 1));
}

static void save_small(const char *name) {
  uint32_t v = 7;
  ofl_safetensors_entry_t e = {.name = "v",
                               .dtype = OFL_DTYPE_U32,
                               .ndim = 1,
                               .shape = {1},
                               .data = &v,
                               .bytes = 4};
  char path[400];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  cr_assert(eq(int, ofl_safetensors_write(path, &e, 1, NULL, 0), OFL_SUCCESS),
            "%s", ofl_last_error());
}

/* 1 when dir's file system takes O_TMPFILE (it is skipped otherwise). */
static int have_tmpfile(void) {
  int fd = open(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0)
    return 0;
  close(fd);
  return 1;
}

Test(save_crash, killed_save_leaves_no_name_with_o_tmpfile) {
  if (!have_tmpfile())
    cr_skip_test("no O_TMPFILE on the file system of %s", dir);
  pid_t pid = start_save("ckpt.safetensors", 0);
  /* while it writes, the file has no name */
  cr_expect(eq(int, count_names(NULL, NULL, 0), 0));
  kill_child(pid);
  cr_expect(eq(int, count_names(NULL, NULL, 0), 0), "nothing left in %s", dir);
  /* and a save over an existing file (link, then rename) works */
  save_small("ckpt.safetensors");
  save_small("ckpt.safetensors");
  cr_expect(eq(int, count_names(NULL, NULL, 0), 1));
}

Test(save_crash, fallback_temporary_of_a_killed_save_is_removed_by_the_next) {
  ofl__no_tmpfile = 1; /* as on NFS: the named temporary */
  pid_t pid = start_save("ckpt.safetensors", 1);
  kill_child(pid);
  char tmp[300] = "", full[600];
  cr_assert(eq(int, count_names(".ckpt.safetensors.tmp.", tmp, sizeof tmp), 1));
  snprintf(full, sizeof full, "%s/%s", dir, tmp);
  struct stat sb;
  cr_assert(eq(int, stat(full, &sb), 0));
  cr_expect(ge(sz, (size_t)sb.st_size, (size_t)BIG), "space was reserved");
  /* the next save of that name, by either path, removes it */
  ofl__no_tmpfile = 0;
  save_small("ckpt.safetensors");
  cr_expect(eq(int, count_names(".ckpt.safetensors.tmp.", NULL, 0), 0));
  cr_expect(eq(int, count_names(NULL, NULL, 0), 1));
  /* same with the fallback path doing the next save */
  pid = start_save("ckpt.safetensors", 1);
  kill_child(pid);
  cr_assert(eq(int, count_names(".ckpt.safetensors.tmp.", NULL, 0), 1));
  ofl__no_tmpfile = 1;
  save_small("ckpt.safetensors");
  ofl__no_tmpfile = 0;
  cr_expect(eq(int, count_names(NULL, NULL, 0), 1));
}

Test(save_crash, temporary_of_a_live_writer_is_never_removed) {
  pid_t pid = start_save("ckpt.safetensors", 1); /* holds its flock */
  cr_assert(eq(int, count_names(".ckpt.safetensors.tmp.", NULL, 0), 1));
  save_small("ckpt.safetensors");
  save_small("other.safetensors");
  cr_expect(eq(int, count_names(".ckpt.safetensors.tmp.", NULL, 0), 1),
            "the live writer's file stays");
  kill_child(pid);
  save_small("ckpt.safetensors");
  cr_expect(eq(int, count_names(".ckpt.safetensors.tmp.", NULL, 0), 0));
}

/* A temporary of another checkpoint name goes once it is older than this
 * process (a crash of an earlier run), never a file that is not ours. */
Test(save_crash, stale_temporaries_of_other_checkpoints_are_removed) {
  pid_t pid = start_save("step100.safetensors", 1);
  kill_child(pid);
  char tmp[300] = "", full[600];
  cr_assert(
      eq(int, count_names(".step100.safetensors.tmp.", tmp, sizeof tmp), 1));
  snprintf(full, sizeof full, "%s/%s", dir, tmp);
  /* not ours: other names, or not a temporary's pattern */
  const char *foreign[] = {".notes.txt.tmp.abcdef", ".x.safetensors.tmp.ab",
                           "step.safetensors.tmp.abcdef"};
  for (int i = 0; i < 3; i++) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, foreign[i]);
    FILE *f = fopen(p, "w");
    cr_assert(not(eq(ptr, f, NULL)));
    fclose(f);
  }
  /* younger than this process (the child was forked from it): kept */
  save_small("step200.safetensors");
  cr_expect(eq(int, count_names(".step100.safetensors.tmp.", NULL, 0), 1));
  /* from an earlier run */
  struct timespec old[2] = {{time(NULL) - 3600, 0}, {time(NULL) - 3600, 0}};
  cr_assert(eq(int, utimensat(AT_FDCWD, full, old, 0), 0));
  save_small("step300.safetensors");
  cr_expect(eq(int, count_names(".step100.safetensors.tmp.", NULL, 0), 0));
  cr_expect(eq(int, count_names(NULL, NULL, 0), 2 + 3),
            "step200, step300 and the three foreign files");
}
