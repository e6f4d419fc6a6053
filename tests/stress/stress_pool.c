/* Pools under concurrent allocate/free from several threads and from stream
 * callbacks (run by the tsan setup), on the backend under test
 * (OFLTEST_BACKEND, tests/support/devmem.h). Every block a thread holds is filled
 * with the thread's pattern and checked before it is returned, so two
 * owners of one block show up as wrong bytes: pinned blocks by the CPU,
 * device blocks through copies on the thread's stream. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"
#include "tests/support/tap.h"

enum { THREADS = 4, ITERS = 4000 };

static ofl_device_t *dev;
static ofl_pool_t *pools[2]; /* device, pinned (budgeted) */
static atomic_size_t wrong_bytes;
static atomic_int errors;
static atomic_int callback_frees;

typedef struct {
  ofl_pool_t *pool;
  ofl_tensor_t *t;
} cb_arg_t;

static void free_in_callback(void *arg) {
  cb_arg_t *c = arg;
  if (ofl_pool_free(c->pool, c->t) != OFL_SUCCESS)
    atomic_fetch_add(&errors, 1);
  else
    atomic_fetch_add(&callback_frees, 1);
  free(c);
}

/* Fills t with v: the CPU in pinned memory, an H2D copy of vbuf (pinned,
 * every byte v, at least the tensor's size) on s, waited for, in device
 * memory. */
static void put(ofl_stream_t *s, ofl_tensor_t *t, uint8_t v,
                const uint8_t *vbuf) {
  size_t n = ofl_tensor_bytes(t);
  if (ofl_tensor_location(t) != OFL_LOC_DEVICE) {
    memset(ofl_tensor_data(t), v, n);
    return;
  }
  if (ofl_memcpy_async(ofl_tensor_data(t), vbuf, n, OFL_COPY_H2D, s) !=
          OFL_SUCCESS ||
      ofl_stream_synchronize(s, 20000) != OFL_SUCCESS)
    atomic_fetch_add(&errors, 1);
}

/* Counts t's bytes that are not v (device bytes read back into buf on s). */
static void check(ofl_stream_t *s, ofl_tensor_t *t, uint8_t v, uint8_t *buf) {
  size_t n = ofl_tensor_bytes(t);
  const uint8_t *d = ofl_tensor_data(t);
  if (ofl_tensor_location(t) == OFL_LOC_DEVICE) {
    memset(buf, (uint8_t)~v, n);
    if (ofl_memcpy_async(buf, d, n, OFL_COPY_D2H, s) != OFL_SUCCESS ||
        ofl_stream_synchronize(s, 20000) != OFL_SUCCESS) {
      atomic_fetch_add(&errors, 1);
      return;
    }
    d = buf;
  }
  size_t w = 0;
  for (size_t i = 0; i < n; ++i)
    w += d[i] != v;
  atomic_fetch_add(&wrong_bytes, w);
}

