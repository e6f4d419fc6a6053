/* ofl._ext: unpack (Block, the DLPack wrap of a reloaded block, pop_record,
 * the version check) and unpack_ordered. */
#include "ext_internal.h"

/* ---- Block: ofl storage that a torch tensor uses (host backend) ---------- */

/* close() left the manager to the last Block: core._destroy_now(), with
 * the caller's exception (if any) kept. */
static void destroy_now_quiet(HooksObject *core) {
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  PyObject *r = ext__call0((PyObject *)core, ext__s_destroy_now);
  if (r == NULL)
    PyErr_WriteUnraisable((PyObject *)core);
  else
    Py_DECREF(r);
  PyErr_Restore(et, ev, tb);
}

static void block_dealloc(PyObject *op) {
  BlockObject *b = (BlockObject *)op;
  HooksObject *core = b->core;
  if (b->h != NULL)
    ofl_tensor_destroy(b->h);
  if (core != NULL) {
    core->live_blocks--;
    if (core->closing && core->live_blocks == 0) {
      /* Freed by Python that ran inside a hook call on this manager (the
       * allocator's torch.empty, a GC there): destroying the manager and
       * its pool under that call would free what it is using; the call
       * destroys it at its end (call_leave). */
      if (core->in_call > 0)
        core->destroy_pending = 1;
      else
        destroy_now_quiet(core);
    }
    Py_DECREF(core);
  }
  Py_TYPE(op)->tp_free(op);
}

/* Brackets a hook call that reaches libofl on self's manager. Python may
 * run inside those calls (the allocator, a GC it starts, a weakref
 * callback), and a Block freed there must not destroy the manager under
 * the call: the destroy waits for the outermost call to end. */
void ext__call_enter(HooksObject *self) { self->in_call++; }

PyObject *ext__call_leave(HooksObject *self, PyObject *res) {
  if (--self->in_call == 0 && self->destroy_pending) {
    self->destroy_pending = 0;
    if (self->closing && self->live_blocks == 0)
      destroy_now_quiet(self);
  }
  return res;
}

static int block_getbuffer(PyObject *op, Py_buffer *view, int flags) {
  BlockObject *b = (BlockObject *)op;
  return PyBuffer_FillInfo(view, op, b->data, b->nbytes, 0, flags);
}

static PyBufferProcs block_as_buffer = {.bf_getbuffer = block_getbuffer};

PyTypeObject ext__BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ofl._ext.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ofl device-pool storage under a reloaded torch tensor.",
    .tp_dealloc = block_dealloc,
    .tp_as_buffer = &block_as_buffer,
};

/* ---- unpack -------------------------------------------------------------- */

/* x.view(*size): ints as positional arguments (a torch.Size argument is
 * parsed much more slowly); a 0-d size is passed as the empty tuple. */
static PyObject *view_as(PyObject *x, PyObject *size) {
  if (!PyTuple_Check(size) || PyTuple_GET_SIZE(size) == 0 ||
      PyTuple_GET_SIZE(size) > 16) {
    PyObject *args[2] = {x, size};
    return PyObject_VectorcallMethod(ext__s_view, args, 2, NULL);
  }
  Py_ssize_t n = PyTuple_GET_SIZE(size);
  PyObject *args[17];
  args[0] = x;
  for (Py_ssize_t i = 0; i < n; i++)
    args[i + 1] = PyTuple_GET_ITEM(size, i);
  return PyObject_VectorcallMethod(ext__s_view, args, (size_t)(n + 1), NULL);
}

/* ---- DLPack (the stable ABI of dlpack.h v0.8, the legacy "dltensor" capsule
 * every torch since 1.10 takes) ------------------------------------------- */

typedef struct {
  int32_t device_type; /* kDLCPU = 1 */
  int32_t device_id;
} ext_dl_device_t;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} ext_dl_type_t;

