// assignments/14_tensor_parallel/tensor_parallel.h — the contract of module 14 (do not edit).
//
// Tensor parallelism in the manner of Megatron-LM: the weights of every layer are cut across the
// ranks of a tensor-parallel group (`tp`, n = tp.size() ranks, this one r = tp.rank()), each rank
// multiplies with its block only, and two collectives per sub-layer put the whole back together.
// The layers, the ops and the loss arithmetic are the model library's (k2c/model/); what you write
// is how the weights are cut and where the activations and their gradients meet.
//
//   f, g                    the conjugate operators: f enters a parallel region (identity
//                           forward, all-reduce of the gradient backward), g leaves it
//                           (all-reduce forward, identity backward)
//   ColumnParallelLinear    the output features cut: rank r holds rows [r·out/n, (r+1)·out/n) of
//                           the [out, in] weight and computes those columns of y
//   RowParallelLinear       the input features cut: rank r holds columns [r·in/n, (r+1)·in/n)
//                           and adds its partial product into everyone's y (g)
//   ParallelMlp             SwiGLU: gate and up column-parallel, down row-parallel
//   ParallelAttention       query and key-value heads cut (GQA): wq, wk, wv column-parallel by
//                           whole heads, the attention of the local heads, wo row-parallel
//   ParallelBlock           the pre-norm residual block around the two
//   VocabParallelEmbedding  the vocabulary cut: rank r looks up ids in [r·V/n, (r+1)·V/n) only
//   vocab_parallel_cross_entropy  the loss over logits cut by vocabulary, never gathered
//
// Activations outside a parallel region ([N, d_model], N = batch·T tokens) are whole and
// identical on every rank; inside, a rank holds its columns ([N, out/n], or its heads). Weights
// are registered with the model library's Init::shard under the unsharded weight's name, so each
// rank starts from exactly its slice of the weights that one process would make (params.h), and
// the parameter names equal the unsharded layers' (model::Linear "name.weight", model::Mlp
// "name.gate/up/down", model::Attention "name.wq/wk/wv/wo", model::Block "name.norm1/attn/norm2/
// mlp"). Every size that is cut must be divisible by n: a constructor given one that is not
// throws std::invalid_argument naming the size and n, before it registers anything.
//
// Communication. Every collective is a sum over `tp` (ReduceOp::sum) of fp32 tensors, in place,
// on the tensors' raw() pointers (the model's tensors live where the communicator's collectives
// expect them: host memory on MPI, device memory on NCCL). Per block, forward runs exactly two
// all-reduces (g after attention's wo, g after the MLP's down) and backward exactly two (f's,
// before attention's and the MLP's input gradients leave), each of N·d_model·4 bytes, and nothing
// else; backward starts each of its two with start_all_reduce as soon as the input gradient is
// computed and computes the weight gradients of wq, wk, wv (gate, up) before waiting on it, so
// the transfer runs under that work. Layers call ctx.params.grad_done(id) after adding into a
// weight's gradient, as the library's layers do.
//
// Use the model library's ops (ctx.ops: matmul, rope, attention_forward, swiglu_forward, ...) for
// every computation on tensors; never read or write tensor elements yourself (on NCCL they are
// device memory). Host code may handle index lists of N entries (ids, targets) and the per-row
// statistics of the loss (N numbers each), moved with ops.upload and ops.download.
//
// Tests: autograder/14_tensor_parallel/test_tensor_parallel.cpp. Lecture: lectures/14_tensor_parallel.md.
#pragma once

#include <cstdint>
#include <string>

#include "k2c/dist/communicator.h"
#include "k2c/model/block.h"
#include "k2c/model/layers.h"

