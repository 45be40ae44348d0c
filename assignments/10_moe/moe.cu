// assignments/10_moe/moe.cu — module 10: your implementation (contract: moe.h).
//
// Read lectures/10_moe.md first. Suggested order: route and balance_loss (task 1), dispatch,
// permute and combine (task 2), grouped_gemm and grouped_weight_grad (task 3), then the layer's
// forward and backward from those parts (task 4). k2c/device/tensor_core.cuh holds module 05's
// wrappers for cp.async, ldmatrix (plain and transposing) and mma.sync: build the grouped GEMM on
// them. The argument checks are given; keep them at the top of each function.
#include <cstddef>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/todo.h"
#include "k2c/device/hopper.cuh"
#include "k2c/device/tensor_core.cuh"
#include "moe.h"

namespace k2c::moe {

void route(const RouterConfig& c, int tokens, const float* logits, const float* bias, float* scores, int* expert,
           float* weight, cudaStream_t stream) {
  if (!check_route(c, tokens, logits, bias, scores, expert, weight, "moe route")) return;
  (void)stream;
  K2C_TODO("route: a warp per token; scores, the group filter, top-k by repeated arg-max (ties to the lower "
           "index), then the weights");
}

std::size_t balance_workspace_bytes(int experts) {
  K2C_CHECK(experts >= 1 && experts <= kMaxExperts, "moe balance_workspace_bytes: bad expert count " << experts);
  K2C_TODO("balance_workspace_bytes: room for a count per expert");
}

void balance_loss(int tokens, int experts, int top_k, float alpha, const float* logits, const int* expert, float* loss,
                  float* dlogits, void* workspace, cudaStream_t stream) {
  check_balance(tokens, experts, top_k, logits, expert, loss, dlogits, workspace, "moe balance_loss");
  (void)alpha, (void)stream;
  K2C_TODO("balance_loss: count the choices per expert, then per token p = softmax(z), its share of the loss and "
           "dz = p ∘ (g − p·g)");
}

std::size_t dispatch_workspace_bytes(int tokens, int experts, int top_k) {
  K2C_CHECK(experts >= 1 && experts <= kMaxExperts, "moe dispatch_workspace_bytes: experts must be in 1.." << kMaxExperts);
  check_choices(tokens, top_k, "moe dispatch_workspace_bytes");
  K2C_TODO("dispatch_workspace_bytes: whatever your counting sort needs");
}

void dispatch(int tokens, int experts, int top_k, int capacity, const int* expert, int* counts, int* offsets,
              int* slot, int* source, void* workspace, cudaStream_t stream) {
  K2C_CHECK(experts >= 1 && experts <= kMaxExperts, "moe dispatch: experts must be in 1.." << kMaxExperts);
  check_choices(tokens, top_k, "moe dispatch");
  check_pointers("moe dispatch", {counts, offsets});
  if (static_cast<long long>(tokens) * top_k > 0) check_pointers("moe dispatch", {expert, slot, source, workspace});
  (void)capacity, (void)stream;
  K2C_TODO("dispatch: a stable counting sort of the choices by expert (no atomics deciding the order), with the "
           "capacity applied to each expert's first choices");
}

void permute(int tokens, int hidden, int top_k, const bf16* x, const int* slot, bf16* rows, cudaStream_t stream) {
  if (!check_permute(tokens, hidden, top_k, x, slot, rows, "moe permute")) return;
  (void)stream;
  K2C_TODO("permute: copy each kept choice's token row to its slot, 16 bytes at a time");
}

void combine(int tokens, int hidden, int top_k, const bf16* rows, const int* slot, const float* weight,
             const float* residual, bf16* y, cudaStream_t stream) {
  if (!check_combine(tokens, hidden, top_k, rows, slot, weight, residual, y, "moe combine")) return;
  (void)stream;
  K2C_TODO("combine: gather each token's kept rows, weighted, onto the residual, in fp32");
}

void grouped_gemm(int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, bf16* c,
                  bool b_transposed, bool accumulate, cudaStream_t stream) {
  check_grouped(groups, n, k, {offsets, a, b, c}, "moe grouped_gemm");
  (void)b_transposed, (void)accumulate, (void)stream;
  K2C_TODO("grouped_gemm (bf16 C): one persistent launch over the tiles of every group, the group sizes read "
           "on the device");
}

void grouped_gemm(int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, float* c,
                  bool b_transposed, bool accumulate, cudaStream_t stream) {
  check_grouped(groups, n, k, {offsets, a, b, c}, "moe grouped_gemm");
  (void)b_transposed, (void)accumulate, (void)stream;
  K2C_TODO("grouped_gemm (fp32 C): the same kernel with an fp32 epilogue");
}

void grouped_weight_grad(int groups, const int* offsets, int n, int k, const bf16* dy, const bf16* x, float* dw,
                         cudaStream_t stream) {
  check_grouped(groups, n, k, {offsets, dy, x, dw}, "moe grouped_weight_grad");
  (void)stream;
  K2C_TODO("grouped_weight_grad: dW_g = dY_gᵀ X_g, each group summing over its own rows (both operands read "
           "with ldmatrix.trans); zeros for an empty group");
}

// Part B (bonus). This file is compiled for sm_90a where the build targets sm_90: wgmma, TMA and
// setmaxnreg are then available inside `#if defined(__CUDA_ARCH_FEAT_SM90_ALL)`
// (k2c/device/hopper.cuh wraps them; module 05's Part B is the model). Given: hopper_supported()
// and the checks.
bool hopper_supported(std::string* why_not) { return k2c::hopper::sm90a_supported(why_not); }

void grouped_gemm_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* a, const bf16* b,
                         bf16* c, bool b_transposed, cudaStream_t stream) {
  check_grouped_hopper(groups, offsets, rows, n, k, a, b, c, b_transposed, "moe grouped_gemm_hopper");
  k2c::hopper::require_sm90a("moe grouped_gemm_hopper");
  (void)stream;
  K2C_TODO("grouped_gemm_hopper: module 05's warp-specialised wgmma GEMM with TMA, its persistent schedule "
           "walking the tiles of every group; with b_transposed = false, B in 64 × 64 MN-major boxes");
}

