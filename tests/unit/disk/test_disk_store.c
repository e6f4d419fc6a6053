/* Disk store: CRC32C, space inside the file, round trips byte for byte
 * through both engines, prefetch and stalls, budget, timeouts, buffers. */
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>

#include "tests/support/disk_test_util.h"

TestSuite(disk, .init = disk_setup, .fini = disk_teardown);

Test(disk, crc32c_matches_known_vectors) {
  cr_expect(eq(u32, ofl__crc32c(0, "123456789", 9), 0xE3069283u));
  cr_expect(eq(u32, ofl__crc32c_sw(0, "123456789", 9), 0xE3069283u));
  cr_expect(eq(u32, ofl__crc32c(0, "", 0), 0u));
  unsigned char zeros[32] = {0}, ones[32];
  memset(ones, 0xff, sizeof ones);
  /* RFC 3720 (iSCSI) test vectors. */
  cr_expect(eq(u32, ofl__crc32c(0, zeros, 32), 0x8A9136AAu));
  cr_expect(eq(u32, ofl__crc32c(0, ones, 32), 0x62A8AB43u));
}

Test(disk, crc32c_hardware_agrees_with_table_at_every_alignment) {
  unsigned char buf[4200];
  fill(buf, sizeof buf, 7);
  for (size_t off = 0; off < 9; off++)
    for (size_t n = 0; n < 4100; n += 37) {
      uint32_t a = ofl__crc32c(0, buf + off, n);
      uint32_t b = ofl__crc32c_sw(0, buf + off, n);
      cr_assert(eq(u32, a, b), "off %zu n %zu", off, n);
    }
  /* Continuing over a split equals one pass. */
  uint32_t one = ofl__crc32c(0, buf, 4000);
  uint32_t two = ofl__crc32c(ofl__crc32c(0, buf, 1234), buf + 1234, 2766);
  cr_expect(eq(u32, one, two));
}

Test(disk, space_first_fit_and_coalescing) {
  disk_space_t s;
  ofl__disk_space_init(&s);
  uint64_t off = 99;
  cr_expect(not(ofl__disk_space_take(&s, 4096, &off)));
  cr_assert(ofl__disk_space_give(&s, 0, 40960));
  s.file_bytes = 40960;
  uint64_t a, b, c;
  cr_assert(ofl__disk_space_take(&s, 8192, &a));
  cr_assert(ofl__disk_space_take(&s, 8192, &b));
  cr_assert(ofl__disk_space_take(&s, 8192, &c));
  cr_expect(eq(u64, a, 0));
  cr_expect(eq(u64, b, 8192));
  cr_expect(eq(u64, c, 16384));
  cr_expect(eq(u64, ofl__disk_space_tail_free(&s), 16384));
  ofl__disk_space_give(&s, a, 8192);
  ofl__disk_space_give(&s, c, 8192); /* joins the tail */
  cr_expect(eq(sz, s.nfree, 2));
  cr_expect(eq(u64, ofl__disk_space_tail_free(&s), 24576));
  ofl__disk_space_give(&s, b, 8192); /* joins both sides */
  cr_expect(eq(sz, s.nfree, 1));
  cr_expect(eq(u64, s.free[0].off, 0));
  cr_expect(eq(u64, s.free[0].len, 40960));
  ofl__disk_space_fini(&s);
}

Test(disk, group_selection_reads_the_list) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  p.groups = "core_attn, expert_fc1,moe_act";
  ofl_disk_t *d = open_with(&p);
  cr_expect(eq(int, ofl_disk_group_selected(d, "core_attn"), 1));
  cr_expect(eq(int, ofl_disk_group_selected(d, "expert_fc1"), 1));
  cr_expect(eq(int, ofl_disk_group_selected(d, "moe_act"), 1));
  cr_expect(eq(int, ofl_disk_group_selected(d, "core"), 0));
  cr_expect(eq(int, ofl_disk_group_selected(d, "attn_norm"), 0));
  ofl_disk_close(d);
  p.groups = "*";
  d = open_with(&p);
  cr_expect(eq(int, ofl_disk_group_selected(d, "anything"), 1));
  ofl_disk_close(d);
}

