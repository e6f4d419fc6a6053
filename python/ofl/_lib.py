"""ctypes declarations of libofl's public C API (include/ofl/*.h).

Only what the Python package uses is declared. Struct layouts mirror the C
headers field for field; the *_INIT helpers return the values of the C
``*_PARAMS_INIT`` macros.

Where the library comes from (first found wins):

1. ``OFL_LIBRARY``: a path to ``libofl.so`` (tests and ``ofl.sh`` set it to
   the build tree's copy);
2. the copy in the package (``ofl/_libs/libofl.so.0``): ``pip install
   ./python`` builds it from the repository's sources (or copies the one
   ``OFL_BUNDLE_LIBRARY=path`` names);
3. the build tree next to this source tree (``<repo>/build*/libofl.so``),
   when the package runs from a checkout;
4. the lib directory of a ``meson install`` prefix whose ``bin`` (with
   ``ofl-info``) is on ``PATH``;
5. the system loader (``ldconfig``, ``LD_LIBRARY_PATH``).

The C extension ofl._ext (ofl.torch's saved-tensor hooks) links libofl too;
it is imported after this module, and the dynamic loader binds it to the
libofl loaded here (same soname), which ofl.torch._core checks. ctypes serves
the calls that are not per saved tensor: creation, groups, commits, resets,
statistics, the configuration.
"""
import ctypes
import ctypes.util
import glob
import importlib.util
import os
import shutil
import sys

c_int = ctypes.c_int
c_int64 = ctypes.c_int64
c_uint64 = ctypes.c_uint64
c_uint = ctypes.c_uint
c_size_t = ctypes.c_size_t
c_double = ctypes.c_double
c_char_p = ctypes.c_char_p
c_void_p = ctypes.c_void_p
POINTER = ctypes.POINTER

MAX_DIMS = 8
SIZE_MAX = ctypes.c_size_t(-1).value

# ofl_status_t
SUCCESS = 0
ERR_NOT_READY = 1
ERR_INVALID_ARG = 2
ERR_INVALID_USAGE = 3
ERR_NO_MEMORY = 4
ERR_TIMEOUT = 5
ERR_IO = 7
ERR_NOT_SUPPORTED = 12
ERR_CONFIG = 13
ERR_MISMATCH = 14
ERR_CORRUPT = 15
ERR_NO_SPACE = 16

# ofl_dtype_t
DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_F8_E4M3, DTYPE_F8_E5M2 = 0, 1, 2, 3, 4
DTYPE_I64, DTYPE_I32, DTYPE_I16, DTYPE_I8, DTYPE_U8, DTYPE_BOOL = 5, 6, 7, 8, 9, 10

# ofl_location_t
LOC_NONE, LOC_DEVICE, LOC_PINNED, LOC_DISK = 0, 1, 2, 3

# ofl_backend_t
BACKEND_AUTO, BACKEND_HOST, BACKEND_CUDA = 0, 1, 2

# ofl_copy_kind_t
COPY_H2D, COPY_D2H, COPY_D2D, COPY_H2H = 0, 1, 2, 3

# ofl_summary_format_t
SUMMARY_TEXT = 0

TIMEOUT_DEFAULT = -1


class DeviceParams(ctypes.Structure):
    _fields_ = [("backend", c_int), ("device_index", c_int),
                ("device_capacity_bytes", c_size_t), ("strict", c_int),
                ("jitter_seed", c_uint64), ("jitter_max_us", c_int),
                ("link_h2d_gbps", c_double), ("link_d2h_gbps", c_double),
                ("link_total_gbps", c_double)]


def device_params_init():
    return DeviceParams(BACKEND_AUTO, -1, 0, -1, 0, -1, -1.0, -1.0, -1.0)


# Out-parameter structs end with spare room: a field added to the C struct
# later must not write past the Python object (it is not read until declared).
_PAD = ("_reserved", c_uint64 * 32)


class DeviceStats(ctypes.Structure):
    _fields_ = [("device_bytes_in_use", c_size_t), ("device_bytes_peak", c_size_t),
                ("device_capacity_bytes", c_size_t), ("pinned_bytes_in_use", c_size_t),
                ("device_allocs", c_uint64), ("device_frees", c_uint64),
                ("pinned_allocs", c_uint64), ("pinned_frees", c_uint64),
                ("copies", c_uint64), ("copy_bytes", c_uint64 * 4),
                ("strict_violations", c_uint64), _PAD]


