// lab/row_streams.cu — designs for modules 06 and 07 at the graded shape (16384 ×
// 4096 bf16) that keep more bytes in flight than the register kernels: rows streamed into shared
// memory by the bulk copy engine (cp.async.bulk, sm_90), in a ring per warp (softmax, RMSNorm
// forward) or per block (RMSNorm backward, adopted by the solution); and the register kernels with
// every load of a thread issued first into 16-byte registers, the row kept packed (packed_rows:
// softmax 0.91 and RMSNorm forward 0.91 of the copy rate here, against 0.85 and 0.89 for the
// references of the time; since adopted by the solutions). The 'anatomy' section takes the RMSNorm
// backward apart (which found the cost of its partial-row stores) and 'parts' times the solution's
// backward kernel by kernel. Beside them: cudaMemcpy of several sizes and plain copy kernels of
// the graded bytes, and the reference solutions, all timed as the graded tests time (L2
// overwritten before each run, median of 30). The numbers one H200 gave are in
// lab/results/h200.json under "row_streams". Build and run on an H100 or H200:
//   nvcc -O3 -std=c++20 -arch=sm_90 -Icommon/include -Iassignments/06_softmax \
//     -Iassignments/07_rmsnorm lab/row_streams.cu common/src/device.cu -o /tmp/rs && /tmp/rs [sections]
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "../solutions/06_softmax/softmax.cu"
#include "../solutions/07_rmsnorm/rmsnorm.cu"
#include "k2c/core/random.h"
#include "k2c/device/hopper.cuh"
#include "median_time.cuh"

using bf16 = __nv_bfloat16;
namespace hp = k2c::hopper;
using k2c::rows::Max;
using k2c::rows::Sum;
using k2c::rows::warp_all;

__device__ __forceinline__ std::uint32_t saddr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
// Rows are held as 16-byte vectors of bf16 bits and converted with k2c/device/rows.cuh's helpers.
using Vec = k2c::rows::Bits<bf16, 8>;
__device__ __forceinline__ void unpack(const Vec& raw, float (&f)[8]) { k2c::rows::unpack<bf16, 8>(raw, f); }
__device__ __forceinline__ Vec pack(const float (&f)[8]) { return k2c::rows::pack<bf16, 8>(f); }
__device__ __forceinline__ Vec lds16(std::uint32_t a) {
  Vec v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
// The RMSNorm forward's output: y = x · rs · gamma for the vectors t, t + stride, ... (below
// vecs) of a row held in raw.
template <int ITERS>
__device__ __forceinline__ void rms_scale_store(const Vec (&raw)[ITERS], const bf16* gamma, Vec* yr, float rs, int t,
                                                int stride, int vecs) {
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * stride + t;
    if (v < vecs) {
      float f[8], g[8];
      unpack(raw[it], f);
      unpack(__ldg(reinterpret_cast<const Vec*>(gamma) + v), g);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] *= rs * g[i];
      yr[v] = pack(f);
    }
  }
}

// ---- plain copies: U 16-byte pieces per thread, blocks of 256 over consecutive chunks --------
template <int U>
__global__ __launch_bounds__(256) void copy_kernel(const int4* __restrict__ x, int4* __restrict__ y, std::size_t n) {
  const std::size_t base = static_cast<std::size_t>(blockIdx.x) * 256 * U + threadIdx.x;
  int4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (base + u * 256 < n) v[u] = x[base + u * 256];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (base + u * 256 < n) y[base + u * 256] = v[u];
}

// ---- two streams read per stream written, as the RMSNorm backward moves them (h and dy in, dx
// out): z = x + y on bf16, U 16-byte pieces of each input per thread.
template <int U>
__global__ __launch_bounds__(256) void add_kernel(const int4* __restrict__ x, const int4* __restrict__ y,
                                                  int4* __restrict__ z, std::size_t n) {
  const std::size_t base = static_cast<std::size_t>(blockIdx.x) * 256 * U + threadIdx.x;
  int4 a[U], b[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (base + u * 256 < n) a[u] = x[base + u * 256], b[u] = y[base + u * 256];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (base + u * 256 < n) {
      __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&a[u]);
      const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(&b[u]);
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = __hadd2(p[i], q[i]);
      z[base + u * 256] = a[u];
    }
  }
}

