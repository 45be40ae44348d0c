// solutions/09_flash_attention/flash_attention_backward.cuh — module 09's reference, part 3 of 4:
// the backward pass by recomputation. dot_kernel (D = rowsum(dO·O), and dQ's sums zeroed) and
// dq_convert_kernel, which run before and after it, then backward_kernel on mma.sync
// (BackwardTile) and Part B's hopper_backward_kernel on wgmma (HopperBackwardTile). Included by
// flash_attention.cu only, inside its unnamed namespace, after the forward pass
// (flash_attention_forward.cuh); the naive kernels (flash_attention_naive.cuh) follow.
#pragma once

// ---- backward -----------------------------------------------------------------------------------

// D_i = Σ_d dO_id · O_id (the softmax gradient's row term, lecture section 7), and row i of dQ's
// fp32 sums zeroed for the backward kernel to add into, in the same pass over the rows. A row is
// D/8 lanes' 16-byte loads of dO and O, so a warp takes 32/(D/8) rows (4 at D = 64) and every lane
// loads: a memory-bound pass needs every lane's bytes in flight (appendix section 5.8).
template <int D, bool kTokens>
__global__ void dot_kernel(Params p, std::size_t rows) {
  constexpr int kLanes = D / 8, kRowsPerWarp = 32 / kLanes;
  const int lane = threadIdx.x % 32, part = lane % kLanes;
  const std::size_t warp = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const std::size_t row = warp * kRowsPerWarp + lane / kLanes;
  float acc = 0;
  if (row < rows) {  // no return: every lane takes part in the shuffles below
    const std::size_t at = p.q_at<D, kTokens>(row);
    const uint4 a = reinterpret_cast<const uint4*>(p.dout + at)[part];
    const uint4 c = reinterpret_cast<const uint4*>(p.o + at)[part];
    const auto* x = reinterpret_cast<const __nv_bfloat162*>(&a);
    const auto* y = reinterpret_cast<const __nv_bfloat162*>(&c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 fx = __bfloat1622float2(x[i]), fy = __bfloat1622float2(y[i]);
      acc += fx.x * fy.x + fx.y * fy.y;
    }
    auto* zero = reinterpret_cast<float4*>(p.dq_accum + row * D);  // D/4 float4: two a lane
    zero[part] = zero[part + kLanes] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (row < rows && part == 0) p.dot[row] = acc;
}

// dot_kernel over `rows` rows: D/8 lanes a row.
template <int D>
void launch_dot(const Params& p, std::size_t rows, cudaStream_t stream) {
  const std::size_t threads = rows * (D / 8);
  auto* kernel = p.tokens_first ? dot_kernel<D, true> : dot_kernel<D, false>;
  kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(p, rows);
}

// dq = bf16(scale · dq_accum), four elements per thread: dq_accum's rows are heads first, dq's in
// the call's layout.
template <int D, bool kTokens = false>
__global__ void dq_convert_kernel(Params p, std::size_t quads) {
  const auto* accum = reinterpret_cast<const float4*>(p.dq_accum);
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < quads;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float4 a = accum[i];
    const std::size_t row = i / (D / 4), quad = i % (D / 4);
    auto* dq = reinterpret_cast<uint2*>(p.dq + p.q_at<D, kTokens>(row)) + quad;
    *dq = make_uint2(pack_bf16x2(a.x * p.scale, a.y * p.scale), pack_bf16x2(a.z * p.scale, a.w * p.scale));
  }
}

// 8 warps, 128 keys per block (16 per warp), query blocks of 64. Everything is computed
// transposed, keys as rows: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ. Then Pᵀ and dSᵀ sit in registers in the
// layout of an A operand for dV += Pᵀ dO and dK += dSᵀ Q, and each warp's dK and dV rows never
// leave it. Only dQ = dS K needs the other orientation: dSᵀ goes to shared memory once, and each
// warp computes a 16·DQ_STRIPS × D/(2·DQ_STRIPS) slice of dQ (32 × D/4 shipped) and adds it into
// the fp32 accumulator in global memory.
// Shared memory: K, V 2·128·D, Q and dO double-buffered 4·64·D, dSᵀ 128·64 bf16 (twice with
// kDqLate), plus lse and D: 161 KiB at D = 128, one block per SM; 97 KiB at D = 64.
template <int D_, int CHUNKS = D_ / 64, int DQ_STRIPS = 2, int SCORE_UNROLL = D_ / 16, bool DQ_LATE = true>
struct BackwardTile {
  static constexpr int D = D_, kChunks = CHUNKS, kDqStrips = DQ_STRIPS, kScoreUnroll = SCORE_UNROLL;
  static constexpr int kKeys = 128, kRows = 64, kWarps = 8, kThreads = 32 * kWarps;
  // kDqLate: step t's dQ is computed in step t + 1, after that step's barrier (and its prefetch),
  // from a second dSᵀ buffer; the barrier between writing dSᵀ and reading it is then the next
  // step's: one barrier a step instead of two, plus one after the loop for the last step's dQ.
  static constexpr bool kDqLate = DQ_LATE;
  static constexpr int kDsBuffers = kDqLate ? 2 : 1;
  static constexpr bool kPair = false;  // clusters: HopperBackwardTile's only
  static constexpr int kSmemBytes = (2 * kKeys * D + 4 * kRows * D + kDsBuffers * kKeys * kRows) * 2 + 4 * kRows * 4;
};

