// layers.cpp — see k2c/model/layers.h.
#include "k2c/model/layers.h"

#include <cmath>
#include <stdexcept>
#include <vector>

namespace k2c::model {

// ---------------------------------------------------------------------------------------------
// Linear

Linear::Linear(ParamList& params, const std::string& name, std::int64_t in, std::int64_t out, Init init)
    : w_(params.add(name + ".weight", {out, in}, init)), in_(in), out_(out) {}

Linear Linear::tied(ParamList& params, ParamId weight) {
  Linear l;
  l.w_ = params.share(weight);
  l.out_ = params.info(weight).shape[0];
  l.in_ = params.info(weight).shape[1];
  return l;
}

void check_residual(DType residual, float dropout, const std::string& who) {
  if (residual != DType::f32 && residual != DType::bf16)
    throw std::invalid_argument(who + ": the residual stream is f32 or bf16, not " + to_string(residual));
  if (residual == DType::bf16 && dropout > 0)
    throw std::invalid_argument(who + ": a bf16 residual stream needs dropout 0 (dropout runs on fp32 only), got " +
                                std::to_string(dropout));
}

void Linear::forward(Context& ctx, const Tensor& x, Tensor& y) const {
  ctx.ops.matmul(x, false, ctx.params.value(w_), true, y, 1.0f, 0.0f);
}

void Linear::backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const {
  ctx.ops.linear_backward(x, ctx.params.value(w_), dy, ctx.trains(w_) ? &ctx.params.grad(w_) : nullptr, dx);
  ctx.params.grad_done(w_);
}

void Linear::forward_shared(Context& ctx, const Tensor& x, std::initializer_list<const Linear*> layers,
                            std::initializer_list<Tensor*> ys) {
  std::vector<const Tensor*> ws;
  for (const Linear* l : layers) ws.push_back(&ctx.params.value(l->w_));
  ctx.ops.shared_linear_forward(x, ws, std::span<Tensor* const>(ys.begin(), ys.size()));
}

void Linear::backward_shared(Context& ctx, const Tensor& x, std::initializer_list<const Linear*> layers,
                             std::initializer_list<const Tensor*> dys, Tensor* dx) {
  std::vector<const Tensor*> ws;
  std::vector<Tensor*> dws;
  for (const Linear* l : layers) {
    ws.push_back(&ctx.params.value(l->w_));
    dws.push_back(ctx.trains(l->w_) ? &ctx.params.grad(l->w_) : nullptr);
  }
  ctx.ops.shared_linear_backward(x, ws, std::span<const Tensor* const>(dys.begin(), dys.size()), dws, dx);
  for (const Linear* l : layers) ctx.params.grad_done(l->w_);  // in the order given, as one backward each would
}

// ---------------------------------------------------------------------------------------------
// Embedding

Embedding::Embedding(ParamList& params, const std::string& name, std::int64_t vocab, std::int64_t dim, Init init)
    : w_(params.add(name + ".weight", {vocab, dim}, init)), vocab_(vocab), dim_(dim) {}

// The lookup and its gradient take fp32 rows (ops.h); a bf16 residual stream passes them through
// one copy that rounds (forward) or widens (backward), once a step.
void Embedding::forward(Context& ctx, const Tensor& ids, Tensor& out) const {
  if (out.dtype() == DType::f32) return ctx.ops.embedding_forward(ids, ctx.params.value(w_), out);
  Tensor rows = ctx.tensor(out.shape());
  ctx.ops.embedding_forward(ids, ctx.params.value(w_), rows);
  ctx.ops.copy(out, rows);
}

void Embedding::backward(Context& ctx, const Tensor& ids, const Tensor& dout) const {
  if (ctx.trains(w_)) {
    if (dout.dtype() == DType::f32) {
      ctx.ops.embedding_backward(ids, dout, ctx.params.grad(w_));
    } else {
      Tensor wide = ctx.tensor(dout.shape());
      ctx.ops.copy(wide, dout);
      ctx.ops.embedding_backward(ids, wide, ctx.params.grad(w_));
    }
  }
  ctx.params.grad_done(w_);
}

// ---------------------------------------------------------------------------------------------
// RmsNorm

RmsNorm::RmsNorm(ParamList& params, const std::string& name, std::int64_t dim, float eps)
    : g_(params.add(name + ".weight", {dim}, {Init::ones})), dim_(dim), eps_(eps) {}

void RmsNorm::forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const {
  saved.rstd = ctx.tensor({x.numel() / dim_});
  ctx.ops.rmsnorm_forward(x, ctx.params.value(g_), eps_, y, saved.rstd);
}

void RmsNorm::backward(Context& ctx, const Tensor& x, const Saved& saved, const Tensor& dy, Tensor& dx,
                       const Tensor* residual_dy) const {
  Tensor scratch;  // the backend always writes dgamma; a frozen one's is dropped
  if (!ctx.trains(g_)) {
    scratch = ctx.tensor({dim_});
    ctx.ops.fill(scratch, 0.0f);
  }
  Tensor& dgamma = ctx.trains(g_) ? ctx.params.grad(g_) : scratch;
  if (residual_dy)
    ctx.ops.rmsnorm_backward_add(x, ctx.params.value(g_), saved.rstd, dy, *residual_dy, dx, dgamma);
  else
    ctx.ops.rmsnorm_backward(x, ctx.params.value(g_), saved.rstd, dy, dx, dgamma);
  ctx.params.grad_done(g_);
}

// ---------------------------------------------------------------------------------------------
// Attention

Attention::Attention(ParamList& params, const std::string& name, const AttentionConfig& c) : config_(c) {
  if (c.q_heads < 1 || c.kv_heads < 1 || c.q_heads % c.kv_heads || c.d_model % c.q_heads ||
      c.head_dim() % 2)
    throw std::invalid_argument("attention '" + name + "': d_model " + std::to_string(c.d_model) +
                                ", q_heads " + std::to_string(c.q_heads) + ", kv_heads " +
                                std::to_string(c.kv_heads) +
                                " (q_heads must divide d_model into even head sizes, kv_heads q_heads)");
  const std::int64_t kv = static_cast<std::int64_t>(c.kv_heads) * c.head_dim();
  wq_ = Linear(params, name + ".wq", c.d_model, c.d_model);
  wk_ = Linear(params, name + ".wk", c.d_model, kv);
  wv_ = Linear(params, name + ".wv", c.d_model, kv);
  wo_ = Linear(params, name + ".wo", c.d_model, c.d_model);
}

namespace {
AttentionShape shape_of(const AttentionConfig& c, int batch, std::int64_t T) {
  return AttentionShape::causal_self(batch, T, c.q_heads, c.kv_heads, c.head_dim());
}
}  // namespace

void Attention::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
                        Saved& s) const {
  const std::int64_t N = x.dim(0), kv = static_cast<std::int64_t>(config_.kv_heads) * config_.head_dim();
  s.q = ctx.activation({N, config_.d_model});
  s.k = ctx.activation({N, kv});
  s.v = ctx.activation({N, kv});
  s.o = ctx.activation({N, config_.d_model});
  s.lse = ctx.tensor({batch, config_.q_heads, positions.numel()});
  Linear::forward_shared(ctx, x, {&wq_, &wk_, &wv_}, {&s.q, &s.k, &s.v});
  ctx.ops.rope(s.q, positions, config_.q_heads, config_.head_dim(), config_.rope_theta, false);
  ctx.ops.rope(s.k, positions, config_.kv_heads, config_.head_dim(), config_.rope_theta, false);
  ctx.ops.attention_forward(shape_of(config_, batch, positions.numel()), s.q, s.k, s.v, s.o, s.lse);
  wo_.forward(ctx, s.o, y);
}

