/* ofl: the auto offload plan's solver (docs/DESIGN.md section 5.4): the
 * peak simulation and the search over whole and split names. Pure: no
 * state, no logging but the error of a malformed instance. */
#include "pipeline/plan_solve.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"

#define PLAN_EXACT_NAMES 16
#define PLAN_TIE_NS 1.0
#define PLAN_NO_SLOT SIZE_MAX
#define PLAN_BISECT_FROM 8 /* split counts worth a bisection of the bound */
#define PLAN_EXACT_RECOMPUTE 8 /* recomputable names searched exactly */

/* ---- the peak simulation ---------------------------------------------- */

enum { PLAN_EV_ALLOC, PLAN_EV_RELOAD, PLAN_EV_RECOMP, PLAN_EV_FREE };
#define PLAN_NEV 4 /* events per group */

typedef struct {
  int64_t t;
  size_t group;
  int kind;
} plan_event_t;

/* A copy's end: whole nanoseconds and a fraction in [0, 1), so that int64
 * clocks far from zero keep their precision next to double copy times. */
typedef struct {
  int64_t ns;
  double frac;
} plan_time_t;

/* A reload issued or a backward that needs it (h2d_stall). */
typedef struct {
  double t; /* ns after the instance's earliest t_alloc */
  size_t group;
  size_t key; /* ties: its backward place where it has one, else group */
  bool need;  /* false: the reload is issued; true: its backward begins */
} plan_h2d_event_t;

/* What does not depend on the choice, sorted once per instance: the commit,
 * reload and free events by time (additions first at equal times), and the
 * groups in t_alloc order (ties by index), the D2H stream's order. Each
 * evaluation is then one merge of these with the copy ends, which the
 * serialised stream produces already sorted. Also the per-evaluation
 * scratch of the peak and of the reload queue (h2d_stall). */
typedef struct {
  const ofl__plan_group_t *g;
  size_t n;
  plan_event_t *ev; /* PLAN_NEV n */
  size_t *by_alloc; /* n */
  plan_h2d_event_t *h2d; /* 2n, per evaluation */
  double *end;           /* n, per evaluation: a group's copy end */
  double *issue;         /* n, per evaluation: a reload's issue */
  size_t *at_pos;        /* n: the group at each backward place (SIZE_MAX:
                            none) */
  size_t *prev;          /* n, per evaluation: places of chosen groups */
  unsigned char *back; /* n, per evaluation: reloaded before its bytes left
                          (they never leave) */
} plan_order_t;

static int event_cmp(const void *pa, const void *pb) {
  const plan_event_t *a = pa, *b = pb;
  if (a->t != b->t)
    return a->t < b->t ? -1 : 1;
  bool ra = a->kind == PLAN_EV_FREE, rb = b->kind == PLAN_EV_FREE;
  if (ra != rb)
    return ra ? 1 : -1; /* additions before removals: the conservative side */
  if (a->group != b->group)
    return a->group < b->group ? -1 : 1;
  return a->kind - b->kind;
}

/* A recomputed group's bytes come back as its backward begins (t_reload +
 * bwd_window_ns), never after t_free. */
static int64_t recomp_time(const ofl__plan_group_t *x) {
  double w = x->bwd_window_ns > 0 ? x->bwd_window_ns : 0;
  double room = (double)x->t_free - (double)x->t_reload;
  return w >= room ? x->t_free : x->t_reload + (int64_t)llround(w);
}

static bool plan_order_init(plan_order_t *o, const ofl__plan_group_t *g,
                            size_t n) {
  memset(o, 0, sizeof *o);
  o->g = g;
  o->n = n;
  if (n == 0)
    return true;
  size_t each = PLAN_NEV * sizeof(plan_event_t) + 3 * sizeof(size_t) +
                2 * sizeof(plan_h2d_event_t) + 2 * sizeof(double) + 1;
  if (n > SIZE_MAX / each)
    return false;
  o->ev = malloc(n * each);
  if (o->ev == NULL)
    return false;
  o->by_alloc = (size_t *)(o->ev + PLAN_NEV * n);
  o->h2d = (plan_h2d_event_t *)(o->by_alloc + n);
  o->end = (double *)(o->h2d + 2 * n);
  o->issue = o->end + n;
  o->at_pos = (size_t *)(o->issue + n);
  o->prev = o->at_pos + n;
  o->back = (unsigned char *)(o->prev + n);
  for (size_t i = 0; i < n; i++)
    o->at_pos[i] = SIZE_MAX;
  for (size_t i = 0; i < n; i++)
    if (g[i].lead > 0 && g[i].bwd_pos >= 0 && (size_t)g[i].bwd_pos < n)
      o->at_pos[g[i].bwd_pos] = i;
  for (size_t i = 0; i < n; i++) {
    plan_event_t *e = &o->ev[PLAN_NEV * i];
    e[0] = (plan_event_t){g[i].t_alloc, i, PLAN_EV_ALLOC};
    e[1] = (plan_event_t){g[i].t_reload, i, PLAN_EV_RELOAD};
    e[2] = (plan_event_t){recomp_time(&g[i]), i, PLAN_EV_RECOMP};
    e[3] = (plan_event_t){g[i].t_free, i, PLAN_EV_FREE};
  }
  qsort(o->ev, PLAN_NEV * n, sizeof *o->ev, event_cmp);
  /* The commits in sorted order are the t_alloc order, ties by index. */
  size_t k = 0;
  for (size_t e = 0; e < PLAN_NEV * n; e++)
    if (o->ev[e].kind == PLAN_EV_ALLOC)
      o->by_alloc[k++] = o->ev[e].group;
  return true;
}

static void plan_order_fini(plan_order_t *o) {
  free(o->ev);
  o->ev = NULL;
  o->by_alloc = NULL;
  o->h2d = NULL;
  o->end = NULL;
  o->issue = NULL;
  o->at_pos = NULL;
  o->prev = NULL;
  o->back = NULL;
}

static bool is_chosen(const ofl__plan_group_t *g, const bool *chosen,
                      size_t i) {
  return chosen != NULL && g[i].offloadable && chosen[i];
}

/* start + ns, saturating at the clock's end (a copy that never ends never
 * frees its bytes, which is the conservative reading). */
static plan_time_t time_after(plan_time_t start, double ns) {
  if (!(ns > 0))
    ns = 0;
  double x = start.frac + ns;
  if (!(x < 0x1p62))
    return (plan_time_t){INT64_MAX, 0};
  double whole = floor(x);
  int64_t w = (int64_t)whole;
  if (start.ns > INT64_MAX - w)
    return (plan_time_t){INT64_MAX, 0};
  return (plan_time_t){start.ns + w, x - whole};
}

static bool time_before(plan_time_t a, plan_time_t b) {
  return a.ns < b.ns || (a.ns == b.ns && a.frac < b.frac);
}

/* The next chosen group's copy on the D2H stream after *stream (the
 * previous copy's end): sets *group, *stream (the copy's end) and *leave
 * (when its bytes leave: release_ns after the copy's end), advances *next.
 * With one release_ns per instance the leaves come in commit order, sorted
 * like the copy ends. */
static bool next_copy(const plan_order_t *o, const bool *chosen, bool instant,
                      size_t *next, plan_time_t *stream, plan_time_t *leave,
                      size_t *group) {
  while (*next < o->n) {
    size_t i = o->by_alloc[(*next)++];
    if (!is_chosen(o->g, chosen, i))
      continue;
    plan_time_t start = {o->g[i].t_alloc, 0};
    if (time_before(start, *stream))
      start = *stream;
    *stream = time_after(start, instant ? 0 : o->g[i].d2h_ns);
    *leave = time_after(*stream, o->g[i].release_ns);
    *group = i;
    return true;
  }
  return false;
}

/* The group that holds group c's input (has_input), else SIZE_MAX. */
static size_t producer(const ofl__plan_group_t *g, size_t n, size_t c) {
  if (!g[c].has_input || g[c].input_of >= n || g[c].input_of == c)
    return SIZE_MAX;
  return g[c].input_of;
}

/* The producer of recomputed group c's input, where it is offloaded under
 * chosen, else SIZE_MAX. */
