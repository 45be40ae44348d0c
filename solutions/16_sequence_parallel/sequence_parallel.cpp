// solutions/16_sequence_parallel/sequence_parallel.cpp — module 16, the reference (contract:
// assignments/16_sequence_parallel/sequence_parallel.h; lecture: lectures/16_sequence_parallel.md).
//
// Two cuts of the activations along the tokens.
//
// Part A, sequence parallelism, finishes what tensor parallelism started. Module 14 cut every
// weight, but between the sub-layers each rank still held the whole [N, d] activation and ran the
// norms, dropouts and residual adds on all of it, n times over the group. Here those rows are cut:
//
//     x_r ─norm─► all-gather ─► [ attention, heads cut ] ─► reduce-scatter ─drop─+─► h_r ...
//   rows r      whole [N, d]       partial sums [N, d]         rows r of the sum
//
// A reduce-scatter is the first half of an all-reduce and an all-gather its second half, so the
// bytes on the wire are those of module 14's all-reduces; what changes is that everything outside
// the parallel regions, and what it keeps for backward, shrinks by n.
//
// Part B, context parallelism, cuts the tokens of attention itself. Each rank keeps its queries;
// the keys and values of every rank pass by on a ring, one block per step, and each block's partial
// result is folded into the running one through the log-sum-exp. With causal masking a rank holds
// one early and one late chunk of every sequence, so all ranks do the same work.
//
// Everything on tensors goes through ctx.ops (the CPU backend on MPI ranks, the GPU backend on
// NCCL): this file computes index lists from shapes on the host, never an element of a tensor.
#include "sequence_parallel.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace k2c::sequence_parallel {

using model::AttentionShape;
using model::Category;
using model::DType;
using model::DropoutKey;
using model::Init;
using model::Shape;
using model::ShardOf;

