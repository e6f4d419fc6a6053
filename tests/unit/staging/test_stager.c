/* The stager: a staged copy is immune to later updates, cached staging
 * reuses its memory, shared storage is copied once, type_check names the
 * tensor, a source freed while staging is an error, and background saves
 * round-trip through the safetensors reader and fail without partial files. */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "runtime/internal.h"
#include "staging/staging_internal.h"
#include "tests/support/devmem.h"

/* On the backend under test (OFLTEST_BACKEND). Staged copies live in host
 * memory and are read by the CPU; device tensors only through copies
 * (host_bytes). */
static ofl_device_t *dev;
static ofl_pool_t *pool;
static char dir[256];

static void setup(void) {
  ofl_device_params_t p = t_device_params(100, 0);
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.kind = OFL_POOL_DEVICE;
  pp.budget_bytes = 0;
  cr_assert(eq(int, ofl_pool_create(dev, &pp, &pool), OFL_SUCCESS), "%s",
            ofl_last_error());
  snprintf(dir, sizeof dir, "/tmp/ofl-stager-test.XXXXXX");
  cr_assert(not(eq(ptr, mkdtemp(dir), NULL)));
}
static void teardown(void) {
  ofl_pool_destroy(pool);
  ofl_device_close(dev);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  (void)!system(cmd);
}

TestSuite(stager, .init = setup, .fini = teardown, .timeout = 60);

static void pattern(unsigned char *p, size_t n, unsigned seed) {
  uint32_t x = seed * 2654435761u + 7;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (unsigned char)(x >> 16);
  }
}

/* A device tensor filled with pattern(seed) through the compute stream. */
static ofl_tensor_t *dev_tensor(const int64_t *shape, int ndim, ofl_dtype_t dt,
                                unsigned seed) {
  ofl_tensor_t *t = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, ndim, dt, NULL, &t),
               OFL_SUCCESS),
            "%s", ofl_last_error());
  size_t n = ofl_tensor_bytes(t);
  unsigned char *h = malloc(n ? n : 1);
  pattern(h, n, seed);
  ofl_stream_t *c = ofl_device_compute_stream(dev);
  cr_assert(eq(int, ofl_memcpy_async(ofl_tensor_data(t), h, n, OFL_COPY_H2D, c),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(c, 10000), OFL_SUCCESS));
  free(h);
  return t;
}

/* Overwrites a device tensor (a training update) on the compute stream. */
static void update(ofl_tensor_t *t, int value) {
  ofl_stream_t *c = ofl_device_compute_stream(dev);
  cr_assert(eq(int, ofl_memset_async(ofl_tensor_data(t), value,
                                     ofl_tensor_bytes(t), c),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_stream_synchronize(c, 10000), OFL_SUCCESS));
}

/* A host copy of a tensor's bytes (free it): a device tensor's read back
 * through a copy, a host tensor's (a staged copy) copied by the CPU. */
static unsigned char *host_bytes(const ofl_tensor_t *t) {
  size_t n = ofl_tensor_bytes(t);
  unsigned char *h = malloc(n ? n : 1);
  cr_assert(not(eq(ptr, h, NULL)));
  if (ofl_tensor_location(t) == OFL_LOC_DEVICE)
    cr_assert(eq(int, t_read(dev, h, ofl_tensor_data(t), n), OFL_SUCCESS),
              "%s", ofl_last_error());
  else
    memcpy(h, ofl_tensor_data(t), n);
  return h;
}

/* Bytes of a tensor (staged, or on the device) differing from
 * pattern(seed). */
static size_t wrong_bytes(const ofl_tensor_t *t, unsigned seed) {
  size_t n = ofl_tensor_bytes(t);
  unsigned char *want = malloc(n ? n : 1);
  pattern(want, n, seed);
  unsigned char *got = host_bytes(t);
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++)
    wrong += got[i] != want[i];
  free(want);
  free(got);
  return wrong;
}

static int count_files(const char *d) {
  DIR *dp = opendir(d);
  int n = 0;
  struct dirent *e;
  while (dp != NULL && (e = readdir(dp)) != NULL)
    n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
  if (dp != NULL)
    closedir(dp);
  return n;
}

enum { NT = 3 };
static const int64_t shapes[NT][2] = {{64, 33}, {17, 5}, {1000, 3}};
static const ofl_dtype_t dtypes[NT] = {OFL_DTYPE_F32, OFL_DTYPE_BF16,
                                       OFL_DTYPE_I64};
static const char *names[NT] = {"layers.0.weight", "layers.0.norm",
                                "step_counts"};

