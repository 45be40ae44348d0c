// solutions/07_rmsnorm/rmsnorm.cu — reference solution of module 07 (contract: rmsnorm.h).
//
// Both passes are memory-bound. Bytes per element (bf16):
//   forward   read h, write y                                     4 B  (8 B with the fused add:
//             read x and residual, write residual_out and y)
//   backward  read h and dy, write dx                             6 B
// gamma, rstd and dgamma are one row or one column: noise next to rows × cols. So each pass must
// touch its matrices exactly once, at copy speed, and the design follows module 06's fast softmax:
// a row lives in registers between its reduction and its output (k2c/device/rows.cuh).
//
// Forward: one reduction per row (the sum of squares), then y = h · rstd · gamma. gamma is read by
// every row, but 8 KiB of it stays in L1/L2; rstd is one float per row.
//
// Backward: with r = rstd and n = cols, differentiating y_j = h_j · r · g_j gives
//   dx_j = r · g_j · dy_j − h_j · r³/n · Σ_k dy_k · g_k · h_k
// (the second term is the path through r, which depends on every h_k): one more row reduction,
// then a pointwise formula. dgamma_j = Σ_rows dy_j · h_j · r is a reduction over rows, the
// transpose of everything else. Adding each row's contribution with atomicAdd into dgamma[j]
// would have all 16384 rows hammer the same 4096 addresses. Instead the grid is persistent
// (as many blocks as fit on the GPU at once, each looping over rows): a thread always handles the
// same columns, so it accumulates its columns' dgamma in registers across all its rows, and each
// row-group writes one partial row at the end. A second small kernel sums the partial rows per
// column: ~P × cols floats (P ≈ a few hundred), a few MB against the hundreds of MB of the main
// pass, with no atomics at all and a fixed summation order (bit-identical from run to run).
//
// On Hopper (sm_90) the backward pass of rows of 2048 to 8192 columns streams its rows differently:
// see backward_ring_kernel.
//
// Rows too long for registers take other kernels: in the forward, rows over 65536 bf16 in 16-byte
// vectors (32768 with the fused add) or over 16384 read one element at a time (8192 with the add);
// in the backward, over 16384 in vectors or 8192 one at a time. The forward pass reads the row twice in
// a loop kernel (the second read of a row mostly comes from L2); the backward pass uses two
// kernels, described before backward_slice_kernel.
#include <algorithm>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/device/hopper.cuh"
#include "k2c/device/rows.cuh"
#include "rmsnorm.h"

namespace k2c::rmsnorm {
namespace {

using namespace k2c::rows;

constexpr int kVecBf16 = kVec<bf16>;  // 8 bf16 in 16 bytes
// The forward keeps its row as bits (k2c::rows::kMaxBitsIters vectors a thread at most), two
// vectors a thread where the row allows (measured best, see forward_kernel). The backward keeps h
// and dy as bits and the running dgamma as floats: 16 of those and 8 vectors a thread at most
// (beyond that ptxas spills heavily), two vectors a thread where the row allows.
constexpr int kForwardTargetIters = 2;
template <int VEC>
inline constexpr int kBackwardMaxIters = std::min(8, 16 / VEC);

// ----------------------------------------------------------------------------- forward ---
// h = x (+ residual, rounded to bf16 exactly as it is stored in residual_out, so the backward pass
// sees the same h the forward normalised).
template <int VEC, bool kResidual>
__device__ __forceinline__ void load_h(const bf16* x, const bf16* residual, bf16* residual_out,
                                       std::size_t at, float (&h)[VEC]) {
  load<bf16, VEC>(x + at, h);
  if constexpr (kResidual) {
    float r[VEC];
    load<bf16, VEC>(residual + at, r);
#pragma unroll
    for (int i = 0; i < VEC; ++i) h[i] = __bfloat162float(__float2bfloat16(h[i] + r[i]));
    store<bf16, VEC>(residual_out + at, h);
  }
}

// The row is kept as the bits it was loaded as (module 06's registers kernel explains why), and
// every load of a thread is issued before any arithmetic: 256 threads × 2 vectors per 4096-wide
// row measured 0.91 of the copy rate on an H200, against 0.89 with the row held as floats. With
// the fused add, h = x + residual is rounded to bf16 anyway, so it is kept packed too.
// kEarlyGamma: gamma's vectors are asked for right after the row's, so that they arrive during
// the reduction instead of after it (where registers allow: 4 vectors a thread, 2 with the add).
template <int VEC, int ITERS, bool kResidual, bool kEarlyGamma = (ITERS <= (kResidual ? 2 : 4))>
__global__ __launch_bounds__(1024) void forward_kernel(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                               const bf16* __restrict__ gamma, bf16* __restrict__ y,
                               bf16* __restrict__ residual_out, float* __restrict__ rstd, int rows,
                               int cols, float eps) {
  __shared__ RowScratch scratch;
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;  // idle rows of the last block still join the reduction
  const std::size_t base = static_cast<std::size_t>(row) * cols;
  auto at = [&](int it) { return (it * blockDim.x + threadIdx.x) * VEC; };
  auto has = [&](int it) { return live && at(it) < cols; };

  Bits<bf16, VEC> h[ITERS];
  Bits<bf16, VEC> res[kResidual ? ITERS : 1];
  Bits<bf16, VEC> g_early[kEarlyGamma ? ITERS : 1];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    if (has(it)) {
      h[it] = load_bits<bf16, VEC>(x + base + at(it));
      if constexpr (kResidual) res[it] = load_bits<bf16, VEC>(residual + base + at(it));
    }
  }
  if constexpr (kEarlyGamma) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
      if (has(it)) g_early[it] = load_bits<bf16, VEC>(gamma + at(it));
  }

