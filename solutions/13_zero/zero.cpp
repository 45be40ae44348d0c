// solutions/13_zero/zero.cpp — reference solution of module 13 (contract: zero.h).
//
// The memory a rank spends on training state, per parameter, fp32 throughout as the model
// library trains: 4 bytes of value, 4 of gradient, 8 of AdamW moments (m and v) — 16 bytes, the
// same 16 as mixed precision's 2 + 2 + 12. Data parallelism keeps all 16 on every rank; each
// stage of ZeRO keeps 1/n of one more part:
//   stage 1  4 + 4 + 8/n     the moments are only read by the update of their own element
//   stage 2  4 + 12/n        the gradients are only read by that update too, once reduced
//   stage 3  16/n            the parameters are only read by one layer at a time
// and the traffic stays what data parallelism moves, 2Ψ(n−1)/n elements sent per rank: its
// all-reduce is a reduce-scatter plus an all-gather, and ZeRO only puts the update between the
// two halves. Stage 3 adds a second all-gather (in backward, the parameters having been freed
// after forward): 3Ψ(n−1)/n, less the last layer, whose parameters stay from its forward to its
// backward, which follows at once.
//
// Units. Everything is organised by the model's layers, through two things the library gives:
// each layer's parameters are one contiguous range of the flat buffers (Transformer::
// layer_params), and Context::on_layer is called before and after each layer's forward and
// backward. A layer with parameters is a unit; a tied head, which has none of its own, runs on
// the embedding's unit. A unit of S elements is padded to P = n·B (B = ceil(S/n)), because the
// library collectives take equal blocks: with the padding at the end the whole unit is one
// all-gather straight into a P-element buffer, and one reduce-scatter straight out of one, with
// no copies. Rank r owns elements [r·B, (r+1)·B) of the padded unit.
//
// Buffers that come and go (gathered parameters, gradient buckets, staging) are taken from pools
// of equal buffers that are only ever allocated when none is free: after the first step, a step
// allocates nothing. On a GPU an allocation or a free synchronises the device and would stall
// every overlap this file sets up; the ledger still shows the pools, i.e. what was needed at the
// busiest moment.
//
// Order. On NCCL, local work (the model's kernels, copies, fills: the caller puts the GPU
// backend on the world's compute stream with cuda_ops_use_stream) runs on that stream and
// collectives on the communicator's own; a started collective is ordered after the
// local work issued before it, and wait() makes later local work wait for it. So a buffer handed
// back to a pool after its last reader was *issued* may be given to the next collective at once:
// that collective runs after the reader. On MPI every local operation is done when it returns.
#include "zero.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

namespace k2c::zero {

using dist::DType;
using dist::ReduceOp;
using dist::Ticket;
using model::Category;
using model::LayerEvent;
using model::ParamId;
using model::Tensor;

namespace {

// One unit: a layer's parameters as ZeRO sees them.
struct Unit {
  std::int64_t begin = 0, size = 0;  // flat range [begin, begin + size): values and gradients alike
  std::int64_t block = 0;            // B: each rank's share of the padded unit
  std::int64_t mine = 0;             // this rank's real elements: clamp(size − r·B, 0, B)
  std::int64_t slot = 0;             // where this rank's block sits in the shard buffers
  ParamId first = 0, last = 0;       // its parameters, [first, last)
  int first_backward = -1, last_backward = -1;  // the layers of its first and last use in backward
  std::unique_ptr<model::AdamW> adam;

  std::int64_t padded(int n) const { return block * n; }
  std::int64_t own_begin(int r) const { return begin + std::min(size, block * r); }  // flat index
};

// Equal buffers of `elements` floats, allocated only when none is free.
class Pool {
 public:
  Pool(model::Ops& ops, model::MemoryLedger& ledger, Category category, std::int64_t elements)
      : ops_(ops), ledger_(ledger), category_(category), elements_(std::max<std::int64_t>(elements, 1)) {}
  float* take() {
    if (free_.empty()) {
      owned_.emplace_back(ops_.memory(), ledger_, category_, model::Shape{elements_});
      free_.push_back(owned_.back().f32());
    }
    float* p = free_.back();
    free_.pop_back();
    return p;
  }
  void give(float* p) { free_.push_back(p); }

