/* ofl: the stager (docs/DESIGN.md section 6): a training-safe host copy of a set
 * of named tensors, copied on a D2H stream, cached and reused across calls.
 * Tensors sharing a storage are copied once, as one span. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool/pool_internal.h"
#include "staging/staging_internal.h"

#define BUF_ALIGN ((size_t)64)

void ofl__deadline(int64_t timeout_ms, struct timespec *ts) {
  int64_t ms = ofl__timeout_ms(timeout_ms);
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += (time_t)(ms / 1000);
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

/* ---- the staged set -------------------------------------------------------- */

void ofl__staged_ref(ofl_staged_t *set) { atomic_fetch_add(&set->refs, 1); }

static void drop_sources(ofl_staged_t *set) {
  if (set->keep == NULL)
    return;
  for (size_t g = 0; g < set->n_groups; g++) {
    ofl_tensor_destroy(set->keep[g]);
    set->keep[g] = NULL;
  }
}

/* The reference the stager holds is the only handle left on the source
 * storage, or ofl_pool_reset reclaimed the block: the caller let go of the
 * tensor while its copy was in flight. */
static bool source_freed(const ofl_tensor_t *keep) {
  const ofl__storage_t *st = keep->st;
  if (st == NULL)
    return true;
  if (st->kind == OFL__STORAGE_BLOCK && keep->st_gen != st->gen)
    return true;
  return atomic_load(&st->refs) <= 1;
}

/* Lock held: the outcome of a joined set. */
static ofl_status_t joined_status(const ofl_staged_t *set) {
  ofl_status_t st = set->status;
  if (st != OFL_SUCCESS)
    ofl__error_quiet(st, "%s", set->message);
  return st;
}

ofl_status_t ofl__staged_join(ofl_staged_t *set, int64_t timeout_ms) {
  pthread_mutex_lock(&set->join_lock);
  if (!set->pending) {
    ofl_status_t st = joined_status(set);
    pthread_mutex_unlock(&set->join_lock);
    return st;
  }
  /* The wait runs without the lock: a save thread joining with the default
   * timeout must not hold up a caller's short synchronize or a status. */
  uint64_t gen = set->stage_gen;
  pthread_mutex_unlock(&set->join_lock);
  ofl_status_t st = ofl_event_synchronize(set->done, timeout_ms);
  if (st == OFL_ERR_TIMEOUT)
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_STAGING,
                      "staging copies of %zu tensors not complete in time; "
                      "the D2H stream is stalled or the timeout too short",
                      set->n);
  pthread_mutex_lock(&set->join_lock);
  if (!set->pending || set->stage_gen != gen) { /* another join did it */
    st = joined_status(set);
    pthread_mutex_unlock(&set->join_lock);
    return st;
  }
  if (st != OFL_SUCCESS) {
    snprintf(set->message, sizeof set->message,
             "staging copies failed on the D2H stream: %s", ofl_last_error());
  } else if (set->keep != NULL) {
    for (size_t g = 0; g < set->n_groups; g++) {
      if (set->keep[g] != NULL && source_freed(set->keep[g])) {
        st = OFL_ERR_INVALID_USAGE;
        snprintf(set->message, sizeof set->message,
                 "tensor '%.128s' was freed while staging (between "
                 "ofl_stager_stage and ofl_stager_synchronize); its staged "
                 "copy is not trusted: keep sources alive until the join",
                 set->keep_name[g]);
        break;
      }
    }
  }
  drop_sources(set);
  set->pending = false;
  set->status = st;
  pthread_mutex_unlock(&set->join_lock);
  if (st != OFL_SUCCESS)
    return ofl__error(st, OFL_SUBSYS_STAGING, "%s", set->message);
  return OFL_SUCCESS;
}

