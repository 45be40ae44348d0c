// autograder/08_rope/bench_rope.cu — module 08's sweep: BM_rope/<variant>/<head_dim>, bf16, a
// Llama-style input of 4 × 4096 tokens with 32 query and 8 key heads, head_dim 64 and 128: both
// pair layouts with cos/sin from the table and on the fly, beside a cudaMemcpy of the same bytes
// (variant "copy"). GB/s count q and k read and written once.
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/testing/bench.h"
#include "k2c/testing/bf16.h"
#include "rope.h"

namespace rp = k2c::rope;
using k2c::bf16;

static void register_all() {
  for (int d : {64, 128}) {
    const rp::Shape s{4, 4096, 32, 8, d};
    const std::size_t tokens = static_cast<std::size_t>(s.batch) * s.seq;
    const std::size_t nq = tokens * s.q_heads * d, nk = tokens * s.kv_heads * d;
    const double bytes = 2.0 * (nq + nk) * sizeof(bf16);
    const std::string suffix = "/" + std::to_string(d);
    k2c::bench::add("BM_rope/copy" + suffix, [=](benchmark::State& state) {
      k2c::DeviceBuffer<bf16> a(nq + nk), b(nq + nk);
      k2c::bench::run(state, [&] {
        K2C_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), a.bytes(), cudaMemcpyDeviceToDevice));
      }, 0, bytes);
    });
    for (rp::Layout layout : {rp::Layout::interleaved, rp::Layout::half_split}) {
      for (bool use_cache : {true, false}) {
        const std::string name = std::string(layout == rp::Layout::interleaved ? "interleaved" : "half_split") +
                                 (use_cache ? "_table" : "_on_the_fly");
        k2c::bench::add("BM_rope/" + name + suffix, [=](benchmark::State& state) {
          k2c::DeviceBuffer<bf16> q(nq), k(nk), q_out(nq), k_out(nk);
          k2c::fill_uniform_device(q.data(), nq, 1);
          k2c::fill_uniform_device(k.data(), nk, 2);
          k2c::DeviceBuffer<float2> cache(static_cast<std::size_t>(s.seq) * (d / 2));
          rp::build_cache(cache.data(), s.seq, d, 10000.0);
          k2c::bench::run(state, [&] {
            rp::apply(q.data(), k.data(), q_out.data(), k_out.data(), s, 0, layout, rp::Direction::forward,
                      10000.0, use_cache ? cache.data() : nullptr, use_cache ? s.seq : 0);
          }, 0, bytes);
        });
      }
    }
  }
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
