// k2c/model/cuda_ops.h — the GPU backend of the model library (library k2c_model_cuda, built
// where the CUDA toolkit is): every operation of ops.h on the current device. First version:
// fp32 storage, cuBLAS GEMMs, one plain kernel per other operation (src/cuda_ops.cu says what
// the fast path will change). Agreement with the CPU backend is within rounding, not in bits.
#pragma once

#include "k2c/model/ops.h"

namespace k2c::model {

// Whether this process sees a CUDA device (tests skip without one).
bool cuda_device_present();
// The process's GPU backend, made on first use (throws k2c::Error when no device is present).
Ops& cuda_ops();

}  // namespace k2c::model
