// cuda_ops.cu — the GPU backend of k2c/model/ops.h: every operation on the device, tensors in
// fp32 (activations, master weights, gradients, optimizer state), in one of two kinds of math:
//
//   GpuMath::fp32  GEMMs in plain fp32 (cuBLAS SGEMM) and a straightforward kernel for every
//                  other operation, attention included: the reference the tests hold tightly
//                  against the CPU backend.
//   GpuMath::bf16  the fast path: the operands of every GEMM are rounded to bf16 on their way in
//                  and multiplied on the tensor cores with fp32 accumulation and fp32 results
//                  (mixed precision as training frameworks do it), and attention is computed by
//                  batched tensor-core GEMMs over blocks of the score matrix: the causal mask's
//                  empty blocks are never computed, the softmax runs in fp32 between the GEMMs,
//                  and backward recomputes the scores from the log-sum-exp instead of storing
//                  them (src/cuda_attention.cuh tells the story); for head_dim 64 and 128 a fused
//                  FlashAttention-2 kernel pair on mma.sync takes over, and the scores never
//                  reach memory (src/cuda_flash.cuh).
//
// Element-wise and row-wise operations (norms, RoPE, SwiGLU, cross-entropy, dropout, AdamW) are
// the same plain kernels in both modes: they are memory-bound and fp32 costs them a factor of
// two in bytes at most. Reductions that the CPU backend does in a fixed order are done here with
// atomics where that is simplest (embedding gradients, scatters): the GPU backend promises
// agreement within rounding, not bits. Every launch and every cuBLAS call goes to one stream
// (cuda_ops_use_stream), so a communicator that orders its work against that stream sees the
// model's work in order.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "k2c/check.h"
#include "k2c/model/cuda_ops.h"
#include "k2c/model/mask.h"
#include "op_checks.h"

namespace k2c::model {

namespace {

// The stream every operation of both GPU backends is issued to (nullptr: the legacy default
// stream, which orders against every other blocking stream of the device).
cudaStream_t g_stream = nullptr;

constexpr int kThreads = 256;
int blocks_for(std::int64_t n) { return static_cast<int>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 65535)); }

using checks::as_matrix;
using checks::Matrix;
using checks::same_shape;

// Device memory with a cache of freed blocks, as training frameworks keep one: a step allocates
// and frees the same activation sizes every time, and cudaMalloc / cudaFree are slow and
// cudaFree waits for the whole device. A freed block goes back to a free list by size and the
// next request of that size takes it. That is safe in stream order: every kernel that read the
// old tensor was queued before any kernel that writes the new one, on the same stream. Blocks are
// rounded up (to 512 bytes, or to 2 MiB above 2 MiB) so that near sizes share; when the device
// runs out, the cache is released and the allocation tried once more.
class DeviceMemory final : public Memory {
 public:
  ~DeviceMemory() override {
    release_cache();
    for (auto& [p, bytes] : live_) cudaFree(p);
  }
  void* alloc(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    const std::size_t size = rounded(bytes);
    void* p = nullptr;
    if (auto it = free_.find(size); it != free_.end()) {
      p = it->second;
      free_.erase(it);
      cached_ -= size;
    } else if (cudaMalloc(&p, size) != cudaSuccess) {
      cudaGetLastError();  // clear the out-of-memory error, release what is cached, try again
      release_cache();
      K2C_CUDA_CHECK(cudaMalloc(&p, size));
    }
    live_[p] = size;
    return p;
  }
  void free(void* p) override {
    if (!p) return;
    const auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours: nothing to do
    free_.emplace(it->second, p);
    cached_ += it->second;
    live_.erase(it);
  }
  bool on_device() const override { return true; }

 private:
  static std::size_t rounded(std::size_t bytes) {
    const std::size_t unit = bytes > (std::size_t{2} << 20) ? (std::size_t{2} << 20) : 512;
    return (bytes + unit - 1) / unit * unit;
  }
  void release_cache() {
    if (free_.empty()) return;
    cudaDeviceSynchronize();
    for (auto& [size, p] : free_) cudaFree(p);
    free_.clear();
    cached_ = 0;
  }
  std::unordered_map<void*, std::size_t> live_;
  std::unordered_multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
};

// ---------------------------------------------------------------------------------------------
// kernels: one thread an element (grid-stride), or one block a row

#define K2C_FOR_EACH(i, n) \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

__global__ void fill_kernel(float* p, std::int64_t n, float v) { K2C_FOR_EACH(i, n) p[i] = v; }
__global__ void add_kernel(const float* a, const float* b, float* o, std::int64_t n) { K2C_FOR_EACH(i, n) o[i] = a[i] + b[i]; }
__global__ void axpy_kernel(float* acc, const float* x, float s, std::int64_t n) { K2C_FOR_EACH(i, n) acc[i] += s * x[i]; }
__global__ void scale_kernel(float* p, float s, std::int64_t n) { K2C_FOR_EACH(i, n) p[i] *= s; }

// The same four, and SwiGLU's two below, a float4 at a time: what they are limited by is bytes,
// and 16-byte accesses move them at close to the copy rate where 4-byte ones reach about half.
// They take over when every pointer is 16-byte aligned and the length a multiple of 4 (whole
// activations always are; a view of some rows may not be).
bool vectorizable(std::int64_t n, std::initializer_list<const void*> pointers) {
  if (n % 4) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<std::uintptr_t>(p) % 16) return false;
  return true;
}
__global__ void fill4_kernel(float4* p, std::int64_t n4, float v) { K2C_FOR_EACH(i, n4) p[i] = make_float4(v, v, v, v); }
__global__ void add4_kernel(const float4* a, const float4* b, float4* o, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    const float4 x = a[i], y = b[i];
    o[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
  }
}
__global__ void axpy4_kernel(float4* acc, const float4* x, float s, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    float4 a = acc[i];
    const float4 b = x[i];
    a.x += s * b.x, a.y += s * b.y, a.z += s * b.z, a.w += s * b.w;
    acc[i] = a;
  }
}
__global__ void scale4_kernel(float4* p, float s, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    float4 a = p[i];
    a.x *= s, a.y *= s, a.z *= s, a.w *= s;
    p[i] = a;
  }
}

