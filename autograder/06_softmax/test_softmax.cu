// autograder/06_softmax/test_softmax.cu — tests of module 06 (contract: softmax.h).
//
// Every version, in fp32 and bf16, against the double-precision CPU reference on row lengths
// that hit every edge (1, 7, 31, 4095, 4096, 65537, ...), with many and few rows, outputs
// poisoned with NaN first; logits large enough to overflow an exp that forgets the maximum;
// the fast version's speed against the copy bandwidth measured in the same run.
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/device/buffer.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/bf16.h"
#include "k2c/testing/compare.h"
#include "k2c/testing/testing.h"
#include "k2c/testing/witness.h"
#include "softmax.h"

namespace sm = k2c::softmax;
using k2c::bf16;
using k2c::testing::seed_for;

namespace {

// Tolerances. A probability p comes out of exp(x - m) / s in fp32: exp's relative error is about
// 2^-21 plus |x - m| · 2^-24 from scaling the argument, the sum's a few ulps. fp32 outputs keep
// that (≈ 2e-6 relative for logits within ±64); bf16 outputs add one rounding of at most 2^-8 (8 significant bits).
// Probabilities span many orders of magnitude, so the bound is relative, with an absolute floor
// far below any probability the tests produce except those that truly underflow. The norm bound
// (error norm over reference norm) can never exceed the largest elementwise relative error, so for
// bf16 it sits just above one rounding: a short row dominated by one or two probabilities that
// happen to round by nearly 2^-8 must pass. A wrong maximum, a missing rescale or an unwritten
// element is off by a factor, not by 1e-5.
template <class T>
k2c::Tolerance tolerance() {
  if constexpr (std::is_same_v<T, bf16>) return {1e-30, 4.5e-3, 4e-3};
  return {1e-30, 2e-5, 1e-5};
}

using Shape = k2c::testing::RowShape;

template <class T>
void check(sm::Version v, Shape s, float spread, const std::string& purpose) {
  SCOPED_TRACE(std::string(sm::name(v)) + " " + k2c::type_name<T>() + " " + std::to_string(s.rows) +
               " x " + std::to_string(s.cols) + " logits in ±" + std::to_string(spread));
  const std::size_t n = static_cast<std::size_t>(s.rows) * s.cols;
  const std::vector<float> x = k2c::random_values<T>(n, seed_for(purpose), -spread, spread);
  k2c::DeviceBuffer<T> dx = k2c::to_device<T>(x), dy(n);
  dy.poison();
  sm::softmax(v, dx.data(), dy.data(), s.rows, s.cols);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  const auto report = k2c::compare(k2c::to_host(dy), k2c::ref::softmax_rows(x, s.rows, s.cols),
                                   tolerance<T>(), static_cast<std::size_t>(s.cols));
  EXPECT_TRUE(report.ok) << report.summary();
}

// Row lengths: a single column (every output 1), lengths around the warp and the vector width,
// around the register-path limits (16384 elements one at a time, 32768 fp32 and 65536 bf16 in
// 16-byte vectors; and just past each), and a 65537-long row (odd, and too long for
// registers).
std::vector<Shape> fixed_shapes() {
  return {{1, 1},     {5, 1},     {3, 7},     {33, 31},    {1, 32},     {4, 33},
          {37, 4095}, {64, 4096}, {2, 8192},  {2, 16384},  {2, 16392},  {2, 32768},
          {2, 32776}, {3, 65537}, {1, 65536}, {2, 65544},  {2, 16383},  {2, 16385},
          {2000, 7},  {1000, 128}, {9, 1000}};
}

std::vector<Shape> random_shapes() { return k2c::testing::random_row_shapes(seed_for("shapes"), 6, 20000, 200'000); }

template <class T>
void check_version(sm::Version v) {
  int i = 0;
  for (Shape s : fixed_shapes()) check<T>(v, s, 8.0f, "fixed/" + std::to_string(i++));
  for (Shape s : random_shapes()) check<T>(v, s, 8.0f, "random/" + std::to_string(i++));
}

}  // namespace

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(SoftmaxContract, Implemented) {
  const bool gpu = k2c::testing::gpu_available();
  k2c::DeviceBuffer<float> a(gpu ? 64 : 0), b(gpu ? 64 : 0);
  float* dummy = reinterpret_cast<float*>(256);  // never dereferenced: no device to launch on
  for (sm::Version v : sm::kVersions)
    K2C_EXPECT_IMPLEMENTED(sm::softmax(v, gpu ? a.data() : dummy, gpu ? b.data() : dummy, 2, 32));
}

// Base pointers one element past a 16-byte boundary, with a row length that is a multiple of the
// vector width: a kernel that checks the row length but not the addresses faults or misreads here.
TEST(Softmax, UnalignedPointers) {
  K2C_REQUIRE_GPU();
  const int rows = 5, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows) * cols;
  const std::vector<float> x = k2c::random_values<bf16>(n, seed_for("unaligned"), -8.0f, 8.0f);
  k2c::DeviceBuffer<bf16> dx = k2c::to_device<bf16>(k2c::after_padding(x, 1)), dy(n + 1);
  for (sm::Version v : sm::kVersions) {
    dy.poison();
    sm::softmax(v, dx.data() + 1, dy.data() + 1, rows, cols);
    K2C_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> y = k2c::to_host(dy);
    const auto report = k2c::compare(std::span(y).subspan(1), k2c::ref::softmax_rows(x, rows, cols),
                                     tolerance<bf16>(), cols);
    EXPECT_TRUE(report.ok) << sm::name(v) << ": " << report.summary();
  }
}

TEST(Softmax, ArgumentChecks) {
  for (sm::Version v : sm::kVersions) {
    EXPECT_THROW(sm::softmax(v, static_cast<const float*>(nullptr), nullptr, -1, 4), std::invalid_argument);
    EXPECT_THROW(sm::softmax(v, static_cast<const float*>(nullptr), nullptr, 4, 4), std::invalid_argument);
    sm::softmax(v, static_cast<const float*>(nullptr), nullptr, 0, 4);  // empty: a no-op
    sm::softmax(v, static_cast<const bf16*>(nullptr), nullptr, 4, 0);
    // Too many rows for int indices: refused before any launch (the pointers are never used).
    float* dummy = reinterpret_cast<float*>(256);
    EXPECT_THROW(sm::softmax(v, dummy, dummy, sm::kMaxExtent + 1, 1), std::invalid_argument);
  }
}

TEST(Softmax, ThreePass) {
  K2C_REQUIRE_GPU();
  check_version<float>(sm::Version::three_pass);
  check_version<bf16>(sm::Version::three_pass);
}

TEST(Softmax, Online) {
  K2C_REQUIRE_GPU();
  check_version<float>(sm::Version::online);
  check_version<bf16>(sm::Version::online);
}

TEST(Softmax, Fast) {
  K2C_REQUIRE_GPU();
  check_version<float>(sm::Version::fast);
  check_version<bf16>(sm::Version::fast);
}

// Logits in ±1000: exp(1000) overflows fp32 (and bf16, which has the same range), so a kernel
// that does not subtract the row maximum returns Inf or NaN. The rows also contain many values
// far below the maximum, whose probabilities underflow to 0 exactly.
TEST(Softmax, LargeLogits) {
  K2C_REQUIRE_GPU();
  for (sm::Version v : sm::kVersions) {
    check<float>(v, {16, 4096}, 1000.0f, "large/fp32");
    check<bf16>(v, {7, 65537}, 1000.0f, "large/bf16");
    check<bf16>(v, {100, 33}, 200.0f, "large/short");
  }
}

// bf16, 16384 rows of 4096: 128 MiB in, 128 MiB out. A softmax must read x and write y once, so
// the bytes of a copy are its floor; it is judged against cudaMemcpy's rate in this run.
TEST(SoftmaxPerf, FastVsCopy) {
  K2C_REQUIRE_TIMING();
  const int rows = 16384, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows) * cols;
  const double ceiling = k2c::copy_bandwidth();
  const std::vector<float> x = k2c::random_values<bf16>(n, seed_for("perf"), -8.0f, 8.0f);
  k2c::DeviceBuffer<bf16> dx = k2c::to_device<bf16>(x), dy(n);
  dy.poison();
  const k2c::Timing t = k2c::time_gpu([&] { sm::softmax(sm::Version::fast, dx.data(), dy.data(), rows, cols); });

  // The timed runs' output, checked on 64 random rows.
  const std::vector<float> y = k2c::to_host(dy);
  std::mt19937_64 pick(std::random_device{}());
  for (int k = 0; k < 64; ++k) {
    const int r = static_cast<int>(pick() % rows);
    const std::span<const float> row_x(x.data() + static_cast<std::size_t>(r) * cols, cols);
    const std::span<const float> row_y(y.data() + static_cast<std::size_t>(r) * cols, cols);
    const auto report = k2c::compare(row_y, k2c::ref::softmax_rows(row_x, 1, cols), tolerance<bf16>());
    ASSERT_TRUE(report.ok) << "row " << r << " after the timed runs: " << report.summary();
  }
  const double bytes = 2.0 * n * sizeof(bf16);
  K2C_EXPECT_PERF(bytes / (t.median_ms * 1e-3) / 1e9, ceiling / 1e9,
                  "16384 x 4096 bf16, median of " + std::to_string(t.repeats) + " runs");
}

// The grader's own run of the timed softmax (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(softmax_fast) { sm::softmax(sm::Version::fast, w.at<bf16>(0), w.at<bf16>(1), w.dim(0), w.dim(1)); }
