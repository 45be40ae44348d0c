// k2c/model/layers.h — the layers of a decoder-only transformer, each with forward and backward
// (the residual block that puts them together is in block.h, the mixture of experts in moe.h).
//
// There is no autograd: each layer's backward is written out, and what forward keeps for it is
// an explicit `Saved` value the caller owns. That makes two things visible that the parallel
// modules are about: which activations are alive at a time (a pipeline keeps one Saved per
// micro-batch in flight), and when each parameter's gradient becomes final (the moment DDP may
// start reducing it).
//
// Shapes: activations are [N, D] with N = batch·T tokens, batch-major. Backward functions add
// into parameter gradients (so tied weights and micro-batches sum) and overwrite input gradients.
// A caller may pass dx = nullptr where the input gradient is not wanted.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>

#include "k2c/model/ops.h"
#include "k2c/model/params.h"
#include "k2c/model/tensor.h"

namespace k2c::model {

// The moments around a layer's work at which Transformer calls Context::on_layer.
enum class LayerEvent { before_forward, after_forward, before_backward, after_backward };

// What every layer call needs: the backend, the ledger activations are recorded in, the
// parameters, and the run's dropout state.
struct Context {
  Ops& ops;
  MemoryLedger& ledger;
  ParamList& params;
  float dropout = 0.0f;            // residual dropout probability; 0 in evaluation
  std::uint64_t seed = 0, step = 0;
  std::int64_t row_offset = 0;     // this rank's first row in the global batch (dropout masks)
  float loss_scale = 1.0f;         // the cross-entropy's grad_scale: auxiliary losses use it too
  double aux_loss = 0;             // auxiliary losses (MoE balance) added up by forward passes
  // Called, if set, before and after each forward and each backward of a Transformer's layers
  // (numbered as Transformer::layer_count() says): where ZeRO-3 gathers a layer's parameters
  // just before the layer runs and frees them after it.
  std::function<void(int layer, LayerEvent event)> on_layer;
  // The dtype of the activations that pass between a layer's operations (ops.h's [bf16]): fp32,
  // or bf16 for half the bytes; the MoE layer's experts follow it too (their input rows, gated
  // activations and their gradients). The MoE layer's routing and the experts' summed outputs,
  // parameters and their gradients stay fp32; the residual stream has its own dtype, below.
  DType activations = DType::f32;
  // The dtype of the residual stream: the blocks' inputs and outputs, the sums between a block's
  // two branches, and their gradients. fp32, or bf16 (half the bytes of every pass over the
  // stream, as Megatron-LM keeps it unless told otherwise) where no dropout runs: dropout takes
  // fp32 only.
  DType residual = DType::f32;

  Tensor tensor(Shape shape, Category c = Category::activations, DType t = DType::f32) {
    return Tensor(ops.memory(), ledger, c, shape, t);
  }
  // An activation between operations, in the run's activation dtype.
  Tensor activation(Shape shape) { return tensor(shape, Category::activations, activations); }
  // A tensor of the residual stream (or its gradient), in the run's residual dtype.
  Tensor residual_stream(Shape shape) { return tensor(shape, Category::activations, residual); }
  // Adds into a parameter's gradient unless it is frozen, then reports the use done.
  bool trains(ParamId id) const { return !params.info(id).frozen; }
};

// Throws std::invalid_argument, naming `who`, unless `residual` is a residual dtype a run can have
// with this dropout: f32, or bf16 with no dropout.
void check_residual(DType residual, float dropout, const std::string& who);

// y = x·Wᵀ with W [out, in] (no bias: the models of this course have none).
class Linear {
 public:
  Linear() = default;
  Linear(ParamList& params, const std::string& name, std::int64_t in, std::int64_t out, Init init = {});
  // A Linear that uses an existing [out, in] weight (a head tied to the embedding).
  static Linear tied(ParamList& params, ParamId weight);
  void forward(Context& ctx, const Tensor& x, Tensor& y) const;
  // dW += dyᵀ·x, then dx = dy·W (if dx), then the weight reports done.
  void backward(Context& ctx, const Tensor& x, const Tensor& dy, Tensor* dx) const;
  // Several Linear layers that read the same x (q, k and v; gate and up), as one shared-input
  // operation of the backend: ys[i] = x·W_iᵀ; backward adds each dW_i, writes dx = Σ dy_i·W_i and
  // reports the weights done in the order given.
  static void forward_shared(Context& ctx, const Tensor& x, std::initializer_list<const Linear*> layers,
                             std::initializer_list<Tensor*> ys);
  static void backward_shared(Context& ctx, const Tensor& x, std::initializer_list<const Linear*> layers,
                              std::initializer_list<const Tensor*> dys, Tensor* dx);
  ParamId weight() const { return w_; }
  std::int64_t in() const { return in_; }
  std::int64_t out() const { return out_; }

 private:
  ParamId w_ = -1;
  std::int64_t in_ = 0, out_ = 0;
};

class Embedding {
 public:
  Embedding() = default;
  Embedding(ParamList& params, const std::string& name, std::int64_t vocab, std::int64_t dim, Init init = {});
  void forward(Context& ctx, const Tensor& ids, Tensor& out) const;
  void backward(Context& ctx, const Tensor& ids, const Tensor& dout) const;
  ParamId weight() const { return w_; }

 private:
  ParamId w_ = -1;
  std::int64_t vocab_ = 0, dim_ = 0;
};

class RmsNorm {
 public:
  struct Saved {
    Tensor rstd;
  };
  RmsNorm() = default;
  RmsNorm(ParamList& params, const std::string& name, std::int64_t dim, float eps = 1e-5f);
  void forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const;
  // dx = the norm's input gradient, plus residual_dy where given (the gradient that went around
  // the norm in a residual block, added in the same pass on the GPU).
  void backward(Context& ctx, const Tensor& x, const Saved& saved, const Tensor& dy, Tensor& dx,
                const Tensor* residual_dy = nullptr) const;
  ParamId weight() const { return g_; }

 private:
  ParamId g_ = -1;
  std::int64_t dim_ = 0;
  float eps_ = 1e-5f;
};

struct AttentionConfig {
  int d_model = 0, q_heads = 1, kv_heads = 1;
  float rope_theta = 10000.0f;
  int head_dim() const { return d_model / q_heads; }
};

// Causal self-attention with grouped-query heads and rotary positions: q, k, v projections,
// RoPE on q and k, softmax attention, output projection.
class Attention {
 public:
  struct Saved {
    Tensor q, k, v, o, lse;  // q and k after RoPE
  };
  Attention() = default;
  Attention(ParamList& params, const std::string& name, const AttentionConfig& config);
  // x, y: [batch·T, d_model]; positions i32 [T].
  void forward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, Tensor& y, Saved& saved) const;
  void backward(Context& ctx, const Tensor& x, const Tensor& positions, int batch, const Saved& saved,
                const Tensor& dy, Tensor& dx) const;
  const AttentionConfig& config() const { return config_; }

 private:
  AttentionConfig config_;
  Linear wq_, wk_, wv_, wo_;
};

// SwiGLU feed-forward: y = W_down (silu(W_gate x) · W_up x).
class Mlp {
 public:
  struct Saved {
    Tensor gate, up, h;
  };
  Mlp() = default;
  Mlp(ParamList& params, const std::string& name, std::int64_t d_model, std::int64_t d_ff);
  void forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const;
  void backward(Context& ctx, const Tensor& x, const Saved& saved, const Tensor& dy, Tensor& dx) const;

 private:
  Linear gate_, up_, down_;
};

}  // namespace k2c::model
