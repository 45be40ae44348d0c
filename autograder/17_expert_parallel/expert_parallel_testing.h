// autograder/17_expert_parallel/expert_parallel_testing.h — what the tests of module 17 share: sizes,
// host data, the expert-parallel group with its traffic counters, routings made to order,
// comparisons with the single-process layer, the fixture, and one forward and backward of the
// layer against model::Moe (each side a Side of k2c/model/testing.h). Included by
// test_expert_parallel.cpp (plan, exchange, the layer) and test_expert_parallel_grid.cpp (traffic,
// the dp × ep grid, the speed test).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "expert_parallel.h"
#include "k2c/core/random.h"
#include "k2c/dist/counting.h"
#include "k2c/dist/grid.h"
#include "k2c/dist/testing.h"
#include "k2c/model/backend.h"
#include "k2c/model/dist_testing.h"
#include "k2c/model/moe.h"
#include "k2c/model/testing.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/testing.h"

namespace k2c::expert_parallel_testing {

namespace kd = k2c::dist;
namespace km = k2c::model;
namespace xp = k2c::expert_parallel;
using k2c::dist::testing::world;
using k2c::model::testing::Side;  // one side of a comparison: backend, ledger, parameters, context


// ---------------------------------------------------------------------------------------------
// sizes and host data

constexpr int kTokens = 24, kModel = 16, kExperts = 12, kWidth = 24;
constexpr std::uint64_t kWeightSeed = 17;

inline km::MoeConfig moe_config(int top_k, int shared, float balance) {
  km::MoeConfig c;
  c.d_model = kModel;
  c.experts = kExperts;
  c.top_k = top_k;
  c.d_expert = kWidth;
  c.shared_experts = shared;
  c.balance_coef = balance;
  return c;
}

// Host data (k2c/dist/testing.h): inputs from the run's seed, and the blocks a shard holds.
using kd::testing::Host;
using kd::testing::random_host;
using kd::testing::row_block;

// ---------------------------------------------------------------------------------------------
// comparisons (k2c/dist/testing.h)

using kd::testing::expect_bits;
using kd::testing::expect_close;
using kd::testing::same_on_all_ranks;

inline Host to_float(const std::vector<double>& v) { return Host(v.begin(), v.end()); }

// The groups, counted: ep over every rank (dp 1), and for the comparison a tp group over every
// rank. group() hands them out with empty counters (made once, kept: kd::testing::kept_groups).
struct Group {
  kd::CountingCommunicator counting{world(), "world"};
  kd::ProcessGrid grid{counting, {.ep = world().size()}};
  kd::ProcessGrid tp_grid{counting, {.tp = world().size()}};
  Group() { grid.group({kd::Axis::dp, kd::Axis::ep}); }  // the combined group: a split, made by all now
  kd::Communicator& ep() { return grid.group(kd::Axis::ep); }
  kd::Communicator& dense() { return grid.group({kd::Axis::dp, kd::Axis::ep}); }
  kd::Communicator& expert_dp() { return grid.group(kd::Axis::dp); }
  kd::Communicator& tp() { return tp_grid.group(kd::Axis::tp); }
  kd::Traffic count(const std::string& label, const std::string& op) const { return counting.count(label, op); }
};

inline Group& group() { return kd::testing::kept_groups<Group>(); }

// ---------------------------------------------------------------------------------------------
// routings made to order: every rank's choices, known to every rank

struct Choices {
  int ranks = 1, tokens = 0, top_k = 1;
  std::vector<std::vector<std::int32_t>> expert;  // [rank][t·k + j]
  std::vector<std::vector<float>> weight;         // [rank][t·k + j]
};

// Skewed choices: expert 0 takes about half of the first choices, the others are drawn with
// weights 1/(e + 1); `empty` experts are never chosen. Distinct experts per token, best first.
inline Choices skewed_choices(int ranks, int tokens, int top_k, const std::vector<int>& empty, const std::string& tag) {
  Choices c;
  c.ranks = ranks, c.tokens = tokens, c.top_k = top_k;
  for (int s = 0; s < ranks; ++s) {
    const std::uint64_t seed = k2c::testing::seed_for(tag + "/" + std::to_string(s));
    std::vector<std::int32_t> ex;
    std::vector<float> w;
    for (int t = 0; t < tokens; ++t) {
      std::vector<bool> taken(kExperts, false);
      for (int e : empty) taken[e] = true;
      for (int j = 0; j < top_k; ++j) {
        int pick = -1;
        const float u = k2c::uniform_at(seed, static_cast<std::uint64_t>(t * 8 + j), 0.0f, 1.0f);
        if (j == 0 && !taken[0] && u < 0.5f) {
          pick = 0;
        } else {
          double total = 0;
          for (int e = 0; e < kExperts; ++e) total += taken[e] ? 0.0 : 1.0 / (e + 1);
          double v = k2c::uniform_at(seed, static_cast<std::uint64_t>(t * 8 + j + 4), 0.0f, 1.0f) * total;
          for (int e = 0; e < kExperts && pick < 0; ++e) {
            if (taken[e]) continue;
            v -= 1.0 / (e + 1);
            if (v <= 0) pick = e;
          }
          for (int e = kExperts - 1; pick < 0; --e)  // rounding left v just above 0: the last free one
            if (!taken[e]) pick = e;
        }
        taken[pick] = true;
        ex.push_back(pick);
        w.push_back(k2c::uniform_at(seed, static_cast<std::uint64_t>(1000 + t * 8 + j), 0.25f, 1.0f));
      }
    }
    c.expert.push_back(ex);
    c.weight.push_back(w);
  }
  return c;
}

// Experts nobody chooses: expert 1 always, and at 2 ranks or more the last rank's L experts, so
// that one rank receives no row at all.
inline std::vector<int> empty_experts(int n) {
  std::vector<int> e{1};
  if (n >= 2)
    for (int x = kExperts - kExperts / n; x < kExperts; ++x) e.push_back(x);
  return e;
}

// What a rank keeps under capacity C: per expert, its (token, weight) in token order.
struct Kept {
  std::vector<std::vector<std::pair<std::int32_t, float>>> rows;  // [E]
  std::int64_t dropped = 0;
};
inline Kept kept_of(const Choices& c, int s, std::int64_t capacity) {
  Kept k;
  k.rows.resize(kExperts);
  for (int t = 0; t < c.tokens; ++t)
    for (int j = 0; j < c.top_k; ++j) {
      const int e = c.expert[s][t * c.top_k + j];
      if (capacity >= 0 && static_cast<std::int64_t>(k.rows[e].size()) >= capacity) {
        ++k.dropped;
        continue;
      }
      k.rows[e].push_back({t, c.weight[s][t * c.top_k + j]});
    }
  return k;
}

// Rows that cross a link for rank r: its rows for other ranks' experts, and other ranks' rows
// for its experts.
inline std::pair<std::int64_t, std::int64_t> link_rows(const Choices& c, int r, std::int64_t capacity) {
  const int L = kExperts / c.ranks;
  std::int64_t out = 0, in = 0;
  for (int s = 0; s < c.ranks; ++s) {
    const Kept k = kept_of(c, s, capacity);
    for (int e = 0; e < kExperts; ++e) {
      const int owner = e / L;
      if (s == r && owner != r) out += static_cast<std::int64_t>(k.rows[e].size());
      if (s != r && owner == r) in += static_cast<std::int64_t>(k.rows[e].size());
    }
  }
  return {out, in};
}

inline km::Routing routing_of(const Choices& c, int s) {
  return km::Routing::plan(c.expert[s], c.tokens, c.top_k, kExperts);
}

// Choices of rank s as the reference routed them: the reference's routing covers all n·N tokens.
inline Choices choices_from(const std::vector<std::int32_t>& expert, int top_k, int ranks, int tokens) {
  Choices c;
  c.ranks = ranks, c.tokens = tokens, c.top_k = top_k;
  const std::size_t per = static_cast<std::size_t>(tokens) * top_k;
  for (int s = 0; s < ranks; ++s) {
    c.expert.emplace_back(expert.begin() + s * per, expert.begin() + (s + 1) * per);
    c.weight.emplace_back(per, 1.0f);
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// inputs that route as told: a router whose row e is 3·(unit vector e), and spikes of 2, 1, 0.5
// on a token's chosen experts over noise in ±0.2

inline Host spiked_inputs(const Choices& c, const std::string& tag) {
  const std::int64_t T = static_cast<std::int64_t>(c.ranks) * c.tokens;
  Host x = random_host(T * kModel, tag, -0.2f, 0.2f);
  for (int s = 0; s < c.ranks; ++s)
    for (int t = 0; t < c.tokens; ++t)
      for (int j = 0; j < c.top_k; ++j)
        x[(static_cast<std::int64_t>(s) * c.tokens + t) * kModel + c.expert[s][t * c.top_k + j]] += 2.0f / (1 << j);
  return x;
}

inline void set_spike_router(Side& side, const std::string& name) {
  Host w(static_cast<std::size_t>(kExperts) * kModel, 0.0f);
  for (int e = 0; e < kExperts; ++e) w[static_cast<std::size_t>(e) * kModel + e] = 3.0f;
  side.ops().upload(side.params.value(side.find(name)), w.data());
}

// ---------------------------------------------------------------------------------------------
// parameters

// Each parameter of the expert-parallel side against the reference's of the same name: an
// expert shard [L, a, b] against rows [first·a·b, (first + L)·a·b) of the stacked weight. Values
// (a shard in the wrong place shows here) without `want_grads`, else gradients against them,
// within 1e-4·|w| + of_max·M. The loop follows the reference's parameters, the same on every
// rank, so that the collective check of the dense gradients runs on every rank alike, whatever
// the layer under test registered.
inline void expect_params_match(Side& par, Side& ref, const std::map<std::string, Host>* want_grads, double of_max = 1e-5) {
  EXPECT_EQ(par.params.size(), ref.params.size()) << "the parameters of model::Moe, no more, no fewer";
  for (km::ParamId rid = 0; rid < ref.params.size(); ++rid) {
    const std::string name = ref.params.info(rid).name, what = "parameter '" + name + "'";
    const bool expert = name.find(".experts.") != std::string::npos;
    const km::Shape full = ref.params.info(rid).shape;
    const km::ParamId id = par.find(name);
    std::string layout;  // what is wrong with the parameter's registration, if anything
    std::int64_t begin = 0, count = full.numel();
    if (id < 0) {
      layout = "not registered";
    } else if (const km::ParamInfo& p = par.params.info(id); expert) {
      if (!p.init.shard || !(p.init.shard->full == full) || p.shape.rank != 3 || p.shape[1] != full[1] ||
          p.shape[2] != full[2])
        layout = "not registered as a shard of whole experts of " + full.str() + " (Init::shard)";
      else
        begin = p.init.shard->offset[0] * full[1] * full[2], count = p.shape[0] * full[1] * full[2];
    } else if (!(p.shape == full) || p.init.shard) {
      layout = "is " + p.shape.str() + ", not the whole " + full.str();
    }
    Host got;
    if (!layout.empty()) {
      ADD_FAILURE() << what << ": " << layout;
    } else if (!want_grads) {
      const Host whole = ref.download(ref.params.value(rid));
      expect_bits(par.download(par.params.value(id)), Host(whole.begin() + begin, whole.begin() + begin + count),
                  what + " values");
    } else {
      got = par.download(par.params.grad(id));
      const Host& w = want_grads->at(name);
      expect_close(got, Host(w.begin() + begin, w.begin() + begin + count), what + " gradient", 1e-4, of_max);
    }
    if (want_grads && !expert) {
      EXPECT_TRUE(same_on_all_ranks(got)) << what << ": a dense gradient differs between ranks";
    }
  }
}

inline std::map<std::string, Host> grads_of(Side& ref) {
  std::map<std::string, Host> g;
  for (km::ParamId id = 0; id < ref.params.size(); ++id) g[ref.params.info(id).name] = ref.download(ref.params.grad(id));
  return g;
}

// ---------------------------------------------------------------------------------------------
// fixtures

class ExpertParallel : public kd::testing::CpuModelTest {};

// ---------------------------------------------------------------------------------------------
// the layer against model::Moe


struct LayerCase {
  km::MoeConfig config;
  bool spiked = false;     // routing made to order (skewed_choices with empty experts)
  std::string tag;
};

// Traffic and timing of one forward + backward, for the traffic test.
struct LayerRun {
  kd::TrafficTable forward, backward, reduce;
  Choices routed;                                    // every rank's choices, as the reference routed
  std::map<std::string, std::uint64_t> a2av_started_when_final;
};

// One forward and backward of model::Moe over all n·N tokens and of ExpertParallelMoe over this
// rank's N, compared; returns what the traffic test needs.
inline LayerRun run_against_moe(Group& g, const LayerCase& lc, int n, int r) {
  LayerRun run;
  const km::MoeConfig& cfg = lc.config;
  const std::int64_t T = static_cast<std::int64_t>(n) * kTokens;
  Side ref(km::cpu_ops()), par(km::cpu_ops());
  km::Moe whole(ref.params, "moe", cfg);
  xp::ExpertParallelMoe mine(g.ep(), par.params, "moe", cfg);
  EXPECT_EQ(mine.local_experts(), kExperts / n);
  EXPECT_EQ(mine.first_expert(), r * (kExperts / n));
  ref.materialize(kWeightSeed);
  par.materialize(kWeightSeed);
  expect_params_match(par, ref, nullptr);

  Host X;
  if (lc.spiked) {
    const Choices c = skewed_choices(n, kTokens, cfg.top_k, empty_experts(n), lc.tag + "/choices");
    X = spiked_inputs(c, lc.tag + "/x");
    set_spike_router(ref, "moe.router.weight");
    set_spike_router(par, "moe.router.weight");
  } else {
    X = random_host(T * kModel, lc.tag + "/x");
  }
  const Host dY = random_host(T * kModel, lc.tag + "/dy");
  ref.ctx.loss_scale = par.ctx.loss_scale = 1.0f / static_cast<float>(T);

  km::Tensor xr = ref.upload(X, {T, kModel}), yr = ref.tensor({T, kModel}), dyr = ref.upload(dY, {T, kModel}),
             dxr = ref.tensor({T, kModel});
  km::Tensor xm = par.upload(row_block(X, kModel, r * kTokens, kTokens), {kTokens, kModel}),
             ym = par.tensor({kTokens, kModel}), dym = par.upload(row_block(dY, kModel, r * kTokens, kTokens), {kTokens, kModel}),
             dxm = par.tensor({kTokens, kModel});
  km::Moe::Saved sr;
  xp::ExpertParallelMoe::Saved sm;
  g.counting.reset();
  whole.forward(ref.ctx, xr, yr, sr);
  mine.forward(par.ctx, xm, ym, sm);
  run.forward = g.counting.counts();
  std::vector<std::int32_t> chosen(static_cast<std::size_t>(sr.top_idx.numel()));
  ref.ops().download(chosen.data(), sr.top_idx);
  run.routed = choices_from(chosen, cfg.top_k, n, kTokens);

  const Host Y = ref.download(yr), y = par.download(ym);
  expect_close(y, row_block(Y, kModel, r * kTokens, kTokens), "y (this rank's tokens)");
  EXPECT_NEAR(sm.balance_loss, sr.balance_loss, 1e-5 * std::abs(sr.balance_loss) + 1e-12) << "the group's balance term";
  EXPECT_NEAR(par.ctx.aux_loss, sm.balance_loss, 1e-12) << "forward adds the balance term to ctx.aux_loss";
  EXPECT_TRUE(same_on_all_ranks(&sm.balance_loss, sizeof sm.balance_loss)) << "the balance term differs between ranks";
  EXPECT_EQ(sm.counts, sr.counts) << "the group's assignments per expert";
  EXPECT_EQ(sm.group_tokens, T);
  EXPECT_EQ(sm.dropped, 0);
  EXPECT_EQ(sm.group_dropped, 0);
  EXPECT_EQ(sm.plan.capacity, -1) << "capacity factor 0: nothing dropped";

  // Record, for each parameter, how many all_to_all_v of backward had been started when its
  // gradient became final.
  par.params.on_grad_ready([&](km::ParamId id) {
    run.a2av_started_when_final[par.params.info(id).name] = g.count("ep", "all_to_all_v").started;
  });
  g.counting.reset();
  ref.params.begin_backward();
  whole.backward(ref.ctx, xr, sr, dyr, dxr);
  ref.params.end_backward();
  par.params.begin_backward();
  mine.backward(par.ctx, xm, sm, dym, dxm);
  par.params.end_backward();
  run.backward = g.counting.counts();
  g.counting.reset();
  xp::reduce_gradients(g.dense(), g.expert_dp(), par.ctx, mine);
  run.reduce = g.counting.counts();

  expect_close(par.download(dxm), row_block(ref.download(dxr), kModel, r * kTokens, kTokens),
               "dx (this rank's tokens)");
  const std::map<std::string, Host> want = grads_of(ref);
  expect_params_match(par, ref, &want);
  return run;
}


}  // namespace k2c::expert_parallel_testing
