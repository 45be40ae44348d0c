// solutions/09_flash_attention/flash_attention_forward.cuh — module 09's reference, part 2 of 4:
// the forward pass. First the steps on one 16-row strip of scores that both forward kernels share
// (mask, online softmax, the final store of O and logsumexp), then forward_kernel on mma.sync
// (ForwardTile) and Part B's hopper_forward_kernel on wgmma (HopperTile, with load_tile_sw128,
// which the Hopper backward reuses). Included by flash_attention.cu only, inside its unnamed
// namespace, after the tiles (flash_attention_tiles.cuh); the backward pass
// (flash_attention_backward.cuh) follows.
#pragma once

// ---- the forward pass's per-strip steps (shared by the mma.sync and the wgmma kernels) ----------
//
// A strip is 16 query rows × NT·8 keys of scores in accumulator layout (s[nt][e]: row
// row0 + acc_row(lane, e / 2), key n0 + 8·nt + acc_col(lane) + e % 2) with its DT·8-wide output
// rows and this thread's running max (raw score units) and partial sum for its two rows.

// Hides the scores of keys past kv_len or above the causal diagonal.
template <int NT>
__device__ __forceinline__ void mask_strip(float (&s)[NT][4], const Mask& mask, int row0, int n0, int lane) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (mask.hidden(row0 + acc_row(lane, e / 2), n0 + nt * 8 + acc_col(lane) + e % 2)) s[nt][e] = -INFINITY;
}

// Online softmax (lecture section 3): the new running max, what came before rescaled by
// 2^((old − new)·scale·log2 e), this tile exponentiated with one FFMA + EX2 per score (s becomes
// P, unnormalised). In two halves: softmax_scores leaves the output's factors in `rescale`, for
// a kernel whose previous P·V is still running on the accumulators when the scores are ready;
// rescale_rows applies them.
template <int NT>
__device__ __forceinline__ void softmax_scores(float (&s)[NT][4], float (&row_max)[2], float (&row_sum)[2],
                                               float scale_log2, float (&rescale)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = row_max[half];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 lanes of a row
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // A row that has seen only masked keys keeps max −inf; using 0 instead keeps
    // −inf − (−inf) = NaN out of the exponent, and its terms are all 0 either way.
    const float base = mx == -INFINITY ? 0.0f : mx * scale_log2;
    rescale[half] = fast_exp2(row_max[half] * scale_log2 - base);
    row_max[half] = mx;
    float sum = 0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -base));
        sum += s[nt][e];
      }
    row_sum[half] = row_sum[half] * rescale[half] + sum;  // this thread's columns only
  }
}
template <int DT>
__device__ __forceinline__ void rescale_rows(float (&o)[DT][4], const float (&rescale)[2]) {
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] *= rescale[e / 2];
}
template <int NT, int DT>
__device__ __forceinline__ void softmax_strip(float (&s)[NT][4], float (&o)[DT][4], float (&row_max)[2],
                                              float (&row_sum)[2], float scale_log2) {
  float rescale[2];
  softmax_scores(s, row_max, row_sum, scale_log2, rescale);
  rescale_rows(o, rescale);
}

// Divides the strip's output by its row sums once, at the end, writes it as bf16 and saves
// lse = scale·max + ln(sum) (+inf for a row that saw no key).
template <bool kTokens, int DT>
__device__ __forceinline__ void store_strip(const float (&o)[DT][4], const float (&row_max)[2], const float (&row_sum)[2],
                                            Params p, std::size_t head_row0, int row0, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + acc_row(lane, half);
    if (row >= p.q_len) continue;
    const float inv = sum > 0 ? 1.0f / sum : 0.0f;
    const std::size_t r = head_row0 + row;
    auto* out = reinterpret_cast<std::uint32_t*>(p.out + p.q_at<DT * 8, kTokens>(r) + acc_col(lane));
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) out[dt * 4] = pack_bf16x2(o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv);
    if ((lane & 3) == 0) p.lse_out[r] = sum > 0 ? row_max[half] * p.scale + logf(sum) : INFINITY;
  }
}

// The keys [0, n_end) that rows [m0, m0 + rows) need: under the causal mask the last row,
// m0 + rows − 1, sees keys up to m0 + rows − 1 + offset.
__device__ __forceinline__ int keys_needed(Params p, int m0, int rows) {
  return p.causal ? max(0, min(p.kv_len, m0 + rows + p.kv_len - p.q_len)) : p.kv_len;
}

