// solutions/05_tensor_core_matmul/hopper_matmul.cu — module 05, Part B: the reference Hopper
// GEMM (contract: tensor_core_matmul.h; lecture: lectures/05_tensor_core_matmul.md, part B).
//
// C = A · Bᵀ with wgmma, TMA and mbarriers, warp-specialised and persistent:
//   block        384 threads = 3 warpgroups. Warpgroup 0 is the producer: one thread issues TMA
//                copies, and the group gives most of its registers away (setmaxnreg 24). Warp-
//                groups 1 and 2 are consumers (setmaxnreg 240): each owns 64 rows of the 128×256
//                block tile, i.e. one m64n256 accumulator of 128 fp32 registers a thread.
//   ring         STAGES slots, each an A tile (128×64) and a B tile (256×64), 48 KiB, written by
//                TMA with 128-byte swizzling (what the wgmma descriptors read). Slot s has two
//                mbarriers: full[s] (the producer's expect_tx arrival + TMA's bytes) and
//                empty[s] (one arrival from each consumer warp when done reading).
//   clusters     blocks run in pairs (a cluster of 2) on vertically adjacent tiles, which need the
//                same B tile: each block fetches half of it and TMA multicasts the half into
//                both blocks' shared memory, so B costs each SM half the L2 traffic. A slot is
//                then free only when the consumers of both blocks have read it: empty[s] counts
//                16 arrivals, 8 from each block.
//   persistence  one block per SM; each cluster takes tile pairs c, c + clusters, ... so the
//                producer prefetches the next tile's slabs while the consumers still store this
//                one.
//   epilogue     staged: a consumer writes its 64 × 256 slab of C into shared memory two 64 × 64
//                boxes at a time and one thread hands them to TMA stores, which run on while the
//                consumer goes on to its next tile. Staging costs shared memory; two boxes per
//                consumer (32 KiB) leave room for all four ring slots, where a whole slab would
//                take one. The second pair of boxes waits, packed to bf16 in registers, until the
//                consumer has issued its next tile's first wgmma group: its shared-memory writes
//                then overlap the tensor cores' work. Storing straight from the accumulators
//                instead (C not addressable by TMA) keeps the tensor cores waiting throughout.
//   tails        TMA zero-fills reads outside A and B and clips stores at C's edges; the direct
//                epilogue stores only inside C. TMA needs K % 8 == 0 and 16-byte aligned A and B
//                (rows start on 16 bytes); staging also needs N % 8 == 0 and a 16-byte aligned C.
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"
#include "k2c/device/hopper.cuh"
#include "k2c/device/tensor_core.cuh"
#include "tensor_core_matmul.h"

