// k2c/model/mask.h — the dropout mask rule, one definition for host and device code.
//
// Element `index` of the unsharded activation is kept when a counter-based hash of
// (seed, step, layer, index) lands at or above p (splitmix64's finaliser, 24 random bits), and
// kept elements are scaled by 1/(1 − p). Every backend draws its masks from this function, so
// the CPU and GPU backends, and every way of sharding an activation, drop the same elements.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define K2C_HOST_DEVICE __host__ __device__
#else
#define K2C_HOST_DEVICE
#endif

namespace k2c::model::mask {

K2C_HOST_DEVICE inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

K2C_HOST_DEVICE inline float scale(std::uint64_t seed, std::uint64_t step, std::uint64_t layer,
                                   std::uint64_t index, float p) {
  if (p == 0.0f) return 1.0f;
  const std::uint64_t h = mix(mix(mix(mix(seed) + step) + layer) + index);
  const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;
  return u < p ? 0.0f : 1.0f / (1.0f - p);
}

}  // namespace k2c::model::mask
