"""Megatron-Core's fine-grained activation offloading API, by the same names,
over ofl's manager (megatron/core/pipeline_parallel/
fine_grained_activation_offload.py, core_r0.17 names plus main's switches).

    init_chunk_handler(vp_size, vp_stage, min_offloaded_tensor_size)
                                        -> ofl_manager_chunk_begin (every
                                           microbatch's forward, as Megatron's
                                           GPTModel.preprocess does)
    x = fine_grained_offloading_group_start(x, "core_attn")
                                        -> GroupStart identity op:
                                           forward ofl_manager_group_start,
                                           backward ofl_manager_group_backward_end
    with get_context(True): y = module(x)   saved-tensor hooks:
                                           pack -> ofl_manager_tensor_push,
                                           unpack -> ofl_manager_tensor_pop
    y = fine_grained_offloading_group_commit(y, "core_attn", [x])
                                        -> GroupCommit identity op:
                                           forward ofl_manager_group_commit,
                                           backward ofl_manager_group_backward_begin
    PipelineOffloadManager.get_instance().reset()   end of each schedule call

A forward under torch.no_grad() is forward-only (ofl_manager_set_forward_only):
it offloads nothing and neither consumes the warmup nor creates chunks; the
reset after it turns training mode back on. The first reset after a training
pass ends the warmup and prints the offload summary (rank 0 of
torch.distributed's default group when it is initialized, with every rank's
row gathered there; this process's row otherwise).

Knobs (first creation only; later calls return the instance as it is):
``fraction`` (activation_offload_fraction), ``rank_delta_bytes``
(delta_offload_bytes_across_pp_ranks), ``pp_rank``, ``max_inflight``
(max_inflight_offloads; 0 here is unlimited), ``groups`` (offload_modules, a
list or comma string; default every name), ``prefetch_groups``,
``host_budget_bytes``. Unset ones come from OFL_* (OFL_OFFLOAD_FRACTION,
OFL_RANK_DELTA_BYTES, OFL_MAX_INFLIGHT, OFL_OFFLOAD_GROUPS, ...).
min_offloaded_tensor_size is in elements, as in Megatron (default
OFL_MIN_OFFLOAD_ELEMS, else 1048576); tensors below it are never handed to
ofl (they stay in Python, uncounted by the C statistics).
"""
import contextlib
import os

import torch

from ._core import ManagerCore, _env_int

__all__ = [
    "PipelineOffloadManager", "FineGrainedActivationOffloadingInterface",
    "fine_grained_offloading_group_start", "fine_grained_offloading_group_commit",
    "init_chunk_handler", "flush_delayed_groups", "mark_not_offloadable",
    "disable_offload", "enable_offload", "forward_record", "backward_record",
    "reset", "get_context",
]


