/* ofl: the safetensors header parser, a small strict JSON parser: anything
 * the format does not allow is OFL_ERR_CORRUPT with a message naming the
 * problem, never a guess; what the format allows and ofl cannot represent
 * (dtypes, more than 8 dimensions) is noted for the reader
 * (staging/safetensors_read.c) to report as OFL_ERR_NOT_SUPPORTED. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "staging/safetensors_read.h"

static void note_unsupported(parser_t *ps, const char *name, const char *what,
                             const char *detail) {
  if (ps->unsupported[0] != '\0')
    return;
  snprintf(ps->unsupported, sizeof ps->unsupported, "tensor '%.64s' %s%.40s",
           name, what, detail);
}

/* Dtypes of the format (safetensors 0.6) that ofl_dtype_t has no value for:
 * a file using them is valid, just not loadable here. */
static const char *const format_only_dtypes[] = {"F4", "F6_E2M3", "F6_E3M2",
                                                 "F8_E8M0", "C64"};

static ofl_status_t fail(parser_t *ps, const char *fmt, const char *detail) {
  if (ps->st != OFL_SUCCESS)
    return ps->st;
  char what[256];
  snprintf(what, sizeof what, fmt, detail ? detail : "");
  ps->st = ofl__error(OFL_ERR_CORRUPT, OFL_SUBSYS_STAGING,
                      "safetensors '%s': %s (header byte %zu); the file is not "
                      "a valid safetensors file",
                      ps->source, what, (size_t)(ps->p - ps->start));
  return ps->st;
}

static void skip_ws(parser_t *ps) {
  while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' ||
                             *ps->p == '\n' || *ps->p == '\r'))
    ps->p++;
}

static bool expect(parser_t *ps, char c) {
  skip_ws(ps);
  if (ps->p < ps->end && *ps->p == c) {
    ps->p++;
    return true;
  }
  char want[2] = {c, 0};
  fail(ps, "expected '%s'", want);
  return false;
}

static bool peek(parser_t *ps, char c) {
  skip_ws(ps);
  return ps->p < ps->end && *ps->p == c;
}

static int hex4(const char *p) {
  int v = 0;
  for (int i = 0; i < 4; i++) {
    char c = p[i];
    v <<= 4;
    if (c >= '0' && c <= '9')
      v |= c - '0';
    else if (c >= 'a' && c <= 'f')
      v |= c - 'a' + 10;
    else if (c >= 'A' && c <= 'F')
      v |= c - 'A' + 10;
    else
      return -1;
  }
  return v;
}

