// autograder/03_tiled_matmul/bench_tiled_matmul.cu — BM_tiled_matmul_sgemm/{tile32,tiled}/<n>.
#include "k2c/testing/bench.h"
#include "tiled_matmul.h"

static void register_all() {
  k2c::bench::sgemm_sweep("tiled_matmul", "tile32", [](int n, const float* a, const float* b, float* c) {
    k2c::tiled_matmul::matmul_tile32(n, n, n, 1.0f, a, b, 0.0f, c);
  });
  k2c::bench::sgemm_sweep("tiled_matmul", "tiled", [](int n, const float* a, const float* b, float* c) {
    k2c::tiled_matmul::matmul(n, n, n, 1.0f, a, b, 0.0f, c);
  });
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
