/* Host backend only (registered as host_only_stress_device_capacity): the
 * host backend's device capacity under concurrent allocation: threads
 * that allocate at the same moment must never together hold more than the
 * capacity (the check and the accounting have to be one step). Run in every
 * build; the tsan setup runs it under ThreadSanitizer. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "tests/support/tap.h"

#define THREADS 2
#define ROUNDS 150
#define CAPACITY ((size_t)4 << 20)
#define REQUEST ((size_t)3 << 20) /* two of them do not fit */

static ofl_device_t *dev;
static pthread_barrier_t start, done;
static void *got[THREADS];
static atomic_int over_capacity, bad_status, wrong_bytes;

static void *worker(void *arg) {
  int id = (int)(intptr_t)arg;
  for (int r = 0; r < ROUNDS; r++) {
    pthread_barrier_wait(&start);
    void *p = NULL;
    ofl_status_t st = ofl_device_malloc(dev, REQUEST, &p);
    if (st == OFL_SUCCESS) {
      memset(p, id + 1, REQUEST); /* the memory must really be there */
      got[id] = p;
    } else if (st != OFL_ERR_NO_MEMORY) {
      atomic_fetch_add(&bad_status, 1);
    }
    pthread_barrier_wait(&done);
    if (id == 0) {
      int n = 0;
      for (int t = 0; t < THREADS; t++)
        n += got[t] != NULL;
      ofl_device_stats_t s;
      ofl_device_get_stats(dev, &s);
      if ((size_t)n * REQUEST > CAPACITY || s.device_bytes_in_use > CAPACITY)
        atomic_fetch_add(&over_capacity, 1);
      for (int t = 0; t < THREADS; t++) {
        if (got[t] != NULL) {
          const unsigned char *c = got[t];
          for (size_t i = 0; i < REQUEST; i += 4096)
            if (c[i] != (unsigned char)(t + 1))
              atomic_fetch_add(&wrong_bytes, 1);
          if (ofl_device_free(dev, got[t]) != OFL_SUCCESS)
            atomic_fetch_add(&bad_status, 1);
          got[t] = NULL;
        }
      }
    }
    pthread_barrier_wait(&start);
  }
  return NULL;
}

int main(void) {
  tap_plan(5);
  setenv("OFL_BACKEND", "host", 1);
  ofl_config_reload();
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.strict = 1; /* allocation poisons the block: a wide window */
  p.device_capacity_bytes = CAPACITY;
  if (!tap_ok(ofl_device_open(&p, &dev) == OFL_SUCCESS, "device opens"))
    return tap_done();
  pthread_barrier_init(&start, NULL, THREADS);
  pthread_barrier_init(&done, NULL, THREADS);
  pthread_t th[THREADS];
  for (int t = 0; t < THREADS; t++)
    pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t);
  for (int t = 0; t < THREADS; t++)
    pthread_join(th[t], NULL);
  tap_ok(atomic_load(&over_capacity) == 0,
         "never more than the capacity allocated at once (%d of %d rounds "
         "over)",
         atomic_load(&over_capacity), ROUNDS);
  tap_ok(atomic_load(&bad_status) == 0,
         "refusals are OFL_ERR_NO_MEMORY and frees succeed (%d other)",
         atomic_load(&bad_status));
  tap_ok(atomic_load(&wrong_bytes) == 0, "allocated blocks hold their bytes");
  ofl_device_stats_t s;
  ofl_device_get_stats(dev, &s);
  tap_ok(s.device_bytes_in_use == 0 && s.device_allocs == s.device_frees,
         "everything returned (in use %zu, allocs %llu, frees %llu)",
         s.device_bytes_in_use, (unsigned long long)s.device_allocs,
         (unsigned long long)s.device_frees);
  pthread_barrier_destroy(&start);
  pthread_barrier_destroy(&done);
  ofl_device_close(dev);
  return tap_done();
}
