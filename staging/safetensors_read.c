/* ofl: reading a safetensors file. The header is checked by a small strict
 * JSON parser (staging/safetensors_header.c): anything the format does not
 * allow is OFL_ERR_CORRUPT with a message naming the problem, never a guess;
 * what the format allows and ofl cannot represent (dtypes, more than 8
 * dimensions) is OFL_ERR_NOT_SUPPORTED. Names are looked up by binary search
 * in an index sorted at open. */
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ofl/device.h>

#include "staging/safetensors_read.h"

/* ---- checks on the parsed entries ------------------------------------------ */

static int cmp_name(const void *a, const void *b) {
  return strcmp(((const rec_t *)a)->name, ((const rec_t *)b)->name);
}
static int cmp_offset(const void *a, const void *b) {
  const rec_t *x = a, *y = b;
  if (x->begin != y->begin)
    return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end)
    return x->end < y->end ? -1 : 1;
  return strcmp(x->name, y->name);
}

static ofl_status_t corrupt(const char *source, const char *fmt, ...)
    OFL__PRINTF(2, 3);
static ofl_status_t corrupt(const char *source, const char *fmt, ...) {
  char what[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_STAGING,
                    "safetensors '%s': %s; the file is not a valid safetensors "
                    "file",
                    source, what);
}

#define ULL(x) ((unsigned long long)(x))

static ofl_status_t check_entries(ofl_safetensors_t *st, const char *source) {
  uint64_t data_size = st->size - st->data_offset;
  if (st->n > 1) /* recs is NULL when there are none: qsort(NULL, ...) is UB */
    qsort(st->recs, st->n, sizeof *st->recs, cmp_name);
  for (size_t i = 1; i < st->n; i++)
    if (strcmp(st->recs[i - 1].name, st->recs[i].name) == 0)
      return corrupt(source, "tensor '%.64s' appears twice",
                     st->recs[i].name);
  for (size_t i = 0; i < st->n; i++) {
    const rec_t *r = &st->recs[i];
    size_t need = 0;
    if (r->end < r->begin)
      return corrupt(source, "tensor '%.64s' has data_offsets [%llu, %llu] "
                             "that end before they begin",
                     r->name, ULL(r->begin), ULL(r->end));
    if (r->end > data_size)
      return corrupt(source, "tensor '%.64s' ends at data offset %llu, past "
                             "the %llu data bytes in the file",
                     r->name, ULL(r->end), ULL(data_size));
    if (ofl__st_shape_bytes(r->shape, r->ndim, r->dtype, &need) !=
        OFL_SUCCESS)
      return corrupt(source, "tensor '%.64s' has a shape whose size in bytes "
                             "does not fit in size_t",
                     r->name);
    if (need != r->end - r->begin)
      return corrupt(source, "tensor '%.64s' has %llu data bytes but its shape "
                             "and dtype need %llu",
                     r->name, ULL(r->end - r->begin), ULL(need));
  }
  if (st->n > 1)
    qsort(st->recs, st->n, sizeof *st->recs, cmp_offset);
  uint64_t at = 0;
  for (size_t i = 0; i < st->n; i++) {
    const rec_t *r = &st->recs[i];
    if (r->begin < at)
      return corrupt(source, "tensor '%.64s' at data offset %llu overlaps the "
                             "tensor before it (which ends at %llu)",
                     r->name, ULL(r->begin), ULL(at));
    if (r->begin > at)
      return corrupt(source, "tensor '%.64s' starts at data offset %llu, "
                             "leaving a hole after offset %llu",
                     r->name, ULL(r->begin), ULL(at));
    at = r->end;
  }
  if (at != data_size)
    return corrupt(source, "%llu data bytes follow the last tensor, which "
                           "ends at %llu",
                   ULL(data_size - at), ULL(at));
  return OFL_SUCCESS;
}

static int cmp_key(const void *a, const void *b) {
  return strcmp((*(const ofl_safetensors_kv_t *const *)a)->key,
                (*(const ofl_safetensors_kv_t *const *)b)->key);
}

/* Duplicate metadata keys, found by sorting pointers (the pairs keep their
 * file order): a linear scan per key was quadratic, minutes for a header of
 * a few MB of short keys. */