namespace k2c::tensor_core_matmul {
namespace {

namespace hp = k2c::hopper;

constexpr int BM = 128, BN = 256, BK = 64;
constexpr int kCluster = 2;     // blocks per cluster sharing B tiles (see wgmma_kernel)
constexpr int kStagedBoxes = 2;      // boxes of C staged per consumer for TMA stores (see wgmma_kernel)
constexpr int kDeferred = 1;    // of a tile's two batches of boxes, stored during the next tile
constexpr int kConsumers = 2;   // warpgroups that multiply
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kTileA = BM * BK * 2, kTileB = BN * BK * 2;  // bytes per slot
constexpr int kStageBytes = kTileA + kTileB;
constexpr int kBox = 64 * 64 * 2;  // one 64 × 64 bf16 box of C, 128-byte swizzled: 8 KiB
static_assert(BK * 2 == 128, "a K slab row is exactly one 128-byte swizzle row");

// Shared memory: the ring; with staging, kBoxes boxes of C per consumer (a whole 64 × 256 slab
// is four, and costs a ring slot: 3 instead of 4); the barriers; 1 KiB of slack to align the ring
// to the 1024 bytes the 128-byte swizzle pattern spans.
template <int kBoxes>
struct Smem {
  static constexpr int kStages = kBoxes > 2 ? 3 : 4;
  static constexpr int kStagingBytes = kConsumers * kBoxes * kBox;
  static constexpr int kBytes = kStages * kStageBytes + kStagingBytes + 2 * kStages * 8 + 1024;
  static_assert(kBytes <= 227 * 1024, "the ring fits in one SM's shared memory");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Tile t of the grouped raster over a tiles_m × tiles_n grid (bands of 16 rows of the grid; with
// clusters a grid row is a pair of tile rows):
// consecutive tiles, which run at the same time on neighbouring SMs, share A rows and B columns
// in L2.
__device__ __forceinline__ void tile_origin(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
  constexpr int kGroupRows = 16;
  const int per_band = kGroupRows * tiles_n;
  const int band = t / per_band, in_band = t % per_band;
  const int band_rows = min(kGroupRows, tiles_m - band * kGroupRows);
  tm = band * kGroupRows + in_band % band_rows;
  tn = in_band / band_rows;
}
#endif

// kCluster = 1: each block loads its own A and B tiles.
// kCluster = 2: blocks run in clusters of two that take vertically adjacent tiles (rows m0 and
// m0 + 128, the same columns): both need the same B tile, so each block loads one half of it
// and TMA multicasts that half into both blocks' shared memory. A slot then holds a peer's
// data too, so it is free only when the consumers of both blocks are done with it: empty[s]
// counts 16 arrivals, 8 local and 8 remote.
//
// kBoxes > 0: a consumer's epilogue writes its 64 × 256 slab into shared memory, kBoxes 64 × 64
// boxes at a time, in the layout a TMA load of them would produce, and one thread hands the boxes
// to TMA stores (clipped at C's edges). The last boxes' stores run while the consumer starts its
// next tile's MMAs; storing straight from the accumulators (kBoxes = 0) keeps the tensor cores
// idle for the whole epilogue. Needs a C that TMA can address (16-byte aligned, N % 8 == 0).
//
// kDefer: the last kDefer of a tile's 4 / kBoxes batches of boxes wait, packed to bf16 in
// registers, until the consumer has issued its next tile's first wgmma groups, so that writing
// them into shared memory overlaps the tensor cores' work (hopper::TmaEpilogue).
template <int kCluster, int kBoxes, int kDefer = 0>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 const __grid_constant__ CUtensorMap map_c, bf16* __restrict__ C, int M, int N, int K, bool pairs) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int STAGES = Smem<kBoxes>::kStages;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t raw = tc::smem_addr(smem_raw);
  const std::uint32_t ring = (raw + 1023) & ~1023u;
  const std::uint32_t staging = ring + STAGES * kStageBytes;
  const std::uint32_t bars = staging + Smem<kBoxes>::kStagingBytes;
  auto slot_a = [&](int s) { return ring + s * kStageBytes; };
  auto slot_b = [&](int s) { return ring + s * kStageBytes + kTileA; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (STAGES + s); };

  // The unit of work is a group of kCluster vertically adjacent tiles; this block takes the
  // rank-th tile of each group its cluster is given.
  const int rank = kCluster > 1 ? static_cast<int>(hp::cluster_rank()) : 0;
  const int cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  const int tiles_m = tc::ceil_div(M, BM), tiles_n = tc::ceil_div(N, BN);
  const int groups_m = (tiles_m + kCluster - 1) / kCluster;
  const int groups = groups_m * tiles_n, k_blocks = tc::ceil_div(K, BK);
  const int warpgroup = threadIdx.x / 128;
  // Group g's tile for this block: its rank-th tile row, the group's column.
  auto origin = [&](int g, int& m0, int& n0) {
    int gm, tn;
    tile_origin(g, groups_m, tiles_n, gm, tn);
    m0 = (gm * kCluster + rank) * BM;
    n0 = tn * BN;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      hp::mbarrier_init(full(s), 1);
      hp::mbarrier_init(empty(s), kCluster * kConsumers * 4);
    }
    hp::fence_barrier_init();
  }
  // The peer's barriers must be initialised before anyone multicasts into them or arrives on them.
  if constexpr (kCluster > 1)
    hp::cluster_sync();
  else
    __syncthreads();

