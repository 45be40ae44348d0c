// solutions/10_moe/moe_routing.cuh — module 10's reference, part 1 of 4: which experts each
// token goes to, and where in expert order each choice lands. The router (a warp per token:
// scores, group filter, top-k, weights) and the balance loss's kernels, then dispatch, the
// stable counting sort of the choices by expert (chunk ranks, scan, scatter). Included by moe.cu
// only, inside its unnamed namespace, after that file's Carve; the memory-bound kernels
// (moe_permute.cuh) follow.
#pragma once

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
