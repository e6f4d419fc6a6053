/* ofl: the pipeline offload manager. It moves the activations a model saves
 * for backward to pinned host memory during the forward pass of a
 * pipeline-parallel schedule and brings them back, one group ahead, during
 * the backward pass. All copies run on the manager's D2H and H2D streams and
 * overlap with compute; the ordering rules are those of docs/DESIGN.md
 * section 5.
 *
 * How a model uses it (C has no autograd, so the application calls the
 * backward markers itself):
 *
 *   forward of one microbatch on one virtual stage:
 *     ofl_manager_chunk_begin(m, vp_size, vp_stage);
 *     per module call:  group_start("core_attn");
 *                       tensor_push(q) -> tag_q; tensor_push(k) -> tag_k; ...
 *                       group_commit("core_attn", forced, n, 0);
 *   backward of the same microbatch (modules in reverse order):
 *     group_backward_begin("core_attn");
 *     tensor_pop(tag_k) -> k; tensor_pop(tag_q) -> q;     (device storage)
 *     group_backward_end("core_attn");
 *   end of the iteration (the schedule's reset):
 *     ofl_manager_reset(m);
 *
 * The first iteration is the warmup: every eligible tensor is offloaded and
 * the structure (chunks, groups, names, bytes, backward order) is recorded.
 * The reset that ends it applies the steady-state policy; later iterations
 * replay the record and a structure that does not match it is an error
 * (OFL_ERR_MISMATCH naming the group and the chunk). */

/* The table below is kept out of the formatter's reach. */
/* clang-format off */
/* Names against the reference (Megatron-Core fine-grained activation
 * offloading, megatron/core/pipeline_parallel/fine_grained_activation_offload.py):
 *
 *   ofl                                  reference
 *   ------------------------------------ -------------------------------------
 *   ofl_manager_t                        PipelineOffloadManager
 *   ofl_manager_get                      PipelineOffloadManager.get_instance
 *   ofl_manager_reset_instance           PipelineOffloadManager.reset_instance
 *   ofl_manager_chunk_begin              init_model_chunk_offload_handler
 *                                        (+ pop_forward_chunk after warmup)
 *   ofl_manager_group_start              fine_grained_offloading_group_start /
 *                                        GroupStart.forward
 *   ofl_manager_tensor_push              on_save_for_backward -> tensor_push
 *   ofl_manager_group_commit             fine_grained_offloading_group_commit /
 *                                        GroupCommit.forward -> bulk_offload
 *   ofl_manager_flush_delayed_groups     flush_delayed_groups
 *   ofl_manager_group_backward_begin     GroupCommit.backward ->
 *                                        on_group_commit_backward
 *   ofl_manager_tensor_pop               on_get_saved_tensor -> tensor_pop
 *   ofl_manager_group_backward_end       GroupStart.backward ->
 *                                        on_group_start_backward (bulk_reload)
 *   ofl_manager_reset                    reset (+ post_warmup_callback)
 *   ofl_manager_mark_not_offloadable     mark_not_offloadable /
 *                                        mark_not_offload
 *   ofl_manager_disable_offload/enable   disable_offload / enable_offload
 *   ofl_manager_set_forward_only         (none: NeMo RL suspends offloading)
 *   ofl_manager_forward_record           forward_record
 *   ofl_manager_backward_record          backward_record
 *   ofl_manager_summary_bytes/_total     offload_summary_bytes / _total_bytes
 *   ofl_tag_t                            tag (group_idx, k)
 *   params.min_offload_elems             min_offloaded_tensor_size
 *   params.fraction                      activation_offload_fraction
 *   params.rank_delta_bytes              delta_offload_bytes_across_pp_ranks
 *   params.max_inflight                  max_inflight_offloads (0 here means
 *                                        unlimited, not "join every commit") */
/* clang-format on */

/* Where ofl differs on purpose (docs/DESIGN.md section 5 rules): an inline
 * reload waits for its group's offload (rule 1); pinned and device buffers are
 * reused only after the copies that read them (rule 2); the compute stream
 * is looked up at every use (rule 3); a forward-only pass neither consumes
 * the warmup nor creates chunks (rule 4); a structure mismatch is an error
 * (rule 5); the same storage pushed twice in a group is copied once
 * (rule 6); the summary is gathered on the user's comm (rule 7).
 *
 * Threads: one manager is driven by one thread at a time (the training
 * loop); the copy streams run on their own. */
#ifndef OFL_MANAGER_H
#define OFL_MANAGER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <ofl/comm.h>
#include <ofl/device.h>
#include <ofl/disk.h>
#include <ofl/export.h>
#include <ofl/pool.h>
#include <ofl/status.h>
#include <ofl/summary.h>
#include <ofl/tensor.h>

OFL_EXTERN_C_BEGIN

typedef struct ofl_manager ofl_manager_t;

