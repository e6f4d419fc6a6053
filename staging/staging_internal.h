/* ofl: staging/ internals shared by the safetensors writer, the reader, the
 * stager and the background saves. Not installed. */
#ifndef OFL_STAGING_INTERNAL_H
#define OFL_STAGING_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include <ofl/safetensors.h>

#include "runtime/internal.h"

/* The write(2) the writer calls; tests swap it to inject faults (short
 * writes, ENOSPC, EIO). NULL restores the system call. Not thread-safe:
 * set it before starting saves. */
typedef ssize_t (*ofl__write_fn)(int fd, const void *buf, size_t bytes);
void ofl__safetensors_set_write_hook(ofl__write_fn fn);

/* Element size of a dtype (0 when invalid) and the bytes of a shape; the
 * staging code does not depend on pool/ for these. */
size_t ofl__st_elem_size(ofl_dtype_t dtype);
ofl_status_t ofl__st_shape_bytes(const int64_t *shape, int ndim,
                                 ofl_dtype_t dtype, size_t *out);

/* true when s[0..len) is valid UTF-8 without NUL bytes. */
bool ofl__utf8_valid(const char *s, size_t len);

/* Checks a tensor name for the format: non-empty, at most
 * OFL_SAFETENSORS_NAME_MAX bytes, valid UTF-8, not "__metadata__". Reports
 * the error (what names the caller: "stage", "write"). */
ofl_status_t ofl__safetensors_check_name(const char *name, const char *what);

#endif /* OFL_STAGING_INTERNAL_H */
