/* Helpers shared by the disk store tests: a device of the backend under test
 * (OFLTEST_BACKEND, tests/support/devmem.h), a private temp directory per test
 * (checked empty at the end), seeded byte patterns. Extents' buffers are
 * pinned memory, which the CPU reads and writes on every backend; device
 * memory is filled and checked through copies (dev_fill, dev_wrong). */
#ifndef OFL_TESTS_DISK_UTIL_H
#define OFL_TESTS_DISK_UTIL_H

#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "disk/disk_internal.h"
#include "tests/support/devmem.h"

static ofl_device_t *dev;
static char tdir[256];

/* Entries of a directory other than . and ..; -1 when it cannot be read. */
static inline int dir_entries(const char *path) {
  DIR *dd = opendir(path);
  if (dd == NULL)
    return -1;
  int n = 0;
  struct dirent *de;
  while ((de = readdir(dd)) != NULL)
    if (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0)
      n++;
  closedir(dd);
  return n;
}

static inline void disk_setup(void) {
  /* strict mode with jitter on the host backend */
  ofl_device_params_t p = t_device_params(50, 0);
  p.device_capacity_bytes = (size_t)1 << 30;
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  snprintf(tdir, sizeof tdir, "/tmp/ofl-disk-test-XXXXXX");
  cr_assert(not(eq(ptr, mkdtemp(tdir), NULL)));
}

static inline void disk_teardown(void) {
  ofl_device_close(dev);
  int n = dir_entries(tdir);
  rmdir(tdir);
  cr_expect(eq(int, n, 0), "files left in %s", tdir);
}

static inline ofl_disk_params_t params_for(ofl_disk_engine_t engine,
                                           int checksum) {
  ofl_disk_params_t p = OFL_DISK_PARAMS_INIT;
  p.dev = dev;
  p.dir = tdir;
  p.engine = engine;
  p.checksum = checksum;
  p.budget_bytes = 0;
  p.queue_depth = 8;
  p.block_bytes = (size_t)1 << 20;
  p.rank = 0;
  p.keep_bytes = 0; /* reloads read the file; the keep tests set their own */
  return p;
}

static inline ofl_disk_t *open_with(const ofl_disk_params_t *p) {
#if OFL_HAVE_LIBURING
  /* Not usable on an old kernel, nor under valgrind (its io_uring_enter
   * blocks for good): the io_uring variants are skipped there. */
  if (p->engine == OFL_DISK_ENGINE_URING && !ofl__disk_uring_usable())
    cr_skip_test("io_uring is not usable here (kernel without timed waits, "
                 "or valgrind)");
#endif
  ofl_disk_t *d = NULL;
  cr_assert(eq(int, ofl_disk_open(p, &d), OFL_SUCCESS), "%s", ofl_last_error());
  return d;
}

static inline ofl_disk_t *open_store(ofl_disk_engine_t engine, int checksum) {
  ofl_disk_params_t p = params_for(engine, checksum);
  return open_with(&p);
}

static inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

/* Byte i of pattern seed: differs between seeds and between positions. */
static inline void fill(void *p, size_t n, uint64_t seed) {
  unsigned char *b = p;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = mix(seed * 0x9e3779b97f4a7c15ull + i);
    memcpy(b + i, &v, 8);
  }
  uint64_t v = mix(seed * 0x9e3779b97f4a7c15ull + i);
  for (; i < n; i++, v >>= 8)
    b[i] = (unsigned char)v;
}

static inline size_t count_wrong(const void *p, size_t n, uint64_t seed) {
  unsigned char *ref = malloc(n ? n : 1);
  cr_assert(not(eq(ptr, ref, NULL)));
  fill(ref, n, seed);
  const unsigned char *b = p;
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++)
    wrong += b[i] != ref[i];
  free(ref);
  return wrong;
}

/* Device memory [dptr, dptr + n) set to pattern seed, through an H2D copy on
 * the compute stream (waited for). */
static inline void dev_fill(void *dptr, size_t n, uint64_t seed) {
  void *h = malloc(n ? n : 1);
  cr_assert(not(eq(ptr, h, NULL)));
  fill(h, n, seed);
  cr_assert(eq(int, t_write(dev, dptr, h, n), OFL_SUCCESS), "%s",
            ofl_last_error());
  free(h);
}

/* Wrong bytes of device memory [dptr, dptr + n) against pattern seed, read
 * back through a D2H copy on the compute stream. */
static inline size_t dev_wrong(const void *dptr, size_t n, uint64_t seed) {
  void *h = malloc(n ? n : 1);
  cr_assert(not(eq(ptr, h, NULL)));
  cr_assert(eq(int, t_read(dev, h, dptr, n), OFL_SUCCESS), "%s",
            ofl_last_error());
  size_t w = count_wrong(h, n, seed);
  free(h);
  return w;
}

static inline ofl_disk_stats_t disk_stats(const ofl_disk_t *d) {
  ofl_disk_stats_t s;
  memset(&s, 0, sizeof s);
  ofl_disk_get_stats(d, &s);
  return s;
}

/* Creates an extent of n bytes holding pattern seed and writes it. */
static inline ofl_disk_extent_t *put(ofl_disk_t *d, size_t n, uint64_t seed) {
  ofl_disk_extent_t *e = NULL;
  cr_assert(eq(int, ofl_disk_extent_create(d, n, &e), OFL_SUCCESS), "%s",
            ofl_last_error());
  fill(ofl_disk_extent_data(e), n, seed);
  cr_assert(eq(int, ofl_disk_extent_write(e), OFL_SUCCESS), "%s",
            ofl_last_error());
  return e;
}

#endif /* OFL_TESTS_DISK_UTIL_H */
