// autograder/07_rmsnorm/test_rmsnorm.cu — tests of module 07 (contract: rmsnorm.h).
//
// Forward (with and without the fused residual add) and backward (dx and dgamma) against the
// double-precision CPU reference on row lengths 1, 7, 31, 4095, 4096, 65537 and random shapes,
// with few and many rows; outputs poisoned first; both passes' speed against the copy bandwidth
// measured in the same run.
#include <algorithm>
#include <cmath>
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
#include "rmsnorm.h"

namespace rn = k2c::rmsnorm;
using k2c::bf16;
using k2c::testing::seed_for;

namespace {

constexpr float kEps = 1e-5f;

// y = h · rstd · gamma and dx are computed in fp32 (errors ~1e-6) and rounded once to bf16
// (relative error at most 2^-8 ≈ 3.9e-3): rtol a little over that; the absolute floor covers
// dx's cancelling terms, whose fp32 error is absolute. rstd is fp32 from a sum of squares:
// relative 2e-5 leaves room for summation error over 65537 terms. dgamma sums rows terms of size
// up to ~2 in fp32: the absolute bound grows with the row count. The norm bound of the bf16
// outputs sits just above one rounding, since a norm of relative errors can never exceed the
// largest one and a row of one or two elements may round by nearly 2^-8 throughout. A wrong
// formula, a missing term or an unwritten element is off by orders of magnitude more.
constexpr k2c::Tolerance kOutTolerance{1e-4, 4.5e-3, 4e-3};
constexpr k2c::Tolerance kRstdTolerance{0, 2e-5, 1e-5};
k2c::Tolerance dgamma_tolerance(int rows) { return {1e-6 + 2.4e-7 * rows, 1e-5, 1e-5}; }

using Shape = k2c::testing::RowShape;

std::vector<Shape> fixed_shapes() {
  // Around the register-path limits too: 8192 elements (the backward one element at a time),
  // 16384 (the backward in 16-byte vectors; the forward one element at a time), 32768 (the
  // forward with the fused add) and 65536 (the forward in 16-byte vectors), and one vector past
  // each.
  // And around the reference's Hopper backward (rows of 2048 to 8192 bf16 streamed through a ring
  // of 3 or 2 row pairs): its ends and one vector past them, a vector past a whole number per
  // thread (2056), where the ring drops to 2 slots (6152), and more rows than blocks (2000), and
  // enough rows per block that the slots of both rings are reused several times, their barriers'
  // phase bits flipping back and forth (2500, 8000). Many short rows (20000 x 7 and 40000 x 128)
  // leave thousands of partial rows of dgamma on an H200, which the reference sums in two passes.
  return {{1, 1},      {3, 7},     {33, 31},   {1, 32},     {4, 33},     {37, 4095},  {64, 4096},
          {2, 8192},   {2, 16384}, {2, 16392}, {2, 32768},  {2, 32776},  {3, 65537},  {2, 65536},
          {2, 65544},  {2, 16383}, {2, 16385}, {2, 8191},  {2, 8193},
          {20000, 7},  {1000, 128}, {9, 1000}, {3000, 4096}, {5, 2040},  {7, 2048},   {2000, 2056},
          {3, 6144},   {600, 6152}, {3, 8200},    {2500, 6152}, {8000, 2048}, {40000, 128}};
}

std::vector<Shape> all_shapes() {
  std::vector<Shape> shapes = fixed_shapes();
  for (Shape s : k2c::testing::random_row_shapes(seed_for("shapes"), 6, 20000, 200'000)) shapes.push_back(s);
  return shapes;
}

std::string describe(Shape s) { return std::to_string(s.rows) + " x " + std::to_string(s.cols); }

void check_forward(Shape s, bool fused, const std::string& purpose) {
  SCOPED_TRACE(describe(s) + (fused ? " with the residual add" : ""));
  const std::size_t n = static_cast<std::size_t>(s.rows) * s.cols;
  const std::vector<float> x = k2c::random_values<bf16>(n, seed_for(purpose + "/x"), -2.0f, 2.0f);
  const std::vector<float> res = k2c::random_values<bf16>(n, seed_for(purpose + "/res"), -2.0f, 2.0f);
  const std::vector<float> gamma = k2c::random_values<bf16>(s.cols, seed_for(purpose + "/g"), 0.5f, 1.5f);
  // What the layer normalises: x, or x + residual rounded to bf16.
  std::vector<float> h = x;
  if (fused) {
    for (std::size_t i = 0; i < n; ++i) h[i] = x[i] + res[i];
    h = k2c::round_to_bf16(h);
  }

  auto dx = k2c::to_device<bf16>(x), dres = k2c::to_device<bf16>(res), dg = k2c::to_device<bf16>(gamma);
  k2c::DeviceBuffer<bf16> dy(n), dsum(n);
  k2c::DeviceBuffer<float> drstd(s.rows);
  dy.poison();
  dsum.poison();
  drstd.poison();
  rn::forward(dx.data(), fused ? dres.data() : nullptr, dg.data(), dy.data(), fused ? dsum.data() : nullptr,
              drstd.data(), s.rows, s.cols, kEps);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());

  const k2c::ref::RmsNormForward want = k2c::ref::rmsnorm_forward(h, gamma, s.rows, s.cols, kEps);
  const auto y_report = k2c::compare(k2c::to_host(dy), want.y, kOutTolerance, s.cols);
  EXPECT_TRUE(y_report.ok) << "y: " << y_report.summary();
  const auto r_report = k2c::compare(drstd.download(), want.rstd, kRstdTolerance);
  EXPECT_TRUE(r_report.ok) << "rstd: " << r_report.summary();
  if (fused) {
    const auto h_report = k2c::compare(k2c::to_host(dsum), std::vector<double>(h.begin(), h.end()),
                                       k2c::Tolerance{0, 0, 0}, s.cols);
    EXPECT_TRUE(h_report.ok) << "residual_out (x + residual rounded to bf16, exactly): " << h_report.summary();
  }
}

// The backward pass on its own: rstd comes from the reference, so a forward bug cannot hide here.
void check_backward(Shape s, const std::string& purpose) {
  SCOPED_TRACE(describe(s));
  const std::size_t n = static_cast<std::size_t>(s.rows) * s.cols;
  const std::vector<float> h = k2c::random_values<bf16>(n, seed_for(purpose + "/h"), -2.0f, 2.0f);
  const std::vector<float> dy = k2c::random_values<bf16>(n, seed_for(purpose + "/dy"), -1.0f, 1.0f);
  const std::vector<float> gamma = k2c::random_values<bf16>(s.cols, seed_for(purpose + "/g"), 0.5f, 1.5f);
  const k2c::ref::RmsNormForward fwd = k2c::ref::rmsnorm_forward(h, gamma, s.rows, s.cols, kEps);
  const std::vector<float> rstd(fwd.rstd.begin(), fwd.rstd.end());

  auto dh = k2c::to_device<bf16>(h), ddy = k2c::to_device<bf16>(dy), dg = k2c::to_device<bf16>(gamma);
  k2c::DeviceBuffer<float> drstd{std::span<const float>(rstd)}, ddgamma(s.cols);
  k2c::DeviceBuffer<bf16> ddx(n);
  k2c::DeviceBuffer<char> workspace(rn::backward_workspace_bytes(s.rows, s.cols));
  ddx.poison();
  ddgamma.poison();
  workspace.poison();  // a kernel that trusts its workspace to start at zero fails
  rn::backward(dh.data(), dg.data(), ddy.data(), drstd.data(), ddx.data(), ddgamma.data(),
               workspace.data(), s.rows, s.cols);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());

  const k2c::ref::RmsNormBackward want = k2c::ref::rmsnorm_backward(h, gamma, dy, s.rows, s.cols, kEps);
  // With one column, y = sign(h)·gamma whatever h is, so dx is zero up to eps-sized terms: the
  // outputs are pure rounding noise, and only the elementwise bound (absolute) means anything.
  k2c::Tolerance dx_tolerance = kOutTolerance;
  if (s.cols == 1) dx_tolerance.max_rel_l2 = 1.0;
  const auto dx_report = k2c::compare(k2c::to_host(ddx), want.dx, dx_tolerance, s.cols);
  EXPECT_TRUE(dx_report.ok) << "dx: " << dx_report.summary();
  const auto dg_report = k2c::compare(ddgamma.download(), want.dgamma, dgamma_tolerance(s.rows));
  EXPECT_TRUE(dg_report.ok) << "dgamma: " << dg_report.summary();
}

}  // namespace

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(RmsNormContract, Implemented) {
  const bool gpu = k2c::testing::gpu_available();
  k2c::DeviceBuffer<bf16> a(gpu ? 64 : 0), b(gpu ? 64 : 0), g(gpu ? 32 : 0);
  k2c::DeviceBuffer<float> r(gpu ? 64 : 0), dg(gpu ? 32 : 0);
  auto pick = [gpu](auto* real) { return gpu ? real : reinterpret_cast<decltype(real)>(256); };
  K2C_EXPECT_IMPLEMENTED(rn::forward(pick(a.data()), nullptr, pick(g.data()), pick(b.data()), nullptr,
                                     pick(r.data()), 2, 32, kEps));
  const std::size_t ws = rn::backward_workspace_bytes(2, 32);
  k2c::DeviceBuffer<char> w(gpu ? ws : 0);
  K2C_EXPECT_IMPLEMENTED(rn::backward(pick(a.data()), pick(g.data()), pick(a.data()), pick(r.data()),
                                      pick(b.data()), pick(dg.data()), pick(w.data()), 2, 32));
}