namespace {

// =============================================================================================
// helpers

std::size_t count_of(const Tensor& t) { return static_cast<std::size_t>(t.numel()); }

void all_reduce_sum(Communicator& c, Tensor& t) {
  c.all_reduce(t.raw(), t.raw(), count_of(t), dist::DType::f32, dist::ReduceOp::sum);
}

// This rank's share of a size cut over the group, or the contract's error. Called before any
// parameter is registered, so a refused block leaves the ParamList untouched.
std::int64_t share_of(const std::string& what, std::int64_t size, int n) {
  if (size <= 0 || size % n != 0)
    throw std::invalid_argument(what + " = " + std::to_string(size) +
                                " is not divisible by the tensor-parallel size " + std::to_string(n));
  return size / n;
}

// model::Linear's default initialisation (normal, std 0.02), as the block at (row, col) of a
// weight of shape `full`: every element starts as the one it stands for in the unsharded weight.
Init shard_init(Shape full, std::int64_t row, std::int64_t col) {
  Init init;
  init.shard = ShardOf{full, {row, col, 0, 0}};
  return init;
}

void check_attention(const std::string& name, const model::AttentionConfig& c) {
  if (c.q_heads < 1 || c.kv_heads < 1 || c.q_heads % c.kv_heads || c.d_model % c.q_heads || c.head_dim() % 2)
    throw std::invalid_argument("attention '" + name + "': d_model " + std::to_string(c.d_model) + ", q_heads " +
                                std::to_string(c.q_heads) + ", kv_heads " + std::to_string(c.kv_heads) +
                                " (q_heads must divide d_model into even head sizes, kv_heads q_heads)");
}

Tensor upload_i32(Context& ctx, const std::vector<std::int32_t>& host) {
  Tensor t = ctx.tensor({static_cast<std::int64_t>(host.size())}, Category::activations, DType::i32);
  ctx.ops.upload(t, host.data());
  return t;
}

// =============================================================================================
// Part A: the block's pieces

// Residual dropout as model::Block draws it: layer 2·index after attention, 2·index + 1 after the
// MLP, and the row offset of this rank's first row in the whole batch. Under sequence
// parallelism that offset moves by r·N/n, and the mask is exactly the unsharded mask's rows.
DropoutKey residual_key(const Context& ctx, int index, int site, std::int64_t first_row) {
  DropoutKey k;
  k.seed = ctx.seed;
  k.step = ctx.step;
  k.layer = static_cast<std::uint64_t>(2 * index + site);
  k.row_offset = ctx.row_offset + first_row;
  return k;
}

void drop(Context& ctx, const Tensor& in, int index, int site, std::int64_t first_row, Tensor& out) {
  if (ctx.dropout > 0)
    ctx.ops.dropout(in, ctx.dropout, residual_key(ctx, index, site, first_row), out);
  else if (out.raw() != in.raw())
    ctx.ops.copy(out, in);
}

// The attention and the MLP of a tensor-parallel block, on whole inputs, each ending in a partial
// sum over the ranks (what leaves the row-parallel wo and down). Whether that partial sum is then
// all-reduced (plain TP) or reduce-scattered (SP) is the caller's business: the sub-layers are
// the same in both.
struct HeadLinears {
  const model::Linear &wq, &wk, &wv, &wo;
  int q_heads, kv_heads, head_dim;
  float theta;
};

// This rank's share of the heads of `c` over a group of n: the linears are already cut to it.
HeadLinears local_heads(const model::Linear& wq, const model::Linear& wk, const model::Linear& wv,
                        const model::Linear& wo, const model::AttentionConfig& c, int n) {
  return {wq, wk, wv, wo, c.q_heads / n, c.kv_heads / n, c.head_dim(), c.rope_theta};
}

void attention_partial(Context& ctx, const HeadLinears& a, const Tensor& x, const Tensor& positions, int batch,
                       Tensor& partial, model::Attention::Saved& s) {
  const std::int64_t N = x.dim(0), T = positions.numel(), hd = a.head_dim;
  s.q = ctx.tensor({N, a.q_heads * hd});
  s.k = ctx.tensor({N, a.kv_heads * hd});
  s.v = ctx.tensor({N, a.kv_heads * hd});
  s.o = ctx.tensor({N, a.q_heads * hd});
  s.lse = ctx.tensor({batch, a.q_heads, T});
  a.wq.forward(ctx, x, s.q);
  a.wk.forward(ctx, x, s.k);
  a.wv.forward(ctx, x, s.v);
  ctx.ops.rope(s.q, positions, a.q_heads, a.head_dim, a.theta, false);
  ctx.ops.rope(s.k, positions, a.kv_heads, a.head_dim, a.theta, false);
  const auto shape = model::AttentionShape::causal_self(batch, T, a.q_heads, a.kv_heads, a.head_dim);
  ctx.ops.attention_forward(shape, s.q, s.k, s.v, s.o, s.lse);
  a.wo.forward(ctx, s.o, partial);  // this rank's heads' share of the output
}

// dy whole; dx_partial [N, d]: this rank's heads' share of the input gradient.
void attention_partial_backward(Context& ctx, const HeadLinears& a, const Tensor& x, const Tensor& positions,
                                int batch, const model::Attention::Saved& s, const Tensor& dy, Tensor& dx_partial) {
  Tensor dout = ctx.tensor(s.o.shape()), dq = ctx.tensor(s.q.shape()), dk = ctx.tensor(s.k.shape()),
         dv = ctx.tensor(s.v.shape()), part = ctx.tensor(x.shape());
  a.wo.backward(ctx, s.o, dy, &dout);
  const auto shape = model::AttentionShape::causal_self(batch, positions.numel(), a.q_heads, a.kv_heads, a.head_dim);
  // dk and dv written, not added into: nothing to zero first (a ring adds; this is one block).
  ctx.ops.attention_backward_overwrite(shape, s.q, s.k, s.v, s.o, s.lse, dout, dq, dk, dv);
  ctx.ops.rope(dq, positions, a.q_heads, a.head_dim, a.theta, true);
  ctx.ops.rope(dk, positions, a.kv_heads, a.head_dim, a.theta, true);
  // q, k and v all read x: their input gradients add before anything leaves the rank.
  a.wv.backward(ctx, x, dv, &dx_partial);
  a.wk.backward(ctx, x, dk, &part);
  ctx.ops.accumulate(dx_partial, part, 1.0f);
  a.wq.backward(ctx, x, dq, &part);
  ctx.ops.accumulate(dx_partial, part, 1.0f);
}

void mlp_partial(Context& ctx, const model::Linear& gate, const model::Linear& up, const model::Linear& down,
                 const Tensor& x, Tensor& partial, model::Mlp::Saved& s) {
  const std::int64_t N = x.dim(0), f = gate.out();
  s.gate = ctx.tensor({N, f});
  s.up = ctx.tensor({N, f});
  s.h = ctx.tensor({N, f});
  gate.forward(ctx, x, s.gate);
  up.forward(ctx, x, s.up);
  ctx.ops.swiglu_forward(s.gate, s.up, s.h);  // feature by feature: this rank's d_ff/n alone
  down.forward(ctx, s.h, partial);
}

void mlp_partial_backward(Context& ctx, const model::Linear& gate, const model::Linear& up, const model::Linear& down,
                          const Tensor& x, const model::Mlp::Saved& s, const Tensor& dy, Tensor& dx_partial) {
  Tensor dh = ctx.tensor(s.h.shape()), dgate = ctx.tensor(s.gate.shape()), dup = ctx.tensor(s.up.shape()),
         part = ctx.tensor(x.shape());
  down.backward(ctx, s.h, dy, &dh);
  ctx.ops.swiglu_backward(s.gate, s.up, dh, dgate, dup);
  up.backward(ctx, x, dup, &dx_partial);
  gate.backward(ctx, x, dgate, &part);
  ctx.ops.accumulate(dx_partial, part, 1.0f);
}

}  // namespace

// =============================================================================================
// Part A: the collectives on rows

void all_gather_rows(Communicator& tp, const Tensor& shard, Tensor& whole) {
  if (whole.rank() != 2 || shard.rank() != 2 || whole.dim(1) != shard.dim(1) ||
      whole.dim(0) != shard.dim(0) * tp.size())
    throw std::invalid_argument("all_gather_rows: shard " + shard.shape().str() + " and whole " + whole.shape().str() +
                                " on " + std::to_string(tp.size()) + " ranks");
  // Rank q's block lands at offset q·count: exactly rows [q·M, (q+1)·M) of a row-major matrix.
  tp.all_gather(shard.raw(), whole.raw(), count_of(shard), dist::DType::f32);
}

void reduce_scatter_rows(Communicator& tp, const Tensor& partial, Tensor& shard) {
  if (partial.rank() != 2 || shard.rank() != 2 || partial.dim(1) != shard.dim(1) ||
      partial.dim(0) != shard.dim(0) * tp.size())
    throw std::invalid_argument("reduce_scatter_rows: partial " + partial.shape().str() + " and shard " +
                                shard.shape().str() + " on " + std::to_string(tp.size()) + " ranks");
  tp.reduce_scatter(partial.raw(), shard.raw(), count_of(shard), dist::DType::f32, dist::ReduceOp::sum);
}