class PoolStats(ctypes.Structure):
    _fields_ = [("total_bytes", c_size_t), ("in_use_bytes", c_size_t),
                ("peak_in_use_bytes", c_size_t), ("budget_bytes", c_size_t),
                ("reserve_bytes", c_size_t)] + [
        (n, c_uint64) for n in (
            "blocks_total", "blocks_in_use", "requests", "hits", "misses",
            "frees", "budget_refusals", "pending_skips", "stream_waits",
            "backend_allocs", "backend_frees", "evictions")] + [_PAD]


class ManagerParams(ctypes.Structure):
    _fields_ = [("device", c_void_p), ("device_pool", c_void_p),
                ("offload", c_int), ("groups", c_char_p),
                ("min_offload_elems", c_int64), ("min_offload_bytes", c_int64),
                ("fraction", c_double), ("rank_delta_bytes", c_int64),
                ("max_inflight", c_int), ("host_budget_bytes", c_int64),
                ("pp_rank", c_int), ("rank", c_int), ("comm", c_void_p),
                ("dynamic_groups", c_char_p), ("summary_out", c_void_p),
                ("disk", c_void_p), ("prefetch_groups", c_int),
                ("memory_target_bytes", c_int64),
                ("device_memory_target_bytes", c_int64)]


class PlanName(ctypes.Structure):
    """ofl_plan_name_t: one group name of the auto plan."""
    _fields_ = [("name", c_char_p), ("groups", ctypes.c_uint32),
                ("chosen", ctypes.c_uint32), ("bytes", c_uint64),
                ("chosen_bytes", c_uint64), ("copy_ms", c_double),
                ("window_ms", c_double), ("exposed_ms", c_double),
                ("prefetch_lead_max", ctypes.c_uint32)]


class ManagerPlan(ctypes.Structure):
    """ofl_manager_plan_t (ofl_manager_plan_get): the auto plan of a rank."""
    _fields_ = [("automatic", c_int), ("met", c_int), ("exact", c_int),
                ("target_bytes", c_uint64), ("predicted_peak_bytes", c_uint64),
                ("peak_all_bytes", c_uint64), ("peak_none_bytes", c_uint64),
                ("shortfall_bytes", c_uint64), ("predicted_exposed_ms", c_double),
                ("predicted_stall_ms", c_double),
                ("d2h_gbps", c_double), ("h2d_gbps", c_double),
                ("rate_source", c_char_p), ("warmup_stall_ms", c_double),
                ("release_ms", c_double),
                ("iterations", c_uint64),
                ("measured_peak_bytes", c_uint64),
                ("measured_peak_max_bytes", c_uint64),
                ("measured_stall_ms", c_double), ("lead_changes", c_uint64),
                ("settled_iterations", c_uint64),
                ("measured_peak_settled_bytes", c_uint64),
                ("replans", c_uint64), ("nnames", c_size_t),
                ("names", ctypes.POINTER(PlanName))]


# recompute: the auto plan's third action (ofl_manager_group_start_flags,
# ofl_manager_group_action, ofl_manager_plan_action)
GROUP_RECOMPUTABLE = 1
ACTION_KEEP = 0
ACTION_OFFLOAD = 1
ACTION_RECOMPUTE = 2
ACTION_NAMES = {ACTION_KEEP: "keep", ACTION_OFFLOAD: "offload", ACTION_RECOMPUTE: "recompute"}


class PlanAction(ctypes.Structure):
    """ofl_plan_action_t (ofl_manager_plan_action): one name's action in the
    plan, its bytes, the predicted cost and the measured one."""
    _fields_ = [("name", c_char_p), ("action", c_int), ("recomputable", c_int),
                ("groups", ctypes.c_uint32), ("offloaded", ctypes.c_uint32),
                ("recomputed", ctypes.c_uint32), ("bytes", c_uint64),
                ("recompute_bytes", c_uint64), ("recompute_ms", c_double),
                ("predicted_ms", c_double), ("measured_ms", c_double)]


