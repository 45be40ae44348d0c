// autograder/18_capstone/capstone_testing.h — what the tests of module 18 share: the tiny
// configurations, the Markov tokens every run reads and the loaders over them, the tolerances of
// the comparisons, and a check that every rank holds the same bits. Included by test_capstone.cpp
// (the grids against model::Trainer, refusals, training, resume), test_capstone_zero.cpp (the
// ZeRO stages against the capstone's own optimizer) and test_capstone_perf.cpp (the speed test).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "capstone.h"
#include "k2c/dist/testing.h"
#include "k2c/model/data.h"
#include "k2c/model/train.h"

namespace k2c::capstone_testing {

namespace kc = k2c::capstone;
namespace kd = k2c::dist;
namespace km = k2c::model;
using k2c::dist::testing::world;

// Steps of every grid run, and the tolerances of grids whose sums run in another order than the
// reference's (test_capstone.cpp's header says where they come from).
constexpr int kSteps = 20;
constexpr double kLossTol = 5e-7, kNormTol = 5e-6, kParamAtol = 5e-5, kParamRtol = 1e-4, kParamL2 = 5e-6;

// The models: dense, a mixture of experts, the same without the balance term (see dp 2 × ep 2),
// dense and MoE with their activations stored in bf16, and both with their residual stream in bf16
// too.
enum class Model { dense, moe, moe_unbalanced, dense_bf16, moe_bf16, dense_bf16_residual, moe_bf16_residual, dense_dropout };

inline km::TrainConfig tiny_config(Model model) {
  km::TrainConfig c;
  c.model = km::ModelConfig::tiny();
  const bool residual = model == Model::dense_bf16_residual || model == Model::moe_bf16_residual;
  if (model == Model::moe || model == Model::moe_unbalanced || model == Model::moe_bf16 || model == Model::moe_bf16_residual)
    c.model.experts = 4, c.model.top_k = 2, c.model.shared_experts = 1, c.model.d_expert = 32;
  if (model == Model::moe_unbalanced) c.model.balance_coef = 0.0f;
  if (model == Model::dense_bf16 || model == Model::moe_bf16 || residual) c.activations = km::DType::bf16;
  if (residual) c.residual = km::DType::bf16;
  if (model == Model::dense_dropout) c.dropout = 0.1f;
  c.steps = kSteps, c.batch = 8, c.lr = 3e-3f, c.min_lr = 3e-4f, c.warmup = 5, c.clip = 0.5f;
  c.eval_every = 0;
  return c;
}

// Rank r's checkpoint file of save(path) on n ranks, as the contract (capstone.h) names it.
inline std::filesystem::path checkpoint_file(const std::filesystem::path& path, int r, int n) {
  return n == 1 ? path : std::filesystem::path(path.string() + ".rank" + std::to_string(r));
}

// The tokens every run reads, and loaders over them for any data rank.
struct Data {
  std::vector<std::uint16_t> train, val;
  std::uint32_t vocab;
  Data(int vocab, int branching, std::uint64_t seed) : vocab(static_cast<std::uint32_t>(vocab)) {
    km::MarkovSource source(seed, vocab, branching);
    train = source.sample(60000);
    val = source.sample(20000);
  }
  km::TokenLoader loader(const km::TrainConfig& c, bool validation, int rank, int ranks) const {
    return km::TokenLoader(validation ? val : train, vocab,
                           {c.model.seq_len, c.batch, rank, ranks, validation ? 102u : 101u});
  }
  kc::LoaderFactory factory(const km::TrainConfig& c) const {
    return [this, c](bool validation, int rank, int ranks) { return loader(c, validation, rank, ranks); };
  }
};

inline const Data& tiny_data() {
  static const Data d(256, 4, 7);
  return d;
}

// Every rank holds the same bits of a value.
inline bool same_on_every_rank(double v) {
  double lo = v, hi = v;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

}  // namespace k2c::capstone_testing