// =============================================================================================
// Part A: the block

SequenceParallelBlock::SequenceParallelBlock(Communicator& tp, ParamList& params, const std::string& name,
                                             const model::BlockConfig& c, int index, bool sequence_parallel)
    : tp_(&tp), config_(c), index_(index), sequence_parallel_(sequence_parallel) {
  const int n = tp.size(), r = tp.rank();
  const model::AttentionConfig& a = c.attention;
  if (c.moe.experts > 0)
    throw std::invalid_argument("sequence-parallel block '" + name + "': a mixture of experts (" +
                                std::to_string(c.moe.experts) + " experts) is not supported");
  check_attention(name + ".attn", a);
  // Every check before the first registration.
  const std::int64_t f = share_of(name + ".mlp: d_ff", c.d_ff, n);
  const std::int64_t hq = share_of(name + ".attn: q_heads", a.q_heads, n);
  const std::int64_t hkv = share_of(name + ".attn: kv_heads", a.kv_heads, n);
  const std::int64_t d = a.d_model, hd = a.head_dim(), kv = static_cast<std::int64_t>(a.kv_heads) * hd;

  // The norms act on d features of each token: a token's row needs no other rank, so the weights
  // stay whole on every rank whichever way the rows are cut.
  norm1_ = model::RmsNorm(params, name + ".norm1", d, c.norm_eps);
  norm2_ = model::RmsNorm(params, name + ".norm2", d, c.norm_eps);
  // Column-parallel by whole heads (output rows of W), row-parallel wo (input columns).
  wq_ = model::Linear(params, name + ".attn.wq", d, hq * hd, shard_init({d, d}, r * hq * hd, 0));
  wk_ = model::Linear(params, name + ".attn.wk", d, hkv * hd, shard_init({kv, d}, r * hkv * hd, 0));
  wv_ = model::Linear(params, name + ".attn.wv", d, hkv * hd, shard_init({kv, d}, r * hkv * hd, 0));
  wo_ = model::Linear(params, name + ".attn.wo", hq * hd, d, shard_init({d, d}, 0, r * hq * hd));
  gate_ = model::Linear(params, name + ".mlp.gate", d, f, shard_init({c.d_ff, d}, r * f, 0));
  up_ = model::Linear(params, name + ".mlp.up", d, f, shard_init({c.d_ff, d}, r * f, 0));
  down_ = model::Linear(params, name + ".mlp.down", f, d, shard_init({d, c.d_ff}, 0, r * f));
}

namespace {

// How many rows of the whole activation this rank's x stands for, and where its own rows start.
struct Rows {
  std::int64_t whole, mine, first;
};

Rows rows_of(const Communicator& tp, bool sp, const Tensor& x, const Tensor& positions, int batch) {
  const std::int64_t N = static_cast<std::int64_t>(batch) * positions.numel(), n = tp.size();
  if (sp && N != n * x.dim(0))
    throw std::invalid_argument("sequence-parallel block: batch·T = " + std::to_string(N) + " tokens cannot be " +
                                std::to_string(x.dim(0)) + " rows on each of " + std::to_string(n) +
                                " ranks (batch·T must be n times the rows of x)");
  if (!sp && N != x.dim(0))
    throw std::invalid_argument("tensor-parallel block: batch·T = " + std::to_string(N) + " tokens but x has " +
                                std::to_string(x.dim(0)) + " rows");
  return {N, x.dim(0), sp ? tp.rank() * x.dim(0) : 0};
}

// The norm's weight gradient under sequence parallelism: each rank has Σ over its own rows only.
// The sum over the group comes first, then the gradient is final (grad_done), as DDP expects.
void norm_backward_rows(Context& ctx, Communicator& tp, const model::RmsNorm& norm, const Tensor& x,
                        const model::RmsNorm::Saved& saved, const Tensor& dy, Tensor& dx) {
  const ParamId g = norm.weight();
  Tensor dgamma = ctx.tensor({x.dim(1)});
  ctx.ops.fill(dgamma, 0.0f);  // the backend adds into dgamma
  ctx.ops.rmsnorm_backward(x, ctx.params.value(g), saved.rstd, dy, dx, dgamma);
  all_reduce_sum(tp, dgamma);  // d floats: nothing next to the activations' traffic
  if (ctx.trains(g)) ctx.ops.accumulate(ctx.params.grad(g), dgamma, 1.0f);
  ctx.params.grad_done(g);
}

}  // namespace

