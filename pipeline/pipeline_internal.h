/* ofl: private structures of the pipeline offload manager, shared by the
 * files of pipeline/ (docs/design/pipeline.md draws their layers). Not
 * installed. */
#ifndef OFL_PIPELINE_INTERNAL_H
#define OFL_PIPELINE_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include <ofl/manager.h>

#include "runtime/device_internal.h"
#include "runtime/internal.h"

/* Distinct group names per manager (a chunk keeps them as a bit mask). */
#define OFL__MAX_NAMES 64

/* One pushed tensor. Entries sharing a storage form a cluster copied once
 * (rule 6); the leader holds the pinned copy. */
typedef enum {
  E_HELD = 0,  /* pushed, device storage, group not committed */
  E_KEPT,      /* committed, stays on the device */
  E_OFFLOADED, /* device storage released; bytes in the leader's host copy */
  E_RELOADED,  /* device storage again */
  E_POPPED     /* handed back to the caller */
} entry_state_t;

typedef struct entry {
  ofl_tensor_t *t;
  ofl_tensor_t *host;     /* leader: the pinned copy while offloaded */
  ofl_disk_extent_t *ext; /* leader: or its disk extent */
  const void *sid;        /* storage identity at commit */
  size_t off;             /* offset in the storage at commit */
  size_t lo, span;        /* leader: byte range of the storage it copies */
  size_t pin_charge;      /* leader: bytes charged to the pinned admission
                             while its copy is in pinned memory (tier.c) */
  uint32_t leader;   /* index of the cluster leader (itself for a leader) */
  uint32_t nmembers; /* leader: entries in the cluster */
  uint8_t flag;      /* leader: 1 a tensor is big enough, 2 one is marked
                        not-offloadable */
  uint8_t state;
} entry_t;

typedef struct chunk chunk_t;

typedef struct group {
  chunk_t *chunk;
  uint32_t index; /* in the chunk, forward (start) order */
  int nid;        /* name id */
  entry_t *entries;
  uint32_t n, cap;
  ofl_event_t *offload_ev; /* recorded on d2h after the group's copies */
  ofl_event_t *reload_ev;  /* recorded on h2d after the group's reload */
  /* Recorded in warmup. */
  uint64_t warm_bytes;
  uint64_t warm_tensors;
  uint64_t warm_disk_bytes;   /* of warm_bytes, to the disk tier */
  uint64_t warm_budget_bytes; /* kept: no pinned (nor disk) room */
  uint32_t warm_small;        /* clusters kept for their size */
  uint32_t warm_flagged;      /* clusters not offloadable (flag, location) */
  uint32_t warm_bwd_cursor;   /* m->bwd_cursor at its commit */
  bool policy_offload;        /* steady-state switch (policy.c) */
  uint8_t keep_why;           /* ofl_group_keep_reason_t of the policy */
  bool last_of_name;          /* no later group of the same name in the chunk */
  bool next_in_bwd;           /* kept in steady state: the last of its name
                                 in the chunk next of that name in backward
                                 at its commit (policy.c, end of warmup) */
  /* The plan's index of the group (warmup order): the plan keeps the
   * group's measurements, lead and ledger state in its own arrays
   * (plan.h). */
  uint32_t pidx;
  /* Recompute (ofl_manager_group_start_flags, OFL_GROUP_RECOMPUTABLE). */
  bool recomputable;       /* the application can rerun it (every start of
                              the warmup said so) */
  bool rc_seen;            /* a start of the warmup gave flags */
  uint8_t action;          /* ofl_group_action_t of the steady plan */
  uint64_t rc_input_bytes; /* the input the application keeps for it */
  uint8_t rc_reruns;       /* OFL_RERUN_OWN | OFL_RERUN_INPUT (warmup) */
  /* Per iteration. */
  bool open, delayed, committed, offloaded, reload_issued, reload_joined;
  bool inline_reload;
  ofl_stream_t *joined_on; /* the compute stream that waited for reload_ev
                              (rule 3: another one must wait too) */
  uint8_t bwd;             /* 0 not begun, 1 begun, 2 ended */
} group_t;

