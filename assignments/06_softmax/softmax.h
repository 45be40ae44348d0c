// assignments/06_softmax/softmax.h — the contract of module 06 (do not edit).
//
// Row softmax, the operator at the heart of attention: for every row r of a rows × cols
// row-major matrix x,
//
//   y[r][c] = exp(x[r][c] - m_r) / sum_j exp(x[r][j] - m_r),   m_r = max_j x[r][j].
//
// Subtracting the row maximum changes nothing mathematically and keeps every exp() in [0, 1]:
// without it a logit of 100 overflows fp32's exp. Inputs and outputs are fp32 or bf16; the
// arithmetic is fp32 in both cases.
//
// You write the same function three times, each version the lecture's next step:
//   three_pass  one pass for the maximum, one for the sum, one to normalise: x is read 3 times
//   online      the maximum and the sum in one pass (the online rescaling trick), then normalise
//   fast        whatever reaches the memory bandwidth: the row kept in registers, vector loads,
//               warp-shuffle reductions, a warp or less per short row, a block per long row
//
// Tests: autograder/06_softmax/test_softmax.cu. Lecture: lectures/06_softmax.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c::softmax {

// The largest rows or cols accepted: indices are int, with room for a block's overhang.
inline constexpr int kMaxExtent = 2147483647 - 8192;

enum class Version { three_pass, online, fast };
inline constexpr Version kVersions[] = {Version::three_pass, Version::online, Version::fast};
inline const char* name(Version v) {
  return v == Version::three_pass ? "three_pass" : v == Version::online ? "online" : "fast";
}

// y = softmax(x) along each row, on `stream`, asynchronously. x and y are device pointers to
// rows × cols elements that do not overlap; rows, cols >= 0 (nothing happens when either is 0);
// any cols, including 1 and odd lengths (a row then starts at an address that is not a multiple
// of 16 bytes). Rows of x may hold any finite values. Throws std::invalid_argument for negative
// sizes, sizes over kMaxExtent, or null pointers when rows·cols > 0.
void softmax(Version v, const float* x, float* y, int rows, int cols, cudaStream_t stream = nullptr);
void softmax(Version v, const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols,
             cudaStream_t stream = nullptr);

// The argument checks of softmax() (given, not part of the exercise: the stub and the reference
// call the same ones). Throws std::invalid_argument, with the values, for what the comment above
// rules out; returns false when there is nothing to do (rows or cols 0), for the caller to return.
[[nodiscard]] inline bool check_args(const void* x, const void* y, int rows, int cols) {
  K2C_CHECK(rows >= 0 && cols >= 0, "softmax: negative size " << rows << " x " << cols);
  if (rows == 0 || cols == 0) return false;
  K2C_CHECK(x != nullptr && y != nullptr, "softmax: null pointer for " << rows << " x " << cols);
  K2C_CHECK(rows <= kMaxExtent && cols <= kMaxExtent,
            "softmax: at most " << kMaxExtent << " rows and columns, got " << rows << " x " << cols);
  return true;
}

}  // namespace k2c::softmax
