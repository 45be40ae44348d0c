// lab/tensor_peak.cu — how fast the tensor cores go when a kernel does nothing but
// issue matrix instructions: mma.sync m16n8k16 (what module 05's Part A is built on) and wgmma
// m64n256k16 (Part B), bf16 operands, fp32 accumulators, random data, with cuBLAS bf16 at 8192³
// timed in the same process. These are the instruction paths' ceilings that lecture 05 compares
// its kernels with: no loads, no stores, no address arithmetic, only the multiplies. Then the
// ceiling of Part A's design once its operands come from shared memory: the reference's warp
// layout (8 warps as 4 × 2, 64 × 64 warp tiles) reading its fragments by ldmatrix from one fixed,
// swizzled 256 × 64 + 128 × 64 stage, over and over, with no global memory and no cp.async: what
// no pipeline around that loop can beat.
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icommon/include lab/tensor_peak.cu \
//        common/src/device.cu -lcublas -lcuda -o /tmp/tensor_peak && /tmp/tensor_peak
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/random.h"
#include "k2c/device/hopper.cuh"
#include "k2c/device/tensor_core.cuh"
#include "median_time.cuh"

using bf16 = __nv_bfloat16;
namespace hp = k2c::hopper;

// mma.sync: every warp keeps kAcc independent accumulators (so that one instruction never waits
// for the previous one's result) and cycles through four A and two B fragments of random bf16
// pairs, so the operands the tensor cores see change from one instruction to the next.
template <int kAcc>
__global__ void mma_sync_peak(const std::uint32_t* in, float* out, int iters) {
  const int lane = threadIdx.x % 32;
  std::uint32_t a[4][4], b[2][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) a[i][j] = in[lane * 20 + 4 * i + j];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) b[i][j] = in[lane * 20 + 16 + 2 * i + j];
  float d[kAcc][4] = {};
  for (int it = 0; it < iters; it += 4)  // iters: a multiple of 4
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int j = 0; j < kAcc; ++j) k2c::tc::mma_bf16_16816(d[j], a[(r + j) % 4], b[(r + j) % 2]);
  float s = 0;
#pragma unroll
  for (int j = 0; j < kAcc; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the work; one float a thread
}

