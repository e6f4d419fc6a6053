/* ofl pipeline demo: the model's offload calls mapped onto the ofl manager
 * (one manager per run; the summary goes through an MPI comm). */
#ifndef OFL_DEMO_NO_MPI
#include <mpi.h>
#endif
#include <stdlib.h>

#include "glue.h"

#include <ofl/comm.h>
#include <ofl/manager.h>
#include <ofl/summary.h>

struct glue {
  ofl_manager_t *m;
  ofl_comm_t *comm;
  ofl_disk_t *disk;
};

int glue_open(const glue_params_t *p, glue_t **out) {
  glue_t *g = calloc(1, sizeof *g);
  if (g == NULL)
    return OFL_ERR_NO_MEMORY;
  ofl_status_t st = OFL_SUCCESS;
#ifndef OFL_DEMO_NO_MPI
  if (p->mpi_comm != NULL)
    st = ofl_comm_create_mpi(*(MPI_Comm *)p->mpi_comm, NULL, &g->comm);
  else
#endif
    st = ofl_comm_create_self(NULL, &g->comm);
  if (st != OFL_SUCCESS) {
    free(g);
    return st;
  }
  if (p->disk_groups != NULL && p->disk_groups[0] != '\0') {
    ofl_disk_params_t dp = OFL_DISK_PARAMS_INIT;
    dp.dev = p->dev;
    dp.groups = p->disk_groups;
    dp.dir = p->disk_dir;
    dp.rank = p->pp_rank;
    st = ofl_disk_open(&dp, &g->disk);
    if (st != OFL_SUCCESS) {
      ofl_comm_destroy(g->comm);
      free(g);
      return st;
    }
  }
  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
  mp.disk = g->disk;
  mp.device = p->dev;
  mp.device_pool = p->act_pool;
  mp.offload = p->offload;
  mp.groups = p->groups;
  mp.min_offload_bytes = (int64_t)p->min_bytes;
  mp.pp_rank = p->pp_rank;
  mp.rank = p->pp_rank;
  mp.comm = g->comm;
  mp.memory_target_bytes = p->memory_target_bytes;
  mp.device_memory_target_bytes = p->device_memory_target_bytes;
  mp.fraction = p->fraction;
  mp.summary_out = p->summary_out;
  st = ofl_manager_create(&mp, &g->m);
  if (st == OFL_SUCCESS && p->recompute) {
    st = ofl_manager_set_plan_recompute(g->m, 1);
    if (st != OFL_SUCCESS)
      ofl_manager_destroy(g->m);
  }
  if (st != OFL_SUCCESS) {
    ofl_disk_close(g->disk);
    ofl_comm_destroy(g->comm);
    free(g);
    return st;
  }
  *out = g;
  return OFL_SUCCESS;
}

void glue_close(glue_t *g) {
  if (g == NULL)
    return;
  ofl_manager_destroy(g->m); /* before the store it writes to */
  ofl_disk_close(g->disk);
  ofl_comm_destroy(g->comm);
  free(g);
}

int glue_chunk_begin(glue_t *g, int vpp, int vp_stage, int microbatch) {
  (void)microbatch; /* chunks follow the order of the calls */
  return ofl_manager_chunk_begin(g->m, vpp, vp_stage);
}

int glue_group_start(glue_t *g, const char *name) {
  return ofl_manager_group_start(g->m, name);
}

int glue_group_start_recomputable(glue_t *g, const char *name,
                                  size_t input_bytes, const char *input_group,
                                  unsigned reruns, int *recompute) {
  ofl_group_action_t a = OFL_ACTION_KEEP;
  ofl_status_t st = ofl_manager_group_start_rerun(g->m, name, input_bytes,
                                                  input_group, reruns);
  if (st == OFL_SUCCESS)
    st = ofl_manager_group_action(g->m, name, &a);
  *recompute = st == OFL_SUCCESS && a == OFL_ACTION_RECOMPUTE;
  return st;
}

int glue_save(glue_t *g, ofl_tensor_t *t, uint64_t *tag) {
  ofl_tag_t tg = OFL_TAG_INVALID;
  ofl_status_t st = ofl_manager_tensor_push(g->m, t, &tg);
  if (st == OFL_SUCCESS)
    *tag = tg;
  return st;
}