static void staged_free(ofl_staged_t *set) {
  if (set->pending)
    (void)ofl__staged_join(set, OFL_TIMEOUT_DEFAULT);
  drop_sources(set);
  for (size_t i = 0; i < set->n && set->tensors != NULL; i++)
    ofl_tensor_destroy(set->tensors[i]);
  if (set->buf != NULL) {
    if (set->pinned)
      ofl_pinned_free(set->dev, set->buf);
    else
      free(set->buf);
  }
  if (set->done != NULL)
    ofl_event_destroy(set->done);
  for (size_t i = 0; i < set->n && set->names != NULL; i++)
    free(set->names[i]);
  free(set->names);
  free(set->by_name);
  free(set->slots);
  free(set->groups);
  free(set->tensors);
  free(set->keep);
  free(set->keep_name);
  pthread_mutex_destroy(&set->join_lock);
  free(set);
}

void ofl_staged_release(ofl_staged_t *set) {
  if (set != NULL && atomic_fetch_sub(&set->refs, 1) == 1)
    staged_free(set);
}

size_t ofl_staged_count(const ofl_staged_t *set) {
  return set != NULL ? set->n : 0;
}

const char *ofl_staged_name(const ofl_staged_t *set, size_t index) {
  return set != NULL && index < set->n ? set->names[index] : NULL;
}

const ofl_tensor_t *ofl_staged_tensor(const ofl_staged_t *set, size_t index) {
  return set != NULL && index < set->n ? set->tensors[index] : NULL;
}

const ofl_tensor_t *ofl_staged_find(const ofl_staged_t *set,
                                    const char *name) {
  if (set == NULL || name == NULL)
    return NULL;
  size_t lo = 0, hi = set->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(set->names[set->by_name[mid]], name);
    if (c == 0)
      return set->tensors[set->by_name[mid]];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

ofl_status_t ofl_staged_status(const ofl_staged_t *set) {
  if (set == NULL)
    return OFL_ERR_INVALID_ARG;
  ofl_staged_t *s = (ofl_staged_t *)set;
  pthread_mutex_lock(&s->join_lock);
  ofl_status_t st = s->pending ? OFL_ERR_NOT_READY : s->status;
  pthread_mutex_unlock(&s->join_lock);
  return st;
}

/* ---- the plan: validation and grouping by storage ------------------------ */

typedef struct {
  uintptr_t key;   /* storage id (grouping) */
  uintptr_t addr;  /* data address */
  const char *name;
  size_t idx;
} sort_item_t;

static int cmp_item_name(const void *a, const void *b) {
  return strcmp(((const sort_item_t *)a)->name, ((const sort_item_t *)b)->name);
}
static int cmp_item_storage(const void *a, const void *b) {
  const sort_item_t *x = a, *y = b;
  if (x->key != y->key)
    return x->key < y->key ? -1 : 1;
  if (x->addr != y->addr)
    return x->addr < y->addr ? -1 : 1;
  return x->idx < y->idx ? -1 : (x->idx > y->idx);
}
/* Runs (one per storage) ordered by their first tensor in input order, so
 * that the layout does not depend on addresses. */
static int cmp_item_first(const void *a, const void *b) {
  const sort_item_t *x = a, *y = b;
  return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

static ofl_status_t reserve(ofl_stager_t *s, size_t n) {
  if (n <= s->plan_cap)
    return OFL_SUCCESS;
  size_t cap = n < 64 ? 64 : n;
  sort_item_t *items = malloc(3 * cap * sizeof *items);
  ofl__stage_slot_t *slots = malloc(cap * sizeof *slots);
  ofl__stage_group_t *groups = malloc(cap * sizeof *groups);
  if (items == NULL || slots == NULL || groups == NULL) {
    free(items), free(slots), free(groups);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "stage: out of host memory for a plan of %zu tensors", n);
  }
  free(s->scratch), free(s->plan_slots), free(s->plan_groups);
  s->scratch = (size_t *)(void *)items;
  s->plan_slots = slots;
  s->plan_groups = groups;
  s->plan_cap = cap;
  return OFL_SUCCESS;
}

static ofl_status_t check_inputs(const ofl_named_tensor_t *in, size_t n,
                                 sort_item_t *by_name) {
  if (n > 0 && in == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "stage: tensors is NULL with n %zu", n);
  for (size_t i = 0; i < n; i++) {
    OFL_CHECK(ofl__safetensors_check_name(in[i].name, "stage"));
    const ofl_tensor_t *t = in[i].tensor;
    if (t == NULL || !ofl_tensor_has_storage(t))
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                        "stage: tensor '%.128s' is NULL or has no storage "
                        "(released or freed); stage tensors that hold data",
                        in[i].name);
    ofl_location_t loc = ofl_tensor_location(t);
    if (loc != OFL_LOC_DEVICE && loc != OFL_LOC_PINNED)
      return ofl__error(OFL_ERR_NOT_SUPPORTED, OFL_SUBSYS_STAGING,
                        "stage: tensor '%.128s' is on disk; reload it before "
                        "staging",
                        in[i].name);
    by_name[i] = (sort_item_t){0, 0, in[i].name, i};
  }
  qsort(by_name, n, sizeof *by_name, cmp_item_name);
  for (size_t i = 1; i < n; i++)
    if (strcmp(by_name[i - 1].name, by_name[i].name) == 0)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                        "stage: tensor name '%.128s' appears twice; names "
                        "must be unique",
                        by_name[i].name);
  return OFL_SUCCESS;
}

