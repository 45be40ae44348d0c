// cpu_ops.cpp — the CPU backend of k2c/model/ops.h: fp32, single-threaded, every sum in a fixed
// order (ascending index), so the same inputs give the same bits on every run and every rank.
//
// Written for clarity over speed: the CPU backend trains tiny models in tests; the sizes that
// need speed run on the GPU backend.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/core/bf16.h"
#include "k2c/model/mask.h"
#include "k2c/model/moe.h"
#include "k2c/model/ops.h"
#include "op_checks.h"

namespace k2c::model {

void AttentionShape::check() const {
  auto bad = [&](const std::string& why) {
    throw std::invalid_argument("attention: " + why + " (batch " + std::to_string(batch) +
                                ", q_len " + std::to_string(q_len) + ", kv_len " +
                                std::to_string(kv_len) + ", q_heads " + std::to_string(q_heads) +
                                ", kv_heads " + std::to_string(kv_heads) + ", head_dim " +
                                std::to_string(head_dim) + ")");
  };
  if (batch < 1 || q_len < 0 || kv_len < 0 || head_dim < 1) bad("sizes must be positive");
  if (q_heads < 1 || kv_heads < 1 || q_heads % kv_heads != 0)
    bad("q_heads must be a positive multiple of kv_heads");
}

// The shared-input Linear operations, for every backend that has nothing better: plain matmul calls.
void Ops::shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) {
  if (ws.size() != ys.size()) throw std::invalid_argument("shared_linear_forward: one output per weight");
  for (std::size_t i = 0; i < ws.size(); ++i) matmul(x, false, *ws[i], true, *ys[i], 1.0f, 0.0f);
}

void Ops::shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                                 std::span<Tensor* const> dws, Tensor* dx) {
  if (ws.size() != dys.size() || ws.size() != dws.size())
    throw std::invalid_argument("shared_linear_backward: one output gradient and one weight gradient per weight");
  for (std::size_t i = 0; i < ws.size(); ++i)
    if (dws[i]) matmul(*dys[i], true, x, false, *dws[i], 1.0f, 1.0f);
  if (dx)
    for (std::size_t i = 0; i < ws.size(); ++i) matmul(*dys[i], false, *ws[i], false, *dx, 1.0f, i == 0 ? 0.0f : 1.0f);
}

namespace {
// Group g's matrix of a stacked [E, n, k] tensor, and the range of offsets a grouped call covers.
Tensor group_matrix(const Tensor& w, int e) {
  if (w.rank() != 3 || e < 0 || e >= w.dim(0))
    throw std::invalid_argument("grouped GEMM: group " + std::to_string(e) + " of a stacked weight " + w.shape().str());
  return Tensor::view(w.f32() + e * w.dim(1) * w.dim(2), {w.dim(1), w.dim(2)});
}
void check_offsets(std::span<const std::int64_t> offsets, std::int64_t rows, const char* who) {
  bool ok = !offsets.empty() && offsets.front() == 0 && offsets.back() == rows;
  for (std::size_t g = 0; ok && g + 1 < offsets.size(); ++g) ok = offsets[g] <= offsets[g + 1];
  if (!ok)
    throw std::invalid_argument(std::string(who) + ": offsets must rise from 0 to the " + std::to_string(rows) +
                                " rows given");
}
}  // namespace

void Ops::grouped_matmul(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                         bool transpose_w, Tensor& c) {
  check_offsets(offsets, a.dim(0), "grouped_matmul");
  for (std::size_t g = 0; g + 1 < offsets.size(); ++g) {
    const std::int64_t r0 = offsets[g], count = offsets[g + 1] - r0;
    if (count == 0) continue;
    Tensor c_g = c.rows(r0, count);
    matmul(a.rows(r0, count), false, group_matrix(w, first + static_cast<int>(g)), transpose_w, c_g, 1.0f, 0.0f);
  }
}

void Ops::grouped_weight_grad(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                              Tensor& dw) {
  check_offsets(offsets, dy.dim(0), "grouped_weight_grad");
  for (std::size_t g = 0; g + 1 < offsets.size(); ++g) {
    const std::int64_t r0 = offsets[g], count = offsets[g + 1] - r0;
    if (count == 0) continue;
    Tensor dw_g = group_matrix(dw, first + static_cast<int>(g));
    matmul(dy.rows(r0, count), true, x.rows(r0, count), false, dw_g, 1.0f, 1.0f);
  }
}

