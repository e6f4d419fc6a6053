"""Megatron-Core's fine-grained activation offloading API, by the same names,
over ofl's manager (megatron/core/pipeline_parallel/
fine_grained_activation_offload.py): the calls of the released wheel
(0.16.1) and of the main branch both run unchanged.

    init_chunk_handler(vp_size, vp_stage, min_offloaded_tensor_size)   0.16.1
    init_chunk_handler(pp_rank=, vp_size=, vp_stage=,
                       min_offloaded_tensor_size=,
                       delta_offload_bytes_across_pp_ranks=,
                       activation_offload_fraction=,
                       max_inflight_offloads=)                          main
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
    y = fine_grained_offloading_group_commit(y, "core_attn", [x])      0.16.1
    y = fine_grained_offloading_group_offload(y, "core_attn", [x])     main
                                        -> GroupCommit identity op:
                                           forward ofl_manager_group_commit,
                                           backward ofl_manager_group_backward_begin
    with off_interface(flag, x, "core_attn") as x: y = module(x)
    y = manager.group_offload(y, forced_released_tensors=[x])          main
                                        (the interface object: start on
                                           entry, hooks inside, commit after)
    PipelineOffloadManager.get_instance().reset(process_group=None)
                                        end of each schedule call; the
                                           summary is gathered on process_group
                                           (main passes tp_dp_cp) when given

The two spellings that differ in meaning follow the version they are written
against: ``delay_offload=True`` delays the offload until
flush_delayed_groups() always through 0.16.1's ``group_commit`` names, and
only between enter_replay() and exit_replay() (a CUDA graph replay) through
main's ``group_offload`` names, as in each version. ``forward_record()`` and
``backward_record(tensor)`` without an event (main) use the manager's
cuda_graph_event; 0.16.1 passes its own event.

A forward under torch.no_grad() is forward-only (ofl_manager_set_forward_only):
it offloads nothing and neither consumes the warmup nor creates chunks; the
reset after it turns training mode back on. The first reset after a training
pass ends the warmup and prints the offload summary (rank 0 of
``process_group``, else of torch.distributed's default group when it is
initialized, with every rank's row gathered there; this process's row
otherwise).

Knobs: ``fraction`` (activation_offload_fraction), ``rank_delta_bytes``
(delta_offload_bytes_across_pp_ranks), ``pp_rank``, ``max_inflight``
(max_inflight_offloads; 0 here is unlimited), ``groups`` (offload_modules, a
list or comma string; default every name; "auto": ofl's plan chooses them at
the end of the warmup to meet ``memory_target``), ``memory_target`` (the
activation bytes this rank may keep on the device at its peak, an int or a
string with K/M/G; OFL_MEMORY_TARGET), ``device_memory_target`` (the device
memory the step may use at its peak, weights, gradients and optimizer state
included: the warmup measures what is not activations and the plan gets the
rest; the tighter of the two wins; OFL_DEVICE_MEMORY_TARGET), ``prefetch_groups``,
``host_budget_bytes``, given at the first creation
(``PipelineOffloadManager.get_instance(**knobs)``; later calls return the
instance as it is). Main's init_chunk_handler passes the first four from
Megatron's config: they apply when they reach a manager that has begun no
chunk yet (the first microbatch), except those given to the constructor,
which win; after the warmup they are ignored, as in Megatron, and a change
during the warmup is an error. Megatron's max_inflight_offloads None is
ofl's 0 (unlimited) and Megatron's 0 (compute waits for each offload at its
commit) is ofl's 1 (the nearest: one offload in flight). Unset knobs come
from OFL_* (OFL_OFFLOAD_FRACTION, OFL_RANK_DELTA_BYTES, OFL_MAX_INFLIGHT,
OFL_OFFLOAD_GROUPS, ...). min_offloaded_tensor_size is in elements, as in
Megatron (default OFL_MIN_OFFLOAD_ELEMS, else 1048576); tensors below it are
never handed to ofl (they stay in Python, uncounted by the C statistics).
"""
import contextlib
import ctypes
import functools
import os
import re

import torch

from .. import _lib
from .._errors import OflError
from . import _core
from ._core import ManagerCore, _env_int

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

__all__ = [
    "PipelineOffloadManager", "FineGrainedActivationOffloadingInterface",
    "fine_grained_offloading_group_start", "fine_grained_offloading_group_commit",
    "fine_grained_offloading_group_offload", "fine_grained_offloading_group_flush_delayed_groups",
    "fine_grained_offloading_disable_offload", "fine_grained_offloading_enable_offload",
    "fine_grained_offloading_forward_record", "fine_grained_offloading_backward_record",
    "init_chunk_handler", "flush_delayed_groups", "mark_not_offloadable", "mark_not_offload",
    "disable_offload", "enable_offload", "forward_record", "backward_record",
    "reset", "get_context",
]

# Megatron's config names of the knobs init_chunk_handler passes (main) and
# ofl's names for them.
_MAIN_KNOBS = (("pp_rank", "pp_rank"), ("delta_offload_bytes_across_pp_ranks", "rank_delta_bytes"),
               ("activation_offload_fraction", "fraction"),
               ("max_inflight_offloads", "max_inflight"))
_CHUNK_016 = ("vp_size", "vp_stage", "min_offloaded_tensor_size")
_CHUNK_MAIN = ("pp_rank", "vp_size", "vp_stage", "min_offloaded_tensor_size",
               "delta_offload_bytes_across_pp_ranks", "activation_offload_fraction",
               "max_inflight_offloads")


