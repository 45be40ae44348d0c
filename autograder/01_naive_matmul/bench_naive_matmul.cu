// autograder/01_naive_matmul/bench_naive_matmul.cu — the first rung of the SGEMM ladder, and
// cuBLAS as version 0: BM_naive_matmul_sgemm/{cublas,naive}/<n>. tools/plot_ladder.py draws
// the ladder of modules 01–04 from these programs' JSON.
#include "k2c/reference/ceilings.h"
#include "k2c/testing/bench.h"
#include "naive_matmul.h"

static void register_all() {
  k2c::bench::sgemm_sweep("naive_matmul", "cublas", [](int n, const float* a, const float* b, float* c) {
    k2c::cublas_sgemm(n, n, n, 1.0f, a, b, 0.0f, c);
  });
  k2c::bench::sgemm_sweep("naive_matmul", "naive", [](int n, const float* a, const float* b, float* c) {
    k2c::naive_matmul::matmul(n, n, n, 1.0f, a, b, 0.0f, c);
  });
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
