// cuda_attention.cuh — the GPU backend's fast path (GpuMath::bf16): operands rounded to bf16 for
// the tensor cores, and attention as batched GEMMs over blocks of the score matrix. Included by
// cuda_ops.cu only, inside its unnamed namespace (it uses that file's g_stream and macros).
//
// Attention, the way this file computes it. For one (sequence, head) the scores S = Q·Kᵀ are a
// T×T matrix; with a causal mask only its lower triangle matters. Cut the sequence into nc
// chunks of c = T/nc rows: block (i, j) of S is Q_i·K_jᵀ, a c×c GEMM, and the blocks with j > i
// are entirely masked. So
//
//   forward   S_ij = Q_i·K_jᵀ          for j ≤ i   (one batched GEMM over every (b, h, i, j))
//             P = softmax(S·scale)     row by row in fp32, lse kept, P rounded to bf16
//             O_i = P_i,0..i · V_0..i  (one batched GEMM per i: its inner length is (i+1)·c)
//   backward  S again from Q and K, P = exp(S·scale − lse) (recomputing beats storing T² values)
//             dP_ij = dO_i·V_jᵀ, dS = P·(dP − rowsum(dO·O))·scale
//             dQ_i = dS_i,0..i · K_0..i,  dK_j = dS_j..nc,jᵀ · Q_j..nc,  dV_j = P_j..nc,jᵀ · dO_j..nc
//
// With nc = 8 (T = 1024: chunks of 128) the GEMMs do 36 of 64 blocks' work (56%) instead of all of it. Every GEMM reads
// bf16 and accumulates in fp32; S and dP are written in fp32, so the softmax sees unrounded
// scores. The score blocks live in a workspace of batch·heads·T² values, processed a few
// sequences at a time when that would be large. The blocks are found through arrays of
// pointers (cublasGemmBatchedEx), which also express GQA: query head h reads key-value head
// h / group. Where several query heads add into one key-value head's gradient, each writes its
// own slice of a scratch buffer and a small kernel sums the group.
#pragma once

// ---------------------------------------------------------------------------------------------
// workspace: device buffers that grow on demand and are kept for the next call

class Workspace {
 public:
  ~Workspace() {
    for (auto& b : buffers_) cudaFree(b.ptr);
    for (auto& st : ring_) {
      if (st.ptr) cudaFreeHost(st.ptr);
      if (st.done) cudaEventDestroy(st.done);
    }
  }
  // Buffer `slot`, at least `bytes` long. Growing frees the old buffer (cudaFree waits for the
  // device, so no queued kernel still reads it).
  void* get(int slot, std::size_t bytes) {
    if (slot >= static_cast<int>(buffers_.size())) buffers_.resize(slot + 1);
    Buffer& b = buffers_[slot];
    if (b.bytes < bytes) {
      if (b.ptr) K2C_CUDA_CHECK(cudaFree(b.ptr));
      b.ptr = nullptr;
      b.bytes = 0;
      K2C_CUDA_CHECK(cudaMalloc(&b.ptr, bytes));
      b.bytes = bytes;
    }
    return b.ptr;
  }
  std::size_t bytes() const {
    std::size_t total = 0;
    for (const auto& b : buffers_) total += b.bytes;
    return total;
  }
  // Copies the pointers to the device (through pinned memory, in stream order) and returns the
  // device copy. The host side is a ring of staging buffers, each reused only once the copy
  // that last read it has run, so the host does not wait for the device to drain: it can queue
  // a whole forward pass ahead. (The device copy can be reused at once: stream order puts the
  // next upload after every GEMM that reads this one.)
  void** upload_pointers(const std::vector<const void*>& host, int slot) {
    const std::size_t bytes = host.size() * sizeof(void*);
    Staging& st = ring_[next_++ % ring_.size()];
    if (!st.done) K2C_CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
    K2C_CUDA_CHECK(cudaEventSynchronize(st.done));
    if (st.bytes < bytes) {
      if (st.ptr) K2C_CUDA_CHECK(cudaFreeHost(st.ptr));
      st.ptr = nullptr;
      K2C_CUDA_CHECK(cudaMallocHost(&st.ptr, bytes));
      st.bytes = bytes;
    }
    std::memcpy(st.ptr, host.data(), bytes);
    void* dev = get(slot, bytes);
    K2C_CUDA_CHECK(cudaMemcpyAsync(dev, st.ptr, bytes, cudaMemcpyHostToDevice, g_stream));
    K2C_CUDA_CHECK(cudaEventRecord(st.done, g_stream));
    return static_cast<void**>(dev);
  }