def _chunk_args(call, args, kw):
    """init_chunk_handler's arguments as a dict by Megatron's names: 0.16.1's
    (vp_size, vp_stage, min_offloaded_tensor_size) or main's (pp_rank first,
    then the knobs). Main's call is told apart by pp_rank or a knob."""
    main = len(args) > 3 or any(k in kw for k, _ in _MAIN_KNOBS)
    names = _CHUNK_MAIN if main else _CHUNK_016
    if len(args) > len(names):
        raise TypeError("%s takes at most %d positional arguments (%s), got %d"
                        % (call, len(names), ", ".join(names), len(args)))
    out = dict(zip(names, args))
    for k, v in kw.items():
        if k not in names:
            raise TypeError("%s: unexpected keyword argument %r (Megatron-Core's are %s)"
                            % (call, k, ", ".join(_CHUNK_MAIN)))
        if k in out:
            raise TypeError("%s: got multiple values for argument %r" % (call, k))
        out[k] = v
    return out


def _ofl_max_inflight(v):
    """Megatron's max_inflight_offloads as ofl's max_inflight: None (no cap)
    is 0 (unlimited); Megatron's 0 (wait for each offload at its commit) is
    1, the nearest ofl has."""
    if v is None:
        return 0
    v = int(v)
    if v < 0:
        raise ValueError("init_chunk_handler: max_inflight_offloads must be None or >= 0, got %d"
                         % v)
    return v if v > 0 else 1


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


def _groups_knob(call, arg, groups):
    """offload_modules / groups as the manager's comma string (bytes): a
    str ("auto": the plan chooses; "": every name), or a list of names."""
    if isinstance(groups, (list, tuple)):
        if not all(isinstance(g, (str, bytes)) and g for g in groups):
            raise TypeError("%s: %s must be a str (\"auto\", or comma-separated group names) or "
                            "a list of non-empty names, got %r" % (call, arg, groups))
        groups = ",".join(g.decode() if isinstance(g, bytes) else g for g in groups)
    if not isinstance(groups, (str, bytes)):
        raise TypeError("%s: %s must be a str (\"auto\", or comma-separated group names) or a "
                        "list of names, got %s" % (call, arg, type(groups).__name__))
    return groups.encode() if isinstance(groups, str) else groups


