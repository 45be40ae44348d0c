// tools/experiments/moe_grouped.cu — tile shapes of module 10's grouped GEMM at the module's
// shape (16384 tokens × top-6 over 64 experts, uniform loads), against cuBLAS once per expert.
// It compiles the reference solution into itself to reach the kernel's tile parameter:
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icommon/include -Iassignments/10_moe \
//        tools/experiments/moe_grouped.cu -lcublas -o /tmp/moe_grouped && /tmp/moe_grouped
#include <cublas_v2.h>

#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "../../solutions/10_moe/moe.cu"
#include "median_time.cuh"

namespace k2c::moe {

// Values in [-1, 1) from a hash of the index: random enough that the tensor cores see real data.
__global__ void fill_kernel(bf16* p, std::size_t n, unsigned seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed * 40503u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(static_cast<float>(h & 0xffff) / 32768.0f - 1.0f);
  }
}
void fill_uniform_device(bf16* p, std::size_t n, unsigned seed) { fill_kernel<<<1024, 256>>>(p, n, seed); }

constexpr int kExperts = 64;

template <class T>
double rate(const GemmArgs<bf16>& args, double flops) {
  return flops / (median_ms([&] { launch_gemm<Mode::rows, true, true, true, T>(args, nullptr); }, 20) * 1e-3) / 1e12;
}

void experiment() {
  std::mt19937_64 rng(1);
  std::vector<int> counts(kExperts, 0);
  for (int t = 0; t < 16384; ++t) {
    std::vector<int> all(kExperts);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < 6; ++j) ++counts[all[j]];
  }
  std::vector<int> off(kExperts + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
  cublasHandle_t blas;
  cublasCreate(&blas);
  for (bool up : {true, false}) {
    const int rows = off.back(), n = up ? 2816 : 2048, k = up ? 2048 : 1408;
    bf16 *a, *b, *c;
    int* d_off;
    cudaMalloc(&a, sizeof(bf16) * rows * k);
    cudaMalloc(&b, sizeof(bf16) * kExperts * n * k);
    cudaMalloc(&c, sizeof(bf16) * rows * n);
    cudaMalloc(&d_off, sizeof(int) * off.size());
    cudaMemcpy(d_off, off.data(), sizeof(int) * off.size(), cudaMemcpyHostToDevice);
    fill_uniform_device(a, static_cast<std::size_t>(rows) * k, 1);
    fill_uniform_device(b, static_cast<std::size_t>(kExperts) * n * k, 2);
    const double flops = 2.0 * rows * n * static_cast<double>(k);
    const GemmArgs<bf16> args{kExperts, d_off, 0, n, k, a, b, c, false, true};
    const float one = 1, zero = 0;
    const double loop = flops / (median_ms([&] {
      for (int e = 0; e < kExperts; ++e)
        cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, counts[e], k, &one, b + static_cast<std::size_t>(e) * n * k,
                     CUDA_R_16BF, k, a + static_cast<std::size_t>(off[e]) * k, CUDA_R_16BF, k, &zero,
                     c + static_cast<std::size_t>(off[e]) * n, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }, 20) * 1e-3) / 1e12;
    std::printf("%s projection (n %d, k %d): cuBLAS loop %.1f TFLOP/s\n", up ? "up" : "down", n, k, loop);
    std::printf("  128x256 2x4 warps 4 stages 1/SM (kept)   %.1f\n", rate<Tile<128, 256, 2, 4, 4, 1>>(args, flops));
    std::printf("  256x128 4x2 warps 4 stages 1/SM          %.1f\n", rate<Tile<256, 128, 4, 2, 4, 1>>(args, flops));
    std::printf("  128x128 2x2 warps 3 stages 2/SM          %.1f\n", rate<Tile<128, 128, 2, 2, 3, 2>>(args, flops));
    std::printf("  128x128 4x2 warps 3 stages 2/SM          %.1f\n", rate<Tile<128, 128, 4, 2, 3, 2>>(args, flops));
    std::printf("  128x128 2x2 warps 5 stages 1/SM          %.1f\n", rate<Tile<128, 128, 2, 2, 5, 1>>(args, flops));
    std::printf("  256x128 4x2 warps 3 stages 1/SM          %.1f\n", rate<Tile<256, 128, 4, 2, 3, 1>>(args, flops));
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(d_off);
  }
  cudaError_t err = cudaDeviceSynchronize();
  std::printf("status: %s\n", cudaGetErrorString(err));
}

}  // namespace k2c::moe

int main() {
  k2c::moe::experiment();
  return 0;
}
