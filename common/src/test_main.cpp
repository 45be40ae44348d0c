// test_main.cpp — the main() of every module's test program (compiled once, as the object
// library k2c_test_main; each program's k2c::testing::kProgram says which module it tests).
//
// Besides running GoogleTest it
//   - fixes the context the tests read (module, tree, rubric, seed from K2C_SEED),
//   - records the seed and the device in the JSON report for the grader,
//   - serves the grader's witness run of a timed kernel (--k2c_witness=NAME) instead of testing,
//   - ends the process after a test that left a sticky CUDA error (an illegal address, say):
//     every later test would fail for a reason that is not theirs, so the module is reported
//     as crashed with the cause instead.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "k2c/testing/testing.h"
#if K2C_HAS_CUDA
#include <cuda_runtime.h>

#include "k2c/device/device.h"
#endif

namespace {

class DeviceEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    using ::testing::Test;
    const auto& c = k2c::testing::context();
    Test::RecordProperty("k2c_module", c.module_id);
    Test::RecordProperty("k2c_impl", c.impl);
    Test::RecordProperty("k2c_seed", std::to_string(c.seed));
#if K2C_HAS_CUDA
    const k2c::DeviceInfo& d = k2c::device_info();
    Test::RecordProperty("k2c_gpu", d.present ? d.name : std::string("none"));
    if (!d.present) Test::RecordProperty("k2c_gpu_reason", d.reason);
    Test::RecordProperty("k2c_cuda_runtime", std::to_string(d.runtime_version));
    std::printf("[ k2c      ] module %s (%s), seed %llu, device: %s\n", c.module_id.c_str(),
                c.impl.c_str(), static_cast<unsigned long long>(c.seed),
                d.present ? d.name.c_str() : ("none (" + d.reason + ")").c_str());
#else
    Test::RecordProperty("k2c_gpu", "none");
    Test::RecordProperty("k2c_gpu_reason", "built without a CUDA toolkit");
#endif
  }
};

#if K2C_HAS_CUDA
class StickyErrorListener : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!k2c::device_info().present) return;
    const cudaError_t first = cudaDeviceSynchronize();
    cudaGetLastError();
    const cudaError_t again = cudaDeviceSynchronize();
    if (again != cudaSuccess) {
      std::fprintf(stderr, "K2C_FATAL: sticky CUDA error after %s.%s: %s\n",
                   info.test_suite_name(), info.name(), cudaGetErrorString(again));
      std::fflush(nullptr);
      std::_Exit(3);
    }
    if (first != cudaSuccess)
      std::fprintf(stderr, "[ k2c      ] warning: %s.%s left an unchecked CUDA error: %s\n",
                   info.test_suite_name(), info.name(), cudaGetErrorString(first));
  }
};
#endif

}  // namespace

int main(int argc, char** argv) {
  // The grader's witness run of a timed kernel (k2c/testing/witness.h): no tests, no report.
  if (const int status = k2c::testing::serve_witness_if_asked(argc, argv); status >= 0) return status;
  ::testing::InitGoogleTest(&argc, argv);
  const k2c::testing::Context c =
      k2c::testing::context_from_env(k2c::testing::kProgram.module_id, k2c::testing::kProgram.impl,
                                      k2c::testing::kProgram.default_rubric);
  k2c::testing::set_context(c);

  ::testing::AddGlobalTestEnvironment(new DeviceEnvironment);
#if K2C_HAS_CUDA
  ::testing::UnitTest::GetInstance()->listeners().Append(new StickyErrorListener);
#endif
  return RUN_ALL_TESTS();
}
