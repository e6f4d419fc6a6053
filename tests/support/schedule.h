/* The schedules the tests play (tests/support/driver.h, tests/gpu): the
 * project's one generator of Megatron-Core's 1F1B and interleaved 1F1B order
 * (examples/pipeline_demo/schedule.c, linked through test_support_dep), under
 * the driver's names, and the seven named groups of a layer. */
#ifndef OFL_TEST_SCHEDULE_H
#define OFL_TEST_SCHEDULE_H

#include "examples/pipeline_demo/schedule.h"

/* The seven named groups of a transformer layer, in forward order. */
static const char *const drv_names[7] = {
    "attn_norm", "qkv_linear", "core_attn", "attn_proj",
    "mlp_norm",  "expert_fc1", "moe_act"};

typedef sched_step_t drv_step_t;

/* The order of steps on pipeline rank rank (2 * mbs * vpp entries in out);
 * returns the count. */
static inline int drv_schedule(int pp, int rank, int vpp, int mbs,
                               drv_step_t *out) {
  return sched_build(pp, rank, vpp, mbs, out);
}

#endif
