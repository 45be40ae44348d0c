// course_kernels.cu — the adapters of course_kernels.h: the model's tensors into a module's bf16
// contract and back, on the GPU backend's stream. The model's activations are fp32 or bf16
// (k2c/model/ops.h); a bf16 activation already in the contract's layout reaches the module with no
// pass at all, and a module's bf16 output is written straight into a bf16 activation.
#include "course_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "flash_attention.h"
#include "k2c/core/check.h"
#include "k2c/core/todo.h"
#include "k2c/device/rows.cuh"
#include "k2c/model/cuda_ops.h"
#include "moe.h"
#include "rmsnorm.h"
#include "rope.h"
#include "tensor_core_matmul.h"

namespace k2c::capstone {
namespace {

using bf16 = __nv_bfloat16;
using model::AttentionShape;
using model::Tensor;

cudaStream_t stream() { return static_cast<cudaStream_t>(model::cuda_ops_stream()); }

// ---- conversion kernels: memory-bound passes, grid-stride loops.
//
// A step makes hundreds of these passes, so each has two forms. The plain form takes one element
// per thread at any address, over 64-bit indices. The x8 form takes 8 elements per thread (two
// 16-byte fp32 accesses, one 16-byte bf16 access) where the pointers start on 16 bytes, and the
// layout changes for 09 do their index arithmetic in 32 bits: per element, the plain form's 64-bit
// divisions cost more than the memory traffic they serve. Both round the same way (to nearest even),
// so which one ran never changes a result.

constexpr int kThreads = 256;
unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 8192 ? (b > 0 ? b : 1) : 8192);
}
#define FOR_EACH(i, n) \
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < (n); i += std::int64_t{gridDim.x} * blockDim.x)

using k2c::rows::aligned16;  // a null pointer counts as aligned: it is never read
// The x8 layout kernels count vectors in int, with room for a grid's stride past the end.
constexpr std::int64_t kMaxVectors = INT_MAX / 2;

struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};
__device__ __forceinline__ Bf16x8 bf16x8_of(const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  return {{__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w), __floats2bfloat162_rn(b.x, b.y),
           __floats2bfloat162_rn(b.z, b.w)}};
}
__device__ __forceinline__ Bf16x8 bf16x8_of(const bf16* p) { return *reinterpret_cast<const Bf16x8*>(p); }
// One element of the model's side (fp32 or bf16) to fp32 and back (rounded to nearest even).
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(bf16* p, float v) { *p = __float2bfloat16(v); }
// p[0..8) = v, plus plus[0..8) where plus is given (p itself to add into it).
__device__ __forceinline__ void store_f32x8(float* p, Bf16x8 v, const float* plus) {
  float4* q = reinterpret_cast<float4*>(p);
  for (int half = 0; half < 2; ++half) {
    const float2 lo = __bfloat1622float2(v.h[2 * half]), hi = __bfloat1622float2(v.h[2 * half + 1]);
    float4 r = make_float4(lo.x, lo.y, hi.x, hi.y);
    if (plus) {
      const float4 o = reinterpret_cast<const float4*>(plus)[half];
      r = make_float4(o.x + r.x, o.y + r.y, o.z + r.z, o.w + r.w);
    }
    q[half] = r;
  }
}