struct chunk {
  uint32_t index; /* forward (creation) order */
  int vp_stage;
  int mb;           /* microbatch: creation order within the stage */
  uint32_t bwd_pos; /* place in the backward order */
  bool in_bwd;
  group_t **groups;
  uint32_t ngroups, cap;
  uint64_t name_mask;
  /* Per iteration. */
  uint32_t fwd_cursor;    /* groups started */
  uint32_t *commit_order; /* group indexes in commit order */
  uint32_t ncommit;
  uint32_t bwd_left; /* commits whose backward has not begun */
  group_t **stack;   /* offloaded groups waiting for reload (LIFO) */
  uint32_t nstack;
  bool fwd_done;
};

typedef struct name_info {
  char *name;
  /* Range names ("ofl offload <name>", "ofl reload <name>"), made once. */
  char *range_offload, *range_reload;
  bool selected; /* offloaded at all (params.groups) */
  bool dynamic;  /* byte-keyed pool blocks */
  uint64_t summary_bytes;
  uint64_t pin_span_max; /* dynamic: the largest cluster seen (tier.c) */
  ofl_manager_group_stats_t st;
  /* max_inflight throttle: offload events of this name, oldest first. */
  group_t **ring;
  uint32_t ring_head, ring_len;
} name_info_t;

/* One group_start of the warmup, offloaded name or not (the plan). */
typedef struct plan_rec {
  chunk_t *c;
  group_t *g; /* NULL: name not selected */
  int nid;
} plan_rec_t;

typedef struct open_group {
  group_t *g; /* NULL for a name that is not offloaded */
  int nid;
} open_group_t;

typedef struct delayed {
  group_t *g;
  ofl_tensor_t **forced;
  size_t n, cap;
} delayed_t;

/* Test switches that turn one rule of docs/DESIGN.md section 5 off, so that the
 * tests can show they fail without it. Never set outside tests. */
enum {
  OFL__RULE1_OFF = 1u << 1,
  OFL__RULE2_OFF = 1u << 2, /* rule 2, pinned side */
  OFL__RULE3_OFF = 1u << 3,
  OFL__RULE4_OFF = 1u << 4,
  OFL__RULE6_OFF = 1u << 6,
  OFL__RULE2D_OFF = 1u << 7 /* rule 2, device side */
};

typedef struct ofl__stall_probes ofl__stall_probes_t;
typedef struct ofl__plan ofl__plan_t;

/* Which configured values the application set in ofl_manager_params_t
 * (ofl_manager_config_print says where each value came from). */
enum {
  OFL__SRC_OFFLOAD = 1u << 0,
  OFL__SRC_GROUPS = 1u << 1,
  OFL__SRC_MIN_ELEMS = 1u << 2,
  OFL__SRC_MIN_BYTES = 1u << 3,
  OFL__SRC_FRACTION = 1u << 4,
  OFL__SRC_DELTA = 1u << 5,
  OFL__SRC_INFLIGHT = 1u << 6,
  OFL__SRC_PREFETCH = 1u << 7,
  OFL__SRC_HOST_BUDGET = 1u << 8,
  OFL__SRC_TARGET = 1u << 9,
  OFL__SRC_DEV_TARGET = 1u << 10
};

/* Switches of the tests alone (switches.c sets them; never set outside
 * tests). */
struct ofl__manager_test {
  unsigned rules_off;              /* OFL__RULE*_OFF */
  ofl_stream_t *compute_at_create; /* what rule 3 switched off uses */
  int fail_offload_after;          /* the offload of that many more clusters
                                      succeeds, the next fails; <0: never */
};

struct ofl_manager {
  ofl_device_t *dev;
  bool own_dev;
  /* The manager counts as a pool of dev while it lives, so that a close of
   * dev before the manager's destroy waits for it (its streams and events
   * live on dev). */
  bool holds_dev;
  ofl_stream_t *d2h, *h2d;
  ofl_event_t *ev_compute, *ev_d2h, *ev_h2d;
  ofl_pool_t *host_pool, *dev_pool;
  bool own_dev_pool;
  ofl_comm_t *comm;
  FILE *summary_out;
  ofl_summary_t *summary; /* gathered at the end of warmup */

  /* Configuration. */
  bool offload;
  size_t min_bytes;   /* > 0: threshold in bytes */
  uint64_t min_elems; /* when min_bytes == 0 */
  double fraction;
  uint64_t rank_delta_bytes;
  uint32_t max_inflight;
  uint32_t prefetch_groups; /* reloads issued ahead of backward */
  uint32_t from_params;     /* OFL__SRC_* bits: the value came from params */
  int pp_rank, rank;
  char *groups_cfg, *dynamic_cfg;
  bool off_trained; /* offload off: a training chunk began (not forward-only,
                       not disabled), so this reset ends the warmup */
  ofl_disk_t *disk; /* the tier below pinned memory, or NULL */