// ---- the RMSNorm backward's anatomy: the register backward taken apart. Blocks of 256 threads
// walk rows b, b + grid, ... of h and dy (4096 columns: two 16-byte vectors of each a thread) and
// write dx. MODE 0 writes h + dy (the add kernel in rows), 1 also reduces a dot product over the
// row first (two barriers) and uses it, 2 to 5 also accumulate dgamma partial sums and write one
// partial row per block at the end in different ways (3: not at all).
template <int MODE>
__global__ __launch_bounds__(256) void anatomy(const bf16* __restrict__ h, const bf16* __restrict__ dy,
                                               bf16* __restrict__ dx, float* __restrict__ partial, int rows,
                                               int cols) {
  using k2c::rows::Bits;
  __shared__ k2c::rows::RowScratch scratch;
  constexpr int kIters = 2;
  const int vecs = cols / 8;
  float dg[kIters][8] = {};
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::size_t base = static_cast<std::size_t>(row) * cols;
    Bits<bf16, 8> a[kIters], b[kIters];
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs) {
        a[it] = k2c::rows::load_bits<bf16, 8>(h + base + 8 * v);
        b[it] = k2c::rows::load_bits<bf16, 8>(dy + base + 8 * v);
      }
    }
    float dot = 0.0f;
    if constexpr (MODE >= 1) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        float af[8], bf[8];
        k2c::rows::unpack<bf16, 8>(a[it], af);
        k2c::rows::unpack<bf16, 8>(b[it], bf);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot += af[i] * bf[i];
      }
      dot = k2c::rows::row_all(dot, k2c::rows::Sum{}, scratch) * 1e-9f;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs) {
        float af[8], bf[8];
        k2c::rows::unpack<bf16, 8>(a[it], af);
        k2c::rows::unpack<bf16, 8>(b[it], bf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if constexpr (MODE >= 2) dg[it][i] += af[i] * bf[i];
          af[i] = af[i] + bf[i] + dot * af[i];
        }
        k2c::rows::store_bits<bf16, 8>(dx + base + 8 * v, k2c::rows::pack<bf16, 8>(af));
      }
    }
  }
  float* mine = partial + static_cast<std::size_t>(blockIdx.x) * cols;
  if constexpr (MODE == 2) {  // 8 scalar stores a vector, as the solutions wrote their partial rows
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs)
#pragma unroll
        for (int i = 0; i < 8; ++i) mine[8 * v + i] = dg[it][i];
    }
  } else if constexpr (MODE == 3) {  // accumulated, practically never written
    float all = 0.0f;
#pragma unroll
    for (int it = 0; it < kIters; ++it)
#pragma unroll
      for (int i = 0; i < 8; ++i) all += dg[it][i];
    if (all == 1234.5f) mine[threadIdx.x] = all;
  } else if constexpr (MODE == 4) {  // two float4 stores a vector
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs) {
        reinterpret_cast<float4*>(mine)[2 * v] = make_float4(dg[it][0], dg[it][1], dg[it][2], dg[it][3]);
        reinterpret_cast<float4*>(mine)[2 * v + 1] = make_float4(dg[it][4], dg[it][5], dg[it][6], dg[it][7]);
      }
    }
  } else if constexpr (MODE == 5) {  // through shared memory: every warp store 512 contiguous bytes
    __shared__ float4 stage[1024];
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs) {  // at most 1024 float4: rows of up to 4096 columns
        stage[2 * v] = make_float4(dg[it][0], dg[it][1], dg[it][2], dg[it][3]);
        stage[2 * v + 1] = make_float4(dg[it][4], dg[it][5], dg[it][6], dg[it][7]);
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < cols / 4; i += 256) reinterpret_cast<float4*>(mine)[i] = stage[i];
  }
}

// ---- warp rings: warp w of the grid takes rows w, w + warps, ...; its ring holds S rows, each
// brought in by one bulk copy that completes on the slot's mbarrier. Lane 0 refills a slot as soon
// as every lane is done reading it, so S - 1 rows are always on their way while one is computed.
struct WarpRing {
  std::uint32_t ring, bars, row_bytes;
  int S, first, stride, lane;
  __device__ std::uint32_t slot(int k) const { return ring + (k % S) * row_bytes; }
  __device__ void issue(const bf16* src, int rows, int cols, int k) const {
    const int r = first + k * stride;
    if (lane == 0 && r < rows) {
      const std::uint32_t bar = bars + 8 * (k % S);
      hp::mbarrier_arrive_expect_tx(bar, row_bytes);
      hp::bulk_load(slot(k), src + static_cast<std::size_t>(r) * cols, row_bytes, bar);
    }
  }
  __device__ void wait(int k) const { hp::mbarrier_wait(bars + 8 * (k % S), (k / S) & 1); }
};

template <int W>
__device__ WarpRing make_ring(unsigned char* smem, int S, int cols) {
  WarpRing w;
  const int warp = threadIdx.x / 32;
  w.lane = threadIdx.x % 32;
  w.S = S;
  w.row_bytes = cols * 2;
  const std::uint32_t base = (saddr(smem) + 127) & ~127u;
  w.ring = base + warp * S * w.row_bytes;
  w.bars = base + W * S * w.row_bytes + warp * S * 8;
  w.first = blockIdx.x * W + warp;
  w.stride = gridDim.x * W;
  if (w.lane == 0) {
    for (int s = 0; s < S; ++s) hp::mbarrier_init(w.bars + 8 * s, 1);
    hp::fence_barrier_init();
  }
  __syncwarp();
  return w;
}
template <int W>
int ring_smem(int S, int cols) { return W * S * (cols * 2 + 8) + 128; }