static void round_trips(ofl_disk_engine_t engine, int checksum) {
  ofl_disk_t *d = open_store(engine, checksum);
  static const size_t sizes[] = {1,
                                 2,
                                 511,
                                 4095,
                                 4096,
                                 4097,
                                 65537,
                                 (1u << 20) - 3,
                                 (1u << 20),
                                 (3u << 20) + 17,
                                 (9u << 20) + 4093};
  size_t n = sizeof sizes / sizeof sizes[0];
  ofl_disk_extent_t *e[sizeof sizes / sizeof sizes[0]];
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) {
    e[i] = put(d, sizes[i], 100 + i);
    total += sizes[i];
  }
  for (size_t i = 0; i < n; i++) {
    cr_assert(eq(int, ofl_disk_extent_wait(e[i], -1), OFL_SUCCESS), "%s",
              ofl_last_error());
    cr_expect(eq(int, ofl_disk_extent_state(e[i]), OFL_DISK_EXTENT_ON_DISK));
    /* the bounce buffer went back once the write completed */
    cr_expect(eq(ptr, ofl_disk_extent_data(e[i]), NULL));
  }
  for (size_t i = n; i-- > 0;) { /* reverse order, like backward */
    void *p = NULL;
    cr_assert(eq(int, ofl_disk_extent_reload(e[i], -1, &p), OFL_SUCCESS), "%s",
              ofl_last_error());
    cr_assert(eq(sz, count_wrong(p, sizes[i], 100 + i), 0), "size %zu",
              sizes[i]);
    cr_expect(eq(u64, (uintptr_t)p % 4096, 0));
    cr_assert(eq(int, ofl_disk_extent_destroy(e[i]), OFL_SUCCESS));
  }
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(u64, s.bytes_written, total));
  cr_expect(eq(u64, s.bytes_read, total));
  cr_expect(eq(u64, s.writes, n));
  cr_expect(eq(u64, s.reads, n));
  cr_expect(eq(int, s.uring, engine == OFL_DISK_ENGINE_URING));
  cr_expect(eq(int, s.checksum, checksum));
  cr_expect(ge(int, s.queue_depth_max, 2)); /* requests overlapped */
  cr_expect(le(int, s.queue_depth_max, 8));
  cr_expect(eq(u64, s.extents, 0));
  cr_expect(eq(sz, s.extent_bytes, 0));
  cr_expect(eq(
      u64, s.faults_eio + s.faults_short + s.faults_corrupt + s.faults_enospc,
      0));
  cr_expect(gt(dbl, s.write_gbps, 0.0));
  cr_expect(gt(dbl, s.read_gbps, 0.0));
  ofl_disk_close(d);
}

#if OFL_HAVE_LIBURING
Test(disk, round_trip_every_size_io_uring) {
  round_trips(OFL_DISK_ENGINE_URING, 0);
}
Test(disk, round_trip_every_size_io_uring_checksummed) {
  round_trips(OFL_DISK_ENGINE_URING, 1);
}
#endif
Test(disk, round_trip_every_size_threads) {
  round_trips(OFL_DISK_ENGINE_THREADS, 0);
}
Test(disk, round_trip_every_size_threads_checksummed) {
  round_trips(OFL_DISK_ENGINE_THREADS, 1);
}

Test(disk, buffered_io_when_direct_is_off) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.direct = OFL_DISK_DIRECT_OFF;
  ofl_disk_t *d = open_with(&p);
  cr_expect(eq(int, disk_stats(d).direct, 0));
  cr_expect(eq(int, disk_stats(d).uring, 0)); /* auto: threads when buffered */
  ofl_disk_extent_t *e = put(d, 12345, 5);
  void *data = NULL;
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, 12345, 5), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
}

/* A timeout of INT64_MAX ms (or any whose nanoseconds pass the clock's
 * range) means "wait": before, the deadline wrapped into the past and the
 * wait gave up at once with OFL_ERR_TIMEOUT. */