/* The handle of a pushed tensor between push and pop; single use. 0 is never
 * a valid tag. A tag names the manager that made it: popped on another
 * manager it is OFL_ERR_INVALID_ARG (ids are reused only after 255 more
 * managers were created). */
typedef uint64_t ofl_tag_t;
#define OFL_TAG_INVALID UINT64_C(0) /* an ofl_tag_t; no cast, for C++ */

/* Parameters of ofl_manager_create. Fields left at their *_INIT value are
 * read from the OFL_* environment (see ofl_config_print). */
typedef struct ofl_manager_params {
  ofl_device_t *device;       /* NULL: opened from the environment (owned) */
  ofl_pool_t *device_pool;    /* reload buffers; NULL: the manager's own,
                                 which outlives the manager while popped
                                 tensors still use its blocks */
  int offload;                /* master switch; <0: OFL_OFFLOAD */
  const char *groups;         /* comma-separated names offloaded; NULL:
                                 OFL_OFFLOAD_GROUPS; "": every name */
  int64_t min_offload_elems;  /* smallest tensor offloaded, in elements;
                                 <0: OFL_MIN_OFFLOAD_ELEMS */
  int64_t min_offload_bytes;  /* in bytes, wins over elems when > 0;
                                 <0: OFL_MIN_OFFLOAD_BYTES */
  double fraction;            /* of groups of each chunk kept offloaded after
                                 warmup, in [0, 1]; <0: OFL_OFFLOAD_FRACTION.
                                 Per chunk, all names together: of the groups
                                 of a chunk still offloaded after the
                                 first-backward and rank-delta rules (and
                                 that offloaded bytes in the warmup), the
                                 floor((1 - fraction) x count) started last
                                 in its forward stay on the device; names do
                                 not get a share each */
  int64_t rank_delta_bytes;   /* bytes kept on the device per pipeline rank
                                 (pp_rank x delta; groups are kept in
                                 backward order while any of it is left, so
                                 the last may go past it, as in the
                                 reference); <0: OFL_RANK_DELTA_BYTES */
  int max_inflight;           /* offloads in flight per group name before
                                 compute waits; 0 unlimited; <0: env */
  int64_t host_budget_bytes;  /* pinned pool budget; 0 unlimited; <0: env */
  int pp_rank;                /* pipeline rank of this process */
  int rank;                   /* rank written in log lines; <0: the log rank */
  ofl_comm_t *comm;           /* summary gather at the end of warmup (every
                                 rank of it resets; a rank with offload off
                                 joins at its first reset with an empty
                                 row); NULL: this rank only */
  const char *dynamic_groups; /* names whose shapes change per microbatch
                                 (byte-keyed pool blocks); NULL:
                                 "expert_fc1,moe_act,fused_group_mlp" */
  FILE *summary_out;          /* where rank 0 of comm prints the summary
                                 table (text); NULL: not printed */
  ofl_disk_t *disk;           /* the disk tier (not owned): groups it selects
                                 (ofl_disk_group_selected) go to disk, and clusters the
                                 host budget refuses fall to it; NULL: none */
  int prefetch_groups;        /* reloads issued this many groups ahead of
                                 the backward pass (each holds its device
                                 buffers until its backward); <=0:
                                 OFL_PREFETCH_GROUPS. With groups "auto" the
                                 start of each group's learned lead */
  int64_t memory_target_bytes; /* groups "auto": the activation bytes this
                                 rank may keep on the device at its peak
                                 (what the plan aims at; 0: no target, the
                                 plan offloads nothing it need not); <0:
                                 OFL_MEMORY_TARGET. Ignored without auto */
  int64_t device_memory_target_bytes; /* groups "auto": the device memory
                                 this rank's step may use at its peak,
                                 weights, gradients, optimizer state and
                                 workspace included. The warmup (every group
                                 offloaded) measures what is not activations:
                                 its device peak (ofl_manager_set_device_peak,
                                 else the device's stats) less the
                                 activation pool's peak in use (device_pool,
                                 else the manager's reload pool); the plan
                                 aims the activations at the rest; a target at or
                                 below the non-activation bytes makes the
                                 reset that ends the warmup fail (both
                                 figures in the error). With
                                 memory_target_bytes too, the tighter of the
                                 two wins. 0: none; <0:
                                 OFL_DEVICE_MEMORY_TARGET */
} ofl_manager_params_t;

#define OFL_MANAGER_PARAMS_INIT                                                \
  {                                                                            \
    NULL, NULL, -1, NULL, -1, -1, -1.0, -1, -1, -1, 0, -1, NULL, NULL, NULL,   \
        NULL, 0, -1, -1                                                        \
  }

