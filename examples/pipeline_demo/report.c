/* ofl pipeline demo: the report. How far the device memory saved may fall
 * short of the offload summary, the device memory of both runs over time
 * (CSV, PNG through gnuplot). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"

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
size_t largest_offloaded_group(const opts_t *o) {
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

int prefetch_groups_in_force(void) {
  const char *v = getenv("OFL_PREFETCH_GROUPS");
  int n = v != NULL ? atoi(v) : 1;
  return n >= 1 ? n : 1;
}

/* ---- the memory curves ----------------------------------------------------
 * CSV: rank,run,seconds,device_mib,steady_seconds: seconds since the run
 * began, and since its steady state began (iteration 2; the warmup is
 * negative), so that the two runs of a rank line up where their steady
 * states start whatever their warmups took. */

static void csv_row(FILE *f, int rank, int k, const double *s) {
  fprintf(f, "%d,%s,%.6f,%.3f,%.6f\n", rank, k ? "offload" : "baseline", s[0],
          s[1] / 1048576.0, s[2]);
}

/* Samples of one run as (t, bytes, t - steady start) triplets. */
static double *samples(const result_t *res) {
  double *buf = malloc(sizeof(double) * 3 * (res->nmem ? res->nmem : 1));
  if (buf == NULL)
    die(NULL, "out of host memory");
  for (size_t i = 0; i < res->nmem; i++) {
    buf[3 * i] = res->mem_t[i];
    buf[3 * i + 1] = res->mem_b[i];
    buf[3 * i + 2] = res->mem_t[i] - res->steady_s;
  }
  return buf;
}

#ifdef OFL_DEMO_NO_MPI
/* This process's samples only, under its stage number. */
int write_memory_csv(const char *path, int rank, int pp, const result_t *base,
                     const result_t *off) {
  (void)pp;
  FILE *f = fopen(path, "w");
  if (f == NULL) {
    fprintf(stderr, DEMO_NAME ": cannot write %s: %s\n", path,
            strerror(errno));
    return -1;
  }
  fprintf(f, "rank,run,seconds,device_mib,steady_seconds\n");
  const result_t *runs[2] = {base, off};
  for (int k = 0; k < 2; k++) {
    double *buf = samples(runs[k]);
    for (size_t i = 0; i < runs[k]->nmem; i++)
      csv_row(f, rank, k, &buf[3 * i]);
    free(buf);
  }
  return fclose(f) == 0 ? 0 : -1;
}
#else
/* Every rank's samples are gathered on rank 0, which writes the file;
 * returns 0 on rank 0 when the file was written (and on the others). */
int write_memory_csv(const char *path, int rank, int pp, const result_t *base,
                     const result_t *off) {
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
      fprintf(stderr, DEMO_NAME ": cannot write %s: %s\n", path,
              strerror(errno));
    else
      fprintf(f, "rank,run,seconds,device_mib,steady_seconds\n");
  }
  const result_t *runs[2] = {base, off};
  for (int k = 0; k < 2; k++) {
    int n = counts[k];
    double *buf = samples(runs[k]);
    if (rank == 0) {
      for (int src = 0; src < pp; src++) {
        int m = all[2 * src + k];
        double *rb =
            src == 0 ? buf : malloc(sizeof(double) * 3 * (size_t)(m ? m : 1));
        if (src != 0) {
          if (MPI_Irecv(rb, 3 * m, MPI_DOUBLE, src, 900 + k, MPI_COMM_WORLD,
                        &req) != MPI_SUCCESS)
            die(NULL, "MPI_Irecv of rank %d's memory samples failed", src);
          wait_bounded(&req, "the receive of a rank's memory samples");
        }
        for (int i = 0; f && i < m; i++)
          csv_row(f, src, k, &rb[3 * i]);
        if (src != 0)
          free(rb);
      }
    } else {
      if (MPI_Isend(buf, 3 * n, MPI_DOUBLE, 0, 900 + k, MPI_COMM_WORLD,
                    &req) != MPI_SUCCESS)
        die(NULL, "MPI_Isend of the memory samples failed");
      wait_bounded(&req, "the send of the memory samples to rank 0");
    }
    free(buf);
  }
  free(all);
  if (rank != 0)
    return 0;
  return f != NULL && fclose(f) == 0 ? 0 : -1;
}
#endif