void SequenceParallelBlock::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
                                    Saved& s) const {
  Communicator& tp = *tp_;
  const bool sp = sequence_parallel_;
  const Rows rows = rows_of(tp, sp, x, positions, batch);
  const std::int64_t d = config_.attention.d_model;
  const HeadLinears heads = local_heads(wq_, wk_, wv_, wo_, config_.attention, tp.size());
  y.expect({rows.mine, d}, "block output");
  s.n1 = ctx.tensor({rows.whole, d});
  s.n2 = ctx.tensor({rows.whole, d});
  s.h = ctx.tensor({rows.mine, d});
  s.attn_out = ctx.tensor({rows.mine, d});
  s.mlp_out = ctx.tensor({rows.mine, d});

  // Into a parallel region: the norm on this rank's rows, then (SP) the all-gather that gives the
  // column-parallel layers the whole input. Plain TP normalises the whole x on every rank.
  auto enter = [&](const model::RmsNorm& norm, const Tensor& in, Tensor& whole, model::RmsNorm::Saved& saved) {
    if (!sp) {
      norm.forward(ctx, in, whole, saved);
      return;
    }
    Tensor mine = ctx.tensor({rows.mine, d});
    norm.forward(ctx, in, mine, saved);
    all_gather_rows(tp, mine, whole);
  };
  // Out of it: the row-parallel layer's partial sums become this rank's rows of the sum (SP), or
  // the whole sum on every rank (TP, in place).
  auto leave = [&](Tensor& partial, Tensor& out) {
    if (sp) reduce_scatter_rows(tp, partial, out);
    else all_reduce_sum(tp, out);
  };

  // h = x + drop(attn(norm1(x)))
  enter(norm1_, x, s.n1, s.norm1);
  {
    Tensor partial = sp ? ctx.tensor({rows.whole, d}) : Tensor{};
    attention_partial(ctx, heads, s.n1, positions, batch, sp ? partial : s.attn_out, s.attn);
    leave(partial, s.attn_out);
  }
  drop(ctx, s.attn_out, index_, 0, rows.first, s.attn_out);
  ctx.ops.add(x, s.attn_out, s.h);

  // y = h + drop(mlp(norm2(h)))
  enter(norm2_, s.h, s.n2, s.norm2);
  {
    Tensor partial = sp ? ctx.tensor({rows.whole, d}) : Tensor{};
    mlp_partial(ctx, gate_, up_, down_, s.n2, sp ? partial : s.mlp_out, s.mlp);
    leave(partial, s.mlp_out);
  }
  drop(ctx, s.mlp_out, index_, 1, rows.first, s.mlp_out);
  ctx.ops.add(s.h, s.mlp_out, y);
}

void SequenceParallelBlock::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch,
                                     const Saved& s, const Tensor& dy, Tensor& dx) const {
  Communicator& tp = *tp_;
  const bool sp = sequence_parallel_;
  const Rows rows = rows_of(tp, sp, x, positions, batch);
  const std::int64_t d = config_.attention.d_model;
  const HeadLinears heads = local_heads(wq_, wk_, wv_, wo_, config_.attention, tp.size());
  dy.expect({rows.mine, d}, "block output gradient");
  dx.expect({rows.mine, d}, "block input gradient");

  // Backward of the reduce-scatter: every rank needs the whole gradient of the sub-layer's
  // output, so the rows are gathered (plain TP: it is whole already, g's backward is the identity).
  auto into_region = [&](const Tensor& mine, Tensor& whole) {
    if (sp) all_gather_rows(tp, mine, whole);
    else ctx.ops.copy(whole, mine);
  };
  // Backward of the all-gather: each rank's input gradient is a partial sum over its heads or
  // features; the rows of the sum go back to their owners (plain TP: f's all-reduce, in place).
  auto out_of_region = [&](Tensor& partial, Tensor& mine) {
    if (sp) reduce_scatter_rows(tp, partial, mine);
    else {
      all_reduce_sum(tp, partial);
      ctx.ops.copy(mine, partial);
    }
  };
  auto norm_backward = [&](const model::RmsNorm& norm, const Tensor& in, const model::RmsNorm::Saved& saved,
                           const Tensor& g, Tensor& out) {
    if (sp) norm_backward_rows(ctx, tp, norm, in, saved, g, out);
    else norm.backward(ctx, in, saved, g, out);  // whole rows on every rank: the same gradient everywhere
  };

  Tensor g = ctx.tensor({rows.mine, d}), dn = ctx.tensor({rows.mine, d}), dh = ctx.tensor({rows.mine, d});
  Tensor g_whole = ctx.tensor({rows.whole, d}), partial = ctx.tensor({rows.whole, d});

  // y = h + drop(mlp(norm2(h)))
  drop(ctx, dy, index_, 1, rows.first, g);
  into_region(g, g_whole);
  mlp_partial_backward(ctx, gate_, up_, down_, s.n2, s.mlp, g_whole, partial);
  out_of_region(partial, dn);
  norm_backward(norm2_, s.h, s.norm2, dn, dh);
  ctx.ops.accumulate(dh, dy, 1.0f);

  // h = x + drop(attn(norm1(x)))
  drop(ctx, dh, index_, 0, rows.first, g);
  into_region(g, g_whole);
  attention_partial_backward(ctx, heads, s.n1, positions, batch, s.attn, g_whole, partial);
  out_of_region(partial, dn);
  norm_backward(norm1_, x, s.norm1, dn, dx);
  ctx.ops.accumulate(dx, dh, 1.0f);
}

// =============================================================================================
// Part B: the layout
//
// Causal attention of a sequence cut into 2·cp chunks: query chunk a reads a + 1 chunks of keys
// (the diagonal one half). Chunks a and 2·cp − 1 − a together read 2·cp chunks' worth, whatever
// a is: pairing each early chunk with its mirror image gives every rank the same work.

CpLayout cp_layout(std::int64_t seq_len, int cp, int rank) {
  if (cp < 1 || rank < 0 || rank >= cp)
    throw std::invalid_argument("cp_layout: rank " + std::to_string(rank) + " of " + std::to_string(cp));
  if (seq_len <= 0 || seq_len % (2 * cp) != 0)
    throw std::invalid_argument("context parallelism: the sequence length " + std::to_string(seq_len) +
                                " is not a positive multiple of 2·cp = " + std::to_string(2 * cp) +
                                " (each rank holds two of 2·cp equal chunks)");
  CpLayout l;
  l.cp = cp;
  l.rank = rank;
  l.seq_len = seq_len;
  l.chunk = seq_len / (2 * cp);
  l.first = rank;
  l.second = 2 * cp - 1 - rank;
  return l;
}

