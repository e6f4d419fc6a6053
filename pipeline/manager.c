/* ofl: the pipeline offload manager, the top of pipeline/: lifecycle
 * (instances and the process singleton), configuration, the per-iteration
 * reset, the stream boundaries and statistics. Chunks are in chunk.c,
 * groups in group_forward.c and group_backward.c, the end of warmup in
 * policy.c, what it reports in report.c; docs/design/pipeline.md draws the
 * layers. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline_internal.h"
#include "pool/pool_internal.h"

/* ---- configuration ----------------------------------------------------------
 */

/* params.device_memory_target_bytes / OFL_DEVICE_MEMORY_TARGET: the device
 * memory the step may use at its peak; plan_measure.c turns it into an
 * activation target at the end of the warmup. */
static ofl_status_t read_device_target(ofl_manager_t *m,
                                       const ofl_manager_params_t *p) {
  if (p->device_memory_target_bytes >= 0) {
    m->dev_target = (uint64_t)p->device_memory_target_bytes;
    m->from_params |= OFL__SRC_DEV_TARGET;
  } else {
    size_t t;
    OFL_CHECK(ofl__config_size("OFL_DEVICE_MEMORY_TARGET", &t));
    m->dev_target = t;
  }
  if (m->dev_target > 0 && !m->auto_plan)
    OFL_WARN(OFL_SUBSYS_PIPELINE,
             "a device memory target of %llu bytes is set "
             "(OFL_DEVICE_MEMORY_TARGET / params.device_memory_target_bytes; "
             "ofl.torch's device_memory_target=) but the offloaded groups are "
             "configured: the target is ignored; set OFL_OFFLOAD_GROUPS=auto "
             "(params.groups \"auto\"; offload_modules=\"auto\" in "
             "ofl.torch) for a plan that meets it",
             (unsigned long long)m->dev_target);
  return OFL_SUCCESS;
}
static ofl_status_t configure(ofl_manager_t *m, const ofl_manager_params_t *p) {
  bool b;
  m->from_params = (p->offload >= 0 ? OFL__SRC_OFFLOAD : 0) |
                   (p->groups != NULL ? OFL__SRC_GROUPS : 0) |
                   (p->min_offload_elems >= 0 ? OFL__SRC_MIN_ELEMS : 0) |
                   (p->min_offload_bytes >= 0 ? OFL__SRC_MIN_BYTES : 0) |
                   (p->fraction >= 0 ? OFL__SRC_FRACTION : 0) |
                   (p->rank_delta_bytes >= 0 ? OFL__SRC_DELTA : 0) |
                   (p->max_inflight >= 0 ? OFL__SRC_INFLIGHT : 0) |
                   (p->prefetch_groups > 0 ? OFL__SRC_PREFETCH : 0) |
                   (p->host_budget_bytes >= 0 ? OFL__SRC_HOST_BUDGET : 0);
  if (p->offload >= 0) {
    m->offload = p->offload != 0;
  } else {
    OFL_CHECK(ofl__config_bool("OFL_OFFLOAD", &b));
    m->offload = b;
  }
  const char *groups = p->groups;
  if (groups == NULL)
    OFL_CHECK(ofl__config_str("OFL_OFFLOAD_GROUPS", &groups));
  const char *dyn = p->dynamic_groups != NULL
                        ? p->dynamic_groups
                        : "expert_fc1,moe_act,fused_group_mlp";
  /* "auto": every name is offloaded in the warmup, the plan chooses. */
  m->auto_plan = groups != NULL && strcmp(groups, "auto") == 0;
  m->groups_cfg = strdup(groups && !m->auto_plan ? groups : "");
  m->dynamic_cfg = strdup(dyn);
  if (m->groups_cfg == NULL || m->dynamic_cfg == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the manager's configuration");
  int64_t v;
  if (p->min_offload_elems >= 0) {
    m->min_elems = (uint64_t)p->min_offload_elems;
  } else {
    OFL_CHECK(ofl__config_int("OFL_MIN_OFFLOAD_ELEMS", &v));
    m->min_elems = v < 0 ? 0 : (uint64_t)v;
  }
  if (p->min_offload_bytes >= 0)
    m->min_bytes = (size_t)p->min_offload_bytes;
  else
    OFL_CHECK(ofl__config_size("OFL_MIN_OFFLOAD_BYTES", &m->min_bytes));
  double f = p->fraction;
  if (f < 0)
    OFL_CHECK(ofl__config_double("OFL_OFFLOAD_FRACTION", &f));
  if (!(f >= 0.0 && f <= 1.0))
    return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_PIPELINE,
                      "offload fraction %g is outside [0, 1]; set "
                      "OFL_OFFLOAD_FRACTION or params.fraction in that range",
                      f);
  m->fraction = f;
  if (p->rank_delta_bytes >= 0) {
    m->rank_delta_bytes = (uint64_t)p->rank_delta_bytes;
  } else {
    size_t d;
    OFL_CHECK(ofl__config_size("OFL_RANK_DELTA_BYTES", &d));
    m->rank_delta_bytes = d;
  }
  if (p->max_inflight >= 0) {
    m->max_inflight = (uint32_t)p->max_inflight;
  } else {
    OFL_CHECK(ofl__config_int("OFL_MAX_INFLIGHT", &v));
    if (v < 0 || v > 1000000)
      return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_PIPELINE,
                        "OFL_MAX_INFLIGHT %lld is outside 0..1000000",
                        (long long)v);
    m->max_inflight = (uint32_t)v;
  }
  if (p->prefetch_groups > 0) {
    v = p->prefetch_groups;
  } else {
    OFL_CHECK(ofl__config_int("OFL_PREFETCH_GROUPS", &v));
  }
  if (v < 1 || v > 64)
    return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_PIPELINE,
                      "prefetch groups %lld is outside 1..64; set "
                      "OFL_PREFETCH_GROUPS or params.prefetch_groups in that "
                      "range",
                      (long long)v);
  m->prefetch_groups = (uint32_t)v;
  if (p->memory_target_bytes >= 0) {
    m->mem_target = (uint64_t)p->memory_target_bytes;
    m->from_params |= OFL__SRC_TARGET;
  } else {
    size_t t;
    OFL_CHECK(ofl__config_size("OFL_MEMORY_TARGET", &t));
    m->mem_target = t;
  }
  OFL_CHECK(read_device_target(m, p));
  OFL_CHECK(ofl__config_bool("OFL_PLAN_RECOMPUTE", &m->plan_recompute));
  if (m->mem_target > 0 && !m->auto_plan)
    OFL_WARN(OFL_SUBSYS_PIPELINE,
             "a memory target of %llu bytes is set (OFL_MEMORY_TARGET / "
             "params.memory_target_bytes; ofl.torch's memory_target=) but "
             "the offloaded groups are configured ('%s'): the target is "
             "ignored; set OFL_OFFLOAD_GROUPS=auto (params.groups \"auto\"; "
             "offload_modules=\"auto\" in ofl.torch) for a plan that meets "
             "it",
             (unsigned long long)m->mem_target, m->groups_cfg);
  if (m->auto_plan && (m->fraction < 1.0 || m->rank_delta_bytes > 0))
    OFL_WARN(OFL_SUBSYS_PIPELINE,
             "groups \"auto\": the offload fraction (%g) and the rank delta "
             "(%llu bytes) are ignored; the plan decides from the memory "
             "target and the warmup's measurements",
             m->fraction, (unsigned long long)m->rank_delta_bytes);
  m->pp_rank = p->pp_rank < 0 ? 0 : p->pp_rank;
  m->rank = p->rank >= 0 ? p->rank : ofl_log_get_rank();
  m->comm = p->comm;
  m->summary_out = p->summary_out;
  m->disk = p->disk;
  return OFL_SUCCESS;
}

