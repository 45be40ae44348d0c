// lab/tensor_core.cu — tile-shape sweep of module 05's Part A kernel beside
// cuBLAS and Part B, at 4096³ and 8192³ (bf16 in and out, C = A·Bᵀ). The reference solution is
// included directly so its TU-internal kernel can be launched with tiles it does not pick
// itself. Lecture 05 quotes what this measured. Build and run on an H100/H200:
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icommon/include -Iassignments/05_tensor_core_matmul \
//     lab/tensor_core.cu common/src/device.cu -lcublas -lcuda -o /tmp/tc && /tmp/tc
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "k2c/core/random.h"
#include "median_time.cuh"
#include "../solutions/05_tensor_core_matmul/hopper_matmul.cu"
#include "../solutions/05_tensor_core_matmul/tensor_core_matmul.cu"

using bf16 = __nv_bfloat16;
namespace tcm = k2c::tensor_core_matmul;

template <class T>
static void part_a(int n, const bf16* A, const bf16* B, bf16* C) {
  tcm::launch_tile<T, true>(n, n, n, A, B, C, true, nullptr);
}

int main(int argc, char** argv) {
  // `hopper`: cuBLAS and the Part B variants only, each timed twice (in two rounds).
  const bool hopper_only = argc > 1 && std::string(argv[1]) == "hopper";
  cublasHandle_t h;
  cublasCreate(&h);
  for (int n : {4096, 8192}) {
    const size_t nn = size_t(n) * n;
    bf16 *A, *B, *C;
    cudaMalloc(&A, nn * 2);
    cudaMalloc(&B, nn * 2);
    cudaMalloc(&C, nn * 2);
    k2c::fill_uniform_device(A, nn, 1);
    k2c::fill_uniform_device(B, nn, 2);
    const double flop = 2.0 * n * double(n) * n;
    const int reps = n >= 8192 ? 20 : 40;
    std::vector<bf16> want(nn), got(nn);
    // Largest difference from cuBLAS's result relative to its largest element: a wrong kernel
    // shows up as O(1), a right one as bf16 rounding (~4e-3).
    auto difference = [&] {
      cudaMemcpy(got.data(), C, nn * 2, cudaMemcpyDeviceToHost);
      double diff = 0, top = 0;
      for (size_t i = 0; i < nn; i += 7) {
        diff = std::max(diff, std::abs(double(__bfloat162float(got[i])) - __bfloat162float(want[i])));
        top = std::max(top, std::abs(double(__bfloat162float(want[i]))));
      }
      return diff / top;
    };
    auto report = [&](const char* name, const std::function<void()>& f, double base) {
      cudaMemset(C, 0xFF, nn * 2);
      const double ms = median_ms(f, reps);
      const cudaError_t e = cudaDeviceSynchronize();
      const double tf = flop / ms * 1e-9;
      if (base == 0) cudaMemcpy(want.data(), C, nn * 2, cudaMemcpyDeviceToHost);
      std::printf("n=%d %-28s %8.1f TFLOP/s  %5.3f of cuBLAS  diff %.1e %s\n", n, name, tf,
                  base > 0 ? tf / base : 1.0, base > 0 ? difference() : 0.0,
                  e == cudaSuccess ? "" : cudaGetErrorString(e));
      return tf;
    };
    const float one = 1, zero = 0;
    const double cublas = report("cublas", [&] {
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, B, CUDA_R_16BF, n, A, CUDA_R_16BF,
                   n, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }, 0);
    using namespace k2c::tensor_core_matmul;
    if (hopper_only && tcm::hopper_supported()) {
      for (int round = 0; round < 2; ++round) {
        report("wgmma, 1 block per tile", [&] { tcm::launch_hopper<1, 0>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, clusters of 2", [&] { tcm::launch_hopper<2, 0>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, 1 block, staged 4 boxes", [&] { tcm::launch_hopper<1, 4>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, clusters, staged 4 boxes", [&] { tcm::launch_hopper<2, 4>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, 1 block, staged 2 boxes", [&] { tcm::launch_hopper<1, 2>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, clusters, staged 2 boxes", [&] { tcm::launch_hopper<2, 2>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, 1 block, staged 1 box", [&] { tcm::launch_hopper<1, 1>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, 1 block, 2 boxes, 1 deferred", [&] { tcm::launch_hopper<1, 2, 1>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, clusters, 2 boxes, 1 deferred", [&] { tcm::launch_hopper<2, 2, 1>(n, n, n, A, B, C, nullptr); }, cublas);
        report("wgmma, clusters, 2 boxes, 2 deferred", [&] { tcm::launch_hopper<2, 2, 2>(n, n, n, A, B, C, nullptr); }, cublas);
        report("cublas again", [&] {
          cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, B, CUDA_R_16BF, n, A, CUDA_R_16BF,
                       n, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        }, cublas);
      }
      cudaFree(A);
      cudaFree(B);
      cudaFree(C);
      continue;
    }
    report("mma 128x256 w2x4 s3", [&] { part_a<Tile<128, 256, 2, 4, 3>>(n, A, B, C); }, cublas);
    report("mma 128x256 w2x4 s4", [&] { part_a<Tile<128, 256, 2, 4, 4>>(n, A, B, C); }, cublas);
    report("mma 256x128 w4x2 s3", [&] { part_a<Tile<256, 128, 4, 2, 3>>(n, A, B, C); }, cublas);
    report("mma 256x128 w4x2 s4 (ref)", [&] { part_a<Tile<256, 128, 4, 2, 4>>(n, A, B, C); }, cublas);
    report("mma 128x128 w2x2 s3", [&] { part_a<Tile<128, 128, 2, 2, 3>>(n, A, B, C); }, cublas);
    report("mma 128x128 w2x2 s4", [&] { part_a<Tile<128, 128, 2, 2, 4>>(n, A, B, C); }, cublas);
    report("mma 128x128 w2x4 s4", [&] { part_a<Tile<128, 128, 2, 4, 4>>(n, A, B, C); }, cublas);
    report("mma 256x128 w4x4 s3", [&] { part_a<Tile<256, 128, 4, 4, 3>>(n, A, B, C); }, cublas);
    report("mma 256x128 w4x4 s4", [&] { part_a<Tile<256, 128, 4, 4, 4>>(n, A, B, C); }, cublas);
    report("mma 128x256 w4x4 s4", [&] { part_a<Tile<128, 256, 4, 4, 4>>(n, A, B, C); }, cublas);
    report("mma 256x256 w4x4 s3", [&] { part_a<Tile<256, 256, 4, 4, 3>>(n, A, B, C); }, cublas);
    if (tcm::hopper_supported()) {
      report("wgmma, clusters of 2", [&] { tcm::launch_hopper<2, 0>(n, n, n, A, B, C, nullptr); }, cublas);
      report("wgmma, staged, 1 deferred (ref)", [&] {
        tcm::launch_hopper<tcm::kCluster, tcm::kStagedBoxes, tcm::kDeferred>(n, n, n, A, B, C, nullptr);
      }, cublas);
    }
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
  }
  return 0;
}
