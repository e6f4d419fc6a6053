/* Contracts a program should never have to guess: a prefetch that finds no
 * device memory, a pop that retries, popped tensors outliving their
 * manager, tags of another manager, pushes of memory that is not the
 * device's, the end of warmup with offload off, the end-of-warmup report,
 * the steady-state plan and its peak. */
#include <ofl/log.h>

#include "tests/support/harness.h"

#define KIB ((size_t)1024)

static ofl_manager_stats_t stats(h_env_t *e) {
  ofl_manager_stats_t st;
  ofl_manager_get_stats(e->m, &st);
  return st;
}

static size_t in_use(ofl_device_t *dev) {
  ofl_device_stats_t ds;
  ofl_device_get_stats(dev, &ds);
  return ds.device_bytes_in_use;
}

/* ---- item 1: a prefetch without device memory ------------------------------
 * One chunk, three 64 KiB groups (A, B, C in forward order), a reload pool
 * of two blocks, and the application holding each popped tensor until the
 * next group's backward has ended. */

typedef struct {
  h_env_t e;
  ofl_pool_t *reload;
  ofl_tag_t tag[3];
} small_env_t;

static const char *const abc[3] = {"attn_norm", "core_attn", "mlp_norm"};

static void small_open(small_env_t *s, uint64_t seed) {
  h_open_dev(&s->e, 10, seed);
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.name = "reload";
  pp.budget_bytes = 2 * 64 * KIB;
  H_OK(ofl_pool_create(s->e.dev, &pp, &s->reload));
  ofl_manager_params_t mp = h_params(&s->e);
  mp.device_pool = s->reload;
  mp.prefetch_groups = 1;
  H_OK(ofl_manager_create(&mp, &s->e.m));
  H_OK(ofl_manager_chunk_begin(s->e.m, 1, 0));
  for (int g = 0; g < 3; g++) {
    H_OK(ofl_manager_group_start(s->e.m, abc[g]));
    H_OK(ofl_manager_tensor_push(s->e.m, h_tensor(&s->e, 64 * KIB, 100 + g),
                                 &s->tag[g]));
    H_OK(ofl_manager_group_commit(s->e.m, abc[g], NULL, 0, 0));
  }
}

static void small_close(small_env_t *s) {
  ofl_manager_destroy(s->e.m);
  s->e.m = NULL;
  ofl_pool_destroy(s->reload);
  h_close(&s->e);
}

/* Pops tag of group g and checks its bytes (the tensor is kept). */
static ofl_tensor_t *pop_checked(small_env_t *s, int g) {
  ofl_tensor_t *t = NULL;
  H_OK(ofl_manager_tensor_pop(s->e.m, s->tag[g], &t));
  cr_assert(eq(sz, h_wrong(&s->e, t, 64 * KIB, 100 + (uint64_t)g), 0));
  return t;
}

Test(pipeline_contracts, a_prefetch_without_device_memory_never_fails) {
  small_env_t s;
  small_open(&s, 1);
  H_OK(ofl_manager_group_backward_begin(s.e.m, abc[2]));
  ofl_tensor_t *c = pop_checked(&s, 2); /* inline: reload block 1 */
  H_OK(ofl_manager_group_backward_end(s.e.m, abc[2])); /* B: block 2 */
  H_OK(ofl_manager_group_backward_begin(s.e.m, abc[1]));
  ofl_tensor_t *b = pop_checked(&s, 1);
  /* The prefetch of A finds both blocks held: the call still succeeds. */
  H_OK(ofl_manager_group_backward_end(s.e.m, abc[1]));
  H_OK(ofl_tensor_destroy(c));
  H_OK(ofl_manager_group_backward_begin(s.e.m, abc[0]));
  ofl_tensor_t *a = pop_checked(&s, 0); /* reloaded at its pop */
  H_OK(ofl_manager_group_backward_end(s.e.m, abc[0]));
  H_OK(ofl_tensor_destroy(b));
  H_OK(ofl_tensor_destroy(a));
  ofl_manager_stats_t st = stats(&s.e);
  cr_assert(eq(u64, st.inline_reloads, 2));
  cr_assert(eq(u64, st.reloaded_tensors, 3));
  H_OK(ofl_manager_reset(s.e.m));
  small_close(&s);
}

