// cuda_kernels.cuh — the GPU backend's plain kernels: one thread an element (grid-stride, a
// float4 at a time where the addresses allow) or one block a row, for every operation of
// k2c/model/ops.h that is not a GEMM or the fast path's attention. The fp32 mode runs every
// operation on them; the bf16 fast path shares all but GEMMs and attention. Included by
// cuda_ops.cu only, inside its unnamed namespace (it uses that file's kThreads and blocks_for).
//
// The kernels of ops.h's [bf16] operations are templates over the element type of their
// activations, T = float or __nv_bfloat16: they load through load1/load4, which widen exactly,
// compute in fp32 and store through store1/store4, which round to nearest even.
#pragma once

#define K2C_FOR_EACH(i, n) \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

// A tensor's elements as T (the dtype checked).
template <class T>
T* ptr(const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.f32();
  } else {
    if (t.dtype() != DType::bf16) throw std::logic_error("tensor is " + to_string(t.dtype()) + ", not bf16");
    return static_cast<T*>(t.raw());
  }
}

__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store1(float* p, float v) { *p = v; }
__device__ __forceinline__ void store1(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
// Four neighbours in one access: 16 bytes of fp32 or 8 of bf16 (p aligned to that).
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void store2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
__device__ __forceinline__ void store2(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 raw;
  raw.x = *reinterpret_cast<const unsigned*>(&a);
  raw.y = *reinterpret_cast<const unsigned*>(&b);
  *reinterpret_cast<uint2*>(p) = raw;
}

// bf16 <-> fp32 copies: the GPU backend's fallback for a bf16 tensor where a kernel takes fp32
// only (CudaOps::Wide).
__global__ void widen_kernel(const __nv_bfloat16* x, float* y, std::int64_t n) { K2C_FOR_EACH(i, n) y[i] = load1(x + i); }
__global__ void narrow_kernel(const float* x, __nv_bfloat16* y, std::int64_t n) { K2C_FOR_EACH(i, n) store1(y + i, x[i]); }

template <class T>
__global__ void fill_kernel(T* p, std::int64_t n, float v) { K2C_FOR_EACH(i, n) store1(p + i, v); }
template <class A, class B, class O>  // each fp32 or bf16
__global__ void add_kernel(const A* a, const B* b, O* o, std::int64_t n) {
  K2C_FOR_EACH(i, n) store1(o + i, load1(a + i) + load1(b + i));
}
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
template <class T>
__global__ void fill4_kernel(T* p, std::int64_t n4, float v) { K2C_FOR_EACH(i, n4) store4(p + 4 * i, make_float4(v, v, v, v)); }
template <class A, class B, class O>
__global__ void add4_kernel(const A* a, const B* b, O* o, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    const float4 x = load4(a + 4 * i), y = load4(b + 4 * i);
    store4(o + 4 * i, make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
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
// An id outside the table is skipped and flagged here too: the forward's flag is reported only at
// the next wait, which may come after the backward.
__global__ void embedding_backward_kernel(const int* ids, const float* dout, float* dtable, std::int64_t n, std::int64_t d,
                                          std::int64_t vocab, int* bad) {
  K2C_FOR_EACH(i, n * d) {
    const std::int64_t id = ids[i / d];
    if (id < 0 || id >= vocab) {
      *bad = 1;
      continue;
    }
    atomicAdd(&dtable[id * d + i % d], dout[i]);
  }
}

// One block a row. y (fp32 or bf16) from x (fp32 or bf16): the residual stream in, a GEMM's
// operand out. With kVec4 (rows of a multiple of 4 from aligned starts, which the caller checks) a
// thread moves four neighbours per access: the row kernels are limited by how many bytes are in
// flight.
template <bool kVec4, class X, class Y>
__global__ void rmsnorm_forward_kernel(const X* x, const float* g, float eps, Y* y, float* rstd, std::int64_t cols) {
  __shared__ float scratch[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  float ss = 0;
  if constexpr (kVec4) {
    for (std::int64_t j = 4 * threadIdx.x; j < cols; j += 4 * blockDim.x) {
      const float4 v = load4(x + o + j);
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) ss += load1(x + o + j) * load1(x + o + j);
  }
  const float rs = rsqrtf(block_sum(ss, scratch) / cols + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  if constexpr (kVec4) {
    for (std::int64_t j = 4 * threadIdx.x; j < cols; j += 4 * blockDim.x) {
      const float4 v = load4(x + o + j), w = load4(g + j);
      store4(y + o + j, make_float4(v.x * rs * w.x, v.y * rs * w.y, v.z * rs * w.z, v.w * rs * w.w));
    }
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) store1(y + o + j, load1(x + o + j) * rs * g[j]);
  }
}
// residual (may be null) is added to dx in the same pass. dy fp32 or bf16 (a GEMM's output); x,
// the residual's gradient and dx all in the residual stream's dtype, fp32 or bf16 (S).
template <bool kVec4, class S, class DY>
__global__ void rmsnorm_backward_kernel(const S* x, const float* g, const float* rstd, const DY* dy, const S* residual,
                                        S* dx, std::int64_t cols) {
  __shared__ float scratch[kThreads];
  const std::int64_t o = blockIdx.x * cols;
  const float rs = rstd[blockIdx.x];
  float c = 0;
  if constexpr (kVec4) {
    for (std::int64_t j = 4 * threadIdx.x; j < cols; j += 4 * blockDim.x) {
      const float4 w = load4(g + j), d = load4(dy + o + j), v = load4(x + o + j);
      c += w.x * d.x * v.x + w.y * d.y * v.y + w.z * d.z * v.z + w.w * d.w * v.w;
    }
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) c += g[j] * load1(dy + o + j) * load1(x + o + j);
  }
  c = block_sum(c, scratch) / cols;
  const float k = rs * rs * c;
  if constexpr (kVec4) {
    for (std::int64_t j = 4 * threadIdx.x; j < cols; j += 4 * blockDim.x) {
      const float4 w = load4(g + j), d = load4(dy + o + j), v = load4(x + o + j);
      float4 r = make_float4(rs * (w.x * d.x - v.x * k), rs * (w.y * d.y - v.y * k), rs * (w.z * d.z - v.z * k),
                             rs * (w.w * d.w - v.w * k));
      if (residual) {
        const float4 e = load4(residual + o + j);
        r = make_float4(r.x + e.x, r.y + e.y, r.z + e.z, r.w + e.w);
      }
      store4(dx + o + j, r);
    }
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const float d = rs * (g[j] * load1(dy + o + j) - load1(x + o + j) * k);
      store1(dx + o + j, residual ? d + load1(residual + o + j) : d);
    }
  }
}
// dgamma += Σ_rows dy·x·rstd: a thread a column over a run of kRowRun rows (neighbouring threads
// read neighbouring columns), one atomic per thread and run rather than one per element. Runs of
// 64 rows make 768 blocks at 16,384 × 768, enough loads in flight; runs of 256 made 192 and left
// this pass waiting on memory (lab/results/h200.json, capstone_rmsnorm_dgamma).
constexpr int kRowRun = 64;
template <class S, class DY>
__global__ void rmsnorm_dgamma_kernel(const S* x, const float* rstd, const DY* dy, float* dg, std::int64_t rows,
                                      std::int64_t cols) {
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  const std::int64_t r0 = blockIdx.y * static_cast<std::int64_t>(kRowRun), r1 = min(rows, r0 + kRowRun);
  float acc = 0;
  for (std::int64_t r = r0; r < r1; ++r) acc += load1(dy + r * cols + j) * load1(x + r * cols + j) * rstd[r];
  atomicAdd(&dg[j], acc);
}

// One thread a (row, pair) for every head of the row: the angle (computed in double, as the CPU
// backend does) depends on the position and the pair only, so it is computed once, not per head.
template <class T_>
__global__ void rope_kernel(T_* x, const int* pos, std::int64_t rows, int T, int heads, int hd, float theta, bool inverse) {
  const int half = hd / 2;
  K2C_FOR_EACH(e, rows * half) {
    const std::int64_t r = e / half;
    const int i = static_cast<int>(e % half);
    const double angle = pos[r % T] * pow(static_cast<double>(theta), -2.0 * i / hd);
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(inverse ? -sin(angle) : sin(angle));
    for (int h = 0; h < heads; ++h) {
      T_* p = x + r * heads * hd + static_cast<std::int64_t>(h) * hd;
      const float x0 = load1(p + i), x1 = load1(p + i + half);
      store1(p + i, x0 * c - x1 * s);
      store1(p + i + half, x0 * s + x1 * c);
    }
  }
}

// The fast form, where head_dim is a multiple of 8 and x 16-byte aligned: the angles' cosines and
// sines are computed once per call into a table of [T][head_dim/2] (in double, as above), and a
// thread rotates four pairs of one head with two loads of four. The loop above has a thread walk
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
template <class T_>
__global__ void rope4_kernel(T_* x, const float2* cs, std::int64_t rows, int T, int heads, int hd) {
  const int half = hd / 2, quads = half / 4;
  K2C_FOR_EACH(e, rows * heads * quads) {
    const std::int64_t r = e / (static_cast<std::int64_t>(heads) * quads);
    const int h = static_cast<int>(e / quads % heads), i = static_cast<int>(e % quads) * 4;
    T_* p = x + (r * heads + h) * hd + i;
    const float2* c = cs + (r % T) * half + i;
    const float4 a = load4(p);
    float4 b = load4(p + half);
    const float2 c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
    const float4 a2 = make_float4(a.x * c0.x - b.x * c0.y, a.y * c1.x - b.y * c1.y, a.z * c2.x - b.z * c2.y, a.w * c3.x - b.w * c3.y);
    b = make_float4(a.x * c0.y + b.x * c0.x, a.y * c1.y + b.y * c1.x, a.z * c2.y + b.z * c2.x, a.w * c3.y + b.w * c3.x);
    store4(p, a2);
    store4(p + half, b);
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
template <class T>
__global__ void swiglu_forward_kernel(const T* g, const T* u, T* h, std::int64_t n) {
  K2C_FOR_EACH(i, n) store1(h + i, swiglu(load1(g + i), load1(u + i)));
}
template <class T>
__global__ void swiglu_backward_kernel(const T* g, const T* u, const T* dh, T* dg, T* du, std::int64_t n) {
  K2C_FOR_EACH(i, n) {
    float x, y;
    swiglu_grad(load1(g + i), load1(u + i), load1(dh + i), x, y);
    store1(dg + i, x);
    store1(du + i, y);
  }
}
template <class T>
__global__ void swiglu_forward4_kernel(const T* g, const T* u, T* h, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    const float4 a = load4(g + 4 * i), b = load4(u + 4 * i);
    store4(h + 4 * i, make_float4(swiglu(a.x, b.x), swiglu(a.y, b.y), swiglu(a.z, b.z), swiglu(a.w, b.w)));
  }
}
template <class T>
__global__ void swiglu_backward4_kernel(const T* g, const T* u, const T* dh, T* dg, T* du, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    const float4 a = load4(g + 4 * i), b = load4(u + 4 * i), d = load4(dh + 4 * i);
    float4 x, y;
    swiglu_grad(a.x, b.x, d.x, x.x, y.x);
    swiglu_grad(a.y, b.y, d.y, x.y, y.y);
    swiglu_grad(a.z, b.z, d.z, x.z, y.z);
    swiglu_grad(a.w, b.w, d.w, x.w, y.w);
    store4(dg + 4 * i, x);
    store4(du + 4 * i, y);
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
// L2). Rows of a multiple of 4 go four at a time (the caller checks the alignment). The logits
// and their gradient are T, fp32 or bf16; the sums are fp32.
template <bool kVec4, class T>
__global__ void cross_entropy_kernel(const T* z, const int* t, float scale, T* dz, double* loss, std::int64_t cols,
                                     int* bad) {
  const std::int64_t o = blockIdx.x * cols;
  const int target = t[blockIdx.x];
  if (target < 0 || target >= cols) {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) store1(dz + o + j, 0.0f);
    if (threadIdx.x == 0) {
      loss[blockIdx.x] = 0;
      if (target >= cols) *bad = 1;
    }
    return;
  }
  float m = -INFINITY, s = 0;
  if constexpr (kVec4) {
    for (std::int64_t j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 v = load4(z + o + 4 * j);
      lse_add(m, s, v.x), lse_add(m, s, v.y), lse_add(m, s, v.z), lse_add(m, s, v.w);
    }
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) lse_add(m, s, load1(z + o + j));
  }
  block_lse(m, s);
  const float lse = m + logf(s);
  const float zt = load1(z + o + target);
  if constexpr (kVec4) {
    for (std::int64_t j = threadIdx.x; j < cols / 4; j += blockDim.x) {
      const float4 v = load4(z + o + 4 * j);
      store4(dz + o + 4 * j,
             make_float4(scale * expf(v.x - lse), scale * expf(v.y - lse), scale * expf(v.z - lse), scale * expf(v.w - lse)));
    }
    __syncthreads();  // the target's element is corrected after every thread has written its own
    if (threadIdx.x == 0) store1(dz + o + target, scale * (expf(zt - lse) - 1.0f));
  } else {
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      store1(dz + o + j, scale * (expf(load1(z + o + j) - lse) - (j == target ? 1.0f : 0.0f)));
  }
  if (threadIdx.x == 0) loss[blockIdx.x] = static_cast<double>(lse) - zt;
}

// The same for bf16 rows that fit in registers (a multiple of 8 long, from 16-byte starts): the
// row is read once and kept as bits, so the gradient pass reads no memory at all. At a 32k
// vocabulary a row is 64 KiB, and the L2 holds too few rows in flight for the first kernel's
// second read to hit it every time. The max and the sum of exponentials are two reductions over
// the registers, with no branch per element. 512 threads, VECS 16-byte vectors each: rows of up
// to 4096·VECS.
constexpr int kRowThreads = 512;
template <int VECS>
__global__ void __launch_bounds__(kRowThreads) cross_entropy_rows_kernel(const __nv_bfloat16* z, const int* t, float scale,
                                                                         __nv_bfloat16* dz, double* loss, int cols, int* bad) {
  __shared__ float partial[kRowThreads / 32];
  const std::int64_t o = static_cast<std::int64_t>(blockIdx.x) * cols;
  const int target = t[blockIdx.x];
  auto at = [&](int i) { return (i * kRowThreads + static_cast<int>(threadIdx.x)) * 8; };
  auto reduce = [&](float v, auto op) {  // the block's op over one value a thread, to every thread
    for (int d = 16; d > 0; d /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, d));
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    v = partial[0];
    for (int w = 1; w < kRowThreads / 32; ++w) v = op(v, partial[w]);
    __syncthreads();  // partial is reused by the next reduction
    return v;
  };
  if (target < 0 || target >= cols) {
    for (int i = 0; i < VECS; ++i)
      if (at(i) < cols) *reinterpret_cast<uint4*>(dz + o + at(i)) = uint4{0, 0, 0, 0};
    if (threadIdx.x == 0) {
      loss[blockIdx.x] = 0;
      if (target >= cols) *bad = 1;
    }
    return;
  }
  uint4 bits[VECS];
#pragma unroll
  for (int i = 0; i < VECS; ++i)
    if (at(i) < cols) bits[i] = *reinterpret_cast<const uint4*>(z + o + at(i));
  auto element = [&](int i, int j) {  // element j of vector i, as a float
    const std::uint32_t word = (&bits[i].x)[j / 2];
    return __uint_as_float(j % 2 ? word & 0xffff0000u : word << 16);
  };
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < VECS; ++i)
    if (at(i) < cols)
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, element(i, j));
  m = reduce(m, [](float a, float b) { return fmaxf(a, b); });
  float sum = 0;
