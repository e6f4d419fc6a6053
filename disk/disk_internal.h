/* ofl: disk store internals shared by disk_store.c (configuration, engine
 * choice, open and close), disk_file.c (the private file, O_DIRECT, growing
 * it), disk_keep.c (bounce buffers, the keep list), disk_extent.c (extents
 * and their states), disk_io.c (io_uring and thread engines), disk_space.c
 * (space inside the file) and disk_crc.c. Not installed. */
#ifndef OFL_POOL_DISK_INTERNAL_H
#define OFL_POOL_DISK_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ofl/disk.h>
#include <ofl/version.h>

#if OFL_HAVE_LIBURING
#include <liburing.h>
#endif

#define OFL__DISK_ALIGN ((size_t)4096)

static inline size_t ofl__disk_round(size_t bytes) {
  return (bytes + OFL__DISK_ALIGN - 1) & ~(OFL__DISK_ALIGN - 1);
}

/* ---- CRC32C (Castagnoli), reflected, init and final xor ~0 ---------------
 * ofl__crc32c(0, "123456789", 9) == 0xE3069283. Pass the previous result as
 * crc to continue over more bytes. */
uint32_t ofl__crc32c(uint32_t crc, const void *data, size_t bytes);
/* The portable table version (the hardware one is checked against it). */
uint32_t ofl__crc32c_sw(uint32_t crc, const void *data, size_t bytes);
int ofl__crc32c_hw_available(void);

/* ---- space inside the file ------------------------------------------------
 * Free ranges sorted by offset, coalesced; the file grows at its end. */
typedef struct disk_range {
  uint64_t off, len;
} disk_range_t;

typedef struct disk_space {
  disk_range_t *free;
  size_t nfree, cap;
  uint64_t file_bytes;
} disk_space_t;

void ofl__disk_space_init(disk_space_t *s);
void ofl__disk_space_fini(disk_space_t *s);
/* First fit; false when no free range is long enough. */
bool ofl__disk_space_take(disk_space_t *s, uint64_t len, uint64_t *off);
/* Returns a range (coalesced with its neighbours); false only when the list
 * cannot grow (out of memory), in which case the range is lost to reuse. */
bool ofl__disk_space_give(disk_space_t *s, uint64_t off, uint64_t len);
/* Bytes of the free range that ends at file_bytes (0 when none). */
uint64_t ofl__disk_space_tail_free(const disk_space_t *s);

/* ---- fault injection (tests) ----------------------------------------------
 */
typedef enum ofl__disk_fault {
  OFL__DISK_FAULT_NONE = 0,
  OFL__DISK_FAULT_WRITE_EIO,
  OFL__DISK_FAULT_WRITE_ENOSPC,
  OFL__DISK_FAULT_WRITE_SHORT,
  OFL__DISK_FAULT_READ_EIO,
  OFL__DISK_FAULT_READ_SHORT,
  OFL__DISK_FAULT_READ_CORRUPT /* the read succeeds, one byte is flipped */
} ofl__disk_fault_t;

/* The fault hits `count` I/O requests of its direction after `after_n`
 * more requests of that direction have gone through untouched. */
void ofl__disk_inject_fault(ofl_disk_t *disk, ofl__disk_fault_t kind,
                            unsigned after_n, unsigned count);
/* Tests: while paused, queued operations stay queued (no request is cut). */
void ofl__disk_pause(ofl_disk_t *d, int paused);
/* Tests: the store's O_TMPFILE is turned off by ofl__no_tmpfile
 * (disk/private_file.h), the one hook for the disk store and staging/. */

/* Tests: when nonzero, the O_DIRECT probe write at open fails with this
 * errno (ENOSPC: a full file system; EINVAL: O_DIRECT refused). */
extern int ofl__disk_probe_errno;

/* The file descriptor and an extent's file offset (tests that corrupt the
 * file behind the store's back). */
int ofl__disk_fd(const ofl_disk_t *disk);
uint64_t ofl__disk_extent_offset(const ofl_disk_extent_t *e);

/* ---- store and extents ------------------------------------------------------
 */
enum { DISK_OP_NONE = 0, DISK_OP_WRITE, DISK_OP_READ };