def plan_actions(m, nnames):
    """Each name's PlanAction of manager m as a dict by the C field names
    (action as "keep", "offload" or "recompute"), keyed by name; {} before
    the end of the warmup or without groups "auto"."""
    out = {}
    a = PlanAction()
    for i in range(nnames):
        if lib.ofl_manager_plan_action(m, i, ctypes.byref(a)) != 0:
            break
        d = {n: getattr(a, n) for n, _ in PlanAction._fields_}
        d["name"] = (a.name or b"").decode()
        d["action"] = ACTION_NAMES.get(a.action, str(a.action))
        d["recomputable"] = bool(a.recomputable)
        out[d["name"]] = d
    return out


def plan_dict(p):
    """A ManagerPlan as a dict by the C field names; names: a list of dicts
    (their C fields), rate_source a str."""
    out = {n: getattr(p, n) for n, _ in ManagerPlan._fields_ if n not in ("nnames", "names")}
    out["rate_source"] = (p.rate_source or b"").decode()
    out["names"] = []
    for i in range(p.nnames):
        x = p.names[i]
        d = {n: getattr(x, n) for n, _ in PlanName._fields_}
        d["name"] = (x.name or b"").decode()
        out["names"].append(d)
    return out


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(call, arg, value):
    """A byte count from an int (>= 0) or a string with an optional K/M/G/T
    suffix (powers of 1024; "KiB", "KB" and "k" read the same), as
    OFL_MEMORY_TARGET. TypeError/ValueError name call and arg."""
    if isinstance(value, bool) or not isinstance(value, (int, str, bytes)):
        raise TypeError("%s: %s must be an int (bytes) or a str such as \"512M\" or \"2G\", "
                        "got %s" % (call, arg, type(value).__name__))
    if isinstance(value, int):
        if value < 0:
            raise ValueError("%s: %s must be >= 0 bytes, got %d" % (call, arg, value))
        return value
    text = value.decode() if isinstance(value, bytes) else value
    t = text.strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix) and t[-len(suffix) - 1] in _SIZE_UNITS:
            t = t[:-len(suffix)]
            break
    unit = t[-1:] if t[-1:] in _SIZE_UNITS and t[-1:] != "" else ""
    num = t[:-1] if unit else t
    try:
        v = float(num.strip())
    except ValueError:
        v = -1.0
    if not num.strip() or not v >= 0 or v == float("inf"):
        raise ValueError("%s: %s %r is not a size (bytes, or a number with K, M or G, "
                         "such as \"512M\")" % (call, arg, text))
    return int(v * _SIZE_UNITS[unit])


class Allocator(ctypes.Structure):
    """ofl_allocator_t: the application's memory for a pool's blocks."""
    _fields_ = [("ctx", c_void_p), ("alloc", c_void_p), ("free", c_void_p)]


class PoolParams(ctypes.Structure):
    _fields_ = [("kind", c_int), ("name", c_char_p), ("budget_bytes", c_size_t),
                ("reserve_bytes", c_size_t), ("evict", c_int), ("segments", c_int),
                ("allocator", ctypes.POINTER(Allocator))]


POOL_DEVICE = 0
POOL_BUDGET_FROM_ENV = (1 << (8 * ctypes.sizeof(c_size_t))) - 1


def pool_params_init():
    """OFL_POOL_PARAMS_INIT."""
    return PoolParams(POOL_DEVICE, None, POOL_BUDGET_FROM_ENV, 0, 1, 1, None)


def manager_params_init():
    return ManagerParams(None, None, -1, None, -1, -1, -1.0, -1, -1, -1, 0,
                         -1, None, None, None, None, 0, -1, -1)


MANAGER_STAT_FIELDS = (
    "iterations", "offloaded_tensors", "offloaded_bytes", "reloaded_tensors",
    "reloaded_bytes", "inline_reloads", "stalls", "stall_ns", "kept_groups",
    "kept_tensors", "budget_kept_tensors", "budget_kept_bytes", "disk_tensors",
    "disk_bytes", "dedup_tensors", "unpopped_tensors")


class ManagerStats(ctypes.Structure):
    _fields_ = [(n, c_uint64) for n in MANAGER_STAT_FIELDS] + [
        ("device_bytes_peak", c_size_t), ("host_bytes_peak", c_size_t),
        ("steady_device_pool_peak_bytes", c_size_t), _PAD]


