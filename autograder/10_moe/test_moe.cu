// autograder/10_moe/test_moe.cu — tests of module 10 (contract: moe.h).
//
// Exact where the answer is discrete: chosen experts, counts, offsets, slots and sources must
// equal the CPU reference's (k2c/reference/reference.h), and permute must copy bits.
//
// Near ties. The kernels compute scores in fp32 and the reference in double, so two experts
// whose keys differ by less than about a millionth of their size may legitimately come out in
// either order. Tests whose data is random redraw it (a new seed, deterministically) until no
// token has a relative gap under kRouteTieGap (kLayerTieGap for the layer) among its chosen
// keys, at its k-th choice or at its group cut; the tie rule
// itself (lower index wins) is tested on exact ties, which fp32 and double see alike.
//
// Tolerances for values. Every input is a bf16 value, so products are exact and what differs is
// the rounding of intermediates to bf16 (each at most 2^-8 relative) and fp32 accumulation.
//   scores, weights, loss and its gradient: fp32 throughout: scores, weights and the loss within
//                 1e-5 relative, logit gradients (differences of such values) and the layer's
//                 weights (from logits summed in another order) within 1e-4.
//   grouped GEMM: one rounding of C (bf16 output: 2^-8·|ref|) plus fp32 accumulation over k
//                 terms, at most k · 2^-24 · Σ|terms| and typically √k · 2^-24 · Σ|terms|; the
//                 bound 2^-8·|ref| + 2^-16·Σ|terms| covers the worst case up to k = 256 and the
//                 typical one far beyond (k = 2056 is tested).
//   the layer:    an output passes through several bf16 intermediates ([g|u], h, the experts'
//                 rows, y; in the backward pass also dlogits and the rows' gradients). Their
//                 roundings perturb the terms of each sum by 2^-8 relative with unrelated
//                 signs, so an element's error behaves like a random walk: a few 2^-8 of the
//                 tensor's root mean square. Elements must lie within 2^-7·|ref| + c·rms(ref)
//                 with c = 2^-5 forward and 2^-4 backward, about 5 standard deviations of that
//                 walk at the sizes tested. A bug moves an element by the size of its terms:
//                 a lost or doubled choice, a wrong expert, weight, slot or transposition shows
//                 as an error of order rms(ref) (the tests route with weights of 0.1 to 1).
//   weight gradients of the layer: each element sums one term per token that reached the
//                 expert, often a handful of terms of both signs. A term carries the roundings
//                 of the intermediates it is made of (up to six of 2^-8, independent: about
//                 2^-7.5 as a root mean square), so where terms cancel the error is large against
//                 the sum and scales with Σ|terms| instead: within 2^-6·Σ|terms| + 2^-4·rms(ref).
//                 dW1's and dW3's terms contain dh = d_out·W2, itself a sum over the hidden
//                 width whose bf16 inputs leave it an error of 2^-8 of its own terms' size, so
//                 they count dh at that size (k2c::ref::MoeBackward's *_mag). With 2^-7·|ref| in
//                 place of the first term, the reference solution failed at 4 of the seeds 1 to 60
//                 (7 tokens over 64 experts); a lost or wrong term still misses by its own size.
// Outputs are poisoned (NaN) before each call; NaN fails every comparison.
//
// Speed: the grouped GEMM at the module's DeepSeek-like shape against one dense cuBLAS GEMM of the
// same total size, interleaved in the same run (the per-expert cuBLAS loop reported beside it):
// Part B's wgmma kernel where it runs and is implemented (what the layer's forward pass would
// use), else grouped_gemm(), and grouped_gemm() alone as a recorded figure; and the whole layer's
// forward plus backward against a naive layer in the same run (k2c/reference/moe_baseline.h: a
// launch per expert for every step, an unfused router, scatter-adds).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/device/buffer.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"
#include "k2c/reference/moe_baseline.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/bf16.h"
#include "k2c/testing/testing.h"
#include "moe.h"

namespace moe = k2c::moe;
using k2c::bf16;
using k2c::testing::seed_for;

namespace {

// Relative gaps below which fp32 and double may order two keys differently: about 30 fp32 ulps
// when both sides route the same logits, more for the layer, whose logits are sums that the GPU
// and the CPU add in different orders.
constexpr double kRouteTieGap = 4e-6, kLayerTieGap = 3e-5;

template <class T>
k2c::DeviceBuffer<T> upload(const std::vector<T>& v) {
  return k2c::DeviceBuffer<T>{std::span<const T>(v)};
}
// Outputs filled with garbage before a call: NaN for floating types (poison()), 0x7F7F7F7F for
// int32, which no index or count takes and which differs from the −1 of a dropped slot.
template <class T>
void repoison(k2c::DeviceBuffer<T>& b) {
  if constexpr (std::is_same_v<T, int>) {
    if (b.size() > 0) ASSERT_EQ(cudaMemset(b.data(), 0x7F, b.bytes()), cudaSuccess);
  } else {
    b.poison();
  }
}
template <class T>
k2c::DeviceBuffer<T> poisoned(std::size_t n) {
  k2c::DeviceBuffer<T> b(n);
  repoison(b);
  return b;
}

k2c::ref::RouterConfig ref_config(const moe::RouterConfig& c) {
  return {c.experts, c.top_k, c.score == moe::Score::softmax ? k2c::ref::RouterScore::softmax : k2c::ref::RouterScore::sigmoid,
          c.groups, c.top_groups, c.normalize, static_cast<double>(c.route_scale)};
}

std::string describe(const moe::RouterConfig& c) {
  std::ostringstream os;
  os << "E" << c.experts << " k" << c.top_k << (c.score == moe::Score::softmax ? " softmax" : " sigmoid") << " groups "
     << c.top_groups << "/" << c.groups << (c.normalize ? " normalized" : "") << " scale " << c.route_scale;
  return os.str();
}

// The smallest relative gap, over tokens, between adjacent keys among the k + 1 best eligible
// ones, and between the last kept group and the next, as the reference sees them.
double smallest_gap(const k2c::ref::Routing& r, const std::vector<float>& bias, int tokens, const moe::RouterConfig& c) {
  const int E = c.experts, per = E / c.groups;
  double gap = INFINITY;
  auto relative = [](double a, double b) { return (a - b) / std::max({std::abs(a), std::abs(b), 1e-30}); };
  for (int t = 0; t < tokens; ++t) {
    std::vector<double> key(E);
    for (int e = 0; e < E; ++e) key[e] = r.scores[static_cast<std::size_t>(t) * E + e] + (bias.empty() ? 0.0 : bias[e]);
    if (c.groups > 1) {
      std::vector<std::pair<double, int>> group(c.groups);
      for (int g = 0; g < c.groups; ++g) {
        std::vector<double> mine(key.begin() + g * per, key.begin() + (g + 1) * per);
        std::sort(mine.rbegin(), mine.rend());
        group[g] = {mine[0] + (per > 1 ? mine[1] : 0.0), g};
      }
      std::sort(group.begin(), group.end(), [](auto a, auto b) { return a.first > b.first; });
      if (c.top_groups < c.groups) gap = std::min(gap, relative(group[c.top_groups - 1].first, group[c.top_groups].first));
      std::vector<bool> kept(c.groups, false);
      for (int i = 0; i < c.top_groups; ++i) kept[group[i].second] = true;
      for (int e = 0; e < E; ++e)
        if (!kept[e / per]) key[e] = -INFINITY;
    }
    // The chosen experts come out best first, so every adjacent pair among the top k + 1 counts.
    std::sort(key.rbegin(), key.rend());
    for (int j = 0; j + 1 <= c.top_k && j + 1 < E; ++j)
      if (std::isfinite(key[j + 1])) gap = std::min(gap, relative(key[j], key[j + 1]));
  }
  return gap;
}

::testing::AssertionResult close_rel(const char* what, const std::vector<float>& got, const std::vector<double>& want,
                                     double rel, double abs) {
  std::ostringstream bad;
  std::size_t count = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isfinite(got[i]) && std::abs(got[i] - want[i]) <= rel * std::abs(want[i]) + abs) continue;
    if (count++ < 6) bad << " [" << i << "] got " << got[i] << " want " << want[i] << ";";
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << count << " of " << want.size() << " wrong:" << bad.str();
}