  /* Pinned admission (tier.c): under a host budget a steady iteration
   * offloads a cluster to pinned memory only while the clusters in it,
   * charged in call order, stay within pin_limit; the same clusters go
   * there in every iteration, whatever the copies' timing. */
  uint64_t pin_charged;     /* bytes charged to the clusters in pinned memory */
  uint64_t pin_limit;       /* admission limit; UINT64_MAX: none */
  uint64_t pin_cluster_max; /* the largest charge admitted; UINT64_MAX */
  size_t pin_budget;        /* the pool's budget the limits were set for */
  bool pin_moved; /* a limit dropped in this iteration: the placement of the
                     next one differs (the pools learn on) */

  /* State. */
  bool warmup, enabled, forward_only;
  uint32_t gen;    /* iteration count, for stale tags */
  unsigned tag_id; /* 1..255, in every tag: another manager's is refused */
  name_info_t names[OFL__MAX_NAMES];
  int nnames;

  chunk_t **fwd; /* every chunk, forward order */
  uint32_t nfwd, capfwd;
  chunk_t **bwd; /* backward order */
  uint32_t nbwd, capbwd;
  uint32_t fwd_before_bwd; /* warmup: chunks begun before the first backward
                              (the microbatches in flight at the peak) */
  int vpp;
  chunk_t ***stages; /* warmup: chunks per virtual stage not yet ordered */
  uint32_t *nstage, *capstage, *stage_count;

  chunk_t *cur_fwd, *cur_bwd;
  uint32_t fwd_cursor; /* steady state: next recorded chunk */
  uint32_t bwd_cursor; /* next place in the backward order */

  open_group_t *open;
  uint32_t nopen, capopen;
  delayed_t *delayed;
  uint32_t ndelayed, capdelayed;

  ofl_tensor_t **held; /* tensors held outside groups */
  uint32_t nheld, capheld;

  plan_rec_t *plan; /* warmup: every group start, in forward order */
  uint32_t nplan, capplan;
  uint64_t warm_small_tensors, warm_small_bytes; /* kept for their size */

  ofl_manager_stats_t st;
  ofl__stall_probes_t *probes; /* cuda: stalls timed on the GPU (stall.c) */

  /* groups "auto" (plan_measure.c, plan_ledger.c). */
  bool auto_plan;
  bool plan_recompute; /* OFL_PLAN_RECOMPUTE: the plan may recompute */
  uint64_t mem_target; /* bytes; 0: none */
  /* params.device_memory_target_bytes (0: none); at the warmup's end the
   * plan's mem_target becomes it less dev_rest, the non-activation bytes
   * (device peak less the activation peak with everything offloaded),
   * when that is tighter (plan_measure.c, ofl__plan_device_target). */
  uint64_t dev_target;
  uint64_t dev_peak_noted; /* ofl_manager_set_device_peak; 0: the device's */
  uint64_t dev_peak, dev_rest; /* measured at the warmup's end */
  ofl__plan_t *ap;             /* measurements, the plan, the ledger */

  struct ofl__manager_test test;
};

/* Tags (ofl_manager_tensor_push returns them, tensor_pop takes them):
 * bit 63: held outside a group; bits 55..62: the manager's tag id (a tag
 * pops only on the manager that made it); bits 40..54: iteration; managed:
 * bits 24..39 chunk, 12..23 group, 0..11 entry + 1; held: bits 0..39
 * slot + 1. The low field is never 0, so neither is a tag. */
#define OFL__TAG_HELD (UINT64_C(1) << 63)
#define OFL__TAG_ID_SHIFT 55
#define OFL__TAG_ID(m) ((uint64_t)(m)->tag_id << OFL__TAG_ID_SHIFT)
#define OFL__TAG_GEN_MASK (UINT64_C(0x7fff) << 40)
#define OFL__TAG_GEN(m) ((uint64_t)((m)->gen & 0x7fffu) << 40)
#define OFL__TAG_SLOT_MASK ((UINT64_C(1) << 40) - 1)
#define OFL__TAG_MAX_GROUPS 0xfffu  /* per chunk */
#define OFL__TAG_MAX_ENTRIES 0xffeu /* per group (entry + 1 fits 12 bits) */

