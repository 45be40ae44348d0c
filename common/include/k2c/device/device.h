// k2c/device/device.h — what GPU (if any) this process sees, and its theoretical fp32 peak.
#pragma once

#include <cstddef>
#include <string>

namespace k2c {

struct DeviceInfo {
  bool present = false;
  std::string reason;        // why no device is usable, when !present
  std::string name;          // e.g. "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;
  int sms = 0;
  double clock_ghz = 0;      // maximum SM clock the driver reports
  std::size_t l2_bytes = 0;
  std::size_t global_bytes = 0;
  int driver_version = 0;    // e.g. 13000
  int runtime_version = 0;
};

// Device 0 (the harness always uses the current device); cached after the first call.
const DeviceInfo& device_info();

// FP32 lanes per SM by architecture: 64 on sm_70/sm_80, 128 on sm_86 and newer.
int fp32_lanes_per_sm(int cc_major, int cc_minor);

// SMs × lanes × 2 FLOP per FMA × maximum clock. A kernel cannot beat it; the clock it holds
// under load may be lower, which is why the course asks for a fraction of it.
double fp32_peak_flops(const DeviceInfo& d);

// "NVIDIA H200" -> "h200": the name of autograder/reference/<gpu>.json for this device.
std::string gpu_slug(const std::string& name);

}  // namespace k2c
