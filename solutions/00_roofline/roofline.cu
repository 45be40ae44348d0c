// solutions/00_roofline/roofline.cu — reference solution of module 00 (contract: roofline.h).
//
// Module 00 measures the machine. Two kernels, each built to hit one ceiling and nothing else:
//
//   copy            moves bytes and does no arithmetic: its speed is the memory system's.
//   fma_throughput  does arithmetic and (almost) no memory traffic: its speed is the cores'.
//
// Napkin math on an H200 (the figures the tests compare against are measured in the same run):
//   copy of 1 GiB: 2 GiB must cross HBM (read + write); at ~4.3 TB/s that is ~0.5 ms.
//   fp32 peak: 132 SMs × 128 lanes × 2 FLOP × 1.98 GHz ≈ 67 TFLOP/s.
// Anything a later module does sits between these two roofs; module 00 shows how close a
// simple kernel gets to each of them.
#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "k2c/check.h"
#include "roofline.h"

namespace k2c::roofline {

// ============================================================================ bandwidth ======
//
// Three things make a copy kernel fast:
//   1. 16-byte accesses (float4): one instruction moves 4 floats, so a warp's load is a single
//      512-byte request and the load/store units issue a quarter of the instructions.
//   2. Enough bytes in flight. By Little's law the bytes in flight must cover bandwidth ×
//      latency: 4.3 TB/s × ~600 ns ≈ 2.6 MB across the chip, ~20 KB per SM. Each thread issues
//      kUnroll independent 16-byte loads before it stores anything, so 2048 resident threads
//      per SM have 2048 × 4 × 16 B = 128 KB in flight per SM: comfortably enough.
//   3. A grid-stride loop over a grid sized to the machine (a few blocks per SM), so blocks
//      are not launched and retired millions of times and every SM stays busy to the end.
// The tail (n not a multiple of 4) is copied by scalar loads in a separate loop.

constexpr int kCopyThreads = 256;
constexpr int kUnroll = 4;

__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst,
                            std::size_t n4, const float* __restrict__ src_tail,
                            float* __restrict__ dst_tail, int tail) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  // Main loop: kUnroll loads first, then kUnroll stores, so the loads overlap in flight.
  for (; i + (kUnroll - 1) * stride < n4; i += kUnroll * stride) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n4; i += stride) dst[i] = src[i];  // the last partial round

  // At most 3 trailing floats: the first threads of the grid take one each.
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < static_cast<std::size_t>(tail)) dst_tail[t] = src_tail[t];
}

static int resident_blocks(int threads_per_block) {
  int device = 0, sms = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms * (2048 / threads_per_block);  // as many blocks as fit at once (2048 threads/SM)
}

void copy(const float* src, float* dst, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  K2C_CHECK(src != nullptr && dst != nullptr, "copy: null pointer for n=" << n);
  K2C_CHECK(reinterpret_cast<std::uintptr_t>(src) % 16 == 0 &&
                reinterpret_cast<std::uintptr_t>(dst) % 16 == 0,
            "copy: src and dst must be 16-byte aligned, got " << src << " and " << dst);
  const std::size_t n4 = n / 4;
  const int tail = static_cast<int>(n % 4);
  const std::size_t needed = (n4 + kCopyThreads - 1) / kCopyThreads;
  const int blocks = static_cast<int>(
      std::max<std::size_t>(1, std::min<std::size_t>(needed, resident_blocks(kCopyThreads))));
  copy_kernel<<<blocks, kCopyThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(src), reinterpret_cast<float4*>(dst), n4, src + 4 * n4,
      dst + 4 * n4, tail);
  K2C_CUDA_CHECK_LAUNCH();
}