static size_t put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xe0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  o[0] = (char)(0xf0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
  o[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

/* A JSON string, unescaped into a new NUL-terminated UTF-8 buffer. */
static char *parse_string(parser_t *ps) {
  if (!expect(ps, '"'))
    return NULL;
  const char *q = ps->p;
  while (q < ps->end && *q != '"') /* the unescaped form is never longer */
    q += (*q == '\\' && q + 1 < ps->end) ? 2 : 1;
  if (q >= ps->end) {
    fail(ps, "unterminated string", NULL);
    return NULL;
  }
  char *out = malloc((size_t)(q - ps->p) + 1);
  if (out == NULL) {
    ps->st = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                        "safetensors '%s': out of host memory", ps->source);
    return NULL;
  }
  size_t n = 0;
  while (ps->p < q) {
    unsigned char c = (unsigned char)*ps->p;
    if (c < 0x20) {
      fail(ps, "control character inside a string", NULL);
      goto bad;
    }
    if (c != '\\') {
      out[n++] = (char)c;
      ps->p++;
      continue;
    }
    ps->p++;
    char e = *ps->p++;
    switch (e) {
    case '"': out[n++] = '"'; break;
    case '\\': out[n++] = '\\'; break;
    case '/': out[n++] = '/'; break;
    case 'b': out[n++] = '\b'; break;
    case 'f': out[n++] = '\f'; break;
    case 'n': out[n++] = '\n'; break;
    case 'r': out[n++] = '\r'; break;
    case 't': out[n++] = '\t'; break;
    case 'u': {
      int hi = (q - ps->p >= 4) ? hex4(ps->p) : -1;
      if (hi < 0) {
        fail(ps, "bad \\u escape", NULL);
        goto bad;
      }
      ps->p += 4;
      uint32_t cp = (uint32_t)hi;
      if (hi >= 0xd800 && hi <= 0xdbff) {
        int lo = (q - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u')
                     ? hex4(ps->p + 2)
                     : -1;
        if (lo < 0xdc00 || lo > 0xdfff) {
          fail(ps, "unpaired surrogate in a \\u escape", NULL);
          goto bad;
        }
        ps->p += 6;
        cp = 0x10000 + (((uint32_t)hi - 0xd800) << 10) + ((uint32_t)lo - 0xdc00);
      } else if (hi >= 0xdc00 && hi <= 0xdfff) {
        fail(ps, "unpaired surrogate in a \\u escape", NULL);
        goto bad;
      } else if (hi == 0) {
        fail(ps, "NUL character in a string", NULL);
        goto bad;
      }
      n += put_utf8(out + n, cp);
      break;
    }
    default:
      fail(ps, "bad escape in a string", NULL);
      goto bad;
    }
  }
  ps->p = q + 1;
  out[n] = '\0';
  if (!ofl__utf8_valid(out, n)) {
    fail(ps, "string is not valid UTF-8", NULL);
    goto bad;
  }
  return out;
bad:
  free(out);
  return NULL;
}

/* A non-negative JSON integer that fits in 63 bits. */
static bool parse_uint(parser_t *ps, uint64_t *out) {
  skip_ws(ps);
  const char *s = ps->p;
  uint64_t v = 0;
  while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
    unsigned d = (unsigned)(*ps->p - '0');
    if (v > ((uint64_t)INT64_MAX - d) / 10) {
      fail(ps, "integer too large", NULL);
      return false;
    }
    v = v * 10 + d;
    ps->p++;
  }
  if (ps->p == s) {
    fail(ps, "expected a non-negative integer", NULL);
    return false;
  }
  if (ps->p - s > 1 && *s == '0') {
    fail(ps, "integer with a leading zero", NULL);
    return false;
  }
  if (ps->p < ps->end && (*ps->p == '.' || *ps->p == 'e' || *ps->p == 'E')) {
    fail(ps, "expected an integer, found a fraction or exponent", NULL);
    return false;
  }
  *out = v;
  return true;
}

static bool parse_dtype(parser_t *ps, const char *name, ofl_dtype_t *out) {
  char *s = parse_string(ps);
  if (s == NULL)
    return false;
  for (int d = 0; d < OFL_DTYPE_COUNT; d++) {
    if (strcmp(s, ofl_safetensors_dtype_name((ofl_dtype_t)d)) == 0) {
      free(s);
      *out = (ofl_dtype_t)d;
      return true;
    }
  }
  for (size_t i = 0;
       i < sizeof format_only_dtypes / sizeof format_only_dtypes[0]; i++) {
    if (strcmp(s, format_only_dtypes[i]) == 0) {
      note_unsupported(ps, name, "has dtype ", s);
      free(s);
      *out = OFL_DTYPE_COUNT;
      return true;
    }
  }
  fail(ps, "unknown dtype \"%.40s\"", s);
  free(s);
  return false;
}

/* {"dtype":..., "shape":[...], "data_offsets":[b,e]}, each exactly once. */
static bool parse_tensor(parser_t *ps, rec_t *r) {
  bool have_dtype = false, have_shape = false, have_offsets = false;
  if (!expect(ps, '{'))
    return false;
  if (peek(ps, '}'))
    return fail(ps, "tensor entry without dtype, shape, data_offsets", NULL),
           false;
  do {
    char *key = parse_string(ps);
    if (key == NULL || !expect(ps, ':')) {
      free(key);
      return false;
    }
    bool ok = true;
    if (strcmp(key, "dtype") == 0 && !have_dtype) {
      have_dtype = true;
      ok = parse_dtype(ps, r->name, &r->dtype);
    } else if (strcmp(key, "shape") == 0 && !have_shape) {
      have_shape = true;
      ok = expect(ps, '[');
      r->ndim = 0;
      int dims = 0;
      if (ok && !peek(ps, ']')) {
        do {
          uint64_t v = 0;
          if (!(ok = parse_uint(ps, &v)))
            break;
          if (dims < OFL_MAX_DIMS) /* more are valid, and unsupported */
            r->shape[dims] = (int64_t)v;
          dims++;
          skip_ws(ps);
        } while (ps->p < ps->end && *ps->p == ',' && ps->p++);
      }
      ok = ok && expect(ps, ']');
      r->ndim = dims <= OFL_MAX_DIMS ? dims : OFL_MAX_DIMS;
      if (ok && dims > OFL_MAX_DIMS) {
        char what[96];
        snprintf(what, sizeof what, "has %d dimensions; ofl supports at most "
                                    "%d", dims, OFL_MAX_DIMS);
        note_unsupported(ps, r->name, what, "");
      }
    } else if (strcmp(key, "data_offsets") == 0 && !have_offsets) {
      have_offsets = true;
      ok = expect(ps, '[') && parse_uint(ps, &r->begin) && expect(ps, ',') &&
           parse_uint(ps, &r->end) && expect(ps, ']');
    } else {
      fail(ps, "unknown or repeated key \"%.40s\" in a tensor entry", key);
      ok = false;
    }
    free(key);
    if (!ok)
      return false;
    skip_ws(ps);
  } while (ps->p < ps->end && *ps->p == ',' && ps->p++);
  if (!expect(ps, '}'))
    return false;
  if (!have_dtype || !have_shape || !have_offsets)
    return fail(ps, "tensor entry misses dtype, shape or data_offsets", NULL),
           false;
  return true;
}

static bool add_meta(ofl_safetensors_t *st, parser_t *ps, char *k, char *v) {
  if (st->n_meta == st->cap_meta) {
    size_t cap = st->cap_meta ? 2 * st->cap_meta : 8;
    ofl_safetensors_kv_t *m = realloc(st->meta, cap * sizeof *m);
    if (m == NULL) {
      free(k), free(v);
      ps->st = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                          "safetensors '%s': out of host memory", ps->source);
      return false;
    }
    st->meta = m, st->cap_meta = cap;
  }
  st->meta[st->n_meta++] = (ofl_safetensors_kv_t){k, v};
  return true;
}

