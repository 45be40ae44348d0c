// test_layers.cpp — every layer's backward against central finite differences of its forward.
//
// Each test draws inputs and a random output weighting r, takes L = Σ r·y (summed in double) as
// the loss, computes the analytic gradients with one backward of dy = r, and compares them with
// (L(x + ε) − L(x − ε)) / 2ε for every element of every input and parameter. Shapes are tiny and
// awkward (odd sizes, repeated ids, GQA, fully masked attention rows) so each test takes
// milliseconds.
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/core/bf16.h"
#include "k2c/model/layers.h"
#include "k2c/model/transformer.h"

namespace k2c::model {
namespace {

struct Var {
  std::string name;
  float* x;
  const float* grad;
  std::int64_t n;
};

// Compares each analytic gradient element with a central difference of `loss`; reports the first
// mismatches when `report`, and returns how many elements differ. Tolerance: fp32 forward passes
// make the difference accurate to about 1e-4 here.
//
// `branch`, when given, names the discrete choices the last loss() call made (a MoE's routing).
// An element whose ±ε steps change them sits on a seam where the loss is not differentiable: it is
// skipped and counted in *skipped, and callers bound how many may be.
int gradient_mismatches(const std::function<double()>& loss, const std::vector<Var>& vars, bool report,
                        double eps = 1e-2, const std::function<std::uint64_t()>& branch = {},
                        int* skipped = nullptr, double atol = 2e-3, double rtol = 2e-2) {
  int total = 0;
  std::uint64_t base = 0;
  if (branch) {
    loss();
    base = branch();
  }
  for (const Var& v : vars) {
    int bad = 0;
    for (std::int64_t i = 0; i < v.n; ++i) {
      const float keep = v.x[i];
      v.x[i] = keep + static_cast<float>(eps);
      const double up = loss();
      const bool up_same = !branch || branch() == base;
      v.x[i] = keep - static_cast<float>(eps);
      const double down = loss();
      const bool down_same = !branch || branch() == base;
      v.x[i] = keep;
      if (!up_same || !down_same) {
        if (skipped) ++*skipped;
        continue;
      }
      const double fd = (up - down) / (2 * eps), an = v.grad[i];
      // A NaN compares false with everything, so it is counted explicitly.
      if ((std::isnan(an) || std::abs(fd - an) > atol + rtol * std::abs(fd)) && ++bad <= 5 && report)
        ADD_FAILURE() << v.name << "[" << i << "]: analytic " << an << ", finite difference " << fd;
    }
    if (report) EXPECT_EQ(bad, 0) << v.name << ": " << bad << " of " << v.n << " elements differ";
    total += bad;
  }
  return total;
}

void expect_gradients(const std::function<double()>& loss, const std::vector<Var>& vars, double eps = 1e-2) {
  gradient_mismatches(loss, vars, true, eps);
}

// The same for a loss with discrete choices: at most a tenth of the elements may be skipped for
// sitting on a seam, so the check cannot pass by skipping.
void expect_gradients_off_seams(const std::function<double()>& loss, const std::vector<Var>& vars, double eps,
                                const std::function<std::uint64_t()>& branch) {
  int skipped = 0;
  std::int64_t n = 0;
  for (const Var& v : vars) n += v.n;
  gradient_mismatches(loss, vars, true, eps, branch, &skipped);
  EXPECT_LE(skipped, n / 10) << skipped << " of " << n << " elements changed the routing when stepped";
}

// The chosen experts of a MoE layer (an i32 tensor on the CPU backend), hashed.
std::uint64_t routing_signature(const Tensor& experts, std::uint64_t h = 1469598103934665603ull) {
  for (std::int64_t i = 0; i < experts.numel(); ++i) h = (h ^ static_cast<std::uint64_t>(experts.i32()[i])) * 1099511628211ull;
  return h;
}

std::mt19937& rng() {
  static std::mt19937 g;
  return g;
}

void randomize(Tensor& t, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng());
}

double weighted_sum(const Tensor& y, const Tensor& r) {
  double s = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) s += static_cast<double>(y.f32()[i]) * r.f32()[i];
  return s;
}

