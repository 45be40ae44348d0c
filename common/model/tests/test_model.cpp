// test_model.cpp — the model library's bookkeeping: the parameter list and its gradient-ready
// protocol, frozen and tied parameters, checkpointing, dropout masks of shards, the memory
// ledger, optimizers and the schedule, bit-for-bit determinism of the CPU backend, and
// activations stored in bf16.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/model/optim.h"
#include "k2c/model/timed_ops.h"
#include "k2c/model/transformer.h"

namespace k2c::model {
namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.vocab = 17, c.d_model = 16, c.n_layers = 3, c.q_heads = 4, c.kv_heads = 2, c.d_ff = 24, c.seq_len = 8;
  return c;
}

// Token ids and next-token targets for `batch` sequences, from a fixed little generator.
struct Batch {
  std::vector<std::int32_t> ids, targets;
};
Batch make_batch(const ModelConfig& c, int batch, std::uint32_t seed) {
  Batch b;
  std::uint32_t x = seed * 2654435761u + 1;
  std::vector<std::int32_t> stream(batch * c.seq_len + 1);
  for (auto& t : stream) t = static_cast<std::int32_t>((x = x * 1664525u + 1013904223u) >> 8) % c.vocab;
  for (int i = 0; i < batch * c.seq_len; ++i) {
    b.ids.push_back(stream[i]);
    b.targets.push_back(stream[i + 1]);
  }
  return b;
}

// A model on the CPU backend with its batch uploaded.
struct ModelRun {
  MemoryLedger ledger;
  ParamList params;
  Context ctx{cpu_ops(), ledger, params};
  ModelConfig config;
  Transformer model;
  Tensor ids, targets;
  int batch;
  ModelRun(const ModelConfig& c, int b, std::uint64_t seed = 1, bool freeze_norm = false,
           DType activations = DType::f32)
      : config(c), model(params, c), batch(b) {
    ctx.activations = activations;
    if (freeze_norm) params.freeze(find("final_norm.weight"));
    params.materialize(ctx.ops, ledger, seed);
    const Batch data = make_batch(c, b, 5);
    ids = ctx.tensor({b * c.seq_len}, Category::activations, DType::i32);
    targets = ctx.tensor({b * c.seq_len}, Category::activations, DType::i32);
    ctx.ops.upload(ids, data.ids.data());
    ctx.ops.upload(targets, data.targets.data());
  }
  ParamId find(const std::string& name) const {
    for (ParamId i = 0; i < params.size(); ++i)
      if (params.info(i).name == name) return i;
    throw std::runtime_error("no parameter " + name);
  }
  double step(bool checkpoint = false) {
    return model.train_step(ctx, ids, targets, batch, 1.0f / (batch * config.seq_len), checkpoint);
  }
  std::vector<float> grads() {
    Tensor& g = params.flat_grads();
    return {g.f32(), g.f32() + g.numel()};
  }
};

TEST(Params, LayoutFollowsRegistrationOrder) {
  ModelRun r(small_config(), 2);
  std::int64_t offset = 0;
  for (ParamId i = 0; i < r.params.size(); ++i) {
    EXPECT_EQ(r.params.info(i).offset, offset) << r.params.info(i).name;
    EXPECT_EQ(r.params.value(i).f32(), r.params.flat_values().f32() + offset);
    offset += r.params.info(i).shape.numel();
  }
  EXPECT_EQ(offset, r.params.numel());
  EXPECT_EQ(r.params.numel(), r.config.parameter_count());
  EXPECT_THROW(r.params.add("late", {4}, {}), std::logic_error);
}

TEST(Params, InitialValuesDependOnNameNotOrder) {
  // Two lists registering the same named parameter in different places start it identically.
  MemoryLedger ledger;
  ParamList a, b;
  const ParamId wa = a.add("w", {3, 5}, {Init::normal, 0.5f});
  b.add("other", {7}, {});
  const ParamId wb = b.add("w", {3, 5}, {Init::normal, 0.5f});
  a.materialize(cpu_ops(), ledger, 42);
  b.materialize(cpu_ops(), ledger, 42);
  EXPECT_EQ(std::memcmp(a.value(wa).raw(), b.value(wb).raw(), a.value(wa).bytes()), 0);
  ParamList c;
  const ParamId wc = c.add("w", {3, 5}, {Init::normal, 0.5f});
  c.materialize(cpu_ops(), ledger, 43);
  EXPECT_NE(std::memcmp(a.value(wa).raw(), c.value(wc).raw(), a.value(wa).bytes()), 0);
}

