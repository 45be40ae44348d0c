// solutions/09_flash_attention/flash_attention.cu — module 09, the reference (contract:
// flash_attention.h). Read lectures/09_flash_attention.md first; the sections named below are
// the lecture's.
//
// What lives here:
//   forward()        FlashAttention 2's forward pass on mma.sync: a block owns 128 query rows,
//                    streams K and V tiles through double-buffered shared memory, keeps the
//                    running max, sum and output in registers and writes O and logsumexp once.
//   backward()       recomputation: a block owns 128 keys, walks every query block (of every query
//                    head of its GQA group) that can see them, rebuilds P from the saved
//                    logsumexp, keeps dK and dV in registers and adds dQ into an fp32 buffer.
//   forward_hopper(), backward_hopper()
//                    Part B: the same two passes on Hopper's warpgroup MMA (wgmma, sm_90a).
//   naive_forward()  S and P written to global memory, for contrast.
//
// Fragment layouts, ldmatrix and cp.async are lecture 05's (k2c/tensor_core.cuh): read its
// section on the mma.sync fragments before the index arithmetic below.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "flash_attention.h"
#include "k2c/check.h"
#include "k2c/hopper.cuh"
#include "k2c/tensor_core.cuh"

namespace k2c::flash_attention {
namespace {

using tc::ceil_div;
using tc::cp_async_16;
using tc::ldmatrix_x4;
using tc::ldmatrix_x4_trans;
using tc::mma_bf16_16816;
using tc::pack_bf16x2;
using tc::smem_addr;

constexpr float kLog2e = 1.4426950408889634f;

// 2^x in one MUFU.EX2 instruction (2 ulp; exp2(-inf) = 0, which the masks rely on).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- shared-memory tiles ---------------------------------------------------------------------
//
// A tile is `rows` rows of W bf16 (W = 64 or 128: 128 or 256 bytes), stored as 16-byte chunks
// with chunk c of row r at position c ^ (r % 8). ldmatrix reads one chunk column of 8 rows at a
// time; the XOR spreads those 8 chunks over all 32 banks, so every ldmatrix and every cp.async
// store is conflict-free (lecture 05, the swizzle section).
template <int W>
__device__ __forceinline__ std::uint32_t swizzled(std::uint32_t tile, int row, int chunk) {
  static_assert(W % 64 == 0, "a row must hold at least 8 chunks for the XOR to stay inside it");
  return tile + row * (W * 2) + ((chunk ^ (row & 7)) << 4);
}

// Copies rows [0, ROWS) of a W-wide bf16 tile starting at `src`; rows >= valid_rows are zero
// filled. All THREADS threads of the block take part; src must point at a real row. Thread t
// copies chunk t % (W/8) of rows t / (W/8) + i·kRowStep: a trip count known at compile time, so
// the loop unrolls into straight cp.async with immediate offsets (a loop counted from t, as in
// `for (i = t; i < n; i += THREADS)`, compiles to a rolled loop with remainder branches, hundreds
// of instructions per tile that every warp issues on its way to the tensor cores), and with
// kRowStep a multiple of 8 the swizzle's XOR is the same for each of a thread's rows.
template <int ROWS, int W, int THREADS>
__device__ __forceinline__ void load_tile(std::uint32_t tile, const bf16* src, int valid_rows, int tid) {
  constexpr int kChunks = W / 8, kRowStep = THREADS / kChunks;
  static_assert(THREADS % kChunks == 0 && ROWS % kRowStep == 0, "every thread copies the same chunks");
  const int r0 = tid / kChunks, c = tid % kChunks;
#pragma unroll
  for (int i = 0; i < ROWS / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool ok = r < valid_rows;
    cp_async_16(swizzled<W>(tile, r, c), ok ? src + static_cast<std::size_t>(r) * W + c * 8 : src, ok);
  }
}

// The A fragment (16 rows × 16 columns) at (row0, col0) of a row-major tile, by one ldmatrix.x4.
template <int W>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], std::uint32_t tile, int row0, int col0, int lane) {
  ldmatrix_x4(a, swizzled<W>(tile, row0 + (lane & 15), col0 / 8 + (lane >> 4)));
}

// Two B fragments (k16 × n8 each, n-tiles n0 and n0 + 8) when the tile stores B transposed, rows
// = n and columns = k (K in Q·Kᵀ: keys × head_dim). b[0..1] is n-tile n0, b[2..3] n-tile n0 + 8.
template <int W>
__device__ __forceinline__ void load_b_nk(std::uint32_t (&b)[4], std::uint32_t tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, swizzled<W>(tile, n0 + (lane & 7) + ((lane >> 4) << 3), k0 / 8 + ((lane >> 3) & 1)));
}

// The same when the tile stores B as it is, rows = k and columns = n (V in P·V: keys × head_dim):
// the .trans load turns each 8×8 piece around on the way.
template <int W>
__device__ __forceinline__ void load_b_kn(std::uint32_t (&b)[4], std::uint32_t tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, swizzled<W>(tile, k0 + (lane & 7) + (((lane >> 3) & 1) << 3), n0 / 8 + (lane >> 4)));
}