static size_t offloaded_input(const ofl__plan_group_t *g, size_t n,
                              const bool *chosen, size_t c) {
  size_t in = producer(g, n, c);
  return in != SIZE_MAX && is_chosen(g, chosen, in) ? in : SIZE_MAX;
}

/* An offloaded group's bytes come back (its reload, or the rerun of a
 * recomputed group whose input they hold, whichever is first): o->back[i]
 * 0 they are there (its copy runs), 1 back before they left (they never
 * leave), 2 they left, 3 back. */
static void come_back(const plan_order_t *o, size_t i, uint64_t *cur) {
  if (o->back[i] == 2) {
    *cur += o->g[i].bytes;
    o->back[i] = 3;
  } else if (o->back[i] == 0) {
    o->back[i] = 1;
  }
}

/* The producer of recomputed group c's input, where it is recomputed too
 * (a chain: the rerun of c makes the producer's tensors again first, and
 * they stay until the producer's backward ends), else SIZE_MAX. */
static size_t recomputed_input(const ofl__plan_group_t *g, size_t n,
                               const bool *rec, size_t c) {
  size_t in = rec != NULL ? producer(g, n, c) : SIZE_MAX;
  return in != SIZE_MAX && rec[in] ? in : SIZE_MAX;
}

/* A recomputed group's rerun bytes come back (its own rerun, or the rerun
 * of a group whose input they are, whichever is first): o->back[i] 3 once
 * they are (a recomputed group is never offloaded, so its back[] is free). */
static void rerun_back(const plan_order_t *o, size_t i, uint64_t *cur) {
  if (o->back[i] != 3) {
    *cur += o->g[i].recompute_bytes;
    o->back[i] = 3;
  }
}

/* instant: every copy takes no time. That peak is a lower bound of the
 * real one (each group's bytes leave no later) and, unlike it, never grows
 * when a group is added to the choice (no queue delays the others; an
 * offloaded producer of an input is back no later than a kept one). */
static uint64_t peak_eval(const plan_order_t *o, const bool *chosen,
                          const bool *rec, bool instant) {
  const ofl__plan_group_t *g = o->g;
  size_t nev = PLAN_NEV * o->n, e = 0, next = 0, copy = 0;
  plan_time_t stream = {INT64_MIN, 0}, end = {INT64_MIN, 0};
  if (o->n > 0)
    memset(o->back, 0, o->n);
  bool pending = next_copy(o, chosen, instant, &next, &stream, &end, &copy);
  uint64_t cur = 0, peak = 0;
  while (e < nev || pending) {
    /* A fixed event at the copy end's whole ns goes first: it is earlier
     * (frac > 0), an addition (additions first), or a removal (either). */
    if (e < nev && (!pending || o->ev[e].t <= end.ns)) {
      const plan_event_t *ev = &o->ev[e++];
      const ofl__plan_group_t *x = &g[ev->group];
      bool r = rec != NULL && rec[ev->group];
      if (ev->kind == PLAN_EV_ALLOC) {
        cur += x->bytes + x->kept_bytes - (r ? x->recompute_bytes : 0);
      } else if (ev->kind == PLAN_EV_RECOMP) {
        if (r) /* the rerun forward's bytes */
          rerun_back(o, ev->group, &cur);
        size_t in = r ? offloaded_input(g, o->n, chosen, ev->group) : SIZE_MAX;
        if (in != SIZE_MAX) /* the rerun's input, reloaded for it */
          come_back(o, in, &cur);
        in = r ? recomputed_input(g, o->n, rec, ev->group) : SIZE_MAX;
        if (in != SIZE_MAX) /* the rerun's input, rerun for it (a chain) */
          rerun_back(o, in, &cur);
      } else if (ev->kind == PLAN_EV_RELOAD) {
        /* Its bytes come back; when they never left (the copy still
         * running), they stay counted once. */
        if (is_chosen(g, chosen, ev->group))
          come_back(o, ev->group, &cur);
      } else {
        cur -= x->bytes + x->kept_bytes;
      }
    } else {
      if (o->back[copy] == 0) {
        cur -= g[copy].bytes;
        o->back[copy] = 2;
      }
      pending = next_copy(o, chosen, instant, &next, &stream, &end, &copy);
    }
    if (cur > peak)
      peak = cur;
  }
  return peak;
}

double ofl__plan_group_exposed(const ofl__plan_group_t *g) {
  double window = g->lead > 0 ? g->bwd_window_max_ns : g->bwd_window_ns;
  return ofl__plan_d2h_part(g) +
         fmax(0.0, g->h2d_ns - window);
}

uint64_t ofl__plan_peak(const ofl__plan_group_t *g, size_t n,
                        const bool *chosen) {
  plan_order_t o;
  if (!plan_order_init(&o, g, n))
    return UINT64_MAX;
  uint64_t peak = peak_eval(&o, chosen, NULL, false);
  plan_order_fini(&o);
  return peak;
}

/* chosen and rec (n each) of actions; false where action is NULL. */
static bool split_actions(const uint8_t *action, size_t n, bool **chosen,
                          bool **rec) {
  *chosen = calloc(2 * (n ? n : 1), sizeof **chosen);
  if (*chosen == NULL)
    return false;
  *rec = *chosen + (n ? n : 1);
  for (size_t i = 0; action != NULL && i < n; i++) {
    (*chosen)[i] = action[i] == OFL__PLAN_OFFLOAD;
    (*rec)[i] = action[i] == OFL__PLAN_RECOMPUTE;
  }
  return true;
}

uint64_t ofl__plan_peak_actions(const ofl__plan_group_t *g, size_t n,
                                const uint8_t *action) {
  bool *chosen, *rec;
  plan_order_t o;
  if (!split_actions(action, n, &chosen, &rec))
    return UINT64_MAX;
  uint64_t peak = UINT64_MAX;
  if (plan_order_init(&o, g, n)) {
    peak = peak_eval(&o, chosen, rec, false);
    plan_order_fini(&o);
  }
  free(chosen);
  return peak;
}

/* ---- the exposed copy time --------------------------------------------- */

static int h2d_event_cmp(const void *pa, const void *pb) {
  const plan_h2d_event_t *a = pa, *b = pb;
  if (a->t != b->t)
    return a->t < b->t ? -1 : 1;
  if (a->need != b->need)
    return a->need ? 1 : -1; /* an issue at the same time goes first */
  if (a->key != b->key)      /* in backward order, as the runtime issues */
    return a->key < b->key ? -1 : 1;
  return a->group < b->group ? -1 : (a->group > b->group);
}

/* The backward of group i begins (ns). */
static int64_t bwd_begin(const ofl__plan_group_t *x) {
  double w = x->bwd_window_ns > 0 ? x->bwd_window_ns : 0;
  return x->t_reload + (int64_t)llround(w);
}

/* When each chosen group's reload is issued under the choice, into
 * o->issue (ns after t0): t_reload where lead is 0, else at the end of the
 * backward of the lead-th chosen group before it in backward order or of
 * the group at gate_pos, whichever is later, within [t_alloc, its
 * backward's begin] (see ofl__plan_group_t). */
static void issue_times(const plan_order_t *o, const bool *chosen, double t0) {
  const ofl__plan_group_t *g = o->g;
  for (size_t i = 0; i < o->n; i++)
    o->issue[i] = (double)g[i].t_reload - t0;
  size_t seen = 0; /* chosen groups so far in backward order */
  for (size_t pos = 0; pos < o->n; pos++) {
    size_t i = o->at_pos[pos];
    if (i == SIZE_MAX || !is_chosen(g, chosen, i))
      continue;
    const ofl__plan_group_t *x = &g[i];
    int64_t begin = bwd_begin(x), at = begin;
    size_t from = x->gate_pos >= 0 ? (size_t)x->gate_pos : pos;
    if (seen >= x->lead && o->prev[seen - x->lead] > from)
      from = o->prev[seen - x->lead];
    if (from < pos) { /* a backward before its own ends */
      size_t k = o->at_pos[from];
      at = k != SIZE_MAX ? g[k].t_free : x->t_reload;
    }
    if (at < x->t_alloc)
      at = x->t_alloc;
    if (at > begin)
      at = begin;
    o->issue[i] = (double)at - t0;
    o->prev[seen++] = pos;
  }
  /* A group whose lead reaches deeper issues the ones before it too
   * (ofl__plan_prefetch_depth: as deep as the deepest lead asks, in
   * order): each takes the earliest issue after it, never before its own
   * commit. */
  double pull = INFINITY;
  for (size_t k = seen; k-- > 0;) {
    size_t i = o->at_pos[o->prev[k]];
    double t = o->issue[i];
    if (pull < t)
      t = fmax(pull, (double)g[i].t_alloc - t0);
    o->issue[i] = t;
    if (t < pull)
      pull = t;
  }
}

