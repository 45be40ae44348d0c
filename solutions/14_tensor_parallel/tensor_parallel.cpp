// solutions/14_tensor_parallel/tensor_parallel.cpp — module 14, the reference (contract:
// assignments/14_tensor_parallel/tensor_parallel.h; lecture: lectures/14_tensor_parallel.md).
//
// Megatron-style tensor parallelism on the model library. The whole idea fits in one picture:
//
//     x ──f──► [ column-parallel ] ──► [ element-wise ] ──► [ row-parallel ] ──g──► y
//   whole        rank r's columns        rank r's columns      a partial sum         whole
//
// A column-parallel layer needs the whole input and produces a slice of the output; a row-
// parallel layer takes exactly that slice and produces a partial sum of the whole output. Put
// them back to back and nothing has to move between them: the MLP's SwiGLU and attention's heads
// act on each column (feature, head) alone. The only communication is at the two ends:
//   g: forward, the partial sums are added (all-reduce); backward, the whole dy is already on
//      every rank, so the identity;
//   f: forward, the identity (x is already whole everywhere); backward, each rank's dx is only
//      its columns' contribution, so the sum (all-reduce).
// Two all-reduces forward (one g per sub-layer) and two backward (one f per sub-layer) per block.
//
// Version 1 (this file) adds one idea beyond the picture: in backward, f's all-reduce is started
// as soon as dx is computed, and the weight gradients, which do not depend on it, are computed
// while it travels. On NCCL the all-reduce runs on the communicator's stream next to the GEMMs.
//
// Everything on tensors goes through ctx.ops (the CPU backend on MPI ranks, the GPU backend on
// NCCL): this file never touches an element of an activation or a weight.
#include "tensor_parallel.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace k2c::tensor_parallel {

using model::Category;
using model::DType;
using model::Shape;
using model::ShardOf;

