/* Long runs and fault paths of the manager: memory and internal records stay
 * flat over hundreds of iterations, and a prefetch that failed half-way
 * never hands out a tensor before its copy landed. */
#include <ofl/disk.h>

#include "disk/disk_internal.h"

#include "tests/support/harness.h"

#define KIB ((size_t)1024)

/* ---- long runs ----------------------------------------------------------- */

/* Sizes of every growable record of the manager. */
typedef struct {
  uint32_t nfwd, capfwd, nbwd, capbwd, capopen, capdelayed, capheld;
  uint64_t chunk_caps, group_caps, ngroups, stack_entries, ring_len;
  int nnames;
} records_t;

static records_t records(const ofl_manager_t *m) {
  records_t r = {0};
  r.nfwd = m->nfwd;
  r.capfwd = m->capfwd;
  r.nbwd = m->nbwd;
  r.capbwd = m->capbwd;
  r.capopen = m->capopen;
  r.capdelayed = m->capdelayed;
  r.capheld = m->capheld;
  r.nnames = m->nnames;
  for (uint32_t i = 0; i < m->nfwd; i++) {
    const chunk_t *c = m->fwd[i];
    r.chunk_caps += c->cap;
    r.ngroups += c->ngroups;
    r.stack_entries += c->nstack;
    for (uint32_t j = 0; j < c->ngroups; j++)
      r.group_caps += c->groups[j]->cap;
  }
  for (int k = 0; k < m->nnames; k++)
    r.ring_len += m->names[k].ring_len;
  return r;
}

static void check_records_equal(const records_t *a, const records_t *b) {
  cr_assert(eq(u32, b->nfwd, a->nfwd));
  cr_assert(eq(u32, b->capfwd, a->capfwd));
  cr_assert(eq(u32, b->nbwd, a->nbwd));
  cr_assert(eq(u32, b->capbwd, a->capbwd));
  cr_assert(eq(u32, b->capopen, a->capopen));
  cr_assert(eq(u32, b->capdelayed, a->capdelayed));
  cr_assert(eq(u32, b->capheld, a->capheld));
  cr_assert(eq(u64, b->chunk_caps, a->chunk_caps));
  cr_assert(eq(u64, b->group_caps, a->group_caps));
  cr_assert(eq(u64, b->ngroups, a->ngroups));
  cr_assert(eq(int, b->nnames, a->nnames));
  /* Nothing waits for a reload or an in-flight slot after a reset. */
  cr_assert(eq(u64, b->stack_entries, 0));
  cr_assert(eq(u64, b->ring_len, 0));
}

typedef struct {
  ofl_device_stats_t dev;
  ofl_pool_stats_t host, act;
  ofl_disk_stats_t disk;
  ofl_pool_stats_t bounce; /* the disk tier's pinned buffers */
  records_t rec;
} snapshot_t;

static snapshot_t snapshot(drv_t *d) {
  snapshot_t s;
  memset(&s, 0, sizeof s);
  ofl_device_get_stats(d->dev, &s.dev);
  ofl_pool_get_stats(ofl_manager_host_pool(d->m), &s.host);
  ofl_pool_get_stats(d->pool, &s.act);
  if (d->disk != NULL) {
    ofl_disk_get_stats(d->disk, &s.disk);
    ofl_pool_get_stats(d->disk->pool, &s.bounce);
  }
  s.rec = records(d->m);
  return s;
}

static void check_pool_flat(const char *what, const ofl_pool_stats_t *a,
                            const ofl_pool_stats_t *b) {
  cr_assert(eq(u64, b->backend_allocs, a->backend_allocs), "%s pool", what);
  cr_assert(eq(u64, b->backend_frees, a->backend_frees));
  cr_assert(eq(u64, b->blocks_total, a->blocks_total));
  cr_assert(eq(sz, b->total_bytes, a->total_bytes));
  cr_assert(eq(sz, b->in_use_bytes, a->in_use_bytes));
  cr_assert(eq(u64, b->blocks_in_use, a->blocks_in_use));
}