std::vector<double> Ops::column_sums(const Tensor& x) {
  const checks::Matrix m = checks::as_matrix(x);
  std::vector<float> host(static_cast<std::size_t>(x.numel()));
  download(host.data(), x);
  std::vector<double> sums(static_cast<std::size_t>(m.cols), 0.0);
  for (std::int64_t r = 0; r < m.rows; ++r)
    for (std::int64_t c = 0; c < m.cols; ++c) sums[c] += host[r * m.cols + c];
  return sums;
}

void Ops::routing_grad(const Tensor& indices, const Tensor& values, std::span<const float> column_add, Tensor& out) {
  const checks::Matrix m = checks::routing_grad_args(indices, values, column_add, out);
  std::vector<std::int32_t> idx(static_cast<std::size_t>(indices.numel()));
  std::vector<float> val(idx.size()), host(static_cast<std::size_t>(out.numel()), 0.0f);
  download(idx.data(), indices);
  download(val.data(), values);
  const std::int64_t k = indices.dim(1);
  for (std::int64_t n = 0; n < m.rows; ++n) {
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = idx[n * k + j];
      if (e < 0 || e >= m.cols) throw std::out_of_range("routing_grad: expert " + std::to_string(e));
      host[n * m.cols + e] += val[n * k + j];
    }
    for (std::int64_t e = 0; e < m.cols; ++e) host[n * m.cols + e] += column_add[e];
  }
  upload(out, host.data());
}

std::vector<std::int64_t> Ops::route_rows(const Tensor& indices, const Tensor& values, int experts, bool normalize,
                                          Tensor& token_of_row, Tensor& row_of, Tensor& weight_of_row) {
  const std::int64_t A = checks::route_rows_args(indices, values, experts, token_of_row, row_of, weight_of_row);
  const std::int64_t N = indices.dim(0), k = indices.dim(1);
  std::vector<std::int32_t> idx(static_cast<std::size_t>(A));
  std::vector<float> val(idx.size()), w_row(idx.size());
  download(idx.data(), indices);
  download(val.data(), values);
  const Routing r = Routing::plan(idx, static_cast<int>(N), static_cast<int>(k), experts);
  for (std::int64_t n = 0; n < N; ++n) {
    float sum = 0;
    for (std::int64_t j = 0; j < k; ++j) sum += val[n * k + j];
    for (std::int64_t j = 0; j < k; ++j)
      w_row[r.row_of[n * k + j]] = normalize ? val[n * k + j] / sum : val[n * k + j];
  }
  upload(token_of_row, r.token_of_row.data());
  upload(row_of, r.row_of.data());
  upload(weight_of_row, w_row.data());
  return r.counts;
}

void Ops::route_rows_backward(const Tensor& values, const Tensor& row_of, const Tensor& dweight, bool normalize,
                              Tensor& dvalues) {
  checks::route_rows_backward_args(values, row_of, dweight, dvalues);
  const std::int64_t N = values.dim(0), k = values.dim(1);
  std::vector<float> val(static_cast<std::size_t>(values.numel())), dw(val.size()), dval(val.size());
  std::vector<std::int32_t> row(val.size());
  download(val.data(), values);
  download(row.data(), row_of);
  download(dw.data(), dweight);
  for (std::int32_t r : row)
    if (r < 0 || r >= values.numel()) throw std::out_of_range("route_rows_backward: row " + std::to_string(r));
  for (std::int64_t n = 0; n < N; ++n) {
    float sum = 0, wdw = 0;
    for (std::int64_t j = 0; j < k; ++j) sum += val[n * k + j];
    for (std::int64_t j = 0; j < k; ++j) wdw += val[n * k + j] / sum * dw[row[n * k + j]];
    for (std::int64_t j = 0; j < k; ++j) {
      const float d = dw[row[n * k + j]];
      dval[n * k + j] = normalize ? (d - wdw) / sum : d;
    }
  }
  upload(dvalues, dval.data());
}

void Ops::rmsnorm_backward_add(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                               const Tensor& residual_dy, Tensor& dx, Tensor& dgamma) {
  rmsnorm_backward(x, gamma, rstd, dy, dx, dgamma);
  accumulate(dx, residual_dy, 1.0f);
}