// Whether a rows × BN tile at (m0, n0) crosses the kv tail or the diagonal: only those pay for
// the mask.
__device__ __forceinline__ bool tile_needs_mask(Params p, int m0, int n0, int keys) {
  return n0 + keys > p.kv_len || (p.causal && n0 + keys - 1 > m0 + p.kv_len - p.q_len);
}

// ---- forward ----------------------------------------------------------------------------------

// 4 warps, 128 query rows per block: each warp owns 32 rows (two 16-row strips), so the row max
// and sum never leave a warp ("split-Q", lecture section 5). K and V tiles of BN = 64 keys are
// double buffered. Shared memory: Q 128·D + 2·2·64·D bf16 = 96 KiB at D = 128 (two blocks per
// SM), 48 KiB at D = 64. Registers bound the tile: the output alone is 32·D/32 = D fp32 values per
// thread, the scores 32·BN/32 = BN more. QK_UNROLL unrolls Q·Kᵀ's loop over head_dim; fully
// unrolled, the compiler issues the next k step's ldmatrix while this step's mma run: 2 to 6 %
// faster at both head dims over two runs, although at D = 128 it spills 52 bytes (lecture
// sections 5.5 and 11). SKIP_HIDDEN: under the causal mask a warp skips the tiles whose keys all lie
// past its rows' diagonal (with equal query and key lengths, the last tile of a query block for
// half its warps): their scores would all be masked, and the warp's state would come out of them
// unchanged.
template <int D_, int KEYS = 64, int WARPS = 4, int STRIPS = 2, int QK_UNROLL = D_ / 16, bool SKIP_HIDDEN = true>
struct ForwardTile {
  static constexpr int D = D_, kKeys = KEYS, kWarps = WARPS, kStrips = STRIPS, kQkUnroll = QK_UNROLL;
  static constexpr bool kSkipHidden = SKIP_HIDDEN;
  static constexpr int kRows = 16 * kStrips * kWarps, kThreads = 32 * kWarps;
  static constexpr int kSmemBytes = (kRows + 4 * kKeys) * D * 2;
  static constexpr int kMinBlocks = kThreads <= 128 ? 2 : 1;  // what the register file allows
};

template <class T, bool kTokens = false>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) forward_kernel(Params p) {
  constexpr int D = T::D, BM = T::kRows, BN = T::kKeys, NT = BN / 8, DT = D / 8, WM = 16 * T::kStrips;
  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t sQ = smem_addr(smem);
  auto sK = [&](int stage) { return sQ + (BM + stage * BN) * D * 2; };
  auto sV = [&](int stage) { return sQ + (BM + 2 * BN + stage * BN) * D * 2; };

  int rank, h, b;
  launch_place(p.wave_heads, rank, h, b);
  const int m0 = (gridDim.x - 1 - rank) * BM, g = h / p.group;  // the last query blocks see the most keys
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};

  const bf16* q = p.q + p.q_at<D, kTokens>(p.q_rows(b, h) + m0);
  const bf16* k = p.k + p.kv_at<D, kTokens>(p.kv_rows(b, g));
  const bf16* v = p.v + p.kv_at<D, kTokens>(p.kv_rows(b, g));
  const std::size_t q_ld = p.q_ld<D, kTokens>(), kv_ld = p.kv_ld<D, kTokens>();

  const int n_blocks = ceil_div(keys_needed(p, m0, BM), BN);

  auto load_kv = [&](int j) {
    const int n0 = j * BN;
    load_tile<BN, D, T::kThreads>(sK(j & 1), k + n0 * kv_ld, kv_ld, p.kv_len - n0, tid);
    load_tile<BN, D, T::kThreads>(sV(j & 1), v + n0 * kv_ld, kv_ld, p.kv_len - n0, tid);
  };
  load_tile<BM, D, T::kThreads>(sQ, q, q_ld, p.q_len - m0, tid);
  if (n_blocks > 0) load_kv(0);
  tc::cp_async_commit();

  float o[T::kStrips][DT][4] = {};
  float row_max[T::kStrips][2], row_sum[T::kStrips][2] = {};  // max in raw score units
#pragma unroll
  for (int s = 0; s < T::kStrips; ++s) row_max[s][0] = row_max[s][1] = -INFINITY;

  for (int j = 0; j < n_blocks; ++j) {
    const int n0 = j * BN;
    // Wait for this tile; the barrier then also tells that every warp is done with iteration
    // j − 1, so its buffer can take the prefetch of tile j + 1, which runs under this tile's math.
    // One barrier per iteration.
    tc::cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < n_blocks) load_kv(j + 1);
    tc::cp_async_commit();
    // The warp's last row, m0 + warp·WM + WM − 1, sees keys up to that row + offset.
    if (T::kSkipHidden && p.causal && n0 > m0 + warp * WM + WM - 1 + mask.offset) continue;

    // S = Q Kᵀ for the warp's 32 rows × BN keys, fp32.
    float s[T::kStrips][NT][4] = {};
