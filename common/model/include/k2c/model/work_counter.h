// k2c/model/work_counter.h — the work a rank hands its backend, and whether a grid of ranks split
// it: WorkCounter (an Ops that counts on the way through) and work_split_problem (the rule).
//
// A grid's losses and weights can equal one process's while every rank trains the whole model, or
// while a tp, pp or ep axis is run as data parallelism; the work each rank does cannot. Module 18's
// grid tests and the grader's rank witness of them (autograder/witness/rank_cases_training.cpp)
// wrap the backend a trainer is given in a WorkCounter on every rank and hold the counts against
// one process's with work_split_problem. Header-only: the witness links no test code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "k2c/model/forwarding_ops.h"

namespace k2c::model {

// The work handed to `inner`, counted on the way through: the FLOPs of the products (2·M·N·K a
// GEMM, attention's two products forward and four backward, as if unmasked) and the parameter
// elements the optimizer steps. The results are the inner backend's, bit for bit.
class WorkCounter final : public ForwardingOps {
 public:
  explicit WorkCounter(Ops& inner) : ForwardingOps(inner) {}
  double flops() const { return flops_; }
  std::int64_t stepped() const { return stepped_; }  // parameter elements updated, over optimizer calls

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha,
              float beta) override {
    flops_ += 2 * rows(c) * cols(c) * (ta ? rows(a) : cols(a));
    ForwardingOps::matmul(a, ta, b, tb, c, alpha, beta);
  }
  void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dw,
                       Tensor* dx) override {
    flops_ += 2 * rows(dy) * cols(dy) * cols(x) * ((dw != nullptr) + (dx != nullptr));
    ForwardingOps::linear_backward(x, w, dy, dw, dx);
  }
  void shared_linear_forward(const Tensor& x, std::span<const Tensor* const> ws,
                             std::span<Tensor* const> ys) override {
    for (const Tensor* y : ys) flops_ += 2 * rows(*y) * cols(*y) * cols(x);
    ForwardingOps::shared_linear_forward(x, ws, ys);
  }
  void shared_linear_backward(const Tensor& x, std::span<const Tensor* const> ws,
                              std::span<const Tensor* const> dys, std::span<Tensor* const> dws,
                              Tensor* dx) override {
    for (std::size_t i = 0; i < dys.size(); ++i)
      flops_ += 2 * rows(*dys[i]) * cols(*dys[i]) * cols(x) * ((i < dws.size() && dws[i]) + (dx != nullptr));
    ForwardingOps::shared_linear_backward(x, ws, dys, dws, dx);
  }
  void grouped_matmul(const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w,
                      bool transpose_w, Tensor& c) override {
    flops_ += 2 * grouped_rows(offsets) * cols(a) * cols(c);
    ForwardingOps::grouped_matmul(a, offsets, first, w, transpose_w, c);
  }
  void grouped_weight_grad(const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                           Tensor& dw) override {
    flops_ += 2 * grouped_rows(offsets) * cols(dy) * cols(x);
    ForwardingOps::grouped_weight_grad(dy, x, offsets, first, dw);
  }
  void attention_forward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                         Tensor& o, Tensor& lse) override {
    flops_ += 4 * attention_macs(s);
    ForwardingOps::attention_forward(s, q, k, v, o, lse);
  }
  void attention_backward(const AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& o, const Tensor& lse, const Tensor& dout, Tensor& dq,
                          Tensor& dk, Tensor& dv) override {
    flops_ += 8 * attention_macs(s);
    ForwardingOps::attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv);
  }
  void attention_backward_overwrite(const AttentionShape& s, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& o, const Tensor& lse,
                                    const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) override {
    flops_ += 8 * attention_macs(s);
    ForwardingOps::attention_backward_overwrite(s, q, k, v, o, lse, dout, dq, dk, dv);
  }
  void sgd_step(Tensor& p, const Tensor& g, Tensor* m, float lr, float beta, float wd) override {
    stepped_ += p.numel();
    ForwardingOps::sgd_step(p, g, m, lr, beta, wd);
  }
  void adamw_step(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, float lr, float b1, float b2,
                  float eps, float wd, int t) override {
    stepped_ += p.numel();
    ForwardingOps::adamw_step(p, g, m, v, lr, b1, b2, eps, wd, t);
  }

 private:
  double flops_ = 0;
  std::int64_t stepped_ = 0;

  // A tensor as a matrix: its last dimension is the columns, the rest the rows.
  static double cols(const Tensor& t) { return t.numel() == 0 ? 0.0 : static_cast<double>(t.dim(t.rank() - 1)); }
  static double rows(const Tensor& t) { return t.numel() == 0 ? 0.0 : static_cast<double>(t.numel()) / cols(t); }
  static double grouped_rows(std::span<const std::int64_t> offsets) {
    return offsets.empty() ? 0.0 : static_cast<double>(offsets.back() - offsets.front());
  }
  static double attention_macs(const AttentionShape& s) {
    return static_cast<double>(s.batch) * s.q_heads * s.q_len * s.kv_len * s.head_dim;
  }
};


