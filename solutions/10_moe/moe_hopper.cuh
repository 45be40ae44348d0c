// solutions/10_moe/moe_hopper.cuh — module 10's reference, part 4 of 4: Part B, the grouped GEMM
// on wgmma (sm_90a), with TMA copies, a producer warpgroup and two consumers, persistent over the
// groups; then its entry points grouped_gemm_hopper() and grouped_weight_grad_hopper(). Included
// by moe.cu only, at namespace k2c::moe scope (it opens its own unnamed namespace), after the
// contract's mma.sync entry points; the layer, in moe.cu, follows.
#pragma once

// ================================================================================================
// Part B: the grouped GEMM on wgmma (module 05's Part B kernel, persistent over groups)
// ================================================================================================
//
//   block     384 threads = 3 warpgroups. Warpgroup 0 produces: one thread issues the TMA copies
//             and the group hands its registers to the others (setmaxnreg 24). Warpgroups 1 and
//             2 consume (setmaxnreg 240): each owns 64 rows of the 128×256 tile, one m64n256
//             accumulator of 128 fp32 registers a thread.
//   ring      STAGES slots of an A tile (128×64) and a B tile (256×64), written by TMA with
//             128-byte swizzling; full[s] completes on the copies' bytes, empty[s] on one
//             arrival per consumer warp.
//   forms     as in grouped_kernel, C[m][n] = Σ_r A(m, r) B(n, r):
//             forward  A and B K-major: TMA boxes of 128 rows of 64 r, one of A, two of B;
//             dX       B MN-major (W read untransposed): four boxes of 64 r-rows × 64 n, read
//                      through MN-major descriptors with wgmma's transpose flag;
//             dW       A and B MN-major (dY and X, r = the group's rows), the groups splitting r.
//   groups    A tile of group g reads A from row offsets[g] + m0 (forward, dX) and B from row
//             g·(n or k) + n0; rows past the group's end (the next group's, or TMA's zero fill)
//             are multiplied but never stored. In the dW form they would be summed: the last k
//             step of a tile clears them in shared memory before the wgmma reads the slot.
//             Producer and consumers walk the same tile sequence, each finding a tile's group in
//             the prefix of tile counts that the block computes first.
//   tails     a group's last tile row is on average half empty (a group of 1560 rows ends in a
//             tile of 24). Where at most 64 of its rows are real (forward, dX), the consumers
//             split the tile's columns instead of its rows: both read A's first 64 rows, each
//             multiplies them by its 128 columns of B (m64n128), and the tile takes half the MMAs.
//   pairs     (forward and dX forms, measured and not used) blocks could run in clusters of two
//             that take neighbouring tiles of the list, which usually share their B tile (tiles of
//             a group go down a column first): each block fetches half of B and TMA multicasts it
//             into both, so that B crosses from L2 once per pair instead of once per tile (module
//             05's clusters). At this module's shapes their rates were 2.5-11% lower than one block per
//             tile (lab/moe_grouped.cu pairs; lecture section 7).

