/* ofl._ext: the saved-tensor hooks of ofl.torch in C.
 *
 * ofl.torch._core.ManagerCore derives from Hooks when this module is present:
 * its pack and unpack methods are the hot path of every saved tensor (decide
 * whether the tensor goes to the manager, hand it over, give it back), which
 * over ctypes costs several foreign calls and Python objects per tensor. The
 * rest of the manager (groups, commits, the release of torch memory) stays in
 * Python and shares the state below, exposed as attributes of the same names.
 * The pure-Python methods in _core.py (_PyHooks) are the same algorithm and
 * the fallback when this module is absent.
 *
 * libofl is neither included nor linked: ofl._lib loads it with ctypes and
 * setup() receives the addresses of the functions in _ext_abi.h. torch is not
 * linked either: tensors are used through their Python methods.
 *
 * One interpreter per process (module state in statics, single-phase init).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_ext_abi.h"

#define OFL_EXT_ABI_VERSION 2

_Static_assert(sizeof(void *) <= sizeof(unsigned long long),
               "pointers are kept as unsigned long long");

/* Copies at least this large run without the GIL. */
#define COPY_NOGIL_BYTES ((size_t)1 << 16)

/* ---- what setup() provides ----------------------------------------------- */

static struct {
#define API_FIELD(name, ret, params) ext_##name##_fn name;
  OFL_EXT_FUNCTIONS(API_FIELD)
#undef API_FIELD
} api;
static int api_ready;

static PyObject *error_factory; /* ofl._errors.error(status, where) */
static PyObject *torch_frombuffer, *torch_uint8, *torch_strided,
    *torch_parameter, *torch_tensor;
static PyObject *kw_dtype; /* ("dtype",) */
/* torch._C._from_dlpack (NULL: not in this torch) and, per torch dtype, the
 * DLPack type this torch exports it as (a PyLong: code | bits << 8 | lanes
 * << 16), measured at setup: the zero-copy wrap of a reloaded block in one
 * call (see wrap_dlpack). */
static PyObject *torch_from_dlpack, *dl_types;

/* Interned attribute and method names. */
static PyObject *s_is_cpu, *s_is_cuda, *s_layout, *s_base, *s_numel,
    *s_element_size, *s_not_offloadable, *s_untyped_storage, *s_data_ptr,
    *s_nbytes, *s_is_contiguous, *s_stride, *s_storage_offset, *s_size,
    *s_dtype, *s_bases, *s_records, *s_view, *s_as_strided, *s_sync_compute,
    *s_wrap_reloaded, *s_destroy_now, *s_version, *s_is_conj, *s_is_neg,
    *s_is_quantized, *s_is_buffer, *s_version_error, *s_pop_error,
    *s_group_start, *s_commit, *s_get_device;

static void drain_handback(void);

