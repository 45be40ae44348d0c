// assignments/04_register_tiled_matmul/register_tiled_matmul.cu — module 04: your implementation
// (contract: register_tiled_matmul.h). Read lectures/04_register_tiled_matmul.md first.
//
// What is given: the Tile template (tile sizes as template parameters, with the static_asserts
// that reject impossible combinations at compile time) and the configurations the tuner chooses
// from (tiles.h, included at the top; add your own to Configs below), and the dispatch from a
// configuration index to its launcher (dispatch.h, included at the end).
// What you write: matmul_kernel (2-D register blocking, float4 loads, A transposed in shared
// memory, warp tiling; double buffering once the rest works) and launch().
#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/gemm_args.h"
#include "k2c/core/todo.h"
#include "register_tiled_matmul.h"
#include "tiles.h"
#include "tuned_config.h"

namespace k2c::register_tiled_matmul {

// ============================================================== tile configuration =========

// Tile, its static_asserts, the nine given configurations and kGroupM are in tiles.h. To try
// another configuration, list it here: ConfigsWith<Tile<128, 64, 16, 64, 32, 2, 8, 4, 128>>
// becomes index 9 for the tuner.
using Configs = ConfigsWith<>;

// ========================================================================== kernel =========

// template <class T, bool kVec>
// __global__ void __launch_bounds__(T::kThreads) matmul_kernel(int M, int N, int K, float alpha,
//     const float* __restrict__ A, const float* __restrict__ B, float beta, float* __restrict__ C);

// ======================================================================== launchers =========

template <class T>
void launch(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream) {
  (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)B, (void)beta, (void)C, (void)stream;
  K2C_TODO("launch: run matmul_kernel<T, vec> with T::kThreads threads and T::kSmemBytes of "
           "dynamic shared memory (cudaFuncSetAttribute above 48 KiB)");
}

}  // namespace k2c::register_tiled_matmul

// The contract's functions from Configs and launch<T>: given, the same for every version.
#include "dispatch.h"
