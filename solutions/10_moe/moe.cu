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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/check.h"
#include "k2c/hopper.cuh"
#include "k2c/tensor_core.cuh"
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

// ================================================================================================
// Router
// ================================================================================================

constexpr int kRouteWarps = 4;  // tokens per block: two E-float arrays per warp in shared memory

// The better of (value, index) pairs: larger value, then lower index (the contract's tie rule).
__device__ __forceinline__ bool better(float v, int i, float best_v, int best_i) {
  return v > best_v || (v == best_v && i < best_i);
}
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oi = __shfl_xor_sync(kFull, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// A warp per token. Scores and selection keys live in shared memory; each of the k rounds of
// the top-k is a warp-wide arg-max, after which the winner's key is set to −∞.
__global__ void __launch_bounds__(32 * kRouteWarps)
    route_kernel(RouterConfig c, int tokens, const float* __restrict__ logits, const float* __restrict__ bias,
                 float* __restrict__ scores, int* __restrict__ expert, float* __restrict__ weight) {
  __shared__ float s_all[kRouteWarps][kMaxExperts], key_all[kRouteWarps][kMaxExperts];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kRouteWarps + warp;
  if (t >= tokens) return;
  const int E = c.experts;
  float* s = s_all[warp];
  float* key = key_all[warp];
  const float* z = logits + static_cast<std::size_t>(t) * E;

  if (c.score == Score::softmax) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, z[e]);
    m = warp_max(m);
    float sum = 0;
    for (int e = lane; e < E; e += 32) sum += (s[e] = expf(z[e] - m));
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) s[e] /= sum;
  } else {
    for (int e = lane; e < E; e += 32) s[e] = 1.0f / (1.0f + expf(-z[e]));
  }
  for (int e = lane; e < E; e += 32) {
    scores[static_cast<std::size_t>(t) * E + e] = s[e];
    key[e] = s[e] + (bias ? bias[e] : 0.0f);
  }
  __syncwarp();

  if (c.groups > 1) {
    // Lane g scores group g by its two best keys; top_groups arg-max rounds pick the groups.
    const int per = E / c.groups;
    float score = -INFINITY;
    if (lane < c.groups) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int e = lane * per; e < (lane + 1) * per; ++e) {
        const float v = key[e];
        if (v > b1) b2 = b1, b1 = v;
        else if (v > b2) b2 = v;
      }
      score = per > 1 ? b1 + b2 : b1;
    }
    bool eligible = false;
    for (int r = 0; r < c.top_groups; ++r) {
      float v = lane < c.groups && !eligible ? score : -INFINITY;
      int i = lane < c.groups && !eligible ? lane : kMaxGroups;
      warp_argmax(v, i);
      if (lane == i) eligible = true;
    }
    const unsigned mask = __ballot_sync(kFull, eligible);
    for (int e = lane; e < E; e += 32)
      if (!((mask >> (e / per)) & 1u)) key[e] = -INFINITY;
    __syncwarp();
  }

  // Top-k. Lane j keeps choice j's expert and score.
  int mine = 0;
  float mine_s = 0;
  for (int j = 0; j < c.top_k; ++j) {
    float v = -INFINITY;
    int i = kMaxExperts;
    for (int e = lane; e < E; e += 32)
      if (better(key[e], e, v, i)) v = key[e], i = e;
    warp_argmax(v, i);
    if (i >= E) i = j;  // only NaN keys left: any index in range will do
    if (lane == j) mine = i, mine_s = s[i];
    __syncwarp();
    if (lane == 0) key[i] = -INFINITY;
    __syncwarp();
  }
  const bool normalize = c.normalize || c.score == Score::sigmoid;
  const float total = warp_sum(lane < c.top_k ? mine_s : 0.0f);
  if (lane < c.top_k) {
    const std::size_t at = static_cast<std::size_t>(t) * c.top_k + lane;
    expert[at] = mine;
    weight[at] = (normalize ? mine_s / total : mine_s) * c.route_scale;
  }
}

__global__ void count_kernel(long long choices, int experts, const int* __restrict__ expert, int* __restrict__ counts) {
  for (long long a = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; a < choices;
       a += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int e = expert[a];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
  }
}

// A warp per token: p = softmax(z), the token's share of the loss, and dz = p ∘ (g − p·g) with
// g_i = c · count_i.
__global__ void balance_kernel(int tokens, int experts, float c, const float* __restrict__ logits,
                               const int* __restrict__ counts, float* __restrict__ loss, float* __restrict__ dlogits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * (blockDim.x / 32) + warp;
  if (t >= tokens) return;
  const float* z = logits + static_cast<std::size_t>(t) * experts;
  float m = -INFINITY;
  for (int e = lane; e < experts; e += 32) m = fmaxf(m, z[e]);
  m = warp_max(m);
  float sum = 0;
  for (int e = lane; e < experts; e += 32) sum += expf(z[e] - m);
  sum = warp_sum(sum);
  float pg = 0;
  for (int e = lane; e < experts; e += 32) pg += expf(z[e] - m) / sum * c * counts[e];
  pg = warp_sum(pg);
  for (int e = lane; e < experts; e += 32) {
    const float p = expf(z[e] - m) / sum;
    dlogits[static_cast<std::size_t>(t) * experts + e] = p * (c * counts[e] - pg);
  }
  if (lane == 0) atomicAdd(loss, pg);
}

// ================================================================================================
// Dispatch: a stable counting sort of the tokens·top_k choices by expert.
//   1. chunk_rank_kernel  per chunk of 256 choices: each choice's rank among the chunk's earlier
//                         choices of the same expert (warp: match_any + popc; across warps:
//                         per-warp counts in shared memory), and the chunk's count per expert.
//   2. scan_kernel        per expert, the chunks' counts become each chunk's first rank; then
//                         the kept counts (capped) and their prefix sums, the offsets.
//   3. scatter_kernel     slot = offsets[e] + rank, or −1 beyond the capacity.
// Atomics would give the same counts but a different order on every run; this order is the
// reference's (token, then choice) on every run.
// ================================================================================================

constexpr int kChunk = 256, kChunkWarps = kChunk / 32;

__global__ void __launch_bounds__(kChunk)
    chunk_rank_kernel(long long choices, int experts, const int* __restrict__ expert, int* __restrict__ rank,
                      int* __restrict__ chunk_counts) {
  extern __shared__ int warp_counts[];  // [kChunkWarps][experts]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kChunkWarps * experts; i += kChunk) warp_counts[i] = 0;
  __syncthreads();
  const long long a = blockIdx.x * static_cast<long long>(kChunk) + threadIdx.x;
  int e = a < choices ? expert[a] : -1;
  if (e >= experts) e = -1;  // out of range: counted nowhere (scatter_kernel drops it)
  const bool valid = e >= 0;
  const unsigned same = __match_any_sync(kFull, e);
  const int below = __popc(same & ((1u << lane) - 1));
  if (valid && below == 0) warp_counts[warp * experts + e] = __popc(same);
  __syncthreads();
  if (valid) {
    int r = below;
    for (int w = 0; w < warp; ++w) r += warp_counts[w * experts + e];
    rank[a] = r;
  }
  for (int x = threadIdx.x; x < experts; x += kChunk) {
    int total = 0;
    for (int w = 0; w < kChunkWarps; ++w) total += warp_counts[w * experts + x];
    chunk_counts[blockIdx.x * static_cast<long long>(experts) + x] = total;
  }
}