// Accumulator → operand. The fp32 accumulators of two neighbouring n8 tiles (columns 16k..16k+15
// of a 16-row strip) hold, per thread, exactly the elements that the A fragment of k step k
// needs: rounding them to bf16 pairs is all it takes to feed P (or dS) straight back into the
// tensor cores, without a trip through shared memory (lecture, section 4).
__device__ __forceinline__ void accumulators_to_a(std::uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16x2(lo[0], lo[1]);
  a[1] = pack_bf16x2(lo[2], lo[3]);
  a[2] = pack_bf16x2(hi[0], hi[1]);
  a[3] = pack_bf16x2(hi[2], hi[3]);
}

__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  const std::uint32_t b[2] = {b0, b1};
  mma_bf16_16816(d, a, b);
}

// Where thread `lane` sits in an accumulator: rows lane/4 and lane/4 + 8, columns 2·(lane%4) + {0, 1}.
__device__ __forceinline__ int acc_row(int lane, int half) { return (lane >> 2) + 8 * half; }
__device__ __forceinline__ int acc_col(int lane) { return 2 * (lane & 3); }

// The value itself, through a volatile asm statement that the compiler's optimiser may neither
// move nor look through: what a loop computes from it is not hoisted out of the loop and held in
// registers across it. (ptxas sees a plain move; that the effect survives is checked in
// ptxas -v's register and spill counts, lecture section 10.5.)
__device__ __forceinline__ std::uint64_t opaque(std::uint64_t v) {
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
  return v;
}

// Key j is visible to query i (causal, bottom-right aligned) when j <= i + offset, where
// offset = kv_len - q_len.
struct Mask {
  int kv_len;
  int offset;
  bool causal;
  __device__ __forceinline__ bool hidden(int query, int key) const {
    return key >= kv_len || (causal && key > query + offset);
  }
};

struct Params {
  const bf16 *q, *k, *v, *o, *dout;
  bf16 *out, *dq, *dk, *dv;
  const float* lse_in;
  float *lse_out, *dot, *dq_accum;
  int heads, kv_heads, group, q_len, kv_len;
  int wave_heads;  // heads started together (launch_place); 0 or less: SMs × the tile's blocks per SM / blocks per head
  float scale, scale_log2;
  bool causal;
  // Row offsets of head (b, h) in q-shaped and of kv head (b, g) in kv-shaped tensors.
  __device__ std::size_t q_rows(int b, int h) const { return (static_cast<std::size_t>(b) * heads + h) * q_len; }
  __device__ std::size_t kv_rows(int b, int g) const { return (static_cast<std::size_t>(b) * kv_heads + g) * kv_len; }
};

// Where a block sits, in launch order. The GPU starts blocks in order of their linear index and
// holds about wave_heads heads' worth at once, so the heads (with their batch) go in sets of
// wave_heads, and inside a set the heaviest blocks start first: under the causal mask a query
// block near the end and a key block near the start do the most work. The last blocks to start,
// which decide how long the grid's tail is, are then the light ones of the last set, while the
// K and V of the heads in flight still fit in L2. `rank` 0 is the heaviest block of its head;
// with heads as the outer loop only the last head's heavy blocks would start late and run on
// alone (lecture section 6.3).
__device__ __forceinline__ void launch_place(int wave_heads, int& rank, int& h, int& b) {
  const long long blocks = gridDim.x, pairs = static_cast<long long>(gridDim.y) * gridDim.z;
  const long long at = blockIdx.x + blocks * (blockIdx.y + static_cast<long long>(gridDim.y) * blockIdx.z);
  const long long set = at / (wave_heads * blocks), in_set = at % (wave_heads * blocks);
  const long long size = min(static_cast<long long>(wave_heads), pairs - set * wave_heads);
  const long long pair = set * wave_heads + in_set % size;
  rank = static_cast<int>(in_set / size);
  h = static_cast<int>(pair % gridDim.y);
  b = static_cast<int>(pair / gridDim.y);
}

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
// P, unnormalised).
template <int NT, int DT>
__device__ __forceinline__ void softmax_strip(float (&s)[NT][4], float (&o)[DT][4], float (&row_max)[2],
                                              float (&row_sum)[2], float scale_log2) {
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
    const float rescale = fast_exp2(row_max[half] * scale_log2 - base);
    row_max[half] = mx;
    float sum = 0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -base));
        sum += s[nt][e];
      }
    row_sum[half] = row_sum[half] * rescale + sum;  // this thread's columns only
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][2 * half] *= rescale;
      o[dt][2 * half + 1] *= rescale;
    }
  }
}

