/* Rendering of the summary: the reference text layout (widths, long names,
 * rows without groups, huge values, rounding), JSON and CSV. The expected
 * texts were produced by an independent Python rendering of the reference
 * layout (format(x, ".2f"), str.center, ljust/rjust). */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

#define MB 1048576ull

typedef struct {
  const char *name;
  uint64_t bytes;
} cell_t;

/* Builds a summary of nranks rows; each row is a list ended by {NULL, 0}. */
static ofl_summary_t *build(int nranks, const cell_t *const *rows) {
  ofl_byte_table_t *t[16] = {0};
  cr_assert(le(int, nranks, 16));
  for (int r = 0; r < nranks; r++) {
    cr_assert(eq(int, ofl_byte_table_create(&t[r]), OFL_SUCCESS));
    for (const cell_t *c = rows[r]; c && c->name; c++)
      cr_assert(
          eq(int, ofl_byte_table_add(t[r], c->name, c->bytes), OFL_SUCCESS));
  }
  ofl_summary_t *s = NULL;
  cr_assert(eq(
      int,
      ofl_summary_from_tables((const ofl_byte_table_t *const *)t, nranks, &s),
      OFL_SUCCESS));
  for (int r = 0; r < nranks; r++)
    ofl_byte_table_destroy(t[r]);
  return s;
}

static char *render(const ofl_summary_t *s, ofl_summary_format_t f) {
  char *text = NULL;
  size_t len = 0;
  cr_assert(eq(int, ofl_summary_render(s, f, &text, &len), OFL_SUCCESS));
  cr_assert(eq(sz, len, strlen(text)));
  return text;
}

static const cell_t two_r0[] = {
    {"core_attn", 3 * MB + MB / 2}, {"attn_norm", MB}, {NULL, 0}};
static const cell_t two_r1[] = {
    {"qkv_linear", 5 * MB}, {"core_attn", 2 * MB}, {NULL, 0}};

