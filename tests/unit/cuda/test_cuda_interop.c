/* The cuda backend inside an application's GPU program: the caller's device
 * stays the caller's, the application's own streams are ordered, releases
 * never run inside host functions, commit never waits for copies, steady
 * state allocates nothing, NCCL gathers are bounded (an unbounded timeout
 * saturates) and abort only a communicator they may. On the
 * cudasim stand-in (the counters and the second device come from it). */
#include <criterion/criterion.h>
#include "tests/support/cr_assert.h"
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "tests/support/devmem.h"
#include "tests/support/fixture.h"

#define OK(call)                                                               \
  cr_assert(eq(int, (call), OFL_SUCCESS), "%s: %s", #call, ofl_last_error())
#define CUDA_OK(call) cr_assert(eq(int, (int)(call), (int)cudaSuccess), #call)

static cudasim_stats_t sim(void) {
  cudasim_stats_t s;
  memset(&s, 0, sizeof s);
  if (!t_sim_stats(&s))
    cr_skip_test("needs the cudasim stand-in (its counters)");
  return s;
}

static int sim_device_of(const void *p) {
  int (*is_dev)(const void *, int *) = NULL;
  *(void **)&is_dev = dlsym(RTLD_DEFAULT, "cudasim_is_device_memory");
  int d = -1;
  cr_assert(is_dev != NULL && is_dev(p, &d), "%p is not device memory", p);
  return d;
}

static int sim_in_host_fn(void) {
  int (*f)(void) = NULL;
  *(void **)&f = dlsym(RTLD_DEFAULT, "cudasim_in_host_fn");
  return f != NULL && f();
}

static int current_device(void) {
  int d = -1;
  CUDA_OK(cudaGetDevice(&d));
  return d;
}

static ofl_device_t *open_cuda(int index) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_CUDA;
  dp.device_index = index;
  ofl_device_t *dev = NULL;
  OK(ofl_device_open(&dp, &dev));
  return dev;
}

/* A gate that holds a stream: a host function that waits until opened (it
 * calls nothing, as host functions must). */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int open;
} gate_t;
static gate_t gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
static void gate_fn(void *arg) {
  (void)arg;
  pthread_mutex_lock(&gate.mu);
  while (!gate.open)
    pthread_cond_wait(&gate.cv, &gate.mu);
  pthread_mutex_unlock(&gate.mu);
}
static void gate_open(void) {
  pthread_mutex_lock(&gate.mu);
  gate.open = 1;
  pthread_cond_broadcast(&gate.cv);
  pthread_mutex_unlock(&gate.mu);
}

TestSuite(cuda_interop, .timeout = 120);

/* ---- 1: the caller's device -----------------------------------------------
 */

Test(cuda_interop, device_without_index_is_the_callers_and_stays_selected) {
  sim();
  CUDA_OK(cudaSetDevice(1));
  ofl_device_t *dev = open_cuda(-1);
  void *d = NULL, *h = NULL;
  OK(ofl_device_malloc(dev, 1 << 16, &d));
  cr_assert(eq(int, sim_device_of(d), 1));
  OK(ofl_pinned_malloc(dev, 1 << 16, &h));
  ofl_stream_t *s = NULL;
  ofl_event_t *ev = NULL;
  OK(ofl_stream_create(dev, "copy", &s));
  OK(ofl_event_create(dev, &ev));
  OK(t_fill(dev, d, 1 << 16, 7));
  OK(ofl_memcpy_async(h, d, 1 << 16, OFL_COPY_D2H, s));
  OK(ofl_event_record(ev, s));
  OK(ofl_event_synchronize(ev, -1));
  cr_assert(eq(sz, t_pattern_wrong(h, 1 << 16, 7), 0));
  cr_assert(eq(int, current_device(), 1));

  /* A second ofl device on GPU 0, used from this thread: the thread is
   * back on 1 after every call. */
  ofl_device_t *dev0 = open_cuda(0);
  cr_assert(eq(int, current_device(), 1));
  void *d0 = NULL;
  OK(ofl_device_malloc(dev0, 4096, &d0));
  cr_assert(eq(int, sim_device_of(d0), 0));
  cr_assert(eq(int, current_device(), 1));
  OK(t_fill(dev0, d0, 4096, 9));
  cr_assert(eq(sz, t_wrong(dev0, d0, 4096, 9), 0));
  cr_assert(eq(int, current_device(), 1));
  OK(ofl_device_free(dev0, d0));
  ofl_device_close(dev0);
  cr_assert(eq(int, current_device(), 1));

  ofl_event_destroy(ev);
  OK(ofl_stream_destroy(s));
  OK(ofl_pinned_free(dev, h));
  OK(ofl_device_free(dev, d));
  ofl_device_close(dev);
  cr_assert(eq(int, current_device(), 1));
}

typedef struct {
  ofl_device_t *dev;
  int ok;
  int device_after;
} thread_job_t;

static void *foreign_thread(void *arg) {
  thread_job_t *j = arg;
  void *d = NULL;
  j->ok = ofl_device_malloc(j->dev, 8192, &d) == OFL_SUCCESS &&
          t_fill(j->dev, d, 8192, 3) == OFL_SUCCESS &&
          t_wrong(j->dev, d, 8192, 3) == 0 &&
          ofl_device_free(j->dev, d) == OFL_SUCCESS;
  cudaGetDevice(&j->device_after);
  return NULL;
}

Test(cuda_interop, ofl_on_gpu1_creates_no_context_on_gpu0) {
  sim();
  CUDA_OK(cudaSetDevice(1));
  ofl_device_t *dev = open_cuda(-1);
  /* A thread of the application that never chose a device calls ofl. */
  thread_job_t j = {dev, 0, -1};
  pthread_t t;
  cr_assert(eq(int, pthread_create(&t, NULL, foreign_thread, &j), 0));
  pthread_join(t, NULL);
  cr_assert(j.ok, "%s", ofl_last_error());
  /* A release after a copy, run by ofl's release thread. */
  void *raw = NULL;
  CUDA_OK(cudaMalloc(&raw, 4096));
  int64_t shape[1] = {4096};
  ofl_tensor_t *w = NULL;
  OK(ofl_tensor_wrap(raw, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE, NULL, NULL,
                     &w));
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "s", &s));
  OK(ofl_tensor_release_storage_after(w, s));
  OK(ofl_stream_synchronize(s, -1));
  OK(ofl_tensor_destroy(w));
  OK(ofl_stream_destroy(s));
  ofl_device_close(dev);
  CUDA_OK(cudaFree(raw));
  cudasim_stats_t st = sim();
  cr_assert(eq(u64, st.contexts[0], 0),
            "a primary context was created on GPU 0, which the application "
            "never used");
  cr_assert(eq(u64, st.contexts[1], 1));
  cr_assert(eq(int, current_device(), 1));
}

