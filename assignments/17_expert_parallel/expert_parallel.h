// assignments/17_expert_parallel/expert_parallel.h — the contract of module 17 (do not edit).
//
// Expert parallelism for the model library's mixture-of-experts layer (k2c/model/moe.h), in the
// manner of Megatron-LM: the E experts are cut across the ranks of an expert-parallel group
// (`ep`, n = ep.size() ranks, this one r = ep.rank()), rank r holding whole experts
// [r·E/n, (r+1)·E/n) (L = E/n of them), and the ranks see DIFFERENT tokens, as data-parallel
// ranks do. Each token's rows travel to the ranks that hold its experts and back:
//
//   route        the router (whole on every rank) picks top_k experts per token, as model::Moe
//   plan         per expert, how many rows this rank sends (after the capacity), exchanged with
//                the group so that every rank knows how many rows it will receive
//   dispatch     this rank's rows to the experts' ranks (all-to-all-v); a rank's rows for its own
//                experts never enter the collective
//   experts      each rank's local experts on the rows it received, grouped by expert
//   combine      the experts' outputs back to the tokens' ranks (all-to-all-v), summed with the
//                router's weights; the shared expert, computed locally, added
// and backward the same exchanges in reverse.
//
// Shapes: x, y [N, d] (this rank's N tokens, d = d_model); k = top_k; F = d_expert. A token's k
// choices are its "assignments" (n·k + j is choice j of token n). The plan orders this rank's kept
// assignments by expert, and by token inside an expert: "plan order", K rows. The experts' input
// on rank r holds R rows grouped by local expert, and inside an expert by sending rank, and by
// token inside that: for ranks that hold consecutive slices of one batch, global token order.
//
// Capacity. With capacity C >= 0, this rank keeps, for each expert, its first C assignments to
// that expert in token order and drops the rest: a dropped assignment contributes nothing to y
// (the residual connection carries the token) and gets no gradient. C < 0: nothing is dropped.
// The layer's C comes from its capacity factor: expert_capacity() below.
//
// Communication, all on `ep` and on the tensors' raw() pointers (host memory on MPI, device
// memory on NCCL: the counts travel in small tensors of ctx, never in host vectors):
//   plan_exchange   exactly one all_to_all of L int32 per rank (4·E bytes counted)
//   to_experts / dispatch / from_experts / combine
//                   all_to_all_v of fp32 rows, each started with start_all_to_all_v and waited
//                   in the same call, as many as you like; this rank's rows for its own experts
//                   never travel, so together they count exactly 4·d·(rows to other ranks) bytes
//                   (to_experts, dispatch) or 4·d·(rows received from other ranks) (from_experts,
//                   combine), and nothing else
//   forward         one all_reduce (sum) of 2E + 1 floats: the group's assignments per expert,
//                   the sums of router probabilities per expert, the rows dropped; plus the above
//   backward        only to_experts and from_experts (dy's rows out, dx's rows back)
//   reduce_gradients  below
// The `meanwhile` function given to the exchanges runs after the rows were handed to the
// collectives and before they are waited on: local work that hides the transfer (the shared
// expert, the router's backward).
//
// Use the model library's ops (ctx.ops: gather_rows, scatter_add_rows, scale_rows, row_dot,
// softmax_rows, top_k, ...) and layers (model::Linear, model::Mlp, model::Moe's stages) for every
// computation on tensors; never read or write tensor elements yourself. Host code may handle the
// routing's integers and per-token numbers (N·k or N·E of them) through ops.upload and ops.download.
//
// Tests: autograder/17_expert_parallel/test_expert_parallel.cpp and test_expert_parallel_grid.cpp. Lecture: lectures/17_expert_parallel.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "k2c/dist/communicator.h"
#include "k2c/model/moe.h"