namespace {

// ---------------------------------------------------------------------------------------------
// helpers

// This rank's share of a size cut over the group, or the error the contract asks for. Checked
// before anything is registered, so a failed constructor leaves the ParamList as it was.
std::int64_t share_of(const std::string& what, std::int64_t size, int n) {
  if (size <= 0 || size % n != 0)
    throw std::invalid_argument(what + " = " + std::to_string(size) +
                                " is not divisible by the tensor-parallel size " + std::to_string(n));
  return size / n;
}

// `init` as the block at `offset` of a weight of shape `full`: Init::shard makes each element
// start as the element of the unsharded weight it stands for, so rank r's block is bit for bit
// the slice one process would hold.
Init as_shard(Init init, Shape full, std::int64_t row, std::int64_t col) {
  init.shard = ShardOf{full, {row, col, 0, 0}};
  return init;
}

void all_reduce_sum(Communicator& tp, Tensor& t) {
  tp.all_reduce(t.raw(), t.raw(), static_cast<std::size_t>(t.numel()), dist::DType::f32, dist::ReduceOp::sum);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// f and g

dist::Ticket f_backward(Communicator& tp, Tensor& dx) {
  // Started, not blocking: the caller has weight gradients to compute that do not read dx.
  return tp.start_all_reduce(dx.raw(), dx.raw(), static_cast<std::size_t>(dx.numel()), dist::DType::f32,
                             dist::ReduceOp::sum);
}

void g_forward(Communicator& tp, Tensor& y) {
  // Blocking: the next layer (a residual add, a norm) reads y at once, so there is nothing to
  // overlap it with inside the block.
  all_reduce_sum(tp, y);
}

// ---------------------------------------------------------------------------------------------
// ColumnParallelLinear

ColumnParallelLinear::ColumnParallelLinear(Communicator& tp, ParamList& params, const std::string& name,
                                           std::int64_t in, std::int64_t out, Init init)
    : tp_(&tp), in_(in), out_(out), local_out_(share_of(name + ": out", out, tp.size())) {
  // Rows of W are output features: rank r keeps rows [r·out/n, (r+1)·out/n).
  w_ = params.add(name + ".weight", {local_out_, in}, as_shard(init, {out, in}, tp.rank() * local_out_, 0));
}

void ColumnParallelLinear::forward(Context& ctx, const Tensor& x, Tensor& y) const {
  // Each output element is the same dot product over all `in` features as in the unsharded
  // layer, summed in the same order: this forward is bit-exact against one process.
  ctx.ops.matmul(x, false, ctx.params.value(w_), true, y, 1.0f, 0.0f);
}

void ColumnParallelLinear::backward_input(Context& ctx, const Tensor& dy, Tensor& dx, bool accumulate) const {
  ctx.ops.matmul(dy, false, ctx.params.value(w_), false, dx, 1.0f, accumulate ? 1.0f : 0.0f);
}

void ColumnParallelLinear::backward_weight(Context& ctx, const Tensor& x, const Tensor& dy) const {
  // Rank r's rows of dW need only its own columns of dy and the whole x: no communication.
  if (ctx.trains(w_)) ctx.ops.matmul(dy, true, x, false, ctx.params.grad(w_), 1.0f, 1.0f);
  ctx.params.grad_done(w_);
}

void ColumnParallelLinear::backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const {
  if (!dx) {
    backward_weight(ctx, x, dy);
    return;
  }
  backward_input(ctx, dy, *dx, false);
  const dist::Ticket sum = f_backward(*tp_, *dx);  // dx travels ...
  backward_weight(ctx, x, dy);                     // ... while dW is computed
  tp_->wait(sum);
}

// ---------------------------------------------------------------------------------------------
// RowParallelLinear

RowParallelLinear::RowParallelLinear(Communicator& tp, ParamList& params, const std::string& name,
                                     std::int64_t in, std::int64_t out, Init init)
    : tp_(&tp), in_(in), out_(out), local_in_(share_of(name + ": in", in, tp.size())) {
  // Columns of W are input features: rank r keeps columns [r·in/n, (r+1)·in/n), the features
  // the column-parallel layer before it produced on this rank.
  w_ = params.add(name + ".weight", {out, local_in_}, as_shard(init, {out, in}, 0, tp.rank() * local_in_));
}

void RowParallelLinear::forward(Context& ctx, const Tensor& x, Tensor& y) const {
  // y = Σ_r x_r·W_rᵀ: this rank's term, then the sum (g). The ranks add in another order than
  // one process's single dot product does, so y agrees with it within rounding, not in bits;
  // the all-reduce gives every rank the same bits.
  ctx.ops.matmul(x, false, ctx.params.value(w_), true, y, 1.0f, 0.0f);
  g_forward(*tp_, y);
}

void RowParallelLinear::backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const {
  // g's backward is the identity: dy is whole on every rank, and both gradients below need only
  // this rank's slice of x and of W.
  if (ctx.trains(w_)) ctx.ops.matmul(dy, true, x, false, ctx.params.grad(w_), 1.0f, 1.0f);
  if (dx) ctx.ops.matmul(dy, false, ctx.params.value(w_), false, *dx, 1.0f, 0.0f);
  ctx.params.grad_done(w_);
}

// ---------------------------------------------------------------------------------------------
// ParallelMlp

ParallelMlp::ParallelMlp(Communicator& tp, ParamList& params, const std::string& name, std::int64_t d_model,
                         std::int64_t d_ff)
    : tp_(&tp) {
  share_of(name + ": d_ff", d_ff, tp.size());  // one clear message before any weight is registered
  gate_ = ColumnParallelLinear(tp, params, name + ".gate", d_model, d_ff);
  up_ = ColumnParallelLinear(tp, params, name + ".up", d_model, d_ff);
  down_ = RowParallelLinear(tp, params, name + ".down", d_ff, d_model);
}

void ParallelMlp::forward(Context& ctx, const Tensor& x, Tensor& y, Saved& s) const {
  const std::int64_t N = x.dim(0), f = gate_.local_out();
  s.gate = ctx.tensor({N, f});
  s.up = ctx.tensor({N, f});
  s.h = ctx.tensor({N, f});
  // f forward: the identity, x is whole here already.
  gate_.forward(ctx, x, s.gate);
  up_.forward(ctx, x, s.up);
  ctx.ops.swiglu_forward(s.gate, s.up, s.h);  // feature by feature: rank r's d_ff/n features alone
  down_.forward(ctx, s.h, y);                 // partial sums, then g: all-reduce 1 of 1
}

void ParallelMlp::backward(Context& ctx, const Tensor& x, const Saved& s, const Tensor& dy, Tensor& dx) const {
  Tensor dh = ctx.tensor(s.h.shape()), dgate = ctx.tensor(s.gate.shape()), dup = ctx.tensor(s.up.shape());
  down_.backward(ctx, s.h, dy, &dh);  // g backward: dy is whole, nothing to exchange
  ctx.ops.swiglu_backward(s.gate, s.up, dh, dgate, dup);
  // gate and up read the same x, so their input gradients add before f: one all-reduce, not two.
  up_.backward_input(ctx, dup, dx, false);
  gate_.backward_input(ctx, dgate, dx, true);
  const dist::Ticket sum = f_backward(*tp_, dx);
  // Two weight-gradient GEMMs (2·N·d·d_ff/n FLOPs each) to hide N·d·4 bytes behind.
  up_.backward_weight(ctx, x, dup);
  gate_.backward_weight(ctx, x, dgate);
  tp_->wait(sum);
}

// ---------------------------------------------------------------------------------------------
// ParallelAttention

ParallelAttention::ParallelAttention(Communicator& tp, ParamList& params, const std::string& name,
                                     const model::AttentionConfig& c)
    : tp_(&tp), config_(c) {
  if (c.q_heads < 1 || c.kv_heads < 1 || c.q_heads % c.kv_heads || c.d_model % c.q_heads || c.head_dim() % 2)
    throw std::invalid_argument("attention '" + name + "': d_model " + std::to_string(c.d_model) + ", q_heads " +
                                std::to_string(c.q_heads) + ", kv_heads " + std::to_string(c.kv_heads) +
                                " (q_heads must divide d_model into even head sizes, kv_heads q_heads)");
  // Whole heads per rank: a head split across ranks would need its scores summed over them. With
  // both counts divisible by n, rank r's query heads read exactly rank r's key-value heads.
  share_of(name + ": q_heads", c.q_heads, tp.size());
  share_of(name + ": kv_heads", c.kv_heads, tp.size());
  const std::int64_t d = c.d_model, kv = static_cast<std::int64_t>(c.kv_heads) * c.head_dim();
  wq_ = ColumnParallelLinear(tp, params, name + ".wq", d, d);
  wk_ = ColumnParallelLinear(tp, params, name + ".wk", d, kv);
  wv_ = ColumnParallelLinear(tp, params, name + ".wv", d, kv);
  wo_ = RowParallelLinear(tp, params, name + ".wo", d, d);
}

void ParallelAttention::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
                                Saved& s) const {
  const int hq = local_q_heads(), hkv = local_kv_heads(), hd = config_.head_dim();
  const std::int64_t N = x.dim(0), T = positions.numel();
  s.q = ctx.tensor({N, static_cast<std::int64_t>(hq) * hd});
  s.k = ctx.tensor({N, static_cast<std::int64_t>(hkv) * hd});
  s.v = ctx.tensor({N, static_cast<std::int64_t>(hkv) * hd});
  s.o = ctx.tensor({N, static_cast<std::int64_t>(hq) * hd});
  s.lse = ctx.tensor({batch, hq, T});
  wq_.forward(ctx, x, s.q);
  wk_.forward(ctx, x, s.k);
  wv_.forward(ctx, x, s.v);
  // RoPE rotates each head by position alone, and attention never mixes heads: the local heads
  // are a complete attention problem of their own.
  ctx.ops.rope(s.q, positions, hq, hd, config_.rope_theta, false);
  ctx.ops.rope(s.k, positions, hkv, hd, config_.rope_theta, false);
  ctx.ops.attention_forward(model::AttentionShape::causal_self(batch, T, hq, hkv, hd), s.q, s.k, s.v, s.o, s.lse);
  wo_.forward(ctx, s.o, y);  // the heads' partial outputs, then g: all-reduce 1 of 1
}

void ParallelAttention::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& s,
                                 const Tensor& dy, Tensor& dx) const {
  const int hq = local_q_heads(), hkv = local_kv_heads(), hd = config_.head_dim();
  Tensor dout = ctx.tensor(s.o.shape()), dq = ctx.tensor(s.q.shape()), dk = ctx.tensor(s.k.shape()),
         dv = ctx.tensor(s.v.shape());
  wo_.backward(ctx, s.o, dy, &dout);
  const auto shape = model::AttentionShape::causal_self(batch, positions.numel(), hq, hkv, hd);
  // dk and dv written, not added into (attention_backward adds, for a ring): nothing to zero first.
  ctx.ops.attention_backward_overwrite(shape, s.q, s.k, s.v, s.o, s.lse, dout, dq, dk, dv);
  ctx.ops.rope(dq, positions, hq, hd, config_.rope_theta, true);  // a rotation's transpose is its inverse
  ctx.ops.rope(dk, positions, hkv, hd, config_.rope_theta, true);
  // q, k and v were all computed from x: their input gradients add, then one f for the three.
  wv_.backward_input(ctx, dv, dx, false);
  wk_.backward_input(ctx, dk, dx, true);
  wq_.backward_input(ctx, dq, dx, true);
  const dist::Ticket sum = f_backward(*tp_, dx);
  wv_.backward_weight(ctx, x, dv);
  wk_.backward_weight(ctx, x, dk);
  wq_.backward_weight(ctx, x, dq);
  tp_->wait(sum);
}

