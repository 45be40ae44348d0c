// sgemm_testing.cpp — see k2c/testing/sgemm_testing.h.
#include "k2c/testing/sgemm_testing.h"

#include <random>

#include <gtest/gtest.h>

#include "k2c/core/random.h"
#include "k2c/device/buffer.h"
#include "k2c/device/timing.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/compare.h"
#include "k2c/testing/testing.h"

namespace k2c::sgemm_testing {

std::string describe(const Case& c) {
  return std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) +
         " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta);
}

std::vector<Case> fixed_cases() {
  return {{1, 1, 1, 1.5f, -0.5f},     {17, 33, 65, 0.75f, 1.25f},  {7, 129, 33, -1.5f, 0.5f},
          {64, 64, 64, 2.0f, -1.0f},  {1, 513, 257, 0.5f, 2.0f},   {300, 1, 77, -0.25f, 1.5f},
          {129, 130, 131, 1.0f, 0.5f}, {255, 257, 3, 1.25f, -1.0f}, {1000, 999, 1001, 1.25f, 0.75f},
          {1024, 1024, 1024, 0.5f, 0.25f}};
}

std::vector<Case> beta_zero_cases() {
  return {{1, 1, 1, 1.5f, 0.0f}, {33, 65, 17, -0.75f, 0.0f}, {200, 130, 70, 1.0f, 0.0f},
          {256, 256, 256, 1.0f, 0.0f}};
}

std::vector<Case> random_cases(std::uint64_t seed, int count, int max_dim) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dim(1, max_dim);
  std::uniform_real_distribution<float> scale(-2.0f, 2.0f);
  std::vector<Case> cases;
  for (int i = 0; i < count; ++i) cases.push_back({dim(rng), dim(rng), dim(rng), scale(rng), scale(rng)});
  return cases;
}

void check_implemented(SgemmFn fn) {
  const bool gpu = testing::gpu_available();
  DeviceBuffer<float> a(gpu ? 4 : 0), b(gpu ? 4 : 0), c(gpu ? 4 : 0);
  float* dummy = reinterpret_cast<float*>(256);  // never dereferenced: no device to launch on
  K2C_EXPECT_IMPLEMENTED(fn(1, 1, 1, 1.0f, gpu ? a.data() : dummy, gpu ? b.data() : dummy, 0.0f,
                            gpu ? c.data() : dummy, nullptr));
}

void check_case(SgemmFn fn, const Case& c) {
  SCOPED_TRACE(describe(c));
  const std::string tag = describe(c);
  const std::size_t a_n = static_cast<std::size_t>(c.M) * c.K, b_n = static_cast<std::size_t>(c.K) * c.N,
                    c_n = static_cast<std::size_t>(c.M) * c.N;
  std::vector<float> A(a_n), B(b_n), C(c_n);
  fill_uniform(A, testing::seed_for(tag + "/A"));
  fill_uniform(B, testing::seed_for(tag + "/B"));
  fill_uniform(C, testing::seed_for(tag + "/C"));
  DeviceBuffer<float> dA{std::span<const float>(A)}, dB{std::span<const float>(B)}, dC(c_n);
  if (c.beta == 0.0f)
    dC.poison();  // NaN everywhere: beta == 0 must not read C
  else
    dC.upload(C);

  fn(c.M, c.N, c.K, c.alpha, dA.data(), dB.data(), c.beta, dC.data(), nullptr);
  const cudaError_t err = cudaDeviceSynchronize();
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);

  const auto want = ref::gemm(c.M, c.N, c.K, c.alpha, A, B, c.beta, C);
  const auto report = compare(dC.download(), want, gemm_tolerance(c.K, c.alpha, c.beta), c.N);
  EXPECT_TRUE(report.ok) << report.summary();
}

double measure_rate(SgemmFn fn, int M, int N, int K, int repeats) {
  constexpr float alpha = 1.25f, beta = -0.75f;
  std::vector<float> A(static_cast<std::size_t>(M) * K), B(static_cast<std::size_t>(K) * N),
      C(static_cast<std::size_t>(M) * N);
  fill_uniform(A, testing::seed_for("rate/A"));
  fill_uniform(B, testing::seed_for("rate/B"));
  fill_uniform(C, testing::seed_for("rate/C"));
  DeviceBuffer<float> dA{std::span<const float>(A)}, dB{std::span<const float>(B)},
      dC{std::span<const float>(C)};

  // Correctness of exactly one run, at random positions (the full reference would take minutes).
  fn(M, N, K, alpha, dA.data(), dB.data(), beta, dC.data(), nullptr);
  const std::vector<float> out = dC.download();
  std::mt19937_64 rng(testing::seed_for("rate/samples"));
  std::vector<std::size_t> where;
  std::vector<float> got;
  std::vector<double> want;
  for (int s = 0; s < 512; ++s) {
    const int r = static_cast<int>(rng() % M), col = static_cast<int>(rng() % N);
    where.push_back(static_cast<std::size_t>(r) * N + col);
    got.push_back(out[where.back()]);
    want.push_back(ref::gemm_at(N, K, alpha, A, B, beta, C, r, col));
  }
  const auto report = compare_sampled(got, want, where, gemm_tolerance(K, alpha, beta), N);
  EXPECT_TRUE(report.ok) << "the timed kernel's output is wrong: " << report.summary();
  if (!report.ok) return 0;

  // beta = 0 while timing, so every repeat computes the same thing.
  const Timing t = time_gpu([&] { fn(M, N, K, alpha, dA.data(), dB.data(), 0.0f, dC.data(), nullptr); },
                            {.warmup = 2, .repeats = repeats});

  // And the timed runs must have computed it: fresh positions that nothing could have predicted.
  const std::vector<float> timed = dC.download();
  std::mt19937_64 fresh(std::random_device{}());
  where.clear(), got.clear(), want.clear();
  const std::vector<float> no_c;
  for (int s = 0; s < 256; ++s) {
    const int r = static_cast<int>(fresh() % M), col = static_cast<int>(fresh() % N);
    where.push_back(static_cast<std::size_t>(r) * N + col);
    got.push_back(timed[where.back()]);
    want.push_back(ref::gemm_at(N, K, alpha, A, B, 0.0, no_c, r, col));
  }
  const auto timed_report = compare_sampled(got, want, where, gemm_tolerance(K, alpha, 0), N);
  EXPECT_TRUE(timed_report.ok) << "the timed runs' output is wrong: " << timed_report.summary();
  if (!timed_report.ok) return 0;
  return 2.0 * M * static_cast<double>(N) * K / (t.median_ms * 1e-3);
}

void run_witness(SgemmFn fn, const testing::WitnessLaunch& w) {
  fn(w.dim(0), w.dim(1), w.dim(2), 1.0f, w.at<float>(0), w.at<float>(1), 0.0f, w.at<float>(2), nullptr);
}

}  // namespace k2c::sgemm_testing