struct ofl_disk_extent {
  ofl_disk_t *disk;
  size_t bytes; /* payload */
  size_t span;  /* bytes rounded to 4 KiB: file space and buffer capacity */
  uint64_t off; /* file offset */
  ofl_tensor_t *buf; /* bounce buffer (pool block) or NULL */
  void *data;
  ofl_disk_extent_state_t state;
  /* The operation in flight (engine side). */
  int op;
  bool submitted;    /* write_after: false until the stream reached it */
  bool keep_buffer;  /* a reload/prefetch came while writing */
  size_t carved;     /* bytes cut into requests so far */
  unsigned inflight; /* requests issued and not completed */
  int err;           /* first errno of the op (EIO, ENOSPC, ...) */
  bool short_io;
  bool corrupt_injected;
  ofl_status_t last;    /* outcome of the last finished operation */
  ofl_status_t pending; /* read error not yet returned by reload */
  uint32_t crc;
  /* ON_DISK with the written bytes still in this buffer (keep list, oldest
   * first); buf and data stay NULL until a reload takes it. */
  ofl_tensor_t *kept;
  struct ofl_disk_extent *keep_prev, *keep_next;
  struct ofl_disk_extent *next_queued; /* FIFO of ops with uncarved bytes */
  struct ofl_disk_extent *prev, *next; /* live list */
};

typedef struct disk_req {
  ofl_disk_extent_t *ext;
  uint64_t file_off;
  size_t buf_off;
  size_t len;
  int write;
  ofl__disk_fault_t fault; /* injected outcome, NONE: real I/O */
  bool busy;
} disk_req_t;

typedef struct disk_engine_ops {
  const char *name;
  ofl_status_t (*start)(ofl_disk_t *d);
  void (*kick)(ofl_disk_t *d); /* lock held: new requests are queued */
  void (*stop)(ofl_disk_t *d); /* lock not held; I/O has drained */
} disk_engine_ops_t;

struct ofl_disk {
  ofl_device_t *dev;
  ofl_pool_t *pool;
  bool own_pool;
  int fd;
  char dir[4096];
  int rank;
  bool direct, checksum, preallocate;
  int queue_depth;
  size_t block_bytes;
  uint64_t budget, grow;
  int prefetch_groups;
  char *groups; /* comma list, owned */

  pthread_mutex_t mu;
  pthread_cond_t done_cv; /* an operation finished */
  pthread_cond_t work_cv; /* thread engine: requests are queued */
  disk_space_t space;
  ofl_disk_extent_t *live;                  /* list of live extents */
  ofl_disk_extent_t *keep_head, *keep_tail; /* kept buffers, oldest first */
  size_t keep_cap, kept_bytes;
  /* Operations with requests left to cut, [0] reads and [1] writes. Reads
   * go first: the backward pass waits on them, writes only hold buffers. */
  ofl_disk_extent_t *q_head[2], *q_tail[2];
  disk_req_t *reqs; /* queue_depth slots */
  int reqs_busy;
  unsigned ops_inflight; /* extent operations not finished */
  /* Bumped (with a broadcast of done_cv) whenever the store gives a bounce
   * buffer back to the pool or its keep list: a reload waiting for a buffer
   * that in-flight writes will return retries on every change. */
  uint64_t buf_gen;
  bool degraded;
  bool stop;
  bool paused; /* tests */

  /* fault injection */
  ofl__disk_fault_t inj_kind;
  unsigned inj_after, inj_count;

  /* busy time per direction, for GB/s */
  int busy_dir[2];
  uint64_t busy_since[2], busy_ns[2];
  ofl_disk_stats_t st;

  const disk_engine_ops_t *eng;
  pthread_t *threads;
  int nthreads;
#if OFL_HAVE_LIBURING
  struct io_uring ring;
  bool ring_ok;
#endif
};

extern const disk_engine_ops_t ofl__disk_engine_threads;
#if OFL_HAVE_LIBURING
extern const disk_engine_ops_t ofl__disk_engine_uring;
/* 1 when the kernel lets this process use io_uring (with timed waits). */
int ofl__disk_uring_usable(void);
#endif

/* ---- shared by the store's files ----------------------------------------
 */
static inline void ofl__disk_lock(const ofl_disk_t *d) {
  pthread_mutex_lock((pthread_mutex_t *)&d->mu);
}
static inline void ofl__disk_unlock(const ofl_disk_t *d) {
  pthread_mutex_unlock((pthread_mutex_t *)&d->mu);
}