// ---------------------------------------------------------------------------------------------
// ParallelBlock

ParallelBlock::ParallelBlock(Communicator& tp, ParamList& params, const std::string& name,
                             const model::BlockConfig& c) {
  if (c.moe.experts > 0)
    throw std::invalid_argument("parallel block '" + name + "': a mixture of experts (" +
                                std::to_string(c.moe.experts) + " experts) is not tensor-parallel here");
  share_of(name + ".mlp: d_ff", c.d_ff, tp.size());
  share_of(name + ".attn: q_heads", c.attention.q_heads, tp.size());
  share_of(name + ".attn: kv_heads", c.attention.kv_heads, tp.size());
  // The norms are small ([d_model]) and sit where activations are whole: every rank keeps all of
  // each and does the same work, which costs less than any exchange would.
  norm1_ = model::RmsNorm(params, name + ".norm1", c.attention.d_model, c.norm_eps);
  norm2_ = model::RmsNorm(params, name + ".norm2", c.attention.d_model, c.norm_eps);
  attn_ = ParallelAttention(tp, params, name + ".attn", c.attention);
  mlp_ = ParallelMlp(tp, params, name + ".mlp", c.attention.d_model, c.d_ff);
}

void ParallelBlock::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
                            Saved& s) const {
  if (ctx.dropout > 0)
    throw std::invalid_argument("parallel block: dropout " + std::to_string(ctx.dropout) + " is not supported");
  const Shape shape = x.shape();
  s.n1 = ctx.tensor(shape);
  s.h = ctx.tensor(shape);
  s.n2 = ctx.tensor(shape);
  s.attn_out = ctx.tensor(shape);
  s.mlp_out = ctx.tensor(shape);
  norm1_.forward(ctx, x, s.n1, s.norm1);
  attn_.forward(ctx, s.n1, positions, batch, s.attn_out, s.attn);
  ctx.ops.add(x, s.attn_out, s.h);
  norm2_.forward(ctx, s.h, s.n2, s.norm2);
  mlp_.forward(ctx, s.n2, s.mlp_out, s.mlp);
  ctx.ops.add(s.h, s.mlp_out, y);
}