Test(cuda_interop, ofl_device_variable_names_the_gpu) {
  sim();
  setenv("OFL_DEVICE", "local", 1);
  setenv("LOCAL_RANK", "3", 1); /* 3 % 2 devices */
  OK(ofl_config_reload());
  ofl_device_t *dev = open_cuda(-1);
  void *d = NULL;
  OK(ofl_device_malloc(dev, 256, &d));
  cr_assert(eq(int, sim_device_of(d), 1));
  cr_assert(eq(int, ofl_device_ordinal(dev), 1)); /* what it chose */
  OK(ofl_device_free(dev, d));
  ofl_device_close(dev);
  setenv("OFL_DEVICE", "7", 1);
  OK(ofl_config_reload());
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_CUDA;
  cr_assert(eq(int, ofl_device_open(&dp, &dev), OFL_ERR_CONFIG));
  cr_assert(strstr(ofl_last_error(), "OFL_DEVICE=7") != NULL, "%s",
            ofl_last_error());
  unsetenv("OFL_DEVICE");
  unsetenv("LOCAL_RANK");
  OK(ofl_config_reload());
}

/* ---- 2: releases never inside host functions ----------------------------- */

static atomic_int released, released_in_host_fn, release_free_failed;
static void free_release(void *data, size_t bytes, void *user) {
  (void)bytes;
  (void)user;
  if (sim_in_host_fn())
    atomic_fetch_add(&released_in_host_fn, 1);
  if (cudaFree(data) != cudaSuccess) /* a CUDA call: legal here */
    atomic_fetch_add(&release_free_failed, 1);
  atomic_fetch_add(&released, 1);
}

Test(cuda_interop, release_callback_runs_after_the_copy_outside_host_fns) {
  sim();
  ofl_device_t *dev = open_cuda(0);
  const size_t n = 1 << 20;
  void *raw = NULL, *h = NULL;
  CUDA_OK(cudaMalloc(&raw, n));
  OK(ofl_pinned_malloc(dev, n, &h));
  OK(t_fill(dev, raw, n, 11));
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL;
  OK(ofl_tensor_wrap(raw, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE, free_release,
                     NULL, &t));
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "d2h", &s));
  gate.open = 0;
  OK(ofl_stream_launch_host_func(s, gate_fn, NULL));
  OK(ofl_memcpy_async(h, raw, n, OFL_COPY_D2H, s));
  OK(ofl_tensor_release_storage_after(t, s));
  cr_assert(eq(int, atomic_load(&released), 0),
            "released while its copy is still queued");
  gate_open();
  OK(ofl_stream_synchronize(s, -1));
  cr_assert(eq(int, atomic_load(&released), 1),
            "not released once its stream was synchronised");
  cr_assert(eq(int, atomic_load(&released_in_host_fn), 0));
  cr_assert(eq(int, atomic_load(&release_free_failed), 0));
  cr_assert(eq(sz, t_pattern_wrong(h, n, 11), 0));
  OK(ofl_tensor_destroy(t));
  OK(ofl_stream_destroy(s));
  OK(ofl_pinned_free(dev, h));
  ofl_device_close(dev);
}

/* ---- 3 and 5: the application's stream; commit never waits --------------- */

/* The fixture's device, activation pool and manager. */
typedef t_env_t env_t;

static void env_open(env_t *e, int index) {
  e->dev = open_cuda(index);
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  pp.name = "activations";
  OK(ofl_pool_create(e->dev, &pp, &e->pool));
  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
  mp.device = e->dev;
  mp.device_pool = e->pool;
  mp.offload = 1;
  mp.groups = "";
  mp.min_offload_bytes = 1;
  mp.min_offload_elems = 0;
  mp.fraction = 1.0;
  OK(ofl_manager_create(&mp, &e->m));
}

static void gate_cuda_fn(void *arg) { gate_fn(arg); }

Test(cuda_interop, compute_on_the_applications_nonblocking_stream_is_ordered) {
  sim();
  env_t e;
  env_open(&e, 0);
  cudaStream_t app = NULL;
  CUDA_OK(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking));
  ofl_stream_t *ws = NULL;
  OK(ofl_stream_wrap_native(e.dev, app, "app", &ws));
  cr_assert(eq(ptr, ofl_stream_native(ws), (void *)app));
  cr_assert(eq(ptr, ofl_stream_native(ofl_device_compute_stream(e.dev)),
               (void *)cudaStreamLegacy));
  ofl_device_set_compute_stream(e.dev, ws);

  const size_t n = 256 * 1024;
  void *src = NULL;
  CUDA_OK(cudaMallocHost(&src, n));
  t_pattern(src, n, 21);
  OK(ofl_manager_chunk_begin(e.m, 1, 0));
  OK(ofl_manager_group_start(e.m, "core_attn"));
  ofl_tensor_t *t = NULL;
  int64_t shape[1] = {(int64_t)n};
  OK(ofl_pool_alloc(e.pool, shape, 1, OFL_DTYPE_U8, ws, &t));
  /* The application writes the activation late, on its own stream. */
  gate.open = 0;
  CUDA_OK(cudaLaunchHostFunc(app, gate_cuda_fn, NULL));
  CUDA_OK(
      cudaMemcpyAsync(ofl_tensor_data(t), src, n, cudaMemcpyHostToDevice, app));
  ofl_tag_t tag;
  OK(ofl_manager_tensor_push(e.m, t, &tag));
  OK(ofl_manager_group_commit(e.m, "core_attn", NULL, 0, 0));
  gate_open();
  OK(ofl_manager_group_backward_begin(e.m, "core_attn"));
  ofl_tensor_t *back = NULL;
  OK(ofl_manager_tensor_pop(e.m, tag, &back));
  cr_assert(eq(sz, t_wrong(e.dev, ofl_tensor_data(back), n, 21), 0),
            "the offload read the activation before the application's "
            "stream wrote it");
  OK(ofl_manager_group_backward_end(e.m, "core_attn"));
  OK(ofl_tensor_destroy(back));
  OK(ofl_manager_reset(e.m));
  OK(ofl_stream_synchronize(ws, -1));
  ofl_device_set_compute_stream(e.dev, NULL);
  OK(ofl_stream_destroy(ws));
  /* Only the wrapper went: the application's stream still works. */
  CUDA_OK(cudaStreamSynchronize(app));
  CUDA_OK(cudaStreamDestroy(app));
  CUDA_OK(cudaFreeHost(src));
  t_env_close(&e);
}

