/* The summary: union of names across ranks, rows for empty ranks, totals,
 * accessors, the gather over a self comm, and the comm entry points that
 * need no second process. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "collectives/comm_internal.h"

static ofl_byte_table_t *table(const char *const *names, const uint64_t *bytes,
                               size_t n) {
  ofl_byte_table_t *t = NULL;
  cr_assert(eq(int, ofl_byte_table_create(&t), OFL_SUCCESS));
  for (size_t i = 0; i < n; i++)
    cr_assert(eq(int, ofl_byte_table_add(t, names[i], bytes[i]), OFL_SUCCESS));
  return t;
}

Test(summary, union_of_names_with_zero_cells_and_totals) {
  const char *n0[] = {"mlp_norm", "core_attn"};
  const uint64_t b0[] = {100, 200};
  const char *n2[] = {"expert_fc1", "core_attn", "attn_norm"};
  const uint64_t b2[] = {1, 2, 4};
  ofl_byte_table_t *t0 = table(n0, b0, 2), *t1 = table(NULL, NULL, 0),
                   *t2 = table(n2, b2, 3);
  const ofl_byte_table_t *tabs[] = {t0, t1, t2, NULL};
  ofl_summary_t *s = NULL;
  cr_assert(eq(int, ofl_summary_from_tables(tabs, 4, &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_summary_nranks(s), 4));
  const char *groups[] = {"attn_norm", "core_attn", "expert_fc1", "mlp_norm"};
  const uint64_t cells[4][4] = {
      {0, 200, 0, 100}, {0, 0, 0, 0}, {4, 2, 1, 0}, {0, 0, 0, 0}};
  cr_assert(eq(sz, ofl_summary_ngroups(s), 4));
  for (size_t g = 0; g < 4; g++) {
    cr_assert(eq(str, (char *)ofl_summary_group_name(s, g), (char *)groups[g]));
    size_t at = 99;
    cr_assert(eq(int, ofl_summary_find_group(s, groups[g], &at), OFL_SUCCESS));
    cr_assert(eq(sz, at, g));
    uint64_t col = 0;
    for (int r = 0; r < 4; r++) {
      cr_assert(eq(u64, ofl_summary_bytes(s, r, g), cells[r][g]));
      col += cells[r][g];
    }
    cr_assert(eq(u64, ofl_summary_group_total(s, g), col));
  }
  const uint64_t rows[] = {300, 0, 7, 0};
  for (int r = 0; r < 4; r++)
    cr_assert(eq(u64, ofl_summary_rank_total(s, r), rows[r]));
  cr_assert(eq(u64, ofl_summary_total(s), 307));
  /* out of range reads are zero / NULL, never a crash */
  cr_assert(eq(u64, ofl_summary_bytes(s, 4, 0), 0));
  cr_assert(eq(u64, ofl_summary_bytes(s, -1, 0), 0));
  cr_assert(eq(u64, ofl_summary_bytes(s, 0, 4), 0));
  cr_assert(eq(ptr, (void *)ofl_summary_group_name(s, 4), NULL));
  cr_assert(eq(u64, ofl_summary_rank_total(s, 9), 0));
  ofl_log_set_level(OFL_LOG_NONE);
  size_t at = 77;
  cr_assert(eq(int, ofl_summary_find_group(s, "qkv_linear", &at),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(sz, at, 77));
  ofl_summary_destroy(s);
  ofl_byte_table_destroy(t0);
  ofl_byte_table_destroy(t1);
  ofl_byte_table_destroy(t2);
}

