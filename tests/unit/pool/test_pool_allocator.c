/* Pools whose blocks come from the application's allocator
 * (ofl_pool_params_t.allocator, include/ofl/pool.h): one allocator call per
 * block and none to the backend, free only after the block's last queued
 * use, the out-of-memory retry on a refusal, and a manager that offloads
 * and reloads through such a pool. The allocator is what a GPU program has:
 * cudaMalloc / cudaFree of the loaded runtime on cuda (the stand-in reports
 * a cudaFree under a queued copy as misuse), the C heap on the host backend
 * (whose device adopts the application's memory). */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ofl/ofl.h>
#include "tests/support/devmem.h"
#include "tests/support/fixture.h"

#define KIB ((size_t)1024)
#define MIB ((size_t)1 << 20)
#define MAX_LIVE 64

static ofl_device_t *dev;

/* The counting allocator: every call, the live blocks, an optional cap on
 * the bytes it hands out, and what the copy queued before a free had done
 * when the free came. */
typedef struct counting {
  int (*cuda_malloc)(void **, size_t);
  int (*cuda_free)(void *);
  atomic_ulong allocs, frees, refusals;
  size_t cap_bytes; /* 0: no cap */
  size_t live_bytes;
  void *live[MAX_LIVE];
  size_t live_size[MAX_LIVE];
  ofl_stream_t *live_stream[MAX_LIVE];
  int mismatches;    /* frees of a pointer, size or stream it did not give */
  atomic_int *watch; /* non-NULL: copied into seen_at_free at each free */
  int seen_at_free;
} counting_t;

static counting_t ca;

static ofl_status_t ca_alloc(void *ctx, size_t bytes, ofl_stream_t *stream,
                             void **ptr) {
  counting_t *c = ctx;
  atomic_fetch_add(&c->allocs, 1);
  if (c->cap_bytes != 0 && c->live_bytes + bytes > c->cap_bytes) {
    atomic_fetch_add(&c->refusals, 1);
    return OFL_ERR_NO_MEMORY;
  }
  void *p = NULL;
  if (c->cuda_malloc != NULL) {
    if (c->cuda_malloc(&p, bytes) != 0)
      return OFL_ERR_CUDA;
  } else {
    p = aligned_alloc(256, (bytes + 255) / 256 * 256);
  }
  if (p == NULL)
    return OFL_ERR_NO_MEMORY;
  for (int i = 0; i < MAX_LIVE; i++)
    if (c->live[i] == NULL) {
      c->live[i] = p;
      c->live_size[i] = bytes;
      c->live_stream[i] = stream;
      break;
    }
  c->live_bytes += bytes;
  *ptr = p;
  return OFL_SUCCESS;
}

static void ca_free(void *ctx, void *ptr, size_t bytes, ofl_stream_t *stream) {
  counting_t *c = ctx;
  atomic_fetch_add(&c->frees, 1);
  if (c->watch != NULL)
    c->seen_at_free = atomic_load(c->watch);
  int found = 0;
  for (int i = 0; i < MAX_LIVE; i++)
    if (c->live[i] == ptr) {
      found = c->live_size[i] == bytes && c->live_stream[i] == stream;
      c->live[i] = NULL;
      break;
    }
  c->mismatches += !found;
  c->live_bytes -= bytes;
  if (c->cuda_free != NULL)
    (void)c->cuda_free(ptr);
  else
    free(ptr);
}

static const ofl_allocator_t allocator = {&ca, ca_alloc, ca_free};

/* cudaMalloc / cudaFree of the runtime the device loaded. */
static void find_cuda(void) {
  static const char *const names[] = {"libcudart.so.13", "libcudart.so.12",
                                      "libcudart.so.11.0", "libcudart.so"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    void *h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL)
      continue;
    *(void **)&ca.cuda_malloc = dlsym(h, "cudaMalloc");
    *(void **)&ca.cuda_free = dlsym(h, "cudaFree");
    return;
  }
}

static void open_dev(void) {
  ofl_device_params_t p = t_device_params(20, 24);
  cr_assert(eq(int, ofl_device_open(&p, &dev), OFL_SUCCESS), "%s",
            ofl_last_error());
  memset(&ca, 0, sizeof ca);
  if (t_on_cuda()) {
    find_cuda();
    cr_assert(ca.cuda_malloc != NULL && ca.cuda_free != NULL,
              "no loaded cudart");
  } else {
    cr_assert(eq(int, ofl_device_adopt_host_memory(dev, 1), OFL_SUCCESS));
  }
}
static void close_dev(void) { ofl_device_close(dev); }

