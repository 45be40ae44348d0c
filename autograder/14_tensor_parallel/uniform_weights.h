// autograder/14_tensor_parallel/uniform_weights.h — weights for module 14's large timed runs (the
// performance test and k2c_tensor_parallel).
//
// The library draws initial values with a Box-Muller transform per element on the host, which
// for the 700 million weights of a d 8192 MLP takes longer than everything timed. These runs
// materialize their ParamList without the flat value buffer (ParamStorage{.values = false}) and
// bind each weight to memory of their own, filled with uniform values in ±1/sqrt(fan-in) from a
// hash of (the weight's name, the element's index in the UNSHARDED weight). So, as with
// Init::shard, a shard holds exactly its slice of what one process holds, and an unsharded and
// a tensor-parallel MLP built from the same names compute the same function.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "k2c/core/random.h"
#include "k2c/model/params.h"

namespace k2c::tp_harness {

// Binds every parameter of `params` (materialized without values; matrices only) to a new
// tensor from ops.memory() recorded in `ledger`, and returns the tensors: keep them alive as
// long as the parameters are used.
inline std::vector<model::Tensor> bind_uniform_weights(model::ParamList& params, model::Ops& ops,
                                                       model::MemoryLedger& ledger) {
  std::vector<model::Tensor> owned;
  owned.reserve(static_cast<std::size_t>(params.size()));
  for (model::ParamId id = 0; id < params.size(); ++id) {
    const model::ParamInfo& p = params.info(id);
    const bool shard = p.init.shard.has_value();
    const model::Shape full = shard ? p.init.shard->full : p.shape;
    const std::int64_t r0 = shard ? p.init.shard->offset[0] : 0, c0 = shard ? p.init.shard->offset[1] : 0;
    const std::uint64_t seed = model::name_hash(p.name);
    const float a = 1.0f / std::sqrt(static_cast<float>(full[1]));  // keeps activations of order 1
    std::vector<float> host(static_cast<std::size_t>(p.shape.numel()));
    for (std::int64_t i = 0; i < p.shape[0]; ++i)
      for (std::int64_t j = 0; j < p.shape[1]; ++j)
        host[static_cast<std::size_t>(i * p.shape[1] + j)] =
            k2c::uniform_at(seed, static_cast<std::uint64_t>((r0 + i) * full[1] + c0 + j), -a, a);
    owned.emplace_back(ops.memory(), ledger, model::Category::params, p.shape);
    ops.upload(owned.back(), host.data());
    params.bind_value(id, owned.back().f32());
  }
  return owned;
}

}  // namespace k2c::tp_harness
