// assignments/00_roofline/roofline.cu — module 00: your implementation (contract: roofline.h).
//
// Replace every K2C_TODO with your code. Until you do, the grader reports the function as
// "not implemented yet". Read lectures/00_roofline.md and the handout README.md first.
#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/todo.h"
#include "roofline.h"

namespace k2c::roofline {

// ---- bandwidth ------------------------------------------------------------------------------

void copy(const float* src, float* dst, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  K2C_CHECK(src != nullptr && dst != nullptr, "copy: null pointer for n=" << n);
  K2C_CHECK(reinterpret_cast<std::uintptr_t>(src) % 16 == 0 &&
                reinterpret_cast<std::uintptr_t>(dst) % 16 == 0,
            "copy: src and dst must be 16-byte aligned, got " << src << " and " << dst);
  (void)stream;
  K2C_TODO("copy: write a grid-stride copy kernel with 16-byte (float4) accesses and a tail");
}

// ---- arithmetic -----------------------------------------------------------------------------

void fma_throughput(float* out, std::size_t n, int iters, cudaStream_t stream) {
  K2C_CHECK(iters >= 0, "fma_throughput: iters must be >= 0, got " << iters);
  if (n == 0) return;
  K2C_CHECK(out != nullptr, "fma_throughput: null pointer for n=" << n);
  (void)stream;
  K2C_TODO("fma_throughput: write the kFmaChains-chain FMA kernel described in roofline.h");
}

// ---- the roofline ---------------------------------------------------------------------------

double ridge_point(double peak_flops, double bandwidth) {
  (void)peak_flops;
  (void)bandwidth;
  K2C_TODO("ridge_point: the intensity where the memory roof meets the compute roof");
}

double attainable_flops(double intensity, double peak_flops, double bandwidth) {
  (void)intensity;
  (void)peak_flops;
  (void)bandwidth;
  K2C_TODO("attainable_flops: the roofline model's bound for this intensity");
}

double matmul_intensity(long M, long N, long K, int bytes_per_element) {
  (void)M;
  (void)N;
  (void)K;
  (void)bytes_per_element;
  K2C_TODO("matmul_intensity: 2*M*N*K FLOPs over the fewest bytes C = alpha*A*B + beta*C moves");
}

}  // namespace k2c::roofline
