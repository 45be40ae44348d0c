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

#include "k2c/core/check.h"
#include "roofline.h"

namespace k2c::roofline {

// ============================================================================ bandwidth ======
//
// What makes a copy kernel fast:
//   1. 16-byte accesses (float4): one instruction moves 4 floats, so a warp's load is a single
//      512-byte request and the load/store units issue a quarter of the instructions.
//   2. Enough bytes in flight. By Little's law the loads in flight must cover their bandwidth ×
//      latency (a copy's threads wait on loads only): half of 4.25 TB/s × ~600 ns ≈ 1.28 MB
//      across the chip, ~9.7 KB per SM (lecture 00, section 2.3). 2048 resident threads per SM
//      with one 16-byte load each already hold 32 KB per SM in flight.
//   3. A grid that covers the array: one float4 per thread, as many blocks as that takes.
//      The loop below is still a grid-stride loop, so any n is handled with a capped grid,
//      but at the sizes that matter it runs exactly once per thread.
//
// Measured on an H200 (1 GiB, same run as cudaMemcpy's 4.26 TB/s; see lectures/00_roofline.md):
//   persistent grid (8 blocks of 256 per SM, each thread striding over ~250 float4s,
//   unrolled 4 or 8 deep)                                 3.93 TB/s   0.92 of cudaMemcpy
//   same, with streaming cache hints (__ldcs / __stcs)    3.78 TB/s   0.89
//   one float4 per thread, 262 144 blocks                 4.27 TB/s   1.00
// A plausible reading (not proven here): the persistent grid's threads drift apart, so the
// requests in flight at any moment scatter over a wider address range than the single sweep
// of a full grid, and DRAM row locality suffers. The streaming hints, often recommended for
// copies, cost 3% here. Measure; do not assume.
//
// The tail (n not a multiple of 4) is copied with scalar accesses by the first threads.

constexpr int kCopyThreads = 256;
constexpr std::size_t kMaxCopyBlocks = std::size_t{1} << 20;  // 2^28 float4s = 4 GiB per pass

__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst,
                            std::size_t n4, const float* __restrict__ src_tail,
                            float* __restrict__ dst_tail, int tail) {
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = first; i < n4; i += stride) dst[i] = src[i];
  if (first < static_cast<std::size_t>(tail)) dst_tail[first] = src_tail[first];
}

void copy(const float* src, float* dst, std::size_t n, cudaStream_t stream) {
  if (!check_copy_args(src, dst, n)) return;
  const std::size_t n4 = n / 4;
  const int tail = static_cast<int>(n % 4);
  // At least one block, so a copy of 1..3 floats still runs its tail.
  const std::size_t blocks =
      std::clamp<std::size_t>((n4 + kCopyThreads - 1) / kCopyThreads, 1, kMaxCopyBlocks);
  copy_kernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(src), reinterpret_cast<float4*>(dst), n4, src + 4 * n4,
      dst + 4 * n4, tail);
  K2C_CUDA_CHECK_LAUNCH();
}

// =========================================================================== arithmetic ======
//
// An FMA has a latency of about 4 cycles on Hopper, and each of an SM's 4 schedulers issues one
// warp instruction per cycle to its 32 FP32 lanes. Two things follow:
//   - Latency: one dependency chain per thread would need 4 ready warps per scheduler at all
//     times. kFmaChains = 8 independent chains give each warp 8 FMAs it can issue back to back.
//     The chains live in registers (the j-loop is fully unrolled: indexing a register array
//     with a run-time index would move it to local memory).
//   - Issue slots: the peak needs an FMA in *every* issue slot, so the loop's own counter,
//     compare and branch are pure loss. Unrolling the t-loop amortises them. Measured on an
//     H200 (fp32 peak 66.9 TFLOP/s at 1.98 GHz, the clock held there throughout):
//       unroll 1: 0.58 of peak   4: 0.84   8: 0.91   16: 0.95   32: 0.97
// Memory traffic is one load and one store per element: nothing next to 2 × 8 × iters FLOPs.

constexpr int kFmaThreads = 256;

__global__ void fma_throughput_kernel(float* __restrict__ out, std::size_t n, int iters) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float x[kFmaChains];
    const float start = out[i];
#pragma unroll
    for (int j = 0; j < kFmaChains; ++j) x[j] = start + static_cast<float>(j) * kFmaStep;
#pragma unroll 32
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

// As many blocks as fit on the GPU at once (2048 threads per SM): each thread then loops over
// several elements, and every block lives for the whole launch.
static int resident_blocks(int threads_per_block) {
  int device = 0, sms = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms * (2048 / threads_per_block);
}

void fma_throughput(float* out, std::size_t n, int iters, cudaStream_t stream) {
  if (!check_fma_args(out, n, iters)) return;
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
// below it a kernel is memory-bound, above it compute-bound. On an H200's datasheet, fp32:
// 67e12 / 4.8e12 ≈ 14 FLOP/byte; bf16 tensor cores: ~990e12 / 4.8e12 ≈ 206 FLOP/byte. With the
// rates measured in lecture 00 (copy 4.25 TB/s, cuBLAS bf16 796 TFLOP/s) the bf16 ridge is 187.

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
// an fp32 SGEMM crosses the measured fp32 ridge (~12) already at n ≈ 96 — if, and only if, the kernel
// really reads each input once. Modules 01–04 are the story of getting there.
double matmul_intensity(long M, long N, long K, int bytes_per_element) {
  K2C_CHECK(M >= 1 && N >= 1 && K >= 1 && bytes_per_element >= 1,
            "matmul_intensity: need M, N, K, bytes >= 1, got " << M << ", " << N << ", " << K
                                                              << ", " << bytes_per_element);
  const double m = static_cast<double>(M), n = static_cast<double>(N), k = static_cast<double>(K);
  return 2.0 * m * n * k / ((m * k + k * n + 2.0 * m * n) * bytes_per_element);
}

}  // namespace k2c::roofline