int glue_group_commit(glue_t *g, const char *name) {
  return ofl_manager_group_commit(g->m, name, NULL, 0, 0);
}

int glue_backward_begin(glue_t *g, const char *name) {
  return ofl_manager_group_backward_begin(g->m, name);
}

int glue_load(glue_t *g, uint64_t tag, ofl_tensor_t **t) {
  return ofl_manager_tensor_pop(g->m, (ofl_tag_t)tag, t);
}

int glue_backward_end(glue_t *g, const char *name) {
  return ofl_manager_group_backward_end(g->m, name);
}

int glue_iteration_end(glue_t *g) { return ofl_manager_reset(g->m); }

size_t glue_summary_total_bytes(glue_t *g) {
  return (size_t)ofl_manager_summary_total_bytes(g->m);
}

/* Collective over the run's comm: every rank's per-name summary bytes, as
 * the table the manager gathered at the end of warmup. */
void glue_print_summary(glue_t *g, FILE *out) {
  ofl_byte_table_t *t = NULL;
  if (ofl_byte_table_create(&t) != OFL_SUCCESS)
    return;
  size_t n = ofl_manager_group_count(g->m);
  for (size_t i = 0; i < n; i++) {
    ofl_manager_group_stats_t gs;
    if (ofl_manager_group_stats(g->m, i, &gs) == OFL_SUCCESS &&
        gs.summary_bytes > 0)
      ofl_byte_table_add(t, gs.name, gs.summary_bytes);
  }
  ofl_summary_t *s = NULL;
  if (ofl_summary_gather(g->comm, t, 1, &s) == OFL_SUCCESS && s != NULL) {
    fputc('\n', out);
    ofl_summary_write(s, OFL_SUMMARY_TEXT, out);
    fflush(out);
  }
  ofl_summary_destroy(s);
  ofl_byte_table_destroy(t);
}

void glue_get_stats(glue_t *g, glue_stats_t *out) {
  ofl_manager_stats_t s;
  ofl_manager_get_stats(g->m, &s);
  *out = (glue_stats_t){
      .offloaded_bytes = s.offloaded_bytes,
      .reloaded_bytes = s.reloaded_bytes,
      .offloaded_tensors = s.offloaded_tensors,
      .reloaded_tensors = s.reloaded_tensors,
      .stalls = s.stalls,
      .stall_ms = (double)s.stall_ns / 1e6,
      .inline_reloads = s.inline_reloads,
      .kept_on_device = s.kept_tensors,
  };
  if (g->disk != NULL) {
    ofl_disk_stats_t d;
    ofl_disk_get_stats(g->disk, &d);
    out->disk = 1;
    out->disk_written = d.bytes_written;
    out->disk_read = d.bytes_read;
    out->disk_write_gbps = d.write_gbps;
    out->disk_read_gbps = d.read_gbps;
    out->disk_prefetch_hits = d.prefetch_hits;
    out->disk_stalls = d.stalls;
    out->disk_keep_hits = d.keep_hits;
    out->disk_faults =
        d.faults_enospc + d.faults_eio + d.faults_short + d.faults_corrupt;
  }
}

int glue_plan(glue_t *g, ofl_manager_plan_t *out) {
  return ofl_manager_plan_get(g->m, out);
}

void glue_plan_actions(glue_t *g, char *buf, size_t n) {
  static const char *const what[] = {"keep", "offload", "recompute"};
  ofl_manager_plan_t pl;
  size_t used = 0;
  buf[0] = '\0';
  if (ofl_manager_plan_get(g->m, &pl) != OFL_SUCCESS)
    return;
  for (size_t i = 0; i < pl.nnames && used < n; i++) {
    ofl_plan_action_t a;
    if (ofl_manager_plan_action(g->m, i, &a) != OFL_SUCCESS)
      continue;
    int k = snprintf(buf + used, n - used,
                     "%s%s=%s (%.2f/%.2f ms; recompute %.3f MiB %.2f ms)",
                     used ? ", " : "", a.name, what[a.action], a.predicted_ms,
                     a.measured_ms, (double)a.recompute_bytes / 1048576.0,
                     a.recompute_ms);
    if (k < 0)
      break;
    used += (size_t)k;
  }
}
