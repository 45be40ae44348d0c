// assignments/16_sequence_parallel/sequence_parallel.cpp — module 16: your implementation
// (contract: sequence_parallel.h). Read lectures/16_sequence_parallel.md first.
//
// Work in the order of the points table. Part A: the two collectives on rows, then the block in
// plain tensor-parallel mode (module 14's block, built from model::Linear shards), then the same
// block with sequence parallelism (swap the all-reduces for reduce-scatters and all-gathers, run
// the norms and dropouts on your rows, sum the norms' gradients). Part B: the layout, the merge of
// two partial attention results, ring attention forward (start each hop before the blocks that
// hide it), backward (dK and dV travel with the keys), and last the layer around it.
#include "sequence_parallel.h"
#include "k2c/core/todo.h"

namespace k2c::sequence_parallel {

// ---- Part A: the collectives on rows

void all_gather_rows(Communicator& tp, const Tensor& shard, Tensor& whole) {
  (void)tp, (void)shard, (void)whole;
  K2C_TODO("all_gather_rows: one all_gather of the shard's floats into the whole");
}

void reduce_scatter_rows(Communicator& tp, const Tensor& partial, Tensor& shard) {
  (void)tp, (void)partial, (void)shard;
  K2C_TODO("reduce_scatter_rows: one reduce_scatter (sum) leaving this rank's rows of the sum");
}

// ---- Part A: the block

SequenceParallelBlock::SequenceParallelBlock(Communicator& tp, ParamList& params, const std::string& name,
                                             const model::BlockConfig& config, int index, bool sequence_parallel) {
  (void)tp, (void)params, (void)name, (void)config, (void)index, (void)sequence_parallel;
  K2C_TODO("SequenceParallelBlock: check the sizes, two whole norms, seven model::Linear shards (Init::shard)");
}

void SequenceParallelBlock::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
                                    Saved& saved) const {
  (void)ctx, (void)x, (void)positions, (void)batch, (void)y, (void)saved;
  K2C_TODO("SequenceParallelBlock::forward: norm, gather, attention, scatter, dropout, residual; again for the MLP");
}

void SequenceParallelBlock::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch,
                                     const Saved& saved, const Tensor& dy, Tensor& dx) const {
  (void)ctx, (void)x, (void)positions, (void)batch, (void)saved, (void)dy, (void)dx;
  K2C_TODO("SequenceParallelBlock::backward: the forward in reverse, gathers and scatters swapped, norm gradients summed");
}

// ---- Part B: the layout

CpLayout cp_layout(std::int64_t seq_len, int cp, int rank) {
  (void)seq_len, (void)cp, (void)rank;
  K2C_TODO("cp_layout: check seq_len % (2·cp), chunk = seq_len / (2·cp), chunks rank and 2·cp − 1 − rank");
}

std::vector<std::int32_t> local_positions(const CpLayout& layout) {
  (void)layout;
  K2C_TODO("local_positions: the first chunk's positions, then the second's");
}

std::vector<std::int64_t> local_rows(const CpLayout& layout, int batch) {
  (void)layout, (void)batch;
  K2C_TODO("local_rows: chunk-major, then sequence, then token: b·seq_len + position");
}

// ---- Part B: merging partial results

AttentionMerge::AttentionMerge(Context& ctx, int batch, int q_heads, int q_len, int head_dim) {
  (void)ctx, (void)batch, (void)q_heads, (void)q_len, (void)head_dim;
  K2C_TODO("AttentionMerge: remember the shape, prepare what every merge of it needs");
}

void AttentionMerge::merge(Context& ctx, Tensor& o, Tensor& lse, Tensor& o_part, const Tensor& lse_part) const {
  (void)ctx, (void)o, (void)lse, (void)o_part, (void)lse_part;
  K2C_TODO("AttentionMerge::merge: lse = log(e^lse + e^lse_part), o = the two outputs weighted by e^(lse_i − lse)");
}

// ---- Part B: ring attention

RingAttention::RingAttention(Context& ctx, Communicator& cp, const RingConfig& config) {
  (void)ctx, (void)cp, (void)config;
  K2C_TODO("RingAttention: check the heads, make the layout (which refuses a bad seq_len), prepare the merge");
}

void RingAttention::forward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
                            Tensor& lse) const {
  (void)ctx, (void)q, (void)k, (void)v, (void)o, (void)lse;
  K2C_TODO("RingAttention::forward: cp steps: start the hop, the visible blocks, merge, wait");
}

void RingAttention::backward(Context& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                             const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) const {
  (void)ctx, (void)q, (void)k, (void)v, (void)o, (void)lse, (void)dout, (void)dq, (void)dk, (void)dv;
  K2C_TODO("RingAttention::backward: keys round the ring again, dq here, dk and dv travelling with their keys");
}

// ---- Part B: the layer

ContextParallelAttention::ContextParallelAttention(Communicator& cp, ParamList& params, const std::string& name,
                                                   const model::AttentionConfig& config, std::int64_t seq_len) {
  (void)cp, (void)params, (void)name, (void)config, (void)seq_len;
  K2C_TODO("ContextParallelAttention: check the config, the layout, four whole model::Linear weights");
}

void ContextParallelAttention::forward(Context& ctx, const Tensor& x, int batch, Tensor& y, Saved& saved) const {
  (void)ctx, (void)x, (void)batch, (void)y, (void)saved;
  K2C_TODO("ContextParallelAttention::forward: projections, RoPE per chunk, ring attention, wo");
}

void ContextParallelAttention::backward(Context& ctx, const Tensor& x, int batch, const Saved& saved,
                                        const Tensor& dy, Tensor& dx) const {
  (void)ctx, (void)x, (void)batch, (void)saved, (void)dy, (void)dx;
  K2C_TODO("ContextParallelAttention::backward: wo, ring backward, RoPE back, the projections");
}

}  // namespace k2c::sequence_parallel
