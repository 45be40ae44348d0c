// test_harness.cpp — the project's own tests of common/: comparison, references, random
// numbers, descriptors over a socket, the rubric parser and K2C_TODO. CPU only; they run everywhere, CI included.
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/core/fd_io.h"
#include "k2c/core/gemm_args.h"
#include "k2c/core/random.h"
#include "k2c/core/rubric.h"
#include "k2c/core/todo.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/compare.h"

// ---------------------------------------------------------------------------- comparison ---

TEST(Compare, AcceptsEqualAndWithinTolerance) {
  const std::vector<float> out = {1.0f, -2.0f, 3.0000002f};
  const std::vector<double> ref = {1.0, -2.0, 3.0};
  EXPECT_TRUE(k2c::compare(out, ref, k2c::kFp32Tolerance).ok);
}

TEST(Compare, CatchesOneWrongValue) {
  std::vector<float> out(1000, 0.5f);
  std::vector<double> ref(1000, 0.5);
  out[617] = 0.51f;
  const auto r = k2c::compare(out, ref, k2c::kFp32Tolerance, 100);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.bad, 1u);
  ASSERT_EQ(r.first.size(), 1u);
  EXPECT_EQ(r.first[0].index, 617u);
  EXPECT_NE(r.summary().find("(6, 17)"), std::string::npos) << r.summary();
}

TEST(Compare, NaNAlwaysFails) {
  std::vector<float> out = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<double> ref = {1.0, 2.0};
  const auto huge = k2c::Tolerance{1e30, 1e30, 1e30};  // even a tolerance that allows anything
  const auto r = k2c::compare(out, ref, huge);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.non_finite, 1u);
  // A NaN in the reference is a bug in the test, and fails too.
  out[1] = 2.0f;
  ref[1] = std::nan("");
  EXPECT_FALSE(k2c::compare(out, ref, huge).ok);
}

TEST(Compare, CatchesUnwrittenPoisonedElement) {
  // Outputs are poisoned with all-ones bytes before a run; an element the kernel skipped stays so.
  std::vector<float> out(64, 1.0f);
  std::uint32_t poison = 0xFFFFFFFFu;
  std::memcpy(&out[63], &poison, sizeof poison);
  const auto r = k2c::compare(out, std::vector<double>(64, 1.0), k2c::kFp32Tolerance);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.first.at(0).index, 63u);
}

TEST(Compare, RelativeNormCatchesSpreadError) {
  // Every element inside the elementwise band, but biased the same way: the norm catches it.
  const std::vector<double> ref(4096, 1.0);
  const std::vector<float> out(4096, 1.0f + 9e-6f);
  const auto r = k2c::compare(out, ref, k2c::Tolerance{1e-5, 0, 1e-6});
  EXPECT_EQ(r.bad, 0u);
  EXPECT_FALSE(r.ok);
}

TEST(Compare, SizeMismatchFails) {
  EXPECT_FALSE(k2c::compare(std::vector<float>(3), std::vector<double>(4), k2c::kFp32Tolerance).ok);
}

// ---------------------------------------------------------------------------- references ---

TEST(Reference, GemmExactOnSmallIntegers) {
  // Small integers make every product and sum exact: a bit-exact first check.
  const int M = 3, N = 4, K = 5;
  std::vector<float> A(M * K), B(K * N), C(M * N);
  for (int i = 0; i < M * K; ++i) A[i] = static_cast<float>(i % 7 - 3);
  for (int i = 0; i < K * N; ++i) B[i] = static_cast<float>(i % 5 - 2);
  for (int i = 0; i < M * N; ++i) C[i] = static_cast<float>(i % 3);
  const auto out = k2c::ref::gemm(M, N, K, 2.0, A, B, -1.0, C);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += A[r * K + k] * B[k * N + c];
      EXPECT_EQ(out[r * N + c], 2.0 * acc - C[r * N + c]);
      EXPECT_EQ(k2c::ref::gemm_at(N, K, 2.0, A, B, -1.0, C, r, c), out[r * N + c]);
    }
}

TEST(Reference, GemmBetaZeroIgnoresNaN) {
  std::vector<float> A = {1, 2}, B = {3, 4}, C = {std::nanf("")};
  const auto out = k2c::ref::gemm(1, 1, 2, 1.0, A, B, 0.0, C);
  EXPECT_EQ(out[0], 11.0);
}

TEST(Reference, GemmArgumentChecks) {
  float x = 0;
  EXPECT_THROW(k2c::check_gemm_args(-1, 1, 1, &x, &x, 0, &x), std::invalid_argument);
  EXPECT_THROW(k2c::check_gemm_args(1, 1, 1, nullptr, &x, 0, &x), std::invalid_argument);
  EXPECT_NO_THROW(k2c::check_gemm_args(0, 7, 3, nullptr, nullptr, 0, nullptr));
  EXPECT_NO_THROW(k2c::check_gemm_args(2, 2, 0, nullptr, nullptr, 1, &x));
}

TEST(Reference, FmaChainsFollowTheContract) {
  const std::vector<float> in = {0.5f};
  const auto out = k2c::ref::fma_chains(in, 2, 2, 0.25f, 0.5f, 1.0f);
  // chain 0: 0.5 -> 1.25 -> 1.625; chain 1: 0.75 -> 1.375 -> 1.6875
  EXPECT_EQ(out[0], 1.625 + 1.6875);
}

TEST(Reference, SoftmaxIsStableAndNormalised) {
  const std::vector<float> x = {1, 2, 3, 10000, 10001, 9999, -5, -5, -5};  // row 2 would overflow exp
  const auto y = k2c::ref::softmax_rows(x, 3, 3);
  for (int r = 0; r < 3; ++r) {
    double sum = 0;
    for (int c = 0; c < 3; ++c) {
      ASSERT_TRUE(std::isfinite(y[r * 3 + c]));
      sum += y[r * 3 + c];
    }
    EXPECT_NEAR(sum, 1.0, 1e-15);
  }
  const double e = std::exp(1.0);
  EXPECT_NEAR(y[0], 1 / (1 + e + e * e), 1e-15);
  // Shift invariance: row 2 is row 1 + 9999, reordered as (middle, largest, smallest).
  EXPECT_NEAR(y[1], y[3], 1e-15);
  EXPECT_NEAR(y[2], y[4], 1e-15);
  EXPECT_NEAR(y[0], y[5], 1e-15);
  EXPECT_NEAR(y[6], 1.0 / 3, 1e-15);
}

