"""``offload_activations``: a torchtune-style context manager (and decorator)
that offloads every saved activation through an ofl manager.

Mapping onto the manager (documented in python/README.md too):
  * one **chunk** per forward run under the context (``ofl_manager_chunk_begin
    (1, 0)`` at the outermost ``__enter__`` when grad is enabled);
  * one **group per saved tensor**, named ``activations``: the pack hook
    starts it, pushes the tensor and commits it at once, so the D2H copy of
    each activation starts right after the op that produced it, as
    torchtune's per-tensor offload does (``ManagerCore.pack_offload``, in C,
    ofl._ext);
  * ``max_fwd_stash_size`` is the manager's ``max_inflight``: at most that
    many offloads of the name in flight before compute waits for the oldest;
    and its ``prefetch_groups``: backward issues the reloads of that many
    saved tensors ahead (with a group per tensor, a reload only one group
    ahead has one op's backward to land in);
  * backward: autograd unpacks in its own order, which is not exactly the
    reverse of the saves; each unpack first runs the backward markers
    (``group_backward_begin`` / ``_end``) of the groups the manager expects
    up to and including the tensor's own, which keeps the manager's
    prefetch one group ahead; pop is correct in any order (a group not yet
    prefetched is reloaded inline, after its offload);
  * the **iteration** ends when the backward has used every saved tensor of
    the forwards so far (at that last unpack, outside a forward), or else at
    the next forward that starts after a backward, or at the first forward
    after one that raised: ``ofl_manager_reset`` runs there. Gradient
    accumulation (several forwards, then their backwards) is one iteration
    of several chunks. Saved tensors still held by a graph when an
    iteration is ended that way (a partial backward, a graph kept alive)
    are reloaded first, so a later backward through them still works. The
    first iteration is the manager's warmup; a model whose saved-tensor
    structure changes from one iteration to the next (the manager answers
    OFL_ERR_MISMATCH) keeps its tensors in memory for the rest of that
    forward and gets a fresh manager (a new warmup) at the next iteration;
  * **one manager per context object, shared across objects**: the manager
    and its pools stay with a context that is entered step after step, and
    a context made afresh every step (``with offload_activations(model):``
    in the loop) takes over the manager of an earlier, dropped one with the
    same settings, so neither pattern creates a manager per step. Nothing
    stays registered on the model between steps: the head's hooks are added
    at the outermost ``__enter__`` and removed at its ``__exit__``;
  * **graphs used more than once** (``retain_graph=True``, ``create_graph=
    True``, ``torch.autograd.functional.hvp``): the first unpack of a saved
    tensor pops it from the manager, and the record that autograd keeps
    holds the unpacked tensor for later unpacks; tensors saved while a
    backward runs (double backward) stay in memory;
  * a saved tensor changed in place after the save raises autograd's
    "modified by an inplace operation" error at unpack (torch skips its own
    check when saved-tensor hooks are set);
  * tensors that stay where they are: parameters and other tensor
    subclasses, views of parameters, buffers (``nn.Buffer``, and every
    buffer of ``model``), lazy conjugates and negations, quantized and
    non-strided tensors, tensors under ``min_offload_size`` bytes (or of
    another device), and every tensor saved inside the output head;
  * the **output head** (torchtune's rule): ``model.output``, or
    ``model.output.linear`` when the output is tied (torchtune's
    ``TiedLinear``), else ``model.lm_head`` (Hugging Face): the activations
    saved inside it are not offloaded (they are the first needed in
    backward). ``warn_if_no_head`` warns when there is none;
  * **names under the auto plan**: with ``offload_modules="auto"`` and a
    ``model``, each saved tensor's group is named by the module that saved
    it, as a module path (``layers.0.mlp``, ``layers.0.attn_norm``; a tensor
    saved by a layer's own code is ``layers.0``; outside the model
    ``activations``): the model's children, the items of its ModuleLists
    and Sequentials and their children, so the plan and its printout say
    which modules it offloads. Without "auto" (or without a model) every
    group is named ``activations``;
  * ``use_streams=False`` waits for each copy right after its commit;
    ``use_pin_memory`` is accepted for compatibility: ofl's host pool is
    always page-locked on cuda (and plain memory on the host backend).
"""
import contextlib
import operator
import sys
import threading
import warnings
import weakref

