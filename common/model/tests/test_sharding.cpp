// test_sharding.cpp — what the sharded modules build on: a parameter registered as a block of an
// unsharded weight starts from exactly that block's values (tensor parallelism), and optimizers
// that each own a range of the flat gradient buffer step the same bits as one optimizer over all
// of it (ZeRO), frozen parameters and ranges that cut through parameters included; a parameter
// list without flat buffers, whose views the caller binds, starts from the same values and
// steps the same bits (ZeRO-2 and 3).
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/model/optim.h"
#include "k2c/model/params.h"

namespace k2c::model {
namespace {

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// One parameter "w" with the given shape and init, materialized from `seed`; an unrelated
// parameter is registered first so that w's place in the flat buffer differs from index 0.
struct OneWeight {
  MemoryLedger ledger;
  ParamList params;
  ParamId w;
  OneWeight(Shape shape, Init init, std::uint64_t seed = 7) {
    params.add("before", {3}, {});
    w = params.add("w", shape, std::move(init));
    params.materialize(cpu_ops(), ledger, seed);
  }
  const float* data() { return params.value(w).f32(); }
};

TEST(ShardInit, ColumnAndRowShardsAreSlicesOfTheFullWeight) {
  const Init normal{Init::normal, 0.5f};
  OneWeight full({6, 10}, normal);

  // Columns 3..6 of every row: a block that is not contiguous in the full weight.
  OneWeight cols({6, 4}, {Init::normal, 0.5f, ShardOf{{6, 10}, {0, 3}}});
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 4; ++c)
      ASSERT_TRUE(same_bits(cols.data()[r * 4 + c], full.data()[r * 10 + 3 + c])) << "row " << r << " col " << c;

  // Rows 4..5: one contiguous stretch of the full weight.
  OneWeight rows({2, 10}, {Init::normal, 0.5f, ShardOf{{6, 10}, {4, 0}}});
  EXPECT_EQ(std::memcmp(rows.data(), full.data() + 4 * 10, 2 * 10 * sizeof(float)), 0);

  // A "shard" that is the whole weight at offset 0 is the unsharded weight.
  OneWeight whole({6, 10}, {Init::normal, 0.5f, ShardOf{{6, 10}, {0, 0}}});
  EXPECT_EQ(std::memcmp(whole.data(), full.data(), 60 * sizeof(float)), 0);

  // Without the shard description the block would start from the full weight's first elements.
  OneWeight unsharded({6, 4}, normal);
  EXPECT_NE(std::memcmp(unsharded.data(), cols.data(), 24 * sizeof(float)), 0);
}

TEST(ShardInit, ThreeDimensionalBlockOfStackedExperts) {
  // Experts 1..2 of 4, rows 0..2 of 3, columns 2..3 of 5: every dimension offset or cut.
  OneWeight full({4, 3, 5}, {Init::normal, 1.0f}, 11);
  OneWeight block({2, 3, 2}, {Init::normal, 1.0f, ShardOf{{4, 3, 5}, {1, 0, 2}}}, 11);
  for (int e = 0; e < 2; ++e)
    for (int r = 0; r < 3; ++r)
      for (int c = 0; c < 2; ++c)
        ASSERT_TRUE(same_bits(block.data()[(e * 3 + r) * 2 + c], full.data()[((1 + e) * 3 + r) * 5 + 2 + c]))
            << e << ", " << r << ", " << c;
}

TEST(ShardInit, ConstantInitsIgnoreTheShard) {
  OneWeight ones({2, 3}, {Init::ones, 0.02f, ShardOf{{4, 6}, {2, 3}}});
  for (int i = 0; i < 6; ++i) EXPECT_EQ(ones.data()[i], 1.0f);
}

TEST(ShardInit, BadShardsAreRejectedWhenAdded) {
  ParamList p;
  auto add = [&](Shape shape, ShardOf shard) { p.add("w", shape, {Init::normal, 0.02f, shard}); };
  // Not the same rank as the full shape.
  EXPECT_THROW(add({6, 4}, ShardOf{{60}, {0}}), std::invalid_argument);
  EXPECT_THROW(add({6}, ShardOf{{6, 10}, {0, 0}}), std::invalid_argument);
  // Past the end of a dimension, by one element.
  EXPECT_THROW(add({6, 4}, ShardOf{{6, 10}, {0, 7}}), std::invalid_argument);
  EXPECT_THROW(add({2, 10}, ShardOf{{6, 10}, {5, 0}}), std::invalid_argument);
  // Larger than the full weight, negative offsets, an offset past the rank.
  EXPECT_THROW(add({7, 10}, ShardOf{{6, 10}, {0, 0}}), std::invalid_argument);
  EXPECT_THROW(add({2, 4}, ShardOf{{6, 10}, {-1, 0}}), std::invalid_argument);
  EXPECT_THROW(add({2, 4}, ShardOf{{6, 10}, {0, 0, 1, 0}}), std::invalid_argument);
  // The message names the parameter and both shapes.
  try {
    add({6, 4}, ShardOf{{6, 10}, {0, 7}});
    FAIL() << "an overflowing shard was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'w'"), std::string::npos) << what;
    EXPECT_NE(what.find("[6, 10]"), std::string::npos) << what;
    EXPECT_NE(what.find("[6, 4]"), std::string::npos) << what;
  }
  // Rejected shards registered nothing; a shard that ends exactly at the edge is fine.
  EXPECT_EQ(p.size(), 0);
  EXPECT_NO_THROW(add({6, 4}, ShardOf{{6, 10}, {0, 6}}));
}