Test(disk, an_unbounded_timeout_waits) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_THREADS, 0);
  ofl_disk_t *d = open_with(&p);
  ofl_disk_extent_t *e = put(d, 1 << 20, 9);
  void *data = NULL;
  cr_assert(eq(int, ofl_disk_extent_wait(e, INT64_MAX), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_reload(e, INT64_MAX, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, 1 << 20, 9), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_close(d);
}

Test(disk, direct_io_on_a_file_system_that_takes_it) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  p.direct = OFL_DISK_DIRECT_ON; /* /tmp is ext4 on the project's machines */
  ofl_disk_t *d = NULL;
  ofl_status_t st = ofl_disk_open(&p, &d);
  if (st == OFL_ERR_NOT_SUPPORTED)
    cr_skip_test("O_DIRECT not available in %s", tdir);
  cr_assert(eq(int, st, OFL_SUCCESS), "%s", ofl_last_error());
  cr_expect(eq(int, disk_stats(d).direct, 1));
  ofl_disk_close(d);
}

Test(disk, prefetched_reload_does_not_stall_and_cold_reload_does) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  ofl_disk_extent_t *a = put(d, 3 << 20, 1), *b = put(d, 3 << 20, 2);
  cr_assert(eq(int, ofl_disk_extent_wait(a, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_wait(b, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_prefetch(a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_wait(a, -1), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_state(a), OFL_DISK_EXTENT_RESIDENT));
  void *pa = NULL, *pb = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(a, -1, &pa), OFL_SUCCESS));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(u64, s.prefetch_hits, 1));
  cr_expect(eq(u64, s.stalls, 0));
  cr_assert(eq(int, ofl_disk_extent_reload(b, -1, &pb), OFL_SUCCESS));
  s = disk_stats(d);
  cr_expect(eq(u64, s.stalls, 1));
  cr_expect(gt(u64, s.stall_ns, 0));
  cr_expect(eq(u64, s.reloads, 2));
  cr_expect(eq(sz, count_wrong(pa, 3 << 20, 1), 0));
  cr_expect(eq(sz, count_wrong(pb, 3 << 20, 2), 0));
  /* evict keeps the disk copy; a second reload reads it again */
  cr_assert(eq(int, ofl_disk_extent_evict(a), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_state(a), OFL_DISK_EXTENT_ON_DISK));
  cr_assert(eq(int, ofl_disk_extent_reload(a, -1, &pa), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(pa, 3 << 20, 1), 0));
  ofl_disk_extent_destroy(a);
  ofl_disk_extent_destroy(b);
  ofl_disk_close(d);
}

static void sleep_fn(void *arg) {
  (void)arg;
  struct timespec ts = {0, 400 * 1000000L};
  nanosleep(&ts, NULL);
}

Test(disk, reload_while_writing_keeps_the_buffer) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 0);
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "d2h", &s), OFL_SUCCESS));
  ofl_disk_extent_t *e = NULL;
  cr_assert(eq(int, ofl_disk_extent_create(d, 8 << 20, &e), OFL_SUCCESS));
  fill(ofl_disk_extent_data(e), 8 << 20, 9);
  /* the write is held behind the stream, so reload surely meets it */
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_fn, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_write_after(e, s), OFL_SUCCESS));
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_state(e), OFL_DISK_EXTENT_WRITING));
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  /* written, and still in memory: no read was needed */
  cr_expect(eq(int, ofl_disk_extent_state(e), OFL_DISK_EXTENT_RESIDENT));
  cr_expect(eq(sz, count_wrong(p, 8 << 20, 9), 0));
  cr_expect(eq(u64, disk_stats(d).reads, 0));
  cr_expect(eq(u64, disk_stats(d).stalls, 0));
  ofl_disk_extent_destroy(e);
  ofl_stream_destroy(s);
  ofl_disk_close(d);
}

Test(disk, budget_refuses_quietly_and_freed_space_is_reused) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  p.budget_bytes = 4 << 20;
  ofl_disk_t *d = open_with(&p);
  ofl_disk_extent_t *a = put(d, 3 << 20, 1), *b = NULL;
  cr_expect(eq(int, ofl_disk_extent_create(d, 2 << 20, &b), OFL_ERR_NO_SPACE));
  cr_expect(eq(ptr, b, NULL));
  cr_expect(eq(int, ofl_disk_is_degraded(d), 0)); /* a budget is no fault */
  cr_expect(eq(u64, disk_stats(d).budget_refusals, 1));
  cr_assert(eq(int, ofl_disk_extent_wait(a, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_destroy(a), OFL_SUCCESS));
  b = put(d, 4 << 20, 2);
  cr_assert(eq(int, ofl_disk_extent_wait(b, -1), OFL_SUCCESS));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(le(sz, s.file_bytes, 4 << 20));
  void *data = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(b, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, 4 << 20, 2), 0));
  ofl_disk_extent_destroy(b);
  ofl_disk_close(d);
}