Test(pipeline_contracts, a_pop_without_device_memory_can_be_retried) {
  small_env_t s;
  small_open(&s, 2);
  H_OK(ofl_manager_group_backward_begin(s.e.m, abc[2]));
  ofl_tensor_t *c = pop_checked(&s, 2);
  H_OK(ofl_manager_group_backward_end(s.e.m, abc[2]));
  H_OK(ofl_manager_group_backward_begin(s.e.m, abc[1]));
  ofl_tensor_t *b = pop_checked(&s, 1);
  H_OK(ofl_manager_group_backward_end(s.e.m, abc[1]));
  H_OK(ofl_manager_group_backward_begin(s.e.m, abc[0]));
  /* Both blocks still held: the pop says so and changes nothing. */
  ofl_tensor_t *a = NULL;
  cr_assert(
      eq(int, ofl_manager_tensor_pop(s.e.m, s.tag[0], &a), OFL_ERR_NO_MEMORY));
  cr_assert(eq(ptr, a, NULL));
  cr_assert(
      not(eq(ptr, strstr(ofl_last_error(), "pop the same tag again"), NULL)),
      "%s", ofl_last_error());
  H_OK(ofl_tensor_destroy(c));
  a = pop_checked(&s, 0); /* the same tag, now with a free block */
  H_OK(ofl_manager_group_backward_end(s.e.m, abc[0]));
  cr_assert(eq(int, ofl_manager_tensor_pop(s.e.m, s.tag[0], &a),
               OFL_ERR_INVALID_USAGE)); /* it popped once */
  H_OK(ofl_tensor_destroy(b));
  H_OK(ofl_tensor_destroy(a));
  H_OK(ofl_manager_reset(s.e.m));
  cr_assert(eq(u64, stats(&s.e).unpopped_tensors, 0));
  small_close(&s);
}

/* ---- item 3: a popped tensor outlives its manager ---------------------------
 */

Test(pipeline_contracts, a_popped_tensor_outlives_its_manager) {
  h_env_t e;
  h_open_dev(&e, 10, 3);
  ofl_tensor_t *x = h_tensor(&e, 64 * KIB, 31);
  size_t before = in_use(e.dev);
  ofl_manager_params_t mp = h_params(&e);
  mp.device_pool = NULL; /* the manager's own reload pool, as _get does */
  H_OK(ofl_manager_create(&mp, &e.m));
  ofl_tag_t tag;
  H_OK(ofl_manager_chunk_begin(e.m, 1, 0));
  H_OK(ofl_manager_group_start(e.m, "core_attn"));
  H_OK(ofl_manager_tensor_push(e.m, x, &tag));
  H_OK(ofl_manager_group_commit(e.m, "core_attn", NULL, 0, 0));
  H_OK(ofl_manager_group_backward_begin(e.m, "core_attn"));
  ofl_tensor_t *t = NULL;
  H_OK(ofl_manager_tensor_pop(e.m, tag, &t));
  H_OK(ofl_manager_group_backward_end(e.m, "core_attn"));
  /* Its storage is a block of the manager's pool, not of the pool the
   * tensor came from. */
  cr_assert(eq(ptr, ofl_tensor_pool(t), ofl_manager_device_pool(e.m)));
  cr_assert(eq(int, ofl_pool_free(e.pool, t), OFL_ERR_INVALID_ARG));
  H_OK(ofl_manager_reset(e.m));
  ofl_manager_destroy(e.m);
  e.m = NULL;
  cr_assert(ofl_tensor_has_storage(t));
  cr_assert(eq(sz, h_wrong(&e, t, 64 * KIB, 31), 0));
  H_OK(ofl_tensor_destroy(t));
  /* The reload pool went with its last block. */
  cr_assert(eq(sz, in_use(e.dev), before));
  h_close(&e);
}

/* ---- item 4: tags name their manager ----------------------------------------
 */

