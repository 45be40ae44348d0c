// autograder/05_tensor_core_matmul/bench_tensor_core_matmul.cu — the bf16 ladder:
// BM_tensor_core_matmul_bf16gemm/{cublas,mma_sync,wgmma}/<n>, C = A·Bᵀ with bf16 output.
// cuBLAS is version 0, as in the SGEMM ladder; wgmma only where Part B can run, and only at sizes
// it accepts (multiples of 8).
#include "k2c/reference/ceilings.h"
#include "k2c/testing/bench.h"
#include "tensor_core_matmul.h"

namespace tcm = k2c::tensor_core_matmul;

static void register_all() {
  k2c::bench::bf16_gemm_sweep("tensor_core_matmul", "cublas",
                              [](int n, const tcm::bf16* a, const tcm::bf16* b, tcm::bf16* c) {
                                k2c::cublas_bf16_gemm(n, n, n, a, b, c);
                              });
  k2c::bench::bf16_gemm_sweep("tensor_core_matmul", "mma_sync",
                              [](int n, const tcm::bf16* a, const tcm::bf16* b, tcm::bf16* c) {
                                tcm::matmul(n, n, n, a, b, c);
                              });
  if (tcm::hopper_supported())
    k2c::bench::bf16_gemm_sweep("tensor_core_matmul", "wgmma",
                                [](int n, const tcm::bf16* a, const tcm::bf16* b, tcm::bf16* c) {
                                  tcm::matmul_hopper(n, n, n, a, b, c);
                                },
                                8);
}

int main(int argc, char** argv) { return k2c::bench::main(argc, argv, register_all); }
