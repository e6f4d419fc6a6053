/* The per-rank byte table: name rules, accumulation, order, overflow, and its
 * wire format (round trip, every malformed buffer rejected). */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "collectives/summary_internal.h"

static ofl_byte_table_t *mk(void) {
  ofl_byte_table_t *t = NULL;
  cr_assert(eq(int, ofl_byte_table_create(&t), OFL_SUCCESS));
  return t;
}

Test(byte_table, add_accumulates_and_keeps_names_sorted) {
  ofl_byte_table_t *t = mk();
  cr_assert(eq(int, ofl_byte_table_add(t, "qkv_linear", 10), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "attn_norm", 5), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "moe_act", 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "qkv_linear", 32), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "Z_upper", 1), OFL_SUCCESS));
  const char *names[] = {"Z_upper", "attn_norm", "moe_act", "qkv_linear"};
  const uint64_t bytes[] = {1, 5, 0, 42};
  cr_assert(eq(sz, ofl_byte_table_count(t), 4));
  for (size_t i = 0; i < 4; i++) {
    cr_assert(eq(str, (char *)ofl_byte_table_name(t, i), (char *)names[i]));
    cr_assert(eq(u64, ofl_byte_table_bytes(t, i), bytes[i]));
  }
  cr_assert(eq(ptr, (void *)ofl_byte_table_name(t, 4), NULL));
  cr_assert(eq(u64, ofl_byte_table_bytes(t, 4), 0));
  cr_assert(eq(u64, ofl_byte_table_total(t), 48));
  int found = -1;
  cr_assert(eq(u64, ofl_byte_table_get(t, "attn_norm", &found), 5));
  cr_assert(eq(int, found, 1));
  cr_assert(eq(u64, ofl_byte_table_get(t, "core_attn", &found), 0));
  cr_assert(eq(int, found, 0));
  cr_assert(eq(u64, ofl_byte_table_get(t, "moe_act", &found), 0));
  cr_assert(eq(int, found, 1));
  ofl_byte_table_destroy(t);
}

Test(byte_table, set_overwrites_and_clear_empties) {
  ofl_byte_table_t *t = mk();
  cr_assert(eq(int, ofl_byte_table_add(t, "a", 7), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_set(t, "a", 3), OFL_SUCCESS));
  cr_assert(eq(u64, ofl_byte_table_get(t, "a", NULL), 3));
  ofl_byte_table_clear(t);
  cr_assert(eq(sz, ofl_byte_table_count(t), 0));
  cr_assert(eq(u64, ofl_byte_table_total(t), 0));
  cr_assert(eq(int, ofl_byte_table_add(t, "b", 1), OFL_SUCCESS));
  cr_assert(eq(str, (char *)ofl_byte_table_name(t, 0), "b"));
  ofl_byte_table_destroy(t);
}

Test(byte_table, invalid_names_are_rejected_and_leave_the_table_unchanged) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_byte_table_t *t = mk();
  cr_assert(eq(int, ofl_byte_table_add(t, "keep", 1), OFL_SUCCESS));
  char longname[OFL_BYTE_TABLE_NAME_MAX + 2];
  memset(longname, 'x', sizeof(longname) - 1);
  longname[sizeof(longname) - 1] = '\0';
  const char *bad[] = {"", "tab\there", "new\nline", "del\x7f", longname};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    cr_assert(eq(int, ofl_byte_table_add(t, bad[i], 5), OFL_ERR_INVALID_ARG),
              "name %zu", i);
    cr_assert(eq(int, ofl_byte_table_set(t, bad[i], 5), OFL_ERR_INVALID_ARG));
  }
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "1 to 1024 bytes"), NULL)));
  cr_assert(eq(int, ofl_byte_table_add(t, NULL, 5), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_byte_table_add(NULL, "x", 5), OFL_ERR_INVALID_ARG));
  /* the longest allowed name is fine */
  longname[OFL_BYTE_TABLE_NAME_MAX] = '\0';
  cr_assert(eq(int, ofl_byte_table_add(t, longname, 2), OFL_SUCCESS));
  cr_assert(eq(sz, ofl_byte_table_count(t), 2));
  cr_assert(eq(u64, ofl_byte_table_get(t, "keep", NULL), 1));
  ofl_byte_table_destroy(t);
}

