// solutions/02_coalesced_matmul/coalesced_matmul.cu — reference solution of module 02
// (contract: coalesced_matmul.h).
//
// Version 2 of the SGEMM ladder. The arithmetic is module 01's, line for line; only the mapping
// of threads to elements of C changes: threadIdx.x now walks along a ROW of C (consecutive
// columns) instead of down a column.
//
// Why it matters, per warp and per step k of the dot product:
//   module 01: the 32 threads have 32 consecutive rows. Their A loads are K floats apart: 32
//              different 32-byte sectors for one instruction. Their B loads are the same address
//              (one broadcast). Their C stores, N floats apart, are 32 sectors again.
//   module 02: the 32 threads have 32 consecutive columns. Their A loads are the same address
//              (a broadcast); their B loads are 32 consecutive floats = 128 bytes = 4 sectors,
//              one request; their C stores likewise.
// Requests per warp per k step go from 33 sectors to 5, and the L1 serves the kernel instead of
// drowning in it. Measured on an H200 at 4096³: about 12× module 01 (see lectures/02 and
// autograder/reference/h200.json). It is still far from cuBLAS: every FMA still needs two loads
// from the memory system, which modules 03 and 04 remove.
#include <cuda_runtime.h>

#include "coalesced_matmul.h"
#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"

namespace k2c::coalesced_matmul {

constexpr int kBlock = 32;

__global__ void matmul_kernel(int M, int N, int K, float alpha, const float* __restrict__ A,
                              const float* __restrict__ B, float beta, float* __restrict__ C) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;  // the fast index: consecutive in a warp
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  if (row >= M || col >= N) return;

  const float* a = A + static_cast<std::size_t>(row) * K;
  const float* b = B + col;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) acc += a[k] * b[static_cast<std::size_t>(k) * N];

  const std::size_t i = static_cast<std::size_t>(row) * N + col;
  C[i] = beta == 0.0f ? alpha * acc : alpha * acc + beta * C[i];
}

void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream) {
  check_gemm_args(M, N, K, A, B, beta, C);
  if (M == 0 || N == 0) return;
  const dim3 block(kBlock, kBlock);
  const dim3 grid((N + kBlock - 1) / kBlock, (M + kBlock - 1) / kBlock);
  K2C_CHECK(grid.y <= 65535, "matmul: M=" << M << " needs " << grid.y
                                          << " blocks in y, more than the 65535 allowed");
  matmul_kernel<<<grid, block, 0, stream>>>(M, N, K, alpha, A, B, beta, C);
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace k2c::coalesced_matmul
