// moe.cpp — see k2c/model/moe.h.
#include "k2c/model/moe.h"

#include <stdexcept>

namespace k2c::model {

Routing Routing::plan(const std::vector<std::int32_t>& expert, int tokens, int top_k, int experts) {
  if (expert.size() != static_cast<std::size_t>(tokens) * top_k)
    throw std::invalid_argument("routing: " + std::to_string(expert.size()) + " assignments for " +
                                std::to_string(tokens) + " tokens x top " + std::to_string(top_k));
  Routing r;
  r.tokens = tokens, r.top_k = top_k, r.experts = experts;
  r.expert = expert;
  r.counts.assign(experts, 0);
  for (std::int32_t e : expert) {
    if (e < 0 || e >= experts) throw std::out_of_range("routing: expert " + std::to_string(e));
    ++r.counts[e];
  }
  r.offsets.assign(experts + 1, 0);
  for (int e = 0; e < experts; ++e) r.offsets[e + 1] = r.offsets[e] + r.counts[e];
  // A counting sort by expert keeps assignments in token order inside each expert.
  std::vector<std::int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  r.token_of_row.assign(expert.size(), 0);
  r.row_of.assign(expert.size(), 0);
  for (std::size_t a = 0; a < expert.size(); ++a) {
    const std::int64_t row = next[expert[a]]++;
    r.token_of_row[row] = static_cast<std::int32_t>(a / top_k);
    r.row_of[a] = static_cast<std::int32_t>(row);
  }
  return r;
}

Moe::Moe(ParamList& params, const std::string& name, const MoeConfig& c) : config_(c) {
  if (c.experts < 1 || c.top_k < 1 || c.top_k > c.experts || c.d_expert < 1 || c.d_model < 1)
    throw std::invalid_argument("moe '" + name + "': " + std::to_string(c.experts) + " experts, top " +
                                std::to_string(c.top_k) + ", width " + std::to_string(c.d_expert));
  router_ = Linear(params, name + ".router", c.d_model, c.experts);
  gate_ = params.add(name + ".experts.gate.weight", {c.experts, c.d_expert, c.d_model}, {});
  up_ = params.add(name + ".experts.up.weight", {c.experts, c.d_expert, c.d_model}, {});
  down_ = params.add(name + ".experts.down.weight", {c.experts, c.d_model, c.d_expert}, {});
  has_shared_ = c.shared_experts > 0;
  if (has_shared_) shared_ = Mlp(params, name + ".shared", c.d_model, c.d_expert * c.shared_experts);
}

void Moe::route(Context& ctx, const Tensor& x, Saved& s) const {
  const std::int64_t N = x.dim(0);
  const int E = config_.experts, k = config_.top_k;
  Tensor logits = ctx.tensor({N, E});
  router_.forward(ctx, x, logits);
  s.probs = ctx.tensor({N, E});
  ctx.ops.softmax_rows(logits, s.probs);
  s.top_idx = ctx.tensor({N, k}, Category::activations, DType::i32);
  s.top_val = ctx.tensor({N, k});
  ctx.ops.top_k(s.probs, k, s.top_idx, s.top_val);
  // The plan stays where the choices are; the host gets E counts, for the grouped GEMMs' offsets
  // and the balance term, and E column sums, P_e the mean probability of each expert.
  s.token_of_row = ctx.tensor({N * k}, Category::activations, DType::i32);
  s.row_of = ctx.tensor({N * k}, Category::activations, DType::i32);
  s.weight_of_row = ctx.tensor({N * k});
  s.counts = ctx.ops.route_rows(s.top_idx, s.top_val, E, config_.normalize_top_k, s.token_of_row, s.row_of,
                                s.weight_of_row);
  s.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) s.offsets[e + 1] = s.offsets[e] + s.counts[e];
  const std::vector<double> p = ctx.ops.column_sums(s.probs);
  // Balance: f_e from the counts, P_e from p.
  double balance = 0;
  for (int e = 0; e < E; ++e) balance += static_cast<double>(s.counts[e]) / (N * k) * (p[e] / N);
  s.balance_loss = config_.balance_coef * E * balance;
}