/* The reloads of the chosen groups on the one H2D stream, in the order
 * they are issued (issue_times): each starts when it is issued, the stream
 * is free and its own D2H copy has ended (the D2H copies queued as in the
 * peak simulation, next_copy); a backward that begins (t_reload +
 * bwd_window_ns) before its reload ended waits, and everything after that
 * wait runs that much later (the issues of later reloads included).
 * Returns the sum of the waits, ns, and each group's into wait[i] where
 * wait is not NULL; o's h2d, end, issue and prev are its scratch. */
static double h2d_stall(const plan_order_t *o, const bool *chosen,
                        double *wait) {
  const ofl__plan_group_t *g = o->g;
  if (o->n == 0)
    return 0;
  double t0 = (double)g[o->by_alloc[0]].t_alloc; /* the earliest commit */
  size_t next = 0, i = 0;
  plan_time_t stream = {INT64_MIN, 0}, leave;
  while (next_copy(o, chosen, false, &next, &stream, &leave, &i))
    o->end[i] = ((double)stream.ns - t0) + stream.frac;
  issue_times(o, chosen, t0);
  size_t m = 0;
  for (i = 0; i < o->n; i++) {
    if (!is_chosen(g, chosen, i))
      continue;
    double issue = o->issue[i];
    double need = (double)bwd_begin(&g[i]) - t0;
    size_t key = g[i].lead > 0 && g[i].bwd_pos >= 0 &&
                         (size_t)g[i].bwd_pos < o->n &&
                         o->at_pos[g[i].bwd_pos] == i
                     ? (size_t)g[i].bwd_pos
                     : i;
    o->h2d[m++] = (plan_h2d_event_t){issue, i, key, false};
    o->h2d[m++] = (plan_h2d_event_t){need, i, key, true};
  }
  qsort(o->h2d, m, sizeof *o->h2d, h2d_event_cmp);
  double shift = 0, link = -INFINITY, stall = 0;
  for (size_t e = 0; e < m; e++) {
    const plan_h2d_event_t *ev = &o->h2d[e];
    double now = ev->t + shift;
    if (!ev->need) {
      double start = now;
      if (start < link)
        start = link;
      if (start < o->end[ev->group])
        start = o->end[ev->group];
      link = start + (g[ev->group].h2d_ns > 0 ? g[ev->group].h2d_ns : 0);
      o->end[ev->group] = link; /* from here on: its reload's end */
    } else if (o->end[ev->group] > now) {
      stall += o->end[ev->group] - now;
      shift += o->end[ev->group] - now;
      if (wait != NULL)
        wait[ev->group] = o->end[ev->group] - now;
    }
  }
  return stall;
}

/* The D2H part of the exposure: per group, as ofl__plan_group_exposed. */
static double d2h_exposed(const ofl__plan_group_t *g, size_t n,
                          const bool *chosen) {
  double x = 0;
  for (size_t i = 0; i < n; i++)
    if (is_chosen(g, chosen, i))
      x += ofl__plan_d2h_part(&g[i]);
  return x;
}

double ofl__plan_exposure(const ofl__plan_group_t *g, size_t n,
                          const bool *chosen, double *waits, double *part) {
  plan_order_t o;
  if (!plan_order_init(&o, g, n))
    return INFINITY;
  for (size_t i = 0; part != NULL && i < n; i++)
    part[i] = 0;
  double x = h2d_stall(&o, chosen, part);
  plan_order_fini(&o);
  for (size_t i = 0; part != NULL && i < n; i++)
    if (is_chosen(g, chosen, i))
      part[i] += ofl__plan_d2h_part(&g[i]);
  if (waits != NULL)
    *waits = x;
  return d2h_exposed(g, n, chosen) + x; /* the search's order (cand_exposed) */
}

double ofl__plan_exposed(const ofl__plan_group_t *g, size_t n,
                         const bool *chosen) {
  return ofl__plan_exposure(g, n, chosen, NULL, NULL);
}

double ofl__plan_input_wait(const ofl__plan_group_t *g, size_t i,
                            bool offloaded) {
  if (!offloaded || !g[i].has_input)
    return 0;
  double w = g[i].bwd_window_ns > 0 ? g[i].bwd_window_ns : 0;
  return fmax(0.0, g[g[i].input_of].h2d_ns - w);
}

/* The recomputed groups' waits for their inputs' reloads (rec, chosen: n
 * each), ns. */
static double input_waits(const ofl__plan_group_t *g, size_t n,
                          const bool *chosen, const bool *rec) {
  double w = 0;
  for (size_t i = 0; rec != NULL && i < n; i++)
    if (rec[i])
      w += ofl__plan_input_wait(
          g, i, offloaded_input(g, n, chosen, i) != SIZE_MAX);
  return w;
}

/* Whether recomputed group k, other than i, reruns group j's forward as
 * its input before i's backward (a lower bwd_pos). */
static bool earlier_consumer(const ofl__plan_group_t *g, size_t n,
                             const bool *rec, size_t i, size_t j) {
  for (size_t k = 0; k < n; k++)
    if (k != i && rec[k] && g[k].rerun_input && g[k].has_input &&
        g[k].input_of == j && g[k].bwd_pos < g[i].bwd_pos)
      return true;
  return false;
}

double ofl__plan_rerun_credit(const ofl__plan_group_t *g, size_t n,
                              const bool *rec, size_t i) {
  if (!rec[i])
    return 0;
  double c = 0;
  if (g[i].rerun_own && earlier_consumer(g, n, rec, i, i))
    c += g[i].fwd_ns;
  if (g[i].rerun_input && g[i].has_input) {
    size_t j = g[i].input_of;
    if ((rec[j] && g[j].rerun_own && g[j].bwd_pos < g[i].bwd_pos) ||
        earlier_consumer(g, n, rec, i, j))
      c += g[j].fwd_ns;
  }
  return c < g[i].recompute_ns ? c : g[i].recompute_ns;
}

double ofl__plan_rerun_ns(const ofl__plan_group_t *g, size_t n,
                          const bool *rec) {
  double r = 0;
  for (size_t i = 0; i < n; i++)
    if (rec[i])
      r += g[i].recompute_ns - ofl__plan_rerun_credit(g, n, rec, i);
  return r;
}

double ofl__plan_cost(const ofl__plan_group_t *g, size_t n,
                      const uint8_t *action, double *recompute_ns) {
  bool *chosen, *rec;
  if (!split_actions(action, n, &chosen, &rec))
    return INFINITY;
  double r = input_waits(g, n, chosen, rec) + ofl__plan_rerun_ns(g, n, rec);
  double x = ofl__plan_exposed(g, n, chosen) + r;
  free(chosen);
  if (recompute_ns != NULL)
    *recompute_ns = r;
  return x;
}

/* ---- the instance ------------------------------------------------------ */

/* Per name, its offloadable groups in split_rank order and the prefix sums
 * of their exposed time and bytes; the names that have any ("active"). */
typedef struct {
  int nnames;
  size_t *count;   /* nnames: offloadable groups of the name */
  size_t *off;     /* nnames: first slot of the name in members */
  size_t *members; /* offloadable groups, by name then split_rank */
  double *pre_exp; /* per name count+1 entries, from off[name] + name */
  uint64_t *pre_bytes;
  int *active; /* names with count > 0 */
  int nactive;
} plan_names_t;

