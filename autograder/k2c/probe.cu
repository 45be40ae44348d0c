// probe.cu — k2c_probe: the device and (with --ceilings) the measured ceilings, as JSON.
// The grader runs it as a child process so that k2c itself never links CUDA.
#include <cstdio>
#include <cstring>
#include <iostream>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "k2c/device/device.h"
#include "k2c/reference/ceilings.h"

int main(int argc, char** argv) {
  const bool ceilings = argc > 1 && std::strcmp(argv[1], "--ceilings") == 0;
  const k2c::DeviceInfo& d = k2c::device_info();
  int count = 0;
  if (d.present && cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  nlohmann::json j;
  j["device"] = {{"present", d.present}, {"count", count}, {"reason", d.reason}, {"name", d.name},
                 {"cc", std::to_string(d.cc_major) + std::to_string(d.cc_minor)},
                 {"sms", d.sms}, {"clock_ghz", d.clock_ghz}, {"l2_bytes", d.l2_bytes},
                 {"global_bytes", d.global_bytes}, {"driver", d.driver_version},
                 {"runtime", d.runtime_version}};
  if (ceilings) {
    if (!d.present) {
      std::fprintf(stderr, "no CUDA device: %s\n", d.reason.c_str());
      return 3;
    }
    try {
      j["ceilings"] = {
          {"cudaMemcpy D2D", {{"value", k2c::copy_bandwidth() / 1e9}, {"unit", "GB/s"}}},
          {"fp32 peak", {{"value", k2c::fp32_peak_flops(d) / 1e12}, {"unit", "TFLOP/s"}}},
          {"cuBLAS SGEMM", {{"value", k2c::sgemm_rate(4096) / 1e12}, {"unit", "TFLOP/s"}, {"size", 4096}}},
          {"cuBLAS bf16 GEMM", {{"value", k2c::bf16_gemm_rate(4096) / 1e12}, {"unit", "TFLOP/s"}, {"size", 4096}}},
      };
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
  }
  std::cout << j.dump(2) << "\n";
  return 0;
}
