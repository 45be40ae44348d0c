// assignments/05_tensor_core_matmul/tiles.cuh — the given beginning of tensor_core_matmul.cu
// (Part A): the Tile template, with the static_asserts that reject impossible tile shapes at
// compile time, and the swizzle map of a tile's 128-byte rows. Included once, at the top of
// tensor_core_matmul.cu (the stub's and the reference's alike); not a file to edit or submit.
// The kernel that uses them is what the module asks you to write.
#pragma once

#include <cstdint>

namespace k2c::tensor_core_matmul {
namespace {  // internal to the .cu that includes it, like the kernel

// A block computes a BM×BN tile of C in k steps of 64; its WARPS_M × WARPS_N warps each own a
// (BM/WARPS_M) × (BN/WARPS_N) sub-tile, made of 16×8 mma tiles.
template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, BK = 64, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_,
                       STAGES = STAGES_;
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // one warp's tile
  static constexpr int MT = WM / 16, NT = WN / 8;             // its mma tiles
  static constexpr int kRowBytes = BK * 2;                     // one 128-byte row per tile row
  static constexpr int kStageBytes = (BM + BN) * kRowBytes;
  static constexpr int kSmemBytes = STAGES * kStageBytes;
  // Block-rows per raster band, for a kernel that walks the tiles of C in bands of block-rows:
  // blocks resident at one time then share A and B tiles in L2.
  static constexpr int kGroupRows = 16;

  static_assert(BM % (16 * WARPS_M) == 0 && BN % (16 * WARPS_N) == 0,
                "warp tiles are whole 16-row and 16-column steps (B is read 16 columns at a time)");
  static_assert((BM * 8) % kThreads == 0 && (BN * 8) % kThreads == 0,
                "every thread copies the same number of 16-byte chunks");
  static_assert(STAGES >= 2, "a pipeline needs at least two buffers");
  static_assert(kSmemBytes <= 227 * 1024, "the stages fit in one SM's shared memory");
};

// Byte offset of 16-byte chunk `chunk` (0-7) of row `row` in a tile of 128-byte rows, swizzled so
// that ldmatrix's 8 row addresses fall in 8 different groups of banks (lecture section 4).
[[maybe_unused]] __device__ __forceinline__ std::uint32_t swizzled(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

}  // namespace
}  // namespace k2c::tensor_core_matmul
