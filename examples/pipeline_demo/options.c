/* ofl pipeline demo: the command line (--help's text and its parser). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"

/* Two strings: ISO C caps a literal at 4095 characters. */
static const char *const usage_text[2] = {
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
    "                      expert_fc1,moe_act, or 'all' [all]; 'auto': ofl\n"
    "                      chooses them at the end of the warmup (groups\n"
    "                      \"auto\") to meet --memory-target at the least\n"
    "                      predicted exposed copy time, and prints its plan\n"
    "                      after the summary\n"
    "  --memory-target MIB with --offload auto: the activation MiB each rank\n"
    "                      may keep on the device at its peak (params.\n"
    "                      memory_target_bytes; 0: none) [OFL_MEMORY_TARGET]\n"
    "  --device-memory-target MIB  with --offload auto: the device MiB each\n"
    "                      rank's step may use at its peak, weights and\n"
    "                      workspace included; the warmup measures what is\n"
    "                      not activations and the plan gets the rest (params.\n"
    "                      device_memory_target_bytes; the tighter target\n"
    "                      wins) [OFL_DEVICE_MEMORY_TARGET]\n"
    "  --offload-fraction F  of each chunk's offloaded groups, the fraction\n"
    "                      kept offloaded after warmup (params.fraction, as\n"
    "                      Megatron's activation_offload_fraction; not with\n"
    "                      auto) [OFL_OFFLOAD_FRACTION]\n"
    "  --min-offload-bytes B  smallest tensor offloaded [4096]\n"
    ,
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
    "                      saved <= summary on every rank (see the report);\n"
    "                      with --offload auto and --memory-target: fail\n"
    "                      unless every rank's measured activation peak (the\n"
    "                      plan's, and the demo's own: pool bytes in use less\n"
    "                      its tensors that are not saved activations) is\n"
    "                      within its target\n"
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
    "  --recompute         with --offload auto: the plan may also recompute\n"
    "                      any group (its backward reruns the group's forward\n"
    "                      from an input that stays on the device: the\n"
    "                      norms' outputs from the residual, the attention\n"
    "                      from qkv, the MLP's first product from its input)\n"
    "                      where that costs less than an offload\n"
    "  --recompute-modules LIST  the offload run recomputes these groups in\n"
    "                      every iteration, whatever the plan (a fixed\n"
    "                      selective recompute, as Megatron's\n"
    "                      --recompute-modules); 'full': every layer keeps\n"
    "                      only its input and reruns its whole forward in\n"
    "                      backward (full recompute) [none]\n"
    "  --quiet             no progress lines\n"
    "  --help              this text\n"};

static void usage(FILE *f) {
  fputs(usage_text[0], f);
  fputs(usage_text[1], f);
}

const char *const demo_group_names[7] = {"attn_norm",  "qkv_linear",
                                         "core_attn",  "attn_proj",
                                         "mlp_norm",   "expert_fc1",
                                         "moe_act"};

/* A comma list of the layer's group names: a misspelt one would offload
 * nothing of its group, and the run would still compare equal; refused
 * here, naming the closest of the seven. what: the option. */
static int check_groups(const char *what, const char *list, int rank) {
  const char *p = list;
  while (p != NULL && *p != '\0') {
    size_t len = strcspn(p, ",");
    int known = 0;
    for (int g = 0; g < 7 && !known; g++)
      known = strlen(demo_group_names[g]) == len &&
              strncmp(p, demo_group_names[g], len) == 0;
    if (!known) {
      if (rank == 0) {
        /* the closest name: most characters in common at the same place
         * after '-' is read as '_' (core-attn) */
        int best = 0, best_score = -1;
        for (int g = 0; g < 7; g++) {
          int score = 0;
          for (size_t k = 0; k < len && demo_group_names[g][k]; k++)
            score += (p[k] == '-' ? '_' : p[k]) == demo_group_names[g][k];
          if (score > best_score) {
            best = g;
            best_score = score;
          }
        }
        fprintf(stderr,
                DEMO_NAME ": %s: unknown group '%.*s'%s%s%s; the groups are "
                "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,"
                "expert_fc1,moe_act (or all)\n",
                what, (int)len, p, best_score > 0 ? " (did you mean " : "",
                best_score > 0 ? demo_group_names[best] : "",
                best_score > 0 ? "?)" : "");
      }
      return -1;
    }
    p += len;
    p = *p == ',' ? p + 1 : p;
  }
  return 0;
}