/* Counters since creation (per group name: ofl_manager_group_stats). */
typedef struct ofl_manager_stats {
  uint64_t iterations;        /* resets */
  uint64_t offloaded_tensors; /* D2H copies made (one per storage) */
  uint64_t offloaded_bytes;
  uint64_t reloaded_tensors; /* H2D copies made */
  uint64_t reloaded_bytes;
  uint64_t inline_reloads;      /* tensors reloaded inside tensor_pop */
  uint64_t stalls;              /* reloads compute had to wait for (cuda:
                                   measured on the GPU by timing events around
                                   the wait, counted when compute was held
                                   over 10 us; read at reset and by get_stats;
                                   host: backward_begin found it unfinished) */
  uint64_t stall_ns;            /* time compute waited for them (host backend:
                                   measured; cuda: not measured, 0) */
  uint64_t kept_groups;         /* groups the policy kept on the device */
  uint64_t kept_tensors;        /* tensors kept on the device at commit, for
                                   any reason: policy, size, flag, location,
                                   and the budget_kept_tensors below too */
  uint64_t budget_kept_tensors; /* kept because the host budget was full
                                   (and the disk tier, if any, refused);
                                   also counted in kept_tensors */
  uint64_t budget_kept_bytes;
  uint64_t disk_tensors; /* offloads that went to the disk tier */
  uint64_t disk_bytes;
  uint64_t dedup_tensors;    /* pushes sharing a storage already copied */
  uint64_t unpopped_tensors; /* pushed but never popped before reset */
  size_t device_bytes_peak;  /* of the manager's device */
  size_t host_bytes_peak;    /* pinned pool peak in use */
  size_t steady_device_pool_peak_bytes; /* peak_in_use_bytes of the device
                                  pool (params.device_pool, else the
                                  manager's reload pool) since the end of
                                  the warmup: the manager calls
                                  ofl_pool_reset_peak on it then. With the
                                  activations in that pool, the steady-state
                                  peak to compare against a run without
                                  offload. 0 during the warmup */
} ofl_manager_stats_t;

/* Counters of one group name. */
/* No struct tag: it would be hidden by the function of the same name
 * (C++ -Wshadow). */
typedef struct {
  const char *name;
  uint64_t offloaded_tensors;
  uint64_t offloaded_bytes;
  uint64_t reloaded_tensors;
  uint64_t reloaded_bytes;
  uint64_t inline_reloads;
  uint64_t stalls;
  uint64_t stall_ns;
  uint64_t kept_groups;
  uint64_t budget_kept_bytes;
  uint64_t summary_bytes; /* offload_summary_bytes of this name (0 before the
                             end of warmup) */
} ofl_manager_group_stats_t;

/* ---- lifecycle ------------------------------------------------------------
 */

/* An independent manager. params NULL: everything from the environment. */
OFL_API ofl_status_t ofl_manager_create(const ofl_manager_params_t *params,
                                        ofl_manager_t **out);
/* Drains the copy streams (bounded), releases every buffer, the streams and
 * the device if the manager opened it. Tensors never popped are destroyed.
 * Popped tensors stay valid: they are the caller's, and the manager's own
 * reload pool (params.device_pool NULL) is destroyed only when the last of
 * them is destroyed; so is the device when the manager opened it. With a
 * caller's device, keep it open until then. NULL is accepted. */
OFL_API void ofl_manager_destroy(ofl_manager_t *m);

/* The process-wide manager, created from the environment on first use. */
OFL_API ofl_status_t ofl_manager_get(ofl_manager_t **out);
/* Destroys the process-wide manager; the next ofl_manager_get makes a new
 * one (tests). */
OFL_API void ofl_manager_reset_instance(void);

OFL_API ofl_device_t *ofl_manager_device(const ofl_manager_t *m);
OFL_API ofl_stream_t *ofl_manager_d2h_stream(const ofl_manager_t *m);
OFL_API ofl_stream_t *ofl_manager_h2d_stream(const ofl_manager_t *m);
OFL_API ofl_pool_t *ofl_manager_host_pool(const ofl_manager_t *m);
OFL_API ofl_pool_t *ofl_manager_device_pool(const ofl_manager_t *m);

/* ---- forward
 * ----------------------------------------------------------------- */

/* The forward of one microbatch on virtual stage vp_stage (0 .. vp_size-1)
 * begins. During warmup it records a chunk and its place in the backward
 * order; afterwards it moves to the next recorded chunk and checks that the
 * stage matches (OFL_ERR_MISMATCH otherwise). */
OFL_API ofl_status_t ofl_manager_chunk_begin(ofl_manager_t *m, int vp_size,
                                             int vp_stage);
/* A module call named name begins; tensors pushed until its commit belong to
 * it (the most recently started open group receives pushes). Names outside
 * params.groups are not offloaded, but still pair with their commit. */
OFL_API ofl_status_t ofl_manager_group_start(ofl_manager_t *m,
                                             const char *name);
