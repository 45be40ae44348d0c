// autograder/09_flash_attention/test_flash_attention.cu — tests of module 09 (contract:
// flash_attention.h).
//
// Tolerance. Inputs are bf16 values, so the double-precision CPU reference sees exactly what the
// kernels see, and every product of two inputs is exact in fp32. The errors that matter are the
// bf16 roundings of intermediates, each a relative error of at most 2^-8:
//   forward   P rounded before O += P·V moves O_ic by at most 2^-8·Σ_j P_ij·|V_jc|; O itself is
//             rounded once more (2^-8·|O_ic|).
//   backward  P rounded before dV += Pᵀ·dO (2^-8·Σ_i P_ij·|dO_ic|); dS rounded before dK and dQ
//             (2^-8·|dS_ij| per term); D_i = Σ dO_i ∘ O_i computed from the bf16 O the pass is
//             given (an error of at most 2^-8·Σ_c |dO_ic·O_ic| in D_i, times P_ij in dS_ij); and
//             each gradient is rounded once (2^-8·|ref|).
// The CPU reference returns those sums of absolute terms as "magnitudes"
// (k2c/reference/reference.h), and every element must lie within
//   1.25 · 2^-8 · (magnitude + |ref|) + 1e-5
// where the factor 1.25 covers fp32 accumulation, the approximate exp2 (2 ulp) and lse's own fp32
// rounding, all below 2^-20 relative, with ample room; 1e-5 covers elements whose terms cancel to
// nearly nothing. lse is fp32 throughout: a sum of up to kv_len terms, so within
// 1e-4 + kv_len·6e-8 + 1e-6·|lse|; +inf (a query that sees no key) must be exactly +inf.
// What the bounds catch: a missing or doubled key block moves O or a gradient by its share of the
// terms, a sixteenth of them or more at the sizes tested, against a bound of 2^-8 of them; a mask
// off by one key, an unwritten element (outputs are poisoned with NaN first) or a NaN fails at
// once.
//
// Speed: FLOPs counted as FlashAttention's benchmarks do (4·B·H·Nq·Nk·d forward, halved when
// causal; 2.5× that backward), divided by cuBLAS's bf16 GEMM rate at 4096³ measured in the same
// run. The timed runs' outputs are spot-checked at fresh random rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "flash_attention.h"
#include "k2c/device/buffer.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/bf16.h"
#include "k2c/testing/testing.h"
#include "k2c/testing/witness.h"

namespace fa = k2c::flash_attention;
using k2c::bf16;
using k2c::testing::seed_for;
using Shape = fa::Shape;

namespace {

std::string describe(const Shape& s) {
  std::ostringstream os;
  os << "B" << s.batch << " H" << s.heads << "/" << s.kv_heads << " q" << s.q_len << " kv" << s.kv_len << " d"
     << s.head_dim << (s.causal ? " causal" : "") << " scale " << s.scale
     << (s.layout == fa::Layout::tokens_first ? " tokens first" : "");
  return os.str();
}

Shape make_shape(int batch, int heads, int kv_heads, int q_len, int kv_len, int d, bool causal) {
  return {batch, heads, kv_heads, q_len, kv_len, d, causal, 1.0f / std::sqrt(static_cast<float>(d))};
}

k2c::ref::AttentionShape ref_shape(const Shape& s) {
  return {s.batch, s.heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, s.causal, static_cast<double>(s.scale)};
}

std::size_t q_elems(const Shape& s) { return static_cast<std::size_t>(s.batch) * s.heads * s.q_len * s.head_dim; }
std::size_t kv_elems(const Shape& s) { return static_cast<std::size_t>(s.batch) * s.kv_heads * s.kv_len * s.head_dim; }
std::size_t rows(const Shape& s) { return static_cast<std::size_t>(s.batch) * s.heads * s.q_len; }

// The reference works heads first. A [batch][heads][len][d] tensor in the shape's layout
// (tokens_first: [batch][len][heads][d]), and from it back; `heads` and `len` are q's or k's.
std::vector<float> permuted(const std::vector<float>& x, const Shape& s, int heads, int len, bool to_layout) {
  if (s.layout == fa::Layout::heads_first) return x;
  std::vector<float> out(x.size());
  const std::size_t d = s.head_dim;
  for (std::size_t b = 0; b < std::size_t(s.batch); ++b)
    for (std::size_t h = 0; h < std::size_t(heads); ++h)
      for (std::size_t i = 0; i < std::size_t(len); ++i) {
        const std::size_t heads_first = ((b * heads + h) * len + i) * d, tokens_first = ((b * len + i) * heads + h) * d;
        const std::size_t from = to_layout ? heads_first : tokens_first, to = to_layout ? tokens_first : heads_first;
        std::copy_n(x.begin() + from, d, out.begin() + to);
      }
  return out;
}
std::vector<float> q_in_layout(const std::vector<float>& x, const Shape& s) { return permuted(x, s, s.heads, s.q_len, true); }
std::vector<float> kv_in_layout(const std::vector<float>& x, const Shape& s) {
  return permuted(x, s, s.kv_heads, s.kv_len, true);
}
std::vector<float> q_from_layout(const std::vector<float>& x, const Shape& s) {
  return permuted(x, s, s.heads, s.q_len, false);
}
std::vector<float> kv_from_layout(const std::vector<float>& x, const Shape& s) {
  return permuted(x, s, s.kv_heads, s.kv_len, false);
}

// Q and K in [-2, 2] make the softmax fairly peaked (scores of standard deviation about 1.3 at
// any head_dim), so masks and tiles change the answer visibly; V and dO in [-1, 1].
struct Inputs {
  std::vector<float> q, k, v, dout;
};
Inputs make_inputs(const Shape& s, const std::string& tag) {
  return {k2c::random_values<bf16>(q_elems(s), seed_for(tag + "/q"), -2.0f, 2.0f),
          k2c::random_values<bf16>(kv_elems(s), seed_for(tag + "/k"), -2.0f, 2.0f),
          k2c::random_values<bf16>(kv_elems(s), seed_for(tag + "/v"), -1.0f, 1.0f),
          k2c::random_values<bf16>(q_elems(s), seed_for(tag + "/dout"), -1.0f, 1.0f)};
}

double bound(double ref, double magnitude) { return 1.25 * std::ldexp(magnitude + std::abs(ref), -8) + 1e-5; }

// got[i] against want[i] within bound(want, magnitude); where[i] is its index in the full tensor
// (rows of head_dim), for the report.
::testing::AssertionResult check_values(const char* what, const std::vector<float>& got,
                                        const std::vector<double>& want, const std::vector<double>& magnitude,
                                        int head_dim, const std::vector<std::size_t>* where = nullptr) {
  std::ostringstream bad;
  std::size_t count = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isfinite(got[i]) && std::abs(got[i] - want[i]) <= bound(want[i], magnitude[i])) continue;
    const std::size_t at = where ? (*where)[i] : i;
    if (count++ < 6)
      bad << " [row " << at / head_dim << ", col " << at % head_dim << "] got " << got[i] << " want " << want[i]
          << " ±" << bound(want[i], magnitude[i]) << ";";
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << count << " of " << got.size() << " wrong:" << bad.str();
}