class PipelineOffloadManager:
    """The process-wide manager (Megatron's singleton). Also the context
    manager that installs the saved-tensor hooks (get_context(True))."""

    _instance = None

    def __init__(self, **knobs):
        if "offload_modules" in knobs:
            if "groups" in knobs:
                raise TypeError("PipelineOffloadManager: offload_modules and groups are the same "
                                "knob; give one of them")
            knobs["groups"] = knobs.pop("offload_modules")
        groups = knobs.pop("groups", None)
        if groups is None:
            groups = os.environ.get("OFL_OFFLOAD_GROUPS", "")
        groups = _groups_knob("PipelineOffloadManager", "groups", groups)
        # recompute: the plan's third action (recompute=True: every name run
        # through offload_or_recompute; recompute_modules: those names only)
        self._rc = _Recompute(knobs.pop("recompute", None), knobs.pop("recompute_modules", None),
                              groups, knobs.get("memory_target"),
                              knobs.get("device_memory_target"))
        for name in ("memory_target", "device_memory_target"):
            if knobs.get(name) is not None:
                knobs[name] = _lib.parse_bytes("PipelineOffloadManager", name, knobs[name])
        unknown = set(knobs) - {"fraction", "rank_delta_bytes", "pp_rank", "max_inflight",
                                "prefetch_groups", "host_budget_bytes", "summary",
                                "memory_target", "device_memory_target"}
        if unknown:
            raise TypeError("PipelineOffloadManager: unknown knob(s) %s" % sorted(unknown))
        self._explicit = set(knobs)  # given by the user: Megatron's config does not override
        knobs.setdefault("summary", True)
        self._knobs = dict(knobs, groups=groups)
        self._new_core()
        self._depth = 0
        # marker calls begun and ended since the last reset(): unequal at
        # reset(), one was cut (an exception, an interrupt) and the step
        # is abandoned even where it left the manager no group open
        self._calls = [0, 0]
        self._chunk = (1, 0)  # (vp_size, vp_stage) of the chunk begun last
        self._in_replay = False
        self._graph_stream = None
        self._graph_event = None

    def _new_core(self, min_elems=None):
        self._core = ManagerCore(**self._knobs)
        self._core.min_elems = (_env_int("OFL_MIN_OFFLOAD_ELEMS", 1 << 20) if min_elems is None
                                else min_elems)
        self._rc.attach(self._core)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._core.pack, self._core.unpack)
        self._begun = False  # no chunk begun yet: knobs may still change

    def _set_knobs(self, given):
        """Main's init_chunk_handler knobs (ofl names -> values): applied to
        a manager that has begun no chunk (a new one is made with them),
        ignored after the warmup (as Megatron does), an error when they
        change during it."""
        want = {k: v for k, v in given.items()
                if k not in self._explicit and self._knobs.get(k) != v}
        if not want:
            return
        if self._begun:
            if not self._core.is_warmup():
                return
            raise ValueError(
                "init_chunk_handler: %s changed during the warmup (%s); Megatron-Core reads them "
                "from the model config, which must be the same for every microbatch"
                % (", ".join(sorted(want)),
                   ", ".join("%s %r -> %r" % (k, self._knobs.get(k), v)
                             for k, v in sorted(want.items()))))
        core = self._core
        min_elems, enabled = core.min_elems, core.enabled
        self._knobs.update(want)
        core.close()
        self._new_core(min_elems)
        self._core.set_enabled(enabled)

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
        self._depth += 1
        self._hooks.__enter__()  # hooks left on torch's stack by a cut: reset() pops them
        return self

    def __exit__(self, *exc):
        r = self._hooks.__exit__(*exc)  # the pop first (a cut before it: reset())
        self._depth -= 1
        return r

    def _pop_stray_hooks(self):
        """This manager's saved-tensor hooks left on torch's stack by an
        entry or exit that was cut (reset() runs outside the context)."""
        top = _top_hooks(False) if _top_hooks is not None else None
        while top is not None and top[0] is self._hooks.pack_hook:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            top = _top_hooks(False)
        self._depth = 0

    def _call_begins(self):
        self._calls[0] += 1

    def _call_ends(self):
        self._calls[1] += 1

    # -- chunks and iterations
    @_py_errors("init_chunk_handler")
    def init_model_chunk_offload_handler(self, *args, **kw):
        """(vp_size, vp_stage, min_offloaded_tensor_size) as 0.16.1, or
        (pp_rank, vp_size, vp_stage, min_offloaded_tensor_size,
        delta_offload_bytes_across_pp_ranks, activation_offload_fraction,
        max_inflight_offloads=None) as main."""
        # ofl's own keywords (not Megatron's): the auto plan's knobs
        given = {}
        kw = dict(kw)
        if "offload_modules" in kw:
            given["groups"] = _groups_knob("init_chunk_handler", "offload_modules",
                                           kw.pop("offload_modules"))
        for name in ("memory_target", "device_memory_target"):
            if kw.get(name, None) is not None:
                given[name] = _lib.parse_bytes("init_chunk_handler", name, kw.pop(name))
            kw.pop(name, None)
        a = _chunk_args("init_chunk_handler", args, kw)
        for mname, oname in _MAIN_KNOBS:
            if mname in a:
                v = a[mname]
                if oname == "max_inflight":
                    v = _ofl_max_inflight(v)
                elif v is None:
                    continue
                elif oname == "fraction":
                    v = float(v)
                else:
                    v = int(v)
                given[oname] = v
        self._call_begins()
        if given:
            self._set_knobs(given)
        core = self._core
        if a.get("min_offloaded_tensor_size") is not None:
            core.min_elems = int(a["min_offloaded_tensor_size"])
        core.set_forward_only(not torch.is_grad_enabled())
        self._chunk = (a.get("vp_size") or 1, a.get("vp_stage") or 0)
        core.chunk_begin(*self._chunk)
        core.backward_ran = False  # a backward marker after this chunk's begin
        self._begun = True
        self._call_ends()

    def _restart_cut_warmup(self):
        """The warmup ended with a record of no group at all and a group
        comes: that warmup was a step cut before its first group (its
        reset() cannot tell it from a rank without groups). A new manager
        records the warmup again, from the chunk begun last; returns its
        core. The new one is in place before the old one closes."""
        old = self._core
        min_elems, enabled, forward_only = old.min_elems, old.enabled, old.forward_only
        self._new_core(min_elems)
        old.close()
        core = self._core
        core.set_enabled(enabled)
        core.set_forward_only(forward_only)
        core.chunk_begin(*self._chunk)
        core.backward_ran = False
        self._begun = True
        return core

    @_py_errors("reset()")
    def reset(self, process_group=None):
        """End of a schedule call (training or evaluation). The first one
        after a training pass ends the warmup and prints the summary,
        gathered on ``process_group`` (main's call passes the tp-dp-cp
        group) or torch.distributed's default group.

        After a step abandoned by an exception (groups left open, backward
        never run) it recovers: the open groups are closed, the saved
        tensors of the step are dropped, and a warmup that the step cut
        short starts again with the next step."""
        core = self._core
        if process_group is None:
            return self._reset(core)
        summary, core.summary = core.summary, False
        was_warmup = core.is_warmup()
        try:
            self._reset(core)
        finally:
            core.summary = summary
        if summary and was_warmup and self._core is core and not core.is_warmup():
            core.summary_text = _group_summary(core, process_group)

    def _reset(self, core):
        self._pop_stray_hooks()
        # a marker call that did not end, a group open in the manager or in
        # Python's list (a commit cut after its C call): the open groups are
        # committed and their handles ended
        abandoned = self._calls[0] != self._calls[1]
        if core.commit_open_groups():
            abandoned = True
        self._calls = [0, 0]
        was_warmup = core.is_warmup()
        # no backward marker since the last chunk began: a training step
        # runs its backward before reset(), so one that did not was cut
        # (a chunk with fewer groups than the warmup's is then no error)
        cut = abandoned or not getattr(core, "backward_ran", True)
        try:
            core.reset()
        except OflError as e:
            # after an abandoned step the structure may not match: reset ran
            if not cut or e.status != _lib.ERR_MISMATCH:
                raise
        finally:
            core.set_forward_only(False)
        if was_warmup and not abandoned and self._rc.redo:
            # a group started recomputable turned out not to be (an input
            # changed in place, RNG without its state saved): the warmup is
            # recorded again, that name started not recomputable
            abandoned = True
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

    def mark_not_offload(self, tensor):
        """Main's name: the tensor is never offloaded."""
        mark_not_offloadable(tensor)

    def mark_not_offloadable(self, tensor):
        """0.16.1's name: the tensor is never offloaded."""
        mark_not_offloadable(tensor)

    # -- CUDA graphs (transformer/module.py hands these to TE's graph capture)
    @property
    def cuda_graph_stream(self):
        """The stream of TE's graph capture and replay (cuda; None on the
        host backend, which has no graphs)."""
        if self._graph_stream is None and self._core.is_cuda:
            self._graph_stream = torch.cuda.Stream()
        return self._graph_stream

    @property
    def cuda_graph_event(self):
        """The event that orders graph compute with the copy streams (cuda;
        None on the host backend)."""
        if self._graph_event is None and self._core.is_cuda:
            try:
                self._graph_event = torch.cuda.Event(external=True)
            except TypeError:  # a torch without external events
                self._graph_event = torch.cuda.Event()
        return self._graph_event

    def enter_replay(self):
        """A CUDA graph replay begins: main's group_offload(...,
        delay_offload=True) delays its offload until flush_delayed_groups()."""
        self._in_replay = True

    def exit_replay(self):
        self._in_replay = False

    def synchronize(self):
        self._core.synchronize()

    # -- observability
    def stats(self):
        """ofl_manager_get_stats as a dict by the C field names; with the
        auto plan, ``plan`` (ofl_manager_plan_get) and ``plan["actions"]``:
        per name the action (keep, offload, recompute), the bytes, the
        predicted and the measured cost (ofl_manager_plan_action), and why a
        name is not recomputable."""
        return self._rc.add_actions(self._core, self._core.stats())

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