static void names_fini(plan_names_t *s) {
  free(s->count);
  free(s->off);
  free(s->members);
  free(s->pre_exp);
  free(s->pre_bytes);
  free(s->active);
}

static ofl_status_t names_alloc(plan_names_t *s, int nnames, size_t n) {
  size_t nn = (size_t)nnames;
  memset(s, 0, sizeof *s);
  s->nnames = nnames;
  s->count = calloc(nn + 1, sizeof *s->count);
  s->off = calloc(nn + 1, sizeof *s->off);
  s->members = calloc(n + 1, sizeof *s->members);
  s->pre_exp = calloc(n + nn + 1, sizeof *s->pre_exp);
  s->pre_bytes = calloc(n + nn + 1, sizeof *s->pre_bytes);
  s->active = calloc(nn + 1, sizeof *s->active);
  if (s->count == NULL || s->off == NULL || s->members == NULL ||
      s->pre_exp == NULL || s->pre_bytes == NULL || s->active == NULL) {
    names_fini(s);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "plan solve: no memory for groups %zu names %d", n,
                      nnames);
  }
  return OFL_SUCCESS;
}

static bool add_u64(uint64_t *acc, uint64_t v) {
  if (*acc > UINT64_MAX - v)
    return false;
  *acc += v;
  return true;
}

static bool bad_ns(double v) { return !(v >= 0) || isinf(v); }

/* The checks that need no per-name state: names, times, copy figures, and
 * byte totals the simulation can add up (an offloaded group can count its
 * bytes twice while its copy runs late). */
static ofl_status_t check_group(const ofl__plan_group_t *x, size_t i,
                                size_t n, int nnames, uint64_t *total) {
  if (x->name < 0 || x->name >= nnames)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu name %d out of range (nnames %d)",
                      i, x->name, nnames);
  if (x->t_alloc > x->t_reload || x->t_reload > x->t_free)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu times out of order: t_alloc "
                      "%lld t_reload %lld t_free %lld",
                      i, (long long)x->t_alloc, (long long)x->t_reload,
                      (long long)x->t_free);
  if (x->offloadable &&
      (bad_ns(x->d2h_ns) || bad_ns(x->h2d_ns) || bad_ns(x->fwd_window_ns) ||
       bad_ns(x->bwd_window_ns) || bad_ns(x->release_ns)))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu copy times must be finite and "
                      ">= 0: d2h_ns %g h2d_ns %g fwd_window_ns %g "
                      "bwd_window_ns %g",
                      i, x->d2h_ns, x->h2d_ns, x->fwd_window_ns,
                      x->bwd_window_ns);
  if (x->recomputable &&
      (bad_ns(x->recompute_ns) ||
       x->recompute_bytes > x->bytes + x->kept_bytes ||
       x->bytes + x->kept_bytes < x->bytes))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu recompute_ns %g must be finite "
                      "and >= 0, recompute_bytes %llu at most bytes + "
                      "kept_bytes %llu",
                      i, x->recompute_ns,
                      (unsigned long long)x->recompute_bytes,
                      (unsigned long long)(x->bytes + x->kept_bytes));
  if (x->recomputable && bad_ns(x->fwd_ns))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu fwd_ns %g must be finite and "
                      ">= 0",
                      i, x->fwd_ns);
  if (x->has_input && (x->input_of == i || x->input_of >= n))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu input_of %u must be another "
                      "group, below %zu",
                      i, x->input_of, n);
  if (x->lead > 0 &&
      (x->bwd_pos < 0 || x->gate_pos < 0 || x->gate_pos > x->bwd_pos ||
       bad_ns(x->bwd_window_max_ns) || x->bwd_window_max_ns < x->bwd_window_ns))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu reload place out of range: "
                      "lead %u bwd_pos %d gate_pos %d bwd_window_max_ns %g "
                      "(bwd_window_ns %g)",
                      i, x->lead, x->bwd_pos, x->gate_pos, x->bwd_window_max_ns,
                      x->bwd_window_ns);
  if (!add_u64(total, x->bytes) || !add_u64(total, x->bytes) ||
      !add_u64(total, x->kept_bytes))
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: group %zu byte totals overflow 64 bits", i);
  return OFL_SUCCESS;
}

/* Validates the instance and fills s (allocated by names_alloc). */
static ofl_status_t names_build(plan_names_t *s, const ofl__plan_group_t *g,
                                size_t n) {
  uint64_t total = 0;
  const ofl__plan_group_t *first = NULL;
  for (size_t i = 0; i < n; i++) {
    OFL_CHECK(check_group(&g[i], i, n, s->nnames, &total));
    if (g[i].lead > 0 && (size_t)g[i].bwd_pos >= n)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                        "plan solve: group %zu bwd_pos %d not below the "
                        "%zu groups",
                        i, g[i].bwd_pos, n);
    for (size_t j = 0; g[i].lead > 0 && j < i; j++) {
      if (g[j].lead == 0)
        continue;
      if (g[j].bwd_pos == g[i].bwd_pos)
        return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                          "plan solve: groups %zu and %zu share bwd_pos %d", j,
                          i, g[i].bwd_pos);
      const ofl__plan_group_t *a = g[j].bwd_pos < g[i].bwd_pos ? &g[j] : &g[i],
                              *b = a == &g[j] ? &g[i] : &g[j];
      if (a->gate_pos > b->gate_pos)
        return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                          "plan solve: groups %zu and %zu: gate_pos goes "
                          "back along backward order (%d at place %d, %d at "
                          "place %d)",
                          j, i, a->gate_pos, a->bwd_pos, b->gate_pos,
                          b->bwd_pos);
    }
    if (!g[i].offloadable)
      continue;
    s->count[g[i].name]++;
    if (first == NULL)
      first = &g[i];
    else if (g[i].release_ns != first->release_ns)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                        "plan solve: group %zu release_ns %g differs from "
                        "the instance's %g (one latency for every group)",
                        i, g[i].release_ns, first->release_ns);
    else if (g[i].d2h_free != first->d2h_free)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                        "plan solve: group %zu d2h_free %d differs from the "
                        "instance's %d (one measure of time for every group)",
                        i, (int)g[i].d2h_free, (int)first->d2h_free);
  }
  for (int m = 1; m < s->nnames; m++)
    s->off[m] = s->off[m - 1] + s->count[m - 1];
  for (size_t i = 0; i < n; i++)
    s->members[i] = PLAN_NO_SLOT;
  for (size_t i = 0; i < n; i++) {
    if (!g[i].offloadable)
      continue;
    int m = g[i].name, r = g[i].split_rank;
    /* count distinct ranks in [0, count) leave none missing */
    if (r < 0 || (size_t)r >= s->count[m] ||
        s->members[s->off[m] + (size_t)r] != PLAN_NO_SLOT)
      return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                        "plan solve: group %zu name %d split_rank %d: the "
                        "name's %zu offloadable groups need the distinct "
                        "ranks 0..%zu",
                        i, m, r, s->count[m], s->count[m] - 1);
    s->members[s->off[m] + (size_t)r] = i;
  }
  for (int m = 0; m < s->nnames; m++) {
    size_t base = s->off[m] + (size_t)m;
    for (size_t j = 0; j < s->count[m]; j++) {
      const ofl__plan_group_t *x = &g[s->members[s->off[m] + j]];
      s->pre_exp[base + j + 1] =
          s->pre_exp[base + j] + ofl__plan_group_exposed(x);
      s->pre_bytes[base + j + 1] = s->pre_bytes[base + j] + x->bytes;
    }
    if (s->count[m] > 0)
      s->active[s->nactive++] = m;
  }
  return OFL_SUCCESS;
}

static double name_exposed(const plan_names_t *s, int m, size_t j) {
  return s->pre_exp[s->off[m] + (size_t)m + j];
}

static uint64_t name_bytes(const plan_names_t *s, int m, size_t j) {
  return s->pre_bytes[s->off[m] + (size_t)m + j];
}

/* ---- the search -------------------------------------------------------- */

typedef struct {
  double exposed;
  uint64_t moved;
  uint64_t peak;
} plan_score_t;

/* a beats b: less exposed time beyond the 1 ns tie, then fewer moved
 * bytes, then the lower peak. */