template <int W>
__global__ __launch_bounds__(32 * W) void softmax_ring(const bf16* __restrict__ x, bf16* __restrict__ y, int rows, int cols, int S) {
  extern __shared__ unsigned char smem[];
  const WarpRing w = make_ring<W>(smem, S, cols);
  for (int k = 0; k < S; ++k) w.issue(x, rows, cols, k);
  const int vecs = cols / 8;
  for (int k = 0, r = w.first; r < rows; ++k, r += w.stride) {
    w.wait(k);
    const std::uint32_t slot = w.slot(k);
    float m = Max::identity;
#pragma unroll 4
    for (int v = w.lane; v < vecs; v += 32) {
      float f[8];
      unpack(lds16(slot + 16 * v), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, f[i]);
    }
    m = warp_all(m, Max{});
    const float ml = m * 1.4426950408889634f;
    float s = 0.0f;
#pragma unroll 4
    for (int v = w.lane; v < vecs; v += 32) {
      float f[8];
      unpack(lds16(slot + 16 * v), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) s += exp2f(fmaf(f[i], 1.4426950408889634f, -ml));
    }
    const float inv = 1.0f / warp_all(s, Sum{});
    Vec* yr = reinterpret_cast<Vec*>(y + static_cast<std::size_t>(r) * cols);
#pragma unroll 4
    for (int v = w.lane; v < vecs; v += 32) {
      float f[8];
      unpack(lds16(slot + 16 * v), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = exp2f(fmaf(f[i], 1.4426950408889634f, -ml)) * inv;
      yr[v] = pack(f);
    }
    hp::fence_proxy_async();
    __syncwarp();
    w.issue(x, rows, cols, k + S);
  }
}

template <int W>
__global__ __launch_bounds__(32 * W) void rms_fwd_ring(const bf16* __restrict__ x, const bf16* __restrict__ gamma, bf16* __restrict__ y,
                                                      float* __restrict__ rstd, int rows, int cols, float eps, int S) {
  extern __shared__ unsigned char smem[];
  const WarpRing w = make_ring<W>(smem, S, cols);
  for (int k = 0; k < S; ++k) w.issue(x, rows, cols, k);
  const int vecs = cols / 8;
  for (int k = 0, r = w.first; r < rows; ++k, r += w.stride) {
    w.wait(k);
    const std::uint32_t slot = w.slot(k);
    float sq = 0.0f;
#pragma unroll 4
    for (int v = w.lane; v < vecs; v += 32) {
      float f[8];
      unpack(lds16(slot + 16 * v), f);
#pragma unroll
      for (int i = 0; i < 8; ++i) sq = fmaf(f[i], f[i], sq);
    }
    const float rs = rsqrtf(warp_all(sq, Sum{}) / cols + eps);
    if (w.lane == 0) rstd[r] = rs;
    Vec* yr = reinterpret_cast<Vec*>(y + static_cast<std::size_t>(r) * cols);
    const Vec* g4 = reinterpret_cast<const Vec*>(gamma);
#pragma unroll 4
    for (int v = w.lane; v < vecs; v += 32) {
      float f[8], g[8];
      unpack(lds16(slot + 16 * v), f);
      unpack(__ldg(g4 + v), g);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = f[i] * rs * g[i];
      yr[v] = pack(f);
    }
    hp::fence_proxy_async();
    __syncwarp();
    w.issue(x, rows, cols, k + S);
  }
}

// ---- registers, packed: blockDim.x threads per row, blockDim.y rows per block, each thread ITERS
// 16-byte vectors of its row kept as raw bf16 (4 registers a vector instead of 8 floats), so that
// fewer threads per row still fit many rows per SM. Softmax recomputes exp in the output pass.
template <bool kSoftmax, int ITERS>
__global__ __launch_bounds__(256) void packed_rows(const bf16* __restrict__ x, const bf16* __restrict__ gamma, bf16* __restrict__ y,
                                                  float* __restrict__ rstd, int rows, int cols, float eps) {
  __shared__ k2c::rows::RowScratch scratch;
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const int vecs = cols / 8;
  const Vec* xr = reinterpret_cast<const Vec*>(x + static_cast<std::size_t>(row) * cols);
  Vec* yr = reinterpret_cast<Vec*>(y + static_cast<std::size_t>(row) * cols);
  Vec raw[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * blockDim.x + threadIdx.x;
    if (live && v < vecs) raw[it] = xr[v];
  }
  float first = kSoftmax ? Max::identity : 0.0f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * blockDim.x + threadIdx.x;
    if (live && v < vecs) {
      float f[8];
      unpack(raw[it], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) first = kSoftmax ? fmaxf(first, f[i]) : fmaf(f[i], f[i], first);
    }
  }
  if constexpr (kSoftmax) {
    const float m = k2c::rows::row_all(first, Max{}, scratch);
    float sum = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * blockDim.x + threadIdx.x;
      if (live && v < vecs) {
        float f[8];
        unpack(raw[it], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += __expf(f[i] - m);
      }
    }
    const float inv = 1.0f / k2c::rows::row_all(sum, Sum{}, scratch);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * blockDim.x + threadIdx.x;
      if (live && v < vecs) {
        float f[8];
        unpack(raw[it], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = __expf(f[i] - m) * inv;
        yr[v] = pack(f);
      }
    }
  } else {
    const float rs = rsqrtf(k2c::rows::row_all(first, Sum{}, scratch) / cols + eps);
    if (live && threadIdx.x == 0) rstd[row] = rs;
    rms_scale_store(raw, gamma, yr, rs, threadIdx.x, blockDim.x, live ? vecs : 0);
  }
}

// A block's ring of S slots of slot_bytes each (128-byte aligned in dynamic shared memory), then
// one mbarrier per slot, initialised by thread 0 before any thread goes on.
struct BlockRing {
  std::uint32_t ring, bars;
};
__device__ __forceinline__ BlockRing block_ring_setup(unsigned char* smem, int S, std::uint32_t slot_bytes) {
  BlockRing b;
  b.ring = (saddr(smem) + 127) & ~127u;
  b.bars = b.ring + S * slot_bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) hp::mbarrier_init(b.bars + 8 * s, 1);
    hp::fence_barrier_init();
  }
  __syncthreads();
  return b;
}

// ---- block rings for the one-input kernels: block b takes rows b, b + blocks, ...; its ring holds
// S rows; thread 0 refills a slot once the block's first reduction (whose barriers follow every
// thread's reads of the slot) is over. Thread t keeps vectors t + 256·i (ITERS of them) packed.
template <bool kSoftmax, int ITERS>
__global__ __launch_bounds__(256) void block_ring(const bf16* __restrict__ x, const bf16* __restrict__ gamma, bf16* __restrict__ y,
                                                 float* __restrict__ rstd, int rows, int cols, float eps, int S) {
  extern __shared__ unsigned char smem[];
  __shared__ k2c::rows::RowScratch scratch;
  const std::uint32_t row_bytes = cols * 2;
  const auto [ring, bars] = block_ring_setup(smem, S, row_bytes);
  auto issue = [&](int k) {
    const int r = blockIdx.x + k * gridDim.x;
    if (threadIdx.x == 0 && r < rows) {
      const std::uint32_t bar = bars + 8 * (k % S);
      hp::mbarrier_arrive_expect_tx(bar, row_bytes);
      hp::bulk_load(ring + (k % S) * row_bytes, x + static_cast<std::size_t>(r) * cols, row_bytes, bar);
    }
  };
  for (int k = 0; k < S; ++k) issue(k);
  const int vecs = cols / 8;
  for (int k = 0, r = blockIdx.x; r < rows; ++k, r += gridDim.x) {
    hp::mbarrier_wait(bars + 8 * (k % S), (k / S) & 1);
    const std::uint32_t at = ring + (k % S) * row_bytes;
    Vec raw[ITERS];
    float first = kSoftmax ? Max::identity : 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs) {
        raw[it] = lds16(at + 16 * v);
        float f[8];
        unpack(raw[it], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) first = kSoftmax ? fmaxf(first, f[i]) : fmaf(f[i], f[i], first);
      }
    }
    hp::fence_proxy_async();
    Vec* yr = reinterpret_cast<Vec*>(y + static_cast<std::size_t>(r) * cols);
    if constexpr (kSoftmax) {
      const float m = k2c::rows::row_all(first, Max{}, scratch);
      issue(k + S);
      float e[ITERS][8], sum = 0.0f;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int v = it * 256 + threadIdx.x;
        if (v < vecs) {
          unpack(raw[it], e[it]);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            e[it][i] = __expf(e[it][i] - m);
            sum += e[it][i];
          }
        }
      }
      const float inv = 1.0f / k2c::rows::row_all(sum, Sum{}, scratch);
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int v = it * 256 + threadIdx.x;
        if (v < vecs) {
#pragma unroll
          for (int i = 0; i < 8; ++i) e[it][i] *= inv;
          yr[v] = pack(e[it]);
        }
      }
    } else {
      const float rs = rsqrtf(k2c::rows::row_all(first, Sum{}, scratch) / cols + eps);
      issue(k + S);
      if (threadIdx.x == 0) rstd[r] = rs;
      rms_scale_store(raw, gamma, yr, rs, threadIdx.x, 256, vecs);
    }
  }
}

