// assignments/02_coalesced_matmul/coalesced_matmul.h — the contract of module 02 (do not edit).
//
// The same SGEMM as module 01 (see assignments/01_naive_matmul/naive_matmul.h for the full
// statement): C = alpha * A * B + beta * C, fp32, row-major, densely packed device arrays,
// A M×K, B K×N, C M×N, any M, N, K >= 0; beta == 0 means C is not read; K == 0 leaves beta * C;
// asynchronous on `stream`; std::invalid_argument for a negative size or a null pointer that
// would be used. Only the implementation changes.
//
// Tests: autograder/02_coalesced_matmul/test_coalesced_matmul.cu. Lecture: lectures/02_coalesced_matmul.md.
#pragma once

#include <cuda_runtime_api.h>

namespace k2c::coalesced_matmul {

void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream = nullptr);

}  // namespace k2c::coalesced_matmul
