// solutions/08_rope/rope.cu — reference solution of module 08 (contract: rope.h).
//
// RoPE is a pointwise rotation: every element of q and k is read once and written once, with a
// handful of FLOPs in between, so the target is the copy rate. What is not pointwise is the
// angle: cos and sin of p·theta_k depend on the position p and the pair k, but not on the head.
// A Llama-style layer at 16384 tokens has 32 query and 8 key heads of 128 dimensions: 40 heads
// share each (p, k). So one thread takes one token and a group of pairs, gets their cos/sin once,
// and walks all 40 heads with them.
//
// Where cos/sin come from:
//   cache      a table built once per model (in double, stored as fp32: 8 bytes per (p, k)).
//              Per token it is d/2 · 8 = 512 bytes against 40 heads · 128 · 2 · 2 = 20 KiB of q/k
//              traffic, ~2.5% more bytes, and a table of 4096 positions (2 MiB) stays in L2.
//   on the fly cos/sin per (p, k): no extra bytes but real instructions, shared by 40 heads so
//              they hide under the memory time. The trap is precision: p·theta_k rounded to
//              fp32 is off by up to p · 2^-24 radians (0.004 at p = 65536, as large as a bf16
//              rounding of the output), and theta_k itself carries a few fp32 ulps that p
//              multiplies. So the angle is formed in double, reduced to [-π, π] in double, and
//              only then handed to the fp32 sincosf, whose small argument it handles exactly to
//              a few ulps: as accurate as the table, at any position.
//
// Vector accesses: interleaved pairs (2k, 2k+1) are adjacent, so 8 bf16 = 4 pairs per 16-byte
// load; half-split pairs (k, k + d/2) come from two 16-byte loads of 8 elements each, one per half.
// Head dims that do not allow it (or unaligned pointers) take one pair at a time.
#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/check.h"
#include "k2c/rows.cuh"
#include "rope.h"

namespace k2c::rope {
namespace {

using k2c::rows::aligned16;
using k2c::rows::load;
using k2c::rows::store;

// PAIRS pairs (a_i, b_i), i.e. pairs u·PAIRS .. u·PAIRS + PAIRS - 1 of a head of dimension d.
template <Layout L, int PAIRS>
__device__ __forceinline__ void load_pairs(const bf16* head, int d, int u, float (&a)[PAIRS], float (&b)[PAIRS]) {
  if constexpr (L == Layout::interleaved && PAIRS == 1) {  // element accesses: any alignment
    a[0] = __bfloat162float(head[2 * u]);
    b[0] = __bfloat162float(head[2 * u + 1]);
  } else if constexpr (L == Layout::interleaved) {
    float v[2 * PAIRS];
    load<bf16, 2 * PAIRS>(head + 2 * PAIRS * u, v);
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) a[i] = v[2 * i], b[i] = v[2 * i + 1];
  } else {
    load<bf16, PAIRS>(head + PAIRS * u, a);
    load<bf16, PAIRS>(head + d / 2 + PAIRS * u, b);
  }
}

template <Layout L, int PAIRS>
__device__ __forceinline__ void store_pairs(bf16* head, int d, int u, const float (&a)[PAIRS], const float (&b)[PAIRS]) {
  if constexpr (L == Layout::interleaved && PAIRS == 1) {
    head[2 * u] = __float2bfloat16(a[0]);
    head[2 * u + 1] = __float2bfloat16(b[0]);
  } else if constexpr (L == Layout::interleaved) {
    float v[2 * PAIRS];
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) v[2 * i] = a[i], v[2 * i + 1] = b[i];
    store<bf16, 2 * PAIRS>(head + 2 * PAIRS * u, v);
  } else {
    store<bf16, PAIRS>(head + PAIRS * u, a);
    store<bf16, PAIRS>(head + d / 2 + PAIRS * u, b);
  }
}

template <Layout L, int PAIRS>
__device__ __forceinline__ void rotate_head(const bf16* in, bf16* out, int d, int u, const float (&c)[PAIRS],
                                            const float (&s)[PAIRS]) {
  float a[PAIRS], b[PAIRS];
  load_pairs<L, PAIRS>(in, d, u, a, b);
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const float ra = a[i] * c[i] - b[i] * s[i];
    b[i] = a[i] * s[i] + b[i] * c[i];
    a[i] = ra;
  }
  store_pairs<L, PAIRS>(out, d, u, a, b);
}

