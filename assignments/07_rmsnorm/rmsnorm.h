// assignments/07_rmsnorm/rmsnorm.h — the contract of module 07 (do not edit).
//
// RMSNorm, the normalisation of Llama-style transformers, forward and backward, bf16 storage and
// fp32 arithmetic. For every row h of a rows × cols row-major matrix and a weight vector gamma:
//
//   rstd = 1 / sqrt(mean_j(h_j²) + eps)          y_j = h_j · rstd · gamma_j
//
// Unlike LayerNorm there is no mean to subtract and no bias: one reduction per row instead of
// two, and one saved number per row (rstd) for the backward pass.
//
// Tests: autograder/07_rmsnorm/test_rmsnorm.cu. Lecture: lectures/07_rmsnorm.md.
#pragma once

#include <cstddef>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c::rmsnorm {

using bf16 = __nv_bfloat16;

// The largest rows or cols accepted: indices are int, with room for a block's overhang.
inline constexpr int kMaxExtent = 2147483647 - 8192;

// Forward, on `stream`, asynchronously. All pointers are device pointers; rows, cols >= 0
// (nothing happens when either is 0); eps > 0.
//   x        rows × cols   the input
//   residual rows × cols   optional (nullptr: none). When given, the layer normalises
//                          h = x + residual, rounded to bf16, and also writes that h to
//                          residual_out (the pre-norm transformer's "fused add + norm": the sum
//                          is the next block's residual stream)
//   gamma    cols          the weight
//   y        rows × cols   the output
//   residual_out rows × cols  required exactly when residual is given (else ignored); may not
//                          alias x or residual
//   rstd     rows          fp32, 1 / rms of each row of h: what backward() needs
// Throws std::invalid_argument for negative sizes, eps <= 0, a missing pointer, or residual_out
// aliasing x or residual, or sizes over kMaxExtent.
void forward(const bf16* x, const bf16* residual, const bf16* gamma, bf16* y, bf16* residual_out,
             float* rstd, int rows, int cols, float eps, cudaStream_t stream = nullptr);

// forward()'s argument checks (given, not part of the exercise: the stub and the reference call
// the same ones). Throws as said above; returns false when there is nothing to do (rows or cols
// 0), for the caller to return.
[[nodiscard]] inline bool check_forward_args(const bf16* x, const bf16* residual,
                                             const bf16* gamma, const bf16* y,
                                             const bf16* residual_out, const float* rstd, int rows,
                                             int cols, float eps) {
  K2C_CHECK(rows >= 0 && cols >= 0, "rmsnorm forward: negative size " << rows << " x " << cols);
  K2C_CHECK(eps > 0, "rmsnorm forward: eps must be > 0, got " << eps);
  if (rows == 0 || cols == 0) return false;
  K2C_CHECK(x && gamma && y && rstd && (residual == nullptr || residual_out != nullptr),
            "rmsnorm forward: missing pointer (x, gamma, y and rstd are required, and residual_out "
            "when residual is given)");
  K2C_CHECK(residual == nullptr || (residual_out != x && residual_out != residual),
            "rmsnorm forward: residual_out may not alias x or residual");
  K2C_CHECK(rows <= kMaxExtent && cols <= kMaxExtent, "rmsnorm forward: at most "
                                                           << kMaxExtent << " rows and columns, got "
                                                           << rows << " x " << cols);
  return true;
}

// Backward of y = h · rstd · gamma for upstream gradient dy, given the h that forward normalised
// (x, or residual_out when the add was fused) and the rstd it saved:
//   dx_j      = rstd · (gamma_j · dy_j − h_j · rstd² · mean_k(dy_k · gamma_k · h_k))   bf16
//   dgamma_j  = sum over rows of dy_j · h_j · rstd                                  fp32
// dgamma sums over all rows; it is written (not accumulated into), so rows == 0 gives zeros (and
// then only dgamma is used: the other pointers may be null). `workspace` is device memory of at
// least backward_workspace_bytes(rows, cols) bytes, 16-byte aligned (as cudaMalloc returns), for
// the partial sums of dgamma: the rows are shared out over many blocks, and each block's partial
// sums must meet somewhere without thousands of atomics on the same cols addresses.
// Throws std::invalid_argument for negative sizes, sizes over kMaxExtent, a missing pointer or a
// misaligned workspace.
std::size_t backward_workspace_bytes(int rows, int cols);
void backward(const bf16* h, const bf16* gamma, const bf16* dy, const float* rstd, bf16* dx,
              float* dgamma, void* workspace, int rows, int cols, cudaStream_t stream = nullptr);

}  // namespace k2c::rmsnorm
