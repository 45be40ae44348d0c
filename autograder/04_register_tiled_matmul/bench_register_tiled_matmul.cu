// autograder/04_register_tiled_matmul/bench_register_tiled_matmul.cu —
// BM_register_tiled_matmul_sgemm/register_tiled/<n>, the tuned configuration.
#include "k2c/testing/bench.h"
#include "register_tiled_matmul.h"

static void register_all() {
  k2c::bench::sgemm_sweep("register_tiled_matmul", "register_tiled",
                          [](int n, const float* a, const float* b, float* c) {
                            k2c::register_tiled_matmul::matmul(n, n, n, 1.0f, a, b, 0.0f, c);
                          });
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