#pragma unroll
  for (int i = 0; i < VECS; ++i)
    if (at(i) < cols)
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += expf(element(i, j) - m);
  sum = reduce(sum, [](float a, float b) { return a + b; });
  const float lse = m + logf(sum);
#pragma unroll
  for (int i = 0; i < VECS; ++i) {
    if (at(i) >= cols) continue;
    uint4 g;
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(scale * expf(element(i, j) - lse), scale * expf(element(i, j + 1) - lse));
      (&g.x)[j / 2] = *reinterpret_cast<const std::uint32_t*>(&pair);
    }
    *reinterpret_cast<uint4*>(dz + o + at(i)) = g;
  }
  __syncthreads();  // the target's element is corrected after every thread has written its own
  if (threadIdx.x == 0) {
    const float zt = __bfloat162float(z[o + target]);
    dz[o + target] = __float2bfloat16(scale * (expf(zt - lse) - 1.0f));
    loss[blockIdx.x] = static_cast<double>(lse) - zt;
  }
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
// One element's AdamW update, the one formula of both kernels below. Each operation is spelled
// out as a correctly rounded intrinsic, which the compiler never fuses into an FMA: left to
// itself it fused the two kernels' copies differently, and their results differed in the last
// bit. A parameter must get the same bits whichever path its range takes (a ZeRO shard that
// starts off a 16-byte boundary takes the scalar one).
struct AdamWUpdate {
  float lr, b1, b2, eps, wd, c1, c2;
  __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
    m = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(1.0f - b1, g));
    v = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(1.0f - b2, g), g));
    const float step = __fdiv_rn(__fdiv_rn(m, c1), __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c2)), eps));
    p = __fsub_rn(p, __fmul_rn(lr, __fadd_rn(__fmul_rn(wd, p), step)));
  }
};
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, AdamWUpdate step, std::int64_t n) {
  K2C_FOR_EACH(i, n) step(p[i], g[i], m[i], v[i]);
}
// Four elements a thread: the update reads and writes seven floats an element, so the optimizer
// step is bound by memory, and 16-byte accesses reach its bandwidth where 4-byte ones do not.
__global__ void adamw4_kernel(float4* p, const float4* g, float4* m, float4* v, AdamWUpdate step, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    float4 pi = p[i], mi = m[i], vi = v[i];
    const float4 gi = g[i];
    step(pi.x, gi.x, mi.x, vi.x);
    step(pi.y, gi.y, mi.y, vi.y);
    step(pi.z, gi.z, mi.z, vi.z);
    step(pi.w, gi.w, mi.w, vi.w);
    p[i] = pi, m[i] = mi, v[i] = vi;
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

// The MoE layer's row operations (gathers into expert order, the weighted scatter back, the
// per-row dot and scale). A block per row, its threads over the row's columns: the row index is
// read once per row, the column arithmetic is 32-bit, and with kVec every thread moves four
// neighbours at a time (16 bytes of fp32, 8 of bf16), which every row start allows when the
// columns are a multiple of 4 and the pointers aligned (CudaOps::row_launch). The first versions
// took an element per thread and found its row with a 64-bit division each.
template <bool kVec, class S, class O>
__global__ void gather_rows_kernel(const S* src, const int* rows, O* out, int d, int src_rows, int* bad) {
  const int i = rows[blockIdx.x];
  if (i < 0 || i >= src_rows) {  // refused, not read
    if (threadIdx.x == 0) *bad = 1;
    return;
  }
  const S* from = src + static_cast<std::int64_t>(i) * d;
  O* to = out + static_cast<std::int64_t>(blockIdx.x) * d;
  if constexpr (kVec) {
    for (int j = 4 * threadIdx.x; j < d; j += 4 * blockDim.x) store4(to + j, load4(from + j));
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) store1(to + j, load1(from + j));
  }
}
// out[rows[r]] += scale[r]·src[r]: rows may repeat, so the adds are atomic (on Hopper four floats
// in one atomic).
__device__ __forceinline__ void atomic_add4(float* p, float4 v) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(p), v);
#else
  atomicAdd(p, v.x), atomicAdd(p + 1, v.y), atomicAdd(p + 2, v.z), atomicAdd(p + 3, v.w);
