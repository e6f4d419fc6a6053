/* ofl: the host backend's memory: device and pinned blocks in a sorted
 * registry, the device capacity, the inflight counts that queued
 * operations hold on their blocks, and the checks of a copy's ranges. */
#include <stdlib.h>
#include <string.h>

#include "runtime/host.h"

#define DEVICE_ALIGN 256
#define PINNED_ALIGN 4096

struct hblock {
  char *base;
  size_t bytes;
  bool pinned;
  /* Queued or running operations that use the block: raised under
   * reg_lock (so the block cannot leave the registry meanwhile), lowered
   * without it when an operation finishes. */
  _Atomic size_t inflight;
};

ofl_status_t ofl__host_registry_open(ofl_device_t *dev) {
  host_dev_t *h = calloc(1, sizeof *h);
  if (h == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate the host backend");
  pthread_mutex_init(&h->reg_lock, NULL);
  ofl__host_cond_init(&h->reg_cond);
  dev->impl = h;
  return OFL_SUCCESS;
}

void ofl__host_registry_close(ofl_device_t *dev) {
  host_dev_t *h = HD(dev);
  if (h->nblocks > 0)
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "device close: %zu block(s) still allocated; "
             "released now",
             h->nblocks);
  for (size_t i = 0; i < h->nblocks; i++) {
    free(h->blocks[i]->base);
    free(h->blocks[i]);
  }
  free(h->blocks);
  pthread_mutex_destroy(&h->reg_lock);
  pthread_cond_destroy(&h->reg_cond);
  free(h);
  dev->impl = NULL;
}

/* The block containing p, or NULL. Caller holds reg_lock. */
static hblock_t *find_block(host_dev_t *h, const void *p) {
  const char *c = p;
  size_t lo = 0, hi = h->nblocks;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (h->blocks[mid]->base <= c)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return NULL;
  hblock_t *b = h->blocks[lo - 1];
  return c < b->base + b->bytes ? b : NULL;
}

static ofl_status_t insert_block(host_dev_t *h, hblock_t *b) {
  pthread_mutex_lock(&h->reg_lock);
  if (h->nblocks == h->cap) {
    size_t ncap = h->cap ? h->cap * 2 : 64;
    hblock_t **nb = realloc(h->blocks, ncap * sizeof *nb);
    if (nb == NULL) {
      pthread_mutex_unlock(&h->reg_lock);
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                        "cannot grow the host backend block registry");
    }
    h->blocks = nb;
    h->cap = ncap;
  }
  size_t i = h->nblocks;
  while (i > 0 && h->blocks[i - 1]->base > b->base) {
    h->blocks[i] = h->blocks[i - 1];
    i--;
  }
  h->blocks[i] = b;
  h->nblocks++;
  pthread_mutex_unlock(&h->reg_lock);
  return OFL_SUCCESS;
}

static void remove_block_locked(host_dev_t *h, hblock_t *b) {
  for (size_t i = 0; i < h->nblocks; i++)
    if (h->blocks[i] == b) {
      memmove(&h->blocks[i], &h->blocks[i + 1],
              (h->nblocks - i - 1) * sizeof *h->blocks);
      h->nblocks--;
      return;
    }
}

static ofl_status_t block_alloc(ofl_device_t *dev, size_t bytes, bool pinned,
                                void **out) {
  host_dev_t *h = HD(dev);
  if (!pinned) {
    size_t cap = dev->cfg.capacity_bytes;
    size_t used = atomic_load(&h->device_reserved);
    do {
      if (cap != 0 && (used > cap || bytes > cap - used))
        return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                          "device memory exhausted: %zu bytes requested, %zu "
                          "of %zu in use; offload more or raise "
                          "OFL_DEVICE_CAPACITY",
                          bytes, used, cap);
    } while (!atomic_compare_exchange_weak(&h->device_reserved, &used,
                                           used + bytes));
  }
  hblock_t *b = calloc(1, sizeof *b);
  void *mem = NULL;
  size_t align = pinned ? PINNED_ALIGN : DEVICE_ALIGN;
  size_t rounded = (bytes + align - 1) / align * align;
  if (b == NULL || posix_memalign(&mem, align, rounded) != 0) {
    free(b);
    if (!pinned)
      atomic_fetch_sub(&h->device_reserved, bytes);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "host backend cannot allocate %zu bytes of %s memory",
                      bytes, pinned ? "pinned" : "device");
  }
  b->base = mem;
  b->bytes = bytes;
  b->pinned = pinned;
  if (dev->cfg.strict)
    memset(mem, OFL__POISON_BYTE, rounded); /* uninitialised reads show */
  ofl_status_t st = insert_block(h, b);
  if (st != OFL_SUCCESS) {
    free(mem);
    free(b);
    if (!pinned)
      atomic_fetch_sub(&h->device_reserved, bytes);
    return st;
  }
  *out = mem;
  return OFL_SUCCESS;
}

