/* ofl: the table of every OFL_* variable (runtime/config_table.c), read by
 * the loader and the typed reads (runtime/config.c). Not installed. */
#ifndef OFL_RUNTIME_CONFIG_TABLE_H
#define OFL_RUNTIME_CONFIG_TABLE_H

#include <stdbool.h>
#include <stdint.h>

typedef enum { K_STR, K_BOOL, K_INT, K_SIZE, K_DOUBLE, K_ENUM } kind_t;

typedef struct entry {
  const char *name;
  const char *def;
  kind_t kind;
  const char *words; /* K_ENUM: allowed values, '|'-separated */
  /* K_INT: lo..hi (both 0: any int64); K_SIZE: lo..hi bytes (hi 0: no
   * upper bound); K_DOUBLE: dlo..dhi (dhi 0: no upper bound). */
  int64_t lo, hi;
  double dlo, dhi;
  /* Extra check of the text (K_STR, K_DOUBLE); NULL: none. hint says what
   * it accepts. */
  bool (*check)(const char *s);
  const char *hint;
  const char *doc;
} entry_t;

/* The entries of the table: a new variable raises it (config_table.c checks
 * the count when it compiles). */
#define OFL__CONFIG_ENTRIES 44
/* Every OFL_* variable the library reads. README.md lists the same. */
extern const entry_t ofl__config_table[];

#endif /* OFL_RUNTIME_CONFIG_TABLE_H */