TEST(Params, GradientReadyFiresOncePerTrainableParameter) {
  for (bool tied : {false, true}) {
    ModelConfig c = small_config();
    c.tied_head = tied;
    ModelRun r(c, 2, 1, /*freeze_norm=*/true);
    std::map<ParamId, int> fired;
    std::vector<ParamId> order;
    r.params.on_grad_ready([&](ParamId id) {
      ++fired[id];
      order.push_back(id);
    });
    r.step();
    const ParamId frozen = r.find("final_norm.weight");
    EXPECT_EQ(fired.count(frozen), 0u) << "a frozen parameter has no gradient to report";
    EXPECT_THROW(r.params.grad(frozen), std::logic_error);
    for (ParamId id : r.params.trainable()) EXPECT_EQ(fired[id], 1) << r.params.info(id).name;
    // Backward runs from the head down, so the embedding (tied or not) is final last.
    EXPECT_EQ(order.back(), r.find("embed.weight"));
    if (!tied) EXPECT_EQ(order.front(), r.find("head.weight"));
    // A tied weight is not final after its first use: the head's use alone must not fire it.
    if (tied) EXPECT_EQ(r.params.info(r.find("embed.weight")).uses, 2);
  }
}

TEST(Params, ProtocolMisuseIsCaught) {
  MemoryLedger ledger;
  ParamList p;
  const ParamId w = p.add("w", {2}, {});
  p.materialize(cpu_ops(), ledger, 1);
  EXPECT_THROW(p.grad_done(w), std::logic_error);  // outside a backward
  p.begin_backward();
  EXPECT_THROW(p.end_backward(), std::logic_error);  // w never reported
  p.begin_backward();
  p.grad_done(w);
  EXPECT_THROW(p.grad_done(w), std::logic_error);  // twice
}

TEST(Model, CheckpointedBackwardIsBitIdenticalAndSmaller) {
  ModelRun plain(small_config(), 3), ckpt(small_config(), 3);
  plain.ledger.reset_peaks();
  ckpt.ledger.reset_peaks();
  const std::size_t before = plain.ledger.current(Category::activations);  // the batch itself
  const double l1 = plain.step(false), l2 = ckpt.step(true);
  EXPECT_EQ(l1, l2);
  const std::vector<float> a = plain.grads(), b = ckpt.grads();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  const std::size_t p = plain.ledger.peak(Category::activations), c = ckpt.ledger.peak(Category::activations);
  EXPECT_LT(c, p) << "checkpointing should keep fewer activation bytes at the peak";
  EXPECT_EQ(plain.ledger.current(Category::activations), before) << "activations leaked after the step";
  EXPECT_EQ(ckpt.ledger.current(Category::activations), before);
}