// Divides the strip's output by its row sums once, at the end, writes it as bf16 and saves
// lse = scale·max + ln(sum) (+inf for a row that saw no key).
template <int DT>
__device__ __forceinline__ void store_strip(const float (&o)[DT][4], const float (&row_max)[2], const float (&row_sum)[2],
                                            Params p, std::size_t head_row0, int row0, int lane) {
  constexpr int D = DT * 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + acc_row(lane, half);
    if (row >= p.q_len) continue;
    const float inv = sum > 0 ? 1.0f / sum : 0.0f;
    const std::size_t r = head_row0 + row;
    auto* out = reinterpret_cast<std::uint32_t*>(p.out + r * D + acc_col(lane));
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

template <class T>
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

  const bf16* q = p.q + (p.q_rows(b, h) + m0) * D;
  const bf16* k = p.k + p.kv_rows(b, g) * D;
  const bf16* v = p.v + p.kv_rows(b, g) * D;

  const int n_blocks = ceil_div(keys_needed(p, m0, BM), BN);

  auto load_kv = [&](int j) {
    const int n0 = j * BN;
    load_tile<BN, D, T::kThreads>(sK(j & 1), k + static_cast<std::size_t>(n0) * D, p.kv_len - n0, tid);
    load_tile<BN, D, T::kThreads>(sV(j & 1), v + static_cast<std::size_t>(n0) * D, p.kv_len - n0, tid);
  };
  load_tile<BM, D, T::kThreads>(sQ, q, p.q_len - m0, tid);
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
    store_strip(o[st], row_max[st], row_sum[st], p, p.q_rows(b, h), m0 + warp * WM + st * 16, lane);
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

// Like load_tile, into the 128-byte-swizzled block layout.
template <int ROWS, int W, int THREADS>
__device__ __forceinline__ void load_tile_sw128(std::uint32_t tile, const bf16* src, int valid_rows, int tid) {
  constexpr int kChunks = W / 8, kRowStep = THREADS / kChunks;
  static_assert(THREADS % kChunks == 0 && ROWS % kRowStep == 0, "every thread copies the same chunks");
  const int r0 = tid / kChunks, c = tid % kChunks;
#pragma unroll
  for (int i = 0; i < ROWS / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool ok = r < valid_rows;
    const std::uint32_t at = tile + (c / 8) * ROWS * 128 + r * 128 + (((c % 8) ^ (r & 7)) << 4);
    cp_async_16(at, ok ? src + static_cast<std::size_t>(r) * W + c * 8 : src, ok);
  }
}

// acc(64 × D) += A(64 × 16, registers) · B(16 × D, shared memory, MN-major), D = 64 or 128: the
// P·V shape both Hopper kernels use.
template <int D>
__device__ __forceinline__ void wgmma_rs_tb(float (&acc)[D / 8][4], const std::uint32_t (&a)[4], std::uint64_t b) {
  auto& d = reinterpret_cast<float(&)[D / 2]>(acc);
  if constexpr (D == 128) k2c::hopper::wgmma_m64n128k16_rs_tb(d, a, b);
  else k2c::hopper::wgmma_m64n64k16_rs_tb(d, a, b);
}

template <class T>
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
  const bf16* q = p.q + (p.q_rows(b, h) + m0) * D;
  const bf16* k = p.k + p.kv_rows(b, g) * D;
  const bf16* v = p.v + p.kv_rows(b, g) * D;
  const int n_blocks = ceil_div(keys_needed(p, m0, BM), BN);
  const std::uint32_t q_rows = sQ + wg * 64 * 128;  // this warpgroup's 64 rows in each column block

  auto load_kv = [&](int j) {
    const int n0 = j * BN;
    load_tile_sw128<BN, D, T::kThreads>(sK(j & 1), k + static_cast<std::size_t>(n0) * D, p.kv_len - n0, tid);
    load_tile_sw128<BN, D, T::kThreads>(sV(j & 1), v + static_cast<std::size_t>(n0) * D, p.kv_len - n0, tid);
  };
  load_tile_sw128<BM, D, T::kThreads>(sQ, q, p.q_len - m0, tid);
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
  store_strip(o, row_max, row_sum, p, p.q_rows(b, h), m0 + warp * 16, lane);
#else
  (void)p;  // compiled without sm_90a: forward_hopper() refuses to launch (hopper_supported)
#endif
}

// ---- backward -----------------------------------------------------------------------------------

