/* ofl pipeline demo: a multi-rank pipeline-parallel training run under
 * mpirun, one pipeline stage per rank, 1F1B or interleaved 1F1B, layers made
 * of the named groups of a transformer layer doing real arithmetic (on the
 * CPU, or as GPU kernels on a cuda device: --backend). It
 * trains twice in one invocation, without and with activation offload, and
 * checks that losses, gradients and weights are bit-identical; it reports the
 * offload summary, device memory saved, bytes moved, stalls and step times.
 *
 * Built with OFL_DEMO_NO_MPI (ofl_pipeline_demo_single) it needs no MPI: one
 * process runs the schedule of one stage (--stage S of --stages P), and the
 * messages of the other stages (activations from the previous stage,
 * gradients from the next one) are generated from a seed, the same in both
 * runs, so the bit-identity check holds for that stage alone. */
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#ifndef OFL_DEMO_NO_MPI
#include <mpi.h>
#endif
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>

#include "glue.h"
#include "kernels.h"
#include "kernels_cuda.h"
#include "schedule.h"

/* ---- options ------------------------------------------------------------ */

typedef struct {
  int vpp, microbatches, layers, hidden, seq, iters;
  char offload_groups[256];
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

static const char *usage_text =
#ifdef OFL_DEMO_NO_MPI
    "usage: ofl_pipeline_demo_single [--stage S] [--stages P] [options]\n"
    "  One process runs stage S of a P-stage pipeline without MPI: the\n"
    "  activations of stage S-1 and the gradients of stage S+1 are generated\n"
    "  from a seed (the same in both runs).\n"
    "  --stage S           the pipeline stage this process runs [0]\n"
    "  --stages P          pipeline size [4]\n"
#else
    "usage: mpirun -n P ofl_pipeline_demo [options]\n"
    "  One pipeline stage per MPI rank (P ranks = pipeline size P).\n"
#endif
    "  --vpp V             virtual stages per rank; V > 1 runs interleaved "
    "1F1B\n"
    "                      (microbatches must then be a multiple of P) [1]\n"
    "  --microbatches M    microbatches per iteration [8]\n"
    "  --layers L          layers per virtual stage [2]\n"
    "  --hidden H          hidden size [128]\n"
    "  --seq S             sequence length (rows per activation, <= 4096) "
    "[128]\n"
    "  --iters N           iterations per run; the first is the warmup [4]\n"
    "  --offload LIST      group names to offload, comma-separated, from\n"
    "                      attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,\n"
    "                      expert_fc1,moe_act, or 'all' [all]\n"
    "  --min-offload-bytes B  smallest tensor offloaded [4096]\n"
    "  --link-gbps G       emulate a host link of G GB/s per direction (0: "
    "off) [0]\n"
    "  --disk-groups LIST  group names that go to the disk tier (one private\n"
    "                      file per rank, io_uring, prefetch) [none]\n"
    "  --disk-dir DIR      directory of the disk tier's file [OFL_DISK_DIR or "
    "/tmp]\n"
    "  --memory-csv FILE   write device memory over time, both runs (rank 0)\n"
    "  --memory-png FILE   render the memory CSV to a PNG with gnuplot (rank\n"
    "                      0); without --memory-csv the CSV goes next to it\n"
    "  --trace FILE        Chrome trace of the offload run (%r: rank); "
    "without\n"
    "                      it OFL_TRACE_FILE traces both runs, as in any\n"
    "                      program (the second run's file gets .1 before "
    ".json)\n"
    "  --check-memory      fail unless summary - prefetch bound <= device "
    "bytes\n"
    "                      saved <= summary on every rank (see the report)\n"
    "  --mem-tolerance F   extra relative slack of --check-memory on both\n"
    "                      sides [0]\n"
    "  --timeout S         seconds a rank waits for a peer: its messages and\n"
    "                      every collective (barriers, reductions) [60]\n"
    "  --backend B         auto, host or cuda [auto]: the first line says\n"
    "                      which one and why. host: the arithmetic runs on\n"
    "                      the CPU (kernels.c). cuda: it runs as GPU kernels\n"
    "                      (kernels_cuda.cu, built by nvcc into the module\n"
    "                      libofl_demo_kernels_cuda.so next to the demo, or\n"
    "                      OFL_DEMO_KERNELS_CUDA) on the demo's own stream;\n"
    "                      the GPU is OFL_DEVICE's (an ordinal or local),\n"
    "                      else 0. auto: cuda when a GPU and the module are\n"
    "                      there, else host\n"
    "  --preset oom        a model whose activations do not fit on the device\n"
    "                      without offload, sized from its capacity (host:\n"
    "                      OFL_DEVICE_CAPACITY; cuda: cudaMemGetInfo): sets\n"
    "                      --hidden, --seq, --layers, --microbatches, --vpp 1\n"
    "                      (after the other options). The baseline run must\n"
    "                      run out of device memory (reported, not a crash),\n"
    "                      the offload run must fit; it is compared bit for\n"
    "                      bit with a baseline run without the capacity\n"
    "  --quiet             no progress lines\n"
    "  --help              this text\n";

static int parse_int(const char *s, int lo, int hi, int *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi)
    return -1;
  *out = (int)v;
  return 0;
}

static int parse_opts(int argc, char **argv, opts_t *o, int rank) {
  *o = (opts_t){.vpp = 1,
                .microbatches = 8,
                .layers = 2,
                .hidden = 128,
                .seq = 128,
                .iters = 4,
                .min_offload_bytes = 4096,
                .mem_tolerance = 0,
                .timeout_s = 60,
                .die_rank = -1,
                .stage = 0,
                .stages = 4};
  snprintf(o->offload_groups, sizeof o->offload_groups, "all");
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = 0;
#define INT_OPT(flag, field, lo, hi)                                           \
  if (strcmp(a, flag) == 0) {                                                  \
    bad = !v || parse_int(v, lo, hi, &o->field);                               \
    i++;                                                                       \
    goto next;                                                                 \
  }
    INT_OPT("--vpp", vpp, 1, 16)
    INT_OPT("--microbatches", microbatches, 1, 4096)
    INT_OPT("--layers", layers, 1, 64)
    INT_OPT("--hidden", hidden, 8, 8192)
    INT_OPT("--seq", seq, 1, 4096)
    INT_OPT("--iters", iters, 1, 100000)
    INT_OPT("--timeout", timeout_s, 1, 86400)
    INT_OPT("--die-rank", die_rank, 0, 1 << 20)
#ifdef OFL_DEMO_NO_MPI
    INT_OPT("--stage", stage, 0, 4095)
    if (strcmp(a, "--stages") == 0)
      o->stages_given = 1;
    INT_OPT("--stages", stages, 1, 4096)
#endif
#undef INT_OPT
    if (strcmp(a, "--offload") == 0 && v) {
      snprintf(o->offload_groups, sizeof o->offload_groups, "%s", v);
      i++;
    } else if (strcmp(a, "--min-offload-bytes") == 0 && v) {
      o->min_offload_bytes = (size_t)strtoull(v, NULL, 10);
      i++;
    } else if (strcmp(a, "--link-gbps") == 0 && v) {
      o->link_gbps = atof(v);
      bad = o->link_gbps < 0;
      i++;
    } else if (strcmp(a, "--disk-groups") == 0 && v) {
      o->disk_groups = v;
      i++;
    } else if (strcmp(a, "--disk-dir") == 0 && v) {
      o->disk_dir = v;
      i++;
    } else if (strcmp(a, "--memory-csv") == 0 && v) {
      o->csv = v;
      i++;
    } else if (strcmp(a, "--memory-png") == 0 && v) {
      o->png = v;
      i++;
    } else if (strcmp(a, "--trace") == 0 && v) {
      o->trace = v;
      i++;
    } else if (strcmp(a, "--mem-tolerance") == 0 && v) {
      o->mem_tolerance = atof(v);
      bad = !(o->mem_tolerance >= 0 && o->mem_tolerance < 1);
      i++;
    } else if (strcmp(a, "--die-at") == 0 && v) {
      o->die_at = v;
      bad = strcmp(v, "barrier") != 0 && strcmp(v, "reduce") != 0;
      i++;
    } else if (strcmp(a, "--backend") == 0 && v) {
      if (strcmp(v, "auto") == 0)
        o->backend = OFL_BACKEND_AUTO;
      else if (strcmp(v, "host") == 0)
        o->backend = OFL_BACKEND_HOST;
      else if (strcmp(v, "cuda") == 0)
        o->backend = OFL_BACKEND_CUDA;
      else
        bad = 1;
      i++;
    } else if (strcmp(a, "--preset") == 0 && v) {
      bad = strcmp(v, "oom") != 0;
      o->preset_oom = !bad;
      i++;
    } else if (strcmp(a, "--check-memory") == 0) {
      o->check_memory = 1;
    } else if (strcmp(a, "--no-compute-stream") == 0) {
      o->no_compute_stream = 1;
    } else if (strcmp(a, "--quiet") == 0) {
      o->quiet = 1;
    } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      if (rank == 0)
        fputs(usage_text, stdout);
      return 1;
    } else {
      bad = 1;
    }
  next:
    if (bad) {
      if (rank == 0)
        fprintf(stderr, DEMO_NAME ": bad or incomplete option '%s'\n%s", a,
                usage_text);
      return -1;
    }
  }
  if (strcmp(o->offload_groups, "all") == 0)
    snprintf(o->offload_groups, sizeof o->offload_groups,
             "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,expert_fc1,"
             "moe_act");
  return 0;
}

/* ---- the model ---------------------------------------------------------- */

typedef struct {
  int s, h, f;
} dims_t;

enum { W_G1, W_QKV, W_O, W_G2, W_1, W_2, NW };

typedef struct {
  float *w[NW], *dw[NW];
  size_t n[NW];
} layer_t;

typedef struct {
  uint64_t x, y1, qkv, probs, a, x2, y2, u;
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
} run_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int g_rank = -1;      /* this process's rank, for messages */
static int g_timeout_s = 60; /* --timeout, for every wait on a peer */
static char *g_env_trace;    /* OFL_TRACE_FILE as the demo started */