// =========================================================================== arithmetic ======
//
// An FMA has a latency of about 4 cycles on Hopper, and each SM sub-partition can start one
// warp-wide FMA per cycle. One dependency chain per thread would therefore need 4 warps per
// scheduler just to cover the latency, with nothing to spare for the loop's own instructions.
// kFmaChains = 8 independent chains give each warp 8 FMAs it can issue back to back, so even a
// few warps keep the pipe full. The chains live in registers (the j-loop is fully unrolled:
// indexing a register array with a run-time index would move it to local memory).
// Memory traffic is one load and one store per thread per launch: nothing next to
// 2 × 8 × iters FLOPs.

constexpr int kFmaThreads = 256;

__global__ void fma_throughput_kernel(float* __restrict__ out, std::size_t n, int iters) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float x[kFmaChains];
    const float start = out[i];
#pragma unroll
    for (int j = 0; j < kFmaChains; ++j) x[j] = start + static_cast<float>(j) * kFmaStep;
#pragma unroll 4
    for (int t = 0; t < iters; ++t) {
#pragma unroll
      for (int j = 0; j < kFmaChains; ++j) x[j] = fmaf(x[j], kFmaMul, kFmaAdd);
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kFmaChains; ++j) sum += x[j];
    out[i] = sum;
  }
}

void fma_throughput(float* out, std::size_t n, int iters, cudaStream_t stream) {
  K2C_CHECK(iters >= 0, "fma_throughput: iters must be >= 0, got " << iters);
  if (n == 0) return;
  K2C_CHECK(out != nullptr, "fma_throughput: null pointer for n=" << n);
  const std::size_t needed = (n + kFmaThreads - 1) / kFmaThreads;
  const int blocks = static_cast<int>(
      std::max<std::size_t>(1, std::min<std::size_t>(needed, resident_blocks(kFmaThreads))));
  fma_throughput_kernel<<<blocks, kFmaThreads, 0, stream>>>(out, n, iters);
  K2C_CUDA_CHECK_LAUNCH();
}

// ========================================================================== the roofline =====
//
// A kernel that does F FLOPs while moving B bytes has arithmetic intensity I = F / B. It needs
// at least F / peak seconds for the arithmetic and B / bandwidth for the bytes, so its rate is at
// most min(peak, I × bandwidth). The two terms meet at the ridge point I* = peak / bandwidth:
// below it a kernel is memory-bound, above it compute-bound. On an H200, fp32: 67e12 / 4.3e12
// ≈ 16 FLOP/byte; bf16 tensor cores: ~990e12 / 4.3e12 ≈ 230 FLOP/byte.

double ridge_point(double peak_flops, double bandwidth) {
  K2C_CHECK(peak_flops > 0 && bandwidth > 0,
            "ridge_point: rates must be > 0, got " << peak_flops << ", " << bandwidth);
  return peak_flops / bandwidth;
}

double attainable_flops(double intensity, double peak_flops, double bandwidth) {
  K2C_CHECK(intensity >= 0, "attainable_flops: intensity must be >= 0, got " << intensity);
  K2C_CHECK(peak_flops > 0 && bandwidth > 0,
            "attainable_flops: rates must be > 0, got " << peak_flops << ", " << bandwidth);
  return std::min(peak_flops, intensity * bandwidth);
}

// 2MNK FLOPs over (MK + KN + 2MN) elements: for square n it is 2n³ / (4n² · b) = n / (2b), so
// an fp32 SGEMM crosses the fp32 ridge (~16) already at n ≈ 128 — if, and only if, the kernel
// really reads each input once. Modules 01–04 are the story of getting there.
double matmul_intensity(long M, long N, long K, int bytes_per_element) {
  K2C_CHECK(M >= 1 && N >= 1 && K >= 1 && bytes_per_element >= 1,
            "matmul_intensity: need M, N, K, bytes >= 1, got " << M << ", " << N << ", " << K
                                                              << ", " << bytes_per_element);
  const double m = static_cast<double>(M), n = static_cast<double>(N), k = static_cast<double>(K);
  return 2.0 * m * n * k / ((m * k + k * n + 2.0 * m * n) * bytes_per_element);
}

}  // namespace k2c::roofline
