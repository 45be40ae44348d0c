// k2c/reference/ceilings.h — the ceilings performance is measured against, measured on the GPU
// at hand.
//
// Every performance threshold of the course is a fraction of one of these, measured in the same
// process as the code under test, so a threshold means the same on an A100, an RTX 4090 or an
// H200. Each function allocates its own buffers, fills them with random data (never zeros: a
// GEMM on zeros runs faster than on real data), and times with time_gpu.
#pragma once

#include <cstddef>

struct __nv_bfloat16;

namespace k2c {

// Device-to-device cudaMemcpy, in bytes per second counting bytes read plus bytes written.
double copy_bandwidth(std::size_t bytes_per_buffer = std::size_t{1} << 30);

// cuBLAS SGEMM (fp32, no TF32) at M = N = K = n, in FLOP/s.
double sgemm_rate(int n = 4096);

// cuBLAS GEMM with bf16 inputs, fp32 accumulation and bf16 output at M = N = K = n, in the
// layout of module 05 (C = A·Bᵀ, all row-major), in FLOP/s.
double bf16_gemm_rate(int n = 4096);

// Version 0 of the bf16 ladder: cuBLAS computing module 05's C = A·Bᵀ (A M×K, B N×K, C M×N, all
// row-major bf16, fp32 accumulation), asynchronous on the default stream.
void cublas_bf16_gemm(int M, int N, int K, const __nv_bfloat16* A, const __nv_bfloat16* B,
                      __nv_bfloat16* C);

// The vendor library as "version 0" of the SGEMM ladder: cuBLAS SGEMM on row-major operands,
// C = alpha*A*B + beta*C, asynchronous on the default stream (one handle per process).
void cublas_sgemm(int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                  float* C);

// Module 01's naive SGEMM (one thread per output, threadIdx.x walking down rows), kept here as a
// trusted baseline: module 02's goal is a multiple of its rate, and a handout has no solutions/.
void naive_sgemm(int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                 float* C);
double naive_sgemm_rate(int n = 4096);

}  // namespace k2c