// D_i = Σ_d dO_id · O_id, one warp per row (the softmax gradient's row term, lecture section 7).
template <int D>
__global__ void dot_kernel(const bf16* dout, const bf16* o, float* dot, std::size_t rows) {
  const std::size_t row = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float acc = 0;
  if (lane < D / 8) {
    const uint4 a = reinterpret_cast<const uint4*>(dout + row * D)[lane];
    const uint4 c = reinterpret_cast<const uint4*>(o + row * D)[lane];
    const auto* x = reinterpret_cast<const __nv_bfloat162*>(&a);
    const auto* y = reinterpret_cast<const __nv_bfloat162*>(&c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 fx = __bfloat1622float2(x[i]), fy = __bfloat1622float2(y[i]);
      acc += fx.x * fy.x + fx.y * fy.y;
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) dot[row] = acc;
}

// dq = bf16(scale · dq_accum), four elements per thread.
__global__ void dq_convert_kernel(const float4* accum, uint2* dq, float scale, std::size_t quads) {
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < quads;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float4 a = accum[i];
    dq[i] = make_uint2(pack_bf16x2(a.x * scale, a.y * scale), pack_bf16x2(a.z * scale, a.w * scale));
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
template <int DT>
__device__ __forceinline__ void store_key_rows(const float (&dk)[DT][4], const float (&dv)[DT][4], const Params& p,
                                               int b, int g, int key0, int lane) {
  constexpr int D = DT * 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + acc_row(lane, half);
    if (key >= p.kv_len) continue;
    auto* k_out = reinterpret_cast<std::uint32_t*>(p.dk + (p.kv_rows(b, g) + key) * D + acc_col(lane));
    auto* v_out = reinterpret_cast<std::uint32_t*>(p.dv + (p.kv_rows(b, g) + key) * D + acc_col(lane));
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

template <class T>
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

  load_tile<BN, D, T::kThreads>(sK, p.k + kv_row0 * D, p.kv_len - n0, tid);
  load_tile<BN, D, T::kThreads>(sV, p.v + kv_row0 * D, p.kv_len - n0, tid);

  // Issues the copies of step t's Q and dO tiles, and its rows' lse and D in the same group.
  auto fetch = [&](int t) {
    int m0;
    const std::size_t r = step_rows(t, m0);
    load_tile<BM, D, T::kThreads>(sQ(t & 1), p.q + (r + m0) * D, p.q_len - m0, tid);
    load_tile<BM, D, T::kThreads>(sdO(t & 1), p.dout + (r + m0) * D, p.q_len - m0, tid);
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

  store_key_rows(dk, dv, p, b, g, n0 + key_row, lane);
}

// ---- Part B: the backward pass on Hopper's warpgroup MMA (sm_90a) --------------------------------
//
// backward_kernel's structure with wgmma: two warpgroups of 128 threads, 64 keys each (128 keys
// per block), query steps of 64 rows. Sᵀ = K Qᵀ and dPᵀ = V dOᵀ read both operands from shared
// memory, as two commit groups, so that Pᵀ is computed while dPᵀ is still on the tensor cores.
// Pᵀ and dSᵀ go from the accumulators straight into A fragments for dV += Pᵀ dO and dK += dSᵀ Q
// (dO and Q read MN-major), and dSᵀ also goes to shared memory, where dQ = dS K reads it as an
// MN-major A operand. There is no ldmatrix at all: waiting for ldmatrix results is where the
// mma.sync backward's warps stall most (lecture sections 10.5 and 11). Tiles are laid out as the
// Hopper forward lays them out (load_tile_sw128). Shared memory: K, V 2·128·D, Q and dO
// double-buffered 4·64·D, dSᵀ 128·64 bf16, lse and D: 145 KiB at D = 128, 146 KiB with the 1 KiB
// of alignment slack, one block per SM and 255 registers per thread at D = 128 (241 at D = 64),
// no spill.
template <int D_>
struct HopperBackwardTile {
  static constexpr int D = D_, kKeys = 128, kRows = 64, kThreads = 256;
  static constexpr int kKvBytes = kKeys * D * 2, kRowBytes = kRows * D * 2, kDsBytes = kKeys * kRows * 2;
  // dQ's BM × D tile, split between the warpgroups as 64-column blocks: at D = 128 each takes its
  // own block over all 128 keys; at D = 64 both take the one block, each over its own 64 keys,
  // and both add into dq_accum (an m64n32 half-block would save those extra adds, but would
  // start half-way into a swizzled 128-byte row).
  static constexpr int kDqKeys = D == 128 ? kKeys : kKeys / 2;
  static constexpr int kSmemBytes = 2 * kKvBytes + 4 * kRowBytes + kDsBytes + 4 * kRows * 4 + 1024;
};

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) hopper_backward_kernel(Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace hp = k2c::hopper;
  constexpr int D = T::D, BN = T::kKeys, BM = T::kRows, DT = D / 8, QT = BM / 8;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  const std::uint32_t sK = base, sV = base + T::kKvBytes;
  auto sQ = [&](int t) { return base + 2 * T::kKvBytes + (t & 1) * T::kRowBytes; };
  auto sdO = [&](int t) { return base + 2 * T::kKvBytes + (2 + (t & 1)) * T::kRowBytes; };
  const std::uint32_t sdS = base + 2 * T::kKvBytes + 4 * T::kRowBytes;  // dSᵀ: BN rows of BM, one block
  float* s_lse = reinterpret_cast<float*>(smem_raw + (sdS + T::kDsBytes - smem_addr(smem_raw)));  // [2][BM]
  float* s_dot = s_lse + 2 * BM;                                                                  // [2][BM]

  int rank, g, b;
  launch_place(p.wave_heads, rank, g, b);
  const int n0 = rank * BN;
  const int tid = threadIdx.x, lane = tid % 32, wg = tid / 128, warp = (tid / 32) % 4;
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
  const std::size_t kv_row0 = p.kv_rows(b, g) + n0;
  const QueryWalk<BM> walk(p, n0);
  static_assert(T::kThreads >= 2 * BM, "fetch copies lse and D with a thread per row each");
  auto fetch = [&](int t) {
    int m0;
    const std::size_t r = walk.rows(p, b, g, t, m0);
    load_tile_sw128<BM, D, T::kThreads>(sQ(t), p.q + (r + m0) * D, p.q_len - m0, tid);
    load_tile_sw128<BM, D, T::kThreads>(sdO(t), p.dout + (r + m0) * D, p.q_len - m0, tid);
    fetch_row_terms<BM>(p, r, m0, s_lse + (t & 1) * BM, s_dot + (t & 1) * BM, tid);
  };

  load_tile_sw128<BN, D, T::kThreads>(sK, p.k + kv_row0 * D, p.kv_len - n0, tid);
  load_tile_sw128<BN, D, T::kThreads>(sV, p.v + kv_row0 * D, p.kv_len - n0, tid);
  if (walk.steps > 0) fetch(0);
  tc::cp_async_commit();

  float dk[DT][4] = {}, dv[DT][4] = {};     // the warpgroup's 64 key rows, accumulator layout per warp
  const int key_row = 64 * wg + 16 * warp;  // this warp's 16 keys: rows key_row + lane/4 (+8)
  // Every descriptor below is one of eight first descriptors plus a byte offset (only the address
  // field changes: hp::smem_desc_plus), known at compile time apart from the step's Q / dO
  // buffer, and the first descriptors pass through `opaque` in each step. Otherwise the compiler hoists the loop-invariant ones, dozens of 64-bit values,
  // out of the loop and holds them in registers across it: at d = 128 that spilled 124 bytes and
  // measured 12 to 14 % slower (lecture section 10.5).
  const std::uint64_t k_desc0 = hp::smem_desc_128b(sK + 64 * wg * 128), v_desc0 = hp::smem_desc_128b(sV + 64 * wg * 128),
                      q_desc0 = hp::smem_desc_128b(sQ(0)), do_desc0 = hp::smem_desc_128b(sdO(0)),
                      q_mn0 = hp::smem_desc_128b_mn(sQ(0), BM * 128), do_mn0 = hp::smem_desc_128b_mn(sdO(0), BM * 128);
  // The k16 slice kk of a K-major tile of `rows` rows: 64-column blocks, 32 bytes per slice.
  auto slice = [](std::uint64_t tile, int rows, int kk) {
    return hp::smem_desc_plus(tile, (kk / 4) * rows * 128 + (kk % 4) * 32);
  };
  for (int t = 0; t < walk.steps; ++t) {
    int m0;
    const std::size_t q_row0 = walk.rows(p, b, g, t, m0);
    // As in the mma.sync kernel: wait, one barrier, then prefetch into the buffers step t − 1
    // used (its wgmmas were waited for at its end). The fence makes the cp.async data visible
    // to wgmma, which reads shared memory through the async proxy.
    tc::cp_async_wait<0>();
    hp::fence_proxy_async();
    __syncthreads();
    if (t + 1 < walk.steps) fetch(t + 1);
    tc::cp_async_commit();

    // Sᵀ and dPᵀ, the warpgroup's 64 keys × BM queries, D/16 k16 steps each, as two groups.
    const std::uint32_t buffer = (t & 1) * T::kRowBytes;  // this step's Q and dO buffers
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

    // Pᵀ and dSᵀ exactly as in the mma.sync kernel: a warp's share of a wgmma accumulator has the
    // layout of mma.sync's n8 tiles.
    const float* lse = s_lse + (t & 1) * BM;
    const float* dot = s_dot + (t & 1) * BM;
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
    hp::wgmma_fence();
    {
      const std::uint64_t do_mn = hp::smem_desc_plus(opaque(do_mn0), buffer), q_mn = hp::smem_desc_plus(opaque(q_mn0), buffer);
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        wgmma_rs_tb<D>(dv, ap[kq], hp::smem_desc_plus(do_mn, kq * 16 * 128));
        wgmma_rs_tb<D>(dk, ads[kq], hp::smem_desc_plus(q_mn, kq * 16 * 128));
      }
    }
    hp::wgmma_commit();

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
    hp::wgmma_wait<0>();  // dQ, and the dV / dK group above (whose A fragments are ap and ads)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + 16 * warp + acc_row(lane, half);
      if (row >= p.q_len) continue;
      float* dst = p.dq_accum + (q_row0 + row) * D + 64 * dq_block + acc_col(lane);
#pragma unroll
      for (int j = 0; j < 8; ++j) add_pair(dst + 8 * j, dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
    }
  }
  tc::cp_async_wait<0>();

  store_key_rows(dk, dv, p, b, g, n0 + key_row, lane);
#else
  (void)p;  // compiled without sm_90a: backward_hopper() refuses to launch (hopper_supported)
#endif
}

// ---- naive attention ----------------------------------------------------------------------------

// S = scale · Q Kᵀ (−inf where masked), fp32, one 32 × 32 tile per block through shared memory.
template <int D>
__global__ void naive_scores_kernel(Params p, float* S) {
  __shared__ float sq[32][D + 1], sk[32][D + 1];
  const int h = blockIdx.z % p.heads, b = blockIdx.z / p.heads, g = h / p.group;
  const int i0 = blockIdx.y * 32, j0 = blockIdx.x * 32, tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  for (int e = threadIdx.x; e < 32 * D; e += blockDim.x) {
    const int r = e / D, c = e % D;
    sq[r][c] = i0 + r < p.q_len ? __bfloat162float(p.q[(p.q_rows(b, h) + i0 + r) * D + c]) : 0.0f;
    sk[r][c] = j0 + r < p.kv_len ? __bfloat162float(p.k[(p.kv_rows(b, g) + j0 + r) * D + c]) : 0.0f;
  }
  __syncthreads();
  const Mask mask{p.kv_len, p.kv_len - p.q_len, p.causal};
  for (int r = ty; r < 32; r += blockDim.x / 32) {
    const int i = i0 + r, j = j0 + tx;
    if (i >= p.q_len || j >= p.kv_len) continue;
    float acc = 0;
    for (int c = 0; c < D; ++c) acc += sq[r][c] * sk[tx][c];
    S[(p.q_rows(b, h) + i) * p.kv_len + j] = mask.hidden(i, j) ? -INFINITY : acc * p.scale;
  }
}

// Row softmax in place (S becomes P) and lse, one block per row.
__global__ void naive_softmax_kernel(float* S, float* lse, int kv_len) {
  __shared__ float partial[32];
  float* row = S + static_cast<std::size_t>(blockIdx.x) * kv_len;
  auto block_reduce = [&](float x, bool is_max) {
    for (int m = 16; m > 0; m /= 2) {
      const float y = __shfl_xor_sync(0xffffffffu, x, m);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = x;
    __syncthreads();
    x = is_max ? -INFINITY : 0.0f;
    for (int w = 0; w < blockDim.x / 32; ++w) x = is_max ? fmaxf(x, partial[w]) : x + partial[w];
    __syncthreads();
    return x;
  };
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < kv_len; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_reduce(mx, true);
  const float base = mx == -INFINITY ? 0.0f : mx;
  float sum = 0;
  for (int j = threadIdx.x; j < kv_len; j += blockDim.x) sum += expf(row[j] - base);
  sum = block_reduce(sum, false);
  const float inv = sum > 0 ? 1.0f / sum : 0.0f;
  for (int j = threadIdx.x; j < kv_len; j += blockDim.x) row[j] = expf(row[j] - base) * inv;
  if (threadIdx.x == 0) lse[blockIdx.x] = sum > 0 ? base + logf(sum) : INFINITY;
}

// O = P V, 16 query rows × D per block, P and V tiles of 32 keys through shared memory.
template <int D>
__global__ void naive_pv_kernel(Params p, const float* P) {
  __shared__ float sp[16][33], sv[32][D];
  const int h = blockIdx.y % p.heads, b = blockIdx.y / p.heads, g = h / p.group;
  const int i0 = blockIdx.x * 16;
  constexpr int kPerThread = 16 * D / 128;  // 128 threads; thread t: column t % D, rows t / D + ...
  float acc[kPerThread] = {};
  const int c = threadIdx.x % D, r0 = threadIdx.x / D, rstep = 128 / D;
  for (int j0 = 0; j0 < p.kv_len; j0 += 32) {
    for (int e = threadIdx.x; e < 16 * 32; e += 128) {
      const int r = e / 32, j = e % 32;
      sp[r][j] = i0 + r < p.q_len && j0 + j < p.kv_len ? P[(p.q_rows(b, h) + i0 + r) * p.kv_len + j0 + j] : 0.0f;
    }
    for (int e = threadIdx.x; e < 32 * D; e += 128) {
      const int j = e / D, d = e % D;
      sv[j][d] = j0 + j < p.kv_len ? __bfloat162float(p.v[(p.kv_rows(b, g) + j0 + j) * D + d]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int x = 0; x < kPerThread; ++x)
      for (int j = 0; j < 32; ++j) acc[x] += sp[r0 + x * rstep][j] * sv[j][c];
    __syncthreads();
  }
#pragma unroll
  for (int x = 0; x < kPerThread; ++x) {
    const int i = i0 + r0 + x * rstep;
    if (i < p.q_len) p.out[(p.q_rows(b, h) + i) * D + c] = __float2bfloat16(acc[x]);
  }
}

// ---- host side ----------------------------------------------------------------------------------

Params make_params(const Shape& s) {
  Params p{};
  p.heads = s.heads;
  p.kv_heads = s.kv_heads;
  p.group = s.heads / s.kv_heads;
  p.q_len = s.q_len;
  p.kv_len = s.kv_len;
  p.scale = s.scale;
  p.scale_log2 = s.scale * kLog2e;
  p.causal = s.causal;
  return p;
}

bool has_work(const Shape& s) { return s.batch > 0 && s.heads > 0 && s.q_len > 0; }

// The checks and parameters every forward entry point shares (`who` names it in errors).
Params forward_params(const char* who, const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o,
                      float* lse) {
  check_pointers(who, {q, o, lse});
  if (s.kv_len > 0) check_pointers(who, {k, v});
  Params p = make_params(s);
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = o;
  p.lse_out = lse;
  return p;
}

// Rows of fp32 D, then the fp32 dq accumulator, 16-byte aligned.
std::size_t dot_floats(const Shape& s) {
  return (static_cast<std::size_t>(s.batch) * s.heads * s.q_len + 3) / 4 * 4;
}

// The checks and parameters both backward entry points share. Returns false when there is no
// query at all, after writing dk and dv, which are still defined then, as zeros.
bool backward_params(const char* who, const Shape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
                     const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                     cudaStream_t stream, Params& p) {
  check_shape(s, who);
  if (!has_work(s)) {
    if (s.batch > 0 && s.kv_heads > 0 && s.kv_len > 0) {
      check_pointers(who, {dk, dv});
      const std::size_t bytes = static_cast<std::size_t>(s.batch) * s.kv_heads * s.kv_len * s.head_dim * 2;
      K2C_CUDA_CHECK(cudaMemsetAsync(dk, 0, bytes, stream));
      K2C_CUDA_CHECK(cudaMemsetAsync(dv, 0, bytes, stream));
    }
    return false;
  }
  check_pointers(who, {q, o, dout, lse, dq, workspace});
  if (s.kv_len > 0) check_pointers(who, {k, v, dk, dv});
  p = make_params(s);
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.dout = dout;
  p.lse_in = lse;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  p.dot = static_cast<float*>(workspace);
  p.dq_accum = p.dot + dot_floats(s);
  return true;
}

// More than 48 KiB of dynamic shared memory must be asked for, per kernel and per device: set at
// every launch (a microsecond against kernels of milliseconds), so a second GPU is covered too.
template <class Kernel>
void set_smem(Kernel kernel, int bytes) {
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// How many heads' blocks the GPU holds at once (at least one): see launch_place.
int wave_heads(int blocks_per_head, int blocks_per_sm) {
  int device = 0, sms = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  K2C_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(1, sms * blocks_per_sm / std::max(1, blocks_per_head));
}

// Launches a forward kernel over (query blocks, heads, batch).
template <class T, auto Kernel>
void launch_query_blocks(Params p, const Shape& s, cudaStream_t stream) {
  set_smem(Kernel, T::kSmemBytes);
  const dim3 grid(ceil_div(s.q_len, T::kRows), s.heads, s.batch);
  if (p.wave_heads <= 0) p.wave_heads = wave_heads(static_cast<int>(grid.x), T::kMinBlocks);
  Kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(p);
  K2C_CUDA_CHECK_LAUNCH();
}
template <class T>
void launch_forward(const Params& p, const Shape& s, cudaStream_t stream) {
  launch_query_blocks<T, forward_kernel<T>>(p, s, stream);
}
template <class T>
void launch_hopper(const Params& p, const Shape& s, cudaStream_t stream) {
  launch_query_blocks<T, hopper_forward_kernel<T>>(p, s, stream);
}

// The backward pass: D, the kernel over (key blocks, kv heads, batch), then dq from its fp32 sum.
template <class T, auto Kernel>
void launch_backward(Params p, const Shape& s, cudaStream_t stream) {
  constexpr int D = T::D;
  set_smem(Kernel, T::kSmemBytes);
  const std::size_t rows = static_cast<std::size_t>(s.batch) * s.heads * s.q_len;
  dot_kernel<D><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(p.dout, p.o, p.dot, rows);
  K2C_CUDA_CHECK_LAUNCH();
  K2C_CUDA_CHECK(cudaMemsetAsync(p.dq_accum, 0, rows * D * sizeof(float), stream));
  const dim3 grid(ceil_div(s.kv_len, T::kKeys), s.kv_heads, s.batch);
  if (p.wave_heads <= 0) p.wave_heads = wave_heads(static_cast<int>(grid.x), 1);
  if (grid.x > 0) {
    Kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(p);
    K2C_CUDA_CHECK_LAUNCH();
  }
  const std::size_t quads = rows * D / 4;
  dq_convert_kernel<<<static_cast<unsigned>((quads + 255) / 256), 256, 0, stream>>>(
      reinterpret_cast<const float4*>(p.dq_accum), reinterpret_cast<uint2*>(p.dq), p.scale, quads);
  K2C_CUDA_CHECK_LAUNCH();
}

template <int D>
void launch_naive(const Params& p, const Shape& s, float* S, cudaStream_t stream) {
  const long long heads = static_cast<long long>(s.batch) * s.heads;
  K2C_CHECK(heads <= 65535 && ceil_div(s.q_len, 32) <= 65535,
            "naive_forward: batch · heads and q_len / 32 must be at most 65535 (its grid)");
  if (s.kv_len > 0) {
    naive_scores_kernel<D><<<dim3(ceil_div(s.kv_len, 32), ceil_div(s.q_len, 32), heads), 256, 0, stream>>>(p, S);
    K2C_CUDA_CHECK_LAUNCH();
  }
  const std::size_t rows = static_cast<std::size_t>(heads) * s.q_len;
  K2C_CHECK(rows <= 0x7fffffffULL, "naive_forward: too many rows for one grid");
  naive_softmax_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(S, p.lse_out, s.kv_len);
  K2C_CUDA_CHECK_LAUNCH();
  naive_pv_kernel<D><<<dim3(ceil_div(s.q_len, 16), heads), 128, 0, stream>>>(p, S);
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace

void forward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
             cudaStream_t stream) {
  check_shape(s, "flash_attention forward");
  if (!has_work(s)) return;
  const Params p = forward_params("flash_attention forward", s, q, k, v, o, lse);
  if (s.head_dim == 64) launch_forward<ForwardTile<64>>(p, s, stream);
  else launch_forward<ForwardTile<128>>(p, s, stream);
}

bool hopper_supported(std::string* why_not) { return k2c::hopper::sm90a_supported(why_not); }

void forward_hopper(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                    cudaStream_t stream) {
  check_shape(s, "flash_attention forward_hopper");
  if (!has_work(s)) return;
  const Params p = forward_params("flash_attention forward_hopper", s, q, k, v, o, lse);
  k2c::hopper::require_sm90a("flash_attention forward_hopper");
  if (s.head_dim == 64) launch_hopper<HopperTile<64>>(p, s, stream);
  else launch_hopper<HopperTile<128>>(p, s, stream);
}

std::size_t backward_workspace_bytes(const Shape& s) {
  check_shape(s, "flash_attention backward_workspace_bytes");
  return (dot_floats(s) + static_cast<std::size_t>(s.batch) * s.heads * s.q_len * s.head_dim) * sizeof(float);
}

void backward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
              const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, void* workspace,
              cudaStream_t stream) {
  Params p;
  if (!backward_params("flash_attention backward", s, q, k, v, o, dout, lse, dq, dk, dv, workspace, stream, p)) return;
  // BackwardTile's defaults: the scores in D/64 chunks, their head_dim loop unrolled fully, 16-row
  // dQ warp tiles, dQ one step late. Each measured fastest or level with the fastest within the
  // run-to-run spread at both head dims (lab/flash_attention.cu, lecture section
  // 11), although at D = 128 it spills: ptxas's register allocation moves with small changes of
  // the code around it, so measure rather than read the spill count.
  if (s.head_dim == 64) launch_backward<BackwardTile<64>, backward_kernel<BackwardTile<64>>>(p, s, stream);
  else launch_backward<BackwardTile<128>, backward_kernel<BackwardTile<128>>>(p, s, stream);
}

void backward_hopper(const Shape& s, const bf16* q, const bf16* k, const bf16* v, const bf16* o,
                     const bf16* dout, const float* lse, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                     cudaStream_t stream) {
  Params p;
  const char* who = "flash_attention backward_hopper";
  if (!backward_params(who, s, q, k, v, o, dout, lse, dq, dk, dv, workspace, stream, p)) return;
  k2c::hopper::require_sm90a(who);
  if (s.head_dim == 64) launch_backward<HopperBackwardTile<64>, hopper_backward_kernel<HopperBackwardTile<64>>>(p, s, stream);
  else launch_backward<HopperBackwardTile<128>, hopper_backward_kernel<HopperBackwardTile<128>>>(p, s, stream);
}

std::size_t naive_workspace_bytes(const Shape& s) {
  check_shape(s, "flash_attention naive_workspace_bytes");
  return static_cast<std::size_t>(s.batch) * s.heads * s.q_len * s.kv_len * sizeof(float);
}

void naive_forward(const Shape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse,
                   void* workspace, cudaStream_t stream) {
  check_shape(s, "flash_attention naive_forward");
  if (!has_work(s)) return;
  const Params p = forward_params("flash_attention naive_forward", s, q, k, v, o, lse);
  if (s.kv_len > 0) check_pointers("flash_attention naive_forward", {workspace});
  if (s.head_dim == 64) launch_naive<64>(p, s, static_cast<float*>(workspace), stream);
  else launch_naive<128>(p, s, static_cast<float*>(workspace), stream);
}

}  // namespace k2c::flash_attention
