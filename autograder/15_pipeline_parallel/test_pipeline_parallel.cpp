// autograder/15_pipeline_parallel/test_pipeline_parallel.cpp — tests of module 15 (contract:
// pipeline_parallel.h).
//
// Run as `mpirun -np p` at the rank counts the rubric lists: p ranks are p pipeline stages. On the
// MPI backend every stage runs the model library's CPU backend (the fixture CpuModelTest: those
// tests skip in the NCCL run, whose communicator takes device memory only); the performance test
// runs on NCCL with one GPU per stage and the GPU backend.
//
// The model is small (d 64, 5 blocks, T 32, vocabulary 256) and its 5 blocks split unevenly over
// 2, 3 and 4 stages. Every stage is built by the test with the split the contract describes
// (not with the student's stage_blocks, which has a test of its own), so a wrong split costs
// only that test's points.
//
// The reference is the unsplit model in one process, computed on every rank: for each step, the
// same micro-batches one after the other through Transformer::train_step, with the gradient
// scale 1 / (m · tokens) and the same dropout masks, then one AdamW update. A pipeline runs the
// same operations on the same values in the same order, so after every step each stage's
// gradients and parameters must equal the reference's parameters of the same names bit for bit,
// and the last stage's loss the reference's loss. Dropout is on (probability 0.1), so a micro-batch that
// draws another micro-batch's masks fails too.
//
// The trace must match what the stage ran (Stage keeps its own log) and the contract's order
// exactly; its times must be ordered within a stage and, where all ranks share one clock (one
// host), across stages: a stage starts F(k) only after the stage before ended it, and B(k) only
// after the stage after ended it. Memory: the stage counts the micro-batches it holds (m for
// GPipe, min(m, p − s) for 1F1B), and the activation peak of the ledger must agree with that
// count, measured against one micro-batch's own footprint. Traffic: each boundary carries one
// activation forward and one gradient back per micro-batch, and nothing more (lecture, 7.1).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/dist/counting.h"
#include "k2c/dist/rank_witness.h"
#include "k2c/dist/testing.h"
#include "k2c/model/backend.h"
#include "k2c/model/data.h"
#include "k2c/model/dist_testing.h"
#include "k2c/model/optim.h"
#include "k2c/model/transformer.h"
#include "k2c/testing/testing.h"
#include "pipeline_harness.h"
#include "pipeline_parallel.h"

namespace pp = k2c::pipeline_parallel;
namespace ps = k2c::pipeline_stage;
namespace kd = k2c::dist;
namespace km = k2c::model;
using k2c::dist::testing::world;
using k2c::dist::testing::failed_anywhere;
using k2c::pipeline_harness::split;
using k2c::pipeline_harness::test_model;
using k2c::pipeline_harness::upload_i32;
using ps::Pass;

