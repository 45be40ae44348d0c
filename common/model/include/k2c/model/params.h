// k2c/model/params.h — a model's parameters: flat fp32 buffers with a view per tensor.
//
// Layers register their parameters while the model is built; materialize() then allocates one
// flat buffer of values and one of gradients, in registration order, and gives each parameter a
// view into both. Flat buffers are what the distributed modules work on: DDP packs gradient
// buckets from contiguous ranges, ZeRO cuts the buffers into one shard per rank.
//
//   frozen   a parameter that is not trained: no gradient slot, skipped by optimizers and by the
//            gradient-ready callback
//   shared   a parameter used by several layers (tied weights): each use adds its gradient, and
//            the gradient is final after the last one
//
// Backward protocol: the model calls begin_backward(), each layer calls grad_done(id) after it
// has added its contribution to a parameter's gradient, and when a parameter's last use is done
// the gradient-ready callback fires for it, exactly once per backward. end_backward() checks
// that every trainable parameter got there (a missing or repeated call is a bug in the model).
// A backward pass holds that protocol through a BackwardPass (below), so one that throws half-way
// does not leave the list waiting for the rest of it.
//
// Storage the caller manages (ZeRO). materialize() may leave out either flat buffer; each
// parameter's view of it is then empty until the caller binds it to memory of its own
// (bind_value, bind_grad), and value() or grad() of an unbound parameter throws, naming it. A
// ZeRO-2 rank binds a layer's gradient views to a bucket for the layer's backward; a ZeRO-3 rank
// binds the value views to the layer's gathered parameters for as long as the layer runs.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "k2c/model/ops.h"
#include "k2c/model/tensor.h"

namespace k2c::model {

using ParamId = int;

// Where a parameter sits inside a larger, unsharded one. A tensor-parallel rank registers only
// its block of a weight: rank r of n in a column-parallel layer holds the [out/n, in] block of a
// [out, in] weight at offset (r·out/n, 0), in a row-parallel layer the [out, in/n] block at
// (0, r·in/n). `full` is the unsharded shape (same rank as the parameter) and offset[d] the first
// index of the block in dimension d, so the block spans offset[d] .. offset[d] + shape[d] − 1
// there. Offsets past the rank stay 0.
struct ShardOf {
  Shape full;
  std::array<std::int64_t, 4> offset{};
};

// How a parameter starts: zeros, ones, or normal(0, std) drawn from (seed, name, element index),
// so a parameter's initial values do not depend on what else the model holds or in which order.
//
// With `shard` set, the parameter is a block of the unsharded weight described there, and the
// "element index" is the row-major index in the FULL shape: element (i0, i1, ...) of the block
// starts as element (offset0 + i0, offset1 + i1, ...) of the full weight. Register the shard under
// the unsharded weight's name (the name is hashed into the draw), and every rank starts from
// exactly its slice of the weights that one process would make. ParamList::add rejects a shard
// of another rank or one that does not fit inside `full` (std::invalid_argument).
struct Init {
  enum Kind { zeros, ones, normal } kind = normal;
  float std = 0.02f;
  std::optional<ShardOf> shard{};
};

struct ParamInfo {
  std::string name;
  Shape shape;
  Init init;
  bool frozen = false;
  int uses = 1;                  // layers that add to its gradient in one backward
  std::int64_t offset = 0;       // elements before it in the flat value buffer
  std::int64_t grad_offset = -1; // elements before it in the flat gradient buffer; −1 if frozen
};

// Which flat buffers ParamList::materialize() allocates (see "Storage the caller manages").
struct ParamStorage {
  bool values = true, grads = true;
};

class ParamList {
 public:
  // Registers a parameter; init.shard (if set) is validated against `shape` here.
  ParamId add(std::string name, Shape shape, Init init, bool frozen = false);
  // One more layer uses parameter `id` (a tied weight); returns id.
  ParamId share(ParamId id);
  void freeze(ParamId id);  // before materialize()

  // Lays the parameters out (offsets), allocates the flat buffers `storage` asks for (ledger
  // categories: parameters, gradients), initialises the values from `seed` and zeroes the
  // gradients. After this, no parameter can be added.
  void materialize(Ops& ops, MemoryLedger& ledger, std::uint64_t seed, ParamStorage storage = {});
  bool materialized() const { return materialized_; }
  // Points parameter id's value (gradient) view at `data`, numel() floats of the caller's in
  // this backend's memory, or unbinds it (nullptr). Only where materialize() left the flat
  // buffer out (std::logic_error otherwise); a frozen parameter has no gradient to bind.
  void bind_value(ParamId id, float* data);
  void bind_grad(ParamId id, float* data);
  // Value elements [begin, end) of the flat layout as materialize() initialised them, into
  // `host`: a rank that holds only a shard of the values starts from the same bits.
  void initial_values(std::int64_t begin, std::int64_t end, float* host) const;

  int size() const { return static_cast<int>(info_.size()); }
  const ParamInfo& info(ParamId id) const { return info_.at(id); }
  // Both throw std::logic_error for a view that is not bound (see above); grad() also for a
  // frozen parameter.
  Tensor& value(ParamId id);
  Tensor& grad(ParamId id);
  // Empty where materialize() left them out.
  Tensor& flat_values() { return values_; }
  Tensor& flat_grads() { return grads_; }
  std::int64_t numel() const { return value_count_; }
  std::int64_t trainable_numel() const { return grad_count_; }
  std::vector<ParamId> trainable() const;

  // Zeroes the flat gradient buffer (bound gradient memory is its owner's to zero).
  void zero_grads(Ops& ops);

  // ---- backward protocol
  using ReadyFn = std::function<void(ParamId)>;
  void on_grad_ready(ReadyFn fn) { ready_ = std::move(fn); }
  void begin_backward();
  void grad_done(ParamId id);
  void end_backward();
  // Leaves a backward that an exception interrupted, so the next one can begin.
  void cancel_backward() { in_backward_ = false; }

 private:
  std::vector<ParamInfo> info_;
  bool materialized_ = false;
  std::uint64_t seed_ = 0;
  std::int64_t value_count_ = 0, grad_count_ = 0;
  Tensor values_, grads_;
  std::vector<Tensor> value_views_, grad_views_;
  std::vector<int> done_;
  bool in_backward_ = false;
  ReadyFn ready_;
};

// One backward of `params` as a scope: the constructor begins it, finish() ends it (and throws as
// end_backward() does when a parameter went unreported), and a scope left without finish(), by
// an exception half-way, cancels it, so the next backward can begin. Every backward of a whole
// model or of a part of one (Transformer::train_step, a pipeline stage) runs inside one.
class BackwardPass {
 public:
  explicit BackwardPass(ParamList& params) : params_(params) { params_.begin_backward(); }
  BackwardPass(const BackwardPass&) = delete;
  BackwardPass& operator=(const BackwardPass&) = delete;
  ~BackwardPass() {
    if (!finished_) params_.cancel_backward();
  }
  void finish() {
    finished_ = true;  // end_backward() leaves the backward itself, even when it throws
    params_.end_backward();
  }

 private:
  ParamList& params_;
  bool finished_ = false;
};

// The normal(0, 1) value that Init::normal scales for element `index` of a parameter whose name
// hashes to `name_hash`: the rule a sharded model follows to start from the same weights.
float init_normal(std::uint64_t seed, std::uint64_t name_hash, std::uint64_t index);
std::uint64_t name_hash(const std::string& name);

}  // namespace k2c::model
