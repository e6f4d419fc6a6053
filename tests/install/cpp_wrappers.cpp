// The C++ wrappers of <ofl/ofl.hpp> beyond the example: Comm, Disk, Stager,
// Pool::stats and runtime shapes, Manager::summary, forward-only and
// enable/disable switches, and a Group left by an exception, which must be
// abandoned (not committed) and say so. Host backend; TAP output.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include <ofl/ofl.h>
#include <ofl/ofl.hpp>

namespace {

int tests = 0, failed = 0;

void tap(bool ok, const std::string &what) {
  ++tests;
  if (!ok)
    ++failed;
  std::printf("%s %d - %s\n", ok ? "ok" : "not ok", tests, what.c_str());
}

// Runs one forward and backward of two layers, each a call of `group` with
// one tensor of `shape`, the bytes checked after the pops. The policy keeps
// the call of a name that runs backward first (layer 1) on the device:
// layer 0's is offloaded.
bool one_step(ofl::Manager &mgr, ofl::Pool &pool, const char *group,
              const std::vector<int64_t> &shape) {
  const char *names[2] = {group, group};
  ofl_tag_t tags[2] = {OFL_TAG_INVALID, OFL_TAG_INVALID};
  mgr.chunk_begin(1, 0);
  for (int i = 0; i < 2; i++) {
    ofl::Group g(mgr, names[i]);
    ofl::Tensor t = pool.alloc(shape, OFL_DTYPE_F32);
    std::memset(t.data(), 0x5a + i, t.bytes());
    tags[i] = g.push(std::move(t));
    g.commit();
  }
  bool good = true;
  for (int i = 1; i >= 0; i--) {
    ofl::Backward b(mgr, names[i]);
    ofl::Tensor t = b.pop(tags[i]);
    const auto *p = t.data_as<const unsigned char>();
    for (size_t k = 0; k < t.bytes(); k++)
      good = good && p[k] == 0x5a + i;
    b.end();
  }
  mgr.reset();
  return good;
}

// What `fn` writes to stderr (the wrappers' WARN lines).
template <typename Fn> std::string capture_stderr(Fn fn) {
  std::fflush(stderr);
  char path[] = "/tmp/ofl-cpp-stderr-XXXXXX";
  int fd = mkstemp(path);
  int saved = dup(2);
  dup2(fd, 2);
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::string out;
  char buf[4096];
  lseek(fd, 0, SEEK_SET);
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0)
    out.append(buf, static_cast<size_t>(n));
  close(fd);
  unlink(path);
  return out;
}

} // namespace

