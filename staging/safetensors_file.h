/* ofl: the files of a safetensors write (staging/safetensors_file.c), for
 * the writer (staging/safetensors_write.c). Not installed. */
#ifndef OFL_STAGING_SAFETENSORS_FILE_H
#define OFL_STAGING_SAFETENSORS_FILE_H

#include <stdbool.h>

#include "staging/staging_internal.h"

/* The error of a failed op ("writing", "syncing"...) on path with errno
 * err: OFL_ERR_NO_SPACE for a full file system or the file size limit,
 * else OFL_ERR_IO; reported. */
ofl_status_t ofl__st_io_error(int err, const char *op, const char *path);
/* NAME_MAX of dir's file system (255 when it cannot be asked). */
long ofl__st_name_max(const char *dir);
/* Splits path into directory and base name (both malloc'ed). */
ofl_status_t ofl__st_split_path(const char *path, char **dir, char **base);
/* Removes the temporaries that saves killed before their rename left in
 * dir (of base, and of other names older than this process); never one a
 * live writer holds. Best effort. */
void ofl__st_sweep_stale(const char *dir, const char *base);
/* Creates a named temporary file next to path, locked: its name fits the
 * directory's NAME_MAX whatever the length of the final name. */
ofl_status_t ofl__st_create_temp(const char *dir, const char *base,
                                 const char *path, char **tmp_out,
                                 int *fd_out);
/* An unnamed file in dir (O_TMPFILE), locked; -1 with errno when the file
 * system or kernel has none (or ofl__no_tmpfile is set). */
int ofl__st_open_unnamed(const char *dir);
/* Names the complete unnamed file path (over an existing file through a
 * locked temporary name and a rename). OFL_ERR_NOT_SUPPORTED (quiet) when
 * the file cannot be linked at all: the caller writes again through a named
 * temporary. */
ofl_status_t ofl__st_publish_unnamed(int fd, const char *dir,
                                     const char *base, const char *path);
/* fsync of the directory, best effort. */
void ofl__st_sync_dir(const char *dir);

#endif /* OFL_STAGING_SAFETENSORS_FILE_H */