namespace k2c::expert_parallel {

using dist::Communicator;
using model::Context;
using model::MoeConfig;
using model::ParamId;
using model::ParamList;
using model::Routing;
using model::Tensor;

// ---- given: the capacity rule (the tests use it too)

// C = ceil(capacity_factor · N·k / E): the capacity factor times the mean number of this rank's
// assignments per expert, so an expert receives at most n·C rows from the group. A factor <= 0
// means no capacity (−1).
inline std::int64_t expert_capacity(double capacity_factor, std::int64_t tokens, int top_k, int experts) {
  if (capacity_factor <= 0) return -1;
  return static_cast<std::int64_t>(std::ceil(capacity_factor * static_cast<double>(tokens * top_k) / experts));
}

// ---- the plan of one exchange

struct Plan {
  int ranks = 1, rank = 0;               // n and r of the group
  int experts = 0, local_experts = 0;    // E and L = E/n; rank r holds experts [r·L, (r+1)·L)
  int top_k = 1;
  std::int64_t tokens = 0;               // N, this rank's tokens
  std::int64_t capacity = -1;            // C (−1: none)

  // This rank as a sender.
  std::vector<std::int64_t> kept;        // [E]: this rank's assignments to expert e after the capacity
  std::vector<std::int64_t> begin;       // [E + 1]: prefix sums of kept, so expert e's rows are
                                         //   [begin[e], begin[e+1]) in plan order
  std::int64_t dropped = 0;              // this rank's assignments over the capacity
  Tensor token;                          // i32 [K]: the token of each row, in plan order
  Tensor weight;                         // f32 [K]: its combine weight (the router's, after top-k)

  // This rank as a receiver, after the counts exchange.
  std::vector<std::int64_t> from;        // [n·L]: rows rank s sends to local expert l, at s·L + l
                                         //   (for s = r: kept[r·L + l])
  std::vector<std::int64_t> offsets;     // [L + 1]: local expert l's rows in the experts' input
                                         //   are [offsets[l], offsets[l+1]); inside them, rank s's
                                         //   rows come after those of ranks 0 .. s−1

  std::int64_t rows() const { return begin.empty() ? 0 : begin.back(); }           // K
  std::int64_t expert_rows() const { return offsets.empty() ? 0 : offsets.back(); }  // R
  // Rows that cross a link in each direction: this rank's rows for other ranks' experts, and the
  // rows other ranks send to this rank's experts.
  std::int64_t rows_out() const {
    std::int64_t s = 0;
    for (int e = 0; e < experts; ++e)
      if (e / local_experts != rank) s += kept[e];
    return s;
  }
  std::int64_t rows_in() const {
    std::int64_t s = 0;
    for (int q = 0; q < ranks; ++q) {
      if (q == rank) continue;
      for (int l = 0; l < local_experts; ++l) s += from[q * local_experts + l];
    }
    return s;
  }
};

// Plans the exchange of this rank's routing (routing.tokens tokens, routing.top_k choices each,
// routing.experts experts; model::Routing::plan makes it) with weights[n·k + j], the combine
// weight of assignment (n, j), and capacity C (see the top; −1: none). Fills every field above,
// with one all_to_all over `ep` for `from`. Throws std::invalid_argument, before communicating,
// when E is not divisible by n (naming both) or weights.size() != N·k.
Plan plan_exchange(Communicator& ep, Context& ctx, const Routing& routing, const std::vector<float>& weights,
                   std::int64_t capacity);

// ---- the exchanges (rows are fp32 [·, d])

// rows [K, d] in plan order → expert_rows [R, d], grouped as the plan's offsets say. Row i of
// `rows` lands on the rank that holds its expert; this rank's own rows are copied locally.
void to_experts(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& rows, Tensor& expert_rows,
                const std::function<void()>& meanwhile = {});
// The reverse: expert_rows [R, d] → rows [K, d] in plan order, each row back on the rank and at
// the place it came from.
void from_experts(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& expert_rows, Tensor& rows,
                  const std::function<void()>& meanwhile = {});

// The forward pair, what the speed test times. dispatch: expert_in [R, d] = the rows of x [N, d]
// of this rank's kept assignments and of the other ranks' for this rank's experts, grouped (the
// experts' input: to_experts of x's rows in plan order). combine: returned [K, d] = from_experts
// of expert_out [R, d], and y [N, d] += weight·row for every row (y is not cleared: the caller
// puts the shared expert's output there first, or zeros).
void dispatch(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& x, Tensor& expert_in,
              const std::function<void()>& meanwhile = {});
void combine(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& expert_out, Tensor& returned, Tensor& y,
             const std::function<void()>& meanwhile = {});

// ---- the layer

// model::Moe with its experts cut over `ep`. Parameters, registered in model::Moe's order and
// under its names, so that each rank starts from exactly its part of the weights one process
// would make: `name`.router.weight [E, d] whole; `name`.experts.gate.weight and .up.weight
// [L, F, d] and .down.weight [L, d, F], the slices [r·L, (r+1)·L) of model::Moe's stacked [E, F, d]
// and [E, d, F] weights (Init::shard, normal, std 0.02); `name`.shared (a model::Mlp of width
// F·shared_experts) whole, if shared_experts > 0.
//
// Forward as model::Moe::forward computes it for this rank's tokens, with three differences:
// the experts run where they live; the capacity (C = expert_capacity(capacity_factor, N, k, E))
// drops assignments; and the balance term is the group's, coef·E·Σ_e f_e·P_e with f_e and P_e
// over every token of the ep group (what one process holding all of them would compute), the
// same on every rank and added to ctx.aux_loss. Backward as model::Moe::backward, with the
// balance gradient weighted by ctx.loss_scale·(the group's tokens), the drops' gradients zero;
// gradients of the router and the shared expert cover this rank's tokens only (reduce_gradients
// sums them). Layers call ctx.params.grad_done(id) after adding into a weight's gradient.
class ExpertParallelMoe {
 public:
  struct Saved {
    Tensor probs;                       // [N, E]: the router's softmax
    std::vector<float> top_val;         // [N·k]: the chosen probabilities, best first
    std::vector<float> weights;         // [N·k]: the combine weights
    Routing routing;                    // this rank's routing, before the capacity
    Plan plan;
    model::Moe::Saved experts;          // xp, gate, up, h, yp: the rows this rank's experts ran
    Tensor returned;                    // [K, d]: the experts' outputs, back in plan order
    model::Mlp::Saved shared;
    Tensor shared_out;                  // [N, d], if there is a shared expert
    std::vector<std::int64_t> counts;   // [E]: the group's assignments per expert (before capacity)
    std::int64_t group_tokens = 0;      // tokens over the group
    std::int64_t dropped = 0;           // this rank's dropped assignments
    std::int64_t group_dropped = 0;     // the group's
    double balance_loss = 0;            // the group's balance term
  };

