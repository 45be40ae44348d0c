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

#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/dist/rank_witness.h"
#include "k2c/dist/testing.h"
#include "k2c/model/block.h"
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

// A layer check's x and dy [rows, d], one after the other at the start of the checker's input;
// `exact`: nothing may follow them.
inline std::pair<std::vector<float>, std::vector<float>> witness_x_dy(const k2c::dist::testing::RankCase& c,
                                                                      std::int64_t rows, std::int64_t d, bool exact = true) {
  const std::size_t bytes = static_cast<std::size_t>(2 * rows * d) * sizeof(float);
  if (exact ? c.in.size() != bytes : c.in.size() < bytes) throw std::runtime_error("x and dy have an unexpected size");
  std::vector<float> x(static_cast<std::size_t>(rows * d)), dy(x.size());
  if (!x.empty()) {
    std::memcpy(x.data(), c.in.data(), x.size() * sizeof(float));
    std::memcpy(dy.data(), c.in.data() + x.size() * sizeof(float), dy.size() * sizeof(float));
  }
  return {x, dy};
}

// A layer check's answer: `head` (figures of the check's own, as bytes), y, dx, then the gradients
// of the parameters named, as this rank holds them.
inline void answer_layer(k2c::dist::testing::RankCase& c, Side& par, const Tensor& y, const Tensor& dx,
                         const std::vector<std::string>& names, std::vector<unsigned char> head = {}) {
  std::vector<unsigned char> out = std::move(head);
  auto put = [&out](const std::vector<float>& v) {
    const std::size_t at = out.size();
    out.resize(at + v.size() * sizeof(float));
    if (!v.empty()) std::memcpy(out.data() + at, v.data(), v.size() * sizeof(float));
  };
  put(par.download(y)), put(par.download(dx));
  for (const std::string& name : names) {
    const ParamId id = par.find(name);
    if (id < 0) throw std::runtime_error("the layer registered no " + name);
    put(par.download(par.params.grad(id)));
  }
  if (out.size() != c.out.size()) throw std::runtime_error("the answer is not the size the checker expects");
  c.out = std::move(out);
}

// The names of the parameters whose gradients a check asks for: the rest of its input from byte
// `at`, one per line.
using WitnessNames = std::vector<std::string>;
inline WitnessNames witness_names(const k2c::dist::testing::RankCase& c, std::size_t at) {
  WitnessNames names;
  std::string line;
  for (std::size_t i = at; i < c.in.size(); ++i)
    if (c.in[i] == '\n') {
      names.push_back(line);
      line.clear();
    } else {
      line += static_cast<char>(c.in[i]);
    }
  return names;
}

// A check of blocks (modules 14 and 16; the layout in autograder/witness/rank_cases_training.cpp,
// draw_block): args 0 d_model, 1 q_heads, 2 kv_heads, 3 batch, 4 T, 5 d_ff, 6 blocks, 7 dropout
// (the float's bits), 8 row_offset, 9 the dropout seed, 10 the step, 11 sequence parallel (0/1),
// 12 the weights' seed. The input: this rank's rows of x, then of dy (all rows, or its 1/n of
// them under sequence parallelism), then the names of the parameters whose gradients it answers,
// one per line.
struct WitnessBlocks {
  BlockConfig config;
  int batch = 0, seq_len = 0, blocks = 0;
  bool sequence_parallel = false;
  std::uint64_t weights = 0;
  std::int64_t rows = 0;
  std::vector<float> x, dy;
  WitnessNames names;
};

inline WitnessBlocks witness_blocks(k2c::dist::testing::RankCase& c, Context& ctx, int ranks) {
  WitnessBlocks w;
  w.config.attention.d_model = static_cast<int>(c.args[0]);
  w.config.attention.q_heads = static_cast<int>(c.args[1]), w.config.attention.kv_heads = static_cast<int>(c.args[2]);
  w.batch = static_cast<int>(c.args[3]), w.seq_len = static_cast<int>(c.args[4]);
  w.config.d_ff = c.args[5], w.blocks = static_cast<int>(c.args[6]);
  ctx.dropout = std::bit_cast<float>(static_cast<std::int32_t>(c.args[7]));
  ctx.row_offset = c.args[8], ctx.seed = static_cast<std::uint64_t>(c.args[9]), ctx.step = static_cast<std::uint64_t>(c.args[10]);
  w.sequence_parallel = c.args[11] != 0, w.weights = static_cast<std::uint64_t>(c.args[12]);
  if (w.batch < 1 || w.seq_len < 1 || w.blocks < 1 || ranks < 1) throw std::runtime_error("a block case without rows or blocks");
  w.rows = std::int64_t{w.batch} * w.seq_len / (w.sequence_parallel ? ranks : 1);
  std::tie(w.x, w.dy) = witness_x_dy(c, w.rows, w.config.attention.d_model, false);
  w.names = witness_names(c, 2 * w.x.size() * sizeof(float));
  return w;
}

// Runs a check of blocks: `blocks` (made by the caller over this rank's parameters, materialized
// from w.weights) forward over x then backward from dy, and answers y, dx and the gradients named.
template <class B>
void answer_blocks(k2c::dist::testing::RankCase& c, Side& par, const WitnessBlocks& w, const std::vector<B>& blocks) {
  const std::int64_t d = w.config.attention.d_model;
  std::vector<std::int32_t> pos(static_cast<std::size_t>(w.seq_len));
  for (int t = 0; t < w.seq_len; ++t) pos[t] = t;
  const Tensor positions = par.upload_ids(pos);
  std::vector<Tensor> acts;  // acts[b]: block b's input; acts.back(): the output
  std::vector<typename B::Saved> saved(blocks.size());
  acts.push_back(par.upload(w.x, {w.rows, d}));
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    acts.push_back(par.poisoned({w.rows, d}));
    blocks[b].forward(par.ctx, acts[b], positions, w.batch, acts[b + 1], saved[b]);
  }
  Tensor grad = par.upload(w.dy, {w.rows, d});
  par.params.zero_grads(par.ops());
  par.params.begin_backward();
  for (std::size_t b = blocks.size(); b-- > 0;) {
    Tensor dx = par.poisoned({w.rows, d});
    blocks[b].backward(par.ctx, acts[b], positions, w.batch, saved[b], grad, dx);
    grad = std::move(dx);
  }
  par.params.end_backward();
  answer_layer(c, par, acts.back(), grad, w.names);
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