Test(pipeline_contracts, a_tag_of_another_manager_is_refused) {
  h_env_t e;
  h_open(&e, 10, 4);
  ofl_manager_params_t mp = h_params(&e);
  ofl_manager_t *m2 = NULL;
  H_OK(ofl_manager_create(&mp, &m2));
  ofl_manager_t *ms[2] = {e.m, m2};
  ofl_tag_t tag[2], held[2];
  for (int i = 0; i < 2; i++) {
    H_OK(ofl_manager_chunk_begin(ms[i], 1, 0));
    H_OK(ofl_manager_group_start(ms[i], "core_attn"));
    H_OK(ofl_manager_tensor_push(ms[i], h_tensor(&e, 16 * KIB, 40 + i),
                                 &tag[i]));
    H_OK(ofl_manager_group_commit(ms[i], "core_attn", NULL, 0, 0));
    H_OK(ofl_manager_tensor_push(ms[i], h_tensor(&e, 16 * KIB, 50 + i),
                                 &held[i])); /* outside any group */
  }
  cr_assert(not(eq(u64, tag[0], tag[1])));
  cr_assert(not(eq(u64, held[0], held[1])));
  for (int i = 0; i < 2; i++) {
    H_OK(ofl_manager_group_backward_begin(ms[i], "core_attn"));
    ofl_tensor_t *t = NULL;
    ofl_tag_t foreign[2] = {tag[1 - i], held[1 - i]};
    for (int k = 0; k < 2; k++) {
      cr_assert(eq(int, ofl_manager_tensor_pop(ms[i], foreign[k], &t),
                   OFL_ERR_INVALID_ARG));
      cr_assert(eq(ptr, t, NULL));
      char hex[32];
      snprintf(hex, sizeof hex, "0x%llx", (unsigned long long)foreign[k]);
      cr_assert(not(eq(ptr, strstr(ofl_last_error(), hex), NULL)), "%s",
                ofl_last_error());
      cr_assert(not(eq(ptr, strstr(ofl_last_error(), "another manager"), NULL)),
                "%s", ofl_last_error());
    }
    /* Its own tags still pop, with their own bytes. */
    e.m = ms[i];
    cr_assert(eq(sz, h_pop_check(&e, tag[i], 16 * KIB, 40 + (uint64_t)i), 0));
    cr_assert(eq(sz, h_pop_check(&e, held[i], 16 * KIB, 50 + (uint64_t)i), 0));
    H_OK(ofl_manager_group_backward_end(ms[i], "core_attn"));
    H_OK(ofl_manager_reset(ms[i]));
  }
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_manager_tensor_pop(m2, OFL_TAG_INVALID, &t),
               OFL_ERR_INVALID_ARG));
  e.m = ms[0];
  ofl_manager_destroy(m2);
  h_close(&e);
}

/* ---- item 6: only memory of the manager's device is pushed -----------------
 */

static void push_refused(h_env_t *e, ofl_tensor_t *t) {
  H_OK(ofl_manager_chunk_begin(e->m, 1, 0));
  H_OK(ofl_manager_group_start(e->m, "core_attn"));
  ofl_tag_t tag = OFL_TAG_INVALID;
  cr_assert(
      eq(int, ofl_manager_tensor_push(e->m, t, &tag), OFL_ERR_INVALID_ARG));
  cr_assert(eq(u64, tag, OFL_TAG_INVALID));
  cr_assert(
      not(eq(ptr,
             strstr(ofl_last_error(), "not memory of this manager's device"),
             NULL)),
      "%s", ofl_last_error());
  /* Nothing was taken: the group commits empty, nothing is copied. */
  H_OK(ofl_manager_group_commit(e->m, "core_attn", NULL, 0, 0));
  cr_assert(eq(u64, stats(e).offloaded_tensors, 0));
  H_OK(ofl_manager_reset(e->m));
}

Test(pipeline_contracts, a_tensor_of_another_device_is_refused_at_push) {
  h_env_t e;
  h_open(&e, 10, 6);
  ofl_device_params_t dp = t_device_params(10, 7);
  dp.device_index = 1; /* cuda: the stand-in's second device */
  ofl_device_t *other = NULL;
  H_OK(ofl_device_open(&dp, &other));
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  ofl_pool_t *op = NULL;
  H_OK(ofl_pool_create(other, &pp, &op));
  ofl_tensor_t *t = NULL;
  int64_t shape[1] = {(int64_t)(16 * KIB)};
  H_OK(ofl_pool_alloc(op, shape, 1, OFL_DTYPE_U8,
                      ofl_device_compute_stream(other), &t));
  push_refused(&e, t);
  H_OK(ofl_tensor_destroy(t));
  ofl_pool_destroy(op);
  ofl_device_close(other);
  h_close(&e);
}

static void count_release(void *data, size_t bytes, void *user) {
  (void)data;
  (void)bytes;
  (*(int *)user)++;
}

