/* ofl: the table of every OFL_* variable: name, default, kind, range,
 * one-line doc, and the extra checks of the values some variables take.
 * runtime/config.c loads it from the environment and reads it. */
#include <stdlib.h>
#include <string.h>

#include "runtime/config_table.h"
#include "runtime/internal.h"

static bool check_subsys(const char *s) {
  unsigned mask;
  return ofl__log_parse_subsys(s, &mask);
}

static bool check_rank(const char *s) {
  int r;
  return ofl__log_parse_rank(s, &r);
}

/* OFL_DEVICE: empty, local, or a decimal ordinal (runtime/device_cuda.c
 * checks it against the devices present). */
static bool check_device(const char *s) {
  if (*s == '\0' || strcmp(s, "local") == 0)
    return true;
  int r;
  return ofl__log_parse_rank(s, &r);
}

/* A link rate paces each byte 1/rate seconds: a rate so low that one byte
 * takes longer than a day is a typo, not a link (and below ~1e-300 GB/s the
 * arithmetic gives infinities). 0 switches the model off. */
static bool check_link(const char *s) {
  double v = strtod(s, NULL);
  return v == 0 || v * 1e9 >= OFL__LINK_MIN_BPS;
}

#define LINK_HINT "0 (off) or a rate of at least 1.2e-14 GB/s (one byte a day)"