// Base pointers one element past a 16-byte boundary, with a row length that is a multiple of the
// vector width: a kernel that checks the row length but not the addresses faults or misreads here.
TEST(RmsNorm, UnalignedPointers) {
  K2C_REQUIRE_GPU();
  const int rows = 6, cols = 4096;
  const std::size_t n = static_cast<std::size_t>(rows) * cols;
  const std::vector<float> h = k2c::random_values<bf16>(n, seed_for("unaligned/h"), -2.0f, 2.0f);
  const std::vector<float> dy = k2c::random_values<bf16>(n, seed_for("unaligned/dy"), -1.0f, 1.0f);
  const std::vector<float> gamma = k2c::random_values<bf16>(cols, seed_for("unaligned/g"), 0.5f, 1.5f);
  auto dh = k2c::to_device<bf16>(k2c::after_padding(h, 1)), ddy = k2c::to_device<bf16>(k2c::after_padding(dy, 1));
  auto dg = k2c::to_device<bf16>(gamma);
  k2c::DeviceBuffer<bf16> y(n + 1), dx(n + 1);
  k2c::DeviceBuffer<float> rstd(rows), dgamma(cols);
  k2c::DeviceBuffer<char> workspace(rn::backward_workspace_bytes(rows, cols));
  y.poison();
  dx.poison();
  rn::forward(dh.data() + 1, nullptr, dg.data(), y.data() + 1, nullptr, rstd.data(), rows, cols, kEps);
  const k2c::ref::RmsNormForward fwd = k2c::ref::rmsnorm_forward(h, gamma, rows, cols, kEps);
  rn::backward(dh.data() + 1, dg.data(), ddy.data() + 1, rstd.data(), dx.data() + 1, dgamma.data(),
               workspace.data(), rows, cols);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  const k2c::ref::RmsNormBackward bwd = k2c::ref::rmsnorm_backward(h, gamma, dy, rows, cols, kEps);
  const std::vector<float> y_host = k2c::to_host(y), dx_host = k2c::to_host(dx);
  const auto y_report = k2c::compare(std::span(y_host).subspan(1), fwd.y, kOutTolerance, cols);
  EXPECT_TRUE(y_report.ok) << "y: " << y_report.summary();
  const auto dx_report = k2c::compare(std::span(dx_host).subspan(1), bwd.dx, kOutTolerance, cols);
  EXPECT_TRUE(dx_report.ok) << "dx: " << dx_report.summary();
}

