// autograder/07_rmsnorm/bench_rmsnorm.cu — module 07's sweep: BM_rmsnorm/<variant>/<cols>, bf16,
// 64 Mi elements per tensor at every row length: forward, forward with the fused residual add,
// backward, and a cudaMemcpy of the forward's bytes (variant "copy"). GB/s count the bytes each
// pass must move: forward 2, fused forward 4, backward 3 tensors.
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/testing/bench.h"
#include "k2c/testing/bf16.h"
#include "rmsnorm.h"

namespace rn = k2c::rmsnorm;
using k2c::bf16;

static void register_all() {
  const std::size_t n = std::size_t{1} << 26;
  const double tensor = static_cast<double>(n) * sizeof(bf16);
  for (int cols : {128, 1024, 4096, 8192, 65536}) {
    const int rows = static_cast<int>(n / cols);
    const std::string suffix = "/" + std::to_string(cols);
    k2c::bench::add("BM_rmsnorm/copy" + suffix, [=](benchmark::State& state) {
      k2c::DeviceBuffer<bf16> x(n), y(n);
      k2c::bench::run(state, [&] {
        K2C_CUDA_CHECK(cudaMemcpyAsync(y.data(), x.data(), x.bytes(), cudaMemcpyDeviceToDevice));
      }, 0, 2 * tensor);
    });
    for (bool fused : {false, true}) {
      k2c::bench::add(std::string("BM_rmsnorm/") + (fused ? "forward_residual" : "forward") + suffix,
                      [=](benchmark::State& state) {
                        k2c::DeviceBuffer<bf16> x(n), res(n), g(cols), y(n), sum(n);
                        k2c::fill_uniform_device(x.data(), n, 1, -2.0f, 2.0f);
                        k2c::fill_uniform_device(res.data(), n, 2, -2.0f, 2.0f);
                        k2c::fill_uniform_device(g.data(), cols, 3, 0.5f, 1.5f);
                        k2c::DeviceBuffer<float> rstd(rows);
                        k2c::bench::run(state, [&] {
                          rn::forward(x.data(), fused ? res.data() : nullptr, g.data(), y.data(),
                                      fused ? sum.data() : nullptr, rstd.data(), rows, cols, 1e-5f);
                        }, 0, (fused ? 4 : 2) * tensor);
                      });
    }
    k2c::bench::add("BM_rmsnorm/backward" + suffix, [=](benchmark::State& state) {
      k2c::DeviceBuffer<bf16> h(n), dy(n), g(cols), dx(n);
      k2c::fill_uniform_device(h.data(), n, 1, -2.0f, 2.0f);
      k2c::fill_uniform_device(dy.data(), n, 2, -1.0f, 1.0f);
      k2c::fill_uniform_device(g.data(), cols, 3, 0.5f, 1.5f);
      k2c::DeviceBuffer<float> rstd(rows), dgamma(cols);
      k2c::DeviceBuffer<char> workspace(rn::backward_workspace_bytes(rows, cols));
      k2c::DeviceBuffer<bf16> y(n);
      rn::forward(h.data(), nullptr, g.data(), y.data(), nullptr, rstd.data(), rows, cols, 1e-5f);
      k2c::bench::run(state, [&] {
        rn::backward(h.data(), g.data(), dy.data(), rstd.data(), dx.data(), dgamma.data(), workspace.data(),
                     rows, cols);
      }, 0, 3 * tensor);
    });
  }
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
