// solutions/10_moe/moe.cu — module 10: the reference MoE layer (contract: moe.h; lecture:
// lectures/10_moe.md).
//
// The forward pass, in launches:
//   1. logits = x W_rᵀ                 grouped GEMM with one group, fp32 out
//   2. route                           a warp per token: scores, group filter, top-k, weights
//   3. dispatch                        histogram per chunk → scan → scatter: deterministic slots
//   4. permute                         token rows copied into expert order
//   5. [g|u] = x_e W13_eᵀ              grouped GEMM over all experts, one launch
//   6. h = silu(g) ∘ u                 elementwise
//   7. out_e = h_e W2_eᵀ               grouped GEMM
//   8. shared experts                  the same three steps as one dense SwiGLU (one group)
//   9. combine                         y_t = shared_t + Σ_j w_tj · out[slot_tj], gathered per token
// The backward pass runs the same steps in reverse; each grouped GEMM has two gradients, dX (the
// same kernel, B read the other way) and dW (a grouped sum over each expert's rows).
//
// The grouped GEMM is module 05's mma.sync kernel taught to do three things more:
//   groups      the launch is persistent (one block per SM) and walks a list of tiles that
//               spans every group; each block prefix-sums the group sizes from device memory
//               (offsets, as dispatch wrote them) into shared memory and finds a tile's group by
//               binary search. No count ever travels to the host, so the whole layer is
//               asynchronous, and no SM idles at the end of one expert while another waits.
//   layouts     an operand tile is either "K-contiguous" (rows of 64 reduction elements, the
//               forward pass) or "MN-contiguous" (64 reduction rows of the tile's width: W read
//               untransposed for dX, and both dY and X for dW). The latter is read with
//               ldmatrix.trans, which transposes each 8×8 piece on its way into registers.
//   ragged K    for dW the groups split the reduction, not the rows: group g sums over its own
//               rows, zero-filled past its end, and a group with no rows writes zeros.
//
// The kernels are in four parts beside this file, included below in this order; this file keeps
// what surrounds them (the workspace carver they share, the contract's entry points, the layer):
//   moe_routing.cuh       the router and dispatch: steps 2 and 3, and the balance loss
//   moe_permute.cuh       permute, combine, SwiGLU (steps 4, 6, 9), their and the router's backward
//   moe_grouped_gemm.cuh  the grouped GEMM on mma.sync: steps 1, 5, 7 and 8, and every gradient
//   moe_hopper.cuh        Part B: the grouped GEMM on wgmma, with its entry points
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/device/hopper.cuh"
#include "../shared/mma_tile.cuh"
#include "k2c/device/tensor_core.cuh"
#include "moe.h"

namespace k2c::moe {
namespace {

using tc::ceil_div;
using tc::smem_addr;

constexpr unsigned kFull = 0xffffffffu;

std::size_t align256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// Carves consecutive 256-byte-aligned arrays out of one workspace; with a null base it only
// counts, which is how the *_workspace_bytes functions and the passes agree on one layout.
class Carve {
 public:
  explicit Carve(void* base) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(std::size_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += align256(count * sizeof(T));
    return p;
  }
  std::size_t used() const { return used_; }