Test(pipeline_contracts, host_memory_wrapped_as_device_is_refused_at_push) {
  h_env_t e;
  h_open(&e, 10, 8);
  void *host = malloc(16 * KIB);
  cr_assert(not(eq(ptr, host, NULL)));
  int released = 0;
  int64_t shape[1] = {(int64_t)(16 * KIB)};
  ofl_tensor_t *t = NULL;
  H_OK(ofl_tensor_wrap(host, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE,
                       count_release, &released, &t));
  push_refused(&e, t);
  H_OK(ofl_tensor_destroy(t));
  cr_assert(eq(int, released, 1));
  free(host);
  h_close(&e);
}

Test(pipeline_contracts, device_memory_wrapped_is_offloaded_and_reloaded) {
  h_env_t e;
  h_open(&e, 10, 9);
  void *dptr = NULL;
  H_OK(ofl_device_malloc(e.dev, 16 * KIB, &dptr));
  H_OK(t_fill(e.dev, dptr, 16 * KIB, 91));
  int64_t shape[1] = {(int64_t)(16 * KIB)};
  ofl_tensor_t *t = NULL;
  H_OK(ofl_tensor_wrap(dptr, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE, NULL, NULL,
                       &t));
  ofl_tag_t tag;
  H_OK(ofl_manager_chunk_begin(e.m, 1, 0));
  H_OK(ofl_manager_group_start(e.m, "core_attn"));
  H_OK(ofl_manager_tensor_push(e.m, t, &tag));
  H_OK(ofl_manager_group_commit(e.m, "core_attn", NULL, 0, 0));
  H_OK(ofl_manager_group_backward_begin(e.m, "core_attn"));
  cr_assert(eq(sz, h_pop_check(&e, tag, 16 * KIB, 91), 0));
  H_OK(ofl_manager_group_backward_end(e.m, "core_attn"));
  cr_assert(eq(u64, stats(&e).offloaded_tensors, 1));
  H_OK(ofl_manager_reset(e.m));
  H_OK(ofl_manager_synchronize(e.m, -1));
  H_OK(ofl_device_free(e.dev, dptr));
  h_close(&e);
}

/* ---- item 7: offload off, no comm -------------------------------------------
 */

static void one_training_iteration(h_env_t *e, uint64_t seed) {
  ofl_tag_t tag;
  H_OK(ofl_manager_chunk_begin(e->m, 1, 0));
  H_OK(ofl_manager_group_start(e->m, "core_attn"));
  H_OK(ofl_manager_tensor_push(e->m, h_tensor(e, 16 * KIB, seed), &tag));
  H_OK(ofl_manager_group_commit(e->m, "core_attn", NULL, 0, 0));
  H_OK(ofl_manager_group_backward_begin(e->m, "core_attn"));
  cr_assert(eq(sz, h_pop_check(e, tag, 16 * KIB, seed), 0));
  H_OK(ofl_manager_group_backward_end(e->m, "core_attn"));
  H_OK(ofl_manager_reset(e->m));
}

Test(pipeline_contracts, offload_off_without_comm_ends_the_warmup) {
  h_env_t e;
  h_open_dev(&e, 10, 10);
  ofl_manager_params_t mp = h_params(&e);
  mp.offload = 0;
  mp.comm = NULL;
  H_OK(ofl_manager_create(&mp, &e.m));
  uint64_t b = 1;
  cr_assert(eq(int, ofl_manager_summary_bytes(e.m, "core_attn", &b),
               OFL_ERR_NOT_READY));
  /* An evaluation pass does not end it (rule 4). */
  ofl_manager_set_forward_only(e.m, 1);
  one_training_iteration(&e, 11);
  ofl_manager_set_forward_only(e.m, 0);
  cr_assert(eq(int, ofl_manager_is_warmup(e.m), 1));
  one_training_iteration(&e, 12);
  cr_assert(eq(int, ofl_manager_is_warmup(e.m), 0));
  H_OK(ofl_manager_summary_bytes(e.m, "core_attn", &b));
  cr_assert(eq(u64, b, 0));
  cr_assert(eq(u64, ofl_manager_summary_total_bytes(e.m), 0));
  cr_assert(ofl_manager_summary(e.m) != NULL);
  one_training_iteration(&e, 13);
  cr_assert(eq(u64, stats(&e).offloaded_tensors, 0));
  h_close(&e);
}

/* ---- item 14: the end-of-warmup report
 * ---------------------------------------
 */

