// autograder/18_capstone/test_capstone.cpp — tests of module 18 (contract: capstone.h).
//
// Run as `mpirun -np n` at the rank counts the rubric lists (1, 2, 4 and 8); each grid test runs at
// the rank count its grid needs and skips at the others. Every rank computes on the model
// library's CPU backend. In the rubric's NCCL run (one GPU) these tests skip and the speed test of
// test_capstone_perf.cpp runs.
//
// The reference is the model library's single-process trainer (model::Trainer) over the same
// tokens, computed on every rank: the same model (initialised from the same seed), the same
// global batches, AdamW, cosine schedule and clipping. The grids train the tiny configuration
// (d 64, 2 layers, 4 heads of which 2 key-value, T 32, vocabulary 256; its MoE variant has 4
// experts of width 32, top 2, one shared) for 20 steps of 8 sequences on Markov data, with
// clipping at 0.5 so that it acts on most steps.
//
// What must agree (the loss is the mean over the global batch, the gradient norm the whole
// model's before clipping):
//   - grid 1: every step's loss and norm, and every parameter after 20 steps, bit for bit
//     (the same operations in the same order);
//   - pp 2 with one micro-batch: the same bits for the losses (each stage runs the unsplit
//     model's operations on exact copies of the activations); the norm, summed per stage in
//     another order, and so the parameters, within the tolerance below (the reference measured
//     the same bits for the parameters too: the clipping factor rounds to the same float);
//   - every other grid: sums over ranks in another order, so each step's loss within
//     kLossTol·max(1, loss) of the reference and the norm within kNormTol relative, and the
//     parameters after 20 steps within atol kParamAtol + rtol kParamRtol;
//   - ep 2 with activations in bf16: the first step's loss and norm within the same tolerances.
//     A bf16 activation rounds an fp32 sum, and sums in another order round the other way now
//     and then; after a few steps of AdamW the curves part by 1e-4 relative, too much to tell a
//     wrong rounding point from. The first step still agrees to 1e-8 where both grids round in
//     the same places, and parts by 1e-6 in the loss and 1e-4 in the norm where one grid keeps a
//     tensor in fp32 that the other rounds (measured on attention's output);
//   - the residual stream in bf16 too: grid 1 bit for bit, as above; dp 2 and pp 2 their first
//     step, for the same reason as ep 2's;
//   - on every grid, every rank reports the same bits for the loss and the norm;
//   - on every grid, the work each rank hands the backend it was given, counted on the way through
//     (k2c/model/work_counter.h): the products add up to one process's, every parameter is
//     stepped, no rank does much more than its dp share of the products, and where tp, pp or ep
//     cut the model no rank steps every parameter. A grid that trains the whole model on every
//     rank, or runs tp, pp or ep as data parallelism, matches the curves but not this.
// The tolerances are 20 to 40 times the largest differences the reference showed over these
// grids (loss 1.3e-8 relative, norm 1.5e-7, parameters 2.4e-6 absolute and 2.2e-7 in relative
// L2, the last at tp 2 × ep 2: rounding differences of fp32 sums that AdamW carries on for 20
// steps); a gradient reduced over the wrong group or scaled twice misses them by orders of
// magnitude.
//
// Training: the tiny model on a Markov chain of 32 tokens must come within 0.05 nats of the
// chain's own loss on the validation tokens (the floor no model can beat) on dp 2 in 300 steps.
// Resume: 12 steps in one run equal 6 steps, a checkpoint and 6 more in a new trainer, bit for bit.
// ZeRO as a flag is tested in test_capstone_zero.cpp; what both files share is capstone_testing.h.
#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "capstone_testing.h"
#include "k2c/dist/rank_witness.h"
#include "k2c/model/dist_testing.h"
#include "k2c/model/work_counter.h"
#include "k2c/testing/compare.h"
#include "k2c/testing/testing.h"

using namespace k2c::capstone_testing;  // the shared configurations, data and tolerances

