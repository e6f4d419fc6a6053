/* Host-backend copy throughput (D2H, H2D, both at once) beside plain memcpy
 * of the same sizes in the same run. Prints size, time, GB/s and the ratio
 * ofl/memcpy. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"
#include "bench/bench.h"

typedef struct {
  void *dst;
  const void *src;
  size_t n;
} job_t;

static void *memcpy_thread(void *arg) {
  job_t *j = arg;
  memcpy(j->dst, j->src, j->n);
  return NULL;
}

static int reps_for(size_t n) {
  return n >= (256u << 20) ? 5 : n >= (16u << 20) ? 20 : 200;
}

/* Best time of reps of: one or two memcpy threads at once. */
static double time_memcpy(job_t *jobs, int njobs, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    pthread_t th[2];
    uint64_t t0 = ofl__now_ns();
    for (int i = 0; i < njobs; i++)
      pthread_create(&th[i], NULL, memcpy_thread, &jobs[i]);
    for (int i = 0; i < njobs; i++)
      pthread_join(th[i], NULL);
    double s = (double)(ofl__now_ns() - t0) / 1e9;
    if (s < best)
      best = s;
  }
  return best;
}

int main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  setenv("OFL_BACKEND", "host", 0);
  ofl_config_reload();
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  p.strict = 0;
  ofl_device_t *dev = NULL;
  CHECK(ofl_device_open(&p, &dev));
  ofl_stream_t *d2h = NULL, *h2d = NULL;
  CHECK(ofl_stream_create(dev, "d2h", &d2h));
  CHECK(ofl_stream_create(dev, "h2d", &h2d));

  const size_t sizes[] = {1u << 20, 16u << 20, 256u << 20};
  printf("host backend copies vs memcpy (best of N; GB/s = 1e9 bytes/s; "
         "both = D2H and H2D at once, against two memcpy threads)\n");
  printf("%-10s %-6s %12s %10s %12s %10s %8s\n", "size", "dir", "ofl_us",
         "ofl_GB/s", "memcpy_us", "mem_GB/s", "ratio");
  for (size_t si = 0; si < 3; si++) {
    size_t n = sizes[si];
    int reps = reps_for(n);
    void *dev_a = NULL, *dev_b = NULL, *pin_a = NULL, *pin_b = NULL;
    CHECK(ofl_device_malloc(dev, n, &dev_a));
    CHECK(ofl_device_malloc(dev, n, &dev_b));
    CHECK(ofl_pinned_malloc(dev, n, &pin_a));
    CHECK(ofl_pinned_malloc(dev, n, &pin_b));
    memset(dev_a, 1, n);
    memset(dev_b, 2, n);
    memset(pin_a, 3, n);
    memset(pin_b, 4, n);
    for (int dir = 0; dir < 3; dir++) {
      const char *name = dir == 0 ? "D2H" : dir == 1 ? "H2D" : "both";
      double best = 1e30;
      for (int r = 0; r < reps; r++) {
        uint64_t t0 = ofl__now_ns();
        if (dir == 0 || dir == 2)
          CHECK(ofl_memcpy_async(pin_a, dev_a, n, OFL_COPY_D2H, d2h));
        if (dir == 1 || dir == 2)
          CHECK(ofl_memcpy_async(dev_b, pin_b, n, OFL_COPY_H2D, h2d));
        CHECK(ofl_stream_synchronize(d2h, -1));
        CHECK(ofl_stream_synchronize(h2d, -1));
        double s = (double)(ofl__now_ns() - t0) / 1e9;
        if (s < best)
          best = s;
      }
      job_t jobs[2] = {{pin_a, dev_a, n}, {dev_b, pin_b, n}};
      int njobs = dir == 2 ? 2 : 1;
      job_t *first = dir == 1 ? &jobs[1] : &jobs[0];
      double mbest = time_memcpy(first, njobs, reps);
      double bytes = (double)n * njobs;
      printf("%-10zu %-6s %12.1f %10.2f %12.1f %10.2f %8.3f\n", n, name,
             best * 1e6, bytes / best / 1e9, mbest * 1e6, bytes / mbest / 1e9,
             mbest / best);
    }
    ofl_device_free(dev, dev_a);
    ofl_device_free(dev, dev_b);
    ofl_pinned_free(dev, pin_a);
    ofl_pinned_free(dev, pin_b);
  }
  ofl_stream_destroy(d2h);
  ofl_stream_destroy(h2d);
  ofl_device_close(dev);
  return 0;
}
