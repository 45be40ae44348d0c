// assignments/10_moe/moe.h — the contract of module 10 (do not edit).
//
// A mixture-of-experts layer, bf16 storage with fp32 accumulation, forward and backward:
//
//   logits = x W_rᵀ (fp32)  →  route: scores, top-k experts and their weights per token
//   dispatch: tokens' rows grouped by expert (counts, offsets, a slot per choice, capacity drops)
//   routed experts, one grouped GEMM per weight matrix over all experts:
//       [g | u] = x_e W13_eᵀ      h = silu(g) ∘ u      out_e = h W2_eᵀ
//   combine: y_t = shared(x_t) + Σ_j weight_tj · out[slot_tj]   (dropped choices add nothing)
//
// Layouts, row-major and contiguous, a weight laid out as a linear layer's ([out][in]):
//   x, y, dx           [tokens][hidden]                   bf16
//   w_router           [experts][hidden]                  bf16
//   w13                [experts][2·ffn][hidden]           bf16   rows 0..ffn-1: W1 (gate), then W3 (up)
//   w2                 [experts][hidden][ffn]             bf16
//   shared_w13         [2·shared_ffn][hidden]             bf16   the shared experts as one SwiGLU
//   shared_w2          [hidden][shared_ffn]               bf16   network of their total width
//   logits, scores     [tokens][experts]                  fp32
//   expert, weight     [tokens][top_k]                    int32, fp32   best choice first
//   weight gradients   laid out like the weights          fp32
//
// Routing rules (k2c::ref::route is the oracle): scores are softmax(logits) or sigmoid(logits);
// experts are ranked by score + bias (bias optional, per expert: it steers the choice and never
// the weights). With groups > 1 the experts form `groups` equal groups, a group is scored by the
// sum of its two best biased scores (its best when a group has one expert), and only the
// `top_groups` best groups compete. Ties go to the lower index, for experts and for groups. The
// weights are the chosen experts' unbiased scores, divided by their sum when `normalize` (always
// with sigmoid scores), times route_scale.
//
// Tests: autograder/10_moe/test_moe.cu and test_moe_perf.cu. Lecture: lectures/10_moe.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c::moe {

using bf16 = __nv_bfloat16;

enum class Score { softmax, sigmoid };

struct RouterConfig {
  int experts = 8;  // 1 .. kMaxExperts
  int top_k = 2;    // 1 .. kMaxTopK
  Score score = Score::softmax;
  int groups = 1, top_groups = 1;  // groups divides experts, groups <= 32, top_groups <= groups
  bool normalize = false;
  float route_scale = 1.0f;
};

inline constexpr int kMaxExperts = 1024, kMaxTopK = 32, kMaxGroups = 32;
inline constexpr long long kMaxElements = 1LL << 36;  // per tensor: offsets are 64-bit, rows int

// The argument checks every entry point makes (given, not part of the exercise); each throws
// std::invalid_argument with the reason.
inline void check_router(const RouterConfig& c, const char* who) {
  K2C_CHECK(c.experts >= 1 && c.experts <= kMaxExperts,
            who << ": experts must be in 1.." << kMaxExperts << ", got " << c.experts);
  K2C_CHECK(c.groups >= 1 && c.groups <= kMaxGroups && c.experts % c.groups == 0,
            who << ": groups (" << c.groups << ") must divide experts (" << c.experts << ") and be at most " << kMaxGroups);
  K2C_CHECK(c.top_groups >= 1 && c.top_groups <= c.groups,
            who << ": top_groups must be in 1..groups, got " << c.top_groups);
  K2C_CHECK(c.top_k >= 1 && c.top_k <= kMaxTopK && c.top_k <= c.experts / c.groups * c.top_groups,
            who << ": top_k (" << c.top_k << ") must be in 1.." << kMaxTopK << " and fit in the eligible experts ("
                << c.experts / c.groups * c.top_groups << ")");
  K2C_CHECK(c.route_scale > 0 && c.route_scale < 1e30f, who << ": route_scale must be finite and > 0");
}
inline void check_tokens(long long tokens, long long width, const char* who) {
  K2C_CHECK(tokens >= 0 && width >= 1 && tokens * width <= kMaxElements,
            who << ": bad size (" << tokens << " rows of " << width << ")");
}
// The tokens · top_k choices are counted and indexed with int: at most 2^31 − 1 of them.
inline void check_choices(long long tokens, int top_k, const char* who) {
  K2C_CHECK(tokens >= 0 && top_k >= 1 && top_k <= kMaxTopK && tokens * top_k <= 0x7fffffff,
            who << ": tokens (" << tokens << ") and top_k (" << top_k << ") must give 0 .. 2^31 - 1 choices, top_k in 1.."
                << kMaxTopK);
}
// Every pointer given must be non-null and 16-byte aligned (bias and dlogits_extra may be null
// where the contract says so; when given, they must be aligned too).
inline void check_pointers(const char* who, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    K2C_CHECK(p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 == 0,
              who << ": a pointer is " << (p ? "not 16-byte aligned" : "null"));
}