// Σ x² in double: each block sums its share, one atomic per block.
__global__ void sum_squares_kernel(const float* x, std::int64_t n, double* out) {
  __shared__ double part[kThreads];
  double s = 0;
  K2C_FOR_EACH(i, n) s += static_cast<double>(x[i]) * x[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, part[0]);
}

// A block's sum of one value per thread, returned to every thread.
__device__ float block_sum(float v, float* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) scratch[threadIdx.x] += scratch[threadIdx.x + w];
    __syncthreads();
  }
  const float total = scratch[0];
  __syncthreads();
  return total;
}
__device__ float block_max(float v, float* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + w]);
    __syncthreads();
  }
  const float m = scratch[0];
  __syncthreads();
  return m;
}

__global__ void embedding_forward_kernel(const int* ids, const float* table, float* out, std::int64_t n, std::int64_t d,
                                         std::int64_t vocab, int* bad) {
  K2C_FOR_EACH(i, n * d) {
    const int id = ids[i / d];
    if (id < 0 || id >= vocab) {
      *bad = 1;
      continue;
    }
    out[i] = table[id * d + i % d];
  }
}
__global__ void embedding_backward_kernel(const int* ids, const float* dout, float* dtable, std::int64_t n, std::int64_t d) {
  K2C_FOR_EACH(i, n * d) atomicAdd(&dtable[ids[i / d] * d + i % d], dout[i]);
}

__global__ void rmsnorm_forward_kernel(const float* x, const float* g, float eps, float* y, float* rstd, std::int64_t cols) {
  __shared__ float scratch[kThreads];
  const float* xr = x + blockIdx.x * cols;
  float ss = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) ss += xr[j] * xr[j];
  const float rs = rsqrtf(block_sum(ss, scratch) / cols + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) y[blockIdx.x * cols + j] = xr[j] * rs * g[j];
}
// residual (may be null) is added to dx in the same pass.
__global__ void rmsnorm_backward_kernel(const float* x, const float* g, const float* rstd, const float* dy,
                                        const float* residual, float* dx, std::int64_t cols) {
  __shared__ float scratch[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  const float rs = rstd[blockIdx.x];
  float c = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) c += g[j] * dy[o + j] * x[o + j];
  c = block_sum(c, scratch) / cols;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float d = rs * (g[j] * dy[o + j] - x[o + j] * rs * rs * c);
    dx[o + j] = residual ? d + residual[o + j] : d;
  }
}
// dgamma += Σ_rows dy·x·rstd: a thread a column over a run of kRowRun rows (neighbouring threads
// read neighbouring columns), one atomic per thread and run rather than one per element.
constexpr int kRowRun = 256;
__global__ void rmsnorm_dgamma_kernel(const float* x, const float* rstd, const float* dy, float* dg, std::int64_t rows,
                                      std::int64_t cols) {
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  const std::int64_t r0 = blockIdx.y * static_cast<std::int64_t>(kRowRun), r1 = min(rows, r0 + kRowRun);
  float acc = 0;
  for (std::int64_t r = r0; r < r1; ++r) acc += dy[r * cols + j] * x[r * cols + j] * rstd[r];
  atomicAdd(&dg[j], acc);
}

// One thread a (row, pair) for every head of the row: the angle (computed in double, as the CPU
// backend does) depends on the position and the pair only, so it is computed once, not per head.
__global__ void rope_kernel(float* x, const int* pos, std::int64_t rows, int T, int heads, int hd, float theta, bool inverse) {
  const int half = hd / 2;
  K2C_FOR_EACH(e, rows * half) {
    const std::int64_t r = e / half;
    const int i = static_cast<int>(e % half);
    const double angle = pos[r % T] * pow(static_cast<double>(theta), -2.0 * i / hd);
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(inverse ? -sin(angle) : sin(angle));
    for (int h = 0; h < heads; ++h) {
      float* p = x + r * heads * hd + static_cast<std::int64_t>(h) * hd;
      const float x0 = p[i], x1 = p[i + half];
      p[i] = x0 * c - x1 * s;
      p[i + half] = x0 * s + x1 * c;
    }
  }
}

// The fast form, where head_dim is a multiple of 8 and x 16-byte aligned: the angles' cosines and
// sines are computed once per call into a table of [T][head_dim/2] (in double, as above), and a
// thread rotates four pairs of one head with two float4 loads. The loop above has a thread walk
// the heads one after another with 4-byte accesses, which keeps too few bytes in flight to reach
// the memory's rate; same arithmetic, same results.
__global__ void rope_table_kernel(float2* cs, const int* pos, int T, int hd, float theta, bool inverse) {
  const int half = hd / 2;
  K2C_FOR_EACH(e, static_cast<std::int64_t>(T) * half) {
    const int i = static_cast<int>(e % half);
    const double angle = pos[e / half] * pow(static_cast<double>(theta), -2.0 * i / hd);
    cs[e] = make_float2(static_cast<float>(cos(angle)), static_cast<float>(inverse ? -sin(angle) : sin(angle)));
  }
}
__global__ void rope4_kernel(float* x, const float2* cs, std::int64_t rows, int T, int heads, int hd) {
  const int half = hd / 2, quads = half / 4;
  K2C_FOR_EACH(e, rows * heads * quads) {
    const std::int64_t r = e / (static_cast<std::int64_t>(heads) * quads);
    const int h = static_cast<int>(e / quads % heads), i = static_cast<int>(e % quads) * 4;
    float* p = x + (r * heads + h) * hd + i;
    const float2* c = cs + (r % T) * half + i;
    float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + half);
    const float2 c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
    const float4 a2 = make_float4(a.x * c0.x - b.x * c0.y, a.y * c1.x - b.y * c1.y, a.z * c2.x - b.z * c2.y, a.w * c3.x - b.w * c3.y);
    b = make_float4(a.x * c0.y + b.x * c0.x, a.y * c1.y + b.y * c1.x, a.z * c2.y + b.z * c2.x, a.w * c3.y + b.w * c3.x);
    *reinterpret_cast<float4*>(p) = a2;
    *reinterpret_cast<float4*>(p + half) = b;
  }
}