// ---- register backward variants at rows of up to 4096 bf16 (256 threads x 2 vectors a row):
// ROWS rows per block, whose reductions share their barriers, and with PIPE each row-group's next
// row of h and dy loaded (as bits) before the current row is reduced, so one row is always on its
// way while another is computed. Persistent, one partial row of dgamma per row-group.
template <int ROWS, bool PIPE>
__global__ __launch_bounds__(256 * ROWS) void bwd_rows(const bf16* __restrict__ h, const bf16* __restrict__ gamma,
                                                    const bf16* __restrict__ dy, const float* __restrict__ rstd,
                                                    bf16* __restrict__ dx, float* __restrict__ partial, int rows, int cols) {
  constexpr int IT = 2;
  __shared__ k2c::rows::RowScratch scratch;
  const int vecs = cols / 8;
  auto has = [&](long row, int it) { return row < rows && it * 256 + static_cast<int>(threadIdx.x) < vecs; };
  auto load_row = [&](long row, Vec (&hb)[IT], Vec (&db)[IT]) {
#pragma unroll
    for (int it = 0; it < IT; ++it)
      if (has(row, it)) {
        const std::size_t at = static_cast<std::size_t>(row) * cols + 8 * (it * 256 + threadIdx.x);
        hb[it] = k2c::rows::load_bits<bf16, 8>(h + at);
        db[it] = k2c::rows::load_bits<bf16, 8>(dy + at);
      }
  };
  float dg[IT][8] = {};
  const long step = static_cast<long>(gridDim.x) * ROWS;
  long row = static_cast<long>(blockIdx.x) * ROWS + threadIdx.y;
  Vec hb[IT], db[IT];
  load_row(row, hb, db);
  // h, dy and gamma of vector it of this thread's current row, as floats.
  auto floats = [&](int it, float (&hf)[8], float (&df)[8], float (&gf)[8]) {
    unpack(hb[it], hf);
    unpack(db[it], df);
    unpack(__ldg(reinterpret_cast<const Vec*>(gamma) + it * 256 + threadIdx.x), gf);
  };
  for (long first = static_cast<long>(blockIdx.x) * ROWS; first < rows; first += step, row += step) {
    Vec hn[IT], dn[IT];
    if constexpr (PIPE) load_row(row + step, hn, dn);
    const float r = row < rows ? rstd[row] : 0.0f;
    float dot = 0.0f;
#pragma unroll
    for (int it = 0; it < IT; ++it)
      if (has(row, it)) {
        float hf[8], df[8], gf[8];
        floats(it, hf, df, gf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dot += gf[i] * df[i] * hf[i];
          dg[it][i] += df[i] * hf[i] * r;
        }
      }
    const float k = r * r * r * k2c::rows::row_all(dot, Sum{}, scratch) / cols;
#pragma unroll
    for (int it = 0; it < IT; ++it)
      if (has(row, it)) {
        float hf[8], df[8], gf[8];
        floats(it, hf, df, gf);
#pragma unroll
        for (int i = 0; i < 8; ++i) df[i] = r * gf[i] * df[i] - k * hf[i];
        k2c::rows::store_bits<bf16, 8>(dx + static_cast<std::size_t>(row) * cols + 8 * (it * 256 + threadIdx.x),
                                       pack(df));
      }
    if constexpr (PIPE) {
#pragma unroll
      for (int it = 0; it < IT; ++it) hb[it] = hn[it], db[it] = dn[it];
    } else {
      load_row(row + step, hb, db);
    }
  }
  float* mine = partial + (static_cast<std::size_t>(blockIdx.x) * ROWS + threadIdx.y) * cols;
#pragma unroll
  for (int it = 0; it < IT; ++it)
    if (it * 256 + static_cast<int>(threadIdx.x) < vecs)
#pragma unroll
      for (int i = 0; i < 8; ++i) mine[8 * (it * 256 + threadIdx.x) + i] = dg[it][i];
}