/* Fills s->plan_slots and s->plan_groups; returns the number of groups and
 * the buffer bytes. */
static void build_plan(ofl_stager_t *s, const ofl_named_tensor_t *in,
                       size_t n, sort_item_t *items, sort_item_t *runs,
                       size_t *n_groups, size_t *buf_bytes) {
  for (size_t i = 0; i < n; i++) {
    const ofl_tensor_t *t = in[i].tensor;
    items[i] = (sort_item_t){(uintptr_t)ofl_tensor_storage_id(t),
                             (uintptr_t)ofl_tensor_data(t), NULL, i};
  }
  qsort(items, n, sizeof *items, cmp_item_storage);
  /* One run per storage; runs[r].idx is its first input index, addr its
   * start in items. */
  size_t nr = 0;
  for (size_t i = 0; i < n; i++) {
    if (i == 0 || items[i].key != items[i - 1].key)
      runs[nr++] = (sort_item_t){0, i, NULL, items[i].idx};
    else if (items[i].idx < runs[nr - 1].idx)
      runs[nr - 1].idx = items[i].idx;
  }
  qsort(runs, nr, sizeof *runs, cmp_item_first);
  size_t off = 0;
  for (size_t g = 0; g < nr; g++) {
    size_t start = runs[g].addr;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    size_t k = start;
    do {
      const ofl_tensor_t *t = in[items[k].idx].tensor;
      uintptr_t a = (uintptr_t)ofl_tensor_data(t);
      lo = a < lo ? a : lo;
      hi = a + ofl_tensor_bytes(t) > hi ? a + ofl_tensor_bytes(t) : hi;
      k++;
    } while (k < n && items[k].key == items[start].key);
    ofl__stage_group_t *gr = &s->plan_groups[g];
    gr->storage_id = (const void *)items[start].key;
    gr->src = (const char *)lo;
    gr->span_bytes = (size_t)(hi - lo);
    gr->buf_off = off;
    gr->kind = ofl_tensor_location(in[items[start].idx].tensor) ==
                       OFL_LOC_DEVICE
                   ? OFL_COPY_D2H
                   : OFL_COPY_H2H;
    off += (gr->span_bytes + BUF_ALIGN - 1) / BUF_ALIGN * BUF_ALIGN;
    for (size_t j = start; j < k; j++) {
      const ofl_tensor_t *t = in[items[j].idx].tensor;
      ofl__stage_slot_t *sl = &s->plan_slots[items[j].idx];
      sl->dtype = ofl_tensor_dtype(t);
      sl->ndim = ofl_tensor_ndim(t);
      memset(sl->shape, 0, sizeof sl->shape);
      memcpy(sl->shape, ofl_tensor_shape(t), (size_t)sl->ndim * sizeof(int64_t));
      sl->group = g;
      sl->off_in_span = (size_t)((uintptr_t)ofl_tensor_data(t) - lo);
      sl->bytes = ofl_tensor_bytes(t);
    }
  }
  *n_groups = nr;
  *buf_bytes = off;
}