static ofl_status_t check_metadata(ofl_safetensors_t *st, const char *source) {
  if (st->n_meta < 2)
    return OFL_SUCCESS;
  const ofl_safetensors_kv_t **v = malloc(st->n_meta * sizeof *v);
  if (v == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors '%s': out of host memory", source);
  for (size_t i = 0; i < st->n_meta; i++)
    v[i] = &st->meta[i];
  qsort(v, st->n_meta, sizeof *v, cmp_key);
  ofl_status_t s = OFL_SUCCESS;
  for (size_t i = 1; i < st->n_meta && s == OFL_SUCCESS; i++)
    if (strcmp(v[i - 1]->key, v[i]->key) == 0)
      s = corrupt(source, "metadata key \"%.40s\" appears twice", v[i]->key);
  free(v);
  return s;
}

static int cmp_rec_ptr_name(const void *a, const void *b) {
  return strcmp((*(const rec_t *const *)a)->name,
                (*(const rec_t *const *)b)->name);
}

/* The name index: restoring n tensors by name costs O(n log n), not
 * O(n^2) with a scan per name. */
static ofl_status_t build_index(ofl_safetensors_t *st, const char *source) {
  st->by_name = malloc((st->n ? st->n : 1) * sizeof *st->by_name);
  if (st->by_name == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors '%s': out of host memory for the name "
                      "index of %zu tensors",
                      source, st->n);
  for (size_t i = 0; i < st->n; i++)
    st->by_name[i] = &st->recs[i];
  if (st->n > 1)
    qsort(st->by_name, st->n, sizeof *st->by_name, cmp_rec_ptr_name);
  return OFL_SUCCESS;
}

static ofl_status_t load(ofl_safetensors_t *st, const char *source) {
  if (st->size < 8)
    return corrupt(source, "file of %zu bytes is shorter than the 8-byte "
                           "header length",
                   st->size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | st->image[i];
  if (n > OFL_SAFETENSORS_HEADER_MAX)
    return corrupt(source, "header length %llu is larger than the format's "
                           "limit of %zu bytes (the reference reader refuses "
                           "it too)",
                   ULL(n), OFL_SAFETENSORS_HEADER_MAX);
  if (n > st->size - 8)
    return corrupt(source, "header length %llu runs past the end of the "
                           "file (%zu bytes)",
                   ULL(n), st->size);
  st->data_offset = 8 + (size_t)n;
  parser_t ps = {(const char *)st->image + 8, (const char *)st->image + 8,
                 (const char *)st->image + 8 + n, source, OFL_SUCCESS, ""};
  OFL_CHECK(ofl__safetensors_parse_header(st, &ps));
  if (ps.unsupported[0] != '\0')
    return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_STAGING,
                      "safetensors '%s': %s; the file is valid but ofl "
                      "cannot load it (convert that tensor, e.g. to F32, "
                      "or load the file with another reader)",
                      source, ps.unsupported);
  OFL_CHECK(check_metadata(st, source));
  OFL_CHECK(check_entries(st, source));
  return build_index(st, source);
}

static ofl_status_t make(ofl_safetensors_t **out) {
  ofl_safetensors_t *st = calloc(1, sizeof *st);
  if (st == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors: out of host memory");
  *out = st;
  return OFL_SUCCESS;
}

ofl_status_t ofl_safetensors_parse(const void *image, size_t bytes,
                                   ofl_safetensors_t **out) {
  if ((image == NULL && bytes > 0) || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors parse: image or out is NULL");
  ofl_safetensors_t *st = NULL;
  OFL_CHECK(make(&st));
  st->image = malloc(bytes ? bytes : 1);
  if (st->image == NULL) {
    free(st);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "safetensors parse: out of host memory for %zu bytes",
                      bytes);
  }
  if (bytes > 0)
    memcpy(st->image, image, bytes);
  st->size = bytes;
  ofl_status_t s = load(st, "image");
  if (s != OFL_SUCCESS) {
    ofl_safetensors_close(st);
    return s;
  }
  *out = st;
  return OFL_SUCCESS;
}

ofl_status_t ofl_safetensors_open(const char *path, ofl_safetensors_t **out) {
  if (path == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors open: path or out is NULL");
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                      "safetensors open: cannot open '%s': %s; check the path",
                      path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    close(fd);
    return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                      "safetensors open: '%s' is not a regular file", path);
  }
  ofl_safetensors_t *st = NULL;
  ofl_status_t s = make(&st);
  if (s != OFL_SUCCESS) {
    close(fd);
    return s;
  }
  st->size = (size_t)sb.st_size;
  if (st->size > 0) {
    void *m = mmap(NULL, st->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      int err = errno;
      close(fd);
      free(st);
      return ofl__error(OFL_ERR_SYSTEM, OFL_SUBSYS_STAGING,
                        "safetensors open: cannot map '%s': %s", path,
                        strerror(err));
    }
    st->image = m;
    st->mapped = true;
  }
  close(fd);
  s = load(st, path);
  if (s != OFL_SUCCESS) {
    ofl_safetensors_close(st);
    return s;
  }
  *out = st;
  return OFL_SUCCESS;
}

void ofl_safetensors_close(ofl_safetensors_t *st) {
  if (st == NULL)
    return;
  for (size_t i = 0; i < st->n; i++)
    free(st->recs[i].name);
  for (size_t i = 0; i < st->n_meta; i++) {
    free((char *)st->meta[i].key);
    free((char *)st->meta[i].value);
  }
  free(st->recs);
  free(st->by_name);
  free(st->meta);
  if (st->mapped)
    munmap(st->image, st->size);
  else
    free(st->image);
  free(st);
}

size_t ofl_safetensors_count(const ofl_safetensors_t *st) {
  return st != NULL ? st->n : 0;
}

static void fill(const ofl_safetensors_t *st, const rec_t *r,
                 ofl_safetensors_entry_t *out) {
  out->name = r->name;
  out->dtype = r->dtype;
  out->ndim = r->ndim;
  memset(out->shape, 0, sizeof out->shape);
  memcpy(out->shape, r->shape, (size_t)r->ndim * sizeof r->shape[0]);
  out->data = st->image + st->data_offset + r->begin;
  out->bytes = (size_t)(r->end - r->begin);
}

ofl_status_t ofl_safetensors_get(const ofl_safetensors_t *st, size_t index,
                                 ofl_safetensors_entry_t *out) {
  if (st == NULL || out == NULL || index >= st->n)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors get: index %zu out of range (count %zu) or "
                      "NULL argument",
                      index, st != NULL ? st->n : 0);
  fill(st, &st->recs[index], out);
  return OFL_SUCCESS;
}

