// decode_kernel.cu — module 19, Part G, reference solution: split-KV decode attention reading a
// paged bf16 cache in place.
//
// The arithmetic is small, 4·G FLOPs per 4 bytes of key and value (G query heads per KV head),
// but not free: done one dot product per lane with shuffles to sum it, it costs ~70 instructions
// per token and holds the kernel to about half the memory's speed. What the kernel must get right:
//   1. every byte of the cache read once, in whole 16-byte chunks, and many bytes in flight
//      whatever the other warps are doing: a copy warp fills a ring of tiles in shared memory
//      (cp.async) and refills each tile as soon as the compute warps release it, so the loads
//      never wait for the arithmetic;
//   2. little work per byte: the group's query heads are the rows of a tensor-core tile (GQA makes
//      the 16-row tile a quarter full at G = 4, which costs nothing: the tensor cores are idle
//      anyway), so 16 tokens cost a warp HD/8 mma for the scores and HD/8 for the output;
//   3. one full wave of blocks, whatever the batch: the cache of each (sequence, KV head) is cut
//      into as many parts as it takes to give every resident block slot of the GPU one part (a
//      single part when the batch alone fills it), and a second kernel merges the parts by their
//      log-sum-exps.
// Inside a block each of the 4 compute warps takes 16 tokens of a 64-token tile and keeps its own
// online softmax (lecture 09); the warps are merged through shared memory at the end.
#include "decode_kernel.h"

#include "k2c/device/hopper.cuh"
#include "k2c/device/tensor_core.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace k2c::inference {
namespace {

constexpr int kWarps = 4;     // compute warps per block; one more warp copies
constexpr int kThreads = (kWarps + 1) * 32;
constexpr int kStages = 3;    // tiles in shared memory
constexpr int kMaxGroup = 8;  // query heads per KV head
constexpr float kLog2e = 1.4426950408889634f;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("decode_attention_paged: " + what);
}

void validate(const DecodeShape& s) {
  require(s.batch >= 1, "batch = " + std::to_string(s.batch) + " (need >= 1)");
  require(s.head_dim == 64 || s.head_dim == 128, "head_dim = " + std::to_string(s.head_dim) + " (need 64 or 128)");
  require(s.kv_heads >= 1 && s.q_heads >= s.kv_heads && s.q_heads % s.kv_heads == 0,
          "q_heads = " + std::to_string(s.q_heads) + ", kv_heads = " + std::to_string(s.kv_heads) +
              " (q_heads must be a multiple of kv_heads >= 1)");
  require(s.q_heads / s.kv_heads <= kMaxGroup,
          "q_heads / kv_heads = " + std::to_string(s.q_heads / s.kv_heads) + " (at most 8)");
  require(s.page_size >= 1, "page_size = " + std::to_string(s.page_size) + " (need >= 1)");
  require(s.max_pages >= 1, "max_pages = " + std::to_string(s.max_pages) + " (need >= 1)");
  require(s.max_length >= 1 && std::int64_t{s.max_length} <= std::int64_t{s.max_pages} * s.page_size,
          "max_length = " + std::to_string(s.max_length) + " (need 1 .. max_pages·page_size = " +
              std::to_string(std::int64_t{s.max_pages} * s.page_size) + ")");
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, n = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      n = 0;
    return n > 0 ? n : 132;
  }();
  return count;
}

// How the cache is cut. Every block streams its part from start to end at about the same rate
// (the memory is shared fairly), so the time is (waves of blocks) × (tiles per part + what a
// block's start costs), plus the merge when there is more than one part. The resident slots
// (blocks per SM × SMs) come from the occupancy calculator: with 96 KiB of ring a block, two
// per SM on the H200. 32 sequences × 8 KV heads = 256 blocks of one part fill its 264 slots in
// one wave with no merge; one sequence of 32k tokens takes 32 parts of 1,024 per head.
struct Split {
  int tokens = 1;  // per part
  int parts = 1;   // of the longest sequence
};

constexpr int kStartTiles = 2;  // a block's start (queries, first lookups, pipeline fill), in tiles
constexpr int kMergeTiles = 4;  // the merge kernel and its launch, in tiles of streaming

