// autograder/15_pipeline_parallel/pipeline_harness.h — what module 15's tests and benchmark share:
// the models they run, the contract's split of blocks over stages written out independently of
// the student's, and micro-batches of synthetic tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "k2c/model/ops.h"
#include "k2c/model/transformer.h"
#include "stage.h"

namespace k2c::pipeline_harness {

// The CPU tests' model: d 64, 5 blocks (uneven on 2, 3 and 4 stages), T 32, vocabulary 256; one
// micro-batch of 2 sequences runs forward and backward in a few milliseconds on one core.
inline model::ModelConfig test_model() {
  model::ModelConfig c;
  c.vocab = 256, c.d_model = 64, c.n_layers = 5, c.q_heads = 4, c.kv_heads = 2, c.d_ff = 128, c.seq_len = 32;
  return c;
}

// The GPU model: d 2048, 8 blocks, T 1024, vocabulary 32768, about 0.5 G parameters. A micro-batch
// of kGpuRows = 2 sequences is about 6 TFLOP of forward and backward through the whole model
// (ModelConfig::train_flops_per_token), milliseconds of work per stage at any rate the library's
// GPU backend reaches, while what crosses a stage boundary is 16 MiB (2048 × 2048 fp32), tens of
// microseconds over NVLink: what is measured is the schedule, not the link.
constexpr int kGpuRows = 2;
inline model::ModelConfig gpu_model() {
  model::ModelConfig c;
  c.vocab = 32768, c.d_model = 2048, c.n_layers = 8, c.q_heads = 16, c.kv_heads = 8, c.d_ff = 5632;
  c.seq_len = 1024;
  return c;
}

// The contract's split (stage_blocks), written out so that a harness can build stages without
// the student's: stage s starts after s stages of L/p blocks and the min(s, L mod p) longer ones.
inline pipeline_stage::Span split(int n_layers, int stages, int stage) {
  const int base = n_layers / stages, longer = n_layers % stages;
  const int first = stage * base + (stage < longer ? stage : longer);
  return {first, first + base + (stage < longer ? 1 : 0)};
}

inline model::Tensor upload_i32(model::Ops& ops, model::MemoryLedger& ledger, const std::vector<std::int32_t>& v) {
  model::Tensor t(ops.memory(), ledger, model::Category::activations, {static_cast<std::int64_t>(v.size())},
                  model::DType::i32);
  ops.upload(t, v.data());
  return t;
}

// Micro-batch k of a step, `rows` sequences of the given ids and targets, uploaded into `ledger`.
inline pipeline_stage::MicroBatch micro_batch(model::Ops& ops, model::MemoryLedger& ledger,
                                              const std::vector<std::int32_t>& ids,
                                              const std::vector<std::int32_t>& targets, int rows, int k) {
  pipeline_stage::MicroBatch mb;
  mb.ids = upload_i32(ops, ledger, ids);
  mb.targets = upload_i32(ops, ledger, targets);
  mb.rows = rows;
  mb.row_offset = static_cast<std::int64_t>(k) * rows;
  mb.index = k;
  return mb;
}

// m micro-batches of `rows` sequences of arbitrary tokens (for timing: the values do not
// matter, only that they are valid ids), in `ledger` (kept apart from the stage's own).
inline std::vector<pipeline_stage::MicroBatch> synthetic_micro_batches(model::Ops& ops, model::MemoryLedger& ledger,
                                                                       const model::ModelConfig& c, int m, int rows) {
  std::vector<pipeline_stage::MicroBatch> out(static_cast<std::size_t>(m));
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(c.seq_len);
  for (int k = 0; k < m; ++k) {
    std::vector<std::int32_t> ids(n), targets(n);
    for (std::size_t i = 0; i < n; ++i) {
      ids[i] = static_cast<std::int32_t>((i * 7919u + static_cast<std::size_t>(k) * 104729u) % static_cast<std::size_t>(c.vocab));
      targets[i] = static_cast<std::int32_t>((i * 6151u + static_cast<std::size_t>(k) * 3571u) % static_cast<std::size_t>(c.vocab));
    }
    out[static_cast<std::size_t>(k)] = micro_batch(ops, ledger, ids, targets, rows, k);
  }
  return out;
}

// One micro-batch's forward and backward on `stage` alone, with no neighbour: a constant input
// and output gradient stand in for what the neighbours would send. What the pipeline's ideal
// step is made of.
inline void run_alone(pipeline_stage::Stage& stage, model::Context& ctx, const pipeline_stage::MicroBatch& mb,
                      float grad_scale, bool recompute) {
  const model::Shape shape = stage.activation_shape(mb.rows);
  model::Tensor in, out, dout, din;
  if (!stage.is_first()) {
    in = ctx.tensor(shape);
    ctx.ops.fill(in, 0.5f);
  }
  pipeline_stage::Stage::Saved saved;
  stage.forward(ctx, mb, std::move(in), grad_scale, recompute, saved, out);
  out = model::Tensor();
  if (!stage.is_last()) {
    dout = ctx.tensor(shape);
    ctx.ops.fill(dout, 1e-3f);
  }
  stage.backward(ctx, mb, saved, dout, din);
}

}  // namespace k2c::pipeline_harness
