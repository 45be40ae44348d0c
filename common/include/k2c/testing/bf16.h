// k2c/testing/bf16.h — bfloat16 on the host side of the tests: rounding inputs, widening outputs,
// and test tensors held as float or bf16 on the device.
//
// bf16 keeps fp32's 8-bit exponent and cuts the mantissa to 7 bits, so converting fp32 → bf16
// rounds to 8 significant bits (relative error at most 2^-8) and bf16 → fp32 is exact. Tests draw
// inputs in fp32, round them once with to_bf16, and give the CPU reference the widened bf16
// values: the reference then sees exactly what the kernel sees.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>

#include "k2c/core/random.h"
#include "k2c/device/buffer.h"

namespace k2c {

using bf16 = __nv_bfloat16;

// Round to nearest even, as the GPU's __float2bfloat16 does.
inline std::vector<bf16> to_bf16(std::span<const float> x) {
  std::vector<bf16> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = __float2bfloat16(x[i]);
  return out;
}

inline std::vector<float> widen(std::span<const bf16> x) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = __bfloat162float(x[i]);
  return out;
}

// The fp32 values a tensor holds after a round trip through bf16.
inline std::vector<float> round_to_bf16(std::span<const float> x) { return widen(to_bf16(x)); }

}  // namespace k2c

// ---- typed test data: values drawn in fp32, held as T (float or bf16) on the device ----------

namespace k2c {

// n uniform values in [lo, hi), already rounded to what T can hold (so the CPU reference sees
// exactly the kernel's input).
template <class T>
std::vector<float> random_values(std::size_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(n);
  fill_uniform(v, seed, lo, hi);
  if constexpr (std::is_same_v<T, bf16>) v = round_to_bf16(v);
  return v;
}

template <class T>
DeviceBuffer<T> to_device(std::span<const float> values) {
  if constexpr (std::is_same_v<T, bf16>) {
    const std::vector<bf16> b = to_bf16(values);
    return DeviceBuffer<T>{std::span<const bf16>(b)};
  } else {
    return DeviceBuffer<T>{values};
  }
}

template <class T>
std::vector<float> to_host(const DeviceBuffer<T>& d) {
  if constexpr (std::is_same_v<T, bf16>) {
    const std::vector<bf16> b = d.download();
    return widen(b);
  } else {
    return d.download();
  }
}

// The values after `by` leading zeros: uploaded, the data then starts `by` elements past an
// allocation's (16-byte aligned) start, which is how tests hand a kernel misaligned pointers.
inline std::vector<float> after_padding(std::span<const float> values, std::size_t by) {
  std::vector<float> out(values.size() + by, 0.0f);
  std::copy(values.begin(), values.end(), out.begin() + static_cast<std::ptrdiff_t>(by));
  return out;
}

template <class T>
const char* type_name() {
  return std::is_same_v<T, bf16> ? "bf16" : "fp32";
}

}  // namespace k2c
