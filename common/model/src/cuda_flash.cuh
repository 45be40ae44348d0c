// cuda_flash.cuh — the GPU backend's fused attention (GpuMath::bf16, head_dim 64 or 128): the
// FlashAttention-2 scheme on mma.sync bf16 tensor cores, so the T×T scores never reach memory.
// Included by cuda_ops.cu only, after cuda_attention.cuh (it uses that file's helpers).
//
// Forward: a block of 4 warps owns 64 queries of one (sequence, head); each warp 16 of them. The
// queries stay in registers while 64-key tiles of K and V pass through shared memory: S = Q·Kᵀ
// for the tile (m16n8k16 MMAs), a running max and sum per query row (the online softmax), and
// O += P·V with P taken straight from the score registers (the accumulator of one MMA has the
// layout of the next one's A operand, two 8-column tiles making one 16-wide step). Causal
// blocks stop at the diagonal tile. O is divided by the row sum at the end and the log-sum-exp
// is kept for backward.
//
// Backward, in two kernels. dK and dV: a block owns 64 keys, each warp 16 of them, with K and V
// in registers; query tiles from the diagonal down pass through shared memory: Sᵀ = K·Qᵀ and P
// from the saved log-sum-exp, dPᵀ = V·dOᵀ, dSᵀ = P(dP − D) with D = rowsum(dO·O); dV += Pᵀ·dO and
// dK += dSᵀ·Q accumulate in registers and are written once. dQ: a block owns 64 queries, as in
// forward, recomputes S and dP against each key tile and accumulates dQ += dS·K in registers.
// Two more products than adding dQ from the key side, but no atomics: at 64-row tiles those
// came to a hundred million per layer of the benchmark's model and cost more than the products.
// Rows and keys past the sequence's end are zero-filled and masked, so any length works.
#pragma once

