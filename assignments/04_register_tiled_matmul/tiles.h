// assignments/04_register_tiled_matmul/tiles.h — the given beginning of register_tiled_matmul.cu:
// the Tile template (tile sizes as template parameters, with the static_asserts that reject every
// combination the kernel could not run), the nine configurations the tuner chooses from, and
// kGroupM, the block order's group height. Included once, at the top of register_tiled_matmul.cu
// (the stub's and the reference's alike), which then names its list: `using Configs =
// ConfigsWith<>;`, or ConfigsWith<Tile<...>, ...> to try more. Not a file to edit or submit: the
// tuner's indices in tuned_config.h count from the first of these nine, so extra configurations
// go after them, in the .cu.
#pragma once

#include <cstddef>
#include <tuple>

#include "register_tiled_matmul.h"

namespace k2c::register_tiled_matmul {

template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN, int THREADS>
struct Tile {
  static constexpr int kBM = BM, kBN = BN, kBK = BK, kWM = WM, kWN = WN, kWNIter = WNITER,
                       kTM = TM, kTN = TN, kThreads = THREADS;
  static constexpr int kWarps = THREADS / 32;
  static constexpr int kWMIter = (WM * WN) / (32 * TM * TN * WNITER);  // row slices per warp
  static constexpr int kWSubM = WM / (kWMIter > 0 ? kWMIter : 1), kWSubN = WN / WNITER;
  static constexpr int kLdA = BM + 4;  // padded row of the transposed A tile (16-byte aligned)
  static constexpr int kLoadsA = BM * BK / 4 / THREADS;  // float4 loads per thread per tile
  static constexpr int kLoadsB = BK * BN / 4 / THREADS;
  static constexpr std::size_t kSmemBytes = 2 * BK * (kLdA + BN) * sizeof(float);

  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 1024 threads");
  static_assert(BM % WM == 0 && BN % WN == 0, "warp tiles tile the block tile");
  static_assert((BM / WM) * (BN / WN) == kWarps, "one warp tile per warp");
  static_assert(kWMIter >= 1 && (WM * WN) % (32 * TM * TN * WNITER) == 0,
                "a warp tile splits into whole per-thread slices");
  static_assert(kWMIter >= 1 && WM % (kWMIter > 0 ? kWMIter : 1) == 0 && WN % WNITER == 0, "slices tile the warp tile");
  static_assert((kWSubM / TM) * (kWSubN / TN) == 32 && kWSubM % TM == 0 && kWSubN % TN == 0,
                "the 32 threads of a warp cover one slice exactly");
  static_assert(TM % 4 == 0 && TN % 4 == 0, "fragments are read as float4");
  static_assert(BK % 4 == 0 && BN % 4 == 0, "tiles are loaded as float4");
  static_assert((BM * BK / 4) % THREADS == 0 && (BK * BN / 4) % THREADS == 0,
                "every thread loads the same whole number of float4s");
  static_assert(kSmemBytes <= 227 * 1024, "two buffers fit in a block's shared memory");

  static TileConfig config() { return {BM, BN, BK, WM, WN, WNITER, TM, TN, THREADS}; }
};

// The configurations the tuner chooses from: these nine, then `More`. A line added in the .cu
// (ConfigsWith<Tile<...>>) is a new candidate; the static_asserts above reject it at compile
// time if the kernel could not run it.
template <class... More>
using ConfigsWith = std::tuple<
    Tile<128, 128, 16, 64, 64, 4, 8, 4, 128>,   // 128 outputs per thread, 4 warps
    Tile<128, 128, 8, 64, 32, 2, 8, 4, 256>,    // 64 outputs per thread, 8 warps
    Tile<128, 256, 16, 64, 64, 4, 8, 4, 256>,   // 128 outputs per thread, 8 warps, wide tile
    Tile<256, 128, 16, 64, 64, 4, 8, 4, 256>,   // the same, tall
    Tile<64, 128, 16, 32, 64, 2, 4, 4, 128>,    // 64 outputs per thread, small tile
    Tile<128, 128, 16, 32, 64, 2, 8, 4, 256>,   // 64 outputs per thread, BK 16
    Tile<128, 128, 16, 64, 32, 2, 8, 4, 256>,   // like 1 with BK 16
    Tile<128, 256, 8, 64, 64, 4, 8, 4, 256>,    // like 2 with BK 8
    Tile<64, 64, 16, 32, 32, 1, 4, 4, 128>,     // 32 outputs per thread: many blocks for small C
    More...>;

constexpr int kGroupM = 8;  // tile rows per group in the block order

}  // namespace k2c::register_tiled_matmul