typedef struct {
  void *data;
  ext_dl_device_t device;
  int32_t ndim;
  ext_dl_type_t dtype;
  int64_t *shape;
  int64_t *strides; /* in elements */
  uint64_t byte_offset;
} ext_dl_tensor_t;

typedef struct ext_dl_managed {
  ext_dl_tensor_t dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct ext_dl_managed *self);
} ext_dl_managed_t;

#define DL_MAX_DIMS 16

/* A managed tensor and its shape and strides in one allocation; owner (a
 * Block) is held until torch lets go of the tensor. */
typedef struct {
  ext_dl_managed_t m;
  PyObject *owner;
  int64_t dims[2 * DL_MAX_DIMS];
} ext_dl_t;

/* torch calls it when the last view of the tensor is freed, on whichever
 * thread freed it, with or without the GIL (as torch.frombuffer's deleter,
 * the GIL is taken to drop the Block). */
static void dl_deleter(ext_dl_managed_t *self) {
  ext_dl_t *d = (ext_dl_t *)self;
#if PY_VERSION_HEX >= 0x030D0000
  int finalizing = Py_IsFinalizing();
#else
  int finalizing = _Py_IsFinalizing();
#endif
  if (!finalizing) {
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF(d->owner);
    PyGILState_Release(g);
  }
  PyMem_RawFree(d);
}

/* A capsule torch did not consume ("dltensor", not renamed "used_dltensor")
 * still owns its tensor. */
static void dl_capsule_free(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {
    ext_dl_managed_t *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m != NULL && m->deleter != NULL)
      m->deleter(m);
  }
}

/* The DLPack type torch exports dtype as, from a capsule of a 1-element
 * tensor (setup): a PyLong, or NULL without an exception when torch cannot
 * export it. */
PyObject *ext__dl_type_of(PyObject *torch, PyObject *dtype) {
  PyObject *empty = PyObject_GetAttrString(torch, "empty");
  PyObject *t = NULL, *cap = NULL, *res = NULL;
  if (empty == NULL)
    goto out;
  PyObject *one = PyLong_FromLong(1);
  if (one == NULL)
    goto out;
  PyObject *kw = Py_BuildValue("{sO}", "dtype", dtype);
  if (kw != NULL) {
    PyObject *a = PyTuple_Pack(1, one);
    if (a != NULL)
      t = PyObject_Call(empty, a, kw);
    Py_XDECREF(a);
  }
  Py_XDECREF(kw);
  Py_DECREF(one);
  if (t == NULL)
    goto out;
  cap = PyObject_CallMethod(t, "__dlpack__", NULL);
  if (cap == NULL || !PyCapsule_IsValid(cap, "dltensor"))
    goto out;
  ext_dl_managed_t *m = PyCapsule_GetPointer(cap, "dltensor");
  if (m == NULL)
    goto out;
  ext_dl_type_t ty = m->dl_tensor.dtype;
  res = PyLong_FromLong((long)ty.code | (long)ty.bits << 8 |
                        (long)ty.lanes << 16);
out:
  PyErr_Clear();
  Py_XDECREF(cap);
  Py_XDECREF(t);
  Py_XDECREF(empty);
  return res;
}

/* A torch tensor of dtype and size (contiguous) over the bytes of b, a Block,
 * made by torch._C._from_dlpack in one call (torch.frombuffer and a view
 * cost two calls and their argument parsing). Returns NULL without an
 * exception when this path does not apply (no _from_dlpack, a dtype torch
 * does not export or import, more than DL_MAX_DIMS dimensions). */
