/* Checkpoint staging and writing throughput on the host backend.
 *   staging: a state dict of T tensors (total B bytes) staged into a host
 *     copy (cached blocking, cached async + synchronize, uncached), beside
 *     memcpy of the same bytes in the same run;
 *   writer: ofl_stager_save of the staged set (safetensors, temp file,
 *     fsync, rename) beside fio sequential writes of the same size on the
 *     same file system (O_DIRECT io_uring, and buffered + fsync).
 * Usage: ofl_bench_staging [total_MiB [tensors [dir]]]
 * (defaults 512 MiB, 64 tensors, $TMPDIR or /tmp). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"
#include "bench/bench.h"

static double secs_since(uint64_t t0) {
  return (double)(ofl__now_ns() - t0) / 1e9;
}

static void row(const char *what, size_t bytes, double s, double ref_gbps) {
  double gbps = (double)bytes / s / 1e9;
  if (ref_gbps > 0)
    printf("%-36s %10.1f %9.2f %9.2f %7.2f\n", what, (double)bytes / 1048576.0,
           s * 1e3, gbps, gbps / ref_gbps);
  else
    printf("%-36s %10.1f %9.2f %9.2f %7s\n", what, (double)bytes / 1048576.0,
           s * 1e3, gbps, "1.00");
}

/* Runs fio and returns its write bandwidth in bytes/s, or 0 when fio is
 * missing or failed (the reason is printed). */
static double run_fio(const char *dir, size_t bytes, int direct,
                      const char *engine) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "fio --name=ofl-bench --filename=%s/ofl-bench-fio.tmp --rw=write "
           "--bs=4M --size=%zu --direct=%d --ioengine=%s --iodepth=8 "
           "--end_fsync=1 --output-format=json 2>/dev/null",
           dir, bytes, direct, engine);
  FILE *p = popen(cmd, "r");
  if (p == NULL)
    return 0;
  size_t cap = 1 << 16, len = 0;
  char *out = malloc(cap);
  size_t n;
  while ((n = fread(out + len, 1, cap - len - 1, p)) > 0) {
    len += n;
    if (len + 1 == cap)
      out = realloc(out, cap *= 2);
  }
  out[len] = '\0';
  int rc = pclose(p);
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s/ofl-bench-fio.tmp", dir);
  unlink(tmp);
  double bw = 0;
  const char *w = strstr(out, "\"write\" : {"); /* the section, not "rw" */
  const char *b = w ? strstr(w, "\"bw_bytes\"") : NULL;
  if (rc == 0 && b != NULL)
    bw = strtod(strchr(b, ':') + 1, NULL);
  free(out);
  return bw;
}