/* ---- recompute: the third action of the auto plan ----------------------
 *
 * A group the application can rerun (activation checkpointing) is started
 * with OFL_GROUP_RECOMPUTABLE and the bytes of the input it would keep to
 * rerun it. With groups "auto" and OFL_PLAN_RECOMPUTE=1 (or
 * ofl_manager_set_plan_recompute) the plan chooses per name keep, offload
 * or recompute (a name is recomputable when every group of it in the
 * warmup was started recomputable). The warmup offloads every group and
 * measures each group's forward time (its commit less its start, on the
 * compute stream): the time a recompute costs again in its backward; a
 * recompute frees the group's bytes less the kept input. In each steady
 * iteration the application asks, right after the group's start, what the
 * plan chose (ofl_manager_group_action): for OFL_ACTION_RECOMPUTE it pushes
 * nothing, keeps the input itself, and reruns the forward from it in the
 * group's backward (between group_backward_begin and _end, as usual); ofl
 * counts the input from the commit and the group's bytes again from its
 * backward's begin. Offload-only is the default. */
#define OFL_GROUP_RECOMPUTABLE 1u

typedef enum ofl_group_action {
  OFL_ACTION_KEEP = 0,    /* push as usual; the plan keeps it on the device */
  OFL_ACTION_OFFLOAD = 1, /* push as usual; offloaded (the warmup: every
                             group) */
  OFL_ACTION_RECOMPUTE = 2 /* push nothing; rerun the forward in backward */
} ofl_group_action_t;

/* ofl_manager_group_start with flags (OFL_GROUP_RECOMPUTABLE, or 0) and
 * the device bytes of the input the application keeps when it recomputes
 * the group (ignored without the flag). */
OFL_API ofl_status_t ofl_manager_group_start_flags(ofl_manager_t *m,
                                                   const char *name,
                                                   unsigned flags,
                                                   size_t kept_input_bytes);
/* ofl_manager_group_start_flags(m, name, OFL_GROUP_RECOMPUTABLE,
 * kept_input_bytes), and the name of the group that produced that input
 * (input_group: NULL or "" for none): where the input is a tensor of
 * another group (pushed and committed in it), the most recent group of
 * input_group started before this one in the same chunk. Where the plan
 * offloads that group and recomputes this one, the rerun needs the input
 * back before this group's backward: the plan charges the part of its
 * reload that this group's backward window does not hide to the
 * recompute's cost, and counts its bytes as back on the device from this
 * group's backward (not its own). A name that is not offloaded, or has no
 * group before this one in the chunk, links nothing. Read in the warmup;
 * steady iterations may pass it again or not. */
OFL_API ofl_status_t ofl_manager_group_start_recompute(ofl_manager_t *m,
                                                       const char *name,
                                                       size_t kept_input_bytes,
                                                       const char *input_group);
/* What a recompute reruns (ofl_manager_group_start_rerun), a mask:
 * OFL_RERUN_OWN, the group's own forward (its commit less its start); and
 * OFL_RERUN_INPUT, input_group's forward: the group saved that group's
 * output and a recompute makes it again from what input_group keeps (a
 * linear's saved input, the norm before it: Megatron's "layernorm"
 * recompute). The plan's first estimate of the recompute is the sum of the
 * forward times the mask names, measured in the warmup (input_group's
 * where it was started with ofl_manager_group_start_flags, _recompute or
 * _rerun, any flags: else that part is 0 until the reruns measure it);
 * the reruns' measured times correct it as for any recompute. A forward
 * that two recomputed groups name (one's input group that is itself
 * recomputed with OFL_RERUN_OWN, or the input group of two) is counted
 * once, to the first of their backwards: the application runs it there
 * once and holds what it made for the later backward (the demo's attention
 * for attn_proj and core_attn). */
#define OFL_RERUN_OWN 1u
#define OFL_RERUN_INPUT 2u
/* ofl_manager_group_start_recompute(m, name, kept_input_bytes,
 * input_group) with the rerun's cost named by reruns (a non-zero mask of
 * OFL_RERUN_OWN and OFL_RERUN_INPUT; OFL_RERUN_INPUT needs an
 * input_group). ofl_manager_group_start_recompute is reruns
 * OFL_RERUN_OWN. */
OFL_API ofl_status_t ofl_manager_group_start_rerun(ofl_manager_t *m,
                                                   const char *name,
                                                   size_t kept_input_bytes,
                                                   const char *input_group,
                                                   unsigned reruns);
/* The plan's action for the open group name (the most recent start of it
 * not yet committed): OFL_ACTION_OFFLOAD in the warmup, OFL_ACTION_RECOMPUTE
 * only for a recomputable group the steady plan recomputes, else KEEP or
 * OFFLOAD as the policy placed it (a name not offloaded: KEEP).
 * OFL_ERR_INVALID_USAGE when no group of that name is open. With offload
 * disabled: OFL_ACTION_KEEP. */
OFL_API ofl_status_t ofl_manager_group_action(const ofl_manager_t *m,
                                              const char *name,
                                              ofl_group_action_t *action);