// Exclusive prefix sums of count(0), count(1), ... into prefix[0..n), and their total into
// prefix[n], by one warp: lane l sums a run of consecutive items, the lanes scan their sums with
// shuffles, and each lane writes its run. Used for dispatch's offsets and for the grouped GEMMs'
// first tile of each group.
template <class Count>
__device__ __forceinline__ void warp_prefix(int n, Count count, int* prefix) {
  const int lane = threadIdx.x % 32, per = ceil_div(n, 32), lo = min(n, lane * per), hi = min(n, lo + per);
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += count(i);
  int inclusive = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, inclusive, o);
    if (lane >= o) inclusive += v;
  }
  int run = inclusive - sum;
  for (int i = lo; i < hi; ++i) {
    prefix[i] = run;
    run += count(i);
  }
  if (lane == 31) prefix[n] = inclusive;
}

// The group of tile t: the last g with prefix[g] <= t (an empty group shares its prefix with
// the next one, which the search lands on).
__device__ __forceinline__ int group_of(const int* prefix, int groups, int t) {
  int lo = 0, hi = groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

// One block of up to 1024 threads, a thread per expert.
__global__ void __launch_bounds__(kMaxExperts)
    scan_kernel(int chunks, int experts, int capacity, int* __restrict__ chunk_counts, int* __restrict__ counts,
                int* __restrict__ offsets) {
  __shared__ int kept[kMaxExperts];
  const int e = threadIdx.x;
  if (e < experts) {
    int run = 0;
    for (int ch = 0; ch < chunks; ++ch) {
      int* p = chunk_counts + static_cast<long long>(ch) * experts + e;
      const int n = *p;
      *p = run;
      run += n;
    }
    kept[e] = capacity >= 0 ? min(run, capacity) : run;
    counts[e] = kept[e];
  }
  __syncthreads();
  if (threadIdx.x < 32) warp_prefix(experts, [&](int x) { return kept[x]; }, offsets);
}

__global__ void scatter_kernel(long long choices, int experts, int top_k, int capacity, const int* __restrict__ expert,
                               const int* __restrict__ rank, const int* __restrict__ chunk_base,
                               const int* __restrict__ offsets, int* __restrict__ slot, int* __restrict__ source) {
  for (long long a = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; a < choices;
       a += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int e = expert[a];
    int s = -1;
    if (e >= 0 && e < experts) {
      const int r = chunk_base[(a / kChunk) * experts + e] + rank[a];
      if (capacity < 0 || r < capacity) {
        s = offsets[e] + r;
        source[s] = static_cast<int>(a / top_k);
      }
    }
    slot[a] = s;
  }
}

// ================================================================================================
// Permute, combine, SwiGLU: memory-bound, 16-byte pieces (8 bf16) per thread.
// ================================================================================================

struct alignas(16) Pack8 {
  __nv_bfloat162 h[4];
};
__device__ __forceinline__ void unpack(const Pack8& p, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(p.h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ Pack8 pack(const float (&f)[8]) {
  Pack8 p;
#pragma unroll
  for (int i = 0; i < 4; ++i) p.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return p;
}

// A warp per choice copies the token's row to its slot.
__global__ void permute_kernel(long long choices, int hidden, int top_k, const Pack8* __restrict__ x,
                               const int* __restrict__ slot, Pack8* __restrict__ rows) {
  const long long a = blockIdx.x * static_cast<long long>(blockDim.x / 32) + threadIdx.x / 32;
  if (a >= choices) return;
  const int s = slot[a];
  if (s < 0) return;
  const int pieces = hidden / 8;
  const Pack8* src = x + (a / top_k) * pieces;
  Pack8* dst = rows + static_cast<long long>(s) * pieces;
  for (int i = threadIdx.x % 32; i < pieces; i += 32) dst[i] = src[i];
}

// A block per token gathers its k rows: no atomics, so every run adds in the same order.
__global__ void combine_kernel(int hidden, int top_k, const Pack8* __restrict__ rows, const int* __restrict__ slot,
                               const float* __restrict__ weight, const float* __restrict__ residual,
                               Pack8* __restrict__ y) {
  const long long t = blockIdx.x;
  const int pieces = hidden / 8;
  for (int i = threadIdx.x; i < pieces; i += blockDim.x) {
    float acc[8] = {};
    if (residual) {
      const float4* r = reinterpret_cast<const float4*>(residual + t * hidden + 8 * i);
      const float4 lo = r[0], hi = r[1];
      acc[0] = lo.x, acc[1] = lo.y, acc[2] = lo.z, acc[3] = lo.w;
      acc[4] = hi.x, acc[5] = hi.y, acc[6] = hi.z, acc[7] = hi.w;
    }
    for (int j = 0; j < top_k; ++j) {
      const int s = slot[t * top_k + j];
      if (s < 0) continue;
      const float w = weight ? weight[t * top_k + j] : 1.0f;
      float v[8];
      unpack(rows[static_cast<long long>(s) * pieces + i], v);
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = fmaf(w, v[c], acc[c]);
    }
    y[t * pieces + i] = pack(acc);
  }
}

__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + __expf(-a)); }

// h[r][i] = silu(gu[r][i]) · gu[r][ffn + i].
__global__ void swiglu_kernel(long long rows, int ffn, const Pack8* __restrict__ gu, Pack8* __restrict__ h) {
  const int pieces = ffn / 8;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < rows * pieces;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / pieces, p = i % pieces;
    float g[8], u[8], out[8];
    unpack(gu[r * 2 * pieces + p], g);
    unpack(gu[r * 2 * pieces + pieces + p], u);
#pragma unroll
    for (int c = 0; c < 8; ++c) out[c] = g[c] * sigmoid(g[c]) * u[c];
    h[i] = pack(out);
  }
}

// dg = dh · u · σ(g)(1 + g(1 − σ(g))), du = dh · silu(g).
__global__ void swiglu_backward_kernel(long long rows, int ffn, const Pack8* __restrict__ gu, const Pack8* __restrict__ dh,
                                       Pack8* __restrict__ dgu) {
  const int pieces = ffn / 8;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < rows * pieces;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / pieces, p = i % pieces;
    float g[8], u[8], d[8], dg[8], du[8];
    unpack(gu[r * 2 * pieces + p], g);
    unpack(gu[r * 2 * pieces + pieces + p], u);
    unpack(dh[i], d);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float sg = sigmoid(g[c]);
      dg[c] = d[c] * u[c] * sg * (1.0f + g[c] * (1.0f - sg));
      du[c] = d[c] * g[c] * sg;
    }
    dgu[r * 2 * pieces + p] = pack(dg);
    dgu[r * 2 * pieces + pieces + p] = pack(du);
  }
}