static char warn_text[4096];
static int warn_lines, size_lines;
static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  (void)subsys;
  (void)user;
  if (level == OFL_LOG_WARN && strstr(msg, "never started") != NULL) {
    warn_lines++;
    snprintf(warn_text + strlen(warn_text),
             sizeof warn_text - strlen(warn_text), "%s\n", msg);
  }
  if (level == OFL_LOG_INFO &&
      strstr(msg, "2 tensors (128 bytes) stay on the device for their size"))
    size_lines++;
}

Test(pipeline_contracts, names_the_warmup_never_saw_are_warned) {
  h_env_t e;
  h_open_dev(&e, 10, 14);
  ofl_manager_params_t mp = h_params(&e);
  mp.groups = "core_attn, core_atn,expert_fc1";
  mp.min_offload_bytes = (int64_t)KIB;
  H_OK(ofl_manager_create(&mp, &e.m));
  ofl_log_set_handler(capture, NULL);
  ofl_log_set_level(OFL_LOG_INFO);
  ofl_tag_t tag[3];
  H_OK(ofl_manager_chunk_begin(e.m, 1, 0));
  H_OK(ofl_manager_group_start(e.m, "core_attn"));
  H_OK(ofl_manager_tensor_push(e.m, h_tensor(&e, 16 * KIB, 141), &tag[0]));
  H_OK(ofl_manager_tensor_push(e.m, h_tensor(&e, 64, 142), &tag[1]));
  H_OK(ofl_manager_tensor_push(e.m, h_tensor(&e, 64, 143), &tag[2]));
  H_OK(ofl_manager_group_commit(e.m, "core_attn", NULL, 0, 0));
  H_OK(ofl_manager_group_backward_begin(e.m, "core_attn"));
  for (int i = 2; i >= 0; i--)
    cr_assert(eq(
        sz, h_pop_check(&e, tag[i], i == 0 ? 16 * KIB : 64, 141 + (uint64_t)i),
        0));
  H_OK(ofl_manager_group_backward_end(e.m, "core_attn"));
  cr_assert(eq(int, warn_lines, 0)); /* only at the end of the warmup */
  H_OK(ofl_manager_reset(e.m));
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(NULL, NULL);
  cr_assert(eq(int, warn_lines, 2), "%s", warn_text);
  cr_assert(not(eq(ptr, strstr(warn_text, "group core_atn "), NULL)), "%s",
            warn_text);
  cr_assert(not(eq(ptr, strstr(warn_text, "group expert_fc1 "), NULL)), "%s",
            warn_text);
  /* a near miss says which name the warmup saw; a name far from every
   * seen one gets no guess */
  cr_assert(not(eq(ptr,
                   strstr(warn_text, "group core_atn is configured for "
                                     "offload (params.groups / "
                                     "OFL_OFFLOAD_GROUPS; offload_modules= "
                                     "in ofl.torch) but the warmup never "
                                     "started it (did you mean core_attn?)"),
                   NULL)),
            "%s", warn_text);
  const char *far = strstr(warn_text, "group expert_fc1 ");
  cr_assert(eq(ptr, strstr(far, "did you mean"), NULL), "%s", warn_text);
  cr_assert(eq(int, size_lines, 1));
  h_close(&e);
}

/* ---- item 16: the plan
 * -------------------------------------------------------
 */

typedef struct {
  const char *name;
  size_t bytes;
  int not_offloadable;
} gspec_t;

/* Forward of one chunk of the given groups (one tensor each); tags out. */
static void forward(h_env_t *e, const gspec_t *gs, int n, uint64_t seed,
                    ofl_tag_t *tags) {
  H_OK(ofl_manager_chunk_begin(e->m, 1, 0));
  for (int g = 0; g < n; g++) {
    ofl_tensor_t *t = h_tensor(e, gs[g].bytes, seed + (uint64_t)g);
    if (gs[g].not_offloadable)
      ofl_manager_mark_not_offloadable(t);
    H_OK(ofl_manager_group_start(e->m, gs[g].name));
    H_OK(ofl_manager_tensor_push(e->m, t, &tags[g]));
    H_OK(ofl_manager_group_commit(e->m, gs[g].name, NULL, 0, 0));
  }
}

static void backward(h_env_t *e, const gspec_t *gs, int n, uint64_t seed,
                     const ofl_tag_t *tags) {
  for (int g = n - 1; g >= 0; g--) {
    H_OK(ofl_manager_group_backward_begin(e->m, gs[g].name));
    cr_assert(
        eq(sz, h_pop_check(e, tags[g], gs[g].bytes, seed + (uint64_t)g), 0),
        "group %s", gs[g].name);
    H_OK(ofl_manager_group_backward_end(e->m, gs[g].name));
  }
}