Test(byte_table, overflowing_add_is_rejected_and_total_saturates) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_byte_table_t *t = mk();
  cr_assert(eq(int, ofl_byte_table_add(t, "a", UINT64_MAX - 1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "a", 2), OFL_ERR_INVALID_ARG));
  cr_assert(eq(u64, ofl_byte_table_get(t, "a", NULL), UINT64_MAX - 1));
  cr_assert(eq(int, ofl_byte_table_add(t, "a", 1), OFL_SUCCESS));
  cr_assert(eq(u64, ofl_byte_table_get(t, "a", NULL), UINT64_MAX));
  cr_assert(eq(int, ofl_byte_table_add(t, "b", 10), OFL_SUCCESS));
  cr_assert(eq(u64, ofl_byte_table_total(t), UINT64_MAX));
  ofl_byte_table_destroy(t);
}

Test(byte_table, many_names_stay_sorted_and_findable) {
  ofl_byte_table_t *t = mk();
  char name[32];
  /* insert in a scrambled order */
  for (unsigned i = 0; i < 500; i++) {
    unsigned k = (i * 7919u) % 500u;
    snprintf(name, sizeof(name), "g%04u", k);
    cr_assert(eq(int, ofl_byte_table_add(t, name, k + 1), OFL_SUCCESS));
  }
  cr_assert(eq(sz, ofl_byte_table_count(t), 500));
  for (unsigned k = 0; k < 500; k++) {
    snprintf(name, sizeof(name), "g%04u", k);
    cr_assert(eq(str, (char *)ofl_byte_table_name(t, k), name));
    cr_assert(eq(u64, ofl_byte_table_bytes(t, k), k + 1));
  }
  cr_assert(eq(u64, ofl_byte_table_total(t), 500u * 501u / 2u));
  ofl_byte_table_destroy(t);
}

Test(byte_table, wire_format_round_trips_byte_for_byte) {
  ofl_byte_table_t *t = mk();
  cr_assert(eq(int, ofl_byte_table_add(t, "core_attn", 123456789012345ull),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "a", 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "b", UINT64_MAX), OFL_SUCCESS));
  unsigned char *buf = NULL;
  size_t len = 0;
  cr_assert(eq(int, ofl__byte_table_encode(t, &buf, &len), OFL_SUCCESS));
  /* "OFLT", version 1, 3 entries, then "a" */
  const unsigned char head[] = {'O', 'F', 'L', 'T', 1, 0, 0, 0, 3, 0, 0, 0, 1,
                                0,   0,   0,   'a', 0, 0, 0, 0, 0, 0, 0, 0};
  cr_assert(eq(sz, len, 12 + (4 + 1 + 8) + (4 + 1 + 8) + (4 + 9 + 8)));
  cr_assert(eq(int, memcmp(buf, head, sizeof(head)), 0));
  ofl_byte_table_t *back = NULL;
  cr_assert(eq(int, ofl__byte_table_decode(buf, len, 3, &back), OFL_SUCCESS));
  cr_assert(eq(sz, ofl_byte_table_count(back), 3));
  for (size_t i = 0; i < 3; i++) {
    cr_assert(eq(str, (char *)ofl_byte_table_name(back, i),
                 (char *)ofl_byte_table_name(t, i)));
    cr_assert(
        eq(u64, ofl_byte_table_bytes(back, i), ofl_byte_table_bytes(t, i)));
  }
  unsigned char *buf2 = NULL;
  size_t len2 = 0;
  cr_assert(eq(int, ofl__byte_table_encode(back, &buf2, &len2), OFL_SUCCESS));
  cr_assert(eq(sz, len2, len));
  cr_assert(eq(int, memcmp(buf, buf2, len), 0));
  free(buf2);
  ofl_byte_table_destroy(back);

  /* an empty (or NULL) table encodes to the 12-byte header */
  free(buf);
  cr_assert(eq(int, ofl__byte_table_encode(NULL, &buf, &len), OFL_SUCCESS));
  cr_assert(eq(sz, len, 12));
  cr_assert(eq(int, ofl__byte_table_decode(buf, len, 0, &back), OFL_SUCCESS));
  cr_assert(eq(sz, ofl_byte_table_count(back), 0));
  ofl_byte_table_destroy(back);
  free(buf);
  ofl_byte_table_destroy(t);
}