void Attention::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& s,
                         const Tensor& dy, Tensor& dx) const {
  Tensor dout = ctx.activation(s.o.shape()), dq = ctx.activation(s.q.shape()), dk = ctx.activation(s.k.shape()),
         dv = ctx.activation(s.v.shape());
  wo_.backward(ctx, s.o, dy, &dout);
  ctx.ops.attention_backward_overwrite(shape_of(config_, batch, positions.numel()), s.q, s.k, s.v, s.o, s.lse, dout,
                                       dq, dk, dv);
  // Through RoPE: the rotation's transpose is its inverse.
  ctx.ops.rope(dq, positions, config_.q_heads, config_.head_dim(), config_.rope_theta, true);
  ctx.ops.rope(dk, positions, config_.kv_heads, config_.head_dim(), config_.rope_theta, true);
  // The projections saw x before RoPE; x is the same for all three, so their input gradients add.
  Linear::backward_shared(ctx, x, {&wv_, &wk_, &wq_}, {&dv, &dk, &dq}, &dx);
}

// ---------------------------------------------------------------------------------------------
// Mlp

Mlp::Mlp(ParamList& params, const std::string& name, std::int64_t d_model, std::int64_t d_ff)
    : gate_(params, name + ".gate", d_model, d_ff), up_(params, name + ".up", d_model, d_ff),
      down_(params, name + ".down", d_ff, d_model) {}

void Mlp::forward(Context& ctx, const Tensor& x, Tensor& y, Saved& s) const {
  const std::int64_t N = x.dim(0);
  s.gate = ctx.activation({N, gate_.out()});
  s.up = ctx.activation({N, up_.out()});
  s.h = ctx.activation({N, up_.out()});
  Linear::forward_shared(ctx, x, {&gate_, &up_}, {&s.gate, &s.up});
  ctx.ops.swiglu_forward(s.gate, s.up, s.h);
  down_.forward(ctx, s.h, y);
}

void Mlp::backward(Context& ctx, const Tensor& x, const Saved& s, const Tensor& dy, Tensor& dx) const {
  Tensor dh = ctx.activation(s.h.shape()), dgate = ctx.activation(s.gate.shape()), dup = ctx.activation(s.up.shape());
  down_.backward(ctx, s.h, dy, &dh);
  ctx.ops.swiglu_backward(s.gate, s.up, dh, dgate, dup);
  Linear::backward_shared(ctx, x, {&up_, &gate_}, {&dup, &dgate}, &dx);
}

}  // namespace k2c::model