// A context over fresh parameters on the CPU backend.
struct Rig {
  // Each test draws from the same fresh stream, so it checks the same numbers whether it runs
  // alone or after others.
  Rig() { rng().seed(1234 + seed_offset()); }
  static unsigned seed_offset() {
    const char* s = std::getenv("K2C_FD_SEED");  // to try a test over other draws by hand
    return s ? static_cast<unsigned>(std::atoi(s)) : 0u;
  }
  MemoryLedger ledger;
  ParamList params;
  Context ctx{cpu_ops(), ledger, params};
  Tensor make(Shape s, float scale = 1.0f) {
    Tensor t = ctx.tensor(s);
    randomize(t, scale);
    return t;
  }
  // Gives every parameter random values (gains near 1), so no gradient is trivially zero.
  void randomize_params(float scale = 0.5f) {
    for (ParamId id = 0; id < params.size(); ++id) {
      randomize(params.value(id), scale);
      if (params.info(id).init.kind == Init::ones)
        for (std::int64_t i = 0; i < params.value(id).numel(); ++i) params.value(id).f32()[i] += 1.0f;
    }
  }
  std::vector<Var> param_vars() {
    std::vector<Var> v;
    for (ParamId id : params.trainable())
      v.push_back({params.info(id).name, params.value(id).f32(), params.grad(id).f32(), params.value(id).numel()});
    return v;
  }
};

// The check itself must be able to fail: a gradient 10% off is caught.
TEST(Layers, FiniteDifferenceCheckCatchesAWrongGradient) {
  std::vector<float> x = {0.3f, -1.2f, 2.0f};
  auto loss = [&] { return 0.5 * (x[0] * x[0] + x[1] * x[1] + x[2] * x[2]); };
  std::vector<float> wrong = {0.33f, -1.32f, 2.2f}, right = {0.3f, -1.2f, 2.0f};
  EXPECT_EQ(gradient_mismatches(loss, {{"x", x.data(), wrong.data(), 3}}, false), 3);
  EXPECT_EQ(gradient_mismatches(loss, {{"x", x.data(), right.data(), 3}}, false), 0);
  std::vector<float> nan = {0.3f, NAN, 2.0f};
  EXPECT_EQ(gradient_mismatches(loss, {{"x", x.data(), nan.data(), 3}}, false), 1);
}

TEST(Layers, LinearAllThreeLayouts) {
  Rig s;
  Linear lin(s.params, "lin", 7, 3);
  s.params.materialize(s.ctx.ops, s.ledger, 1);
  s.randomize_params();
  Tensor x = s.make({5, 7}), r = s.make({5, 3}), y = s.ctx.tensor({5, 3}), dx = s.ctx.tensor({5, 7});
  auto loss = [&] {
    lin.forward(s.ctx, x, y);
    return weighted_sum(y, r);
  };
  loss();
  s.params.begin_backward();
  lin.backward(s.ctx, x, r, &dx);
  s.params.end_backward();
  auto vars = s.param_vars();
  vars.push_back({"x", x.f32(), dx.f32(), x.numel()});
  expect_gradients(loss, vars);
}

TEST(Layers, EmbeddingWithRepeatedIds) {
  Rig s;
  Embedding emb(s.params, "emb", 6, 4);
  s.params.materialize(s.ctx.ops, s.ledger, 2);
  Tensor ids = s.ctx.tensor({7}, Category::activations, DType::i32);
  const std::int32_t id_values[] = {3, 0, 3, 5, 3, 1, 0};
  s.ctx.ops.upload(ids, id_values);
  Tensor r = s.make({7, 4}), y = s.ctx.tensor({7, 4});
  auto loss = [&] {
    emb.forward(s.ctx, ids, y);
    return weighted_sum(y, r);
  };
  loss();
  s.params.begin_backward();
  emb.backward(s.ctx, ids, r);
  s.params.end_backward();
  expect_gradients(loss, s.param_vars());
  // Row 2 and 4 were never looked up: their gradient is exactly zero.
  for (int j = 0; j < 4; ++j) EXPECT_EQ(s.params.grad(emb.weight()).f32()[2 * 4 + j], 0.0f);

  const std::int32_t outside[] = {0, 6, 1, 1, 1, 1, 1};
  s.ctx.ops.upload(ids, outside);
  EXPECT_THROW(emb.forward(s.ctx, ids, y), std::out_of_range);
}

TEST(Layers, RmsNorm) {
  Rig s;
  RmsNorm norm(s.params, "norm", 6);
  s.params.materialize(s.ctx.ops, s.ledger, 3);
  s.randomize_params(0.3f);
  Tensor x = s.make({4, 6}), r = s.make({4, 6}), y = s.ctx.tensor({4, 6}), dx = s.ctx.tensor({4, 6});
  RmsNorm::Saved saved;
  auto loss = [&] {
    norm.forward(s.ctx, x, y, saved);
    return weighted_sum(y, r);
  };
  loss();
  s.params.begin_backward();
  norm.backward(s.ctx, x, saved, r, dx);
  s.params.end_backward();
  auto vars = s.param_vars();
  vars.push_back({"x", x.f32(), dx.f32(), x.numel()});
  expect_gradients(loss, vars);
}

