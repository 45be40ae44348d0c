// autograder/05_tensor_core_matmul/test_tensor_core_matmul.cu — tests of module 05
// (contract: tensor_core_matmul.h).
//
// Tolerance. Inputs are drawn as bf16 values, so the CPU reference (double) sees exactly what the
// tensor cores see, and each product a·b is exact in fp32 (8 + 8 significant bits < 24). What
// remains is the fp32 summation of K products and, for bf16 output, one final rounding:
//   |out - ref| <= K · 2^-23 · Σ|a·b|   (the worst case of any fp32 summation order, γ_K ≈
//                                         K · 2^-24, doubled for tensor cores that truncate
//                                         partial sums)
//                + 2^-8 · |ref|          (bf16 output: rounding to 8 significant bits is off by
//                                         at most 2^-8 relative to the rounded sum, which the
//                                         first term's margin over γ_K also absorbs)
// The bound is computed per element from the reference's Σ|a·b|. At the correctness tests' sizes
// (K up to about 1100) a wrong element is far outside it: dropping one k term moves a sum by about
// |a·b| ~ 0.25, while at K = 1024 the bound is about 0.03 + 0.004·|ref| for inputs in [-1, 1). At
// 8192³ the bound grows to about 2 and the timed runs' spot checks catch gross errors only (a
// wrong tile, an unwritten element). NaN and unwritten (poisoned) elements always fail.
//
// Speed: against cuBLAS's bf16 GEMM (same layout, bf16 out, fp32 accumulation) measured in the
// same run; Part A graded at 8192³, Part B (bonus) at 8192³ and 4096³.
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/device/buffer.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/bf16.h"
#include "k2c/testing/testing.h"
#include "k2c/testing/witness.h"
#include "tensor_core_matmul.h"

namespace tcm = k2c::tensor_core_matmul;
using k2c::bf16;

namespace {

struct Shape {
  int M, N, K;
};

std::string describe(const Shape& s) {
  return std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K);
}

// Awkward shapes: a single element, tails on every side, tall and flat, K shorter than one
// 64-wide k tile and K not a multiple of it. K % 8 == 0 in all (the fast path). {200, 328, 64}:
// Part B's staged stores with a last column box 8 wide and a last 64-row slab 8 rows tall.
const std::vector<Shape> kFixed = {{1, 1, 8},       {1, 1, 64},     {17, 33, 64},
                                   {7, 129, 40},    {128, 256, 64}, {129, 257, 72},
                                   {300, 5, 136},   {5, 300, 8},    {513, 1, 256},
                                   {200, 328, 64},  {256, 512, 1024}, {1000, 999, 1000}};

// More output tiles than an H200 has SMs (or SM pairs), so that blocks of a persistent kernel
// take a second tile and raster bands wrap: Part A's bands are 16 tile-rows (M > 4096 for two),
// Part B's 90 and 72 tile groups over 66 clusters, with a K tail. The last two hold Part B's
// deferred batch of boxes across tiles where it is clipped at N: one 8-wide box (N = 2440), and
// nothing inside C at all (N = 2104, flushed during the next tile).
const std::vector<Shape> kManyTiles = {{4200, 130, 64}, {2100, 2560, 136}, {2304, 2048, 520},
                                       {2100, 2440, 136}, {2304, 2104, 72}};

// K % 8 != 0: the path without 16-byte copies.
const std::vector<Shape> kOddK = {{1, 1, 1}, {33, 65, 1001}, {255, 257, 3}, {64, 64, 17}};

std::vector<Shape> random_shapes(std::uint64_t seed, int count, int max_dim, bool k_multiple_of_8) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dim(1, max_dim);
  std::vector<Shape> out;
  for (int i = 0; i < count; ++i) {
    Shape s{dim(rng), dim(rng), dim(rng)};
    if (k_multiple_of_8) s.K = (s.K + 7) / 8 * 8;
    out.push_back(s);
  }
  return out;
}

// The per-element bound of the header comment.
double bound(double ref, double magnitude, int K, bool bf16_out) {
  return K * std::ldexp(magnitude, -23) + (bf16_out ? std::ldexp(std::abs(ref), -8) : 0.0);
}

