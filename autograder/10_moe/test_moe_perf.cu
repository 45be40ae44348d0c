// autograder/10_moe/test_moe_perf.cu — tests of module 10 (contract: moe.h), continued: the speed
// tests and Part B (bonus), the Hopper wgmma grouped GEMMs, checked as Part A's are (moe_testing.h;
// tolerances at the top of test_moe.cu) and skipped with the reason where they cannot run.
//
// Speed: the grouped GEMM at the module's DeepSeek-like shape against one dense cuBLAS GEMM of the
// same total size, interleaved in the same run (the per-expert cuBLAS loop reported beside it):
// Part B's wgmma kernel where it runs and is implemented (what the layer's forward pass would
// use), else grouped_gemm(), and grouped_gemm() alone as a recorded figure; and the whole layer's
// forward plus backward against a naive layer in the same run (k2c/reference/moe_baseline.h: a
// launch per expert for every step, an unfused router, scatter-adds).
#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"
#include "k2c/reference/moe_baseline.h"
#include "moe_testing.h"
#include "k2c/testing/witness.h"

using namespace k2c::moe_testing;  // moe::, bf16, seed_for, the buffers and the GEMM checks

namespace {

// The module's shape (DeepSeek-V2-Lite's layer): 16384 tokens, hidden 2048, 64 routed experts of
// width 1408, top-6, 2 shared experts (2816 wide together), softmax scores.
constexpr int kTokens = 16384, kHidden = 2048, kExperts = 64, kFfn = 1408, kTopK = 6, kSharedFfn = 2816;

// Loads: every token picks k distinct experts, uniformly or skewed (expert e drawn with weight
// 1 / (e + 1), a Zipf law: with six distinct picks per token the busiest expert gets about 8.5×
// the mean).
std::vector<int> expert_loads(bool skewed, std::uint64_t seed) {
  return k2c::baseline::expert_loads(kTokens, kExperts, kTopK, skewed, seed);
}

void record_loads(const std::vector<int>& counts) {
  const double mean = std::accumulate(counts.begin(), counts.end(), 0.0) / counts.size();
  const int max = *std::max_element(counts.begin(), counts.end());
  ::testing::Test::RecordProperty("load_imbalance_max_over_mean", std::to_string(max / mean));
}

// The grouped GEMM against its ideal, one dense cuBLAS GEMM of the same 2·rows·n·k FLOPs (M = the
// routed rows, same n, k, bf16 in and out, fp32 accumulation), which reads one n × k weight, not
// 64 (0.74 GB for the up projection, some 0.15 ms at HBM rate to hide), and has no ragged last
// tiles (lecture section 7.3). cuBLAS once per expert, the loop a grouped GEMM replaces, is
// reported, not graded: it sags under sustained load more than one kernel (section 11). The three
// run interleaved, `repeats` each. which: the up projection ([g|u] = x W13ᵀ: n = 2·1408, k = 2048)
// or the down one (n = 2048, k = 1408). The grouped output is checked against the loop's.
void expect_grouped_rate(bool up, bool skewed, int repeats, bool hopper = false) {
  const std::vector<int> counts = expert_loads(skewed, seed_for(skewed ? "skewed loads" : "uniform loads"));
  record_loads(counts);
  const std::vector<int> off = offsets_of(counts);
  const int rows = off.back(), n = up ? 2 * kFfn : kHidden, k = up ? kHidden : kFfn;
  const std::size_t a_elems = static_cast<std::size_t>(rows) * k, b_elems = static_cast<std::size_t>(kExperts) * n * k,
                    c_elems = static_cast<std::size_t>(rows) * n;
  k2c::DeviceBuffer<bf16> a(a_elems), b(b_elems), c(c_elems), c_loop(c_elems), c_dense(c_elems);
  k2c::fill_uniform_device(a.data(), a_elems, seed_for("perf a"));
  k2c::fill_uniform_device(b.data(), b_elems, seed_for("perf b"));
  auto d_off = upload(off);
  auto grouped = [&] {
    if (hopper) moe::grouped_gemm_hopper(kExperts, d_off.data(), rows, n, k, a.data(), b.data(), c.data());
    else moe::grouped_gemm(kExperts, d_off.data(), n, k, a.data(), b.data(), c.data());
  };
  // Every row against expert 0's weight: the product means nothing, only its time is used.
  auto dense = [&] { k2c::cublas_bf16_gemm(rows, n, k, a.data(), b.data(), c_dense.data()); };
  auto loop = [&] {
    for (int e = 0; e < kExperts; ++e)
      if (counts[e] > 0)
        k2c::cublas_bf16_gemm(counts[e], n, k, a.data() + static_cast<std::size_t>(off[e]) * k,
                              b.data() + static_cast<std::size_t>(e) * n * k, c_loop.data() + static_cast<std::size_t>(off[e]) * n);
  };
  c.poison();
  const std::vector<k2c::Timing> t = k2c::time_gpu_interleaved({grouped, dense, loop}, {.warmup = 1, .repeats = repeats});
  const double grouped_ms = t[0].median_ms, dense_ms = t[1].median_ms, loop_ms = t[2].median_ms;
  // Spot checks of the timed runs' output against cuBLAS's (both bf16 roundings of one sum).
  const std::vector<float> got = k2c::to_host(c), want = k2c::to_host(c_loop);
  std::mt19937_64 rng(std::random_device{}());
  std::size_t bad = 0;
  for (int i = 0; i < 4096; ++i) {
    const std::size_t at = rng() % got.size();
    if (!(std::abs(got[at] - want[at]) <= 0x1p-7 * std::abs(want[at]) + 1e-2)) ++bad;
  }
  EXPECT_EQ(bad, 0u) << "grouped GEMM output differs from cuBLAS's at sampled elements";
  const double flops = 2.0 * rows * static_cast<double>(n) * k;
  const double rate = flops / grouped_ms * 1e-9, loop_rate = flops / loop_ms * 1e-9;
  ::testing::Test::RecordProperty("ratio_to_cublas_loop", std::to_string(rate / loop_rate));
  std::ostringstream detail;
  detail.precision(4);
  detail << (hopper ? "wgmma, " : "") << (up ? "up" : "down") << " projection, " << (skewed ? "skewed" : "uniform")
         << " loads, " << repeats << " runs of each, interleaved; cuBLAS per-expert loop (reported, not graded) "
         << loop_rate << " TFLOP/s, ratio " << rate / loop_rate;
  K2C_EXPECT_PERF(rate, flops / dense_ms * 1e-9, detail.str());
}

// The grouped GEMM the layer's forward pass would use: Part B's where this build and device run
// it and it is implemented, grouped_gemm() otherwise.
bool use_hopper() {
  if (!moe::hopper_supported()) return false;
  k2c::DeviceBuffer<bf16> buf(64 * 8);
  auto off = upload(std::vector<int>{0, 8});
  try {
    moe::grouped_gemm_hopper(1, off.data(), 8, 8, 8, buf.data(), buf.data(), buf.data());
  } catch (const k2c::NotImplemented&) {
    return false;
  }
  return cudaDeviceSynchronize() == cudaSuccess;
}

}  // namespace

