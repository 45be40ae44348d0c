// autograder/01_naive_matmul/bench_naive_matmul.cu — the first rung of the SGEMM ladder:
// BM_naive_matmul_sgemm/{cublas,naive}/<n> for square sizes including non-powers of two
// (cuBLAS is version 0: every later module's rate reads as a fraction of it).
#include "k2c/bench.h"
#include "k2c/buffer.h"
#include "k2c/ceilings.h"
#include "k2c/random.h"
#include "naive_matmul.h"

static void register_all() {
  for (int n : {128, 256, 500, 512, 1000, 1024, 2000, 2048, 4000, 4096}) {
    for (const char* variant : {"cublas", "naive"}) {
      const bool library = variant[0] == 'c';
      k2c::bench::add(std::string("BM_naive_matmul_sgemm/") + variant + "/" + std::to_string(n),
                      [n, library](benchmark::State& state) {
                        const std::size_t nn = static_cast<std::size_t>(n) * n;
                        k2c::DeviceBuffer<float> a(nn), b(nn), c(nn);
                        k2c::fill_uniform_device(a.data(), nn, 1);
                        k2c::fill_uniform_device(b.data(), nn, 2);
                        k2c::bench::run(state, [&] {
                          if (library)
                            k2c::cublas_sgemm(n, n, n, 1.0f, a.data(), b.data(), 0.0f, c.data());
                          else
                            k2c::naive_matmul::matmul(n, n, n, 1.0f, a.data(), b.data(), 0.0f, c.data());
                        }, 2.0 * n * static_cast<double>(n) * n, 0);
                      })->Iterations(n >= 2000 ? 3 : 10);
    }
  }
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