// |got − ref| <= 2^-7·|ref| + c·rms(ref), element by element; with `mag` (the layer's weight
// gradients: each element's sum of its terms' magnitudes, the bound the header derives)
// 2^-6·mag + c·rms(ref) instead. Records the worst error as a fraction of its bound, so that a
// report shows the margin.
::testing::AssertionResult close_rms(const char* what, const std::vector<float>& got, const std::vector<double>& want,
                                     double c, const std::vector<double>* mag = nullptr) {
  double sq = 0;
  for (double v : want) sq += v * v;
  const double rms = want.empty() ? 0 : std::sqrt(sq / want.size());
  std::ostringstream bad;
  std::size_t count = 0;
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double scale = mag ? std::ldexp((*mag)[i], -6) : std::ldexp(std::abs(want[i]), -7);
    const double err = std::abs(got[i] - want[i]), bound = scale + c * rms + 1e-30;
    if (std::isfinite(got[i])) worst = std::max(worst, err / bound);
    if (std::isfinite(got[i]) && err <= bound) continue;
    if (count++ < 6) {
      bad << " [" << i << "] got " << got[i] << " want " << want[i];
      if (mag) bad << " (terms' magnitude " << (*mag)[i] << ")";
      bad << ";";
    }
  }
  ::testing::Test::RecordProperty(std::string("worst_error_over_bound_") + what, std::to_string(worst));
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << count << " of " << want.size() << " wrong (rms " << rms
                                       << ", worst " << worst << " of the bound):" << bad.str();
}

// ---- routing ---------------------------------------------------------------------------------

struct RouteCase {
  moe::RouterConfig c;
  int tokens;
  bool with_bias;
};

