/* ofl: per-rank byte tables and the offload summary across ranks.
 *
 * A byte table maps names (offload group names) to byte counts on one rank. A
 * summary is the rank x name matrix gathered from every rank of a comm: the
 * union of the names (sorted by strcmp), one row per rank (a rank whose table
 * is empty still has a row of zeros), row, column and grand totals. It renders
 * as the reference text table ("Activation Offload Summary (MB)"), as JSON and
 * as CSV (both in exact bytes). */
#ifndef OFL_SUMMARY_H
#define OFL_SUMMARY_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <ofl/comm.h>
#include <ofl/export.h>
#include <ofl/status.h>

OFL_EXTERN_C_BEGIN

/* ---- byte table (one rank) ------------------------------------------------
 */

typedef struct ofl_byte_table ofl_byte_table_t;

/* Longest name accepted, in bytes (without the terminating NUL). */
#define OFL_BYTE_TABLE_NAME_MAX 1024

OFL_API ofl_status_t ofl_byte_table_create(ofl_byte_table_t **out);
OFL_API void ofl_byte_table_destroy(ofl_byte_table_t *table);

/* Adds bytes to the entry of name, creating it (with 0 + bytes) when absent;
 * adding 0 creates an entry of 0 bytes. A name is 1 to OFL_BYTE_TABLE_NAME_MAX
 * bytes without control characters. OFL_ERR_INVALID_ARG when the name is
 * invalid or the sum would not fit in 64 bits (the table is then unchanged). */
OFL_API ofl_status_t ofl_byte_table_add(ofl_byte_table_t *table,
                                        const char *name, uint64_t bytes);
/* Sets the entry of name to bytes (same name rules). */
OFL_API ofl_status_t ofl_byte_table_set(ofl_byte_table_t *table,
                                        const char *name, uint64_t bytes);
/* Removes every entry. */
OFL_API void ofl_byte_table_clear(ofl_byte_table_t *table);

/* Entries in name order (strcmp): count, then name and bytes of entry i. */
OFL_API size_t ofl_byte_table_count(const ofl_byte_table_t *table);
OFL_API const char *ofl_byte_table_name(const ofl_byte_table_t *table,
                                        size_t i); /* NULL when out of range */
OFL_API uint64_t ofl_byte_table_bytes(const ofl_byte_table_t *table, size_t i);
/* Bytes of name; 0 when absent (then *found, if given, is 0). */
OFL_API uint64_t ofl_byte_table_get(const ofl_byte_table_t *table,
                                    const char *name, int *found);
/* Sum of every entry (saturates at UINT64_MAX, which add keeps from
 * happening within one entry but not across entries). */
OFL_API uint64_t ofl_byte_table_total(const ofl_byte_table_t *table);

/* ---- summary (every rank of a comm) ---------------------------------------
 */

typedef struct ofl_summary ofl_summary_t;

typedef enum ofl_summary_format {
  OFL_SUMMARY_TEXT = 0, /* the reference layout, MB (2^20 bytes), 2 decimals */
  OFL_SUMMARY_JSON = 1, /* exact bytes */
  OFL_SUMMARY_CSV = 2   /* exact bytes: rank,<names...>,total; a total row */
} ofl_summary_format_t;

/* Gathers every rank's table over comm (NULL: a self comm): sizes first, then
 * the payloads. Collective: every rank of comm calls it. With root_only the
 * summary is built on rank 0 only and *out is set to NULL on the other ranks;
 * otherwise every rank gets the same summary. Every rank learns whether the
 * gather succeeded: a rank that died or never called makes it fail on all the
 * others within the comm's timeout (OFL_ERR_TIMEOUT naming the ranks). */
OFL_API ofl_status_t ofl_summary_gather(ofl_comm_t *comm,
                                        const ofl_byte_table_t *local,
                                        int root_only, ofl_summary_t **out);

/* Builds a summary from nranks tables (row r from tables[r]; a NULL table is
 * an empty row). No communication. */
OFL_API ofl_status_t ofl_summary_from_tables(
    const ofl_byte_table_t *const *tables, int nranks, ofl_summary_t **out);

OFL_API void ofl_summary_destroy(ofl_summary_t *summary);

OFL_API int ofl_summary_nranks(const ofl_summary_t *summary);
/* Group names: the sorted union over every rank. */
OFL_API size_t ofl_summary_ngroups(const ofl_summary_t *summary);
OFL_API const char *ofl_summary_group_name(const ofl_summary_t *summary,
                                           size_t group); /* NULL: range */
/* Index of name among the groups; OFL_ERR_INVALID_ARG when absent. */
OFL_API ofl_status_t ofl_summary_find_group(const ofl_summary_t *summary,
                                            const char *name, size_t *out);
/* Bytes of one cell; 0 when rank or group is out of range. */
OFL_API uint64_t ofl_summary_bytes(const ofl_summary_t *summary, int rank,
                                   size_t group);
OFL_API uint64_t ofl_summary_rank_total(const ofl_summary_t *summary, int rank);
OFL_API uint64_t ofl_summary_group_total(const ofl_summary_t *summary,
                                         size_t group);
OFL_API uint64_t ofl_summary_total(const ofl_summary_t *summary);

/* Renders the summary into a NUL-terminated string allocated with malloc
 * (release it with free). *out_len, if given, receives strlen. */
OFL_API ofl_status_t ofl_summary_render(const ofl_summary_t *summary,
                                        ofl_summary_format_t format, char **out,
                                        size_t *out_len);
/* Renders and writes to f. OFL_ERR_IO when the write fails. */
OFL_API ofl_status_t ofl_summary_write(const ofl_summary_t *summary,
                                       ofl_summary_format_t format, FILE *f);

OFL_EXTERN_C_END

#endif /* OFL_SUMMARY_H */