def _group_summary(core, group):
    """The summary table of every rank of ``group``, gathered to its rank 0
    (gather_object: every rank of the group resets, as Megatron's
    all_gather_object); printed there. Returns the table (this rank's row
    on the other ranks)."""
    import torch.distributed as dist
    s = _lib.lib.ofl_manager_summary(core.m)
    L = _lib.lib
    local = {}
    for g in range(L.ofl_summary_ngroups(s) if s else 0):
        local[L.ofl_summary_group_name(s, g).decode()] = int(L.ofl_summary_bytes(s, 0, g))
    core.summary_rows = [local]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        text = _core._render(s) if s else None
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        rows = [None] * world if rank == 0 else None
        dist.gather_object(local, rows, dst=dist.get_global_rank(group, 0), group=group)
        if rank == 0:
            core.summary_rows = rows
            text = _core._render_rows(rows)
        else:
            text = _core._render(s) if s else None
    if text and rank == 0:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
    return text


def _lib_stream(core, which):
    from .._lib import lib
    fn = lib.ofl_manager_d2h_stream if which == "d2h" else lib.ofl_manager_h2d_stream
    return lib.ofl_stream_native(fn(core.m))


def _torch_stream(native):
    """torch view of an ofl stream (cuda only; None on the host backend)."""
    if not native:
        return None
    rt = _core.Runtime.get()
    return torch.cuda.ExternalStream(native, device=rt.torch_device)


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
        ctx.core.backward_ran = True
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
        ctx.core.backward_ran = True
        ctx.core.backward_begin(ctx.name)
        return grad, None, None, None, None


class _BackwardRecord(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, event, core):
        ctx.event = event
        ctx.core = core
        return tensor

    @staticmethod
    def backward(ctx, grad):
        core = ctx.core  # the H2D wait is ofl_manager_backward_record's
        core.record_boundary(False)
        ctx.event.record(torch.cuda.current_stream(core.torch_device))
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
    if torch.is_grad_enabled():
        _check_grad(call, tensor)
    mgr._call_begins()
    if not torch.is_grad_enabled():
        core.set_forward_only(True)
    elif core.active and not core.is_warmup() and core.group_count() == 0:
        core = mgr._restart_cut_warmup()
    out = _GroupStart.apply(tensor, core, _bname(name))
    mgr._call_ends()
    return out


@_py_errors("fine_grained_offloading_group_commit")
def fine_grained_offloading_group_commit(tensor, name, forced_released_tensors=None,
                                         delay_offload=False):
    """Ends group ``name`` (it must be open: another name is an ofl error)
    and offloads its saved tensors after the compute so far;
    forced_released_tensors lose their storage once copied. ``tensor`` may be
    a tensor, a tuple or a list (the marker goes on element 0).
    ``delay_offload``: the offload waits for flush_delayed_groups()
    (0.16.1's meaning; main's group_offload delays only in a graph replay)."""
    return _commit("fine_grained_offloading_group_commit", tensor, name,
                   forced_released_tensors, bool(delay_offload))


@_py_errors("fine_grained_offloading_group_offload")
def fine_grained_offloading_group_offload(tensor, name, forced_released_tensors=None,
                                          delay_offload=False):
    """Main's name of fine_grained_offloading_group_commit. ``delay_offload``
    delays the offload until flush_delayed_groups() only between
    enter_replay() and exit_replay() (a CUDA graph replay), as in main."""
    mgr = PipelineOffloadManager.get_instance()
    return _commit("fine_grained_offloading_group_offload", tensor, name,
                   forced_released_tensors, bool(delay_offload) and mgr._in_replay)