static ofl_status_t open_resources(ofl_manager_t *m,
                                   const ofl_manager_params_t *p) {
  if (p->device != NULL) {
    m->dev = p->device;
  } else {
    OFL_CHECK(ofl_device_open(NULL, &m->dev));
    m->own_dev = true;
  }
  /* A device closed before this manager is destroyed closes after it. */
  ofl__device_pool_created(m->dev);
  m->holds_dev = true;
  m->test.compute_at_create = ofl_device_compute_stream(m->dev);
  OFL_CHECK(ofl_stream_create(m->dev, "offload-d2h", &m->d2h));
  OFL_CHECK(ofl_stream_create(m->dev, "offload-h2d", &m->h2d));
  OFL_CHECK(ofl_event_create(m->dev, &m->ev_compute));
  OFL_CHECK(ofl_event_create(m->dev, &m->ev_d2h));
  OFL_CHECK(ofl_event_create(m->dev, &m->ev_h2d));
  ofl_pool_params_t hp = OFL_POOL_PARAMS_INIT;
  hp.kind = OFL_POOL_PINNED;
  hp.name = "offload-host";
  /* Every pinned block from registered segments: no registration per
   * tensor, and changing sizes share the segments (DESIGN section 4). */
  hp.segments = OFL_POOL_SEGMENTS_ALL;
  hp.budget_bytes = p->host_budget_bytes < 0 ? OFL_POOL_BUDGET_FROM_ENV
                                             : (size_t)p->host_budget_bytes;
  OFL_CHECK(ofl_pool_create(m->dev, &hp, &m->host_pool));
  m->pin_limit = m->pin_cluster_max = UINT64_MAX;
  ofl__tier_end_iteration(m);
  if (p->device_pool != NULL) {
    m->dev_pool = p->device_pool;
  } else {
    ofl_pool_params_t dp = OFL_POOL_PARAMS_INIT;
    dp.name = "offload-reload";
    OFL_CHECK(ofl_pool_create(m->dev, &dp, &m->dev_pool));
    m->own_dev_pool = true;
  }
  return OFL_SUCCESS;
}