// Runs route() on random logits (redrawn while a near tie exists) and checks every output.
void check_route(const RouteCase& rc, const std::string& tag) {
  const moe::RouterConfig& c = rc.c;
  SCOPED_TRACE(describe(c) + " tokens " + std::to_string(rc.tokens) + (rc.with_bias ? " bias" : ""));
  const std::size_t n = static_cast<std::size_t>(rc.tokens) * c.experts;
  std::vector<float> logits, bias;
  k2c::ref::Routing ref;
  for (int attempt = 0;; ++attempt) {
    logits = k2c::random_values<float>(n, seed_for(tag + "/logits/" + std::to_string(attempt)), -3.0f, 3.0f);
    bias = rc.with_bias ? k2c::random_values<float>(c.experts, seed_for(tag + "/bias/" + std::to_string(attempt)), -0.05f, 0.05f)
                        : std::vector<float>{};
    ref = k2c::ref::route(logits, bias, rc.tokens, ref_config(c));
    if (smallest_gap(ref, bias, rc.tokens, c) > kRouteTieGap) break;
    ASSERT_LT(attempt, 20) << "no draw without a near tie";
  }
  auto d_logits = upload(logits);
  k2c::DeviceBuffer<float> d_bias = rc.with_bias ? upload(bias) : k2c::DeviceBuffer<float>{};
  auto scores = poisoned<float>(n);
  auto expert = poisoned<int>(static_cast<std::size_t>(rc.tokens) * c.top_k);
  auto weight = poisoned<float>(static_cast<std::size_t>(rc.tokens) * c.top_k);
  moe::route(c, rc.tokens, d_logits.data(), rc.with_bias ? d_bias.data() : nullptr, scores.data(), expert.data(),
             weight.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(expert.download(), ref.expert);
  EXPECT_TRUE(close_rel("scores", scores.download(), ref.scores, 1e-5, 1e-7));
  EXPECT_TRUE(close_rel("weight", weight.download(), ref.weight, 1e-5, 1e-7));
}

// ---- grouped GEMM --------------------------------------------------------------------------------

std::vector<int> offsets_of(const std::vector<int>& sizes) {
  std::vector<int> off(sizes.size() + 1, 0);
  std::partial_sum(sizes.begin(), sizes.end(), off.begin() + 1);
  return off;
}

// C_g = A_g · op(B_g) in double, with Σ|terms| for the bound.
struct GemmRef {
  std::vector<double> c, magnitude;
};
GemmRef grouped_ref(const std::vector<int>& off, int n, int k, const std::vector<float>& a, const std::vector<float>& b,
                    bool b_transposed) {
  const int rows = off.back();
  GemmRef r{std::vector<double>(static_cast<std::size_t>(rows) * n), std::vector<double>(static_cast<std::size_t>(rows) * n)};
  for (std::size_t g = 0; g + 1 < off.size(); ++g)
    for (int i = off[g]; i < off[g + 1]; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0, m = 0;
        for (int x = 0; x < k; ++x) {
          const double bv = b_transposed ? b[(g * n + j) * static_cast<std::size_t>(k) + x] : b[(g * k + x) * static_cast<std::size_t>(n) + j];
          const double t = a[static_cast<std::size_t>(i) * k + x] * bv;
          s += t;
          m += std::abs(t);
        }
        r.c[static_cast<std::size_t>(i) * n + j] = s;
        r.magnitude[static_cast<std::size_t>(i) * n + j] = m;
      }
  return r;
}

::testing::AssertionResult close_gemm(const char* what, const std::vector<float>& got, const GemmRef& ref, bool bf16_out) {
  std::ostringstream bad;
  std::size_t count = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double bound = (bf16_out ? std::ldexp(std::abs(ref.c[i]), -8) : 0.0) + std::ldexp(ref.magnitude[i], -16) + 1e-6;
    if (std::isfinite(got[i]) && std::abs(got[i] - ref.c[i]) <= bound) continue;
    if (count++ < 6) bad << " [" << i << "] got " << got[i] << " want " << ref.c[i] << ";";
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << count << " of " << got.size() << " wrong:" << bad.str();
}

// Group sizes with the edge cases: empty groups, a group under one tile, one over a tile.
std::vector<int> group_sizes(std::mt19937_64& rng, int groups, int max_rows) {
  std::vector<int> sizes(groups);
  for (int& s : sizes) {
    const int kind = static_cast<int>(rng() % 4);
    s = kind == 0 ? 0 : kind == 1 ? static_cast<int>(rng() % 17) : static_cast<int>(rng() % (max_rows + 1));
  }
  return sizes;
}

// hopper: Part B's grouped_gemm_hopper (bf16 C, no accumulate), told that A and C hold `spare`
// rows more than the groups use.
void check_grouped_gemm(const std::vector<int>& sizes, int n, int k, bool b_transposed, bool fp32_out, bool accumulate,
                        bool hopper = false, int spare = 0) {
  std::ostringstream name;
  name << sizes.size() << " groups, rows " << offsets_of(sizes).back() << ", n " << n << ", k " << k
       << (b_transposed ? " B^T" : " B") << (fp32_out ? " fp32" : " bf16") << (accumulate ? " accumulate" : "")
       << (hopper ? " (Hopper, " + std::to_string(spare) + " spare rows)" : "");
  SCOPED_TRACE(name.str());
  const std::vector<int> off = offsets_of(sizes);
  const int groups = static_cast<int>(sizes.size()), rows = off.back();
  const int held = std::max(rows + spare, 1);  // rows A and C hold
  const auto a = k2c::random_values<bf16>(static_cast<std::size_t>(held) * k, seed_for(name.str() + "/a"));
  const auto b = k2c::random_values<bf16>(static_cast<std::size_t>(groups) * n * k, seed_for(name.str() + "/b"));
  GemmRef ref = grouped_ref(off, n, k, a, b, b_transposed);
  auto d_off = upload(off);
  auto d_a = k2c::to_device<bf16>(a), d_b = k2c::to_device<bf16>(b);
  const std::size_t cn = static_cast<std::size_t>(held) * n;
  std::vector<float> got;
  if (fp32_out) {
    std::vector<float> start(cn, 0.0f);
    if (accumulate) {
      start = k2c::random_values<float>(cn, seed_for(name.str() + "/c"));
      for (std::size_t i = 0; i < ref.c.size(); ++i) ref.c[i] += start[i];
    }
    auto c = accumulate ? upload(start) : poisoned<float>(cn);
    moe::grouped_gemm(groups, d_off.data(), n, k, d_a.data(), d_b.data(), c.data(), b_transposed, accumulate);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got = c.download();
  } else {
    auto c = poisoned<bf16>(cn);
    if (accumulate) {
      const auto start = k2c::random_values<bf16>(cn, seed_for(name.str() + "/c"));
      for (std::size_t i = 0; i < ref.c.size(); ++i) ref.c[i] += start[i];
      c = k2c::to_device<bf16>(start);
    }
    if (hopper) moe::grouped_gemm_hopper(groups, d_off.data(), held, n, k, d_a.data(), d_b.data(), c.data(), b_transposed);
    else moe::grouped_gemm(groups, d_off.data(), n, k, d_a.data(), d_b.data(), c.data(), b_transposed, accumulate);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got = k2c::to_host(c);
    // Rows past the groups' end are never written: still poisoned.
    for (std::size_t i = static_cast<std::size_t>(rows) * n; i < cn && hopper; ++i)
      ASSERT_TRUE(std::isnan(got[i])) << "row " << i / n << " past the groups' end was written";
  }
  got.resize(static_cast<std::size_t>(rows) * n);
  EXPECT_TRUE(close_gemm("C", got, ref, !fp32_out));
}

// hopper: Part B's grouped_weight_grad_hopper, told that dY and X hold `spare` rows more than the
// groups use; those rows are NaN, which must not reach any group's sum.
void check_weight_grad(const std::vector<int>& sizes, int n, int k, bool hopper = false, int spare = 0) {
  std::ostringstream name;
  name << sizes.size() << " groups, rows " << offsets_of(sizes).back() << ", n " << n << ", k " << k
       << (hopper ? " (Hopper, " + std::to_string(spare) + " spare rows)" : "");
  SCOPED_TRACE(name.str());
  const std::vector<int> off = offsets_of(sizes);
  const int groups = static_cast<int>(sizes.size()), rows = off.back(), held = std::max(rows + spare, 1);
  auto dy = k2c::random_values<bf16>(static_cast<std::size_t>(held) * n, seed_for(name.str() + "/dy"));
  auto x = k2c::random_values<bf16>(static_cast<std::size_t>(held) * k, seed_for(name.str() + "/x"));
  std::fill(dy.begin() + static_cast<std::ptrdiff_t>(rows) * n, dy.end(), NAN);
  std::fill(x.begin() + static_cast<std::ptrdiff_t>(rows) * k, x.end(), NAN);
  GemmRef ref{std::vector<double>(static_cast<std::size_t>(groups) * n * k), std::vector<double>(static_cast<std::size_t>(groups) * n * k)};
  for (int g = 0; g < groups; ++g)
    for (int r = off[g]; r < off[g + 1]; ++r)
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < k; ++j) {
          const double t = static_cast<double>(dy[static_cast<std::size_t>(r) * n + i]) * x[static_cast<std::size_t>(r) * k + j];
          ref.c[(static_cast<std::size_t>(g) * n + i) * k + j] += t;
          ref.magnitude[(static_cast<std::size_t>(g) * n + i) * k + j] += std::abs(t);
        }
  auto d_off = upload(off);
  auto d_dy = k2c::to_device<bf16>(dy), d_x = k2c::to_device<bf16>(x);
  auto dw = poisoned<float>(static_cast<std::size_t>(groups) * n * k);
  if (hopper) moe::grouped_weight_grad_hopper(groups, d_off.data(), held, n, k, d_dy.data(), d_x.data(), dw.data());
  else moe::grouped_weight_grad(groups, d_off.data(), n, k, d_dy.data(), d_x.data(), dw.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(close_gemm("dW", dw.download(), ref, false));
}

// ---- the layer ---------------------------------------------------------------------------------

struct LayerCase {
  moe::RouterConfig c;
  int tokens, hidden, ffn, shared_ffn, capacity;
  bool with_bias;
};

std::string describe(const LayerCase& lc) {
  std::ostringstream os;
  os << describe(lc.c) << ", T " << lc.tokens << " d " << lc.hidden << " f " << lc.ffn << " shared " << lc.shared_ffn
     << " capacity " << lc.capacity << (lc.with_bias ? " bias" : "");
  return os.str();
}

// Host copies of the layer's data (bf16 values held as float) and its reference view.
struct LayerData {
  LayerCase lc;
  std::vector<float> x, dy, w_router, bias, w13, w2, shared_w13, shared_w2;
  std::vector<float> w1, w3, sw1, sw3;  // the reference's split of W13
  k2c::ref::MoeLayer ref_layer() const {
    k2c::ref::MoeLayer m;
    m.hidden = lc.hidden;
    m.ffn = lc.ffn;
    m.shared_ffn = std::max(lc.shared_ffn, 1);
    m.shared = lc.shared_ffn > 0 ? 1 : 0;
    m.router = ref_config(lc.c);
    m.capacity = lc.capacity;
    m.w_router = w_router;
    m.bias = bias;
    m.w1 = w1;
    m.w3 = w3;
    m.w2 = w2;
    m.shared_w1 = sw1;
    m.shared_w3 = sw3;
    m.shared_w2 = shared_w2;
    return m;
  }
};

// Splits [groups][2f][d] into its W1 and W3 halves.
void split13(const std::vector<float>& w13, int groups, int f, int d, std::vector<float>& w1, std::vector<float>& w3) {
  const std::size_t half = static_cast<std::size_t>(f) * d;
  w1.clear();
  w3.clear();
  for (int g = 0; g < groups; ++g) {
    const auto base = w13.begin() + static_cast<std::ptrdiff_t>(2 * half * g);
    w1.insert(w1.end(), base, base + static_cast<std::ptrdiff_t>(half));
    w3.insert(w3.end(), base + static_cast<std::ptrdiff_t>(half), base + static_cast<std::ptrdiff_t>(2 * half));
  }
}

// Weights scaled so that logits, gates and outputs are of order one.
LayerData make_layer(const LayerCase& lc, const std::string& tag) {
  const int E = lc.c.experts, d = lc.hidden, f = lc.ffn, sf = lc.shared_ffn;
  const float ar = 4.5f / std::sqrt(static_cast<float>(d)), a1 = 3.0f / std::sqrt(static_cast<float>(d)),
              a2 = 3.0f / std::sqrt(static_cast<float>(f)), as2 = sf > 0 ? 3.0f / std::sqrt(static_cast<float>(sf)) : 0.0f;
  LayerData L{lc};
  L.x = k2c::random_values<bf16>(static_cast<std::size_t>(lc.tokens) * d, seed_for(tag + "/x"));
  L.dy = k2c::random_values<bf16>(static_cast<std::size_t>(lc.tokens) * d, seed_for(tag + "/dy"));
  L.w_router = k2c::random_values<bf16>(static_cast<std::size_t>(E) * d, seed_for(tag + "/wr"), -ar, ar);
  if (lc.with_bias) L.bias = k2c::random_values<float>(E, seed_for(tag + "/bias"), -0.05f, 0.05f);
  L.w13 = k2c::random_values<bf16>(static_cast<std::size_t>(E) * 2 * f * d, seed_for(tag + "/w13"), -a1, a1);
  L.w2 = k2c::random_values<bf16>(static_cast<std::size_t>(E) * d * f, seed_for(tag + "/w2"), -a2, a2);
  L.shared_w13 = k2c::random_values<bf16>(static_cast<std::size_t>(2) * sf * d, seed_for(tag + "/sw13"), -a1, a1);
  L.shared_w2 = k2c::random_values<bf16>(static_cast<std::size_t>(d) * sf, seed_for(tag + "/sw2"), -as2, as2);
  split13(L.w13, E, f, d, L.w1, L.w3);
  split13(L.shared_w13, 1, sf, d, L.sw1, L.sw3);
  return L;
}

// The layer on the device: weights, buffers, routing outputs, workspaces.
struct DeviceLayer {
  const LayerData& L;
  k2c::DeviceBuffer<bf16> x, dy, w_router, w13, w2, shared_w13, shared_w2, y, dx;
  k2c::DeviceBuffer<float> bias, logits, scores, weight, g_router, g13, g2, gs13, gs2;
  k2c::DeviceBuffer<int> expert, counts;
  k2c::DeviceBuffer<char> saved, work;
  moe::Layer layer;
  explicit DeviceLayer(const LayerData& data) : L(data) {
    const LayerCase& lc = L.lc;
    const int E = lc.c.experts, T = lc.tokens, k = lc.c.top_k;
    x = k2c::to_device<bf16>(L.x);
    dy = k2c::to_device<bf16>(L.dy);
    w_router = k2c::to_device<bf16>(L.w_router);
    w13 = k2c::to_device<bf16>(L.w13);
    w2 = k2c::to_device<bf16>(L.w2);
    if (lc.shared_ffn > 0) {
      shared_w13 = k2c::to_device<bf16>(L.shared_w13);
      shared_w2 = k2c::to_device<bf16>(L.shared_w2);
    }
    if (lc.with_bias) bias = upload(L.bias);
    y = poisoned<bf16>(L.x.size());
    dx = poisoned<bf16>(L.x.size());
    logits = poisoned<float>(static_cast<std::size_t>(T) * E);
    scores = poisoned<float>(static_cast<std::size_t>(T) * E);
    weight = poisoned<float>(static_cast<std::size_t>(T) * k);
    expert = poisoned<int>(static_cast<std::size_t>(T) * k);
    counts = poisoned<int>(E);
    g_router = poisoned<float>(L.w_router.size());
    g13 = poisoned<float>(L.w13.size());
    g2 = poisoned<float>(L.w2.size());
    gs13 = poisoned<float>(L.shared_w13.size());
    gs2 = poisoned<float>(L.shared_w2.size());
    layer = {lc.c, lc.hidden, lc.ffn, lc.shared_ffn, lc.capacity, w_router.data(), lc.with_bias ? bias.data() : nullptr,
             w13.data(), w2.data(), lc.shared_ffn > 0 ? shared_w13.data() : nullptr,
             lc.shared_ffn > 0 ? shared_w2.data() : nullptr};
    saved = poisoned<char>(moe::forward_workspace_bytes(layer, T));
    work = poisoned<char>(moe::backward_workspace_bytes(layer, T));
  }
  moe::Routing routing() { return {logits.data(), scores.data(), expert.data(), weight.data(), counts.data()}; }
  moe::Grads grads() {
    return {g_router.data(), g13.data(), g2.data(), L.lc.shared_ffn > 0 ? gs13.data() : nullptr,
            L.lc.shared_ffn > 0 ? gs2.data() : nullptr};
  }
  void forward() { moe::forward(layer, L.lc.tokens, x.data(), y.data(), routing(), saved.data()); }
  void backward(const float* extra = nullptr) {
    moe::backward(layer, L.lc.tokens, x.data(), dy.data(), routing(), saved.data(), extra, dx.data(), grads(), work.data());
  }
};

// Data for a layer case without near ties in its routing, and the reference forward pass.
LayerData draw_layer(const LayerCase& lc, k2c::ref::MoeForward& ref) {
  for (int attempt = 0;; ++attempt) {
    LayerData L = make_layer(lc, describe(lc) + "/" + std::to_string(attempt));
    const auto m = L.ref_layer();
    ref = k2c::ref::moe_forward(L.x, lc.tokens, m);
    if (smallest_gap(ref.routing, L.bias, lc.tokens, lc.c) > kLayerTieGap) return L;
    if (attempt == 20) {
      ADD_FAILURE() << "no draw without a near tie";
      return L;
    }
  }
}

std::vector<LayerCase> layer_cases() {
  using moe::Score;
  return {
      // Mixtral-like: 8 experts, top-2, renormalised softmax.
      {{8, 2, Score::softmax, 1, 1, true, 1.0f}, 200, 64, 48, 0, -1, false},
      // DeepSeek-V2-like: softmax without renormalisation, a shared expert, groups.
      {{16, 3, Score::softmax, 4, 2, false, 4.0f}, 150, 96, 40, 64, -1, false},
      // DeepSeek-V3-like: sigmoid, bias, groups, route scale; a tight capacity that drops.
      {{32, 4, Score::sigmoid, 8, 4, true, 2.5f}, 120, 64, 32, 32, 12, true},
      // Tiny: one token, one expert, top-1.
      {{1, 1, Score::softmax, 1, 1, false, 1.0f}, 1, 8, 8, 8, -1, false},
      // More experts than tokens, so most experts get none.
      {{64, 6, Score::softmax, 1, 1, true, 1.0f}, 7, 40, 24, 0, -1, false},
  };
}

void check_layer_forward(const LayerCase& lc) {
  SCOPED_TRACE(describe(lc));
  k2c::ref::MoeForward ref;
  const LayerData L = draw_layer(lc, ref);
  DeviceLayer D(L);
  D.forward();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(D.expert.download(), ref.routing.expert);
  EXPECT_EQ(D.counts.download(), ref.dispatch.counts);
  EXPECT_TRUE(close_rel("weight", D.weight.download(), ref.routing.weight, 1e-4, 1e-6));
  EXPECT_TRUE(close_rel("scores", D.scores.download(), ref.routing.scores, 1e-4, 1e-7));
  EXPECT_TRUE(close_rms("y", k2c::to_host(D.y), ref.y, 0x1p-5));
}

void check_layer_backward(const LayerCase& lc, bool with_extra) {
  SCOPED_TRACE(describe(lc) + (with_extra ? " + balance loss" : ""));
  k2c::ref::MoeForward fwd;
  const LayerData L = draw_layer(lc, fwd);
  DeviceLayer D(L);
  const int E = lc.c.experts, T = lc.tokens, d = lc.hidden;
  D.forward();
  // The balancing loss's logit gradient, computed on the reference's logits and choices, as the
  // extra term; the reference adds its route through w_router to dw_router and dx.
  std::vector<double> extra;
  k2c::DeviceBuffer<float> d_extra;
  if (with_extra) {
    std::vector<float> logits(static_cast<std::size_t>(T) * E);
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += static_cast<double>(L.x[static_cast<std::size_t>(t) * d + c]) * L.w_router[static_cast<std::size_t>(e) * d + c];
        logits[static_cast<std::size_t>(t) * E + e] = static_cast<float>(acc);
      }
    extra = k2c::ref::balance_loss(logits, fwd.routing, T, E, lc.c.top_k, 0.1).dlogits;
    d_extra = upload(std::vector<float>(extra.begin(), extra.end()));
  }
  D.backward(with_extra ? d_extra.data() : nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto ref = k2c::ref::moe_backward(L.x, T, L.ref_layer(), L.dy);
  if (with_extra)
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        const double z = static_cast<float>(extra[static_cast<std::size_t>(t) * E + e]);
        for (int c = 0; c < d; ++c) {
          ref.dw_router[static_cast<std::size_t>(e) * d + c] += z * L.x[static_cast<std::size_t>(t) * d + c];
          ref.dx[static_cast<std::size_t>(t) * d + c] += z * L.w_router[static_cast<std::size_t>(e) * d + c];
        }
      }
  constexpr double c = 0x1p-4;
  EXPECT_TRUE(close_rms("dx", k2c::to_host(D.dx), ref.dx, c));
  EXPECT_TRUE(close_rms("dw_router", D.g_router.download(), ref.dw_router, c));
  // The device keeps W1 and W3 stacked per expert; compare each half with the reference's.
  std::vector<float> g1, g3;
  split13(D.g13.download(), E, lc.ffn, d, g1, g3);
  EXPECT_TRUE(close_rms("dw1", g1, ref.dw1, c, &ref.dw1_mag));
  EXPECT_TRUE(close_rms("dw3", g3, ref.dw3, c, &ref.dw3_mag));
  EXPECT_TRUE(close_rms("dw2", D.g2.download(), ref.dw2, c, &ref.dw2_mag));
  if (lc.shared_ffn > 0) {
    split13(D.gs13.download(), 1, lc.shared_ffn, d, g1, g3);
    EXPECT_TRUE(close_rms("dshared_w1", g1, ref.dshared_w1, c, &ref.dshared_w1_mag));
    EXPECT_TRUE(close_rms("dshared_w3", g3, ref.dshared_w3, c, &ref.dshared_w3_mag));
    EXPECT_TRUE(close_rms("dshared_w2", D.gs2.download(), ref.dshared_w2, c, &ref.dshared_w2_mag));
  }
}