/* 200 iterations of a small interleaved schedule: after the warmup
 * iterations no pool or backend allocation is made, nothing stays in use
 * between iterations and the manager's records keep their sizes, while
 * every popped byte is checked. */
static void run_long(const char *disk_groups, unsigned names_mask) {
  drv_cfg_t cfg = {0};
  cfg.pp = 2;
  cfg.rank = 0;
  cfg.vpp = 2;
  cfg.mbs = 2;
  cfg.layers = 1;
  cfg.names_mask = names_mask;
  cfg.tensors_max = 3;
  cfg.thresh = 256;
  cfg.size_lo = 512;
  cfg.size_hi = 3000; /* one page class for byte-keyed (dynamic) blocks */
  cfg.seed = 77;
  cfg.jitter_us = 0;
  cfg.tricks = 1;
  cfg.offload = 1;
  cfg.disk_groups = disk_groups;
  cfg.keyed_by_bytes = 1;
  drv_t d;
  cr_assert(eq(int, drv_open(&d, &cfg), OFL_SUCCESS), "%s", d.msg);
  const int warm = 5, total = 200;
  for (int it = 0; it < warm; it++)
    cr_assert(eq(int, drv_iteration(&d), OFL_SUCCESS), "%s", d.msg);
  snapshot_t a = snapshot(&d);
  ofl_manager_stats_t m0;
  ofl_manager_get_stats(d.m, &m0);
  for (int it = warm; it < total; it++) {
    cr_assert(eq(int, drv_iteration(&d), OFL_SUCCESS), "iteration %d: %s", it,
              d.msg);
    if (it == 100 || it == total - 1) {
      snapshot_t b = snapshot(&d);
      check_records_equal(&a.rec, &b.rec);
      check_pool_flat("host", &a.host, &b.host);
      check_pool_flat("activation", &a.act, &b.act);
      cr_assert(eq(u64, b.dev.device_allocs, a.dev.device_allocs));
      /* Pinned memory outside the disk tier's bounce buffers: none. The
       * bounce pool holds as many buffers as extents were alive at once
       * (the write thread's pace decides how many), never more. */
      cr_assert(eq(u64, b.dev.pinned_allocs - b.bounce.backend_allocs,
                   a.dev.pinned_allocs - a.bounce.backend_allocs));
      cr_assert(le(u64, b.bounce.blocks_total,
                   (uint64_t)(b.disk.peak_extent_bytes / 4096)));
      cr_assert(eq(sz, b.dev.device_bytes_in_use, a.dev.device_bytes_in_use));
      cr_assert(eq(sz, b.dev.pinned_bytes_in_use - b.bounce.total_bytes,
                   a.dev.pinned_bytes_in_use - a.bounce.total_bytes));
      cr_assert(eq(u64, b.dev.strict_violations, 0));
      cr_assert(eq(sz, b.disk.file_bytes, a.disk.file_bytes));
    }
  }
  ofl_manager_stats_t m1;
  ofl_manager_get_stats(d.m, &m1);
  cr_assert(eq(u64, m1.iterations, (uint64_t)total));
  cr_assert(gt(u64, m1.offloaded_tensors, m0.offloaded_tensors));
  cr_assert(eq(u64, m1.reloaded_tensors - m0.reloaded_tensors,
               m1.offloaded_tensors - m0.offloaded_tensors));
  cr_assert(eq(u64, m1.unpopped_tensors, 0));
  cr_assert(gt(sz, d.checked_tensors, (size_t)total));
  cr_assert(eq(sz, d.wrong_bytes, 0));
  cr_assert(eq(int, d.order_errors, 0));
  if (disk_groups != NULL) {
    cr_assert(gt(u64, m1.disk_tensors, m0.disk_tensors));
    H_OK(ofl_manager_synchronize(d.m, 10000));
    ofl_disk_stats_t k;
    ofl_disk_get_stats(d.disk, &k);
    cr_assert(eq(u64, k.extents, 0));
  }
  drv_close(&d);
}