import torch

from .. import _lib
from .._errors import OflError
from . import _core
from ._core import ManagerCore, unpack_detached

# the records of tensors kept where they are (ofl._ext's Kept; none without it)
_KEPT = (_core._ext.Kept,) if _core._ext is not None else ()

__all__ = ["offload_activations", "OffloadActivations", "release_managers"]

_NAME = b"activations"
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_current_node = getattr(torch._C, "_current_autograd_node", None)


def find_head(model):
    """The output head under torchtune's rule (model.output, its .linear
    when tied), else model.lm_head; None when there is none."""
    out = getattr(model, "output", None)
    if isinstance(out, torch.nn.Module):
        return out
    lin = getattr(out, "linear", None)
    if isinstance(lin, torch.nn.Module):
        return lin
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.nn.Module):
        return head
    return None


class _Session:
    """One manager and the state of its current iteration, driven by one
    context object at a time (owner)."""

    def __init__(self, key):
        self.key = key
        self.core = None
        self.owner = None  # weakref to the OffloadActivations using it
        self.depth = 0  # 1 while a forward is in progress (its context entered)
        # set from begin_forward to the end of the context's __enter__: still
        # set at the next begin_forward, that entry was cut (an exception or
        # an interrupt between two of its lines) and its step is abandoned
        self.entering = False
        self.rc_reasons = {}  # recompute: name -> why it cannot be recomputed
        self.rc_warned = set()
        self._new_core()

    def _new_core(self):
        old = self.core
        max_inflight, prefetch, groups, target, device_target, recompute = self.key[:6]
        self.core = ManagerCore(groups=groups, fraction=1.0, rank_delta_bytes=0, pp_rank=0,
                                max_inflight=max_inflight, summary=False,
                                prefetch_groups=prefetch, memory_target=target,
                                device_memory_target=device_target)
        self.rc_redo = False
        if recompute:
            self.core._check(_lib.lib.ofl_manager_set_plan_recompute(self.core.m, 1),
                             "ofl_manager_set_plan_recompute")
        self.broken = False  # the structure changed: rest of the forward kept
        self._new_iteration()
        if old is not None:
            old.close()

    def _new_iteration(self):
        self.chunks = []  # [[group mark, ...] per forward of this iteration]
        self.names = []  # [[group name, ...] per chunk] with named groups
        self.cur = None  # (module group, name) whose backward began and has not ended
        self.rc_pending = 0  # recomputed module groups whose rerun has not come
        self.live = []  # weakrefs of this iteration's records (forced end)
        self.bwd = [0, 0]  # manager's backward position: chunk, groups done
        self.backward_seen = False
        self.abandoned = False  # a forward raised

    # -- iteration
    def end_iteration(self):
        """Ends the manager's iteration: the saved tensors still held by a
        graph are reloaded first (each record keeps its tensor), then the
        manager resets. A warmup whose record is unusable (a forward that
        raised, a changed structure) is thrown away: a new manager."""
        core = self.core
        if core.unpopped:
            for ref in self.live:
                r = ref()
                if r is not None and r.cached is None and r.core is core:
                    core.pop_record(r)
        if self.cur is not None and not self.abandoned:
            self.end_current()
        renew = self.broken or (self.abandoned and core.is_warmup()) or (
            self.rc_redo and core.is_warmup())
        if (self.chunks or self.abandoned) and not renew:
            # an abandoned step may have left the manager a chunk that
            # self.chunks does not list, or a group open: the groups here
            # are all this session's (one per tensor), so they are committed
            core.commit_open_groups()
            try:
                core.reset()
            except OflError as e:
                if e.status == _lib.ERR_CONFIG and not core.is_warmup():
                    # a device target below what is not activations: the
                    # iteration ended (everything offloaded), the error says why
                    self._new_iteration()
                    raise
                if e.status != _lib.ERR_MISMATCH:
                    raise
                renew = core.is_warmup()
        if renew:
            self._new_core()
        else:
            self._new_iteration()

    def begin_forward(self):
        if self.entering or self.depth:  # the last entry or exit was cut
            self.abandoned = True
        self.entering = True
        core = self.core
        if self.broken or self.abandoned or (self.chunks and (self.backward_seen
                                                               or core.unpopped == 0)):
            self.end_iteration()
            core = self.core
        self.depth = 1
        if not self.broken:
            try:
                core.chunk_begin(1, 0)
            except OflError as e:
                if e.status != _lib.ERR_MISMATCH:
                    raise
                self.broken = True
                return
            self.chunks.append([])
            self.names.append([])

    def end_forward(self, failed):
        if failed:
            self.abandoned = True
        self.depth = 0
        self.entering = False
        if not failed and self.backward_seen and self.core.unpopped == 0:
            self.end_iteration()

    # -- hooks (see _Hooks)
    def keep_or_offload_failed(self, t, e):
        """The structure no longer matches the warmup (another model, a cut
        forward): the rest of this forward stays in memory."""
        if e.status != _lib.ERR_MISMATCH:
            raise e
        self.broken = True
        return self.core.keep(t) if t is not None else None

    def after_backward(self):
        """An unpack ran: the iteration ends when it left nothing to pop,
        outside a forward."""
        self.backward_seen = True
        if (self.core.unpopped == 0 and self.depth == 0 and self.chunks
                and self.rc_pending == 0):
            self.end_iteration()

    def end_current(self):
        """Ends the backward of the module group begun last (its records
        may pop one after another: it ends when another group begins)."""
        g, name = self.cur
        self.cur = None
        if g.index == 0:
            g.index = -2
            self.core.backward_end(name)

    def reach(self, g):
        """The backward markers the manager expects up to group g's, by
        their names (groups passed over are begun and ended); g is begun.
        Returns g's name, or None when g was passed over already."""
        core, chunks, names, pos = self.core, self.chunks, self.names, self.bwd
        if self.cur is not None and g.index == -1:
            self.end_current()
        mine = None
        while g.index == -1 and pos[0] < len(chunks):
            groups = chunks[pos[0]]
            if pos[1] >= len(groups):
                pos[0] += 1
                pos[1] = 0
                continue
            j = len(groups) - 1 - pos[1]
            nxt, name = groups[j], names[pos[0]][j]
            pos[1] += 1
            core.backward_begin(name)
            nxt.index = 0
            if nxt is not g:
                core.backward_end(name)
                nxt.index = -2
            else:
                mine = name
        return mine


