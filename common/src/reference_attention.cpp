// reference_attention.cpp — attention in double, the oracle of module 09 (see
// k2c/reference/reference.h).
//
// The plain definition, nothing tiled: S = scale · Q Kᵀ with the causal mask, P = softmax(S) row
// by row, O = P V. The backward pass recomputes P the same way and applies
//   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − rowsum(dO ∘ O)),  dQ = scale · dS K,  dK = scale · dSᵀ Q,
// with dK and dV summed over the query heads that share a kv head.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "k2c/reference/reference.h"

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
                       std::vector<double>(static_cast<std::size_t>(s.batch) * s.heads * s.q_len),
                       std::vector<double>(q.size(), 0.0)};
  std::vector<double> p(s.kv_len);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const Slice sl = slice(s, b, h);
      for (int i = 0; i < s.q_len; ++i) {
        out.lse[sl.row + i] = probabilities(s, q, k, sl, i, p);
        double* o = &out.o[sl.q + static_cast<std::size_t>(i) * d];
        double* mag = &out.o_magnitude[sl.q + static_cast<std::size_t>(i) * d];
        for (int j = 0; j < visible_keys(s, i); ++j)
          for (int c = 0; c < d; ++c) {
            const double vj = v[sl.kv + static_cast<std::size_t>(j) * d + c];
            o[c] += p[j] * vj;
            mag[c] += p[j] * std::abs(vj);
          }
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
                      std::vector<double>(v.size(), 0.0), std::vector<double>(q.size(), 0.0),
                      std::vector<double>(k.size(), 0.0), std::vector<double>(v.size(), 0.0)};
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
        double D = 0, e = 0;
        for (int c = 0; c < d; ++c) {
          D += dor[c] * o[c];
          e += std::abs(dor[c] * o[c]);
        }
        const std::size_t qi = sl.q + static_cast<std::size_t>(i) * d;
        for (int j = 0; j < n; ++j) {
          const std::size_t kj = sl.kv + static_cast<std::size_t>(j) * d;
          double dpj = 0;
          for (int c = 0; c < d; ++c) {
            g.dv[kj + c] += p[j] * dor[c];
            g.dv_magnitude[kj + c] += p[j] * std::abs(dor[c]);
            dpj += static_cast<double>(dor[c]) * v[kj + c];
          }
          const double ds = p[j] * (dpj - D), ds_mag = std::abs(ds) + p[j] * e;
          for (int c = 0; c < d; ++c) {
            g.dq[qi + c] += s.scale * ds * k[kj + c];
            g.dk[kj + c] += s.scale * ds * q[qi + c];
            g.dq_magnitude[qi + c] += s.scale * ds_mag * std::abs(k[kj + c]);
            g.dk_magnitude[kj + c] += s.scale * ds_mag * std::abs(q[qi + c]);
          }
        }
      }
    }
  return g;
}

namespace {

// What both spot checks need of query row i: D_i = Σ dO_i ∘ O_i from the given o, and
// e_i = Σ |dO_i ∘ O_i| (what a relative error in O moves D_i by).
struct RowTerms {
  double D, e;
};
RowTerms row_terms(std::span<const float> o, std::span<const float> dout, std::size_t qi, int d) {
  RowTerms r{0, 0};
  for (int c = 0; c < d; ++c) {
    r.D += static_cast<double>(dout[qi + c]) * o[qi + c];
    r.e += std::abs(static_cast<double>(dout[qi + c]) * o[qi + c]);
  }
  return r;
}

// And of one (query i, key j) pair: P_ij from the given lse, and dS_ij = P_ij·(dP_ij − D_i).
// Returns false when the key is hidden from the query.
struct PairTerms {
  double p, ds, ds_magnitude;
};
bool pair_terms(std::span<const float> q, std::span<const float> k, std::span<const float> v,
                std::span<const float> dout, std::span<const float> lse, const AttentionShape& s,
                const Slice& sl, int i, int j, const RowTerms& row, PairTerms& t) {
  if (j >= visible_keys(s, i)) return false;
  const int d = s.head_dim;
  const std::size_t qi = sl.q + static_cast<std::size_t>(i) * d, kj = sl.kv + static_cast<std::size_t>(j) * d;
  double dot = 0, dp = 0;
  for (int c = 0; c < d; ++c) {
    dot += static_cast<double>(q[qi + c]) * k[kj + c];
    dp += static_cast<double>(dout[qi + c]) * v[kj + c];
  }
  t.p = std::exp(s.scale * dot - lse[sl.row + i]);
  t.ds = t.p * (dp - row.D);
  t.ds_magnitude = std::abs(t.ds) + t.p * row.e;
  return true;
}

AttentionRowGradient zero_rows(int d) {
  const std::vector<double> z(d, 0.0);
  return {z, z, z, z, z, z};
}

}  // namespace

