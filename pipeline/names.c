/* ofl: the pipeline's shared records: growing arrays, comma-separated
 * lists and the table of group names (a chunk keeps its names as a bit
 * mask of their ids). The lowest file of pipeline/: it calls no other. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"
#include "pool/pool_internal.h"

/* Grows *arr to hold need elements (doubling); new elements are zeroed. */
ofl_status_t ofl__grow(void **arr, uint32_t *cap, uint32_t need, size_t elem) {
  if (need <= *cap)
    return OFL_SUCCESS;
  uint32_t n = *cap ? *cap * 2 : 8;
  while (n < need)
    n *= 2;
  char *p = realloc(*arr, (size_t)n * elem);
  if (p == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory to grow a pipeline record to %u entries", n);
  memset(p + (size_t)*cap * elem, 0, (size_t)(n - *cap) * elem);
  *arr = p;
  *cap = n;
  return OFL_SUCCESS;
}

/* The next item of a comma-separated list (spaces around items ignored):
 * *item and *len name it; returns where the following search starts, or
 * NULL when the list has no more items. */
const char *ofl__list_next(const char *p, const char **item, size_t *len) {
  while (p != NULL && (*p == ' ' || *p == ','))
    p++;
  if (p == NULL || *p == '\0')
    return NULL;
  const char *end = p;
  while (*end != '\0' && *end != ',')
    end++;
  const char *last = end;
  while (last > p && last[-1] == ' ')
    last--;
  *item = p;
  *len = (size_t)(last - p);
  return end;
}

/* 1 when name is an item of the comma-separated list. */
static bool list_has(const char *list, const char *name) {
  size_t n = strlen(name), len;
  const char *item;
  for (const char *p = list; (p = ofl__list_next(p, &item, &len)) != NULL;)
    if (len == n && strncmp(item, name, n) == 0)
      return true;
  return false;
}

int ofl__name_find(const ofl_manager_t *m, const char *name) {
  for (int i = 0; i < m->nnames; i++)
    if (strcmp(m->names[i].name, name) == 0)
      return i;
  return -1;
}

ofl_status_t ofl__name_intern(ofl_manager_t *m, const char *name, int *out) {
  int i = ofl__name_find(m, name);
  if (i >= 0) {
    *out = i;
    return OFL_SUCCESS;
  }
  if (name[0] == '\0')
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "rank %d: a group name must not be empty", m->rank);
  if (!m->warmup)
    return OFL__PERR(OFL_ERR_MISMATCH, m, m->cur_fwd, name,
                     "group name not seen in the warmup iteration%s", "");
  if (m->nnames >= OFL__MAX_NAMES)
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, m->cur_fwd, name,
                     "more than %d distinct group names", OFL__MAX_NAMES);
  name_info_t *ni = &m->names[m->nnames];
  memset(ni, 0, sizeof *ni);
  ni->name = strdup(name);
  size_t len = strlen(name) + sizeof "ofl offload ";
  ni->range_offload = malloc(len);
  ni->range_reload = malloc(len);
  if (ni->range_offload != NULL && ni->range_reload != NULL) {
    snprintf(ni->range_offload, len, "ofl offload %s", name);
    snprintf(ni->range_reload, len, "ofl reload %s", name);
  }
  if (m->max_inflight > 0)
    ni->ring = calloc(m->max_inflight + 1, sizeof *ni->ring);
  if (ni->name == NULL || ni->range_offload == NULL ||
      ni->range_reload == NULL || (m->max_inflight > 0 && ni->ring == NULL)) {
    free(ni->name);
    free(ni->range_offload);
    free(ni->range_reload);
    free(ni->ring);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "rank %d: no memory for group name %s", m->rank, name);
  }
  ni->selected = m->groups_cfg[0] == '\0' || list_has(m->groups_cfg, name);
  ni->dynamic = list_has(m->dynamic_cfg, name);
  /* Its reloads are byte-keyed, whatever share of them passes the size
   * threshold in the warmup (ofl__pool_expect_byte_keys); none where it is
   * never offloaded. */
  if (ni->dynamic && ni->selected && m->offload)
    ofl__pool_expect_byte_keys(m->dev_pool);
  ni->st.name = ni->name;
  *out = m->nnames++;
  return OFL_SUCCESS;
}