namespace flash {

constexpr int kTile = 64;      // queries per forward block, keys per backward block, and tile length
constexpr int kWarpsPer = 4;   // 16 rows each
constexpr int kBlock = 32 * kWarpsPer;
constexpr float kLog2e = 1.4426950408889634f;  // exp(x) = exp2(x·log2(e)): exp2 is one MUFU instruction

struct Args {
  int T, heads, kv_heads;
  bool causal;
  float scale;  // 1/sqrt(head_dim)
};

__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void ldsm4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4_t(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// c (16×8 fp32) += a (16×16 bf16, row) · b (16×8 bf16, col).
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// Rows [row0, row0 + 64) of one head of a [sequences·T, heads·D] bf16 tensor into a shared tile
// with rows `ld` elements apart (D + 8: the padding puts the 8 rows an ldmatrix reads in 8
// different bank groups), by asynchronous 16-byte copies (cp.async): every thread issues all of
// its copies at once and the block computes on the previous tile while they fly. Rows past T are
// zero-filled (a copy of 0 source bytes). The caller commits the group and waits for it.
template <int D>
__device__ void load_tile(__nv_bfloat16* tile, int ld, const __nv_bfloat16* src, std::int64_t seq_row0, int row0, int T,
                          int heads, int h) {
  constexpr int kVecs = D / 8;  // 16-byte vectors per row
#pragma unroll
  for (int e = threadIdx.x; e < kTile * kVecs; e += kBlock) {
    const int r = e / kVecs, c = (e % kVecs) * 8;
    const bool inside = row0 + r < T;
    const __nv_bfloat16* from =
        inside ? src + ((seq_row0 + row0 + r) * heads + h) * static_cast<std::int64_t>(D) + c : src;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(tile + r * ld + c)), "l"(from),
                 "r"(inside ? 16 : 0));
  }
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_groups() {  // all but the N most recent groups have landed
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The loop head every kernel runs before computing on tile j of n: the next tile's copies go out
// (into the other buffer, which every warp finished with last iteration) and tile j is waited
// for; the barrier then makes it visible to every warp.
template <class LoadNext>
__device__ __forceinline__ void next_tile(int j, int n, LoadNext&& load_next) {
  if (j + 1 < n) {
    load_next(j + 1);
    wait_groups<1>();
  } else {
    wait_groups<0>();
  }
  __syncthreads();
}

// Key-value tile j (rows [64·j, 64·j + 64) of K and V, head kh) into buffer j % 2 of `kv`, as one
// commit group: the stream that forward and dQ pass their queries against.
template <int D>
__device__ __forceinline__ void load_kv(__nv_bfloat16* kv, int ld, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                        std::int64_t seq, int j, const Args& a, int kh) {
  __nv_bfloat16* buf = kv + (j % 2) * 2 * kTile * ld;
  load_tile<D>(buf, ld, k, seq, j * kTile, a.T, a.kv_heads, kh);
  load_tile<D>(buf + kTile * ld, ld, v, seq, j * kTile, a.T, a.kv_heads, kh);
  commit();
}

// Where this lane's ldmatrix address lies in a tile read as B operands: two n8 tiles at rows
// 16·np.. of a row-major (n × k) tile, k step kk (b_offset); or, transposed, k rows 16·kk.. of a
// (k × n) tile, n columns 16·np.. (bt_offset). (The A fragments' address, written out in each
// kernel, stays there: as a helper it changed the dQ kernel's schedule for head_dim 64.)
__device__ __forceinline__ int b_offset(int np, int kk, int ld, int lane) {
  return (np * 16 + (lane / 16) * 8 + lane % 8) * ld + kk * 16 + ((lane / 8) % 2) * 8;
}
__device__ __forceinline__ int bt_offset(int kk, int np, int ld, int lane) {
  return (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * ld + np * 16 + (lane / 16) * 8;
}

// The A operand of the next product for keys (or queries) 16·kk.. from the accumulators of this
// one: the accumulator layout of two 16×8 tiles is that of a 16×16 A fragment, rounded to bf16.
__device__ __forceinline__ void acc_to_a(unsigned (&f)[4], const float (*acc)[4], int kk) {
  f[0] = pack(acc[2 * kk][0], acc[2 * kk][1]);
  f[1] = pack(acc[2 * kk][2], acc[2 * kk][3]);
  f[2] = pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  f[3] = pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// O is written as O_ (fp32 or bf16, rounded from the fp32 accumulator).
template <int D, class O_>
__global__ void __launch_bounds__(kBlock) forward_kernel(Args a, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                         const __nv_bfloat16* v, O_* o, float* lse) {
  constexpr int LD = D + 8;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  auto* Qs = reinterpret_cast<__nv_bfloat16*>(shared_raw);
  __nv_bfloat16* KVs = Qs + kTile * LD;  // two buffers of (K, V)
  const int tiles = (a.T + kTile - 1) / kTile;
  const int qt = tiles - 1 - static_cast<int>(blockIdx.x);  // the longest causal rows first
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (a.heads / a.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const std::int64_t seq = static_cast<std::int64_t>(b) * a.T;
  auto load_kv_tile = [&](int j) { load_kv<D>(KVs, LD, k, v, seq, j, a, kh); };
  load_tile<D>(Qs, LD, q, seq, qt * kTile, a.T, a.heads, h);
  commit();
  load_kv_tile(0);
  wait_groups<1>();  // Q has landed; the first K and V may still be on their way
  __syncthreads();
  unsigned qf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) ldsm4(qf[kk], Qs + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);

  const float sl = a.scale * kLog2e;  // exp(x·scale) = exp2(x·sl)
  float acc[D / 8][4] = {};
  float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0, 0};
  const int qrow[2] = {qt * kTile + warp * 16 + g, qt * kTile + warp * 16 + g + 8};
  const int kv_tiles = a.causal ? qt + 1 : tiles;
  for (int j = 0; j < kv_tiles; ++j) {
    next_tile(j, kv_tiles, load_kv_tile);
    const __nv_bfloat16* Ks = KVs + (j % 2) * 2 * kTile * LD;
    const __nv_bfloat16* Vs = Ks + kTile * LD;
    float s[8][4] = {};
    for (int kk = 0; kk < D / 16; ++kk)
      for (int np = 0; np < 4; ++np) {
        unsigned bf[4];
        ldsm4(bf, Ks + b_offset(np, kk, LD, lane));
        mma(s[2 * np], qf[kk], bf[0], bf[1]);
        mma(s[2 * np + 1], qf[kk], bf[2], bf[3]);
      }
    // Mask (only the diagonal tile and a tile past the end need it: the issue slots it would
    // take on every tile are what this kernel is short of), then the online softmax of each of
    // this thread's two rows.
    if ((a.causal && j == qt) || (j + 1) * kTile > a.T) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * kTile + nt * 8 + 2 * t + (e & 1);
          if (key >= a.T || (a.causal && key > qrow[e / 2])) s[nt][e] = -INFINITY;
        }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
    float rescale[2], shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_new = fmaxf(mx[r], tile_max[r]);
      rescale[r] = m_new == -INFINITY ? 1.0f : exp2f((mx[r] - m_new) * sl);  // exp2(−inf) = 0 for a first tile
      mx[r] = m_new;
      sum[r] *= rescale[r];
      shift[r] = m_new == -INFINITY ? 0.0f : m_new * sl;  // p = exp2(s·sl − shift): one FFMA and one MUFU
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(fmaf(s[nt][e], sl, -shift[e / 2]));
        sum[e / 2] += s[nt][e];
      }
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      acc[dn][0] *= rescale[0], acc[dn][1] *= rescale[0];
      acc[dn][2] *= rescale[1], acc[dn][3] *= rescale[1];
    }
    for (int kk = 0; kk < 4; ++kk) {  // 16 keys a step
      unsigned pf[4];
      acc_to_a(pf, s, kk);
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned bf[4];
        ldsm4_t(bf, Vs + bt_offset(kk, dp, LD, lane));
        mma(acc[2 * dp], pf, bf[0], bf[1]);
        mma(acc[2 * dp + 1], pf, bf[2], bf[3]);
      }
    }
    __syncthreads();  // done with this buffer: the next iteration's copy may overwrite it
  }
  for (int r = 0; r < 2; ++r) {
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
  }
  for (int r = 0; r < 2; ++r) {
    if (qrow[r] >= a.T) continue;
    const float inv = sum[r] > 0 ? 1.0f / sum[r] : 0.0f;
    O_* orow = o + ((seq + qrow[r]) * a.heads + h) * static_cast<std::int64_t>(D);
    for (int dn = 0; dn < D / 8; ++dn) store2(orow + dn * 8 + 2 * t, acc[dn][2 * r] * inv, acc[dn][2 * r + 1] * inv);
    if (t == 0)
      lse[(static_cast<std::int64_t>(b) * a.heads + h) * a.T + qrow[r]] =
          sum[r] > 0 ? mx[r] * a.scale + logf(sum[r]) : -INFINITY;
  }
}