 private:
  model::Ops& ops_;
  model::MemoryLedger& ledger_;
  Category category_;
  std::int64_t elements_;
  std::deque<Tensor> owned_;
  std::vector<float*> free_;
};

Tensor view(float* p, std::int64_t n) { return Tensor::view(p, {n}); }

}  // namespace

struct Zero::Impl {
  dist::Communicator& comm;
  const model::Transformer& model;
  model::ParamList& params;
  model::Ops& ops;
  model::MemoryLedger& ledger;
  ZeroConfig config;
  int n, r;

  std::vector<Unit> units;
  std::vector<int> unit_of_layer;  // each layer's unit (a tied head: the embedding's)
  Tensor value_shard, grad_shard;  // Σ B elements each: stage 3 values, stages 2 and 3 gradients

  // ---- stage 3: gathered units. At most two at a time: the running one and the prefetched one.
  struct Gathered {
    float* at = nullptr;
    Ticket ticket{};
    bool pending = false;
  };
  std::vector<Gathered> gathered;
  // ---- stages 2 and 3: gradient buckets, bound to a unit from its first backward use.
  std::vector<float*> bucket;
  // ---- reduce-scatters in flight, oldest first: at most one while the next unit's backward runs.
  struct Reduction {
    int unit;
    Ticket ticket;
    float* bucket;       // stages 2, 3: the bucket it reads
    float* staged_in;    // stage 1: a padded copy of the unit's gradients, if the unit needs padding
    float* staged_out;   // stage 1: where the rank's reduced block lands
  };
  std::deque<Reduction> reductions;

  std::int64_t max_padded = 0, max_block = 0;
  Pool gather_pool, bucket_pool, staging_pool, block_pool;

  // ---- clipping: the one f64 the ranks' sums of squares are all-reduced in (device memory on
  // NCCL, where a collective cannot read the host), and the last step's norm.
  Tensor norm_sum;
  double last_norm = std::numeric_limits<double>::quiet_NaN();

  Impl(dist::Communicator& c, const model::Transformer& m, model::ParamList& p, model::Ops& o,
       model::MemoryLedger& l, std::uint64_t seed, ZeroConfig cfg)
      : comm(c), model(m), params(p), ops(o), ledger(l), config(cfg), n(c.size()), r(c.rank()),
        max_padded(largest(m, p, c.size(), true)), max_block(largest(m, p, c.size(), false)),
        gather_pool(o, l, Category::params, max_padded), bucket_pool(o, l, Category::grads, max_padded),
        staging_pool(o, l, Category::comm, max_padded), block_pool(o, l, Category::comm, max_block) {
    if (config.stage < 1 || config.stage > 3)
      throw std::invalid_argument("zero: stage " + std::to_string(config.stage) + " (1, 2 or 3)");
    if (params.materialized()) throw std::invalid_argument("zero: the parameters are already materialized");
    for (ParamId id = 0; id < params.size(); ++id)
      if (params.info(id).frozen)
        throw std::invalid_argument("zero: parameter '" + params.info(id).name + "' is frozen (not supported)");
    params.materialize(ops, ledger, seed, {.values = config.stage < 3, .grads = config.stage < 2});
    lay_out_units();
    if (config.clip > 0) norm_sum = Tensor(ops.memory(), ledger, Category::comm, {2});  // 8 bytes
    if (config.stage >= 2) {
      std::int64_t total = 0;
      for (const Unit& u : units) total += u.block;
      grad_shard = Tensor(ops.memory(), ledger, Category::grads, {std::max<std::int64_t>(total, 1)});
      if (config.stage == 3) {
        value_shard = Tensor(ops.memory(), ledger, Category::params, {std::max<std::int64_t>(total, 1)});
        // The rank's block of every unit, from the same rule materialize() draws a full buffer
        // with; the padding stays zero.
        std::vector<float> host(static_cast<std::size_t>(value_shard.numel()), 0.0f);
        for (const Unit& u : units)
          params.initial_values(u.own_begin(r), u.own_begin(r) + u.mine, host.data() + u.slot);
        ops.upload(value_shard, host.data());
      }
    }
    // One AdamW per unit over the rank's range: exactly 8 bytes of state per owned element.
    for (Unit& u : units)
      u.adam = std::make_unique<model::AdamW>(params, ops, ledger, config.adamw, u.own_begin(r), u.own_begin(r) + u.mine);
  }

