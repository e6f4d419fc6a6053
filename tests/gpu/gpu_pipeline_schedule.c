/* The pipeline manager on the cuda backend through whole schedules: 1F1B and
 * interleaved 1F1B (vpp 2), several microbatches, the seven named groups,
 * three iterations (the warmup and two steady ones). Every pushed tensor is
 * filled through an H2D copy with a pattern of (iteration, chunk,
 * microbatch, group, tensor); every popped tensor is read back D2H and
 * compared byte for byte. Tiers: pinned host memory, the disk tier (some
 * groups), and a small host budget (some groups stay on the device). Runs
 * on a real GPU and on the cudasim stand-in; exits 77 without a device. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/gpu/gpu_common.h"
#include "tests/support/fixture.h"
#include "tests/support/schedule.h"

#define NT 2      /* tensors per group */
#define LAYERS 2  /* layers per chunk */

typedef struct {
  const char *name;
  int pp, rank, vpp, mbs;
  const char *disk_groups; /* NULL: no disk tier */
  int64_t host_budget;     /* 0: unlimited */
} cfg_t;

typedef struct {
  ofl_tag_t tag[NT];
  uint64_t seed[NT];
  size_t bytes[NT];
} rec_t;

typedef struct {
  size_t wrong, checked, pushed;
  int failed;
  char msg[512];
  ofl_manager_stats_t stats;
  ofl_disk_stats_t disk;
} result_t;

static uint64_t seed_of(int it, int c, int mb, int l, int g, int k) {
  return t_mix(((uint64_t)it << 40) ^ ((uint64_t)c << 32) ^
               ((uint64_t)mb << 24) ^ ((uint64_t)l << 16) ^
               ((uint64_t)g << 8) ^ (uint64_t)k);
}

static size_t size_of(int c, int l, int g, int k, int mb) {
  /* 4 KiB .. ~100 KiB; the dynamic names change with the microbatch */
  uint64_t h = t_mix((uint64_t)(c * 131 + l * 17 + g * 7 + k) +
                     (g >= 5 ? (uint64_t)mb * 977 : 0));
  return 4096 + (size_t)(h % (96 * 1024));
}

#define TRY(call)                                                              \
  do {                                                                         \
    ofl_status_t s_ = (call);                                                  \
    if (s_ != OFL_SUCCESS) {                                                   \
      snprintf(r->msg, sizeof(r->msg), "%s: %s (%s)", #call,                   \
               ofl_status_str(s_), ofl_last_error());                          \
      r->failed = 1;                                                           \
      goto out;                                                                \
    }                                                                          \
  } while (0)

static void run(const cfg_t *cfg, result_t *r) {
  memset(r, 0, sizeof(*r));
  ofl_device_t *dev = NULL;
  ofl_pool_t *pool = NULL;
  ofl_disk_t *disk = NULL;
  ofl_manager_t *m = NULL;
  int total = cfg->vpp * cfg->mbs;
  rec_t *rec = calloc((size_t)total * LAYERS * 7, sizeof(*rec));
  drv_step_t *steps = calloc((size_t)2 * total, sizeof(*steps));
  if (rec == NULL || steps == NULL) {
    r->failed = 1;
    snprintf(r->msg, sizeof(r->msg), "out of memory");
    goto out;
  }
  TRY(gpu_open_device(0, &dev));
  TRY(t_env_open_pool(dev, &pool));
  if (cfg->disk_groups) {
    ofl_disk_params_t kp = t_env_disk_params(dev, cfg->disk_groups, cfg->rank);
    TRY(ofl_disk_open(&kp, &disk));
  }
  ofl_manager_params_t mp = t_env_manager_params(dev, pool);
  mp.disk = disk;
  mp.host_budget_bytes = cfg->host_budget;
  mp.pp_rank = cfg->rank;
  mp.rank = cfg->rank;
  TRY(ofl_manager_create(&mp, &m));
  ofl_stream_t *cs = ofl_device_compute_stream(dev);
  int nsteps = drv_schedule(cfg->pp, cfg->rank, cfg->vpp, cfg->mbs, steps);
  for (int it = 0; it < 3; it++) {
    for (int si = 0; si < nsteps; si++) {
      const drv_step_t *st = &steps[si];
      int c = st->chunk, mb = st->mb;
      if (st->fwd) {
        TRY(ofl_manager_chunk_begin(m, cfg->vpp, c));
        for (int l = 0; l < LAYERS; l++)
          for (int g = 0; g < 7; g++) {
            rec_t *q = &rec[(((size_t)c * cfg->mbs + mb) * LAYERS + l) * 7 + g];
            TRY(ofl_manager_group_start(m, drv_names[g]));
            for (int k = 0; k < NT; k++) {
              size_t bytes = size_of(c, l, g, k, mb);
              int64_t shape[1] = {(int64_t)bytes};
              ofl_tensor_t *t = NULL;
              TRY(ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, cs, &t));
              q->seed[k] = seed_of(it, c, mb, l, g, k);
              q->bytes[k] = bytes;
              TRY(t_fill(dev, ofl_tensor_data(t), bytes, q->seed[k]));
              TRY(ofl_manager_tensor_push(m, t, &q->tag[k]));
              r->pushed++;
            }
            TRY(ofl_manager_group_commit(m, drv_names[g], NULL, 0, 0));
          }
      } else {
        for (int l = LAYERS - 1; l >= 0; l--)
          for (int g = 6; g >= 0; g--) {
            rec_t *q = &rec[(((size_t)c * cfg->mbs + mb) * LAYERS + l) * 7 + g];
            TRY(ofl_manager_group_backward_begin(m, drv_names[g]));
            for (int k = NT - 1; k >= 0; k--) {
              ofl_tensor_t *t = NULL;
              TRY(ofl_manager_tensor_pop(m, q->tag[k], &t));
              if (ofl_tensor_bytes(t) != q->bytes[k] ||
                  ofl_tensor_location(t) != OFL_LOC_DEVICE) {
                r->wrong += q->bytes[k];
              } else {
                size_t w = t_wrong(dev, ofl_tensor_data(t), q->bytes[k],
                                   q->seed[k]);
                r->wrong += w == SIZE_MAX ? q->bytes[k] : w;
              }
              r->checked++;
              TRY(ofl_tensor_destroy(t));
            }
            TRY(ofl_manager_group_backward_end(m, drv_names[g]));
          }
      }
    }
    TRY(ofl_manager_reset(m));
  }
  TRY(ofl_manager_synchronize(m, -1));
  ofl_manager_get_stats(m, &r->stats);
  if (disk)
    ofl_disk_get_stats(disk, &r->disk);