static ofl_group_plan_t plan(h_env_t *e, size_t i) {
  ofl_group_plan_t p;
  memset(&p, 0xff, sizeof p);
  H_OK(ofl_manager_group_plan(e->m, i, &p));
  return p;
}

#define PLAN_IS(e, i, nm, where, why)                                          \
  do {                                                                         \
    ofl_group_plan_t p_ = plan((e), (i));                                      \
    cr_assert(eq(str, (char *)p_.name, (char *)(nm)), "plan %d", (int)(i));    \
    cr_assert(eq(int, p_.placement, (where)), "plan %d (%s)", (int)(i), nm);   \
    cr_assert(eq(int, p_.reason, (why)), "plan %d (%s)", (int)(i), nm);        \
  } while (0)

/* Policy reasons: one chunk, five groups of one name (16 KiB each), pp rank
 * 1 with a 16 KiB delta, fraction 0.5. */
Test(pipeline_contracts, plan_names_the_policy_reasons) {
  h_env_t e;
  h_open_dev(&e, 10, 16);
  ofl_manager_params_t mp = h_params(&e);
  mp.fraction = 0.5;
  mp.pp_rank = 1;
  mp.rank_delta_bytes = (int64_t)(16 * KIB);
  H_OK(ofl_manager_create(&mp, &e.m));
  gspec_t gs[5];
  for (int g = 0; g < 5; g++)
    gs[g] = (gspec_t){"attn_proj", 16 * KIB, 0};
  ofl_tag_t tags[5];
  ofl_group_plan_t p;
  cr_assert(eq(int, ofl_manager_group_plan(e.m, 0, &p), OFL_ERR_NOT_READY));
  cr_assert(eq(sz, ofl_manager_group_plan_count(e.m), 0));
  forward(&e, gs, 5, 160, tags);
  backward(&e, gs, 5, 160, tags);
  H_OK(ofl_manager_reset(e.m));
  cr_assert(eq(sz, ofl_manager_group_plan_count(e.m), 5));
  /* Backward order: the last group first (kept: nothing prefetched for
   * it); the delta keeps the first in forward order; of the three left,
   * floor(3 x 0.5) = 1, the latest, stays for the fraction. */
  PLAN_IS(&e, 0, "attn_proj", OFL_GROUP_DEVICE, OFL_KEEP_RANK_DELTA);
  PLAN_IS(&e, 1, "attn_proj", OFL_GROUP_PINNED, OFL_KEEP_NONE);
  PLAN_IS(&e, 2, "attn_proj", OFL_GROUP_PINNED, OFL_KEEP_NONE);
  PLAN_IS(&e, 3, "attn_proj", OFL_GROUP_DEVICE, OFL_KEEP_FRACTION);
  PLAN_IS(&e, 4, "attn_proj", OFL_GROUP_DEVICE, OFL_KEEP_FIRST_BACKWARD);
  p = plan(&e, 1);
  cr_assert(eq(sz, p.chunk, 0));
  cr_assert(eq(u64, p.bytes, 16 * KIB));
  cr_assert(eq(int, ofl_manager_group_plan(e.m, 5, &p), OFL_ERR_INVALID_ARG));
  /* The steady state does what the plan says. */
  ofl_manager_stats_t w = stats(&e);
  forward(&e, gs, 5, 170, tags);
  backward(&e, gs, 5, 170, tags);
  H_OK(ofl_manager_reset(e.m));
  ofl_manager_stats_t s = stats(&e);
  cr_assert(eq(u64, s.offloaded_tensors - w.offloaded_tensors, 2));
  cr_assert(eq(u64, s.kept_groups - w.kept_groups, 3));
  h_close(&e);
}

/* The last group of a name in a chunk that is next to run backward when it
 * commits (a last stage: F0 B0 F1 B1 F2 B2). */