// The room a rank's products have over its share of the batch. Over a grid's ranks the products
// add up to exactly one process's where nothing is replicated, more where something is (a mixture
// of experts is replicated over tp). A dp rank's products are at most its 1/dp of the batch's:
// the axes inside its dp group (tp, pp, ep) cut that share unevenly (a pipeline stage that holds
// the head, experts that the router sends more tokens) but never add to it, except by replication
// over tp (module 18's reference: 0.36 a rank at dp 2 × tp 2 on a mixture of experts, where 0.25
// is an even cut) or recomputed activations (a third more). Half again over the share leaves
// room for those, not for a rank that trains on the whole batch.
inline constexpr double kMinProductSum = 0.99, kDataShareSlack = 1.5;

// "" if the ranks of a grid (its axes' sizes dp, tp, pp, ep) split the work of some steps, each
// rank's counts given in world rank order, as one process's counts for the same steps (one_flops,
// one_stepped) say they must; else what is wrong, with every rank's shares:
//   - the products add up to at least one process's (kMinProductSum of them): the work went
//     through the backends the ranks were given (a rank may do more, never less);
//   - every parameter was stepped on some rank, each step;
//   - where dp > 1, no rank did more than kDataShareSlack / dp of one process's products: dp cuts
//     the batch, and a rank that trains on the whole batch does it all;
//   - where the grid cuts the model (tp, pp or ep > 1), no rank stepped every parameter: a rank
//     that trains the whole model, or a grid that runs those axes as data parallelism, keeps the
//     whole model on every rank.
inline std::string work_split_problem(int dp, int tp, int pp, int ep, const std::vector<double>& flops,
                                      const std::vector<double>& stepped, double one_flops, double one_stepped) {
  double flops_sum = 0, flops_max = 0, stepped_sum = 0, stepped_max = 0;
  for (double f : flops) flops_sum += f, flops_max = std::max(flops_max, f);
  for (double p : stepped) stepped_sum += p, stepped_max = std::max(stepped_max, p);
  std::ostringstream shares;
  for (std::size_t r = 0; r < flops.size() && r < stepped.size(); ++r)
    shares << (r ? "; " : "") << "rank " << r << ": products " << flops[r] / one_flops << ", parameters stepped "
           << stepped[r] / one_stepped;
  const std::string of = " (each rank's share of one process's work: " + shares.str() + ")";
  std::ostringstream why;
  const double bound = kDataShareSlack / dp;
  if (!(flops_sum >= kMinProductSum * one_flops))
    why << "the ranks' products add up to " << flops_sum / one_flops
        << " of one process's: the trainer must compute with the Ops it is given";
  else if (!(stepped_sum >= one_stepped))
    why << "some parameters were not stepped with the Ops the trainer was given";
  else if (dp > 1 && !(flops_max <= bound * one_flops))
    why << "a rank did " << flops_max / one_flops << " of one process's products, over " << bound
        << ": dp " << dp << " cuts the batch between the ranks";
  else if (tp * pp * ep > 1 && !(stepped_max < one_stepped))
    why << "a rank stepped every parameter, so it holds the whole model: tp, pp and ep cut it";
  else
    return "";
  return why.str() + of;
}

}  // namespace k2c::model