Test(disk, bounce_budget_refusal_leaves_no_space_held) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  p.bounce_budget_bytes = 1 << 20;
  ofl_disk_t *d = open_with(&p);
  ofl_disk_extent_t *e = NULL;
  cr_expect(eq(int, ofl_disk_extent_create(d, 2 << 20, &e), OFL_ERR_NO_MEMORY));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(u64, s.buffer_refusals, 1));
  cr_expect(eq(sz, s.extent_bytes, 0));
  cr_expect(eq(u64, s.extents, 0));
  ofl_disk_close(d);
}

/* OFL_DISK_BOUNCE_BUDGET caps the store's own bounce pool when the params
 * leave it to the environment; explicit params win. */
Test(disk, bounce_budget_from_the_environment) {
  setenv("OFL_DISK_BOUNCE_BUDGET", "3M", 1);
  ofl_config_reload();
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  cr_assert(eq(sz, p.bounce_budget_bytes, OFL_DISK_FROM_ENV));
  ofl_disk_t *d = open_with(&p);
  ofl_disk_extent_t *a = NULL, *b = NULL;
  cr_assert(eq(int, ofl_disk_extent_create(d, 2 << 20, &a), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_create(d, 2 << 20, &b), OFL_ERR_NO_MEMORY));
  cr_expect(eq(u64, disk_stats(d).buffer_refusals, 1));
  ofl_disk_extent_destroy(a);
  ofl_disk_close(d);
  /* explicit 0: no cap, whatever the environment says */
  p.bounce_budget_bytes = 0;
  d = open_with(&p);
  cr_assert(eq(int, ofl_disk_extent_create(d, 2 << 20, &a), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_create(d, 2 << 20, &b), OFL_SUCCESS));
  ofl_disk_extent_destroy(a);
  ofl_disk_extent_destroy(b);
  ofl_disk_close(d);
  /* a bad value is an error naming the variable */
  setenv("OFL_DISK_BOUNCE_BUDGET", "lots", 1);
  ofl_config_reload();
  p.bounce_budget_bytes = OFL_DISK_FROM_ENV;
  d = NULL;
  cr_expect(ne(int, ofl_disk_open(&p, &d), OFL_SUCCESS));
  cr_expect(eq(ptr, d, NULL));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "OFL_DISK_BOUNCE_BUDGET"), NULL),
            "%s", ofl_last_error());
  unsetenv("OFL_DISK_BOUNCE_BUDGET");
  ofl_config_reload();
}

/* A comma list of directories: the store takes entry local rank % count,
 * the local rank from the launcher's variable, else the store's rank; an
 * empty entry is an error naming the variable. Data goes round trip in the
 * chosen directory. */
Test(disk, directory_list_spreads_ranks_over_disks) {
  static const char *const launcher[] = {"OMPI_COMM_WORLD_LOCAL_RANK",
                                         "MPI_LOCALRANKID", "SLURM_LOCALID",
                                         "LOCAL_RANK"};
  for (size_t i = 0; i < 4; i++)
    unsetenv(launcher[i]);
  char a[sizeof tdir + 8], b[sizeof tdir + 8], list[3 * sizeof tdir];
  snprintf(a, sizeof a, "%s/a", tdir);
  snprintf(b, sizeof b, "%s/b", tdir);
  cr_assert(eq(int, mkdir(a, 0700), 0));
  cr_assert(eq(int, mkdir(b, 0700), 0));
  snprintf(list, sizeof list, "%s,%s", a, b);
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.dir = list;
  for (int rank = 0; rank < 3; rank++) {
    p.rank = rank; /* no launcher variable: the store's rank */
    ofl_disk_t *d = open_with(&p);
    cr_expect(eq(str, (char *)ofl_disk_dir(d), rank % 2 ? b : a));
    ofl_disk_extent_t *e = put(d, 5000, 9);
    void *data = NULL;
    cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
    cr_assert(eq(int, ofl_disk_extent_state(e), OFL_DISK_EXTENT_ON_DISK));
    cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &data), OFL_SUCCESS));
    cr_expect(eq(sz, count_wrong(data, 5000, 9), 0));
    cr_expect(eq(u64, disk_stats(d).bytes_read, 5000));
    ofl_disk_extent_destroy(e);
    ofl_disk_close(d);
  }
  /* the launcher's local rank wins over the store's rank */
  setenv("SLURM_LOCALID", "3", 1);
  p.rank = 0;
  ofl_disk_t *d = open_with(&p);
  cr_expect(eq(str, (char *)ofl_disk_dir(d), b));
  ofl_disk_close(d);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "4", 1); /* first in the order */
  d = open_with(&p);
  cr_expect(eq(str, (char *)ofl_disk_dir(d), a));
  ofl_disk_close(d);
  for (size_t i = 0; i < 4; i++)
    unsetenv(launcher[i]);
  /* an empty entry */
  snprintf(list, sizeof list, "%s,,%s", a, b);
  p.rank = 1;
  d = NULL;
  cr_expect(eq(int, ofl_disk_open(&p, &d), OFL_ERR_CONFIG));
  cr_expect(eq(ptr, d, NULL));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "OFL_DISK_DIR"), NULL), "%s",
            ofl_last_error());
  cr_expect(eq(int, dir_entries(a), 0));
  cr_expect(eq(int, dir_entries(b), 0));
  rmdir(a);
  rmdir(b);
}