class ManagerGroupStats(ctypes.Structure):
    _fields_ = [("name", c_char_p)] + [(n, c_uint64) for n in (
        "offloaded_tensors", "offloaded_bytes", "reloaded_tensors",
        "reloaded_bytes", "inline_reloads", "stalls", "stall_ns",
        "kept_groups", "budget_kept_bytes", "summary_bytes")] + [_PAD]


class DiskParams(ctypes.Structure):
    _fields_ = [("dev", c_void_p), ("bounce_pool", c_void_p),
                ("bounce_budget_bytes", c_size_t), ("dir", c_char_p),
                ("budget_bytes", c_size_t), ("initial_bytes", c_size_t),
                ("grow_bytes", c_size_t), ("preallocate", c_int),
                ("queue_depth", c_int), ("block_bytes", c_size_t),
                ("prefetch_groups", c_int), ("checksum", c_int),
                ("direct", c_int), ("engine", c_int), ("groups", c_char_p),
                ("rank", c_int), ("keep_bytes", c_size_t)]


def disk_params_init():
    return DiskParams(None, None, SIZE_MAX, None, SIZE_MAX, 0, 0, -1, 0, 0,
                      -1, -1, -1, 0, None, -1, SIZE_MAX)


class DiskStats(ctypes.Structure):
    _fields_ = [("bytes_written", c_uint64), ("bytes_read", c_uint64),
                ("write_gbps", c_double), ("read_gbps", c_double),
                ("writes", c_uint64), ("reads", c_uint64),
                ("writes_skipped", c_uint64), ("bytes_skipped", c_uint64),
                ("requests", c_uint64), ("queue_depth", c_int),
                ("queue_depth_max", c_int)] + [(n, c_uint64) for n in (
        "reloads", "prefetch_hits", "stalls", "stall_ns", "faults_enospc",
        "faults_eio", "faults_short", "faults_corrupt", "budget_refusals",
        "buffer_refusals", "keep_hits", "keep_drops")] + [
        ("keep_bytes", c_size_t), ("kept_bytes", c_size_t),
        ("file_bytes", c_size_t), ("budget_bytes", c_size_t),
        ("extent_bytes", c_size_t), ("peak_extent_bytes", c_size_t),
        ("extents", c_uint64), ("direct", c_int), ("uring", c_int),
        ("checksum", c_int), ("degraded", c_int), _PAD]


class StagerParams(ctypes.Structure):
    _fields_ = [("cache_staged", c_int), ("pin_memory", c_int),
                ("type_check", c_int), ("async_staging", c_int),
                ("stream", c_void_p), ("max_inflight_saves", c_int),
                ("when_busy", c_int)]


class StagerStats(ctypes.Structure):
    _fields_ = [(n, c_uint64) for n in (
        "stages", "tensors_staged", "storages_copied", "shared_tensors",
        "bytes_copied", "buffer_allocs", "buffer_bytes", "cache_reuses",
        "cache_rebuilds", "saves_started", "saves_completed", "saves_failed",
        "save_busy_waits")] + [_PAD]


class NamedTensor(ctypes.Structure):
    _fields_ = [("name", c_char_p), ("tensor", c_void_p)]


class SafetensorsEntry(ctypes.Structure):
    _fields_ = [("name", c_char_p), ("dtype", c_int), ("ndim", c_int),
                ("shape", c_int64 * MAX_DIMS), ("data", c_void_p),
                ("bytes", c_size_t)]


class SafetensorsKV(ctypes.Structure):
    _fields_ = [("key", c_char_p), ("value", c_char_p)]


_P = c_void_p
_PP = POINTER(c_void_p)
_I64P = POINTER(c_int64)

