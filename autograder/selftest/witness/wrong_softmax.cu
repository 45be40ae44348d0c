// A fast softmax that is wrong (every output 1/cols, whatever the logits), whose report is
// forged to say every test passed: the grader's own run of it checks the output itself.
#include "softmax.h"

// (witness_test.sh puts forger.inc in front of this file: a submission is the one file.)

namespace k2c::softmax {
namespace {
template <class T>
__global__ void uniform(T* y, long n, float value) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n; i += static_cast<long>(gridDim.x) * blockDim.x)
    y[i] = static_cast<T>(value);
}
template <class T>
void launch(const T* x, T* y, int rows, int cols, cudaStream_t stream) {
  if (!check_args(x, y, rows, cols)) return;
  uniform<<<1024, 256, 0, stream>>>(y, static_cast<long>(rows) * cols, 1.0f / cols);
}
}  // namespace
void softmax(Version, const float* x, float* y, int rows, int cols, cudaStream_t stream) { launch(x, y, rows, cols, stream); }
void softmax(Version, const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
  launch(x, y, rows, cols, stream);
}
}  // namespace k2c::softmax
