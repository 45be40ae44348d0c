// model_ranks.cpp — the model library on MPI ranks: data-parallel training put together from its
// parts, the ground the distributed modules stand on.
//
// Each rank holds a replica of a small transformer, reads its rows of the global batch, and
// starts an all-reduce of each parameter's gradient as soon as backward reports it final (the
// gradient-ready callback), while backward goes on with the layers below. The averaged gradients
// must match one process that saw the whole batch, and every rank must hold the same bits.
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/dist/communicator.h"
#include "k2c/dist/testing.h"
#include "k2c/model/data.h"
#include "k2c/model/optim.h"
#include "k2c/model/transformer.h"

namespace {

using namespace k2c::model;
namespace dist = k2c::dist;

class ModelRanks : public dist::testing::DistTest {};

ModelConfig small_model() {
  ModelConfig c;
  c.vocab = 32, c.d_model = 16, c.n_layers = 2, c.q_heads = 4, c.kv_heads = 2, c.d_ff = 24, c.seq_len = 8;
  return c;
}

constexpr int kGlobalBatch = 4;  // sequences per step over all ranks (1, 2 or 4 ranks)

// A replica of the model and the loader of data-parallel rank `rank` of `ranks`.
struct Replica {
  MemoryLedger ledger;
  ParamList params;
  Context ctx{cpu_ops(), ledger, params};
  Transformer model;
  TokenLoader loader;
  Replica(const std::vector<std::uint16_t>& tokens, int rank, int ranks)
      : model(params, small_model()), loader(tokens, 32, {small_model().seq_len, kGlobalBatch, rank, ranks, 9}) {
    params.materialize(ctx.ops, ledger, 3);  // the same seed everywhere: identical replicas
  }
  // One step's gradients (added to zeroed buffers); grad_scale averages over the global batch.
  double backward(int step) {
    const TokenBatch b = loader.batch_at(step);
    Tensor ids = ctx.tensor({static_cast<std::int64_t>(b.inputs.size())}, Category::activations, DType::i32);
    Tensor targets = ctx.tensor({static_cast<std::int64_t>(b.targets.size())}, Category::activations, DType::i32);
    ctx.ops.upload(ids, b.inputs.data());
    ctx.ops.upload(targets, b.targets.data());
    params.zero_grads(ctx.ops);
    return model.train_step(ctx, ids, targets, b.rows, 1.0f / (kGlobalBatch * small_model().seq_len));
  }
};

std::vector<float> values_of(Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

// Rank 0's copy of `v`, on every rank.
std::vector<float> from_rank0(dist::Communicator& w, std::vector<float> v) {
  w.broadcast(v.data(), v.size(), dist::DType::f32, 0);
  return v;
}

TEST_F(ModelRanks, DataParallelStepsMatchOneProcess) {
  dist::Communicator& w = dist::testing::world();
  ASSERT_EQ(kGlobalBatch % w.size(), 0) << "run at 1, 2 or 4 ranks";
  const std::vector<std::uint16_t> tokens = MarkovSource(5, 32, 4).sample(4000);
  Replica local(tokens, w.rank(), w.size()), whole(tokens, 0, 1);
  AdamW local_opt(local.params, local.ctx.ops, local.ledger), whole_opt(whole.params, whole.ctx.ops, whole.ledger);

  std::vector<dist::Ticket> tickets;
  local.params.on_grad_ready([&](ParamId id) {
    Tensor& g = local.params.grad(id);
    tickets.push_back(w.start_all_reduce(g.raw(), g.raw(), static_cast<std::size_t>(g.numel()), dist::DType::f32,
                                         dist::ReduceOp::sum));
  });
  for (int step = 0; step < 3; ++step) {
    tickets.clear();
    local.backward(step);
    ASSERT_EQ(static_cast<int>(tickets.size()), local.params.size()) << "one all-reduce per parameter";
    for (const dist::Ticket t : tickets) w.wait(t);
    whole.backward(step);

    // Summed over ranks in another order than one process sums: equal up to rounding; at one
    // rank the very same computation, bit for bit.
    const std::vector<float> g = values_of(local.params.flat_grads()), ref = values_of(whole.params.flat_grads());
    for (std::size_t i = 0; i < g.size(); ++i)
      ASSERT_NEAR(g[i], ref[i], 1e-6f + 1e-4f * std::abs(ref[i])) << "gradient " << i << " at step " << step;
    if (w.size() == 1) EXPECT_EQ(g, ref);
    EXPECT_EQ(g, from_rank0(w, g)) << "ranks disagree on the averaged gradients";

    local_opt.step(1e-2f);
    whole_opt.step(1e-2f);
    const std::vector<float> p = values_of(local.params.flat_values());
    EXPECT_EQ(p, from_rank0(w, p)) << "replicas drifted apart at step " << step;
  }
}

}  // namespace