// Compares got[i] (element where[i] of an M×N output) with the reference; reports the first few.
::testing::AssertionResult check_elements(const std::vector<float>& got,
                                          const std::vector<double>& want,
                                          const std::vector<double>& magnitude,
                                          const std::vector<std::size_t>& where, int N, int K,
                                          bool bf16_out) {
  std::ostringstream bad;
  int count = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]);
    if (std::isfinite(got[i]) && err <= bound(want[i], magnitude[i], K, bf16_out)) continue;
    if (count++ < 6)
      bad << " (" << where[i] / N << ", " << where[i] % N << "): got " << got[i] << ", want "
          << want[i] << " ±" << bound(want[i], magnitude[i], K, bf16_out) << ";";
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << count << " of " << got.size() << " elements wrong:"
                                       << bad.str();
}

template <class OutT>
using Fn = void (*)(int, int, int, const bf16*, const bf16*, OutT*, cudaStream_t);

template <class OutT>
Fn<OutT> part_a() {
  return static_cast<Fn<OutT>>(tcm::matmul);
}

// Runs fn on one shape with inputs from the run's seed and checks every element. `offset` shifts
// A, B and C by that many elements from their allocations' 16-byte aligned starts.
template <class OutT>
void check_shape(Fn<OutT> fn, const Shape& s, std::size_t offset = 0) {
  SCOPED_TRACE(describe(s) + (offset ? " offset " + std::to_string(offset) : std::string()));
  const std::string tag = describe(s);
  const std::size_t na = static_cast<std::size_t>(s.M) * s.K, nb = static_cast<std::size_t>(s.N) * s.K,
                    nc = static_cast<std::size_t>(s.M) * s.N;
  const auto A = k2c::random_values<bf16>(na, k2c::testing::seed_for(tag + "/A"));
  const auto B = k2c::random_values<bf16>(nb, k2c::testing::seed_for(tag + "/B"));
  auto dA = k2c::to_device<bf16>(k2c::after_padding(A, offset));
  auto dB = k2c::to_device<bf16>(k2c::after_padding(B, offset));
  k2c::DeviceBuffer<OutT> dC(nc + offset);
  dC.poison();  // NaN: an element the kernel never writes fails

  fn(s.M, s.N, s.K, dA.data() + offset, dB.data() + offset, dC.data() + offset, nullptr);
  const cudaError_t err = cudaDeviceSynchronize();
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);

  const std::vector<float> all = k2c::to_host(dC);
  const std::vector<float> got(all.begin() + offset, all.end());
  std::vector<double> magnitude;
  const std::vector<double> want = k2c::ref::gemm_abt(s.M, s.N, s.K, A, B, &magnitude);
  std::vector<std::size_t> where(nc);
  for (std::size_t i = 0; i < nc; ++i) where[i] = i;
  EXPECT_TRUE(check_elements(got, want, magnitude, where, s.N, s.K, sizeof(OutT) == 2));
}

template <class OutT>
void check_shapes(Fn<OutT> fn, const std::vector<Shape>& shapes) {
  for (const Shape& s : shapes) check_shape(fn, s);
}

// Rate of fn at n³ in FLOP/s: one checked run, then the timed runs (median, L2 flushed), whose
// output is checked again at fresh random positions.
double measure_rate(Fn<bf16> fn, int n, int repeats) {
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  const auto A = k2c::random_values<bf16>(nn, k2c::testing::seed_for("rate/A"));
  const auto B = k2c::random_values<bf16>(nn, k2c::testing::seed_for("rate/B"));
  auto dA = k2c::to_device<bf16>(A);
  auto dB = k2c::to_device<bf16>(B);
  k2c::DeviceBuffer<bf16> dC(nn);

  auto sample_check = [&](std::uint64_t seed, const char* what) {
    const std::vector<float> out = k2c::to_host(dC);
    std::mt19937_64 rng(seed);
    std::vector<float> got;
    std::vector<double> want, magnitude;
    std::vector<std::size_t> where;
    for (int i = 0; i < 256; ++i) {
      const int r = static_cast<int>(rng() % n), c = static_cast<int>(rng() % n);
      double mag = 0;
      want.push_back(k2c::ref::gemm_abt_at(n, A, B, r, c, &mag));
      magnitude.push_back(mag);
      where.push_back(static_cast<std::size_t>(r) * n + c);
      got.push_back(out[where.back()]);
    }
    const auto ok = check_elements(got, want, magnitude, where, n, n, true);
    EXPECT_TRUE(ok) << what;
    return static_cast<bool>(ok);
  };

  dC.poison();
  fn(n, n, n, dA.data(), dB.data(), dC.data(), nullptr);
  if (!sample_check(k2c::testing::seed_for("rate/samples"), "the first run's output")) return 0;
  dC.poison();
  const k2c::Timing t = k2c::time_gpu([&] { fn(n, n, n, dA.data(), dB.data(), dC.data(), nullptr); },
                                      {.warmup = 3, .repeats = repeats});
  // Fresh positions, which no kernel could single out in advance; a failure prints them.
  if (!sample_check(std::random_device{}(), "the timed runs' output")) return 0;
  return 2.0 * n * static_cast<double>(n) * n / (t.median_ms * 1e-3);
}

