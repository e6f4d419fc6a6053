/* Host backend only (registered as host_only_stress_pool_reserve): the
 * host backend's strict-mode refusal of an unordered free is what keeps the
 * round trips exact here. Strict-mode free checks on blocks carved from a
 * pool's reserve, from
 * several threads at once while another thread creates and destroys
 * streams: the check walks the device's streams and their queues, so this
 * is where a lock-order problem or a race would show (the tsan setup runs
 * it). Every copied byte is checked. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "tests/support/tap.h"

#define THREADS 2
#define ITERS 150
#define BYTES ((size_t)8192)

static ofl_device_t *dev;
static ofl_pool_t *pool;
static atomic_int stop_churn;
static atomic_int errors, wrong, early_frees, refused;

static void *worker(void *arg) {
  int id = (int)(intptr_t)arg;
  ofl_stream_t *s = NULL;
  void *d = NULL;
  unsigned char *back = malloc(BYTES);
  if (ofl_stream_create(dev, "w", &s) != OFL_SUCCESS ||
      ofl_device_malloc(dev, BYTES, &d) != OFL_SUCCESS || back == NULL) {
    atomic_fetch_add(&errors, 1);
    return NULL;
  }
  int64_t shape[1] = {(int64_t)BYTES};
  for (int it = 0; it < ITERS; it++) {
    ofl_tensor_t *t = NULL;
    if (ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &t) != OFL_SUCCESS) {
      atomic_fetch_add(&errors, 1);
      break;
    }
    unsigned char v = (unsigned char)(id * 64 + it);
    memset(ofl_tensor_data(t), v, BYTES);
    ofl_status_t a = ofl_memcpy_async(d, ofl_tensor_data(t), BYTES,
                                      OFL_COPY_H2D, s);
    ofl_status_t b = ofl_memcpy_async(back, d, BYTES, OFL_COPY_D2H, s);
    if (a != OFL_SUCCESS || b != OFL_SUCCESS)
      atomic_fetch_add(&errors, 1);
    /* Unordered free while the upload may still be queued: refused, or
     * accepted only once nothing queued touches the block. */
    ofl_status_t f = ofl_pool_free(pool, t);
    if (f == OFL_ERR_INVALID_USAGE) {
      atomic_fetch_add(&refused, 1);
      if (ofl_pool_free_after(pool, t, s) != OFL_SUCCESS)
        atomic_fetch_add(&errors, 1);
    } else if (f != OFL_SUCCESS) {
      atomic_fetch_add(&errors, 1);
    }
    if (ofl_stream_synchronize(s, 20000) != OFL_SUCCESS)
      atomic_fetch_add(&errors, 1);
    size_t w = 0;
    for (size_t i = 0; i < BYTES; i++)
      w += back[i] != v;
    if (w > 0) {
      atomic_fetch_add(&wrong, 1);
      if (f == OFL_SUCCESS)
        atomic_fetch_add(&early_frees, 1);
    }
  }
  ofl_device_free(dev, d);
  ofl_stream_destroy(s);
  free(back);
  return NULL;
}

static void *churn(void *arg) {
  (void)arg;
  while (!atomic_load(&stop_churn)) {
    ofl_stream_t *s = NULL;
    if (ofl_stream_create(dev, "churn", &s) == OFL_SUCCESS)
      ofl_stream_destroy(s);
  }
  return NULL;
}

int main(void) {
  tap_plan(5);
  setenv("OFL_BACKEND", "host", 1);
  ofl_config_reload();
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.strict = 1;
  p.jitter_max_us = 100;
  if (!tap_ok(ofl_device_open(&p, &dev) == OFL_SUCCESS, "device opens"))
    return tap_done();
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_PINNED;
  pp.budget_bytes = 0;
  pp.reserve_bytes = 8 * BYTES;
  if (!tap_ok(ofl_pool_create(dev, &pp, &pool) == OFL_SUCCESS,
              "pool with a reserve"))
    return tap_done();
  pthread_t th[THREADS], ch;
  pthread_create(&ch, NULL, churn, NULL);
  for (int t = 0; t < THREADS; t++)
    pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t);
  for (int t = 0; t < THREADS; t++)
    pthread_join(th[t], NULL);
  atomic_store(&stop_churn, 1);
  pthread_join(ch, NULL);
  tap_ok(atomic_load(&errors) == 0, "no unexpected errors (%d)",
         atomic_load(&errors));
  tap_ok(atomic_load(&wrong) == 0,
         "every round trip is byte exact (%d wrong, %d after an accepted "
         "unordered free; %d frees refused)",
         atomic_load(&wrong), atomic_load(&early_frees),
         atomic_load(&refused));
  ofl_pool_stats_t st;
  ofl_pool_get_stats(pool, &st);
  tap_ok(st.blocks_in_use == 0 && st.backend_allocs == 1,
         "all blocks back, only the reserve allocated (in use %llu, backend "
         "allocs %llu)",
         (unsigned long long)st.blocks_in_use,
         (unsigned long long)st.backend_allocs);
  ofl_pool_destroy(pool);
  ofl_device_close(dev);
  return tap_done();
}
