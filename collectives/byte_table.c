/* ofl: the per-rank byte table (name -> bytes), kept sorted by name, and its
 * wire format for the gather. */
#include <stdlib.h>
#include <string.h>

#include <ofl/summary.h>

#include "collectives/summary_internal.h"

ofl_status_t ofl_byte_table_create(ofl_byte_table_t **out) {
  if (!out)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_byte_table_create: out is NULL");
  ofl_byte_table_t *t = calloc(1, sizeof(*t));
  if (!t)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "ofl_byte_table_create: out of memory");
  *out = t;
  return OFL_SUCCESS;
}

void ofl_byte_table_clear(ofl_byte_table_t *t) {
  if (!t)
    return;
  for (size_t i = 0; i < t->count; i++)
    free(t->entries[i].name);
  t->count = 0;
}

void ofl_byte_table_destroy(ofl_byte_table_t *t) {
  if (!t)
    return;
  ofl_byte_table_clear(t);
  free(t->entries);
  free(t);
}

ofl_status_t ofl__name_check(const char *name, size_t len, const char *what) {
  if (len == 0 || len > OFL_BYTE_TABLE_NAME_MAX)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "%s: a name must be 1 to %d bytes long, not %zu", what,
                      OFL_BYTE_TABLE_NAME_MAX, len);
  for (size_t i = 0; i < len; i++) {
    unsigned char ch = (unsigned char)name[i];
    if (ch < 0x20 || ch == 0x7f)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                        "%s: name '%.40s' has control character 0x%02x at "
                        "byte %zu; use printable names",
                        what, ch >= 0x20 ? name : "?", ch, i);
  }
  return OFL_SUCCESS;
}

/* Index of name, or where it would go (*found 0). */
static size_t find(const ofl_byte_table_t *t, const char *name, int *found) {
  size_t lo = 0, hi = t->count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(t->entries[mid].name, name);
    if (c == 0) {
      *found = 1;
      return mid;
    }
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  *found = 0;
  return lo;
}

static ofl_status_t upsert(ofl_byte_table_t *t, const char *name,
                           uint64_t bytes, int add, const char *what) {
  if (!t || !name)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL, "%s: %s is NULL",
                      what, !t ? "table" : "name");
  size_t len = strnlen(name, OFL_BYTE_TABLE_NAME_MAX + 1);
  OFL_CHECK(ofl__name_check(name, len, what));
  int found;
  size_t at = find(t, name, &found);
  if (found) {
    ofl__byte_entry_t *e = &t->entries[at];
    if (add && bytes > UINT64_MAX - e->bytes)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                        "%s: bytes of '%s' would exceed 64 bits (%llu + "
                        "%llu)",
                        what, name, (unsigned long long)e->bytes,
                        (unsigned long long)bytes);
    e->bytes = add ? e->bytes + bytes : bytes;
    return OFL_SUCCESS;
  }
  if (t->count == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 8;
    ofl__byte_entry_t *ne = realloc(t->entries, cap * sizeof(*ne));
    if (!ne)
      return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                        "%s: out of memory growing the table to %zu entries",
                        what, cap);
    t->entries = ne;
    t->cap = cap;
  }
  char *copy = malloc(len + 1);
  if (!copy)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "%s: out of memory copying a name", what);
  memcpy(copy, name, len + 1);
  memmove(&t->entries[at + 1], &t->entries[at],
          (t->count - at) * sizeof(*t->entries));
  t->entries[at].name = copy;
  t->entries[at].bytes = bytes;
  t->count++;
  return OFL_SUCCESS;
}

ofl_status_t ofl_byte_table_add(ofl_byte_table_t *t, const char *name,
                                uint64_t bytes) {
  return upsert(t, name, bytes, 1, "ofl_byte_table_add");
}

ofl_status_t ofl_byte_table_set(ofl_byte_table_t *t, const char *name,
                                uint64_t bytes) {
  return upsert(t, name, bytes, 0, "ofl_byte_table_set");
}

size_t ofl_byte_table_count(const ofl_byte_table_t *t) {
  return t ? t->count : 0;
}

const char *ofl_byte_table_name(const ofl_byte_table_t *t, size_t i) {
  return t && i < t->count ? t->entries[i].name : NULL;
}

uint64_t ofl_byte_table_bytes(const ofl_byte_table_t *t, size_t i) {
  return t && i < t->count ? t->entries[i].bytes : 0;
}