static bool parse_metadata(ofl_safetensors_t *st, parser_t *ps) {
  skip_ws(ps);
  if (ps->end - ps->p >= 4 && memcmp(ps->p, "null", 4) == 0) {
    ps->p += 4;
    return true;
  }
  if (!expect(ps, '{'))
    return false;
  if (peek(ps, '}'))
    return ps->p++, true;
  do {
    char *k = parse_string(ps);
    if (k == NULL)
      return false;
    char *v = NULL;
    if (expect(ps, ':') && !peek(ps, '"'))
      fail(ps, "metadata value of \"%.40s\" is not a string", k);
    if (ps->st != OFL_SUCCESS || (v = parse_string(ps)) == NULL) {
      free(k);
      return false;
    }
    if (!add_meta(st, ps, k, v))
      return false;
    skip_ws(ps);
  } while (ps->p < ps->end && *ps->p == ',' && ps->p++);
  return expect(ps, '}');
}

static bool add_rec(ofl_safetensors_t *st, parser_t *ps, const rec_t *r) {
  if (st->n == st->cap) {
    size_t cap = st->cap ? 2 * st->cap : 16;
    rec_t *nr = realloc(st->recs, cap * sizeof *nr);
    if (nr == NULL) {
      ps->st = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                          "safetensors '%s': out of host memory", ps->source);
      return false;
    }
    st->recs = nr, st->cap = cap;
  }
  st->recs[st->n++] = *r;
  return true;
}

ofl_status_t ofl__safetensors_parse_header(ofl_safetensors_t *st,
                                           parser_t *ps) {
  bool seen_meta = false;
  skip_ws(ps);
  if (ps->p >= ps->end || *ps->p != '{')
    return fail(ps, "header does not start with '{'", NULL);
  ps->p++;
  if (peek(ps, '}')) {
    ps->p++;
  } else {
    do {
      char *key = parse_string(ps);
      if (key == NULL || !expect(ps, ':')) {
        free(key);
        return ps->st;
      }
      if (strcmp(key, "__metadata__") == 0) {
        free(key);
        if (seen_meta)
          return fail(ps, "__metadata__ appears twice", NULL);
        seen_meta = true;
        if (!parse_metadata(st, ps))
          return ps->st;
      } else {
        rec_t r = {.name = key};
        if (!parse_tensor(ps, &r) || !add_rec(st, ps, &r)) {
          free(key);
          return ps->st;
        }
      }
      skip_ws(ps);
    } while (ps->p < ps->end && *ps->p == ',' && ps->p++);
    if (!expect(ps, '}'))
      return ps->st;
  }
  skip_ws(ps); /* the writer pads with spaces */
  if (ps->p != ps->end)
    return fail(ps, "unexpected bytes after the header object", NULL);
  return OFL_SUCCESS;
}
