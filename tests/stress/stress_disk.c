/* Disk store under threads (run by the tsan setup): four threads offload
 * and reload through one store, with writes queued behind a D2H stream,
 * prefetch, evict, faults injected meanwhile, on both engines. Every reload
 * that succeeds is compared byte for byte; every failed write must still
 * hand back its bytes from host memory. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "disk/disk_internal.h"
#include "tests/support/devmem.h"
#include "tests/support/tap.h"

static ofl_device_t *dev;

static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static unsigned char byte_at(uint64_t seed, size_t i) {
  return (unsigned char)(mix(seed * 0x9e3779b97f4a7c15ull + i / 8) >>
                         (8 * (i % 8)));
}

static void fill(unsigned char *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++)
    p[i] = byte_at(seed, i);
}

static size_t wrong(const unsigned char *p, size_t n, uint64_t seed) {
  size_t w = 0;
  for (size_t i = 0; i < n; i++)
    w += p[i] != byte_at(seed, i);
  return w;
}

typedef struct {
  ofl_disk_t *d;
  int id;
  size_t wrong, errors, done;
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  ofl_stream_t *s = NULL;
  if (ofl_stream_create(dev, "d2h", &s) != OFL_SUCCESS) {
    w->errors++;
    return NULL;
  }
  enum { K = 6 };
  for (int round = 0; round < 15; round++) {
    ofl_disk_extent_t *e[K] = {0};
    size_t n[K];
    uint64_t seed[K];
    for (int k = 0; k < K; k++) {
      n[k] = 1 + (size_t)(mix((uint64_t)(w->id * 7919 + round * 31 + k)) %
                          (700u << 10));
      seed[k] = (uint64_t)(w->id * 100000 + round * 100 + k);
      if (ofl_disk_extent_create(w->d, n[k], &e[k]) != OFL_SUCCESS) {
        e[k] = NULL; /* degraded by an injected fault: fine, skip */
        continue;
      }
      fill(ofl_disk_extent_data(e[k]), n[k], seed[k]);
      if ((k & 1) ? ofl_disk_extent_write_after(e[k], s)
                  : ofl_disk_extent_write(e[k]))
        w->errors++;
    }
    for (int k = K - 1; k >= 0; k--) {
      if (e[k] == NULL)
        continue;
      if (k > 0 && e[k - 1] != NULL)
        ofl_disk_extent_prefetch(e[k - 1]);
      if (k % 3 == 0) { /* wait, then force a read from the file */
        if (ofl_disk_extent_wait(e[k], -1) == OFL_SUCCESS &&
            ofl_disk_extent_state(e[k]) == OFL_DISK_EXTENT_RESIDENT)
          ofl_disk_extent_evict(e[k]);
      }
      void *p = NULL;
      ofl_status_t st = ofl_disk_extent_reload(e[k], -1, &p);
      /* injected faults hit at most two requests of each kind: retry */
      for (int a = 0; a < 4 && (st == OFL_ERR_IO || st == OFL_ERR_CORRUPT); a++)
        st = ofl_disk_extent_reload(e[k], -1, &p);
      if (st == OFL_SUCCESS) {
        w->wrong += wrong(p, n[k], seed[k]);
        w->done++;
      } else {
        w->errors++;
      }
      if (ofl_disk_extent_destroy(e[k]) != OFL_SUCCESS)
        w->errors++;
    }
    if (ofl_disk_is_degraded(w->d))
      ofl_disk_clear_degraded(w->d);
  }
  ofl_stream_destroy(s);
  return NULL;
}

static void run(ofl_disk_engine_t engine, const char *name) {
  char dir[] = "/tmp/ofl-stress-disk-XXXXXX";
  if (mkdtemp(dir) == NULL) {
    tap_ok(0, "%s: temp dir", name);
    return;
  }
  ofl_disk_params_t p = OFL_DISK_PARAMS_INIT;
  p.dev = dev;
  p.dir = dir;
  p.engine = engine;
  p.checksum = 1;
  p.queue_depth = 6;
  p.block_bytes = 128 << 10;
  p.budget_bytes = 0;
  ofl_disk_t *d = NULL;
  if (!tap_ok(ofl_disk_open(&p, &d) == OFL_SUCCESS, "%s: open (%s)", name,
              ofl_last_error())) {
    rmdir(dir);
    return;
  }
  worker_t w[4];
  pthread_t t[4];
  for (int i = 0; i < 4; i++) {
    w[i] = (worker_t){d, i, 0, 0, 0};
    pthread_create(&t[i], NULL, worker, &w[i]);
  }
  /* faults while the workers run */
  ofl__disk_inject_fault(d, OFL__DISK_FAULT_WRITE_EIO, 20, 2);
  usleep(20000);
  ofl__disk_inject_fault(d, OFL__DISK_FAULT_READ_CORRUPT, 10, 2);
  usleep(20000);
  ofl__disk_inject_fault(d, OFL__DISK_FAULT_READ_EIO, 10, 2);
  size_t wr = 0, err = 0, done = 0;
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    wr += w[i].wrong;
    err += w[i].errors;
    done += w[i].done;
  }
  ofl_disk_stats_t s;
  ofl_disk_get_stats(d, &s);
  tap_diag("%s: faults eio %llu corrupt %llu, stalls %llu, hits %llu", name,
           (unsigned long long)s.faults_eio,
           (unsigned long long)s.faults_corrupt, (unsigned long long)s.stalls,
           (unsigned long long)s.prefetch_hits);
  tap_ok(wr == 0, "%s: zero wrong bytes over %zu reloads (wrong %zu)", name,
         done, wr);
  tap_ok(err == 0, "%s: no unexpected errors (%zu)", name, err);
  tap_ok(done > 100, "%s: reloads done %zu", name, done);
  tap_ok(s.extents == 0 && s.extent_bytes == 0, "%s: every extent freed", name);
  ofl_disk_close(d);
  tap_ok(rmdir(dir) == 0, "%s: directory left empty", name);
}

int main(void) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = t_backend(); /* the backend under test (tests/support/devmem.h) */
  if (ofl_device_open(&dp, &dev) != OFL_SUCCESS) {
    printf("1..0 # SKIP no device: %s\n", ofl_last_error());
    return 0;
  }
  tap_plan(12);
  run(OFL_DISK_ENGINE_THREADS, "threads");
#if OFL_HAVE_LIBURING
  if (ofl__disk_uring_usable()) {
    run(OFL_DISK_ENGINE_URING, "io_uring");
  } else { /* an old kernel, or valgrind (io_uring_enter blocks for good) */
    for (int i = 0; i < 6; i++)
      tap_ok(1, "io_uring # SKIP io_uring not usable here");
  }
#else
  for (int i = 0; i < 6; i++)
    tap_ok(1, "io_uring # SKIP built without liburing");
#endif
  ofl_device_close(dev);
  return tap_done();
}