TEST(RmsNorm, ArgumentChecks) {
  bf16* none = nullptr;
  float* nonef = nullptr;
  EXPECT_THROW(rn::forward(none, none, none, none, none, nonef, -1, 4, kEps), std::invalid_argument);
  EXPECT_THROW(rn::forward(none, none, none, none, none, nonef, 4, 4, kEps), std::invalid_argument);
  EXPECT_THROW(rn::forward(none, none, none, none, none, nonef, 0, 4, 0.0f), std::invalid_argument);  // eps
  EXPECT_THROW(rn::backward(none, none, none, nonef, none, nonef, nullptr, 4, -4), std::invalid_argument);
  EXPECT_THROW(rn::backward(none, none, none, nonef, none, nonef, nullptr, 4, 4), std::invalid_argument);
  rn::forward(none, none, none, none, none, nonef, 0, 4, kEps);  // empty: a no-op
  // Too many rows for int indices, and residual_out aliasing an input: refused before any launch
  // (the dummy pointers are never used).
  bf16* d = reinterpret_cast<bf16*>(256);
  float* df = reinterpret_cast<float*>(256);
  EXPECT_THROW(rn::forward(d, nullptr, d, d, nullptr, df, rn::kMaxExtent + 1, 1, kEps), std::invalid_argument);
  EXPECT_THROW(rn::forward(d, d + 8, d, d + 16, d, df, 4, 4, kEps), std::invalid_argument);
  rn::backward(none, none, none, nonef, none, nonef, nullptr, 4, 0);
}

