// autograder/04_register_tiled_matmul/test_register_tiled_matmul.cu — tests of module 04
// (contract: register_tiled_matmul.h).
//
// Every tile configuration the tuner may choose is checked, on both the float4 path (N and K
// multiples of 4) and the scalar path (the fixed shapes include both), so a configuration that
// compiles but computes garbage cannot be tuned into use. Speed of matmul() (the tuned
// configuration) against cuBLAS SGEMM measured in the same run: graded at 4096³, recorded at
// 1024, 2048, 4000 and 8192.
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "k2c/device/buffer.h"
#include "k2c/reference/ceilings.h"
#include "k2c/testing/sgemm_testing.h"
#include "k2c/testing/testing.h"
#include "register_tiled_matmul.h"

namespace rt = k2c::register_tiled_matmul;
namespace st = k2c::sgemm_testing;
constexpr st::SgemmFn kMatmul = rt::matmul;

// matmul_config(index, ...) as an SgemmFn, one instantiation per index used.
template <int I>
void config_fn(int M, int N, int K, float alpha, const float* A, const float* B, float beta,
               float* C, cudaStream_t stream) {
  rt::matmul_config(I, M, N, K, alpha, A, B, beta, C, stream);
}
constexpr st::SgemmFn kConfigFns[] = {config_fn<0>, config_fn<1>, config_fn<2>, config_fn<3>,
                                      config_fn<4>, config_fn<5>, config_fn<6>, config_fn<7>,
                                      config_fn<8>, config_fn<9>, config_fn<10>, config_fn<11>};

static void for_each_config(const std::function<void(st::SgemmFn)>& check) {
  const int n = rt::config_count();
  ASSERT_LE(n, static_cast<int>(std::size(kConfigFns))) << "extend kConfigFns";
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE("configuration " + std::to_string(i) + ": " + rt::config(i).name());
    check(kConfigFns[i]);
  }
}

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(RegisterTiledMatmulContract, Implemented) { st::check_implemented(kMatmul); }

TEST(RegisterTiledMatmul, ConfigsAreListed) {
  ASSERT_GE(rt::config_count(), 1);
  EXPECT_THROW(rt::config(rt::config_count()), std::invalid_argument);
  EXPECT_THROW(rt::matmul_config(-1, 1, 1, 1, 1.0f, nullptr, nullptr, 0.0f, nullptr),
               std::invalid_argument);
}

TEST(RegisterTiledMatmul, EveryConfigFixedShapes) {
  K2C_REQUIRE_GPU();
  for_each_config([](st::SgemmFn fn) {
    for (const st::Case& c : st::fixed_cases()) st::check_case(fn, c);
  });
}

TEST(RegisterTiledMatmul, EveryConfigRandomShapes) {
  K2C_REQUIRE_GPU();
  const auto cases = st::random_cases(k2c::testing::seed_for("shapes"), 6, 400);
  for_each_config([&](st::SgemmFn fn) {
    for (const st::Case& c : cases) st::check_case(fn, c);
  });
}

TEST(RegisterTiledMatmul, BetaZeroIgnoresC) {
  K2C_REQUIRE_GPU();
  for_each_config([](st::SgemmFn fn) {
    for (const st::Case& c : st::beta_zero_cases()) st::check_case(fn, c);
    st::check_case(fn, {5, 9, 0, 1.5f, -0.5f});  // K == 0: C = beta * C
    st::check_case(fn, {8, 12, 4, 1.5f, 0.0f});  // float4 path, K == one partial tile
  });
}

static void expect_rate_at(int n, int repeats) {
  const double ceiling = k2c::sgemm_rate(n);
  const double achieved = st::measure_rate(kMatmul, n, n, n, repeats);
  K2C_EXPECT_PERF(achieved / 1e12, ceiling / 1e12,
                  std::to_string(n) + "^3, matmul() with the configuration tuned_config.h names, " +
                      std::to_string(repeats) + " runs");
}

// The grader's own run of the timed GEMM (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(sgemm) { st::run_witness(kMatmul, w); }

TEST(RegisterTiledMatmulPerf, At4096) {
  K2C_REQUIRE_TIMING();
  expect_rate_at(4096, 20);
}

// Recorded for the reference table; no points.
TEST(RegisterTiledMatmulPerf, At1024) { K2C_REQUIRE_TIMING(); expect_rate_at(1024, 20); }
TEST(RegisterTiledMatmulPerf, At2048) { K2C_REQUIRE_TIMING(); expect_rate_at(2048, 20); }
TEST(RegisterTiledMatmulPerf, At4000) { K2C_REQUIRE_TIMING(); expect_rate_at(4000, 20); }
TEST(RegisterTiledMatmulPerf, At8192) { K2C_REQUIRE_TIMING(); expect_rate_at(8192, 10); }