// Combine's backward, a warp per choice: d_out[slot] = w · dy[t] and dw = ⟨dy[t], out[slot]⟩.
__global__ void combine_backward_kernel(long long choices, int hidden, int top_k, const Pack8* __restrict__ dy,
                                        const Pack8* __restrict__ out, const int* __restrict__ slot,
                                        const float* __restrict__ weight, Pack8* __restrict__ d_out,
                                        float* __restrict__ dw) {
  const long long a = blockIdx.x * static_cast<long long>(blockDim.x / 32) + threadIdx.x / 32;
  if (a >= choices) return;
  const int lane = threadIdx.x % 32, s = slot[a], pieces = hidden / 8;
  if (s < 0) {
    if (lane == 0) dw[a] = 0;
    return;
  }
  const float w = weight[a];
  const Pack8* g = dy + (a / top_k) * pieces;
  float dot = 0;
  for (int i = lane; i < pieces; i += 32) {
    float gv[8], ov[8], d[8];
    unpack(g[i], gv);
    unpack(out[static_cast<long long>(s) * pieces + i], ov);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      dot = fmaf(gv[c], ov[c], dot);
      d[c] = w * gv[c];
    }
    d_out[static_cast<long long>(s) * pieces + i] = pack(d);
  }
  dot = warp_sum(dot);
  if (lane == 0) dw[a] = dot;
}

// The router's backward, a warp per token: weights → scores (through the normalisation) → logits
// (through softmax or sigmoid), plus dlogits_extra; written as bf16 for the two GEMMs that take
// it to w_router and x.
__global__ void __launch_bounds__(32 * kRouteWarps)
    router_backward_kernel(RouterConfig c, int tokens, const float* __restrict__ scores, const int* __restrict__ expert,
                           const float* __restrict__ dw, const float* __restrict__ extra, bf16* __restrict__ dlogits) {
  __shared__ float ds_all[kRouteWarps][kMaxExperts];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kRouteWarps + warp;
  if (t >= tokens) return;
  const int E = c.experts, k = c.top_k;
  const float* s = scores + static_cast<std::size_t>(t) * E;
  float* ds = ds_all[warp];
  for (int e = lane; e < E; e += 32) ds[e] = 0;
  const bool normalize = c.normalize || c.score == Score::sigmoid;
  const int e_mine = lane < k ? expert[static_cast<std::size_t>(t) * k + lane] : 0;
  const float s_mine = lane < k ? s[e_mine] : 0.0f, dw_mine = lane < k ? dw[static_cast<std::size_t>(t) * k + lane] : 0.0f;
  const float S = normalize ? warp_sum(s_mine) : 1.0f;
  const float mix = normalize ? warp_sum(dw_mine * s_mine) / S : 0.0f;
  __syncwarp();
  for (int j = 0; j < k; ++j)  // choices are distinct experts, but one lane at a time keeps it plain
    if (lane == j) ds[e_mine] += c.route_scale / S * (dw_mine - mix);
  __syncwarp();
  float sds = 0;
  if (c.score == Score::softmax) {
    for (int e = lane; e < E; e += 32) sds += s[e] * ds[e];
    sds = warp_sum(sds);
  }
  for (int e = lane; e < E; e += 32) {
    const float dz = c.score == Score::softmax ? s[e] * (ds[e] - sds) : ds[e] * s[e] * (1.0f - s[e]);
    const std::size_t at = static_cast<std::size_t>(t) * E + e;
    dlogits[at] = __float2bfloat16(dz + (extra ? extra[at] : 0.0f));
  }
}

__global__ void one_group_kernel(int* offsets, int rows) {
  offsets[0] = 0;
  offsets[1] = rows;
}

// ================================================================================================
// The grouped GEMM
// ================================================================================================

// In GEMM terms every variant computes C[m][n] = Σ_r A(m, r) · B(n, r), per group:
//   Mode::rows       groups split the rows of A and C (forward and dX); r runs over k.
//   Mode::reduction  groups split r (dW): C_g is [m][n] = [dY's width][X's width].
// An operand is K-contiguous (r fastest in memory) or MN-contiguous (m or n fastest).
enum class Mode { rows, reduction };

template <class OutT>
struct GemmArgs {
  int groups;
  const int* offsets;
  int m, n, k;  // m: reduction mode only (rows mode takes each group's rows from offsets)
  const bf16* a;
  const bf16* b;
  OutT* c;
  bool accumulate, pairs;
};

template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_, int BLOCKS_PER_SM_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, BK = 64, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr int kBlocksPerSm = BLOCKS_PER_SM_;
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MT = WM / 16, NT = WN / 8;
  static constexpr int kTileA = BM * BK * 2, kTileB = BN * BK * 2, kStageBytes = kTileA + kTileB;
  static constexpr int kSmemBytes = STAGES * kStageBytes;
  static_assert(WM % 16 == 0 && WN % 16 == 0 && BM >= 64 && BN >= 64, "whole mma tiles; swizzled rows of 128 bytes or more");
  static_assert(kBlocksPerSm * (kSmemBytes + 4 * (kMaxExperts + 1)) <= 227 * 1024,
                "stages and the tile prefix fit in shared memory");
};

// 128×256 with 8 warps of 64×64, 4 stages, one block per SM. Measured on an H200 at the module's
// up projection (lab/moe_grouped.cu): 328.9 TFLOP/s; module 05's 256×128 313.1;
// 128×128 with 4 warps and 2 blocks per SM 320.4; with 8 warps 294.5; 256×128 with 3 stages 316.8.
using Reference = Tile<128, 256, 2, 4, 4, 1>;

// Byte offset of 16-byte chunk `chunk` of row `row`, rows of `row_bytes` (a multiple of 128):
// chunk c of row r lives at c ^ (r % 8), so 8 consecutive rows read at one chunk hit 8 different
// 16-byte bank groups: ldmatrix (8 rows, one chunk) is conflict-free in both tile shapes.
template <int kRowBytes>
__device__ __forceinline__ std::uint32_t swz(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// One 16-byte chunk of a tile: the 8 elements src[row · ld + col ..], zeros where the row is
// outside (row_ok false) or an element lies at or past col_end. With kVector, col_end and ld
// are multiples of 8, so a chunk is wholly inside or wholly outside and cp.async moves it.
template <bool kVector>
__device__ __forceinline__ void copy_chunk(std::uint32_t dst, const bf16* src, long long ld, int row, bool row_ok,
                                           int col, int col_end) {
  if constexpr (kVector) {
    const bool inside = row_ok && col < col_end;
    tc::cp_async_16(dst, inside ? src + row * ld + col : src, inside);
  } else {
    alignas(16) bf16 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = row_ok && col + j < col_end ? src[row * ld + col + j] : __float2bfloat16(0.0f);
    const uint4 p = *reinterpret_cast<const uint4*>(v);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(p.x), "r"(p.y), "r"(p.z), "r"(p.w));
  }
}

// A K-contiguous tile: ROWS rows × 64 reduction elements (128 bytes a row). Element (row, r) of
// the source is src[row · ld + r]; rows >= row_end and r >= r_end are zero-filled.
template <class T, int ROWS, bool kVector>
__device__ __forceinline__ void load_k_tile(std::uint32_t tile, const bf16* src, long long ld, int row0, int row_end,
                                            int r0, int r_end) {
#pragma unroll
  for (int i = 0; i < ROWS * 8 / T::kThreads; ++i) {
    const int id = i * T::kThreads + threadIdx.x, row = id >> 3, ch = id & 7;
    copy_chunk<kVector>(tile + swz<128>(row, ch), src, ld, row0 + row, row0 + row < row_end, r0 + ch * 8, r_end);
  }
}

