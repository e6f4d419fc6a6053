/* The device layer at its edges: sizes and lengths that wrap the address
 * space, timeouts too long to add to the clock, objects ended while queued
 * work still refers to them, and a device closed with streams left open.
 * On the backend under test (OFLTEST_BACKEND); device bytes are reached
 * through copies only. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"
#include "tests/support/devmem.h"

static ofl_device_t *dev;

static void open_dev(void) {
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  ofl_device_params_t p = t_device_params(50, 0);
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(device_limits, .init = open_dev, .fini = close_dev);

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void sleep_100ms(void *arg) {
  (void)arg;
  sleep_ms(100);
}

static void sleep_then_set(void *arg) {
  sleep_ms(150);
  atomic_store((atomic_int *)arg, 1);
}

static void wait_flag(void *arg) {
  atomic_int *flag = arg;
  for (int i = 0; i < 5000 && !atomic_load(flag); i++)
    sleep_ms(1);
}

Test(device_limits, allocations_whose_size_wraps_when_rounded_are_refused) {
  ofl_device_stats_t before, after;
  ofl_device_get_stats(dev, &before);
  void *p = (void *)&before; /* must stay unchanged */
  cr_assert(
      eq(int, ofl_pinned_malloc(dev, SIZE_MAX - 100, &p), OFL_ERR_NO_MEMORY));
  cr_assert(eq(ptr, p, (void *)&before));
  cr_assert(
      eq(int, ofl_device_malloc(dev, SIZE_MAX - 10, &p), OFL_ERR_NO_MEMORY));
  cr_assert(eq(ptr, p, (void *)&before));
  cr_assert(
      eq(int, ofl_pinned_malloc(dev, SIZE_MAX / 2 + 1, &p), OFL_ERR_NO_MEMORY));
  ofl_device_get_stats(dev, &after);
  cr_assert(eq(sz, after.pinned_bytes_in_use, before.pinned_bytes_in_use));
  cr_assert(eq(sz, after.device_bytes_in_use, before.device_bytes_in_use));
  cr_assert(eq(u64, after.pinned_allocs, before.pinned_allocs));
  cr_assert(eq(u64, after.device_allocs, before.device_allocs));
}

Test(device_limits, copies_and_memsets_whose_length_wraps_are_rejected) {
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "wrap", &s), OFL_SUCCESS));
  void *d = NULL;
  cr_assert(eq(int, ofl_device_malloc(dev, 4096, &d), OFL_SUCCESS));
  cr_assert(eq(int, t_set(dev, d, 0x5A, 4096), OFL_SUCCESS), "%s",
            ofl_last_error());
  unsigned char host[64];
  memset(host, 1, sizeof host);
  /* d + length wraps past the end of the address space, so a check of
   * d + length against the block's end would pass. */
  size_t wrap = SIZE_MAX - 8;
  cr_assert(eq(int, ofl_memcpy_async(d, host, wrap, OFL_COPY_H2D, s),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_memcpy_async(host, d, wrap, OFL_COPY_D2H, s),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_memset_async(d, 0, wrap, s), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int,
               ofl_memcpy_async(host, host + 1, (size_t)PTRDIFF_MAX + 1u,
                                OFL_COPY_H2H, s),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  /* Nothing ran: the block and the host buffer are as they were. */
  cr_assert(eq(sz, t_wrong_value(dev, d, 4096, 0x5A), 0));
  for (size_t i = 0; i < sizeof host; i++)
    cr_assert(eq(u8, host[i], 1));
  /* And the block has no queued users left: it can be freed in strict mode. */
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_SUCCESS));
  ofl_stream_destroy(s);
}

Test(device_limits, a_timeout_too_long_to_add_to_the_clock_still_waits) {
  ofl_stream_t *s = NULL;
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "slow", &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_100ms, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(s, INT64_MAX), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_100ms, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_synchronize(ev, INT64_MAX), OFL_SUCCESS), "%s",
            ofl_last_error());
  /* The same through the default timeout (waits that take no argument). */
  setenv("OFL_WAIT_TIMEOUT_MS", "9223372036854775807", 1);
  cr_assert(eq(int, ofl_config_reload(), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_100ms, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_wait_event(ofl_device_compute_stream(dev), ev),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  /* The host compute stream waited on this thread; on cuda the wait is
   * queued: the compute stream drains after the record, under the default
   * timeout too. */
  cr_assert(eq(int,
               ofl_stream_synchronize(ofl_device_compute_stream(dev),
                                      OFL_TIMEOUT_DEFAULT),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_assert(eq(int, ofl_event_query(ev), OFL_SUCCESS));
  ofl_stream_t *s2 = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "waiter", &s2), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_100ms, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_wait_event(s2, ev), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_stream_synchronize(s2, OFL_TIMEOUT_DEFAULT), OFL_SUCCESS),
      "%s", ofl_last_error());
  cr_assert(eq(int, ofl_event_query(ev), OFL_SUCCESS));
  setenv("OFL_WAIT_TIMEOUT_MS", "10000", 1);
  ofl_config_reload();
  ofl_event_destroy(ev);
  ofl_stream_destroy(s2);
  ofl_stream_destroy(s);
}

