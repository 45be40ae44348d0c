// autograder/10_moe/bench_moe.cu — module 10's benchmarks at the module's shape (16384 tokens,
// hidden 2048, 64 experts of width 1408, top-6, shared experts 2816 wide):
//   BM_moe/grouped/<up|down>/<uniform|skewed>      the grouped GEMM, one launch
//   BM_moe/hopper/<up|down>/<uniform|skewed>       Part B's wgmma version (where supported)
//   BM_moe/cublas_loop/<up|down>/<uniform|skewed>  cuBLAS once per expert on the same data
//   BM_moe/layer/<forward|forward_backward>        module 10's layer
//   BM_moe/naive/forward_backward                  the naive layer (k2c/reference/moe_baseline.h)
// Loads: every token picks 6 distinct experts, uniformly or with weight 1 / (e + 1).
#include <numeric>
#include <string>
#include <vector>

#include "k2c/reference/ceilings.h"
#include "k2c/reference/moe_baseline.h"
#include "k2c/testing/bench.h"
#include "moe.h"

namespace moe = k2c::moe;
using moe::bf16;

namespace {

constexpr int kTokens = 16384, kHidden = 2048, kExperts = 64, kFfn = 1408, kTopK = 6, kSharedFfn = 2816;

std::vector<int> loads(bool skewed) { return k2c::baseline::expert_loads(kTokens, kExperts, kTopK, skewed, skewed ? 2 : 1); }

void register_gemms() {
  for (bool up : {true, false})
    for (bool skewed : {false, true}) {
      const std::string suffix = std::string(up ? "/up" : "/down") + (skewed ? "/skewed" : "/uniform");
      for (const std::string variant : {"grouped", "hopper", "cublas_loop"}) {
        if (variant == "hopper" && !moe::hopper_supported()) continue;
        k2c::bench::add("BM_moe/" + variant + suffix, [=](benchmark::State& state) {
          const std::vector<int> counts = loads(skewed);
          std::vector<int> off(kExperts + 1, 0);
          std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
          const int rows = off.back(), n = up ? 2 * kFfn : kHidden, k = up ? kHidden : kFfn;
          k2c::DeviceBuffer<bf16> a(static_cast<std::size_t>(rows) * k), b(static_cast<std::size_t>(kExperts) * n * k),
              c(static_cast<std::size_t>(rows) * n);
          k2c::fill_uniform_device(a.data(), a.size(), 1);
          k2c::fill_uniform_device(b.data(), b.size(), 2);
          k2c::DeviceBuffer<int> d_off{std::span<const int>(off)};
          const double flops = 2.0 * rows * static_cast<double>(n) * k;
          k2c::bench::run(state, [&] {
            if (variant == "grouped") {
              moe::grouped_gemm(kExperts, d_off.data(), n, k, a.data(), b.data(), c.data());
            } else if (variant == "hopper") {
              moe::grouped_gemm_hopper(kExperts, d_off.data(), rows, n, k, a.data(), b.data(), c.data());
            } else {
              for (int e = 0; e < kExperts; ++e)
                if (counts[e] > 0)
                  k2c::cublas_bf16_gemm(counts[e], n, k, a.data() + static_cast<std::size_t>(off[e]) * k,
                                        b.data() + static_cast<std::size_t>(e) * n * k,
                                        c.data() + static_cast<std::size_t>(off[e]) * n);
            }
          }, flops, 0);
        })->Iterations(20);
      }
    }
}

// Weights and inputs for the layer benchmarks, on the device.
struct LayerData {
  k2c::DeviceBuffer<bf16> x, dy, w_router, w13, w2, sw13, sw2, y, dx;
  LayerData()
      : x(static_cast<std::size_t>(kTokens) * kHidden), dy(x.size()), w_router(static_cast<std::size_t>(kExperts) * kHidden),
        w13(static_cast<std::size_t>(kExperts) * 2 * kFfn * kHidden), w2(static_cast<std::size_t>(kExperts) * kHidden * kFfn),
        sw13(static_cast<std::size_t>(2) * kSharedFfn * kHidden), sw2(static_cast<std::size_t>(kHidden) * kSharedFfn),
        y(x.size()), dx(x.size()) {
    k2c::fill_uniform_device(x.data(), x.size(), 3);
    k2c::fill_uniform_device(dy.data(), dy.size(), 4);
    k2c::fill_uniform_device(w_router.data(), w_router.size(), 5, -0.1f, 0.1f);
    k2c::fill_uniform_device(w13.data(), w13.size(), 6, -0.066f, 0.066f);
    k2c::fill_uniform_device(w2.data(), w2.size(), 7, -0.08f, 0.08f);
    k2c::fill_uniform_device(sw13.data(), sw13.size(), 8, -0.066f, 0.066f);
    k2c::fill_uniform_device(sw2.data(), sw2.size(), 9, -0.056f, 0.056f);
  }
};

// Routed experts 6·(T·k)·d·f and shared experts 6·T·d·sf per forward pass; backward twice that.
constexpr double kForwardFlops = 6.0 * kTokens * kTopK * static_cast<double>(kHidden) * kFfn +
                                 6.0 * kTokens * static_cast<double>(kHidden) * kSharedFfn;

void register_layers() {
  for (bool with_backward : {false, true})
    k2c::bench::add(std::string("BM_moe/layer/") + (with_backward ? "forward_backward" : "forward"),
                    [=](benchmark::State& state) {
      LayerData L;
      const moe::RouterConfig c{kExperts, kTopK, moe::Score::softmax, 1, 1, false, 1.0f};
      const moe::Layer layer{c, kHidden, kFfn, kSharedFfn, -1, L.w_router.data(), nullptr, L.w13.data(), L.w2.data(),
                             L.sw13.data(), L.sw2.data()};
      k2c::DeviceBuffer<float> logits(static_cast<std::size_t>(kTokens) * kExperts), scores(logits.size()),
          weight(static_cast<std::size_t>(kTokens) * kTopK), gr(L.w_router.size()), g13(L.w13.size()), g2(L.w2.size()),
          gs13(L.sw13.size()), gs2(L.sw2.size());
      k2c::DeviceBuffer<int> expert(static_cast<std::size_t>(kTokens) * kTopK), counts(kExperts);
      k2c::DeviceBuffer<char> saved(moe::forward_workspace_bytes(layer, kTokens)),
          work(moe::backward_workspace_bytes(layer, kTokens));
      const moe::Routing r{logits.data(), scores.data(), expert.data(), weight.data(), counts.data()};
      const moe::Grads g{gr.data(), g13.data(), g2.data(), gs13.data(), gs2.data()};
      k2c::bench::run(state, [&] {
        moe::forward(layer, kTokens, L.x.data(), L.y.data(), r, saved.data());
        if (with_backward)
          moe::backward(layer, kTokens, L.x.data(), L.dy.data(), r, saved.data(), nullptr, L.dx.data(), g, work.data());
      }, with_backward ? 3 * kForwardFlops : kForwardFlops, 0);
    })->Iterations(10);
  k2c::bench::add("BM_moe/naive/forward_backward", [](benchmark::State& state) {
    LayerData L;
    k2c::baseline::NaiveMoe naive({kTokens, kHidden, kFfn, kSharedFfn, kExperts, kTopK, L.x.data(), L.dy.data(),
                                   L.w_router.data(), L.w13.data(), L.w2.data(), L.sw13.data(), L.sw2.data()});
    k2c::bench::run(state, [&] { naive.step(); }, 3 * kForwardFlops, 0);
  })->Iterations(3);
}

void register_all() {
  register_gemms();
  register_layers();
}

}  // namespace

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