class _Hooks:
    """The pack and unpack hooks of one context object (without a reference
    to it). The work per tensor is the manager core's (in C with ofl._ext):
    pack_offload (a group of its own: start, push, commit) and
    unpack_ordered (the backward markers in the manager's order, then pop)."""

    __slots__ = ("s", "suspend", "stack", "mod")

    def __init__(self):
        self.s = None
        self.suspend = 0
        self.stack = None  # module paths being run (named groups), else None
        self.mod = 0  # module groups open (recompute=True): tensors go into them

    def pack(self, t):
        s = self.s
        core = s.core
        if self.suspend or s.broken or (_current_node is not None and _current_node() is not None):
            return core.keep(t)
        stack = self.stack
        try:
            if self.mod:
                r = core.pack(t)  # into the open module group
                if type(r) not in _KEPT:
                    s.live.append(weakref.ref(r))
                return r
            if stack is None:
                return core.pack_offload(t, _NAME, s.chunks[-1], s.live)
            name = stack[-1] if stack else _NAME
            marks = s.chunks[-1]
            n = len(marks)
            r = core.pack_offload(t, name, marks, s.live)
            if len(marks) > n:
                s.names[-1].append(name)
            return r
        except OflError as e:
            return s.keep_or_offload_failed(t, e)

    def unpack(self, r):
        s = self.s
        if s is None:  # the context was closed: records it made still unpack
            c = getattr(r, "core", None)
            if c is None:
                return unpack_detached(r)
            return c.unpack(r)
        if self.stack is None:
            x = s.core.unpack_ordered(r, s.chunks, s.bwd, _NAME)
        else:
            x = _unpack_named(s, r)
        if type(r) not in _KEPT:
            s.after_backward()
        return x