// Activations stored in bf16: the step keeps fewer activation bytes at its peak (every one of
// them counted in the ledger), leaks none, and its loss and gradients stay within bf16's rounding
// of the fp32 step (the gradients differ by about 0.3% of their norm here), but not at zero
// distance: something was rounded. A checkpointed bf16 step recomputes the same bits. The MoE
// configuration too, whose routed experts store their rows and activations in bf16 (their summed
// outputs stay fp32: 0.73 of the fp32 peak here, 0.86 when the experts kept fp32).
TEST(Model, Bf16ActivationsHalveTheirBytesWithinRounding) {
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    ModelConfig c = small_config();
    if (moe) c.experts = 4, c.top_k = 2, c.d_expert = 12, c.shared_experts = 1;
    ModelRun f32(c, 3), bf16(c, 3, 1, false, DType::bf16), again(c, 3, 1, false, DType::bf16);
    const std::size_t before = bf16.ledger.current(Category::activations);
    f32.ledger.reset_peaks();
    bf16.ledger.reset_peaks();
    const double a = f32.step(), b = bf16.step();
    EXPECT_EQ(again.step(true), b) << "checkpointed recomputation rounds at the same points";
    EXPECT_EQ(again.grads(), bf16.grads());
    EXPECT_LT(bf16.ledger.peak(Category::activations), 0.8 * f32.ledger.peak(Category::activations));
    EXPECT_EQ(bf16.ledger.current(Category::activations), before) << "activations leaked after the step";
    EXPECT_NEAR(a, b, 2e-3 * a);
    EXPECT_NE(a, b) << "bf16 activations that round nothing";
    const std::vector<float> ga = f32.grads(), gb = bf16.grads();
    double ss = 0, diff = 0;
    for (std::size_t i = 0; i < ga.size(); ++i) {
      ASSERT_TRUE(std::isfinite(gb[i])) << "gradient " << i;
      ss += static_cast<double>(ga[i]) * ga[i];
      diff += (static_cast<double>(ga[i]) - gb[i]) * (static_cast<double>(ga[i]) - gb[i]);
    }
    EXPECT_LT(std::sqrt(diff / ss), 2e-2) << "relative difference of the gradients";
    std::printf("%s: loss %.6f (fp32) %.6f (bf16), gradients differ by %.2e relative, activation peak %zu of %zu bytes\n",
                moe ? "moe" : "dense", a, b, std::sqrt(diff / ss), bf16.ledger.peak(Category::activations),
                f32.ledger.peak(Category::activations));
  }
}

TEST(Model, CpuBackendIsDeterministic) {
  ModelRun a(small_config(), 2), b(small_config(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(a.step(), b.step());
    EXPECT_EQ(a.grads(), b.grads());
  }
}

// TimedOps (a ForwardingOps) changes nothing of what it forwards: the same loss and gradients
// bit for bit, and every kind of operation a step runs is in its table.
TEST(Model, TimedStepIsTheSameStep) {
  ModelRun plain(small_config(), 2);
  ModelRun timed(small_config(), 2);
  int syncs = 0;
  TimedOps clock(cpu_ops(), [&] { ++syncs; });
  Context ctx{clock, timed.ledger, timed.params};
  const float scale = 1.0f / (2 * timed.config.seq_len);
  EXPECT_EQ(timed.model.train_step(ctx, timed.ids, timed.targets, 2, scale, false), plain.step());
  EXPECT_EQ(timed.grads(), plain.grads());
  for (const char* op : {"embedding", "rmsnorm", "matmul fwd (a bT)", "rope", "attention", "swiglu", "cross-entropy",
                         "linear backward (dW, dX)", "attention backward", "rmsnorm backward", "embedding backward"})
    EXPECT_GT(clock.entries().count(op) ? clock.entries().at(op).calls : 0, 0) << op;
  long calls = 0;
  for (const auto& [name, e] : clock.entries()) {
    calls += e.calls;
    // The host's part is the wall time up to the return, before the closing sync: within the whole.
    EXPECT_GE(e.host_seconds, 0.0) << name;
    EXPECT_LE(e.host_seconds, e.seconds) << name;
  }
  EXPECT_EQ(syncs, 2 * calls) << "one sync before and one after each operation";
  EXPECT_NE(clock.report().find("attention backward"), std::string::npos);
  EXPECT_NE(clock.report().find("host ms"), std::string::npos);
}

// In-step timing: each operation between two marks of its own, its time the marks' distance,
// the gaps between operations counted apart; off, it passes everything through untimed.
TEST(Model, TimedInStepReadsTheMarks) {
  struct FakeMarks final : QueueMarks {
    int marks = 0, resets = 0;
    int mark() override { return marks++; }
    double seconds(int from, int to) override { return 1e-3 * (to - from); }  // 1 ms a mark
    void reset() override { ++resets; }
  } fake;
  ModelRun plain(small_config(), 2);
  ModelRun timed(small_config(), 2);
  TimedOps clock(cpu_ops(), fake);
  clock.enable(false);
  EXPECT_TRUE(clock.report().find("total") != std::string::npos);
  Context ctx{clock, timed.ledger, timed.params};
  const float scale = 1.0f / (2 * timed.config.seq_len);
  EXPECT_EQ(timed.model.train_step(ctx, timed.ids, timed.targets, 2, scale, false), plain.step());
  EXPECT_EQ(fake.marks, 0) << "switched off, it marks nothing";
  EXPECT_TRUE(clock.entries().empty());
  clock.enable(true);
  timed.model.train_step(ctx, timed.ids, timed.targets, 2, scale, false);
  const std::string table = clock.report();  // asked first, it reads the marks itself
  long calls = 0;
  double seconds = 0;
  for (const auto& [name, e] : clock.entries()) calls += e.calls, seconds += e.seconds;
  ASSERT_GT(calls, 10);
  char total[32];
  std::snprintf(total, sizeof total, "%10.3f", 1.0 * calls);  // calls × 1 ms
  EXPECT_NE(table.find(std::string("total") + std::string(21, ' ') + " " + total), std::string::npos) << table;
  EXPECT_EQ(fake.marks, 2 * calls) << "a mark before and after each operation";
  EXPECT_DOUBLE_EQ(seconds, 1e-3 * calls) << "each operation's marks are neighbours";
  EXPECT_DOUBLE_EQ(clock.between_seconds(), 1e-3 * (calls - 1)) << "one mark's distance between operations";
  const auto& norm = clock.entries().at("rmsnorm");
  EXPECT_DOUBLE_EQ(norm.seconds, 1e-3 * norm.calls);
  clock.reset();
  EXPECT_TRUE(clock.entries().empty());
  EXPECT_EQ(clock.between_seconds(), 0.0);
  EXPECT_EQ(fake.resets, 1);
}

TEST(Model, GradientsAccumulateOverMicroBatches) {
  // Two calls on the same batch with grad_scale 1/2 each equal one call with scale 1.
  ModelRun once(small_config(), 2), twice(small_config(), 2);
  const float s = 1.0f / (2 * once.config.seq_len);
  once.model.train_step(once.ctx, once.ids, once.targets, 2, s);
  twice.model.train_step(twice.ctx, twice.ids, twice.targets, 2, s / 2);
  twice.model.train_step(twice.ctx, twice.ids, twice.targets, 2, s / 2);
  const auto a = once.grads(), b = twice.grads();
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-6f + 1e-5f * std::abs(a[i])) << i;
}

