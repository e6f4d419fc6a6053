/* ofl: fine-grained activation offloading for pipeline-parallel training.
 * Umbrella header: includes every public header. */
#ifndef OFL_OFL_H
#define OFL_OFL_H

#include <ofl/version.h>
#include <ofl/export.h>
#include <ofl/status.h>
#include <ofl/log.h>
#include <ofl/config.h>
#include <ofl/device.h>
#include <ofl/tensor.h>
#include <ofl/pool.h>
#include <ofl/safetensors.h>
#include <ofl/comm.h>
#include <ofl/summary.h>
#include <ofl/staging.h>
#include <ofl/manager.h>
#include <ofl/disk.h>

#endif /* OFL_OFL_H */
