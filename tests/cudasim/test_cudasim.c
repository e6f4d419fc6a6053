/* Self-test of the cudasim runtime stand-in (tests/cudasim/cudart*.c): each
 * strictness rule that ofl's tests rely on, checked once. Runs in count mode
 * (CUDASIM_MISUSE=count); each deliberate misuse is checked and reset. */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/cudasim/cudasim.h"
#include "tests/support/tap.h"

#define N 4096

static uint64_t misuse_count(void) {
  cudasim_stats_t st;
  cudasim_get_stats(&st);
  return st.misuse;
}

/* Checks that `call` is reported as misuse (one report), then forgets it. */
#define EXPECT_MISUSE(call, err, name)                                         \
  do {                                                                         \
    uint64_t before_ = misuse_count();                                         \
    cudaError_t e_ = (call);                                                   \
    tap_ok(e_ == (err) && misuse_count() == before_ + 1,                       \
           "%s (got %s, misuse \"%s\")", name, cudaGetErrorName(e_),           \
           cudasim_last_misuse());                                             \
    cudasim_reset_misuse();                                                    \
    (void)cudaGetLastError();                                                  \
  } while (0)

/* Stream operations for stalling a stream (cudasim__enqueue). */
static int op_sleep(void *arg, volatile int *abort_flag) {
  (void)abort_flag;
  usleep((useconds_t)(intptr_t)arg * 1000);
  return 0;
}

static int op_block(void *arg, volatile int *abort_flag) {
  int *release = arg;
  while (!__atomic_load_n(release, __ATOMIC_ACQUIRE) &&
         !__atomic_load_n(abort_flag, __ATOMIC_ACQUIRE))
    usleep(500);
  return 0;
}

static void sigsegv_exit(int sig) {
  (void)sig;
  _exit(42);
}

/* Runs fn in a child; returns its exit status (-1: killed by a signal). */
static int in_child(void (*fn)(void *), void *arg) {
  pid_t pid = fork();
  if (pid == 0) {
    fn(arg);
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void child_no_device(void *arg) {
  (void)arg;
  setenv("CUDASIM_DEVICES", "0", 1);
  int n = 7;
  cudaError_t e = cudaGetDeviceCount(&n);
  _exit(e == cudaErrorNoDevice && n == 0 ? 10 : 11);
}

static void child_old_driver(void *arg) {
  (void)arg;
  setenv("CUDASIM_DRIVER_VERSION", "12080", 1);
  int n = 7;
  _exit(cudaGetDeviceCount(&n) == cudaErrorInsufficientDriver ? 10 : 11);
}

static void child_touch(void *p) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = sigsegv_exit;
  sigaction(SIGSEGV, &sa, NULL);
  volatile char c = *(volatile char *)p;
  (void)c;
}

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != v)
      return 0;
  return 1;
}

static void fill_pattern(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    p[i] = (unsigned char)(i * 31u + seed);
}

/* ---- host functions ---- */
static int hostfn_log[64], hostfn_n;
static void hostfn_append(void *arg) {
  hostfn_log[hostfn_n++] = (int)(intptr_t)arg;
}

static cudaError_t hostfn_call_result;
static int hostfn_saw_flag;
static void hostfn_calls_cuda(void *arg) {
  (void)arg;
  int d;
  hostfn_call_result = cudaGetDevice(&d);
  hostfn_saw_flag = cudasim_in_host_fn();
}

static void *thread_get_device(void *arg) {
  int *out = arg;
  if (cudaGetDevice(out) != cudaSuccess)
    *out = -1;
  return NULL;
}

static void test_processes(void) {
  tap_ok(in_child(child_no_device, NULL) == 10,
         "CUDASIM_DEVICES=0: cudaGetDeviceCount answers cudaErrorNoDevice, 0");
  tap_ok(
      in_child(child_old_driver, NULL) == 10,
      "an old driver: cudaGetDeviceCount answers cudaErrorInsufficientDriver");
}