static void make_state(ofl_tensor_t **t, ofl_named_tensor_t *nt, unsigned seed) {
  for (int i = 0; i < NT; i++) {
    t[i] = dev_tensor(shapes[i], 2, dtypes[i], seed + (unsigned)i);
    nt[i] = (ofl_named_tensor_t){names[i], t[i]};
  }
}
static void free_state(ofl_tensor_t **t) {
  for (int i = 0; i < NT; i++)
    cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
}

static void check_old_bytes_survive_updates(int async) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.async_staging = async;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stager_should_synchronize_after_execute(s), async));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 10);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_stager_synchronize(s, 10000), OFL_SUCCESS), "%s",
            ofl_last_error());
  for (int i = 0; i < NT; i++)
    update(t[i], 0x5c); /* training moves on */
  cr_assert(eq(sz, ofl_staged_count(set), NT));
  for (int i = 0; i < NT; i++) {
    const ofl_tensor_t *st = ofl_staged_find(set, names[i]);
    cr_assert(not(eq(ptr, (void *)st, NULL)));
    cr_assert(eq(ptr, (void *)st, (void *)ofl_staged_tensor(set, (size_t)i)));
    cr_assert(eq(str, (char *)ofl_staged_name(set, (size_t)i),
                 (char *)names[i]));
    cr_assert(eq(int, (int)ofl_tensor_dtype(st), (int)dtypes[i]));
    cr_assert(eq(i64, ofl_tensor_shape(st)[0], shapes[i][0]));
    cr_assert(eq(i64, ofl_tensor_shape(st)[1], shapes[i][1]));
    cr_assert(eq(int, (int)ofl_tensor_location(st), OFL_LOC_PINNED));
    cr_assert(eq(sz, wrong_bytes(st, 10 + (unsigned)i), 0), "tensor %s",
              names[i]);
    unsigned char *now = host_bytes(t[i]);
    cr_assert(eq(int, now[0], 0x5c));
    free(now);
  }
  cr_assert(eq(int, ofl_staged_status(set), OFL_SUCCESS));
  ofl_staged_release(set);
  free_state(t);
  cr_assert(eq(int, ofl_stager_destroy(s), OFL_SUCCESS));
}

Test(stager, blocking_staged_copy_keeps_old_bytes_after_device_updates) {
  check_old_bytes_survive_updates(0);
}

Test(stager, async_staged_copy_keeps_old_bytes_after_synchronize) {
  check_old_bytes_survive_updates(1);
}

Test(stager, cached_staging_allocates_once_and_reuses_the_pinned_copy) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  p.pin_memory = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 20);
  ofl_staged_t *first = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &first), OFL_SUCCESS));
  ofl_staged_release(first);
  ofl_device_stats_t d0;
  ofl_device_get_stats(dev, &d0);
  for (int it = 1; it <= 5; it++) {
    /* new values each step, as training would produce */
    for (int i = 0; i < NT; i++) {
      ofl_stream_t *c = ofl_device_compute_stream(dev);
      size_t n = ofl_tensor_bytes(t[i]);
      unsigned char *h = malloc(n);
      pattern(h, n, 100u * (unsigned)it + (unsigned)i);
      cr_assert(eq(int, ofl_memcpy_async(ofl_tensor_data(t[i]), h, n,
                                         OFL_COPY_H2D, c),
                   OFL_SUCCESS));
      ofl_stream_synchronize(c, 10000);
      free(h);
    }
    ofl_staged_t *set = NULL;
    cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
    cr_assert(eq(ptr, (void *)set, (void *)first), "same cached set");
    for (int i = 0; i < NT; i++)
      cr_assert(eq(sz,
                   wrong_bytes(ofl_staged_tensor(set, (size_t)i),
                               100u * (unsigned)it + (unsigned)i),
                   0),
                "iteration %d tensor %d", it, i);
    ofl_staged_release(set);
  }
  ofl_device_stats_t d1;
  ofl_device_get_stats(dev, &d1);
  cr_assert(eq(u64, d1.pinned_allocs, d0.pinned_allocs),
            "no pinned allocation after the first stage");
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  cr_assert(eq(u64, st.stages, 6));
  cr_assert(eq(u64, st.buffer_allocs, 1));
  cr_assert(eq(u64, st.cache_reuses, 5));
  cr_assert(eq(u64, st.cache_rebuilds, 0));
  free_state(t);
  cr_assert(eq(int, ofl_stager_destroy(s), OFL_SUCCESS));
}

