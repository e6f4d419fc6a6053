/* ofl pipeline demo: what its files share. The demo is split by concern:
 *   demo.c      main: the two runs, the comparison, the verdict
 *   options.c   the command line
 *   backend.c   which backend and why, the GPU module, --preset oom
 *   model.c     the model and its arithmetic (CPU or GPU kernels), the
 *               tensors handed to ofl, forward and backward of a layer
 *   comm.c      bounded waits and the messages between stages
 *   train.c     the schedule: one iteration, a whole run
 *   report.c    the memory check, the per-rank report, the CSV and PNG */
#ifndef OFL_DEMO_H
#define OFL_DEMO_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <ofl/ofl.h>

#include "glue.h"
#include "kernels_cuda.h"
#include "schedule.h"

typedef struct {
  int vpp, microbatches, layers, hidden, seq, iters;
  char offload_groups[256];
  int offload_auto;         /* --offload auto: groups "auto" */
  double memory_target_mib; /* --memory-target; <0: OFL_MEMORY_TARGET */
  double device_memory_target_mib; /* --device-memory-target; <0:
                                      OFL_DEVICE_MEMORY_TARGET */
  double fraction;          /* --offload-fraction; <0: OFL_OFFLOAD_FRACTION */
  size_t min_offload_bytes;
  double link_gbps;
  const char *csv, *trace, *png;
  const char *disk_groups, *disk_dir;
  int check_memory; /* fail when saved bytes differ from the summary > 5% */
  double mem_tolerance;
  int quiet;
  int timeout_s;
  /* Hidden test options: rank die_rank (-1: the last) exits without a word
   * to the others at die_at ("barrier": the per-iteration barrier of the
   * offload run's second iteration; "reduce": the end-of-run reductions),
   * so that a test can check that the others fail within --timeout. */
  const char *die_at;
  int die_rank;
  int stage, stages; /* OFL_DEMO_NO_MPI: the stage this process runs */
  ofl_backend_t backend; /* --backend; resolved in main before the runs */
  int preset_oom;        /* --preset oom */
  int stages_given;      /* --stages was on the command line */
  int gpu_ordinal;       /* cuda: the GPU the runs open (ofl's choice) */
  /* Hidden test option: on cuda, ofl is not told the demo's stream (the
   * mistake the compute-stream hand-off prevents: offloads then copy
   * before the kernels that write the tensors ran), so that a test can
   * check the stand-in makes the comparison fail. */
  int no_compute_stream;
  int recompute; /* --recompute: groups "auto" may also recompute */
  /* --recompute-modules: the demo itself recomputes these groups in every
   * iteration of the offload run (bit i: demo_group_names[i]), as a fixed
   * selective recompute would; recompute_full: the whole layer is rerun
   * from its input in backward (full recompute). */
  unsigned recompute_fixed;
  int recompute_full;
} opts_t;

/* 1 when this build compiled examples/pipeline_demo/kernels_cuda.cu (the
 * GPU kernels of the layer arithmetic, in their own module; see --help). */
#ifdef OFL_DEMO_HAVE_CUDA_KERNELS
#define DEMO_CUDA_KERNELS_COMPILED 1
#else
#define DEMO_CUDA_KERNELS_COMPILED 0
#endif

#ifdef OFL_DEMO_NO_MPI
#define DEMO_NAME "ofl_pipeline_demo_single"
#else
#define DEMO_NAME "ofl_pipeline_demo"
#endif

/* The seven group names of a layer, in forward order. */
extern const char *const demo_group_names[7];

/* ---- the model ---------------------------------------------------------- */

typedef struct {
  int s, h, f;
} dims_t;

enum { W_G1, W_QKV, W_O, W_G2, W_1, W_2, NW };

typedef struct {
  float *w[NW], *dw[NW];
  size_t n[NW];
} layer_t;

/* What one layer of one microbatch left for its backward: the tags of the
 * tensors handed to the manager (0: none), and the tensors the demo holds
 * itself. A recomputed group pushes nothing (rc, bit i for
 * demo_group_names[i]); its backward reruns its forward from an input:
 *   attn_norm, mlp_norm: the residual they save is their input, kept
 *     (hx, hx2): nothing to rerun, nothing freed;
 *   qkv_linear, expert_fc1: the norm's output (y1, y2) rerun from the
 *     residual attn_norm, mlp_norm hold;
 *   core_attn: qkv and the probabilities rerun from qkv_linear's y1;
 *   attn_proj: the attention's output rerun from core_attn's qkv;
 *   moe_act: the MLP's first product (u) rerun from expert_fc1's y2.
 * An input is obtained once, by the first backward that needs it (popped
 * from its group, or itself rerun when that group is recomputed too), and
 * held (hx, hy1, hqkv, hx2, hy2) until its own group's backward; when
 * attn_proj and core_attn are both recomputed, attn_proj's rerun of the
 * attention keeps its probabilities (hprobs) for core_attn's. With
 * --recompute-modules full, the layer keeps only its input (hx) and its
 * backward first reruns the whole forward, each saved tensor held in loc[]
 * (at its tag field's index, the tag 0) instead of handed to the manager. */