# name: (restype, argtypes)
_PROTOS = {
    "ofl_status_str": (c_char_p, [c_int]),
    "ofl_config_get": (c_char_p, [c_char_p]),
    "ofl_last_error": (c_char_p, []),
    "ofl_clear_error": (None, []),
    # device
    "ofl_device_open": (c_int, [POINTER(DeviceParams), _PP]),
    "ofl_device_close": (None, [_P]),
    "ofl_device_trace_flush": (c_int, [_P]),
    "ofl_device_backend": (c_int, [_P]),
    "ofl_device_adopt_host_memory": (c_int, [_P, c_int]),
    "ofl_device_ordinal": (c_int, [_P]),
    "ofl_device_get_stats": (None, [_P, POINTER(DeviceStats)]),
    "ofl_device_compute_stream": (_P, [_P]),
    "ofl_device_set_compute_stream": (None, [_P, _P]),
    "ofl_stream_wrap_native": (c_int, [_P, _P, c_char_p, _PP]),
    "ofl_stream_native": (_P, [_P]),
    "ofl_stream_destroy": (c_int, [_P]),
    "ofl_stream_synchronize": (c_int, [_P, c_int64]),
    "ofl_event_create": (c_int, [_P, _PP]),
    "ofl_manager_forward_record": (c_int, [_P, _P]),
    "ofl_manager_backward_record": (c_int, [_P, _P]),
    "ofl_event_destroy": (None, [_P]),
    "ofl_event_record": (c_int, [_P, _P]),
    "ofl_event_query": (c_int, [_P]),
    "ofl_event_synchronize": (c_int, [_P, c_int64]),
    "ofl_memcpy_async": (c_int, [_P, _P, c_size_t, c_int, _P]),
    # tensor
    "ofl_tensor_wrap": (c_int, [_P, _I64P, c_int, c_int, c_int, _P, _P, _PP]),
    "ofl_tensor_wrap_flags": (c_int, [_P, _I64P, c_int, c_int, c_int, _P, _P, c_uint, _PP]),
    "ofl_tensor_create": (c_int, [_I64P, c_int, c_int, _PP]),
    "ofl_tensor_destroy": (c_int, [_P]),
    "ofl_tensor_destroy_slot": (c_int, [_PP, _P]),
    "ofl_tensor_view": (c_int, [_P, c_size_t, _I64P, c_int, c_int, _PP]),
    "ofl_tensor_alias": (c_int, [_P, _PP]),
    "ofl_tensor_release_storage_after": (c_int, [_P, _P]),
    "ofl_tensor_data": (_P, [_P]),
    "ofl_tensor_bytes": (c_size_t, [_P]),
    "ofl_tensor_has_storage": (c_int, [_P]),
    "ofl_tensor_location": (c_int, [_P]),
    "ofl_tensor_set_flags": (None, [_P, ctypes.c_uint]),
    "ofl_tensor_ndim": (c_int, [_P]),
    "ofl_tensor_shape": (_I64P, [_P]),
    "ofl_tensor_dtype": (c_int, [_P]),
    # pool
    "ofl_pool_get_stats": (None, [_P, POINTER(PoolStats)]),
    "ofl_pool_alloc": (c_int, [_P, _I64P, c_int, c_int, _P, _PP]),
    "ofl_pool_create": (c_int, [_P, _P, _PP]),
    "ofl_pool_destroy": (None, [_P]),
    # manager
    "ofl_manager_create": (c_int, [POINTER(ManagerParams), _PP]),
    "ofl_manager_destroy": (None, [_P]),
    "ofl_manager_device": (_P, [_P]),
    "ofl_manager_d2h_stream": (_P, [_P]),
    "ofl_manager_h2d_stream": (_P, [_P]),
    "ofl_manager_host_pool": (_P, [_P]),
    "ofl_manager_device_pool": (_P, [_P]),
    "ofl_manager_chunk_begin": (c_int, [_P, c_int, c_int]),
    "ofl_manager_group_start": (c_int, [_P, c_char_p]),
    "ofl_manager_tensor_push": (c_int, [_P, _P, POINTER(c_uint64)]),
    "ofl_manager_group_commit": (c_int, [_P, c_char_p, _PP, c_size_t, c_int]),
    "ofl_manager_flush_delayed_groups": (c_int, [_P]),
    "ofl_manager_group_push_bytes": (c_int, [_P, c_char_p, _P, c_size_t, c_int,
                                             POINTER(c_uint64), _PP]),
    "ofl_manager_commit_open_groups": (c_int, [_P, POINTER(c_size_t)]),
    "ofl_manager_group_backward_begin": (c_int, [_P, c_char_p]),
    "ofl_manager_tensor_pop": (c_int, [_P, c_uint64, _PP]),
    "ofl_manager_group_backward_end": (c_int, [_P, c_char_p]),
    "ofl_manager_reset": (c_int, [_P]),
    "ofl_manager_is_warmup": (c_int, [_P]),
    "ofl_manager_set_device_peak": (None, [_P, c_size_t]),
    "ofl_manager_mark_not_offloadable": (None, [_P]),
    "ofl_manager_disable_offload": (None, [_P]),
    "ofl_manager_enable_offload": (None, [_P]),
    "ofl_manager_set_forward_only": (None, [_P, c_int]),
    "ofl_manager_synchronize": (c_int, [_P, c_int64]),
    "ofl_manager_summary_bytes": (c_int, [_P, c_char_p, POINTER(c_uint64)]),
    "ofl_manager_summary_total_bytes": (c_uint64, [_P]),
    "ofl_manager_summary": (_P, [_P]),
    "ofl_manager_get_stats": (None, [_P, POINTER(ManagerStats)]),
    "ofl_manager_plan_get": (c_int, [_P, POINTER(ManagerPlan)]),
    "ofl_manager_group_start_flags": (c_int, [_P, c_char_p, ctypes.c_uint, c_size_t]),
    "ofl_manager_group_action": (c_int, [_P, c_char_p, POINTER(c_int)]),
    "ofl_manager_set_plan_recompute": (c_int, [_P, c_int]),
    "ofl_manager_plan_action": (c_int, [_P, c_size_t, POINTER(PlanAction)]),
    "ofl_manager_group_count": (c_size_t, [_P]),
    "ofl_manager_group_stats": (c_int, [_P, c_size_t, POINTER(ManagerGroupStats)]),
    # summary
    "ofl_summary_render": (c_int, [_P, c_int, POINTER(ctypes.c_void_p), POINTER(c_size_t)]),
    "ofl_summary_from_tables": (c_int, [POINTER(_P), c_int, _PP]),
    "ofl_summary_destroy": (None, [_P]),
    "ofl_summary_ngroups": (c_size_t, [_P]),
    "ofl_summary_group_name": (c_char_p, [_P, c_size_t]),
    "ofl_summary_bytes": (c_uint64, [_P, c_int, c_size_t]),
    "ofl_byte_table_create": (c_int, [_PP]),
    "ofl_byte_table_destroy": (None, [_P]),
    "ofl_byte_table_add": (c_int, [_P, c_char_p, c_uint64]),
    # disk
    "ofl_disk_open": (c_int, [POINTER(DiskParams), _PP]),
    "ofl_disk_close": (None, [_P]),
    "ofl_disk_get_stats": (None, [_P, POINTER(DiskStats)]),
    "ofl_disk_is_degraded": (c_int, [_P]),
    "ofl_disk_clear_degraded": (None, [_P]),
    "ofl_disk_extent_create": (c_int, [_P, c_size_t, _PP]),
    "ofl_disk_extent_data": (_P, [_P]),
    "ofl_disk_extent_write": (c_int, [_P]),
    "ofl_disk_extent_query": (c_int, [_P]),
    "ofl_disk_extent_wait": (c_int, [_P, c_int64]),
    "ofl_disk_extent_state": (c_int, [_P]),
    "ofl_disk_extent_prefetch": (c_int, [_P]),
    "ofl_disk_extent_reload": (c_int, [_P, c_int64, _PP]),
    "ofl_disk_extent_destroy": (c_int, [_P]),
    # staging
    "ofl_stager_create": (c_int, [_P, POINTER(StagerParams), _PP]),
    "ofl_stager_destroy": (c_int, [_P]),
    "ofl_stager_stage": (c_int, [_P, POINTER(NamedTensor), c_size_t, _PP]),
    "ofl_stager_should_synchronize_after_execute": (c_int, [_P]),
    "ofl_stager_synchronize": (c_int, [_P, c_int64]),
    "ofl_stager_get_stats": (None, [_P, POINTER(StagerStats)]),
    "ofl_staged_count": (c_size_t, [_P]),
    "ofl_staged_tensor": (_P, [_P, c_size_t]),
    "ofl_staged_status": (c_int, [_P]),
    "ofl_staged_release": (None, [_P]),
    # safetensors
    "ofl_safetensors_write": (c_int, [c_char_p, POINTER(SafetensorsEntry), c_size_t,
                                      POINTER(SafetensorsKV), c_size_t]),
    "ofl_safetensors_open": (c_int, [c_char_p, _PP]),
    "ofl_safetensors_close": (None, [_P]),
    "ofl_safetensors_count": (c_size_t, [_P]),
    "ofl_safetensors_get": (c_int, [_P, c_size_t, POINTER(SafetensorsEntry)]),
    "ofl_safetensors_metadata_count": (c_size_t, [_P]),
    "ofl_safetensors_metadata": (c_int, [_P, c_size_t, POINTER(SafetensorsKV)]),
}


