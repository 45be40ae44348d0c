// k2c/model/transformer.h — a decoder-only transformer built from the layers of layers.h.
//
//   ids → embedding → blocks (pre-norm attention + SwiGLU) → final RMSNorm → head → logits
//
// The head is untied by default (its own [vocab, d_model] weight); `tied_head` shares the
// embedding's weight instead. train_step runs forward, the fused softmax cross-entropy and
// backward, adding into the gradients; the parameters' gradient-ready callbacks fire during it.
//
// Layer by layer. The model is a sequence of layers in the order forward runs them: 0 the
// embedding, 1 .. n_layers the blocks, n_layers + 1 the final norm, n_layers + 2 the head.
// Forward and train_step call ctx.on_layer (if set) around each layer's forward and backward,
// and each layer's parameters are one contiguous stretch of the flat buffers: the units ZeRO
// shards, gathers and frees.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k2c/model/block.h"

namespace k2c::model {

struct ModelConfig {
  int vocab = 256, d_model = 64, n_layers = 2, q_heads = 4, kv_heads = 2;
  std::int64_t d_ff = 172;
  int seq_len = 32;
  float rope_theta = 10000.0f, norm_eps = 1e-5f, init_std = 0.02f;
  bool tied_head = false;
  // A mixture of experts in every block instead of the d_ff MLP when experts > 0.
  int experts = 0, top_k = 2, shared_experts = 1;
  std::int64_t d_expert = 0;
  float balance_coef = 0.01f;

  void check() const;  // throws std::invalid_argument naming the bad field
  std::int64_t parameter_count() const;
  // Training FLOPs per token (forward + backward = 3× forward): 6 per matrix weight a token
  // passes through (with experts: the router, its top_k experts and the shared ones) plus the
  // attention scores and weighted sums (12·layers·d·T, the causal half not subtracted, as the
  // usual MFU convention counts them).
  double train_flops_per_token() const;
  std::string describe() const;  // "d 64, 2 layers, 4 heads (2 kv), ff 172, vocab 256, T 32: 0.12 M parameters"

  static ModelConfig tiny();        // CPU tests: seconds per step on 2 cores
  static ModelConfig dense_135m();  // the GPU benchmark's model (d 768, 12 layers, T 1024, V 32768)
};

class Transformer {
 public:
  struct Saved {
    Tensor positions, x0, xf, logits;
    std::vector<Block::Saved> blocks;
    RmsNorm::Saved final_norm;
  };

  Transformer(ParamList& params, const ModelConfig& config);
  const ModelConfig& config() const { return config_; }

  // ids i32 [batch·T] → saved.logits [batch·T, vocab]. With checkpoint, each block keeps only its
  // output (see Block).
  void forward(Context& ctx, const Tensor& ids, int batch, bool checkpoint, Saved& saved) const;
  // Forward, cross-entropy against targets i32 [batch·T] (−1 ignored), backward with
  // dlogits scaled by grad_scale. Returns the summed loss of this call's tokens (without the MoE
  // balance term, which ctx.aux_loss holds afterwards and whose gradient is included).
  double train_step(Context& ctx, const Tensor& ids, const Tensor& targets, int batch, float grad_scale,
                    bool checkpoint = false) const;
  // Summed loss, no backward.
  double evaluate(Context& ctx, const Tensor& ids, const Tensor& targets, int batch) const;

  // ---- layer by layer (see the top of this file)
  int layer_count() const { return config_.n_layers + 3; }
  // The parameters layer l registered: ids [first, last), consecutive, so after materialize()
  // their values (and, none being frozen, their gradients) are one contiguous range of the flat
  // buffers. A tied head registered none.
  struct LayerParams {
    ParamId first = 0, last = 0;
  };
  LayerParams layer_params(int l) const;
  // The layers whose parameters layer l uses: {l}, and for a tied head {0, l} (the embedding's
  // weight). Throws std::out_of_range outside [0, layer_count()).
  std::vector<int> layer_uses(int l) const;

 private:
  // Calls ctx.on_layer if set.
  static void event(Context& ctx, int layer, LayerEvent e) {
    if (ctx.on_layer) ctx.on_layer(layer, e);
  }
  std::vector<LayerParams> layer_params_;
  ModelConfig config_;
  Embedding embed_;
  std::vector<Block> blocks_;
  RmsNorm final_norm_;
  Linear head_;
};

}  // namespace k2c::model
