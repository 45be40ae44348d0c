// reference_attention.cpp — attention in double, the oracle of module 09 (see k2c/reference.h).
//
// The plain definition, nothing tiled: S = scale · Q Kᵀ with the causal mask, P = softmax(S) row
// by row, O = P V. The backward pass recomputes P the same way and applies
//   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − rowsum(dO ∘ O)),  dQ = scale · dS K,  dK = scale · dSᵀ Q,
// with dK and dV summed over the query heads that share a kv head.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "k2c/reference.h"

namespace k2c::ref {
namespace {

void check(const AttentionShape& s, std::size_t q, std::size_t k, std::size_t v) {
  if (s.batch < 0 || s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads != 0 || s.q_len < 0 ||
      s.kv_len < 0 || s.head_dim < 1)
    throw std::invalid_argument("attention reference: bad shape");
  const std::size_t nq = static_cast<std::size_t>(s.batch) * s.heads * s.q_len * s.head_dim;
  const std::size_t nk = static_cast<std::size_t>(s.batch) * s.kv_heads * s.kv_len * s.head_dim;
  if (q != nq || k != nk || v != nk) throw std::invalid_argument("attention reference: sizes do not match the shape");
}

// The last key query i may see (exclusive bound), with the bottom-right causal alignment.
int visible_keys(const AttentionShape& s, int i) {
  if (!s.causal) return s.kv_len;
  const long last = static_cast<long>(i) + s.kv_len - s.q_len;  // inclusive
  return static_cast<int>(std::clamp<long>(last + 1, 0, s.kv_len));
}

// Offsets of one (batch, query head) slice and of the kv slice it reads.
struct Slice {
  std::size_t q, kv, row;  // q/o element offset, k/v element offset, lse row offset
};
Slice slice(const AttentionShape& s, int b, int h) {
  const int kvh = h / (s.heads / s.kv_heads);
  return {(static_cast<std::size_t>(b) * s.heads + h) * s.q_len * s.head_dim,
          (static_cast<std::size_t>(b) * s.kv_heads + kvh) * s.kv_len * s.head_dim,
          (static_cast<std::size_t>(b) * s.heads + h) * s.q_len};
}

// Row i of P for one slice (length kv_len, zeros past the visible keys) and its logsumexp.
double probabilities(const AttentionShape& s, std::span<const float> q, std::span<const float> k,
                     const Slice& sl, int i, std::vector<double>& p) {
  const int d = s.head_dim, n = visible_keys(s, i);
  std::fill(p.begin(), p.end(), 0.0);
  if (n == 0) return std::numeric_limits<double>::infinity();
  double m = -std::numeric_limits<double>::infinity();
  for (int j = 0; j < n; ++j) {
    double dot = 0;
    for (int c = 0; c < d; ++c)
      dot += static_cast<double>(q[sl.q + static_cast<std::size_t>(i) * d + c]) * k[sl.kv + static_cast<std::size_t>(j) * d + c];
    p[j] = s.scale * dot;
    m = std::max(m, p[j]);
  }
  double sum = 0;
  for (int j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - m));
  for (int j = 0; j < n; ++j) p[j] /= sum;
  return m + std::log(sum);
}

}  // namespace

AttentionForward attention_forward(std::span<const float> q, std::span<const float> k,
                                   std::span<const float> v, const AttentionShape& s) {
  check(s, q.size(), k.size(), v.size());
  const int d = s.head_dim;
  AttentionForward out{std::vector<double>(q.size(), 0.0),
                       std::vector<double>(static_cast<std::size_t>(s.batch) * s.heads * s.q_len)};
  std::vector<double> p(s.kv_len);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const Slice sl = slice(s, b, h);
      for (int i = 0; i < s.q_len; ++i) {
        out.lse[sl.row + i] = probabilities(s, q, k, sl, i, p);
        double* o = &out.o[sl.q + static_cast<std::size_t>(i) * d];
        for (int j = 0; j < visible_keys(s, i); ++j)
          for (int c = 0; c < d; ++c) o[c] += p[j] * v[sl.kv + static_cast<std::size_t>(j) * d + c];
      }
    }
  return out;
}

AttentionBackward attention_backward(std::span<const float> q, std::span<const float> k,
                                     std::span<const float> v, std::span<const float> dout,
                                     const AttentionShape& s) {
  check(s, q.size(), k.size(), v.size());
  if (dout.size() != q.size()) throw std::invalid_argument("attention reference: dout must be shaped like q");
  const int d = s.head_dim;
  AttentionBackward g{std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0),
                      std::vector<double>(v.size(), 0.0)};
  std::vector<double> p(s.kv_len), o(d);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const Slice sl = slice(s, b, h);
      for (int i = 0; i < s.q_len; ++i) {
        probabilities(s, q, k, sl, i, p);
        const int n = visible_keys(s, i);
        const float* dor = &dout[sl.q + static_cast<std::size_t>(i) * d];
        // O row (recomputed) and D = rowsum(dO ∘ O).
        std::fill(o.begin(), o.end(), 0.0);
        for (int j = 0; j < n; ++j)
          for (int c = 0; c < d; ++c) o[c] += p[j] * v[sl.kv + static_cast<std::size_t>(j) * d + c];
        double D = 0;
        for (int c = 0; c < d; ++c) D += dor[c] * o[c];
        for (int j = 0; j < n; ++j) {
          const std::size_t kj = sl.kv + static_cast<std::size_t>(j) * d;
          double dpj = 0;
          for (int c = 0; c < d; ++c) {
            g.dv[kj + c] += p[j] * dor[c];
            dpj += static_cast<double>(dor[c]) * v[kj + c];
          }
          const double ds = p[j] * (dpj - D);
          for (int c = 0; c < d; ++c) {
            g.dq[sl.q + static_cast<std::size_t>(i) * d + c] += s.scale * ds * k[kj + c];
            g.dk[kj + c] += s.scale * ds * q[sl.q + static_cast<std::size_t>(i) * d + c];
          }
        }
      }
    }
  return g;
}

}  // namespace k2c::ref