static void *worker(void *arg) {
  int id = (int)(intptr_t)arg;
  uint64_t rng = 0x243f6a8885a308d3ull * (uint64_t)(id + 1);
  ofl_stream_t *s = NULL;
  char name[16];
  snprintf(name, sizeof name, "w%d", id);
  /* the largest block: 4 x 256 f32; vbuf holds the thread's value, buf
   * takes device bytes read back */
  const size_t most = 4 * 256 * sizeof(float);
  const uint8_t v = (uint8_t)(0x10 + id);
  uint8_t *buf = malloc(most), *vbuf = NULL;
  if (buf == NULL || ofl_pinned_malloc(dev, most, (void **)&vbuf) ||
      ofl_stream_create(dev, name, &s) != OFL_SUCCESS) {
    atomic_fetch_add(&errors, 1);
    free(buf);
    ofl_pinned_free(dev, vbuf);
    return NULL;
  }
  memset(vbuf, v, most);
  for (int i = 0; i < ITERS; ++i) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    ofl_pool_t *pool = pools[rng % 2];
    int64_t shape[2] = {(int64_t)(1 + (rng >> 8) % 4), 256};
    ofl_tensor_t *t = NULL;
    ofl_status_t st =
        (rng >> 20) % 3 == 0
            ? ofl_pool_alloc_dynamic(pool, shape, 2, OFL_DTYPE_F16, NULL, &t)
            : ofl_pool_alloc(pool, shape, 2, OFL_DTYPE_F32, NULL, &t);
    if (st == OFL_ERR_NO_MEMORY)
      continue; /* the pinned pool's budget: a legitimate refusal */
    if (st != OFL_SUCCESS) {
      atomic_fetch_add(&errors, 1);
      continue;
    }
    put(s, t, v, vbuf);
    check(s, t, v, buf);
    switch ((rng >> 24) % 4) {
    case 0:
      st = ofl_pool_free(pool, t);
      break;
    case 1: /* stream-ordered: a write on s is the last use (a memset of
             * device memory, a copy into host memory) */
      st = ofl_tensor_location(t) == OFL_LOC_DEVICE
               ? ofl_memset_async(ofl_tensor_data(t), v, ofl_tensor_bytes(t), s)
               : ofl_memcpy_async(ofl_tensor_data(t), vbuf,
                                  ofl_tensor_bytes(t), OFL_COPY_H2H, s);
      if (st == OFL_SUCCESS)
        st = ofl_pool_free_after(pool, t, s);
      break;
    case 2: { /* freed by a stream callback */
      cb_arg_t *c = malloc(sizeof *c);
      c->pool = pool;
      c->t = t;
      st = ofl_stream_launch_host_func(s, free_in_callback, c);
      break;
    }
    default: { /* a view keeps the block until both are gone */
      ofl_tensor_t *view = NULL;
      st = ofl_tensor_alias(t, &view);
      if (st == OFL_SUCCESS)
        st = ofl_pool_free(pool, t);
      if (st == OFL_SUCCESS) {
        check(s, view, v, buf);
        st = ofl_tensor_destroy(view);
      }
      break;
    }
    }
    if (st != OFL_SUCCESS)
      atomic_fetch_add(&errors, 1);
  }
  if (ofl_stream_destroy(s) != OFL_SUCCESS)
    atomic_fetch_add(&errors, 1);
  free(buf);
  ofl_pinned_free(dev, vbuf);
  return NULL;
}

int main(void) {
  tap_plan(6);
  ofl_device_params_t dp = t_device_params(5, 0);
  dp.strict = -1; /* host backend: strict mode from OFL_STRICT */
  if (!tap_ok(ofl_device_open(&dp, &dev) == OFL_SUCCESS, "device opens"))
    return tap_done();
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.budget_bytes = 0;
  ofl_pool_create(dev, &pp, &pools[0]);
  pp.kind = OFL_POOL_PINNED;
  pp.budget_bytes = 24 * 4096;
  ofl_pool_create(dev, &pp, &pools[1]);

  pthread_t th[THREADS];
  for (int i = 0; i < THREADS; ++i)
    pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i);
  for (int i = 0; i < THREADS; ++i)
    pthread_join(th[i], NULL);

  tap_ok(atomic_load(&errors) == 0, "no call failed (%d failures)",
         atomic_load(&errors));
  tap_ok(atomic_load(&wrong_bytes) == 0,
         "no block had two owners (%zu wrong bytes)",
         atomic_load(&wrong_bytes));
  tap_ok(atomic_load(&callback_frees) > 0, "stream callbacks freed %d blocks",
         atomic_load(&callback_frees));
  int consistent = 1;
  for (int i = 0; i < 2; ++i) {
    ofl_pool_stats_t s;
    ofl_pool_get_stats(pools[i], &s);
    tap_diag("pool %d requests %llu hits %llu misses %llu refusals %llu "
             "blocks %llu",
             i, (unsigned long long)s.requests, (unsigned long long)s.hits,
             (unsigned long long)s.misses,
             (unsigned long long)s.budget_refusals,
             (unsigned long long)s.blocks_total);
    consistent &= s.blocks_in_use == 0 && s.in_use_bytes == 0 &&
                  s.hits + s.misses + s.budget_refusals == s.requests &&
                  s.frees == s.hits + s.misses;
  }
  tap_ok(consistent, "counters add up and nothing is held at the end");
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pools[1], &s);
  tap_ok(s.total_bytes <= 24 * 4096,
         "pinned pool stayed in its budget "
         "(%zu bytes)",
         s.total_bytes);
  ofl_pool_destroy(pools[0]);
  ofl_pool_destroy(pools[1]);
  ofl_device_close(dev);
  return tap_done();
}
