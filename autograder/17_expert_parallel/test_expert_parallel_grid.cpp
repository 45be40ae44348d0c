// autograder/17_expert_parallel/test_expert_parallel_grid.cpp — tests of module 17 (contract:
// expert_parallel.h), continued: the traffic of every collective against the EP and TP formulas,
// expert parallelism inside a dp × ep grid, refusals, and the speed test of dispatch and combine
// (NCCL). Sizes, references and tolerances as at the top of test_expert_parallel.cpp.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "expert_parallel_testing.h"

using namespace k2c::expert_parallel_testing;  // the shared helpers and the fixture

// ---------------------------------------------------------------------------------------------
// traffic, against expert parallelism's formulas and tensor parallelism's

namespace {

// The same layer under tensor parallelism: each rank holds F/n of every expert's width (rows of
// gate and up, columns of down) and the whole router, and all the tokens. model::Moe over the
// narrower experts gives this rank's part of the output; a SwiGLU's hidden features are
// independent, so the parts sum to the whole, and one all-reduce makes it. The input gradient's
// parts (the experts' and, with no balance term, the router's, which is linear in the experts'
// outputs) sum the same way.
struct TensorParallelMoe {
  km::ParamList params;
  km::Moe moe;
  km::Context ctx;
  std::vector<km::Tensor> owned;
  TensorParallelMoe(Side& whole, km::MemoryLedger& ledger, const km::MoeConfig& cfg, int n, int r)
      : moe(params, "moe", narrow(cfg, n)), ctx{whole.ops(), ledger, params} {
    params.materialize(whole.ops(), ledger, kWeightSeed, {.values = false, .grads = true});
    const std::int64_t F = cfg.d_expert, f = F / n, d = cfg.d_model;
    for (km::ParamId id = 0; id < params.size(); ++id) {
      const std::string& name = params.info(id).name;
      const Host all = whole.value(name);
      Host part;
      if (name == "moe.experts.down.weight") {  // [E, d, F] → columns [r·f, (r+1)·f) of each row
        for (std::int64_t row = 0; row < cfg.experts * d; ++row)
          part.insert(part.end(), all.begin() + row * F + r * f, all.begin() + row * F + (r + 1) * f);
      } else if (name != "moe.router.weight") {  // gate, up [E, F, d] → rows [r·f, (r+1)·f) of each expert
        for (int e = 0; e < cfg.experts; ++e)
          part.insert(part.end(), all.begin() + (e * F + r * f) * d, all.begin() + (e * F + (r + 1) * f) * d);
      } else {
        part = all;
      }
      owned.emplace_back(whole.ops().memory(), ledger, km::Category::params, params.info(id).shape);
      whole.ops().upload(owned.back(), part.data());
      params.bind_value(id, owned.back().f32());
    }
  }
  static km::MoeConfig narrow(km::MoeConfig c, int n) {
    c.d_expert /= n;
    return c;
  }
};

}  // namespace