static bool beats(plan_score_t a, plan_score_t b) {
  if (a.exposed < b.exposed - PLAN_TIE_NS)
    return true;
  if (a.exposed > b.exposed + PLAN_TIE_NS)
    return false;
  return a.moved < b.moved || (a.moved == b.moved && a.peak < b.peak);
}

/* Whether a candidate with these sums could beat best for some peak: the
 * test that spares a simulation. */
static bool may_beat(double exposed, uint64_t moved, plan_score_t best) {
  return beats((plan_score_t){exposed, moved, 0}, best);
}

typedef struct {
  const ofl__plan_group_t *g;
  size_t n;
  uint64_t target;
  const plan_names_t *names;
  plan_order_t order;
  bool *cand; /* n: the choice being evaluated */
  uint32_t evaluated;
  /* The recomputed names of the choice (the outer loop of the three-way
   * search): rec (n) their groups, excl their bits among names->active
   * (never offloaded), rcost and rmoved their recompute ns and bytes. */
  bool *rec;
  unsigned rmask, excl;
  double rcost;
  uint64_t rmoved;
  bool linked; /* some recomputable group's input is another group's */
  uint64_t nodes; /* peak evaluations (evaluate), not saturated */
  bool cut;       /* the lowest-peak search ran out of its budget */
} plan_search_t;

/* The exposed time of p->cand (ofl__plan_exposed). */
static double cand_exposed(const plan_search_t *p) {
  /* the recomputed groups are kept as far as the reload queue goes */
  return d2h_exposed(p->g, p->n, p->cand) + h2d_stall(&p->order, p->cand, NULL);
}

/* The recomputed groups' waits for their inputs' reloads under p->cand:
 * never below 0, so the bounds without them stay bounds. */
static double cand_input_waits(const plan_search_t *p) {
  return p->linked ? input_waits(p->g, p->n, p->cand, p->rec) : 0;
}

/* The choice: the active names k with whole[k] (whole indexes
 * names->active), and the first j groups of name split (-1: none). */
static void set_choice(plan_search_t *p, const bool *whole, int split,
                       size_t j) {
  const plan_names_t *s = p->names;
  memset(p->cand, 0, p->n * sizeof *p->cand);
  for (int k = 0; k < s->nactive; k++) {
    int m = s->active[k];
    size_t upto = whole[k] ? s->count[m] : (m == split ? j : 0);
    for (size_t r = 0; r < upto; r++)
      p->cand[s->members[s->off[m] + r]] = true;
  }
}

static uint64_t evaluate(plan_search_t *p, bool instant) {
  if (p->evaluated < UINT32_MAX)
    p->evaluated++;
  p->nodes++;
  return peak_eval(&p->order, p->cand, p->rec, instant);
}

typedef struct {
  plan_score_t score;
  unsigned mask;
  int split;
  size_t j;
  bool found; /* score is of a choice that meets the target */
  unsigned rmask; /* the recomputed names (bits of the recompute list) */
} plan_best_t;

/* bound: the sum of the choice's per-group exposed times, never above its
 * exposed time (ofl__plan_exposed), which the reload queue can raise: a
 * choice whose bound cannot beat the best is not simulated. */
static void try_choice(plan_search_t *p, plan_best_t *best, bool *whole,
                       unsigned mask, int split, size_t j, double bound,
                       uint64_t moved) {
  bound += p->rcost;
  moved += p->rmoved;
  if (!may_beat(bound, moved, best->score))
    return;
  set_choice(p, whole, split, j);
  uint64_t peak = evaluate(p, false);
  if (peak > p->target)
    return;
  plan_score_t sc = {p->rcost + cand_input_waits(p) + cand_exposed(p), moved,
                     peak};
  if (beats(sc, best->score))
    *best = (plan_best_t){sc, mask, split, j, true, p->rmask};
}

/* A subset of whole names (bits index names->active) and its sums. */
typedef struct {
  double exposed;
  uint64_t moved;
  unsigned mask;
} plan_subset_t;

/* The subset with the first j groups of name m, j = 1 .. count - 1, while
 * the exposed time can still beat the best. Where that leaves many j, the
 * lower bound (copies that take no time, never higher for a larger j)
 * skips the first j by bisection: those that cannot meet the target in any
 * case. */
static void try_splits(plan_search_t *p, plan_best_t *best, bool *whole,
                       plan_subset_t sub, int m) {
  const plan_names_t *s = p->names;
  size_t jmax = 0;
  sub.exposed += p->rcost; /* try_choice adds it again itself */
  while (jmax + 1 < s->count[m] && sub.exposed + name_exposed(s, m, jmax + 1) <=
                                       best->score.exposed + PLAN_TIE_NS)
    jmax++;
  size_t lo = 1, hi = jmax + 1; /* the first j whose bound meets: [lo, hi] */
  if (jmax >= PLAN_BISECT_FROM) {
    while (lo < hi) {
      size_t mid = lo + (hi - lo) / 2;
      set_choice(p, whole, m, mid);
      if (evaluate(p, true) <= p->target)
        hi = mid;
      else
        lo = mid + 1;
    }
  }
  for (size_t j = lo; j <= jmax; j++) {
    double ej = sub.exposed + name_exposed(s, m, j);
    if (ej > best->score.exposed + PLAN_TIE_NS)
      break; /* the prefix sums only grow, the best only gets better */
    try_choice(p, best, whole, sub.mask, m, j, ej - p->rcost,
               sub.moved + name_bytes(s, m, j));
  }
}

static int subset_cmp(const void *pa, const void *pb) {
  const plan_subset_t *a = pa, *b = pb;
  if (a->exposed != b->exposed)
    return a->exposed < b->exposed ? -1 : 1;
  if (a->moved != b->moved)
    return a->moved < b->moved ? -1 : 1;
  return a->mask < b->mask ? -1 : (a->mask > b->mask);
}

/* Every subset of whole names, each with at most one more name split at
 * every j, subsets in order of exposed time: once a subset is past the best
 * (beyond the tie), so are all that follow and their splits, since exposed
 * time only grows with what is added. The peak is not monotone in j (a
 * longer D2H queue frees later), so every j that survives the exposed test
 * and the lower bound is simulated. sub has 2^nactive entries. Worst case
 * 2^16 subsets times every split: tight targets on many names with many
 * groups take seconds or more. */
static void subsets_build(const plan_names_t *s, plan_subset_t *sub) {
  int k_n = s->nactive;
  size_t nsub = (size_t)1 << k_n;
  for (size_t i = 0; i < nsub; i++) {
    sub[i] = (plan_subset_t){0, 0, (unsigned)i};
    for (int k = 0; k < k_n; k++)
      if ((i >> k) & 1u) {
        int m = s->active[k];
        sub[i].exposed += name_exposed(s, m, s->count[m]);
        sub[i].moved += name_bytes(s, m, s->count[m]);
      }
  }
  qsort(sub, nsub, sizeof *sub, subset_cmp);
}

/* With the recomputed names of p (none: the offload-only search), the
 * subsets of the other names, sub sorted by subsets_build. */
static plan_best_t search_exact(plan_search_t *p, const plan_subset_t *sub,
                                plan_best_t best) {
  const plan_names_t *s = p->names;
  int k_n = s->nactive;
  size_t nsub = (size_t)1 << k_n;
  bool whole[PLAN_EXACT_NAMES];
  for (size_t i = 0; i < nsub; i++) {
    double e = sub[i].exposed;
    if (p->rcost + e > best.score.exposed + PLAN_TIE_NS)
      break;
    if (sub[i].mask & p->excl)
      continue; /* a recomputed name is not offloaded too */
    for (int k = 0; k < k_n; k++)
      whole[k] = (sub[i].mask >> k) & 1u;
    /* nothing chosen is known not to meet it (peak_none) */
    if (sub[i].mask != 0 || p->rmask != 0)
      try_choice(p, &best, whole, sub[i].mask, -1, 0, e, sub[i].moved);
    for (int k = 0; k < k_n; k++)
      if (!whole[k] && !((p->excl >> k) & 1u))
        try_splits(p, &best, whole, sub[i], s->active[k]);
  }
  return best;
}