namespace {
// Values on a 2^-10 grid, so that x ± 2^-7 is exact in fp32 for the finite differences below.
std::vector<float> grid_values(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  k2c::fill_uniform(v, seed);
  for (float& x : v) x = std::round(x * 1024.0f) / 1024.0f;
  return v;
}

// The central difference (f(x + h·e_i) − f(x − h·e_i)) / 2h of f() in x[i], x[i] restored after.
template <class F>
double central_difference(std::vector<float>& x, std::size_t i, double h, F f) {
  const float keep = x[i];
  x[i] = keep + static_cast<float>(h);
  const double up = f();
  x[i] = keep - static_cast<float>(h);
  const double down = f();
  x[i] = keep;
  return (up - down) / (2 * h);
}
}  // namespace

TEST(Reference, RmsNormBackwardMatchesFiniteDifferences) {
  const int rows = 3, cols = 8;
  const double eps = 1e-5, h = 1.0 / 128;
  std::vector<float> x = grid_values(rows * cols, 1), gamma = grid_values(cols, 2),
                     w = grid_values(rows * cols, 3);
  // L = Σ w·y, so dL/dy = w.
  auto loss = [&](const std::vector<float>& xs, const std::vector<float>& gs) {
    const auto f = k2c::ref::rmsnorm_forward(xs, gs, rows, cols, eps);
    double l = 0;
    for (std::size_t i = 0; i < f.y.size(); ++i) l += w[i] * f.y[i];
    return l;
  };
  const auto b = k2c::ref::rmsnorm_backward(x, gamma, w, rows, cols, eps);
  const auto at_x_gamma = [&] { return loss(x, gamma); };
  for (std::size_t i = 0; i < x.size(); ++i)
    EXPECT_NEAR(b.dx[i], central_difference(x, i, h, at_x_gamma), 2e-3) << "dx[" << i << "]";
  for (std::size_t c = 0; c < gamma.size(); ++c)  // y is linear in gamma
    EXPECT_NEAR(b.dgamma[c], central_difference(gamma, c, h, at_x_gamma), 1e-9) << "dgamma[" << c << "]";
  // Forward: with gamma = 1 each output row has mean square 1 (up to eps).
  const auto f = k2c::ref::rmsnorm_forward(x, std::vector<float>(cols, 1.0f), rows, cols, 0.0);
  double ms = 0;
  for (int c = 0; c < cols; ++c) ms += f.y[c] * f.y[c] / cols;
  EXPECT_NEAR(ms, 1.0, 1e-12);
}

TEST(Reference, RopeRotatesByRelativePosition) {
  const int tokens = 5, heads = 2, d = 8;
  const std::vector<float> q = grid_values(tokens * heads * d, 4), k = grid_values(tokens * heads * d, 5);
  for (auto layout : {k2c::ref::RopeLayout::interleaved, k2c::ref::RopeLayout::half_split}) {
    // The inverse (the backward pass) undoes the rotation, which preserves norms.
    const auto fwd = k2c::ref::rope(q, tokens, heads, d, 7, 10000.0, layout, false);
    const std::vector<float> fwd_f(fwd.begin(), fwd.end());
    const auto back = k2c::ref::rope(fwd_f, tokens, heads, d, 7, 10000.0, layout, true);
    double nq = 0, nf = 0;
    for (std::size_t i = 0; i < q.size(); ++i) {
      EXPECT_NEAR(back[i], q[i], 1e-6);
      nq += static_cast<double>(q[i]) * q[i];
      nf += fwd[i] * fwd[i];
    }
    EXPECT_NEAR(nq, nf, 1e-9 * nq);
    // <rope(q, m), rope(k, n)> depends on m − n only: shifting both positions by 100 keeps it.
    auto score = [&](long offset) {
      const auto rq = k2c::ref::rope(q, tokens, heads, d, offset, 10000.0, layout, false);
      const auto rk = k2c::ref::rope(k, tokens, heads, d, offset + 3, 10000.0, layout, false);
      double s = 0;
      for (int i = 0; i < d; ++i) s += rq[i] * rk[(2 * heads) * d + i];  // q token 0 · k token 2, head 0
      return s;
    };
    EXPECT_NEAR(score(0), score(100), 1e-9);
  }
}

TEST(Reference, AttentionBackwardMatchesFiniteDifferences) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    // Two query heads sharing one kv head, more keys than queries (the causal mask is then a
    // staircase ending at the last key), head_dim 4.
    const k2c::ref::AttentionShape s{.batch = 1, .heads = 2, .kv_heads = 1, .q_len = 3, .kv_len = 5,
                                     .head_dim = 4, .causal = causal, .scale = 0.5};
    std::vector<float> q = grid_values(2 * 3 * 4, 11), k = grid_values(5 * 4, 12), v = grid_values(5 * 4, 13);
    const std::vector<float> w = grid_values(2 * 3 * 4, 14);  // L = Σ w·O, so dL/dO = w
    auto loss = [&] {
      const auto f = k2c::ref::attention_forward(q, k, v, s);
      double l = 0;
      for (std::size_t i = 0; i < f.o.size(); ++i) l += w[i] * f.o[i];
      return l;
    };
    const auto g = k2c::ref::attention_backward(q, k, v, w, s);
    const double h = 1.0 / 128;
    auto check = [&](std::vector<float>& x, const std::vector<double>& dx, const char* name) {
      for (std::size_t i = 0; i < x.size(); ++i)
        EXPECT_NEAR(dx[i], central_difference(x, i, h, loss), 2e-4) << name << "[" << i << "]";
    };
    check(q, g.dq, "dq");
    check(k, g.dk, "dk");
    check(v, g.dv, "dv");
  }
}

