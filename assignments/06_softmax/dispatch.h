// assignments/06_softmax/dispatch.h — the given end of softmax.cu: the contract's two softmax()
// overloads (fp32 and bf16), each calling the .cu's run<T>(v, x, y, rows, cols, stream), the one
// template that serves both element types. Included once, at the end of softmax.cu (the stub's and
// the reference's alike), after run<T> is defined in the .cu's unnamed namespace; not a file to
// edit or submit.
#pragma once

#include <cuda_bf16.h>

#include "softmax.h"

namespace k2c::softmax {

void softmax(Version v, const float* x, float* y, int rows, int cols, cudaStream_t stream) {
  run(v, x, y, rows, cols, stream);
}
void softmax(Version v, const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols,
             cudaStream_t stream) {
  run(v, x, y, rows, cols, stream);
}

}  // namespace k2c::softmax