/* The names whose every group is recomputable, and per subset of them
 * (bit r: rname[r]) its recompute ns, bytes and offload exclusion. */
typedef struct {
  int nr;
  int rname[PLAN_EXACT_RECOMPUTE];
  double cost;
  uint64_t moved;
  unsigned mask, excl;
} plan_rsub_t;

static int rsub_cmp(const void *pa, const void *pb) {
  const plan_rsub_t *a = pa, *b = pb;
  if (a->cost != b->cost)
    return a->cost < b->cost ? -1 : 1;
  if (a->moved != b->moved)
    return a->moved > b->moved ? -1 : 1; /* more freed first: cuts sooner */
  return a->mask < b->mask ? -1 : (a->mask > b->mask);
}

/* The recomputable names (every group of the name recomputable, at least
 * one group); -1 when more than PLAN_EXACT_RECOMPUTE. */
static int recompute_names(const ofl__plan_group_t *g, size_t n, int nnames,
                           int *rname) {
  int nr = 0;
  for (int m = 0; m < nnames; m++) {
    bool any = false, all = true;
    for (size_t i = 0; i < n; i++)
      if (g[i].name == m) {
        any = true;
        all = all && g[i].recomputable;
      }
    if (!any || !all)
      continue;
    if (nr == PLAN_EXACT_RECOMPUTE)
      return -1;
    rname[nr++] = m;
  }
  return nr;
}

/* Sets p's recompute state to the names of mask (bits of rname). */
static void set_recompute(plan_search_t *p, const int *rname, int nr,
                          unsigned mask) {
  const plan_names_t *s = p->names;
  p->rmask = mask;
  p->excl = 0;
  p->rcost = 0;
  p->rmoved = 0;
  memset(p->rec, 0, p->n * sizeof *p->rec);
  for (int r = 0; r < nr; r++) {
    if (!((mask >> r) & 1u))
      continue;
    for (int k = 0; k < s->nactive; k++)
      if (s->active[k] == rname[r])
        p->excl |= 1u << k;
    for (size_t i = 0; i < p->n; i++)
      if (p->g[i].name == rname[r]) {
        p->rec[i] = true;
        p->rmoved += p->g[i].recompute_bytes;
      }
  }
  p->rcost = ofl__plan_rerun_ns(p->g, p->n, p->rec); /* each forward once */
}

/* Whether some offload choice with p's recomputed names may meet the
 * target: the peak with every other name offloaded and copies that take no
 * time is a lower bound of all of them (evaluate(p, true)). */
static bool recompute_may_meet(plan_search_t *p) {
  bool whole[PLAN_EXACT_NAMES];
  for (int k = 0; k < p->names->nactive; k++)
    whole[k] = !((p->excl >> k) & 1u);
  set_choice(p, whole, -1, 0);
  return evaluate(p, true) <= p->target;
}

/* Every subset of the recomputable names, cheapest first, each with the
 * exact offload search over the other names; a subset whose recompute time
 * alone is past the best ends the loop (the rest cost more), one whose
 * lower bound of the peak is over the target is skipped (a target no
 * choice meets then costs one evaluation per subset). */
static ofl_status_t search_recompute(plan_search_t *p, const plan_subset_t *sub,
                                     const int *rname, int nr,
                                     plan_best_t *best) {
  size_t nrs = (size_t)1 << nr;
  plan_rsub_t *rs = malloc(nrs * sizeof *rs);
  if (rs == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "plan solve: no memory for the %d recomputable names' "
                      "subsets",
                      nr);
  for (size_t q = 0; q < nrs; q++) {
    set_recompute(p, rname, nr, (unsigned)q);
    rs[q] = (plan_rsub_t){0, {0}, p->rcost, p->rmoved, (unsigned)q, p->excl};
  }
  qsort(rs, nrs, sizeof *rs, rsub_cmp);
  for (size_t q = 0; q < nrs; q++) {
    if (rs[q].cost > best->score.exposed + PLAN_TIE_NS)
      break;
    set_recompute(p, rname, nr, rs[q].mask);
    if (nr == 0 || recompute_may_meet(p))
      *best = search_exact(p, sub, *best);
  }
  free(rs);
  return OFL_SUCCESS;
}

/* ---- a target no choice meets: the lowest peak ------------------------- */

/* a beats b for the lowest peak: the lower peak, then the least cost
 * beyond the 1 ns tie, then fewer bytes off the device. */
static bool beats_low(plan_score_t a, plan_score_t b) {
  if (a.peak != b.peak)
    return a.peak < b.peak;
  if (a.exposed < b.exposed - PLAN_TIE_NS)
    return true;
  if (a.exposed > b.exposed + PLAN_TIE_NS)
    return false;
  return a.moved < b.moved;
}

/* The choice (with p's recomputed names) against the lowest found. */
static void low_try(plan_search_t *p, plan_best_t *best, const bool *whole,
                    unsigned mask, int split, size_t j, uint64_t moved) {
  set_choice(p, whole, split, j);
  uint64_t peak = evaluate(p, false);
  if (best->found && peak > best->score.peak)
    return;
  plan_score_t sc = {p->rcost + cand_input_waits(p) + cand_exposed(p),
                     moved + p->rmoved, peak};
  if (!best->found || beats_low(sc, best->score))
    *best = (plan_best_t){sc, mask, split, j, true, p->rmask};
}

/* A subset of the recomputable names and the lowest peak any offload
 * choice can give it (copies that take no time, every other name
 * offloaded). */
typedef struct {
  uint64_t lb;
  double cost;
  unsigned mask;
} plan_rlow_t;

static int rlow_cmp(const void *pa, const void *pb) {
  const plan_rlow_t *a = pa, *b = pb;
  if (a->lb != b->lb)
    return a->lb < b->lb ? -1 : 1;
  if (a->cost != b->cost)
    return a->cost < b->cost ? -1 : 1;
  return a->mask < b->mask ? -1 : (a->mask > b->mask);
}

/* No choice meets the target, recompute on: the lowest predicted peak over
 * the three-way space (every subset of the recomputable names rname, each
 * with every subset of the other names whole and at most one split), ties
 * to the least cost, then to fewer bytes (beats_low). The bound: the peak
 * with copies that take no time (evaluate(p, true)) is never above the
 * real one and never grows when a group is added, so a recompute subset
 * whose bound with everything else offloaded is above the lowest found is
 * skipped with all its choices, an offload subset S likewise (not its
 * splits), and the splits of a name m with S where the bound of S with m
 * whole is above it. Subsets of recomputable names go in the order of their
 * bound; the offload subsets from every name down, so that low peaks come
 * first. At most OFL__PLAN_LOWEST_BUDGET evaluations once a choice was
 * found (the first one tried always is): then it stops with the lowest
 * found and sets p->cut. */
static bool lowest_spent(plan_search_t *p, const plan_best_t *best,
                         uint64_t from) {
  if (best->found && p->nodes - from >= OFL__PLAN_LOWEST_BUDGET)
    p->cut = true;
  return p->cut;
}

