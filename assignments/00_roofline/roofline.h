// assignments/00_roofline/roofline.h — the contract of module 00 (do not edit).
//
// Module 00 measures the two numbers every later module is judged by: how many bytes per second
// the GPU's memory can move, and how many floating-point operations per second its cores can do.
// You write a copy kernel (the bandwidth side), an FMA kernel (the arithmetic side), and three
// small host functions that put the two together into a roofline.
//
// Tests: autograder/00_roofline/test_roofline.cu. Lecture: lectures/00_roofline.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c::roofline {

// ---- bandwidth ------------------------------------------------------------------------------

// dst[i] = src[i] for 0 <= i < n, on `stream`, asynchronously (no synchronisation inside).
// src and dst are device pointers aligned to 16 bytes (cudaMalloc gives 256), not overlapping;
// n is any size, including 0 and sizes that are not a multiple of 4. Elements of dst at index
// >= n must not be touched. Throws std::invalid_argument for a null or misaligned pointer when
// n > 0.
void copy(const float* src, float* dst, std::size_t n, cudaStream_t stream = nullptr);

// ---- arithmetic -----------------------------------------------------------------------------

// The FMA-throughput kernel computes, for every 0 <= i < n, with float arithmetic:
//
//   x[j] = out[i] + j * kFmaStep                      for j = 0 .. kFmaChains-1
//   repeat iters times:  x[j] = fmaf(x[j], kFmaMul, kFmaAdd)   for every j
//   out[i] = sum of x[j], added in order j = 0, 1, 2, ...
//
// i.e. kFmaChains independent dependency chains per element, so one thread can keep several
// FMAs in flight. It does 2 * kFmaChains * iters * n floating-point operations (the final sum
// is not counted). out is a device pointer, read then overwritten; iters >= 0.
inline constexpr int kFmaChains = 8;
inline constexpr float kFmaStep = 0.125f;
inline constexpr float kFmaMul = 0.999f;   // |x| contracts toward kFmaAdd / (1 - kFmaMul) = 1,
inline constexpr float kFmaAdd = 0.001f;   // so no overflow or denormals for any iters.
void fma_throughput(float* out, std::size_t n, int iters, cudaStream_t stream = nullptr);

// The argument checks of copy() and fma_throughput() (given, not part of the exercise: the stub
// and the reference call the same ones). Each throws std::invalid_argument, with the offending
// value, for what the comments above rule out, and returns false when n == 0, so that the caller
// returns before launching anything.
[[nodiscard]] inline bool check_copy_args(const float* src, const float* dst, std::size_t n) {
  if (n == 0) return false;
  K2C_CHECK(src != nullptr && dst != nullptr, "copy: null pointer for n=" << n);
  K2C_CHECK(reinterpret_cast<std::uintptr_t>(src) % 16 == 0 &&
                reinterpret_cast<std::uintptr_t>(dst) % 16 == 0,
            "copy: src and dst must be 16-byte aligned, got " << src << " and " << dst);
  return true;
}
[[nodiscard]] inline bool check_fma_args(const float* out, std::size_t n, int iters) {
  K2C_CHECK(iters >= 0, "fma_throughput: iters must be >= 0, got " << iters);
  if (n == 0) return false;
  K2C_CHECK(out != nullptr, "fma_throughput: null pointer for n=" << n);
  return true;
}

// ---- the roofline (host only) ---------------------------------------------------------------

// The arithmetic intensity (FLOP per byte) above which a kernel on this machine is limited by
// arithmetic rather than memory. peak_flops in FLOP/s, bandwidth in bytes/s, both > 0.
double ridge_point(double peak_flops, double bandwidth);

// The best rate (FLOP/s) a kernel of the given arithmetic intensity (FLOP/byte, >= 0) can reach
// under the roofline model.
double attainable_flops(double intensity, double peak_flops, double bandwidth);

// The arithmetic intensity of C = alpha*A*B + beta*C with A M×K, B K×N, C M×N, counting
// 2*M*N*K FLOPs and the fewest bytes possible: A, B and C read once, C written once, each
// element bytes_per_element wide. M, N, K >= 1.
double matmul_intensity(long M, long N, long K, int bytes_per_element);

}  // namespace k2c::roofline
