/* ofl: the OFL_* configuration variables. One table lists every variable with
 * its default and meaning; the environment is parsed once, on first use. */
#ifndef OFL_CONFIG_H
#define OFL_CONFIG_H

#include <stdio.h>

#include <ofl/export.h>
#include <ofl/status.h>

OFL_EXTERN_C_BEGIN

/* Parses the environment again (tests and programs that setenv() after start).
 * Returns OFL_ERR_CONFIG when a value is invalid; the message names the
 * variable and its allowed values. Unknown OFL_* variables are warned about
 * once. */
OFL_API ofl_status_t ofl_config_reload(void);

/* Writes every variable, its current value, default and one-line doc. */
OFL_API void ofl_config_print(FILE *out);

/* The raw text of a variable as in force (environment or default); NULL for
 * a name that is not in the table. */
OFL_API const char *ofl_config_get(const char *name);

OFL_EXTERN_C_END

#endif /* OFL_CONFIG_H */
