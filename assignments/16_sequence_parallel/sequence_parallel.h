// assignments/16_sequence_parallel/sequence_parallel.h — the contract of module 16 (do not edit).
//
// Two ways of cutting a transformer's activations along the tokens, on top of the model library
// (k2c/model/): the layers, the ops and the parameter lists are the library's; what you write is
// which tokens each rank holds, what travels between the ranks and when.
//
// Part A — Megatron sequence parallelism, in a tensor-parallel group `tp` (n ranks, this one r).
// Tensor parallelism (module 14) cuts the weights of attention and of the MLP, but leaves the
// activations between them whole and identical on every rank: the norms, the dropouts and the
// residual adds are done n times over, and their activations are kept n times over. Sequence
// parallelism cuts those activations by tokens instead: rank r keeps rows [r·N/n, (r+1)·N/n) of
// the [N, d_model] activations between the sub-layers (N = batch·T tokens, batch-major, so the
// cut is a cut of the flattened tokens). Where plain TP has an all-reduce (after wo, after
// down), SP has a reduce-scatter that leaves each rank its rows of the sum; where plain TP has the
// identity (before wq/wk/wv, before gate/up), SP has an all-gather of the rows. Backward swaps
// the two. An all-gather plus a reduce-scatter move exactly what one all-reduce moves.
//
//   all_gather_rows          shard [N/n, d] on every rank → whole [N, d], rank q's rows at q·N/n
//   reduce_scatter_rows      partial [N, d] on every rank → shard [N/n, d] of the sum
//   SequenceParallelBlock    the pre-norm residual block of model::Block, tensor-parallel inside,
//                            with sequence parallelism around (or plain TP, to compare with)
//
// Part B — context parallelism with ring attention, in a context-parallel group `cp` (n ranks).
// Every rank holds a share of each sequence's tokens, all the weights, and computes its tokens'
// queries, keys and values itself. Attention is the one place where tokens meet: each rank keeps
// its queries and the key-value blocks of all ranks pass by, one ring step at a time, each step's
// transfer hidden under the attention of the block that arrived in the step before. Every block
// gives a partial result (output and log-sum-exp of the scores) that is merged into the running
// one. Causal attention gives the later tokens more keys to read, so a rank holding a contiguous
// slice would work in proportion to its rank; instead the sequence is cut into 2·n chunks of
// C = T/(2·n) tokens and rank r holds chunks r and 2·n − 1 − r, one early and one late, which
// gives every rank the same work.
//
//   cp_layout, local_positions, local_rows    which tokens a rank holds, and in which order
//   AttentionMerge                            two partial attention results into one (log-sum-exp)
//   RingAttention                             attention over the whole sequence from one rank's share
//   ContextParallelAttention                  model::Attention's layer (projections, RoPE) around it
//
// Local order under context parallelism (write it down before anything else): a rank's rows are
// chunk-major. With batch B, its 2·B·C rows are first chunk `first` of sequence 0, of sequence
// 1, ..., of sequence B − 1, then chunk `second` of each sequence: local row (j·B + b)·C + t holds
// token t of chunk j (0: first, 1: second) of sequence b. So each chunk of the batch is a
// contiguous [B·C, ...] matrix, which the library's attention takes as `batch` sequences of C.
//
// Use the model library's ops (ctx.ops: matmul, rope, attention_forward, scale_rows, ...) for
// every computation on tensors; never read or write tensor elements yourself (on NCCL they are
// device memory). Host code may make lists of indices and positions from the shapes alone and
// move them with ops.upload, and may handle vectors of per-row statistics (downloaded with
// ops.download). Collectives and exchanges act on tensors' raw() pointers, fp32.
//
// Tests: autograder/16_sequence_parallel/test_sequence_parallel.cpp. Lecture: lectures/16_sequence_parallel.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k2c/dist/communicator.h"
#include "k2c/model/block.h"
#include "k2c/model/layers.h"

