/* ofl: writing a safetensors file atomically: an unnamed O_TMPFILE in the
 * target directory given its name with linkat once complete, else a named
 * temporary renamed into place; fsync of the file and of the directory. A
 * save killed half-way leaves no name behind on the first path; on the
 * second, its temporary is removed by the next save into that directory.
 * Here: the format (dtype names, names, the JSON header) and the bytes; the
 * files, temporary and final: staging/safetensors_file.c. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "staging/safetensors_file.h"
#include "staging/staging_internal.h"

static const struct {
  const char *name;
  size_t size;
} dtypes[OFL_DTYPE_COUNT] = {
    [OFL_DTYPE_F32] = {"F32", 4},         [OFL_DTYPE_F16] = {"F16", 2},
    [OFL_DTYPE_BF16] = {"BF16", 2},       [OFL_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [OFL_DTYPE_F8_E5M2] = {"F8_E5M2", 1}, [OFL_DTYPE_I64] = {"I64", 8},
    [OFL_DTYPE_I32] = {"I32", 4},         [OFL_DTYPE_I16] = {"I16", 2},
    [OFL_DTYPE_I8] = {"I8", 1},           [OFL_DTYPE_U8] = {"U8", 1},
    [OFL_DTYPE_BOOL] = {"BOOL", 1},       [OFL_DTYPE_F64] = {"F64", 8},
    [OFL_DTYPE_U16] = {"U16", 2},         [OFL_DTYPE_U32] = {"U32", 4},
    [OFL_DTYPE_U64] = {"U64", 8},
};

const char *ofl_safetensors_dtype_name(ofl_dtype_t dtype) {
  if ((int)dtype < 0 || dtype >= OFL_DTYPE_COUNT)
    return NULL;
  return dtypes[dtype].name;
}

size_t ofl__st_elem_size(ofl_dtype_t dtype) {
  if ((int)dtype < 0 || dtype >= OFL_DTYPE_COUNT)
    return 0;
  return dtypes[dtype].size;
}

ofl_status_t ofl__st_shape_bytes(const int64_t *shape, int ndim,
                                 ofl_dtype_t dtype, size_t *out) {
  size_t bytes = ofl__st_elem_size(dtype);
  if (bytes == 0 || ndim < 0 || ndim > OFL_MAX_DIMS ||
      (ndim > 0 && shape == NULL))
    return OFL_ERR_INVALID_ARG;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0)
      return OFL_ERR_INVALID_ARG;
    if (shape[d] != 0 && bytes > SIZE_MAX / (uint64_t)shape[d])
      return OFL_ERR_INVALID_ARG;
    bytes *= (size_t)shape[d];
  }
  *out = bytes;
  return OFL_SUCCESS;
}

/* ---- fault injection ---------------------------------------------------- */

static ssize_t system_write(int fd, const void *buf, size_t bytes) {
  return write(fd, buf, bytes);
}
static _Atomic(ofl__write_fn) write_fn = system_write;

void ofl__safetensors_set_write_hook(ofl__write_fn fn) {
  atomic_store(&write_fn, fn != NULL ? fn : system_write);
}

/* ---- names ---------------------------------------------------------------- */

