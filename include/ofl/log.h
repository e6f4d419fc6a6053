/* ofl: logging (NCCL-style OFL_DEBUG, OFL_DEBUG_SUBSYS, OFL_DEBUG_RANK,
 * OFL_DEBUG_FILE). Messages go to stderr unless OFL_DEBUG_FILE or a handler
 * says otherwise; stdout belongs to the application. */
#ifndef OFL_LOG_H
#define OFL_LOG_H

#include <ofl/export.h>

OFL_EXTERN_C_BEGIN

typedef enum ofl_log_level {
  OFL_LOG_NONE = 0,
  OFL_LOG_WARN = 1,
  OFL_LOG_INFO = 2,
  OFL_LOG_TRACE = 3
} ofl_log_level_t;

/* Subsystems, a bit each, selected by OFL_DEBUG_SUBSYS=INIT,DEVICE,... or ALL. */
typedef enum ofl_log_subsys {
  OFL_SUBSYS_INIT = 1u << 0,
  OFL_SUBSYS_DEVICE = 1u << 1,
  OFL_SUBSYS_POOL = 1u << 2,
  OFL_SUBSYS_PIPELINE = 1u << 3,
  OFL_SUBSYS_DISK = 1u << 4,
  OFL_SUBSYS_STAGING = 1u << 5,
  OFL_SUBSYS_COLL = 1u << 6,
  OFL_SUBSYS_CONFIG = 1u << 7,
  OFL_SUBSYS_ALL = 0xffu
} ofl_log_subsys_t;

/* A handler receives every message that passes the level, subsystem and rank
 * filters, already formatted without a trailing newline. A notice (a line the
 * default level prints that is no warning, e.g. "auto plan settled"; NOTE in
 * the default sink) arrives as OFL_LOG_INFO whatever the level. */
typedef void (*ofl_log_handler_fn)(ofl_log_level_t level, unsigned subsys,
                                   const char *message, void *user);

/* Installs a handler (NULL restores the default sink). Returns the old one. */
OFL_API ofl_log_handler_fn ofl_log_set_handler(ofl_log_handler_fn fn,
                                               void *user);

/* Overrides the level from OFL_DEBUG; OFL_LOG_NONE silences everything. */
OFL_API void ofl_log_set_level(ofl_log_level_t level);
OFL_API ofl_log_level_t ofl_log_get_level(void);

/* The rank written in every line and matched against OFL_DEBUG_RANK and the
 * %r of OFL_DEBUG_FILE. -1 (the default) means unknown. */
OFL_API void ofl_log_set_rank(int rank);
OFL_API int ofl_log_get_rank(void);

/* Re-reads OFL_DEBUG* from the environment (tests; the first log call reads it
 * on its own). */
OFL_API void ofl_log_reload(void);

OFL_EXTERN_C_END

#endif /* OFL_LOG_H */
