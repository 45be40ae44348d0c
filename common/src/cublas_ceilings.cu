// cublas_ceilings.cu — see k2c/reference/ceilings.h: the ceilings and ladder baselines that call
// cuBLAS.
//
// Kept in a file of their own so that only programs which call one of them link cuBLAS (test
// programs link with --as-needed): loading cuBLAS and cuBLASLt costs hundreds of MB of reads,
// which a program that measures bandwidth should never pay on a cold start.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/random.h"
#include "k2c/device/buffer.h"
#include "k2c/device/nvtx.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"

namespace k2c {

namespace {

struct CublasHandle {
  cublasHandle_t h{};
  CublasHandle() { K2C_CUBLAS_CHECK(cublasCreate(&h)); }
  ~CublasHandle() { cublasDestroy(h); }
};

__global__ void to_bf16_kernel(const float* in, __nv_bfloat16* out, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = __float2bfloat16(in[i]);
}

}  // namespace

double sgemm_rate(int n) {
  K2C_NVTX_RANGE("ceiling: cuBLAS SGEMM");
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  DeviceBuffer<float> a(nn), b(nn), c(nn);
  fill_uniform_device(a.data(), nn, 1);
  fill_uniform_device(b.data(), nn, 2);
  fill_uniform_device(c.data(), nn, 3);
  CublasHandle blas;
  // (b, a) rather than (a, b): the row-major trick of cublas_sgemm below.
  // The default math mode keeps SGEMM in plain fp32 (TF32 tensor cores need an explicit opt-in),
  // so this is the rate an fp32 kernel competes with.
  K2C_CUBLAS_CHECK(cublasSetMathMode(blas.h, CUBLAS_DEFAULT_MATH));
  const float alpha = 1.0f, beta = 0.5f;
  const Timing t = time_gpu([&] {
    K2C_CUBLAS_CHECK(cublasSgemm(blas.h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, b.data(), n,
                                 a.data(), n, &beta, c.data(), n));
  });
  return 2.0 * n * static_cast<double>(n) * n / (t.median_ms * 1e-3);
}

void cublas_sgemm(int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                  float* C) {
  static CublasHandle blas;
  // cuBLAS is column-major: a row-major C (M×N) is a column-major Cᵀ (N×M) = Bᵀ·Aᵀ, so swapping
  // the operands computes the row-major product with no transposes.
  K2C_CUBLAS_CHECK(cublasSgemm(blas.h, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, B, N, A, K,
                               &beta, C, N));
}

double bf16_gemm_rate(int n) {
  K2C_NVTX_RANGE("ceiling: cuBLAS bf16 GEMM");
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  DeviceBuffer<float> tmp(nn);
  DeviceBuffer<__nv_bfloat16> a(nn), b(nn), c(nn);
  fill_uniform_device(tmp.data(), nn, 4);
  to_bf16_kernel<<<1024, 256>>>(tmp.data(), a.data(), nn);
  fill_uniform_device(tmp.data(), nn, 5);
  to_bf16_kernel<<<1024, 256>>>(tmp.data(), b.data(), nn);
  K2C_CUDA_CHECK_LAUNCH();
  const Timing t = time_gpu([&] { cublas_bf16_gemm(n, n, n, a.data(), b.data(), c.data()); });
  return 2.0 * n * static_cast<double>(n) * n / (t.median_ms * 1e-3);
}

void cublas_bf16_gemm(int M, int N, int K, const __nv_bfloat16* A, const __nv_bfloat16* B,
                      __nv_bfloat16* C) {
  static CublasHandle blas;
  const float alpha = 1.0f, beta = 0.0f;
  // Row-major C (M×N) = A·Bᵀ is column-major Cᵀ (N×M) = B·Aᵀ, where the row-major N×K B is a
  // column-major K×N matrix (so op T) and the row-major M×K A a column-major K×M one (op N).
  K2C_CUBLAS_CHECK(cublasGemmEx(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, B, CUDA_R_16BF,
                                K, A, CUDA_R_16BF, K, &beta, C, CUDA_R_16BF, N,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace k2c