 private:
  struct Buffer {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  struct Staging {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t done = nullptr;
  };
  std::vector<Buffer> buffers_;
  std::array<Staging, 64> ring_{};
  std::size_t next_ = 0;
};

// The workspace's slots.
enum Slot { kGemmA, kGemmB, kAttnQ, kAttnK, kAttnV, kAttnDo, kScores, kProbs, kScoreGrads, kProbGrads, kGroupDk,
            kGroupDv, kPointers, kLosses, kDelta, kLinearDy, kRope, kRouting };

// ---------------------------------------------------------------------------------------------
// fp32 → bf16, four at a time where the addresses allow

__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* y, std::int64_t n) {
  K2C_FOR_EACH(i, n) y[i] = __float2bfloat16(x[i]);
}
__global__ void to_bf16_x4_kernel(const float4* x, __nv_bfloat162* y, std::int64_t n4) {
  K2C_FOR_EACH(i, n4) {
    const float4 v = x[i];
    y[2 * i] = __floats2bfloat162_rn(v.x, v.y);
    y[2 * i + 1] = __floats2bfloat162_rn(v.z, v.w);
  }
}
// A bf16 tensor is used as it is (activations stored in bf16), with no copy.
const __nv_bfloat16* to_bf16(const Tensor& t, Workspace& ws, int slot) {
  if (t.dtype() == DType::bf16) return ptr<__nv_bfloat16>(t);
  const std::int64_t n = t.numel();
  auto* out = static_cast<__nv_bfloat16*>(ws.get(slot, static_cast<std::size_t>(n) * sizeof(__nv_bfloat16)));
  if (n == 0) return out;
  if (reinterpret_cast<std::uintptr_t>(t.f32()) % 16 == 0 && n % 4 == 0)
    to_bf16_x4_kernel<<<blocks_for(n / 4), kThreads, 0, g_stream>>>(reinterpret_cast<const float4*>(t.f32()),
                                                                    reinterpret_cast<__nv_bfloat162*>(out), n / 4);
  else
    to_bf16_kernel<<<blocks_for(n), kThreads, 0, g_stream>>>(t.f32(), out, n);
  K2C_CUDA_CHECK_LAUNCH();
  return out;
}

// ---------------------------------------------------------------------------------------------
// batched GEMMs on row-major operands, found through pointer arrays

// The operands of `count` GEMMs of one shape: A pointers, then B, then C, in one array.
struct GemmBatch {
  int count = 0;
  std::size_t offset = 0;  // of the A pointers in the uploaded array
};
class PointerList {
 public:
  GemmBatch begin() { return {0, ptrs_.size()}; }
  // Call add() `count` times after begin(), then finish(): the list stores A…, B…, C….
  void add(GemmBatch& batch, const void* a, const void* b, void* c) {
    a_.push_back(a);
    b_.push_back(b);
    c_.push_back(c);
    ++batch.count;
  }
  void finish() {
    ptrs_.insert(ptrs_.end(), a_.begin(), a_.end());
    ptrs_.insert(ptrs_.end(), b_.begin(), b_.end());
    ptrs_.insert(ptrs_.end(), c_.begin(), c_.end());
    a_.clear();
    b_.clear();
    c_.clear();
  }
  const std::vector<const void*>& all() const { return ptrs_; }
  void clear() { ptrs_.clear(); }

 private:
  std::vector<const void*> ptrs_, a_, b_, c_;
};