def _unpack_named(s, r):
    """unpack_ordered for groups of several names: the backward markers of
    the groups the manager expects up to r's own (chunks first in, first
    out; a chunk's groups in reverse), each by its own name, then r's
    tensor. Records that are kept, cached or of another manager take the
    core's own path (no marker)."""
    core = s.core
    if (type(r) in _KEPT or getattr(r, "cached", None) is not None
            or getattr(r, "core", None) is not core):
        return core.unpack_ordered(r, s.chunks, s.bwd, _NAME)
    o = r.vref()
    if o is not None and o._version != r.version:
        raise _core._modified_error(o, r.size, r.version, o._version)
    g = r.group
    if s.cur is not None and s.cur[0] is g:
        return core.pop_record(r)  # a module group's next record
    mine = s.reach(g)
    x = core.pop_record(r)
    if g.index == 0 and mine is not None:
        if type(g) is _ModGroup:
            s.cur = (g, mine)  # ends when another group begins
        else:
            g.index = -2
            core.backward_end(mine)
    return x


def _same(t):
    return t


class _ModGroup(_core._Group):
    """A module call as one group (recompute=True): its saved tensors, or
    none when the plan recomputes it."""


def _recompute_call(ctx, path, orig, args, kwargs):
    """A recompute candidate's call under the auto plan (recompute=True):
    one group named path, started recomputable; kept or offloaded as the
    plan says (its saved tensors pushed into it), or run under
    torch.utils.checkpoint (non-reentrant) when the plan recomputes it, its
    rerun in backward between the group's markers."""
    from . import megatron as om
    hk, s = ctx._hk, ctx._s
    core = s.core if s is not None else None
    if (core is None or hk.suspend or hk.mod or s.broken or not core.active
            or not torch.is_grad_enabled()
            or (_current_node is not None and _current_node() is not None)):
        return orig(*args, **kwargs)
    tensors = om._tensors(args, kwargs)
    if not any(t.requires_grad for t in tensors):
        return orig(*args, **kwargs)
    bn = path.encode()
    why = s.rc_reasons.get(path)
    flags = _lib.GROUP_RECOMPUTABLE if why is None else 0
    try:
        core._check(_lib.lib.ofl_manager_group_start_flags(
            core.m, bn, flags, om._kept_bytes(core, tensors) if flags else 0),
            "ofl_manager_group_start(%s)" % path)
    except OflError as e:
        s.keep_or_offload_failed(None, e)  # the structure changed: kept from here on
        return orig(*args, **kwargs)
    g = _ModGroup(bn)
    core.open.append(g)
    action = om._group_action(core, bn)
    versions = [(t, t._version) for t in tensors]
    if action == _lib.ACTION_RECOMPUTE:
        from torch.utils.checkpoint import checkpoint
        calls = []

        def rerun(*a, **k):
            if calls:  # the recompute, in backward
                s.rc_pending -= 1
                if s.core is core and s.reach(g) is not None:
                    s.cur = (g, bn)
            calls.append(1)
            return orig(*a, **k)
        # the checkpoint saves its inputs through the hooks in force: plain
        # ones here (they stay where they are: the kept input), not ofl's
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = checkpoint(rerun, *args, use_reentrant=False, **kwargs)
        s.rc_pending += 1
    else:
        hk.mod += 1
        try:
            out = orig(*args, **kwargs)
        finally:
            hk.mod -= 1
    core.commit(bn)
    s.chunks[-1].append(g)
    s.names[-1].append(bn)
    changed = [t for t, v in versions if t._version != v]
    if changed and path not in s.rc_reasons:
        s.rc_reasons[path] = ("it changes an input in place (a %s tensor), so a rerun would "
                              "read the changed value" % list(changed[0].shape))
        if flags:
            s.rc_redo = True
        if path not in s.rc_warned:
            s.rc_warned.add(path)
            warnings.warn("ofl: %s cannot be recomputed: %s; the plan keeps or offloads it"
                          % (path, s.rc_reasons[path]), stacklevel=3)
    return out