static void die(run_t *r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, DEMO_NAME " rank %d: ", r ? r->rank : g_rank);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
#ifndef OFL_DEMO_NO_MPI
  MPI_Abort(MPI_COMM_WORLD, 2);
#endif
  exit(2);
}

#ifndef OFL_DEMO_NO_MPI

/* Waits for a non-blocking MPI operation until --timeout. Every collective
 * of the demo goes through here (MPI_Ibarrier, MPI_Ireduce, ... instead of
 * their blocking forms): a rank that died, or never calls, makes the
 * others fail with a message naming the step instead of hanging forever. */
static void wait_bounded(MPI_Request *req, const char *what) {
  double deadline = now_s() + g_timeout_s;
  unsigned nap = 1;
  for (;;) {
    int done = 0;
    if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
      die(NULL, "%s failed", what);
    if (done)
      return;
    if (now_s() > deadline)
      die(NULL,
          "%s did not complete after %d s; did a rank die? (--timeout "
          "sets the wait)",
          what, g_timeout_s);
    usleep(nap);
    if (nap < 500)
      nap *= 2;
  }
}

static void barrier_bounded(const char *what) {
  MPI_Request req;
  if (MPI_Ibarrier(MPI_COMM_WORLD, &req) != MPI_SUCCESS)
    die(NULL, "MPI_Ibarrier (%s) failed", what);
  wait_bounded(&req, what);
}
#else
static void barrier_bounded(const char *what) { (void)what; }
#endif

/* --die-at: this rank leaves at `point` without telling anyone, as a crash
 * would (no MPI_Finalize, no abort). */
static void maybe_die_at(const opts_t *o, int rank, int pp, const char *point) {
  int who = o->die_rank >= 0 ? o->die_rank : pp - 1;
  if (o->die_at == NULL || strcmp(o->die_at, point) != 0 || rank != who)
    return;
  fprintf(stderr, "ofl_pipeline_demo rank %d: exits at the %s (--die-at)\n",
          rank, point);
  fflush(stderr);
  _exit(3);
}

#define OK(r, call)                                                            \
  do {                                                                         \
    int st_ = (call);                                                          \
    if (st_ != 0)                                                              \
      die((r), "%s failed: %s (%s)", #call, ofl_status_str(st_),               \
          ofl_last_error());                                                   \
  } while (0)

/* ---- where the arithmetic runs ---------------------------------------------
 * On the host backend the layer arithmetic is kernels.c's, on the CPU, on
 * the memory of ofl's host "device". On a cuda device it is kernels_cuda.h's
 * GPU kernels (a module dlopened by choose_backend: g_kc), launched on the
 * demo's own non-blocking stream, which ofl is given as the compute stream
 * (ofl_stream_wrap_native + ofl_device_set_compute_stream), as a training
 * program's stream would be. The x_* functions below run one or the other;
 * what the host reads or writes of device memory (inputs, messages, the
 * loss, the compared state) crosses through the run's host buffers, on the
 * compute stream, synchronously. */
static const kc_api_t *g_kc;
static void *g_kc_module;
static ofl_stream_t *g_ocs; /* the running run's compute stream (cuda) */

#define KC(r, call)                                                            \
  do {                                                                         \
    int kc_e_ = (call);                                                        \
    if (kc_e_ != 0)                                                            \
      die((r), "%s failed: %s (CUDA error %d)", #call,                         \
          g_kc->error_string(kc_e_), kc_e_);                                   \
  } while (0)

/* Host buffer i (0 or 1) of at least n floats. */
static float *hbuf(run_t *r, int i, size_t n) {
  if (r->hcap[i] < n) {
    free(r->hbuf[i]);
    r->hbuf[i] = malloc(n * sizeof(float));
    if (r->hbuf[i] == NULL)
      die(r, "out of host memory (%zu bytes)", n * sizeof(float));
    r->hcap[i] = n;
  }
  return r->hbuf[i];
}

/* The n floats at device address src, readable by the host (src itself on
 * the host backend; host buffer `i` after a copy on the cuda path). */
static const float *dev_read(run_t *r, const float *src, size_t n, int i) {
  if (g_kc == NULL)
    return src;
  float *h = hbuf(r, i, n);
  KC(r, g_kc->d2h(h, src, n * sizeof(float), r->cs));
  return h;
}

/* Where the host writes n floats bound for dst: dst itself on the host
 * backend, else host buffer `i`, which dev_commit then copies to dst. */
static float *dev_stage(run_t *r, float *dst, size_t n, int i) {
  return g_kc == NULL ? dst : hbuf(r, i, n);
}

static void dev_commit(run_t *r, float *dst, const float *staged, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->h2d(dst, staged, n * sizeof(float), r->cs));
}

static void x_fill(run_t *r, float *dst, size_t n, unsigned long long seed,
                   float scale) {
  float *h = dev_stage(r, dst, n, 0);
  k_fill(h, n, seed, scale);
  dev_commit(r, dst, h, n);
}

static void x_matmul(run_t *r, float *c, const float *a, const float *b,
                     int m, int k, int n, int acc) {
  if (g_kc != NULL)
    KC(r, g_kc->matmul(c, a, b, m, k, n, acc, r->cs));
  else
    k_matmul(c, a, b, m, k, n, acc);
}

static void x_matmul_tn(run_t *r, float *c, const float *a, const float *b,
                        int m, int k, int n, int acc) {
  if (g_kc != NULL)
    KC(r, g_kc->matmul_tn(c, a, b, m, k, n, acc, r->cs));
  else
    k_matmul_tn(c, a, b, m, k, n, acc);
}

static void x_matmul_nt(run_t *r, float *c, const float *a, const float *b,
                        int m, int k, int n, int acc) {
  if (g_kc != NULL)
    KC(r, g_kc->matmul_nt(c, a, b, m, k, n, acc, r->cs));
  else
    k_matmul_nt(c, a, b, m, k, n, acc);
}

static void x_rmsnorm(run_t *r, float *y, const float *x, const float *g,
                      int rows, int h) {
  if (g_kc != NULL)
    KC(r, g_kc->rmsnorm(y, x, g, rows, h, r->cs));
  else
    k_rmsnorm(y, x, g, rows, h);
}

static void x_attention(run_t *r, float *out, float *probs, const float *qkv,
                        int s, int h) {
  if (g_kc != NULL)
    KC(r, g_kc->attention(out, probs, qkv, s, h, r->cs));
  else
    k_attention(out, probs, qkv, s, h);
}

static void x_silu(run_t *r, float *act, const float *u, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->silu(act, u, n, r->cs));
  else
    k_silu(act, u, n);
}

static void x_silu_backward(run_t *r, float *du, const float *dact,
                            const float *u, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->silu_backward(du, dact, u, n, r->cs));
  else
    k_silu_backward(du, dact, u, n);
}

static void x_add(run_t *r, float *y, const float *x, size_t n) {
  if (g_kc != NULL)
    KC(r, g_kc->add(y, x, n, r->cs));
  else
    k_add(y, x, n);
}

/* The tensor handles the demo's code holds (not the manager's): after an
 * out-of-memory in the middle of a step (--preset oom's baseline) they are
 * destroyed before the run's manager, pool and device. */
static ofl_tensor_t **g_live;
static size_t g_nlive, g_caplive;

static ofl_tensor_t *live_add(ofl_tensor_t *t) {
  if (g_nlive == g_caplive) {
    g_caplive = g_caplive ? 2 * g_caplive : 256;
    ofl_tensor_t **n = realloc(g_live, g_caplive * sizeof *g_live);
    if (n == NULL) {
      fprintf(stderr, DEMO_NAME ": out of host memory\n");
      exit(2);
    }
    g_live = n;
  }
  g_live[g_nlive++] = t;
  return t;
}

static void live_remove(ofl_tensor_t *t) {
  for (size_t i = g_nlive; i-- > 0;)
    if (g_live[i] == t) {
      g_live[i] = g_live[--g_nlive];
      return;
    }
}

/* Where an allocation that runs out of device memory jumps to when the run
 * expects it (--preset oom's baseline); NULL: it is an error. */
static jmp_buf *g_oom_jump;
static char g_oom_msg[512];

static ofl_tensor_t *act(run_t *r, int rows, int cols) {
  int64_t shape[2] = {rows, cols};
  ofl_tensor_t *t = NULL;
  /* cuda: a block whose last use is still queued is handed out at once,
   * the compute stream made to wait for that use (ofl_pool_alloc). */
  int st = ofl_pool_alloc(r->pool, shape, 2, OFL_DTYPE_F32,
                          g_kc != NULL ? r->ocs : NULL, &t);
  if (st == OFL_ERR_NO_MEMORY && g_oom_jump != NULL) {
    snprintf(g_oom_msg, sizeof g_oom_msg, "%s: %s", ofl_status_str(st),
             ofl_last_error());
    longjmp(*g_oom_jump, 1);
  }
  OK(r, st);
  return live_add(t);
}

static float *F(const ofl_tensor_t *t) { return ofl_tensor_data(t); }

static ofl_tensor_t *alias(run_t *r, ofl_tensor_t *t) {
  ofl_tensor_t *a = NULL;
  OK(r, ofl_tensor_alias(t, &a));
  return live_add(a);
}

/* Ends a handle of the demo's. On the cuda path the storage is let go
 * after the work queued on the compute stream (its last use: the kernels
 * that read it may not have run yet), so the pool cannot hand the block to
 * another stream's work before they did. ofl's own reloads into this pool
 * are safe without it (the H2D stream waits for the compute stream before
 * each reload, docs/DESIGN.md section 5), so no test can see it missing;
 * it is what any other user of the pool on another stream relies on. */
static void drop(ofl_tensor_t *t) {
  live_remove(t);
  if (g_kc != NULL && g_ocs != NULL && ofl_tensor_data(t) != NULL)
    (void)ofl_tensor_release_storage_after(t, g_ocs);
  ofl_tensor_destroy(t);
}

/* Hands t to the manager: from here on it is the manager's handle. */
static int save(glue_t *g, ofl_tensor_t *t, uint64_t *tag) {
  live_remove(t);
  return glue_save(g, t, tag);
}