TestSuite(pool_allocator, .init = open_dev, .fini = close_dev);

static ofl_pool_t *make_pool(ofl_pool_kind_t kind, const char *name) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.kind = kind;
  p.name = name;
  p.budget_bytes = 0;
  p.allocator = &allocator;
  ofl_pool_t *pool = NULL;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_SUCCESS), "%s",
            ofl_last_error());
  return pool;
}

static ofl_pool_stats_t stats_of(const ofl_pool_t *pool) {
  ofl_pool_stats_t s;
  ofl_pool_get_stats(pool, &s);
  return s;
}

static uint64_t device_allocs(void) {
  ofl_device_stats_t d;
  ofl_device_get_stats(dev, &d);
  return d.device_allocs;
}

static ofl_tensor_t *alloc_bytes(ofl_pool_t *pool, size_t n, int dynamic,
                                 ofl_stream_t *stream) {
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL;
  ofl_status_t s =
      dynamic ? ofl_pool_alloc_dynamic(pool, shape, 1, OFL_DTYPE_U8, stream, &t)
              : ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, stream, &t);
  cr_assert(eq(int, s, OFL_SUCCESS), "%zu bytes: %s", n, ofl_last_error());
  return t;
}

/* Every block created is one allocator call (with its size and stream) and
 * every block released one free of the same pointer, size and stream;
 * reused blocks call nothing, and the backend allocates nothing, segments
 * included (byte sizes change, which would turn them on). */
Test(pool_allocator,
     every_block_is_one_allocator_call_and_none_reaches_the_backend) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, "app");
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "alloc", &s), OFL_SUCCESS));
  uint64_t d0 = device_allocs();
  ofl_tensor_t *a = alloc_bytes(pool, 3 * KIB, 1, s);
  ofl_tensor_t *b = alloc_bytes(pool, 9 * KIB, 1, NULL);
  ofl_tensor_t *c = alloc_bytes(pool, 20 * KIB, 0, s);
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.allocs), 3));
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(b), 9 * KIB, 5), OFL_SUCCESS),
            "%s", ofl_last_error());
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(b), 9 * KIB, 5), 0));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  b = alloc_bytes(pool, 9 * KIB, 1, NULL); /* a hit: no call */
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.allocs), 3));
  ofl_pool_stats_t st = stats_of(pool);
  cr_assert(eq(u64, st.misses, 3));
  cr_assert(eq(u64, st.hits, 1));
  cr_assert(eq(u64, st.backend_allocs, 3));
  cr_assert(eq(u64, st.segments, 0));
  cr_assert(eq(u64, st.segment_bytes, 0));
  cr_assert(eq(sz, st.held_bytes, 4 * KIB + 12 * KIB + 20 * KIB));
  cr_assert(eq(u64, device_allocs(), d0));
  /* clear releases the two free blocks; destroy the third. */
  cr_assert(eq(int, ofl_pool_free(pool, a), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_free(pool, b), OFL_SUCCESS));
  cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.frees), 2));
  cr_assert(eq(u64, stats_of(pool).backend_frees, 2));
  cr_assert(eq(int, ofl_pool_free(pool, c), OFL_SUCCESS));
  ofl_pool_destroy(pool);
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.frees), 3));
  cr_assert(eq(int, ca.mismatches, 0));
  cr_assert(eq(sz, ca.live_bytes, 0));
  cr_assert(eq(u64, device_allocs(), d0));
  cr_assert(eq(int, ofl_stream_destroy(s), OFL_SUCCESS));
}

static void slow(void *arg) {
  (void)arg;
  usleep(150 * 1000);
}
static void mark(void *arg) { atomic_store((atomic_int *)arg, 1); }

/* A block freed after a copy queued behind a slow host function: clear
 * (and, for the second, destroy) gives it to the allocator's free only
 * after the copy completed. */