::testing::AssertionResult check_lse(const std::vector<float>& got, const std::vector<double>& want, int kv_len) {
  std::ostringstream bad;
  std::size_t count = 0;
  const double tol = 1e-4 + kv_len * 6e-8;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::isinf(want[i]) ? (std::isinf(got[i]) && got[i] > 0)
                                        : std::isfinite(got[i]) && std::abs(got[i] - want[i]) <= tol + 1e-6 * std::abs(want[i]);
    if (ok) continue;
    if (count++ < 6) bad << " [row " << i << "] got " << got[i] << " want " << want[i] << ";";
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "lse: " << count << " of " << got.size() << " wrong:" << bad.str();
}

enum class Path { flash, naive, hopper };

// One forward call on device tensors, by the path named (the naive one with a poisoned workspace).
void run_forward(Path path, const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse) {
  if (path == Path::flash) {
    fa::forward(s, q, k, v, o, lse);
  } else if (path == Path::hopper) {
    fa::forward_hopper(s, q, k, v, o, lse);
  } else {
    k2c::DeviceBuffer<float> work(fa::naive_workspace_bytes(s) / sizeof(float));
    work.poison();
    fa::naive_forward(s, q, k, v, o, lse, work.data());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the workspace is freed
  }
}

const char* path_name(Path path) { return path == Path::naive ? " (naive)" : path == Path::hopper ? " (Hopper)" : ""; }

// One forward call on one shape, outputs poisoned, every element checked.
void check_forward(const Shape& s, Path path = Path::flash) {
  SCOPED_TRACE(describe(s) + path_name(path));
  const Inputs in = make_inputs(s, describe(s));
  auto dq = k2c::to_device<bf16>(q_in_layout(in.q, s)), dk = k2c::to_device<bf16>(kv_in_layout(in.k, s)),
       dv = k2c::to_device<bf16>(kv_in_layout(in.v, s));
  k2c::DeviceBuffer<bf16> o(q_elems(s));
  k2c::DeviceBuffer<float> lse(rows(s));
  o.poison();
  lse.poison();
  run_forward(path, s, dq.data(), dk.data(), dv.data(), o.data(), lse.data());
  const cudaError_t err = cudaDeviceSynchronize();
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  const auto ref = k2c::ref::attention_forward(in.q, in.k, in.v, ref_shape(s));
  EXPECT_TRUE(check_values("o", q_from_layout(k2c::to_host(o), s), ref.o, ref.o_magnitude, s.head_dim));
  EXPECT_TRUE(check_lse(k2c::to_host(lse), ref.lse, s.kv_len));
}