// D_i = Σ_d dO·O of each query row, [sequences, heads, T]: one warp a row.
template <class E>
__global__ void delta_kernel(const E* o, const E* dout, float* delta, std::int64_t rows, int T, int heads, int hd) {
  const int lane = threadIdx.x % 32;
  K2C_FOR_EACH_WARP_ROW(r, rows) {  // r = (b·T + t)·heads + h
    float d = 0;
    for (int c = lane; c < hd; c += 32) d += load1(o + r * hd + c) * load1(dout + r * hd + c);
    for (int off = 16; off; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
    const std::int64_t h = r % heads, bt = r / heads, b = bt / T, t = bt % T;
    if (lane == 0) delta[(b * heads + h) * T + t] = d;
  }
}

// dk_out / dv_out: [sequences·T, out_heads·D] of G (fp32 or bf16), head `out_head`; `add` adds
// into them (the layer's tensors) instead of writing (a per-query-head scratch that
// sum_groups_kernel folds).
template <int D, class G>
__global__ void __launch_bounds__(kBlock) dkdv_kernel(Args a, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                      const __nv_bfloat16* v, const __nv_bfloat16* dout, const float* lse,
                                                      const float* delta, G* dk_out, G* dv_out, int out_heads,
                                                      bool add) {
  constexpr int LD = D + 8;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  auto* Ks = reinterpret_cast<__nv_bfloat16*>(shared_raw);
  __nv_bfloat16* Vs = Ks + kTile * LD;
  __nv_bfloat16* QdOs = Vs + kTile * LD;                               // two buffers of (Q, dO)
  auto* stats = reinterpret_cast<float*>(QdOs + 4 * kTile * LD);      // two buffers of (lse, D)
  const int tiles = (a.T + kTile - 1) / kTile;
  const int jt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kh = h / (a.heads / a.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const std::int64_t seq = static_cast<std::int64_t>(b) * a.T;
  const std::int64_t row_stats = (static_cast<std::int64_t>(b) * a.heads + h) * a.T;
  auto load_q = [&](int i) {
    __nv_bfloat16* buf = QdOs + (i % 2) * 2 * kTile * LD;
    load_tile<D>(buf, LD, q, seq, i * kTile, a.T, a.heads, h);
    load_tile<D>(buf + kTile * LD, LD, dout, seq, i * kTile, a.T, a.heads, h);
    commit();
    float* st = stats + (i % 2) * 2 * kTile;  // read after the barrier that follows the wait
    for (int e = threadIdx.x; e < kTile; e += kBlock) {
      const int qi = i * kTile + e;
      st[e] = qi < a.T ? lse[row_stats + qi] * kLog2e : INFINITY;  // a row past the end: P = 0
      st[kTile + e] = qi < a.T ? delta[row_stats + qi] : 0.0f;
    }
  };
  const int first = a.causal ? jt : 0;
  load_tile<D>(Ks, LD, k, seq, jt * kTile, a.T, a.kv_heads, kh);
  load_tile<D>(Vs, LD, v, seq, jt * kTile, a.T, a.kv_heads, kh);
  commit();
  if (first < tiles) load_q(first);
  wait_groups<1>();
  __syncthreads();
  unsigned kf[D / 16][4], vf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    ldsm4(kf[kk], Ks + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
    ldsm4(vf[kk], Vs + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
  }
  float dka[D / 8][4] = {}, dva[D / 8][4] = {};
  const float sl = a.scale * kLog2e;
  const int key[2] = {jt * kTile + warp * 16 + g, jt * kTile + warp * 16 + g + 8};

  for (int i = first; i < tiles; ++i) {
    next_tile(i, tiles, load_q);
    const __nv_bfloat16* Qs = QdOs + (i % 2) * 2 * kTile * LD;
    const __nv_bfloat16* dOs = Qs + kTile * LD;
    const float* lse_s = stats + (i % 2) * 2 * kTile;
    const float* delta_s = lse_s + kTile;
    float st[8][4] = {}, dpt[8][4] = {};  // this warp's 16 keys × the tile's 64 queries
    for (int kk = 0; kk < D / 16; ++kk)
      for (int np = 0; np < 4; ++np) {
        unsigned bq[4], bo[4];
        const int off = b_offset(np, kk, LD, lane);
        ldsm4(bq, Qs + off);
        ldsm4(bo, dOs + off);
        mma(st[2 * np], kf[kk], bq[0], bq[1]);
        mma(st[2 * np + 1], kf[kk], bq[2], bq[3]);
        mma(dpt[2 * np], vf[kk], bo[0], bo[1]);
        mma(dpt[2 * np + 1], vf[kk], bo[2], bo[3]);
      }
    // P and dS, transposed (rows: keys, columns: queries).
    // Masks only on the diagonal tile and at the end of the sequence (lse_s holds lse·log2(e)).
    const bool edge = (a.causal && i == jt) || (i + 1) * kTile > a.T || (jt + 1) * kTile > a.T;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ql = nt * 8 + 2 * t + (e & 1);
        float p = exp2f(fmaf(st[nt][e], sl, -lse_s[ql]));
        if (edge) {
          const int qi = i * kTile + ql, kr = key[e / 2];
          if (!(kr < a.T && qi < a.T && (!a.causal || kr <= qi))) p = 0.0f;
        }
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - delta_s[ql]);
      }
    // dV += Pᵀ·dO and dK += dSᵀ·Q: 16 queries a step, operands from registers and shared memory.
    for (int kk = 0; kk < 4; ++kk) {
      unsigned pf[4], sf[4];
      acc_to_a(pf, st, kk);
      acc_to_a(sf, dpt, kk);
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned bo[4], bq[4];
        const int off = bt_offset(kk, dp, LD, lane);
        ldsm4_t(bo, dOs + off);
        ldsm4_t(bq, Qs + off);
        mma(dva[2 * dp], pf, bo[0], bo[1]);
        mma(dva[2 * dp + 1], pf, bo[2], bo[3]);
        mma(dka[2 * dp], sf, bq[0], bq[1]);
        mma(dka[2 * dp + 1], sf, bq[2], bq[3]);
      }
    }
    __syncthreads();  // done with this buffer
  }
  const int out_head = out_heads == a.heads ? h : kh;
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= a.T) continue;
    const std::int64_t row = ((seq + key[r]) * out_heads + out_head) * static_cast<std::int64_t>(D);
    for (int dn = 0; dn < D / 8; ++dn)
      for (int c = 0; c < 2; ++c) {
        const std::int64_t at = row + dn * 8 + 2 * t + c;
        const float dkv = dka[dn][2 * r + c] * a.scale, dvv = dva[dn][2 * r + c];
        store1(dk_out + at, add ? load1(dk_out + at) + dkv : dkv);
        store1(dv_out + at, add ? load1(dv_out + at) + dvv : dvv);
      }
  }
}