Split split_for(const DecodeShape& s, int slots) {
  const int step = kWarps * 16;  // tokens per tile (Tiles<HD>::kTokens)
  const int steps = (s.max_length + step - 1) / step;
  const std::int64_t pairs = std::int64_t{s.batch} * s.kv_heads;
  int best = 1;
  std::int64_t best_cost = std::numeric_limits<std::int64_t>::max();
  for (int parts = 1; parts <= steps; ++parts) {
    const int tiles = (steps + parts - 1) / parts;
    const std::int64_t waves = (pairs * parts + slots - 1) / slots;
    const std::int64_t cost = waves * (tiles + kStartTiles) + (parts > 1 ? kMergeTiles : 0);
    if (cost < best_cost) best = parts, best_cost = cost;
    if (waves > 1 && parts > 1) break;  // more parts only add waves from here on
  }
  Split split;
  split.tokens = ((steps + best - 1) / best) * step;
  split.parts = (s.max_length + split.tokens - 1) / split.tokens;
  return split;
}

struct Workspace {
  float* out;  // [batch, q_heads, parts, head_dim]: each part's normalised output
  float* lse;  // [batch, q_heads, parts]: each part's log2-sum-exp2 of its scaled scores
};

Workspace carve(const DecodeShape& s, const Split& split, void* base) {
  float* out = static_cast<float*>(base);
  const std::size_t out_elems = std::size_t(s.batch) * s.q_heads * split.parts * s.head_dim;
  return {out, out + out_elems};
}

// How a block walks its part of the cache: tiles of kTokens tokens (16 per compute warp) in a
// ring of kStages slots of shared memory. The copy warp fills slot i % kStages with tile i as soon
// as the compute warps have released it (its "empty" barrier), each lane's copies arriving on the
// slot's "full" barrier when they have landed; the compute warps wait on "full", compute, and
// release the slot. Up to kStages tiles are on their way while the warps compute, and neither side
// ever waits for a __syncthreads of the other. (Asking the copy engine for each token's row with a
// bulk copy instead, 256 bytes a request, measured half the speed: it serves small requests slowly.)
//
// Rows of a tile are head_dim·2 bytes; the 16-byte chunk c of row r is stored at chunk
// c ^ (r % 8) of its row. ldmatrix reads one chunk of 8 consecutive rows at once, and without
// the swizzle those 8 chunks would sit in the same banks (an 8-way conflict).
template <int HD>
struct Tiles {
  static constexpr int kChunks = HD / 8;                   // 16-byte chunks per token row
  static constexpr int kTokens = kWarps * 16;              // per tile: one mma k-step per warp
  static constexpr int kTileBytes = kTokens * HD * 2;      // the keys (or values) of a tile
  static constexpr int kStageBytes = 2 * kTileBytes;
  static constexpr int kBarriers = kStages * kStageBytes;  // offset of the 2·kStages mbarriers
  static constexpr int kSharedBytes = kBarriers + 2 * kStages * 8;
};

template <int HD>
__device__ __forceinline__ std::uint32_t swizzled(int r, int c) {
  return static_cast<std::uint32_t>(r * HD * 2 + ((c ^ (r & 7)) * 16));
}