def _commit(call, tensor, name, forced_released_tensors, delay):
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
    mgr = PipelineOffloadManager.get_instance()
    core = mgr._core
    if torch.is_grad_enabled():
        _check_grad(call, first)
    bn = _bname(name)
    mgr._call_begins()
    if isinstance(tensor, (tuple, list)):
        items = list(tensor)
        items[0] = _GroupCommit.apply(items[0], core, bn, forced, delay)
        out = type(tensor)(items)
    else:
        out = _GroupCommit.apply(tensor, core, bn, forced, delay)
    mgr._call_ends()
    return out


@_py_errors("init_chunk_handler")
def init_chunk_handler(*args, **kw):
    """Begins a microbatch's forward: (vp_size, vp_stage,
    min_offloaded_tensor_size) as Megatron-Core 0.16.1, or main's keywords
    (pp_rank, vp_size, vp_stage, min_offloaded_tensor_size,
    delta_offload_bytes_across_pp_ranks, activation_offload_fraction,
    max_inflight_offloads)."""
    PipelineOffloadManager.get_instance().init_model_chunk_offload_handler(*args, **kw)


@_py_errors("flush_delayed_groups()")
def flush_delayed_groups():
    PipelineOffloadManager.get_instance().flush_delayed_groups()


def mark_not_offloadable(tensor):
    """The tensor is never offloaded (Megatron sets it on parameters)."""
    if tensor is not None:
        _check_tensor("mark_not_offloadable", "tensor", tensor)
        tensor._ofl_not_offloadable = True
        tensor.offloading_activation = False
        tensor._do_not_offload = True  # main's flag, for code that reads it
    return tensor


def mark_not_offload(tensor):
    """Main's name of mark_not_offloadable."""
    if tensor is not None:
        _check_tensor("mark_not_offload", "tensor", tensor)
    return mark_not_offloadable(tensor)


def disable_offload():
    PipelineOffloadManager.get_instance().disable_offload()


def enable_offload():
    PipelineOffloadManager.get_instance().enable_offload()


def forward_record(event=None):
    """Graph-capture boundary (forward): records event (main: the manager's
    cuda_graph_event) on the current stream, which then waits for the D2H
    stream. No-op on the host backend."""
    mgr = PipelineOffloadManager.get_instance()
    core = mgr._core
    if not core.is_cuda:
        return
    # ofl's call, capture-safe: outside a capture compute waits for the D2H
    # stream; inside one the boundary is recorded without a wait on a stream
    # the capture does not contain (the capture stays valid)
    core.record_boundary(True)
    (event if event is not None else mgr.cuda_graph_event).record(
        torch.cuda.current_stream(core.torch_device))


def backward_record(tensor, event=None):
    """Identity whose backward records event (main: the manager's
    cuda_graph_event) and makes the current stream wait for the H2D stream.
    No-op (returns tensor) on the host backend."""
    mgr = PipelineOffloadManager.get_instance()
    if not mgr._core.is_cuda:
        return tensor
    return _BackwardRecord.apply(tensor, event if event is not None else mgr.cuda_graph_event,
                                 mgr._core)


def reset(process_group=None):
    PipelineOffloadManager.get_instance().reset(process_group=process_group)


def cuda_graph_stream():
    return PipelineOffloadManager.get_instance().cuda_graph_stream


def cuda_graph_event():
    return PipelineOffloadManager.get_instance().cuda_graph_event


def enter_replay():
    PipelineOffloadManager.get_instance().enter_replay()


def exit_replay():
    PipelineOffloadManager.get_instance().exit_replay()


# Megatron-Core's module-level names (0.16.1 and main)
fine_grained_offloading_disable_offload = disable_offload
fine_grained_offloading_enable_offload = enable_offload
fine_grained_offloading_group_flush_delayed_groups = flush_delayed_groups


def fine_grained_offloading_forward_record(event):
    """0.16.1's module-level forward_record(event)."""
    forward_record(event)


def fine_grained_offloading_backward_record(tensor, event):
    """0.16.1's module-level backward_record(tensor, event)."""
    return backward_record(tensor, event)


def get_context(flag):
    """The saved-tensor hooks when flag, else a null context."""
    return PipelineOffloadManager.get_instance() if flag else contextlib.nullcontext()


class FineGrainedActivationOffloadingInterface:
    """``with FineGrainedActivationOffloadingInterface(offload, x, name) as x:``
    starts group ``name`` on x (use the returned tensor as the module input)
    and installs the saved-tensor hooks for the block; commit afterwards
    with ``manager.group_offload(y, forced_released_tensors=...)`` (main) or
    ``group_commit(y, name)`` / fine_grained_offloading_group_commit (0.16.1).
    With ``offload`` false every one of them passes the tensor through."""

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

    def group_offload(self, tensor, forced_released_tensors=None, delay_offload=False):
        """Main: commits this object's group (see
        fine_grained_offloading_group_offload); the tensor unchanged when
        offload is off."""
        if not self.offload:
            return tensor
        return fine_grained_offloading_group_offload(tensor, self.name, forced_released_tensors,
                                                     delay_offload)

    # Megatron's static helpers, 0.16.1's and main's spellings
    init_chunk_handler = staticmethod(init_chunk_handler)
    get_context = staticmethod(get_context)
    group_commit = staticmethod(fine_grained_offloading_group_commit)
    mark_not_offloadable = staticmethod(mark_not_offloadable)
    mark_not_offload = staticmethod(mark_not_offload)
    forward_record = staticmethod(forward_record)
    backward_record = staticmethod(backward_record)
    reset = staticmethod(reset)
    flush_delayed_groups = staticmethod(flush_delayed_groups)
    disable_offload = staticmethod(disable_offload)
    enable_offload = staticmethod(enable_offload)
    cuda_graph_stream = staticmethod(cuda_graph_stream)
    cuda_graph_event = staticmethod(cuda_graph_event)
    enter_replay = staticmethod(enter_replay)
    exit_replay = staticmethod(exit_replay)

    @staticmethod
    def reset_instance():
        PipelineOffloadManager.reset_instance()


