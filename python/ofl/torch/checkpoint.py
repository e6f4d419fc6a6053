"""Checkpoints through ofl: safetensors files (ofl's atomic writer and strict
reader) and a torch.distributed.checkpoint AsyncStager over ofl's stager.

* ``save_safetensors(state_dict, path, metadata=None)``: a flat dict of
  tensors (any device; copied to the CPU first when elsewhere) written with
  ofl_safetensors_write (temporary file, fsync, rename: nothing at ``path``
  on error). dtypes: float32/16, bfloat16, float8 e4m3/e5m2, int64/32/16/8,
  uint8, bool.
* ``load_safetensors(path, device="cpu")``: every tensor of the file, read
  with ofl_safetensors_open (strict header checks), as a dict name -> tensor.
* ``AsyncStager(cache_staged_state_dict=False, type_check=False)``: stage()
  returns a deep copy of the state dict with every tensor in host memory,
  copied by ofl_stager_stage. It copies as torch's StateDictStager does:
  through any container or object (dicts, lists, tuples, namedtuples,
  dataclasses, objects with __dict__ or __slots__, through __reduce_ex__ like
  copy.deepcopy, or their own __deepcopy__), with a memo, so an object
  reached twice is copied once and cycles close; non-tensor values are
  deep-copied (atomic ones and unchanged tuples kept). Each distinct tensor
  storage is staged whole, once: views come back as views of one staged
  storage, at the same offsets and strides, and a tensor's custom
  attributes (its __dict__, deep-copied) and requires_grad come along. The
  staged tensors are CPU tensors over ofl's staged set (no second copy; it
  lives until the last of them is freed). A first pass finds the storages
  and hands them to ofl, which copies on its stream while stage() builds the
  copy over them (a tensor only that second pass meets, made anew by an
  object's __reduce_ex__, is copied by torch there); stage() returns once
  the copies are complete, so should_synchronize_after_execute is False and
  synchronize_staging has nothing to wait for. Tensors ofl cannot stage
  (other devices, meta, sparse or quantized) raise ValueError naming where
  they are in the state dict; stage after close raises RuntimeError. With
  cache_staged_state_dict the host copy is kept and reused by the next stage
  of the same layout (overwritten, as torch's BlockingAsyncStager does);
  type_check then makes a different layout an error naming the tensor.
  bench/bench_stager.py compares stage() with torch's stagers.
"""
import copyreg
import ctypes
import re
import types
import weakref

import torch

from .. import _lib
from .._errors import check, error
from ._core import Runtime, ofl_dtype, torch_dtype

L = _lib.lib
_byref = ctypes.byref

try:  # the protocol of the installed torch
    from torch.distributed.checkpoint.staging import AsyncStager as _TorchAsyncStager
except Exception:  # torch built without distributed
    _TorchAsyncStager = object

__all__ = ["save_safetensors", "load_safetensors", "AsyncStager"]


def save_safetensors(state_dict, path, metadata=None):
    keep = []
    entries = (_lib.SafetensorsEntry * max(1, len(state_dict)))()
    for i, (name, t) in enumerate(state_dict.items()):
        if not isinstance(t, torch.Tensor):
            raise TypeError("save_safetensors: %r is a %s, not a tensor" % (name, type(t).__name__))
        if t.ndim > _lib.MAX_DIMS:
            raise ValueError("save_safetensors: %r has %d dimensions (at most %d)"
                             % (name, t.ndim, _lib.MAX_DIMS))
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        bname = str(name).encode()
        keep.append((t, bname))
        e = entries[i]
        e.name = bname
        e.dtype = ofl_dtype(t.dtype)
        e.ndim = t.ndim
        for d, s in enumerate(t.shape):
            e.shape[d] = s
        e.data = t.data_ptr() if t.numel() else None
        e.bytes = t.numel() * t.element_size()
    meta = metadata or {}
    kvs = (_lib.SafetensorsKV * max(1, len(meta)))()
    mkeep = []
    for i, (k, v) in enumerate(meta.items()):
        kb, vb = str(k).encode(), str(v).encode()
        mkeep.append((kb, vb))
        kvs[i].key = kb
        kvs[i].value = vb
    check(L.ofl_safetensors_write(str(path).encode(), entries, len(state_dict), kvs, len(meta)),
          "ofl_safetensors_write(%s)" % path)