def _candidates():
    env = os.environ.get("OFL_LIBRARY")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for p in sorted(glob.glob(os.path.join(here, "_libs", "libofl.so*"))):
        yield p
    repo = os.path.dirname(os.path.dirname(here))  # python/ofl -> repo root
    if os.path.exists(os.path.join(repo, "include", "ofl", "manager.h")):
        for d in ("build", "build-release", "build-py"):
            for name in ("libofl.so", "libofl.so.0"):
                p = os.path.join(repo, d, name)
                if os.path.exists(p):
                    yield p
    # A `meson install` prefix whose bin is on PATH: its lib directory
    # (lib, lib64 or lib/<multiarch>), next to the ofl-info found there.
    info = shutil.which("ofl-info")
    if info is not None:
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(info)))
        for pattern in ("lib*/libofl.so.0", "lib*/*/libofl.so.0"):
            for p in sorted(glob.glob(os.path.join(prefix, pattern))):
                yield p
    found = ctypes.util.find_library("ofl")
    yield found or "libofl.so.0"
    yield "libofl.so"


def _load():
    # libofl dlopens libcudart and libnccl (by soname) at its first cuda
    # device or NCCL comm; torch bundles its own copies with the same
    # sonames. Importing torch first makes libofl use the copies torch
    # loaded (the same C APIs) instead of loading older system ones that
    # torch would then find in place of its own.
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401
    errors = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append("%s: %s" % (path, e))
    raise ImportError(
        "ofl: cannot load libofl (%s). `pip install ./python` from a checkout "
        "of the repository builds it into the package; or build it (meson "
        "setup build && ninja -C build) and set OFL_LIBRARY=/path/to/"
        "libofl.so.0, or put the lib directory of a `meson install` prefix "
        "on LD_LIBRARY_PATH" % "; ".join(errors))