class PipelineOffloadManager:
    """The process-wide manager (Megatron's singleton). Also the context
    manager that installs the saved-tensor hooks (get_context(True))."""

    _instance = None

    def __init__(self, **knobs):
        groups = knobs.pop("groups", None)
        if groups is None:
            groups = os.environ.get("OFL_OFFLOAD_GROUPS", "")
        if not isinstance(groups, (str, bytes)):
            groups = ",".join(groups)
        if isinstance(groups, str):
            groups = groups.encode()
        unknown = set(knobs) - {"fraction", "rank_delta_bytes", "pp_rank", "max_inflight",
                                "prefetch_groups", "host_budget_bytes", "summary"}
        if unknown:
            raise TypeError("PipelineOffloadManager: unknown knob(s) %s" % sorted(unknown))
        knobs.setdefault("summary", True)
        self._core = ManagerCore(groups=groups, **knobs)
        self._core.min_elems = _env_int("OFL_MIN_OFFLOAD_ELEMS", 1 << 20)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._core.pack, self._core.unpack)
        self._depth = 0

    # -- singleton
    @classmethod
    def get_instance(cls, **knobs):
        if cls._instance is None:
            cls._instance = cls(**knobs)
        return cls._instance

    @classmethod
    def reset_instance(cls, **knobs):
        """Destroys the instance (the C manager goes once the last reloaded
        tensor that lives in its memory is freed) and creates a new one."""
        if cls._instance is not None:
            cls._instance._core.close()
        cls._instance = None
        cls._instance = cls(**knobs)
        return cls._instance

    @classmethod
    def destroy_instance(cls):
        if cls._instance is not None:
            cls._instance._core.close()
        cls._instance = None

    # -- the context (saved-tensor hooks)
    def __enter__(self):
        self._hooks.__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        return self._hooks.__exit__(*exc)

    # -- chunks and iterations
    def init_model_chunk_offload_handler(self, vp_size=None, vp_stage=None,
                                         min_offloaded_tensor_size=None):
        core = self._core
        if min_offloaded_tensor_size is not None:
            core.min_elems = int(min_offloaded_tensor_size)
        core.set_forward_only(not torch.is_grad_enabled())
        core.chunk_begin(vp_size or 1, vp_stage or 0)

    def reset(self):
        """End of a schedule call (training or evaluation). The first one
        after a training pass ends the warmup and prints the summary."""
        core = self._core
        try:
            core.reset()
        finally:
            core.set_forward_only(False)

    def disable_offload(self):
        self._core.set_enabled(False)

    def enable_offload(self):
        self._core.set_enabled(True)

    def flush_delayed_groups(self):
        self._core.flush_delayed()

    def synchronize(self):
        self._core.synchronize()

    # -- observability
    def stats(self):
        """ofl_manager_get_stats as a dict by the C field names."""
        return self._core.stats()

    def group_stats(self):
        return self._core.group_stats()

    def pool_stats(self):
        return self._core.pool_stats()

    def device_stats(self):
        return self._core.rt.stats()

    @property
    def is_warmup(self):
        return self._core.is_warmup()

    @property
    def do_offload(self):
        return self._core.active

    @property
    def offload_summary_bytes(self):
        return {n: self._core.summary_bytes(n) for n in self._core.group_stats()}

    @property
    def offload_summary_total_bytes(self):
        return self._core.summary_total_bytes()

    @property
    def summary_text(self):
        """The summary table printed at the end of warmup: every rank's row
        on rank 0 of torch.distributed's default group (this rank's own row
        on the others, and without torch.distributed)."""
        return self._core.summary_text

    @property
    def summary_rows(self):
        """The bytes behind summary_text: one {group name: bytes} per rank
        (rank 0; [this rank's] elsewhere)."""
        return self._core.summary_rows

    @property
    def d2h_stream(self):
        return _torch_stream(_lib_stream(self._core, "d2h"))

    @property
    def h2d_stream(self):
        return _torch_stream(_lib_stream(self._core, "h2d"))


def _lib_stream(core, which):
    from .._lib import lib
    fn = lib.ofl_manager_d2h_stream if which == "d2h" else lib.ofl_manager_h2d_stream
    return lib.ofl_stream_native(fn(core.m))


def _torch_stream(native):
    """torch view of an ofl stream (cuda only; None on the host backend)."""
    if not native:
        return None
    return torch.cuda.ExternalStream(native)


# ---- identity autograd markers ----------------------------------------------------


class _GroupStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, core, name):
        core.group_start(name)
        ctx.core = core
        ctx.name = name
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.core.backward_end(ctx.name)
        return grad, None, None


class _GroupCommit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, core, name, forced, delay):
        core.commit(name, forced or (), delay)
        ctx.core = core
        ctx.name = name
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.core.backward_begin(ctx.name)
        return grad, None, None, None, None


class _BackwardRecord(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, event, h2d):
        ctx.event = event
        ctx.h2d = h2d
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.event.record()
        torch.cuda.current_stream().wait_stream(ctx.h2d)
        return grad, None, None


def _bname(name):
    return name.encode() if isinstance(name, str) else name


def fine_grained_offloading_group_start(tensor, name):
    """Marks the start of group ``name``; returns the tensor (identity) that
    must replace the module input."""
    mgr = PipelineOffloadManager.get_instance()
    core = mgr._core
    if not torch.is_grad_enabled():
        core.set_forward_only(True)
    return _GroupStart.apply(tensor, core, _bname(name))