TEST(Reference, AttentionGroupedQueryEqualsReplicatedHeads) {
  // Four query heads over two kv heads equal four heads over their own copies of the kv heads.
  const int H = 4, Hkv = 2, Nq = 3, Nk = 6, d = 3;
  const k2c::ref::AttentionShape gqa{.batch = 1, .heads = H, .kv_heads = Hkv, .q_len = Nq, .kv_len = Nk,
                                     .head_dim = d, .causal = true, .scale = 0.7};
  k2c::ref::AttentionShape mha = gqa;
  mha.kv_heads = H;
  const std::vector<float> q = grid_values(H * Nq * d, 21), k = grid_values(Hkv * Nk * d, 22),
                           v = grid_values(Hkv * Nk * d, 23), dout = grid_values(H * Nq * d, 24);
  std::vector<float> k4, v4;
  for (int h = 0; h < H; ++h) {
    const std::size_t at = static_cast<std::size_t>(h / (H / Hkv)) * Nk * d;
    k4.insert(k4.end(), k.begin() + at, k.begin() + at + Nk * d);
    v4.insert(v4.end(), v.begin() + at, v.begin() + at + Nk * d);
  }
  const auto a = k2c::ref::attention_forward(q, k, v, gqa), b = k2c::ref::attention_forward(q, k4, v4, mha);
  for (std::size_t i = 0; i < a.o.size(); ++i) EXPECT_NEAR(a.o[i], b.o[i], 1e-14);
  for (std::size_t i = 0; i < a.lse.size(); ++i) EXPECT_NEAR(a.lse[i], b.lse[i], 1e-14);
  // The shared kv head's gradient is the sum over the query heads that read it.
  const auto ga = k2c::ref::attention_backward(q, k, v, dout, gqa), gb = k2c::ref::attention_backward(q, k4, v4, dout, mha);
  for (int h = 0; h < H; ++h)
    for (int e = 0; e < Nk * d; ++e) {
      const std::size_t shared = static_cast<std::size_t>(h / (H / Hkv)) * Nk * d + e;
      if (h % (H / Hkv) == 0) {
        double sum_k = 0, sum_v = 0;
        for (int r = 0; r < H / Hkv; ++r) {
          sum_k += gb.dk[static_cast<std::size_t>(h + r) * Nk * d + e];
          sum_v += gb.dv[static_cast<std::size_t>(h + r) * Nk * d + e];
        }
        EXPECT_NEAR(ga.dk[shared], sum_k, 1e-13);
        EXPECT_NEAR(ga.dv[shared], sum_v, 1e-13);
      }
    }
}

TEST(Reference, AttentionCausalMaskIsBottomRightAligned) {
  const int d = 2;
  // More queries than keys: query i sees keys j <= i + 2 - 4, so queries 0 and 1 see none (output 0,
  // logsumexp +inf), query 2 sees key 0 only (its output is v[0] exactly), query 3 sees both.
  const k2c::ref::AttentionShape s{.q_len = 4, .kv_len = 2, .head_dim = d, .causal = true, .scale = 1.0};
  const std::vector<float> q = grid_values(4 * d, 31), k = grid_values(2 * d, 32), v = grid_values(2 * d, 33);
  const auto f = k2c::ref::attention_forward(q, k, v, s);
  for (int i : {0, 1}) {
    EXPECT_EQ(f.o[i * d], 0.0);
    EXPECT_EQ(f.o[i * d + 1], 0.0);
    EXPECT_TRUE(std::isinf(f.lse[i]) && f.lse[i] > 0);
  }
  EXPECT_EQ(f.o[2 * d], v[0]);
  EXPECT_EQ(f.o[2 * d + 1], v[1]);
  EXPECT_NEAR(f.lse[2], static_cast<double>(q[2 * d]) * k[0] + static_cast<double>(q[2 * d + 1]) * k[1], 1e-15);
  const double s0 = static_cast<double>(q[3 * d]) * k[0] + static_cast<double>(q[3 * d + 1]) * k[1];
  const double s1 = static_cast<double>(q[3 * d]) * k[2] + static_cast<double>(q[3 * d + 1]) * k[3];
  EXPECT_NEAR(f.lse[3], std::log(std::exp(s0) + std::exp(s1)), 1e-14);
  // Nothing flows through a query that sees no key.
  const auto g = k2c::ref::attention_backward(q, k, v, grid_values(4 * d, 34), s);
  for (int c = 0; c < 2 * d; ++c) EXPECT_EQ(g.dq[c], 0.0);
}