namespace k2c::sequence_parallel {

using dist::Communicator;
using model::Context;
using model::ParamId;
using model::ParamList;
using model::Tensor;

// =============================================================================================
// Part A: sequence parallelism
// =============================================================================================

// ---- the two collectives on rows (lecture, section 2)
//
// Rank r's `shard` [M, d] is rows [r·M, (r+1)·M) of `whole` [n·M, d]: all_gather_rows fills
// `whole` on every rank (one all_gather of M·d floats). Its backward is reduce_scatter_rows.
void all_gather_rows(Communicator& tp, const Tensor& shard, Tensor& whole);
// Every rank holds a partial sum `partial` [n·M, d]; `shard` [M, d] becomes rows [r·M, (r+1)·M)
// of the sum over the ranks (one reduce_scatter, ReduceOp::sum). Its backward is all_gather_rows.
// `partial` is left as it was.
void reduce_scatter_rows(Communicator& tp, const Tensor& partial, Tensor& shard);

// ---- the block
//
// h = x + drop(attn(norm1(x))); y = h + drop(mlp(norm2(h))), as model::Block computes it (dense,
// no checkpointing), with attention and the SwiGLU MLP tensor-parallel over `tp` as in module 14:
// rank r holds query heads [r·Hq/n, (r+1)·Hq/n) and key-value heads [r·Hkv/n, ...) of wq, wk, wv
// (output rows) and the matching columns of wo; d_ff features [r·d_ff/n, ...) of gate and up
// (rows) and of down (columns). Every weight is a model::Linear registered with Init::shard
// (kind normal, std 0.02, as model::Linear's default) under model::Block's names ("name.attn.wq",
// "name.mlp.gate", ... ".weight"), so it starts as exactly its slice of one process's weight; the
// norms ("name.norm1", "name.norm2") are whole on every rank. d_ff, Hq and Hkv must divide by n,
// and config.moe.experts must be 0: otherwise the constructor throws std::invalid_argument naming
// the size and n, before it registers anything.
//
// With sequence_parallel = true, x, y, dy and dx are this rank's rows [r·N/n, (r+1)·N/n) of the
// whole [N, d] activation (N = batch·T must be n·x.dim(0): std::invalid_argument otherwise, naming
// batch·T and n). The norms, the dropouts and the residual adds act on these rows only; the
// dropout masks are those of the rows' places in the whole (DropoutKey row_offset =
// ctx.row_offset + r·N/n, and model::Block's layer numbers 2·index and 2·index + 1), so the
// result is exactly the matching rows of model::Block's. The norms' gradients are partial sums
// over this rank's rows: each is all-reduced (sum, d floats) before it is added into the norm's
// gradient, and only then is grad_done called for it, so every rank ends with the whole gradient.
//
// With sequence_parallel = false, the block is plain tensor parallelism (module 14's): x, y, dy, dx
// whole [N, d] and identical on every rank, the norms computed whole on every rank with nothing
// exchanged, dropout masks at row_offset = ctx.row_offset.
//
// Communication per block, S = 4·N·d bytes (fp32), counted as k2c/dist/counting.h counts:
//                    forward                                 backward
//   plain TP         2 all_reduce of S (after wo, down)     2 all_reduce of S (before the norms)
//   sequence par.    2 all_gather of S (after the norms)    2 all_gather of S (dy of wo, down)
//                    2 reduce_scatter of S (wo, down)       2 reduce_scatter of S (into the norms)
//                                                           2 all_reduce of 4·d (norm gradients)
// and nothing else. Per rank, an all-gather and a reduce-scatter of S each move (n−1)/n·S and an
// all-reduce 2·(n−1)/n·S: the same bytes, besides the norms' 2·d floats.
//
// What forward keeps (Saved): n1 and n2, the norms' outputs gathered (the sub-layers' whole
// inputs, [N, d], which their weight gradients need); h, attn_out (after dropout) and mlp_out
// (after dropout), the block's own rows ([N/n, d] under SP, [N, d] under plain TP); the norms'
// rstd (of those rows); the attention's q, k (after RoPE), v, o, lse of this rank's heads; the
// MLP's gate, up, h of this rank's features. Nothing else outlives forward.
class SequenceParallelBlock {
 public:
  struct Saved {
    Tensor n1, n2;
    Tensor h, attn_out, mlp_out;
    model::RmsNorm::Saved norm1, norm2;
    model::Attention::Saved attn;
    model::Mlp::Saved mlp;
  };
  SequenceParallelBlock() = default;
  SequenceParallelBlock(Communicator& tp, ParamList& params, const std::string& name,
                        const model::BlockConfig& config, int index, bool sequence_parallel);
  // positions i32 [T], the whole sequence's (the attention runs on whole sequences).
  void forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y, Saved& saved) const;
  void backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& saved,
                const Tensor& dy, Tensor& dx) const;
  bool sequence_parallel() const { return sequence_parallel_; }

 private:
  Communicator* tp_ = nullptr;
  model::BlockConfig config_;
  int index_ = 0;
  bool sequence_parallel_ = true;
  model::RmsNorm norm1_, norm2_;
  model::Linear wq_, wk_, wv_, wo_, gate_, up_, down_;
};