const entry_t ofl__config_table[] = {
    /* runtime */
    {.name = "OFL_BACKEND",
     .def = "auto",
     .kind = K_ENUM,
     .words = "auto|host|cuda",
     .doc = "device backend; auto picks cuda when a GPU is present"},
    {.name = "OFL_DEBUG",
     .def = "WARN",
     .kind = K_ENUM,
     .words = "NONE|WARN|INFO|TRACE|VERSION",
     .doc = "log level"},
    {.name = "OFL_DEBUG_SUBSYS",
     .def = "ALL",
     .kind = K_STR,
     .check = check_subsys,
     .hint = "a comma list of INIT,DEVICE,POOL,PIPELINE,DISK,STAGING,COLL,"
             "CONFIG or ALL, ^ first to exclude",
     .doc = "subsystems to log; ^ excludes"},
    {.name = "OFL_DEBUG_RANK",
     .def = "",
     .kind = K_STR,
     .check = check_rank,
     .hint = "empty or a decimal rank >= 0",
     .doc = "log only on this rank (empty: all ranks)"},
    {.name = "OFL_DEBUG_FILE",
     .def = "",
     .kind = K_STR,
     .doc = "log file instead of stderr; %h host, %p pid, %r rank"},
    {.name = "OFL_WAIT_TIMEOUT_MS",
     .def = "120000",
     .kind = K_INT,
     .lo = 1,
     .hi = INT64_MAX,
     .doc = "timeout of every wait that is not given one, in ms"},
    {.name = "OFL_TRACE_FILE",
     .def = "",
     .kind = K_STR,
     .doc = "write a Chrome trace (JSON) of streams, copies and waits here at "
            "device close; %p pid, %r rank, %d device number in the process "
            "(a second device on the same path gets .N before .json)"},
    {.name = "OFL_DEVICE",
     .def = "",
     .kind = K_STR,
     .check = check_device,
     .hint = "empty, local, or a device ordinal",
     .doc = "cuda device of a device opened without an index: an ordinal, or "
            "local (the launcher's local rank modulo the device count); "
            "empty: the calling thread's current device"},
    {.name = "OFL_CUDART_LIBRARY",
     .def = "",
     .kind = K_STR,
     .doc = "cuda runtime loaded at the first cuda device open (a soname or "
            "path); empty: libcudart.so.13, then libcudart.so.12"},
    {.name = "OFL_NCCL_LIBRARY",
     .def = "",
     .kind = K_STR,
     .doc = "nccl loaded at the first NCCL comm creation (a soname or path); "
            "empty: libnccl.so.2"},
    {.name = "OFL_DEVICE_CAPACITY",
     .def = "0",
     .kind = K_SIZE,
     .doc = "host backend: device memory capacity (0: unlimited)"},
    {.name = "OFL_STRICT",
     .def = "0",
     .kind = K_BOOL,
     .doc = "host backend: poison freed blocks, jitter worker streams, report "
            "frees of in-flight blocks"},
    {.name = "OFL_JITTER_SEED",
     .def = "1",
     .kind = K_INT,
     .lo = 0,
     .hi = INT64_MAX,
     .doc = "host backend strict mode: seed of the stream jitter"},
    {.name = "OFL_JITTER_MAX_US",
     .def = "200",
     .kind = K_INT,
     .lo = 0,
     .hi = INT32_MAX,
     .doc = "host backend strict mode: largest jitter per operation, in "
            "microseconds"},
    {.name = "OFL_HOST_SPIN_US",
     .def = "20",
     .kind = K_INT,
     .lo = 0,
     .hi = 100000,
     .doc = "host backend: microseconds a worker stream polls for more work "
            "before it sleeps, while one of its last four idle periods was "
            "that short (0: sleep at once)"},
    {.name = "OFL_HOST_DOZE_US",
     .def = "100",
     .kind = K_INT,
     .lo = 0,
     .hi = 1000000,
     .doc = "host backend: within 20 ms of its last operation a worker "
            "stream sleeps in timed dozes of this many microseconds and "
            "finds new work itself, so that queueing a copy wakes nobody "
            "(0: every queueing onto a sleeping worker wakes it)"},
    {.name = "OFL_HOST_INLINE_BYTES",
     .def = "0",
     .kind = K_SIZE,
     .doc = "host backend: a copy of up to this many bytes submitted to an "
            "idle worker stream runs on the submitting thread (no hand-off "
            "to the worker; never with strict-mode jitter or a link model); "
            "0: every copy goes to the worker"},
    {.name = "OFL_LINK_H2D_GBPS",
     .def = "0",
     .kind = K_DOUBLE,
     .check = check_link,
     .hint = LINK_HINT,
     .doc = "host backend link model: H2D GB/s (0: unlimited)"},
    {.name = "OFL_LINK_D2H_GBPS",
     .def = "0",
     .kind = K_DOUBLE,
     .check = check_link,
     .hint = LINK_HINT,
     .doc = "host backend link model: D2H GB/s (0: unlimited)"},
    {.name = "OFL_LINK_TOTAL_GBPS",
     .def = "0",
     .kind = K_DOUBLE,
     .check = check_link,
     .hint = LINK_HINT,
     .doc = "host backend link model: both directions together, GB/s (0: "
            "their sum)"},
    /* pools */
    {.name = "OFL_HOST_BUDGET",
     .def = "0",
     .kind = K_SIZE,
     .doc = "pinned host pool byte budget (0: unlimited)"},
    {.name = "OFL_DEVICE_POOL_BUDGET",
     .def = "0",
     .kind = K_SIZE,
     .doc = "device pool byte budget (0: unlimited)"},
    /* pipeline */
    {.name = "OFL_OFFLOAD",
     .def = "1",
     .kind = K_BOOL,
     .doc = "master switch of activation offloading"},
    {.name = "OFL_OFFLOAD_GROUPS",
     .def = "",
     .kind = K_STR,
     .doc = "comma-separated group names to offload (empty: all; auto: "
            "the plan chooses, see OFL_MEMORY_TARGET)"},
    {.name = "OFL_MEMORY_TARGET",
     .def = "0",
     .kind = K_SIZE,
     .doc = "with OFL_OFFLOAD_GROUPS=auto: activation bytes this rank may "
            "keep on the device at its peak; the plan picks the groups (0: "
            "no target, offload what hides behind compute)"},
    {.name = "OFL_DEVICE_MEMORY_TARGET",
     .def = "0",
     .kind = K_SIZE,
     .doc = "with OFL_OFFLOAD_GROUPS=auto: device memory this rank's step "
            "may use at its peak, weights, gradients and optimizer state "
            "included; the warmup measures what is not activations and the "
            "plan aims the activations at the rest (0: none; with "
            "OFL_MEMORY_TARGET too, the tighter wins)"},
    {.name = "OFL_PLAN_RECOMPUTE",
     .def = "0",
     .kind = K_BOOL,
     .doc = "with OFL_OFFLOAD_GROUPS=auto: the plan may also recompute the "
            "groups the application started recomputable (keep, offload or "
            "recompute per name, the least predicted step time)"},
    {.name = "OFL_MIN_OFFLOAD_ELEMS",
     .def = "1048576",
     .kind = K_INT,
     .lo = 0,
     .hi = INT64_MAX,
     .doc = "smallest tensor offloaded, in elements"},
    {.name = "OFL_MIN_OFFLOAD_BYTES",
     .def = "0",
     .kind = K_SIZE,
     .doc = "smallest tensor offloaded, in bytes (0: use "
            "OFL_MIN_OFFLOAD_ELEMS)"},
    /* The manager checks the params field against the same [0, 1]. */
    {.name = "OFL_OFFLOAD_FRACTION",
     .def = "1.0",
     .kind = K_DOUBLE,
     .dlo = 0.0,
     .dhi = 1.0,
     .doc = "fraction of groups of each name offloaded after warmup"},
    {.name = "OFL_RANK_DELTA_BYTES",
     .def = "0",
     .kind = K_SIZE,
     .doc = "per pipeline rank, bytes fewer offloaded than the rank before"},
    {.name = "OFL_PREFETCH_GROUPS",
     .def = "1",
     .kind = K_INT,
     .lo = 1,
     .hi = 64,
     .doc = "groups whose reloads are issued ahead of the backward pass (each "
            "holds its device buffers until its backward)"},
    {.name = "OFL_MAX_INFLIGHT",
     .def = "0",
     .kind = K_INT,
     .lo = 0,
     .hi = 1000000,
     .doc = "max offloads in flight per group name (0: unlimited)"},
    /* disk tier */
    {.name = "OFL_DISK_DIR",
     .def = "",
     .kind = K_STR,
     .doc = "directory of the disk tier file (empty: TMPDIR or /tmp); a comma "
            "list spreads the ranks of a node over several disks"},
    {.name = "OFL_DISK_GROUPS",
     .def = "",
     .kind = K_STR,
     .doc = "group names placed on disk rather than in host memory"},
    {.name = "OFL_DISK_BUDGET",
     .def = "0",
     .kind = K_SIZE,
     .doc = "cap on the disk tier file's size (0: no cap, the file grows "
            "until the file system refuses; 1 to 4095: refused at open)"},
    {.name = "OFL_DISK_BOUNCE_BUDGET",
     .def = "0",
     .kind = K_SIZE,
     .doc = "pinned bytes for the disk tier's bounce buffers (0: no cap); a "
            "full pool makes the tier refuse, and the data stays where it is"},
    {.name = "OFL_DISK_KEEP",
     .def = "256M",
     .kind = K_SIZE,
     .doc = "bounce buffers the disk tier keeps after their write, so that "
            "reloads of recent extents need no read (capped at "
            "OFL_DISK_BOUNCE_BUDGET; 0: none)"},
    {.name = "OFL_DISK_QUEUE_DEPTH",
     .def = "8",
     .kind = K_INT,
     .lo = 1,
     .hi = 4096,
     .doc = "io_uring queue depth"},
    {.name = "OFL_DISK_BLOCK",
     .def = "4M",
     .kind = K_SIZE,
     .lo = 1,
     .hi = (int64_t)1 << 30,
     .doc = "disk I/O block size"},
    {.name = "OFL_DISK_PREFETCH",
     .def = "2",
     .kind = K_INT,
     .lo = 0,
     .hi = 1024,
     .doc = "groups read ahead of the backward pass"},
    {.name = "OFL_DISK_CHECKSUM",
     .def = "1",
     .kind = K_BOOL,
     .doc = "CRC32C per extent, verified on read"},
    {.name = "OFL_DISK_DIRECT",
     .def = "auto",
     .kind = K_ENUM,
     .words = "auto|on|off",
     .doc = "O_DIRECT on the disk file"},
    /* staging */
    {.name = "OFL_STAGING_MAX_INFLIGHT",
     .def = "1",
     .kind = K_INT,
     .lo = 1,
     .hi = 1024,
     .doc = "checkpoint saves in flight per stager"},
};

_Static_assert(sizeof ofl__config_table / sizeof ofl__config_table[0] ==
                   OFL__CONFIG_ENTRIES,
               "OFL__CONFIG_ENTRIES (runtime/config_table.h) counts the "
               "entries of the table");