  float squares = 0.0f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    if (has(it)) {
      float v[VEC];
      unpack<bf16, VEC>(h[it], v);
      if constexpr (kResidual) {
        float r[VEC];
        unpack<bf16, VEC>(res[it], r);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] += r[i];
        h[it] = pack<bf16, VEC>(v);  // rounded: the h the backward pass will read
        store_bits<bf16, VEC>(residual_out + base + at(it), h[it]);
        unpack<bf16, VEC>(h[it], v);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) squares += v[i] * v[i];
    }
  }
  const float r = rsqrtf(row_all(squares, Sum{}, scratch) / cols + eps);
  if (live && threadIdx.x == 0) rstd[row] = r;

#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    if (has(it)) {
      float v[VEC], g[VEC];
      unpack<bf16, VEC>(h[it], v);
      unpack<bf16, VEC>(kEarlyGamma ? g_early[it] : load_bits<bf16, VEC>(gamma + at(it)), g);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] *= r * g[i];
      store_bits<bf16, VEC>(y + base + at(it), pack<bf16, VEC>(v));
    }
  }
}

// One block of 1024 threads per row, the row read twice: for rows that do not fit in registers.
// With the fused add, the second pass reads back residual_out, which this same thread wrote.
template <int VEC, bool kResidual>
__global__ __launch_bounds__(1024) void forward_loop_kernel(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                                    const bf16* __restrict__ gamma, bf16* __restrict__ y,
                                    bf16* residual_out, float* __restrict__ rstd, int cols,
                                    float eps) {
  __shared__ RowScratch scratch;
  const std::size_t base = static_cast<std::size_t>(blockIdx.x) * cols;
  float squares = 0.0f;
  for (int c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    float h[VEC];
    load_h<VEC, kResidual>(x, residual, residual_out, base + c, h);
#pragma unroll
    for (int i = 0; i < VEC; ++i) squares += h[i] * h[i];
  }
  const float r = rsqrtf(row_all(squares, Sum{}, scratch) / cols + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  const bf16* h_src = kResidual ? residual_out : x;
  for (int c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    float h[VEC], g[VEC];
    load<bf16, VEC>(h_src + base + c, h);
    load<bf16, VEC>(gamma + c, g);
#pragma unroll
    for (int i = 0; i < VEC; ++i) h[i] *= r * g[i];
    store<bf16, VEC>(y + base + c, h);
  }
}

template <int VEC, bool kResidual>
void forward_with(const bf16* x, const bf16* residual, const bf16* gamma, bf16* y, bf16* residual_out,
                  float* rstd, int rows, int cols, float eps, cudaStream_t stream) {
  // The fused add holds two rows of bits until the sum is formed, so it gets half the vectors.
  constexpr int kMaxIters = kMaxBitsIters<bf16, VEC> / (kResidual ? 2 : 1);
  const RowPlan plan = plan_row(cols, VEC, kMaxIters, kForwardTargetIters, /*min_threads=*/1);
  if (!plan.fits) {
    forward_loop_kernel<VEC, kResidual><<<rows, 1024, 0, stream>>>(x, residual, gamma, y, residual_out,
                                                                   rstd, cols, eps);
    return;
  }
  with_iters<kMaxIters>(plan.iters, [&](auto iters) {
    forward_kernel<VEC, iters(), kResidual><<<plan.blocks(rows), plan.block(), 0, stream>>>(
        x, residual, gamma, y, residual_out, rstd, rows, cols, eps);
  });
}

template <int VEC>
void forward_vec(const bf16* x, const bf16* residual, const bf16* gamma, bf16* y, bf16* residual_out,
                 float* rstd, int rows, int cols, float eps, cudaStream_t stream) {
  if (residual)
    forward_with<VEC, true>(x, residual, gamma, y, residual_out, rstd, rows, cols, eps, stream);
  else
    forward_with<VEC, false>(x, residual, gamma, y, residual_out, rstd, rows, cols, eps, stream);
}

// ---------------------------------------------------------------------------- backward ---
// A thread's VEC consecutive dgamma sums into its partial row, as 16-byte stores where VEC allows.
// Eight scalar stores a vector (each warp instruction then writes 4 bytes in each of 32 sectors)
// made 6.2 MiB of partial rows cost about 12 µs in a stripped-down backward (row_streams
// 'anatomy'): on an H200 at 16384 × 4096 the Hopper ring below measured 0.805 of the copy rate
// that way and 0.86 with float4 stores.
template <int VEC>
__device__ __forceinline__ void store_partial(float* p, const float (&v)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float four[4] = {v[i], v[i + 1], v[i + 2], v[i + 3]};
      store<float, 4>(p + i, four);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = v[i];
  }
}

