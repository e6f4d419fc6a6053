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
 *      same copies in and out; best of the reps;
 *   3. the same workload with host memory short, which is when a disk tier
 *      is used: the process moves into a memory cgroup (v1 or v2) whose
 *      limit, OFL_BENCH_DISK_HOST_MIB (256) plus 64 MiB of slack, holds
 *      what it allocates from then on, page cache included; the store's
 *      bounce pool gets OFL_BENCH_DISK_HOST_MIB as its budget and an offload
 *      that finds it full waits for the oldest write. Needs root and a
 *      writable memory controller, else the part says n/a.
 *
 * Part 1 runs the store with CRC32C off and on (OFL_DISK_CHECKSUM, on by
 * default) and prints the cost; parts 2 and 3 use OFL_DISK_CHECKSUM.
 *
 * usage: ofl_bench_disk [dir] (default OFL_DISK_DIR, TMPDIR or /tmp);
 * OFL_BENCH_DISK_COUNT (64), OFL_BENCH_DISK_MIB (16), OFL_DISK_QUEUE_DEPTH,
 * OFL_DISK_BLOCK, OFL_DISK_PREFETCH (used as given; the bench default is 4). */
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "disk/disk_internal.h"
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

/* checksum: 0 or 1, -1: OFL_DISK_CHECKSUM */
static ofl_disk_t *open_store(ofl_disk_direct_t direct, size_t bounce,
                              size_t keep, int checksum) {
  ofl_disk_params_t p = OFL_DISK_PARAMS_INIT;
  p.dev = dev;
  p.bounce_budget_bytes = bounce;
  p.keep_bytes = keep;
  p.dir = dir;
  p.budget_bytes = 0;
  p.queue_depth = qd;
  p.block_bytes = block;
  p.direct = direct;
  p.checksum = checksum;
  ofl_disk_t *d = NULL;
  CHECK(ofl_disk_open(&p, &d));
  return d;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i += 4096)
    memset(p + i, (int)(seed * 31 + i / 4096) & 0xff,
           n - i < 4096 ? n - i : 4096);
}

/* Sequential write then read of every extent; GB/s by wall time. No kept
 * buffers: every byte is read back from the file, as fio reads it. */