Test(device_limits, an_event_destroyed_while_its_record_and_waits_are_queued) {
  ofl_stream_t *a = NULL, *b = NULL;
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "a", &a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "b", &b), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  atomic_int go = 0;
  void *d = NULL;
  /* pinned: a copy from or to pageable memory may wait for its stream on
   * a GPU, and stream a is held until go is set below */
  enum { NB = 256 };
  unsigned char *src = NULL, *out = NULL;
  cr_assert(eq(int, ofl_pinned_malloc(dev, NB, (void **)&src), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_malloc(dev, NB, (void **)&out), OFL_SUCCESS));
  memset(src, 0x3C, NB);
  memset(out, 0, NB);
  cr_assert(eq(int, ofl_device_malloc(dev, NB, &d), OFL_SUCCESS));
  /* a: blocked, then the copy, then the record; b waits on that record. As
   * with cudaEventDestroy, destroying the event now is allowed: the queued
   * record and wait keep what they need until they have run. */
  cr_assert(
      eq(int, ofl_stream_launch_host_func(a, wait_flag, &go), OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(d, src, NB, OFL_COPY_H2D, a),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_wait_event(b, ev), OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(out, d, NB, OFL_COPY_D2H, b),
               OFL_SUCCESS));
  ofl_event_destroy(ev);
  /* Other events reuse the memory the destroyed one had. */
  ofl_event_t *others[8];
  for (int i = 0; i < 8; i++)
    cr_assert(eq(int, ofl_event_create(dev, &others[i]), OFL_SUCCESS));
  atomic_store(&go, 1);
  cr_assert(eq(int, ofl_stream_synchronize(b, 10000), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_stream_synchronize(a, 10000), OFL_SUCCESS), "%s",
            ofl_last_error());
  for (size_t i = 0; i < NB; i++)
    cr_assert(eq(u8, out[i], 0x3C));
  for (int i = 0; i < 8; i++) {
    cr_assert(eq(int, ofl_event_query(others[i]), OFL_SUCCESS));
    ofl_event_destroy(others[i]);
  }
  cr_assert(eq(int, ofl_device_free(dev, d), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_free(dev, src), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_free(dev, out), OFL_SUCCESS));
  ofl_stream_destroy(a);
  ofl_stream_destroy(b);
}

Test(device_limits, close_waits_for_and_stops_streams_left_open) {
  ofl_device_params_t p = t_device_params(-1, 0);
  ofl_device_t *d2 = NULL;
  cr_assert(eq(int, ofl_device_open(&p, &d2), OFL_SUCCESS));
  ofl_stream_t *s = NULL, *t = NULL;
  cr_assert(eq(int, ofl_stream_create(d2, "left-open", &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(d2, "also-open", &t), OFL_SUCCESS));
  atomic_int done_s = 0, done_t = 0;
  void *pin = NULL;
  unsigned char src[512];
  memset(src, 0x77, sizeof src);
  cr_assert(eq(int, ofl_pinned_malloc(d2, sizeof src, &pin), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_launch_host_func(s, sleep_then_set, &done_s),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(pin, src, sizeof src, OFL_COPY_H2H, s),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_launch_host_func(t, sleep_then_set, &done_t),
               OFL_SUCCESS));
  /* "Waits for all streams (bounded), stops workers": the host functions
   * queued on streams never destroyed have run when close returns. */
  ofl_device_close(d2);
  cr_assert(eq(int, atomic_load(&done_s), 1));
  cr_assert(eq(int, atomic_load(&done_t), 1));
}

Test(device_limits, destroying_the_threads_compute_stream_falls_back) {
  ofl_stream_t *def = ofl_device_compute_stream(dev);
  ofl_stream_t *mine = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "my-compute", &mine), OFL_SUCCESS));
  ofl_device_set_compute_stream(dev, mine);
  cr_assert(eq(ptr, ofl_device_compute_stream(dev), mine));
  cr_assert(eq(int, ofl_stream_destroy(mine), OFL_SUCCESS));
  /* The override named a stream that no longer exists. */
  ofl_stream_t *now = ofl_device_compute_stream(dev);
  cr_assert(eq(ptr, now, def));
  unsigned char a[32], b[32];
  memset(a, 9, sizeof a);
  memset(b, 0, sizeof b);
  cr_assert(eq(int, ofl_memcpy_async(b, a, sizeof a, OFL_COPY_H2H, now),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(now, 10000), OFL_SUCCESS));
  cr_assert(eq(int, memcmp(a, b, sizeof a), 0));
}

