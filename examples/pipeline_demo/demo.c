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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"

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
           o.layers, o.hidden, o.seq, o.iters,
           o.offload_auto ? "auto (ofl's plan chooses)" : o.offload_groups,
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
  enum { NF = 34 };
  const plan_result_t *pl = &off.plan;
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
                         (double)largest_offloaded_group(&o),
                     (double)pl->have,
                     pl->target,
                     pl->predicted_peak,
                     pl->measured_peak_max,
                     (double)off.act_peak,
                     pl->predicted_exposed_ms,
                     pl->measured_stall_ms,
                     pl->peak_all,
                     (double)pl->met,
                     pl->peak_none,
                     off.ledger_peak,
                     pl->predicted_stall_ms,
                     (double)off.recomputed};
  double *all = leader ? malloc(sizeof mine * (size_t)rep_n) : NULL;
#ifdef OFL_DEMO_NO_MPI
  memcpy(all, mine, sizeof mine);
#else
  if (MPI_Igather(mine, NF, MPI_DOUBLE, all, NF, MPI_DOUBLE, 0, MPI_COMM_WORLD,
                  &req) != MPI_SUCCESS)
    die(NULL, "MPI_Igather of the per-rank figures failed");
  wait_bounded(&req, "the gather of the per-rank figures");
#endif
  /* What rank 0 prints: the table, the memory check, the verdict. */
  int mem_fail = 0, nothing = 0, plan_over = 0;
  if (leader)
    report_print(&o, all, NF, rep_first, rep_n, &base, &off, no_compare,
                 diff_all, bad_ranks, &mem_fail, &nothing);
  if (leader && o.offload_auto)
    plan_over = report_plan(&o, all, NF, rep_first, rep_n);
  /* The offload run's activation peak as the demo sees it (pool less its
   * own tensors), with or without a plan: what strategies compare on. */
  for (int i = 0; leader && i < rep_n; i++)
    printf("demo activation peak rank %d: %.3f MiB measured (steady state, "
           "offload run); the manager's ledger: %.4f MiB measured\n",
           rep_first + i, all[NF * i + 25] / 1048576,
           all[NF * i + 31] / 1048576);
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
    /* Where the files went, so that nobody has to guess. */
    int wrote = write_memory_csv(csv, rank, pp, &base, &off) == 0;
    if (leader && wrote)
      printf("memory over time (CSV): %s\n", csv);
    if (leader && wrote && o.png &&
        render_png(csv, o.png, rep_first, rep_n, all, NF) == 0)
      printf("memory over time (PNG): %s\n", o.png);
    fflush(stdout);
  }
  int fail = 0;
  if (leader)
    fail = diff_all != 0 || (o.check_memory && mem_fail > 0) || oom_fail ||
           nothing || (o.check_memory && plan_over > 0);
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
