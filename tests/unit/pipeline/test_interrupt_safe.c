/* The calls a caller that can be interrupted between two of its calls
 * (Python's KeyboardInterrupt) relies on: ofl_manager_group_push_bytes (a
 * group of its own in one call), ofl_manager_commit_open_groups (what a cut
 * step left open, before the reset) and ofl_tensor_destroy_slot (ending a
 * handle and clearing its slot in one call). Data checked byte for byte. */
#include "tests/support/harness.h"

#define KIB ((size_t)1024)

static size_t pool_in_use(ofl_pool_t *p) {
  ofl_pool_stats_t s;
  ofl_pool_get_stats(p, &s);
  return s.in_use_bytes;
}

static int is_host(h_env_t *e) {
  return ofl_device_backend(e->dev) == OFL_BACKEND_HOST;
}

/* One iteration of three tensors, each pushed by group_push_bytes into a
 * group "act" of its own, popped in reverse and checked. copy: the bytes
 * are copied at the push and the source is overwritten at once. */
static void push_bytes_iteration(h_env_t *e, int copy, uint64_t seed) {
  static const size_t sizes[3] = {64 * KIB, 4 * KIB + 3, 256 * KIB};
  ofl_tensor_t *src[3];
  ofl_tag_t tag[3];
  H_OK(ofl_manager_chunk_begin(e->m, 1, 0));
  for (int i = 0; i < 3; i++) {
    src[i] = h_tensor(e, sizes[i], seed + (uint64_t)i);
    H_OK(ofl_stream_synchronize(ofl_device_compute_stream(e->dev), -1));
    ofl_tensor_t *pushed = NULL;
    H_OK(ofl_manager_group_push_bytes(e->m, "act", ofl_tensor_data(src[i]),
                                      sizes[i], copy, &tag[i], &pushed));
    cr_assert(not(eq(ptr, pushed, NULL)));
    cr_assert(not(eq(u64, tag[i], OFL_TAG_INVALID)));
    if (copy) { /* the manager has its own copy: the source may go */
      memset(ofl_tensor_data(src[i]), 0xA5, sizes[i]);
      H_OK(ofl_tensor_destroy(src[i]));
      src[i] = NULL;
    }
  }
  for (int i = 2; i >= 0; i--) {
    H_OK(ofl_manager_group_backward_begin(e->m, "act"));
    cr_assert(eq(sz, h_pop_check(e, tag[i], sizes[i], seed + (uint64_t)i), 0),
              "tensor %d", i);
    H_OK(ofl_manager_group_backward_end(e->m, "act"));
  }
  H_OK(ofl_manager_reset(e->m));
  for (int i = 0; i < 3; i++)
    H_OK(ofl_tensor_destroy(src[i]));
}

Test(interrupt_safe, group_push_bytes_wraps_device_memory_byte_for_byte) {
  h_env_t e;
  h_open(&e, 0, 1);
  for (int it = 0; it < 3; it++) /* the warmup, then steady state */
    push_bytes_iteration(&e, 0, 100 + (uint64_t)it * 10);
  cr_assert(eq(sz, pool_in_use(e.pool), 0));
  h_close(&e);
}

Test(interrupt_safe, group_push_bytes_copies_on_the_host_backend) {
  h_env_t e;
  h_open(&e, 0, 2);
  if (!is_host(&e)) { /* copy needs device memory that is host memory */
    char buf[64];
    ofl_tag_t tag = OFL_TAG_INVALID;
    ofl_tensor_t *pushed = NULL;
    H_OK(ofl_manager_chunk_begin(e.m, 1, 0));
    cr_assert(eq(int,
                 ofl_manager_group_push_bytes(e.m, "act", buf, sizeof buf, 1,
                                              &tag, &pushed),
                 OFL_ERR_INVALID_ARG));
    cr_assert(eq(ptr, pushed, NULL));
    H_OK(ofl_manager_reset(e.m));
    h_close(&e);
    return;
  }
  for (int it = 0; it < 3; it++)
    push_bytes_iteration(&e, 1, 200 + (uint64_t)it * 10);
  cr_assert(eq(sz, pool_in_use(e.pool), 0));
  h_close(&e);
}

