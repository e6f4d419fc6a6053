/* ofl: whether the manager offloads now, and on which compute stream:
 * the application's switches (disable, forward-only), the compute stream
 * looked up at each use, the refusal inside a CUDA graph capture, and the
 * tests' switches (struct ofl__manager_test). */
#include "pipeline/pipeline_internal.h"

bool ofl__manager_active(const ofl_manager_t *m) {
  bool fwd_only = m->forward_only && !(m->test.rules_off & OFL__RULE4_OFF);
  return m->offload && m->enabled && !fwd_only;
}

/* A CUDA graph that captures the compute stream cannot contain ofl's
 * offload: its copies, pool blocks and events are decided at each call, and
 * a capture would freeze them. Offloading calls refuse instead of breaking
 * the application's capture (docs/DESIGN.md section 3.1); with offload
 * disabled they only hold tensors and work inside a capture. */
ofl_status_t ofl__capture_refuse(ofl_manager_t *m, const char *fn) {
  if (!ofl__stream_capturing(ofl__compute(m)))
    return OFL_SUCCESS;
  return ofl__error(OFL_ERR_INVALID_USAGE, OFL_SUBSYS_PIPELINE,
                    "rank %d: %s while the compute stream is being captured "
                    "into a CUDA graph: offload copies cannot be captured; "
                    "disable offload for captured passes "
                    "(ofl_manager_disable_offload) and mark the graph's "
                    "boundaries with ofl_manager_forward_record / "
                    "ofl_manager_backward_record",
                    m->rank, fn);
}

/* Rule 3: the compute stream is looked up at each use, never kept. */
ofl_stream_t *ofl__compute(ofl_manager_t *m) {
  if (m->test.rules_off & OFL__RULE3_OFF)
    return m->test.compute_at_create;
  return ofl_device_compute_stream(m->dev);
}

void ofl_manager_mark_not_offloadable(ofl_tensor_t *t) {
  if (t != NULL)
    ofl_tensor_set_flags(t, ofl_tensor_flags(t) | OFL_TENSOR_NOT_OFFLOADABLE);
}

void ofl_manager_disable_offload(ofl_manager_t *m) {
  if (m != NULL)
    m->enabled = false;
}

void ofl_manager_enable_offload(ofl_manager_t *m) {
  if (m != NULL)
    m->enabled = true;
}

void ofl_manager_set_forward_only(ofl_manager_t *m, int on) {
  if (m != NULL)
    m->forward_only = on != 0;
}

/* ---- tests only
 * ----------------------------------------------------------------- */

void ofl__manager_rules_off(ofl_manager_t *m, unsigned mask) {
  m->test.rules_off = mask;
}

void ofl__manager_fail_offload_after(ofl_manager_t *m, int after_n) {
  m->test.fail_offload_after = after_n;
}

bool ofl__manager_test_fail_offload(ofl_manager_t *m) {
  return m->test.fail_offload_after >= 0 && m->test.fail_offload_after-- == 0;
}
