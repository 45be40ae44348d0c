// assignments/14_tensor_parallel/tensor_parallel.cpp — module 14: your implementation
// (contract: tensor_parallel.h). Read lectures/14_tensor_parallel.md first.
//
// Work in the order of the points table: f and g, the two linear layers, then the MLP (two
// column-parallel layers, one row-parallel), attention (the same, by whole heads), the block,
// and last the vocabulary: the embedding and the cross-entropy. Each piece is a few calls of
// ctx.ops around the unsharded layer's arithmetic (common/model/src/layers.cpp shows it) plus at
// most one collective (the loss: three).
#include "tensor_parallel.h"
#include "k2c/core/todo.h"

namespace k2c::tensor_parallel {

dist::Ticket f_backward(Communicator& tp, Tensor& dx) {
  (void)tp, (void)dx;
  K2C_TODO("f_backward: start the all-reduce (sum) of dx in place and return its ticket");
}

void g_forward(Communicator& tp, Tensor& y) {
  (void)tp, (void)y;
  K2C_TODO("g_forward: all-reduce (sum) y in place");
}

// ---- ColumnParallelLinear

ColumnParallelLinear::ColumnParallelLinear(Communicator& tp, ParamList& params, const std::string& name,
                                           std::int64_t in, std::int64_t out, Init init) {
  (void)tp, (void)params, (void)name, (void)in, (void)out, (void)init;
  K2C_TODO("ColumnParallelLinear: check out % n, register rows [r·out/n, (r+1)·out/n) with Init::shard");
}

void ColumnParallelLinear::forward(Context& ctx, const Tensor& x, Tensor& y) const {
  (void)ctx, (void)x, (void)y;
  K2C_TODO("ColumnParallelLinear::forward: y = x·W_rᵀ");
}

void ColumnParallelLinear::backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const {
  (void)ctx, (void)x, (void)dy, (void)dx;
  K2C_TODO("ColumnParallelLinear::backward: dx = dy·W_r, start f's all-reduce, dW_r += dyᵀ·x, wait");
}

void ColumnParallelLinear::backward_input(Context& ctx, const Tensor& dy, Tensor& dx, bool accumulate) const {
  (void)ctx, (void)dy, (void)dx, (void)accumulate;
  K2C_TODO("ColumnParallelLinear::backward_input: dx (+)= dy·W_r, nothing communicated");
}

void ColumnParallelLinear::backward_weight(Context& ctx, const Tensor& x, const Tensor& dy) const {
  (void)ctx, (void)x, (void)dy;
  K2C_TODO("ColumnParallelLinear::backward_weight: dW_r += dyᵀ·x, then grad_done");
}

// ---- RowParallelLinear

RowParallelLinear::RowParallelLinear(Communicator& tp, ParamList& params, const std::string& name,
                                     std::int64_t in, std::int64_t out, Init init) {
  (void)tp, (void)params, (void)name, (void)in, (void)out, (void)init;
  K2C_TODO("RowParallelLinear: check in % n, register columns [r·in/n, (r+1)·in/n) with Init::shard");
}

void RowParallelLinear::forward(Context& ctx, const Tensor& x, Tensor& y) const {
  (void)ctx, (void)x, (void)y;
  K2C_TODO("RowParallelLinear::forward: y = x_r·W_rᵀ, then g");
}

void RowParallelLinear::backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const {
  (void)ctx, (void)x, (void)dy, (void)dx;
  K2C_TODO("RowParallelLinear::backward: dW_r += dyᵀ·x_r, dx_r = dy·W_r, no communication");
}

// ---- ParallelMlp

ParallelMlp::ParallelMlp(Communicator& tp, ParamList& params, const std::string& name, std::int64_t d_model,
                         std::int64_t d_ff) {
  (void)tp, (void)params, (void)name, (void)d_model, (void)d_ff;
  K2C_TODO("ParallelMlp: gate and up column-parallel, down row-parallel");
}

void ParallelMlp::forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const {
  (void)ctx, (void)x, (void)y, (void)saved;
  K2C_TODO("ParallelMlp::forward: gate, up, swiglu on the local features, down (one all-reduce)");
}

void ParallelMlp::backward(Context& ctx, const Tensor& x, const Saved& saved, const Tensor& dy, Tensor& dx) const {
  (void)ctx, (void)x, (void)saved, (void)dy, (void)dx;
  K2C_TODO("ParallelMlp::backward: down, swiglu, both input gradients into dx, f started, weights, wait");
}

// ---- ParallelAttention

ParallelAttention::ParallelAttention(Communicator& tp, ParamList& params, const std::string& name,
                                     const model::AttentionConfig& config) {
  (void)tp, (void)params, (void)name, (void)config;
  K2C_TODO("ParallelAttention: check the head counts, wq/wk/wv column-parallel, wo row-parallel");
}

void ParallelAttention::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
                                Saved& saved) const {
  (void)ctx, (void)x, (void)positions, (void)batch, (void)y, (void)saved;
  K2C_TODO("ParallelAttention::forward: projections, RoPE and attention on the local heads, wo (one all-reduce)");
}