TEST_F(ExpertParallel, TrafficMatchesFormulas) {
  Group& g = group();
  const km::MoeConfig cfg = moe_config(2, 1, 0.01f);
  const LayerRun run = run_against_moe(g, {cfg, false, "traffic/ep"}, n(), r());
  const auto [out, in] = link_rows(run.routed, r(), -1);
  const std::uint64_t rows_bytes = 4u * kModel * static_cast<std::uint64_t>(out + in);
  auto at = [](const kd::TrafficTable& t, const std::string& label, const std::string& op) {
    const auto l = t.find(label);
    if (l == t.end()) return kd::Traffic{};
    const auto o = l->second.find(op);
    return o == l->second.end() ? kd::Traffic{} : o->second;
  };
  auto calls = [](const kd::TrafficTable& t) {
    std::uint64_t c = 0;
    for (const auto& [label, ops] : t)
      for (const auto& [op, tr] : ops) c += tr.calls;
    return c;
  };
  // Forward.
  EXPECT_EQ(at(run.forward, "ep", "all_to_all").calls, 1u) << "forward: one counts exchange";
  EXPECT_EQ(at(run.forward, "ep", "all_to_all").bytes, 4u * kExperts);
  EXPECT_EQ(at(run.forward, "ep", "all_reduce").calls, 1u) << "forward: one all-reduce of the group's load";
  EXPECT_EQ(at(run.forward, "ep", "all_reduce").bytes, 4u * (2 * kExperts + 1)) << "2E + 1 floats";
  const kd::Traffic fwd = at(run.forward, "ep", "all_to_all_v");
  EXPECT_EQ(fwd.bytes, rows_bytes) << "forward: 4·d·(rows_out " << out << " + rows_in " << in << ")";
  EXPECT_EQ(fwd.started, fwd.calls) << "every all_to_all_v started";
  EXPECT_EQ(calls(run.forward), 2 + fwd.calls) << "forward: nothing else";
  // Backward.
  const kd::Traffic bwd = at(run.backward, "ep", "all_to_all_v");
  EXPECT_EQ(bwd.bytes, rows_bytes) << "backward: dy's rows out, dx's rows back";
  EXPECT_EQ(bwd.started, bwd.calls);
  EXPECT_GE(bwd.calls, 2u);
  EXPECT_EQ(calls(run.backward), bwd.calls) << "backward: nothing but the row exchanges";
  for (const char* name : {"moe.router.weight", "moe.shared.gate.weight", "moe.shared.up.weight", "moe.shared.down.weight"}) {
    const auto it = run.a2av_started_when_final.find(name);
    EXPECT_TRUE(it != run.a2av_started_when_final.end() && it->second >= 1)
        << name << ": its gradient must become final while dy's rows travel (after the exchange is started)";
  }
  // Gradients: the dense ones over dp × ep, none for the experts at dp 1.
  const std::uint64_t dense_bytes = 4u * (kExperts * kModel + 3u * kModel * kWidth);
  const kd::Traffic red = at(run.reduce, "dp+ep", "all_reduce");
  EXPECT_EQ(red.calls, n() > 1 ? 4u : 0u) << "one all-reduce per dense parameter (none on one rank)";
  EXPECT_EQ(red.bytes, n() > 1 ? dense_bytes : 0u);
  EXPECT_EQ(calls(run.reduce), red.calls) << "expert gradients are complete at dp 1: nothing to reduce";

  // Every row that leaves a rank arrives at another: the group's rows_out and rows_in agree.
  std::int64_t sum_out = 0, sum_in = 0;
  for (int q = 0; q < n(); ++q) {
    const auto [o, i] = link_rows(run.routed, q, -1);
    sum_out += o, sum_in += i;
  }
  EXPECT_EQ(sum_out, sum_in);

  // Tensor parallelism on the same layer (no shared expert, no balance term), N tokens on every
  // rank: one all-reduce of 4·N·d each way, whatever the routing.
  const km::MoeConfig tcfg = moe_config(2, 0, 0.0f);
  Side ref(km::cpu_ops());
  km::Moe whole(ref.params, "moe", tcfg);
  ref.materialize(kWeightSeed);
  km::MemoryLedger ledger;
  TensorParallelMoe tpm(ref, ledger, tcfg, n(), r());
  const Host x = random_host(kTokens * kModel, "traffic/tp/x"), dy = random_host(kTokens * kModel, "traffic/tp/dy");
  km::Tensor xr = ref.upload(x, {kTokens, kModel}), yr = ref.tensor({kTokens, kModel}), dyr = ref.upload(dy, {kTokens, kModel}),
             dxr = ref.tensor({kTokens, kModel});
  km::Tensor yt = ref.tensor({kTokens, kModel}), dxt = ref.tensor({kTokens, kModel});
  km::Moe::Saved sr, st;
  whole.forward(ref.ctx, xr, yr, sr);
  ref.params.begin_backward();
  whole.backward(ref.ctx, xr, sr, dyr, dxr);
  ref.params.end_backward();
  g.counting.reset();
  tpm.moe.forward(tpm.ctx, xr, yt, st);
  g.tp().all_reduce(yt.raw(), yt.raw(), static_cast<std::size_t>(yt.numel()), kd::DType::f32, kd::ReduceOp::sum);
  const kd::Traffic tp_fwd = g.count("tp", "all_reduce");
  tpm.params.begin_backward();
  tpm.moe.backward(tpm.ctx, xr, st, dyr, dxt);
  tpm.params.end_backward();
  g.tp().all_reduce(dxt.raw(), dxt.raw(), static_cast<std::size_t>(dxt.numel()), kd::DType::f32, kd::ReduceOp::sum);
  const kd::Traffic tp_all = g.count("tp", "all_reduce");
  expect_close(ref.download(yt), ref.download(yr), "tensor-parallel y (the comparison is of the same layer)");
  expect_close(ref.download(dxt), ref.download(dxr), "tensor-parallel dx");
  const std::uint64_t tp_bytes = 4u * kTokens * kModel;
  EXPECT_EQ(tp_fwd.calls, 1u);
  EXPECT_EQ(tp_fwd.bytes, tp_bytes) << "tensor parallelism: one all-reduce of 4·N·d forward";
  EXPECT_EQ(tp_all.calls, 2u);
  EXPECT_EQ(tp_all.bytes, 2 * tp_bytes) << "and one backward";

  if (r() == 0) {
    // Per token and pass, bytes each rank puts on its links: EP its rows out and back in
    // (rows_out + rows_in), TP a ring all-reduce's 2(n−1)/n of the buffer.
    const double ep_per_token = static_cast<double>(rows_bytes) / kTokens;
    const double tp_per_token = 2.0 * (n() - 1) / n() * static_cast<double>(tp_bytes) / kTokens;
    std::printf("[ traffic  ] per token and pass, rank 0: expert parallelism %.1f bytes, tensor parallelism %.1f bytes"
                " (k = %d, n = %d)\n",
                ep_per_token, tp_per_token, cfg.top_k, n());
  }
}