// The persistent grid has at most partials_for(rows, cols) row-groups, so the workspace size
// depends on the shape only (not on the GPU): min(rows, max(256, 2^22 / cols)) partial rows, so
// at most max(2^22, 256 · cols) floats (16 MiB up to 16384 columns). That is 1024 partial rows at
// 4096 columns, while short rows may have many more groups (128 columns: up to 32768), which they
// need, since a GPU holds hundreds of 1-warp row-groups at once.
constexpr long kMaxPartialFloats = long{1} << 22;

// Rounded up to whole blocks: a block of several 1-warp rows owns all its row-groups' partial rows
// (zeros for those that got no row), even when there are fewer rows than that.
int partials_for(int rows, int cols) {
  const long by_size = std::max<long>(256, kMaxPartialFloats / std::max(cols, 1));
  const long groups = std::min<long>(rows, by_size);
  return static_cast<int>((groups + kMaxRowsPerBlock - 1) / kMaxRowsPerBlock * kMaxRowsPerBlock);
}

// h and dy are kept as their bits and every load of a row is issued before any arithmetic, as in
// the forward kernel: on an H200 at 16384 × 4096 this measured 0.795 of the copy rate (0.74 with
// the rows held as floats), level with the Hopper ring below (0.796 in the same process). Asking
// L2 for the row 1 to 6 steps ahead (prefetch.global.L2 by every thread) made it slower: 0.73 to
// 0.56.
// (__launch_bounds__(1024, 1): with the bare bound ptxas held the version with one 16-byte vector
// a thread to 32 registers and spilled.)
template <int VEC, int ITERS>
__global__ __launch_bounds__(1024, 1) void backward_kernel(const bf16* __restrict__ h, const bf16* __restrict__ gamma,
                                const bf16* __restrict__ dy, const float* __restrict__ rstd,
                                bf16* __restrict__ dx, float* __restrict__ partial, int rows, int cols) {
  __shared__ RowScratch scratch;
  auto at = [&](int it) { return (it * blockDim.x + threadIdx.x) * VEC; };
  float dg[ITERS][VEC] = {};
  // Every row-group of the block runs the same number of iterations (the loop is over the block's
  // first row), so all threads reach row_all's barriers together.
  // rows may come within 8192 of INT_MAX (kMaxExtent) and the stride can be larger than that, so
  // the step stops at rows instead of stepping past INT_MAX.
  const int step = gridDim.x * blockDim.y;
  for (int first = blockIdx.x * blockDim.y; first < rows; first = rows - first > step ? first + step : rows) {
    const int row = first + threadIdx.y;
    const bool live = row < rows;
    auto has = [&](int it) { return live && at(it) < cols; };
    const std::size_t base = static_cast<std::size_t>(row) * cols;
    const float r = live ? rstd[row] : 0.0f;
    // h and dy as their bits, every load issued before any arithmetic (see the forward kernel).
    Bits<bf16, VEC> hb[ITERS], db[ITERS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
      if (has(it)) {
        hb[it] = load_bits<bf16, VEC>(h + base + at(it));
        db[it] = load_bits<bf16, VEC>(dy + base + at(it));
      }
    // This thread's vector it of h, dy and gamma as floats (gamma read again at each use).
    auto unpack_at = [&](int it, float (&hv)[VEC], float (&d)[VEC], float (&g)[VEC]) {
      unpack<bf16, VEC>(hb[it], hv);
      unpack<bf16, VEC>(db[it], d);
      unpack<bf16, VEC>(load_bits<bf16, VEC>(gamma + at(it)), g);
    };
    float dot = 0.0f;  // Σ dy·gamma·h over the row
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (has(it)) {
        float hv[VEC], d[VEC], g[VEC];
        unpack_at(it, hv, d, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          dot += g[i] * d[i] * hv[i];
          dg[it][i] += d[i] * hv[i] * r;
        }
      }
    }
    const float k = r * r * r * row_all(dot, Sum{}, scratch) / cols;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (has(it)) {
        float hv[VEC], d[VEC], g[VEC];
        unpack_at(it, hv, d, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) d[i] = r * g[i] * d[i] - k * hv[i];
        store_bits<bf16, VEC>(dx + base + at(it), pack<bf16, VEC>(d));
      }
    }
  }
  // One partial row per row-group, zeros included (a group that got no rows still owns its row).
  float* mine = partial + static_cast<std::size_t>(blockIdx.x * blockDim.y + threadIdx.y) * cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (it * blockDim.x + threadIdx.x) * VEC;
    if (c < cols) store_partial<VEC>(mine + c, dg[it]);
  }
}

