// autograder/01_naive_matmul/test_naive_matmul.cu — tests of module 01
// (contract: naive_matmul.h).
//
// Correctness against the double-precision CPU reference (k2c/testing/sgemm_testing.h, shared by
// every SGEMM module): awkward fixed shapes, random shapes from the run's seed, alpha and beta away
// from 0 and 1, random C (an unwritten element keeps its old value), beta == 0 over a C poisoned
// with NaN. The performance test spot-checks a 4096³ product and compares the rate with cuBLAS
// SGEMM measured in the same run.
#include <gtest/gtest.h>

#include "k2c/device/buffer.h"
#include "k2c/reference/ceilings.h"
#include "k2c/testing/sgemm_testing.h"
#include "k2c/testing/testing.h"
#include "naive_matmul.h"

namespace st = k2c::sgemm_testing;
constexpr st::SgemmFn kMatmul = k2c::naive_matmul::matmul;

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(NaiveMatmulContract, Implemented) { st::check_implemented(kMatmul); }

TEST(NaiveMatmul, FixedShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::fixed_cases()) st::check_case(kMatmul, c);
}

TEST(NaiveMatmul, RandomShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::random_cases(k2c::testing::seed_for("shapes"), 10, 300))
    st::check_case(kMatmul, c);
}

TEST(NaiveMatmul, BetaZeroIgnoresC) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::beta_zero_cases()) st::check_case(kMatmul, c);
}

TEST(NaiveMatmul, DegenerateSizes) {
  K2C_REQUIRE_GPU();
  // M or N == 0: nothing to compute, nothing may be touched (null pointers are fine).
  kMatmul(0, 5, 3, 1.0f, nullptr, nullptr, 1.0f, nullptr, nullptr);
  kMatmul(4, 0, 3, 1.0f, nullptr, nullptr, 1.0f, nullptr, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // K == 0: C = beta * C (and beta == 0 gives zeros even over NaN).
  st::check_case(kMatmul, {5, 9, 0, 1.5f, -0.5f});
  st::check_case(kMatmul, {3, 4, 0, 1.5f, 0.0f});
  EXPECT_THROW(kMatmul(-1, 2, 2, 1.0f, nullptr, nullptr, 0.0f, nullptr, nullptr),
               std::invalid_argument);
}

// The grader's own run of the timed GEMM (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(sgemm) { st::run_witness(kMatmul, w); }

TEST(NaiveMatmulPerf, At4096) {
  K2C_REQUIRE_TIMING();
  const double ceiling = k2c::sgemm_rate(4096);
  const double achieved = st::measure_rate(kMatmul, 4096, 4096, 4096, 5);
  K2C_EXPECT_PERF(achieved / 1e12, ceiling / 1e12, "4096^3, median of 5 runs");
}