/* Lets the auto plan recompute (on != 0) or not, wins over
 * OFL_PLAN_RECOMPUTE; before the reset that ends the warmup
 * (OFL_ERR_INVALID_USAGE after it). */
OFL_API ofl_status_t ofl_manager_set_plan_recompute(ofl_manager_t *m, int on);

/* Hands t to the manager until ofl_manager_tensor_pop returns it; *tag names
 * it. Outside a group, with offload disabled or in forward-only mode the
 * tensor is only held (never copied). Inside a group, a tensor located
 * OFL_LOC_DEVICE must be memory of the manager's device: a tensor of another
 * device, or host memory wrapped as device memory, is OFL_ERR_INVALID_ARG
 * here (pinned tensors are accepted and stay where they are). */
OFL_API ofl_status_t ofl_manager_tensor_push(ofl_manager_t *m, ofl_tensor_t *t,
                                             ofl_tag_t *tag);
/* Ends the open group name: its eligible tensors (size threshold, not marked
 * not-offloadable, each storage once) are copied to pinned memory on the D2H
 * stream after the compute stream's work so far, and their device storage is
 * released after that copy. forced_release (n tensors the caller still
 * holds, e.g. the module input) lose their device storage after the copy too
 * when their storage was offloaded with the group. delay != 0 queues the
 * commit until ofl_manager_flush_delayed_groups: the manager keeps the
 * forced_release pointers (not the tensors), so those handles must stay
 * alive, not destroyed, until the flush (or the reset that drops the delayed
 * commit). */
OFL_API ofl_status_t ofl_manager_group_commit(
    ofl_manager_t *m, const char *name, ofl_tensor_t *const *forced_release,
    size_t n, int delay);
/* group_start(name), a push of nbytes at data and the group's commit in one
 * call: a group of its own for one tensor (torch's per-tensor offload), with
 * no state between the calls that an interrupt of the caller could leave
 * behind. copy != 0 (host backend only): the bytes are copied into a block
 * of the manager's device pool, so data may be reused at once; copy 0: data
 * (the manager's device memory) is wrapped and must stay valid until the
 * D2H copy completes. *tag pops it; *pushed is the handle the manager owns
 * until that pop (ofl_tensor_has_storage tells whether it was offloaded).
 * The group is committed even when the push fails. */
OFL_API ofl_status_t ofl_manager_group_push_bytes(ofl_manager_t *m,
                                                  const char *name, void *data,
                                                  size_t nbytes, int copy,
                                                  ofl_tag_t *tag,
                                                  ofl_tensor_t **pushed);
/* Commits every group still open, innermost first, with no forced releases:
 * what a step abandoned between a group_start and its commit (an exception,
 * an interrupt) leaves behind, so that the reset after it can run.
 * *ncommitted (may be NULL): how many were open. */
OFL_API ofl_status_t ofl_manager_commit_open_groups(ofl_manager_t *m,
                                                   size_t *ncommitted);
/* Runs the delayed commits in the order they were made. */
OFL_API ofl_status_t ofl_manager_flush_delayed_groups(ofl_manager_t *m);

/* ---- backward
 * ---------------------------------------------------------------- */

/* The backward of group name begins: selects the chunk that runs backward
 * (the recorded backward order) and makes the compute stream wait for the
 * group's reload. Groups run backward in the reverse order of their
 * commits. */
OFL_API ofl_status_t ofl_manager_group_backward_begin(ofl_manager_t *m,
                                                      const char *name);
/* The tensor pushed under tag, with device storage (reloaded inline, after
 * the group's offload, when it was not prefetched). The caller owns it
 * again. A tag pops once.
 *
 * An offloaded tensor's new storage is a block of the manager's device pool
 * (params.device_pool, else the manager's own): end the tensor with
 * ofl_tensor_destroy (ofl_pool_free on the pool it was allocated from
 * refuses it: the block is not that pool's). When that pool has no memory
 * for the reload, the call returns OFL_ERR_NO_MEMORY and changes nothing:
 * the tensor stays offloaded and the same tag pops again, once device
 * memory was released (e.g. by destroying tensors popped earlier). A tag
 * of another manager, 0, or of an earlier iteration is
 * OFL_ERR_INVALID_ARG. */
OFL_API ofl_status_t ofl_manager_tensor_pop(ofl_manager_t *m, ofl_tag_t tag,
                                            ofl_tensor_t **out);
/* The backward of group name ends: the H2D stream waits for compute and
 * prefetches the next group to run backward (the next chunk's last group
 * when this chunk has none left). A prefetch only gets ahead: when the
 * device pool has no memory for its buffers, the call still succeeds and
 * those tensors reload inline at their tensor_pop. */
OFL_API ofl_status_t ofl_manager_group_backward_end(ofl_manager_t *m,
                                                    const char *name);

/* ---- iteration ------------------------------------------------------------
 */

