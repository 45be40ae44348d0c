// k2c/model/backend.h — backend_for: the backend a program of Part II computes on, chosen by
// where its run keeps tensors.
//
// A distributed program's tensors must be memory its communicator can move: host memory on MPI
// (the CPU backend's), device memory on NCCL (the GPU backend's). So the run decides the model
// library's backend. On the GPU the model's kernels go to the communicator's compute stream, so
// that a collective issued after them sees their results, and vice versa. The programs of modules
// 12–17 and 19 choose through it.
//
// Header-only: whether the GPU backend is there to choose is K2C_MODEL_CUDA, which the build sets
// to 1 for a program that links k2c_model_cuda (cmake/K2CModule.cmake). A test includes this
// header for that macro too, and calls backend_if_built, which lets it skip with its reason where
// a program would throw.
#pragma once

#include <stdexcept>

#include "k2c/model/cuda_ops.h"  // GpuMath; the functions are called only where the library is linked
#include "k2c/model/ops.h"

#ifndef K2C_MODEL_CUDA
#define K2C_MODEL_CUDA 0
#endif

namespace k2c::model {

// The CPU backend; with `gpu`, the GPU backend in `math`, issuing all later work to `stream` (a
// communicator's compute_stream()). Throws std::runtime_error for `gpu` in a program built
// without the GPU backend.
inline Ops& backend_for(bool gpu, void* stream, GpuMath math = GpuMath::bf16) {
  if (!gpu) return cpu_ops();
#if K2C_MODEL_CUDA
  cuda_ops_use_stream(stream);
  return cuda_ops(math);
#else
  (void)stream;
  (void)math;
  throw std::runtime_error(
      "a NCCL run computes on the model library's GPU backend (k2c_model_cuda), which this program was built "
      "without: build with the CUDA toolkit, or run on MPI (K2C_BACKEND=mpi)");
#endif
}

// backend_for's choice, or null where that is the GPU backend and this program was built without
// it: the tests' form, since a test skips there (saying so) where a program fails.
inline Ops* backend_if_built(bool gpu, void* stream, GpuMath math = GpuMath::bf16) {
  if (gpu && !K2C_MODEL_CUDA) return nullptr;
  return &backend_for(gpu, stream, math);
}

}  // namespace k2c::model