// The elements of one head that a thread rotates, as stored: one 16-byte piece when interleaved,
// one from each half when half-split.
template <Layout L, int PAIRS>
struct Slice {
  static constexpr int kFirst = L == Layout::interleaved ? 2 * PAIRS : PAIRS;
  k2c::rows::Pack<bf16, kFirst> first;
  k2c::rows::Pack<bf16, PAIRS> second;  // unused when interleaved
};

template <Layout L, int PAIRS>
__device__ __forceinline__ Slice<L, PAIRS> load_slice(const bf16* head, int d, int u) {
  using k2c::rows::Pack;
  Slice<L, PAIRS> sl;
  sl.first = *reinterpret_cast<const Pack<bf16, Slice<L, PAIRS>::kFirst>*>(head + Slice<L, PAIRS>::kFirst * u);
  if constexpr (L == Layout::half_split)
    sl.second = *reinterpret_cast<const Pack<bf16, PAIRS>*>(head + d / 2 + PAIRS * u);
  return sl;
}

template <Layout L, int PAIRS>
__device__ __forceinline__ void rotate_slice(const Slice<L, PAIRS>& sl, bf16* head, int d, int u,
                                             const float (&c)[PAIRS], const float (&s)[PAIRS]) {
  float a[PAIRS], b[PAIRS];
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    if constexpr (L == Layout::interleaved) {
      a[i] = __bfloat162float(sl.first.v[2 * i]);
      b[i] = __bfloat162float(sl.first.v[2 * i + 1]);
    } else {
      a[i] = __bfloat162float(sl.first.v[i]);
      b[i] = __bfloat162float(sl.second.v[i]);
    }
    const float ra = a[i] * c[i] - b[i] * s[i];
    b[i] = a[i] * s[i] + b[i] * c[i];
    a[i] = ra;
  }
  store_pairs<L, PAIRS>(head, d, u, a, b);
}

// Rotates `heads` consecutive heads. The vector path loads kBatch heads before storing any: out may
// alias in (in place), so the compiler may not hoist a later head's load above an earlier head's
// store by itself, and without this each thread would have one load in flight at a time.
template <Layout L, int PAIRS>
__device__ __forceinline__ void rotate_heads(const bf16* in, bf16* out, int heads, int d, int u,
                                             const float (&c)[PAIRS], const float (&s)[PAIRS]) {
  int h = 0;
  if constexpr (PAIRS > 1) {
    constexpr int kBatch = 4;
    for (; h + kBatch <= heads; h += kBatch) {
      Slice<L, PAIRS> sl[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) sl[j] = load_slice<L, PAIRS>(in + (h + j) * d, d, u);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) rotate_slice<L, PAIRS>(sl[j], out + (h + j) * d, d, u, c, s);
    }
  }
  for (; h < heads; ++h) rotate_head<L, PAIRS>(in + h * d, out + h * d, d, u, c, s);
}

// One thread per (token, group of PAIRS pairs, span of heads); `units` groups per head. The heads
// of q then those of k form one list of q_heads + kv_heads rows of d elements, and blockIdx.y
// picks which `span` of them this thread rotates.
template <Layout L, int PAIRS>
__global__ void rope_kernel(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, long tokens, int seq,
                            int q_heads, int kv_heads, int d, int span, long offset, float sign,
                            const float2* __restrict__ cache, double log2_base) {
  const int units = d / 2 / PAIRS;
  const long idx = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * units) return;
  const long token = idx / units;
  const int u = static_cast<int>(idx % units);
  const long p = offset + token % seq;

  float c[PAIRS], s[PAIRS];
  if (cache != nullptr) {
    const float2* row = cache + p * (d / 2) + u * PAIRS;
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const float2 cs = row[i];
      c[i] = cs.x;
      s[i] = sign * cs.y;
    }
  } else {
    // The angle in double, reduced to [-π, π] before the fp32 sincosf: see the top of the file.
    // A few double operations per (token, pair), shared by every head.
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const int pair = u * PAIRS + i;
      const double angle = static_cast<double>(p) * exp2(-2.0 * pair / d * log2_base);
      constexpr double kTwoPi = 6.283185307179586;
      sincosf(static_cast<float>(angle - kTwoPi * rint(angle / kTwoPi)), &s[i], &c[i]);
      s[i] *= sign;
    }
  }

  const int first = static_cast<int>(blockIdx.y) * span;
  const int last = min(q_heads + kv_heads, first + span);
  if (first < q_heads) {
    const std::size_t at = (static_cast<std::size_t>(token) * q_heads + first) * d;
    rotate_heads<L, PAIRS>(q + at, q_out + at, min(last, q_heads) - first, d, u, c, s);
  }
  if (last > q_heads) {
    const int from = max(first, q_heads) - q_heads;
    const std::size_t at = (static_cast<std::size_t>(token) * kv_heads + from) * d;
    rotate_heads<L, PAIRS>(k + at, k_out + at, last - q_heads - from, d, u, c, s);
  }
}