/* End of an iteration (call it after every schedule call, training or not).
 * The first reset that saw chunks ends the warmup: the steady-state policy
 * runs and the summary is gathered on params.comm (collective over it).
 * With offload off, the first reset after a training chunk ends it (a
 * summary of zero bytes), with or without a comm. At the end of the warmup
 * a name of params.groups that no group_start used is a WARN naming it, and
 * the tensors kept for their size are counted at INFO.
 * Tensors never popped are destroyed (counted). OFL_ERR_INVALID_USAGE, with
 * nothing changed, while a group is open; OFL_ERR_MISMATCH (after resetting)
 * when fewer chunks ran than recorded. */
OFL_API ofl_status_t ofl_manager_reset(ofl_manager_t *m);
/* 1 until the end of the warmup. */
OFL_API int ofl_manager_is_warmup(const ofl_manager_t *m);
/* For params.device_memory_target_bytes: the device memory the application
 * measured at the warmup's peak with its own allocator (all of it:
 * weights, gradients, optimizer state, workspace, activations, the
 * activation pool's blocks; e.g. torch.cuda.max_memory_allocated), used by
 * the reset that ends the warmup in place of the device's stats (which
 * count only what was allocated through ofl: ofl_device_malloc, pools over
 * the device). A program whose activation pool takes its blocks from its
 * own allocator notes it. Call it before that reset; 0 goes back to the
 * device's stats. */
OFL_API void ofl_manager_set_device_peak(ofl_manager_t *m, size_t bytes);

/* ---- switches -------------------------------------------------------------
 */

/* The tensor (and every handle made from it later) is never offloaded. */
OFL_API void ofl_manager_mark_not_offloadable(ofl_tensor_t *t);
/* With offload disabled, chunks, groups and backward markers do nothing and
 * pushed tensors are only held (CUDA-graph warmup passes). */
OFL_API void ofl_manager_disable_offload(ofl_manager_t *m);
OFL_API void ofl_manager_enable_offload(ofl_manager_t *m);
/* Forward-only passes (evaluation, log-probs): like disabled, and the reset
 * that ends such a pass neither ends the warmup nor checks the structure
 * (rule 4). Turn it on before the pass and off before the next training
 * iteration. */
OFL_API void ofl_manager_set_forward_only(ofl_manager_t *m, int on);

/* Graph-capture boundaries: forward_record records event on the compute
 * stream and makes compute wait for the D2H stream; backward_record records
 * event on the compute stream and makes compute wait for the H2D stream. */
OFL_API ofl_status_t ofl_manager_forward_record(ofl_manager_t *m,
                                                ofl_event_t *event);
OFL_API ofl_status_t ofl_manager_backward_record(ofl_manager_t *m,
                                                 ofl_event_t *event);

/* Prints the configuration the manager actually uses, one line per value:
 * the value in force and where it came from ("params" when the application
 * set the field, else "environment" or "default"). f NULL: stdout. */
OFL_API void ofl_manager_config_print(const ofl_manager_t *m, FILE *f);

/* Waits (bounded) until both copy streams are idle. */
OFL_API ofl_status_t ofl_manager_synchronize(ofl_manager_t *m,
                                             int64_t timeout_ms);

/* ---- summary and statistics -----------------------------------------------
 */

/* offload_summary_bytes of name: bytes offloaded (steady-state policy) by
 * the groups of that name in the chunks whose forward began before the first
 * backward of the warmup iteration (the chunks in flight at the first
 * backward). It is an upper bound of the device bytes removed from the
 * memory peak, not a measurement: with prefetching, reloads of earlier
 * layers land while later layers' backward temporaries are alive, so the
 * measured reduction can be below it. Compare with the program's measured
 * peak (ofl_manager_stats_t.steady_device_pool_peak_bytes, or the
 * application's own allocator). (The reference stops after the first chunk
 * in backward order, which undercounts on every pipeline stage but the
 * last.) OFL_ERR_NOT_READY before the end of warmup; 0 bytes for a name
 * never offloaded. */
OFL_API ofl_status_t ofl_manager_summary_bytes(const ofl_manager_t *m,
                                               const char *name, uint64_t *out);
/* Sum over names (0 before the end of warmup). */
OFL_API uint64_t ofl_manager_summary_total_bytes(const ofl_manager_t *m);
/* The summary gathered at the end of warmup over params.comm (one row per
 * rank of it, a rank that offloaded nothing included), or of this rank alone
 * without a comm. NULL before the end of warmup or when the gather failed.
 * Owned by the manager. */
OFL_API const ofl_summary_t *ofl_manager_summary(const ofl_manager_t *m);

OFL_API void ofl_manager_get_stats(const ofl_manager_t *m,
                                   ofl_manager_stats_t *out);

/* ---- the steady-state plan --------------------------------------------------
 */