Test(stager, uncached_staging_gives_each_call_its_own_copy) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.pin_memory = 0;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 30);
  ofl_staged_t *a = NULL, *b = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &a), OFL_SUCCESS));
  update(t[0], 0x11);
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &b), OFL_SUCCESS));
  cr_assert(not(eq(ptr, (void *)a, (void *)b)));
  cr_assert(eq(sz, wrong_bytes(ofl_staged_tensor(a, 0), 30), 0));
  const unsigned char *nb = ofl_tensor_data(ofl_staged_tensor(b, 0));
  size_t not_updated = 0;
  for (size_t i = 0; i < ofl_tensor_bytes(t[0]); i++)
    not_updated += nb[i] != 0x11;
  cr_assert(eq(sz, not_updated, 0));
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  cr_assert(eq(u64, st.buffer_allocs, 2));
  ofl_staged_release(a);
  ofl_staged_release(b);
  free_state(t);
  ofl_stager_destroy(s);
}

Test(stager, type_check_names_the_tensor_whose_shape_dtype_or_name_changed) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  p.type_check = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 40);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  ofl_staged_release(set);

  /* a different shape */
  int64_t other[2] = {17, 6};
  ofl_tensor_t *u = dev_tensor(other, 2, OFL_DTYPE_BF16, 1);
  ofl_named_tensor_t nt2[NT] = {nt[0], {names[1], u}, nt[2]};
  ofl_staged_t *bad = (ofl_staged_t *)0x1;
  cr_assert(eq(int, ofl_stager_stage(s, nt2, NT, &bad), OFL_ERR_MISMATCH));
  cr_assert(eq(ptr, (void *)bad, (void *)0x1));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "'layers.0.norm'"), NULL)),
            "%s", ofl_last_error());
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "[17,5]"), NULL)));
  /* a different dtype */
  ofl_tensor_t *v = dev_tensor(shapes[1], 2, OFL_DTYPE_F16, 1);
  nt2[1].tensor = v;
  cr_assert(eq(int, ofl_stager_stage(s, nt2, NT, &bad), OFL_ERR_MISMATCH));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "bf16"), NULL)), "%s",
            ofl_last_error());
  /* a name not in the cached set */
  ofl_named_tensor_t nt3[NT] = {nt[0], {"layers.0.bias", t[1]}, nt[2]};
  cr_assert(eq(int, ofl_stager_stage(s, nt3, NT, &bad), OFL_ERR_MISMATCH));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "'layers.0.bias'"), NULL)),
            "%s", ofl_last_error());
  /* a missing name */
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT - 1, &bad), OFL_ERR_MISMATCH));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "'step_counts'"), NULL)),
            "%s", ofl_last_error());
  /* the original layout still stages into the cache */
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  ofl_staged_release(set);
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  cr_assert(eq(u64, st.buffer_allocs, 1));
  cr_assert(eq(u64, st.stages, 2));
  ofl_stager_destroy(s);

  /* Caching off: a different layout is just another copy. */
  p.cache_staged = 0;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  ofl_staged_release(set);
  nt2[1].tensor = u;
  cr_assert(eq(int, ofl_stager_stage(s, nt2, NT, &set), OFL_SUCCESS));
  cr_assert(eq(sz, wrong_bytes(ofl_staged_find(set, names[1]), 1), 0));
  ofl_staged_release(set);
  ofl_stager_destroy(s);
  ofl_pool_free(pool, u);
  ofl_pool_free(pool, v);
  free_state(t);
}

Test(stager, cache_without_type_check_rebuilds_on_a_new_layout) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 50);
  ofl_staged_t *a = NULL, *b = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT - 1, &b), OFL_SUCCESS));
  cr_assert(not(eq(ptr, (void *)a, (void *)b)));
  /* the old set, still held, was not overwritten */
  cr_assert(eq(sz, ofl_staged_count(a), NT));
  cr_assert(eq(sz, wrong_bytes(ofl_staged_tensor(a, 2), 52), 0));
  cr_assert(eq(sz, ofl_staged_count(b), NT - 1));
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  cr_assert(eq(u64, st.cache_rebuilds, 1));
  cr_assert(eq(u64, st.buffer_allocs, 2));
  ofl_staged_release(a);
  ofl_staged_release(b);
  free_state(t);
  ofl_stager_destroy(s);
}