// ---- optimizers over ranges

// Parameters of mixed ranks (decayed and not) with a frozen one in the middle, so that gradient
// offsets and value offsets differ for everything after it. Gradient layout:
//   a [3, 4] at [0, 12)   g [5] at [12, 17)   (frozen [4, 2]: no slot)   b [2, 3, 2] at [17, 29)
//   c [7] at [29, 36)
struct Mixed {
  MemoryLedger ledger;
  ParamList params;
  ParamId frozen;
  Mixed() {
    params.add("a", {3, 4}, {Init::normal, 0.5f});
    params.add("g", {5}, {Init::normal, 0.5f});
    frozen = params.add("frozen", {4, 2}, {Init::normal, 0.5f}, /*frozen=*/true);
    params.add("b", {2, 3, 2}, {Init::normal, 0.5f});
    params.add("c", {7}, {Init::normal, 0.5f});
    params.materialize(cpu_ops(), ledger, 3);
  }
  std::vector<float> values() {
    const Tensor& v = params.flat_values();
    return {v.f32(), v.f32() + v.numel()};
  }
};

// The same random gradients for step s on every list.
std::vector<float> random_grads(std::int64_t n, int s) {
  std::mt19937 gen(1000 + s);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> g(static_cast<std::size_t>(n));
  for (float& x : g) x = dist(gen);
  return g;
}

float lr_at(int s) { return 0.01f * static_cast<float>(s + 1); }

using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

// Ranges that together cover [0, 36): boundaries inside a, g, b and c, one range inside g alone,
// an empty range; the second partition is three ranges and an empty one.
const std::vector<Ranges> kPartitions = {
    {{0, 7}, {7, 13}, {13, 16}, {16, 16}, {16, 31}, {31, 36}},
    {{0, 13}, {13, 16}, {16, 16}, {16, 36}},
};

// Step s of AdamW as it was before ranges and runs existed: one adamw_step per trainable
// parameter over its whole shaped views, its moments at its gradient offset in m and v.
void step_each_parameter(ParamList& params, Tensor& m, Tensor& v, const AdamWConfig& cfg, int s) {
  for (ParamId id : params.trainable()) {
    const ParamInfo& p = params.info(id);
    Tensor pm = Tensor::view(m.f32() + p.grad_offset, p.shape), pv = Tensor::view(v.f32() + p.grad_offset, p.shape);
    cpu_ops().adamw_step(params.value(id), params.grad(id), pm, pv, lr_at(s), cfg.beta1, cfg.beta2, cfg.eps,
                         p.shape.rank >= 2 ? cfg.weight_decay : 0.0f, s + 1);
  }
}

