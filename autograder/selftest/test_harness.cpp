// test_harness.cpp — the project's own tests of common/: comparison, references, random
// numbers, the rubric parser and K2C_TODO. CPU only; they run everywhere, CI included.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/compare.h"
#include "k2c/gemm_args.h"
#include "k2c/random.h"
#include "k2c/reference.h"
#include "k2c/rubric.h"
#include "k2c/todo.h"

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
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float keep = x[i];
    x[i] = keep + static_cast<float>(h);
    const double up = loss(x, gamma);
    x[i] = keep - static_cast<float>(h);
    const double down = loss(x, gamma);
    x[i] = keep;
    EXPECT_NEAR(b.dx[i], (up - down) / (2 * h), 2e-3) << "dx[" << i << "]";
  }
  for (int c = 0; c < cols; ++c) {
    const float keep = gamma[c];
    gamma[c] = keep + static_cast<float>(h);
    const double up = loss(x, gamma);
    gamma[c] = keep - static_cast<float>(h);
    const double down = loss(x, gamma);
    gamma[c] = keep;
    EXPECT_NEAR(b.dgamma[c], (up - down) / (2 * h), 1e-9) << "dgamma[" << c << "]";  // y is linear in gamma
  }
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
      {replace(g, R"("unit": "GB/s",)", ""), "modules[0].tests[1].perf.unit: missing"},
      {replace(g, R"("id": "01_naive_matmul")", R"("id": "naive")"), "modules[0].id"},
      {replace(g, R"("kind": "gpu")", R"("kind": "tpu")"), "modules[0].kind"},
      {replace(g, R"("name": "A.B")", R"("name": "P.Q")"), "modules[0].tests[1].name: duplicate"},
      {replace(g, R"("name": "A.B")", R"("name": "AB")"), "modules[0].tests[0].name"},
      {replace(g, R"("title": "t",)", R"("title": "t", "tiemout_s": 5,)"), "modules[0].tiemout_s: unknown field"},
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
  for (const auto& m : r.modules) EXPECT_GT(m.points(), 0) << m.id;
}

TEST(Rubric, MissingFileIsAnError) {
  EXPECT_THROW(k2c::load_rubric("/nonexistent/rubric.json"), k2c::RubricError);
}
