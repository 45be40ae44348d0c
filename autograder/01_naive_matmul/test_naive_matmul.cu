// autograder/01_naive_matmul/test_naive_matmul.cu — tests of module 01
// (contract: naive_matmul.h).
//
// Correctness against the double-precision CPU reference on fixed awkward shapes and on random
// shapes drawn from the run's seed, with alpha and beta away from 0 and 1 and random C (any
// element left unwritten keeps its old value, which is far outside the tolerance). beta == 0
// runs on a C poisoned with NaN. The performance test spot-checks a 4096³ product at random
// positions and compares the rate with cuBLAS SGEMM measured in the same run.
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/buffer.h"
#include "k2c/ceilings.h"
#include "k2c/compare.h"
#include "k2c/random.h"
#include "k2c/reference.h"
#include "k2c/testing.h"
#include "k2c/timing.h"
#include "naive_matmul.h"

using k2c::testing::seed_for;

namespace {

struct Case {
  int M, N, K;
  float alpha, beta;
};

std::string describe(const Case& c) {
  return std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) +
         " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta);
}

// Runs one case on the GPU and compares every element of C with the reference.
void check_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  const std::string tag = describe(c);
  std::vector<float> A(static_cast<std::size_t>(c.M) * c.K), B(static_cast<std::size_t>(c.K) * c.N),
      C(static_cast<std::size_t>(c.M) * c.N);
  k2c::fill_uniform(A, seed_for(tag + "/A"));
  k2c::fill_uniform(B, seed_for(tag + "/B"));
  k2c::fill_uniform(C, seed_for(tag + "/C"));
  k2c::DeviceBuffer<float> dA{std::span<const float>(A)}, dB{std::span<const float>(B)}, dC(C.size());
  if (c.beta == 0.0f)
    dC.poison();  // NaN everywhere: beta == 0 must not read C
  else
    dC.upload(C);

  k2c::naive_matmul::matmul(c.M, c.N, c.K, c.alpha, dA.data(), dB.data(), c.beta, dC.data());
  K2C_CUDA_CHECK(cudaDeviceSynchronize());

  const auto want = k2c::ref::gemm(c.M, c.N, c.K, c.alpha, A, B, c.beta, C);
  const auto report = k2c::compare(dC.download(), want, k2c::gemm_tolerance(c.K, c.alpha, c.beta), c.N);
  EXPECT_TRUE(report.ok) << report.summary();
}

}  // namespace

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(Contract, Implemented) {
  const bool gpu = k2c::testing::gpu_available();
  k2c::DeviceBuffer<float> a(gpu ? 1 : 0), b(gpu ? 1 : 0), c(gpu ? 1 : 0);
  float* dummy = reinterpret_cast<float*>(256);  // never dereferenced: no device to launch on
  K2C_EXPECT_IMPLEMENTED(k2c::naive_matmul::matmul(1, 1, 1, 1.0f, gpu ? a.data() : dummy,
                                                   gpu ? b.data() : dummy, 0.0f,
                                                   gpu ? c.data() : dummy));
}

TEST(NaiveMatmul, FixedShapes) {
  K2C_REQUIRE_GPU();
  for (const Case& c : {Case{1, 1, 1, 1.5f, -0.5f}, Case{17, 33, 65, 0.75f, 1.25f},
                        Case{7, 129, 33, -1.5f, 0.5f}, Case{64, 64, 64, 2.0f, -1.0f},
                        Case{1000, 1000, 999, 1.25f, 0.75f}, Case{1, 513, 257, 0.5f, 2.0f},
                        Case{300, 1, 77, -0.25f, 1.5f}})
    check_case(c);
}

TEST(NaiveMatmul, RandomShapes) {
  K2C_REQUIRE_GPU();
  std::mt19937_64 rng(seed_for("shapes"));
  std::uniform_int_distribution<int> dim(1, 300);
  std::uniform_real_distribution<float> scale(-2.0f, 2.0f);
  for (int i = 0; i < 10; ++i) check_case({dim(rng), dim(rng), dim(rng), scale(rng), scale(rng)});
}

TEST(NaiveMatmul, BetaZeroIgnoresC) {
  K2C_REQUIRE_GPU();
  for (const Case& c : {Case{1, 1, 1, 1.5f, 0.0f}, Case{33, 65, 17, -0.75f, 0.0f},
                        Case{200, 130, 70, 1.0f, 0.0f}})
    check_case(c);
}

TEST(NaiveMatmul, DegenerateSizes) {
  K2C_REQUIRE_GPU();
  // M or N == 0: nothing to compute, nothing may be touched (null pointers are fine).
  k2c::naive_matmul::matmul(0, 5, 3, 1.0f, nullptr, nullptr, 1.0f, nullptr);
  k2c::naive_matmul::matmul(4, 0, 3, 1.0f, nullptr, nullptr, 1.0f, nullptr);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  // K == 0: C = beta * C (and beta == 0 gives zeros even over NaN).
  check_case({5, 9, 0, 1.5f, -0.5f});
  check_case({3, 4, 0, 1.5f, 0.0f});
  EXPECT_THROW(k2c::naive_matmul::matmul(-1, 2, 2, 1.0f, nullptr, nullptr, 0.0f, nullptr),
               std::invalid_argument);
}

TEST(NaiveMatmulPerf, At4096) {
  K2C_REQUIRE_TIMING();
  constexpr int n = 4096;
  constexpr float alpha = 1.25f, beta = -0.75f;
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  const double ceiling = k2c::sgemm_rate(n);

  std::vector<float> A(nn), B(nn), C(nn);
  k2c::fill_uniform(A, seed_for("A"));
  k2c::fill_uniform(B, seed_for("B"));
  k2c::fill_uniform(C, seed_for("C"));
  k2c::DeviceBuffer<float> dA{std::span<const float>(A)}, dB{std::span<const float>(B)}, dC(nn);

  // Correctness of exactly one run, at random positions (the full reference is 69 G multiply-adds).
  dC.upload(C);
  k2c::naive_matmul::matmul(n, n, n, alpha, dA.data(), dB.data(), beta, dC.data());
  std::vector<float> out = dC.download();
  std::mt19937_64 rng(seed_for("samples"));
  std::vector<std::size_t> where;
  std::vector<float> got;
  std::vector<double> want;
  for (int s = 0; s < 512; ++s) {
    const int r = static_cast<int>(rng() % n), c = static_cast<int>(rng() % n);
    where.push_back(static_cast<std::size_t>(r) * n + c);
    got.push_back(out[where.back()]);
    want.push_back(k2c::ref::gemm_at(n, n, alpha, A, B, beta, C, r, c));
  }
  const auto report = k2c::compare_sampled(got, want, where, k2c::gemm_tolerance(n, alpha, beta), n);
  ASSERT_TRUE(report.ok) << report.summary();

  // Timing: beta = 0 so repeated runs compute the same thing (C is output only).
  const k2c::Timing t = k2c::time_gpu(
      [&] { k2c::naive_matmul::matmul(n, n, n, alpha, dA.data(), dB.data(), 0.0f, dC.data()); },
      {.warmup = 1, .repeats = 5});
  const double achieved = 2.0 * n * static_cast<double>(n) * n / (t.median_ms * 1e-3);
  K2C_EXPECT_PERF(achieved / 1e12, ceiling / 1e12, "4096^3, median of 5 runs");
}
