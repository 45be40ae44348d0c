// autograder/09_flash_attention/bench_flash_attention.cu — module 09's sweep:
// BM_attention/<pass>/d<head_dim>/<causal|full>/<N> with 16384 tokens per call (batch = 16384 / N)
// and 2048 channels (heads = 2048 / head_dim), FlashAttention's benchmark convention, for
// N = 512 … 16384. Passes: forward, backward (on the forward's own o and lse), the naive
// forward that materialises S and P (up to N = 8192), and Part B's wgmma forward ("hopper") and
// backward ("hopper_backward"), where the device and build support them. TFLOP/s count 4·B·H·N²·d
// forward (halved when causal), 2.5× that backward.
#include <cmath>
#include <string>

#include <cuda_runtime.h>

#include "flash_attention.h"
#include "k2c/core/check.h"
#include "k2c/testing/bench.h"

namespace fa = k2c::flash_attention;
using fa::bf16;

static void register_all() {
  for (int d : {64, 128})
    for (bool causal : {true, false})
      for (int n : {512, 1024, 2048, 4096, 8192, 16384}) {
        const fa::Shape s{16384 / n, 2048 / d, 2048 / d, n, n, d, causal, 1.0f / std::sqrt(static_cast<float>(d))};
        const double flops = 4.0 * s.batch * s.heads * static_cast<double>(n) * n * d * (causal ? 0.5 : 1.0);
        const std::string suffix = "/d" + std::to_string(d) + (causal ? "/causal/" : "/full/") + std::to_string(n);
        for (const char* pass : {"forward", "backward", "naive", "hopper", "hopper_backward"}) {
          const std::string name = pass;
          if (name == "naive" && n > 8192) continue;  // S alone would be 34 GB at d = 64
          if (name.starts_with("hopper") && !fa::hopper_supported()) continue;
          k2c::bench::add("BM_attention/" + name + suffix, [=](benchmark::State& state) {
            const std::size_t elems = static_cast<std::size_t>(s.batch) * s.heads * n * d;
            k2c::DeviceBuffer<bf16> q(elems), k(elems), v(elems), o(elems), dout(elems), dq(elems), dk(elems), dv(elems);
            k2c::fill_uniform_device(q.data(), elems, 1, -2.0f, 2.0f);
            k2c::fill_uniform_device(k.data(), elems, 2, -2.0f, 2.0f);
            k2c::fill_uniform_device(v.data(), elems, 3);
            k2c::fill_uniform_device(dout.data(), elems, 4);
            k2c::DeviceBuffer<float> lse(static_cast<std::size_t>(s.batch) * s.heads * n);
            if (name == "naive") {
              k2c::DeviceBuffer<char> work(fa::naive_workspace_bytes(s));
              k2c::bench::run(state, [&] {
                fa::naive_forward(s, q.data(), k.data(), v.data(), o.data(), lse.data(), work.data());
              }, flops, 0);
            } else if (name == "forward") {
              k2c::bench::run(state, [&] { fa::forward(s, q.data(), k.data(), v.data(), o.data(), lse.data()); },
                              flops, 0);
            } else if (name == "hopper") {
              k2c::bench::run(state, [&] { fa::forward_hopper(s, q.data(), k.data(), v.data(), o.data(), lse.data()); },
                              flops, 0);
            } else {
              const auto backward = name == "backward" ? fa::backward : fa::backward_hopper;
              k2c::DeviceBuffer<char> work(fa::backward_workspace_bytes(s));
              fa::forward(s, q.data(), k.data(), v.data(), o.data(), lse.data());
              k2c::bench::run(state, [&] {
                backward(s, q.data(), k.data(), v.data(), o.data(), dout.data(), lse.data(), dq.data(), dk.data(),
                         dv.data(), work.data(), nullptr);
              }, 2.5 * flops, 0);
            }
          });
        }
      }
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