TEST(RmsNorm, Forward) {
  K2C_REQUIRE_GPU();
  int i = 0;
  for (Shape s : all_shapes()) check_forward(s, false, "fwd/" + std::to_string(i++));
}

TEST(RmsNorm, ForwardFusedResidual) {
  K2C_REQUIRE_GPU();
  int i = 0;
  for (Shape s : all_shapes()) check_forward(s, true, "fused/" + std::to_string(i++));
}

TEST(RmsNorm, Backward) {
  K2C_REQUIRE_GPU();
  int i = 0;
  for (Shape s : all_shapes()) check_backward(s, "bwd/" + std::to_string(i++));
  // No rows: dgamma is a sum over nothing and must come out as zeros, not as what was there.
  k2c::DeviceBuffer<float> dgamma(100);
  dgamma.poison();
  rn::backward(nullptr, nullptr, nullptr, nullptr, nullptr, dgamma.data(), nullptr, 0, 100);
  K2C_CUDA_CHECK(cudaDeviceSynchronize());
  for (float v : dgamma.download()) ASSERT_EQ(v, 0.0f) << "dgamma with rows == 0";
}

// ------------------------------------------------------------------------ performance ---

namespace {

constexpr int kRows = 16384, kCols = 4096;

struct PerfData {
  std::size_t n = static_cast<std::size_t>(kRows) * kCols;
  std::vector<float> h = k2c::random_values<bf16>(n, seed_for("perf/h"), -2.0f, 2.0f);
  std::vector<float> gamma = k2c::random_values<bf16>(kCols, seed_for("perf/g"), 0.5f, 1.5f);
  k2c::DeviceBuffer<bf16> dh = k2c::to_device<bf16>(h), dg = k2c::to_device<bf16>(gamma);
};

// Rows of the timed runs' output, checked against the reference at 32 random rows.
void check_rows(const std::vector<float>& got, const std::vector<float>& h, const std::vector<float>& gamma,
                const std::vector<float>& dy, bool backward) {
  std::mt19937_64 pick(std::random_device{}());
  for (int k = 0; k < 32; ++k) {
    const int r = static_cast<int>(pick() % kRows);
    const std::size_t at = static_cast<std::size_t>(r) * kCols;
    const std::span<const float> hr(h.data() + at, kCols), gr(got.data() + at, kCols);
    const std::vector<double> want =
        backward ? k2c::ref::rmsnorm_backward(hr, gamma, std::span<const float>(dy.data() + at, kCols), 1, kCols, kEps).dx
                 : k2c::ref::rmsnorm_forward(hr, gamma, 1, kCols, kEps).y;
    const auto report = k2c::compare(gr, want, kOutTolerance);
    ASSERT_TRUE(report.ok) << "row " << r << " after the timed runs: " << report.summary();
  }
}

}  // namespace

// Forward, bf16, 16384 × 4096: reads h and writes y once (gamma and rstd are noise).
// The grader's own runs of the timed passes (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(rmsnorm_forward) {
  rn::forward(w.at<bf16>(0), nullptr, w.at<bf16>(1), w.at<bf16>(2), nullptr, w.at<float>(3), w.dim(0), w.dim(1), kEps);
}
K2C_WITNESS(rmsnorm_backward) {
  static k2c::DeviceBuffer<char> workspace(rn::backward_workspace_bytes(w.dim(0), w.dim(1)));
  rn::backward(w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), w.at<float>(3), w.at<bf16>(4), w.at<float>(5),
               workspace.data(), w.dim(0), w.dim(1));
}

