/* ofl._ext's private header: what the files of the extension share.
 *
 *   _ext.c         the module: setup, library(), the Hooks type and its
 *                  methods, init (the top: calls the files below);
 *   ext_util.c     what setup provides, the interned names, the small
 *                  helpers (the bottom: calls no other file);
 *   ext_records.c  Saved, Kept and Mark, and the records of saved tensors;
 *   ext_pack.c     eligibility, the group bases, pack and pack_offload;
 *   ext_unpack.c   Block, the DLPack wrap, pop_record, the version check,
 *                  unpack and unpack_ordered;
 *   ext_alloc.c    the hand-back list, drain and the pool allocator.
 *
 * What a file keeps to itself stays static there; what is shared is named
 * ext__*. Not installed, not part of the package's interface. */
#ifndef OFL_EXT_INTERNAL_H
#define OFL_EXT_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

/* Copies at least this large run without the GIL. */
#define COPY_NOGIL_BYTES ((size_t)1 << 16)

/* ---- what setup() provides (ext_util.c; _ext.c sets them) ---------------- */

extern PyObject *ext__error_factory;
extern PyObject *ext__torch_frombuffer, *ext__torch_uint8, *ext__torch_strided,
    *ext__torch_tensor;
extern PyObject *ext__kw_dtype;
extern PyObject *ext__torch_from_dlpack, *ext__dl_types;

/* Interned attribute and method names. */
extern PyObject *ext__s_is_cpu, *ext__s_is_cuda, *ext__s_layout, *ext__s_base,
    *ext__s_numel, *ext__s_element_size, *ext__s_not_offloadable,
    *ext__s_untyped_storage, *ext__s_data_ptr, *ext__s_nbytes,
    *ext__s_is_contiguous, *ext__s_stride, *ext__s_storage_offset, *ext__s_size,
    *ext__s_dtype, *ext__s_bases, *ext__s_records, *ext__s_view,
    *ext__s_as_strided, *ext__s_sync_compute, *ext__s_wrap_reloaded,
    *ext__s_destroy_now, *ext__s_version, *ext__s_is_conj, *ext__s_is_neg,
    *ext__s_is_quantized, *ext__s_is_buffer, *ext__s_version_error,
    *ext__s_pop_error, *ext__s_get_device;

/* ---- the objects --------------------------------------------------------- */

struct HooksObject;

typedef struct {
  PyObject_HEAD unsigned long long tag;
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

typedef struct HooksObject {
  PyObject_HEAD PyObject
      *m;             /* ofl_manager_t * as an int, None once destroyed */
  PyObject *dev_pool; /* ofl_pool_t * as an int */
  PyObject *open;     /* list of open groups, innermost last */
  long long min_elems;
  long long min_bytes;
  long long ordinal;      /* cuda: the GPU ofl opened; its tensors only */
  Py_ssize_t live_blocks; /* reloaded tensors torch still uses */
  Py_ssize_t unpopped;    /* records pushed, not popped, alive */
  int in_call;            /* hook calls on this manager in progress (nested) */
  char destroy_pending; /* the last Block went during one: destroy at its end */
  char active;          /* offload enabled and not forward-only */
  char closing;         /* close() waits for live_blocks to drop to 0 */
  char copy_in;         /* host backend: copy into the device pool */
  char is_cuda;
} HooksObject;

/* Owns a tensor popped from the manager; exports its bytes as a writable
 * buffer for torch.frombuffer, which keeps this object until torch frees the
 * last view. Then the handle is destroyed (its pool block goes back) and the
 * manager's count of live blocks drops (close() waits for it). */
typedef struct {
  PyObject_HEAD HooksObject *core;
  ofl_tensor_t *h;
  void *data;
  Py_ssize_t nbytes;
} BlockObject;

typedef struct {
  PyObject_HEAD PyObject *t;
  long long version;
} KeptObject;

typedef struct {
  PyObject_HEAD int index; /* -1 backward not begun, 0 begun, -2 ended */
} MarkObject;

typedef struct handback {
  struct handback *next;
  PyObject *obj; /* a torch tensor whose memory ofl let go of, or NULL */
  void *ptr;     /* else: a block freed by one of ofl's pools */
} handback_t;

/* ---- the interned names and the small helpers (ext_util.c) --------------- */

int ext__intern_names(void);
PyObject *ext__keep(PyObject *o);
PyObject *ext__raise_ofl(ofl_status_t st, const char *where);
PyObject *ext__optional_attr(PyObject *o, PyObject *name, int *found);
PyObject *ext__call0(PyObject *o, PyObject *name);
int ext__call_ll(PyObject *o, PyObject *name, long long *out);
int ext__call_ptr(PyObject *o, PyObject *name, uintptr_t *out);
int ext__attr_true(PyObject *o, PyObject *name, int call);
void *ext__as_ptr(PyObject *o);

/* ---- records (ext_records.c) --------------------------------------------- */

void ext__saved_forget_core(SavedObject *s);
int ext__tensor_version(PyObject *t, long long *out);
PyObject *ext__make_kept(PyObject *t);
SavedObject *ext__new_record(PyObject *t, PyObject *root, int whole);
extern PyTypeObject ext__SavedType;
extern PyTypeObject ext__KeptType;
extern PyTypeObject ext__MarkType;

/* ---- pack (ext_pack.c) --------------------------------------------------- */

PyObject *ext__hooks_pack(PyObject *op, PyObject *t);
PyObject *ext__hooks_pack_offload(PyObject *op, PyObject *const *args,
                                  Py_ssize_t nargs);

/* ---- unpack (ext_unpack.c) ----------------------------------------------- */

void ext__call_enter(HooksObject *self);
PyObject *ext__call_leave(HooksObject *self, PyObject *res);
PyObject *ext__dl_type_of(PyObject *torch, PyObject *dtype);
PyObject *ext__hooks_unpack(PyObject *op, PyObject *r);
PyObject *ext__hooks_unpack_ordered(PyObject *op, PyObject *const *args,
                                    Py_ssize_t nargs);
PyObject *ext__hooks_pop_record(PyObject *op, PyObject *r);
PyObject *ext__hooks_keep(PyObject *op, PyObject *t);
extern PyTypeObject ext__BlockType;

/* ---- the hand-back list and the allocator (ext_alloc.c) ------------------ */

void ext__release(void *data, size_t bytes, void *user);
void ext__drain_handback(void);
PyObject *ext__set_allocator(PyObject *mod, PyObject *args);
PyObject *ext__drain(PyObject *mod, PyObject *unused);

#endif /* OFL_EXT_INTERNAL_H */