def fine_grained_offloading_group_commit(tensor, name, forced_released_tensors=None,
                                         delay_offload=False):
    """Ends group ``name`` (it must be open: another name is an ofl error)
    and offloads its saved tensors after the compute so far;
    forced_released_tensors lose their storage once copied. ``tensor`` may be
    a tensor, a tuple or a list (the marker goes on element 0)."""
    core = PipelineOffloadManager.get_instance()._core
    forced = list(forced_released_tensors or ())
    bn = _bname(name)
    if isinstance(tensor, (tuple, list)):
        items = list(tensor)
        items[0] = _GroupCommit.apply(items[0], core, bn, forced, bool(delay_offload))
        return type(tensor)(items)
    return _GroupCommit.apply(tensor, core, bn, forced, bool(delay_offload))


def init_chunk_handler(vp_size=None, vp_stage=None, min_offloaded_tensor_size=None):
    PipelineOffloadManager.get_instance().init_model_chunk_offload_handler(
        vp_size, vp_stage, min_offloaded_tensor_size)


def flush_delayed_groups():
    PipelineOffloadManager.get_instance().flush_delayed_groups()


def mark_not_offloadable(tensor):
    """The tensor is never offloaded (Megatron sets it on parameters)."""
    if tensor is not None:
        tensor._ofl_not_offloadable = True
        tensor.offloading_activation = False
    return tensor


def disable_offload():
    PipelineOffloadManager.get_instance().disable_offload()


def enable_offload():
    PipelineOffloadManager.get_instance().enable_offload()


def forward_record(event):
    """Graph-capture boundary (forward): records event on the current stream,
    which then waits for the D2H stream. No-op on the host backend."""
    mgr = PipelineOffloadManager.get_instance()
    if not mgr._core.is_cuda:
        return
    event.record()
    torch.cuda.current_stream().wait_stream(mgr.d2h_stream)


def backward_record(tensor, event):
    """Identity whose backward records event and makes the current stream
    wait for the H2D stream. No-op (returns tensor) on the host backend."""
    mgr = PipelineOffloadManager.get_instance()
    if not mgr._core.is_cuda:
        return tensor
    return _BackwardRecord.apply(tensor, event, mgr.h2d_stream)


def reset():
    PipelineOffloadManager.get_instance().reset()


def get_context(flag):
    """The saved-tensor hooks when flag, else a null context."""
    return PipelineOffloadManager.get_instance() if flag else contextlib.nullcontext()


class FineGrainedActivationOffloadingInterface:
    """``with FineGrainedActivationOffloadingInterface(offload, x, name) as x:``
    starts group ``name`` on x (use the returned tensor as the module input)
    and installs the saved-tensor hooks for the block; commit afterwards
    with group_commit (or fine_grained_offloading_group_commit)."""

    def __init__(self, offload, tensor, name):
        self.offload = offload
        self.tensor = tensor
        self.name = name
        self._ctx = None

    def __enter__(self):
        if not self.offload:
            return self.tensor
        t = fine_grained_offloading_group_start(self.tensor, self.name)
        self._ctx = PipelineOffloadManager.get_instance()
        self._ctx.__enter__()
        return t

    def __exit__(self, *exc):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            return ctx.__exit__(*exc)
        return False

    # Megatron's static helpers
    init_chunk_handler = staticmethod(init_chunk_handler)
    get_context = staticmethod(get_context)
    group_commit = staticmethod(fine_grained_offloading_group_commit)
    mark_not_offloadable = staticmethod(mark_not_offloadable)
    forward_record = staticmethod(forward_record)
    backward_record = staticmethod(backward_record)
    reset = staticmethod(reset)
    flush_delayed_groups = staticmethod(flush_delayed_groups)
    disable_offload = staticmethod(disable_offload)
    enable_offload = staticmethod(enable_offload)

    @staticmethod
    def reset_instance():
        PipelineOffloadManager.reset_instance()