__global__ void to_bf16_plain(const float* src, bf16* dst, std::int64_t n) { FOR_EACH(i, n) dst[i] = __float2bfloat16(src[i]); }
__global__ void to_bf16_x8(const float* src, bf16* dst, std::int64_t n) {
  FOR_EACH(v, n / 8) reinterpret_cast<Bf16x8*>(dst)[v] = bf16x8_of(src + 8 * v);
  FOR_EACH(i, n % 8) dst[n / 8 * 8 + i] = __float2bfloat16(src[n / 8 * 8 + i]);
}
// dst = float(src).
__global__ void from_bf16_plain(const bf16* src, float* dst, std::int64_t n) {
  FOR_EACH(i, n) dst[i] = __bfloat162float(src[i]);
}
__global__ void from_bf16_x8(const bf16* src, float* dst, std::int64_t n) {
  FOR_EACH(v, n / 8) store_f32x8(dst + 8 * v, reinterpret_cast<const Bf16x8*>(src)[v], nullptr);
  FOR_EACH(i, n % 8) dst[n / 8 * 8 + i] = __bfloat162float(src[n / 8 * 8 + i]);
}
__global__ void add_into_plain(const float* src, float* dst, std::int64_t n) { FOR_EACH(i, n) dst[i] += src[i]; }
__global__ void add_into_x4(const float* src, float* dst, std::int64_t n) {
  FOR_EACH(v, n / 4) {
    const float4 a = reinterpret_cast<const float4*>(src)[v], b = reinterpret_cast<float4*>(dst)[v];
    reinterpret_cast<float4*>(dst)[v] = make_float4(b.x + a.x, b.y + a.y, b.z + a.z, b.w + a.w);
  }
  FOR_EACH(i, n % 4) dst[n / 4 * 4 + i] += src[n / 4 * 4 + i];
}
// dst[b][h][t][:] = bf16(src[b][t][h][:]): the model's [batch·tokens, heads·d] to 09's heads-first
// layout.
template <class M>
__global__ void to_heads_first_plain(const M* src, bf16* dst, std::int64_t n, int T, int H, int d) {
  FOR_EACH(i, n) {
    const std::int64_t j = i % d, h = (i / d) % H, t = (i / (std::int64_t{d} * H)) % T, b = i / (std::int64_t{d} * H * T);
    dst[((b * H + h) * T + t) * d + j] = __float2bfloat16(to_f(src[i]));
  }
}
// The same, vector v being elements [8v, 8v + 8) of src (d a multiple of 8).
template <class M>
__global__ void to_heads_first_x8(const M* src, bf16* dst, int vectors, int T, int H, int d) {
  const int per_head = d / 8, per_row = H * per_head;
  for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < vectors; v += gridDim.x * blockDim.x) {
    const int row = v / per_row, c = v - row * per_row, h = c / per_head, b = row / T, t = row - b * T;
    reinterpret_cast<Bf16x8*>(dst)[((std::int64_t{b} * H + h) * T + t) * per_head + (c - h * per_head)] =
        bf16x8_of(src + 8 * std::int64_t{v});
  }
}
// The way back: dst[b][t][h][:] (=, or += when add) src[b][h][t][:].
template <class M>
__global__ void from_heads_first_plain(const bf16* src, M* dst, std::int64_t n, int T, int H, int d, bool add) {
  FOR_EACH(i, n) {
    const std::int64_t j = i % d, h = (i / d) % H, t = (i / (std::int64_t{d} * H)) % T, b = i / (std::int64_t{d} * H * T);
    const float v = __bfloat162float(src[((b * H + h) * T + t) * d + j]);
    put(dst + i, add ? to_f(dst[i]) + v : v);
  }
}
// p[0..8) = v (+= v when add), the sum rounded once where p is bf16.
__device__ __forceinline__ void store8(float* p, Bf16x8 v, bool add) { store_f32x8(p, v, add ? p : nullptr); }
__device__ __forceinline__ void store8(bf16* p, Bf16x8 v, bool add) {
  if (add) {
    const Bf16x8 old = *reinterpret_cast<const Bf16x8*>(p);
    for (int q = 0; q < 4; ++q) {
      const float2 a = __bfloat1622float2(old.h[q]), b = __bfloat1622float2(v.h[q]);
      v.h[q] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
    }
  }
  *reinterpret_cast<Bf16x8*>(p) = v;
}
template <class M>
__global__ void from_heads_first_x8(const bf16* src, M* dst, int vectors, int T, int H, int d, bool add) {
  const int per_head = d / 8, per_row = H * per_head;
  for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < vectors; v += gridDim.x * blockDim.x) {
    const int row = v / per_row, c = v - row * per_row, h = c / per_head, b = row / T, t = row - b * T;
    store8(dst + 8 * std::int64_t{v},
           reinterpret_cast<const Bf16x8*>(src)[((std::int64_t{b} * H + h) * T + t) * per_head + (c - h * per_head)], add);
  }
}
// 05's operands with K cut into slices of `ks` (a multiple of 64; the last slice shorter, and
// ks = K for one slice): slice after slice, each a K-major matrix of every row and its own length,
// so that each slice is a GEMM's operand of its own (see slice_length below).
//
// dst = bf16(src) for an operand given K-major (src rows × K). A block per row at a time, its
// threads along K, so a slice's index is one 32-bit division per element.
template <class M>
__global__ void to_bf16_sliced(const M* src, bf16* dst, int rows, int K, int ks) {
  for (int r = blockIdx.x; r < rows; r += gridDim.x)
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      const int s = k / ks, length = min(ks, K - s * ks);
      dst[std::int64_t{s} * rows * ks + std::int64_t{r} * length + (k - s * ks)] =
          __float2bfloat16(to_f(src[std::int64_t{r} * K + k]));
    }
}
// dst = bf16(srcᵀ) in slices, src rows × cols: 05's K-major operand (cols rows, K = rows) from a
// K-minor one; and where `plain` is given, bf16(src) as it stands too (a Linear layer's dy is both:
// transposed for the weight gradient, as it is for the input gradient), read once for both.
// A 64 × 64 tile through shared memory keeps both the reads and the writes coalesced; a tile never
// straddles two slices (ks is a multiple of 64, or all of K), so its slice is found once. Where
// `vec` (cols % 4 == 0, src on 16 bytes) a whole tile whose slice length is a multiple of 8 moves
// 4 elements a load and 8 bf16 a store; other tiles go one element at a time. A bf16 src is its
// own untransposed copy: `plain` is for fp32 src only.
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const bf16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
constexpr int kTransposeTile = 64, kTransposeThreads = 256;
template <class M>
__global__ void __launch_bounds__(kTransposeThreads)
    to_bf16_transposed(const M* src, bf16* dst, bf16* plain, int rows, int cols, int ks, bool vec) {
  constexpr int kT = kTransposeTile;
  __shared__ float tile[kT][kT + 1];
  const int c0 = blockIdx.x * kT, r0 = blockIdx.y * kT;
  const int s = r0 / ks, k0 = s * ks, length = min(ks, rows - k0);
  bf16* slice = dst + std::int64_t{k0} * cols;  // slices before this one: cols × ks each
  if (vec && r0 + kT <= rows && c0 + kT <= cols && length % 8 == 0) {
    for (int i = threadIdx.x; i < kT * kT / 4; i += kTransposeThreads) {
      const int r = i / (kT / 4), c = i % (kT / 4) * 4;
      const std::int64_t at = std::int64_t{r0 + r} * cols + c0 + c;
      const float4 v = load4(src + at);
      tile[r][c] = v.x, tile[r][c + 1] = v.y, tile[r][c + 2] = v.z, tile[r][c + 3] = v.w;
      if (plain) {
        const __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
        *reinterpret_cast<uint2*>(plain + at) = *reinterpret_cast<const uint2*>(pair);
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kT * kT / 8; i += kTransposeThreads) {
      const int c = i / (kT / 8), r = i % (kT / 8) * 8;
      Bf16x8 out;
      for (int q = 0; q < 4; ++q) out.h[q] = __floats2bfloat162_rn(tile[r + 2 * q][c], tile[r + 2 * q + 1][c]);
      *reinterpret_cast<Bf16x8*>(slice + std::int64_t{c0 + c} * length + (r0 - k0) + r) = out;
    }
    return;
  }
  for (int i = threadIdx.x; i < kT * kT; i += kTransposeThreads) {
    const int r = r0 + i / kT, c = c0 + i % kT;
    if (r < rows && c < cols) {
      const std::int64_t at = std::int64_t{r} * cols + c;
      tile[i / kT][i % kT] = to_f(src[at]);
      if (plain) plain[at] = __float2bfloat16(to_f(src[at]));
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kT * kT; i += kTransposeThreads) {
    const int c = c0 + i / kT, r = r0 + i % kT;
    if (r < rows && c < cols) slice[std::int64_t{c} * length + (r - k0)] = __float2bfloat16(tile[i % kT][i / kT]);
  }
}
// c = alpha·(the sum of `parts` products of n elements, `stride` apart) + beta·c, summed in fp32,
// with beta = 0 ignoring c's old contents (NaN included), as matmul's contract says.
__device__ __forceinline__ float epilogue_of(float sum, float alpha, float beta, float old) {
  const float v = alpha * sum;
  return beta == 0.0f ? v : v + beta * old;
}
// c is the model's output, fp32 or bf16 (rounded once, from the fp32 sum).
template <class T, class M>
__global__ void gemm_epilogue_plain(const T* src, int parts, std::int64_t stride, M* c, std::int64_t n, float alpha,
                                    float beta) {
  FOR_EACH(i, n) {
    float sum = 0.0f;
    for (int p = 0; p < parts; ++p) sum += static_cast<float>(src[p * stride + i]);
    put(c + i, epilogue_of(sum, alpha, beta, beta == 0.0f ? 0.0f : to_f(c[i])));
  }
}
// The same on bf16 products 8 elements at a time (stride a multiple of 8).
__device__ __forceinline__ void load8(const float* p, float* v) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16* p, float* v) {
  const Bf16x8 x = *reinterpret_cast<const Bf16x8*>(p);
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(x.h[q]);
    v[2 * q] = f.x, v[2 * q + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(float* p, const float* v) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(bf16* p, const float* v) {
  Bf16x8 x;
  for (int q = 0; q < 4; ++q) x.h[q] = __floats2bfloat162_rn(v[2 * q], v[2 * q + 1]);
  *reinterpret_cast<Bf16x8*>(p) = x;
}
// out = a + b elementwise, each fp32 or bf16, rounded once where out holds bf16 (a module's bf16
// result plus the model's residual gradient); the x8 form wants all three on 16 bytes.
template <class A, class B, class M>
__global__ void sum_plain(const A* a, const B* b, M* out, std::int64_t n) {
  FOR_EACH(i, n) put(out + i, to_f(a[i]) + to_f(b[i]));
}
template <class A, class B, class M>
__global__ void sum_x8(const A* a, const B* b, M* out, std::int64_t n) {
  FOR_EACH(v, n / 8) {
    float x[8], y[8];
    load8(a + 8 * v, x);
    load8(b + 8 * v, y);
    for (int q = 0; q < 8; ++q) x[q] += y[q];
    store8(out + 8 * v, x);
  }
  FOR_EACH(i, n % 8) {
    const std::int64_t e = n / 8 * 8 + i;
    put(out + e, to_f(a[e]) + to_f(b[e]));
  }
}
template <class M>
__global__ void gemm_epilogue_x8(const bf16* src, int parts, std::int64_t stride, M* c, std::int64_t n, float alpha,
                                 float beta) {
  FOR_EACH(v, n / 8) {
    float sum[8] = {};
    for (int p = 0; p < parts; ++p) {
      const Bf16x8 x = reinterpret_cast<const Bf16x8*>(src + p * stride)[v];
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(x.h[q]);
        sum[2 * q] += f.x, sum[2 * q + 1] += f.y;
      }
    }
    float old[8] = {};
    if (beta != 0.0f) load8(c + 8 * v, old);
    for (int q = 0; q < 8; ++q) sum[q] = epilogue_of(sum[q], alpha, beta, old[q]);
    store8(c + 8 * v, sum);
  }
  FOR_EACH(i, n % 8) {
    const std::int64_t e = n / 8 * 8 + i;
    float sum = 0.0f;
    for (int p = 0; p < parts; ++p) sum += __bfloat162float(src[p * stride + e]);
    put(c + e, epilogue_of(sum, alpha, beta, beta == 0.0f ? 0.0f : to_f(c[e])));
  }
}
// 09 marks a query that sees no key with lse = +inf, the model with −inf: the sign flips both ways.
__global__ void flip_infinite(const float* src, float* dst, std::int64_t n) {
  FOR_EACH(i, n) dst[i] = isinf(src[i]) ? -src[i] : src[i];
}
// 10's group offsets, handed to the device as a kernel argument: no host buffer to keep alive and
// no wait for the stream, as a copy from host memory would need.
struct Offsets {
  int v[k2c::moe::kMaxExperts + 1];
};
static_assert(CUDART_VERSION >= 12010, "10's offsets pass as a kernel argument of 4 KiB: CUDA 12.1 or later");
__global__ void store_offsets(Offsets o, int* dst, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = o.v[i];
}
// RoPE's table for the positions the model gives (not assumed to be 0, 1, 2, ...): row t holds
// (cos, sin) of positions[t]·theta_k, so 08's table path at offset 0 rotates token t by its own
// position. The angle in double, as 08's build_cache makes it.
__global__ void rope_rows(float2* table, const int* positions, int T, int half, double base) {
  FOR_EACH(i, std::int64_t{T} * half) {
    const int t = static_cast<int>(i / half), k = static_cast<int>(i % half);
    const double angle = positions[t] * pow(base, -2.0 * k / (2.0 * half));
    table[i] = make_float2(static_cast<float>(cos(angle)), static_cast<float>(sin(angle)));
  }
}

// Device buffers by name, grown on demand (the shapes of a step repeat, so they settle at once).
class Scratch {
 public:
  ~Scratch() {
    for (auto& [name, b] : buffers_) cudaFree(b.p);
  }
  template <class T>
  T* get(const std::string& name, std::int64_t count) {
    Buffer& b = buffers_[name];
    const std::size_t bytes = static_cast<std::size_t>(count > 0 ? count : 1) * sizeof(T);
    if (b.bytes < bytes) {
      K2C_CUDA_CHECK(cudaStreamSynchronize(stream()));  // the old buffer may still be read
      cudaFree(b.p);
      b.p = nullptr, b.bytes = 0;
      K2C_CUDA_CHECK(cudaMalloc(&b.p, bytes));
      b.bytes = bytes;
    }
    return static_cast<T*>(b.p);
  }

 private:
  struct Buffer {
    void* p = nullptr;
    std::size_t bytes = 0;
  };
  std::map<std::string, Buffer> buffers_;
};

// host.v[0..n) on the device, in the scratch buffer `name`: 10's group offsets, written by a kernel
// that takes them as its argument.
int* device_offsets(Scratch& s, const std::string& name, const Offsets& host, int n) {
  int* d = s.get<int>(name, n);
  store_offsets<<<1, kThreads, 0, stream()>>>(host, d, n);
  K2C_CUDA_CHECK_LAUNCH();
  return d;
}

// Side streams for the slices of a split product, and the events that fork them from the
// backend's stream and join them back into it (so everything after the product, the Scratch's
// reuse of its buffers included, waits for every slice).
class Fork {
 public:
  static constexpr int kMax = 16;
  Fork() {
    for (int i = 0; i < kMax; ++i) {
      K2C_CUDA_CHECK(cudaStreamCreateWithFlags(&side_[i], cudaStreamNonBlocking));
      K2C_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    }
    K2C_CUDA_CHECK(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming));
  }
  ~Fork() {
    for (int i = 0; i < kMax; ++i) cudaStreamDestroy(side_[i]), cudaEventDestroy(done_[i]);
    cudaEventDestroy(start_);
  }
  Fork(const Fork&) = delete;
  Fork& operator=(const Fork&) = delete;
  // Slice 0 runs on the backend's stream, slice i > 0 on a side stream that starts after
  // everything issued so far.
  void begin(int n) {
    K2C_CUDA_CHECK(cudaEventRecord(start_, stream()));
    for (int i = 1; i < n; ++i) K2C_CUDA_CHECK(cudaStreamWaitEvent(side_[i], start_));
  }
  cudaStream_t at(int i) const { return i == 0 ? stream() : side_[i]; }
  // Unchecked, since it also runs while an exception unwinds: these calls fail only when the
  // device already has, and the next checked call reports that.
  void end(int n) noexcept {
    for (int i = 1; i < n; ++i) {
      cudaEventRecord(done_[i], side_[i]);
      cudaStreamWaitEvent(stream(), done_[i]);
    }
  }

 private:
  cudaStream_t side_[kMax]{};
  cudaEvent_t done_[kMax]{}, start_{};
};

// Split-K for products with too few output tiles to fill the GPU. A weight gradient dW = dyᵀ·x of
// a 768 × 768 weight sums over 16384 tokens: 18 of 05's 128 × 256 tiles for 132 SMs, each with a
// long K, so 114 SMs idle. Cut K into slices, run each slice as a GEMM of its own on a stream of
// its own, and add their bf16 outputs in fp32 in the epilogue: as many slices as fit in one wave
// of tiles, none shorter than 512, each a multiple of 64 long (so every slice keeps K % 8 == 0).
// Returns the slice length (K itself for one slice).
int slice_length(std::int64_t M, std::int64_t N, std::int64_t K, int sms) {
  const std::int64_t tiles = ((M + 127) / 128) * ((N + 255) / 256);
  const std::int64_t slices = std::min<std::int64_t>({sms / tiles, K / 512, Fork::kMax});
  if (slices < 2) return static_cast<int>(K);
  return static_cast<int>(((K + slices - 1) / slices + 63) / 64 * 64);
}

template <class Kernel, class... Args>
void launch(Kernel k, std::int64_t n, Args... args) {
  if (n <= 0) return;
  k<<<blocks_for(n), kThreads, 0, stream()>>>(args...);
  K2C_CUDA_CHECK_LAUNCH();
}

// The passes above, each in its x8 form where the pointers allow. n counts elements.
void convert(const float* src, bf16* dst, std::int64_t n) {
  if (aligned16(src) && aligned16(dst)) launch(to_bf16_x8, (n + 7) / 8, src, dst, n);
  else launch(to_bf16_plain, n, src, dst, n);
}
void convert(const bf16* src, float* dst, std::int64_t n) {
  if (aligned16(src) && aligned16(dst)) launch(from_bf16_x8, (n + 7) / 8, src, dst, n);
  else launch(from_bf16_plain, n, src, dst, n);
}
void add_into(const float* src, float* dst, std::int64_t n) {  // dst += src
  if (aligned16(src) && aligned16(dst)) launch(add_into_x4, (n + 3) / 4, src, dst, n);
  else launch(add_into_plain, n, src, dst, n);
}
// The model's tensors as the element type they hold.
bool is_bf16(const Tensor& t) { return t.dtype() == model::DType::bf16; }
bf16* bf16_data(const Tensor& t) { return static_cast<bf16*>(t.raw()); }
// Runs f with t's elements as float* or bf16*, whichever t holds.
template <class F>
void with_data(const Tensor& t, F&& f) {
  if (is_bf16(t)) f(bf16_data(t));
  else f(t.f32());
}
// c (the model's tensor, fp32 or bf16) = alpha·Σ parts + beta·c over bf16 products `stride` apart.
void gemm_epilogue(const bf16* src, int parts, std::int64_t stride, const Tensor& c, std::int64_t n, float alpha,
                   float beta) {
  with_data(c, [&](auto* out) {
    using M = std::remove_pointer_t<decltype(out)>;
    if (aligned16(src) && (parts == 1 || stride % 8 == 0) && aligned16(out))
      launch(gemm_epilogue_x8<M>, (n + 7) / 8, src, parts, stride, out, n, alpha, beta);
    else
      launch(gemm_epilogue_plain<bf16, M>, n, src, parts, stride, out, n, alpha, beta);
  });
}
bool heads_x8(const void* a, const void* b, std::int64_t n, int d) {
  return d % 8 == 0 && aligned16(a) && aligned16(b) && n / 8 <= kMaxVectors;
}
// t in bf16: t's own elements where it holds bf16 from a 16-byte start (the contracts' fast
// paths want one), else bf16(t), or a copy, in the scratch buffer `name`.
const bf16* to_bf16(Scratch& s, const std::string& name, const Tensor& t) {
  if (is_bf16(t) && aligned16(t.raw())) return bf16_data(t);
  bf16* p = s.get<bf16>(name, t.numel());
  if (is_bf16(t)) K2C_CUDA_CHECK(cudaMemcpyAsync(p, t.raw(), t.bytes(), cudaMemcpyDeviceToDevice, stream()));
  else convert(t.f32(), p, t.numel());
  return p;
}
// Where a module writes a bf16 result for t: t itself where it holds bf16 on 16 bytes (the
// contracts' fast paths want that), else the scratch buffer `name`; land() then moves a scratch
// result into t.
bf16* out_bf16(Scratch& s, const std::string& name, const Tensor& t) {
  return is_bf16(t) && aligned16(t.raw()) ? bf16_data(t) : s.get<bf16>(name, t.numel());
}
// The same for a tensor the module reads and writes in place (RoPE): t's values already there.
bf16* in_place_bf16(Scratch& s, const std::string& name, const Tensor& t) {
  bf16* p = out_bf16(s, name, t);
  if (p == t.raw()) return p;
  if (is_bf16(t)) K2C_CUDA_CHECK(cudaMemcpyAsync(p, t.raw(), t.bytes(), cudaMemcpyDeviceToDevice, stream()));
  else convert(t.f32(), p, t.numel());
  return p;
}
void land(const bf16* result, Tensor& t) {
  if (result == t.raw()) return;
  if (is_bf16(t)) K2C_CUDA_CHECK(cudaMemcpyAsync(t.raw(), result, t.bytes(), cudaMemcpyDeviceToDevice, stream()));
  else convert(result, t.f32(), t.numel());
}
// dst = a + b, b and dst the model's tensors (fp32 or bf16 each), a a module's bf16 result.
void add_rows(const bf16* a, const Tensor& b, Tensor& dst) {
  with_data(b, [&](auto* pb) {
    with_data(dst, [&](auto* out) {
      using B = std::remove_pointer_t<decltype(pb)>;
      using M = std::remove_pointer_t<decltype(out)>;
      const std::int64_t n = dst.numel();
      if (aligned16(a) && aligned16(pb) && aligned16(out)) launch(sum_x8<bf16, B, M>, (n + 7) / 8, a, pb, out, n);
      else launch(sum_plain<bf16, B, M>, n, a, pb, out, n);
    });
  });
}
// The model's [batch·T, H·d] tensor in 09's heads-first layout, in bf16.
const bf16* heads_first(Scratch& s, const std::string& name, const Tensor& t, int T, int H, int d) {
  bf16* p = s.get<bf16>(name, t.numel());
  const std::int64_t n = t.numel();
  with_data(t, [&](auto* src) {
    using M = std::remove_pointer_t<decltype(src)>;
    if (heads_x8(src, p, n, d)) launch(to_heads_first_x8<M>, n / 8, src, p, int(n / 8), T, H, d);
    else launch(to_heads_first_plain<M>, n, src, p, n, T, H, d);
  });
  return p;
}
// An attention input for 09: the model's [batch·T, H·d] tensor as it stands (tokens_first, in bf16),
// or its copy in 09's heads-first layout.
const bf16* attention_input(Scratch& s, const std::string& name, const Tensor& t, int T, int H, int d, bool tokens_first) {
  return tokens_first ? to_bf16(s, name, t) : heads_first(s, name, t, T, H, d);
}
// The way back into the model's tensor: t (=, or += when add) src in the model's layout.
void from_heads_first(const bf16* src, Tensor& t, int T, int H, int d, bool add) {
  const std::int64_t n = t.numel();
  with_data(t, [&](auto* dst) {
    using M = std::remove_pointer_t<decltype(dst)>;
    if (heads_x8(src, dst, n, d)) launch(from_heads_first_x8<M>, n / 8, src, dst, int(n / 8), T, H, d, add);
    else launch(from_heads_first_plain<M>, n, src, dst, n, T, H, d, add);
  });
}
// Whether two tensors share any byte (a module's output written over its own input).
bool overlaps(const Tensor& a, const Tensor& b) {
  const auto* pa = static_cast<const char*>(a.raw());
  const auto* pb = static_cast<const char*>(b.raw());
  return pa < pb + b.bytes() && pb < pa + a.bytes();
}
// A 2-D tensor's rows and columns (a vector is one row).
std::pair<std::int64_t, std::int64_t> matrix(const Tensor& t) {
  const std::int64_t cols = t.dim(t.rank() - 1);
  return {cols ? t.numel() / cols : 0, cols};
}
bool fits_int(std::int64_t n) { return n >= 0 && n <= INT_MAX; }

// Which part of a module an operation calls: its Hopper part while `hopper`, and `ran_hopper`
// records what the last call ran (05's GEMM takes Part A at a K the Hopper part does not).
struct Parts {
  bool hopper = false, ran_hopper = false;
};
// CourseKernels::second_choice for a module with a Hopper part: the switch to its Part A, once, and
// only when the failing call ran the Hopper part (a Part A that fails has nothing to give way to).
std::function<std::string()> part_a_after(std::shared_ptr<Parts> parts, std::string part_a) {
  return [parts, part_a] {
    if (!parts->hopper || !parts->ran_hopper) return std::string();
    parts->hopper = false;
    return part_a;
  };
}

// 09's entry point an attention pass calls, as the course table names it: the part, and the
// layout it is given the model's tensors in.
std::string attention_name(const char* pass, bool hopper, bool tokens_first) {
  return std::string("09 flash_attention::") + pass + (hopper ? "_hopper" : "") +
         (tokens_first ? " (tokens_first)" : " (heads_first copies)");
}
// CourseKernels::second_choice for an attention pass: from the tokens_first layout to heads-first
// copies of the tensors (a part that has not taken on tokens_first yet), then from the Hopper part
// to Part A, in tokens_first again where `tokens_allowed` (CourseOptions::attention_tokens_first)
// and then in heads-first copies.
std::function<std::string()> attention_after(std::shared_ptr<Parts> parts, std::shared_ptr<bool> tokens_first,
                                             bool tokens_allowed, const char* pass) {
  return [parts, tokens_first, tokens_allowed, pass] {
    if (*tokens_first) {
      *tokens_first = false;
    } else if (parts->hopper) {
      parts->hopper = false;
      *tokens_first = tokens_allowed;
    } else {
      return std::string();
    }
    return attention_name(pass, parts->hopper, *tokens_first);
  };
}

namespace tcm = k2c::tensor_core_matmul;

// 05's GEMM behind the model's products, c = alpha·op(a)·op(b) + beta·c on the model's tensors
// (fp32 weights, fp32 or bf16 activations), as 05's
// C = A·Bᵀ with A (M×K) and B (N×K) K-major, in bf16 (Hopper part) or fp32 (Part A) out. The
// Linear layers that share an input (attention's q, k and v; the MLP's gate and up) convert it
// once for all their products, and sum their input gradients in one epilogue. The Linear layers'
// weight gradients go to 10's weight-gradient GEMM where it runs (grouped_backward). A call
// returns false (declines) only before it has written anything.
class CourseGemm {
 public:
  // `grouped`: module 10's Hopper weight-gradient GEMM for the Linear layers' backward (see
  // grouped_backward), on while its `hopper` and 05's are, at the shapes shared_backward lets
  // through; its `ran_hopper` says whether the last call here took it. `on_groups`: told each
  // weight gradient's number of groups there (CourseOptions).
  CourseGemm(std::shared_ptr<Scratch> scratch, std::shared_ptr<Parts> parts, std::shared_ptr<Parts> grouped, int sms,
             std::function<void(int)> on_groups)
      : scratch_(std::move(scratch)), parts_(std::move(parts)), grouped_(std::move(grouped)), sms_(sms),
        on_groups_(std::move(on_groups)) {}

  bool matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
    grouped_->ran_hopper = false;
    const auto [ar, ac] = matrix(a);
    const auto [br, bc] = matrix(b);
    const std::int64_t M = ta ? ac : ar, K = ta ? ar : ac, N = tb ? br : bc;
    if (!fits(M, N, K, ta || !tb)) return false;
    parts_->ran_hopper = parts_->hopper && K % 8 == 0;
    const int ks = parts_->ran_hopper ? slice_length(M, N, K, sms_) : static_cast<int>(K);
    const bf16* A = operand("gemm a", a, ar, ac, ta, ks);
    const bf16* B = operand("gemm b", b, br, bc, !tb, ks);
    if (parts_->ran_hopper) {
      const std::int64_t stride = padded(M * N);
      const bool direct = ks >= K && alpha == 1.0f && beta == 0.0f;  // one slice: a bf16 c takes the product itself
      bf16* C = direct ? out_bf16(*scratch_, "gemm c16", c) : scratch_->get<bf16>("gemm c16", (K + ks - 1) / ks * stride);
      const int slices = products(A, B, M, N, K, ks, C, stride);
      if (C != c.raw()) gemm_epilogue(C, slices, stride, c, M * N, alpha, beta);
    } else if (alpha == 1.0f && beta == 0.0f && !is_bf16(c)) {
      tcm::matmul(int(M), int(N), int(K), A, B, c.f32(), stream());
    } else {
      float* C = scratch_->get<float>("gemm c32", M * N);
      tcm::matmul(int(M), int(N), int(K), A, B, C, stream());
      with_data(c, [&](auto* out) {
        launch(gemm_epilogue_plain<float, std::remove_pointer_t<decltype(out)>>, M * N, C, 1, M * N, out, M * N, alpha, beta);
      });
    }
    return true;
  }

  // ys[i] = x·W_iᵀ (Ops::shared_linear_forward), x converted once.
  bool shared_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) {
    grouped_->ran_hopper = false;
    const auto [M, K] = matrix(x);
    if (ys.size() != ws.size()) return false;  // the trusted backend names the error
    bool one_slice = parts_->hopper && K % 8 == 0;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const auto [N, w_cols] = matrix(*ws[i]);
      if (w_cols != K || matrix(*ys[i]) != std::pair{M, N} || !fits(M, N, K, false)) return false;
      one_slice = one_slice && slice_length(M, N, K, sms_) == K;
    }
    if (!one_slice) {  // Part A, or a product to split: one matmul each
      bool hopper = false;
      for (std::size_t i = 0; i < ws.size(); ++i) {
        matmul(x, false, *ws[i], true, *ys[i], 1.0f, 0.0f);
        hopper = hopper || parts_->ran_hopper;
      }
      parts_->ran_hopper = hopper;  // so that a failure here can give way to Part A
      return true;
    }
    parts_->ran_hopper = true;
    const bf16* A = operand("shared x", x, M, K, false, int(K));
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const std::int64_t N = matrix(*ws[i]).first;
      const bf16* B = operand("gemm b", *ws[i], N, K, false, int(K));
      bf16* C = out_bf16(*scratch_, "gemm c16", *ys[i]);  // a bf16 output takes the product itself
      products(A, B, M, N, K, int(K), C, 0);
      if (C != ys[i]->raw()) gemm_epilogue(C, 1, M * N, *ys[i], M * N, 1.0f, 0.0f);
    }
    return true;
  }

  // dW_i += dy_iᵀ·x for each dws[i] given, then dx = Σ_i dy_i·W_i (Ops::shared_linear_backward). A
  // single Linear layer's backward comes here too, as a list of one. Where 10's weight-gradient GEMM
  // is on and 05's Hopper part takes every input gradient's product whole (K_in, T and every N_out
  // multiples of 8), grouped_backward. Otherwise on 05 alone: x transposed once for every weight
  // gradient cut into the same slices, each dy_i converted for both of its products in one pass,
  // and the input gradient's products summed by one epilogue instead of one accumulation pass each.
  bool shared_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                       std::span<Tensor* const> dws, Tensor* dx) {
    const auto [T, K_in] = matrix(x);
    if (dys.size() != ws.size() || dws.size() != ws.size() || (dx && matrix(*dx) != std::pair{T, K_in}) ||
        (dx && ws.empty()))
      return false;  // the trusted backend names the error (or writes dx's empty sum)
    grouped_->ran_hopper = false;
    bool hopper = parts_->hopper && K_in % 8 == 0 && T % 8 == 0;
    bool grouped = hopper && grouped_->hopper;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const auto [N_out, w_cols] = matrix(*ws[i]);
      if (w_cols != K_in || matrix(*dys[i]) != std::pair{T, N_out} || (dws[i] && matrix(*dws[i]) != matrix(*ws[i])) ||
          !fits(N_out, K_in, T, true) || !fits(T, K_in, N_out, true))
        return false;  // before anything is written
      grouped = grouped && kMaxSplit * N_out * K_in <= k2c::moe::kMaxElements &&
                T * std::max(N_out, K_in) <= k2c::moe::kMaxElements;
      hopper = hopper && N_out % 8 == 0 && slice_length(T, K_in, N_out, sms_) == N_out;
    }
    if (grouped && hopper) return grouped_backward(x, ws, dys, dws, dx);
    if (!hopper) {  // Part A, or a K the Hopper part does not take: one matmul each, in Ops's order
      bool ran = false;
      for (std::size_t i = 0; i < ws.size(); ++i)
        if (dws[i]) matmul(*dys[i], true, x, false, *dws[i], 1.0f, 1.0f), ran = ran || parts_->ran_hopper;
      for (std::size_t i = 0; dx && i < ws.size(); ++i)
        matmul(*dys[i], false, *ws[i], false, *dx, 1.0f, i ? 1.0f : 0.0f), ran = ran || parts_->ran_hopper;
      parts_->ran_hopper = ran;  // so that a failure here can give way to Part A
      return true;
    }
    parts_->ran_hopper = true;
    // Weight by weight: dy_i read once, transposed for dW_i's product and kept as it is for dx's.
    const std::int64_t dx_stride = padded(T * K_in);
    bf16* partial = dx_products(dx, dys, dx_stride);
    int x_slices = -1;  // the slice length x was last transposed with
    const bf16* X = nullptr;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const std::int64_t N_out = matrix(*ws[i]).first;
      const bf16* dy = nullptr;  // dy_i in bf16 as it stands: A of dx's product
      if (dws[i]) {
        const std::int64_t stride = padded(N_out * K_in);
        const int ks = slice_length(N_out, K_in, T, sms_);
        if (ks != x_slices) X = operand("shared x", x, T, K_in, true, ks), x_slices = ks;
        const bf16* A = operand("gemm a", *dys[i], T, N_out, true, ks, "dy", dx ? &dy : nullptr);
        bf16* C = scratch_->get<bf16>("gemm c16", (T + ks - 1) / ks * stride);
        const int slices = products(A, X, N_out, K_in, T, ks, C, stride);
        gemm_epilogue(C, slices, stride, *dws[i], N_out * K_in, 1.0f, 1.0f);
      }
      if (!dx) continue;
      if (!dy) dy = operand("dy", *dys[i], T, N_out, false, int(N_out));
      dx_product(dy, *ws[i], T, partial + i * dx_stride);
    }
    if (dx) sum_dx(partial, ws.size(), dx_stride, *dx);
    return true;
  }

 private:
  // Where the input gradient's products go: straight into a bf16 dx for one weight (no sum to make,
  // no pass over a partial product), else a partial product per weight, `stride` apart.
  bf16* dx_products(Tensor* dx, std::span<const Tensor* const> dys, std::int64_t stride) {
    if (!dx) return nullptr;
    if (dys.size() == 1 && !overlaps(*dx, *dys[0])) return out_bf16(*scratch_, "shared dx", *dx);
    return scratch_->get<bf16>("shared dx", static_cast<std::int64_t>(dys.size()) * stride);
  }
  // One of them, dy·W (dy T × N_out in bf16) on 05's Hopper part, with Wᵀ (K_in × N_out) from the
  // pass that converts the fp32 weight.
  void dx_product(const bf16* dy, const Tensor& w, std::int64_t T, bf16* out) {
    const auto [N_out, K_in] = matrix(w);
    const bf16* B = operand("gemm b", w, N_out, K_in, true, int(N_out));
    products(dy, B, T, K_in, N_out, int(N_out), out, 0);
  }
  // dx = the sum of the products (nothing to do where the one product went into dx itself).
  void sum_dx(const bf16* partial, std::size_t weights, std::int64_t stride, Tensor& dx) {
    if (partial != dx.raw()) gemm_epilogue(partial, static_cast<int>(weights), stride, dx, dx.numel(), 1.0f, 0.0f);
  }

  // The weight gradient's row split: at most this many groups.
  static constexpr std::int64_t kMaxSplit = 64;

  // shared_backward with the weight gradients on module 10's Hopper weight-gradient GEMM, which
  // reads both operands MN-major where 05 reads them K-major only: a Linear layer's tokens are one
  // group of a grouped GEMM, and dW_i = dy_iᵀ·x reads dy_i and x as they stand (05 needs both
  // transposed by a pass) and arrives in fp32 (05's is rounded to bf16 before it is added). A weight
  // gradient with too few output tiles to fill the GPU (768 × 768 is 18 of 10's 128 × 256 tiles)
  // splits the tokens into groups, as many as fill one wave, each at least 512 tokens and at most
  // kMaxSplit of them; each group's product is a partial sum that the epilogue adds up: split-K
  // written as groups. Needs N_out and K_in multiples of 8 (TMA rows) and dW in fp32 (ops.h). The input gradient stays on 05 (dx_i = dy_i·W_i with W_iᵀ converted from
  // the fp32 weight in one pass, as W_i itself would be): at the model's shapes 05 ran it 4-13 %
  // faster than 10's input-gradient form (lab/capstone_gemms.cu).
  bool grouped_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                        std::span<Tensor* const> dws, Tensor* dx) {
    namespace moe = k2c::moe;
    parts_->ran_hopper = grouped_->ran_hopper = true;
    const auto [T, K_in] = matrix(x);
    const bool any_dw = std::any_of(dws.begin(), dws.end(), [](const Tensor* t) { return t != nullptr; });
    const bf16* X = any_dw ? to_bf16(*scratch_, "shared x", x) : nullptr;
    const std::int64_t dx_stride = padded(T * K_in);
    bf16* partial = dx_products(dx, dys, dx_stride);
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const std::int64_t N_out = matrix(*ws[i]).first;
      const bf16* dy = to_bf16(*scratch_, "dy", *dys[i]);
      if (dws[i]) {
        const int tiles = static_cast<int>(((N_out + 127) / 128) * ((K_in + 255) / 256));
        const int groups = static_cast<int>(std::clamp<std::int64_t>(std::min<std::int64_t>(sms_ / tiles, T / 512), 1, kMaxSplit));
        const std::int64_t count = N_out * K_in;
        float* parts = scratch_->get<float>("grouped dw", groups * count);
        moe::grouped_weight_grad_hopper(groups, offsets("grouped split", T, groups), int(T), int(N_out), int(K_in), dy,
                                        X, parts, stream());
        if (on_groups_) on_groups_(groups);
        launch(gemm_epilogue_plain<float, float>, count, static_cast<const float*>(parts), groups, count,
               dws[i]->f32(), count, 1.0f, 1.0f);  // dW += the groups' sum
      }
      if (!dx) continue;
      dx_product(dy, *ws[i], T, partial + i * dx_stride);
    }
    if (dx) sum_dx(partial, ws.size(), dx_stride, *dx);
    return true;
  }
  // 10's group offsets for `rows` rows cut into `groups` near-equal groups, on the device.
  int* offsets(const std::string& name, std::int64_t rows, int groups) {
    Offsets host;
    for (int g = 0; g <= groups; ++g) host.v[g] = static_cast<int>(rows * g / groups);
    return device_offsets(*scratch_, name, host, groups + 1);
  }

  // Sizes 05 takes: each within int (with room for a thread's stride past the end), none zero;
  // a transposed operand's K rows are the transpose's grid rows (gridDim.y at most 65535 tiles of
  // 64), and every operand transposed here has K rows.
  static bool fits(std::int64_t M, std::int64_t N, std::int64_t K, bool transposes) {
    auto in_int = [](std::int64_t n) { return n > 0 && n <= INT_MAX - 1024; };
    return in_int(M) && in_int(N) && in_int(K) && (!transposes || (K + kTransposeTile - 1) / kTransposeTile <= 65535);
  }
  // A slice's partial product starts on 16 bytes, as the Hopper part's fast stores want.
  static std::int64_t padded(std::int64_t elements) { return (elements + 7) / 8 * 8; }
  // t (rows × cols, fp32 or bf16) as a K-major bf16 operand in slices of ks, in the scratch buffer
  // `name`: transposed (K = rows) or not (K = cols); a bf16 t that is already that operand (not
  // transposed, one slice) is used as it stands. A transposed one can also give bf16(t)
  // untransposed (*plain): t itself where it holds bf16, else the scratch buffer `plain_name`,
  // from the same pass over t.
  const bf16* operand(const std::string& name, const Tensor& t, std::int64_t rows, std::int64_t cols, bool transposed,
                      int ks, const std::string& plain_name = {}, const bf16** plain = nullptr) {
    const std::int64_t K = transposed ? rows : cols;
    if (!transposed && ks >= K && is_bf16(t) && aligned16(t.raw())) return bf16_data(t);
    bf16* dst = scratch_->get<bf16>(name, rows * cols);
    with_data(t, [&](auto* src) {
      using M = std::remove_pointer_t<decltype(src)>;
      if (transposed) {
        bf16* both = nullptr;
        if (plain) {
          if constexpr (std::is_same_v<M, bf16>) *plain = src;
          else *plain = both = scratch_->get<bf16>(plain_name, rows * cols);
        }
        const bool vec = cols % 4 == 0 && aligned16(src);
        to_bf16_transposed<M><<<dim3((cols + kTransposeTile - 1) / kTransposeTile, (rows + kTransposeTile - 1) / kTransposeTile),
                                kTransposeThreads, 0, stream()>>>(src, dst, both, int(rows), int(cols), ks, vec);
        K2C_CUDA_CHECK_LAUNCH();
      } else if (ks >= K) {
        if constexpr (std::is_same_v<M, float>) convert(src, dst, t.numel());
        else K2C_CUDA_CHECK(cudaMemcpyAsync(dst, src, t.bytes(), cudaMemcpyDeviceToDevice, stream()));  // off 16 bytes
      } else {
        to_bf16_sliced<M><<<static_cast<unsigned>(std::min<std::int64_t>(rows, 8192)), kThreads, 0, stream()>>>(
            src, dst, int(rows), int(cols), ks);
        K2C_CUDA_CHECK_LAUNCH();
      }
    });
    return dst;
  }
  // The Hopper part's products of A (M × K) and B (N × K) in slices of ks, slice i's bf16 product
  // at C + i·stride, each slice on a stream of its own; returns the number of slices. The side
  // streams are joined back even when a launch throws, so that no slice still runs when the
  // scratch buffers are reused.
  int products(const bf16* A, const bf16* B, std::int64_t M, std::int64_t N, std::int64_t K, int ks, bf16* C,
               std::int64_t stride) {
    const int slices = static_cast<int>((K + ks - 1) / ks);
    fork_.begin(slices);
    struct Join {
      Fork& fork;
      int slices;
      ~Join() { fork.end(slices); }
    } join{fork_, slices};
    for (int i = 0; i < slices; ++i) {
      const std::int64_t k0 = std::int64_t{i} * ks, length = std::min<std::int64_t>(ks, K - k0);
      tcm::matmul_hopper(int(M), int(N), int(length), A + M * k0, B + N * k0, C + i * stride, fork_.at(i));
    }
    return slices;
  }

  std::shared_ptr<Scratch> scratch_;
  std::shared_ptr<Parts> parts_, grouped_;
  int sms_;
  std::function<void(int)> on_groups_;
  Fork fork_;
};

}  // namespace

