/* ofl: the disk store's file (docs/DESIGN.md section 4): one private file
 * per store (private_file.h), O_DIRECT when the file system takes it, and
 * the file growing to make space for extents (within the budget). */
#include "disk/disk_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "disk/private_file.h"
#include "runtime/internal.h"

/* A file-size limit (EFBIG) and a quota (EDQUOT) are no space too: same
 * status and same counter (faults_enospc) as ENOSPC. */
static bool is_space_errno(int err) {
  return err == ENOSPC || err == EDQUOT || err == EFBIG;
}

ofl_status_t ofl__disk_status_of_errno(int err) {
  return is_space_errno(err) ? OFL_ERR_NO_SPACE : OFL_ERR_IO;
}

/* An unnamed file: O_TMPFILE, else a named one unlinked at once (a crash
 * between the two leaves the name only for that instant). */
ofl_status_t ofl__disk_file_open(ofl_disk_t *d, const char **how) {
  int unnamed_err = 0;
  int fd = ofl__file_private(d->dir, "ofl-disk-", how, &unnamed_err);
  if (fd < 0)
    return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_DISK,
                      "disk store: cannot create a file in %s (O_TMPFILE: "
                      "%s; mkostemp: %s); set OFL_DISK_DIR to a writable "
                      "directory",
                      d->dir, strerror(unnamed_err), strerror(errno));
  d->fd = fd;
  return OFL_SUCCESS;
}

/* Tests: when nonzero, the O_DIRECT probe write fails with this errno. */
int ofl__disk_probe_errno;

/* O_DIRECT when asked and taken: the flag, then one aligned write, since
 * some file systems accept the flag and refuse the I/O (EINVAL). A probe
 * that fails for want of space says nothing about O_DIRECT: that is a full
 * disk, an error with "on" and a WARN with "auto" (which runs buffered). */
ofl_status_t ofl__disk_file_direct(ofl_disk_t *d, ofl_disk_direct_t mode) {
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
int ofl__disk_file_grow(ofl_disk_t *d, uint64_t off, uint64_t len) {
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
ofl_status_t ofl__disk_file_alloc(ofl_disk_t *d, uint64_t span, uint64_t *out) {
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
  int err = ofl__disk_file_grow(d, s->file_bytes, grow);
  if (is_space_errno(err) && grow > need) {
    grow = need;
    err = ofl__disk_file_grow(d, s->file_bytes, grow);
  }
  if (err != 0) {
    ofl_status_t st = ofl__disk_status_of_errno(err);
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

int ofl__disk_fd(const ofl_disk_t *d) { return d->fd; }