std::vector<std::int32_t> local_positions(const CpLayout& l) {
  std::vector<std::int32_t> pos;
  pos.reserve(static_cast<std::size_t>(2 * l.chunk));
  for (int c : {l.first, l.second})
    for (std::int64_t t = 0; t < l.chunk; ++t) pos.push_back(static_cast<std::int32_t>(c * l.chunk + t));
  return pos;
}

std::vector<std::int64_t> local_rows(const CpLayout& l, int batch) {
  std::vector<std::int64_t> rows;
  rows.reserve(static_cast<std::size_t>(2 * batch * l.chunk));
  for (int c : {l.first, l.second})  // chunk-major: each chunk of the batch one contiguous block
    for (int b = 0; b < batch; ++b)
      for (std::int64_t t = 0; t < l.chunk; ++t) rows.push_back(b * l.seq_len + c * l.chunk + t);
  return rows;
}

// =============================================================================================
// Part B: merging two partial results
//
// Merging is itself an attention. A query that has attended to two sets of keys separately holds
// two "super-keys": one per part, whose score is that part's log-sum-exp and whose value is that
// part's output. Softmax over the two scores gives the weights exp(lse_i − lse), and the
// log-sum-exp of the two scores is the merged lse. The library has no exp or log op, but its
// attention computes exactly that: a problem with one query of 1s and two keys holding lse and
// lse_part (head_dim 1, so the score is the key itself) returns, per query, the weight of the
// running part as output (its value 1, the other 0) and the merged lse, all on the device.
//
// Each query of the real problem is one sequence of the small one; the output then needs the
// weight per (token, head), in the order of o's rows seen as [tokens·heads, head_dim], while
// lse is laid out [batch, heads, q_len]. Two index lists, made once per shape, reorder between them.

namespace {

// The GPU backend's plain attention kernel runs one thread block per (query, head, sequence),
// with the sequences in a grid dimension that ends at 65535: merges run in slabs of sequences.
constexpr std::int64_t kMergeSlab = 32768;

// What the constructor makes once; the per-call buffers are allocated by each merge.
enum MergeState { kPick, kUnpick, kOnes, kValues, kStates };

}  // namespace

AttentionMerge::AttentionMerge(Context& ctx, int batch, int q_heads, int q_len, int head_dim)
    : batch_(batch), heads_(q_heads), len_(q_len), head_dim_(head_dim) {
  if (batch < 1 || q_heads < 1 || q_len < 1 || head_dim < 1)
    throw std::invalid_argument("AttentionMerge: batch " + std::to_string(batch) + ", q_heads " +
                                std::to_string(q_heads) + ", q_len " + std::to_string(q_len) + ", head_dim " +
                                std::to_string(head_dim));
  const std::int64_t R = static_cast<std::int64_t>(batch) * q_heads * q_len;
  if (2 * R > INT32_MAX) throw std::invalid_argument("AttentionMerge: too many rows for i32 indices");
  // Query i in o's row order (token b·L + t, head h) is entry (b·H + h)·L + t of an lse.
  auto lse_index = [&](std::int64_t i) {
    const std::int64_t h = i % q_heads, token = i / q_heads, b = token / q_len, t = token % q_len;
    return (b * q_heads + h) * q_len + t;
  };
  std::vector<std::int32_t> pick(static_cast<std::size_t>(2 * R)), unpick(static_cast<std::size_t>(R));
  std::vector<float> values(static_cast<std::size_t>(2 * R));
  for (std::int64_t i = 0; i < R; ++i) {
    const std::int64_t e = lse_index(i);
    pick[2 * i] = static_cast<std::int32_t>(e);          // key 0: the running lse (stack rows 0..R−1)
    pick[2 * i + 1] = static_cast<std::int32_t>(R + e);  // key 1: the part's (rows R..2R−1)
    unpick[e] = static_cast<std::int32_t>(i);
    values[2 * i] = 1.0f;  // the output is the weight of key 0
  }
  state_.resize(kStates);
  state_[kPick] = upload_i32(ctx, pick);
  state_[kUnpick] = upload_i32(ctx, unpick);
  state_[kOnes] = ctx.tensor({R, 1});
  ctx.ops.fill(state_[kOnes], 1.0f);
  state_[kValues] = ctx.tensor({2 * R, 1});
  ctx.ops.upload(state_[kValues], values.data());
}