namespace {

constexpr int kRows = 2;  // sequences per micro-batch
constexpr int kSteps = 2;
constexpr float kDropout = 0.1f, kLr = 1e-2f;
constexpr std::uint64_t kDropoutSeed = 77;

// From the run's seed but not from the test's name (as seed_for would be): the references are
// computed once and shared by every test that needs the same one.
std::uint64_t init_seed() { return k2c::testing::seed() * 31 + 1001; }
std::uint64_t data_seed() { return k2c::testing::seed() * 31 + 2002; }

const std::vector<std::uint16_t>& tokens() {
  static const std::vector<std::uint16_t> t = km::MarkovSource(data_seed(), 256, 8).sample(20000);
  return t;
}

// Host ids and targets of micro-batch k of step `step`: rows of T tokens from places in the
// Markov stream that depend on (step, row of the step's batch) only.
struct HostBatch {
  std::vector<std::int32_t> ids, targets;
};
HostBatch host_batch(const km::ModelConfig& c, int step, int k, int rows) {
  HostBatch b;
  const std::size_t T = static_cast<std::size_t>(c.seq_len), limit = tokens().size() - T - 1;
  for (int r = 0; r < rows; ++r) {
    const std::uint64_t row = static_cast<std::uint64_t>(k) * rows + r;
    const std::size_t at = static_cast<std::size_t>((static_cast<std::uint64_t>(step) * 1000003u + row * 7919u) * 131u % limit);
    for (std::size_t t = 0; t < T; ++t) {
      b.ids.push_back(tokens()[at + t]);
      b.targets.push_back(tokens()[at + t + 1]);
    }
  }
  return b;
}

std::vector<ps::MicroBatch> micro_batches(km::Ops& ops, km::MemoryLedger& ledger, const km::ModelConfig& c, int m,
                                          int rows, int step) {
  std::vector<ps::MicroBatch> out(static_cast<std::size_t>(m));
  for (int k = 0; k < m; ++k) {
    const HostBatch h = host_batch(c, step, k, rows);
    out[static_cast<std::size_t>(k)] = k2c::pipeline_harness::micro_batch(ops, ledger, h.ids, h.targets, rows, k);
  }
  return out;
}

std::vector<float> host(km::Ops& ops, const km::Tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  if (!v.empty()) ops.download(v.data(), t);
  return v;
}

// ---------------------------------------------------------------------------------------------
// The reference: the unsplit model, one process

using Named = std::map<std::string, std::vector<float>>;
struct Snapshot {
  double loss = 0;
  Named grads, values;  // gradients before the update, values after it
};

Named named(km::ParamList& params, km::Ops& ops, bool grads) {
  Named out;
  for (km::ParamId id = 0; id < params.size(); ++id) {
    if (grads && params.info(id).frozen) continue;
    out[params.info(id).name] = host(ops, grads ? params.grad(id) : params.value(id));
  }
  return out;
}

std::vector<Snapshot> compute_reference(int m, int rows) {
  const km::ModelConfig c = test_model();
  km::Ops& ops = km::cpu_ops();
  km::MemoryLedger ledger;
  km::ParamList params;
  km::Context ctx{ops, ledger, params};
  km::Transformer model(params, c);
  params.materialize(ops, ledger, init_seed());
  km::AdamW opt(params, ops, ledger);
  ctx.dropout = kDropout;
  ctx.seed = kDropoutSeed;
  const std::int64_t tokens = static_cast<std::int64_t>(rows) * c.seq_len;
  std::vector<Snapshot> out;
  for (int step = 0; step < kSteps; ++step) {
    params.zero_grads(ops);
    ctx.step = static_cast<std::uint64_t>(step);
    Snapshot s;
    for (int k = 0; k < m; ++k) {
      const HostBatch h = host_batch(c, step, k, rows);
      km::Tensor ids = upload_i32(ops, ledger, h.ids), targets = upload_i32(ops, ledger, h.targets);
      ctx.row_offset = static_cast<std::int64_t>(k) * rows;
      const double loss = model.train_step(ctx, ids, targets, rows, 1.0f / static_cast<float>(m * tokens));
      s.loss += loss / static_cast<double>(tokens);
    }
    s.loss /= m;
    s.grads = named(params, ops, true);
    opt.step(kLr);
    s.values = named(params, ops, false);
    out.push_back(std::move(s));
  }
  return out;
}

const std::vector<Snapshot>& reference(int m, int rows) {
  static std::map<std::pair<int, int>, std::vector<Snapshot>> cache;
  const auto key = std::make_pair(m, rows);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, compute_reference(m, rows)).first;
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// One rank's stage

struct StageRank {
  km::MemoryLedger ledger, data;  // the stage's memory; the micro-batches' tokens apart from it
  km::ParamList params;
  km::Context ctx;
  ps::Stage stage;
  std::unique_ptr<km::AdamW> opt;