namespace k2c::tensor_parallel {

using dist::Communicator;
using model::Context;
using model::Init;
using model::ParamId;
using model::ParamList;
using model::Tensor;

// ---- the conjugate operators (lecture, section 2)
//
// f, "copy into the region", stands where a whole activation x enters column-parallel layers.
// Forward it is the identity (every rank already holds x), so it has no function. Backward, each
// rank holds a partial input gradient dx_r (its columns' contribution); f's backward starts their
// sum over `tp`, in place in dx, and returns the ticket: the caller waits on it (tp.wait) once it
// has issued the work that may overlap the transfer, and must leave dx alone until then.
dist::Ticket f_backward(Communicator& tp, Tensor& dx);

// g, "reduce out of the region", stands where the partial products of a row-parallel layer leave.
// Forward: y becomes the sum of every rank's y, in place (one all-reduce). Backward it is the
// identity: every rank receives the whole gradient of y and keeps it as it is.
void g_forward(Communicator& tp, Tensor& y);

// ---- linear layers (no bias)

// y = x·Wᵀ, W [out, in] cut by rows: rank r holds rows [r·out/n, (r+1)·out/n), registered as
// `name`.weight with Init::shard (ShardOf{{out, in}, {r·out/n, 0}}) and the kind and std of `init`.
class ColumnParallelLinear {
 public:
  ColumnParallelLinear() = default;
  ColumnParallelLinear(Communicator& tp, ParamList& params, const std::string& name, std::int64_t in,
                       std::int64_t out, Init init = {});
  // x [N, in] whole; y [N, out/n]: this rank's columns of the whole layer's output. No
  // communication (f forward is the identity).
  void forward(Context& ctx, const Tensor& x, Tensor& y) const;
  // dy [N, out/n]. If dx: dx [N, in] = dy·W_r, then f's backward (the all-reduce started), then
  // dW_r += dyᵀ·x and grad_done, then the wait: on return dx is the whole input gradient on every
  // rank. Without dx: only the weight gradient, no communication.
  void backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const;
  // The two halves of backward, for layers that share an input (gate and up; q, k and v) and so
  // one f: dx = dy·W_r (accumulate: dx += dy·W_r), this rank's partial input gradient, nothing
  // communicated; and dW_r += dyᵀ·x followed by grad_done.
  void backward_input(Context& ctx, const Tensor& dy, Tensor& dx, bool accumulate) const;
  void backward_weight(Context& ctx, const Tensor& x, const Tensor& dy) const;

  ParamId weight() const { return w_; }
  std::int64_t in() const { return in_; }
  std::int64_t out() const { return out_; }              // the whole layer's
  std::int64_t local_out() const { return local_out_; }  // this rank's: out / n

 private:
  Communicator* tp_ = nullptr;
  ParamId w_ = -1;
  std::int64_t in_ = 0, out_ = 0, local_out_ = 0;
};

// y = x·Wᵀ, W [out, in] cut by columns: rank r holds columns [r·in/n, (r+1)·in/n), registered as
// `name`.weight with Init::shard (ShardOf{{out, in}, {0, r·in/n}}).
class RowParallelLinear {
 public:
  RowParallelLinear() = default;
  RowParallelLinear(Communicator& tp, ParamList& params, const std::string& name, std::int64_t in,
                    std::int64_t out, Init init = {});
  // x [N, in/n]: this rank's columns of the input (a column-parallel layer's output); y [N, out]
  // whole on every rank: the local product x·W_rᵀ, then g's forward.
  void forward(Context& ctx, const Tensor& x, Tensor& y) const;
  // dy [N, out] whole (g's backward is the identity). dW_r += dyᵀ·x and grad_done; if dx:
  // dx [N, in/n] = dy·W_r, this rank's columns of the input gradient. No communication.
  void backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const;

  ParamId weight() const { return w_; }
  std::int64_t in() const { return in_; }              // the whole layer's
  std::int64_t out() const { return out_; }
  std::int64_t local_in() const { return local_in_; }  // this rank's: in / n

 private:
  Communicator* tp_ = nullptr;
  ParamId w_ = -1;
  std::int64_t in_ = 0, out_ = 0, local_in_ = 0;
};

// ---- the MLP and attention

// SwiGLU, y = W_down (silu(W_gate x) · W_up x), as model::Mlp, with gate and up column-parallel
// ("name.gate", "name.up": d_ff cut) and down row-parallel ("name.down"). silu(·)·(·) acts on each
// hidden feature alone, so rank r applies it to its d_ff/n features with nothing exchanged.
class ParallelMlp {
 public:
  using Saved = model::Mlp::Saved;  // gate, up, h: this rank's [N, d_ff/n]
  ParallelMlp() = default;
  ParallelMlp(Communicator& tp, ParamList& params, const std::string& name, std::int64_t d_model,
              std::int64_t d_ff);
  // x, y [N, d_model] whole. One all-reduce (down's g).
  void forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const;
  // dy, dx [N, d_model] whole. One all-reduce (f's, of the gate's and up's input gradients summed),
  // started before the gate's and up's weight gradients are computed.
  void backward(Context& ctx, const Tensor& x, const Saved& saved, const Tensor& dy, Tensor& dx) const;

 private:
  Communicator* tp_ = nullptr;
  ColumnParallelLinear gate_, up_;
  RowParallelLinear down_;
};

// Causal self-attention with GQA and RoPE, as model::Attention, with the heads cut: rank r runs
// query heads [r·Hq/n, (r+1)·Hq/n) and key-value heads [r·Hkv/n, (r+1)·Hkv/n) (query head h reads
// key-value head h / (Hq/Hkv), so a rank's query heads read only its own key-value heads). wq, wk,
// wv are column-parallel by whole heads ("name.wq", ...), wo row-parallel ("name.wo"). Both
// config.q_heads and config.kv_heads must be divisible by n.
class ParallelAttention {
 public:
  using Saved = model::Attention::Saved;  // q, k (after RoPE), v, o, lse of this rank's heads
  ParallelAttention() = default;
  ParallelAttention(Communicator& tp, ParamList& params, const std::string& name,
                    const model::AttentionConfig& config);
  // x, y [batch·T, d_model] whole; positions i32 [T]. One all-reduce (wo's g).
  void forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
               Saved& saved) const;
  // dy, dx whole. One all-reduce (f's, of the three projections' input gradients summed), started
  // before the weight gradients of wq, wk and wv are computed.
  void backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& saved,
                const Tensor& dy, Tensor& dx) const;
  // This rank's share of the heads.
  int local_q_heads() const { return config_.q_heads / (tp_ ? tp_->size() : 1); }
  int local_kv_heads() const { return config_.kv_heads / (tp_ ? tp_->size() : 1); }

 private:
  Communicator* tp_ = nullptr;
  model::AttentionConfig config_;
  ColumnParallelLinear wq_, wk_, wv_;
  RowParallelLinear wo_;
};