ofl_status_t ofl_safetensors_find(const ofl_safetensors_t *st,
                                  const char *name,
                                  ofl_safetensors_entry_t *out) {
  if (st == NULL || name == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors find: NULL argument");
  size_t lo = 0, hi = st->n;
  while (lo < hi) { /* binary search of the index sorted at open */
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(st->by_name[mid]->name, name);
    if (c == 0) {
      fill(st, st->by_name[mid], out);
      return OFL_SUCCESS;
    }
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return ofl__error_quiet(OFL_ERR_INVALID_ARG,
                          "safetensors find: no tensor named '%.64s'", name);
}

size_t ofl_safetensors_metadata_count(const ofl_safetensors_t *st) {
  return st != NULL ? st->n_meta : 0;
}

ofl_status_t ofl_safetensors_metadata(const ofl_safetensors_t *st,
                                      size_t index, ofl_safetensors_kv_t *out) {
  if (st == NULL || out == NULL || index >= st->n_meta)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors metadata: index %zu out of range or NULL "
                      "argument",
                      index);
  *out = st->meta[index];
  return OFL_SUCCESS;
}

const char *ofl_safetensors_metadata_get(const ofl_safetensors_t *st,
                                         const char *key) {
  if (st == NULL || key == NULL)
    return NULL;
  for (size_t i = 0; i < st->n_meta; i++)
    if (strcmp(st->meta[i].key, key) == 0)
      return st->meta[i].value;
  return NULL;
}

size_t ofl_safetensors_data_offset(const ofl_safetensors_t *st) {
  return st != NULL ? st->data_offset : 0;
}

ofl_status_t ofl_safetensors_copy_to(const ofl_safetensors_t *st,
                                     const char *name, ofl_tensor_t *dst,
                                     ofl_stream_t *stream) {
  if (st == NULL || name == NULL || dst == NULL || stream == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors copy_to: NULL argument");
  ofl_safetensors_entry_t e;
  if (ofl_safetensors_find(st, name, &e) != OFL_SUCCESS)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors copy_to: the file has no tensor '%.128s'",
                      name);
  int ndim = ofl_tensor_ndim(dst);
  const int64_t *shape = ofl_tensor_shape(dst);
  bool same = ofl_tensor_dtype(dst) == e.dtype && ndim == e.ndim;
  for (int d = 0; same && d < ndim; d++)
    same = shape[d] == e.shape[d];
  if (!same) {
    char a[160], b[160];
    ofl__shape_str(e.shape, e.ndim, a, sizeof a);
    ofl__shape_str(shape, ndim, b, sizeof b);
    return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_STAGING,
                      "safetensors copy_to: tensor '%.128s' is %s %s in the "
                      "file but the destination is %s %s; restore into a "
                      "tensor of the saved dtype and shape",
                      name, ofl_safetensors_dtype_name(e.dtype), a,
                      ofl_safetensors_dtype_name(ofl_tensor_dtype(dst)), b);
  }
  ofl_location_t loc = ofl_tensor_location(dst);
  if (loc != OFL_LOC_DEVICE && loc != OFL_LOC_PINNED)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "safetensors copy_to: destination of '%.128s' has no "
                      "device or host storage",
                      name);
  if (e.bytes == 0)
    return OFL_SUCCESS;
  return ofl_memcpy_async(ofl_tensor_data(dst), e.data, e.bytes,
                          loc == OFL_LOC_DEVICE ? OFL_COPY_H2D : OFL_COPY_H2H,
                          stream);
}