/* The CSV's extent: the largest device_mib and the range of steady_seconds,
 * so that every rank's plot has the same scales. */
typedef struct {
  double ymax, xmin, xmax;
} extent_t;

static extent_t csv_extent(const char *csv) {
  extent_t e = {0, 0, 0};
  FILE *f = fopen(csv, "r");
  char line[256];
  while (f != NULL && fgets(line, sizeof line, f) != NULL) {
    int rk;
    char run[16];
    double t, mib, ts;
    if (sscanf(line, "%d,%15[^,],%lf,%lf,%lf", &rk, run, &t, &mib, &ts) != 5)
      continue;
    e.ymax = mib > e.ymax ? mib : e.ymax;
    e.xmin = ts < e.xmin ? ts : e.xmin;
    e.xmax = ts > e.xmax ? ts : e.xmax;
  }
  if (f != NULL)
    fclose(f);
  return e;
}

/* One plot per rank first .. first + pp - 1 of the CSV: both runs on one
 * time axis from their steady state's start, the same scales on every
 * rank (the y one stated), each plot titled with the rank's step times (all: the
 * report's figures, NF per rank), the legend outside the curves, and the
 * offload run drawn thin over the baseline's wide band so that both show
 * where they coincide. Returns 0 when the PNG was written. */
int render_png(const char *csv, const char *png, int first, int pp,
               const double *all, int NF) {
  size_t cap = 2048 + 1024 * (size_t)pp;
  char *script = malloc(cap);
  if (script == NULL)
    return -1;
  extent_t ext = csv_extent(csv);
  double ymax = ext.ymax * 1.08;
  int n = snprintf(
      script, cap,
      "set terminal pngcairo size 1100,%d font 'sans,10'\n"
      "set output '%s'\nset datafile separator ','\n"
      "set key outside right top vertical\nset grid ytics\n"
      "set yrange [0:%g]\nset xrange [%g:%g]\nset ylabel 'MiB allocated'\n"
      "set xlabel 'seconds from the steady state (iteration 2); the warmup "
      "is left of 0'\nset xzeroaxis\nset arrow from 0, graph 0 to 0, graph 1 "
      "nohead dt 3 lc rgb '#888888'\n"
      "set multiplot layout %d,1 title 'ofl demo: device memory per rank "
      "without and with activation offload (same MiB scale on every rank; "
      "runs aligned at their steady state)'\n",
      220 * pp + 80, png, ymax > 0 ? ymax : 1, ext.xmin,
      ext.xmax > ext.xmin ? ext.xmax : ext.xmin + 1, pp);
  for (int i = 0; i < pp && n > 0 && (size_t)n < cap; i++) {
    int r = first + i;
    const double *v = &all[NF * i];
    n += snprintf(
        script + n, cap - (size_t)n,
        "set title 'rank %d: step %.1f ms without offload, %.1f ms with "
        "(steady-state mean)'\n"
        "plot '%s' using ($1==%d && strcol(2) eq 'baseline' ? $5 : 1/0):4 "
        "with lines lw 6 lc rgb '#9ecae1' title 'without offload', "
        "'' using ($1==%d && strcol(2) eq 'offload' ? $5 : 1/0):4 "
        "with lines lw 1.5 lc rgb '#c0392b' title 'with offload'\n",
        r, v[7] * 1e3, v[8] * 1e3, csv, r, r);
  }
  if (n > 0 && (size_t)n < cap)
    snprintf(script + n, cap - (size_t)n, "unset multiplot\n");
  FILE *g = popen("gnuplot 2>&1", "w");
  if (g == NULL) {
    fprintf(stderr, DEMO_NAME ": gnuplot not available; no PNG written\n");
    free(script);
    return -1;
  }
  fputs(script, g);
  free(script);
  if (pclose(g) != 0) {
    fprintf(stderr, DEMO_NAME ": gnuplot failed; no PNG written (is gnuplot "
                    "installed?)\n");
    return -1;
  }
  return 0;
}