Test(disk, bad_arguments_are_errors_with_messages) {
  ofl_disk_t *d = NULL;
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  p.dev = NULL;
  cr_expect(eq(int, ofl_disk_open(&p, &d), OFL_ERR_INVALID_ARG));
  cr_expect(gt(sz, strlen(ofl_last_error()), 0));
  p = params_for(OFL_DISK_ENGINE_AUTO, 0);
  p.dir = "/nonexistent/ofl-disk";
  cr_expect(eq(int, ofl_disk_open(&p, &d), OFL_ERR_SYSTEM));
  cr_expect(eq(ptr, d, NULL));
  d = open_store(OFL_DISK_ENGINE_AUTO, 0);
  ofl_disk_extent_t *e = NULL;
  cr_expect(eq(int, ofl_disk_extent_create(d, 0, &e), OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_disk_extent_create(d, 100, &e), OFL_SUCCESS));
  void *data = NULL;
  cr_expect(
      eq(int, ofl_disk_extent_reload(e, -1, &data), OFL_ERR_INVALID_USAGE));
  cr_expect(eq(int, ofl_disk_extent_evict(e), OFL_ERR_INVALID_USAGE));
  cr_assert(eq(int, ofl_disk_extent_write(e), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_write(e), OFL_ERR_INVALID_USAGE));
  cr_assert(eq(int, ofl_disk_extent_destroy(e), OFL_SUCCESS));
  ofl_disk_close(d);
}

Test(disk, waits_time_out_and_write_after_follows_the_stream) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "d2h", &s), OFL_SUCCESS));
  ofl_disk_extent_t *e = NULL;
  cr_assert(eq(int, ofl_disk_extent_create(d, 1 << 20, &e), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_fn, NULL), OFL_SUCCESS));
  fill(ofl_disk_extent_data(e), 1 << 20, 3);
  cr_assert(eq(int, ofl_disk_extent_write_after(e, s), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_query(e), OFL_ERR_NOT_READY));
  cr_expect(eq(int, ofl_disk_extent_wait(e, 50), OFL_ERR_TIMEOUT));
  cr_expect(gt(sz, strlen(ofl_last_error()), 0));
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_query(e), OFL_SUCCESS));
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, 1 << 20, 3), 0));
  ofl_disk_extent_destroy(e);
  ofl_stream_destroy(s);
  ofl_disk_close(d);
}

Test(disk, close_destroys_live_extents) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 0);
  for (int i = 0; i < 5; i++)
    put(d, 100000, (uint64_t)i);
  ofl_disk_close(d); /* waits for the writes, frees all; teardown checks dir */
}

struct writer_arg {
  ofl_disk_t *d;
  int id;
  size_t wrong;
  int errors;
};