TEST(Layers, AttentionWithGqaAndRope) {
  Rig s;
  const int batch = 2, T = 5;
  Attention attn(s.params, "attn", {8, 4, 2, 100.0f});  // head_dim 2, two queries per kv head
  s.params.materialize(s.ctx.ops, s.ledger, 4);
  s.randomize_params(0.6f);
  Tensor positions = s.ctx.tensor({T}, Category::activations, DType::i32);
  const std::int32_t pos[] = {0, 1, 2, 3, 4};
  s.ctx.ops.upload(positions, pos);
  Tensor x = s.make({batch * T, 8}), r = s.make({batch * T, 8}), y = s.ctx.tensor({batch * T, 8}),
         dx = s.ctx.tensor({batch * T, 8});
  Attention::Saved saved;
  auto loss = [&] {
    attn.forward(s.ctx, x, positions, batch, y, saved);
    return weighted_sum(y, r);
  };
  loss();
  s.params.begin_backward();
  attn.backward(s.ctx, x, positions, batch, saved, r, dx);
  s.params.end_backward();
  auto vars = s.param_vars();
  vars.push_back({"x", x.f32(), dx.f32(), x.numel()});
  expect_gradients(loss, vars);
}

// The attention op alone, with chunk offsets (ring attention's case): queries 3..6 against keys
// 5..9, causal, so the first query chunk rows see no key at all.
TEST(Layers, AttentionOpWithOffsetsAndMaskedRows) {
  Rig s;
  AttentionShape a;
  a.batch = 1, a.q_len = 4, a.kv_len = 5, a.q_heads = 2, a.kv_heads = 1, a.head_dim = 4;
  a.causal = true, a.q_offset = 3, a.kv_offset = 5;
  Tensor q = s.make({4, 8}), k = s.make({5, 4}), v = s.make({5, 4}), o = s.ctx.tensor({4, 8}),
         lse = s.ctx.tensor({1, 2, 4}), r = s.make({4, 8});
  Tensor dq = s.ctx.tensor({4, 8}), dk = s.ctx.tensor({5, 4}), dv = s.ctx.tensor({5, 4});
  auto loss = [&] {
    s.ctx.ops.attention_forward(a, q, k, v, o, lse);
    return weighted_sum(o, r);
  };
  loss();
  // Queries at positions 3 and 4 see no key (keys start at 5): output 0, lse −inf.
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(lse.f32()[h * 4 + 0], -INFINITY);
    EXPECT_EQ(lse.f32()[h * 4 + 1], -INFINITY);
    EXPECT_EQ(o.f32()[0 * 8 + h * 4], 0.0f);
  }
  s.ctx.ops.fill(dk, 0.0f);
  s.ctx.ops.fill(dv, 0.0f);
  s.ctx.ops.attention_backward(a, q, k, v, o, lse, r, dq, dk, dv);
  expect_gradients(loss, {{"q", q.f32(), dq.f32(), q.numel()},
                          {"k", k.f32(), dk.f32(), k.numel()},
                          {"v", v.f32(), dv.f32(), v.numel()}});
  // Written instead of added into: the same gradients over NaN; with no queries, zeros.
  Tensor dk_written = s.ctx.tensor({5, 4}), dv_written = s.ctx.tensor({5, 4});
  s.ctx.ops.fill(dk_written, NAN);
  s.ctx.ops.fill(dv_written, NAN);
  s.ctx.ops.attention_backward_overwrite(a, q, k, v, o, lse, r, dq, dk_written, dv_written);
  for (std::int64_t i = 0; i < dk.numel(); ++i) {
    EXPECT_EQ(dk_written.f32()[i], dk.f32()[i]) << i;
    EXPECT_EQ(dv_written.f32()[i], dv.f32()[i]) << i;
  }
  AttentionShape none = a;
  none.q_len = 0;
  Tensor no_q = s.ctx.tensor({0, 8}), no_lse = s.ctx.tensor({1, 2, 0});
  s.ctx.ops.fill(dk_written, NAN);
  s.ctx.ops.fill(dv_written, NAN);
  s.ctx.ops.attention_backward_overwrite(none, no_q, k, v, no_q, no_lse, no_q, no_q, dk_written, dv_written);
  for (std::int64_t i = 0; i < dk.numel(); ++i) EXPECT_EQ(dk_written.f32()[i], 0.0f) << i;
  for (std::int64_t i = 0; i < dv.numel(); ++i) EXPECT_EQ(dv_written.f32()[i], 0.0f) << i;
  a.head_dim = 0;
  EXPECT_THROW(s.ctx.ops.attention_forward(a, q, k, v, o, lse), std::invalid_argument);
}