// The grader's own run of the timed up projection (k2c/testing/witness.h), on its buffers, with the
// kernel the test times.
K2C_WITNESS(moe_up_projection) {
  static const bool hopper = use_hopper();
  if (hopper)
    moe::grouped_gemm_hopper(w.dim(0), w.at<int>(2), w.dim(1), w.dim(2), w.dim(3), w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(3));
  else
    moe::grouped_gemm(w.dim(0), w.at<int>(2), w.dim(2), w.dim(3), w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(3));
}

TEST(MoeGroupedPerf, UpProjection) {
  K2C_REQUIRE_TIMING();
  expect_grouped_rate(true, false, 40, use_hopper());
}

// Recorded for the reference table.
TEST(MoeGroupedPerf, DownProjection) {
  K2C_REQUIRE_TIMING();
  expect_grouped_rate(false, false, 40, use_hopper());
}

TEST(MoeGroupedPerf, SkewedLoads) {
  K2C_REQUIRE_TIMING();
  expect_grouped_rate(true, true, 20, use_hopper());
}

// grouped_gemm() itself, the kernel every GPU runs.
TEST(MoeGroupedPerf, PortableUpProjection) {
  K2C_REQUIRE_TIMING();
  expect_grouped_rate(true, false, 40, false);
}

// One call of the layer's speed test: inputs, outputs and routing of its own.
struct LayerCall {
  k2c::DeviceBuffer<bf16> x, dy, y, dx;
  k2c::DeviceBuffer<float> logits, scores, weight;
  k2c::DeviceBuffer<int> expert, counts;
};