bool ofl__utf8_valid(const char *s, size_t len) {
  const unsigned char *p = (const unsigned char *)s;
  size_t i = 0;
  while (i < len) {
    unsigned c = p[i];
    size_t extra;
    uint32_t cp;
    if (c == 0)
      return false;
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      extra = 1, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      extra = 2, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      extra = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + extra >= len)
      return false;
    for (size_t k = 1; k <= extra; k++) {
      if ((p[i + k] & 0xc0) != 0x80)
        return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    /* No overlong forms, no surrogates, nothing past U+10FFFF. */
    if ((extra == 1 && cp < 0x80) || (extra == 2 && cp < 0x800) ||
        (extra == 3 && cp < 0x10000) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += extra + 1;
  }
  return true;
}

ofl_status_t ofl__safetensors_check_name(const char *name, const char *what) {
  if (name == NULL || name[0] == '\0')
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "%s: a tensor has an empty or NULL name; give every "
                      "tensor a unique non-empty name",
                      what);
  size_t len = strnlen(name, OFL_SAFETENSORS_NAME_MAX + 1);
  if (len > OFL_SAFETENSORS_NAME_MAX)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "%s: tensor name '%.64s...' is longer than %zu bytes; "
                      "shorten it",
                      what, name, OFL_SAFETENSORS_NAME_MAX);
  if (!ofl__utf8_valid(name, len))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "%s: tensor name '%.64s' is not valid UTF-8; safetensors "
                      "names are UTF-8 strings",
                      what, name);
  if (strcmp(name, "__metadata__") == 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "%s: '__metadata__' is reserved by the safetensors "
                      "format and cannot name a tensor; rename it",
                      what);
  return OFL_SUCCESS;
}

/* ---- the JSON header ------------------------------------------------------ */

typedef struct {
  char *buf;
  size_t len, cap;
  bool failed;
} sbuf_t;

static void sb_put(sbuf_t *b, const char *s, size_t n) {
  if (b->failed)
    return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + n + 1)
      cap *= 2;
    char *nb = realloc(b->buf, cap);
    if (nb == NULL) {
      b->failed = true;
      return;
    }
    b->buf = nb, b->cap = cap;
  }
  memcpy(b->buf + b->len, s, n);
  b->len += n;
  b->buf[b->len] = '\0';
}
static void sb_str(sbuf_t *b, const char *s) { sb_put(b, s, strlen(s)); }
static void sb_u64(sbuf_t *b, uint64_t v) {
  char tmp[24];
  int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
  sb_put(b, tmp, (size_t)n);
}

/* A JSON string: quotes, backslashes and control characters escaped; other
 * UTF-8 passes through as is (JSON allows it). */
static void sb_json_string(sbuf_t *b, const char *s) {
  sb_put(b, "\"", 1);
  for (const char *p = s; *p != '\0'; p++) {
    unsigned char c = (unsigned char)*p;
    char esc[8];
    if (c == '"' || c == '\\') {
      esc[0] = '\\', esc[1] = (char)c;
      sb_put(b, esc, 2);
    } else if (c < 0x20) {
      snprintf(esc, sizeof esc, "\\u%04x", c);
      sb_put(b, esc, 6);
    } else {
      sb_put(b, p, 1);
    }
  }
  sb_put(b, "\"", 1);
}

/* Sort key of one tensor in data order (qsort has no context argument). */
typedef struct {
  size_t elem;
  const char *name;
  size_t index;
} order_key_t;

static int cmp_data_order(const void *a, const void *b) {
  const order_key_t *x = a, *y = b;
  if (x->elem != y->elem)
    return x->elem > y->elem ? -1 : 1; /* largest elements first: aligned */
  return strcmp(x->name, y->name);
}

