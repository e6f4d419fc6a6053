/* cudasim: kernel registration, launch configurations, and launches
 * run as the CPU emulation the program registered. */
#include "cudart_internal.h"

/* ---- kernels (cudasim.h): registration, launch configuration, launches
 * ------------------------------------------------------------------------ */

typedef struct kfunc {
  struct kfunc *next;
  void **module;    /* the __cudaRegisterFatBinary handle */
  const void *host; /* the host stub nvcc generated */
  char name[256];   /* device name */
} kfunc_t;

typedef struct kemu_reg {
  struct kemu_reg *next;
  const cudasim_kernel_emu_t *emu;
} kemu_reg_t;

static pthread_mutex_t k_mu = PTHREAD_MUTEX_INITIALIZER;
static kfunc_t *k_funcs;   /* k_mu */
static kemu_reg_t *k_emus; /* k_mu */

/* The <<<>>> configurations pushed and not yet popped, per thread. */
typedef struct {
  dim3 grid, block;
  size_t shmem;
  cudaStream_t stream;
} kconf_t;
static __thread kconf_t t_kconf[8];
static __thread int t_nkconf;

EXPORT void **__cudaRegisterFatBinary(void *fatCubin) {
  ensure_init();
  void **h = xcalloc(1, sizeof *h);
  *h = fatCubin;
  return h;
}

EXPORT void __cudaRegisterFatBinaryEnd(void **handle) { (void)handle; }

EXPORT void __cudaUnregisterFatBinary(void **handle) {
  pthread_mutex_lock(&k_mu);
  for (kfunc_t **pp = &k_funcs; *pp;) {
    if ((*pp)->module == handle) {
      kfunc_t *f = *pp;
      *pp = f->next;
      free(f);
    } else {
      pp = &(*pp)->next;
    }
  }
  pthread_mutex_unlock(&k_mu);
  free(handle);
}

EXPORT void __cudaRegisterFunction(void **handle, const char *hostFun,
                                   char *deviceFun, const char *deviceName,
                                   int thread_limit, uint3 *tid, uint3 *bid,
                                   dim3 *bDim, dim3 *gDim, int *wSize) {
  (void)deviceFun, (void)thread_limit, (void)tid, (void)bid, (void)bDim;
  (void)gDim, (void)wSize;
  kfunc_t *f = xcalloc(1, sizeof *f);
  f->module = handle;
  f->host = hostFun;
  snprintf(f->name, sizeof f->name, "%s", deviceName ? deviceName : "?");
  pthread_mutex_lock(&k_mu);
  f->next = k_funcs;
  k_funcs = f;
  pthread_mutex_unlock(&k_mu);
}

/* Copies the device name of the kernel registered for host stub `host`
 * (or whose handle is `handle`) into name; 0 when there is none. Under
 * k_mu: a module may be unregistered (dlclose, exit) meanwhile. */
static kfunc_t *kfunc_find_locked(const void *host, const void *handle) {
  kfunc_t *f = k_funcs;
  while (f && f->host != host && (void *)f != handle)
    f = f->next;
  return f;
}

static int kfunc_name(const void *host, const void *handle, char *name,
                      size_t cap) {
  pthread_mutex_lock(&k_mu);
  kfunc_t *f = kfunc_find_locked(host, handle);
  if (f)
    snprintf(name, cap, "%s", f->name);
  pthread_mutex_unlock(&k_mu);
  return f != NULL;
}

EXPORT int cudasim_register_kernel(const cudasim_kernel_emu_t *emu) {
  if (!emu || !emu->name || !emu->thread || !emu->spans || emu->nparams < 0 ||
      emu->nparams > CUDASIM_KERNEL_MAX_PARAMS)
    return EINVAL;
  for (int i = 0; i < emu->nparams; i++)
    if (emu->param_size[i] == 0)
      return EINVAL;
  pthread_mutex_lock(&k_mu);
  kemu_reg_t *r = k_emus;
  while (r && strcmp(r->emu->name, emu->name) != 0)
    r = r->next;
  if (!r) {
    r = xcalloc(1, sizeof *r);
    r->next = k_emus;
    k_emus = r;
  }
  r->emu = emu;
  pthread_mutex_unlock(&k_mu);
  return 0;
}

static const cudasim_kernel_emu_t *kemu_find(const char *name) {
  pthread_mutex_lock(&k_mu);
  kemu_reg_t *r = k_emus;
  while (r && strcmp(r->emu->name, name) != 0)
    r = r->next;
  pthread_mutex_unlock(&k_mu);
  return r ? r->emu : NULL;
}

EXPORT cudaError_t __cudaGetKernel(cudaKernel_t *out, const void *hostFun) {
  ensure_init();
  pthread_mutex_lock(&k_mu);
  kfunc_t *f = hostFun ? kfunc_find_locked(hostFun, NULL) : NULL;
  pthread_mutex_unlock(&k_mu);
  if (!out || !f)
    return fail(cudaErrorInvalidDeviceFunction);
  *out = (cudaKernel_t)f;
  return cudaSuccess;
}

EXPORT unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim,
                                            size_t sharedMem,
                                            struct CUstream_st *stream) {
  if (t_nkconf == (int)(sizeof t_kconf / sizeof t_kconf[0]))
    return 1;
  t_kconf[t_nkconf++] = (kconf_t){gridDim, blockDim, sharedMem, stream};
  return 0;
}

