/* ofl: the summary (rank x group matrix with totals): built from per-rank
 * tables, gathered over a comm, and its accessors. */
#include <stdlib.h>
#include <string.h>

#include "collectives/summary_internal.h"

void ofl_summary_destroy(ofl_summary_t *s) {
  if (!s)
    return;
  for (size_t g = 0; g < s->ngroups; g++)
    free(s->names[g]);
  free(s->names);
  free(s->cells);
  free(s->rank_totals);
  free(s->group_totals);
  free(s);
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The sorted union of every table's names (borrowed pointers). */
static ofl_status_t union_names(const ofl_byte_table_t *const *tables,
                                int nranks, const char ***out, size_t *out_n) {
  size_t all = 0;
  for (int r = 0; r < nranks; r++)
    all += tables[r] ? tables[r]->count : 0;
  const char **names = malloc((all ? all : 1) * sizeof(*names));
  if (!names)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "summary: cannot allocate %zu names", all);
  size_t n = 0;
  for (int r = 0; r < nranks; r++)
    for (size_t i = 0; tables[r] && i < tables[r]->count; i++)
      names[n++] = tables[r]->entries[i].name;
  qsort(names, n, sizeof(*names), cmp_name);
  size_t u = 0;
  for (size_t i = 0; i < n; i++)
    if (u == 0 || strcmp(names[u - 1], names[i]) != 0)
      names[u++] = names[i];
  *out = names;
  *out_n = u;
  return OFL_SUCCESS;
}

static size_t group_index(char *const *names, size_t n, const char *name) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(names[mid], name);
    if (c == 0)
      return mid;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return n; /* unreachable: every name is in the union */
}

static ofl_status_t add_checked(uint64_t *acc, uint64_t v, const char *what) {
  if (v > UINT64_MAX - *acc)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "summary: the %s exceeds 64 bits", what);
  *acc += v;
  return OFL_SUCCESS;
}

static ofl_status_t fill(ofl_summary_t *s,
                         const ofl_byte_table_t *const *tables) {
  for (int r = 0; r < s->nranks; r++) {
    const ofl_byte_table_t *t = tables[r];
    for (size_t i = 0; t && i < t->count; i++) {
      size_t g = group_index(s->names, s->ngroups, t->entries[i].name);
      uint64_t b = t->entries[i].bytes;
      s->cells[(size_t)r * s->ngroups + g] = b;
      OFL_CHECK(add_checked(&s->rank_totals[r], b, "total of a rank"));
      OFL_CHECK(add_checked(&s->group_totals[g], b, "total of a group"));
      OFL_CHECK(add_checked(&s->total, b, "grand total"));
    }
  }
  return OFL_SUCCESS;
}

ofl_status_t ofl_summary_from_tables(const ofl_byte_table_t *const *tables,
                                     int nranks, ofl_summary_t **out) {
  if (!out || nranks <= 0 || !tables)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_summary_from_tables: need tables, nranks > 0 (got "
                      "%d) and out",
                      nranks);
  const char **names = NULL;
  size_t n = 0;
  OFL_CHECK(union_names(tables, nranks, &names, &n));
  ofl_status_t st = OFL_ERR_NO_MEMORY;
  ofl_summary_t *s = calloc(1, sizeof(*s));
  if (!s)
    goto fail;
  s->nranks = nranks;
  s->names = calloc(n ? n : 1, sizeof(char *));
  size_t ncells = (size_t)nranks * n;
  s->cells = calloc(ncells ? ncells : 1, sizeof(uint64_t));
  s->rank_totals = calloc((size_t)nranks, sizeof(uint64_t));
  s->group_totals = calloc(n ? n : 1, sizeof(uint64_t));
  if (!s->names || !s->cells || !s->rank_totals || !s->group_totals)
    goto fail;
  for (; s->ngroups < n; s->ngroups++) {
    s->names[s->ngroups] = strdup(names[s->ngroups]);
    if (!s->names[s->ngroups])
      goto fail;
  }
  st = fill(s, tables);
  if (st != OFL_SUCCESS)
    goto fail;
  free(names);
  *out = s;
  return OFL_SUCCESS;
fail:
  if (st == OFL_ERR_NO_MEMORY)
    ofl__error(st, OFL_SUBSYS_COLL,
               "summary: out of memory building %d ranks x %zu groups", nranks,
               n);
  ofl_summary_destroy(s);
  free(names);
  return st;
}