static void sample_memory(run_t *r) {
  if (r->nmem == r->capmem) {
    r->capmem = r->capmem ? r->capmem * 2 : 1024;
    r->mem_t = realloc(r->mem_t, r->capmem * sizeof *r->mem_t);
    r->mem_b = realloc(r->mem_b, r->capmem * sizeof *r->mem_b);
  }
  /* Device memory allocated (as torch's memory_allocated): weights plus the
   * activation pool's blocks in use; free pool blocks are cache, not use. */
  ofl_pool_stats_t st;
  ofl_pool_get_stats(r->pool, &st);
  r->mem_t[r->nmem] = now_s() - r->t0;
  r->mem_b[r->nmem] = (double)(r->weight_bytes + st.in_use_bytes);
  r->nmem++;
  /* The GPU's own figure: everything allocated on it (this process's pools
   * and weights, ofl's buffers, the runtime's, other processes'). Asked
   * only when the pool's memory changed since the last sample (it moves
   * with allocations, and the pool is what allocates during a step), so
   * that the step does not pay a driver call per group. */
  size_t fr = 0, tot = 0;
  if (g_kc != NULL && st.total_bytes != r->pool_total_seen &&
      g_kc->mem_info(&fr, &tot) == 0) {
    r->pool_total_seen = st.total_bytes;
    if (tot - fr > r->gpu_used_peak)
      r->gpu_used_peak = tot - fr;
  }
}

static void init_layers(run_t *r, int nlayers) {
  dims_t d = r->d;
  for (int i = 0; i < nlayers; i++) {
    layer_t *L = &r->layers[i];
    size_t n[NW] = {(size_t)d.h, (size_t)d.h * 3 * d.h, (size_t)d.h * d.h,
                    (size_t)d.h, (size_t)d.h * d.f,     (size_t)d.f * d.h};
    for (int k = 0; k < NW; k++) {
      L->n[k] = n[k];
      OK(r, ofl_device_malloc(r->dev, n[k] * sizeof(float), (void **)&L->w[k]));
      OK(r,
         ofl_device_malloc(r->dev, n[k] * sizeof(float), (void **)&L->dw[k]));
      r->weight_bytes += 2 * n[k] * sizeof(float);
      unsigned long long seed = ((unsigned long long)r->rank << 32) ^
                                ((unsigned long long)i << 8) ^ (unsigned)k;
      if (k == W_G1 || k == W_G2) {
        float *h = dev_stage(r, L->w[k], n[k], 0);
        for (size_t j = 0; j < n[k]; j++)
          h[j] = 1.0f;
        dev_commit(r, L->w[k], h, n[k]);
      } else {
        x_fill(r, L->w[k], n[k], seed, 1.0f / sqrtf((float)d.h));
      }
      if (g_kc != NULL)
        KC(r, g_kc->memset0(L->dw[k], n[k] * sizeof(float), r->cs));
      else
        memset(L->dw[k], 0, n[k] * sizeof(float));
    }
  }
}

static void x_rmsnorm_backward(run_t *r, float *dx, float *dg, const float *x,
                               const float *g, const float *dy, int rows,
                               int h) {
  if (g_kc == NULL) {
    k_rmsnorm_backward(dx, dg, x, g, dy, rows, h);
    return;
  }
  ofl_tensor_t *scratch = act(r, rows, 1); /* the rows' 1/rms */
  KC(r, g_kc->rmsnorm_backward(dx, dg, x, g, dy, F(scratch), rows, h, r->cs));
  drop(scratch);
}

static void x_attention_backward(run_t *r, float *dqkv, const float *dout,
                                 const float *qkv, const float *probs, int s,
                                 int h) {
  if (g_kc == NULL) {
    k_attention_backward(dqkv, dout, qkv, probs, s, h);
    return;
  }
  ofl_tensor_t *scratch = act(r, s, s); /* dS */
  KC(r, g_kc->attention_backward(dqkv, dout, qkv, probs, F(scratch), s, h,
                                 r->cs));
  drop(scratch);
}

/* Forward of one layer; x is consumed (the caller's handle ends here). */
static ofl_tensor_t *layer_forward(run_t *r, layer_t *L, saved_t *sv,
                                   ofl_tensor_t *x) {
  dims_t d = r->d;
  glue_t *g = r->glue;
  size_t sh = (size_t)d.s * d.h;

  OK(r, glue_group_start(g, "attn_norm"));
  ofl_tensor_t *y1 = act(r, d.s, d.h);
  x_rmsnorm(r, F(y1), F(x), L->w[W_G1], d.s, d.h);
  OK(r, save(g, alias(r, x), &sv->x));
  OK(r, glue_group_commit(g, "attn_norm"));
  sample_memory(r);

  OK(r, glue_group_start(g, "qkv_linear"));
  ofl_tensor_t *qkv = act(r, d.s, 3 * d.h);
  x_matmul(r, F(qkv), F(y1), L->w[W_QKV], d.s, d.h, 3 * d.h, 0);
  OK(r, save(g, y1, &sv->y1));
  OK(r, glue_group_commit(g, "qkv_linear"));
  sample_memory(r);

  OK(r, glue_group_start(g, "core_attn"));
  ofl_tensor_t *a = act(r, d.s, d.h);
  ofl_tensor_t *probs = act(r, d.s, d.s);
  x_attention(r, F(a), F(probs), F(qkv), d.s, d.h);
  OK(r, save(g, qkv, &sv->qkv));
  OK(r, save(g, probs, &sv->probs));
  OK(r, glue_group_commit(g, "core_attn"));
  sample_memory(r);

  OK(r, glue_group_start(g, "attn_proj"));
  ofl_tensor_t *x2 = act(r, d.s, d.h);
  x_matmul(r, F(x2), F(a), L->w[W_O], d.s, d.h, d.h, 0);
  x_add(r, F(x2), F(x), sh);
  OK(r, save(g, a, &sv->a));
  OK(r, glue_group_commit(g, "attn_proj"));
  sample_memory(r);
  drop(x);

  OK(r, glue_group_start(g, "mlp_norm"));
  ofl_tensor_t *y2 = act(r, d.s, d.h);
  x_rmsnorm(r, F(y2), F(x2), L->w[W_G2], d.s, d.h);
  OK(r, save(g, alias(r, x2), &sv->x2));
  OK(r, glue_group_commit(g, "mlp_norm"));
  sample_memory(r);

  OK(r, glue_group_start(g, "expert_fc1"));
  ofl_tensor_t *u = act(r, d.s, d.f);
  x_matmul(r, F(u), F(y2), L->w[W_1], d.s, d.h, d.f, 0);
  OK(r, save(g, y2, &sv->y2));
  OK(r, glue_group_commit(g, "expert_fc1"));
  sample_memory(r);

  OK(r, glue_group_start(g, "moe_act"));
  ofl_tensor_t *av = act(r, d.s, d.f);
  ofl_tensor_t *out = act(r, d.s, d.h);
  x_silu(r, F(av), F(u), (size_t)d.s * d.f);
  x_matmul(r, F(out), F(av), L->w[W_2], d.s, d.f, d.h, 0);
  x_add(r, F(out), F(x2), sh);
  OK(r, save(g, u, &sv->u));
  OK(r, glue_group_commit(g, "moe_act"));
  sample_memory(r);
  drop(av);
  drop(x2);
  return out;
}

static ofl_tensor_t *load(run_t *r, uint64_t tag) {
  ofl_tensor_t *t = NULL;
  OK(r, glue_load(r->glue, tag, &t));
  return live_add(t);
}

static void backward_end(run_t *r, const char *name) {
  OK(r, glue_backward_end(r->glue, name));
  sample_memory(r);
}

/* Backward of the group `name` that computed y[rows,out] = x[rows,in] @ w:
 * dw += x^T dy; returns dx = dy w^T (x is the tensor saved under tag). */
static ofl_tensor_t *linear_backward(run_t *r, const char *name, uint64_t tag,
                                     const float *w, float *dw,
                                     const ofl_tensor_t *dy, int rows, int in,
                                     int out) {
  OK(r, glue_backward_begin(r->glue, name));
  ofl_tensor_t *x = load(r, tag);
  x_matmul_tn(r, dw, F(x), F(dy), in, rows, out, 1);
  ofl_tensor_t *dx = act(r, rows, in);
  x_matmul_nt(r, F(dx), F(dy), w, rows, out, in, 0);
  drop(x);
  backward_end(r, name);
  return dx;
}

/* Backward of one layer; dout is consumed; returns d(input). */
static ofl_tensor_t *layer_backward(run_t *r, layer_t *L, saved_t *sv,
                                    ofl_tensor_t *dout) {
  dims_t d = r->d;
  glue_t *g = r->glue;

  OK(r, glue_backward_begin(g, "moe_act"));
  ofl_tensor_t *u = load(r, sv->u);
  ofl_tensor_t *av = act(r, d.s, d.f), *dact = act(r, d.s, d.f);
  x_silu(r, F(av), F(u), (size_t)d.s * d.f);
  x_matmul_tn(r, L->dw[W_2], F(av), F(dout), d.f, d.s, d.h, 1);
  x_matmul_nt(r, F(dact), F(dout), L->w[W_2], d.s, d.h, d.f, 0);
  ofl_tensor_t *du = act(r, d.s, d.f);
  x_silu_backward(r, F(du), F(dact), F(u), (size_t)d.s * d.f);
  drop(av);
  drop(dact);
  drop(u);
  backward_end(r, "moe_act");
  ofl_tensor_t *dx2 = dout; /* the residual passes the gradient through */

  ofl_tensor_t *dy2 = linear_backward(r, "expert_fc1", sv->y2, L->w[W_1],
                                      L->dw[W_1], du, d.s, d.h, d.f);
  drop(du);

  OK(r, glue_backward_begin(g, "mlp_norm"));
  ofl_tensor_t *x2 = load(r, sv->x2);
  x_rmsnorm_backward(r, F(dx2), L->dw[W_G2], F(x2), L->w[W_G2], F(dy2), d.s, d.h);
  drop(x2);
  drop(dy2);
  backward_end(r, "mlp_norm");

  ofl_tensor_t *da = linear_backward(r, "attn_proj", sv->a, L->w[W_O],
                                     L->dw[W_O], dx2, d.s, d.h, d.h);
  ofl_tensor_t *dx = dx2;

  OK(r, glue_backward_begin(g, "core_attn"));
  ofl_tensor_t *probs = load(r, sv->probs);
  ofl_tensor_t *qkv = load(r, sv->qkv);
  ofl_tensor_t *dqkv = act(r, d.s, 3 * d.h);
  x_attention_backward(r, F(dqkv), F(da), F(qkv), F(probs), d.s, d.h);
  drop(qkv);
  drop(probs);
  drop(da);
  backward_end(r, "core_attn");

  ofl_tensor_t *dy1 = linear_backward(r, "qkv_linear", sv->y1, L->w[W_QKV],
                                      L->dw[W_QKV], dqkv, d.s, d.h, 3 * d.h);
  drop(dqkv);

  OK(r, glue_backward_begin(g, "attn_norm"));
  ofl_tensor_t *x = load(r, sv->x);
  x_rmsnorm_backward(r, F(dx), L->dw[W_G1], F(x), L->w[W_G1], F(dy1), d.s, d.h);
  drop(x);
  drop(dy1);
  backward_end(r, "attn_norm");
  return dx;
}