static inline ofl_tag_t ofl__tag_make(const ofl_manager_t *m, uint32_t c,
                                      uint32_t g, uint32_t k) {
  return OFL__TAG_ID(m) | OFL__TAG_GEN(m) | ((uint64_t)c << 24) |
         ((uint64_t)g << 12) | (uint64_t)(k + 1);
}

/* The files' calls, from the lowest file to the highest
 * (docs/design/pipeline.md section 5.5). */

/* names.c: records, lists and the name table (calls no other file). */
/* Grows *arr to hold need elements (doubling); new elements are zeroed. */
ofl_status_t ofl__grow(void **arr, uint32_t *cap, uint32_t need, size_t elem);
int ofl__name_find(const ofl_manager_t *m, const char *name);
const char *ofl__list_next(const char *p, const char **item, size_t *len);
ofl_status_t ofl__name_intern(ofl_manager_t *m, const char *name, int *out);

/* switches.c */
bool ofl__manager_active(const ofl_manager_t *m);
ofl_stream_t *ofl__compute(ofl_manager_t *m);
/* OFL_ERR_INVALID_USAGE naming fn while the compute stream is captured
 * into a CUDA graph (offloading calls cannot be captured). */
ofl_status_t ofl__capture_refuse(ofl_manager_t *m, const char *fn);
/* Tests: whether this offload is the one ofl__manager_fail_offload_after
 * chose to fail (counts down). */
bool ofl__manager_test_fail_offload(ofl_manager_t *m);

/* Tests only (switches.c). */
void ofl__manager_rules_off(ofl_manager_t *m, unsigned mask);
/* The offload of after_n more clusters succeeds, the next one fails (as a
 * copy that cannot be queued would); -1: no fault. */
void ofl__manager_fail_offload_after(ofl_manager_t *m, int after_n);

/* plan_measure.c, plan_ledger.c, plan_feedback.c: groups "auto". Every
 * hook returns at once without auto. The warmup hooks stamp the compute and
 * copy streams; the steady hooks keep the activation ledger (bytes of
 * pushed tensors on the device). */
void ofl__plan_on_commit(ofl_manager_t *m, group_t *g, int phase);
/* group_start of g in the warmup: the start of its forward (recompute);
 * input: the group that holds the input a recompute of g keeps (NULL:
 * none). */
void ofl__plan_on_start(ofl_manager_t *m, group_t *g, group_t *input);
void ofl__plan_on_reload(ofl_manager_t *m, group_t *g, int phase);
void ofl__plan_on_backward(ofl_manager_t *m, group_t *g, int end);
/* g's reload held compute ns (warm: at its backward's begin in the
 * warmup, taken out of the warmup's timeline). */
void ofl__plan_on_stall(ofl_manager_t *m, group_t *g, uint64_t ns, bool warm);
/* The auto plan's warmup: a tensor_pop of g's took ns (a recompute's measured
 * cost leaves that time out of the warmup's backward). */
void ofl__plan_warm_pop(ofl_manager_t *m, group_t *g, uint64_t ns);
/* Reloads to keep issued ahead, from the leads of the groups next in
 * reload order (stack tops of c, then of next), given the ahead reloads
 * already issued and not yet begun. */
uint32_t ofl__plan_prefetch_depth(const ofl_manager_t *m, const chunk_t *c,
                                  const chunk_t *next, uint32_t ahead);
/* End of warmup: measure, solve, apply (after the first-backward rule and
 * the next-in-backward marks, before the summary). */
ofl_status_t ofl__plan_end_warmup(ofl_manager_t *m);
/* A steady iteration ended: measured against predicted, leads learn. */
void ofl__plan_end_iteration(ofl_manager_t *m);
void ofl__plan_free(ofl_manager_t *m);

/* stall.c: on backends with timing events, compute's wait for a reload is
 * timed on the device (events before and after the wait, read later). */
/* Makes compute wait for ev and times the wait: OFL_ERR_NOT_SUPPORTED
 * where the backend cannot time (the caller measures on the CPU). warm:
 * the time also goes to the plan as a warmup stall (a warmup backward's
 * begin). */
ofl_status_t ofl__stall_timed_wait(ofl_manager_t *m, group_t *g,
                                   ofl_stream_t *compute, ofl_event_t *ev,
                                   bool warm);
/* Adds the completed measurements to the stall counters (all of them,
 * waiting boundedly, when wait). */
void ofl__stall_harvest(ofl_manager_t *m, bool wait);
void ofl__stall_free(ofl_manager_t *m);

