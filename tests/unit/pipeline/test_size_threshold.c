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

/* One iteration of two layers, each with group "attn" (a shape-keyed f32
 * tensor of 2048 elements, always over the threshold) and group "moe" (a
 * byte-keyed tensor of moe_bytes, a name in dynamic_groups), pushed, popped
 * in reverse and checked byte for byte. The steady policy keeps each name's
 * last group; the first layer's go out and back. */
static void moe_iteration(h_env_t *e, size_t moe_bytes, uint64_t seed) {
  int64_t s1[1] = {2048}, s2[1] = {(int64_t)moe_bytes};
  ofl_tag_t ta[2], tb[2];
  H_OK(ofl_manager_chunk_begin(e->m, 1, 0));
  for (int l = 0; l < 2; l++) {
    ofl_tensor_t *a = NULL, *b = NULL;
    H_OK(ofl_pool_alloc(e->pool, s1, 1, OFL_DTYPE_F32, NULL, &a));
    H_OK(ofl_pool_alloc_dynamic(e->pool, s2, 1, OFL_DTYPE_U8, NULL, &b));
    H_OK(t_tensor_fill(e->dev, a, 8192, seed + 4 * (uint64_t)l));
    H_OK(t_tensor_fill(e->dev, b, moe_bytes, seed + 4 * (uint64_t)l + 1));
    H_OK(ofl_manager_group_start(e->m, "attn"));
    H_OK(ofl_manager_tensor_push(e->m, a, &ta[l]));
    H_OK(ofl_manager_group_commit(e->m, "attn", NULL, 0, 0));
    H_OK(ofl_manager_group_start(e->m, "moe"));
    H_OK(ofl_manager_tensor_push(e->m, b, &tb[l]));
    H_OK(ofl_manager_group_commit(e->m, "moe", NULL, 0, 0));
  }
  for (int l = 1; l >= 0; l--) {
    uint64_t sd = seed + 4 * (uint64_t)l;
    H_OK(ofl_manager_group_backward_begin(e->m, "moe"));
    cr_assert(eq(sz, h_pop_check(e, tb[l], moe_bytes, sd + 1), 0));
    H_OK(ofl_manager_group_backward_end(e->m, "moe"));
    H_OK(ofl_manager_group_backward_begin(e->m, "attn"));
    cr_assert(eq(sz, h_pop_check(e, ta[l], 8192, sd), 0));
    H_OK(ofl_manager_group_backward_end(e->m, "attn"));
  }
  H_OK(ofl_manager_reset(e->m));
}

/* A dynamic name whose sizes straddle the threshold: under it through the
 * warmup and the reload pool's learning, over it later. Its first reload is
 * the reload pool's first byte-keyed block; before the pool knew of the
 * name it switched to segments there, one backend allocation in a steady
 * iteration. */
Test(pipeline_size_threshold,
     a_dynamic_name_first_over_the_threshold_after_learning_makes_no_call) {
  h_env_t e;
  h_open_dev(&e, 0, 34);
  ofl_manager_params_t mp = h_params(&e);
  mp.device_pool = NULL; /* the manager's own reload pool */
  mp.min_offload_elems = 0;
  mp.min_offload_bytes = 4096;
  mp.dynamic_groups = "moe";
  H_OK(ofl_manager_create(&mp, &e.m));
  ofl_pool_t *reload = ofl_manager_device_pool(e.m);
  cr_assert(ne(ptr, reload, e.pool));
  uint64_t seed = 100;
  for (int it = 0; it < 16; it++, seed += 8)
    moe_iteration(&e, 2048 + (size_t)it * 97, seed); /* under 4096 */
  ofl_pool_stats_t before, after;
  ofl_pool_get_stats(reload, &before);
  cr_assert(ne(u64, before.learned_iteration, 0),
            "the reload pool still learns after 16 iterations");
  ofl_manager_stats_t ms0, ms1;
  ofl_manager_get_stats(e.m, &ms0);
  for (int it = 0; it < 2000; it++, seed += 8)
    moe_iteration(&e, 4096 + (size_t)(it * 613) % 8000, seed);
  ofl_pool_get_stats(reload, &after);
  ofl_manager_get_stats(e.m, &ms1);
  /* The first layer's two tensors of every later iteration went out and
   * back, "moe" included. */
  cr_assert(eq(u64, ms1.offloaded_tensors - ms0.offloaded_tensors, 4000));
  cr_assert(eq(u64, after.backend_allocs, before.backend_allocs),
            "reload pool: %llu backend allocations after its learning",
            (unsigned long long)(after.backend_allocs - before.backend_allocs));
  cr_assert(eq(u64, after.backend_frees, before.backend_frees));
  cr_assert(eq(u64, after.segments, before.segments));
  cr_assert(eq(sz, after.held_bytes, before.held_bytes));
  h_close(&e);
}
