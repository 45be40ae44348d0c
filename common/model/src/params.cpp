// params.cpp — see k2c/model/params.h.
#include "k2c/model/mask.h"
#include "k2c/model/params.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace k2c::model {

namespace {

// Throws unless `shard` describes a block of the same rank as `shape` that lies inside its full
// shape: a shard that pokes out would silently draw another weight's (or no weight's) values.
void check_shard(const std::string& name, const Shape& shape, const ShardOf& shard) {
  const std::string what = "parameter '" + name + "' " + shape.str() + " as a shard of " + shard.full.str();
  if (shard.full.rank != shape.rank)
    throw std::invalid_argument(what + ": the shard and the full shape must have the same rank");
  for (int d = 0; d < 4; ++d) {
    const std::int64_t off = shard.offset[d];
    if (d >= shape.rank) {
      if (off != 0)
        throw std::invalid_argument(what + ": offset " + std::to_string(off) + " in dimension " +
                                    std::to_string(d) + ", past the rank (must be 0)");
      continue;
    }
    if (off < 0 || off + shape[d] > shard.full[d])
      throw std::invalid_argument(what + ": dimension " + std::to_string(d) + " spans [" + std::to_string(off) +
                                  ", " + std::to_string(off + shape[d]) + "), outside [0, " +
                                  std::to_string(shard.full[d]) + ")");
  }
}

// The row-major index in the full shape of element `i` (row-major in `shape`) of a shard.
std::uint64_t full_index(std::int64_t i, const Shape& shape, const ShardOf& shard) {
  std::int64_t index = 0, stride = 1;
  for (int d = shape.rank - 1; d >= 0; --d) {  // peel coordinates off the fastest dimension first
    const std::int64_t coord = i % shape[d];
    i /= shape[d];
    index += (shard.offset[d] + coord) * stride;
    stride *= shard.full[d];
  }
  return static_cast<std::uint64_t>(index);
}

}  // namespace