static void test_contexts_and_devices(void) {
  cudasim_stats_t st;
  int n = 0, d = -1;
  cudaGetDeviceCount(&n);
  cudaGetDevice(&d);
  cudasim_get_stats(&st);
  int none_yet = st.contexts[0] == 0 && st.contexts[1] == 0;
  void *p;
  cudaMalloc(&p, 256);
  cudasim_get_stats(&st);
  tap_ok(n == 2 && d == 0 && none_yet && st.contexts[0] == 1 &&
             st.contexts[1] == 0,
         "two devices; cudaGetDeviceCount/GetDevice create no context, "
         "cudaMalloc creates device 0's");
  cudaSetDevice(1);
  int other = -1;
  pthread_t t;
  pthread_create(&t, NULL, thread_get_device, &other);
  pthread_join(t, NULL);
  cudaGetDevice(&d);
  cudasim_get_stats(&st);
  tap_ok(d == 1 && other == 0 && st.contexts[1] == 1,
         "the current device is per thread (this 1, another 0); "
         "cudaSetDevice(1) creates device 1's context");
  tap_ok(cudaSetDevice(2) == cudaErrorInvalidDevice &&
             cudaGetLastError() == cudaErrorInvalidDevice &&
             cudaGetLastError() == cudaSuccess,
         "cudaSetDevice out of range: cudaErrorInvalidDevice, last error "
         "returned once");
  cudaSetDevice(0);
  cudaFree(p);
}