// An MN-contiguous tile: 64 reduction rows × COLS elements (2·COLS bytes a row). Element (r, col)
// of the source is src[r · ld + col]; r >= r_end and col >= col_end are zero-filled.
template <class T, int COLS, bool kVector>
__device__ __forceinline__ void load_mn_tile(std::uint32_t tile, const bf16* src, long long ld, int r0, int r_end,
                                             int col0, int col_end) {
  constexpr int kChunks = COLS / 8;
#pragma unroll
  for (int i = 0; i < 64 * kChunks / T::kThreads; ++i) {
    const int id = i * T::kThreads + threadIdx.x, row = id / kChunks, ch = id % kChunks;
    copy_chunk<kVector>(tile + swz<COLS * 2>(row, ch), src, ld, r0 + row, r0 + row < r_end, col0 + ch * 8, col_end);
  }
}

template <class OutT>
__device__ __forceinline__ void store_pair(OutT* p, bool both, bool pairs, bool accumulate, float v0, float v1) {
  if (accumulate) {
    v0 += static_cast<float>(p[0]);
    if (both) v1 += static_cast<float>(p[1]);
  }
  if (both && pairs) {
    if constexpr (sizeof(OutT) == 2) {
      *reinterpret_cast<std::uint32_t*>(p) = tc::pack_bf16x2(v0, v1);
    } else {
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    }
  } else {
    p[0] = static_cast<OutT>(v0);
    if (both) p[1] = static_cast<OutT>(v1);
  }
}

template <class T, Mode kMode, bool kAK, bool kBK, bool kVector, class OutT>
__global__ void __launch_bounds__(T::kThreads, T::kBlocksPerSm) grouped_kernel(GemmArgs<OutT> p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int prefix[kMaxExperts + 1];  // prefix[g]: the first tile of group g
  const std::uint32_t smem0 = smem_addr(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / T::WARPS_N, warp_n = warp % T::WARPS_N;
  const int tiles_n = ceil_div(p.n, T::BN);

  // Each group's first tile.
  auto tiles_of = [&](int g) {
    return (kMode == Mode::rows ? ceil_div(p.offsets[g + 1] - p.offsets[g], T::BM) : ceil_div(p.m, T::BM)) * tiles_n;
  };
  if (warp == 0) warp_prefix(p.groups, tiles_of, prefix);
  __syncthreads();
  const int total = prefix[p.groups];

  auto stage_a = [&](int s) { return smem0 + s * T::kStageBytes; };
  auto stage_b = [&](int s) { return smem0 + s * T::kStageBytes + T::kTileA; };

  // ldmatrix lane roles (module 05 for K-contiguous tiles; the transposed reads below).
  //   A, K-contiguous:  lanes 0-15 rows 0-15 at chunk 0, lanes 16-31 the same rows at chunk 1.
  //   A, MN-contiguous: matrix q = lane / 8 is (r 0-7 | 8-15) × (m 0-7 | 8-15) in a0..a3 order:
  //                     r row (lane % 8) + 8·(lane / 16), m chunk + (lane / 8) % 2.
  //   B, K-contiguous:  lanes 0-7 rows 0-7 chunk 0, 8-15 rows 0-7 chunk 1, 16-23 rows 8-15
  //                     chunk 0, 24-31 rows 8-15 chunk 1.
  //   B, MN-contiguous: r row (lane % 8) + 8·((lane / 8) % 2), n chunk + lane / 16.
  const int ak_row = warp_m * T::WM + (lane & 15), ak_chunk = lane >> 4;
  const int amn_row = (lane & 7) + ((lane >> 4) << 3), amn_chunk = (warp_m * T::WM) / 8 + ((lane >> 3) & 1);
  const int bk_row = warp_n * T::WN + (lane & 7) + ((lane >> 4) << 3), bk_chunk = (lane >> 3) & 1;
  const int bmn_row = (lane & 7) + (((lane >> 3) & 1) << 3), bmn_chunk = (warp_n * T::WN) / 8 + (lane >> 4);

  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const int g = group_of(prefix, p.groups, t), local = t - prefix[g];
    const int row0 = p.offsets[g], rows_g = p.offsets[g + 1] - row0;
    const int M = kMode == Mode::rows ? rows_g : p.m;
    const int R = kMode == Mode::rows ? p.k : rows_g;
    const int tiles_m = ceil_div(M, T::BM);
    // Consecutive tiles go down one column of tiles: blocks running together share B's tile.
    const int m0 = (local % tiles_m) * T::BM, n0 = (local / tiles_m) * T::BN;

    // Operand bases and leading dimensions for this group.
    const bf16 *a, *b;
    long long lda, ldb;
    if constexpr (kMode == Mode::rows) {
      a = p.a + static_cast<long long>(row0) * p.k;
      lda = p.k;
      b = p.b + static_cast<long long>(g) * p.n * p.k;
      ldb = kBK ? p.k : p.n;
    } else {
      a = p.a + static_cast<long long>(row0) * p.m;
      lda = p.m;
      b = p.b + static_cast<long long>(row0) * p.n;
      ldb = p.n;
    }
    auto load_stage = [&](int s, int kt) {
      const int r0 = kt * T::BK;
      if constexpr (kAK) load_k_tile<T, T::BM, kVector>(stage_a(s), a, lda, m0, M, r0, R);
      else load_mn_tile<T, T::BM, kVector>(stage_a(s), a, lda, r0, R, m0, M);
      if constexpr (kBK) load_k_tile<T, T::BN, kVector>(stage_b(s), b, ldb, n0, p.n, r0, R);
      else load_mn_tile<T, T::BN, kVector>(stage_b(s), b, ldb, r0, R, n0, p.n);
    };

    __syncthreads();  // every warp is done with the previous tile's stages
    float acc[T::MT][T::NT][4] = {};
    const int k_tiles = ceil_div(R, T::BK);
#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
      if (s < k_tiles) load_stage(s, s);
      tc::cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      tc::cp_async_wait<T::STAGES - 2>();
      __syncthreads();
      const int next = kt + T::STAGES - 1;
      if (next < k_tiles) load_stage(next % T::STAGES, next);
      tc::cp_async_commit();

      const std::uint32_t sa = stage_a(kt % T::STAGES), sb = stage_b(kt % T::STAGES);
#pragma unroll
      for (int ks = 0; ks < T::BK / 16; ++ks) {
        std::uint32_t af[T::MT][4], bfr[T::NT][2];
#pragma unroll
        for (int mt = 0; mt < T::MT; ++mt) {
          if constexpr (kAK) tc::ldmatrix_x4(af[mt], sa + swz<128>(ak_row + mt * 16, ks * 2 + ak_chunk));
          else tc::ldmatrix_x4_trans(af[mt], sa + swz<T::BM * 2>(ks * 16 + amn_row, amn_chunk + mt * 2));
        }
#pragma unroll
        for (int nt = 0; nt < T::NT; nt += 2) {
          std::uint32_t r[4];
          if constexpr (kBK) tc::ldmatrix_x4(r, sb + swz<128>(bk_row + nt * 8, ks * 2 + bk_chunk));
          else tc::ldmatrix_x4_trans(r, sb + swz<T::BN * 2>(ks * 16 + bmn_row, bmn_chunk + nt));
          bfr[nt][0] = r[0];
          bfr[nt][1] = r[1];
          bfr[nt + 1][0] = r[2];
          bfr[nt + 1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < T::NT; ++nt) tc::mma_bf16_16816(acc[mt][nt], af[mt], bfr[nt]);
      }
    }
    tc::cp_async_wait<0>();

    // Epilogue: rows g8 and g8 + 8, column pairs 2q, of every mma tile.
    OutT* c = kMode == Mode::rows ? p.c + static_cast<long long>(row0) * p.n
                                  : p.c + static_cast<long long>(g) * p.m * p.n;
    const int g8 = lane / 4, q = lane % 4;
#pragma unroll
    for (int mt = 0; mt < T::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < T::NT; ++nt) {
        const int col = n0 + warp_n * T::WN + nt * 8 + 2 * q;
        if (col >= p.n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + warp_m * T::WM + mt * 16 + g8 + 8 * h;
          if (row < M)
            store_pair(c + static_cast<long long>(row) * p.n + col, col + 1 < p.n, p.pairs, p.accumulate,
                       acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
        }
      }
  }
}

// Blocks that fit on the device at once, asked once per device and kernel.
template <class T, class Kernel>
int resident_blocks(Kernel kernel) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> known;
  int device = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int& n = known[{device, reinterpret_cast<const void*>(kernel)}];
  if (n == 0) {
    int sms = 0, per_sm = 0;
    K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    K2C_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, T::kThreads, T::kSmemBytes));
    K2C_CHECK(per_sm > 0, "moe grouped GEMM: the kernel does not fit on this GPU");
    n = sms * per_sm;
  }
  return n;
}