Test(pipeline_contracts, plan_names_groups_kept_as_next_in_backward) {
  h_env_t e;
  h_open(&e, 10, 17);
  gspec_t gs[2] = {{"core_attn", 8 * KIB, 0}, {"core_attn", 8 * KIB, 0}};
  ofl_tag_t tags[2];
  for (int it = 0; it < 2; it++) {
    ofl_manager_stats_t w = stats(&e);
    for (int mb = 0; mb < 3; mb++) {
      forward(&e, gs, 2, 170 + (uint64_t)(10 * mb), tags);
      backward(&e, gs, 2, 170 + (uint64_t)(10 * mb), tags);
    }
    H_OK(ofl_manager_reset(e.m));
    if (it == 1) {
      ofl_manager_stats_t s = stats(&e);
      cr_assert(eq(u64, s.kept_groups - w.kept_groups, 3));
    }
  }
  cr_assert(eq(sz, ofl_manager_group_plan_count(e.m), 6));
  PLAN_IS(&e, 0, "core_attn", OFL_GROUP_PINNED, OFL_KEEP_NONE);
  PLAN_IS(&e, 1, "core_attn", OFL_GROUP_DEVICE, OFL_KEEP_FIRST_BACKWARD);
  for (size_t c = 1; c < 3; c++) {
    PLAN_IS(&e, 2 * c, "core_attn", OFL_GROUP_PINNED, OFL_KEEP_NONE);
    PLAN_IS(&e, 2 * c + 1, "core_attn", OFL_GROUP_DEVICE,
            OFL_KEEP_NEXT_BACKWARD);
    cr_assert(eq(sz, plan(&e, 2 * c + 1).chunk, c));
    cr_assert(eq(int, plan(&e, 2 * c + 1).microbatch, (int)c));
  }
  h_close(&e);
}

/* What the warmup found: a tensor too small, one marked, a name not
 * selected, a group the host budget cannot take, one for the disk tier and
 * plain ones; two chunks in flight (F0 F1 B0 B1) so that chunk 1 shows them
 * (chunk 0, first in backward, keeps its groups for the policy). */
Test(pipeline_contracts, plan_names_what_the_warmup_could_not_offload) {
  h_env_t e;
  h_open_dev(&e, 10, 18);
  ofl_disk_params_t kp = OFL_DISK_PARAMS_INIT;
  kp.dev = e.dev;
  kp.dir = "/tmp";
  kp.budget_bytes = 64 * KIB; /* takes both expert_fc1, not core_attn */
  kp.grow_bytes = 64 * KIB;
  kp.groups = "expert_fc1";
  kp.direct = OFL_DISK_DIRECT_OFF;
  kp.engine = OFL_DISK_ENGINE_THREADS;
  ofl_disk_t *disk = NULL;
  H_OK(ofl_disk_open(&kp, &disk));
  ofl_manager_params_t mp = h_params(&e);
  mp.groups = "attn_norm,qkv_linear,core_attn,attn_proj,expert_fc1,moe_act";
  mp.min_offload_bytes = (int64_t)KIB;
  mp.host_budget_bytes = (int64_t)(128 * KIB);
  mp.disk = disk;
  H_OK(ofl_manager_create(&mp, &e.m));
  const gspec_t gs[7] = {
      {"attn_norm", 64, 0},       {"qkv_linear", 16 * KIB, 1},
      {"mlp_norm", 16 * KIB, 0},  {"core_attn", 256 * KIB, 0},
      {"attn_proj", 16 * KIB, 0}, {"expert_fc1", 16 * KIB, 0},
      {"moe_act", 16 * KIB, 0},
  };
  ofl_tag_t tags[2][7];
  forward(&e, gs, 7, 180, tags[0]);
  forward(&e, gs, 7, 190, tags[1]);
  backward(&e, gs, 7, 180, tags[0]);
  backward(&e, gs, 7, 190, tags[1]);
  H_OK(ofl_manager_reset(e.m));
  ofl_manager_stats_t w = stats(&e);
  /* Kept at commit: the small, the marked and the budget-refused tensor of
   * each chunk; the last two are in kept_tensors too. */
  cr_assert(eq(u64, w.budget_kept_tensors, 2));
  cr_assert(eq(u64, w.kept_tensors, 6));
  cr_assert(eq(sz, ofl_manager_group_plan_count(e.m), 14));
  const int keep[7] = {OFL_KEEP_SIZE,         OFL_KEEP_NOT_OFFLOADABLE,
                       OFL_KEEP_NOT_SELECTED, OFL_KEEP_HOST_BUDGET,
                       OFL_KEEP_NONE,         OFL_KEEP_NONE,
                       OFL_KEEP_NONE};
  const int where[7] = {OFL_GROUP_DEVICE, OFL_GROUP_DEVICE, OFL_GROUP_DEVICE,
                        OFL_GROUP_DEVICE, OFL_GROUP_PINNED, OFL_GROUP_DISK,
                        OFL_GROUP_PINNED};
  for (int g = 0; g < 7; g++) {
    bool offloads = keep[g] == OFL_KEEP_NONE;
    PLAN_IS(&e, (size_t)g, gs[g].name, OFL_GROUP_DEVICE,
            offloads ? OFL_KEEP_FIRST_BACKWARD : keep[g]);
    PLAN_IS(&e, (size_t)(7 + g), gs[g].name, where[g], keep[g]);
  }
  ofl_group_plan_t p = plan(&e, 7 + 5);
  cr_assert(eq(u64, p.bytes, 16 * KIB));
  cr_assert(eq(u64, p.disk_bytes, 16 * KIB));
  cr_assert(eq(sz, plan(&e, 7 + 2).chunk, 1));
  /* The steady state offloads the three groups the plan says. */
  forward(&e, gs, 7, 200, tags[0]);
  forward(&e, gs, 7, 210, tags[1]);
  backward(&e, gs, 7, 200, tags[0]);
  backward(&e, gs, 7, 210, tags[1]);
  H_OK(ofl_manager_reset(e.m));
  ofl_manager_stats_t s = stats(&e);
  cr_assert(eq(u64, s.offloaded_tensors - w.offloaded_tensors, 3));
  cr_assert(eq(u64, s.disk_tensors - w.disk_tensors, 1));
  ofl_manager_destroy(e.m);
  e.m = NULL;
  ofl_disk_close(disk);
  h_close(&e);
}

