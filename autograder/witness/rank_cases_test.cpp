// rank_cases_test.cpp — k2c_rank_cases_test: the judges of some rank-witness checks
// (rank_cases.h) on the CPU, with no ranks. For 14's linear layers' backward and 16's ring
// attention, answers made here from each rank's input by a computation of their own (fp32 sums for
// the layers, the course's attention reference for the ring) pass the judge; the same answers with
// one gradient element, one lse, or one rank's copy of a whole tensor changed fail it. So a check
// that stopped looking at a part of the answer would fail here, not only against a forged report.
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/reference/reference.h"
#include "rank_cases.h"

namespace rw = k2c::rank_witness;

namespace {

constexpr int kRanks = 3;

std::vector<float> floats_of(const rw::Bytes& b) {
  std::vector<float> v(b.size() / sizeof(float));
  std::memcpy(v.data(), b.data(), v.size() * sizeof(float));
  return v;
}

// A rank's answer bytes from its tensors in order.
rw::Bytes answer(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> all;
  for (const auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  return rw::floats(all);
}

// Adds `by` to float i of a rank's answer.
void nudge(rw::Bytes& b, std::size_t i, float by) {
  float v;
  std::memcpy(&v, b.data() + i * sizeof(float), sizeof v);
  v += by;
  std::memcpy(b.data() + i * sizeof(float), &v, sizeof v);
}

// c = a·b for row-major a [m][k], b [k][n] (transposed operands by the flags), in fp32.
std::vector<float> product(const std::vector<float>& a, bool ta, const std::vector<float>& b, bool tb, int m, int n, int k) {
  std::vector<float> c(static_cast<std::size_t>(m) * n, 0.0f);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float s = 0;
      for (int p = 0; p < k; ++p) s += (ta ? a[p * m + i] : a[i * k + p]) * (tb ? b[j * k + p] : b[p * n + j]);
      c[i * n + j] = s;
    }
  return c;
}

// The honest answers of a linear check's case: column_parallel_backward (dx, dW_r) or
// row_parallel_linear (y, dx_r, dW_r), from the ranks' inputs.
std::vector<rw::Bytes> linear_answers(const std::string& kind, const rw::Case& c) {
  const int in = static_cast<int>(c.args[0]), out = static_cast<int>(c.args[1]), tokens = static_cast<int>(c.args[2]);
  std::vector<rw::Bytes> got(kRanks);
  // A rank's input as its three matrices, x, W and dy, of n_x and n_w elements and the rest.
  auto split = [&](int r, int n_x, int n_w) {
    const std::vector<float> v = floats_of(c.in[r]);
    return std::array<std::vector<float>, 3>{std::vector<float>(v.begin(), v.begin() + n_x),
                                             std::vector<float>(v.begin() + n_x, v.begin() + n_x + n_w),
                                             std::vector<float>(v.begin() + n_x + n_w, v.end())};
  };
  if (kind == "column_parallel_backward") {
    const int lo = out / kRanks;
    std::vector<float> dx(static_cast<std::size_t>(tokens) * in, 0.0f);
    std::vector<std::vector<float>> dw(kRanks);
    for (int r = 0; r < kRanks; ++r) {  // x [tokens][in], W_r [lo][in], dy_r [tokens][lo]
      const auto [x, w, dy] = split(r, tokens * in, lo * in);
      const std::vector<float> part = product(dy, false, w, false, tokens, in, lo);
      for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += part[i];
      dw[r] = product(dy, true, x, false, lo, in, tokens);
    }
    for (int r = 0; r < kRanks; ++r) got[r] = answer({&dx, &dw[r]});
    return got;
  }
  const int li = in / kRanks;
  std::vector<float> y(static_cast<std::size_t>(tokens) * out, 0.0f);
  std::vector<std::vector<float>> dx(kRanks), dw(kRanks);
  for (int r = 0; r < kRanks; ++r) {  // x_r [tokens][li], W_r [out][li], dy [tokens][out]
    const auto [x, w, dy] = split(r, tokens * li, out * li);
    const std::vector<float> part = product(x, false, w, true, tokens, out, li);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += part[i];
    dx[r] = product(dy, false, w, false, tokens, li, out);
    dw[r] = product(dy, true, x, false, out, li, tokens);
  }
  for (int r = 0; r < kRanks; ++r) got[r] = answer({&y, &dx[r], &dw[r]});
  return got;
}

// The honest answers of a ring case (o, dq, dk, dv of the rank's rows, then lse [2·B][H][C]): the
// whole sequences put back together from the ranks' rows, the course's attention reference on them.
std::vector<rw::Bytes> ring_answers(const std::string& kind, const rw::Case& c) {
  const int B = static_cast<int>(c.args[0]), T = static_cast<int>(c.args[1]), H = static_cast<int>(c.args[2]),
            Hkv = static_cast<int>(c.args[3]), hd = static_cast<int>(c.args[4]), C = T / (2 * kRanks);
  const int local = 2 * B * C;
  auto row_of = [&](int r, int i) {  // the rank's local row i: chunk-major, then sequence, then token
    const int chunk = i / (B * C) == 0 ? r : 2 * kRanks - 1 - r, b = i / C % B, t = i % C;
    return std::pair{b, chunk * C + t};
  };
  // Heads first, as the reference takes them: [b][head][t][d].
  std::vector<float> q(B * H * T * hd), k(B * Hkv * T * hd), v(B * Hkv * T * hd), dout(B * H * T * hd);
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<float> in = floats_of(c.in[r]);
    std::size_t at = 0;
    for (auto [dst, heads] : {std::pair{&q, H}, std::pair{&k, Hkv}, std::pair{&v, Hkv}, std::pair{&dout, H}})
      for (int i = 0; i < local; ++i) {
        const auto [b, t] = row_of(r, i);
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < hd; ++d) (*dst)[((b * heads + h) * T + t) * hd + d] = in[at++];
      }
  }
  const k2c::ref::AttentionShape s{B, H, Hkv, T, T, hd, kind == "ring_attention_causal", 1.0 / std::sqrt(double(hd))};
  const k2c::ref::AttentionForward f = k2c::ref::attention_forward(q, k, v, s);
  const k2c::ref::AttentionBackward g = k2c::ref::attention_backward(q, k, v, dout, s);
  std::vector<rw::Bytes> got(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    std::vector<float> all;
    for (auto [src, heads] : {std::pair{&f.o, H}, std::pair{&g.dq, H}, std::pair{&g.dk, Hkv}, std::pair{&g.dv, Hkv}})
      for (int i = 0; i < local; ++i) {
        const auto [b, t] = row_of(r, i);
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < hd; ++d) all.push_back(static_cast<float>((*src)[((b * heads + h) * T + t) * hd + d]));
      }
    for (int j = 0; j < 2; ++j)
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
          for (int t = 0; t < C; ++t) {
            const int chunk = j == 0 ? r : 2 * kRanks - 1 - r;
            all.push_back(static_cast<float>(f.lse[(b * H + h) * T + chunk * C + t]));
          }
    got[r] = rw::floats(all);
  }
  return got;
}

