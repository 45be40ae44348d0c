// k2c/model/forwarding_ops.h — an Ops that forwards every operation to another backend, with one
// hook around each: the base of TimedOps (where a step's time goes) and of the tests' probes
// (which operations a step ran, in what order, with what shapes, and what the communicator had
// done by then).
//
// A derived class overrides around() to wrap every operation, or one operation's override to
// look at its arguments (calling ForwardingOps's to run it). Operations a derived class does not
// touch reach the inner backend unchanged, so its results are the inner backend's bit for bit.
#pragma once

#include <functional>
#include <span>
#include <string>

#include "k2c/model/ops.h"

namespace k2c::model {

class ForwardingOps : public Ops {
 public:
  explicit ForwardingOps(Ops& inner) : inner_(inner) {}
  Ops& inner() const { return inner_; }

  std::string name() const override { return inner_.name(); }
  Memory& memory() override { return inner_.memory(); }

  void upload(Tensor& dst, const void* host) override { around("upload", [&] { inner_.upload(dst, host); }); }
  void download(void* host, const Tensor& src) override { around("download", [&] { inner_.download(host, src); }); }
  void fill(Tensor& t, float v) override { around("fill", [&] { inner_.fill(t, v); }); }
  void copy(Tensor& dst, const Tensor& src) override { around("copy", [&] { inner_.copy(dst, src); }); }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override { around("add", [&] { inner_.add(a, b, out); }); }
  void accumulate(Tensor& acc, const Tensor& x, float s) override { around("accumulate", [&] { inner_.accumulate(acc, x, s); }); }
  void scale(Tensor& t, float s) override { around("scale", [&] { inner_.scale(t, s); }); }
  double sum_squares(const Tensor& t) override {
    double r = 0;
    around("sum_squares", [&] { r = inner_.sum_squares(t); });
    return r;
  }
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    // The three layouts of a Linear layer apart: forward, input gradient, weight gradient.
    around(ta ? "matmul dW (aT b)" : tb ? "matmul fwd (a bT)" : "matmul dX (a b)",
         [&] { inner_.matmul(a, ta, b, tb, c, alpha, beta); });
  }
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw, Tensor* dx) override {
    around("linear backward (dW, dX)", [&] { inner_.linear_backward(x, w, dy, dw, dx); });
  }
  void shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) override {
    around("matmul fwd (a bT)", [&] { inner_.shared_linear_forward(x, ws, ys); });
  }
  void shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                              std::span<Tensor* const> dws, Tensor* dx) override {
    around("linear backward (dW, dX)", [&] { inner_.shared_linear_backward(x, ws, dys, dws, dx); });
  }
  void grouped_matmul(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                      bool transpose_w, Tensor& c) override {
    around("grouped matmul", [&] { inner_.grouped_matmul(a, offsets, first, w, transpose_w, c); });
  }
  void grouped_weight_grad(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                           Tensor& dw) override {
    around("grouped weight grad", [&] { inner_.grouped_weight_grad(dy, x, offsets, first, dw); });
  }
  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) override {
    around("embedding", [&] { inner_.embedding_forward(ids, table, out); });
  }
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) override {
    around("embedding backward", [&] { inner_.embedding_backward(ids, dout, dtable); });
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& g, float eps, Tensor& y, Tensor& rstd) override {
    around("rmsnorm", [&] { inner_.rmsnorm_forward(x, g, eps, y, rstd); });
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dg) override {
    around("rmsnorm backward", [&] { inner_.rmsnorm_backward(x, g, rstd, dy, dx, dg); });
  }
  void rmsnorm_backward_add(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy, const Tensor& r,
                            Tensor& dx, Tensor& dg) override {
    around("rmsnorm backward", [&] { inner_.rmsnorm_backward_add(x, g, rstd, dy, r, dx, dg); });
  }
  void rope(Tensor& x, const Tensor& positions, int heads, int hd, float theta, bool inverse) override {
    around("rope", [&] { inner_.rope(x, positions, heads, hd, theta, inverse); });
  }
  void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                         Tensor& lse) override {
    around("attention", [&] { inner_.attention_forward(s, q, k, v, o, lse); });
  }
  void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) override {
    around("attention backward", [&] { inner_.attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv); });
  }
  void attention_backward_overwrite(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& o, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                    Tensor& dv) override {
    around("attention backward", [&] { inner_.attention_backward_overwrite(s, q, k, v, o, lse, dout, dq, dk, dv); });
  }
  void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& h) override {
    around("swiglu", [&] { inner_.swiglu_forward(g, u, h); });
  }
  void swiglu_backward(const Tensor& g, const Tensor& u, const Tensor& dh, Tensor& dg, Tensor& du) override {
    around("swiglu backward", [&] { inner_.swiglu_backward(g, u, dh, dg, du); });
  }
  double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& dlogits) override {
    double r = 0;
    around("cross-entropy", [&] { r = inner_.cross_entropy(logits, targets, grad_scale, dlogits); });
    return r;
  }
  void dropout(const Tensor& x, float p, const DropoutKey& key, Tensor& out) override {
    around("dropout", [&] { inner_.dropout(x, p, key, out); });
  }
  void softmax_rows(const Tensor& x, Tensor& y) override { around("softmax", [&] { inner_.softmax_rows(x, y); }); }
  void softmax_rows_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    around("softmax backward", [&] { inner_.softmax_rows_backward(y, dy, dx); });
  }
  void top_k(const Tensor& s, int k, Tensor& idx, Tensor& val) override { around("top_k", [&] { inner_.top_k(s, k, idx, val); }); }
  void gather_rows(const Tensor& src, const Tensor& rows, Tensor& out) override {
    around("gather_rows", [&] { inner_.gather_rows(src, rows, out); });
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& out) override {
    around("scatter_add_rows", [&] { inner_.scatter_add_rows(src, rows, scale, out); });
  }
  void gather_add_rows(const Tensor& src, const Tensor& rows, int k, const Tensor* scale, Tensor& out) override {
    around("gather_add_rows", [&] { inner_.gather_add_rows(src, rows, k, scale, out); });
  }
  void gather_add_rows_backward(const Tensor& dout, const Tensor& token_of_row, const Tensor& scale, const Tensor& src,
                                Tensor& dsrc, Tensor& dscale) override {
    around("gather_add_rows backward", [&] { inner_.gather_add_rows_backward(dout, token_of_row, scale, src, dsrc, dscale); });
  }
  void row_dot(const Tensor& a, const Tensor& b, Tensor& out) override { around("row_dot", [&] { inner_.row_dot(a, b, out); }); }
  void scale_rows(Tensor& x, const Tensor& s) override { around("scale_rows", [&] { inner_.scale_rows(x, s); }); }
  std::vector<double> column_sums(const Tensor& x) override {
    std::vector<double> sums;
    around("column_sums", [&] { sums = inner_.column_sums(x); });
    return sums;
  }
  void routing_grad(const Tensor& indices, const Tensor& values, std::span<const float> column_add,
                    Tensor& out) override {
    around("routing_grad", [&] { inner_.routing_grad(indices, values, column_add, out); });
  }
  std::vector<std::int64_t> route_rows(const Tensor& indices, const Tensor& values, int experts, bool normalize,
                                       Tensor& token_of_row, Tensor& row_of, Tensor& weight_of_row) override {
    std::vector<std::int64_t> counts;
    around("route_rows",
           [&] { counts = inner_.route_rows(indices, values, experts, normalize, token_of_row, row_of, weight_of_row); });
    return counts;
  }
  void route_rows_backward(const Tensor& values, const Tensor& row_of, const Tensor& dweight, bool normalize,
                           Tensor& dvalues) override {
    around("route_rows_backward", [&] { inner_.route_rows_backward(values, row_of, dweight, normalize, dvalues); });
  }
  void sgd_step(Tensor& p, const Tensor& g, Tensor* m, float lr, float beta, float wd) override {
    around("sgd", [&] { inner_.sgd_step(p, g, m, lr, beta, wd); });
  }
  void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, float lr, float b1, float b2, float eps, float wd,
                  int t) override {
    around("adamw", [&] { inner_.adamw_step(p, g, m, v, lr, b1, b2, eps, wd, t); });
  }

 protected:
  // Every operation comes through here: `op` is its name as TimedOps' table prints it ("matmul
  // fwd (a bT)", "attention backward", ...), `run` forwards it to the inner backend. The default
  // just runs it.
  virtual void around(const char* op, const std::function<void()>& run) {
    (void)op;
    run();
  }

  Ops& inner_;
};

}  // namespace k2c::model