# ---- recompute: keep, offload or recompute per name ----------------------------
#
# The auto plan (offload_modules="auto") may choose, per group name, to keep
# a group's activations, offload them or recompute them (ofl_manager_group_
# start_flags with OFL_GROUP_RECOMPUTABLE, ofl_manager_group_action). A name
# is recomputable when the module call is made through offload_or_recompute
# (or a module wrapped by apply_recompute_modules) and the manager was made
# with recompute=True or lists the name in recompute_modules (Megatron's
# names: core_attn, mlp, layernorm, ...). A recomputed call runs under
# torch.utils.checkpoint (non-reentrant, the RNG state saved and restored,
# Megatron's CUDA RNG tracker too): its backward reruns the forward from the
# inputs it keeps, between the group's backward markers, so ofl measures
# what the rerun costs (plan["actions"][name]["measured_ms"]).

# Megatron's recompute_modules, and what ofl does with each
_MEGATRON_RECOMPUTE = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                       "shared_experts")
_NOT_WRAPPED = {
    "moe_act": "Megatron recomputes the MoE activation inside its grouped experts' forward "
               "(output-discarding checkpoint); ofl cannot wrap that call",
    "mla_up_proj": "Megatron recomputes the MLA up projection inside the attention's forward "
                   "(output-discarding checkpoint); ofl cannot wrap that call",
    "moe": "Megatron decides the MoE layer's recompute from its config at every forward; "
           "ofl does not wrap it (leave it to Megatron's recompute_modules)",
    "shared_experts": "Megatron decides the shared experts' recompute from its config at every "
                      "forward; ofl does not wrap it (leave it to Megatron's recompute_modules)",
}


class _Recompute:
    """The recompute knobs of a PipelineOffloadManager and what the warmups
    found: the names that cannot be recomputed and why (kept across the
    managers the instance makes)."""

    def __init__(self, on, modules, groups, target, device_target):
        if on is not None and not isinstance(on, bool):
            raise TypeError("PipelineOffloadManager: recompute must be True or False, got %r"
                            % (on,))
        if modules is not None:
            if isinstance(modules, str):
                modules = [m for m in modules.split(",") if m]
            if not isinstance(modules, (list, tuple, set)) or not all(
                    isinstance(m, str) and m for m in modules):
                raise TypeError("PipelineOffloadManager: recompute_modules must be a list of "
                                "names (Megatron's: %s), got %r"
                                % (", ".join(_MEGATRON_RECOMPUTE), modules))
            modules = set(modules)
        self.on = bool(on) or bool(modules)
        self.modules = modules  # None: every name run through offload_or_recompute
        if self.on and groups != b"auto":
            raise ValueError("PipelineOffloadManager: recompute needs offload_modules=\"auto\" "
                             "(the plan that chooses keep, offload or recompute per name)")
        self.reasons = {}  # name -> why it cannot be recomputed
        self.warned = set()
        self.redo = False

    def attach(self, core):
        """A new manager: the plan may recompute (set before its warmup)."""
        self.redo = False
        if self.on:
            core._check(_lib.lib.ofl_manager_set_plan_recompute(core.m, 1),
                        "ofl_manager_set_plan_recompute")

    def reason(self, name):
        """Why name cannot be recomputed (None: it can)."""
        if not self.on:
            return "recompute is off (PipelineOffloadManager(recompute=True) or " \
                   "recompute_modules=[...] turns it on)"
        r = self.reasons.get(name)
        if r is None and self.modules is not None and name not in self.modules:
            r = "not in recompute_modules (%s)" % ", ".join(sorted(self.modules))
        return r

    def found(self, name, why, started_recomputable):
        """The warmup found that name cannot be recomputed; a group of it
        already started recomputable makes the warmup run again."""
        if name not in self.reasons:
            self.reasons[name] = why
        if started_recomputable:
            self.redo = True
        if self.on and name not in self.warned:
            self.warned.add(name)
            import warnings
            warnings.warn("ofl: %s cannot be recomputed: %s; the plan keeps or offloads it"
                          % (name, why), stacklevel=4)

    def add_actions(self, core, st):
        plan = st.get("plan")
        if plan is None:
            return st
        acts = _lib.plan_actions(core.m, len(plan.get("names", ())))
        for name, a in acts.items():
            a["why_not_recomputable"] = None if a["recomputable"] else (
                self.reason(name) or "never started recomputable (not run through "
                "offload_or_recompute, or it pushed no group in the warmup)")
        plan["actions"] = acts
        plan["recompute"] = self.on
        return st


def _tensors(args, kwargs):
    out = [a for a in args if isinstance(a, torch.Tensor)]
    out += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    return out


def _kept_bytes(core, tensors):
    """The device bytes of the inputs a recompute keeps (distinct storages)."""
    seen, n = set(), 0
    for t in tensors:
        if t.device.type != core.device_type:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