// ---- speed -------------------------------------------------------------------------------------

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

}  // namespace

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(MoeContract, Implemented) {
  const bool gpu = k2c::testing::gpu_available();
  k2c::DeviceBuffer<float> f(gpu ? 64 : 0);
  k2c::DeviceBuffer<int> i(gpu ? 64 : 0);
  float* fp = gpu ? f.data() : reinterpret_cast<float*>(256);  // never dereferenced without a device
  int* ip = gpu ? i.data() : reinterpret_cast<int*>(256);
  K2C_EXPECT_IMPLEMENTED(moe::route(moe::RouterConfig{4, 1}, 1, fp, nullptr, fp + 16, ip, fp + 32));
}

TEST(MoeArguments, Rejected) {
  K2C_REQUIRE_GPU();
  k2c::DeviceBuffer<float> f(256);
  k2c::DeviceBuffer<int> iv(256);
  k2c::DeviceBuffer<bf16> b(256);
  float* fp = f.data();
  int* ip = iv.data();
  bf16* bp = b.data();
  K2C_EXPECT_IMPLEMENTED(moe::route(moe::RouterConfig{4, 1}, 1, fp, nullptr, fp + 16, ip, fp + 32));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto bad_config = [](auto change) {
    moe::RouterConfig c{8, 2};
    change(c);
    return c;
  };
  for (const moe::RouterConfig& c :
       {bad_config([](auto& c) { c.experts = 0; }), bad_config([](auto& c) { c.experts = 2000; }),
        bad_config([](auto& c) { c.top_k = 9; }), bad_config([](auto& c) { c.groups = 3; }),
        bad_config([](auto& c) { c.groups = 4, c.top_groups = 1, c.top_k = 3; }),
        bad_config([](auto& c) { c.route_scale = 0; }), bad_config([](auto& c) { c.route_scale = NAN; }),
        bad_config([](auto& c) { c.groups = 2, c.top_groups = 3; })}) {
    SCOPED_TRACE(describe(c));
    EXPECT_THROW(moe::route(c, 1, fp, nullptr, fp + 16, ip, fp + 32), std::invalid_argument);
  }
  EXPECT_THROW(moe::route(moe::RouterConfig{4, 1}, -1, fp, nullptr, fp, ip, fp), std::invalid_argument);
  EXPECT_THROW(moe::route(moe::RouterConfig{4, 1}, 1, nullptr, nullptr, fp, ip, fp), std::invalid_argument);
  EXPECT_THROW(moe::route(moe::RouterConfig{4, 1}, 1, fp + 1, nullptr, fp, ip, fp), std::invalid_argument);
  EXPECT_THROW(moe::dispatch(4, 0, 1, -1, ip, ip, ip, ip, ip, ip), std::invalid_argument);
  EXPECT_THROW(moe::permute(4, 12, 1, bp, ip, bp), std::invalid_argument);  // hidden not a multiple of 8
  EXPECT_THROW(moe::combine(4, 16, 0, bp, ip, fp, nullptr, bp), std::invalid_argument);
  EXPECT_THROW(moe::grouped_gemm(0, ip, 8, 8, bp, bp, bp), std::invalid_argument);
  EXPECT_THROW(moe::grouped_gemm(1, ip, 0, 8, bp, bp, fp), std::invalid_argument);
  EXPECT_THROW(moe::grouped_weight_grad(1, nullptr, 8, 8, bp, bp, fp), std::invalid_argument);
  moe::Layer l{moe::RouterConfig{4, 1}, 12, 16, 0, -1, bp, nullptr, bp, bp, nullptr, nullptr};
  EXPECT_THROW(moe::forward_workspace_bytes(l, 4), std::invalid_argument);  // hidden 12
  l.hidden = 16;
  l.ffn = 20;
  EXPECT_THROW(moe::forward_workspace_bytes(l, 4), std::invalid_argument);  // ffn 20
  l.ffn = 16;
  l.w13 = nullptr;
  EXPECT_THROW(moe::forward_workspace_bytes(l, 4), std::invalid_argument);
}