template <Mode kMode, bool kAK, bool kBK, bool kVector, class T = Reference, class OutT>
void launch_gemm(const GemmArgs<OutT>& args, cudaStream_t stream) {
  auto* kernel = grouped_kernel<T, kMode, kAK, kBK, kVector, OutT>;
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  kernel<<<resident_blocks<T>(kernel), T::kThreads, T::kSmemBytes, stream>>>(args);
  K2C_CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <class OutT>
void run_grouped(const char* who, int groups, const int* offsets, int n, int k, const bf16* a, const bf16* b, OutT* c,
                 bool b_transposed, bool accumulate, cudaStream_t stream) {
  check_grouped(groups, n, k, {offsets, a, b, c}, who);
  // Vector copies need every row to start on 16 bytes: n and k multiples of 8, aligned bases.
  const bool vec = n % 8 == 0 && k % 8 == 0 && aligned16(a) && aligned16(b);
  const bool pairs = n % 2 == 0 && reinterpret_cast<std::uintptr_t>(c) % (2 * sizeof(OutT)) == 0;
  const GemmArgs<OutT> args{groups, offsets, 0, n, k, a, b, c, accumulate, pairs};
  if (b_transposed) {
    if (vec) launch_gemm<Mode::rows, true, true, true>(args, stream);
    else launch_gemm<Mode::rows, true, true, false>(args, stream);
  } else {
    if (vec) launch_gemm<Mode::rows, true, false, true>(args, stream);
    else launch_gemm<Mode::rows, true, false, false>(args, stream);
  }
}

}  // namespace

// ================================================================================================
// The contract's entry points
// ================================================================================================

void route(const RouterConfig& c, int tokens, const float* logits, const float* bias, float* scores, int* expert,
           float* weight, cudaStream_t stream) {
  check_router(c, "moe route");
  check_tokens(tokens, c.experts, "moe route");
  if (tokens == 0) return;
  check_pointers("moe route", {logits, scores, expert, weight});
  if (bias) check_pointers("moe route", {bias});
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
  K2C_CHECK(tokens >= 1 && experts >= 1 && experts <= kMaxExperts && top_k >= 1 && top_k <= experts,
            "moe balance_loss: bad sizes (tokens " << tokens << ", experts " << experts << ", top_k " << top_k << ")");
  check_tokens(tokens, experts, "moe balance_loss");
  check_pointers("moe balance_loss", {logits, expert, loss, dlogits, workspace});
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
  K2C_CHECK(hidden >= 8 && hidden % 8 == 0, "moe permute: hidden must be a multiple of 8, got " << hidden);
  check_choices(tokens, top_k, "moe permute");
  check_tokens(static_cast<long long>(tokens) * top_k, hidden, "moe permute");
  if (tokens == 0) return;
  check_pointers("moe permute", {x, slot, rows});
  const long long choices = static_cast<long long>(tokens) * top_k;
  permute_kernel<<<static_cast<unsigned>((choices + 7) / 8), 256, 0, stream>>>(
      choices, hidden, top_k, reinterpret_cast<const Pack8*>(x), slot, reinterpret_cast<Pack8*>(rows));
  K2C_CUDA_CHECK_LAUNCH();
}