TEST(RmsNormPerf, ForwardVsCopy) {
  K2C_REQUIRE_TIMING();
  const double ceiling = k2c::copy_bandwidth();
  PerfData d;
  k2c::DeviceBuffer<bf16> y(d.n);
  k2c::DeviceBuffer<float> rstd(kRows);
  y.poison();
  rstd.poison();
  const k2c::Timing t = k2c::time_gpu([&] {
    rn::forward(d.dh.data(), nullptr, d.dg.data(), y.data(), nullptr, rstd.data(), kRows, kCols, kEps);
  });
  check_rows(k2c::to_host(y), d.h, d.gamma, {}, false);
  const std::vector<double> rstd_ref = k2c::ref::rmsnorm_forward(d.h, d.gamma, kRows, kCols, kEps).rstd;
  const auto r_report = k2c::compare(rstd.download(), rstd_ref, kRstdTolerance);
  ASSERT_TRUE(r_report.ok) << "rstd after the timed runs: " << r_report.summary();
  const double bytes = 2.0 * d.n * sizeof(bf16);
  K2C_EXPECT_PERF(bytes / (t.median_ms * 1e-3) / 1e9, ceiling / 1e9,
                  "16384 x 4096 bf16, median of " + std::to_string(t.repeats) + " runs");
}

// Backward, bf16, 16384 × 4096: reads h and dy, writes dx (dgamma's partial sums, written and
// read back once, add about 8% more bytes, which the rate does not count).
TEST(RmsNormPerf, BackwardVsCopy) {
  K2C_REQUIRE_TIMING();
  const double ceiling = k2c::copy_bandwidth();
  PerfData d;
  const std::vector<float> dy = k2c::random_values<bf16>(d.n, seed_for("perf/dy"), -1.0f, 1.0f);
  const std::vector<double> rstd_ref = k2c::ref::rmsnorm_forward(d.h, d.gamma, kRows, kCols, kEps).rstd;
  const std::vector<float> rstd(rstd_ref.begin(), rstd_ref.end());
  k2c::DeviceBuffer<bf16> ddy = k2c::to_device<bf16>(dy), dx(d.n);
  k2c::DeviceBuffer<float> drstd{std::span<const float>(rstd)}, dgamma(kCols);
  k2c::DeviceBuffer<char> workspace(rn::backward_workspace_bytes(kRows, kCols));
  dx.poison();
  dgamma.poison();
  const k2c::Timing t = k2c::time_gpu([&] {
    rn::backward(d.dh.data(), d.dg.data(), ddy.data(), drstd.data(), dx.data(), dgamma.data(),
                 workspace.data(), kRows, kCols);
  });
  check_rows(k2c::to_host(dx), d.h, d.gamma, dy, true);
  // dgamma of the timed runs at 64 random columns, each summed in double over all rows.
  const std::vector<float> dg = dgamma.download();
  std::mt19937_64 pick(std::random_device{}());
  std::vector<float> got;
  std::vector<double> want;
  std::vector<std::size_t> where;
  for (int k = 0; k < 64; ++k) {
    const std::size_t c = pick() % kCols;
    double sum = 0;
    for (std::size_t r = 0; r < kRows; ++r) sum += static_cast<double>(dy[r * kCols + c]) * d.h[r * kCols + c] * rstd_ref[r];
    got.push_back(dg[c]);
    want.push_back(sum);
    where.push_back(c);
  }
  const auto g_report = k2c::compare_sampled(got, want, where, dgamma_tolerance(kRows));
  ASSERT_TRUE(g_report.ok) << "dgamma after the timed runs: " << g_report.summary();
  const double bytes = 3.0 * d.n * sizeof(bf16);
  K2C_EXPECT_PERF(bytes / (t.median_ms * 1e-3) / 1e9, ceiling / 1e9,
                  "16384 x 4096 bf16, median of " + std::to_string(t.repeats) + " runs");
}