def recompute_candidates(model, names, head):
    """{module: group name} of the modules offload_activations(recompute=
    True) runs as one group each: those of names with no other named module
    inside, the head excepted. The name is the path with the layer's index
    as "*" (``layers.*.mlp``): one name per module of a layer, as Megatron's
    names are, so the plan's search over the recomputable names stays exact
    (it is for up to 8 of them)."""
    import re
    inner = {}
    for m, path in names.items():
        if m is head:
            continue
        if any(c in names for c in m.modules() if c is not m):
            continue
        inner[m] = re.sub(r"(^|\.)\d+(?=\.)", r"\1*", path)
    return inner


def module_names(model):
    """{module: path} of the modules whose saved tensors name their groups
    under the auto plan: the model's children, the items of every
    ModuleList and Sequential in it, and those items' children."""
    out = {}
    for name, child in model.named_children():
        out[child] = name
    for path, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            for i, item in m.named_children():
                ip = "%s.%s" % (path, i) if path else i
                out[item] = ip
                for cn, c in item.named_children():
                    out.setdefault(c, "%s.%s" % (ip, cn))
    for m in [m for m in out if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]:
        del out[m]  # a container is never called itself
    return out


_sessions = {}  # key -> [_Session]
_sessions_lock = threading.Lock()


def _acquire(owner, key):
    """A session for owner: one with the same settings whose owner is gone,
    else a new one."""
    with _sessions_lock:
        lst = _sessions.setdefault(key, [])
        for s in lst:
            if s.owner is None or s.owner() is None:
                s.owner = weakref.ref(owner)
                break
        else:
            s = None
    if s is None:
        s = _Session(key)
        s.owner = weakref.ref(owner)
        with _sessions_lock:
            _sessions[key].append(s)
    return s


def release_managers():
    """Destroys the managers (and their pools) that no context uses now;
    the next context makes a new one. Returns how many were released."""
    n = 0
    with _sessions_lock:
        for key, lst in list(_sessions.items()):
            keep = []
            for s in lst:
                if s.owner is None or s.owner() is None:
                    s.core.close()
                    n += 1
                else:
                    keep.append(s)
            if keep:
                _sessions[key] = keep
            else:
                del _sessions[key]
    return n


def _check_flag(arg, v):
    """A flag must be a bool (a str such as "no" would read as True)."""
    if not isinstance(v, bool) and type(v).__name__ != "bool_":  # numpy's too
        raise TypeError("OffloadActivations: %s must be True or False, got %r" % (arg, v))