TEST(Dropout, ShardMasksAreSlicesOfTheWholeMask) {
  const std::int64_t R = 12, C = 10;
  DropoutKey whole{77, 3, 5};
  int dropped = 0;
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) dropped += dropout_scale(whole, 0.3f, r, c, C) == 0.0f;
  EXPECT_NEAR(dropped / double(R * C), 0.3, 0.12);
  // Row shards (data or sequence parallel) and column shards (tensor parallel).
  for (std::int64_t r0 : {0, 5})
    for (std::int64_t c0 : {0, 4}) {
      DropoutKey shard = whole;
      shard.row_offset = r0, shard.col_offset = c0, shard.full_cols = C;
      for (std::int64_t r = 0; r + r0 < R && r < 4; ++r)
        for (std::int64_t c = 0; c + c0 < C && c < 6; ++c)
          ASSERT_EQ(dropout_scale(shard, 0.3f, r, c, 6), dropout_scale(whole, 0.3f, r0 + r, c0 + c, C));
    }
  // Another step or layer draws another mask.
  DropoutKey next = whole;
  next.step = 4;
  int same = 0;
  for (std::int64_t i = 0; i < R * C; ++i)
    same += dropout_scale(next, 0.5f, i / C, i % C, C) == dropout_scale(whole, 0.5f, i / C, i % C, C);
  EXPECT_LT(same, R * C * 3 / 4);
  // The op applies the same mask, scaled by 1/(1 − p).
  MemoryLedger ledger;
  ParamList params;
  Context ctx{cpu_ops(), ledger, params};
  Tensor x = ctx.tensor({R, C}), y = ctx.tensor({R, C});
  ctx.ops.fill(x, 2.0f);
  ctx.ops.dropout(x, 0.3f, whole, y);
  for (std::int64_t i = 0; i < R * C; ++i)
    ASSERT_FLOAT_EQ(y.f32()[i], 2.0f * dropout_scale(whole, 0.3f, i / C, i % C, C));
  EXPECT_THROW(ctx.ops.dropout(x, 1.0f, whole, y), std::invalid_argument);
}