/* Where the steady state puts a group of the warmup record. */
typedef enum ofl_group_placement {
  OFL_GROUP_PINNED = 0, /* offloaded to pinned host memory */
  OFL_GROUP_DISK,       /* offloaded to the disk tier (params.disk) */
  OFL_GROUP_DEVICE      /* kept on the device: see the reason */
} ofl_group_placement_t;

/* Why a group stays on the device. */
typedef enum ofl_group_keep_reason {
  OFL_KEEP_NONE = 0,        /* offloaded */
  OFL_KEEP_FIRST_BACKWARD,  /* the first group of its name to run backward
                               (nothing is prefetched for it) */
  OFL_KEEP_NEXT_BACKWARD,   /* the last of its name in a chunk that is the
                               next to run backward when it commits (the
                               reference's should_bulk_offload) */
  OFL_KEEP_FRACTION,        /* params.fraction */
  OFL_KEEP_RANK_DELTA,      /* params.rank_delta_bytes x pp_rank */
  OFL_KEEP_SIZE,            /* no tensor big enough (min_offload_bytes /
                               _elems), or no tensor pushed */
  OFL_KEEP_NOT_OFFLOADABLE, /* every tensor marked not-offloadable or not
                               in device memory */
  OFL_KEEP_HOST_BUDGET,     /* the warmup found no pinned (nor disk) room for
                               any of its tensors */
  OFL_KEEP_NOT_SELECTED,    /* its name is not in params.groups */
  OFL_KEEP_AUTO_PLAN        /* groups "auto": the plan keeps it (the target
                               is met without its offload, or its copies
                               would cost more exposed time) */
} ofl_group_keep_reason_t;

typedef struct ofl_group_plan {
  size_t chunk;     /* the chunk, in forward order of the record */
  int vp_stage;     /* of the chunk */
  int microbatch;   /* the chunk's microbatch in its stage (creation order) */
  const char *name; /* the group's name (owned by the manager) */
  ofl_group_placement_t placement;
  ofl_group_keep_reason_t reason; /* OFL_KEEP_NONE unless kept */
  uint64_t bytes;                 /* bytes the warmup offloaded from it */
  uint64_t disk_bytes;            /* of them, to the disk tier */
} ofl_group_plan_t;

/* The groups of the warmup record, every group_start of the warmup (names
 * not offloaded included) in forward order; 0 before the end of warmup. */
OFL_API size_t ofl_manager_group_plan_count(const ofl_manager_t *m);
/* Where group i of the record goes in steady state and, when it stays on
 * the device, why (the policy decided at the end of warmup, the rest as
 * the warmup saw it: a budget left free by the policy's kept groups may
 * take a group the warmup could not). OFL_ERR_NOT_READY before the end of
 * warmup, OFL_ERR_INVALID_ARG for i >= ofl_manager_group_plan_count. */
OFL_API ofl_status_t ofl_manager_group_plan(const ofl_manager_t *m, size_t i,
                                            ofl_group_plan_t *out);
/* ---- the auto plan (groups "auto") -----------------------------------------
 *
 * With params.groups (or OFL_OFFLOAD_GROUPS) "auto" the warmup offloads
 * every group and measures, per group, its bytes, its copy times and the
 * compute its copies can hide behind (forward: from its commit to the next
 * commit; backward: from the reload's issue to its backward); at the end of
 * the warmup a solver (docs/DESIGN.md section 5.4) picks the groups whose
 * offload brings the predicted activation peak within memory_target_bytes
 * with the least predicted exposed copy time. Later iterations measure the
 * peak and the reload stalls against the prediction, and each group's
 * prefetch lead learns from its stalls. */

/* One group name of the plan. */
typedef struct ofl_plan_name {
  const char *name;         /* owned by the manager */
  uint32_t groups;          /* groups of the name in one iteration */
  uint32_t chosen;          /* of them, offloaded by the plan */
  uint64_t bytes;           /* offloadable bytes of all its groups */
  uint64_t chosen_bytes;    /* of them, offloaded */
  double copy_ms;           /* D2H + H2D time of all its groups' bytes */
  double window_ms;         /* forward + backward windows of its groups */
  double exposed_ms;        /* predicted exposed copy time of the chosen:
                               their D2H copies past their windows and the
                               backward's waits for their reloads (queued on
                               the H2D stream: a wait is charged to the group
                               that waits); the names' sum is the plan's */
  uint32_t prefetch_lead_max; /* largest learned lead of its groups */
} ofl_plan_name_t;