/* The per-rank table (all: NF figures per rank, rep_n ranks numbered from
 * rep_first), the check of the memory saved against the summary, the step
 * time ratio and the verdict. *mem_fail: ranks outside the bound;
 * *nothing: 1 when no rank offloaded a byte (the comparison then shows
 * nothing, and the run fails). */
void report_print(const opts_t *o, const double *all, int NF, int rep_first,
                  int rep_n, const result_t *base, const result_t *off,
                  int no_compare, long long diff_all, long long bad_ranks,
                  int *mem_fail_out, int *nothing_out) {
  int mem_fail = 0, mem_equal = 0, mem_short = 0;
  printf("\n%-6s %12s %12s %12s %12s %8s %12s %12s %8s %8s %10s %10s\n",
         "rank", "peak_base", "peak_offl", "saved_MiB", "summary_MiB",
         "saved/sum", "offl_MiB", "reload_MiB", "stalls", "stall_ms",
         "step_base", "step_offl");
  for (int i = 0; i < rep_n; i++) {
    const double *v = &all[NF * i];
    double saved = v[0] - v[1];
    /* 0/0 is no ratio: a rank with nothing in its summary shows "-". */
    char ratio[16];
    if (v[2] > 0)
      snprintf(ratio, sizeof ratio, "%.3f", saved / v[2]);
    else
      snprintf(ratio, sizeof ratio, "-");
    printf("%-6d %10.2fMi %10.2fMi %12.2f %12.2f %8s %12.2f %12.2f %8.0f "
           "%8.2f %8.1fms %8.1fms\n",
           rep_first + i, v[0] / 1048576, v[1] / 1048576, saved / 1048576,
           v[2] / 1048576, ratio, v[3] / 1048576, v[4] / 1048576, v[5], v[6],
           v[7] * 1e3, v[8] * 1e3);
  }
  double offloaded = 0;
  for (int i = 0; i < rep_n; i++)
    offloaded += all[NF * i + 3];
  /* a recompute (fixed, or the plan's) changes the computation even where
   * nothing is offloaded: the comparison then checks it */
  double recomputed = 0;
  for (int i = 0; i < rep_n; i++)
    recomputed += all[NF * i + 33];
  int recomputes = o->recompute_fixed != 0 || o->recompute_full;
  int nothing = offloaded == 0 && recomputed == 0;
  if (nothing)
    printf("\nNOTHING WAS OFFLOADED on any rank: groups %s, tensors >= %zu "
           "bytes (--offload, --min-offload-bytes); the comparison below "
           "shows nothing, and the run fails\n",
           o->offload_groups, o->min_offload_bytes);
  /* The check of the bound above largest_offloaded_group, saying for
   * each rank whether and why the saving differs from the summary. */
  printf("\n");
  /* auto: the plan's leads move the prefetch, so the bound above does not
   * hold; the check is the target's (report_plan). A fixed recompute frees
   * bytes the summary does not count: not checked. */
  if (recomputes && o->check_memory)
    printf("device memory saved against the summary: not checked with "
           "--recompute-modules (recomputed groups free bytes the summary "
           "does not count)\n");
  for (int i = 0; i < rep_n && !no_compare && !o->offload_auto && !recomputes;
       i++) {
    const double *v = &all[NF * i];
    double saved = v[0] - v[1], sum = v[2], bound = v[20];
    double slack = o->mem_tolerance * sum;
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
           o->disk_groups, "rank", "written_MiB", "read_MiB", "write_GB/s",
           "read_GB/s", "reloads", "from_kept", "faults");
    for (int i = 0; i < rep_n; i++) {
      const double *v = &all[NF * i];
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
           "median steady-state iteration)\n",
           so / sb);
    if (o->offload_auto)
      printf("device memory saved against the summary: not checked with "
             "--offload auto (its prefetch leads move); the check is each "
             "rank's activation peak against its target\n");
    else
    printf("device memory saved against the summary: equal on %d, short "
           "by the prefetched group(s) on %d, outside the bound on %d of "
           "%d rank(s)\n",
           mem_equal, mem_short, mem_fail, rep_n);
  }
  if (g_kc != NULL)
    printf("GPU memory in use at the peak (cudaMemGetInfo, rank 0's GPU, "
           "all of its users): %.2f MiB without offload, %.2f MiB with\n",
           (double)base->gpu_used_peak / 1048576,
           (double)off->gpu_used_peak / 1048576);
  /* this process's state (its stage; rank 0's under MPI) */
  if (no_compare)
    printf("state checksum (losses, weights, gradients) of this stage: "
           "offload %016llx\n",
           (unsigned long long)off->checksum);
  else
    printf("state checksum (losses, weights, gradients) of this stage: "
           "baseline %016llx, offload %016llx\n",
           (unsigned long long)base->checksum,
           (unsigned long long)off->checksum);
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
  *mem_fail_out = mem_fail;
  *nothing_out = nothing;
}

