"""``disk_checkpoint(function, *args, prefetch_size=1, save_workers=4,
disk_dir=None)``: activation checkpointing whose saved inputs wait on ofl's
disk tier (Axolotl's Disco pattern).

Forward runs ``function`` under ``torch.no_grad()`` (no activation is
saved), then writes each tensor input to an extent of ofl's disk store
(ofl_disk_extent_create, a copy into its bounce buffer, ofl_disk_extent_write
in the background) and drops the Python reference to the input. Backward
reloads the inputs (ofl_disk_extent_reload; a prefetch issued earlier makes
that a hit), restores the RNG state of the forward, recomputes ``function``
with grad enabled and backpropagates through it, like
torch.utils.checkpoint (non-reentrant semantics are not needed: the
recompute is local).

* ``prefetch_size``: when a checkpoint's backward begins, the inputs of the
  next ``prefetch_size`` checkpoints in backward order (the ones that ran
  forward just before it) start reading (ofl_disk_extent_prefetch).
* ``save_workers``: the disk store's queue depth (I/O requests in flight).
* ``disk_dir``: the directory of the store's (unnamed, private) file;
  None: OFL_DISK_DIR, TMPDIR or /tmp. One store per directory per process.

Axolotl's calling convention (its ``gradient_checkpointing: offload_disk``,
axolotl/monkeypatch/gradient_checkpointing/offload_disk.py): ``Disco``, an
autograd Function used as ``Disco.apply(decoder_layer, hidden_states,
*args)``, with ``Disco.get_instance(prefetch_size=1, prefetch_to_gpu=True,
save_workers=4)`` (``get_manager`` in older Axolotl) for the shared store,
and ``hf_grad_checkpoint_disk_offload_wrapper(decoder_layer, *args,
use_reentrant=None)``, the function Axolotl puts in place of
transformers.modeling_utils.checkpoint. As in Axolotl only
``hidden_states`` goes to disk and the other arguments stay in memory;
unlike Axolotl the recompute restores the forward's RNG state (dropout
gives the same mask) and arguments that require grad get their gradient
(Axolotl returns None for them). ``prefetch_to_gpu`` is accepted: ofl
reloads into the device the input came from.
* A store that refuses an extent (budget or file system full, a degraded
  store after a write fault, no bounce buffer) leaves that input in memory:
  the step succeeds, ``DiskStore.stats()['kept_in_memory']`` counts it. A
  write that fails after it was queued keeps the bytes in the bounce buffer
  (ofl's HOST_ONLY extent), so reload still returns them.
"""
import ctypes
import threading
import weakref

import torch

from .. import _lib
from .._errors import check, error
from ._core import Runtime

L = _lib.lib
_byref = ctypes.byref
_destroy_extent = L.ofl_disk_extent_destroy  # NULL accepted

__all__ = ["disk_checkpoint", "DiskStore", "Disco", "hf_grad_checkpoint_disk_offload_wrapper"]


