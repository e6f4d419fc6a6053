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
import functools
import os
import re

import torch

from .. import _lib
from .._errors import OflError
from ._core import ManagerCore, _env_int

__all__ = [
    "PipelineOffloadManager", "FineGrainedActivationOffloadingInterface",
    "fine_grained_offloading_group_start", "fine_grained_offloading_group_commit",
    "init_chunk_handler", "flush_delayed_groups", "mark_not_offloadable",
    "disable_offload", "enable_offload", "forward_record", "backward_record",
    "reset", "get_context",
]


# The C calls behind the Python ones, as a Python user typed them.
_PY_NAMES = [
    (re.compile(r'ofl_manager_group_start\("([^"]*)"\)'),
     r'fine_grained_offloading_group_start(tensor, "\1")'),
    (re.compile(r'ofl_manager_group_commit\("([^"]*)"\)'),
     r'fine_grained_offloading_group_commit(tensor, "\1")'),
    (re.compile(r"ofl_manager_group_backward_begin"),
     "the backward of fine_grained_offloading_group_commit"),
    (re.compile(r"ofl_manager_group_backward_end"),
     "the backward of fine_grained_offloading_group_start"),
    (re.compile(r"ofl_manager_group_start"), "fine_grained_offloading_group_start"),
    (re.compile(r"ofl_manager_group_commit"), "fine_grained_offloading_group_commit"),
    (re.compile(r"ofl_manager_flush_delayed_groups"), "flush_delayed_groups()"),
    (re.compile(r"ofl_manager_chunk_begin"), "init_chunk_handler"),
    (re.compile(r"ofl_manager_reset"), "reset()"),
    (re.compile(r"ofl_manager_tensor_push"), "saving a tensor for backward"),
    (re.compile(r"ofl_manager_tensor_pop"), "unpacking a saved tensor"),
]


def _pythonize(text):
    for rx, repl in _PY_NAMES:
        text = rx.sub(repl, text)
    return text