// ---- RMSNorm backward, a block ring: block b takes rows b, b + blocks, ...; slot s holds the
// row of h and the row of dy. Thread t handles vectors t + 256·i of a row (ITERS of them) and
// keeps its columns' dgamma partial sums in registers; one partial row per block at the end.
template <int ITERS, int MIN_BLOCKS>
__global__ __launch_bounds__(256, MIN_BLOCKS) void rms_bwd_ring(const bf16* __restrict__ h, const bf16* __restrict__ gamma,
                                                   const bf16* __restrict__ dy, const float* __restrict__ rstd,
                                                   bf16* __restrict__ dx, float* __restrict__ partial, int rows, int cols, int S) {
  extern __shared__ unsigned char smem[];
  __shared__ k2c::rows::RowScratch scratch;
  const std::uint32_t row_bytes = cols * 2;
  const auto [ring, bars] = block_ring_setup(smem, S, 2 * row_bytes);
  auto issue = [&](int k) {
    const int r = blockIdx.x + k * gridDim.x;
    if (threadIdx.x == 0 && r < rows) {
      const std::uint32_t bar = bars + 8 * (k % S), at = ring + (k % S) * 2 * row_bytes;
      hp::mbarrier_arrive_expect_tx(bar, 2 * row_bytes);
      hp::bulk_load(at, h + static_cast<std::size_t>(r) * cols, row_bytes, bar);
      hp::bulk_load(at + row_bytes, dy + static_cast<std::size_t>(r) * cols, row_bytes, bar);
    }
  };
  for (int k = 0; k < S; ++k) issue(k);
  const int vecs = cols / 8;
  float g[ITERS][8], dg[ITERS][8] = {};
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * 256 + threadIdx.x;
    if (v < vecs) unpack(__ldg(reinterpret_cast<const Vec*>(gamma) + v), g[it]);
  }
  for (int k = 0, r = blockIdx.x; r < rows; ++k, r += gridDim.x) {
    hp::mbarrier_wait(bars + 8 * (k % S), (k / S) & 1);
    const std::uint32_t at = ring + (k % S) * 2 * row_bytes;
    Vec hr[ITERS], dr[ITERS];
    float dot = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs) {
        hr[it] = lds16(at + 16 * v);
        dr[it] = lds16(at + row_bytes + 16 * v);
        float hf[8], df[8];
        unpack(hr[it], hf);
        unpack(dr[it], df);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(g[it][i] * df[i], hf[i], dot);
      }
    }
    hp::fence_proxy_async();
    const float total = k2c::rows::row_all(dot, Sum{}, scratch);  // its barriers end the slot's reads
    issue(k + S);
    const float rs = rstd[r], kk = rs * rs * rs * total / cols;
    Vec* out = reinterpret_cast<Vec*>(dx + static_cast<std::size_t>(r) * cols);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * 256 + threadIdx.x;
      if (v < vecs) {
        float hf[8], df[8], o[8];
        unpack(hr[it], hf);
        unpack(dr[it], df);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dg[it][i] = fmaf(df[i] * hf[i], rs, dg[it][i]);
          o[i] = rs * g[it][i] * df[i] - kk * hf[i];
        }
        out[v] = pack(o);
      }
    }
  }
  float* mine = partial + static_cast<std::size_t>(blockIdx.x) * cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * 256 + threadIdx.x;
    if (v < vecs)
#pragma unroll
      for (int i = 0; i < 8; ++i) mine[8 * v + i] = dg[it][i];
  }
}