Test(pool_allocator, free_runs_after_the_blocks_last_queued_use) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, "app");
  ofl_stream_t *s = NULL;
  cr_assert(eq(int, ofl_stream_create(dev, "copy", &s), OFL_SUCCESS));
  size_t n = 256 * KIB;
  unsigned char *src = malloc(n);
  t_pattern(src, n, 9);
  for (int round = 0; round < 2; round++) {
    atomic_int copied = 0;
    ca.watch = &copied;
    ca.seen_at_free = -1;
    ofl_tensor_t *t = alloc_bytes(pool, n, 0, s);
    cr_assert(eq(int, ofl_stream_launch_host_func(s, slow, NULL), OFL_SUCCESS));
    cr_assert(eq(int,
                 ofl_memcpy_async(ofl_tensor_data(t), src, n, OFL_COPY_H2D, s),
                 OFL_SUCCESS),
              "%s", ofl_last_error());
    cr_assert(
        eq(int, ofl_stream_launch_host_func(s, mark, &copied), OFL_SUCCESS));
    cr_assert(eq(int, ofl_pool_free_after(pool, t, s), OFL_SUCCESS));
    cr_assert(eq(int, atomic_load(&copied), 0)); /* still queued */
    if (round == 0)
      cr_assert(eq(int, ofl_pool_clear(pool), OFL_SUCCESS));
    else
      ofl_pool_destroy(pool);
    cr_assert(eq(u64, (uint64_t)atomic_load(&ca.frees), (uint64_t)round + 1));
    cr_assert(eq(int, ca.seen_at_free, 1), "free ran before the copy ended");
    ca.watch = NULL;
  }
  cr_assert(eq(int, ca.mismatches, 0));
  cr_assert(eq(int, ofl_stream_destroy(s), OFL_SUCCESS));
  free(src);
}

/* A refusal releases the pool's cached blocks (given back through free)
 * and the request is tried again; a request the allocator can never serve
 * is OFL_ERR_NO_MEMORY with the usual message, and nothing changes. */
Test(pool_allocator, refusal_takes_the_out_of_memory_retry) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, "acts");
  ca.cap_bytes = 4 * MIB;
  ofl_tensor_t *t[3];
  for (int i = 0; i < 3; i++)
    t[i] = alloc_bytes(pool, MIB, 0, NULL);
  for (int i = 0; i < 3; i++)
    cr_assert(eq(int, ofl_pool_free(pool, t[i]), OFL_SUCCESS));
  /* 2 MiB more does not fit beside the three cached blocks. */
  ofl_tensor_t *big = alloc_bytes(pool, 2 * MIB, 0, NULL);
  ofl_pool_stats_t st = stats_of(pool);
  cr_assert(eq(u64, st.oom_retries, 1));
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.refusals), 1));
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.frees), 3));
  cr_assert(eq(u64, st.blocks_total, 1));
  cr_assert(eq(u64, st.backend_allocs, 5));
  cr_assert(
      eq(int, t_fill(dev, ofl_tensor_data(big), 2 * MIB, 3), OFL_SUCCESS));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(big), 2 * MIB, 3), 0));
  /* Beyond the cap even with nothing cached. */
  int64_t shape[1] = {(int64_t)(3 * MIB)};
  ofl_tensor_t *x = (ofl_tensor_t *)0x1;
  cr_assert(eq(int, ofl_pool_alloc(pool, shape, 1, OFL_DTYPE_U8, NULL, &x),
               OFL_ERR_NO_MEMORY));
  cr_assert(eq(ptr, x, (ofl_tensor_t *)0x1));
  const char *m = ofl_last_error();
  cr_assert(ne(ptr, strstr(m, "pool acts: out of device memory"), NULL), "%s",
            m);
  cr_assert(ne(ptr, strstr(m, "3145728 bytes requested"), NULL), "%s", m);
  cr_assert(ne(ptr,
               strstr(m, "pool acts (device) held 2097152 in use 2097152 "
                         "cached 0"),
               NULL),
            "%s", m);
  st = stats_of(pool);
  cr_assert(eq(u64, st.oom_retries, 2));
  cr_assert(eq(u64, st.blocks_total, 1));
  cr_assert(eq(int, ofl_pool_free(pool, big), OFL_SUCCESS));
  ofl_pool_destroy(pool);
  cr_assert(eq(sz, ca.live_bytes, 0));
  cr_assert(eq(int, ca.mismatches, 0));
}

/* The manager offloads a tensor of the application's pool and reloads it
 * into a block of the same pool (params.device_pool): byte for byte, every
 * device block from the allocator, none from the backend. */