// The grouped GEMMs' checks: groups in 1..kMaxExperts, n and k >= 1, groups · n · k within
// kMaxElements, no null pointer.
inline void check_grouped(int groups, int n, int k, std::initializer_list<const void*> pointers, const char* who) {
  K2C_CHECK(groups >= 1 && groups <= kMaxExperts, who << ": groups must be in 1.." << kMaxExperts << ", got " << groups);
  K2C_CHECK(n >= 1 && k >= 1, who << ": n and k must be >= 1, got n=" << n << " k=" << k);
  check_tokens(static_cast<long long>(groups) * n, k, who);
  for (const void* p : pointers) K2C_CHECK(p != nullptr, who << ": a pointer is null");
}

// route's checks: the router's configuration, tokens rows of c.experts logits, then (only when
// there are tokens) the pointers, bias optional. Returns false when there is nothing to route.
[[nodiscard]] inline bool check_route(const RouterConfig& c, int tokens, const float* logits, const float* bias,
                                      const float* scores, const int* expert, const float* weight, const char* who) {
  check_router(c, who);
  check_tokens(tokens, c.experts, who);
  if (tokens == 0) return false;
  check_pointers(who, {logits, scores, expert, weight});
  if (bias) check_pointers(who, {bias});
  return true;
}

// balance_loss's checks: at least one token, top_k in 1..experts, no null or misaligned pointer.
inline void check_balance(int tokens, int experts, int top_k, const float* logits, const int* expert,
                          const float* loss, const float* dlogits, const void* workspace, const char* who) {
  K2C_CHECK(tokens >= 1 && experts >= 1 && experts <= kMaxExperts && top_k >= 1 && top_k <= experts,
            who << ": bad sizes (tokens " << tokens << ", experts " << experts << ", top_k " << top_k << ")");
  check_tokens(tokens, experts, who);
  check_pointers(who, {logits, expert, loss, dlogits, workspace});
}

// permute's and combine's checks: hidden a whole number of 16-byte vectors, the tokens · top_k
// choices and their rows within the limits above, then (only when there are tokens) the
// pointers; combine's weight and residual may be null. Returns false when there is nothing to
// move, for the caller to return at once.
inline void check_choice_rows(int tokens, int hidden, int top_k, const char* who) {
  K2C_CHECK(hidden >= 8 && hidden % 8 == 0, who << ": hidden must be a multiple of 8, got " << hidden);
  check_choices(tokens, top_k, who);
  check_tokens(static_cast<long long>(tokens) * top_k, hidden, who);
}
[[nodiscard]] inline bool check_permute(int tokens, int hidden, int top_k, const void* x, const int* slot,
                                        const void* rows, const char* who) {
  check_choice_rows(tokens, hidden, top_k, who);
  if (tokens == 0) return false;
  check_pointers(who, {x, slot, rows});
  return true;
}
[[nodiscard]] inline bool check_combine(int tokens, int hidden, int top_k, const void* rows, const int* slot,
                                        const float* weight, const float* residual, const void* y, const char* who) {
  check_choice_rows(tokens, hidden, top_k, who);
  if (tokens == 0) return false;
  check_pointers(who, {rows, slot, y});
  if (weight) check_pointers(who, {weight});
  if (residual) check_pointers(who, {residual});
  return true;
}

// ---- task 1: the router ---------------------------------------------------------------------

// From fp32 logits [tokens][experts] and an optional bias [experts] (null: none), writes the
// unbiased scores [tokens][experts] and the choices: expert [tokens][top_k] (best first) and
// their weights.
void route(const RouterConfig& c, int tokens, const float* logits, const float* bias, float* scores,
           int* expert, float* weight, cudaStream_t stream = nullptr);

// The Switch load-balancing loss in its top-k form: L = alpha · E / (k · T²) · Σ_i count_i · Σ_t
// p_ti, with p = softmax(logits) (whatever the router's scoring) and count_i the choices of
// expert i in `expert` (constants: the gradient flows through p only). Writes the loss (one
// float) and dlogits [tokens][experts]; `workspace` holds balance_workspace_bytes(experts).
// tokens >= 1.
std::size_t balance_workspace_bytes(int experts);
void balance_loss(int tokens, int experts, int top_k, float alpha, const float* logits, const int* expert,
                  float* loss, float* dlogits, void* workspace, cudaStream_t stream = nullptr);

// ---- task 2: dispatch, permute, combine --------------------------------------------------------