Test(cuda_interop, wrapping_a_stream_of_another_gpu_is_refused) {
  sim();
  ofl_device_t *dev = open_cuda(1);
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t s0 = NULL;
  CUDA_OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  ofl_stream_t *w = NULL;
  cr_assert(
      eq(int, ofl_stream_wrap_native(dev, s0, "s0", &w), OFL_ERR_INVALID_ARG));
  cr_assert(strstr(ofl_last_error(), "device 0") != NULL, "%s",
            ofl_last_error());
  cr_assert(eq(int, current_device(), 0));
  CUDA_OK(cudaStreamDestroy(s0));
  ofl_device_close(dev);
}

Test(cuda_interop, commit_of_shared_external_storage_never_waits_for_d2h) {
  sim();
  setenv("OFL_WAIT_TIMEOUT_MS", "3000", 1);
  OK(ofl_config_reload());
  env_t e;
  env_open(&e, 0);
  const size_t n = 128 * 1024;
  void *raw = NULL;
  CUDA_OK(cudaMalloc(&raw, n));
  OK(t_fill(e.dev, raw, n, 31));
  int64_t shape[1] = {(int64_t)n};
  ofl_tensor_t *t = NULL, *alias = NULL;
  atomic_store(&released, 0);
  OK(ofl_tensor_wrap(raw, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE, free_release,
                     NULL, &t));
  OK(ofl_tensor_alias(t, &alias)); /* another handle shares the storage */
  gate.open = 0;
  OK(ofl_stream_launch_host_func(ofl_manager_d2h_stream(e.m), gate_fn, NULL));
  OK(ofl_manager_chunk_begin(e.m, 1, 0));
  OK(ofl_manager_group_start(e.m, "expert_fc1"));
  ofl_tag_t tag;
  OK(ofl_manager_tensor_push(e.m, t, &tag));
  /* The D2H stream is held by the gate: a commit that waited for it would
   * time out here. */
  OK(ofl_manager_group_commit(e.m, "expert_fc1", &t, 1, 0));
  cr_assert(eq(int, atomic_load(&released), 0));
  gate_open();
  OK(ofl_manager_group_backward_begin(e.m, "expert_fc1"));
  ofl_tensor_t *back = NULL;
  OK(ofl_manager_tensor_pop(e.m, tag, &back));
  cr_assert(eq(sz, t_wrong(e.dev, ofl_tensor_data(back), n, 31), 0));
  OK(ofl_manager_group_backward_end(e.m, "expert_fc1"));
  OK(ofl_tensor_destroy(back));
  OK(ofl_manager_reset(e.m));
  /* The alias still holds the memory, with its bytes. */
  cr_assert(eq(sz, t_wrong(e.dev, raw, n, 31), 0));
  OK(ofl_tensor_destroy(alias));
  OK(ofl_manager_synchronize(e.m, -1));
  OK(ofl_stream_synchronize(ofl_manager_d2h_stream(e.m), -1));
  cr_assert(eq(int, atomic_load(&released), 1));
  cr_assert(eq(int, atomic_load(&release_free_failed), 0));
  t_env_close(&e);
  unsetenv("OFL_WAIT_TIMEOUT_MS");
}

/* ---- 4: steady state allocates nothing ------------------------------------
 */

static void iteration(env_t *e, int mbs, uint64_t seed, size_t *wrong) {
  static const char *const names[3] = {"attn_norm", "core_attn", "moe_act"};
  ofl_tag_t tags[8][3][2];
  ofl_stream_t *cs = ofl_device_compute_stream(e->dev);
  for (int mb = 0; mb < mbs; mb++) {
    OK(ofl_manager_chunk_begin(e->m, 1, 0));
    for (int g = 0; g < 3; g++) {
      OK(ofl_manager_group_start(e->m, names[g]));
      for (int k = 0; k < 2; k++) {
        ofl_tensor_t *t = NULL;
        int64_t shape[2] = {64, 256 * (k + 1)};
        OK(ofl_pool_alloc(e->pool, shape, 2, OFL_DTYPE_F32, cs, &t));
        OK(t_fill(e->dev, ofl_tensor_data(t), ofl_tensor_bytes(t),
                  seed + (uint64_t)(mb * 100 + g * 10 + k)));
        OK(ofl_manager_tensor_push(e->m, t, &tags[mb][g][k]));
      }
      OK(ofl_manager_group_commit(e->m, names[g], NULL, 0, 0));
    }
  }
  for (int mb = 0; mb < mbs; mb++) {
    for (int g = 2; g >= 0; g--) {
      OK(ofl_manager_group_backward_begin(e->m, names[g]));
      for (int k = 1; k >= 0; k--) {
        ofl_tensor_t *t = NULL;
        OK(ofl_manager_tensor_pop(e->m, tags[mb][g][k], &t));
        *wrong += t_wrong(e->dev, ofl_tensor_data(t), ofl_tensor_bytes(t),
                          seed + (uint64_t)(mb * 100 + g * 10 + k));
        OK(ofl_tensor_destroy(t));
      }
      OK(ofl_manager_group_backward_end(e->m, names[g]));
    }
  }
  OK(ofl_manager_reset(e->m));
}

Test(cuda_interop, steady_state_makes_no_allocation_free_or_registration) {
  sim();
  env_t e;
  env_open(&e, 0);
  size_t wrong = 0;
  iteration(&e, 4, 1000, &wrong); /* warmup */
  iteration(&e, 4, 2000, &wrong); /* first steady-state iteration */
  OK(ofl_manager_synchronize(e.m, -1));
  void (*reset)(void) = NULL;
  *(void **)&reset = dlsym(RTLD_DEFAULT, "cudasim_reset_stats");
  cr_assert(reset != NULL);
  reset();
  for (int it = 0; it < 20; it++)
    iteration(&e, 4, 3000 + (uint64_t)it * 7919, &wrong);
  OK(ofl_manager_synchronize(e.m, -1));
  cudasim_stats_t s = sim();
  cr_assert(eq(sz, wrong, 0));
  cr_assert(eq(u64, s.device_mallocs, 0));
  cr_assert(eq(u64, s.device_frees, 0));
  cr_assert(eq(u64, s.host_registers, 0));
  cr_assert(eq(u64, s.host_unregisters, 0));
  cr_assert(eq(u64, s.host_allocs, 0));
  cr_assert(eq(u64, s.host_frees, 0));
  cr_assert(gt(u64, s.copies, 0));
  t_env_close(&e);
}