namespace {

namespace hp = k2c::hopper;

enum class HopperForm { forward, dx, dw };

constexpr int kHopperBM = 128, kHopperBN = 256, kHopperBK = 64, kHopperThreads = 384;
constexpr int kHopperTileA = kHopperBM * kHopperBK * 2, kHopperTileB = kHopperBN * kHopperBK * 2;
constexpr int kHopperStageBytes = kHopperTileA + kHopperTileB;
constexpr int kHopperBox = 64 * 64 * 2;  // one 64 × 64 box of bf16, 128-byte swizzled: 8 KiB
constexpr int kHopperBoxB = kHopperBN / 2;  // rows of a forward-form B box: a tile takes two

// Shared memory of a variant: the ring; with kBoxes > 0, kBoxes 64 × 64 boxes of each consumer's
// 64 × 256 bf16 output slab, staged for TMA stores (all four cost a ring slot: 3 instead of 4);
// the barriers; 1 KiB of slack to align the ring to the 1024 bytes a 128-byte swizzle spans. The
// prefix of tile counts comes last, one int per group and one more (prefix_bytes).
template <int kBoxes>
struct HopperSmem {
  static constexpr int kStages = kBoxes > 2 ? 3 : 4;
  static constexpr int kStaging = 2 * kBoxes * kHopperBox;
  static constexpr int kBytes = kStages * kHopperStageBytes + kStaging + 2 * kStages * 8 + 1024;
  static_assert(kBytes + 4 * 2 <= 227 * 1024, "the ring, staging and a one-group prefix fit");
};
constexpr int prefix_bytes(int groups) { return 4 * (groups + 1); }
constexpr int kSmemLimit = 227 * 1024;
constexpr int kStagedBoxes = 4;  // what the module's launches stage
static_assert(HopperSmem<kStagedBoxes>::kBytes + prefix_bytes(kMaxExperts) <= kSmemLimit, "every group count fits");

struct HopperArgs {
  int groups;
  const int* offsets;
  int m, n, k;  // m: dW only (C's rows); k: the reduction of the forward and dX forms
  void* c;
  bool pairs;
};

// kBoxes > 0: the epilogue goes through shared memory, kBoxes boxes at a time, and TMA stores (bf16
// C whose rows start on 16 bytes), so that a consumer's last stores overlap its next tile's MMAs
// instead of stalling them; the last kDefer batches wait in registers until the next tile's first
// wgmma groups are issued (hopper::TmaEpilogue; module 05 measures the choices).
//
// kSplitTail: tail tiles with at most 64 real rows split along columns (see "tails" above); false
// only in lab/moe_grouped.cu, which measures what the split is worth.
//
// kCluster = 2 (see "pairs" above): the blocks run in clusters of two, and a cluster takes the
// tiles 2u and 2u + 1 of the list together. Where both lie in one group and one column of tiles
// they need the same B tile, and each block fetches half of it and multicasts the half into both;
// otherwise each fetches its own. A slot may then hold the peer's data, so it is free only when
// the consumers of both blocks are done with it: empty[s] counts the arrivals of both. The two
// blocks therefore step through the ring together, which only the forward and dX forms allow
// (every tile there has the same k blocks); a block whose tile lies past the list's end steps
// through its k blocks without copies or MMAs.
template <HopperForm kForm, class OutT, int kBoxes, int kDefer = 0, bool kSplitTail = true, int kCluster = 1>
__global__ void __launch_bounds__(kHopperThreads, 1)
    hopper_grouped_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ CUtensorMap map_c, HopperArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kCluster == 1 || (kCluster == 2 && kForm != HopperForm::dw),
                "pairs share B in the forward and dX forms only: dW's tiles differ in length");
  constexpr bool kAT = kForm == HopperForm::dw, kBT = kForm != HopperForm::forward;  // MN-major operands
  constexpr int kHopperStages = HopperSmem<kBoxes>::kStages;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t ring = (smem_addr(smem_raw) + 1023) & ~1023u;
  const std::uint32_t staging = ring + kHopperStages * kHopperStageBytes;
  const std::uint32_t bars = staging + HopperSmem<kBoxes>::kStaging;
  int* prefix = reinterpret_cast<int*>(smem_raw + (bars + 16 * kHopperStages - smem_addr(smem_raw)));
  auto slot_a = [&](int s) { return ring + s * kHopperStageBytes; };
  auto slot_b = [&](int s) { return ring + s * kHopperStageBytes + kHopperTileA; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kHopperStages + s); };
  const int tiles_n = ceil_div(p.n, kHopperBN);
  const int warpgroup = threadIdx.x / 128, lane = threadIdx.x % 32;
  auto tiles_of = [&](int g) {
    return (kForm == HopperForm::dw ? ceil_div(p.m, kHopperBM) : ceil_div(p.offsets[g + 1] - p.offsets[g], kHopperBM)) *
           tiles_n;
  };

  if (threadIdx.x < 32) warp_prefix(p.groups, tiles_of, prefix);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kHopperStages; ++s) {
      hp::mbarrier_init(full(s), 1);
      hp::mbarrier_init(empty(s), kCluster * 2 * 4);  // every consumer warp of the cluster
    }
    hp::fence_barrier_init();
  }
  // With pairs, the peer's barriers must be initialised before anyone multicasts into them.
  if constexpr (kCluster > 1)
    hp::cluster_sync();
  else
    __syncthreads();
  const int total = prefix[p.groups];
  const int rank = kCluster > 1 ? static_cast<int>(hp::cluster_rank()) : 0;
  const int cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  // Units of work: unit u is tiles kCluster·u .. kCluster·u + kCluster − 1, this block's the rank-th.
  const int units = ceil_div(total, kCluster);
  // Tile t → its group, the group's first row, its row count, the tile's origin in C, and the
  // reduction length.
  struct Where {
    int g, row0, rows, m0, n0, r;
  };
  auto locate = [&](int t) {
    Where w;
    w.g = group_of(prefix, p.groups, t);
    w.row0 = p.offsets[w.g];
    w.rows = p.offsets[w.g + 1] - w.row0;
    const int tiles_m = kForm == HopperForm::dw ? ceil_div(p.m, kHopperBM) : ceil_div(w.rows, kHopperBM);
    const int local = t - prefix[w.g];
    w.m0 = (local % tiles_m) * kHopperBM;
    w.n0 = (local / tiles_m) * kHopperBN;
    w.r = kForm == HopperForm::dw ? w.rows : p.k;
    return w;
  };
  // Whether unit u's two tiles read the same B tile (same group, same column of tiles).
  auto pair_shares_b = [&](int u) {
    if (kCluster == 1 || kCluster * u + 1 >= total) return false;
    const Where x = locate(kCluster * u), y = locate(kCluster * u + 1);
    return x.g == y.g && x.n0 == y.n0;
  };
  // Arrives on slot s's empty barrier in every block of the cluster (one arrival per warp).
  auto release = [&](int s) {
    hp::mbarrier_arrive(empty(s));
    if constexpr (kCluster > 1) hp::mbarrier_arrive_cluster(empty(s), rank ^ 1);
  };

  if (warpgroup == 0) {
    hp::setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      int it = 0;  // k blocks issued over all tiles: slot it % STAGES, lap it / STAGES
      for (int u = cluster; u < units; u += clusters) {
        const int t = kCluster * u + rank;
        const bool real = t < total;
        const Where w = real ? locate(t) : Where{0, 0, 0, 0, 0, p.k};
        const bool shares_b = pair_shares_b(u);
        // B's parts: 2 boxes of 128 rows (forward) or 4 of 64 columns (dX); with a shared B tile
        // this block fetches the parts of its rank for both blocks, else all of them for itself.
        constexpr int kParts = kForm == HopperForm::forward ? 2 : 4, kPartBytes = kHopperTileB / kParts;
        for (int kb = 0; kb < ceil_div(w.r, kHopperBK); ++kb, ++it) {
          const int s = it % kHopperStages, r0 = kb * kHopperBK;
          hp::mbarrier_wait(empty(s), ((it / kHopperStages) & 1) ^ 1);
          if (!real) {  // no tile: the slot's phase passes with no bytes
            hp::mbarrier_arrive(full(s));
            continue;
          }
          hp::mbarrier_arrive_expect_tx(full(s), kHopperStageBytes);
          if constexpr (kForm != HopperForm::dw) {
            hp::tma_load_2d(slot_a(s), &map_a, full(s), r0, w.row0 + w.m0);
            for (int j = 0; j < kParts; ++j) {
              const std::uint32_t dst = slot_b(s) + j * kPartBytes;
              const int x = kForm == HopperForm::forward ? r0 : w.n0 + 64 * j;
              const int y = kForm == HopperForm::forward ? w.g * p.n + w.n0 + kHopperBoxB * j : w.g * p.k + r0;
              if (!shares_b)
                hp::tma_load_2d(dst, &map_b, full(s), x, y);
              else if (j * kCluster / kParts == rank)
                hp::tma_load_2d_multicast(dst, &map_b, full(s), x, y, (1u << kCluster) - 1);
            }
          } else {
            for (int j = 0; j < 2; ++j)
              hp::tma_load_2d(slot_a(s) + j * kHopperBox, &map_a, full(s), w.m0 + 64 * j, w.row0 + r0);
            for (int j = 0; j < 4; ++j)
              hp::tma_load_2d(slot_b(s) + j * kHopperBox, &map_b, full(s), w.n0 + 64 * j, w.row0 + r0);
          }
        }
      }
    }
  } else {
    hp::setmaxnreg_inc<240>();
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4;
    float d[128];
    hp::TmaEpilogue<(kBoxes > 0 ? kBoxes : 4), kDefer> epilogue{staging + consumer * kBoxes * kHopperBox, &map_c, p.n,
                                                            2 + consumer};
    int it = 0;
    for (int u = cluster; u < units; u += clusters) {
      const int t = kCluster * u + rank;
      if (t >= total) {  // the peer's tile is the list's last: keep the ring's laps in step with it
        for (int kb = 0; kb < ceil_div(p.k, kHopperBK); ++kb, ++it) {
          const int s = it % kHopperStages;
          hp::mbarrier_wait(full(s), (it / kHopperStages) & 1);
          if (lane == 0) release(s);
        }
        continue;
      }
      const Where w = locate(t);
      const int k_blocks = ceil_div(w.r, kHopperBK);
      // A tail tile split along columns: this consumer's columns start 128·consumer further,
      // its rows where the tile's do.
      const bool split = kSplitTail && kForm != HopperForm::dw && w.rows - w.m0 <= 64;
      if (k_blocks == 0) {  // dW of an empty group: a sum of nothing
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0;
      }
      // The k loop, compiled once per tile shape: a branch between the two shapes inside it
      // would make ptxas serialise every wgmma (it cannot prove the branch warpgroup-uniform).
      auto k_loop = [&](auto split_tile) {
        constexpr bool kSplit = decltype(split_tile)::value;
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % kHopperStages;
          hp::mbarrier_wait(full(s), (it / kHopperStages) & 1);
          if constexpr (kForm == HopperForm::dw) {
            // The group's last k step: clear the rows past its end in all six boxes (they hold
            // the next group's rows, or whatever lies past the last kept row), so that they add
            // zero.
            const int valid = w.r - kb * kHopperBK;
            if (valid < kHopperBK) {
              const int ct = threadIdx.x - 128;  // 0..255 over both consumers
              const int chunks = (kHopperBK - valid) * 8;  // 16-byte pieces per box
              for (int i = ct; i < 6 * chunks; i += 256) {
                const int box = i / chunks, piece = i % chunks;
                const std::uint32_t base = box < 2 ? slot_a(s) + box * kHopperBox : slot_b(s) + (box - 2) * kHopperBox;
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(base + valid * 128 + piece * 16), "r"(0));
              }
              hp::fence_proxy_async();
              hp::named_sync(1, 256);  // both consumers, after all the clearing
            }
          }
          hp::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kHopperBK / 16; ++kk) {
            if constexpr (kSplit) {
              static_assert(kSplit && !kAT, "split tiles read A K-major (the forward and dX forms)");
              // 128 rows of K-major B are 16 KiB; 128 columns of MN-major B are two of its boxes.
              const std::uint64_t a = hp::smem_desc_128b(slot_a(s) + 32 * kk);
              const std::uint64_t b =
                  kBT ? hp::smem_desc_128b_mn(slot_b(s) + consumer * 2 * kHopperBox + kk * 2048, kHopperBox)
                      : hp::smem_desc_128b(slot_b(s) + consumer * 128 * kHopperBK * 2 + 32 * kk);
              hp::wgmma_m64n128k16_ss<0, kBT ? 1 : 0>(d, a, b, kb > 0 || kk > 0);
            } else {
              const std::uint64_t a =
                  kAT ? hp::smem_desc_128b_mn(slot_a(s) + consumer * kHopperBox + kk * 2048, kHopperBox)
                      : hp::smem_desc_128b(slot_a(s) + consumer * 64 * kHopperBK * 2 + 32 * kk);
              const std::uint64_t b = kBT ? hp::smem_desc_128b_mn(slot_b(s) + kk * 2048, kHopperBox)
                                          : hp::smem_desc_128b(slot_b(s) + 32 * kk);
              hp::wgmma_m64n256k16<kAT ? 1 : 0, kBT ? 1 : 0>(d, a, b, kb > 0 || kk > 0);
            }
          }
          hp::wgmma_commit();
          if constexpr (kBoxes > 0) epilogue.after_k_block(kb);
          hp::wgmma_wait<0>();
          if (lane == 0) release(s);
        }
      };
      if constexpr (kSplitTail && kForm != HopperForm::dw) {
        if (split) k_loop(std::true_type{});
        else k_loop(std::false_type{});
      } else {
        k_loop(std::false_type{});
      }
      // Rows 16·warp + g8 and + 8 of this consumer's 64, inside C (forward, dX: the group's rows).
      const int g8 = lane / 4, q = lane % 4;
      const int row_end = kForm == HopperForm::dw ? p.m : w.rows;
      if constexpr (kBoxes > 0) {
        // A slab wholly inside the group: into the staging boxes kBoxes at a time, each batch
        // stored by TMA. Slabs that cross the group's end take the direct stores below.
        if (!split && w.m0 + consumer * 64 + 64 <= row_end) {
          epilogue.tile(d, w.n0, w.row0 + w.m0 + consumer * 64, k_blocks);
          continue;
        }
      }
      OutT* c = static_cast<OutT*>(p.c) + (kForm == HopperForm::dw ? static_cast<long long>(w.g) * p.m * p.n
                                                                   : static_cast<long long>(w.row0) * p.n);
      // Split: this consumer's 16 column blocks of the tile's first 64 rows; else its 64 rows.
      const int r_local = w.m0 + (split ? 0 : consumer * 64) + warp * 16 + g8;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int col = w.n0 + (split ? consumer * kHopperBN / 2 : 0) + 8 * j + 2 * q;
        if (col >= p.n || (split && j >= 16)) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r_local + 8 * h;
          if (r < row_end)
            store_pair(c + static_cast<long long>(r) * p.n + col, col + 1 < p.n, p.pairs, false, d[4 * j + 2 * h],
                       d[4 * j + 2 * h + 1]);
        }
      }
    }
    if constexpr (kBoxes > 0) {
      epilogue.finish();
      if (threadIdx.x % 128 == 0) hp::bulk_wait_all();
    }
  }
  // No block of a cluster may exit while its peer can still write into its shared memory or
  // arrive on its barriers.
  if constexpr (kCluster > 1) hp::cluster_sync();
