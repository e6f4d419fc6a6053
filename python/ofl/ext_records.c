/* ofl._ext: the records of saved tensors (Saved, Kept, Mark) and what
 * describes a tensor handed to the manager. */
#include "ext_internal.h"

/* The record leaves its manager's count of records not popped. */
void ext__saved_forget_core(SavedObject *s) {
  if (s->core != NULL) {
    ((HooksObject *)s->core)->unpopped--;
    Py_CLEAR(s->core);
  }
}

/* ---- Saved: what autograd stores for a tensor handed to the manager ------ */

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
  ext__saved_forget_core(s);
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
  if (((SavedObject *)op)->weakreflist != NULL)
    PyObject_ClearWeakRefs(op);
  saved_clear(op);
  Py_TYPE(op)->tp_free(op);
}

static PyObject *saved_get_core(PyObject *op, void *closure) {
  (void)closure;
  SavedObject *s = (SavedObject *)op;
  return ext__keep(s->core != NULL ? s->core : Py_None);
}

static PyGetSetDef saved_getset[] = {
    {"core", saved_get_core, NULL,
     "the manager's hooks while pushed and not popped, else None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef saved_members[] = {
    {"tag", T_ULONGLONG, offsetof(SavedObject, tag), READONLY,
     "the manager's tag"},
    {"h", T_ULONGLONG, offsetof(SavedObject, h), READONLY,
     "the ofl tensor pushed"},
    {"ptr", T_ULONGLONG, offsetof(SavedObject, ptr), READONLY,
     "address of the bytes"},
    {"nbytes", T_LONGLONG, offsetof(SavedObject, nbytes), READONLY,
     "bytes pushed"},
    {"offset", T_LONGLONG, offsetof(SavedObject, offset), READONLY,
     "storage offset"},
    {"version", T_LONGLONG, offsetof(SavedObject, version), READONLY,
     "_version at the save"},
    {"whole", T_BOOL, offsetof(SavedObject, whole), READONLY,
     "whole storage pushed"},
    {"tensor", T_OBJECT, offsetof(SavedObject, tensor), 0,
     "the torch tensor or None"},
    {"dtype", T_OBJECT, offsetof(SavedObject, dtype), READONLY, "torch dtype"},
    {"size", T_OBJECT, offsetof(SavedObject, size), READONLY, "torch size"},
    {"stride", T_OBJECT, offsetof(SavedObject, stride), READONLY,
     "stride (whole)"},
    {"group", T_OBJECT, offsetof(SavedObject, group), 0, "the group record"},
    {"vref", T_OBJECT, offsetof(SavedObject, vref), READONLY,
     "weakref of the root tensor"},
    {"cached", T_OBJECT, offsetof(SavedObject, cached), READONLY,
     "the tensor of the first unpack, or None"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject ext__SavedType = {
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
    {"version", T_LONGLONG, offsetof(KeptObject, version), READONLY,
     "_version at the save"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject ext__KeptType = {
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
int ext__tensor_version(PyObject *t, long long *out) {
  PyObject *v = PyObject_GetAttr(t, ext__s_version);
  if (v == NULL)
    return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

PyObject *ext__make_kept(PyObject *t) {
  long long v;
  if (ext__tensor_version(t, &v) < 0)
    return NULL;
  KeptObject *k = PyObject_GC_New(KeptObject, &ext__KeptType);
  if (k == NULL)
    return NULL;
  k->t = ext__keep(t);
  k->version = v;
  PyObject_GC_Track((PyObject *)k);
  return (PyObject *)k;
}

/* ---- records: a saved tensor described ----------------------------------- */

/* Fills the record's description of t (before the push: nothing can fail
 * between the push and the record's append). */
static int describe(SavedObject *rec, PyObject *t, int whole) {
  rec->dtype = PyObject_GetAttr(t, ext__s_dtype);
  if (rec->dtype == NULL)
    return -1;
  rec->size = ext__call0(t, ext__s_size);
  if (rec->size == NULL)
    return -1;
  rec->whole = (char)whole;
  if (whole) {
    rec->stride = ext__call0(t, ext__s_stride);
    if (rec->stride == NULL)
      return -1;
    if (ext__call_ll(t, ext__s_storage_offset, &rec->offset) < 0)
      return -1;
  }
  return 0;
}

/* A new record of t (GC-tracked): its version at the save, a weak
 * reference to root and t's description (describe); NULL with an exception
 * on failure. Tag, handle, address and group are the caller's to fill. */
SavedObject *ext__new_record(PyObject *t, PyObject *root, int whole) {
  long long version;
  if (ext__tensor_version(t, &version) < 0)
    return NULL;
  SavedObject *rec = PyObject_GC_New(SavedObject, &ext__SavedType);
  if (rec == NULL)
    return NULL;
  rec->tag = rec->h = rec->ptr = 0;
  rec->nbytes = rec->offset = 0;
  rec->version = version;
  /* every object field set before the record is tracked: the weak
   * reference made next can start a collection, which visits it */
  rec->tensor = rec->dtype = rec->size = rec->stride = rec->group = NULL;
  rec->vref = rec->cached = rec->core = rec->weakreflist = NULL;
  rec->whole = 0;
  PyObject_GC_Track((PyObject *)rec);
  rec->vref = PyWeakref_NewRef(root, NULL);
  if (rec->vref == NULL || describe(rec, t, whole) < 0) {
    Py_DECREF(rec);
    return NULL;
  }
  return rec;
}

/* ---- Mark: the group of one saved tensor (offload_activations) ----------- */

static PyMemberDef mark_members[] = {
    {"index", T_INT, offsetof(MarkObject, index), 0,
     "-1 not begun, 0 begun, -2 ended"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject ext__MarkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ofl._ext.Mark",
    .tp_basicsize = sizeof(MarkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The one-tensor group of a saved tensor (its backward state).",
    .tp_members = mark_members,
};