/* ---- lifecycle
 * ---------------------------------------------------------------- */

ofl_status_t ofl_manager_create(const ofl_manager_params_t *params,
                                ofl_manager_t **out) {
  if (out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_create: out must not be NULL");
  ofl_manager_params_t defaults = OFL_MANAGER_PARAMS_INIT;
  const ofl_manager_params_t *p = params ? params : &defaults;
  ofl_manager_t *m = calloc(1, sizeof *m);
  if (m == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_PIPELINE,
                      "no memory for the offload manager");
  /* Managers alive at once get different ids (255 in a row before one
   * comes back). */
  static atomic_uint next_tag_id;
  m->tag_id = atomic_fetch_add(&next_tag_id, 1) % 255u + 1u;
  m->warmup = true;
  m->enabled = true;
  m->test.fail_offload_after = -1;
  ofl_status_t s;
  OFL_CHECK_GOTO(configure(m, p), s, fail);
  OFL_CHECK_GOTO(open_resources(m, p), s, fail);
  OFL_INFO(OFL_SUBSYS_PIPELINE,
           "rank %d pp_rank %d: manager created (offload %d, groups '%s', "
           "min bytes %zu elems %llu, fraction %g, delta %llu, inflight %u)",
           m->rank, m->pp_rank, m->offload, m->groups_cfg, m->min_bytes,
           (unsigned long long)m->min_elems, m->fraction,
           (unsigned long long)m->rank_delta_bytes, m->max_inflight);
  *out = m;
  return OFL_SUCCESS;
fail:
  ofl_manager_destroy(m);
  return s;
}

static void close_device(void *dev) { ofl_device_close(dev); }

void ofl_manager_destroy(ofl_manager_t *m) {
  if (m == NULL)
    return;
  if (m->d2h)
    ofl_stream_synchronize(m->d2h, OFL_TIMEOUT_DEFAULT);
  if (m->h2d)
    ofl_stream_synchronize(m->h2d, OFL_TIMEOUT_DEFAULT);
  /* The probes name groups: harvested while the groups exist. */
  ofl__stall_harvest(m, true);
  for (uint32_t i = 0; i < m->nfwd; i++)
    for (uint32_t j = 0; j < m->fwd[i]->ngroups; j++)
      ofl__group_end_iteration(m, m->fwd[i]->groups[j]);
  for (uint32_t i = 0; i < m->nheld; i++)
    ofl_tensor_destroy(m->held[i]);
  ofl_pool_destroy(m->host_pool);
  for (uint32_t i = 0; i < m->nfwd; i++)
    ofl__chunk_free(m->fwd[i]);
  if (m->d2h)
    ofl_stream_destroy(m->d2h);
  if (m->h2d)
    ofl_stream_destroy(m->h2d);
  ofl__stall_free(m);
  ofl__plan_free(m);
  ofl_event_destroy(m->ev_compute);
  ofl_event_destroy(m->ev_d2h);
  ofl_event_destroy(m->ev_h2d);
  if (m->own_dev_pool) {
    /* Popped tensors are the caller's and may still use the reload pool's
     * blocks: the pool (and the device, if ours) goes with the last. */
    ofl__pool_destroy_when_idle(m->dev_pool, m->own_dev ? close_device : NULL,
                                m->dev);
  } else if (m->own_dev) {
    ofl_device_close(m->dev);
  }
  for (int i = 0; i < m->nnames; i++) {
    free(m->names[i].name);
    free(m->names[i].range_offload);
    free(m->names[i].range_reload);
    free(m->names[i].ring);
  }
  for (uint32_t i = 0; i < m->capdelayed; i++)
    free(m->delayed[i].forced);
  for (int s = 0; s < m->vpp; s++)
    free(m->stages[s]);
  free(m->stages);
  free(m->nstage);
  free(m->capstage);
  free(m->stage_count);
  free(m->fwd);
  free(m->bwd);
  free(m->open);
  free(m->delayed);
  free(m->held);
  free(m->plan);
  free(m->groups_cfg);
  free(m->dynamic_cfg);
  ofl_summary_destroy(m->summary);
  /* Last: a close deferred until now (the application's, or ours above)
   * runs here, after the streams and events on the device are gone. */
  ofl_device_t *dev = m->holds_dev ? m->dev : NULL;
  free(m);
  if (dev != NULL)
    ofl__device_pool_destroyed(dev);
}

static pthread_mutex_t instance_mu = PTHREAD_MUTEX_INITIALIZER;
static ofl_manager_t *instance;

ofl_status_t ofl_manager_get(ofl_manager_t **out) {
  if (out == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_get: out must not be NULL");
  ofl_status_t s = OFL_SUCCESS;
  pthread_mutex_lock(&instance_mu);
  if (instance == NULL)
    s = ofl_manager_create(NULL, &instance);
  if (s == OFL_SUCCESS)
    *out = instance;
  pthread_mutex_unlock(&instance_mu);
  return s;
}

void ofl_manager_reset_instance(void) {
  pthread_mutex_lock(&instance_mu);
  ofl_manager_t *m = instance;
  instance = NULL;
  pthread_mutex_unlock(&instance_mu);
  ofl_manager_destroy(m);
}

ofl_device_t *ofl_manager_device(const ofl_manager_t *m) {
  return m ? m->dev : NULL;
}
ofl_stream_t *ofl_manager_d2h_stream(const ofl_manager_t *m) {
  return m ? m->d2h : NULL;
}
ofl_stream_t *ofl_manager_h2d_stream(const ofl_manager_t *m) {
  return m ? m->h2d : NULL;
}
ofl_pool_t *ofl_manager_host_pool(const ofl_manager_t *m) {
  return m ? m->host_pool : NULL;
}
ofl_pool_t *ofl_manager_device_pool(const ofl_manager_t *m) {
  return m ? m->dev_pool : NULL;
}

/* ---- iteration
 * ------------------------------------------------------------------ */

/* Rule 5: a training iteration after warmup runs every recorded chunk. */
static ofl_status_t check_structure(ofl_manager_t *m) {
  if (m->warmup || m->fwd_cursor == 0)
    return OFL_SUCCESS;
  OFL_CHECK(ofl__chunk_check_done(m, m->cur_fwd));
  if (m->fwd_cursor != m->nfwd)
    return OFL__PERR(OFL_ERR_MISMATCH, m, m->cur_fwd, "-",
                     "the iteration ran %u chunks, the warmup recorded %u; "
                     "the schedule must repeat the warmup's structure",
                     m->fwd_cursor, m->nfwd);
  return OFL_SUCCESS;
}

static void end_iteration(ofl_manager_t *m) {
  for (uint32_t i = 0; i < m->ndelayed; i++)
    OFL__PLOG(OFL_LOG_WARN, m, m->delayed[i].g->chunk,
              ofl__gname(m, m->delayed[i].g),
              "delayed commit never flushed before reset; the group stayed "
              "on the device%s",
              "");
  m->ndelayed = 0;
  uint64_t unpopped = m->st.unpopped_tensors;
  for (uint32_t i = 0; i < m->nfwd; i++) {
    chunk_t *c = m->fwd[i];
    for (uint32_t j = 0; j < c->ngroups; j++)
      ofl__group_end_iteration(m, c->groups[j]);
    c->fwd_cursor = c->ncommit = c->bwd_left = c->nstack = 0;
    c->fwd_done = false;
  }
  for (uint32_t i = 0; i < m->nheld; i++) {
    if (m->held[i] != NULL) {
      m->st.unpopped_tensors++;
      ofl_tensor_destroy(m->held[i]);
    }
  }
  m->nheld = 0;
  if (m->st.unpopped_tensors != unpopped && !m->forward_only)
    OFL_INFO(OFL_SUBSYS_PIPELINE,
             "rank %d: reset destroyed %llu tensors pushed and never popped",
             m->rank, (unsigned long long)(m->st.unpopped_tensors - unpopped));
  for (int i = 0; i < m->nnames; i++)
    m->names[i].ring_head = m->names[i].ring_len = 0;
  m->cur_fwd = m->cur_bwd = NULL;
  m->fwd_cursor = m->bwd_cursor = 0;
  m->gen++;
  m->st.iterations++;
  /* An iteration whose pinned admission moved is not one the pools learn
   * to repeat (tier.c). */
  ofl__pool_cycle_end_moved(m->dev_pool, m->pin_moved);
  ofl__pool_cycle_end_moved(m->host_pool, m->pin_moved);
  m->pin_moved = false;
  ofl__tier_end_iteration(m);
}

ofl_status_t ofl_manager_reset(ofl_manager_t *m) {
  if (m == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_reset: manager is NULL");
  if (m->nopen > 0) {
    open_group_t *o = &m->open[m->nopen - 1];
    return OFL__PERR(OFL_ERR_INVALID_USAGE, m, o->g ? o->g->chunk : m->cur_fwd,
                     m->names[o->nid].name,
                     "reset while this group is open (started, not "
                     "committed); commit it before the reset%s",
                     "");
  }
  ofl_status_t s = check_structure(m);
  ofl__stall_harvest(m, false);
  if (!m->warmup)
    ofl__plan_end_iteration(m);
  /* A rank whose offload is switched off records nothing, but ends its
   * warmup where the others do, at the first reset after a training chunk
   * (not forward-only, offload not disabled), with a summary of zero
   * bytes: the gather is collective (every other rank of the comm would
   * wait for it until the timeout), and without a comm is_warmup and
   * summary_bytes still answer. */
  bool end_warmup =
      m->warmup && (m->nfwd > 0 || (!m->offload && m->off_trained));
  end_iteration(m);
  if (end_warmup) {
    ofl_status_t p = ofl__policy_end_warmup(m);
    if (s == OFL_SUCCESS)
      s = p;
  }
  return s;
}

int ofl_manager_is_warmup(const ofl_manager_t *m) { return m ? m->warmup : 0; }

void ofl_manager_set_device_peak(ofl_manager_t *m, size_t bytes) {
  if (m != NULL)
    m->dev_peak_noted = bytes;
}

/* Records event on compute and makes compute wait for copy stream s. In a
 * capture the copy stream's event (recorded outside it) cannot be waited
 * for: the boundary is recorded, and the capture is refused while copies are
 * in flight, since nothing would order them before the graph's work. */
static ofl_status_t record_boundary(ofl_manager_t *m, ofl_event_t *event,
                                    ofl_stream_t *s, ofl_event_t *ev_s,
                                    const char *fn) {
  ofl_stream_t *compute = ofl__compute(m);
  if (ofl__stream_capturing(compute)) {
    ofl_status_t q = ofl_stream_query(s);
    if (q == OFL_ERR_NOT_READY)
      return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_PIPELINE,
                        "rank %d: %s inside a CUDA graph capture while copies "
                        "are in flight on the %s stream; call "
                        "ofl_manager_synchronize before beginning the capture",
                        m->rank, fn, ofl_stream_name(s));
    OFL_CHECK(q);
    return ofl_event_record(event, compute);
  }
  OFL_CHECK(ofl_event_record(event, compute));
  OFL_CHECK(ofl_event_record(ev_s, s));
  return ofl_stream_wait_event(compute, ev_s);
}

ofl_status_t ofl_manager_forward_record(ofl_manager_t *m, ofl_event_t *event) {
  if (m == NULL || event == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_forward_record: manager and event must "
                      "not be NULL");
  return record_boundary(m, event, m->d2h, m->ev_d2h,
                         "ofl_manager_forward_record");
}

ofl_status_t ofl_manager_backward_record(ofl_manager_t *m, ofl_event_t *event) {
  if (m == NULL || event == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_backward_record: manager and event must "
                      "not be NULL");
  return record_boundary(m, event, m->h2d, m->ev_h2d,
                         "ofl_manager_backward_record");
}

/* One line of ofl_manager_config_print: the value in force and where it
 * came from (params, or the variable's environment/default). */
static void print_value(FILE *f, const ofl_manager_t *m, unsigned bit,
                        const char *var, const char *value) {
  ofl__config_print_value(f, var, value,
                          (m->from_params & bit) ? "params"
                                                 : ofl__config_source(var));
}

void ofl_manager_config_print(const ofl_manager_t *m, FILE *f) {
  if (f == NULL)
    f = stdout;
  if (m == NULL) {
    fprintf(f, "ofl manager: none\n");
    return;
  }
  char v[64];
  ofl_pool_stats_t hs;
  ofl_pool_get_stats(m->host_pool, &hs);
  fprintf(f,
          "ofl manager rank %d pp_rank %d, backend %s, the values in force:\n",
          m->rank, m->pp_rank, ofl_backend_name(ofl_device_backend(m->dev)));
  print_value(f, m, OFL__SRC_OFFLOAD, "OFL_OFFLOAD", m->offload ? "1" : "0");
  print_value(f, m, OFL__SRC_GROUPS, "OFL_OFFLOAD_GROUPS",
              m->auto_plan       ? "auto"
              : m->groups_cfg[0] ? m->groups_cfg
                                 : "(all)");
  snprintf(v, sizeof v, "%llu%s", (unsigned long long)m->mem_target,
           m->auto_plan ? "" : " (ignored: groups not auto)");
  print_value(f, m, OFL__SRC_TARGET, "OFL_MEMORY_TARGET", v);
  snprintf(v, sizeof v, "%llu%s", (unsigned long long)m->dev_target,
           m->auto_plan ? "" : " (ignored: groups not auto)");
  print_value(f, m, OFL__SRC_DEV_TARGET, "OFL_DEVICE_MEMORY_TARGET", v);
  snprintf(v, sizeof v, "%llu", (unsigned long long)m->min_elems);
  print_value(f, m, OFL__SRC_MIN_ELEMS, "OFL_MIN_OFFLOAD_ELEMS", v);
  snprintf(v, sizeof v, "%zu", m->min_bytes);
  print_value(f, m, OFL__SRC_MIN_BYTES, "OFL_MIN_OFFLOAD_BYTES", v);
  snprintf(v, sizeof v, "%g", m->fraction);
  print_value(f, m, OFL__SRC_FRACTION, "OFL_OFFLOAD_FRACTION", v);
  snprintf(v, sizeof v, "%llu", (unsigned long long)m->rank_delta_bytes);
  print_value(f, m, OFL__SRC_DELTA, "OFL_RANK_DELTA_BYTES", v);
  snprintf(v, sizeof v, "%u", m->max_inflight);
  print_value(f, m, OFL__SRC_INFLIGHT, "OFL_MAX_INFLIGHT", v);
  snprintf(v, sizeof v, "%u", m->prefetch_groups);
  print_value(f, m, OFL__SRC_PREFETCH, "OFL_PREFETCH_GROUPS", v);
  snprintf(v, sizeof v, "%zu", hs.budget_bytes);
  print_value(f, m, OFL__SRC_HOST_BUDGET, "OFL_HOST_BUDGET", v);
  fprintf(f, "%-26s = %-12s (%s)\n", "dynamic_groups", m->dynamic_cfg,
          "params or built-in");
  fprintf(f, "%-26s = %-12s\n", "comm",
          m->comm != NULL ? ofl_comm_kind_name(ofl_comm_kind(m->comm))
                          : "(this rank only)");
  fprintf(f, "%-26s = %-12s\n", "disk tier", m->disk != NULL ? "yes" : "no");
}

ofl_status_t ofl_manager_synchronize(ofl_manager_t *m, int64_t timeout_ms) {
  if (m == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_synchronize: manager is NULL");
  OFL_CHECK(ofl_stream_synchronize(m->d2h, timeout_ms));
  return ofl_stream_synchronize(m->h2d, timeout_ms);
}

/* ---- statistics
 * ----------------------------------------------------------------- */

void ofl_manager_get_stats(const ofl_manager_t *m, ofl_manager_stats_t *out) {
  if (out == NULL)
    return;
  memset(out, 0, sizeof *out);
  if (m == NULL)
    return;
  ofl__stall_harvest((ofl_manager_t *)m, false);
  *out = m->st;
  ofl_device_stats_t ds;
  ofl_device_get_stats(m->dev, &ds);
  out->device_bytes_peak = ds.device_bytes_peak;
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(m->host_pool, &ps);
  out->host_bytes_peak = ps.peak_in_use_bytes;
  if (!m->warmup) {
    ofl_pool_get_stats(m->dev_pool, &ps);
    out->steady_device_pool_peak_bytes = ps.peak_in_use_bytes;
  }
}

size_t ofl_manager_group_count(const ofl_manager_t *m) {
  return m ? (size_t)m->nnames : 0;
}

ofl_status_t ofl_manager_group_stats(const ofl_manager_t *m, size_t i,
                                     ofl_manager_group_stats_t *out) {
  if (m == NULL || out == NULL || i >= (size_t)m->nnames)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_PIPELINE,
                      "ofl_manager_group_stats: index %zu out of range (%d "
                      "names) or NULL argument",
                      i, m ? m->nnames : 0);
  *out = m->names[i].st;
  out->summary_bytes = m->names[i].summary_bytes;
  return OFL_SUCCESS;
}