void combine(int tokens, int hidden, int top_k, const bf16* rows, const int* slot, const float* weight,
             const float* residual, bf16* y, cudaStream_t stream) {
  K2C_CHECK(hidden >= 8 && hidden % 8 == 0, "moe combine: hidden must be a multiple of 8, got " << hidden);
  check_choices(tokens, top_k, "moe combine");
  check_tokens(static_cast<long long>(tokens) * top_k, hidden, "moe combine");
  if (tokens == 0) return;
  check_pointers("moe combine", {rows, slot, y});
  if (weight) check_pointers("moe combine", {weight});
  if (residual) check_pointers("moe combine", {residual});
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

// ================================================================================================
// Part B: the grouped GEMM on wgmma (module 05's Part B kernel, persistent over groups)
// ================================================================================================
//
//   block     384 threads = 3 warpgroups. Warpgroup 0 produces: one thread issues the TMA copies
//             and the group hands its registers to the others (setmaxnreg 24). Warpgroups 1 and
//             2 consume (setmaxnreg 240): each owns 64 rows of the 128×256 tile, one m64n256
//             accumulator of 128 fp32 registers a thread.
//   ring      STAGES slots of an A tile (128×64) and a B tile (256×64), written by TMA with
//             128-byte swizzling; full[s] completes on the copies' bytes, empty[s] on one
//             arrival per consumer warp.
//   forms     as in grouped_kernel, C[m][n] = Σ_r A(m, r) B(n, r):
//             forward  A and B K-major: TMA boxes of 128 rows of 64 r, one of A, two of B;
//             dX       B MN-major (W read untransposed): four boxes of 64 r-rows × 64 n, read
//                      through MN-major descriptors with wgmma's transpose flag;
//             dW       A and B MN-major (dY and X, r = the group's rows), the groups splitting r.
//   groups    A tile of group g reads A from row offsets[g] + m0 (forward, dX) and B from row
//             g·(n or k) + n0; rows past the group's end (the next group's, or TMA's zero fill)
//             are multiplied but never stored. In the dW form they would be summed: the last k
//             step of a tile clears them in shared memory before the wgmma reads the slot.
//             Producer and consumers walk the same tile sequence, each finding a tile's group in
//             the prefix of tile counts that the block computes first.
//   tails     a group's last tile row is on average half empty (a group of 1560 rows ends in a
//             tile of 24). Where at most 64 of its rows are real (forward, dX), the consumers
//             split the tile's columns instead of its rows: both read A's first 64 rows, each
//             multiplies them by its 128 columns of B (m64n128), and the tile takes half the MMAs.
//   pairs     (forward and dX forms, measured and not used) blocks could run in clusters of two
//             that take neighbouring tiles of the list, which usually share their B tile (tiles of
//             a group go down a column first): each block fetches half of B and TMA multicasts it
//             into both, so that B crosses from L2 once per pair instead of once per tile (module
//             05's clusters). At this module's shapes their rates were 2.5-11% lower than one block per
//             tile (lab/moe_grouped.cu pairs; lecture section 7).

namespace {

namespace hp = k2c::hopper;

enum class HopperForm { forward, dx, dw };

constexpr int kHopperBM = 128, kHopperBN = 256, kHopperBK = 64, kHopperThreads = 384;
constexpr int kHopperTileA = kHopperBM * kHopperBK * 2, kHopperTileB = kHopperBN * kHopperBK * 2;
constexpr int kHopperStageBytes = kHopperTileA + kHopperTileB;
constexpr int kHopperBox = 64 * 64 * 2;  // one 64 × 64 box of bf16, 128-byte swizzled: 8 KiB
constexpr int kHopperBoxB = kHopperBN / 2;  // rows of a forward-form B box: a tile takes two

// Shared memory of a variant: the ring; with kBoxes > 0, kBoxes 64 × 64 boxes of each consumer's
// 64 × 256 bf16 output slab, staged for TMA stores (all four cost a ring slot: 3 instead of 4);
// the barriers; 1 KiB of slack to align the ring to the 1024 bytes a 128-byte swizzle spans. The
// prefix of tile counts comes last, one int per group and one more (prefix_bytes).
template <int kBoxes>
struct HopperSmem {
  static constexpr int kStages = kBoxes > 2 ? 3 : 4;
  static constexpr int kStaging = 2 * kBoxes * kHopperBox;
  static constexpr int kBytes = kStages * kHopperStageBytes + kStaging + 2 * kStages * 8 + 1024;
  static_assert(kBytes + 4 * 2 <= 227 * 1024, "the ring, staging and a one-group prefix fit");
};
constexpr int prefix_bytes(int groups) { return 4 * (groups + 1); }
constexpr int kSmemLimit = 227 * 1024;
constexpr int kStagedBoxes = 4;  // what the module's launches stage
static_assert(HopperSmem<kStagedBoxes>::kBytes + prefix_bytes(kMaxExperts) <= kSmemLimit, "every group count fits");

struct HopperArgs {
  int groups;
  const int* offsets;
  int m, n, k;  // m: dW only (C's rows); k: the reduction of the forward and dX forms
  void* c;
  bool pairs;
};

// kBoxes > 0: the epilogue goes through shared memory, kBoxes boxes at a time, and TMA stores (bf16
// C whose rows start on 16 bytes), so that a consumer's last stores overlap its next tile's MMAs
// instead of stalling them; the last kDefer batches wait in registers until the next tile's first
// wgmma groups are issued (hopper::TmaEpilogue; module 05 measures the choices).
//
// kSplitTail: tail tiles with at most 64 real rows split along columns (see "tails" above); false
// only in lab/moe_grouped.cu, which measures what the split is worth.
//
// kCluster = 2 (see "pairs" above): the blocks run in clusters of two, and a cluster takes the
// tiles 2u and 2u + 1 of the list together. Where both lie in one group and one column of tiles
// they need the same B tile, and each block fetches half of it and multicasts the half into both;
// otherwise each fetches its own. A slot may then hold the peer's data, so it is free only when
// the consumers of both blocks are done with it: empty[s] counts the arrivals of both. The two
// blocks therefore step through the ring together, which only the forward and dX forms allow
// (every tile there has the same k blocks); a block whose tile lies past the list's end steps
// through its k blocks without copies or MMAs.
template <HopperForm kForm, class OutT, int kBoxes, int kDefer = 0, bool kSplitTail = true, int kCluster = 1>
__global__ void __launch_bounds__(kHopperThreads, 1)
    hopper_grouped_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ CUtensorMap map_c, HopperArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kCluster == 1 || (kCluster == 2 && kForm != HopperForm::dw),
                "pairs share B in the forward and dX forms only: dW's tiles differ in length");
  constexpr bool kAT = kForm == HopperForm::dw, kBT = kForm != HopperForm::forward;  // MN-major operands
  constexpr int kHopperStages = HopperSmem<kBoxes>::kStages;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t ring = (smem_addr(smem_raw) + 1023) & ~1023u;
  const std::uint32_t staging = ring + kHopperStages * kHopperStageBytes;
  const std::uint32_t bars = staging + HopperSmem<kBoxes>::kStaging;
  int* prefix = reinterpret_cast<int*>(smem_raw + (bars + 16 * kHopperStages - smem_addr(smem_raw)));
  auto slot_a = [&](int s) { return ring + s * kHopperStageBytes; };
  auto slot_b = [&](int s) { return ring + s * kHopperStageBytes + kHopperTileA; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kHopperStages + s); };
  const int tiles_n = ceil_div(p.n, kHopperBN);
  const int warpgroup = threadIdx.x / 128, lane = threadIdx.x % 32;
  auto tiles_of = [&](int g) {
    return (kForm == HopperForm::dw ? ceil_div(p.m, kHopperBM) : ceil_div(p.offsets[g + 1] - p.offsets[g], kHopperBM)) *
           tiles_n;
  };

  if (threadIdx.x < 32) warp_prefix(p.groups, tiles_of, prefix);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kHopperStages; ++s) {
      hp::mbarrier_init(full(s), 1);
      hp::mbarrier_init(empty(s), kCluster * 2 * 4);  // every consumer warp of the cluster
    }
    hp::fence_barrier_init();
  }
  // With pairs, the peer's barriers must be initialised before anyone multicasts into them.
  if constexpr (kCluster > 1)
    hp::cluster_sync();
  else
    __syncthreads();
  const int total = prefix[p.groups];
  const int rank = kCluster > 1 ? static_cast<int>(hp::cluster_rank()) : 0;
  const int cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  // Units of work: unit u is tiles kCluster·u .. kCluster·u + kCluster − 1, this block's the rank-th.
  const int units = ceil_div(total, kCluster);
  // Tile t → its group, the group's first row, its row count, the tile's origin in C, and the
  // reduction length.
  struct Where {
    int g, row0, rows, m0, n0, r;
  };
  auto locate = [&](int t) {
    Where w;
    w.g = group_of(prefix, p.groups, t);
    w.row0 = p.offsets[w.g];
    w.rows = p.offsets[w.g + 1] - w.row0;
    const int tiles_m = kForm == HopperForm::dw ? ceil_div(p.m, kHopperBM) : ceil_div(w.rows, kHopperBM);
    const int local = t - prefix[w.g];
    w.m0 = (local % tiles_m) * kHopperBM;
    w.n0 = (local / tiles_m) * kHopperBN;
    w.r = kForm == HopperForm::dw ? w.rows : p.k;
    return w;
  };
  // Whether unit u's two tiles read the same B tile (same group, same column of tiles).
  auto pair_shares_b = [&](int u) {
    if (kCluster == 1 || kCluster * u + 1 >= total) return false;
    const Where x = locate(kCluster * u), y = locate(kCluster * u + 1);
    return x.g == y.g && x.n0 == y.n0;
  };
  // Arrives on slot s's empty barrier in every block of the cluster (one arrival per warp).
  auto release = [&](int s) {
    hp::mbarrier_arrive(empty(s));
    if constexpr (kCluster > 1) hp::mbarrier_arrive_cluster(empty(s), rank ^ 1);
  };

  if (warpgroup == 0) {
    hp::setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      int it = 0;  // k blocks issued over all tiles: slot it % STAGES, lap it / STAGES
      for (int u = cluster; u < units; u += clusters) {
        const int t = kCluster * u + rank;
        const bool real = t < total;
        const Where w = real ? locate(t) : Where{0, 0, 0, 0, 0, p.k};
        const bool shares_b = pair_shares_b(u);
        // B's parts: 2 boxes of 128 rows (forward) or 4 of 64 columns (dX); with a shared B tile
        // this block fetches the parts of its rank for both blocks, else all of them for itself.
        constexpr int kParts = kForm == HopperForm::forward ? 2 : 4, kPartBytes = kHopperTileB / kParts;
        for (int kb = 0; kb < ceil_div(w.r, kHopperBK); ++kb, ++it) {
          const int s = it % kHopperStages, r0 = kb * kHopperBK;
          hp::mbarrier_wait(empty(s), ((it / kHopperStages) & 1) ^ 1);
          if (!real) {  // no tile: the slot's phase passes with no bytes
            hp::mbarrier_arrive(full(s));
            continue;
          }
          hp::mbarrier_arrive_expect_tx(full(s), kHopperStageBytes);
          if constexpr (kForm != HopperForm::dw) {
            hp::tma_load_2d(slot_a(s), &map_a, full(s), r0, w.row0 + w.m0);
            for (int j = 0; j < kParts; ++j) {
              const std::uint32_t dst = slot_b(s) + j * kPartBytes;
              const int x = kForm == HopperForm::forward ? r0 : w.n0 + 64 * j;
              const int y = kForm == HopperForm::forward ? w.g * p.n + w.n0 + kHopperBoxB * j : w.g * p.k + r0;
              if (!shares_b)
                hp::tma_load_2d(dst, &map_b, full(s), x, y);
              else if (j * kCluster / kParts == rank)
                hp::tma_load_2d_multicast(dst, &map_b, full(s), x, y, (1u << kCluster) - 1);
            }
          } else {
            for (int j = 0; j < 2; ++j)
              hp::tma_load_2d(slot_a(s) + j * kHopperBox, &map_a, full(s), w.m0 + 64 * j, w.row0 + r0);
            for (int j = 0; j < 4; ++j)
              hp::tma_load_2d(slot_b(s) + j * kHopperBox, &map_b, full(s), w.n0 + 64 * j, w.row0 + r0);
          }
        }
      }
    }
  } else {
    hp::setmaxnreg_inc<240>();
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4;
    float d[128];
    hp::TmaEpilogue<(kBoxes > 0 ? kBoxes : 4), kDefer> epilogue{staging + consumer * kBoxes * kHopperBox, &map_c, p.n,
                                                            2 + consumer};
    int it = 0;
    for (int u = cluster; u < units; u += clusters) {
      const int t = kCluster * u + rank;
      if (t >= total) {  // the peer's tile is the list's last: keep the ring's laps in step with it
        for (int kb = 0; kb < ceil_div(p.k, kHopperBK); ++kb, ++it) {
          const int s = it % kHopperStages;
          hp::mbarrier_wait(full(s), (it / kHopperStages) & 1);
          if (lane == 0) release(s);
        }
        continue;
      }
      const Where w = locate(t);
      const int k_blocks = ceil_div(w.r, kHopperBK);
      // A tail tile split along columns: this consumer's columns start 128·consumer further,
      // its rows where the tile's do.
      const bool split = kSplitTail && kForm != HopperForm::dw && w.rows - w.m0 <= 64;
      if (k_blocks == 0) {  // dW of an empty group: a sum of nothing
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0;
      }
      // The k loop, compiled once per tile shape: a branch between the two shapes inside it
      // would make ptxas serialise every wgmma (it cannot prove the branch warpgroup-uniform).
      auto k_loop = [&](auto split_tile) {
        constexpr bool kSplit = decltype(split_tile)::value;
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % kHopperStages;
          hp::mbarrier_wait(full(s), (it / kHopperStages) & 1);
          if constexpr (kForm == HopperForm::dw) {
            // The group's last k step: clear the rows past its end in all six boxes (they hold
            // the next group's rows, or whatever lies past the last kept row), so that they add
            // zero.
            const int valid = w.r - kb * kHopperBK;
            if (valid < kHopperBK) {
              const int ct = threadIdx.x - 128;  // 0..255 over both consumers
              const int chunks = (kHopperBK - valid) * 8;  // 16-byte pieces per box
              for (int i = ct; i < 6 * chunks; i += 256) {
                const int box = i / chunks, piece = i % chunks;
                const std::uint32_t base = box < 2 ? slot_a(s) + box * kHopperBox : slot_b(s) + (box - 2) * kHopperBox;
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(base + valid * 128 + piece * 16), "r"(0));
              }
              hp::fence_proxy_async();
              hp::named_sync(1, 256);  // both consumers, after all the clearing
            }
          }
          hp::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kHopperBK / 16; ++kk) {
            if constexpr (kSplit) {
              static_assert(kSplit && !kAT, "split tiles read A K-major (the forward and dX forms)");
              // 128 rows of K-major B are 16 KiB; 128 columns of MN-major B are two of its boxes.
              const std::uint64_t a = hp::smem_desc_128b(slot_a(s) + 32 * kk);
              const std::uint64_t b =
                  kBT ? hp::smem_desc_128b_mn(slot_b(s) + consumer * 2 * kHopperBox + kk * 2048, kHopperBox)
                      : hp::smem_desc_128b(slot_b(s) + consumer * 128 * kHopperBK * 2 + 32 * kk);
              hp::wgmma_m64n128k16_ss<0, kBT ? 1 : 0>(d, a, b, kb > 0 || kk > 0);
            } else {
              const std::uint64_t a =
                  kAT ? hp::smem_desc_128b_mn(slot_a(s) + consumer * kHopperBox + kk * 2048, kHopperBox)
                      : hp::smem_desc_128b(slot_a(s) + consumer * 64 * kHopperBK * 2 + 32 * kk);
              const std::uint64_t b = kBT ? hp::smem_desc_128b_mn(slot_b(s) + kk * 2048, kHopperBox)
                                          : hp::smem_desc_128b(slot_b(s) + 32 * kk);
              hp::wgmma_m64n256k16<kAT ? 1 : 0, kBT ? 1 : 0>(d, a, b, kb > 0 || kk > 0);
            }
          }
          hp::wgmma_commit();
          if constexpr (kBoxes > 0) epilogue.after_k_block(kb);
          hp::wgmma_wait<0>();
          if (lane == 0) release(s);
        }
      };
      if constexpr (kSplitTail && kForm != HopperForm::dw) {
        if (split) k_loop(std::true_type{});
        else k_loop(std::false_type{});
      } else {
        k_loop(std::false_type{});
      }
      // Rows 16·warp + g8 and + 8 of this consumer's 64, inside C (forward, dX: the group's rows).
      const int g8 = lane / 4, q = lane % 4;
      const int row_end = kForm == HopperForm::dw ? p.m : w.rows;
      if constexpr (kBoxes > 0) {
        // A slab wholly inside the group: into the staging boxes kBoxes at a time, each batch
        // stored by TMA. Slabs that cross the group's end take the direct stores below.
        if (!split && w.m0 + consumer * 64 + 64 <= row_end) {
          epilogue.tile(d, w.n0, w.row0 + w.m0 + consumer * 64, k_blocks);
          continue;
        }
      }
      OutT* c = static_cast<OutT*>(p.c) + (kForm == HopperForm::dw ? static_cast<long long>(w.g) * p.m * p.n
                                                                   : static_cast<long long>(w.row0) * p.n);
      // Split: this consumer's 16 column blocks of the tile's first 64 rows; else its 64 rows.
      const int r_local = w.m0 + (split ? 0 : consumer * 64) + warp * 16 + g8;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = w.n0 + (split ? consumer * kHopperBN / 2 : 0) + 8 * j + 2 * q;
        if (col >= p.n || (split && j >= 16)) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r_local + 8 * h;
          if (r < row_end)
            store_pair(c + static_cast<long long>(r) * p.n + col, col + 1 < p.n, p.pairs, false, d[4 * j + 2 * h],
                       d[4 * j + 2 * h + 1]);
        }
      }
    }
    if constexpr (kBoxes > 0) {
      epilogue.finish();
      if (threadIdx.x % 128 == 0) hp::bulk_wait_all();
    }
  }
  // No block of a cluster may exit while its peer can still write into its shared memory or
  // arrive on its barriers.
  if constexpr (kCluster > 1) hp::cluster_sync();
