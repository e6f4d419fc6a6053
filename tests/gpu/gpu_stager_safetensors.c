/* Checkpoint staging on the cuda backend: device tensors of several dtypes
 * and shapes, filled through H2D copies, are staged (blocking, then async
 * with the sources overwritten after the join) and saved as .safetensors;
 * the files are read back with ofl's reader and compared byte for byte with
 * the source patterns, and restored into fresh device tensors
 * (ofl_safetensors_copy_to) that are read back D2H. Runs on a real GPU and
 * on the cudasim stand-in; exits 77 without a device. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/gpu/gpu_common.h"

#define NT 5

static const struct {
  const char *name;
  ofl_dtype_t dtype;
  int ndim;
  int64_t shape[3];
} specs[NT] = {
    {"layers.0.attn.qkv.weight", OFL_DTYPE_F32, 2, {96, 33, 0}},
    {"layers.0.mlp.fc1.weight", OFL_DTYPE_BF16, 2, {128, 77, 0}},
    {"layers.0.norm.scale", OFL_DTYPE_F16, 1, {1023, 0, 0}},
    {"step_counts", OFL_DTYPE_I64, 3, {3, 5, 7}},
    {"mask", OFL_DTYPE_U8, 1, {40000, 0, 0}},
};

static uint64_t seed_of(int round, int i) {
  return t_mix((uint64_t)round * 1000 + (uint64_t)i + 17);
}

typedef struct {
  long wrong_bytes, wrong_meta;
} check_t;

/* Reads path back and compares every tensor with the round's pattern, then
 * restores each into a fresh device tensor and reads that back. */
static check_t verify(ofl_device_t *dev, ofl_pool_t *pool, const char *path,
                      int round) {
  check_t c = {0, 0};
  ofl_safetensors_t *st = NULL;
  if (ofl_safetensors_open(path, &st) != OFL_SUCCESS) {
    tap_diag("open %s: %s", path, ofl_last_error());
    c.wrong_meta = 1000;
    return c;
  }
  c.wrong_meta += ofl_safetensors_count(st) != NT;
  const char *step = ofl_safetensors_metadata_get(st, "step");
  char want[16];
  snprintf(want, sizeof(want), "%d", round);
  c.wrong_meta += step == NULL || strcmp(step, want) != 0;
  ofl_stream_t *cs = ofl_device_compute_stream(dev);
  for (int i = 0; i < NT; i++) {
    ofl_safetensors_entry_t e;
    if (ofl_safetensors_find(st, specs[i].name, &e) != OFL_SUCCESS) {
      c.wrong_meta++;
      continue;
    }
    size_t bytes = 0;
    ofl_shape_bytes(specs[i].shape, specs[i].ndim, specs[i].dtype, &bytes);
    int same = e.dtype == specs[i].dtype && e.ndim == specs[i].ndim &&
               e.bytes == bytes;
    for (int d = 0; same && d < e.ndim; d++)
      same = e.shape[d] == specs[i].shape[d];
    if (!same) {
      c.wrong_meta++;
      continue;
    }
    c.wrong_bytes += (long)t_pattern_wrong(e.data, bytes, seed_of(round, i));
    /* restore into the device and read back */
    ofl_tensor_t *t = NULL;
    if (ofl_pool_alloc(pool, specs[i].shape, specs[i].ndim, specs[i].dtype, cs,
                       &t) != OFL_SUCCESS ||
        ofl_safetensors_copy_to(st, specs[i].name, t, cs) != OFL_SUCCESS) {
      tap_diag("restore %s: %s", specs[i].name, ofl_last_error());
      c.wrong_meta++;
    } else {
      size_t w = t_wrong(dev, ofl_tensor_data(t), bytes, seed_of(round, i));
      c.wrong_bytes += w == SIZE_MAX ? (long)bytes : (long)w;
    }
    ofl_tensor_destroy(t);
  }
  ofl_stream_synchronize(cs, -1);
  ofl_safetensors_close(st);
  return c;
}

