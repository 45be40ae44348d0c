// k2c/reference.h — CPU reference implementations, the correctness oracle of every module.
//
// Plain loops in double precision, written for clarity rather than speed: what the GPU version
// must compute, with rounding error far below any kernel's tolerance.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace k2c::ref {

// C = alpha * A * B + beta * C, row-major, A M×K, B K×N, C M×N. With beta == 0, C is not read.
std::vector<double> gemm(int M, int N, int K, double alpha, std::span<const float> A,
                         std::span<const float> B, double beta, std::span<const float> C);

// One element (r, c) of the same GEMM: for spot checks of sizes too large for the full loop.
double gemm_at(int N, int K, double alpha, std::span<const float> A, std::span<const float> B,
               double beta, std::span<const float> C, int r, int c);

// Module 00's FMA-chain function (see assignments/00_roofline/roofline.h). It is defined in
// fp32 arithmetic with fused multiply-adds, so the reference computes it in fp32 with std::fma:
// the GPU result should agree to the last bits of the final sum.
std::vector<double> fma_chains(std::span<const float> in, int iters, int chains, float step,
                               float mul, float add);

// ---- memory-bound operators of modules 06–08 (inputs as float, bf16 values widened exactly) ----

// Row softmax of a rows × cols row-major matrix, computed stably (the row maximum subtracted).
std::vector<double> softmax_rows(std::span<const float> x, int rows, int cols);

// RMSNorm, y = x / rms(x) · gamma with rms(x) = sqrt(mean(x²) + eps), per row of length cols.
struct RmsNormForward {
  std::vector<double> y;     // rows × cols
  std::vector<double> rstd;  // rows: 1 / rms(x), what the backward pass reuses
};
RmsNormForward rmsnorm_forward(std::span<const float> x, std::span<const float> gamma, int rows,
                               int cols, double eps);

// Gradients of RMSNorm for upstream dy: with r = rstd of the row and n = cols,
//   dx_i = r·gamma_i·dy_i − x_i · r³/n · Σ_j dy_j·gamma_j·x_j,   dgamma_i = Σ_rows dy_i·x_i·r.
struct RmsNormBackward {
  std::vector<double> dx;      // rows × cols
  std::vector<double> dgamma;  // cols
};
RmsNormBackward rmsnorm_backward(std::span<const float> x, std::span<const float> gamma,
                                 std::span<const float> dy, int rows, int cols, double eps);

// Rotary position embedding of x laid out [tokens][heads][head_dim] (head_dim even): the pair
// (a, b) of dimension-pair k at position p = position_offset + token is rotated by the angle
// p · base^(−2k/head_dim). Pairs are (2k, 2k+1) when interleaved (the complex form), or
// (k, k + head_dim/2) when half-split. inverse = true rotates by the opposite angle, which is
// also the backward pass (a rotation's transpose is its inverse).
enum class RopeLayout { interleaved, half_split };
std::vector<double> rope(std::span<const float> x, int tokens, int heads, int head_dim,
                         long position_offset, double base, RopeLayout layout, bool inverse);


// ---- attention (module 09) ----------------------------------------------------------------------

// Scaled dot-product attention, q [batch][heads][q_len][head_dim], k and v
// [batch][kv_heads][kv_len][head_dim], row-major. Query head h reads kv head h / (heads /
// kv_heads) (grouped-query attention; kv_heads divides heads). With `causal`, key j is visible
// to query i when j <= i + kv_len - q_len: the mask is aligned to the bottom right, so the last
// query sees every key (the FlashAttention 2 convention; the two alignments agree when the
// lengths are equal). A query that sees no key (q_len > kv_len, causal) has output 0 and
// logsumexp +inf.
struct AttentionShape {
  int batch = 1, heads = 1, kv_heads = 1, q_len = 1, kv_len = 1, head_dim = 1;
  bool causal = false;
  double scale = 1.0;  // usually 1 / sqrt(head_dim)
};
struct AttentionForward {
  std::vector<double> o;    // [batch][heads][q_len][head_dim]
  std::vector<double> lse;  // [batch][heads][q_len]: log of the softmax denominator, natural log,
                            // of the scaled scores (what the backward pass recomputes P from)
};
AttentionForward attention_forward(std::span<const float> q, std::span<const float> k,
                                   std::span<const float> v, const AttentionShape& shape);

// Gradients of the same for upstream gradient dout (shaped like o). dk and dv are summed over the
// query heads that share a kv head.
struct AttentionBackward {
  std::vector<double> dq, dk, dv;
};
AttentionBackward attention_backward(std::span<const float> q, std::span<const float> k,
                                     std::span<const float> v, std::span<const float> dout,
                                     const AttentionShape& shape);

}  // namespace k2c::ref