class DiskStore:
    """One ofl disk store (ofl_disk_open) per directory."""

    _stores = {}
    _lock = threading.Lock()

    def __init__(self, disk_dir=None, queue_depth=0, budget_bytes=None):
        self.rt = Runtime.get()
        p = _lib.disk_params_init()
        p.dev = self.rt.dev
        self._dir = disk_dir.encode() if isinstance(disk_dir, str) else disk_dir
        p.dir = self._dir
        p.queue_depth = int(queue_depth)
        if budget_bytes is not None:
            p.budget_bytes = int(budget_bytes)
        d = ctypes.c_void_p()
        check(L.ofl_disk_open(_byref(p), _byref(d)), "ofl_disk_open")
        self.d = d.value
        self.kept_in_memory = 0
        self.stored = 0
        # weak references of the live checkpoints, in forward order: one
        # whose step was cut (its graph dropped) goes, and its extents with it
        self.order = []

    @classmethod
    def get(cls, disk_dir=None, queue_depth=0):
        key = disk_dir
        with cls._lock:
            s = cls._stores.get(key)
            if s is None:
                s = cls._stores[key] = DiskStore(disk_dir, queue_depth)
            return s

    @classmethod
    def close_all(cls):
        with cls._lock:
            for s in cls._stores.values():
                s.close()
            cls._stores.clear()

    def close(self):
        """Ends the extents of the checkpoints still alive, then the store."""
        for r in list(self.order):
            s = r()
            if s is not None:
                s.release()
        if self.d is not None:
            d, self.d = self.d, None
            L.ofl_disk_close(d)

    def put(self, t):
        """An extent holding t's bytes, or None when the store refused."""
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        nb = t.numel() * t.element_size()
        if nb == 0:
            return None
        e = ctypes.c_void_p()
        st = L.ofl_disk_extent_create(self.d, nb, _byref(e))
        if st in (_lib.ERR_NO_SPACE, _lib.ERR_NO_MEMORY):
            self.kept_in_memory += 1
            return None
        check(st, "ofl_disk_extent_create")
        data = L.ofl_disk_extent_data(e.value)
        if t.device.type == "cpu":
            ctypes.memmove(data, t.data_ptr(), nb)
        else:
            dst = torch.frombuffer((ctypes.c_ubyte * nb).from_address(data), dtype=torch.uint8)
            dst.copy_(t.view(-1).view(torch.uint8))
        st = L.ofl_disk_extent_write(e.value)
        if st != 0:
            L.ofl_disk_extent_destroy(e.value)
            raise error(st, "ofl_disk_extent_write")
        self.stored += 1
        return e.value

    def get_tensor(self, ext, dtype, shape, device):
        """The tensor of extent ext's bytes (the extent stays: its owner
        ends it)."""
        data = ctypes.c_void_p()
        check(L.ofl_disk_extent_reload(ext, _lib.TIMEOUT_DEFAULT, _byref(data)),
              "ofl_disk_extent_reload")
        out = torch.empty(shape, dtype=dtype, device=device)
        nb = out.numel() * out.element_size()
        if out.device.type == "cpu":
            ctypes.memmove(out.data_ptr(), data.value, nb)
        else:
            src = torch.frombuffer((ctypes.c_ubyte * nb).from_address(data.value), dtype=torch.uint8)
            out.view(-1).view(torch.uint8).copy_(src)
        return out

    def prefetch(self, ext):
        L.ofl_disk_extent_prefetch(ext)  # best effort (quiet refusals)

    def drop(self, ext):
        L.ofl_disk_extent_destroy(ext)

    def stats(self):
        s = _lib.DiskStats()
        L.ofl_disk_get_stats(self.d, _byref(s))
        d = {n: getattr(s, n) for n, _ in _lib.DiskStats._fields_ if n != "_reserved"}
        d["kept_in_memory"] = self.kept_in_memory
        d["stored"] = self.stored
        return d


class _Saved:
    """The inputs of one checkpoint: per tensor input either an extent or
    the tensor itself (kept in memory)."""

    def __init__(self, store):
        self.store = store
        self.items = []  # (ext or None, tensor or None, dtype, shape, device, requires_grad)
        self.done = False
        self.ref = weakref.ref(self)  # its entry in store.order

    def prefetch(self):
        for ext, *_ in self.items:
            if ext is not None:
                self.store.prefetch(ext)

    def release(self):
        if not self.done:
            # each extent leaves the list on the line of the C call that
            # ends it (an interrupt cannot come between the two): a release
            # cut by an interrupt and run again ends none twice
            items = self.items
            while items and self.store.d is not None:
                ext = items[-1][0]; items.pop(); _destroy_extent(ext)  # noqa: E702
            self.done = True
            try:
                self.store.order.remove(self.ref)
            except ValueError:
                pass

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