/* ---- 6: NCCL gathers are bounded; a timeout aborts the communicator only
 * when the application asked for it -------------------------------------- */

typedef struct {
  ncclUniqueId id;
  int rank;
  ncclComm_t comm;
  cudaStream_t stream;
  ofl_comm_t *oc;
  int barriers;
  int64_t timeout_ms;    /* 0: 500 */
  int abort_on_timeout;  /* ofl_comm_params_t.nccl_abort_on_timeout */
  ofl_status_t last;
  char msg[512];
} nccl_rank_t;

/* On the calling thread: selects the rank's GPU, makes its non-blocking
 * stream and its nonblocking communicator of 2 ranks (waited for). */
static ncclResult_t nccl_rank_init(nccl_rank_t *r) {
  if (cudaSetDevice(r->rank) != cudaSuccess)
    return ncclInvalidUsage;
  cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t st = ncclCommInitRankConfig(&r->comm, 2, r->id, r->rank, &cfg);
  while (st == ncclInProgress)
    ncclCommGetAsyncError(r->comm, &st);
  return st;
}

static void *nccl_rank_main(void *arg) {
  nccl_rank_t *r = arg;
  if (nccl_rank_init(r) != ncclSuccess)
    return NULL;
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = r->timeout_ms ? r->timeout_ms : 500;
  p.nccl_nonblocking = 1;
  p.nccl_abort_on_timeout = r->abort_on_timeout;
  r->last = ofl_comm_create_nccl(r->comm, r->stream, &p, &r->oc);
  for (int i = 0; i < r->barriers && r->last == OFL_SUCCESS; i++)
    r->last = ofl_comm_barrier(r->oc);
  snprintf(r->msg, sizeof r->msg, "%s", ofl_last_error());
  return NULL;
}

/* Two ranks' records, zeroed, sharing one fresh NCCL id. */
static void two_ranks(nccl_rank_t r[2]) {
  memset(r, 0, 2 * sizeof *r);
  cr_assert(eq(int, ncclGetUniqueId(&r[0].id), ncclSuccess));
  r[1].id = r[0].id;
  r[0].rank = 0;
  r[1].rank = 1;
}

static void *barrier_main(void *arg) {
  nccl_rank_t *r = arg;
  cudaSetDevice(r->rank); /* the rank's thread sits on its GPU */
  r->last = ofl_comm_barrier(r->oc);
  snprintf(r->msg, sizeof r->msg, "%s", ofl_last_error());
  return NULL;
}

/* A summary gather to every rank of a table whose bytes name the rank
 * (group "g", 1000 + rank); r->last is the status, or OFL_ERR_CORRUPT when
 * a rank's bytes are wrong. */
static void *table_gather_main(void *arg) {
  nccl_rank_t *r = arg;
  cudaSetDevice(r->rank);
  ofl_byte_table_t *tb = NULL;
  ofl_summary_t *sum = NULL;
  r->last = ofl_byte_table_create(&tb);
  if (r->last == OFL_SUCCESS)
    r->last = ofl_byte_table_add(tb, "g", 1000 + (uint64_t)r->rank);
  if (r->last == OFL_SUCCESS)
    r->last = ofl_summary_gather(r->oc, tb, 0, &sum);
  snprintf(r->msg, sizeof r->msg, "%s", ofl_last_error());
  if (r->last == OFL_SUCCESS) {
    size_t g = 0;
    long wrong = ofl_summary_nranks(sum) != 2 ||
                 ofl_summary_find_group(sum, "g", &g) != OFL_SUCCESS;
    for (int k = 0; k < 2 && !wrong; k++)
      wrong += ofl_summary_bytes(sum, k, g) != 1000 + (uint64_t)k;
    if (wrong) {
      r->last = OFL_ERR_CORRUPT;
      snprintf(r->msg, sizeof r->msg, "rank %d: wrong gathered bytes",
               r->rank);
    }
  }
  ofl_summary_destroy(sum);
  ofl_byte_table_destroy(tb);
  return NULL;
}

Test(cuda_interop, nccl_gather_keeps_its_buffers_between_operations) {
  sim();
  nccl_rank_t r[2];
  two_ranks(r);
  pthread_t t[2];
  for (int i = 0; i < 2; i++) {
    r[i].barriers = 1;
    pthread_create(&t[i], NULL, nccl_rank_main, &r[i]);
  }
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    cr_assert(eq(int, r[i].last, OFL_SUCCESS), "rank %d: %s", i, r[i].msg);
  }
  void (*reset)(void) = NULL;
  *(void **)&reset = dlsym(RTLD_DEFAULT, "cudasim_reset_stats");
  reset();
  /* Five more barriers on each rank, each rank in its own thread. */
  for (int round = 0; round < 5; round++) {
    for (int i = 0; i < 2; i++)
      pthread_create(&t[i], NULL, barrier_main, &r[i]);
    for (int i = 0; i < 2; i++) {
      pthread_join(t[i], NULL);
      cr_assert(eq(int, r[i].last, OFL_SUCCESS), "rank %d: %s", i, r[i].msg);
    }
  }
  cudasim_stats_t s = sim();
  cr_assert(eq(u64, s.device_mallocs, 0));
  cr_assert(eq(u64, s.host_allocs, 0));
  cr_assert(ge(u64, s.copies, 20)); /* the gathers ran: 2 copies each */
  cr_assert(ge(u64, s.nccl_collectives, 10));
  for (int i = 0; i < 2; i++) {
    ofl_comm_destroy(r[i].oc);
    cr_assert(eq(int, ncclCommDestroy(r[i].comm), ncclSuccess));
    cudaStreamDestroy(r[i].stream);
  }
}

/* Waits (bounded) until the stream is idle; its last answer. */
static cudaError_t stream_drained(cudaStream_t s) {
  cudaError_t q = cudaErrorNotReady;
  for (int i = 0; i < 2000 && q == cudaErrorNotReady; i++) {
    q = cudaStreamQuery(s);
    if (q == cudaErrorNotReady)
      usleep(1000);
  }
  (void)cudaGetLastError();
  return q;
}