// A head's output depends on that head's inputs only. Kernels load whole tiles, and a tile that
// hangs past a head's last row (100 rows here, a tail for every tile size) must not bring in what
// lies there: batch 1 is all NaN, which P = 0 would not cancel, and batch 0 must still match the
// reference computed without it.
void check_heads_apart(Path path, fa::Layout layout = fa::Layout::heads_first) {
  for (int d : {64, 128})
    for (bool causal : {false, true}) {
      Shape one = make_shape(1, 2, 1, 100, 100, d, causal), two = make_shape(2, 2, 1, 100, 100, d, causal);
      one.layout = two.layout = layout;
      SCOPED_TRACE(describe(two) + path_name(path) + ", batch 1 all NaN");
      const Inputs in = make_inputs(one, describe(one));
      auto then_nan = [](std::vector<float> x) {
        x.resize(2 * x.size(), std::numeric_limits<float>::quiet_NaN());
        return x;
      };
      auto dq = k2c::to_device<bf16>(then_nan(q_in_layout(in.q, one))),
           dk = k2c::to_device<bf16>(then_nan(kv_in_layout(in.k, one))),
           dv = k2c::to_device<bf16>(then_nan(kv_in_layout(in.v, one)));
      k2c::DeviceBuffer<bf16> o(q_elems(two));
      k2c::DeviceBuffer<float> lse(rows(two));
      o.poison();
      lse.poison();
      run_forward(path, two, dq.data(), dk.data(), dv.data(), o.data(), lse.data());
      const cudaError_t err = cudaDeviceSynchronize();
      ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
      std::vector<float> got_o = k2c::to_host(o), got_lse = k2c::to_host(lse);
      got_o.resize(q_elems(one));
      got_lse.resize(rows(one));
      const auto ref = k2c::ref::attention_forward(in.q, in.k, in.v, ref_shape(one));
      EXPECT_TRUE(check_values("o of batch 0", q_from_layout(got_o, one), ref.o, ref.o_magnitude, d));
      EXPECT_TRUE(check_lse(got_lse, ref.lse, one.kv_len));
    }
}

// One backward call, given the reference's O (rounded to bf16, as a forward pass stores it) and
// lse, so that a forward bug cannot hide here; outputs and workspace poisoned.
void check_backward(const Shape& s, Path path = Path::flash) {
  SCOPED_TRACE(describe(s) + (path == Path::hopper ? " (Hopper)" : ""));
  const Inputs in = make_inputs(s, describe(s));
  const auto fwd = k2c::ref::attention_forward(in.q, in.k, in.v, ref_shape(s));
  const std::vector<float> o(fwd.o.begin(), fwd.o.end()), lse(fwd.lse.begin(), fwd.lse.end());
  auto dq_in = k2c::to_device<bf16>(q_in_layout(in.q, s)), dk_in = k2c::to_device<bf16>(kv_in_layout(in.k, s)),
       dv_in = k2c::to_device<bf16>(kv_in_layout(in.v, s));
  auto d_o = k2c::to_device<bf16>(q_in_layout(o, s)), d_dout = k2c::to_device<bf16>(q_in_layout(in.dout, s));
  k2c::DeviceBuffer<float> d_lse{std::span<const float>(lse)};
  k2c::DeviceBuffer<bf16> dq(q_elems(s)), dk(kv_elems(s)), dv(kv_elems(s));
  k2c::DeviceBuffer<float> work((fa::backward_workspace_bytes(s) + 3) / 4);
  dq.poison();
  dk.poison();
  dv.poison();
  work.poison();
  const auto backward = path == Path::hopper ? fa::backward_hopper : fa::backward;
  backward(s, dq_in.data(), dk_in.data(), dv_in.data(), d_o.data(), d_dout.data(), d_lse.data(), dq.data(),
           dk.data(), dv.data(), work.data(), nullptr);
  const cudaError_t err = cudaDeviceSynchronize();
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  // The reference recomputes O in double; the kernel's D uses the bf16 O it is given, which the
  // dq and dk magnitudes account for.
  const auto ref = k2c::ref::attention_backward(in.q, in.k, in.v, in.dout, ref_shape(s));
  EXPECT_TRUE(check_values("dq", q_from_layout(k2c::to_host(dq), s), ref.dq, ref.dq_magnitude, s.head_dim));
  EXPECT_TRUE(check_values("dk", kv_from_layout(k2c::to_host(dk), s), ref.dk, ref.dk_magnitude, s.head_dim));
  EXPECT_TRUE(check_values("dv", kv_from_layout(k2c::to_host(dv), s), ref.dv, ref.dv_magnitude, s.head_dim));
}

// Every (head_dim, causal) pair on the module's sequence lengths, q_len == kv_len: one key, tiles' edges, a long row.
std::vector<Shape> length_shapes() {
  std::vector<Shape> out;
  for (int d : {64, 128})
    for (bool causal : {false, true})
      for (int n : {1, 17, 63, 64, 65, 1000}) out.push_back(make_shape(1, 2, 2, n, n, d, causal));
  return out;
}