// ---------------------------------------------------------------------------------------------
// data and expert parallelism on one grid

TEST_F(ExpertParallel, DataAndExpertGrid) {
  if (n() != 4) K2C_SKIP("needs 4 ranks (dp 2 × ep 2); this run has " + std::to_string(n()));
  static kd::CountingCommunicator* counting = new kd::CountingCommunicator(world(), "world");
  static kd::ProcessGrid* grid = new kd::ProcessGrid(*counting, {.dp = 2, .ep = 2});
  kd::Communicator& dense = grid->group({kd::Axis::dp, kd::Axis::ep});
  counting->reset();
  const km::MoeConfig cfg = moe_config(2, 1, 0.0f);  // the balance term is per ep group: left out
  const std::int64_t T = static_cast<std::int64_t>(n()) * kTokens;
  Side ref(km::cpu_ops()), par(km::cpu_ops());
  km::Moe whole(ref.params, "moe", cfg);
  xp::ExpertParallelMoe mine(grid->group(kd::Axis::ep), par.params, "moe", cfg);
  EXPECT_EQ(mine.first_expert(), grid->coord(kd::Axis::ep) * (kExperts / 2));
  ref.materialize(kWeightSeed);
  par.materialize(kWeightSeed);
  const Host X = random_host(T * kModel, "grid/x"), dY = random_host(T * kModel, "grid/dy");
  km::Tensor xr = ref.upload(X, {T, kModel}), yr = ref.tensor({T, kModel}), dyr = ref.upload(dY, {T, kModel}),
             dxr = ref.tensor({T, kModel});
  km::Tensor xm = par.upload(row_block(X, kModel, r() * kTokens, kTokens), {kTokens, kModel}),
             ym = par.tensor({kTokens, kModel}), dym = par.upload(row_block(dY, kModel, r() * kTokens, kTokens), {kTokens, kModel}),
             dxm = par.tensor({kTokens, kModel});
  km::Moe::Saved sr;
  xp::ExpertParallelMoe::Saved sm;
  whole.forward(ref.ctx, xr, yr, sr);
  ref.params.begin_backward();
  whole.backward(ref.ctx, xr, sr, dyr, dxr);
  ref.params.end_backward();
  mine.forward(par.ctx, xm, ym, sm);
  par.params.begin_backward();
  mine.backward(par.ctx, xm, sm, dym, dxm);
  par.params.end_backward();
  counting->reset();
  xp::reduce_gradients(dense, grid->group(kd::Axis::dp), par.ctx, mine);
  EXPECT_EQ(counting->count("dp+ep", "all_reduce").calls, 4u) << "router and shared expert over dp × ep";
  EXPECT_EQ(counting->count("dp", "all_reduce").calls, 3u) << "the expert shards over dp";
  EXPECT_EQ(counting->count("dp", "all_reduce").bytes, 4u * 3 * (kExperts / 2) * kWidth * kModel);
  expect_close(par.download(ym), row_block(ref.download(yr), kModel, r() * kTokens, kTokens), "y");
  expect_close(par.download(dxm), row_block(ref.download(dxr), kModel, r() * kTokens, kTokens), "dx");
  const std::map<std::string, Host> want = grads_of(ref);
  expect_params_match(par, ref, &want);
}

