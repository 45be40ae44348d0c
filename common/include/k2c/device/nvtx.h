// k2c/device/nvtx.h — K2C_NVTX_RANGE("name"): a named range on nsys timelines for the enclosing
// scope. Compiled out when the NVTX v3 headers are absent (they are header-only: nothing to link).
#pragma once

// Also compiled out in module implementations (K2C_NO_NVTX, set by k2c_add_module): NVTX's header
// finds its tool library with dlopen, and the grader withholds performance points from a
// student library that loads libraries at run time.
#if __has_include(<nvtx3/nvToolsExt.h>) && !defined(K2C_NO_NVTX)
#include <nvtx3/nvToolsExt.h>
namespace k2c {
struct NvtxRange {
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};
}  // namespace k2c
#define K2C_NVTX_CAT2(a, b) a##b
#define K2C_NVTX_CAT(a, b) K2C_NVTX_CAT2(a, b)
#define K2C_NVTX_RANGE(name) ::k2c::NvtxRange K2C_NVTX_CAT(k2c_nvtx_, __LINE__)(name)
#else
#define K2C_NVTX_RANGE(name) ((void)0)
#endif