Test(summary_render, text_two_ranks_is_the_reference_layout) {
  const cell_t *rows[] = {two_r0, two_r1};
  ofl_summary_t *s = build(2, rows);
  char *text = render(s, OFL_SUMMARY_TEXT);
  const char *expect =
      "========================================================\n"
      "            Activation Offload Summary (MB)             \n"
      "========================================================\n"
      "Rank       attn_norm   core_attn  qkv_linear       Total\n"
      "--------------------------------------------------------\n"
      "Rank 0          1.00        3.50        0.00        4.50\n"
      "Rank 1          0.00        2.00        5.00        7.00\n"
      "--------------------------------------------------------\n"
      "Total           1.00        5.50        5.00       11.50\n"
      "========================================================\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, text_long_name_widens_every_group_column) {
  static const cell_t r0[] = {
      {"a", 1}, {"expert_fc1_with_a_very_long_group_name", 7 * MB}, {NULL, 0}};
  const cell_t *rows[] = {r0, NULL};
  ofl_summary_t *s = build(2, rows);
  char *text = render(s, OFL_SUMMARY_TEXT);
  const char *expect =
      "========================================================================"
      "========================================================\n"
      "                                                Activation Offload "
      "Summary (MB)                                                 \n"
      "========================================================================"
      "========================================================\n"
      "Rank                                           a  "
      "expert_fc1_with_a_very_long_group_name                                  "
      " Total\n"
      "------------------------------------------------------------------------"
      "--------------------------------------------------------\n"
      "Rank 0                                      0.00                        "
      "            7.00                                    7.00\n"
      "Rank 1                                      0.00                        "
      "            0.00                                    0.00\n"
      "------------------------------------------------------------------------"
      "--------------------------------------------------------\n"
      "Total                                       0.00                        "
      "            7.00                                    7.00\n"
      "========================================================================"
      "========================================================\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, text_without_groups_keeps_a_zero_row_per_rank) {
  const cell_t *rows[] = {NULL, NULL, NULL};
  ofl_summary_t *s = build(3, rows);
  cr_assert(eq(sz, ofl_summary_ngroups(s), 0));
  char *text = render(s, OFL_SUMMARY_TEXT);
  /* The title is wider than the table: it is printed whole. */
  const char *expect = "====================\n"
                       "Activation Offload Summary (MB)\n"
                       "====================\n"
                       "Rank           Total\n"
                       "--------------------\n"
                       "Rank 0          0.00\n"
                       "Rank 1          0.00\n"
                       "Rank 2          0.00\n"
                       "--------------------\n"
                       "Total           0.00\n"
                       "====================\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, text_huge_values_widen_columns_and_stay_exact) {
  static const cell_t r0[] = {{"x", 1ull << 62}, {NULL, 0}};
  static const cell_t r1[] = {
      {"x", (1ull << 62) - 1}, {"y", 1ull << 62}, {NULL, 0}};
  const cell_t *rows[] = {r0, r1};
  ofl_summary_t *s = build(2, rows);
  char *text = render(s, OFL_SUMMARY_TEXT);
  const char *expect =
      "=================================================================\n"
      "                 Activation Offload Summary (MB)                 \n"
      "=================================================================\n"
      "Rank                      x                  y              Total\n"
      "-----------------------------------------------------------------\n"
      "Rank 0     4398046511104.00               0.00   4398046511104.00\n"
      "Rank 1     4398046511104.00   4398046511104.00   8796093022208.00\n"
      "-----------------------------------------------------------------\n"
      "Total      8796093022208.00   4398046511104.00  13194139533312.00\n"
      "=================================================================\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, text_rounds_to_two_decimals_ties_to_even) {
  /* 0.125 MB -> 0.12, 0.375 MB -> 0.38 (as Python formats them). */
  static const cell_t r0[] = {
      {"a", 131072}, {"b", 393216}, {"c", 5242}, {NULL, 0}};
  const cell_t *rows[] = {r0};
  ofl_summary_t *s = build(1, rows);
  char *text = render(s, OFL_SUMMARY_TEXT);
  const char *expect =
      "========================================================\n"
      "            Activation Offload Summary (MB)             \n"
      "========================================================\n"
      "Rank               a           b           c       Total\n"
      "--------------------------------------------------------\n"
      "Rank 0          0.12        0.38        0.00        0.50\n"
      "--------------------------------------------------------\n"
      "Total           0.12        0.38        0.00        0.50\n"
      "========================================================\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, text_rank_column_grows_with_two_digit_ranks) {
  const cell_t *rows[12] = {0};
  static const cell_t r11[] = {{"g", 2 * MB}, {NULL, 0}};
  rows[11] = r11;
  ofl_summary_t *s = build(12, rows);
  char *text = render(s, OFL_SUMMARY_TEXT);
  /* rank width max(6, len("Rank 11") + 2) = 9, group width 12 */
  cr_assert(
      not(eq(ptr, strstr(text, "\nRank 9           0.00        0.00\n"), NULL)),
      "%s", text);
  cr_assert(
      not(eq(ptr, strstr(text, "\nRank 11          2.00        2.00\n"), NULL)),
      "%s", text);
  cr_assert(
      not(eq(ptr, strstr(text, "\nTotal            2.00        2.00\n"), NULL)),
      "%s", text);
  /* every line of the table (not the title) has the same width, 33 */
  size_t lines = 0;
  for (char *p = text, *nl; (nl = strchr(p, '\n')); p = nl + 1, lines++)
    if (lines != 1)
      cr_assert(eq(sz, (size_t)(nl - p), 33), "line %zu", lines);
  cr_assert(eq(sz, lines, 3 + 1 + 1 + 12 + 1 + 1 + 1));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, json_has_exact_bytes_in_rank_by_group_order) {
  const cell_t *rows[] = {two_r0, two_r1};
  ofl_summary_t *s = build(2, rows);
  char *text = render(s, OFL_SUMMARY_JSON);
  const char *expect = "{\n"
                       "  \"title\": \"Activation Offload Summary\",\n"
                       "  \"unit\": \"bytes\",\n"
                       "  \"nranks\": 2,\n"
                       "  \"groups\": [\"attn_norm\", \"core_attn\", "
                       "\"qkv_linear\"],\n"
                       "  \"bytes\": [\n"
                       "    [1048576, 3670016, 0],\n"
                       "    [0, 2097152, 5242880]\n"
                       "  ],\n"
                       "  \"rank_totals\": [4718592, 7340032],\n"
                       "  \"group_totals\": [1048576, 5767168, 5242880],\n"
                       "  \"total\": 12058624\n"
                       "}\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render,
     json_escapes_quotes_and_backslashes_and_handles_no_groups) {
  static const cell_t r0[] = {{"a\"b\\c", 18446744073709551615ull}, {NULL, 0}};
  const cell_t *rows[] = {r0};
  ofl_summary_t *s = build(1, rows);
  char *text = render(s, OFL_SUMMARY_JSON);
  const char *expect = "{\n"
                       "  \"title\": \"Activation Offload Summary\",\n"
                       "  \"unit\": \"bytes\",\n"
                       "  \"nranks\": 1,\n"
                       "  \"groups\": [\"a\\\"b\\\\c\"],\n"
                       "  \"bytes\": [\n"
                       "    [18446744073709551615]\n"
                       "  ],\n"
                       "  \"rank_totals\": [18446744073709551615],\n"
                       "  \"group_totals\": [18446744073709551615],\n"
                       "  \"total\": 18446744073709551615\n"
                       "}\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);

  const cell_t *empty[] = {NULL, NULL};
  s = build(2, empty);
  text = render(s, OFL_SUMMARY_JSON);
  const char *expect_empty = "{\n"
                             "  \"title\": \"Activation Offload Summary\",\n"
                             "  \"unit\": \"bytes\",\n"
                             "  \"nranks\": 2,\n"
                             "  \"groups\": [],\n"
                             "  \"bytes\": [\n"
                             "    [],\n"
                             "    []\n"
                             "  ],\n"
                             "  \"rank_totals\": [0, 0],\n"
                             "  \"group_totals\": [],\n"
                             "  \"total\": 0\n"
                             "}\n";
  cr_assert(eq(str, text, (char *)expect_empty));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, csv_is_wide_with_a_total_row_and_quotes_odd_names) {
  const cell_t *rows[] = {two_r0, two_r1};
  ofl_summary_t *s = build(2, rows);
  char *text = render(s, OFL_SUMMARY_CSV);
  const char *expect = "rank,attn_norm,core_attn,qkv_linear,total\n"
                       "0,1048576,3670016,0,4718592\n"
                       "1,0,2097152,5242880,7340032\n"
                       "total,1048576,5767168,5242880,12058624\n";
  cr_assert(eq(str, text, (char *)expect));
  free(text);
  ofl_summary_destroy(s);

  static const cell_t odd[] = {
      {"a,b", 1}, {"say \"hi\"", 2}, {" pad", 3}, {NULL, 0}};
  const cell_t *orows[] = {odd};
  s = build(1, orows);
  text = render(s, OFL_SUMMARY_CSV);
  const char *expect_odd = "rank,\" pad\",\"a,b\",\"say \"\"hi\"\"\",total\n"
                           "0,3,1,2,6\n"
                           "total,3,1,2,6\n";
  cr_assert(eq(str, text, (char *)expect_odd));
  free(text);
  ofl_summary_destroy(s);
}