/* The trace file is the host backend's (cuda ranges go to NVTX). */
Test(device_limits,
     host_only_trace_file_stays_valid_json_with_any_stream_or_range_name) {
  if (t_on_cuda())
    cr_skip_test("host backend only");
  char path[] = "/tmp/ofl-trace-names-XXXXXX";
  int fd = mkstemp(path);
  close(fd);
  setenv("OFL_TRACE_FILE", path, 1);
  ofl_config_reload();
  ofl_device_t *t = NULL;
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  cr_assert(eq(int, ofl_device_open(&p, &t), OFL_SUCCESS));
  ofl_stream_t *s = NULL;
  cr_assert(
      eq(int, ofl_stream_create(t, "d2h \"fast\" \\ lane", &s), OFL_SUCCESS));
  unsigned char h[256], h2[256];
  memset(h, 4, sizeof h);
  cr_assert(
      eq(int, ofl_memcpy_async(h2, h, sizeof h, OFL_COPY_H2H, s), OFL_SUCCESS));
  /* A range name in a buffer the caller reuses before the pop. */
  char name[64];
  snprintf(name, sizeof name, "offload group \"qkv\" chunk 3");
  ofl_range_push(t, name);
  memset(name, 'X', sizeof name - 1);
  name[sizeof name - 1] = '\0';
  ofl_range_pop(t);
  cr_assert(eq(int, ofl_stream_synchronize(s, 10000), OFL_SUCCESS));
  ofl_stream_destroy(s);
  ofl_device_close(t);
  unsetenv("OFL_TRACE_FILE");
  ofl_config_reload();
  FILE *f = fopen(path, "r");
  cr_assert(ne(ptr, f, NULL));
  char buf[16384] = {0};
  size_t got = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  cr_assert(gt(sz, got, 0));
  cr_assert(ne(ptr, strstr(buf, "d2h \\\"fast\\\" \\\\ lane"), NULL), "%s",
            buf);
  cr_assert(ne(ptr, strstr(buf, "offload group \\\"qkv\\\" chunk 3"), NULL),
            "%s", buf);
  cr_assert(eq(ptr, strstr(buf, "XXXX"), NULL));
  /* What Perfetto and chrome://tracing need first: the file parses. */
  char cmd[256];
  snprintf(cmd, sizeof cmd,
           "python3 -c 'import json,sys; json.load(open(sys.argv[1]))' %s",
           path);
  cr_assert(eq(int, system(cmd), 0), "trace is not valid JSON:\n%s", buf);
  unlink(path);
}

Test(device_limits, a_wait_holds_even_after_many_newer_records_complete) {
  ofl_stream_t *slow = NULL, *fast = NULL, *waiter = NULL;
  ofl_event_t *ev = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "slow", &slow), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "fast", &fast), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_create(dev, "waiter", &waiter), OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_create(dev, &ev), OFL_SUCCESS));
  atomic_int go = 0;
  /* The data goes host -> device on slow and device -> host on waiter,
   * through pinned buffers (a copy of pageable memory may wait for its
   * stream on a GPU, and slow is held until go is set below). */
  enum { NB = 128 };
  unsigned char *data = NULL, *out = NULL;
  void *src = NULL;
  cr_assert(eq(int, ofl_pinned_malloc(dev, NB, (void **)&data), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_malloc(dev, NB, (void **)&out), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_malloc(dev, NB, &src), OFL_SUCCESS));
  cr_assert(eq(int, t_set(dev, src, 0, NB), OFL_SUCCESS));
  memset(out, 0xEE, NB);
  memset(data, 0x42, NB);
  /* slow: blocked, then writes the data, then records ev (record 1). */
  cr_assert(
      eq(int, ofl_stream_launch_host_func(slow, wait_flag, &go), OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(src, data, NB, OFL_COPY_H2D, slow),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_event_record(ev, slow), OFL_SUCCESS));
  /* waiter: ordered after record 1, then reads the data. */
  cr_assert(eq(int, ofl_stream_wait_event(waiter, ev), OFL_SUCCESS));
  cr_assert(eq(int, ofl_memcpy_async(out, src, NB, OFL_COPY_D2H, waiter),
               OFL_SUCCESS));
  /* Many newer records of the same event complete on another stream. */
  for (int i = 0; i < 200; i++)
    cr_assert(eq(int, ofl_event_record(ev, fast), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(fast, 10000), OFL_SUCCESS));
  sleep_ms(50);
  /* Record 1 has not been reached: the waiter must still be waiting. */
  cr_assert(eq(int, ofl_stream_query(waiter), OFL_ERR_NOT_READY));
  for (size_t i = 0; i < NB; i++)
    cr_assert(eq(u8, out[i], 0xEE));
  /* A query refers to the last record (on fast), which is complete. */
  cr_assert(eq(int, ofl_event_query(ev), OFL_SUCCESS));
  atomic_store(&go, 1);
  cr_assert(eq(int, ofl_stream_synchronize(waiter, 10000), OFL_SUCCESS));
  for (size_t i = 0; i < NB; i++)
    cr_assert(eq(u8, out[i], 0x42));
  cr_assert(eq(int, ofl_event_query(ev), OFL_SUCCESS));
  cr_assert(eq(int, ofl_device_free(dev, src), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_free(dev, data), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pinned_free(dev, out), OFL_SUCCESS));
  ofl_event_destroy(ev);
  ofl_stream_destroy(waiter);
  ofl_stream_destroy(fast);
  ofl_stream_destroy(slow);
}
