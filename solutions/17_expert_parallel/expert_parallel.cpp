// solutions/17_expert_parallel/expert_parallel.cpp — module 17, the reference (contract:
// assignments/17_expert_parallel/expert_parallel.h; lecture: lectures/17_expert_parallel.md).
//
// Expert parallelism on the model library's MoE layer. One picture for rank r of n, each rank
// holding L = E/n whole experts and its own tokens:
//
//   x ─route─► plan ─gather─► rows in plan order ══ all-to-all-v ══► experts' input (grouped)
//                                                                        │ L SwiGLU GEMMs
//   y ◄─Σ w·row─ returned, plan order ◄══ all-to-all-v ══════════ experts' output
//
// The router is small and whole on every rank; what travels are the rows of the token-choices,
// d numbers each, to the rank of their expert and back. Nothing here is specific to the experts'
// arithmetic (the library's experts_forward runs it): this file is the bookkeeping that makes an
// irregular exchange a pair of all-to-all-v calls, and the reverse of both for backward.
//
// Version 1 would send every kept row through one all-to-all-v and then sort the received rows
// by expert (they arrive grouped by sender). This version adds three ideas:
//   - the exchange runs in L pieces, one per local-expert slot l: piece l moves the rows of
//     experts l, L + l, 2L + l, ... and each receiver names, per sender, where in its experts'
//     input those rows belong, so the received rows land grouped by expert: the sort is free;
//   - a rank's rows for its own experts (1/n of them under uniform routing) never enter the
//     collective: they are copied locally while the others travel;
//   - in the forward pair, piece l + 1 is gathered while piece l travels, and the rows of piece l
//     are summed into y while the later pieces travel, so little of the local work is exposed.
//
// Everything on tensors goes through ctx.ops (the CPU backend on MPI ranks, the GPU backend on
// NCCL); the host sees only the routing's integers and per-token numbers.
#include "expert_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace k2c::expert_parallel {

using model::Category;
using model::DType;
using model::ShardOf;

