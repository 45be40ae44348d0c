// course_kernels.h — the course kernels of k2c_capstone's course mode: modules 05 (GEMM), 07
// (RMSNorm), 08 (RoPE), 09 (FlashAttention) and 10 (the experts' grouped GEMMs) of the tree the
// program was built from, behind the model's operations (k2c/model/course_ops.h checks them and
// says which ran).
//
// The model keeps its tensors in fp32 and the modules' contracts take bf16 (and their own layouts:
// 09's heads before tokens, 05's two K-major operands), so each adapter converts its inputs on the
// way in and its outputs on the way out, on the GPU backend's stream. Those conversions are the
// price of course mode on a model that stores fp32; the table of the run shows what each kernel
// bought. Their buffers are the adapters' own, outside the model's memory ledger.
//
// The Linear layers' weight gradients run on 10's Hopper weight-gradient GEMM (the layer's tokens
// as one group, or split into several for a thin weight) where both 10's and 05's Hopper parts run
// and CourseOptions::weight_grads_on_10 is on: it reads dY and X as they stand, where 05 needs both
// transposed. Every other product runs on 05's GEMM.
//
// Where a module's Hopper part (05's matmul_hopper, 09's forward_hopper and backward_hopper, 10's
// grouped_gemm_hopper and grouped_weight_grad_hopper) runs here and is implemented, it is the one
// used, at the shapes its contract takes; otherwise its Part A. A Hopper part that throws or
// disagrees with the trusted backend gives way to its Part A, which is then checked in turn (the
// GEMM row first gives up 10's weight gradients, then 05's Hopper part); one
// that faults on the GPU in its probe ends the run, naming it (a fault is sticky). Built only
// where CUDA and modules 05–10 are (K2C_COURSE_KERNELS).
#pragma once

#include <functional>

#include "k2c/model/course_ops.h"

namespace k2c::capstone {

struct CourseOptions {
  // The Linear layers' weight gradients on 10's Hopper weight-gradient GEMM where it and 05's Hopper
  // part run (it reads dY and X as they stand), else on 05's with both operands transposed by a
  // pass. Off: 05 alone (the tests run both paths).
  bool weight_grads_on_10 = true;
  // Called with the number of groups each time a weight gradient runs on 10 (tests: which path
  // ran, and how it split the tokens).
  std::function<void(int groups)> on_weight_grad_groups;
  // 09's attention given the model's q, k, v and o as they stand (09's tokens_first layout), where
  // the part in use takes that layout, else through copies in its heads_first layout. Off: the
  // copies from the start (the tests run both paths).
  bool attention_tokens_first = true;
};

model::CourseKernels course_kernels(const CourseOptions& options = {});

// Whether a module's Hopper part runs here and is implemented (`supported`, then `call`, one tiny
// call of it on the GPU backend's stream, does not throw), so that a student who has not done the
// bonus still gets their Part A. A call that faults on the GPU throws std::runtime_error naming
// `part`: the fault is sticky, so no fallback could run after it.
bool probe_part(bool supported, const char* part, const std::function<void()>& call);

}  // namespace k2c::capstone