out:
  ofl_manager_destroy(m);
  ofl_disk_close(disk);
  ofl_pool_destroy(pool);
  ofl_device_close(dev);
  free(rec);
  free(steps);
}

int main(void) {
  gpu_require_device();
  static const cfg_t cfgs[] = {
      {"1F1B pp 2 rank 0, 4 microbatches, host tier", 2, 0, 1, 4, NULL, 0},
      {"interleaved vpp 2 pp 2 rank 0, 4 microbatches, host tier", 2, 0, 2, 4,
       NULL, 0},
      {"1F1B pp 4 rank 1, 6 microbatches, disk tier (core_attn, expert_fc1)",
       4, 1, 1, 6, "core_attn,expert_fc1", 0},
      {"interleaved vpp 2 pp 2 rank 1, 4 microbatches, host budget 256 KiB",
       2, 1, 2, 4, NULL, 256 * 1024},
  };
  int n = (int)(sizeof(cfgs) / sizeof(cfgs[0]));
  tap_plan(n + 3);
  result_t res[4];
  for (int i = 0; i < n; i++) {
    run(&cfgs[i], &res[i]);
    result_t *r = &res[i];
    if (r->failed)
      tap_diag("%s", r->msg);
    tap_ok(!r->failed && r->wrong == 0 && r->checked == r->pushed &&
               r->pushed > 0,
           "%s: %zu tensors pushed, %zu popped and compared, %zu wrong bytes",
           cfgs[i].name, r->pushed, r->checked, r->wrong);
    tap_diag("offloaded %llu tensors (%llu B), reloaded %llu, inline %llu, "
             "budget-kept %llu, disk %llu",
             (unsigned long long)r->stats.offloaded_tensors,
             (unsigned long long)r->stats.offloaded_bytes,
             (unsigned long long)r->stats.reloaded_tensors,
             (unsigned long long)r->stats.inline_reloads,
             (unsigned long long)r->stats.budget_kept_tensors,
             (unsigned long long)r->stats.disk_tensors);
  }
  tap_ok(res[0].stats.offloaded_tensors > 0 && res[1].stats.offloaded_tensors > 0,
         "the host tier offloaded tensors in both schedules");
  tap_ok(res[2].stats.disk_tensors > 0 && res[2].disk.bytes_read > 0,
         "the disk tier wrote and read back its groups (%llu tensors, %llu B "
         "read)",
         (unsigned long long)res[2].stats.disk_tensors,
         (unsigned long long)res[2].disk.bytes_read);
  tap_ok(res[3].stats.budget_kept_tensors > 0 &&
             res[3].stats.offloaded_tensors > 0,
         "the small host budget kept some groups on the device (%llu tensors) "
         "and offloaded others (%llu)",
         (unsigned long long)res[3].stats.budget_kept_tensors,
         (unsigned long long)res[3].stats.offloaded_tensors);
  return tap_done();
}