void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
}

TEST(ShardOptim, FullAdamWIsTheSameUpdateAsBefore) {
  // The update as it was before ranges existed: one adamw_step per trainable parameter over its
  // whole shaped views. The full-range optimizer must give the same bits.
  Mixed ref, full;
  MemoryLedger state_ledger;
  const AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  const std::int64_t n = ref.params.trainable_numel();
  HostMemory host;
  Tensor m(host, state_ledger, Category::optimizer, {n}), v(host, state_ledger, Category::optimizer, {n});
  cpu_ops().fill(m, 0.0f);
  cpu_ops().fill(v, 0.0f);
  AdamW opt(full.params, cpu_ops(), full.ledger, cfg);
  for (int s = 0; s < 5; ++s) {
    const std::vector<float> g = random_grads(n, s);
    cpu_ops().upload(ref.params.flat_grads(), g.data());
    cpu_ops().upload(full.params.flat_grads(), g.data());
    step_each_parameter(ref.params, m, v, cfg, s);
    opt.step(lr_at(s));
  }
  expect_bitwise(full.values(), ref.values(), "values");
  expect_bitwise({opt.first_moment().f32(), opt.first_moment().f32() + n}, {m.f32(), m.f32() + n}, "m");
  EXPECT_EQ(opt.begin(), 0);
  EXPECT_EQ(opt.end(), n);
}

TEST(ShardOptim, AdamWRangesMatchOneFullOptimizerBitForBit) {
  for (const Ranges& ranges : kPartitions) {
    Mixed ref, sharded;
    const std::int64_t n = ref.params.trainable_numel();
    ASSERT_EQ(n, 36);
    const std::vector<float> frozen_before = {sharded.params.value(sharded.frozen).f32(),
                                              sharded.params.value(sharded.frozen).f32() + 8};
    AdamW full(ref.params, cpu_ops(), ref.ledger);
    std::vector<MemoryLedger> ledgers(ranges.size());
    std::vector<AdamW> shards;
    for (std::size_t r = 0; r < ranges.size(); ++r)
      shards.emplace_back(sharded.params, cpu_ops(), ledgers[r], AdamWConfig{}, ranges[r].first, ranges[r].second);
    for (int s = 0; s < 5; ++s) {
      const std::vector<float> g = random_grads(n, s);
      cpu_ops().upload(ref.params.flat_grads(), g.data());
      cpu_ops().upload(sharded.params.flat_grads(), g.data());
      full.step(lr_at(s));
      for (AdamW& opt : shards) opt.step(lr_at(s));
    }
    expect_bitwise(sharded.values(), ref.values(), "values after 5 steps");
    // The ranges' moments laid end to end are the full optimizer's moments.
    std::vector<float> m, v;
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      AdamW& opt = shards[r];
      const std::int64_t count = ranges[r].second - ranges[r].first;
      EXPECT_EQ(opt.steps(), 5);
      EXPECT_EQ(ledgers[r].current(Category::optimizer), static_cast<std::size_t>(8 * count));
      EXPECT_EQ(opt.first_moment().numel(), count);
      if (count == 0) continue;
      m.insert(m.end(), opt.first_moment().f32(), opt.first_moment().f32() + count);
      v.insert(v.end(), opt.second_moment().f32(), opt.second_moment().f32() + count);
    }
    expect_bitwise(m, {full.first_moment().f32(), full.first_moment().f32() + n}, "first moment");
    expect_bitwise(v, {full.second_moment().f32(), full.second_moment().f32() + n}, "second moment");
    // The frozen parameter in the middle was never touched.
    expect_bitwise({sharded.params.value(sharded.frozen).f32(), sharded.params.value(sharded.frozen).f32() + 8},
                   frozen_before, "frozen parameter");
  }
}