// One (part, KV head, sequence) per block.
//
// The group's G query heads are the rows of an mma tile (16 rows, the ones past G zero), so each
// tile of 16 cached tokens costs a warp HD/8 mma for the scores and HD/8 for the output, instead
// of a dot product per lane and per head plus shuffles to sum it: the tensor cores do the
// arithmetic and leave the warp free to keep the memory busy. Fragment rows are query heads:
// lane l holds row l / 4 (a head of the group) and columns 2·(l % 4), +1 of each 8-wide tile.
template <int HD, int G>
__global__ __launch_bounds__(kThreads) void decode_parts(DecodeShape s, DecodeArgs a, int part_tokens, int parts,
                                                         Workspace w, float scale_log2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using T = Tiles<HD>;
  using namespace k2c::tc;
  namespace hp = k2c::hopper;
  extern __shared__ __align__(128) unsigned char pipeline[];
  const int part = blockIdx.x, kv = blockIdx.y, b = blockIdx.z;
  const int length = a.lengths[b];
  const int first = part * part_tokens;
  if (first >= length) return;  // this sequence has fewer parts; the merge knows how many
  const int last = min(first + part_tokens, length);
  const int tiles = (last - first + T::kTokens - 1) / T::kTokens;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = lane / 4, pair = lane % 4;  // fragment row (query head of the group), column pair
  const std::uint32_t base = smem_addr(pipeline);
  auto k_tile = [&](int i) { return base + (i % kStages) * T::kStageBytes; };
  auto full = [&](int i) { return base + T::kBarriers + (i % kStages) * 8; };
  auto empty = [&](int i) { return base + T::kBarriers + (kStages + i % kStages) * 8; };
  if (threadIdx.x == 0) {
    for (int j = 0; j < kStages; ++j) {
      hp::mbarrier_init(full(j), 32);       // each copy lane, when its copies have landed
      hp::mbarrier_init(empty(j), kWarps);  // one arrival per compute warp
    }
    hp::fence_barrier_init();
  }
  __syncthreads();

  float o[HD / 8][4];
  float m = -INFINITY, l = 0.0f;  // this row's running maximum; this lane's share of its sum
  if (warp == kWarps) {
    // The copy warp. Token t lives at row (table[t / page_size]·kv_heads + kv)·page_size +
    // t mod page_size of the pool. Each lane looks up two rows of a tile (r = lane, lane + 32);
    // then each step copies two rows, 16 lanes a row, a 16-byte chunk each, and takes the row from
    // the lane that looked it up. Chunks past the part's end are zero-filled, so the masked scores
    // meet finite values.
    const int* table = a.page_table + std::size_t(b) * s.max_pages;
    auto row_of = [&](int t) { return t < last ? (table[t / s.page_size] * s.kv_heads + kv) * s.page_size + t % s.page_size : 0; };
    const int chunk = lane % T::kChunks, rows_per_step = 32 / T::kChunks;
    for (int i = 0; i < tiles; ++i) {
      const int t0 = first + i * T::kTokens;
      const int lo = row_of(t0 + lane), hi = row_of(t0 + 32 + lane);
      hp::mbarrier_wait(empty(i), ((i / kStages) & 1) ^ 1);  // a fresh slot passes at once
      const std::uint32_t kt = k_tile(i), vt = kt + T::kTileBytes;
#pragma unroll
      for (int r0 = 0; r0 < T::kTokens; r0 += rows_per_step) {
        const int r = r0 + lane / T::kChunks;
        const int row = __shfl_sync(0xffffffffu, r0 < 32 ? lo : hi, r % 32);
        const bool valid = t0 + r < last;
        const std::size_t at = std::size_t(row) * HD + chunk * 8;
        cp_async_16(kt + swizzled<HD>(r, chunk), a.k_pool + at, valid);
        cp_async_16(vt + swizzled<HD>(r, chunk), a.v_pool + at, valid);
      }
      cp_async_arrive(full(i));
    }
  } else {
    // The queries as mma A fragments, straight from global memory (read once per block): rows
    // past the group are zero.
    std::uint32_t qa[HD / 16][2];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        qa[kk][h] = head < G ? *reinterpret_cast<const std::uint32_t*>(
                                   a.q + (std::size_t(b) * s.q_heads + kv * G + head) * HD + kk * 16 + h * 8 + 2 * pair)
                             : 0u;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    for (int i = 0; i < tiles; ++i) {
      const int row0 = warp * 16;  // this warp's 16 tokens of the tile
      const int token0 = first + i * T::kTokens + row0;
      // A warp wholly past the part's end (in its last tile only) has nothing to compute.
      if (token0 < last) {
        hp::mbarrier_wait(full(i), (i / kStages) & 1);
        const std::uint32_t kt = k_tile(i), vt = kt + T::kTileBytes;
        // Scores S = Q·Kᵀ for 16 tokens: two 8-token tiles, HD/16 k-steps.
        // Even and odd k-steps accumulate apart: two chains of dependent mma instead of one.
        float sc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}}, odd[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const int j = lane / 8;
          std::uint32_t kb[4];
          ldmatrix_x4(kb, kt + swizzled<HD>(row0 + (j >> 1) * 8 + (lane & 7), kk * 2 + (j & 1)));
          const std::uint32_t qf[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
          const std::uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
          mma_bf16_16816(kk % 2 ? odd[0] : sc[0], qf, b0);
          mma_bf16_16816(kk % 2 ? odd[1] : sc[1], qf, b1);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[n][e] += odd[n][e];
        // Online softmax of the row (the 4 lanes of a quad share it): scale, mask the tail, rescale.
        float top = m;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const bool valid = token0 + n * 8 + 2 * pair + e < last;
            sc[n][e] = valid ? sc[n][e] * scale_log2 : -INFINITY;
            top = fmaxf(top, sc[n][e]);
          }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));  // finite: token0 < last
        const float rescale = exp2f(m - top);
        m = top;
        float p[2][2];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) p[n][e] = exp2f(sc[n][e] - top);
        l = l * rescale + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
          o[n][0] *= rescale;
          o[n][1] *= rescale;
        }
        // O += P·V: P (rows = heads, 16 tokens) as an A fragment, V through ldmatrix.trans.
        const std::uint32_t pf[4] = {pack_bf16x2(p[0][0], p[0][1]), 0u, pack_bf16x2(p[1][0], p[1][1]), 0u};
