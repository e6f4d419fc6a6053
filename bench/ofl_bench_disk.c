/* Disk tier throughput beside fio on the same file system in the same run,
 * and an offload workload beside a one-file-per-tensor baseline.
 *
 *   1. sequential write then read of COUNT x MIB MiB: the disk store
 *      (io_uring, O_DIRECT where taken) against fio --direct=1
 *      --ioengine=io_uring with the same block size and queue depth, best
 *      of OFL_BENCH_DISK_REPS (5) runs each, alternating;
 *   2. COUNT tensors of MIB MiB offloaded (copied into a bounce buffer and
 *      written) then reloaded in reverse order with prefetch PREFETCH
 *      tensors ahead (read, copied out): the store, direct and buffered,
 *      against write()/read() of one file per tensor, no fsync, with the
 *      same copies in and out; best of the reps.
 *
 * usage: ofl_bench_disk [dir] (default OFL_DISK_DIR, TMPDIR or /tmp);
 * OFL_BENCH_DISK_COUNT (64), OFL_BENCH_DISK_MIB (16), OFL_DISK_QUEUE_DEPTH,
 * OFL_DISK_BLOCK, OFL_DISK_PREFETCH (used as given; the bench default is 4). */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"
#include "bench/bench.h"

static ofl_device_t *dev;
static const char *dir;
static int count, qd, prefetch;
static size_t tensor_bytes, block;

static double now_s(void) { return (double)ofl__now_ns() / 1e9; }

static double gbps(double bytes, double s) {
  return s > 0 ? bytes / s / 1e9 : 0;
}

/* ---- fio ------------------------------------------------------------------
 */

/* bw_bytes of the "read" or "write" section of fio's JSON output. */
static double fio_bw(const char *json, const char *section) {
  char key[32];
  snprintf(key, sizeof key, "\"%s\" : {", section);
  const char *p = strstr(json, key);
  if (p == NULL)
    return -1;
  p = strstr(p, "\"bw_bytes\" : ");
  return p != NULL ? strtod(p + 13, NULL) : -1;
}

static double run_fio(const char *rw, size_t total) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "fio --name=ofl-bench --filename=%s/ofl-bench-fio.dat --rw=%s "
           "--bs=%zu --iodepth=%d --direct=1 --ioengine=io_uring --size=%zu "
           "--output-format=json 2>/dev/null",
           dir, rw, block, qd, total);
  FILE *f = popen(cmd, "r");
  if (f == NULL)
    return -1;
  size_t cap = 1 << 20, n = 0;
  char *buf = malloc(cap);
  size_t got;
  while (buf != NULL && (got = fread(buf + n, 1, cap - 1 - n, f)) > 0) {
    n += got;
    if (n + 1 == cap) {
      char *nb = realloc(buf, cap *= 2);
      if (nb == NULL)
        break;
      buf = nb;
    }
  }
  int rc = pclose(f);
  if (buf == NULL)
    return -1;
  buf[n] = '\0';
  double bw =
      rc == 0 ? fio_bw(buf, strcmp(rw, "write") == 0 ? "write" : "read") : -1;
  free(buf);
  return bw / 1e9;
}

/* ---- the store -------------------------------------------------------------
 */

static ofl_disk_t *open_store(ofl_disk_direct_t direct) {
  ofl_disk_params_t p = OFL_DISK_PARAMS_INIT;
  p.dev = dev;
  p.dir = dir;
  p.budget_bytes = 0;
  p.queue_depth = qd;
  p.block_bytes = block;
  p.direct = direct;
  p.checksum = 0;
  ofl_disk_t *d = NULL;
  CHECK(ofl_disk_open(&p, &d));
  return d;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i += 4096)
    memset(p + i, (int)(seed * 31 + i / 4096) & 0xff,
           n - i < 4096 ? n - i : 4096);
}

/* Sequential write then read of every extent; GB/s by wall time. */
static void store_sequential(double *w, double *r, ofl_disk_stats_t *st) {
  ofl_disk_t *d = open_store(OFL_DISK_DIRECT_AUTO);
  ofl_disk_extent_t **e = calloc((size_t)count, sizeof *e);
  for (int i = 0; i < count; i++) {
    CHECK(ofl_disk_extent_create(d, tensor_bytes, &e[i]));
    fill(ofl_disk_extent_data(e[i]), tensor_bytes, (unsigned)i);
  }
  double t0 = now_s();
  for (int i = 0; i < count; i++)
    CHECK(ofl_disk_extent_write(e[i]));
  for (int i = 0; i < count; i++)
    CHECK(ofl_disk_extent_wait(e[i], -1));
  double t1 = now_s();
  for (int i = 0; i < count; i++)
    CHECK(ofl_disk_extent_prefetch(e[i]));
  size_t wrong = 0;
  for (int i = 0; i < count; i++) {
    void *p = NULL;
    CHECK(ofl_disk_extent_reload(e[i], -1, &p));
    wrong +=
        ((unsigned char *)p)[tensor_bytes - 1] !=
        (unsigned char)(((unsigned)i * 31 + (tensor_bytes - 1) / 4096) & 0xff);
  }
  double t2 = now_s();
  double total = (double)tensor_bytes * count;
  *w = gbps(total, t1 - t0);
  *r = gbps(total, t2 - t1);
  ofl_disk_get_stats(d, st);
  if (wrong)
    printf("# WRONG DATA in %zu extents\n", wrong);
  for (int i = 0; i < count; i++)
    ofl_disk_extent_destroy(e[i]);
  free(e);
  ofl_disk_close(d);
}