def load_safetensors(path, device="cpu", with_metadata=False):
    st = ctypes.c_void_p()
    check(L.ofl_safetensors_open(str(path).encode(), _byref(st)), "ofl_safetensors_open(%s)" % path)
    try:
        out = {}
        room = (_lib.SafetensorsEntry * 2)()  # spare room behind the out-param
        e = room[0]
        for i in range(L.ofl_safetensors_count(st)):
            check(L.ofl_safetensors_get(st, i, room), "ofl_safetensors_get")
            shape = tuple(e.shape[d] for d in range(e.ndim))
            t = torch.empty(shape, dtype=torch_dtype(e.dtype))
            if e.bytes:
                ctypes.memmove(t.data_ptr(), e.data, e.bytes)
            out[e.name.decode()] = t.to(device) if torch.device(device).type != "cpu" else t
        if not with_metadata:
            return out
        meta = {}
        kv = _lib.SafetensorsKV()
        for i in range(L.ofl_safetensors_metadata_count(st)):
            check(L.ofl_safetensors_metadata(st, i, _byref(kv)), "ofl_safetensors_metadata")
            meta[kv.key.decode()] = kv.value.decode()
        return out, meta
    finally:
        L.ofl_safetensors_close(st)


class _StagedSet:
    """The staged set, released when the last torch tensor over it dies."""

    __slots__ = ("s",)

    def __init__(self, s):
        self.s = s

    def __del__(self):
        try:
            L.ofl_staged_release(self.s)
        except Exception:
            pass


# ---- stage(): a deep copy whose tensors ofl fills ----------------------------------

_NIL = object()
_Tensor = torch.Tensor
_strided = torch.strided
# Returned as they are (copy.deepcopy's and StateDictStager's atomic types).
_ATOMIC = frozenset((type(None), int, float, bool, complex, bytes, str, types.CodeType, type,
                     range, types.BuiltinFunctionType, types.FunctionType, weakref.ref,
                     property, type(Ellipsis), type(NotImplemented)))
_PROTOS = {}  # dtype -> an empty cpu tensor (Tensor.new() is the cheapest empty tensor)
_NAMES = []  # b"0", b"1", ...: ofl's name for the i-th tensor of a stage


def _names(n):
    while len(_NAMES) < n:
        _NAMES.append(str(len(_NAMES)).encode())
    return _NAMES