/* ---- messages between stages --------------------------------------------- */

#ifndef OFL_DEMO_NO_MPI
typedef struct {
  MPI_Request req;
  float *buf;
} pending_t;

static pending_t *pend;
static int npend, cappend;

static int tag_of(int mb, int vs, int dir, int nvs) {
  return ((mb * nvs + vs) * 2 + dir) % 32000;
}

static void send_tensor(run_t *r, const ofl_tensor_t *t, int dst, int tag) {
  size_t n = ofl_tensor_nelem(t);
  if (npend == cappend) {
    cappend = cappend ? cappend * 2 : 64;
    pend = realloc(pend, (size_t)cappend * sizeof *pend);
  }
  pending_t *p = &pend[npend++];
  p->buf = malloc(n * sizeof(float));
  if (p->buf == NULL)
    die(r, "out of host memory");
  memcpy(p->buf, dev_read(r, F(t), n, 0), n * sizeof(float));
  if (MPI_Isend(p->buf, (int)n, MPI_FLOAT, dst, tag, MPI_COMM_WORLD, &p->req))
    die(r, "MPI_Isend to rank %d failed", dst);
}

/* Receives with a deadline: a peer that died shows up as an error. */
static void recv_into(run_t *r, ofl_tensor_t *t, int src, int tag) {
  MPI_Request req;
  size_t n = ofl_tensor_nelem(t);
  float *buf = dev_stage(r, F(t), n, 0);
  if (MPI_Irecv(buf, (int)n, MPI_FLOAT, src, tag, MPI_COMM_WORLD, &req))
    die(r, "MPI_Irecv from rank %d failed", src);
  double deadline = now_s() + r->o->timeout_s;
  int done = 0;
  unsigned nap = 1;
  while (!done) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (done)
      break;
    if (now_s() > deadline)
      die(r, "no message from rank %d (tag %d) after %d s; is it alive?", src,
          tag, r->o->timeout_s);
    usleep(nap);
    if (nap < 500)
      nap *= 2;
  }
  dev_commit(r, F(t), buf, n);
}

static void complete_sends(run_t *r) {
  for (int i = 0; i < npend; i++) {
    double deadline = now_s() + r->o->timeout_s;
    int done = 0;
    while (!done) {
      MPI_Test(&pend[i].req, &done, MPI_STATUS_IGNORE);
      if (!done && now_s() > deadline)
        die(r, "a send did not complete after %d s", r->o->timeout_s);
      if (!done)
        usleep(100);
    }
    free(pend[i].buf);
  }
  npend = 0;
}
#else
/* Without MPI the other stages do not run: the message a stage would get
 * from virtual stage vs_from (dir 0: its output activation, dir 1: the
 * gradient of its input) for microbatch mb is generated from a seed naming
 * the three, the same in both runs. Gradients are scaled as the loss's
 * (1/elements). */
static void synth_message(run_t *r, ofl_tensor_t *t, int mb, int vs_from,
                          int dir) {
  size_t n = ofl_tensor_nelem(t);
  unsigned long long seed = 0x5EED000000ull ^
                            ((unsigned long long)(unsigned)mb << 20) ^
                            ((unsigned long long)(unsigned)vs_from << 2) ^
                            (unsigned long long)(unsigned)dir;
  x_fill(r, F(t), n, seed, dir == 0 ? 1.0f : 1.0f / (float)n);
}

static void complete_sends(run_t *r) { (void)r; }
#endif

/* ---- one iteration --------------------------------------------------------
 */

static void run_iteration(run_t *r, const sched_step_t *steps, int nsteps) {
  opts_t *o = r->o;
  dims_t d = r->d;
  int P = r->pp, V = o->vpp, nvs = P * V;
  for (int i = 0; i < nsteps; i++) {
    const sched_step_t *s = &steps[i];
    int vs = s->chunk * P + r->rank; /* global virtual stage */
    int mb = s->microbatch;
    layer_t *L = &r->layers[s->chunk * o->layers];
    saved_t *sv = &r->saved[((size_t)mb * V + s->chunk) * o->layers];
    if (s->forward) {
      ofl_tensor_t *x = act(r, d.s, d.h);
      if (vs == 0)
        x_fill(r, F(x), (size_t)d.s * d.h, 1000003ull * (unsigned)mb + 7,
               1.0f);
      else
#ifdef OFL_DEMO_NO_MPI
        synth_message(r, x, mb, vs - 1, 0);
#else
        recv_into(r, x, (r->rank + P - 1) % P, tag_of(mb, vs - 1, 0, nvs));
#endif
      OK(r, glue_chunk_begin(r->glue, V, s->chunk, mb));
      for (int l = 0; l < o->layers; l++)
        x = layer_forward(r, &L[l], &sv[l], x);
      if (vs == nvs - 1) {
        r->stage_out[mb] = x; /* loss = 0.5 * mean(y^2) at backward */
      } else {
#ifndef OFL_DEMO_NO_MPI
        send_tensor(r, x, (r->rank + 1) % P, tag_of(mb, vs, 0, nvs));
#endif
        drop(x);
      }
    } else {
      ofl_tensor_t *dy = act(r, d.s, d.h);
      if (vs == nvs - 1) {
        ofl_tensor_t *y = r->stage_out[mb];
        size_t n = (size_t)d.s * d.h;
        double loss = 0;
        const float *yh = dev_read(r, F(y), n, 0);
        float *dyh = dev_stage(r, F(dy), n, 1);
        for (size_t k = 0; k < n; k++) {
          loss += 0.5 * (double)yh[k] * (double)yh[k];
          dyh[k] = yh[k] / (float)n;
        }
        dev_commit(r, F(dy), dyh, n);
        r->losses[(size_t)r->iter * o->microbatches + mb] = loss / (double)n;
        drop(y);
        r->stage_out[mb] = NULL;
      } else {
#ifdef OFL_DEMO_NO_MPI
        synth_message(r, dy, mb, vs + 1, 1);
#else
        recv_into(r, dy, (r->rank + 1) % P, tag_of(mb, vs + 1, 1, nvs));
#endif
      }
      for (int l = o->layers - 1; l >= 0; l--)
        dy = layer_backward(r, &L[l], &sv[l], dy);
#ifndef OFL_DEMO_NO_MPI
      if (vs > 0)
        send_tensor(r, dy, (r->rank + P - 1) % P, tag_of(mb, vs, 1, nvs));
#endif
      drop(dy);
    }
    sample_memory(r);
  }
  complete_sends(r);
  OK(r, glue_iteration_end(r->glue));
  /* SGD step; gradients are kept for the comparison after the last step. */
  int nl = o->vpp * o->layers;
  for (int i = 0; i < nl; i++)
    for (int k = 0; k < NW; k++) {
      if (r->iter + 1 < o->iters) {
        layer_t *L = &r->layers[i];
        if (g_kc != NULL) {
          KC(r, g_kc->sgd(L->w[k], L->dw[k], L->n[k], 1e-3f, r->cs));
          continue;
        }
        for (size_t j = 0; j < L->n[k]; j++)
          L->w[k][j] -= 1e-3f * L->dw[k][j];
        memset(L->dw[k], 0, L->n[k] * sizeof(float));
      }
    }
  /* The step ends when the GPU finished it (the step time is measured on
   * the host). */
  if (g_kc != NULL)
    KC(r, g_kc->stream_sync(r->cs));
}

/* ---- a whole run ------------------------------------------------------------
 */

typedef struct {
  double step_s;        /* mean steady-state step time */
  size_t peak_bytes;    /* device peak over steady state */
  size_t summary_bytes; /* offload summary total (offload run) */
  glue_stats_t stats;
  unsigned char *state; /* losses, weights, gradients: for the comparison */
  size_t state_bytes;
  double *mem_t, *mem_b;
  size_t nmem;
  size_t gpu_used_peak; /* cuda: cudaMemGetInfo's largest total - free */
  uint64_t checksum;    /* FNV-1a of state (losses, weights, gradients) */
  int oom;            /* the run stopped: out of device memory (expected) */
  int oom_iter;       /* the iteration it happened in */
  char oom_msg[512];  /* ofl's message */
} result_t;

/* The iterations of a run; 1 when an allocation ran out of device memory
 * and the run expected it (expect_oom), 0 when all of them ran. The
 * setjmp is here so that run()'s own locals are not modified between it
 * and the longjmp. */
