// ofl: thin header-only C++17 wrappers over the C API, for C++ pipelines.
// Ownership is RAII (unique handles), errors are exceptions carrying the
// status and the library's message, and the forward/backward markers of a
// group are scope guards.
//
//   ofl::Manager mgr(params);
//   {                                       // forward of one module call
//     ofl::Group g(mgr, "core_attn");
//     auto tag = g.push(std::move(q));      // the manager owns q until pop
//     g.commit();                           // D2H after the compute so far
//   }
//   {                                       // backward of the same call
//     ofl::Backward b(mgr, "core_attn");
//     ofl::Tensor q = b.pop(tag);           // device storage again
//   }
//   mgr.reset();                            // end of the iteration
//
// Also: Comm (self, MPI, NCCL), Disk (the disk tier store), Stager (async
// checkpoint staging and .safetensors saves), pool and manager statistics,
// the summary, forward-only and offload on/off switches. Shapes are any
// contiguous container of int64_t (std::vector, std::array) or a braced
// list.
#ifndef OFL_OFL_HPP
#define OFL_OFL_HPP

#include <cstdio>
#include <exception>
#include <initializer_list>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ofl/ofl.h>

namespace ofl {

// An ofl call that failed: status() is the code, what() the message.
class Error : public std::runtime_error {
public:
  Error(ofl_status_t st, const std::string &where)
      : std::runtime_error(where + ": " + ofl_status_str(st) + ": " +
                           ofl_last_error()),
        status_(st) {}
  ofl_status_t status() const noexcept { return status_; }

private:
  ofl_status_t status_;
};

inline void check(ofl_status_t st, const char *where) {
  if (st != OFL_SUCCESS)
    throw Error(st, where);
}

// A unique owner of a C handle with its destroy function.
template <typename T, void (*Destroy)(T *)> class Handle {
public:
  Handle() = default;
  explicit Handle(T *p) noexcept : p_(p) {}
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  Handle(Handle &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Handle &operator=(Handle &&o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  ~Handle() { reset(); }
  T *get() const noexcept { return p_; }
  T *release() noexcept { return std::exchange(p_, nullptr); }
  explicit operator bool() const noexcept { return p_ != nullptr; }
  void reset() noexcept {
    if (p_ != nullptr)
      Destroy(std::exchange(p_, nullptr));
  }

private:
  T *p_ = nullptr;
};

namespace detail {
inline void destroy_tensor(ofl_tensor_t *t) { (void)ofl_tensor_destroy(t); }
inline void destroy_stager(ofl_stager_t *s) { (void)ofl_stager_destroy(s); }
// A WARN line in the library's format, at OFL_DEBUG=WARN or above (the C
// API has no public log call: it goes to stderr).
inline void warn(const std::string &msg) {
  if (ofl_log_get_level() >= OFL_LOG_WARN)
    std::fprintf(stderr, "ofl WARN PIPELINE %s\n", msg.c_str());
}
// The number of dimensions of a shape container, as the C API takes it.
template <typename Shape> int ndim_of(const Shape &shape) {
  return static_cast<int>(std::size(shape));
}
} // namespace detail

class Device : public Handle<ofl_device_t, ofl_device_close> {
public:
  explicit Device(const ofl_device_params_t *params = nullptr) {
    ofl_device_t *d = nullptr;
    check(ofl_device_open(params, &d), "ofl_device_open");
    *static_cast<Handle *>(this) = Handle(d);
  }
  ofl_stream_t *compute_stream() const {
    return ofl_device_compute_stream(get());
  }
  ofl_device_stats_t stats() const {
    ofl_device_stats_t s{};
    ofl_device_get_stats(get(), &s);
    return s;
  }
};

class Tensor : public Handle<ofl_tensor_t, detail::destroy_tensor> {
public:
  using Handle::Handle;
  void *data() const { return ofl_tensor_data(get()); }
  template <typename T> T *data_as() const { return static_cast<T *>(data()); }
  size_t bytes() const { return ofl_tensor_bytes(get()); }
  size_t nelem() const { return ofl_tensor_nelem(get()); }
  ofl_location_t location() const { return ofl_tensor_location(get()); }
};

class Pool : public Handle<ofl_pool_t, ofl_pool_destroy> {
public:
  Pool(ofl_device_t *dev, const ofl_pool_params_t *params = nullptr) {
    ofl_pool_t *p = nullptr;
    check(ofl_pool_create(dev, params, &p), "ofl_pool_create");
    *static_cast<Handle *>(this) = Handle(p);
  }
  // A block of key (shape, dtype); shape: a braced list or any contiguous
  // container of int64_t known at run time (std::vector<int64_t>).
  Tensor alloc(std::initializer_list<int64_t> shape, ofl_dtype_t dtype,
               ofl_stream_t *stream = nullptr) {
    return alloc(std::vector<int64_t>(shape), dtype, stream);
  }
  template <typename Shape>
  Tensor alloc(const Shape &shape, ofl_dtype_t dtype,
               ofl_stream_t *stream = nullptr) {
    ofl_tensor_t *t = nullptr;
    check(ofl_pool_alloc(get(), std::data(shape), detail::ndim_of(shape),
                         dtype, stream, &t),
          "ofl_pool_alloc");
    return Tensor(t);
  }
  // Same, keyed by the rounded byte size (dynamic shapes).
  template <typename Shape>
  Tensor alloc_dynamic(const Shape &shape, ofl_dtype_t dtype,
                       ofl_stream_t *stream = nullptr) {
    ofl_tensor_t *t = nullptr;
    check(ofl_pool_alloc_dynamic(get(), std::data(shape),
                                 detail::ndim_of(shape), dtype, stream, &t),
          "ofl_pool_alloc_dynamic");
    return Tensor(t);
  }
  ofl_pool_stats_t stats() const {
    ofl_pool_stats_t s{};
    ofl_pool_get_stats(get(), &s);
    return s;
  }
};

// A comm for the summary gather: one rank, MPI (an MPI_Comm *, duplicated)
// or NCCL (a ncclComm_t * and a cudaStream_t, not owned).
class Comm : public Handle<ofl_comm_t, ofl_comm_destroy> {
public:
  using Handle::Handle;
  static Comm self(const ofl_comm_params_t *params = nullptr) {
    ofl_comm_t *c = nullptr;
    check(ofl_comm_create_self(params, &c), "ofl_comm_create_self");
    return Comm(c);
  }
  static Comm mpi(const void *mpi_comm, const ofl_comm_params_t *params = nullptr) {
    ofl_comm_t *c = nullptr;
    check(ofl_comm_create_mpi_handle(mpi_comm, params, &c),
          "ofl_comm_create_mpi");
    return Comm(c);
  }
  static Comm nccl(const void *nccl_comm, void *cuda_stream,
                   const ofl_comm_params_t *params = nullptr) {
    ofl_comm_t *c = nullptr;
    check(ofl_comm_create_nccl_handle(nccl_comm, cuda_stream, params, &c),
          "ofl_comm_create_nccl");
    return Comm(c);
  }
  int rank() const { return ofl_comm_rank(get()); }
  int size() const { return ofl_comm_size(get()); }
  ofl_comm_kind_t kind() const { return ofl_comm_kind(get()); }
  bool is_broken() const { return ofl_comm_is_broken(get()) != 0; }
  void barrier() { check(ofl_comm_barrier(get()), "ofl_comm_barrier"); }
};

// The disk tier store (one private file in OFL_DISK_DIR).
class Disk : public Handle<ofl_disk_t, ofl_disk_close> {
public:
  explicit Disk(const ofl_disk_params_t &params) {
    ofl_disk_t *d = nullptr;
    check(ofl_disk_open(&params, &d), "ofl_disk_open");
    *static_cast<Handle *>(this) = Handle(d);
  }
  // A store on dev with every other setting from the environment.
  explicit Disk(ofl_device_t *dev) {
    ofl_disk_params_t p = OFL_DISK_PARAMS_INIT;
    p.dev = dev;
    ofl_disk_t *d = nullptr;
    check(ofl_disk_open(&p, &d), "ofl_disk_open");
    *static_cast<Handle *>(this) = Handle(d);
  }
  ofl_disk_stats_t stats() const {
    ofl_disk_stats_t s{};
    ofl_disk_get_stats(get(), &s);
    return s;
  }
  std::string dir() const { return ofl_disk_dir(get()); }
  bool is_degraded() const { return ofl_disk_is_degraded(get()) != 0; }
  size_t drop_kept() { return ofl_disk_drop_kept(get()); }
};

// A staged set (host copies of a state dict) and a background save.
class Staged : public Handle<ofl_staged_t, ofl_staged_release> {
public:
  using Handle::Handle;
  size_t count() const { return ofl_staged_count(get()); }
  const ofl_tensor_t *find(const std::string &name) const {
    return ofl_staged_find(get(), name.c_str());
  }
  ofl_status_t status() const { return ofl_staged_status(get()); }
};

class SaveFuture : public Handle<ofl_save_future_t, ofl_save_release> {
public:
  using Handle::Handle;
  // Waits for the save; throws its error (or the timeout).
  void wait(int64_t timeout_ms = OFL_TIMEOUT_DEFAULT) {
    check(ofl_save_wait(get(), timeout_ms), "ofl_save_wait");
  }
  bool done() const { return ofl_save_query(get()) != OFL_ERR_NOT_READY; }
  uint64_t bytes() const { return ofl_save_bytes(get()); }
};

// Async checkpoint staging into a (cached, pinned) host copy, and saves of
// staged sets to .safetensors on a background thread.
class Stager : public Handle<ofl_stager_t, detail::destroy_stager> {
public:
  explicit Stager(ofl_device_t *dev, const ofl_stager_params_t *params = nullptr) {
    ofl_stager_t *s = nullptr;
    check(ofl_stager_create(dev, params, &s), "ofl_stager_create");
    *static_cast<Handle *>(this) = Handle(s);
  }
  Staged stage(const std::vector<ofl_named_tensor_t> &tensors) {
    ofl_staged_t *set = nullptr;
    check(ofl_stager_stage(get(), tensors.data(), tensors.size(), &set),
          "ofl_stager_stage");
    return Staged(set);
  }
  void synchronize(int64_t timeout_ms = OFL_TIMEOUT_DEFAULT) {
    check(ofl_stager_synchronize(get(), timeout_ms), "ofl_stager_synchronize");
  }
  SaveFuture save(const Staged &set, const std::string &path,
                  const std::vector<ofl_safetensors_kv_t> &metadata = {}) {
    ofl_save_future_t *f = nullptr;
    check(ofl_stager_save(get(), set.get(), path.c_str(),
                          metadata.empty() ? nullptr : metadata.data(),
                          metadata.size(), &f),
          "ofl_stager_save");
    return SaveFuture(f);
  }
  ofl_stager_stats_t stats() const {
    ofl_stager_stats_t s{};
    ofl_stager_get_stats(get(), &s);
    return s;
  }
};

class Manager : public Handle<ofl_manager_t, ofl_manager_destroy> {
public:
  explicit Manager(const ofl_manager_params_t *params = nullptr) {
    ofl_manager_t *m = nullptr;
    check(ofl_manager_create(params, &m), "ofl_manager_create");
    *static_cast<Handle *>(this) = Handle(m);
  }
  void chunk_begin(int vp_size, int vp_stage) {
    check(ofl_manager_chunk_begin(get(), vp_size, vp_stage),
          "ofl_manager_chunk_begin");
  }
  void reset() { check(ofl_manager_reset(get()), "ofl_manager_reset"); }
  bool is_warmup() const { return ofl_manager_is_warmup(get()) != 0; }
  uint64_t summary_total_bytes() const {
    return ofl_manager_summary_total_bytes(get());
  }
  ofl_manager_stats_t stats() const {
    ofl_manager_stats_t s{};
    ofl_manager_get_stats(get(), &s);
    return s;
  }
  // The summary gathered at the end of warmup (nullptr before); owned by
  // the manager.
  const ofl_summary_t *summary() const { return ofl_manager_summary(get()); }
  uint64_t summary_bytes(const std::string &group) const {
    uint64_t b = 0;
    check(ofl_manager_summary_bytes(get(), group.c_str(), &b),
          "ofl_manager_summary_bytes");
    return b;
  }
  // Evaluation passes: no chunks, no end of warmup (see ForwardOnly).
  void set_forward_only(bool on) { ofl_manager_set_forward_only(get(), on ? 1 : 0); }
  void enable_offload() { ofl_manager_enable_offload(get()); }
  void disable_offload() { ofl_manager_disable_offload(get()); }
  void synchronize(int64_t timeout_ms = OFL_TIMEOUT_DEFAULT) {
    check(ofl_manager_synchronize(get(), timeout_ms), "ofl_manager_synchronize");
  }
};

// A forward-only pass for the scope's duration (on in the constructor, off
// in the destructor, also when an exception leaves the scope).
class ForwardOnly {
public:
  explicit ForwardOnly(Manager &m) : m_(m.get()) {
    ofl_manager_set_forward_only(m_, 1);
  }
  ForwardOnly(const ForwardOnly &) = delete;
  ForwardOnly &operator=(const ForwardOnly &) = delete;
  ~ForwardOnly() { ofl_manager_set_forward_only(m_, 0); }

private:
  ofl_manager_t *m_;
};

// Forward of one module call: group_start in the constructor; commit() ends
// it. A group left normally without commit is committed by the destructor,
// which cannot throw: call commit() to see errors.
//
// A group left by an exception (stack unwinding) is abandoned, not
// committed: its tensors were pushed for a forward that did not finish, and
// committing would start copies of them. The C API has no abandon call, so
// the destructor leaves the group open and logs a WARN naming it; the
// manager then refuses reset (OFL_ERR_INVALID_USAGE) and the iteration
// cannot go on: destroy the Manager (its tensors are freed with it) and
// create a new one.
class Group {
public:
  Group(Manager &m, std::string name)
      : m_(m.get()), name_(std::move(name)),
        uncaught_(std::uncaught_exceptions()) {
    check(ofl_manager_group_start(m_, name_.c_str()), "ofl_manager_group_start");
  }
  Group(const Group &) = delete;
  Group &operator=(const Group &) = delete;
  ~Group() {
    if (done_)
      return;
    if (std::uncaught_exceptions() > uncaught_) {
      detail::warn("group " + name_ +
                   " abandoned by an exception: not committed, left open; "
                   "destroy the manager before the next iteration");
      return;
    }
    (void)ofl_manager_group_commit(m_, name_.c_str(), nullptr, 0, 0);
  }
  // Whether the group was ended (commit() called).
  bool committed() const noexcept { return done_; }
  // Hands t to the manager; the tag gives it back in backward.
  ofl_tag_t push(Tensor &&t) {
    ofl_tag_t tag = OFL_TAG_INVALID;
    check(ofl_manager_tensor_push(m_, t.get(), &tag), "ofl_manager_tensor_push");
    t.release();
    return tag;
  }
  void commit(std::initializer_list<ofl_tensor_t *> forced = {}, bool delay = false) {
    std::vector<ofl_tensor_t *> f(forced);
    done_ = true;
    check(ofl_manager_group_commit(m_, name_.c_str(), f.data(), f.size(),
                                   delay ? 1 : 0),
          "ofl_manager_group_commit");
  }

private:
  ofl_manager_t *m_;
  std::string name_;
  int uncaught_;
  bool done_ = false;
};

// Backward of one module call: backward_begin in the constructor,
// backward_end in end() or the destructor.
class Backward {
public:
  Backward(Manager &m, std::string name) : m_(m.get()), name_(std::move(name)) {
    check(ofl_manager_group_backward_begin(m_, name_.c_str()),
          "ofl_manager_group_backward_begin");
  }
  Backward(const Backward &) = delete;
  Backward &operator=(const Backward &) = delete;
  ~Backward() {
    if (!done_)
      (void)ofl_manager_group_backward_end(m_, name_.c_str());
  }
  Tensor pop(ofl_tag_t tag) {
    ofl_tensor_t *t = nullptr;
    check(ofl_manager_tensor_pop(m_, tag, &t), "ofl_manager_tensor_pop");
    return Tensor(t);
  }
  void end() {
    done_ = true;
    check(ofl_manager_group_backward_end(m_, name_.c_str()),
          "ofl_manager_group_backward_end");
  }

private:
  ofl_manager_t *m_;
  std::string name_;
  bool done_ = false;
};

} // namespace ofl

#endif // OFL_OFL_HPP
