// autograder/12_data_parallel/forwarding_ops.h — an Ops that forwards every operation to another
// backend and calls a hook around each one.
//
// Module 12's overlap test uses it as a probe: it numbers the operations of a training step and
// looks at the communication counters as each one begins, to see which all-reduces had been
// started while backward was still running, and whether any had been started too soon.
#pragma once

#include <string>

#include "k2c/model/ops.h"

namespace k2c::ddp_harness {

class ForwardingOps : public model::Ops {
 public:
  explicit ForwardingOps(model::Ops& inner) : inner_(inner) {}
  model::Ops& inner() { return inner_; }

  std::string name() const override { return inner_.name(); }
  model::Memory& memory() override { return inner_.memory(); }

  void upload(model::Tensor& dst, const void* host) override { around("upload", [&] { inner_.upload(dst, host); }); }
  void download(void* host, const model::Tensor& src) override {
    around("download", [&] { inner_.download(host, src); });
  }
  void fill(model::Tensor& t, float value) override { around("fill", [&] { inner_.fill(t, value); }); }
  void copy(model::Tensor& dst, const model::Tensor& src) override { around("copy", [&] { inner_.copy(dst, src); }); }
  void add(const model::Tensor& a, const model::Tensor& b, model::Tensor& out) override {
    around("add", [&] { inner_.add(a, b, out); });
  }
  void accumulate(model::Tensor& acc, const model::Tensor& x, float s) override {
    around("accumulate", [&] { inner_.accumulate(acc, x, s); });
  }
  void scale(model::Tensor& t, float s) override { around("scale", [&] { inner_.scale(t, s); }); }
  double sum_squares(const model::Tensor& t) override {
    double r = 0;
    around("sum_squares", [&] { r = inner_.sum_squares(t); });
    return r;
  }
  void matmul(const model::Tensor& a, bool ta, const model::Tensor& b, bool tb, model::Tensor& c, float alpha,
              float beta) override {
    around("matmul", [&] { inner_.matmul(a, ta, b, tb, c, alpha, beta); });
  }
  void linear_backward(const model::Tensor& x, const model::Tensor& w, const model::Tensor& dy, model::Tensor* dw,
                       model::Tensor* dx) override {
    around("linear_backward", [&] { inner_.linear_backward(x, w, dy, dw, dx); });
  }
  void embedding_forward(const model::Tensor& ids, const model::Tensor& table, model::Tensor& out) override {
    around("embedding_forward", [&] { inner_.embedding_forward(ids, table, out); });
  }
  void embedding_backward(const model::Tensor& ids, const model::Tensor& dout, model::Tensor& dtable) override {
    around("embedding_backward", [&] { inner_.embedding_backward(ids, dout, dtable); });
  }
  void rmsnorm_forward(const model::Tensor& x, const model::Tensor& gamma, float eps, model::Tensor& y,
                       model::Tensor& rstd) override {
    around("rmsnorm_forward", [&] { inner_.rmsnorm_forward(x, gamma, eps, y, rstd); });
  }
  void rmsnorm_backward(const model::Tensor& x, const model::Tensor& gamma, const model::Tensor& rstd,
                        const model::Tensor& dy, model::Tensor& dx, model::Tensor& dgamma) override {
    around("rmsnorm_backward", [&] { inner_.rmsnorm_backward(x, gamma, rstd, dy, dx, dgamma); });
  }
  void rope(model::Tensor& x, const model::Tensor& positions, int heads, int head_dim, float theta,
            bool inverse) override {
    around("rope", [&] { inner_.rope(x, positions, heads, head_dim, theta, inverse); });
  }
  void attention_forward(const model::AttentionShape& s, const model::Tensor& q, const model::Tensor& k,
                         const model::Tensor& v, model::Tensor& o, model::Tensor& lse) override {
    around("attention_forward", [&] { inner_.attention_forward(s, q, k, v, o, lse); });
  }
  void attention_backward(const model::AttentionShape& s, const model::Tensor& q, const model::Tensor& k,
                          const model::Tensor& v, const model::Tensor& o, const model::Tensor& lse,
                          const model::Tensor& dout, model::Tensor& dq, model::Tensor& dk,
                          model::Tensor& dv) override {
    around("attention_backward", [&] { inner_.attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv); });
  }
  void swiglu_forward(const model::Tensor& gate, const model::Tensor& up, model::Tensor& h) override {
    around("swiglu_forward", [&] { inner_.swiglu_forward(gate, up, h); });
  }
  void swiglu_backward(const model::Tensor& gate, const model::Tensor& up, const model::Tensor& dh,
                       model::Tensor& dgate, model::Tensor& dup) override {
    around("swiglu_backward", [&] { inner_.swiglu_backward(gate, up, dh, dgate, dup); });
  }
  double cross_entropy(const model::Tensor& logits, const model::Tensor& targets, float grad_scale,
                       model::Tensor& dlogits) override {
    double r = 0;
    around("cross_entropy", [&] { r = inner_.cross_entropy(logits, targets, grad_scale, dlogits); });
    return r;
  }
  void dropout(const model::Tensor& x, float p, const model::DropoutKey& key, model::Tensor& out) override {
    around("dropout", [&] { inner_.dropout(x, p, key, out); });
  }
  void softmax_rows(const model::Tensor& x, model::Tensor& y) override {
    around("softmax_rows", [&] { inner_.softmax_rows(x, y); });
  }
  void softmax_rows_backward(const model::Tensor& y, const model::Tensor& dy, model::Tensor& dx) override {
    around("softmax_rows_backward", [&] { inner_.softmax_rows_backward(y, dy, dx); });
  }
  void top_k(const model::Tensor& scores, int k, model::Tensor& indices, model::Tensor& values) override {
    around("top_k", [&] { inner_.top_k(scores, k, indices, values); });
  }
  void gather_rows(const model::Tensor& src, const model::Tensor& rows, model::Tensor& out) override {
    around("gather_rows", [&] { inner_.gather_rows(src, rows, out); });
  }
  void scatter_add_rows(const model::Tensor& src, const model::Tensor& rows, const model::Tensor* scale,
                        model::Tensor& out) override {
    around("scatter_add_rows", [&] { inner_.scatter_add_rows(src, rows, scale, out); });
  }
  void row_dot(const model::Tensor& a, const model::Tensor& b, model::Tensor& out) override {
    around("row_dot", [&] { inner_.row_dot(a, b, out); });
  }
  void scale_rows(model::Tensor& x, const model::Tensor& scale) override {
    around("scale_rows", [&] { inner_.scale_rows(x, scale); });
  }
  void sgd_step(model::Tensor& param, const model::Tensor& grad, model::Tensor* momentum, float lr, float beta,
                float weight_decay) override {
    around("sgd_step", [&] { inner_.sgd_step(param, grad, momentum, lr, beta, weight_decay); });
  }
  void adamw_step(model::Tensor& param, const model::Tensor& grad, model::Tensor& m, model::Tensor& v, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int t) override {
    around("adamw_step", [&] { inner_.adamw_step(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, t); });
  }

 protected:
  // Called with the operation's name just before it runs.
  virtual void enter(const char* op) { (void)op; }

 private:
  template <class Fn>
  void around(const char* op, Fn&& fn) {
    enter(op);
    fn();
  }
  model::Ops& inner_;
};

}  // namespace k2c::ddp_harness