#endif
}
template <bool kVec, class S>
__global__ void scatter_add_rows_kernel(const S* src, const int* rows, const float* scale, float* out, int d,
                                        int out_rows, int* bad) {
  const int i = rows[blockIdx.x];
  if (i < 0 || i >= out_rows) {
    if (threadIdx.x == 0) *bad = 1;
    return;
  }
  const float s = scale ? scale[blockIdx.x] : 1.0f;
  const S* from = src + static_cast<std::int64_t>(blockIdx.x) * d;
  float* to = out + static_cast<std::int64_t>(i) * d;
  if constexpr (kVec) {
    for (int j = 4 * threadIdx.x; j < d; j += 4 * blockDim.x) {
      const float4 v = load4(from + j);
      atomic_add4(to + j, make_float4(s * v.x, s * v.y, s * v.z, s * v.w));
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) atomicAdd(to + j, s * load1(from + j));
  }
}
// out[n] += scale[r]·src[r] over token n's k rows, in increasing order of r (equal rows in order of
// j): a block per token, whose first thread sorts the rows into shared memory (k is a handful),
// then each thread adds its columns in that order, a product then a sum, as the CPU rounds them
// (no fused multiply-add). A row outside src is skipped and flagged.
template <bool kVec, class S>
__global__ void gather_add_rows_kernel(const S* src, const int* rows, int k, const float* scale, float* out, int d,
                                       int src_rows, int* bad) {
  extern __shared__ int sorted[];  // [k]
  __shared__ int count;
  if (threadIdx.x == 0) {
    const int* mine = rows + static_cast<std::int64_t>(blockIdx.x) * k;
    int m = 0;
    for (int j = 0; j < k; ++j) {
      const int r = mine[j];
      if (r < 0 || r >= src_rows) {
        *bad = 1;
        continue;
      }
      int i = m++;
      for (; i > 0 && sorted[i - 1] > r; --i) sorted[i] = sorted[i - 1];  // an equal row stays first
      sorted[i] = r;
    }
    count = m;
  }
  __syncthreads();
  float* to = out + static_cast<std::int64_t>(blockIdx.x) * d;
  if constexpr (kVec) {
    for (int j = 4 * threadIdx.x; j < d; j += 4 * blockDim.x) {
      float4 acc = load4(to + j);
      for (int i = 0; i < count; ++i) {
        const int r = sorted[i];
        const float s = scale ? scale[r] : 1.0f;
        const float4 v = load4(src + static_cast<std::int64_t>(r) * d + j);
        acc = make_float4(__fadd_rn(acc.x, __fmul_rn(s, v.x)), __fadd_rn(acc.y, __fmul_rn(s, v.y)),
                          __fadd_rn(acc.z, __fmul_rn(s, v.z)), __fadd_rn(acc.w, __fmul_rn(s, v.w)));
      }
      store4(to + j, acc);
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      float acc = to[j];
      for (int i = 0; i < count; ++i) {
        const int r = sorted[i];
        acc = __fadd_rn(acc, __fmul_rn(scale ? scale[r] : 1.0f, load1(src + static_cast<std::int64_t>(r) * d + j)));
      }
      to[j] = acc;
    }
  }
}
// Its gradient: row r of dsrc = scale[r]·dout[t] (one rounding, the CPU's) and dscale[r] = dout[t]·src[r]
// (a block sum, as row_dot's), t = token_of_row[r]. A token outside dout is skipped and flagged,
// its outputs left unwritten.
template <bool kVec, class O>
__global__ void gather_add_rows_backward_kernel(const float* dout, const int* token_of_row, const float* scale,
                                                const float* src, O* dsrc, float* dscale, int d, int tokens, int* bad) {
  __shared__ float scratch[kThreads];
  const int t = token_of_row[blockIdx.x];
  if (t < 0 || t >= tokens) {
    if (threadIdx.x == 0) *bad = 1;
    return;
  }
  const float* dy = dout + static_cast<std::int64_t>(t) * d;
  const std::int64_t o = static_cast<std::int64_t>(blockIdx.x) * d;
  const float w = scale[blockIdx.x];
  float s = 0;
  if constexpr (kVec) {
    for (int j = 4 * threadIdx.x; j < d; j += 4 * blockDim.x) {
      const float4 g = load4(dy + j), x = load4(src + o + j);
      s += g.x * x.x + g.y * x.y + g.z * x.z + g.w * x.w;
      store4(dsrc + o + j, make_float4(__fmul_rn(w, g.x), __fmul_rn(w, g.y), __fmul_rn(w, g.z), __fmul_rn(w, g.w)));
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      s += dy[j] * src[o + j];
      store1(dsrc + o + j, __fmul_rn(w, dy[j]));
    }
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) dscale[blockIdx.x] = s;
}
// One block per column of x [rows, cols]: its sum in double (the router's mean probability per
// expert, for the balance loss).
__global__ void column_sums_kernel(const float* x, double* sums, std::int64_t rows, std::int64_t cols) {
  __shared__ double scratch[kThreads];
  double s = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) s += x[r * cols + blockIdx.x];
  scratch[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) scratch[threadIdx.x] += scratch[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) sums[blockIdx.x] = scratch[0];
}
// The MoE layer's plan (route_rows) over chunks of kPlanChunk assignments, in three launches.
// First each chunk's count of every expert (a histogram in shared memory, E ints); an expert
// outside [0, E) is flagged and counted nowhere.
constexpr int kPlanChunk = 1024;
__global__ void route_counts_kernel(const int* idx, int assignments, int experts, int* chunk_counts, int* bad) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int begin = blockIdx.x * kPlanChunk, end = min(assignments, begin + kPlanChunk);
  for (int a = begin + threadIdx.x; a < end; a += blockDim.x) {
    const int x = idx[a];
    if (x < 0 || x >= experts) *bad = 1;
    else atomicAdd(&hist[x], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) chunk_counts[blockIdx.x * experts + e] = hist[e];
}
// Then, in one block, each expert's total (for the host), the experts' first rows (a scan over E
// on one thread: E is tens to hundreds) and the first row of each (chunk, expert).
__global__ void route_bases_kernel(const int* chunk_counts, int chunks, int experts, int* counts, int* bases) {
  extern __shared__ int first[];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    int total = 0;
    for (int c = 0; c < chunks; ++c) total += chunk_counts[c * experts + e];
    counts[e] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int row = 0;
    for (int e = 0; e < experts; ++e) first[e] = row, row += counts[e];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    int row = first[e];
    for (int c = 0; c < chunks; ++c) bases[c * experts + e] = row, row += chunk_counts[c * experts + e];
  }
}
// Last, a warp per chunk walks its assignments 32 at a time, in order (Routing::plan's stable
// order): the lanes holding the same expert find each other (__match_any_sync), each takes the
// expert's next row plus the count of those lanes before it, and the lowest of them moves the
// expert's next row on. The weight is the host's arithmetic in the host's order (sums of floats,
// an IEEE division): the same bits as the CPU backend.
__global__ void route_rows_kernel(const int* idx, const float* val, int assignments, int k, int experts, bool normalize,
                                  const int* bases, int* token_of_row, int* row_of, float* weight_of_row) {
  extern __shared__ int next[];
  const int lane = threadIdx.x;
  for (int e = lane; e < experts; e += 32) next[e] = bases[blockIdx.x * experts + e];
  __syncwarp();
  const int begin = blockIdx.x * kPlanChunk, end = min(assignments, begin + kPlanChunk);
  for (int base = begin; base < end; base += 32) {
    const int a = base + lane;
    int x = a < end ? idx[a] : -1;
    if (x < 0 || x >= experts) x = -1;  // flagged by route_counts_kernel
    const unsigned same = __match_any_sync(0xffffffffu, x);
    if (x >= 0) {
      const int row = next[x] + __popc(same & ((1u << lane) - 1u));
      const int n = a / k;
      float sum = 0;
      for (int j = 0; j < k; ++j) sum += val[n * k + j];
      token_of_row[row] = n;
      row_of[a] = row;
      weight_of_row[row] = normalize ? __fdiv_rn(val[a], sum) : val[a];
    }
    __syncwarp();
    if (x >= 0 && lane == __ffs(same) - 1) next[x] += __popc(same);
    __syncwarp();
  }
}
// route_rows' gradient, a thread a token, with the host's operations in the host's order (no
// fused multiply-adds): the same bits as the CPU backend. A row outside [0, N·k) is flagged.
__global__ void route_rows_backward_kernel(const float* val, const int* row_of, const float* dw, std::int64_t tokens,
                                           int k, bool normalize, float* dval, int* bad) {
  K2C_FOR_EACH(n, tokens) {
    const float* v = val + n * k;
    const int* rows = row_of + n * k;
    bool ok = true;
    for (int j = 0; j < k; ++j) ok = ok && rows[j] >= 0 && rows[j] < tokens * k;
    if (!ok) {
      *bad = 1;
      continue;
    }
    float sum = 0, wdw = 0;
    for (int j = 0; j < k; ++j) sum += v[j];
    for (int j = 0; j < k; ++j) wdw = __fadd_rn(wdw, __fmul_rn(__fdiv_rn(v[j], sum), dw[rows[j]]));
    for (int j = 0; j < k; ++j) dval[n * k + j] = normalize ? __fdiv_rn(__fsub_rn(dw[rows[j]], wdw), sum) : dw[rows[j]];
  }
}
// out[n, e] = Σ_j [idx[n, j] = e]·val[n, j] + add[e], in the CPU backend's order; an expert outside
// [0, cols) sets *bad (checked by the row's thread for e = 0).
__global__ void routing_grad_kernel(const int* idx, const float* val, const float* add, float* out, std::int64_t rows,
                                    std::int64_t cols, int k, int* bad) {
  K2C_FOR_EACH(i, rows * cols) {
    const std::int64_t n = i / cols, e = i % cols;
    float s = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int x = idx[n * k + j];
      if (x == e) s += val[n * k + j];
      if (e == 0 && (x < 0 || x >= cols)) *bad = 1;
    }
    out[i] = s + add[e];
  }
}
template <bool kVec>
__global__ void row_dot_kernel(const float* a, const float* b, float* out, int cols) {
  __shared__ float scratch[kThreads];
  const std::int64_t o = static_cast<std::int64_t>(blockIdx.x) * cols;
  float s = 0;
  if constexpr (kVec) {
    for (int j = 4 * threadIdx.x; j < cols; j += 4 * blockDim.x) {
      const float4 x = load4(a + o + j), y = load4(b + o + j);
      s += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
    }
  } else {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += a[o + j] * b[o + j];
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}
template <bool kVec>
__global__ void scale_rows_kernel(float* x, const float* scale, int cols) {
  const float s = scale[blockIdx.x];
  float* row = x + static_cast<std::int64_t>(blockIdx.x) * cols;
  if constexpr (kVec) {
    for (int j = 4 * threadIdx.x; j < cols; j += 4 * blockDim.x) {
      const float4 v = load4(row + j);
      store4(row + j, make_float4(s * v.x, s * v.y, s * v.z, s * v.w));
    }
  } else {
    for (int j = threadIdx.x; j < cols; j += blockDim.x) row[j] *= s;
  }
}
// dst = src in dst's dtype (fp32 <-> bf16, rounding to nearest even): copy() between dtypes.
template <class S, class O>
__global__ void convert_kernel(const S* src, O* dst, std::int64_t n) { K2C_FOR_EACH(i, n) store1(dst + i, load1(src + i)); }
template <class S, class O>
__global__ void convert4_kernel(const S* src, O* dst, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) store4(dst + 4 * i, load4(src + 4 * i));
}
