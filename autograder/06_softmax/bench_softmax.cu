// autograder/06_softmax/bench_softmax.cu — module 06's sweep: BM_softmax/<variant>/<cols>, bf16,
// 64 Mi elements (128 MiB) per tensor at every row length, each version beside a cudaMemcpy of
// the same bytes (variant "copy"). tools/plot_bandwidth.py draws GB/s by row length.
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/testing/bench.h"
#include "k2c/testing/bf16.h"
#include "softmax.h"

namespace sm = k2c::softmax;

static void register_all() {
  const std::size_t n = std::size_t{1} << 26;
  for (int cols : {128, 1024, 4096, 8192, 65536}) {
    const int rows = static_cast<int>(n / cols);
    const double bytes = 2.0 * n * sizeof(k2c::bf16);  // x read once, y written once
    k2c::bench::add("BM_softmax/copy/" + std::to_string(cols), [=](benchmark::State& state) {
      k2c::DeviceBuffer<k2c::bf16> x(n), y(n);
      k2c::bench::run(state, [&] {
        K2C_CUDA_CHECK(cudaMemcpyAsync(y.data(), x.data(), x.bytes(), cudaMemcpyDeviceToDevice));
      }, 0, bytes);
    });
    for (sm::Version v : sm::kVersions) {
      k2c::bench::add(std::string("BM_softmax/") + sm::name(v) + "/" + std::to_string(cols),
                      [=](benchmark::State& state) {
                        k2c::DeviceBuffer<k2c::bf16> x(n), y(n);
                        k2c::fill_uniform_device(x.data(), n, 1, -8.0f, 8.0f);
                        k2c::bench::run(state, [&] { sm::softmax(v, x.data(), y.data(), rows, cols); }, 0, bytes);
                      });
    }
  }
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