def _check_int(arg, v):
    """An int (a numpy integer too); a float, a str or None is refused."""
    if isinstance(v, bool):
        raise TypeError("OffloadActivations: %s must be an int, got a bool (%r)" % (arg, v))
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError("OffloadActivations: %s must be an int, got %s (%r)"
                        % (arg, type(v).__name__, v)) from None


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks, contextlib.ContextDecorator):
    """Offloads the activations saved for backward while it is entered
    (torchtune's ``OffloadActivations``, same positional parameters), through
    ofl's manager. ``model`` (keyword) names the model whose output head
    and buffers are exempt; see the module doc."""

    def __init__(self, use_pin_memory=True, use_streams=None, max_fwd_stash_size=5,
                 min_offload_size=1024, *, model=None, warn_if_no_head=True,
                 offload_modules=None, memory_target=None, device_memory_target=None,
                 recompute=False):
        if isinstance(use_pin_memory, torch.nn.Module):
            raise TypeError("OffloadActivations: the model is a keyword argument "
                            "(OffloadActivations(model=model) or offload_activations(model)); "
                            "the first positional parameter is use_pin_memory, as in torchtune")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError("OffloadActivations: model must be a torch.nn.Module (or None), got %s"
                            % type(model).__name__)
        _check_flag("use_pin_memory", use_pin_memory)
        if use_streams is not None:
            _check_flag("use_streams", use_streams)
        _check_flag("warn_if_no_head", warn_if_no_head)
        _check_flag("recompute", recompute)
        if recompute and (offload_modules != "auto" or model is None):
            raise ValueError("OffloadActivations: recompute=True needs offload_modules=\"auto\" "
                             "and model= (the plan chooses keep, offload or recompute per module "
                             "of the model)")
        self._recompute = bool(recompute)
        self._model_ref = weakref.ref(model) if model is not None else None
        max_fwd_stash_size = _check_int("max_fwd_stash_size", max_fwd_stash_size)
        min_offload_size = _check_int("min_offload_size", min_offload_size)
        if max_fwd_stash_size < 1:
            raise ValueError("OffloadActivations: max_fwd_stash_size must be at least 1 (got %r)"
                             % (max_fwd_stash_size,))
        if min_offload_size < 0:
            raise ValueError("OffloadActivations: min_offload_size must be >= 0 bytes (got %r)"
                             % (min_offload_size,))
        if offload_modules is not None and not isinstance(offload_modules, str):
            raise TypeError("OffloadActivations: offload_modules must be None or the str "
                            "\"auto\", got %s" % type(offload_modules).__name__)
        if offload_modules is not None and offload_modules != "auto":
            raise ValueError("OffloadActivations: offload_modules must be None (every saved "
                             "tensor) or \"auto\" (ofl's plan chooses which to offload to meet "
                             "memory_target), got %r" % (offload_modules,))
        target = None
        if memory_target is not None:
            target = _lib.parse_bytes("OffloadActivations", "memory_target", memory_target)
            if offload_modules != "auto":
                raise ValueError("OffloadActivations: memory_target needs offload_modules=\"auto\" "
                                 "(the plan that meets it); without it every saved tensor is "
                                 "offloaded")
        device_target = None
        if device_memory_target is not None:
            device_target = _lib.parse_bytes("OffloadActivations", "device_memory_target",
                                             device_memory_target)
            if offload_modules != "auto":
                raise ValueError("OffloadActivations: device_memory_target needs "
                                 "offload_modules=\"auto\" (the plan that meets it); without it "
                                 "every saved tensor is offloaded")
        self._groups = b"auto" if offload_modules == "auto" else b""
        self._memory_target = target
        self._device_memory_target = device_target
        self.use_pin_memory = bool(use_pin_memory)
        self.use_streams = True if use_streams is None else bool(use_streams)
        self.min_offload_size = int(min_offload_size)
        self.max_fwd_stash_size = int(max_fwd_stash_size)
        # the hooks hold no reference to this object (a context dropped
        # after its `with` block is freed at once, and its manager goes to
        # the next context)
        self._hk = _Hooks()
        super().__init__(self._hk.pack, self._hk.unpack)
        self._s = None
        self._depth = 0
        self._frame = None  # the frame of the outermost entry's with statement
        self._lasti = -1
        self._thread = None
        self._suspend = 0
        self._handles = []
        self._head = None
        self._closed = False
        if model is not None:
            self._head = find_head(model)
            if self._head is None and warn_if_no_head:
                warnings.warn(
                    "offload_activations: no output head was found on the model (model.output, "
                    "model.output.linear when tied, or model.lm_head); the activations saved by "
                    "the last layer are offloaded too, and brought back at once by backward. "
                    "Pass warn_if_no_head=False to silence this", stacklevel=3)
            for b in model.buffers():
                b._ofl_not_offloadable = True
        # the auto plan's group names: the module paths (see the module doc)
        self._named = (module_names(model) if model is not None and offload_modules == "auto"
                       else None)
        # recompute=True: the innermost named modules run as one group each
        self._rc_modules = (recompute_candidates(model, self._named, self._head)
                            if self._recompute else {})

    # -- the manager
    def _session(self):
        s = self._s
        if s is None:
            # max_fwd_stash_size offloads in flight in forward, and as many
            # reloads issued ahead in backward (one-tensor groups: a reload
            # one group ahead has one op's backward to land in, and stalled)
            key = (self.max_fwd_stash_size if self.use_streams else 0, self.max_fwd_stash_size,
                   self._groups, self._memory_target, self._device_memory_target,
                   self._recompute,
                   # recompute: what the warmups found about a model's modules
                   # stays with that model's manager
                   self._model_ref if self._recompute else None)
            s = self._s = self._hk.s = _acquire(self, key)
        return s

    @property
    def _core(self):
        return self._session().core

    # -- context
    def __enter__(self):
        me = threading.get_ident()
        if self._depth > 0 and self._thread == me and self._exit_was_cut():
            self._finish_cut_exit()
        if self._depth > 0:
            if self._thread != me:
                raise RuntimeError(
                    "offload_activations: this context is already entered in another thread; "
                    "one context serves one thread at a time (make one per thread)")
            self._depth += 1
            return self
        if not torch.is_grad_enabled():
            self._depth = 1
            self._thread = me
            self._grad = False
            return self
        s = self._session()
        s.begin_forward()  # an entry cut before the end of this one is abandoned there
        try:
            self._frame = sys._getframe(1)  # the with statement's (_exit_was_cut)
            self._lasti = self._frame.f_lasti
            s.core.min_bytes = self.min_offload_size
            self._grad = True
            self._thread = me
            self._depth = 1
            self._hk.suspend = 0
            head = self._head
            if head is not None:
                self._handles = [head.register_forward_pre_hook(self._head_pre),
                                 head.register_forward_hook(self._head_post, always_call=True)]
            if self._named is not None:
                self._hk.stack = []
                self._handles += self._name_hooks()
            for m, path in self._rc_modules.items():
                m.forward = self._rc_forward(m, path)
            s.entering = False
            # the hooks are pushed last, on the line that returns: no line
            # of this method runs after the push (an interrupt there would
            # leave them on torch's stack with no __exit__ to come)
            return super().__enter__() or self
        except BaseException:
            self._leave(True)
            raise

    def __exit__(self, exc_type, exc, tb):
        if self._depth != 1 or not self._grad:  # nested, or without grad
            if self._depth > 0:
                self._depth -= 1
            if self._depth == 0:
                self._thread = None
            return False
        # The pop first, then the rest: an exit cut before the pop leaves
        # the context entered, one cut after it a session in a forward; the
        # next entry recognises either (_exit_was_cut, begin_forward)
        super().__exit__(exc_type, exc, tb)
        self._leave(exc_type is not None)
        return False

    def _leave(self, failed):
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self._rc_modules:
            m.__dict__.pop("forward", None)
        self._hk.suspend = 0
        if self._hk.stack is not None:
            del self._hk.stack[:]
        self._depth = 0
        self._thread = None
        self._frame = None
        s = self._s
        if s is not None:
            s.end_forward(failed)

    def _exit_was_cut(self):
        """Whether this context, entered by its own count, was left without
        an __exit__ that completed (an interrupt or an exception in it): the
        with statement that entered it runs again, or is no longer on the
        stack. A with statement nested in it is neither."""
        f = self._frame
        if f is None:
            return False
        caller = sys._getframe(2)  # __enter__'s caller
        if caller is f:
            return caller.f_lasti == self._lasti
        while caller is not None:
            if caller is f:
                return False
            caller = caller.f_back
        return True

    def _finish_cut_exit(self):
        """Ends the forward of an exit that was cut: the hooks off torch's
        stack if they are still on top, then the bookkeeping (abandoned)."""
        top = _top_hooks(False) if _top_hooks is not None else None
        if top is not None and top[0] is self.pack_hook:
            super().__exit__(None, None, None)
        self._leave(True)

    def _name_hooks(self):
        """Forward hooks that keep the path of the module being run on the
        hooks' stack (named groups)."""
        stack = self._hk.stack
        hs = []
        for m, path in self._named.items():
            b = path.encode()

            def pre(module, args, b=b):
                stack.append(b)

            def post(module, args, output, b=b):
                if stack and stack[-1] == b:
                    stack.pop()
            hs.append(m.register_forward_pre_hook(pre))
            hs.append(m.register_forward_hook(post, always_call=True))
        return hs

    def _rc_forward(self, module, path):
        orig = type(module).forward.__get__(module)
        ref = weakref.ref(self)

        def forward(*args, **kwargs):
            ctx = ref()
            if ctx is None:
                return orig(*args, **kwargs)
            return _recompute_call(ctx, path, orig, args, kwargs)
        return forward

    def _head_pre(self, module, args):
        self._hk.suspend += 1

    def _head_post(self, module, args, output):
        if self._hk.suspend > 0:
            self._hk.suspend -= 1

    def close(self):
        """Ends the current iteration and lets go of the manager (kept for
        the next context with the same settings). Idempotent. Raises while
        saved tensors of a forward are still waiting for their backward."""
        if self._depth > 0:
            raise RuntimeError("offload_activations: close() inside the context; leave the "
                               "`with` block first")
        s = self._s
        if s is None:
            return
        core = s.core
        if core.unpopped:
            raise RuntimeError(
                "offload_activations: close() before backward: %d saved tensor(s) of the last "
                "forward are still waiting for their backward (they are kept, nothing is lost); "
                "run loss.backward() first, or drop the graph (del loss) before close()"
                % core.unpopped)
        if s.chunks:
            s.end_iteration()
        self._s = self._hk.s = None
        s.owner = None

    def __del__(self):
        s = getattr(self, "_s", None)
        if s is not None:
            s.owner = None


    # -- observability
    def stats(self):
        """The manager's statistics; with offload_modules="auto", ``plan``
        and ``plan["actions"]``: per name the action (keep or offload; this
        interface does not recompute), the bytes, the predicted and the
        measured cost."""
        st = self._core.stats()
        plan = st.get("plan")
        if plan is not None:
            acts = _lib.plan_actions(self._core.m, len(plan.get("names", ())))
            reasons = self._session().rc_reasons
            for name, a in acts.items():
                a["why_not_recomputable"] = None if a["recomputable"] else (
                    reasons.get(name) or (
                        "recompute is off (offload_activations(..., recompute=True))"
                        if not self._recompute else
                        "not a module run as one group (recompute=True runs the innermost "
                        "modules of the model's layers so)"))
            plan["actions"] = acts
            plan["recompute"] = self._recompute
        return st

    def pool_stats(self):
        return self._core.pool_stats()

    def device_stats(self):
        return self._core.rt.stats()