static int cmp_str_ptr(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks entries and metadata; on success *order holds the data order. */
static ofl_status_t check_inputs(const ofl_safetensors_entry_t *entries,
                                 size_t n, const ofl_safetensors_kv_t *meta,
                                 size_t n_meta, size_t **order_out) {
  if (n > 0 && entries == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors write: entries is NULL with n %zu", n);
  if (n_meta > 0 && meta == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors write: metadata is NULL with n_metadata %zu",
                      n_meta);
  for (size_t i = 0; i < n; i++) {
    const ofl_safetensors_entry_t *e = &entries[i];
    OFL_CHECK(ofl__safetensors_check_name(e->name, "safetensors write"));
    size_t bytes = 0;
    if (ofl__st_shape_bytes(e->shape, e->ndim, e->dtype, &bytes) != OFL_SUCCESS)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                        "safetensors write: tensor '%s' has an invalid dtype "
                        "%d or shape (ndim %d, at most %d, no negative dims)",
                        e->name, (int)e->dtype, e->ndim, OFL_MAX_DIMS);
    if (bytes != e->bytes)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                        "safetensors write: tensor '%s' has bytes %zu but its "
                        "shape and dtype need %zu",
                        e->name, e->bytes, bytes);
    if (bytes > 0 && e->data == NULL)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                        "safetensors write: tensor '%s' has no data", e->name);
  }
  for (size_t i = 0; i < n_meta; i++) {
    const char *k = meta[i].key, *v = meta[i].value;
    if (k == NULL || v == NULL || k[0] == '\0' ||
        !ofl__utf8_valid(k, strlen(k)) || !ofl__utf8_valid(v, strlen(v)))
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                        "safetensors write: metadata pair %zu has a NULL, "
                        "empty or non-UTF-8 key or value",
                        i);
    for (size_t j = 0; j < i; j++)
      if (strcmp(meta[j].key, k) == 0)
        return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                          "safetensors write: metadata key '%.64s' appears "
                          "twice",
                          k);
  }

  size_t *order = malloc((n ? n : 1) * sizeof *order);
  const char **names = malloc((n ? n : 1) * sizeof *names);
  if (order == NULL || names == NULL) {
    free(order);
    free(names);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors write: out of host memory for %zu entries",
                      n);
  }
  for (size_t i = 0; i < n; i++)
    names[i] = entries[i].name;
  qsort(names, n, sizeof *names, cmp_str_ptr);
  for (size_t i = 1; i < n; i++) {
    if (strcmp(names[i - 1], names[i]) == 0) {
      ofl_status_t st = ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                                   "safetensors write: tensor name '%.64s' "
                                   "appears twice; names must be unique",
                                   names[i]);
      free(order);
      free(names);
      return st;
    }
  }
  free(names);
  order_key_t *keys = malloc((n ? n : 1) * sizeof *keys);
  if (keys == NULL) {
    free(order);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors write: out of host memory for %zu entries",
                      n);
  }
  for (size_t i = 0; i < n; i++)
    keys[i] = (order_key_t){ofl__st_elem_size(entries[i].dtype),
                            entries[i].name, i};
  qsort(keys, n, sizeof *keys, cmp_data_order);
  for (size_t i = 0; i < n; i++)
    order[i] = keys[i].index;
  free(keys);
  *order_out = order;
  return OFL_SUCCESS;
}

/* The header JSON padded with spaces so that 8 + its length is a multiple
 * of 8; *data_bytes is the total of the tensors' bytes. */
static ofl_status_t build_header(const ofl_safetensors_entry_t *entries,
                                 const size_t *order, size_t n,
                                 const ofl_safetensors_kv_t *meta,
                                 size_t n_meta, sbuf_t *b,
                                 uint64_t *data_bytes) {
  sb_put(b, "{", 1);
  bool first = true;
  if (n_meta > 0) {
    sb_str(b, "\"__metadata__\":{");
    for (size_t i = 0; i < n_meta; i++) {
      if (i > 0)
        sb_put(b, ",", 1);
      sb_json_string(b, meta[i].key);
      sb_put(b, ":", 1);
      sb_json_string(b, meta[i].value);
    }
    sb_put(b, "}", 1);
    first = false;
  }
  uint64_t off = 0;
  for (size_t k = 0; k < n; k++) {
    const ofl_safetensors_entry_t *e = &entries[order[k]];
    if (!first)
      sb_put(b, ",", 1);
    first = false;
    sb_json_string(b, e->name);
    sb_str(b, ":{\"dtype\":\"");
    sb_str(b, dtypes[e->dtype].name);
    sb_str(b, "\",\"shape\":[");
    for (int d = 0; d < e->ndim; d++) {
      if (d > 0)
        sb_put(b, ",", 1);
      sb_u64(b, (uint64_t)e->shape[d]);
    }
    sb_str(b, "],\"data_offsets\":[");
    sb_u64(b, off);
    sb_put(b, ",", 1);
    off += e->bytes;
    sb_u64(b, off);
    sb_str(b, "]}");
  }
  sb_put(b, "}", 1);
  while (!b->failed && (8 + b->len) % 8 != 0)
    sb_put(b, " ", 1);
  if (b->failed)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors write: out of host memory for the header");
  if (b->len > OFL_SAFETENSORS_HEADER_MAX)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors write: header of %zu bytes is larger than "
                      "the %zu bytes the reference reader accepts (too many "
                      "tensors or too much metadata); split the checkpoint "
                      "into shards",
                      b->len, OFL_SAFETENSORS_HEADER_MAX);
  *data_bytes = off;
  return OFL_SUCCESS;
}