void ParallelBlock::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& s,
                             const Tensor& dy, Tensor& dx) const {
  const Shape shape = x.shape();
  Tensor dn = ctx.tensor(shape), dh = ctx.tensor(shape);
  // y = h + mlp(norm2(h)): dn and dh come out whole (the MLP's f summed them).
  mlp_.backward(ctx, s.n2, s.mlp, dy, dn);
  norm2_.backward(ctx, s.h, s.norm2, dn, dh);
  ctx.ops.accumulate(dh, dy, 1.0f);
  // h = x + attn(norm1(x))
  attn_.backward(ctx, s.n1, positions, batch, s.attn, dh, dn);
  norm1_.backward(ctx, x, s.norm1, dn, dx);
  ctx.ops.accumulate(dx, dh, 1.0f);
}

// ---------------------------------------------------------------------------------------------
// VocabParallelEmbedding

VocabParallelEmbedding::VocabParallelEmbedding(Communicator& tp, ParamList& params, const std::string& name,
                                               std::int64_t vocab, std::int64_t dim, Init init)
    : tp_(&tp), vocab_(vocab), dim_(dim) {
  const std::int64_t rows = share_of(name + ": vocab", vocab, tp.size());
  begin_ = tp.rank() * rows;
  end_ = begin_ + rows;
  w_ = params.add(name + ".weight", {rows, dim}, as_shard(init, {vocab, dim}, begin_, 0));
}