static int intern_names(void) {
  struct {
    PyObject **slot;
    const char *text;
  } names[] = {
      {&s_is_cpu, "is_cpu"},
      {&s_is_cuda, "is_cuda"},
      {&s_layout, "layout"},
      {&s_base, "_base"},
      {&s_numel, "numel"},
      {&s_element_size, "element_size"},
      {&s_not_offloadable, "_ofl_not_offloadable"},
      {&s_untyped_storage, "untyped_storage"},
      {&s_data_ptr, "data_ptr"},
      {&s_nbytes, "nbytes"},
      {&s_is_contiguous, "is_contiguous"},
      {&s_stride, "stride"},
      {&s_storage_offset, "storage_offset"},
      {&s_size, "size"},
      {&s_dtype, "dtype"},
      {&s_bases, "bases"},
      {&s_records, "records"},
      {&s_view, "view"},
      {&s_as_strided, "as_strided"},
      {&s_sync_compute, "_sync_compute"},
      {&s_wrap_reloaded, "_wrap_reloaded"},
      {&s_destroy_now, "_destroy_now"},
      {&s_version, "_version"},
      {&s_is_conj, "is_conj"},
      {&s_is_neg, "is_neg"},
      {&s_is_quantized, "is_quantized"},
      {&s_is_buffer, "_is_buffer"},
      {&s_version_error, "_version_error"},
      {&s_pop_error, "_pop_error"},
      {&s_group_start, "group_start"},
      {&s_commit, "commit"},
      {&s_get_device, "get_device"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    *names[i].slot = PyUnicode_InternFromString(names[i].text);
    if (*names[i].slot == NULL) return -1;
  }
  return 0;
}

/* ---- small helpers --------------------------------------------------------- */

static PyObject *keep(PyObject *o) {
  Py_INCREF(o);
  return o;
}

/* An ofl status as the package's exception (ofl.OflError with the status,
 * its name and ofl_last_error(), built by ofl._errors.error). */
static PyObject *raise_ofl(ext_status_t st, const char *where) {
  PyObject *exc = PyObject_CallFunction(error_factory, "is", (int)st, where);
  if (exc != NULL) {
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
  }
  return NULL;
}

/* o.name, or *found = 0 without an exception when o has no such attribute. */
static PyObject *optional_attr(PyObject *o, PyObject *name, int *found) {
  PyObject *v = NULL;
#if PY_VERSION_HEX >= 0x030D0000
  int r = PyObject_GetOptionalAttr(o, name, &v);
#else
  int r = _PyObject_LookupAttr(o, name, &v);
#endif
  *found = r > 0;
  return r < 0 ? NULL : v;
}

static PyObject *call0(PyObject *o, PyObject *name) {
  return PyObject_CallMethodNoArgs(o, name);
}

/* o.name() as a C integer; -1 with an exception on failure. */
static int call_ll(PyObject *o, PyObject *name, long long *out) {
  PyObject *v = call0(o, name);
  if (v == NULL) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int call_ptr(PyObject *o, PyObject *name, uintptr_t *out) {
  PyObject *v = call0(o, name);
  if (v == NULL) return -1;
  *out = (uintptr_t)PyLong_AsVoidPtr(v);
  Py_DECREF(v);
  return PyErr_Occurred() ? -1 : 0;
}

/* truth of o.name (attribute, or o.name() when call); -1 on error. */
static int attr_true(PyObject *o, PyObject *name, int call) {
  PyObject *v = call ? call0(o, name) : PyObject_GetAttr(o, name);
  if (v == NULL) return -1;
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  return r;
}

/* A Python int holding a pointer (None for NULL, as ctypes gives it). */
static void *as_ptr(PyObject *o) {
  if (o == NULL || o == Py_None) return NULL;
  return PyLong_AsVoidPtr(o);
}

/* ---- Saved: what autograd stores for a tensor handed to the manager -------- */

struct HooksObject;

typedef struct {
  PyObject_HEAD
  unsigned long long tag;
  unsigned long long h;   /* ofl_tensor_t * pushed */
  unsigned long long ptr; /* address of the saved bytes in torch memory */
  long long nbytes;
  long long offset;  /* storage offset (whole storages) */
  long long version; /* the tensor's _version at the save */
  PyObject *tensor;  /* the torch tensor, until its memory is let go */
  PyObject *dtype;
  PyObject *size;
  PyObject *stride; /* whole storages only */
  PyObject *group;
  PyObject *vref;   /* weak reference to the tensor's root (itself or _base) */
  PyObject *cached; /* the tensor the first unpack returned */
  PyObject *core;   /* the Hooks while pushed and not popped (strong) */
  PyObject *weakreflist;
  char whole; /* the whole storage, rebuilt with as_strided */
} SavedObject;

static void saved_forget_core(SavedObject *s);

static int saved_traverse(PyObject *op, visitproc visit, void *arg) {
  SavedObject *s = (SavedObject *)op;
  Py_VISIT(s->tensor);
  Py_VISIT(s->dtype);
  Py_VISIT(s->size);
  Py_VISIT(s->stride);
  Py_VISIT(s->group);
  Py_VISIT(s->vref);
  Py_VISIT(s->cached);
  Py_VISIT(s->core);
  return 0;
}

static int saved_clear(PyObject *op) {
  SavedObject *s = (SavedObject *)op;
  saved_forget_core(s);
  Py_CLEAR(s->tensor);
  Py_CLEAR(s->dtype);
  Py_CLEAR(s->size);
  Py_CLEAR(s->stride);
  Py_CLEAR(s->group);
  Py_CLEAR(s->vref);
  Py_CLEAR(s->cached);
  return 0;
}

static void saved_dealloc(PyObject *op) {
  PyObject_GC_UnTrack(op);
  if (((SavedObject *)op)->weakreflist != NULL) PyObject_ClearWeakRefs(op);
  saved_clear(op);
  Py_TYPE(op)->tp_free(op);
}

static PyObject *saved_get_core(PyObject *op, void *closure) {
  (void)closure;
  SavedObject *s = (SavedObject *)op;
  return keep(s->core != NULL ? s->core : Py_None);
}

static PyGetSetDef saved_getset[] = {
    {"core", saved_get_core, NULL, "the manager's hooks while pushed and not popped, else None",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef saved_members[] = {
    {"tag", T_ULONGLONG, offsetof(SavedObject, tag), READONLY, "the manager's tag"},
    {"h", T_ULONGLONG, offsetof(SavedObject, h), READONLY, "the ofl tensor pushed"},
    {"ptr", T_ULONGLONG, offsetof(SavedObject, ptr), READONLY, "address of the bytes"},
    {"nbytes", T_LONGLONG, offsetof(SavedObject, nbytes), READONLY, "bytes pushed"},
    {"offset", T_LONGLONG, offsetof(SavedObject, offset), READONLY, "storage offset"},
    {"version", T_LONGLONG, offsetof(SavedObject, version), READONLY, "_version at the save"},
    {"whole", T_BOOL, offsetof(SavedObject, whole), READONLY, "whole storage pushed"},
    {"tensor", T_OBJECT, offsetof(SavedObject, tensor), 0, "the torch tensor or None"},
    {"dtype", T_OBJECT, offsetof(SavedObject, dtype), READONLY, "torch dtype"},
    {"size", T_OBJECT, offsetof(SavedObject, size), READONLY, "torch size"},
    {"stride", T_OBJECT, offsetof(SavedObject, stride), READONLY, "stride (whole)"},
    {"group", T_OBJECT, offsetof(SavedObject, group), 0, "the group record"},
    {"vref", T_OBJECT, offsetof(SavedObject, vref), READONLY, "weakref of the root tensor"},
    {"cached", T_OBJECT, offsetof(SavedObject, cached), READONLY,
     "the tensor of the first unpack, or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SavedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ofl._ext.Saved",
    .tp_basicsize = sizeof(SavedObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A saved tensor handed to the ofl manager (made by Hooks.pack).",
    .tp_traverse = saved_traverse,
    .tp_clear = saved_clear,
    .tp_dealloc = saved_dealloc,
    .tp_members = saved_members,
    .tp_getset = saved_getset,
    .tp_weaklistoffset = offsetof(SavedObject, weakreflist),
};

/* ---- Kept: a saved tensor that stays where it is ------------------------- */

typedef struct {
  PyObject_HEAD
  PyObject *t;
  long long version;
} KeptObject;

static int kept_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(((KeptObject *)op)->t);
  return 0;
}

static int kept_clear(PyObject *op) {
  Py_CLEAR(((KeptObject *)op)->t);
  return 0;
}

static void kept_dealloc(PyObject *op) {
  PyObject_GC_UnTrack(op);
  kept_clear(op);
  Py_TYPE(op)->tp_free(op);
}

static PyMemberDef kept_members[] = {
    {"t", T_OBJECT, offsetof(KeptObject, t), READONLY, "the tensor"},
    {"version", T_LONGLONG, offsetof(KeptObject, version), READONLY, "_version at the save"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject KeptType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ofl._ext.Kept",
    .tp_basicsize = sizeof(KeptObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A saved tensor kept where it is, with its version at the save.",
    .tp_traverse = kept_traverse,
    .tp_clear = kept_clear,
    .tp_dealloc = kept_dealloc,
    .tp_members = kept_members,
};

/* t._version as a C integer; -1 with an exception on failure. */
static int tensor_version(PyObject *t, long long *out) {
  PyObject *v = PyObject_GetAttr(t, s_version);
  if (v == NULL) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *make_kept(PyObject *t) {
  long long v;
  if (tensor_version(t, &v) < 0) return NULL;
  KeptObject *k = PyObject_GC_New(KeptObject, &KeptType);
  if (k == NULL) return NULL;
  k->t = keep(t);
  k->version = v;
  PyObject_GC_Track((PyObject *)k);
  return (PyObject *)k;
}

/* ---- Hooks: the state the pack/unpack hooks read, and the hooks ------------ */

typedef struct HooksObject {
  PyObject_HEAD
  PyObject *m;        /* ofl_manager_t * as an int, None once destroyed */
  PyObject *dev_pool; /* ofl_pool_t * as an int */
  PyObject *open;     /* list of open groups, innermost last */
  long long min_elems;
  long long min_bytes;
  long long ordinal; /* cuda: the GPU ofl opened; its tensors only */
  Py_ssize_t live_blocks; /* reloaded tensors torch still uses */
  Py_ssize_t unpopped;    /* records pushed, not popped, alive */
  int in_call;            /* hook calls on this manager in progress (nested) */
  char destroy_pending;   /* the last Block went during one: destroy at its end */
  char active;            /* offload enabled and not forward-only */
  char closing;           /* close() waits for live_blocks to drop to 0 */
  char copy_in;           /* host backend: copy into the device pool */
  char is_cuda;
} HooksObject;

static int hooks_traverse(PyObject *op, visitproc visit, void *arg) {
  HooksObject *self = (HooksObject *)op;
  Py_VISIT(self->m);
  Py_VISIT(self->dev_pool);
  Py_VISIT(self->open);
  return 0;
}

static int hooks_clear(PyObject *op) {
  HooksObject *self = (HooksObject *)op;
  Py_CLEAR(self->m);
  Py_CLEAR(self->dev_pool);
  Py_CLEAR(self->open);
  return 0;
}

static void saved_forget_core(SavedObject *s) {
  if (s->core != NULL) {
    ((HooksObject *)s->core)->unpopped--;
    Py_CLEAR(s->core);
  }
}

static void hooks_dealloc(PyObject *op) {
  PyObject_GC_UnTrack(op);
  hooks_clear(op);
  Py_TYPE(op)->tp_free(op);
}

/* ---- Block: ofl storage that a torch tensor uses (host backend) ------------ */

/* Owns a tensor popped from the manager; exports its bytes as a writable
 * buffer for torch.frombuffer, which keeps this object until torch frees the
 * last view. Then the handle is destroyed (its pool block goes back) and the
 * manager's count of live blocks drops (close() waits for it). */
typedef struct {
  PyObject_HEAD
  HooksObject *core;
  ofl_tensor_t *h;
  void *data;
  Py_ssize_t nbytes;
} BlockObject;

/* close() left the manager to the last Block: core._destroy_now(), with
 * the caller's exception (if any) kept. */
static void destroy_now_quiet(HooksObject *core) {
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  PyObject *r = call0((PyObject *)core, s_destroy_now);
  if (r == NULL)
    PyErr_WriteUnraisable((PyObject *)core);
  else
    Py_DECREF(r);
  PyErr_Restore(et, ev, tb);
}

static void block_dealloc(PyObject *op) {
  BlockObject *b = (BlockObject *)op;
  HooksObject *core = b->core;
  if (b->h != NULL) api.ofl_tensor_destroy(b->h);
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
static void call_enter(HooksObject *self) { self->in_call++; }

static PyObject *call_leave(HooksObject *self, PyObject *res) {
  if (--self->in_call == 0 && self->destroy_pending) {
    self->destroy_pending = 0;
    if (self->closing && self->live_blocks == 0) destroy_now_quiet(self);
  }
  return res;
}

static int block_getbuffer(PyObject *op, Py_buffer *view, int flags) {
  BlockObject *b = (BlockObject *)op;
  return PyBuffer_FillInfo(view, op, b->data, b->nbytes, 0, flags);
}

static PyBufferProcs block_as_buffer = {.bf_getbuffer = block_getbuffer};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ofl._ext.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ofl device-pool storage under a reloaded torch tensor.",
    .tp_dealloc = block_dealloc,
    .tp_as_buffer = &block_as_buffer,
};

/* ---- pack ------------------------------------------------------------------ */

/* Whether the tensor (or the base it views) carries a flag attribute that
 * keeps it where it is (mark_not_offloadable, nn.Buffer): 1, 0, -1 error. */
static int flagged(PyObject *t) {
  PyObject *names[2] = {s_not_offloadable, s_is_buffer};
  for (int i = 0; i < 2; i++) {
    int found;
    PyObject *flag = optional_attr(t, names[i], &found);
    if (flag == NULL && PyErr_Occurred()) return -1;
    if (found) {
      int r = PyObject_IsTrue(flag);
      Py_DECREF(flag);
      if (r != 0) return r;
    }
  }
  return 0;
}

/* Whether t may go to the manager (the checks of _PyHooks.pack): 1 yes,
 * 0 keep it where it is, -1 error. *root: new reference to the tensor whose
 * version counter t shares (its _base, else t). Parameters and other
 * subclasses, views of them, buffers, lazy conjugates and negations (bits
 * that are not in the bytes) and quantized tensors stay. */
static int eligible(HooksObject *self, PyObject *t, long long *numel,
                    long long *nb, PyObject **root) {
  *root = NULL;
  if (Py_TYPE(t) != (PyTypeObject *)torch_tensor) return 0;
  int r = attr_true(t, self->is_cuda ? s_is_cuda : s_is_cpu, 0);
  if (r <= 0) return r;
  if (self->is_cuda) { /* a tensor of another GPU stays where it is */
    long long dev;
    if (call_ll(t, s_get_device, &dev) < 0) return -1;
    if (dev != self->ordinal) return 0;
  }
  PyObject *layout = PyObject_GetAttr(t, s_layout);
  if (layout == NULL) return -1;
  r = layout == torch_strided;
  Py_DECREF(layout);
  if (!r) return 0;
  long long esize;
  if (call_ll(t, s_numel, numel) < 0 || call_ll(t, s_element_size, &esize) < 0)
    return -1;
  *nb = *numel * esize;
  if (*nb == 0 || *numel < self->min_elems || *nb < self->min_bytes) return 0;
  PyObject *base = PyObject_GetAttr(t, s_base);
  if (base == NULL) return -1;
  if (base != Py_None) {
    r = Py_TYPE(base) != (PyTypeObject *)torch_tensor ? 1 : flagged(base);
    if (r != 0) {
      Py_DECREF(base);
      return r < 0 ? -1 : 0; /* a view of a parameter (weight.t()) or buffer */
    }
  }
  if ((r = flagged(t)) != 0 || (r = attr_true(t, s_is_conj, 1)) != 0 ||
      (r = attr_true(t, s_is_neg, 1)) != 0 ||
      (r = attr_true(t, s_is_quantized, 0)) != 0) {
    Py_DECREF(base);
    return r < 0 ? -1 : 0;
  }
  if (base == Py_None) {
    Py_DECREF(base);
    base = keep(t);
  }
  *root = base;
  return 1;
}

/* The storage's handle of the group: bases[sptr] = [handle, pushed], made
 * on first use (a copy into the device pool, or a wrap of torch memory).
 * Returns a new reference. */
static PyObject *group_base(HooksObject *self, PyObject *bases, uintptr_t sptr,
                            int64_t snb) {
  PyObject *key = PyLong_FromVoidPtr((void *)sptr);
  if (key == NULL) return NULL;
  PyObject *base = PyDict_GetItemWithError(bases, key);
  if (base != NULL || PyErr_Occurred()) {
    Py_XINCREF(base);
    Py_DECREF(key);
    return base;
  }
  ofl_tensor_t *h = NULL;
  int64_t shape[1] = {snb};
  ext_status_t st;
  if (self->copy_in) {
    st = api.ofl_pool_alloc(as_ptr(self->dev_pool), shape, 1, EXT_DTYPE_U8,
                            NULL, &h);
    if (st != EXT_SUCCESS) {
      Py_DECREF(key);
      return raise_ofl(st, "ofl_pool_alloc");
    }
    void *dst = api.ofl_tensor_data(h);
    if ((size_t)snb >= COPY_NOGIL_BYTES) {
      Py_BEGIN_ALLOW_THREADS
      memcpy(dst, (const void *)sptr, (size_t)snb);
      Py_END_ALLOW_THREADS
    } else {
      memcpy(dst, (const void *)sptr, (size_t)snb);
    }
  } else {
    st = api.ofl_tensor_wrap((void *)sptr, shape, 1, EXT_DTYPE_U8,
                             EXT_LOC_DEVICE, NULL, NULL, &h);
    if (st != EXT_SUCCESS) {
      Py_DECREF(key);
      return raise_ofl(st, "ofl_tensor_wrap");
    }
  }
  base = PyList_New(2);
  PyObject *hv = base != NULL ? PyLong_FromVoidPtr(h) : NULL;
  if (hv == NULL || PyDict_SetItem(bases, key, base) < 0) {
    Py_XDECREF(hv);
    Py_XDECREF(base);
    Py_DECREF(key);
    api.ofl_tensor_destroy(h);
    return NULL;
  }
  PyList_SET_ITEM(base, 0, hv);
  PyList_SET_ITEM(base, 1, keep(Py_False));
  Py_DECREF(key);
  return base;
}

/* Fills the record's description of t (before the push: nothing can fail
 * between the push and the record's append). */
static int describe(SavedObject *rec, PyObject *t, int whole) {
  rec->dtype = PyObject_GetAttr(t, s_dtype);
  if (rec->dtype == NULL) return -1;
  rec->size = call0(t, s_size);
  if (rec->size == NULL) return -1;
  rec->whole = (char)whole;
  if (whole) {
    rec->stride = call0(t, s_stride);
    if (rec->stride == NULL) return -1;
    if (call_ll(t, s_storage_offset, &rec->offset) < 0) return -1;
  }
  return 0;
}

/* A new record of t (GC-tracked): its version at the save, a weak
 * reference to root and t's description (describe); NULL with an exception
 * on failure. Tag, handle, address and group are the caller's to fill. */
static SavedObject *new_record(PyObject *t, PyObject *root, int whole) {
  long long version;
  if (tensor_version(t, &version) < 0) return NULL;
  SavedObject *rec = PyObject_GC_New(SavedObject, &SavedType);
  if (rec == NULL) return NULL;
  rec->tag = rec->h = rec->ptr = 0;
  rec->nbytes = rec->offset = 0;
  rec->version = version;
  rec->tensor = rec->dtype = rec->size = rec->stride = rec->group = NULL;
  rec->cached = rec->core = rec->weakreflist = NULL;
  rec->whole = 0;
  PyObject_GC_Track((PyObject *)rec);
  rec->vref = PyWeakref_NewRef(root, NULL);
  if (rec->vref == NULL || describe(rec, t, whole) < 0) {
    Py_DECREF(rec);
    return NULL;
  }
  return rec;
}

static PyObject *pack_eligible(HooksObject *self, PyObject *t, long long nb,
                               PyObject *root);

static PyObject *hooks_pack(PyObject *op, PyObject *t) {
  HooksObject *self = (HooksObject *)op;
  if (!self->active || self->open == NULL || !PyList_Check(self->open) ||
      PyList_GET_SIZE(self->open) == 0)
    return make_kept(t);
  long long numel = 0, nb = 0;
  PyObject *root;
  int r = eligible(self, t, &numel, &nb, &root);
  if (r <= 0) return r < 0 ? NULL : make_kept(t);
  PyObject *res = pack_eligible(self, t, nb, root);
  Py_DECREF(root);
  return res;
}

/* The address and size of t's storage: 0, or -1 with an exception. */
static int storage_of(PyObject *t, uintptr_t *sptr, long long *snb) {
  PyObject *st = call0(t, s_untyped_storage);
  if (st == NULL) return -1;
  int r = call_ptr(st, s_data_ptr, sptr) < 0 || call_ll(st, s_nbytes, snb) < 0;
  Py_DECREF(st);
  return r ? -1 : 0;
}

/* pack of a tensor that passed eligible(), into the innermost open group. */
static PyObject *pack_eligible(HooksObject *self, PyObject *t, long long nb,
                               PyObject *root) {
  uintptr_t sptr;
  long long snb;
  if (storage_of(t, &sptr, &snb) < 0) return NULL;
  int contiguous = attr_true(t, s_is_contiguous, 1);
  if (contiguous < 0) return NULL;
  long long off;
  int whole;
  if (contiguous) {
    uintptr_t p;
    if (call_ptr(t, s_data_ptr, &p) < 0) return NULL;
    off = (long long)(p - sptr);
    whole = 0;
  } else if (2 * nb >= snb) {
    off = 0;
    nb = snb;
    whole = 1;
  } else {
    return make_kept(t); /* a small strided view of a large storage */
  }
  if (self->copy_in && !whole && 2 * nb < snb) {
    sptr += (uintptr_t)off; /* copy only the region: its own storage */
    snb = nb;
    off = 0;
  }
  if (!PyList_Check(self->open) || PyList_GET_SIZE(self->open) == 0)
    return make_kept(t); /* closed meanwhile (by code run from a check above) */
  PyObject *g = keep(PyList_GET_ITEM(self->open, PyList_GET_SIZE(self->open) - 1));
  PyObject *bases = NULL, *base = NULL, *records = NULL;
  SavedObject *rec = NULL;
  PyObject *result = NULL;

  bases = PyObject_GetAttr(g, s_bases);
  if (bases == NULL) goto done;
  if (!PyDict_Check(bases)) {
    PyErr_SetString(PyExc_TypeError, "ofl: group.bases is not a dict");
    goto done;
  }
  records = PyObject_GetAttr(g, s_records);
  if (records == NULL) goto done;
  if (!PyList_Check(records)) {
    PyErr_SetString(PyExc_TypeError, "ofl: group.records is not a list");
    goto done;
  }
  rec = new_record(t, root, whole);
  if (rec == NULL) goto done;

  base = group_base(self, bases, sptr, snb);
  if (base == NULL) goto done;
  if (!PyList_Check(base) || PyList_GET_SIZE(base) != 2) {
    PyErr_SetString(PyExc_TypeError, "ofl: group.bases entry is not [handle, pushed]");
    goto done;
  }
  ofl_tensor_t *base_h = as_ptr(PyList_GET_ITEM(base, 0));
  if (base_h == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ofl: null base handle");
    goto done;
  }
  ofl_tensor_t *handle;
  ext_status_t s;
  if (off == 0 && nb == snb) {
    int pushed = PyObject_IsTrue(PyList_GET_ITEM(base, 1));
    if (pushed < 0) goto done;
    if (pushed) {
      if ((s = api.ofl_tensor_alias(base_h, &handle)) != EXT_SUCCESS) {
        raise_ofl(s, "ofl_tensor_alias");
        goto done;
      }
    } else {
      handle = base_h;
      PyObject *old = PyList_GET_ITEM(base, 1);
      PyList_SET_ITEM(base, 1, keep(Py_True));
      Py_DECREF(old);
    }
  } else {
    int64_t shape[1] = {nb};
    s = api.ofl_tensor_view(base_h, (size_t)off, shape, 1, EXT_DTYPE_U8, &handle);
    if (s != EXT_SUCCESS) {
      raise_ofl(s, "ofl_tensor_view");
      goto done;
    }
  }
  ofl_tag_t tag = 0;
  s = api.ofl_manager_tensor_push(as_ptr(self->m), handle, &tag);
  if (s != EXT_SUCCESS) {
    if (handle != base_h) {
      api.ofl_tensor_destroy(handle);
    } else {
      PyObject *old = PyList_GET_ITEM(base, 1);
      PyList_SET_ITEM(base, 1, keep(Py_False));
      Py_DECREF(old);
    }
    raise_ofl(s, "ofl_manager_tensor_push");
    goto done;
  }
  rec->tag = tag;
  rec->h = (unsigned long long)(uintptr_t)handle;
  /* held until the commit at least: while it lives its memory cannot be
   * reused by another tensor of the group (storages are keyed by address) */
  rec->tensor = keep(t);
  rec->ptr = (unsigned long long)(sptr + (uintptr_t)off);
  rec->nbytes = nb;
  rec->group = keep(g);
  rec->core = keep((PyObject *)self);
  self->unpopped++;
  if (PyList_Append(records, (PyObject *)rec) < 0) goto done;
  result = (PyObject *)rec;
  rec = NULL;
done:
  Py_XDECREF(rec);
  Py_XDECREF(base);
  Py_XDECREF(records);
  Py_XDECREF(bases);
  Py_DECREF(g);
  return result;
}

/* ---- unpack ---------------------------------------------------------------- */

/* x.view(*size): ints as positional arguments (a torch.Size argument is
 * parsed much more slowly); a 0-d size is passed as the empty tuple. */
static PyObject *view_as(PyObject *x, PyObject *size) {
  if (!PyTuple_Check(size) || PyTuple_GET_SIZE(size) == 0 ||
      PyTuple_GET_SIZE(size) > 16) {
    PyObject *args[2] = {x, size};
    return PyObject_VectorcallMethod(s_view, args, 2, NULL);
  }
  Py_ssize_t n = PyTuple_GET_SIZE(size);
  PyObject *args[17];
  args[0] = x;
  for (Py_ssize_t i = 0; i < n; i++) args[i + 1] = PyTuple_GET_ITEM(size, i);
  return PyObject_VectorcallMethod(s_view, args, (size_t)(n + 1), NULL);
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
    if (m != NULL && m->deleter != NULL) m->deleter(m);
  }
}

/* The DLPack type torch exports dtype as, from a capsule of a 1-element
 * tensor (setup): a PyLong, or NULL without an exception when torch cannot
 * export it. */
static PyObject *dl_type_of(PyObject *torch, PyObject *dtype) {
  PyObject *empty = PyObject_GetAttrString(torch, "empty");
  PyObject *t = NULL, *cap = NULL, *res = NULL;
  if (empty == NULL) goto out;
  PyObject *one = PyLong_FromLong(1);
  if (one == NULL) goto out;
  PyObject *kw = Py_BuildValue("{sO}", "dtype", dtype);
  if (kw != NULL) {
    PyObject *a = PyTuple_Pack(1, one);
    if (a != NULL) t = PyObject_Call(empty, a, kw);
    Py_XDECREF(a);
  }
  Py_XDECREF(kw);
  Py_DECREF(one);
  if (t == NULL) goto out;
  cap = PyObject_CallMethod(t, "__dlpack__", NULL);
  if (cap == NULL || !PyCapsule_IsValid(cap, "dltensor")) goto out;
  ext_dl_managed_t *m = PyCapsule_GetPointer(cap, "dltensor");
  if (m == NULL) goto out;
  ext_dl_type_t ty = m->dl_tensor.dtype;
  res = PyLong_FromLong((long)ty.code | (long)ty.bits << 8 | (long)ty.lanes << 16);
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
  if (torch_from_dlpack == NULL || dl_types == NULL || !PyTuple_Check(size))
    return NULL;
  Py_ssize_t nd = PyTuple_GET_SIZE(size);
  if (nd > DL_MAX_DIMS) return NULL;
  PyObject *code = PyDict_GetItemWithError(dl_types, dtype);
  if (code == NULL) return NULL; /* absent; a lookup error is raised */
  long c = PyLong_AsLong(code);
  if (c == -1 && PyErr_Occurred()) return NULL;
  ext_dl_t *d = PyMem_RawMalloc(sizeof *d);
  if (d == NULL) return NULL;
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
  d->owner = keep((PyObject *)b);
  PyObject *cap = PyCapsule_New(&d->m, "dltensor", dl_capsule_free);
  if (cap == NULL) {
    Py_DECREF(d->owner);
    PyMem_RawFree(d);
    return NULL;
  }
  PyObject *x = PyObject_CallOneArg(torch_from_dlpack, cap);
  Py_DECREF(cap); /* consumed: torch owns d; else the destructor frees it */
  if (x == NULL) {
    /* A type torch exports but does not import: frombuffer from now on for
     * this dtype (its error, if any, is raised there). */
    PyErr_Clear();
    if (PyDict_DelItem(dl_types, dtype) < 0) PyErr_Clear();
  }
  return x;
}

/* A torch tensor over the bytes of popped handle h (host backend), over a
 * Block that owns h: of dtype and size (contiguous) when size is given, else
 * 1-D of dtype. Steals h (destroyed on failure). */
static PyObject *wrap_block(HooksObject *self, ofl_tensor_t *h,
                            Py_ssize_t nbytes, PyObject *dtype, PyObject *size) {
  BlockObject *b = PyObject_New(BlockObject, &BlockType);
  if (b == NULL) {
    api.ofl_tensor_destroy(h);
    return NULL;
  }
  b->core = (HooksObject *)keep((PyObject *)self);
  b->h = h;
  b->data = api.ofl_tensor_data(h);
  b->nbytes = nbytes;
  self->live_blocks++;
  PyObject *x = size != NULL ? wrap_dlpack(b, dtype, size) : NULL;
  if (x == NULL && !PyErr_Occurred()) {
    PyObject *args[2] = {(PyObject *)b, dtype};
    x = PyObject_Vectorcall(torch_frombuffer, args, 1, kw_dtype);
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

/* Raises the exception that self.<method>(args...) returns. */
static PyObject *raise_from(PyObject *self, PyObject *method, PyObject *const *args,
                            size_t nargs) {
  PyObject *full[5];
  full[0] = self;
  for (size_t i = 0; i < nargs && i < 4; i++) full[i + 1] = args[i];
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
  if (rec->cached != NULL) return keep(rec->cached);
  if (rec->core == NULL) {
    PyErr_SetString(PyExc_RuntimeError,
                    "ofl.torch: a saved tensor was used after its manager let go of it "
                    "(the push failed, or its iteration was ended); run backward before "
                    "reset() or close()");
    return NULL;
  }
  if (rec->core != op) {
    PyErr_SetString(PyExc_RuntimeError,
                    "ofl.torch: a saved tensor was unpacked through another manager");
    return NULL;
  }
  if (self->is_cuda) {
    PyObject *v = call0(op, s_sync_compute);
    if (v == NULL) return NULL;
    Py_DECREF(v);
  }
  ofl_manager_t *m = as_ptr(self->m);
  if (m == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "ofl: the manager was destroyed");
    return NULL;
  }
  ofl_tensor_t *h = NULL;
  ext_status_t s;
  Py_BEGIN_ALLOW_THREADS /* may wait for the reload */
  s = api.ofl_manager_tensor_pop(m, (ofl_tag_t)rec->tag, &h);
  Py_END_ALLOW_THREADS
  if (s != EXT_SUCCESS) {
    PyObject *code = PyLong_FromLong((long)s);
    if (code == NULL) return NULL;
    raise_from(op, s_pop_error, &code, 1);
    Py_DECREF(code);
    return NULL;
  }
  saved_forget_core(rec);

  PyObject *x;
  PyObject *t = rec->tensor; /* taken from the record */
  rec->tensor = NULL;
  if (t != NULL && t != Py_None &&
      (uintptr_t)api.ofl_tensor_data(h) == (uintptr_t)rec->ptr) {
    api.ofl_tensor_destroy(h); /* kept on the device: the tensor itself */
    rec->cached = keep(t);
    return t;
  }
  Py_XDECREF(t);
  if (self->is_cuda) {
    PyObject *hv = PyLong_FromVoidPtr(h);
    if (hv == NULL) {
      api.ofl_tensor_destroy(h);
      return NULL;
    }
    PyObject *args[3] = {op, hv, (PyObject *)rec};
    x = PyObject_VectorcallMethod(s_wrap_reloaded, args, 3, NULL);
    Py_DECREF(hv);
  } else {
    PyObject *b = wrap_block(self, h, (Py_ssize_t)rec->nbytes,
                             rec->whole ? torch_uint8 : rec->dtype,
                             rec->whole ? NULL : rec->size);
    if (b == NULL) return NULL;
    if (rec->whole) {
      PyObject *args[2] = {b, rec->dtype};
      PyObject *v = PyObject_VectorcallMethod(s_view, args, 2, NULL);
      Py_DECREF(b);
      if (v == NULL) return NULL;
      PyObject *off = PyLong_FromLongLong(rec->offset);
      if (off == NULL) {
        Py_DECREF(v);
        return NULL;
      }
      PyObject *sargs[4] = {v, rec->size, rec->stride, off};
      x = PyObject_VectorcallMethod(s_as_strided, sargs, 4, NULL);
      Py_DECREF(off);
      Py_DECREF(v);
    } else {
      x = b; /* shaped by wrap_block */
    }
  }
  if (x == NULL) return NULL;
  rec->cached = keep(x);
  return x;
}

/* The version check of autograd: a saved tensor changed in place since the
 * save is an error (0 ok, -1 raised). */
static int check_version(HooksObject *self, PyObject *t, PyObject *size,
                         long long saved) {
  long long now;
  if (tensor_version(t, &now) < 0) return -1;
  if (now == saved) return 0;
  PyObject *sz = size != NULL ? keep(size) : call0(t, s_size);
  if (sz == NULL) return -1;
  PyObject *a = PyLong_FromLongLong(saved), *b = PyLong_FromLongLong(now);
  if (a != NULL && b != NULL) {
    PyObject *args[4] = {t, sz, a, b};
    raise_from((PyObject *)self, s_version_error, args, 4);
  }
  Py_XDECREF(a);
  Py_XDECREF(b);
  Py_DECREF(sz);
  return -1;
}

/* check_version on the root of a Saved record, when it is still alive (a
 * tensor nobody references cannot have changed). */
static int check_saved_version(HooksObject *self, SavedObject *rec) {
  if (rec->vref == NULL) return 0;
  PyObject *o = PyWeakref_GetObject(rec->vref); /* borrowed */
  if (o == NULL) return -1;
  if (o == Py_None) return 0;
  Py_INCREF(o);
  int bad = check_version(self, o, rec->size, rec->version);
  Py_DECREF(o);
  return bad;
}

static PyObject *hooks_unpack(PyObject *op, PyObject *r) {
  HooksObject *self = (HooksObject *)op;
  drain_handback();
  if (Py_TYPE(r) == &KeptType) {
    KeptObject *k = (KeptObject *)r;
    if (k->t == NULL) Py_RETURN_NONE;
    return check_version(self, k->t, NULL, k->version) ? NULL : keep(k->t);
  }
  if (Py_TYPE(r) != &SavedType) return keep(r);
  SavedObject *rec = (SavedObject *)r;
  if (rec->cached != NULL) return keep(rec->cached);
  return check_saved_version(self, rec) ? NULL : pop_record(self, rec);
}

/* ---- Mark: the group of one saved tensor (offload_activations) ------------- */

typedef struct {
  PyObject_HEAD
  int index; /* -1 backward not begun, 0 begun, -2 ended */
} MarkObject;

static PyMemberDef mark_members[] = {
    {"index", T_INT, offsetof(MarkObject, index), 0, "-1 not begun, 0 begun, -2 ended"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MarkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ofl._ext.Mark",
    .tp_basicsize = sizeof(MarkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The one-tensor group of a saved tensor (its backward state).",
    .tp_members = mark_members,
};

/* ---- what ofl hands back on its own threads ---------------------------------- */

/* ofl releases torch memory it read in place (a wrap's release callback,
 * after the D2H copy of an offload, or when the handle is destroyed) and
 * frees blocks of torch's allocator (ofl_allocator_t.free) possibly on one
 * of its own threads, where no Python may run: each is only linked into
 * handback_list there (lock-free), and the training thread finishes it with
 * the GIL at its next hook, reset or close (drain_handback): the reference
 * to the torch tensor is dropped, or the address goes to the allocator's
 * Python free. */
typedef struct handback {
  struct handback *next;
  PyObject *obj; /* a torch tensor whose memory ofl let go of, or NULL */
  void *ptr;     /* else: a block freed by one of ofl's pools */
} handback_t;

static _Atomic(handback_t *) handback_list;
static PyObject *py_alloc, *py_free; /* set_allocator */

static void push_handback(handback_t *h) {
  handback_t *head = atomic_load(&handback_list);
  do {
    h->next = head;
  } while (!atomic_compare_exchange_weak(&handback_list, &head, h));
}

/* The wrap's release callback (user: the handback holding the tensor). */
static void ext_release(void *data, size_t bytes, void *user) {
  (void)data;
  (void)bytes;
  push_handback(user);
}

/* With the GIL. */
static void drain_handback(void) {
  if (atomic_load_explicit(&handback_list, memory_order_relaxed) == NULL) return;
  handback_t *h = atomic_exchange(&handback_list, NULL);
  while (h != NULL) {
    handback_t *n = h->next;
    if (h->obj != NULL) {
      Py_DECREF(h->obj);
    } else if (py_free != NULL) {
      PyObject *r = PyObject_CallFunction(py_free, "K", (unsigned long long)(uintptr_t)h->ptr);
      if (r == NULL)
        PyErr_WriteUnraisable(py_free);
      else
        Py_DECREF(r);
    }
    PyMem_RawFree(h);
    h = n;
  }
}

/* ---- the pool allocator: torch's memory for ofl's device pool ------------- */

/* ofl_allocator_t's callbacks (include/ofl/pool.h) over two Python
 * callables set by set_allocator: alloc(bytes, stream) -> address (torch's
 * caching allocator on cuda, torch.empty on the host backend) and
 * free(address), reached through handback_list. alloc runs on the thread
 * that allocates (the training thread: pops and prefetches) and takes the
 * GIL. */
static ext_status_t ext_alloc(void *ctx, size_t bytes, ofl_stream_t *stream, void **ptr) {
  (void)ctx;
  ext_status_t st = EXT_ERR_NO_MEMORY;
  PyGILState_STATE g = PyGILState_Ensure();
  if (py_alloc != NULL) {
    PyObject *r = PyObject_CallFunction(py_alloc, "nK", (Py_ssize_t)bytes,
                                        (unsigned long long)(uintptr_t)stream);
    if (r != NULL) {
      void *p = PyLong_AsVoidPtr(r);
      Py_DECREF(r);
      if (p != NULL && !PyErr_Occurred()) {
        *ptr = p;
        st = EXT_SUCCESS;
      }
    }
    if (PyErr_Occurred()) PyErr_Clear(); /* an allocation that failed: ofl retries */
  }
  PyGILState_Release(g);
  return st;
}

static void ext_free(void *ctx, void *ptr, size_t bytes, ofl_stream_t *stream) {
  (void)ctx;
  (void)bytes;
  (void)stream;
  handback_t *h = PyMem_RawMalloc(sizeof *h);
  if (h == NULL) return; /* leaks the block rather than touch Python here */
  h->obj = NULL;
  h->ptr = ptr;
  push_handback(h);
}

/* set_allocator(alloc, free): the Python side of the allocator; returns
 * (address of ext_alloc, address of ext_free) for an ofl_allocator_t. */
static PyObject *ext_set_allocator(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *a, *f;
  if (!PyArg_ParseTuple(args, "OO:set_allocator", &a, &f)) return NULL;
  if (!PyCallable_Check(a) || !PyCallable_Check(f)) {
    PyErr_SetString(PyExc_TypeError, "set_allocator(alloc, free): two callables");
    return NULL;
  }
  Py_INCREF(a);
  Py_INCREF(f);
  Py_XSETREF(py_alloc, a);
  Py_XSETREF(py_free, f);
  ext_status_t (*pa)(void *, size_t, ofl_stream_t *, void **) = ext_alloc;
  void (*pf)(void *, void *, size_t, ofl_stream_t *) = ext_free;
  void *va, *vf;
  memcpy(&va, &pa, sizeof va);
  memcpy(&vf, &pf, sizeof vf);
  return Py_BuildValue("(NN)", PyLong_FromVoidPtr(va), PyLong_FromVoidPtr(vf));
}

static PyObject *ext_drain(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  drain_handback();
  Py_RETURN_NONE;
}

/* pack_offload(t, name): t in a group of its own (offload_activations):
 * its memory wrapped (the device's memory: torch's on cuda, adopted CPU
 * memory on the host backend), group start, push, commit, all in C. The
 * tensor is referenced until ofl releases the wrap (after the D2H copy);
 * a group the policy keeps on the device keeps it in the record, and pop
 * gives it back. */
static PyObject *hooks_pack_offload(PyObject *op, PyObject *const *args,
                                    Py_ssize_t nargs) {
  HooksObject *self = (HooksObject *)op;
  if ((nargs != 2 && nargs != 4) || !PyBytes_Check(args[1]) ||
      (nargs == 4 && (!PyList_Check(args[2]) || !PyList_Check(args[3])))) {
    PyErr_SetString(PyExc_TypeError,
                    "pack_offload(tensor, name: bytes[, marks: list, live: list])");
    return NULL;
  }
  drain_handback();
  PyObject *t = args[0];
  const char *name = PyBytes_AS_STRING(args[1]);
  if (!self->active) return make_kept(t);
  long long numel = 0, nb = 0;
  PyObject *root;
  int r = eligible(self, t, &numel, &nb, &root);
  if (r <= 0) return r < 0 ? NULL : make_kept(t);
  PyObject *res = NULL;
  SavedObject *rec = NULL;
  ofl_manager_t *m = as_ptr(self->m);
  if (m == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "ofl: the manager was destroyed");
    goto out;
  }
  if (self->is_cuda) { /* ofl's compute stream: torch's current one */
    PyObject *v = call0(op, s_sync_compute);
    if (v == NULL) goto out;
    Py_DECREF(v);
  }
  uintptr_t src;
  int contiguous = attr_true(t, s_is_contiguous, 1);
  if (contiguous < 0) goto out;
  int whole = 0;
  if (contiguous) {
    if (call_ptr(t, s_data_ptr, &src) < 0) goto out; /* the tensor's bytes */
  } else {
    uintptr_t sptr;
    long long snb;
    if (storage_of(t, &sptr, &snb) < 0) goto out;
    if (2 * nb < snb) {
      res = make_kept(t); /* a small strided view of a large storage */
      goto out;
    }
    whole = 1; /* the whole storage, rebuilt with as_strided */
    src = sptr;
    nb = snb;
  }
  rec = new_record(t, root, whole);
  if (rec == NULL) goto out;
  rec->ptr = (unsigned long long)src;
  rec->nbytes = nb;
  MarkObject *mk = PyObject_New(MarkObject, &MarkType);
  if (mk == NULL) goto fail;
  mk->index = -1;
  rec->group = (PyObject *)mk;
  handback_t *hold = PyMem_RawMalloc(sizeof *hold);
  if (hold == NULL) {
    PyErr_NoMemory();
    goto fail;
  }
  hold->obj = keep(t);
  hold->ptr = NULL;
  hold->next = NULL;
  ofl_tensor_t *h = NULL;
  int64_t shape[1] = {nb};
  /* ext_release only links hold into a lock-free list: it may run as a
   * host function of the D2H stream, right after the copy. */
  ext_status_t s = api.ofl_tensor_wrap_flags(
      (void *)src, shape, 1, EXT_DTYPE_U8, EXT_LOC_DEVICE, ext_release, hold,
      EXT_WRAP_RELEASE_IN_HOST_FN, &h);
  if (s != EXT_SUCCESS) {
    Py_DECREF(hold->obj);
    PyMem_RawFree(hold);
    raise_ofl(s, "ofl_tensor_wrap");
    goto fail;
  }
  s = api.ofl_manager_group_start(m, name);
  if (s != EXT_SUCCESS) {
    api.ofl_tensor_destroy(h); /* releases the wrap: hold goes to the list */
    raise_ofl(s, "ofl_manager_group_start");
    goto fail;
  }
  ofl_tag_t tag = 0;
  s = api.ofl_manager_tensor_push(m, h, &tag);
  if (s == EXT_SUCCESS) {
    rec->tag = tag;
    rec->h = (unsigned long long)(uintptr_t)h;
    rec->core = keep(op);
    self->unpopped++;
  } else {
    api.ofl_tensor_destroy(h);
  }
  ext_status_t c;
  Py_BEGIN_ALLOW_THREADS /* may wait for the oldest copies (max_inflight) */
  c = api.ofl_manager_group_commit(m, name, NULL, 0, 0);
  Py_END_ALLOW_THREADS
  if (s != EXT_SUCCESS) {
    raise_ofl(s, "ofl_manager_tensor_push");
    goto fail;
  }
  if (c != EXT_SUCCESS) {
    raise_ofl(c, "ofl_manager_group_commit");
    goto fail;
  }
  /* kept on the device by the policy: the record holds the tensor (pop
   * gives it back); offloaded: the wrap holds it until the copy is done */
  if (api.ofl_tensor_has_storage(h)) rec->tensor = keep(t);
  if (nargs == 4) { /* the group in its chunk's list, a weak reference in live */
    PyObject *w = PyWeakref_NewRef((PyObject *)rec, NULL);
    if (w == NULL) goto fail;
    r = PyList_Append(args[2], rec->group) < 0 || PyList_Append(args[3], w) < 0;
    Py_DECREF(w);
    if (r) goto fail;
  }
  res = (PyObject *)rec;
  rec = NULL;
  goto out;
fail:
  Py_CLEAR(rec);
out:
  Py_XDECREF(rec);
  Py_DECREF(root);
  return res;
}

/* A backward marker of the manager (begin != 0: group_backward_begin). */
static int marker(HooksObject *self, const char *name, int begin) {
  ofl_manager_t *m = as_ptr(self->m);
  if (m == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "ofl: the manager was destroyed");
    return -1;
  }
  ext_status_t s;
  Py_BEGIN_ALLOW_THREADS /* begin may wait for the group's reload */
  s = begin ? api.ofl_manager_group_backward_begin(m, name)
            : api.ofl_manager_group_backward_end(m, name);
  Py_END_ALLOW_THREADS
  if (s != EXT_SUCCESS) {
    raise_ofl(s, begin ? "ofl_manager_group_backward_begin"
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
static PyObject *hooks_unpack_ordered(PyObject *op, PyObject *const *args,
                                      Py_ssize_t nargs) {
  HooksObject *self = (HooksObject *)op;
  if (nargs != 4 || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
      PyList_GET_SIZE(args[2]) != 2 || !PyBytes_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "unpack_ordered(record, chunks: list, pos: [int, int], name: bytes)");
    return NULL;
  }
  PyObject *r = args[0], *chunks = args[1], *pos = args[2];
  const char *name = PyBytes_AS_STRING(args[3]);
  if (Py_TYPE(r) != &SavedType) return hooks_unpack(op, r);
  SavedObject *rec = (SavedObject *)r;
  if (rec->cached != NULL) return keep(rec->cached);
  if (rec->core != NULL && rec->core != op) {
    /* Another manager's record (a session renewed its manager): the
     * record's reference to it goes at the pop, so hold one meanwhile. */
    PyObject *c = keep(rec->core);
    call_enter((HooksObject *)c);
    PyObject *x = call_leave((HooksObject *)c, hooks_unpack(c, r));
    Py_DECREF(c);
    return x;
  }
  if (rec->group == NULL || Py_TYPE(rec->group) != &MarkType) return hooks_unpack(op, r);
  drain_handback();
  if (check_saved_version(self, rec)) return NULL;
  if (self->is_cuda) {
    PyObject *v = call0(op, s_sync_compute);
    if (v == NULL) return NULL;
    Py_DECREF(v);
  }
  MarkObject *g = (MarkObject *)rec->group;
  Py_ssize_t ci = PyLong_AsSsize_t(PyList_GET_ITEM(pos, 0));
  Py_ssize_t done = PyLong_AsSsize_t(PyList_GET_ITEM(pos, 1));
  if (PyErr_Occurred()) return NULL;
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
    if (Py_TYPE(nxt) != &MarkType) {
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
  if (err) return NULL;
  PyObject *x = pop_record(self, rec);
  if (g->index == 0) {
    g->index = -2;
    if (marker(self, name, 0) < 0) Py_CLEAR(x);
  }
  return x;
}

static PyObject *hooks_pop_record(PyObject *op, PyObject *r) {
  if (Py_TYPE(r) != &SavedType) {
    PyErr_SetString(PyExc_TypeError, "pop_record: not a Saved record");
    return NULL;
  }
  return pop_record((HooksObject *)op, (SavedObject *)r);
}

static PyObject *hooks_keep(PyObject *op, PyObject *t) {
  (void)op;
  return make_kept(t);
}

/* ---- Hooks' attributes -------------------------------------------------------- */

#define FLAG_GETSET(field)                                                     \
  static PyObject *get_##field(PyObject *op, void *closure) {                  \
    (void)closure;                                                             \
    return PyBool_FromLong(((HooksObject *)op)->field);                        \
  }                                                                            \
  static int set_##field(PyObject *op, PyObject *v, void *closure) {           \
    (void)closure;                                                             \
    if (v == NULL) {                                                           \
      PyErr_SetString(PyExc_AttributeError, "cannot delete " #field);          \
      return -1;                                                               \
    }                                                                          \
    int b = PyObject_IsTrue(v);                                                \
    if (b < 0) return -1;                                                      \
    ((HooksObject *)op)->field = (char)b;                                      \
    return 0;                                                                  \
  }
FLAG_GETSET(active)
FLAG_GETSET(closing)
FLAG_GETSET(copy_in)
FLAG_GETSET(is_cuda)
#undef FLAG_GETSET

static PyGetSetDef hooks_getset[] = {
    {"active", get_active, set_active, "offload enabled and not forward-only", NULL},
    {"closing", get_closing, set_closing, "close() waits for the live blocks", NULL},
    {"copy_in", get_copy_in, set_copy_in, "copy into the device pool (host backend)", NULL},
    {"is_cuda", get_is_cuda, set_is_cuda, "the manager's device is cuda", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef hooks_members[] = {
    {"m", T_OBJECT_EX, offsetof(HooksObject, m), 0, "ofl_manager_t * (int) or None"},
    {"dev_pool", T_OBJECT_EX, offsetof(HooksObject, dev_pool), 0, "ofl_pool_t * (int)"},
    {"open", T_OBJECT_EX, offsetof(HooksObject, open), 0, "open groups, innermost last"},
    {"min_elems", T_LONGLONG, offsetof(HooksObject, min_elems), 0, "size threshold (elements)"},
    {"min_bytes", T_LONGLONG, offsetof(HooksObject, min_bytes), 0, "size threshold (bytes)"},
    {"ordinal", T_LONGLONG, offsetof(HooksObject, ordinal), 0,
     "cuda: the GPU whose tensors the manager takes"},
    {"live_blocks", T_PYSSIZET, offsetof(HooksObject, live_blocks), 0,
     "reloaded tensors torch still uses"},
    {"unpopped", T_PYSSIZET, offsetof(HooksObject, unpopped), 0,
     "records pushed, not popped, alive"},
    {"in_call", T_INT, offsetof(HooksObject, in_call), 0,
     "hook calls on the manager in progress (a destroy waits for them)"},
    {"destroy_pending", T_BOOL, offsetof(HooksObject, destroy_pending), 0,
     "the last Block went during a call: destroy at its end"},
    {NULL, 0, 0, 0, NULL},
};

/* The methods, each one bracketed as a call in progress (call_enter). */
static PyObject *method_pack(PyObject *op, PyObject *t) {
  call_enter((HooksObject *)op);
  return call_leave((HooksObject *)op, hooks_pack(op, t));
}

static PyObject *method_unpack(PyObject *op, PyObject *r) {
  call_enter((HooksObject *)op);
  return call_leave((HooksObject *)op, hooks_unpack(op, r));
}

static PyObject *method_pop_record(PyObject *op, PyObject *r) {
  call_enter((HooksObject *)op);
  return call_leave((HooksObject *)op, hooks_pop_record(op, r));
}

static PyObject *method_pack_offload(PyObject *op, PyObject *const *args,
                                     Py_ssize_t nargs) {
  call_enter((HooksObject *)op);
  return call_leave((HooksObject *)op, hooks_pack_offload(op, args, nargs));
}

static PyObject *method_unpack_ordered(PyObject *op, PyObject *const *args,
                                       Py_ssize_t nargs) {
  call_enter((HooksObject *)op);
  return call_leave((HooksObject *)op, hooks_unpack_ordered(op, args, nargs));
}

static PyMethodDef hooks_methods[] = {
    {"pack", method_pack, METH_O,
     "The saved-tensor pack hook: t itself, or a Saved record pushed to the manager."},
    {"unpack", method_unpack, METH_O,
     "The saved-tensor unpack hook: the tensor of a record (popped from the manager)."},
    {"pack_offload", (PyCFunction)(void (*)(void))method_pack_offload, METH_FASTCALL,
     "pack_offload(t, name): t in a group of its own (start, push, commit); a Kept "
     "record when the manager would not take it."},
    {"unpack_ordered", (PyCFunction)(void (*)(void))method_unpack_ordered, METH_FASTCALL,
     "unpack_ordered(r, chunks, pos, name): the backward markers up to r's group in the "
     "manager's order, then the tensor of r (offload_activations)."},
    {"pop_record", method_pop_record, METH_O,
     "The tensor of a Saved record, popped on first use (no version check)."},
    {"keep", hooks_keep, METH_O, "A Kept record of t (stays where it is)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HooksType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ofl._ext.Hooks",
    .tp_basicsize = sizeof(HooksObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Base of ofl.torch's ManagerCore: the saved-tensor hooks in C.",
    .tp_traverse = hooks_traverse,
    .tp_clear = hooks_clear,
    .tp_dealloc = hooks_dealloc,
    .tp_new = PyType_GenericNew,
    .tp_methods = hooks_methods,
    .tp_members = hooks_members,
    .tp_getset = hooks_getset,
};

/* ---- module -------------------------------------------------------------------- */

static int set_ref(PyObject **slot, PyObject *v) {
  if (v == NULL) return -1;
  Py_XSETREF(*slot, v);
  return 0;
}

/* torch._C._from_dlpack and the DLPack type of every torch dtype this torch
 * exports (dl_types); neither when torch has no _from_dlpack. OFL_EXT_DLPACK=0
 * turns the path off (torch.frombuffer and a view). -1 on error. */
static int set_dlpack(PyObject *torch) {
  static const char *const names[] = {
      "float32", "float64", "float16", "bfloat16", "complex64", "complex128",
      "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
      "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"};
  Py_CLEAR(torch_from_dlpack);
  Py_CLEAR(dl_types);
  const char *env = getenv("OFL_EXT_DLPACK");
  if (env != NULL && strcmp(env, "0") == 0) return 0;
  PyObject *c = PyObject_GetAttrString(torch, "_C");
  PyObject *f = c != NULL ? PyObject_GetAttrString(c, "_from_dlpack") : NULL;
  Py_XDECREF(c);
  if (f == NULL) {
    PyErr_Clear();
    return 0;
  }
  PyObject *types = PyDict_New();
  if (types == NULL) {
    Py_DECREF(f);
    return -1;
  }
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    PyObject *dt = PyObject_GetAttrString(torch, names[i]);
    if (dt == NULL) {
      PyErr_Clear();
      continue;
    }
    PyObject *code = dl_type_of(torch, dt);
    int r = code != NULL ? PyDict_SetItem(types, dt, code) : 0;
    Py_XDECREF(code);
    Py_DECREF(dt);
    if (r < 0) {
      Py_DECREF(types);
      Py_DECREF(f);
      return -1;
    }
  }
  torch_from_dlpack = f;
  dl_types = types;
  return 0;
}

/* setup(addresses, error, torch): addresses maps each name of FUNCTIONS to
 * the address of libofl's function (ctypes.cast(lib.name, c_void_p).value);
 * error(status, where) builds the exception of a failed call. */
static PyObject *ext_setup(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *addresses, *error, *torch;
  if (!PyArg_ParseTuple(args, "O!OO:setup", &PyDict_Type, &addresses, &error, &torch))
    return NULL;
  if (!PyCallable_Check(error)) {
    PyErr_SetString(PyExc_TypeError, "setup: error must be callable");
    return NULL;
  }
  void *fn;
#define API_SET(name, ret, params)                                             \
  fn = NULL;                                                                   \
  {                                                                            \
    PyObject *a = PyDict_GetItemString(addresses, #name);                      \
    if (a != NULL) fn = PyLong_AsVoidPtr(a);                                   \
    if (PyErr_Occurred()) return NULL;                                         \
    if (fn == NULL) {                                                          \
      PyErr_SetString(PyExc_ValueError, "setup: no address for " #name);       \
      return NULL;                                                             \
    }                                                                          \
  }                                                                            \
  _Static_assert(sizeof(fn) == sizeof(api.name), "function pointer size");    \
  memcpy(&api.name, &fn, sizeof fn);
  OFL_EXT_FUNCTIONS(API_SET)
#undef API_SET
  PyObject *nn = NULL;
  if (set_ref(&torch_frombuffer, PyObject_GetAttrString(torch, "frombuffer")) < 0 ||
      set_ref(&torch_uint8, PyObject_GetAttrString(torch, "uint8")) < 0 ||
      set_ref(&torch_strided, PyObject_GetAttrString(torch, "strided")) < 0 ||
      set_ref(&torch_tensor, PyObject_GetAttrString(torch, "Tensor")) < 0 ||
      (nn = PyObject_GetAttrString(torch, "nn")) == NULL ||
      set_ref(&torch_parameter, PyObject_GetAttrString(nn, "Parameter")) < 0) {
    Py_XDECREF(nn);
    return NULL;
  }
  Py_DECREF(nn);
  if (set_dlpack(torch) < 0) return NULL;
  Py_INCREF(error);
  Py_XSETREF(error_factory, error);
  api_ready = 1;
  Py_RETURN_NONE;
}

static PyObject *ext_is_ready(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  return PyBool_FromLong(api_ready);
}

static PyMethodDef ext_methods[] = {
    {"setup", ext_setup, METH_VARARGS,
     "setup(addresses, error, torch): the libofl functions, the error factory "
     "and torch; before any Hooks is used."},
    {"is_ready", ext_is_ready, METH_NOARGS, "Whether setup() ran."},
    {"drain", ext_drain, METH_NOARGS,
     "Drops the references to torch tensors whose memory ofl released, and hands "
     "the blocks ofl's pools freed to the allocator's free."},
    {"set_allocator", ext_set_allocator, METH_VARARGS,
     "set_allocator(alloc, free): Python callables behind an ofl_allocator_t; "
     "returns the addresses of its alloc and free callbacks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ext_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ofl._ext",
    .m_doc = "The saved-tensor hooks of ofl.torch in C (see _ext.c).",
    .m_size = -1,
    .m_methods = ext_methods,
};

PyMODINIT_FUNC PyInit__ext(void) {
  if (intern_names() < 0) return NULL;
  kw_dtype = Py_BuildValue("(s)", "dtype");
  if (kw_dtype == NULL) return NULL;
  if (PyType_Ready(&SavedType) < 0 || PyType_Ready(&HooksType) < 0 ||
      PyType_Ready(&BlockType) < 0 || PyType_Ready(&KeptType) < 0 ||
      PyType_Ready(&MarkType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&ext_module);
  if (m == NULL) return NULL;
  static const char *const api_names[] = {
#define API_NAME(name, ret, params) #name,
      OFL_EXT_FUNCTIONS(API_NAME)
#undef API_NAME
  };
  const Py_ssize_t n_names = (Py_ssize_t)(sizeof api_names / sizeof api_names[0]);
  PyObject *names = PyTuple_New(n_names);
  if (names == NULL) goto fail;
  for (Py_ssize_t i = 0; i < n_names; i++) {
    PyObject *s = PyUnicode_FromString(api_names[i]);
    if (s == NULL) goto fail;
    PyTuple_SET_ITEM(names, i, s);
  }
  if (PyModule_AddObject(m, "FUNCTIONS", names) < 0) goto fail;
  names = NULL;
  if (PyModule_AddIntConstant(m, "ABI_VERSION", OFL_EXT_ABI_VERSION) < 0) goto fail;
  Py_INCREF(&HooksType);
  if (PyModule_AddObject(m, "Hooks", (PyObject *)&HooksType) < 0) {
    Py_DECREF(&HooksType);
    goto fail;
  }
  Py_INCREF(&SavedType);
  if (PyModule_AddObject(m, "Saved", (PyObject *)&SavedType) < 0) {
    Py_DECREF(&SavedType);
    goto fail;
  }
  Py_INCREF(&BlockType);
  if (PyModule_AddObject(m, "Block", (PyObject *)&BlockType) < 0) {
    Py_DECREF(&BlockType);
    goto fail;
  }
  Py_INCREF(&KeptType);
  if (PyModule_AddObject(m, "Kept", (PyObject *)&KeptType) < 0) {
    Py_DECREF(&KeptType);
    goto fail;
  }
  Py_INCREF(&MarkType);
  if (PyModule_AddObject(m, "Mark", (PyObject *)&MarkType) < 0) {
    Py_DECREF(&MarkType);
    goto fail;
  }
  return m;
fail:
  Py_XDECREF(names);
  Py_DECREF(m);
  return NULL;
}
