// k2c/model/block.h — the transformer's residual block: attention and a feed-forward layer
// (SwiGLU, or a mixture of experts), each behind an RMSNorm, with residual dropout and optional
// activation checkpointing.
#pragma once

#include <memory>
#include <string>

#include "k2c/model/layers.h"
#include "k2c/model/moe.h"

namespace k2c::model {

struct BlockConfig {
  AttentionConfig attention;
  std::int64_t d_ff = 0;
  float norm_eps = 1e-5f;
  MoeConfig moe;  // moe.experts > 0: the feed-forward is a mixture of experts instead of d_ff's Mlp
};

// Pre-norm residual block: h = x + drop(attn(norm1(x))); out = h + drop(ffn(norm2(h))), where
// ffn is the SwiGLU Mlp or, with config.moe.experts > 0, the mixture of experts.
//
// With checkpointing, forward keeps only the block's output (the next block's input) and drops
// everything inside; backward recomputes the block's forward from its input first. Memory for
// one block's internals instead of all of them, for one more forward per block.
class Block {
 public:
  struct Internals {
    Tensor n1, h, n2, attn_out, mlp_out;
    RmsNorm::Saved norm1, norm2;
    Attention::Saved attn;
    Mlp::Saved mlp;
    Moe::Saved moe;
  };
  struct Saved {
    Tensor out;
    std::unique_ptr<Internals> internals;  // null after a checkpointed forward
    // The masks' key as forward drew them (seed, step, rows): backward and a recomputation use
    // it, so a pipeline that runs other micro-batches in between need not restore the context.
    DropoutKey dropout;
  };
  Block() = default;
  Block(ParamList& params, const std::string& name, const BlockConfig& config, int index);
  void forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, bool checkpoint,
               Saved& saved) const;
  void backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Saved& saved,
                const Tensor& dout, Tensor& dx) const;

 private:
  void run_forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const DropoutKey& base,
                   Internals& in,
                   Tensor& out) const;
  BlockConfig config_;
  int index_ = 0;
  RmsNorm norm1_, norm2_;
  Attention attn_;
  Mlp mlp_;
  Moe moe_;
  bool is_moe_ = false;
};

}  // namespace k2c::model
