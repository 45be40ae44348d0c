// lab/capstone_gemms.cu — the products of one dense-135M training step (batch 16 × 1024 tokens,
// d 768, ff 2048, vocabulary 32768) timed one by one: cuBLAS in the layout the trusted backend
// calls it with, module 05's Hopper GEMM (C = A·Bᵀ, both operands K-major: for the backward the
// operands as the adapter's transposes leave them, the transposes not timed), and module 10's
// Hopper grouped GEMMs with one group (the backward's MN-major forms; its forward form too; course
// mode runs the weight gradient on this form, in groups of tokens, and the input gradient on 05).
// TFLOP/s per product and over the step, each product weighted by its calls.
// The reference solutions are compiled in:
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icommon/include -Iassignments/05_tensor_core_matmul \
//        -Iassignments/10_moe lab/capstone_gemms.cu common/src/device.cu -lcublas -lcuda \
//        -o /tmp/capstone_gemms && /tmp/capstone_gemms
#include <algorithm>
#include <cstdio>
#include <vector>

#include <cublas_v2.h>

#include "../solutions/05_tensor_core_matmul/hopper_matmul.cu"
#include "../solutions/10_moe/moe.cu"
#include "k2c/core/random.h"
#include "median_time.cuh"

using bf16 = __nv_bfloat16;
namespace tcm = k2c::tensor_core_matmul;
namespace moe = k2c::moe;

namespace {

constexpr int T = 16 * 1024, D = 768, FF = 2048, V = 32768;

// One Linear layer's weight [n_out][k_in] and how many of its shape a step has.
struct Linear {
  const char* name;
  int n_out, k_in, calls;
};
const Linear kLinears[] = {{"q, k, v, o", D, D, 48}, {"gate, up", FF, D, 24}, {"down", D, FF, 12}, {"head", V, D, 1}};

// Uniform bf16 in [-1, 1), on the device.
bf16* random_bf16(std::size_t n, unsigned seed) {
  bf16* d = nullptr;
  cudaMalloc(&d, n * sizeof(bf16));
  k2c::fill_uniform_device(d, n, seed);
  return d;
}

int* device_offsets(int rows, int groups) {
  std::vector<int> h(groups + 1);
  for (int g = 0; g <= groups; ++g) h[g] = static_cast<int>(static_cast<long long>(rows) * g / groups);
  int* d = nullptr;
  cudaMalloc(&d, h.size() * sizeof(int));
  cudaMemcpy(d, h.data(), h.size() * sizeof(int), cudaMemcpyHostToDevice);
  return d;
}

// The adapter's choice of groups for a weight gradient (CourseGemm::grouped_backward).
int split_groups(int n_out, int k_in, int sms) {
  const int tiles = ((n_out + 127) / 128) * ((k_in + 255) / 256);
  return std::clamp(std::min(sms / tiles, T / 512), 1, 64);
}

}  // namespace