// Adds an fp32 pair into global memory: one vector reduction on sm_90, two scalar ones before.
__device__ __forceinline__ void add_pair(float* dst, float x, float y) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// dK = scale · Σ dSᵀ Q and dV = Σ Pᵀ dO of one warp's 16 key rows (the first is key0), as bf16:
// the accumulator layout of mma.sync's n8 tiles, which wgmma's accumulators share per warp.
template <bool kTokens, int DT>
__device__ __forceinline__ void store_key_rows(const float (&dk)[DT][4], const float (&dv)[DT][4], const Params& p,
                                               int b, int g, int key0, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + acc_row(lane, half);
    if (key >= p.kv_len) continue;
    const std::size_t at = p.kv_at<DT * 8, kTokens>(p.kv_rows(b, g) + key) + acc_col(lane);
    auto* k_out = reinterpret_cast<std::uint32_t*>(p.dk + at);
    auto* v_out = reinterpret_cast<std::uint32_t*>(p.dv + at);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      k_out[dt * 4] = pack_bf16x2(dk[dt][2 * half] * p.scale, dk[dt][2 * half + 1] * p.scale);
      v_out[dt * 4] = pack_bf16x2(dv[dt][2 * half], dv[dt][2 * half + 1]);
    }
  }
}

// The query blocks of BM rows that a key block starting at key n0 walks: under the causal mask,
// query i sees key n0 from i = n0 − offset on, and every query head of the GQA group walks the
// same range. Step t covers query head g·group + t / per_head, rows from m0 = (m_first +
// t % per_head)·BM.
template <int BM>
struct QueryWalk {
  static constexpr int shared_steps = 0;  // none taken in step with another block (PairWalk's are)
  int m_first, per_head, steps;
  __device__ QueryWalk(const Params& p, int n0) {
    const int first_query = p.causal ? max(0, n0 - (p.kv_len - p.q_len)) : 0;
    m_first = first_query / BM;
    per_head = first_query < p.q_len ? ceil_div(p.q_len, BM) - m_first : 0;
    steps = p.group * per_head;
  }
  // Sets m0 for step t and returns the first row of its query head.
  __device__ std::size_t rows(const Params& p, int b, int g, int t, int& m0) const {
    m0 = (m_first + t % per_head) * BM;
    return p.q_rows(b, g * p.group + t / per_head);
  }
};

// A step's rows' lse and D into shared memory by 4-byte cp.async, in the same group as its Q and
// dO tiles: threads 0..BM-1 copy lse, BM..2·BM-1 copy D. So they never occupy a register (loaded
// into registers, they were held across the step's math, and at 255 registers spilled right
// after the load). Rows past the end read as zeros: their Q and dO rows are zero too, so S = 0,
// P = 1, dP = 0 and dS = 0, and their P·dO adds exact zeros (their dQ is never stored).
template <int BM>
__device__ __forceinline__ void fetch_row_terms(const Params& p, std::size_t head_row0, int m0, float* lse,
                                                float* dot, int tid) {
  if (tid < 2 * BM) {
    const int row = tid % BM;
    const bool ok = m0 + row < p.q_len;
    const float* src = tid < BM ? p.lse_in : p.dot;
    float* dst = (tid < BM ? lse : dot) + row;
    tc::cp_async_4(smem_addr(dst), ok ? src + head_row0 + m0 + row : src, ok);
  }
}

template <class T, bool kTokens = false>
__global__ void __launch_bounds__(T::kThreads, 1) backward_kernel(Params p) {
  constexpr int D = T::D, BN = T::kKeys, BM = T::kRows, QT = BM / 8, DT = D / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t sK = smem_addr(smem), sV = sK + BN * D * 2;
  auto sQ = [&](int stage) { return sV + BN * D * 2 + stage * BM * D * 2; };
  auto sdO = [&](int stage) { return sV + BN * D * 2 + (2 + stage) * BM * D * 2; };
  auto sdS = [&](int t) {  // dSᵀ of step t: BN rows of BM
    return sV + BN * D * 2 + 4 * BM * D * 2 + (T::kDqLate ? t & 1 : 0) * BN * BM * 2;
  };
  float* s_lse = reinterpret_cast<float*>(smem + (2 * BN * D + 4 * BM * D + T::kDsBuffers * BN * BM) * 2);  // [2][BM]
  float* s_dot = s_lse + 2 * BM;                                                           // [2][BM]
  static_assert(T::kThreads >= 2 * BM, "fetch copies lse and D with a thread per row each");

  int rank, g, b;
  launch_place(p.wave_heads, rank, g, b);
  const int n0 = rank * BN;  // the first key blocks are seen by the most queries
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
  const std::size_t kv_row0 = p.kv_rows(b, g) + n0;
  const QueryWalk<BM> walk(p, n0);
  const int steps = walk.steps;
  auto step_rows = [&](int t, int& m0) { return walk.rows(p, b, g, t, m0); };

  load_tile<BN, D, T::kThreads>(sK, p.k + p.kv_at<D, kTokens>(kv_row0), p.kv_ld<D, kTokens>(), p.kv_len - n0, tid);
  load_tile<BN, D, T::kThreads>(sV, p.v + p.kv_at<D, kTokens>(kv_row0), p.kv_ld<D, kTokens>(), p.kv_len - n0, tid);

  // Issues the copies of step t's Q and dO tiles, and its rows' lse and D in the same group.
  auto fetch = [&](int t) {
    int m0;
    const std::size_t r = step_rows(t, m0);
    const std::size_t at = p.q_at<D, kTokens>(r + m0);
    load_tile<BM, D, T::kThreads>(sQ(t & 1), p.q + at, p.q_ld<D, kTokens>(), p.q_len - m0, tid);
    load_tile<BM, D, T::kThreads>(sdO(t & 1), p.dout + at, p.q_ld<D, kTokens>(), p.q_len - m0, tid);
    fetch_row_terms<BM>(p, r, m0, s_lse + (t & 1) * BM, s_dot + (t & 1) * BM, tid);
  };

  float dk[DT][4] = {}, dv[DT][4] = {};
  const int key_row = warp * 16;  // this warp's 16 keys inside the block
  if (steps > 0) fetch(0);
  tc::cp_async_commit();

  // dQ (BM × D) += dS K of step t, k = the BN keys: the warps split the BM × D tile into
  // kDqStrips·16 rows × DC columns each. dS is stored transposed, so its A fragments come from
  // the transposing ldmatrix. Every warp's dSᵀ rows of step t must be in shared memory.
  auto dq_step = [&](int t) {
    int m0;
    const std::size_t q_row0 = step_rows(t, m0);
    constexpr int S = T::kDqStrips, RG = BM / (16 * S), DC = D / (T::kWarps / RG);
    const int qrow = (warp % RG) * 16 * S, dcol = (warp / RG) * DC;
    float dq[S][DC / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < BN; kk += 16) {
      std::uint32_t a[S][4];
#pragma unroll
      for (int st = 0; st < S; ++st)
        ldmatrix_x4_trans(a[st], swizzled<BM>(sdS(t), kk + (lane & 7) + ((lane >> 4) << 3),
                                              (qrow + 16 * st) / 8 + ((lane >> 3) & 1)));
#pragma unroll
      for (int dt = 0; dt < DC / 8; dt += 2) {
        std::uint32_t bk[4];
        load_b_kn<D>(bk, sK, kk, dcol + dt * 8, lane);
#pragma unroll
        for (int st = 0; st < S; ++st) {
          mma(dq[st][dt], a[st], bk[0], bk[1]);
          mma(dq[st][dt + 1], a[st], bk[2], bk[3]);
        }
      }
    }
#pragma unroll
    for (int st = 0; st < S; ++st)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m0 + qrow + 16 * st + acc_row(lane, half);
        if (row >= p.q_len) continue;
        float* dst = p.dq_accum + (q_row0 + row) * D + dcol + acc_col(lane);
#pragma unroll
        for (int dt = 0; dt < DC / 8; ++dt) add_pair(dst + dt * 8, dq[st][dt][2 * half], dq[st][dt][2 * half + 1]);
      }
  };

  for (int t = 0; t < steps; ++t) {
    int m0;
    step_rows(t, m0);
    // As in the forward pass: wait, one barrier, then prefetch into the buffer step t − 1 used.
    tc::cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < steps) fetch(t + 1);
    tc::cp_async_commit();
    if constexpr (T::kDqLate) {
      if (t > 0) dq_step(t - 1);  // its dSᵀ was completed before the barrier above
    }
    const float* lse2 = s_lse + (t & 1) * BM;
    const float* dot = s_dot + (t & 1) * BM;

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys × BM queries, a chunk of query columns at a
    // time so that only one chunk's fp32 scores are live (registers are the scarce resource here:
    // dK and dV alone hold D fp32 per thread, D/2 each). Each chunk ends as bf16 pairs of Pᵀ and dSᵀ, which
    // are already the A operands of dV += Pᵀ dO and dK += dSᵀ Q.
    const bool masked = n0 + BN > p.kv_len || (p.causal && n0 + BN - 1 > m0 + mask.offset);
    std::uint32_t ap[BM / 16][4], ads[BM / 16][4];