static void store_sequential(int checksum, double *w, double *r,
                             ofl_disk_stats_t *st) {
  ofl_disk_t *d = open_store(OFL_DISK_DIRECT_AUTO, 0, 0, checksum);
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

/* Creates an extent; when the bounce pool is full, waits for the oldest
 * write still in flight (*oldest moves up) and tries again. */
static void create_with_wait(ofl_disk_t *d, ofl_disk_extent_t **e, int i,
                             int *oldest) {
  for (;;) {
    ofl_status_t st = ofl_disk_extent_create(d, tensor_bytes, &e[i]);
    if (st != OFL_ERR_NO_MEMORY || *oldest >= i) {
      CHECK(st);
      return;
    }
    CHECK(ofl_disk_extent_wait(e[(*oldest)++], -1));
  }
}

/* The workload: offload all, reload in reverse with prefetch. src are the
 * "device" tensors, dst the reload target. A prefetch that finds no bounce
 * buffer is left to the reload. Returns seconds. */
static double store_workload(ofl_disk_t *d, unsigned char **src,
                             unsigned char *dst, size_t *wrong) {
  ofl_disk_extent_t **e = calloc((size_t)count, sizeof *e);
  int oldest = 0;
  double t0 = now_s();
  for (int i = 0; i < count; i++) {
    create_with_wait(d, e, i, &oldest);
    memcpy(ofl_disk_extent_data(e[i]), src[i], tensor_bytes); /* the D2H */
    CHECK(ofl_disk_extent_write(e[i]));
  }
  for (int i = count - 1; i >= 0; i--) {
    for (int k = i - 1; k >= 0 && k >= i - prefetch; k--) {
      ofl_status_t st = ofl_disk_extent_prefetch(e[k]);
      if (st != OFL_ERR_NO_MEMORY)
        CHECK(st);
    }
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
static void mode_run(ofl_disk_direct_t direct, size_t bounce, int reps,
                     unsigned char **src, unsigned char *dst, double *best,
                     size_t *wrong, ofl_disk_stats_t *st) {
  ofl_disk_t *d = open_store(direct, bounce, OFL_DISK_FROM_ENV, -1);
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
  st->keep_hits = (st->keep_hits - s0.keep_hits) / (uint64_t)reps;
  st->bytes_read = (st->bytes_read - s0.bytes_read) / (uint64_t)reps;
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

/* One row of the table for a store run: stats per timed iteration. */
static void store_row(const char *name, double t, double moved,
                      const ofl_disk_stats_t *st, size_t wrong) {
  printf("%-34s %9.3f %9.3f %8llu %8llu %8llu %9.0f %7zu\n", name, t,
         gbps(moved, t), (unsigned long long)st->stalls,
         (unsigned long long)st->prefetch_hits,
         (unsigned long long)st->keep_hits, (double)st->bytes_read / 1048576.0,
         wrong);
}

/* The three ways (store direct, per-file, store buffered) one after the
 * other with sync() between, so that one's dirty pages are not written back
 * during another's timing; one store per mode, as in training: its first
 * iteration (untimed) fills the bounce pool and grows the file. Prints the
 * table; returns the wrong tensors. */
static size_t compare(int reps, size_t bounce, unsigned char **src,
                      unsigned char *dst, unsigned char *host) {
  size_t wrong_d = 0, wrong_b = 0, wrong_p = 0;
  double td = 1e30, tb = 1e30, tp = 1e30;
  ofl_disk_stats_t sd, sb;
  mode_run(OFL_DISK_DIRECT_AUTO, bounce, reps, src, dst, &td, &wrong_d, &sd);
  sync();
  for (int r = 0; r < reps; r++) {
    double c = baseline_workload(src, dst, host, &wrong_p);
    tp = c < tp ? c : tp;
    sync();
  }
  mode_run(OFL_DISK_DIRECT_OFF, bounce, reps, src, dst, &tb, &wrong_b, &sb);
  sync();
  double moved = 2.0 * (double)tensor_bytes * count;
  printf("%-34s %9s %9s %8s %8s %8s %9s %7s\n", "", "time s", "GB/s", "stalls",
         "hits", "kept", "read MiB", "wrong");
  store_row(sd.direct ? "ofl disk store, O_DIRECT" : "ofl disk store, auto", td,
            moved, &sd, wrong_d);
  store_row("ofl disk store, buffered", tb, moved, &sb, wrong_b);
  printf("%-34s %9.3f %9.3f %8s %8s %8s %9s %7zu\n",
         "file per tensor, write/read", tp, gbps(moved, tp), "-", "-", "-", "-",
         wrong_p);
  printf("%-34s %9.2f   (goal > 1)\n",
         sd.direct ? "speedup O_DIRECT store / per-file"
                   : "speedup auto store / per-file",
         tp / td);
  printf("%-34s %9.2f\n", "speedup buffered store / per-file", tp / tb);
  printf("# GB/s counts bytes both ways (offload + reload); kept: reloads "
         "served by buffers kept after their write (OFL_DISK_KEEP %zu MiB), "
         "read MiB: bytes read back per iteration\n",
         sd.keep_bytes >> 20);
  return wrong_d + wrong_b + wrong_p;
}

/* ---- host memory limit: a memory cgroup ------------------------------------
 * v1 (memory controller mounted at /sys/fs/cgroup/memory) or v2 (memory in
 * /sys/fs/cgroup's controllers). What the process allocates after it moved
 * in, page cache included, is charged there. */
static char cg_path[512], cg_home[512];
static bool cg_v2;

static bool write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return false;
  bool ok = fputs(text, f) >= 0;
  return fclose(f) == 0 && ok;
}

static uint64_t read_u64(const char *path) {
  FILE *f = fopen(path, "r");
  unsigned long long v = 0;
  if (f != NULL) {
    if (fscanf(f, "%llu", &v) != 1)
      v = 0;
    fclose(f);
  }
  return v;
}

static bool has_memory_controller_v2(void) {
  FILE *f = fopen("/sys/fs/cgroup/cgroup.controllers", "r");
  char line[512] = "";
  if (f == NULL)
    return false;
  bool ok = fgets(line, sizeof line, f) != NULL && strstr(line, "memory");
  fclose(f);
  return ok;
}

/* NULL when the process is in a new cgroup limited to `limit` bytes, else
 * why not. */
static const char *cg_enter(size_t limit) {
  const char *root;
  if (access("/sys/fs/cgroup/memory/memory.limit_in_bytes", F_OK) == 0) {
    root = "/sys/fs/cgroup/memory";
    cg_v2 = false;
  } else if (has_memory_controller_v2()) {
    root = "/sys/fs/cgroup";
    cg_v2 = true;
  } else {
    return "no memory cgroup controller (v1 or v2) on this machine";
  }
  snprintf(cg_home, sizeof cg_home, "%s/cgroup.procs", root);
  snprintf(cg_path, sizeof cg_path, "%s/ofl-bench-disk-%d", root,
           (int)getpid());
  if (mkdir(cg_path, 0755) != 0)
    return "cannot create a memory cgroup (needs root and a writable "
           "cgroup file system)";
  char file[600], num[32];
  snprintf(num, sizeof num, "%zu", limit);
  snprintf(file, sizeof file, "%s/%s", cg_path,
           cg_v2 ? "memory.max" : "memory.limit_in_bytes");
  bool ok = write_file(file, num);
  if (ok && cg_v2) { /* no swap either: the limit is what stays in RAM */
    snprintf(file, sizeof file, "%s/memory.swap.max", cg_path);
    (void)write_file(file, "0");
  }
  snprintf(num, sizeof num, "%d", (int)getpid());
  snprintf(file, sizeof file, "%s/cgroup.procs", cg_path);
  if (!ok || !write_file(file, num)) {
    rmdir(cg_path);
    return "cannot set the memory cgroup's limit or move into it";
  }
  return NULL;
}

static uint64_t cg_peak(void) {
  char file[600];
  snprintf(file, sizeof file, "%s/%s", cg_path,
           cg_v2 ? "memory.peak" : "memory.max_usage_in_bytes");
  return read_u64(file);
}

static void cg_leave(void) {
  char num[32];
  snprintf(num, sizeof num, "%d", (int)getpid());
  if (!write_file(cg_home, num) || rmdir(cg_path) != 0)
    fprintf(stderr, "# could not remove the cgroup %s\n", cg_path);
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
  double fw = -1, fr = -1, sw = 0, sr = 0, kw = 0, kr = 0;
  ofl_disk_stats_t st, kst;
  for (int r = 0; r < reps; r++) {
    double a = run_fio("write", total), b = run_fio("read", total), c, e;
    unlink(fiofile);
    fw = a > fw ? a : fw;
    fr = b > fr ? b : fr;
    sync();
    store_sequential(0, &c, &e, &st);
    sync();
    sw = c > sw ? c : sw;
    sr = e > sr ? e : sr;
    store_sequential(1, &c, &e, &kst);
    sync();
    kw = c > kw ? c : kw;
    kr = e > kr ? e : kr;
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
  printf("%-34s %10.3f %10.3f\n",
         "  + CRC32C (the default)", kw, kr);
  if (fw > 0 && fr > 0)
    printf("%-34s %10.2f %10.2f   (goal >= 0.80)\n", "ratio ofl / fio", sw / fw,
           sr / fr);
  if (fw > 0 && fr > 0)
    printf("%-34s %10.2f %10.2f\n", "ratio ofl + CRC32C / fio", kw / fw,
           kr / fr);
  printf("%-34s %10.2f %10.2f   (CRC32C %s)\n", "ratio with / without CRC32C",
         sw > 0 ? kw / sw : 0.0, sr > 0 ? kr / sr : 0.0,
         ofl__crc32c_hw_available() ? "sse4.2" : "table");
  printf("# store: engine %s, queue depth reached %d, busy-time GB/s write "
         "%.3f read %.3f\n",
         st.uring ? "io_uring" : "threads", st.queue_depth_max, st.write_gbps,
         st.read_gbps);

  /* 2. the offload workload, beside one file per tensor */
  unsigned char **src = calloc((size_t)count, sizeof *src);
  unsigned char *dst = malloc(tensor_bytes);
  unsigned char *host = malloc(tensor_bytes);
  if (src == NULL || dst == NULL || host == NULL) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (int i = 0; i < count; i++) {
    src[i] = malloc(tensor_bytes);
    if (src[i] == NULL) {
      fprintf(stderr, "out of memory\n");
      return 1;
    }
    fill(src[i], tensor_bytes, (unsigned)i + 7);
  }
  memset(dst, 0, tensor_bytes);
  memset(host, 0, tensor_bytes);
  size_t wrong = 0;
  printf("\n## %d tensors of %zu MiB offloaded, reloaded in reverse with "
         "prefetch %d; host memory not limited\n",
         count, tensor_bytes >> 20, prefetch);
  wrong += compare(reps, 0, src, dst, host);
  printf("# the per-file baseline never syncs: here its bytes stay in the "
         "page cache and are read back from memory\n");

  /* 3. the same with host memory short */
  size_t host_mib = (size_t)env_int("OFL_BENCH_DISK_HOST_MIB", 256);
  size_t limit = (host_mib + 64) << 20;
  printf("\n## the same workload, host memory short: %zu MiB for bounce "
         "buffers or page cache (memory cgroup limit %zu MiB)\n",
         host_mib, limit >> 20);
  sync();
  const char *why = cg_enter(limit);
  if (why != NULL) {
    printf("n/a: %s\n", why);
  } else {
    wrong += compare(reps, host_mib << 20, src, dst, host);
    printf("# peak memory charged to the cgroup: %.0f MiB\n",
           (double)cg_peak() / 1048576.0);
    cg_leave();
  }
  free(host);
  for (int i = 0; i < count; i++)
    free(src[i]);
  free(src);
  free(dst);
  ofl_device_close(dev);
  return wrong ? 1 : 0;
}
