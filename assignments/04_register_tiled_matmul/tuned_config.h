// tuned_config.h — the configuration matmul() uses; written by the tuner (make tune).
#pragma once
namespace k2c::register_tiled_matmul {
inline constexpr int kTunedConfig = 0;  // not tuned yet: the first configuration
}  // namespace k2c::register_tiled_matmul
