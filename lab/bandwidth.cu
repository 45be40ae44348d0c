// lab/bandwidth.cu — launch-configuration and design sweep for the memory-bound
// kernels of modules 06–08 at the graded shape (16384 × 4096 bf16). The reference solutions are
// included directly, so their TU-internal kernels can be launched with block shapes and grids the
// solutions do not pick themselves, beside cudaMemcpy of the same bytes. Also here, the designs
// that were measured and not adopted: a persistent grid with register prefetch of the next row
// (softmax_pf, rms_*_pf), a single (max, sum) pair reduction (softmax_pair), streaming cache hints
// (softmax_hints), and rows streamed through a shared-memory ring with cp.async (*_cpa). Lecture
// 06 section 7.3 and its last exercise quote what they measured. Build and run on a GPU machine:
//   nvcc -O3 -std=c++20 -arch=sm_90 -Icommon/include -Iassignments/06_softmax \
//     -Iassignments/07_rmsnorm -Iassignments/08_rope lab/bandwidth.cu -o /tmp/bw && /tmp/bw
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "../solutions/06_softmax/softmax.cu"
#include "../solutions/07_rmsnorm/rmsnorm.cu"
#include "../solutions/08_rope/rope.cu"

using bf16 = __nv_bfloat16;

static float* g_flush = nullptr;
static const size_t kFlush = size_t{256} << 20;

double time_ms(const std::function<void()>& f, int reps = 30) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < reps; ++i) {
    cudaMemsetAsync(g_flush, i, kFlush);
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) { printf("CUDA error %s\n", cudaGetErrorString(e)); exit(1); }
  return t[t.size() / 2];
}

void report(const char* what, double bytes, double ms, double ceiling) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  printf("%-48s %8.4f ms %7.0f GB/s  %.3f of 1GiB memcpy\n", what, ms, gbs, gbs / ceiling);
}

// A persistent variant of the softmax register kernel: grid-stride over row groups.
template <int VEC, int ITERS>
__global__ __launch_bounds__(1024) void softmax_persistent(const bf16* __restrict__ x, bf16* __restrict__ y, int rows, int cols) {
  using namespace k2c::rows;
  __shared__ RowScratch scratch;
  for (int first = blockIdx.x * blockDim.y; first < rows; first += gridDim.x * blockDim.y) {
    const int row = first + threadIdx.y;
    const bool live = row < rows;
    const bf16* xr = x + static_cast<size_t>(row) * cols;
    bf16* yr = y + static_cast<size_t>(row) * cols;
    float v[ITERS][VEC];
    float m = Max::identity;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * VEC;
      if (live && c < cols) {
        load<bf16, VEC>(xr + c, v[it]);
#pragma unroll
        for (int i = 0; i < VEC; ++i) m = fmaxf(m, v[it][i]);
      }
    }
    m = row_all(m, Max{}, scratch);
    float s = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * VEC;
      if (live && c < cols)
#pragma unroll
        for (int i = 0; i < VEC; ++i) { v[it][i] = __expf(v[it][i] - m); s += v[it][i]; }
    }
    s = row_all(s, Sum{}, scratch);
    const float inv = 1.0f / s;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * VEC;
      if (live && c < cols) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[it][i] *= inv;
        store<bf16, VEC>(yr + c, v[it]);
      }
    }
  }
}

// Streaming-hint variant: last-use loads (__ldlu) and evict-first stores (__stcs).
template <int VEC, int ITERS>
__global__ __launch_bounds__(1024) void softmax_hints(const bf16* __restrict__ x, bf16* __restrict__ y, int rows, int cols) {
  using namespace k2c::rows;
  __shared__ RowScratch scratch;
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const bf16* xr = x + static_cast<size_t>(row) * cols;
  bf16* yr = y + static_cast<size_t>(row) * cols;
  float v[ITERS][VEC];
  float m = Max::identity;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * VEC;
    if (live && c < cols) {
      const int4 raw = __ldlu(reinterpret_cast<const int4*>(xr + c));
      const bf16* e = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) { v[it][i] = __bfloat162float(e[i]); m = fmaxf(m, v[it][i]); }
    }
  }
  m = row_all(m, Max{}, scratch);
  float s = 0;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * VEC;
    if (live && c < cols)