static int run_iterations(run_t *r, const sched_step_t *steps, int nsteps,
                          int offload, int expect_oom, double *steady,
                          int *nsteady) {
  opts_t *o = r->o;
  jmp_buf jb;
  if (expect_oom) {
    if (setjmp(jb) != 0) {
      g_oom_jump = NULL;
      return 1;
    }
    g_oom_jump = &jb;
  }
  for (r->iter = 0; r->iter < o->iters; r->iter++) {
    if (r->iter == 1 || o->iters == 1)
      ofl_pool_reset_peak(r->pool);
    if (offload && r->iter == (o->iters > 1 ? 1 : 0))
      maybe_die_at(o, r->rank, r->pp, "barrier");
    barrier_bounded("the barrier before an iteration");
    double t = now_s();
    run_iteration(r, steps, nsteps);
    barrier_bounded("the barrier after an iteration");
    t = now_s() - t;
    if (r->iter > 0 || o->iters == 1) {
      *steady += t;
      (*nsteady)++;
    }
#ifdef OFL_DEMO_NO_MPI
    if (!o->quiet && r->rank != r->pp - 1) {
      printf("[%s] iteration %d/%d%s  (stage %d: no loss)  step %.1f ms\n",
             offload ? "offload" : "baseline", r->iter + 1, o->iters,
             r->iter == 0 ? " (warmup)" : "", r->rank, t * 1e3);
      fflush(stdout);
    }
#endif
    if (!o->quiet && r->rank == r->pp - 1) {
      double l = 0;
      for (int m = 0; m < o->microbatches; m++)
        l += r->losses[(size_t)r->iter * o->microbatches + m];
      printf("[%s] iteration %d/%d%s  loss %.6f  step %.1f ms\n",
             offload ? "offload" : "baseline", r->iter + 1, o->iters,
             r->iter == 0 ? " (warmup)" : "", l / o->microbatches, t * 1e3);
      fflush(stdout);
    }
  }
  g_oom_jump = NULL;
  return 0;
}

/* One run, without or with offload. capacity: the device's capacity
 * (host backend; 0: OFL_DEVICE_CAPACITY). expect_oom: an allocation that
 * runs out of device memory ends the run (res->oom) instead of the
 * program. */
static void run(opts_t *o, int rank, int pp, int offload, size_t capacity,
                int expect_oom, result_t *res) {
  run_t r = {.o = o, .rank = rank, .pp = pp, .iter = 0,
             .pool_total_seen = SIZE_MAX};
  r.d = (dims_t){o->seq, o->hidden, 2 * o->hidden};
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = o->backend;
  dp.device_capacity_bytes = capacity;
  dp.link_h2d_gbps = o->link_gbps;
  dp.link_d2h_gbps = o->link_gbps;
  /* --trace traces the offload run; OFL_TRACE_FILE, as in any program,
   * traces every device the process opens (both runs; the library gives
   * the second one its own file). */
  if (o->trace != NULL) {
    if (offload)
      setenv("OFL_TRACE_FILE", o->trace, 1);
    else if (g_env_trace != NULL)
      setenv("OFL_TRACE_FILE", g_env_trace, 1);
    else
      unsetenv("OFL_TRACE_FILE");
  }
  if (g_kc != NULL)
    dp.device_index = o->gpu_ordinal;
  OK(&r, ofl_config_reload());
  OK(&r, ofl_device_open(&dp, &r.dev));
  if (g_kc != NULL) {
    /* The demo's own stream on the run's GPU, handed to ofl as this
     * thread's compute stream: offloads wait for the kernels queued on it
     * before copying, reloads are made visible to it. */
    KC(&r, g_kc->set_device(o->gpu_ordinal));
    KC(&r, g_kc->stream_create(&r.cs));
    OK(&r, ofl_stream_wrap_native(r.dev, r.cs, "demo compute", &r.ocs));
    if (!o->no_compute_stream)
      ofl_device_set_compute_stream(r.dev, r.ocs);
    g_ocs = r.ocs;
  }
  ofl_pool_params_t pp_ = OFL_POOL_PARAMS_INIT;
  pp_.kind = OFL_POOL_DEVICE;
  pp_.name = "activations";
  pp_.budget_bytes = 0;
  OK(&r, ofl_pool_create(r.dev, &pp_, &r.pool));
  int nl = o->vpp * o->layers;
  r.layers = calloc((size_t)nl, sizeof *r.layers);
  r.saved = calloc((size_t)o->microbatches * nl, sizeof *r.saved);
  r.stage_out = calloc((size_t)o->microbatches, sizeof *r.stage_out);
  r.losses = calloc((size_t)o->iters * o->microbatches, sizeof *r.losses);
  init_layers(&r, nl);

  glue_params_t gp = {.dev = r.dev,
                      .act_pool = r.pool,
                      .offload = offload,
                      .groups = o->offload_groups,
                      .min_bytes = o->min_offload_bytes,
                      .pp_rank = rank,
                      .pp_size = pp,
                      .mpi_comm = NULL,
                      .disk_groups = offload ? o->disk_groups : NULL,
                      .disk_dir = o->disk_dir};
#ifndef OFL_DEMO_NO_MPI
  MPI_Comm world = MPI_COMM_WORLD;
  gp.mpi_comm = &world;
#endif
  OK(&r, glue_open(&gp, &r.glue));

  sched_step_t *steps =
      calloc((size_t)2 * o->microbatches * o->vpp, sizeof *steps);
  int nsteps = sched_build(pp, rank, o->vpp, o->microbatches, steps);
  if (nsteps < 0)
    die(&r, "invalid schedule (vpp %d needs microbatches a multiple of %d)",
        o->vpp, pp);

  double steady = 0;
  int nsteady = 0;
  r.t0 = now_s();
  if (run_iterations(&r, steps, nsteps, offload, expect_oom, &steady,
                     &nsteady)) {
    /* Out of device memory in the middle of a step: the handles the
     * demo's code held go back to the pool; the manager destroys its own
     * at close. */
    res->oom = 1;
    res->oom_iter = r.iter;
    snprintf(res->oom_msg, sizeof res->oom_msg, "%s", g_oom_msg);
    while (g_nlive > 0)
      drop(g_live[g_nlive - 1]);
    for (int m = 0; m < o->microbatches; m++)
      r.stage_out[m] = NULL;
  }
  ofl_pool_stats_t ps;
  ofl_pool_get_stats(r.pool, &ps);
  res->peak_bytes = r.weight_bytes + ps.peak_in_use_bytes;
  res->step_s = steady / (nsteady ? nsteady : 1);
  res->summary_bytes = glue_summary_total_bytes(r.glue);
  glue_get_stats(r.glue, &res->stats);
  if (offload) {
#ifdef OFL_DEMO_NO_MPI
    /* The summary of this process's self comm has one row, "Rank 0": it is
     * this stage's, so it is printed under the stage's number. */
    char *text = NULL;
    size_t len = 0;
    FILE *mf = open_memstream(&text, &len);
    if (mf != NULL) {
      glue_print_summary(r.glue, mf);
      fclose(mf);
      char *row = text != NULL ? strstr(text, "\nRank 0 ") : NULL;
      if (row != NULL) {
        char label[32];
        int n = snprintf(label, sizeof label, "Rank %d", rank);
        char *p = row + 1 + 6; /* past "Rank 0" */
        int spare = 0;
        while (p[spare] == ' ')
          spare++;
        if (n - 6 < spare) {
          memmove(row + 1 + n, p + (n - 6), strlen(p + (n - 6)) + 1);
          memcpy(row + 1, label, (size_t)n);
        }
      }
      if (text != NULL)
        fputs(text, stdout);
      fflush(stdout);
      free(text);
    }
#else
    glue_print_summary(r.glue, stdout);
#endif
  }

  /* State for the comparison: losses, then every weight and gradient. */
  size_t bytes = (size_t)o->iters * o->microbatches * sizeof(double);
  for (int i = 0; i < nl; i++)
    for (int k = 0; k < NW; k++)
      bytes += 2 * r.layers[i].n[k] * sizeof(float);
  res->state = malloc(bytes);
  res->state_bytes = bytes;
  size_t off = 0;
  memcpy(res->state, r.losses,
         (size_t)o->iters * o->microbatches * sizeof(double));
  off += (size_t)o->iters * o->microbatches * sizeof(double);
  for (int i = 0; i < nl; i++)
    for (int k = 0; k < NW; k++) {
      size_t n = r.layers[i].n[k];
      memcpy(res->state + off, dev_read(&r, r.layers[i].w[k], n, 0),
             n * sizeof(float));
      off += n * sizeof(float);
      memcpy(res->state + off, dev_read(&r, r.layers[i].dw[k], n, 0),
             n * sizeof(float));
      off += n * sizeof(float);
    }
  res->gpu_used_peak = r.gpu_used_peak;
  /* FNV-1a of the state: what a comparison across invocations uses (the
   * --preset oom run on a GPU, which has no baseline of its own). */
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; i++)
    h = (h ^ res->state[i]) * 1099511628211ull;
  res->checksum = h;
  res->mem_t = r.mem_t;
  res->mem_b = r.mem_b;
  res->nmem = r.nmem;

  glue_close(r.glue);
  /* Everything queued on the demo's stream is done before its memory and
   * the stream go. */
  if (g_kc != NULL)
    KC(&r, g_kc->stream_sync(r.cs));
  for (int i = 0; i < nl; i++)
    for (int k = 0; k < NW; k++) {
      ofl_device_free(r.dev, r.layers[i].w[k]);
      ofl_device_free(r.dev, r.layers[i].dw[k]);
    }
  ofl_pool_destroy(r.pool);
  if (g_kc != NULL) {
    ofl_device_set_compute_stream(r.dev, NULL);
    ofl_stream_destroy(r.ocs);
    g_ocs = NULL;
    KC(&r, g_kc->stream_destroy(r.cs));
  }
  free(r.hbuf[0]);
  free(r.hbuf[1]);
  ofl_device_close(r.dev);
  free(steps);
  free(r.layers);
  free(r.saved);
  free(r.stage_out);
  free(r.losses);
}

/* ---- how far the memory saved may fall short of the summary --------------
 * The summary counts the bytes of every offloaded group of the chunks alive
 * at the first backward: what the offload takes off the device at the peak.
 * The measured saving (peak without offload - peak with) reaches it except
 * for the reloads issued ahead: each group_backward_end makes the H2D
 * stream reload the next OFL_PREFETCH_GROUPS groups in backward order
 * (default 1), and their device buffers are allocated while the current
 * group's backward still runs, that is at the moment of the peak, when the
 * run without offload holds the same groups too. So
 *   summary - prefetch_groups x (largest offloaded group) <= saved,
 * and saved <= summary: apart from the offloaded groups, both runs hold
 * the same tensors at the same points of the schedule. */