Test(byte_table, every_truncated_or_damaged_buffer_is_reported_as_corrupt) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_byte_table_t *t = mk();
  cr_assert(eq(int, ofl_byte_table_add(t, "x", 1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "yy", 2), OFL_SUCCESS));
  unsigned char *buf = NULL;
  size_t len = 0;
  cr_assert(eq(int, ofl__byte_table_encode(t, &buf, &len), OFL_SUCCESS));
  ofl_byte_table_t *back = NULL;
  for (size_t cut = 0; cut < len; cut++) {
    unsigned char *part = malloc(cut ? cut : 1); /* exact size for ASan */
    memcpy(part, buf, cut);
    cr_assert(
        eq(int, ofl__byte_table_decode(part, cut, 5, &back), OFL_ERR_CORRUPT),
        "cut %zu", cut);
    free(part);
  }
  cr_assert(eq(ptr, back, NULL));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "from rank 5"), NULL)));

  unsigned char *copy = malloc(len + 1);
  /* trailing byte */
  memcpy(copy, buf, len);
  copy[len] = 0;
  cr_assert(eq(int, ofl__byte_table_decode(copy, len + 1, 1, &back),
               OFL_ERR_CORRUPT));
  /* second entry cut to "x": a duplicate of the first, a byte left over */
  memcpy(copy, buf, len);
  copy[12 + 13] = 1;
  copy[12 + 13 + 4] = (unsigned char)'x';
  cr_assert(
      eq(int, ofl__byte_table_decode(copy, len, 1, &back), OFL_ERR_CORRUPT));
  /* control character inside a name */
  memcpy(copy, buf, len);
  copy[12 + 4] = '\n';
  cr_assert(
      eq(int, ofl__byte_table_decode(copy, len, 1, &back), OFL_ERR_CORRUPT));
  /* wrong magic, wrong version */
  memcpy(copy, buf, len);
  copy[0] = 'X';
  cr_assert(
      eq(int, ofl__byte_table_decode(copy, len, 1, &back), OFL_ERR_CORRUPT));
  memcpy(copy, buf, len);
  copy[4] = 2;
  cr_assert(
      eq(int, ofl__byte_table_decode(copy, len, 1, &back), OFL_ERR_CORRUPT));
  cr_assert(eq(ptr, back, NULL));
  free(copy);
  free(buf);
  ofl_byte_table_destroy(t);
}

Test(byte_table, duplicate_name_in_a_buffer_is_corrupt) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_byte_table_t *t = mk();
  cr_assert(eq(int, ofl_byte_table_add(t, "ab", 1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_byte_table_add(t, "ac", 2), OFL_SUCCESS));
  unsigned char *buf = NULL;
  size_t len = 0;
  cr_assert(eq(int, ofl__byte_table_encode(t, &buf, &len), OFL_SUCCESS));
  /* entries at 12 ("ab") and 12 + 14 ("ac"): make the second "ab" */
  cr_assert(eq(int, buf[12 + 14 + 4 + 1], 'c'));
  buf[12 + 14 + 4 + 1] = 'b';
  ofl_byte_table_t *back = NULL;
  cr_assert(
      eq(int, ofl__byte_table_decode(buf, len, 2, &back), OFL_ERR_CORRUPT));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "duplicate"), NULL)));
  cr_assert(eq(ptr, back, NULL));
  free(buf);
  ofl_byte_table_destroy(t);
}