/* ---- the file --------------------------------------------------------------- */

/* Writes all of buf, retrying short writes and EINTR. */
static ofl_status_t write_all(int fd, const void *buf, size_t bytes,
                              const char *path) {
  const char *p = buf;
  while (bytes > 0) {
    size_t chunk = bytes < ((size_t)1 << 30) ? bytes : ((size_t)1 << 30);
    ssize_t w = atomic_load(&write_fn)(fd, p, chunk);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0)
      return ofl__st_io_error(errno, "writing", path);
    if (w == 0)
      return ofl__st_io_error(ENOSPC, "writing (no progress)", path);
    p += w;
    bytes -= (size_t)w;
  }
  return OFL_SUCCESS;
}

/* Small tensors are gathered into one buffer so that a checkpoint of many
 * small tensors does not cost a system call each. */
#define GATHER_BYTES ((size_t)1 << 20)

typedef struct {
  int fd;
  const char *path;
  char *buf;
  size_t len;
} gather_t;

static ofl_status_t gather_flush(gather_t *g) {
  if (g->len == 0)
    return OFL_SUCCESS;
  ofl_status_t st = write_all(g->fd, g->buf, g->len, g->path);
  g->len = 0;
  return st;
}

static ofl_status_t gather_put(gather_t *g, const void *data, size_t bytes) {
  if (bytes == 0)
    return OFL_SUCCESS;
  if (g->buf != NULL && bytes <= GATHER_BYTES / 4) {
    if (g->len + bytes > GATHER_BYTES)
      OFL_CHECK(gather_flush(g));
    memcpy(g->buf + g->len, data, bytes);
    g->len += bytes;
    return OFL_SUCCESS;
  }
  OFL_CHECK(gather_flush(g));
  return write_all(g->fd, data, bytes, g->path);
}

static ofl_status_t write_body(int fd, const char *path, const sbuf_t *hdr,
                               const ofl_safetensors_entry_t *entries,
                               const size_t *order, size_t n,
                               uint64_t data_bytes) {
  /* Reserving the space first turns a full disk into an early, clean error
   * where the file system supports it. */
  int err = posix_fallocate(fd, 0, (off_t)(8 + hdr->len + data_bytes));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG)
    return ofl__st_io_error(err, "reserving space for", path);

  unsigned char len_le[8];
  uint64_t hl = hdr->len;
  for (int i = 0; i < 8; i++)
    len_le[i] = (unsigned char)(hl >> (8 * i));
  gather_t g = {fd, path, malloc(GATHER_BYTES), 0};
  ofl_status_t st = gather_put(&g, len_le, 8);
  if (st == OFL_SUCCESS)
    st = gather_put(&g, hdr->buf, hdr->len);
  for (size_t k = 0; k < n && st == OFL_SUCCESS; k++)
    st = gather_put(&g, entries[order[k]].data, entries[order[k]].bytes);
  if (st == OFL_SUCCESS)
    st = gather_flush(&g);
  free(g.buf);
  return st;
}

/* One attempt: through an unnamed file when unnamed, else a named
 * temporary. OFL_ERR_NOT_SUPPORTED (quiet) when the unnamed file could not
 * be named: the caller tries again the other way. */
