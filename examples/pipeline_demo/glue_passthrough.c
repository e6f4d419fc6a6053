/* Temporary pass-through glue (no manager): validates the demo itself. */
#include <stdlib.h>

#include "glue.h"

struct glue {
  ofl_tensor_t **slots;
  size_t n, cap;
};

int glue_open(const glue_params_t *p, glue_t **out) {
  (void)p;
  *out = calloc(1, sizeof **out);
  return 0;
}
void glue_close(glue_t *g) {
  free(g->slots);
  free(g);
}
int glue_chunk_begin(glue_t *g, int vpp, int vp_stage, int mb) {
  (void)g; (void)vpp; (void)vp_stage; (void)mb;
  return 0;
}
int glue_group_start(glue_t *g, const char *name) { (void)g; (void)name; return 0; }
int glue_save(glue_t *g, ofl_tensor_t *t, uint64_t *tag) {
  if (g->n == g->cap) {
    g->cap = g->cap ? g->cap * 2 : 1024;
    g->slots = realloc(g->slots, g->cap * sizeof *g->slots);
  }
  g->slots[g->n] = t;
  *tag = g->n++;
  return 0;
}
int glue_group_commit(glue_t *g, const char *name) { (void)g; (void)name; return 0; }
int glue_backward_begin(glue_t *g, const char *name) { (void)g; (void)name; return 0; }
int glue_load(glue_t *g, uint64_t tag, ofl_tensor_t **t) {
  *t = g->slots[tag];
  g->slots[tag] = NULL;
  return 0;
}
int glue_backward_end(glue_t *g, const char *name) { (void)g; (void)name; return 0; }
int glue_iteration_end(glue_t *g) { g->n = 0; return 0; }
size_t glue_summary_total_bytes(glue_t *g) { (void)g; return 0; }
void glue_print_summary(glue_t *g, FILE *out) { (void)g; (void)out; }
void glue_get_stats(glue_t *g, glue_stats_t *out) { (void)g; *out = (glue_stats_t){0}; }
