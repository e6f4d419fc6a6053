/* The pipeline manager under jittered schedules with its copy streams on
 * worker threads, as a plain TAP program so that ThreadSanitizer can run it
 * (the tsan setup), a quarter of the configurations with the disk tier.
 * Each configuration checks every popped byte. */
#include "tests/support/tap.h"
#include "tests/support/driver.h"

int main(void) {
  enum { CONFIGS = 24 };
  tap_plan(CONFIGS);
  for (int i = 0; i < CONFIGS; i++) {
    uint64_t h = drv_mix((uint64_t)i + 4242);
    drv_cfg_t c = {0};
    c.pp = 1 + (int)(h % 3);
    c.rank = (int)((h >> 8) % (uint64_t)c.pp);
    c.vpp = 1 + (int)((h >> 16) % 3);
    c.mbs = c.vpp > 1 ? c.pp * 2 : 1 + (int)((h >> 24) % 5);
    c.layers = 1 + (int)((h >> 32) % 2);
    c.names_mask = 1 + (unsigned)((h >> 40) % 127);
    c.tensors_max = 2;
    c.thresh = 128;
    c.size_lo = 64;
    c.size_hi = 512;
    c.seed = (uint64_t)i + 1;
    c.jitter_us = 20;
    c.tricks = 1;
    c.offload = 1;
    if (i % 4 == 3) { /* the disk tier takes every group */
      c.disk_groups = "*";
      c.host_budget = 0;
    }
    drv_t d;
    ofl_status_t s = drv_open(&d, &c);
    for (int it = 0; s == OFL_SUCCESS && it < 3; it++)
      s = drv_iteration(&d);
    tap_ok(s == OFL_SUCCESS && d.wrong_bytes == 0 && d.order_errors == 0,
           "config %d pp %d rank %d vpp %d mbs %d layers %d names 0x%x: %zu "
           "tensors, %zu wrong bytes %s",
           i, c.pp, c.rank, c.vpp, c.mbs, c.layers, c.names_mask,
           d.checked_tensors, d.wrong_bytes, d.msg);
    drv_close(&d);
  }
  return tap_done();
}