Test(stager, tensors_sharing_storage_are_copied_once_and_stay_shared) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  int64_t shape[1] = {4096};
  ofl_tensor_t *base = dev_tensor(shape, 1, OFL_DTYPE_F32, 60);
  ofl_tensor_t *v1 = NULL, *v2 = NULL, *al = NULL;
  int64_t vs[2] = {16, 16};
  cr_assert(eq(int, ofl_tensor_view(base, 1024, vs, 2, OFL_DTYPE_F32, &v1),
               OFL_SUCCESS));
  int64_t vs2[1] = {100};
  cr_assert(eq(int, ofl_tensor_view(base, 1500, vs2, 1, OFL_DTYPE_I16, &v2),
               OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_alias(base, &al), OFL_SUCCESS));
  int64_t other_shape[1] = {10};
  ofl_tensor_t *other = dev_tensor(other_shape, 1, OFL_DTYPE_U8, 61);
  ofl_named_tensor_t nt[5] = {{"view1", v1}, {"base", base}, {"other", other},
                              {"view2", v2}, {"alias", al}};
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, 5, &set), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  cr_assert(eq(u64, st.storages_copied, 2));
  cr_assert(eq(u64, st.shared_tensors, 3));
  cr_assert(eq(u64, st.bytes_copied, 4096 * 4 + 10));
  const ofl_tensor_t *sb = ofl_staged_find(set, "base");
  cr_assert(eq(sz, wrong_bytes(sb, 60), 0));
  for (int i = 0; i < 5; i++) {
    const ofl_tensor_t *x = ofl_staged_tensor(set, (size_t)i);
    cr_assert(eq(sz, ofl_tensor_bytes(x), ofl_tensor_bytes(nt[i].tensor)));
    unsigned char *src = host_bytes(nt[i].tensor);
    cr_assert(eq(int, memcmp(ofl_tensor_data(x), src, ofl_tensor_bytes(x)), 0),
              "tensor %s", nt[i].name);
    free(src);
    if (i != 2)
      cr_assert(eq(ptr, (void *)ofl_tensor_storage_id(x),
                   (void *)ofl_tensor_storage_id(sb)),
                "staged %s shares the staged base's storage", nt[i].name);
  }
  cr_assert(not(eq(ptr, (void *)ofl_tensor_storage_id(ofl_staged_find(set, "other")),
                   (void *)ofl_tensor_storage_id(sb))));
  /* views keep their offsets inside the shared copy */
  cr_assert(eq(sz, (size_t)((char *)ofl_tensor_data(ofl_staged_find(set, "view2")) -
                            (char *)ofl_tensor_data(sb)),
               1500));
  ofl_staged_release(set);
  ofl_tensor_destroy(v1);
  ofl_tensor_destroy(v2);
  ofl_tensor_destroy(al);
  ofl_pool_free(pool, base);
  ofl_pool_free(pool, other);
  ofl_stager_destroy(s);
}

Test(stager, bad_inputs_are_rejected_with_nothing_staged) {
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, NULL, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 70);
  ofl_staged_t *out = (ofl_staged_t *)0x1;
  ofl_named_tensor_t dup[2] = {nt[0], {names[0], t[1]}};
  cr_assert(eq(int, ofl_stager_stage(s, dup, 2, &out), OFL_ERR_INVALID_ARG));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "appears twice"), NULL)));
  ofl_named_tensor_t null_t[1] = {{"w", NULL}};
  cr_assert(eq(int, ofl_stager_stage(s, null_t, 1, &out), OFL_ERR_INVALID_ARG));
  char longname[OFL_SAFETENSORS_NAME_MAX + 10];
  memset(longname, 'a', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  ofl_named_tensor_t lng[1] = {{longname, t[0]}};
  cr_assert(eq(int, ofl_stager_stage(s, lng, 1, &out), OFL_ERR_INVALID_ARG));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "longer than"), NULL)));
  ofl_tensor_t *released = NULL;
  cr_assert(eq(int, ofl_tensor_alias(t[2], &released), OFL_SUCCESS));
  cr_assert(eq(int, ofl_tensor_release_storage(released), OFL_SUCCESS));
  ofl_named_tensor_t rel[1] = {{"gone", released}};
  cr_assert(eq(int, ofl_stager_stage(s, rel, 1, &out), OFL_ERR_INVALID_ARG));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "'gone'"), NULL)));
  cr_assert(eq(ptr, (void *)out, (void *)0x1));
  ofl_stager_stats_t st;
  ofl_stager_get_stats(s, &st);
  cr_assert(eq(u64, st.stages, 0));
  cr_assert(eq(u64, st.buffer_allocs, 0));
  ofl_tensor_destroy(released);
  free_state(t);
  ofl_stager_destroy(s);
}