// Every case index (tiny, tails, large) of `kind`: the honest answers pass, and each change fails.
template <class Answers>
void expect_judged(const std::string& kind, Answers answers) {
  std::mt19937_64 rng(20261206);
  for (int index = 0; index < 3; ++index) {
    const rw::Case c = rw::find_drawer(kind)(kind, kRanks, index, rng);
    const std::vector<rw::Bytes> honest = answers(kind, c);
    for (int r = 0; r < kRanks; ++r) ASSERT_EQ(honest[r].size(), c.out_bytes[r]) << c.what << ": rank " << r << "'s answer";
    EXPECT_EQ(c.check(honest), "") << c.what;
    // The last float of a rank's answer (the weight gradient's, or the ring's last lse), the first
    // (y, dx or o), and one in the middle, each moved by a tenth of a unit.
    for (int r = 0; r < kRanks; ++r)
      for (const std::size_t i : {std::size_t{0}, c.out_bytes[r] / sizeof(float) / 2, c.out_bytes[r] / sizeof(float) - 1}) {
        std::vector<rw::Bytes> wrong = honest;
        nudge(wrong[r], i, 0.1f);
        EXPECT_NE(c.check(wrong), "") << c.what << ": rank " << r << ", float " << i << " moved";
      }
  }
}

}  // namespace

TEST(RankCases, ColumnParallelBackwardJudgesDxAndTheWeightGradient) {
  expect_judged("column_parallel_backward", linear_answers);
}

TEST(RankCases, RowParallelLinearJudgesYDxAndTheWeightGradient) { expect_judged("row_parallel_linear", linear_answers); }

TEST(RankCases, RingAttentionJudgesOutputsGradientsAndLse) {
  expect_judged("ring_attention_causal", ring_answers);
  expect_judged("ring_attention_full", ring_answers);
}
