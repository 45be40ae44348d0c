// assignments/04_register_tiled_matmul/register_tiled_matmul.h — the contract of module 04
// (do not edit).
//
// The same SGEMM as module 01 (see assignments/01_naive_matmul/naive_matmul.h for the full
// statement): C = alpha * A * B + beta * C, fp32, row-major, densely packed device arrays,
// A M×K, B K×N, C M×N, any M, N, K >= 0; beta == 0 means C is not read; K == 0 leaves beta * C;
// asynchronous on `stream`; std::invalid_argument for a negative size or a null pointer that
// would be used.
//
// The kernel is a template over its tile sizes. The implementation offers a list of tile
// configurations; the tuner (autograder/04_register_tiled_matmul/tune_register_tiled_matmul.cu,
// `make tune`) times them all on the GPU at hand and writes the fastest one's index into
// tuned_config.h beside the implementation, which matmul() uses. The tests run every
// configuration, so any configuration that compiles must also compute the right answer.
//
// Tests: autograder/04_register_tiled_matmul/test_register_tiled_matmul.cu.
// Lecture: lectures/04_register_tiled_matmul.md.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

namespace k2c::register_tiled_matmul {

// One tile configuration: a block computes a bm×bn tile of C in steps of bk along K; each of its
// warps a wm×wn sub-tile in wniter column slices; each thread tm×tn outputs per slice.
struct TileConfig {
  int bm, bn, bk, wm, wn, wniter, tm, tn, threads;
  std::string name() const;  // e.g. "128x128x16 w64x64x4 t8x4 128thr"
};

int config_count();
TileConfig config(int index);

// The graded entry point: the configuration tuned_config.h names.
void matmul(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
            cudaStream_t stream = nullptr);

// The same computation with configuration `index` (0 <= index < config_count()).
void matmul_config(int index, int M, int N, int K, float alpha, const float* A, const float* B,
                   float beta, float* C, cudaStream_t stream = nullptr);

}  // namespace k2c::register_tiled_matmul
