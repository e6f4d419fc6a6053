"""``offload_activations``: a torchtune-style context manager (and decorator)
that offloads every saved activation, over an ofl manager of its own.

Mapping onto the manager (documented in python/README.md too):
  * one **chunk** per forward run under the context (``ofl_manager_chunk_begin
    (1, 0)`` at ``__enter__`` when grad is enabled);
  * one **group per saved tensor**, named ``activations``: the pack hook
    starts it, pushes the tensor and commits it at once, so the D2H copy of
    each activation starts right after the op that produced it, as
    torchtune's per-tensor offload does;
  * ``max_fwd_stash_size`` is the manager's ``max_inflight``: at most that
    many offloads of the name in flight before compute waits for the oldest
    (the activations alive in forward only because they are being copied);
  * backward: autograd unpacks in its own order, which is not exactly the
    reverse of the saves; each unpack first runs the backward markers
    (``group_backward_begin`` / ``_end``) of the groups the manager expects
    up to and including the tensor's own, which keeps the manager's
    prefetch one group ahead; pop is correct in any order (a group not yet
    prefetched is reloaded inline, after its offload);
  * the **iteration** ends at the next ``__enter__`` once every saved tensor
    of the previous forwards is gone (backward done, or graph dropped):
    ``ofl_manager_reset`` runs there, so gradient accumulation (several
    forwards, then their backwards) is one iteration of several chunks.
    The first iteration is the manager's warmup; a model whose saved-tensor
    structure changes from one iteration to the next (the manager answers
    OFL_ERR_MISMATCH) keeps its tensors in memory for the rest of that
    forward and gets a fresh manager (a new warmup) at the next iteration.
  * with ``model``, the activations saved inside its output head (the last
    ``nn.Linear``, or a module called ``output``/``lm_head``) are not
    offloaded: they are the first needed in backward. ``warn_if_no_head``
    warns when no such module is found.
  * ``use_streams=False`` waits for each copy right after its commit;
    ``use_pin_memory`` is accepted for compatibility: ofl's host pool is
    always page-locked on cuda (and plain memory on the host backend).
  * ``min_offload_size`` is in bytes; smaller tensors stay in memory and are
    never handed to ofl.
"""
import contextlib
import warnings

import torch

from .. import _lib
from .._errors import OflError
from ._core import ManagerCore

__all__ = ["offload_activations", "OffloadActivations"]

_NAME = b"activations"


class _ChunkToken:
    """Referenced by every record of one forward; its death (autograd let go
    of all of them) tells the context the chunk is over."""

    __slots__ = ("owner", "__weakref__")

    def __init__(self, owner):
        self.owner = owner
        owner.live_chunks += 1

    def __del__(self):
        try:
            self.owner.live_chunks -= 1
        except Exception:
            pass


class _G:
    __slots__ = ("token", "begun", "ended")

    def __init__(self, token):
        self.token = token
        self.begun = False
        self.ended = False


def _find_head(model):
    for attr in ("output", "lm_head", "head"):
        m = getattr(model, attr, None)
        if isinstance(m, torch.nn.Linear):
            return m
    last = None
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            last = m
    return last