#pragma unroll T::kQkUnroll
    for (int kk = 0; kk < D; kk += 16) {
      std::uint32_t a[T::kStrips][4];
#pragma unroll
      for (int st = 0; st < T::kStrips; ++st) load_a<D>(a[st], sQ, warp * WM + st * 16, kk, lane);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        std::uint32_t bk[4];
        load_b_nk<D>(bk, sK(j & 1), nt * 8, kk, lane);
#pragma unroll
        for (int st = 0; st < T::kStrips; ++st) {
          mma(s[st][nt], a[st], bk[0], bk[1]);
          mma(s[st][nt + 1], a[st], bk[2], bk[3]);
        }
      }
    }

    if (tile_needs_mask(p, m0, n0, BN)) {
#pragma unroll
      for (int st = 0; st < T::kStrips; ++st) mask_strip(s[st], mask, m0 + warp * WM + st * 16, n0, lane);
    }
#pragma unroll
    for (int st = 0; st < T::kStrips; ++st) softmax_strip(s[st], o[st], row_max[st], row_sum[st], p.scale_log2);

    // O += P V: P from registers (bf16), V by transposing ldmatrix.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      std::uint32_t a[T::kStrips][4];
#pragma unroll
      for (int st = 0; st < T::kStrips; ++st) accumulators_to_a(a[st], s[st][2 * kk], s[st][2 * kk + 1]);
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        std::uint32_t bv[4];
        load_b_kn<D>(bv, sV(j & 1), kk * 16, dt * 8, lane);
#pragma unroll
        for (int st = 0; st < T::kStrips; ++st) {
          mma(o[st][dt], a[st], bv[0], bv[1]);
          mma(o[st][dt + 1], a[st], bv[2], bv[3]);
        }
      }
    }
  }
  tc::cp_async_wait<0>();

#pragma unroll
  for (int st = 0; st < T::kStrips; ++st)
    store_strip<kTokens>(o[st], row_max[st], row_sum[st], p, p.q_rows(b, h), m0 + warp * WM + st * 16, lane);
}

// ---- Part B: the forward pass on Hopper's warpgroup MMA (sm_90a) ---------------------------------
//
// Each warpgroup (128 threads) owns 64 query rows, two warpgroups per block share K and V tiles
// of 64 keys, double buffered by cp.async as above. What changes is the tensor-core instruction:
// wgmma reads Q, K and V straight from shared memory through descriptors, so the ldmatrix
// traffic that bounds the mma.sync kernel disappears, and P goes from registers into the second
// product as before. Tiles are laid out as wgmma's 128-byte-swizzled operands: 64-column blocks
// of rows × 128 bytes, chunk c of row r stored at c ^ (r % 8), each block 1024-byte aligned
// (lecture section 10). Shared memory: Q 128·D + 2·2·64·D bf16 = 96 KiB at D = 128 (97 with the
// alignment slack), so two
// blocks fit an SM and their softmax and matrix phases interleave; registers are then capped at
// 128 per thread (2 · 256 threads), which costs a few spilled bytes at D = 128 and still
// measured fastest (lab/flash_attention.cu: one warpgroup per block, or one block
// per SM, were 16 % and 13 % slower; a one-warpgroup kernel that issued the next tile's Q·Kᵀ
// before this tile's softmax, FA3's overlap, made ptxas serialise its wgmmas and ran 10 % slower
// than the same kernel without it).
template <int D_, int WARPGROUPS = 2, int MIN_BLOCKS = 2>
struct HopperTile {
  static constexpr int D = D_, kRows = 64 * WARPGROUPS, kKeys = 64;
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kQBytes = kRows * D * 2, kTileBytes = kKeys * D * 2;  // Q; a K or V tile
  static constexpr int kSmemBytes = kQBytes + 4 * kTileBytes + 1024;  // + room to align to 1 KiB
  static constexpr int kMinBlocks = WARPGROUPS == 1 ? 2 : MIN_BLOCKS;
};