// =============================================================================================
// Part B: context parallelism and ring attention
// =============================================================================================

// ---- the load-balanced layout (lecture, section 4)

struct CpLayout {
  int cp = 1, rank = 0;
  std::int64_t seq_len = 0;
  std::int64_t chunk = 0;    // C = seq_len / (2·cp)
  int first = 0, second = 0; // the chunks this rank holds: rank and 2·cp − 1 − rank
};
// The layout of rank `rank` of `cp` over sequences of seq_len tokens. Throws
// std::invalid_argument unless cp >= 1, 0 <= rank < cp and seq_len is a positive multiple of
// 2·cp; the message of the last case names seq_len and 2·cp.
CpLayout cp_layout(std::int64_t seq_len, int cp, int rank);
// The position in its sequence of each of the rank's 2·C tokens of one sequence, in local order:
// first·C, ..., first·C + C − 1, second·C, ..., second·C + C − 1.
std::vector<std::int32_t> local_positions(const CpLayout& layout);
// For each of the rank's 2·batch·C local rows, in local order (chunk-major, see the top), the row
// of the whole batch-major activation [batch·seq_len, ...] that it holds: b·seq_len + position.
std::vector<std::int64_t> local_rows(const CpLayout& layout, int batch);

// ---- merging partial attention results (lecture, section 3)
//
// Attention of a query over keys K1 ∪ K2 from its attention over K1 alone (o1, lse1) and over K2
// alone (o2, lse2): lse = log(exp(lse1) + exp(lse2)) and o = exp(lse1 − lse)·o1 + exp(lse2 −
// lse)·o2. A query that saw no key of a part has lse −inf there and o 0, and weighs nothing.
// Shapes as the library's attention gives them: o [batch·q_len, q_heads·head_dim] (token rows,
// heads side by side), lse [batch, q_heads, q_len].
class AttentionMerge {
 public:
  AttentionMerge() = default;
  // Prepares the merges of one shape: whatever merge() wants made once (index lists, constants),
  // in ctx's memory, so the merge must not outlive ctx's ledger.
  AttentionMerge(Context& ctx, int batch, int q_heads, int q_len, int head_dim);
  // o, lse: the running result, replaced by the merge of itself and (o_part, lse_part).
  // o_part's contents are undefined afterwards (it may serve as scratch).
  void merge(Context& ctx, Tensor& o, Tensor& lse, Tensor& o_part, const Tensor& lse_part) const;

 private:
  int batch_ = 0, heads_ = 0, len_ = 0, head_dim_ = 0;
  std::vector<Tensor> state_;  // yours to fill in the constructor
};

// ---- ring attention
//
// The attention of model::Attention (softmax(q·kᵀ/sqrt(head_dim)) over the visible keys, GQA:
// query head h reads key-value head h / (Hq/Hkv)) over whole sequences of seq_len tokens, every
// rank holding its share of the queries, keys and values in local order. Keys that are
// visible: all of them (causal = false), or those at a position not after the query's.
struct RingConfig {
  int batch = 1;
  std::int64_t seq_len = 0;
  int q_heads = 1, kv_heads = 1, head_dim = 0;
  bool causal = true;
};

