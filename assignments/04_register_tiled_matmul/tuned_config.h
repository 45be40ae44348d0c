// tuned_config.h — the configurations matmul() uses; written by the tuner (make tune).
#pragma once
namespace k2c::register_tiled_matmul {
inline constexpr int kTunedConfig = 0;       // large outputs (not tuned yet)
inline constexpr int kTunedConfigSmall = 0;  // outputs of fewer than kSmallOutputs elements
inline constexpr long kSmallOutputs = 1536L * 1536;
}  // namespace k2c::register_tiled_matmul
