/* ofl pipeline demo: communication between the ranks. Every wait on a
 * peer is bounded (--timeout), so that a rank that died makes the others
 * fail with a message instead of hanging; the activations and gradients
 * that cross stages are MPI messages, or without MPI generated from a
 * seed. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "demo.h"

int g_rank = -1;
int g_timeout_s = 60;

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void die(run_t *r, const char *fmt, ...) {
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
void wait_bounded(MPI_Request *req, const char *what) {
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

void barrier_bounded(const char *what) {
  MPI_Request req;
  if (MPI_Ibarrier(MPI_COMM_WORLD, &req) != MPI_SUCCESS)
    die(NULL, "MPI_Ibarrier (%s) failed", what);
  wait_bounded(&req, what);
}
#else
void barrier_bounded(const char *what) { (void)what; }
#endif

/* --die-at: this rank leaves at `point` without telling anyone, as a crash
 * would (no MPI_Finalize, no abort). */
void maybe_die_at(const opts_t *o, int rank, int pp, const char *point) {
  int who = o->die_rank >= 0 ? o->die_rank : pp - 1;
  if (o->die_at == NULL || strcmp(o->die_at, point) != 0 || rank != who)
    return;
  fprintf(stderr, "ofl_pipeline_demo rank %d: exits at the %s (--die-at)\n",
          rank, point);
  fflush(stderr);
  _exit(3);
}

/* ---- messages between stages --------------------------------------------- */

#ifndef OFL_DEMO_NO_MPI
typedef struct {
  MPI_Request req;
  float *buf;
} pending_t;

static pending_t *pend;
static int npend, cappend;

int tag_of(int mb, int vs, int dir, int nvs) {
  return ((mb * nvs + vs) * 2 + dir) % 32000;
}

void send_tensor(run_t *r, const ofl_tensor_t *t, int dst, int tag) {
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
void recv_into(run_t *r, ofl_tensor_t *t, int src, int tag) {
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

void complete_sends(run_t *r) {
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
void synth_message(run_t *r, ofl_tensor_t *t, int mb, int vs_from,
                          int dir) {
  size_t n = ofl_tensor_nelem(t);
  unsigned long long seed = 0x5EED000000ull ^
                            ((unsigned long long)(unsigned)mb << 20) ^
                            ((unsigned long long)(unsigned)vs_from << 2) ^
                            (unsigned long long)(unsigned)dir;
  x_fill(r, F(t), n, seed, dir == 0 ? 1.0f : 1.0f / (float)n);
}

void complete_sends(run_t *r) { (void)r; }
#endif
