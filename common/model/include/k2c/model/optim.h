// k2c/model/optim.h — optimizers, gradient clipping and the learning-rate schedule.
//
// Optimizers update every trainable parameter from its gradient view; their state (momentum,
// Adam's moments) is one flat buffer per kind in the ledger's "optimizer" category, laid out like
// the flat gradient buffer. Weight decay applies to matrices only (parameters of rank >= 2), not
// to norm gains.
//
// Ranges (ZeRO). An optimizer may instead own a contiguous range [begin, end) of the flat
// GRADIENT buffer (ParamList::flat_grads(), indices 0 .. trainable_numel()): its state is then
// end − begin elements (element k is gradient element begin + k), and step() updates only the
// parts of the trainable parameters that fall in the range, cutting through parameters where the
// boundaries do. Every update is elementwise, so ranges that together cover the buffer give
// exactly the bits of one optimizer over all of it. Because frozen parameters have values but no
// gradient slot, gradient element g of a parameter is value element g − grad_offset + offset:
// the range's values are contiguous in the value buffer only when no frozen parameter lies
// inside it. An empty range holds no state and steps nothing (its state tensors are empty).
// A rank that holds no flat buffer (ZeRO-2 and 3, see ParamStorage) passes the range's
// values and gradients to step() in buffers of its own instead.
#pragma once

#include <cstdint>

#include "k2c/model/ops.h"
#include "k2c/model/params.h"

namespace k2c::model {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

class AdamW {
 public:
  // State for the whole gradient buffer.
  AdamW(ParamList& params, Ops& ops, MemoryLedger& ledger, AdamWConfig config = {});
  // State for gradient elements [begin, end) only: 8·(end − begin) bytes of optimizer state.
  // Throws std::invalid_argument unless 0 <= begin <= end <= params.trainable_numel().
  AdamW(ParamList& params, Ops& ops, MemoryLedger& ledger, AdamWConfig config, std::int64_t begin,
        std::int64_t end);
  void step(float lr);  // one update of every trainable element in the range
  // The same update on the caller's copies of the range: `values` and `grads` hold end − begin
  // elements each, element k being gradient element begin + k (values of frozen parameters are
  // not in it). Throws std::invalid_argument on another length.
  void step(float lr, Tensor& values, const Tensor& grads);
  int steps() const { return t_; }
  std::int64_t begin() const { return begin_; }
  std::int64_t end() const { return end_; }
  Tensor& first_moment() { return m_; }   // [end − begin]
  Tensor& second_moment() { return v_; }  // [end − begin]
  void set_steps(int t) { t_ = t; }  // a resumed run continues the bias correction

 private:
  ParamList& params_;
  Ops& ops_;
  AdamWConfig config_;
  std::int64_t begin_ = 0, end_ = 0;
  Tensor m_, v_;
  int t_ = 0;
};

class Sgd {
 public:
  Sgd(ParamList& params, Ops& ops, MemoryLedger& ledger, float momentum = 0.0f, float weight_decay = 0.0f);
  // Gradient elements [begin, end) only (momentum state, if any, of end − begin elements); the
  // same validation as AdamW's.
  Sgd(ParamList& params, Ops& ops, MemoryLedger& ledger, float momentum, float weight_decay,
      std::int64_t begin, std::int64_t end);
  void step(float lr);
  std::int64_t begin() const { return begin_; }
  std::int64_t end() const { return end_; }

 private:
  ParamList& params_;
  Ops& ops_;
  float beta_, weight_decay_;
  std::int64_t begin_ = 0, end_ = 0;
  Tensor momentum_;  // empty without momentum (or with an empty range)
};

// The L2 norm of all trainable gradients together, summed in registration order.
double global_grad_norm(ParamList& params, Ops& ops);
// Scales the gradients so that their global norm is at most max_norm (max_norm <= 0: no clipping);
// returns the norm before.
double clip_grad_norm(ParamList& params, Ops& ops, double max_norm);

// Linear warm-up from 0 over `warmup` steps, then a cosine from max_lr down to min_lr at `total`
// (and min_lr after it). Steps count from 0.
float cosine_lr(int step, int warmup, int total, float max_lr, float min_lr);

}  // namespace k2c::model