lib, path = _load()
for _name, (_res, _args) in _PROTOS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


# The package's own variables: OFL_LIBRARY (above), OFL_PYTHON_EXT (it used
# to select saved-tensor hooks over ctypes, which are gone: ofl.torch._core
# warns that 0 no longer does anything) and OFL_EXT_DLPACK (ofl._ext: 0 hands
# reloaded blocks to torch with torch.frombuffer instead of DLPack).
_PACKAGE_VARS = ("OFL_LIBRARY", "OFL_PYTHON_EXT", "OFL_EXT_DLPACK")


def _running_ofl_info():
    """Whether this process is `python -m ofl.info`, which hands over to
    ofl-info: that reports every configuration problem itself, once."""
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b == "ofl.info" for a, b in zip(argv, argv[1:]))


def _load_config_quietly():
    """The library warns once, at its first configuration load, about every
    OFL_* variable it does not know; the package's own are hidden from the C
    environment during that first load. Under `python -m ofl.info` the load
    says nothing (ofl-info, or the fallback's check, says it once)."""
    if _running_ofl_info():
        lib.ofl_log_set_level(0)
    saved = {n: os.environ.pop(n) for n in _PACKAGE_VARS if n in os.environ}
    try:
        lib.ofl_config_get(b"OFL_BACKEND")
    finally:
        os.environ.update(saved)


_load_config_quietly()

# Every error a call returns is raised as an OflError carrying its message
# (ofl._errors): the library logs it at INFO only, so that a Python user
# reads it once, not first as a C WARN line on stderr.
lib.ofl_error_logging_set.argtypes = [ctypes.c_int]
lib.ofl_error_logging_set.restype = None
lib.ofl_error_logging_set(0)

_libc = ctypes.CDLL(None)
_libc.free.argtypes = [c_void_p]
_libc.free.restype = None


def free(ptr):
    _libc.free(ptr)