class _DiskCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, store, prefetch_size, ndisk, *args):
        """The first ``ndisk`` arguments that are tensors go to disk, the
        others stay in memory until the recompute."""
        ctx.function = function
        ctx.prefetch_size = prefetch_size
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = None
        if torch.cuda.is_available() and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            ctx.cuda_rng = torch.cuda.get_rng_state()
        with torch.no_grad():
            out = function(*args)
        saved = _Saved(store)
        ctx.args = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                ext = store.put(a) if i < ndisk else None
                saved.items.append((ext, None if ext is not None else a.detach(), a.dtype,
                                    a.shape, a.device, a.requires_grad))
                ctx.args.append(len(saved.items) - 1)
            else:
                ctx.args.append(("const", a))
        store.order.append(saved.ref)
        ctx.saved = saved
        return out

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved
        store = saved.store
        # prefetch the inputs of the checkpoints that run backward next
        try:
            i = store.order.index(saved.ref)
            for r in store.order[max(0, i - ctx.prefetch_size):i]:
                s = r()
                if s is not None:
                    s.prefetch()
        except ValueError:
            pass
        inputs = []
        for a in ctx.args:
            if isinstance(a, tuple):
                inputs.append(a[1])
                continue
            ext, t, dtype, shape, device, rg = saved.items[a]
            if ext is not None:
                t = store.get_tensor(ext, dtype, shape, device)
                # the item forgets the extent on the line that ends it
                saved.items[a] = (None, None, dtype, shape, device, rg); _destroy_extent(ext)  # noqa: E702,E501
            x = t.detach()
            x.requires_grad_(rg)
            inputs.append(x)
        saved.release()
        devices = [torch.cuda.current_device()] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            with torch.enable_grad():
                out = ctx.function(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        gin = tuple(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
                    for x in inputs)
        return (None, None, None, None) + gin


def disk_checkpoint(function, *args, prefetch_size=1, save_workers=4, disk_dir=None):
    """Runs function(*args) without saving its activations; its tensor inputs
    wait on ofl's disk tier until backward recomputes it."""
    store = DiskStore.get(disk_dir, save_workers)
    if not torch.is_grad_enabled():
        return function(*args)
    return _DiskCheckpoint.apply(function, store, int(prefetch_size), len(args), *args)


class _DiscoInstance:
    """The store and prefetch depth of Disco (Axolotl's DiskOffloadManager)."""

    def __init__(self, prefetch_size, prefetch_to_gpu, save_workers):
        self.prefetch_size = int(prefetch_size)
        self.prefetch_to_gpu = bool(prefetch_to_gpu)
        self.store = DiskStore.get(None, save_workers)


class Disco(torch.autograd.Function):
    """Axolotl's disk checkpointer over ofl's disk tier:
    ``Disco.apply(forward_function, hidden_states, *args)`` runs
    ``forward_function(hidden_states, *args)`` without saving its
    activations, keeps ``hidden_states`` on disk until backward and
    recomputes there (see the module doc)."""

    _instance = None

    @staticmethod
    def get_instance(prefetch_size=1, prefetch_to_gpu=True, save_workers=4):
        """The shared store (made at the first call, with its arguments)."""
        if Disco._instance is None:
            Disco._instance = _DiscoInstance(prefetch_size, prefetch_to_gpu, save_workers)
        return Disco._instance

    get_manager = get_instance  # Axolotl before get_instance

    @classmethod
    def apply(cls, forward_function, hidden_states, *args):
        inst = cls.get_instance()
        if not torch.is_grad_enabled():
            return forward_function(hidden_states, *args)
        return _DiskCheckpoint.apply(forward_function, inst.store, inst.prefetch_size, 1,
                                     hidden_states, *args)


def hf_grad_checkpoint_disk_offload_wrapper(decoder_layer, *args, use_reentrant=None):
    """Axolotl's stand-in for transformers.modeling_utils.checkpoint
    (``gradient_checkpointing: offload_disk``): Disco over the layer call
    transformers hands it (a partial carrying the keyword arguments)."""
    return Disco.apply(decoder_layer, *args)
