// assignments/05_tensor_core_matmul/tensor_core_matmul.cu — module 05, Part A: your mma.sync GEMM
// (contract: tensor_core_matmul.h). Read lectures/05_tensor_core_matmul.md sections 1-7 first.
//
// What is given: the Tile template with the static_asserts that reject impossible tile shapes,
// and the swizzle map (tiles.cuh, included at the top); the argument checks, the choice between
// the fast path (16-byte copies) and the general one, and matmul() (dispatch.h, at the end).
// The instructions themselves are wrapped in k2c/device/tensor_core.cuh (cp_async_16,
// cp_async_commit/wait, ldmatrix_x4, mma_bf16_16816, pack_bf16x2).
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
#include "tiles.cuh"

namespace k2c::tensor_core_matmul {
namespace {

// Start with something small that works (e.g. Tile<64, 64, 2, 2, 2>), then grow it: lecture
// section 5 explains why 64×64 warp tiles are needed to keep the tensor cores fed.
using Chosen = Tile<128, 128, 2, 2, 3>;

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

}  // namespace
}  // namespace k2c::tensor_core_matmul

// matmul() from launch<OutT>: given, the same for every version.
#include "dispatch.h"
