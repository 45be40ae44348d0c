// autograder/13_zero/zero_reference.h — what the tests and the benchmark of module 13 share: the
// models they run, the contract's arithmetic of units and shards, the data-parallel reference
// every ZeRO run is held against, and one ZeRO rank with its ledgers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "k2c/dist/communicator.h"
#include "k2c/model/data.h"
#include "k2c/model/optim.h"
#include "k2c/model/transformer.h"
#include "zero.h"

namespace k2c::zero::reference {

namespace kd = k2c::dist;
namespace km = k2c::model;

// ---------------------------------------------------------------------------------------------
// models

// d 64, 2 layers, 4 heads (2 kv), ff 172, vocab 256, T 32: about 0.12 M parameters.
inline km::ModelConfig tiny_model(bool tied = false) {
  km::ModelConfig c = km::ModelConfig::tiny();
  c.tied_head = tied;
  return c;
}

// Width 2: the final norm's unit has 2 elements, fewer than 3 or 4 ranks, so some ranks own
// nothing of it; no unit divides evenly by 3 or 4, so every unit is padded somewhere.
inline km::ModelConfig narrow_model(bool tied) {
  km::ModelConfig c;
  c.vocab = 7, c.d_model = 2, c.n_layers = 1, c.q_heads = 1, c.kv_heads = 1, c.d_ff = 3, c.seq_len = 8;
  c.tied_head = tied;
  return c;
}

// Many thin layers (24 blocks of 12 k parameters): each unit is a small part of the model, as in
// the large models ZeRO is for, and a step still takes a fraction of a second on one CPU core.
inline km::ModelConfig deep_model() {
  km::ModelConfig c;
  c.vocab = 64, c.d_model = 32, c.n_layers = 24, c.q_heads = 2, c.kv_heads = 2, c.d_ff = 86, c.seq_len = 16;
  return c;
}

// The deep model twice as wide (1.2 M parameters): what an engine keeps off its ledgers shows
// as megabytes of heap, well above the allocator's and Open MPI's own bookkeeping.
inline km::ModelConfig wide_model() {
  km::ModelConfig c = deep_model();
  c.d_model = 64, c.d_ff = 171;
  return c;
}

// d 768, 48 layers, vocab 8192, T 512: 0.35 G parameters, 5.6 GB of training state in fp32 on
// one rank; 51 units, so the two that ZeRO-3 holds beyond its shard are a small part of it.
inline km::ModelConfig gpu_model() {
  km::ModelConfig c;
  c.vocab = 8192, c.d_model = 768, c.n_layers = 48, c.q_heads = 12, c.kv_heads = 12, c.d_ff = 2048, c.seq_len = 512;
  return c;
}

// ---------------------------------------------------------------------------------------------
// the contract's arithmetic (zero.h): a unit of S elements, B = ceil(S / n), P = n·B, and rank r
// owning clamp(S − r·B, 0, B) real elements

struct Units {
  int n = 1, r = 0;
  std::vector<std::int64_t> size;  // per unit: the layers with parameters, in order
  std::int64_t block(std::size_t u) const { return (size[u] + n - 1) / n; }
  std::int64_t padded(std::size_t u) const { return block(u) * n; }
  std::int64_t mine(std::size_t u) const { return std::clamp<std::int64_t>(size[u] - block(u) * r, 0, block(u)); }
  std::int64_t params() const { return sum([&](std::size_t u) { return size[u]; }); }
  std::int64_t shard() const { return sum([&](std::size_t u) { return mine(u); }); }
  std::int64_t padded_shard() const { return sum([&](std::size_t u) { return block(u); }); }
  std::int64_t padded_total() const { return sum([&](std::size_t u) { return padded(u); }); }
  std::int64_t max_padded() const {
    std::int64_t m = 0;
    for (std::size_t u = 0; u < size.size(); ++u) m = std::max(m, padded(u));
    return m;
  }
  // Bytes per rank of parameters, gradients and AdamW state that the stage cannot do without:
  // 4Ψ + 4Ψ + 8E, 4Ψ + 12E and 16E, E the rank's real elements.
  std::int64_t ideal_bytes(int stage) const {
    const std::int64_t psi = params(), e = shard();
    return stage == 1 ? 8 * psi + 8 * e : stage == 2 ? 4 * psi + 12 * e : 16 * e;
  }
  template <class F>
  std::int64_t sum(F f) const {
    std::int64_t t = 0;
    for (std::size_t u = 0; u < size.size(); ++u) t += f(u);
    return t;
  }
};

// From the parameters' shapes alone: `p` need not be materialized.
inline Units units_of(const km::Transformer& m, const km::ParamList& p, int n, int r) {
  Units u;
  u.n = n, u.r = r;
  for (int l = 0; l < m.layer_count(); ++l) {
    const auto [first, last] = m.layer_params(l);
    std::int64_t s = 0;
    for (km::ParamId id = first; id < last; ++id) s += p.info(id).shape.numel();
    if (s > 0) u.size.push_back(s);
  }
  return u;
}

inline Units units_of(const km::ModelConfig& c, int n, int r) {
  km::ParamList p;
  km::Transformer m(p, c);
  return units_of(m, p, n, r);
}

// ---------------------------------------------------------------------------------------------
// one rank's rows of a step

struct Batch {
  km::Tensor ids, targets;
  int rows = 0;
  float scale = 0;  // 1 / tokens of the global batch: the gradient of the mean loss
};

inline Batch make_batch(km::Ops& ops, km::MemoryLedger& ledger, const km::TokenBatch& tb, int global_batch) {
  Batch b;
  const std::int64_t count = static_cast<std::int64_t>(tb.inputs.size());
  b.ids = km::Tensor(ops.memory(), ledger, km::Category::activations, {count}, km::DType::i32);
  b.targets = km::Tensor(ops.memory(), ledger, km::Category::activations, {count}, km::DType::i32);
  ops.upload(b.ids, tb.inputs.data());
  ops.upload(b.targets, tb.targets.data());
  b.rows = tb.rows;
  b.scale = 1.0f / static_cast<float>(global_batch * tb.seq_len);
  return b;
}

// ---------------------------------------------------------------------------------------------
// the reference: data parallelism with one all-reduce (sum) per unit, started as soon as the
// unit's gradient is final so that it runs under the rest of backward (the strong baseline the
// speed tests compare with), clip_grad_norm when `clip` > 0, and one AdamW over all parameters

class Ddp {
 public:
  Ddp(kd::Communicator& w, const km::ModelConfig& c, km::Ops& ops, std::uint64_t seed, double clip = 0)
      : w_(w), ops_(ops), model_(params_, c), ctx_{ops, activations_, params_}, clip_(clip) {
    params_.materialize(ops, ledger_, seed);
    adam_ = std::make_unique<km::AdamW>(params_, ops, ledger_);
    // Each unit's flat range, and the layer after whose backward its gradient is final: the
    // lowest layer that uses it (a tied head's weight is the embedding's, final at layer 0).
    std::vector<int> unit_of_layer(static_cast<std::size_t>(model_.layer_count()), -1);
    for (int l = 0; l < model_.layer_count(); ++l) {
      const auto [first, last] = model_.layer_params(l);
      if (first == last) continue;
      unit_of_layer[static_cast<std::size_t>(l)] = static_cast<int>(ranges_.size());
      const km::ParamInfo& a = params_.info(first);
      const km::ParamInfo& z = params_.info(last - 1);
      ranges_.push_back({a.offset, z.offset + z.shape.numel() - a.offset, l});
    }
    for (int l = 0; l < model_.layer_count(); ++l)
      for (int used : model_.layer_uses(l))
        if (const int u = unit_of_layer[static_cast<std::size_t>(used)]; u >= 0)
          ranges_[static_cast<std::size_t>(u)].final_after = std::min(ranges_[static_cast<std::size_t>(u)].final_after, l);
  }