// ---- harness ---------------------------------------------------------------------------------
static double g_ceiling = 0;
static int g_sms = 0;
void report(const char* what, double bytes, double ms) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  std::printf("%-56s %8.4f ms %7.0f GB/s  %.3f of the 1 GiB memcpy\n", what, ms, gbs, gbs / g_ceiling);
}
double timed(const std::function<void()>& f) { return graded_ms(f); }
float max_diff(const bf16* a, const bf16* b, std::size_t n) { return max_bf16_diff(a, b, n, true); }
template <class K>
int blocks_for(K kernel, int threads, int smem) {
  int per_sm = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();  // too much shared memory: not a configuration, not an error
    return 0;
  }
  return per_sm * g_sms;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // Sections to run (default all): packed mix bwd parts anatomy cluster copy softmax rmsfwd rmsbwd.
  auto wanted = [&](const char* section) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; ++i)
      if (std::string(argv[i]) == section) return true;
    return false;
  };
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  g_sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs, L2 %d MiB\n", prop.name, g_sms, prop.l2CacheSize >> 20);
  const int rows = 16384, cols = 4096;
  const std::size_t n = std::size_t{rows} * cols;
  bf16 *x, *y, *y2, *dy, *gamma, *big1, *big2;
  float *rstd, *partial, *dgamma, *dgamma2;
  cudaMalloc(&x, n * 2);
  cudaMalloc(&y, n * 2);
  cudaMalloc(&y2, n * 2);
  cudaMalloc(&dy, n * 2);
  cudaMalloc(&gamma, cols * 2);
  cudaMalloc(&rstd, rows * 4);
  cudaMalloc(&partial, std::size_t{4096} * cols * 4);
  cudaMalloc(&dgamma, cols * 4);
  cudaMalloc(&dgamma2, cols * 4);
  cudaMalloc(&big1, std::size_t{1} << 30);
  cudaMalloc(&big2, std::size_t{1} << 30);
  k2c::fill_uniform_device(x, n, 1, -8.0f, 8.0f);
  k2c::fill_uniform_device(dy, n, 2);
  k2c::fill_uniform_device(gamma, cols, 3);
  cudaMemset(big1, 0x5A, std::size_t{1} << 30);
  g_ceiling = 2.0 * (1 << 30) / (timed([&] { cudaMemcpyAsync(big2, big1, std::size_t{1} << 30, cudaMemcpyDeviceToDevice); }) * 1e-3) / 1e9;
  std::printf("memcpy 1 GiB: %.0f GB/s\n", g_ceiling);
  const double two = 2.0 * n * 2, three = 3.0 * n * 2;


  auto packed_variants = [&](bool softmax) {
    for (int threads : {32, 64, 128, 256}) {
      const int iters = 512 / threads;
      const dim3 block(threads, 256 / threads);
      const unsigned grid = (rows + block.y - 1) / block.y;
      cudaMemset(y2, 0xFF, n * 2);
      double ms = 0;
      auto go = [&](auto kern) { ms = timed([&] { kern<<<grid, block>>>(x, gamma, y2, rstd, rows, cols, 1e-6f); }); };
      if (softmax) {
        if (iters == 16) go(packed_rows<true, 16>); else if (iters == 8) go(packed_rows<true, 8>);
        else if (iters == 4) go(packed_rows<true, 4>); else go(packed_rows<true, 2>);
      } else {
        if (iters == 16) go(packed_rows<false, 16>); else if (iters == 8) go(packed_rows<false, 8>);
        else if (iters == 4) go(packed_rows<false, 4>); else go(packed_rows<false, 2>);
      }
      char name[96];
      std::snprintf(name, sizeof name, "packed registers %d threads x %d vectors, diff %.1e", threads, iters, max_diff(y2, y, n));
      report(name, two, ms);
    }
  };
  // The shipped register kernels beside the experiment's packed ones, back to back.
  if (wanted("packed")) {
  std::printf("\n-- packed registers against the solutions, 16384 x 4096 bf16\n");
  namespace sm = k2c::softmax;
  report("reference softmax fast", two, timed([&] { sm::softmax(sm::Version::fast, x, y, rows, cols); }));
  packed_variants(true);
  k2c::rmsnorm::forward(x, nullptr, gamma, y, nullptr, rstd, rows, cols, 1e-6f);
  report("reference RMSNorm forward", two, timed([&] { k2c::rmsnorm::forward(x, nullptr, gamma, y, nullptr, rstd, rows, cols, 1e-6f); }));
  packed_variants(false);
  for (bool early : {true, false}) {
    const auto kernel = early ? k2c::rmsnorm::forward_kernel<8, 2, false, true> : k2c::rmsnorm::forward_kernel<8, 2, false, false>;
    cudaMemset(y2, 0xFF, n * 2);
    const double ms = timed([&] { kernel<<<rows, 256>>>(x, nullptr, gamma, y2, nullptr, rstd, rows, cols, 1e-6f); });
    char name[96];
    std::snprintf(name, sizeof name, "solution's forward kernel, gamma %s, diff %.1e", early ? "early" : "late", max_diff(y2, y, n));
    report(name, two, ms);
  }
  }
  // Reading two bytes per byte written (the RMSNorm backward's mix) against the copy's one to one.
  if (wanted("mix")) {
  std::printf("\n-- two reads per write, 3 x 128 MiB\n");
  const std::size_t n16 = n * 2 / 16;
  const double three = 3.0 * n * 2;
  report("memcpy 384 MiB (same bytes, one read per write)", 2.0 * (std::size_t{384} << 20),
         timed([&] { cudaMemcpyAsync(big2, big1, std::size_t{384} << 20, cudaMemcpyDeviceToDevice); }));
  report("copy kernel 2 x 16 B, 128 MiB", two, timed([&] { copy_kernel<2><<<(n16 + 511) / 512, 256>>>((int4*)x, (int4*)y, n16); }));
  report("add kernel, 1 x 16 B of each input per thread", three, timed([&] { add_kernel<1><<<(n16 + 255) / 256, 256>>>((int4*)x, (int4*)dy, (int4*)y, n16); }));
  report("add kernel, 2 x 16 B", three, timed([&] { add_kernel<2><<<(n16 + 511) / 512, 256>>>((int4*)x, (int4*)dy, (int4*)y, n16); }));
  report("add kernel, 4 x 16 B", three, timed([&] { add_kernel<4><<<(n16 + 1023) / 1024, 256>>>((int4*)x, (int4*)dy, (int4*)y, n16); }));
  k2c::rmsnorm::forward(x, nullptr, gamma, y2, nullptr, rstd, rows, cols, 1e-6f);
  report("reference RMSNorm backward (ring)", three, timed([&] {
    k2c::rmsnorm::backward(x, gamma, dy, rstd, y, dgamma, partial, rows, cols);
  }));
  }
  // The register backward (persistent row-groups, h and dy as bits) beside the Hopper ring the
  // solution runs at this shape. (Variants that also prefetched each row-group's row 1 to 6 steps
  // ahead into L2 measured 0.73 to 0.56, see h200.json.)
  if (wanted("bwd")) {
  std::printf("\n-- RMSNorm backward 16384 x 4096 bf16, register kernel\n");
  namespace rn = k2c::rmsnorm;
  const double three = 3.0 * n * 2;
  rn::forward(x, nullptr, gamma, y2, nullptr, rstd, rows, cols, 1e-6f);
  report("reference backward (ring)", three, timed([&] { rn::backward(x, gamma, dy, rstd, y, dgamma, partial, rows, cols); }));
  auto variant = [&](auto kernel, int) {
    const dim3 block(256, 1);
    const unsigned blocks = rn::persistent_blocks(kernel, block, rows, cols);
    cudaMemset(y2, 0xFF, n * 2);
    const double ms = timed([&] {
      kernel<<<blocks, block>>>(x, gamma, dy, rstd, y2, partial, rows, cols);
      rn::sum_partials_kernel<<<(cols + 31) / 32, dim3(32, rn::kSumWarps)>>>(partial, dgamma2, static_cast<int>(blocks), cols);
    });
    char name[96];
    std::snprintf(name, sizeof name, "registers, %u blocks, diff %.1e", blocks, max_diff(y2, y, n));
    report(name, three, ms);
  };
  variant(rn::backward_kernel<8, 2>, 0);
  auto rows_variant = [&](auto kernel, int rows_per_block, bool pipe) {
    const dim3 block(256, rows_per_block);
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256 * rows_per_block, 0);
    const int blocks = std::min(4096 / rows_per_block, per_sm * g_sms);
    cudaMemset(y2, 0xFF, n * 2);
    const double ms = timed([&] {
      kernel<<<blocks, block>>>(x, gamma, dy, rstd, y2, partial, rows, cols);
      rn::sum_partials_kernel<<<(cols + 31) / 32, dim3(32, rn::kSumWarps)>>>(partial, dgamma2, blocks * rows_per_block, cols);
    });
    char name[96];
    std::snprintf(name, sizeof name, "%d row(s) a block%s, %d blocks, diff %.1e", rows_per_block,
                  pipe ? ", next row loaded first" : "", blocks, max_diff(y2, y, n));
    report(name, three, ms);
  };
  rows_variant(bwd_rows<1, false>, 1, false);
  rows_variant(bwd_rows<1, true>, 1, true);
  rows_variant(bwd_rows<2, false>, 2, false);
  rows_variant(bwd_rows<2, true>, 2, true);
  rows_variant(bwd_rows<4, true>, 4, true);
  }
  // The backward taken apart (anatomy kernels above) at several grid sizes.
  if (wanted("anatomy")) {
  std::printf("\n-- RMSNorm backward's anatomy, 16384 x 4096 bf16 (h, dy in, dx out)\n");
  const char* what[] = {"h + dy", "h + dy after a row reduction", "reduction, dgamma rows by scalar stores",
                        "reduction, dgamma accumulated, not written", "reduction, dgamma rows by float4 stores",
                        "reduction, dgamma rows through shared memory"};
  for (int grid : {396, 792, 1056, 16384})
    for (int mode = 0; mode < 6; ++mode) {
      if (mode >= 2 && grid > 4096) continue;  // partial rows for 4096 blocks at most
      const double ms = timed([&] {
        if (mode == 0) anatomy<0><<<grid, 256>>>(x, dy, y, partial, rows, cols);
        if (mode == 1) anatomy<1><<<grid, 256>>>(x, dy, y, partial, rows, cols);
        if (mode == 2) anatomy<2><<<grid, 256>>>(x, dy, y, partial, rows, cols);
        if (mode == 3) anatomy<3><<<grid, 256>>>(x, dy, y, partial, rows, cols);
        if (mode == 4) anatomy<4><<<grid, 256>>>(x, dy, y, partial, rows, cols);
        if (mode == 5) anatomy<5><<<grid, 256>>>(x, dy, y, partial, rows, cols);
      });
      char name[96];
      std::snprintf(name, sizeof name, "%s, %d blocks", what[mode], grid);
      report(name, three, ms);
    }
  }
  // Where the backward's time goes: the ring kernel and the partial-row sum timed alone.
  if (wanted("parts")) {
  std::printf("\n-- RMSNorm backward 16384 x 4096 bf16, its two kernels\n");
  namespace rn = k2c::rmsnorm;
  rn::forward(x, nullptr, gamma, y2, nullptr, rstd, rows, cols, 1e-6f);
  report("reference backward (ring + sum)", three, timed([&] { rn::backward(x, gamma, dy, rstd, y, dgamma, partial, rows, cols); }));
  int partials = 0;
  report("ring kernel alone", three, timed([&] { partials = rn::backward_ring(x, gamma, dy, rstd, y, partial, rows, cols, 0); }));
  report("ring, then the sum as a plain launch (not a dependent one)", three, timed([&] {
           rn::backward_ring(x, gamma, dy, rstd, y, partial, rows, cols, 0);
           rn::sum_partials_kernel<<<(cols + 31) / 32, dim3(32, rn::kSumWarps)>>>(partial, dgamma2, partials, cols);
         }));
  char name[96];
  std::snprintf(name, sizeof name, "sum of %d partial rows alone (bytes of the backward)", partials);
  report(name, three, timed([&] { rn::sum_partials_kernel<<<(cols + 31) / 32, dim3(32, rn::kSumWarps)>>>(partial, dgamma2, partials, cols); }));
  }
  // The ring's blocks in clusters that pre-sum their partial rows (backward_ring_kernel's
  // CLUSTER): the whole backward (ring + dependent sum) per cluster size, in 4 rounds that rotate
  // the order; then the largest relative difference of dgamma from the unclustered one.
  if (wanted("cluster")) {
  std::printf("\n-- RMSNorm backward 16384 x 4096 bf16, partial rows pre-summed by clusters\n");
  namespace rn = k2c::rmsnorm;
  rn::forward(x, nullptr, gamma, y2, nullptr, rstd, rows, cols, 1e-6f);
  auto backward = [&](auto cluster, float* dg) {
    const int partials = rn::backward_ring<decltype(cluster)::value>(x, gamma, dy, rstd, y, partial, rows, cols, 0);
    rn::sum_partials(partial, dg, partials, cols, true, 0);
  };
  const std::vector<std::function<void()>> variants = {[&] { backward(std::integral_constant<int, 1>{}, dgamma); },
                                                        [&] { backward(std::integral_constant<int, 2>{}, dgamma); },
                                                        [&] { backward(std::integral_constant<int, 4>{}, dgamma); }};
  const char* names[3] = {"clusters of 1 (no pre-sum)", "clusters of 2", "clusters of 4"};
  const auto ms = rotating_rounds(variants, 4, timed);
  for (int round = 0; round < 4; ++round)
    for (int v = 0; v < 3; ++v) {
      char name[96];
      std::snprintf(name, sizeof name, "round %d, %s", round, names[v]);
      report(name, three, ms[v][round]);
    }
  std::vector<float> want(cols), got(cols);
  backward(std::integral_constant<int, 1>{}, dgamma);
  cudaMemcpy(want.data(), dgamma, 4 * cols, cudaMemcpyDeviceToHost);
  for (int v = 1; v < 3; ++v) {
    variants[v]();
    cudaMemcpy(got.data(), dgamma, 4 * cols, cudaMemcpyDeviceToHost);
    double worst = 0;
    for (int c = 0; c < cols; ++c) worst = std::max(worst, std::fabs(double(got[c]) - want[c]) / std::max(1e-6, std::fabs(double(want[c]))));
    std::printf("%s: dgamma's largest relative difference from clusters of 1: %.3g (%s)\n", names[v], worst,
                cudaGetErrorString(cudaDeviceSynchronize()));
  }
  }
  if (wanted("copy")) {
  std::printf("\n-- copies of 128 MiB\n");
  for (std::size_t mib : {128, 192, 256, 512}) {
    char name[64];
    std::snprintf(name, sizeof name, "memcpy %zu MiB", mib);
    report(name, 2.0 * (mib << 20), timed([&] { cudaMemcpyAsync(big2, big1, mib << 20, cudaMemcpyDeviceToDevice); }));
  }
  const std::size_t n16 = n * 2 / 16;
  report("copy kernel, 1 x 16 B per thread", two, timed([&] { copy_kernel<1><<<(n16 + 255) / 256, 256>>>((int4*)x, (int4*)y, n16); }));
  report("copy kernel, 2 x 16 B per thread", two, timed([&] { copy_kernel<2><<<(n16 + 511) / 512, 256>>>((int4*)x, (int4*)y, n16); }));
  report("copy kernel, 4 x 16 B per thread", two, timed([&] { copy_kernel<4><<<(n16 + 1023) / 1024, 256>>>((int4*)x, (int4*)y, n16); }));
  report("copy kernel, 8 x 16 B per thread", two, timed([&] { copy_kernel<8><<<(n16 + 2047) / 2048, 256>>>((int4*)x, (int4*)y, n16); }));

  }
  if (wanted("softmax")) {
  std::printf("\n-- softmax 16384 x 4096 bf16\n");
  namespace sm = k2c::softmax;
  report("reference fast", two, timed([&] { sm::softmax(sm::Version::fast, x, y, rows, cols); }));
  packed_variants(true);
  for (int S : {2, 3, 4, 6})
    for (int per_sm : {2, 3, 4, 6, 8}) {
      const int smem = S * (cols * 2 + 8) + 128;
      if (blocks_for(block_ring<true, 2>, 256, smem) < per_sm * g_sms) continue;
      cudaMemset(y2, 0xFF, n * 2);
      const double ms = timed([&] { block_ring<true, 2><<<per_sm * g_sms, 256, smem>>>(x, gamma, y2, rstd, rows, cols, 0.f, S); });
      char name[96];
      std::snprintf(name, sizeof name, "block ring S%d, %d blocks/SM, diff %.1e", S, per_sm, max_diff(y2, y, n));
      report(name, two, ms);
    }
  for (int S : {2, 3, 4, 6}) {
    for (int W : {4, 8}) {
      auto kern = W == 4 ? softmax_ring<4> : softmax_ring<8>;
      const int smem = W == 4 ? ring_smem<4>(S, cols) : ring_smem<8>(S, cols);
      const int grid = blocks_for(kern, 32 * W, smem);
      if (grid == 0) continue;
      cudaMemset(y2, 0xFF, n * 2);
      const double ms = timed([&] { kern<<<grid, 32 * W, smem>>>(x, y2, rows, cols, S); });
      char name[96];
      std::snprintf(name, sizeof name, "warp ring S%d W%d (%d blocks) diff %.1e", S, W, grid, max_diff(y2, y, n));
      report(name, two, ms);
    }
  }

  }
  namespace rn = k2c::rmsnorm;
  if (wanted("rmsfwd")) {
  std::printf("\n-- RMSNorm forward 16384 x 4096 bf16\n");
  rn::forward(x, nullptr, gamma, y, nullptr, rstd, rows, cols, 1e-6f);
  packed_variants(false);
  for (int S : {2, 3, 4, 6})
    for (int per_sm : {2, 3, 4, 6, 8}) {
      const int smem = S * (cols * 2 + 8) + 128;
      if (blocks_for(block_ring<false, 2>, 256, smem) < per_sm * g_sms) continue;
      cudaMemset(y2, 0xFF, n * 2);
      const double ms = timed([&] { block_ring<false, 2><<<per_sm * g_sms, 256, smem>>>(x, gamma, y2, rstd, rows, cols, 1e-6f, S); });
      char name[96];
      std::snprintf(name, sizeof name, "block ring S%d, %d blocks/SM, diff %.1e", S, per_sm, max_diff(y2, y, n));
      report(name, two, ms);
    }
  report("reference forward", two, timed([&] { rn::forward(x, nullptr, gamma, y, nullptr, rstd, rows, cols, 1e-6f); }));
  for (int S : {2, 3, 4, 6}) {
    for (int W : {4, 8}) {
      auto kern = W == 4 ? rms_fwd_ring<4> : rms_fwd_ring<8>;
      const int smem = W == 4 ? ring_smem<4>(S, cols) : ring_smem<8>(S, cols);
      const int grid = blocks_for(kern, 32 * W, smem);
      if (grid == 0) continue;
      cudaMemset(y2, 0xFF, n * 2);
      const double ms = timed([&] { kern<<<grid, 32 * W, smem>>>(x, gamma, y2, rstd, rows, cols, 1e-6f, S); });
      char name[96];
      std::snprintf(name, sizeof name, "warp ring S%d W%d (%d blocks) diff %.1e", S, W, grid, max_diff(y2, y, n));
      report(name, two, ms);
    }
  }

  }
  if (wanted("rmsbwd")) {
  std::printf("\n-- RMSNorm backward 16384 x 4096 bf16 (rate counts h, dy, dx)\n");
  rn::forward(x, nullptr, gamma, y, nullptr, rstd, rows, cols, 1e-6f);
  void* ws;
  cudaMalloc(&ws, rn::backward_workspace_bytes(rows, cols));
  report("reference backward", three, timed([&] { rn::backward(x, gamma, dy, rstd, y, dgamma, ws, rows, cols); }));
  auto bwd_variant = [&](auto kern, int S, int per_sm, const char* tag) {
    const int smem = S * 2 * cols * 2 + S * 8 + 128;
    if (blocks_for(kern, 256, smem) < per_sm * g_sms) return;
    const int grid = per_sm * g_sms;
    cudaMemset(y2, 0xFF, n * 2);
    const double ms = timed([&] {
      kern<<<grid, 256, smem>>>(x, gamma, dy, rstd, y2, partial, rows, cols, S);
      k2c::rmsnorm::sum_partials_kernel<<<(cols + 31) / 32, dim3(32, 32)>>>(partial, dgamma2, grid, cols);
    });
    rn::backward(x, gamma, dy, rstd, y, dgamma, ws, rows, cols);  // the reference's dx and dgamma
    std::vector<float> a(cols), b(cols);
    cudaMemcpy(a.data(), dgamma, cols * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(b.data(), dgamma2, cols * 4, cudaMemcpyDeviceToHost);
    float dgd = 0;
    for (int c = 0; c < cols; ++c) dgd = std::max(dgd, std::fabs(a[c] - b[c]) / std::max(std::fabs(a[c]), 1e-3f));
    char name[128];
    std::snprintf(name, sizeof name, "block ring%s S%d, %d blocks/SM, dx diff %.1e dg diff %.1e", tag, S, per_sm,
                  max_diff(y2, y, n), dgd);
    report(name, three, ms);
  };
  for (int S : {2, 3, 4})
    for (int per_sm : {3, 4}) {
      bwd_variant(rms_bwd_ring<2, 1>, S, per_sm, "");
      bwd_variant(rms_bwd_ring<2, 4>, S, per_sm, " (64 registers)");
    }
  }

  return 0;
}
