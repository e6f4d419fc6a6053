/* ofl: reload stalls measured where they happen. On cuda the CPU enqueues
 * far ahead of the GPU, so a query of the reload's event when backward
 * begins says "not ready" nearly always and measures nothing. Instead a
 * timing event is recorded on the compute stream before and after its wait
 * for the reload; the time between them is how long compute was held. The
 * pairs are read later (at reset, or when statistics are asked for), from a
 * fixed ring made at the first wait: steady state creates nothing. */
#include <stdlib.h>

#include "pipeline/pipeline_internal.h"
#include "runtime/device_internal.h"

#define NPROBES 64
/* Back-to-back events around a wait that is already satisfied differ by a
 * few microseconds; a longer gap is compute held by the reload. */
#define STALL_NS 10000

typedef struct probe {
  ofl_event_t *before, *after;
  int nid;
  group_t *g; /* its reload (groups live as long as the manager) */
  bool pending;
  bool warm; /* a warmup backward's begin (the plan takes it out) */
} probe_t;

struct ofl__stall_probes {
  probe_t p[NPROBES];
  uint32_t next;
  bool unsupported;
};

static void harvest_one(ofl_manager_t *m, probe_t *p, bool wait) {
  if (!p->pending)
    return;
  uint64_t ns = 0;
  ofl_status_t st = ofl__event_elapsed_ns(p->before, p->after, &ns);
  if (st == OFL_ERR_NOT_READY && wait &&
      ofl_event_synchronize(p->after, OFL_TIMEOUT_DEFAULT) == OFL_SUCCESS)
    st = ofl__event_elapsed_ns(p->before, p->after, &ns);
  if (st == OFL_ERR_NOT_READY)
    return;
  p->pending = false;
  if (st != OFL_SUCCESS || ns < STALL_NS)
    return;
  m->st.stalls++;
  m->st.stall_ns += ns;
  if (p->nid >= 0 && p->nid < m->nnames) {
    m->names[p->nid].st.stalls++;
    m->names[p->nid].st.stall_ns += ns;
  }
  ofl__plan_on_stall(m, p->g, ns, p->warm);
}

void ofl__stall_harvest(ofl_manager_t *m, bool wait) {
  if (m->probes == NULL)
    return;
  for (uint32_t i = 0; i < NPROBES; i++)
    harvest_one(m, &m->probes->p[i], wait);
}

static ofl_status_t make_probes(ofl_manager_t *m) {
  ofl__stall_probes_t *pr = calloc(1, sizeof *pr);
  if (pr == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "cannot allocate the stall probes");
  m->probes = pr;
  for (uint32_t i = 0; i < NPROBES; i++) {
    ofl_status_t st = ofl__event_create_timed(m->dev, &pr->p[i].before);
    if (st == OFL_SUCCESS)
      st = ofl__event_create_timed(m->dev, &pr->p[i].after);
    if (st != OFL_SUCCESS) {
      pr->unsupported = true; /* measured on the CPU instead */
      return st;
    }
  }
  return OFL_SUCCESS;
}

ofl_status_t ofl__stall_timed_wait(ofl_manager_t *m, group_t *g,
                                   ofl_stream_t *compute, ofl_event_t *ev,
                                   bool warm) {
  if (m->probes == NULL && ofl_device_backend(m->dev) != OFL_BACKEND_HOST)
    (void)make_probes(m);
  if (m->probes == NULL || m->probes->unsupported)
    return OFL_ERR_NOT_SUPPORTED;
  probe_t *p = &m->probes->p[m->probes->next];
  /* The ring came round: read its oldest pair if it completed; if not,
   * this wait goes unmeasured rather than make the training thread wait
   * for the GPU (which would cap how far the CPU runs ahead). */
  harvest_one(m, p, false);
  if (p->pending)
    return ofl_stream_wait_event(compute, ev); /* waited, not measured */
  OFL_CHECK(ofl_event_record(p->before, compute));
  OFL_CHECK(ofl_stream_wait_event(compute, ev));
  OFL_CHECK(ofl_event_record(p->after, compute));
  p->nid = g->nid;
  p->g = g;
  p->warm = warm;
  p->pending = true;
  m->probes->next = (m->probes->next + 1) % NPROBES;
  return OFL_SUCCESS;
}

void ofl__stall_free(ofl_manager_t *m) {
  if (m->probes == NULL)
    return;
  for (uint32_t i = 0; i < NPROBES; i++) {
    if (m->probes->p[i].before != NULL)
      ofl_event_destroy(m->probes->p[i].before);
    if (m->probes->p[i].after != NULL)
      ofl_event_destroy(m->probes->p[i].after);
  }
  free(m->probes);
  m->probes = NULL;
}