class OffloadActivations(contextlib.ContextDecorator):
    def __init__(self, model=None, use_pin_memory=True, use_streams=True,
                 min_offload_size=1024, max_fwd_stash_size=5, warn_if_no_head=True):
        if max_fwd_stash_size < 1:
            raise ValueError("max_fwd_stash_size must be at least 1")
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.min_offload_size = int(min_offload_size)
        self.max_fwd_stash_size = int(max_fwd_stash_size)
        self.live_chunks = 0
        self._core = None
        self._new_core()
        self._chunks = []  # [[_G, ...] per chunk of this iteration]
        self._bwd = [0, 0]  # manager's backward position: chunk, groups done
        self._cur = None  # group begun, not ended
        self._broken = False
        self._suspend = 0
        self._token = None
        self._hooks = None
        self._handles = []
        if model is not None:
            head = _find_head(model)
            if head is None:
                if warn_if_no_head:
                    warnings.warn("offload_activations: no output head (nn.Linear) found in "
                                  "the model; every activation is offloaded, the last layer's "
                                  "too", stacklevel=2)
            else:
                self._handles.append(head.register_forward_pre_hook(self._head_pre))
                self._handles.append(head.register_forward_hook(self._head_post))

    def _new_core(self):
        if self._core is not None:
            self._core.close()
        self._core = ManagerCore(groups=b"", fraction=1.0, rank_delta_bytes=0, pp_rank=0,
                                 max_inflight=self.max_fwd_stash_size if self.use_streams else 0,
                                 summary=False)
        self._core.min_bytes = self.min_offload_size
        self._chunks = []
        self._bwd = [0, 0]
        self._cur = None

    def _head_pre(self, module, args):
        self._suspend += 1

    def _head_post(self, module, args, output):
        self._suspend -= 1

    # -- context
    def __enter__(self):
        if not torch.is_grad_enabled():
            self._hooks = None
            return self
        core = self._core
        if self.live_chunks == 0:
            self._end_iteration()
        core = self._core
        self._token = _ChunkToken(self)
        try:
            if not self._broken:
                core.chunk_begin(1, 0)
                self._chunks.append([])
        except OflError as e:
            if e.status != _lib.ERR_MISMATCH:
                raise
            self._broken = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._token = None
        if self._hooks is not None:
            h, self._hooks = self._hooks, None
            return h.__exit__(*exc)
        return False

    def _end_iteration(self):
        """All saved tensors of the previous forwards are gone: the
        manager's iteration ends."""
        if self._cur is not None:
            self._end_cur()
        if self._chunks or self._broken:
            try:
                self._core.reset()
            except OflError as e:
                if e.status != _lib.ERR_MISMATCH:
                    raise
                self._broken = True
            if self._broken:
                self._new_core()
                self._broken = False
        self._chunks = []
        self._bwd = [0, 0]
        self._cur = None

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._core is not None:
            self._core.close()
            self._core = None

    # -- hooks
    def _pack(self, t):
        core = self._core
        if (self._suspend or self._broken or t.device.type != core.device_type
                or t.numel() * t.element_size() < self.min_offload_size
                or isinstance(t, torch.nn.Parameter)):
            return t
        try:
            core.group_start(_NAME)
        except OflError as e:
            if e.status != _lib.ERR_MISMATCH:
                raise
            self._broken = True
            return t
        r = core.pack(t)
        core.commit(_NAME)
        g = _G(self._token)
        self._chunks[-1].append(g)
        if not self.use_streams:
            core.synchronize()
        if r is not t:  # a record of the manager's (core.Saved)
            r.group = g
        return r

    def _end_cur(self):
        g, self._cur = self._cur, None
        g.ended = True
        self._core.backward_end(_NAME)

    def _advance_to(self, g):
        """Runs the backward markers, in the manager's order (chunks first
        in, first out; groups of a chunk in reverse), up to g."""
        chunks = self._chunks
        pos = self._bwd
        while not g.begun:
            if self._cur is not None:
                self._end_cur()
            ci, done = pos
            if ci >= len(chunks):
                return
            groups = chunks[ci]
            if done >= len(groups):
                pos[0] += 1
                pos[1] = 0
                continue
            nxt = groups[len(groups) - 1 - done]
            pos[1] += 1
            self._core.backward_begin(_NAME)
            nxt.begun = True
            self._cur = nxt

    def _unpack(self, r):
        if type(r) is not self._core.Saved:
            return r
        g = r.group
        if not g.begun:
            self._advance_to(g)
        t = self._core.unpack(r)
        if self._cur is g:
            self._end_cur()
        return t

    # -- observability
    def stats(self):
        return self._core.stats()

    def pool_stats(self):
        return self._core.pool_stats()

    def device_stats(self):
        return self._core.rt.stats()


def offload_activations(model=None, use_pin_memory=True, use_streams=True, min_offload_size=1024,
                        max_fwd_stash_size=5, warn_if_no_head=True):
    """A context manager (and decorator) that offloads every saved activation
    of at least min_offload_size bytes through ofl. See the module doc for
    how it maps onto the manager."""
    return OffloadActivations(model=model, use_pin_memory=use_pin_memory, use_streams=use_streams,
                              min_offload_size=min_offload_size,
                              max_fwd_stash_size=max_fwd_stash_size,
                              warn_if_no_head=warn_if_no_head)