static ofl_status_t search_lowest(plan_search_t *p, const int *rname, int nr,
                                  plan_best_t *best) {
  uint64_t from = p->nodes;
  const plan_names_t *s = p->names;
  int k_n = s->nactive;
  size_t nsub = (size_t)1 << k_n, nrs = (size_t)1 << nr;
  uint64_t *lb = malloc(nsub * sizeof *lb);
  plan_rlow_t *rs = malloc(nrs * sizeof *rs);
  if (lb == NULL || rs == NULL) {
    free(lb);
    free(rs);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "plan solve: no memory for the lowest peak's search "
                      "(%d names, %d recomputable)",
                      k_n, nr);
  }
  bool whole[PLAN_EXACT_NAMES];
  for (size_t q = 0; q < nrs; q++) {
    set_recompute(p, rname, nr, (unsigned)q);
    for (int k = 0; k < k_n; k++)
      whole[k] = !((p->excl >> k) & 1u);
    set_choice(p, whole, -1, 0);
    rs[q] = (plan_rlow_t){evaluate(p, true), p->rcost, (unsigned)q};
  }
  qsort(rs, nrs, sizeof *rs, rlow_cmp);
  for (size_t q = 0; q < nrs && !lowest_spent(p, best, from); q++) {
    if (best->found && rs[q].lb > best->score.peak)
      break; /* the rest are bounded higher still */
    set_recompute(p, rname, nr, rs[q].mask);
    for (size_t i = nsub; i-- > 0 && !lowest_spent(p, best, from);) {
      unsigned S = (unsigned)i;
      if (S & p->excl)
        continue;
      uint64_t moved = 0;
      for (int k = 0; k < k_n; k++) {
        whole[k] = (S >> k) & 1u;
        if (whole[k])
          moved += name_bytes(s, s->active[k], s->count[s->active[k]]);
      }
      set_choice(p, whole, -1, 0);
      lb[S] = evaluate(p, true);
      if (!best->found || lb[S] <= best->score.peak)
        low_try(p, best, whole, S, -1, 0, moved);
      for (int k = 0; k < k_n; k++) {
        unsigned with = S | (1u << k);
        if (with == S || (p->excl >> k) & 1u)
          continue;
        if (lb[with] > best->score.peak) /* with > S: computed before */
          continue;
        int m = s->active[k];
        for (size_t j = 1; j < s->count[m] && !lowest_spent(p, best, from);
             j++)
          low_try(p, best, whole, S, m, j, moved + name_bytes(s, m, j));
      }
    }
  }
  free(lb);
  free(rs);
  return OFL_SUCCESS;
}

typedef struct {
  double ratio;
  uint64_t bytes;
  int k;
} plan_rank_t;

static int rank_cmp(const void *pa, const void *pb) {
  const plan_rank_t *a = pa, *b = pb;
  if (a->ratio != b->ratio)
    return a->ratio > b->ratio ? -1 : 1;
  if (a->bytes != b->bytes)
    return a->bytes > b->bytes ? -1 : 1;
  return a->k - b->k;
}

/* Above PLAN_EXACT_NAMES: whole names by bytes per exposed ns, most first,
 * until the target is met; then each added name, least efficient first, is
 * dropped again where the target is met without it (which can also turn an
 * all-names choice that misses the target into one that meets it: the peak
 * is not monotone). Leaves the choice in p->cand. */
static ofl_status_t search_greedy(plan_search_t *p, uint64_t *peak) {
  const plan_names_t *s = p->names;
  int k_n = s->nactive;
  plan_rank_t *rank = calloc((size_t)k_n, sizeof *rank);
  bool *whole = calloc((size_t)k_n, sizeof *whole);
  if (rank == NULL || whole == NULL) {
    free(rank);
    free(whole);
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "plan solve: no memory for the greedy order of %d "
                      "names",
                      k_n);
  }
  for (int k = 0; k < k_n; k++) {
    int m = s->active[k];
    double e = name_exposed(s, m, s->count[m]);
    uint64_t b = name_bytes(s, m, s->count[m]);
    rank[k] = (plan_rank_t){e > 0 ? (double)b / e : INFINITY, b, k};
  }
  qsort(rank, (size_t)k_n, sizeof *rank, rank_cmp);
  int added = 0;
  uint64_t cur = UINT64_MAX;
  while (added < k_n && cur > p->target) {
    whole[rank[added++].k] = true;
    set_choice(p, whole, -1, 0);
    cur = evaluate(p, false);
  }
  for (int a = added - 1; a >= 0; a--) {
    whole[rank[a].k] = false;
    set_choice(p, whole, -1, 0);
    uint64_t without = evaluate(p, false);
    if (without <= p->target)
      cur = without;
    else
      whole[rank[a].k] = true;
  }
  set_choice(p, whole, -1, 0);
  *peak = cur;
  free(rank);
  free(whole);
  return OFL_SUCCESS;
}

static void fill_result(const plan_search_t *p, ofl__plan_result_t *r) {
  r->exposed_ns = cand_exposed(p);
  r->moved_bytes = 0;
  r->recompute_ns = 0;
  r->recomputed_bytes = 0;
  for (size_t i = 0; i < p->n; i++) {
    if (p->cand[i])
      r->moved_bytes += p->g[i].bytes;
    if (p->rec[i])
      r->recomputed_bytes += p->g[i].recompute_bytes;
  }
  r->recompute_ns = ofl__plan_rerun_ns(p->g, p->n, p->rec);
  r->recompute_ns += cand_input_waits(p);
  r->cost_ns = r->exposed_ns + r->recompute_ns;
}

static ofl_status_t solve(plan_search_t *p, bool recompute,
                          ofl__plan_result_t *r) {
  const plan_names_t *s = p->names;
  memset(p->cand, 0, p->n * sizeof *p->cand);
  r->peak_none = evaluate(p, false);
  for (size_t i = 0; i < p->n; i++)
    p->cand[i] = p->g[i].offloadable;
  r->peak_all = evaluate(p, false);
  r->exact = s->nactive <= PLAN_EXACT_NAMES;
  r->split_name = -1;
  if (r->peak_none <= p->target) {
    memset(p->cand, 0, p->n * sizeof *p->cand);
    r->predicted_peak = r->peak_none;
    return OFL_SUCCESS;
  }
  int rname[PLAN_EXACT_RECOMPUTE], nr = 0;
  if (recompute && r->exact) {
    nr = recompute_names(p->g, p->n, s->nnames, rname);
    if (nr < 0) { /* too many to search: offload only, and say so */
      nr = 0;
      r->exact = false;
    }
  }
  if (!r->exact && s->nactive > PLAN_EXACT_NAMES)
    return search_greedy(p, &r->predicted_peak);
  /* Every offloadable group offloaded is the first candidate where it meets
   * the target; where it does not, a subset still may (the peak is not
   * monotone), and where none does, the answer is all of them, not met. */
  plan_best_t best = {{INFINITY, UINT64_MAX, UINT64_MAX}, 0, -1, 0, false, 0};
  if (r->peak_all <= p->target) { /* p->cand: every offloadable group */
    best.score = (plan_score_t){cand_exposed(p), 0, r->peak_all};
    best.found = true;
    for (int k = 0; k < s->nactive; k++) {
      int m = s->active[k];
      best.score.moved += name_bytes(s, m, s->count[m]);
    }
  }
  best.mask = (1u << s->nactive) - 1;
  plan_subset_t *sub = malloc(((size_t)1 << s->nactive) * sizeof *sub);
  if (sub == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "plan solve: no memory for the %d names' subsets",
                      s->nactive);
  subsets_build(s, sub);
  ofl_status_t st = search_recompute(p, sub, rname, nr, &best);
  free(sub);
  if (st != OFL_SUCCESS)
    return st;
  if (!best.found && recompute) { /* no choice meets it: the lowest peak */
    uint64_t from = p->nodes;
    OFL_CHECK(search_lowest(p, rname, nr, &best));
    r->lowest = best.found;
    r->cut = p->cut;
    r->lowest_nodes =
        p->nodes - from < UINT32_MAX ? (uint32_t)(p->nodes - from) : UINT32_MAX;
  }
  set_recompute(p, rname, nr, best.found ? best.rmask : 0);
  bool whole[PLAN_EXACT_NAMES] = {false};
  for (int k = 0; k < s->nactive; k++)
    whole[k] = (best.mask >> k) & 1u;
  set_choice(p, whole, best.split, best.j);
  r->predicted_peak = best.found ? best.score.peak : r->peak_all;
  r->split_name = best.split;
  return OFL_SUCCESS;
}