namespace {
// A dispatcher's plan must cover exactly the rows it hands over, with experts that exist.
void check_plan(const std::vector<std::int64_t>& offsets, int first, int experts, std::int64_t rows) {
  if (offsets.empty() || offsets.front() != 0 || offsets.back() != rows || first < 0 ||
      first + static_cast<std::int64_t>(offsets.size()) - 1 > experts)
    throw std::invalid_argument("moe experts: offsets for " + std::to_string(offsets.size() - 1) +
                                " experts from " + std::to_string(first) + " must start at 0 and end at the " +
                                std::to_string(rows) + " rows given, within " + std::to_string(experts) + " experts");
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e)
    if (offsets[e + 1] < offsets[e]) throw std::invalid_argument("moe experts: offsets must not decrease");
}

// t in the run's activation dtype: t itself, or a rounded copy kept in `copy`.
const Tensor& in_activation_dtype(Context& ctx, const Tensor& t, Tensor& copy) {
  if (t.dtype() == ctx.activations) return t;
  copy = ctx.activation(t.shape());
  ctx.ops.copy(copy, t);
  return copy;
}
}  // namespace

// The experts' activations (gate, up, h and, in backward, their gradients) are stored in the run's
// activation dtype, as the dense MLP's are, and so are the rows they read: a caller's fp32 rows
// (an expert-parallel exchange) are rounded here, where Moe::forward gathers them rounded, so that
// every grid rounds the same values. Their output yp stays fp32: it is summed into the layer's
// fp32 output, here or on the rank the rows came from.
void Moe::experts_forward(Context& ctx, const std::vector<std::int64_t>& offsets, int first, const Tensor& xp,
                          Saved& s) const {
  const std::int64_t R = xp.dim(0), d = config_.d_model, F = config_.d_expert;
  check_plan(offsets, first, config_.experts, R);
  s.gate = ctx.activation({R, F});
  s.up = ctx.activation({R, F});
  s.h = ctx.activation({R, F});
  s.yp = ctx.tensor({R, d});
  s.x_rounded = Tensor();  // none from an earlier call
  if (R == 0) return;
  const Tensor& x = in_activation_dtype(ctx, xp, s.x_rounded);
  // Each operation over every expert's rows at once (one grouped GEMM: module 10's shape of the
  // work); row by row the same arithmetic as one expert at a time.
  ctx.ops.grouped_matmul(x, offsets, first, ctx.params.value(gate_), true, s.gate);
  ctx.ops.grouped_matmul(x, offsets, first, ctx.params.value(up_), true, s.up);
  ctx.ops.swiglu_forward(s.gate, s.up, s.h);
  ctx.ops.grouped_matmul(s.h, offsets, first, ctx.params.value(down_), true, s.yp);
}

void Moe::experts_backward(Context& ctx, const std::vector<std::int64_t>& offsets, int first, const Tensor& xp,
                           const Saved& s, const Tensor& dyp, Tensor& dxp) const {
  const std::int64_t R = xp.dim(0), F = config_.d_expert;
  check_plan(offsets, first, config_.experts, R);
  if (R > 0) {
    Tensor dh = ctx.activation({R, F}), dg = ctx.activation({R, F}), du = ctx.activation({R, F}),
           part = ctx.tensor(dxp.shape()), dy_rounded;
    const Tensor& x = s.x_rounded.empty() ? xp : s.x_rounded;  // the rows forward read
    const Tensor& dy = in_activation_dtype(ctx, dyp, dy_rounded);
    if (ctx.trains(down_)) ctx.ops.grouped_weight_grad(dy, s.h, offsets, first, ctx.params.grad(down_));
    ctx.ops.grouped_matmul(dy, offsets, first, ctx.params.value(down_), false, dh);
    ctx.ops.swiglu_backward(s.gate, s.up, dh, dg, du);
    if (ctx.trains(gate_)) ctx.ops.grouped_weight_grad(dg, x, offsets, first, ctx.params.grad(gate_));
    if (ctx.trains(up_)) ctx.ops.grouped_weight_grad(du, x, offsets, first, ctx.params.grad(up_));
    ctx.ops.grouped_matmul(dg, offsets, first, ctx.params.value(gate_), false, dxp);
    ctx.ops.grouped_matmul(du, offsets, first, ctx.params.value(up_), false, part);
    ctx.ops.accumulate(dxp, part, 1.0f);
  }
  // Every expert's slice is final now, including those that got no rows.
  ctx.params.grad_done(down_);
  ctx.params.grad_done(up_);
  ctx.params.grad_done(gate_);
}