  StageRank(km::Ops& ops, const km::ModelConfig& c, int s, int p)
      : ctx{ops, ledger, params}, stage(params, c, split(c.n_layers, p, s), s, p) {
    params.materialize(ops, ledger, init_seed());
    opt = std::make_unique<km::AdamW>(params, ops, ledger);
    ctx.dropout = kDropout;
    ctx.seed = kDropoutSeed;
  }
};

std::string schedule_name(pp::Schedule s) { return s == pp::Schedule::gpipe ? "GPipe" : "1F1B"; }

// Every parameter of the stage against the reference's of the same name, bit for bit.
void expect_bits(km::ParamList& params, km::Ops& ops, const Named& want, bool grads, const std::string& what) {
  int bad = 0;
  for (km::ParamId id = 0; id < params.size() && bad < 3; ++id) {
    const km::ParamInfo& info = params.info(id);
    if (grads && info.frozen) continue;
    const auto it = want.find(info.name);
    if (it == want.end()) {
      ADD_FAILURE() << what << ": the stage holds '" << info.name << "', which the model does not";
      ++bad;
      continue;
    }
    const std::vector<float> got = host(ops, grads ? params.grad(id) : params.value(id));
    if (got.size() != it->second.size() ||
        std::memcmp(got.data(), it->second.data(), got.size() * sizeof(float)) != 0) {
      std::size_t i = 0;
      while (i < got.size() && i < it->second.size() && std::memcmp(&got[i], &it->second[i], sizeof(float)) == 0) ++i;
      ADD_FAILURE() << what << ": " << (grads ? "gradient" : "value") << " of '" << info.name
                    << "' differs from the unsplit model's, first at element " << i << ": "
                    << (i < got.size() ? got[i] : 0.0f) << " instead of "
                    << (i < it->second.size() ? it->second[i] : 0.0f);
      ++bad;
    }
  }
}

// Every early stop is agreed on first (failed_anywhere, k2c/dist/testing.h): a rank that stopped
// while its neighbours went on would leave them waiting for its messages.
// Trains kSteps steps on this rank's stage with `schedule` and m micro-batches and holds each
// step against the reference.
void check_against_reference(pp::Schedule schedule, int m, bool recompute) {
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const int s = w.rank(), p = w.size();
  const km::ModelConfig c = test_model();
  const std::vector<Snapshot>& ref = reference(m, kRows);
  StageRank r(km::cpu_ops(), c, s, p);
  for (int step = 0; step < kSteps; ++step) {
    const std::string what = schedule_name(schedule) + (recompute ? " with recomputation" : "") + ", m = " +
                             std::to_string(m) + ", stage " + std::to_string(s) + " of " + std::to_string(p) +
                             ", step " + std::to_string(step);
    r.params.zero_grads(r.ctx.ops);
    r.ctx.step = static_cast<std::uint64_t>(step);
    const std::vector<ps::MicroBatch> mbs = micro_batches(r.ctx.ops, r.data, c, m, kRows, step);
    const double loss = pp::train_step(p2p, r.stage, r.ctx, mbs, {schedule, recompute}, nullptr);
    if (s == p - 1)
      EXPECT_EQ(loss, ref[static_cast<std::size_t>(step)].loss) << what << ": the step's loss";
    else
      EXPECT_EQ(loss, 0.0) << what << ": only the last stage has a loss";
    EXPECT_EQ(r.stage.live(), 0) << what << ": micro-batches left in flight after the step";
    expect_bits(r.params, r.ctx.ops, ref[static_cast<std::size_t>(step)].grads, true, what);
    r.opt->step(kLr);
    expect_bits(r.params, r.ctx.ops, ref[static_cast<std::size_t>(step)].values, false, what);
    if (failed_anywhere()) return;
  }
}

// The order of passes the contract prescribes for stage s of p.
std::vector<std::pair<Pass, int>> prescribed(pp::Schedule schedule, int s, int p, int m) {
  std::vector<std::pair<Pass, int>> order;
  if (schedule == pp::Schedule::gpipe) {
    for (int k = 0; k < m; ++k) order.emplace_back(Pass::forward, k);
    for (int k = 0; k < m; ++k) order.emplace_back(Pass::backward, k);
    return order;
  }
  const int w = std::min(p - s - 1, m);
  for (int k = 0; k < w; ++k) order.emplace_back(Pass::forward, k);
  for (int i = 0; i < m - w; ++i) {
    order.emplace_back(Pass::forward, w + i);
    order.emplace_back(Pass::backward, i);
  }
  for (int k = m - w; k < m; ++k) order.emplace_back(Pass::backward, k);
  return order;
}

std::string describe(const std::vector<std::pair<Pass, int>>& order) {
  std::ostringstream os;
  for (const auto& [pass, k] : order) os << (pass == Pass::forward ? " F" : " B") << k;
  return os.str();
}

// Whether every rank runs on one host, so that their steady clocks are one clock.
bool one_host() {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < len; ++i) h = (h ^ static_cast<unsigned char>(name[i])) * 1099511628211ull;
  std::uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

// Activation bytes on this stage: what one micro-batch leaves between forward and backward
// (its Saved, the received input included), and the peak of a step of one micro-batch alone.
struct Footprint {
  std::size_t saved = 0, one_step_peak = 0, message = 0;
};

}  // namespace