typedef struct {
  uint64_t x, y1, qkv, probs, a, x2, y2, u;
  unsigned rc;
  ofl_tensor_t *hx, *hy1, *hqkv, *hx2, *hy2, *hprobs;
  ofl_tensor_t *loc[8];
} saved_t;

typedef struct {
  opts_t *o;
  dims_t d;
  int rank, pp;
  ofl_device_t *dev;
  ofl_pool_t *pool;
  glue_t *glue;
  layer_t *layers;          /* vpp * layers */
  saved_t *saved;           /* microbatches * vpp * layers */
  ofl_tensor_t **stage_out; /* last-stage outputs per microbatch (loss) */
  double *losses;           /* iters * microbatches, last stage only */
  int iter;
  /* memory samples */
  double *mem_t;
  double *mem_b;
  size_t nmem, capmem;
  double t0;
  double steady_s; /* when the steady state began, seconds after t0 */
  size_t weight_bytes; /* device bytes of weights and gradients */
  /* cuda path (g_kc non-NULL): the demo's own compute stream, as created
   * (cs) and as ofl knows it (ocs); host buffers for what crosses to and
   * from the device (inputs, messages, the loss, the compared state). */
  void *cs;
  ofl_stream_t *ocs;
  float *hbuf[2];
  size_t hcap[2];
  size_t gpu_used_peak; /* cudaMemGetInfo: total - free, largest sample */
  size_t pool_total_seen; /* the pool's bytes at the last GPU sample */
  size_t act_peak; /* steady state: pool bytes in use less the demo's own
                      tensors that are not saved activations, largest sample
                      (with --offload auto: since the plan last changed, as
                      its measured_peak_settled_bytes) */
  uint64_t plan_changes; /* --offload auto: replans + lead changes seen */
  /* --offload auto: the ledger's peak over the iterations since the plan
   * last changed (as measured_peak_settled_bytes), less a last iteration
   * over the target that the plan answered at its end (answered_over, its
   * peak; 0: none): docs/design/pipeline.md allows one iteration at most
   * 10% over the target, after which the plan changes, and the run had no
   * iteration left to measure the change. */
  uint64_t ledger_settled, answered_over;
  uint64_t recomputed;   /* group starts recomputed (fixed or the plan's) */
  int offload; /* the offload run (not the baseline) */
  int rerun;   /* full recompute: a layer's forward rerun in its backward
                  (no groups; saved tensors held in saved_t.loc) */
} run_t;

/* The auto plan as a run ends (ofl_manager_plan_get), and the demo's own
 * activation peak (run_t.act_peak), for --check-memory and the report. */
typedef struct {
  int have;                   /* the manager made an auto plan */
  int met;                    /* it predicted the target met */
  double target, predicted_peak, measured_peak_max, peak_all, peak_none;
  double predicted_exposed_ms, measured_stall_ms;
  double predicted_stall_ms; /* the backward's predicted reload waits */
} plan_result_t;

/* What a run leaves for the report and the comparison. */
typedef struct {
  double step_s;        /* mean steady-state step time */
  size_t peak_bytes;    /* device peak over steady state */
  size_t summary_bytes; /* offload summary total (offload run) */
  glue_stats_t stats;
  unsigned char *state; /* losses, weights, gradients: for the comparison */
  size_t state_bytes;
  double *mem_t, *mem_b;
  size_t nmem;
  double steady_s; /* mem_t of the steady state's start (iteration 2) */
  size_t gpu_used_peak; /* cuda: cudaMemGetInfo's largest total - free */
  uint64_t checksum;    /* FNV-1a of state (losses, weights, gradients) */
  int oom;            /* the run stopped: out of device memory (expected) */
  int oom_iter;       /* the iteration it happened in */
  char oom_msg[512];  /* ofl's message */
  size_t act_peak;    /* run_t.act_peak */
  uint64_t recomputed; /* run_t.recomputed */
  plan_result_t plan; /* offload run with --offload auto */
  double ledger_peak; /* offload run, any groups: the manager's measured
                         activation peak (ofl_manager_plan_get; since the
                         plan last changed with auto) */
} result_t;

