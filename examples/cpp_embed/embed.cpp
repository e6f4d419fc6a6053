// ofl C++ example: how a C++ pipeline embeds ofl through <ofl/ofl.hpp>.
// One pipeline stage, a few microbatches of a two-layer model whose modules
// save activations; forward pushes them inside group scopes, backward pops
// them inside backward scopes and checks every byte. Several iterations:
// the first is the warmup, the rest replay it. Exit status 0 on success.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include <ofl/manager.h>
#include <ofl/ofl.hpp>
#include <ofl/pool.h>

namespace {

constexpr int kMicrobatches = 3;
constexpr int kLayers = 2;
constexpr int kIterations = 3;
const char *const kModules[] = {"core_attn", "expert_fc1"};

// The bytes module m of layer l saves for microbatch mb: a pattern the
// backward can check without keeping a copy.
uint8_t pattern(int it, int mb, int l, int m, int k, size_t i) {
  return static_cast<uint8_t>(i * 131u + static_cast<size_t>(it * 7 + mb * 5 +
                                                             l * 3 + m + k * 11));
}

struct Saved {
  ofl_tag_t tag[2];
};

} // namespace

int main() {
  try {
    ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
    dp.backend = OFL_BACKEND_HOST;
    ofl::Device dev(&dp);
    ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT;
    pp.kind = OFL_POOL_DEVICE;
    pp.budget_bytes = 0;
    ofl::Pool pool(dev.get(), &pp);

    ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT;
    mp.device = dev.get();
    mp.device_pool = pool.get();
    mp.min_offload_bytes = 1024;
    mp.groups = "";
    ofl::Manager mgr(&mp);

    size_t wrong = 0, checked = 0;
    for (int it = 0; it < kIterations; it++) {
      std::map<int, std::vector<Saved>> saved; // microbatch -> layer x module
      // 1F1B on a single stage: forward of a microbatch, then its backward.
      for (int mb = 0; mb < kMicrobatches; mb++) {
        mgr.chunk_begin(1, 0);
        for (int l = 0; l < kLayers; l++)
          for (int m = 0; m < 2; m++) {
            ofl::Group g(mgr, kModules[m]);
            Saved s{};
            for (int k = 0; k < 2; k++) {
              ofl::Tensor t = pool.alloc({64, 32}, OFL_DTYPE_F32);
              auto *p = t.data_as<uint8_t>();
              for (size_t i = 0; i < t.bytes(); i++)
                p[i] = pattern(it, mb, l, m, k, i);
              s.tag[k] = g.push(std::move(t));
            }
            g.commit();
            saved[mb].push_back(s);
          }
        for (int l = kLayers - 1; l >= 0; l--)
          for (int m = 1; m >= 0; m--) {
            ofl::Backward b(mgr, kModules[m]);
            const Saved &s = saved[mb][static_cast<size_t>(l * 2 + m)];
            for (int k = 1; k >= 0; k--) {
              ofl::Tensor t = b.pop(s.tag[k]);
              const auto *p = t.data_as<const uint8_t>();
              for (size_t i = 0; i < t.bytes(); i++, checked++)
                wrong += p[i] != pattern(it, mb, l, m, k, i);
            }
            b.end();
          }
      }
      mgr.reset();
      ofl_manager_stats_t st = mgr.stats();
      std::printf("iteration %d%s: offloaded %llu bytes, reloaded %llu bytes, "
                  "wrong bytes so far %zu of %zu\n",
                  it + 1, it == 0 ? " (warmup)" : "",
                  static_cast<unsigned long long>(st.offloaded_bytes),
                  static_cast<unsigned long long>(st.reloaded_bytes), wrong,
                  checked);
    }
    uint64_t summary = mgr.summary_total_bytes();
    ofl_manager_stats_t st = mgr.stats();
    std::printf("summary bytes %llu; %s\n",
                static_cast<unsigned long long>(summary),
                wrong == 0 ? "every popped byte matches" : "WRONG BYTES");
    // Misuse surfaces as an exception with the library's message.
    bool threw = false;
    try {
      ofl::Backward b(mgr, "never_offloaded");
    } catch (const ofl::Error &e) {
      threw = true;
      std::printf("misuse reported: %s\n", e.what());
    }
    return wrong == 0 && checked > 0 && st.offloaded_bytes > 0 && threw ? 0 : 1;
  } catch (const ofl::Error &e) {
    std::fprintf(stderr, "ofl error: %s\n", e.what());
    return 1;
  }
}
