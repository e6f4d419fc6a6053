"""The engine under every interface of ofl.torch: one ofl manager driven from
torch's saved-tensor hooks.

How a torch tensor crosses into ofl (pack):
  * a tensor the manager may offload (on the manager's device, not a
    Parameter, not marked, at least the size threshold) is wrapped with
    ofl_tensor_wrap at OFL_LOC_DEVICE (on the host backend "device" memory is
    host memory, so a CPU tensor is device memory there): its storage is
    wrapped once per group as bytes (U8), and each saved tensor is a view of
    it (ofl_tensor_view / alias), so that tensors sharing a storage are
    copied once (the manager's rule 6) and a non-contiguous view covering at
    least half of its storage is offloaded as the whole storage and rebuilt
    with as_strided; a smaller non-contiguous view stays in Python;
  * the wrap has no release callback: ofl never frees torch memory. The
    Python reference that keeps the torch storage alive is dropped once the
    D2H copy has completed: after each commit an ofl event is recorded on
    the manager's D2H stream and the references of the tensors that lost
    their device storage (the manager released them after the copy) are let
    go when that event has completed (polled on the training thread at the
    next commit, backward marker or reset; no callback from an ofl thread,
    so no GIL hand-off on the copy path). forced_released_tensors whose
    storage was offloaded with the group get ``untyped_storage().resize_(0)``
    at the same point (the reference's resize_(0) after record_stream).

How it comes back (unpack): ofl_manager_tensor_pop returns the handle with
device storage. A tensor that was not offloaded still has the torch storage:
the original torch tensor is returned. A reloaded one lives in a block of the
manager's device pool: it is handed to torch without a copy
(host backend: imported through DLPack by ofl._ext, or torch.frombuffer
over its Block; cuda: __cuda_array_interface__, _wrap_reloaded) and
the block goes back to the pool (stream-ordered after the compute stream on
cuda) when torch frees the last view of it. Copying into torch.empty would
cost one more memcpy of every reloaded byte and saves no allocation (the
reload already needs its destination), so the zero-copy wrap is used. The
manager is not destroyed while such tensors live (reset_instance defers the
destroy until the last one is freed).

Compute stream: the host backend's compute stream is the calling thread. On
cuda torch's current stream is wrapped (ofl_stream_wrap_native, cached per
stream) and set as ofl's compute stream of the calling thread before every
call that orders against compute (autograd runs backward on its own device
thread, so it is set there too).
"""
import atexit
import ctypes
import os
import threading
import warnings
import weakref

import torch

from .. import _lib
from .._errors import OflError, check, error

L = _lib.lib
_byref = ctypes.byref
_PTR = ctypes.sizeof(ctypes.c_void_p)


def _c_void_p_at(arr, i):
    """Element i of a ctypes c_void_p array as a c_void_p over its memory
    (an out-parameter the C call writes in place)."""
    return ctypes.c_void_p.from_buffer(arr, i * _PTR)
_weakref = weakref.ref


def _load_ext():
    """ofl._ext (the saved-tensor hooks, in C), set up, or None and why not.
    It links libofl (the package's copy, or the build's); ofl._lib loaded a
    libofl with ctypes first, and the module is bound to that same library
    (the dynamic loader matches the soname), which is checked here: two
    libofl in one process would each have a manager the other does not
    know."""
    if os.environ.get("OFL_PYTHON_EXT", "").strip() == "0":
        warnings.warn("ofl.torch: OFL_PYTHON_EXT=0 no longer selects saved-tensor hooks over "
                      "ctypes: there is one implementation, the C extension ofl._ext; unset "
                      "OFL_PYTHON_EXT", stacklevel=2)
    try:
        from .. import _ext
    except ImportError as e:
        return None, "ofl._ext cannot be imported (%s)" % e
    if getattr(_ext, "ABI_VERSION", None) != 3:
        return None, "ofl._ext at %s is of another version of the package" % _ext.__file__
    bound, _ = _ext.library()
    try:
        same = os.path.samefile(bound, _lib.path)
    except OSError:
        same = os.path.realpath(bound) == os.path.realpath(_lib.path)
    if not same:
        return None, ("ofl._ext at %s is bound to the libofl at %s, not to the one ofl loaded "
                      "(%s): OFL_LIBRARY and the package's ofl/_libs name different builds"
                      % (_ext.__file__, bound, _lib.path))
    _ext.setup(error, torch)
    return _ext, None


_ext, _ext_missing = _load_ext()
hooks_backend = "c" if _ext is not None else None
"""The saved-tensor hooks ManagerCore runs: "c" (ofl._ext), or None where the
extension is missing (ofl.torch's offloading then refuses to start and says
why: hooks_backend_reason)."""
hooks_backend_reason = _ext_missing or "ofl._ext from %s" % _ext.__file__

