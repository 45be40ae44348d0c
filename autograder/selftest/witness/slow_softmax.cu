// A correct softmax at a crawl (one thread per row, three passes), whose report is forged to
// claim 95% of the copy rate: the grader's own run of it sees the crawl.
#include <cmath>

#include "softmax.h"

// (witness_test.sh puts forger.inc in front of this file: a submission is the one file.)

namespace k2c::softmax {
namespace {
template <class T>
__global__ void per_row(const T* x, T* y, int rows, int cols) {
  const long r = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const T* in = x + r * cols;
  float m = -INFINITY, s = 0;
  for (int c = 0; c < cols; ++c) m = fmaxf(m, static_cast<float>(in[c]));
  for (int c = 0; c < cols; ++c) s += __expf(static_cast<float>(in[c]) - m);
  for (int c = 0; c < cols; ++c) y[r * cols + c] = static_cast<T>(__expf(static_cast<float>(in[c]) - m) / s);
}
template <class T>
void launch(const T* x, T* y, int rows, int cols, cudaStream_t stream) {
  if (!check_args(x, y, rows, cols)) return;
  per_row<<<(rows + 127) / 128, 128, 0, stream>>>(x, y, rows, cols);
}
}  // namespace
void softmax(Version, const float* x, float* y, int rows, int cols, cudaStream_t stream) { launch(x, y, rows, cols, stream); }
void softmax(Version, const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
  launch(x, y, rows, cols, stream);
}
}  // namespace k2c::softmax
