/* ofl: the files of a safetensors write (staging/safetensors_write.c):
 * the errors of the file system, the temporary files (named ones locked and
 * swept when stale, unnamed O_TMPFILE ones), naming the finished file and
 * syncing its directory. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "disk/private_file.h"
#include "staging/safetensors_file.h"

ofl_status_t ofl__st_io_error(int err, const char *op, const char *path) {
  if (err == ENOSPC || err == EDQUOT)
    return ofl__error(OFL_ERR_NO_SPACE, OFL_SUBSYS_STAGING,
                      "safetensors write: %s '%s': %s; free space on that "
                      "file system or save elsewhere",
                      op, path, strerror(err));
  if (err == EFBIG)
    return ofl__error(OFL_ERR_NO_SPACE, OFL_SUBSYS_STAGING,
                      "safetensors write: %s '%s': %s; the file size limit "
                      "(ulimit -f or the file system's) is too small",
                      op, path, strerror(err));
  return ofl__error(OFL_ERR_IO, OFL_SUBSYS_STAGING,
                    "safetensors write: %s '%s': %s; check the device", op,
                    path, strerror(err));
}

long ofl__st_name_max(const char *dir) {
  long m = pathconf(dir, _PC_NAME_MAX);
  return m > 0 ? m : 255;
}

/* ---- temporary files ------------------------------------------------------
 * Named temporaries are ".BASE.tmp.XXXXXX", BASE cut so that the name fits
 * NAME_MAX. The writer holds an flock on its file from creation to rename:
 * a sweeper that gets the lock knows no live writer owns the file. */

#define TMP_SUFFIX ".tmp."
#define TMP_RANDOM 6

/* Bytes of base kept in a temporary's name in dir. */
static size_t tmp_keep(const char *dir, const char *base) {
  long name_max = ofl__st_name_max(dir);
  size_t keep = strlen(base);
  const size_t extra = 1 + strlen(TMP_SUFFIX) + TMP_RANDOM;
  if (keep + extra > (size_t)name_max)
    keep = (size_t)name_max > extra ? (size_t)name_max - extra : 0;
  return keep;
}

/* The library's load time, close to the process start: a temporary of
 * another checkpoint name is only removed when older than this. */
static time_t loaded_at;
__attribute__((constructor)) static void note_load_time(void) {
  loaded_at = time(NULL);
}

static bool tmp_random_ok(const char *p) {
  for (int i = 0; i < TMP_RANDOM; i++) {
    char c = p[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
          (c >= '0' && c <= '9')))
      return false;
  }
  return p[TMP_RANDOM] == '\0';
}

/* 1: name is a temporary of this save's file (prefix kept bytes of base);
 * 2: of another .safetensors file; 0: not ours. */
static int tmp_kind(const char *name, const char *base, size_t keep) {
  size_t len = strlen(name), sl = strlen(TMP_SUFFIX);
  if (name[0] != '.' || len < 1 + sl + TMP_RANDOM + 1)
    return 0;
  const char *suffix = name + len - TMP_RANDOM - sl;
  if (memcmp(suffix, TMP_SUFFIX, sl) != 0 || !tmp_random_ok(suffix + sl))
    return 0;
  size_t mid = len - 1 - sl - TMP_RANDOM;
  if (mid == keep && memcmp(name + 1, base, keep) == 0)
    return 1;
  const char *ext = ".safetensors";
  size_t el = strlen(ext);
  return mid > el && memcmp(name + 1 + mid - el, ext, el) == 0 ? 2 : 0;
}

/* Removes the temporaries that saves killed before their rename left in
 * dir: ours (same base name), and those of other .safetensors names older
 * than this process. Never a file a live writer holds (its flock), nor
 * someone else's. Best effort. */
void ofl__st_sweep_stale(const char *dir, const char *base) {
  DIR *dd = opendir(dir);
  if (dd == NULL)
    return;
  size_t keep = tmp_keep(dir, base);
  unsigned removed = 0;
  struct dirent *de;
  while ((de = readdir(dd)) != NULL) {
    int kind = tmp_kind(de->d_name, base, keep);
    if (kind == 0)
      continue;
    int fd = openat(dirfd(dd), de->d_name,
                    O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
      continue;
    struct stat a, b;
    if (fstat(fd, &a) == 0 && S_ISREG(a.st_mode) && a.st_uid == geteuid() &&
        (kind == 1 || a.st_mtime < loaded_at) &&
        flock(fd, LOCK_EX | LOCK_NB) == 0 &&
        fstatat(dirfd(dd), de->d_name, &b, AT_SYMLINK_NOFOLLOW) == 0 &&
        a.st_dev == b.st_dev && a.st_ino == b.st_ino &&
        unlinkat(dirfd(dd), de->d_name, 0) == 0)
      removed++;
    close(fd);
  }
  closedir(dd);
  if (removed > 0)
    OFL_INFO(OFL_SUBSYS_STAGING,
             "safetensors write: removed %u stale temporary file(s) of "
             "killed saves in %s",
             removed, dir);
}

static ofl_status_t create_error(int err, const char *dir, const char *path) {
  if (err == ENOSPC || err == EDQUOT)
    return ofl__st_io_error(err, "creating a temporary file for", path);
  return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                    "safetensors write: cannot create a file in directory "
                    "'%s' for '%s': %s; check that the directory exists and "
                    "is writable",
                    dir, path, strerror(err));
}

/* A buffer for a temporary name next to base in dir ("DIR/.BASE" cut to
 * *keep characters, the suffix and TMP_RANDOM characters): *cap bytes;
 * NULL when out of memory. */