Test(cuda_interop, nccl_timeout_aborts_the_communicator_when_asked) {
  sim();
  nccl_rank_t r[2];
  two_ranks(r);
  r[0].barriers = 1; /* rank 1 never calls */
  r[1].barriers = 0;
  r[0].abort_on_timeout = 1;
  pthread_t t[2];
  for (int i = 0; i < 2; i++)
    pthread_create(&t[i], NULL, nccl_rank_main, &r[i]);
  for (int i = 0; i < 2; i++)
    pthread_join(t[i], NULL);
  cr_assert(eq(int, r[0].last, OFL_ERR_TIMEOUT), "%s", r[0].msg);
  cr_assert(strstr(r[0].msg, "ncclCommAbort") != NULL, "%s", r[0].msg);
  cr_assert(ofl_comm_is_broken(r[0].oc));
  /* ncclCommAbort freed rank 0's communicator: it is not destroyed again. */
  cr_assert(ofl_comm_nccl_aborted(r[0].oc));
  cr_assert(eq(int, ofl_comm_nccl_aborted(r[1].oc), 0));
  /* The collective left on the stream ended: the stream drains. */
  CUDA_OK(cudaSetDevice(0));
  cr_assert(ne(int, (int)stream_drained(r[0].stream), (int)cudaErrorNotReady),
            "the aborted collective still holds the stream");
  ofl_comm_destroy(r[0].oc);
  ofl_comm_destroy(r[1].oc);
  ncclCommAbort(r[1].comm);
  cudaStreamDestroy(r[0].stream);
  cudaStreamDestroy(r[1].stream);
}

/* The communicator is the application's (it may share it): by default a
 * timeout leaves it alone and says what to do; the application aborts it
 * (on the stand-in, an abort of a communicator ofl had aborted already is
 * misuse, a double free with NCCL). */
Test(cuda_interop, nccl_timeout_leaves_the_applications_communicator_alone) {
  sim();
  nccl_rank_t r[2];
  two_ranks(r);
  r[0].barriers = 1; /* rank 1 never calls */
  r[1].barriers = 0;
  r[0].timeout_ms = 300;
  pthread_t t[2];
  for (int i = 0; i < 2; i++)
    pthread_create(&t[i], NULL, nccl_rank_main, &r[i]);
  for (int i = 0; i < 2; i++)
    pthread_join(t[i], NULL);
  cr_assert(eq(int, r[0].last, OFL_ERR_TIMEOUT), "%s", r[0].msg);
  cr_assert(strstr(r[0].msg, "was not aborted") != NULL, "%s", r[0].msg);
  cr_assert(strstr(r[0].msg, "abort it (ncclCommAbort)") != NULL, "%s",
            r[0].msg);
  cr_assert(ofl_comm_is_broken(r[0].oc));
  cr_assert(eq(int, ofl_comm_nccl_aborted(r[0].oc), 0));
  /* not aborted: no asynchronous error (an aborted one says
   * ncclSystemError), and the all-gather still holds the stream */
  ncclResult_t async = ncclInternalError;
  cr_assert(eq(int, ncclCommGetAsyncError(r[0].comm, &async), ncclSuccess));
  cr_assert(eq(int, async, ncclSuccess), "async error %d", async);
  CUDA_OK(cudaSetDevice(0));
  cr_assert(eq(int, (int)cudaStreamQuery(r[0].stream),
               (int)cudaErrorNotReady));
  (void)cudaGetLastError();
  /* what the application does: abort its communicator, and the stream
   * drains */
  cr_assert(eq(int, ncclCommAbort(r[0].comm), ncclSuccess));
  cr_assert(ne(int, (int)stream_drained(r[0].stream), (int)cudaErrorNotReady),
            "the collective still holds the stream after the abort");
  ofl_comm_destroy(r[0].oc);
  ofl_comm_destroy(r[1].oc);
  ncclCommAbort(r[1].comm);
  cudaStreamDestroy(r[0].stream);
  cudaStreamDestroy(r[1].stream);
}

/* A timeout of INT64_MAX ms (no practical limit) is a deadline that never
 * passes, not one that wraps into the past: gathers and barriers complete,
 * with every rank's data. */
Test(cuda_interop, nccl_gather_with_an_unbounded_timeout_completes) {
  sim();
  nccl_rank_t r[2];
  two_ranks(r);
  for (int i = 0; i < 2; i++) {
    r[i].barriers = 3;
    r[i].timeout_ms = INT64_MAX;
  }
  pthread_t t[2];
  for (int i = 0; i < 2; i++)
    pthread_create(&t[i], NULL, nccl_rank_main, &r[i]);
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    cr_assert(eq(int, r[i].last, OFL_SUCCESS), "rank %d: %s", i, r[i].msg);
    cr_assert(eq(i64, ofl_comm_timeout_ms(r[i].oc), INT64_MAX));
  }
  for (int i = 0; i < 2; i++)
    pthread_create(&t[i], NULL, table_gather_main, &r[i]);
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    cr_assert(eq(int, r[i].last, OFL_SUCCESS), "rank %d: %s", i, r[i].msg);
  }
  for (int i = 0; i < 2; i++) {
    ofl_comm_destroy(r[i].oc);
    cr_assert(eq(int, ncclCommDestroy(r[i].comm), ncclSuccess));
    cudaStreamDestroy(r[i].stream);
  }
}

/* Rank 1 of the deadline test: not ofl, but the first round of ofl's gather
 * done by hand (the 16-byte header all-gather: payload length, operation
 * number 1, result on rank 0 only), `late_ms` late; it never makes the
 * second round (the payloads). */
typedef struct {
  nccl_rank_t *r;
  int late_ms;
  ncclResult_t res;
} half_rank_t;

static void *half_rank_main(void *arg) {
  half_rank_t *h = arg;
  nccl_rank_t *r = h->r;
  ncclResult_t st = nccl_rank_init(r);
  h->res = st;
  if (st != ncclSuccess)
    return NULL;
  usleep((useconds_t)h->late_ms * 1000);
  unsigned char hdr[32] = {0}, *own = hdr + 16 * r->rank;
  own[0] = 64;  /* payload bytes (u64, little-endian) */
  own[8] = 1;   /* operation 1 of the comm (u32) */
  own[12] = 0;  /* root only */
  void *dev = NULL;
  cudaMalloc(&dev, sizeof hdr);
  /* on the collective's stream: a pageable cudaMemcpy may return before
   * its DMA is done, and the non-blocking stream does not wait for it */
  cudaMemcpyAsync((char *)dev + 16 * r->rank, own, 16, cudaMemcpyHostToDevice,
                  r->stream);
  st = ncclAllGather((char *)dev + 16 * r->rank, dev, 16, ncclUint8, r->comm,
                     r->stream);
  while (st == ncclInProgress)
    ncclCommGetAsyncError(r->comm, &st);
  h->res = st;
  cudaStreamSynchronize(r->stream);
  cudaFree(dev);
  return NULL;
}

