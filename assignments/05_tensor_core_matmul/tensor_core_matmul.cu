// assignments/05_tensor_core_matmul/tensor_core_matmul.cu — module 05, Part A: your mma.sync GEMM
// (contract: tensor_core_matmul.h). Read lectures/05_tensor_core_matmul.md sections 1-7 first.
//
// What is given: the Tile template with the static_asserts that reject impossible tile shapes,
// the swizzle map, the argument checks and the choice between the fast path (16-byte copies)
// and the general one. The instructions themselves are wrapped in k2c/device/tensor_core.cuh
// (cp_async_16, cp_async_commit/wait, ldmatrix_x4, mma_bf16_16816, pack_bf16x2).
// What you write: the kernel (block and warp tiling, a cp.async pipeline over STAGES shared-
// memory buffers, ldmatrix from the swizzled tiles, mma.sync, and an epilogue that stores only
// inside C) and launch().
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"
#include "k2c/core/todo.h"
#include "k2c/device/tensor_core.cuh"
#include "tensor_core_matmul.h"

namespace k2c::tensor_core_matmul {
namespace {

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

  static_assert(BM % (16 * WARPS_M) == 0 && BN % (16 * WARPS_N) == 0,
                "warp tiles are whole 16-row and 16-column steps (B is read 16 columns at a time)");
  static_assert((BM * 8) % kThreads == 0 && (BN * 8) % kThreads == 0,
                "every thread copies the same number of 16-byte chunks");
  static_assert(STAGES >= 2, "a pipeline needs at least two buffers");
  static_assert(kSmemBytes <= 227 * 1024, "the stages fit in one SM's shared memory");
};

// Start with something small that works (e.g. Tile<64, 64, 2, 2, 2>), then grow it: lecture
// section 5 explains why 64×64 warp tiles are needed to keep the tensor cores fed.
using Chosen = Tile<128, 128, 2, 2, 3>;

// Byte offset of 16-byte chunk `chunk` (0-7) of row `row` in a tile of 128-byte rows, swizzled so
// that ldmatrix's 8 row addresses fall in 8 different groups of banks (lecture section 4).
[[maybe_unused]] __device__ __forceinline__ std::uint32_t swizzled(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

// Your kernel. A suggested signature:
//   template <class T, bool kVector, class OutT>
//   __global__ void __launch_bounds__(T::kThreads, 1)
//   mma_kernel(int M, int N, int K, const bf16* A, const bf16* B, OutT* C, bool pairs);
// kVector: 16-byte cp.async copies (K % 8 == 0, A and B 16-byte aligned) or element loads.
// pairs: C rows allow 2-element stores (N even, C aligned to a pair).

// Launches the kernel for C (bf16 or float). The arguments are checked already; M, N > 0.
template <class OutT>
void launch(int M, int N, int K, const bf16* A, const bf16* B, OutT* C, bool vector, bool pairs,
            cudaStream_t stream) {
  (void)M, (void)N, (void)K, (void)A, (void)B, (void)C, (void)vector, (void)pairs, (void)stream;
  K2C_TODO("launch your mma.sync kernel (dynamic shared memory above 48 KiB needs "
           "cudaFuncSetAttribute first)");
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <class OutT>
void run(int M, int N, int K, const bf16* A, const bf16* B, OutT* C, cudaStream_t stream) {
  check_gemm_args(M, N, K, A, B, 0.0f, C);
  if (M == 0 || N == 0) return;
  const bool vector = K % 8 == 0 && aligned16(A) && aligned16(B);
  const bool pairs = N % 2 == 0 && reinterpret_cast<std::uintptr_t>(C) % (2 * sizeof(OutT)) == 0;
  launch(M, N, K, A, B, C, vector, pairs, stream);
}

}  // namespace

void matmul(int M, int N, int K, const bf16* A, const bf16* B, bf16* C, cudaStream_t stream) {
  run(M, N, K, A, B, C, stream);
}

void matmul(int M, int N, int K, const bf16* A, const bf16* B, float* C, cudaStream_t stream) {
  run(M, N, K, A, B, C, stream);
}

}  // namespace k2c::tensor_core_matmul
