/* ofl._ext: what every file of the extension uses: the objects setup()
 * provides, the interned names, the small helpers. Calls no other file of
 * the extension. */
#include "ext_internal.h"

/* ---- what setup() provides (_ext.c sets them) --------------------------- */

PyObject *ext__error_factory; /* ofl._errors.error(status, where) */
PyObject *ext__torch_frombuffer, *ext__torch_uint8, *ext__torch_strided,
    *ext__torch_tensor;
PyObject *ext__kw_dtype; /* ("dtype",) */
/* torch._C._from_dlpack (NULL: not in this torch) and, per torch dtype, the
 * DLPack type this torch exports it as (a PyLong: code | bits << 8 | lanes
 * << 16), measured at setup: the zero-copy wrap of a reloaded block in one
 * call (see wrap_dlpack). */
PyObject *ext__torch_from_dlpack, *ext__dl_types;

/* Interned attribute and method names. */
PyObject *ext__s_is_cpu, *ext__s_is_cuda, *ext__s_layout, *ext__s_base,
    *ext__s_numel, *ext__s_element_size, *ext__s_not_offloadable,
    *ext__s_untyped_storage, *ext__s_data_ptr, *ext__s_nbytes,
    *ext__s_is_contiguous, *ext__s_stride, *ext__s_storage_offset, *ext__s_size,
    *ext__s_dtype, *ext__s_bases, *ext__s_records, *ext__s_view,
    *ext__s_as_strided, *ext__s_sync_compute, *ext__s_wrap_reloaded,
    *ext__s_destroy_now, *ext__s_version, *ext__s_is_conj, *ext__s_is_neg,
    *ext__s_is_quantized, *ext__s_is_buffer, *ext__s_version_error,
    *ext__s_pop_error, *ext__s_get_device;

int ext__intern_names(void) {
  struct {
    PyObject **slot;
    const char *text;
  } names[] = {
      {&ext__s_is_cpu, "is_cpu"},
      {&ext__s_is_cuda, "is_cuda"},
      {&ext__s_layout, "layout"},
      {&ext__s_base, "_base"},
      {&ext__s_numel, "numel"},
      {&ext__s_element_size, "element_size"},
      {&ext__s_not_offloadable, "_ofl_not_offloadable"},
      {&ext__s_untyped_storage, "untyped_storage"},
      {&ext__s_data_ptr, "data_ptr"},
      {&ext__s_nbytes, "nbytes"},
      {&ext__s_is_contiguous, "is_contiguous"},
      {&ext__s_stride, "stride"},
      {&ext__s_storage_offset, "storage_offset"},
      {&ext__s_size, "size"},
      {&ext__s_dtype, "dtype"},
      {&ext__s_bases, "bases"},
      {&ext__s_records, "records"},
      {&ext__s_view, "view"},
      {&ext__s_as_strided, "as_strided"},
      {&ext__s_sync_compute, "_sync_compute"},
      {&ext__s_wrap_reloaded, "_wrap_reloaded"},
      {&ext__s_destroy_now, "_destroy_now"},
      {&ext__s_version, "_version"},
      {&ext__s_is_conj, "is_conj"},
      {&ext__s_is_neg, "is_neg"},
      {&ext__s_is_quantized, "is_quantized"},
      {&ext__s_is_buffer, "_is_buffer"},
      {&ext__s_version_error, "_version_error"},
      {&ext__s_pop_error, "_pop_error"},
      {&ext__s_get_device, "get_device"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    *names[i].slot = PyUnicode_InternFromString(names[i].text);
    if (*names[i].slot == NULL)
      return -1;
  }
  return 0;
}

/* ---- small helpers ------------------------------------------------------- */

PyObject *ext__keep(PyObject *o) {
  Py_INCREF(o);
  return o;
}

/* An ofl status as the package's exception (ofl.OflError with the status,
 * its name and ofl_last_error(), built by ofl._errors.error). */
PyObject *ext__raise_ofl(ofl_status_t st, const char *where) {
  PyObject *exc =
      PyObject_CallFunction(ext__error_factory, "is", (int)st, where);
  if (exc != NULL) {
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
  }
  return NULL;
}

/* o.name, or *found = 0 without an exception when o has no such attribute. */
PyObject *ext__optional_attr(PyObject *o, PyObject *name, int *found) {
  PyObject *v = NULL;
#if PY_VERSION_HEX >= 0x030D0000
  int r = PyObject_GetOptionalAttr(o, name, &v);
#else
  int r = _PyObject_LookupAttr(o, name, &v);
#endif
  *found = r > 0;
  return r < 0 ? NULL : v;
}

PyObject *ext__call0(PyObject *o, PyObject *name) {
  return PyObject_CallMethodNoArgs(o, name);
}

/* o.name() as a C integer; -1 with an exception on failure. */
int ext__call_ll(PyObject *o, PyObject *name, long long *out) {
  PyObject *v = ext__call0(o, name);
  if (v == NULL)
    return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

int ext__call_ptr(PyObject *o, PyObject *name, uintptr_t *out) {
  PyObject *v = ext__call0(o, name);
  if (v == NULL)
    return -1;
  *out = (uintptr_t)PyLong_AsVoidPtr(v);
  Py_DECREF(v);
  return PyErr_Occurred() ? -1 : 0;
}

/* truth of o.name (attribute, or o.name() when call); -1 on error. */
int ext__attr_true(PyObject *o, PyObject *name, int call) {
  PyObject *v = call ? ext__call0(o, name) : PyObject_GetAttr(o, name);
  if (v == NULL)
    return -1;
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  return r;
}

/* A Python int holding a pointer (None for NULL, as ctypes gives it). */
void *ext__as_ptr(PyObject *o) {
  if (o == NULL || o == Py_None)
    return NULL;
  return PyLong_AsVoidPtr(o);
}