static PyObject *wrap_dlpack(BlockObject *b, PyObject *dtype, PyObject *size) {
  if (ext__torch_from_dlpack == NULL || ext__dl_types == NULL ||
      !PyTuple_Check(size))
    return NULL;
  Py_ssize_t nd = PyTuple_GET_SIZE(size);
  if (nd > DL_MAX_DIMS)
    return NULL;
  PyObject *code = PyDict_GetItemWithError(ext__dl_types, dtype);
  if (code == NULL)
    return NULL; /* absent; a lookup error is raised */
  long c = PyLong_AsLong(code);
  if (c == -1 && PyErr_Occurred())
    return NULL;
  ext_dl_t *d = PyMem_RawMalloc(sizeof *d);
  if (d == NULL)
    return NULL;
  int64_t *shape = d->dims, *strides = d->dims + DL_MAX_DIMS;
  for (Py_ssize_t i = 0; i < nd; i++) {
    shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(size, i));
    if (shape[i] < 0) {
      PyMem_RawFree(d);
      return NULL;
    }
  }
  int64_t run = 1;
  for (Py_ssize_t i = nd - 1; i >= 0; i--) {
    strides[i] = run;
    run *= shape[i] > 0 ? shape[i] : 1;
  }
  d->m.dl_tensor.data = b->data;
  d->m.dl_tensor.device.device_type = 1; /* kDLCPU: the host backend */
  d->m.dl_tensor.device.device_id = 0;
  d->m.dl_tensor.ndim = (int32_t)nd;
  d->m.dl_tensor.dtype.code = (uint8_t)(c & 0xff);
  d->m.dl_tensor.dtype.bits = (uint8_t)((c >> 8) & 0xff);
  d->m.dl_tensor.dtype.lanes = (uint16_t)(c >> 16);
  d->m.dl_tensor.shape = shape;
  d->m.dl_tensor.strides = strides;
  d->m.dl_tensor.byte_offset = 0;
  d->m.manager_ctx = NULL;
  d->m.deleter = dl_deleter;
  d->owner = ext__keep((PyObject *)b);
  PyObject *cap = PyCapsule_New(&d->m, "dltensor", dl_capsule_free);
  if (cap == NULL) {
    Py_DECREF(d->owner);
    PyMem_RawFree(d);
    return NULL;
  }
  PyObject *x = PyObject_CallOneArg(ext__torch_from_dlpack, cap);
  Py_DECREF(cap); /* consumed: torch owns d; else the destructor frees it */
  if (x == NULL) {
    /* A type torch exports but does not import: frombuffer from now on for
     * this dtype (its error, if any, is raised there). */
    PyErr_Clear();
    if (PyDict_DelItem(ext__dl_types, dtype) < 0)
      PyErr_Clear();
  }
  return x;
}

/* A torch tensor over the bytes of popped handle h (host backend), over a
 * Block that owns h: of dtype and size (contiguous) when size is given, else
 * 1-D of dtype. Steals h (destroyed on failure). */
static PyObject *wrap_block(HooksObject *self, ofl_tensor_t *h,
                            Py_ssize_t nbytes, PyObject *dtype,
                            PyObject *size) {
  BlockObject *b = PyObject_New(BlockObject, &ext__BlockType);
  if (b == NULL) {
    ofl_tensor_destroy(h);
    return NULL;
  }
  b->core = (HooksObject *)ext__keep((PyObject *)self);
  b->h = h;
  b->data = ofl_tensor_data(h);
  b->nbytes = nbytes;
  self->live_blocks++;
  PyObject *x = size != NULL ? wrap_dlpack(b, dtype, size) : NULL;
  if (x == NULL && !PyErr_Occurred()) {
    PyObject *args[2] = {(PyObject *)b, dtype};
    x = PyObject_Vectorcall(ext__torch_frombuffer, args, 1, ext__kw_dtype);
    if (x != NULL && size != NULL &&
        !(PyTuple_Check(size) && PyTuple_GET_SIZE(size) == 1)) {
      PyObject *v = view_as(x, size);
      Py_DECREF(x);
      x = v;
    }
  }
  Py_DECREF(b); /* torch holds it now, or it goes (and h with it) */
  return x;
}

/* ---- pop_record, and the version check of autograd ----------------------- */