Test(cuda_interop, nccl_gather_deadline_covers_all_its_rounds) {
  sim();
  nccl_rank_t r[2];
  two_ranks(r);
  /* Rank 0: a summary gather with a 500 ms timeout. Rank 1 answers the
   * first round 350 ms late and never the second: the gather must fail
   * about 500 ms after it began, not 500 ms after the first round ended. */
  /* (times scaled by OFLTEST_SLOW under the sanitizer and valgrind setups) */
  int k = getenv("OFLTEST_SLOW") ? atoi(getenv("OFLTEST_SLOW")) : 1;
  k = k < 1 ? 1 : k;
  half_rank_t h = {&r[1], 350 * k, ncclSuccess};
  pthread_t t1;
  pthread_create(&t1, NULL, half_rank_main, &h);
  cr_assert(eq(int, nccl_rank_init(&r[0]), ncclSuccess));
  ofl_comm_params_t p = OFL_COMM_PARAMS_INIT;
  p.timeout_ms = 500 * k;
  p.nccl_nonblocking = 1;
  p.nccl_abort_on_timeout = 1; /* the abort ends rank 1's wait below */
  OK(ofl_comm_create_nccl(r[0].comm, r[0].stream, &p, &r[0].oc));
  ofl_byte_table_t *tb = NULL;
  OK(ofl_byte_table_create(&tb));
  OK(ofl_byte_table_add(tb, "core_attn", 1234));
  ofl_summary_t *sum = NULL;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  ofl_status_t gs = ofl_summary_gather(r[0].oc, tb, 1, &sum);
  clock_gettime(CLOCK_MONOTONIC, &b);
  pthread_join(t1, NULL);
  double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 +
              (double)(b.tv_nsec - a.tv_nsec) / 1e6;
  cr_assert(eq(int, h.res, ncclSuccess), "rank 1's first round failed");
  cr_assert(eq(int, gs, OFL_ERR_TIMEOUT), "%s", ofl_last_error());
  cr_assert(strstr(ofl_last_error(), "table all-gather") != NULL,
            "the second round is the one that times out: %s",
            ofl_last_error());
  cr_assert(ms >= 450.0 * k && ms < 800.0 * k,
            "the gather failed after %.0f ms; its deadline is %d ms from "
            "its start (%d would be a fresh deadline per round)",
            ms, 500 * k, 850 * k);
  ofl_byte_table_destroy(tb);
  ofl_comm_destroy(r[0].oc); /* rank 0's communicator was aborted */
  ncclCommAbort(r[1].comm);
  cudaStreamDestroy(r[0].stream);
  cudaStreamDestroy(r[1].stream);
}

/* ---- 7: an application's graph capture is never broken by ofl -------------
 */

Test(cuda_interop, ofl_calls_never_invalidate_an_applications_capture) {
  sim();
  ofl_device_t *dev = open_cuda(0);
  cudaStream_t app = NULL;
  CUDA_OK(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking));
  void *appbuf = NULL;
  CUDA_OK(cudaMalloc(&appbuf, 4096));
  CUDA_OK(cudaStreamBeginCapture(app, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaMemsetAsync(appbuf, 7, 4096, app)); /* captured */
  /* Global mode forbids allocations, registrations, synchronisations and
   * queries from every thread while the capture runs: ofl's must not count. */
  void *d = NULL, *h = NULL;
  OK(ofl_device_malloc(dev, 1 << 16, &d));
  OK(ofl_pinned_malloc(dev, 1 << 16, &h));
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "copies", &s));
  t_pattern(h, 1 << 16, 41);
  OK(ofl_memcpy_async(d, h, 1 << 16, OFL_COPY_H2D, s));
  OK(ofl_stream_synchronize(s, -1));
  OK(ofl_stream_destroy(s));
  OK(ofl_pinned_free(dev, h));
  OK(ofl_device_free(dev, d));
  cudaGraph_t graph = NULL;
  CUDA_OK(cudaStreamEndCapture(app, &graph)); /* not invalidated */
  cudaGraphExec_t exec = NULL;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, app));
  CUDA_OK(cudaStreamSynchronize(app));
  unsigned char back[4096];
  CUDA_OK(cudaMemcpy(back, appbuf, sizeof back, cudaMemcpyDeviceToHost));
  size_t wrong = 0;
  for (size_t i = 0; i < sizeof back; i++)
    wrong += back[i] != 7;
  cr_assert(eq(sz, wrong, 0), "the captured memset did not replay");
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaFree(appbuf));
  CUDA_OK(cudaStreamDestroy(app));
  ofl_device_close(dev);
}

/* ---- smaller ones ----------------------------------------------------------
 */

/* Two microbatches of groups a then b. In steady state the first group of
 * each name to run backward (microbatch 0's) stays on the device; microbatch
 * 1's are offloaded, and its b is prefetched at the end of microbatch 0's
 * first backward (microbatch 0 has nothing left to reload). With gate_h2d
 * that prefetch is held while compute reaches its wait. */
static void two_microbatches(env_t *e, int gate_h2d, size_t *wrong) {
  static const char *const names[2] = {"attn_proj", "core_attn"};
  ofl_stream_t *cs = ofl_device_compute_stream(e->dev);
  ofl_tag_t tags[2][2];
  for (int mb = 0; mb < 2; mb++) {
    OK(ofl_manager_chunk_begin(e->m, 1, 0));
    for (int g = 0; g < 2; g++) {
      OK(ofl_manager_group_start(e->m, names[g]));
      ofl_tensor_t *t = NULL;
      int64_t shape[1] = {256 * 1024};
      OK(ofl_pool_alloc(e->pool, shape, 1, OFL_DTYPE_U8, cs, &t));
      OK(t_fill(e->dev, ofl_tensor_data(t), ofl_tensor_bytes(t),
                (uint64_t)(50 + mb * 2 + g)));
      OK(ofl_manager_tensor_push(e->m, t, &tags[mb][g]));
      OK(ofl_manager_group_commit(e->m, names[g], NULL, 0, 0));
    }
  }
  for (int mb = 0; mb < 2; mb++) {
    for (int g = 1; g >= 0; g--) {
      OK(ofl_manager_group_backward_begin(e->m, names[g]));
      if (mb == 1 && g == 1 && gate_h2d) {
        usleep(30000); /* compute waits at the gate meanwhile */
        gate_open();
      }
      ofl_tensor_t *t = NULL;
      OK(ofl_manager_tensor_pop(e->m, tags[mb][g], &t));
      *wrong += t_wrong(e->dev, ofl_tensor_data(t), ofl_tensor_bytes(t),
                        (uint64_t)(50 + mb * 2 + g));
      OK(ofl_tensor_destroy(t));
      if (mb == 0 && g == 1 && gate_h2d) {
        gate.open = 0;
        OK(ofl_stream_launch_host_func(ofl_manager_h2d_stream(e->m), gate_fn,
                                       NULL));
      }
      OK(ofl_manager_group_backward_end(e->m, names[g]));
    }
  }
  OK(ofl_manager_reset(e->m));
}

