// op_checks.h — the argument checks every backend of ops.h makes, in one place (private to
// common/model/src): each backend checks the same shapes with the same messages, and only the
// computation differs.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <span>
#include <string>

#include "k2c/model/ops.h"

namespace k2c::model::checks {

inline void same_shape(const Tensor& a, const Tensor& b, const char* what) {
  if (!(a.shape() == b.shape()))
    throw std::invalid_argument(std::string(what) + ": shapes differ, " + a.shape().str() + " and " + b.shape().str());
}

// copy's: as many elements, of one dtype, or fp32 and bf16 either way (a conversion).
inline void copy_args(const Tensor& dst, const Tensor& src) {
  auto is_float = [](DType t) { return t == DType::f32 || t == DType::bf16; };
  if (dst.numel() != src.numel() || (dst.dtype() != src.dtype() && !(is_float(dst.dtype()) && is_float(src.dtype()))))
    throw std::invalid_argument("copy: " + src.shape().str() + " " + to_string(src.dtype()) + " into " +
                                dst.shape().str() + " " + to_string(dst.dtype()));
}

// Rows and row length of a tensor seen as a matrix (all leading dimensions are rows).
struct Matrix {
  std::int64_t rows, cols;
};
inline Matrix as_matrix(const Tensor& t) {
  const std::int64_t cols = t.rank() ? t.dim(t.rank() - 1) : 0;
  return {cols ? t.numel() / cols : 0, cols};
}

// c = op(a)·op(b): the problem's M, N, K, after checking that the three shapes agree.
struct GemmDims {
  std::int64_t M, N, K;
};
inline GemmDims gemm_dims(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c) {
  const Matrix ma = as_matrix(a), mb = as_matrix(b), mc = as_matrix(c);
  const std::int64_t M = ta ? ma.cols : ma.rows, K = ta ? ma.rows : ma.cols;
  const std::int64_t Kb = tb ? mb.cols : mb.rows, N = tb ? mb.rows : mb.cols;
  if (K != Kb || mc.rows != M || mc.cols != N)
    throw std::invalid_argument("matmul: op(a) " + std::to_string(M) + "x" + std::to_string(K) + ", op(b) " +
                                std::to_string(Kb) + "x" + std::to_string(N) + ", c " + c.shape().str());
  return {M, N, K};
}

// rmsnorm_forward's tensors: x [.., cols], gamma [cols], y like x, rstd [rows]; x as a matrix.
inline Matrix rmsnorm_args(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd) {
  const Matrix m = as_matrix(x);
  gamma.expect({m.cols}, "rmsnorm gamma");
  same_shape(x, y, "rmsnorm");
  rstd.expect({m.rows}, "rmsnorm rstd");
  return m;
}

// rmsnorm_backward's: dy and dx like x, dgamma and gamma [cols], rstd [rows]; x as a matrix.
inline Matrix rmsnorm_backward_args(const Tensor& x, const Tensor& gamma, const Tensor& rstd, const Tensor& dy,
                                    const Tensor& dx, const Tensor& dgamma) {
  const Matrix m = as_matrix(x);
  same_shape(x, dy, "rmsnorm backward");
  same_shape(x, dx, "rmsnorm backward");
  dgamma.expect({m.cols}, "rmsnorm dgamma");
  gamma.expect({m.cols}, "rmsnorm gamma");
  rstd.expect({m.rows}, "rmsnorm rstd");
  return m;
}

// top_k's: k in 1..(row length of scores), indices (int32) and values [rows, k]; scores as a matrix.
inline Matrix top_k_args(const Tensor& scores, int k, const Tensor& indices, const Tensor& values) {
  const Matrix m = as_matrix(scores);
  if (k < 1 || k > m.cols)
    throw std::invalid_argument("top_k: k = " + std::to_string(k) + " with " + std::to_string(m.cols) + " scores a row");
  indices.expect({m.rows, k}, "top_k indices", DType::i32);
  values.expect({m.rows, k}, "top_k values");
  return m;
}

inline Matrix routing_grad_args(const Tensor& indices, const Tensor& values, std::span<const float> column_add,
                                const Tensor& out) {
  const Matrix m = as_matrix(out);
  if (indices.rank() != 2)
    throw std::invalid_argument("routing_grad: indices must be [N, k], got rank " + std::to_string(indices.rank()));
  indices.expect({m.rows, indices.dim(1)}, "routing_grad indices", DType::i32);
  values.expect(indices.shape(), "routing_grad values");
  if (static_cast<std::int64_t>(column_add.size()) != m.cols)
    throw std::invalid_argument("routing_grad: " + std::to_string(column_add.size()) + " column terms for " +
                                std::to_string(m.cols) + " columns");
  return m;
}

// route_rows' arguments; returns N·k.
inline std::int64_t route_rows_args(const Tensor& indices, const Tensor& values, int experts, const Tensor& token_of_row,
                                    const Tensor& row_of, const Tensor& weight_of_row) {
  if (indices.rank() != 2)
    throw std::invalid_argument("route_rows: indices must be [N, k], got rank " + std::to_string(indices.rank()));
  if (experts < 1) throw std::invalid_argument("route_rows: " + std::to_string(experts) + " experts");
  indices.expect(indices.shape(), "route_rows indices", DType::i32);
  values.expect(indices.shape(), "route_rows values");
  const std::int64_t a = indices.numel();
  if (a > INT32_MAX)
    throw std::invalid_argument("route_rows: " + std::to_string(a) + " assignments, more than i32 rows can number");
  token_of_row.expect({a}, "route_rows token_of_row", DType::i32);
  row_of.expect({a}, "route_rows row_of", DType::i32);
  weight_of_row.expect({a}, "route_rows weight_of_row");
  return a;
}
inline void route_rows_backward_args(const Tensor& values, const Tensor& row_of, const Tensor& dweight,
                                     const Tensor& dvalues) {
  if (values.rank() != 2)
    throw std::invalid_argument("route_rows_backward: values must be [N, k], got rank " + std::to_string(values.rank()));
  values.expect(values.shape(), "route_rows_backward values");
  row_of.expect({values.numel()}, "route_rows_backward row_of", DType::i32);
  dweight.expect({values.numel()}, "route_rows_backward dweight");
  dvalues.expect(values.shape(), "route_rows_backward dvalues");
}

// gather_add_rows' arguments: rows i32 [N·k] for out [N, D], src [R, D], scale [R]; returns out
// as a matrix.
inline Matrix gather_add_rows_args(const Tensor& src, const Tensor& rows, int k, const Tensor* scale, const Tensor& out) {
  const Matrix m = as_matrix(out), ms = as_matrix(src);
  if (k < 1) throw std::invalid_argument("gather_add_rows: " + std::to_string(k) + " rows a token");
  rows.expect({m.rows * k}, "gather_add_rows rows", DType::i32);
  if (ms.cols != m.cols)
    throw std::invalid_argument("gather_add_rows: source " + src.shape().str() + " for output " + out.shape().str());
  if (scale) scale->expect({ms.rows}, "gather_add_rows scale");
  return m;
}

// gather_add_rows_backward's: src and dsrc [R, D] alike, token_of_row i32, scale and dscale [R],
// dout [N, D]; returns src as a matrix.
inline Matrix gather_add_rows_backward_args(const Tensor& dout, const Tensor& token_of_row, const Tensor& scale,
                                            const Tensor& src, const Tensor& dsrc, const Tensor& dscale) {
  const Matrix m = as_matrix(src);
  same_shape(src, dsrc, "gather_add_rows_backward dsrc");
  token_of_row.expect({m.rows}, "gather_add_rows_backward token_of_row", DType::i32);
  scale.expect({m.rows}, "gather_add_rows_backward scale");
  dscale.expect({m.rows}, "gather_add_rows_backward dscale");
  if (as_matrix(dout).cols != m.cols)
    throw std::invalid_argument("gather_add_rows_backward: output gradient " + dout.shape().str() + " for rows " +
                                src.shape().str());
  return m;
}

// An activation of ops.h's [bf16] operations: the shape, in fp32 or bf16.
inline void activation(const Tensor& t, const Shape& shape, const char* what) {
  t.expect(shape, what, t.dtype() == DType::bf16 ? DType::bf16 : DType::f32);
}

inline void attention_args(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v) {
  s.check();
  activation(q, {static_cast<std::int64_t>(s.batch) * s.q_len, static_cast<std::int64_t>(s.q_heads) * s.head_dim}, "attention q");
  activation(k, {static_cast<std::int64_t>(s.batch) * s.kv_len, static_cast<std::int64_t>(s.kv_heads) * s.head_dim}, "attention k");
  activation(v, k.shape(), "attention v");
}

inline void attention_backward_args(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& o, const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                    const Tensor& dk, const Tensor& dv) {
  attention_args(s, q, k, v);
  same_shape(q, o, "attention backward");
  same_shape(q, dout, "attention backward");
  same_shape(q, dq, "attention backward dq");
  same_shape(k, dk, "attention backward dk");
  same_shape(v, dv, "attention backward dv");
  lse.expect({s.batch, s.q_heads, s.q_len}, "attention backward lse");
}

}  // namespace k2c::model::checks
