// assignments/05_tensor_core_matmul/tensor_core_matmul.h — the contract of module 05 (do not edit).
//
// C = A · Bᵀ in bf16 with fp32 accumulation, on the tensor cores.
//   A  M×K bf16, row-major (K contiguous)
//   B  N×K bf16, row-major (K contiguous): the layout of a linear layer's weight
//      (out_features × in_features), of attention's K in Q·Kᵀ and of module 10's experts.
//      Both operands are then "K-major", the layout mma.sync's row.col form and wgmma read
//      without transposing.
//   C  M×N, row-major, bf16 (each fp32 sum rounded once, to nearest even) or fp32.
// Densely packed device arrays; any M, N, K >= 0 (K == 0 writes zeros); asynchronous on `stream`.
// Calls may run at once on different streams (the capstone's course mode splits a long K so),
// so keep no state in device memory from one call to the next.
// std::invalid_argument for a negative size or a null pointer that would be used.
//
// Part A, matmul(): mma.sync m16n8k16 + ldmatrix + cp.async, for any GPU from sm_80 on. Its fast
// path loads 16-byte chunks and so needs K % 8 == 0 and 16-byte aligned A and B; other inputs
// must still be computed correctly (more slowly).
//
// Part B, matmul_hopper(): wgmma + TMA + mbarriers + warp specialization, sm_90a only (the build
// compiles this module for sm_90a when it targets sm_90). TMA addresses rows in 16-byte units, so
// it requires K % 8 == 0 and 16-byte aligned A and B, and throws std::invalid_argument otherwise
// (callers fall back to matmul()). hopper_supported() says whether this build and device can
// run it, and why not.
//
// Tests: autograder/05_tensor_core_matmul/test_tensor_core_matmul.cu.
// Lecture: lectures/05_tensor_core_matmul.md.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"

namespace k2c::tensor_core_matmul {

using bf16 = __nv_bfloat16;

// Part A.
void matmul(int M, int N, int K, const bf16* A, const bf16* B, bf16* C,
            cudaStream_t stream = nullptr);
void matmul(int M, int N, int K, const bf16* A, const bf16* B, float* C,
            cudaStream_t stream = nullptr);

// Part B. Fills *why_not (when given) with the reason it cannot run here.
bool hopper_supported(std::string* why_not = nullptr);
void matmul_hopper(int M, int N, int K, const bf16* A, const bf16* B, bf16* C,
                   cudaStream_t stream = nullptr);

// The argument checks both parts make (given, not part of the exercise; the stubs and the
// reference call the same ones). 16-byte alignment decides Part A's fast path and is what TMA
// needs of every row start in Part B.
inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// matmul_hopper's preconditions, as stated above; throws std::invalid_argument naming the value.
inline void check_hopper_args(int M, int N, int K, const bf16* A, const bf16* B, const bf16* C) {
  check_gemm_args(M, N, K, A, B, 0.0f, C);
  if (M == 0 || N == 0) return;
  K2C_CHECK(K % 8 == 0, "matmul_hopper needs K % 8 == 0 (TMA rows start on 16 bytes), got K="
                            << K << "; use matmul()");
  K2C_CHECK(K == 0 || (aligned16(A) && aligned16(B)),
            "matmul_hopper needs 16-byte aligned A and B (TMA); use matmul()");
}

}  // namespace k2c::tensor_core_matmul
