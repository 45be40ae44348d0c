// k2c/model/cuda_ops.h — the GPU backend of the model library (library k2c_model_cuda, built
// where the CUDA toolkit is): every operation of ops.h on the current device, tensors in fp32
// (and activations in bf16 where a layer stores them so). Two kinds of math (src/cuda_ops.cu
// says more):
//   GpuMath::bf16  the fast path: GEMM operands rounded to bf16 for the tensor cores (fp32
//                  accumulation; results in the output's dtype), attention as blocked
//                  tensor-core GEMMs;
//   GpuMath::fp32  every product in fp32 and plain kernels: the tight reference for tests.
// Agreement with the CPU backend is within rounding (bf16's for the fast path), not in bits.
#pragma once

#include <memory>

#include "k2c/model/ops.h"
#include "k2c/model/timed_ops.h"

namespace k2c::model {

enum class GpuMath { fp32, bf16 };

// Whether this process sees a CUDA device (tests skip without one).
bool cuda_device_present();
// The process's GPU backend of that math, made on first use (throws k2c::Error when no device
// is present).
Ops& cuda_ops(GpuMath math = GpuMath::bf16);
// Issues every later operation of both GPU backends to `stream` (a cudaStream_t; nullptr: the
// legacy default stream) — for instance a communicator's compute stream, so that collectives
// ordered against that stream see the model's results. Waits for the old stream first. The
// backends reuse a freed tensor's memory in stream order: a tensor handed to a started
// collective must live until that collective's wait().
void cuda_ops_use_stream(void* stream);
// The stream the GPU backends issue to now: where a caller's own kernels go to stay in their order
// (the course kernels of k2c_capstone's course mode).
void* cuda_ops_stream();
// Waits for everything issued to that stream (for timing one operation alone).
void cuda_ops_synchronize();
// Marks for TimedOps' in-step timing: CUDA events recorded on the backends' stream at the time
// of each mark (a pool, reused after reset()).
std::unique_ptr<QueueMarks> cuda_queue_marks();

}  // namespace k2c::model