TEST(Ledger, TotalsEqualTheBytesAllocated) {
  MemoryLedger ledger;
  HostMemory host;
  {
    Tensor a(host, ledger, Category::activations, {3, 5});
    Tensor b(host, ledger, Category::comm, {7}, DType::bf16);
    EXPECT_EQ(ledger.current(Category::activations), 60u);
    EXPECT_EQ(ledger.current(Category::comm), 14u);
    Tensor moved = std::move(a);  // a move transfers the record, never counts it twice
    EXPECT_EQ(ledger.current_total(), 74u);
  }
  EXPECT_EQ(ledger.current_total(), 0u);
  EXPECT_EQ(ledger.peak(Category::activations), 60u);
  EXPECT_EQ(ledger.peak_total(), 74u);
  EXPECT_THROW(ledger.remove(Category::params, 1), std::logic_error);

  // A model's parameters, gradients and AdamW state are exactly 4, 4 and 8 bytes a parameter.
  ModelRun r(small_config(), 2);
  AdamW opt(r.params, r.ctx.ops, r.ledger);
  const std::size_t n = r.params.numel();
  EXPECT_EQ(r.ledger.current(Category::params), 4 * n);
  EXPECT_EQ(r.ledger.current(Category::grads), 4 * n);
  EXPECT_EQ(r.ledger.current(Category::optimizer), 8 * n);
  EXPECT_NE(r.ledger.report().find("optimizer"), std::string::npos);
}

TEST(Optim, AdamWFirstStepAgainstTheFormula) {
  MemoryLedger ledger;
  ParamList p;
  const ParamId w = p.add("w", {2, 2}, {Init::ones});
  const ParamId g = p.add("g", {2}, {Init::ones});
  p.materialize(cpu_ops(), ledger, 1);
  const float grads[] = {0.5f, -2.0f, 0.0f, 1e-3f, 3.0f, -1.0f};
  cpu_ops().upload(p.flat_grads(), grads);
  AdamW opt(p, cpu_ops(), ledger, {0.9f, 0.95f, 1e-8f, 0.1f});
  opt.step(0.01f);
  // Step 1: m̂ = g and v̂ = g², so the update is lr·(wd·p + g/(|g| + eps)) = lr·(wd + sign g).
  const float* v = p.flat_values().f32();
  EXPECT_NEAR(v[0], 1.0f - 0.01f * (0.1f + 1.0f), 1e-6f);
  EXPECT_NEAR(v[1], 1.0f - 0.01f * (0.1f - 1.0f), 1e-6f);
  EXPECT_NEAR(v[2], 1.0f - 0.01f * 0.1f, 1e-6f);  // zero gradient: decay only
  EXPECT_NEAR(v[4], 1.0f - 0.01f, 1e-6f);         // a gain (rank 1): no weight decay
  EXPECT_NEAR(v[5], 1.0f + 0.01f, 1e-6f);
  EXPECT_EQ(opt.steps(), 1);
}

TEST(Optim, ClippingAndSchedule) {
  MemoryLedger ledger;
  ParamList p;
  p.add("w", {4}, {Init::zeros});
  p.materialize(cpu_ops(), ledger, 1);
  const float grads[] = {3.0f, 0.0f, 4.0f, 0.0f};
  cpu_ops().upload(p.flat_grads(), grads);
  EXPECT_DOUBLE_EQ(global_grad_norm(p, cpu_ops()), 5.0);
  EXPECT_DOUBLE_EQ(clip_grad_norm(p, cpu_ops(), 1.0), 5.0);
  EXPECT_NEAR(global_grad_norm(p, cpu_ops()), 1.0, 1e-6);
  EXPECT_DOUBLE_EQ(clip_grad_norm(p, cpu_ops(), 2.0), global_grad_norm(p, cpu_ops()));  // below: untouched

  EXPECT_FLOAT_EQ(cosine_lr(0, 10, 100, 1.0f, 0.1f), 0.1f);  // warm-up from lr/warmup
  EXPECT_FLOAT_EQ(cosine_lr(9, 10, 100, 1.0f, 0.1f), 1.0f);
  EXPECT_FLOAT_EQ(cosine_lr(10, 10, 100, 1.0f, 0.1f), 1.0f);
  EXPECT_NEAR(cosine_lr(55, 10, 100, 1.0f, 0.1f), 0.55f, 1e-6f);  // halfway down
  EXPECT_FLOAT_EQ(cosine_lr(100, 10, 100, 1.0f, 0.1f), 0.1f);
  EXPECT_FLOAT_EQ(cosine_lr(500, 10, 100, 1.0f, 0.1f), 0.1f);
}