_TORCH_TO_OFL = {
    torch.float32: _lib.DTYPE_F32,
    torch.float16: _lib.DTYPE_F16,
    torch.bfloat16: _lib.DTYPE_BF16,
    torch.int64: _lib.DTYPE_I64,
    torch.int32: _lib.DTYPE_I32,
    torch.int16: _lib.DTYPE_I16,
    torch.int8: _lib.DTYPE_I8,
    torch.uint8: _lib.DTYPE_U8,
    torch.bool: _lib.DTYPE_BOOL,
}
for _n, _c in (("float8_e4m3fn", _lib.DTYPE_F8_E4M3), ("float8_e5m2", _lib.DTYPE_F8_E5M2)):
    if hasattr(torch, _n):
        _TORCH_TO_OFL[getattr(torch, _n)] = _c
_OFL_TO_TORCH = {v: k for k, v in _TORCH_TO_OFL.items()}


def ofl_dtype(dtype):
    try:
        return _TORCH_TO_OFL[dtype]
    except KeyError:
        raise TypeError("ofl: dtype %s has no ofl equivalent" % dtype) from None


def torch_dtype(code):
    return _OFL_TO_TORCH[code]


def _env_int(name, default):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return int(float(v))


# ---- the device ---------------------------------------------------------------


class Runtime:
    """The process's ofl device: cuda when OFL_BACKEND says so or (auto) when
    torch sees a GPU, else the host backend. Shared by every manager, disk
    store and stager that ofl.torch creates."""

    _instance = None
    _lock = threading.Lock()

    def __init__(self):
        p = _lib.device_params_init()
        want = os.environ.get("OFL_BACKEND", "auto").lower()
        if want == "auto":
            p.backend = _lib.BACKEND_CUDA if torch.cuda.is_available() else _lib.BACKEND_HOST
        dev = ctypes.c_void_p()
        check(L.ofl_device_open(_byref(p), _byref(dev)), "ofl_device_open")
        self.dev = dev.value
        self.backend = L.ofl_device_backend(self.dev)
        self.is_cuda = self.backend == _lib.BACKEND_CUDA
        if not self.is_cuda:
            # CPU tensors are the host backend's device memory here: the
            # manager offloads them in place (no copy into ofl's memory)
            check(L.ofl_device_adopt_host_memory(self.dev, 1), "ofl_device_adopt_host_memory")
        self.device_type = "cuda" if self.is_cuda else "cpu"
        # the GPU ofl opened (OFL_DEVICE, else the current device at the
        # first use): its tensors, streams and memory are ofl's; a tensor
        # of another GPU stays where it is
        self.ordinal = L.ofl_device_ordinal(self.dev) if self.is_cuda else -1
        self.torch_device = (torch.device("cuda", self.ordinal) if self.is_cuda
                             else torch.device("cpu"))
        self._wrapped = {}  # cudaStream_t -> ofl stream
        self._tls = threading.local()
        # The device lives until the process ends and is never closed, so
        # OFL_TRACE_FILE's trace is written at interpreter exit instead
        atexit.register(L.ofl_device_trace_flush, self.dev)

    @classmethod
    def get(cls):
        inst = cls._instance
        if inst is None:
            with cls._lock:
                if cls._instance is None:
                    cls._instance = Runtime()
                inst = cls._instance
        return inst

    def compute_stream(self):
        """ofl's compute stream for the calling thread: torch's current
        stream on cuda (set as the thread's override), the device's on the
        host backend."""
        if not self.is_cuda:
            return L.ofl_device_compute_stream(self.dev)
        native = torch.cuda.current_stream(self.torch_device).cuda_stream
        tls = self._tls
        if getattr(tls, "native", None) != native:
            s = self._wrapped.get(native)
            if s is None:
                out = ctypes.c_void_p()
                check(L.ofl_stream_wrap_native(self.dev, ctypes.c_void_p(native),
                                               b"torch", _byref(out)),
                      "ofl_stream_wrap_native")
                s = self._wrapped[native] = out.value
            L.ofl_device_set_compute_stream(self.dev, s)
            tls.native = native
            tls.stream = s
        return tls.stream

    def allocator(self):
        """The ofl_allocator_t over torch's allocator (None without ofl._ext,
        whose C callbacks it needs): the blocks of ofl.torch's device pools
        are torch's memory, so one allocator serves the GPU (torch's cuda
        caching allocator: torch.cuda.memory_allocated counts reloaded
        activations, and either side's cache is the other's to use) and, on
        the host backend, CPU tensors (the device adopts them)."""
        if _ext is None:
            return None
        a = getattr(self, "_allocator", None)
        if a is None:
            self._blocks = {}  # host backend: address -> the torch tensor
            fa, ff = _ext.set_allocator(self._alloc, self._free)
            a = self._allocator = _lib.Allocator(None, fa, ff)
        return a

    def _alloc(self, nbytes, stream):
        if self.is_cuda:
            native = L.ofl_stream_native(stream) if stream else None
            return torch.cuda.caching_allocator_alloc(
                nbytes, device=self.ordinal,
                stream=native if native else torch.cuda.current_stream(self.torch_device))
        t = torch.empty(nbytes, dtype=torch.uint8)
        p = t.data_ptr()
        self._blocks[p] = t
        return p

    def _free(self, ptr):
        if self.is_cuda:
            torch.cuda.caching_allocator_delete(ptr)
        else:
            self._blocks.pop(ptr, None)

    def stats(self):
        s = _lib.DeviceStats()
        L.ofl_device_get_stats(self.dev, _byref(s))
        d = {n: getattr(s, n) for n, _ in _lib.DeviceStats._fields_ if n not in ("copy_bytes", "_reserved")}
        d["copy_bytes"] = list(s.copy_bytes)
        return d


