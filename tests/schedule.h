/* Megatron's 1F1B and interleaved 1F1B order of steps for one pipeline
 * stage, for the tests that play whole schedules (tests/unit/pipeline's
 * driver and tests/gpu). Header-only, no dependencies. */
#ifndef OFL_TEST_SCHEDULE_H
#define OFL_TEST_SCHEDULE_H

/* The seven named groups of a transformer layer, in forward order. */
static const char *const drv_names[7] = {
    "attn_norm", "qkv_linear", "core_attn", "attn_proj",
    "mlp_norm",  "expert_fc1", "moe_act"};

typedef struct {
  int fwd; /* 1 forward, 0 backward */
  int chunk;
  int mb;
} drv_step_t;

/* Megatron's 1F1B (vpp 1) and interleaved 1F1B (vpp > 1, microbatches a
 * multiple of pp) order of steps on pipeline rank rank. Returns the count. */
static inline int drv_schedule(int pp, int rank, int vpp, int mbs,
                               drv_step_t *out) {
  int total = mbs * vpp;
  int warm;
  if (vpp == 1) {
    warm = pp - rank - 1;
  } else {
    warm = (pp - rank - 1) * 2 + (vpp - 1) * pp;
    if (mbs == pp)
      warm = total;
  }
  if (warm > total)
    warm = total;
  int n = 0, f = 0, b = 0;
  int group = pp * vpp;
#define DRV_F(k)                                                               \
  out[n++] = (drv_step_t) {                                                    \
    1, ((k) % group) / pp, ((k) / group) * pp + (k) % pp                       \
  }
#define DRV_B(k)                                                               \
  out[n++] = (drv_step_t) {                                                    \
    0, vpp - 1 - ((k) % group) / pp, ((k) / group) * pp + (k) % pp             \
  }
  for (; f < warm; f++)
    DRV_F(f);
  while (f < total) {
    DRV_F(f);
    f++;
    DRV_B(b);
    b++;
  }
  while (b < total) {
    DRV_B(b);
    b++;
  }
#undef DRV_F
#undef DRV_B
  return n;
}

#endif