// Causal with q_len != kv_len, both ways: queries that see no key at all (q_len > kv_len), a
// diagonal that crosses tiles off their corners, and kv_len == 0.
std::vector<Shape> unequal_shapes() {
  std::vector<Shape> out;
  for (int d : {64, 128})
    for (auto [nq, nk] : {std::pair{17, 100}, {100, 17}, {64, 200}, {200, 64}, {1, 130}, {130, 1}, {129, 300}})
      out.push_back(make_shape(1, 2, 1, nq, nk, d, true));
  out.push_back(make_shape(2, 2, 2, 50, 300, 128, false));
  out.push_back(make_shape(1, 2, 2, 40, 0, 64, false));
  out.push_back(make_shape(1, 2, 2, 40, 0, 128, true));
  return out;
}

// Grouped-query heads: 8 query heads over 8, 2 and 1 kv heads.
std::vector<Shape> grouped_shapes() {
  std::vector<Shape> out;
  for (int kv_heads : {8, 2, 1})
    for (bool causal : {false, true}) out.push_back(make_shape(2, 8, kv_heads, 150, 150, kv_heads == 2 ? 64 : 128, causal));
  out.push_back(make_shape(1, 8, 1, 70, 200, 128, true));
  return out;
}

// The tokens_first layout, where the rows of a head lie among those of the other heads: one row,
// tails of every tile size, grouped heads (q and kv rows then lie different distances apart),
// queries that see no key, no keys at all, and more than one batch.
std::vector<Shape> tokens_first_shapes() {
  std::vector<Shape> out;
  for (int d : {64, 128}) {
    out.push_back(make_shape(1, 3, 3, 1, 1, d, false));
    out.push_back(make_shape(2, 4, 2, 129, 129, d, true));
    out.push_back(make_shape(2, 6, 1, 65, 200, d, false));
    out.push_back(make_shape(1, 4, 4, 150, 70, d, true));
    out.push_back(make_shape(3, 2, 2, 300, 300, d, true));
  }
  out.push_back(make_shape(1, 2, 2, 40, 0, 64, false));
  for (Shape& s : out) s.layout = fa::Layout::tokens_first;
  return out;
}

std::vector<Shape> random_shapes(std::uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<Shape> out;
  for (int i = 0; i < count; ++i) {
    const int kv_heads = pick(1, 3), group = pick(1, 4), d = pick(0, 1) ? 128 : 64;
    Shape s = make_shape(pick(1, 2), kv_heads * group, kv_heads, pick(1, 400), pick(1, 400), d, pick(0, 1) == 1);
    if (pick(0, 2) == 0) s.scale = std::uniform_real_distribution<float>(0.02f, 0.3f)(rng);
    out.push_back(s);
  }
  return out;
}

// ---- speed ------------------------------------------------------------------------------------

// The graded shape: B = 4, H = 32, N = 4096, d = 128 (or 64), where PyTorch's backends are measured too.
Shape perf_shape(int d, bool causal) { return make_shape(4, 32, 32, 4096, 4096, d, causal); }

double forward_flops(const Shape& s) {
  return 4.0 * s.batch * s.heads * static_cast<double>(s.q_len) * s.kv_len * s.head_dim * (s.causal ? 0.5 : 1.0);
}

// Everything a timed test needs on the device and (for the spot checks) on the host.
struct Problem {
  Shape s;
  Inputs in;
  k2c::DeviceBuffer<bf16> q, k, v, dout, o, dq, dk, dv;
  k2c::DeviceBuffer<float> lse, work;
  explicit Problem(const Shape& shape)
      : s(shape), in(make_inputs(shape, "perf " + describe(shape))), q(k2c::to_device<bf16>(in.q)),
        k(k2c::to_device<bf16>(in.k)), v(k2c::to_device<bf16>(in.v)), dout(k2c::to_device<bf16>(in.dout)),
        o(q_elems(shape)), dq(q_elems(shape)), dk(kv_elems(shape)), dv(kv_elems(shape)), lse(rows(shape)) {}
};