Test(stager, source_freed_while_async_staging_is_an_error_and_saves_nothing) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.async_staging = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 80);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  char path[300];
  snprintf(path, sizeof path, "%s/freed.safetensors", dir);
  ofl_save_future_t *f = NULL;
  /* Freed before the join: the pool must not hand the block out while the
   * copy may still read it (strict mode would poison it). */
  void *old = ofl_tensor_data(t[1]);
  cr_assert(eq(int, ofl_pool_free(pool, t[1]), OFL_SUCCESS));
  ofl_tensor_t *reuse = NULL;
  cr_assert(eq(int, ofl_pool_alloc(pool, shapes[1], 2, dtypes[1], NULL, &reuse),
               OFL_SUCCESS));
  cr_assert(not(eq(ptr, ofl_tensor_data(reuse), old)),
            "freed source not handed out while staging holds it");
  cr_assert(eq(int, ofl_stager_save(s, set, path, NULL, 0, &f), OFL_SUCCESS));
  ofl_status_t st = ofl_stager_synchronize(s, 10000);
  cr_assert(eq(int, st, OFL_ERR_INVALID_USAGE));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "'layers.0.norm' was freed"),
                   NULL)),
            "%s", ofl_last_error());
  cr_assert(eq(int, ofl_staged_status(set), OFL_ERR_INVALID_USAGE));
  cr_assert(eq(int, ofl_save_wait(f, 10000), OFL_ERR_INVALID_USAGE));
  cr_assert(not(eq(ptr, strstr(ofl_save_error(f), "freed while staging"), NULL)),
            "%s", ofl_save_error(f));
  cr_assert(eq(int, count_files(dir), 0), "no file, partial or final");
  ofl_save_release(f);
  ofl_staged_release(set);
  ofl_pool_free(pool, reuse);
  ofl_pool_free(pool, t[0]);
  ofl_pool_free(pool, t[2]);
  ofl_stager_stats_t ss;
  ofl_stager_get_stats(s, &ss);
  cr_assert(eq(u64, ss.saves_failed, 1));
  ofl_stager_destroy(s);
}

/* Every dtype staged from the device, saved in the background, read back. */
Test(stager, save_round_trips_every_dtype_byte_for_byte) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  p.async_staging = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[OFL_DTYPE_COUNT];
  ofl_named_tensor_t nt[OFL_DTYPE_COUNT];
  char nm[OFL_DTYPE_COUNT][32];
  for (int d = 0; d < OFL_DTYPE_COUNT; d++) {
    int64_t shape[3] = {3 + d, 7, 2};
    t[d] = dev_tensor(shape, 3, (ofl_dtype_t)d, 200u + (unsigned)d);
    snprintf(nm[d], sizeof nm[d], "t.%s", ofl_dtype_name((ofl_dtype_t)d));
    nt[d] = (ofl_named_tensor_t){nm[d], t[d]};
  }
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, OFL_DTYPE_COUNT, &set),
               OFL_SUCCESS));
  char path[300];
  snprintf(path, sizeof path, "%s/all.safetensors", dir);
  ofl_safetensors_kv_t meta[1] = {{"step", "42"}};
  ofl_save_future_t *f = NULL;
  /* the save joins the stage itself */
  cr_assert(eq(int, ofl_stager_save(s, set, path, meta, 1, &f), OFL_SUCCESS));
  cr_assert(eq(int, ofl_save_wait(f, 20000), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_stager_synchronize(s, 10000), OFL_SUCCESS));
  struct stat sb;
  cr_assert(eq(int, stat(path, &sb), 0));
  cr_assert(eq(u64, ofl_save_bytes(f), (uint64_t)sb.st_size));
  ofl_safetensors_t *rd = NULL;
  cr_assert(eq(int, ofl_safetensors_open(path, &rd), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(sz, ofl_safetensors_count(rd), OFL_DTYPE_COUNT));
  cr_assert(eq(str, (char *)ofl_safetensors_metadata_get(rd, "step"), "42"));
  cr_assert(eq(str, (char *)ofl_safetensors_metadata_get(rd, "format"), "pt"));
  for (int d = 0; d < OFL_DTYPE_COUNT; d++) {
    ofl_safetensors_entry_t e;
    cr_assert(eq(int, ofl_safetensors_find(rd, nm[d], &e), OFL_SUCCESS));
    cr_assert(eq(int, (int)e.dtype, d));
    cr_assert(eq(int, e.ndim, 3));
    cr_assert(eq(i64, e.shape[0], 3 + d));
    cr_assert(eq(sz, e.bytes, ofl_tensor_bytes(t[d])));
    unsigned char *src = host_bytes(t[d]);
    cr_assert(eq(int, memcmp(e.data, src, e.bytes), 0), "bytes of %s", nm[d]);
    free(src);
  }
  ofl_safetensors_close(rd);
  cr_assert(eq(int, count_files(dir), 1));
  ofl_save_release(f);
  ofl_staged_release(set);
  for (int d = 0; d < OFL_DTYPE_COUNT; d++)
    ofl_pool_free(pool, t[d]);
  ofl_stager_stats_t ss;
  ofl_stager_get_stats(s, &ss);
  cr_assert(eq(u64, ss.saves_completed, 1));
  ofl_stager_destroy(s);
}