  if (warpgroup == 0) {
    // Producer. Every warp of the group lowers its register cap (a warp that skipped it would
    // hold the consumers' increase back); one thread issues the copies.
    hp::setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      int it = 0;  // k blocks issued so far, over all tiles: slot it % STAGES, lap it / STAGES
      for (int g = cluster; g < groups; g += clusters) {
        int m0, n0;
        origin(g, m0, n0);
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % STAGES;
          // Wait until the consumers have freed the slot in the previous lap (lap 0: at once).
          hp::mbarrier_wait(empty(s), ((it / STAGES) & 1) ^ 1);
          hp::mbarrier_arrive_expect_tx(full(s), kStageBytes);  // own A + every part of B
          hp::tma_load_2d(slot_a(s), &map_a, full(s), kb * BK, m0);
          if constexpr (kCluster == 1) {
            hp::tma_load_2d(slot_b(s), &map_b, full(s), kb * BK, n0);
          } else {
            constexpr int kPart = BN / kCluster;  // rows of B this block fetches for all
            hp::tma_load_2d_multicast(slot_b(s) + rank * kPart * BK * 2, &map_b, full(s),
                                      kb * BK, n0 + rank * kPart, (1u << kCluster) - 1);
          }
        }
      }
    }
  } else {
    // Consumers.
    hp::setmaxnreg_inc<240>();
    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    float d[128];
    hp::TmaEpilogue<(kBoxes > 0 ? kBoxes : 4), kDefer> epilogue{staging + consumer * kBoxes * kBox, &map_c, N, 1 + consumer};
    int it = 0;
    for (int g = cluster; g < groups; g += clusters) {
      int m0, n0;
      origin(g, m0, n0);
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % STAGES;
        hp::mbarrier_wait(full(s), (it / STAGES) & 1);
        hp::wgmma_fence();
        // This consumer's 64 rows of A start 64 rows (8 KiB) into the slot; each k16 step moves
        // 32 bytes along the 128-byte row. The tile's first step overwrites the accumulators.
        const std::uint32_t a = slot_a(s) + consumer * 64 * BK * 2, b = slot_b(s);
#pragma unroll
        for (int k = 0; k < BK / 16; ++k)
          hp::wgmma_m64n256k16(d, hp::smem_desc_128b(a + 32 * k), hp::smem_desc_128b(b + 32 * k),
                               kb > 0 || k > 0);
        hp::wgmma_commit();
        if constexpr (kBoxes > 0) epilogue.after_k_block(kb);
        // Waiting for this block's group before taking the next measured slightly faster than
        // keeping one group in flight (lecture appendix, section 5.2): the other consumer warpgroup keeps
        // the tensor cores busy meanwhile.
        hp::wgmma_wait<0>();
        if (lane == 0) {
          hp::mbarrier_arrive(empty(s));
          for (int peer = 0; peer < kCluster; ++peer)
            if (peer != rank) hp::mbarrier_arrive_cluster(empty(s), peer);
        }
      }

      const int g8 = lane / 4, q = lane % 4;
      if constexpr (kBoxes > 0) {
        const int slab_row = m0 + consumer * 64;
        if (slab_row >= M) continue;  // a cluster's tile past the bottom of C
        epilogue.tile(d, n0, slab_row, k_blocks);
        continue;
      }
      // Epilogue straight from the accumulators: rows 16·warp + g and + 8 of this consumer's 64
      // (none, for a cluster's tile past the bottom of C).
      const int row = m0 + consumer * 64 + warp * 16 + g8;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = n0 + 8 * j + 2 * q;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row + 8 * h;
          if (r >= M) continue;
          bf16* p = C + static_cast<std::size_t>(r) * N + col;
          const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
          if (pairs && col + 1 < N) {
            *reinterpret_cast<std::uint32_t*>(p) = tc::pack_bf16x2(v0, v1);
          } else {
            if (col < N) p[0] = __float2bfloat16(v0);
            if (col + 1 < N) p[1] = __float2bfloat16(v1);
          }
        }
      }
    }
    if constexpr (kBoxes > 0) {
      epilogue.finish();
      if (threadIdx.x % 128 == 0) hp::bulk_wait_all();  // stores done before the block ends
    }
  }
  // No block of a cluster may exit while its peer can still write into its shared memory or
  // arrive on its barriers.
  if constexpr (kCluster > 1) hp::cluster_sync();