// The same backward on Hopper, with the rows brought in by the bulk copy engine. In the kernel
// above a block has bytes in flight only between its loads and its reduction; then it waits,
// reduces (two barriers) and stores with nothing on the way, and 8 such blocks per SM do not keep
// HBM busy. Here each block owns a ring of kSlots slots in shared memory, each the h row and the
// dy row of one of its rows; one thread asks the copy engine for a whole row pair with two bulk
// copies (cp.async.bulk) that complete on the slot's mbarrier, and refills the slot as soon as the
// block has read it, so kSlots - 1 rows per block are always on their way while one is computed.
// Fewer, longer-lived blocks (as many as fit: 3 per SM at 4096 columns) also mean fewer partial
// rows of dgamma for the second kernel to sum. Thread t handles vectors t, t + 256, ... of a row
// (ITERS of them), as in the register kernel, and keeps them in registers between the reduction
// and the output. On an H200 at 16384 × 4096 this measured 0.81 of the copy rate against 0.74.
constexpr int kRingThreads = 256;
constexpr int kRingCluster = 1;  // blocks per cluster pre-summing their partial rows (see the kernel)
constexpr int kRingBytes = 72 * 1024;  // shared memory for a block's ring: 3 row pairs at 6144 columns

// Slots of the ring for rows of `cols` bf16 (0: the ring does not fit).
constexpr int ring_slots(int cols) {
  const long pair = 4L * cols;  // an h row and a dy row
  return pair * 3 <= kRingBytes ? 3 : pair * 2 <= kRingBytes ? 2 : 0;
}
constexpr int ring_smem_bytes(int cols) { return ring_slots(cols) * (4 * cols + 8) + 128; }
// The most any row length of the ring asks for (3 slots of 6144 columns), set once as the kernels'
// limit: a limit set per call could be lowered by another host thread between its set and launch.
constexpr int kRingSmemMax = ring_smem_bytes(6144);
static_assert(ring_smem_bytes(8192) <= kRingSmemMax && ring_smem_bytes(6152) <= kRingSmemMax, "the largest ring");