/* A write hook that holds the save until released, so that "in flight" is
 * deterministic. */
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cond = PTHREAD_COND_INITIALIZER;
static int gate_open;
static atomic_int gate_entered;
static ssize_t gated_write(int fd, const void *buf, size_t bytes) {
  atomic_fetch_add(&gate_entered, 1);
  pthread_mutex_lock(&gate_lock);
  while (!gate_open)
    pthread_cond_wait(&gate_cond, &gate_lock);
  pthread_mutex_unlock(&gate_lock);
  return write(fd, buf, bytes);
}
static void open_gate(void) {
  pthread_mutex_lock(&gate_lock);
  gate_open = 1;
  pthread_cond_broadcast(&gate_cond);
  pthread_mutex_unlock(&gate_lock);
}
static void *open_gate_later(void *arg) {
  (void)arg;
  usleep(200 * 1000);
  open_gate();
  return NULL;
}

static void wait_entered(void) {
  for (int i = 0; i < 5000 && atomic_load(&gate_entered) == 0; i++)
    usleep(1000);
  cr_assert(gt(int, atomic_load(&gate_entered), 0));
}

Test(stager, second_save_in_flight_is_refused_when_busy_is_error) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.when_busy = OFL_SAVE_WHEN_BUSY_ERROR;
  p.max_inflight_saves = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 90);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  ofl__safetensors_set_write_hook(gated_write);
  char p1[300], p2[300];
  snprintf(p1, sizeof p1, "%s/a.safetensors", dir);
  snprintf(p2, sizeof p2, "%s/b.safetensors", dir);
  ofl_save_future_t *f1 = NULL, *f2 = (ofl_save_future_t *)0x1;
  cr_assert(eq(int, ofl_stager_save(s, set, p1, NULL, 0, &f1), OFL_SUCCESS));
  wait_entered();
  cr_assert(eq(int, ofl_save_query(f1), OFL_ERR_NOT_READY));
  cr_assert(eq(int, ofl_save_wait(f1, 50), OFL_ERR_TIMEOUT));
  cr_assert(eq(int, ofl_stager_save(s, set, p2, NULL, 0, &f2),
               OFL_ERR_INVALID_USAGE));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "already in flight"), NULL)));
  cr_assert(eq(ptr, (void *)f2, (void *)0x1));
  open_gate();
  cr_assert(eq(int, ofl_save_wait(f1, 20000), OFL_SUCCESS), "%s",
            ofl_last_error());
  ofl__safetensors_set_write_hook(NULL);
  /* a slot is free again */
  cr_assert(eq(int, ofl_stager_save(s, set, p2, NULL, 0, &f2), OFL_SUCCESS));
  cr_assert(eq(int, ofl_save_wait(f2, 20000), OFL_SUCCESS));
  cr_assert(eq(int, count_files(dir), 2));
  ofl_save_release(f1);
  ofl_save_release(f2);
  ofl_staged_release(set);
  free_state(t);
  ofl_stager_destroy(s);
}

Test(stager, second_save_waits_for_the_first_by_default) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.max_inflight_saves = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 95);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  ofl__safetensors_set_write_hook(gated_write);
  char p1[300], p2[300];
  snprintf(p1, sizeof p1, "%s/a.safetensors", dir);
  snprintf(p2, sizeof p2, "%s/b.safetensors", dir);
  ofl_save_future_t *f1 = NULL, *f2 = NULL;
  cr_assert(eq(int, ofl_stager_save(s, set, p1, NULL, 0, &f1), OFL_SUCCESS));
  wait_entered();
  pthread_t th;
  pthread_create(&th, NULL, open_gate_later, NULL);
  uint64_t t0 = ofl__now_ns();
  cr_assert(eq(int, ofl_stager_save(s, set, p2, NULL, 0, &f2), OFL_SUCCESS));
  /* it could start only once the first one ended */
  cr_assert(eq(int, ofl_save_query(f1), OFL_SUCCESS));
  cr_assert(ge(u64, ofl__now_ns() - t0, 100u * 1000 * 1000));
  cr_assert(eq(int, ofl_save_wait(f2, 20000), OFL_SUCCESS));
  pthread_join(th, NULL);
  ofl__safetensors_set_write_hook(NULL);
  ofl_stager_stats_t ss;
  ofl_stager_get_stats(s, &ss);
  cr_assert(eq(u64, ss.save_busy_waits, 1));
  cr_assert(eq(u64, ss.saves_completed, 2));
  ofl_save_release(f1);
  ofl_save_release(f2);
  ofl_staged_release(set);
  free_state(t);
  ofl_stager_destroy(s);
}