  // The largest padded unit (or block) of the model on n ranks, for the pools' buffer size.
  static std::int64_t largest(const model::Transformer& m, const model::ParamList& p, int n, bool padded) {
    std::int64_t most = 0;
    for (int l = 0; l < m.layer_count(); ++l) {
      const auto [first, last] = m.layer_params(l);
      std::int64_t size = 0;
      for (ParamId id = first; id < last; ++id) size += p.info(id).shape.numel();
      const std::int64_t block = (size + n - 1) / n;
      most = std::max(most, padded ? block * n : block);
    }
    return most;
  }

  void lay_out_units() {
    const int layers = model.layer_count();
    std::vector<int> unit_of_own_layer(static_cast<std::size_t>(layers), -1);
    std::int64_t slot = 0;
    for (int l = 0; l < layers; ++l) {
      const auto [first, last] = model.layer_params(l);
      if (first == last) continue;
      Unit u;
      u.first = first, u.last = last;
      u.begin = params.info(first).offset;
      u.size = params.info(last - 1).offset + params.info(last - 1).shape.numel() - u.begin;
      u.block = (u.size + n - 1) / n;
      u.mine = std::clamp<std::int64_t>(u.size - u.block * r, 0, u.block);
      u.slot = slot;
      slot += u.block;
      unit_of_own_layer[static_cast<std::size_t>(l)] = static_cast<int>(units.size());
      units.push_back(std::move(u));
    }
    // A layer runs on the one unit among the layers it uses that has parameters.
    for (int l = 0; l < layers; ++l) {
      int unit = -1;
      for (int used : model.layer_uses(l)) {
        const int u = unit_of_own_layer[static_cast<std::size_t>(used)];
        if (u < 0) continue;
        if (unit >= 0) throw std::invalid_argument("zero: layer " + std::to_string(l) + " uses two units");
        unit = u;
      }
      if (unit < 0) throw std::invalid_argument("zero: layer " + std::to_string(l) + " has no parameters");
      unit_of_layer.push_back(unit);
      // Backward runs the layers downwards: the first use of a unit is its highest layer.
      Unit& u = units[static_cast<std::size_t>(unit)];
      u.first_backward = std::max(u.first_backward, l);
      u.last_backward = u.last_backward < 0 ? l : std::min(u.last_backward, l);
    }
    gathered.assign(units.size(), {});
    bucket.assign(units.size(), nullptr);
  }

  // ------------------------------------------------------------------ stage 3: gather and free

  void start_gather(int u) {
    Gathered& g = gathered[static_cast<std::size_t>(u)];
    if (g.at) return;  // already here or on its way
    const Unit& unit = units[static_cast<std::size_t>(u)];
    g.at = gather_pool.take();
    g.ticket = comm.start_all_gather(value_shard.f32() + unit.slot, g.at, static_cast<std::size_t>(unit.block),
                                     DType::f32);
    g.pending = true;
  }

  // The unit's parameters in place and bound to its layers' views. Without prefetch this is
  // where the all-gather starts too, and the layer waits for all of it.
  void ensure_gathered(int u) {
    start_gather(u);
    Gathered& g = gathered[static_cast<std::size_t>(u)];
    if (!g.pending) return;
    comm.wait(g.ticket);
    g.pending = false;
    const Unit& unit = units[static_cast<std::size_t>(u)];
    for (ParamId id = unit.first; id < unit.last; ++id)
      params.bind_value(id, g.at + (params.info(id).offset - unit.begin));
  }

  // Unbinding first: a layer that reads a freed unit gets the library's error, not stale data.
  void free_gathered(int u) {
    Gathered& g = gathered[static_cast<std::size_t>(u)];
    const Unit& unit = units[static_cast<std::size_t>(u)];
    for (ParamId id = unit.first; id < unit.last; ++id) params.bind_value(id, nullptr);
    gather_pool.give(g.at);
    g = {};
  }

  // ------------------------------------------------------------------ gradients

  // Stages 2 and 3: a zeroed bucket for the unit's backward (backward adds into gradients). The
  // padding is zeroed too: it is summed over the ranks with everything else.
  void take_bucket(int u) {
    const Unit& unit = units[static_cast<std::size_t>(u)];
    float* b = bucket_pool.take();
    Tensor whole = view(b, unit.padded(n));
    ops.fill(whole, 0.0f);
    for (ParamId id = unit.first; id < unit.last; ++id) params.bind_grad(id, b + (params.info(id).offset - unit.begin));
    bucket[static_cast<std::size_t>(u)] = b;
  }