// Output rows of the forward pass at random (batch, head, query), each against the reference
// computed on its own: one query over exactly the keys it sees.
bool spot_check_forward(const Problem& p, std::uint64_t seed, const char* what) {
  const Shape& s = p.s;
  const int d = s.head_dim;
  const std::vector<float> o = k2c::to_host(p.o), lse = k2c::to_host(p.lse);
  std::mt19937_64 rng(seed);
  std::vector<float> got, got_lse;
  std::vector<double> want, mag, want_lse;
  std::vector<std::size_t> where;
  for (int t = 0; t < 24; ++t) {
    const int b = static_cast<int>(rng() % s.batch), h = static_cast<int>(rng() % s.heads),
              i = static_cast<int>(rng() % s.q_len), g = h / (s.heads / s.kv_heads);
    const int seen = s.causal ? std::clamp(i + s.kv_len - s.q_len + 1, 0, s.kv_len) : s.kv_len;
    const std::size_t qrow = (static_cast<std::size_t>(b) * s.heads + h) * s.q_len + i;
    const std::size_t kv0 = (static_cast<std::size_t>(b) * s.kv_heads + g) * s.kv_len * d;
    const std::vector<float> q1(p.in.q.begin() + qrow * d, p.in.q.begin() + (qrow + 1) * d);
    const std::vector<float> k1(p.in.k.begin() + kv0, p.in.k.begin() + kv0 + static_cast<std::size_t>(seen) * d);
    const std::vector<float> v1(p.in.v.begin() + kv0, p.in.v.begin() + kv0 + static_cast<std::size_t>(seen) * d);
    const auto ref = k2c::ref::attention_forward(q1, k1, v1, {1, 1, 1, 1, seen, d, false, s.scale});
    for (int c = 0; c < d; ++c) {
      got.push_back(o[qrow * d + c]);
      want.push_back(ref.o[c]);
      mag.push_back(ref.o_magnitude[c]);
      where.push_back(qrow * d + c);
    }
    got_lse.push_back(lse[qrow]);
    want_lse.push_back(ref.lse[0]);
  }
  const auto ok_o = check_values("o", got, want, mag, d, &where);
  const auto ok_lse = check_lse(got_lse, want_lse, s.kv_len);
  EXPECT_TRUE(ok_o) << what;
  EXPECT_TRUE(ok_lse) << what;
  return ok_o && ok_lse;
}

// Gradients at random key rows (dk, dv) and query rows (dq), given the o and lse the pass used.
bool spot_check_backward(const Problem& p, std::uint64_t seed, const char* what) {
  const Shape& s = p.s;
  const int d = s.head_dim;
  const std::vector<float> o = k2c::to_host(p.o), lse = k2c::to_host(p.lse);
  const std::vector<float> dq = k2c::to_host(p.dq), dk = k2c::to_host(p.dk), dv = k2c::to_host(p.dv);
  std::mt19937_64 rng(seed);
  bool ok = true;
  for (int t = 0; t < 6; ++t) {
    const int b = static_cast<int>(rng() % s.batch);
    const int g = static_cast<int>(rng() % s.kv_heads), j = static_cast<int>(rng() % s.kv_len);
    const auto kg = k2c::ref::attention_key_gradient_at(p.in.q, p.in.k, p.in.v, o, p.in.dout, lse, ref_shape(s), b, g, j);
    const std::size_t krow = ((static_cast<std::size_t>(b) * s.kv_heads + g) * s.kv_len + j) * d;
    std::vector<std::size_t> where(d);
    for (int c = 0; c < d; ++c) where[c] = krow + c;
    const auto ok_dk = check_values("dk", std::vector<float>(dk.begin() + krow, dk.begin() + krow + d), kg.dk, kg.dk_magnitude, d, &where);
    const auto ok_dv = check_values("dv", std::vector<float>(dv.begin() + krow, dv.begin() + krow + d), kg.dv, kg.dv_magnitude, d, &where);
    const int h = static_cast<int>(rng() % s.heads), i = static_cast<int>(rng() % s.q_len);
    const auto qg = k2c::ref::attention_query_gradient_at(p.in.q, p.in.k, p.in.v, o, p.in.dout, lse, ref_shape(s), b, h, i);
    const std::size_t qrow = ((static_cast<std::size_t>(b) * s.heads + h) * s.q_len + i) * d;
    for (int c = 0; c < d; ++c) where[c] = qrow + c;
    const auto ok_dq = check_values("dq", std::vector<float>(dq.begin() + qrow, dq.begin() + qrow + d), qg.dq, qg.dq_magnitude, d, &where);
    EXPECT_TRUE(ok_dk) << what;
    EXPECT_TRUE(ok_dv) << what;
    EXPECT_TRUE(ok_dq) << what;
    ok = ok && ok_dk && ok_dv && ok_dq;
  }
  return ok;
}

enum class Pass { forward, backward, naive, hopper, hopper_backward };

// Rate in FLOP/s: one checked run, then the timed runs (median, L2 flushed), checked again at
// fresh random rows. The backward pass runs on the o and lse of this module's own forward pass.
double measure(Pass pass, const Shape& s, int repeats) {
  Problem p(s);
  const bool backward = pass == Pass::backward || pass == Pass::hopper_backward;
  const std::size_t work_bytes = backward ? fa::backward_workspace_bytes(s)
                                 : pass == Pass::naive ? fa::naive_workspace_bytes(s)
                                                       : 0;
  p.work = k2c::DeviceBuffer<float>((work_bytes + 3) / 4);
  auto run = [&] {
    switch (pass) {
      case Pass::forward: fa::forward(s, p.q.data(), p.k.data(), p.v.data(), p.o.data(), p.lse.data()); break;
      case Pass::hopper: fa::forward_hopper(s, p.q.data(), p.k.data(), p.v.data(), p.o.data(), p.lse.data()); break;
      case Pass::naive:
        fa::naive_forward(s, p.q.data(), p.k.data(), p.v.data(), p.o.data(), p.lse.data(), p.work.data());
        break;
      case Pass::backward:
      case Pass::hopper_backward:
        (pass == Pass::backward ? fa::backward : fa::backward_hopper)(s, p.q.data(), p.k.data(), p.v.data(),
                                                                      p.o.data(), p.dout.data(), p.lse.data(),
                                                                      p.dq.data(), p.dk.data(), p.dv.data(),
                                                                      p.work.data(), nullptr);
        break;
    }
  };
  auto check = [&](std::uint64_t seed, const char* what) {
    return backward ? spot_check_backward(p, seed, what) : spot_check_forward(p, seed, what);
  };
  if (backward) {
    fa::forward(s, p.q.data(), p.k.data(), p.v.data(), p.o.data(), p.lse.data());
    p.dq.poison();
    p.dk.poison();
    p.dv.poison();
  } else {
    p.o.poison();
    p.lse.poison();
  }
  run();
  if (cudaDeviceSynchronize() != cudaSuccess) return 0;
  if (!check(seed_for("perf samples"), "the first run's output")) return 0;
  const k2c::Timing t = k2c::time_gpu(run, {.warmup = 2, .repeats = repeats});
  if (!check(std::random_device{}(), "the timed runs' output")) return 0;
  const double flops = forward_flops(s) * (backward ? 2.5 : 1.0);
  return flops / (t.median_ms * 1e-3);
}