void VocabParallelEmbedding::forward(Context& ctx, const Tensor& ids, Tensor& out, Saved& saved) const {
  // The ids are N integers and Ops has no integer arithmetic: shift and mask them on the host.
  const std::int64_t N = ids.numel();
  out.expect({N, dim_}, "vocab-parallel embedding output");
  std::vector<std::int32_t> host(static_cast<std::size_t>(N)), local(host.size());
  std::vector<float> mask(host.size());
  ctx.ops.download(host.data(), ids);
  for (std::size_t i = 0; i < host.size(); ++i) {
    const std::int64_t id = host[i];
    if (id < 0 || id >= vocab_)
      throw std::out_of_range("vocab-parallel embedding: id " + std::to_string(id) + " outside [0, " +
                              std::to_string(vocab_) + ")");
    const bool mine = id >= begin_ && id < end_;
    local[i] = mine ? static_cast<std::int32_t>(id - begin_) : 0;  // any valid row: masked below
    mask[i] = mine ? 1.0f : 0.0f;
  }
  saved.local_ids = ctx.tensor({N}, Category::activations, DType::i32);
  saved.mask = ctx.tensor({N});
  ctx.ops.upload(saved.local_ids, local.data());
  ctx.ops.upload(saved.mask, mask.data());
  ctx.ops.embedding_forward(saved.local_ids, ctx.params.value(w_), out);
  ctx.ops.scale_rows(out, saved.mask);  // rows that another rank owns become zero ...
  all_reduce_sum(*tp_, out);            // ... so the sum is exactly the owner's row (x + 0 = x)
}

void VocabParallelEmbedding::backward(Context& ctx, const Saved& saved, const Tensor& dout) const {
  // dout is whole on every rank; each rank takes the rows of its own ids. A masked row adds zero
  // into row 0 of the shard, which changes nothing.
  if (ctx.trains(w_)) {
    Tensor mine = ctx.tensor(dout.shape());
    ctx.ops.copy(mine, dout);
    ctx.ops.scale_rows(mine, saved.mask);
    ctx.ops.embedding_backward(saved.local_ids, mine, ctx.params.grad(w_));
  }
  ctx.params.grad_done(w_);
}

// ---------------------------------------------------------------------------------------------
// vocab_parallel_cross_entropy
//
// loss_i = lse_i − z_i,t with lse_i = log Σ_j exp(z_ij) over the WHOLE vocabulary. With the
// columns cut over the ranks, write M_i for the global row maximum and s_ri = Σ_{j in r} exp(z_ij −
// M_i) for rank r's part of the sum: lse_i = M_i + log Σ_r s_ri. So three all-reduces of N numbers
// replace gathering N·V logits: max of the local maxima, sum of the target logits (one rank holds
// each), sum of the s_ri. The gradient softmax − onehot is then local, since exp(z_ij − lse_i) =
// p_ij · s_ri / S_i, where p is rank r's local softmax and S_i = Σ_r s_ri.
//
// Ops has no element-wise exp or log, so the O(N) per-row arithmetic runs on the host; everything
// O(N·V/n) stays in ops. s_ri comes out of the local softmax: at the local maximum m_ri the local
// softmax is exp(0)/Σ_j exp(z_ij − m_ri), so s_ri = exp(m_ri − M_i) / max_j p_ij.

