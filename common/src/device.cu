// device.cu — device queries and the device-side random fill (see k2c/device/device.h,
// k2c/core/random.h).
#include <algorithm>
#include <cctype>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/random.h"
#include "k2c/device/device.h"

namespace k2c {

static DeviceInfo query_device() {
  DeviceInfo d;
  cudaDriverGetVersion(&d.driver_version);
  cudaRuntimeGetVersion(&d.runtime_version);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear it: "no device" is an answer here, not an error
    if (d.driver_version == 0)
      d.reason = "no NVIDIA driver on this machine";
    else
      d.reason = err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device found";
    return d;
  }
  cudaDeviceProp p{};
  K2C_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  int clock_khz = 0;
  K2C_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  d.present = true;
  d.name = p.name;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.sms = p.multiProcessorCount;
  d.clock_ghz = clock_khz * 1e-6;
  d.l2_bytes = static_cast<std::size_t>(p.l2CacheSize);
  d.global_bytes = p.totalGlobalMem;
  return d;
}

const DeviceInfo& device_info() {
  static const DeviceInfo info = query_device();
  return info;
}

int fp32_lanes_per_sm(int cc_major, int cc_minor) {
  if (cc_major < 8 || (cc_major == 8 && cc_minor == 0)) return 64;
  return 128;
}

double fp32_peak_flops(const DeviceInfo& d) {
  return static_cast<double>(d.sms) * fp32_lanes_per_sm(d.cc_major, d.cc_minor) * 2.0 *
         d.clock_ghz * 1e9;
}

std::string gpu_slug(const std::string& name) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s.rfind("nvidia ", 0) == 0) s = s.substr(7);
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

template <class T>
__global__ void fill_uniform_kernel(T* out, std::size_t n, std::uint64_t seed, float lo, float hi) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = static_cast<T>(uniform_at(seed, i, lo, hi));
}

template <class T>
static void fill_uniform_device_as(T* out, std::size_t n, std::uint64_t seed, float lo, float hi) {
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<std::size_t>((n + 255) / 256, 4096));
  fill_uniform_kernel<T><<<blocks, 256>>>(out, n, seed, lo, hi);
  K2C_CUDA_CHECK_LAUNCH();
}

void fill_uniform_device(float* out, std::size_t n, std::uint64_t seed, float lo, float hi) {
  fill_uniform_device_as(out, n, seed, lo, hi);
}
void fill_uniform_device(__nv_bfloat16* out, std::size_t n, std::uint64_t seed, float lo, float hi) {
  fill_uniform_device_as(out, n, seed, lo, hi);
}

}  // namespace k2c