static bool slot_equal(const ofl__stage_slot_t *a, const ofl__stage_slot_t *b) {
  return a->dtype == b->dtype && a->ndim == b->ndim && a->group == b->group &&
         a->off_in_span == b->off_in_span && a->bytes == b->bytes &&
         memcmp(a->shape, b->shape, sizeof a->shape) == 0;
}

/* The cached set has exactly this plan (names, order, types, sharing). */
static bool plan_matches(const ofl_stager_t *s, const ofl_staged_t *c,
                         const ofl_named_tensor_t *in, size_t n,
                         size_t n_groups) {
  if (c->n != n || c->n_groups != n_groups)
    return false;
  for (size_t g = 0; g < n_groups; g++)
    if (c->groups[g].span_bytes != s->plan_groups[g].span_bytes ||
        c->groups[g].kind != s->plan_groups[g].kind)
      return false;
  for (size_t i = 0; i < n; i++)
    if (strcmp(c->names[i], in[i].name) != 0 ||
        !slot_equal(&c->slots[i], &s->plan_slots[i]))
      return false;
  return true;
}

void ofl__shape_str(const int64_t *shape, int ndim, char *out, size_t cap) {
  size_t len = (size_t)snprintf(out, cap, "[");
  for (int d = 0; d < ndim && len < cap; d++)
    len += (size_t)snprintf(out + len, cap - len, d ? ",%lld" : "%lld",
                            (long long)shape[d]);
  if (len < cap)
    snprintf(out + len, cap - len, "]");
}

/* type_check: names the first tensor whose name, shape or dtype differs
 * from the cached set. OFL_SUCCESS when only the order or sharing changed. */
static ofl_status_t type_check(const ofl_stager_t *s, const ofl_staged_t *c,
                               size_t n,
                               const sort_item_t *by_name) {
  size_t i = 0, j = 0;
  while (i < n || j < c->n) {
    int cmp = i == n     ? 1
              : j == c->n ? -1
                          : strcmp(by_name[i].name, c->names[c->by_name[j]]);
    if (cmp < 0)
      return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_STAGING,
                        "stage: tensor '%.128s' is not in the cached staged "
                        "set (type_check); stage the same names each time, "
                        "or turn type_check off to rebuild the cache",
                        by_name[i].name);
    if (cmp > 0)
      return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_STAGING,
                        "stage: tensor '%.128s' of the cached staged set is "
                        "missing (type_check); stage the same names each "
                        "time, or turn type_check off to rebuild the cache",
                        c->names[c->by_name[j]]);
    const ofl__stage_slot_t *now = &s->plan_slots[by_name[i].idx];
    const ofl__stage_slot_t *was = &c->slots[c->by_name[j]];
    if (now->dtype != was->dtype || now->ndim != was->ndim ||
        memcmp(now->shape, was->shape, sizeof now->shape) != 0) {
      char a[160], b[160];
      ofl__shape_str(was->shape, was->ndim, a, sizeof a);
      ofl__shape_str(now->shape, now->ndim, b, sizeof b);
      return ofl__error(OFL_ERR_MISMATCH, OFL_SUBSYS_STAGING,
                        "stage: tensor '%.128s' changed from %s %s to %s %s "
                        "since it was cached (type_check); keep shapes and "
                        "dtypes fixed, or turn type_check off",
                        by_name[i].name, ofl_dtype_name(was->dtype), a,
                        ofl_dtype_name(now->dtype), b);
    }
    i++, j++;
  }
  return OFL_SUCCESS;
}

/* ---- building a set ---------------------------------------------------------- */

