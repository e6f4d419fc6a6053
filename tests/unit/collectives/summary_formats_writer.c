/* Writes the JSON, CSV and text of a fixed summary to stdout, separated by
 * form feeds, for check_summary_formats.py (Python's json and csv modules
 * read what ofl wrote). The tables are the same as in that script. */
#include <stdio.h>

#include <ofl/ofl.h>

int main(void) {
  static const struct {
    int rank;
    const char *name;
    uint64_t bytes;
  } cells[] = {
      {0, "attn_norm", 1048576},
      {0, "core \"attn\"", 3670016},
      {0, "back\\slash", 1},
      {1, "comma,name", 9223372036854775808ull},
      {1, " lead and trail ", 12345},
      {1, "caf\xc3\xa9", 2097152},
      {3, "attn_norm", 5},
  };
  ofl_byte_table_t *t[4] = {0};
  for (int r = 0; r < 4; r++)
    if (ofl_byte_table_create(&t[r]) != OFL_SUCCESS)
      return 1;
  for (size_t i = 0; i < sizeof(cells) / sizeof(cells[0]); i++)
    if (ofl_byte_table_add(t[cells[i].rank], cells[i].name, cells[i].bytes) !=
        OFL_SUCCESS)
      return 1;
  /* rank 2 is empty */
  ofl_summary_t *s = NULL;
  if (ofl_summary_from_tables((const ofl_byte_table_t *const *)t, 4, &s) !=
      OFL_SUCCESS) {
    fprintf(stderr, "%s\n", ofl_last_error());
    return 1;
  }
  int rc = ofl_summary_write(s, OFL_SUMMARY_JSON, stdout) != OFL_SUCCESS;
  fputc('\f', stdout);
  rc |= ofl_summary_write(s, OFL_SUMMARY_CSV, stdout) != OFL_SUCCESS;
  fputc('\f', stdout);
  rc |= ofl_summary_write(s, OFL_SUMMARY_TEXT, stdout) != OFL_SUCCESS;
  ofl_summary_destroy(s);
  for (int r = 0; r < 4; r++)
    ofl_byte_table_destroy(t[r]);
  return rc;
}