/* The workload: offload all, reload in reverse with prefetch. src are the
 * "device" tensors, dst the reload target. Returns seconds. */
static double store_workload(ofl_disk_t *d, unsigned char **src,
                             unsigned char *dst, size_t *wrong) {
  ofl_disk_extent_t **e = calloc((size_t)count, sizeof *e);
  double t0 = now_s();
  for (int i = 0; i < count; i++) {
    CHECK(ofl_disk_extent_create(d, tensor_bytes, &e[i]));
    memcpy(ofl_disk_extent_data(e[i]), src[i], tensor_bytes); /* the D2H */
    CHECK(ofl_disk_extent_write(e[i]));
  }
  for (int i = count - 1; i >= 0; i--) {
    for (int k = i - 1; k >= 0 && k >= i - prefetch; k--)
      CHECK(ofl_disk_extent_prefetch(e[k]));
    void *p = NULL;
    CHECK(ofl_disk_extent_reload(e[i], -1, &p));
    memcpy(dst, p, tensor_bytes); /* the H2D */
    *wrong += memcmp(dst, src[i], tensor_bytes) != 0;
    CHECK(ofl_disk_extent_destroy(e[i]));
  }
  double t = now_s() - t0;
  free(e);
  return t;
}

/* Warm-up iteration, then the best of reps; stalls and hits per timed
 * iteration. */
static void mode_run(ofl_disk_direct_t direct, int reps, unsigned char **src,
                     unsigned char *dst, double *best, size_t *wrong,
                     ofl_disk_stats_t *st) {
  ofl_disk_t *d = open_store(direct);
  store_workload(d, src, dst, wrong);
  ofl_disk_stats_t s0;
  ofl_disk_get_stats(d, &s0);
  for (int r = 0; r < reps; r++) {
    double t = store_workload(d, src, dst, wrong);
    *best = t < *best ? t : *best;
  }
  ofl_disk_get_stats(d, st);
  st->stalls = (st->stalls - s0.stalls) / (uint64_t)reps;
  st->prefetch_hits = (st->prefetch_hits - s0.prefetch_hits) / (uint64_t)reps;
  ofl_disk_close(d);
}

/* One file per tensor, write() then read(), no fsync; like the seed's
 * offloader, the tensor is first copied to a host buffer (its .cpu()) and
 * copied back after the read (its .to(device)), so both sides make the same
 * memory copies. */
static double baseline_workload(unsigned char **src, unsigned char *dst,
                                unsigned char *host, size_t *wrong) {
  char path[4200];
  double t0 = now_s();
  for (int i = 0; i < count; i++) {
    snprintf(path, sizeof path, "%s/ofl-bench-base-%d.bin", dir, i);
    memcpy(host, src[i], tensor_bytes); /* the D2H */
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || write(fd, host, tensor_bytes) != (ssize_t)tensor_bytes) {
      perror(path);
      exit(1);
    }
    close(fd);
  }
  for (int i = count - 1; i >= 0; i--) {
    snprintf(path, sizeof path, "%s/ofl-bench-base-%d.bin", dir, i);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, host, tensor_bytes) != (ssize_t)tensor_bytes) {
      perror(path);
      exit(1);
    }
    close(fd);
    unlink(path);
    memcpy(dst, host, tensor_bytes); /* the H2D */
    *wrong += memcmp(dst, src[i], tensor_bytes) != 0;
  }
  return now_s() - t0;
}

static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v != NULL && *v ? atoi(v) : dflt;
}

