/* ofl._ext: what ofl hands back on its own threads (the hand-back list,
 * drain) and the pool allocator's callbacks (set_allocator). */
#include "ext_internal.h"

/* ---- what ofl hands back on its own threads ------------------------------ */

/* ofl releases torch memory it read in place (a wrap's release callback,
 * after the D2H copy of an offload, or when the handle is destroyed) and
 * frees blocks of torch's allocator (ofl_allocator_t.free) possibly on one
 * of its own threads, where no Python may run: each is only linked into
 * handback_list there (lock-free), and the training thread finishes it with
 * the GIL at its next hook, reset or close (drain_handback): the reference
 * to the torch tensor is dropped, or the address goes to the allocator's
 * Python free. */
static _Atomic(handback_t *) handback_list;
static PyObject *py_alloc, *py_free; /* set_allocator */

static void push_handback(handback_t *h) {
  handback_t *head = atomic_load(&handback_list);
  do {
    h->next = head;
  } while (!atomic_compare_exchange_weak(&handback_list, &head, h));
}

/* The wrap's release callback (user: the handback holding the tensor). */
void ext__release(void *data, size_t bytes, void *user) {
  (void)data;
  (void)bytes;
  push_handback(user);
}

/* With the GIL. */
void ext__drain_handback(void) {
  if (atomic_load_explicit(&handback_list, memory_order_relaxed) == NULL)
    return;
  handback_t *h = atomic_exchange(&handback_list, NULL);
  while (h != NULL) {
    handback_t *n = h->next;
    if (h->obj != NULL) {
      Py_DECREF(h->obj);
    } else if (py_free != NULL) {
      PyObject *r = PyObject_CallFunction(
          py_free, "K", (unsigned long long)(uintptr_t)h->ptr);
      if (r == NULL)
        PyErr_WriteUnraisable(py_free);
      else
        Py_DECREF(r);
    }
    PyMem_RawFree(h);
    h = n;
  }
}

/* ---- the pool allocator: torch's memory for ofl's device pool ------------ */

/* ofl_allocator_t's callbacks (include/ofl/pool.h) over two Python
 * callables set by set_allocator: alloc(bytes, stream) -> address (torch's
 * caching allocator on cuda, torch.empty on the host backend) and
 * free(address), reached through handback_list. alloc runs on the thread
 * that allocates (the training thread: pops and prefetches) and takes the
 * GIL. */
static ofl_status_t ext_alloc(void *ctx, size_t bytes, ofl_stream_t *stream,
                              void **ptr) {
  (void)ctx;
  ofl_status_t st = OFL_ERR_NO_MEMORY;
  PyGILState_STATE g = PyGILState_Ensure();
  if (py_alloc != NULL) {
    PyObject *r = PyObject_CallFunction(py_alloc, "nK", (Py_ssize_t)bytes,
                                        (unsigned long long)(uintptr_t)stream);
    if (r != NULL) {
      void *p = PyLong_AsVoidPtr(r);
      Py_DECREF(r);
      if (p != NULL && !PyErr_Occurred()) {
        *ptr = p;
        st = OFL_SUCCESS;
      }
    }
    if (PyErr_Occurred())
      PyErr_Clear(); /* an allocation that failed: ofl retries */
  }
  PyGILState_Release(g);
  return st;
}

static void ext_free(void *ctx, void *ptr, size_t bytes, ofl_stream_t *stream) {
  (void)ctx;
  (void)bytes;
  (void)stream;
  handback_t *h = PyMem_RawMalloc(sizeof *h);
  if (h == NULL)
    return; /* leaks the block rather than touch Python here */
  h->obj = NULL;
  h->ptr = ptr;
  push_handback(h);
}

/* set_allocator(alloc, free): the Python side of the allocator; returns
 * (address of ext_alloc, address of ext_free) for an ofl_allocator_t. */
PyObject *ext__set_allocator(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *a, *f;
  if (!PyArg_ParseTuple(args, "OO:set_allocator", &a, &f))
    return NULL;
  if (!PyCallable_Check(a) || !PyCallable_Check(f)) {
    PyErr_SetString(PyExc_TypeError,
                    "set_allocator(alloc, free): two callables");
    return NULL;
  }
  Py_INCREF(a);
  Py_INCREF(f);
  Py_XSETREF(py_alloc, a);
  Py_XSETREF(py_free, f);
  ofl_status_t (*pa)(void *, size_t, ofl_stream_t *, void **) = ext_alloc;
  void (*pf)(void *, void *, size_t, ofl_stream_t *) = ext_free;
  void *va, *vf;
  memcpy(&va, &pa, sizeof va);
  memcpy(&vf, &pf, sizeof vf);
  return Py_BuildValue("(NN)", PyLong_FromVoidPtr(va), PyLong_FromVoidPtr(vf));
}

PyObject *ext__drain(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  ext__drain_handback();
  Py_RETURN_NONE;
}