namespace {

// The two spot checks over a source of each query row's terms: row(r) for lse's row r.
template <class Row>
AttentionRowGradient key_gradient(std::span<const float> q, std::span<const float> k, std::span<const float> v,
                                  std::span<const float> dout, std::span<const float> lse, const AttentionShape& s,
                                  int batch, int kv_head, int key, Row row) {
  check(s, q.size(), k.size(), v.size());
  const int d = s.head_dim, group = s.heads / s.kv_heads;
  AttentionRowGradient g = zero_rows(d);
  for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    const Slice sl = slice(s, batch, h);
    for (int i = 0; i < s.q_len; ++i) {
      const std::size_t qi = sl.q + static_cast<std::size_t>(i) * d;
      PairTerms t;
      if (!pair_terms(q, k, v, dout, lse, s, sl, i, key, row(sl.row + i, qi), t)) continue;
      for (int c = 0; c < d; ++c) {
        g.dv[c] += t.p * dout[qi + c];
        g.dv_magnitude[c] += t.p * std::abs(dout[qi + c]);
        g.dk[c] += s.scale * t.ds * q[qi + c];
        g.dk_magnitude[c] += s.scale * t.ds_magnitude * std::abs(q[qi + c]);
      }
    }
  }
  return g;
}

template <class Row>
AttentionRowGradient query_gradient(std::span<const float> q, std::span<const float> k, std::span<const float> v,
                                    std::span<const float> dout, std::span<const float> lse, const AttentionShape& s,
                                    int batch, int head, int query, Row row) {
  check(s, q.size(), k.size(), v.size());
  const int d = s.head_dim;
  AttentionRowGradient g = zero_rows(d);
  const Slice sl = slice(s, batch, head);
  const RowTerms terms = row(sl.row + query, sl.q + static_cast<std::size_t>(query) * d);  // once, not per key
  for (int j = 0; j < s.kv_len; ++j) {
    PairTerms t;
    if (!pair_terms(q, k, v, dout, lse, s, sl, query, j, terms, t)) continue;
    const std::size_t kj = sl.kv + static_cast<std::size_t>(j) * d;
    for (int c = 0; c < d; ++c) {
      g.dq[c] += s.scale * t.ds * k[kj + c];
      g.dq_magnitude[c] += s.scale * t.ds_magnitude * std::abs(k[kj + c]);
    }
  }
  return g;
}

// Row terms from o, or as given (checked to cover lse's rows).
auto terms_of(std::span<const float> o, std::span<const float> dout, int d) {
  if (o.size() != dout.size()) throw std::invalid_argument("attention reference: o must be shaped like dout");
  return [o, dout, d](std::size_t, std::size_t qi) { return row_terms(o, dout, qi, d); };
}
auto terms_of(const AttentionRowTerms& rows, std::size_t lse_rows) {
  if (rows.D.size() != lse_rows || rows.e.size() != lse_rows)
    throw std::invalid_argument("attention reference: D and e need one number per row of lse");
  return [rows](std::size_t r, std::size_t) { return RowTerms{rows.D[r], rows.e[r]}; };
}

}  // namespace

AttentionRowGradient attention_key_gradient_at(std::span<const float> q, std::span<const float> k,
                                               std::span<const float> v, std::span<const float> o,
                                               std::span<const float> dout, std::span<const float> lse,
                                               const AttentionShape& s, int batch, int kv_head, int key) {
  return key_gradient(q, k, v, dout, lse, s, batch, kv_head, key, terms_of(o, dout, s.head_dim));
}