  double step(const Batch& b, float lr) {
    params_.zero_grads(ops_);
    std::vector<kd::Ticket> tickets;
    ctx_.on_layer = [&](int l, km::LayerEvent e) {
      if (e != km::LayerEvent::after_backward) return;
      for (const Range& r : ranges_)
        if (r.final_after == l) {
          float* g = params_.flat_grads().f32() + r.begin;
          tickets.push_back(w_.start_all_reduce(g, g, static_cast<std::size_t>(r.size), kd::DType::f32, kd::ReduceOp::sum));
        }
    };
    const double loss = model_.train_step(ctx_, b.ids, b.targets, b.rows, b.scale);
    ctx_.on_layer = nullptr;
    for (kd::Ticket t : tickets) w_.wait(t);
    if (clip_ > 0) grad_norm_ = km::clip_grad_norm(params_, ops_, clip_);
    adam_->step(lr);
    return loss;
  }
  double grad_norm() const { return grad_norm_; }  // the last step's, before clipping (clip > 0)

  std::vector<float> values() {
    std::vector<float> v(static_cast<std::size_t>(params_.numel()));
    ops_.download(v.data(), params_.flat_values());
    return v;
  }
  km::MemoryLedger& ledger() { return ledger_; }

 private:
  struct Range {
    std::int64_t begin, size;
    int final_after;
  };
  kd::Communicator& w_;
  km::Ops& ops_;
  km::MemoryLedger ledger_, activations_;
  km::ParamList params_;
  km::Transformer model_;
  km::Context ctx_;
  double clip_ = 0, grad_norm_ = 0;
  std::unique_ptr<km::AdamW> adam_;
  std::vector<Range> ranges_;
};

// One ZeRO rank: the engine, the ledger of its training state, and a context whose activations
// are recorded in a ledger of their own, so the first holds ZeRO's memory and nothing else.
struct ZeroRank {
  km::MemoryLedger ledger, activations;
  km::ParamList params;
  km::Transformer model;
  km::Context ctx;
  Units units;
  std::unique_ptr<Zero> zero;
  ZeroRank(kd::Communicator& w, const km::ModelConfig& c, km::Ops& ops, std::uint64_t seed, ZeroConfig config)
      : model(params, c), ctx{ops, activations, params}, units(units_of(model, params, w.size(), w.rank())) {
    zero = std::make_unique<Zero>(w, model, params, ops, ledger, seed, config);
  }
  double step(const Batch& b, float lr) { return zero->step(ctx, b.ids, b.targets, b.rows, b.scale, lr); }
};

}  // namespace k2c::zero::reference