def _path_of(root, target):
    """Where target sits under root, as Python would index it (for error
    messages; a slow search)."""
    seen = set()
    todo = [(root, "state_dict")]
    while todo:
        obj, path = todo.pop()
        if obj is target:
            return path
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend((v, "%s[%r]" % (path, k)) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            todo.extend((v, "%s[%d]" % (path, i)) for i, v in enumerate(obj))
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                todo.extend((v, "%s.%s" % (path, k)) for k, v in attrs.items())
            for k in getattr(type(obj), "__slots__", ()):
                if isinstance(k, str) and hasattr(obj, k):
                    todo.append((getattr(obj, k), "%s.%s" % (path, k)))
    return "a tensor of the state dict"


def _reduce(x, cls):
    """What copy.deepcopy rebuilds x from (None when x cannot say)."""
    reductor = copyreg.dispatch_table.get(cls)
    if reductor is not None:
        return reductor(x)
    reductor = getattr(x, "__reduce_ex__", None)
    if reductor is not None:
        return reductor(4)
    reductor = getattr(x, "__reduce__", None)
    return reductor() if reductor is not None else None


def _slots(cls):
    slots = getattr(cls, "__slots__", ())
    return (slots,) if isinstance(slots, str) else slots


class _DeepCopy:
    """One stage(): the state dict copied the way torch's StateDictStager
    copies it (a deepcopy memo keyed by id, so an object reached twice is
    copied once and cycles close; tuples whose items did not change are
    kept), every tensor replaced by a CPU tensor over a staged storage.

    Two passes, so that ofl copies while the Python work runs: collect()
    finds every tensor storage the copy will meet (containers, tensors'
    attributes, objects through what __reduce_ex__ gives, as copy() goes),
    ofl is handed them, then copy() builds the copy over the staged
    storages."""

    def __init__(self, device_ok):
        self.memo = {}
        self.keep = []  # the originals: their ids stay theirs while memo keys
        self.index = {}  # source storage data_ptr -> index in sources
        self.sources = []  # [data_ptr, nbytes, on cuda, first tensor, its entry]
        self.entries = []  # (tensor, source index) per distinct tensor: ofl's input
        self.storage_of = {}  # id(tensor) -> source index
        self.storages = []  # per source, a torch storage over its staged copy
        self.late = {}  # data_ptr -> copy, for storages collect() did not meet
        self.device_ok = device_ok

    def collect(self, root):
        seen = set()
        held = []  # what __reduce_ex__ made, alive while its id is in seen
        todo = [root]
        pop, push, extend = todo.pop, todo.append, todo.extend
        while todo:
            x = pop()
            cls = type(x)
            if cls in _ATOMIC or id(x) in seen:
                continue
            seen.add(id(x))
            if cls is dict:
                extend(x.values())
            elif cls is list or cls is tuple:
                extend(x)
            elif cls is _Tensor or isinstance(x, _Tensor):
                if cls is _Tensor or x.data_ptr() != 0:
                    self._register(x)
                attrs = x.__dict__
                if attrs:
                    extend(attrs.values())
                if cls is not _Tensor:
                    for k in _slots(cls):
                        if hasattr(x, k):
                            push(getattr(x, k))
            elif isinstance(x, dict):
                extend(x.keys())
                extend(x.values())
            elif isinstance(x, (list, tuple, set, frozenset)):
                extend(x)
            elif not issubclass(cls, type) and getattr(x, "__deepcopy__", None) is None:
                rv = _reduce(x, cls)
                if rv is not None and not isinstance(rv, str):
                    rv = list(rv)
                    for j in (3, 4):  # iterators: taken once, kept for the look
                        if len(rv) > j and rv[j] is not None:
                            rv[j] = list(rv[j])
                    held.append(rv)
                    push(rv)

    def _register(self, x):
        if x.layout is not _strided or x.is_quantized or x.is_meta or not self.device_ok(x):
            raise _Unstageable(x)
        st = x.untyped_storage()
        nbytes = st.nbytes()
        if nbytes == 0:
            return
        ptr = st.data_ptr()
        i = self.index.get(ptr)
        if i is None:
            i = self.index[ptr] = len(self.sources)
            self.sources.append([ptr, nbytes, x.is_cuda, x, len(self.entries)])
        elif nbytes > self.sources[i][1]:  # two storages over one memory
            self.sources[i][1] = nbytes
        self.storage_of[id(x)] = i
        self.entries.append((x, i))

    def copy(self, x):
        d = id(x)
        y = self.memo.get(d, _NIL)
        if y is not _NIL:
            return y
        cls = type(x)
        if cls in _ATOMIC:
            return x
        if cls is _Tensor or isinstance(x, _Tensor):
            y = self._tensor(x)
        else:
            f = _DISPATCH.get(cls)
            y = f(self, x) if f is not None else self._object(x, cls)
        if y is not x:
            self.memo[d] = y
            self.keep.append(x)
        return y

    def _dict(self, x):
        y = self.memo[id(x)] = {}
        c = self.copy
        for k, v in x.items():
            y[c(k)] = c(v)
        return y

    def _list(self, x):
        y = self.memo[id(x)] = []
        c = self.copy
        y.extend(c(v) for v in x)
        return y

    def _tuple(self, x):
        c = self.copy
        y = [c(v) for v in x]
        # an item that refers back to x copied x meanwhile: that copy is x's
        done = self.memo.get(id(x), _NIL)
        if done is not _NIL:
            return done
        for a, b in zip(x, y):
            if a is not b:
                return tuple(y)
        return x

    def _method(self, x):
        return type(x)(x.__func__, self.copy(x.__self__))

    def _tensor(self, x):
        plain = type(x) is _Tensor
        if not plain and x.data_ptr() == 0:
            # a wrapper subclass (no storage of its own): its attributes
            # hold the tensors, as in StateDictStager
            y = x.new_empty(x.size(), device="cpu")
        else:
            if plain:
                proto = _PROTOS.get(x.dtype)
                if proto is None:
                    proto = _PROTOS[x.dtype] = torch.empty(0, dtype=x.dtype)
                y = proto.new()  # empty, same dtype, on the cpu
            else:
                y = x.new_empty([], device="cpu")
            i = self.storage_of.get(id(x))
            y.set_(self.storages[i] if i is not None else self._late(x), x.storage_offset(),
                   x.size(), x.stride())
            if x.requires_grad:
                y.requires_grad_(True)
        self.memo[id(x)] = y
        attrs = x.__dict__
        if attrs:
            c = self.copy
            for k, v in attrs.items():
                setattr(y, k, c(v))
        if not plain:
            for k in _slots(type(x)):
                if hasattr(x, k):
                    setattr(y, k, self.copy(getattr(x, k)))
        return y

    def _late(self, x):
        """The copy of a storage collect() did not meet: empty, or one that
        an object's __reduce_ex__ made anew for this pass (copied by torch:
        ofl's stage is under way)."""
        if x.layout is not _strided or x.is_quantized or x.is_meta or not self.device_ok(x):
            raise _Unstageable(x)
        st = x.untyped_storage()
        if st.nbytes() == 0:
            return torch.UntypedStorage(0)
        y = self.late.get(st.data_ptr())
        if y is None:
            y = self.late[st.data_ptr()] = torch.UntypedStorage(st.nbytes()).copy_(st)
        return y

    def _object(self, x, cls):
        if issubclass(cls, type):
            return x
        f = getattr(x, "__deepcopy__", None)
        if f is not None:
            return f(self.memo)
        rv = _reduce(x, cls)
        if rv is None:
            raise TypeError("AsyncStager.stage: cannot copy an object of type %s"
                            % cls.__qualname__)
        if isinstance(rv, str):
            return x
        return self._rebuild(x, *rv)

    def _rebuild(self, x, func, args, state=None, listiter=None, dictiter=None):
        c = self.copy
        y = func(*(c(a) for a in args)) if args else func()
        self.memo[id(x)] = y
        if state is not None:
            state = c(state)
            if hasattr(y, "__setstate__"):
                y.__setstate__(state)
            else:
                slotstate = None
                if isinstance(state, tuple) and len(state) == 2:
                    state, slotstate = state
                if state:
                    y.__dict__.update(state)
                if slotstate:
                    for k, v in slotstate.items():
                        setattr(y, k, v)
        if listiter is not None:
            for v in listiter:
                y.append(c(v))
        if dictiter is not None:
            for k, v in dictiter:
                y[c(k)] = c(v)
        return y


# by type, as copy.deepcopy dispatches (unbound: a walk must not hold itself,
# or its staged storages would wait for the cycle collector)
_DISPATCH = {dict: _DeepCopy._dict, list: _DeepCopy._list, tuple: _DeepCopy._tuple,
             types.MethodType: _DeepCopy._method}


class _Unstageable(Exception):
    def __init__(self, t):
        super().__init__()
        self.t = t


class AsyncStager(_TorchAsyncStager):
    """torch.distributed.checkpoint.staging.AsyncStager over ofl's stager."""

    _synchronize_after_execute = False

    def __init__(self, cache_staged_state_dict=False, type_check=False):
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check
        self._rt = Runtime.get()
        # async_staging: stage() overlaps its own work with ofl's copies and
        # joins them before it returns
        p = _lib.StagerParams(1 if cache_staged_state_dict else 0, 1, 1 if type_check else 0, 1,
                              None, 0, 0)
        s = ctypes.c_void_p()
        check(L.ofl_stager_create(self._rt.dev, _byref(p), _byref(s)), "ofl_stager_create")
        self._s = s.value
        self._arr = None  # the NamedTensor array of the last stage, reused at the same size
        if self._rt.is_cuda:
            self._device_ok = lambda t: t.is_cpu or t.is_cuda
        else:
            self._device_ok = lambda t: t.is_cpu

    @property
    def should_synchronize_after_execute(self):
        return False  # stage() joins ofl's copies before it returns

    def stage(self, state_dict):
        if self._s is None:
            raise RuntimeError("AsyncStager.stage: the stager is closed (stage after close); "
                               "create a new AsyncStager")
        walk = _DeepCopy(self._device_ok)
        with torch.no_grad():
            try:
                walk.collect(state_dict)
                return self._stage_and_copy(walk, state_dict)
            except _Unstageable as e:
                t = e.t
                raise ValueError(
                    "AsyncStager.stage: %s (a %s of shape %s, dtype %s, layout %s, on %s) "
                    "cannot be staged by ofl, which copies strided, non-quantized tensors "
                    "on the cpu%s" % (_path_of(state_dict, t), type(t).__name__,
                                      list(t.shape), t.dtype, t.layout, t.device,
                                      " or cuda" if self._rt.is_cuda else "")) from None

    def _stage_and_copy(self, walk, state_dict):
        """One ofl stage of every distinct source storage walk collected,
        whole (views keep their offsets), then walk's copy over the staged
        storages while ofl copies; returns after the join. Each tensor is one
        entry, over its whole storage: ofl copies a storage once and counts
        the tensors that share it."""
        sources, entries = walk.sources, walk.entries
        if not sources:
            return walk.copy(state_dict)
        n = len(entries)
        arr = self._arr
        if arr is None or len(arr) != n:
            arr = (_lib.NamedTensor * n)()
            names = _names(n)
            for i in range(n):
                arr[i].name = names[i]
            self._arr = arr
        shape = (ctypes.c_int64 * 1)()
        out = ctypes.c_void_p()
        wrap = L.ofl_tensor_wrap
        pinned, device, u8 = _lib.LOC_PINNED, _lib.LOC_DEVICE, _lib.DTYPE_U8
        wrapped = []
        sset = ctypes.c_void_p()
        try:
            for ptr, nbytes, cuda, _, _ in sources:
                shape[0] = nbytes
                # CPU memory is host memory for ofl (LOC_PINNED: copied host to
                # host, pageable memory included); cuda memory is device memory
                check(wrap(ptr, shape, 1, u8, device if cuda else pinned, None, None,
                           _byref(out)), "AsyncStager.stage: ofl_tensor_wrap")
                wrapped.append(out.value)
            for i, (_, j) in enumerate(entries):
                arr[i].tensor = wrapped[j]
            if self._rt.is_cuda:
                self._rt.compute_stream()  # the copies follow torch's current stream
            st = L.ofl_stager_stage(self._s, arr, n, _byref(sset))
            if st != 0:
                raise self._stage_error(st, entries, state_dict)
            holder = _StagedSet(sset.value)
            try:
                walk.storages = self._staged_storages(sset.value, sources, holder)
                copied = walk.copy(state_dict)
            finally:
                # the wrapped sources must outlive the copies (ofl reports a
                # source let go of before the join)
                st = L.ofl_stager_synchronize(self._s, _lib.TIMEOUT_DEFAULT)
            if st != 0:
                raise error(st, "AsyncStager.stage: ofl_stager_synchronize")
        finally:
            for h in wrapped:
                L.ofl_tensor_destroy(h)
        return copied

    @staticmethod
    def _staged_storages(sset, sources, holder):
        """A torch storage over each source's staged copy: one buffer object
        over the staged set's memory (it holds the set), a storage per copy
        at its offset."""
        tensor, data = L.ofl_staged_tensor, L.ofl_tensor_data
        ptrs = [data(tensor(sset, src[4])) for src in sources]
        lo = min(ptrs)
        hi = max(p + src[1] for p, src in zip(ptrs, sources))
        buf = (ctypes.c_ubyte * (hi - lo)).from_address(lo)
        buf._ofl = holder
        frombuffer, u8 = torch.frombuffer, torch.uint8
        return [frombuffer(buf, dtype=u8, count=src[1], offset=p - lo).untyped_storage()
                for p, src in zip(ptrs, sources)]

    def _stage_error(self, st, entries, state_dict):
        e = error(st, "AsyncStager.stage: ofl_stager_stage")
        # ofl names the tensors by their index: say which tensors they are
        for i in sorted({int(m) for m in re.findall(r"'(\d+)'", e.message)}):
            if i < len(entries):
                e.args = (e.args[0] + "; tensor '%d' is %s"
                          % (i, _path_of(state_dict, entries[i][0])),)
        return e

    def synchronize_staging(self):
        if self._s is not None:
            check(L.ofl_stager_synchronize(self._s, _lib.TIMEOUT_DEFAULT),
                  "AsyncStager.synchronize_staging: ofl_stager_synchronize")

    def close(self):
        if self._s is not None:
            s, self._s = self._s, None
            self._arr = None
            check(L.ofl_stager_destroy(s), "AsyncStager.close: ofl_stager_destroy")

    def stats(self):
        if self._s is None:
            raise RuntimeError("AsyncStager.stats: the stager is closed")
        s = _lib.StagerStats()
        L.ofl_stager_get_stats(self._s, _byref(s))
        return {n: getattr(s, n) for n, _ in _lib.StagerStats._fields_ if n != "_reserved"}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