// Groups the tokens·top_k choices by expert. Within an expert, choices keep token order (then
// choice order); with capacity >= 0 an expert keeps its first `capacity` choices and drops the
// rest (capacity < 0: no limit). Writes counts [experts] (choices kept), offsets [experts + 1]
// (their prefix sums; offsets[experts] = rows kept), slot [tokens][top_k] (the row of each choice
// in expert order, -1 when dropped) and source [tokens · top_k] (the token of each kept row;
// entries past the rows kept are left alone). Deterministic: the same input gives the same output
// on every run. `workspace` holds dispatch_workspace_bytes(tokens, experts, top_k).
std::size_t dispatch_workspace_bytes(int tokens, int experts, int top_k);
void dispatch(int tokens, int experts, int top_k, int capacity, const int* expert, int* counts, int* offsets,
              int* slot, int* source, void* workspace, cudaStream_t stream = nullptr);

// rows[slot_tj] = x[t] for every kept choice: [rows kept][hidden], rows kept = tokens·top_k at
// most. hidden % 8 == 0 (rows move in 16-byte pieces).
void permute(int tokens, int hidden, int top_k, const bf16* x, const int* slot, bf16* rows,
             cudaStream_t stream = nullptr);

// y[t] = residual[t] + Σ_j weight_tj · rows[slot_tj] over the kept choices, in fp32, rounded once.
// residual (fp32 [tokens][hidden]) may be null (zero); weight may be null (every weight 1: the
// inverse of permute, and the backward pass's gather of dx). hidden % 8 == 0.
void combine(int tokens, int hidden, int top_k, const bf16* rows, const int* slot, const float* weight,
             const float* residual, bf16* y, cudaStream_t stream = nullptr);

// ---- task 3: grouped GEMM ------------------------------------------------------------------------
//
// One launch over every group, with the group sizes in device memory (offsets [groups + 1], as
// dispatch writes them): no copy to the host, no per-group launch. Group g owns rows
// offsets[g] .. offsets[g+1]-1 of the row-major operands.

// C_g = A_g · B_gᵀ (+ C_g when accumulate): A [rows][k], B [groups][n][k], C [rows][n]. The
// experts' forward pass (B = W13 or W2) and the router's logits (one group, fp32 C).
// b_transposed = false reads B as [groups][k][n] instead (C_g = A_g · B_g): the input gradient,
// dx_e = dy_e · W_e. n, k >= 1.
void grouped_gemm(int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, bf16* c,
                  bool b_transposed = true, bool accumulate = false, cudaStream_t stream = nullptr);
void grouped_gemm(int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, float* c,
                  bool b_transposed = true, bool accumulate = false, cudaStream_t stream = nullptr);

// The weight gradient: dW_g = dY_gᵀ · X_g for dY [rows][n], X [rows][k], dW [groups][n][k] fp32,
// a sum over the group's rows (a group with no rows gets zeros).
void grouped_weight_grad(int groups, const int* offsets, int n, int k, const bf16* dy, const bf16* x, float* dw,
                         cudaStream_t stream = nullptr);

// ---- Part B (bonus): the grouped GEMMs on Hopper's wgmma ---------------------------------------

// grouped_gemm() with bf16 C (overwritten) and grouped_weight_grad() on warpgroup MMA with TMA
// copies, for sm_90a. TMA describes whole tensors, so these need the number of rows the row-major
// operands hold: `rows` >= offsets[groups] (rows past offsets[groups] are neither used nor
// written). TMA also needs rows that start on 16 bytes: k % 8 == 0 and 16-byte aligned operands,
// and n % 8 == 0 wherever n is a row length (b_transposed = false; dy of the weight gradient).
// With b_transposed = false, k % 64 == 0 as well: a 64-deep step of B must not reach into the
// next group's rows. hopper_supported() says whether this build and device can run them (the
// reason in *why_not when not); the functions throw std::invalid_argument with that reason, or
// for bad arguments, instead of launching.
// The first call on a device runs a feature probe (a small launch and copy, synchronous) whose
// answer is kept; later calls are asynchronous like the rest of the contract.
bool hopper_supported(std::string* why_not = nullptr);
void grouped_gemm_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* a, const bf16* b,
                         bf16* c, bool b_transposed = true, cudaStream_t stream = nullptr);
void grouped_weight_grad_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* dy,
                                const bf16* x, float* dw, cudaStream_t stream = nullptr);
