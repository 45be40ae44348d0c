// assignments/08_rope/rope.cu — module 08: your implementation (contract: rope.h).
//
// Read lectures/08_rope.md first. The angle of a pair depends on the position and the pair index,
// not on the head: compute (or load) each cos/sin once and use it for several heads of q and k,
// while consecutive threads still work on consecutive memory (lecture section 9).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/todo.h"
#include "rope.h"

namespace k2c::rope {

void build_cache(float2* cache, int positions, int head_dim, double base, cudaStream_t stream) {
  K2C_CHECK(positions >= 0 && head_dim >= 2 && head_dim % 2 == 0 && base > 1,
            "rope build_cache: need positions >= 0, even head_dim >= 2, base > 1");
  if (positions == 0) return;
  K2C_CHECK(cache != nullptr, "rope build_cache: null cache");
  (void)stream;
  K2C_TODO("rope build_cache: one thread per (position, pair), cos and sin in double");
}

void apply(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, const Shape& shape,
           long position_offset, Layout layout, Direction direction, double base,
           const float2* cache, int cache_positions, cudaStream_t stream) {
  if (!check_apply_args(q, k, q_out, k_out, shape, position_offset, base, cache, cache_positions)) return;
  (void)layout, (void)direction, (void)stream;
  K2C_TODO("rope apply: check the shape, then one thread per (token, group of pairs, a few heads)");
}

}  // namespace k2c::rope
