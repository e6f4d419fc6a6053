/* ofl pipeline demo: the offload calls a model makes, in one place. The
 * demo's layers call these; glue.c maps them onto the ofl manager. */
#ifndef OFL_DEMO_GLUE_H
#define OFL_DEMO_GLUE_H

#include <stdint.h>
#include <stdio.h>

#include <ofl/ofl.h>

typedef struct glue glue_t;

typedef struct {
  ofl_device_t *dev;
  ofl_pool_t *act_pool; /* device pool of activations and reload buffers */
  int offload;          /* 0: the manager runs with offload disabled */
  const char *groups;   /* comma-separated group names to offload */
  size_t min_bytes;     /* smallest tensor offloaded */
  int pp_rank, pp_size;
  void *mpi_comm;          /* MPI_Comm * for the summary, NULL: self */
  const char *disk_groups; /* group names on the disk tier; NULL/"": none */
  const char *disk_dir;    /* NULL: OFL_DISK_DIR, TMPDIR or /tmp */
  int64_t memory_target_bytes; /* groups "auto"; <0: OFL_MEMORY_TARGET */
  int64_t device_memory_target_bytes; /* groups "auto"; 0: none; <0:
                                         OFL_DEVICE_MEMORY_TARGET */
  double fraction;             /* <0: OFL_OFFLOAD_FRACTION */
  FILE *summary_out; /* the manager prints its summary and plan here at the
                        end of warmup (rank 0 of the comm); NULL: not */
  int recompute;     /* groups "auto": the plan may recompute */
} glue_params_t;

int glue_open(const glue_params_t *p, glue_t **out);
void glue_close(glue_t *g);

/* Forward of one microbatch on one virtual stage starts. */
int glue_chunk_begin(glue_t *g, int vpp, int vp_stage, int microbatch);
int glue_group_start(glue_t *g, const char *name);
/* A group the demo can rerun from an input of input_bytes it keeps, the
 * output of the group input_group (NULL: none; the plan charges that
 * group's reload to the rerun where it offloads it); reruns: what the
 * rerun is (OFL_RERUN_OWN, OFL_RERUN_INPUT: input_group's forward): *recompute
 * 1 when the plan recomputes it in this iteration (the demo then saves
 * nothing and reruns the forward in its backward). */
int glue_group_start_recomputable(glue_t *g, const char *name,
                                  size_t input_bytes, const char *input_group,
                                  unsigned reruns, int *recompute);
/* Hands a saved activation to the manager; it owns the handle until pop. */
int glue_save(glue_t *g, ofl_tensor_t *t, uint64_t *tag);
int glue_group_commit(glue_t *g, const char *name);
int glue_backward_begin(glue_t *g, const char *name);
/* The saved activation back, with device storage; the caller destroys it. */
int glue_load(glue_t *g, uint64_t tag, ofl_tensor_t **t);
int glue_backward_end(glue_t *g, const char *name);
/* End of an iteration (the schedule's reset). */
int glue_iteration_end(glue_t *g);

/* After warmup: the estimated device bytes saved (summary total), and the
 * summary printed through the comm on rank 0 of it. */
size_t glue_summary_total_bytes(glue_t *g);
void glue_print_summary(glue_t *g, FILE *out);

typedef struct {
  uint64_t offloaded_bytes, reloaded_bytes;
  uint64_t offloaded_tensors, reloaded_tensors;
  uint64_t stalls; /* reloads the compute stream had to wait for */
  double stall_ms;
  uint64_t inline_reloads;
  uint64_t kept_on_device;
  int disk; /* 1 when the disk tier is in use */
  uint64_t disk_written, disk_read;
  double disk_write_gbps, disk_read_gbps;
  uint64_t disk_prefetch_hits, disk_stalls, disk_faults;
  uint64_t disk_keep_hits; /* reloads served by kept buffers, no read */
} glue_stats_t;
void glue_get_stats(glue_t *g, glue_stats_t *out);
/* The auto plan (ofl_manager_plan_get): 0, or OFL_ERR_NOT_READY without one. */
int glue_plan(glue_t *g, ofl_manager_plan_t *out);
/* The auto plan's action per name as it stands, with its predicted and
 * measured cost, and what recomputing it would free and cost ("name=action
 * (pred/meas ms; recompute B MiB T ms), ..."; "" without a plan). */
void glue_plan_actions(glue_t *g, char *buf, size_t n);

#endif