std::uint64_t name_hash(const std::string& name) {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a: stable across platforms and runs
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

float init_normal(std::uint64_t seed, std::uint64_t hash, std::uint64_t index) {
  // Box-Muller on two independent uniforms in (0, 1] drawn from the counter.
  const std::uint64_t a = mask::mix(mask::mix(seed ^ hash) + 2 * index), b = mask::mix(mask::mix(seed ^ hash) + 2 * index + 1);
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

ParamId ParamList::add(std::string name, Shape shape, Init init, bool frozen) {
  if (materialized()) throw std::logic_error("parameter '" + name + "' added after materialize()");
  for (const ParamInfo& p : info_)
    if (p.name == name) throw std::invalid_argument("parameter '" + name + "' registered twice");
  if (init.shard) check_shard(name, shape, *init.shard);
  info_.push_back({std::move(name), shape, init, frozen});
  return static_cast<ParamId>(info_.size() - 1);
}

ParamId ParamList::share(ParamId id) {
  if (materialized()) throw std::logic_error("share() after materialize()");
  ++info_.at(id).uses;
  return id;
}

void ParamList::freeze(ParamId id) {
  if (materialized()) throw std::logic_error("freeze() after materialize()");
  info_.at(id).frozen = true;
}

void ParamList::materialize(Ops& ops, MemoryLedger& ledger, std::uint64_t seed, ParamStorage storage) {
  if (materialized()) throw std::logic_error("materialize() called twice");
  value_count_ = grad_count_ = 0;
  for (ParamInfo& p : info_) {
    p.offset = value_count_;
    value_count_ += p.shape.numel();
    p.grad_offset = p.frozen ? -1 : grad_count_;
    if (!p.frozen) grad_count_ += p.shape.numel();
  }
  materialized_ = true;
  seed_ = seed;
  if (storage.values) {
    values_ = Tensor(ops.memory(), ledger, Category::params, {value_count_});
    // Initial values are made on the host and uploaded: the rule lives in one place for every backend.
    std::vector<float> host(static_cast<std::size_t>(value_count_));
    initial_values(0, value_count_, host.data());
    ops.upload(values_, host.data());
  }
  if (storage.grads) grads_ = Tensor(ops.memory(), ledger, Category::grads, {grad_count_});
  for (const ParamInfo& p : info_) {
    value_views_.push_back(storage.values ? Tensor::view(values_.f32() + p.offset, p.shape) : Tensor());
    grad_views_.push_back(p.frozen || !storage.grads ? Tensor() : Tensor::view(grads_.f32() + p.grad_offset, p.shape));
  }
  zero_grads(ops);
  done_.assign(info_.size(), 0);
}

void ParamList::initial_values(std::int64_t begin, std::int64_t end, float* host) const {
  if (!materialized()) throw std::logic_error("initial_values() before materialize()");
  if (begin < 0 || begin > end || end > value_count_)
    throw std::invalid_argument("initial_values: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") is not inside the value buffer [0, " + std::to_string(value_count_) + ")");
  for (const ParamInfo& p : info_) {
    const std::int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.shape.numel());
    if (lo >= hi) continue;
    const std::uint64_t h = name_hash(p.name);
    // A shard draws each element at its index in the unsharded weight, so that the shards of all
    // ranks together hold exactly what one process would have made.
    const ShardOf* shard = p.init.shard ? &*p.init.shard : nullptr;
    for (std::int64_t at = lo; at < hi; ++at) {
      const std::int64_t i = at - p.offset;
      host[at - begin] =
          p.init.kind == Init::zeros  ? 0.0f
          : p.init.kind == Init::ones ? 1.0f
                                      : p.init.std * init_normal(seed_, h, shard ? full_index(i, p.shape, *shard)
                                                                                 : static_cast<std::uint64_t>(i));
    }
  }
}

namespace {
// Caller-managed storage is bound only where the flat buffer was left out: a view that pointed
// away from a flat buffer that still exists would leave two copies silently disagreeing.
void check_bind(const ParamList& params, ParamId id, bool flat_exists, const char* what) {
  if (!params.materialized()) throw std::logic_error(std::string(what) + " before materialize()");
  if (flat_exists)
    throw std::logic_error(std::string(what) + "('" + params.info(id).name +
                           "'): the flat buffer exists; materialize without it to bind memory of your own");
}
}  // namespace

void ParamList::bind_value(ParamId id, float* data) {
  check_bind(*this, id, !values_.empty(), "bind_value");
  value_views_.at(id) = data ? Tensor::view(data, info_[id].shape) : Tensor();
}

void ParamList::bind_grad(ParamId id, float* data) {
  check_bind(*this, id, !grads_.empty(), "bind_grad");
  if (info_.at(id).frozen) throw std::logic_error("bind_grad('" + info_[id].name + "'): the parameter is frozen");
  grad_views_.at(id) = data ? Tensor::view(data, info_[id].shape) : Tensor();
}

Tensor& ParamList::value(ParamId id) {
  if (!materialized()) throw std::logic_error("parameters used before materialize()");
  Tensor& v = value_views_.at(id);
  if (v.empty() && info_[id].shape.numel() > 0)
    throw std::logic_error("parameter '" + info_[id].name + "' has no values bound (a layer ran before its "
                           "parameters were gathered, or after they were freed)");
  return v;
}

Tensor& ParamList::grad(ParamId id) {
  if (!materialized()) throw std::logic_error("parameters used before materialize()");
  if (info_.at(id).frozen) throw std::logic_error("parameter '" + info_[id].name + "' is frozen: no gradient");
  Tensor& g = grad_views_.at(id);
  if (g.empty() && info_[id].shape.numel() > 0)
    throw std::logic_error("parameter '" + info_[id].name + "' has no gradient memory bound (its layer's backward "
                           "ran before a bucket was bound to it)");
  return g;
}

std::vector<ParamId> ParamList::trainable() const {
  std::vector<ParamId> ids;
  for (ParamId i = 0; i < size(); ++i)
    if (!info_[i].frozen) ids.push_back(i);
  return ids;
}

void ParamList::zero_grads(Ops& ops) {
  if (!grads_.empty()) ops.fill(grads_, 0.0f);
}

void ParamList::begin_backward() {
  if (in_backward_) throw std::logic_error("begin_backward() twice without end_backward()");
  in_backward_ = true;
  done_.assign(info_.size(), 0);
}

void ParamList::grad_done(ParamId id) {
  const ParamInfo& p = info_.at(id);
  if (p.frozen) return;  // frozen parameters take no gradient, whatever the layer does
  if (!in_backward_) throw std::logic_error("grad_done('" + p.name + "') outside a backward");
  if (++done_[id] > p.uses)
    throw std::logic_error("parameter '" + p.name + "' reported done " + std::to_string(done_[id]) +
                           " times, but has " + std::to_string(p.uses) + " uses");
  if (done_[id] == p.uses && ready_) ready_(id);
}

void ParamList::end_backward() {
  in_backward_ = false;
  for (ParamId i = 0; i < size(); ++i)
    if (!info_[i].frozen && done_[i] != info_[i].uses)
      throw std::logic_error("backward ended with parameter '" + info_[i].name + "' done " +
                             std::to_string(done_[i]) + " of " + std::to_string(info_[i].uses) + " times");
}

}  // namespace k2c::model