namespace {

// The single-process run of a configuration: every step's record, the final parameters, and the
// work it handed its backend (WorkCounter) in one step.
struct Reference {
  std::vector<km::StepRecord> steps;
  std::vector<float> values;
  double flops_per_step = 0;
  std::int64_t stepped_per_step = 0;
};

const Reference& reference(Model model) {
  static std::map<Model, Reference> cache;
  auto it = cache.find(model);
  if (it != cache.end()) return it->second;
  const km::TrainConfig c = tiny_config(model);
  const Data& d = tiny_data();
  km::WorkCounter counter(km::cpu_ops());
  km::Trainer trainer(c, counter, d.loader(c, false, 0, 1), d.loader(c, true, 0, 1));
  Reference r;
  for (int s = 0; s < kSteps; ++s) r.steps.push_back(trainer.step());
  r.values.resize(static_cast<std::size_t>(trainer.params().numel()));
  km::cpu_ops().download(r.values.data(), trainer.params().flat_values());
  r.flops_per_step = counter.flops() / kSteps;
  r.stepped_per_step = counter.stepped() / kSteps;
  return cache.emplace(model, std::move(r)).first->second;
}

enum class Match { bits, loss_bits, tolerance, first_step };

// Every rank's value of a count, in world rank order.
std::vector<double> on_every_rank(double v) {
  std::vector<double> all(static_cast<std::size_t>(world().size()));
  MPI_Allgather(&v, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
  return all;
}

// The grid split the work of `steps` steps between its ranks as it must (k2c/model/work_counter.h's
// rule), each rank's work counted by its WorkCounter, against one process's.
void expect_work_split(const kd::GridShape& shape, const km::WorkCounter& counter, const Reference& ref, int steps) {
  const std::string problem = km::work_split_problem(
      shape.dp, shape.tp, shape.pp, shape.ep, on_every_rank(counter.flops()),
      on_every_rank(static_cast<double>(counter.stepped())), ref.flops_per_step * steps,
      static_cast<double>(ref.stepped_per_step) * steps);
  EXPECT_EQ(problem, "") << "grid " << kc::grid_name(shape);
}

// Trains `grid` for kSteps (first_step: one step) and holds it against the single-process
// reference.
void expect_grid_matches(const std::string& grid, Model model, int micro_batches, Match match) {
  const kd::GridShape shape = kc::parse_grid(grid);
  if (world().size() != shape.total())
    K2C_SKIP("grid " + grid + " needs " + std::to_string(shape.total()) + " ranks; this run has " +
             std::to_string(world().size()));
  const Reference& ref = reference(model);
  kc::CapstoneConfig config;
  config.train = tiny_config(model);
  config.grid = shape;
  config.micro_batches = micro_batches;
  km::WorkCounter counter(km::cpu_ops());
  kc::GridTrainer trainer(world(), counter, config, tiny_data().factory(config.train));
  const int steps = match == Match::first_step ? 1 : kSteps;
  for (int s = 0; s < steps; ++s) {
    const km::StepRecord r = trainer.step();
    const km::StepRecord& w = ref.steps[static_cast<std::size_t>(s)];
    ASSERT_TRUE(same_on_every_rank(r.loss) && same_on_every_rank(r.grad_norm)) << "step " << s;
    EXPECT_EQ(r.lr, w.lr) << "step " << s;
    if (match == Match::tolerance || match == Match::first_step) {
      ASSERT_NEAR(r.loss, w.loss, kLossTol * std::max(1.0, w.loss)) << "step " << s;
    } else {
      ASSERT_EQ(r.loss, w.loss) << "step " << s << " (bit for bit)";
    }
    if (match == Match::bits) {
      ASSERT_EQ(r.grad_norm, w.grad_norm) << "step " << s << " (bit for bit)";
    } else {
      ASSERT_NEAR(r.grad_norm, w.grad_norm, kNormTol * w.grad_norm) << "step " << s;
    }
  }
  expect_work_split(shape, counter, ref, steps);
  if (match == Match::first_step) return;
  const std::vector<float> got = trainer.gather_values();
  ASSERT_EQ(got.size(), ref.values.size());
  if (match == Match::bits) {
    EXPECT_TRUE(got == ref.values) << "the parameters after " << kSteps << " steps differ from the reference's";
  } else {
    const std::vector<double> want(ref.values.begin(), ref.values.end());
    const k2c::CompareReport rep = k2c::compare(got, want, {kParamAtol, kParamRtol, kParamL2});
    EXPECT_TRUE(rep.ok) << "parameters after " << kSteps << " steps: " << rep.summary();
  }
}

}  // namespace

// Worth no points: it lets the grader say "not implemented yet".
using CapstoneContract = kd::testing::CpuModelTest;
TEST_F(CapstoneContract, Implemented) {
  kc::CapstoneConfig config;
  config.train = tiny_config(Model::dense);
  config.grid.dp = world().size();
  try {
    kc::GridTrainer trainer(world(), km::cpu_ops(), config, tiny_data().factory(config.train));
    (void)trainer.step();
  } catch (const k2c::NotImplemented& e) {
    FAIL() << e.what();
  }
}

using Capstone = kd::testing::CpuModelTest;

TEST_F(Capstone, ParsesGrids) {
  const kd::GridShape g = kc::parse_grid("dp2,tp2,pp3,ep4");
  EXPECT_EQ(g.dp, 2);
  EXPECT_EQ(g.tp, 2);
  EXPECT_EQ(g.pp, 3);
  EXPECT_EQ(g.ep, 4);
  EXPECT_EQ(g.cp, 1);
  EXPECT_EQ(kc::parse_grid("dp2xpp2").total(), 4);
  EXPECT_EQ(kc::parse_grid("1").total(), 1);
  EXPECT_EQ(kc::grid_name(kc::parse_grid("tp2,dp2")), "dp2,tp2");
  EXPECT_THROW(kc::parse_grid("dp0"), std::invalid_argument);
  EXPECT_THROW(kc::parse_grid("xy2"), std::invalid_argument);
  for (const char* bad : {"dp2,", "tp2x", "dp2,dp4", "dp2 tp2", "dp99999999999", "dp", "dp2;tp2", "dp-1"})
    EXPECT_THROW(kc::parse_grid(bad), std::invalid_argument) << bad;
}

TEST_F(Capstone, OneRankMatchesLibraryTrainer) { expect_grid_matches("1", Model::dense, 1, Match::bits); }
TEST_F(Capstone, OneRankMoeMatchesLibraryTrainer) { expect_grid_matches("1", Model::moe, 1, Match::bits); }
// Activations stored in bf16 (config.train.activations): the stage rounds where model::Transformer
// does, the final norm's output and the logits included.
TEST_F(Capstone, OneRankBf16MatchesLibraryTrainer) { expect_grid_matches("1", Model::dense_bf16, 1, Match::bits); }
TEST_F(Capstone, OneRankMoeBf16MatchesLibraryTrainer) { expect_grid_matches("1", Model::moe_bf16, 1, Match::bits); }
// The residual stream in bf16 too (config.train.residual): the stage's own residual tensors (the
// embedding's output, the gradients between blocks) in it as model::Transformer makes them, with
// experts too (the MoE layer takes an fp32 copy of its output's gradient). On dp and pp (whose
// stages send fp32, which holds a bf16 value exactly) the first step: from the second on, the
// weights' fp32 rounding differences flip roundings of the stream, which the grids' tolerances do
// not allow for (7e-6 of the norm at step 2 where 5e-6 is allowed).
TEST_F(Capstone, OneRankBf16ResidualMatchesLibraryTrainer) {
  expect_grid_matches("1", Model::dense_bf16_residual, 1, Match::bits);
}
TEST_F(Capstone, OneRankMoeBf16ResidualMatchesLibraryTrainer) {
  expect_grid_matches("1", Model::moe_bf16_residual, 1, Match::bits);
}
// Dropout at 0.1: the stage draws its masks as model::Transformer does (the same seeds, the same
// order), or the curve leaves the library's at the first step.
TEST_F(Capstone, OneRankDropoutMatchesLibraryTrainer) {
  if (world().size() == 1)  // a curve that dropout leaves alone could not tell a stage that ignores it
    ASSERT_NE(reference(Model::dense_dropout).steps[0].loss, reference(Model::dense).steps[0].loss);
  expect_grid_matches("1", Model::dense_dropout, 1, Match::bits);
}
TEST_F(Capstone, GridDp2Bf16ResidualMatchesOneRank) {
  expect_grid_matches("dp2", Model::dense_bf16_residual, 1, Match::first_step);
}
TEST_F(Capstone, GridPp2Bf16ResidualMatchesOneRank) {
  expect_grid_matches("pp2", Model::dense_bf16_residual, 2, Match::first_step);
}
TEST_F(Capstone, GridDp2MatchesOneRank) { expect_grid_matches("dp2", Model::dense, 1, Match::tolerance); }
TEST_F(Capstone, GridTp2MatchesOneRank) { expect_grid_matches("tp2", Model::dense, 1, Match::tolerance); }
TEST_F(Capstone, GridPp2MatchesOneRank) { expect_grid_matches("pp2", Model::dense, 1, Match::loss_bits); }
TEST_F(Capstone, GridPp2MicroBatchesMatchOneRank) {
  expect_grid_matches("pp2", Model::dense, 4, Match::tolerance);
}
// With ep alone the ep group is every data rank: the balance term is one process's.
TEST_F(Capstone, GridEp2MatchesOneRank) { expect_grid_matches("ep2", Model::moe, 1, Match::tolerance); }
// The same in bf16, its first step: ep's block rounds where model::Block does (attention's
// output included).
TEST_F(Capstone, GridEp2Bf16MatchesOneRank) { expect_grid_matches("ep2", Model::moe_bf16, 1, Match::first_step); }
TEST_F(Capstone, GridDp2Tp2MatchesOneRank) { expect_grid_matches("dp2,tp2", Model::dense, 1, Match::tolerance); }
TEST_F(Capstone, GridDp2Pp2MatchesOneRank) { expect_grid_matches("dp2,pp2", Model::dense, 2, Match::tolerance); }
TEST_F(Capstone, GridTp2Pp2MatchesOneRank) { expect_grid_matches("tp2,pp2", Model::dense, 2, Match::tolerance); }
// Under dp × ep each ep group balances its own tokens (the mean of the groups' terms is not the
// term of all tokens), so this grid is compared without the balance term.
TEST_F(Capstone, GridDp2Ep2MatchesOneRank) {
  expect_grid_matches("dp2,ep2", Model::moe_unbalanced, 1, Match::tolerance);
}
// tp × ep: attention cut over tp, experts over ep, the MoE replicated over tp. Each tp rank's ep
// group is every data rank, so the balance term is one process's, as at ep 2.
TEST_F(Capstone, GridTp2Ep2MatchesOneRank) { expect_grid_matches("tp2,ep2", Model::moe, 1, Match::tolerance); }
// A mixture of experts on the axes that do not cut it. Under dp alone each data rank routes and
// balances its own tokens, as under dp × ep, so the grid is compared without the balance term.
// A pipeline's stages hold whole MoE layers; with micro-batches each balances its own micro-batch's
// tokens (a term not linear in the counts), so again without it. pp × ep in one micro-batch keeps
// the term: its ep group is every data rank, as at ep 2.
TEST_F(Capstone, GridDp2MoeMatchesOneRank) {
  expect_grid_matches("dp2", Model::moe_unbalanced, 1, Match::tolerance);
}
TEST_F(Capstone, GridPp2MoeMatchesOneRank) {
  expect_grid_matches("pp2", Model::moe_unbalanced, 2, Match::tolerance);
}
TEST_F(Capstone, GridPp2Ep2MatchesOneRank) { expect_grid_matches("pp2,ep2", Model::moe, 1, Match::tolerance); }
// tp alone on a mixture of experts: attention cut over tp, every expert on every tp rank (an ep
// group of one), which all see every token, so the balance term is one process's. Under dp × tp
// each data rank balances its own tokens again.
TEST_F(Capstone, GridTp2MoeMatchesOneRank) { expect_grid_matches("tp2", Model::moe, 1, Match::tolerance); }
TEST_F(Capstone, GridDp2Tp2MoeMatchesOneRank) {
  expect_grid_matches("dp2,tp2", Model::moe_unbalanced, 1, Match::tolerance);
}
// Three axes at once (8 ranks), where every group meets two others: a rank's tp group, its
// stage's neighbours and its gradient group must all be formed from the same layout. tp × pp × ep
// keeps the balance term: each tp rank's ep group is every data rank, in one micro-batch.
TEST_F(Capstone, GridDp2Tp2Pp2MatchesOneRank) { expect_grid_matches("dp2,tp2,pp2", Model::dense, 2, Match::tolerance); }
TEST_F(Capstone, GridTp2Pp2Ep2MatchesOneRank) { expect_grid_matches("tp2,pp2,ep2", Model::moe, 1, Match::tolerance); }

// The grader's own check of a grid (k2c/dist/rank_witness.h; the cases and the layout in
// autograder/witness/rank_cases_training.cpp): the checker's grid, model, schedule and tokens.
namespace {
void grid_case(k2c::dist::testing::RankCase& c) {
  kc::CapstoneConfig config;
  config.grid.dp = static_cast<int>(c.args[0]), config.grid.tp = static_cast<int>(c.args[1]);
  config.grid.pp = static_cast<int>(c.args[2]), config.grid.ep = static_cast<int>(c.args[3]);
  config.micro_batches = static_cast<int>(c.args[13]);
  km::TrainConfig& t = config.train;
  t.model = km::testing::witness_model(c.args);
  t.seed = static_cast<std::uint64_t>(c.args[12]);
  t.steps = static_cast<int>(c.args[14]), t.batch = static_cast<int>(c.args[15]);
  t.eval_every = 0;
  constexpr std::size_t kFields = 11;
  std::int64_t f[kFields];
  if (c.in.size() < sizeof f) throw std::runtime_error("the input is shorter than its fields");
  std::memcpy(f, c.in.data(), sizeof f);
  auto as_float = [](std::int64_t bits) { return std::bit_cast<float>(static_cast<std::int32_t>(bits)); };
  t.model.experts = static_cast<int>(f[0]), t.model.top_k = static_cast<int>(f[1]), t.model.d_expert = f[2];
  t.model.shared_experts = static_cast<int>(f[3]), t.model.balance_coef = as_float(f[4]);
  t.lr = as_float(f[5]), t.min_lr = as_float(f[6]), t.clip = as_float(f[7]), t.adamw.eps = as_float(f[8]);
  t.warmup = static_cast<int>(f[9]);
  if (f[10] < 0 || c.in.size() != sizeof f + static_cast<std::size_t>(f[10]) * sizeof(std::uint16_t))
    throw std::runtime_error("the token stream is not the size its field says");
  std::vector<std::uint16_t> tokens(static_cast<std::size_t>(f[10]));
  if (!tokens.empty()) std::memcpy(tokens.data(), c.in.data() + sizeof f, tokens.size() * sizeof(std::uint16_t));
  const kc::LoaderFactory data = [&](bool validation, int rank, int ranks) {
    return km::TokenLoader(tokens, static_cast<std::uint32_t>(t.model.vocab),
                           {t.model.seq_len, t.batch, rank, ranks, validation ? 102u : 101u});
  };
  km::WorkCounter counter(km::cpu_ops());
  kc::GridTrainer trainer(world(), counter, config, data);
  std::vector<double> head;
  for (int s = 0; s < t.steps; ++s) {
    const km::StepRecord r = trainer.step();
    head.insert(head.end(), {r.loss, r.grad_norm, r.lr});
  }
  // The steps' work, counted before gather_values() (which may compute, under ZeRO stage 3).
  const double work[] = {counter.flops(), static_cast<double>(counter.stepped())};
  const std::vector<float> values = trainer.gather_values();
  if (c.out.size() != head.size() * sizeof(double) + values.size() * sizeof(float) + sizeof work)
    throw std::runtime_error("gather_values() returned " + std::to_string(values.size()) + " values, not what the model has");
  std::memcpy(c.out.data(), head.data(), head.size() * sizeof(double));
  if (!values.empty()) std::memcpy(c.out.data() + head.size() * sizeof(double), values.data(), values.size() * sizeof(float));
  std::memcpy(c.out.data() + c.out.size() - sizeof work, work, sizeof work);
}
}  // namespace

K2C_RANK_WITNESS(capstone_one_rank) { grid_case(c); }
K2C_RANK_WITNESS(capstone_one_rank_moe) { grid_case(c); }
K2C_RANK_WITNESS(capstone_dp2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_tp2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_pp2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_pp2_micro_batches) { grid_case(c); }
K2C_RANK_WITNESS(capstone_ep2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_dp2_tp2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_dp2_pp2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_tp2_pp2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_dp2_ep2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_tp2_ep2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_dp2_tp2_pp2) { grid_case(c); }
K2C_RANK_WITNESS(capstone_tp2_pp2_ep2) { grid_case(c); }

// A configuration the grid cannot run is refused on every rank before anything is communicated.
TEST_F(Capstone, RefusesGridsThatDoNotFit) {
  const int n = world().size();
  auto refuses = [&](kc::CapstoneConfig c, const char* why) {
    EXPECT_THROW(kc::GridTrainer(world(), km::cpu_ops(), c, tiny_data().factory(c.train)), std::invalid_argument)
        << why;
  };
  kc::CapstoneConfig c;
  c.train = tiny_config(Model::dense);
  c.grid.dp = n + 1;
  refuses(c, "a grid of another size than the world");
  c.grid = {.dp = n};
  c.micro_batches = 3;
  refuses(c, "a batch that does not split into micro-batches");
  c.micro_batches = 1;
  c.grid = {.ep = n};
  if (n > 1) refuses(c, "expert parallelism without experts");
  c.train = tiny_config(Model::dense);
  c.grid = {.cp = n};
  if (n > 1) refuses(c, "context parallelism, which the capstone's grid does not have");
  c.train.activations = km::DType::i32;
  c.grid = {.dp = n};
  refuses(c, "activations stored as integers");
  c.train = tiny_config(Model::dense);
  c.train.residual = km::DType::i32;
  refuses(c, "a residual stream of integers");
  c.train = tiny_config(Model::dense_bf16_residual);
  c.train.dropout = 0.1f;
  refuses(c, "a bf16 residual stream with dropout, which runs on fp32 only");
  if (n == 1) return;
  // The sizes that must divide (capstone.h), each broken alone on a grid that takes the rest.
  auto refuses_on = [&](kd::GridShape grid, const char* why, auto&& change) {
    c.train = tiny_config(Model::dense);
    c.grid = grid;
    change(c.train);
    refuses(c, why);
  };
  refuses_on({.pp = n}, "more stages than layers", [&](km::TrainConfig& t) { t.model.n_layers = n - 1; });
  refuses_on({.tp = n}, "kv heads that tp does not divide", [&](km::TrainConfig& t) { t.model.kv_heads = 1; });
  refuses_on({.tp = n}, "a width of the MLP that tp does not divide", [&](km::TrainConfig& t) { t.model.d_ff = 4 * n + 1; });
  refuses_on({.tp = n}, "a vocabulary that tp does not divide", [&](km::TrainConfig& t) { t.model.vocab = 256 * n + 1; });
  refuses_on({.tp = n}, "dropout under tensor parallelism", [&](km::TrainConfig& t) { t.dropout = 0.1f; });
  refuses_on({.tp = n}, "a bf16 residual stream under tensor parallelism",
             [&](km::TrainConfig& t) { t.activations = t.residual = km::DType::bf16; });
  c.train = tiny_config(Model::moe);
  c.train.model.experts = 2 * n + 1;
  c.grid = {.ep = n};
  refuses(c, "experts that ep does not divide");
  c.train = tiny_config(Model::moe);
  c.train.dropout = 0.1f;
  refuses(c, "dropout under expert parallelism");
}

// The tiny model on a chain of 32 tokens with 4 successors each reaches the chain's own loss.
TEST_F(Capstone, MarkovReachesTheEntropyFloor) {
  if (world().size() != 2) K2C_SKIP("runs on dp 2 (2 ranks); this run has " + std::to_string(world().size()));
  kc::CapstoneConfig config;
  km::TrainConfig& c = config.train;
  c.model.vocab = 32, c.model.d_model = 32, c.model.n_layers = 1, c.model.q_heads = 2, c.model.kv_heads = 1;
  c.model.d_ff = 64, c.model.seq_len = 16;
  c.batch = 16, c.steps = 300, c.lr = 1e-2f, c.min_lr = 1e-3f, c.warmup = 10;
  c.adamw.weight_decay = 0.0f;
  config.grid = {.dp = 2};
  const Data data(32, 4, 11);
  kc::GridTrainer trainer(world(), km::cpu_ops(), config, data.factory(c));
  // The chain's own loss on exactly the validation tokens the model is evaluated on.
  km::MarkovSource source(11, 32, 4);
  const km::TransitionMatrix P = source.transition_matrix();
  const int batches = 16;
  double floor = 0, n = 0;
  const km::TokenLoader val = data.loader(c, true, 0, 1);
  for (int i = 0; i < batches; ++i) {
    const km::TokenBatch b = val.batch_at(i);
    for (std::size_t t = 0; t < b.targets.size(); ++t, ++n) floor -= std::log(P[b.inputs[t]][b.targets[t]]);
  }
  floor /= n;
  while (trainer.steps_done() < c.steps) (void)trainer.step();
  const double loss = trainer.evaluate(batches);
  EXPECT_TRUE(same_on_every_rank(loss));
  EXPECT_LT(loss - floor, 0.05) << "validation loss " << loss << ", floor " << floor;
  EXPECT_GT(loss - floor, -0.02) << "no model beats the chain that made the data";
}

// 12 steps straight equal 6 steps, a checkpoint, and 6 more in a trainer that loads it.
TEST_F(Capstone, ResumeMatchesUninterruptedRun) {
  const int n = world().size();
  if (n > 4) K2C_SKIP("runs at 1, 2 and 4 ranks; this run has " + std::to_string(n));
  kc::CapstoneConfig config;
  config.train = tiny_config(Model::dense);
  config.train.steps = 12;
  config.grid = n == 4 ? kc::parse_grid("dp2,pp2") : kd::GridShape{.pp = n};
  config.micro_batches = 2;
  // A folder of this job's own (rank 0's process id), so that runs as other users or at the same
  // time never share one.
  long job = static_cast<long>(getpid());
  MPI_Bcast(&job, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("k2c_capstone_resume_" + std::to_string(job));
  if (world().rank() == 0) std::filesystem::create_directories(dir);
  world().barrier();
  const std::filesystem::path ckpt = dir / ("np" + std::to_string(n) + ".bin");
  std::vector<double> straight, resumed;
  {
    kc::GridTrainer t(world(), km::cpu_ops(), config, tiny_data().factory(config.train));
    while (t.steps_done() < 12) straight.push_back(t.step().loss);
  }
  {
    kc::GridTrainer t(world(), km::cpu_ops(), config, tiny_data().factory(config.train));
    while (t.steps_done() < 6) resumed.push_back(t.step().loss);
    t.save(ckpt);
  }
  // The resumed trainer must read the files: a later checkpoint of another trainer is saved in
  // between, and the files move to a new name (the contract's: path, or path + ".rank<r>"), so
  // neither a trainer that restores the state it saved last nor one that keeps states by path in
  // memory resumes from step 6.
  {
    kc::GridTrainer t(world(), km::cpu_ops(), config, tiny_data().factory(config.train));
    while (t.steps_done() < 3) t.step();
    t.save(dir / "decoy.bin");
  }
  const std::filesystem::path moved = dir / "moved.bin";
  world().barrier();
  int missing = -1;  // the first rank whose file is not where the contract puts it
  if (world().rank() == 0)
    for (int r = 0; r < n && missing < 0; ++r) {
      std::error_code ec;
      std::filesystem::rename(checkpoint_file(ckpt, r, n), checkpoint_file(moved, r, n), ec);
      if (ec) missing = r;
    }
  MPI_Bcast(&missing, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (missing >= 0 && world().rank() == 0) std::filesystem::remove_all(dir);
  ASSERT_EQ(missing, -1) << "save() left no file " << checkpoint_file(ckpt, missing, n);
  {
    kc::GridTrainer t(world(), km::cpu_ops(), config, tiny_data().factory(config.train));
    t.load(moved);
    EXPECT_EQ(t.steps_done(), 6);
    while (t.steps_done() < 12) resumed.push_back(t.step().loss);
  }
  EXPECT_EQ(straight, resumed) << "the resumed curve differs from the uninterrupted one";
  // Another grid's checkpoint is refused.
  if (n > 1) {
    kc::CapstoneConfig other = config;
    other.grid = {.dp = n};
    kc::GridTrainer t(world(), km::cpu_ops(), other, tiny_data().factory(other.train));
    EXPECT_THROW(t.load(moved), std::runtime_error);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}
