// k2c/model/timed_ops.h — where a step's time goes: an Ops that forwards every operation to
// another backend and adds up the wall time spent in each kind of operation.
//
// On a GPU the operations are asynchronous, so each one is bracketed by `sync` (for the CUDA
// backend, a device synchronise): the figures are the time each operation takes on its own,
// without the overlap a normal step gets, and the step runs slower while it is being timed.
// Use it for one profiled step next to the timed ones, never for the timed ones themselves. Each
// operation is also an NVTX range of the same name where the NVTX headers are found, so
// `nsys profile k2c_model_bench` shows the profiled step with the table's names.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "k2c/model/ops.h"
#include "k2c/nvtx.h"

namespace k2c::model {

class TimedOps final : public Ops {
 public:
  struct Entry {
    double seconds = 0;
    long calls = 0;
  };
  TimedOps(Ops& inner, std::function<void()> sync) : inner_(inner), sync_(std::move(sync)) {}

  const std::map<std::string, Entry>& entries() const { return entries_; }
  void reset() { entries_.clear(); }
  // A table, the most expensive operation first: seconds, share of the total, calls.
  std::string report() const;

  std::string name() const override { return inner_.name() + " (timed)"; }
  Memory& memory() override { return inner_.memory(); }
  void upload(Tensor& dst, const void* host) override { time("upload", [&] { inner_.upload(dst, host); }); }
  void download(void* host, const Tensor& src) override { time("download", [&] { inner_.download(host, src); }); }
  void fill(Tensor& t, float v) override { time("fill", [&] { inner_.fill(t, v); }); }
  void copy(Tensor& dst, const Tensor& src) override { time("copy", [&] { inner_.copy(dst, src); }); }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override { time("add", [&] { inner_.add(a, b, out); }); }
  void accumulate(Tensor& acc, const Tensor& x, float s) override { time("accumulate", [&] { inner_.accumulate(acc, x, s); }); }
  void scale(Tensor& t, float s) override { time("scale", [&] { inner_.scale(t, s); }); }
  double sum_squares(const Tensor& t) override {
    double r = 0;
    time("sum_squares", [&] { r = inner_.sum_squares(t); });
    return r;
  }
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    // The three layouts of a Linear layer apart: forward, input gradient, weight gradient.
    time(ta ? "matmul dW (aT b)" : tb ? "matmul fwd (a bT)" : "matmul dX (a b)",
         [&] { inner_.matmul(a, ta, b, tb, c, alpha, beta); });
  }
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw, Tensor* dx) override {
    time("linear backward (dW, dX)", [&] { inner_.linear_backward(x, w, dy, dw, dx); });
  }
  void shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) override {
    time("matmul fwd (a bT)", [&] { inner_.shared_linear_forward(x, ws, ys); });
  }
  void shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                              std::span<Tensor* const> dws, Tensor* dx) override {
    time("linear backward (dW, dX)", [&] { inner_.shared_linear_backward(x, ws, dys, dws, dx); });
  }
  void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) override {
    time("embedding", [&] { inner_.embedding_forward(ids, table, out); });
  }
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) override {
    time("embedding backward", [&] { inner_.embedding_backward(ids, dout, dtable); });
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& g, float eps, Tensor& y, Tensor& rstd) override {
    time("rmsnorm", [&] { inner_.rmsnorm_forward(x, g, eps, y, rstd); });
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dg) override {
    time("rmsnorm backward", [&] { inner_.rmsnorm_backward(x, g, rstd, dy, dx, dg); });
  }
  void rmsnorm_backward_add(const Tensor& x, const Tensor& g, const Tensor& rstd, const Tensor& dy, const Tensor& r,
                            Tensor& dx, Tensor& dg) override {
    time("rmsnorm backward", [&] { inner_.rmsnorm_backward_add(x, g, rstd, dy, r, dx, dg); });
  }
  void rope(Tensor& x, const Tensor& positions, int heads, int hd, float theta, bool inverse) override {
    time("rope", [&] { inner_.rope(x, positions, heads, hd, theta, inverse); });
  }
  void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                         Tensor& lse) override {
    time("attention", [&] { inner_.attention_forward(s, q, k, v, o, lse); });
  }
  void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                          const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) override {
    time("attention backward", [&] { inner_.attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv); });
  }
  void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& h) override {
    time("swiglu", [&] { inner_.swiglu_forward(g, u, h); });
  }
  void swiglu_backward(const Tensor& g, const Tensor& u, const Tensor& dh, Tensor& dg, Tensor& du) override {
    time("swiglu backward", [&] { inner_.swiglu_backward(g, u, dh, dg, du); });
  }
  double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor& dlogits) override {
    double r = 0;
    time("cross-entropy", [&] { r = inner_.cross_entropy(logits, targets, grad_scale, dlogits); });
    return r;
  }
  void dropout(const Tensor& x, float p, const DropoutKey& key, Tensor& out) override {
    time("dropout", [&] { inner_.dropout(x, p, key, out); });
  }
  void softmax_rows(const Tensor& x, Tensor& y) override { time("softmax", [&] { inner_.softmax_rows(x, y); }); }
  void softmax_rows_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    time("softmax backward", [&] { inner_.softmax_rows_backward(y, dy, dx); });
  }
  void top_k(const Tensor& s, int k, Tensor& idx, Tensor& val) override { time("top_k", [&] { inner_.top_k(s, k, idx, val); }); }
  void gather_rows(const Tensor& src, const Tensor& rows, Tensor& out) override {
    time("gather_rows", [&] { inner_.gather_rows(src, rows, out); });
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& out) override {
    time("scatter_add_rows", [&] { inner_.scatter_add_rows(src, rows, scale, out); });
  }
  void row_dot(const Tensor& a, const Tensor& b, Tensor& out) override { time("row_dot", [&] { inner_.row_dot(a, b, out); }); }
  void scale_rows(Tensor& x, const Tensor& s) override { time("scale_rows", [&] { inner_.scale_rows(x, s); }); }
  void sgd_step(Tensor& p, const Tensor& g, Tensor* m, float lr, float beta, float wd) override {
    time("sgd", [&] { inner_.sgd_step(p, g, m, lr, beta, wd); });
  }
  void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, float lr, float b1, float b2, float eps, float wd,
                  int t) override {
    time("adamw", [&] { inner_.adamw_step(p, g, m, v, lr, b1, b2, eps, wd, t); });
  }

 private:
  template <class F>
  void time(const char* what, F&& f) {
    sync_();
    const auto t0 = std::chrono::steady_clock::now();
    K2C_NVTX_RANGE(what);  // the same names on an nsys timeline as in the table
    f();
    sync_();
    Entry& e = entries_[what];
    e.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++e.calls;
  }

  Ops& inner_;
  std::function<void()> sync_;
  std::map<std::string, Entry> entries_;
};

}  // namespace k2c::model
