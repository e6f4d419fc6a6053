/* ofl._ext: the saved-tensor hooks of ofl.torch in C.
 *
 * ofl.torch._core.ManagerCore derives from Hooks: its pack and unpack methods
 * are the hot path of every saved tensor (decide whether the tensor goes to
 * the manager, hand it over, give it back). The rest of the manager (groups,
 * commits, the release of torch memory) stays in Python, over ctypes, and
 * shares the state below, exposed as attributes of the same names. There is
 * one implementation of the hooks: this one.
 *
 * The module includes ofl's headers and links libofl: in the package, the
 * copy pip built into ofl/_libs (found through the module's RUNPATH,
 * $ORIGIN/_libs); in the repository's build, the build's libofl. ofl._lib
 * loads libofl with ctypes before this module is imported, and the dynamic
 * loader binds the module's libofl.so.0 to the library already loaded under
 * that soname, so ctypes and this module share one libofl (library() says
 * which file; ofl.torch._core checks that it is ctypes' own). torch is not
 * linked: tensors are used through their Python methods.
 *
 * One interpreter per process (module state in statics, single-phase init).
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* dladdr */
#endif
#include "ext_internal.h"

#include <dlfcn.h>

#define OFL_EXT_ABI_VERSION 3

_Static_assert(sizeof(void *) <= sizeof(unsigned long long),
               "pointers are kept as unsigned long long");

static int api_ready;

/* ---- Hooks: the state the pack/unpack hooks read, and the hooks ---------- */

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

static void hooks_dealloc(PyObject *op) {
  PyObject_GC_UnTrack(op);
  hooks_clear(op);
  Py_TYPE(op)->tp_free(op);
}

/* ---- Hooks' attributes --------------------------------------------------- */

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
    if (b < 0)                                                                 \
      return -1;                                                               \
    ((HooksObject *)op)->field = (char)b;                                      \
    return 0;                                                                  \
  }
FLAG_GETSET(active)
FLAG_GETSET(closing)
FLAG_GETSET(copy_in)
FLAG_GETSET(is_cuda)
#undef FLAG_GETSET