#pragma unroll
    for (int c = 0; c < T::kChunks; ++c) {
      constexpr int CQ = QT / T::kChunks;
      float sT[CQ][4] = {}, dpT[CQ][4] = {};
#pragma unroll T::kScoreUnroll
      for (int kk = 0; kk < D; kk += 16) {
        std::uint32_t ak[4], av[4];
        load_a<D>(ak, sK, key_row, kk, lane);
        load_a<D>(av, sV, key_row, kk, lane);
#pragma unroll
        for (int i = 0; i < CQ; i += 2) {
          std::uint32_t bq[4], bo[4];
          load_b_nk<D>(bq, sQ(t & 1), (c * CQ + i) * 8, kk, lane);
          load_b_nk<D>(bo, sdO(t & 1), (c * CQ + i) * 8, kk, lane);
          mma(sT[i], ak, bq[0], bq[1]);
          mma(sT[i + 1], ak, bq[2], bq[3]);
          mma(dpT[i], av, bo[0], bo[1]);
          mma(dpT[i + 1], av, bo[2], bo[3]);
        }
      }
      // Pᵀ = exp(scale·Sᵀ − lse) recomputed (zero where masked), then dSᵀ = Pᵀ ∘ (dPᵀ − D).
#pragma unroll
      for (int i = 0; i < CQ; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + key_row + acc_row(lane, e / 2), col = (c * CQ + i) * 8 + acc_col(lane) + e % 2;
          float pr = fast_exp2(fmaf(sT[i][e], p.scale_log2, -lse2[col] * kLog2e));
          if (masked && mask.hidden(m0 + col, key)) pr = 0.0f;
          sT[i][e] = pr;
          dpT[i][e] = pr * (dpT[i][e] - dot[col]);
        }
#pragma unroll
      for (int i = 0; i < CQ; i += 2) {
        accumulators_to_a(ap[(c * CQ + i) / 2], sT[i], sT[i + 1]);
        accumulators_to_a(ads[(c * CQ + i) / 2], dpT[i], dpT[i + 1]);
      }
    }

    // dV += Pᵀ dO and dK += dSᵀ Q (k = the BM queries).
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        std::uint32_t bo[4], bq[4];
        load_b_kn<D>(bo, sdO(t & 1), kk * 16, dt * 8, lane);
        load_b_kn<D>(bq, sQ(t & 1), kk * 16, dt * 8, lane);
        mma(dv[dt], ap[kk], bo[0], bo[1]);
        mma(dv[dt + 1], ap[kk], bo[2], bo[3]);
        mma(dk[dt], ads[kk], bq[0], bq[1]);
        mma(dk[dt + 1], ads[kk], bq[2], bq[3]);
      }
    }

    // dSᵀ to shared memory (bf16, the same swizzle with BM-wide rows) for dQ. Register
    // ads[kk][2·(qt % 2) + half] of the A fragment holds n8 tile qt = 2·kk + qt % 2, row half.
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = key_row + acc_row(lane, half);
        const std::uint32_t at = swizzled<BM>(sdS(t), row, qt) + acc_col(lane) * 2;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(ads[qt / 2][2 * (qt % 2) + half]));
      }
    if constexpr (!T::kDqLate) {
      __syncthreads();  // dSᵀ complete (the next step's first barrier guards its reuse)
      dq_step(t);
    }
  }
  if constexpr (T::kDqLate) {
    if (steps > 0) {
      __syncthreads();  // the last step's dSᵀ complete
      dq_step(steps - 1);
    }
  }
  tc::cp_async_wait<0>();

  store_key_rows<kTokens>(dk, dv, p, b, g, n0 + key_row, lane);
}