#pragma unroll
        for (int n2 = 0; n2 < HD / 16; ++n2) {
          const int j = lane / 8;
          std::uint32_t vb[4];
          ldmatrix_x4_trans(vb, vt + swizzled<HD>(row0 + (j & 1) * 8 + (lane & 7), n2 * 2 + (j >> 1)));
          const std::uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
          mma_bf16_16816(o[2 * n2], pf, b0);
          mma_bf16_16816(o[2 * n2 + 1], pf, b1);
        }
      }
      // Release the slot: its arrival counts towards the slot's refill, which comes after it.
      __syncwarp();
      if (lane == 0) hp::mbarrier_arrive(empty(i));
    }
  }
  // Every tile has landed and been read (the compute warps waited for each, and only after all the
  // copies a tile's barrier counts had landed): the ring's memory is reused below.
  __syncthreads();

  // Merge the compute warps: each wrote its rows (heads) through shared memory.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  float* sm_m = reinterpret_cast<float*>(pipeline);  // [kWarps][G]
  float* sm_l = sm_m + kWarps * G;                     // [kWarps][G]
  float* sm_o = sm_l + kWarps * G;                     // [kWarps][G][HD]
  if (warp < kWarps && head < G) {
    if (pair == 0) {
      sm_m[warp * G + head] = m;
      sm_l[warp * G + head] = l;
    }
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      sm_o[(warp * G + head) * HD + n * 8 + 2 * pair] = o[n][0];
      sm_o[(warp * G + head) * HD + n * 8 + 2 * pair + 1] = o[n][1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * HD; idx += kThreads) {
    const int g = idx / HD, d = idx % HD;
    float best = -INFINITY;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) best = fmaxf(best, sm_m[x * G + g]);
    float sum = 0.0f, out = 0.0f;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) {
      const float mx = sm_m[x * G + g];
      const float scale = mx == -INFINITY ? 0.0f : exp2f(mx - best);  // a warp with no tokens adds nothing
      sum += sm_l[x * G + g] * scale;
      out += sm_o[(x * G + g) * HD + d] * scale;
    }
    // The part has at least one token, so sum > 0. A single part is the whole answer.
    if (parts == 1) {
      a.o[(std::size_t(b) * s.q_heads + kv * G + g) * HD + d] = __float2bfloat16(out / sum);
      continue;
    }
    const std::size_t slot = (std::size_t(b) * s.q_heads + kv * G + g) * parts + part;
    w.out[slot * HD + d] = out / sum;
    if (d == 0) w.lse[slot] = best + log2f(sum);
  }
#else
  __trap();  // built for a GPU older than Hopper (mbarrier waits): decode_attention_paged refuses it first
#endif
}

