// assignments/01_naive_matmul/naive_matmul.h — the contract of module 01 (do not edit).
//
// SGEMM, the operation every later matmul module makes faster:
//
//   C = alpha * A * B + beta * C
//
// A is M×K, B is K×N, C is M×N, all fp32, row-major, densely packed (the element (r, c) of A is
// A[r * K + c]), device pointers. M, N, K >= 0, any size (no multiple-of-anything assumption).
// As in BLAS, when beta == 0 the old contents of C are not read: C may hold garbage, even NaN,
// and the result must still be alpha * A * B. K == 0 leaves C = beta * C.
// The call is asynchronous on `stream`. Throws std::invalid_argument for a negative size or a
// null pointer that would be used.
//
// Tests: autograder/01_naive_matmul/test_naive_matmul.cu. Lecture: lectures/01_naive_matmul.md.
#pragma once

#include <cuda_runtime_api.h>

namespace k2c::naive_matmul {

void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream = nullptr);

}  // namespace k2c::naive_matmul
