/* ofl: rendering of the summary: the reference text table (MB, 2 decimals),
 * JSON and CSV (exact bytes). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/summary_internal.h"

#define TITLE "Activation Offload Summary (MB)"

/* ---- a growing string ------------------------------------------------------
 */

typedef struct sbuf {
  char *p;
  size_t len, cap;
  bool oom;
} sbuf_t;

static void sb_reserve(sbuf_t *b, size_t more) {
  if (b->oom || b->len + more + 1 <= b->cap)
    return;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < b->len + more + 1)
    cap *= 2;
  char *np = realloc(b->p, cap);
  if (!np) {
    b->oom = true;
    return;
  }
  b->p = np;
  b->cap = cap;
}

static void sb_add(sbuf_t *b, const char *s, size_t n) {
  sb_reserve(b, n);
  if (b->oom)
    return;
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void sb_str(sbuf_t *b, const char *s) { sb_add(b, s, strlen(s)); }

static void sb_fill(sbuf_t *b, char ch, size_t n) {
  sb_reserve(b, n);
  if (b->oom)
    return;
  memset(b->p + b->len, ch, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void sb_printf(sbuf_t *b, const char *fmt, ...) OFL__PRINTF(2, 3);
static void sb_printf(sbuf_t *b, const char *fmt, ...) {
  char small[64];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(small, sizeof(small), fmt, ap);
  va_end(ap);
  if (n < 0) {
    b->oom = true;
    return;
  }
  if ((size_t)n < sizeof(small)) {
    sb_add(b, small, (size_t)n);
    return;
  }
  sb_reserve(b, (size_t)n);
  if (b->oom)
    return;
  va_start(ap, fmt);
  vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

/* Left- or right-justified in width columns (never truncated). */
static void sb_just(sbuf_t *b, const char *s, size_t width, bool left) {
  size_t n = strlen(s);
  if (!left && n < width)
    sb_fill(b, ' ', width - n);
  sb_add(b, s, n);
  if (left && n < width)
    sb_fill(b, ' ', width - n);
}

/* ---- text ------------------------------------------------------------------
 */

/* bytes / 2^20 with two decimals, exact, ties to even (as Python's
 * format(x, ".2f") rounds the exactly representable quotient). */
static void format_mb(uint64_t bytes, char *out, size_t cap) {
  uint64_t whole = bytes >> 20;
  uint64_t num = (bytes & ((1u << 20) - 1)) * 100u;
  uint64_t cents = num >> 20, rem = num & ((1u << 20) - 1);
  if (rem > (1u << 19) || (rem == (1u << 19) && (cents & 1u)))
    cents++;
  if (cents == 100) {
    whole++;
    cents = 0;
  }
  snprintf(out, cap, "%llu.%02u", (unsigned long long)whole, (unsigned)cents);
}

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

static void render_text(const ofl_summary_t *s, sbuf_t *b) {
  char cell[32], label[32];
  snprintf(label, sizeof(label), "Rank %d", s->nranks - 1);
  size_t rank_w = max_sz(6, strlen(label) + 2);
  /* The reference sizes every group column max(12, longest name + 2); a
   * value wider than that widens the columns instead of breaking them. */
  size_t col_w = 12;
  for (size_t g = 0; g < s->ngroups; g++)
    col_w = max_sz(col_w, strlen(s->names[g]) + 2);
  format_mb(s->total, cell, sizeof(cell)); /* the widest value */
  col_w = max_sz(col_w, strlen(cell) + 2);
  size_t width = rank_w + col_w * (s->ngroups + 1);

  sb_fill(b, '=', width);
  sb_str(b, "\n");
  /* Centred as Python's str.center does it. */
  size_t tl = strlen(TITLE);
  if (width > tl) {
    size_t marg = width - tl, left = marg / 2 + (marg & width & 1);
    sb_fill(b, ' ', left);
    sb_str(b, TITLE);
    sb_fill(b, ' ', marg - left);
  } else {
    sb_str(b, TITLE);
  }
  sb_str(b, "\n");
  sb_fill(b, '=', width);
  sb_str(b, "\n");

  sb_just(b, "Rank", rank_w, true);
  for (size_t g = 0; g < s->ngroups; g++)
    sb_just(b, s->names[g], col_w, false);
  sb_just(b, "Total", col_w, false);
  sb_str(b, "\n");
  sb_fill(b, '-', width);
  sb_str(b, "\n");

  for (int r = 0; r < s->nranks; r++) {
    snprintf(label, sizeof(label), "Rank %d", r);
    sb_just(b, label, rank_w, true);
    for (size_t g = 0; g < s->ngroups; g++) {
      format_mb(s->cells[(size_t)r * s->ngroups + g], cell, sizeof(cell));
      sb_just(b, cell, col_w, false);
    }
    format_mb(s->rank_totals[r], cell, sizeof(cell));
    sb_just(b, cell, col_w, false);
    sb_str(b, "\n");
  }
  sb_fill(b, '-', width);
  sb_str(b, "\n");
  sb_just(b, "Total", rank_w, true);
  for (size_t g = 0; g < s->ngroups; g++) {
    format_mb(s->group_totals[g], cell, sizeof(cell));
    sb_just(b, cell, col_w, false);
  }
  format_mb(s->total, cell, sizeof(cell));
  sb_just(b, cell, col_w, false);
  sb_str(b, "\n");
  sb_fill(b, '=', width);
  sb_str(b, "\n");
}

/* ---- JSON ------------------------------------------------------------------
 */

/* Names have no control characters (checked when they enter a table). */
static void json_string(sbuf_t *b, const char *s) {
  sb_str(b, "\"");
  for (; *s; s++) {
    if (*s == '"' || *s == '\\')
      sb_str(b, "\\");
    sb_add(b, s, 1);
  }
  sb_str(b, "\"");
}

static void json_u64s(sbuf_t *b, const uint64_t *v, size_t n) {
  sb_str(b, "[");
  for (size_t i = 0; i < n; i++)
    sb_printf(b, "%s%llu", i ? ", " : "", (unsigned long long)v[i]);
  sb_str(b, "]");
}

static void render_json(const ofl_summary_t *s, sbuf_t *b) {
  sb_str(b, "{\n  \"title\": \"Activation Offload Summary\",\n"
            "  \"unit\": \"bytes\",\n");
  sb_printf(b, "  \"nranks\": %d,\n  \"groups\": [", s->nranks);
  for (size_t g = 0; g < s->ngroups; g++) {
    if (g)
      sb_str(b, ", ");
    json_string(b, s->names[g]);
  }
  sb_str(b, "],\n  \"bytes\": [\n");
  for (int r = 0; r < s->nranks; r++) {
    sb_str(b, "    ");
    json_u64s(b, s->cells + (size_t)r * s->ngroups, s->ngroups);
    sb_str(b, r + 1 < s->nranks ? ",\n" : "\n");
  }
  sb_str(b, "  ],\n  \"rank_totals\": ");
  json_u64s(b, s->rank_totals, (size_t)s->nranks);
  sb_str(b, ",\n  \"group_totals\": ");
  json_u64s(b, s->group_totals, s->ngroups);
  sb_printf(b, ",\n  \"total\": %llu\n}\n", (unsigned long long)s->total);
}

/* ---- CSV (RFC 4180, LF line ends) ------------------------------------------
 */

static void csv_field(sbuf_t *b, const char *s) {
  size_t n = strlen(s);
  bool quote = strpbrk(s, ",\"") != NULL || s[0] == ' ' || s[n - 1] == ' ';
  if (!quote) {
    sb_add(b, s, n);
    return;
  }
  sb_str(b, "\"");
  for (; *s; s++) {
    if (*s == '"')
      sb_str(b, "\"");
    sb_add(b, s, 1);
  }
  sb_str(b, "\"");
}

static void render_csv(const ofl_summary_t *s, sbuf_t *b) {
  sb_str(b, "rank");
  for (size_t g = 0; g < s->ngroups; g++) {
    sb_str(b, ",");
    csv_field(b, s->names[g]);
  }
  sb_str(b, ",total\n");
  for (int r = 0; r < s->nranks; r++) {
    sb_printf(b, "%d", r);
    for (size_t g = 0; g < s->ngroups; g++)
      sb_printf(b, ",%llu",
                (unsigned long long)s->cells[(size_t)r * s->ngroups + g]);
    sb_printf(b, ",%llu\n", (unsigned long long)s->rank_totals[r]);
  }
  sb_str(b, "total");
  for (size_t g = 0; g < s->ngroups; g++)
    sb_printf(b, ",%llu", (unsigned long long)s->group_totals[g]);
  sb_printf(b, ",%llu\n", (unsigned long long)s->total);
}

/* ---- entry points ----------------------------------------------------------
 */

ofl_status_t ofl_summary_render(const ofl_summary_t *s,
                                ofl_summary_format_t format, char **out,
                                size_t *out_len) {
  if (!s || !out)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_summary_render: %s is NULL", !s ? "summary" : "out");
  sbuf_t b = {0};
  switch (format) {
  case OFL_SUMMARY_TEXT:
    render_text(s, &b);
    break;
  case OFL_SUMMARY_JSON:
    render_json(s, &b);
    break;
  case OFL_SUMMARY_CSV:
    render_csv(s, &b);
    break;
  default:
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_summary_render: unknown format %d; use "
                      "OFL_SUMMARY_TEXT, _JSON or _CSV",
                      (int)format);
  }
  if (b.oom || !b.p) {
    free(b.p);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "ofl_summary_render: out of memory rendering %d ranks "
                      "x %zu groups",
                      s->nranks, s->ngroups);
  }
  if (out_len)
    *out_len = b.len;
  *out = b.p;
  return OFL_SUCCESS;
}

ofl_status_t ofl_summary_write(const ofl_summary_t *s,
                               ofl_summary_format_t format, FILE *f) {
  if (!f)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_summary_write: the FILE is NULL");
  char *text = NULL;
  size_t len = 0;
  OFL_CHECK(ofl_summary_render(s, format, &text, &len));
  size_t wrote = fwrite(text, 1, len, f);
  int flushed = fflush(f);
  free(text);
  if (wrote != len || flushed != 0)
    return ofl__error(OFL_ERR_IO, OFL_SUBSYS_COLL,
                      "ofl_summary_write: wrote %zu of %zu bytes (disk full "
                      "or closed pipe?)",
                      wrote, len);
  return OFL_SUCCESS;
}
