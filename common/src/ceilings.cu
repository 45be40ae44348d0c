// ceilings.cu — see k2c/reference/ceilings.h: the ceilings that need no vendor library (the
// cuBLAS ones are in cublas_ceilings.cu, so a program that measures only bandwidth never loads
// cuBLAS).
#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/random.h"
#include "k2c/device/buffer.h"
#include "k2c/device/nvtx.h"
#include "k2c/device/timing.h"
#include "k2c/reference/ceilings.h"

namespace k2c {

double copy_bandwidth(std::size_t bytes_per_buffer) {
  K2C_NVTX_RANGE("ceiling: cudaMemcpy D2D");
  DeviceBuffer<char> src(bytes_per_buffer), dst(bytes_per_buffer);
  K2C_CUDA_CHECK(cudaMemset(src.data(), 0x5A, src.bytes()));
  const Timing t = time_gpu([&] {
    K2C_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDeviceToDevice));
  });
  return 2.0 * static_cast<double>(bytes_per_buffer) / (t.median_ms * 1e-3);
}

__global__ void naive_sgemm_kernel(int M, int N, int K, float alpha, const float* A,
                                   const float* B, float beta, float* C) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  const int col = blockIdx.y * blockDim.y + threadIdx.y;
  if (row >= M || col >= N) return;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k)
    acc += A[static_cast<std::size_t>(row) * K + k] * B[static_cast<std::size_t>(k) * N + col];
  const std::size_t i = static_cast<std::size_t>(row) * N + col;
  C[i] = beta == 0.0f ? alpha * acc : alpha * acc + beta * C[i];
}

void naive_sgemm(int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                 float* C) {
  if (M == 0 || N == 0) return;
  const dim3 block(32, 32), grid((M + 31) / 32, (N + 31) / 32);
  naive_sgemm_kernel<<<grid, block>>>(M, N, K, alpha, A, B, beta, C);
  K2C_CUDA_CHECK_LAUNCH();
}

double naive_sgemm_rate(int n) {
  K2C_NVTX_RANGE("ceiling: naive SGEMM");
  const std::size_t nn = static_cast<std::size_t>(n) * n;
  DeviceBuffer<float> a(nn), b(nn), c(nn);
  fill_uniform_device(a.data(), nn, 6);
  fill_uniform_device(b.data(), nn, 7);
  const Timing t = time_gpu([&] { naive_sgemm(n, n, n, 1.0f, a.data(), b.data(), 0.0f, c.data()); },
                            {.warmup = 1, .repeats = 5});
  return 2.0 * n * static_cast<double>(n) * n / (t.median_ms * 1e-3);
}

}  // namespace k2c
