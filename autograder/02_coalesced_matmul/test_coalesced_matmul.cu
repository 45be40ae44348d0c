// autograder/02_coalesced_matmul/test_coalesced_matmul.cu — tests of module 02
// (contract: coalesced_matmul.h). Correctness as for every SGEMM module
// (k2c/testing/sgemm_testing.h); speed as a multiple of module 01's naive kernel (the trusted copy
// in common/) measured in the same run.
#include <gtest/gtest.h>

#include "coalesced_matmul.h"
#include "k2c/device/buffer.h"
#include "k2c/reference/ceilings.h"
#include "k2c/testing/sgemm_testing.h"
#include "k2c/testing/testing.h"

namespace st = k2c::sgemm_testing;
constexpr st::SgemmFn kMatmul = k2c::coalesced_matmul::matmul;

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(CoalescedMatmulContract, Implemented) { st::check_implemented(kMatmul); }

TEST(CoalescedMatmul, FixedShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::fixed_cases()) st::check_case(kMatmul, c);
}

TEST(CoalescedMatmul, RandomShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::random_cases(k2c::testing::seed_for("shapes"), 10, 300))
    st::check_case(kMatmul, c);
}

TEST(CoalescedMatmul, BetaZeroIgnoresC) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::beta_zero_cases()) st::check_case(kMatmul, c);
  st::check_case(kMatmul, {5, 9, 0, 1.5f, -0.5f});  // K == 0: C = beta * C
}

// The grader's own run of the timed GEMM (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(sgemm) { st::run_witness(kMatmul, w); }

TEST(CoalescedMatmulPerf, VsNaive) {
  K2C_REQUIRE_TIMING();
  const double ceiling = k2c::naive_sgemm_rate(4096);
  const double achieved = st::measure_rate(kMatmul, 4096, 4096, 4096, 5);
  K2C_EXPECT_PERF(achieved / 1e12, ceiling / 1e12, "4096^3; the ratio is the speed-up over naive");
}
