// solutions/09_flash_attention/flash_attention_naive.cuh — module 09's reference, part 4 of 4:
// naive_forward()'s three kernels, which write S and P to global memory, for contrast with the
// fused kernels. Included by flash_attention.cu only, inside its unnamed namespace, after the
// backward pass (flash_attention_backward.cuh); the host side, in flash_attention.cu, follows.
#pragma once

// ---- naive attention ----------------------------------------------------------------------------

// S = scale · Q Kᵀ (−inf where masked), fp32, one 32 × 32 tile per block through shared memory.
template <int D>
__global__ void naive_scores_kernel(Params p, float* S) {
  __shared__ float sq[32][D + 1], sk[32][D + 1];
  const int h = blockIdx.z % p.heads, b = blockIdx.z / p.heads, g = h / p.group;
  const int i0 = blockIdx.y * 32, j0 = blockIdx.x * 32, tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  for (int e = threadIdx.x; e < 32 * D; e += blockDim.x) {
    const int r = e / D, c = e % D;
    sq[r][c] = i0 + r < p.q_len ? __bfloat162float(p.q[(p.q_rows(b, h) + i0 + r) * D + c]) : 0.0f;
    sk[r][c] = j0 + r < p.kv_len ? __bfloat162float(p.k[(p.kv_rows(b, g) + j0 + r) * D + c]) : 0.0f;
  }
  __syncthreads();
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
  for (int r = ty; r < 32; r += blockDim.x / 32) {
    const int i = i0 + r, j = j0 + tx;
    if (i >= p.q_len || j >= p.kv_len) continue;
    float acc = 0;
    for (int c = 0; c < D; ++c) acc += sq[r][c] * sk[tx][c];
    S[(p.q_rows(b, h) + i) * p.kv_len + j] = mask.hidden(i, j) ? -INFINITY : acc * p.scale;
  }
}

// Row softmax in place (S becomes P) and lse, one block per row.
__global__ void naive_softmax_kernel(float* S, float* lse, int kv_len) {
  __shared__ float partial[32];
  float* row = S + static_cast<std::size_t>(blockIdx.x) * kv_len;
  auto block_reduce = [&](float x, bool is_max) {
    for (int m = 16; m > 0; m /= 2) {
      const float y = __shfl_xor_sync(0xffffffffu, x, m);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = x;
    __syncthreads();
    x = is_max ? -INFINITY : 0.0f;
    for (int w = 0; w < blockDim.x / 32; ++w) x = is_max ? fmaxf(x, partial[w]) : x + partial[w];
    __syncthreads();
    return x;
  };
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < kv_len; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, true);
  const float base = mx == -INFINITY ? 0.0f : mx;
  float sum = 0;
  for (int j = threadIdx.x; j < kv_len; j += blockDim.x) sum += expf(row[j] - base);
  sum = block_reduce(sum, false);
  const float inv = sum > 0 ? 1.0f / sum : 0.0f;
  for (int j = threadIdx.x; j < kv_len; j += blockDim.x) row[j] = expf(row[j] - base) * inv;
  if (threadIdx.x == 0) lse[blockIdx.x] = sum > 0 ? base + logf(sum) : INFINITY;
}

// O = P V, 16 query rows × D per block, P and V tiles of 32 keys through shared memory.
template <int D>
__global__ void naive_pv_kernel(Params p, const float* P) {
  __shared__ float sp[16][33], sv[32][D];
  const int h = blockIdx.y % p.heads, b = blockIdx.y / p.heads, g = h / p.group;
  const int i0 = blockIdx.x * 16;
  constexpr int kPerThread = 16 * D / 128;  // 128 threads; thread t: column t % D, rows t / D + ...
  float acc[kPerThread] = {};
  const int c = threadIdx.x % D, r0 = threadIdx.x / D, rstep = 128 / D;
  for (int j0 = 0; j0 < p.kv_len; j0 += 32) {
    for (int e = threadIdx.x; e < 16 * 32; e += 128) {
      const int r = e / 32, j = e % 32;
      sp[r][j] = i0 + r < p.q_len && j0 + j < p.kv_len ? P[(p.q_rows(b, h) + i0 + r) * p.kv_len + j0 + j] : 0.0f;
    }
    for (int e = threadIdx.x; e < 32 * D; e += 128) {
      const int j = e / D, d = e % D;
      sv[j][d] = j0 + j < p.kv_len ? __bfloat162float(p.v[(p.kv_rows(b, g) + j0 + j) * D + d]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int x = 0; x < kPerThread; ++x)
      for (int j = 0; j < 32; ++j) acc[x] += sp[r0 + x * rstep][j] * sv[j][c];
    __syncthreads();
  }
#pragma unroll
  for (int x = 0; x < kPerThread; ++x) {
    const int i = i0 + r0 + x * rstep;
    if (i < p.q_len) p.out[(p.q_rows(b, h) + i) * D + c] = __float2bfloat16(acc[x]);
  }
}