int main() {
  std::printf("TAP version 13\n");
  try {
    ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
    dp.backend = OFL_BACKEND_HOST;
    ofl::Device dev(&dp);
    ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
    pp.budget_bytes = 0;
    ofl::Pool pool(dev.get(), &pp);

    // Shapes from a runtime container.
    std::vector<int64_t> shape{64, 32};
    {
      ofl::Tensor t = pool.alloc(shape, OFL_DTYPE_F32);
      tap(t.bytes() == 64 * 32 * 4 && t.nelem() == 64 * 32,
          "Pool::alloc takes a std::vector<int64_t> shape");
      ofl_pool_stats_t s = pool.stats();
      tap(s.in_use_bytes >= t.bytes() && s.blocks_in_use >= 1,
          "Pool::stats counts the block in use");
    }

    ofl::Comm comm = ofl::Comm::self();
    comm.barrier();
    tap(comm.rank() == 0 && comm.size() == 1 && comm.kind() == OFL_COMM_SELF &&
            !comm.is_broken(),
        "Comm::self: rank 0 of 1, barrier");

    ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
    mp.device = dev.get();
    mp.device_pool = pool.get();
    mp.min_offload_bytes = 1024;
    mp.groups = "";
    mp.comm = comm.get();
    ofl::Manager mgr(&mp);
    tap(mgr.summary() == nullptr, "no summary before the end of warmup");
    bool good = one_step(mgr, pool, "attn_norm", shape);
    good = one_step(mgr, pool, "attn_norm", shape) && good;
    tap(good && !mgr.is_warmup(), "two iterations, bytes intact");
    const ofl_summary_t *sum = mgr.summary();
    tap(sum != nullptr && ofl_summary_nranks(sum) == 1 &&
            mgr.summary_bytes("attn_norm") == 64 * 32 * 4 &&
            mgr.summary_bytes("core_attn") == 0,
        "Manager::summary and summary_bytes after warmup");

    uint64_t before = mgr.stats().offloaded_bytes;
    {
      ofl::ForwardOnly fwd(mgr);
      ofl::Group g(mgr, "core_attn");
      g.push(pool.alloc(shape, OFL_DTYPE_F32));
      g.commit();
    }
    mgr.reset();
    tap(mgr.stats().offloaded_bytes == before && !mgr.is_warmup(),
        "ForwardOnly scope: nothing offloaded, warmup not restarted");
    tap(one_step(mgr, pool, "attn_norm", shape) &&
            mgr.stats().offloaded_bytes > before,
        "training again after the forward-only scope offloads");

    before = mgr.stats().offloaded_bytes;
    mgr.disable_offload();
    bool off_ok = one_step(mgr, pool, "attn_norm", shape);
    tap(off_ok && mgr.stats().offloaded_bytes == before,
        "disable_offload: the step runs, nothing offloaded");
    mgr.enable_offload();
    tap(one_step(mgr, pool, "attn_norm", shape) &&
            mgr.stats().offloaded_bytes > before,
        "enable_offload: offloading again");

    // A group left by an exception: abandoned, not committed, said so.
    {
      ofl_manager_params_t mp2 = mp;
      mp2.comm = nullptr;
      ofl::Manager m2(&mp2);
      bool caught = false;
      bool committed = true;
      std::string err = capture_stderr([&] {
        try {
          m2.chunk_begin(1, 0);
          ofl::Group g(m2, "expert_fc1");
          g.push(pool.alloc(shape, OFL_DTYPE_F32));
          committed = g.committed();
          throw std::runtime_error("model code failed");
        } catch (const std::runtime_error &) {
          caught = true;
        }
      });
      ofl_manager_stats_t s2 = m2.stats();
      tap(caught && !committed && s2.offloaded_bytes == 0 &&
              s2.offloaded_tensors == 0,
          "Group unwound by an exception is not committed");
      tap(err.find("group expert_fc1 abandoned") != std::string::npos,
          "the abandoned group is a WARN line: " +
              err.substr(0, err.find('\n')));
      ofl_status_t st = ofl_manager_reset(m2.get());
      tap(st == OFL_ERR_INVALID_USAGE,
          "the manager refuses reset while the abandoned group is open");
    } // m2 destroyed with the group's tensor

    // Disk: a store from the environment.
    {
      ofl::Disk disk(dev.get());
      ofl_disk_stats_t s = disk.stats();
      tap(!disk.dir().empty() && (s.direct == 0 || s.direct == 1) &&
              !disk.is_degraded(),
          "Disk opens in " + disk.dir() + (s.direct ? " (O_DIRECT)" : " (buffered)") +
              (s.uring ? " io_uring" : " threads"));
    }

    // Stager: stage a state dict and save it as safetensors.
    {
      ofl::Stager stager(dev.get());
      ofl::Tensor w = pool.alloc(std::vector<int64_t>{16, 16}, OFL_DTYPE_F32);
      std::memset(w.data(), 1, w.bytes());
      ofl::Staged set = stager.stage({{"layer0.weight", w.get()}});
      stager.synchronize();
      tap(set.count() == 1 && set.find("layer0.weight") != nullptr &&
              set.status() == OFL_SUCCESS,
          "Stager::stage: one tensor staged");
      char path[] = "/tmp/ofl-cpp-save-XXXXXX";
      int fd = mkstemp(path);
      close(fd);
      ofl::SaveFuture f = stager.save(set, path);
      f.wait();
      tap(f.done() && f.bytes() > w.bytes() && stager.stats().saves_completed == 1,
          "Stager::save writes the safetensors file");
      unlink(path);
    }

    // Errors are exceptions with the library's message.
    bool threw = false;
    try {
      ofl_disk_params_t bad = OFL_DISK_PARAMS_INIT;
      ofl::Disk d(bad); // no device
    } catch (const ofl::Error &e) {
      threw = e.status() == OFL_ERR_INVALID_ARG;
    }
    tap(threw, "Disk without a device throws ofl::Error(OFL_ERR_INVALID_ARG)");
  } catch (const ofl::Error &e) {
    tap(false, std::string("unexpected ofl::Error: ") + e.what());
  }
  std::printf("1..%d\n", tests);
  return failed == 0 ? 0 : 1;
}