def offload_activations(model=None, use_pin_memory=True, use_streams=True, min_offload_size=1024,
                        max_fwd_stash_size=5, warn_if_no_head=True, offload_modules=None,
                        memory_target=None, device_memory_target=None, recompute=False):
    """A context manager (and decorator) that offloads every saved activation
    of at least min_offload_size bytes through ofl. See the module doc for
    how it maps onto the manager. ``offload_modules="auto"``: the first
    iteration (the warmup) offloads every one and measures; from the second
    on, ofl's plan offloads those that bring the activation peak within
    ``memory_target`` (bytes, or a str with K/M/G) at the least predicted
    exposed copy time; ``stats()["plan"]`` says what it chose.
    ``device_memory_target`` (with "auto"): the device memory the step may
    use at its peak, weights, gradients and optimizer state included; the
    warmup measures what is not activations and the plan aims the
    activations at the rest (the tighter of the two targets wins).
    ``recompute=True`` (with "auto" and a model): the innermost named
    modules (``layers.0.mlp``, ...) run as one group each, which the plan may
    also recompute (torch.utils.checkpoint, non-reentrant) where that costs
    less step time or where offloading cannot meet the target."""
    return OffloadActivations(use_pin_memory=use_pin_memory, use_streams=use_streams,
                              max_fwd_stash_size=max_fwd_stash_size,
                              min_offload_size=min_offload_size, model=model,
                              warn_if_no_head=warn_if_no_head and model is not None,
                              offload_modules=offload_modules, memory_target=memory_target,
                              device_memory_target=device_memory_target, recompute=recompute)