  // The unit's gradients are final (its last use in backward is done): sum them over the ranks,
  // each rank receiving its own block. Started, not waited for: it runs while backward goes on
  // with the layers below. The one before it is finished now, so that at most one reduction is in
  // flight while the next bucket fills.
  void start_reduce(int u) {
    const Unit& unit = units[static_cast<std::size_t>(u)];
    const std::size_t block = static_cast<std::size_t>(unit.block);
    Reduction red{u, {}, nullptr, nullptr, nullptr};
    if (config.stage >= 2) {
      red.bucket = bucket[static_cast<std::size_t>(u)];
      bucket[static_cast<std::size_t>(u)] = nullptr;
      for (ParamId id = unit.first; id < unit.last; ++id) params.bind_grad(id, nullptr);
      red.ticket = comm.start_reduce_scatter(red.bucket, grad_shard.f32() + unit.slot, block, DType::f32, ReduceOp::sum);
    } else {
      // Stage 1 reduces out of the full gradient buffer. A unit that needs padding would read
      // past its end (into the next unit, or past the buffer), so it goes through a padded copy.
      float* send = params.flat_grads().f32() + unit.begin;
      if (unit.padded(n) != unit.size) {
        red.staged_in = staging_pool.take();
        Tensor src = view(send, unit.size), dst = view(red.staged_in, unit.size);
        ops.copy(dst, src);
        Tensor tail = view(red.staged_in + unit.size, unit.padded(n) - unit.size);
        ops.fill(tail, 0.0f);
        send = red.staged_in;
      }
      // The reduced block cannot land in the buffer it is reduced from (the collective's input
      // and output must not overlap), so it lands aside and is copied in when done.
      red.staged_out = block_pool.take();
      red.ticket = comm.start_reduce_scatter(send, red.staged_out, block, DType::f32, ReduceOp::sum);
    }
    reductions.push_back(red);
    while (reductions.size() > 1) finish_oldest_reduction();
  }

  void finish_oldest_reduction() {
    Reduction red = reductions.front();
    reductions.pop_front();
    comm.wait(red.ticket);
    if (red.bucket) bucket_pool.give(red.bucket);
    if (red.staged_in) staging_pool.give(red.staged_in);
    if (red.staged_out) {
      const Unit& unit = units[static_cast<std::size_t>(red.unit)];
      Tensor dst = view(params.flat_grads().f32() + unit.own_begin(r), unit.mine), src = view(red.staged_out, unit.mine);
      ops.copy(dst, src);
      block_pool.give(red.staged_out);
    }
  }

  // ------------------------------------------------------------------ the step

  void on_layer(int l, LayerEvent e) {
    const int u = unit_of_layer[static_cast<std::size_t>(l)];
    const int last_layer = model.layer_count() - 1;
    const bool stage3 = config.stage == 3;
    switch (e) {
      case LayerEvent::before_forward:
        if (stage3) {
          ensure_gathered(u);
          if (config.prefetch && l < last_layer) start_gather(unit_of_layer[static_cast<std::size_t>(l + 1)]);
        }
        break;
      case LayerEvent::after_forward:
        // The last layer's parameters stay: its backward comes next.
        if (stage3 && l < last_layer) free_gathered(u);
        break;
      case LayerEvent::before_backward:
        if (stage3) {
          ensure_gathered(u);
          if (config.prefetch && l > 0) start_gather(unit_of_layer[static_cast<std::size_t>(l - 1)]);
        }
        if (config.stage >= 2 && l == units[static_cast<std::size_t>(u)].first_backward) take_bucket(u);
        break;
      case LayerEvent::after_backward:
        if (l == units[static_cast<std::size_t>(u)].last_backward) start_reduce(u);
        if (stage3) free_gathered(u);
        break;
    }
  }

  double step(model::Context& ctx, const Tensor& ids, const Tensor& targets, int batch, float grad_scale, float lr) {
    if (&ctx.params != &params) throw std::invalid_argument("zero: ctx.params is not the engine's parameter list");
    if (config.stage == 1) params.zero_grads(ops);
    // The hook for this step only; the caller's comes back however the step ends.
    struct Restore {
      model::Context& ctx;
      std::function<void(int, LayerEvent)> saved;
      ~Restore() { ctx.on_layer = std::move(saved); }
    } restore{ctx, std::move(ctx.on_layer)};
    ctx.on_layer = [this](int l, LayerEvent e) { on_layer(l, e); };
    const double loss = model.train_step(ctx, ids, targets, batch, grad_scale);
    while (!reductions.empty()) finish_oldest_reduction();
    if (config.clip > 0) clip_gradients();

    // Each rank updates its own block of every unit, with its own AdamW.
    for (Unit& u : units) {
      if (config.stage == 1) {
        u.adam->step(lr);
        continue;
      }
      float* values = config.stage == 2 ? params.flat_values().f32() + u.own_begin(r) : value_shard.f32() + u.slot;
      Tensor v = view(values, u.mine), g = view(shard_grads(u), u.mine);
      u.adam->step(lr, v, g);
    }
    if (config.stage < 3) gather_updated_values();
    return loss;
  }