TEST(Optim, SgdWithMomentum) {
  MemoryLedger ledger;
  ParamList p;
  p.add("w", {2}, {Init::ones});
  p.materialize(cpu_ops(), ledger, 1);
  const float grads[] = {1.0f, -1.0f};
  Sgd opt(p, cpu_ops(), ledger, 0.5f);
  cpu_ops().upload(p.flat_grads(), grads);
  opt.step(0.1f);  // m = g
  opt.step(0.1f);  // m = 0.5 g + g
  EXPECT_NEAR(p.flat_values().f32()[0], 1.0f - 0.1f * (1.0f + 1.5f), 1e-6f);
  EXPECT_NEAR(p.flat_values().f32()[1], 1.0f + 0.1f * (1.0f + 1.5f), 1e-6f);
}

TEST(Model, LayersAreContiguousRangesAndReportTheirEvents) {
  for (bool tied : {false, true}) {
    ModelConfig c = small_config();
    c.tied_head = tied;
    ModelRun r(c, 2);
    const int layers = r.model.layer_count(), L = c.n_layers;
    ASSERT_EQ(layers, L + 3);
    // Layers own consecutive ids that tile the flat buffer in order; a tied head owns none.
    ParamId next = 0;
    for (int l = 0; l < layers; ++l) {
      const Transformer::LayerParams p = r.model.layer_params(l);
      EXPECT_EQ(p.first, next) << "layer " << l;
      EXPECT_EQ(p.last == p.first, tied && l == layers - 1) << "layer " << l;
      next = p.last;
      EXPECT_EQ(r.model.layer_uses(l), (tied && l == layers - 1 ? std::vector<int>{0, l} : std::vector<int>{l}));
    }
    EXPECT_EQ(next, r.params.size());
    EXPECT_THROW(r.model.layer_uses(layers), std::out_of_range);

    // Forward runs the layers up, backward down, each bracketed by its two events.
    std::vector<std::pair<int, LayerEvent>> seen;
    r.ctx.on_layer = [&](int l, LayerEvent e) { seen.emplace_back(l, e); };
    r.step();
    std::vector<std::pair<int, LayerEvent>> want;
    for (int l = 0; l < layers; ++l)
      want.insert(want.end(), {{l, LayerEvent::before_forward}, {l, LayerEvent::after_forward}});
    for (int l = layers; l-- > 0;)
      want.insert(want.end(), {{l, LayerEvent::before_backward}, {l, LayerEvent::after_backward}});
    EXPECT_EQ(seen, want);
  }
}

TEST(Model, ConfigRejectsBadShapes) {
  ModelConfig c = small_config();
  c.q_heads = 3;  // 16 / 3 is not whole
  ParamList p;
  EXPECT_THROW(Transformer(p, c), std::invalid_argument);
  c = small_config();
  c.kv_heads = 3;
  EXPECT_THROW(c.check(), std::invalid_argument);
  ModelRun r(small_config(), 2);
  Tensor wrong = r.ctx.tensor({5}, Category::activations, DType::i32);
  EXPECT_THROW(r.model.train_step(r.ctx, wrong, wrong, 2, 1.0f), std::invalid_argument);
  EXPECT_NEAR(ModelConfig::dense_135m().parameter_count() / 1e6, 135.0, 10.0);
}

}  // namespace
}  // namespace k2c::model