static void *writer_main(void *p) {
  struct writer_arg *a = p;
  for (int i = 0; i < 20; i++) {
    size_t n = 1000 + (size_t)(mix((uint64_t)(a->id * 100 + i)) % 300000);
    uint64_t seed = (uint64_t)(a->id * 1000 + i);
    ofl_disk_extent_t *e = NULL;
    if (ofl_disk_extent_create(a->d, n, &e) != OFL_SUCCESS) {
      a->errors++;
      continue;
    }
    fill(ofl_disk_extent_data(e), n, seed);
    void *data = NULL;
    if (ofl_disk_extent_write(e) != OFL_SUCCESS ||
        ofl_disk_extent_wait(e, -1) != OFL_SUCCESS ||
        ofl_disk_extent_reload(e, -1, &data) != OFL_SUCCESS)
      a->errors++;
    else
      a->wrong += count_wrong(data, n, seed);
    ofl_disk_extent_destroy(e);
  }
  return NULL;
}

Test(disk, threads_share_one_store) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 1);
  pthread_t t[4];
  struct writer_arg a[4];
  for (int i = 0; i < 4; i++) {
    a[i] = (struct writer_arg){d, i, 0, 0};
    pthread_create(&t[i], NULL, writer_main, &a[i]);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    cr_expect(eq(int, a[i].errors, 0));
    cr_expect(eq(sz, a[i].wrong, 0));
  }
  cr_expect(eq(u64, disk_stats(d).extents, 0));
  ofl_disk_close(d);
}

Test(disk, bounce_buffer_returns_only_after_the_write_completes) {
  ofl_disk_t *d = open_store(OFL_DISK_ENGINE_AUTO, 0);
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "d2h", &s), OFL_SUCCESS));
  ofl_disk_extent_t *e = NULL;
  cr_assert(eq(int, ofl_disk_extent_create(d, (2 << 20) + 1, &e), OFL_SUCCESS));
  fill(ofl_disk_extent_data(e), (2 << 20) + 1, 11);
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_fn, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_write_after(e, s), OFL_SUCCESS));
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(d->pool, &ps);
  cr_expect(eq(sz, ps.in_use_bytes, (2 << 20) + 4096)); /* held, rounded */
  cr_assert(eq(int, ofl_disk_extent_wait(e, -1), OFL_SUCCESS));
  ofl_pool_get_stats(d->pool, &ps);
  cr_expect(eq(sz, ps.in_use_bytes, 0)); /* back once written */
  /* the next extent reuses the block: no new pinned memory */
  ofl_disk_extent_t *f = put(d, (2 << 20) + 1, 12);
  cr_assert(eq(int, ofl_disk_extent_wait(f, -1), OFL_SUCCESS));
  ofl_pool_get_stats(d->pool, &ps);
  cr_expect(eq(u64, ps.backend_allocs, 1));
  void *p = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(e, -1, &p), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(p, (2 << 20) + 1, 11), 0));
  ofl_disk_extent_destroy(e);
  ofl_disk_extent_destroy(f);
  ofl_stream_destroy(s);
  ofl_disk_close(d);
}

Test(disk, reads_overtake_queued_writes_and_unstarted_writes_are_dropped) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.queue_depth = 2;
  p.block_bytes = 1 << 20;
  ofl_disk_t *d = open_with(&p);
  ofl_disk_extent_t *r = put(d, 1 << 20, 1);
  cr_assert(eq(int, ofl_disk_extent_wait(r, -1), OFL_SUCCESS));
  enum { N = 4 };
  ofl_disk_extent_t *w[N];
  ofl__disk_pause(d, 1); /* everything below stays queued until resumed */
  for (int i = 0; i < N; i++)
    w[i] = put(d, 8 << 20, (uint64_t)(10 + i));
  cr_assert(eq(int, ofl_disk_extent_prefetch(r), OFL_SUCCESS));
  /* a write not started yet: reload serves the buffer, destroy drops it */
  void *data = NULL;
  cr_assert(eq(int, ofl_disk_extent_reload(w[N - 1], -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, 8 << 20, 10 + N - 1), 0));
  cr_assert(eq(int, ofl_disk_extent_destroy(w[N - 1]), OFL_SUCCESS));
  ofl__disk_pause(d, 0);
  /* the 1-request read was queued last and goes first: it is done while
   * the first 8-request write is still going */
  cr_assert(eq(int, ofl_disk_extent_wait(r, -1), OFL_SUCCESS));
  cr_expect(eq(int, ofl_disk_extent_query(w[0]), OFL_ERR_NOT_READY));
  for (int i = 0; i < N - 1; i++)
    cr_assert(eq(int, ofl_disk_extent_wait(w[i], -1), OFL_SUCCESS));
  ofl_disk_stats_t s = disk_stats(d);
  cr_expect(eq(u64, s.writes_skipped, 1));
  cr_expect(eq(u64, s.bytes_skipped, 8 << 20));
  cr_expect(
      eq(u64, s.bytes_written, (1 << 20) + (uint64_t)(N - 1) * (8 << 20)));
  cr_expect(eq(u64, s.writes, N)); /* r and N - 1 of the others */
  cr_assert(eq(int, ofl_disk_extent_reload(r, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, 1 << 20, 1), 0));
  for (int i = 0; i < N - 1; i++) {
    cr_assert(eq(int, ofl_disk_extent_reload(w[i], -1, &data), OFL_SUCCESS));
    cr_expect(eq(sz, count_wrong(data, 8 << 20, (uint64_t)(10 + i)), 0));
    ofl_disk_extent_destroy(w[i]);
  }
  ofl_disk_extent_destroy(r);
  ofl_disk_close(d);
}

