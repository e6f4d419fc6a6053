/* Threads and streams at once on the backend under test (OFLTEST_BACKEND,
 * tests/support/devmem.h): several producer threads
 * each drive their own pair of streams joined by events, while sharing one
 * device. Every copied byte is checked. Run in every build; the tsan setup
 * runs it under ThreadSanitizer. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"
#include "tests/support/tap.h"

#define THREADS 4
#define ITERS 200
#define BYTES (64 * 1024)

static ofl_device_t *dev;

typedef struct {
  int id;
  size_t wrong;
  int errors;
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  ofl_stream_t *a = NULL, *b = NULL;
  ofl_event_t *ev = NULL;
  void *d = NULL, *pin = NULL;
  unsigned char *src = malloc(BYTES), *dst = malloc(BYTES);
  if (ofl_stream_create(dev, "a", &a) || ofl_stream_create(dev, "b", &b) ||
      ofl_event_create(dev, &ev) || ofl_device_malloc(dev, BYTES, &d) ||
      ofl_pinned_malloc(dev, BYTES, &pin) || !src || !dst) {
    w->errors++;
    return NULL;
  }
  for (int it = 0; it < ITERS; it++) {
    unsigned char v = (unsigned char)(w->id * 31 + it);
    memset(src, v, BYTES);
    /* a: H2D then record; b: wait, D2D-free path D2H into pinned; then the
     * caller reads the pinned copy after synchronizing b. */
    w->errors += ofl_memcpy_async(d, src, BYTES, OFL_COPY_H2D, a) != OFL_SUCCESS;
    w->errors += ofl_event_record(ev, a) != OFL_SUCCESS;
    w->errors += ofl_stream_wait_event(b, ev) != OFL_SUCCESS;
    w->errors += ofl_memcpy_async(pin, d, BYTES, OFL_COPY_D2H, b) != OFL_SUCCESS;
    w->errors += ofl_memcpy_async(dst, pin, BYTES, OFL_COPY_H2H, b) != OFL_SUCCESS;
    w->errors += ofl_stream_synchronize(b, 20000) != OFL_SUCCESS;
    w->errors += ofl_stream_synchronize(a, 20000) != OFL_SUCCESS;
    for (size_t i = 0; i < BYTES; i++)
      w->wrong += dst[i] != v;
  }
  ofl_device_free(dev, d);
  ofl_pinned_free(dev, pin);
  ofl_event_destroy(ev);
  ofl_stream_destroy(a);
  ofl_stream_destroy(b);
  free(src);
  free(dst);
  return NULL;
}

int main(void) {
  tap_plan(3);
  ofl_device_params_t p = t_device_params(20, 0);
  if (!tap_ok(ofl_device_open(&p, &dev) == OFL_SUCCESS, "device opens"))
    return tap_done();
  pthread_t th[THREADS];
  worker_t w[THREADS];
  for (int i = 0; i < THREADS; i++) {
    w[i] = (worker_t){.id = i};
    pthread_create(&th[i], NULL, worker, &w[i]);
  }
  size_t wrong = 0;
  int errors = 0;
  for (int i = 0; i < THREADS; i++) {
    pthread_join(th[i], NULL);
    wrong += w[i].wrong;
    errors += w[i].errors;
  }
  tap_ok(errors == 0, "no call failed across %d threads x %d iterations (%d)",
         THREADS, ITERS, errors);
  tap_ok(wrong == 0, "zero wrong bytes (%zu)", wrong);
  ofl_device_close(dev);
  return tap_done();
}
