/* ofl: private structures of the byte table and the summary. */
#ifndef OFL_COLLECTIVES_SUMMARY_INTERNAL_H
#define OFL_COLLECTIVES_SUMMARY_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <ofl/summary.h>

#include "collectives/comm_internal.h"

typedef struct ofl__byte_entry {
  char *name;
  uint64_t bytes;
} ofl__byte_entry_t;

struct ofl_byte_table {
  ofl__byte_entry_t *entries; /* sorted by strcmp of name, names unique */
  size_t count, cap;
};

struct ofl_summary {
  int nranks;
  size_t ngroups;
  char **names;           /* sorted, unique */
  uint64_t *cells;        /* nranks x ngroups, row-major */
  uint64_t *rank_totals;  /* nranks */
  uint64_t *group_totals; /* ngroups */
  uint64_t total;
};

/* Checks a name of len bytes (1..OFL_BYTE_TABLE_NAME_MAX, no control
 * characters); what names the caller in the message. */
ofl_status_t ofl__name_check(const char *name, size_t len, const char *what);

ofl_status_t ofl__byte_table_encode(const ofl_byte_table_t *t,
                                    unsigned char **out, size_t *out_len);
/* OFL_ERR_CORRUPT naming rank when the buffer is malformed. */
ofl_status_t ofl__byte_table_decode(const unsigned char *buf, size_t len,
                                    int rank, ofl_byte_table_t **out);

#endif /* OFL_COLLECTIVES_SUMMARY_INTERNAL_H */