# ---- zero-copy torch tensors over ofl storage ---------------------------------


class _Block:
    """Owns an ofl tensor handle whose storage a torch tensor uses; destroyed
    when torch frees the last view (the buffer object dies with the torch
    storage). The cuda path of ofl._ext's unpack: its pop hands the handle
    to ``_wrap_reloaded``, which makes the block first (the host backend's
    block is ofl._ext's own Block).

    The core lists every block (``core.blocks``: a weak reference -> its
    ``v`` and stream): a __del__ cut by an interrupt (Python reports it as
    unraisable and drops the rest) leaves its handle there, and the core's
    next reset, close or pool_stats ends it (reap_blocks). The handle is
    ended by one C call that also clears ``v`` (ofl_tensor_destroy_slot),
    so ending it twice does nothing."""

    __slots__ = ("core", "v", "ref", "stream", "key", "__weakref__")

    def __init__(self, core, h=None, stream=None):
        self.core = core
        self.v = ctypes.c_void_p(h)
        self.ref = _byref(self.v)
        self.stream = stream
        self.key = _weakref(self)
        core.live_blocks += 1
        core.blocks[self.key] = (self.v, stream)

    @property
    def h(self):
        return self.v.value

    def __del__(self):
        if getattr(self, "key", None) is not None:  # not an __init__ cut before the handle
            L.ofl_tensor_destroy_slot(self.ref, self.stream)
            self.core._block_freed(self.key)


class _CudaArray:
    __slots__ = ("__cuda_array_interface__", "_ofl")


def wrap_storage(core, h, nbytes, dtype, device_type, stream=None):
    """A torch tensor (1-D, dtype) over the nbytes at ofl tensor h's data,
    keeping h alive until torch lets go."""
    return wrap_block(_Block(core, h, stream), nbytes, dtype, device_type)


def wrap_block(blk, nbytes, dtype, device_type):
    """wrap_storage over the handle a _Block owns."""
    core = blk.core
    ptr = L.ofl_tensor_data(blk.v.value)
    if device_type == "cpu":
        buf = (ctypes.c_ubyte * nbytes).from_address(ptr)
        buf._ofl = blk
        return torch.frombuffer(buf, dtype=dtype)
    a = _CudaArray()
    a._ofl = blk
    a.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                  "data": (ptr, False), "version": 2}
    return torch.as_tensor(a, device=core.rt.torch_device).view(dtype)


# ---- the engine ------------------------------------------------------------------


def _kept_tensor(r):
    """The tensor of a _Kept record, unchanged since the save."""
    t = r.t
    if t._version != r.version:
        raise _modified_error(t, t.size(), r.version, t._version)
    return t


