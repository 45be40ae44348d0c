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
