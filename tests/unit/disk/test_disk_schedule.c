/* The disk tier inside a pipeline-like schedule on the backend under test:
 * forward offloads device tensors (D2H into a bounce buffer, write queued
 * after the copy on the D2H stream, device memory freed), backward reloads
 * them in reverse order with prefetch a few groups ahead (H2D on the H2D
 * stream, buffer freed after it). Tensors go to disk by group name or when
 * the host pool's budget is exhausted (spill). Byte-for-byte checks. */
#include "tests/support/disk_test_util.h"

TestSuite(disk_schedule, .init = disk_setup, .fini = disk_teardown);

typedef struct act {
  size_t bytes;
  uint64_t seed;
  const char *group;
  void *dev_ptr;
  ofl_tensor_t *host;     /* host tier */
  ofl_disk_extent_t *ext; /* disk tier */
} act_t;

typedef struct sched {
  ofl_disk_t *d;
  ofl_pool_t *host_pool;
  ofl_stream_t *d2h, *h2d;
  size_t on_disk, on_host, on_disk_bytes;
} sched_t;

static void sched_open(sched_t *s, size_t host_budget, const char *groups,
                       int prefetch) {
  memset(s, 0, sizeof *s);
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.groups = groups;
  p.prefetch_groups = prefetch;
  s->d = open_with(&p);
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_PINNED;
  pp.name = "host-tier";
  pp.budget_bytes = host_budget;
  cr_assert(eq(int, ofl_pool_create(dev, &pp, &s->host_pool), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "d2h", &s->d2h), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "h2d", &s->h2d), OFL_SUCCESS));
}

static void sched_close(sched_t *s) {
  ofl_stream_destroy(s->d2h);
  ofl_stream_destroy(s->h2d);
  ofl_pool_destroy(s->host_pool);
  ofl_disk_close(s->d);
}

static void offload(sched_t *s, act_t *a) {
  cr_assert(
      eq(int, ofl_device_malloc(dev, a->bytes, &a->dev_ptr), OFL_SUCCESS));
  dev_fill(a->dev_ptr, a->bytes, a->seed); /* device memory: by a copy */
  int64_t shape[1] = {(int64_t)a->bytes};
  void *dst = NULL;
  if (!ofl_disk_group_selected(s->d, a->group) &&
      ofl_pool_alloc_dynamic(s->host_pool, shape, 1, OFL_DTYPE_U8, NULL,
                             &a->host) == OFL_SUCCESS) {
    dst = ofl_tensor_data(a->host);
    s->on_host++;
  } else { /* named for disk, or the host budget is exhausted: spill */
    cr_assert(
        eq(int, ofl_disk_extent_create(s->d, a->bytes, &a->ext), OFL_SUCCESS),
        "%s", ofl_last_error());
    dst = ofl_disk_extent_data(a->ext);
    s->on_disk++;
    s->on_disk_bytes += a->bytes;
  }
  cr_assert(
      eq(int, ofl_memcpy_async(dst, a->dev_ptr, a->bytes, OFL_COPY_D2H, s->d2h),
         OFL_SUCCESS));
  if (a->ext != NULL) /* the bounce buffer is written once the copy is done */
    cr_assert(
        eq(int, ofl_disk_extent_write_after(a->ext, s->d2h), OFL_SUCCESS));
}

static void free_device(sched_t *s, act_t *acts, int n) {
  cr_assert(eq(int, ofl_stream_synchronize(s->d2h, -1), OFL_SUCCESS));
  for (int i = 0; i < n; i++) {
    cr_assert(eq(int, ofl_device_free(dev, acts[i].dev_ptr), OFL_SUCCESS));
    acts[i].dev_ptr = NULL;
  }
}

static size_t reload(sched_t *s, act_t *a) {
  void *src = NULL;
  if (a->ext != NULL)
    cr_assert(eq(int, ofl_disk_extent_reload(a->ext, -1, &src), OFL_SUCCESS),
              "%s", ofl_last_error());
  else
    src = ofl_tensor_data(a->host);
  cr_assert(
      eq(int, ofl_device_malloc(dev, a->bytes, &a->dev_ptr), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_memcpy_async(a->dev_ptr, src, a->bytes, OFL_COPY_H2D, s->h2d),
         OFL_SUCCESS));
  /* buffers go back only after the H2D that reads them (rule 2) */
  if (a->ext != NULL)
    cr_assert(
        eq(int, ofl_disk_extent_destroy_after(a->ext, s->h2d), OFL_SUCCESS));
  else
    cr_assert(eq(int, ofl_pool_free_after(s->host_pool, a->host, s->h2d),
                 OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(s->h2d, -1), OFL_SUCCESS));
  size_t wrong = dev_wrong(a->dev_ptr, a->bytes, a->seed);
  cr_assert(eq(int, ofl_device_free(dev, a->dev_ptr), OFL_SUCCESS));
  return wrong;
}