void AttentionMerge::merge(Context& ctx, Tensor& o, Tensor& lse, Tensor& o_part, const Tensor& lse_part) const {
  const std::int64_t R = static_cast<std::int64_t>(batch_) * heads_ * len_;
  const Shape o_shape{static_cast<std::int64_t>(batch_) * len_, static_cast<std::int64_t>(heads_) * head_dim_};
  if (state_.size() != kStates) throw std::logic_error("AttentionMerge::merge on a default-constructed merge");
  o.expect(o_shape, "merge: o");
  o_part.expect(o_shape, "merge: o_part");
  lse.expect({batch_, heads_, len_}, "merge: lse");
  lse_part.expect({batch_, heads_, len_}, "merge: lse_part");
  model::Ops& ops = ctx.ops;
  Tensor stack = ctx.tensor({2 * R, 1}), keys = ctx.tensor({2 * R, 1}), weight = ctx.tensor({R, 1}),
         lse_new = ctx.tensor({R, 1});

  // The two scores of every query side by side, in o's row order.
  Tensor running = stack.rows(0, R), part = stack.rows(R, R);
  ops.copy(running, lse.reshaped({R, 1}));
  ops.copy(part, lse_part.reshaped({R, 1}));
  ops.gather_rows(stack, state_[kPick], keys);

  model::AttentionShape s;
  s.q_len = 1;
  s.kv_len = 2;
  s.head_dim = 1;
  s.causal = false;
  for (std::int64_t b0 = 0; b0 < R; b0 += kMergeSlab) {
    const std::int64_t S = std::min(kMergeSlab, R - b0);
    s.batch = static_cast<int>(S);
    const Tensor q = state_[kOnes].rows(b0, S), k = keys.rows(2 * b0, 2 * S), v = state_[kValues].rows(2 * b0, 2 * S);
    Tensor w = weight.rows(b0, S), l = lse_new.rows(b0, S).reshaped({S, 1, 1});
    ops.attention_forward(s, q, k, v, w, l);
  }
  Tensor lse_rows = lse.reshaped({R, 1});
  ops.gather_rows(lse_new, state_[kUnpick], lse_rows);

  // o = w·o + (1 − w)·o_part, written as o_part + w·(o − o_part): one weight per row of
  // [tokens·heads, head_dim], and exact where either side weighs nothing.
  Tensor mine = o.reshaped({R, head_dim_}), theirs = o_part.reshaped({R, head_dim_});
  ops.accumulate(mine, theirs, -1.0f);
  ops.scale_rows(mine, weight.reshaped({R}));
  ops.accumulate(mine, theirs, 1.0f);
}

// =============================================================================================
// Part B: ring attention

namespace {

// What forward and backward both take: this rank's two chunks of `rows` rows each, q and o of the
// query heads, k and v of the key-value heads.
void expect_qkvo(const RingConfig& c, std::int64_t rows, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& o) {
  q.expect({2 * rows, static_cast<std::int64_t>(c.q_heads) * c.head_dim}, "ring attention q");
  k.expect({2 * rows, static_cast<std::int64_t>(c.kv_heads) * c.head_dim}, "ring attention k");
  v.expect(k.shape(), "ring attention v");
  o.expect(q.shape(), "ring attention o");
}

// A chunk of the batch: rows [j·B·C, (j+1)·B·C) of a local tensor, and its lse [B, H, C].
Tensor chunk_rows(const Tensor& t, int j, std::int64_t rows) { return t.rows(j * rows, rows); }
Tensor chunk_lse(const Tensor& lse, int j, std::int64_t B, std::int64_t H, std::int64_t C) {
  return lse.reshaped({2 * B * H, C}).rows(j * B * H, B * H).reshaped({B, H, C});
}

// The block (query chunk qa, key chunk kc), by global chunk index, or nothing if no key is visible.
std::optional<AttentionShape> block_shape(const RingConfig& c, std::int64_t C, int qa, int kc) {
  if (c.causal && kc > qa) return std::nullopt;  // every key after every query
  AttentionShape s;
  s.batch = c.batch;
  s.q_len = s.kv_len = static_cast<int>(C);
  s.q_heads = c.q_heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.causal = c.causal && kc == qa;  // only the diagonal needs the mask: earlier chunks are all visible
  s.q_offset = qa * C;
  s.kv_offset = kc * C;
  return s;
}

// Keys and values (or their gradients) that travel together.
struct KvPair {
  Tensor k, v;
};

KvPair kv_like(Context& ctx, const Tensor& k) {
  return {ctx.tensor(k.shape()), ctx.tensor(k.shape())};
}

// One ring step: send (k, v) to the next rank, receive the previous rank's into `into`.
std::array<dist::Ticket, 2> pass_on(Communicator& cp, const Tensor& k, const Tensor& v, KvPair& into) {
  const int n = cp.size(), next = (cp.rank() + 1) % n, prev = (cp.rank() + n - 1) % n;
  return {cp.start_send_recv(k.raw(), count_of(k), next, into.k.raw(), count_of(into.k), prev, dist::DType::f32),
          cp.start_send_recv(v.raw(), count_of(v), next, into.v.raw(), count_of(into.v), prev, dist::DType::f32)};
}

void wait_both(Communicator& cp, const std::array<dist::Ticket, 2>& t) {
  cp.wait(t[0]);
  cp.wait(t[1]);
}

}  // namespace

RingAttention::RingAttention(Context& ctx, Communicator& cp, const RingConfig& c) : cp_(&cp), config_(c) {
  if (c.batch < 1 || c.q_heads < 1 || c.kv_heads < 1 || c.q_heads % c.kv_heads || c.head_dim < 1)
    throw std::invalid_argument("ring attention: batch " + std::to_string(c.batch) + ", q_heads " +
                                std::to_string(c.q_heads) + ", kv_heads " + std::to_string(c.kv_heads) +
                                ", head_dim " + std::to_string(c.head_dim) +
                                " (q_heads must be a multiple of kv_heads)");
  layout_ = cp_layout(c.seq_len, cp.size(), cp.rank());
  // Every block of a call has one chunk's shape: the merge's index lists are made once here, not
  // in every forward (a few million host operations and uploads at long contexts).
  merge_ = AttentionMerge(ctx, c.batch, c.q_heads, static_cast<int>(layout_.chunk), c.head_dim);
}