// ---------------------------------------------------------------------------------------------
// expert counts that do not divide

TEST_F(ExpertParallel, RejectsIndivisibleExperts) {
  Group& g = group();
  {
    km::ParamList params;  // a count that divides is accepted
    xp::ExpertParallelMoe ok(g.ep(), params, "moe", moe_config(2, 1, 0.01f));
    EXPECT_EQ(params.size(), 7) << "router, three expert shards, three shared weights";
  }
  if (n() == 1) return;  // every count divides by 1
  const int odd = 2 * n() + 1;
  auto expect_named = [&](const std::string& what, const auto& call) {
    try {
      call();
      ADD_FAILURE() << what << ": " << odd << " experts over " << n() << " ranks were accepted";
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(std::to_string(odd)), std::string::npos) << what << ": the message names the expert count: " << m;
      EXPECT_NE(m.find(std::to_string(n())), std::string::npos) << what << ": the message names the group size: " << m;
    }
  };
  km::ParamList params;
  km::MoeConfig bad = moe_config(2, 1, 0.01f);
  bad.experts = odd;
  expect_named("ExpertParallelMoe", [&] { xp::ExpertParallelMoe(g.ep(), params, "moe", bad); });
  EXPECT_EQ(params.size(), 0) << "nothing is registered before the check";
  Side s(km::cpu_ops());
  std::vector<std::int32_t> choice(kTokens, 0);
  const km::Routing routing = km::Routing::plan(choice, kTokens, 1, odd);
  expect_named("plan_exchange", [&] { xp::plan_exchange(g.ep(), s.ctx, routing, Host(kTokens, 1.0f), -1); });
  const km::Routing fine = km::Routing::plan(choice, kTokens, 1, kExperts);
  EXPECT_THROW(xp::plan_exchange(g.ep(), s.ctx, fine, Host(kTokens - 1, 1.0f), -1), std::invalid_argument)
      << "one weight per assignment";
  EXPECT_EQ(g.counting.calls_except({}), 0u) << "refusals communicate nothing";
}

// ---------------------------------------------------------------------------------------------
// speed: NCCL, one GPU per rank

namespace {
constexpr std::int64_t kPerfTokens = 8192, kPerfModel = 4096;
constexpr int kPerfTopK = 2, kPerfExpertsPerRank = 4;
}  // namespace