TEST(Layers, SwigluMlp) {
  Rig s;
  Mlp mlp(s.params, "mlp", 6, 5);
  s.params.materialize(s.ctx.ops, s.ledger, 5);
  s.randomize_params(0.6f);
  Tensor x = s.make({3, 6}), r = s.make({3, 6}), y = s.ctx.tensor({3, 6}), dx = s.ctx.tensor({3, 6});
  Mlp::Saved saved;
  auto loss = [&] {
    mlp.forward(s.ctx, x, y, saved);
    return weighted_sum(y, r);
  };
  loss();
  s.params.begin_backward();
  mlp.backward(s.ctx, x, saved, r, dx);
  s.params.end_backward();
  auto vars = s.param_vars();
  vars.push_back({"x", x.f32(), dx.f32(), x.numel()});
  expect_gradients(loss, vars);
}

// A small dense block (d 8, two query heads over one kv head, d_ff 6) with random parameters,
// over 2 sequences of 3 tokens at positions 0, 1, 2.
struct SmallBlock {
  static constexpr int batch = 2, T = 3;
  static BlockConfig config() {
    BlockConfig bc;
    bc.attention = {8, 2, 1, 10000.0f};
    bc.d_ff = 6;
    return bc;
  }
  explicit SmallBlock(Rig& s) : block(s.params, "block", config(), 0) {
    s.params.materialize(s.ctx.ops, s.ledger, 6);
    s.randomize_params(0.4f);
    positions = s.ctx.tensor({T}, Category::activations, DType::i32);
    const std::int32_t pos[] = {0, 1, 2};
    s.ctx.ops.upload(positions, pos);
  }
  Block block;
  Tensor positions;
};

TEST(Layers, BlockWithDropout) {
  Rig s;
  s.ctx.dropout = 0.2f;  // the mask is a fixed function of the key, so the loss stays smooth
  s.ctx.seed = 9;
  SmallBlock b(s);
  const int batch = SmallBlock::batch, T = SmallBlock::T;
  const Block& block = b.block;
  const Tensor& positions = b.positions;
  Tensor x = s.make({batch * T, 8}), r = s.make({batch * T, 8}), dx = s.ctx.tensor({batch * T, 8});
  Block::Saved saved;
  auto loss = [&] {
    block.forward(s.ctx, x, positions, batch, false, saved);
    return weighted_sum(saved.out, r);
  };
  loss();
  s.params.begin_backward();
  block.backward(s.ctx, x, positions, batch, saved, r, dx);
  s.params.end_backward();
  auto vars = s.param_vars();
  vars.push_back({"x", x.f32(), dx.f32(), x.numel()});
  expect_gradients(loss, vars, 3e-3);
}

// With bf16 activations the branches' outputs are bf16 (they only feed the residual add), and
// h = x + attn_out holds exactly the fp32 sum of x and the widened bf16 output; with dropout,
// which takes fp32, they stay fp32. The residual stream is fp32 either way.
TEST(Layers, BlockBranchOutputsInTheActivationDtype) {
  for (const float dropout : {0.0f, 0.2f}) {
    SCOPED_TRACE("dropout " + std::to_string(dropout));
    Rig s;
    s.ctx.activations = DType::bf16;
    s.ctx.dropout = dropout;
    SmallBlock b(s);
    Tensor x = s.make({SmallBlock::batch * SmallBlock::T, 8});
    Block::Saved saved;
    b.block.forward(s.ctx, x, b.positions, SmallBlock::batch, false, saved);
    const Block::Internals& in = *saved.internals;
    const DType branch = dropout > 0 ? DType::f32 : DType::bf16;
    EXPECT_EQ(in.attn_out.dtype(), branch);
    EXPECT_EQ(in.mlp_out.dtype(), branch);
    EXPECT_EQ(in.h.dtype(), DType::f32);
    EXPECT_EQ(saved.out.dtype(), DType::f32);
    if (dropout > 0) continue;
    const auto* a16 = static_cast<const std::uint16_t*>(in.attn_out.raw());
    for (std::int64_t i = 0; i < x.numel(); ++i)
      ASSERT_EQ(in.h.f32()[i], x.f32()[i] + bf16_to_float(a16[i])) << "element " << i;
  }
}

