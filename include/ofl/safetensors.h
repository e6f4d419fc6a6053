/* ofl: the safetensors file format (what PyTorch and the Hugging Face
 * ecosystem load directly). A file is an 8-byte little-endian header length
 * N, N bytes of UTF-8 JSON padded with spaces so that the data starts on an
 * 8-byte boundary, then the tensors' bytes packed without holes:
 *
 *   {"__metadata__":{"k":"v"},
 *    "name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}, ...}
 *
 * data_offsets are relative to the start of the data. The writer orders the
 * data by element size (largest first) then by name, so every tensor starts
 * on a multiple of its element size. Writing is atomic: the file is written
 * and fsynced under no name or a temporary one in the same directory, then
 * given its name, then the directory is fsynced; on any error nothing
 * appears at the final path (see ofl_safetensors_write for what a killed
 * process leaves). */
#ifndef OFL_SAFETENSORS_H
#define OFL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include <ofl/export.h>
#include <ofl/status.h>
#include <ofl/tensor.h>

OFL_EXTERN_C_BEGIN

/* Longest tensor name and metadata key or value, in bytes (UTF-8). */
#define OFL_SAFETENSORS_NAME_MAX OFL__SIZE_C(1024)
/* Largest header, in bytes, that ofl reads or writes: the reference
 * implementation's limit (100,000,000 bytes, not 100 MiB), so that every
 * file ofl writes loads there too. */
#define OFL_SAFETENSORS_HEADER_MAX OFL__SIZE_C(100000000)

/* One tensor: name, dtype, shape and bytes (row-major, little-endian). */
typedef struct ofl_safetensors_entry {
  const char *name;
  ofl_dtype_t dtype;
  int ndim;
  int64_t shape[OFL_MAX_DIMS];
  const void *data;
  size_t bytes; /* must equal ofl_shape_bytes(shape, ndim, dtype) */
} ofl_safetensors_entry_t;

/* One "__metadata__" pair (strings only, as the format requires). */
typedef struct ofl_safetensors_kv {
  const char *key;
  const char *value;
} ofl_safetensors_kv_t;

/* Writes entries (names unique, non-empty, valid UTF-8, at most
 * OFL_SAFETENSORS_NAME_MAX bytes, not "__metadata__") and metadata to path
 * atomically. OFL_ERR_INVALID_ARG for bad entries, a header over
 * OFL_SAFETENSORS_HEADER_MAX or a file name too long for the file system,
 * OFL_ERR_NO_SPACE when the disk is full, OFL_ERR_SYSTEM when the directory
 * cannot be written, OFL_ERR_IO for other write errors; in every error case
 * nothing is left at path (an older file there is kept as it was).
 *
 * A process killed during the write (its space was reserved up front):
 *   - where the file system has O_TMPFILE (ext4, xfs, btrfs, tmpfs), the
 *     file has no name until it is complete (linkat; over an existing file
 *     a temporary ".NAME.tmp.XXXXXX" lives only between the link and the
 *     rename), so the kernel frees it and nothing is left;
 *   - elsewhere (NFS, most FUSE file systems) the named temporary
 *     ".NAME.tmp.XXXXXX" stays until the next save into that directory,
 *     which removes the temporaries of the same NAME, and those of other
 *     "*.safetensors" names older than the process, that no live writer
 *     holds (each writer keeps an flock on its temporary until the rename).
 *     Another program's files are never removed. */
OFL_API ofl_status_t ofl_safetensors_write(const char *path,
                                           const ofl_safetensors_entry_t *entries,
                                           size_t n,
                                           const ofl_safetensors_kv_t *metadata,
                                           size_t n_metadata);

/* A parsed file (read-only; the entries point into it). */
typedef struct ofl_safetensors ofl_safetensors_t;

/* Maps path and checks the header strictly: JSON syntax, known dtypes,
 * shapes, offsets in range, matching the shape's size, neither overlapping
 * nor leaving holes, a header of at most OFL_SAFETENSORS_HEADER_MAX bytes.
 * OFL_ERR_CORRUPT with a message naming the problem (and the tensor) for a
 * malformed file; OFL_ERR_NOT_SUPPORTED naming the tensor for a valid file
 * that ofl cannot represent (a dtype of the format that ofl_dtype_t lacks,
 * such as C64 or F8_E8M0, or more than OFL_MAX_DIMS dimensions);
 * OFL_ERR_SYSTEM when it cannot be opened. Dtypes: F64, F32, F16, BF16,
 * F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL. Name lookups
 * (find, copy_to) go through an index sorted at open: O(log n). */
OFL_API ofl_status_t ofl_safetensors_open(const char *path,
                                          ofl_safetensors_t **out);
/* Same checks on a file image in memory (copied). */
OFL_API ofl_status_t ofl_safetensors_parse(const void *image, size_t bytes,
                                           ofl_safetensors_t **out);
/* NULL is accepted. Entries and strings obtained from st end with it. */
OFL_API void ofl_safetensors_close(ofl_safetensors_t *st);

/* Tensors in data order (index 0 has the lowest offset). */
OFL_API size_t ofl_safetensors_count(const ofl_safetensors_t *st);
OFL_API ofl_status_t ofl_safetensors_get(const ofl_safetensors_t *st,
                                         size_t index,
                                         ofl_safetensors_entry_t *out);
/* OFL_ERR_INVALID_ARG when no tensor has that name. O(log n). */
OFL_API ofl_status_t ofl_safetensors_find(const ofl_safetensors_t *st,
                                          const char *name,
                                          ofl_safetensors_entry_t *out);
/* The "__metadata__" pairs, in file order. */
OFL_API size_t ofl_safetensors_metadata_count(const ofl_safetensors_t *st);
OFL_API ofl_status_t ofl_safetensors_metadata(const ofl_safetensors_t *st,
                                              size_t index,
                                              ofl_safetensors_kv_t *out);
/* The value of key, NULL when absent. */
OFL_API const char *ofl_safetensors_metadata_get(const ofl_safetensors_t *st,
                                                 const char *key);
/* Byte offset of the data in the file (8 + header length; a multiple of 8
 * in files ofl writes, any value in files from elsewhere). */
OFL_API size_t ofl_safetensors_data_offset(const ofl_safetensors_t *st);

/* Restores one tensor: copies the tensor called name from st into dst
 * (same dtype and shape; dst on the device or in pinned memory) on stream.
 * The copy reads st's memory, so synchronize stream before closing st.
 * OFL_ERR_INVALID_ARG when st has no such tensor, OFL_ERR_MISMATCH naming
 * the tensor when the dtype or shape differ. */
OFL_API ofl_status_t ofl_safetensors_copy_to(const ofl_safetensors_t *st,
                                             const char *name,
                                             ofl_tensor_t *dst,
                                             ofl_stream_t *stream);

/* The format's dtype name ("F32", "BF16", "F8_E4M3", "BOOL", ...); NULL for
 * an invalid dtype. */
OFL_API const char *ofl_safetensors_dtype_name(ofl_dtype_t dtype);

OFL_EXTERN_C_END

#endif /* OFL_SAFETENSORS_H */