/* ---- the auto plan against the target --------------------------------------
 * Two measurements of each rank's activation peak in steady state: the
 * plan's (the manager's ledger of saved tensors on the device) and the
 * demo's (the pool's blocks in use less the demo's own tensors, sampled
 * after each group), both over the iterations since the plan last changed
 * (its feedback answers an iteration over the target with a change: the
 * peak that counts is the one it settled on). Either above the target
 * (with --mem-tolerance) fails --check-memory. Figures: all[NF * i + 21
 * ...], see demo.c. */
int report_plan(const opts_t *o, const double *all, int NF, int rep_first,
                int rep_n) {
  int over = 0;
  /* Each figure says whether it is predicted (pred_: the plan's model, as
   * last solved: it may have solved again since the plan printed after the
   * warmup) or measured (meas_: in the steady iterations since the plan
   * last changed). */
  printf("\nauto plan in steady state (MiB; pred_: predicted by the plan as "
         "last solved, meas_: measured since the plan last changed):\n"
         "%30s %10s %10s %10s %10s %10s %10s %11s %11s %11s\n",
         "rank", "target", "pred_peak", "meas_peak", "meas_demo", "pred_all",
         "pred_none", "pred_exp_ms", "pred_stall", "meas_stall");
  for (int i = 0; i < rep_n; i++) {
    const double *v = &all[NF * i];
    if (v[21] == 0) {
      printf("rank %d: no auto plan (the warmup did not end?)\n",
             rep_first + i);
      over++;
      continue;
    }
    printf("%30d %10.4f %10.4f %10.4f %10.4f %10.4f %10.4f %11.3f %11.3f "
           "%11.3f\n",
           rep_first + i, v[22] / 1048576, v[23] / 1048576, v[24] / 1048576,
           v[25] / 1048576, v[28] / 1048576, v[30] / 1048576, v[26], v[32],
           v[27]);
  }
  for (int i = 0; i < rep_n; i++) {
    const double *v = &all[NF * i];
    double target = v[22], limit = target * (1 + o->mem_tolerance);
    if (v[21] == 0 || target <= 0)
      continue;
    const char *who = v[24] > limit ? "the plan's ledger"
                      : v[25] > limit ? "the demo's pool"
                                      : NULL;
    if (who != NULL) {
      over++;
      printf("rank %d: measured activation peak %.2f MiB (%s) is OVER its "
             "memory target %.2f MiB (predicted %.2f MiB%s)\n",
             rep_first + i, (v[24] > limit ? v[24] : v[25]) / 1048576, who,
             target / 1048576, v[23] / 1048576,
             v[29] ? "" : "; the target cannot be met even offloading "
                          "everything");
    }
  }
  if (o->memory_target_mib != 0)
    printf("measured activation peak within the memory target: %s on %d "
           "of %d rank(s)\n",
           over ? "NO, only" : "yes", rep_n - over, rep_n);
  fflush(stdout);
  return over;
}