#endif
}

// Whether this build and device run Part B, asked once per device (a probe launch). With a CUDA
// error pending the probe would not run: the answer is then "no" for this call only.
bool hopper_here() {
  static std::mutex mutex;
  static std::map<int, bool> known;
  int device = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (known.find(device) == known.end() && cudaPeekAtLastError() != cudaSuccess) return false;
  auto it = known.find(device);
  if (it == known.end()) it = known.emplace(device, hp::sm90a_supported(nullptr)).first;
  return it->second;
}

template <HopperForm kForm, class OutT, int kBoxes = 0, int kDefer = 0, bool kSplitTail = true, int kCluster = 1>
void launch_hopper(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c, const HopperArgs& args,
                   cudaStream_t stream) {
  auto* kernel = hopper_grouped_kernel<kForm, OutT, kBoxes, kDefer, kSplitTail, kCluster>;
  const int smem = HopperSmem<kBoxes>::kBytes + prefix_bytes(args.groups);
  K2C_CHECK(smem <= kSmemLimit, "moe: " << args.groups << " groups do not fit the wgmma kernel's shared memory");
  // The limit is the variant's largest (the most groups), not this call's: a limit set per call
  // could be lowered by another host thread between its set and this launch.
  constexpr int kLimit = std::min(kSmemLimit, HopperSmem<kBoxes>::kBytes + prefix_bytes(kMaxExperts));
  K2C_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLimit));
  hp::ClusterLaunch launch(kCluster, kHopperThreads, smem, stream);
  // As many blocks as fit at once (persistent), asked once per device.
  static std::mutex mutex;
  static std::map<int, int> resident_on;
  int device = 0, resident = 0;
  K2C_CUDA_CHECK(cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(mutex);
    int& known = resident_on[device];
    if (known == 0) {
      known = launch.resident_blocks(kernel);
      K2C_CHECK(known > 0, "moe: the wgmma kernel does not fit on this GPU");
    }
    resident = known;
  }
  launch.config.gridDim = dim3(resident);
  K2C_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, map_a, map_b, map_c, args));
}

}  // namespace