/* Bytes of the largest group the run offloads in one layer (each saved
 * tensor counted when its group is offloaded and it reaches the minimum
 * size, rounded up to the page as a pool block may be). */
static size_t largest_offloaded_group(const opts_t *o) {
  size_t s = (size_t)o->seq, h = (size_t)o->hidden, f = 2 * h;
  struct {
    const char *name;
    size_t elems[2];
  } groups[] = {{"attn_norm", {s * h, 0}},
                {"qkv_linear", {s * h, 0}},
                {"core_attn", {3 * s * h, s * s}},
                {"attn_proj", {s * h, 0}},
                {"mlp_norm", {s * h, 0}},
                {"expert_fc1", {s * h, 0}},
                {"moe_act", {s * f, 0}}};
  size_t best = 0;
  for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
    /* a whole name in the comma list */
    const char *p = o->offload_groups;
    size_t len = strlen(groups[g].name);
    int listed = 0;
    while (p != NULL && *p != '\0' && !listed) {
      listed = strncmp(p, groups[g].name, len) == 0 &&
               (p[len] == ',' || p[len] == '\0');
      p = strchr(p, ',');
      p = p != NULL ? p + 1 : NULL;
    }
    if (!listed)
      continue;
    size_t bytes = 0;
    for (int k = 0; k < 2; k++) {
      size_t b = groups[g].elems[k] * sizeof(float);
      if (b > 0 && b >= o->min_offload_bytes)
        bytes += (b + 4095) / 4096 * 4096;
    }
    if (bytes > best)
      best = bytes;
  }
  return best;
}

static int prefetch_groups_in_force(void) {
  const char *v = getenv("OFL_PREFETCH_GROUPS");
  int n = v != NULL ? atoi(v) : 1;
  return n >= 1 ? n : 1;
}

/* ---- reports
 * ------------------------------------------------------------------ */

#ifdef OFL_DEMO_NO_MPI
/* This process's samples only, under its stage number. */
static void write_memory_csv(const char *path, int rank, int pp,
                             const result_t *base, const result_t *off) {
  (void)pp;
  FILE *f = fopen(path, "w");
  if (f == NULL) {
    fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
    return;
  }
  fprintf(f, "rank,run,seconds,device_mib\n");
  const result_t *runs[2] = {base, off};
  for (int k = 0; k < 2; k++)
    for (size_t i = 0; i < runs[k]->nmem; i++)
      fprintf(f, "%d,%s,%.6f,%.3f\n", rank, k ? "offload" : "baseline",
              runs[k]->mem_t[i], runs[k]->mem_b[i] / 1048576.0);
  fclose(f);
}
#else
static void write_memory_csv(const char *path, int rank, int pp,
                             const result_t *base, const result_t *off) {
  /* Every rank's samples are gathered on rank 0: rank, run, t, MiB. */
  int counts[2] = {(int)base->nmem, (int)off->nmem};
  int *all = rank == 0 ? malloc(sizeof(int) * 2 * (size_t)pp) : NULL;
  MPI_Request req;
  if (MPI_Igather(counts, 2, MPI_INT, all, 2, MPI_INT, 0, MPI_COMM_WORLD,
                  &req) != MPI_SUCCESS)
    die(NULL, "MPI_Igather of the memory sample counts failed");
  wait_bounded(&req, "the gather of the memory sample counts");
  FILE *f = NULL;
  if (rank == 0) {
    f = fopen(path, "w");
    if (f == NULL)
      fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
    else
      fprintf(f, "rank,run,seconds,device_mib\n");
  }
  const result_t *runs[2] = {base, off};
  for (int k = 0; k < 2; k++) {
    int n = counts[k];
    double *buf = malloc(sizeof(double) * 2 * (size_t)(n ? n : 1));
    for (int i = 0; i < n; i++) {
      buf[2 * i] = runs[k]->mem_t[i];
      buf[2 * i + 1] = runs[k]->mem_b[i];
    }
    if (rank == 0) {
      for (int src = 0; src < pp; src++) {
        int m = all[2 * src + k];
        double *rb =
            src == 0 ? buf : malloc(sizeof(double) * 2 * (size_t)(m ? m : 1));
        if (src != 0) {
          if (MPI_Irecv(rb, 2 * m, MPI_DOUBLE, src, 900 + k, MPI_COMM_WORLD,
                        &req) != MPI_SUCCESS)
            die(NULL, "MPI_Irecv of rank %d's memory samples failed", src);
          wait_bounded(&req, "the receive of a rank's memory samples");
        }
        for (int i = 0; f && i < m; i++)
          fprintf(f, "%d,%s,%.6f,%.3f\n", src, k ? "offload" : "baseline",
                  rb[2 * i], rb[2 * i + 1] / 1048576.0);
        if (src != 0)
          free(rb);
      }
    } else {
      if (MPI_Isend(buf, 2 * n, MPI_DOUBLE, 0, 900 + k, MPI_COMM_WORLD, &req) !=
          MPI_SUCCESS)
        die(NULL, "MPI_Isend of the memory samples failed");
      wait_bounded(&req, "the send of the memory samples to rank 0");
    }
    free(buf);
  }
  if (f)
    fclose(f);
  free(all);
}
#endif

/* One plot per rank first .. first + pp - 1 of the CSV. */
static void render_png(const char *csv, const char *png, int first, int pp) {
  char script[4096];
  int n = snprintf(script, sizeof script,
                   "set terminal pngcairo size 1100,%d font 'sans,10'\n"
                   "set output '%s'\nset datafile separator ','\n"
                   "set multiplot layout %d,1 title 'ofl demo: device memory "
                   "per rank, without and with activation offload'\n",
                   260 * pp + 60, png, pp);
  for (int r = first; r < first + pp && n < (int)sizeof script - 400; r++)
    n += snprintf(
        script + n, sizeof script - (size_t)n,
        "set title 'rank %d'\nset yrange [0:*]\nset ylabel 'MiB "
        "allocated'\nset xlabel 'seconds into the run'\n"
        "plot '%s' using ($1==%d && strcol(2) eq 'baseline' ? $3 : 1/0):4 "
        "with lines lw 2 title 'without offload', "
        "'' using ($1==%d && strcol(2) eq 'offload' ? $3 : 1/0):4 "
        "with lines lw 2 title 'with offload'\n",
        r, csv, r, r);
  snprintf(script + n, sizeof script - (size_t)n, "unset multiplot\n");
  FILE *g = popen("gnuplot 2>&1", "w");
  if (g == NULL) {
    fprintf(stderr, "gnuplot not available; no PNG written\n");
    return;
  }
  fputs(script, g);
  if (pclose(g) != 0)
    fprintf(stderr, "gnuplot failed; no PNG written (is gnuplot installed?)\n");
}

/* ---- the backend and --preset oom ----------------------------------------- */

/* Opens a device as the runs will (--backend, OFL_BACKEND), says on the
 * first line which backend and why, and resolves o->backend to it. The
 * demo's arithmetic runs on the CPU: the cuda backend would need the GPU
 * kernels, which this demo does not run (see --help), so an explicit cuda
 * fails here and auto falls back to the host backend, saying so. *capacity
 * is the device's capacity (0: unlimited). Returns 0, or 2 after a message. */
/* Loads the demo's GPU module (kernels_cuda.h): OFL_DEMO_KERNELS_CUDA, else
 * next to the executable, else the loader's path. NULL with the reason in
 * why. Called after a cuda device was opened, so that the module's
 * libcudart.so.13 is the runtime ofl loaded. */
static const kc_api_t *load_kernels(char *why, size_t why_bytes) {
  if (!DEMO_CUDA_KERNELS_COMPILED) {
    snprintf(why, why_bytes,
             "they are not compiled into this build (no CUDA toolkit with "
             "nvcc found at setup)");
    return NULL;
  }
  char path[4096];
  const char *env = getenv("OFL_DEMO_KERNELS_CUDA");
  const char *tried = NULL;
  void *h = NULL;
  if (env != NULL && env[0] != '\0') {
    tried = env;
    h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
  } else {
    char exe[3072];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      exe[n] = '\0';
      char *slash = strrchr(exe, '/');
      if (slash != NULL)
        *slash = '\0';
      snprintf(path, sizeof path, "%s/libofl_demo_kernels_cuda.so", exe);
      tried = path;
      h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (h == NULL) {
      tried = "libofl_demo_kernels_cuda.so";
      h = dlopen(tried, RTLD_NOW | RTLD_LOCAL);
    }
  }
  if (h == NULL) {
    const char *e = dlerror();
    snprintf(why, why_bytes,
             "the module of the GPU kernels did not load (%.200s: %.300s); "
             "set OFL_DEMO_KERNELS_CUDA to its path",
             tried ? tried : "?", e ? e : "unknown error");
    return NULL;
  }
  const kc_api_t *(*get)(void) = NULL;
  void *sym = dlsym(h, KC_API_SYMBOL);
  if (sym != NULL) /* ISO C has no object-to-function pointer cast */
    memcpy(&get, &sym, sizeof get);
  const kc_api_t *api = get != NULL ? get() : NULL;
  if (api == NULL || api->version != KC_API_VERSION) {
    snprintf(why, why_bytes, "%.300s is not this demo's module of GPU kernels",
             tried);
    /* not closed: get() may have registered emulations that point into it */
    return NULL;
  }
  g_kc_module = h;
  return api;
}

/* Resolves --backend: opens a device as the runs will (auto: cuda when a
 * GPU is usable), and on cuda loads the GPU kernels, without which the
 * demo cannot compute there (auto then falls back to the host backend,
 * saying why; an explicit cuda fails). Prints the first line. */