static ofl_status_t set_new(ofl_stager_t *s, const ofl_named_tensor_t *in,
                            size_t n, size_t n_groups, size_t buf_bytes,
                            const sort_item_t *by_name, ofl_staged_t **out) {
  ofl_staged_t *set = calloc(1, sizeof *set);
  if (set == NULL)
    goto oom;
  set->dev = s->dev;
  set->owner = s;
  atomic_init(&set->refs, 1);
  atomic_init(&set->saves, 0);
  pthread_mutex_init(&set->join_lock, NULL);
  set->n = n;
  set->n_groups = n_groups;
  size_t nn = n ? n : 1, ng = n_groups ? n_groups : 1;
  set->names = calloc(nn, sizeof *set->names);
  set->by_name = malloc(nn * sizeof *set->by_name);
  set->slots = malloc(nn * sizeof *set->slots);
  set->groups = malloc(ng * sizeof *set->groups);
  set->tensors = calloc(nn, sizeof *set->tensors);
  set->keep = calloc(ng, sizeof *set->keep);
  set->keep_name = calloc(ng, sizeof *set->keep_name);
  if (set->names == NULL || set->by_name == NULL || set->slots == NULL ||
      set->groups == NULL || set->tensors == NULL || set->keep == NULL ||
      set->keep_name == NULL)
    goto oom;
  for (size_t i = 0; i < n; i++) {
    if ((set->names[i] = strdup(in[i].name)) == NULL)
      goto oom;
    set->by_name[i] = by_name[i].idx;
  }
  memcpy(set->slots, s->plan_slots, n * sizeof *set->slots);
  memcpy(set->groups, s->plan_groups, n_groups * sizeof *set->groups);
  set->buf_bytes = buf_bytes;
  size_t alloc = buf_bytes ? buf_bytes : BUF_ALIGN;
  ofl_status_t st;
  if (s->p.pin_memory) {
    OFL_CHECK_GOTO(ofl_pinned_malloc(s->dev, alloc, &set->buf), st, fail);
    set->pinned = true;
  } else if (posix_memalign(&set->buf, 4096, alloc) != 0) {
    set->buf = NULL;
    goto oom;
  }
  OFL_CHECK_GOTO(ofl_event_create(s->dev, &set->done), st, fail);
  /* The staged tensors share storage as their sources did: one wrapped
   * span per group, a view per tensor. */
  ofl_tensor_t **bases = calloc(ng, sizeof *bases);
  if (bases == NULL)
    goto oom;
  st = OFL_SUCCESS;
  for (size_t g = 0; g < n_groups && st == OFL_SUCCESS; g++) {
    int64_t span = (int64_t)set->groups[g].span_bytes;
    st = ofl_tensor_wrap((char *)set->buf + set->groups[g].buf_off, &span, 1,
                         OFL_DTYPE_U8, OFL_LOC_PINNED, NULL, NULL, &bases[g]);
  }
  for (size_t i = 0; i < n && st == OFL_SUCCESS; i++) {
    const ofl__stage_slot_t *sl = &set->slots[i];
    st = ofl_tensor_view(bases[sl->group], sl->off_in_span, sl->shape,
                         sl->ndim, sl->dtype, &set->tensors[i]);
  }
  for (size_t g = 0; g < n_groups; g++)
    ofl_tensor_destroy(bases[g]); /* the views keep the storage */
  free(bases);
  if (st != OFL_SUCCESS)
    goto fail;
  pthread_mutex_lock(&s->lock);
  s->stats.buffer_allocs++;
  s->stats.buffer_bytes += alloc;
  pthread_mutex_unlock(&s->lock);
  *out = set;
  return OFL_SUCCESS;
oom:
  st = ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                  "stage: out of host memory for a staged copy of %zu tensors "
                  "(%zu bytes); free memory or stage fewer tensors",
                  n, buf_bytes);
fail:
  if (set != NULL)
    staged_free(set);
  return st;
}

/* ---- staging --------------------------------------------------------------- */

/* Queues the copies of set's groups on the stager's stream, ordered after
 * the work queued so far on the caller's compute stream. */
