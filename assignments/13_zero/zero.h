// assignments/13_zero/zero.h — the contract of module 13 (do not edit).
//
// ZeRO: data parallelism in which no rank keeps a full copy of the training state. Every rank
// trains the same transformer (k2c/model/transformer.h) on its own rows of each global batch, as
// in DDP, but the optimizer state (stage 1), the gradients too (stage 2) and the parameters too
// (stage 3) are cut into one shard per rank, and collectives bring each piece to where it is
// needed for as long as it is needed. The layers, the loss, AdamW and the data are the model
// library's; what you write is the sharding, the collectives and the bookkeeping of memory.
//
// Units and shards. The model's layers (Transformer::layer_count(): embedding, blocks, final
// norm, head) each registered a contiguous range of the flat parameter buffer, of S elements.
// Every layer with S > 0 is one unit. The library collectives take equal blocks, so a unit is
// padded at its end to P = n·B elements, B = ceil(S / n) = block_of(S, n, 0).size, and rank r of
// n owns block r of the padded unit: elements [r·B, (r+1)·B), of which the real ones are
// [r·B, min((r+1)·B, S)). A unit smaller than the number of ranks leaves some ranks an empty
// block. The rank's shard is its blocks of every unit.
//
// The stages, each keeping less than the one before (what a rank holds between steps):
//   stage 1  all parameters and all gradients; AdamW state for its shard only (one AdamW per
//            unit over the rank's range, k2c/model/optim.h). After backward, each unit's
//            gradients are reduce-scattered (sum); the rank updates its shard and all-gathers
//            every unit's parameters back.
//   stage 2  as stage 1, but no full gradient buffer: a unit's gradients are accumulated in a
//            bucket of P elements bound to its parameters for the unit's backward, then
//            reduce-scattered into the rank's gradient shard, and the bucket is reused.
//   stage 3  as stage 2, but no full parameter buffer: the rank holds its shard of the
//            parameters, and a unit's parameters are all-gathered just before the unit runs,
//            forward and again in backward, and freed after it. The last layer's stay from its
//            forward to its backward. With prefetch, the next unit's all-gather is started
//            when a unit begins, so it moves while this one computes.
// Traffic per step, in the bytes k2c/dist/counting.h counts (4 bytes per element):
//   stages 1, 2  one reduce-scatter and one all-gather of every unit: Σ 4·P each
//   stage 3      reduce-scatter Σ 4·P; all-gather Σ 4·P in forward and again in backward for
//                every unit but the last layer's
// and no other collective, except, with clipping on, one all-reduce (sum) of one f64: 8 bytes.
// Clipping (clip > 0) is clip_grad_norm's (k2c/model/optim.h) over the whole model: after the
// reductions, the global norm of the summed gradients is the square root of the sum over ranks
// of each rank's Σ g² over its real shard elements, and if it exceeds clip, every rank scales its
// shard of the gradients by clip / norm before AdamW.
// Memory (the ledger given to the constructor), beyond the shard:
//   stage 2  gradients: at most two units' buckets at once (one being filled by backward while
//            the one before it is reduced); three with a tied head, whose unit (the embedding's)
//            collects the head's gradient first and its own last, so its bucket lasts the whole
//            backward
//   stage 3  the same, and parameters: at most two units gathered at once (the running one and
//            the one being prefetched; one without prefetch)
// Optimizer state: exactly 8 bytes per element of the rank's real shard.
//
// Results. After every step all ranks hold bit-identical parameters. At 1 and 2 ranks they are
// bit-identical with data parallelism that all-reduces (sum) the gradients and steps one AdamW
// over all parameters, since a sum of two numbers is the same in any order; at more ranks the
// reductions may add in another order, and the tests allow a tolerance.
//
// Tests: autograder/13_zero/test_zero.cpp. Lecture: lectures/13_zero.md.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "k2c/dist/communicator.h"
#include "k2c/model/optim.h"
#include "k2c/model/transformer.h"

namespace k2c::zero {

struct ZeroConfig {
  int stage = 1;           // 1, 2 or 3
  bool prefetch = true;    // stage 3: gather the next unit while this one runs
  double clip = 0;         // largest global gradient norm before AdamW (<= 0: no clipping)
  model::AdamWConfig adamw{};
};

class Zero {
 public:
  // Takes over `params`: registered by `model`, not yet materialized; the constructor materializes
  // it with the flat buffers its stage keeps (ParamList::materialize and ParamStorage), from
  // `seed`, so that every rank starts from the values one process would have. Every byte the
  // engine allocates (parameters, gradients, optimizer state, communication buffers) is recorded
  // in `ledger`; tensors come from ops.memory() (host memory on MPI, device memory on NCCL) and
  // computations go through `ops`. `comm` connects the data-parallel ranks; all references must
  // outlive the engine. Throws std::invalid_argument for a stage other than 1, 2, 3, a frozen
  // parameter (not supported here), or parameters already materialized.
  Zero(dist::Communicator& comm, const model::Transformer& model, model::ParamList& params, model::Ops& ops,
       model::MemoryLedger& ledger, std::uint64_t seed, ZeroConfig config = {});
  ~Zero();
  Zero(const Zero&) = delete;
  Zero& operator=(const Zero&) = delete;

  // One training step on this rank's rows, collective over `comm`: forward and backward through
  // model.train_step(ctx, ids, targets, batch, grad_scale) (ctx.params must be `params`; the
  // engine sets ctx.on_layer for the step and restores it after), gradients summed over the
  // ranks, AdamW at learning rate lr on the rank's shard, and the parameters made ready for the
  // next step. Returns train_step's loss (this rank's rows only).
  double step(model::Context& ctx, const model::Tensor& ids, const model::Tensor& targets, int batch,
              float grad_scale, float lr);

  // The global gradient norm of the last step, before clipping, the same on every rank; NaN when
  // clipping is off (it is then not computed: it would cost an all-reduce) or before any step.
  double grad_norm() const;

  // Every parameter value in flat order (ParamList's layout), on every rank, in host memory: for
  // tests and checkpoints. Collective.
  std::vector<float> gather_values();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k2c::zero