typedef struct ofl_manager_plan {
  int automatic;                 /* 1: groups "auto" made this plan */
  int met;                       /* predicted peak <= target */
  int exact;                     /* the solver's search was exact */
  uint64_t target_bytes;         /* 0: none */
  uint64_t predicted_peak_bytes; /* with the chosen groups */
  uint64_t peak_all_bytes;       /* offloading everything it may */
  uint64_t peak_none_bytes;      /* offloading nothing */
  uint64_t shortfall_bytes;      /* predicted peak - target when not met */
  double predicted_exposed_ms;   /* per iteration: D2H copy time past its
                                    forward window, and the waits of the
                                    backward for reloads queued on the H2D
                                    stream behind each other (a three-way
                                    plan, OFL_PLAN_RECOMPUTE: the waits
                                    alone, the step time it adds; a D2H
                                    copy past its window delays no compute
                                    by itself) */
  double predicted_stall_ms;     /* the second part alone: the backward's
                                    waits for reloads, what a run measures
                                    as measured_stall_ms */
  double d2h_gbps, h2d_gbps;     /* link rates the plan used */
  const char *rate_source;       /* "measured" (the warmup's copies),
                                    "link model" (OFL_LINK_*_GBPS),
                                    "memcpy" (the backend timed its own
                                    copies: host memcpy, cuda a pinned<->
                                    device cudaMemcpyAsync), "default"
                                    (10 GB/s: none of these) */
  double warmup_stall_ms;        /* the warmup's reload waits (it offloads
                                    every group), taken out of the timeline
                                    the plan models */
  double release_ms;             /* host backend: the longest a copy of the
                                    warmup was seen unfinished; every
                                    offloaded group's bytes are taken to stay
                                    that long (0 with timing events) */
  /* The last finished iteration, measured. */
  uint64_t iterations;           /* steady iterations measured */
  uint64_t measured_peak_bytes;  /* activation bytes on the device, peak */
  uint64_t measured_peak_max_bytes; /* over every steady iteration */
  double measured_stall_ms;      /* reload stalls of the iteration */
  uint64_t lead_changes;         /* prefetch leads moved, all iterations */
  uint64_t settled_iterations;   /* steady iterations since the plan last
                                    changed (a replan or a lead moved) */
  uint64_t measured_peak_settled_bytes; /* the largest measured peak of
                                    those: the figure to hold against the
                                    target once the feedback settled */
  uint64_t replans;              /* solves after the warmup's: a measured
                                    peak over the target makes the plan
                                    solve again for a target lowered by the
                                    overshoot (at most 8) */
  size_t nnames;
  const ofl_plan_name_t *names;  /* owned by the manager; valid until the
                                    next reset or destroy */
} ofl_manager_plan_t;

/* One group name's action in the plan (ofl_manager_plan_action), beside
 * ofl_plan_name_t: what it chose, the bytes, the predicted cost and the
 * measured one. */
typedef struct ofl_plan_action {
  const char *name;           /* owned by the manager */
  ofl_group_action_t action;  /* RECOMPUTE when its groups are recomputed,
                                 OFFLOAD when any is offloaded, else KEEP */
  int recomputable;           /* every group of it started recomputable */
  uint32_t groups, offloaded, recomputed;
  uint64_t bytes;             /* its groups' bytes (offloadable and kept) */
  uint64_t recompute_bytes;   /* what recomputing all of them frees */
  double recompute_ms;        /* predicted: their forward time, per
                                 iteration (the warmup's, corrected by
                                 each steady iteration's measured rerun
                                 of the groups recomputed: an exponential
                                 average), and for a recomputed group whose
                                 input's group is offloaded
                                 (ofl_manager_group_start_recompute) the
                                 wait for that reload */
  double predicted_ms;        /* the cost of its action: exposed copy time
                                 (offload) or recompute_ms (recompute) */
  double measured_ms;         /* the last steady iteration: recompute: its
                                 recomputed groups' backward time less the
                                 warmup's backward of the same groups (CPU
                                 clock); offload: the reload stalls of its
                                 groups; 0 for keep */
} ofl_plan_action_t;

/* Name i (0 .. out.nnames - 1 of ofl_manager_plan_get) of the plan.
 * OFL_ERR_NOT_READY before the end of the warmup or without groups "auto",
 * OFL_ERR_INVALID_ARG past the names. */
OFL_API ofl_status_t ofl_manager_plan_action(const ofl_manager_t *m, size_t i,
                                             ofl_plan_action_t *out);

/* The plan of this rank. OFL_ERR_NOT_READY before the end of the warmup.
 * Without groups "auto" (offload on): out->automatic 0 and only the
 * measured fields (iterations, measured_peak_*, measured_stall_ms,
 * settled_*) are set, the same ledger's figures, for comparing a
 * configured offload with a plan. */
OFL_API ofl_status_t ofl_manager_plan_get(const ofl_manager_t *m,
                                          ofl_manager_plan_t *out);

/* Group names seen so far (in order of first use), and their counters. */
OFL_API size_t ofl_manager_group_count(const ofl_manager_t *m);
OFL_API ofl_status_t ofl_manager_group_stats(const ofl_manager_t *m, size_t i,
                                             ofl_manager_group_stats_t *out);

OFL_EXTERN_C_END

#endif /* OFL_MANAGER_H */