#pragma unroll
      for (int i = 0; i < VEC; ++i) { v[it][i] = __expf(v[it][i] - m); s += v[it][i]; }
  }
  s = row_all(s, Sum{}, scratch);
  const float inv = 1.0f / s;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * VEC;
    if (live && c < cols) {
      int4 raw;
      bf16* e = reinterpret_cast<bf16*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) e[i] = __float2bfloat16(v[it][i] * inv);
      __stcs(reinterpret_cast<int4*>(yr + c), raw);
    }
  }
}


// Persistent + prefetch: the next row's raw bytes are loaded before the current row is reduced.
template <int ITERS>
__global__ __launch_bounds__(256) void softmax_pf(const bf16* __restrict__ x, bf16* __restrict__ y, int rows, int cols) {
  using namespace k2c::rows;
  __shared__ RowScratch scratch;
  const int stride = gridDim.x * blockDim.y;
  int row = blockIdx.x * blockDim.y + threadIdx.y;
  int4 cur[ITERS], nxt[ITERS];
  auto fetch = [&](int r, int4 (&dst)[ITERS]) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      if (r < rows && c < cols) dst[it] = *reinterpret_cast<const int4*>(x + size_t(r) * cols + c);
    }
  };
  fetch(row, cur);
  for (int first = blockIdx.x * blockDim.y; first < rows; first += stride, row += stride) {
    fetch(row + stride, nxt);
    const bool live = row < rows;
    float v[ITERS][8];
    float m = Max::identity;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      const bf16* e = reinterpret_cast<const bf16*>(&cur[it]);
      if (live && c < cols)
#pragma unroll
        for (int i = 0; i < 8; ++i) { v[it][i] = __bfloat162float(e[i]); m = fmaxf(m, v[it][i]); }
    }
    m = row_all(m, Max{}, scratch);
    float s = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      if (live && c < cols)
#pragma unroll
        for (int i = 0; i < 8; ++i) { v[it][i] = __expf(v[it][i] - m); s += v[it][i]; }
    }
    s = row_all(s, Sum{}, scratch);
    const float inv = 1.0f / s;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      if (live && c < cols) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[it][i] *= inv;
        store<bf16, 8>(y + size_t(row) * cols + c, v[it]);
      }
      cur[it] = nxt[it];
    }
  }
}

// Softmax with one reduction: per-thread (max, sum) merged across the row in one pass.
template <int ITERS>
__global__ __launch_bounds__(256) void softmax_pair(const bf16* __restrict__ x, bf16* __restrict__ y, int rows, int cols) {
  __shared__ float2 sh[32];
  const int row = blockIdx.x;
  const bf16* xr = x + size_t(row) * cols;
  float v[ITERS][8];
  float m = -INFINITY;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * 8;
    if (c < cols) {
      k2c::rows::load<bf16, 8>(xr + c, v[it]);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, v[it][i]);
    }
  }
  float s = 0;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * 8;
    if (c < cols)
#pragma unroll
      for (int i = 0; i < 8; ++i) { v[it][i] = __expf(v[it][i] - m); s += v[it][i]; }
  }
  // merge (m, s) pairs
  float M = m, S = s;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(~0u, M, o), s2 = __shfl_xor_sync(~0u, S, o);
    const float mm = fmaxf(M, m2);
    S = S * __expf(M - mm) + s2 * __expf(m2 - mm);
    M = mm;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (lane == 0) sh[warp] = make_float2(M, S);
  __syncthreads();
  float2 p = lane < warps ? sh[lane] : make_float2(-INFINITY, 0.f);
  M = p.x; S = p.y;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(~0u, M, o), s2 = __shfl_xor_sync(~0u, S, o);
    const float mm = fmaxf(M, m2);
    S = (M == -INFINITY ? 0.f : S * __expf(M - mm)) + (m2 == -INFINITY ? 0.f : s2 * __expf(m2 - mm));
    M = mm;
  }
  const float scale = __expf(m - M) / S;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * 8;
    if (c < cols) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[it][i] *= scale;
      k2c::rows::store<bf16, 8>(y + size_t(row) * cols + c, v[it]);
    }
  }
}