int main(int argc, char **argv) {
  setenv("OFL_BACKEND", "host", 0);
  ofl_config_reload();
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  dp.strict = 0;
  CHECK(ofl_device_open(&dp, &dev));

  dir = argc > 1 ? argv[1] : NULL;
  if (dir == NULL) {
    CHECK(ofl__config_str("OFL_DISK_DIR", &dir));
    if (dir == NULL || !*dir)
      dir = getenv("TMPDIR");
    if (dir == NULL || !*dir)
      dir = "/tmp";
  }
  count = env_int("OFL_BENCH_DISK_COUNT", 64);
  tensor_bytes = (size_t)env_int("OFL_BENCH_DISK_MIB", 16) << 20;
  int64_t v = 0;
  CHECK(ofl__config_int("OFL_DISK_QUEUE_DEPTH", &v));
  qd = (int)v;
  CHECK(ofl__config_size("OFL_DISK_BLOCK", &block));
  prefetch = env_int("OFL_DISK_PREFETCH", 4);
  size_t total = tensor_bytes * (size_t)count;

  printf("# ofl_bench_disk: dir %s, %d x %zu MiB = %zu MiB, block %zu KiB, "
         "queue depth %d, prefetch %d\n",
         dir, count, tensor_bytes >> 20, total >> 20, block >> 10, qd,
         prefetch);

  /* 1. sequential, beside fio: best of reps, alternating */
  int reps = env_int("OFL_BENCH_DISK_REPS", 5);
  char fiofile[4200];
  snprintf(fiofile, sizeof fiofile, "%s/ofl-bench-fio.dat", dir);
  double fw = -1, fr = -1, sw = 0, sr = 0;
  ofl_disk_stats_t st;
  for (int r = 0; r < reps; r++) {
    double a = run_fio("write", total), b = run_fio("read", total), c, e;
    unlink(fiofile);
    fw = a > fw ? a : fw;
    fr = b > fr ? b : fr;
    sync();
    store_sequential(&c, &e, &st);
    sync();
    sw = c > sw ? c : sw;
    sr = e > sr ? e : sr;
  }
  printf("\n## sequential I/O, same file system, same run\n");
  printf("%-34s %10s %10s\n", "", "write GB/s", "read GB/s");
  if (fw > 0 && fr > 0)
    printf("%-34s %10.3f %10.3f\n", "fio O_DIRECT io_uring", fw, fr);
  else
    printf("%-34s %10s %10s\n", "fio O_DIRECT io_uring", "n/a", "n/a");
  printf("%-34s %10.3f %10.3f\n",
         st.direct ? "ofl disk store (O_DIRECT)" : "ofl disk store (buffered)",
         sw, sr);
  if (fw > 0 && fr > 0)
    printf("%-34s %10.2f %10.2f   (goal >= 0.80)\n", "ratio ofl / fio", sw / fw,
           sr / fr);
  printf("# store: engine %s, queue depth reached %d, busy-time GB/s write "
         "%.3f read %.3f\n",
         st.uring ? "io_uring" : "threads", st.queue_depth_max, st.write_gbps,
         st.read_gbps);

  /* 2. the offload workload, beside one file per tensor */
  unsigned char **src = calloc((size_t)count, sizeof *src);
  unsigned char *dst = malloc(tensor_bytes);
  for (int i = 0; i < count; i++) {
    src[i] = malloc(tensor_bytes);
    if (src[i] == NULL || dst == NULL) {
      fprintf(stderr, "out of memory\n");
      return 1;
    }
    fill(src[i], tensor_bytes, (unsigned)i + 7);
  }
  unsigned char *host = malloc(tensor_bytes);
  if (host == NULL)
    return 1;
  size_t wrong_d = 0, wrong_b = 0, wrong_p = 0;
  /* One store per mode, as in training: the first iteration (untimed)
   * fills the bounce pool and grows the file; the timed ones are steady
   * state. The baseline's host buffer is allocated once too. The modes run
   * one after the other with sync() between, so that one's dirty pages are
   * not written back during another's timing. */
  double td = 1e30, tb = 1e30, tp = 1e30;
  ofl_disk_stats_t sd, sb;
  mode_run(OFL_DISK_DIRECT_AUTO, reps, src, dst, &td, &wrong_d, &sd);
  sync();
  for (int r = 0; r < reps; r++) {
    double c = baseline_workload(src, dst, host, &wrong_p);
    tp = c < tp ? c : tp;
    sync();
  }
  mode_run(OFL_DISK_DIRECT_OFF, reps, src, dst, &tb, &wrong_b, &sb);
  sync();
  free(host);
  double moved = 2.0 * (double)total;
  printf("\n## %d tensors of %zu MiB offloaded, reloaded in reverse with "
         "prefetch %d\n",
         count, tensor_bytes >> 20, prefetch);
  printf("%-34s %9s %9s %8s %8s %7s\n", "", "time s", "GB/s", "stalls", "hits",
         "wrong");
  printf("%-34s %9.3f %9.3f %8llu %8llu %7zu\n", "ofl disk store, O_DIRECT", td,
         gbps(moved, td), (unsigned long long)sd.stalls,
         (unsigned long long)sd.prefetch_hits, wrong_d);
  printf("%-34s %9.3f %9.3f %8llu %8llu %7zu\n", "ofl disk store, buffered", tb,
         gbps(moved, tb), (unsigned long long)sb.stalls,
         (unsigned long long)sb.prefetch_hits, wrong_b);
  printf("%-34s %9.3f %9.3f %8s %8s %7zu\n", "file per tensor, write/read", tp,
         gbps(moved, tp), "-", "-", wrong_p);
  printf("%-34s %9.2f\n", "speedup O_DIRECT store / per-file", tp / td);
  printf("%-34s %9.2f\n", "speedup buffered store / per-file", tp / tb);
  printf("# GB/s counts bytes both ways (offload + reload); the per-file "
         "baseline never syncs, so its bytes may stay in the page cache\n");
  for (int i = 0; i < count; i++)
    free(src[i]);
  free(src);
  free(dst);
  ofl_device_close(dev);
  return wrong_d + wrong_b + wrong_p ? 1 : 0;
}