TEST(MoeRouter, Softmax) {
  K2C_REQUIRE_GPU();
  using moe::Score;
  for (const RouteCase& rc : std::vector<RouteCase>{{{8, 2, Score::softmax, 1, 1, true, 1.0f}, 300, false},
                                                    {{64, 6, Score::softmax, 1, 1, false, 1.0f}, 500, false},
                                                    {{5, 5, Score::softmax, 1, 1, false, 2.0f}, 33, false},
                                                    {{1, 1, Score::softmax, 1, 1, false, 1.0f}, 10, false},
                                                    {{160, 6, Score::softmax, 8, 3, false, 16.0f}, 200, false},
                                                    {{1000, 32, Score::softmax, 1, 1, true, 1.0f}, 40, false},
                                                    {{37, 3, Score::softmax, 1, 1, false, 1.0f}, 0, false}})
    check_route(rc, "softmax");
}

TEST(MoeRouter, SigmoidGroupsBias) {
  K2C_REQUIRE_GPU();
  using moe::Score;
  for (const RouteCase& rc : std::vector<RouteCase>{{{256, 8, Score::sigmoid, 8, 4, true, 2.5f}, 300, true},
                                                    {{64, 6, Score::sigmoid, 1, 1, true, 1.0f}, 200, true},
                                                    {{32, 4, Score::softmax, 32, 4, false, 1.0f}, 100, true},
                                                    {{48, 2, Score::sigmoid, 3, 1, true, 1.0f}, 150, false}})
    check_route(rc, "sigmoid");
  // Exact ties: equal logits give equal scores in any precision; the lower index must win, for
  // experts and for groups.
  const moe::RouterConfig c{16, 3, moe::Score::softmax, 4, 2, true, 1.0f};
  const std::vector<float> logits(2 * 16, 0.5f);
  const auto ref = k2c::ref::route(logits, {}, 2, ref_config(c));
  auto d_logits = upload(logits);
  auto scores = poisoned<float>(32);
  auto expert = poisoned<int>(6);
  auto weight = poisoned<float>(6);
  moe::route(c, 2, d_logits.data(), nullptr, scores.data(), expert.data(), weight.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(expert.download(), (std::vector<int>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(expert.download(), ref.expert);
}

TEST(MoeBalance, LossAndGradient) {
  K2C_REQUIRE_GPU();
  for (auto [tokens, experts, top_k] : {std::tuple{300, 8, 2}, {1000, 64, 6}, {1, 4, 4}, {77, 33, 5}}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens) + " experts " + std::to_string(experts));
    const auto logits = k2c::random_values<float>(static_cast<std::size_t>(tokens) * experts, seed_for("balance logits"), -3.0f, 3.0f);
    const auto routing = k2c::ref::route(logits, {}, tokens, {experts, top_k});
    const auto ref = k2c::ref::balance_loss(logits, routing, tokens, experts, top_k, 0.01);
    auto d_logits = upload(logits);
    auto d_expert = upload(routing.expert);
    auto loss = poisoned<float>(1);
    auto dlogits = poisoned<float>(logits.size());
    auto work = poisoned<char>(moe::balance_workspace_bytes(experts));
    moe::balance_loss(tokens, experts, top_k, 0.01f, d_logits.data(), d_expert.data(), loss.data(), dlogits.data(),
                      work.data());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_NEAR(loss.download()[0], ref.loss, 1e-5 * ref.loss);
    // dz_j = p_j (g_j − Σ p g) with g_i = alpha·E/(k·T²)·count_i <= alpha·E/(k·T): the absolute
    // term is a millionth of that (uniform counts make the exact gradient 0).
    EXPECT_TRUE(close_rel("dlogits", dlogits.download(), ref.dlogits, 1e-4, 1e-6 * 0.01 * experts / (top_k * tokens)));
  }
}

TEST(MoeDispatch, OrderCountsCapacity) {
  K2C_REQUIRE_GPU();
  std::mt19937_64 rng(seed_for("dispatch"));
  struct Case {
    int tokens, experts, top_k, capacity;
    bool one_expert;
  };
  for (const Case& cs : std::vector<Case>{{1000, 8, 2, -1, false}, {1000, 8, 2, 100, false}, {5000, 64, 6, 400, false},
                                          {300, 64, 6, -1, false}, {700, 16, 1, -1, true}, {700, 16, 1, 50, true},
                                          {3, 1000, 4, -1, false}, {0, 8, 2, -1, false}, {257, 5, 5, 0, false}}) {
    SCOPED_TRACE("tokens " + std::to_string(cs.tokens) + " experts " + std::to_string(cs.experts) + " k " +
                 std::to_string(cs.top_k) + " capacity " + std::to_string(cs.capacity) + (cs.one_expert ? " all to one" : ""));
    // Choices: k distinct experts per token, from a skewed distribution (some experts get none).
    k2c::ref::Routing r;
    for (int t = 0; t < cs.tokens; ++t) {
      std::vector<int> all(cs.experts);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::sort(all.begin(), all.begin() + std::min(cs.experts, 3 * cs.top_k));
      for (int j = 0; j < cs.top_k; ++j) r.expert.push_back(cs.one_expert ? 7 : all[j]);
    }
    const auto ref = k2c::ref::dispatch(r, cs.tokens, cs.experts, cs.top_k, cs.capacity);
    const std::size_t choices = r.expert.size();
    auto expert = upload(r.expert.empty() ? std::vector<int>{0} : r.expert);
    auto counts = poisoned<int>(cs.experts);
    auto offsets = poisoned<int>(cs.experts + 1);
    auto slot = poisoned<int>(std::max<std::size_t>(choices, 1));
    auto source = poisoned<int>(std::max<std::size_t>(choices, 1));
    auto work = poisoned<char>(std::max<std::size_t>(moe::dispatch_workspace_bytes(cs.tokens, cs.experts, cs.top_k), 16));
    for (int run = 0; run < 2; ++run) {  // twice, outputs and workspace poisoned again: the same answer
      if (run == 1) {
        repoison(counts);
        repoison(offsets);
        repoison(slot);
        repoison(source);
        repoison(work);
      }
      moe::dispatch(cs.tokens, cs.experts, cs.top_k, cs.capacity, expert.data(), counts.data(), offsets.data(),
                    slot.data(), source.data(), work.data());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(counts.download(), ref.counts);
      EXPECT_EQ(offsets.download(), ref.offsets);
      std::vector<int> got_slot = slot.download(), got_source = source.download();
      got_slot.resize(choices);
      got_source.resize(ref.source.size());
      EXPECT_EQ(got_slot, ref.slot);
      EXPECT_EQ(got_source, ref.source);
    }
  }
}

TEST(MoePermute, RoundTripAndCombine) {
  K2C_REQUIRE_GPU();
  std::mt19937_64 rng(seed_for("permute"));
  for (auto [tokens, hidden, experts, top_k] : {std::tuple{500, 64, 8, 1}, {300, 2048, 64, 6}, {1, 8, 1, 1}, {129, 200, 7, 3}}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens) + " hidden " + std::to_string(hidden) + " k " + std::to_string(top_k));
    k2c::ref::Routing r;
    for (int t = 0; t < tokens; ++t) {
      std::vector<int> all(experts);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      for (int j = 0; j < top_k; ++j) {
        r.expert.push_back(all[j]);
        r.weight.push_back(0.1 + 0.9 * (rng() % 1000) / 1000.0);
      }
    }
    const auto disp = k2c::ref::dispatch(r, tokens, experts, top_k, -1);
    const auto x = k2c::random_values<bf16>(static_cast<std::size_t>(tokens) * hidden, seed_for("permute x"));
    auto d_x = k2c::to_device<bf16>(x);
    auto slot = upload(disp.slot);
    auto rows = poisoned<bf16>(disp.source.size() * hidden);
    moe::permute(tokens, hidden, top_k, d_x.data(), slot.data(), rows.data());
    auto y = poisoned<bf16>(x.size());
    moe::combine(tokens, hidden, top_k, rows.data(), slot.data(), nullptr, nullptr, y.data());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // permute copies bits; combine with unit weights of top_k copies gives top_k · x.
    const std::vector<float> got_rows = k2c::to_host(rows);
    const std::vector<double> want_rows = k2c::ref::permute(x, hidden, disp);
    EXPECT_TRUE(close_rel("rows", got_rows, want_rows, 0, 0));
    std::vector<double> want_y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) want_y[i] = top_k * static_cast<double>(x[i]);
    EXPECT_TRUE(close_rel("combine(permute(x))", k2c::to_host(y), want_y, 0x1p-8, 0));
    // Weighted, with a residual: one rounding of an fp32 sum.
    const std::vector<float> w(r.weight.begin(), r.weight.end());
    const auto residual = k2c::random_values<float>(x.size(), seed_for("permute residual"));
    auto d_w = upload(w);
    auto d_res = upload(residual);
    moe::combine(tokens, hidden, top_k, rows.data(), slot.data(), d_w.data(), d_res.data(), y.data());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<double> want = k2c::ref::combine(want_rows, tokens, hidden, top_k, disp, r);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] += residual[i];
    EXPECT_TRUE(close_rel("combine", k2c::to_host(y), want, 0x1p-8, 1e-6));
  }
}