static PyGetSetDef hooks_getset[] = {
    {"active", get_active, set_active, "offload enabled and not forward-only",
     NULL},
    {"closing", get_closing, set_closing, "close() waits for the live blocks",
     NULL},
    {"copy_in", get_copy_in, set_copy_in,
     "copy into the device pool (host backend)", NULL},
    {"is_cuda", get_is_cuda, set_is_cuda, "the manager's device is cuda", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef hooks_members[] = {
    {"m", T_OBJECT_EX, offsetof(HooksObject, m), 0,
     "ofl_manager_t * (int) or None"},
    {"dev_pool", T_OBJECT_EX, offsetof(HooksObject, dev_pool), 0,
     "ofl_pool_t * (int)"},
    {"open", T_OBJECT_EX, offsetof(HooksObject, open), 0,
     "open groups, innermost last"},
    {"min_elems", T_LONGLONG, offsetof(HooksObject, min_elems), 0,
     "size threshold (elements)"},
    {"min_bytes", T_LONGLONG, offsetof(HooksObject, min_bytes), 0,
     "size threshold (bytes)"},
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

/* ---- Hooks' methods and type --------------------------------------------- */

/* The methods, each one bracketed as a call in progress (call_enter). */
static PyObject *method_pack(PyObject *op, PyObject *t) {
  ext__call_enter((HooksObject *)op);
  return ext__call_leave((HooksObject *)op, ext__hooks_pack(op, t));
}

static PyObject *method_unpack(PyObject *op, PyObject *r) {
  ext__call_enter((HooksObject *)op);
  return ext__call_leave((HooksObject *)op, ext__hooks_unpack(op, r));
}

static PyObject *method_pop_record(PyObject *op, PyObject *r) {
  ext__call_enter((HooksObject *)op);
  return ext__call_leave((HooksObject *)op, ext__hooks_pop_record(op, r));
}

static PyObject *method_pack_offload(PyObject *op, PyObject *const *args,
                                     Py_ssize_t nargs) {
  ext__call_enter((HooksObject *)op);
  return ext__call_leave((HooksObject *)op,
                         ext__hooks_pack_offload(op, args, nargs));
}

static PyObject *method_unpack_ordered(PyObject *op, PyObject *const *args,
                                       Py_ssize_t nargs) {
  ext__call_enter((HooksObject *)op);
  return ext__call_leave((HooksObject *)op,
                         ext__hooks_unpack_ordered(op, args, nargs));
}

static PyMethodDef hooks_methods[] = {
    {"pack", method_pack, METH_O,
     "The saved-tensor pack hook: t itself, or a Saved record pushed to the "
     "manager."},
    {"unpack", method_unpack, METH_O,
     "The saved-tensor unpack hook: the tensor of a record (popped from the "
     "manager)."},
    {"pack_offload", (PyCFunction)(void (*)(void))method_pack_offload,
     METH_FASTCALL,
     "pack_offload(t, name): t in a group of its own (start, push, commit); a "
     "Kept "
     "record when the manager would not take it."},
    {"unpack_ordered", (PyCFunction)(void (*)(void))method_unpack_ordered,
     METH_FASTCALL,
     "unpack_ordered(r, chunks, pos, name): the backward markers up to r's "
     "group in the "
     "manager's order, then the tensor of r (offload_activations)."},
    {"pop_record", method_pop_record, METH_O,
     "The tensor of a Saved record, popped on first use (no version check)."},
    {"keep", ext__hooks_keep, METH_O,
     "A Kept record of t (stays where it is)."},
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

/* ---- module -------------------------------------------------------------- */

static int set_ref(PyObject **slot, PyObject *v) {
  if (v == NULL)
    return -1;
  Py_XSETREF(*slot, v);
  return 0;
}

/* torch._C._from_dlpack and the DLPack type of every torch dtype this torch
 * exports (dl_types); neither when torch has no _from_dlpack. OFL_EXT_DLPACK=0
 * turns the path off (torch.frombuffer and a view). -1 on error. */
static int set_dlpack(PyObject *torch) {
  static const char *const names[] = {
      "float32",     "float64",         "float16",        "bfloat16",
      "complex64",   "complex128",      "int8",           "int16",
      "int32",       "int64",           "uint8",          "uint16",
      "uint32",      "uint64",          "bool",           "float8_e4m3fn",
      "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"};
  Py_CLEAR(ext__torch_from_dlpack);
  Py_CLEAR(ext__dl_types);
  const char *env = getenv("OFL_EXT_DLPACK");
  if (env != NULL && strcmp(env, "0") == 0)
    return 0;
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
    PyObject *code = ext__dl_type_of(torch, dt);
    int r = code != NULL ? PyDict_SetItem(types, dt, code) : 0;
    Py_XDECREF(code);
    Py_DECREF(dt);
    if (r < 0) {
      Py_DECREF(types);
      Py_DECREF(f);
      return -1;
    }
  }
  ext__torch_from_dlpack = f;
  ext__dl_types = types;
  return 0;
}

/* setup(error, torch): error(status, where) builds the exception of a failed
 * call. */
static PyObject *ext_setup(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *error, *torch;
  if (!PyArg_ParseTuple(args, "OO:setup", &error, &torch))
    return NULL;
  if (!PyCallable_Check(error)) {
    PyErr_SetString(PyExc_TypeError, "setup: error must be callable");
    return NULL;
  }
  if (set_ref(&ext__torch_frombuffer,
              PyObject_GetAttrString(torch, "frombuffer")) < 0 ||
      set_ref(&ext__torch_uint8, PyObject_GetAttrString(torch, "uint8")) < 0 ||
      set_ref(&ext__torch_strided, PyObject_GetAttrString(torch, "strided")) <
          0 ||
      set_ref(&ext__torch_tensor, PyObject_GetAttrString(torch, "Tensor")) < 0)
    return NULL;
  if (set_dlpack(torch) < 0)
    return NULL;
  Py_INCREF(error);
  Py_XSETREF(ext__error_factory, error);
  api_ready = 1;
  Py_RETURN_NONE;
}

static PyObject *ext_is_ready(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  return PyBool_FromLong(api_ready);
}

/* The path of the libofl this module is bound to (the file the dynamic
 * loader opened for it), and the version of the headers it was built with. */
static PyObject *ext_library(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  Dl_info info;
  if (dladdr((void *)&ofl_manager_create, &info) == 0 ||
      info.dli_fname == NULL) {
    PyErr_SetString(PyExc_OSError,
                    "ofl._ext: dladdr cannot name the libofl it is bound to");
    return NULL;
  }
  return Py_BuildValue("(ss)", info.dli_fname, OFL_VERSION_STRING);
}

static PyMethodDef ext_methods[] = {
    {"setup", ext_setup, METH_VARARGS,
     "setup(error, torch): the error factory and torch; before any Hooks is "
     "used."},
    {"library", ext_library, METH_NOARGS,
     "(path, version) of the libofl this module is bound to."},
    {"is_ready", ext_is_ready, METH_NOARGS, "Whether setup() ran."},
    {"drain", ext__drain, METH_NOARGS,
     "Drops the references to torch tensors whose memory ofl released, and "
     "hands "
     "the blocks ofl's pools freed to the allocator's free."},
    {"set_allocator", ext__set_allocator, METH_VARARGS,
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
  if (ext__intern_names() < 0)
    return NULL;
  ext__kw_dtype = Py_BuildValue("(s)", "dtype");
  if (ext__kw_dtype == NULL)
    return NULL;
  if (PyType_Ready(&ext__SavedType) < 0 || PyType_Ready(&HooksType) < 0 ||
      PyType_Ready(&ext__BlockType) < 0 || PyType_Ready(&ext__KeptType) < 0 ||
      PyType_Ready(&ext__MarkType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&ext_module);
  if (m == NULL)
    return NULL;
  if (PyModule_AddIntConstant(m, "ABI_VERSION", OFL_EXT_ABI_VERSION) < 0)
    goto fail;
  Py_INCREF(&HooksType);
  if (PyModule_AddObject(m, "Hooks", (PyObject *)&HooksType) < 0) {
    Py_DECREF(&HooksType);
    goto fail;
  }
  Py_INCREF(&ext__SavedType);
  if (PyModule_AddObject(m, "Saved", (PyObject *)&ext__SavedType) < 0) {
    Py_DECREF(&ext__SavedType);
    goto fail;
  }
  Py_INCREF(&ext__BlockType);
  if (PyModule_AddObject(m, "Block", (PyObject *)&ext__BlockType) < 0) {
    Py_DECREF(&ext__BlockType);
    goto fail;
  }
  Py_INCREF(&ext__KeptType);
  if (PyModule_AddObject(m, "Kept", (PyObject *)&ext__KeptType) < 0) {
    Py_DECREF(&ext__KeptType);
    goto fail;
  }
  Py_INCREF(&ext__MarkType);
  if (PyModule_AddObject(m, "Mark", (PyObject *)&ext__MarkType) < 0) {
    Py_DECREF(&ext__MarkType);
    goto fail;
  }
  return m;
fail:
  Py_DECREF(m);
  return NULL;
}