static void test_memory(void) {
  unsigned char *d;
  cudaMalloc((void **)&d, N);
  /* 42: the child's SIGSEGV handler ran (valgrind exits with its own error
   * code first); 0 would mean the read succeeded. */
  int touch = in_child(child_touch, d);
  tap_ok(touch != 0,
         "a CPU read of cudaMalloc memory segfaults (child "
         "status %d)",
         touch);
  int dev = -1;
  struct cudaPointerAttributes a;
  cudaPointerGetAttributes(&a, d + 10);
  tap_ok(cudasim_is_device_memory(d + 100, &dev) && dev == 0 &&
             a.type == cudaMemoryTypeDevice && a.device == 0 &&
             ((uintptr_t)d % 256) == 0,
         "cudaMalloc memory is 256-aligned device memory of device 0");

  unsigned char *pin, *back;
  cudaMallocHost((void **)&pin, N);
  cudaMallocHost((void **)&back, N);
  cudaPointerGetAttributes(&a, pin);
  int pinned_attr = a.type == cudaMemoryTypeHost;
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  fill_pattern(pin, N, 1);
  memset(back, 0, N);
  cudaMemcpyAsync(d, pin, N, cudaMemcpyHostToDevice, s);
  cudaMemcpyAsync(back, d, N, cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  tap_ok(pinned_attr && memcmp(pin, back, N) == 0,
         "H2D then D2H with pinned memory: byte for byte");

  unsigned char *pg = malloc(N), *pgback = malloc(N);
  fill_pattern(pg, N, 2);
  memset(pgback, 0, N);
  cudaMemcpyAsync(d, pg, N, cudaMemcpyHostToDevice, s);
  memset(pg, 0xee, N); /* staged at the call: may be reused at once */
  cudaMemcpyAsync(pgback, d, N, cudaMemcpyDefault, s);
  fill_pattern(pg, N, 2);
  tap_ok(memcmp(pg, pgback, N) == 0,
         "pageable H2D is staged at the call; pageable D2H is complete when "
         "the call returns");

  /* FIFO: memset i then copy out to slot i, sixteen times, under jitter. */
  unsigned char *slots;
  cudaMallocHost((void **)&slots, 16 * 64);
  for (int i = 0; i < 16; i++) {
    cudaMemsetAsync(d, i + 1, 64, s);
    cudaMemcpyAsync(slots + 64 * i, d, 64, cudaMemcpyDeviceToHost, s);
  }
  for (int i = 0; i < 16; i++)
    cudaLaunchHostFunc(s, hostfn_append, (void *)(intptr_t)i);
  cudaStreamSynchronize(s);
  int fifo = hostfn_n == 16;
  for (int i = 0; i < 16; i++)
    fifo = fifo && all_bytes(slots + 64 * i, 64, (unsigned char)(i + 1)) &&
           hostfn_log[i] == i;
  tap_ok(fifo, "one stream runs its operations in FIFO order (copies, "
               "memsets, host functions)");

  size_t free0, total;
  cudaMemGetInfo(&free0, &total);
  void *big = NULL;
  uint64_t mis = misuse_count();
  cudaError_t e = cudaMalloc(&big, free0 + 4096);
  int cleared = cudaGetLastError() == cudaErrorMemoryAllocation &&
                cudaPeekAtLastError() == cudaSuccess;
  void *one;
  cudaMalloc(&one, 1 << 20);
  size_t free1;
  cudaMemGetInfo(&free1, &total);
  tap_ok(e == cudaErrorMemoryAllocation && big == NULL && cleared &&
             misuse_count() == mis && total == ((size_t)64 << 20) &&
             free1 == free0 - (1 << 20),
         "cudaMemGetInfo reports capacity and free bytes; over capacity is "
         "cudaErrorMemoryAllocation, not misuse");
  cudaFree(one);

  free(pg);
  free(pgback);
  cudaFreeHost(slots);
  cudaFreeHost(pin);
  cudaFreeHost(back);
  cudaStreamDestroy(s);
  cudaFree(d);
}

static void test_events(void) {
  cudaStream_t a, b, c;
  cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking);
  cudaEvent_t ev, done, fresh;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&fresh, cudaEventDisableTiming);

  int release = 0;
  cudaEventRecord(ev, b);
  cudasim__enqueue(a, op_block, &release, "stall");
  cudaStreamWaitEvent(c, ev, 0);
  cudaEventRecord(ev, a); /* re-record on the stalled stream */
  cudaEventRecord(done, c);
  int ok = 0;
  for (int i = 0; i < 2000 && !ok; i++) {
    ok = cudaEventQuery(done) == cudaSuccess;
    if (!ok)
      usleep(1000);
  }
  (void)cudaGetLastError();
  int a_busy = cudaStreamQuery(a) == cudaErrorNotReady;
  int last = cudaGetLastError() == cudaErrorNotReady &&
             cudaGetLastError() == cudaSuccess;
  tap_ok(ok && a_busy, "a wait captures the event's record at the call (a "
                       "re-record on a stalled stream is not waited for)");
  tap_ok(last, "cudaStreamQuery's cudaErrorNotReady is also the thread's "
               "last error");
  __atomic_store_n(&release, 1, __ATOMIC_RELEASE);
  cudaStreamSynchronize(a);

  tap_ok(cudaEventQuery(fresh) == cudaSuccess &&
             cudaStreamWaitEvent(c, fresh, 0) == cudaSuccess &&
             cudaStreamSynchronize(c) == cudaSuccess,
         "a never-recorded event: query succeeds, a wait on it is no wait");

  int never = 0;
  cudasim__enqueue(a, op_block, &never, "stall forever");
  cudasim__abort_ops(&never);
  tap_ok(cudaStreamSynchronize(a) == cudaSuccess,
         "cudasim__abort_ops ends a blocked external operation");

  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0, a);
  cudasim__enqueue(a, op_sleep, (void *)(intptr_t)20, "sleep 20 ms");
  cudaEventRecord(t1, a);
  cudaEventSynchronize(t1);
  float ms = 0;
  cudaError_t e1 = cudaEventElapsedTime(&ms, t0, t1);
  cudaError_t e2 = cudaEventElapsedTime(&ms, ev, t1);
  (void)cudaGetLastError();
  tap_ok(e1 == cudaSuccess && ms >= 19.0f && ms < 2000.0f &&
             e2 == cudaErrorInvalidResourceHandle,
         "cudaEventElapsedTime: %.1f ms around a 20 ms operation; an event "
         "without timing is cudaErrorInvalidResourceHandle",
         (double)ms);

  cudaSetDevice(1);
  cudaStream_t s1;
  cudaStreamCreate(&s1);
  EXPECT_MISUSE(cudaEventRecord(ev, s1), cudaErrorInvalidResourceHandle,
                "recording an event of device 0 on a stream of device 1 is "
                "misuse");
  cudaStreamDestroy(s1);
  cudaSetDevice(0);

  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaEventDestroy(ev);
  cudaEventDestroy(done);
  cudaEventDestroy(fresh);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  cudaStreamDestroy(c);
}

