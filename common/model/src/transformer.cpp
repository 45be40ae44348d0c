// transformer.cpp — see k2c/model/transformer.h.
#include "k2c/model/transformer.h"

#include <cstdio>
#include <numeric>
#include <stdexcept>

namespace k2c::model {

void ModelConfig::check() const {
  auto bad = [](const std::string& what) { throw std::invalid_argument("model config: " + what); };
  if (vocab < 2) bad("vocab must be at least 2");
  if (d_model < 2 || n_layers < 0 || seq_len < 1 || d_ff < 1) bad("sizes must be positive");
  if (q_heads < 1 || kv_heads < 1 || q_heads % kv_heads) bad("q_heads must be a multiple of kv_heads");
  if (d_model % q_heads || (d_model / q_heads) % 2) bad("d_model / q_heads must be a whole, even head size");
  if (experts < 0 || (experts > 0 && (top_k < 1 || top_k > experts || d_expert < 1 || shared_experts < 0)))
    bad("experts need 1 <= top_k <= experts, d_expert >= 1 and shared_experts >= 0");
}

std::int64_t ModelConfig::parameter_count() const {
  const std::int64_t d = d_model, hd = d_model / q_heads, kv = static_cast<std::int64_t>(kv_heads) * hd;
  const std::int64_t ffn = experts > 0 ? d * experts + 3 * d * d_expert * (experts + shared_experts) : 3 * d * d_ff;
  const std::int64_t block = 2 * d + d * d * 2 + 2 * d * kv + ffn;
  return static_cast<std::int64_t>(vocab) * d * (tied_head ? 1 : 2) + n_layers * block + d;
}

double ModelConfig::train_flops_per_token() const {
  const double d = d_model, hd = static_cast<double>(d_model) / q_heads, kv = kv_heads * hd;
  const double ffn = experts > 0 ? d * experts + 3 * d * static_cast<double>(d_expert) * (top_k + shared_experts)
                                 : 3 * d * static_cast<double>(d_ff);
  const double matrices = n_layers * (2 * d * d + 2 * d * kv + ffn) +
                          static_cast<double>(vocab) * d;  // the head; the embedding is a lookup
  return 6.0 * matrices + 12.0 * n_layers * d * seq_len;
}

std::string ModelConfig::describe() const {
  char ffn[96], s[256];
  if (experts > 0)
    std::snprintf(ffn, sizeof ffn, "%d experts of %lld (top %d, %d shared)", experts,
                  static_cast<long long>(d_expert), top_k, shared_experts);
  else
    std::snprintf(ffn, sizeof ffn, "ff %lld", static_cast<long long>(d_ff));
  std::snprintf(s, sizeof s, "d %d, %d layers, %d heads (%d kv), %s, vocab %d, T %d: %.2f M parameters",
                d_model, n_layers, q_heads, kv_heads, ffn, vocab, seq_len, parameter_count() / 1e6);
  return s;
}

ModelConfig ModelConfig::tiny() { return {}; }

ModelConfig ModelConfig::dense_135m() {
  ModelConfig c;
  c.vocab = 32768;
  c.d_model = 768;
  c.n_layers = 12;
  c.q_heads = 12;
  c.kv_heads = 12;
  c.d_ff = 2048;
  c.seq_len = 1024;
  return c;
}

Transformer::Transformer(ParamList& params, const ModelConfig& config) : config_(config) {
  config.check();
  // Each layer's parameters are the ids registered while it is built.
  auto layer = [&](auto&& build) {
    const ParamId first = params.size();
    build();
    layer_params_.push_back({first, params.size()});
  };
  const Init emb{Init::normal, config.init_std};
  layer([&] { embed_ = Embedding(params, "embed", config.vocab, config.d_model, emb); });
  BlockConfig bc;
  bc.attention = {config.d_model, config.q_heads, config.kv_heads, config.rope_theta};
  bc.d_ff = config.d_ff;
  bc.norm_eps = config.norm_eps;
  bc.moe = {config.d_model, config.experts, config.top_k, config.d_expert, config.shared_experts, true,
            config.balance_coef};
  for (int i = 0; i < config.n_layers; ++i)
    layer([&] { blocks_.emplace_back(params, "blocks." + std::to_string(i), bc, i); });
  layer([&] { final_norm_ = RmsNorm(params, "final_norm", config.d_model, config.norm_eps); });
  layer([&] {
    head_ = config.tied_head ? Linear::tied(params, embed_.weight())
                             : Linear(params, "head", config.d_model, config.vocab, emb);
  });
}

Transformer::LayerParams Transformer::layer_params(int l) const { return layer_params_.at(static_cast<std::size_t>(l)); }

std::vector<int> Transformer::layer_uses(int l) const {
  if (l < 0 || l >= layer_count())
    throw std::out_of_range("transformer: layer " + std::to_string(l) + " of " + std::to_string(layer_count()));
  if (config_.tied_head && l == layer_count() - 1) return {0, l};
  return {l};
}

void Transformer::forward(Context& ctx, const Tensor& ids, int batch, bool checkpoint, Saved& s) const {
  const std::int64_t T = config_.seq_len, N = static_cast<std::int64_t>(batch) * T;
  if (batch < 1 || ids.numel() != N)
    throw std::invalid_argument("transformer: ids hold " + std::to_string(ids.numel()) +
                                " tokens, expected batch " + std::to_string(batch) + " x T " +
                                std::to_string(T));
  check_residual(ctx.residual, ctx.dropout, "transformer");  // a Context made by hand, too
  s.positions = ctx.tensor({T}, Category::activations, DType::i32);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T));
  std::iota(pos.begin(), pos.end(), 0);
  ctx.ops.upload(s.positions, pos.data());
  const int L = static_cast<int>(blocks_.size());
  s.x0 = ctx.residual_stream({N, config_.d_model});
  event(ctx, 0, LayerEvent::before_forward);
  embed_.forward(ctx, ids, s.x0);
  event(ctx, 0, LayerEvent::after_forward);
  s.blocks.clear();
  s.blocks.resize(blocks_.size());
  const Tensor* x = &s.x0;
  for (int i = 0; i < L; ++i) {
    event(ctx, i + 1, LayerEvent::before_forward);
    blocks_[i].forward(ctx, *x, s.positions, batch, checkpoint, s.blocks[i]);
    event(ctx, i + 1, LayerEvent::after_forward);
    x = &s.blocks[i].out;
  }
  s.xf = ctx.activation({N, config_.d_model});
  event(ctx, L + 1, LayerEvent::before_forward);
  final_norm_.forward(ctx, *x, s.xf, s.final_norm);
  event(ctx, L + 1, LayerEvent::after_forward);
  s.logits = ctx.activation({N, config_.vocab});
  event(ctx, L + 2, LayerEvent::before_forward);
  head_.forward(ctx, s.xf, s.logits);
  event(ctx, L + 2, LayerEvent::after_forward);
}