TEST(Reference, AttentionRowGradientsMatchTheFullBackward) {
  // The spot-check helpers, given the exact o and lse, give the full backward pass's rows; the
  // magnitudes bound each gradient's size (|x| <= its magnitude), and scale with the data.
  const k2c::ref::AttentionShape s{.batch = 2, .heads = 4, .kv_heads = 2, .q_len = 5, .kv_len = 7,
                                   .head_dim = 3, .causal = true, .scale = 0.6};
  const std::vector<float> q = grid_values(2 * 4 * 5 * 3, 41), k = grid_values(2 * 2 * 7 * 3, 42),
                           v = grid_values(2 * 2 * 7 * 3, 43), dout = grid_values(2 * 4 * 5 * 3, 44);
  const auto f = k2c::ref::attention_forward(q, k, v, s);
  const auto g = k2c::ref::attention_backward(q, k, v, dout, s);
  const std::vector<float> o(f.o.begin(), f.o.end()), lse(f.lse.begin(), f.lse.end());
  for (std::size_t i = 0; i < f.o.size(); ++i) EXPECT_LE(std::abs(f.o[i]), f.o_magnitude[i] + 1e-15);
  for (int b = 0; b < 2; ++b)
    for (int kvh = 0; kvh < 2; ++kvh)
      for (int j = 0; j < 7; ++j) {
        const auto r = k2c::ref::attention_key_gradient_at(q, k, v, o, dout, lse, s, b, kvh, j);
        const std::size_t at = ((static_cast<std::size_t>(b) * 2 + kvh) * 7 + j) * 3;
        for (int c = 0; c < 3; ++c) {
          EXPECT_NEAR(r.dk[c], g.dk[at + c], 1e-6);  // o and lse pass through float
          EXPECT_NEAR(r.dv[c], g.dv[at + c], 1e-6);
          EXPECT_LE(std::abs(g.dk[at + c]), g.dk_magnitude[at + c] + 1e-15);
          EXPECT_LE(std::abs(g.dv[at + c]), g.dv_magnitude[at + c] + 1e-15);
        }
      }
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h)
      for (int i = 0; i < 5; ++i) {
        const auto r = k2c::ref::attention_query_gradient_at(q, k, v, o, dout, lse, s, b, h, i);
        const std::size_t at = ((static_cast<std::size_t>(b) * 4 + h) * 5 + i) * 3;
        for (int c = 0; c < 3; ++c) {
          EXPECT_NEAR(r.dq[c], g.dq[at + c], 1e-6);
          EXPECT_LE(std::abs(g.dq[at + c]), g.dq_magnitude[at + c] + 1e-15);
        }
      }
  // Given each row's D and e instead of o (what the grader's checker keeps), the same rows exactly.
  std::vector<double> D(lse.size()), e(lse.size());
  for (std::size_t r = 0; r < lse.size(); ++r)
    for (int c = 0; c < 3; ++c) {
      D[r] += static_cast<double>(dout[r * 3 + c]) * o[r * 3 + c];
      e[r] += std::abs(static_cast<double>(dout[r * 3 + c]) * o[r * 3 + c]);
    }
  const k2c::ref::AttentionRowTerms rows{D, e};
  const auto a = k2c::ref::attention_key_gradient_at(q, k, v, o, dout, lse, s, 1, 1, 3),
             a2 = k2c::ref::attention_key_gradient_at(q, k, v, rows, dout, lse, s, 1, 1, 3);
  const auto b = k2c::ref::attention_query_gradient_at(q, k, v, o, dout, lse, s, 1, 2, 4),
             b2 = k2c::ref::attention_query_gradient_at(q, k, v, rows, dout, lse, s, 1, 2, 4);
  EXPECT_EQ(a.dk, a2.dk);
  EXPECT_EQ(a.dv, a2.dv);
  EXPECT_EQ(a.dk_magnitude, a2.dk_magnitude);
  EXPECT_EQ(b.dq, b2.dq);
  EXPECT_EQ(b.dq_magnitude, b2.dq_magnitude);
  EXPECT_THROW(k2c::ref::attention_key_gradient_at(q, k, v, k2c::ref::AttentionRowTerms{std::span(D).first(3), e}, dout,
                                                   lse, s, 0, 0, 0),
               std::invalid_argument);
}

TEST(Reference, RouterChoosesDeterministically) {
  namespace r = k2c::ref;
  // Softmax scores, top-2, a tie between experts 1 and 3: the lower index comes first.
  const std::vector<float> z = {0.1f, 2.0f, -1.0f, 2.0f, 0.5f, 1.5f};
  r::RouterConfig c{.experts = 6, .top_k = 2};
  r::Routing a = r::route(z, {}, 1, c);
  EXPECT_EQ(a.expert, (std::vector<int>{1, 3}));
  EXPECT_NEAR(a.weight[0], a.scores[1], 1e-15);
  double total = 0;
  for (double s : a.scores) total += s;
  EXPECT_NEAR(total, 1.0, 1e-14);
  c.normalize = true;
  c.route_scale = 2.5;
  a = r::route(z, {}, 1, c);
  EXPECT_NEAR(a.weight[0], 1.25, 1e-14);  // two equal scores, normalised, scaled
  EXPECT_NEAR(a.weight[1], 1.25, 1e-14);
  // Sigmoid scores with a bias: the bias picks expert 2, the weights ignore it.
  const std::vector<float> flat(4, 0.0f), bias = {0.0f, 0.0f, 0.5f, 0.0f};
  const r::Routing b = r::route(flat, bias, 1, {.experts = 4, .top_k = 1, .score = r::RouterScore::sigmoid});
  EXPECT_EQ(b.expert[0], 2);
  EXPECT_NEAR(b.weight[0], 1.0, 1e-15);  // sigmoid weights are normalised over the chosen
}

TEST(Reference, RouterLimitsGroups) {
  namespace r = k2c::ref;
  // Four groups of two. Group 0 holds the single best expert but a weak partner; groups 1 and 2
  // have two good experts each and win the two group slots, so expert 0 is not eligible.
  const std::vector<float> z = {3.0f, -5.0f, 1.0f, 1.0f, 0.9f, 0.9f, -1.0f, -1.0f};
  r::RouterConfig c{.experts = 8, .top_k = 2, .score = r::RouterScore::sigmoid};
  EXPECT_EQ(r::route(z, {}, 1, c).expert, (std::vector<int>{0, 2}));
  c.groups = 4;
  c.top_groups = 2;
  EXPECT_EQ(r::route(z, {}, 1, c).expert, (std::vector<int>{2, 3}));
  c.top_groups = 4;  // every group eligible: the plain top-k again
  EXPECT_EQ(r::route(z, {}, 1, c).expert, (std::vector<int>{0, 2}));
}

TEST(Reference, BalanceLossGradientAndMinimum) {
  namespace r = k2c::ref;
  const int T = 5, E = 4, k = 2;
  std::vector<float> z = grid_values(T * E, 41);
  const r::Routing routing = r::route(z, {}, T, {.experts = E, .top_k = k});
  const r::BalanceLoss l = r::balance_loss(z, routing, T, E, k, 0.01);
  const double h = 1.0 / 128;
  const auto at_z = [&] { return r::balance_loss(z, routing, T, E, k, 0.01).loss; };
  for (std::size_t i = 0; i < z.size(); ++i)  // counts held fixed, as in training
    EXPECT_NEAR(l.dlogits[i], central_difference(z, i, h, at_z), 1e-8) << "dlogits[" << i << "]";
  // Uniform probabilities and every expert chosen equally often: the loss is exactly alpha.
  const std::vector<float> zero(4 * 4, 0.0f);
  r::Routing even;
  even.expert = {0, 1, 2, 3};
  EXPECT_NEAR(r::balance_loss(zero, even, 4, 4, 1, 0.01).loss, 0.01, 1e-15);
}