/* The bits of the names in a checked comma-separated list
 * (demo_group_names order). */
static unsigned group_mask(const char *list) {
  unsigned m = 0;
  for (const char *p = list; *p != '\0';) {
    size_t len = strcspn(p, ",");
    for (int g = 0; g < 7; g++)
      if (strlen(demo_group_names[g]) == len &&
          strncmp(p, demo_group_names[g], len) == 0)
        m |= 1u << g;
    p += len + (p[len] == ',');
  }
  return m;
}

static int parse_int(const char *s, int lo, int hi, int *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi)
    return -1;
  *out = (int)v;
  return 0;
}

int parse_opts(int argc, char **argv, opts_t *o, int rank) {
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
                .memory_target_mib = -1,
                .device_memory_target_mib = -1,
                .fraction = -1,
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
    } else if (strcmp(a, "--memory-target") == 0 && v) {
      char *end = NULL;
      o->memory_target_mib = strtod(v, &end);
      bad = end == v || *end != '\0' || !(o->memory_target_mib >= 0);
      i++;
    } else if (strcmp(a, "--device-memory-target") == 0 && v) {
      char *end = NULL;
      o->device_memory_target_mib = strtod(v, &end);
      bad = end == v || *end != '\0' || !(o->device_memory_target_mib >= 0);
      i++;
    } else if (strcmp(a, "--offload-fraction") == 0 && v) {
      char *end = NULL;
      o->fraction = strtod(v, &end);
      bad = end == v || *end != '\0' ||
            !(o->fraction >= 0 && o->fraction <= 1);
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
    } else if (strcmp(a, "--recompute") == 0) {
      o->recompute = 1;
    } else if (strcmp(a, "--recompute-modules") == 0 && v) {
      if (strcmp(v, "full") == 0)
        o->recompute_full = 1;
      else if (check_groups("--recompute-modules", v, rank) != 0)
        return -1;
      else
        o->recompute_fixed = group_mask(v);
      i++;
    } else if (strcmp(a, "--quiet") == 0) {
      o->quiet = 1;
    } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      if (rank == 0)
        usage(stdout);
      return 1;
    } else {
      bad = 1;
    }
  next:
    if (bad) {
      if (rank == 0)
      {
        fprintf(stderr, DEMO_NAME ": bad or incomplete option '%s'\n", a);
        usage(stderr);
      }
      return -1;
    }
  }
  o->offload_auto = strcmp(o->offload_groups, "auto") == 0;
  if ((o->recompute_fixed || o->recompute_full) && o->recompute) {
    if (rank == 0)
      fprintf(stderr, DEMO_NAME ": --recompute-modules fixes what is "
                      "recomputed; --recompute lets the plan choose: one or "
                      "the other\n");
    return -1;
  }
  if (o->device_memory_target_mib >= 0 && !o->offload_auto) {
    if (rank == 0)
      fprintf(stderr, DEMO_NAME ": --device-memory-target needs --offload auto "
                      "(the plan that meets it)\n");
    return -1;
  }
  if (o->memory_target_mib >= 0 && !o->offload_auto) {
    if (rank == 0)
      fprintf(stderr, DEMO_NAME ": --memory-target needs --offload auto (the "
                      "plan that meets it); a configured group list ignores "
                      "it\n");
    return -1;
  }
  if (o->fraction >= 0 && o->offload_auto) {
    if (rank == 0)
      fprintf(stderr, DEMO_NAME ": --offload-fraction is not for --offload "
                      "auto (the plan decides what stays); use "
                      "--memory-target\n");
    return -1;
  }
  /* auto: every name is offloaded in the warmup (the prefetch bound and
   * the banner list them all); the manager is told "auto". */
  if (strcmp(o->offload_groups, "all") == 0 || o->offload_auto)
    snprintf(o->offload_groups, sizeof o->offload_groups,
             "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,expert_fc1,"
             "moe_act");
  if (check_groups("--offload", o->offload_groups, rank) != 0 ||
      (o->disk_groups != NULL &&
       check_groups("--disk-groups", o->disk_groups, rank) != 0))
    return -1;
  return 0;
}