__global__ void gather_floats(const float* from, const std::size_t* at, int n, float* into) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) into[i] = from[at[i]];
}

// The elements of an fp32 device tensor at the given positions, on the host.
std::vector<float> sample_device(const float* from, const std::vector<std::size_t>& at) {
  if (at.empty()) return {};
  k2c::DeviceBuffer<std::size_t> d_at(at.size());
  d_at.upload(at);
  k2c::DeviceBuffer<float> into(at.size());
  const int n = static_cast<int>(at.size());
  gather_floats<<<(n + 255) / 256, 256>>>(from, d_at.data(), n, into.data());
  K2C_CUDA_CHECK_LAUNCH();
  return into.download();
}

// One call's weight gradients at sampled positions: for each of moe::Grads' five tensors, where
// (drawn after the call, from a seed nobody knew before it) and what the layer had written there.
struct GradSamples {
  std::array<std::vector<std::size_t>, 5> at;
  std::array<std::vector<float>, 5> got;
};

// The layer's forward + backward at the module's shape against the naive layer in the same run.
// Every call, warm-up and timed, gets inputs of its own and outputs of its own, poisoned, and each
// call's outputs are compared with the naive layer's on the same inputs at sampled elements: a layer
// that computed once and skipped the repeats leaves poison behind. The weight gradients, one set of
// buffers for all calls, are read at drawn positions once each call has ended, off the clock, and
// poisoned before the next; each call's samples are compared with the naive layer's in the same
// way. Rate: the layer's FLOPs per second.
TEST(MoeLayerPerf, ForwardBackward) {
  K2C_REQUIRE_TIMING();
  const moe::RouterConfig c{kExperts, kTopK, moe::Score::softmax, 1, 1, false, 1.0f};
  const int T = kTokens, d = kHidden, f = kFfn, sf = kSharedFfn, E = kExperts;
  const std::size_t Td = static_cast<std::size_t>(T) * d;
  // Device-side random data: the host reference is far too slow at this size.
  k2c::DeviceBuffer<bf16> w_router(static_cast<std::size_t>(E) * d), w13(static_cast<std::size_t>(E) * 2 * f * d),
      w2(static_cast<std::size_t>(E) * d * f), sw13(static_cast<std::size_t>(2) * sf * d), sw2(static_cast<std::size_t>(d) * sf);
  k2c::fill_uniform_device(w_router.data(), w_router.size(), seed_for("layer wr"), -0.1f, 0.1f);
  k2c::fill_uniform_device(w13.data(), w13.size(), seed_for("layer w13"), -0.066f, 0.066f);
  k2c::fill_uniform_device(w2.data(), w2.size(), seed_for("layer w2"), -0.08f, 0.08f);
  k2c::fill_uniform_device(sw13.data(), sw13.size(), seed_for("layer sw13"), -0.066f, 0.066f);
  k2c::fill_uniform_device(sw2.data(), sw2.size(), seed_for("layer sw2"), -0.056f, 0.056f);
  k2c::DeviceBuffer<float> g_router(w_router.size()), g13(w13.size()), g2(w2.size()), gs13(sw13.size()), gs2(sw2.size());
  const moe::Layer layer{c, d, f, sf, -1, w_router.data(), nullptr, w13.data(), w2.data(), sw13.data(), sw2.data()};
  k2c::DeviceBuffer<char> saved(moe::forward_workspace_bytes(layer, T)), work(moe::backward_workspace_bytes(layer, T));
  const moe::Grads g{g_router.data(), g13.data(), g2.data(), gs13.data(), gs2.data()};
  k2c::TimingOptions options{.warmup = 1, .repeats = 5};
  const int calls = options.warmup + options.repeats;
  std::vector<LayerCall> set;
  for (int i = 0; i < calls; ++i) {
    const std::size_t Te = static_cast<std::size_t>(T) * E, Tk = static_cast<std::size_t>(T) * kTopK;
    LayerCall& k = set.emplace_back(LayerCall{k2c::DeviceBuffer<bf16>(Td), k2c::DeviceBuffer<bf16>(Td),
                                              k2c::DeviceBuffer<bf16>(Td), k2c::DeviceBuffer<bf16>(Td),
                                              k2c::DeviceBuffer<float>(Te), k2c::DeviceBuffer<float>(Te),
                                              k2c::DeviceBuffer<float>(Tk), k2c::DeviceBuffer<int>(Tk),
                                              k2c::DeviceBuffer<int>(E)});
  }
  // The weight gradients of each call, read after it has ended, then poisoned for the next call.
  const std::array<float*, 5> grad_buffers{g_router.data(), g13.data(), g2.data(), gs13.data(), gs2.data()};
  const std::array<std::size_t, 5> grad_sizes{g_router.size(), g13.size(), g2.size(), gs13.size(), gs2.size()};
  std::vector<GradSamples> grads_of(calls);
  auto read_grads = [&](int i) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::mt19937_64 rng(k2c::testing::unpredictable_seed());
    for (std::size_t b = 0; b < grad_buffers.size(); ++b) {
      auto& at = grads_of[static_cast<std::size_t>(i)].at[b];
      for (int s = 0; s < 4096; ++s) at.push_back(rng() % grad_sizes[b]);
      grads_of[static_cast<std::size_t>(i)].got[b] = sample_device(grad_buffers[b], at);
      K2C_CUDA_CHECK(cudaMemset(grad_buffers[b], 0xFF, grad_sizes[b] * sizeof(float)));
    }
  };
  for (std::size_t b = 0; b < grad_buffers.size(); ++b)
    K2C_CUDA_CHECK(cudaMemset(grad_buffers[b], 0xFF, grad_sizes[b] * sizeof(float)));
  // Each call's x and dy are drawn (from a seed nobody knows in advance) and its y and dx poisoned
  // just before it, off the clock, so no call can be answered in an earlier one; each repeat is
  // timed until the whole device is idle, so work left on a stream of the layer's own counts.
  options.before = [&](std::size_t, int i) {
    if (i > 0) read_grads(i - 1);
    LayerCall& k = set[static_cast<std::size_t>(i)];
    k2c::fill_uniform_device(k.x.data(), Td, k2c::testing::unpredictable_seed());
    k2c::fill_uniform_device(k.dy.data(), Td, k2c::testing::unpredictable_seed());
    k.y.poison();
    k.dx.poison();
  };
  options.whole_device = true;
  int call = 0;
  auto step = [&] {
    LayerCall& k = set[call++ % calls];
    const moe::Routing r{k.logits.data(), k.scores.data(), k.expert.data(), k.weight.data(), k.counts.data()};
    moe::forward(layer, T, k.x.data(), k.y.data(), r, saved.data());
    moe::backward(layer, T, k.x.data(), k.dy.data(), r, saved.data(), nullptr, k.dx.data(), g, work.data());
  };
  const k2c::Timing ours = k2c::time_gpu(step, options);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(call, calls) << "the timing made another number of calls than its options say";
  read_grads(calls - 1);
  record_loads(set.back().counts.download());
  auto naive_for = [&](const LayerCall& k) {
    return std::make_unique<k2c::baseline::NaiveMoe>(k2c::baseline::MoeProblem{
        T, d, f, sf, E, kTopK, k.x.data(), k.dy.data(), w_router.data(), w13.data(), w2.data(), sw13.data(), sw2.data()});
  };
  const auto timed_naive = naive_for(set[0]);
  const k2c::Timing base = k2c::time_gpu([&] { timed_naive->step(); }, {.warmup = 1, .repeats = 3});
  // Each call's y and dx against the naive layer's at sampled elements: two bf16 pipelines of the
  // same sums. The two compute the logits in different orders, so a token at a near tie may choose
  // differently; such tokens (their y and dx depend on their own choice only) are left out, and
  // must be rare.
  for (int i = 0; i < calls; ++i) {
    std::unique_ptr<k2c::baseline::NaiveMoe> naive;
    if (i > 0) (naive = naive_for(set[i]))->step();
    const k2c::baseline::NaiveMoe& theirs_layer = i == 0 ? *timed_naive : *naive;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int> ours_e = set[i].expert.download(), theirs_e = theirs_layer.expert();
    std::vector<bool> same(T, true);
    int differ = 0;
    for (int t = 0; t < T; ++t) {
      std::vector<int> a(ours_e.begin() + t * kTopK, ours_e.begin() + (t + 1) * kTopK);
      std::vector<int> b(theirs_e.begin() + t * kTopK, theirs_e.begin() + (t + 1) * kTopK);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a != b) same[t] = false, ++differ;
    }
    EXPECT_LE(differ, T / 1000) << "call " << i << ": tokens routed differently from the naive layer";
    // The experts a token routed differently went to in either layer: their gradients hold a
    // different set of rows, so their elements are left out of the comparison below.
    std::vector<bool> expert_same(E, true);
    for (int t = 0; t < T; ++t)
      if (!same[t])
        for (int j = 0; j < kTopK; ++j) expert_same[ours_e[t * kTopK + j]] = expert_same[theirs_e[t * kTopK + j]] = false;
    for (auto [what, got, want] :
         {std::tuple{"y", k2c::to_host(set[i].y), theirs_layer.y()}, {"dx", k2c::to_host(set[i].dx), theirs_layer.dx()}}) {
      double sq = 0;
      for (float v : want) sq += static_cast<double>(v) * v;
      const double rms = std::sqrt(sq / want.size());
      std::mt19937_64 rng(seed_for("layer samples " + std::to_string(i)));
      std::size_t bad = 0;
      for (int s = 0; s < 4096; ++s) {
        const std::size_t at = rng() % got.size();
        if (!same[at / d]) continue;
        if (!(std::abs(got[at] - want[at]) <= 0x1p-6 * std::abs(want[at]) + 0x1p-4 * rms)) ++bad;
      }
      EXPECT_EQ(bad, 0u) << "call " << i << " of the timed layer: " << what
                         << " differs from the naive layer's at sampled elements";
    }
    // Its weight gradients at the positions drawn after it: an element of a routed expert's w13
    // or w2 belongs to expert position / (its size per expert).
    const char* names[5] = {"the router's gradient", "w13's gradient", "w2's gradient", "the shared w13's gradient",
                            "the shared w2's gradient"};
    const std::array<const float*, 5> want_grads = theirs_layer.weight_grads();
    for (std::size_t b = 0; b < want_grads.size(); ++b) {
      const GradSamples& gs = grads_of[static_cast<std::size_t>(i)];
      const std::vector<float> want = sample_device(want_grads[b], gs.at[b]);
      double sq = 0;
      for (float v : want) sq += static_cast<double>(v) * v;
      const double rms = std::sqrt(sq / want.size());
      const std::size_t per_expert = grad_sizes[b] / E;
      std::size_t bad = 0;
      for (std::size_t s = 0; s < want.size(); ++s) {
        if ((b == 1 || b == 2) && !expert_same[gs.at[b][s] / per_expert]) continue;
        const float got = gs.got[b][s];
        if (!(std::abs(got - want[s]) <= 0x1p-6 * std::abs(want[s]) + 0x1p-4 * rms)) ++bad;
      }
      EXPECT_EQ(bad, 0u) << "call " << i << " of the timed layer: " << names[b]
                         << " differs from the naive layer's at elements drawn after the call";
    }
  }
  // Routed experts 6·(T·k)·d·f forward plus the shared experts' 6·T·d·sf, three times that with
  // the backward pass; the router's GEMMs are negligible.
  const double flops = 3.0 * (6.0 * T * kTopK * static_cast<double>(d) * f + 6.0 * T * static_cast<double>(d) * sf);
  ::testing::Test::RecordProperty("layer_ms", std::to_string(ours.median_ms));
  ::testing::Test::RecordProperty("naive_ms", std::to_string(base.median_ms));
  K2C_EXPECT_PERF(flops / ours.median_ms * 1e-9, flops / base.median_ms * 1e-9,
                  "forward + backward at T 16384, d 2048, 64 experts of 1408, top-6, shared 2816, vs the naive layer; "
                  "every call with inputs and outputs of its own, each checked");
}