inline void check_grouped_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* a,
                                 const bf16* b, const bf16* c, bool b_transposed, const char* who) {
  check_grouped(groups, n, k, {offsets, a, b, c}, who);
  check_tokens(rows, k > n ? k : n, who);
  K2C_CHECK(static_cast<long long>(groups) * (b_transposed ? n : k) <= 0x7fffffff,
            who << ": the stacked B has more than 2^31 - 1 rows (TMA coordinates are int)");
  K2C_CHECK(k % 8 == 0, who << ": k must be a multiple of 8 (TMA rows start on 16 bytes), got " << k);
  K2C_CHECK(b_transposed || (n % 8 == 0 && k % 64 == 0),
            who << ": with b_transposed = false, n must be a multiple of 8 and k of 64, got n=" << n << " k=" << k);
  check_pointers(who, {a, b});
}
inline void check_weight_grad_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* dy,
                                     const bf16* x, const float* dw, const char* who) {
  check_grouped(groups, n, k, {offsets, dy, x, dw}, who);
  check_tokens(rows, k > n ? k : n, who);
  K2C_CHECK(n % 8 == 0 && k % 8 == 0, who << ": n and k must be multiples of 8 (TMA rows), got n=" << n << " k=" << k);
  check_pointers(who, {dy, x});
}

// ---- task 4: the layer ---------------------------------------------------------------------------

struct Layer {
  RouterConfig router;
  int hidden = 64, ffn = 64;  // multiples of 8
  int shared_ffn = 0;         // total width of the shared experts; 0: none (multiple of 8)
  int capacity = -1;          // per expert; < 0: no limit
  const bf16* w_router = nullptr;
  const float* bias = nullptr;  // may be null
  const bf16* w13 = nullptr;
  const bf16* w2 = nullptr;
  const bf16* shared_w13 = nullptr;  // null when shared_ffn == 0
  const bf16* shared_w2 = nullptr;
};
inline void check_layer(const Layer& l, int tokens, const char* who) {
  check_router(l.router, who);
  K2C_CHECK(l.hidden >= 8 && l.hidden % 8 == 0 && l.ffn >= 8 && l.ffn % 8 == 0 && l.shared_ffn >= 0 &&
                l.shared_ffn % 8 == 0,
            who << ": hidden, ffn and shared_ffn must be multiples of 8 (hidden " << l.hidden << ", ffn " << l.ffn
                << ", shared_ffn " << l.shared_ffn << ")");
  check_choices(tokens, l.router.top_k, who);
  check_tokens(static_cast<long long>(tokens) * l.router.top_k, 2LL * (l.ffn > l.hidden ? l.ffn : l.hidden), who);
  check_tokens(static_cast<long long>(l.router.experts) * 2 * l.ffn, l.hidden, who);
  if (l.shared_ffn > 0) {
    check_tokens(tokens, 2LL * (l.shared_ffn > l.hidden ? l.shared_ffn : l.hidden), who);
    check_tokens(2LL * l.shared_ffn, l.hidden, who);
  }
  check_pointers(who, {l.w_router, l.w13, l.w2});
  if (l.shared_ffn > 0) check_pointers(who, {l.shared_w13, l.shared_w2});
  if (l.bias != nullptr) check_pointers(who, {l.bias});
}

// Where the forward pass writes the routing (device memory, owned by the caller; the backward
// pass reads it): logits and scores [tokens][experts], expert and weight [tokens][top_k], counts
// [experts] (choices kept per expert: the load; dropped = tokens·top_k − Σ counts).
struct Routing {
  float* logits = nullptr;
  float* scores = nullptr;
  int* expert = nullptr;
  float* weight = nullptr;
  int* counts = nullptr;
};

// Forward: writes y and the routing, and keeps in `saved` (forward_workspace_bytes) what the
// backward pass needs. Nothing happens when tokens is 0. (An implementation that asks
// hopper_supported() which kernels to use synchronises once, at its first call on a device.)
std::size_t forward_workspace_bytes(const Layer& l, int tokens);
void forward(const Layer& l, int tokens, const bf16* x, bf16* y, const Routing& routing, void* saved,
             cudaStream_t stream = nullptr);

// Backward with the routing held fixed (a top-k choice has no gradient; gradients reach the
// router through the chosen experts' weights): given x, upstream dy, the forward's routing and
// `saved`, writes dx and every weight's gradient (fp32, overwritten, not accumulated).
// dlogits_extra [tokens][experts] (may be null) is added to the router's logit gradient before it
// reaches w_router and x: the place for auxiliary losses such as balance_loss.
struct Grads {
  float* w_router = nullptr;
  float* w13 = nullptr;
  float* w2 = nullptr;
  float* shared_w13 = nullptr;  // null when shared_ffn == 0
  float* shared_w2 = nullptr;
};
std::size_t backward_workspace_bytes(const Layer& l, int tokens);
void backward(const Layer& l, int tokens, const bf16* x, const bf16* dy, const Routing& routing, const void* saved,
              const float* dlogits_extra, bf16* dx, const Grads& grads, void* workspace,
              cudaStream_t stream = nullptr);

}  // namespace k2c::moe