int main() {
  cublasHandle_t h;
  cublasCreate(&h);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const float one = 1.0f, zero = 0.0f;
  constexpr int kReps = 30;
  // Buffers big enough for every product (the head's are the largest).
  bf16* a = random_bf16(std::size_t{T} * V, 1);
  bf16* b = random_bf16(std::max(std::size_t{V} * D, std::size_t{FF} * T), 2);  // W, Wᵀ, or 05's xᵀ
  bf16* c = random_bf16(std::size_t{T} * V, 3);
  float* c32 = nullptr;
  cudaMalloc(&c32, std::size_t{V} * D * sizeof(float));  // the largest fp32 weight gradient, or 7 of 768 × 768
  int* one_group = device_offsets(T, 1);

  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  double step_flops = 0, cublas_ms = 0, both_10_ms = 0, course_ms = 0, tc05_ms = 0;
  std::printf("%-11s %-8s %6s %6s %6s  %9s %9s %9s %9s\n", "linear", "product", "M", "N", "K", "cuBLAS", "05",
              "10", "10 split");
  for (const Linear& l : kLinears) {
    const double flops = 2.0 * T * l.n_out * l.k_in;
    // Forward y = x·Wᵀ: cuBLAS Cᵀ = W·xᵀ (op T on W), 05 as it is, 10's forward form.
    const double f_cublas = median_ms([&] {
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, l.n_out, T, l.k_in, &one, b, CUDA_R_16BF, l.k_in, a, CUDA_R_16BF,
                   l.k_in, &zero, c, CUDA_R_16BF, l.n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }, kReps);
    const double f_05 = median_ms([&] { tcm::matmul_hopper(T, l.n_out, l.k_in, a, b, c, nullptr); }, kReps);
    const double f_10 =
        median_ms([&] { moe::grouped_gemm_hopper(1, one_group, T, l.n_out, l.k_in, a, b, c, true, nullptr); }, kReps);
    std::printf("%-11s %-8s %6d %6d %6d  %9.1f %9.1f %9.1f %9s\n", l.name, "forward", T, l.n_out, l.k_in,
                tflops(flops, f_cublas), tflops(flops, f_05), tflops(flops, f_10), "");
    // Weight gradient dW = dyᵀ·x, fp32: cuBLAS (x op N, dy op T), 05 on transposed copies, 10 with one
    // group and with the adapter's split.
    const int groups = split_groups(l.n_out, l.k_in, sms);
    int* split = device_offsets(T, groups);
    const double w_cublas = median_ms([&] {
      cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, l.k_in, l.n_out, T, &one, a, CUDA_R_16BF, l.k_in, c, CUDA_R_16BF,
                   l.n_out, &one, c32, CUDA_R_32F, l.k_in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }, kReps);
    const double w_05 = median_ms([&] { tcm::matmul_hopper(l.n_out, l.k_in, T, a, b, c, nullptr); }, kReps);
    const double w_10 = median_ms(
        [&] { moe::grouped_weight_grad_hopper(1, one_group, T, l.n_out, l.k_in, c, a, c32, nullptr); }, kReps);
    const double w_10s = median_ms(
        [&] { moe::grouped_weight_grad_hopper(groups, split, T, l.n_out, l.k_in, c, a, c32, nullptr); }, kReps);
    std::printf("%-11s %-8s %6d %6d %6d  %9.1f %9.1f %9.1f %6.1f/%-2d\n", l.name, "dW", l.n_out, l.k_in, T,
                tflops(flops, w_cublas), tflops(flops, w_05), tflops(flops, w_10), tflops(flops, w_10s), groups);
    // Input gradient dx = dy·W: cuBLAS (both op N), 05 on Wᵀ, 10's dX form (W read as it is).
    const double x_cublas = median_ms([&] {
      cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, l.k_in, T, l.n_out, &one, b, CUDA_R_16BF, l.k_in, a, CUDA_R_16BF,
                   l.n_out, &zero, c, CUDA_R_16BF, l.k_in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }, kReps);
    const double x_05 = median_ms([&] { tcm::matmul_hopper(T, l.k_in, l.n_out, a, b, c, nullptr); }, kReps);
    const double x_10 = median_ms(
        [&] { moe::grouped_gemm_hopper(1, one_group, T, l.k_in, l.n_out, a, b, c, false, nullptr); }, kReps);
    std::printf("%-11s %-8s %6d %6d %6d  %9.1f %9.1f %9.1f %9s\n", l.name, "dx", T, l.k_in, l.n_out,
                tflops(flops, x_cublas), tflops(flops, x_05), tflops(flops, x_10), "");
    cudaFree(split);
    step_flops += 3 * flops * l.calls;
    cublas_ms += (f_cublas + w_cublas + x_cublas) * l.calls;
    tc05_ms += (f_05 + w_05 + x_05) * l.calls;
    both_10_ms += (f_05 + w_10s + x_10) * l.calls;
    course_ms += (f_05 + w_10s + x_05) * l.calls;
  }
  std::printf("\nstep's products, %.2f TFLOP: cuBLAS %.2f ms (%.1f TFLOP/s), 05 alone %.2f ms (%.1f), "
              "05 forward and 10 backward %.2f ms (%.1f), course mode's choice (10's weight gradients, 05 "
              "otherwise) %.2f ms (%.1f)\n",
              step_flops / 1e12, cublas_ms, tflops(step_flops, cublas_ms), tc05_ms, tflops(step_flops, tc05_ms),
              both_10_ms, tflops(step_flops, both_10_ms), course_ms, tflops(step_flops, course_ms));
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("%s\n", err == cudaSuccess ? "ok" : cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