Test(pipeline_long_run, two_hundred_iterations_keep_memory_and_records_flat,
     .timeout = 240) {
  run_long(NULL, 0x7f);
}

Test(pipeline_long_run, two_hundred_iterations_with_the_disk_tier_stay_flat,
     .timeout = 240) {
  run_long("core_attn,expert_fc1", 0x7f);
}

/* ---- a prefetch that failed half-way ------------------------------------- */

/* The prefetch of a group of two copies gets device memory for the first
 * copy and not for the second (the reload pool's budget is full): the H2D of
 * the first copy is queued, and backward_end succeeds all the same (a
 * prefetch only gets ahead; the second tensor reloads at its pop). A tensor
 * of that group must still not be handed out before its copy landed. */
Test(pipeline_long_run, pop_after_a_half_issued_prefetch_waits_for_its_copy) {
  h_env_t e;
  h_open_dev(&e, 0, 31);
  ofl_pool_params_t rp = OFL_POOL_PARAMS_INIT;
  rp.name = "reload";
  rp.budget_bytes = 96 * KIB;
  ofl_pool_t *reload = NULL;
  H_OK(ofl_pool_create(e.dev, &rp, &reload));
  ofl_manager_params_t mp = h_params(&e);
  mp.device_pool = reload;
  H_OK(ofl_manager_create(&mp, &e.m));

  ofl_tag_t ta[2], tb[2];
  H_OK(ofl_manager_chunk_begin(e.m, 1, 0));
  H_OK(ofl_manager_group_start(e.m, "qkv_linear"));
  for (int k = 0; k < 2; k++)
    H_OK(ofl_manager_tensor_push(e.m, h_tensor(&e, 24 * KIB, 100 + k), &ta[k]));
  H_OK(ofl_manager_group_commit(e.m, "qkv_linear", NULL, 0, 0));
  H_OK(ofl_manager_group_start(e.m, "core_attn"));
  for (int k = 0; k < 2; k++)
    H_OK(ofl_manager_tensor_push(e.m, h_tensor(&e, 32 * KIB, 200 + k), &tb[k]));
  H_OK(ofl_manager_group_commit(e.m, "core_attn", NULL, 0, 0));

  /* core_attn runs backward first (reloaded inline) and keeps its two
   * tensors: 64 of the 96 KiB. */
  H_OK(ofl_manager_group_backward_begin(e.m, "core_attn"));
  ofl_tensor_t *b[2];
  for (int k = 1; k >= 0; k--)
    H_OK(ofl_manager_tensor_pop(e.m, tb[k], &b[k]));
  /* A slow copy engine: the prefetch's first H2D lands late. */
  h_stall(ofl_manager_h2d_stream(e.m), 300);
  H_OK(ofl_manager_group_backward_end(e.m, "core_attn"));
  for (int k = 0; k < 2; k++) {
    cr_assert(eq(sz, h_wrong(&e, b[k], 32 * KIB, 200 + k), 0));
    H_OK(ofl_tensor_destroy(b[k]));
  }

  /* qkv_linear: both tensors come back with their bytes. */
  H_OK(ofl_manager_group_backward_begin(e.m, "qkv_linear"));
  for (int k = 1; k >= 0; k--)
    cr_assert(eq(sz, h_pop_check(&e, ta[k], 24 * KIB, 100 + k), 0),
              "tensor %d", k);
  H_OK(ofl_manager_group_backward_end(e.m, "qkv_linear"));
  H_OK(ofl_manager_reset(e.m));
  ofl_device_stats_t ds;
  ofl_device_get_stats(e.dev, &ds);
  cr_assert(eq(u64, ds.strict_violations, 0));
  ofl_manager_destroy(e.m);
  e.m = NULL;
  ofl_pool_destroy(reload);
  h_close(&e);
}