// One block per (query, head, batch): scores into shared memory (kv_len floats), then the
// softmax and the weighted sum. Memory for kv_len scores limits this version to short sequences
// per block (48 KB: 12k keys), ample for tests; the tiled kernel replaces it for real lengths.
struct AttnArgs {
  int batch, q_len, kv_len, q_heads, kv_heads, hd;
  bool causal;
  long long q_offset, kv_offset;
  float scale;
};
__device__ bool visible(const AttnArgs& a, int i, int j) { return !a.causal || a.kv_offset + j <= a.q_offset + i; }
__device__ const float* head_row(const float* t, const AttnArgs& a, int b, int tok, int h, int heads, int len) {
  return t + ((static_cast<std::int64_t>(b) * len + tok) * heads + h) * a.hd;
}

__global__ void attention_forward_kernel(AttnArgs a, const float* q, const float* k, const float* v, float* o, float* lse) {
  extern __shared__ float p[];
  __shared__ float scratch[kThreads];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kh = h / (a.q_heads / a.kv_heads);
  const float* qi = head_row(q, a, b, i, h, a.q_heads, a.q_len);
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < a.kv_len; j += blockDim.x) {
    float s = -INFINITY;
    if (visible(a, i, j)) {
      const float* kj = head_row(k, a, b, j, kh, a.kv_heads, a.kv_len);
      s = 0;
      for (int d = 0; d < a.hd; ++d) s += qi[d] * kj[d];
      s *= a.scale;
    }
    p[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_max(mx, scratch);
  float* oi = o + ((static_cast<std::int64_t>(b) * a.q_len + i) * a.q_heads + h) * a.hd;
  float& l = lse[(static_cast<std::int64_t>(b) * a.q_heads + h) * a.q_len + i];
  if (mx == -INFINITY) {  // sees no key
    for (int d = threadIdx.x; d < a.hd; d += blockDim.x) oi[d] = 0;
    if (threadIdx.x == 0) l = -INFINITY;
    return;
  }
  float sum = 0;
  for (int j = threadIdx.x; j < a.kv_len; j += blockDim.x) sum += p[j] == -INFINITY ? 0.0f : expf(p[j] - mx);
  const float total = block_sum(sum, scratch), lse_i = mx + logf(total);
  for (int j = threadIdx.x; j < a.kv_len; j += blockDim.x) p[j] = p[j] == -INFINITY ? 0.0f : expf(p[j] - lse_i);
  __syncthreads();
  for (int d = threadIdx.x; d < a.hd; d += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < a.kv_len; ++j) acc += p[j] * head_row(v, a, b, j, kh, a.kv_heads, a.kv_len)[d];
    oi[d] = acc;
  }
  if (threadIdx.x == 0) l = lse_i;
}

// Same blocks: P recomputed from lse, D_i = dO_i·O_i, dS = P(dP − D); dq written, dk and dv added
// with atomics (several queries and heads share a key).
__global__ void attention_backward_kernel(AttnArgs a, const float* q, const float* k, const float* v, const float* o,
                                          const float* lse, const float* dout, float* dq, float* dk, float* dv) {
  extern __shared__ float ds[];
  __shared__ float scratch[kThreads];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kh = h / (a.q_heads / a.kv_heads);
  const float* qi = head_row(q, a, b, i, h, a.q_heads, a.q_len);
  const float* doi = head_row(dout, a, b, i, h, a.q_heads, a.q_len);
  float* dqi = dq + ((static_cast<std::int64_t>(b) * a.q_len + i) * a.q_heads + h) * a.hd;
  const float l = lse[(static_cast<std::int64_t>(b) * a.q_heads + h) * a.q_len + i];
  if (l == -INFINITY) {
    for (int d = threadIdx.x; d < a.hd; d += blockDim.x) dqi[d] = 0;
    return;
  }
  float di = 0;
  for (int d = threadIdx.x; d < a.hd; d += blockDim.x) di += doi[d] * head_row(o, a, b, i, h, a.q_heads, a.q_len)[d];
  di = block_sum(di, scratch);
  for (int j = threadIdx.x; j < a.kv_len; j += blockDim.x) {
    float s = 0;
    if (visible(a, i, j)) {
      const float* kj = head_row(k, a, b, j, kh, a.kv_heads, a.kv_len);
      const float* vj = head_row(v, a, b, j, kh, a.kv_heads, a.kv_len);
      float qk = 0, dov = 0;
      for (int d = 0; d < a.hd; ++d) qk += qi[d] * kj[d], dov += doi[d] * vj[d];
      const float pij = expf(a.scale * qk - l);
      s = pij * (dov - di);
      float* dvj = dv + ((static_cast<std::int64_t>(b) * a.kv_len + j) * a.kv_heads + kh) * a.hd;
      float* dkj = dk + ((static_cast<std::int64_t>(b) * a.kv_len + j) * a.kv_heads + kh) * a.hd;
      for (int d = 0; d < a.hd; ++d) {
        atomicAdd(&dvj[d], pij * doi[d]);
        atomicAdd(&dkj[d], a.scale * s * qi[d]);
      }
    }
    ds[j] = s;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < a.hd; d += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < a.kv_len; ++j) acc += ds[j] * head_row(k, a, b, j, kh, a.kv_heads, a.kv_len)[d];
    dqi[d] = a.scale * acc;
  }
}

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoid(g) * u; }
__device__ __forceinline__ void swiglu_grad(float g, float u, float dh, float& dg, float& du) {
  const float s = sigmoid(g);
  dg = dh * u * s * (1.0f + g * (1.0f - s));
  du = dh * g * s;
}
__global__ void swiglu_forward_kernel(const float* g, const float* u, float* h, std::int64_t n) {
  K2C_FOR_EACH(i, n) h[i] = swiglu(g[i], u[i]);
}
__global__ void swiglu_backward_kernel(const float* g, const float* u, const float* dh, float* dg, float* du, std::int64_t n) {
  K2C_FOR_EACH(i, n) swiglu_grad(g[i], u[i], dh[i], dg[i], du[i]);
}
__global__ void swiglu_forward4_kernel(const float4* g, const float4* u, float4* h, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    const float4 a = g[i], b = u[i];
    h[i] = make_float4(swiglu(a.x, b.x), swiglu(a.y, b.y), swiglu(a.z, b.z), swiglu(a.w, b.w));
  }
}
__global__ void swiglu_backward4_kernel(const float4* g, const float4* u, const float4* dh, float4* dg, float4* du,
                                        std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    const float4 a = g[i], b = u[i], d = dh[i];
    float4 x, y;
    swiglu_grad(a.x, b.x, d.x, x.x, y.x);
    swiglu_grad(a.y, b.y, d.y, x.y, y.y);
    swiglu_grad(a.z, b.z, d.z, x.z, y.z);
    swiglu_grad(a.w, b.w, d.w, x.w, y.w);
    dg[i] = x;
    du[i] = y;
  }
}

