// reference.cpp — see k2c/reference.h.
#include "k2c/reference.h"

#include <cmath>

namespace k2c::ref {

std::vector<double> gemm(int M, int N, int K, double alpha, std::span<const float> A,
                         std::span<const float> B, double beta, std::span<const float> C) {
  std::vector<double> out(static_cast<std::size_t>(M) * N);
  std::vector<double> row(N);
  for (int r = 0; r < M; ++r) {
    std::fill(row.begin(), row.end(), 0.0);
    for (int k = 0; k < K; ++k) {  // r-k-c order walks B and the row contiguously
      const double a = A[static_cast<std::size_t>(r) * K + k];
      const float* b = &B[static_cast<std::size_t>(k) * N];
      for (int c = 0; c < N; ++c) row[c] += a * b[c];
    }
    for (int c = 0; c < N; ++c) {
      const std::size_t i = static_cast<std::size_t>(r) * N + c;
      out[i] = alpha * row[c] + (beta == 0 ? 0.0 : beta * C[i]);
    }
  }
  return out;
}

double gemm_at(int N, int K, double alpha, std::span<const float> A, std::span<const float> B,
               double beta, std::span<const float> C, int r, int c) {
  double acc = 0;
  for (int k = 0; k < K; ++k)
    acc += static_cast<double>(A[static_cast<std::size_t>(r) * K + k]) *
           B[static_cast<std::size_t>(k) * N + c];
  const std::size_t i = static_cast<std::size_t>(r) * N + c;
  return alpha * acc + (beta == 0 ? 0.0 : beta * C[i]);
}

std::vector<double> fma_chains(std::span<const float> in, int iters, int chains, float step,
                               float mul, float add) {
  std::vector<double> out(in.size());
  std::vector<float> x(chains);
  for (std::size_t i = 0; i < in.size(); ++i) {
    for (int j = 0; j < chains; ++j) x[j] = in[i] + static_cast<float>(j) * step;
    for (int t = 0; t < iters; ++t)
      for (int j = 0; j < chains; ++j) x[j] = std::fma(x[j], mul, add);
    float sum = 0;
    for (int j = 0; j < chains; ++j) sum += x[j];
    out[i] = sum;
  }
  return out;
}

}  // namespace k2c::ref
