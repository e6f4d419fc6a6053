/* ofl: the auto plan's measurements (groups "auto", docs/design/pipeline.md
 * section 5.4). Warmup: every group is offloaded and stamped: its commit,
 * backward begin and backward end on the compute stream, its copies on the
 * D2H and H2D streams (timing events where the backend has them, else the
 * CPU clock, which on the host backend is the compute stream's clock: host
 * compute runs on the calling thread), and its reload waits. End of warmup:
 * the link rates, the device's non-activation bytes, and the stamps become
 * an instance of pipeline/plan_solve.h (bytes, times, windows). The plan's
 * per-group state lives here, in p->ms, indexed by the plan's own index
 * (g->pidx). Above the solver; below the ledger (plan_ledger.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/plan.h"

/* ---- warmup stamps ------------------------------------------------------ */

static void stamp(ofl_manager_t *m, stamp_t *s, ofl_stream_t *stream) {
  ofl__plan_t *p = m->ap;
  s->cpu = ofl__now_ns();
  s->waits = p->bwd_seq;
  s->set = true;
  if (!p->timed || p->timing_lost)
    return;
  if ((s->ev == NULL &&
       ofl__event_create_timed(m->dev, &s->ev) != OFL_SUCCESS) ||
      ofl_event_record(s->ev, stream) != OFL_SUCCESS)
    p->timing_lost = true;
}

meas_t *ofl__plan_meas(ofl_manager_t *m, group_t *g) {
  ofl__plan_t *p = m->ap;
  if (g->pidx < p->nms && p->ms[g->pidx].g == g)
    return &p->ms[g->pidx];
  if (ofl__grow((void **)&p->ms, &p->capms, p->nms + 1, sizeof *p->ms) !=
      OFL_SUCCESS)
    return NULL;
  meas_t *x = &p->ms[p->nms];
  memset(x, 0, sizeof *x);
  x->g = g;
  g->pidx = p->nms++;
  return x;
}

