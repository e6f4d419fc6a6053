/* cudasim: cudaMemcpy* and cudaMemset*, checked against their kind,
 * the live allocations and the stream's device. */
#include "cudart_internal.h"

/* ---- copies and memsets -----------------------------------------------------
 */

enum { MEM_HOST, MEM_PINNED, MEM_DEVICE, MEM_STALE };

/* What [p, p+bytes) is: device memory in one live allocation (device in
 * *dev), a device address outside one (stale: freed or overrun), pinned host
 * memory, or pageable host memory. g.mu held. */
static int classify_locked(const void *p, size_t bytes, int *dev) {
  *dev = device_of_addr((uintptr_t)p);
  if (*dev >= 0)
    return shadow_of((uintptr_t)p, bytes, NULL) ? MEM_DEVICE : MEM_STALE;
  return host_pinned((uintptr_t)p, bytes) ? MEM_PINNED : MEM_HOST;
}

static const char *kind_name(int k) {
  static const char *names[] = {"HostToHost", "HostToDevice", "DeviceToHost",
                                "DeviceToDevice", "Default"};
  return k >= 0 && k <= 4 ? names[k] : "?";
}

/* The one copy path. sync: cudaMemcpy (waits, except for a pageable H2D,
 * which returns once staged, and D2D, which never waits); async: waits only
 * where CUDA's API sync behaviour says so (D2H into pageable memory and
 * host-to-host copies). */
static cudaError_t copy_common(void *dst, const void *src, size_t bytes,
                               enum cudaMemcpyKind kind, cudaStream_t h,
                               const char *api, int sync) {
  if ((int)kind < 0 || (int)kind > cudaMemcpyDefault)
    return fail(cudaErrorInvalidMemcpyDirection);
  if (bytes == 0)
    return cudaSuccess;
  if (!dst || !src) {
    misuse("%s: NULL %s with %zu bytes", api, dst ? "source" : "destination",
           bytes);
    return fail(cudaErrorInvalidValue);
  }
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(h, &s, api);
  if (e) {
    pthread_mutex_unlock(&g.mu);
    return fail(e);
  }
  int ddev, sdev;
  int dc = classify_locked(dst, bytes, &ddev);
  int sc = classify_locked(src, bytes, &sdev);
  const char *why = NULL;
  int inferred = (sc == MEM_DEVICE ? 2 : 0) + (dc == MEM_DEVICE ? 1 : 0);
  static const int kinds[4] = {cudaMemcpyHostToHost, cudaMemcpyHostToDevice,
                               cudaMemcpyDeviceToHost,
                               cudaMemcpyDeviceToDevice};
  if (dc == MEM_STALE || sc == MEM_STALE)
    why = "range not inside one live device allocation (use after free or "
          "overrun)";
  else if (kind != cudaMemcpyDefault && (int)kind != kinds[inferred])
    why = "kind does not match the pointers";
  else if ((sc == MEM_DEVICE && sdev != s->dev) ||
           (dc == MEM_DEVICE && ddev != s->dev))
    why = "device memory of another device than the stream's";
  if (why) {
    pthread_mutex_unlock(&g.mu);
    misuse("%s(dst %p, src %p, %zu bytes, %s): %s (dst is %s, src is %s)", api,
           dst, src, bytes, kind_name((int)kind), why,
           dc == MEM_DEVICE  ? "device"
           : dc == MEM_STALE ? "stale device"
                             : "host",
           sc == MEM_DEVICE  ? "device"
           : sc == MEM_STALE ? "stale device"
                             : "host");
    return fail(cudaErrorInvalidValue);
  }
  kind = (enum cudaMemcpyKind)kinds[inferred];
  op_t *op = op_new(OP_COPY, api);
  op->dst = dst;
  op->src = src;
  op->bytes = bytes;
  op->dst_dev = dc == MEM_DEVICE ? ddev : -1;
  op->src_dev = sc == MEM_DEVICE ? sdev : -1;
  op->dst_pinned = dc == MEM_PINNED;
  op->src_pinned = sc == MEM_PINNED;
  int capturing = s->cap != NULL;
  int pageable_h2d = kind == cudaMemcpyHostToDevice && sc == MEM_HOST;
  /* A pageable source is staged at the call: the caller may reuse it once
   * the call returned (the DMA itself is still asynchronous). */
  if (pageable_h2d && !capturing) {
    op->staging = malloc(bytes);
    if (!op->staging)
      abort();
    memcpy(op->staging, src, bytes);
  }
  int wait = !capturing &&
             ((kind == cudaMemcpyDeviceToHost && dc == MEM_HOST) ||
              kind == cudaMemcpyHostToHost ||
              (sync && !pageable_h2d && kind != cudaMemcpyDeviceToDevice));
  marker_t *m = NULL;
  if (wait)
    m = marker_ref(op->marker = marker_new());
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  STAT_ADD(copies, 1);
  STAT_ADD(copy_bytes, bytes);
  if (m) {
    marker_wait(m);
    marker_unref(m);
  }
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                   enum cudaMemcpyKind kind,
                                   cudaStream_t stream) {
  ENTER("cudaMemcpyAsync");
  NEED_CTX();
  return copy_common(dst, src, count, kind, stream, "cudaMemcpyAsync", 0);
}

EXPORT cudaError_t cudaMemcpy(void *dst, const void *src, size_t count,
                              enum cudaMemcpyKind kind) {
  ENTER("cudaMemcpy");
  NEED_CTX();
  return copy_common(dst, src, count, kind, NULL, "cudaMemcpy", 1);
}

/* Memsets of device memory never wait, cudaMemset included (CUDA: they are
 * asynchronous unless the target is pinned host memory). */
static cudaError_t memset_common(void *dst, int value, size_t bytes,
                                 cudaStream_t h, const char *api) {
  if (bytes == 0)
    return cudaSuccess;
  pthread_mutex_lock(&g.mu);
  cstream_t *s;
  int e = stream_get_locked(h, &s, api);
  if (e) {
    pthread_mutex_unlock(&g.mu);
    return fail(e);
  }
  int dev;
  int c = classify_locked(dst, bytes, &dev);
  if (c != MEM_DEVICE || dev != s->dev) {
    pthread_mutex_unlock(&g.mu);
    misuse("%s(%p, %zu bytes): %s", api, dst, bytes,
           c == MEM_DEVICE ? "device memory of another device than the stream's"
           : c == MEM_STALE
               ? "not inside one live device allocation (use after "
                 "free or overrun)"
               : "not device memory");
    return fail(cudaErrorInvalidValue);
  }
  op_t *op = op_new(OP_MEMSET, api);
  op->dst = dst;
  op->dst_dev = dev;
  op->value = value;
  op->bytes = bytes;
  push_locked(s, op);
  pthread_mutex_unlock(&g.mu);
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count,
                                   cudaStream_t stream) {
  ENTER("cudaMemsetAsync");
  NEED_CTX();
  return memset_common(devPtr, value, count, stream, "cudaMemsetAsync");
}

EXPORT cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
  ENTER("cudaMemset");
  NEED_CTX();
  return memset_common(devPtr, value, count, NULL, "cudaMemset");
}
