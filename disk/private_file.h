/* ofl: a private file in a directory: unnamed (O_TMPFILE), else named by
 * mkostemp and unlinked at once. The disk store keeps its data in one; the
 * safetensors writer (staging/) writes into an unnamed one that it names
 * when complete. No dependency beyond libc, so that staging/ can use it
 * without using the disk store. Not installed. */
#ifndef OFL_DISK_PRIVATE_FILE_H
#define OFL_DISK_PRIVATE_FILE_H

#include <sys/types.h>

/* Tests: when set, ofl__file_unnamed fails with EOPNOTSUPP, as on a file
 * system without O_TMPFILE (NFS), so that callers take their fallback: the
 * disk store a named file unlinked right after it is created, the
 * safetensors writer a named, locked temporary renamed into place. */
extern int ofl__no_tmpfile;

/* An unnamed file in dir, opened with access (O_RDWR or O_WRONLY) and
 * O_CLOEXEC, created with mode (less the umask). The fd, or -1 with errno
 * (EOPNOTSUPP when the file system, the kernel or ofl__no_tmpfile says no). */
int ofl__file_unnamed(const char *dir, int access, mode_t mode);

/* A file nobody else can open: unnamed, else made by mkostemp as
 * dir/<prefix>XXXXXX (mode 0600) and unlinked at once, so that a crash
 * leaves its name only for that instant. Read-write, O_CLOEXEC. The fd and
 * *how ("O_TMPFILE" or "unlinked"), or -1 with errno (mkostemp's) and, in
 * *unnamed_err, why no unnamed file was made. */
int ofl__file_private(const char *dir, const char *prefix, const char **how,
                      int *unnamed_err);

#endif /* OFL_DISK_PRIVATE_FILE_H */