TEST(Reference, DispatchPermuteCombine) {
  namespace r = k2c::ref;
  const int T = 6, E = 3, H = 2;
  const std::vector<float> x = grid_values(T * H, 51);
  // top-1 to experts 2, 0, 2, 1, 0, 2: expert order 0: tokens 1, 4; 1: token 3; 2: tokens 0, 2, 5.
  r::Routing routing;
  routing.expert = {2, 0, 2, 1, 0, 2};
  routing.weight.assign(T, 1.0);
  r::Dispatch d = r::dispatch(routing, T, E, 1, -1);
  EXPECT_EQ(d.counts, (std::vector<int>{2, 1, 3}));
  EXPECT_EQ(d.offsets, (std::vector<int>{0, 2, 3, 6}));
  EXPECT_EQ(d.source, (std::vector<int>{1, 4, 3, 0, 2, 5}));
  EXPECT_EQ(d.dropped, 0);
  // permute, then combine with weight 1: the identity.
  const std::vector<double> rows = r::permute(x, H, d), back = r::combine(rows, T, H, 1, d, routing);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], x[i]);
  // Capacity 2: expert 2 keeps tokens 0 and 2 and drops token 5, whose output is then zero.
  d = r::dispatch(routing, T, E, 1, 2);
  EXPECT_EQ(d.counts, (std::vector<int>{2, 1, 2}));
  EXPECT_EQ(d.dropped, 1);
  EXPECT_EQ(d.slot[5], -1);
  const std::vector<double> cut = r::combine(r::permute(x, H, d), T, H, 1, d, routing);
  EXPECT_EQ(cut[5 * H], 0.0);
  EXPECT_EQ(cut[5 * H + 1], 0.0);
  // One expert takes everything; the others get no rows at all.
  routing.expert.assign(T, 1);
  d = r::dispatch(routing, T, E, 1, -1);
  EXPECT_EQ(d.counts, (std::vector<int>{0, T, 0}));
  // Top-2: each token's two rows, weighted, add up in combine.
  r::Routing two;
  two.expert = {0, 1, 1, 2};
  two.weight = {0.25, 0.75, 0.5, 0.5};
  d = r::dispatch(two, 2, E, 2, -1);
  const std::vector<double> mixed = r::combine(r::permute(std::span(x).first(2 * H), H, d), 2, H, 2, d, two);
  for (std::size_t i = 0; i < 2 * H; ++i) EXPECT_NEAR(mixed[i], x[i], 1e-15);
}

TEST(Reference, MoeForwardIsExpertsPlusShared) {
  namespace r = k2c::ref;
  const int T = 4, H = 3, F = 5, SF = 2, E = 3;
  const std::vector<float> x = grid_values(T * H, 61), wr = grid_values(E * H, 62);
  const std::vector<float> w1 = grid_values(E * F * H, 63), w3 = grid_values(E * F * H, 64), w2 = grid_values(E * F * H, 65);
  const std::vector<float> s1 = grid_values(SF * H, 66), s3 = grid_values(SF * H, 67), s2 = grid_values(SF * H, 68);
  r::MoeLayer layer{.hidden = H, .ffn = F, .shared_ffn = SF, .shared = 1,
                    .router = {.experts = E, .top_k = 2, .normalize = true},
                    .w_router = wr, .w1 = w1, .w3 = w3, .w2 = w2, .shared_w1 = s1, .shared_w3 = s3, .shared_w2 = s2};
  const r::MoeForward f = r::moe_forward(x, T, layer);
  // Token by token: Σ_j w_j · FFN_{e_j}(x_t) + FFN_shared(x_t).
  const std::size_t per = static_cast<std::size_t>(F) * H;
  for (int t = 0; t < T; ++t) {
    const std::vector<double> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
    std::vector<double> want = r::swiglu(xt, 1, H, SF, s1, s3, s2);
    for (int j = 0; j < 2; ++j) {
      const int e = f.routing.expert[t * 2 + j];
      const std::vector<double> ye = r::swiglu(xt, 1, H, F, std::span(w1).subspan(e * per, per),
                                               std::span(w3).subspan(e * per, per), std::span(w2).subspan(e * per, per));
      for (int c = 0; c < H; ++c) want[c] += f.routing.weight[t * 2 + j] * ye[c];
    }
    for (int c = 0; c < H; ++c) EXPECT_NEAR(f.y[t * H + c], want[c], 1e-14) << "token " << t;
  }
  // SwiGLU by hand on one number: silu(2·3)·(5·3)·7 with hidden = ffn = 1.
  const std::vector<float> a = {2.0f}, b = {5.0f}, c = {7.0f};
  const std::vector<double> one = {3.0};
  EXPECT_NEAR(r::swiglu(one, 1, 1, 1, a, b, c)[0], 6.0 / (1.0 + std::exp(-6.0)) * 15.0 * 7.0, 1e-12);
}