static void test_race_and_legacy(void) {
  unsigned char *d, *h;
  cudaMalloc((void **)&d, N);
  cudaMallocHost((void **)&h, N);
  cudaStream_t a, b;
  cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  int stale = 0, fresh = 0;
#if defined(__SANITIZE_THREAD__)
  /* The deliberate race is on the stand-in's shadow memory: ThreadSanitizer
   * reports it (as it would report a missing wait in ofl). */
  stale = fresh = -1;
#endif
  for (int i = 0; i < 60 && !(stale && fresh); i++) {
    cudaMemset(d, 0, N);
    cudaDeviceSynchronize();
    /* Nothing orders the two streams: holding one of them back (in turn)
     * lets either order happen even on a loaded machine, where jitter alone
     * might always give the same one. */
    cudasim__enqueue(i % 2 ? b : a, op_sleep, (void *)(intptr_t)10,
                     "hold one stream back");
    cudaMemsetAsync(d, 0xab, N, a);
    cudaMemcpyAsync(h, d, N, cudaMemcpyDeviceToHost, b); /* no wait: a race */
    cudaDeviceSynchronize();
    if (all_bytes(h, N, 0xab))
      fresh++;
    else
      stale++;
  }
  tap_ok(stale && fresh,
         "two streams without a wait race (jitter): stale "
         "bytes seen, fresh bytes seen%s",
         stale < 0 ? " # SKIP under ThreadSanitizer" : "");

  /* Legacy stream: a blocking stream's work waits for prior legacy work. */
  cudaStream_t blocking;
  cudaStreamCreate(&blocking);
  cudasim__enqueue(NULL, op_sleep, (void *)(intptr_t)20, "sleep on legacy");
  cudaMemsetAsync(d, 0x5a, N, NULL);
  cudaMemcpyAsync(h, d, N, cudaMemcpyDeviceToHost, blocking);
  cudaStreamSynchronize(blocking);
  tap_ok(all_bytes(h, N, 0x5a), "work on a blocking stream waits for prior "
                                "legacy-stream work");
  /* A non-blocking stream does not wait for the legacy stream. */
  int release = 0;
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  cudasim__enqueue(NULL, op_block, &release, "stall the legacy stream");
  cudaMemsetAsync(d, 0x11, N, a);
  cudaEventRecord(ev, a);
  int ran = 0;
  for (int i = 0; i < 2000 && !ran; i++) {
    ran = cudaEventQuery(ev) == cudaSuccess;
    if (!ran)
      usleep(1000);
  }
  (void)cudaGetLastError();
  __atomic_store_n(&release, 1, __ATOMIC_RELEASE);
  cudaDeviceSynchronize();
  tap_ok(ran, "a non-blocking stream does not wait for the legacy stream");
  cudaEventDestroy(ev);

  /* Destroying a stream with queued work: the work still completes. */
  cudaStream_t doomed;
  cudaStreamCreateWithFlags(&doomed, cudaStreamNonBlocking);
  memset(h, 0, N);
  cudasim__enqueue(doomed, op_sleep, (void *)(intptr_t)10, "sleep 10 ms");
  cudaMemsetAsync(d, 0x77, N, doomed);
  cudaMemcpyAsync(h, d, N, cudaMemcpyDeviceToHost, doomed);
  cudaError_t de = cudaStreamDestroy(doomed);
  int pending = !all_bytes(h, N, 0x77);
  cudaDeviceSynchronize();
  tap_ok(de == cudaSuccess && pending && all_bytes(h, N, 0x77),
         "cudaStreamDestroy returns at once; the queued work completes");

  unsigned int flags = 9;
  cudaStreamGetFlags(blocking, &flags);
  tap_ok(flags == cudaStreamDefault, "cudaStreamGetFlags");
  cudaStreamDestroy(blocking);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  cudaFreeHost(h);
  cudaFree(d);
}