static ofl_status_t write_file(const char *path, const char *dir,
                               const char *base, const sbuf_t *hdr,
                               const ofl_safetensors_entry_t *entries,
                               const size_t *order, size_t n,
                               uint64_t data_bytes, bool unnamed) {
  ofl_status_t st;
  char *tmp = NULL;
  int fd = -1;
  if (unnamed) {
    fd = ofl__st_open_unnamed(dir);
    if (fd < 0) {
      int err = errno;
      if (err == ENOSPC || err == EDQUOT)
        return ofl__st_io_error(err, "creating a file for", path);
      return ofl__error_quiet(OFL_ERR_NOT_SUPPORTED,
                              "safetensors write: no O_TMPFILE in '%s': %s",
                              dir, strerror(err));
    }
  } else {
    OFL_CHECK(ofl__st_create_temp(dir, base, path, &tmp, &fd));
  }
  OFL_CHECK_GOTO(write_body(fd, path, hdr, entries, order, n, data_bytes), st,
                 out);
  if (fsync(fd) != 0) {
    st = ofl__st_io_error(errno, "syncing", path);
    goto out;
  }
  /* Named while still open: the flock keeps sweepers off the file until
   * it has its final name. */
  if (unnamed) {
    OFL_CHECK_GOTO(ofl__st_publish_unnamed(fd, dir, base, path), st, out);
  } else if (rename(tmp, path) != 0) {
    st = ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                    "safetensors write: cannot rename the finished file to "
                    "'%s': %s; check that the path is not a directory",
                    path, strerror(errno));
    goto out;
  } else {
    free(tmp);
    tmp = NULL; /* renamed: nothing to remove */
  }
  st = OFL_SUCCESS;
out:
  if (fd >= 0)
    close(fd); /* after fsync, close reports nothing new; drops the lock */
  if (tmp != NULL) {
    unlink(tmp); /* no partial file survives an error */
    free(tmp);
  }
  return st;
}

ofl_status_t ofl_safetensors_write(const char *path,
                                   const ofl_safetensors_entry_t *entries,
                                   size_t n,
                                   const ofl_safetensors_kv_t *metadata,
                                   size_t n_metadata) {
  if (path == NULL || path[0] == '\0')
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors write: path is NULL or empty");
  if (strlen(path) >= PATH_MAX)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors write: path of %zu bytes is longer than "
                      "PATH_MAX (%d); use a shorter path",
                      strlen(path), PATH_MAX);
  size_t *order = NULL;
  OFL_CHECK(check_inputs(entries, n, metadata, n_metadata, &order));

  ofl_status_t st;
  char *dir = NULL, *base = NULL;
  sbuf_t hdr = {0};
  uint64_t data_bytes = 0;
  OFL_CHECK_GOTO(ofl__st_split_path(path, &dir, &base), st, out);
  if (strlen(base) > (size_t)ofl__st_name_max(dir)) {
    st = ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                    "safetensors write: file name '%.40s...' (%zu bytes) is "
                    "longer than the file system allows (%ld); use a shorter "
                    "name",
                    base, strlen(base), ofl__st_name_max(dir));
    goto out;
  }
  OFL_CHECK_GOTO(build_header(entries, order, n, metadata, n_metadata, &hdr,
                              &data_bytes),
                 st, out);
  ofl__st_sweep_stale(dir, base);
  st = write_file(path, dir, base, &hdr, entries, order, n, data_bytes, true);
  if (st == OFL_ERR_NOT_SUPPORTED) {
    OFL_INFO(OFL_SUBSYS_STAGING,
             "safetensors write: %s; using a named temporary file",
             ofl_last_error());
    st = write_file(path, dir, base, &hdr, entries, order, n, data_bytes,
                    false);
  }
  if (st != OFL_SUCCESS)
    goto out;
  ofl__st_sync_dir(dir);
  OFL_INFO(OFL_SUBSYS_STAGING,
           "safetensors written path %s tensors %zu bytes %llu", path, n,
           (unsigned long long)(8 + hdr.len + data_bytes));
out:
  free(hdr.buf);
  free(dir);
  free(base);
  free(order);
  return st;
}
