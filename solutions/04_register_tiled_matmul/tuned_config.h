// tuned_config.h — the configurations matmul() uses; written by the tuner (make tune).
// NVIDIA H200, 2026-11-29.
// large: 4096^3: 128x256x8 w64x64x4 t8x4 256thr, 48.40 TFLOP/s = 95.4% of cuBLAS SGEMM in the same run
// small: 1024^3: 64x128x16 w32x64x2 t4x4 128thr, 35.00 TFLOP/s = 111.5% of cuBLAS SGEMM in the same run
#pragma once
namespace k2c::register_tiled_matmul {
inline constexpr int kTunedConfig = 7;       // large outputs
inline constexpr int kTunedConfigSmall = 4;  // outputs of fewer than kSmallOutputs elements
inline constexpr long kSmallOutputs = 2048L * 2048;
}  // namespace k2c::register_tiled_matmul