// RMSNorm forward, persistent + prefetch.
template <int ITERS>
__global__ __launch_bounds__(256) void rms_fwd_pf(const bf16* __restrict__ x, const bf16* __restrict__ gamma, bf16* __restrict__ y, float* rstd, int rows, int cols, float eps) {
  using namespace k2c::rows;
  __shared__ RowScratch scratch;
  const int stride = gridDim.x;
  int row = blockIdx.x;
  int4 cur[ITERS], nxt[ITERS];
  auto fetch = [&](int r, int4 (&dst)[ITERS]) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      if (r < rows && c < cols) dst[it] = *reinterpret_cast<const int4*>(x + size_t(r) * cols + c);
    }
  };
  fetch(row, cur);
  for (; row < rows; row += stride) {
    fetch(row + stride, nxt);
    float h[ITERS][8], sq = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const bf16* e = reinterpret_cast<const bf16*>(&cur[it]);
#pragma unroll
      for (int i = 0; i < 8; ++i) { h[it][i] = __bfloat162float(e[i]); sq += h[it][i] * h[it][i]; }
    }
    const float r = rsqrtf(row_all(sq, Sum{}, scratch) / cols + eps);
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      float g[8];
      load<bf16, 8>(gamma + c, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) h[it][i] *= r * g[i];
      store<bf16, 8>(y + size_t(row) * cols + c, h[it]);
      cur[it] = nxt[it];
    }
  }
}

// RMSNorm backward, persistent + prefetch of h and dy (raw), dgamma partials in registers.
template <int ITERS>
__global__ __launch_bounds__(256) void rms_bwd_pf(const bf16* __restrict__ h, const bf16* __restrict__ gamma, const bf16* __restrict__ dy,
                                                  const float* __restrict__ rstd, bf16* __restrict__ dx, float* __restrict__ partial, int rows, int cols) {
  using namespace k2c::rows;
  __shared__ RowScratch scratch;
  const int stride = gridDim.x;
  int row = blockIdx.x;
  int4 ch[ITERS], cd[ITERS], nh[ITERS], nd[ITERS];
  float dg[ITERS][8] = {};
  auto fetch = [&](int r, int4 (&dh)[ITERS], int4 (&dd)[ITERS]) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      if (r < rows) {
        dh[it] = *reinterpret_cast<const int4*>(h + size_t(r) * cols + c);
        dd[it] = *reinterpret_cast<const int4*>(dy + size_t(r) * cols + c);
      }
    }
  };
  fetch(row, ch, cd);
  for (; row < rows; row += stride) {
    fetch(row + stride, nh, nd);
    const float r = rstd[row];
    float hv[ITERS][8], gd[ITERS][8], dot = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
      float g[8];
      load<bf16, 8>(gamma + c, g);
      const bf16* eh = reinterpret_cast<const bf16*>(&ch[it]);
      const bf16* ed = reinterpret_cast<const bf16*>(&cd[it]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        hv[it][i] = __bfloat162float(eh[i]);
        const float d = __bfloat162float(ed[i]);
        gd[it][i] = g[i] * d;
        dot += gd[it][i] * hv[it][i];
        dg[it][i] += d * hv[it][i] * r;
      }
    }
    const float k = r * r * r * row_all(dot, Sum{}, scratch) / cols;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (it * blockDim.x + threadIdx.x) * 8;
#pragma unroll
      for (int i = 0; i < 8; ++i) gd[it][i] = r * gd[it][i] - k * hv[it][i];
      store<bf16, 8>(dx + size_t(row) * cols + c, gd[it]);
      ch[it] = nh[it];
      cd[it] = nd[it];
    }
  }
  float* mine = partial + size_t(blockIdx.x) * cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) mine[c + i] = dg[it][i];
  }
}


// ---- cp.async pipelines: rows streamed into a shared-memory ring STAGES deep; each thread copies
// and later reads back only its own 16-byte pieces, so no barrier is needed around the ring.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int ITERS, int STAGES>
__global__ __launch_bounds__(256) void softmax_cpa(const bf16* __restrict__ x, bf16* __restrict__ y, int rows, int cols) {
  using namespace k2c::rows;
  extern __shared__ int4 ring[];
  __shared__ RowScratch scratch;
  const int vecs = cols / 8, stride = gridDim.x;
  auto issue = [&](int r, int stage) {
    if (r < rows)
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c = it * blockDim.x + threadIdx.x;
        cp_async16(&ring[stage * vecs + c], x + size_t(r) * cols + size_t(c) * 8);
      }
    cp_commit();
  };
  int row = blockIdx.x;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(row + s * stride, s);
  for (int k = 0; row < rows; ++k, row += stride) {
    issue(row + (STAGES - 1) * stride, (k + STAGES - 1) % STAGES);
    cp_wait<STAGES - 1>();
    const int stage = k % STAGES;
    float v[ITERS][8];
    float m = Max::identity;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * blockDim.x + threadIdx.x;
      const int4 raw = ring[stage * vecs + c];
      const bf16* e = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) { v[it][i] = __bfloat162float(e[i]); m = fmaxf(m, v[it][i]); }
    }
    m = row_all(m, Max{}, scratch);
    float s = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int i = 0; i < 8; ++i) { v[it][i] = __expf(v[it][i] - m); s += v[it][i]; }
    s = row_all(s, Sum{}, scratch);
    const float inv = 1.0f / s;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * blockDim.x + threadIdx.x;