def _py_errors(call):
    """Decorator: ofl errors raised inside the Python call ``call`` name the
    Python calls, not the C ones."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*a, **kw):
            try:
                return fn(*a, **kw)
            except OflError as e:
                raise OflError(e.status, _pythonize(e.message), call) from None
        return inner
    return wrap


def _check_name(call, name):
    if not isinstance(name, (str, bytes)) or not name:
        raise TypeError("%s: name must be a non-empty str (a group name such as \"core_attn\"), "
                        "got %r" % (call, name))


def _check_tensor(call, arg, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: %s must be a torch.Tensor, got %s" % (call, arg, type(t).__name__))


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
        self._knobs = dict(knobs, groups=groups)
        self._new_core()
        self._depth = 0

    def _new_core(self, min_elems=None):
        self._core = ManagerCore(**self._knobs)
        self._core.min_elems = (_env_int("OFL_MIN_OFFLOAD_ELEMS", 1 << 20) if min_elems is None
                                else min_elems)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._core.pack, self._core.unpack)

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
    @_py_errors("init_chunk_handler")
    def init_model_chunk_offload_handler(self, vp_size=None, vp_stage=None,
                                         min_offloaded_tensor_size=None):
        core = self._core
        if min_offloaded_tensor_size is not None:
            core.min_elems = int(min_offloaded_tensor_size)
        core.set_forward_only(not torch.is_grad_enabled())
        core.chunk_begin(vp_size or 1, vp_stage or 0)

    @_py_errors("reset()")
    def reset(self):
        """End of a schedule call (training or evaluation). The first one
        after a training pass ends the warmup and prints the summary.

        After a step abandoned by an exception (groups left open, backward
        never run) it recovers: the open groups are closed, the saved
        tensors of the step are dropped, and a warmup that the step cut
        short starts again with the next step."""
        core = self._core
        abandoned = bool(core.open)
        if abandoned:
            for g in reversed(list(core.open)):
                try:
                    core.commit(g.name)
                except OflError:
                    core.open.remove(g) if g in core.open else None
        was_warmup = core.is_warmup()
        try:
            core.reset()
        except OflError as e:
            if not abandoned:
                raise
            if e.status != _lib.ERR_MISMATCH and core.open:
                raise
            abandoned = True
        finally:
            core.set_forward_only(False)
        if abandoned and was_warmup:
            # the warmup's record is of a cut step: a new manager records anew
            min_elems = core.min_elems
            enabled = core.enabled
            core.close()
            self._new_core(min_elems)
            self._core.set_enabled(enabled)

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


def _once(ctx, call):
    """A marker's backward runs once per forward (Megatron's interface)."""
    if ctx.ran and ctx.core.enabled:
        raise RuntimeError(
            "ofl.torch: the backward of %s(tensor, %r) ran a second time (retain_graph=True, "
            "or a second backward through the same graph). Megatron-style offloading supports "
            "one backward per forward, as Megatron-Core does: use "
            "ofl.torch.offload_activations() for graphs used more than once, or call "
            "disable_offload() for such steps" % (call, ctx.name.decode()))
    ctx.ran = True


class _GroupStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, core, name):
        core.group_start(name)
        ctx.core = core
        ctx.name = name
        ctx.ran = False
        return tensor

    @staticmethod
    @_py_errors("backward of fine_grained_offloading_group_start")
    def backward(ctx, grad):
        _once(ctx, "fine_grained_offloading_group_start")
        ctx.core.backward_end(ctx.name)
        return grad, None, None


class _GroupCommit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, core, name, forced, delay):
        core.commit(name, forced or (), delay)
        ctx.core = core
        ctx.name = name
        ctx.ran = False
        return tensor

    @staticmethod
    @_py_errors("backward of fine_grained_offloading_group_commit")
    def backward(ctx, grad):
        _once(ctx, "fine_grained_offloading_group_commit")
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


def _check_grad(call, t):
    if torch.is_grad_enabled() and not t.requires_grad:
        raise ValueError(
            "%s: the tensor does not require grad, so the group's backward marker would never "
            "run; pass the module input (or output) that autograd differentiates through, or "
            "run a forward-only pass under torch.no_grad()" % call)


@_py_errors("fine_grained_offloading_group_start")
def fine_grained_offloading_group_start(tensor, name):
    """Marks the start of group ``name``; returns the tensor (identity) that
    must replace the module input."""
    call = "fine_grained_offloading_group_start"
    _check_tensor(call, "tensor", tensor)
    _check_name(call, name)
    mgr = PipelineOffloadManager.get_instance()
    core = mgr._core
    if not torch.is_grad_enabled():
        core.set_forward_only(True)
    else:
        _check_grad(call, tensor)
    return _GroupStart.apply(tensor, core, _bname(name))


@_py_errors("fine_grained_offloading_group_commit")
def fine_grained_offloading_group_commit(tensor, name, forced_released_tensors=None,
                                         delay_offload=False):
    """Ends group ``name`` (it must be open: another name is an ofl error)
    and offloads its saved tensors after the compute so far;
    forced_released_tensors lose their storage once copied. ``tensor`` may be
    a tensor, a tuple or a list (the marker goes on element 0)."""
    call = "fine_grained_offloading_group_commit"
    _check_name(call, name)
    if isinstance(tensor, (tuple, list)):
        if not tensor:
            raise TypeError("%s: tensor is an empty %s; pass the module output (a tensor, or a "
                            "tuple whose first element is a tensor)" % (call, type(tensor).__name__))
        _check_tensor(call, "tensor[0]", tensor[0])
        first = tensor[0]
    else:
        _check_tensor(call, "tensor", tensor)
        first = tensor
    if forced_released_tensors is None:
        forced = []
    elif isinstance(forced_released_tensors, (list, tuple)):
        forced = list(forced_released_tensors)
        for i, f in enumerate(forced):
            if f is not None:
                _check_tensor(call, "forced_released_tensors[%d]" % i, f)
    else:
        raise TypeError("%s: forced_released_tensors must be a list of tensors, got %s"
                        % (call, type(forced_released_tensors).__name__))
    core = PipelineOffloadManager.get_instance()._core
    if torch.is_grad_enabled():
        _check_grad(call, first)
    bn = _bname(name)
    if isinstance(tensor, (tuple, list)):
        items = list(tensor)
        items[0] = _GroupCommit.apply(items[0], core, bn, forced, bool(delay_offload))
        return type(tensor)(items)
    return _GroupCommit.apply(tensor, core, bn, forced, bool(delay_offload))


@_py_errors("init_chunk_handler")
def init_chunk_handler(vp_size=None, vp_stage=None, min_offloaded_tensor_size=None):
    PipelineOffloadManager.get_instance().init_model_chunk_offload_handler(
        vp_size, vp_stage, min_offloaded_tensor_size)


@_py_errors("flush_delayed_groups()")
def flush_delayed_groups():
    PipelineOffloadManager.get_instance().flush_delayed_groups()


def mark_not_offloadable(tensor):
    """The tensor is never offloaded (Megatron sets it on parameters)."""
    if tensor is not None:
        _check_tensor("mark_not_offloadable", "tensor", tensor)
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
