// assignments/05_tensor_core_matmul/dispatch.h — the given end of tensor_core_matmul.cu (Part A):
// the contract's two matmul() overloads, which check their arguments, return early on an empty C
// and choose the kernel's variant before calling the .cu's launch<OutT>(M, N, K, A, B, C, vector,
// pairs, stream). Included once, at the end of tensor_core_matmul.cu (the stub's and the
// reference's alike), after launch<OutT> is defined in the .cu's unnamed namespace; not a file to
// edit or submit.
#pragma once

#include <cstdint>

#include "k2c/core/gemm_args.h"
#include "tensor_core_matmul.h"

namespace k2c::tensor_core_matmul {
namespace {  // the same unnamed namespace as the .cu's launch<OutT>

template <class OutT>
void run(int M, int N, int K, const bf16* A, const bf16* B, OutT* C, cudaStream_t stream) {
  check_gemm_args(M, N, K, A, B, 0.0f, C);
  if (M == 0 || N == 0) return;
  // vector: 16-byte cp.async copies, for which every row of A and B must start on 16 bytes.
  // pairs: 2-element stores of C, for which its rows must be of even length and C aligned to a pair.
  const bool vector = K % 8 == 0 && aligned16(A) && aligned16(B);
  const bool pairs = N % 2 == 0 && reinterpret_cast<std::uintptr_t>(C) % (2 * sizeof(OutT)) == 0;
  launch(M, N, K, A, B, C, vector, pairs, stream);
}

}  // namespace

void matmul(int M, int N, int K, const bf16* A, const bf16* B, bf16* C, cudaStream_t stream) {
  run(M, N, K, A, B, C, stream);
}

void matmul(int M, int N, int K, const bf16* A, const bf16* B, float* C, cudaStream_t stream) {
  run(M, N, K, A, B, C, stream);
}

}  // namespace k2c::tensor_core_matmul