static void test_misuse(void) {
  unsigned char *d, *h;
  cudaMalloc((void **)&d, N);
  cudaMallocHost((void **)&h, N);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);

  uint64_t before = misuse_count();
  cudaLaunchHostFunc(s, hostfn_calls_cuda, NULL);
  cudaStreamSynchronize(s);
  tap_ok(hostfn_call_result == cudaErrorNotPermitted && hostfn_saw_flag &&
             misuse_count() == before + 1,
         "a CUDA call inside a host function: cudaErrorNotPermitted, misuse");
  cudasim_reset_misuse();

  EXPECT_MISUSE(cudaMemcpyAsync(h, d, N, cudaMemcpyHostToDevice, s),
                cudaErrorInvalidValue,
                "a copy whose kind does not match is "
                "misuse");
  EXPECT_MISUSE(cudaMemcpyAsync(h, d + 16, N, cudaMemcpyDeviceToHost, s),
                cudaErrorInvalidValue,
                "a copy past the end of an allocation "
                "is misuse");
  EXPECT_MISUSE(cudaMemcpyAsync(NULL, d, N, cudaMemcpyDeviceToHost, s),
                cudaErrorInvalidValue, "a NULL pointer with bytes is misuse");
  unsigned char *gone;
  cudaMalloc((void **)&gone, N);
  cudaFree(gone);
  EXPECT_MISUSE(cudaMemcpyAsync(h, gone, N, cudaMemcpyDeviceToHost, s),
                cudaErrorInvalidValue,
                "a copy from freed device memory is "
                "misuse");
  EXPECT_MISUSE(cudaFree(d + 256), cudaErrorInvalidValue,
                "cudaFree of a pointer inside an allocation is misuse");
  EXPECT_MISUSE(cudaFree(gone), cudaErrorInvalidValue,
                "a double cudaFree is misuse");

  unsigned char *victim;
  cudaMalloc((void **)&victim, N);
  cudasim__enqueue(s, op_sleep, (void *)(intptr_t)30, "sleep 30 ms");
  cudaMemcpyAsync(h, victim, N, cudaMemcpyDeviceToHost, s);
  EXPECT_MISUSE(cudaFree(victim), cudaSuccess,
                "cudaFree of memory a queued copy uses is misuse (then it "
                "synchronizes and frees)");

  unsigned char *reg = malloc(3 * 4096);
  cudaHostRegister(reg, 2 * 4096, cudaHostRegisterDefault);
  EXPECT_MISUSE(cudaHostRegister(reg + 4096, 2 * 4096, cudaHostRegisterDefault),
                cudaErrorHostMemoryAlreadyRegistered,
                "an overlapping cudaHostRegister is misuse");
  EXPECT_MISUSE(cudaHostUnregister(reg + 4096),
                cudaErrorHostMemoryNotRegistered,
                "cudaHostUnregister of an unregistered pointer is misuse");
  cudasim__enqueue(s, op_sleep, (void *)(intptr_t)20, "sleep 20 ms");
  cudaMemcpyAsync(d, reg, 4096, cudaMemcpyHostToDevice, s);
  EXPECT_MISUSE(cudaHostUnregister(reg), cudaSuccess,
                "cudaHostUnregister of memory a queued copy uses is misuse");
  free(reg);

  cudaSetDevice(1);
  unsigned char *d1;
  cudaMalloc((void **)&d1, N);
  cudaSetDevice(0);
  EXPECT_MISUSE(cudaMemcpyAsync(h, d1, N, cudaMemcpyDeviceToHost, s),
                cudaErrorInvalidValue,
                "memory of device 1 in a copy on a "
                "stream of device 0 is misuse");
  EXPECT_MISUSE(cudaMemsetAsync(h, 0, N, s), cudaErrorInvalidValue,
                "a memset of host memory is misuse");
  cudaSetDevice(1);
  cudaFree(d1);
  cudaSetDevice(0);

  cudasim_stats_t st;
  cudasim_get_stats(&st);
  tap_ok(st.implicit_syncs >= 5 && st.host_registers == 1 &&
             st.host_unregisters == 1,
         "stats count implicit synchronisations (%llu) and registrations",
         (unsigned long long)st.implicit_syncs);

  cudaStreamDestroy(s);
  cudaFreeHost(h);
  cudaFree(d);
}