/* Backward: reverse order; before each reload the next `ahead` disk
 * tensors in reload order are prefetched. */
static size_t backward(sched_t *s, act_t *acts, int n) {
  int ahead = ofl_disk_prefetch_groups(s->d);
  size_t wrong = 0;
  for (int i = n - 1; i >= 0; i--) {
    for (int k = i; k >= 0 && k >= i - ahead; k--)
      if (acts[k].ext != NULL)
        cr_assert(eq(int, ofl_disk_extent_prefetch(acts[k].ext), OFL_SUCCESS));
    wrong += reload(s, &acts[i]);
  }
  return wrong;
}

static const char *const groups[] = {"attn_norm", "qkv_linear", "core_attn",
                                     "attn_proj", "mlp_norm",   "expert_fc1",
                                     "moe_act"};

Test(disk_schedule, groups_named_for_disk_round_trip_with_prefetch) {
  sched_t s;
  sched_open(&s, 0, "core_attn,expert_fc1,moe_act", 2);
  enum { N = 28 };
  act_t acts[N];
  memset(acts, 0, sizeof acts);
  for (int i = 0; i < N; i++) {
    acts[i].bytes = 1 + (size_t)(mix((uint64_t)i) % (3u << 20));
    acts[i].seed = 1000 + (uint64_t)i;
    acts[i].group = groups[i % 7];
    offload(&s, &acts[i]);
  }
  free_device(&s, acts, N);
  cr_expect(eq(sz, s.on_disk, 12)); /* 3 of every 7 */
  cr_expect(eq(sz, backward(&s, acts, N), 0));
  ofl_disk_stats_t st = disk_stats(s.d);
  /* a write still queued when its reload came is dropped at destroy */
  cr_expect(eq(u64, st.bytes_written + st.bytes_skipped, s.on_disk_bytes));
  cr_expect(eq(u64, st.reloads, s.on_disk));
  cr_expect(eq(u64, st.prefetch_hits + st.stalls, s.on_disk));
  cr_expect(gt(u64, st.reads, 0));
  cr_expect(eq(u64, st.extents, 0));
  sched_close(&s);
}

Test(disk_schedule, spill_to_disk_when_the_host_budget_is_small) {
  sched_t s;
  sched_open(&s, 6 << 20, "", 3);
  enum { N = 32 };
  act_t acts[N];
  memset(acts, 0, sizeof acts);
  for (int i = 0; i < N; i++) {
    acts[i].bytes = (size_t)(i % 5 + 1) * 300001; /* unaligned sizes */
    acts[i].seed = 77 + (uint64_t)i;
    acts[i].group = groups[i % 7];
    offload(&s, &acts[i]);
  }
  free_device(&s, acts, N);
  cr_expect(gt(sz, s.on_host, 0));
  cr_expect(gt(sz, s.on_disk, s.on_host)); /* most spilled */
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(s.host_pool, &ps);
  cr_expect(le(sz, ps.total_bytes, 6 << 20));
  cr_expect(gt(u64, ps.budget_refusals, 0));
  cr_expect(eq(sz, backward(&s, acts, N), 0));
  ofl_disk_stats_t st = disk_stats(s.d);
  /* a write still queued when its reload came is dropped at destroy */
  cr_expect(eq(u64, st.bytes_written + st.bytes_skipped, s.on_disk_bytes));
  cr_expect(eq(u64, st.reloads, s.on_disk));
  sched_close(&s);
}

Test(disk_schedule, a_256_mib_tensor_round_trips) {
  sched_t s;
  sched_open(&s, 0, "*", 1);
  act_t a;
  memset(&a, 0, sizeof a);
  a.bytes = (size_t)256 << 20;
  a.seed = 256;
  a.group = "core_attn";
  offload(&s, &a);
  free_device(&s, &a, 1);
  /* written out before the reload, so the bytes come back from the file */
  cr_assert(eq(int, ofl_disk_extent_wait(a.ext, -1), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_state(a.ext), OFL_DISK_EXTENT_ON_DISK));
  cr_expect(eq(sz, reload(&s, &a), 0));
  ofl_disk_stats_t st = disk_stats(s.d);
  cr_expect(eq(u64, st.bytes_written, (uint64_t)256 << 20));
  cr_expect(eq(u64, st.bytes_read, (uint64_t)256 << 20));
  cr_expect(eq(u64, st.faults_corrupt, 0));
  sched_close(&s);
}