 private:
  char* base_;
  std::size_t used_ = 0;
};

#include "moe_routing.cuh"
#include "moe_permute.cuh"
#include "moe_grouped_gemm.cuh"

}  // namespace

// ================================================================================================
// The contract's entry points
// ================================================================================================

void route(const RouterConfig& c, int tokens, const float* logits, const float* bias, float* scores, int* expert,
           float* weight, cudaStream_t stream) {
  if (!check_route(c, tokens, logits, bias, scores, expert, weight, "moe route")) return;
  route_kernel<<<ceil_div(tokens, kRouteWarps), 32 * kRouteWarps, 0, stream>>>(c, tokens, logits, bias, scores,
                                                                                  expert, weight);
  K2C_CUDA_CHECK_LAUNCH();
}

std::size_t balance_workspace_bytes(int experts) {
  K2C_CHECK(experts >= 1 && experts <= kMaxExperts, "moe balance_workspace_bytes: bad expert count " << experts);
  return align256(experts * sizeof(int));
}

void balance_loss(int tokens, int experts, int top_k, float alpha, const float* logits, const int* expert, float* loss,
                  float* dlogits, void* workspace, cudaStream_t stream) {
  check_balance(tokens, experts, top_k, logits, expert, loss, dlogits, workspace, "moe balance_loss");
  int* counts = static_cast<int*>(workspace);
  K2C_CUDA_CHECK(cudaMemsetAsync(counts, 0, experts * sizeof(int), stream));
  K2C_CUDA_CHECK(cudaMemsetAsync(loss, 0, sizeof(float), stream));
  const long long choices = static_cast<long long>(tokens) * top_k;
  count_kernel<<<static_cast<unsigned>(std::min<long long>((choices + 255) / 256, 4096)), 256, 0, stream>>>(
      choices, experts, expert, counts);
  const float c = alpha * experts / (static_cast<float>(top_k) * tokens * static_cast<float>(tokens));
  balance_kernel<<<ceil_div(tokens, 8), 256, 0, stream>>>(tokens, experts, c, logits, counts, loss, dlogits);
  K2C_CUDA_CHECK_LAUNCH();
}

namespace {
struct DispatchSpace {
  int *rank, *chunk_counts;
};
DispatchSpace carve_dispatch(Carve& w, long long choices, int experts) {
  const long long chunks = (choices + kChunk - 1) / kChunk;
  return {w.take<int>(choices), w.take<int>(chunks * experts)};
}
}  // namespace

std::size_t dispatch_workspace_bytes(int tokens, int experts, int top_k) {
  K2C_CHECK(experts >= 1 && experts <= kMaxExperts, "moe dispatch_workspace_bytes: experts must be in 1.." << kMaxExperts);
  check_choices(tokens, top_k, "moe dispatch_workspace_bytes");
  Carve w(nullptr);
  carve_dispatch(w, static_cast<long long>(tokens) * top_k, experts);
  return w.used();
}

void dispatch(int tokens, int experts, int top_k, int capacity, const int* expert, int* counts, int* offsets,
              int* slot, int* source, void* workspace, cudaStream_t stream) {
  K2C_CHECK(experts >= 1 && experts <= kMaxExperts, "moe dispatch: experts must be in 1.." << kMaxExperts);
  check_choices(tokens, top_k, "moe dispatch");
  check_pointers("moe dispatch", {counts, offsets});
  const long long choices = static_cast<long long>(tokens) * top_k;
  if (choices > 0) check_pointers("moe dispatch", {expert, slot, source, workspace});
  Carve w(workspace);
  const DispatchSpace d = carve_dispatch(w, choices, experts);
  const long long chunks = (choices + kChunk - 1) / kChunk;
  K2C_CHECK(chunks <= 0x7fffffff, "moe dispatch: too many choices");
  if (chunks > 0) {
    chunk_rank_kernel<<<static_cast<int>(chunks), kChunk, kChunkWarps * experts * sizeof(int), stream>>>(
        choices, experts, expert, d.rank, d.chunk_counts);
    K2C_CUDA_CHECK_LAUNCH();
  }
  scan_kernel<<<1, kMaxExperts, 0, stream>>>(static_cast<int>(chunks), experts, capacity, d.chunk_counts, counts,
                                              offsets);
  K2C_CUDA_CHECK_LAUNCH();
  if (chunks > 0) {
    scatter_kernel<<<static_cast<int>(std::min<long long>(chunks, 8192)), kChunk, 0, stream>>>(
        choices, experts, top_k, capacity, expert, d.rank, d.chunk_counts, offsets, slot, source);
    K2C_CUDA_CHECK_LAUNCH();
  }
}

void permute(int tokens, int hidden, int top_k, const bf16* x, const int* slot, bf16* rows, cudaStream_t stream) {
  if (!check_permute(tokens, hidden, top_k, x, slot, rows, "moe permute")) return;
  const long long choices = static_cast<long long>(tokens) * top_k;
  permute_kernel<<<static_cast<unsigned>((choices + 7) / 8), 256, 0, stream>>>(
      choices, hidden, top_k, reinterpret_cast<const Pack8*>(x), slot, reinterpret_cast<Pack8*>(rows));
  K2C_CUDA_CHECK_LAUNCH();
}

void combine(int tokens, int hidden, int top_k, const bf16* rows, const int* slot, const float* weight,
             const float* residual, bf16* y, cudaStream_t stream) {
  if (!check_combine(tokens, hidden, top_k, rows, slot, weight, residual, y, "moe combine")) return;
  combine_kernel<<<tokens, std::min(256, std::max(32, hidden / 8 / 32 * 32)), 0, stream>>>(
      hidden, top_k, reinterpret_cast<const Pack8*>(rows), slot, weight, residual, reinterpret_cast<Pack8*>(y));
  K2C_CUDA_CHECK_LAUNCH();
}

void grouped_gemm(int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, bf16* c,
                  bool b_transposed, bool accumulate, cudaStream_t stream) {
  run_grouped("moe grouped_gemm", groups, offsets, n, k, a, b, c, b_transposed, accumulate, stream);
}
void grouped_gemm(int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, float* c,
                  bool b_transposed, bool accumulate, cudaStream_t stream) {
  run_grouped("moe grouped_gemm", groups, offsets, n, k, a, b, c, b_transposed, accumulate, stream);
}

void grouped_weight_grad(int groups, const int* offsets, int n, int k, const bf16* dy, const bf16* x, float* dw,
                         cudaStream_t stream) {
  const char* who = "moe grouped_weight_grad";
  check_grouped(groups, n, k, {offsets, dy, x, dw}, who);
  const bool vec = n % 8 == 0 && k % 8 == 0 && aligned16(dy) && aligned16(x);
  const bool pairs = k % 2 == 0 && reinterpret_cast<std::uintptr_t>(dw) % 8 == 0;
  // In GEMM terms C[m][n] with m = dY's width and n = X's width.
  const GemmArgs<float> args{groups, offsets, n, k, 0, dy, x, dw, false, pairs};
  if (vec) launch_gemm<Mode::reduction, false, false, true>(args, stream);
  else launch_gemm<Mode::reduction, false, false, false>(args, stream);
}

#include "moe_hopper.cuh"

// ================================================================================================
// The layer
// ================================================================================================

namespace {

// The forward pass's saved state, in one workspace: the backward pass carves the same layout.
struct Saved {
  int *offsets, *slot, *source, *one_group;
  void* dispatch_space;
  bf16 *xp, *gu, *h, *out, *shared_gu, *shared_h;
  float* shared_y;
};
Saved carve_saved(Carve& w, const Layer& l, int tokens) {
  const long long choices = static_cast<long long>(tokens) * l.router.top_k;
  Saved s{};
  s.offsets = w.take<int>(l.router.experts + 1);
  s.slot = w.take<int>(choices);
  s.source = w.take<int>(choices);
  s.one_group = w.take<int>(2);
  s.dispatch_space = w.take<char>(dispatch_workspace_bytes(tokens, l.router.experts, l.router.top_k));
  s.xp = w.take<bf16>(choices * l.hidden);
  s.gu = w.take<bf16>(choices * 2 * l.ffn);
  s.h = w.take<bf16>(choices * l.ffn);
  s.out = w.take<bf16>(choices * l.hidden);
  s.shared_gu = w.take<bf16>(static_cast<long long>(tokens) * 2 * l.shared_ffn);
  s.shared_h = w.take<bf16>(static_cast<long long>(tokens) * l.shared_ffn);
  s.shared_y = w.take<float>(static_cast<long long>(tokens) * l.hidden);
  return s;
}

struct BackwardSpace {
  bf16 *d_out, *dh, *dgu, *dxp, *dlogits, *shared_dh, *shared_dgu;
  float *dw, *dx;
};
BackwardSpace carve_backward(Carve& w, const Layer& l, int tokens) {
  const long long choices = static_cast<long long>(tokens) * l.router.top_k;
  BackwardSpace b{};
  b.d_out = w.take<bf16>(choices * l.hidden);
  b.dh = w.take<bf16>(choices * l.ffn);
  b.dgu = w.take<bf16>(choices * 2 * l.ffn);
  b.dxp = w.take<bf16>(choices * l.hidden);
  b.dlogits = w.take<bf16>(static_cast<long long>(tokens) * l.router.experts);
  b.shared_dh = w.take<bf16>(static_cast<long long>(tokens) * l.shared_ffn);
  b.shared_dgu = w.take<bf16>(static_cast<long long>(tokens) * 2 * l.shared_ffn);
  b.dw = w.take<float>(choices);
  b.dx = w.take<float>(static_cast<long long>(tokens) * l.hidden);
  return b;
}

unsigned elementwise_blocks(long long pieces) { return static_cast<unsigned>(std::min<long long>((pieces + 255) / 256, 65536)); }

void swiglu(long long rows, int ffn, const bf16* gu, bf16* h, cudaStream_t stream) {
  if (rows == 0) return;
  swiglu_kernel<<<elementwise_blocks(rows * ffn / 8), 256, 0, stream>>>(rows, ffn, reinterpret_cast<const Pack8*>(gu),
                                                                        reinterpret_cast<Pack8*>(h));
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::size_t forward_workspace_bytes(const Layer& l, int tokens) {
  check_layer(l, tokens, "moe forward_workspace_bytes");
  Carve w(nullptr);
  carve_saved(w, l, tokens);
  return w.used();
}

void forward(const Layer& l, int tokens, const bf16* x, bf16* y, const Routing& r, void* saved, cudaStream_t stream) {
  const char* who = "moe forward";
  check_layer(l, tokens, who);
  if (tokens == 0) return;
  check_pointers(who, {x, y, r.logits, r.scores, r.expert, r.weight, r.counts, saved});
  const int E = l.router.experts, k = l.router.top_k, d = l.hidden, f = l.ffn;
  Carve w(saved);
  const Saved s = carve_saved(w, l, tokens);
  one_group_kernel<<<1, 1, 0, stream>>>(s.one_group, tokens);
  K2C_CUDA_CHECK_LAUNCH();

  // Router and dispatch.
  grouped_gemm(1, s.one_group, E, d, x, l.w_router, r.logits, true, false, stream);
  route(l.router, tokens, r.logits, l.bias, r.scores, r.expert, r.weight, stream);
  dispatch(tokens, E, k, l.capacity, r.expert, r.counts, s.offsets, s.slot, s.source, s.dispatch_space, stream);
  permute(tokens, d, k, x, s.slot, s.xp, stream);

  // Routed experts: rows past offsets[E] are never read (the groups end there). The forward
  // GEMMs run on Part B's wgmma kernel where the build and device allow it.
  const long long choices = static_cast<long long>(tokens) * k;
  const bool wgmma = hopper_here();
  auto forward_gemm = [&](int groups, const int* offsets, long long rows, int n, int kk, const bf16* a, const bf16* b,
                          bf16* c) {
    if (wgmma) grouped_gemm_hopper(groups, offsets, static_cast<int>(rows), n, kk, a, b, c, true, stream);
    else grouped_gemm(groups, offsets, n, kk, a, b, c, true, false, stream);
  };
  forward_gemm(E, s.offsets, choices, 2 * f, d, s.xp, l.w13, s.gu);
  swiglu(choices, f, s.gu, s.h, stream);  // rows past the kept ones: harmless
  forward_gemm(E, s.offsets, choices, d, f, s.h, l.w2, s.out);

  // Shared experts, then the weighted gather.
  const float* residual = nullptr;
  if (l.shared_ffn > 0) {
    forward_gemm(1, s.one_group, tokens, 2 * l.shared_ffn, d, x, l.shared_w13, s.shared_gu);
    swiglu(tokens, l.shared_ffn, s.shared_gu, s.shared_h, stream);
    grouped_gemm(1, s.one_group, d, l.shared_ffn, s.shared_h, l.shared_w2, s.shared_y, true, false, stream);
    residual = s.shared_y;
  }
  combine(tokens, d, k, s.out, s.slot, r.weight, residual, y, stream);
}

std::size_t backward_workspace_bytes(const Layer& l, int tokens) {
  check_layer(l, tokens, "moe backward_workspace_bytes");
  Carve w(nullptr);
  carve_backward(w, l, tokens);
  return w.used();
}

void backward(const Layer& l, int tokens, const bf16* x, const bf16* dy, const Routing& r, const void* saved,
              const float* dlogits_extra, bf16* dx, const Grads& g, void* workspace, cudaStream_t stream) {
  const char* who = "moe backward";
  check_layer(l, tokens, who);
  check_pointers(who, {g.w_router, g.w13, g.w2});
  if (l.shared_ffn > 0) check_pointers(who, {g.shared_w13, g.shared_w2});
  const int E = l.router.experts, k = l.router.top_k, d = l.hidden, f = l.ffn;
  if (tokens == 0) {  // no rows: every weight's gradient is an empty sum
    K2C_CUDA_CHECK(cudaMemsetAsync(g.w_router, 0, sizeof(float) * E * d, stream));
    K2C_CUDA_CHECK(cudaMemsetAsync(g.w13, 0, sizeof(float) * E * 2 * f * d, stream));
    K2C_CUDA_CHECK(cudaMemsetAsync(g.w2, 0, sizeof(float) * E * d * f, stream));
    if (l.shared_ffn > 0) {
      K2C_CUDA_CHECK(cudaMemsetAsync(g.shared_w13, 0, sizeof(float) * 2 * l.shared_ffn * d, stream));
      K2C_CUDA_CHECK(cudaMemsetAsync(g.shared_w2, 0, sizeof(float) * d * l.shared_ffn, stream));
    }
    return;
  }
  check_pointers(who, {x, dy, r.scores, r.expert, r.weight, saved, dx, workspace});
  if (dlogits_extra) check_pointers(who, {dlogits_extra});
  Carve sw(const_cast<void*>(saved));
  const Saved s = carve_saved(sw, l, tokens);
  Carve bw(workspace);
  const BackwardSpace b = carve_backward(bw, l, tokens);
  const long long choices = static_cast<long long>(tokens) * k;

  // Combine: the routed rows' gradient and the weights' gradient.
  combine_backward_kernel<<<static_cast<unsigned>((choices + 7) / 8), 256, 0, stream>>>(
      choices, d, k, reinterpret_cast<const Pack8*>(dy), reinterpret_cast<const Pack8*>(s.out), s.slot, r.weight,
      reinterpret_cast<Pack8*>(b.d_out), b.dw);
  K2C_CUDA_CHECK_LAUNCH();

  // Routed experts, down then up: dX through the same kernels with W read untransposed, dW as
  // a grouped sum over each expert's rows; on Part B's wgmma kernels where they run.
  const bool wgmma = hopper_here();
  auto input_grad = [&](int groups, const int* offsets, long long rows, int n, int kk, const bf16* a, const bf16* w,
                        bf16* c) {
    if (wgmma && kk % 64 == 0) grouped_gemm_hopper(groups, offsets, static_cast<int>(rows), n, kk, a, w, c, false, stream);
    else grouped_gemm(groups, offsets, n, kk, a, w, c, false, false, stream);
  };
  auto weight_grad = [&](int groups, const int* offsets, long long rows, int n, int kk, const bf16* dyy, const bf16* xx,
                         float* dw) {
    if (wgmma) grouped_weight_grad_hopper(groups, offsets, static_cast<int>(rows), n, kk, dyy, xx, dw, stream);
    else grouped_weight_grad(groups, offsets, n, kk, dyy, xx, dw, stream);
  };
  input_grad(E, s.offsets, choices, f, d, b.d_out, l.w2, b.dh);
  weight_grad(E, s.offsets, choices, d, f, b.d_out, s.h, g.w2);
  swiglu_backward_kernel<<<elementwise_blocks(choices * f / 8), 256, 0, stream>>>(
      choices, f, reinterpret_cast<const Pack8*>(s.gu), reinterpret_cast<const Pack8*>(b.dh),
      reinterpret_cast<Pack8*>(b.dgu));
  K2C_CUDA_CHECK_LAUNCH();
  input_grad(E, s.offsets, choices, d, 2 * f, b.dgu, l.w13, b.dxp);
  weight_grad(E, s.offsets, choices, 2 * f, d, b.dgu, s.xp, g.w13);

  // Shared experts write the fp32 dx first; the router's share is added to it.
  bool have_dx = false;
  if (l.shared_ffn > 0) {
    const int sf = l.shared_ffn;
    input_grad(1, s.one_group, tokens, sf, d, dy, l.shared_w2, b.shared_dh);
    weight_grad(1, s.one_group, tokens, d, sf, dy, s.shared_h, g.shared_w2);
    swiglu_backward_kernel<<<elementwise_blocks(static_cast<long long>(tokens) * sf / 8), 256, 0, stream>>>(
        tokens, sf, reinterpret_cast<const Pack8*>(s.shared_gu), reinterpret_cast<const Pack8*>(b.shared_dh),
        reinterpret_cast<Pack8*>(b.shared_dgu));
    K2C_CUDA_CHECK_LAUNCH();
    grouped_gemm(1, s.one_group, d, 2 * sf, b.shared_dgu, l.shared_w13, b.dx, false, false, stream);  // fp32 out
    weight_grad(1, s.one_group, tokens, 2 * sf, d, b.shared_dgu, x, g.shared_w13);
    have_dx = true;
  }

  // Router: dlogits (bf16), then dW_router = dlogitsᵀ x and dx += dlogits W_router.
  router_backward_kernel<<<ceil_div(tokens, kRouteWarps), 32 * kRouteWarps, 0, stream>>>(
      l.router, tokens, r.scores, r.expert, b.dw, dlogits_extra, b.dlogits);
  K2C_CUDA_CHECK_LAUNCH();
  grouped_weight_grad(1, s.one_group, E, d, b.dlogits, x, g.w_router, stream);
  grouped_gemm(1, s.one_group, d, E, b.dlogits, l.w_router, b.dx, false, have_dx, stream);

  // dx = (shared + router) + Σ_j dxp[slot_tj]: combine with unit weights.
  combine(tokens, d, k, b.dxp, s.slot, nullptr, b.dx, dx, stream);
}

}  // namespace k2c::moe