TEST(Layers, CrossEntropyWithIgnoredTargets) {
  Rig s;
  Tensor z = s.make({4, 5}, 2.0f), dz = s.ctx.tensor({4, 5});
  Tensor t = s.ctx.tensor({4}, Category::activations, DType::i32);
  const std::int32_t targets[] = {2, -1, 4, 0};
  s.ctx.ops.upload(t, targets);
  const float scale = 0.25f;
  auto loss = [&] { return scale * s.ctx.ops.cross_entropy(z, t, 0.0f, dz); };
  s.ctx.ops.cross_entropy(z, t, scale, dz);
  std::vector<float> grad(dz.f32(), dz.f32() + 20);
  expect_gradients(loss, {{"logits", z.f32(), grad.data(), 20}});
  for (int j = 0; j < 5; ++j) EXPECT_EQ(grad[5 + j], 0.0f);  // the ignored row
  const std::int32_t outside[] = {2, 5, 0, 0};
  s.ctx.ops.upload(t, outside);
  EXPECT_THROW(s.ctx.ops.cross_entropy(z, t, 1.0f, dz), std::out_of_range);
}

// The whole model against finite differences, head tied to the embedding (the tied gradient is
// the sum of both uses) and untied.
void check_transformer(bool tied) {
  Rig s;
  ModelConfig c;
  c.vocab = 11, c.d_model = 8, c.n_layers = 2, c.q_heads = 2, c.kv_heads = 1, c.d_ff = 6, c.seq_len = 4;
  c.tied_head = tied;
  Transformer model(s.params, c);
  s.params.materialize(s.ctx.ops, s.ledger, 7);
  s.randomize_params(0.4f);
  // Embedding rows of order 1, as RMSNorm sees them in a trained model: small rows would put the
  // norm's 1/rms where a finite step bends it.
  randomize(s.params.value(0), 1.0f);
  const int batch = 2;
  Tensor ids = s.ctx.tensor({batch * c.seq_len}, Category::activations, DType::i32);
  Tensor targets = s.ctx.tensor({batch * c.seq_len}, Category::activations, DType::i32);
  const std::int32_t id_values[] = {1, 5, 10, 5, 0, 3, 3, 7}, target_values[] = {5, 10, 5, 0, 3, 3, 7, -1};
  s.ctx.ops.upload(ids, id_values);
  s.ctx.ops.upload(targets, target_values);
  model.train_step(s.ctx, ids, targets, batch, 1.0f);
  auto loss = [&] { return model.evaluate(s.ctx, ids, targets, batch); };
  // A smaller step than the layers' keeps the truncation error of a whole model's central
  // differences (it grows with ε² times the curvature) under the tolerance.
  expect_gradients(loss, s.param_vars(), 3e-3);
}

TEST(Layers, TransformerUntiedHead) { check_transformer(false); }
TEST(Layers, TransformerTiedHead) { check_transformer(true); }

TEST(Layers, RopeInverseAndRelativePositions) {
  Rig s;
  const int heads = 2, hd = 6, T = 5;
  Tensor positions = s.ctx.tensor({T}, Category::activations, DType::i32);
  const std::int32_t pos[] = {0, 3, 7, 100, 2048};
  s.ctx.ops.upload(positions, pos);
  Tensor x = s.make({2 * T, heads * hd}), y = s.ctx.tensor({2 * T, heads * hd});
  s.ctx.ops.copy(y, x);
  s.ctx.ops.rope(y, positions, heads, hd, 10000.0f, false);
  s.ctx.ops.rope(y, positions, heads, hd, 10000.0f, true);
  for (std::int64_t i = 0; i < x.numel(); ++i) EXPECT_NEAR(y.f32()[i], x.f32()[i], 1e-5f);
  // A rotation by position keeps norms, and q·k depends on positions only through their
  // difference: the same two vectors at (3, 7) and at (100, 104) give the same dot product.
  Tensor q = s.make({1, hd}), k = s.make({1, hd});
  auto rotated_dot = [&](int pq, int pk) {
    Tensor a = s.ctx.tensor({1, hd}), b = s.ctx.tensor({1, hd}), p = s.ctx.tensor({1}, Category::activations, DType::i32);
    s.ctx.ops.copy(a, q);
    s.ctx.ops.copy(b, k);
    s.ctx.ops.upload(p, &pq);
    s.ctx.ops.rope(a, p, 1, hd, 10000.0f, false);
    s.ctx.ops.upload(p, &pk);
    s.ctx.ops.rope(b, p, 1, hd, 10000.0f, false);
    double d = 0;
    for (int i = 0; i < hd; ++i) d += a.f32()[i] * b.f32()[i];
    return d;
  };
  EXPECT_NEAR(rotated_dot(3, 7), rotated_dot(100, 104), 1e-4);
  EXPECT_THROW(s.ctx.ops.rope(x, positions, heads, 5, 10000.0f, false), std::invalid_argument);
}

}  // namespace
}  // namespace k2c::model