/* ---- a demand read waits for the buffers that writes in flight return ---
 * A bounce budget of two 64 KiB buffers, both held by writes in flight
 * (one held by a paused engine, one behind a slow D2H stream): the reload
 * of a third extent must wait for them, not fail with "budget exhausted"
 * (1F1B with everything on disk and a small OFL_DISK_BOUNCE_BUDGET). */

enum { BOUNCE_EXT = 64 << 10 };

static ofl_disk_t *small_bounce_store(void) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.bounce_budget_bytes = 2 * BOUNCE_EXT;
  return open_with(&p);
}

static double ms_since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) * 1e3 +
         (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
}

struct resume_arg {
  ofl_disk_t *d;
  long delay_ms;
};

static void *resume_later(void *p) {
  struct resume_arg *a = p;
  struct timespec ts = {a->delay_ms / 1000, (a->delay_ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
  ofl__disk_pause(a->d, 0);
  return NULL;
}

Test(disk, demand_read_waits_for_buffers_that_writes_in_flight_return) {
  ofl_disk_t *d = small_bounce_store();
  ofl_disk_extent_t *a = put(d, BOUNCE_EXT, 1);
  cr_assert(eq(int, ofl_disk_extent_wait(a, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_state(a), OFL_DISK_EXTENT_ON_DISK));
  /* both buffers go to writes that stay in flight for a while */
  ofl__disk_pause(d, 1);
  ofl_disk_extent_t *b = put(d, BOUNCE_EXT, 2), *c = NULL;
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "d2h", &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_create(d, BOUNCE_EXT, &c), OFL_SUCCESS));
  fill(ofl_disk_extent_data(c), BOUNCE_EXT, 3);
  cr_assert(
      eq(int, ofl_stream_launch_host_func(s, sleep_fn, NULL), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_write_after(c, s), OFL_SUCCESS));
  /* no buffer now: a prefetch is refused quietly */
  cr_expect(eq(int, ofl_disk_extent_prefetch(a), OFL_ERR_NO_MEMORY));
  pthread_t t;
  struct resume_arg ra = {d, 200};
  pthread_create(&t, NULL, resume_later, &ra);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  void *data = NULL;
  cr_expect(eq(int, ofl_disk_extent_reload(a, 20000, &data), OFL_SUCCESS),
            "%s", ofl_last_error());
  double waited = ms_since(&t0);
  pthread_join(t, NULL);
  cr_expect(ge(dbl, waited, 150.0), "the reload waited for a write (%.0f ms)",
            waited);
  cr_assert(not(eq(ptr, data, NULL)));
  cr_expect(eq(sz, count_wrong(data, BOUNCE_EXT, 1), 0));
  cr_assert(eq(int, ofl_disk_extent_wait(b, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_wait(c, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_destroy(a), OFL_SUCCESS));
  /* the writes' bytes are intact too */
  cr_assert(eq(int, ofl_disk_extent_reload(b, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, BOUNCE_EXT, 2), 0));
  cr_assert(eq(int, ofl_disk_extent_destroy(b), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_reload(c, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, BOUNCE_EXT, 3), 0));
  cr_assert(eq(int, ofl_disk_extent_destroy(c), OFL_SUCCESS));
  ofl_stream_destroy(s);
  ofl_disk_close(d);
}

/* Buffers held by extents in memory (no write in flight to return one):
 * no progress is possible, so the reload fails at once, saying why. */
Test(disk, demand_read_without_writes_in_flight_fails_at_once) {
  ofl_disk_t *d = small_bounce_store();
  ofl_disk_extent_t *a = put(d, BOUNCE_EXT, 1), *b = NULL, *c = NULL;
  cr_assert(eq(int, ofl_disk_extent_wait(a, -1), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_create(d, BOUNCE_EXT, &b), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_create(d, BOUNCE_EXT, &c), OFL_SUCCESS));
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  void *data = NULL;
  cr_expect(eq(int, ofl_disk_extent_reload(a, 20000, &data),
               OFL_ERR_NO_MEMORY));
  cr_expect(lt(dbl, ms_since(&t0), 5000.0), "did not wait for the timeout");
  cr_expect(eq(ptr, data, NULL));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "no write in flight"), NULL),
            "%s", ofl_last_error());
  /* a buffer given back makes the retry work */
  cr_assert(eq(int, ofl_disk_extent_destroy(c), OFL_SUCCESS));
  cr_assert(eq(int, ofl_disk_extent_reload(a, -1, &data), OFL_SUCCESS));
  cr_expect(eq(sz, count_wrong(data, BOUNCE_EXT, 1), 0));
  ofl_disk_extent_destroy(a);
  ofl_disk_extent_destroy(b);
  ofl_disk_close(d);
}