int main(int argc, char **argv) {
  size_t total_mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 512;
  int ntensors = argc > 2 ? atoi(argv[2]) : 64;
  const char *dir = argc > 3 ? argv[3]
                    : getenv("TMPDIR") ? getenv("TMPDIR")
                                       : "/tmp";
  if (total_mib == 0 || ntensors <= 0) {
    fprintf(stderr, "usage: %s [total_MiB [tensors [dir]]]\n", argv[0]);
    return 2;
  }
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  dp.strict = 0;
  ofl_device_t *dev = NULL;
  CHECK(ofl_device_open(&dp, &dev));

  /* The state dict: ntensors f32 tensors in device memory. */
  size_t per = total_mib * 1048576 / (size_t)ntensors / 4 * 4;
  size_t total = per * (size_t)ntensors;
  ofl_tensor_t **t = calloc((size_t)ntensors, sizeof *t);
  void **mem = calloc((size_t)ntensors, sizeof *mem);
  ofl_named_tensor_t *nt = calloc((size_t)ntensors, sizeof *nt);
  char (*names)[32] = calloc((size_t)ntensors, sizeof *names);
  for (int i = 0; i < ntensors; i++) {
    int64_t shape[1] = {(int64_t)(per / 4)};
    CHECK(ofl_device_malloc(dev, per, &mem[i]));
    memset(mem[i], i + 1, per);
    CHECK(ofl_tensor_wrap(mem[i], shape, 1, OFL_DTYPE_F32, OFL_LOC_DEVICE,
                          NULL, NULL, &t[i]));
    snprintf(names[i], sizeof names[i], "layers.%d.weight", i);
    nt[i] = (ofl_named_tensor_t){names[i], t[i]};
  }
  printf("# ofl_bench_staging: %d tensors, %.0f MiB, host backend, dir %s\n",
         ntensors, (double)total / 1048576.0, dir);
  printf("%-36s %10s %9s %9s %7s\n", "what", "MiB", "ms", "GB/s", "ratio");

  /* memcpy of the same bytes, tensor by tensor, into a touched buffer. */
  char *dst = malloc(total);
  memset(dst, 0, total);
  const int reps = 5;
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    uint64_t t0 = ofl__now_ns();
    for (int i = 0; i < ntensors; i++)
      memcpy(dst + (size_t)i * per, mem[i], per);
    double s = secs_since(t0);
    best = s < best ? s : best;
  }
  double ref = (double)total / best / 1e9;
  row("memcpy (same bytes, per tensor)", total, best, 0);
  free(dst);

  /* Cached blocking staging: the steady state (first call allocates). */
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  ofl_stager_t *s = NULL;
  CHECK(ofl_stager_create(dev, &p, &s));
  ofl_staged_t *set = NULL;
  uint64_t t0 = ofl__now_ns();
  CHECK(ofl_stager_stage(s, nt, (size_t)ntensors, &set));
  double first = secs_since(t0);
  ofl_staged_release(set);
  best = 1e30;
  for (int r = 0; r < reps; r++) {
    t0 = ofl__now_ns();
    CHECK(ofl_stager_stage(s, nt, (size_t)ntensors, &set));
    double sec = secs_since(t0);
    best = sec < best ? sec : best;
    ofl_staged_release(set);
  }
  row("stage cached, first call (allocates)", total, first, ref);
  row("stage cached blocking (steady)", total, best, ref);
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  printf("# cached: %llu buffer allocations in %llu stages\n",
         (unsigned long long)st.buffer_allocs, (unsigned long long)st.stages);
  ofl_stager_destroy(s);

  /* Cached async staging: stage returns after queuing; the join waits. */
  p.async_staging = 1;
  CHECK(ofl_stager_create(dev, &p, &s));
  CHECK(ofl_stager_stage(s, nt, (size_t)ntensors, &set));
  CHECK(ofl_stager_synchronize(s, -1));
  ofl_staged_release(set);
  best = 1e30;
  double best_return = 1e30;
  for (int r = 0; r < reps; r++) {
    t0 = ofl__now_ns();
    CHECK(ofl_stager_stage(s, nt, (size_t)ntensors, &set));
    double ret = secs_since(t0);
    CHECK(ofl_stager_synchronize(s, -1));
    double sec = secs_since(t0);
    best = sec < best ? sec : best;
    best_return = ret < best_return ? ret : best_return;
    ofl_staged_release(set);
  }
  row("stage cached async + synchronize", total, best, ref);
  printf("# async: stage returns after %.3f ms (the training thread's "
         "blocking time)\n",
         best_return * 1e3);
  ofl_stager_destroy(s);

  /* Uncached: a new host copy each call (allocation and page faults). */
  p = (ofl_stager_params_t)OFL_STAGER_PARAMS_INIT;
  CHECK(ofl_stager_create(dev, &p, &s));
  best = 1e30;
  for (int r = 0; r < 3; r++) {
    t0 = ofl__now_ns();
    CHECK(ofl_stager_stage(s, nt, (size_t)ntensors, &set));
    double sec = secs_since(t0);
    best = sec < best ? sec : best;
    ofl_staged_release(set);
  }
  row("stage uncached (allocates each call)", total, best, ref);
  ofl_stager_destroy(s);

  /* Writer: save the staged set, against fio on the same file system. */
  printf("\n%-36s %10s %9s %9s %7s\n", "writer", "MiB", "ms", "GB/s",
         "vs fio");
  double fio_direct = run_fio(dir, total, 1, "io_uring");
  const char *engine = "io_uring";
  if (fio_direct <= 0) {
    fio_direct = run_fio(dir, total, 1, "libaio");
    engine = "libaio";
  }
  double fio_buffered = run_fio(dir, total, 0, "psync");
  double fio_ref = fio_direct > 0 ? fio_direct / 1e9 : 0;
  char label[64];
  if (fio_direct > 0) {
    snprintf(label, sizeof label, "fio write direct %s", engine);
    row(label, total, (double)total / fio_direct, 0);
  } else {
    printf("%-36s (fio missing or failed; row skipped)\n", "fio write direct");
  }
  if (fio_buffered > 0)
    row("fio write buffered + fsync", total, (double)total / fio_buffered,
        fio_ref);

  p.cache_staged = 1;
  CHECK(ofl_stager_create(dev, &p, &s));
  CHECK(ofl_stager_stage(s, nt, (size_t)ntensors, &set));
  char path[1100];
  snprintf(path, sizeof path, "%s/ofl-bench.safetensors", dir);
  best = 1e30;
  uint64_t file_bytes = 0;
  for (int r = 0; r < 3; r++) {
    ofl_save_future_t *f = NULL;
    t0 = ofl__now_ns();
    CHECK(ofl_stager_save(s, set, path, NULL, 0, &f));
    CHECK(ofl_save_wait(f, -1));
    double sec = secs_since(t0);
    best = sec < best ? sec : best;
    file_bytes = ofl_save_bytes(f);
    ofl_save_release(f);
  }
  unlink(path);
  row("ofl save (safetensors, fsync)", (size_t)file_bytes, best, fio_ref);
  ofl_staged_release(set);
  ofl_stager_destroy(s);

  for (int i = 0; i < ntensors; i++) {
    ofl_tensor_destroy(t[i]);
    ofl_device_free(dev, mem[i]);
  }
  free(t), free(mem), free(nt), free(names);
  ofl_device_close(dev);
  return 0;
}