// Heads a thread rotates with one cos/sin: all of a token's heads (span = q_heads + kv_heads)
// computes the angles fewest times, a smaller span starts more threads, each with a shorter chain.
constexpr int kSpan = 1 << 30;

template <Layout L, int PAIRS>
void launch(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, const Shape& sh, long offset, float sign,
            const float2* cache, double base, cudaStream_t stream, int span = kSpan) {
  const long tokens = static_cast<long>(sh.batch) * sh.seq;
  const long threads = tokens * (sh.head_dim / 2 / PAIRS);
  const int heads = sh.q_heads + sh.kv_heads;
  span = std::clamp(span, (heads + 65534) / 65535, heads);  // gridDim.y stays within its limit
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads), (heads + span - 1) / span);
  rope_kernel<L, PAIRS><<<grid, kThreads, 0, stream>>>(q, k, q_out, k_out, tokens, sh.seq, sh.q_heads,
                                                       sh.kv_heads, sh.head_dim, span, offset, sign, cache,
                                                       std::log2(base));
}

// cache[p · d/2 + k] = (cos, sin)(p · base^(-2k/d)), in double: the table is built once, so its
// accuracy costs nothing later, and it is what makes long positions exact.
__global__ void cache_kernel(float2* cache, int positions, int half, double base) {
  const long idx = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<long>(positions) * half) return;
  const long p = idx / half;
  const int k = static_cast<int>(idx % half);
  double s, c;
  sincos(static_cast<double>(p) * pow(base, -static_cast<double>(k) / half), &s, &c);
  cache[idx] = make_float2(static_cast<float>(c), static_cast<float>(s));
}

}  // namespace

void build_cache(float2* cache, int positions, int head_dim, double base, cudaStream_t stream) {
  K2C_CHECK(positions >= 0 && head_dim >= 2 && head_dim % 2 == 0 && base > 1,
            "rope build_cache: need positions >= 0, even head_dim >= 2, base > 1; got "
                << positions << ", " << head_dim << ", " << base);
  if (positions == 0) return;
  K2C_CHECK(cache != nullptr, "rope build_cache: null cache");
  const long n = static_cast<long>(positions) * (head_dim / 2);
  cache_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(cache, positions, head_dim / 2, base);
  K2C_CUDA_CHECK_LAUNCH();
}

void apply(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, const Shape& shape,
           long position_offset, Layout layout, Direction direction, double base,
           const float2* cache, int cache_positions, cudaStream_t stream) {
  if (!check_apply_args(q, k, q_out, k_out, shape, position_offset, base, cache, cache_positions)) return;
  const float sign = direction == Direction::forward ? 1.0f : -1.0f;
  const int d = shape.head_dim;
  const bool aligned = aligned16(q) && aligned16(k) && aligned16(q_out) && aligned16(k_out);
  if (layout == Layout::interleaved) {
    if (aligned && d % 8 == 0)
      launch<Layout::interleaved, 4>(q, k, q_out, k_out, shape, position_offset, sign, cache, base, stream);
    else
      launch<Layout::interleaved, 1>(q, k, q_out, k_out, shape, position_offset, sign, cache, base, stream);
  } else {
    if (aligned && d % 16 == 0)
      launch<Layout::half_split, 8>(q, k, q_out, k_out, shape, position_offset, sign, cache, base, stream);
    else
      launch<Layout::half_split, 1>(q, k, q_out, k_out, shape, position_offset, sign, cache, base, stream);
  }
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace k2c::rope
