// reference.cpp — see k2c/reference/reference.h.
#include "k2c/reference/reference.h"

#include <algorithm>
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

std::vector<double> gemm_abt(int M, int N, int K, std::span<const float> A,
                             std::span<const float> B, std::vector<double>* magnitude) {
  std::vector<double> out(static_cast<std::size_t>(M) * N);
  if (magnitude) magnitude->assign(out.size(), 0.0);
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) {
      double mag = 0;
      out[static_cast<std::size_t>(r) * N + c] = gemm_abt_at(K, A, B, r, c, &mag);
      if (magnitude) (*magnitude)[static_cast<std::size_t>(r) * N + c] = mag;
    }
  return out;
}

double gemm_abt_at(int K, std::span<const float> A, std::span<const float> B, int r, int c,
                   double* magnitude) {
  const float* a = A.data() + static_cast<std::size_t>(r) * K;
  const float* b = B.data() + static_cast<std::size_t>(c) * K;  // rows of B are contiguous in k
  double acc = 0, mag = 0;
  for (int k = 0; k < K; ++k) {
    const double p = static_cast<double>(a[k]) * b[k];
    acc += p;
    mag += std::abs(p);
  }
  if (magnitude) *magnitude = mag;
  return acc;
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

std::vector<double> softmax_rows(std::span<const float> x, int rows, int cols) {
  std::vector<double> out(static_cast<std::size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    const float* row = &x[static_cast<std::size_t>(r) * cols];
    double* o = &out[static_cast<std::size_t>(r) * cols];
    double max = -INFINITY, sum = 0;
    for (int c = 0; c < cols; ++c) max = std::max(max, static_cast<double>(row[c]));
    for (int c = 0; c < cols; ++c) sum += (o[c] = std::exp(row[c] - max));
    for (int c = 0; c < cols; ++c) o[c] /= sum;
  }
  return out;
}

RmsNormForward rmsnorm_forward(std::span<const float> x, std::span<const float> gamma, int rows,
                               int cols, double eps) {
  RmsNormForward f{std::vector<double>(static_cast<std::size_t>(rows) * cols), std::vector<double>(rows)};
  for (int r = 0; r < rows; ++r) {
    const float* row = &x[static_cast<std::size_t>(r) * cols];
    double ss = 0;
    for (int c = 0; c < cols; ++c) ss += static_cast<double>(row[c]) * row[c];
    f.rstd[r] = 1.0 / std::sqrt(ss / cols + eps);
    for (int c = 0; c < cols; ++c) f.y[static_cast<std::size_t>(r) * cols + c] = row[c] * f.rstd[r] * gamma[c];
  }
  return f;
}

RmsNormBackward rmsnorm_backward(std::span<const float> x, std::span<const float> gamma,
                                 std::span<const float> dy, int rows, int cols, double eps) {
  const RmsNormForward f = rmsnorm_forward(x, gamma, rows, cols, eps);
  RmsNormBackward b{std::vector<double>(static_cast<std::size_t>(rows) * cols), std::vector<double>(cols, 0.0)};
  for (int r = 0; r < rows; ++r) {
    const std::size_t o = static_cast<std::size_t>(r) * cols;
    const double rs = f.rstd[r];
    double dot = 0;  // Σ dy·gamma·x over the row
    for (int c = 0; c < cols; ++c) dot += static_cast<double>(dy[o + c]) * gamma[c] * x[o + c];
    for (int c = 0; c < cols; ++c) {
      b.dx[o + c] = rs * gamma[c] * dy[o + c] - x[o + c] * rs * rs * rs / cols * dot;
      b.dgamma[c] += static_cast<double>(dy[o + c]) * x[o + c] * rs;
    }
  }
  return b;
}

std::vector<double> rope(std::span<const float> x, int tokens, int heads, int head_dim,
                         long position_offset, double base, RopeLayout layout, bool inverse) {
  std::vector<double> out(x.size());
  const int half = head_dim / 2;
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h) {
      const std::size_t o = (static_cast<std::size_t>(t) * heads + h) * head_dim;
      for (int k = 0; k < half; ++k) {
        const double angle = static_cast<double>(position_offset + t) * std::pow(base, -2.0 * k / head_dim);
        const double c = std::cos(angle), s = (inverse ? -1.0 : 1.0) * std::sin(angle);
        const int i = layout == RopeLayout::interleaved ? 2 * k : k;
        const int j = layout == RopeLayout::interleaved ? 2 * k + 1 : k + half;
        const double a = x[o + i], b = x[o + j];
        out[o + i] = a * c - b * s;  // (a + ib) · e^{i·angle}
        out[o + j] = a * s + b * c;
      }
    }
  return out;
}

}  // namespace k2c::ref
