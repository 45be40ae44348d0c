// assignments/08_rope/rope.h — the contract of module 08 (do not edit).
//
// Rotary position embedding (RoPE): before attention, every query and key vector is rotated, pair
// of dimensions by pair of dimensions, by an angle proportional to its position. Pair k of a
// head of dimension d turns at frequency theta_k = base^(-2k/d), so at position p it is rotated by
//
//   (a, b) -> (a·cos(p·theta_k) − b·sin(p·theta_k),  a·sin(p·theta_k) + b·cos(p·theta_k)).
//
// The dot product of a query at position m and a key at position n then depends on m − n only:
// attention sees relative positions (the lecture derives it from the complex form).
//
// Which dimensions form pair k:
//   interleaved  (2k, 2k+1)        the complex-number form of the original paper
//   half_split   (k, k + d/2)      the "rotate half" form of GPT-NeoX and Llama checkpoints
//
// Tests: autograder/08_rope/test_rope.cu. Lecture: lectures/08_rope.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "k2c/core/check.h"

namespace k2c::rope {

using bf16 = __nv_bfloat16;

enum class Layout { interleaved, half_split };
// backward rotates by the opposite angle: the gradient of a rotation is its transpose, which is
// its inverse, so dq = R(−angle) · dq_out.
enum class Direction { forward, backward };

// Query and key tensors, [batch][seq][heads][head_dim] row-major, bf16. q has q_heads heads and k
// kv_heads (grouped-query attention: kv_heads divides q_heads; MQA: kv_heads == 1).
struct Shape {
  int batch = 1, seq = 1, q_heads = 1, kv_heads = 1, head_dim = 2;
};

// The cos/sin table: cache[p · head_dim/2 + k] = (cos(p·theta_k), sin(p·theta_k)) for
// 0 <= p < positions, computed in double and stored as fp32 (device memory, positions ·
// head_dim/2 float2). Asynchronous on `stream`. head_dim even and >= 2, positions >= 0, base > 1.
void build_cache(float2* cache, int positions, int head_dim, double base, cudaStream_t stream = nullptr);

// Rotates q into q_out and k into k_out (device pointers; q_out may equal q and k_out may equal k:
// in place). Token s of every sequence is at position position_offset + s (an offset lets a
// sequence-parallel rank or a decoding step start mid-sequence).
//   cache == nullptr   cos and sin computed on the fly from base, the angle p·theta_k as
//                      accurate as the table's (an angle rounded to fp32 is off by up to
//                      p · 2^-24 radians, which the tests catch at long positions)
//   otherwise          read from a table made by build_cache with the same head_dim and base;
//                      cache_positions is its length, and position_offset + seq must not exceed it
// Shapes: every count >= 1 except batch and seq (>= 0: nothing to do), head_dim even, q_heads a
// multiple of kv_heads, position_offset >= 0. Throws std::invalid_argument otherwise, and for null
// pointers when there is work.
void apply(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, const Shape& shape,
           long position_offset, Layout layout, Direction direction, double base,
           const float2* cache, int cache_positions, cudaStream_t stream = nullptr);

// The argument checks apply() starts with (given, so every implementation rejects the same
// inputs with the same messages). Returns false when there is nothing to do.
inline bool check_apply_args(const bf16* q, const bf16* k, const bf16* q_out, const bf16* k_out,
                             const Shape& s, long position_offset, double base, const float2* cache,
                             int cache_positions) {
  K2C_CHECK(s.batch >= 0 && s.seq >= 0, "rope: negative batch " << s.batch << " or seq " << s.seq);
  K2C_CHECK(s.q_heads >= 1 && s.kv_heads >= 1 && s.q_heads % s.kv_heads == 0,
            "rope: q_heads (" << s.q_heads << ") must be a positive multiple of kv_heads (" << s.kv_heads << ")");
  K2C_CHECK(s.head_dim >= 2 && s.head_dim % 2 == 0, "rope: head_dim must be even and >= 2, got " << s.head_dim);
  K2C_CHECK(position_offset >= 0, "rope: negative position_offset " << position_offset);
  K2C_CHECK(base > 1, "rope: base must be > 1, got " << base);
  if (s.batch == 0 || s.seq == 0) return false;
  K2C_CHECK(q && k && q_out && k_out, "rope: null q, k, q_out or k_out");
  K2C_CHECK(cache == nullptr || position_offset + s.seq <= cache_positions,
            "rope: positions up to " << position_offset + s.seq << " need a cache that long, got "
                                     << cache_positions);
  return true;
}

}  // namespace k2c::rope