TEST(MoeGroupedGemm, Forward) {
  K2C_REQUIRE_GPU();
  std::mt19937_64 rng(seed_for("grouped"));
  check_grouped_gemm({300}, 64, 128, true, false, false);
  check_grouped_gemm({0, 5, 0, 257, 1, 0}, 136, 64, true, false, false);
  check_grouped_gemm(group_sizes(rng, 9, 400), 200, 96, true, true, false);
  check_grouped_gemm(group_sizes(rng, 7, 300), 96, 200, false, false, false);
  check_grouped_gemm(group_sizes(rng, 5, 300), 72, 40, false, true, true);
  check_grouped_gemm(group_sizes(rng, 4, 200), 37, 45, true, false, false);  // element copies: n, k not multiples of 8
  check_grouped_gemm(group_sizes(rng, 4, 200), 64, 96, false, false, true);   // bf16 C += A·B
  check_grouped_gemm(group_sizes(rng, 4, 200), 45, 37, false, true, true);
  check_grouped_gemm({0, 0, 0}, 16, 16, true, false, false);  // nothing to do
  check_grouped_gemm({64}, 5, 2048, true, true, false);      // a router's shape: few columns, long rows
}

TEST(MoeGroupedGemm, WeightGrad) {
  K2C_REQUIRE_GPU();
  std::mt19937_64 rng(seed_for("weight grad"));
  check_weight_grad({300}, 64, 128);
  check_weight_grad({0, 5, 0, 257, 1, 0}, 136, 64);  // empty groups must get zeros
  check_weight_grad(group_sizes(rng, 8, 400), 96, 200);
  check_weight_grad(group_sizes(rng, 4, 200), 37, 45);
  check_weight_grad({1000}, 5, 64);  // the router's dW: dlogits [T][E]ᵀ · x
}