uint64_t ofl_byte_table_get(const ofl_byte_table_t *t, const char *name,
                            int *found) {
  int f = 0;
  size_t at = t && name ? find(t, name, &f) : 0;
  if (found)
    *found = f;
  return f ? t->entries[at].bytes : 0;
}

uint64_t ofl_byte_table_total(const ofl_byte_table_t *t) {
  uint64_t sum = 0;
  for (size_t i = 0; t && i < t->count; i++)
    sum = t->entries[i].bytes > UINT64_MAX - sum ? UINT64_MAX
                                                 : sum + t->entries[i].bytes;
  return sum;
}

/* ---- wire format ----------------------------------------------------------
 * "OFLT", u32 version 1, u32 count, then per entry (in name order) u32 name
 * length, the name without NUL, u64 bytes. Little-endian. */

#define TABLE_MAGIC 0x544c464fu /* "OFLT" */
#define TABLE_VERSION 1u

ofl_status_t ofl__byte_table_encode(const ofl_byte_table_t *t,
                                    unsigned char **out, size_t *out_len) {
  size_t n = t ? t->count : 0, total = 12;
  for (size_t i = 0; i < n; i++)
    total += 4 + strlen(t->entries[i].name) + 8;
  unsigned char *buf = malloc(total);
  if (!buf)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "summary: cannot allocate %zu bytes to encode the "
                      "table",
                      total);
  ofl__put_u32(buf, TABLE_MAGIC);
  ofl__put_u32(buf + 4, TABLE_VERSION);
  ofl__put_u32(buf + 8, (uint32_t)n);
  size_t at = 12;
  for (size_t i = 0; i < n; i++) {
    size_t len = strlen(t->entries[i].name);
    ofl__put_u32(buf + at, (uint32_t)len);
    memcpy(buf + at + 4, t->entries[i].name, len);
    ofl__put_u64(buf + at + 4 + len, t->entries[i].bytes);
    at += 4 + len + 8;
  }
  *out = buf;
  *out_len = total;
  return OFL_SUCCESS;
}

static ofl_status_t corrupt(int rank, const char *why) {
  return ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_COLL,
                    "summary: the table received from rank %d is malformed "
                    "(%s); are all ranks running the same ofl version?",
                    rank, why);
}

ofl_status_t ofl__byte_table_decode(const unsigned char *buf, size_t len,
                                    int rank, ofl_byte_table_t **out) {
  if (len < 12 || ofl__get_u32(buf) != TABLE_MAGIC)
    return corrupt(rank, "bad magic");
  if (ofl__get_u32(buf + 4) != TABLE_VERSION)
    return corrupt(rank, "unknown version");
  uint32_t n = ofl__get_u32(buf + 8);
  ofl_byte_table_t *t;
  OFL_CHECK(ofl_byte_table_create(&t));
  size_t at = 12;
  ofl_status_t st = OFL_SUCCESS;
  char name[OFL_BYTE_TABLE_NAME_MAX + 1];
  for (uint32_t i = 0; i < n && st == OFL_SUCCESS; i++) {
    if (len - at < 4) {
      st = corrupt(rank, "truncated entry");
      break;
    }
    uint32_t nl = ofl__get_u32(buf + at);
    if (nl == 0 || nl > OFL_BYTE_TABLE_NAME_MAX || len - at - 4 < nl + 8u) {
      st = corrupt(rank, "bad name length");
      break;
    }
    memcpy(name, buf + at + 4, nl);
    name[nl] = '\0';
    if (strlen(name) != nl) {
      st = corrupt(rank, "NUL inside a name");
      break;
    }
    int found;
    (void)find(t, name, &found);
    if (found) {
      st = corrupt(rank, "duplicate name");
      break;
    }
    if (ofl__name_check(name, nl, "summary") != OFL_SUCCESS ||
        ofl_byte_table_set(t, name, ofl__get_u64(buf + at + 4 + nl)) !=
            OFL_SUCCESS) {
      st = corrupt(rank, "invalid name");
      break;
    }
    at += 4 + nl + 8;
  }
  if (st == OFL_SUCCESS && at != len)
    st = corrupt(rank, "trailing bytes");
  if (st != OFL_SUCCESS) {
    ofl_byte_table_destroy(t);
    return st;
  }
  *out = t;
  return OFL_SUCCESS;
}