void RingAttention::forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                            Tensor& lse) const {
  Communicator& cp = *cp_;
  const RingConfig& c = config_;
  const int n = cp.size(), r = cp.rank();
  const std::int64_t B = c.batch, C = layout_.chunk, H = c.q_heads, rows = B * C;
  expect_qkvo(c, rows, q, k, v, o);
  lse.expect({2 * B, H, C}, "ring attention lse");

  Tensor o_part = ctx.tensor({rows, H * c.head_dim}), lse_part = ctx.tensor({B, H, C});
  // Two receive buffers: the one being read this step, and the one the next step arrives in.
  std::array<KvPair, 2> arrived;
  if (n > 1) arrived = {kv_like(ctx, k), kv_like(ctx, k)};
  const int mine[2] = {layout_.first, layout_.second};
  bool have[2] = {false, false};

  for (int step = 0; step < n; ++step) {
    const int owner = (r - step + n) % n;  // whose keys and values this rank holds now
    const CpLayout theirs = cp_layout(c.seq_len, n, owner);
    const Tensor& ks = step == 0 ? k : arrived[step % 2].k;
    const Tensor& vs = step == 0 ? v : arrived[step % 2].v;
    // Start the next hop first: it reads ks and vs (reading a send buffer is allowed) and fills
    // the other buffer, while the blocks below run.
    std::array<dist::Ticket, 2> hop{};
    if (step + 1 < n) hop = pass_on(cp, ks, vs, arrived[(step + 1) % 2]);

    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const std::optional<AttentionShape> s = block_shape(c, C, mine[i], j == 0 ? theirs.first : theirs.second);
        if (!s) continue;
        const Tensor qi = chunk_rows(q, i, rows), kj = chunk_rows(ks, j, rows), vj = chunk_rows(vs, j, rows);
        Tensor oi = chunk_rows(o, i, rows), lsei = chunk_lse(lse, i, B, H, C);
        if (!have[i]) {  // the chunk's first block is its running result
          ctx.ops.attention_forward(*s, qi, kj, vj, oi, lsei);
          have[i] = true;
        } else {
          ctx.ops.attention_forward(*s, qi, kj, vj, o_part, lse_part);
          merge_.merge(ctx, oi, lsei, o_part, lse_part);
        }
      }
    if (step + 1 < n) wait_both(cp, hop);
  }
}

// Backward recomputes each block's probabilities from q, k and the FINAL lse (the library's
// attention_backward does that), so each block's contribution is exact as it stands: P_blk =
// exp(S_blk − lse) is the block's share of the whole softmax, and D = rowsum(dO·O) uses the final
// o. dq collects on this rank; dk and dv belong to the keys' owner, so they travel with the keys.
void RingAttention::backward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                             const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) const {
  Communicator& cp = *cp_;
  const RingConfig& c = config_;
  const int n = cp.size(), r = cp.rank();
  const std::int64_t B = c.batch, C = layout_.chunk, H = c.q_heads, rows = B * C;
  expect_qkvo(c, rows, q, k, v, o);
  dout.expect(q.shape(), "ring attention dout");
  dq.expect(q.shape(), "ring attention dq");
  dk.expect(k.shape(), "ring attention dk");
  dv.expect(k.shape(), "ring attention dv");
  lse.expect({2 * B, H, C}, "ring attention lse");

  Tensor dq_part = ctx.tensor({rows, H * c.head_dim});
  std::array<KvPair, 2> arrived;  // keys and values, as in forward
  // Gradient sums: the one this step adds to (two, since last step's is still on its way out)
  // and the one arriving from the previous rank.
  std::array<KvPair, 2> grads = {kv_like(ctx, k), kv_like(ctx, k)};
  KvPair incoming;
  if (n > 1) {
    arrived = {kv_like(ctx, k), kv_like(ctx, k)};
    incoming = kv_like(ctx, k);
  }
  const int mine[2] = {layout_.first, layout_.second};
  bool have[2] = {false, false};
  std::array<dist::Ticket, 2> grad_hop{};

  for (int step = 0; step < n; ++step) {
    const CpLayout theirs = cp_layout(c.seq_len, n, (r - step + n) % n);
    const Tensor& ks = step == 0 ? k : arrived[step % 2].k;
    const Tensor& vs = step == 0 ? v : arrived[step % 2].v;
    std::array<dist::Ticket, 2> hop{};
    if (step + 1 < n) hop = pass_on(cp, ks, vs, arrived[(step + 1) % 2]);

    KvPair& g = grads[step % 2];
    ctx.ops.fill(g.k, 0.0f);  // attention_backward adds into dk and dv
    ctx.ops.fill(g.v, 0.0f);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const std::optional<AttentionShape> s = block_shape(c, C, mine[i], j == 0 ? theirs.first : theirs.second);
        if (!s) continue;
        const Tensor qi = chunk_rows(q, i, rows), kj = chunk_rows(ks, j, rows), vj = chunk_rows(vs, j, rows),
                     oi = chunk_rows(o, i, rows), doi = chunk_rows(dout, i, rows), lsei = chunk_lse(lse, i, B, H, C);
        Tensor dqi = chunk_rows(dq, i, rows), dkj = chunk_rows(g.k, j, rows), dvj = chunk_rows(g.v, j, rows);
        ctx.ops.attention_backward(*s, qi, kj, vj, oi, lsei, doi, have[i] ? dq_part : dqi, dkj, dvj);
        if (have[i]) ctx.ops.accumulate(dqi, dq_part, 1.0f);
        have[i] = true;
      }
    if (n > 1) {
      // Add what the ranks before this one computed for the same keys, then pass the sum on.
      // After the last step the next rank is the keys' owner: that hop brings them home.
      if (step > 0) {
        wait_both(cp, grad_hop);
        ctx.ops.accumulate(g.k, incoming.k, 1.0f);
        ctx.ops.accumulate(g.v, incoming.v, 1.0f);
      }
      grad_hop = pass_on(cp, g.k, g.v, incoming);
    }
    if (step + 1 < n) wait_both(cp, hop);
  }
  if (n > 1) wait_both(cp, grad_hop);
  const KvPair& home = n > 1 ? incoming : grads[0];
  ctx.ops.copy(dk, home.k);
  ctx.ops.copy(dv, home.v);
}

