// assignments/03_tiled_matmul/tiled_matmul.h — the contract of module 03 (do not edit).
//
// The same SGEMM as module 01 (see assignments/01_naive_matmul/naive_matmul.h for the full
// statement): C = alpha * A * B + beta * C, fp32, row-major, densely packed device arrays,
// A M×K, B K×N, C M×N, any M, N, K >= 0; beta == 0 means C is not read; K == 0 leaves beta * C;
// asynchronous on `stream`; std::invalid_argument for a negative size or a null pointer that
// would be used. Both functions compute exactly this; they differ in how they use shared memory.
//
// Tests: autograder/03_tiled_matmul/test_tiled_matmul.cu. Lecture: lectures/03_tiled_matmul.md.
#pragma once

#include <cuda_runtime_api.h>

namespace k2c::tiled_matmul {

// Part A: 32×32 tiles of A and B staged in shared memory; one thread per element of C.
// Sizes that are not multiples of 32 are handled by zero-filling the tile edges.
void matmul_tile32(int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                   float* C, cudaStream_t stream = nullptr);

// Part B (graded for speed): tiles again, but each thread computes a column of several elements
// of C, so each value read from shared memory feeds several FMAs.
void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream = nullptr);

}  // namespace k2c::tiled_matmul
