// solutions/10_moe/moe_permute.cuh — module 10's reference, part 2 of 4: the memory-bound
// kernels, 16 bytes (8 bf16) a thread. Permute (token rows into expert order), combine (the
// weighted gather back per token), SwiGLU, and the backward kernels of those three and of the
// router. Included by moe.cu only, inside its unnamed namespace, after routing and dispatch
// (moe_routing.cuh); the grouped GEMM (moe_grouped_gemm.cuh) follows.
#pragma once

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