namespace {

// ---------------------------------------------------------------------------------------------
// helpers

void require_divisible(const std::string& what, int experts, int n) {
  if (experts < 1 || experts % n != 0)
    throw std::invalid_argument(what + ": " + std::to_string(experts) + " experts do not split evenly over " +
                                std::to_string(n) + " expert-parallel ranks");
}

// Entries [begin, begin + count) of a one-dimensional tensor (token ids, weights), as a view.
Tensor entries(const Tensor& t, std::int64_t begin, std::int64_t count) {
  return Tensor::view(static_cast<char*>(t.raw()) + begin * model::dtype_size(t.dtype()), {count}, t.dtype());
}

// Where rank s's rows for local expert l start in the experts' input: after the rows of all
// earlier local experts and of ranks 0 .. s−1 for this one.
std::int64_t input_row(const Plan& p, int l, int s) {
  std::int64_t at = p.offsets[l];
  for (int q = 0; q < s; ++q) at += p.from[q * p.local_experts + l];
  return at;
}

// ---------------------------------------------------------------------------------------------
// the exchanges
//
// Piece l of an exchange moves, between every pair of ranks q → q', the rows of q's tokens for
// expert q'·L + l. On the token side they sit at begin[e] in plan order (contiguous: plan order is
// by expert); on the expert side at input_row(l, q). Both sides know both numbers after the plan,
// so the counts and offsets of an all_to_all_v (elements, d per row) are all local arithmetic.

enum class Way { to_experts, back };

dist::Ticket start_piece(Communicator& ep, const Plan& p, int l, Way way, const Tensor& src, Tensor& dst) {
  const int n = p.ranks, L = p.local_experts;
  const std::size_t d = static_cast<std::size_t>(src.dim(1));
  std::vector<std::size_t> plan_count(n, 0), plan_at(n, 0), input_count(n, 0), input_at(n, 0);
  for (int q = 0; q < n; ++q) {
    if (q == p.rank) continue;  // our own rows stay home (copy_own): zero bytes on the link
    const int e = q * L + l;    // the expert of piece l on rank q
    plan_count[q] = static_cast<std::size_t>(p.kept[e]) * d;
    plan_at[q] = static_cast<std::size_t>(p.begin[e]) * d;
    input_count[q] = static_cast<std::size_t>(p.from[q * L + l]) * d;
    input_at[q] = static_cast<std::size_t>(input_row(p, l, q)) * d;
  }
  if (way == Way::to_experts)
    return ep.start_all_to_all_v(src.raw(), plan_count, plan_at, dst.raw(), input_count, input_at, dist::DType::f32);
  return ep.start_all_to_all_v(src.raw(), input_count, input_at, dst.raw(), plan_count, plan_at, dist::DType::f32);
}

// This rank's rows for its own expert l: at begin[r·L + l] in plan order, at input_row(l, r) in
// the experts' input. The pieces in flight write other rows of the same tensor, so the copy may
// run alongside them.
void copy_own(Context& ctx, const Plan& p, int l, Way way, const Tensor& src, Tensor& dst) {
  const int e = p.rank * p.local_experts + l;
  const std::int64_t count = p.kept[e], plan_row = p.begin[e], input = input_row(p, l, p.rank);
  if (count == 0) return;
  Tensor to = dst.rows(way == Way::to_experts ? input : plan_row, count);
  ctx.ops.copy(to, src.rows(way == Way::to_experts ? plan_row : input, count));
}

// y[token] += weight · row for plan rows [begin, begin + count).
void add_rows(Context& ctx, const Plan& p, const Tensor& returned, Tensor& y, std::int64_t begin, std::int64_t count) {
  if (count == 0) return;
  const Tensor scale = entries(p.weight, begin, count);
  ctx.ops.scatter_add_rows(returned.rows(begin, count), entries(p.token, begin, count), &scale, y);
}

void expect_rows(const Tensor& t, std::int64_t rows, std::int64_t d, const char* what) { t.expect({rows, d}, what); }

// ---------------------------------------------------------------------------------------------
// the local experts, through the library's grouped GEMMs
//
// model::Moe::experts_forward and experts_backward run the SwiGLU experts on rows grouped by
// expert, reading stacked weights through a ParamList by id. Our shards are exactly such stacked
// weights for L experts. So a Moe of L experts, registered in a ParamList of its own that is
// materialized without storage and whose expert views are bound to our shards (values, and
// gradients where they train), runs them unchanged: its gradients land in ours. Cheap enough to
// build per call (a few names and pointers). A library hook letting model::Moe register a slice
// of its experts would make this adapter unnecessary.
class LocalExperts {
 public:
  LocalExperts(Context& ctx, const MoeConfig& c, int local, const std::vector<ParamId>& shards)
      : moe_(list_, "local", local_config(c, local)), view_{ctx.ops, ctx.ledger, list_} {
    const char* kinds[3] = {"local.experts.gate.weight", "local.experts.up.weight", "local.experts.down.weight"};
    ParamId theirs[3] = {-1, -1, -1};
    for (ParamId id = 0; id < list_.size(); ++id)
      for (int i = 0; i < 3; ++i)
        if (list_.info(id).name == kinds[i]) theirs[i] = id;
    for (int i = 0; i < 3; ++i)
      if (!ctx.trains(shards[i])) list_.freeze(theirs[i]);  // a frozen shard takes no gradient here either
    view_.activations = ctx.activations;  // the experts store their activations in the run's dtype
    list_.materialize(ctx.ops, ctx.ledger, 0, {.values = false, .grads = false});
    for (int i = 0; i < 3; ++i) {
      list_.bind_value(theirs[i], ctx.params.value(shards[i]).f32());
      if (ctx.trains(shards[i])) list_.bind_grad(theirs[i], ctx.params.grad(shards[i]).f32());
    }
  }
  void forward(const std::vector<std::int64_t>& offsets, const Tensor& xp, model::Moe::Saved& s) {
    moe_.experts_forward(view_, offsets, 0, xp, s);
  }
  void backward(const std::vector<std::int64_t>& offsets, const Tensor& xp, const model::Moe::Saved& s,
                const Tensor& dyp, Tensor& dxp) {
    list_.begin_backward();  // experts_backward reports its three weights done to this list
    moe_.experts_backward(view_, offsets, 0, xp, s, dyp, dxp);
  }

