/* A warmup whose every tensor the size threshold keeps on the device says
 * so at WARN (how many tensors and bytes, which setting to lower); one that
 * offloads something reports the kept ones at INFO only, naming the
 * threshold that applied. */
#include "tests/support/harness.h"

typedef struct {
  int warnings;
  char warn[2048];
  char info[2048];
} capture_t;

static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  (void)subsys;
  capture_t *c = user;
  if (level == OFL_LOG_WARN) {
    c->warnings++;
    snprintf(c->warn, sizeof c->warn, "%s", msg);
  } else if (level == OFL_LOG_INFO && strstr(msg, "size threshold")) {
    snprintf(c->info, sizeof c->info, "%s", msg);
  }
}

/* One warmup iteration of one chunk, one group, two f32 tensors of n1 and
 * n2 elements, under mp's thresholds; returns the bytes offloaded. */
static uint64_t warmup(ofl_manager_params_t mp, h_env_t *e, int64_t n1,
                       int64_t n2) {
  H_OK(ofl_manager_create(&mp, &e->m));
  int64_t s1[1] = {n1}, s2[1] = {n2};
  ofl_tensor_t *a = NULL, *b = NULL;
  H_OK(ofl_pool_alloc(e->pool, s1, 1, OFL_DTYPE_F32, NULL, &a));
  H_OK(ofl_pool_alloc(e->pool, s2, 1, OFL_DTYPE_F32, NULL, &b));
  H_OK(t_tensor_fill(e->dev, a, (size_t)n1 * 4, 1));
  H_OK(t_tensor_fill(e->dev, b, (size_t)n2 * 4, 2));
  ofl_tag_t ta, tb;
  H_OK(ofl_manager_chunk_begin(e->m, 1, 0));
  H_OK(ofl_manager_group_start(e->m, "core_attn"));
  H_OK(ofl_manager_tensor_push(e->m, a, &ta));
  H_OK(ofl_manager_tensor_push(e->m, b, &tb));
  H_OK(ofl_manager_group_commit(e->m, "core_attn", NULL, 0, 0));
  H_OK(ofl_manager_group_backward_begin(e->m, "core_attn"));
  ofl_tensor_t *o = NULL;
  H_OK(ofl_manager_tensor_pop(e->m, tb, &o));
  H_OK(ofl_tensor_destroy(o));
  H_OK(ofl_manager_tensor_pop(e->m, ta, &o));
  H_OK(ofl_tensor_destroy(o));
  H_OK(ofl_manager_group_backward_end(e->m, "core_attn"));
  H_OK(ofl_manager_reset(e->m)); /* ends the warmup */
  ofl_manager_stats_t s;
  ofl_manager_get_stats(e->m, &s);
  return s.offloaded_bytes;
}

Test(pipeline_size_threshold, all_kept_for_size_is_one_warning_naming_the_setting) {
  h_env_t e;
  h_open_dev(&e, 0, 31);
  ofl_manager_params_t mp = h_params(&e);
  mp.min_offload_bytes = 0;
  mp.min_offload_elems = 1048576; /* the default */
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_INFO);
  ofl_log_set_handler(capture, &c);
  uint64_t off = warmup(mp, &e, 256, 512);
  ofl_log_set_handler(NULL, NULL);
  ofl_log_set_level(OFL_LOG_WARN);
  cr_assert(eq(u64, off, 0));
  cr_assert(eq(int, c.warnings, 1), "%s", c.warn);
  cr_assert(ne(ptr,
               strstr(c.warn, "warmup offloaded nothing: 2 tensors (3072 "
                              "bytes) stayed on the device"),
               NULL),
            "%s", c.warn);
  cr_assert(ne(ptr, strstr(c.warn, "min_offload_elems 1048576"), NULL), "%s",
            c.warn);
  cr_assert(ne(ptr, strstr(c.warn, "lower it (params.min_offload_elems or "
                                   "OFL_MIN_OFFLOAD_ELEMS; from ofl.torch "
                                   "min_offload_size=, or "
                                   "min_offloaded_tensor_size= in Megatron's "
                                   "calls)"),
               NULL),
            "%s", c.warn);
  ofl_manager_destroy(e.m);
  e.m = NULL;
  /* A byte threshold names the byte setting. */
  mp.min_offload_bytes = 1 << 20;
  c = (capture_t){0};
  ofl_log_set_handler(capture, &c);
  off = warmup(mp, &e, 256, 512);
  ofl_log_set_handler(NULL, NULL);
  cr_assert(eq(u64, off, 0));
  cr_assert(eq(int, c.warnings, 1), "%s", c.warn);
  cr_assert(ne(ptr, strstr(c.warn, "min_offload_bytes 1048576"), NULL), "%s",
            c.warn);
  cr_assert(ne(ptr, strstr(c.warn, "OFL_MIN_OFFLOAD_BYTES; from ofl.torch "),
               NULL),
            "%s", c.warn);
  cr_assert(ne(ptr, strstr(c.warn, "in Megatron's calls) to offload them"),
               NULL),
            "%s", c.warn);
  h_close(&e);
}

Test(pipeline_size_threshold, some_offloaded_is_info_with_the_threshold) {
  h_env_t e;
  h_open_dev(&e, 0, 32);
  ofl_manager_params_t mp = h_params(&e);
  mp.min_offload_bytes = 0;
  mp.min_offload_elems = 1024;
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_INFO);
  ofl_log_set_handler(capture, &c);
  uint64_t off = warmup(mp, &e, 256, 2048);
  ofl_log_set_handler(NULL, NULL);
  ofl_log_set_level(OFL_LOG_WARN);
  cr_assert(eq(u64, off, 8192));
  cr_assert(eq(int, c.warnings, 0), "%s", c.warn);
  cr_assert(ne(ptr,
               strstr(c.info, "1 tensors (1024 bytes) stay on the device "
                              "for their size, each under the size threshold "
                              "min_offload_elems 1024 (OFL_MIN_OFFLOAD_ELEMS"),
               NULL),
            "%s", c.info);
  cr_assert(eq(ptr, strstr(c.info, "under 0 bytes"), NULL), "%s", c.info);
  h_close(&e);
}

Test(pipeline_size_threshold, offload_off_says_nothing_of_sizes) {
  h_env_t e;
  h_open_dev(&e, 0, 33);
  ofl_manager_params_t mp = h_params(&e);
  mp.offload = 0;
  mp.min_offload_bytes = 0;
  mp.min_offload_elems = 1048576;
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_INFO);
  ofl_log_set_handler(capture, &c);
  warmup(mp, &e, 256, 512);
  ofl_log_set_handler(NULL, NULL);
  ofl_log_set_level(OFL_LOG_WARN);
  cr_assert(eq(int, c.warnings, 0), "%s", c.warn);
  h_close(&e);
}