// Like load_tile, into the 128-byte-swizzled block layout: 64-element column blocks of ROWS
// rows × 128 bytes each, chunk c of row r at chunk (c % 8) ^ (r % 8) of its block's row.
template <int ROWS, int W, int THREADS>
__device__ __forceinline__ void load_tile_sw128(std::uint32_t tile, const bf16* src, std::size_t ld, int valid_rows,
                                                int tid) {
  copy_rows<ROWS, W, THREADS>(src, ld, valid_rows, tid, [tile](int r, int c) {
    return tile + (c / 8) * ROWS * 128 + r * 128 + (((c % 8) ^ (r & 7)) << 4);
  });
}

// acc(64 × D) += A(64 × 16, registers) · B(16 × D, shared memory, MN-major), D = 64 or 128: the
// P·V shape both Hopper kernels use.
template <int D>
__device__ __forceinline__ void wgmma_rs_tb(float (&acc)[D / 8][4], const std::uint32_t (&a)[4], std::uint64_t b) {
  auto& d = reinterpret_cast<float(&)[D / 2]>(acc);
  if constexpr (D == 128) k2c::hopper::wgmma_m64n128k16_rs_tb(d, a, b);
  else k2c::hopper::wgmma_m64n64k16_rs_tb(d, a, b);
}

template <class T, bool kTokens = false>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) hopper_forward_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace hp = k2c::hopper;
  constexpr int D = T::D, BM = T::kRows, BN = T::kKeys, NT = BN / 8, DT = D / 8;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
  auto sK = [&](int stage) { return sQ + T::kQBytes + 2 * stage * T::kTileBytes; };
  auto sV = [&](int stage) { return sQ + T::kQBytes + (2 * stage + 1) * T::kTileBytes; };

  int rank, h, b;
  launch_place(p.wave_heads, rank, h, b);
  const int m0 = (gridDim.x - 1 - rank) * BM, g = h / p.group;  // heaviest first, as above
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
  const bf16* q = p.q + p.q_at<D, kTokens>(p.q_rows(b, h) + m0);
  const bf16* k = p.k + p.kv_at<D, kTokens>(p.kv_rows(b, g));
  const bf16* v = p.v + p.kv_at<D, kTokens>(p.kv_rows(b, g));
  const std::size_t q_ld = p.q_ld<D, kTokens>(), kv_ld = p.kv_ld<D, kTokens>();
  const int n_blocks = ceil_div(keys_needed(p, m0, BM), BN);
  const std::uint32_t q_rows = sQ + wg * 64 * 128;  // this warpgroup's 64 rows in each column block

  auto load_kv = [&](int j) {
    const int n0 = j * BN;
    load_tile_sw128<BN, D, T::kThreads>(sK(j & 1), k + n0 * kv_ld, kv_ld, p.kv_len - n0, tid);
    load_tile_sw128<BN, D, T::kThreads>(sV(j & 1), v + n0 * kv_ld, kv_ld, p.kv_len - n0, tid);
  };
  load_tile_sw128<BM, D, T::kThreads>(sQ, q, q_ld, p.q_len - m0, tid);
  if (n_blocks > 0) load_kv(0);
  tc::cp_async_commit();

  // This warp's 16 rows of the warpgroup's 64, in the accumulator layout of mma.sync strips.
  float o[DT][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {};
  for (int j = 0; j < n_blocks; ++j) {
    const int n0 = j * BN;
    tc::cp_async_wait<0>();
    hp::fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
    __syncthreads();
    if (j + 1 < n_blocks) load_kv(j + 1);
    tc::cp_async_commit();

    // S = Q Kᵀ: D/16 steps of k16, each 32 bytes further along the 128-byte rows of a block.
    float s[NT][4];
    hp::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const std::uint32_t along = (kk % 4) * 32;
      hp::wgmma_m64n64k16_ss(reinterpret_cast<float(&)[NT * 4]>(s),
                             hp::smem_desc_128b(q_rows + (kk / 4) * BM * 128 + along),
                             hp::smem_desc_128b(sK(j & 1) + (kk / 4) * BN * 128 + along), kk > 0);
    }
    hp::wgmma_commit();
    hp::wgmma_wait<0>();

    if (tile_needs_mask(p, m0, n0, BN)) mask_strip(s, mask, m0 + warp * 16, n0, lane);  // warp w: rows 16w..
    softmax_strip(s, o, row_max, row_sum, p.scale_log2);

    // O += P V: P as register A fragments, V read MN-major (keys are k, head_dim is n). Step kk
    // starts 16 rows down V's first 64-column block; the second block is a tile's half away.
    std::uint32_t a[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) accumulators_to_a(a[kk], s[2 * kk], s[2 * kk + 1]);
    hp::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      wgmma_rs_tb<D>(o, a[kk], hp::smem_desc_128b_mn(sV(j & 1) + kk * 16 * 128, BN * 128));
    }
    hp::wgmma_commit();
    hp::wgmma_wait<0>();  // before the next iteration's prefetch overwrites this V
  }
  tc::cp_async_wait<0>();
  store_strip<kTokens>(o, row_max, row_sum, p, p.q_rows(b, h), m0 + warp * 16, lane);
