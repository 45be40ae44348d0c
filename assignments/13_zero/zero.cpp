// assignments/13_zero/zero.cpp — module 13: your implementation (contract: zero.h).
// Read lectures/13_zero.md first, and the handout (README.md) for the order to work in.
//
// Everything the engine keeps goes in Impl, which only this file sees: add whatever members you
// need. A plan that works, stage by stage:
//   - From the model: layer_count(), layer_params(l) (ids [first, last), one contiguous range of
//     the flat buffers once materialized) and layer_uses(l) (a tied head uses the embedding's).
//     Make one record per unit: its range, B, the rank's real elements, where its block sits in
//     your shard buffers, and its AdamW over the rank's range.
//   - ctx.on_layer gets (layer, event) before and after every forward and backward of a layer:
//     install yours for the step and restore the caller's afterwards.
//   - Stage 1: materialize with both flat buffers; after a unit's last backward use, start its
//     reduce-scatter; update with AdamW::step(lr); all-gather the parameters back.
//   - Stage 2: materialize without the gradient buffer; bind each unit's gradients to a zeroed
//     bucket at its first backward use (ParamList::bind_grad), reduce-scatter the bucket into
//     your gradient shard, update with AdamW::step(lr, values, grads).
//   - Stage 3: materialize with neither buffer; keep your block of every unit's values
//     (ParamList::initial_values gives its starting bits); bind a unit's values to its gathered
//     copy before the unit runs (ParamList::bind_value), unbind and free it after.
//   - Clipping, any stage: once every reduction is done, Ops::sum_squares of each unit's real
//     shard elements, summed in a double, one all-reduce of that double (on NCCL its bytes must
//     be in device memory), then Ops::scale of the shard if the norm exceeds clip.
#include "zero.h"
#include "k2c/core/todo.h"

namespace k2c::zero {

struct Zero::Impl {};

Zero::Zero(dist::Communicator& comm, const model::Transformer& model, model::ParamList& params, model::Ops& ops,
           model::MemoryLedger& ledger, std::uint64_t seed, ZeroConfig config) {
  (void)comm, (void)model, (void)params, (void)ops, (void)ledger, (void)seed, (void)config;
  K2C_TODO("Zero: materialize the parameters for the stage, lay out the units, make one AdamW per unit");
}

Zero::~Zero() = default;

double Zero::step(model::Context& ctx, const model::Tensor& ids, const model::Tensor& targets, int batch,
                  float grad_scale, float lr) {
  (void)ctx, (void)ids, (void)targets, (void)batch, (void)grad_scale, (void)lr;
  K2C_TODO("Zero::step: train_step under your on_layer hook, reduce-scatter, AdamW on the shard, all-gather");
}

double Zero::grad_norm() const {
  K2C_TODO("Zero::grad_norm: the last step's global gradient norm before clipping (NaN when clipping is off)");
}

std::vector<float> Zero::gather_values() {
  K2C_TODO("Zero::gather_values: every unit's blocks from every rank, in flat order");
}

}  // namespace k2c::zero