void expect_rate(Pass pass, const Shape& s, int repeats) {
  const double ceiling = k2c::bf16_gemm_rate(4096);
  const double achieved = measure(pass, s, repeats);
  const char* name = pass == Pass::forward           ? "forward"
                     : pass == Pass::backward        ? "backward"
                     : pass == Pass::hopper          ? "wgmma forward"
                     : pass == Pass::hopper_backward ? "wgmma backward"
                                                     : "naive forward";
  K2C_EXPECT_PERF(achieved / 1e12, ceiling / 1e12,
                  std::string(name) + " at " + describe(s) + " vs cuBLAS bf16 at 4096^3, " + std::to_string(repeats) +
                      " runs");
}

// A valid small shape, and shapes that each break one rule of check_shape.
const Shape kValidShape = make_shape(1, 2, 1, 2, 2, 64, true);
std::vector<Shape> invalid_shapes() {
  auto with = [](auto change) {
    Shape s = kValidShape;
    change(s);
    return s;
  };
  return {with([](Shape& s) { s.head_dim = 96; }), with([](Shape& s) { s.kv_heads = 3; }),
          with([](Shape& s) { s.kv_heads = 0; }),   with([](Shape& s) { s.q_len = -1; }),
          with([](Shape& s) { s.scale = 0; }),      with([](Shape& s) { s.scale = NAN; }),
          with([](Shape& s) { s.batch = -2; }),     with([](Shape& s) { s.heads = s.kv_heads = 70000; }),
          with([](Shape& s) { s.layout = static_cast<fa::Layout>(7); })};
}

// Small device buffers for the argument checks: every tensor argument points into `buf`.
struct ArgBuffers {
  k2c::DeviceBuffer<bf16> buf{64 * 8};
  k2c::DeviceBuffer<float> lse{8};
  bf16* x = buf.data();
};

}  // namespace

// The grader's own runs of the timed passes (k2c/testing/witness.h), on its buffers.
static Shape witness_shape(const k2c::testing::WitnessLaunch& w) {
  return make_shape(w.dim(0), w.dim(1), w.dim(2), w.dim(3), w.dim(4), w.dim(5), w.dim(6) != 0);
}
K2C_WITNESS(attention_forward) {
  fa::forward(witness_shape(w), w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), w.at<bf16>(3), w.at<float>(4));
}
K2C_WITNESS(attention_forward_hopper) {
  fa::forward_hopper(witness_shape(w), w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), w.at<bf16>(3), w.at<float>(4));
}
// The backward passes on the grader's q, k, v, o, dout and lse (buffers 0-5; dq, dk, dv 6-8). The
// workspace is scratch, not an output: the test program's own, kept for the launches that follow
// at the same shape.
static void* witness_workspace(const Shape& s) {
  static k2c::DeviceBuffer<unsigned char> work;
  const std::size_t bytes = fa::backward_workspace_bytes(s);
  if (work.size() < bytes) work = k2c::DeviceBuffer<unsigned char>(bytes);
  return work.data();
}
K2C_WITNESS(attention_backward) {
  const Shape s = witness_shape(w);
  fa::backward(s, w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), w.at<bf16>(3), w.at<bf16>(4), w.at<float>(5), w.at<bf16>(6),
               w.at<bf16>(7), w.at<bf16>(8), witness_workspace(s));
}
K2C_WITNESS(attention_backward_hopper) {
  const Shape s = witness_shape(w);
  fa::backward_hopper(s, w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), w.at<bf16>(3), w.at<bf16>(4), w.at<float>(5),
                      w.at<bf16>(6), w.at<bf16>(7), w.at<bf16>(8), witness_workspace(s));
}

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(FlashAttentionContract, Implemented) {
  const bool gpu = k2c::testing::gpu_available();
  k2c::DeviceBuffer<bf16> buf(gpu ? 64 * 8 : 0);
  k2c::DeviceBuffer<float> lse(gpu ? 8 : 0);
  bf16* dummy = reinterpret_cast<bf16*>(256);  // never dereferenced: no device to launch on
  bf16* x = gpu ? buf.data() : dummy;
  K2C_EXPECT_IMPLEMENTED(fa::forward(make_shape(1, 1, 1, 1, 1, 64, false), x, x, x, x,
                                     gpu ? lse.data() : reinterpret_cast<float*>(256)));
}