#pragma unroll
      for (int i = 0; i < 8; ++i) v[it][i] *= inv;
      store<bf16, 8>(y + size_t(row) * cols + size_t(c) * 8, v[it]);
    }
  }
  cp_wait<0>();
}

template <int ITERS, int STAGES>
__global__ __launch_bounds__(256) void rms_fwd_cpa(const bf16* __restrict__ x, const bf16* __restrict__ gamma, bf16* __restrict__ y, float* rstd, int rows, int cols, float eps) {
  using namespace k2c::rows;
  extern __shared__ int4 ring[];
  __shared__ RowScratch scratch;
  const int vecs = cols / 8, stride = gridDim.x;
  auto issue = [&](int r, int stage) {
    if (r < rows)
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c = it * blockDim.x + threadIdx.x;
        cp_async16(&ring[stage * vecs + c], x + size_t(r) * cols + size_t(c) * 8);
      }
    cp_commit();
  };
  int row = blockIdx.x;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(row + s * stride, s);
  for (int k = 0; row < rows; ++k, row += stride) {
    issue(row + (STAGES - 1) * stride, (k + STAGES - 1) % STAGES);
    cp_wait<STAGES - 1>();
    const int stage = k % STAGES;
    float h[ITERS][8], sq = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int4 raw = ring[stage * vecs + it * blockDim.x + threadIdx.x];
      const bf16* e = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) { h[it][i] = __bfloat162float(e[i]); sq += h[it][i] * h[it][i]; }
    }
    const float r = rsqrtf(row_all(sq, Sum{}, scratch) / cols + eps);
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * blockDim.x + threadIdx.x;
      float g[8];
      load<bf16, 8>(gamma + size_t(c) * 8, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) h[it][i] *= r * g[i];
      store<bf16, 8>(y + size_t(row) * cols + size_t(c) * 8, h[it]);
    }
  }
  cp_wait<0>();
}

template <int ITERS, int STAGES>
__global__ __launch_bounds__(256) void rms_bwd_cpa(const bf16* __restrict__ h, const bf16* __restrict__ gamma, const bf16* __restrict__ dy,
                                                   const float* __restrict__ rstd, bf16* __restrict__ dx, float* __restrict__ partial, int rows, int cols) {
  using namespace k2c::rows;
  extern __shared__ int4 ring[];  // [STAGES][2][vecs]
  __shared__ RowScratch scratch;
  const int vecs = cols / 8, stride = gridDim.x;
  auto issue = [&](int r, int stage) {
    if (r < rows)
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c = it * blockDim.x + threadIdx.x;
        cp_async16(&ring[(stage * 2) * vecs + c], h + size_t(r) * cols + size_t(c) * 8);
        cp_async16(&ring[(stage * 2 + 1) * vecs + c], dy + size_t(r) * cols + size_t(c) * 8);
      }
    cp_commit();
  };
  float dg[ITERS][8] = {};
  int row = blockIdx.x;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(row + s * stride, s);
  for (int k = 0; row < rows; ++k, row += stride) {
    issue(row + (STAGES - 1) * stride, (k + STAGES - 1) % STAGES);
    cp_wait<STAGES - 1>();
    const int stage = k % STAGES;
    const float r = rstd[row];
    float hv[ITERS][8], gd[ITERS][8], dot = 0;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * blockDim.x + threadIdx.x;
      const int4 rh = ring[(stage * 2) * vecs + c], rd = ring[(stage * 2 + 1) * vecs + c];
      const bf16* eh = reinterpret_cast<const bf16*>(&rh);
      const bf16* ed = reinterpret_cast<const bf16*>(&rd);
      float g[8];
      load<bf16, 8>(gamma + size_t(c) * 8, g);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        hv[it][i] = __bfloat162float(eh[i]);
        const float d = __bfloat162float(ed[i]);
        gd[it][i] = g[i] * d;
        dot += gd[it][i] * hv[it][i];
        dg[it][i] += d * hv[it][i] * r;
      }
    }
    const float kk = r * r * r * row_all(dot, Sum{}, scratch) / cols;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * blockDim.x + threadIdx.x;
