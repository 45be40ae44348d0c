// autograder/00_roofline/test_roofline.cu — tests of module 00 (contract: roofline.h).
//
// RooflineMath.*  host arithmetic; runs on any machine.
// Copy.*, Fma.*   correctness on the GPU: random sizes including tails, outputs poisoned with
//                 NaN, guard elements after the end that must survive.
// *Perf.*         rate against a ceiling measured in this run (rubric: autograder/rubric.json).
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/core/random.h"
#include "k2c/device/buffer.h"
#include "k2c/device/device.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/compare.h"
#include "k2c/testing/testing.h"
#include "k2c/testing/witness.h"
#include "roofline.h"

namespace rl = k2c::roofline;
using k2c::testing::seed_for;

// =============================================================== roofline arithmetic (CPU) ===

TEST(RooflineMath, RidgePoint) {
  EXPECT_NEAR(rl::ridge_point(67e12, 4.25e12), 67e12 / 4.25e12, 1e-9);
  EXPECT_NEAR(rl::ridge_point(1.0, 4.0), 0.25, 1e-15);
  EXPECT_THROW(rl::ridge_point(0.0, 1.0), std::invalid_argument);
  EXPECT_THROW(rl::ridge_point(1.0, -1.0), std::invalid_argument);
}

TEST(RooflineMath, AttainableFlops) {
  const double peak = 50e12, bw = 4e12;  // ridge at 12.5 FLOP/B
  EXPECT_NEAR(rl::attainable_flops(1.0, peak, bw), 4e12, 1.0);
  EXPECT_NEAR(rl::attainable_flops(12.5, peak, bw), 50e12, 1.0);
  EXPECT_NEAR(rl::attainable_flops(1000.0, peak, bw), 50e12, 1.0);
  EXPECT_EQ(rl::attainable_flops(0.0, peak, bw), 0.0);
  EXPECT_THROW(rl::attainable_flops(-1.0, peak, bw), std::invalid_argument);
}

TEST(RooflineMath, MatmulIntensity) {
  // Square fp32: 2n³ / (4n² · 4 B) = n / 8.
  EXPECT_NEAR(rl::matmul_intensity(4096, 4096, 4096, 4), 512.0, 1e-9);
  EXPECT_NEAR(rl::matmul_intensity(128, 128, 128, 2), 32.0, 1e-12);
  // GEMV-like (N = 1): about 2 FLOP per element of A, i.e. 0.5 FLOP/B in fp32 — memory-bound.
  const double gemv = rl::matmul_intensity(8192, 1, 8192, 4);
  EXPECT_NEAR(gemv, 2.0 * 8192 * 8192 / ((8192.0 * 8192 + 8192 + 2 * 8192) * 4), 1e-12);
  EXPECT_LT(gemv, 0.5);
  // Not symmetric in general: the M×N output is read and written.
  EXPECT_NEAR(rl::matmul_intensity(2, 3, 5, 4), 60.0 / ((10 + 15 + 12) * 4.0), 1e-12);
  EXPECT_THROW(rl::matmul_intensity(0, 1, 1, 4), std::invalid_argument);
}

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(RooflineContract, Implemented) {
  const bool gpu = k2c::testing::gpu_available();
  k2c::DeviceBuffer<float> a(gpu ? 4 : 0), b(gpu ? 4 : 0);
  float* dummy = reinterpret_cast<float*>(256);  // never dereferenced: no device to launch on
  K2C_EXPECT_IMPLEMENTED(rl::copy(gpu ? a.data() : dummy, gpu ? b.data() : dummy, 4));
  K2C_EXPECT_IMPLEMENTED(rl::fma_throughput(gpu ? a.data() : dummy, 4, 1));
}

// ==================================================================== copy (GPU, correct) ===

// Copies n floats into a buffer with kGuard extra elements after the end, all poisoned; checks
// that the first n equal the source and that the guard is untouched.
static void check_copy(std::size_t n) {
  constexpr std::size_t kGuard = 64;
  std::vector<float> host(n);
  k2c::fill_uniform(host, seed_for("copy/" + std::to_string(n)));
  k2c::DeviceBuffer<float> src{std::span<const float>(host)};
  k2c::DeviceBuffer<float> dst(n + kGuard);
  dst.poison();
  rl::copy(src.data(), dst.data(), n);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> out = dst.download();

  const std::vector<double> want(host.begin(), host.end());
  const auto report = k2c::compare(std::span(out).first(n), want, k2c::Tolerance{0, 0, 0});
  EXPECT_TRUE(report.ok) << "n=" << n << ": " << report.summary();
  std::size_t touched = 0;
  for (std::size_t i = n; i < n + kGuard; ++i) touched += !std::isnan(out[i]);
  EXPECT_EQ(touched, 0u) << "n=" << n << ": copy wrote " << touched
                         << " element(s) past the end of dst";
}

TEST(RooflineCopy, AllSizes) {
  K2C_REQUIRE_GPU();
  std::vector<std::size_t> sizes = {1, 2, 3, 4, 5, 7, 8, 31, 33, 1000, 4097, 65536,
                                    (1u << 20) + 3, 12'345'679};
  std::mt19937_64 rng(seed_for("sizes"));
  for (int i = 0; i < 6; ++i) sizes.push_back(1 + rng() % 3'000'000);
  for (std::size_t n : sizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    check_copy(n);
  }
}