Test(pool_allocator, manager_reloads_into_the_allocators_blocks) {
  ofl_pool_t *pool = make_pool(OFL_POOL_DEVICE, "app");
  ofl_manager_params_t mp = t_env_manager_params(dev, pool);
  ofl_manager_t *m = NULL;
  cr_assert(eq(int, ofl_manager_create(&mp, &m), OFL_SUCCESS), "%s",
            ofl_last_error());
  uint64_t d0 = device_allocs();
  size_t n = MIB + 3 * KIB;
  ofl_tensor_t *t = alloc_bytes(pool, n, 0, NULL);
  cr_assert(eq(int, t_fill(dev, ofl_tensor_data(t), n, 77), OFL_SUCCESS));
  ofl_tag_t tag;
  cr_assert(eq(int, ofl_manager_chunk_begin(m, 1, 0), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_group_start(m, "mlp_norm"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_tensor_push(m, t, &tag), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(
      eq(int, ofl_manager_group_commit(m, "mlp_norm", NULL, 0, 0), OFL_SUCCESS),
      "%s", ofl_last_error());
  cr_assert(eq(int,
               ofl_stream_synchronize(ofl_device_compute_stream(dev),
                                      OFL_TIMEOUT_DEFAULT),
               OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_manager_group_backward_begin(m, "mlp_norm"), OFL_SUCCESS),
      "%s", ofl_last_error());
  ofl_tensor_t *back = NULL;
  cr_assert(eq(int, ofl_manager_tensor_pop(m, tag, &back), OFL_SUCCESS), "%s",
            ofl_last_error());
  cr_assert(eq(int, ofl_pool_owns(pool, back), 1));
  cr_assert(eq(sz, t_wrong(dev, ofl_tensor_data(back), n, 77), 0));
  ofl_pool_stats_t st = stats_of(pool);
  cr_assert(eq(u64, st.backend_allocs, (uint64_t)atomic_load(&ca.allocs)));
  cr_assert(eq(u64, st.backend_allocs, st.misses));
  cr_assert(ge(u64, st.misses, 1));
  cr_assert(eq(u64, device_allocs(), d0));
  cr_assert(eq(int, ofl_tensor_destroy(back), OFL_SUCCESS));
  cr_assert(
      eq(int, ofl_manager_group_backward_end(m, "mlp_norm"), OFL_SUCCESS));
  cr_assert(eq(int, ofl_manager_reset(m), OFL_SUCCESS), "%s", ofl_last_error());
  ofl_manager_destroy(m);
  ofl_pool_destroy(pool);
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.frees),
               (uint64_t)atomic_load(&ca.allocs)));
  cr_assert(eq(int, ca.mismatches, 0));
}

/* Host backend: a device pool with an allocator needs the device to adopt
 * the application's memory, and says so; an incomplete allocator and a
 * reserve are refused. */
Test(pool_allocator, creation_checks_adoption_and_the_allocator) {
  ofl_pool_params_t p = OFL_POOL_PARAMS_INIT;
  p.budget_bytes = 0;
  ofl_allocator_t half = {&ca, ca_alloc, NULL};
  p.allocator = &half;
  ofl_pool_t *pool = (ofl_pool_t *)0x1;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_ERR_INVALID_ARG));
  cr_assert(eq(ptr, pool, (ofl_pool_t *)0x1));
  p.allocator = &allocator;
  p.reserve_bytes = MIB;
  cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_ERR_INVALID_ARG));
  p.reserve_bytes = 0;
  if (t_on_cuda()) {
    cr_assert(
        eq(int, ofl_device_adopt_host_memory(dev, 1), OFL_ERR_NOT_SUPPORTED));
  } else {
    cr_assert(eq(int, ofl_device_adopt_host_memory(dev, 0), OFL_SUCCESS));
    cr_assert(eq(int, ofl_pool_create(dev, &p, &pool), OFL_ERR_INVALID_ARG));
    cr_assert(
        ne(ptr, strstr(ofl_last_error(), "ofl_device_adopt_host_memory"), NULL),
        "%s", ofl_last_error());
    cr_assert(eq(ptr, pool, (ofl_pool_t *)0x1));
  }
  cr_assert(eq(u64, (uint64_t)atomic_load(&ca.allocs), 0));
}