// Parameters that AdamW steps as runs (neighbours in values, gradients and state with one weight
// decay: a and a2, b2 and b3) on both sides of a frozen one that no run may cross (a2 and b both
// decay, but b's values lie past the frozen parameter's). Gradient layout:
//   a [3, 4] at [0, 12)   a2 [2, 2] at [12, 16)   (frozen [4, 2])   b [2, 3] at [16, 22)
//   b2 [3] at [22, 25)   b3 [5] at [25, 30)   c [2, 2] at [30, 34)
// One adamw_step per parameter, the update before runs existed, gives the same bits as the full
// optimizer and as ranges that start and end inside runs, and the frozen values stay as they were.
TEST(ShardOptim, RunsOfParametersStepAsTheirParametersWould) {
  struct Runs {
    MemoryLedger ledger;
    ParamList params;
    ParamId frozen;
    Runs() {
      params.add("a", {3, 4}, {Init::normal, 0.5f});
      params.add("a2", {2, 2}, {Init::normal, 0.5f});
      frozen = params.add("frozen", {4, 2}, {Init::normal, 0.5f}, /*frozen=*/true);
      params.add("b", {2, 3}, {Init::normal, 0.5f});
      params.add("b2", {3}, {Init::normal, 0.5f});
      params.add("b3", {5}, {Init::normal, 0.5f});
      params.add("c", {2, 2}, {Init::normal, 0.5f});
      params.materialize(cpu_ops(), ledger, 5);
    }
    std::vector<float> values() {
      const Tensor& v = params.flat_values();
      return {v.f32(), v.f32() + v.numel()};
    }
  } ref, full, sharded;
  const AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  const std::int64_t n = ref.params.trainable_numel();
  ASSERT_EQ(n, 34);
  const std::vector<float> frozen_before = {sharded.params.value(sharded.frozen).f32(),
                                            sharded.params.value(sharded.frozen).f32() + 8};
  MemoryLedger state_ledger;
  HostMemory host;
  Tensor m(host, state_ledger, Category::optimizer, {n}), v(host, state_ledger, Category::optimizer, {n});
  cpu_ops().fill(m, 0.0f);
  cpu_ops().fill(v, 0.0f);
  AdamW whole(full.params, cpu_ops(), full.ledger, cfg);
  const Ranges ranges = {{0, 14}, {14, 23}, {23, 34}};  // cuts inside a2 and b2
  std::vector<MemoryLedger> ledgers(ranges.size());
  std::vector<AdamW> shards;
  for (std::size_t r = 0; r < ranges.size(); ++r)
    shards.emplace_back(sharded.params, cpu_ops(), ledgers[r], cfg, ranges[r].first, ranges[r].second);
  for (int s = 0; s < 5; ++s) {
    const std::vector<float> g = random_grads(n, s);
    for (Runs* list : {&ref, &full, &sharded}) cpu_ops().upload(list->params.flat_grads(), g.data());
    step_each_parameter(ref.params, m, v, cfg, s);
    whole.step(lr_at(s));
    for (AdamW& opt : shards) opt.step(lr_at(s));
  }
  expect_bitwise(full.values(), ref.values(), "values, the whole range");
  expect_bitwise(sharded.values(), ref.values(), "values, three ranges");
  expect_bitwise({whole.second_moment().f32(), whole.second_moment().f32() + n}, {v.f32(), v.f32() + n},
                 "second moment");
  expect_bitwise({sharded.params.value(sharded.frozen).f32(), sharded.params.value(sharded.frozen).f32() + 8},
                 frozen_before, "frozen parameter");
}

TEST(ShardOptim, ARangeStepsOnlyItsOwnElements) {
  // Range [10, 20) of the gradients: a[10..11], all of g, b[0..2]. In the value buffer b starts
  // after the frozen parameter, so b's pieces sit 8 elements later than their gradients.
  Mixed m;
  const std::vector<float> before = m.values();
  AdamW opt(m.params, cpu_ops(), m.ledger, {}, 10, 20);
  const std::vector<float> g(36, 1.0f);
  cpu_ops().upload(m.params.flat_grads(), g.data());
  opt.step(0.1f);
  const std::vector<float> after = m.values();
  for (std::size_t i = 0; i < after.size(); ++i) {
    // Value indices: a [0, 12), g [12, 17), frozen [17, 25), b [25, 37), c [37, 44).
    const bool stepped = (i >= 10 && i < 17) || (i >= 25 && i < 28);
    EXPECT_EQ(!same_bits(after[i], before[i]), stepped) << "value element " << i;
  }
}