// Worth no points: it lets the grader say "not implemented yet".
using PipelineParallelContract = kd::testing::CpuModelTest;
TEST_F(PipelineParallelContract, Implemented) {
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  StageRank r(km::cpu_ops(), test_model(), w.rank(), w.size());
  const std::vector<ps::MicroBatch> mbs = micro_batches(r.ctx.ops, r.data, test_model(), 1, 1, 0);
  try {
    (void)pp::stage_blocks(4, 2, 0);
    (void)pp::train_step(p2p, r.stage, r.ctx, mbs, {}, nullptr);
  } catch (const k2c::NotImplemented& e) {
    FAIL() << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// The split (local: every rank checks the same cases)

using PipelineParallelStageSplit = kd::testing::DistTest;
TEST_F(PipelineParallelStageSplit, BlocksPerStage) {
  for (int layers : {1, 2, 3, 5, 7, 8, 12, 13, 32}) {
    for (int stages = 1; stages <= std::min(layers, 9); ++stages) {
      int next = 0;
      for (int s = 0; s < stages; ++s) {
        const ps::Span got = pp::stage_blocks(layers, stages, s);
        const int want = layers / stages + (s < layers % stages ? 1 : 0);
        EXPECT_EQ(got.first, next) << layers << " blocks, stage " << s << " of " << stages << ": not where the stage before ended";
        EXPECT_EQ(got.size(), want) << layers << " blocks, stage " << s << " of " << stages
                                    << ": the first " << layers % stages << " stages hold one block more";
        next = got.last;
      }
      EXPECT_EQ(next, layers) << layers << " blocks on " << stages << " stages are not all placed";
    }
  }
  // More stages than blocks leaves a stage with nothing to do: refused, with both counts named.
  try {
    (void)pp::stage_blocks(3, 4, 0);
    ADD_FAILURE() << "stage_blocks(3 blocks, 4 stages) must throw std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find('3'), std::string::npos) << "the message should name the block count: " << msg;
    EXPECT_NE(msg.find('4'), std::string::npos) << "the message should name the stage count: " << msg;
  }
  EXPECT_THROW((void)pp::stage_blocks(4, 0, 0), std::invalid_argument);
  EXPECT_THROW((void)pp::stage_blocks(4, 2, 2), std::invalid_argument);
  EXPECT_THROW((void)pp::stage_blocks(4, 2, -1), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Bit-exact against the unsplit model

using PipelineParallel = kd::testing::CpuModelTest;

TEST_F(PipelineParallel, GpipeMatchesOneProcess) { check_against_reference(pp::Schedule::gpipe, 4, false); }

TEST_F(PipelineParallel, OneFOneBMatchesOneProcess) { check_against_reference(pp::Schedule::one_f_one_b, 6, false); }

// The grader's own check of a step's schedules (k2c/dist/rank_witness.h; the cases and the layout
// in autograder/witness/rank_cases_training.cpp): the checker's model, seeds and micro-batches, the
// stage built with the contract's split, one train_step.
namespace {
void pipeline_case(k2c::dist::testing::RankCase& c) {
  const km::ModelConfig m = km::testing::witness_model(c.args);
  const int count = static_cast<int>(c.args[2]), rows = static_cast<int>(c.args[3]);
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const int s = w.rank(), p = w.size();
  km::Ops& ops = km::cpu_ops();
  km::MemoryLedger ledger, data;
  km::ParamList params;
  km::Context ctx{ops, ledger, params};
  ps::Stage stage(params, m, split(m.n_layers, p, s), s, p);
  params.materialize(ops, ledger, static_cast<std::uint64_t>(c.args[12]));
  ctx.dropout = static_cast<float>(c.args[15]) / 1e6f;
  ctx.seed = static_cast<std::uint64_t>(c.args[13]);
  ctx.step = static_cast<std::uint64_t>(c.args[14]);
  params.zero_grads(ops);
  const std::size_t per = static_cast<std::size_t>(rows) * m.seq_len;
  if (c.in.size() != static_cast<std::size_t>(count) * 2 * per * sizeof(std::int32_t))
    throw std::runtime_error("the micro-batches do not fit the model");
  std::vector<ps::MicroBatch> mbs(static_cast<std::size_t>(count));
  for (int k = 0; k < count; ++k) {
    std::vector<std::int32_t> ids(per), targets(per);
    std::memcpy(ids.data(), c.in.data() + (2 * k) * per * sizeof(std::int32_t), per * sizeof(std::int32_t));
    std::memcpy(targets.data(), c.in.data() + (2 * k + 1) * per * sizeof(std::int32_t), per * sizeof(std::int32_t));
    mbs[static_cast<std::size_t>(k)] = k2c::pipeline_harness::micro_batch(ops, data, ids, targets, rows, k);
  }
  const pp::Schedule schedule = c.args[0] ? pp::Schedule::one_f_one_b : pp::Schedule::gpipe;
  const double loss = pp::train_step(p2p, stage, ctx, mbs, {schedule, c.args[1] != 0}, nullptr);
  std::vector<unsigned char> out(sizeof loss);
  std::memcpy(out.data(), &loss, sizeof loss);
  for (km::ParamId id = 0; id < params.size(); ++id) {
    const std::vector<float> g = host(ops, params.grad(id));
    const std::size_t at = out.size();
    out.resize(at + g.size() * sizeof(float));
    if (!g.empty()) std::memcpy(out.data() + at, g.data(), g.size() * sizeof(float));
  }
  if (out.size() != c.out.size()) throw std::runtime_error("the stage's gradients are not the size the checker expects");
  c.out = std::move(out);
}
}  // namespace

K2C_RANK_WITNESS(pipeline_gpipe) { pipeline_case(c); }
K2C_RANK_WITNESS(pipeline_1f1b) { pipeline_case(c); }
K2C_RANK_WITNESS(pipeline_few_micro_batches) { pipeline_case(c); }
K2C_RANK_WITNESS(pipeline_recompute) { pipeline_case(c); }

// Fewer micro-batches than stages: 1F1B's warm-up is cut short (w = m on the early stages) and
// the steady state may be empty; m = 1 is no pipelining at all, and must still be right.
TEST_F(PipelineParallel, FewMicroBatches) {
  const int p = world().size();
  std::vector<int> ms = {1};
  if (p >= 3) ms.push_back(p - 1);
  if (p >= 2) ms.push_back(2);
  std::sort(ms.begin(), ms.end());
  ms.erase(std::unique(ms.begin(), ms.end()), ms.end());
  for (int m : ms) {
    for (pp::Schedule schedule : {pp::Schedule::gpipe, pp::Schedule::one_f_one_b}) {
      check_against_reference(schedule, m, false);
      if (failed_anywhere()) return;
    }
  }
}

// Recomputation keeps only each micro-batch's input and runs the stage's forward again in
// backward: the same bits, and a lower activation peak (checked with GPipe, where it matters most).
TEST_F(PipelineParallel, Recompute) {
  check_against_reference(pp::Schedule::gpipe, 4, true);
  if (failed_anywhere()) return;
  check_against_reference(pp::Schedule::one_f_one_b, 4, true);
  if (failed_anywhere()) return;
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const int s = w.rank(), p = w.size(), m = 4;
  const km::ModelConfig c = test_model();
  std::size_t peaks[2] = {0, 0};
  for (bool recompute : {false, true}) {
    StageRank r(km::cpu_ops(), c, s, p);
    const std::vector<ps::MicroBatch> mbs = micro_batches(r.ctx.ops, r.data, c, m, kRows, 0);
    r.ledger.reset_peaks();
    const std::size_t base = r.ledger.current(km::Category::activations);
    pp::train_step(p2p, r.stage, r.ctx, mbs, {pp::Schedule::gpipe, recompute}, nullptr);
    peaks[recompute ? 1 : 0] = r.ledger.peak(km::Category::activations) - base;
  }
  EXPECT_LT(peaks[1], peaks[0]) << "stage " << s << " of " << p << ": GPipe's activation peak with recomputation ("
                                << peaks[1] << " bytes) is not below the peak without (" << peaks[0] << " bytes)";
}

// Traffic (lecture 15, section 7.1): per step a boundary carries each micro-batch's activation
// forward and its gradient back, [rows·T, d] fp32 each, point to point, whatever the schedule and
// with or without recomputation. So stage s sends m such tensors to s + 1 unless it is the last and
// m to s − 1 unless it is the first: a message sent twice, a tensor in the wrong dtype or a
// gradient sent on from the first stage shows. Counted by a CountingCommunicator under the stage's
// PointToPointView (which offers nothing but point-to-point): sends and the sending half of
// send_recv, in bytes, whatever the messages' split into calls.
TEST_F(PipelineParallel, TrafficMatchesTheFormula) {
  kd::Communicator& w = world();
  const int s = w.rank(), p = w.size(), m = 4;
  if (p == 1) K2C_SKIP("one stage sends nothing: traffic is counted at 2 to 4 stages");
  const km::ModelConfig c = test_model();
  const std::uint64_t tensor = static_cast<std::uint64_t>(kRows) * c.seq_len * c.d_model * sizeof(float);
  const std::uint64_t want = m * tensor * ((s < p - 1 ? 1 : 0) + (s > 0 ? 1 : 0));
  for (pp::Schedule schedule : {pp::Schedule::gpipe, pp::Schedule::one_f_one_b})
    for (bool recompute : {false, true}) {
      kd::CountingCommunicator counting(w, "stages");
      kd::PointToPointView p2p(counting);
      StageRank r(km::cpu_ops(), c, s, p);
      const std::vector<ps::MicroBatch> mbs = micro_batches(r.ctx.ops, r.data, c, m, kRows, 0);
      pp::train_step(p2p, r.stage, r.ctx, mbs, {schedule, recompute}, nullptr);
      const std::uint64_t sent = counting.total("send").bytes + counting.total("send_recv").bytes;
      const std::string what = schedule_name(schedule) + (recompute ? " with recomputation" : "") + ", stage " +
                               std::to_string(s) + " of " + std::to_string(p) + ", m = " + std::to_string(m);
      EXPECT_EQ(sent, want) << what << ": bytes sent in one step, " << m << " micro-batches of " << tensor
                            << " bytes to each neighbour\n" << counting.report();
      if (failed_anywhere()) return;
    }
}

// ---------------------------------------------------------------------------------------------
// The trace

TEST_F(PipelineParallel, TraceIsValid) {
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const int s = w.rank(), p = w.size(), m = 5;
  const km::ModelConfig c = test_model();
  const bool shared_clock = one_host();
  for (pp::Schedule schedule : {pp::Schedule::gpipe, pp::Schedule::one_f_one_b}) {
    const std::string what = schedule_name(schedule) + ", m = " + std::to_string(m) + ", stage " + std::to_string(s) +
                             " of " + std::to_string(p);
    StageRank r(km::cpu_ops(), c, s, p);
    const std::vector<ps::MicroBatch> mbs = micro_batches(r.ctx.ops, r.data, c, m, kRows, 0);
    // One origin for every rank (rank 0's clock reading), so that times compare across stages.
    std::int64_t origin = std::chrono::steady_clock::now().time_since_epoch().count();
    MPI_Bcast(&origin, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    pp::Trace trace;
    trace.origin = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(origin));
    r.stage.reset_counts();
    pp::train_step(p2p, r.stage, r.ctx, mbs, {schedule, false}, &trace);

    // What ran, by the stage's own log, and what the trace says ran.
    std::vector<std::pair<Pass, int>> ran, traced;
    for (const ps::Stage::Ran& x : r.stage.log()) ran.emplace_back(x.pass, x.micro_batch);
    for (const pp::Event& e : trace.events) traced.emplace_back(e.pass, e.micro_batch);
    const std::vector<std::pair<Pass, int>> want = prescribed(schedule, s, p, m);
    EXPECT_EQ(describe(ran), describe(want)) << what << ": the passes the stage ran are not the schedule's";
    EXPECT_EQ(describe(traced), describe(ran)) << what << ": the trace is not what the stage ran";

    // Counts, order within the stage, and micro-batches in flight.
    std::vector<int> fwd(m, 0), bwd(m, 0);
    int in_flight = 0, lowest = 0;
    double last_end = -1e300;
    for (const pp::Event& e : trace.events) {
      if (e.micro_batch < 0 || e.micro_batch >= m) {  // no early return: the ranks gather below
        ADD_FAILURE() << what << ": event of micro-batch " << e.micro_batch;
        continue;
      }
      EXPECT_LE(e.start_ms, e.end_ms) << what << ": an event ends before it starts";
      EXPECT_GE(e.start_ms, last_end) << what << ": events overlap on one stage";
      last_end = e.end_ms;
      if (e.pass == Pass::forward) {
        ++fwd[static_cast<std::size_t>(e.micro_batch)];
        ++in_flight;
      } else {
        EXPECT_EQ(fwd[static_cast<std::size_t>(e.micro_batch)], 1)
            << what << ": backward of micro-batch " << e.micro_batch << " before its forward";
        ++bwd[static_cast<std::size_t>(e.micro_batch)];
        --in_flight;
      }
      lowest = std::min(lowest, in_flight);
    }
    for (int k = 0; k < m; ++k) {
      EXPECT_EQ(fwd[static_cast<std::size_t>(k)], 1) << what << ": forwards of micro-batch " << k;
      EXPECT_EQ(bwd[static_cast<std::size_t>(k)], 1) << what << ": backwards of micro-batch " << k;
    }
    EXPECT_GE(lowest, 0) << what << ": more backwards than forwards at some point";
    EXPECT_EQ(in_flight, 0) << what << ": micro-batches still in flight at the end";

    // Across stages: F(k) on s + 1 starts after F(k) on s ended, B(k) on s after B(k) on s + 1.
    // Every rank shares the 2m events of every rank (padded, should one be short).
    const std::size_t n = 2 * static_cast<std::size_t>(m);
    std::vector<double> mine(4 * n, -1), all(4 * n * static_cast<std::size_t>(p));
    for (std::size_t i = 0; i < std::min(n, trace.events.size()); ++i) {
      const pp::Event& e = trace.events[i];
      mine[4 * i] = e.pass == Pass::forward ? 0 : 1;
      mine[4 * i + 1] = e.micro_batch, mine[4 * i + 2] = e.start_ms, mine[4 * i + 3] = e.end_ms;
    }
    MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, all.data(), static_cast<int>(mine.size()),
                  MPI_DOUBLE, MPI_COMM_WORLD);
    if (!shared_clock || s + 1 >= p) continue;
    auto find = [&](int stage, int pass, int k, bool start) {
      for (std::size_t i = 0; i < n; ++i) {
        const double* e = &all[(static_cast<std::size_t>(stage) * n + i) * 4];
        if (e[0] == pass && e[1] == k) return start ? e[2] : e[3];
      }
      return start ? -1e300 : 1e300;  // missing: counted above already
    };
    for (int k = 0; k < m; ++k) {
      EXPECT_GE(find(s + 1, 0, k, true), find(s, 0, k, false))
          << what << ": stage " << s + 1 << " started F" << k << " before stage " << s << " ended it";
      EXPECT_GE(find(s, 1, k, true), find(s + 1, 1, k, false))
          << what << ": stage " << s << " started B" << k << " before stage " << s + 1 << " ended it";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Memory

TEST_F(PipelineParallel, PeakActivations) {
  kd::Communicator& w = world();
  kd::PointToPointView p2p(w);
  const int s = w.rank(), p = w.size(), m = 6;
  const km::ModelConfig c = test_model();

  // One micro-batch's footprint on this stage, measured with the stage alone: the bytes its Saved
  // holds between forward and backward (the received input included), and the peak of a whole
  // step of one micro-batch through the schedule (the working set of one forward and backward,
  // with its messages).
  Footprint f;
  {
    StageRank r(km::cpu_ops(), c, s, p);
    const std::vector<ps::MicroBatch> one = micro_batches(r.ctx.ops, r.data, c, 1, kRows, 0);
    const km::Shape shape = r.stage.activation_shape(kRows);
    f.message = static_cast<std::size_t>(shape.numel()) * sizeof(float);
    const std::size_t before = r.ledger.current(km::Category::activations);
    km::Tensor input, output, dinput;
    if (!r.stage.is_first()) {
      input = r.ctx.tensor(shape);
      r.ctx.ops.fill(input, 0.5f);
    }
    ps::Stage::Saved saved;
    r.stage.forward(r.ctx, one[0], std::move(input), 1.0f, false, saved, output);
    output = km::Tensor();
    f.saved = r.ledger.current(km::Category::activations) - before;
    km::Tensor dout;
    if (!r.stage.is_last()) {
      dout = r.ctx.tensor(shape);
      r.ctx.ops.fill(dout, 0.25f);
    }
    r.stage.backward(r.ctx, one[0], saved, dout, dinput);
    dinput = km::Tensor();
    dout = km::Tensor();
    r.params.zero_grads(r.ctx.ops);
    r.ledger.reset_peaks();
    const std::size_t base = r.ledger.current(km::Category::activations);
    pp::train_step(p2p, r.stage, r.ctx, one, {pp::Schedule::gpipe, false}, nullptr);
    f.one_step_peak = r.ledger.peak(km::Category::activations) - base;
  }

  for (pp::Schedule schedule : {pp::Schedule::gpipe, pp::Schedule::one_f_one_b}) {
    const std::string what = schedule_name(schedule) + ", m = " + std::to_string(m) + ", stage " + std::to_string(s) +
                             " of " + std::to_string(p);
    StageRank r(km::cpu_ops(), c, s, p);
    const std::vector<ps::MicroBatch> mbs = micro_batches(r.ctx.ops, r.data, c, m, kRows, 0);
    r.stage.reset_counts();
    r.ledger.reset_peaks();
    const std::size_t base = r.ledger.current(km::Category::activations);
    pp::train_step(p2p, r.stage, r.ctx, mbs, {schedule, false}, nullptr);
    const std::size_t peak = r.ledger.peak(km::Category::activations) - base;
    const int held = schedule == pp::Schedule::gpipe ? m : std::min(m, p - s);
    EXPECT_EQ(r.stage.peak_live(), held) << what << ": micro-batches held at once";
    EXPECT_EQ(r.ledger.current(km::Category::activations), base) << what << ": activations left after the step";
    // The others' Saved plus one micro-batch's whole working set, and a few messages' worth of
    // room for buffers a schedule may hold a little longer than the one-micro-batch step did.
    const std::size_t bound = static_cast<std::size_t>(held - 1) * f.saved + f.one_step_peak + 4 * f.message;
    EXPECT_LE(peak, bound) << what << ": activation peak " << peak << " bytes, more than " << held - 1
                           << " micro-batches' saved " << f.saved << " bytes each, one step of one micro-batch ("
                           << f.one_step_peak << " bytes) and 4 messages of " << f.message << " bytes";
    if (schedule == pp::Schedule::gpipe)
      EXPECT_GE(peak, static_cast<std::size_t>(m) * f.saved) << what << ": GPipe holds every micro-batch at its peak";
  }
}

// ---------------------------------------------------------------------------------------------
// Performance: NCCL, one GPU per stage

using PipelineParallelPerf = kd::testing::DistTest;
TEST_F(PipelineParallelPerf, StepVsIdeal) {
  K2C_REQUIRE_NCCL();
  kd::Communicator& w = world();
  if (w.size() < 2) K2C_SKIP("needs 2 or more GPUs, one per stage (this run has 1)");
  // The model's kernels on the world's compute stream: sends and receives are ordered after the
  // work that produced their data, and the work that reads what they received after them.
  km::Ops* gpu = km::backend_if_built(true, w.compute_stream());
  if (!gpu) K2C_SKIP("built without the model library's GPU backend (k2c_model_cuda)");
  if (k2c::testing::sanitizing()) K2C_SKIP("timing is skipped under compute-sanitizer");
  km::Ops& ops = *gpu;
  // The stages' traffic is counted (k2c/dist/counting.h), so that a timed step that skips its
  // sends and receives, and with them the bubble, cannot pass for a fast one.
  kd::CountingCommunicator counting(w, "stages");
  kd::PointToPointView p2p(counting);
  const int s = w.rank(), p = w.size(), m = 4 * p;
  const km::ModelConfig c = k2c::pipeline_harness::gpu_model();
  const int rows = k2c::pipeline_harness::kGpuRows;
  km::MemoryLedger ledger, data;
  km::ParamList params;
  km::Context ctx{ops, ledger, params};
  ps::Stage stage(params, c, split(c.n_layers, p, s), s, p);
  params.materialize(ops, ledger, init_seed());
  const std::vector<ps::MicroBatch> mbs = k2c::pipeline_harness::synthetic_micro_batches(ops, data, c, m, rows);

  // One micro-batch's forward and backward on this stage alone, no communication; the slowest
  // stage's time counts (time_step takes the maximum over ranks), as it paces the pipeline.
  const float scale = 1.0f / static_cast<float>(m * rows * c.seq_len);
  const kd::TimeStepOptions opt{.warmup = 2, .repeats = 7};
  const double one_ms =
      kd::time_step(w, [&] { k2c::pipeline_harness::run_alone(stage, ctx, mbs[0], scale, false); }, opt).median_ms;
  // Every timed step must run the schedule's passes, all of them: the stage's own log is checked
  // after each call (host work outside the GPU's timeline), so that a step that skips passes on
  // the timed calls cannot pass for a fast one.
  // Each step must also send what TrafficMatchesTheFormula counts: m activations, fp32
  // [rows·T, d] each, to each neighbour.
  const std::vector<std::pair<Pass, int>> want = prescribed(pp::Schedule::one_f_one_b, s, p, m);
  const std::uint64_t tensor = static_cast<std::uint64_t>(rows) * c.seq_len * c.d_model * sizeof(float);
  const std::uint64_t want_bytes = m * tensor * ((s < p - 1 ? 1 : 0) + (s > 0 ? 1 : 0));
  auto sent = [&] { return counting.total("send").bytes + counting.total("send_recv").bytes; };
  int wrong_steps = 0, wrong_traffic = 0;
  const double step_ms = kd::time_step(w, [&] {
    stage.reset_counts();
    const std::uint64_t before = sent();
    pp::train_step(p2p, stage, ctx, mbs, {pp::Schedule::one_f_one_b, false}, nullptr);
    if (sent() - before != want_bytes) ++wrong_traffic;
    std::vector<std::pair<Pass, int>> ran;
    for (const ps::Stage::Ran& x : stage.log()) ran.emplace_back(x.pass, x.micro_batch);
    if (ran != want || stage.live() != 0) ++wrong_steps;
  }, opt).median_ms;
  EXPECT_EQ(wrong_steps, 0) << "timed 1F1B steps whose passes on stage " << s << " were not the schedule's "
                            << describe(want);
  EXPECT_EQ(wrong_traffic, 0) << "timed 1F1B steps in which stage " << s << " did not send " << m << " tensors of "
                              << tensor << " bytes to each neighbour\n" << counting.report();
  const double ideal_ms = (m + p - 1) * one_ms;
  if (s == 0)
    K2C_EXPECT_PERF(1e3 / step_ms, 1e3 / ideal_ms,
                    "1F1B, " + std::to_string(p) + " stages, " + std::to_string(m) + " micro-batches: step " +
                        std::to_string(step_ms) + " ms against the ideal (m + p - 1) x " + std::to_string(one_ms) +
                        " ms = " + std::to_string(ideal_ms) + " ms");
}