static ofl_status_t queue_copies(ofl_stager_t *s, ofl_staged_t *set,
                                 const ofl_named_tensor_t *in, size_t n) {
  /* Looked up now, never cached (docs/DESIGN.md section 5 rule 3). */
  ofl_stream_t *compute = ofl_device_compute_stream(s->dev);
  OFL_CHECK(ofl_event_record(s->compute_done, compute));
  OFL_CHECK(ofl_stream_wait_event(s->stream, s->compute_done));
  ofl_status_t st = OFL_SUCCESS;
  if (s->p.async_staging) {
    /* Hold every source storage until the join, so that a source let go
     * of meanwhile is never read after its memory was reused. */
    for (size_t i = 0; i < n && st == OFL_SUCCESS; i++) {
      size_t g = set->slots[i].group;
      if (set->keep[g] == NULL) {
        st = ofl_tensor_alias(in[i].tensor, &set->keep[g]);
        set->keep_name[g] = set->names[i];
      }
    }
    if (st != OFL_SUCCESS) {
      drop_sources(set);
      return st;
    }
  }
  for (size_t g = 0; g < set->n_groups && st == OFL_SUCCESS; g++) {
    const ofl__stage_group_t *gr = &set->groups[g];
    if (gr->span_bytes > 0)
      st = ofl_memcpy_async((char *)set->buf + gr->buf_off, gr->src,
                            gr->span_bytes, gr->kind, s->stream);
  }
  if (st == OFL_SUCCESS)
    st = ofl_event_record(set->done, s->stream);
  if (st != OFL_SUCCESS) {
    /* Some copies may be queued: let them finish before anyone reuses the
     * buffer or the sources. */
    (void)ofl_stream_synchronize(s->stream, OFL_TIMEOUT_DEFAULT);
    drop_sources(set);
  }
  return st;
}

/* Waits (bounded) until no save reads the cached set's buffer. */
static ofl_status_t wait_saves_done(ofl_stager_t *s, ofl_staged_t *set) {
  struct timespec dl;
  ofl__deadline(OFL_TIMEOUT_DEFAULT, &dl);
  pthread_mutex_lock(&s->lock);
  int rc = 0;
  while (atomic_load(&set->saves) > 0 && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&s->cond, &s->lock, &dl);
  bool busy = atomic_load(&set->saves) > 0;
  pthread_mutex_unlock(&s->lock);
  if (busy)
    return ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_STAGING,
                      "stage: a save of the cached staged set is still "
                      "writing after the wait timeout; the cached copy cannot "
                      "be overwritten yet (wait for the save's future)");
  return OFL_SUCCESS;
}

static void set_status(ofl_staged_t *set, bool pending, ofl_status_t st) {
  pthread_mutex_lock(&set->join_lock);
  set->pending = pending;
  if (pending)
    set->stage_gen++;
  set->status = st;
  if (st == OFL_SUCCESS)
    set->message[0] = '\0';
  else
    snprintf(set->message, sizeof set->message,
             "staging into this set failed: %s", ofl_last_error());
  pthread_mutex_unlock(&set->join_lock);
}