AttentionRowGradient attention_query_gradient_at(std::span<const float> q, std::span<const float> k,
                                                 std::span<const float> v, std::span<const float> o,
                                                 std::span<const float> dout, std::span<const float> lse,
                                                 const AttentionShape& s, int batch, int head, int query) {
  return query_gradient(q, k, v, dout, lse, s, batch, head, query, terms_of(o, dout, s.head_dim));
}

AttentionRowGradient attention_key_gradient_at(std::span<const float> q, std::span<const float> k,
                                               std::span<const float> v, const AttentionRowTerms& rows,
                                               std::span<const float> dout, std::span<const float> lse,
                                               const AttentionShape& s, int batch, int kv_head, int key) {
  return key_gradient(q, k, v, dout, lse, s, batch, kv_head, key, terms_of(rows, lse.size()));
}

AttentionRowGradient attention_query_gradient_at(std::span<const float> q, std::span<const float> k,
                                                 std::span<const float> v, const AttentionRowTerms& rows,
                                                 std::span<const float> dout, std::span<const float> lse,
                                                 const AttentionShape& s, int batch, int head, int query) {
  return query_gradient(q, k, v, dout, lse, s, batch, head, query, terms_of(rows, lse.size()));
}

std::vector<double> mla_forward(std::span<const float> x, int T, const MlaShape& c, const MlaWeights& w) {
  const int d = c.d_model, H = c.heads, dn = c.nope_dim, dr = c.rope_dim, dc = c.latent_dim, dv = c.value_dim;
  const int dqk = dn + dr;
  auto narrow = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  auto rotate = [&](const std::vector<double>& v, int heads) {
    return narrow(rope(narrow(v), T, heads, dr, 0, c.rope_theta, RopeLayout::half_split, false));
  };
  const std::vector<float> qn = narrow(gemm_abt(T, H * dn, d, x, w.wq_nope));
  const std::vector<float> qr = rotate(gemm_abt(T, H * dr, d, x, w.wq_rope), H);
  const std::vector<float> lat = narrow(gemm_abt(T, dc, d, x, w.w_dkv));
  const std::vector<float> kr = rotate(gemm_abt(T, dr, d, x, w.w_kr), 1);
  const std::vector<float> kn = narrow(gemm_abt(T, H * dn, dc, lat, w.w_uk));
  const std::vector<float> v = narrow(gemm_abt(T, H * dv, dc, lat, w.w_uv));
  // [head][token][dn + dr]; values padded with zeros to the same width (dv <= dn + dr).
  std::vector<float> Q(static_cast<std::size_t>(H) * T * dqk), K(Q.size()), V(Q.size(), 0.0f);
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) {
      const std::size_t at = (static_cast<std::size_t>(h) * T + t) * dqk;
      std::copy_n(qn.begin() + (std::size_t(t) * H + h) * dn, dn, Q.begin() + at);
      std::copy_n(qr.begin() + (std::size_t(t) * H + h) * dr, dr, Q.begin() + at + dn);
      std::copy_n(kn.begin() + (std::size_t(t) * H + h) * dn, dn, K.begin() + at);
      std::copy_n(kr.begin() + std::size_t(t) * dr, dr, K.begin() + at + dn);
      std::copy_n(v.begin() + (std::size_t(t) * H + h) * dv, dv, V.begin() + at);
    }
  const std::vector<double> o = attention_forward(Q, K, V, {1, H, H, T, T, dqk, true, 1.0 / std::sqrt(double(dqk))}).o;
  std::vector<float> heads(static_cast<std::size_t>(T) * H * dv);  // [token][head·dv]: each head's first dv numbers
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < dv; ++i)
        heads[(std::size_t(t) * H + h) * dv + i] = static_cast<float>(o[(static_cast<std::size_t>(h) * T + t) * dqk + i]);
  return gemm_abt(T, d, H * dv, heads, w.wo);
}

}  // namespace k2c::ref