def _rng_tracker():
    """Megatron's CUDA RNG tracker when megatron.core is already imported."""
    import sys
    tp = sys.modules.get("megatron.core.tensor_parallel.random")
    try:
        return tp.get_cuda_rng_tracker() if tp is not None else None
    except Exception:
        return None


def _rng_snapshot(core):
    st = [torch.get_rng_state()]
    if core.is_cuda:
        st.append(torch.cuda.get_rng_state(core.torch_device))
    return st


def _recomputed(fn, mgr, name):
    """fn for torch's checkpoint: its second call (the recompute, in
    backward) runs with Megatron's CUDA RNG tracker states as they were at
    the first (torch's checkpoint restores torch's RNG state, not the
    tracker's), and counts as a marker call of the manager: one that raises
    leaves the count open, so reset() treats the step as abandoned (its
    backward stopped part way) and recovers."""
    tracker = _rng_tracker()
    if tracker is not None and not hasattr(tracker, "get_states"):
        tracker = None
    first = []

    def run(*a, **k):
        if not first:
            first.append(dict(tracker.get_states()) if tracker is not None else None)
            return fn(*a, **k)
        mgr._call_begins()
        now = None
        if tracker is not None:
            now = dict(tracker.get_states())
            tracker.set_states(dict(first[0]))
        try:
            out = fn(*a, **k)
        except BaseException as e:
            if hasattr(e, "add_note"):
                e.add_note("ofl: raised while recomputing %s in backward; the step is "
                           "abandoned: call reset() (Megatron's schedule does) and the next "
                           "step runs as usual" % name)
            raise
        finally:
            if tracker is not None:
                tracker.set_states(now)
        mgr._call_ends()
        return out
    return run


class _GroupStartFlags(torch.autograd.Function):
    """_GroupStart with the recompute flag and the kept input's bytes."""

    @staticmethod
    def forward(ctx, tensor, core, name, flags, kept):
        core._check(_lib.lib.ofl_manager_group_start_flags(core.m, name, flags, kept),
                    "ofl_manager_group_start(%s)" % name.decode())
        core.open.append(_core._Group(name))
        ctx.core = core
        ctx.name = name
        ctx.ran = False
        return tensor

    @staticmethod
    @_py_errors("backward of offload_or_recompute")
    def backward(ctx, grad):
        _once(ctx, "offload_or_recompute")
        ctx.core.backward_ran = True
        ctx.core.backward_end(ctx.name)
        return grad, None, None, None, None


def _same(t):
    return t


def _group_action(core, bname):
    a = ctypes.c_int()
    core._check(_lib.lib.ofl_manager_group_action(core.m, bname, ctypes.byref(a)),
                "ofl_manager_group_action(%s)" % bname.decode())
    return a.value


def _first_output(out):
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], out
    return None, out


@_py_errors("offload_or_recompute")
def offload_or_recompute(name, function, *args, preserve_rng_state=True, **kwargs):
    """``function(*args, **kwargs)`` as group ``name`` of the manager: the
    one-call form of fine_grained_offloading_group_start, the saved-tensor
    hooks and the group's commit, where the auto plan may also choose to
    recompute the call (PipelineOffloadManager(offload_modules="auto",
    recompute=True) or recompute_modules=[name, ...]). A recomputed call
    runs under torch.utils.checkpoint (non-reentrant; torch's RNG state, and
    Megatron's CUDA RNG tracker, restored for the rerun): it saves nothing
    but its inputs, and its backward reruns it. A call that changes an
    input in place, or draws random numbers with preserve_rng_state=False,
    is never recomputed: the warmup finds it, warns once with the reason,
    records the warmup again, and stats()["plan"]["actions"][name] says
    why. Without grad, or with offloading off, it is a plain call."""
    call = "offload_or_recompute"
    _check_name(call, name)
    if not callable(function):
        raise TypeError("%s: function must be callable, got %s" % (call, type(function).__name__))
    mgr = PipelineOffloadManager.get_instance()
    core = mgr._core
    tensors = _tensors(args, kwargs)
    first = next((i for i, a in enumerate(args)
                  if isinstance(a, torch.Tensor) and a.requires_grad), None)
    if not torch.is_grad_enabled() or first is None or not core.active:
        return function(*args, **kwargs)
    bn = _bname(name)
    sname = bn.decode()
    rc = mgr._rc
    why = rc.reason(sname)
    warm = core.is_warmup()
    flags = _lib.GROUP_RECOMPUTABLE if why is None else 0
    mgr._call_begins()
    if core.active and not warm and core.group_count() == 0:
        core = mgr._restart_cut_warmup()
        warm = True
    args = list(args)
    args[first] = _GroupStartFlags.apply(args[first], core, bn, flags,
                                         _kept_bytes(core, tensors) if flags else 0)
    mgr._call_ends()
    action = _group_action(core, bn)
    versions = [(t, t._version) for t in tensors]
    if action == _lib.ACTION_RECOMPUTE:
        from torch.utils.checkpoint import checkpoint
        # the checkpoint saves its inputs through the hooks in force: plain
        # ones (they stay where they are, the kept input), never ofl's
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = checkpoint(_recomputed(function, mgr, sname), *args, use_reentrant=False,
                             preserve_rng_state=preserve_rng_state, **kwargs)
        changed = [t for t, v in versions if t._version != v]
        if changed:
            raise RuntimeError(
                "ofl: %s was recomputed but changed an input in place during its forward "
                "(a %s tensor); its recompute would read the changed value. Make the module "
                "out of place, or leave %s out of recompute_modules" % (
                    sname, list(changed[0].shape), sname))
    else:
        rng = _rng_snapshot(core) if warm and flags and not preserve_rng_state else None
        with mgr:
            out = function(*args, **kwargs)
        if flags or warm:
            changed = [t for t, v in versions if t._version != v]
            if changed:
                rc.found(sname, "it changes an input in place (a %s tensor), so a rerun would "
                         "read the changed value" % list(changed[0].shape), bool(flags))
            elif rng is not None and any(not torch.equal(a, b)
                                         for a, b in zip(rng, _rng_snapshot(core))):
                rc.found(sname, "it draws random numbers and preserve_rng_state=False, so a "
                         "rerun would draw others", bool(flags))
    t0, seq = _first_output(out)
    if t0 is None:
        raise TypeError("%s: %s returned %s; the group's commit needs a tensor (or a tuple "
                        "or list whose first element is one)" % (call, sname,
                                                                  type(out).__name__))
    mgr._call_begins()
    if t0.requires_grad:
        t0 = _GroupCommit.apply(t0, core, bn, [], False)
    else:
        core.commit(bn, (), False)
    mgr._call_ends()
    if seq is None:
        return t0
    items = list(seq)
    items[0] = t0
    return type(seq)(items)


