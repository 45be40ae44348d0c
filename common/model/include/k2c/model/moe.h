// k2c/model/moe.h — a mixture-of-experts feed-forward layer: a softmax router picks top_k of
// `experts` SwiGLU experts per token, plus shared experts that every token passes through.
//
//   forward:  logits = x·W_routerᵀ → probs = softmax → top-k (weights renormalised to sum 1)
//             → permute (rows grouped by expert, stable) → each expert's SwiGLU on its rows
//             → combine: y[n] = Σ_j w[n, j] · expert_out[row of (n, j)] → + shared experts
//   loss:     a Switch-style balance term coef · E · Σ_e f_e · P_e, where f_e is the fraction of
//             the N·k assignments that went to expert e and P_e the mean router probability of e
//
// The stages are separate functions of the layer (route, permute, experts, combine) because the
// expert-parallel module puts an all-to-all between them: its ranks route, send each expert's
// rows to the rank that holds it, run their experts, and send the results back to combine.
// Expert weights are stacked per kind: gate and up [E, F, d], down [E, d, F].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k2c/model/layers.h"

namespace k2c::model {

struct MoeConfig {
  int d_model = 0, experts = 0, top_k = 1;
  std::int64_t d_expert = 0;
  int shared_experts = 0;         // each of width d_expert
  bool normalize_top_k = true;    // combine weights = top-k probabilities / their sum
  float balance_coef = 0.01f;
};

// Where each token's top_k assignments went: the plan that permute and combine follow.
struct Routing {
  int tokens = 0, top_k = 0, experts = 0;
  std::vector<std::int32_t> expert;      // [N·k]: the expert of assignment (n, j), at n·k + j
  std::vector<std::int64_t> counts;      // [E]: rows per expert
  std::vector<std::int64_t> offsets;     // [E + 1]: first permuted row of each expert
  std::vector<std::int32_t> token_of_row;  // [N·k]: the token of each permuted row
  std::vector<std::int32_t> row_of;        // [N·k]: the permuted row of assignment (n, j)
  // Groups assignments by expert, tokens in order inside each (a stable plan: ranks that route
  // the same tokens make the same one). Throws for an expert id outside [0, experts).
  static Routing plan(const std::vector<std::int32_t>& expert, int tokens, int top_k, int experts);
};

class Moe {
 public:
  struct Saved {
    Tensor probs, top_idx, top_val;           // [N, E]; [N, k] the chosen experts (i32), their probabilities
    std::vector<std::int64_t> counts;         // [E] rows per expert, on the host
    std::vector<std::int64_t> offsets;        // [E + 1] the first row of each expert, on the host
    Tensor token_of_row, row_of, weight_of_row;  // [N·k] the plan, on the backend (Ops::route_rows)
    Tensor xp, gate, up, h, yp;               // permuted rows and the experts' activations
    Tensor x_rounded;  // xp in the activation dtype, where experts_forward was given fp32 rows
    Mlp::Saved shared;
    double balance_loss = 0;
  };

  Moe() = default;
  Moe(ParamList& params, const std::string& name, const MoeConfig& config);
  const MoeConfig& config() const { return config_; }

  // x, y: [N, d]. saved.balance_loss holds the balance term of this call.
  void forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const;
  // dx = the input gradient; the balance term's gradient is included, weighted by
  // ctx.loss_scale·N (the same weighting as the cross-entropy's grad_scale).
  void backward(Context& ctx, const Tensor& x, Saved& saved, const Tensor& dy, Tensor& dx) const;

  // ---- the stages, for an expert-parallel dispatcher
  // The router, the choice of experts, the plan (Ops::route_rows: on the backend, its counts and
  // offsets on the host) and the balance term.
  void route(Context& ctx, const Tensor& x, Saved& saved) const;
  // The experts' forward on rows already grouped by expert: rows [offsets[e], offsets[e+1]) of
  // xp go through expert first_expert + e. yp gets the outputs, in fp32; xp may be fp32 or bf16,
  // and the experts store their activations in ctx.activations (fp32 rows rounded on the way in).
  void experts_forward(Context& ctx, const std::vector<std::int64_t>& offsets, int first_expert,
                       const Tensor& xp, Saved& saved) const;
  void experts_backward(Context& ctx, const std::vector<std::int64_t>& offsets, int first_expert,
                        const Tensor& xp, const Saved& saved, const Tensor& dyp, Tensor& dxp) const;

 private:
  MoeConfig config_;
  Linear router_;
  ParamId gate_ = -1, up_ = -1, down_ = -1;
  Mlp shared_;
  bool has_shared_ = false;
};

}  // namespace k2c::model
