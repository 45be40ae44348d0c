// autograder/12_data_parallel/replica.h — one rank's copy of a model, and how module 12's tests
// and benchmark cut a global batch over ranks and micro-batches.
//
// A Replica is the model library's parts put together the way `k2c train` does it in one process
// (ledger, parameters, context, transformer), with chosen parameters frozen before the buffers are
// laid out. Data: step s's global batch is `rows` sequences drawn from (seed, s) by TokenLoader;
// data-parallel rank r of n reads rows [r·rows/n, (r+1)·rows/n), and micro-batch m of k within it
// the m-th of k equal consecutive slices. However the batch is cut, the union is the same data,
// so every layout can be held against one process that saw all of it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "k2c/model/data.h"
#include "k2c/model/transformer.h"

namespace k2c::ddp_harness {

// The CPU tests' model: d 64, 2 layers, T 32, vocabulary 256, about 90 k parameters, a training
// step of 12 sequences in well under 0.1 s on one core. The head is tied to the embedding (one
// parameter, two uses), and one matrix in the middle of the model is frozen.
inline model::ModelConfig test_model() {
  model::ModelConfig c;
  c.vocab = 256, c.d_model = 64, c.n_layers = 2, c.q_heads = 4, c.kv_heads = 2, c.d_ff = 128, c.seq_len = 32;
  c.tied_head = true;
  return c;
}
inline const std::vector<std::string>& test_frozen() {
  static const std::vector<std::string> names = {"blocks.0.attn.wk.weight"};
  return names;
}

// The GPU performance test's model: d 1024, 8 layers, T 512, vocabulary 16384, untied head,
// about 136 M parameters (545 MB of fp32 gradients), trained on perf_rows() sequences per rank
// per step: enough tokens that backward can hide the all-reduce, few enough that the all-reduce
// is a sizeable share of the step and hiding it is what counts (lecture section 5).
inline model::ModelConfig perf_model() {
  model::ModelConfig c;
  c.vocab = 16384, c.d_model = 1024, c.n_layers = 8, c.q_heads = 16, c.kv_heads = 16, c.d_ff = 2816;
  c.seq_len = 512;
  return c;
}
inline int perf_rows() { return 4; }

class Replica {
 public:
  Replica(model::Ops& ops, const model::ModelConfig& config, std::uint64_t seed,
          const std::vector<std::string>& frozen = {})
      : ctx{ops, ledger, params}, model(params, config) {
    for (const std::string& name : frozen) params.freeze(find(name));
    params.materialize(ops, ledger, seed);
  }
  Replica(const Replica&) = delete;
  Replica& operator=(const Replica&) = delete;

  // Forward, loss and backward over one batch, adding into the gradients (the gradient-ready
  // callbacks fire during it); returns the summed loss of its tokens.
  double backward(const model::TokenBatch& b, float grad_scale) {
    const std::int64_t n = static_cast<std::int64_t>(b.inputs.size());
    model::Tensor ids = ctx.tensor({n}, model::Category::activations, model::DType::i32);
    model::Tensor targets = ctx.tensor({n}, model::Category::activations, model::DType::i32);
    ctx.ops.upload(ids, b.inputs.data());
    ctx.ops.upload(targets, b.targets.data());
    return model.train_step(ctx, ids, targets, b.rows, grad_scale);
  }

  model::ParamId find(const std::string& name) const {
    for (model::ParamId id = 0; id < params.size(); ++id)
      if (params.info(id).name == name) return id;
    throw std::invalid_argument("no parameter named '" + name + "'");
  }
  std::vector<float> host(model::Tensor& t) {
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    if (!v.empty()) ctx.ops.download(v.data(), t);
    return v;
  }
  std::vector<float> grads() { return host(params.flat_grads()); }
  std::vector<float> values() { return host(params.flat_values()); }

  model::MemoryLedger ledger;
  model::ParamList params;
  model::Context ctx;
  model::Transformer model;
};

// Micro-batch `micro` of `micros` of data-parallel rank `rank` of `ranks`, in step `step`'s global
// batch of `rows` sequences (rows divisible by ranks · micros).
inline model::TokenBatch slice_of(const std::vector<std::uint16_t>& tokens, const model::ModelConfig& c, int rows,
                                  int rank, int ranks, int micro, int micros, std::int64_t step,
                                  std::uint64_t seed) {
  // The loader's data-parallel split, one level further down: rank r's micro-batch m is part
  // r·micros + m of ranks·micros, which is the m-th slice of rank r's rows.
  const model::TokenLoader loader(tokens, static_cast<std::uint32_t>(c.vocab),
                                  {c.seq_len, rows, rank * micros + micro, ranks * micros, seed});
  return loader.batch_at(step);
}

}  // namespace k2c::ddp_harness