TEST(ShardOptim, SgdRangesMatchOneFullOptimizer) {
  for (const Ranges& ranges : kPartitions) {
    Mixed ref, sharded;
    const std::int64_t n = ref.params.trainable_numel();
    Sgd full(ref.params, cpu_ops(), ref.ledger, 0.9f, 0.05f);
    std::vector<MemoryLedger> ledgers(ranges.size());
    std::vector<Sgd> shards;
    for (std::size_t r = 0; r < ranges.size(); ++r)
      shards.emplace_back(sharded.params, cpu_ops(), ledgers[r], 0.9f, 0.05f, ranges[r].first, ranges[r].second);
    for (int s = 0; s < 5; ++s) {
      const std::vector<float> g = random_grads(n, s);
      cpu_ops().upload(ref.params.flat_grads(), g.data());
      cpu_ops().upload(sharded.params.flat_grads(), g.data());
      full.step(lr_at(s));
      for (Sgd& opt : shards) opt.step(lr_at(s));
    }
    expect_bitwise(sharded.values(), ref.values(), "values after 5 steps");
    for (std::size_t r = 0; r < ranges.size(); ++r)
      EXPECT_EQ(ledgers[r].current(Category::optimizer),
                static_cast<std::size_t>(4 * (ranges[r].second - ranges[r].first)));
  }
}

TEST(ShardOptim, InvalidRangesAreRejected) {
  Mixed m;
  const std::int64_t n = m.params.trainable_numel();  // 36: the frozen parameter has no slot
  for (auto [b, e] : Ranges{{-1, 4}, {5, 4}, {0, n + 1}, {n + 1, n + 1}, {0, m.params.numel()}}) {
    EXPECT_THROW(AdamW(m.params, cpu_ops(), m.ledger, {}, b, e), std::invalid_argument) << b << ", " << e;
    EXPECT_THROW(Sgd(m.params, cpu_ops(), m.ledger, 0.9f, 0.0f, b, e), std::invalid_argument) << b << ", " << e;
  }
  EXPECT_EQ(m.ledger.current(Category::optimizer), 0u) << "a rejected range allocated state";
  EXPECT_NO_THROW(AdamW(m.params, cpu_ops(), m.ledger, {}, n, n));
  ParamList unmade;
  unmade.add("w", {4}, {});
  EXPECT_THROW(AdamW(unmade, cpu_ops(), m.ledger, {}, 0, 0), std::logic_error);
}

// ---- storage the caller manages (ZeRO-2 and 3)

// Mixed's parameters, laid out but with neither flat buffer: nothing in the ledger, every view
// unbound until the caller binds it.
struct Unbacked {
  MemoryLedger ledger;
  ParamList params;
  Unbacked() {
    params.add("a", {3, 4}, {Init::normal, 0.5f});
    params.add("g", {5}, {Init::normal, 0.5f});
    params.add("frozen", {4, 2}, {Init::normal, 0.5f}, /*frozen=*/true);
    params.add("b", {2, 3, 2}, {Init::normal, 0.5f});
    params.add("c", {7}, {Init::normal, 0.5f});
    params.materialize(cpu_ops(), ledger, 3, {.values = false, .grads = false});
  }
};

TEST(ShardStorage, InitialValuesOfAnyRangeMatchTheFlatBuffer) {
  Mixed flat;
  Unbacked own;
  EXPECT_EQ(own.ledger.current(Category::params) + own.ledger.current(Category::grads), 0u);
  EXPECT_TRUE(own.params.flat_values().empty());
  EXPECT_EQ(own.params.info(3).offset, flat.params.info(3).offset) << "the layout does not depend on storage";
  const std::vector<float> want = flat.values();
  for (auto [b, e] : Ranges{{0, 44}, {0, 0}, {5, 30}, {43, 44}}) {
    std::vector<float> got(static_cast<std::size_t>(e - b));
    own.params.initial_values(b, e, got.data());
    expect_bitwise(got, {want.begin() + b, want.begin() + e}, "range [" + std::to_string(b) + ", " + std::to_string(e) + ")");
  }
  std::vector<float> sink(1);
  EXPECT_THROW(own.params.initial_values(40, 45, sink.data()), std::invalid_argument);
}

