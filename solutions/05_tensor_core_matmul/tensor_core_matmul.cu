// solutions/05_tensor_core_matmul/tensor_core_matmul.cu — module 05, Part A: the reference
// mma.sync GEMM (contract: tensor_core_matmul.h; lecture: lectures/05_tensor_core_matmul.md).
//
// C = A · Bᵀ, bf16 in, fp32 accumulation. The design, top to bottom:
//   block tile   256×128 of C, 8 warps as 4 (along M) × 2 (along N), each warp a 64×64 tile:
//                4 m16 × 8 n8 = 32 mma.sync per 16-wide k step, 128 fp32 accumulators a thread.
//                A 64×64 warp tile loads 4 KiB by ldmatrix per 16-wide k step for 131,072 FLOPs
//                of tensor-core work, 32 FLOPs per byte: about what shared memory (128 bytes
//                per clock per SM) can feed at the tensor cores' rate. Smaller warp tiles starve
//                them.
//   k tile       64 bf16 = 128 bytes per row, so a row is one full line of the 32 banks.
//   pipeline     STAGES shared-memory buffers filled by cp.async (global → shared with no
//                register round trip); while the warps multiply tile k, tiles k+1 .. k+STAGES-1
//                are in flight. One __syncthreads per k tile.
//   swizzle      16-byte chunk c of row r is stored at chunk c ^ (r % 8). ldmatrix reads the same
//                chunk of 8 consecutive rows; unswizzled, those 8 rows (128 bytes apart) would
//                all hit the same 4 banks and serialise 8-fold. Swizzled, they cover all 32 banks.
//   raster       consecutive blocks walk down a band of 16 block-rows before moving right, so the
//                blocks resident at one time share A and B tiles in L2.
//   tails        rows and columns outside the matrix are zero-filled by cp.async (source size
//                0) and never stored. K % 8 != 0 or unaligned A/B take the same kernel with plain
//                element loads instead of 16-byte copies.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"
#include "../shared/mma_tile.cuh"
#include "k2c/device/tensor_core.cuh"
#include "tensor_core_matmul.h"
#include "tiles.cuh"