#endif
}

// Whether this build and device run Part B, asked once per device (a probe launch). With a CUDA
// error pending the probe would not run: the answer is then "no" for this call only.
bool hopper_here() {
  static std::mutex mutex;
  static std::map<int, bool> known;
  int device = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (known.find(device) == known.end() && cudaPeekAtLastError() != cudaSuccess) return false;
  auto it = known.find(device);
  if (it == known.end()) it = known.emplace(device, hp::sm90a_supported(nullptr)).first;
  return it->second;
}

template <HopperForm kForm, class OutT, int kBoxes = 0, int kDefer = 0, bool kSplitTail = true, int kCluster = 1>
void launch_hopper(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c, const HopperArgs& args,
                   cudaStream_t stream) {
  auto* kernel = hopper_grouped_kernel<kForm, OutT, kBoxes, kDefer, kSplitTail, kCluster>;
  const int smem = HopperSmem<kBoxes>::kBytes + prefix_bytes(args.groups);
  K2C_CHECK(smem <= kSmemLimit, "moe: " << args.groups << " groups do not fit the wgmma kernel's shared memory");
  // The limit is the variant's largest (the most groups), not this call's: a limit set per call
  // could be lowered by another host thread between its set and this launch.
  constexpr int kLimit = std::min(kSmemLimit, HopperSmem<kBoxes>::kBytes + prefix_bytes(kMaxExperts));
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLimit));
  hp::ClusterLaunch launch(kCluster, kHopperThreads, smem, stream);
  // As many blocks as fit at once (persistent), asked once per device.
  static std::mutex mutex;
  static std::map<int, int> resident_on;
  int device = 0, resident = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(mutex);
    int& known = resident_on[device];
    if (known == 0) {
      known = launch.resident_blocks(kernel);
      K2C_CHECK(known > 0, "moe: the wgmma kernel does not fit on this GPU");
    }
    resident = known;
  }
  launch.config.gridDim = dim3(resident);
  K2C_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, map_a, map_b, map_c, args));
}

}  // namespace