// Online softmax (as in FlashAttention): fold x into a running (max m, sum s of exp(· − m)).
__device__ __forceinline__ void lse_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;
    m = x;
  } else if (x != -INFINITY) {  // (−inf − −inf would be NaN)
    s += expf(x - m);
  }
}
// Two running pairs merged; a pair that saw nothing is (−inf, 0).
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}
// The block's (max, sum) pair, returned to every thread: warps by shuffles, then the warps' pairs.
__device__ void block_lse(float& m, float& s) {
  __shared__ float wm[kThreads / 32], ws[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  if (threadIdx.x % 32 == 0) wm[threadIdx.x / 32] = m, ws[threadIdx.x / 32] = s;
  __syncthreads();
  m = wm[0], s = ws[0];
  for (int w = 1; w < kThreads / 32; ++w) lse_merge(m, s, wm[w], ws[w]);
  __syncthreads();
}

// One block a row, two passes over the logits instead of three: the log-sum-exp in one online
// pass, then the gradient (the row is 128 KiB at a 32k vocabulary, so the second read mostly hits
// L2). Rows of a multiple of 4 go a float4 at a time (the caller checks the alignment).
template <bool kVec4>
__global__ void cross_entropy_kernel(const float* z, const int* t, float scale, float* dz, double* loss, std::int64_t cols,
                                     int* bad) {
  const std::int64_t o = blockIdx.x * cols;
  const int target = t[blockIdx.x];
  if (target < 0 || target >= cols) {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) dz[o + j] = 0;
    if (threadIdx.x == 0) {
      loss[blockIdx.x] = 0;
      if (target >= cols) *bad = 1;
    }
    return;
  }
  float m = -INFINITY, s = 0;
  if constexpr (kVec4) {
    const float4* z4 = reinterpret_cast<const float4*>(z + o);
    for (std::int64_t j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 v = z4[j];
      lse_add(m, s, v.x), lse_add(m, s, v.y), lse_add(m, s, v.z), lse_add(m, s, v.w);
    }
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) lse_add(m, s, z[o + j]);
  }
  block_lse(m, s);
  const float lse = m + logf(s);
  if constexpr (kVec4) {
    const float4* z4 = reinterpret_cast<const float4*>(z + o);
    float4* d4 = reinterpret_cast<float4*>(dz + o);
    for (std::int64_t j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 v = z4[j];
      float4 g = make_float4(scale * expf(v.x - lse), scale * expf(v.y - lse), scale * expf(v.z - lse), scale * expf(v.w - lse));
      d4[j] = g;
    }
    __syncthreads();  // the target's element is corrected after every thread has written its own
    if (threadIdx.x == 0) dz[o + target] = scale * (expf(z[o + target] - lse) - 1.0f);
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      dz[o + j] = scale * (expf(z[o + j] - lse) - (j == target ? 1.0f : 0.0f));
  }
  if (threadIdx.x == 0) loss[blockIdx.x] = static_cast<double>(lse) - z[o + target];
}

__global__ void dropout_kernel(const float* x, float* y, std::int64_t rows, std::int64_t cols, float p,
                               unsigned long long seed, unsigned long long step, unsigned long long layer,
                               long long row_offset, long long col_offset, long long full_cols) {
  K2C_FOR_EACH(e, rows * cols) {
    const std::int64_t r = e / cols, c = e % cols;
    const std::uint64_t index = static_cast<std::uint64_t>((row_offset + r) * full_cols + col_offset + c);
    y[e] = x[e] * mask::scale(seed, step, layer, index, p);
  }
}

__global__ void sgd_kernel(float* p, const float* g, float* m, float lr, float beta, float wd, std::int64_t n) {
  K2C_FOR_EACH(i, n) {
    float d = g[i] + wd * p[i];
    if (m) d = m[i] = beta * m[i] + d;
    p[i] -= lr * d;
  }
}
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, float lr, float b1, float b2, float eps,
                             float wd, float c1, float c2, std::int64_t n) {
  K2C_FOR_EACH(i, n) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    p[i] -= lr * (wd * p[i] + (m[i] / c1) / (sqrtf(v[i] / c2) + eps));
  }
}

__global__ void softmax_kernel(const float* x, float* y, std::int64_t cols) {
  __shared__ float scratch[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) mx = fmaxf(mx, x[o + j]);
  mx = block_max(mx, scratch);
  float s = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += expf(x[o + j] - mx);
  const float total = block_sum(s, scratch);
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) y[o + j] = expf(x[o + j] - mx) / total;
}
__global__ void softmax_backward_kernel(const float* y, const float* dy, float* dx, std::int64_t cols) {
  __shared__ float scratch[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  float d = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) d += y[o + j] * dy[o + j];
  d = block_sum(d, scratch);
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) dx[o + j] = y[o + j] * (dy[o + j] - d);
}

// One thread a row: the router's rows are short (tens of experts). Ties go to the lower index,
// as on the CPU (a stable sort by decreasing score).
__global__ void top_k_kernel(const float* s, int* idx, float* val, std::int64_t rows, int cols, int k) {
  K2C_FOR_EACH(r, rows) {
    const float* row = s + r * cols;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int c = 0; c < cols; ++c) {
        bool taken = false;
        for (int t = 0; t < j; ++t) taken |= idx[r * k + t] == c;
        if (!taken && (best < 0 || row[c] > row[best])) best = c;
      }
      idx[r * k + j] = best;
      val[r * k + j] = row[best];
    }
  }
}

