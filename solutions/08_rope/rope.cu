// solutions/08_rope/rope.cu — reference solution of module 08 (contract: rope.h).
//
// RoPE is a pointwise rotation: every element of q and k is read once and written once, with a
// handful of FLOPs in between, so the target is the copy rate. What is not pointwise is the
// angle: cos and sin of p·theta_k depend on the position p and the pair k, but not on the head.
// A Llama-style layer at 16384 tokens has 32 query and 8 key heads of 128 dimensions: 40 heads
// share each (p, k). A thread that took one token and walked all 40 heads with one cos/sin would
// fetch it least often, but the GPU would then touch a little of every token at once, scattered
// over all of q and k, and that measured 0.86 of the copy rate on an H200. So a thread takes
// a few heads of one token, the grid walks memory in order like a copy kernel, and cos/sin is
// fetched for 2 heads or computed for 4: 0.907 (table) and 0.92 (on the fly) in the same runs.
//
// Where cos/sin come from:
//   cache      a table built once per model (in double, stored as fp32: 8 bytes per (p, k)).
//              Per token it is d/2 · 8 = 512 bytes against 40 heads · 128 · 2 · 2 = 20 KiB of q/k
//              traffic, ~2.5% more bytes, and a table of 4096 positions (2 MiB) stays in L2,
//              where the 20 reads of each row (one per 2 heads) find it.
//   on the fly cos/sin per (p, k): no extra bytes but real instructions, shared by 4 heads and
//              hidden under the memory time. The trap is precision: p·theta_k rounded to
//              fp32 is off by up to p · 2^-24 radians (0.004 at p = 65536, as large as a bf16
//              rounding of the output), and theta_k itself carries a few fp32 ulps that p
//              multiplies. So the angle is formed in double, reduced to [-π, π] in double, and
//              only then handed to the fp32 sincosf, whose small argument it handles exactly to
//              a few ulps: as accurate as the table at any position below 2^31 (beyond ~2^40
//              the double angle's own rounding reaches a bf16 rounding's size).
//
// Vector accesses: interleaved pairs (2k, 2k+1) are adjacent, so 8 bf16 = 4 pairs per 16-byte
// load; half-split pairs (k, k + d/2) come from two 16-byte loads of 8 elements each, one per half.
// Head dims that do not allow it (or unaligned pointers) take one pair at a time.
#include <climits>
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/device/rows.cuh"
#include "rope.h"

namespace k2c::rope {
namespace {

using k2c::rows::aligned16;
using k2c::rows::Bits;
using k2c::rows::load_bits;
using k2c::rows::pack;
using k2c::rows::store_bits;
using k2c::rows::unpack;

// The elements of one head that a thread rotates, kept as the bits they were loaded as (as the
// row kernels of modules 06 and 07 do: half the registers of floats): one 16-byte piece when
// interleaved, one from each half when half-split (single elements when PAIRS == 1).
template <Layout L, int PAIRS>
struct Slice {
  static constexpr int kFirst = L == Layout::interleaved ? 2 * PAIRS : PAIRS;
  Bits<bf16, kFirst> first;
  Bits<bf16, PAIRS> second;  // unused when interleaved
};

template <Layout L, int PAIRS>
__device__ __forceinline__ Slice<L, PAIRS> load_slice(const bf16* head, int d, int u) {
  Slice<L, PAIRS> sl{};
  if constexpr (L == Layout::interleaved && PAIRS == 1)  // two elements: any alignment
    sl.first = __bfloat16_as_ushort(head[2 * u]) |
               static_cast<unsigned>(__bfloat16_as_ushort(head[2 * u + 1])) << 16;
  else
    sl.first = load_bits<bf16, Slice<L, PAIRS>::kFirst>(head + Slice<L, PAIRS>::kFirst * u);
  if constexpr (L == Layout::half_split) sl.second = load_bits<bf16, PAIRS>(head + d / 2 + PAIRS * u);
  return sl;
}

template <Layout L, int PAIRS>
__device__ __forceinline__ void rotate_slice(const Slice<L, PAIRS>& sl, bf16* head, int d, int u,
                                             const float (&c)[PAIRS], const float (&s)[PAIRS]) {
  constexpr int kFirst = Slice<L, PAIRS>::kFirst;
  float first[kFirst], a[PAIRS], b[PAIRS];
  unpack<bf16, kFirst>(sl.first, first);
  if constexpr (L == Layout::half_split) unpack<bf16, PAIRS>(sl.second, b);
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    if constexpr (L == Layout::interleaved)
      a[i] = first[2 * i], b[i] = first[2 * i + 1];
    else
      a[i] = first[i];
    const float ra = a[i] * c[i] - b[i] * s[i];
    b[i] = a[i] * s[i] + b[i] * c[i];
    a[i] = ra;
  }
  if constexpr (L == Layout::interleaved && PAIRS == 1) {
    head[2 * u] = __float2bfloat16(a[0]);
    head[2 * u + 1] = __float2bfloat16(b[0]);
  } else if constexpr (L == Layout::interleaved) {
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) first[2 * i] = a[i], first[2 * i + 1] = b[i];
    store_bits<bf16, kFirst>(head + kFirst * u, pack<bf16, kFirst>(first));
  } else {
    store_bits<bf16, PAIRS>(head + PAIRS * u, pack<bf16, PAIRS>(a));
    store_bits<bf16, PAIRS>(head + d / 2 + PAIRS * u, pack<bf16, PAIRS>(b));
  }
}