  ExpertParallelMoe() = default;
  // Throws std::invalid_argument, before registering anything, for a configuration model::Moe
  // refuses or when E is not divisible by n (the message names E and n).
  ExpertParallelMoe(Communicator& ep, ParamList& params, const std::string& name, const MoeConfig& config,
                    double capacity_factor = 0);
  // x, y [N, d].
  void forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const;
  // dy, dx [N, d]; dx is overwritten.
  void backward(Context& ctx, const Tensor& x, Saved& saved, const Tensor& dy, Tensor& dx) const;

  const MoeConfig& config() const { return config_; }
  double capacity_factor() const { return capacity_factor_; }
  int local_experts() const { return local_; }
  int first_expert() const { return first_; }
  // The router and the shared expert's three weights (gate, up, down), held whole by every rank.
  const std::vector<ParamId>& dense_params() const { return dense_; }
  // This rank's expert shards: gate, up, down.
  std::vector<ParamId> expert_params() const { return {gate_, up_, down_}; }

 private:
  Communicator* ep_ = nullptr;
  MoeConfig config_;
  double capacity_factor_ = 0;
  int local_ = 0, first_ = 0;
  model::Linear router_;
  ParamId gate_ = -1, up_ = -1, down_ = -1;
  model::Mlp shared_;
  bool has_shared_ = false;
  std::vector<ParamId> dense_;  // filled by the constructor: what dense_params() returns
};

// After a backward: sums the dense parameters' gradients over `dense` (the data-and-expert group,
// dp × ep, whose ranks all saw different tokens) and the expert shards' over `expert_dp` (the
// ranks that hold the same experts: dp), one blocking all_reduce (sum) per trainable parameter,
// dense first, in dense_params() / expert_params() order. A group of one rank is skipped.
void reduce_gradients(Communicator& dense, Communicator& expert_dp, Context& ctx, const ExpertParallelMoe& moe);

}  // namespace k2c::expert_parallel