// CLUSTER > 1: the blocks run in clusters of CLUSTER, which add their partial rows together
// through distributed shared memory before they leave, block r of a cluster summing the r-th
// slice of the columns over the cluster's staged rows: the sum kernel then reads CLUSTER times
// fewer partial rows. Partial row c is cluster c's. On an H200 at 16384 × 4096 the whole backward
// made 0.843-0.847 of the copy rate with clusters of 2 and 0.823-0.834 with 4, against 0.853-0.862
// without (row_streams 'cluster'): the module ships kRingCluster = 1.
//
// Shared memory: the ring (128-byte aligned), then one mbarrier per slot.
template <int ITERS, int CLUSTER>
__global__ __launch_bounds__(kRingThreads) void backward_ring_kernel(
    const bf16* __restrict__ h, const bf16* __restrict__ gamma, const bf16* __restrict__ dy,
    const float* __restrict__ rstd, bf16* __restrict__ dx, float* __restrict__ partial, int rows, int cols, int slots) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace hp = k2c::hopper;
  extern __shared__ unsigned char smem[];
  __shared__ RowScratch scratch;
  const std::uint32_t row_bytes = 2u * cols;
  const std::uint32_t ring = (static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)) + 127) & ~127u;
  const std::uint32_t bars = ring + slots * 2 * row_bytes;
  auto slot = [&](int k) { return ring + (k % slots) * 2 * row_bytes; };
  auto bar = [&](int k) { return bars + 8 * (k % slots); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) hp::mbarrier_init(bars + 8 * s, 1);
    hp::fence_barrier_init();
  }
  __syncthreads();
  // The k-th row of this block, b + k · blocks, into slot k % slots.
  auto issue = [&](int k) {
    const long r = blockIdx.x + static_cast<long>(k) * gridDim.x;
    if (threadIdx.x == 0 && r < rows) {
      hp::mbarrier_arrive_expect_tx(bar(k), 2 * row_bytes);
      hp::bulk_load(slot(k), h + r * cols, row_bytes, bar(k));
      hp::bulk_load(slot(k) + row_bytes, dy + r * cols, row_bytes, bar(k));
    }
  };
  for (int k = 0; k < slots; ++k) issue(k);

  // The slots through a generic pointer, so the compiler sees shared-memory loads it may schedule.
  unsigned char* ring_ptr = smem + (ring - static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)));
  const int vecs = cols / kVecBf16;
  // gamma, h and dy stay as their bf16 bits (k2c::rows::Bits) and are converted at each use. (Held
  // to 64 registers, 4 blocks of 256 would share an SM instead of 3: that measured 0.75 of the
  // copy rate at 4096 columns, against 0.81.)
  using Vec = Bits<bf16, kVecBf16>;
  Vec g[ITERS];
  float dg[ITERS][kVecBf16] = {};
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * kRingThreads + threadIdx.x;
    if (v < vecs) g[it] = load_bits<bf16, kVecBf16>(gamma + kVecBf16 * v);
  }
  for (int k = 0, row = blockIdx.x; row < rows; ++k, row += gridDim.x) {
    const float r = rstd[row];  // asked for before the wait, so it arrives while the row does
    hp::mbarrier_wait(bar(k), (k / slots) & 1);
    const Vec* hs = reinterpret_cast<const Vec*>(ring_ptr + (k % slots) * 2 * row_bytes);
    const Vec* ds = hs + vecs;
    Vec hv[ITERS], dv[ITERS];
    float dot = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * kRingThreads + threadIdx.x;
      if (v < vecs) {
        hv[it] = hs[v];
        dv[it] = ds[v];
        float hf[kVecBf16], df[kVecBf16], gf[kVecBf16];
        unpack<bf16, kVecBf16>(hv[it], hf);
        unpack<bf16, kVecBf16>(dv[it], df);
        unpack<bf16, kVecBf16>(g[it], gf);
#pragma unroll
        for (int i = 0; i < kVecBf16; ++i) dot += gf[i] * df[i] * hf[i];
      }
    }
    // The copy engine may overwrite the slot only after every thread's reads of it: each thread
    // orders its reads before the async proxy's writes, and row_all's barriers order the threads.
    hp::fence_proxy_async();
    const float total = row_all(dot, Sum{}, scratch);
    issue(k + slots);
    const float kr = r * r * r * total / cols;
    bf16* out = dx + static_cast<std::size_t>(row) * cols;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int v = it * kRingThreads + threadIdx.x;
      if (v < vecs) {
        float hf[kVecBf16], df[kVecBf16], gf[kVecBf16];
        unpack<bf16, kVecBf16>(hv[it], hf);
        unpack<bf16, kVecBf16>(dv[it], df);
        unpack<bf16, kVecBf16>(g[it], gf);
#pragma unroll
        for (int i = 0; i < kVecBf16; ++i) {
          dg[it][i] += df[i] * hf[i] * r;
          df[i] = r * gf[i] * df[i] - kr * hf[i];
        }
        store_bits<bf16, kVecBf16>(out + kVecBf16 * v, pack<bf16, kVecBf16>(df));
      }
    }
  }
  // The partial-row sum may start launching now (it waits for this grid to finish before it reads).
  hp::launch_dependents();
  // The partial row leaves through the ring, now idle (every copy issued has been waited for), so
  // that each warp store writes 512 contiguous bytes, where 16-byte stores straight from registers
  // leave each 32-byte sector half written by one instruction. The ring kernel alone measured
  // 0.899 of the copy rate this way against 0.888 (the whole backward: 0.859 against 0.860).
  __syncthreads();
  float* stage = reinterpret_cast<float*>(ring_ptr);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int v = it * kRingThreads + threadIdx.x;
    if (v < vecs) store_partial<kVecBf16>(stage + kVecBf16 * v, dg[it]);
  }
  if constexpr (CLUSTER == 1) {
    __syncthreads();
    float4* mine = reinterpret_cast<float4*>(partial + static_cast<std::size_t>(blockIdx.x) * cols);
    for (int i = threadIdx.x; i < cols / 4; i += kRingThreads) mine[i] = reinterpret_cast<const float4*>(stage)[i];
  } else {
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block of the cluster has staged its row
    const float4* rows_of[CLUSTER];
#pragma unroll
    for (int b = 0; b < CLUSTER; ++b) rows_of[b] = reinterpret_cast<const float4*>(cluster.map_shared_rank(stage, b));
    const int quads = cols / 4, per = (quads + CLUSTER - 1) / CLUSTER;
    const int first = static_cast<int>(cluster.block_rank()) * per, last = min(quads, first + per);
    float4* out = reinterpret_cast<float4*>(partial + static_cast<std::size_t>(blockIdx.x / CLUSTER) * cols);
    for (int i = first + threadIdx.x; i < last; i += kRingThreads) {
      float4 sum = rows_of[0][i];
#pragma unroll
      for (int b = 1; b < CLUSTER; ++b) {  // in rank order: the same sums on every run
        const float4 v = rows_of[b][i];
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      }
      out[i] = sum;
    }
    cluster.sync();  // no block leaves while another still reads its row
  }
#endif
}