// ---- Part B: the backward pass on Hopper's warpgroup MMA (sm_90a) --------------------------------
//
// backward_kernel's structure with wgmma: two warpgroups of 128 threads, 64 keys each (128 keys
// per block), query steps of 64 rows. Sᵀ = K Qᵀ and dPᵀ = V dOᵀ read both operands from shared
// memory, as two commit groups, so that Pᵀ is computed while dPᵀ is still on the tensor cores.
// Pᵀ and dSᵀ go from the accumulators straight into A fragments for dV += Pᵀ dO and dK += dSᵀ Q
// (dO and Q read MN-major), and dSᵀ also goes to shared memory, where dQ = dS K reads it as an
// MN-major A operand. There is no ldmatrix at all: waiting for ldmatrix results is where the
// mma.sync backward's warps stall most (lecture sections 10.6 and 11). Once dSᵀ is published, dQ's
// product goes to the tensor cores before dV's and dK's, so that the step's dQ atomic adds run
// while those two are still computing (kDqOrder, below). Tiles are laid out as the
// Hopper forward lays them out (load_tile_sw128). Shared memory: K, V 2·128·D, Q and dO
// double-buffered 4·64·D, dSᵀ 128·64 bf16, lse and D: 145 KiB at D = 128, 146 KiB with the 1 KiB
// of alignment slack (at D = 64, 81 KiB and the 16 KiB the warpgroups swap dQ halves through),
// one block per SM and 255 registers per thread at D = 128 (243 at D = 64), no spill.
// kProbe: what a step leaves out, for lab/flash_attention.cu's timing probes only (their results
// are wrong; the library never launches them): dQ's atomic adds, or dQ altogether, with or
// without the barrier that publishes dSᵀ to it.
// kBuffers: the Q, dO, lse and D buffers, so kBuffers − 1 steps' copies are in flight while a step
// computes (2: the next step's only).
// kPair: blocks run in clusters of two, neighbouring key blocks of one head, which walk their
// common query blocks in step and sum their dQ blocks in shared memory before adding them into
// dq_accum: every element is added half as often (see the kernel).
// kDefer: a step's dQ adds are issued in the next step, once its Sᵀ and dPᵀ products are on the
// tensor cores, each thread's sums parked in shared memory in between.
// kDqOrder: where a step's dQ product goes among dV's and dK's, and what its adds wait for.
// after: dV and dK issued before the barrier that publishes dSᵀ, dQ after it, all three waited for
// before the adds. first: dQ issued first once dSᵀ is published, then dV and dK, and the adds
// wait for dQ alone, so they run while dV and dK are on the tensor cores. between: dV before the
// barrier, then dQ, then dK, the adds under dK. On an H100, first ran 1.118 times as fast as
// after at d = 128 (causal) and 1.015 times at d = 64; between 1.065 and 1.034 times
// (lab/flash_attention.cu dq_first). The shipped kernel issues dQ first; the probes, pairs and
// deferred adds keep the order they were measured with.
enum class BackwardProbe { none, no_dq_adds, no_dq, no_dq_no_barrier };
enum class DqOrder { after, first, between };
template <int D_, BackwardProbe kProbe_ = BackwardProbe::none, int kBuffers_ = 2, bool kPair_ = false,
          bool kDefer_ = false,
          DqOrder kDqOrder_ = kProbe_ == BackwardProbe::none && !kPair_ && !kDefer_ ? DqOrder::first : DqOrder::after>
struct HopperBackwardTile {
  static constexpr int D = D_, kKeys = 128, kRows = 64, kThreads = 256, kBuffers = kBuffers_;
  static_assert(kBuffers >= 2, "a step's copies and the next step's at least");
  static constexpr BackwardProbe kProbe = kProbe_;
  static constexpr bool kPair = kPair_, kDefer = kDefer_;
  static constexpr DqOrder kDqOrder = kDqOrder_;
  static_assert(!(kPair && kDefer), "one way of moving the adds at a time");
  static_assert(kDqOrder == DqOrder::after || (kProbe == BackwardProbe::none && !kPair && !kDefer),
                "dQ before dV or dK with the plain adds only");
  static_assert(!kDefer || kProbe == BackwardProbe::none, "a probe without adds would add parked garbage");
  static constexpr int kKvBytes = kKeys * D * 2, kRowBytes = kRows * D * 2, kDsBytes = kKeys * kRows * 2;
  // dQ's BM × D tile, split between the warpgroups as 64-column blocks: at D = 128 each takes its
  // own block over all 128 keys; at D = 64 both take the one block, each over its own 64 keys,
  // and they swap halves so that each adds 32 columns of the sum into dq_accum (an m64n32
  // half-block each would start half-way into a swizzled 128-byte row).
  static constexpr int kDqKeys = D == 128 ? kKeys : kKeys / 2;
  // At D = 64 the warpgroups swap the halves of their dQ blocks that the other one adds: 16 floats
  // a thread each way (see the kernel).
  static constexpr int kSwapBytes = D == 64 ? 2 * 128 * 16 * 4 : 0;
  // kPair: the holders of one dQ element's partial sums in a step (the pair's two blocks, times
  // the two warpgroups at D = 64); each adds kHeldTiles of a thread's 8 n8 tiles, for every
  // holder. A block's inbox, per step parity: [its holder][sender][tile][thread] float4, a thread
  // named by its index in the block at D = 128 (the warpgroups hold different columns) and in its
  // warpgroup at D = 64 (both hold the same ones).
  static constexpr int kHolders = D == 128 ? 2 : 4, kHeldTiles = 8 / kHolders, kLocalHolders = kHolders / 2;
  static constexpr int kInboxThreads = D == 128 ? 256 : 128;
  static constexpr int kInboxBytes = kLocalHolders * kHolders * kHeldTiles * kInboxThreads * 16;
  // What the other holders send a block in a step (its own holders' parts it stores itself).
  static constexpr int kIncomingBytes = kLocalHolders * (kHolders - 1) * kHeldTiles * kInboxThreads * 16;
  // kDefer: [step parity][tile][thread] float4, a thread's 8 n8 tiles of dQ.
  static constexpr int kParkBytes = kDefer ? 2 * 8 * kThreads * 16 : 0;
  static constexpr int kSmemBytes = 2 * kKvBytes + 2 * kBuffers * kRowBytes + kDsBytes + 2 * kBuffers * kRows * 4 +
                                    kSwapBytes + (kPair ? 2 * kInboxBytes + 4 * 8 : 0) + kParkBytes + 1024;
};