#else
  (void)p;  // compiled without sm_90a: forward_hopper() refuses to launch (hopper_supported)
#endif
}

// ---- Part B, warp-specialised: TMA copies, a producer warpgroup, two consumers taking turns ------
//
// The design of FlashAttention-3's forward pass on Hopper, for 128 query rows by 128 keys:
//   block     384 threads, one block per SM. Warpgroup 0 produces: one thread issues TMA copies of
//             Q (once) and of each K and V tile into a ring of STAGES slots; the group hands its
//             registers to the consumers (setmaxnreg). Warpgroups 1 and 2 consume, 64 query rows
//             each: S = Q Kᵀ (m64n128, both operands from shared memory), the mask and the online
//             softmax in registers, O += P V (P from registers, V from shared memory).
//   barriers  q_full; k_full[s] and v_full[s] complete on the copies' bytes, so S can start
//             while V is still arriving; empty[s] takes one arrival per consumer once its P V
//             has read the slot.
//   turns     (kPingpong) the consumers issue their products in turn, through two named
//             barriers: while one warpgroup's products run on the tensor cores, the other does its
//             softmax, so the tensor cores do not wait for the exponentials (the ping-pong
//             schedule of FA3).
//   order     what a turn issues (kOrder). kGroupedOverlap, the default, FA3's: the next
//             S(j+1) = Q K(j+1)ᵀ and O += P(j) V(j) together, S first, so one turn hands the
//             tensor cores both of a warpgroup's products and the other warpgroup's softmax runs
//             under them; the warpgroup then waits for S(j+1) alone (wgmma_wait<1>) and computes
//             its softmax while its own P V(j) is still on the tensor cores, and waits for P V
//             only to rescale O (a tile's first S and last P V take a turn each). kGrouped: the
//             same pair, P V first, both waited for before the softmax. kSerial: S(j) alone in a turn,
//             P V(j) issued outside the turns once its softmax is done. kOverlapSoftmax, FA3's
//             second schedule: the same pair as kGrouped's (S(j) with P(j−1) V(j−1)), but only
//             S(j) is in the turn and only S(j) is waited for: the softmax of S(j) runs while
//             P(j−1) V(j−1) is still on the tensor cores, and O's rescaling waits for it.
//   schedule  which tiles a block takes (kSchedule). kClaim, the default, is persistent: one
//             block per SM, each taking the next tile in launch_place's order from a counter in
//             global memory when it starts one (so blocks that drew light tiles take more of
//             them, as the hardware's own block scheduling would). The producer passes each
//             tile's index to the consumers through a slot of the block's own in global memory,
//             written before q_full's arrival and read after its completion (q_empty orders the
//             next write after the reads); an index past the end stops them. (In shared memory
//             the same handoff is as correct, but compute-sanitizer's racecheck, which does not
//             follow ordering through mbarriers, reports it as a race.) It copies the next tile's Q as soon as both consumers have
//             finished the current tile's last S = Q Kᵀ (q_empty), and its K and V into the ring
//             as slots free, while the consumers still multiply P V and store O. With kOneTile
//             (a grid of tiles, one each) a block waits for its Q and first K before any product
//             and leaves the SM idle while it stores O, a fixed cost that weighs twice as much
//             under the causal mask, where a tile has half as many key blocks on average
//             (measured: lecture 09's appendix, section 5.6).
//   edges     TMA sees each head as a matrix of its own (3-D tensor maps: column, row, head), so
//             a 128-row box that hangs past a head's last row reads zeros there, never the next
//             head's rows: whatever those hold (a NaN in V would survive P = 0), one head's output
//             depends on its own inputs only. Q rows past q_len are computed and never stored; K
//             rows past kv_len are masked.
// Shared memory: Q 128·D + STAGES·2·128·D bf16 = 224 KiB at D = 128 and three stages, the
// default: with the grouped orders a turn reads K(j+1) while P V(j) still reads V(j), so two slots
// are in use and the third is what the producer fills ahead. Measured on an H100 at the graded
// shape (lab/flash_attention.cu hopper_fwd, lecture 09's appendix §5.5): kGrouped ran 1.06
// (causal) and 1.05 (full) times as fast as kSerial with two slots, and kGroupedOverlap 1.04 and
// 1.05 times as fast as kGrouped; with two slots kGroupedOverlap loses a fifth.
enum WsSchedule { kOneTile, kClaim };
enum WsOrder { kSerial, kOverlapSoftmax, kGrouped, kGroupedOverlap };
template <int D_, bool PINGPONG = true, int STAGES = 3, int ORDER = kGroupedOverlap, int SCHEDULE = kClaim,
          bool EARLY_RELEASE = false>