// Declared in course_kernels.h. A call that faults on the GPU (an illegal address, say) cannot be
// passed over: the fault is sticky, every later CUDA call of the process fails with it, and nothing
// could fall back. So that case ends the run at once, naming the part, instead of at some later
// call that did nothing wrong.
bool probe_part(bool supported, const char* part, const std::function<void()>& call) {
  if (!supported) return false;
  try {
    call();
    K2C_CUDA_CHECK(cudaStreamSynchronize(stream()));
    return true;
  } catch (const std::exception&) {
    (void)cudaGetLastError();  // clears an error that is not sticky (a bad launch, say)
    if (const cudaError_t sticky = cudaDeviceSynchronize(); sticky != cudaSuccess)
      throw std::runtime_error(std::string(part) + " faulted on the GPU in a one-call probe (" +
                               cudaGetErrorString(sticky) +
                               "); a fault ends the process's CUDA context, so course mode cannot fall back "
                               "from it: fix that part, or run with --kernels trusted");
    return false;
  }
}

model::CourseKernels course_kernels(const CourseOptions& options) {
  namespace tcm = k2c::tensor_core_matmul;
  namespace fa = k2c::flash_attention;
  auto scratch = std::make_shared<Scratch>();
  model::CourseKernels k;

  // ---- 05: c = alpha·op(a)·op(b) + beta·c as 05's C = A·Bᵀ with A (M×K) and B (N×K) K-major.
  const auto gemm_hopper = std::make_shared<Parts>();
  gemm_hopper->hopper = probe_part(tcm::hopper_supported(), "05 tensor_core_matmul::matmul_hopper", [&] {
    bf16* a = scratch->get<bf16>("probe", 3 * 64 * 64);
    K2C_CUDA_CHECK(cudaMemsetAsync(a, 0, 2 * 64 * 64 * sizeof(bf16), stream()));
    tcm::matmul_hopper(64, 64, 64, a, a + 64 * 64, a + 2 * 64 * 64, stream());
  });
  // The Linear layers' weight gradients on 10's Hopper weight-gradient GEMM
  // (CourseGemm::grouped_backward), while 05's Hopper part runs and options.weight_grads_on_10 asks
  // for it; switched on below, once 10's probe has answered.
  const auto linear_grouped = std::make_shared<Parts>();
  k.names["matmul"] = gemm_hopper->hopper ? "05 tensor_core_matmul::matmul_hopper" : "05 tensor_core_matmul::matmul";
  // A failing call that took 10's GEMM gives it up first: the products go back to 05 alone.
  k.second_choice["matmul"] = [linear_grouped, part_a = part_a_after(gemm_hopper, "05 tensor_core_matmul::matmul")] {
    if (!linear_grouped->hopper || !linear_grouped->ran_hopper) return part_a();
    linear_grouped->hopper = false;
    return std::string("05 tensor_core_matmul::matmul_hopper");
  };
  int sms = 0;
  {
    int device = 0;
    K2C_CUDA_CHECK(cudaGetDevice(&device));
    K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  }
  const auto gemm = std::make_shared<CourseGemm>(scratch, gemm_hopper, linear_grouped, sms, options.on_weight_grad_groups);
  k.matmul = [gemm](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
    return gemm->matmul(a, ta, b, tb, c, alpha, beta);
  };
  k.shared_linear_forward = [gemm](const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) {
    return gemm->shared_forward(x, ws, ys);
  };
  k.shared_linear_backward = [gemm](const Tensor& x, std::span<const Tensor* const> ws,
                                    std::span<const Tensor* const> dys, std::span<Tensor* const> dws, Tensor* dx) {
    return gemm->shared_backward(x, ws, dys, dws, dx);
  };

  // ---- 10: the experts' grouped GEMMs, one launch over every group: the Hopper part where its
  // shapes allow (bf16 products, landing in the model's tensor as they are where it holds bf16,
  // converted where fp32; fp32 weight gradients), else Part A (fp32 outputs). The group offsets reach the device as 10's int32 by a kernel argument.
  namespace moe = k2c::moe;
  // Whether 10 takes the call (else the trusted backend names what is wrong).
  auto grouped_fits = [](const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w) {
    const std::int64_t groups = static_cast<std::int64_t>(offsets.size()) - 1;
    return groups >= 1 && groups <= moe::kMaxExperts && w.rank() == 3 && first >= 0 && first + groups <= w.dim(0) &&
           fits_int(a.dim(0)) && fits_int(w.dim(1)) && fits_int(w.dim(2)) && offsets.front() == 0 &&
           offsets.back() == a.dim(0);
  };
  auto grouped_args = [scratch, grouped_fits](const Tensor& a, std::span<const std::int64_t> offsets, int first,
                                              const Tensor& w, const int*& device_offsets, const bf16*& a16,
                                              const bf16** w16) {
    if (!grouped_fits(a, offsets, first, w)) return false;
    const int groups = static_cast<int>(offsets.size()) - 1;
    Offsets host;
    for (int g = 0; g <= groups; ++g) host.v[g] = static_cast<int>(offsets[g]);
    device_offsets = k2c::capstone::device_offsets(*scratch, "moe offsets", host, groups + 1);
    a16 = to_bf16(*scratch, "moe a", a);
    if (w16) {  // the groups' weights (a weight gradient's call has none to read)
      const std::int64_t per_group = w.dim(1) * w.dim(2), count = groups * per_group;
      bf16* w_groups = scratch->get<bf16>("moe w", count);
      convert(w.f32() + first * per_group, w_groups, count);
      *w16 = w_groups;
    }
    return true;
  };
  auto probe_grouped = [&](const char* part, auto call) {
    return probe_part(moe::hopper_supported(), part, [&] {
      Offsets one;
      one.v[0] = 0, one.v[1] = 64;
      int* off = device_offsets(*scratch, "probe offsets", one, 2);
      bf16* p = scratch->get<bf16>("probe", 3 * 64 * 64);
      K2C_CUDA_CHECK(cudaMemsetAsync(p, 0, 3 * 64 * 64 * sizeof(bf16), stream()));
      call(off, p, scratch->get<float>("probe dw", 64 * 64));
    });
  };
  const auto grouped_hopper = std::make_shared<Parts>(), grad_hopper = std::make_shared<Parts>();
  grouped_hopper->hopper = probe_grouped("10 moe::grouped_gemm_hopper", [](const int* off, bf16* p, float*) {
    moe::grouped_gemm_hopper(1, off, 64, 64, 64, p, p + 64 * 64, p + 2 * 64 * 64, true, stream());
  });
  grad_hopper->hopper = probe_grouped("10 moe::grouped_weight_grad_hopper", [](const int* off, bf16* p, float* dw) {
    moe::grouped_weight_grad_hopper(1, off, 64, 64, 64, p, p + 64 * 64, dw, stream());
  });
  linear_grouped->hopper = options.weight_grads_on_10 && gemm_hopper->hopper && grad_hopper->hopper;
  if (linear_grouped->hopper) k.names["matmul"] += " (weight gradients: 10 moe::grouped_weight_grad_hopper)";
  k.names["grouped matmul"] = grouped_hopper->hopper ? "10 moe::grouped_gemm_hopper" : "10 moe::grouped_gemm";
  k.second_choice["grouped matmul"] = part_a_after(grouped_hopper, "10 moe::grouped_gemm");
  k.grouped_matmul = [scratch, grouped_fits, grouped_args, grouped_hopper](
                         const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                         bool transpose_w, Tensor& c) {
    const int* off;
    const bf16 *a16, *w16;
    if (!grouped_fits(a, offsets, first, w)) return false;
    if (a.dim(0) == 0) return true;  // no rows: nothing to write (10 takes no null output)
    if (!grouped_args(a, offsets, first, w, off, a16, &w16)) return false;
    // Forward: w_g is 10's B_g [n][k]. Input gradient: w_g [rows of w][cols of w] is 10's [k][n].
    // The Hopper part describes its operands for TMA: rows of 16 bytes.
    const int groups = int(offsets.size()) - 1, rows = int(a.dim(0));
    const int n = int(transpose_w ? w.dim(1) : w.dim(2)), kk = int(transpose_w ? w.dim(2) : w.dim(1));
    grouped_hopper->ran_hopper = grouped_hopper->hopper && kk % 8 == 0 && (transpose_w || (n % 8 == 0 && kk % 64 == 0)) &&
                                 std::int64_t{groups} * (transpose_w ? n : kk) <= INT_MAX;
    // c fp32 or bf16 (the experts' activations are in the run's dtype, their output in fp32).
    if (grouped_hopper->ran_hopper) {
      bf16* c16 = out_bf16(*scratch, "moe c", c);
      moe::grouped_gemm_hopper(groups, off, rows, n, kk, a16, w16, c16, transpose_w, stream());
      land(c16, c);
    } else if (is_bf16(c)) {
      bf16* c16 = out_bf16(*scratch, "moe c", c);
      moe::grouped_gemm(groups, off, n, kk, a16, w16, c16, transpose_w, false, stream());
      land(c16, c);
    } else {
      moe::grouped_gemm(groups, off, n, kk, a16, w16, c.f32(), transpose_w, false, stream());
    }
    return true;
  };
  k.names["grouped weight grad"] = grad_hopper->hopper ? "10 moe::grouped_weight_grad_hopper" : "10 moe::grouped_weight_grad";
  k.second_choice["grouped weight grad"] = part_a_after(grad_hopper, "10 moe::grouped_weight_grad");
  k.grouped_weight_grad = [scratch, grouped_fits, grouped_args, grad_hopper](
                              const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                              Tensor& dw) {
    const int* off;
    const bf16* dy16;
    if (!grouped_fits(dy, offsets, first, dw)) return false;
    if (dy.dim(0) == 0) return true;  // no rows: dw += 0
    if (!grouped_args(dy, offsets, first, dw, off, dy16, nullptr)) return false;
    const int groups = int(offsets.size()) - 1, n = int(dw.dim(1)), kk = int(dw.dim(2));
    const std::int64_t count = std::int64_t{groups} * n * kk;
    float* part = scratch->get<float>("moe dw", count);
    const bf16* x16 = to_bf16(*scratch, "moe x", x);
    grad_hopper->ran_hopper = grad_hopper->hopper && n % 8 == 0 && kk % 8 == 0;
    if (grad_hopper->ran_hopper) moe::grouped_weight_grad_hopper(groups, off, int(dy.dim(0)), n, kk, dy16, x16, part, stream());
    else moe::grouped_weight_grad(groups, off, n, kk, dy16, x16, part, stream());
    add_into(part, dw.f32() + first * std::int64_t{n} * kk, count);  // dw +=
    return true;
  };

  // ---- 07: RMSNorm forward and backward, no fused residual (the model adds its own).
  k.names["rmsnorm"] = "07 rmsnorm::forward";
  k.rmsnorm_forward = [scratch](const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) {
    const auto [rows, cols] = matrix(x);
    if (!fits_int(rows) || !fits_int(cols) || rows > rmsnorm::kMaxExtent || cols > rmsnorm::kMaxExtent) return false;
    bf16* y16 = out_bf16(*scratch, "norm y", y);
    rmsnorm::forward(to_bf16(*scratch, "norm x", x), nullptr, to_bf16(*scratch, "norm gamma", gamma), y16, nullptr,
                     rstd.f32(), int(rows), int(cols), eps, stream());
    land(y16, y);
    return true;
  };
  k.names["rmsnorm backward"] = "07 rmsnorm::backward";
  k.rmsnorm_backward = [scratch](const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                                 const Tensor* residual_dy, Tensor& dx, Tensor& dgamma) {
    const auto [rows, cols] = matrix(x);
    if (!fits_int(rows) || !fits_int(cols) || rows > rmsnorm::kMaxExtent || cols > rmsnorm::kMaxExtent) return false;
    // 07 writes bf16: straight into a bf16 dx where there is nothing to add, else into scratch,
    // which one pass adds to the residual's gradient in dx's dtype (fp32 or bf16, as the stream).
    bf16* dx16 = residual_dy ? scratch->get<bf16>("norm dx", x.numel()) : out_bf16(*scratch, "norm dx", dx);
    float* dg = scratch->get<float>("norm dgamma", cols);
    void* ws = scratch->get<unsigned char>("norm workspace",
                                           static_cast<std::int64_t>(rmsnorm::backward_workspace_bytes(int(rows), int(cols))));
    rmsnorm::backward(to_bf16(*scratch, "norm x", x), to_bf16(*scratch, "norm gamma", gamma),
                      to_bf16(*scratch, "norm dy", dy), rstd.f32(), dx16, dg, ws, int(rows), int(cols), stream());
    if (residual_dy) add_rows(dx16, *residual_dy, dx);
    else land(dx16, dx);
    add_into(dg, dgamma.f32(), cols);  // dgamma +=
    return true;
  };

  // ---- 08: RoPE in place, half-split pairs, from a table of the given positions.
  k.names["rope"] = "08 rope::apply";
  k.rope = [scratch](Tensor& x, const Tensor& positions, int heads, int head_dim, float theta, bool inverse) {
    const auto [rows, cols] = matrix(x);
    const std::int64_t T = positions.numel();
    if (T == 0 || rows % T || cols != std::int64_t{heads} * head_dim || head_dim % 2 || !fits_int(rows)) return false;
    const int half = head_dim / 2;
    auto* table = scratch->get<float2>("rope table", T * half);
    launch(rope_rows, T * half, table, positions.i32(), int(T), half, double(theta));
    bf16* x16 = in_place_bf16(*scratch, "rope x", x);
    // 08 rotates q and k in one call; the model rotates one tensor at a time, so the k side is one
    // head of scratch (kv_heads 1 divides any head count).
    bf16* k16 = scratch->get<bf16>("rope k", rows * head_dim);
    const rope::Shape s{int(rows / T), int(T), heads, 1, head_dim};
    rope::apply(x16, k16, x16, k16, s, 0, rope::Layout::half_split,
                inverse ? rope::Direction::backward : rope::Direction::forward, theta, table, int(T), stream());
    land(x16, x);
    return true;
  };

  // ---- 09: attention, causal aligned to the bottom right. The model's q, k, v and o are laid out
  // token by token, 09's tokens_first layout: given as they stand where a part takes that layout
  // (checked like any kernel), else through copies in 09's heads_first layout.
  auto fa_shape = [](const AttentionShape& s, bool tokens_first, fa::Shape& out) {
    // 09's mask: key j visible to query i when j <= i + kv_len − q_len; the model's when
    // q_offset + i >= kv_offset + j. The same mask only when the offsets say so.
    if (s.causal && s.q_offset - s.kv_offset != std::int64_t{s.kv_len} - s.q_len) return false;
    if (s.head_dim != 64 && s.head_dim != 128) return false;
    out = {s.batch, s.q_heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, s.causal,
           static_cast<float>(1.0 / std::sqrt(double(s.head_dim))),
           tokens_first ? fa::Layout::tokens_first : fa::Layout::heads_first};
    return true;
  };
  auto probe = [&](const char* part, auto call) {
    return probe_part(fa::hopper_supported(), part, [&] {
      const fa::Shape s{1, 1, 1, 16, 16, 64, true, 0.125f};
      bf16* p = scratch->get<bf16>("probe", 8 * 16 * 64);
      auto* lse = scratch->get<float>("probe lse", 16);
      K2C_CUDA_CHECK(cudaMemsetAsync(p, 0, 8 * 16 * 64 * sizeof(bf16), stream()));
      K2C_CUDA_CHECK(cudaMemsetAsync(lse, 0, 16 * sizeof(float), stream()));
      call(s, p, lse);
    });
  };
  const auto fwd_hopper = std::make_shared<Parts>(), bwd_hopper = std::make_shared<Parts>();
  fwd_hopper->hopper = fwd_hopper->ran_hopper =
      probe("09 flash_attention::forward_hopper", [](const fa::Shape& s, bf16* p, float* lse) {
        fa::forward_hopper(s, p, p + 1024, p + 2048, p + 3072, lse, stream());
      });
  bwd_hopper->hopper = bwd_hopper->ran_hopper =
      probe("09 flash_attention::backward_hopper", [&](const fa::Shape& s, bf16* p, float* lse) {
        void* ws = scratch->get<unsigned char>("probe ws", static_cast<std::int64_t>(fa::backward_workspace_bytes(s)));
        fa::backward_hopper(s, p, p + 1024, p + 2048, p + 3072, p + 4096, lse, p + 5120, p + 6144, p + 7168, ws,
                            stream());
      });
  // Each pass's layout: tokens_first until a call in it fails the check (attention_after).
  const auto fwd_tokens = std::make_shared<bool>(options.attention_tokens_first),
             bwd_tokens = std::make_shared<bool>(options.attention_tokens_first);
  k.names["attention"] = attention_name("forward", fwd_hopper->hopper, *fwd_tokens);
  k.second_choice["attention"] = attention_after(fwd_hopper, fwd_tokens, options.attention_tokens_first, "forward");
  k.attention_forward = [scratch, fa_shape, fwd_hopper, fwd_tokens](const AttentionShape& s, const Tensor& q,
                                                                    const Tensor& kk, const Tensor& v, Tensor& o,
                                                                    Tensor& lse) {
    fa::Shape f;
    const bool tokens = *fwd_tokens;
    if (!fa_shape(s, tokens, f)) return false;
    const int d = s.head_dim;
    Scratch& sc = *scratch;
    const bf16 *q16 = attention_input(sc, "attn q", q, s.q_len, s.q_heads, d, tokens),
               *k16 = attention_input(sc, "attn k", kk, s.kv_len, s.kv_heads, d, tokens),
               *v16 = attention_input(sc, "attn v", v, s.kv_len, s.kv_heads, d, tokens);
    bf16* o16 = tokens ? out_bf16(sc, "attn o", o) : scratch->get<bf16>("attn o", o.numel());
    // 09 takes pointers on 16 bytes: lse goes through scratch where the model's does not start there.
    float* lse09 = aligned16(lse.f32()) ? lse.f32() : scratch->get<float>("attn lse", lse.numel());
    if (fwd_hopper->hopper) fa::forward_hopper(f, q16, k16, v16, o16, lse09, stream());
    else fa::forward(f, q16, k16, v16, o16, lse09, stream());
    if (tokens) land(o16, o);
    else from_heads_first(o16, o, s.q_len, s.q_heads, d, false);
    launch(flip_infinite, lse.numel(), static_cast<const float*>(lse09), lse.f32(), lse.numel());
    return true;
  };
  k.names["attention backward"] = attention_name("backward", bwd_hopper->hopper, *bwd_tokens);
  k.second_choice["attention backward"] = attention_after(bwd_hopper, bwd_tokens, options.attention_tokens_first, "backward");
  k.attention_backward = [scratch, fa_shape, bwd_hopper, bwd_tokens](
                             const AttentionShape& s, const Tensor& q, const Tensor& kk, const Tensor& v, const Tensor& o,
                             const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, bool add_kv) {
    fa::Shape f;
    const bool tokens = *bwd_tokens;
    if (!fa_shape(s, tokens, f)) return false;
    const int d = s.head_dim;
    Scratch& sc = *scratch;
    const bf16 *q16 = attention_input(sc, "attn q", q, s.q_len, s.q_heads, d, tokens),
               *k16 = attention_input(sc, "attn k", kk, s.kv_len, s.kv_heads, d, tokens),
               *v16 = attention_input(sc, "attn v", v, s.kv_len, s.kv_heads, d, tokens),
               *o16 = attention_input(sc, "attn o", o, s.q_len, s.q_heads, d, tokens),
               *do16 = attention_input(sc, "attn do", dout, s.q_len, s.q_heads, d, tokens);
    float* lse09 = scratch->get<float>("attn lse", lse.numel());
    launch(flip_infinite, lse.numel(), lse.f32(), lse09, lse.numel());
    // dq is written, and dk and dv unless add_kv: straight into the model's tensors where 09 can
    // (its layout, and no input in the same memory); dk and dv are added into where add_kv.
    auto apart = [&](const Tensor& t) {
      return !overlaps(t, q) && !overlaps(t, kk) && !overlaps(t, v) && !overlaps(t, o) && !overlaps(t, dout);
    };
    auto written = [&](const char* name, const Tensor& t, bool whole) {
      return whole && tokens && apart(t) ? out_bf16(sc, name, t) : scratch->get<bf16>(name, t.numel());
    };
    bf16* dq16 = written("attn dq", dq, true);
    bf16* dk16 = written("attn dk", dk, !add_kv);
    bf16* dv16 = written("attn dv", dv, !add_kv);
    void* ws = scratch->get<unsigned char>("attn workspace", static_cast<std::int64_t>(fa::backward_workspace_bytes(f)));
    if (bwd_hopper->hopper) fa::backward_hopper(f, q16, k16, v16, o16, do16, lse09, dq16, dk16, dv16, ws, stream());
    else fa::backward(f, q16, k16, v16, o16, do16, lse09, dq16, dk16, dv16, ws, stream());
    if (tokens) {
      land(dq16, dq);
      if (add_kv) {
        gemm_epilogue(dk16, 1, dk.numel(), dk, dk.numel(), 1.0f, 1.0f);  // dk += dk16
        gemm_epilogue(dv16, 1, dv.numel(), dv, dv.numel(), 1.0f, 1.0f);
      } else {
        land(dk16, dk);
        land(dv16, dv);
      }
    } else {
      from_heads_first(dq16, dq, s.q_len, s.q_heads, d, false);
      from_heads_first(dk16, dk, s.kv_len, s.kv_heads, d, add_kv);
      from_heads_first(dv16, dv, s.kv_len, s.kv_heads, d, add_kv);
    }
    return true;
  };
  return k;
}

}  // namespace k2c::capstone