double vocab_parallel_cross_entropy(Communicator& tp, Context& ctx, const Tensor& logits, const Tensor& targets,
                                    float grad_scale, Tensor& dlogits) {
  model::Ops& ops = ctx.ops;
  const std::int64_t N = logits.dim(0), Vr = logits.dim(1), V = Vr * tp.size(), begin = Vr * tp.rank();
  targets.expect({N}, "vocab-parallel cross-entropy targets", DType::i32);
  dlogits.expect(logits.shape(), "vocab-parallel cross-entropy gradient");
  if (N * Vr > INT32_MAX)  // the gather below addresses logits as N·Vr rows with i32 indices
    throw std::invalid_argument("vocab-parallel cross-entropy: " + std::to_string(N) + " rows of " +
                                std::to_string(Vr) + " logits exceed i32 row indices");

  // Targets on the host: where each row's target sits in this rank's columns, if it does.
  std::vector<std::int32_t> target(static_cast<std::size_t>(N)), at(target.size());
  std::vector<float> mine(target.size());
  ops.download(target.data(), targets);
  std::vector<std::int32_t> my_rows;  // flat indices i·Vr + (t_i − begin) of the targets held here
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int64_t t = target[i];
    if (t < -1 || t >= V)
      throw std::out_of_range("vocab-parallel cross-entropy: target " + std::to_string(t) + " outside [0, " +
                              std::to_string(V) + ")");
    const bool here = t >= begin && t < begin + Vr;
    at[i] = static_cast<std::int32_t>(i * Vr + (here ? t - begin : 0));
    mine[i] = here ? 1.0f : 0.0f;
    if (here) my_rows.push_back(at[i]);
  }

  // 1. Row maxima over the whole vocabulary.
  Tensor arg = ctx.tensor({N, 1}, Category::activations, DType::i32), local_max = ctx.tensor({N, 1}),
         row_max = ctx.tensor({N, 1});
  ops.top_k(logits, 1, arg, local_max);
  ops.copy(row_max, local_max);
  tp.all_reduce(row_max.raw(), row_max.raw(), static_cast<std::size_t>(N), dist::DType::f32, dist::ReduceOp::max);

  // 2. Target logits: the logits seen as N·Vr rows of one element, one gathered per row, zero
  //    where another rank holds the target.
  Tensor at_t = ctx.tensor({N}, Category::activations, DType::i32), mine_t = ctx.tensor({N}),
         target_logit = ctx.tensor({N, 1});
  ops.upload(at_t, at.data());
  ops.upload(mine_t, mine.data());
  ops.gather_rows(logits.reshaped({N * Vr, 1}), at_t, target_logit);
  ops.scale_rows(target_logit, mine_t);
  all_reduce_sum(tp, target_logit);

  // 3. Sums of exponentials against the global maximum. The local softmax goes straight into
  //    dlogits, which it becomes after one scaling per row.
  Tensor p_max = ctx.tensor({N, 1});
  ops.softmax_rows(logits, dlogits);
  ops.top_k(dlogits, 1, arg, p_max);
  std::vector<float> m_local(target.size()), m_all(target.size()), pm(target.size()), s(target.size());
  ops.download(m_local.data(), local_max);
  ops.download(m_all.data(), row_max);
  ops.download(pm.data(), p_max);
  for (std::size_t i = 0; i < s.size(); ++i)
    s[i] = static_cast<float>(std::exp(static_cast<double>(m_local[i]) - m_all[i]) / pm[i]);
  Tensor sums = ctx.tensor({N});
  ops.upload(sums, s.data());
  all_reduce_sum(tp, sums);

  // 4. The loss, the same on every rank (every input to it was all-reduced), and the row scales.
  std::vector<float> S(target.size()), zt(target.size()), scale(target.size());
  ops.download(S.data(), sums);
  ops.download(zt.data(), target_logit);
  double total = 0;
  for (std::size_t i = 0; i < S.size(); ++i) {
    if (target[i] < 0) {
      scale[i] = 0.0f;  // an ignored row: zero loss, zero gradient
      continue;
    }
    total += static_cast<double>(m_all[i]) + std::log(static_cast<double>(S[i])) - zt[i];
    scale[i] = grad_scale * (s[i] / S[i]);
  }

  // 5. dlogits = grad_scale·(p·s/S − onehot), on this rank's columns only.
  Tensor scale_t = ctx.tensor({N});
  ops.upload(scale_t, scale.data());
  ops.scale_rows(dlogits, scale_t);
  if (!my_rows.empty()) {
    const std::int64_t R = static_cast<std::int64_t>(my_rows.size());
    Tensor rows = ctx.tensor({R}, Category::activations, DType::i32), minus = ctx.tensor({R, 1});
    ops.upload(rows, my_rows.data());
    ops.fill(minus, -grad_scale);
    Tensor flat = dlogits.reshaped({N * Vr, 1});
    ops.scatter_add_rows(minus, rows, nullptr, flat);
  }
  return total;
}

}  // namespace k2c::tensor_parallel
