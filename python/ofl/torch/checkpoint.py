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
  copies every tensor of a (nested) state dict into host memory with
  ofl_stager_stage (one copy per distinct storage; tensors sharing a storage
  share it in the staged copy too) and returns the same structure with the
  tensors replaced by CPU tensors over the staged memory (no second copy;
  the staged set lives until the last of them is freed). With
  cache_staged_state_dict the host copy is kept and reused by the next
  stage (overwritten, as torch's BlockingAsyncStager does); type_check then
  makes a different layout an error. Staging is blocking (stage returns
  when the copies are done), so should_synchronize_after_execute is False.
  Non-tensor values pass through unchanged.
"""
import ctypes

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


def _walk(obj, path, leaves):
    if isinstance(obj, torch.Tensor):
        leaves.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, path + (str(k),), leaves)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, path + (str(i),), leaves)


def _rebuild(obj, path, staged):
    if isinstance(obj, torch.Tensor):
        return staged[path]
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, path + (str(k),), staged)) for k, v in obj.items()) \
            if type(obj) is not dict else {k: _rebuild(v, path + (str(k),), staged)
                                           for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, path + (str(i),), staged) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        vals = [_rebuild(v, path + (str(i),), staged) for i, v in enumerate(obj)]
        return type(obj)(*vals) if hasattr(obj, "_fields") else tuple(vals)
    return obj


class AsyncStager(_TorchAsyncStager):
    """torch.distributed.checkpoint.staging.AsyncStager over ofl's stager."""

    _synchronize_after_execute = False

    def __init__(self, cache_staged_state_dict=False, type_check=False):
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check
        self._rt = Runtime.get()
        p = _lib.StagerParams(1 if cache_staged_state_dict else 0, 1, 1 if type_check else 0, 0,
                              None, 0, 0)
        s = ctypes.c_void_p()
        check(L.ofl_stager_create(self._rt.dev, _byref(p), _byref(s)), "ofl_stager_create")
        self._s = s.value

    @property
    def should_synchronize_after_execute(self):
        return bool(L.ofl_stager_should_synchronize_after_execute(self._s))

    def stage(self, state_dict):
        if self._s is None:
            raise RuntimeError("AsyncStager: stage after close")
        leaves = []
        _walk(state_dict, (), leaves)
        staged = {}
        todo = []  # (path, tensor) handed to ofl
        for path, t in leaves:
            t = t.detach()
            if (t.device.type not in ("cpu", self._rt.device_type) or t.numel() == 0
                    or t.layout is not torch.strided or type(t) is not torch.Tensor):
                staged[path] = t.to("cpu", copy=True)  # outside ofl's device
                continue
            if not t.is_contiguous():
                t = t.contiguous()
            todo.append((path, t))
        if todo:
            self._stage_ofl(todo, staged)
        return _rebuild(state_dict, (), staged)

    def _stage_ofl(self, todo, staged):
        bases = {}
        handles = []
        names = []
        shape = (ctypes.c_int64 * 1)()
        out = ctypes.c_void_p()
        try:
            for path, t in todo:
                st = t.untyped_storage()
                sptr = st.data_ptr()
                base = bases.get(sptr)
                if base is None:
                    shape[0] = st.nbytes()
                    # CPU memory is host memory for ofl (LOC_PINNED: copied host to
                    # host, pageable memory included); cuda memory is device memory
                    loc = _lib.LOC_DEVICE if t.device.type == "cuda" else _lib.LOC_PINNED
                    check(L.ofl_tensor_wrap(sptr, shape, 1, _lib.DTYPE_U8, loc, None,
                                            None, _byref(out)), "ofl_tensor_wrap")
                    base = bases[sptr] = out.value
                shape[0] = t.numel() * t.element_size()
                check(L.ofl_tensor_view(base, t.data_ptr() - sptr, shape, 1, _lib.DTYPE_U8,
                                        _byref(out)), "ofl_tensor_view")
                handles.append(out.value)
                names.append(("/".join(path) or "tensor").encode())
            n = len(handles)
            arr = (_lib.NamedTensor * n)()
            for i in range(n):
                arr[i].name = names[i]
                arr[i].tensor = handles[i]
            sset = ctypes.c_void_p()
            check(L.ofl_stager_stage(self._s, arr, n, _byref(sset)), "ofl_stager_stage")
        finally:
            for h in handles:
                L.ofl_tensor_destroy(h)
            for b in bases.values():
                L.ofl_tensor_destroy(b)
        holder = _StagedSet(sset.value)
        st = L.ofl_staged_status(sset.value)
        if st != 0:
            raise error(st, "ofl_staged_status")
        for i, (path, t) in enumerate(todo):
            h = L.ofl_staged_tensor(sset.value, i)
            nb = L.ofl_tensor_bytes(h)
            buf = (ctypes.c_ubyte * nb).from_address(L.ofl_tensor_data(h))
            buf._ofl = holder
            staged[path] = torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape)

    def synchronize_staging(self):
        if self._s is not None:
            check(L.ofl_stager_synchronize(self._s, _lib.TIMEOUT_DEFAULT), "ofl_stager_synchronize")

    def close(self):
        if self._s is not None:
            s, self._s = self._s, None
            check(L.ofl_stager_destroy(s), "ofl_stager_destroy")

    def stats(self):
        s = _lib.StagerStats()
        L.ofl_stager_get_stats(self._s, _byref(s))
        return {n: getattr(s, n) for n, _ in _lib.StagerStats._fields_ if n != "_reserved"}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