def _wrap_module(module, name):
    """module's calls go through offload_or_recompute(name, ...)."""
    if getattr(module, "_ofl_recompute_name", None) is not None:
        return False
    orig = module.forward

    def forward(*args, **kwargs):
        return offload_or_recompute(name, orig, *args, **kwargs)

    module.forward = forward
    module._ofl_recompute_name = name
    return True


def apply_recompute_modules(model, config=None, recompute_modules=None):
    """Lets ofl's auto plan choose keep, offload or recompute for the
    modules of a Megatron-Core model named by Megatron's recompute_modules
    (``config.recompute_modules`` with ``recompute_granularity='selective'``,
    or ``recompute_modules``): "core_attn" (each layer's
    self_attention.core_attention), "mlp" (a dense layer's mlp) and
    "layernorm" (input_layernorm and pre_mlp_layernorm) are wrapped by
    offload_or_recompute under those names, and Megatron's own checkpoint
    and offload flags for them are turned off on the layers (ofl offloads
    or recomputes them as the plan says). "moe", "shared_experts",
    "moe_act" and "mla_up_proj" stay Megatron's (the plan says why). The
    manager is made (or must already be) with offload_modules="auto" and
    these names in recompute_modules. Returns {name: modules wrapped}."""
    if recompute_modules is None:
        if config is None:
            raise TypeError("apply_recompute_modules: give config (Megatron's TransformerConfig) "
                            "or recompute_modules")
        if getattr(config, "recompute_granularity", None) != "selective":
            raise ValueError("apply_recompute_modules: config.recompute_granularity is %r; "
                             "Megatron's recompute_modules apply with 'selective'"
                             % (getattr(config, "recompute_granularity", None),))
        recompute_modules = list(config.recompute_modules or ())
    names = list(recompute_modules)
    bad = [n for n in names if n not in _MEGATRON_RECOMPUTE]
    if bad:
        import difflib
        hint = difflib.get_close_matches(bad[0], _MEGATRON_RECOMPUTE, 1)
        raise ValueError("apply_recompute_modules: unknown recompute module %r%s (Megatron's "
                         "are %s)" % (bad[0], "; did you mean %r?" % hint[0] if hint else "",
                                      ", ".join(_MEGATRON_RECOMPUTE)))
    mgr = PipelineOffloadManager.get_instance()
    rc = mgr._rc
    if not rc.on:
        raise ValueError("apply_recompute_modules: the manager does not recompute; make it with "
                         "PipelineOffloadManager.get_instance(offload_modules=\"auto\", "
                         "recompute_modules=%r)" % (names,))
    wrapped = {n: 0 for n in names}
    for layer in model.modules():
        if not (hasattr(layer, "self_attention") and hasattr(layer, "mlp")
                and hasattr(layer, "input_layernorm")):
            continue
        attn = layer.self_attention
        if "core_attn" in names and isinstance(getattr(attn, "core_attention", None),
                                               torch.nn.Module):
            attn.checkpoint_core_attention = False
            attn.offload_core_attention = False
            wrapped["core_attn"] += _wrap_module(attn.core_attention, "core_attn")
        if "mlp" in names and not getattr(layer, "is_moe_layer", False):
            layer.recompute_mlp = False
            wrapped["mlp"] += _wrap_module(layer.mlp, "mlp")
        if "layernorm" in names:
            for attr, flag, off in (("input_layernorm", "recompute_input_layernorm",
                                     "offload_attn_norm"),
                                    ("pre_mlp_layernorm", "recompute_pre_mlp_layernorm",
                                     "offload_mlp_norm")):
                norm = getattr(layer, attr, None)
                if norm is None or type(norm).__name__ == "IdentityOp" or \
                        not list(norm.parameters()):
                    continue
                setattr(layer, flag, False)
                setattr(layer, off, False)
                wrapped["layernorm"] += _wrap_module(norm, "layernorm")
    for n in names:
        if n in _NOT_WRAPPED:
            rc.reasons.setdefault(n, _NOT_WRAPPED[n])
    return wrapped


__all__ += ["offload_or_recompute", "apply_recompute_modules"]