 private:
  static MoeConfig local_config(MoeConfig c, int local) {
    c.experts = local;
    c.top_k = 1;
    c.shared_experts = 0;
    return c;
  }
  ParamList list_;
  model::Moe moe_;
  Context view_;
};

// ---------------------------------------------------------------------------------------------
// the group's load and the router's gradient

// f_e and P_e of the balance term, and the drops, over every token of the group: each rank adds
// its assignments per expert, its sum of router probabilities per expert and its drops into one
// vector, and one all-reduce of 2E + 1 numbers gives everyone the group's. Counts travel as
// floats: exact up to 2^24 assignments.
void group_load(Communicator& ep, Context& ctx, const MoeConfig& c, ExpertParallelMoe::Saved& s) {
  const int E = c.experts, k = c.top_k;
  const std::int64_t N = s.routing.tokens;
  std::vector<float> probs(static_cast<std::size_t>(N) * E), load(2 * E + 1, 0.0f);
  if (N > 0) ctx.ops.download(probs.data(), s.probs);
  for (int e = 0; e < E; ++e) {
    double p = 0;
    for (std::int64_t n = 0; n < N; ++n) p += probs[n * E + e];
    load[e] = static_cast<float>(s.routing.counts[e]);
    load[E + e] = static_cast<float>(p);
  }
  load[2 * E] = static_cast<float>(s.plan.dropped);
  Tensor t = ctx.tensor({2 * E + 1}, Category::comm);
  ctx.ops.upload(t, load.data());
  ep.all_reduce(t.raw(), t.raw(), load.size(), dist::DType::f32, dist::ReduceOp::sum);
  ctx.ops.download(load.data(), t);

  s.counts.assign(E, 0);
  std::int64_t assignments = 0;
  for (int e = 0; e < E; ++e) assignments += s.counts[e] = std::llround(load[e]);
  s.group_tokens = assignments / k;
  s.group_dropped = std::llround(load[2 * E]);
  const double T = static_cast<double>(s.group_tokens);
  double balance = 0;
  for (int e = 0; T > 0 && e < E; ++e) balance += static_cast<double>(s.counts[e]) / (T * k) * (load[E + e] / T);
  s.balance_loss = c.balance_coef * E * balance;
}

// model::Moe::backward's second half for this rank's tokens: from dw (the gradient of each kept
// row's combine weight, in plan order) back through the top-k normalisation, plus the group's
// balance term, through the softmax into the router. The arithmetic is the library's, in its
// order; what is ours is finding each assignment's row (or its absence) in the plan.
void router_backward(Context& ctx, const MoeConfig& c, const model::Linear& router, const Tensor& x,
                     const ExpertParallelMoe::Saved& s, const Tensor& dw, Tensor& dx_part) {
  const Plan& p = s.plan;
  const Routing& r = s.routing;
  const std::int64_t N = r.tokens;
  const int E = c.experts, k = c.top_k;
  std::vector<float> dw_plan(static_cast<std::size_t>(p.rows()));
  if (p.rows() > 0) ctx.ops.download(dw_plan.data(), dw);
  // Assignment a sits at routing row row_of[a], the i-th of its expert's rows; the plan kept the
  // first kept[e] of them, at begin[e] + i. A dropped one added nothing to y: its dw is 0.
  auto dw_of = [&](std::int64_t a) {
    const int e = r.expert[a];
    const std::int64_t i = r.row_of[a] - r.offsets[e];
    return i < p.kept[e] ? dw_plan[p.begin[e] + i] : 0.0f;
  };
  std::vector<float> dprobs(static_cast<std::size_t>(N) * E, 0.0f);
  for (std::int64_t n = 0; n < N; ++n) {
    const float* val = &s.top_val[n * k];
    float sum = 0, wdw = 0;
    for (int j = 0; j < k; ++j) sum += val[j];
    for (int j = 0; j < k; ++j) wdw += val[j] / sum * dw_of(n * k + j);
    for (int j = 0; j < k; ++j) {
      const float g = dw_of(n * k + j);
      // w_j = v_j / Σv  ⇒  dv_j = (dw_j − Σ_i w_i·dw_i) / Σv
      dprobs[n * E + r.expert[n * k + j]] += c.normalize_top_k ? (g - wdw) / sum : g;
    }
  }
  // The balance term coef·E·Σ_e f_e·P_e over the group's T tokens adds coef·E·f_e/T to dp of every
  // token, weighted like the loss (loss_scale per token, T tokens).
  const std::int64_t T = s.group_tokens;
  const double w_aux = static_cast<double>(ctx.loss_scale) * T;
  for (int e = 0; T > 0 && e < E; ++e) {
    const float g = static_cast<float>(w_aux * c.balance_coef * E * s.counts[e] / double(T * k) / T);
    for (std::int64_t n = 0; n < N; ++n) dprobs[n * E + e] += g;
  }
  Tensor dp = ctx.tensor({N, E}), dlogits = ctx.tensor({N, E});
  if (N > 0) ctx.ops.upload(dp, dprobs.data());
  ctx.ops.softmax_rows_backward(s.probs, dp, dlogits);
  router.backward(ctx, x, dlogits, &dx_part);
}

model::Init expert_shard(model::Shape full, int first) {
  model::Init init;  // model::Moe's kind and std: normal, 0.02
  init.shard = ShardOf{full, {first, 0, 0, 0}};
  return init;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// the plan

Plan plan_exchange(Communicator& ep, Context& ctx, const Routing& routing, const std::vector<float>& weights,
                   std::int64_t capacity) {
  const int n = ep.size(), E = routing.experts, k = routing.top_k;
  require_divisible("expert-parallel plan", E, n);
  const std::int64_t N = routing.tokens, A = N * k;
  if (static_cast<std::int64_t>(weights.size()) != A)
    throw std::invalid_argument("expert-parallel plan: " + std::to_string(weights.size()) + " weights for " +
                                std::to_string(N) + " tokens x top " + std::to_string(k));
  Plan p;
  p.ranks = n;
  p.rank = ep.rank();
  p.experts = E;
  p.local_experts = E / n;
  p.top_k = k;
  p.tokens = N;
  p.capacity = capacity < 0 ? -1 : capacity;

  // The capacity, decided here, before anything travels: the routing lists each expert's rows
  // in token order, so "the first C" are simply its first C rows.
  p.kept.assign(E, 0);
  p.begin.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    const std::int64_t wanted = routing.counts[e];
    p.kept[e] = p.capacity < 0 ? wanted : std::min(wanted, p.capacity);
    p.dropped += wanted - p.kept[e];
    p.begin[e + 1] = p.begin[e] + p.kept[e];
  }

  // Plan order is the routing's order with the dropped rows left out.
  std::vector<float> weight_of_row(static_cast<std::size_t>(A));
  for (std::int64_t a = 0; a < A; ++a) weight_of_row[routing.row_of[a]] = weights[a];
  std::vector<std::int32_t> token(static_cast<std::size_t>(p.rows()));
  std::vector<float> weight(token.size());
  for (int e = 0; e < E; ++e)
    for (std::int64_t i = 0; i < p.kept[e]; ++i) {
      const std::int64_t row = routing.offsets[e] + i;
      token[p.begin[e] + i] = routing.token_of_row[row];
      weight[p.begin[e] + i] = weight_of_row[row];
    }

  // The counts exchange. Rank q's experts are [q·L, (q+1)·L), so block q of `kept` is exactly
  // what q must learn from us: kept itself is the send buffer of an all-to-all of L counts per
  // rank, and what arrives, block s from rank s, is `from`.
  const int L = p.local_experts;
  std::vector<std::int32_t> counts(p.kept.begin(), p.kept.end());
  Tensor out = ctx.tensor({E}, Category::comm, DType::i32), in = ctx.tensor({E}, Category::comm, DType::i32);
  ctx.ops.upload(out, counts.data());
  ep.all_to_all(out.raw(), in.raw(), static_cast<std::size_t>(L), dist::DType::i32);
  ctx.ops.download(counts.data(), in);
  p.from.assign(counts.begin(), counts.end());
  p.offsets.assign(L + 1, 0);
  for (int l = 0; l < L; ++l) {
    p.offsets[l + 1] = p.offsets[l];
    for (int s = 0; s < n; ++s) p.offsets[l + 1] += p.from[s * L + l];
  }

  p.token = ctx.tensor({p.rows()}, Category::activations, DType::i32);
  p.weight = ctx.tensor({p.rows()});
  if (p.rows() > 0) {
    ctx.ops.upload(p.token, token.data());
    ctx.ops.upload(p.weight, weight.data());
  }
  return p;
}

// ---------------------------------------------------------------------------------------------
// the exchanges

void to_experts(Communicator& ep, Context& ctx, const Plan& p, const Tensor& rows, Tensor& expert_rows,
                const std::function<void()>& meanwhile) {
  const std::int64_t d = rows.dim(1);
  expect_rows(rows, p.rows(), d, "to_experts: rows in plan order");
  expect_rows(expert_rows, p.expert_rows(), d, "to_experts: the experts' rows");
  std::vector<dist::Ticket> pieces;
  for (int l = 0; l < p.local_experts; ++l) pieces.push_back(start_piece(ep, p, l, Way::to_experts, rows, expert_rows));
  for (int l = 0; l < p.local_experts; ++l) copy_own(ctx, p, l, Way::to_experts, rows, expert_rows);
  if (meanwhile) meanwhile();
  for (dist::Ticket t : pieces) ep.wait(t);
}

void from_experts(Communicator& ep, Context& ctx, const Plan& p, const Tensor& expert_rows, Tensor& rows,
                  const std::function<void()>& meanwhile) {
  const std::int64_t d = expert_rows.dim(1);
  expect_rows(expert_rows, p.expert_rows(), d, "from_experts: the experts' rows");
  expect_rows(rows, p.rows(), d, "from_experts: rows in plan order");
  std::vector<dist::Ticket> pieces;
  for (int l = 0; l < p.local_experts; ++l) pieces.push_back(start_piece(ep, p, l, Way::back, expert_rows, rows));
  for (int l = 0; l < p.local_experts; ++l) copy_own(ctx, p, l, Way::back, expert_rows, rows);
  if (meanwhile) meanwhile();
  for (dist::Ticket t : pieces) ep.wait(t);
}

void dispatch(Communicator& ep, Context& ctx, const Plan& p, const Tensor& x, Tensor& expert_in,
              const std::function<void()>& meanwhile) {
  const std::int64_t d = x.dim(1);
  const int L = p.local_experts;
  expect_rows(x, p.tokens, d, "dispatch: x");
  expect_rows(expert_in, p.expert_rows(), d, "dispatch: the experts' input");
  // The send buffer in plan order; the places of our own rows stay unused (they go straight from
  // x into expert_in below).
  Tensor rows = ctx.tensor({p.rows(), d});
  std::vector<dist::Ticket> pieces;
  for (int l = 0; l < L; ++l) {
    // Gather piece l, then start it: the gathers of pieces l + 1, ... write other rows of the
    // buffer while this one is read, so they overlap its transfer.
    for (int q = 0; q < p.ranks; ++q) {
      const int e = q * L + l;
      if (q == p.rank || p.kept[e] == 0) continue;
      Tensor to = rows.rows(p.begin[e], p.kept[e]);
      ctx.ops.gather_rows(x, entries(p.token, p.begin[e], p.kept[e]), to);
    }
    pieces.push_back(start_piece(ep, p, l, Way::to_experts, rows, expert_in));
  }
  for (int l = 0; l < L; ++l) {
    const int e = p.rank * L + l;
    if (p.kept[e] == 0) continue;
    Tensor to = expert_in.rows(input_row(p, l, p.rank), p.kept[e]);
    ctx.ops.gather_rows(x, entries(p.token, p.begin[e], p.kept[e]), to);
  }
  if (meanwhile) meanwhile();
  for (dist::Ticket t : pieces) ep.wait(t);
}

void combine(Communicator& ep, Context& ctx, const Plan& p, const Tensor& expert_out, Tensor& returned, Tensor& y,
             const std::function<void()>& meanwhile) {
  const std::int64_t d = expert_out.dim(1);
  const int L = p.local_experts;
  expect_rows(expert_out, p.expert_rows(), d, "combine: the experts' output");
  expect_rows(returned, p.rows(), d, "combine: returned rows");
  expect_rows(y, p.tokens, d, "combine: y");
  std::vector<dist::Ticket> pieces;
  for (int l = 0; l < L; ++l) pieces.push_back(start_piece(ep, p, l, Way::back, expert_out, returned));
  // Our own experts' outputs: into place (backward reads every returned row) and into y while
  // the other rows travel. They are contiguous in plan order: experts r·L .. r·L + L − 1.
  for (int l = 0; l < L; ++l) copy_own(ctx, p, l, Way::back, expert_out, returned);
  add_rows(ctx, p, returned, y, p.begin[p.rank * L], p.begin[(p.rank + 1) * L] - p.begin[p.rank * L]);
  if (meanwhile) meanwhile();
  // Piece l's rows are added as soon as piece l is in. On NCCL wait() only orders what follows
  // after the exchange, so the later pieces keep travelling under these additions.
  for (int l = 0; l < L; ++l) {
    ep.wait(pieces[l]);
    for (int q = 0; q < p.ranks; ++q)
      if (q != p.rank) add_rows(ctx, p, returned, y, p.begin[q * L + l], p.kept[q * L + l]);
  }
}

// ---------------------------------------------------------------------------------------------
// the layer

ExpertParallelMoe::ExpertParallelMoe(Communicator& ep, ParamList& params, const std::string& name,
                                     const MoeConfig& c, double capacity_factor)
    : ep_(&ep), config_(c), capacity_factor_(capacity_factor) {
  if (c.experts < 1 || c.top_k < 1 || c.top_k > c.experts || c.d_expert < 1 || c.d_model < 1 || c.shared_experts < 0)
    throw std::invalid_argument("expert-parallel moe '" + name + "': " + std::to_string(c.experts) + " experts, top " +
                                std::to_string(c.top_k) + ", width " + std::to_string(c.d_expert));
  require_divisible("expert-parallel moe '" + name + "'", c.experts, ep.size());
  local_ = c.experts / ep.size();
  first_ = ep.rank() * local_;
  const std::int64_t d = c.d_model, F = c.d_expert, E = c.experts;
  // model::Moe's order and names: each shard starts as exactly its slice of the stacked weights.
  router_ = model::Linear(params, name + ".router", d, E);
  gate_ = params.add(name + ".experts.gate.weight", {local_, F, d}, expert_shard({E, F, d}, first_));
  up_ = params.add(name + ".experts.up.weight", {local_, F, d}, expert_shard({E, F, d}, first_));
  down_ = params.add(name + ".experts.down.weight", {local_, d, F}, expert_shard({E, d, F}, first_));
  dense_ = {router_.weight()};
  has_shared_ = c.shared_experts > 0;
  if (has_shared_) {
    const ParamId before = params.size();
    shared_ = model::Mlp(params, name + ".shared", d, F * c.shared_experts);
    for (ParamId id = before; id < params.size(); ++id) dense_.push_back(id);
  }
}

void ExpertParallelMoe::forward(Context& ctx, const Tensor& x, Tensor& y, Saved& s) const {
  const std::int64_t N = x.dim(0), d = config_.d_model;
  const int E = config_.experts, k = config_.top_k;
  x.expect({N, d}, "expert-parallel moe input");
  y.expect({N, d}, "expert-parallel moe output");

  // 1. Route, as model::Moe::route does: the same ops in the same order, so each token's choices
  //    and weights are bit for bit what one process would compute for it.
  Tensor logits = ctx.tensor({N, E});
  router_.forward(ctx, x, logits);
  s.probs = ctx.tensor({N, E});
  ctx.ops.softmax_rows(logits, s.probs);
  Tensor top_idx = ctx.tensor({N, k}, Category::activations, DType::i32), top_val = ctx.tensor({N, k});
  ctx.ops.top_k(s.probs, k, top_idx, top_val);
  std::vector<std::int32_t> chosen(static_cast<std::size_t>(N) * k);
  s.top_val.assign(chosen.size(), 0.0f);
  if (N > 0) {
    ctx.ops.download(chosen.data(), top_idx);
    ctx.ops.download(s.top_val.data(), top_val);
  }
  s.routing = Routing::plan(chosen, static_cast<int>(N), k, E);
  s.weights.assign(chosen.size(), 0.0f);
  for (std::int64_t n = 0; n < N; ++n) {
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += s.top_val[n * k + j];
    for (int j = 0; j < k; ++j)
      s.weights[n * k + j] = config_.normalize_top_k ? s.top_val[n * k + j] / sum : s.top_val[n * k + j];
  }

  // 2. The plan, the group's load and the balance term.
  s.plan = plan_exchange(*ep_, ctx, s.routing, s.weights, expert_capacity(capacity_factor_, N, k, E));
  s.dropped = s.plan.dropped;
  group_load(*ep_, ctx, config_, s);
  ctx.aux_loss += s.balance_loss;

  // 3. Dispatch; the shared expert, which needs nothing from other ranks, runs while rows travel.
  s.experts.xp = ctx.tensor({s.plan.expert_rows(), d});
  dispatch(*ep_, ctx, s.plan, x, s.experts.xp, [&] {
    if (!has_shared_) return;
    s.shared_out = ctx.tensor({N, d});
    shared_.forward(ctx, x, s.shared_out, s.shared);
  });

  // 4. This rank's experts on what it received: one GEMM chain per expert over its rows.
  LocalExperts(ctx, config_, local_, expert_params()).forward(s.plan.offsets, s.experts.xp, s.experts);

  // 5. Combine into y, which starts as the shared expert's output.
  if (has_shared_) ctx.ops.copy(y, s.shared_out);
  else ctx.ops.fill(y, 0.0f);
  s.returned = ctx.tensor({s.plan.rows(), d});
  combine(*ep_, ctx, s.plan, s.experts.yp, s.returned, y);
}

void ExpertParallelMoe::backward(Context& ctx, const Tensor& x, Saved& s, const Tensor& dy, Tensor& dx) const {
  const Plan& p = s.plan;
  const std::int64_t N = x.dim(0), d = config_.d_model, K = p.rows(), R = p.expert_rows();
  dy.expect({N, d}, "expert-parallel moe dy");
  dx.expect({N, d}, "expert-parallel moe dx");

  // 1. Combine's backward, at home. y[n] += w·row gives d(row) = w·dy[n], which must reach the
  //    row's expert, and dw = dy[n]·row, which stays here for the router.
  Tensor dy_rows = ctx.tensor({K, d}), dw = ctx.tensor({K});
  if (K > 0) {
    ctx.ops.gather_rows(dy, p.token, dy_rows);
    ctx.ops.row_dot(dy_rows, s.returned, dw);
    ctx.ops.scale_rows(dy_rows, p.weight);
  }

  // 2. To the experts (the plan of forward, in the same direction). The shared expert's backward
  //    and the router's need nothing from other ranks: they run while the rows travel, and their
  //    weights' gradients are final before the exchange is waited on.
  Tensor dyp = ctx.tensor({R, d}), router_dx = ctx.tensor({N, d});
  to_experts(*ep_, ctx, p, dy_rows, dyp, [&] {
    if (has_shared_) shared_.backward(ctx, x, s.shared, dy, dx);
    else ctx.ops.fill(dx, 0.0f);
    router_backward(ctx, config_, router_, x, s, dw, router_dx);
  });

  // 3. The local experts' backward: their weights' gradients here, the rows' input gradients to
  //    go back.
  Tensor dxp = ctx.tensor({R, d});
  LocalExperts(ctx, config_, local_, expert_params()).backward(p.offsets, s.experts.xp, s.experts, dyp, dxp);
  ctx.params.grad_done(down_);
  ctx.params.grad_done(up_);
  ctx.params.grad_done(gate_);

  // 4. Back home, each token's rows summed into its input gradient (the un-permute), in the
  //    library's order: shared expert, experts' rows, router.
  Tensor dx_rows = ctx.tensor({K, d});
  from_experts(*ep_, ctx, p, dxp, dx_rows);
  if (K > 0) ctx.ops.scatter_add_rows(dx_rows, p.token, nullptr, dx);
  ctx.ops.accumulate(dx, router_dx, 1.0f);
}

// ---------------------------------------------------------------------------------------------
// gradients

void reduce_gradients(Communicator& dense, Communicator& expert_dp, Context& ctx, const ExpertParallelMoe& moe) {
  // Every rank of dense (dp × ep) computed the router's and the shared expert's gradients from its
  // own tokens: their sum is the whole batch's. An expert's rows from every rank of the ep group
  // already met on its rank; only copies of it in other data-parallel replicas remain to add.
  auto sum_over = [&](Communicator& group, const std::vector<ParamId>& ids) {
    if (group.size() == 1) return;
    for (ParamId id : ids) {
      if (!ctx.trains(id)) continue;
      Tensor& g = ctx.params.grad(id);
      group.all_reduce(g.raw(), g.raw(), static_cast<std::size_t>(g.numel()), dist::DType::f32, dist::ReduceOp::sum);
    }
  };
  sum_over(dense, moe.dense_params());
  sum_over(expert_dp, moe.expert_params());
}

}  // namespace k2c::expert_parallel