/* Writes that never finish (a stuck disk): the wait is bounded by the
 * reload's timeout. */
Test(disk, demand_read_waiting_for_stuck_writes_times_out) {
  ofl_disk_t *d = small_bounce_store();
  ofl_disk_extent_t *a = put(d, BOUNCE_EXT, 1);
  cr_assert(eq(int, ofl_disk_extent_wait(a, -1), OFL_SUCCESS));
  ofl__disk_pause(d, 1);
  ofl_disk_extent_t *b = put(d, BOUNCE_EXT, 2), *c = put(d, BOUNCE_EXT, 3);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  void *data = NULL;
  cr_expect(eq(int, ofl_disk_extent_reload(a, 300, &data), OFL_ERR_TIMEOUT));
  double waited = ms_since(&t0);
  cr_expect(ge(dbl, waited, 250.0), "%.0f ms", waited);
  cr_expect(ne(ptr, strstr(ofl_last_error(), "writes in flight"), NULL), "%s",
            ofl_last_error());
  ofl__disk_pause(d, 0);
  cr_assert(eq(int, ofl_disk_extent_reload(a, -1, &data), OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_expect(eq(sz, count_wrong(data, BOUNCE_EXT, 1), 0));
  ofl_disk_extent_destroy(a);
  ofl_disk_extent_destroy(b);
  ofl_disk_extent_destroy(c);
  ofl_disk_close(d);
}

/* OFL_DISK_BUDGET: 0 is no cap; a cap below the 4 KiB unit would round to
 * 0 and silently lift the cap, so it is a configuration error. */
Test(disk, budget_zero_is_no_cap_and_a_tiny_budget_is_an_error) {
  ofl_disk_params_t p = params_for(OFL_DISK_ENGINE_AUTO, 1);
  p.budget_bytes = 0;
  p.grow_bytes = 1 << 20;
  ofl_disk_t *d = open_with(&p);
  ofl_disk_extent_t *e[3];
  for (int i = 0; i < 3; i++)
    e[i] = put(d, 3 << 20, (uint64_t)i);
  cr_expect(eq(u64, disk_stats(d).budget_refusals, 0));
  cr_expect(eq(sz, disk_stats(d).budget_bytes, 0));
  for (int i = 0; i < 3; i++)
    ofl_disk_extent_destroy(e[i]);
  ofl_disk_close(d);
  p.budget_bytes = 100;
  d = NULL;
  cr_expect(eq(int, ofl_disk_open(&p, &d), OFL_ERR_CONFIG));
  cr_expect(eq(ptr, d, NULL));
  cr_expect(ne(ptr, strstr(ofl_last_error(), "OFL_DISK_BUDGET"), NULL), "%s",
            ofl_last_error());
}