// The query blocks a key block walks in a pair (kPair): first the ones both blocks of the pair
// walk, in step (the second block's, which the causal mask starts later: every query head of the
// group), then, for the first block only, its own first query blocks, which the second block's
// keys do not see. rows() as QueryWalk's; shared_steps: the steps taken in step with the other.
template <int BM>
struct PairWalk {
  int m_shared, per_shared, shared_steps, m_own, per_own, steps;
  __device__ PairWalk(const Params& p, int n0_first, int keys, int member) {
    const QueryWalk<BM> first(p, n0_first), second(p, n0_first + keys);
    per_shared = n0_first + keys < p.kv_len ? second.per_head : 0;  // no second block past the last key
    m_shared = second.m_first;
    shared_steps = p.group * per_shared;
    m_own = first.m_first;
    per_own = member == 0 ? first.per_head - per_shared : 0;
    steps = shared_steps + p.group * per_own;
  }
  __device__ std::size_t rows(const Params& p, int b, int g, int t, int& m0) const {
    if (t < shared_steps) {
      m0 = (m_shared + t % per_shared) * BM;
      return p.q_rows(b, g * p.group + t / per_shared);
    }
    const int e = t - shared_steps;
    m0 = (m_own + e % per_own) * BM;
    return p.q_rows(b, g * p.group + e / per_own);
  }
};