Test(cuda_interop, a_reload_that_holds_compute_is_a_stall_timed_on_the_device) {
  sim();
  env_t e;
  env_open(&e, 0);
  size_t wrong = 0;
  two_microbatches(&e, 0, &wrong); /* warmup */
  ofl_manager_stats_t before;
  ofl_manager_get_stats(e.m, &before);
  two_microbatches(&e, 1, &wrong);
  OK(ofl_stream_synchronize(ofl_device_compute_stream(e.dev), -1));
  ofl_manager_stats_t after;
  ofl_manager_get_stats(e.m, &after);
  cr_assert(eq(sz, wrong, 0), "wrong %zu", wrong);
  /* The held prefetch, and maybe microbatch 1's a, reloaded right before
   * its backward. */
  cr_assert(ge(u64, after.stalls - before.stalls, 1), "stalls %llu",
            (unsigned long long)(after.stalls - before.stalls));
  /* The CPU enqueued long before the GPU waited: only device timing sees
   * the ~30 ms compute was held. */
  cr_assert(ge(u64, after.stall_ns - before.stall_ns, 10000000ull),
            "stall_ns %llu",
            (unsigned long long)(after.stall_ns - before.stall_ns));
  t_env_close(&e);
}

static uint64_t reloaded_after_first_backward(int depth) {
  env_t e;
  e.dev = open_cuda(0);
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
  OK(ofl_pool_create(e.dev, &pp, &e.pool));
  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
  mp.device = e.dev;
  mp.device_pool = e.pool;
  mp.offload = 1;
  mp.groups = "";
  mp.min_offload_bytes = 1;
  mp.fraction = 1.0;
  mp.prefetch_groups = depth;
  OK(ofl_manager_create(&mp, &e.m));
  static const char *const names[4] = {"attn_norm", "qkv_linear", "core_attn",
                                       "attn_proj"};
  uint64_t issued = 0;
  size_t wrong = 0;
  for (int it = 0; it < 2; it++) {
    ofl_tag_t tags[2][4];
    ofl_stream_t *cs = ofl_device_compute_stream(e.dev);
    for (int mb = 0; mb < 2; mb++) {
      OK(ofl_manager_chunk_begin(e.m, 1, 0));
      for (int g = 0; g < 4; g++) {
        OK(ofl_manager_group_start(e.m, names[g]));
        ofl_tensor_t *t = NULL;
        int64_t shape[1] = {64 * 1024};
        OK(ofl_pool_alloc(e.pool, shape, 1, OFL_DTYPE_U8, cs, &t));
        OK(t_fill(e.dev, ofl_tensor_data(t), 64 * 1024,
                  (uint64_t)(it * 100 + mb * 10 + g)));
        OK(ofl_manager_tensor_push(e.m, t, &tags[mb][g]));
        OK(ofl_manager_group_commit(e.m, names[g], NULL, 0, 0));
      }
    }
    for (int mb = 0; mb < 2; mb++) {
      for (int g = 3; g >= 0; g--) {
        OK(ofl_manager_group_backward_begin(e.m, names[g]));
        ofl_tensor_t *t = NULL;
        OK(ofl_manager_tensor_pop(e.m, tags[mb][g], &t));
        wrong += t_wrong(e.dev, ofl_tensor_data(t), 64 * 1024,
                         (uint64_t)(it * 100 + mb * 10 + g));
        OK(ofl_tensor_destroy(t));
        OK(ofl_manager_group_backward_end(e.m, names[g]));
        if (mb == 0 && g == 3) {
          ofl_manager_stats_t s;
          ofl_manager_get_stats(e.m, &s);
          issued = s.reloaded_bytes - issued; /* this iteration's so far */
        }
      }
    }
    OK(ofl_manager_reset(e.m));
    if (it == 0) {
      ofl_manager_stats_t s;
      ofl_manager_get_stats(e.m, &s);
      issued = s.reloaded_bytes; /* the warmup's, subtracted above */
    }
  }
  cr_assert(eq(sz, wrong, 0));
  t_env_close(&e);
  return issued;
}

Test(cuda_interop, prefetch_groups_issues_that_many_reloads_ahead) {
  sim();
  /* reloaded_bytes counts reloads as they are issued; read right after the
   * first backward_end of a steady-state iteration. */
  uint64_t d1 = reloaded_after_first_backward(1);
  uint64_t d2 = reloaded_after_first_backward(2);
  uint64_t d3 = reloaded_after_first_backward(3);
  cr_assert(eq(u64, d2, d1 + 64 * 1024), "depth 1 %llu, depth 2 %llu",
            (unsigned long long)d1, (unsigned long long)d2);
  cr_assert(eq(u64, d3, d1 + 2 * 64 * 1024), "depth 1 %llu, depth 3 %llu",
            (unsigned long long)d1, (unsigned long long)d3);
}

Test(cuda_interop, pinned_blocks_are_registered_in_whole_pages) {
  sim();
  ofl_device_t *dev = open_cuda(0);
  void *h = NULL;
  OK(ofl_pinned_malloc(dev, 100, &h));
  long page = sysconf(_SC_PAGESIZE);
  struct cudaPointerAttributes a;
  /* The rest of the block's page belongs to the registration, so no heap
   * neighbour shares a registered page. */
  CUDA_OK(cudaPointerGetAttributes(&a, (char *)h + page - 1));
  cr_assert(eq(int, (int)a.type, (int)cudaMemoryTypeHost));
  OK(ofl_pinned_free(dev, h));
  ofl_device_close(dev);
}