// ---- Part B (bonus): wgmma, skipped with the reason where it cannot run ----------------------

#define REQUIRE_HOPPER()                                                   \
  do {                                                                     \
    K2C_REQUIRE_GPU();                                                     \
    std::string why_;                                                      \
    if (!moe::hopper_supported(&why_)) K2C_SKIP("Part B: " + why_);        \
  } while (0)

TEST(MoeHopper, GroupedGemm) {
  REQUIRE_HOPPER();
  std::mt19937_64 rng(seed_for("hopper grouped"));
  check_grouped_gemm({300}, 64, 128, true, false, false, true, 0);
  check_grouped_gemm({0, 5, 0, 257, 1, 0}, 136, 64, true, false, false, true, 3);
  check_grouped_gemm(group_sizes(rng, 9, 400), 200, 96, true, false, false, true, 0);
  check_grouped_gemm(group_sizes(rng, 5, 300), 37, 40, true, false, false, true, 130);  // n not a multiple of 8
  check_grouped_gemm(group_sizes(rng, 3, 600), 520, 2056, true, false, false, true, 1);
  check_grouped_gemm({0, 0}, 16, 16, true, false, false, true, 5);
  // Last tiles with 1, 64, 65 and 127 real rows: up to 64 the two consumers split the columns,
  // one half past n here (n 264 = 256 + 8).
  check_grouped_gemm({1, 64, 65, 129, 192, 193, 255, 63}, 264, 128, true, false, false, true, 2);
  // The input gradient's form: B read untransposed (k % 64 == 0).
  check_grouped_gemm({300}, 64, 128, false, false, false, true, 0);
  check_grouped_gemm({0, 5, 0, 257, 1, 0}, 136, 64, false, false, false, true, 3);
  check_grouped_gemm(group_sizes(rng, 7, 400), 200, 192, false, false, false, true, 9);
  check_grouped_gemm(group_sizes(rng, 3, 600), 2056, 512, false, false, false, true, 0);
  check_grouped_gemm({1, 64, 65, 129, 192, 193, 255, 63}, 264, 128, false, false, false, true, 2);
  // The weight gradient's form: ragged reductions, empty groups, NaN rows past the groups' end.
  check_weight_grad({300}, 64, 128, true, 0);
  check_weight_grad({0, 5, 0, 257, 1, 0}, 136, 64, true, 7);
  check_weight_grad(group_sizes(rng, 8, 400), 96, 200, true, 64);
  check_weight_grad(group_sizes(rng, 3, 900), 520, 264, true, 1);
  check_weight_grad({0, 0, 0}, 16, 16, true, 3);
  // What TMA cannot describe is refused, not launched: k % 8 != 0; n % 8 != 0 or k % 64 != 0
  // with B untransposed; a weight gradient with n % 8 != 0.
  k2c::DeviceBuffer<bf16> buf(1024);
  k2c::DeviceBuffer<float> out(1024);
  auto off = upload(std::vector<int>{0, 4});
  EXPECT_THROW(moe::grouped_gemm_hopper(1, off.data(), 4, 8, 12, buf.data(), buf.data(), buf.data()),
               std::invalid_argument);
  EXPECT_THROW(moe::grouped_gemm_hopper(1, off.data(), 4, 8, 96, buf.data(), buf.data(), buf.data(), false),
               std::invalid_argument);
  EXPECT_THROW(moe::grouped_weight_grad_hopper(1, off.data(), 4, 12, 8, buf.data(), buf.data(), out.data()),
               std::invalid_argument);
}