#pragma unroll
      for (int i = 0; i < 8; ++i) gd[it][i] = r * gd[it][i] - kk * hv[it][i];
      store<bf16, 8>(dx + size_t(row) * cols + size_t(c) * 8, gd[it]);
    }
  }
  cp_wait<0>();
  float* mine = partial + size_t(blockIdx.x) * cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) mine[c + i] = dg[it][i];
  }
}

template <class K>
int resident_smem(K kernel, int threads, size_t smem) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  return per_sm;
}

int resident(const void* kernel, int threads) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
  return per_sm;
}

int main() {
  cudaMalloc(&g_flush, kFlush);
  const int rows = 16384, cols = 4096;
  const size_t n = size_t(rows) * cols;
  bf16 *x, *y, *z, *w;
  cudaMalloc(&x, n * 2);
  cudaMalloc(&y, n * 2);
  cudaMalloc(&z, n * 2);
  cudaMalloc(&w, n * 2);
  cudaMemset(x, 0x3c, n * 2);
  cudaMemset(z, 0x3c, n * 2);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);

  char *big1, *big2;
  cudaMalloc(&big1, size_t(1) << 30);
  cudaMalloc(&big2, size_t(1) << 30);
  const double ceiling = 2.0 * (1 << 30) / (time_ms([&] { cudaMemcpyAsync(big2, big1, size_t(1) << 30, cudaMemcpyDeviceToDevice); }) * 1e-3) / 1e9;
  printf("memcpy 1 GiB: %.0f GB/s\n", ceiling);
  const double two = 2.0 * n * 2, three = 3.0 * n * 2;
  report("memcpy 128 MiB", two, time_ms([&] { cudaMemcpyAsync(y, x, n * 2, cudaMemcpyDeviceToDevice); }), ceiling);
  report("memcpy 256 MiB", 2 * two, time_ms([&] { cudaMemcpyAsync(big2, big1, n * 4, cudaMemcpyDeviceToDevice); }), ceiling);

  using namespace k2c::rows;
  // ---- softmax
  auto sm_reg = [&](int threads, auto iters) {
    const dim3 block(threads, threads >= 128 ? 1 : 128 / threads);
    char name[96];
    snprintf(name, sizeof name, "softmax registers t%d it%d", threads, int(iters()));
    report(name, two, time_ms([&] {
      k2c::softmax::registers_kernel<bf16, 8, iters()><<<(rows + block.y - 1) / block.y, block>>>(x, y, rows, cols);
    }), ceiling);
  };
  sm_reg(256, std::integral_constant<int, 2>{});
  {
    auto run_cpa = [&](auto stages) {
      const size_t smem = size_t(stages()) * cols * 2;
      const int occ = resident_smem(softmax_cpa<2, stages()>, 256, smem);
      for (int mult : {1, 2}) {
        char name[96];
        snprintf(name, sizeof name, "softmax cp.async t256 stages %d groups %d", int(stages()), sms * occ * mult);
        report(name, two, time_ms([&] { softmax_cpa<2, stages()><<<sms * occ * mult, 256, smem>>>(x, y, rows, cols); }), ceiling);
      }
    };
    run_cpa(std::integral_constant<int, 2>{});
    run_cpa(std::integral_constant<int, 3>{});
    run_cpa(std::integral_constant<int, 4>{});
  }

  // ---- rmsnorm
  bf16* gamma;
  float *rstd, *dgamma, *partial;
  cudaMalloc(&gamma, cols * 2);
  cudaMemset(gamma, 0x3c, cols * 2);
  cudaMalloc(&rstd, rows * 4);
  cudaMalloc(&dgamma, cols * 4);
  cudaMalloc(&partial, size_t(4096) * cols * 4);
  cudaMemset(rstd, 0, rows * 4);
  report("rmsnorm fwd registers t256 it2", two, time_ms([&] {
    k2c::rmsnorm::forward_kernel<8, 2, false><<<rows, 256>>>(x, nullptr, gamma, y, nullptr, rstd, rows, cols, 1e-5f);
  }), ceiling);
  {
    auto fwd_cpa = [&](auto stages) {
      const size_t smem = size_t(stages()) * cols * 2;
      const int occ = resident_smem(rms_fwd_cpa<2, stages()>, 256, smem);
      char name[96];
      snprintf(name, sizeof name, "rmsnorm fwd cp.async stages %d groups %d", int(stages()), sms * occ);
      report(name, two, time_ms([&] { rms_fwd_cpa<2, stages()><<<sms * occ, 256, smem>>>(x, gamma, y, rstd, rows, cols, 1e-5f); }), ceiling);
    };
    fwd_cpa(std::integral_constant<int, 2>{});
    fwd_cpa(std::integral_constant<int, 3>{});
    fwd_cpa(std::integral_constant<int, 4>{});
    report("rmsnorm bwd solution (registers, persistent)", three, time_ms([&] {
      k2c::rmsnorm::backward(x, gamma, z, rstd, w, dgamma, partial, rows, cols, nullptr);
    }), ceiling);
    auto bwd_cpa = [&](auto stages) {
      const size_t smem = size_t(stages()) * 2 * cols * 2;
      const int occ = resident_smem(rms_bwd_cpa<2, stages()>, 256, smem);
      char name[96];
      snprintf(name, sizeof name, "rmsnorm bwd cp.async stages %d groups %d", int(stages()), sms * occ);
      report(name, three, time_ms([&] {
        rms_bwd_cpa<2, stages()><<<sms * occ, 256, smem>>>(x, gamma, z, rstd, w, partial, rows, cols);
        k2c::rmsnorm::sum_partials_kernel<<<(cols + 31) / 32, dim3(32, k2c::rmsnorm::kSumWarps)>>>(partial, dgamma, sms * occ, cols);
      }), ceiling);
    };
    bwd_cpa(std::integral_constant<int, 2>{});
    bwd_cpa(std::integral_constant<int, 3>{});
    bwd_cpa(std::integral_constant<int, 4>{});
  }

  // ---- rope: q 16384 x 32 x 128, k 16384 x 8 x 128, half-split, table and on the fly
  {
    using namespace k2c::rope;
    const long tokens = 16384;
    const size_t nq = tokens * 32 * 128, nk = tokens * 8 * 128;
    bf16 *q, *k, *qo, *ko;
    cudaMalloc(&q, nq * 2); cudaMalloc(&k, nk * 2); cudaMalloc(&qo, nq * 2); cudaMalloc(&ko, nk * 2);
    cudaMemset(q, 0x3c, nq * 2); cudaMemset(k, 0x3c, nk * 2);
    float2* cache;
    cudaMalloc(&cache, 4096 * 64 * 8);
    build_cache(cache, 4096, 128, 10000.0, nullptr);
    const double bytes = 2.0 * (nq + nk) * 2;
    report("memcpy rope bytes", bytes, time_ms([&] { cudaMemcpyAsync(qo, q, nq * 2, cudaMemcpyDeviceToDevice); cudaMemcpyAsync(ko, k, nk * 2, cudaMemcpyDeviceToDevice); }), ceiling);
    // The solution's launcher at its own block size (the mapping is studied in rope_order.cu).
    const Shape shape{4, 4096, 32, 8, 128};
    for (bool table : {true, false}) {
      report(table ? "rope half8 table" : "rope half8 fly", bytes, time_ms([&] {
        launch<Layout::half_split, 8>(q, k, qo, ko, shape, 0, 1.0f, table ? cache : nullptr, 10000.0, nullptr);
      }), ceiling);
    }
    report("rope half4 table", bytes, time_ms([&] {
      launch<Layout::half_split, 4>(q, k, qo, ko, shape, 0, 1.0f, cache, 10000.0, nullptr);
    }), ceiling);
    report("rope inter4 table", bytes, time_ms([&] {
      launch<Layout::interleaved, 4>(q, k, qo, ko, shape, 0, 1.0f, cache, 10000.0, nullptr);
    }), ceiling);
  }
  return 0;
}