namespace {

using checks::as_matrix;
using checks::Matrix;
using checks::same_shape;

// bf16 activations on the CPU: an operation runs on fp32 stand-ins of its tensors and rounds what
// it wrote back into each bf16 output once, at the end (to nearest, ties to even, as the GPU's
// kernels round where they store). A stand-in is the tensor itself where it is fp32, else a
// widened copy (widening is exact), so an fp32 call runs exactly as before.
class Wide {
 public:
  explicit Wide(const Tensor& t, bool written = false) : t_(t), written_(written) {
    if (t.dtype() != DType::bf16) return;
    const std::int64_t n = t.numel();
    copy_.resize(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)));  // a view needs an address
    const auto* h = static_cast<const std::uint16_t*>(t.raw());
    for (std::int64_t i = 0; i < n; ++i) copy_[i] = bf16_to_float(h[i]);
    view_ = Tensor::view(copy_.data(), t.shape());
  }
  ~Wide() {
    if (!written_ || view_.empty()) return;
    auto* h = static_cast<std::uint16_t*>(t_.raw());
    for (std::int64_t i = 0; i < t_.numel(); ++i) h[i] = float_to_bf16(copy_[i]);
  }
  Wide(const Wide&) = delete;
  Wide& operator=(const Wide&) = delete;
  operator Tensor&() { return view_.empty() ? const_cast<Tensor&>(t_) : view_; }

 private:
  const Tensor& t_;
  bool written_;
  std::vector<float> copy_;
  Tensor view_;
};

bool any_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t && t->dtype() == DType::bf16) return true;
  return false;
}

class CpuOps final : public Ops {
 public:
  std::string name() const override { return "cpu"; }
  Memory& memory() override { return host_; }

  void upload(Tensor& dst, const void* host) override { std::memcpy(dst.raw(), host, dst.bytes()); }
  void download(void* host, const Tensor& src) override { std::memcpy(host, src.raw(), src.bytes()); }

  // ---- element-wise

  void fill(Tensor& t, float value) override {
    if (any_bf16({&t})) {
      Wide w(t, true);
      return fill(w, value);
    }
    float* p = t.f32();
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = value;
  }

  void copy(Tensor& dst, const Tensor& src) override {
    checks::copy_args(dst, src);
    if (dst.dtype() == src.dtype()) return (void)std::memcpy(dst.raw(), src.raw(), src.bytes());
    Wide ws(src), wd(dst, true);  // a conversion: widened exactly, rounded once where stored
    copy(wd, ws);
  }

  void add(const Tensor& a, const Tensor& b, Tensor& out) override {
    same_shape(a, b, "add");
    same_shape(a, out, "add");
    if (any_bf16({&a, &b, &out})) {
      Wide wa(a), wb(b), wo(out, true);
      return add(wa, wb, wo);
    }
    const float *x = a.f32(), *y = b.f32();
    float* o = out.f32();
    for (std::int64_t i = 0; i < a.numel(); ++i) o[i] = x[i] + y[i];
  }

  void accumulate(Tensor& acc, const Tensor& x, float s) override {
    same_shape(acc, x, "accumulate");
    float* a = acc.f32();
    const float* p = x.f32();
    for (std::int64_t i = 0; i < x.numel(); ++i) a[i] += s * p[i];
  }