// The smem-fed loop: a block of 8 warps (4 along M × 2 along N, each 64 × 64) over one stage of
// A [256][64] and B [128][64] bf16 in 128-byte swizzled rows, filled once with random data. Per
// pass: 4 k steps of 16, each 4 ldmatrix_x4 of A, 4 of B and 32 mma. kSync: a __syncthreads per
// pass (the reference's one barrier per k tile of 64); kAhead: each k step's fragments are loaded
// during the previous step's mma (two fragment sets in registers); kCopy: each pass also copies a
// stage's worth of bytes (48 KiB, what the pipeline brings per k tile) from global memory that
// stays in L2 (each block its own 48 KiB, so that the blocks spread over L2 as a GEMM's tiles do)
// into a second stage that no one reads, waiting for the previous pass's copies before the
// barrier: the pipeline's L2 and shared-memory traffic and its waits, without DRAM. kCopy = 1 as
// the reference copies, 16 bytes a thread by cp.async; 2 by one thread, bulk copies of 8 KiB
// (cp.async.bulk, sm_90) completing on an mbarrier, so that the copies cost the warps no
// instructions; 3 the same bytes stored from registers (st.shared, 16 bytes a thread), no global
// memory at all: the shared memory's share of the cost alone.
__device__ __forceinline__ std::uint32_t swizzled(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

//
// kNT: n8 tiles a warp (8: the reference's 64 × 64 warp tiles; 12: 64 × 96, B a 192-row stage),
// the wider tile reading 5 KiB of fragments per 16 of k for 1.5× the MMAs (38 FLOPs a byte
// instead of 32), at 192 accumulators a thread.
template <bool kSync, bool kAhead, int kCopy = 0, int kNT = 8>
__global__ void __launch_bounds__(256, 1) mma_from_smem(const std::uint32_t* in, const std::uint32_t* copy_src, float* out,
                                                        int iters) {
  constexpr int kRows = 256 + 8 * 2 * kNT;  // A's 256 rows and B's 2 warps × 8·kNT
  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t sa = k2c::tc::smem_addr(smem), sb = sa + 256 * 128, spare = sa + kRows * 128;
  const std::uint32_t bar = spare + kRows * 128;  // kCopy = 2's barrier, after the spare stage
  const std::uint32_t* src = copy_src + static_cast<std::size_t>(blockIdx.x) * kRows * 32;  // this block's kRows rows
  for (int i = threadIdx.x; i < kRows * 32; i += blockDim.x)
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sa + 4 * i), "r"(in[i % 4096]));
  if (kCopy == 2 && threadIdx.x == 0) {
    hp::mbarrier_init(bar, 1);
    hp::fence_barrier_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp / 2, wn = warp % 2;
  const int a_row = wm * 64 + (lane & 15), a_chunk = lane >> 4;
  const int b_row = wn * 8 * kNT + (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
  float acc[4][kNT][4] = {};
  std::uint32_t a[kAhead ? 2 : 1][4][4], b[kAhead ? 2 : 1][kNT][2];
  auto load = [&](int set, int ks) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) k2c::tc::ldmatrix_x4(a[set][mt], sa + swizzled(a_row + 16 * mt, 2 * ks + a_chunk));
#pragma unroll
    for (int nt = 0; nt < kNT; nt += 2) {
      std::uint32_t r[4];
      k2c::tc::ldmatrix_x4(r, sb + swizzled(b_row + 8 * nt, 2 * ks + b_chunk));
      b[set][nt][0] = r[0], b[set][nt][1] = r[1], b[set][nt + 1][0] = r[2], b[set][nt + 1][1] = r[3];
    }
  };
  auto multiply = [&](int set) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) k2c::tc::mma_bf16_16816(acc[mt][nt], a[set][mt], b[set][nt]);
  };
  if (kAhead) load(0, 0);
  for (int it = 0; it < iters; ++it) {
    if (kCopy == 2) {
      // Every thread sees the previous pass's copies land (the first pass's "previous" phase
      // counts as done), then one thread starts this pass's: kRows rows of 128 bytes.
      hp::mbarrier_wait(bar, (it & 1) ^ 1);
      if (threadIdx.x == 0) {
        hp::mbarrier_arrive_expect_tx(bar, kRows * 128);
        for (int i = 0; i < kRows / 64; ++i) hp::bulk_load(spare + 8192 * i, src + 2048 * i, 8192, bar);
      }
    } else if (kCopy == 3) {
#pragma unroll 2
      for (int i = 0; i < kRows / 32; ++i) {
        const int chunk = i * 256 + threadIdx.x;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(spare + 16 * chunk), "r"(chunk), "r"(i), "r"(it),
                     "r"(lane));
      }
    } else if (kCopy == 1) {
      // kRows rows of 128 bytes (384: 12 chunks of 16 bytes a thread).
      k2c::tc::cp_async_wait<0>();
#pragma unroll 2  // fully unrolled, the 64 × 96 variant's addresses spill
      for (int i = 0; i < kRows / 32; ++i) {
        const int chunk = i * 256 + threadIdx.x;
        k2c::tc::cp_async_16(spare + 16 * chunk, src + 4 * chunk, true);
      }
      k2c::tc::cp_async_commit();
    }
    if (kSync) __syncthreads();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (kAhead) {
        load((ks + 1) % 2, (ks + 1) % 4);  // the next step's (at the last, the next pass's first)
        multiply(ks % 2);
      } else {
        load(0, ks);
        multiply(0);
      }
    }
  }
  // No copy may still be writing into the block's shared memory when it exits.
  if (kCopy == 1) k2c::tc::cp_async_wait<0>();
  if (kCopy == 2 && iters > 0) hp::mbarrier_wait(bar, (iters - 1) & 1);
  float s = 0;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) s += acc[mt][nt][0] + acc[mt][nt][1] + acc[mt][nt][2] + acc[mt][nt][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// wgmma: every warpgroup multiplies its own 64×64 A tile by a shared 256×64 B tile, both random
// and laid out as TMA's 128-byte swizzle would leave them, four k16 steps per group, keeping one
// group in flight.
__global__ void wgmma_peak(const std::uint32_t* in, float* out, int iters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t base = (k2c::tc::smem_addr(smem_raw) + 1023) & ~1023u;
  const int warpgroups = blockDim.x / 128, wg = threadIdx.x / 128;
  const std::uint32_t b_tile = base, a_tile = base + 256 * 128 + wg * 64 * 128;
  const int words = (256 + 64 * warpgroups) * 128 / 4;
  for (int i = threadIdx.x; i < words; i += blockDim.x)
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(base + 4 * i), "r"(in[i % 4096]));
  hp::fence_proxy_async();
  __syncthreads();
  float d[128];
  for (int it = 0; it < iters; ++it) {
    hp::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      hp::wgmma_m64n256k16(d, hp::smem_desc_128b(a_tile + 32 * k), hp::smem_desc_128b(b_tile + 32 * k), it > 0 || k > 0);
    hp::wgmma_commit();
    hp::wgmma_wait<1>();
  }
  hp::wgmma_wait<0>();
  float s = 0;
#pragma unroll
  for (int i = 0; i < 128; ++i) s += d[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
#endif
}

// A failed launch or opt-in would otherwise show up as an absurd rate.
void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

int main() {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device attribute");
  std::uint32_t* in;
  float* out;
  cudaMalloc(&in, 4096 * 4);
  cudaMalloc(&out, sizeof(float) * sms * 4 * 1024);
  k2c::fill_uniform_device(reinterpret_cast<bf16*>(in), 8192, 7);
  // The copying variants' sources: 56 KiB a block, the largest stage, for two blocks an SM (7 MiB
  // for 132 SMs: well inside the 50 MiB L2).
  std::uint32_t* copy_src = nullptr;
  const std::size_t copy_bytes = static_cast<std::size_t>(sms) * 2 * 448 * 128;
  cudaMalloc(&copy_src, copy_bytes);
  k2c::fill_uniform_device(reinterpret_cast<bf16*>(copy_src), copy_bytes / 2, 8);

  // About 10 ms a run at the expected rates; medians of 10 runs after 3.
  auto report = [&](const char* what, double flops, double ms) {
    std::printf("  %-44s %7.1f TFLOP/s\n", what, flops / (ms * 1e-3) / 1e12);
  };
  std::printf("mma.sync m16n8k16 bf16 -> fp32, %d SMs:\n", sms);
  auto mma_case = [&](auto acc, int warps_per_sm) {  // one block of warps_per_sm warps per SM
    constexpr int kAcc = decltype(acc)::value;
    const long long warps = static_cast<long long>(sms) * warps_per_sm;
    const int iters = static_cast<int>(6e12 / (warps * kAcc * 4096.0)) / 4 * 4;
    const double ms = median_ms([&] { mma_sync_peak<kAcc><<<sms, 32 * warps_per_sm>>>(in, out, iters); }, 10);
    check(cudaGetLastError(), "mma_sync_peak");
    char what[96];
    std::snprintf(what, sizeof what, "%2d warps/SM, %d accumulators a warp", warps_per_sm, kAcc);
    report(what, 4096.0 * kAcc * iters * warps, ms);
  };
  for (int w : {4, 8, 16, 32}) {
    mma_case(std::integral_constant<int, 4>{}, w);
    mma_case(std::integral_constant<int, 8>{}, w);
  }

  std::printf("mma.sync fed by ldmatrix from one fixed shared-memory stage (8 warps of 64x64):\n");
  auto smem_case = [&](auto kernel, const char* name, int blocks_per_sm, int nt = 8) {
    const int smem = 2 * (256 + 16 * nt) * 128 + 8;  // the stage, a second one to copy into, a barrier
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "shared memory opt-in");
    const long long blocks = static_cast<long long>(sms) * blocks_per_sm;
    const double pass = 4.0 * 4 * nt * 4096;  // a warp's FLOPs per pass: 4 k steps of 4 × nt mma
    const int iters = static_cast<int>(6e12 / (blocks * 8 * pass));
    const double ms = median_ms([&] { kernel<<<blocks, 256, smem>>>(in, copy_src, out, iters); }, 10);
    check(cudaGetLastError(), name);
    char what[96];
    std::snprintf(what, sizeof what, "%s, %d block(s)/SM", name, blocks_per_sm);
    report(what, pass * 8 * iters * blocks, ms);
  };
  smem_case(mma_from_smem<false, false>, "in order", 1);
  smem_case(mma_from_smem<false, true>, "fragments a step ahead", 1);
  smem_case(mma_from_smem<true, false>, "in order, a barrier per 64 of k", 1);
  smem_case(mma_from_smem<true, true>, "a step ahead, a barrier per 64 of k", 1);
  smem_case(mma_from_smem<true, false, 1>, "in order, barrier, 48 KiB copied per 64 of k", 1);
  smem_case(mma_from_smem<true, true, 1>, "a step ahead, barrier, 48 KiB copied", 1);
  smem_case(mma_from_smem<true, false, 3>, "in order, barrier, 48 KiB stored from registers", 1);
  smem_case(mma_from_smem<true, true, 3>, "a step ahead, barrier, 48 KiB stored from registers", 1);
  smem_case(mma_from_smem<true, false, 2>, "in order, barrier, 48 KiB bulk-copied", 1);
  smem_case(mma_from_smem<true, true, 2>, "a step ahead, barrier, 48 KiB bulk-copied", 1);
  smem_case(mma_from_smem<true, false, 0, 12>, "64x96 warp tiles, in order, barrier", 1, 12);
  smem_case(mma_from_smem<true, false, 1, 12>, "64x96, in order, barrier, 56 KiB copied", 1, 12);
  smem_case(mma_from_smem<true, false, 2, 12>, "64x96, in order, barrier, 56 KiB bulk-copied", 1, 12);

  std::printf("wgmma m64n256k16 bf16 -> fp32 (A, B from shared memory):\n");
  check(cudaFuncSetAttribute(wgmma_peak, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024), "shared memory opt-in");
  for (int wgs : {1, 2, 3}) {
    const long long groups = static_cast<long long>(sms) * wgs;
    const int iters = static_cast<int>(8e12 / (groups * 4 * 524288.0));
    const double ms = median_ms([&] { wgmma_peak<<<sms, 128 * wgs, 96 * 1024>>>(in, out, iters); }, 10);
    check(cudaGetLastError(), "wgmma_peak");
    char what[96];
    std::snprintf(what, sizeof what, "%d warpgroup(s) a block, one block/SM", wgs);
    report(what, 524288.0 * 4 * iters * groups, ms);
  }

  // cuBLAS at 8192³ on random data, back to back.
  const int n = 8192;
  bf16 *A, *B, *C;
  cudaMalloc(&A, sizeof(bf16) * n * n);
  cudaMalloc(&B, sizeof(bf16) * n * n);
  cudaMalloc(&C, sizeof(bf16) * n * n);
  k2c::fill_uniform_device(A, static_cast<std::size_t>(n) * n, 1);
  k2c::fill_uniform_device(B, static_cast<std::size_t>(n) * n, 2);
  cublasHandle_t blas;
  cublasCreate(&blas);
  const float one = 1, zero = 0;
  const double ms = median_ms(
      [&] {
        cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, B, CUDA_R_16BF, n, A, CUDA_R_16BF, n, &zero, C,
                     CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      },
      10);
  std::printf("cuBLAS bf16 GEMM 8192^3, back to back:\n");
  report("cublasGemmEx", 2.0 * n * n * static_cast<double>(n), ms);
  check(cudaDeviceSynchronize(), "the runs");
  std::printf("status: no error\n");
  return 0;
}
