/* ofl: private files (private_file.h): O_TMPFILE, else mkostemp + unlink.
 * The one place that decides how an unnamed file is made, with the one test
 * hook that turns O_TMPFILE off. */
#include "disk/private_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int ofl__no_tmpfile;

int ofl__file_unnamed(const char *dir, int access, mode_t mode) {
#ifdef O_TMPFILE
  if (ofl__no_tmpfile) {
    errno = EOPNOTSUPP;
    return -1;
  }
  return open(dir, O_TMPFILE | access | O_CLOEXEC, mode);
#else
  (void)dir;
  (void)access;
  (void)mode;
  errno = EOPNOTSUPP;
  return -1;
#endif
}

int ofl__file_private(const char *dir, const char *prefix, const char **how,
                      int *unnamed_err) {
  int fd = ofl__file_unnamed(dir, O_RDWR, 0600);
  if (fd >= 0) {
    *how = "O_TMPFILE";
    return fd;
  }
  *unnamed_err = errno;
  size_t cap = strlen(dir) + 1 + strlen(prefix) + 6 + 1;
  char *path = malloc(cap);
  if (path == NULL) {
    errno = ENOMEM;
    return -1;
  }
  snprintf(path, cap, "%s/%sXXXXXX", dir, prefix);
  fd = mkostemp(path, O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    free(path);
    errno = err;
    return -1;
  }
  unlink(path);
  free(path);
  fchmod(fd, 0600);
  *how = "unlinked";
  return fd;
}