def _modified_error(t, size, version, now):
    """The error autograd raises for a saved tensor changed in place."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        "inplace operation: [%s %s] is at version %d; expected version %d instead. Hint: "
        "the tensor was changed in place after it was saved for backward (checked by "
        "ofl.torch's saved-tensor hooks, as autograd checks it without hooks); enable "
        "anomaly detection with torch.autograd.set_detect_anomaly(True) to find the "
        "operation, and use an out-of-place operation (or .clone()) instead"
        % (t.type(), list(size), now, version))


class _Group:
    __slots__ = ("name", "records", "bases", "index", "aliases", "forced")

    def __init__(self, name):
        self.name = name
        self.records = []
        self.bases = {}  # storage data_ptr -> [base handle, pushed?]
        self.index = -1
        # handles owned from the C call that makes them on (an interrupt
        # after that call leaves them here, for _drop_bases): the commit's
        # forced-release aliases
        self.aliases = None  # ctypes.c_void_p array
        self.forced = ()


def unpack_detached(r):
    """Unpack of a record whose manager is gone from its context: kept
    tensors and tensors already popped."""
    tr = type(r)
    if _ext is not None and tr is _ext.Kept:
        return _kept_tensor(r)
    if _ext is not None and tr is _ext.Saved:
        if r.cached is None:
            raise RuntimeError("ofl.torch: a saved tensor was unpacked after its manager was "
                               "closed; run backward before close()")
        return r.cached
    return r


class _CoreMethods:
    """One ofl manager and the Python state around it (everything but the
    saved-tensor hooks, which the class it is combined with provides)."""

    def __init__(self, *, groups=b"", fraction=None, rank_delta_bytes=None,
                 max_inflight=None, pp_rank=0, prefetch_groups=0,
                 host_budget_bytes=None, summary=False, disk=None, memory_target=None,
                 device_memory_target=None):
        self.rt = Runtime.get()
        p = _lib.manager_params_init()
        p.device = self.rt.dev
        p.groups = groups
        # groups "auto": the plan chooses at the end of the warmup
        self.auto = groups == b"auto"
        if memory_target is not None:
            p.memory_target_bytes = int(memory_target)
        # the device target: the warmup's end measures what is not
        # activations (_note_device_peak) and the plan gets the rest
        self.device_target = None
        self.device_figures = None
        if device_memory_target is not None:
            p.device_memory_target_bytes = int(device_memory_target)
            self.device_target = int(device_memory_target) or None
        p.min_offload_bytes = 1  # the size threshold is applied in Python
        if fraction is not None:
            p.fraction = float(fraction)
        if rank_delta_bytes is not None:
            p.rank_delta_bytes = int(rank_delta_bytes)
        if max_inflight is not None:
            p.max_inflight = int(max_inflight)
        if host_budget_bytes is not None:
            p.host_budget_bytes = int(host_budget_bytes)
        p.pp_rank = int(pp_rank)
        p.prefetch_groups = int(prefetch_groups)
        if disk is not None:
            p.disk = disk
        # reloaded activations in torch's memory: a device pool over torch's
        # allocator, given to the manager (its own would cudaMalloc beside
        # torch's caching allocator)
        self.torch_pool = None
        alloc = self.rt.allocator()
        if alloc is not None:
            pp = _lib.pool_params_init()
            pp.name = b"torch"
            pp.allocator = ctypes.pointer(alloc)
            tp = ctypes.c_void_p()
            check(L.ofl_pool_create(self.rt.dev, _byref(pp), _byref(tp)), "ofl_pool_create")
            self.torch_pool = tp.value
            p.device_pool = tp.value
        m = ctypes.c_void_p()
        st = L.ofl_manager_create(_byref(p), _byref(m))
        if st != 0:
            if self.torch_pool is not None:
                L.ofl_pool_destroy(self.torch_pool)
            raise error(st, "ofl_manager_create")
        self.m = m.value
        self.d2h = L.ofl_manager_d2h_stream(self.m)
        # The host backend copies only from its own device memory (blocks of
        # ofl_device_malloc): a CPU tensor is copied into a block of the
        # manager's device pool at pack time ("device" memory there), and the
        # torch tensor is let go at once. On cuda torch memory is wrapped.
        self.copy_in = not self.rt.is_cuda
        self.dev_pool = L.ofl_manager_device_pool(self.m)
        self.summary = summary
        self.summary_text = None
        self.summary_rows = None  # [{group: bytes}] per rank (rank 0), or this rank's
        self.device_type = self.rt.device_type
        self.torch_device = self.rt.torch_device
        self.ordinal = self.rt.ordinal
        self.is_cuda = self.rt.is_cuda
        self.enabled = True
        self.forward_only = False
        self.active = True
        self.min_elems = 0
        self.min_bytes = 0
        self.open = []  # open groups, innermost last
        self.delayed = []
        self.pending = []  # (event, [tensors to drop], [tensors to resize_(0)])
        self.free_events = []
        self._boundary_ev = None  # forward/backward_record's event
        self.live_blocks = 0
        self.blocks = {}  # weakref of a _Block -> (its handle's c_void_p, stream)
        self.unpopped = 0  # records pushed, not popped, alive
        self.closing = False
        # libofl calls on the manager in progress: Python can run inside one
        # (the allocator's torch.empty, a GC it starts) and free the last
        # block of a closing manager; the destroy waits for the call's end
        self.in_call = 0
        self.destroy_pending = False
        # reused out-parameters
        self._h = ctypes.c_void_p()
        self._href = _byref(self._h)
        self._tag = ctypes.c_uint64()
        self._tagref = _byref(self._tag)
        self._shape = (ctypes.c_int64 * 1)()

    # -- lifetime
    def _block_freed(self, key):
        if self.blocks.pop(key, None) is not None:
            self.live_blocks -= 1
        if self.closing and self.live_blocks == 0:
            self._destroy_now()

    def reap_blocks(self):
        """Ends the handles of blocks whose __del__ was cut (see _Block)."""
        for key in [k for k in self.blocks if k() is None]:
            v, stream = self.blocks[key]
            self._check(L.ofl_tensor_destroy_slot(_byref(v), stream), "ofl_tensor_destroy_slot")
            self._block_freed(key)

    def close(self):
        if self.m is None or self.closing:
            return
        self.reap_blocks()
        self.closing = True
        self.release_pending(wait=True)
        L.ofl_manager_synchronize(self.m, _lib.TIMEOUT_DEFAULT)
        _ext.drain()
        for g in self.open:
            self._drop_bases(g)
        self.open = []
        if self.live_blocks == 0:
            self._destroy_now()

    def _destroy_now(self):
        m = self.m
        if m is None:
            return
        if self.in_call:  # inside a call on this manager: at its end (_leave)
            self.destroy_pending = True
            return
        self.m = None  # before the calls: code they let run sees it destroyed
        L.ofl_manager_destroy(m)
        if self.torch_pool is not None:  # after the manager: its reload pool
            L.ofl_pool_destroy(self.torch_pool)
            self.torch_pool = None
            _ext.drain()  # the blocks it freed go back to torch
        for ev in self.free_events:
            L.ofl_event_destroy(ev)
        self.free_events = []
        ev = self._boundary_ev
        if ev is not None:
            L.ofl_event_destroy(ev)
            self._boundary_ev = None

    def _leave(self):
        """The end of a libofl call bracketed by in_call += 1: a destroy
        that waited for it runs now."""
        self.in_call -= 1
        if not self.in_call and self.destroy_pending:
            self.destroy_pending = False
            if self.closing and self.live_blocks == 0:
                self._destroy_now()

    def _sync_compute(self):
        if self.is_cuda:
            self.rt.compute_stream()

    def _update_active(self):
        self.active = self.enabled and not self.forward_only

    def _check(self, st, where):
        if st != 0:
            raise error(st, where)

    def _version_error(self, t, size, version, now):
        return _modified_error(t, size, version, now)

    def _pop_error(self, st):
        e = error(st, "unpacking a saved tensor (ofl_manager_tensor_pop)")
        if st == _lib.ERR_INVALID_ARG:
            return RuntimeError(
                "ofl.torch: backward used a saved tensor of an iteration that was already "
                "ended (reset(), or a new forward of offload_activations after this one was "
                "abandoned): its memory was released. Run the backward of every forward "
                "before reset() (%s)" % e)
        return e

    # -- switches
    def set_enabled(self, on):
        self.enabled = bool(on)
        (L.ofl_manager_enable_offload if on else L.ofl_manager_disable_offload)(self.m)
        self._update_active()

    def set_forward_only(self, on):
        on = bool(on)
        if on != self.forward_only:
            L.ofl_manager_set_forward_only(self.m, 1 if on else 0)
            self.forward_only = on
            self._update_active()

    # -- forward
    def chunk_begin(self, vp_size, vp_stage):
        self._check(L.ofl_manager_chunk_begin(self.m, int(vp_size or 1), int(vp_stage or 0)),
                    "ofl_manager_chunk_begin")

    def group_start(self, name):
        bname = name.encode() if isinstance(name, str) else name
        self._check(L.ofl_manager_group_start(self.m, bname), "ofl_manager_group_start(%s)" % name)
        g = _Group(bname)
        self.open.append(g)
        return g

    def _drop_bases(self, g):
        """Ends the group's handles that the manager does not own: bases not
        pushed, the base being made, forced-release aliases. A base is
        marked ended on the line of the C call that ends it (nothing
        between the two can be interrupted) and the others are ended by
        ofl_tensor_destroy_slot, so a second call after a cut one ends
        nothing twice."""
        for base in list(g.bases.values()):
            if not base[1]:
                base[1] = None; L.ofl_tensor_destroy(base[0])  # noqa: E702 one line (see above)
        g.bases = {}
        self._drop_aliases(g)

    def _drop_aliases(self, g):
        arr = g.aliases
        if arr is not None:
            for i in range(len(arr)):
                L.ofl_tensor_destroy_slot(_byref(_c_void_p_at(arr, i)), None)

    def _find_open(self, bname):
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i].name == bname:
                return i
        return -1

    def commit(self, name, forced=(), delay=False):
        bname = name.encode() if isinstance(name, str) else name
        i = self._find_open(bname)
        g = self.open[i] if i >= 0 else None
        # forced releases: aliases of the storages pushed in this group, made
        # into g.aliases (g owns them from the C call on; _drop_bases ends them)
        n = 0
        arr = None
        if g is not None and forced:
            forced_t = []
            arr = g.aliases = (ctypes.c_void_p * len(forced))()
            for f in forced:
                if not isinstance(f, torch.Tensor) or f.device.type != self.device_type:
                    continue
                base = g.bases.get(f.untyped_storage().data_ptr())
                if base is None:
                    continue
                self._check(L.ofl_tensor_alias(base[0], _byref(_c_void_p_at(arr, n))), "ofl_tensor_alias")
                n += 1
                forced_t.append(f)
            g.forced = forced_t
        self._sync_compute()
        st = L.ofl_manager_group_commit(self.m, bname, arr if n else None, n, 1 if delay else 0)
        if st != 0:
            if g is not None:
                self._drop_aliases(g)
            raise error(st, "ofl_manager_group_commit(%s)" % bname.decode())
        if g is None:
            return
        # g leaves self.open once its handles are ended: a cut before that
        # leaves it there for the recovery (commit_open_groups ends them)
        if delay:
            self.delayed.append(g)
            del self.open[i]
            return
        self._after_commit(g)
        del self.open[i]

    def flush_delayed(self):
        self._sync_compute()
        st = L.ofl_manager_flush_delayed_groups(self.m)
        delayed, self.delayed = self.delayed, []
        for g in delayed:
            self._after_commit(g)
        self._check(st, "ofl_manager_flush_delayed_groups")

    def _after_commit(self, g):
        has = L.ofl_tensor_has_storage
        drop = []
        if self.copy_in:
            for r in g.records:  # the manager holds a copy
                r.tensor = None
        else:
            for r in g.records:
                if r.tensor is not None and not has(r.h):
                    drop.append(r.tensor)
                    r.tensor = None
        resize = []
        arr = g.aliases
        for k, f in enumerate(g.forced):
            if not has(arr[k]):
                resize.append(f)
        self._drop_bases(g)
        g.records = None
        if drop or resize:
            self._hold_until_copied(drop, resize)
        self.release_pending()

    def _hold_until_copied(self, drop, resize):
        """Keeps the torch tensors of drop (and resize, resize_(0) then)
        until the D2H copies issued so far have completed."""
        ev = self.free_events.pop() if self.free_events else None
        if ev is None:
            out = ctypes.c_void_p()
            check(L.ofl_event_create(self.rt.dev, _byref(out)), "ofl_event_create")
            ev = out.value
        self._check(L.ofl_event_record(ev, self.d2h), "ofl_event_record")
        self.pending.append((ev, drop, resize))

    def release_pending(self, wait=False):
        """Lets go of torch storage whose D2H copy has completed."""
        pend = self.pending
        while pend:
            ev = pend[0][0]
            if wait:
                check(L.ofl_event_synchronize(ev, _lib.TIMEOUT_DEFAULT), "ofl_event_synchronize")
            elif L.ofl_event_query(ev) != 0:
                break
            _, drop, resize = pend.pop(0)
            for f in resize:
                f.untyped_storage().resize_(0)
            drop.clear()
            self.free_events.append(ev)

    # -- graph-capture boundaries
    def record_boundary(self, forward):
        """ofl_manager_forward_record / _backward_record on torch's current
        stream: compute waits for the D2H (forward) or H2D (backward)
        stream; inside a CUDA graph capture the C call records the boundary
        without waiting on a stream outside the capture (and refuses while
        copies are in flight), so the capture stays valid."""
        self._sync_compute()
        ev = self._boundary_ev
        if ev is None:
            out = ctypes.c_void_p()
            check(L.ofl_event_create(self.rt.dev, _byref(out)), "ofl_event_create")
            ev = self._boundary_ev = out.value
        fn = L.ofl_manager_forward_record if forward else L.ofl_manager_backward_record
        self._check(fn(self.m, ev), "forward_record" if forward else "backward_record")

    # -- backward
    def backward_begin(self, name):
        self._sync_compute()
        self.in_call += 1  # may reload: the allocator runs Python
        try:
            st = L.ofl_manager_group_backward_begin(self.m, name)
        finally:
            self._leave()
        self._check(st, "ofl_manager_group_backward_begin(%s)" % name.decode())
        if self.pending:
            self.release_pending()

    def backward_end(self, name):
        self._sync_compute()
        self.in_call += 1
        try:
            st = L.ofl_manager_group_backward_end(self.m, name)
        finally:
            self._leave()
        self._check(st, "ofl_manager_group_backward_end(%s)" % name.decode())

    def _wrap_reloaded(self, h, r):
        """The torch tensor of saved record r over popped handle h (an int,
        owned from here on), reloaded into the manager's device pool: the
        cuda path of ofl._ext (the host backend's is in C)."""
        x = wrap_storage(self, h, r.nbytes, torch.uint8 if r.whole else r.dtype,
                         self.device_type, self.rt.compute_stream() if self.is_cuda else None)
        if r.whole:
            return x.view(r.dtype).as_strided(r.size, r.stride, r.offset)
        return x.view(r.size) if len(r.size) != 1 else x

    # -- iteration
    def _note_device_peak(self):
        """Before a warmup reset with a device target: the device peak the C
        plan reads (it takes the activation pool's peak off it). On cuda
        torch's allocator holds everything (torch.cuda.max_memory_allocated).
        On the host backend torch keeps no CPU allocator statistics: ofl's
        device peak, plus the activation pool's blocks where they are torch's
        memory (the C extension's allocator); weights and optimizer state in
        torch's CPU memory are not in it."""
        d, ps = _lib.DeviceStats(), _lib.PoolStats()
        L.ofl_device_get_stats(self.rt.dev, _byref(d))
        L.ofl_pool_get_stats(self.dev_pool, _byref(ps))
        if self.is_cuda:
            peak, source = int(torch.cuda.max_memory_allocated(self.torch_device)), "torch.cuda"
        else:
            peak, source = int(d.device_bytes_peak), "ofl device"
            if self.torch_pool is not None:
                peak += int(ps.peak_in_use_bytes)
        L.ofl_manager_set_device_peak(self.m, peak)
        self.device_figures = {"device_peak_bytes": peak,
                               "activation_pool_peak_bytes": int(ps.peak_in_use_bytes),
                               "device_source": source}

    def reset(self):
        self.reap_blocks()
        was_warmup = L.ofl_manager_is_warmup(self.m)
        self._sync_compute()
        if was_warmup and self.device_target:
            self._note_device_peak()
        self.in_call += 1
        try:
            st = L.ofl_manager_reset(self.m)
        finally:
            self._leave()
        if st == 0 or st == _lib.ERR_MISMATCH or (st == _lib.ERR_CONFIG and was_warmup
                                                  and not L.ofl_manager_is_warmup(self.m)):
            for g in self.open:
                self._drop_bases(g)
            self.open = []
            self.delayed = []
        self.release_pending(wait=True)
        _ext.drain()  # torch tensors whose memory ofl released
        if st == 0 and was_warmup and not L.ofl_manager_is_warmup(self.m) and self.summary:
            self.summary_text = self.render_summary()
            if self.summary_text and _rank() == 0:
                print(self.summary_text, end="" if self.summary_text.endswith("\n") else "\n",
                      flush=True)
        self._check(st, "ofl_manager_reset")

    def commit_open_groups(self):
        """Commits every group still open in the manager (a step abandoned
        between a group_start and its commit, by an exception or an
        interrupt, even one between the C call and the Python bookkeeping),
        then ends the handles of the groups Python lists open (those and any
        whose commit was cut after its C call); how many were open, in the
        manager or in that list."""
        n = ctypes.c_size_t()
        self._check(L.ofl_manager_commit_open_groups(self.m, _byref(n)),
                    "ofl_manager_commit_open_groups")
        listed = len(self.open)
        for g in self.open:
            self._drop_bases(g)
        self.open = []
        return max(n.value, listed)

    def is_warmup(self):
        return bool(L.ofl_manager_is_warmup(self.m))

    def synchronize(self):
        self._check(L.ofl_manager_synchronize(self.m, _lib.TIMEOUT_DEFAULT), "ofl_manager_synchronize")
        self.release_pending(wait=True)

    def render_summary(self):
        """The summary table at the end of warmup. Under torch.distributed
        (any backend: gloo on the CPU, NCCL on GPUs) every rank's row is
        gathered to rank 0 of the default group (gather_object, collective:
        every rank ends its warmup in the same iteration) and rank 0 gets the
        table of all ranks; the other ranks get a table of their own row
        (labelled Rank 0, as every one-rank table). Without it, this
        process's row as rank 0. The gather is bounded by the process
        group's timeout (init_process_group(timeout=...)): a rank that
        failed its reset and never reaches it makes the others fail there."""
        s = L.ofl_manager_summary(self.m)
        local = {}
        for g in range(L.ofl_summary_ngroups(s) if s else 0):
            local[L.ofl_summary_group_name(s, g).decode()] = int(L.ofl_summary_bytes(s, 0, g))
        self.summary_rows = [local]
        dist = _dist()
        if dist is None:
            return _render(s) if s else None
        # Every rank takes part, with or without a table of its own (a rank
        # that offloaded nothing sends an empty row): a rank that skipped
        # the gather would leave the others waiting for the process group's
        # timeout.
        rank, world = dist.get_rank(), dist.get_world_size()
        rows = [None] * world if rank == 0 else None
        dist.gather_object(local, rows, dst=0)
        if rank != 0:
            return _render(s) if s else None
        self.summary_rows = rows
        return _render_rows(rows)

    # -- statistics
    def stats(self):
        s = _lib.ManagerStats()
        L.ofl_manager_get_stats(self.m, _byref(s))
        out = {n: getattr(s, n) for n, _ in _lib.ManagerStats._fields_ if n != "_reserved"}
        if self.auto:
            out["plan"] = self.plan()
            if out["plan"] is not None and self.device_target:
                out["plan"].update(self._device_plan(out["plan"]))
        return out

    def _device_plan(self, plan):
        """The device target's figures for stats()["plan"]: the target, the
        warmup's device peak, the activation pool's peak and what is not
        activations (their difference, as the C plan computed it)."""
        f = dict(self.device_figures or {})
        f["device_target_bytes"] = self.device_target
        f["non_activation_bytes"] = max(0, f.get("device_peak_bytes", 0)
                                        - f.get("activation_pool_peak_bytes", 0))
        return f

    def plan(self):
        """ofl_manager_plan_get as a dict (_lib.plan_dict), or None before
        the end of the warmup and without groups "auto"."""
        p = _lib.ManagerPlan()
        if L.ofl_manager_plan_get(self.m, _byref(p)) != 0:
            return None
        return _lib.plan_dict(p)

    def group_count(self):
        """Group names the manager has seen."""
        return L.ofl_manager_group_count(self.m)

    def group_stats(self):
        out = {}
        gs = _lib.ManagerGroupStats()
        for i in range(L.ofl_manager_group_count(self.m)):
            check(L.ofl_manager_group_stats(self.m, i, _byref(gs)), "ofl_manager_group_stats")
            out[gs.name.decode()] = {n: getattr(gs, n) for n, _ in _lib.ManagerGroupStats._fields_
                                     if n not in ("name", "_reserved")}
        return out

    def summary_bytes(self, name):
        v = ctypes.c_uint64()
        check(L.ofl_manager_summary_bytes(self.m, name.encode(), _byref(v)), "ofl_manager_summary_bytes")
        return v.value

    def summary_total_bytes(self):
        return L.ofl_manager_summary_total_bytes(self.m)

    def pool_stats(self):
        self.reap_blocks()
        res = {}
        for key, fn in (("device_pool", L.ofl_manager_device_pool), ("host_pool", L.ofl_manager_host_pool)):
            s = _lib.PoolStats()
            L.ofl_pool_get_stats(fn(self.m), _byref(s))
            res[key] = {n: getattr(s, n) for n, _ in _lib.PoolStats._fields_ if n != "_reserved"}
        return res


if _ext is not None:
    class ManagerCore(_ext.Hooks, _CoreMethods):
        """One ofl manager with ofl.torch's saved-tensor hooks (ofl._ext)."""

        Saved = _ext.Saved
else:
    class ManagerCore:
        """Stands for the manager where ofl._ext is missing: refuses to start
        and says what to install."""

        Saved = None

        def __init__(self, *args, **kwargs):
            raise ImportError(
                "ofl.torch: offloading activations needs the package's C extension ofl._ext, "
                "and %s. Install the Python headers (Debian: apt-get install python3-dev) and "
                "reinstall the package (pip install ./python), or build the repository with "
                "meson and put <build>/python on PYTHONPATH. ofl.torch's safetensors, stager and "
                "disk checkpoint work without it." % hooks_backend_reason)


def _render(summary):
    out = ctypes.c_void_p()
    n = ctypes.c_size_t()
    check(L.ofl_summary_render(summary, _lib.SUMMARY_TEXT, _byref(out), _byref(n)),
          "ofl_summary_render")
    try:
        return ctypes.string_at(out.value, n.value).decode()
    finally:
        _lib.free(out.value)


def _render_rows(rows):
    """The summary of one {group: bytes} dict per rank (row r: rows[r])."""
    tables = (ctypes.c_void_p * len(rows))()
    summary = ctypes.c_void_p()
    try:
        for r, row in enumerate(rows):
            t = ctypes.c_void_p()
            check(L.ofl_byte_table_create(_byref(t)), "ofl_byte_table_create")
            tables[r] = t.value
            for name, nbytes in sorted((row or {}).items()):
                check(L.ofl_byte_table_add(t, name.encode(), nbytes), "ofl_byte_table_add")
        check(L.ofl_summary_from_tables(tables, len(rows), _byref(summary)),
              "ofl_summary_from_tables")
        return _render(summary)
    finally:
        if summary.value:
            L.ofl_summary_destroy(summary)
        for t in tables:
            if t:
                L.ofl_byte_table_destroy(t)


def _dist():
    """torch.distributed when a default group of more than one rank is
    initialized, else None."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist
    except Exception:
        pass
    return None


def _rank():
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


__all__ = ["Runtime", "ManagerCore", "OflError", "ofl_dtype", "torch_dtype", "wrap_storage",
           "hooks_backend"]