/* ---- globals ------------------------------------------------------------ */

extern int g_rank;          /* this process's rank, for messages */
extern int g_timeout_s;     /* --timeout, for every wait on a peer */
extern char *g_env_trace;   /* OFL_TRACE_FILE as the demo started */
extern const kc_api_t *g_kc; /* the GPU module's kernels; NULL: the CPU's */
extern void *g_kc_module;
extern ofl_stream_t *g_ocs; /* the running run's compute stream (cuda) */
/* The demo's own tensor handles, for the cleanup after an out-of-memory. */
extern ofl_tensor_t **g_live;
extern size_t g_nlive;
/* Where an allocation that runs out of device memory jumps to when the run
 * expects it (--preset oom's baseline); NULL: it is an error. */
extern jmp_buf *g_oom_jump;
extern char g_oom_msg[512];

/* ---- comm.c ------------------------------------------------------------- */

double now_s(void);
#if defined(__GNUC__)
__attribute__((noreturn, format(printf, 2, 3)))
#endif
void die(run_t *r, const char *fmt, ...);
#ifndef OFL_DEMO_NO_MPI
#include <mpi.h>
void wait_bounded(MPI_Request *req, const char *what);
void send_tensor(run_t *r, const ofl_tensor_t *t, int dst, int tag);
void recv_into(run_t *r, ofl_tensor_t *t, int src, int tag);
int tag_of(int mb, int vs, int dir, int nvs);
#else
void synth_message(run_t *r, ofl_tensor_t *t, int mb, int vs_from, int dir);
#endif
void barrier_bounded(const char *what);
void complete_sends(run_t *r);
void maybe_die_at(const opts_t *o, int rank, int pp, const char *point);

#define OK(r, call)                                                            \
  do {                                                                         \
    int st_ = (call);                                                          \
    if (st_ != 0)                                                              \
      die((r), "%s failed: %s (%s)", #call, ofl_status_str(st_),               \
          ofl_last_error());                                                   \
  } while (0)

#define KC(r, call)                                                            \
  do {                                                                         \
    int kc_e_ = (call);                                                        \
    if (kc_e_ != 0)                                                            \
      die((r), "%s failed: %s (CUDA error %d)", #call,                         \
          g_kc->error_string(kc_e_), kc_e_);                                   \
  } while (0)

/* ---- options.c, backend.c ------------------------------------------------ */

int parse_opts(int argc, char **argv, opts_t *o, int rank);
int choose_backend(opts_t *o, int leader, size_t *capacity);
int size_preset_oom(opts_t *o, int rank, int pp, size_t capacity, int leader);

/* ---- model.c ------------------------------------------------------------ */

static inline float *F(const ofl_tensor_t *t) { return ofl_tensor_data(t); }
const float *dev_read(run_t *r, const float *src, size_t n, int i);
float *dev_stage(run_t *r, float *dst, size_t n, int i);
void dev_commit(run_t *r, float *dst, const float *staged, size_t n);
void x_fill(run_t *r, float *dst, size_t n, unsigned long long seed,
            float scale);
ofl_tensor_t *act(run_t *r, int rows, int cols);
void drop(ofl_tensor_t *t);
void sample_memory(run_t *r);
void init_layers(run_t *r, int nlayers);
ofl_tensor_t *layer_forward(run_t *r, layer_t *L, saved_t *sv, ofl_tensor_t *x);
ofl_tensor_t *layer_backward(run_t *r, layer_t *L, saved_t *sv,
                             ofl_tensor_t *dy);

/* ---- train.c, report.c --------------------------------------------------- */

void run(opts_t *o, int rank, int pp, int offload, size_t capacity,
         int expect_oom, result_t *res);
size_t largest_offloaded_group(const opts_t *o);
int prefetch_groups_in_force(void);
int write_memory_csv(const char *path, int rank, int pp, const result_t *base,
                     const result_t *off);
int render_png(const char *csv, const char *png, int first, int pp,
               const double *all, int NF);
void report_print(const opts_t *o, const double *all, int NF, int rep_first,
                  int rep_n, const result_t *base, const result_t *off,
                  int no_compare, long long diff_all, long long bad_ranks,
                  int *mem_fail, int *nothing);
/* --offload auto: per rank, the plan against the target; the ranks whose
 * measured activation peak is over it (when a target is set). */
int report_plan(const opts_t *o, const double *all, int NF, int rep_first,
                int rep_n);

#ifdef OFL_DEMO_NO_MPI
#define DEMO_FINALIZE() ((void)0)
#else
#define DEMO_FINALIZE() MPI_Finalize()
#endif

#endif /* OFL_DEMO_H */