TEST(FlashAttentionArguments, Rejected) {
  K2C_REQUIRE_GPU();
  ArgBuffers a;
  bf16* x = a.x;
  k2c::DeviceBuffer<float>& lse = a.lse;
  const Shape ok = kValidShape;
  // The checks are given in the stub: the points come with a working forward().
  K2C_EXPECT_IMPLEMENTED(fa::forward(ok, x, x, x, x, lse.data()));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const Shape& s : invalid_shapes()) {
    SCOPED_TRACE(describe(s));
    EXPECT_THROW(fa::forward(s, x, x, x, x, lse.data()), std::invalid_argument);
    EXPECT_THROW(fa::naive_forward(s, x, x, x, x, lse.data(), x), std::invalid_argument);
    EXPECT_THROW(fa::backward(s, x, x, x, x, x, lse.data(), x, x, x, x), std::invalid_argument);
  }
  EXPECT_THROW(fa::forward(ok, nullptr, x, x, x, lse.data()), std::invalid_argument);
  EXPECT_THROW(fa::forward(ok, x + 1, x, x, x, lse.data()), std::invalid_argument);  // 2 bytes off
  EXPECT_THROW(fa::backward(ok, x, x, x, x, x, lse.data(), x, x, x, nullptr), std::invalid_argument);
  EXPECT_THROW(fa::naive_forward(ok, x, x, x, x, lse.data(), nullptr), std::invalid_argument);
  Shape tokens_first = ok;
  tokens_first.layout = fa::Layout::tokens_first;
  EXPECT_THROW(fa::naive_forward(tokens_first, x, x, x, x, lse.data(), x), std::invalid_argument);
}

TEST(FlashAttentionNaive, Forward) {
  K2C_REQUIRE_GPU();
  for (const Shape& s : {make_shape(1, 2, 2, 1, 1, 64, false), make_shape(1, 2, 2, 65, 65, 128, true),
                         make_shape(2, 4, 1, 300, 300, 64, true), make_shape(1, 2, 2, 100, 17, 128, true),
                         make_shape(1, 2, 1, 33, 257, 128, false), make_shape(1, 2, 2, 40, 0, 64, false)})
    check_forward(s, Path::naive);
}

TEST(FlashAttentionForward, SequenceLengths) {
  K2C_REQUIRE_GPU();
  for (const Shape& s : length_shapes()) check_forward(s);
  check_heads_apart(Path::flash);
}

TEST(FlashAttentionForward, CausalUnequalLengths) {
  K2C_REQUIRE_GPU();
  for (const Shape& s : unequal_shapes()) check_forward(s);
}

TEST(FlashAttentionForward, GroupedQueryHeads) {
  K2C_REQUIRE_GPU();
  for (const Shape& s : grouped_shapes()) check_forward(s);
}

TEST(FlashAttentionForward, RandomShapes) {
  K2C_REQUIRE_GPU();
  for (const Shape& s : random_shapes(seed_for("shapes"), 8)) check_forward(s);
}

TEST(FlashAttentionBackward, SequenceLengths) {
  K2C_REQUIRE_GPU();
  for (const Shape& s : length_shapes()) check_backward(s);
}

TEST(FlashAttentionBackward, CausalUnequalAndGrouped) {
  K2C_REQUIRE_GPU();
  for (const Shape& s : unequal_shapes()) check_backward(s);
  for (const Shape& s : grouped_shapes()) check_backward(s);
  for (const Shape& s : random_shapes(seed_for("backward shapes"), 4)) check_backward(s);
  // No queries: dk and dv are still written, as zeros.
  check_backward(make_shape(1, 2, 1, 0, 70, 64, false));
}

// The layout of a model's projections (flash_attention.h): forward and backward on shapes whose
// heads interleave row by row, and heads that stay apart (batch 1 all NaN) in that layout too.
TEST(FlashAttentionLayout, TokensFirst) {
  K2C_REQUIRE_GPU();
  const std::vector<Shape> shapes = tokens_first_shapes();
  for (const Shape& s : shapes) check_forward(s);
  for (const Shape& s : shapes) check_backward(s);
  Shape no_queries = make_shape(1, 2, 1, 0, 70, 64, false);
  no_queries.layout = fa::Layout::tokens_first;
  check_backward(no_queries);
  check_heads_apart(Path::flash, fa::Layout::tokens_first);
}

TEST(FlashAttentionForwardPerf, Causal128) {
  K2C_REQUIRE_TIMING();
  expect_rate(Pass::forward, perf_shape(128, true), 20);
}

