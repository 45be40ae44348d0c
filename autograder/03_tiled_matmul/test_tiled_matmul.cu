// autograder/03_tiled_matmul/test_tiled_matmul.cu — tests of module 03
// (contract: tiled_matmul.h). Correctness of both parts as for every SGEMM module
// (k2c/testing/sgemm_testing.h), the fixed shapes covering every kind of partial tile; speed of
// Part B against cuBLAS SGEMM measured in the same run.
#include <gtest/gtest.h>

#include "k2c/device/buffer.h"
#include "k2c/reference/ceilings.h"
#include "k2c/testing/sgemm_testing.h"
#include "k2c/testing/testing.h"
#include "tiled_matmul.h"

namespace st = k2c::sgemm_testing;
constexpr st::SgemmFn kTile32 = k2c::tiled_matmul::matmul_tile32;
constexpr st::SgemmFn kMatmul = k2c::tiled_matmul::matmul;

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(TiledMatmulContract, Implemented) {
  st::check_implemented(kTile32);
  st::check_implemented(kMatmul);
}

TEST(TiledMatmulTile32, FixedShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::fixed_cases()) st::check_case(kTile32, c);
  for (const st::Case& c : st::beta_zero_cases()) st::check_case(kTile32, c);
}

TEST(TiledMatmulTile32, RandomShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::random_cases(k2c::testing::seed_for("shapes"), 10, 300))
    st::check_case(kTile32, c);
}

TEST(TiledMatmul, FixedShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::fixed_cases()) st::check_case(kMatmul, c);
}

TEST(TiledMatmul, RandomShapes) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::random_cases(k2c::testing::seed_for("shapes"), 10, 300))
    st::check_case(kMatmul, c);
}

TEST(TiledMatmul, BetaZeroIgnoresC) {
  K2C_REQUIRE_GPU();
  for (const st::Case& c : st::beta_zero_cases()) st::check_case(kMatmul, c);
  st::check_case(kMatmul, {5, 9, 0, 1.5f, -0.5f});  // K == 0: C = beta * C
}

// The grader's own run of the timed GEMM (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(sgemm) { st::run_witness(kMatmul, w); }

TEST(TiledMatmulPerf, VsCublas) {
  K2C_REQUIRE_TIMING();
  const double ceiling = k2c::sgemm_rate(4096);
  const double achieved = st::measure_rate(kMatmul, 4096, 4096, 4096, 10);
  K2C_EXPECT_PERF(achieved / 1e12, ceiling / 1e12, "4096^3, median of 10 runs");
}