TEST(ShardStorage, ViewsAreUsableOnlyWhileBound) {
  Unbacked own;
  EXPECT_THROW(own.params.value(0), std::logic_error);
  EXPECT_THROW(own.params.grad(0), std::logic_error);
  std::vector<float> v(12, 1.0f), g(12, 0.0f);
  own.params.bind_value(0, v.data());
  own.params.bind_grad(0, g.data());
  EXPECT_EQ(own.params.value(0).f32(), v.data());
  EXPECT_EQ(own.params.grad(0).shape(), (Shape{3, 4}));
  own.params.bind_value(0, nullptr);
  EXPECT_THROW(own.params.value(0), std::logic_error) << "an unbound view must not be read";
  EXPECT_THROW(own.params.bind_grad(2, g.data()), std::logic_error) << "a frozen parameter has no gradient";
  // Where the flat buffer exists, a second home for a parameter is refused.
  Mixed flat;
  EXPECT_THROW(flat.params.bind_value(0, v.data()), std::logic_error);
  EXPECT_THROW(flat.params.bind_grad(0, g.data()), std::logic_error);
}

TEST(ShardStorage, AdamWOnTheCallersCopiesMatchesTheFlatBuffers) {
  // Two ranges over gradient elements [0, 36), one cutting g and b; the own copies hold the
  // trainable values only, so b's values follow g's directly (the frozen parameter is skipped).
  Mixed ref;
  Unbacked own;
  const std::int64_t n = ref.params.trainable_numel();
  AdamW full(ref.params, cpu_ops(), ref.ledger);
  const Ranges ranges = {{0, 14}, {14, 36}};
  std::vector<AdamW> shards;
  std::vector<std::vector<float>> values, grads;
  for (auto [b, e] : ranges) {
    shards.emplace_back(own.params, cpu_ops(), own.ledger, AdamWConfig{}, b, e);
    std::vector<float> v(static_cast<std::size_t>(e - b));
    for (std::int64_t k = b; k < e; ++k) {
      const std::int64_t at = k < 17 ? k : k + 8;  // gradient element -> value element
      own.params.initial_values(at, at + 1, &v[static_cast<std::size_t>(k - b)]);
    }
    values.push_back(v);
    grads.emplace_back(v.size());
  }
  EXPECT_EQ(own.ledger.current(Category::optimizer), static_cast<std::size_t>(8 * n));
  for (int s = 0; s < 5; ++s) {
    const std::vector<float> g = random_grads(n, s);
    cpu_ops().upload(ref.params.flat_grads(), g.data());
    full.step(lr_at(s));
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      std::copy(g.begin() + ranges[r].first, g.begin() + ranges[r].second, grads[r].begin());
      Tensor v = Tensor::view(values[r].data(), {static_cast<std::int64_t>(values[r].size())});
      Tensor gr = Tensor::view(grads[r].data(), {static_cast<std::int64_t>(grads[r].size())});
      shards[r].step(lr_at(s), v, gr);
    }
  }
  std::vector<float> got = values[0], want;
  got.insert(got.end(), values[1].begin(), values[1].end());
  const std::vector<float> all = ref.values();
  want.insert(want.end(), all.begin(), all.begin() + 17);
  want.insert(want.end(), all.begin() + 25, all.end());
  expect_bitwise(got, want, "trainable values after 5 steps");
  std::vector<float> wrong(3);
  Tensor w = Tensor::view(wrong.data(), {3});
  EXPECT_THROW(shards[0].step(0.1f, w, w), std::invalid_argument);
}

}  // namespace
}  // namespace k2c::model
