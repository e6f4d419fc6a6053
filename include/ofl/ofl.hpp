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
#ifndef OFL_OFL_HPP
#define OFL_OFL_HPP

#include <initializer_list>
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
  Tensor alloc(std::initializer_list<int64_t> shape, ofl_dtype_t dtype,
               ofl_stream_t *stream = nullptr) {
    std::vector<int64_t> s(shape);
    ofl_tensor_t *t = nullptr;
    check(ofl_pool_alloc(get(), s.data(), static_cast<int>(s.size()), dtype,
                         stream, &t),
          "ofl_pool_alloc");
    return Tensor(t);
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
};

// Forward of one module call: group_start in the constructor; commit() ends
// it (a group left without commit is committed by the destructor, which
// cannot throw: call commit() to see errors).
class Group {
public:
  Group(Manager &m, std::string name) : m_(m.get()), name_(std::move(name)) {
    check(ofl_manager_group_start(m_, name_.c_str()), "ofl_manager_group_start");
  }
  Group(const Group &) = delete;
  Group &operator=(const Group &) = delete;
  ~Group() {
    if (!done_)
      (void)ofl_manager_group_commit(m_, name_.c_str(), nullptr, 0, 0);
  }
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
