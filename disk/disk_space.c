/* ofl: space inside the disk store's file. A sorted list of free ranges,
 * first fit, coalesced on return; the store grows the file at its end and
 * hands the new range to this list. Lock held by the caller. */
#include "disk/disk_internal.h"

#include <stdlib.h>
#include <string.h>

void ofl__disk_space_init(disk_space_t *s) { memset(s, 0, sizeof *s); }

void ofl__disk_space_fini(disk_space_t *s) {
  free(s->free);
  memset(s, 0, sizeof *s);
}

bool ofl__disk_space_take(disk_space_t *s, uint64_t len, uint64_t *off) {
  for (size_t i = 0; i < s->nfree; i++) {
    disk_range_t *r = &s->free[i];
    if (r->len < len)
      continue;
    *off = r->off;
    r->off += len;
    r->len -= len;
    if (r->len == 0) {
      memmove(r, r + 1, (s->nfree - i - 1) * sizeof *r);
      s->nfree--;
    }
    return true;
  }
  return false;
}

bool ofl__disk_space_give(disk_space_t *s, uint64_t off, uint64_t len) {
  if (len == 0)
    return true;
  size_t i = 0; /* first range after off */
  while (i < s->nfree && s->free[i].off < off)
    i++;
  bool join_prev = i > 0 && s->free[i - 1].off + s->free[i - 1].len == off;
  bool join_next = i < s->nfree && off + len == s->free[i].off;
  if (join_prev && join_next) {
    s->free[i - 1].len += len + s->free[i].len;
    memmove(&s->free[i], &s->free[i + 1],
            (s->nfree - i - 1) * sizeof s->free[0]);
    s->nfree--;
    return true;
  }
  if (join_prev) {
    s->free[i - 1].len += len;
    return true;
  }
  if (join_next) {
    s->free[i].off = off;
    s->free[i].len += len;
    return true;
  }
  if (s->nfree == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 16;
    disk_range_t *n = realloc(s->free, cap * sizeof *n);
    if (n == NULL)
      return false;
    s->free = n;
    s->cap = cap;
  }
  memmove(&s->free[i + 1], &s->free[i], (s->nfree - i) * sizeof s->free[0]);
  s->free[i].off = off;
  s->free[i].len = len;
  s->nfree++;
  return true;
}

uint64_t ofl__disk_space_tail_free(const disk_space_t *s) {
  if (s->nfree == 0)
    return 0;
  const disk_range_t *r = &s->free[s->nfree - 1];
  return r->off + r->len == s->file_bytes ? r->len : 0;
}