TEST(RooflineCopy, StaysInBounds) {
  K2C_REQUIRE_GPU();
  rl::copy(nullptr, nullptr, 0);  // n == 0 is a no-op, even with null pointers
  for (std::size_t n : {1u, 3u, 4u, 6u, 255u, 257u, 1025u}) check_copy(n);
}

// ===================================================================== FMA (GPU, correct) ===

TEST(RooflineFma, MatchesReference) {
  K2C_REQUIRE_GPU();
  for (auto [n, iters] : {std::pair<std::size_t, int>{1, 0}, {7, 1}, {1000, 37}, {100'003, 256}}) {
    SCOPED_TRACE("n=" + std::to_string(n) + " iters=" + std::to_string(iters));
    std::vector<float> in(n);
    k2c::fill_uniform(in, seed_for("fma/" + std::to_string(n)), -4.0f, 4.0f);
    k2c::DeviceBuffer<float> buf{std::span<const float>(in)};
    rl::fma_throughput(buf.data(), n, iters);
    K2C_CUDA_CHECK(cudaDeviceSynchronize());
    const auto want = k2c::ref::fma_chains(in, iters, rl::kFmaChains, rl::kFmaStep, rl::kFmaMul,
                                           rl::kFmaAdd);
    const auto report = k2c::compare(buf.download(), want, k2c::kFp32Tolerance);
    EXPECT_TRUE(report.ok) << report.summary();
  }
}

// ======================================================================== performance ======

TEST(RooflineCopyPerf, VsMemcpy) {
  K2C_REQUIRE_TIMING();
  // 1 GiB per buffer: ~18× the H200's L2, so the copy runs from HBM.
  const std::size_t bytes = std::size_t{1} << 30, n = bytes / sizeof(float);
  const double ceiling = k2c::copy_bandwidth(bytes);
  k2c::DeviceBuffer<float> src(n), dst(n);
  k2c::fill_uniform_device(src.data(), n, seed_for("src"));
  dst.poison();
  const k2c::Timing t = k2c::time_gpu([&] { rl::copy(src.data(), dst.data(), n); });

  // Check the result of the timed runs: every element, since a copy has nothing to hide behind.
  std::vector<float> out(n);
  K2C_CUDA_CHECK(cudaMemcpy(out.data(), dst.data(), bytes, cudaMemcpyDeviceToHost));
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += out[i] != k2c::uniform_at(seed_for("src"), i, -1.0f, 1.0f);
  ASSERT_EQ(wrong, 0u) << "the timed copy produced " << wrong << " wrong values";

  const double achieved = 2.0 * bytes / (t.median_ms * 1e-3);
  K2C_EXPECT_PERF(achieved / 1e9, ceiling / 1e9,
                  "1 GiB, median of " + std::to_string(t.repeats) + " runs");
}

// The grader's own run of the copy (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(copy) { rl::copy(w.at<float>(0), w.at<float>(1), static_cast<std::size_t>(w.shape[0])); }

// ... and of the FMA chains, in place on its buffer of two waves of this GPU's threads.
K2C_WITNESS(fma) { rl::fma_throughput(w.at<float>(0), static_cast<std::size_t>(w.shape[0]), w.dim(1)); }

TEST(RooflineFmaPerf, VsPeak) {
  K2C_REQUIRE_TIMING();
  const k2c::DeviceInfo& d = k2c::device_info();
  const std::size_t n = static_cast<std::size_t>(d.sms) * 2048 * 2;  // 2 full waves of threads
  const int iters = 4096;
  k2c::DeviceBuffer<float> buf(n);
  k2c::fill_uniform_device(buf.data(), n, seed_for("fma"));
  constexpr int kWarmup = 3, kRepeats = 15;
  const k2c::Timing t = k2c::time_gpu([&] { rl::fma_throughput(buf.data(), n, iters); },
                                      {.warmup = kWarmup, .repeats = kRepeats, .flush_l2 = false});
  // The buffer went through every launch in turn: replay them on the CPU for fresh random
  // elements, so skipped iterations or skipped elements cannot pass.
  const std::vector<float> out = buf.download();
  std::mt19937_64 fresh(std::random_device{}());
  std::vector<float> start(1);
  for (int s = 0; s < 32; ++s) {
    const std::size_t i = fresh() % n;
    start[0] = k2c::uniform_at(seed_for("fma"), i, -1.0f, 1.0f);
    for (int launch = 0; launch < kWarmup + kRepeats; ++launch)
      start[0] = static_cast<float>(k2c::ref::fma_chains(start, iters, rl::kFmaChains, rl::kFmaStep,
                                                         rl::kFmaMul, rl::kFmaAdd)[0]);
    ASSERT_NEAR(out[i], start[0], 1e-5 * std::abs(start[0]) + 1e-6) << "element " << i << " after the timed runs";
  }

  const double flops = 2.0 * rl::kFmaChains * iters * static_cast<double>(n);
  const double achieved = flops / (t.median_ms * 1e-3);
  K2C_EXPECT_PERF(achieved / 1e12, k2c::fp32_peak_flops(d) / 1e12,
                  "peak = " + std::to_string(d.sms) + " SMs x " +
                      std::to_string(k2c::fp32_lanes_per_sm(d.cc_major, d.cc_minor)) +
                      " lanes x 2 x " + std::to_string(d.clock_ghz) + " GHz");
}