ofl_status_t ofl__plan_alloc(ofl_manager_t *m) {
  if (m->ap != NULL)
    return OFL_SUCCESS;
  m->ap = calloc(1, sizeof *m->ap);
  if (m->ap == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the auto plan's measurements");
  m->ap->timed = true; /* until a timing event cannot be made */
  return OFL_SUCCESS;
}

/* The bytes of g's storages (each cluster once) and, of them, those its
 * commit offloaded: one pass over the entries. */
uint64_t ofl__plan_group_bytes(const group_t *g, uint64_t *offloaded) {
  uint64_t b = 0, off = 0;
  for (uint32_t i = 0; i < g->n; i++) {
    const entry_t *l = &g->entries[i];
    if (l->leader == i) {
      b += l->span;
      off += l->state == E_OFFLOADED ? l->span : 0;
    }
  }
  *offloaded = off;
  return b;
}

/* Warmup: the offloaded groups whose copies are still running at this
 * marker (where the steady ledger looks too) had their bytes on the device
 * until at least now; the marker is at's stamp kind of group ms[at]. */
static void warm_poll(ofl_manager_t *m, uint32_t at, uint8_t kind) {
  ofl__plan_t *p = m->ap;
  uint64_t now = 0;
  for (uint32_t i = 0; i < p->nms; i++) {
    meas_t *x = &p->ms[i];
    if (!x->rel_pending)
      continue;
    if (ofl_event_query(x->g->offload_ev) == OFL_SUCCESS) {
      x->rel_pending = false;
    } else {
      x->late = now ? now : (now = ofl__now_ns());
      x->late_ms = (int32_t)at;
      x->late_kind = kind;
    }
  }
}

void ofl__plan_on_start(ofl_manager_t *m, group_t *g, group_t *input) {
  if (g == NULL || !m->offload || !m->warmup || !m->auto_plan ||
      ofl__plan_alloc(m) != OFL_SUCCESS)
    return;
  meas_t *x = ofl__plan_meas(m, g);
  if (x == NULL)
    return;
  stamp(m, &x->start, ofl__compute(m));
  x->input = input != g ? input : NULL;
}

/* The warmup's part of ofl__plan_on_commit. */
void ofl__plan_warm_commit(ofl_manager_t *m, group_t *g, int phase) {
  /* Every group of the record gets its place in the ledger; the stamps
   * are the auto plan's. */
  if (ofl__plan_alloc(m) != OFL_SUCCESS)
    return;
  meas_t *x = ofl__plan_meas(m, g);
  if (x == NULL || !m->auto_plan)
    return;
  ofl__plan_t *p = m->ap;
  if (phase == 0) {
    warm_poll(m, g->pidx, 0);
    stamp(m, &x->commit, ofl__compute(m));
    if (!p->base.set)
      stamp(m, &p->base, ofl__compute(m));
  } else if (phase == 1) {
    stamp(m, &x->d2h_a, m->d2h);
  } else {
    if (phase == 2)
      stamp(m, &x->d2h_b, m->d2h);
    uint64_t off;
    x->kept_bytes = ofl__plan_group_bytes(g, &off) - off;
    x->rel_pending = phase == 2 && off > 0;
  }
  return;
}

/* The warmup's measurements of g (NULL outside an auto warmup, or
 * without memory for them). */
static meas_t *warm_meas(ofl_manager_t *m, group_t *g) {
  return m->auto_plan && g != NULL && m->warmup && m->ap != NULL
             ? ofl__plan_meas(m, g)
             : NULL;
}

/* The warmup's part of ofl__plan_on_reload. */
void ofl__plan_warm_reload(ofl_manager_t *m, group_t *g, int phase) {
  meas_t *x = warm_meas(m, g);
  if (x != NULL)
    stamp(m, phase == 0 ? &x->h2d_a : &x->h2d_b, m->h2d);
}

/* The warmup's part of ofl__plan_on_backward. */
void ofl__plan_warm_backward(ofl_manager_t *m, group_t *g, int end) {
  meas_t *x = warm_meas(m, g);
  if (x == NULL)
    return;
  warm_poll(m, g->pidx, end ? 2 : 1);
  if (!end)
    x->bwd_seq = ++m->ap->bwd_seq;
  stamp(m, end ? &x->bwd_end : &x->bwd_begin, ofl__compute(m));
  if (end && x->bwd_begin.set)
    x->bwd_cpu_ns = x->bwd_end.cpu - x->bwd_begin.cpu;
}

void ofl__plan_warm_pop(ofl_manager_t *m, group_t *g, uint64_t ns) {
  meas_t *x = warm_meas(m, g);
  if (x != NULL && x->bwd_begin.set && !x->bwd_end.set)
    x->warm_pop_ns += ns;
}

void ofl__plan_on_stall(ofl_manager_t *m, group_t *g, uint64_t ns, bool warm) {
  ofl__plan_t *p = m->ap;
  if (p == NULL || g == NULL || g->pidx >= p->nms || p->ms[g->pidx].g != g)
    return;
  meas_t *x = &p->ms[g->pidx];
  x->stalled = true;
  if (warm)
    x->warm_stall_ns += ns;
}

/* ---- end of warmup: the instance ------------------------------------------
 */

/* ns of a stamp on the warmup's axis (0 at the base), less the time its
 * backward passes waited for reloads before it: the plan models the
 * compute, and the
 * warmup offloaded every group, where a steady iteration offloads only
 * some. A wait inflated every later gap and window (a reload's window
 * took in the wait it caused, so a copy the link could not hide looked
 * hidden). Copy stamps move with the compute stamp they were issued at. */
int64_t ofl__plan_at_ns(const ofl__plan_t *p, const stamp_t *s) {
  if (!s->set)
    return -1;
  int64_t t = (int64_t)(s->cpu - p->base.cpu);
  if (p->timed && !p->timing_lost && s->ev != NULL && p->base.ev != NULL) {
    uint64_t ns = 0;
    if (ofl__event_elapsed_ns(p->base.ev, s->ev, &ns) == OFL_SUCCESS)
      t = (int64_t)ns;
  }
  if (p->stalled_before != NULL) {
    uint32_t k = s->waits < p->nbwd ? s->waits : p->nbwd;
    t -= (int64_t)p->stalled_before[k];
  }
  return t;
}

static bool span_ns(const ofl__plan_t *p, const stamp_t *a, const stamp_t *b,
                    uint64_t *ns) {
  if (!a->set || !b->set || !p->timed || p->timing_lost || a->ev == NULL ||
      b->ev == NULL)
    return false;
  return ofl__event_elapsed_ns(a->ev, b->ev, ns) == OFL_SUCCESS;
}

/* The link rate the plan takes where the backend has none (a failed
 * measurement). */
#define DEFAULT_LINK_BPS 10e9

/* Link rates: measured from the warmup's copies (timing events), else the
 * backend's (ofl__device_link_rate: its link model, else its own timing of
 * its copies, "memcpy"). */
static void link_rates(ofl_manager_t *m) {
  ofl__plan_t *p = m->ap;
  uint64_t db = 0, dns = 0, hb = 0, hns = 0;
  for (uint32_t i = 0; i < p->nms; i++) {
    meas_t *x = &p->ms[i];
    uint64_t ns;
    uint64_t moved = x->g->warm_bytes;
    if (moved > 0 && span_ns(p, &x->d2h_a, &x->d2h_b, &ns) && ns > 0) {
      db += moved;
      dns += ns;
    }
    if (moved > 0 && span_ns(p, &x->h2d_a, &x->h2d_b, &ns) && ns > 0) {
      hb += moved;
      hns += ns;
    }
  }
  if (dns > 0) {
    p->out.d2h_gbps = (double)db / (double)dns;
    p->out.h2d_gbps = hns > 0 ? (double)hb / (double)hns : p->out.d2h_gbps;
    p->out.rate_source = "measured";
    return;
  }
  double d2h = 0, h2d = 0;
  ofl__link_source_t src = OFL__LINK_NONE;
  if (ofl__device_link_rate(m->dev, &d2h, &h2d, &src) != OFL_SUCCESS)
    src = OFL__LINK_NONE;
  p->out.d2h_gbps =
      (src != OFL__LINK_NONE && d2h > 0 ? d2h : DEFAULT_LINK_BPS) / 1e9;
  p->out.h2d_gbps =
      (src != OFL__LINK_NONE && h2d > 0 ? h2d : DEFAULT_LINK_BPS) / 1e9;
  p->out.rate_source = src == OFL__LINK_MODEL   ? "link model"
                       : src == OFL__LINK_TIMED ? "memcpy"
                                                : "default";
}

static int cmp_bwd(const void *a, const void *b, void *ctx) {
  const meas_t *ms = ctx;
  uint32_t x = ms[*(const uint32_t *)a].bwd_seq;
  uint32_t y = ms[*(const uint32_t *)b].bwd_seq;
  return x < y ? -1 : x > y;
}

/* Insertion sort by bwd_seq (qsort_r is not C11). */
static void sort_bwd(uint32_t *v, uint32_t n, const meas_t *ms) {
  for (uint32_t i = 1; i < n; i++) {
    uint32_t k = v[i], j = i;
    while (j > 0 && cmp_bwd(&v[j - 1], &k, (void *)ms) > 0) {
      v[j] = v[j - 1];
      j--;
    }
    v[j] = k;
  }
}

/* When group at backward place pos (0-based) reloads with lead L and
 * every group offloaded: at the end of the backward L places earlier, or
 * at gate's end where that is later (the runtime issues reloads at most one
 * chunk ahead), never before its commit nor after its backward begins. */
int64_t ofl__plan_reload_time(const ofl__plan_t *p, uint32_t pos, uint32_t lead,
                              uint32_t gate, int64_t t_alloc, int64_t t_begin) {
  uint32_t from = pos >= lead && pos - lead > gate ? pos - lead : gate;
  int64_t t = from < pos ? p->t_bwd_end[p->bwd_order[from]] : t_begin;
  if (t < t_alloc)
    t = t_alloc;
  return t > t_begin ? t_begin : t;
}

/* A group's forward time, its commit less its start, ns; 0 where its start
 * was not stamped (a start without flags). */
static double forward_ns(const ofl__plan_t *p, const meas_t *x) {
  if (!x->start.set || !x->commit.set)
    return 0;
  int64_t f = ofl__plan_at_ns(p, &x->commit) - ofl__plan_at_ns(p, &x->start);
  return f > 0 ? (double)f : 0;
}

ofl_status_t ofl__plan_build_instance(ofl_manager_t *m, int *nnames) {
  ofl__plan_t *p = m->ap;
  uint32_t n = p->nms;
  p->inst = calloc(n ? n : 1, sizeof *p->inst);
  p->chosen = calloc(n ? n : 1, sizeof *p->chosen);
  p->bwd_order = calloc(n ? n : 1, sizeof *p->bwd_order);
  p->t_bwd_end = calloc(n ? n : 1, sizeof *p->t_bwd_end);
  if (!p->inst || !p->chosen || !p->bwd_order || !p->t_bwd_end)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the auto plan");
  link_rates(m);
  double d2h_bps = p->out.d2h_gbps * 1e9, h2d_bps = p->out.h2d_gbps * 1e9;
  p->nbwd = 0;
  for (uint32_t i = 0; i < n; i++)
    if (p->ms[i].bwd_seq > 0)
      p->bwd_order[p->nbwd++] = i;
  sort_bwd(p->bwd_order, p->nbwd, p->ms);
  /* The warmup's reload waits, in backward order (bwd_seq 1..nbwd): from
   * here on at_ns leaves them out of the timeline. */
  p->stalled_before = calloc((size_t)p->nbwd + 1, sizeof *p->stalled_before);
  if (p->stalled_before == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the auto plan");
  for (uint32_t k = 0; k < p->nbwd; k++)
    p->stalled_before[k + 1] =
        p->stalled_before[k] + p->ms[p->bwd_order[k]].warm_stall_ns;
  p->out.warmup_stall_ms = (double)p->stalled_before[p->nbwd] / 1e6;
  /* Commit order is the stamp order of the commits (one thread). */
  int64_t last = 0;
  for (uint32_t i = 0; i < n; i++) {
    meas_t *x = &p->ms[i];
    p->t_bwd_end[i] = ofl__plan_at_ns(p, &x->bwd_end);
    int64_t t = ofl__plan_at_ns(p, &x->commit);
    if (t > last)
      last = t;
    if (p->t_bwd_end[i] > last)
      last = p->t_bwd_end[i];
  }
  /* A copy of the warmup that ended later than the model puts its end
   * (the warmup's commits, every copy at the link rate one after another:
   * queueing is the model's already) shows latency the model lacks (a copy
   * worker that woke late, a copy that waited for other work, a CPU that
   * runs ahead of the device and sees the end late): the largest such
   * excess delays every offloaded group's release after its modelled end
   * (one per instance: which copy a late start hits is chance). The end is
   * the later of the copies' timing event and the place on the compute
   * stream of the last marker that saw them unfinished; without timing
   * events, that marker's CPU time (a lower bound; not the first that saw
   * them done, a whole window later). */
  bool timed = p->timed && !p->timing_lost;
  double latency = 0, queue = 0;
  for (uint32_t i = 0; i < n; i++) {
    const meas_t *x = &p->ms[i];
    if (x->g->warm_bytes == 0 || !x->commit.set)
      continue;
    double t0 = (double)ofl__plan_at_ns(p, &x->commit);
    queue = (queue > t0 ? queue : t0) +
            (d2h_bps > 0 ? (double)x->g->warm_bytes * 1e9 / d2h_bps : 0);
    double end = timed ? (double)ofl__plan_at_ns(p, &x->d2h_b) : -1;
    if (x->late != 0 && (uint32_t)x->late_ms < n &&
        (timed || x->late > x->commit.cpu)) {
      /* The ledger sees a copy end at its markers, on the CPU: where the
       * CPU runs ahead of the device (a GPU), a marker whose own place on
       * the compute stream is well past the copy's end can still see it
       * unfinished, and the bytes stay until then. Without timing events
       * that marker's stamp is the end (its CPU time, taken right after
       * the look, with the warmup's waits out like every stamp). */
      const meas_t *y = &p->ms[x->late_ms];
      const stamp_t *at = x->late_kind == 0   ? &y->commit
                          : x->late_kind == 1 ? &y->bwd_begin
                                              : &y->bwd_end;
      double seen = (double)ofl__plan_at_ns(p, at);
      if (seen > end)
        end = seen;
    }
    if (end - queue > latency)
      latency = end - queue;
  }
  p->out.release_ms = latency / 1e6;
  /* Per backward place, the earliest backward end that can issue its
   * reload: prefetch_next reaches one chunk ahead, and into a chunk only
   * once its forward finished (forward_finished), so the first place of
   * the chunk before in backward order whose end comes after this chunk's
   * last commit; its own chunk's first where none does or none is. */
  uint32_t *gate = calloc(2 * (size_t)(p->nbwd ? p->nbwd : 1), sizeof *gate);
  if (gate == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the auto plan");
  uint32_t *start = gate + (p->nbwd ? p->nbwd : 1); /* of each place's run */
  for (uint32_t k = 0; k < p->nbwd; k++)
    start[k] = k > 0 && p->ms[p->bwd_order[k]].g->chunk ==
                            p->ms[p->bwd_order[k - 1]].g->chunk
                   ? start[k - 1]
                   : k;
  for (uint32_t k = 0; k < p->nbwd; k++) {
    uint32_t run = start[k];
    if (k > run) { /* the same as its chunk's first place */
      gate[k] = gate[run];
      continue;
    }
    gate[k] = run; /* its own chunk's first, unless the chunk before's */
    if (run == 0)
      continue;
    /* The chunk's forward ends at its last commit: only a backward end
     * after it reaches into the chunk (forward_finished). */
    int64_t fwd_end = INT64_MIN;
    for (uint32_t j = run; j < p->nbwd && start[j] == run; j++) {
      int64_t t = ofl__plan_at_ns(p, &p->ms[p->bwd_order[j]].commit);
      if (t > fwd_end)
        fwd_end = t;
    }
    for (uint32_t q = start[run - 1]; q < run; q++)
      if (p->t_bwd_end[p->bwd_order[q]] >= fwd_end) {
        gate[k] = q;
        break;
      }
  }
  for (uint32_t i = 0; i < n; i++)
    p->inst[i].bwd_pos = -1;
  for (uint32_t k = 0; k < p->nbwd; k++) {
    p->inst[p->bwd_order[k]].bwd_pos = (int32_t)k;
    p->inst[p->bwd_order[k]].gate_pos = (int32_t)gate[k];
  }
  free(gate);
  int split[OFL__MAX_NAMES] = {0};
  *nnames = m->nnames;
  for (uint32_t i = 0; i < n; i++) {
    meas_t *x = &p->ms[i];
    group_t *g = x->g;
    ofl__plan_group_t *q = &p->inst[i];
    q->name = g->nid;
    q->bytes = g->warm_bytes;
    q->kept_bytes = x->kept_bytes;
    q->t_alloc = ofl__plan_at_ns(p, &x->commit);
    if (q->t_alloc < 0)
      q->t_alloc = 0;
    int64_t begin = ofl__plan_at_ns(p, &x->bwd_begin);
    q->t_free = p->t_bwd_end[i] >= q->t_alloc ? p->t_bwd_end[i] : last;
    if (begin < q->t_alloc || begin > q->t_free)
      begin = q->t_free;
    q->offloadable = x->bwd_seq > 0 && g->warm_bytes > 0 && g->policy_offload &&
                     !g->next_in_bwd;
    if (q->offloadable)
      q->split_rank = split[g->nid]++;
    x->lead = p->base_lead;
    x->lead_cap = LEAD_MAX;
    q->t_reload =
        q->bwd_pos >= 0
            ? ofl__plan_reload_time(p, (uint32_t)q->bwd_pos, x->lead,
                                    (uint32_t)q->gate_pos, q->t_alloc, begin)
            : q->t_free;
    if (q->bwd_pos >= 0) { /* where any choice may issue it */
      q->lead = x->lead;
      int64_t early =
          ofl__plan_reload_time(p, (uint32_t)q->bwd_pos, UINT32_MAX,
                                (uint32_t)q->gate_pos, q->t_alloc, begin);
      q->bwd_window_max_ns = (double)(begin - early);
    }
    /* The next commit after this one (else the iteration's last stamp). */
    int64_t next = last;
    for (uint32_t k = 0; k < n; k++) {
      int64_t t = ofl__plan_at_ns(p, &p->ms[k].commit);
      if (t > q->t_alloc && t < next)
        next = t;
    }
    q->fwd_window_ns = (double)(next - q->t_alloc);
    q->bwd_window_ns = (double)(begin - q->t_reload);
    q->d2h_ns = d2h_bps > 0 ? (double)q->bytes * 1e9 / d2h_bps : 0;
    q->release_ns = latency;
    q->d2h_free = m->plan_recompute; /* a three-way plan: the step time */
    q->h2d_ns = h2d_bps > 0 ? (double)q->bytes * 1e9 / h2d_bps : 0;
    /* its own forward: what a recompute that reruns it costs once
     * (ofl__plan_rerun_credit) */
    q->fwd_ns = forward_ns(p, x);
    /* Recompute: the forward again (commit less start, on compute), and
     * the group's bytes less the input the application keeps. */
    q->recomputable = g->recomputable && x->start.set && x->bwd_seq > 0;
    q->rerun_own = q->recomputable && (g->rc_reruns & OFL_RERUN_OWN);
    q->rerun_input = false;
    if (q->recomputable) {
      int64_t fwd = q->t_alloc - ofl__plan_at_ns(p, &x->start);
      uint64_t all = q->bytes + q->kept_bytes;
      q->recompute_ns = (g->rc_reruns & OFL_RERUN_OWN) && fwd > 0
                            ? (double)fwd
                            : 0;
      q->recompute_bytes =
          all > g->rc_input_bytes ? all - g->rc_input_bytes : 0;
      /* the group that holds the input, where the record has it */
      const group_t *in = x->input;
      if (in != NULL && in->pidx < n && p->ms[in->pidx].g == in &&
          in->pidx != i) {
        q->has_input = true;
        q->input_of = in->pidx;
        /* OFL_RERUN_INPUT: that group's forward again */
        q->rerun_input = (g->rc_reruns & OFL_RERUN_INPUT) != 0;
        if (q->rerun_input)
          q->recompute_ns += forward_ns(p, &p->ms[in->pidx]);
      }
    }
  }
  return OFL_SUCCESS;
}

/* params.device_memory_target_bytes: what is not activations, measured
 * over the warmup (every group offloaded), gets its bytes; the activations
 * get the rest of the device target, or the activation target when that is
 * tighter. Not activations: the warmup's device peak (the application's
 * own, ofl_manager_set_device_peak, else the device's stats: what was
 * allocated through ofl on it) less the activation pool's peak in use
 * (params.device_pool, else the manager's reload pool). A device target at
 * or below it is an error giving both figures; everything that may go is
 * then offloaded. */
ofl_status_t ofl__plan_device_target(ofl_manager_t *m) {
  if (m->dev_target == 0)
    return OFL_SUCCESS;
  ofl_device_stats_t ds;
  ofl_pool_stats_t ps;
  ofl_device_get_stats(m->dev, &ds);
  ofl_pool_get_stats(m->dev_pool, &ps);
  uint64_t act = ps.peak_in_use_bytes;
  m->dev_peak =
      m->dev_peak_noted > 0 ? m->dev_peak_noted : ds.device_bytes_peak;
  const char *how =
      m->dev_peak_noted > 0 ? "the application's" : "the device's";
  m->dev_rest = m->dev_peak > act ? m->dev_peak - act : 0;
  if (m->dev_target <= m->dev_rest) {
    m->mem_target = 1; /* offload everything that may go */
    return ofl__error(
        OFL_ERR_CONFIG, OFL_SUBSYS_PIPELINE,
        "rank %d: device memory target %llu bytes (%.2f MiB) is at or below "
        "the %llu bytes (%.2f MiB) that are not activations (the warmup's "
        "device peak %llu bytes, %s, less the activation pool's peak %llu "
        "bytes); everything that may go is offloaded. Raise "
        "OFL_DEVICE_MEMORY_TARGET "
        "(params.device_memory_target_bytes) above %.2f MiB",
        m->rank, (unsigned long long)m->dev_target, ofl__mib(m->dev_target),
        (unsigned long long)m->dev_rest, ofl__mib(m->dev_rest),
        (unsigned long long)m->dev_peak, how, (unsigned long long)act,
        ofl__mib(m->dev_rest));
  }
  uint64_t want = m->dev_target - m->dev_rest;
  if (m->mem_target == 0 || want < m->mem_target)
    m->mem_target = want;
  OFL_INFO(OFL_SUBSYS_PIPELINE,
           "rank %d: device memory target %.2f MiB: not activations %.2f MiB "
           "(device peak %.2f, %s, less activations %.2f), activation target "
           "%.2f MiB",
           m->rank, ofl__mib(m->dev_target), ofl__mib(m->dev_rest),
           ofl__mib(m->dev_peak), how, ofl__mib(act), ofl__mib(m->mem_target));
  return OFL_SUCCESS;
}

void ofl__plan_free(ofl_manager_t *m) {
  ofl__plan_t *p = m->ap;
  if (p == NULL)
    return;
  for (uint32_t i = 0; i < p->nms; i++) {
    stamp_t *st[] = {&p->ms[i].start,   &p->ms[i].commit, &p->ms[i].bwd_begin,
                     &p->ms[i].bwd_end, &p->ms[i].d2h_a,  &p->ms[i].d2h_b,
                     &p->ms[i].h2d_a,   &p->ms[i].h2d_b};
    for (size_t k = 0; k < sizeof st / sizeof st[0]; k++)
      if (st[k]->ev != NULL)
        ofl_event_destroy(st[k]->ev);
  }
  if (p->base.ev != NULL)
    ofl_event_destroy(p->base.ev);
  free(p->ms);
  free(p->inst);
  free(p->chosen);
  free(p->chosen_safe);
  free(p->action_safe);
  free(p->bwd_order);
  free(p->stalled_before);
  free(p->t_bwd_end);
  free(p->off_now);
  free(p->pending);
  free(p->fifo);
  free(p->names);
  free(p->acts);
  free(p->stall0);
  free(p->action);
  free(p->rec);
  free(p);
  m->ap = NULL;
}