  // The rank's reduced gradients of unit u: in the full gradient buffer at its own range (stage
  // 1), or its block of the gradient shard (stages 2 and 3).
  float* shard_grads(const Unit& u) {
    return config.stage == 1 ? params.flat_grads().f32() + u.own_begin(r) : grad_shard.f32() + u.slot;
  }

  // clip_grad_norm's rule over the whole model. Every element of the model has exactly one owner,
  // so the ranks' sums of squares over their real elements add up to the global sum; each is
  // taken in double, as global_grad_norm does, so that the norm agrees with data parallelism's
  // to about 1e-16 and the float scale almost always to the bit.
  void clip_gradients() {
    double sum = 0;
    for (const Unit& u : units)
      if (u.mine > 0) sum += ops.sum_squares(view(shard_grads(u), u.mine));
    ops.upload(norm_sum, &sum);
    comm.all_reduce(norm_sum.f32(), norm_sum.f32(), 1, DType::f64, ReduceOp::sum);
    ops.download(&sum, norm_sum);
    last_norm = std::sqrt(sum);
    if (last_norm <= config.clip) return;
    const float scale = static_cast<float>(config.clip / last_norm);
    for (const Unit& u : units) {
      if (u.mine == 0) continue;
      Tensor g = view(shard_grads(u), u.mine);
      ops.scale(g, scale);
    }
  }

  // Stages 1 and 2: every unit's updated blocks back to every rank. The send buffer is the unit's
  // gradient memory, which the update has just consumed: B elements at the unit's start in the
  // full gradient buffer (stage 1; S >= B), or the rank's gradient block (stage 2). A unit without
  // padding is gathered straight into the parameter buffer; one with padding would write past
  // its end there, so it goes through a staging buffer.
  void gather_updated_values() {
    float* const flat_values = params.flat_values().f32();
    std::vector<Ticket> tickets;
    for (const Unit& u : units) {
      float* send = config.stage == 1 ? params.flat_grads().f32() + u.begin : grad_shard.f32() + u.slot;
      Tensor src = view(flat_values + u.own_begin(r), u.mine), dst = view(send, u.mine);
      ops.copy(dst, src);
      const std::size_t block = static_cast<std::size_t>(u.block);
      if (u.padded(n) == u.size) {
        tickets.push_back(comm.start_all_gather(send, flat_values + u.begin, block, DType::f32));
        continue;
      }
      float* staged = staging_pool.take();
      comm.all_gather(send, staged, block, DType::f32);
      Tensor out = view(flat_values + u.begin, u.size), in = view(staged, u.size);
      ops.copy(out, in);
      staging_pool.give(staged);
    }
    for (Ticket t : tickets) comm.wait(t);
  }

  std::vector<float> gather_values() {
    std::vector<float> out(static_cast<std::size_t>(params.numel()));
    if (config.stage < 3) {
      ops.download(out.data(), params.flat_values());
      return out;
    }
    for (const Unit& u : units) {
      float* at = gather_pool.take();
      comm.all_gather(value_shard.f32() + u.slot, at, static_cast<std::size_t>(u.block), DType::f32);
      ops.download(out.data() + u.begin, view(at, u.size));
      gather_pool.give(at);
    }
    return out;
  }
};

Zero::Zero(dist::Communicator& comm, const model::Transformer& model, model::ParamList& params, model::Ops& ops,
           model::MemoryLedger& ledger, std::uint64_t seed, ZeroConfig config)
    : impl_(std::make_unique<Impl>(comm, model, params, ops, ledger, seed, config)) {}

Zero::~Zero() = default;

double Zero::step(model::Context& ctx, const model::Tensor& ids, const model::Tensor& targets, int batch,
                  float grad_scale, float lr) {
  return impl_->step(ctx, ids, targets, batch, grad_scale, lr);
}

double Zero::grad_norm() const { return impl_->last_norm; }

std::vector<float> Zero::gather_values() { return impl_->gather_values(); }

}  // namespace k2c::zero
