// assignments/00_roofline/roofline.cu — module 00: your implementation (contract: roofline.h).
//
// Replace every K2C_TODO with your code. Until you do, the grader reports the function as
// "not implemented yet". Read lectures/00_roofline.md and the handout README.md first.
#include <algorithm>

#include <cuda_runtime.h>

#include "k2c/core/check.h"
#include "k2c/core/todo.h"
#include "roofline.h"

namespace k2c::roofline {

// ---- bandwidth ------------------------------------------------------------------------------

void copy(const float* src, float* dst, std::size_t n, cudaStream_t stream) {
  if (!check_copy_args(src, dst, n)) return;  // given (roofline.h)
  (void)stream;
  K2C_TODO("copy: write a grid-stride copy kernel with 16-byte (float4) accesses and a tail");
}

// ---- arithmetic -----------------------------------------------------------------------------

void fma_throughput(float* out, std::size_t n, int iters, cudaStream_t stream) {
  if (!check_fma_args(out, n, iters)) return;  // given (roofline.h)
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