bool hopper_supported(std::string* why_not) { return hp::sm90a_supported(why_not); }

void grouped_gemm_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* a, const bf16* b,
                         bf16* c, bool b_transposed, cudaStream_t stream) {
  const char* who = "moe grouped_gemm_hopper";
  check_grouped_hopper(groups, offsets, rows, n, k, a, b, c, b_transposed, who);
  hp::require_sm90a(who);
  if (rows == 0) return;
  const HopperArgs args{groups, offsets, 0, n, k, c, n % 2 == 0 && reinterpret_cast<std::uintptr_t>(c) % 4 == 0};
  const CUtensorMap map_a = hp::make_tensor_map_bf16(a, rows, k, kHopperBM, kHopperBK);
  const CUtensorMap map_b = b_transposed ? hp::make_tensor_map_bf16(b, groups * n, k, kHopperBoxB, kHopperBK)
                                         : hp::make_tensor_map_bf16(b, groups * k, n, 64, 64);
  // TMA stores C where its rows start on 16 bytes; otherwise the epilogue stores from registers.
  // The whole slab staged at once (four boxes, three ring slots): at this module's shapes it
  // measured ahead of two boxes at a time with four slots, which module 05's longer K prefers
  // (lab/moe_grouped.cu boxes).
  if (n % 8 == 0 && reinterpret_cast<std::uintptr_t>(c) % 16 == 0) {
    const CUtensorMap map_c = hp::make_tensor_map_bf16(c, rows, n, 64, 64);
    if (b_transposed) launch_hopper<HopperForm::forward, bf16, kStagedBoxes>(map_a, map_b, map_c, args, stream);
    else launch_hopper<HopperForm::dx, bf16, kStagedBoxes>(map_a, map_b, map_c, args, stream);
  } else {
    if (b_transposed) launch_hopper<HopperForm::forward, bf16>(map_a, map_b, map_a, args, stream);
    else launch_hopper<HopperForm::dx, bf16>(map_a, map_b, map_a, args, stream);
  }
}

void grouped_weight_grad_hopper(int groups, const int* offsets, int rows, int n, int k, const bf16* dy, const bf16* x,
                                float* dw, cudaStream_t stream) {
  const char* who = "moe grouped_weight_grad_hopper";
  check_weight_grad_hopper(groups, offsets, rows, n, k, dy, x, dw, who);
  hp::require_sm90a(who);
  const HopperArgs args{groups, offsets, n, k, 0, dw, k % 2 == 0 && reinterpret_cast<std::uintptr_t>(dw) % 8 == 0};
  if (rows == 0) {  // every group is empty: every gradient is zero
    K2C_CUDA_CHECK(cudaMemsetAsync(dw, 0, sizeof(float) * groups * static_cast<std::size_t>(n) * k, stream));
    return;
  }
  // In GEMM terms C[m][n] with m = dY's width and n = X's width, both read MN-major.
  const CUtensorMap map_a = hp::make_tensor_map_bf16(dy, rows, n, 64, 64);
  const CUtensorMap map_b = hp::make_tensor_map_bf16(x, rows, k, 64, 64);
  launch_hopper<HopperForm::dw, float>(map_a, map_b, map_a, args, stream);
}