static char *tmp_name_buffer(const char *dir, const char *base, size_t *keep,
                             size_t *cap) {
  *keep = tmp_keep(dir, base);
  *cap = strlen(dir) + 1 + 1 + *keep + strlen(TMP_SUFFIX) + TMP_RANDOM + 1;
  return malloc(*cap);
}

/* Creates a named temporary file next to path, locked: its name fits the
 * directory's NAME_MAX whatever the length of the final name. */
ofl_status_t ofl__st_create_temp(const char *dir, const char *base,
                                 const char *path, char **tmp_out,
                                 int *fd_out) {
  size_t keep, cap;
  char *tmp = tmp_name_buffer(dir, base, &keep, &cap);
  if (tmp == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors write: out of host memory");
  for (int attempt = 0; attempt < 16; attempt++) {
    snprintf(tmp, cap, "%s/.%.*s" TMP_SUFFIX "XXXXXX", dir, (int)keep, base);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      free(tmp);
      return create_error(err, dir, path);
    }
    /* A sweeper may have taken the file between mkostemp and flock: keep it
     * only if the name is still this file once it is locked. */
    struct stat a, b;
    if (flock(fd, LOCK_EX) == 0 && fstat(fd, &a) == 0 && stat(tmp, &b) == 0 &&
        a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
      fchmod(fd, 0644); /* mkostemp makes 0600; a checkpoint is to be read */
      *tmp_out = tmp;
      *fd_out = fd;
      return OFL_SUCCESS;
    }
    close(fd);
  }
  free(tmp);
  return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                    "safetensors write: the temporary files made in '%s' for "
                    "'%s' kept disappearing; is another program removing "
                    "files there?",
                    dir, path);
}

/* An unnamed file in dir (O_TMPFILE), locked; -1 with errno when the file
 * system or kernel has none (or ofl__no_tmpfile is set). */
int ofl__st_open_unnamed(const char *dir) {
  int fd = ofl__file_unnamed(dir, O_WRONLY, 0644);
  if (fd < 0)
    return -1;
  fchmod(fd, 0644); /* whatever the umask, as the named path does */
  if (flock(fd, LOCK_EX) != 0) { /* for the temporary name linkat may give */
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

/* Gives the unnamed file fd the name target: AT_EMPTY_PATH (needs
 * CAP_DAC_READ_SEARCH on older kernels), else /proc/self/fd/N. 0 or errno
 * (EEXIST: target exists). */
static int link_unnamed(int fd, const char *target) {
#ifdef AT_EMPTY_PATH
  if (linkat(fd, "", AT_FDCWD, target, AT_EMPTY_PATH) == 0)
    return 0;
  if (errno == EEXIST)
    return EEXIST;
#endif
  char proc[64];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  return linkat(AT_FDCWD, proc, AT_FDCWD, target, AT_SYMLINK_FOLLOW) == 0
             ? 0
             : errno;
}

/* Names the complete unnamed file path. linkat cannot replace a file, so
 * over an existing one the file is linked to a temporary name (locked
 * through fd, like a named temporary) and renamed. OFL_ERR_NOT_SUPPORTED
 * when the file cannot be linked at all (the caller writes again through a
 * named temporary). */
ofl_status_t ofl__st_publish_unnamed(int fd, const char *dir, const char *base,
                                     const char *path) {
  int err = link_unnamed(fd, path);
  if (err == 0)
    return OFL_SUCCESS;
  if (err != EEXIST)
    return ofl__error_quiet(OFL_ERR_NOT_SUPPORTED,
                            "safetensors write: cannot link the unnamed "
                            "file to '%s': %s",
                            path, strerror(err));
  size_t keep, cap;
  char *tmp = tmp_name_buffer(dir, base, &keep, &cap);
  if (tmp == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors write: out of host memory");
  static const char alnum[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  uint64_t x = ofl__now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)fd;
  for (int attempt = 0; attempt < 32 && err == EEXIST; attempt++) {
    char rnd[TMP_RANDOM + 1];
    for (int i = 0; i < TMP_RANDOM; i++) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      rnd[i] = alnum[(x >> 33) % (sizeof alnum - 1)];
    }
    rnd[TMP_RANDOM] = '\0';
    snprintf(tmp, cap, "%s/.%.*s" TMP_SUFFIX "%s", dir, (int)keep, base, rnd);
    err = link_unnamed(fd, tmp);
  }
  ofl_status_t st = OFL_SUCCESS;
  if (err != 0) {
    st = ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                    "safetensors write: cannot link the finished file next "
                    "to '%s': %s; check the directory",
                    path, strerror(err));
  } else if (rename(tmp, path) != 0) {
    st = ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                    "safetensors write: cannot rename the finished file to "
                    "'%s': %s; check that the path is not a directory",
                    path, strerror(errno));
    unlink(tmp);
  }
  free(tmp);
  return st;
}

void ofl__st_sync_dir(const char *dir) {
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)fsync(dfd); /* best effort: some file systems refuse it */
    close(dfd);
  }
}

/* Splits path into directory and base name (both malloc'ed). */
ofl_status_t ofl__st_split_path(const char *path, char **dir, char **base) {
  const char *slash = strrchr(path, '/');
  const char *b = slash ? slash + 1 : path;
  if (*b == '\0')
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors write: path '%s' names a directory; give "
                      "a file name",
                      path);
  *dir = slash == NULL   ? strdup(".")
         : slash == path ? strdup("/")
                         : strndup(path, (size_t)(slash - path));
  *base = strdup(b);
  if (*dir == NULL || *base == NULL) {
    free(*dir);
    free(*base);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors write: out of host memory");
  }
  return OFL_SUCCESS;
}
