/* ofl: status codes and the last-error message. */
#ifndef OFL_STATUS_H
#define OFL_STATUS_H

#include <ofl/export.h>

OFL_EXTERN_C_BEGIN

/* One list, expanded into the enum and into ofl_status_str(). */
#define OFL_STATUS_LIST(X)                                                     \
  X(OFL_SUCCESS, 0, "success")                                                 \
  X(OFL_ERR_NOT_READY, 1, "operation not complete yet")                        \
  X(OFL_ERR_INVALID_ARG, 2, "invalid argument")                                \
  X(OFL_ERR_INVALID_USAGE, 3, "invalid usage (wrong order of calls)")          \
  X(OFL_ERR_NO_MEMORY, 4, "out of memory or budget exhausted")                 \
  X(OFL_ERR_TIMEOUT, 5, "timed out")                                           \
  X(OFL_ERR_SYSTEM, 6, "system call failed")                                   \
  X(OFL_ERR_IO, 7, "i/o error")                                                \
  X(OFL_ERR_CUDA, 8, "cuda error")                                             \
  X(OFL_ERR_NO_DEVICE, 9, "no device found")                                   \
  X(OFL_ERR_MPI, 10, "mpi error")                                              \
  X(OFL_ERR_NCCL, 11, "nccl error")                                            \
  X(OFL_ERR_NOT_SUPPORTED, 12, "not supported in this build or backend")       \
  X(OFL_ERR_CONFIG, 13, "invalid configuration")                               \
  X(OFL_ERR_MISMATCH, 14, "structure does not match the warmup record")        \
  X(OFL_ERR_CORRUPT, 15, "data corrupted (bad checksum or malformed file)")    \
  X(OFL_ERR_NO_SPACE, 16, "no space left on device")                           \
  X(OFL_ERR_INTERNAL, 17, "internal error")

typedef enum ofl_status {
#define OFL__STATUS_ENUM(name, value, text) name = value,
  OFL_STATUS_LIST(OFL__STATUS_ENUM)
#undef OFL__STATUS_ENUM
} ofl_status_t;

/* Short fixed description of a status code; never NULL. */
OFL_API const char *ofl_status_str(ofl_status_t status);

/* The message of the last error reported on the calling thread: what failed and
 * what to do about it. Empty string when none. Valid until the next ofl call on
 * this thread that fails. */
OFL_API const char *ofl_last_error(void);

/* Clears the calling thread's last-error message. */
OFL_API void ofl_clear_error(void);

/* Where an error a call returns is logged. warn 1 (the default): as a WARN
 * by the function that detects it, with the cause and what to do. warn 0:
 * at INFO only, for a caller that reports every error itself (a language
 * binding that raises it as an exception with ofl_last_error(), so that the
 * user does not read the same error twice, once in C's words). Process-wide;
 * warnings that are not returned errors are logged as before. */
OFL_API void ofl_error_logging_set(int warn);

OFL_EXTERN_C_END

#endif /* OFL_STATUS_H */