// =============================================================================================
// Part B: the layer

namespace {

// RoPE on a local tensor: each chunk's B·C rows rotated by that chunk's C positions (the op
// repeats a [C] position list over the rows, one sequence after the other).
void rotate(Context& ctx, const CpLayout& l, Tensor& x, int heads, int head_dim, float theta, bool inverse) {
  const std::int64_t rows = x.dim(0) / 2;
  const int chunks[2] = {l.first, l.second};
  for (int j = 0; j < 2; ++j) {
    std::vector<std::int32_t> pos(static_cast<std::size_t>(l.chunk));
    for (std::int64_t t = 0; t < l.chunk; ++t) pos[t] = static_cast<std::int32_t>(chunks[j] * l.chunk + t);
    const Tensor positions = upload_i32(ctx, pos);
    Tensor part = x.rows(j * rows, rows);
    ctx.ops.rope(part, positions, heads, head_dim, theta, inverse);
  }
}

}  // namespace

ContextParallelAttention::ContextParallelAttention(Communicator& cp, ParamList& params, const std::string& name,
                                                   const model::AttentionConfig& c, std::int64_t seq_len)
    : cp_(&cp), config_(c) {
  check_attention(name, c);
  layout_ = cp_layout(seq_len, cp.size(), cp.rank());
  const std::int64_t kv = static_cast<std::int64_t>(c.kv_heads) * c.head_dim();
  wq_ = model::Linear(params, name + ".wq", c.d_model, c.d_model);
  wk_ = model::Linear(params, name + ".wk", c.d_model, kv);
  wv_ = model::Linear(params, name + ".wv", c.d_model, kv);
  wo_ = model::Linear(params, name + ".wo", c.d_model, c.d_model);
}

void ContextParallelAttention::forward(Context& ctx, const Tensor& x, int batch, Tensor& y, Saved& s) const {
  const std::int64_t rows = 2 * batch * layout_.chunk, d = config_.d_model,
                     kv = static_cast<std::int64_t>(config_.kv_heads) * config_.head_dim();
  x.expect({rows, d}, "context-parallel attention input");
  s.q = ctx.tensor({rows, d});
  s.k = ctx.tensor({rows, kv});
  s.v = ctx.tensor({rows, kv});
  s.o = ctx.tensor({rows, d});
  s.lse = ctx.tensor({2 * batch, config_.q_heads, layout_.chunk});
  // The projections act token by token: the local rows are all they need.
  wq_.forward(ctx, x, s.q);
  wk_.forward(ctx, x, s.k);
  wv_.forward(ctx, x, s.v);
  rotate(ctx, layout_, s.q, config_.q_heads, config_.head_dim(), config_.rope_theta, false);
  rotate(ctx, layout_, s.k, config_.kv_heads, config_.head_dim(), config_.rope_theta, false);
  const RingAttention ring(ctx, *cp_, {batch, layout_.seq_len, config_.q_heads, config_.kv_heads, config_.head_dim(), true});
  ring.forward(ctx, s.q, s.k, s.v, s.o, s.lse);
  wo_.forward(ctx, s.o, y);
}

void ContextParallelAttention::backward(Context& ctx, const Tensor& x, int batch, const Saved& s, const Tensor& dy,
                                        Tensor& dx) const {
  Tensor dout = ctx.tensor(s.o.shape()), dq = ctx.tensor(s.q.shape()), dk = ctx.tensor(s.k.shape()),
         dv = ctx.tensor(s.v.shape()), part = ctx.tensor(x.shape());
  wo_.backward(ctx, s.o, dy, &dout);
  const RingAttention ring(ctx, *cp_, {batch, layout_.seq_len, config_.q_heads, config_.kv_heads, config_.head_dim(), true});
  ring.backward(ctx, s.q, s.k, s.v, s.o, s.lse, dout, dq, dk, dv);
  rotate(ctx, layout_, dq, config_.q_heads, config_.head_dim(), config_.rope_theta, true);
  rotate(ctx, layout_, dk, config_.kv_heads, config_.head_dim(), config_.rope_theta, true);
  // The weights' gradients from this rank's tokens only; the caller sums them over the group.
  wv_.backward(ctx, x, dv, &dx);
  wk_.backward(ctx, x, dk, &part);
  ctx.ops.accumulate(dx, part, 1.0f);
  wq_.backward(ctx, x, dq, &part);
  ctx.ops.accumulate(dx, part, 1.0f);
}

}  // namespace k2c::sequence_parallel
