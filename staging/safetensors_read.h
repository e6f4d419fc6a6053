/* ofl: what the safetensors reader (staging/safetensors_read.c) and its
 * header parser (staging/safetensors_header.c) share: the open file's
 * entries and the parser's state. Not installed. */
#ifndef OFL_STAGING_SAFETENSORS_READ_H
#define OFL_STAGING_SAFETENSORS_READ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ofl/safetensors.h>

#include "staging/staging_internal.h"

typedef struct {
  char *name;
  ofl_dtype_t dtype;
  int ndim;
  int64_t shape[OFL_MAX_DIMS];
  uint64_t begin, end;
} rec_t;

struct ofl_safetensors {
  unsigned char *image;
  size_t size;
  bool mapped;
  size_t data_offset;
  rec_t *recs; /* sorted by offset */
  size_t n, cap;
  const rec_t **by_name; /* recs sorted by name, for find */
  ofl_safetensors_kv_t *meta;
  size_t n_meta, cap_meta;
};

/* The header parser's state: the header's bytes, where it stands, the
 * first error. */
typedef struct {
  const char *start, *p, *end;
  const char *source; /* file name or "image" for messages */
  ofl_status_t st;
  /* The first thing the format allows and ofl cannot represent; reported
   * (OFL_ERR_NOT_SUPPORTED) once the whole header parsed, so that a file
   * with a syntax error is still called corrupt. */
  char unsupported[320];
} parser_t;

/* Parses the header JSON of [ps->p, ps->end) into st's entries and
 * metadata: OFL_ERR_CORRUPT (reported, also in ps->st) on anything the
 * format does not allow; what it allows and ofl cannot represent is noted
 * in ps->unsupported for the caller to report once the whole header
 * parsed. */
ofl_status_t ofl__safetensors_parse_header(ofl_safetensors_t *st,
                                           parser_t *ps);

#endif /* OFL_STAGING_SAFETENSORS_READ_H */