double Transformer::train_step(Context& ctx, const Tensor& ids, const Tensor& targets, int batch,
                               float grad_scale, bool checkpoint) const {
  Saved s;
  ctx.loss_scale = grad_scale;
  ctx.aux_loss = 0;
  forward(ctx, ids, batch, checkpoint, s);
  const std::int64_t N = s.logits.dim(0), d = config_.d_model;
  Tensor dlogits = ctx.activation(s.logits.shape());
  const double loss = ctx.ops.cross_entropy(s.logits, targets, grad_scale, dlogits);  // may refuse a target
  s.logits = Tensor();  // the logits are the largest activation: gone as soon as possible
  BackwardPass pass(ctx.params);
  const int L = static_cast<int>(blocks_.size());
  Tensor dx = ctx.residual_stream({N, d}), dprev = ctx.residual_stream({N, d});
  {
    Tensor dxf = ctx.activation({N, d});
    event(ctx, L + 2, LayerEvent::before_backward);
    head_.backward(ctx, s.xf, dlogits, &dxf);
    event(ctx, L + 2, LayerEvent::after_backward);
    const Tensor& last = blocks_.empty() ? s.x0 : s.blocks.back().out;
    event(ctx, L + 1, LayerEvent::before_backward);
    final_norm_.backward(ctx, last, s.final_norm, dxf, dx);
    event(ctx, L + 1, LayerEvent::after_backward);
  }
  for (int i = L; i-- > 0;) {
    const Tensor& input = i == 0 ? s.x0 : s.blocks[i - 1].out;
    event(ctx, i + 1, LayerEvent::before_backward);
    blocks_[i].backward(ctx, input, s.positions, batch, s.blocks[i], dx, dprev);
    event(ctx, i + 1, LayerEvent::after_backward);
    std::swap(dx, dprev);
    s.blocks[i].out = Tensor();  // the next block down no longer needs this block's output
  }
  event(ctx, 0, LayerEvent::before_backward);
  embed_.backward(ctx, ids, dx);
  event(ctx, 0, LayerEvent::after_backward);
  pass.finish();
  return loss;
}

double Transformer::evaluate(Context& ctx, const Tensor& ids, const Tensor& targets, int batch) const {
  Saved s;
  const float dropout = ctx.dropout;
  const double aux = ctx.aux_loss;  // an evaluation adds nothing to the training step's terms
  ctx.dropout = 0.0f;
  forward(ctx, ids, batch, true, s);
  ctx.dropout = dropout;
  ctx.aux_loss = aux;
  Tensor scratch = ctx.activation(s.logits.shape());
  return ctx.ops.cross_entropy(s.logits, targets, 0.0f, scratch);
}

}  // namespace k2c::model