// dQ_i = scale · Σ_j dS_ij·K_j for one 64-query tile, the key tiles streaming past as in forward:
// S and dP recomputed (two more products than a kernel that also adds dQ from the key side
// through atomics, and cheaper than the atomics), dS = P(dP − D) in registers, dQ accumulated in
// registers and written once.
template <int D, class G>
__global__ void __launch_bounds__(kBlock) dq_kernel(Args a, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                    const __nv_bfloat16* v, const __nv_bfloat16* dout, const float* lse,
                                                    const float* delta, G* dq) {
  constexpr int LD = D + 8;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  auto* Qs = reinterpret_cast<__nv_bfloat16*>(shared_raw);
  __nv_bfloat16* dOs = Qs + kTile * LD;
  __nv_bfloat16* KVs = dOs + kTile * LD;  // two buffers of (K, V)
  const int tiles = (a.T + kTile - 1) / kTile;
  const int qt = tiles - 1 - static_cast<int>(blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (a.heads / a.kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const std::int64_t seq = static_cast<std::int64_t>(b) * a.T;
  const std::int64_t row_stats = (static_cast<std::int64_t>(b) * a.heads + h) * a.T;
  auto load_kv_tile = [&](int j) { load_kv<D>(KVs, LD, k, v, seq, j, a, kh); };
  load_tile<D>(Qs, LD, q, seq, qt * kTile, a.T, a.heads, h);
  load_tile<D>(dOs, LD, dout, seq, qt * kTile, a.T, a.heads, h);
  commit();
  load_kv_tile(0);
  wait_groups<1>();
  __syncthreads();
  unsigned qf[D / 16][4], of[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    ldsm4(qf[kk], Qs + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
    ldsm4(of[kk], dOs + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
  }
  const int qrow[2] = {qt * kTile + warp * 16 + g, qt * kTile + warp * 16 + g + 8};
  float row_lse[2], row_delta[2];
  for (int r = 0; r < 2; ++r) {
    row_lse[r] = qrow[r] < a.T ? lse[row_stats + qrow[r]] * kLog2e : INFINITY;
    row_delta[r] = qrow[r] < a.T ? delta[row_stats + qrow[r]] : 0.0f;
  }
  float acc[D / 8][4] = {};
  const float sl = a.scale * kLog2e;
  const int kv_tiles = a.causal ? qt + 1 : tiles;
  for (int j = 0; j < kv_tiles; ++j) {
    next_tile(j, kv_tiles, load_kv_tile);
    const __nv_bfloat16* Ks = KVs + (j % 2) * 2 * kTile * LD;
    const __nv_bfloat16* Vs = Ks + kTile * LD;
    float s[8][4] = {}, dp[8][4] = {};
    for (int kk = 0; kk < D / 16; ++kk)
      for (int np = 0; np < 4; ++np) {
        unsigned bk[4], bv[4];
        const int off = b_offset(np, kk, LD, lane);
        ldsm4(bk, Ks + off);
        ldsm4(bv, Vs + off);
        mma(s[2 * np], qf[kk], bk[0], bk[1]);
        mma(s[2 * np + 1], qf[kk], bk[2], bk[3]);
        mma(dp[2 * np], of[kk], bv[0], bv[1]);
        mma(dp[2 * np + 1], of[kk], bv[2], bv[3]);
      }
    const bool edge = (a.causal && j == qt) || (j + 1) * kTile > a.T || (qt + 1) * kTile > a.T;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        float p = exp2f(fmaf(s[nt][e], sl, -row_lse[r]));
        if (edge) {
          const int key = j * kTile + nt * 8 + 2 * t + (e & 1);
          if (!(key < a.T && qrow[r] < a.T && (!a.causal || key <= qrow[r]))) p = 0.0f;
        }
        dp[nt][e] = p * (dp[nt][e] - row_delta[r]);
      }
    for (int kk = 0; kk < 4; ++kk) {
      unsigned sf[4];
      acc_to_a(sf, dp, kk);
      for (int dn = 0; dn < D / 16; ++dn) {
        unsigned bk[4];
        ldsm4_t(bk, Ks + bt_offset(kk, dn, LD, lane));
        mma(acc[2 * dn], sf, bk[0], bk[1]);
        mma(acc[2 * dn + 1], sf, bk[2], bk[3]);
      }
    }
    __syncthreads();  // done with this buffer
  }
  for (int r = 0; r < 2; ++r) {
    if (qrow[r] >= a.T) continue;
    G* row = dq + ((seq + qrow[r]) * a.heads + h) * static_cast<std::int64_t>(D);
    for (int dn = 0; dn < D / 8; ++dn) store2(row + dn * 8 + 2 * t, acc[dn][2 * r] * a.scale, acc[dn][2 * r + 1] * a.scale);
  }
}

}  // namespace flash

// Whether the fused kernels take this call (on top of blocked_attention_fits). They store the fp32
// rows of O (forward) or dQ (backward), `rows_out`, two elements at a time, so it must start on 8
// bytes (a view that starts one float into its buffer goes the blocked way).
bool flash_fits(const AttentionShape& s, const Tensor& rows_out) {
  return blocked_attention_fits(s) && (s.head_dim == 64 || s.head_dim == 128) &&
         reinterpret_cast<std::uintptr_t>(rows_out.raw()) % 8 == 0;
}

class FlashAttention {
 public:
  explicit FlashAttention(Workspace& ws) : ws_(ws) {}

  void forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, Tensor& lse) {
    const __nv_bfloat16 *q16 = to_bf16(q, ws_, kAttnQ), *k16 = to_bf16(k, ws_, kAttnK), *v16 = to_bf16(v, ws_, kAttnV);
    if (o.dtype() == DType::bf16) return forward_as(s, q16, k16, v16, ptr<__nv_bfloat16>(o), lse);
    forward_as(s, q16, k16, v16, o.f32(), lse);
  }

  // dq, dk and dv of one dtype, o and dout of one dtype (the caller widens a mixed set). dq is
  // written; dk and dv are added into where `add_kv`, else written.
  void backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, bool add_kv) {
    const __nv_bfloat16 *q16 = to_bf16(q, ws_, kAttnQ), *k16 = to_bf16(k, ws_, kAttnK), *v16 = to_bf16(v, ws_, kAttnV),
                        *do16 = to_bf16(dout, ws_, kAttnDo);
    const std::int64_t rows = static_cast<std::int64_t>(s.batch) * s.q_len * s.q_heads;
    auto* delta = static_cast<float*>(ws_.get(kDelta, static_cast<std::size_t>(rows) * sizeof(float)));
    if (o.dtype() == DType::bf16)  // O and dO of one type (the caller widens a mixed pair)
      flash::delta_kernel<<<blocks_for(rows * 32), kThreads, 0, g_stream>>>(
          ptr<__nv_bfloat16>(o), ptr<__nv_bfloat16>(dout), delta, rows, s.q_len, s.q_heads, s.head_dim);
    else
      flash::delta_kernel<<<blocks_for(rows * 32), kThreads, 0, g_stream>>>(o.f32(), dout.f32(), delta, rows, s.q_len,
                                                                           s.q_heads, s.head_dim);
    K2C_CUDA_CHECK_LAUNCH();
    const Inputs in{q16, k16, v16, do16, lse.f32(), delta};
    if (dq.dtype() == DType::bf16) return backward_as<__nv_bfloat16>(s, q, in, dq, dk, dv, add_kv);
    backward_as<float>(s, q, in, dq, dk, dv, add_kv);
  }

 private:
  struct Inputs {
    const __nv_bfloat16 *q, *k, *v, *dout;
    const float *lse, *delta;
  };
  template <class O_>
  void forward_as(const AttentionShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, O_* o,
                  Tensor& lse) {
    const dim3 grid((s.q_len + flash::kTile - 1) / flash::kTile, s.q_heads, s.batch);
    if (s.head_dim == 64) launch_forward<64>(grid, args(s), q, k, v, o, lse.f32());
    else launch_forward<128>(grid, args(s), q, k, v, o, lse.f32());
  }
  // The gradients are G. One query head per key-value head: dK and dV go straight into the
  // layer's tensors. Otherwise each query head writes its own fp32 slice and sum_groups_kernel
  // folds the groups into them.
  template <class G>
  void backward_as(const AttentionShape& s, const Tensor& q, const Inputs& in, Tensor& dq, Tensor& dk, Tensor& dv,
                   bool add_kv) {
    const int group = s.q_heads / s.kv_heads;
    const dim3 grid((s.q_len + flash::kTile - 1) / flash::kTile, s.q_heads, s.batch);
    if (group == 1) return run_backward(s, grid, in, ptr<G>(dq), ptr<G>(dk), ptr<G>(dv), s.kv_heads, add_kv);
    const std::size_t bytes = static_cast<std::size_t>(q.numel()) * sizeof(float);
    auto* dk_heads = static_cast<float*>(ws_.get(kGroupDk, bytes));
    auto* dv_heads = static_cast<float*>(ws_.get(kGroupDv, bytes));
    run_backward(s, grid, in, ptr<G>(dq), dk_heads, dv_heads, s.q_heads, false);
    const std::int64_t tokens = static_cast<std::int64_t>(s.batch) * s.q_len;
    for (auto [src, dst] : {std::pair{dk_heads, ptr<G>(dk)}, std::pair{dv_heads, ptr<G>(dv)}}) {
      sum_groups_kernel<<<blocks_for(tokens * s.kv_heads * s.head_dim), kThreads, 0, g_stream>>>(
          src, dst, tokens, s.kv_heads, group, s.head_dim, add_kv);
      K2C_CUDA_CHECK_LAUNCH();
    }
  }
  template <class Q, class KV>
  void run_backward(const AttentionShape& s, dim3 grid, const Inputs& in, Q* dq, KV* dk, KV* dv, int out_heads,
                       bool add) {
    if (s.head_dim == 64)
      launch_backward<64>(grid, args(s), in.q, in.k, in.v, in.dout, in.lse, in.delta, dq, dk, dv, out_heads, add);
    else
      launch_backward<128>(grid, args(s), in.q, in.k, in.v, in.dout, in.lse, in.delta, dq, dk, dv, out_heads, add);
  }
  static flash::Args args(const AttentionShape& s) {
    return {s.q_len, s.q_heads, s.kv_heads, s.causal, 1.0f / std::sqrt(static_cast<float>(s.head_dim))};
  }
  template <int D, class O_>
  static void launch_forward(dim3 grid, flash::Args a, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, O_* o, float* lse) {
    constexpr int bytes = 5 * flash::kTile * (D + 8) * 2;  // Q and two (K, V) buffers
    static const bool ready = [] {
      return cudaFuncSetAttribute(flash::forward_kernel<D, O_>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
             cudaSuccess;
    }();
    if (!ready) throw std::runtime_error("flash attention: cannot reserve " + std::to_string(bytes) + " bytes of shared memory");
    flash::forward_kernel<D, O_><<<grid, flash::kBlock, bytes, g_stream>>>(a, q, k, v, o, lse);
    K2C_CUDA_CHECK_LAUNCH();
  }
  template <int D, class Q, class KV>
  static void launch_backward(dim3 grid, flash::Args a, const __nv_bfloat16* q, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const __nv_bfloat16* dout, const float* lse, const float* delta,
                              Q* dq, KV* dk, KV* dv, int out_heads, bool add) {
    // dK/dV: K, V and two (Q, dO) buffers with their row statistics; dQ: Q, dO and two (K, V).
    constexpr int bytes = 6 * flash::kTile * (D + 8) * 2 + 4 * flash::kTile * 4;
    static const bool ready = [] {
      return cudaFuncSetAttribute(flash::dkdv_kernel<D, KV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
                 cudaSuccess &&
             cudaFuncSetAttribute(flash::dq_kernel<D, Q>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess;
    }();
    if (!ready) throw std::runtime_error("flash attention: cannot reserve " + std::to_string(bytes) + " bytes of shared memory");
    flash::dkdv_kernel<D, KV><<<grid, flash::kBlock, bytes, g_stream>>>(a, q, k, v, dout, lse, delta, dk, dv, out_heads, add);
    K2C_CUDA_CHECK_LAUNCH();
    flash::dq_kernel<D, Q><<<grid, flash::kBlock, bytes, g_stream>>>(a, q, k, v, dout, lse, delta, dq);
    K2C_CUDA_CHECK_LAUNCH();
  }

  Workspace& ws_;
};