// C (M×N, row-major, leading dimension ldc) = alpha·op(A)·op(B) + beta·C for every GEMM of the
// batch; A and B bf16, C fp32; accumulation in fp32. Row-major C is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ,
// so the operands swap places and keep their ops.
void gemm_batched(cublasHandle_t blas, void** dev, const GemmBatch& g, bool ta, bool tb, int M, int N, int K,
                  int lda, int ldb, int ldc, float alpha, float beta) {
  if (g.count == 0 || M == 0 || N == 0) return;
  const void* const* A = dev + g.offset;
  const void* const* B = dev + g.offset + g.count;
  void* const* C = dev + g.offset + 2 * g.count;
  K2C_CUBLAS_CHECK(cublasGemmBatchedEx(blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                                       &alpha, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C, CUDA_R_32F, ldc,
                                       g.count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// ---------------------------------------------------------------------------------------------
// the row kernels between the GEMMs: one warp a row of scores

struct BlockAttn {
  int T, c, heads;  // sequence length (queries = keys), chunk length, query heads
  bool causal;
  float scale;
};

// The columns of score row t that the GEMMs computed: the row's chunk and every chunk before it
// (causal), or the whole row.
__device__ int computed_cols(const BlockAttn& a, int t) { return a.causal ? (t / a.c + 1) * a.c : a.T; }

// rows = sequences·heads·T, row r = ((b·heads + h)·T + t). P gets exp(scale·s − lse) on the
// visible columns and 0 on the masked ones the PV GEMM reads.
// One warp a row, the warps striding over the rows (the grid is capped at 65535 blocks).
#define K2C_FOR_EACH_WARP_ROW(r, rows)                                                                        \
  for (std::int64_t r = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32; r < (rows); \
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x / 32)

__global__ void block_softmax_kernel(BlockAttn a, const float* S, __nv_bfloat16* P, float* lse, std::int64_t rows) {
  const int lane = threadIdx.x % 32;
  K2C_FOR_EACH_WARP_ROW(r, rows) {
    const int t = static_cast<int>(r % a.T), cols = computed_cols(a, t), seen = a.causal ? t + 1 : a.T;
    const float* s = S + r * a.T;
    float mx = -INFINITY;
    for (int j = lane; j < seen; j += 32) mx = fmaxf(mx, s[j]);
    for (int o = 16; o; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0;
    for (int j = lane; j < seen; j += 32) sum += __expf(a.scale * (s[j] - mx));
    for (int o = 16; o; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float l = a.scale * mx + __logf(sum);
    __nv_bfloat16* p = P + r * a.T;
    for (int j = lane; j < cols; j += 32) p[j] = __float2bfloat16(j < seen ? __expf(a.scale * s[j] - l) : 0.0f);
    if (lane == 0) lse[r] = l;
  }
}

// Backward of the same row: P from the recomputed scores and lse, D = dO·O of the row's query,
// dS = P·(dP − D)·scale; P and dS written in bf16 for the dV, dQ and dK GEMMs. o and dout are
// the layer's fp32 tensors ([sequences·T, heads·hd]).
__global__ void block_softmax_backward_kernel(BlockAttn a, int hd, const float* S, const float* dP, const float* lse,
                                              const float* o, const float* dout, __nv_bfloat16* P,
                                              __nv_bfloat16* dS, std::int64_t rows) {
  const int lane = threadIdx.x % 32;
  K2C_FOR_EACH_WARP_ROW(r, rows) {
    const int t = static_cast<int>(r % a.T), cols = computed_cols(a, t), seen = a.causal ? t + 1 : a.T;
    const std::int64_t bh = r / a.T, b = bh / a.heads, h = bh % a.heads;
    const std::int64_t orow = ((b * a.T + t) * a.heads + h) * hd;
    float d = 0;
    for (int k = lane; k < hd; k += 32) d += o[orow + k] * dout[orow + k];
    for (int off = 16; off; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
    const float l = lse[r];
    const float* s = S + r * a.T;
    const float* dp = dP + r * a.T;
    __nv_bfloat16* p = P + r * a.T;
    __nv_bfloat16* ds = dS + r * a.T;
    for (int j = lane; j < cols; j += 32) {
      const float pj = j < seen ? __expf(a.scale * s[j] - l) : 0.0f;
      p[j] = __float2bfloat16(pj);
      ds[j] = __float2bfloat16(pj * (dp[j] - d) * a.scale);
    }
  }
}

// dkv[b, t, kh, :] += (or, without `add`, =) Σ over the group's query heads h of per_head[b, t, h, :].
template <class G>
__global__ void sum_groups_kernel(const float* per_head, G* dkv, std::int64_t tokens, int kv_heads, int group, int hd,
                                  bool add) {
  K2C_FOR_EACH(e, tokens * kv_heads * hd) {
    const std::int64_t tok = e / (static_cast<std::int64_t>(kv_heads) * hd);
    const int kh = static_cast<int>(e / hd % kv_heads), k = static_cast<int>(e % hd);
    const float* src = per_head + (tok * kv_heads * group + static_cast<std::int64_t>(kh) * group) * hd + k;
    float acc = 0;
    for (int g = 0; g < group; ++g) acc += src[static_cast<std::int64_t>(g) * hd];
    store1(dkv + e, add ? load1(dkv + e) + acc : acc);
  }
}

// ---------------------------------------------------------------------------------------------
// the drivers

// Whether the blocked path takes this call: queries and keys of one sequence (equal lengths and
// offsets when causal), head_dim a multiple of 8 (16-byte rows for the tensor cores).
bool blocked_attention_fits(const AttentionShape& s) {
  return s.q_len == s.kv_len && (!s.causal || s.q_offset == s.kv_offset) && s.head_dim % 8 == 0 && s.q_len > 0;
}

// How the sequence is cut: chunks of at least 128 rows (smaller blocks make GEMMs too small to
// run the tensor cores well), at most 8 of them, only when they divide T.
int attention_chunks(const AttentionShape& s) {
  if (!s.causal) return 1;
  for (int nc : {8, 4, 2})
    if (s.q_len % nc == 0 && s.q_len / nc >= 128) return nc;
  return 1;
}

// Sequences per pass, so that one fp32 score matrix of the pass stays within 2 GiB.
int sequences_per_pass(const AttentionShape& s) {
  const double per_sequence = 4.0 * s.q_heads * s.q_len * static_cast<double>(s.q_len);
  return static_cast<int>(std::clamp(std::floor(2147483648.0 / per_sequence), 1.0, static_cast<double>(s.batch)));
}

struct AttnPointers {
  const __nv_bfloat16 *q, *k, *v, *dout;  // bf16 copies, the layer's layouts
  float *S, *dP;                          // fp32 score blocks of one pass
  __nv_bfloat16 *P, *dS;
};

// Appends one GEMM per (sequence of the pass, head, lower-triangle block (i, j)): C_ij = A_i·B_jᵀ
// with A rows of `a` (a_heads heads), B rows of `b` (kv heads), C blocks of `scores`.
GemmBatch score_blocks(PointerList& list, const AttentionShape& s, int nc, int b0, int nb, const __nv_bfloat16* a,
                       const __nv_bfloat16* b, float* scores) {
  const int T = s.q_len, c = T / nc, H = s.q_heads, Hk = s.kv_heads, D = s.head_dim, group = H / Hk;
  GemmBatch g = list.begin();
  for (int bi = 0; bi < nb; ++bi)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < nc; ++i)
        for (int j = 0; j <= (s.causal ? i : nc - 1); ++j)
          list.add(g, a + ((static_cast<std::int64_t>(b0 + bi) * T + i * c) * H + h) * D,
                   b + ((static_cast<std::int64_t>(b0 + bi) * T + j * c) * Hk + h / group) * D,
                   scores + ((static_cast<std::int64_t>(bi) * H + h) * T + i * c) * T + j * c);
  list.finish();
  return g;
}

class BlockedAttention {
 public:
  // The handle is read at each call: the backend creates it after this object.
  BlockedAttention(const cublasHandle_t& blas, Workspace& ws) : blas_(blas), ws_(ws) {}

  void forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, Tensor& lse) {
    const int T = s.q_len, nc = attention_chunks(s), c = T / nc, H = s.q_heads, Hk = s.kv_heads, D = s.head_dim;
    const int group = H / Hk, per_pass = sequences_per_pass(s);
    AttnPointers p = buffers(s, per_pass, q, k, v, nullptr);
    for (int b0 = 0; b0 < s.batch; b0 += per_pass) {
      const int nb = std::min(per_pass, s.batch - b0);
      PointerList list;
      const GemmBatch scores = score_blocks(list, s, nc, b0, nb, p.q, p.k, p.S);
      std::vector<GemmBatch> pv(nc);
      for (int i = 0; i < nc; ++i) {
        pv[i] = list.begin();
        for (int bi = 0; bi < nb; ++bi)
          for (int h = 0; h < H; ++h)
            list.add(pv[i], p.P + ((static_cast<std::int64_t>(bi) * H + h) * T + i * c) * T,
                     p.v + (static_cast<std::int64_t>(b0 + bi) * T * Hk + h / group) * D,
                     o.f32() + ((static_cast<std::int64_t>(b0 + bi) * T + i * c) * H + h) * D);
        list.finish();
      }
      void** dev = ws_.upload_pointers(list.all(), kPointers);
      gemm_batched(blas_, dev, scores, false, true, c, c, D, H * D, Hk * D, T, 1.0f, 0.0f);
      const std::int64_t rows = static_cast<std::int64_t>(nb) * H * T;
      block_softmax_kernel<<<blocks_for(rows * 32), kThreads, 0, g_stream>>>(
          args(s, nc), p.S, p.P, lse.f32() + static_cast<std::int64_t>(b0) * H * T, rows);
      K2C_CUDA_CHECK_LAUNCH();
      for (int i = 0; i < nc; ++i)
        gemm_batched(blas_, dev, pv[i], false, false, c, D, s.causal ? (i + 1) * c : T, T, Hk * D, H * D, 1.0f, 0.0f);
    }
  }

  void backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
    const int T = s.q_len, nc = attention_chunks(s), c = T / nc, H = s.q_heads, Hk = s.kv_heads, D = s.head_dim;
    const int group = H / Hk, per_pass = sequences_per_pass(s);
    AttnPointers p = buffers(s, per_pass, q, k, v, &dout);
    // With one query head per key-value head, dK and dV add straight into the layer's tensors;
    // otherwise each query head writes its own slice and sum_groups_kernel adds them up.
    float* dk_dst = dk.f32();
    float* dv_dst = dv.f32();
    int dst_heads = Hk;
    const std::size_t per_head_bytes = static_cast<std::size_t>(q.numel()) * sizeof(float);
    if (group > 1) {
      dk_dst = static_cast<float*>(ws_.get(kGroupDk, per_head_bytes));
      dv_dst = static_cast<float*>(ws_.get(kGroupDv, per_head_bytes));
      dst_heads = H;
    }
    const float beta = group > 1 ? 0.0f : 1.0f;
    for (int b0 = 0; b0 < s.batch; b0 += per_pass) {
      const int nb = std::min(per_pass, s.batch - b0);
      PointerList list;
      const GemmBatch scores = score_blocks(list, s, nc, b0, nb, p.q, p.k, p.S);
      const GemmBatch dscores = score_blocks(list, s, nc, b0, nb, p.dout, p.v, p.dP);
      std::vector<GemmBatch> dqs(nc), dks(nc), dvs(nc);
      for (int i = 0; i < nc; ++i) {
        dqs[i] = list.begin();
        for (int bi = 0; bi < nb; ++bi)
          for (int h = 0; h < H; ++h)
            list.add(dqs[i], p.dS + ((static_cast<std::int64_t>(bi) * H + h) * T + i * c) * T,
                     p.k + (static_cast<std::int64_t>(b0 + bi) * T * Hk + h / group) * D,
                     dq.f32() + ((static_cast<std::int64_t>(b0 + bi) * T + i * c) * H + h) * D);
        list.finish();
      }
      // dK_j and dV_j read column block j of dS and P from row block j down: transposed, an
      // inner length of (nc − j)·c.
      for (auto [batches, src, rhs, dst] : {std::tuple{&dks, p.dS, p.q, dk_dst}, std::tuple{&dvs, p.P, p.dout, dv_dst}})
        for (int j = 0; j < nc; ++j) {
          GemmBatch& g = (*batches)[j];
          g = list.begin();
          for (int bi = 0; bi < nb; ++bi)
            for (int h = 0; h < H; ++h) {
              // Destination head h: the key-value head itself when group is 1, else h's own slice.
              list.add(g, src + ((static_cast<std::int64_t>(bi) * H + h) * T + j * c) * T + j * c,
                       rhs + ((static_cast<std::int64_t>(b0 + bi) * T + j * c) * H + h) * D,
                       dst + ((static_cast<std::int64_t>(b0 + bi) * T + j * c) * dst_heads + h) * D);
            }
          list.finish();
        }
      void** dev = ws_.upload_pointers(list.all(), kPointers);
      gemm_batched(blas_, dev, scores, false, true, c, c, D, H * D, Hk * D, T, 1.0f, 0.0f);
      gemm_batched(blas_, dev, dscores, false, true, c, c, D, H * D, Hk * D, T, 1.0f, 0.0f);
      const std::int64_t rows = static_cast<std::int64_t>(nb) * H * T;
      const std::int64_t first = static_cast<std::int64_t>(b0) * T * H * D;
      block_softmax_backward_kernel<<<blocks_for(rows * 32), kThreads, 0, g_stream>>>(
          args(s, nc), D, p.S, p.dP, lse.f32() + static_cast<std::int64_t>(b0) * H * T, o.f32() + first,
          dout.f32() + first, p.P, p.dS, rows);
      K2C_CUDA_CHECK_LAUNCH();
      for (int i = 0; i < nc; ++i)
        gemm_batched(blas_, dev, dqs[i], false, false, c, D, s.causal ? (i + 1) * c : T, T, Hk * D, H * D, 1.0f, 0.0f);
      for (int j = 0; j < nc; ++j) {
        const int inner = s.causal ? (nc - j) * c : T;
        gemm_batched(blas_, dev, dks[j], true, false, c, D, inner, T, H * D, dst_heads * D, 1.0f, beta);
        gemm_batched(blas_, dev, dvs[j], true, false, c, D, inner, T, H * D, dst_heads * D, 1.0f, beta);
      }
    }
    if (group > 1) {
      const std::int64_t tokens = static_cast<std::int64_t>(s.batch) * T;
      for (auto [src, dst] : {std::pair{dk_dst, dk.f32()}, std::pair{dv_dst, dv.f32()}}) {
        sum_groups_kernel<<<blocks_for(tokens * Hk * D), kThreads, 0, g_stream>>>(src, dst, tokens, Hk, group, D, true);
        K2C_CUDA_CHECK_LAUNCH();
      }
    }
  }

 private:
  static BlockAttn args(const AttentionShape& s, int nc) {
    return {s.q_len, s.q_len / nc, s.q_heads, s.causal, 1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  }
  AttnPointers buffers(const AttentionShape& s, int per_pass, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor* dout) {
    AttnPointers p{};
    p.q = to_bf16(q, ws_, kAttnQ);
    p.k = to_bf16(k, ws_, kAttnK);
    p.v = to_bf16(v, ws_, kAttnV);
    if (dout) p.dout = to_bf16(*dout, ws_, kAttnDo);
    const std::size_t n = static_cast<std::size_t>(per_pass) * s.q_heads * s.q_len * static_cast<std::size_t>(s.q_len);
    p.S = static_cast<float*>(ws_.get(kScores, n * sizeof(float)));
    p.P = static_cast<__nv_bfloat16*>(ws_.get(kProbs, n * sizeof(__nv_bfloat16)));
    if (dout) {
      p.dP = static_cast<float*>(ws_.get(kScoreGrads, n * sizeof(float)));
      p.dS = static_cast<__nv_bfloat16*>(ws_.get(kProbGrads, n * sizeof(__nv_bfloat16)));
    }
    return p;
  }

  const cublasHandle_t& blas_;
  Workspace& ws_;
};
