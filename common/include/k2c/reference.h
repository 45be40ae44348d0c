// k2c/reference.h — CPU reference implementations, the correctness oracle of every module.
//
// Plain loops in double precision, written for clarity rather than speed: what the GPU version
// must compute, with rounding error far below any kernel's tolerance.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace k2c::ref {

// C = alpha * A * B + beta * C, row-major, A M×K, B K×N, C M×N. With beta == 0, C is not read.
std::vector<double> gemm(int M, int N, int K, double alpha, std::span<const float> A,
                         std::span<const float> B, double beta, std::span<const float> C);

// One element (r, c) of the same GEMM: for spot checks of sizes too large for the full loop.
double gemm_at(int N, int K, double alpha, std::span<const float> A, std::span<const float> B,
               double beta, std::span<const float> C, int r, int c);

// Module 00's FMA-chain function (see assignments/00_roofline/roofline.h). It is defined in
// fp32 arithmetic with fused multiply-adds, so the reference computes it in fp32 with std::fma:
// the GPU result should agree to the last bits of the final sum.
std::vector<double> fma_chains(std::span<const float> in, int iters, int chains, float step,
                               float mul, float add);

}  // namespace k2c::ref