static void test_capture(void) {
  unsigned char *d, *h;
  cudaMalloc((void **)&d, N);
  cudaMallocHost((void **)&h, N);
  memset(h, 0, N);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaError_t e0 = cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  cudaStreamIsCapturing(s, &cs);
  cudaMemsetAsync(d, 7, N, s);
  cudaMemcpyAsync(h, d, N, cudaMemcpyDeviceToHost, s);
  cudaError_t e1 = cudaStreamEndCapture(s, &graph);
  cudaDeviceSynchronize();
  int untouched = all_bytes(h, N, 0);
  cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphLaunch(exec, s);
  cudaStreamSynchronize(s);
  tap_ok(e0 == cudaSuccess && e1 == cudaSuccess &&
             cs == cudaStreamCaptureStatusActive && untouched &&
             all_bytes(h, N, 7),
         "captured work does not run; a graph launch runs it");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  void *p = NULL;
  cudaError_t em = cudaMalloc(&p, 256);
  cudaError_t ee = cudaStreamEndCapture(s, &graph);
  (void)cudaGetLastError();
  tap_ok(em == cudaErrorStreamCaptureUnsupported &&
             ee == cudaErrorStreamCaptureInvalidated && graph == NULL,
         "cudaMalloc during a global capture fails and invalidates it");
  tap_ok(cudaStreamBeginCapture(NULL, cudaStreamCaptureModeGlobal) ==
             cudaErrorStreamCaptureUnsupported,
         "the legacy stream cannot be captured");
  (void)cudaGetLastError();
  cudaStreamDestroy(s);
  cudaFreeHost(h);
  cudaFree(d);
}

static void test_errors(void) {
  tap_ok(
      strcmp(cudaGetErrorString(cudaErrorNotReady), "device not ready") == 0 &&
          strcmp(cudaGetErrorName(cudaErrorNotReady), "cudaErrorNotReady") == 0,
      "error names and strings are the real ones");
  int v = 0;
  tap_ok(cudaRuntimeGetVersion(&v) == cudaSuccess && v == 13000 &&
             cudaDriverGetVersion(&v) == cudaSuccess && v == 13000,
         "runtime and driver versions 13000");
  int d;
  cudasim_inject_error(1, cudaErrorMemoryAllocation, 0);
  cudaError_t e1 = cudaGetDevice(&d), e2 = cudaGetDevice(&d);
  (void)cudaGetLastError();
  tap_ok(e1 == cudaErrorMemoryAllocation && e2 == cudaSuccess,
         "an injected error fails one call");
  cudasim_inject_error(2, cudaErrorLaunchFailure, 1);
  e1 = cudaGetDevice(&d);
  e2 = cudaGetDevice(&d);
  cudaError_t e3 = cudaGetLastError(), e4 = cudaGetLastError();
  tap_ok(e1 == cudaSuccess && e2 == cudaErrorLaunchFailure &&
             e3 == cudaErrorLaunchFailure && e4 == cudaErrorLaunchFailure,
         "an injected sticky error fails every later call");
}

/* ---- kernels: registration, launches, the emulation in stream order ---- */

/* What nvcc's generated code calls (crt/host_runtime.h); declared here, as
 * a C test has no <<<>>>. */
void **__cudaRegisterFatBinary(void *fatCubin);
void __cudaRegisterFatBinaryEnd(void **handle);
void __cudaUnregisterFatBinary(void **handle);
void __cudaRegisterFunction(void **handle, const char *hostFun,
                            char *deviceFun, const char *deviceName,
                            int thread_limit, uint3 *tid, uint3 *bid,
                            dim3 *bDim, dim3 *gDim, int *wSize);
