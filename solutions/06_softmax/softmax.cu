// solutions/06_softmax/softmax.cu — reference solution of module 06 (contract: softmax.h).
//
// Softmax is memory-bound: per element it reads one value and writes one, and does a handful of
// FLOPs (a subtract, an exp, a multiply). At 16384 × 4096 bf16 that is 128 MiB in and 128 MiB
// out, about 63 µs at the H200's ~4.25 TB/s copy rate, while the ~200 MFLOP take the cores
// a few µs. So the only question is how many bytes cross HBM and how well the kernel keeps the
// memory system busy; the three versions are three answers.
//
//   three_pass   max, sum, normalise: x is read three times. A 4096-wide row is 8 KiB (bf16), so
//                the re-reads mostly hit L2, but every pass still pays its loads and its
//                block-wide reduction.
//   online       running max and running sum in one pass (rescale the sum whenever the max
//                grows), then a second pass to write: two reads, one write.
//   fast         the row read once into registers, reduced twice (max, then sum) with warp
//                shuffles, written once: exactly the bytes of a copy. 16-byte vector loads
//                (8 bf16 or 4 fp32 per instruction) whenever the row length allows it, a warp
//                or part of one per short row (no shared memory, no barriers) and a block per
//                row for long ones. Rows too long for registers fall back to the online kernel, whose
//                second read of a row is then (mostly) an L2 hit.
//
// Everything is computed in fp32. exp(x - m) uses __expf (ex2.approx after a multiply by log2 e):
// its relative error, ~2^-21 plus |x - m|·2^-24 from the multiply, is far below bf16's 2^-8 and
// well inside the fp32 test tolerance. Rows are independent, so no reduction ever crosses rows.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/device/rows.cuh"
#include "softmax.h"

namespace k2c::softmax {
namespace {

using namespace k2c::rows;

constexpr int kRowThreads = 256;  // threads per row in the block-per-row kernels

// ------------------------------------------------------------------------- three passes ---
// One block per row. Pass 1: each thread's maximum over its strided elements, then the block's.
// Pass 2: the same for the sum of exp(x - m). Pass 3: normalise.
template <class T>
__global__ void three_pass_kernel(const T* __restrict__ x, T* __restrict__ y, int cols) {
  __shared__ RowScratch scratch;
  const T* xr = x + static_cast<std::size_t>(blockIdx.x) * cols;
  T* yr = y + static_cast<std::size_t>(blockIdx.x) * cols;

  float m = Max::identity;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, to_float(xr[c]));
  m = row_all(m, Max{}, scratch);

  float s = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += __expf(to_float(xr[c]) - m);
  s = row_all(s, Sum{}, scratch);