template <class T, bool kTokens = false>
__global__ void __launch_bounds__(T::kThreads, 1) hopper_backward_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace hp = k2c::hopper;
  constexpr int D = T::D, BN = T::kKeys, BM = T::kRows, DT = D / 8, QT = BM / 8;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  const std::uint32_t sK = base, sV = base + T::kKvBytes;
  constexpr unsigned NB = T::kBuffers;  // unsigned: t % NB compiles to t & 1 where NB = 2
  auto sQ = [&](int t) { return base + 2 * T::kKvBytes + (t % NB) * T::kRowBytes; };
  auto sdO = [&](int t) { return base + 2 * T::kKvBytes + (NB + t % NB) * T::kRowBytes; };
  const std::uint32_t sdS = base + 2 * T::kKvBytes + 2 * NB * T::kRowBytes;  // dSᵀ: BN rows of BM, one block
  float* s_lse = reinterpret_cast<float*>(smem_raw + (sdS + T::kDsBytes - smem_addr(smem_raw)));  // [NB][BM]
  float* s_dot = s_lse + NB * BM;                                                                 // [NB][BM]
  const std::uint32_t sSwap = sdS + T::kDsBytes + 2 * NB * BM * 4;  // D = 64: [warpgroup][4][128] float4
  const std::uint32_t sInbox = sSwap + T::kSwapBytes;                // kPair: [step parity] inboxes
  // kPair: full[parity] completes when a step's inbox holds every other holder's part (one
  // arrival, this block's thread 0 announcing the bytes, and the bytes); empty[parity] when the
  // other block has read what this one sent it two steps before (one arrival, from it).
  const std::uint32_t full0 = sInbox + 2 * T::kInboxBytes, empty0 = full0 + 16;
  const std::uint32_t sPark = sInbox + (T::kPair ? 2 * T::kInboxBytes + 32 : 0);  // kDefer

  int rank, g, b, member = 0;
  if constexpr (T::kPair) {
    // Cluster c of the grid's pairs takes key blocks 2r and 2r + 1 of a head, r placed as
    // launch_place places a block.
    member = static_cast<int>(hp::cluster_rank());
    tile_place(launch_index() / 2, gridDim.x / 2, static_cast<int>(gridDim.y),
               static_cast<long long>(gridDim.y) * gridDim.z, p.wave_heads, rank, g, b);
    rank = 2 * rank + member;
    if (threadIdx.x == 0) {
      for (int i = 0; i < 2; ++i) hp::mbarrier_init(full0 + 8 * i, 1), hp::mbarrier_init(empty0 + 8 * i, 1);
      hp::fence_barrier_init();
    }
    hp::cluster_sync();  // both blocks run, their barriers ready, before either signals the other
    if (rank * BN >= p.kv_len) return;  // the second block of a pair past the last key: no work
  } else {
    launch_place(p.wave_heads, rank, g, b);
  }
  const int n0 = rank * BN;
  const int tid = threadIdx.x, lane = tid % 32, wg = tid / 128, warp = (tid / 32) % 4;
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
  const std::size_t kv_row0 = p.kv_rows(b, g) + n0;
  const auto walk = [&] {
    if constexpr (T::kPair) return PairWalk<BM>(p, n0 - member * BN, BN, member);
    else return QueryWalk<BM>(p, n0);
  }();
  static_assert(T::kThreads >= 2 * BM, "fetch copies lse and D with a thread per row each");
  auto fetch = [&](int t) {
    int m0;
    const std::size_t r = walk.rows(p, b, g, t, m0);
    const std::size_t at = p.q_at<D, kTokens>(r + m0);
    load_tile_sw128<BM, D, T::kThreads>(sQ(t), p.q + at, p.q_ld<D, kTokens>(), p.q_len - m0, tid);
    load_tile_sw128<BM, D, T::kThreads>(sdO(t), p.dout + at, p.q_ld<D, kTokens>(), p.q_len - m0, tid);
    fetch_row_terms<BM>(p, r, m0, s_lse + (t % NB) * BM, s_dot + (t % NB) * BM, tid);
  };

  load_tile_sw128<BN, D, T::kThreads>(sK, p.k + p.kv_at<D, kTokens>(kv_row0), p.kv_ld<D, kTokens>(), p.kv_len - n0, tid);
  load_tile_sw128<BN, D, T::kThreads>(sV, p.v + p.kv_at<D, kTokens>(kv_row0), p.kv_ld<D, kTokens>(), p.kv_len - n0, tid);
  if (walk.steps > 0) fetch(0);
  tc::cp_async_commit();
  for (int t = 1; t + 1 < T::kBuffers; ++t) {  // the other steps in flight at the first, one group each
    if (t < walk.steps) fetch(t);
    tc::cp_async_commit();
  }

  float dk[DT][4] = {}, dv[DT][4] = {};     // the warpgroup's 64 key rows, accumulator layout per warp
  const int key_row = 64 * wg + 16 * warp;  // this warp's 16 keys: rows key_row + lane/4 (+8)
  // Every descriptor below is one of eight first descriptors plus a byte offset (only the address
  // field changes: hp::smem_desc_plus), known at compile time apart from the step's Q / dO
  // buffer, and the first descriptors pass through `opaque` in each step. Otherwise the compiler hoists the loop-invariant ones, dozens of 64-bit values,
  // out of the loop and holds them in registers across it: at d = 128 that spilled 124 bytes and
  // measured 12 to 14 % slower (lecture section 10.6).
  const std::uint64_t k_desc0 = hp::smem_desc_128b(sK + 64 * wg * 128), v_desc0 = hp::smem_desc_128b(sV + 64 * wg * 128),
                      q_desc0 = hp::smem_desc_128b(sQ(0)), do_desc0 = hp::smem_desc_128b(sdO(0)),
                      q_mn0 = hp::smem_desc_128b_mn(sQ(0), BM * 128), do_mn0 = hp::smem_desc_128b_mn(sdO(0), BM * 128);
  // The k16 slice kk of a K-major tile of `rows` rows: 64-column blocks, 32 bytes per slice.
  auto slice = [](std::uint64_t tile, int rows, int kk) {
    return hp::smem_desc_plus(tile, (kk / 4) * rows * 128 + (kk % 4) * 32);
  };
  // kPair: a shared step's dQ block goes out to its holders (hand_out, at the step's end: every
  // tile into the inbox of the holder that adds it), and each holder adds its tiles' sums one step
  // later (add_held), once its block's full barrier says every part has landed. A holder's own part
  // is a plain store that the same thread reads back; the others' come by st.async, which
  // completes their bytes on the receiving block's barrier and orders nothing else: no fence waits
  // for this thread's earlier atomic adds (with barrier.cluster's release, which did, the pairs ran
  // at 0.73-0.79 of the one-block kernel's rate, dQ after dV and dK; this way at 0.83-0.89). Step t uses the inboxes and
  // barriers of parity t % 2; a block's thread 0 announces step t's bytes at its top, and, from
  // step 2 on, tells the other block that step t − 2's inbox is read (every thread read it in step
  // t − 1, before this step's barrier), which that block waits for before it writes that parity
  // again. At D = 128 a holder is a block (tiles 4·member on); at D = 64 a warpgroup of either
  // block (holder 2·member + warpgroup, tiles 2·holder on), and the warpgroups of one block send
  // each other their parts by st.async too: those writes of parity t % 2 come after step t's
  // __syncthreads, which follows every thread's reads of step t − 2's. No cluster barrier is needed
  // before a block exits: whatever the other block sends into it (bytes, arrivals) is consumed by a
  // wait of its own before it gets there.
  constexpr int kHeld = T::kHeldTiles, kLocal = T::kLocalHolders;
  const int holder = member * kLocal + (kLocal == 2 ? wg : 0);
  const int inbox_thread = tid % T::kInboxThreads;
  auto inbox = [&](int t, int local_holder, int sender, int tile) {
    return sInbox + (t & 1) * T::kInboxBytes +
           (((local_holder * T::kHolders + sender) * kHeld + tile) * T::kInboxThreads + inbox_thread) * 16;
  };
  auto step_top = [&](int t) {  // after the step's barrier
    if (tid == 0 && t < walk.shared_steps) {
      if (t >= 2) hp::mbarrier_arrive_cluster(empty0 + 8 * (t & 1), 1 - member);
      hp::mbarrier_arrive_expect_tx(full0 + 8 * (t & 1), T::kIncomingBytes);
    }
  };
  auto hand_out = [&](const float (&dq)[32], int t) {
    if (t >= 2) hp::mbarrier_wait(empty0 + 8 * (t & 1), ((t >> 1) - 1) & 1);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int owner = j / kHeld, cta = owner / kLocal;
      const std::uint32_t at = inbox(t, owner % kLocal, holder, j % kHeld);
      const float* v = dq + 4 * j;
      if (owner == holder)
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]));
      else
        hp::store_remote_v4(at, full0 + 8 * (t & 1), cta, v[0], v[1], v[2], v[3]);
    }
  };
  auto add_held = [&](int t) {
    hp::mbarrier_wait(full0 + 8 * (t & 1), (t >> 1) & 1);
    int m0;
    const std::size_t q_row0 = walk.rows(p, b, g, t, m0);
    const int dq_block = D == 128 ? wg : 0;
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      float x = 0, y = 0, z = 0, w = 0;
#pragma unroll
      for (int sender = 0; sender < T::kHolders; ++sender) {
        float a, c, d, e;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(a), "=f"(c), "=f"(d), "=f"(e)
                     : "r"(inbox(t, holder % kLocal, sender, k)));
        x += a, y += c, z += d, w += e;
      }
      const int j = holder * kHeld + k;
      float* dst = p.dq_accum + q_row0 * D + 64 * dq_block + acc_col(lane) + 8 * j;
      const int row = m0 + 16 * warp + acc_row(lane, 0);
      if (row < p.q_len) add_pair(dst + std::size_t(row) * D, x, y);
      if (row + 8 < p.q_len) add_pair(dst + std::size_t(row + 8) * D, z, w);
    }
  };
  (void)step_top, (void)hand_out, (void)add_held;

  // kDefer: a thread's tiles j0 .. j0 + tiles − 1 of step t's dQ (the ones it adds: all 8 at
  // D = 128, its warpgroup's half after the swap at D = 64) parked, and added one step later. A
  // thread reads back only what it parked itself, so no barrier orders the two.
  const int park_j0 = D == 128 ? 0 : 4 * wg, park_tiles = D == 128 ? 8 : 4;
  auto park = [&](int t, const float (&dq)[32]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < park_j0 || j >= park_j0 + park_tiles) continue;
      const float* v = dq + 4 * j;
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(sPark + (((t & 1) * 8 + j) * T::kThreads + tid) * 16),
                   "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]));
    }
  };
  auto add_parked = [&](int t) {
    int m0;
    const std::size_t q_row0 = walk.rows(p, b, g, t, m0);
    const int dq_block = D == 128 ? wg : 0, row = m0 + 16 * warp + acc_row(lane, 0);
    float* dst = p.dq_accum + q_row0 * D + 64 * dq_block + acc_col(lane);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < park_j0 || j >= park_j0 + park_tiles) continue;
      float x, y, z, w;
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(x), "=f"(y), "=f"(z), "=f"(w)
                   : "r"(sPark + (((t & 1) * 8 + j) * T::kThreads + tid) * 16));
      if (row < p.q_len) add_pair(dst + std::size_t(row) * D + 8 * j, x, y);
      if (row + 8 < p.q_len) add_pair(dst + std::size_t(row + 8) * D + 8 * j, z, w);
    }
  };
  (void)park, (void)add_parked;

  for (int t = 0; t < walk.steps; ++t) {
    int m0;
    const std::size_t q_row0 = walk.rows(p, b, g, t, m0);
    // As in the mma.sync kernel: wait, one barrier, then prefetch into the buffers step t − 1
    // used (its wgmmas were waited for at its end). The fence makes the cp.async data visible
    // to wgmma, which reads shared memory through the async proxy.
    tc::cp_async_wait<T::kBuffers - 2>();  // this step's group (the later steps' may still be in flight)
    hp::fence_proxy_async();
    __syncthreads();
    if (t + T::kBuffers - 1 < walk.steps) fetch(t + T::kBuffers - 1);
    tc::cp_async_commit();
    if constexpr (T::kPair) step_top(t);

    // Sᵀ and dPᵀ, the warpgroup's 64 keys × BM queries, D/16 k16 steps each, as two groups.
    const std::uint32_t buffer = (t % NB) * T::kRowBytes;  // this step's Q and dO buffers
    float sT[QT][4], dpT[QT][4];
    hp::wgmma_fence();
    {
      const std::uint64_t k_desc = opaque(k_desc0), q_desc = hp::smem_desc_plus(opaque(q_desc0), buffer);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        hp::wgmma_m64n64k16_ss(reinterpret_cast<float(&)[QT * 4]>(sT), slice(k_desc, BN, kk), slice(q_desc, BM, kk), kk > 0);
    }
    hp::wgmma_commit();
    {
      const std::uint64_t v_desc = opaque(v_desc0), do_desc = hp::smem_desc_plus(opaque(do_desc0), buffer);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        hp::wgmma_m64n64k16_ss(reinterpret_cast<float(&)[QT * 4]>(dpT), slice(v_desc, BN, kk), slice(do_desc, BM, kk), kk > 0);
    }
    hp::wgmma_commit();
    if constexpr (T::kPair) {
      if (t > 0 && t - 1 < walk.shared_steps) add_held(t - 1);  // while Sᵀ and dPᵀ run
    }
    if constexpr (T::kDefer) {
      if (t > 0) add_parked(t - 1);  // while Sᵀ and dPᵀ run
    }

    // Pᵀ and dSᵀ exactly as in the mma.sync kernel: a warp's share of a wgmma accumulator has the
    // layout of mma.sync's n8 tiles.
    const float* lse = s_lse + (t % NB) * BM;
    const float* dot = s_dot + (t % NB) * BM;
    const bool masked = n0 + BN > p.kv_len || (p.causal && n0 + BN - 1 > m0 + mask.offset);
    hp::wgmma_wait<1>();  // Sᵀ is done; dPᵀ may still run
#pragma unroll
    for (int i = 0; i < QT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + key_row + acc_row(lane, e / 2), col = i * 8 + acc_col(lane) + e % 2;
        float pr = fast_exp2(fmaf(sT[i][e], p.scale_log2, -lse[col] * kLog2e));
        if (masked && mask.hidden(m0 + col, key)) pr = 0.0f;
        sT[i][e] = pr;
      }
    hp::wgmma_wait<0>();  // dPᵀ
#pragma unroll
    for (int i = 0; i < QT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpT[i][e] = sT[i][e] * (dpT[i][e] - dot[i * 8 + acc_col(lane) + e % 2]);
    std::uint32_t ap[BM / 16][4], ads[BM / 16][4];
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      accumulators_to_a(ap[kq], sT[2 * kq], sT[2 * kq + 1]);
      accumulators_to_a(ads[kq], dpT[2 * kq], dpT[2 * kq + 1]);
    }
    // dSᵀ to shared memory: rows = keys, 128-byte rows of BM queries, swizzled, the A of dQ. It
    // is stored before the wgmma below takes ads as its A operand: registers a wgmma reads may
    // not be touched, not even read, until its group has been waited for.
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = key_row + acc_row(lane, half);
        const std::uint32_t at = sdS + row * 128 + ((qt ^ (row & 7)) << 4) + acc_col(lane) * 2;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(ads[qt / 2][2 * (qt % 2) + half]));
      }

    // dV += Pᵀ dO and dK += dSᵀ Q, k = the BM queries: dO and Q read MN-major.
    // (which: 1 dV, 2 dK, 3 both, as one commit group.)
    auto issue_dkv = [&](int which) {
      hp::wgmma_fence();
      const std::uint64_t do_mn = hp::smem_desc_plus(opaque(do_mn0), buffer), q_mn = hp::smem_desc_plus(opaque(q_mn0), buffer);
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        if (which & 1) wgmma_rs_tb<D>(dv, ap[kq], hp::smem_desc_plus(do_mn, kq * 16 * 128));
        if (which & 2) wgmma_rs_tb<D>(dk, ads[kq], hp::smem_desc_plus(q_mn, kq * 16 * 128));
      }
      hp::wgmma_commit();
    };
    if constexpr (T::kDqOrder == DqOrder::after) issue_dkv(3);
    if constexpr (T::kDqOrder == DqOrder::between) issue_dkv(1);

    if constexpr (T::kProbe == BackwardProbe::no_dq || T::kProbe == BackwardProbe::no_dq_no_barrier) {
      if constexpr (T::kProbe == BackwardProbe::no_dq) {
        hp::fence_proxy_async();
        __syncthreads();
      }
      hp::wgmma_wait<0>();
    } else {
      hp::fence_proxy_async();  // the dSᵀ stores above, before wgmma reads them
      __syncthreads();

      // dQ (BM × 64 columns, block dq_block) += dS K over kDqKeys keys from dq_key0: dS is dSᵀ read
      // MN-major, K read MN-major (keys are k, head_dim is n).
      const int dq_block = D == 128 ? wg : 0, dq_key0 = D == 128 ? 0 : 64 * wg;
      float dq[32];
      hp::wgmma_fence();
      {
        const std::uint64_t ds_mn = opaque(hp::smem_desc_128b_mn(sdS + dq_key0 * 128, BN * 128)),
                            k_mn = opaque(hp::smem_desc_128b_mn(sK + dq_block * BN * 128 + dq_key0 * 128, BN * 128));
#pragma unroll
        for (int kk = 0; kk < T::kDqKeys / 16; ++kk)
          hp::wgmma_m64n64k16_ss<1, 1>(dq, hp::smem_desc_plus(ds_mn, kk * 16 * 128), hp::smem_desc_plus(k_mn, kk * 16 * 128),
                                       kk > 0);
      }
      hp::wgmma_commit();
      if constexpr (T::kDqOrder == DqOrder::after) {
        hp::wgmma_wait<0>();  // dQ, and the dV / dK group above (whose A fragments are ap and ads)
      } else {
        issue_dkv(T::kDqOrder == DqOrder::first ? 3 : 2);
        hp::wgmma_wait<1>();  // dQ (and dV before it); what follows it, which reads ap or ads, may still run
      }
      // dq's n8 tiles j0 .. j0 + tiles - 1 of both rows into dq_accum, an atomic add per float
      // pair. These adds cost the kernel a fifth of its time at D = 128 and two fifths at D = 64,
      // and bulk or TMA reductions of the same sums were no faster (lecture 09's appendix, 5.4).
      auto add_tiles = [&](int j0, int tiles) {
        if constexpr (T::kDefer) {
          (void)j0, (void)tiles;  // the same tiles: park_j0 and park_tiles
          park(t, dq);
        } else {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = m0 + 16 * warp + acc_row(lane, half);
            if (row >= p.q_len) continue;
            float* dst = p.dq_accum + (q_row0 + row) * D + 64 * dq_block + acc_col(lane);
#pragma unroll
            for (int j = j0; j < j0 + tiles; ++j) add_pair(dst + 8 * j, dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
          }
        }
      };
      if constexpr (T::kProbe == BackwardProbe::no_dq_adds) {
        (void)add_tiles;  // the probe leaves them out
      } else if (T::kPair && t < walk.shared_steps) {
        hand_out(dq, t);
      } else if constexpr (D == 128) {
        add_tiles(0, 8);
      } else {
        // D = 64: both warpgroups hold the same block, each summed over its own 64 keys, in the
        // same layout (thread t of one holds what thread t of the other holds). Each hands the
        // other the half it will not add, columns 32-63 from warpgroup 0 and 0-31 from 1, and adds
        // the other's half into its own: one atomic add per element instead of two.
        const int wt = tid % 128;
        auto swap_out = [&](auto give) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float* v = dq + 4 * (decltype(give)::value + i);
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(sSwap + ((wg * 4 + i) * 128 + wt) * 16),
                         "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]));
          }
        };
        auto swap_in = [&](auto keep) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float* v = dq + 4 * (decltype(keep)::value + i);
            float x, y, z, w;
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(x), "=f"(y), "=f"(z), "=f"(w)
                         : "r"(sSwap + (((1 - wg) * 4 + i) * 128 + wt) * 16));
            v[0] += x, v[1] += y, v[2] += z, v[3] += w;
          }
          add_tiles(decltype(keep)::value, 4);
        };
        if (wg == 0) swap_out(std::integral_constant<int, 4>{});
        else swap_out(std::integral_constant<int, 0>{});
        __syncthreads();  // both halves written (the next step's first barrier guards their reuse)
        if (wg == 0) swap_in(std::integral_constant<int, 0>{});
        else swap_in(std::integral_constant<int, 4>{});
      }
      if constexpr (T::kDqOrder != DqOrder::after) hp::wgmma_wait<0>();  // before the next step reuses ap, ads and the buffers
    }
  }
  if constexpr (T::kPair) {
    if (walk.steps > 0 && walk.steps == walk.shared_steps) add_held(walk.steps - 1);  // the last step's
  }
  if constexpr (T::kDefer) {
    if (walk.steps > 0) add_parked(walk.steps - 1);
  }
  tc::cp_async_wait<0>();

  store_key_rows<kTokens>(dk, dv, p, b, g, n0 + key_row, lane);
#else
  (void)p;  // compiled without sm_90a: backward_hopper() refuses to launch (hopper_supported)
#endif
}