cudaError_t __cudaGetKernel(cudaKernel_t *out, const void *hostFun);
cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim,
                               dim3 blockDim, void **args, size_t sharedMem,
                               cudaStream_t stream);
unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim,
                                     size_t sharedMem,
                                     struct CUstream_st *stream);
cudaError_t __cudaPopCallConfiguration(dim3 *gridDim, dim3 *blockDim,
                                       size_t *sharedMem, void *stream);

/* The emulation of "scale2(float *y, const float *x, size_t n)":
 * y[i] = 2 x[i]. */
static int scale2_spans(void *const *args, cudasim_kernel_span_t *o,
                        int max) {
  size_t n = *(const size_t *)args[2];
  if (max < 2)
    return 0;
  o[0] = (cudasim_kernel_span_t){0, n * sizeof(float)};
  o[1] = (cudasim_kernel_span_t){1, n * sizeof(float)};
  return 2;
}
static void scale2_thread(void *const *args, long long i) {
  float *y = *(float *const *)args[0];
  const float *x = *(const float *const *)args[1];
  if (i < (long long)*(const size_t *)args[2])
    y[i] = 2.0f * x[i];
}
static const cudasim_kernel_emu_t scale2_emu = {
    "scale2", 3, {sizeof(void *), sizeof(void *), sizeof(size_t)},
    scale2_spans, scale2_thread};
static char scale2_stub, nokernel_stub; /* the "host stubs" */

static cudaError_t launch_scale2(const void *stub, float *y, const float *x,
                                 size_t n, unsigned threads,
                                 cudaStream_t s) {
  dim3 grid = {(unsigned)((n + threads - 1) / threads), 1, 1};
  dim3 block = {threads, 1, 1};
  if (__cudaPushCallConfiguration(grid, block, 0, s) != 0)
    return cudaErrorInvalidConfiguration;
  dim3 g2, b2;
  size_t shm;
  cudaStream_t s2;
  cudaError_t e = __cudaPopCallConfiguration(&g2, &b2, &shm, &s2);
  if (e != cudaSuccess)
    return e;
  cudaKernel_t k = NULL;
  e = __cudaGetKernel(&k, stub);
  if (e != cudaSuccess)
    return e;
  void *args[] = {&y, &x, &n};
  return __cudaLaunchKernel(k, g2, b2, args, shm, s2);
}