TEST(Reference, MoeBackwardMatchesFiniteDifferences) {
  namespace r = k2c::ref;
  const int T = 3, H = 3, F = 2, SF = 2, E = 4;
  std::vector<float> x = grid_values(T * H, 71), wr = grid_values(E * H, 72), w1 = grid_values(E * F * H, 73),
                     w3 = grid_values(E * F * H, 74), w2 = grid_values(E * F * H, 75), s1 = grid_values(SF * H, 76),
                     s3 = grid_values(SF * H, 77), s2 = grid_values(SF * H, 78);
  const std::vector<float> wy = grid_values(T * H, 79);  // L = Σ wy·y, so dL/dy = wy
  for (r::RouterScore score : {r::RouterScore::softmax, r::RouterScore::sigmoid}) {
    SCOPED_TRACE(score == r::RouterScore::softmax ? "softmax" : "sigmoid");
    auto layer = [&] {
      return r::MoeLayer{.hidden = H, .ffn = F, .shared_ffn = SF, .shared = 1,
                         .router = {.experts = E, .top_k = 2, .score = score, .normalize = true, .route_scale = 1.5},
                         .w_router = wr, .w1 = w1, .w3 = w3, .w2 = w2, .shared_w1 = s1, .shared_w3 = s3, .shared_w2 = s2};
    };
    const r::MoeForward base = r::moe_forward(x, T, layer());
    const r::MoeBackward g = r::moe_backward(x, T, layer(), wy);
    auto loss = [&](bool& same_choice) {
      const r::MoeForward f = r::moe_forward(x, T, layer());
      same_choice = f.routing.expert == base.routing.expert;
      double l = 0;
      for (std::size_t i = 0; i < f.y.size(); ++i) l += wy[i] * f.y[i];
      return l;
    };
    const double h = 1.0 / 256;
    int checked = 0;
    auto check = [&](std::vector<float>& p, const std::vector<double>& dp, const char* name) {
      for (std::size_t i = 0; i < p.size(); ++i) {
        const float keep = p[i];
        bool same_up = false, same_down = false;
        p[i] = keep + static_cast<float>(h);
        const double up = loss(same_up);
        p[i] = keep - static_cast<float>(h);
        const double down = loss(same_down);
        p[i] = keep;
        if (!same_up || !same_down) continue;  // the step moved a top-k choice: no derivative here
        ++checked;
        EXPECT_NEAR(dp[i], (up - down) / (2 * h), 2e-4) << name << "[" << i << "]";
      }
    };
    check(x, g.dx, "dx");
    check(wr, g.dw_router, "dw_router");
    check(w1, g.dw1, "dw1");
    check(w3, g.dw3, "dw3");
    check(w2, g.dw2, "dw2");
    check(s1, g.dshared_w1, "dshared_w1");
    check(s3, g.dshared_w3, "dshared_w3");
    check(s2, g.dshared_w2, "dshared_w2");
    EXPECT_GT(checked, 80) << "too many elements moved the routing to check the gradient";
    // Each magnitude sum bounds its gradient, and with three tokens through the shared expert
    // some terms cancel, so some bound strictly.
    int strict = 0;
    auto bounds = [&](const std::vector<double>& d, const std::vector<double>& mag, const char* name) {
      ASSERT_EQ(d.size(), mag.size()) << name;
      for (std::size_t i = 0; i < d.size(); ++i) {
        EXPECT_GE(mag[i], std::abs(d[i]) - 1e-12) << name << "[" << i << "]";
        strict += mag[i] > std::abs(d[i]) + 1e-9;
      }
    };
    bounds(g.dw1, g.dw1_mag, "dw1");
    bounds(g.dw3, g.dw3_mag, "dw3");
    bounds(g.dw2, g.dw2_mag, "dw2");
    bounds(g.dshared_w1, g.dshared_w1_mag, "dshared_w1");
    bounds(g.dshared_w3, g.dshared_w3_mag, "dshared_w3");
    bounds(g.dshared_w2, g.dshared_w2_mag, "dshared_w2");
    EXPECT_GT(strict, 0) << "no gradient element sums terms of both signs";
  }
}

// -------------------------------------------------------------------------------- random ---

TEST(Random, DeterministicAndInRange) {
  std::vector<float> a(10000), b(10000);
  k2c::fill_uniform(a, 42, -2.0f, 3.0f);
  k2c::fill_uniform(b, 42, -2.0f, 3.0f);
  EXPECT_EQ(a, b);
  double mean = 0;
  for (float v : a) {
    ASSERT_GE(v, -2.0f);
    ASSERT_LT(v, 3.0f);
    mean += v / a.size();
  }
  EXPECT_NEAR(mean, 0.5, 0.05);
  k2c::fill_uniform(b, 43, -2.0f, 3.0f);
  EXPECT_NE(a, b);
  EXPECT_EQ(a[1234], k2c::uniform_at(42, 1234, -2.0f, 3.0f));  // element i needs no sequence
}

// ------------------------------------------------------------------ descriptors (fd_io.h) ---

// The witness lends its buffers as a descriptor sent with its greeting: the receiver gets the
// whole message and a descriptor of its own for the same open file, or -1 and nothing open.
TEST(FdIo, ADescriptorTravelsWithItsMessage) {
  int sock[2], pipe_fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sock), 0);
  ASSERT_EQ(pipe(pipe_fds), 0);
  std::vector<char> message(100000);  // longer than one segment: the rest follows the descriptor
  for (std::size_t i = 0; i < message.size(); ++i) message[i] = static_cast<char>(i * 7);
  std::vector<char> got(message.size());
  int fd = -1;
  std::thread receiver([&] { fd = k2c::receive_with_fd(sock[1], got.data(), got.size()); });
  EXPECT_TRUE(k2c::send_with_fd(sock[0], message.data(), message.size(), pipe_fds[1]));
  receiver.join();
  ASSERT_GE(fd, 0);
  EXPECT_EQ(got, message);
  EXPECT_NE(fd, pipe_fds[1]);
  ASSERT_EQ(write(fd, "ok", 2), 2);  // the received descriptor writes into the same pipe
  char back[2] = {};
  ASSERT_EQ(read(pipe_fds[0], back, 2), 2);
  EXPECT_EQ(std::string(back, 2), "ok");
  close(fd);

  // Bytes without a descriptor, and a message cut short by the sender's end: -1.
  ASSERT_TRUE(k2c::send_fully(sock[0], message.data(), 16));
  EXPECT_EQ(k2c::receive_with_fd(sock[1], got.data(), 16), -1);
  ASSERT_TRUE(k2c::send_with_fd(sock[0], message.data(), 8, pipe_fds[1]));
  close(sock[0]);
  EXPECT_EQ(k2c::receive_with_fd(sock[1], got.data(), 16), -1);
  for (int f : {sock[1], pipe_fds[0], pipe_fds[1]}) close(f);
}

// ---------------------------------------------------------------------------------- todo ---

TEST(Todo, ThrowsNotImplementedWithMarker) {
  try {
    K2C_TODO("write the kernel");
    FAIL() << "K2C_TODO returned";
  } catch (const k2c::NotImplemented& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(k2c::kNotImplementedMarker, 0), 0u) << what;
    EXPECT_NE(what.find("write the kernel"), std::string::npos);
  }
}

// -------------------------------------------------------------------------------- rubric ---

namespace {

const char* kGood = R"({
  "version": 1, "max_file_bytes": 1000,
  "modules": [{"id": "01_naive_matmul", "title": "t", "kind": "gpu", "timeout_s": 60,
    "files": ["assignments/01_naive_matmul/naive_matmul.cu"],
    "tests": [{"name": "A.B", "points": 3},
              {"name": "P.Q", "points": 7, "perf": {"ceiling": "c", "unit": "GB/s",
                "threshold": 0.5, "goal": 0.9, "max_ratio": 1.1}}]}]})";

// Parses `text`; returns the error message ("" if it parsed).
std::string rubric_error(const std::string& text) {
  try {
    k2c::parse_rubric(text, "r.json");
    return "";
  } catch (const k2c::RubricError& e) {
    return e.what();
  }
}