// How the work is done, which the tests check:
//   - One attention_forward (backward: attention_backward, or attention_backward_overwrite
//     where a key chunk's dk and dv start empty) call per pair (query chunk i, key
//     chunk j) with at least one visible key, with q_len = kv_len = C, batch = B, q_offset =
//     (global index of chunk i)·C and kv_offset likewise: causal = true only on the diagonal (the
//     same chunk), causal = false where every key is visible (an earlier chunk), no call where
//     none is (a later chunk, under causal). So under causal masking every rank makes 2·cp + 1
//     block calls of the same total work, and 4·cp without it.
//   - The ring: at step s = 0, ..., cp − 1 a rank holds the keys and values of rank r − s
//     (mod cp): its own at step 0. Before computing step s's blocks it starts (start_send_recv)
//     the exchange that passes what it holds to rank r + 1 and receives rank r − 1's, so that
//     the transfer runs under the computation; it waits before step s + 1. Forward sends
//     (cp − 1) times the bytes of its k and v; nothing else is communicated.
//   - Backward with recomputation: the keys and values go round the ring again, and with each
//     block travels the sum of the dK and dV contributions of the ranks it has visited; after cp
//     steps and one last hop each rank has the whole dk and dv of its own keys and values.
//     Backward sends (cp − 1) times the bytes of k and v, then cp times as many in gradients
//     (none at cp = 1); by the time it computes step s's blocks, it has started the exchange of
//     step s + 1's keys and values (s < cp − 1) and sent the gradients of s blocks.
class RingAttention {
 public:
  RingAttention() = default;
  // Throws std::invalid_argument if seq_len is not a multiple of 2·cp (naming seq_len and 2·cp),
  // or the heads do not fit (q_heads a multiple of kv_heads, head_dim >= 1), before anything
  // else. Then prepares the merge of its blocks' partial results (merge_, of one chunk's shape)
  // in ctx's memory, once for every call: the ring must not outlive ctx's ledger.
  RingAttention(Context& ctx, Communicator& cp, const RingConfig& config);
  const RingConfig& config() const { return config_; }
  const CpLayout& layout() const { return layout_; }

  // q [2·B·C, Hq·hd], k, v [2·B·C, Hkv·hd]: this rank's rows in local order (q and k already
  // rotated by RoPE at their positions). o [2·B·C, Hq·hd], lse [2·B, Hq, C]: chunk j's lse of
  // sequence b at [j·B + b] (chunk-major, like the rows).
  void forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, Tensor& lse) const;
  // o and lse as forward made them; dout like o. dq, dk, dv (shapes of q, k, v) are overwritten
  // with the gradients of this rank's queries, keys and values.
  void backward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) const;

 private:
  Communicator* cp_ = nullptr;
  RingConfig config_;
  CpLayout layout_;
  AttentionMerge merge_;
};

// ---- the layer
//
// model::Attention (causal, GQA, RoPE) over sequences of seq_len tokens, each rank holding its
// 2·C tokens of each sequence in local order. The weights wq, wk, wv, wo are whole on every rank
// (model::Linear, model::Attention's names "name.wq", ... ".weight"): context parallelism cuts
// the tokens, not the weights. RoPE rotates each chunk's rows by that chunk's positions. The
// weight gradients this layer adds are this rank's tokens' share: the caller sums them over the
// cp group (in a model: together with data parallelism, over dp×cp), and the layer calls
// grad_done after its own share as model::Linear does.
class ContextParallelAttention {
 public:
  using Saved = model::Attention::Saved;  // q, k (after RoPE), v, o, lse of this rank's tokens
  ContextParallelAttention() = default;
  // Throws std::invalid_argument as model::Attention and RingAttention do.
  ContextParallelAttention(Communicator& cp, ParamList& params, const std::string& name,
                           const model::AttentionConfig& config, std::int64_t seq_len);
  // x, y [2·batch·C, d_model], local order.
  void forward(Context& ctx, const Tensor& x, int batch, Tensor& y, Saved& saved) const;
  void backward(Context& ctx, const Tensor& x, int batch, const Saved& saved, const Tensor& dy, Tensor& dx) const;
  const CpLayout& layout() const { return layout_; }

 private:
  Communicator* cp_ = nullptr;
  model::AttentionConfig config_;
  CpLayout layout_;
  model::Linear wq_, wk_, wv_, wo_;
};

}  // namespace k2c::sequence_parallel