static int choose_backend(opts_t *o, int leader, size_t *capacity) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = o->backend;
  ofl_device_t *dev = NULL;
  ofl_status_t st = ofl_device_open(&dp, &dev);
  if (st != OFL_SUCCESS) {
    if (leader)
      fprintf(stderr, DEMO_NAME ": cannot open a %s device: %s (%s)\n",
              ofl_backend_name(o->backend), ofl_status_str(st),
              ofl_last_error());
    return 2;
  }
  ofl_backend_t got = ofl_device_backend(dev);
  char why[400];
  snprintf(why, sizeof why, "%s", ofl_device_selection_reason(dev));
  ofl_device_stats_t ds;
  ofl_device_get_stats(dev, &ds);
  *capacity = ds.device_capacity_bytes;
  int explicit_ = why[0] == '\0'; /* --backend or OFL_BACKEND named it */
  if (got == OFL_BACKEND_CUDA) {
    /* the GPU ofl chose (device_index, OFL_DEVICE, the current device):
     * the runs open it again and the kernels run on it */
    o->gpu_ordinal = ofl_device_ordinal(dev);
    char kwhy[600];
    const kc_api_t *kc = load_kernels(kwhy, sizeof kwhy);
    ofl_device_close(dev);
    if (kc == NULL && explicit_) {
      if (leader)
        fprintf(stderr,
                DEMO_NAME ": the cuda backend needs the demo's GPU kernels: "
                          "%s. Use --backend host or auto.\n",
                kwhy);
      return 2;
    }
    if (kc == NULL) {
      if (leader)
        printf("ofl pipeline demo: backend host (%s, but the demo's GPU "
               "kernels cannot be used: %s)\n",
               why, kwhy);
      o->backend = OFL_BACKEND_HOST;
      dp.backend = OFL_BACKEND_HOST;
      if (ofl_device_open(&dp, &dev) == OFL_SUCCESS) {
        ofl_device_get_stats(dev, &ds);
        *capacity = ds.device_capacity_bytes;
        ofl_device_close(dev);
      }
      return 0;
    }
    g_kc = kc;
    if (leader)
      printf("ofl pipeline demo: backend cuda (%s); the layer arithmetic "
             "runs as GPU kernels on the demo's own stream%s\n",
             explicit_ ? (o->backend == OFL_BACKEND_CUDA ? "--backend cuda"
                                                         : "OFL_BACKEND names it")
                       : why,
             kc->emulated ? " (here the test stand-in of the CUDA runtime, "
                            "which runs their CPU emulation)"
                          : "");
    o->backend = OFL_BACKEND_CUDA;
    return 0;
  }
  ofl_device_close(dev);
  if (leader)
    printf("ofl pipeline demo: backend %s (%s)\n", ofl_backend_name(got),
           explicit_ ? (o->backend == OFL_BACKEND_HOST
                            ? "--backend host"
                            : "OFL_BACKEND names it")
                     : why);
  o->backend = got;
  return 0;
}

/* Device bytes of one run, estimated for --preset oom (4-byte floats):
 * weights and gradients, 2 x (8h^2 + 2h) per layer; saved per layer and
 * microbatch, 10sh + s^2 (x, y1, qkv 3sh, probs s^2, a, x2, y2, u 2sh);
 * without offload `inflight` microbatches keep all their layers' saved
 * tensors at the peak, with offload about two layers' worth remain (the
 * layer computing, its transients and the prefetched group). On the host
 * backend the offload estimate came out 10-25% above the measured peak and
 * the baseline's 3-5% below. */
static double est_weights(double h, double layers) {
  return layers * 2 * (8 * h * h + 2 * h) * 4;
}
static double est_saved_layer(double s, double h) {
  return (10 * s * h + s * s) * 4;
}

/* Sets the model of --preset oom from the device capacity: seq = 8 x
 * hidden (activations outweigh weights), 1F1B, 2P microbatches, enough
 * layers that the baseline's peak holds 8 layers' saved tensors (layers x
 * microbatches in flight), and hidden as large as keeps the offload run's
 * estimate within 60% of the capacity. Returns 0, or 2 after a message. */
static int size_preset_oom(opts_t *o, int rank, int pp, size_t capacity,
                           int leader) {
  if (capacity == 0) {
    if (leader)
      fprintf(stderr,
              DEMO_NAME ": --preset oom needs a device capacity: on the host "
                        "backend set OFL_DEVICE_CAPACITY (e.g. 8M)\n");
    return 2;
  }
  double cap = (double)capacity;
  int inflight = pp - rank; /* 1F1B: microbatches alive at the peak */
  o->vpp = 1;
  o->microbatches = 2 * pp;
  if (inflight > o->microbatches)
    inflight = o->microbatches;
  /* Layers first: at least 8 layers' worth of saved tensors at the
   * baseline's peak against about 2 with offload. */
  int layers = (8 + inflight - 1) / inflight;
  if (layers < 2)
    layers = 2;
  int h = 0;
  for (int c = 8; c <= 512; c += 8)
    if (est_weights(c, layers) + 2 * est_saved_layer(8.0 * c, c) <=
        0.6 * cap)
      h = c;
  if (h == 0)
    h = 8;
  double s = 8.0 * h;
  o->hidden = h;
  o->seq = 8 * h;
  o->layers = layers;
  double base = est_weights(h, layers) +
                (double)inflight * layers * est_saved_layer(s, h);
  double offl = est_weights(h, layers) + 2 * est_saved_layer(s, h);
  if (leader)
    printf("preset oom: device capacity %.2f MiB; hidden %d, seq %d, %d "
           "layer(s), %d microbatches, %d in flight on stage %d: estimated "
           "peak %.2f MiB without offload, %.2f MiB with\n",
           cap / 1048576, o->hidden, o->seq, o->layers, o->microbatches,
           inflight, rank, base / 1048576, offl / 1048576);
  if (base <= 1.25 * cap || offl > 0.6 * cap) {
    if (leader)
      fprintf(stderr,
              DEMO_NAME ": --preset oom: no model of this shape fits with "
                        "offload and not without on stage %d (capacity "
                        "%.2f MiB): use an earlier stage, more stages or "
                        "another capacity\n",
              rank, cap / 1048576);
    return 2;
  }
  return 0;
}

#ifdef OFL_DEMO_NO_MPI
#define DEMO_FINALIZE() ((void)0)
#else
#define DEMO_FINALIZE() MPI_Finalize()
#endif

int main(int argc, char **argv) {
  int rank = 0, pp = 1;
#ifndef OFL_DEMO_NO_MPI
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &pp);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  ofl_log_set_rank(rank);
  g_rank = rank;
#endif
  if (getenv("OFL_TRACE_FILE") != NULL)
    g_env_trace = strdup(getenv("OFL_TRACE_FILE"));
  opts_t o;
  int pr = parse_opts(argc, argv, &o, rank);
  g_timeout_s = o.timeout_s;
  if (pr != 0) {
    DEMO_FINALIZE();
    return pr > 0 ? 0 : 2;
  }
  /* The ranks this process reports: all of them on rank 0 under MPI, its
   * own stage without MPI. */
  int leader = rank == 0, rep_first = 0, rep_n = pp;
#ifdef OFL_DEMO_NO_MPI
  if (o.stage >= o.stages) {
    fprintf(stderr, DEMO_NAME ": --stage %d is not a stage of --stages %d\n",
            o.stage, o.stages);
    return 2;
  }
  rank = o.stage;
  pp = o.stages;
  ofl_log_set_rank(rank);
  g_rank = rank;
  leader = 1;
  rep_first = rank;
  rep_n = 1;
#endif
  if (o.vpp > 1 && o.microbatches % pp != 0) {
    if (leader)
      fprintf(stderr,
              DEMO_NAME ": interleaved 1F1B (--vpp %d) needs "
              "--microbatches to be a multiple of the %d ranks\n",
              o.vpp, pp);
    DEMO_FINALIZE();
    return 2;
  }
  size_t capacity = 0;
  if (choose_backend(&o, leader, &capacity) != 0) {
    DEMO_FINALIZE();
    return 2;
  }
#ifdef OFL_DEMO_NO_MPI
  if (!o.quiet)
    printf("ofl pipeline demo (one process, no MPI): stage %d of %d; the "
           "other stages' messages are generated from a seed\n",
           rank, pp);
#endif
  if (o.preset_oom) {
#ifndef OFL_DEMO_NO_MPI
    if (pp != 1) {
      if (leader)
        fprintf(stderr, DEMO_NAME ": --preset oom runs on one rank (mpirun "
                                  "-n 1), or use ofl_pipeline_demo_single "
                                  "--stage S --stages P\n");
      DEMO_FINALIZE();
      return 2;
    }
#endif
    if (size_preset_oom(&o, rank, pp, capacity, leader) != 0) {
      DEMO_FINALIZE();
      return 2;
    }
  }
  if (leader && !o.quiet)
    printf("ofl pipeline demo: %d stage(s), %s, vpp %d, %d microbatches, %d "
           "layer(s) per stage, hidden %d, seq %d, %d iterations\n"
           "offloading groups: %s (tensors >= %zu bytes); %s backend%s\n",
           pp, o.vpp > 1 ? "interleaved 1F1B" : "1F1B", o.vpp, o.microbatches,
           o.layers, o.hidden, o.seq, o.iters, o.offload_groups,
           o.min_offload_bytes, ofl_backend_name(o.backend),
           o.link_gbps > 0 ? ", emulated host link" : "");

  result_t base = {0}, off = {0}, oom = {0};
  int oom_fail = 0, no_compare = 0;
  if (o.preset_oom) {
    /* The baseline under the capacity must run out of device memory; the
     * offload run must fit; the bit-identity check compares it with a
     * baseline run without the capacity (the host backend's, so the same
     * arithmetic), whose peak is the report's peak_base. */
    run(&o, rank, pp, 0, 0, 1, &oom);
    if (oom.oom) {
      if (leader)
        printf("[baseline] out of device memory at iteration %d/%d, as "
               "expected without offload (capacity %.2f MiB): %s\n",
               oom.oom_iter + 1, o.iters, (double)capacity / 1048576,
               oom.oom_msg);
    } else {
      oom_fail = 1;
      if (leader)
        printf("[baseline] did NOT run out of device memory (peak %.2f MiB, "
               "capacity %.2f MiB): --preset oom sized the model wrong\n",
               (double)oom.peak_bytes / 1048576, (double)capacity / 1048576);
    }
    run(&o, rank, pp, 1, 0, 0, &off);
    if (leader)
      printf("[offload] trained under the capacity: peak %.2f MiB of %.2f "
             "MiB\n",
             (double)off.peak_bytes / 1048576, (double)capacity / 1048576);
    if (o.backend == OFL_BACKEND_HOST) {
      run(&o, rank, pp, 0, (size_t)1 << 50, 0, &base);
      if (leader)
        printf("[baseline] without the capacity (the reference of the "
               "comparison): peak %.2f MiB\n",
               (double)base.peak_bytes / 1048576);
      free(oom.state);
      free(oom.mem_t);
      free(oom.mem_b);
    } else {
      /* A GPU has no baseline without its capacity: the comparison is the
       * plain runs' (without --preset oom); the report's baseline is the
       * run that ran out of memory. */
      no_compare = 1;
      free(oom.state);
      oom.state = NULL;
      oom.state_bytes = 0;
      base = oom;
    }
  } else {
    run(&o, rank, pp, 0, 0, 0, &base);
    run(&o, rank, pp, 1, 0, 0, &off);
  }

  /* Bit-identical: count differing bytes on each rank, sum over ranks. */
  long long diff = no_compare                           ? 0
                   : base.state_bytes != off.state_bytes ? -1
                                                         : 0;
  for (size_t i = 0; !no_compare && diff >= 0 && i < base.state_bytes; i++)
    diff += base.state[i] != off.state[i];
  long long diff_all = 0, bad_ranks = 0, bad = diff != 0;
  maybe_die_at(&o, rank, pp, "reduce");