/* Builds the summary from every rank's encoded table. */
static ofl_status_t from_blobs(const ofl__blobs_t *b, ofl_summary_t **out) {
  ofl_byte_table_t **tables = calloc((size_t)b->nranks, sizeof(*tables));
  if (!tables)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_COLL,
                      "summary: out of memory for %d tables", b->nranks);
  ofl_status_t st = OFL_SUCCESS;
  for (int r = 0; r < b->nranks && st == OFL_SUCCESS; r++)
    st = ofl__byte_table_decode(b->data + b->offsets[r], b->lens[r], r,
                                &tables[r]);
  if (st == OFL_SUCCESS)
    st = ofl_summary_from_tables((const ofl_byte_table_t *const *)tables,
                                 b->nranks, out);
  for (int r = 0; r < b->nranks; r++)
    ofl_byte_table_destroy(tables[r]);
  free(tables);
  return st;
}

ofl_status_t ofl_summary_gather(ofl_comm_t *comm, const ofl_byte_table_t *local,
                                int root_only, ofl_summary_t **out) {
  if (!out)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_summary_gather: out is NULL");
  ofl_comm_t *self = NULL;
  if (!comm) {
    OFL_CHECK(ofl_comm_create_self(NULL, &self));
    comm = self;
  }
  /* A NULL table is a rank with nothing offloaded: it still has a row. */
  unsigned char *mine = NULL;
  size_t len = 0;
  ofl__blobs_t b = {0};
  ofl_summary_t *s = NULL;
  ofl_status_t st = ofl__byte_table_encode(local, &mine, &len);
  bool gathered = false;
  if (st == OFL_SUCCESS) {
    st = ofl__comm_gather(comm, mine, len, !root_only, &b);
    gathered = st == OFL_SUCCESS;
  }
  if (st == OFL_SUCCESS && (!root_only || comm->rank == 0))
    st = from_blobs(&b, &s);
  if (gathered && root_only && comm->size > 1) {
    /* Every rank learns whether rank 0 built the summary: the others were
     * told the gather succeeded before rank 0 built it. */
    int32_t root_st = (int32_t)st;
    ofl__blobs_t agree = {0};
    ofl_status_t a =
        ofl__comm_gather(comm, &root_st, sizeof root_st, true, &agree);
    if (a == OFL_SUCCESS && agree.nranks > 0 && agree.lens[0] == sizeof root_st)
      memcpy(&root_st, agree.data + agree.offsets[0], sizeof root_st);
    ofl__blobs_free(&agree);
    if (a != OFL_SUCCESS && st == OFL_SUCCESS) {
      st = a;
      ofl_summary_destroy(s);
      s = NULL;
    } else if (comm->rank != 0 && st == OFL_SUCCESS &&
               root_st != (int32_t)OFL_SUCCESS)
      st = ofl__error((ofl_status_t)root_st, OFL_SUBSYS_COLL,
                      "ofl_summary_gather: rank 0 could not build the "
                      "summary (%s); its log says why",
                      ofl_status_str((ofl_status_t)root_st));
  }
  if (st == OFL_SUCCESS) {
    OFL_INFO(OFL_SUBSYS_COLL,
             "summary gathered on rank %d of %d (%s comm): %zu groups, total "
             "bytes %llu",
             comm->rank, comm->size, ofl_comm_kind_name(comm->kind),
             s ? s->ngroups : 0, s ? (unsigned long long)s->total : 0ull);
    *out = s;
  }
  ofl__blobs_free(&b);
  free(mine);
  ofl_comm_destroy(self);
  return st;
}

/* ---- accessors -------------------------------------------------------------
 */

int ofl_summary_nranks(const ofl_summary_t *s) { return s ? s->nranks : 0; }
size_t ofl_summary_ngroups(const ofl_summary_t *s) {
  return s ? s->ngroups : 0;
}

const char *ofl_summary_group_name(const ofl_summary_t *s, size_t g) {
  return s && g < s->ngroups ? s->names[g] : NULL;
}

ofl_status_t ofl_summary_find_group(const ofl_summary_t *s, const char *name,
                                    size_t *out) {
  if (!s || !name || !out)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_COLL,
                      "ofl_summary_find_group: summary, name and out must "
                      "not be NULL");
  size_t g = group_index(s->names, s->ngroups, name);
  if (g == s->ngroups)
    return ofl__error_quiet(OFL_ERR_INVALID_ARG,
                            "ofl_summary_find_group: no group '%s' in the "
                            "summary",
                            name);
  *out = g;
  return OFL_SUCCESS;
}

uint64_t ofl_summary_bytes(const ofl_summary_t *s, int rank, size_t g) {
  if (!s || rank < 0 || rank >= s->nranks || g >= s->ngroups)
    return 0;
  return s->cells[(size_t)rank * s->ngroups + g];
}

uint64_t ofl_summary_rank_total(const ofl_summary_t *s, int rank) {
  return s && rank >= 0 && rank < s->nranks ? s->rank_totals[rank] : 0;
}

uint64_t ofl_summary_group_total(const ofl_summary_t *s, size_t g) {
  return s && g < s->ngroups ? s->group_totals[g] : 0;
}

uint64_t ofl_summary_total(const ofl_summary_t *s) { return s ? s->total : 0; }
