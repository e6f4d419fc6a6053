/* ofl: internal helpers shared by every folder (errors, logging, config,
 * time). Not installed. */
#ifndef OFL_RUNTIME_INTERNAL_H
#define OFL_RUNTIME_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <ofl/config.h>
#include <ofl/log.h>
#include <ofl/status.h>

#include "runtime/clock.h" /* time */

#if defined(__GNUC__)
#define OFL__PRINTF(a, b) __attribute__((format(printf, a, b)))
#define OFL__LIKELY(x) __builtin_expect(!!(x), 1)
#define OFL__UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define OFL__PRINTF(a, b)
#define OFL__LIKELY(x) (x)
#define OFL__UNLIKELY(x) (x)
#endif

/* ---- errors ---------------------------------------------------------------
 * The function that detects an error calls ofl__error(): it stores the
 * message as the thread's last error, logs it at WARN, and returns status.
 * Callers only propagate (OFL_CHECK leaves an INFO breadcrumb). */
ofl_status_t ofl__error(ofl_status_t status, unsigned subsys, const char *fmt,
                        ...) OFL__PRINTF(3, 4);
/* Same without the WARN line (expected outcomes such as budget exhaustion
 * that the caller handles by falling back). */
ofl_status_t ofl__error_quiet(ofl_status_t status, const char *fmt, ...)
    OFL__PRINTF(2, 3);

#define OFL_CHECK(call)                                                        \
  do {                                                                         \
    ofl_status_t ofl__st = (call);                                             \
    if (OFL__UNLIKELY(ofl__st != OFL_SUCCESS)) {                               \
      OFL_INFO(OFL_SUBSYS_ALL, "%s:%d %s -> %s", __FILE__, __LINE__, #call,    \
               ofl_status_str(ofl__st));                                       \
      return ofl__st;                                                          \
    }                                                                          \
  } while (0)

#define OFL_CHECK_GOTO(call, st, label)                                        \
  do {                                                                         \
    (st) = (call);                                                             \
    if (OFL__UNLIKELY((st) != OFL_SUCCESS)) {                                  \
      OFL_INFO(OFL_SUBSYS_ALL, "%s:%d %s -> %s", __FILE__, __LINE__, #call,    \
               ofl_status_str(st));                                            \
      goto label;                                                              \
    }                                                                          \
  } while (0)

/* ---- logging --------------------------------------------------------------
 * The level check is one load and a compare before any formatting. */
extern _Atomic int ofl__log_level_cache; /* -1: not yet read from the env */
extern _Atomic unsigned ofl__log_subsys_mask;
void ofl__log_init(void);
void ofl__log(ofl_log_level_t level, unsigned subsys, const char *file,
              int line, const char *fmt, ...) OFL__PRINTF(5, 6);

static inline bool ofl__log_enabled(ofl_log_level_t level, unsigned subsys) {
  if (OFL__UNLIKELY(ofl__log_level_cache < 0))
    ofl__log_init();
  return (int)level <= ofl__log_level_cache &&
         (subsys & ofl__log_subsys_mask) != 0;
}

#define OFL__LOG(level, subsys, ...)                                           \
  do {                                                                         \
    if (ofl__log_enabled((level), (subsys)))                                   \
      ofl__log((level), (subsys), __FILE__, __LINE__, __VA_ARGS__);            \
  } while (0)
#define OFL_WARN(subsys, ...) OFL__LOG(OFL_LOG_WARN, (subsys), __VA_ARGS__)
#define OFL_INFO(subsys, ...) OFL__LOG(OFL_LOG_INFO, (subsys), __VA_ARGS__)
#define OFL_TRACE(subsys, ...) OFL__LOG(OFL_LOG_TRACE, (subsys), __VA_ARGS__)
/* A notice: one line at the default level that is not a warning (the auto
 * plan settled). Printed where a WARN would be, named NOTE, and given to a
 * handler as OFL_LOG_INFO: a handler that counts WARNs (a test) or turns
 * them into Python warnings does not take it for one, and the public
 * levels (and their values) stay as they are. */
#define OFL__LOG_NOTE ((ofl_log_level_t)0x10)
#define OFL_NOTE(subsys, ...)                                                  \
  do {                                                                         \
    if (ofl__log_enabled(OFL_LOG_WARN, (subsys)))                              \
      ofl__log(OFL__LOG_NOTE, (subsys), __FILE__, __LINE__, __VA_ARGS__);      \
  } while (0)

/* ---- configuration --------------------------------------------------------
 * Typed reads of the OFL_* table (runtime/config.c). Each returns
 * OFL_ERR_CONFIG with a message naming the variable and what it accepts when
 * the value in force is invalid; *out is set only on success. */
ofl_status_t ofl__config_str(const char *name, const char **out);
/* The rank of this process on its node, as the launcher says (Open MPI,
 * MPICH, Slurm, torchrun), else fallback (when >= 0), else 0. */
int ofl__local_rank(int fallback);
ofl_status_t ofl__config_bool(const char *name, bool *out);
ofl_status_t ofl__config_int(const char *name, int64_t *out);
/* Changes whenever the table is (re)loaded (0: never loaded): a value
 * parsed under one generation holds until the next. */
unsigned ofl__config_generation(void);
/* Sizes accept K, M, G, T suffixes (powers of 1024) and KB/MB/GB. */
ofl_status_t ofl__config_size(const char *name, size_t *out);
ofl_status_t ofl__config_double(const char *name, double *out);
/* Index of the value in the variable's list of allowed words. */
ofl_status_t ofl__config_enum(const char *name, int *out);
/* Where the value in force of a variable comes from: "environment" or
 * "default" (a params field that wins over both is the caller's to say). */
const char *ofl__config_source(const char *name);
/* One line "NAME = value (source)", the layout of ofl_config_print, for
 * printers of values resolved elsewhere (the manager's params). */
void ofl__config_print_value(FILE *f, const char *name, const char *value,
                             const char *source);

/* The slowest link-model rate accepted, in bytes/s: one byte a day. A lower
 * rate is a typo, and pacing a copy at it would outlast any program. */
#define OFL__LINK_MIN_BPS (1.0 / 86400.0)

/* Strict parsers of the logging variables (runtime/log.c), shared with the
 * configuration table's checks: false when the text is invalid. */
/* Case-insensitive Levenshtein distance of two names (up to 64 characters
 * of each): the did-you-mean of unknown variables and group names. */
size_t ofl__edit_distance(const char *a, const char *b);

bool ofl__log_parse_subsys(const char *s, unsigned *mask);
/* A decimal rank >= 0 (and below 2^30); "" is -1, all ranks. */
bool ofl__log_parse_rank(const char *s, int *rank);

/* ---- threads --------------------------------------------------------------
 */
/* Names the calling thread "ofl <what>" (cut to the 15 bytes Linux keeps),
 * so that top -H, gdb, perf and py-spy tell ofl's threads apart; a failure
 * only leaves the inherited name. */
void ofl__thread_name(const char *what);

#endif /* OFL_RUNTIME_INTERNAL_H */
