// solutions/01_naive_matmul/naive_matmul.cu — reference solution of module 01
// (contract: naive_matmul.h).
//
// Version 1 of the SGEMM ladder: one thread per element of C, each computing a full dot product
// of a row of A with a column of B straight from global memory. It is correct for every shape
// and deliberately simple; modules 02–04 make it fast, one idea at a time.
//
// Napkin math at M = N = K = 4096: 2·4096³ ≈ 137 GFLOP. The fewest bytes are (3 + 1)·4096²·4 B
// ≈ 268 MB, about 0.06 ms at 4.3 TB/s, against ~2.7 ms for the arithmetic at cuBLAS's ~51
// TFLOP/s: an SGEMM of this size is compute-bound by a factor of ~40, *if* each input is read
// once. This kernel instead reads 2K floats per output: 2·4096³·4 B ≈ 550 GB of requests, which
// only the caches keep from taking over a tenth of a second at HBM speed.
//
// Thread mapping: threadIdx.x walks down the ROWS of C. That is the natural first guess, and it
// is the wrong one for memory: the 32 threads of a warp read A at addresses K floats apart (32
// separate memory sectors for one load instruction), and they write C a whole row apart. Module
// 02 swaps the mapping so a warp's threads touch consecutive addresses, and measures the gain.
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"
#include "naive_matmul.h"

namespace k2c::naive_matmul {

constexpr int kBlock = 32;  // 32×32 = 1024 threads, the most a block may have

__global__ void matmul_kernel(int M, int N, int K, float alpha, const float* __restrict__ A,
                              const float* __restrict__ B, float beta, float* __restrict__ C) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  const int col = blockIdx.y * blockDim.y + threadIdx.y;
  // Blocks on the right or bottom edge overhang C when M or N is not a multiple of 32; those
  // threads have nothing to do. Only the edge blocks diverge here.
  if (row >= M || col >= N) return;

  float acc = 0.0f;  // fp32 accumulation, as cuBLAS SGEMM does; the tolerance allows for it
  for (int k = 0; k < K; ++k)
    acc += A[static_cast<std::size_t>(row) * K + k] * B[static_cast<std::size_t>(k) * N + col];

  const std::size_t i = static_cast<std::size_t>(row) * N + col;
  // BLAS convention: beta == 0 means C is output only, so garbage (even NaN) in C is ignored
  // rather than multiplied by zero (NaN · 0 = NaN).
  C[i] = beta == 0.0f ? alpha * acc : alpha * acc + beta * C[i];
}

void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream) {
  check_gemm_args(M, N, K, A, B, beta, C);
  if (M == 0 || N == 0) return;
  const dim3 block(kBlock, kBlock);
  const dim3 grid((M + kBlock - 1) / kBlock, (N + kBlock - 1) / kBlock);
  K2C_CHECK(grid.y <= 65535, "matmul: N=" << N << " needs " << grid.y
                                          << " blocks in y, more than the 65535 allowed");
  matmul_kernel<<<grid, block, 0, stream>>>(M, N, K, alpha, A, B, beta, C);
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace k2c::naive_matmul