static ofl_status_t solve_any(const ofl__plan_group_t *g, size_t n,
                              int nnames, uint64_t target, bool recompute,
                              bool *chosen, bool *rec,
                              ofl__plan_result_t *out) {
  if ((n > 0 && (g == NULL || chosen == NULL)) || out == NULL || nnames < 0)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan solve: groups %p n %zu chosen %p out %p nnames "
                      "%d: pointers must be set and nnames >= 0",
                      (const void *)g, n, (void *)chosen, (void *)out, nnames);
  plan_names_t names;
  OFL_CHECK(names_alloc(&names, nnames, n));
  plan_search_t p = {g, n, target, &names, {0}, NULL, 0, NULL, 0, 0, 0, 0,
                     false, 0, false};
  for (size_t i = 0; i < n; i++)
    p.linked |= g[i].recomputable && g[i].has_input;
  ofl__plan_result_t r;
  memset(&r, 0, sizeof r);
  ofl_status_t st = names_build(&names, g, n);
  if (st != OFL_SUCCESS)
    goto out_names;
  p.cand = calloc(2 * (n + 1), sizeof *p.cand);
  if (p.cand != NULL)
    p.rec = p.cand + n + 1;
  if (p.cand == NULL || !plan_order_init(&p.order, g, n)) {
    st =
        ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                   "plan solve: no memory for the simulation of %zu groups", n);
    goto out_cand;
  }
  OFL_CHECK_GOTO(solve(&p, recompute, &r), st, out_order);
  fill_result(&p, &r);
  r.met = r.predicted_peak <= target;
  r.evaluated = p.evaluated;
  if (n > 0) {
    memcpy(chosen, p.cand, n * sizeof *chosen);
    memcpy(rec, p.rec, n * sizeof *rec);
  }
  *out = r;
out_order:
  plan_order_fini(&p.order);
out_cand:
  free(p.cand);
out_names:
  names_fini(&names);
  return st;
}

ofl_status_t ofl__plan_solve(const ofl__plan_group_t *g, size_t n, int nnames,
                             uint64_t target, bool *chosen,
                             ofl__plan_result_t *out) {
  if ((n > 0 && (g == NULL || chosen == NULL)) || out == NULL)
    return solve_any(g, n, nnames, target, false, chosen, NULL, out);
  bool *rec = calloc(n + 1, sizeof *rec);
  if (rec == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "plan solve: no memory for %zu groups", n);
  ofl_status_t st = solve_any(g, n, nnames, target, false, chosen, rec, out);
  free(rec);
  return st;
}

ofl_status_t ofl__plan_solve_actions(const ofl__plan_group_t *g, size_t n,
                                     int nnames, uint64_t target,
                                     bool recompute, uint8_t *action,
                                     ofl__plan_result_t *out) {
  if ((n > 0 && (g == NULL || action == NULL)) || out == NULL)
    return solve_any(g, n, nnames, target, recompute, NULL, NULL, out);
  bool *chosen = calloc(2 * (n + 1), sizeof *chosen);
  if (chosen == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "plan solve: no memory for %zu groups", n);
  bool *rec = chosen + n + 1;
  ofl_status_t st =
      solve_any(g, n, nnames, target, recompute, chosen, rec, out);
  for (size_t i = 0; st == OFL_SUCCESS && i < n; i++)
    action[i] = rec[i]      ? OFL__PLAN_RECOMPUTE
                : chosen[i] ? OFL__PLAN_OFFLOAD
                            : OFL__PLAN_KEEP;
  free(chosen);
  return st;
}

uint64_t ofl__plan_replan_aim(uint64_t target, uint64_t last_aim,
                              uint64_t measured, uint64_t predicted) {
  uint64_t over = measured > target ? measured - target : 0;
  uint64_t aim = last_aim > over ? last_aim - over : 1;
  if (measured > predicted) {
    uint64_t err = measured - predicted;
    uint64_t fit = target > err ? target - err : 1;
    if (fit < aim)
      aim = fit;
  }
  return aim;
}

/* A replan whose aim nothing meets (the lowest-peak choice, out): the plan
 * before it went over the target although the model put every choice at
 * or above this peak, so the model's peaks cannot rank the choices that tie
 * at it; bytes off the device can. The offload-only fallback (every group
 * offloaded) replaces out where its predicted peak is no higher and it
 * takes more bytes off the device (offloaded and recomputed), its cost
 * whatever it is. The lowest-peak choice of the first solve breaks ties to
 * the least cost; in the demo's test of a late warmup that choice, every
 * choice predicted at 2.75 MiB, kept a third of the bytes offloading all
 * would move, measured 2.00 MiB against a 1.84 target, and the replans
 * chose it again and again until they ran out. */
static void more_off_at_the_lowest(const ofl__plan_group_t *g, size_t n,
                                   int nnames, uint64_t aim, uint8_t *action,
                                   ofl__plan_result_t *out) {
  uint8_t *cand = malloc(n);
  ofl__plan_result_t r;
  if (cand != NULL &&
      ofl__plan_solve_actions(g, n, nnames, aim, false, cand, &r) ==
          OFL_SUCCESS &&
      r.predicted_peak <= out->predicted_peak &&
      r.moved_bytes + r.recomputed_bytes >
          out->moved_bytes + out->recomputed_bytes) {
    memcpy(action, cand, n);
    r.lowest = true; /* no choice meets the aim */
    *out = r;
  }
  free(cand);
}

ofl_status_t ofl__plan_replan_actions(const ofl__plan_group_t *g, size_t n,
                                     int nnames, uint64_t target,
                                     uint64_t last_aim, uint64_t measured,
                                     uint64_t predicted, uint64_t moved_before,
                                     uint8_t *action, ofl__plan_result_t *out,
                                     uint64_t *aim_out) {
  if (aim_out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "plan replan: aim_out must not be NULL");
  uint64_t aim = ofl__plan_replan_aim(target, last_aim, measured, predicted);
  OFL_CHECK(
      ofl__plan_solve_actions(g, n, nnames, aim, true, action, out));
  *aim_out = aim;
  if (!out->met && n > 0)
    more_off_at_the_lowest(g, n, nnames, aim, action, out);
  uint64_t err = measured > predicted ? measured - predicted : 0;
  if (err == 0 || moved_before == 0 || n == 0)
    return OFL_SUCCESS; /* an error no offload carries: the aim alone */
  uint8_t *cand = malloc(n);
  ofl__plan_group_t *kept = malloc(n * sizeof *kept);
  if (cand == NULL || kept == NULL) {
    free(cand);
    free(kept);
    return OFL_SUCCESS; /* the aim's plan stands */
  }
  /* The recompute-only space: every group kept or recomputed (its bytes
   * stay as kept bytes), which carries none of the error. */
  memcpy(kept, g, n * sizeof *kept);
  for (size_t i = 0; i < n; i++)
    if (kept[i].offloadable) {
      kept[i].kept_bytes += kept[i].bytes;
      kept[i].bytes = 0;
      kept[i].offloadable = false;
    }
  /* the target less 0, 1/4, 1/2, 3/4 of the error: aims above the first;
   * then the recompute-only choice for the target */
  for (unsigned k = 0; k <= OFL__PLAN_REPLAN_SHARES; k++) {
    bool only = k == OFL__PLAN_REPLAN_SHARES;
    uint64_t part = only ? 0 : err / OFL__PLAN_REPLAN_SHARES * k;
    if (part >= target || (!only && target - part <= aim))
      continue;
    uint64_t a = target - part;
    ofl__plan_result_t r;
    if (ofl__plan_solve_actions(only ? kept : g, n, nnames, a, true, cand,
                                &r) != OFL_SUCCESS ||
        !r.met)
      continue;
    uint64_t carried = ofl__plan_carried(err, r.moved_bytes, moved_before);
    if (r.predicted_peak > UINT64_MAX - carried ||
        r.predicted_peak + carried > target)
      continue;
    if (out->met && r.cost_ns >= out->cost_ns)
      continue;
    memcpy(action, cand, n);
    *out = r;
    *aim_out = a;
  }
  free(cand);
  free(kept);
  return OFL_SUCCESS;
}

uint64_t ofl__plan_under_note(ofl__plan_under_t *u, bool fresh,
                              uint64_t predicted, uint64_t measured) {
  if (fresh)
    u->iters = 0;
  if (measured >= predicted) {
    u->iters = 0;
    return 0;
  }
  uint64_t err = predicted - measured;
  if (u->iters == 0 || err < u->err)
    u->err = err;
  if (u->iters < OFL__PLAN_RAISE_AFTER)
    u->iters++;
  return u->iters >= OFL__PLAN_RAISE_AFTER ? u->err : 0;
}
