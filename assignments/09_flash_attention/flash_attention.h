// assignments/09_flash_attention/flash_attention.h — the contract of module 09 (do not edit).
//
// Scaled dot-product attention, forward and backward, bf16 storage with fp32 accumulation, on
// tensor cores (mma.sync). Per batch b and query head h, with kv head g = h / (heads / kv_heads):
//
//   S = scale · Q Kᵀ        P = softmax(S, masked, row by row)        O = P V
//   lse_i = log Σ_j exp(S_ij)  (natural log, over the keys query i may see)
//
// Layouts, all row-major and contiguous. Shape::layout picks one for q, k, v, o, dout, dq, dk and
// dv alike (lse is the same in both):
//   heads_first (the default)
//     q, o, dq        [batch][heads][q_len][head_dim]          bf16
//     k, v, dk, dv    [batch][kv_heads][kv_len][head_dim]      bf16
//   tokens_first: what a model's projections write, token by token with the heads side by side,
//   so that consecutive rows of one head lie heads · head_dim (kv_heads · head_dim) elements apart
//     q, o, dq        [batch][q_len][heads][head_dim]          bf16
//     k, v, dk, dv    [batch][kv_len][kv_heads][head_dim]      bf16
//   lse               [batch][heads][q_len]                    fp32
// kv_heads divides heads: grouped-query attention (kv_heads == 1 is multi-query). The grouped
// query heads read the same K and V; in the backward pass their dK and dV are summed.
//
// Causal masking is aligned to the bottom right: key j is visible to query i when
// j <= i + kv_len - q_len, so the last query sees every key (FlashAttention 2's convention; when
// q_len == kv_len it is the usual "j <= i"). A query that sees no key (causal, q_len > kv_len, or
// kv_len == 0) has output 0 and lse = +inf, and contributes nothing to the gradients.
//
// Tests: autograder/09_flash_attention/test_flash_attention.cu. Lecture: lectures/09_flash_attention.md.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c::flash_attention {

using bf16 = __nv_bfloat16;

enum class Layout { heads_first, tokens_first };

struct Shape {
  int batch = 1;
  int heads = 1;     // query heads
  int kv_heads = 1;  // divides heads
  int q_len = 1;
  int kv_len = 1;
  int head_dim = 64;  // 64 or 128
  bool causal = false;
  float scale = 0.125f;  // usually 1 / sqrt(head_dim); finite and > 0
  Layout layout = Layout::heads_first;  // naive_forward takes heads_first only
};

// The argument checks every entry point makes (given, not part of the exercise). Throws
// std::invalid_argument with the reason for: a negative size, heads not a positive multiple of
// kv_heads, head_dim other than 64 or 128, heads or batch over 65535 (each may be a grid
// dimension), a scale that is not finite and > 0, a layout that is neither of the two, or a
// tensor of more than kMaxElements elements (offsets are 64-bit, but rows and grid sizes are int).
inline constexpr long long kMaxElements = 1LL << 36;
inline void check_shape(const Shape& s, const char* who) {
  K2C_CHECK(s.batch >= 0 && s.heads >= 0 && s.kv_heads >= 0 && s.q_len >= 0 && s.kv_len >= 0,
            who << ": negative size (batch " << s.batch << ", heads " << s.heads << ", kv_heads "
                << s.kv_heads << ", q_len " << s.q_len << ", kv_len " << s.kv_len << ")");
  K2C_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0,
            who << ": heads (" << s.heads << ") must be a multiple of kv_heads (" << s.kv_heads << ") > 0");
  K2C_CHECK(s.head_dim == 64 || s.head_dim == 128, who << ": head_dim must be 64 or 128, got " << s.head_dim);
  K2C_CHECK(s.heads <= 65535 && s.batch <= 65535, who << ": heads and batch must be at most 65535 (a grid dimension)");
  K2C_CHECK(std::isfinite(s.scale) && s.scale > 0, who << ": scale must be finite and > 0, got " << s.scale);
  K2C_CHECK(s.layout == Layout::heads_first || s.layout == Layout::tokens_first,
            who << ": layout must be heads_first or tokens_first");
  const long long rows = static_cast<long long>(s.batch) * s.heads * (s.q_len > s.kv_len ? s.q_len : s.kv_len);
  K2C_CHECK(rows * s.head_dim <= kMaxElements, who << ": more than " << kMaxElements << " elements per tensor");
}
// Every pointer given must be non-null and 16-byte aligned.
inline void check_pointers(const char* who, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    K2C_CHECK(p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 == 0,
              who << ": a pointer is " << (p ? "not 16-byte aligned" : "null"));
}

// Forward, on `stream`, asynchronously: writes o and lse. Pointers are device pointers, 16-byte
// aligned (as cudaMalloc returns; every row of head_dim bf16 then is too); k and v (and below dk,
// dv and the naive workspace) may be null when kv_len is 0, since nothing is read through them. Nothing happens when
// batch, heads or q_len is 0. Throws std::invalid_argument for a bad shape or a missing or
// misaligned pointer.
void forward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
             cudaStream_t stream = nullptr);

// Backward with recomputation: given the forward's inputs, its o and lse, and the upstream
// gradient dout (shaped like o), writes dq, dk and dv. No q_len × kv_len matrix is stored:
// `workspace` (device memory, 16-byte aligned, at least backward_workspace_bytes(s) bytes) holds
// per-row and per-element fp32 scratch, for instance D = rowsum(dout ∘ o) and an fp32 dq that
// many blocks add into. dk and dv are written, not accumulated into (all zeros when no query sees
// a key). Throws as forward does.
std::size_t backward_workspace_bytes(const Shape& s);
void backward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
              const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, void* workspace,
              cudaStream_t stream = nullptr);

// Part B (bonus): forward() and backward() again on Hopper's warpgroup MMA (wgmma) and its
// shared-memory descriptors: same arguments, outputs, workspace, rules and checks. The module is
// compiled for sm_90a wherever the build targets sm_90; hopper_supported() says whether this
// build and device can run them (the reason in *why_not when not), and forward_hopper() and
// backward_hopper() throw std::invalid_argument with that reason instead of launching.
bool hopper_supported(std::string* why_not = nullptr);
void forward_hopper(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                    cudaStream_t stream = nullptr);
void backward_hopper(const Shape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
                     const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                     cudaStream_t stream = nullptr);

// Standard attention for contrast: S and P are materialised in global memory, fp32, in
// `workspace` (at least naive_workspace_bytes(s): batch · heads · q_len · kv_len floats), then
// O = P V. Same outputs and rules as forward(), and two more limits: the heads_first layout, and
// batch · heads and q_len / 32 at most 65535 (its grid; std::invalid_argument otherwise). It moves O(N²) bytes where
// forward() moves O(N·d): the lecture measures the difference. naive_workspace_bytes is given
// (defined here, not part of the exercise).
inline std::size_t naive_workspace_bytes(const Shape& s) {
  check_shape(s, "flash_attention naive_workspace_bytes");
  return static_cast<std::size_t>(s.batch) * s.heads * s.q_len * s.kv_len * sizeof(float);
}
void naive_forward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                   void* workspace, cudaStream_t stream = nullptr);

}  // namespace k2c::flash_attention