Test(summary, totals_beyond_64_bits_are_rejected) {
  ofl_log_set_level(OFL_LOG_NONE);
  const char *n[] = {"a"};
  const uint64_t big[] = {UINT64_MAX / 2 + 1};
  ofl_byte_table_t *t = table(n, big, 1);
  const ofl_byte_table_t *tabs[] = {t, t};
  ofl_summary_t *s = (ofl_summary_t *)0x1;
  cr_assert(eq(int, ofl_summary_from_tables(tabs, 2, &s), OFL_ERR_INVALID_ARG));
  cr_assert(eq(ptr, s, (ofl_summary_t *)0x1));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "exceeds 64 bits"), NULL)));
  cr_assert(eq(int, ofl_summary_from_tables(tabs, 0, &s), OFL_ERR_INVALID_ARG));
  ofl_byte_table_destroy(t);
}

Test(summary, gather_over_self_gives_one_row_equal_to_the_local_table) {
  const char *n[] = {"qkv_linear", "attn_proj"};
  const uint64_t b[] = {4096, 8192};
  ofl_byte_table_t *t = table(n, b, 2);
  for (int mode = 0; mode < 3; mode++) {
    ofl_comm_t *comm = NULL;
    if (mode > 0)
      cr_assert(eq(int, ofl_comm_create_self(NULL, &comm), OFL_SUCCESS));
    ofl_summary_t *s = NULL;
    cr_assert(eq(int, ofl_summary_gather(comm, t, mode == 2, &s), OFL_SUCCESS));
    cr_assert(not(eq(ptr, s, NULL)));
    cr_assert(eq(int, ofl_summary_nranks(s), 1));
    cr_assert(eq(sz, ofl_summary_ngroups(s), 2));
    cr_assert(eq(str, (char *)ofl_summary_group_name(s, 0), "attn_proj"));
    cr_assert(eq(u64, ofl_summary_bytes(s, 0, 0), 8192));
    cr_assert(eq(u64, ofl_summary_bytes(s, 0, 1), 4096));
    cr_assert(eq(u64, ofl_summary_total(s), 12288));
    ofl_summary_destroy(s);
    ofl_comm_destroy(comm);
  }
  /* a rank with nothing to report still has a row */
  ofl_summary_t *s = NULL;
  cr_assert(eq(int, ofl_summary_gather(NULL, NULL, 0, &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_summary_nranks(s), 1));
  cr_assert(eq(sz, ofl_summary_ngroups(s), 0));
  ofl_summary_destroy(s);
  ofl_byte_table_destroy(t);
}

Test(summary, self_comm_reports_rank_size_kind_and_timeout) {
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = 1234;
  ofl_comm_t *c = NULL;
  cr_assert(eq(int, ofl_comm_create_self(&p, &c), OFL_SUCCESS));
  cr_assert(eq(int, ofl_comm_rank(c), 0));
  cr_assert(eq(int, ofl_comm_size(c), 1));
  cr_assert(eq(int, ofl_comm_kind(c), OFL_COMM_SELF));
  cr_assert(eq(str, (char *)ofl_comm_kind_name(ofl_comm_kind(c)), "self"));
  cr_assert(eq(i64, ofl_comm_timeout_ms(c), 1234));
  cr_assert(eq(int, ofl_comm_is_broken(c), 0));
  cr_assert(eq(int, ofl_comm_barrier(c), OFL_SUCCESS));
  ofl_comm_destroy(c);
  /* the default comes from OFL_WAIT_TIMEOUT_MS */
  cr_assert(eq(int, ofl_comm_create_self(NULL, &c), OFL_SUCCESS));
  cr_assert(eq(i64, ofl_comm_timeout_ms(c), 120000));
  ofl_comm_destroy(c);
  cr_assert(eq(int, ofl_comm_rank(NULL), -1));
  cr_assert(eq(int, ofl_comm_size(NULL), 0));
  ofl_comm_destroy(NULL);
}

Test(summary, mpi_and_nccl_constructors_check_their_arguments) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_comm_t *c = (ofl_comm_t *)0x1;
#if OFL_HAVE_MPI
  /* This process never called MPI_Init. */
  long dummy = 0;
  cr_assert(eq(int, ofl_comm_create_mpi_handle(&dummy, NULL, &c),
               OFL_ERR_INVALID_USAGE));
  cr_assert(
      not(eq(ptr, strstr(ofl_last_error(), "MPI is not initialized"), NULL)));
  cr_assert(
      eq(int, ofl_comm_create_mpi_handle(NULL, NULL, &c), OFL_ERR_INVALID_ARG));
#else
  cr_assert(eq(int, ofl_comm_create_mpi_handle(NULL, NULL, &c),
               OFL_ERR_NOT_SUPPORTED));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "no MPI support"), NULL)));