/* Raises the exception that self.<method>(args...) returns. */
static PyObject *raise_from(PyObject *self, PyObject *method,
                            PyObject *const *args, size_t nargs) {
  PyObject *full[5];
  full[0] = self;
  for (size_t i = 0; i < nargs && i < 4; i++)
    full[i + 1] = args[i];
  PyObject *exc = PyObject_VectorcallMethod(method, full, nargs + 1, NULL);
  if (exc != NULL) {
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
  }
  return NULL;
}

/* The tensor of a record: popped from the manager on first use and kept in
 * the record (later unpacks of a retained graph return it). */
static PyObject *pop_record(HooksObject *self, SavedObject *rec) {
  PyObject *op = (PyObject *)self;
  if (rec->cached != NULL)
    return ext__keep(rec->cached);
  if (rec->core == NULL) {
    PyErr_SetString(
        PyExc_RuntimeError,
        "ofl.torch: a saved tensor was used after its manager let go of it "
        "(the push failed, or its iteration was ended); run backward before "
        "reset() or close()");
    return NULL;
  }
  if (rec->core != op) {
    PyErr_SetString(
        PyExc_RuntimeError,
        "ofl.torch: a saved tensor was unpacked through another manager");
    return NULL;
  }
  if (self->is_cuda) {
    PyObject *v = ext__call0(op, ext__s_sync_compute);
    if (v == NULL)
      return NULL;
    Py_DECREF(v);
  }
  ofl_manager_t *m = ext__as_ptr(self->m);
  if (m == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "ofl: the manager was destroyed");
    return NULL;
  }
  ofl_tensor_t *h = NULL;
  ofl_status_t s;
  Py_BEGIN_ALLOW_THREADS /* may wait for the reload */
      s = ofl_manager_tensor_pop(m, (ofl_tag_t)rec->tag, &h);
  Py_END_ALLOW_THREADS if (s != OFL_SUCCESS) {
    PyObject *code = PyLong_FromLong((long)s);
    if (code == NULL)
      return NULL;
    raise_from(op, ext__s_pop_error, &code, 1);
    Py_DECREF(code);
    return NULL;
  }
  ext__saved_forget_core(rec);

  PyObject *x;
  PyObject *t = rec->tensor; /* taken from the record */
  rec->tensor = NULL;
  if (t != NULL && t != Py_None &&
      (uintptr_t)ofl_tensor_data(h) == (uintptr_t)rec->ptr) {
    ofl_tensor_destroy(h); /* kept on the device: the tensor itself */
    rec->cached = ext__keep(t);
    return t;
  }
  Py_XDECREF(t);
  if (self->is_cuda) {
    PyObject *hv = PyLong_FromVoidPtr(h);
    if (hv == NULL) {
      ofl_tensor_destroy(h);
      return NULL;
    }
    PyObject *args[3] = {op, hv, (PyObject *)rec};
    x = PyObject_VectorcallMethod(ext__s_wrap_reloaded, args, 3, NULL);
    Py_DECREF(hv);
  } else {
    PyObject *b = wrap_block(self, h, (Py_ssize_t)rec->nbytes,
                             rec->whole ? ext__torch_uint8 : rec->dtype,
                             rec->whole ? NULL : rec->size);
    if (b == NULL)
      return NULL;
    if (rec->whole) {
      PyObject *args[2] = {b, rec->dtype};
      PyObject *v = PyObject_VectorcallMethod(ext__s_view, args, 2, NULL);
      Py_DECREF(b);
      if (v == NULL)
        return NULL;
      PyObject *off = PyLong_FromLongLong(rec->offset);
      if (off == NULL) {
        Py_DECREF(v);
        return NULL;
      }
      PyObject *sargs[4] = {v, rec->size, rec->stride, off};
      x = PyObject_VectorcallMethod(ext__s_as_strided, sargs, 4, NULL);
      Py_DECREF(off);
      Py_DECREF(v);
    } else {
      x = b; /* shaped by wrap_block */
    }
  }
  if (x == NULL)
    return NULL;
  rec->cached = ext__keep(x);
  return x;
}

