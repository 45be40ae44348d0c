// autograder/02_coalesced_matmul/bench_coalesced_matmul.cu — BM_coalesced_matmul_sgemm/coalesced/<n>.
#include "coalesced_matmul.h"
#include "k2c/testing/bench.h"

static void register_all() {
  k2c::bench::sgemm_sweep("coalesced_matmul", "coalesced", [](int n, const float* a, const float* b, float* c) {
    k2c::coalesced_matmul::matmul(n, n, n, 1.0f, a, b, 0.0f, c);
  });
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
