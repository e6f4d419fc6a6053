/* cudasim: device memory (PROT_NONE ranges read through a shadow
 * mapping), pinned host ranges, and their API. */
#include "cudart_internal.h"

/* ---- device memory --------------------------------------------------------
 */

/* Reserves the device's address range: PROT_NONE so that the CPU faults on
 * device memory, plus a shadow the stand-in itself uses. Twice the capacity
 * so that freed addresses are not reused soon; smaller where the address
 * space is limited (valgrind), down to 256 MiB. */
static int device_reserve(device_t *d) {
  if (d->base)
    return 0;
  size_t range = d->capacity * 2;
  const size_t min_range = (size_t)256 << 20;
  if (range < min_range)
    range = min_range;
  range = (range + 4095) & ~(size_t)4095;
  for (; range >= min_range; range = (range / 2 + 4095) & ~(size_t)4095) {
    int fl = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void *b = mmap(NULL, range, PROT_NONE, fl, -1, 0);
    if (b == MAP_FAILED)
      continue;
    void *s = mmap(NULL, range, PROT_READ | PROT_WRITE, fl, -1, 0);
    if (s == MAP_FAILED) {
      munmap(b, range);
      continue;
    }
    d->base = b;
    d->shadow = s;
    d->range = range;
    return 0;
  }
  return -1;
}