void expect_rate(Fn<bf16> fn, int n, int repeats, const std::string& what) {
  const double ceiling = k2c::bf16_gemm_rate(n);
  const double achieved = measure_rate(fn, n, repeats);
  K2C_EXPECT_PERF(achieved / 1e12, ceiling / 1e12,
                  what + " at " + std::to_string(n) + "^3 vs cuBLAS bf16, " +
                      std::to_string(repeats) + " runs");
}

#define REQUIRE_HOPPER()                                                   \
  do {                                                                     \
    K2C_REQUIRE_GPU();                                                     \
    std::string why_;                                                      \
    if (!tcm::hopper_supported(&why_)) K2C_SKIP("Part B: " + why_);        \
  } while (0)

}  // namespace

// Worth no points: it lets the grader say "not implemented yet" even without a GPU.
TEST(TensorCoreMatmulContract, Implemented) {
  const bool gpu = k2c::testing::gpu_available();
  k2c::DeviceBuffer<bf16> a(gpu ? 8 : 0), b(gpu ? 8 : 0), c(gpu ? 8 : 0);
  bf16* dummy = reinterpret_cast<bf16*>(256);  // never dereferenced: no device to launch on
  K2C_EXPECT_IMPLEMENTED(tcm::matmul(1, 1, 8, gpu ? a.data() : dummy, gpu ? b.data() : dummy,
                                     gpu ? c.data() : dummy, nullptr));
}

TEST(TensorCoreMatmul, FixedShapesBf16Out) {
  K2C_REQUIRE_GPU();
  check_shapes(part_a<bf16>(), kFixed);
}

TEST(TensorCoreMatmul, FixedShapesFp32Out) {
  K2C_REQUIRE_GPU();
  check_shapes(part_a<float>(), kFixed);
}

TEST(TensorCoreMatmul, RandomShapes) {
  K2C_REQUIRE_GPU();
  const auto seed = k2c::testing::seed_for("shapes");
  check_shapes(part_a<bf16>(), random_shapes(seed, 6, 700, true));
  check_shapes(part_a<float>(), random_shapes(seed + 1, 4, 700, false));
  check_shape(part_a<bf16>(), kManyTiles[0]);
}

TEST(TensorCoreMatmul, OddKAndUnalignedPointers) {
  K2C_REQUIRE_GPU();
  check_shapes(part_a<bf16>(), kOddK);
  check_shapes(part_a<float>(), kOddK);
  // A, B and C 1 element (2 bytes) and 3 elements (6 bytes; 12 for the fp32 C) past 16-byte
  // alignment, with K % 8 == 0: the element path, and C stored without pairs.
  check_shape(part_a<bf16>(), {129, 257, 72}, 1);
  check_shape(part_a<float>(), {65, 31, 136}, 3);
  // Even N: only C's alignment forbids paired stores.
  check_shape(part_a<bf16>(), {64, 64, 72}, 1);
  check_shape(part_a<float>(), {65, 32, 136}, 1);
}

