/* ofl: the disk store's bounce buffers and its keep list: written extents
 * whose bytes are still in a bounce buffer (oldest first, within keep_cap),
 * so that a reload soon after the write needs no read. A buffer the pool
 * refuses is made by giving kept ones back, oldest first. */
#include "disk/disk_internal.h"

#include "runtime/internal.h"
#include "runtime/queue.h"

ofl_tensor_t *ofl__disk_keep_unlink(ofl_disk_t *d, ofl_disk_extent_t *e) {
  OFL_DLIST_UNLINK_TAIL(d->keep_head, d->keep_tail, e, keep_prev, keep_next);
  d->kept_bytes -= e->span;
  ofl_tensor_t *t = e->kept;
  e->kept = NULL;
  return t;
}

/* Lock held: gives the oldest kept buffer back to the pool; false when
 * none is kept. */
static bool keep_drop_oldest(ofl_disk_t *d) {
  if (d->keep_head == NULL)
    return false;
  ofl_pool_free(d->pool, ofl__disk_keep_unlink(d, d->keep_head));
  d->st.keep_drops++;
  return true;
}

ofl_tensor_t *ofl__disk_keep_add(ofl_disk_t *d, ofl_disk_extent_t *e,
                                 ofl_tensor_t *t) {
  if (e->span > d->keep_cap)
    return t;
  while (d->kept_bytes + e->span > d->keep_cap)
    keep_drop_oldest(d);
  e->kept = t;
  OFL_DLIST_PUSH_TAIL(d->keep_head, d->keep_tail, e, keep_prev, keep_next);
  d->kept_bytes += e->span;
  return NULL;
}

bool ofl__disk_keep_take(ofl_disk_t *d, ofl_disk_extent_t *e) {
  if (e->kept == NULL)
    return false;
  e->buf = ofl__disk_keep_unlink(d, e);
  e->data = ofl_tensor_data(e->buf);
  e->state = OFL_DISK_EXTENT_RESIDENT;
  d->st.keep_hits++;
  return true;
}

size_t ofl_disk_drop_kept(ofl_disk_t *d) {
  if (d == NULL)
    return 0;
  ofl__disk_lock(d);
  size_t bytes = d->kept_bytes;
  while (keep_drop_oldest(d)) {
  }
  ofl__disk_buffer_returned(d);
  ofl__disk_unlock(d);
  return bytes;
}

ofl_status_t ofl__disk_buffer_alloc(ofl_disk_t *d, size_t span,
                                    ofl_tensor_t **t) {
  int64_t shape[1] = {(int64_t)span};
  ofl_status_t st;
  for (;;) {
    st = ofl_pool_alloc_dynamic(d->pool, shape, 1, OFL_DTYPE_U8, NULL, t);
    if (st != OFL_ERR_NO_MEMORY)
      break;
    ofl__disk_lock(d);
    bool dropped = keep_drop_oldest(d);
    ofl__disk_unlock(d);
    if (!dropped)
      break;
  }
  if (st != OFL_SUCCESS) {
    ofl__disk_lock(d);
    d->st.buffer_refusals++;
    ofl__disk_unlock(d);
    return st;
  }
  if (((uintptr_t)ofl_tensor_data(*t) & (OFL__DISK_ALIGN - 1)) != 0) {
    ofl_pool_free(d->pool, *t);
    return ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_DISK,
                      "disk store: bounce buffer %p is not 4 KiB aligned; "
                      "the pinned pool must hand out page-aligned blocks",
                      ofl_tensor_data(*t));
  }
  return OFL_SUCCESS;
}