std::string replace(std::string s, const std::string& from, const std::string& to) {
  const auto at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return s.replace(at, from.size(), to);
}

}  // namespace

TEST(Rubric, ParsesAndLooksUp) {
  const k2c::Rubric r = k2c::parse_rubric(kGood);
  ASSERT_EQ(r.modules.size(), 1u);
  EXPECT_EQ(r.find("01"), &r.modules[0]);
  EXPECT_EQ(r.find("1"), &r.modules[0]);
  EXPECT_EQ(r.find("01_naive_matmul"), &r.modules[0]);
  EXPECT_EQ(r.find("02"), nullptr);
  EXPECT_EQ(r.modules[0].points(), 10);
  ASSERT_TRUE(r.modules[0].find_test("P.Q")->perf);
  EXPECT_EQ(r.modules[0].find_test("P.Q")->perf->goal, 0.9);
  EXPECT_EQ(r.modules[0].find_test("P.Q")->perf->witness, "");
  EXPECT_EQ(k2c::parse_rubric(replace(kGood, R"("goal": 0.9)", R"("goal": 0.9, "witness": "copy")"))
                .modules[0].find_test("P.Q")->perf->witness, "copy");
  // "build" is optional: what autograder/CMakeLists.txt reads from it, read here the same way.
  EXPECT_FALSE(r.modules[0].model);
  EXPECT_FALSE(r.modules[0].sm90a);
  const k2c::ModuleSpec built = k2c::parse_rubric(replace(kGood, R"("title": "t",)",
      R"("title": "t", "build": {"model": true, "sm90a": true},)")).modules[0];
  EXPECT_TRUE(built.model);
  EXPECT_TRUE(built.sm90a);
}

// The one rule for a performance test's bar, which the tests and the grader both call.
TEST(Rubric, RequiredBarIsTheGoalForSolutionsOnly) {
  const k2c::PerfSpec& p = *k2c::parse_rubric(kGood).modules[0].find_test("P.Q")->perf;
  EXPECT_EQ(p.required("solutions"), 0.9);
  EXPECT_EQ(p.required("assignments"), 0.5);
  EXPECT_EQ(p.required(""), 0.5);  // anything but the reference tree is held to the student bar
  EXPECT_STREQ(k2c::PerfSpec::required_name("solutions"), "reference goal");
  EXPECT_STREQ(k2c::PerfSpec::required_name("assignments"), "student bar");
}

TEST(Rubric, ErrorsNameTheField) {
  const std::string g = kGood;
  const std::pair<std::string, std::string> cases[] = {
      {"{", "not valid JSON"},
      {replace(g, R"("version": 1)", R"("version": 2)"), "version: unsupported"},
      {replace(g, R"("points": 3)", R"("points": -3)"), "modules[0].tests[0].points"},
      {replace(g, R"("points": 3)", R"("points": "3")"), "modules[0].tests[0].points: expected a number"},
      {replace(g, R"("threshold": 0.5)", R"("threshold": 2)"), "modules[0].tests[1].perf.threshold"},
      {replace(g, R"("goal": 0.9)", R"("goal": 0.1)"), "modules[0].tests[1].perf.goal"},
      {replace(g, R"("goal": 0.9)", R"("goal": 0.9, "witness": "")"), "modules[0].tests[1].perf.witness"},
      {replace(g, R"("unit": "GB/s",)", ""), "modules[0].tests[1].perf.unit: missing"},
      {replace(g, R"("id": "01_naive_matmul")", R"("id": "naive")"), "modules[0].id"},
      {replace(g, R"("kind": "gpu")", R"("kind": "tpu")"), "modules[0].kind"},
      {replace(g, R"("name": "A.B")", R"("name": "P.Q")"), "modules[0].tests[1].name: duplicate"},
      {replace(g, R"("name": "A.B")", R"("name": "AB")"), "modules[0].tests[0].name"},
      {replace(g, R"("title": "t",)", R"("title": "t", "tiemout_s": 5,)"), "modules[0].tiemout_s: unknown field"},
      {replace(g, R"("title": "t",)", R"("title": "t", "build": {"model": 1},)"), "modules[0].build.model"},
      {replace(g, R"("title": "t",)", R"("title": "t", "build": {"uses": [7]},)"), "modules[0].build.uses[0]"},
      {replace(g, R"("title": "t",)", R"("title": "t", "build": {"uses": ["77_nosuch"]},)"),
       "modules[0].build.uses[0]: '77_nosuch' is not a module listed before"},
      {replace(g, R"("max_file_bytes": 1000)", R"("max_file_bytes": 1e300)"), "max_file_bytes: expected 1.."},
      {replace(g, R"("title": "t",)", R"("title": "t", "build": {"sm90a": "yes"},)"), "modules[0].build.sm90a"},
      {replace(g, R"("title": "t",)", R"("title": "t", "build": {"modle": true},)"), "modules[0].build.modle: unknown field"},
      {replace(g, R"("assignments/01_naive_matmul/naive_matmul.cu")", R"("../etc/passwd")"), "modules[0].files[0]"},
  };
  for (const auto& [text, expected] : cases) {
    const std::string err = rubric_error(text);
    EXPECT_NE(err.find(expected), std::string::npos) << "expected '" << expected << "', got '" << err << "'";
    EXPECT_EQ(err.rfind("r.json", 0), 0u) << err;
  }
}

TEST(Rubric, TheCourseRubricIsValid) {
  const k2c::Rubric r = k2c::load_rubric(K2C_RUBRIC_PATH);
  EXPECT_GE(r.modules.size(), 2u);
  std::set<std::string> before;
  for (const auto& m : r.modules) {
    EXPECT_GT(m.points(), 0) << m.id;
    // The build declares modules in the rubric's order, so a module uses only earlier ones.
    for (const auto& used : m.uses) EXPECT_TRUE(before.count(used)) << m.id << " uses " << used << ", not listed before it";
    before.insert(m.id);
  }
}