// Long rows (too long for registers) in two kernels. The first computes each row's
// k = r³/n · Σ dy·g·h. The second splits the matrix into column slices × row-groups: a block
// owns a slice of columns and a set of rows, keeps its slice of gamma and of the dgamma partial
// sums in registers across all its rows, and writes one partial row slice at the end. The rows
// are read twice (6 + 4 bytes per element instead of 6), but every pass streams at full width.
// A block per row, adding into its dgamma partial row in global memory at every row, measured
// 0.12 of a copy at 65536 columns; this design 0.47.
constexpr int kLongGroups = 64;     // row-groups of the long-row path: its partial rows
constexpr int kSliceThreads = 256;  // a slice is kSliceThreads · kSliceVectors vectors wide
constexpr int kSliceVectors = 2;

int long_groups(int rows) { return std::min(rows, kLongGroups); }

template <int VEC>
__global__ __launch_bounds__(1024) void row_dot_kernel(const bf16* __restrict__ h, const bf16* __restrict__ gamma,
                                                       const bf16* __restrict__ dy, const float* __restrict__ rstd,
                                                       float* __restrict__ k, int rows, int cols) {
  __shared__ RowScratch scratch;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::size_t base = static_cast<std::size_t>(row) * cols;
    float dot = 0.0f;
    for (int c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
      float hv[VEC], d[VEC], g[VEC];
      load<bf16, VEC>(h + base + c, hv);
      load<bf16, VEC>(dy + base + c, d);
      load<bf16, VEC>(gamma + c, g);
#pragma unroll
      for (int i = 0; i < VEC; ++i) dot += g[i] * d[i] * hv[i];
    }
    const float r = rstd[row];
    const float total = row_all(dot, Sum{}, scratch);
    if (threadIdx.x == 0) k[row] = r * r * r * total / cols;
  }
}

template <int VEC>
__global__ __launch_bounds__(kSliceThreads) void backward_slice_kernel(
    const bf16* __restrict__ h, const bf16* __restrict__ gamma, const bf16* __restrict__ dy,
    const float* __restrict__ rstd, const float* __restrict__ k, bf16* __restrict__ dx,
    float* __restrict__ partial, int rows, int cols) {
  const int groups = gridDim.y;
  // The columns of this thread: vector v at c0 + (v · kSliceThreads + threadIdx.x) · VEC.
  const int c0 = blockIdx.x * kSliceThreads * kSliceVectors * VEC;
  auto column = [&](int v) { return c0 + (v * kSliceThreads + threadIdx.x) * VEC; };
  float g[kSliceVectors][VEC], dg[kSliceVectors][VEC] = {};
#pragma unroll
  for (int v = 0; v < kSliceVectors; ++v)
    if (column(v) < cols) load<bf16, VEC>(gamma + column(v), g[v]);
  for (int row = blockIdx.y; row < rows; row += groups) {
    const std::size_t base = static_cast<std::size_t>(row) * cols;
    const float r = rstd[row], kr = k[row];
    float hv[kSliceVectors][VEC], d[kSliceVectors][VEC];
#pragma unroll
    for (int v = 0; v < kSliceVectors; ++v)  // all loads first: more bytes in flight
      if (column(v) < cols) {
        load<bf16, VEC>(h + base + column(v), hv[v]);
        load<bf16, VEC>(dy + base + column(v), d[v]);
      }
#pragma unroll
    for (int v = 0; v < kSliceVectors; ++v)
      if (column(v) < cols) {
        float out[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          dg[v][i] += d[v][i] * hv[v][i] * r;
          out[i] = r * g[v][i] * d[v][i] - kr * hv[v][i];
        }
        store<bf16, VEC>(dx + base + column(v), out);
      }
  }
  float* mine = partial + static_cast<std::size_t>(blockIdx.y) * cols;
#pragma unroll
  for (int v = 0; v < kSliceVectors; ++v)
    if (column(v) < cols) store_partial<VEC>(mine + column(v), dg[v]);
}