ofl_status_t ofl_stager_stage(ofl_stager_t *s, const ofl_named_tensor_t *in,
                              size_t n, ofl_staged_t **out) {
  if (s == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_stage: stager and out must not be NULL");
  if (s->last != NULL) {
    /* An async stage that was not synchronized: join it first (its
     * outcome stays in its set). */
    ofl_status_t st = ofl__staged_join(s->last, OFL_TIMEOUT_DEFAULT);
    if (st == OFL_ERR_TIMEOUT)
      return st;
    ofl_staged_release(s->last);
    s->last = NULL;
  }
  OFL_CHECK(reserve(s, n));
  sort_item_t *items = (sort_item_t *)(void *)s->scratch;
  sort_item_t *by_name = items, *by_storage = items + s->plan_cap,
              *runs = items + 2 * s->plan_cap;
  OFL_CHECK(check_inputs(in, n, by_name));
  size_t n_groups = 0, buf_bytes = 0;
  build_plan(s, in, n, by_storage, runs, &n_groups, &buf_bytes);

  ofl_staged_t *set = NULL;
  bool reuse = false;
  if (s->p.cache_staged && s->cached != NULL) {
    reuse = plan_matches(s, s->cached, in, n, n_groups);
    if (!reuse && s->p.type_check)
      OFL_CHECK(type_check(s, s->cached, n, by_name));
  }
  ofl_status_t st;
  if (reuse) {
    set = s->cached;
    OFL_CHECK(wait_saves_done(s, set));
    /* Same layout; the sources may live elsewhere now. */
    memcpy(set->groups, s->plan_groups, n_groups * sizeof *set->groups);
  } else {
    OFL_CHECK(set_new(s, in, n, n_groups, buf_bytes, by_name, &set));
  }
  set_status(set, true, OFL_SUCCESS);
  st = queue_copies(s, set, in, n);
  if (st != OFL_SUCCESS) {
    set_status(set, false, st);
    if (!reuse)
      staged_free(set);
    return st;
  }
  if (!reuse && s->p.cache_staged) {
    if (s->cached != NULL) {
      ofl_staged_release(s->cached); /* holders keep it alive */
      pthread_mutex_lock(&s->lock);
      s->stats.cache_rebuilds++;
      pthread_mutex_unlock(&s->lock);
    }
    ofl__staged_ref(set);
    s->cached = set;
  }
  ofl__staged_ref(set); /* the caller's reference */
  if (s->p.async_staging) {
    ofl__staged_ref(set);
    s->last = set;
  } else {
    st = ofl__staged_join(set, OFL_TIMEOUT_DEFAULT);
    if (st != OFL_SUCCESS) {
      ofl_staged_release(set); /* the caller's */
      if (!reuse)
        ofl_staged_release(set); /* the creation reference */
      return st;
    }
  }
  if (!reuse)
    ofl_staged_release(set); /* creation reference: now held by the above */
  size_t bytes = 0;
  for (size_t g = 0; g < n_groups; g++)
    bytes += set->groups[g].span_bytes;
  pthread_mutex_lock(&s->lock);
  s->stats.stages++;
  s->stats.tensors_staged += n;
  s->stats.storages_copied += n_groups;
  s->stats.shared_tensors += n - n_groups;
  s->stats.bytes_copied += bytes;
  if (reuse)
    s->stats.cache_reuses++;
  pthread_mutex_unlock(&s->lock);
  OFL_TRACE(OFL_SUBSYS_STAGING, "stage tensors %zu storages %zu bytes %zu %s",
            n, n_groups, bytes, reuse ? "cached" : "new");
  *out = set;
  return OFL_SUCCESS;
}

int ofl_stager_should_synchronize_after_execute(const ofl_stager_t *s) {
  return s != NULL && s->p.async_staging;
}

ofl_status_t ofl_stager_synchronize(ofl_stager_t *s, int64_t timeout_ms) {
  if (s == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_synchronize: stager is NULL");
  if (s->last == NULL)
    return OFL_SUCCESS;
  ofl_status_t st = ofl__staged_join(s->last, timeout_ms);
  if (st == OFL_ERR_TIMEOUT)
    return st; /* still pending: a later call can join it */
  ofl_staged_release(s->last);
  s->last = NULL;
  return st;
}

void ofl_stager_get_stats(const ofl_stager_t *s, ofl_stager_stats_t *out) {
  if (s == NULL || out == NULL)
    return;
  ofl_stager_t *m = (ofl_stager_t *)s;
  pthread_mutex_lock(&m->lock);
  *out = m->stats;
  pthread_mutex_unlock(&m->lock);
}

/* ---- lifecycle --------------------------------------------------------------- */

ofl_status_t ofl_stager_create(ofl_device_t *dev,
                               const ofl_stager_params_t *params,
                               ofl_stager_t **out) {
  if (dev == NULL || out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_create: dev and out must not be NULL");
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  if (params != NULL)
    p = *params;
  if (p.when_busy != OFL_SAVE_WHEN_BUSY_WAIT &&
      p.when_busy != OFL_SAVE_WHEN_BUSY_ERROR)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_create: when_busy %d is neither "
                      "OFL_SAVE_WHEN_BUSY_WAIT nor OFL_SAVE_WHEN_BUSY_ERROR",
                      (int)p.when_busy);
  int64_t max = p.max_inflight_saves;
  if (max == 0)
    OFL_CHECK(ofl__config_int("OFL_STAGING_MAX_INFLIGHT", &max));
  if (max < 1 || max > 1024)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_create: max_inflight_saves %lld must be in "
                      "1..1024 (OFL_STAGING_MAX_INFLIGHT)",
                      (long long)max);
  if (p.stream != NULL && ofl_stream_device(p.stream) != dev)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_STAGING,
                      "ofl_stager_create: the given stream belongs to another "
                      "device");
  ofl_stager_t *s = calloc(1, sizeof *s);
  if (s == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_STAGING,
                      "ofl_stager_create: out of host memory");
  s->dev = dev;
  s->p = p;
  s->max_inflight = (int)max;
  atomic_init(&s->refs, 1);
  pthread_mutex_init(&s->lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cond, &ca);
  pthread_condattr_destroy(&ca);
  ofl_status_t st;
  if (p.stream != NULL) {
    s->stream = p.stream;
  } else {
    OFL_CHECK_GOTO(ofl_stream_create(dev, "staging", &s->stream), st, fail);
    s->own_stream = true;
  }
  OFL_CHECK_GOTO(ofl_event_create(dev, &s->compute_done), st, fail);
  /* CUDA copies device memory into pageable host memory synchronously: the
   * call returns once the bytes arrived, so asynchronous staging without
   * pinned memory is not asynchronous there. Say so once per stager. */
  if (p.async_staging && !p.pin_memory &&
      ofl_device_backend(dev) == OFL_BACKEND_CUDA)
    OFL_WARN(OFL_SUBSYS_STAGING,
             "stager: async_staging with pin_memory 0: on cuda a copy into "
             "pageable memory is synchronous, so stage() returns only after "
             "the copies; set pin_memory 1 for staging that overlaps "
             "training");
  OFL_INFO(OFL_SUBSYS_STAGING,
           "stager created cache %d pinned %d type_check %d async %d "
           "max_inflight_saves %d",
           p.cache_staged, p.pin_memory, p.type_check, p.async_staging,
           s->max_inflight);
  *out = s;
  return OFL_SUCCESS;
fail:
  ofl__stager_unref(s);
  return st;
}