// Every suite starts with its module's name, compared without the number, underscores or case
// (07_rmsnorm: RmsNormPerf), so no two modules share a suite and a test's name alone says which
// module it belongs to: what a filter, a report or a reader sees.
TEST(Rubric, SuitesNameTheirModule) {
  const k2c::Rubric r = k2c::load_rubric(K2C_RUBRIC_PATH);
  auto folded = [](std::string_view s) {
    std::string out;
    for (char c : s)
      if (c != '_') out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  };
  std::map<std::string, std::string> owner;  // suite -> module
  for (const auto& m : r.modules) {
    const std::string name = folded(std::string_view(m.id).substr(m.id.find('_') + 1));
    for (const auto& t : m.tests) {
      const std::string suite = t.name.substr(0, t.name.find('.'));
      EXPECT_EQ(folded(suite).rfind(name, 0), 0u)
          << m.id << ": suite '" << suite << "' of " << t.name << " does not start with the module's name";
      const auto [it, fresh] = owner.emplace(suite, m.id);
      EXPECT_TRUE(fresh || it->second == m.id) << "suite '" << suite << "' is in " << it->second << " and " << m.id;
    }
  }
}

// The rubric is the one register of modules; the documents that list them must agree with it:
// each module has its lecture and its handout, and the course maps (the README's and the
// student handout's) have one row per module, no more and no fewer, linking the lecture by id.
TEST(Rubric, EveryModuleHasItsDocs) {
  const k2c::Rubric r = k2c::load_rubric(K2C_RUBRIC_PATH);
  const std::filesystem::path root = std::filesystem::path(K2C_RUBRIC_PATH).parent_path().parent_path();
  std::set<std::string> registered;
  for (const auto& m : r.modules) {
    registered.insert(m.id);
    EXPECT_TRUE(std::filesystem::is_regular_file(root / "lectures" / (m.id + ".md"))) << m.id << ": no lectures/" << m.id << ".md";
    EXPECT_TRUE(std::filesystem::is_regular_file(root / "assignments" / m.id / "README.md"))
        << m.id << ": no assignments/" << m.id << "/README.md";
  }
  // A course-map row: "| NN | [name](lectures/NN_name.md) | ...".
  const std::regex row(R"(^\| (\d\d) \| \[([a-z0-9_]+)\]\(lectures/(\d\d_[a-z0-9_]+)\.md\) \|)");
  for (const char* doc : {"README.md", "docs/README.handout.md"}) {
    std::ifstream in(root / doc);
    ASSERT_TRUE(in) << "cannot read " << doc;
    std::set<std::string> listed;
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (!std::regex_search(line, m, row)) continue;
      const std::string id = m[3];
      EXPECT_EQ(m[1].str() + "_" + m[2].str(), id) << doc << ": the row of " << id << " names another module";
      EXPECT_TRUE(listed.insert(id).second) << doc << ": " << id << " is listed twice";
    }
    for (const auto& id : registered) EXPECT_TRUE(listed.count(id)) << doc << ": no course-map row for " << id;
    for (const auto& id : listed) EXPECT_TRUE(registered.count(id)) << doc << ": a row for " << id << ", which the rubric does not register";
  }
}

// A file's text ("" when it cannot be read), and whether `needle` appears in a file of `dir`.
namespace {
std::string file_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
bool in_some_file(const std::filesystem::path& dir, const std::string& needle) {
  for (const auto& f : std::filesystem::directory_iterator(dir))
    if (file_text(f.path()).find(needle) != std::string::npos) return true;
  return false;
}
}  // namespace

// A witness the rubric names must exist on both sides: the checker's spec (autograder/witness/
// specs.cu) and the module's test program (K2C_WITNESS in one of its test files), or the grader's own
// run would fail on every machine for a reason that is not the submission's.
TEST(Rubric, EveryWitnessHasBothSides) {
  const k2c::Rubric r = k2c::load_rubric(K2C_RUBRIC_PATH);
  const std::filesystem::path root = std::filesystem::path(K2C_RUBRIC_PATH).parent_path().parent_path();
  const std::string specs = file_text(root / "autograder/witness/specs.cu");
  ASSERT_FALSE(specs.empty());
  int timed = 0, rechecked = 0;
  for (const auto& m : r.modules)
    for (const auto& t : m.tests) {
      const std::string witness = t.perf ? t.perf->witness : t.witness;
      if (witness.empty()) continue;
      ++(t.perf ? timed : rechecked);
      EXPECT_NE(m.kind, "cpu") << t.name << ": only kernels run on a GPU are witnessed";
      EXPECT_NE(specs.find("\"" + witness + "\""), std::string::npos) << t.name << ": specs.cu has no witness " << witness;
      EXPECT_TRUE(in_some_file(root / "autograder" / m.id, "K2C_WITNESS(" + witness + ")"))
          << t.name << ": no K2C_WITNESS(" << witness << ") in autograder/" << m.id;
    }
  EXPECT_GE(timed, 4);
  EXPECT_GE(rechecked, 4);
}

// Likewise for the checks of distributed correctness tests: the checker's kinds (the table of
// autograder/witness/rank_cases.cpp) and K2C_RANK_WITNESS in the module's test files.
TEST(Rubric, EveryRankWitnessHasBothSides) {
  const k2c::Rubric r = k2c::load_rubric(K2C_RUBRIC_PATH);
  const std::filesystem::path root = std::filesystem::path(K2C_RUBRIC_PATH).parent_path().parent_path();
  const std::string checker = file_text(root / "autograder/witness/rank_cases.cpp");
  ASSERT_FALSE(checker.empty());
  int named = 0;
  for (const auto& m : r.modules)
    for (const auto& t : m.tests) {
      if (t.rank_witness.empty()) continue;
      ++named;
      EXPECT_NE(checker.find("\"" + t.rank_witness + "\""), std::string::npos)
          << t.name << ": rank_cases.cpp has no kind " << t.rank_witness;
      EXPECT_TRUE(in_some_file(root / "autograder" / m.id, "K2C_RANK_WITNESS(" + t.rank_witness + ")"))
          << t.name << ": no K2C_RANK_WITNESS(" << t.rank_witness << ") in autograder/" << m.id;
    }
  EXPECT_GE(named, 15);
}

TEST(Rubric, MissingFileIsAnError) {
  EXPECT_THROW(k2c::load_rubric("/nonexistent/rubric.json"), k2c::RubricError);
}