// The pre-norm residual block of model::Block (dense, no dropout): h = x + attn(norm1(x));
// y = h + mlp(norm2(h)). The norms are replicated (every rank holds the whole weight and computes
// the same thing); their gradients come out equal on every rank with nothing exchanged, because
// what flows into them is whole. config.moe.experts must be 0 and ctx.dropout 0
// (std::invalid_argument otherwise).
class ParallelBlock {
 public:
  struct Saved {
    Tensor n1, h, n2, attn_out, mlp_out;
    model::RmsNorm::Saved norm1, norm2;
    ParallelAttention::Saved attn;
    ParallelMlp::Saved mlp;
  };
  ParallelBlock() = default;
  ParallelBlock(Communicator& tp, ParamList& params, const std::string& name, const model::BlockConfig& config);
  // x, y [batch·T, d_model] whole. Two all-reduces.
  void forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y, Saved& saved) const;
  // dy, dx whole. Two all-reduces, both started ahead of the weight gradients they overlap.
  void backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& saved,
                const Tensor& dy, Tensor& dx) const;

 private:
  model::RmsNorm norm1_, norm2_;
  ParallelAttention attn_;
  ParallelMlp mlp_;
};

// ---- the vocabulary

// The [V, D] embedding table cut by rows: rank r holds the rows of ids [r·V/n, (r+1)·V/n),
// registered as `name`.weight with Init::shard.
class VocabParallelEmbedding {
 public:
  // What forward worked out for backward: this rank's ids (an id of the shard minus the shard's
  // first id, 0 elsewhere) and the mask (1 for a row whose id is in the shard, 0 elsewhere).
  struct Saved {
    Tensor local_ids;  // i32 [N]
    Tensor mask;       // f32 [N]
  };
  VocabParallelEmbedding() = default;
  VocabParallelEmbedding(Communicator& tp, ParamList& params, const std::string& name, std::int64_t vocab,
                         std::int64_t dim, Init init = {});
  // ids i32 [N], every one in [0, V) (std::out_of_range otherwise), the same on every rank;
  // out [N, D] whole: each rank looks up the rows of its ids and leaves the others zero, then
  // one all-reduce adds the ranks' rows (each row has exactly one non-zero contribution).
  void forward(Context& ctx, const Tensor& ids, Tensor& out, Saved& saved) const;
  // dout [N, D] whole: each rank adds the rows of its own ids into its shard's gradient, then
  // grad_done. No communication.
  void backward(Context& ctx, const Saved& saved, const Tensor& dout) const;

  ParamId weight() const { return w_; }
  std::int64_t vocab_begin() const { return begin_; }  // this rank's first id: r·V/n
  std::int64_t vocab_end() const { return end_; }      // one past its last: (r+1)·V/n

 private:
  Communicator* tp_ = nullptr;
  ParamId w_ = -1;
  std::int64_t vocab_ = 0, dim_ = 0, begin_ = 0, end_ = 0;
};

// Softmax cross-entropy over logits cut by vocabulary, as model::Ops::cross_entropy computes it
// over the whole [N, V], without ever gathering the logits. logits [N, V/n] are this rank's
// columns [r·V/n, (r+1)·V/n) (a column-parallel head's output), so V = n·logits.dim(1); targets
// i32 [N] are global ids (−1: the row is ignored), the same on every rank; an id outside [0, V)
// other than −1 throws std::out_of_range.
//
// Returns the sum of the losses of the counted rows, the same on every rank, and writes
// dlogits [N, V/n] = grad_scale·(softmax − onehot) on this rank's columns (zero rows for ignored
// targets). Exactly three all-reduces of N floats each, in this order: the row maxima
// (ReduceOp::max), the target logits (sum; the rank that holds a row's target contributes it,
// the others 0), the sums of exp(logit − max) (sum). The gradient is local.
double vocab_parallel_cross_entropy(Communicator& tp, Context& ctx, const Tensor& logits, const Tensor& targets,
                                    float grad_scale, Tensor& dlogits);

}  // namespace k2c::tensor_parallel