/* Lock held: a bounce buffer went back; wake reloads waiting for one. */
static inline void ofl__disk_buffer_returned(ofl_disk_t *d) {
  d->buf_gen++;
  pthread_cond_broadcast(&d->done_cv);
}

/* Lock held: waits on done_cv until deadline_ns (CLOCK_MONOTONIC, from
 * ofl__deadline_ns). false when the deadline passed. */
bool ofl__disk_wait_until(ofl_disk_t *d, uint64_t deadline_ns);

/* ---- the file (disk_file.c) */
/* OFL_ERR_NO_SPACE for ENOSPC and for a file-size limit (EFBIG) or a quota
 * (EDQUOT), which count as faults_enospc too; OFL_ERR_IO otherwise. */
ofl_status_t ofl__disk_status_of_errno(int err);
/* Opens the store's private file in d->dir; *how says which way. */
ofl_status_t ofl__disk_file_open(ofl_disk_t *d, const char **how);
/* Sets d->direct: O_DIRECT when mode asks and a probe write succeeds. */
ofl_status_t ofl__disk_file_direct(ofl_disk_t *d, ofl_disk_direct_t mode);
/* Lock held. Makes [off, off + len) of the file usable; 0 or errno. */
int ofl__disk_file_grow(ofl_disk_t *d, uint64_t off, uint64_t len);
/* Lock held. Space of span bytes: first fit, else the file grows (by at
 * least d->grow, within the budget). */
ofl_status_t ofl__disk_file_alloc(ofl_disk_t *d, uint64_t span, uint64_t *out);

/* ---- bounce buffers and the keep list (disk_keep.c) */
/* Lock not held. A bounce buffer of span bytes; when the pool refuses,
 * kept buffers go back to it, oldest first, until it gives one or none is
 * left. */
ofl_status_t ofl__disk_buffer_alloc(ofl_disk_t *d, size_t span,
                                    ofl_tensor_t **t);
/* Lock held: a write of e completed; keeps its buffer t when the cap
 * allows (dropping older ones) and returns NULL, else returns t to free. */
ofl_tensor_t *ofl__disk_keep_add(ofl_disk_t *d, ofl_disk_extent_t *e,
                                 ofl_tensor_t *t);
/* Lock held: an ON_DISK extent with a kept buffer becomes RESIDENT without
 * a read; false when it has none. */
bool ofl__disk_keep_take(ofl_disk_t *d, ofl_disk_extent_t *e);
/* Lock held: takes e off the keep list; returns its buffer. */
ofl_tensor_t *ofl__disk_keep_unlink(ofl_disk_t *d, ofl_disk_extent_t *e);

/* ---- extents (disk_extent.c) */
/* Lock not held. Frees e's space, buffer and handle (no operation in
 * flight); the buffer goes back after stream when one is given. */
void ofl__disk_extent_release(ofl_disk_t *d, ofl_disk_extent_t *e,
                              ofl_stream_t *after);
/* Lock not held: the engine finished e's operation (ofl__disk_complete_req
 * returned e); verifies, updates state and counters, wakes waiters. */
void ofl__disk_finish(ofl_disk_t *d, ofl_disk_extent_t *e);

/* ---- the I/O queue (disk_io.c) */
/* Lock held: appends e's operation to its queue. */
void ofl__disk_queue_push(ofl_disk_t *d, ofl_disk_extent_t *e);
/* Lock held: takes e's operation out of its queue if nothing of it was cut
 * yet; false otherwise (its requests are issued). */
bool ofl__disk_queue_cancel(ofl_disk_t *d, ofl_disk_extent_t *e);
/* Lock held: cuts the next request from the queue into a free slot; NULL
 * when the queue is empty or every slot is busy. */
disk_req_t *ofl__disk_next_req(ofl_disk_t *d);
/* Lock held: records the result of a request (bytes done or -errno) and
 * frees its slot. Returns the extent when its operation has no request left
 * in flight and nothing left to cut: the caller then calls
 * ofl__disk_finish without the lock. */
ofl_disk_extent_t *ofl__disk_complete_req(ofl_disk_t *d, disk_req_t *r,
                                          long res);

#endif /* OFL_POOL_DISK_INTERNAL_H */
