// tuned_config.h — the configurations matmul() uses; written by the tuner (make tune).
// NVIDIA H200, 2026-11-29, 4096^3: 128x256x8 w64x64x4 t8x4 256thr, 48.364 TFLOP/s = 96.3% of cuBLAS SGEMM in the same run.
// The small-output configuration is not tuned yet (make tune chooses it at 1024^3).
#pragma once
namespace k2c::register_tiled_matmul {
inline constexpr int kTunedConfig = 7;       // large outputs
inline constexpr int kTunedConfigSmall = 8;  // outputs of at most kSmallOutputs elements
inline constexpr long kSmallOutputs = 1536L * 1536;
}  // namespace k2c::register_tiled_matmul