  void scale(Tensor& t, float s) override {
    float* p = t.f32();
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] *= s;
  }

  double sum_squares(const Tensor& t) override {
    const float* p = t.f32();
    double s = 0;
    for (std::int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
    return s;
  }

  // ---- GEMM

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha,
              float beta) override {
    if (any_bf16({&a, &b, &c})) {
      Wide wa(a), wb(b), wc(c, true);
      return matmul(wa, ta, wb, tb, wc, alpha, beta);
    }
    const auto [M, N, K] = checks::gemm_dims(a, ta, b, tb, c);
    const float *A = a.f32(), *B = b.f32();
    float* C = c.f32();
    std::vector<float> acc(static_cast<std::size_t>(N));
    for (std::int64_t i = 0; i < M; ++i) {
      // Every element sums over k in ascending order, whichever loop form reaches it fastest.
      if (tb) {
        for (std::int64_t j = 0; j < N; ++j) {
          float s = 0;
          for (std::int64_t k = 0; k < K; ++k)
            s += (ta ? A[k * M + i] : A[i * K + k]) * B[j * K + k];
          acc[j] = s;
        }
      } else {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::int64_t k = 0; k < K; ++k) {
          const float aik = ta ? A[k * M + i] : A[i * K + k];
          const float* brow = B + k * N;
          for (std::int64_t j = 0; j < N; ++j) acc[j] += aik * brow[j];
        }
      }
      float* crow = C + i * N;
      for (std::int64_t j = 0; j < N; ++j)
        crow[j] = beta == 0.0f ? alpha * acc[j] : alpha * acc[j] + beta * crow[j];
    }
  }

  // ---- embedding

  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) override {
    const Matrix t = as_matrix(table);
    out.expect({ids.numel(), t.cols}, "embedding output");
    const std::int32_t* id = ids.i32();
    for (std::int64_t i = 0; i < ids.numel(); ++i) {
      if (id[i] < 0 || id[i] >= t.rows)
        throw std::out_of_range("embedding: id " + std::to_string(id[i]) + " outside [0, " +
                                std::to_string(t.rows) + ")");
      std::memcpy(out.f32() + i * t.cols, table.f32() + id[i] * t.cols, t.cols * sizeof(float));
    }
  }

  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) override {
    const Matrix t = as_matrix(dtable);
    dout.expect({ids.numel(), t.cols}, "embedding output gradient");
    const std::int32_t* id = ids.i32();
    for (std::int64_t i = 0; i < ids.numel(); ++i) {
      if (id[i] < 0 || id[i] >= t.rows) throw std::out_of_range("embedding: id out of range");
      float* row = dtable.f32() + id[i] * t.cols;
      const float* g = dout.f32() + i * t.cols;
      for (std::int64_t j = 0; j < t.cols; ++j) row[j] += g[j];
    }
  }

  // ---- RMSNorm

  void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, Tensor& y,
                       Tensor& rstd) override {
    if (any_bf16({&x, &y})) {
      Wide wx(x), wy(y, true);
      return rmsnorm_forward(wx, gamma, eps, wy, rstd);
    }
    const Matrix m = checks::rmsnorm_args(x, gamma, y, rstd);
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const float* xr = x.f32() + r * m.cols;
      float ss = 0;
      for (std::int64_t j = 0; j < m.cols; ++j) ss += xr[j] * xr[j];
      const float rs = 1.0f / std::sqrt(ss / static_cast<float>(m.cols) + eps);
      rstd.f32()[r] = rs;
      float* yr = y.f32() + r * m.cols;
      for (std::int64_t j = 0; j < m.cols; ++j) yr[j] = xr[j] * rs * gamma.f32()[j];
    }
  }

  void rmsnorm_backward(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                        Tensor& dx, Tensor& dgamma) override {
    if (any_bf16({&x, &dy, &dx})) {
      Wide wx(x), wdy(dy), wdx(dx, true);
      return rmsnorm_backward(wx, gamma, rstd, wdy, wdx, dgamma);
    }
    const Matrix m = checks::rmsnorm_backward_args(x, gamma, rstd, dy, dx, dgamma);
    const float* g = gamma.f32();
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const float *xr = x.f32() + r * m.cols, *dyr = dy.f32() + r * m.cols;
      const float rs = rstd.f32()[r];
      // y = x·rs·g with rs = (mean x² + eps)^(-1/2): dx_j = rs·(g_j dy_j − x_j·rs²·c), where
      // c = mean over k of g_k dy_k x_k.
      float c = 0;
      for (std::int64_t k = 0; k < m.cols; ++k) c += g[k] * dyr[k] * xr[k];
      c /= static_cast<float>(m.cols);
      float* dxr = dx.f32() + r * m.cols;
      for (std::int64_t j = 0; j < m.cols; ++j) {
        dxr[j] = rs * (g[j] * dyr[j] - xr[j] * rs * rs * c);
        dgamma.f32()[j] += dyr[j] * xr[j] * rs;
      }
    }
  }

  void rmsnorm_backward_add(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                            const Tensor& residual_dy, Tensor& dx, Tensor& dgamma) override {
    if (any_bf16({&x, &dy, &residual_dy, &dx})) {  // the sum rounded once, as the GPU's one pass does
      Wide wx(x), wdy(dy), wr(residual_dy), wdx(dx, true);
      return Ops::rmsnorm_backward_add(wx, gamma, rstd, wdy, wr, wdx, dgamma);
    }
    Ops::rmsnorm_backward_add(x, gamma, rstd, dy, residual_dy, dx, dgamma);
  }

  // ---- RoPE

  void rope(Tensor& x, const Tensor& positions, int heads, int head_dim, float theta,
            bool inverse) override {
    if (any_bf16({&x})) {
      Wide wx(x, true);
      return rope(wx, positions, heads, head_dim, theta, inverse);
    }
    const Matrix m = as_matrix(x);
    const std::int64_t T = positions.numel();
    if (head_dim % 2 || m.cols != static_cast<std::int64_t>(heads) * head_dim || T == 0 || m.rows % T)
      throw std::invalid_argument("rope: x " + x.shape().str() + " is not [batch*" +
                                  std::to_string(T) + ", " + std::to_string(heads) + "*" +
                                  std::to_string(head_dim) + "] with an even head_dim");
    const int half = head_dim / 2;
    std::vector<double> inv_freq(half);
    for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(static_cast<double>(theta), -2.0 * i / head_dim);
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const double pos = positions.i32()[r % T];
      for (int i = 0; i < half; ++i) {
        const double angle = pos * inv_freq[i];
        const float c = static_cast<float>(std::cos(angle));
        const float s = static_cast<float>(inverse ? -std::sin(angle) : std::sin(angle));
        for (int h = 0; h < heads; ++h) {
          float* p = x.f32() + r * m.cols + static_cast<std::int64_t>(h) * head_dim;
          const float x0 = p[i], x1 = p[i + half];
          p[i] = x0 * c - x1 * s;
          p[i + half] = x0 * s + x1 * c;
        }
      }
    }
  }

  // ---- attention

  void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                         Tensor& o, Tensor& lse) override {
    if (any_bf16({&q, &k, &v, &o})) {
      Wide wq(q), wk(k), wv(v), wo(o, true);
      return attention_forward(s, wq, wk, wv, wo, lse);
    }
    checks::attention_args(s, q, k, v);
    o.expect(q.shape(), "attention output");
    lse.expect({s.batch, s.q_heads, s.q_len}, "attention lse");
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    std::vector<float> p(static_cast<std::size_t>(s.kv_len));
    for (int b = 0; b < s.batch; ++b)
      for (int h = 0; h < s.q_heads; ++h)
        for (int i = 0; i < s.q_len; ++i) {
          const float* qi = row(q, s, b, i, h, s.q_heads, s.q_len);
          const int kh = h / (s.q_heads / s.kv_heads);
          float mx = -std::numeric_limits<float>::infinity();
          for (int j = 0; j < s.kv_len; ++j) {
            if (!visible(s, i, j)) continue;
            p[j] = scale * dot(qi, row(k, s, b, j, kh, s.kv_heads, s.kv_len), s.head_dim);
            mx = std::max(mx, p[j]);
          }
          float* oi = const_cast<float*>(row(o, s, b, i, h, s.q_heads, s.q_len));
          std::fill(oi, oi + s.head_dim, 0.0f);
          float& l = lse.f32()[(static_cast<std::int64_t>(b) * s.q_heads + h) * s.q_len + i];
          if (mx == -std::numeric_limits<float>::infinity()) {  // sees no key
            l = mx;
            continue;
          }
          float sum = 0;
          for (int j = 0; j < s.kv_len; ++j)
            if (visible(s, i, j)) sum += std::exp(p[j] - mx);
          l = mx + std::log(sum);
          for (int j = 0; j < s.kv_len; ++j) {
            if (!visible(s, i, j)) continue;
            const float w = std::exp(p[j] - l);
            const float* vj = row(v, s, b, j, kh, s.kv_heads, s.kv_len);
            for (int d = 0; d < s.head_dim; ++d) oi[d] += w * vj[d];
          }
        }
  }

  void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& o, const Tensor& lse, const Tensor& dout,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    if (any_bf16({&q, &k, &v, &o, &dout, &dq, &dk, &dv})) {
      Wide wq(q), wk(k), wv(v), wo(o), wdo(dout), wdq(dq, true), wdk(dk, true), wdv(dv, true);
      return attention_backward(s, wq, wk, wv, wo, lse, wdo, wdq, wdk, wdv);
    }
    checks::attention_backward_args(s, q, k, v, o, lse, dout, dq, dk, dv);
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    for (int b = 0; b < s.batch; ++b)
      for (int h = 0; h < s.q_heads; ++h)
        for (int i = 0; i < s.q_len; ++i) {
          const int kh = h / (s.q_heads / s.kv_heads);
          const float* qi = row(q, s, b, i, h, s.q_heads, s.q_len);
          const float* doi = row(dout, s, b, i, h, s.q_heads, s.q_len);
          float* dqi = const_cast<float*>(row(dq, s, b, i, h, s.q_heads, s.q_len));
          std::fill(dqi, dqi + s.head_dim, 0.0f);
          const float l = lse.f32()[(static_cast<std::int64_t>(b) * s.q_heads + h) * s.q_len + i];
          if (l == -std::numeric_limits<float>::infinity()) continue;
          // D_i = dO_i · O_i equals Σ_j P_ij dP_ij: the softmax backward's row term.
          const float Di = dot(doi, row(o, s, b, i, h, s.q_heads, s.q_len), s.head_dim);
          for (int j = 0; j < s.kv_len; ++j) {
            if (!visible(s, i, j)) continue;
            const float* kj = row(k, s, b, j, kh, s.kv_heads, s.kv_len);
            const float* vj = row(v, s, b, j, kh, s.kv_heads, s.kv_len);
            const float pij = std::exp(scale * dot(qi, kj, s.head_dim) - l);
            const float dsij = pij * (dot(doi, vj, s.head_dim) - Di);
            float* dkj = const_cast<float*>(row(dk, s, b, j, kh, s.kv_heads, s.kv_len));
            float* dvj = const_cast<float*>(row(dv, s, b, j, kh, s.kv_heads, s.kv_len));
            for (int d = 0; d < s.head_dim; ++d) {
              dvj[d] += pij * doi[d];
              dqi[d] += scale * dsij * kj[d];
              dkj[d] += scale * dsij * qi[d];
            }
          }
        }
  }

  // ---- SwiGLU

  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& h) override {
    if (any_bf16({&gate, &up, &h})) {
      Wide wg(gate), wu(up), wh(h, true);
      return swiglu_forward(wg, wu, wh);
    }
    same_shape(gate, up, "swiglu");
    same_shape(gate, h, "swiglu");
    const float *g = gate.f32(), *u = up.f32();
    for (std::int64_t i = 0; i < gate.numel(); ++i) h.f32()[i] = silu(g[i]) * u[i];
  }

  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, Tensor& dgate,
                       Tensor& dup) override {
    if (any_bf16({&gate, &up, &dh, &dgate, &dup})) {
      Wide wg(gate), wu(up), wdh(dh), wdg(dgate, true), wdu(dup, true);
      return swiglu_backward(wg, wu, wdh, wdg, wdu);
    }
    same_shape(gate, up, "swiglu backward");
    same_shape(gate, dh, "swiglu backward");
    same_shape(gate, dgate, "swiglu backward");
    same_shape(gate, dup, "swiglu backward");
    for (std::int64_t i = 0; i < gate.numel(); ++i) {
      const float g = gate.f32()[i], u = up.f32()[i], d = dh.f32()[i];
      const float sg = 1.0f / (1.0f + std::exp(-g));
      dgate.f32()[i] = d * u * sg * (1.0f + g * (1.0f - sg));  // silu'(g) = σ(g)(1 + g(1 − σ(g)))
      dup.f32()[i] = d * g * sg;
    }
  }

  // ---- loss

  double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale,
                       Tensor& dlogits) override {
    if (any_bf16({&logits, &dlogits})) {
      Wide wz(logits), wdz(dlogits, true);
      return cross_entropy(wz, targets, grad_scale, wdz);
    }
    const Matrix m = as_matrix(logits);
    targets.expect({m.rows}, "cross-entropy targets", DType::i32);
    same_shape(logits, dlogits, "cross-entropy gradient");
    double total = 0;
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const float* z = logits.f32() + r * m.cols;
      float* dz = dlogits.f32() + r * m.cols;
      const std::int32_t t = targets.i32()[r];
      if (t < 0) {
        std::fill(dz, dz + m.cols, 0.0f);
        continue;
      }
      if (t >= m.cols)
        throw std::out_of_range("cross-entropy: target " + std::to_string(t) + " outside [0, " +
                                std::to_string(m.cols) + ")");
      float mx = z[0];
      for (std::int64_t j = 1; j < m.cols; ++j) mx = std::max(mx, z[j]);
      float sum = 0;
      for (std::int64_t j = 0; j < m.cols; ++j) sum += std::exp(z[j] - mx);
      const float lse = mx + std::log(sum);
      total += static_cast<double>(lse) - z[t];
      for (std::int64_t j = 0; j < m.cols; ++j)
        dz[j] = grad_scale * (std::exp(z[j] - lse) - (j == t ? 1.0f : 0.0f));
    }
    return total;
  }

  // ---- dropout

  void dropout(const Tensor& x, float p, const DropoutKey& key, Tensor& out) override {
    same_shape(x, out, "dropout");
    if (!(p >= 0.0f && p < 1.0f)) throw std::invalid_argument("dropout: p must be in [0, 1)");
    const Matrix m = as_matrix(x);
    for (std::int64_t r = 0; r < m.rows; ++r)
      for (std::int64_t c = 0; c < m.cols; ++c)
        out.f32()[r * m.cols + c] = x.f32()[r * m.cols + c] * dropout_scale(key, p, r, c, m.cols);
  }

  // ---- routing

  void softmax_rows(const Tensor& x, Tensor& y) override {
    same_shape(x, y, "softmax");
    const Matrix m = as_matrix(x);
    if (m.cols == 0 && m.rows > 0) throw std::invalid_argument("softmax: rows of length 0");
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const float* xr = x.f32() + r * m.cols;
      float* yr = y.f32() + r * m.cols;
      float mx = xr[0], sum = 0;
      for (std::int64_t j = 1; j < m.cols; ++j) mx = std::max(mx, xr[j]);
      for (std::int64_t j = 0; j < m.cols; ++j) sum += yr[j] = std::exp(xr[j] - mx);
      for (std::int64_t j = 0; j < m.cols; ++j) yr[j] /= sum;
    }
  }

  void softmax_rows_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    same_shape(y, dy, "softmax backward");
    same_shape(y, dx, "softmax backward");
    const Matrix m = as_matrix(y);
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const float *yr = y.f32() + r * m.cols, *dyr = dy.f32() + r * m.cols;
      float dot = 0;  // dx = y ⊙ (dy − Σ y dy)
      for (std::int64_t j = 0; j < m.cols; ++j) dot += yr[j] * dyr[j];
      for (std::int64_t j = 0; j < m.cols; ++j) dx.f32()[r * m.cols + j] = yr[j] * (dyr[j] - dot);
    }
  }

  void top_k(const Tensor& scores, int k, Tensor& indices, Tensor& values) override {
    const Matrix m = checks::top_k_args(scores, k, indices, values);
    std::vector<int> order(static_cast<std::size_t>(m.cols));
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const float* s = scores.f32() + r * m.cols;
      for (int j = 0; j < m.cols; ++j) order[j] = j;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return s[a] > s[b]; });
      for (int j = 0; j < k; ++j) {
        indices.i32()[r * k + j] = order[j];
        values.f32()[r * k + j] = s[order[j]];
      }
    }
  }

  void gather_rows(const Tensor& src, const Tensor& rows, Tensor& out) override {
    if (any_bf16({&src, &out})) {
      Wide ws(src), wo(out, true);
      return gather_rows(ws, rows, wo);
    }
    const Matrix m = as_matrix(src);
    out.expect({rows.numel(), m.cols}, "gather_rows output");
    for (std::int64_t r = 0; r < rows.numel(); ++r) {
      const std::int32_t i = rows.i32()[r];
      if (i < 0 || i >= m.rows) throw std::out_of_range("gather_rows: row " + std::to_string(i));
      std::memcpy(out.f32() + r * m.cols, src.f32() + i * m.cols, m.cols * sizeof(float));
    }
  }

  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& out) override {
    if (any_bf16({&src, &out})) {
      Wide ws(src), wo(out, true);
      return scatter_add_rows(ws, rows, scale, wo);
    }
    const Matrix m = as_matrix(out);
    src.expect({rows.numel(), m.cols}, "scatter_add_rows source");
    if (scale) scale->expect({rows.numel()}, "scatter_add_rows scale");
    for (std::int64_t r = 0; r < rows.numel(); ++r) {
      const std::int32_t i = rows.i32()[r];
      if (i < 0 || i >= m.rows) throw std::out_of_range("scatter_add_rows: row " + std::to_string(i));
      const float s = scale ? scale->f32()[r] : 1.0f;
      for (std::int64_t j = 0; j < m.cols; ++j) out.f32()[i * m.cols + j] += s * src.f32()[r * m.cols + j];
    }
  }

  void gather_add_rows(const Tensor& src, const Tensor& rows, int k, const Tensor* scale, Tensor& out) override {
    if (any_bf16({&src, &out})) {
      Wide ws(src), wo(out, true);
      return gather_add_rows(ws, rows, k, scale, wo);
    }
    const Matrix m = checks::gather_add_rows_args(src, rows, k, scale, out);
    const std::int64_t R = as_matrix(src).rows;
    for (std::int64_t a = 0; a < rows.numel(); ++a)  // every row checked before anything is added
      if (rows.i32()[a] < 0 || rows.i32()[a] >= R)
        throw std::out_of_range("gather_add_rows: row " + std::to_string(rows.i32()[a]));
    std::vector<std::int64_t> order(static_cast<std::size_t>(k));
    for (std::int64_t n = 0; n < m.rows; ++n) {
      const std::int32_t* r = rows.i32() + n * k;
      for (int j = 0; j < k; ++j) order[j] = j;
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return r[a] < r[b]; });
      float* to = out.f32() + n * m.cols;
      for (std::int64_t j : order) {
        const float s = scale ? scale->f32()[r[j]] : 1.0f;
        const float* from = src.f32() + r[j] * m.cols;
        for (std::int64_t c = 0; c < m.cols; ++c) to[c] += s * from[c];
      }
    }
  }

  void gather_add_rows_backward(const Tensor& dout, const Tensor& token_of_row, const Tensor& scale, const Tensor& src,
                                Tensor& dsrc, Tensor& dscale) override {
    if (any_bf16({&dout, &src, &dsrc})) {
      Wide wd(dout), ws(src), wds(dsrc, true);
      return gather_add_rows_backward(wd, token_of_row, scale, ws, wds, dscale);
    }
    const Matrix m = checks::gather_add_rows_backward_args(dout, token_of_row, scale, src, dsrc, dscale);
    const std::int64_t N = as_matrix(dout).rows;
    for (std::int64_t r = 0; r < m.rows; ++r)
      if (token_of_row.i32()[r] < 0 || token_of_row.i32()[r] >= N)
        throw std::out_of_range("gather_add_rows_backward: token " + std::to_string(token_of_row.i32()[r]));
    for (std::int64_t r = 0; r < m.rows; ++r) {
      const float* dy = dout.f32() + token_of_row.i32()[r] * m.cols;
      dscale.f32()[r] = dot(dy, src.f32() + r * m.cols, static_cast<int>(m.cols));
      for (std::int64_t c = 0; c < m.cols; ++c) dsrc.f32()[r * m.cols + c] = scale.f32()[r] * dy[c];
    }
  }

  void row_dot(const Tensor& a, const Tensor& b, Tensor& out) override {
    same_shape(a, b, "row_dot");
    const Matrix m = as_matrix(a);
    out.expect({m.rows}, "row_dot output");
    for (std::int64_t r = 0; r < m.rows; ++r)
      out.f32()[r] = dot(a.f32() + r * m.cols, b.f32() + r * m.cols, static_cast<int>(m.cols));
  }

  void scale_rows(Tensor& x, const Tensor& scale) override {
    const Matrix m = as_matrix(x);
    scale.expect({m.rows}, "scale_rows scale");
    for (std::int64_t r = 0; r < m.rows; ++r)
      for (std::int64_t j = 0; j < m.cols; ++j) x.f32()[r * m.cols + j] *= scale.f32()[r];
  }

  // ---- optimizers

  void sgd_step(Tensor& param, const Tensor& grad, Tensor* momentum, float lr, float beta,
                float weight_decay) override {
    same_shape(param, grad, "sgd");
    if (momentum) same_shape(param, *momentum, "sgd momentum");
    float *p = param.f32(), *mo = momentum ? momentum->f32() : nullptr;
    for (std::int64_t i = 0; i < param.numel(); ++i) {
      float g = grad.f32()[i] + weight_decay * p[i];
      if (mo) g = mo[i] = beta * mo[i] + g;
      p[i] -= lr * g;
    }
  }

  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int t) override {
    same_shape(param, grad, "adamw");
    same_shape(param, m, "adamw");
    same_shape(param, v, "adamw");
    if (t < 1) throw std::invalid_argument("adamw: step numbers start at 1");
    const float c1 = 1.0f - static_cast<float>(std::pow(beta1, t));
    const float c2 = 1.0f - static_cast<float>(std::pow(beta2, t));
    float *p = param.f32(), *mm = m.f32(), *vv = v.f32();
    for (std::int64_t i = 0; i < param.numel(); ++i) {
      const float g = grad.f32()[i];
      mm[i] = beta1 * mm[i] + (1.0f - beta1) * g;
      vv[i] = beta2 * vv[i] + (1.0f - beta2) * g * g;
      // Decoupled weight decay (Loshchilov & Hutter): the decay does not pass through the moments.
      p[i] -= lr * (weight_decay * p[i] + (mm[i] / c1) / (std::sqrt(vv[i] / c2) + eps));
    }
  }

 private:
  static float silu(float g) { return g / (1.0f + std::exp(-g)); }

  static float dot(const float* a, const float* b, int n) {
    float s = 0;
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }

  static bool visible(const AttentionShape& s, int i, int j) {
    return !s.causal || s.kv_offset + j <= s.q_offset + i;
  }

  // Head `h` of token t of sequence b in a [batch·len, heads·head_dim] tensor.
  static const float* row(const Tensor& t, const AttentionShape& s, int b, int tok, int h, int heads,
                          int len) {
    return t.f32() + ((static_cast<std::int64_t>(b) * len + tok) * heads + h) * s.head_dim;
  }

  HostMemory host_;
};

}  // namespace

float dropout_scale(const DropoutKey& key, float p, std::int64_t row, std::int64_t col,
                    std::int64_t cols) {
  const std::int64_t full = key.full_cols < 0 ? cols : key.full_cols;
  const std::uint64_t index = static_cast<std::uint64_t>((key.row_offset + row) * full + key.col_offset + col);
  return mask::scale(key.seed, key.step, key.layer, index, p);
}

Ops& cpu_ops() {
  static CpuOps ops;
  return ops;
}

}  // namespace k2c::model