static ssize_t enospc_write(int fd, const void *buf, size_t bytes) {
  (void)fd, (void)buf, (void)bytes;
  errno = ENOSPC;
  return -1;
}

Test(stager, failed_saves_report_the_error_and_leave_no_file) {
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, NULL, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 99);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));

  char path[400];
  snprintf(path, sizeof path, "%s/no/such/dir/x.safetensors", dir);
  ofl_save_future_t *f = NULL;
  cr_assert(eq(int, ofl_stager_save(s, set, path, NULL, 0, &f), OFL_SUCCESS));
  cr_assert(eq(int, ofl_save_wait(f, 20000), OFL_ERR_SYSTEM));
  cr_assert(not(eq(ptr, strstr(ofl_save_error(f), "writable"), NULL)), "%s",
            ofl_save_error(f));
  cr_assert(eq(str, (char *)ofl_last_error(), (char *)ofl_save_error(f)));
  ofl_save_release(f);

  snprintf(path, sizeof path, "%s/full.safetensors", dir);
  ofl__safetensors_set_write_hook(enospc_write);
  cr_assert(eq(int, ofl_stager_save(s, set, path, NULL, 0, &f), OFL_SUCCESS));
  cr_assert(eq(int, ofl_save_wait(f, 20000), OFL_ERR_NO_SPACE));
  ofl__safetensors_set_write_hook(NULL);
  ofl_save_release(f);
  cr_assert(eq(int, count_files(dir), 0));

  ofl_stager_stats_t ss;
  ofl_stager_get_stats(s, &ss);
  cr_assert(eq(u64, ss.saves_failed, 2));
  ofl_staged_release(set);
  free_state(t);
  ofl_stager_destroy(s);
}

Test(stager, cached_stage_waits_for_the_save_reading_the_cached_copy) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 300);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  ofl_staged_release(set);
  ofl__safetensors_set_write_hook(gated_write);
  char path[300];
  snprintf(path, sizeof path, "%s/step1.safetensors", dir);
  ofl_save_future_t *f = NULL;
  cr_assert(eq(int, ofl_stager_save(s, set, path, NULL, 0, &f), OFL_SUCCESS));
  wait_entered();
  for (int i = 0; i < NT; i++)
    update(t[i], 0x77); /* the next step's values */
  pthread_t th;
  pthread_create(&th, NULL, open_gate_later, NULL);
  /* Must not overwrite the pinned copy while the save writes it. */
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  cr_assert(eq(int, ofl_save_query(f), OFL_SUCCESS),
            "the stage waited for the save");
  pthread_join(th, NULL);
  ofl__safetensors_set_write_hook(NULL);
  ofl_safetensors_t *rd = NULL;
  cr_assert(eq(int, ofl_safetensors_open(path, &rd), OFL_SUCCESS));
  for (int i = 0; i < NT; i++) {
    ofl_safetensors_entry_t e;
    cr_assert(eq(int, ofl_safetensors_find(rd, names[i], &e), OFL_SUCCESS));
    unsigned char *want = malloc(e.bytes);
    pattern(want, e.bytes, 300u + (unsigned)i);
    cr_assert(eq(int, memcmp(e.data, want, e.bytes), 0),
              "file holds step 1 values of %s", names[i]);
    free(want);
    const unsigned char *now = ofl_tensor_data(ofl_staged_tensor(set, (size_t)i));
    cr_assert(eq(int, now[0], 0x77), "staged set holds step 2");
  }
  ofl_safetensors_close(rd);
  ofl_save_release(f);
  ofl_staged_release(set);
  free_state(t);
  ofl_stager_destroy(s);
}

