/* Staging under threads (run by the tsan setup): a training loop that
 * updates device tensors, stages them asynchronously into a cached pinned
 * copy, joins, and saves every step in the background with two saves in
 * flight, then checks every file byte for byte. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "tests/support/devmem.h"
#include "tests/support/tap.h"

enum { NT = 4, STEPS = 12 };

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  uint32_t x = seed * 2654435761u + 3;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

int main(void) {
  tap_plan(5);
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = t_backend(); /* the backend under test (tests/support/devmem.h) */
  ofl_device_t *dev = NULL;
  if (!tap_ok(ofl_device_open(&dp, &dev) == OFL_SUCCESS, "device opens"))
    return tap_done();
  char dir[] = "/tmp/ofl-stress-staging.XXXXXX";
  if (mkdtemp(dir) == NULL)
    return 1;

  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  p.async_staging = 1;
  p.max_inflight_saves = 2;
  ofl_stager_t *s = NULL;
  tap_ok(ofl_stager_create(dev, &p, &s) == OFL_SUCCESS, "stager created");

  const int64_t shapes[NT][2] = {{256, 257}, {3, 5}, {1024, 64}, {7, 1}};
  const ofl_dtype_t dts[NT] = {OFL_DTYPE_F32, OFL_DTYPE_BF16, OFL_DTYPE_I8,
                               OFL_DTYPE_I64};
  const char *names[NT] = {"w0", "b0", "emb", "count"};
  ofl_tensor_t *t[NT];
  void *mem[NT];
  ofl_named_tensor_t nt[NT];
  unsigned char *host[NT];
  for (int i = 0; i < NT; i++) {
    size_t bytes = 0;
    ofl_shape_bytes(shapes[i], 2, dts[i], &bytes);
    ofl_device_malloc(dev, bytes, &mem[i]);
    ofl_tensor_wrap(mem[i], shapes[i], 2, dts[i], OFL_LOC_DEVICE, NULL, NULL,
                    &t[i]);
    host[i] = malloc(bytes);
    nt[i] = (ofl_named_tensor_t){names[i], t[i]};
  }

  ofl_save_future_t *f[STEPS] = {0};
  int stage_errors = 0, save_errors = 0;
  ofl_stream_t *compute = ofl_device_compute_stream(dev);
  for (int step = 0; step < STEPS; step++) {
    for (int i = 0; i < NT; i++) { /* the training update */
      size_t bytes = ofl_tensor_bytes(t[i]);
      pattern(host[i], bytes, (unsigned)(step * 10 + i));
      ofl_memcpy_async(mem[i], host[i], bytes, OFL_COPY_H2D, compute);
    }
    ofl_stream_synchronize(compute, -1);
    ofl_staged_t *set = NULL;
    if (ofl_stager_stage(s, nt, NT, &set) != OFL_SUCCESS ||
        ofl_stager_synchronize(s, -1) != OFL_SUCCESS) {
      stage_errors++;
      ofl_staged_release(set);
      continue;
    }
    char path[128];
    snprintf(path, sizeof path, "%s/step%02d.safetensors", dir, step);
    if (ofl_stager_save(s, set, path, NULL, 0, &f[step]) != OFL_SUCCESS)
      save_errors++;
    ofl_staged_release(set);
  }
  for (int step = 0; step < STEPS; step++) {
    if (f[step] != NULL && ofl_save_wait(f[step], -1) != OFL_SUCCESS)
      save_errors++;
    ofl_save_release(f[step]);
  }
  tap_ok(stage_errors == 0 && save_errors == 0,
         "%d steps staged and saved (stage errors %d, save errors %d)", STEPS,
         stage_errors, save_errors);

  size_t wrong = 0;
  int unreadable = 0;
  for (int step = 0; step < STEPS; step++) {
    char path[128];
    snprintf(path, sizeof path, "%s/step%02d.safetensors", dir, step);
    ofl_safetensors_t *rd = NULL;
    if (ofl_safetensors_open(path, &rd) != OFL_SUCCESS) {
      unreadable++;
      continue;
    }
    for (int i = 0; i < NT; i++) {
      ofl_safetensors_entry_t e;
      if (ofl_safetensors_find(rd, names[i], &e) != OFL_SUCCESS) {
        unreadable++;
        continue;
      }
      pattern(host[i], e.bytes, (unsigned)(step * 10 + i));
      for (size_t k = 0; k < e.bytes; k++)
        wrong += ((const unsigned char *)e.data)[k] != host[i][k];
    }
    ofl_safetensors_close(rd);
  }
  tap_ok(unreadable == 0 && wrong == 0,
         "every file holds its own step's bytes (unreadable %d, wrong %zu)",
         unreadable, wrong);
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  tap_ok(st.buffer_allocs == 1 && st.cache_reuses == STEPS - 1,
         "one pinned copy for all steps (allocs %llu, reuses %llu)",
         (unsigned long long)st.buffer_allocs,
         (unsigned long long)st.cache_reuses);
  ofl_stager_destroy(s);
  for (int i = 0; i < NT; i++) {
    ofl_tensor_destroy(t[i]);
    ofl_device_free(dev, mem[i]);
    free(host[i]);
  }
  ofl_device_close(dev);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  (void)!system(cmd);
  return tap_done();
}