void ofl__stager_ref(ofl_stager_t *s) { atomic_fetch_add(&s->refs, 1); }

void ofl__stager_unref(ofl_stager_t *s) {
  if (atomic_fetch_sub(&s->refs, 1) == 1)
    ofl__stager_free(s);
}

void ofl__stager_free(ofl_stager_t *s) {
  if (s->compute_done != NULL)
    ofl_event_destroy(s->compute_done);
  if (s->own_stream && s->stream != NULL)
    ofl_stream_destroy(s->stream);
  free(s->scratch);
  free(s->plan_slots);
  free(s->plan_groups);
  pthread_cond_destroy(&s->cond);
  pthread_mutex_destroy(&s->lock);
  free(s);
}

ofl_status_t ofl_stager_destroy(ofl_stager_t *s) {
  if (s == NULL)
    return OFL_SUCCESS;
  ofl_status_t st = OFL_SUCCESS;
  struct timespec dl;
  ofl__deadline(OFL_TIMEOUT_DEFAULT, &dl);
  pthread_mutex_lock(&s->lock);
  int rc = 0;
  /* Every save thread, not only every save: a thread that completed its
   * future may still be releasing the set (pinned memory of the device). */
  while (s->threads > 0 && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&s->cond, &s->lock, &dl);
  int left = s->threads;
  pthread_mutex_unlock(&s->lock);
  if (left > 0)
    st = ofl__error(OFL_ERR_TIMEOUT, OFL_SUBSYS_STAGING,
                    "ofl_stager_destroy: %d saves still running after the "
                    "wait timeout; they finish in the background",
                    left);
  if (s->last != NULL) {
    (void)ofl__staged_join(s->last, OFL_TIMEOUT_DEFAULT);
    ofl_staged_release(s->last);
    s->last = NULL;
  }
  if (s->cached != NULL) {
    ofl_staged_release(s->cached);
    s->cached = NULL;
  }
  ofl__stager_unref(s);
  return st;
}
