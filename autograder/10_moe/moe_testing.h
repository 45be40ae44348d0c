// autograder/10_moe/moe_testing.h — what the tests of module 10 share: device buffers made from
// host data or poisoned, and the checks of the grouped GEMMs (A·op(B) and the weight gradient)
// against a double-precision reference with the bound derived at the top of test_moe.cu. Included
// by test_moe.cu (Part A: routing, dispatch, permute, grouped GEMM, the layer) and
// test_moe_perf.cu (the speed tests and Part B's wgmma kernels, which run the same GEMM checks).
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/device/buffer.h"
#include "k2c/testing/bf16.h"
#include "k2c/testing/testing.h"
#include "moe.h"

namespace k2c::moe_testing {

namespace moe = k2c::moe;
using k2c::bf16;
using k2c::testing::seed_for;

template <class T>
k2c::DeviceBuffer<T> upload(const std::vector<T>& v) {
  return k2c::DeviceBuffer<T>{std::span<const T>(v)};
}
// Outputs filled with garbage before a call: NaN for floating types (poison()), 0x7F7F7F7F for
// int32, which no index or count takes and which differs from the −1 of a dropped slot.
template <class T>
void repoison(k2c::DeviceBuffer<T>& b) {
  if constexpr (std::is_same_v<T, int>) {
    if (b.size() > 0) ASSERT_EQ(cudaMemset(b.data(), 0x7F, b.bytes()), cudaSuccess);
  } else {
    b.poison();
  }
}
template <class T>
k2c::DeviceBuffer<T> poisoned(std::size_t n) {
  k2c::DeviceBuffer<T> b(n);
  repoison(b);
  return b;
}

// ---------------------------------------------------------------------------------------------
// grouped GEMM

inline std::vector<int> offsets_of(const std::vector<int>& sizes) {
  std::vector<int> off(sizes.size() + 1, 0);
  std::partial_sum(sizes.begin(), sizes.end(), off.begin() + 1);
  return off;
}

// C_g = A_g · op(B_g) in double, with Σ|terms| for the bound.
struct GemmRef {
  std::vector<double> c, magnitude;
};
inline GemmRef grouped_ref(const std::vector<int>& off, int n, int k, const std::vector<float>& a, const std::vector<float>& b,
                    bool b_transposed) {
  const int rows = off.back();
  GemmRef r{std::vector<double>(static_cast<std::size_t>(rows) * n), std::vector<double>(static_cast<std::size_t>(rows) * n)};
  for (std::size_t g = 0; g + 1 < off.size(); ++g)
    for (int i = off[g]; i < off[g + 1]; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0, m = 0;
        for (int x = 0; x < k; ++x) {
          const double bv = b_transposed ? b[(g * n + j) * static_cast<std::size_t>(k) + x] : b[(g * k + x) * static_cast<std::size_t>(n) + j];
          const double t = a[static_cast<std::size_t>(i) * k + x] * bv;
          s += t;
          m += std::abs(t);
        }
        r.c[static_cast<std::size_t>(i) * n + j] = s;
        r.magnitude[static_cast<std::size_t>(i) * n + j] = m;
      }
  return r;
}

inline ::testing::AssertionResult close_gemm(const char* what, const std::vector<float>& got, const GemmRef& ref, bool bf16_out) {
  std::ostringstream bad;
  std::size_t count = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double bound = (bf16_out ? std::ldexp(std::abs(ref.c[i]), -8) : 0.0) + std::ldexp(ref.magnitude[i], -16) + 1e-6;
    if (std::isfinite(got[i]) && std::abs(got[i] - ref.c[i]) <= bound) continue;
    if (count++ < 6) bad << " [" << i << "] got " << got[i] << " want " << ref.c[i] << ";";
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << count << " of " << got.size() << " wrong:" << bad.str();
}

// Group sizes with the edge cases: empty groups, a group under one tile, one over a tile.
inline std::vector<int> group_sizes(std::mt19937_64& rng, int groups, int max_rows) {
  std::vector<int> sizes(groups);
  for (int& s : sizes) {
    const int kind = static_cast<int>(rng() % 4);
    s = kind == 0 ? 0 : kind == 1 ? static_cast<int>(rng() % 17) : static_cast<int>(rng() % (max_rows + 1));
  }
  return sizes;
}

// hopper: Part B's grouped_gemm_hopper (bf16 C, no accumulate), told that A and C hold `spare`
// rows more than the groups use.
inline void check_grouped_gemm(const std::vector<int>& sizes, int n, int k, bool b_transposed, bool fp32_out, bool accumulate,
                        bool hopper = false, int spare = 0) {
  std::ostringstream name;
  name << sizes.size() << " groups, rows " << offsets_of(sizes).back() << ", n " << n << ", k " << k
       << (b_transposed ? " B^T" : " B") << (fp32_out ? " fp32" : " bf16") << (accumulate ? " accumulate" : "")
       << (hopper ? " (Hopper, " + std::to_string(spare) + " spare rows)" : "");
  SCOPED_TRACE(name.str());
  const std::vector<int> off = offsets_of(sizes);
  const int groups = static_cast<int>(sizes.size()), rows = off.back();
  const int held = std::max(rows + spare, 1);  // rows A and C hold
  const auto a = k2c::random_values<bf16>(static_cast<std::size_t>(held) * k, seed_for(name.str() + "/a"));
  const auto b = k2c::random_values<bf16>(static_cast<std::size_t>(groups) * n * k, seed_for(name.str() + "/b"));
  GemmRef ref = grouped_ref(off, n, k, a, b, b_transposed);
  auto d_off = upload(off);
  auto d_a = k2c::to_device<bf16>(a), d_b = k2c::to_device<bf16>(b);
  const std::size_t cn = static_cast<std::size_t>(held) * n;
  std::vector<float> got;
  if (fp32_out) {
    std::vector<float> start(cn, 0.0f);
    if (accumulate) {
      start = k2c::random_values<float>(cn, seed_for(name.str() + "/c"));
      for (std::size_t i = 0; i < ref.c.size(); ++i) ref.c[i] += start[i];
    }
    auto c = accumulate ? upload(start) : poisoned<float>(cn);
    moe::grouped_gemm(groups, d_off.data(), n, k, d_a.data(), d_b.data(), c.data(), b_transposed, accumulate);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got = c.download();
  } else {
    auto c = poisoned<bf16>(cn);
    if (accumulate) {
      const auto start = k2c::random_values<bf16>(cn, seed_for(name.str() + "/c"));
      for (std::size_t i = 0; i < ref.c.size(); ++i) ref.c[i] += start[i];
      c = k2c::to_device<bf16>(start);
    }
    if (hopper) moe::grouped_gemm_hopper(groups, d_off.data(), held, n, k, d_a.data(), d_b.data(), c.data(), b_transposed);
    else moe::grouped_gemm(groups, d_off.data(), n, k, d_a.data(), d_b.data(), c.data(), b_transposed, accumulate);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got = k2c::to_host(c);
    // Rows past the groups' end are never written: still poisoned.
    for (std::size_t i = static_cast<std::size_t>(rows) * n; i < cn && hopper; ++i)
      ASSERT_TRUE(std::isnan(got[i])) << "row " << i / n << " past the groups' end was written";
  }
  got.resize(static_cast<std::size_t>(rows) * n);
  EXPECT_TRUE(close_gemm("C", got, ref, !fp32_out));
}

// hopper: Part B's grouped_weight_grad_hopper, told that dY and X hold `spare` rows more than the
// groups use; those rows are NaN, which must not reach any group's sum.
inline void check_weight_grad(const std::vector<int>& sizes, int n, int k, bool hopper = false, int spare = 0) {
  std::ostringstream name;
  name << sizes.size() << " groups, rows " << offsets_of(sizes).back() << ", n " << n << ", k " << k
       << (hopper ? " (Hopper, " + std::to_string(spare) + " spare rows)" : "");
  SCOPED_TRACE(name.str());
  const std::vector<int> off = offsets_of(sizes);
  const int groups = static_cast<int>(sizes.size()), rows = off.back(), held = std::max(rows + spare, 1);
  auto dy = k2c::random_values<bf16>(static_cast<std::size_t>(held) * n, seed_for(name.str() + "/dy"));
  auto x = k2c::random_values<bf16>(static_cast<std::size_t>(held) * k, seed_for(name.str() + "/x"));
  std::fill(dy.begin() + static_cast<std::ptrdiff_t>(rows) * n, dy.end(), NAN);
  std::fill(x.begin() + static_cast<std::ptrdiff_t>(rows) * k, x.end(), NAN);
  GemmRef ref{std::vector<double>(static_cast<std::size_t>(groups) * n * k), std::vector<double>(static_cast<std::size_t>(groups) * n * k)};
  for (int g = 0; g < groups; ++g)
    for (int r = off[g]; r < off[g + 1]; ++r)
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < k; ++j) {
          const double t = static_cast<double>(dy[static_cast<std::size_t>(r) * n + i]) * x[static_cast<std::size_t>(r) * k + j];
          ref.c[(static_cast<std::size_t>(g) * n + i) * k + j] += t;
          ref.magnitude[(static_cast<std::size_t>(g) * n + i) * k + j] += std::abs(t);
        }
  auto d_off = upload(off);
  auto d_dy = k2c::to_device<bf16>(dy), d_x = k2c::to_device<bf16>(x);
  auto dw = poisoned<float>(static_cast<std::size_t>(groups) * n * k);
  if (hopper) moe::grouped_weight_grad_hopper(groups, d_off.data(), held, n, k, d_dy.data(), d_x.data(), dw.data());
  else moe::grouped_weight_grad(groups, d_off.data(), n, k, d_dy.data(), d_x.data(), dw.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(close_gemm("dW", dw.download(), ref, false));
}

}  // namespace k2c::moe_testing