using ExpertParallelPerf = km::testing::GpuModelTest;  // NCCL, a GPU per rank, the GPU backend
TEST_F(ExpertParallelPerf, DispatchCombineBusBandwidth) {
  kd::Communicator& w = world();
  const int n = w.size();
  km::Ops& ops = gpu();
  Side s(ops);
  const std::int64_t N = kPerfTokens, d = kPerfModel;
  const int E = kPerfExpertsPerRank * n, k = kPerfTopK;
  // Uniform routing: k distinct experts per token, drawn from this rank's seed; weights 1/k.
  std::vector<std::int32_t> choice;
  const std::uint64_t seed = k2c::testing::seed_for("perf/routing/" + std::to_string(w.rank()));
  for (std::int64_t t = 0; t < N; ++t) {
    std::vector<bool> taken(E, false);
    for (int j = 0; j < k; ++j) {
      int e = static_cast<int>(k2c::uniform_at(seed, static_cast<std::uint64_t>(t * k + j), 0.0f, static_cast<float>(E)));
      while (taken[e]) e = (e + 1) % E;
      taken[e] = true;
      choice.push_back(e);
    }
  }
  const km::Routing routing = km::Routing::plan(choice, static_cast<int>(N), k, E);
  const xp::Plan p = xp::plan_exchange(w, s.ctx, routing, Host(choice.size(), 1.0f / k), -1);
  const Host x = random_host(N * d, "perf/x");
  km::Tensor xt = s.upload(x, {N, d}), in = s.tensor({p.expert_rows(), d}), returned = s.tensor({p.rows(), d}),
             y = s.tensor({N, d});

  // The library's all_to_all_v moving the same rows: this rank's rows for rank q are contiguous
  // in plan order (q's experts are consecutive), and what arrives is laid out by sender.
  const std::size_t dd = static_cast<std::size_t>(d);
  std::vector<std::size_t> sc(n, 0), so(n, 0), rc(n, 0), ro(n, 0);
  std::size_t at = 0;
  for (int q = 0; q < n; ++q) {
    so[q] = static_cast<std::size_t>(p.begin[q * kPerfExpertsPerRank]) * dd;
    ro[q] = at;
    if (q == w.rank()) continue;
    sc[q] = static_cast<std::size_t>(p.begin[(q + 1) * kPerfExpertsPerRank] - p.begin[q * kPerfExpertsPerRank]) * dd;
    for (int l = 0; l < kPerfExpertsPerRank; ++l) rc[q] += static_cast<std::size_t>(p.from[q * kPerfExpertsPerRank + l]) * dd;
    at += rc[q];
  }
  km::Tensor lib_in = s.tensor({p.expert_rows(), d});

  // Correctness of the timed work first: each expert multiplies its rows by a factor of its own,
  // 1 + its global index, between dispatch and combine, so that with weights 1/k combine(dispatch(x))
  // is x times the mean of the chosen experts' factors only if every row reached its expert and
  // came back from it (a combine that added rows kept at home would give x).
  ops.fill(y, 0.0f);
  xp::dispatch(w, s.ctx, p, xt, in);
  for (int l = 0; l < p.local_experts; ++l)
    if (p.offsets[l + 1] > p.offsets[l]) {
      km::Tensor rows = in.rows(p.offsets[l], p.offsets[l + 1] - p.offsets[l]);
      ops.scale(rows, 1.0f + static_cast<float>(w.rank() * p.local_experts + l));
    }
  xp::combine(w, s.ctx, p, in, returned, y);
  const Host back = s.download(y);
  std::mt19937_64 fresh(std::random_device{}());
  std::size_t wrong = 0;
  for (int i = 0; i < 4096; ++i) {
    const std::size_t e = fresh() % back.size();
    const std::size_t t = e / dd;
    double factor = 0;
    for (int j = 0; j < k; ++j) factor += (1.0 + choice[t * k + j]) / k;
    const double want = factor * x[e];
    wrong += !(std::abs(back[e] - want) <= 1e-6 * std::abs(want));
  }
  EXPECT_EQ(wrong, 0u) << "combine(dispatch(x)) with experts that scale their rows is not x times the mean factor";

  const kd::TimeStepOptions opt{.warmup = 3, .repeats = 10};
  const double t_ep = kd::time_step(w, [&] {
    xp::dispatch(w, s.ctx, p, xt, in);
    xp::combine(w, s.ctx, p, in, returned, y);
  }, opt).median_ms;
  const double t_lib = kd::time_step(w, [&] {
    w.all_to_all_v(returned.raw(), sc, so, lib_in.raw(), rc, ro, kd::DType::f32);
    w.all_to_all_v(lib_in.raw(), rc, ro, returned.raw(), sc, so, kd::DType::f32);
  }, opt).median_ms;

  // Bytes that cross a link, the busiest rank's: both sides move exactly these.
  long long link = 4LL * d * (p.rows_out() + p.rows_in()), busiest = 0;
  MPI_Allreduce(&link, &busiest, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  const double ep_gbs = static_cast<double>(busiest) / (t_ep * 1e6), lib_gbs = static_cast<double>(busiest) / (t_lib * 1e6);
  if (w.rank() == 0) {
    K2C_EXPECT_PERF(ep_gbs, lib_gbs,
                    "dispatch + combine of " + std::to_string(N) + " tokens x top " + std::to_string(k) + ", d " +
                        std::to_string(d) + ", " + std::to_string(E) + " experts on " + std::to_string(n) +
                        " GPUs: " + std::to_string(t_ep) + " ms, the library's all_to_all_v pair " +
                        std::to_string(t_lib) + " ms, " + std::to_string(busiest >> 20) + " MiB over the links");
  }
}