TEST(FlashAttentionBackwardPerf, Causal128) {
  K2C_REQUIRE_TIMING();
  expect_rate(Pass::backward, perf_shape(128, true), 10);
}

// Recorded for the reference table.
TEST(FlashAttentionForwardPerf, NonCausal128) {
  K2C_REQUIRE_TIMING();
  expect_rate(Pass::forward, perf_shape(128, false), 10);
}

TEST(FlashAttentionForwardPerf, Causal64) {
  K2C_REQUIRE_TIMING();
  expect_rate(Pass::forward, perf_shape(64, true), 20);
}

TEST(FlashAttentionBackwardPerf, NonCausal128) {
  K2C_REQUIRE_TIMING();
  expect_rate(Pass::backward, perf_shape(128, false), 5);
}

TEST(FlashAttentionNaivePerf, Causal128) {
  K2C_REQUIRE_TIMING();
  expect_rate(Pass::naive, perf_shape(128, true), 3);
}

// ---- Part B (bonus): wgmma, skipped with the reason where it cannot run ----------------------

#define REQUIRE_HOPPER()                                                   \
  do {                                                                     \
    K2C_REQUIRE_GPU();                                                     \
    std::string why_;                                                      \
    if (!fa::hopper_supported(&why_)) K2C_SKIP("Part B: " + why_);         \
  } while (0)

// Part B's entry points keep forward()'s and backward()'s checks (given in the stub).
TEST(FlashAttentionHopper, Forward) {
  REQUIRE_HOPPER();
  {
    ArgBuffers a;
    for (const Shape& s : invalid_shapes()) {
      SCOPED_TRACE(describe(s));
      EXPECT_THROW(fa::forward_hopper(s, a.x, a.x, a.x, a.x, a.lse.data()), std::invalid_argument);
    }
    EXPECT_THROW(fa::forward_hopper(kValidShape, a.x + 1, a.x, a.x, a.x, a.lse.data()), std::invalid_argument);
  }
  for (const Shape& s : length_shapes()) check_forward(s, Path::hopper);
  for (const Shape& s : unequal_shapes()) check_forward(s, Path::hopper);
  for (const Shape& s : grouped_shapes()) check_forward(s, Path::hopper);
  for (const Shape& s : random_shapes(seed_for("hopper shapes"), 6)) check_forward(s, Path::hopper);
  check_heads_apart(Path::hopper);
}

// The wgmma backward on the mma.sync backward's fixed shapes, random shapes of its own and no
// queries at all.
TEST(FlashAttentionHopper, Backward) {
  REQUIRE_HOPPER();
  {
    ArgBuffers a;
    bf16* x = a.x;
    for (const Shape& s : invalid_shapes()) {
      SCOPED_TRACE(describe(s));
      EXPECT_THROW(fa::backward_hopper(s, x, x, x, x, x, a.lse.data(), x, x, x, x), std::invalid_argument);
    }
    EXPECT_THROW(fa::backward_hopper(kValidShape, x, x, x, x, x, a.lse.data(), x, x, x, nullptr),
                 std::invalid_argument);
  }
  for (const Shape& s : length_shapes()) check_backward(s, Path::hopper);
  for (const Shape& s : unequal_shapes()) check_backward(s, Path::hopper);
  for (const Shape& s : grouped_shapes()) check_backward(s, Path::hopper);
  for (const Shape& s : random_shapes(seed_for("hopper backward shapes"), 4)) check_backward(s, Path::hopper);
  check_backward(make_shape(1, 2, 1, 0, 70, 64, false), Path::hopper);
}

// Part B in the tokens_first layout, forward and backward, as FlashAttentionLayout.TokensFirst.
TEST(FlashAttentionHopper, TokensFirst) {
  REQUIRE_HOPPER();
  const std::vector<Shape> shapes = tokens_first_shapes();
  for (const Shape& s : shapes) check_forward(s, Path::hopper);
  for (const Shape& s : shapes) check_backward(s, Path::hopper);
  check_heads_apart(Path::hopper, fa::Layout::tokens_first);
}

TEST(FlashAttentionHopperPerf, Causal128) {
  K2C_REQUIRE_TIMING();
  REQUIRE_HOPPER();
  expect_rate(Pass::hopper, perf_shape(128, true), 20);
}

TEST(FlashAttentionHopperPerf, NonCausal128) {
  K2C_REQUIRE_TIMING();
  REQUIRE_HOPPER();
  expect_rate(Pass::hopper, perf_shape(128, false), 10);
}

TEST(FlashAttentionHopperPerf, BackwardCausal128) {
  K2C_REQUIRE_TIMING();
  REQUIRE_HOPPER();
  expect_rate(Pass::hopper_backward, perf_shape(128, true), 10);
}

TEST(FlashAttentionHopperPerf, BackwardNonCausal128) {
  K2C_REQUIRE_TIMING();
  REQUIRE_HOPPER();
  expect_rate(Pass::hopper_backward, perf_shape(128, false), 5);
}