/* The version check of autograd: a saved tensor changed in place since the
 * save is an error (0 ok, -1 raised). */
static int check_version(HooksObject *self, PyObject *t, PyObject *size,
                         long long saved) {
  long long now;
  if (ext__tensor_version(t, &now) < 0)
    return -1;
  if (now == saved)
    return 0;
  PyObject *sz = size != NULL ? ext__keep(size) : ext__call0(t, ext__s_size);
  if (sz == NULL)
    return -1;
  PyObject *a = PyLong_FromLongLong(saved), *b = PyLong_FromLongLong(now);
  if (a != NULL && b != NULL) {
    PyObject *args[4] = {t, sz, a, b};
    raise_from((PyObject *)self, ext__s_version_error, args, 4);
  }
  Py_XDECREF(a);
  Py_XDECREF(b);
  Py_DECREF(sz);
  return -1;
}

/* check_version on the root of a Saved record, when it is still alive (a
 * tensor nobody references cannot have changed). */
static int check_saved_version(HooksObject *self, SavedObject *rec) {
  if (rec->vref == NULL)
    return 0;
  PyObject *o = PyWeakref_GetObject(rec->vref); /* borrowed */
  if (o == NULL)
    return -1;
  if (o == Py_None)
    return 0;
  Py_INCREF(o);
  int bad = check_version(self, o, rec->size, rec->version);
  Py_DECREF(o);
  return bad;
}

PyObject *ext__hooks_unpack(PyObject *op, PyObject *r) {
  HooksObject *self = (HooksObject *)op;
  ext__drain_handback();
  if (Py_TYPE(r) == &ext__KeptType) {
    KeptObject *k = (KeptObject *)r;
    if (k->t == NULL)
      Py_RETURN_NONE;
    return check_version(self, k->t, NULL, k->version) ? NULL : ext__keep(k->t);
  }
  if (Py_TYPE(r) != &ext__SavedType)
    return ext__keep(r);
  SavedObject *rec = (SavedObject *)r;
  if (rec->cached != NULL)
    return ext__keep(rec->cached);
  return check_saved_version(self, rec) ? NULL : pop_record(self, rec);
}

/* ---- unpack_ordered: the backward markers -------------------------------- */

/* A backward marker of the manager (begin != 0: group_backward_begin). */
static int marker(HooksObject *self, const char *name, int begin) {
  ofl_manager_t *m = ext__as_ptr(self->m);
  if (m == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "ofl: the manager was destroyed");
    return -1;
  }
  ofl_status_t s;
  Py_BEGIN_ALLOW_THREADS /* begin may wait for the group's reload */
      s = begin ? ofl_manager_group_backward_begin(m, name)
                : ofl_manager_group_backward_end(m, name);
  Py_END_ALLOW_THREADS if (s != OFL_SUCCESS) {
    ext__raise_ofl(s, begin ? "ofl_manager_group_backward_begin"
                            : "ofl_manager_group_backward_end");
    return -1;
  }
  return 0;
}

/* unpack_ordered(r, chunks, pos, name): the unpack hook of
 * offload_activations. Before popping r, runs the backward markers of the
 * groups the manager expects up to r's own, in its order (chunks first in,
 * first out: chunks[pos[0]]; groups of a chunk in reverse: pos[1] done);
 * groups passed over are begun and ended (their tensors reload inline when
 * autograd gets to them). Mark.index: -1 not begun, 0 begun, -2 ended. */