TEST(TensorCoreMatmul, EmptyAndZeroK) {
  K2C_REQUIRE_GPU();
  check_shape(part_a<bf16>(), {37, 45, 0});   // C = 0
  check_shape(part_a<float>(), {8, 300, 0});
  k2c::DeviceBuffer<bf16> c(4);
  EXPECT_NO_THROW(tcm::matmul(0, 5, 8, nullptr, nullptr, c.data()));  // nothing to write
  EXPECT_NO_THROW(tcm::matmul(5, 0, 8, nullptr, nullptr, c.data()));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(TensorCoreMatmul, RejectsBadArguments) {
  K2C_REQUIRE_GPU();
  k2c::DeviceBuffer<bf16> buf(64);
  // The checks are given in the stub: the points come with a working matmul().
  K2C_EXPECT_IMPLEMENTED(tcm::matmul(1, 1, 8, buf.data(), buf.data(), buf.data()));
  EXPECT_THROW(tcm::matmul(-1, 4, 8, buf.data(), buf.data(), buf.data()), std::invalid_argument);
  EXPECT_THROW(tcm::matmul(4, 4, 8, nullptr, buf.data(), buf.data()), std::invalid_argument);
  EXPECT_THROW(tcm::matmul(4, 4, 8, buf.data(), buf.data(), static_cast<bf16*>(nullptr)),
               std::invalid_argument);
}

TEST(TensorCoreMatmulPerf, At8192) {
  K2C_REQUIRE_TIMING();
  expect_rate(part_a<bf16>(), 8192, 10, "mma.sync");
}

// Recorded for the reference table.
TEST(TensorCoreMatmulPerf, At4096) {
  K2C_REQUIRE_TIMING();
  expect_rate(part_a<bf16>(), 4096, 20, "mma.sync");
}

// ---- Part B (bonus): wgmma, skipped with the reason where it cannot run ----------------------

TEST(TensorCoreMatmulHopper, FixedShapes) {
  REQUIRE_HOPPER();
  check_shapes<bf16>(tcm::matmul_hopper, kFixed);
}

TEST(TensorCoreMatmulHopper, RandomShapes) {
  REQUIRE_HOPPER();
  check_shapes<bf16>(tcm::matmul_hopper,
                     random_shapes(k2c::testing::seed_for("hopper shapes"), 6, 1100, true));
  check_shape<bf16>(tcm::matmul_hopper, {37, 45, 0});
  check_shape<bf16>(tcm::matmul_hopper, {129, 257, 72}, 8);  // offset by 16 bytes: aligned
  for (std::size_t i = 1; i < kManyTiles.size(); ++i) check_shape<bf16>(tcm::matmul_hopper, kManyTiles[i]);
}

TEST(TensorCoreMatmulHopper, RejectsWhatTmaCannotAddress) {
  REQUIRE_HOPPER();
  k2c::DeviceBuffer<bf16> buf(4096);
  // K % 8 != 0: rows would not start on 16 bytes.
  EXPECT_THROW(tcm::matmul_hopper(8, 8, 12, buf.data(), buf.data(), buf.data()),
               std::invalid_argument);
  // A not 16-byte aligned.
  EXPECT_THROW(tcm::matmul_hopper(8, 8, 16, buf.data() + 1, buf.data(), buf.data()),
               std::invalid_argument);
}

TEST(TensorCoreMatmulHopperPerf, At8192) {
  K2C_REQUIRE_TIMING();
  REQUIRE_HOPPER();
  expect_rate(tcm::matmul_hopper, 8192, 10, "wgmma");
}

TEST(TensorCoreMatmulHopperPerf, At4096) {
  K2C_REQUIRE_TIMING();
  REQUIRE_HOPPER();
  expect_rate(tcm::matmul_hopper, 4096, 20, "wgmma");
}

// The grader's own runs of the timed GEMMs at 8192³ (k2c/testing/witness.h), on its buffers.
K2C_WITNESS(bf16_gemm) {
  tcm::matmul(w.dim(0), w.dim(1), w.dim(2), w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), nullptr);
}
K2C_WITNESS(bf16_gemm_hopper) {
  tcm::matmul_hopper(w.dim(0), w.dim(1), w.dim(2), w.at<bf16>(0), w.at<bf16>(1), w.at<bf16>(2), nullptr);
}