__global__ void gather_rows_kernel(const float* src, const int* rows, float* out, std::int64_t n, std::int64_t d,
                                   std::int64_t src_rows, int* bad) {
  K2C_FOR_EACH(e, n * d) {
    const int r = rows[e / d];
    if (r < 0 || r >= src_rows) {
      *bad = 1;
      continue;
    }
    out[e] = src[r * d + e % d];
  }
}
__global__ void scatter_add_rows_kernel(const float* src, const int* rows, const float* scale, float* out, std::int64_t n,
                                        std::int64_t d, std::int64_t out_rows, int* bad) {
  K2C_FOR_EACH(e, n * d) {
    const int r = rows[e / d];
    if (r < 0 || r >= out_rows) {
      *bad = 1;
      continue;
    }
    atomicAdd(&out[r * d + e % d], (scale ? scale[e / d] : 1.0f) * src[e]);
  }
}
__global__ void row_dot_kernel(const float* a, const float* b, float* out, std::int64_t cols) {
  __shared__ float scratch[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  float s = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += a[o + j] * b[o + j];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}
__global__ void scale_rows_kernel(float* x, const float* s, std::int64_t rows, std::int64_t cols) {
  K2C_FOR_EACH(e, rows * cols) x[e] *= s[e / cols];
}

#include "cuda_attention.cuh"
#include "cuda_flash.cuh"

// ---------------------------------------------------------------------------------------------
// the backend

class CudaOps final : public Ops {
 public:
  explicit CudaOps(GpuMath math) : math_(math) {
    K2C_CUBLAS_CHECK(cublasCreate(&blas_));
    // fp32 mode: plain fp32 products, as the CPU backend computes them (no TF32).
    K2C_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
    K2C_CUDA_CHECK(cudaMalloc(&flag_, sizeof(int)));
    K2C_CUDA_CHECK(cudaMalloc(&sum_, sizeof(double)));
  }
  ~CudaOps() override {
    cublasDestroy(blas_);
    cudaFree(flag_);
    cudaFree(sum_);
  }
  std::string name() const override { return math_ == GpuMath::bf16 ? "cuda (bf16 tensor cores)" : "cuda (fp32)"; }
  Memory& memory() override { return device_; }

  void upload(Tensor& dst, const void* host) override {
    K2C_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), host, dst.bytes(), cudaMemcpyHostToDevice, g_stream));
    K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));  // the caller may reuse `host` at once
  }
  void download(void* host, const Tensor& src) override {
    K2C_CUDA_CHECK(cudaMemcpyAsync(host, src.raw(), src.bytes(), cudaMemcpyDeviceToHost, g_stream));
    K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  }

  void fill(Tensor& t, float v) override {
    if (vectorizable(t.numel(), {t.raw()})) launch(fill4_kernel, t.numel() / 4, f4(t), t.numel() / 4, v);
    else launch(fill_kernel, t.numel(), t.f32(), t.numel(), v);
  }
  void copy(Tensor& dst, const Tensor& src) override {
    if (dst.numel() != src.numel() || dst.dtype() != src.dtype())
      throw std::invalid_argument("copy: " + src.shape().str() + " into " + dst.shape().str());
    K2C_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(), cudaMemcpyDeviceToDevice, g_stream));
  }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override {
    same_shape(a, b, "add");
    same_shape(a, out, "add");
    if (vectorizable(a.numel(), {a.raw(), b.raw(), out.raw()}))
      launch(add4_kernel, a.numel() / 4, f4(a), f4(b), f4(out), a.numel() / 4);
    else
      launch(add_kernel, a.numel(), a.f32(), b.f32(), out.f32(), a.numel());
  }
  void accumulate(Tensor& acc, const Tensor& x, float s) override {
    same_shape(acc, x, "accumulate");
    if (vectorizable(x.numel(), {acc.raw(), x.raw()})) launch(axpy4_kernel, x.numel() / 4, f4(acc), f4(x), s, x.numel() / 4);
    else launch(axpy_kernel, x.numel(), acc.f32(), x.f32(), s, x.numel());
  }
  void scale(Tensor& t, float s) override {
    if (vectorizable(t.numel(), {t.raw()})) launch(scale4_kernel, t.numel() / 4, f4(t), s, t.numel() / 4);
    else launch(scale_kernel, t.numel(), t.f32(), s, t.numel());
  }
  double sum_squares(const Tensor& t) override {
    K2C_CUDA_CHECK(cudaMemsetAsync(sum_, 0, sizeof(double), g_stream));
    launch(sum_squares_kernel, t.numel(), t.f32(), t.numel(), sum_);
    double s = 0;
    K2C_CUDA_CHECK(cudaMemcpyAsync(&s, sum_, sizeof s, cudaMemcpyDeviceToHost, g_stream));
    K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
    return s;
  }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    const auto [M, N, K] = checks::gemm_dims(a, ta, b, tb, c);
    const Matrix ma = as_matrix(a), mb = as_matrix(b);
    if (M == 0 || N == 0) return;
    if (K == 0) {  // cuBLAS leaves C alone when K is 0; the contract is c = beta·c
      if (beta == 0.0f) fill(c, 0.0f);
      else scale(c, beta);
      return;
    }
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    if (math_ == GpuMath::bf16) {
      gemm16(to_bf16(a, ws_, kGemmA), ta, ma.cols, to_bf16(b, ws_, kGemmB), tb, mb.cols, c, M, N, K, alpha, beta);
      return;
    }
    // Row-major C (M×N) is column-major Cᵀ (N×M) = op(B)ᵀ·op(A)ᵀ: swap the operands, keep the ops.
    K2C_CUBLAS_CHECK(cublasSgemm(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, b.f32(),
                                 static_cast<int>(mb.cols), a.f32(), static_cast<int>(ma.cols), &beta, c.f32(),
                                 static_cast<int>(N)));
  }

  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw, Tensor* dx) override {
    if (math_ != GpuMath::bf16) return Ops::linear_backward(x, w, dy, dw, dx);
    // dy rounded once for both products; checked as the two matmul calls would be.
    const Matrix mx = as_matrix(x), mw = as_matrix(w), my = as_matrix(dy);
    if (dw) checks::gemm_dims(dy, true, x, false, *dw);
    if (dx) checks::gemm_dims(dy, false, w, false, *dx);
    if (my.rows == 0 || my.cols == 0 || mx.cols == 0 || mw.cols == 0 || (!dw && !dx))
      return Ops::linear_backward(x, w, dy, dw, dx);  // an empty product: matmul's rules for it
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16* dy16 = to_bf16(dy, ws_, kLinearDy);
    if (dw) gemm16(dy16, true, my.cols, to_bf16(x, ws_, kGemmB), false, mx.cols, *dw, my.cols, mx.cols, my.rows, 1.0f, 1.0f);
    if (dx) gemm16(dy16, false, my.cols, to_bf16(w, ws_, kGemmB), false, mw.cols, *dx, my.rows, mw.cols, my.cols, 1.0f, 0.0f);
  }

  void shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) override {
    if (math_ != GpuMath::bf16 || ws.size() != ys.size()) return Ops::shared_linear_forward(x, ws, ys);
    const Matrix mx = as_matrix(x);
    for (std::size_t i = 0; i < ws.size(); ++i) checks::gemm_dims(x, false, *ws[i], true, *ys[i]);
    if (mx.rows == 0 || mx.cols == 0) return Ops::shared_linear_forward(x, ws, ys);  // matmul's rules
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16* x16 = to_bf16(x, ws_, kGemmA);  // once for every projection
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const std::int64_t N = as_matrix(*ws[i]).rows;
      if (N > 0) gemm16(x16, false, mx.cols, to_bf16(*ws[i], ws_, kGemmB), true, mx.cols, *ys[i], mx.rows, N, mx.cols, 1.0f, 0.0f);
    }
  }
  void shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                              std::span<Tensor* const> dws, Tensor* dx) override {
    if (math_ != GpuMath::bf16 || ws.size() != dys.size() || ws.size() != dws.size())
      return Ops::shared_linear_backward(x, ws, dys, dws, dx);
    const Matrix mx = as_matrix(x);
    bool empty = mx.rows == 0 || mx.cols == 0;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      if (dws[i]) checks::gemm_dims(*dys[i], true, x, false, *dws[i]);
      if (dx) checks::gemm_dims(*dys[i], false, *ws[i], false, *dx);
      empty = empty || as_matrix(*dys[i]).cols == 0;
    }
    if (empty || ws.empty()) return Ops::shared_linear_backward(x, ws, dys, dws, dx);  // matmul's rules
    K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
    const __nv_bfloat16* x16 = nullptr;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const Matrix my = as_matrix(*dys[i]);
      const __nv_bfloat16* dy16 = to_bf16(*dys[i], ws_, kLinearDy);  // once for both of its products
      if (dws[i]) {
        if (!x16) x16 = to_bf16(x, ws_, kGemmA);  // once for every weight gradient
        gemm16(dy16, true, my.cols, x16, false, mx.cols, *dws[i], my.cols, mx.cols, my.rows, 1.0f, 1.0f);
      }
      if (dx)
        gemm16(dy16, false, my.cols, to_bf16(*ws[i], ws_, kGemmB), false, mx.cols, *dx, my.rows, mx.cols, my.cols, 1.0f,
               i == 0 ? 0.0f : 1.0f);
    }
  }

  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) override {
    const Matrix t = as_matrix(table);
    out.expect({ids.numel(), t.cols}, "embedding output");
    clear_flag();
    launch(embedding_forward_kernel, ids.numel() * t.cols, ids.i32(), table.f32(), out.f32(), ids.numel(), t.cols, t.rows,
           flag_);
    if (flag_set()) throw std::out_of_range("embedding: an id outside [0, " + std::to_string(t.rows) + ")");
  }
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) override {
    const Matrix t = as_matrix(dtable);
    dout.expect({ids.numel(), t.cols}, "embedding output gradient");
    launch(embedding_backward_kernel, ids.numel() * t.cols, ids.i32(), dout.f32(), dtable.f32(), ids.numel(), t.cols);
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& y, Tensor& rstd) override {
    const Matrix m = as_matrix(x);
    gamma.expect({m.cols}, "rmsnorm gamma");
    same_shape(x, y, "rmsnorm");
    rstd.expect({m.rows}, "rmsnorm rstd");
    if (m.rows) rmsnorm_forward_kernel<<<rows_grid(m.rows), kThreads, 0, g_stream>>>(x.f32(), gamma.f32(), eps, y.f32(), rstd.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dgamma) override {
    rmsnorm_backward_into(x, gamma, rstd, dy, nullptr, dx, dgamma);
  }
  void rmsnorm_backward_add(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                            const Tensor& residual_dy, Tensor& dx, Tensor& dgamma) override {
    same_shape(x, residual_dy, "rmsnorm backward (residual gradient)");
    rmsnorm_backward_into(x, gamma, rstd, dy, &residual_dy, dx, dgamma);
  }
  void rmsnorm_backward_into(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                             const Tensor* residual_dy, Tensor& dx, Tensor& dgamma) {
    const Matrix m = as_matrix(x);
    same_shape(x, dy, "rmsnorm backward");
    same_shape(x, dx, "rmsnorm backward");
    dgamma.expect({m.cols}, "rmsnorm dgamma");
    gamma.expect({m.cols}, "rmsnorm gamma");
    rstd.expect({m.rows}, "rmsnorm rstd");
    if (m.rows == 0) return;
    rmsnorm_backward_kernel<<<rows_grid(m.rows), kThreads, 0, g_stream>>>(
        x.f32(), gamma.f32(), rstd.f32(), dy.f32(), residual_dy ? residual_dy->f32() : nullptr, dx.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
    const dim3 grid(static_cast<unsigned>((m.cols + kThreads - 1) / kThreads),
                    static_cast<unsigned>((m.rows + kRowRun - 1) / kRowRun));
    rmsnorm_dgamma_kernel<<<grid, kThreads, 0, g_stream>>>(x.f32(), rstd.f32(), dy.f32(), dgamma.f32(), m.rows, m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }

  void rope(Tensor& x, const Tensor& positions, int heads, int head_dim, float theta, bool inverse) override {
    const Matrix m = as_matrix(x);
    const std::int64_t T = positions.numel();
    if (head_dim % 2 || m.cols != static_cast<std::int64_t>(heads) * head_dim || T == 0 || m.rows % T)
      throw std::invalid_argument("rope: x " + x.shape().str() + " is not [batch*" + std::to_string(T) + ", " +
                                  std::to_string(heads) + "*" + std::to_string(head_dim) + "] with an even head_dim");
    if (head_dim % 8 == 0 && vectorizable(m.rows * m.cols, {x.raw()})) {
      auto* cs = static_cast<float2*>(ws_.get(kRope, static_cast<std::size_t>(T) * (head_dim / 2) * sizeof(float2)));
      launch(rope_table_kernel, T * (head_dim / 2), cs, positions.i32(), static_cast<int>(T), head_dim, theta, inverse);
      launch(rope4_kernel, m.rows * heads * (head_dim / 8), x.f32(), static_cast<const float2*>(cs), m.rows,
             static_cast<int>(T), heads, head_dim);
      return;
    }
    launch(rope_kernel, m.rows * (head_dim / 2), x.f32(), positions.i32(), m.rows, static_cast<int>(T), heads,
           head_dim, theta, inverse);
  }

  void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                         Tensor& lse) override {
    checks::attention_args(s, q, k, v);
    o.expect(q.shape(), "attention output");
    lse.expect({s.batch, s.q_heads, s.q_len}, "attention lse");
    if (s.q_len == 0) return;
    if (math_ == GpuMath::bf16 && flash_fits(s)) {
      flash_.forward(s, q, k, v, o, lse);
      return;
    }
    if (math_ == GpuMath::bf16 && blocked_attention_fits(s)) {
      K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
      attention_.forward(s, q, k, v, o, lse);
      return;
    }
    const dim3 grid(s.q_len, s.q_heads, s.batch);
    attention_forward_kernel<<<grid, kThreads, score_bytes(s), g_stream>>>(args(s), q.f32(), k.f32(), v.f32(), o.f32(), lse.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }
  void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) override {
    checks::attention_backward_args(s, q, k, v, o, lse, dout, dq, dk, dv);
    if (s.q_len == 0) return;
    if (math_ == GpuMath::bf16 && flash_fits(s)) {
      flash_.backward(s, q, k, v, o, lse, dout, dq, dk, dv);
      return;
    }
    if (math_ == GpuMath::bf16 && blocked_attention_fits(s)) {
      K2C_CUBLAS_CHECK(cublasSetStream(blas_, g_stream));
      attention_.backward(s, q, k, v, o, lse, dout, dq, dk, dv);
      return;
    }
    const dim3 grid(s.q_len, s.q_heads, s.batch);
    attention_backward_kernel<<<grid, kThreads, score_bytes(s), g_stream>>>(args(s), q.f32(), k.f32(), v.f32(), o.f32(), lse.f32(),
                                                                  dout.f32(), dq.f32(), dk.f32(), dv.f32());
    K2C_CUDA_CHECK_LAUNCH();
  }

  void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& h) override {
    same_shape(g, u, "swiglu");
    same_shape(g, h, "swiglu");
    if (vectorizable(g.numel(), {g.raw(), u.raw(), h.raw()}))
      launch(swiglu_forward4_kernel, g.numel() / 4, f4(g), f4(u), f4(h), g.numel() / 4);
    else
      launch(swiglu_forward_kernel, g.numel(), g.f32(), u.f32(), h.f32(), g.numel());
  }
  void swiglu_backward(const Tensor& g, const Tensor& u, const Tensor& dh, Tensor& dg, Tensor& du) override {
    same_shape(g, u, "swiglu backward");
    same_shape(g, dh, "swiglu backward");
    same_shape(g, dg, "swiglu backward");
    same_shape(g, du, "swiglu backward");
    if (vectorizable(g.numel(), {g.raw(), u.raw(), dh.raw(), dg.raw(), du.raw()}))
      launch(swiglu_backward4_kernel, g.numel() / 4, f4(g), f4(u), f4(dh), f4(dg), f4(du), g.numel() / 4);
    else
      launch(swiglu_backward_kernel, g.numel(), g.f32(), u.f32(), dh.f32(), dg.f32(), du.f32(), g.numel());
  }

  double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& dlogits) override {
    const Matrix m = as_matrix(logits);
    targets.expect({m.rows}, "cross-entropy targets", DType::i32);
    same_shape(logits, dlogits, "cross-entropy gradient");
    if (m.rows == 0) return 0;
    auto* losses = static_cast<double*>(ws_.get(kLosses, m.rows * sizeof(double)));
    clear_flag();
    if (vectorizable(m.cols, {logits.raw(), dlogits.raw()}))
      cross_entropy_kernel<true><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(logits.f32(), targets.i32(), grad_scale,
                                                                              dlogits.f32(), losses, m.cols, flag_);
    else
      cross_entropy_kernel<false><<<rows_grid(m.rows), kThreads, 0, g_stream>>>(logits.f32(), targets.i32(), grad_scale,
                                                                               dlogits.f32(), losses, m.cols, flag_);
    K2C_CUDA_CHECK_LAUNCH();
    std::vector<double> host(static_cast<std::size_t>(m.rows));
    K2C_CUDA_CHECK(cudaMemcpyAsync(host.data(), losses, host.size() * sizeof(double), cudaMemcpyDeviceToHost, g_stream));
    K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
    if (flag_set())
      throw std::out_of_range("cross-entropy: a target outside [0, " + std::to_string(m.cols) + ")");
    double total = 0;  // summed on the host in row order, like the CPU backend
    for (double l : host) total += l;
    return total;
  }

  void dropout(const Tensor& x, float p, const DropoutKey& key, Tensor& out) override {
    same_shape(x, out, "dropout");
    if (!(p >= 0.0f && p < 1.0f)) throw std::invalid_argument("dropout: p must be in [0, 1)");
    const Matrix m = as_matrix(x);
    launch(dropout_kernel, x.numel(), x.f32(), out.f32(), m.rows, m.cols, p, key.seed, key.step, key.layer,
           key.row_offset, key.col_offset, key.full_cols < 0 ? m.cols : key.full_cols);
  }

  void softmax_rows(const Tensor& x, Tensor& y) override {
    same_shape(x, y, "softmax");
    const Matrix m = as_matrix(x);
    if (m.cols == 0 && m.rows > 0) throw std::invalid_argument("softmax: rows of length 0");
    if (m.rows) softmax_kernel<<<rows_grid(m.rows), kThreads, 0, g_stream>>>(x.f32(), y.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void softmax_rows_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    same_shape(y, dy, "softmax backward");
    same_shape(y, dx, "softmax backward");
    const Matrix m = as_matrix(y);
    if (m.rows) softmax_backward_kernel<<<rows_grid(m.rows), kThreads, 0, g_stream>>>(y.f32(), dy.f32(), dx.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void top_k(const Tensor& scores, int k, Tensor& indices, Tensor& values) override {
    const Matrix m = as_matrix(scores);
    if (k < 1 || k > m.cols)
      throw std::invalid_argument("top_k: k = " + std::to_string(k) + " with " + std::to_string(m.cols) + " scores a row");
    indices.expect({m.rows, k}, "top_k indices", DType::i32);
    values.expect({m.rows, k}, "top_k values");
    launch(top_k_kernel, m.rows, scores.f32(), indices.i32(), values.f32(), m.rows, static_cast<int>(m.cols), k);
  }
  void gather_rows(const Tensor& src, const Tensor& rows, Tensor& out) override {
    const Matrix m = as_matrix(src);
    out.expect({rows.numel(), m.cols}, "gather_rows output");
    clear_flag();
    launch(gather_rows_kernel, rows.numel() * m.cols, src.f32(), rows.i32(), out.f32(), rows.numel(), m.cols, m.rows, flag_);
    if (flag_set()) throw std::out_of_range("gather_rows: a row outside the source");
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& out) override {
    const Matrix m = as_matrix(out);
    src.expect({rows.numel(), m.cols}, "scatter_add_rows source");
    if (scale) scale->expect({rows.numel()}, "scatter_add_rows scale");
    clear_flag();
    launch(scatter_add_rows_kernel, rows.numel() * m.cols, src.f32(), rows.i32(), scale ? scale->f32() : nullptr, out.f32(),
           rows.numel(), m.cols, m.rows, flag_);
    if (flag_set()) throw std::out_of_range("scatter_add_rows: a row outside the output");
  }
  void row_dot(const Tensor& a, const Tensor& b, Tensor& out) override {
    same_shape(a, b, "row_dot");
    const Matrix m = as_matrix(a);
    out.expect({m.rows}, "row_dot output");
    if (m.rows) row_dot_kernel<<<rows_grid(m.rows), kThreads, 0, g_stream>>>(a.f32(), b.f32(), out.f32(), m.cols);
    K2C_CUDA_CHECK_LAUNCH();
  }
  void scale_rows(Tensor& x, const Tensor& s) override {
    const Matrix m = as_matrix(x);
    s.expect({m.rows}, "scale_rows scale");
    launch(scale_rows_kernel, x.numel(), x.f32(), s.f32(), m.rows, m.cols);
  }

  void sgd_step(Tensor& param, const Tensor& grad, Tensor* momentum, float lr, float beta, float wd) override {
    same_shape(param, grad, "sgd");
    if (momentum) same_shape(param, *momentum, "sgd momentum");
    launch(sgd_kernel, param.numel(), param.f32(), grad.f32(), momentum ? momentum->f32() : nullptr, lr, beta, wd,
           param.numel());
  }
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float b1, float b2, float eps,
                  float wd, int t) override {
    same_shape(param, grad, "adamw");
    same_shape(param, m, "adamw");
    same_shape(param, v, "adamw");
    if (t < 1) throw std::invalid_argument("adamw: step numbers start at 1");
    const float c1 = 1.0f - static_cast<float>(std::pow(b1, t)), c2 = 1.0f - static_cast<float>(std::pow(b2, t));
    launch(adamw_kernel, param.numel(), param.f32(), grad.f32(), m.f32(), v.f32(), lr, b1, b2, eps, wd, c1, c2,
           param.numel());
  }

 private:
  // c (M×N fp32) = alpha·op(a)·op(b) + beta·c on bf16 operands (row-major, rows lda and ldb long),
  // fp32 accumulation. Row-major C is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands swap places.
  void gemm16(const __nv_bfloat16* a, bool ta, std::int64_t lda, const __nv_bfloat16* b, bool tb, std::int64_t ldb,
              Tensor& c, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, float beta) {
    K2C_CUBLAS_CHECK(cublasGemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &alpha, b, CUDA_R_16BF,
                                  static_cast<int>(ldb), a, CUDA_R_16BF, static_cast<int>(lda), &beta, c.f32(), CUDA_R_32F,
                                  static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  static float4* f4(const Tensor& t) { return reinterpret_cast<float4*>(const_cast<float*>(t.f32())); }
  template <class Kernel, class... Args>
  void launch(Kernel kernel, std::int64_t n, Args... args) {
    if (n <= 0) return;
    kernel<<<blocks_for(n), kThreads, 0, g_stream>>>(args...);
    K2C_CUDA_CHECK_LAUNCH();
  }
  static unsigned rows_grid(std::int64_t rows) {
    if (rows > 2147483647) throw std::invalid_argument("too many rows for one launch");
    return static_cast<unsigned>(rows);
  }
  static AttnArgs args(const AttentionShape& s) {
    return {s.batch, s.q_len, s.kv_len, s.q_heads, s.kv_heads, s.head_dim, s.causal, s.q_offset, s.kv_offset,
            1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  }
  static std::size_t score_bytes(const AttentionShape& s) {
    const std::size_t bytes = static_cast<std::size_t>(s.kv_len) * sizeof(float);
    if (bytes > 48 * 1024)
      throw std::invalid_argument("attention (first GPU version): at most 12288 keys a call, got " + std::to_string(s.kv_len));
    return bytes;
  }
  void clear_flag() { K2C_CUDA_CHECK(cudaMemsetAsync(flag_, 0, sizeof(int), g_stream)); }
  bool flag_set() {
    int f = 0;
    K2C_CUDA_CHECK(cudaMemcpyAsync(&f, flag_, sizeof f, cudaMemcpyDeviceToHost, g_stream));
    K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
    return f != 0;
  }

  GpuMath math_;
  DeviceMemory device_;
  cublasHandle_t blas_{};
  Workspace ws_;  // bf16 operands, score blocks, pointer arrays, per-row losses
  BlockedAttention attention_{blas_, ws_};  // head_dim a multiple of 8
  FlashAttention flash_{ws_};                // head_dim 64 or 128
  int* flag_ = nullptr;   // set by kernels that find an index out of range
  double* sum_ = nullptr;
};

}  // namespace

bool cuda_device_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

Ops& cuda_ops(GpuMath math) {
  if (math == GpuMath::fp32) {
    static CudaOps ops(GpuMath::fp32);
    return ops;
  }
  static CudaOps ops(GpuMath::bf16);
  return ops;
}

void cuda_ops_use_stream(void* stream) {
  // Work queued on the old stream must be done before the new one can reuse the memory it used
  // (the allocator's cache and the workspace rely on stream order, and two streams have none).
  if (g_stream != static_cast<cudaStream_t>(stream)) K2C_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  g_stream = static_cast<cudaStream_t>(stream);
}

}  // namespace k2c::model