bool hopper_supported(std::string* why_not) { return hp::sm90a_supported(why_not); }

void grouped_gemm_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* a, const bf16* b,
                         bf16* c, bool b_transposed, cudaStream_t stream) {
  const char* who = "moe grouped_gemm_hopper";
  check_grouped_hopper(groups, offsets, rows, n, k, a, b, c, b_transposed, who);
  hp::require_sm90a(who);
  if (rows == 0) return;
  const HopperArgs args{groups, offsets, 0, n, k, c, n % 2 == 0 && reinterpret_cast<std::uintptr_t>(c) % 4 == 0};
  const CUtensorMap map_a = hp::make_tensor_map_bf16(a, rows, k, kHopperBM, kHopperBK);
  const CUtensorMap map_b = b_transposed ? hp::make_tensor_map_bf16(b, groups * n, k, kHopperBoxB, kHopperBK)
                                         : hp::make_tensor_map_bf16(b, groups * k, n, 64, 64);
  // TMA stores C where its rows start on 16 bytes; otherwise the epilogue stores from registers.
  // The whole slab staged at once (four boxes, three ring slots): at this module's shapes it
  // measured ahead of two boxes at a time with four slots, which module 05's longer K prefers
  // (lab/moe_grouped.cu boxes).
  if (n % 8 == 0 && reinterpret_cast<std::uintptr_t>(c) % 16 == 0) {
    const CUtensorMap map_c = hp::make_tensor_map_bf16(c, rows, n, 64, 64);
    if (b_transposed) launch_hopper<HopperForm::forward, bf16, kStagedBoxes>(map_a, map_b, map_c, args, stream);
    else launch_hopper<HopperForm::dx, bf16, kStagedBoxes>(map_a, map_b, map_c, args, stream);
  } else {
    if (b_transposed) launch_hopper<HopperForm::forward, bf16>(map_a, map_b, map_a, args, stream);
    else launch_hopper<HopperForm::dx, bf16>(map_a, map_b, map_a, args, stream);
  }
}

void grouped_weight_grad_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* dy, const bf16* x,
                                float* dw, cudaStream_t stream) {
  const char* who = "moe grouped_weight_grad_hopper";
  check_weight_grad_hopper(groups, offsets, rows, n, k, dy, x, dw, who);
  hp::require_sm90a(who);
  const HopperArgs args{groups, offsets, n, k, 0, dw, k % 2 == 0 && reinterpret_cast<std::uintptr_t>(dw) % 8 == 0};
  if (rows == 0) {  // every group is empty: every gradient is zero
    K2C_CUDA_CHECK(cudaMemsetAsync(dw, 0, sizeof(float) * groups * static_cast<std::size_t>(n) * k, stream));
    return;
  }
  // In GEMM terms C[m][n] with m = dY's width and n = X's width, both read MN-major.
  const CUtensorMap map_a = hp::make_tensor_map_bf16(dy, rows, n, 64, 64);
  const CUtensorMap map_b = hp::make_tensor_map_bf16(x, rows, k, 64, 64);
  launch_hopper<HopperForm::dw, float>(map_a, map_b, map_a, args, stream);
}

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
