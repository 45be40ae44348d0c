// k2c/reference/moe_baseline.h — the naive MoE layer that module 10's layer is measured against.
//
// It is written the way a first version usually is, and kept here, trusted, because a handout
// has no solutions/: the router unfused (a cuBLAS GEMM for the logits, a softmax kernel, a top-k
// kernel), then a host loop over the experts that for each one scans every choice for its tokens,
// copies the count to the host (a synchronisation), gathers the rows, runs W1, W3 and W2 as three
// cuBLAS calls, and scatter-adds the weighted result with atomics; the backward pass loops the
// same way. The GEMMs are cuBLAS's, so the gap to module 10's layer is launches, synchronisation,
// unfused passes over memory, and small per-expert GEMMs that leave SMs idle.
//
// Scope: softmax scores without renormalisation, no groups, no bias, no capacity, weights laid
// out as in module 10's contract (moe.h). step() runs forward then backward on the stream 0.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_bf16.h>

namespace k2c::baseline {

struct MoeProblem {
  int tokens, hidden, ffn, shared_ffn, experts, top_k;
  const __nv_bfloat16 *x, *dy, *w_router, *w13, *w2, *shared_w13, *shared_w2;
};

// Tokens per expert when each of `tokens` tokens picks `top_k` distinct experts, uniformly or
// (skewed) with weight 1 / (e + 1): the loads of module 10's speed tests and benchmarks.
std::vector<int> expert_loads(int tokens, int experts, int top_k, bool skewed, std::uint64_t seed);

class NaiveMoe {
 public:
  explicit NaiveMoe(const MoeProblem& p);
  ~NaiveMoe();
  NaiveMoe(const NaiveMoe&) = delete;
  NaiveMoe& operator=(const NaiveMoe&) = delete;

  void step();                   // forward + backward
  std::vector<float> y() const;  // the last step's output and input gradient, on the host
  std::vector<float> dx() const;
  std::vector<int> expert() const;  // the last step's choices, [tokens][top_k]
  // The last step's weight gradients (fp32, on the device, overwritten by each step), in the
  // order of module 10's moe::Grads: router, w13, w2, shared w13, shared w2.
  std::array<const float*, 5> weight_grads() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace k2c::baseline