Test(summary_render, write_puts_the_rendered_bytes_in_the_file) {
  const cell_t *rows[] = {two_r0, two_r1};
  ofl_summary_t *s = build(2, rows);
  for (int f = OFL_SUMMARY_TEXT; f <= OFL_SUMMARY_CSV; f++) {
    char *text = render(s, (ofl_summary_format_t)f);
    FILE *tmp = tmpfile();
    cr_assert(not(eq(ptr, tmp, NULL)));
    cr_assert(eq(int, ofl_summary_write(s, (ofl_summary_format_t)f, tmp),
                 OFL_SUCCESS));
    long n = ftell(tmp);
    cr_assert(eq(long, n, (long)strlen(text)));
    rewind(tmp);
    char *back = calloc(1, (size_t)n + 1);
    cr_assert(eq(sz, fread(back, 1, (size_t)n, tmp), (size_t)n));
    cr_assert(eq(str, back, text));
    free(back);
    free(text);
    fclose(tmp);
  }
  ofl_summary_destroy(s);
}

Test(summary_render, failed_write_and_bad_arguments_are_errors) {
  ofl_log_set_level(OFL_LOG_NONE);
  const cell_t *rows[] = {two_r0};
  ofl_summary_t *s = build(1, rows);
  FILE *ro = fopen("/dev/null", "r");
  cr_assert(not(eq(ptr, ro, NULL)));
  cr_assert(eq(int, ofl_summary_write(s, OFL_SUMMARY_TEXT, ro), OFL_ERR_IO));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "wrote 0 of"), NULL)));
  fclose(ro);
  char *text = (char *)0x1;
  cr_assert(eq(int, ofl_summary_render(s, (ofl_summary_format_t)7, &text, NULL),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(ptr, text, (char *)0x1)); /* output untouched on failure */
  cr_assert(eq(int, ofl_summary_render(NULL, OFL_SUMMARY_TEXT, &text, NULL),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_summary_write(s, OFL_SUMMARY_TEXT, NULL),
               OFL_ERR_INVALID_ARG));
  ofl_summary_destroy(s);
}