EXPORT cudaError_t __cudaPopCallConfiguration(dim3 *gridDim, dim3 *blockDim,
                                              size_t *sharedMem, void *stream) {
  if (t_nkconf == 0)
    return fail(cudaErrorMissingConfiguration);
  kconf_t c = t_kconf[--t_nkconf];
  *gridDim = c.grid;
  *blockDim = c.block;
  *sharedMem = c.shmem;
  *(cudaStream_t *)stream = c.stream;
  return cudaSuccess;
}

static cudaError_t launch_common(const char *kname, dim3 grid, dim3 block,
                                 void **args, size_t shmem, cudaStream_t h,
                                 const char *api) {
  NEED_CTX();
  if (!kname)
    return fail(cudaErrorInvalidDeviceFunction);
  unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu ||
      grid.y > 65535 || grid.z > 65535 || threads == 0 || threads > 1024 ||
      block.x > 1024 || block.y > 1024 || block.z > 64)
    return fail(cudaErrorInvalidConfiguration);
  if (shmem > 48 * 1024)
    return fail(cudaErrorInvalidValue);
  const cudasim_kernel_emu_t *emu = kemu_find(kname);
  if (!emu) {
    fprintf(stderr,
            "cudasim: %s(%s): no CPU emulation of this kernel is registered "
            "(cudasim_register_kernel); the stand-in cannot run device code\n",
            api, kname);
    return fail(cudaErrorNoKernelImageForDevice);
  }
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    misuse("%s(%s): grid %ux%ux%u, block %ux%ux%u: the stand-in emulates 1-D "
           "launches only",
           api, kname, grid.x, grid.y, grid.z, block.x, block.y, block.z);
    return fail(cudaErrorNotSupported);
  }
  if (emu->nparams > 0 && !args)
    return fail(cudaErrorInvalidValue);
  op_t *op = op_new(OP_KERNEL, api);
  op->kemu = emu;
  op->kthreads = (unsigned long long)grid.x * block.x;
  size_t off = 0;
  for (int i = 0; i < emu->nparams; i++) {
    op->koff[i] = off;
    off += (emu->param_size[i] + 15) & ~(size_t)15;
  }
  op->kargs_bytes = off;
  op->kargs = xcalloc(1, off ? off : 1);
  void *copied[CUDASIM_KERNEL_MAX_PARAMS];
  for (int i = 0; i < emu->nparams; i++) {
    memcpy(op->kargs + op->koff[i], args[i], emu->param_size[i]);
    copied[i] = op->kargs + op->koff[i];
  }
  int n = emu->spans(copied, op->kspans, CUDASIM_KERNEL_MAX_PARAMS);
  if (n < 0 || n > CUDASIM_KERNEL_MAX_PARAMS) {
    misuse("%s(%s): the emulation's spans() answered %d (0 to %d)", api, kname,
           n, CUDASIM_KERNEL_MAX_PARAMS);
    op_free(op);
    return fail(cudaErrorInvalidValue);
  }
  op->nkspans = n;
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(h, &s, api);
  for (int i = 0; !e && i < n; i++) {
    const cudasim_kernel_span_t *sp = &op->kspans[i];
    if (sp->param < 0 || sp->param >= emu->nparams ||
        emu->param_size[sp->param] != sizeof(void *)) {
      pthread_mutex_unlock(&g.mu);
      misuse("%s(%s): the emulation names parameter %d as a pointer", api,
             kname, sp->param);
      op_free(op);
      return fail(cudaErrorInvalidValue);
    }
    void *p;
    memcpy(&p, op->kargs + op->koff[sp->param], sizeof p);
    op->kptr[i] = (uintptr_t)p;
    if (sp->bytes == 0)
      continue;
    int dev = -1;
    if (!shadow_of((uintptr_t)p, sp->bytes, &dev) || dev != s->dev) {
      pthread_mutex_unlock(&g.mu);
      misuse("%s(%s): parameter %d, %p, does not hold the %zu bytes the "
             "kernel touches in one live allocation of the stream's device "
             "%d (%s); a GPU would fault (cudaErrorIllegalAddress)",
             api, kname, sp->param, p, sp->bytes, s->dev,
             dev < 0 ? "not device memory, freed, or overrun"
                     : "memory of another device");
      op_free(op);
      return fail(cudaErrorIllegalAddress);
    }
  }
  if (e) {
    pthread_mutex_unlock(&g.mu);
    op_free(op);
    return fail(e);
  }
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(kernel_launches, 1);
  return cudaSuccess;
}

/* The two launch entry points: by the handle __cudaGetKernel gave (what
 * nvcc's <<<>>> calls in CUDA 13) or by the host stub. */
static cudaError_t launch_by(const void *host, const void *handle, dim3 grid,
                             dim3 block, void **args, size_t shmem,
                             cudaStream_t stream) {
  char name[256];
  int found = (host != NULL || handle != NULL) &&
              kfunc_name(host, handle, name, sizeof name);
  return launch_common(found ? name : NULL, grid, block, args, shmem, stream,
                       "cudaLaunchKernel");
}

EXPORT cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim,
                                      dim3 blockDim, void **args,
                                      size_t sharedMem, cudaStream_t stream) {
  ENTER("cudaLaunchKernel");
  return launch_by(NULL, kernel, gridDim, blockDim, args, sharedMem, stream);
}

EXPORT cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim,
                                    dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream) {
  ENTER("cudaLaunchKernel");
  return launch_by(func, NULL, gridDim, blockDim, args, sharedMem, stream);
}