// dgamma[c] = Σ_p partial[p][c]. A block covers 32 columns with 32 × 32 threads: a warp reads 32
// consecutive floats of one partial row (one 128-byte line), the 32 warps split the P rows, and the
// 32 sums of a column meet in shared memory. Few loads per thread and many blocks: this pass is
// latency-bound (a few MB), and a version with 8 warps per block took ~20 µs for 1024 partial rows
// of 4096 on an H200. The order is fixed, so the result is deterministic.
//
// In general block (x, y) of a grid of gridDim.y rows of blocks sums the partial rows y, y + Y,
// y + 2Y, ... (Y = gridDim.y) and writes out[y]. With Y = 1 that is dgamma. With Y > 1 it is the
// first of two passes (sum_partials below), and out is partial itself: block y writes its sums
// over row y, which only it reads, after all of its warps have read it. (So no __restrict__.)
constexpr int kSumWarps = 32;
// Guarded loads a thread issues together before adding them in a fixed order: one trip to memory
// for up to 512 partial rows. (A plain loop with #pragma unroll 16 ran its 12 trips at 396 rows in
// the remainder loop, one load at a time: 10 µs against 7 with unroll 4.)
constexpr int kSumBatch = 16;
__global__ __launch_bounds__(32 * kSumWarps) void sum_partials_kernel(const float* partial, float* out,
                                                                      int partials, int cols) {
  __shared__ float sums[kSumWarps][33];
  k2c::hopper::wait_for_prerequisites();  // launched early after the ring: see sum_partials
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int step = gridDim.y;
  float s = 0.0f;
  if (c < cols)
    for (int first = threadIdx.y; blockIdx.y + static_cast<long>(first) * step < partials;
         first += kSumBatch * kSumWarps) {
      float v[kSumBatch];
#pragma unroll
      for (int i = 0; i < kSumBatch; ++i) {
        const long p = blockIdx.y + static_cast<long>(first + i * kSumWarps) * step;
        v[i] = p < partials ? partial[p * cols + c] : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kSumBatch; ++i) s += v[i];
    }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
#pragma unroll
    for (int y = 1; y < kSumWarps; ++y) s += sums[y][threadIdx.x];
    out[static_cast<std::size_t>(blockIdx.y) * cols + c] = s;
  }
}

// dgamma from `partials` partial rows. Short rows give few column blocks (128 columns: 4, on 4
// SMs) and many partial rows (thousands), so there the rows are first split among up to twice as
// many blocks as the GPU has SMs, at least 512 rows each, and a second pass adds their sums. On an
// H200 the backward at 128 columns (64 Mi elements) went from 0.61 to 0.65 of a same-size copy.
// `dependent`: launched as a programmatic dependent launch of the kernel before it (see the ring).
void sum_partials(float* partial, float* dgamma, int partials, int cols, bool dependent, cudaStream_t stream) {
  int device = 0, sms = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int col_blocks = (cols + 31) / 32;
  const int split = std::clamp(partials / (kSumBatch * kSumWarps), 1, (2 * sms + col_blocks - 1) / col_blocks);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(col_blocks, split);
  config.blockDim = dim3(32, kSumWarps);
  config.stream = stream;
  cudaLaunchAttribute early{};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &early;
  config.numAttrs = dependent ? 1 : 0;
  K2C_CUDA_CHECK(cudaLaunchKernelEx(&config, sum_partials_kernel, static_cast<const float*>(partial),
                                    split > 1 ? partial : dgamma, partials, cols));
  if (split > 1)
    sum_partials_kernel<<<col_blocks, dim3(32, kSumWarps), 0, stream>>>(partial, dgamma, split, cols);
}

// As many row-groups as fit on the GPU at once (all blocks resident, each looping over rows),
// capped by partials_for().
template <class Kernel>
unsigned persistent_blocks(Kernel kernel, dim3 block, int rows, int cols) {
  int device = 0, sms = 0, per_sm = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  K2C_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block.x * block.y, 0));
  const int groups = std::min(partials_for(rows, cols), std::max(1, per_sm) * sms * static_cast<int>(block.y));
  return static_cast<unsigned>((groups + block.y - 1) / block.y);
}

// The ring: rows of 2048 to 8192 columns (every thread has a vector; the ring fits) on a GPU that
// runs this file's sm_90 code. Returns the number of partial rows it wrote, 0 if it did not run.
// The first call on a device asks that with a synchronous probe launch (bulk_copies_supported).
template <int CLUSTER = kRingCluster>
int backward_ring(const bf16* h, const bf16* gamma, const bf16* dy, const float* rstd, bf16* dx,
                  float* partial, int rows, int cols, cudaStream_t stream) {
  if (cols < 2048 || cols > 8192 || !k2c::hopper::bulk_copies_supported()) return 0;
  const int slots = ring_slots(cols), smem = ring_smem_bytes(cols);
  int blocks = 0;
  with_iters<4>(pow2_at_least((cols / kVecBf16 + kRingThreads - 1) / kRingThreads), [&](auto iters) {
    const auto kernel = backward_ring_kernel<iters(), CLUSTER>;
    K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingSmemMax));
    k2c::hopper::ClusterLaunch launch(CLUSTER, kRingThreads, smem, stream);
    const int resident = launch.resident_blocks(kernel);
    // Whole clusters; blocks past the last row write zero rows (at most partials_for() of them).
    blocks = std::min((partials_for(rows, cols) + CLUSTER - 1) / CLUSTER * CLUSTER, std::max(CLUSTER, resident));
    launch.config.gridDim = dim3(blocks);
    K2C_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, h, gamma, dy, rstd, dx, partial, rows, cols, slots));
  });
  return blocks / CLUSTER;
}

