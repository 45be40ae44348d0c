// k2c/core/bf16.h — bf16 <-> fp32 on the host, for code that must not need the CUDA headers
// (the MPI communicator's bf16 reductions, the model library's CPU backend).
#pragma once

#include <cstdint>
#include <cstring>

namespace k2c {

// Widening is exact: the 16 bits are the top half of the fp32. Narrowing rounds to
// nearest, ties to even, as the GPU's __float2bfloat16 does; values past the largest bf16 become
// infinity, and a NaN stays a (quiet) NaN instead of being rounded into infinity.
inline float bf16_to_float(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  // Adding 0x7fff rounds up exactly when the low half is over one half; the low bit of the kept
  // half adds the last 1 on a tie when that bit is odd, so ties go to the even neighbour.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

}  // namespace k2c
