// k2c/model/dist_testing.h — the model library in the tests of the distributed modules:
// GpuModelTest, the fixture of their speed tests, and expect_params_match, which holds the
// parameters of a sharded layer (one rank's Side) against those of the unsharded layer they were
// cut from (a Side of the whole).
//
// Why it exists: the speed tests of modules 13, 14, 16 and 17 all need the same run (NCCL, a GPU
// per rank, no sanitizer) and the model library's GPU backend on the world's compute stream, and
// skip with the same reasons without them. The tests of tensor parallelism (14) and of sequence
// parallelism's tp × cp block (16) end every comparison the same way, parameter by parameter,
// matched by name: the shard a parameter registers (Init::shard) must be the block of the whole
// at its offset, bit for bit before training, and its gradient that block of the whole's
// gradient. Written once, so the modules cannot drift apart in what they let through.
//
// A GoogleTest header for programs under mpirun (k2c/dist/testing.h's); the comparisons work on
// host copies of the values (Side::download), so on either backend.
#pragma once

#include <mpi.h>

#include <string>

#include <gtest/gtest.h>

#include "k2c/dist/testing.h"
#include "k2c/model/backend.h"
#include "k2c/model/params.h"
#include "k2c/model/testing.h"
#include "k2c/model/transformer.h"

namespace k2c::model::testing {

// The model a check of the grader's names (k2c_rank_witness's training cases, layout in
// autograder/witness/rank_cases_training.cpp): args[4 .. 11] = vocab, d_model, n_layers, q_heads,
// kv_heads, d_ff, seq_len, tied head. Throws std::invalid_argument for a model that cannot be.
inline ModelConfig witness_model(const std::int64_t* args) {
  ModelConfig c;
  c.vocab = static_cast<int>(args[4]), c.d_model = static_cast<int>(args[5]), c.n_layers = static_cast<int>(args[6]);
  c.q_heads = static_cast<int>(args[7]), c.kv_heads = static_cast<int>(args[8]), c.d_ff = args[9];
  c.seq_len = static_cast<int>(args[10]), c.tied_head = args[11] != 0;
  c.check();
  return c;
}

// Skips (on every rank alike) where K2C_REQUIRE_GPU_RANKS does, and in a program built without
// the model library's GPU backend; gpu() is that backend in bf16, its kernels issued to the
// world's compute stream, so that collectives are ordered after the work that made their inputs.
class GpuModelTest : public k2c::dist::testing::DistTest {
 protected:
  void SetUp() override {
    DistTest::SetUp();
    if (IsSkipped()) return;
    K2C_REQUIRE_GPU_RANKS();
    gpu_ = backend_if_built(true, k2c::dist::testing::world().compute_stream(), GpuMath::bf16);
    if (!gpu_) K2C_SKIP("built without the model library's GPU backend (k2c_model_cuda)");
  }
  Ops& gpu() { return *gpu_; }

 private:
  Ops* gpu_ = nullptr;
};

struct MatchOptions {
  double rel = 1e-4, of_max = 1e-5;  // expect_close's tolerance for gradients
  // The parallel gradients are each rank's share of the whole's: compared after a sum over the
  // ranks (so not held to be the same on every rank).
  bool summed = false;
};

// For each parameter of `par`: the parameter of `ref` with its name must exist; a shard must be
// a matrix cut from a whole of `ref`'s shape, any other parameter must have `ref`'s shape (fatal
// failures, as nothing after them could be compared). Then, without `grads`, the values must
// equal the block bit for bit; with `grads`, the gradient must be within the tolerance of the
// block of `ref`'s gradient, and a replicated parameter's gradient the same on every rank.
inline void expect_params_match(Side& par, Side& ref, bool grads, MatchOptions o = {}) {
  using k2c::dist::testing::Host;
  for (ParamId id = 0; id < par.params.size(); ++id) {
    const ParamInfo& p = par.params.info(id);
    const ParamId rid = ref.find(p.name);
    ASSERT_GE(rid, 0) << "parameter '" << p.name << "' has no counterpart in the unsharded layer";
    const Shape full = ref.params.info(rid).shape;
    const bool sharded = p.init.shard.has_value();
    if (sharded) {
      ASSERT_EQ(p.init.shard->full, full) << "parameter '" << p.name << "': a shard of the wrong whole";
      ASSERT_EQ(p.shape.rank, 2) << "parameter '" << p.name << "': only matrices are cut";
    } else {
      ASSERT_EQ(p.shape, full) << "parameter '" << p.name << "' is " << p.shape.str() << ", the unsharded "
                               << full.str() << ", and is not registered as a shard (Init::shard)";
    }
    auto block = [&](const Host& whole) {
      if (!sharded) return whole;
      const Host rows = k2c::dist::testing::row_block(whole, full[1], p.init.shard->offset[0], p.shape[0]);
      return k2c::dist::testing::column_block(rows, full[1], p.init.shard->offset[1], p.shape[1]);
    };
    const std::string what = "parameter '" + p.name + "'";
    if (!grads) {
      k2c::dist::testing::expect_bits(par.download(par.params.value(id)), block(ref.download(ref.params.value(rid))),
                                      what + " values");
      continue;
    }
    Host g = par.download(par.params.grad(id));
    if (o.summed)
      MPI_Allreduce(MPI_IN_PLACE, g.data(), static_cast<int>(g.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    k2c::dist::testing::expect_close(g, block(ref.download(ref.params.grad(rid))), what + " gradient", o.rel,
                                     o.of_max);
    if (!sharded && !o.summed)
      EXPECT_TRUE(k2c::dist::testing::same_on_all_ranks(g)) << what << ": a replicated gradient differs between ranks";
  }
}

}  // namespace k2c::model::testing