namespace k2c::model {
namespace {

// 4 experts of width 5 over d 6, top 2, one shared expert, balance coefficient 0.5, its
// parameters random and a large router: it spreads the scores, so the small steps of finite
// differences never change which experts a token goes to.
Moe small_moe(Rig& s, bool normalize) {
  Moe moe(s.params, "moe", MoeConfig{6, 4, 2, 5, 1, normalize, 0.5f});
  s.params.materialize(s.ctx.ops, s.ledger, 8);
  s.randomize_params(0.6f);
  randomize(s.params.value(0), 3.0f);  // the router
  return moe;
}

// The mixture of experts (small_moe), the balance term included in the loss (weighted 1 here:
// loss_scale · N = 1).
TEST(Layers, MixtureOfExpertsWithSharedExpertAndBalanceLoss) {
  for (bool normalize : {true, false}) {
    Rig s;
    const Moe moe = small_moe(s, normalize);
    const int N = 7;
    s.ctx.loss_scale = 1.0f / N;
    Tensor x = s.make({N, 6}), r = s.make({N, 6}), y = s.ctx.tensor({N, 6}), dx = s.ctx.tensor({N, 6});
    Moe::Saved saved;
    auto loss = [&] {
      moe.forward(s.ctx, x, y, saved);
      return weighted_sum(y, r) + saved.balance_loss;
    };
    loss();
    // Every assignment appears once in the plan, grouped by expert, with its weight.
    const std::vector<std::int64_t>& offsets = saved.offsets;
    EXPECT_EQ(offsets.back(), N * 2);
    for (int a = 0; a < N * 2; ++a) {
      const int e = saved.top_idx.i32()[a], row = saved.row_of.i32()[a];
      EXPECT_TRUE(row >= offsets[e] && row < offsets[e + 1]);
      EXPECT_EQ(saved.token_of_row.i32()[row], a / 2);
      const float* v = saved.top_val.f32() + a / 2 * 2;
      EXPECT_EQ(saved.weight_of_row.f32()[row], normalize ? v[a % 2] / (v[0] + v[1]) : v[a % 2]);
    }
    s.params.begin_backward();
    moe.backward(s.ctx, x, saved, r, dx);
    s.params.end_backward();
    auto vars = s.param_vars();
    vars.push_back({"x", x.f32(), dx.f32(), x.numel()});
    expect_gradients_off_seams(loss, vars, 3e-3, [&] { return routing_signature(saved.top_idx); });
  }
}

// With bf16 activations the experts store their rows and activations in bf16 and their outputs
// in fp32. Rows gathered by the layer come rounded; fp32 rows (as an expert-parallel exchange
// hands them over) are rounded where the experts start, to the same bits: both callers get the
// same outputs, input gradients and weight gradients, bit for bit.
std::vector<std::uint16_t> halves(const Tensor& t) {
  const auto* p = static_cast<const std::uint16_t*>(t.raw());
  return {p, p + t.numel()};
}
std::vector<float> floats(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

TEST(Layers, MoeExpertsRoundTheSameRowsWhoeverGathersThem) {
  Rig s;
  s.ctx.activations = DType::bf16;
  const Moe moe = small_moe(s, true);
  const int N = 7;
  Tensor x = s.make({N, 6}), y = s.ctx.tensor({N, 6});
  Moe::Saved layer;
  moe.forward(s.ctx, x, y, layer);
  EXPECT_EQ(layer.xp.dtype(), DType::bf16);
  for (const Tensor* t : {&layer.gate, &layer.up, &layer.h}) EXPECT_EQ(t->dtype(), DType::bf16);
  EXPECT_EQ(layer.yp.dtype(), DType::f32);
  EXPECT_TRUE(layer.x_rounded.empty()) << "rows gathered rounded need no second copy";

  // The same rows gathered in fp32 by another caller.
  const std::int64_t R = layer.xp.dim(0);
  Tensor rows32 = s.ctx.tensor({R, 6});
  s.ctx.ops.gather_rows(x, layer.token_of_row, rows32);
  Moe::Saved other;
  moe.experts_forward(s.ctx, layer.offsets, 0, rows32, other);
  ASSERT_EQ(other.x_rounded.dtype(), DType::bf16);
  EXPECT_EQ(halves(other.x_rounded), halves(layer.xp));
  EXPECT_EQ(halves(other.h), halves(layer.h));
  EXPECT_EQ(floats(other.yp), floats(layer.yp));

  // Backward from one fp32 output gradient: the same input and weight gradients.
  Tensor dyp = s.make({R, 6});
  auto backward = [&](const Tensor& rows, const Moe::Saved& saved) {
    Tensor dxp = s.ctx.tensor({R, 6});
    s.params.zero_grads(s.ctx.ops);
    s.params.begin_backward();
    moe.experts_backward(s.ctx, layer.offsets, 0, rows, saved, dyp, dxp);
    for (ParamId id = 0; id < s.params.size(); ++id)  // the ones experts_backward does not report
      if (s.params.info(id).name.find("experts") == std::string::npos) s.params.grad_done(id);
    s.params.end_backward();
    std::vector<float> out = floats(dxp);
    for (ParamId id = 0; id < s.params.size(); ++id) {
      const std::vector<float> g = floats(s.params.grad(id));
      out.insert(out.end(), g.begin(), g.end());
    }
    return out;
  };
  const std::vector<float> a = backward(layer.xp, layer), b = backward(rows32, other);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, std::vector<float>(a.size(), 0.0f));

  // A Saved used again drops the rounded rows of its last call.
  moe.experts_forward(s.ctx, layer.offsets, 0, layer.xp, other);
  EXPECT_TRUE(other.x_rounded.empty());
}

TEST(Layers, RoutingPlanIsStableAndHandlesEmptyExperts) {
  // Tokens 0..3, top 2, experts 0..3; expert 2 gets nothing.
  const Routing r = Routing::plan({3, 0, 0, 1, 3, 1, 0, 3}, 4, 2, 4);
  EXPECT_EQ(r.counts, (std::vector<std::int64_t>{3, 2, 0, 3}));
  EXPECT_EQ(r.offsets, (std::vector<std::int64_t>{0, 3, 5, 5, 8}));
  EXPECT_EQ(r.token_of_row, (std::vector<std::int32_t>{0, 1, 3, 1, 2, 0, 2, 3}));
  for (int a = 0; a < 8; ++a) EXPECT_EQ(r.token_of_row[r.row_of[a]], a / 2);
  EXPECT_THROW(Routing::plan({0, 4}, 1, 2, 4), std::out_of_range);
  EXPECT_THROW(Routing::plan({0, 1, 2}, 1, 2, 4), std::invalid_argument);
}

// The MoE combine seen from each token (Ops::gather_add_rows) adds what the combine seen from each
// row (scatter_add_rows over the inverse list) adds, in the same order: equal bit for bit. Rows
// repeated within a token add in order of j; a row outside the source throws before anything
// is added.
TEST(Layers, GatherAddRowsAddsWhatScatterAddRowsAdds) {
  MemoryLedger ledger;
  auto make = [&](Shape s, DType dtype = DType::f32) {
    return Tensor(cpu_ops().memory(), ledger, Category::activations, s, dtype);
  };
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const Routing r = Routing::plan({3, 0, 0, 1, 3, 1, 0, 3, 2, 1}, 5, 2, 4);
  const int N = 5, k = 2, R = N * k, D = 7;
  Tensor src = make({R, D}), scale = make({R}), rows = make({R}, DType::i32), tokens = make({R}, DType::i32);
  for (std::int64_t i = 0; i < src.numel(); ++i) src.f32()[i] = normal(rng);
  for (std::int64_t i = 0; i < R; ++i) scale.f32()[i] = normal(rng);
  cpu_ops().upload(rows, r.row_of.data());
  cpu_ops().upload(tokens, r.token_of_row.data());
  Tensor gathered = make({N, D}), scattered = make({N, D});
  for (std::int64_t i = 0; i < gathered.numel(); ++i) gathered.f32()[i] = scattered.f32()[i] = normal(rng);
  cpu_ops().gather_add_rows(src, rows, k, &scale, gathered);
  cpu_ops().scatter_add_rows(src, tokens, &scale, scattered);
  for (std::int64_t i = 0; i < gathered.numel(); ++i)
    EXPECT_EQ(std::bit_cast<std::uint32_t>(gathered.f32()[i]), std::bit_cast<std::uint32_t>(scattered.f32()[i])) << i;

  // Token 0 names row 4 twice and row 1: 1, then 4 twice.
  Tensor twice = make({3}, DType::i32), one = make({1, D});
  const std::vector<std::int32_t> picks{4, 1, 4};
  cpu_ops().upload(twice, picks.data());
  for (int c = 0; c < D; ++c) one.f32()[c] = 0.5f;
  cpu_ops().gather_add_rows(src, twice, 3, nullptr, one);
  for (int c = 0; c < D; ++c) {
    float want = 0.5f;
    for (int row : {1, 4, 4}) want += src.f32()[row * D + c];
    EXPECT_EQ(one.f32()[c], want) << c;
  }

  const std::vector<float> before(one.f32(), one.f32() + D);
  const std::vector<std::int32_t> outside{0, static_cast<std::int32_t>(R), 2};
  cpu_ops().upload(twice, outside.data());
  EXPECT_THROW(cpu_ops().gather_add_rows(src, twice, 3, nullptr, one), std::out_of_range);
  EXPECT_EQ(std::vector<float>(one.f32(), one.f32() + D), before) << "nothing added";
  EXPECT_THROW(cpu_ops().gather_add_rows(src, twice, 2, nullptr, one), std::invalid_argument);  // 3 rows for 1 x 2
  EXPECT_THROW(cpu_ops().gather_add_rows(src, rows, 0, nullptr, gathered), std::invalid_argument);
  EXPECT_THROW(cpu_ops().gather_add_rows(src, rows, k, &rows, gathered), std::invalid_argument);  // scale not fp32

  // The gradient equals the three row operations it replaces: gather dout's rows, their dots with
  // src, then the scaling.
  Tensor dout = make({N, D}), dsrc = make({R, D}), dscale = make({R}), rows_of_dout = make({R, D}), dots = make({R});
  for (std::int64_t i = 0; i < dout.numel(); ++i) dout.f32()[i] = normal(rng);
  cpu_ops().gather_add_rows_backward(dout, tokens, scale, src, dsrc, dscale);
  cpu_ops().gather_rows(dout, tokens, rows_of_dout);
  cpu_ops().row_dot(rows_of_dout, src, dots);
  cpu_ops().scale_rows(rows_of_dout, scale);
  for (std::int64_t i = 0; i < dsrc.numel(); ++i) EXPECT_EQ(dsrc.f32()[i], rows_of_dout.f32()[i]) << i;
  for (std::int64_t row = 0; row < R; ++row) EXPECT_EQ(dscale.f32()[row], dots.f32()[row]) << row;
  Tensor bad_tokens = make({R}, DType::i32);
  std::vector<std::int32_t> past(r.token_of_row);
  past[3] = N;
  cpu_ops().upload(bad_tokens, past.data());
  EXPECT_THROW(cpu_ops().gather_add_rows_backward(dout, bad_tokens, scale, src, dsrc, dscale), std::out_of_range);
  EXPECT_THROW(cpu_ops().gather_add_rows_backward(dout, tokens, scale, src, gathered, dscale), std::invalid_argument);
}

TEST(Layers, TransformerWithMixtureOfExperts) {
  Rig s;
  ModelConfig c;
  c.vocab = 9, c.d_model = 8, c.n_layers = 1, c.q_heads = 2, c.kv_heads = 2, c.seq_len = 3;
  c.experts = 3, c.top_k = 2, c.shared_experts = 1, c.d_expert = 4, c.balance_coef = 0.3f;
  Transformer model(s.params, c);
  s.params.materialize(s.ctx.ops, s.ledger, 9);
  s.randomize_params(0.4f);
  randomize(s.params.value(0), 1.0f);  // embedding rows of order 1 (see check_transformer)
  for (ParamId id = 0; id < s.params.size(); ++id)
    if (s.params.info(id).name.find("router") != std::string::npos) randomize(s.params.value(id), 3.0f);
  EXPECT_EQ(s.params.numel(), c.parameter_count());
  const int batch = 2;
  Tensor ids = s.ctx.tensor({6}, Category::activations, DType::i32), targets = s.ctx.tensor({6}, Category::activations, DType::i32);
  const std::int32_t id_values[] = {1, 5, 8, 0, 3, 3}, target_values[] = {5, 8, 2, 3, 3, 7};
  s.ctx.ops.upload(ids, id_values);
  s.ctx.ops.upload(targets, target_values);
  const float scale = 1.0f / 6;
  model.train_step(s.ctx, ids, targets, batch, scale);
  EXPECT_GT(s.ctx.aux_loss, 0.0);
  // The forward spelled out (not evaluate()) so the routing of each block can be read back.
  std::uint64_t signature = 0;
  auto loss = [&] {
    s.ctx.aux_loss = 0;
    Transformer::Saved sv;
    model.forward(s.ctx, ids, batch, false, sv);
    Tensor scratch = s.ctx.tensor(sv.logits.shape());
    const double ce = s.ctx.ops.cross_entropy(sv.logits, targets, 0.0f, scratch);
    signature = 0;
    for (const Block::Saved& b : sv.blocks) signature = routing_signature(b.internals->moe.top_idx, signature + 1);
    return scale * ce + s.ctx.aux_loss;
  };
  expect_gradients_off_seams(loss, s.param_vars(), 3e-3, [&] { return signature; });
}

}  // namespace
}  // namespace k2c::model