/* tier.c: where an offloaded cluster's bytes wait, pinned memory or the
 * disk tier, behind offload, reload and drop. */
/* Copies leader l's cluster into the tier on the D2H stream: the disk tier
 * for the groups it selects, else pinned memory, the disk tier again when
 * the host budget is full; *done false when every tier refused (the
 * cluster stays on the device, counted). */
ofl_status_t ofl__tier_offload(ofl_manager_t *m, group_t *g, entry_t *l,
                               bool *done);
/* Queues the H2D copy of l's bytes from the tier into dst on stream; once
 * queued, the tier's storage is let go after stream (rule 2), *released
 * telling whether that succeeded. Nothing changes on a failure. */
ofl_status_t ofl__tier_reload(ofl_manager_t *m, entry_t *l, void *dst,
                              ofl_stream_t *stream, ofl_status_t *released);
typedef enum {
  OFL__TIER_DROP,           /* the iteration ended without a reload */
  OFL__TIER_UNDO,           /* g's offload failed half-way: its counts go
                               back; its offload event was recorded */
  OFL__TIER_UNDO_UNRECORDED /* the same, no event: waits for the D2H */
} ofl__tier_drop_t;
/* Lets l's tier storage go after the group's copies, without a reload. */
void ofl__tier_drop(ofl_manager_t *m, group_t *g, entry_t *l,
                    ofl__tier_drop_t how);
/* At an iteration's end and at the manager's creation: the pinned
 * admission's limits start from the host pool's budget when it changed. */
void ofl__tier_end_iteration(ofl_manager_t *m);
/* Starts reading back the bytes of the groups next in c's reload order
 * where the tier is slow to give them (the disk tier's prefetch groups). */
void ofl__tier_read_ahead(ofl_manager_t *m, const chunk_t *c);
/* l's bytes are in the tier. */
static inline bool ofl__tier_holds(const entry_t *l) {
  return l->host != NULL || l->ext != NULL;
}

/* chunk.c: chunks, their group records, the backward order. */
ofl_status_t ofl__chunk_new(ofl_manager_t *m, int vp_stage, chunk_t **out);
void ofl__chunk_free(chunk_t *c);
/* A new group record of name nid at the end of chunk c (warmup). */
ofl_status_t ofl__chunk_add_group(ofl_manager_t *m, chunk_t *c, int nid,
                                  group_t **out);
ofl_status_t ofl__order_flush(ofl_manager_t *m, bool force);
chunk_t *ofl__front_backward_chunk(ofl_manager_t *m, int nid);
ofl_status_t ofl__chunk_check_done(ofl_manager_t *m, chunk_t *c);

/* group_forward.c: start, push, commit (public calls only). */

/* group_backward.c: reload, backward, pop. */
void ofl__group_end_iteration(ofl_manager_t *m, group_t *g);

/* report.c: rule 7, the per-name summary gathered on the comm and written
 * on its rank 0 (collective). */
ofl_status_t ofl__report_summary(ofl_manager_t *m);
/* The auto plan printed after the summary on rank 0 of the comm
 * (collective; nothing without auto). */
ofl_status_t ofl__report_plan(ofl_manager_t *m);

/* policy.c */
ofl_status_t ofl__policy_end_warmup(ofl_manager_t *m);

/* Log and error lines name the rank, chunk, microbatch and group. */
#define OFL__PLOG(level, m, c, gname, fmt, ...)                                \
  OFL__LOG((level), OFL_SUBSYS_PIPELINE,                                       \
           "rank %d chunk %d stage %d mb %d group %s: " fmt, (m)->rank,        \
           (c) ? (int)(c)->index : -1, (c) ? (c)->vp_stage : -1,               \
           (c) ? (c)->mb : -1, (gname), __VA_ARGS__)

#define OFL__PERR(status, m, c, gname, fmt, ...)                               \
  ofl__error((status), OFL_SUBSYS_PIPELINE,                                    \
             "rank %d chunk %d stage %d mb %d group %s: " fmt, (m)->rank,      \
             (c) ? (int)(c)->index : -1, (c) ? (c)->vp_stage : -1,             \
             (c) ? (c)->mb : -1, (gname), __VA_ARGS__)

static inline const char *ofl__gname(const ofl_manager_t *m, const group_t *g) {
  return g ? m->names[g->nid].name : "-";
}

#endif /* OFL_PIPELINE_INTERNAL_H */