Test(stager, saved_checkpoint_restores_into_device_tensors) {
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, NULL, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 400);
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  char path[300];
  snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
  ofl_save_future_t *f = NULL;
  cr_assert(eq(int, ofl_stager_save(s, set, path, NULL, 0, &f), OFL_SUCCESS));
  cr_assert(eq(int, ofl_save_wait(f, 20000), OFL_SUCCESS));
  ofl_save_release(f);
  for (int i = 0; i < NT; i++)
    update(t[i], 0); /* lose the state */
  ofl_safetensors_t *rd = NULL;
  cr_assert(eq(int, ofl_safetensors_open(path, &rd), OFL_SUCCESS));
  ofl_stream_t *c = ofl_device_compute_stream(dev);
  for (int i = 0; i < NT; i++)
    cr_assert(eq(int, ofl_safetensors_copy_to(rd, names[i], t[i], c),
                 OFL_SUCCESS));
  int64_t other[2] = {17, 6};
  ofl_tensor_t *u = dev_tensor(other, 2, OFL_DTYPE_BF16, 1);
  cr_assert(eq(int, ofl_safetensors_copy_to(rd, names[1], u, c),
               OFL_ERR_MISMATCH));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "'layers.0.norm'"), NULL)));
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "BF16 [17,5] in the file"),
                   NULL)),
            "%s", ofl_last_error());
  cr_assert(not(eq(ptr, strstr(ofl_last_error(), "destination is BF16 [17,6]"),
                   NULL)),
            "%s", ofl_last_error());
  cr_assert(eq(int, ofl_safetensors_copy_to(rd, "nope", u, c),
               OFL_ERR_INVALID_ARG));
  cr_assert(eq(int, ofl_stream_synchronize(c, 10000), OFL_SUCCESS));
  ofl_safetensors_close(rd);
  for (int i = 0; i < NT; i++)
    cr_assert(eq(sz, wrong_bytes(t[i], 400u + (unsigned)i), 0), "%s",
              names[i]);
  ofl_pool_free(pool, u);
  ofl_staged_release(set);
  free_state(t);
  ofl_stager_destroy(s);
}

/* A save thread joining a stage whose copies are still queued waits on the
 * stage's event without holding the set's lock: the caller's short
 * synchronize still times out and the set's status still says NOT_READY.
 * The stager's D2H stream is held by a gate that opens only after those
 * calls returned (or, if they block, after a 20 s watchdog, which fails the
 * test). */
static atomic_int stall_open;
static void stall_fn(void *arg) {
  (void)arg;
  while (!atomic_load(&stall_open))
    usleep(1000);
}
static void *stall_watchdog(void *arg) {
  (void)arg;
  for (int i = 0; i < 2000 && !atomic_load(&stall_open); i++)
    usleep(10 * 1000);
  atomic_store(&stall_open, 1);
  return NULL;
}

Test(stager, a_save_joining_does_not_block_a_short_synchronize_or_status) {
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.async_staging = 1;
  ofl_stream_t *d2h = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "staging-d2h", &d2h), OFL_SUCCESS));
  p.stream = d2h;
  ofl_stager_t *s = NULL;
  cr_assert(eq(int, ofl_stager_create(dev, &p, &s), OFL_SUCCESS));
  ofl_tensor_t *t[NT];
  ofl_named_tensor_t nt[NT];
  make_state(t, nt, 500);
  atomic_store(&stall_open, 0);
  cr_assert(eq(int, ofl_stream_launch_host_func(d2h, stall_fn, NULL),
               OFL_SUCCESS));
  pthread_t th;
  cr_assert(eq(int, pthread_create(&th, NULL, stall_watchdog, NULL), 0));
  ofl_staged_t *set = NULL;
  cr_assert(eq(int, ofl_stager_stage(s, nt, NT, &set), OFL_SUCCESS));
  char path[300];
  snprintf(path, sizeof path, "%s/pending.safetensors", dir);
  ofl_save_future_t *f = NULL;
  cr_assert(eq(int, ofl_stager_save(s, set, path, NULL, 0, &f), OFL_SUCCESS));
  usleep(50 * 1000); /* the save thread is in its join by now */
  ofl_status_t sy = ofl_stager_synchronize(s, 50);
  ofl_status_t ss = ofl_staged_status(set);
  int gate_was_open = atomic_load(&stall_open);
  atomic_store(&stall_open, 1);
  pthread_join(th, NULL);
  cr_expect(eq(int, gate_was_open, 0), "the calls blocked until the watchdog");
  cr_expect(eq(int, sy, OFL_ERR_TIMEOUT));
  cr_expect(eq(int, ss, OFL_ERR_NOT_READY));
  cr_assert(eq(int, ofl_save_wait(f, 20000), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_stager_synchronize(s, 10000), OFL_SUCCESS));
  cr_assert(eq(int, ofl_staged_status(set), OFL_SUCCESS));
  ofl_safetensors_t *rd = NULL;
  cr_assert(eq(int, ofl_safetensors_open(path, &rd), OFL_SUCCESS));
  for (int i = 0; i < NT; i++) {
    ofl_safetensors_entry_t e;
    cr_assert(eq(int, ofl_safetensors_find(rd, nt[i].name, &e), OFL_SUCCESS));
    unsigned char *src = host_bytes(t[i]);
    cr_assert(eq(int, memcmp(e.data, src, e.bytes), 0), "bytes of %s",
              nt[i].name);
    free(src);
  }
  ofl_safetensors_close(rd);
  ofl_save_release(f);
  ofl_staged_release(set);
  free_state(t);
  ofl_stager_destroy(s);
  ofl_stream_destroy(d2h);
}
