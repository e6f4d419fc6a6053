/* ofl: the host backend's events: records numbered as they are queued and
 * reached in a contiguous prefix (records on several streams complete out
 * of order), and timing events on the CPU clock. The waits on a record,
 * which take work from its stream, are the streams' (host_stream.c). */
#include <stdlib.h>
#include <string.h>

#include "runtime/host.h"

ofl_status_t ofl__host_event_create(ofl_event_t *e) {
  host_event_t *he = calloc(1, sizeof *he);
  if (he == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate an event");
  pthread_mutex_init(&he->mu, NULL);
  ofl__host_cond_init(&he->cv);
  atomic_init(&he->recorded, 0);
  atomic_init(&he->completed, 0);
  atomic_init(&he->refs, 1);
  e->impl = he;
  return OFL_SUCCESS;
}

void ofl__host_event_unref(host_event_t *he) {
  if (atomic_fetch_sub(&he->refs, 1) != 1)
    return;
  if (he->last_stream != NULL)
    ofl__host_stream_unref(he->last_stream);
  pthread_mutex_destroy(&he->mu);
  pthread_cond_destroy(&he->cv);
  free(he->ahead);
  free(he);
}

void ofl__host_event_destroy(ofl_event_t *e) { ofl__host_event_unref(e->impl); }

/* Index of the first entry of he->ahead >= target (mu held). */
static size_t ahead_lower(const host_event_t *he, uint64_t target) {
  size_t lo = 0, hi = he->n_ahead;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (he->ahead[mid] < target)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Record `target` reached (mu held). */
bool ofl__host_event_reached_locked(const host_event_t *he, uint64_t target) {
  if (target <= ev_completed(he))
    return true;
  size_t i = ahead_lower(he, target);
  return i < he->n_ahead && he->ahead[i] == target;
}

bool ofl__host_event_reached_now(host_event_t *he, uint64_t target) {
  if (target <= ev_completed(he))
    return true;
  /* No record ahead: reached iff within the prefix. completed is stored
   * before n_ahead_seen, so an empty list seen here comes with a prefix
   * that covers every record it held. */
  if (atomic_load(&he->n_ahead_seen) == 0)
    return target <= atomic_load(&he->completed);
  pthread_mutex_lock(&he->mu);
  bool done = ofl__host_event_reached_locked(he, target);
  pthread_mutex_unlock(&he->mu);
  return done;
}

/* Records on different streams can complete out of order; a wait captured
 * on an older record must not be released by newer ones (re-recorded on a
 * faster stream, however many), so completion advances only over a
 * contiguous prefix. Called with mu held; true when a thread sleeps on cv
 * (the caller wakes it after unlocking, so it does not wake into a held
 * lock). */
bool ofl__host_event_complete_locked(host_event_t *he, uint64_t target) {
  if (he->timed &&
      target == atomic_load_explicit(&he->recorded, memory_order_relaxed)) {
    he->done_target = target;
    he->done_ns = ofl__now_ns();
  }
  uint64_t c = atomic_load_explicit(&he->completed, memory_order_relaxed);
  if (target == c + 1) {
    c++;
    size_t k = 0;
    while (k < he->n_ahead && he->ahead[k] == c + 1) {
      c++;
      k++;
    }
    if (k > 0) {
      memmove(he->ahead, he->ahead + k, (he->n_ahead - k) * sizeof *he->ahead);
      he->n_ahead -= k;
    }
    /* A reader that sees the count sees the op's writes. */
    atomic_store(&he->completed, c);
    atomic_store(&he->n_ahead_seen, he->n_ahead);
  } else if (target > c && !ofl__host_event_reached_locked(he, target)) {
    /* Room was made at record time (event_make_room). */
    size_t i = ahead_lower(he, target);
    memmove(he->ahead + i + 1, he->ahead + i,
            (he->n_ahead - i) * sizeof *he->ahead);
    he->ahead[i] = target;
    he->n_ahead++;
    atomic_store(&he->n_ahead_seen, he->n_ahead);
  }
  return he->sleepers > 0;
}

/* Makes room in he->ahead for every record in flight plus one more (mu
 * held); false when out of memory. */
static bool event_make_room(host_event_t *he) {
  uint64_t inflight =
      atomic_load_explicit(&he->recorded, memory_order_relaxed) + 1 -
      ev_completed(he);
  if (inflight <= he->cap_ahead)
    return true;
  size_t cap = he->cap_ahead ? he->cap_ahead * 2 : 16;
  while (cap < inflight)
    cap *= 2;
  uint64_t *a = realloc(he->ahead, cap * sizeof *a);
  if (a == NULL)
    return false;
  he->ahead = a;
  he->cap_ahead = cap;
  return true;
}

/* Numbers the next record of he (he->mu held); 0 when out of memory. */
uint64_t ofl__host_event_number_locked(host_event_t *he, ofl_stream_t *s) {
  if (!event_make_room(he)) {
    ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
               "cannot record an event on stream '%s': no memory to track "
               "%llu records in flight",
               s->name, (unsigned long long)(ev_recorded(he) + 1));
    return 0;
  }
  uint64_t target = ev_recorded(he) + 1;
  atomic_store_explicit(&he->recorded, target, memory_order_release);
  return target;
}

ofl_status_t ofl__host_event_create_timed(ofl_event_t *e) {
  OFL_CHECK(ofl__host_event_create(e));
  ((host_event_t *)e->impl)->timed = true;
  return OFL_SUCCESS;
}

/* When e's latest record completed; false while it has not (or e is not
 * a timing event, or was never recorded). */
static bool event_done_ns(host_event_t *he, uint64_t *ns) {
  pthread_mutex_lock(&he->mu);
  uint64_t rec = ev_recorded(he);
  bool done = he->timed && rec > 0 && he->done_target == rec;
  *ns = he->done_ns;
  pthread_mutex_unlock(&he->mu);
  return done;
}

/* As cudaEventElapsedTime: both events' latest records completed (else
 * OFL_ERR_NOT_READY); a b that completed before a gives 0. */
ofl_status_t ofl__host_event_elapsed_ns(ofl_event_t *a, ofl_event_t *b,
                                        uint64_t *ns) {
  uint64_t ta, tb;
  if (!event_done_ns(a->impl, &ta) || !event_done_ns(b->impl, &tb))
    return OFL_ERR_NOT_READY;
  *ns = tb > ta ? tb - ta : 0;
  return OFL_SUCCESS;
}

ofl_status_t ofl__host_event_query(ofl_event_t *e) {
  host_event_t *he = e->impl;
  return ofl__host_event_reached_now(he, ev_recorded(he)) ? OFL_SUCCESS
                                                          : OFL_ERR_NOT_READY;
}