struct HopperWsTile {
  static constexpr bool kEarlyRelease = EARLY_RELEASE;
  static constexpr int D = D_, kRows = 128, kKeys = 128, kStages = STAGES, kThreads = 384;
  static constexpr bool kPingpong = PINGPONG;
  static constexpr int kOrder = ORDER;
  static constexpr int kSchedule = SCHEDULE;
  static constexpr int kQBytes = kRows * D * 2, kTileBytes = kKeys * D * 2;  // Q; one K or V tile
  static constexpr int kBarrierBytes = 8 * (2 + 3 * kStages);
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kTileBytes + kBarrierBytes + 1024;  // + alignment
  static constexpr int kMinBlocks = 1;
};

// `tiles`: query blocks × heads × batch. kOneTile's grid is (query blocks, heads, batch),
// kClaim's one-dimensional; for kClaim, schedule[0] counts the tiles taken past the grid's first
// (zero at launch) and schedule[1 + block] is the block's tile-index slot.
template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    hopper_ws_forward_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                             const __grid_constant__ CUtensorMap map_v, Params p, long long tiles,
                             unsigned long long* schedule) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace hp = k2c::hopper;
  constexpr int D = T::D, BM = T::kRows, BN = T::kKeys, NT = BN / 8, DT = D / 8, S = T::kStages;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
  auto sK = [&](int s) { return sQ + T::kQBytes + 2 * s * T::kTileBytes; };
  auto sV = [&](int s) { return sQ + T::kQBytes + (2 * s + 1) * T::kTileBytes; };
  const std::uint32_t q_full = sQ + T::kQBytes + 2 * S * T::kTileBytes, q_empty = q_full + 8;
  auto k_full = [&](int s) { return q_empty + 8 + 8 * s; };
  auto v_full = [&](int s) { return q_empty + 8 + 8 * (S + s); };
  auto empty = [&](int s) { return q_empty + 8 + 8 * (2 * S + s); };
  volatile unsigned long long* tile_slot = T::kSchedule == kClaim ? schedule + 1 + blockIdx.x : nullptr;

  // Tile `at` placed as launch_place places a block (heaviest first within each set of heads);
  // kOneTile's block takes the tile of its own index.
  const long long blocks = ceil_div(p.q_len, BM), pairs = tiles / blocks;
  const long long one_tile = launch_index();
  struct Tile {
    int m0, h, b, n_blocks;
  };
  auto tile_at = [&](long long at) {
    Tile t;
    int rank;
    tile_place(at, blocks, p.heads, pairs, p.wave_heads, rank, t.h, t.b);
    t.m0 = static_cast<int>(blocks - 1 - rank) * BM;
    t.n_blocks = ceil_div(keys_needed(p, t.m0, BM), BN);
    return t;
  };
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    hp::mbarrier_init(q_full, 1);
    hp::mbarrier_init(q_empty, 2);  // one arrival per consumer warpgroup
    for (int s = 0; s < S; ++s) {
      hp::mbarrier_init(k_full(s), 1);
      hp::mbarrier_init(v_full(s), 1);
      hp::mbarrier_init(empty(s), 2);
    }
    hp::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    hp::setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      long long at = T::kSchedule == kOneTile ? one_tile : blockIdx.x;
      int it = 0;  // K/V blocks copied so far, over all of this block's tiles: the ring's position
      for (int i = 0;; ++i) {
        hp::mbarrier_wait(q_empty, (i & 1) ^ 1);  // both consumers are done with the last tile's Q
        if constexpr (T::kSchedule == kClaim) *tile_slot = at;  // published to the consumers by q_full
        if (at >= tiles) {
          hp::mbarrier_arrive(q_full);  // no copy: the consumers read the index and stop
          break;
        }
        const Tile t = tile_at(at);
        const int q_head = t.b * p.heads + t.h, kv_head = t.b * p.kv_heads + t.h / p.group;  // the maps' matrix index
        hp::mbarrier_arrive_expect_tx(q_full, T::kQBytes);
        for (int c = 0; c < D / 64; ++c) hp::tma_load_3d(sQ + c * BM * 128, &map_q, q_full, 64 * c, t.m0, q_head);
        for (int j = 0; j < t.n_blocks; ++j, ++it) {
          const int s = it % S, row = j * BN;
          hp::mbarrier_wait(empty(s), ((it / S) & 1) ^ 1);  // the consumers are done with its last lap
          hp::mbarrier_arrive_expect_tx(k_full(s), T::kTileBytes);
          for (int c = 0; c < D / 64; ++c)
            hp::tma_load_3d(sK(s) + c * BN * 128, &map_k, k_full(s), 64 * c, row, kv_head);
          hp::mbarrier_arrive_expect_tx(v_full(s), T::kTileBytes);
          for (int c = 0; c < D / 64; ++c)
            hp::tma_load_3d(sV(s) + c * BN * 128, &map_v, v_full(s), 64 * c, row, kv_head);
        }
        if constexpr (T::kSchedule == kOneTile) at = tiles;
        else at = gridDim.x + static_cast<long long>(atomicAdd(schedule, 1ull));
      }
    }
  } else {
    hp::setmaxnreg_inc<240>();
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
    const std::uint32_t q_rows = sQ + consumer * 64 * 128;  // this warpgroup's 64 rows in each column block
    // Turns: consumer c waits on barrier 2 + c before it issues a turn's products (kOrder says
    // which) and, once they are issued, lets the other go. Both take the same turns, tile by tile.
    // Consumer 1 arrives once before the first, so consumer 0 goes first, and consumer 0 takes
    // that extra turn after the last tile, so both barriers end complete.
    constexpr int kTurn = 2;
    if (T::kPingpong && consumer == 1) hp::named_arrive(kTurn, 256);
    float sc[NT][4];
    std::uint32_t a[BN / 16][4];
    int it = 0;  // the ring's position, as the producer counts it
    for (int i = 0;; ++i) {
      hp::mbarrier_wait(q_full, i & 1);
      const long long at = T::kSchedule == kClaim ? static_cast<long long>(*tile_slot) : i == 0 ? one_tile : tiles;
      if (at >= tiles) break;
      const Tile t = tile_at(at);
      const int n_blocks = t.n_blocks, rows0 = t.m0 + consumer * 64, row0 = rows0 + warp * 16;
      float o[DT][4] = {};
      float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {};
      // Q has been read for the last time once S of the tile's last block is complete. The
      // warpgroup's barrier first: every thread has read the tile's index before the producer,
      // released by q_empty, writes the next one.
      auto q_done = [&] {
        hp::named_sync(4 + consumer, 128);
        if (threadIdx.x % 128 == 0) hp::mbarrier_arrive(q_empty);
      };
      if (n_blocks == 0) q_done();
      // This consumer's turn to issue products, and the other's once they are issued.
      auto take_turn = [&] {
        if constexpr (T::kPingpong) hp::named_sync(kTurn + consumer, 256);
      };
      auto pass_turn = [&] {
        if constexpr (T::kPingpong) hp::named_arrive(kTurn + 1 - consumer, 256);
      };
      auto wait_k = [&](int j) { hp::mbarrier_wait(k_full((it + j) % S), ((it + j) / S) & 1); };
      auto wait_v = [&](int j) { hp::mbarrier_wait(v_full((it + j) % S), ((it + j) / S) & 1); };
      // S = Q K(j)ᵀ issued and committed, not waited for.
      auto scores = [&](int j) {
        const int s = (it + j) % S;
        hp::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const std::uint32_t along = (kk % 4) * 32;
          hp::wgmma_m64n128k16_ss(reinterpret_cast<float(&)[NT * 4]>(sc),
                                  hp::smem_desc_128b(q_rows + (kk / 4) * BM * 128 + along),
                                  hp::smem_desc_128b(sK(s) + (kk / 4) * BN * 128 + along), kk > 0);
        }
        hp::wgmma_commit();
      };
      // O += P V(j), P in `a`; issued and committed, not waited for.
      auto pv = [&](int j) {
        const int s = (it + j) % S;
        hp::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
          wgmma_rs_tb<D>(o, a[kk], hp::smem_desc_128b_mn(sV(s) + kk * 16 * 128, BN * 128));
        hp::wgmma_commit();
      };
      // S(j) alone in a turn; P V(j) outside the turns (kSerial, kOverlapSoftmax).
      auto issue_scores = [&](int j) {
        wait_k(j);
        take_turn();
        scores(j);
        pass_turn();
      };
      auto issue_pv = [&](int j) {
        wait_v(j);
        pv(j);
      };
      auto release = [&](int j) {
        if (threadIdx.x % 128 == 0) hp::mbarrier_arrive(empty((it + j) % S));  // the slot's K and V are read
      };
      // The mask and the softmax of S(j), into P; the output's factors left in `rescale`.
      auto softmax = [&](int j, float (&rescale)[2]) {
        if (tile_needs_mask(p, rows0, j * BN, BN)) mask_strip(sc, mask, row0, j * BN, lane);
        softmax_scores(sc, row_max, row_sum, p.scale_log2, rescale);
      };
      auto to_a = [&] {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) accumulators_to_a(a[kk], sc[2 * kk], sc[2 * kk + 1]);
      };
      // A tile's first S, waited for, its softmax, P into `a` (O is zero: nothing to rescale).
      auto first_block = [&](float (&rescale)[2]) {
        issue_scores(0);
        hp::wgmma_wait<0>();
        if (n_blocks == 1) q_done();
        softmax(0, rescale);
        to_a();
      };
      if constexpr (T::kOrder == kGrouped) {
        if (n_blocks > 0) {
          float rescale[2];
          first_block(rescale);
          for (int j = 0; j < n_blocks; ++j) {
            const bool next = j + 1 < n_blocks;
            wait_v(j);  // the copies waited for before the turn, so a turn is never held on them
            if (next) wait_k(j + 1);
            take_turn();
            pv(j);
            if (next) scores(j + 1);
            pass_turn();
            if constexpr (T::kEarlyRelease) {
              hp::wgmma_wait<1>();  // P(j) V(j) is done: the slot goes back before S(j+1) is waited for
              release(j);
              hp::wgmma_wait<0>();
            } else {
              hp::wgmma_wait<0>();
              release(j);
            }
            if (!next) break;
            if (j + 2 == n_blocks) q_done();
            softmax(j + 1, rescale);
            rescale_rows(o, rescale);
            to_a();
          }
        }
      } else if constexpr (T::kOrder == kGroupedOverlap) {
        // The last block's P V is peeled off, so every turn of the loop commits the same two
        // groups: ptxas then sees that wgmma_wait<1> completes S, and does not serialise.
        if (n_blocks > 0) {
          float rescale[2];
          first_block(rescale);
          for (int j = 0; j + 1 < n_blocks; ++j) {
            wait_v(j);
            wait_k(j + 1);
            take_turn();
            scores(j + 1);  // first, so that it completes first
            pv(j);
            pass_turn();
            hp::wgmma_wait<1>();  // S(j+1) is done; P(j) V(j) may still run (it reads `a`, not sc)
            if (j + 2 == n_blocks) q_done();
            softmax(j + 1, rescale);
            hp::wgmma_wait<0>();
            release(j);
            rescale_rows(o, rescale);
            to_a();
          }
          wait_v(n_blocks - 1);
          take_turn();
          pv(n_blocks - 1);
          pass_turn();
          hp::wgmma_wait<0>();
          release(n_blocks - 1);
        }
      } else if constexpr (T::kOrder == kOverlapSoftmax) {
        if (n_blocks > 0) {
          float rescale[2];
          first_block(rescale);
          for (int j = 1; j < n_blocks; ++j) {
            issue_scores(j);
            issue_pv(j - 1);
            hp::wgmma_wait<1>();  // S(j) is done; P(j−1) V(j−1) may still run
            if (j + 1 == n_blocks) q_done();
            softmax(j, rescale);
            hp::wgmma_wait<0>();
            release(j - 1);
            rescale_rows(o, rescale);
            to_a();
          }
          issue_pv(n_blocks - 1);
          hp::wgmma_wait<0>();
          release(n_blocks - 1);
        }
      } else {
        for (int j = 0; j < n_blocks; ++j) {
          float rescale[2];
          issue_scores(j);
          hp::wgmma_wait<0>();
          if (j + 1 == n_blocks) q_done();
          softmax(j, rescale);
          rescale_rows(o, rescale);
          to_a();
          issue_pv(j);
          hp::wgmma_wait<0>();
          release(j);
        }
      }
      it += n_blocks;
      store_strip<false>(o, row_max, row_sum, p, p.q_rows(t.b, t.h), row0, lane);  // heads first only (TMA)
    }
    if (T::kPingpong && consumer == 0) hp::named_sync(kTurn, 256);  // consumer 1's arrival after its last turn
  }
#else
  (void)map_q, (void)map_k, (void)map_v, (void)p;  // compiled without sm_90a: see forward_hopper()
#endif
}

