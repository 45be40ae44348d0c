// k2c/core/random.h — deterministic random numbers, identical on CPU and GPU.
//
// Values come from a counter-based hash (splitmix64) of (seed, index), not from a stateful
// generator, so element i of a tensor is the same number whether it was drawn on the host or
// by a GPU thread, in any order, and a failing case is reproduced by its seed alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

// Declared, not included: this header also serves code built without the CUDA toolkit.
struct __nv_bfloat16;

#if defined(__CUDACC__)
#define K2C_HD __host__ __device__
#else
#define K2C_HD
#endif

namespace k2c {

K2C_HD inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [lo, hi), with 24 random bits: every value is exactly representable in fp32.
K2C_HD inline float uniform_at(std::uint64_t seed, std::uint64_t i, float lo, float hi) {
  const auto bits = static_cast<std::uint32_t>(mix64(mix64(seed) + i) >> 40);
  return lo + (hi - lo) * (static_cast<float>(bits) * (1.0f / 16777216.0f));
}

inline void fill_uniform(std::span<float> out, std::uint64_t seed, float lo = -1.0f,
                         float hi = 1.0f) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = uniform_at(seed, i, lo, hi);
}

// Fills device memory with the same values fill_uniform would give (k2c_cuda; async on stream 0);
// the bf16 overload stores them rounded to nearest (benchmark inputs, made without a host copy).
void fill_uniform_device(float* out, std::size_t n, std::uint64_t seed, float lo = -1.0f,
                         float hi = 1.0f);
void fill_uniform_device(__nv_bfloat16* out, std::size_t n, std::uint64_t seed, float lo = -1.0f,
                         float hi = 1.0f);

}  // namespace k2c