void Moe::forward(Context& ctx, const Tensor& x, Tensor& y, Saved& s) const {
  route(ctx, x, s);
  ctx.aux_loss += s.balance_loss;
  s.xp = ctx.activation({s.token_of_row.numel(), config_.d_model});  // rounded as they are gathered
  ctx.ops.gather_rows(x, s.token_of_row, s.xp);
  experts_forward(ctx, s.offsets, 0, s.xp, s);
  // y starts as the shared expert's output, written there directly, and the routed rows add in.
  if (has_shared_)
    shared_.forward(ctx, x, y, s.shared);
  else
    ctx.ops.fill(y, 0.0f);
  // Combine: each token's k rows, gathered in row order (scatter_add_rows's sums without atomics).
  ctx.ops.gather_add_rows(s.yp, s.row_of, config_.top_k, &s.weight_of_row, y);
}

void Moe::backward(Context& ctx, const Tensor& x, Saved& s, const Tensor& dy, Tensor& dx) const {
  const std::int64_t N = x.dim(0), R = s.xp.dim(0), d = config_.d_model;
  const int E = config_.experts, k = config_.top_k;
  // Combine: y[n] += w_row · yp[row]  =>  dyp[row] = w_row · dy[n], dw_row = dy[n] · yp[row]; dyp
  // in the experts' activation dtype, as their products read it.
  Tensor dyp = ctx.activation({R, d}), dw_row = ctx.tensor({R}), dxp = ctx.tensor({R, d});
  ctx.ops.gather_add_rows_backward(dy, s.token_of_row, s.weight_of_row, s.yp, dyp, dw_row);
  experts_backward(ctx, s.offsets, 0, s.xp, s, dyp, dxp);
  if (has_shared_) {
    shared_.backward(ctx, x, s.shared, dy, dx);
  } else {
    ctx.ops.fill(dx, 0.0f);
  }
  ctx.ops.gather_add_rows(dxp, s.row_of, k, nullptr, dx);  // un-permute

  // Back through the weights to the router probabilities: the chosen ones' gradient (where the
  // plan is), then the N × E gradient.
  Tensor dv = ctx.tensor({N, k});
  ctx.ops.route_rows_backward(s.top_val, s.row_of, dw_row, config_.normalize_top_k, dv);
  // The balance term coef·E·Σ_e f_e·mean_n(p_ne) adds coef·E·f_e/N to every dp_ne; it is weighted
  // like the loss it joins (loss_scale per token, N tokens here).
  const double w_aux = static_cast<double>(ctx.loss_scale) * N;
  std::vector<float> per_expert(E);
  for (int e = 0; e < E; ++e)
    per_expert[e] = static_cast<float>(w_aux * config_.balance_coef * E * s.counts[e] / double(N * k) / N);
  Tensor dp = ctx.tensor({N, E}), dlogits = ctx.tensor({N, E}), part = ctx.tensor(x.shape());
  ctx.ops.routing_grad(s.top_idx, dv, per_expert, dp);
  ctx.ops.softmax_rows_backward(s.probs, dp, dlogits);
  router_.backward(ctx, x, dlogits, &part);
  ctx.ops.accumulate(dx, part, 1.0f);
}

}  // namespace k2c::model