#endif
#if OFL_HAVE_NCCL
  void *none = NULL;
  cr_assert(eq(int, ofl_comm_create_nccl_handle(&none, NULL, NULL, &c),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_comm_create_nccl_handle(NULL, NULL, NULL, &c),
               OFL_ERR_INVALID_ARG));
#else
  cr_assert(eq(int, ofl_comm_create_nccl_handle(NULL, NULL, NULL, &c),
               OFL_ERR_NOT_SUPPORTED));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "no NCCL support"), NULL)));
#endif
  cr_assert(eq(ptr, c, (ofl_comm_t *)0x1));
  cr_assert(eq(int, ofl_comm_barrier(NULL), OFL_ERR_INVALID_ARG));
  cr_assert(
      eq(int, ofl_summary_gather(NULL, NULL, 0, NULL), OFL_ERR_INVALID_ARG));
}

Test(summary, broken_comm_refuses_further_operations) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl_comm_t *c = NULL;
  cr_assert(eq(int, ofl_comm_create_self(NULL, &c), OFL_SUCCESS));
  c->broken = true; /* as after a timeout */
  ofl_summary_t *s = (ofl_summary_t *)0x1;
  cr_assert(eq(int, ofl_summary_gather(c, NULL, 0, &s), OFL_ERR_INVALID_USAGE));
  cr_assert(eq(ptr, s, (ofl_summary_t *)0x1));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "create a new one"), NULL)));
  cr_assert(eq(int, ofl_comm_barrier(c), OFL_ERR_INVALID_USAGE));
  cr_assert(eq(int, ofl_comm_is_broken(c), 1));
  ofl_comm_destroy(c);
}

Test(summary, gather_reply_encoding_round_trips_and_rejects_damage) {
  ofl_log_set_level(OFL_LOG_NONE);
  ofl__blobs_t b;
  cr_assert(eq(int, ofl__blobs_alloc(&b, 3), OFL_SUCCESS));
  b.lens[0] = 3;
  b.lens[1] = 0;
  b.lens[2] = 5;
  cr_assert(eq(int, ofl__blobs_pack(&b), OFL_SUCCESS));
  memcpy(b.data + b.offsets[0], "abc", 3);
  memcpy(b.data + b.offsets[2], "hello", 5);
  unsigned char *enc = NULL;
  size_t len = 0;
  cr_assert(eq(int, ofl__blobs_encode(&b, &enc, &len), OFL_SUCCESS));
  cr_assert(eq(sz, len, 4 + 3 * 8 + 8));
  ofl__blobs_t d;
  cr_assert(eq(int, ofl__blobs_decode(enc, len, 3, &d), OFL_SUCCESS));
  cr_assert(eq(int, d.nranks, 3));
  for (int r = 0; r < 3; r++) {
    cr_assert(eq(sz, d.lens[r], b.lens[r]));
    cr_assert(
        eq(int, memcmp(d.data + d.offsets[r], b.data + b.offsets[r], b.lens[r]),
           0));
  }
  ofl__blobs_free(&d);
  cr_assert(eq(int, ofl__blobs_decode(enc, len, 2, &d), OFL_ERR_CORRUPT));
  for (size_t cut = 0; cut < len; cut++)
    cr_assert(eq(int, ofl__blobs_decode(enc, cut, 3, &d), OFL_ERR_CORRUPT),
              "cut %zu", cut);
  free(enc);
  ofl__blobs_free(&b);
}