/* ---- item 17: the steady-state peak -----------------------------------------
 */

Test(pipeline_contracts, steady_device_pool_peak_leaves_out_the_warmup) {
  h_env_t e;
  h_open(&e, 10, 19);
  gspec_t gs[3] = {{"attn_norm", 16 * KIB, 0},
                   {"core_attn", 16 * KIB, 0},
                   {"mlp_norm", 16 * KIB, 0}};
  ofl_tag_t tags[3];
  for (int it = 0; it < 2; it++) {
    forward(&e, gs, 3, 190, tags);
    if (it == 0) { /* a warmup-only temporary: 1 MiB */
      cr_assert(eq(sz, stats(&e).steady_device_pool_peak_bytes, 0));
      H_OK(ofl_tensor_destroy(h_tensor(&e, 1024 * KIB, 1)));
    }
    backward(&e, gs, 3, 190, tags);
    H_OK(ofl_manager_reset(e.m));
  }
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(e.pool, &ps);
  size_t peak = stats(&e).steady_device_pool_peak_bytes;
  cr_assert(eq(sz, peak, ps.peak_in_use_bytes));
  cr_assert(ge(sz, peak, 16 * KIB));
  cr_assert(lt(sz, peak, 1024 * KIB));
  h_close(&e);
}

/* Item 13: the manager prints what it uses and where each value came from:
 * params over the environment over the default. */
Test(pipeline_contracts,
     config_print_says_the_values_in_force_and_their_source) {
  setenv("OFL_MAX_INFLIGHT", "3", 1);
  setenv("OFL_OFFLOAD_FRACTION", "0.25", 1);
  H_OK(ofl_config_reload());
  h_env_t e;
  h_open_dev(&e, 10, 3);
  ofl_manager_params_t mp = h_params(&e);
  mp.fraction = 0.5;      /* params win over OFL_OFFLOAD_FRACTION */
  mp.max_inflight = -1;   /* from the environment */
  mp.prefetch_groups = 0; /* the default */
  H_OK(ofl_manager_create(&mp, &e.m));
  char buf[4096] = {0};
  FILE *f = fmemopen(buf, sizeof buf - 1, "w");
  cr_assert(f != NULL);
  ofl_manager_config_print(e.m, f);
  fclose(f);
  static const char *const want[4] = {
      "OFL_OFFLOAD_FRACTION       = 0.5          (params)",
      "OFL_MAX_INFLIGHT           = 3            (environment)",
      "OFL_PREFETCH_GROUPS        = 1            (default)",
      "OFL_MIN_OFFLOAD_BYTES      = 1            (params)"};
  for (int i = 0; i < 4; i++)
    cr_assert(ne(ptr, strstr(buf, want[i]), NULL), "want \"%s\" in:\n%s",
              want[i], buf);
  h_close(&e);
  unsetenv("OFL_MAX_INFLIGHT");
  unsetenv("OFL_OFFLOAD_FRACTION");
  H_OK(ofl_config_reload());
}
