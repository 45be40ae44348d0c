// solutions/03_tiled_matmul/tiled_matmul.cu — reference solution of module 03
// (contract: tiled_matmul.h).
//
// Version 3 of the SGEMM ladder: shared memory. Module 02's kernel issues two global loads per
// FMA; even served from L1 that is a load instruction per FLOP, and the load/store units, not
// the FP32 lanes, set the pace. Staging tiles of A and B in shared memory lets a block read each
// input element from global memory once per tile and reuse it many times.
//
//   Part A, matmul_tile32: 32×32 tiles, one output per thread. Each element of a tile is loaded
//   once from global memory and read 32 times from shared memory, so global traffic drops 32×.
//   But every FMA still needs two shared-memory reads (one of them a broadcast), and shared
//   memory serves at most 32 four-byte words per clock per SM: ~1 FMA per word read.
//
//   Part B, matmul: the same idea plus a first step of register reuse. A 64×64 tile of C is
//   computed by 512 threads, each owning a column of kTM = 8 outputs. In the inner loop a thread
//   reads one value of B into a register and uses it for 8 FMAs, with 8 broadcast reads of A:
//   9 shared-memory reads for 8 FMAs instead of 16. Module 04 takes this to 2-D blocks.
//
// Tails: a tile that hangs over the edge of A or B is zero-filled (zeros add nothing to a dot
// product), and only elements inside C are written. The cost is a compare per load; the gain
// is one kernel for every shape.
//
// Bank conflicts. Shared memory has 32 banks of 4-byte words; a warp's access is conflict-free
// when its 32 threads hit 32 different banks or the same word (a broadcast). Here every access
// is one of those: rows of a tile are read along the row by consecutive threads, or read by a
// whole warp at one address. Reading a tile down a column (As[tx][k] with 32-word rows) would put
// all 32 threads in one bank — a 32-way conflict, 32 times slower — which is why the tiles are
// laid out as they are, and why module 04, which stores A transposed, pads its rows.
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"
#include "tiled_matmul.h"

namespace k2c::tiled_matmul {

// ============================================================ Part A: one output per thread ===

constexpr int kTile = 32;

__global__ void matmul_tile32_kernel(int M, int N, int K, float alpha, const float* __restrict__ A,
                                     const float* __restrict__ B, float beta,
                                     float* __restrict__ C) {
  __shared__ float As[kTile][kTile];
  __shared__ float Bs[kTile][kTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * kTile + ty, col = blockIdx.x * kTile + tx;

  float acc = 0.0f;
  for (int k0 = 0; k0 < K; k0 += kTile) {
    // Consecutive tx load consecutive addresses of A's row and of B's row: coalesced.
    As[ty][tx] = row < M && k0 + tx < K ? A[static_cast<std::size_t>(row) * K + k0 + tx] : 0.0f;
    Bs[ty][tx] = k0 + ty < K && col < N ? B[static_cast<std::size_t>(k0 + ty) * N + col] : 0.0f;
    __syncthreads();  // the whole tile is in place before anyone reads it
#pragma unroll
    for (int k = 0; k < kTile; ++k) acc += As[ty][k] * Bs[k][tx];  // broadcast, then stride 1
    __syncthreads();  // nobody overwrites the tile while others still read it
  }
  if (row < M && col < N) {
    const std::size_t i = static_cast<std::size_t>(row) * N + col;
    C[i] = beta == 0.0f ? alpha * acc : alpha * acc + beta * C[i];
  }
}

void matmul_tile32(int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                   float* C, cudaStream_t stream) {
  check_gemm_args(M, N, K, A, B, beta, C);
  if (M == 0 || N == 0) return;
  const dim3 block(kTile, kTile), grid((N + kTile - 1) / kTile, (M + kTile - 1) / kTile);
  K2C_CHECK(grid.y <= 65535, "matmul_tile32: M=" << M << " is too large for the grid");
  matmul_tile32_kernel<<<grid, block, 0, stream>>>(M, N, K, alpha, A, B, beta, C);
  K2C_CUDA_CHECK_LAUNCH();
}

// =============================================== Part B: a column of outputs per thread ======

constexpr int kBM = 64, kBN = 64, kBK = 8, kTM = 8;
constexpr int kThreads = kBM * kBN / kTM;  // 512: one thread per column of kTM outputs
static_assert(kBM * kBK == kThreads && kBK * kBN == kThreads,
              "each thread loads exactly one element of each tile");
static_assert(kBM % kTM == 0, "a thread's column of outputs lies inside the tile");

__global__ void __launch_bounds__(kThreads)
    matmul_kernel(int M, int N, int K, float alpha, const float* __restrict__ A,
                  const float* __restrict__ B, float beta, float* __restrict__ C) {
  __shared__ float As[kBM][kBK];
  __shared__ float Bs[kBK][kBN];
  const int t = threadIdx.x;
  const int out_col = t % kBN, out_row = (t / kBN) * kTM;  // this thread's outputs in the tile
  const int a_row = t / kBK, a_col = t % kBK;              // the A element it loads
  const int b_row = t / kBN, b_col = t % kBN;              // the B element it loads
  const int bm = blockIdx.y * kBM, bn = blockIdx.x * kBN;

  float acc[kTM] = {};
  for (int k0 = 0; k0 < K; k0 += kBK) {
    As[a_row][a_col] = bm + a_row < M && k0 + a_col < K
                           ? A[static_cast<std::size_t>(bm + a_row) * K + k0 + a_col] : 0.0f;
    Bs[b_row][b_col] = k0 + b_row < K && bn + b_col < N
                           ? B[static_cast<std::size_t>(k0 + b_row) * N + bn + b_col] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kBK; ++k) {
      const float b = Bs[k][out_col];  // one read, reused kTM times from a register
#pragma unroll
      for (int i = 0; i < kTM; ++i) acc[i] += As[out_row + i][k] * b;  // a warp-wide broadcast
    }
    __syncthreads();
  }

  const int col = bn + out_col;
  if (col >= N) return;
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    const int row = bm + out_row + i;
    if (row < M) {
      const std::size_t idx = static_cast<std::size_t>(row) * N + col;
      C[idx] = beta == 0.0f ? alpha * acc[i] : alpha * acc[i] + beta * C[idx];
    }
  }
}

void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream) {
  check_gemm_args(M, N, K, A, B, beta, C);
  if (M == 0 || N == 0) return;
  const dim3 grid((N + kBN - 1) / kBN, (M + kBM - 1) / kBM);
  K2C_CHECK(grid.y <= 65535, "matmul: M=" << M << " is too large for the grid");
  matmul_kernel<<<grid, kThreads, 0, stream>>>(M, N, K, alpha, A, B, beta, C);
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace k2c::tiled_matmul