Test(interrupt_safe, group_push_bytes_refuses_misuse_and_leaves_no_group_open) {
  h_env_t e;
  h_open(&e, 0, 3);
  ofl_tensor_t *src = h_tensor(&e, 4 * KIB, 7);
  void *d = ofl_tensor_data(src);
  ofl_tag_t tag = OFL_TAG_INVALID;
  ofl_tensor_t *pushed = NULL;
  cr_assert(eq(int, ofl_manager_group_push_bytes(NULL, "act", d, 4 * KIB, 0, &tag, &pushed),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_manager_group_push_bytes(e.m, NULL, d, 4 * KIB, 0, &tag, &pushed),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_manager_group_push_bytes(e.m, "act", NULL, 4 * KIB, 0, &tag, &pushed),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_manager_group_push_bytes(e.m, "act", d, 0, 0, &tag, &pushed),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_manager_group_push_bytes(e.m, "act", d, 4 * KIB, 0, NULL, &pushed),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_manager_group_push_bytes(e.m, "act", d, 4 * KIB, 0, &tag, NULL),
               OFL_ERR_INVALID_ARG));
  /* no chunk begun: the group cannot start, and nothing is left open */
  cr_assert(eq(int, ofl_manager_group_push_bytes(e.m, "act", d, 4 * KIB, 0, &tag, &pushed),
               OFL_ERR_INVALID_USAGE));
  cr_assert(eq(ptr, pushed, NULL));
  cr_assert(eq(u64, tag, OFL_TAG_INVALID));
  size_t n = 99;
  H_OK(ofl_manager_commit_open_groups(e.m, &n));
  cr_assert(eq(sz, n, 0));
  H_OK(ofl_manager_reset(e.m));
  /* inside an open group of another name: nested, committed on its own */
  H_OK(ofl_manager_chunk_begin(e.m, 1, 0));
  H_OK(ofl_manager_group_start(e.m, "outer"));
  H_OK(ofl_manager_group_push_bytes(e.m, "act", d, 4 * KIB, 0, &tag, &pushed));
  H_OK(ofl_manager_commit_open_groups(e.m, &n));
  cr_assert(eq(sz, n, 1), "only the outer group was left open");
  H_OK(ofl_manager_reset(e.m));
  /* copy 0 wrapped src's bytes: they must outlive the D2H copy, which the
   * reset does not wait for (include/ofl/manager.h) */
  H_OK(ofl_manager_synchronize(e.m, OFL_TIMEOUT_DEFAULT));
  H_OK(ofl_tensor_destroy(src));
  h_close(&e);
}

/* A step cut with two nested groups open: reset refuses, commit_open_groups
 * closes them, the reset runs, and the next iterations are intact. */
Test(interrupt_safe, commit_open_groups_lets_the_reset_after_a_cut_step_run) {
  h_env_t e;
  h_open(&e, 0, 4);
  ofl_tensor_t *keep[2];
  ofl_tag_t tag[2];
  /* the warmup: outer { t0, inner { t1 } } */
  for (int it = 0; it < 3; it++) {
    uint64_t seed = 300 + (uint64_t)it * 10;
    H_OK(ofl_manager_chunk_begin(e.m, 1, 0));
    H_OK(ofl_manager_group_start(e.m, "outer"));
    keep[0] = h_tensor(&e, 32 * KIB, seed);
    H_OK(ofl_manager_tensor_push(e.m, keep[0], &tag[0]));
    H_OK(ofl_manager_group_start(e.m, "inner"));
    keep[1] = h_tensor(&e, 16 * KIB, seed + 1);
    H_OK(ofl_manager_tensor_push(e.m, keep[1], &tag[1]));
    if (it == 1) { /* cut here: both groups open */
      cr_assert(eq(int, ofl_manager_reset(e.m), OFL_ERR_INVALID_USAGE));
      size_t n = 0;
      H_OK(ofl_manager_commit_open_groups(e.m, &n));
      cr_assert(eq(sz, n, 2));
      H_OK(ofl_manager_commit_open_groups(e.m, &n)); /* a second time: none */
      cr_assert(eq(sz, n, 0));
      H_OK(ofl_manager_commit_open_groups(e.m, NULL));
      ofl_manager_reset(e.m); /* may report the structure: it runs */
      continue;
    }
    H_OK(ofl_manager_group_commit(e.m, "inner", NULL, 0, 0));
    H_OK(ofl_manager_group_commit(e.m, "outer", NULL, 0, 0));
    H_OK(ofl_manager_group_backward_begin(e.m, "outer"));
    H_OK(ofl_manager_group_backward_begin(e.m, "inner"));
    cr_assert(eq(sz, h_pop_check(&e, tag[1], 16 * KIB, seed + 1), 0));
    H_OK(ofl_manager_group_backward_end(e.m, "inner"));
    cr_assert(eq(sz, h_pop_check(&e, tag[0], 32 * KIB, seed), 0));
    H_OK(ofl_manager_group_backward_end(e.m, "outer"));
    H_OK(ofl_manager_reset(e.m));
  }
  cr_assert(eq(sz, pool_in_use(e.pool), 0), "every block back in the pool");
  cr_assert(eq(int, ofl_manager_commit_open_groups(NULL, NULL), OFL_ERR_INVALID_ARG));
  h_close(&e);
}

Test(interrupt_safe, tensor_destroy_slot_ends_once_and_clears_the_slot) {
  h_env_t e;
  h_open(&e, 0, 5);
  H_OK(ofl_tensor_destroy_slot(NULL, NULL));
  ofl_tensor_t *slot = NULL;
  H_OK(ofl_tensor_destroy_slot(&slot, NULL));
  slot = h_tensor(&e, 8 * KIB, 9);
  cr_assert(eq(sz, pool_in_use(e.pool), 8 * KIB));
  H_OK(ofl_tensor_destroy_slot(&slot, NULL));
  cr_assert(eq(ptr, slot, NULL));
  cr_assert(eq(sz, pool_in_use(e.pool), 0));
  H_OK(ofl_tensor_destroy_slot(&slot, NULL)); /* again: nothing */
  /* ordered after the compute stream's work */
  slot = h_tensor(&e, 8 * KIB, 10);
  H_OK(ofl_tensor_destroy_slot(&slot, ofl_device_compute_stream(e.dev)));
  cr_assert(eq(ptr, slot, NULL));
  H_OK(ofl_stream_synchronize(ofl_device_compute_stream(e.dev), -1));
  h_close(&e);
}
