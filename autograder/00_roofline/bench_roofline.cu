// autograder/00_roofline/bench_roofline.cu — the bandwidth sweep of module 00:
// BM_roofline_copy/{memcpy,copy}/<floats> from 256 K to 256 M floats, and the FMA kernel.
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/random.h"
#include "k2c/device/buffer.h"
#include "k2c/testing/bench.h"
#include "roofline.h"

namespace rl = k2c::roofline;

static void register_all() {
  for (std::size_t n = std::size_t{1} << 18; n <= std::size_t{1} << 28; n <<= 2) {
    const double bytes = 2.0 * n * sizeof(float);  // read + write
    for (const char* variant : {"memcpy", "copy"}) {
      const bool memcpy_version = variant[0] == 'm';
      k2c::bench::add(std::string("BM_roofline_copy/") + variant + "/" + std::to_string(n),
                      [n, bytes, memcpy_version](benchmark::State& state) {
                        k2c::DeviceBuffer<float> src(n), dst(n);
                        k2c::fill_uniform_device(src.data(), n, 1);
                        k2c::bench::run(state, [&] {
                          if (memcpy_version)
                            K2C_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), n * sizeof(float),
                                                           cudaMemcpyDeviceToDevice));
                          else
                            rl::copy(src.data(), dst.data(), n);
                        }, 0, bytes);
                      });
    }
  }
  const std::size_t n = static_cast<std::size_t>(k2c::device_info().sms) * 4096;
  for (int iters : {256, 4096}) {
    k2c::bench::add("BM_roofline_fma/fma/" + std::to_string(iters),
                    [n, iters](benchmark::State& state) {
                      k2c::DeviceBuffer<float> buf(n);
                      k2c::fill_uniform_device(buf.data(), n, 2);
                      k2c::bench::run(state, [&] { rl::fma_throughput(buf.data(), n, iters); },
                                      2.0 * rl::kFmaChains * iters * n, 0);
                    });
  }
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