template <int VEC>
void backward_vec(const bf16* h, const bf16* gamma, const bf16* dy, const float* rstd, bf16* dx,
                  float* dgamma, float* partial, int rows, int cols, cudaStream_t stream) {
  const RowPlan plan = plan_row(cols, VEC, kBackwardMaxIters<VEC>, 2);
  int partials = VEC == kVecBf16 ? backward_ring(h, gamma, dy, rstd, dx, partial, rows, cols, stream) : 0;
  const bool ring = partials > 0;
  if (ring) {
    // rows of 2048 to 8192 columns on Hopper: the ring wrote the partial rows
  } else if (!plan.fits) {
    // k after the partial rows (backward_workspace_bytes counts one float per row there).
    float* k = partial + static_cast<std::size_t>(partials_for(rows, cols)) * cols;
    row_dot_kernel<VEC><<<std::min(rows, 4096), 1024, 0, stream>>>(h, gamma, dy, rstd, k, rows, cols);
    const dim3 grid((cols + kSliceThreads * kSliceVectors * VEC - 1) / (kSliceThreads * kSliceVectors * VEC),
                    long_groups(rows));
    backward_slice_kernel<VEC><<<grid, kSliceThreads, 0, stream>>>(h, gamma, dy, rstd, k, dx, partial, rows, cols);
    partials = long_groups(rows);
  } else {
    with_iters<kBackwardMaxIters<VEC>>(plan.iters, [&](auto iters) {
      const auto kernel = backward_kernel<VEC, iters()>;
      const unsigned blocks = persistent_blocks(kernel, plan.block(), rows, cols);
      kernel<<<blocks, plan.block(), 0, stream>>>(h, gamma, dy, rstd, dx, partial, rows, cols);
      partials = static_cast<int>(blocks * plan.block().y);
    });
  }
  K2C_CUDA_CHECK_LAUNCH();
  // After the ring (sm_90) the sum is a programmatic dependent launch: its blocks are launched
  // while the ring's last blocks finish, and wait for the whole ring before reading. On an H200 at
  // 16384 × 4096 the backward measured 0.856-0.861 of the copy rate this way, 0.849-0.850 with a plain
  // launch of the sum (same process).
  sum_partials(partial, dgamma, partials, cols, ring, stream);
}

bool vectorizable(int cols, std::initializer_list<const void*> pointers) {
  if (cols % kVecBf16 != 0) return false;
  for (const void* p : pointers)
    if (!aligned16(p)) return false;
  return true;
}

}  // namespace

void forward(const bf16* x, const bf16* residual, const bf16* gamma, bf16* y, bf16* residual_out,
             float* rstd, int rows, int cols, float eps, cudaStream_t stream) {
  if (!check_forward_args(x, residual, gamma, y, residual_out, rstd, rows, cols, eps)) return;
  if (vectorizable(cols, {x, residual, gamma, y, residual_out}))
    forward_vec<kVecBf16>(x, residual, gamma, y, residual_out, rstd, rows, cols, eps, stream);
  else
    forward_vec<1>(x, residual, gamma, y, residual_out, rstd, rows, cols, eps, stream);
  K2C_CUDA_CHECK_LAUNCH();
}

std::size_t backward_workspace_bytes(int rows, int cols) {
  K2C_CHECK(rows >= 0 && cols >= 0, "rmsnorm backward_workspace_bytes: negative size " << rows << " x " << cols);
  // The partial rows of dgamma, then one float per row for the long-row path's k.
  return (static_cast<std::size_t>(partials_for(rows, cols)) * cols + rows) * sizeof(float);
}

void backward(const bf16* h, const bf16* gamma, const bf16* dy, const float* rstd, bf16* dx,
              float* dgamma, void* workspace, int rows, int cols, cudaStream_t stream) {
  K2C_CHECK(rows >= 0 && cols >= 0, "rmsnorm backward: negative size " << rows << " x " << cols);
  if (cols == 0) return;
  K2C_CHECK(dgamma != nullptr, "rmsnorm backward: missing pointer dgamma");
  if (rows == 0) {  // a sum over no rows
    K2C_CUDA_CHECK(cudaMemsetAsync(dgamma, 0, cols * sizeof(float), stream));
    return;
  }
  K2C_CHECK(h && gamma && dy && rstd && dx && workspace, "rmsnorm backward: missing pointer");
  K2C_CHECK(aligned16(workspace), "rmsnorm backward: workspace not 16-byte aligned");
  K2C_CHECK(rows <= kMaxExtent && cols <= kMaxExtent, "rmsnorm backward: at most " << kMaxExtent << " rows and columns");
  float* partial = static_cast<float*>(workspace);
  if (vectorizable(cols, {h, gamma, dy, dx}))
    backward_vec<kVecBf16>(h, gamma, dy, rstd, dx, dgamma, partial, rows, cols, stream);
  else
    backward_vec<1>(h, gamma, dy, rstd, dx, dgamma, partial, rows, cols, stream);
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace k2c::rmsnorm