/* Index of the first allocation whose start is > p (binary search). */
static int alloc_upper(const device_t *d, uintptr_t p) {
  int lo = 0, hi = d->nallocs;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (d->allocs[mid].start <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The device whose range holds p, or -1. g.mu held. */
int device_of_addr(uintptr_t p) {
  for (int i = 0; i < g.ndev; i++) {
    device_t *d = &g.dev[i];
    if (d->base && p >= (uintptr_t)d->base && p < (uintptr_t)d->base + d->range)
      return i;
  }
  return -1;
}

/* The live allocation holding p (NULL: none). g.mu held. */
alloc_t *alloc_find(int dev, uintptr_t p) {
  device_t *d = &g.dev[dev];
  int i = alloc_upper(d, p) - 1;
  if (i >= 0 && p < d->allocs[i].start + d->allocs[i].size)
    return &d->allocs[i];
  return NULL;
}

/* Bump allocation so that freed addresses are not reused soon (a stale
 * pointer then faults or is reported); first fit once the range is used. */
static uintptr_t alloc_place(device_t *d, size_t size) {
  if (d->bump + size <= d->range)
    return (uintptr_t)d->base + (d->bump += size) - size;
  uintptr_t prev = (uintptr_t)d->base;
  for (int i = 0; i <= d->nallocs; i++) {
    uintptr_t next =
        i < d->nallocs ? d->allocs[i].start : (uintptr_t)d->base + d->range;
    if (next - prev >= size)
      return prev;
    if (i < d->nallocs)
      prev = d->allocs[i].start + d->allocs[i].size;
  }
  return 0;
}

static int device_alloc(int dev, size_t bytes, void **out) {
  device_t *d = &g.dev[dev];
  size_t size = (bytes + ALIGN_DEV - 1) & ~(size_t)(ALIGN_DEV - 1);
  if (size == 0)
    size = ALIGN_DEV;
  pthread_mutex_lock(&g.mu);
  int e = cudaErrorMemoryAllocation;
  uintptr_t p = 0;
  if (device_reserve(d) == 0 && d->used + size <= d->capacity &&
      (p = alloc_place(d, size)) != 0) {
    if (d->nallocs == d->cap_allocs) {
      d->cap_allocs = d->cap_allocs ? d->cap_allocs * 2 : 64;
      d->allocs = realloc(d->allocs, (size_t)d->cap_allocs * sizeof *d->allocs);
      if (!d->allocs)
        abort();
    }
    int i = alloc_upper(d, p);
    memmove(&d->allocs[i + 1], &d->allocs[i],
            (size_t)(d->nallocs - i) * sizeof *d->allocs);
    d->allocs[i] = (alloc_t){p, size};
    d->nallocs++;
    d->used += size;
    A_STORE(&g.stats.device_bytes_in_use[dev], (uint64_t)d->used);
    *out = (void *)p;
    e = cudaSuccess;
  }
  pthread_mutex_unlock(&g.mu);
  return e;
}

/* Removes the allocation starting at p. g.mu held. Returns 0 or -1. */
int device_release(int dev, uintptr_t p) {
  device_t *d = &g.dev[dev];
  int i = alloc_upper(d, p) - 1;
  if (i < 0 || d->allocs[i].start != p)
    return -1;
  size_t size = d->allocs[i].size;
  /* The contents die with the allocation: a reuse reads zeros. */
  madvise(d->shadow + (p - (uintptr_t)d->base), size, MADV_DONTNEED);
  memmove(&d->allocs[i], &d->allocs[i + 1],
          (size_t)(d->nallocs - i - 1) * sizeof *d->allocs);
  d->nallocs--;
  d->used -= size;
  A_STORE(&g.stats.device_bytes_in_use[dev], (uint64_t)d->used);
  return 0;
}

/* Shadow of [p, p+bytes) if it lies in one live allocation. g.mu held. */
char *shadow_of(uintptr_t p, size_t bytes, int *dev_out) {
  int dev = device_of_addr(p);
  if (dev < 0)
    return NULL;
  alloc_t *a = alloc_find(dev, p);
  if (!a || p + bytes > a->start + a->size)
    return NULL;
  if (dev_out)
    *dev_out = dev;
  return g.dev[dev].shadow + (p - (uintptr_t)g.dev[dev].base);
}

/* ---- pinned host ranges -------------------------------------------------- */

static int host_upper(uintptr_t p) {
  int lo = 0, hi = g.nhosts;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (g.hosts[mid].start <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The pinned range holding p (NULL: pageable). g.mu held. */
static host_range_t *host_find(uintptr_t p) {
  int i = host_upper(p) - 1;
  if (i >= 0 && p < g.hosts[i].start + g.hosts[i].size)
    return &g.hosts[i];
  return NULL;
}

static int host_overlaps(uintptr_t p, size_t size) {
  int i = host_upper(p);
  if (i > 0 &&
      ranges_overlap(g.hosts[i - 1].start, g.hosts[i - 1].size, p, size))
    return 1;
  return i < g.nhosts &&
         ranges_overlap(g.hosts[i].start, g.hosts[i].size, p, size);
}

static void host_insert(uintptr_t p, size_t size, int kind, int dev) {
  if (g.nhosts == g.cap_hosts) {
    g.cap_hosts = g.cap_hosts ? g.cap_hosts * 2 : 64;
    g.hosts = realloc(g.hosts, (size_t)g.cap_hosts * sizeof *g.hosts);
    if (!g.hosts)
      abort();
  }
  int i = host_upper(p);
  memmove(&g.hosts[i + 1], &g.hosts[i],
          (size_t)(g.nhosts - i) * sizeof *g.hosts);
  g.hosts[i] = (host_range_t){p, size, kind, dev};
  g.nhosts++;
}

static void host_remove(host_range_t *h) {
  int i = (int)(h - g.hosts);
  memmove(&g.hosts[i], &g.hosts[i + 1],
          (size_t)(g.nhosts - i - 1) * sizeof *g.hosts);
  g.nhosts--;
}

/* Whether all of [p, p+bytes) is pinned. g.mu held. */
int host_pinned(uintptr_t p, size_t bytes) {
  host_range_t *h = host_find(p);
  return h && p + bytes <= h->start + h->size;
}

/* ---- device memory API ----------------------------------------------------
 */

EXPORT cudaError_t cudaMalloc(void **devPtr, size_t size) {
  ENTER("cudaMalloc");
  NEED_CTX();
  if (!devPtr)
    return fail(cudaErrorInvalidValue);
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  if (size == 0) {
    *devPtr = NULL;
    return cudaSuccess;
  }
  void *p;
  e = device_alloc(t_dev, size, &p);
  if (e)
    return fail(e); /* out of memory is an answer, not misuse */
  STAT_ADD(device_mallocs, 1);
  *devPtr = p;
  return cudaSuccess;
}

/* Finds the allocation starting at p: its device, or -1. g.mu held. */
int alloc_start_locked(const void *p, size_t *size) {
  int dev = device_of_addr((uintptr_t)p);
  alloc_t *a = dev >= 0 ? alloc_find(dev, (uintptr_t)p) : NULL;
  if (!a || a->start != (uintptr_t)p)
    return -1;
  *size = a->size;
  return dev;
}

EXPORT cudaError_t cudaFree(void *devPtr) {
  ENTER("cudaFree");
  NEED_CTX();
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  if (!devPtr)
    return cudaSuccess;
  size_t size = 0;
  pthread_mutex_lock(&g.mu);
  int dev = alloc_start_locked(devPtr, &size);
  int busy = dev >= 0 && busy_locked((uintptr_t)devPtr, size);
  pthread_mutex_unlock(&g.mu);
  if (dev < 0) {
    misuse("cudaFree(%p): not the start of a live device allocation (double "
           "free or foreign pointer)",
           devPtr);
    return fail(cudaErrorInvalidValue);
  }
  if (busy)
    misuse("cudaFree(%p): queued work still uses this memory (free it after "
           "the work's event completed)",
           devPtr);
  /* cudaFree synchronizes the device, as the real one does (all of them
   * after a misuse, so that count mode does not free memory in use). */
  STAT_ADD(implicit_syncs, 1);
  sync_device(busy ? -1 : dev);
  pthread_mutex_lock(&g.mu);
  int r = device_release(dev, (uintptr_t)devPtr);
  pthread_mutex_unlock(&g.mu);
  if (r != 0) {
    misuse("cudaFree(%p): freed twice concurrently", devPtr);
    return fail(cudaErrorInvalidValue);
  }
  STAT_ADD(device_frees, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMallocAsync(void **devPtr, size_t size,
                                   cudaStream_t hStream) {
  ENTER("cudaMallocAsync");
  NEED_CTX();
  if (!devPtr)
    return fail(cudaErrorInvalidValue);
  cstream_t *s; /* (captured allocation nodes are not modelled) */
  int e = stream_get_uncaptured(hStream, &s, "cudaMallocAsync");
  if (e)
    return fail(e);
  void *p = NULL;
  if (size && (e = device_alloc(s->dev, size, &p)) != 0)
    return fail(e);
  STAT_ADD(device_mallocs, 1);
  *devPtr = p;
  return cudaSuccess;
}

/* Stream-ordered free: the allocation dies when the stream reaches it. */
EXPORT cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream) {
  ENTER("cudaFreeAsync");
  NEED_CTX();
  cstream_t *s;
  int e = stream_get(hStream, &s, "cudaFreeAsync");
  if (e)
    return fail(e);
  if (!devPtr)
    return cudaSuccess;
  size_t size;
  pthread_mutex_lock(&g.mu);
  int dev = alloc_start_locked(devPtr, &size);
  if (dev < 0 || dev != s->dev) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaFreeAsync(%p): %s", devPtr,
           dev < 0 ? "not the start of a live device allocation"
                   : "memory of another device than the stream's");
    return fail(cudaErrorInvalidValue);
  }
  if (s->cap) {
    s->cap->invalidated = 1;
    pthread_mutex_unlock(&g.mu);
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  for (cstream_t *t = g.streams; t; t = t->next_all) {
    pthread_mutex_lock(&t->mu);
    for (op_t *op = t->head; op; op = op->next)
      if (op->kind == OP_FREE && op->dst == devPtr)
        e = 1;
    pthread_mutex_unlock(&t->mu);
  }
  if (e) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaFreeAsync(%p): already freed by a queued cudaFreeAsync",
           devPtr);
    return fail(cudaErrorInvalidValue);
  }
  op_t *op = op_new(OP_FREE, "cudaFreeAsync");
  op->dst = devPtr;
  op->dst_dev = dev;
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(device_frees, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  ENTER("cudaMemGetInfo");
  NEED_CTX();
  if (!free_bytes || !total)
    return fail(cudaErrorInvalidValue);
  pthread_mutex_lock(&g.mu);
  *total = g.dev[t_dev].capacity;
  *free_bytes = g.dev[t_dev].capacity - g.dev[t_dev].used;
  pthread_mutex_unlock(&g.mu);
  return cudaSuccess;
}

/* ---- pinned host memory API -----------------------------------------------
 */

EXPORT cudaError_t cudaHostAlloc(void **pHost, size_t size,
                                 unsigned int flags) {
  ENTER("cudaHostAlloc");
  NEED_CTX();
  if (!pHost || flags > 0xf)
    return fail(cudaErrorInvalidValue);
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  void *p = NULL;
  if (posix_memalign(&p, 4096, size ? size : 1) != 0)
    return fail(cudaErrorMemoryAllocation);
  pthread_mutex_lock(&g.mu);
  host_insert((uintptr_t)p, size ? size : 1, HOST_ALLOC, t_dev);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(host_allocs, 1);
  *pHost = p;
  return cudaSuccess;
}

EXPORT cudaError_t cudaMallocHost(void **ptr, size_t size) {
  return cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

/* Shared by cudaFreeHost and cudaHostUnregister: the range must be of `kind`
 * and start at p; queued work that still uses it is misuse; the call
 * synchronizes (as the real one does) and forgets the range. */
static int host_release(void *p, int kind, const char *api, int not_found) {
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return e;
  pthread_mutex_lock(&g.mu);
  host_range_t *h = host_find((uintptr_t)p);
  int ok = h && h->start == (uintptr_t)p && h->kind == kind;
  size_t size = ok ? h->size : 0;
  int busy = ok && busy_locked((uintptr_t)p, size);
  pthread_mutex_unlock(&g.mu);
  if (!ok) {
    misuse("%s(%p): not %s", api, p,
           kind == HOST_ALLOC ? "a cudaMallocHost/cudaHostAlloc block"
                              : "the start of a cudaHostRegister'ed range");
    return not_found;
  }
  if (busy)
    misuse("%s(%p): queued work still uses this memory", api, p);
  /* The real call synchronizes the current device only; after a misuse all
   * of them, so that count mode does not free memory a copy is using. */
  STAT_ADD(implicit_syncs, 1);
  sync_device(busy ? -1 : t_dev);
  pthread_mutex_lock(&g.mu);
  h = host_find((uintptr_t)p);
  ok = h && h->start == (uintptr_t)p && h->kind == kind;
  if (ok)
    host_remove(h);
  pthread_mutex_unlock(&g.mu);
  if (!ok) {
    misuse("%s(%p): released twice concurrently", api, p);
    return not_found;
  }
  return cudaSuccess;
}

EXPORT cudaError_t cudaFreeHost(void *ptr) {
  ENTER("cudaFreeHost");
  NEED_CTX();
  if (!ptr)
    return cudaSuccess;
  int e = host_release(ptr, HOST_ALLOC, "cudaFreeHost", cudaErrorInvalidValue);
  if (e)
    return fail(e);
  free(ptr);
  STAT_ADD(host_frees, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaHostRegister(void *ptr, size_t size,
                                    unsigned int flags) {
  ENTER("cudaHostRegister");
  NEED_CTX();
  if (!ptr || !size || flags > 0xf)
    return fail(cudaErrorInvalidValue);
  int e = capture_forbids(cudaErrorStreamCaptureUnsupported);
  if (e)
    return fail(e);
  pthread_mutex_lock(&g.mu);
  if (device_of_addr((uintptr_t)ptr) >= 0) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaHostRegister(%p): device memory", ptr);
    return fail(cudaErrorInvalidValue);
  }
  if (host_overlaps((uintptr_t)ptr, size)) {
    pthread_mutex_unlock(&g.mu);
    misuse("cudaHostRegister(%p, %zu): overlaps pinned or registered memory",
           ptr, size);
    return fail(cudaErrorHostMemoryAlreadyRegistered);
  }
  host_insert((uintptr_t)ptr, size, HOST_REGISTERED, t_dev);
  pthread_mutex_unlock(&g.mu);
  /* Counted as the synchronizing call it is on a GPU; not waited for, so
   * that work racing with it is not hidden. */
  STAT_ADD(implicit_syncs, 1);
  STAT_ADD(host_registers, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaHostUnregister(void *ptr) {
  ENTER("cudaHostUnregister");
  NEED_CTX();
  int e = host_release(ptr, HOST_REGISTERED, "cudaHostUnregister",
                       cudaErrorHostMemoryNotRegistered);
  if (e)
    return fail(e);
  STAT_ADD(host_unregisters, 1);
  return cudaSuccess;
}

EXPORT cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attr,
                                            const void *ptr) {
  ENTER("cudaPointerGetAttributes");
  if (!attr)
    return fail(cudaErrorInvalidValue);
  memset(attr, 0, sizeof *attr);
  attr->type = cudaMemoryTypeUnregistered;
  attr->device = -2;
  pthread_mutex_lock(&g.mu);
  int dev = device_of_addr((uintptr_t)ptr);
  host_range_t *h;
  if (dev >= 0 && alloc_find(dev, (uintptr_t)ptr)) {
    attr->type = cudaMemoryTypeDevice;
    attr->device = dev;
    attr->devicePointer = (void *)ptr;
  } else if (dev < 0 && (h = host_find((uintptr_t)ptr)) != NULL) {
    attr->type = cudaMemoryTypeHost;
    attr->device = h->dev;
    attr->devicePointer = (void *)ptr;
    attr->hostPointer = (void *)ptr;
  }
  pthread_mutex_unlock(&g.mu);
  return cudaSuccess;
}