#ifdef OFL_DEMO_NO_MPI
  diff_all = diff;
  bad_ranks = bad;
#else
  MPI_Request req;
  if (MPI_Ireduce(&diff, &diff_all, 1, MPI_LONG_LONG, MPI_SUM, 0,
                  MPI_COMM_WORLD, &req) != MPI_SUCCESS)
    die(NULL, "MPI_Ireduce of the differing bytes failed");
  wait_bounded(&req, "the reduction of the differing bytes");
  if (MPI_Ireduce(&bad, &bad_ranks, 1, MPI_LONG_LONG, MPI_SUM, 0,
                  MPI_COMM_WORLD, &req) != MPI_SUCCESS)
    die(NULL, "MPI_Ireduce of the differing ranks failed");
  wait_bounded(&req, "the reduction of the differing ranks");
#endif

  /* Per-rank figures, printed by rank 0 in rank order. */
  enum { NF = 21 };
  const glue_stats_t *os = &off.stats;
  double mine[NF] = {(double)base.peak_bytes,
                     (double)off.peak_bytes,
                     (double)off.summary_bytes,
                     (double)os->offloaded_bytes,
                     (double)os->reloaded_bytes,
                     (double)os->stalls,
                     os->stall_ms,
                     base.step_s,
                     off.step_s,
                     (double)os->inline_reloads,
                     (double)os->offloaded_tensors,
                     (double)os->kept_on_device,
                     (double)os->disk,
                     (double)os->disk_written,
                     (double)os->disk_read,
                     os->disk_write_gbps,
                     os->disk_read_gbps,
                     (double)os->disk_prefetch_hits + (double)os->disk_stalls,
                     (double)os->disk_faults,
                     (double)os->disk_keep_hits,
                     (double)prefetch_groups_in_force() *
                         (double)largest_offloaded_group(&o)};
  double *all = leader ? malloc(sizeof mine * (size_t)rep_n) : NULL;
#ifdef OFL_DEMO_NO_MPI
  memcpy(all, mine, sizeof mine);
#else
  if (MPI_Igather(mine, NF, MPI_DOUBLE, all, NF, MPI_DOUBLE, 0, MPI_COMM_WORLD,
                  &req) != MPI_SUCCESS)
    die(NULL, "MPI_Igather of the per-rank figures failed");
  wait_bounded(&req, "the gather of the per-rank figures");
#endif
  int mem_fail = 0, mem_equal = 0, mem_short = 0;
  if (leader) {
    printf("\n%-6s %12s %12s %12s %12s %8s %12s %12s %8s %8s %10s %10s\n",
           "rank", "peak_base", "peak_offl", "saved_MiB", "summary_MiB",
           "saved/sum", "offl_MiB", "reload_MiB", "stalls", "stall_ms",
           "step_base", "step_offl");
    for (int i = 0; i < rep_n; i++) {
      double *v = &all[NF * i];
      double saved = v[0] - v[1];
      double ratio = v[2] > 0 ? saved / v[2] : (saved == 0 ? 1.0 : 0.0);
      printf("%-6d %10.2fMi %10.2fMi %12.2f %12.2f %8.3f %12.2f %12.2f %8.0f "
             "%8.2f %8.1fms %8.1fms\n",
             rep_first + i, v[0] / 1048576, v[1] / 1048576, saved / 1048576, v[2] / 1048576,
             ratio, v[3] / 1048576, v[4] / 1048576, v[5], v[6], v[7] * 1e3,
             v[8] * 1e3);
    }
    /* The check of the bound above largest_offloaded_group, saying for
     * each rank whether and why the saving differs from the summary. */
    printf("\n");
    for (int i = 0; i < rep_n && !no_compare; i++) {
      double *v = &all[NF * i];
      double saved = v[0] - v[1], sum = v[2], bound = v[20];
      double slack = o.mem_tolerance * sum;
      if (saved == sum) {
        mem_equal++;
      } else if (saved < sum && saved >= sum - bound - slack) {
        mem_short++;
        printf("rank %d: saved %.2f MiB, %.2f MiB less than the summary's "
               "%.2f MiB: at the peak the group(s) prefetched for the next "
               "backward step are already back on the device (bound: %d x "
               "%.2f MiB, the largest offloaded group)\n",
               rep_first + i, saved / 1048576, (sum - saved) / 1048576,
               sum / 1048576,
               prefetch_groups_in_force(),
               bound / 1048576 / prefetch_groups_in_force());
      } else if (saved <= sum + slack && saved >= sum - bound - slack) {
        mem_equal++; /* above the summary, within --mem-tolerance */
      } else {
        mem_fail++;
        printf("rank %d: saved %.2f MiB is OUTSIDE [summary - prefetch "
               "bound, summary] = [%.2f, %.2f] MiB\n",
               rep_first + i, saved / 1048576, (sum - bound) / 1048576,
               sum / 1048576);
      }
    }
    if (all[12] > 0) {
      printf("\ndisk tier (%s):\n%-6s %12s %12s %10s %10s %10s %10s %8s\n",
             o.disk_groups, "rank", "written_MiB", "read_MiB", "write_GB/s",
             "read_GB/s", "reloads", "from_kept", "faults");
      for (int i = 0; i < rep_n; i++) {
        double *v = &all[NF * i];
        printf("%-6d %12.2f %12.2f %10.2f %10.2f %10.0f %10.0f %8.0f\n",
               rep_first + i,
               v[13] / 1048576, v[14] / 1048576, v[15], v[16], v[17], v[19],
               v[18]);
      }
      printf("# from_kept: reloads served by bounce buffers kept after their "
             "write (OFL_DISK_KEEP), without a read\n");
    }
    double sb = 0, so = 0;
    for (int i = 0; i < rep_n; i++) {
      sb += all[NF * i + 7];
      so += all[NF * i + 8];
    }
    if (no_compare) {
      printf("\nstep time and device memory saved: not compared (the "
             "baseline ran out of memory before its steady state)\n");
    } else {
      printf("\nstep time with offload / without: %.3f (mean over ranks, "
             "steady-state iterations)\n",
             so / sb);
      printf("device memory saved against the summary: equal on %d, short "
             "by the prefetched group(s) on %d, outside the bound on %d of "
             "%d rank(s)\n",
             mem_equal, mem_short, mem_fail, rep_n);
    }
    if (g_kc != NULL)
      printf("GPU memory in use at the peak (cudaMemGetInfo, rank 0's GPU, "
             "all of its users): %.2f MiB without offload, %.2f MiB with\n",
             (double)base.gpu_used_peak / 1048576,
             (double)off.gpu_used_peak / 1048576);
    /* this process's state (its stage; rank 0's under MPI) */
    if (no_compare)
      printf("state checksum (losses, weights, gradients) of this stage: "
             "offload %016llx\n",
             (unsigned long long)off.checksum);
    else
      printf("state checksum (losses, weights, gradients) of this stage: "
             "baseline %016llx, offload %016llx\n",
             (unsigned long long)base.checksum,
             (unsigned long long)off.checksum);
    if (no_compare)
      printf("bit-identical losses, weights and gradients with and without "
             "offload: not checked here (--preset oom on a GPU has no "
             "baseline that fits; compare the checksum with a run of the "
             "same model without --preset oom on a larger GPU)\n");
    else
      printf("bit-identical losses, weights and gradients with and without "
             "offload: %s (%lld differing bytes on %lld rank(s))\n",
             diff_all == 0 ? "yes" : "NO", diff_all, bad_ranks);
    fflush(stdout);
  }
  /* The PNG is drawn from the CSV: without --memory-csv, the CSV is
   * written next to the PNG (x.png -> x.csv). */
  char csv_path[1024];
  const char *csv = o.csv;
  if (csv == NULL && o.png != NULL) {
    size_t n = strlen(o.png);
    int ext = n > 4 && strcmp(o.png + n - 4, ".png") == 0;
    snprintf(csv_path, sizeof csv_path, "%.*s.csv", (int)(ext ? n - 4 : n),
             o.png);
    csv = csv_path;
  }
  if (csv != NULL) {
    write_memory_csv(csv, rank, pp, &base, &off);
    if (leader && o.png)
      render_png(csv, o.png, rep_first, rep_n);
  }
  int fail = 0;
  if (leader)
    fail = diff_all != 0 || (o.check_memory && mem_fail > 0) || oom_fail;
#ifndef OFL_DEMO_NO_MPI
  if (MPI_Ibcast(&fail, 1, MPI_INT, 0, MPI_COMM_WORLD, &req) != MPI_SUCCESS)
    die(NULL, "MPI_Ibcast of the verdict failed");
  wait_bounded(&req, "the broadcast of the verdict");
#endif
  free(all);
  free(base.state);
  free(off.state);
  free(base.mem_t);
  free(base.mem_b);
  free(off.mem_t);
  free(off.mem_b);
  DEMO_FINALIZE();
  return fail ? 1 : 0;
}