static ofl_status_t block_free(ofl_device_t *dev, void *ptr, bool pinned,
                               size_t *bytes) {
  host_dev_t *h = HD(dev);
  const char *what = pinned ? "pinned" : "device";
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, ptr);
  if (b == NULL || b->base != (char *)ptr || b->pinned != pinned) {
    pthread_mutex_unlock(&h->reg_lock);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "%p is not the start of a %s block of this device "
                      "(freed twice, foreign, or freed with the wrong "
                      "function)",
                      ptr, what);
  }
  size_t n = atomic_load(&b->inflight);
  if (n > 0 && dev->cfg.strict) {
    pthread_mutex_unlock(&h->reg_lock);
    pthread_mutex_lock(&dev->stats_lock);
    dev->stats.strict_violations++;
    pthread_mutex_unlock(&dev->stats_lock);
    return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_DEVICE,
                      "%s block %p (%zu bytes) freed while %zu queued "
                      "operation(s) still use it; synchronize the stream or "
                      "wait on an event recorded after them first",
                      what, ptr, b->bytes, n);
  }
  /* Outside strict mode a free waits for the queued users, as cudaFree
   * synchronizes the device. */
  uint64_t deadline = n > 0 ? ofl__deadline_ns(-1) : 0;
  /* Announced before the count is read again: an op that lowers it to 0
   * then sees the waiter and wakes it (both sequentially consistent). */
  atomic_fetch_add(&h->free_waiters, 1);
  while (atomic_load(&b->inflight) > 0) {
    uint64_t now = ofl__now_ns();
    if (now > deadline) {
      atomic_fetch_sub(&h->free_waiters, 1);
      pthread_mutex_unlock(&h->reg_lock);
      return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_DEVICE,
                        "%s block %p: queued operations did not finish "
                        "before OFL_WAIT_TIMEOUT_MS; not freed",
                        what, ptr);
    }
    ofl__host_cond_wait_until(&h->reg_cond, &h->reg_lock, now, deadline);
  }
  atomic_fetch_sub(&h->free_waiters, 1);
  remove_block_locked(h, b);
  pthread_mutex_unlock(&h->reg_lock);
  if (dev->cfg.strict)
    memset(b->base, OFL__POISON_BYTE, b->bytes);
  *bytes = b->bytes;
  if (!pinned)
    atomic_fetch_sub(&h->device_reserved, b->bytes);
  free(b->base);
  free(b);
  return OFL_SUCCESS;
}

ofl_status_t ofl__host_device_malloc(ofl_device_t *dev, size_t bytes,
                                     void **out) {
  return block_alloc(dev, bytes, false, out);
}
ofl_status_t ofl__host_device_free(ofl_device_t *dev, void *ptr,
                                   size_t *bytes) {
  return block_free(dev, ptr, false, bytes);
}
ofl_status_t ofl__host_pinned_malloc(ofl_device_t *dev, size_t bytes,
                                     void **out) {
  return block_alloc(dev, bytes, true, out);
}
ofl_status_t ofl__host_pinned_free(ofl_device_t *dev, void *ptr,
                                   size_t *bytes) {
  return block_free(dev, ptr, true, bytes);
}

static bool ranges_overlap(const void *a, size_t an, const char *lo,
                           size_t bytes) {
  const char *p = a;
  return an > 0 && bytes > 0 && p < lo + bytes && lo < p + an;
}

/* Queued or running copies and memsets on the device's worker streams
 * whose ranges overlap [lo, lo + bytes) (strict-mode checks only). Takes
 * the device's stream list lock, then each stream's lock. */
static size_t ops_touching(ofl_device_t *dev, const char *lo, size_t bytes) {
  size_t n = 0;
  pthread_mutex_lock(&dev->streams_lock);
  for (ofl_stream_t *s = dev->streams; s != NULL; s = s->dev_next) {
    host_stream_t *hs = s->impl;
    if (hs == NULL || !hs->has_thread)
      continue;
    pthread_mutex_lock(&hs->mu);
    for (const op_t *op = hs->head; op != NULL; op = op->next) {
      if (op->type == OP_COPY)
        n += ranges_overlap(op->dst, op->bytes, lo, bytes) ||
             ranges_overlap(op->src, op->bytes, lo, bytes);
      else if (op->type == OP_MEMSET)
        n += ranges_overlap(op->dst, op->bytes, lo, bytes);
    }
    pthread_mutex_unlock(&hs->mu);
  }
  pthread_mutex_unlock(&dev->streams_lock);
  return n;
}

size_t ofl__host_inflight(ofl_device_t *dev, const void *ptr, size_t bytes) {
  host_dev_t *h = HD(dev);
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, ptr);
  size_t n = b ? atomic_load(&b->inflight) : 0;
  bool whole = b != NULL && b->base == (const char *)ptr && bytes >= b->bytes;
  pthread_mutex_unlock(&h->reg_lock);
  /* Part of a block (a pool's reserve carved into blocks): the block's
   * count covers every part, so look at the queued ranges themselves. */
  if (n > 0 && !whole)
    n = ops_touching(dev, ptr, bytes);
  return n;
}