// o[b, h] = Σ_j 2^(lse_j − L)·out_j with L = log2 Σ_j 2^lse_j, over the parts the sequence has.
template <int HD>
__global__ __launch_bounds__(HD) void merge_parts(DecodeShape s, DecodeArgs a, int part_tokens, int parts,
                                                  Workspace w) {
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int n = (a.lengths[b] + part_tokens - 1) / part_tokens;
  const std::size_t base = (std::size_t(b) * s.q_heads + h) * parts;
  float top = -INFINITY;
  for (int j = 0; j < n; ++j) top = fmaxf(top, w.lse[base + j]);
  float sum = 0.0f, out = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float weight = exp2f(w.lse[base + j] - top);
    sum += weight;
    out = fmaf(weight, w.out[(base + j) * HD + d], out);
  }
  a.o[(std::size_t(b) * s.q_heads + h) * HD + d] = __float2bfloat16(out / sum);
}

// Calls f.template operator()<HD, G>() for the shape's head size and group (the kernel's
// template arguments), so that sizing and launching see the same kernel.
template <class F>
decltype(auto) with_kernel(const DecodeShape& s, F&& f) {
  const int g = s.q_heads / s.kv_heads;
  auto group = [&]<int HD>() -> decltype(auto) {
    switch (g) {
      case 1: return f.template operator()<HD, 1>();
      case 2: return f.template operator()<HD, 2>();
      case 3: return f.template operator()<HD, 3>();
      case 4: return f.template operator()<HD, 4>();
      case 5: return f.template operator()<HD, 5>();
      case 6: return f.template operator()<HD, 6>();
      case 7: return f.template operator()<HD, 7>();
      default: return f.template operator()<HD, 8>();
    }
  };
  if (s.head_dim == 64) return group.template operator()<64>();
  return group.template operator()<128>();
}

// decode_parts<HD, G> with its shared memory opted in (over the 48 KB a kernel gets unasked), and
// how many of its blocks the GPU holds at once. Both are asked once per kernel.
struct Kernel {
  void (*fn)(DecodeShape, DecodeArgs, int, int, Workspace, float);
  int shared;
  int slots;  // resident blocks: blocks per SM × SMs
};

template <int HD, int G>
const Kernel& kernel() {
  static const Kernel k = [] {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major < 9)
      throw std::runtime_error("decode_attention_paged: this kernel waits on Hopper's mbarriers and needs a GPU of "
                               "compute capability 9.0 or later; this one is " + std::to_string(major) + ".x");
    constexpr int shared = Tiles<HD>::kSharedBytes;
    const cudaError_t opted =
        cudaFuncSetAttribute(decode_parts<HD, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    if (opted != cudaSuccess)
      throw std::runtime_error(std::string("decode_attention_paged: ") + cudaGetErrorString(opted));
    int per_sm = 0;
    const cudaError_t asked =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_parts<HD, G>, kThreads, shared);
    if (asked != cudaSuccess || per_sm < 1)
      throw std::runtime_error(std::string("decode_attention_paged: occupancy: ") + cudaGetErrorString(asked));
    return Kernel{decode_parts<HD, G>, shared, per_sm * multiprocessors()};
  }();
  return k;
}

Split split_for(const DecodeShape& s) {
  return with_kernel(s, [&]<int HD, int G>() { return split_for(s, kernel<HD, G>().slots); });
}

}  // namespace

std::size_t decode_workspace_bytes(const DecodeShape& shape) {
  validate(shape);
  const Split split = split_for(shape);
  if (split.parts == 1) return 0;  // the blocks write the output themselves
  return std::size_t(shape.batch) * shape.q_heads * split.parts * (shape.head_dim + 1) * sizeof(float);
}

void decode_attention_paged(const DecodeShape& shape, const DecodeArgs& args, void* workspace, cudaStream_t stream) {
  validate(shape);
  const Split split = split_for(shape);
  const Workspace w = carve(shape, split, workspace);
  const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(shape.head_dim));
  with_kernel(shape, [&]<int HD, int G>() {
    const Kernel& k = kernel<HD, G>();
    k.fn<<<dim3(split.parts, shape.kv_heads, shape.batch), kThreads, k.shared, stream>>>(
        shape, args, split.tokens, split.parts, w, scale_log2);
    if (split.parts > 1)
      merge_parts<HD><<<dim3(shape.q_heads, shape.batch), HD, 0, stream>>>(shape, args, split.tokens, split.parts, w);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("decode_attention_paged: launch failed: ") + cudaGetErrorString(err));
}

}  // namespace k2c::inference