void ParallelAttention::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch,
                                 const Saved& saved, const Tensor& dy, Tensor& dx) const {
  (void)ctx, (void)x, (void)positions, (void)batch, (void)saved, (void)dy, (void)dx;
  K2C_TODO("ParallelAttention::backward: wo, attention, RoPE back, dx from q/k/v, f started, weights, wait");
}

// ---- ParallelBlock

ParallelBlock::ParallelBlock(Communicator& tp, ParamList& params, const std::string& name,
                             const model::BlockConfig& config) {
  (void)tp, (void)params, (void)name, (void)config;
  K2C_TODO("ParallelBlock: two replicated norms, ParallelAttention, ParallelMlp");
}

void ParallelBlock::forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y,
                            Saved& saved) const {
  (void)ctx, (void)x, (void)positions, (void)batch, (void)y, (void)saved;
  K2C_TODO("ParallelBlock::forward: h = x + attn(norm1(x)); y = h + mlp(norm2(h))");
}

void ParallelBlock::backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& saved,
                             const Tensor& dy, Tensor& dx) const {
  (void)ctx, (void)x, (void)positions, (void)batch, (void)saved, (void)dy, (void)dx;
  K2C_TODO("ParallelBlock::backward: the forward's steps in reverse, residuals added");
}

// ---- VocabParallelEmbedding

VocabParallelEmbedding::VocabParallelEmbedding(Communicator& tp, ParamList& params, const std::string& name,
                                               std::int64_t vocab, std::int64_t dim, Init init) {
  (void)tp, (void)params, (void)name, (void)vocab, (void)dim, (void)init;
  K2C_TODO("VocabParallelEmbedding: check vocab % n, register rows [r·V/n, (r+1)·V/n) with Init::shard");
}

void VocabParallelEmbedding::forward(Context& ctx, const Tensor& ids, Tensor& out, Saved& saved) const {
  (void)ctx, (void)ids, (void)out, (void)saved;
  K2C_TODO("VocabParallelEmbedding::forward: local ids and mask, look up, mask, all-reduce");
}

void VocabParallelEmbedding::backward(Context& ctx, const Saved& saved, const Tensor& dout) const {
  (void)ctx, (void)saved, (void)dout;
  K2C_TODO("VocabParallelEmbedding::backward: the masked rows of dout into the shard's gradient");
}

// ---- vocab_parallel_cross_entropy

double vocab_parallel_cross_entropy(Communicator& tp, Context& ctx, const Tensor& logits, const Tensor& targets,
                                    float grad_scale, Tensor& dlogits) {
  (void)tp, (void)ctx, (void)logits, (void)targets, (void)grad_scale, (void)dlogits;
  K2C_TODO("vocab_parallel_cross_entropy: max, target logit, sum of exps (three all-reduces), local gradient");
}

}  // namespace k2c::tensor_parallel