// Heads a thread rotates with one cos/sin. One would fetch or compute every cos/sin 40 times at
// the Llama shape (0.85 and 0.62 of the copy rate on an H200). Computed for 3 or 4 heads they made
// 0.92 (2: 0.845); the table is best read for 2 heads (0.907, against 0.904 for 3 or 4 and 0.896
// for 8).
template <bool kTable>
constexpr int kHeadsPerThread = kTable ? 2 : 4;

// One thread per (token, group u of PAIRS pairs, G heads j, j + J, ..., j + (G-1)·J), where a
// token's heads are its q heads followed by its k heads and J = ceil(heads / G). Consecutive
// threads take consecutive groups, then consecutive j: a warp reads whole 128-byte pieces of
// neighbouring heads (d = 128), and the grid sweeps q and k in memory order, as a copy does.
// kTable: cos/sin from the table, else computed. Separate kernels, so that each holds registers
// for its own path only: 56 and 72 a thread at d = 128 half-split (a first version with both paths
// in one kernel, and its slices held as bf16 structs rather than bits, took 108).
template <Layout L, int PAIRS, bool kTable>
__global__ void rope_kernel(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, long tokens, int seq,
                            int q_heads, int kv_heads, int d, long offset, float sign,
                            const float2* __restrict__ cache, double log2_base, double ratio) {
  constexpr int G = kHeadsPerThread<kTable>;
  const int units = d / 2 / PAIRS, heads = q_heads + kv_heads, J = (heads + G - 1) / G;
  const long slots = static_cast<long>(J) * units;
  const long idx = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * slots) return;
  const long token = idx / slots, r = idx % slots;  // slots may pass 2^31 (long head rows)
  const int j = static_cast<int>(r / units), u = static_cast<int>(r % units);
  const long p = offset + token % seq;
  auto head = [&](int g) { return j + static_cast<long>(g) * J; };  // may pass 2^31 when g > 0
  auto row = [&](auto* qs, auto* ks, long h) {
    return h < q_heads ? qs + (token * q_heads + h) * d : ks + (token * kv_heads + h - q_heads) * d;
  };

  // Every head's slice is loaded before any is stored: out may alias in (in place), so the compiler
  // may not hoist a later head's load above an earlier head's store by itself.
  Slice<L, PAIRS> sl[G];
#pragma unroll
  for (int g = 0; g < G; ++g)
    if (head(g) < heads) sl[g] = load_slice<L, PAIRS>(row(q, k, head(g)), d, u);

  float c[PAIRS], s[PAIRS];
  if constexpr (kTable) {
    const float2* cs = cache + p * (d / 2) + u * PAIRS;
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const float2 v = cs[i];
      c[i] = v.x;
      s[i] = sign * v.y;
    }
  } else {
    // The angle in double, reduced to [-π, π] before the fp32 sincosf: see the top of the file.
    // theta of the first pair by exp2, the next ones by one multiplication each (theta_{k+1} =
    // theta_k · base^(-2/d), a relative error of a few double ulps after 8 steps).
    constexpr double kTwoPi = 6.283185307179586, kInvTwoPi = 0.15915494309189535;
    double theta = exp2(-2.0 * (u * PAIRS) / d * log2_base);
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const double angle = static_cast<double>(p) * theta;
      sincosf(static_cast<float>(fma(-kTwoPi, rint(angle * kInvTwoPi), angle)), &s[i], &c[i]);
      s[i] *= sign;
      theta *= ratio;
    }
  }

#pragma unroll
  for (int g = 0; g < G; ++g)
    if (head(g) < heads) rotate_slice<L, PAIRS>(sl[g], row(q_out, k_out, head(g)), d, u, c, s);
}

template <Layout L, int PAIRS, bool kTable>
void launch(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, const Shape& sh, long offset, float sign,
            const float2* cache, double base, cudaStream_t stream) {
  constexpr int G = kHeadsPerThread<kTable>, kThreads = 256;
  const long tokens = static_cast<long>(sh.batch) * sh.seq;
  const long threads = tokens * ((sh.q_heads + sh.kv_heads + G - 1) / G) * (sh.head_dim / 2 / PAIRS);
  const double log2_base = std::log2(base);
  rope_kernel<L, PAIRS, kTable><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      q, k, q_out, k_out, tokens, sh.seq, sh.q_heads, sh.kv_heads, sh.head_dim, offset, sign, cache, log2_base,
      std::exp2(-2.0 / sh.head_dim * log2_base));
}

template <Layout L, int PAIRS>
void launch(const bf16* q, const bf16* k, bf16* q_out, bf16* k_out, const Shape& sh, long offset, float sign,
            const float2* cache, double base, cudaStream_t stream) {
  if (cache != nullptr)
    launch<L, PAIRS, true>(q, k, q_out, k_out, sh, offset, sign, cache, base, stream);
  else
    launch<L, PAIRS, false>(q, k, q_out, k_out, sh, offset, sign, cache, base, stream);
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
  K2C_CHECK(shape.q_heads <= INT_MAX - 8 - shape.kv_heads,
            "rope: q_heads + kv_heads must stay below 2^31 - 8, got " << shape.q_heads << " + " << shape.kv_heads);
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