int main(void) {
  gpu_require_device();
  tap_plan(6);
  ofl_device_t *dev = NULL;
  ofl_pool_t *pool = NULL;
  ofl_stager_t *sync_st = NULL, *async_st = NULL;
  ofl_tensor_t *src[NT] = {0};
  ofl_named_tensor_t named[NT];
  char path[2][256];
  for (int r = 0; r < 2; r++)
    snprintf(path[r], sizeof(path[r]), "/tmp/ofl_gpu_stager_%d_%d.safetensors",
             (int)getpid(), r);
  if (gpu_open_device(0, &dev) != OFL_SUCCESS) {
    printf("Bail out! device: %s\n", ofl_last_error());
    return 1;
  }
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  int bad = ofl_pool_create(dev, &pp, &pool) != OFL_SUCCESS;
  ofl_stream_t *cs = ofl_device_compute_stream(dev);
  size_t total = 0;
  for (int i = 0; i < NT && !bad; i++) {
    size_t bytes = 0;
    ofl_shape_bytes(specs[i].shape, specs[i].ndim, specs[i].dtype, &bytes);
    bad |= ofl_pool_alloc(pool, specs[i].shape, specs[i].ndim, specs[i].dtype,
                          cs, &src[i]) != OFL_SUCCESS;
    bad |= !bad && t_fill(dev, ofl_tensor_data(src[i]), bytes,
                          seed_of(0, i)) != OFL_SUCCESS;
    named[i] = (ofl_named_tensor_t){specs[i].name, src[i]};
    total += bytes;
  }
  tap_ok(!bad, "%d device tensors (%zu bytes) filled through H2D copies", NT,
         total);
  if (bad) {
    tap_diag("%s", ofl_last_error());
    return tap_done();
  }

  /* round 0: blocking staging, then save */
  ofl_stager_params_t sp = OFL_STAGER_PARAMS_INIT;
  sp.pin_memory = 1;
  ofl_staged_t *set = NULL;
  ofl_save_future_t *fut = NULL;
  ofl_safetensors_kv_t meta[1] = {{"step", "0"}};
  ofl_status_t s = ofl_stager_create(dev, &sp, &sync_st);
  if (s == OFL_SUCCESS)
    s = ofl_stager_stage(sync_st, named, NT, &set);
  if (s == OFL_SUCCESS)
    s = ofl_stager_save(sync_st, set, path[0], meta, 1, &fut);
  if (s == OFL_SUCCESS)
    s = ofl_save_wait(fut, 60000);
  if (s != OFL_SUCCESS)
    tap_diag("blocking stage/save: %s", ofl_last_error());
  tap_ok(s == OFL_SUCCESS && ofl_save_bytes(fut) > total,
         "blocking stage and save of %s (%llu bytes)", path[0],
         (unsigned long long)ofl_save_bytes(fut));
  ofl_save_release(fut);
  ofl_staged_release(set);
  check_t c = verify(dev, pool, path[0], 0);
  tap_ok(c.wrong_bytes == 0 && c.wrong_meta == 0,
         "blocking: the file read back and restored to the device equals the "
         "sources byte for byte (%ld wrong bytes, %ld wrong entries)",
         c.wrong_bytes, c.wrong_meta);

  /* round 1: new contents, async staging; the sources are overwritten right
   * after the join and the file must still hold round 1's bytes */
  for (int i = 0; i < NT; i++) {
    size_t bytes = ofl_tensor_bytes(src[i]);
    bad |= t_fill(dev, ofl_tensor_data(src[i]), bytes, seed_of(1, i)) !=
           OFL_SUCCESS;
  }
  sp.async_staging = 1;
  set = NULL;
  fut = NULL;
  meta[0].value = "1";
  s = ofl_stager_create(dev, &sp, &async_st);
  if (s == OFL_SUCCESS)
    s = ofl_stager_stage(async_st, named, NT, &set);
  int must_sync = async_st ? ofl_stager_should_synchronize_after_execute(async_st) : 0;
  if (s == OFL_SUCCESS)
    s = ofl_stager_synchronize(async_st, 60000);
  for (int i = 0; i < NT && s == OFL_SUCCESS; i++)
    bad |= t_fill(dev, ofl_tensor_data(src[i]), ofl_tensor_bytes(src[i]),
                  seed_of(2, i)) != OFL_SUCCESS;
  if (s == OFL_SUCCESS)
    s = ofl_stager_save(async_st, set, path[1], meta, 1, &fut);
  if (s == OFL_SUCCESS)
    s = ofl_save_wait(fut, 60000);
  if (s != OFL_SUCCESS)
    tap_diag("async stage/save: %s", ofl_last_error());
  tap_ok(s == OFL_SUCCESS && !bad && must_sync == 1,
         "async stage (synchronize after execute: %d), sources overwritten "
         "after the join, then saved",
         must_sync);
  ofl_save_release(fut);
  ofl_staged_release(set);
  c = verify(dev, pool, path[1], 1);
  tap_ok(c.wrong_bytes == 0 && c.wrong_meta == 0,
         "async: the file holds the staged snapshot, not the later writes "
         "(%ld wrong bytes, %ld wrong entries)",
         c.wrong_bytes, c.wrong_meta);

  int fin = ofl_stager_destroy(sync_st) != OFL_SUCCESS;
  fin |= ofl_stager_destroy(async_st) != OFL_SUCCESS;
  for (int i = 0; i < NT; i++)
    fin |= ofl_tensor_destroy(src[i]) != OFL_SUCCESS;
  ofl_pool_destroy(pool);
  ofl_device_close(dev);
  fin |= unlink(path[0]) != 0 || unlink(path[1]) != 0;
  tap_ok(!fin, "stagers, tensors and files released");
  return tap_done();
}
