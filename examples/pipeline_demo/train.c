/* ofl pipeline demo: the schedule. One iteration walks this stage's
 * 1F1B or interleaved 1F1B steps (schedule.c), a forward or backward of
 * one microbatch each, with the messages of comm.c between stages; a run
 * opens a device, a pool and ofl's manager (glue.c), trains --iters
 * iterations and keeps what the report and the comparison need. */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "demo.h"

char *g_env_trace;

/* ---- one iteration --------------------------------------------------------
 */

static void run_iteration(run_t *r, const sched_step_t *steps, int nsteps) {
  opts_t *o = r->o;
  dims_t d = r->d;
  int P = r->pp, V = o->vpp, nvs = P * V;
  for (int i = 0; i < nsteps; i++) {
    const sched_step_t *s = &steps[i];
    int vs = s->chunk * P + r->rank; /* global virtual stage */
    int mb = s->mb;
    layer_t *L = &r->layers[s->chunk * o->layers];
    saved_t *sv = &r->saved[((size_t)mb * V + s->chunk) * o->layers];
    if (s->fwd) {
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


static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The iterations of a run; 1 when an allocation ran out of device memory
 * and the run expected it (expect_oom), 0 when all of them ran. steady
 * (o->iters entries) gets the steady iterations' times, *nsteady their
 * count. The setjmp is here so that run()'s own locals are not modified
 * between it and the longjmp. */
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
    if (r->iter == 1 || o->iters == 1)
      r->steady_s = t - r->t0;
    run_iteration(r, steps, nsteps);
    /* The auto plan's feedback changed it at this reset: the peak that
     * counts against the target starts again with the next iteration. */
    ofl_manager_plan_t pl;
    if (offload && o->offload_auto && glue_plan(r->glue, &pl) == OFL_SUCCESS &&
        pl.automatic) {
      int changed = pl.replans + pl.lead_changes != r->plan_changes;
      int last = r->iter + 1 == o->iters;
      uint64_t peak = pl.measured_peak_bytes, target = pl.target_bytes;
      if (r->iter == 0)
        ; /* the warmup: no steady measurement */
      else if (changed && last && target > 0 && peak > target &&
               peak <= target + target / 10)
        r->answered_over = peak; /* the old plan's last iteration */
      else if (peak > r->ledger_settled)
        r->ledger_settled = peak;
      if (changed && !last) {
        r->plan_changes = pl.replans + pl.lead_changes;
        r->act_peak = 0;
        r->ledger_settled = 0;
      }
    }
    barrier_bounded("the barrier after an iteration");
    t = now_s() - t;
    if (r->iter > 0 || o->iters == 1)
      steady[(*nsteady)++] = t;
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
void run(opts_t *o, int rank, int pp, int offload, size_t capacity,
                int expect_oom, result_t *res) {
  run_t r = {.o = o, .rank = rank, .pp = pp, .iter = 0,
             .pool_total_seen = SIZE_MAX, .offload = offload};
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
                      .disk_dir = o->disk_dir,
                      .memory_target_bytes = -1,
                      .device_memory_target_bytes = -1,
                      .fraction = o->fraction};
  if (offload && o->offload_auto) {
    /* groups "auto": the manager prints the summary and its plan at the end
     * of the warmup (rank 0 of the comm), so the demo does not. */
    gp.groups = "auto";
    gp.summary_out = stdout;
    gp.recompute = o->recompute;
    if (o->memory_target_mib >= 0)
      gp.memory_target_bytes =
          (int64_t)(o->memory_target_mib * 1048576.0 + 0.5);
    if (o->device_memory_target_mib >= 0)
      gp.device_memory_target_bytes =
          (int64_t)(o->device_memory_target_mib * 1048576.0 + 0.5);
  }
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

  double *steady = calloc((size_t)(o->iters > 0 ? o->iters : 1), sizeof *steady);
  if (steady == NULL)
    die(&r, "no memory for the step times");
  int nsteady = 0;
  r.t0 = now_s();
  if (run_iterations(&r, steps, nsteps, offload, expect_oom, steady,
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
  /* The median of the steady iterations: one iteration slowed by the
   * machine (another process, a page fault storm) moves a mean by its
   * whole excess over the iteration count, and a median not at all. */
  qsort(steady, (size_t)nsteady, sizeof *steady, cmp_double);
  res->step_s = nsteady == 0 ? 0
                : nsteady % 2 ? steady[nsteady / 2]
                              : (steady[nsteady / 2 - 1] + steady[nsteady / 2]) / 2;
  free(steady);
  res->summary_bytes = glue_summary_total_bytes(r.glue);
  glue_get_stats(r.glue, &res->stats);
  res->act_peak = r.act_peak;
  res->recomputed = r.recomputed;
  ofl_manager_plan_t plan = {0};
  int have_plan = offload && glue_plan(r.glue, &plan) == OFL_SUCCESS;
  uint64_t settled = plan.settled_iterations > 0
                         ? plan.measured_peak_settled_bytes
                         : plan.measured_peak_max_bytes;
  if (have_plan && o->offload_auto && plan.automatic && r.ledger_settled != 0) {
    /* The demo's own count (run_t.ledger_settled): a last iteration over
     * the target that the plan answered is reported, not held against it. */
    settled = r.ledger_settled;
    if (r.answered_over != 0)
      printf("rank %d: the last iteration measured an activation peak of "
             "%.2f MiB, %.1f%% over the memory target %.2f MiB; the plan "
             "solved again at its end (the feedback's one iteration, at most "
             "10%% over), and the run had no iteration left to measure it: "
             "the check reads the iterations before, %.2f MiB at most\n",
             r.rank, (double)r.answered_over / 1048576,
             100.0 * ((double)r.answered_over / (double)plan.target_bytes - 1),
             (double)plan.target_bytes / 1048576, (double)settled / 1048576);
  }
  if (have_plan)
    res->ledger_peak = (double)settled;
  if (have_plan && o->offload_auto && plan.automatic)
    res->plan = (plan_result_t){
        .have = 1,
        .met = plan.met,
        .target = (double)plan.target_bytes,
        .predicted_peak = (double)plan.predicted_peak_bytes,
        /* Since the plan last changed: the first steady iterations may
         * go over (the warmup's timings missed), the feedback answers. */
        .measured_peak_max = (double)settled,
        .peak_all = (double)plan.peak_all_bytes,
        .peak_none = (double)plan.peak_none_bytes,
        .predicted_exposed_ms = plan.predicted_exposed_ms,
        .measured_stall_ms = plan.measured_stall_ms,
        .predicted_stall_ms = plan.predicted_stall_ms};
  if (have_plan && o->offload_auto && plan.automatic) {
    /* what the plan does at the end (replans may have changed the one
     * printed after the warmup), each name's predicted and measured cost */
    char acts[2048];
    glue_plan_actions(r.glue, acts, sizeof acts);
    printf("auto plan as the run ended, rank %d: %s\n", rank, acts);
    fflush(stdout);
  }
  if (offload && !o->offload_auto) {
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
  res->steady_s = r.steady_s;

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

