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

/* ---- reports
 * ------------------------------------------------------------------ */

#ifdef OFL_DEMO_NO_MPI
/* This process's samples only, under its stage number. */
void write_memory_csv(const char *path, int rank, int pp,
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
void write_memory_csv(const char *path, int rank, int pp,
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
void render_png(const char *csv, const char *png, int first, int pp) {
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