bool ofl__host_device_owns(ofl_device_t *dev, const void *ptr, size_t bytes) {
  host_dev_t *h = HD(dev);
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, ptr);
  bool own = b != NULL && !b->pinned &&
             bytes <= (size_t)(b->base + b->bytes - (const char *)ptr);
  if (b == NULL && atomic_load(&h->adopt))
    own = true; /* the application's memory, adopted */
  pthread_mutex_unlock(&h->reg_lock);
  return own;
}

void ofl__host_adopt_host_memory(ofl_device_t *dev, bool on) {
  atomic_store(&HD(dev)->adopt, on);
}

/* Checks that [p, p+bytes) lies in a device block (want_device) or outside
 * any device block, and takes an inflight reference on the block. */
static ofl_status_t claim(ofl_stream_t *s, const void *p, size_t bytes,
                          bool want_device, const char *role, hblock_t **out) {
  host_dev_t *h = HD(s->dev);
  hblock_t *b = find_block(h, p);
  bool is_device = b != NULL && !b->pinned;
  /* adopted memory is the application's: device memory as well as host,
   * the copy kind says which it plays */
  if (b == NULL && want_device && atomic_load(&h->adopt)) {
    *out = NULL;
    return OFL_SUCCESS;
  }
  if (want_device && !is_device)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': %s %p is not device memory of this "
                      "device; allocate it with ofl_device_malloc or use "
                      "another copy kind",
                      s->name, role, p);
  if (!want_device && is_device)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': %s %p is device memory but the copy kind "
                      "says host",
                      s->name, role, p);
  if (b != NULL && bytes > (size_t)(b->base + b->bytes - (const char *)p))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': %s range of %zu bytes at %p overruns its "
                      "block of %zu bytes",
                      s->name, role, bytes, p, b->bytes);
  *out = b;
  return OFL_SUCCESS;
}

ofl_status_t ofl__host_claim_copy(ofl_stream_t *s, void *dst, const void *src,
                                  size_t bytes, ofl_copy_kind_t kind,
                                  hblock_t *blk[2]) {
  host_dev_t *h = HD(s->dev);
  bool dst_dev = kind == OFL_COPY_H2D || kind == OFL_COPY_D2D;
  bool src_dev = kind == OFL_COPY_D2H || kind == OFL_COPY_D2D;
  hblock_t *bd = NULL, *bs = NULL;
  pthread_mutex_lock(&h->reg_lock);
  ofl_status_t st = claim(s, dst, bytes, dst_dev, "destination", &bd);
  if (st == OFL_SUCCESS)
    st = claim(s, src, bytes, src_dev, "source", &bs);
  if (st == OFL_SUCCESS) {
    if (bd)
      atomic_fetch_add_explicit(&bd->inflight, 1, memory_order_relaxed);
    if (bs)
      atomic_fetch_add_explicit(&bs->inflight, 1, memory_order_relaxed);
  }
  pthread_mutex_unlock(&h->reg_lock);
  if (st != OFL_SUCCESS)
    return st;
  blk[0] = bd;
  blk[1] = bs;
  return OFL_SUCCESS;
}

ofl_status_t ofl__host_claim_fill(ofl_stream_t *s, void *dst, size_t bytes,
                                  hblock_t **out) {
  host_dev_t *h = HD(s->dev);
  pthread_mutex_lock(&h->reg_lock);
  hblock_t *b = find_block(h, dst);
  if (b != NULL && bytes > (size_t)(b->base + b->bytes - (char *)dst)) {
    pthread_mutex_unlock(&h->reg_lock);
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "stream '%s': memset of %zu bytes at %p overruns its "
                      "block of %zu bytes",
                      s->name, bytes, dst, b->bytes);
  }
  if (b != NULL)
    atomic_fetch_add_explicit(&b->inflight, 1, memory_order_relaxed);
  pthread_mutex_unlock(&h->reg_lock);
  *out = b;
  return OFL_SUCCESS;
}

void ofl__host_unclaim(ofl_device_t *dev, hblock_t *const blk[2]) {
  bool drained = false;
  for (int i = 0; i < 2; i++)
    if (blk[i] != NULL) /* the block may be freed right after this */
      drained |= atomic_fetch_sub(&blk[i]->inflight, 1) == 1;
  host_dev_t *h = HD(dev);
  if (drained && atomic_load(&h->free_waiters) > 0) {
    /* Under the lock, so that a free between its check and its wait
     * cannot miss the wake-up. */
    pthread_mutex_lock(&h->reg_lock);
    pthread_cond_broadcast(&h->reg_cond);
    pthread_mutex_unlock(&h->reg_lock);
  }
}