#endif
}

}  // namespace

bool hopper_supported(std::string* why_not) { return hp::sm90a_supported(why_not); }

namespace {

// The launch, for arguments matmul_hopper() has checked and K > 0: as many blocks (clusters) as
// can be resident at once, each looping over tiles.
template <int kCluster, int kBoxes, int kDefer = 0>
void launch_hopper(int M, int N, int K, const bf16* A, const bf16* B, bf16* C,
                   cudaStream_t stream) {
  auto* kernel = wgmma_kernel<kCluster, kBoxes, kDefer>;
  constexpr int kSmemBytes = Smem<kBoxes>::kBytes;
  hp::ClusterLaunch launch(kCluster, kThreads, kSmemBytes, stream);
  // The opt-in is per device, and so is the number of resident clusters: asked once per device.
  int device = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kSmemBytes));
  static std::mutex mutex;
  static std::map<int, int> resident_on;
  int resident = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    int& known = resident_on[device];
    if (known == 0) {
      known = launch.resident_blocks(kernel);
      K2C_CHECK(known > 0, "no cluster of " << kCluster << " fits on this GPU");
    }
    resident = known;
  }
  const CUtensorMap map_a = hopper::make_tensor_map_bf16(A, M, K, BM, BK);
  const CUtensorMap map_b = hopper::make_tensor_map_bf16(B, N, K, BN / kCluster, BK);
  // Without staging the map is never read; it still needs a valid tensor to describe.
  const CUtensorMap map_c = kBoxes > 0 ? hopper::make_tensor_map_bf16(C, M, N, 64, 64) : map_a;
  const long long tiles = static_cast<long long>(tc::ceil_div(M, BM)) * tc::ceil_div(N, BN);
  K2C_CHECK(tiles <= 0x7fffffff, "too many tiles: " << M << "x" << N);
  const long long groups = (tiles + kCluster - 1) / kCluster;  // enough to keep every block busy
  launch.config.gridDim = dim3(static_cast<unsigned>(std::min<long long>(groups * kCluster, resident)));
  const bool pairs = N % 2 == 0 && reinterpret_cast<std::uintptr_t>(C) % 4 == 0;
  K2C_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, map_a, map_b, map_c, C, M, N, K, pairs));
}

}  // namespace

void matmul_hopper(int M, int N, int K, const bf16* A, const bf16* B, bf16* C, cudaStream_t stream) {
  check_hopper_args(M, N, K, A, B, C);
  if (M == 0 || N == 0) return;
  hp::require_sm90a("matmul_hopper");
  if (K == 0) {  // an empty sum: nothing for TMA to describe
    K2C_CUDA_CHECK(cudaMemsetAsync(C, 0, static_cast<std::size_t>(M) * N * sizeof(bf16), stream));
    return;
  }
  // Staged stores need a C that TMA can address: rows on 16 bytes.
  if (N % 8 == 0 && aligned16(C))
    launch_hopper<kCluster, kStagedBoxes, kDeferred>(M, N, K, A, B, C, stream);
  else
    launch_hopper<kCluster, 0>(M, N, K, A, B, C, stream);
}

}  // namespace k2c::tensor_core_matmul