TEST(MoeLayer, Forward) {
  K2C_REQUIRE_GPU();
  for (const LayerCase& lc : layer_cases()) check_layer_forward(lc);
}

TEST(MoeLayer, Backward) {
  K2C_REQUIRE_GPU();
  const auto cases = layer_cases();
  for (const LayerCase& lc : cases) check_layer_backward(lc, false);
  check_layer_backward(cases[0], true);
  check_layer_backward(cases[2], true);
  // No tokens: every weight's gradient is an empty sum and must still be written, as zeros.
  LayerCase none = cases[1];
  none.tokens = 0;
  check_layer_backward(none, false);
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

// The layer's forward + backward at the module's shape against the naive layer in the same
// run; both outputs are compared at sampled tokens. Rate: the layer's FLOPs per second.
TEST(MoeLayerPerf, ForwardBackward) {
  K2C_REQUIRE_TIMING();
  const moe::RouterConfig c{kExperts, kTopK, moe::Score::softmax, 1, 1, false, 1.0f};
  const int T = kTokens, d = kHidden, f = kFfn, sf = kSharedFfn, E = kExperts;
  // Device-side random data: the host reference is far too slow at this size.
  k2c::DeviceBuffer<bf16> x(static_cast<std::size_t>(T) * d), dy(x.size()), w_router(static_cast<std::size_t>(E) * d),
      w13(static_cast<std::size_t>(E) * 2 * f * d), w2(static_cast<std::size_t>(E) * d * f),
      sw13(static_cast<std::size_t>(2) * sf * d), sw2(static_cast<std::size_t>(d) * sf), y(x.size()), dx(x.size());
  k2c::fill_uniform_device(x.data(), x.size(), seed_for("layer x"));
  k2c::fill_uniform_device(dy.data(), dy.size(), seed_for("layer dy"));
  k2c::fill_uniform_device(w_router.data(), w_router.size(), seed_for("layer wr"), -0.1f, 0.1f);
  k2c::fill_uniform_device(w13.data(), w13.size(), seed_for("layer w13"), -0.066f, 0.066f);
  k2c::fill_uniform_device(w2.data(), w2.size(), seed_for("layer w2"), -0.08f, 0.08f);
  k2c::fill_uniform_device(sw13.data(), sw13.size(), seed_for("layer sw13"), -0.066f, 0.066f);
  k2c::fill_uniform_device(sw2.data(), sw2.size(), seed_for("layer sw2"), -0.056f, 0.056f);
  k2c::DeviceBuffer<float> logits(static_cast<std::size_t>(T) * E), scores(logits.size()), weight(static_cast<std::size_t>(T) * kTopK),
      g_router(w_router.size()), g13(w13.size()), g2(w2.size()), gs13(sw13.size()), gs2(sw2.size());
  k2c::DeviceBuffer<int> expert(static_cast<std::size_t>(T) * kTopK), counts(E);
  const moe::Layer layer{c, d, f, sf, -1, w_router.data(), nullptr, w13.data(), w2.data(), sw13.data(), sw2.data()};
  k2c::DeviceBuffer<char> saved(moe::forward_workspace_bytes(layer, T)), work(moe::backward_workspace_bytes(layer, T));
  const moe::Routing r{logits.data(), scores.data(), expert.data(), weight.data(), counts.data()};
  const moe::Grads g{g_router.data(), g13.data(), g2.data(), gs13.data(), gs2.data()};
  auto step = [&] {
    moe::forward(layer, T, x.data(), y.data(), r, saved.data());
    moe::backward(layer, T, x.data(), dy.data(), r, saved.data(), nullptr, dx.data(), g, work.data());
  };
  k2c::baseline::NaiveMoe naive({T, d, f, sf, E, kTopK, x.data(), dy.data(), w_router.data(), w13.data(), w2.data(),
                                 sw13.data(), sw2.data()});
  y.poison();
  dx.poison();
  step();
  naive.step();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  record_loads(counts.download());
  // Both layers' y and dx at sampled tokens: two bf16 pipelines of the same sums. The two compute
  // the logits in different orders, so a token at a near tie may choose differently; such tokens
  // (their y and dx depend on their own choice only) are left out, and must be rare.
  const std::vector<int> ours_e = expert.download(), theirs_e = naive.expert();
  std::vector<bool> same(T, true);
  int differ = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<int> a(ours_e.begin() + t * kTopK, ours_e.begin() + (t + 1) * kTopK);
    std::vector<int> b(theirs_e.begin() + t * kTopK, theirs_e.begin() + (t + 1) * kTopK);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b) same[t] = false, ++differ;
  }
  EXPECT_LE(differ, T / 1000) << "tokens routed differently from the naive layer";
  for (auto [what, ours, theirs] : {std::tuple{"y", k2c::to_host(y), naive.y()}, {"dx", k2c::to_host(dx), naive.dx()}}) {
    double sq = 0;
    for (float v : theirs) sq += static_cast<double>(v) * v;
    const double rms = std::sqrt(sq / theirs.size());
    std::mt19937_64 rng(seed_for("layer samples"));
    std::size_t bad = 0;
    for (int i = 0; i < 4096; ++i) {
      const std::size_t at = rng() % ours.size();
      if (!same[at / d]) continue;
      if (!(std::abs(ours[at] - theirs[at]) <= 0x1p-6 * std::abs(theirs[at]) + 0x1p-4 * rms)) ++bad;
    }
    EXPECT_EQ(bad, 0u) << what << " differs from the naive layer's at sampled elements";
  }
  const k2c::Timing ours = k2c::time_gpu(step, {.warmup = 1, .repeats = 5});
  const k2c::Timing base = k2c::time_gpu([&] { naive.step(); }, {.warmup = 1, .repeats = 3});
  // Routed experts 6·(T·k)·d·f forward plus the shared experts' 6·T·d·sf, three times that with
  // the backward pass; the router's GEMMs are negligible.
  const double flops = 3.0 * (6.0 * T * kTopK * static_cast<double>(d) * f + 6.0 * T * static_cast<double>(d) * sf);
  ::testing::Test::RecordProperty("layer_ms", std::to_string(ours.median_ms));
  ::testing::Test::RecordProperty("naive_ms", std::to_string(base.median_ms));
  K2C_EXPECT_PERF(flops / ours.median_ms * 1e-9, flops / base.median_ms * 1e-9,
                  "forward + backward at T 16384, d 2048, 64 experts of 1408, top-6, shared 2816, vs the naive layer");
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