void grouped_weight_grad_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* dy, const bf16* x,
                                float* dw, cudaStream_t stream) {
  check_weight_grad_hopper(groups, offsets, rows, n, k, dy, x, dw, "moe grouped_weight_grad_hopper");
  k2c::hopper::require_sm90a("moe grouped_weight_grad_hopper");
  (void)stream;
  K2C_TODO("grouped_weight_grad_hopper: both operands MN-major, each group summing over its own rows (clear the "
           "rows past a group's end before the last step's wgmma reads them)");
}

std::size_t forward_workspace_bytes(const Layer& l, int tokens) {
  check_layer(l, tokens, "moe forward_workspace_bytes");
  K2C_TODO("forward_workspace_bytes: what forward() keeps for backward()");
}

void forward(const Layer& l, int tokens, const bf16* x, bf16* y, const Routing& r, void* saved, cudaStream_t stream) {
  check_layer(l, tokens, "moe forward");
  if (tokens == 0) return;
  check_pointers("moe forward", {x, y, r.logits, r.scores, r.expert, r.weight, r.counts, saved});
  (void)stream;
  K2C_TODO("forward: logits, route, dispatch, permute, the experts' grouped GEMMs and SwiGLU, the shared experts, "
           "combine");
}

std::size_t backward_workspace_bytes(const Layer& l, int tokens) {
  check_layer(l, tokens, "moe backward_workspace_bytes");
  K2C_TODO("backward_workspace_bytes: the gradients of every intermediate");
}

void backward(const Layer& l, int tokens, const bf16* x, const bf16* dy, const Routing& r, const void* saved,
              const float* dlogits_extra, bf16* dx, const Grads& g, void* workspace, cudaStream_t stream) {
  check_layer(l, tokens, "moe backward");
  check_pointers("moe backward", {g.w_router, g.w13, g.w2});
  if (l.shared_ffn > 0) check_pointers("moe backward", {g.shared_w13, g.shared_w2});
  if (tokens > 0) check_pointers("moe backward", {x, dy, r.scores, r.expert, r.weight, saved, dx, workspace});
  if (dlogits_extra) check_pointers("moe backward", {dlogits_extra});
  (void)stream;
  K2C_TODO("backward: combine's backward, each grouped GEMM's dX and dW, SwiGLU's backward, the router's backward, "
           "and dx gathered from every path");
}

}  // namespace k2c::moe