  const float inv = 1.0f / s;
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    yr[c] = from_float<T>(__expf(to_float(xr[c]) - m) * inv);
}

// ------------------------------------------------------------------------------- online ---
// The online rule: a thread that has seen values with maximum m and sum s = Σ exp(v - m) and
// now sees v' > m rescales s by exp(m - v') before adding exp(0) = 1; otherwise it adds
// exp(v' - m). Either way one exp per element and one pass over x. Two threads' (m, s) pairs
// combine the same way; here the block first agrees on the row maximum M (one reduction), then
// every thread rescales its own sum to M (s · exp(m - M)) and the sums are added (a second).
// A thread that saw no element keeps m = -inf, s = 0 and contributes 0 · exp(-inf) = 0.
// VEC > 1 is the fast version's fallback for rows too long to keep in registers.
template <class T, int VEC>
__global__ __launch_bounds__(1024) void online_kernel(const T* __restrict__ x, T* __restrict__ y, int cols) {
  __shared__ RowScratch scratch;
  const T* xr = x + static_cast<std::size_t>(blockIdx.x) * cols;
  T* yr = y + static_cast<std::size_t>(blockIdx.x) * cols;

  float m = Max::identity, s = 0.0f;
  for (int c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    float v[VEC];
    load<T, VEC>(xr + c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (v[i] > m) {
        s = s * __expf(m - v[i]) + 1.0f;
        m = v[i];
      } else {
        s += __expf(v[i] - m);
      }
    }
  }
  const float row_max = row_all(m, Max{}, scratch);
  s = row_all(s * __expf(m - row_max), Sum{}, scratch);

  const float inv = 1.0f / s;
  for (int c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    float v[VEC];
    load<T, VEC>(xr + c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = __expf(v[i] - row_max) * inv;
    store<T, VEC>(yr + c, v);
  }
}

// ----------------------------------------------------------------------------- registers ---
// blockDim.x threads per row (1 to 1024), blockDim.y rows per block. Thread t of a row holds the
// vectors t, t + blockDim.x, ... (ITERS of them): consecutive threads touch consecutive 16-byte
// pieces, so a warp-wide load uses every byte of the sectors it touches. The row is read once,
// reduced twice without touching memory again, and written once.
//
// The row stays as the bits it was loaded as (k2c::rows::Bits) and is converted at each use, so
// exp is computed twice, once for the sum and once for the output. That costs a few FLOPs per
// element, which are free here, and saves half the registers of a bf16 row; with all of a thread's
// loads issued before any arithmetic, 128 threads × 4 vectors per 4096-wide row kept the most
// bytes in flight (0.91 of the copy rate on an H200, against 0.85 for 256 threads × 2 vectors
// held as floats).
template <class T, int VEC, int ITERS>
__global__ __launch_bounds__(1024) void registers_kernel(const T* __restrict__ x, T* __restrict__ y, int rows, int cols) {
  __shared__ RowScratch scratch;
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  // A block may overhang the last row; its idle rows still take part in the reductions (which
  // may contain barriers) but load nothing and store nothing.
  const bool live = row < rows;
  const T* xr = x + static_cast<std::size_t>(row) * cols;
  T* yr = y + static_cast<std::size_t>(row) * cols;
  auto has = [&](int it) { return live && (it * blockDim.x + threadIdx.x) * VEC < cols; };
  auto at = [&](int it) { return (it * blockDim.x + threadIdx.x) * VEC; };

  Bits<T, VEC> bits[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
    if (has(it)) bits[it] = load_bits<T, VEC>(xr + at(it));
  // f(it, v) for each vector this thread holds, v its VEC elements as floats.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (has(it)) {
        float v[VEC];
        unpack<T, VEC>(bits[it], v);
        f(it, v);
      }
    }
  };

  float m = Max::identity;
  each([&](int, float (&v)[VEC]) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) m = fmaxf(m, v[i]);
  });
  m = row_all(m, Max{}, scratch);

  float s = 0.0f;
  each([&](int, float (&v)[VEC]) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) s += __expf(v[i] - m);
  });
  const float inv = 1.0f / row_all(s, Sum{}, scratch);

  each([&](int it, float (&v)[VEC]) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = __expf(v[i] - m) * inv;
    store_bits<T, VEC>(yr + at(it), pack<T, VEC>(v));
  });
}

// Four vectors a thread where the row allows (see above); rows longer than 1024 threads × the
// vectors kMaxBitsIters allows (65536 bf16 or 32768 fp32 in 16-byte vectors, 16384 elements
// one at a time) take the online kernel, with 16-byte loads where it can.
constexpr int kTargetIters = 4;

template <class T, int VEC>
void fast(const T* x, T* y, int rows, int cols, cudaStream_t stream) {
  constexpr int kMaxIters = kMaxBitsIters<T, VEC>;
  const RowPlan plan = plan_row(cols, VEC, kMaxIters, kTargetIters, /*min_threads=*/1);
  if (!plan.fits) {
    online_kernel<T, VEC><<<rows, 1024, 0, stream>>>(x, y, cols);
    return;
  }
  with_iters<kMaxIters>(plan.iters, [&](auto iters) {
    registers_kernel<T, VEC, iters()><<<plan.blocks(rows), plan.block(), 0, stream>>>(x, y, rows, cols);
  });
}

template <class T>
void run(Version v, const T* x, T* y, int rows, int cols, cudaStream_t stream) {
  if (!check_args(x, y, rows, cols)) return;
  switch (v) {
    case Version::three_pass:
      three_pass_kernel<T><<<rows, kRowThreads, 0, stream>>>(x, y, cols);
      break;
    case Version::online:
      online_kernel<T, 1><<<rows, kRowThreads, 0, stream>>>(x, y, cols);
      break;
    case Version::fast: {
      // 16-byte accesses need every row to start on a 16-byte boundary: cols a multiple of the
      // vector width and both base pointers aligned. Anything else takes scalar accesses.
      if (cols % kVec<T> == 0 && aligned16(x) && aligned16(y))
        fast<T, kVec<T>>(x, y, rows, cols, stream);
      else
        fast<T, 1>(x, y, rows, cols, stream);
      break;
    }
  }
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace k2c::softmax

// The contract's two overloads, from run<T>: given to students as they are.
#include "dispatch.h"
