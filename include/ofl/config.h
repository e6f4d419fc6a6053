/* ofl: the OFL_* configuration variables. One table lists every variable with
 * its default and meaning; the environment is parsed once, on first use. An
 * empty value (NAME= in the environment) is the same as an unset one, for
 * every variable: the default applies. */
#ifndef OFL_CONFIG_H
#define OFL_CONFIG_H

#include <stdio.h>

#include <ofl/export.h>
#include <ofl/status.h>

OFL_EXTERN_C_BEGIN

/* Parses the environment again (tests and programs that setenv() after start).
 * Returns OFL_ERR_CONFIG when a value is invalid; the message names the
 * variable and its allowed values. Unknown OFL_* variables are warned about
 * once. The first call that reads the configuration (a device open, a
 * manager create) parses it on its own and fails the same way: while any
 * OFL_* value is invalid, every call that reads one returns OFL_ERR_CONFIG
 * naming it (warned about once per value). */
OFL_API ofl_status_t ofl_config_reload(void);

/* Writes every variable with the value in force for the library and its
 * source (environment or default), the default, what it accepts and a
 * one-line doc. A params struct field set by the application wins over
 * both; the manager's own printer shows those. */
OFL_API void ofl_config_print(FILE *out);

/* Checks the environment with the rules the library reads it by: every
 * OFL_* value against its kind and range, every OFL_* name against the
 * table (an unknown one with the closest known name: "did you mean").
 * Writes one line per problem to out (NULL: count only) and returns how
 * many there are; 0: the configuration is usable as it is. ofl-info fails
 * on any. */
OFL_API size_t ofl_config_check(FILE *out);

/* The raw text of a variable as in force (environment or default); NULL for
 * a name that is not in the table. */
OFL_API const char *ofl_config_get(const char *name);

OFL_EXTERN_C_END

#endif /* OFL_CONFIG_H */