namespace k2c::tensor_core_matmul {
namespace {

using tc::smem_addr;

// Tile and swizzled() are tiles.cuh's, given to students as they are.

// Measured on an H200 (lab/tensor_core.cu, 8192³): 256×128 with 4 warps × 2 and 4
// stages 402 TFLOP/s; 128×256 with 3 stages 377; 16 warps of 64×32 tiles 347 (more warps, but
// each reads more shared memory per MMA); 128×128 with 4 warps 373.
using Reference = Tile<256, 128, 4, 2, 4>;

// Copies rows [row0, row0 + ROWS) × k [k0, k0 + 64) of a K-contiguous operand with `rows` rows
// into a swizzled tile, zero-filling what lies outside the matrix.
template <class T, int ROWS, bool kVector>
__device__ __forceinline__ void load_tile(std::uint32_t tile, const bf16* src, int rows, int K,
                                          int row0, int k0) {
  constexpr int kChunks = ROWS * 8;
#pragma unroll
  for (int i = 0; i < kChunks / T::kThreads; ++i) {
    const int id = i * T::kThreads + threadIdx.x;
    const int r = id >> 3, c = id & 7;
    const int row = row0 + r, k = k0 + c * 8;
    const std::uint32_t dst = tile + swizzled(r, c);
    if constexpr (kVector) {
      // With K % 8 == 0 a 16-byte chunk is either wholly inside the matrix or wholly outside.
      const bool inside = row < rows && k < K;
      const bf16* p = inside ? src + static_cast<std::size_t>(row) * K + k : src;
      tc::cp_async_16(dst, p, inside);
    } else {
      alignas(16) bf16 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        v[j] = row < rows && k + j < K ? src[static_cast<std::size_t>(row) * K + k + j]
                                       : __float2bfloat16(0.0f);
      const uint4 packed = *reinterpret_cast<const uint4*>(v);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(packed.x),
                   "r"(packed.y), "r"(packed.z), "r"(packed.w));
    }
  }
}

template <class OutT>
__device__ __forceinline__ void store_pair(OutT* C, int M, int N, bool pairs, int row, int col,
                                           float v0, float v1) {
  if (row >= M) return;
  OutT* p = C + static_cast<std::size_t>(row) * N + col;
  if (pairs && col + 1 < N) {
    if constexpr (sizeof(OutT) == 2) {
      *reinterpret_cast<std::uint32_t*>(p) = tc::pack_bf16x2(v0, v1);
    } else {
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    }
  } else {
    if (col < N) p[0] = static_cast<OutT>(v0);
    if (col + 1 < N) p[1] = static_cast<OutT>(v1);
  }
}

template <class T, bool kVector, class OutT>
__global__ void __launch_bounds__(T::kThreads, 1)
    mma_kernel(int M, int N, int K, const bf16* __restrict__ A, const bf16* __restrict__ B,
               OutT* __restrict__ C, bool pairs) {
  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t smem0 = smem_addr(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / T::WARPS_N, warp_n = warp % T::WARPS_N;

  // Grouped raster: block b → (tile_m, tile_n), bands of kGroupRows block-rows.
  const int tiles_m = tc::ceil_div(M, T::BM), tiles_n = tc::ceil_div(N, T::BN);
  const int per_band = T::kGroupRows * tiles_n;
  const int band = blockIdx.x / per_band, in_band = blockIdx.x % per_band;
  const int band_rows = min(T::kGroupRows, tiles_m - band * T::kGroupRows);
  const int m0 = (band * T::kGroupRows + in_band % band_rows) * T::BM;
  const int n0 = (in_band / band_rows) * T::BN;

  auto stage_a = [&](int s) { return smem0 + s * T::kStageBytes; };
  auto stage_b = [&](int s) { return smem0 + s * T::kStageBytes + T::BM * T::kRowBytes; };
  auto load_stage = [&](int s, int kt) {
    load_tile<T, T::BM, kVector>(stage_a(s), A, M, K, m0, kt * T::BK);
    load_tile<T, T::BN, kVector>(stage_b(s), B, N, K, n0, kt * T::BK);
  };

  float acc[T::MT][T::NT][4] = {};
  const int k_tiles = tc::ceil_div(K, T::BK);

  tc::pipeline_prologue<T::STAGES>(k_tiles, load_stage);

  // ldmatrix lane roles. A (16×16 per x4): lanes 0-15 address rows 0-15 at k chunk 0, lanes
  // 16-31 the same rows at chunk 1 → registers a0..a3 in mma order. B (two n8 tiles per x4):
  // lanes 0-7 rows 0-7 chunk 0, 8-15 rows 0-7 chunk 1, 16-23 rows 8-15 chunk 0, 24-31 rows 8-15
  // chunk 1 → b[0], b[1] of n-tile 0, then of n-tile 1.
  const int a_row = warp_m * T::WM + (lane & 15), a_chunk = lane >> 4;
  const int b_row = warp_n * T::WN + (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;

  for (int kt = 0; kt < k_tiles; ++kt) {
    tc::pipeline_advance<T::STAGES>(kt, k_tiles, load_stage);
    const std::uint32_t sa = stage_a(kt % T::STAGES), sb = stage_b(kt % T::STAGES);
    std::uint32_t a[T::MT][4], b[T::NT][2];
    tc::mma_stage<T::BK / 16>(
        acc, a, b,
        [&](std::uint32_t(&frag)[4], int mt, int ks) {
          tc::ldmatrix_x4(frag, sa + swizzled(a_row + mt * 16, ks * 2 + a_chunk));
        },
        [&](std::uint32_t(&r)[4], int nt, int ks) {
          tc::ldmatrix_x4(r, sb + swizzled(b_row + nt * 8, ks * 2 + b_chunk));
        });
  }
  tc::cp_async_wait<0>();  // no copy may outlive the block (the tail groups are empty)

  // Epilogue: each thread owns pairs of adjacent columns in rows g and g+8 of every mma tile.
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < T::NT; ++nt) {
      const int row = m0 + warp_m * T::WM + mt * 16 + g;
      const int col = n0 + warp_n * T::WN + nt * 8 + 2 * q;
      store_pair(C, M, N, pairs, row, col, acc[mt][nt][0], acc[mt][nt][1]);
      store_pair(C, M, N, pairs, row + 8, col, acc[mt][nt][2], acc[mt][nt][3]);
    }
}

template <class T, bool kVector, class OutT>
void launch_tile(int M, int N, int K, const bf16* A, const bf16* B, OutT* C, bool pairs,
                 cudaStream_t stream) {
  auto* kernel = mma_kernel<T, kVector, OutT>;
  // Beyond 48 KiB of dynamic shared memory a kernel must opt in, on each device it runs on: cheap
  // enough to repeat at every launch.
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      T::kSmemBytes));
  const long long blocks = static_cast<long long>(tc::ceil_div(M, T::BM)) * tc::ceil_div(N, T::BN);
  K2C_CHECK(blocks <= 0x7fffffff, "too many tiles for one launch: " << M << "x" << N);
  kernel<<<static_cast<unsigned>(blocks), T::kThreads, T::kSmemBytes, stream>>>(M, N, K, A, B, C,
                                                                                 pairs);
  K2C_CUDA_CHECK_LAUNCH();
}

// Called by dispatch.h's matmul() with the arguments checked and M, N > 0.
template <class OutT>
void launch(int M, int N, int K, const bf16* A, const bf16* B, OutT* C, bool vector, bool pairs,
            cudaStream_t stream) {
  if (vector)
    launch_tile<Reference, true>(M, N, K, A, B, C, pairs, stream);
  else
    launch_tile<Reference, false>(M, N, K, A, B, C, pairs, stream);
}

}  // namespace
}  // namespace k2c::tensor_core_matmul

// matmul() from launch<OutT>: given to students as it is.
#include "dispatch.h"
