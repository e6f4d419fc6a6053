/* ofl._ext: pack (eligibility, the group bases, the push into the innermost
 * open group) and pack_offload. */
#include "ext_internal.h"

/* ---- pack ---------------------------------------------------------------- */

/* Whether the tensor (or the base it views) carries a flag attribute that
 * keeps it where it is (mark_not_offloadable, nn.Buffer): 1, 0, -1 error. */
static int flagged(PyObject *t) {
  PyObject *names[2] = {ext__s_not_offloadable, ext__s_is_buffer};
  for (int i = 0; i < 2; i++) {
    int found;
    PyObject *flag = ext__optional_attr(t, names[i], &found);
    if (flag == NULL && PyErr_Occurred())
      return -1;
    if (found) {
      int r = PyObject_IsTrue(flag);
      Py_DECREF(flag);
      if (r != 0)
        return r;
    }
  }
  return 0;
}

/* Whether t may go to the manager: 1 yes,
 * 0 keep it where it is, -1 error. *root: new reference to the tensor whose
 * version counter t shares (its _base, else t). Parameters and other
 * subclasses, views of them, buffers, lazy conjugates and negations (bits
 * that are not in the bytes) and quantized tensors stay. */
static int eligible(HooksObject *self, PyObject *t, long long *numel,
                    long long *nb, PyObject **root) {
  *root = NULL;
  if (Py_TYPE(t) != (PyTypeObject *)ext__torch_tensor)
    return 0;
  int r = ext__attr_true(t, self->is_cuda ? ext__s_is_cuda : ext__s_is_cpu, 0);
  if (r <= 0)
    return r;
  if (self->is_cuda) { /* a tensor of another GPU stays where it is */
    long long dev;
    if (ext__call_ll(t, ext__s_get_device, &dev) < 0)
      return -1;
    if (dev != self->ordinal)
      return 0;
  }
  PyObject *layout = PyObject_GetAttr(t, ext__s_layout);
  if (layout == NULL)
    return -1;
  r = layout == ext__torch_strided;
  Py_DECREF(layout);
  if (!r)
    return 0;
  long long esize;
  if (ext__call_ll(t, ext__s_numel, numel) < 0 ||
      ext__call_ll(t, ext__s_element_size, &esize) < 0)
    return -1;
  *nb = *numel * esize;
  if (*nb == 0 || *numel < self->min_elems || *nb < self->min_bytes)
    return 0;
  PyObject *base = PyObject_GetAttr(t, ext__s_base);
  if (base == NULL)
    return -1;
  if (base != Py_None) {
    r = Py_TYPE(base) != (PyTypeObject *)ext__torch_tensor ? 1 : flagged(base);
    if (r != 0) {
      Py_DECREF(base);
      return r < 0 ? -1 : 0; /* a view of a parameter (weight.t()) or buffer */
    }
  }
  if ((r = flagged(t)) != 0 ||
      (r = ext__attr_true(t, ext__s_is_conj, 1)) != 0 ||
      (r = ext__attr_true(t, ext__s_is_neg, 1)) != 0 ||
      (r = ext__attr_true(t, ext__s_is_quantized, 0)) != 0) {
    Py_DECREF(base);
    return r < 0 ? -1 : 0;
  }
  if (base == Py_None) {
    Py_DECREF(base);
    base = ext__keep(t);
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
  if (key == NULL)
    return NULL;
  PyObject *base = PyDict_GetItemWithError(bases, key);
  if (base != NULL || PyErr_Occurred()) {
    Py_XINCREF(base);
    Py_DECREF(key);
    return base;
  }
  ofl_tensor_t *h = NULL;
  int64_t shape[1] = {snb};
  ofl_status_t st;
  if (self->copy_in) {
    st = ofl_pool_alloc(ext__as_ptr(self->dev_pool), shape, 1, OFL_DTYPE_U8,
                        NULL, &h);
    if (st != OFL_SUCCESS) {
      Py_DECREF(key);
      return ext__raise_ofl(st, "ofl_pool_alloc");
    }
    void *dst = ofl_tensor_data(h);
    if ((size_t)snb >= COPY_NOGIL_BYTES) {
      Py_BEGIN_ALLOW_THREADS memcpy(dst, (const void *)sptr, (size_t)snb);
      Py_END_ALLOW_THREADS
    } else {
      memcpy(dst, (const void *)sptr, (size_t)snb);
    }
  } else {
    st = ofl_tensor_wrap((void *)sptr, shape, 1, OFL_DTYPE_U8, OFL_LOC_DEVICE,
                         NULL, NULL, &h);
    if (st != OFL_SUCCESS) {
      Py_DECREF(key);
      return ext__raise_ofl(st, "ofl_tensor_wrap");
    }
  }
  base = PyList_New(2);
  PyObject *hv = base != NULL ? PyLong_FromVoidPtr(h) : NULL;
  if (hv == NULL || PyDict_SetItem(bases, key, base) < 0) {
    Py_XDECREF(hv);
    Py_XDECREF(base);
    Py_DECREF(key);
    ofl_tensor_destroy(h);
    return NULL;
  }
  PyList_SET_ITEM(base, 0, hv);
  PyList_SET_ITEM(base, 1, ext__keep(Py_False));
  Py_DECREF(key);
  return base;
}

static PyObject *pack_eligible(HooksObject *self, PyObject *t, long long nb,
                               PyObject *root);

PyObject *ext__hooks_pack(PyObject *op, PyObject *t) {
  HooksObject *self = (HooksObject *)op;
  if (!self->active || self->open == NULL || !PyList_Check(self->open) ||
      PyList_GET_SIZE(self->open) == 0)
    return ext__make_kept(t);
  long long numel = 0, nb = 0;
  PyObject *root;
  int r = eligible(self, t, &numel, &nb, &root);
  if (r <= 0)
    return r < 0 ? NULL : ext__make_kept(t);
  PyObject *res = pack_eligible(self, t, nb, root);
  Py_DECREF(root);
  return res;
}

/* The address and size of t's storage: 0, or -1 with an exception. */
static int storage_of(PyObject *t, uintptr_t *sptr, long long *snb) {
  PyObject *st = ext__call0(t, ext__s_untyped_storage);
  if (st == NULL)
    return -1;
  int r = ext__call_ptr(st, ext__s_data_ptr, sptr) < 0 ||
          ext__call_ll(st, ext__s_nbytes, snb) < 0;
  Py_DECREF(st);
  return r ? -1 : 0;
}

/* pack of a tensor that passed eligible(), into the innermost open group. */
static PyObject *pack_eligible(HooksObject *self, PyObject *t, long long nb,
                               PyObject *root) {
  uintptr_t sptr;
  long long snb;
  if (storage_of(t, &sptr, &snb) < 0)
    return NULL;
  int contiguous = ext__attr_true(t, ext__s_is_contiguous, 1);
  if (contiguous < 0)
    return NULL;
  long long off;
  int whole;
  if (contiguous) {
    uintptr_t p;
    if (ext__call_ptr(t, ext__s_data_ptr, &p) < 0)
      return NULL;
    off = (long long)(p - sptr);
    whole = 0;
  } else if (2 * nb >= snb) {
    off = 0;
    nb = snb;
    whole = 1;
  } else {
    return ext__make_kept(t); /* a small strided view of a large storage */
  }
  if (self->copy_in && !whole && 2 * nb < snb) {
    sptr += (uintptr_t)off; /* copy only the region: its own storage */
    snb = nb;
    off = 0;
  }
  if (!PyList_Check(self->open) || PyList_GET_SIZE(self->open) == 0)
    return ext__make_kept(
        t); /* closed meanwhile (by code run from a check above) */
  PyObject *g =
      ext__keep(PyList_GET_ITEM(self->open, PyList_GET_SIZE(self->open) - 1));
  PyObject *bases = NULL, *base = NULL, *records = NULL;
  SavedObject *rec = NULL;
  PyObject *result = NULL;

  bases = PyObject_GetAttr(g, ext__s_bases);
  if (bases == NULL)
    goto done;
  if (!PyDict_Check(bases)) {
    PyErr_SetString(PyExc_TypeError, "ofl: group.bases is not a dict");
    goto done;
  }
  records = PyObject_GetAttr(g, ext__s_records);
  if (records == NULL)
    goto done;
  if (!PyList_Check(records)) {
    PyErr_SetString(PyExc_TypeError, "ofl: group.records is not a list");
    goto done;
  }
  rec = ext__new_record(t, root, whole);
  if (rec == NULL)
    goto done;

  base = group_base(self, bases, sptr, snb);
  if (base == NULL)
    goto done;
  if (!PyList_Check(base) || PyList_GET_SIZE(base) != 2) {
    PyErr_SetString(PyExc_TypeError,
                    "ofl: group.bases entry is not [handle, pushed]");
    goto done;
  }
  ofl_tensor_t *base_h = ext__as_ptr(PyList_GET_ITEM(base, 0));
  if (base_h == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "ofl: null base handle");
    goto done;
  }
  ofl_tensor_t *handle;
  ofl_status_t s;
  if (off == 0 && nb == snb) {
    int pushed = PyObject_IsTrue(PyList_GET_ITEM(base, 1));
    if (pushed < 0)
      goto done;
    if (pushed) {
      if ((s = ofl_tensor_alias(base_h, &handle)) != OFL_SUCCESS) {
        ext__raise_ofl(s, "ofl_tensor_alias");
        goto done;
      }
    } else {
      handle = base_h;
      PyObject *old = PyList_GET_ITEM(base, 1);
      PyList_SET_ITEM(base, 1, ext__keep(Py_True));
      Py_DECREF(old);
    }
  } else {
    int64_t shape[1] = {nb};
    s = ofl_tensor_view(base_h, (size_t)off, shape, 1, OFL_DTYPE_U8, &handle);
    if (s != OFL_SUCCESS) {
      ext__raise_ofl(s, "ofl_tensor_view");
      goto done;
    }
  }
  ofl_tag_t tag = 0;
  s = ofl_manager_tensor_push(ext__as_ptr(self->m), handle, &tag);
  if (s != OFL_SUCCESS) {
    if (handle != base_h) {
      ofl_tensor_destroy(handle);
    } else {
      PyObject *old = PyList_GET_ITEM(base, 1);
      PyList_SET_ITEM(base, 1, ext__keep(Py_False));
      Py_DECREF(old);
    }
    ext__raise_ofl(s, "ofl_manager_tensor_push");
    goto done;
  }
  rec->tag = tag;
  rec->h = (unsigned long long)(uintptr_t)handle;
  /* held until the commit at least: while it lives its memory cannot be
   * reused by another tensor of the group (storages are keyed by address) */
  rec->tensor = ext__keep(t);
  rec->ptr = (unsigned long long)(sptr + (uintptr_t)off);
  rec->nbytes = nb;
  rec->group = ext__keep(g);
  rec->core = ext__keep((PyObject *)self);
  self->unpopped++;
  if (PyList_Append(records, (PyObject *)rec) < 0)
    goto done;
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

/* ---- pack_offload: a tensor in a group of its own ------------------------ */

/* pack_offload(t, name): t in a group of its own (offload_activations):
 * its memory wrapped (the device's memory: torch's on cuda, adopted CPU
 * memory on the host backend), group start, push, commit, all in C. The
 * tensor is referenced until ofl releases the wrap (after the D2H copy);
 * a group the policy keeps on the device keeps it in the record, and pop
 * gives it back. */
PyObject *ext__hooks_pack_offload(PyObject *op, PyObject *const *args,
                                  Py_ssize_t nargs) {
  HooksObject *self = (HooksObject *)op;
  if ((nargs != 2 && nargs != 4) || !PyBytes_Check(args[1]) ||
      (nargs == 4 && (!PyList_Check(args[2]) || !PyList_Check(args[3])))) {
    PyErr_SetString(
        PyExc_TypeError,
        "pack_offload(tensor, name: bytes[, marks: list, live: list])");
    return NULL;
  }
  ext__drain_handback();
  PyObject *t = args[0];
  const char *name = PyBytes_AS_STRING(args[1]);
  if (!self->active)
    return ext__make_kept(t);
  long long numel = 0, nb = 0;
  PyObject *root;
  int r = eligible(self, t, &numel, &nb, &root);
  if (r <= 0)
    return r < 0 ? NULL : ext__make_kept(t);
  PyObject *res = NULL;
  SavedObject *rec = NULL;
  ofl_manager_t *m = ext__as_ptr(self->m);
  if (m == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "ofl: the manager was destroyed");
    goto out;
  }
  if (self->is_cuda) { /* ofl's compute stream: torch's current one */
    PyObject *v = ext__call0(op, ext__s_sync_compute);
    if (v == NULL)
      goto out;
    Py_DECREF(v);
  }
  uintptr_t src;
  int contiguous = ext__attr_true(t, ext__s_is_contiguous, 1);
  if (contiguous < 0)
    goto out;
  int whole = 0;
  if (contiguous) {
    if (ext__call_ptr(t, ext__s_data_ptr, &src) < 0)
      goto out; /* the tensor's bytes */
  } else {
    uintptr_t sptr;
    long long snb;
    if (storage_of(t, &sptr, &snb) < 0)
      goto out;
    if (2 * nb < snb) {
      res = ext__make_kept(t); /* a small strided view of a large storage */
      goto out;
    }
    whole = 1; /* the whole storage, rebuilt with as_strided */
    src = sptr;
    nb = snb;
  }
  rec = ext__new_record(t, root, whole);
  if (rec == NULL)
    goto out;
  rec->ptr = (unsigned long long)src;
  rec->nbytes = nb;
  MarkObject *mk = PyObject_New(MarkObject, &ext__MarkType);
  if (mk == NULL)
    goto fail;
  mk->index = -1;
  rec->group = (PyObject *)mk;
  handback_t *hold = PyMem_RawMalloc(sizeof *hold);
  if (hold == NULL) {
    PyErr_NoMemory();
    goto fail;
  }
  hold->obj = ext__keep(t);
  hold->ptr = NULL;
  hold->next = NULL;
  ofl_tensor_t *h = NULL;
  int64_t shape[1] = {nb};
  /* ext_release only links hold into a lock-free list: it may run as a
   * host function of the D2H stream, right after the copy. */
  ofl_status_t s = ofl_tensor_wrap_flags((void *)src, shape, 1, OFL_DTYPE_U8,
                                         OFL_LOC_DEVICE, ext__release, hold,
                                         OFL_WRAP_RELEASE_IN_HOST_FN, &h);
  if (s != OFL_SUCCESS) {
    Py_DECREF(hold->obj);
    PyMem_RawFree(hold);
    ext__raise_ofl(s, "ofl_tensor_wrap");
    goto fail;
  }
  s = ofl_manager_group_start(m, name);
  if (s != OFL_SUCCESS) {
    ofl_tensor_destroy(h); /* releases the wrap: hold goes to the list */
    ext__raise_ofl(s, "ofl_manager_group_start");
    goto fail;
  }
  ofl_tag_t tag = 0;
  s = ofl_manager_tensor_push(m, h, &tag);
  if (s == OFL_SUCCESS) {
    rec->tag = tag;
    rec->h = (unsigned long long)(uintptr_t)h;
    rec->core = ext__keep(op);
    self->unpopped++;
  } else {
    ofl_tensor_destroy(h);
  }
  ofl_status_t c;
  Py_BEGIN_ALLOW_THREADS /* may wait for the oldest copies (max_inflight) */
      c = ofl_manager_group_commit(m, name, NULL, 0, 0);
  Py_END_ALLOW_THREADS if (s != OFL_SUCCESS) {
    ext__raise_ofl(s, "ofl_manager_tensor_push");
    goto fail;
  }
  if (c != OFL_SUCCESS) {
    ext__raise_ofl(c, "ofl_manager_group_commit");
    goto fail;
  }
  /* kept on the device by the policy: the record holds the tensor (pop
   * gives it back); offloaded: the wrap holds it until the copy is done */
  if (ofl_tensor_has_storage(h))
    rec->tensor = ext__keep(t);
  if (nargs ==
      4) { /* the group in its chunk's list, a weak reference in live */
    PyObject *w = PyWeakref_NewRef((PyObject *)rec, NULL);
    if (w == NULL)
      goto fail;
    r = PyList_Append(args[2], rec->group) < 0 || PyList_Append(args[3], w) < 0;
    Py_DECREF(w);
    if (r)
      goto fail;
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