Test(cuda_interop, close_after_a_drain_that_failed_leaks_instead_of_freeing) {
  sim();
  setenv("OFL_WAIT_TIMEOUT_MS", "300", 1);
  OK(ofl_config_reload());
  ofl_device_t *dev = open_cuda(0);
  ofl_stream_t *s = NULL;
  OK(ofl_stream_create(dev, "stuck", &s));
  void *d = NULL, *h = NULL;
  OK(ofl_device_malloc(dev, 1 << 16, &d));
  OK(ofl_pinned_malloc(dev, 1 << 16, &h));
  gate.open = 0;
  OK(ofl_stream_launch_host_func(s, gate_fn, NULL));
  OK(ofl_memcpy_async(h, d, 1 << 16, OFL_COPY_D2H, s));
  /* The stream cannot drain: freeing d or unregistering h under the queued
   * copy would be misuse (the stand-in aborts on it). */
  ofl_device_close(dev);
  gate_open();
  unsetenv("OFL_WAIT_TIMEOUT_MS");
  OK(ofl_config_reload());
}

Test(cuda_interop, offloading_refuses_inside_a_capture_and_held_passes_work) {
  sim();
  env_t e;
  env_open(&e, 0);
  cudaStream_t app = NULL;
  CUDA_OK(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking));
  ofl_stream_t *ws = NULL;
  OK(ofl_stream_wrap_native(e.dev, app, "app", &ws));
  ofl_device_set_compute_stream(e.dev, ws);
  ofl_event_t *boundary = NULL;
  OK(ofl_event_create(e.dev, &boundary));
  ofl_tensor_t *t = NULL;
  int64_t shape[1] = {4096};
  OK(ofl_pool_alloc(e.pool, shape, 1, OFL_DTYPE_U8, ws, &t));
  OK(ofl_stream_synchronize(ws, -1));

  CUDA_OK(cudaStreamBeginCapture(app, cudaStreamCaptureModeGlobal));
  /* Offloading cannot be captured: a clear refusal, the capture intact. */
  cr_assert(eq(int, ofl_manager_chunk_begin(e.m, 1, 0), OFL_ERR_INVALID_USAGE));
  cr_assert(strstr(ofl_last_error(), "captured into a CUDA graph") != NULL,
            "%s", ofl_last_error());
  /* With offload disabled (the reference's graph passes) the calls hold
   * tensors and the boundaries are recorded inside the capture. */
  ofl_manager_disable_offload(e.m);
  OK(ofl_manager_chunk_begin(e.m, 1, 0));
  OK(ofl_manager_group_start(e.m, "core_attn"));
  ofl_tag_t tag;
  OK(ofl_manager_tensor_push(e.m, t, &tag));
  OK(ofl_manager_group_commit(e.m, "core_attn", NULL, 0, 0));
  OK(ofl_manager_forward_record(e.m, boundary));
  OK(ofl_manager_group_backward_begin(e.m, "core_attn"));
  ofl_tensor_t *back = NULL;
  OK(ofl_manager_tensor_pop(e.m, tag, &back));
  cr_assert(eq(ptr, back, t));
  OK(ofl_manager_group_backward_end(e.m, "core_attn"));
  OK(ofl_manager_backward_record(e.m, boundary));
  cudaGraph_t graph = NULL;
  CUDA_OK(cudaStreamEndCapture(app, &graph)); /* not invalidated */
  CUDA_OK(cudaGraphDestroy(graph));
  OK(ofl_manager_reset(e.m));
  ofl_manager_enable_offload(e.m);
  OK(ofl_tensor_destroy(back));
  ofl_event_destroy(boundary);
  ofl_device_set_compute_stream(e.dev, NULL);
  OK(ofl_stream_destroy(ws));
  CUDA_OK(cudaStreamDestroy(app));
  t_env_close(&e);
}

/* The default compute stream is the legacy one: a capture of a blocking
 * stream of the device (any mode, relaxed included) makes every use of it
 * join and break that capture, so offloading must refuse. */
Test(cuda_interop, a_blocking_streams_capture_makes_legacy_compute_refuse) {
  sim();
  env_t e;
  env_open(&e, 0);
  cudaStream_t blocking = NULL;
  CUDA_OK(cudaStreamCreate(&blocking)); /* blocking: syncs with legacy */
  CUDA_OK(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeRelaxed));
  cr_assert(eq(int, ofl_manager_chunk_begin(e.m, 1, 0), OFL_ERR_INVALID_USAGE),
            "%s", ofl_last_error());
  cudaGraph_t graph = NULL;
  CUDA_OK(cudaStreamEndCapture(blocking, &graph)); /* not invalidated */
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(blocking));
  t_env_close(&e);
}

/* An ordered release on a stream being captured is refused before anything
 * changes (its event could never be waited for outside the graph). */
Test(cuda_interop, an_ordered_release_on_a_capturing_stream_is_refused) {
  sim();
  ofl_device_t *dev = open_cuda(0);
  cudaStream_t app = NULL;
  CUDA_OK(cudaStreamCreateWithFlags(&app, cudaStreamNonBlocking));
  ofl_stream_t *ws = NULL;
  OK(ofl_stream_wrap_native(dev, app, "app", &ws));
  void *raw = NULL;
  CUDA_OK(cudaMalloc(&raw, 4096));
  int64_t shape[1] = {4096};
  ofl_tensor_t *t = NULL;
  OK(ofl_tensor_wrap(raw, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE, NULL, NULL,
                     &t));
  CUDA_OK(cudaStreamBeginCapture(app, cudaStreamCaptureModeGlobal));
  cr_assert(
      eq(int, ofl_tensor_release_storage_after(t, ws), OFL_ERR_INVALID_USAGE));
  cr_assert(ofl_tensor_has_storage(t)); /* nothing changed */
  cudaGraph_t graph = NULL;
  CUDA_OK(cudaStreamEndCapture(app, &graph));
  CUDA_OK(cudaGraphDestroy(graph));
  OK(ofl_tensor_release_storage_after(t, ws)); /* after the capture: fine */
  OK(ofl_stream_synchronize(ws, -1));
  OK(ofl_tensor_destroy(t));
  OK(ofl_stream_destroy(ws));
  CUDA_OK(cudaStreamDestroy(app));
  CUDA_OK(cudaFree(raw));
  ofl_device_close(dev);
}

Test(cuda_interop, the_per_thread_default_stream_cannot_be_wrapped) {
  sim();
  ofl_device_t *dev = open_cuda(0);
  ofl_stream_t *w = NULL;
  cr_assert(eq(int,
               ofl_stream_wrap_native(dev, cudaStreamPerThread, "ptds", &w),
               OFL_ERR_INVALID_ARG));
  ofl_device_close(dev);
}