static void test_kernels(void) {
  void **mod = __cudaRegisterFatBinary((void *)"fatbin");
  __cudaRegisterFunction(mod, &scale2_stub, (char *)"scale2", "scale2", -1,
                         NULL, NULL, NULL, NULL, NULL);
  __cudaRegisterFunction(mod, &nokernel_stub, (char *)"nokernel", "nokernel",
                         -1, NULL, NULL, NULL, NULL, NULL);
  __cudaRegisterFatBinaryEnd(mod);
  tap_ok(cudasim_register_kernel(&scale2_emu) == 0,
         "an emulation registers under the kernel's device name");
  cudaSetDevice(0);
  const size_t n = 1000;
  float *h = NULL, *x = NULL, *y = NULL;
  cudaMallocHost((void **)&h, n * sizeof(float));
  cudaMalloc((void **)&x, n * sizeof(float));
  cudaMalloc((void **)&y, n * sizeof(float));
  for (size_t i = 0; i < n; i++)
    h[i] = (float)i;
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  /* A copy, the kernel, a copy back, all queued before any runs: the
   * kernel must see the first copy's bytes and the second its result. */
  int release = 0;
  cudasim__enqueue(s, op_block, &release, "gate");
  cudaMemcpyAsync(x, h, n * sizeof(float), cudaMemcpyHostToDevice, s);
  cudaError_t e = launch_scale2(&scale2_stub, y, x, n, 128, s);
  cudaMemcpyAsync(h, y, n * sizeof(float), cudaMemcpyDeviceToHost, s);
  cudasim_stats_t st;
  cudasim_get_stats(&st);
  __atomic_store_n(&release, 1, __ATOMIC_RELEASE);
  cudaStreamSynchronize(s);
  int good = 1;
  for (size_t i = 0; i < n; i++)
    good &= h[i] == 2.0f * (float)i;
  tap_ok(e == cudaSuccess && good && st.kernel_launches >= 1,
         "a launched kernel runs its emulation in stream order over all %zu "
         "threads (%s)",
         n, cudaGetErrorName(e));
  /* Misuse: a span past the allocation, a launch with no emulation, a bad
   * configuration, freeing memory a queued kernel uses. */
  EXPECT_MISUSE(launch_scale2(&scale2_stub, y, x, n + 64, 128, s),
                cudaErrorIllegalAddress,
                "a kernel span past its allocation (and its 256-byte rounding) is "
                "misuse at the launch");
  e = launch_scale2(&nokernel_stub, y, x, n, 128, s);
  tap_ok(e == cudaErrorNoKernelImageForDevice &&
             cudaGetLastError() == cudaErrorNoKernelImageForDevice,
         "a kernel without an emulation fails its launch (%s)",
         cudaGetErrorName(e));
  e = launch_scale2(&scale2_stub, y, x, n, 2048, s);
  tap_ok(e == cudaErrorInvalidConfiguration,
         "more than 1024 threads a block is an invalid configuration (%s)",
         cudaGetErrorName(e));
  float *tmp = NULL;
  cudaMalloc((void **)&tmp, n * sizeof(float));
  /* (cudaFree synchronizes the device after the report, so the stream is
   * held by a sleep rather than a gate.) */
  cudasim__enqueue(s, op_sleep, (void *)(intptr_t)100, "sleep");
  e = launch_scale2(&scale2_stub, tmp, x, n, 128, s);
  EXPECT_MISUSE(cudaFree(tmp), cudaSuccess,
                "cudaFree of memory a queued kernel uses is misuse");
  cudaStreamSynchronize(s);
  /* cudaFreeAsync on stream b of memory a kernel queued on stream s still
   * uses, nothing ordering the two: misuse when the free runs. */
  cudaStream_t b;
  cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  float *victim = NULL;
  cudaMalloc((void **)&victim, n * sizeof(float));
  release = 0;
  cudasim__enqueue(s, op_block, &release, "gate");
  launch_scale2(&scale2_stub, victim, x, n, 128, s);
  uint64_t before = misuse_count();
  cudaFreeAsync(victim, b);
  cudaStreamSynchronize(b);
  int seen = misuse_count() > before &&
             strstr(cudasim_last_misuse(), "another stream still used") != NULL;
  tap_ok(seen, "cudaFreeAsync of memory a kernel on another stream still "
               "uses, unordered, is misuse when the free runs (\"%s\")",
         cudasim_last_misuse());
  __atomic_store_n(&release, 1, __ATOMIC_RELEASE);
  cudaStreamSynchronize(s); /* the kernel then finds its memory freed */
  cudasim_reset_misuse();
  (void)cudaGetLastError();
  cudaStreamDestroy(b);
  cudaStreamDestroy(s);
  cudaFree(x);
  cudaFree(y);
  cudaFreeHost(h);
  __cudaUnregisterFatBinary(mod);
  cudaKernel_t k = NULL;
  tap_ok(__cudaGetKernel(&k, &scale2_stub) == cudaErrorInvalidDeviceFunction,
         "an unregistered module's kernels are gone");
  (void)cudaGetLastError();
}

int main(void) {
  tap_plan(51);
  test_processes(); /* before the first call: the children start fresh */
  setenv("CUDASIM_DEVICE_MEMORY", "64M", 1);
  cudasim_set_misuse_abort(0);
  test_contexts_and_devices();
  test_memory();
  test_events();
  test_race_and_legacy();
  test_misuse();
  test_capture();
  test_kernels();
  test_errors(); /* last: the sticky error poisons the process */
  tap_diag("misuse reports left: \"%s\"", cudasim_last_misuse());
  return tap_done();
}