PyObject *ext__hooks_unpack_ordered(PyObject *op, PyObject *const *args,
                                    Py_ssize_t nargs) {
  HooksObject *self = (HooksObject *)op;
  if (nargs != 4 || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
      PyList_GET_SIZE(args[2]) != 2 || !PyBytes_Check(args[3])) {
    PyErr_SetString(
        PyExc_TypeError,
        "unpack_ordered(record, chunks: list, pos: [int, int], name: bytes)");
    return NULL;
  }
  PyObject *r = args[0], *chunks = args[1], *pos = args[2];
  const char *name = PyBytes_AS_STRING(args[3]);
  if (Py_TYPE(r) != &ext__SavedType)
    return ext__hooks_unpack(op, r);
  SavedObject *rec = (SavedObject *)r;
  if (rec->cached != NULL)
    return ext__keep(rec->cached);
  if (rec->core != NULL && rec->core != op) {
    /* Another manager's record (a session renewed its manager): the
     * record's reference to it goes at the pop, so hold one meanwhile. */
    PyObject *c = ext__keep(rec->core);
    ext__call_enter((HooksObject *)c);
    PyObject *x = ext__call_leave((HooksObject *)c, ext__hooks_unpack(c, r));
    Py_DECREF(c);
    return x;
  }
  if (rec->group == NULL || Py_TYPE(rec->group) != &ext__MarkType)
    return ext__hooks_unpack(op, r);
  ext__drain_handback();
  if (check_saved_version(self, rec))
    return NULL;
  if (self->is_cuda) {
    PyObject *v = ext__call0(op, ext__s_sync_compute);
    if (v == NULL)
      return NULL;
    Py_DECREF(v);
  }
  MarkObject *g = (MarkObject *)rec->group;
  Py_ssize_t ci = PyLong_AsSsize_t(PyList_GET_ITEM(pos, 0));
  Py_ssize_t done = PyLong_AsSsize_t(PyList_GET_ITEM(pos, 1));
  if (PyErr_Occurred())
    return NULL;
  int err = 0;
  while (g->index == -1 && ci < PyList_GET_SIZE(chunks)) {
    PyObject *groups = PyList_GET_ITEM(chunks, ci);
    if (!PyList_Check(groups)) {
      PyErr_SetString(PyExc_TypeError, "unpack_ordered: a chunk is not a list");
      err = 1;
      break;
    }
    if (done >= PyList_GET_SIZE(groups)) {
      ci++;
      done = 0;
      continue;
    }
    PyObject *nxt = PyList_GET_ITEM(groups, PyList_GET_SIZE(groups) - 1 - done);
    done++;
    if (Py_TYPE(nxt) != &ext__MarkType) {
      PyErr_SetString(PyExc_TypeError, "unpack_ordered: a group is not a Mark");
      err = 1;
      break;
    }
    if (marker(self, name, 1) < 0) {
      err = 1;
      break;
    }
    ((MarkObject *)nxt)->index = 0;
    if ((MarkObject *)nxt != g) { /* passed over: its backward ends at once */
      if (marker(self, name, 0) < 0) {
        err = 1;
        break;
      }
      ((MarkObject *)nxt)->index = -2;
    }
  }
  PyObject *a = PyLong_FromSsize_t(ci), *b = PyLong_FromSsize_t(done);
  if (a == NULL || b == NULL) {
    Py_XDECREF(a);
    Py_XDECREF(b);
    return NULL;
  }
  PyList_SetItem(pos, 0, a);
  PyList_SetItem(pos, 1, b);
  if (err)
    return NULL;
  PyObject *x = pop_record(self, rec);
  if (g->index == 0) {
    g->index = -2;
    if (marker(self, name, 0) < 0)
      Py_CLEAR(x);
  }
  return x;
}

/* ---- pop_record and keep, as Hooks' methods ------------------------------ */

PyObject *ext__hooks_pop_record(PyObject *op, PyObject *r) {
  if (Py_TYPE(r) != &ext__SavedType) {
    PyErr_SetString(PyExc_TypeError, "pop_record: not a Saved record");
    return NULL;
  }
  return pop_record((HooksObject *)op, (SavedObject *)r);
}

PyObject *ext__hooks_keep(PyObject *op, PyObject *t) {
  (void)op;
  return ext__make_kept(t);
}
