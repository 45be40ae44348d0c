// course_kernels_test.cpp — k2c_course_kernels_test: the adapters of course mode
// (course_kernels.cu) with the reference solutions' kernels, on shapes a training step never
// makes: tails and sizes of one, K not a multiple of 8 (05's Part A instead of its Hopper part),
// empty groups and a first group past 0 (10), GQA, attention that is not causal or whose keys
// outnumber its queries, positions that do not count from zero, outputs that add, activations
// stored in bf16. Every call goes
// through CourseOps, which compares the course kernel with the trusted GPU backend at each new
// shape; a test passes when no operation fell back and the shapes that 09 cannot take were
// declined, not miscomputed. A build from assignments/ runs the student's kernels, which this
// program is not here to grade: it skips there.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "course_kernels.h"
#include "k2c/core/bf16.h"
#include "k2c/model/cuda_ops.h"
#include "k2c/model/testing.h"
#include "moe.h"
#include "tensor_core_matmul.h"

namespace k2c::capstone {
namespace {

using model::AttentionShape;
using model::CourseOps;
using model::Tensor;
using model::testing::Side;

class CourseKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!model::cuda_device_present()) GTEST_SKIP() << "needs a CUDA device";
    if (std::string(K2C_IMPL_NAME) != "solutions")
      GTEST_SKIP() << "checks the adapters with the reference kernels; this build runs " << K2C_IMPL_NAME;
    course_ = std::make_unique<CourseOps>(model::cuda_ops(), course_kernels(), CourseOps::Rules{3e-2, 1e-2, 1000});
    side_ = std::make_unique<Side>(*course_);
  }

  Tensor random(model::Shape shape) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> v(static_cast<std::size_t>(shape.numel()));
    for (float& x : v) x = d(rng_);
    return side_->upload(v, shape);
  }
  // The same in bf16 (rounded to nearest even), and a bf16 tensor of NaN.
  Tensor random16(model::Shape shape, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<std::uint16_t> v(static_cast<std::size_t>(shape.numel()));
    for (std::uint16_t& x : v) x = float_to_bf16(d(rng_));
    Tensor t = side_->tensor(shape, model::DType::bf16);
    if (!v.empty()) course_->upload(t, v.data());
    return t;
  }
  Tensor poisoned16(model::Shape shape) {
    Tensor t = side_->tensor(shape, model::DType::bf16);
    course_->fill(t, std::nanf(""));
    return t;
  }
  // The operation's row of the table: the course kernel ran `checked` shapes, declined `declined`,
  // never fell back, and no Hopper part gave way to its Part A.
  void expect_row(const std::string& op, int checked, int declined = 0) {
    for (const auto& r : course_->table()) {
      if (r.op != op) continue;
      EXPECT_TRUE(r.fallback.empty()) << op << " fell back: " << r.fallback;
      EXPECT_TRUE(r.replaced.empty()) << op << " replaced " << r.replaced;
      EXPECT_EQ(r.shapes_checked, checked) << op << "\n" << course_->report();
      EXPECT_EQ(r.shapes_declined, declined) << op << "\n" << course_->report();
      return;
    }
    ADD_FAILURE() << "no row " << op;
  }

  // A fresh CourseOps over course_kernels with the weight gradients on 10 or not (its checks start
  // over), recording the groups of each weight gradient that runs on 10. No tensor of the previous
  // Side may outlive this call.
  void use(bool weight_grads_on_10) {
    CourseOptions options;
    options.weight_grads_on_10 = weight_grads_on_10;
    options.on_weight_grad_groups = [this](int groups) { groups_.push_back(groups); };
    use(options);
  }
  void use(const CourseOptions& options) {
    side_.reset();
    groups_.clear();
    course_ = std::make_unique<CourseOps>(model::cuda_ops(), course_kernels(options), CourseOps::Rules{3e-2, 1e-2, 1000});
    side_ = std::make_unique<Side>(*course_);
  }
  // The operation's row names a kernel that contains `what`.
  void expect_kernel(const std::string& op, const std::string& what) {
    for (const auto& r : course_->table())
      if (r.op == op) {
        EXPECT_NE(r.kernel.find(what), std::string::npos) << op << " ran " << r.kernel;
        return;
      }
    ADD_FAILURE() << "no row " << op;
  }
  void attention_cases();
  // Whether the weight gradients ran on 10, where asked and both modules' Hopper parts run: the
  // matmul row names it, and its calls were seen, split into `fewest` to `most` groups.
  void expect_weight_grads_on_10(bool on, int fewest, int most) {
    const bool runs = on && k2c::moe::hopper_supported() && k2c::tensor_core_matmul::hopper_supported();
    for (const auto& r : course_->table())
      if (r.op == "matmul")
        EXPECT_EQ(r.kernel.find("grouped_weight_grad_hopper") != std::string::npos, runs) << r.kernel;
    EXPECT_EQ(!groups_.empty(), runs);
    if (!runs) return;
    EXPECT_EQ(*std::min_element(groups_.begin(), groups_.end()), fewest);
    EXPECT_EQ(*std::max_element(groups_.begin(), groups_.end()), most);
  }

  // Two Linear layers that share a bf16 input, forward and backward (two shapes of the matmul row).
  void bf16_shared_linears() {
    const std::int64_t T = 2048, K = 96;
    Tensor x = random16({T, K}), w0 = random({128, K}), w1 = random({40, K});
    Tensor y0 = poisoned16({T, 128}), y1 = poisoned16({T, 40}), dy0 = random16({T, 128}), dy1 = random16({T, 40});
    Tensor dw0 = random({128, K}), dw1 = random({40, K}), dx = poisoned16({T, K});
    const Tensor* ws[] = {&w0, &w1};
    Tensor* ys[] = {&y0, &y1};
    const Tensor* dys[] = {&dy0, &dy1};
    Tensor* dws[] = {&dw0, &dw1};
    course_->shared_linear_forward(x, ws, ys);
    course_->shared_linear_backward(x, ws, dys, dws, &dx);
  }

  std::vector<int> groups_;  // of each weight gradient on 10, since use()

  std::mt19937_64 rng_{2026};
  std::unique_ptr<CourseOps> course_;
  std::unique_ptr<Side> side_;
};

TEST_F(CourseKernels, GemmInEveryLayoutAndSize) {
  struct Case {
    int M, N, K;
  };
  // K = 13: 05's Hopper part needs K % 8 == 0, so the adapter runs Part A. Few output tiles over
  // a long K are split into slices of K (132 SMs): dW at {2048, 768, 768} in 4 slices of 512, at
  // {2056, 96, 64} in 576 × 3 + 328 (both operands transposed on the way); {40, 24, 3000}'s
  // forward in 640 × 4 + 440 (neither transposed).
  const Case cases[] = {{1, 1, 8},         {33, 17, 40},    {33, 17, 13},    {257, 130, 264},
                        {2048, 768, 768},  {2056, 96, 64},  {40, 24, 3000}};
  int shapes = 0;
  for (const Case& c : cases) {
    Tensor x = random({c.M, c.K}), w = random({c.N, c.K}), dy = random({c.M, c.N});
    Tensor y = side_->poisoned({c.M, c.N}), dx = side_->poisoned({c.M, c.K}), dw = random({c.N, c.K});
    course_->matmul(x, false, w, true, y, 1.0f, 0.0f);     // forward, y = x·Wᵀ
    course_->matmul(dy, false, w, false, dx, 1.0f, 0.0f);  // dx = dy·W
    course_->matmul(dy, true, x, false, dw, 1.0f, 1.0f);   // dW += dyᵀ·x
    course_->matmul(x, false, w, true, y, 0.5f, 0.25f);    // scaled, added
    shapes += 4;
  }
  expect_row("matmul", shapes);
}

// Linear layers that share an input: one compound call each way, checked as a shape of the matmul
// row, through every path of the adapter (132 SMs), with the weight gradients on 10 (the default)
// and on 05 alone. The second weight is frozen (no gradient); dx is written whole. On 05 alone:
//   T 64, 520, 2048 (K 96)  the shared path; at 520 a tile's tail, at 2048 every weight gradient
//                           in 4 slices of 512 with x transposed once for all of them
//   T 4096, K 768           weight gradients in slices of 1408 (1536 rows) and 512 (40 rows): x
//                           transposed anew for the second
// On 10, where 05's Hopper part takes the input gradient's products whole: the same shapes with
// x and dy not transposed, the weight gradients in one group (T 64, 520) or split into groups of
// tokens (at T 2048 into 4 of 512; at T 4096 into 3 for 1536 rows and 8 for 8 and 40; at T 4104
// into 7 groups of 586 or 587 tokens for 768 × 768, tails inside them) (132 SMs).
// On both:
//   T 37                    one product at a time (K % 8 ≠ 0 for the weight gradients: Part A)
//   K 100                   one product at a time (Part A throughout)
//   T 64, K 2048            the forward products would be split: one at a time
//   T 64, rows 2048         the input gradient's products would be split: one at a time
TEST_F(CourseKernels, LinearsThatShareAnInput) {
  struct Case {
    std::int64_t T, K, rows[3];
  };
  const Case cases[] = {{64, 96, {128, 32, 40}},     {520, 96, {128, 32, 40}}, {2048, 96, {128, 32, 40}},
                        {4096, 768, {1536, 8, 40}},   {37, 96, {128, 32, 40}},  {64, 100, {128, 32, 40}},
                        {64, 2048, {128, 32, 40}},    {64, 96, {2048, 32, 40}}, {2048, 96, {128, 64, 192}},
                        {4104, 768, {768, 64, 256}}};
  for (const bool on_10 : {true, false}) {
    SCOPED_TRACE(on_10 ? "weight gradients on 10" : "05 alone");
    use(on_10);
    int shapes = 0;
    for (const Case& c : cases) {
      const std::int64_t T = c.T, K = c.K;
      Tensor x = random({T, K}), w0 = random({c.rows[0], K}), w1 = random({c.rows[1], K}), w2 = random({c.rows[2], K});
      Tensor y0 = side_->poisoned({T, c.rows[0]}), y1 = side_->poisoned({T, c.rows[1]}),
             y2 = side_->poisoned({T, c.rows[2]});
      const Tensor* ws[] = {&w0, &w1, &w2};
      Tensor* ys[] = {&y0, &y1, &y2};
      course_->shared_linear_forward(x, ws, ys);
      Tensor dy0 = random({T, c.rows[0]}), dy1 = random({T, c.rows[1]}), dy2 = random({T, c.rows[2]});
      Tensor dw0 = random({c.rows[0], K}), dw2 = random({c.rows[2], K}), dx = side_->poisoned({T, K});
      const Tensor* dys[] = {&dy0, &dy1, &dy2};
      Tensor* dws[] = {&dw0, nullptr, &dw2};
      course_->shared_linear_backward(x, ws, dys, dws, &dx);
      shapes += 2;
    }
    expect_row("matmul", shapes);
    expect_weight_grads_on_10(on_10, 1, 8);  // 8: the thin weights at T 4096 and 4104 (24 SMs or more)
  }
}

// One Linear layer's backward (a list of one), with the weight gradient on 10 (in two groups of
// tokens) and on 05 alone: its input gradient goes straight into a bf16 dx (through a scratch
// product for an fp32 one), for a weight of 128 rows and of 40; and without dx.
TEST_F(CourseKernels, OneLinearLayersBackward) {
  for (const bool on_10 : {true, false}) {
    SCOPED_TRACE(on_10 ? "weight gradients on 10" : "05 alone");
    use(on_10);
    int shapes = 0;
    for (const std::int64_t rows : {128, 40})
      for (const bool bf16_dx : {false, true}) {
        const std::int64_t T = 1040, K = 96;
        Tensor x = bf16_dx ? random16({T, K}) : random({T, K}), w = random({rows, K});
        Tensor dy = bf16_dx ? random16({T, rows}) : random({T, rows}), dw = random({rows, K});
        Tensor dx = bf16_dx ? poisoned16({T, K}) : side_->poisoned({T, K});
        course_->linear_backward(x, w, dy, &dw, &dx);
        course_->linear_backward(x, w, dy, &dw, nullptr);
        shapes += 2;
      }
    expect_row("matmul", shapes);
    expect_weight_grads_on_10(on_10, 2, 2);
  }
}

// 10's Hopper part takes k % 8 == 0, and for the input gradient n % 8 == 0 and k % 64 == 0 (10's
// n and k: the model's k and n there); Part A takes the rest, and no rows at all.
//   n 24, k 40   forward and weight gradient on the Hopper part, input gradient on Part A
//   n 64, k 40   all three on the Hopper part
//   n 24, k 13   all three on Part A
TEST_F(CourseKernels, GroupedGemmsWithEmptyGroupsAndAnOffsetFirstGroup) {
  // 5 groups of a stacked weight of 8, from group 2: sizes 3, 0, 17, 1 and 0 rows; then no rows.
  const int first = 2;
  for (const auto& [n, k] : {std::pair{24, 40}, std::pair{64, 40}, std::pair{24, 13}})
    for (const std::vector<std::int64_t>& offsets : {std::vector<std::int64_t>{0, 3, 3, 20, 21, 21}, std::vector<std::int64_t>{0, 0, 0}}) {
      const int rows = static_cast<int>(offsets.back());
      Tensor x = random({rows, k}), w = random({8, n, k}), dy = random({rows, n}), dw = random({8, n, k});
      Tensor y = side_->poisoned({rows, n}), dx = side_->poisoned({rows, k});
      course_->grouped_matmul(x, offsets, first, w, true, y);    // y_g = x_g · w_gᵀ
      course_->grouped_matmul(dy, offsets, first, w, false, dx);  // dx_g = dy_g · w_g
      course_->grouped_weight_grad(dy, x, offsets, first, dw);    // dw_g += dy_gᵀ · x_g
    }
  expect_row("grouped matmul", 12);
  expect_row("grouped weight grad", 6);
  if (k2c::moe::hopper_supported())  // the Hopper part ran (the shapes above take both parts)
    for (const auto& r : course_->table())
      if (r.op == "grouped matmul" || r.op == "grouped weight grad")
        EXPECT_NE(r.kernel.find("_hopper"), std::string::npos) << r.op << ": " << r.kernel;
}

// The experts' grouped GEMMs under bf16 activations (common/model/src/moe.cpp), in the dtypes a
// step gives them: bf16 rows give bf16 gate and up, and bf16 h an fp32 output; backward rounds
// the output gradient to bf16 first, which gives a bf16 dh, and bf16 dg gives fp32 input-gradient
// rows; the fp32 weight gradients come from bf16 operands. Same groups and shapes as above.
TEST_F(CourseKernels, GroupedGemmsOnBf16Rows) {
  const int first = 2;
  const std::vector<std::int64_t> offsets{0, 3, 3, 20, 21, 21};
  for (const auto& [n, k] : {std::pair{24, 40}, std::pair{64, 40}, std::pair{24, 13}}) {
    Tensor x = random16({21, k}), w = random({8, n, k}), w_down = random({8, k, n});
    Tensor h = poisoned16({21, n}), y = side_->poisoned({21, k});
    course_->grouped_matmul(x, offsets, first, w, true, h);       // h_g = x_g · w_gᵀ, bf16 out
    course_->grouped_matmul(h, offsets, first, w_down, true, y);  // y_g = h_g · w_down_gᵀ, fp32 out
    Tensor dy = random16({21, k}), dh = poisoned16({21, n}), dx = side_->poisoned({21, k});
    course_->grouped_matmul(dy, offsets, first, w_down, false, dh);  // bf16 in, bf16 out
    course_->grouped_matmul(dh, offsets, first, w, false, dx);       // bf16 in, fp32 out
    Tensor dw = random({8, n, k}), dw_down = random({8, k, n});
    course_->grouped_weight_grad(dh, x, offsets, first, dw);
    course_->grouped_weight_grad(dy, h, offsets, first, dw_down);
  }
  expect_row("grouped matmul", 12);
  expect_row("grouped weight grad", 6);
}

TEST_F(CourseKernels, RmsNormForwardAndBackward) {
  const int shapes[][2] = {{1, 64}, {37, 100}, {1000, 768}};
  for (const auto& [rows, cols] : shapes) {
    Tensor x = random({rows, cols}), g = random({cols}), dy = random({rows, cols}), res = random({rows, cols});
    Tensor y = side_->poisoned({rows, cols}), rstd = side_->poisoned({rows}), dx = side_->poisoned({rows, cols});
    Tensor dg = random({cols});  // dgamma adds into what is there
    course_->rmsnorm_forward(x, g, 1e-5f, y, rstd);
    course_->rmsnorm_backward(x, g, rstd, dy, dx, dg);
    course_->rmsnorm_backward_add(x, g, rstd, dy, res, dx, dg);
  }
  expect_row("rmsnorm", 3);
  expect_row("rmsnorm backward", 6);
}

TEST_F(CourseKernels, RopeAtAnyPositions) {
  // Positions are data, not shape: CourseOps checks once per tensor shape, so each set of
  // positions comes with a sequence length of its own to be checked on its own.
  const int batch = 3;
  const std::vector<std::int32_t> from_zero{0, 1, 2, 3, 4, 5, 6}, offset{100, 101, 102, 103, 104},
      scattered{9, 2, 40, 2, 0, 777};
  for (const auto& positions : {from_zero, offset, scattered}) {
    Tensor pos = side_->upload_ids(positions);
    const int T = static_cast<int>(positions.size());
    for (const auto& [heads, hd] : {std::pair{3, 16}, std::pair{2, 64}}) {
      Tensor x = random({batch * T, heads * hd});
      course_->rope(x, pos, heads, hd, 10000.0f, false);
      course_->rope(x, pos, heads, hd, 10000.0f, true);
    }
  }
  expect_row("rope", 12);
}

// The attention cases: GQA and MQA, head dims 64 and 128, tails, keys longer than queries, the
// bottom-right causal mask; and two that 09 declines (a top-left causal mask, head_dim 32). The
// backward runs both ways, adding into dk and dv and writing them over NaN (the library's
// Attention), each checked at every shape as a shape of its own.
void CourseKernels::attention_cases() {
  struct Case {
    AttentionShape s;
    bool taken;
  };
  const Case cases[] = {
      {AttentionShape::causal_self(2, 100, 4, 2, 64), true},           // GQA, a tail of 36 rows
      {AttentionShape::causal_self(1, 33, 2, 2, 128), true},           // head_dim 128
      {{2, 40, 70, 4, 1, 64, false, 0, 0}, true},                      // not causal, MQA, kv longer
      {{1, 24, 56, 2, 2, 64, true, 32, 0}, true},                      // the last 24 queries of 56: bottom-right
      {{1, 24, 56, 2, 2, 64, true, 0, 0}, false},                      // causal from the top: 09 cannot
      {AttentionShape::causal_self(1, 16, 2, 2, 32), false},           // head_dim 32: 09 cannot
  };
  int taken = 0, declined = 0;
  for (const Case& c : cases) {
    const AttentionShape& s = c.s;
    Tensor q = random({s.batch * s.q_len, s.q_heads * s.head_dim}), k = random({s.batch * s.kv_len, s.kv_heads * s.head_dim}),
           v = random({s.batch * s.kv_len, s.kv_heads * s.head_dim}), dout = random({s.batch * s.q_len, s.q_heads * s.head_dim});
    Tensor o = side_->poisoned({s.batch * s.q_len, s.q_heads * s.head_dim}), lse = side_->poisoned({s.batch, s.q_heads, s.q_len});
    Tensor dq = side_->poisoned({s.batch * s.q_len, s.q_heads * s.head_dim});
    Tensor dk = random({s.batch * s.kv_len, s.kv_heads * s.head_dim}), dv = random({s.batch * s.kv_len, s.kv_heads * s.head_dim});
    course_->attention_forward(s, q, k, v, o, lse);
    course_->attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv);
    Tensor dk_written = side_->poisoned(dk.shape()), dv_written = side_->poisoned(dv.shape());
    course_->attention_backward_overwrite(s, q, k, v, o, lse, dout, dq, dk_written, dv_written);
    (c.taken ? taken : declined) += 1;
  }
  expect_row("attention", taken, declined);
  expect_row("attention backward", 2 * taken, 2 * declined);
}

// With the reference, both passes take the model's tensors as they stand (09's tokens_first).
TEST_F(CourseKernels, AttentionShapesAndDeclines) {
  attention_cases();
  expect_kernel("attention", "(tokens_first)");
  expect_kernel("attention backward", "(tokens_first)");
}

// The way a part that has not taken on tokens_first runs: through heads-first copies.
TEST_F(CourseKernels, AttentionThroughHeadsFirstCopies) {
  CourseOptions options;
  options.attention_tokens_first = false;
  use(options);
  attention_cases();
  expect_kernel("attention", "(heads_first copies)");
  expect_kernel("attention backward", "(heads_first copies)");
}

// The adapters' conversions move 8 elements a thread where a tensor starts on 16 bytes and one at
// a time where it does not (a parameter's slice of the flat buffer need not): tensors here are
// views that start one float into their buffers, so every conversion takes its one-at-a-time form.
TEST_F(CourseKernels, TensorsThatDoNotStartOn16Bytes) {
  std::vector<Tensor> buffers;
  auto shifted = [&](model::Shape shape, bool poison) {
    buffers.push_back(poison ? side_->poisoned({shape.numel() + 1}) : random({shape.numel() + 1}));
    return Tensor::view(buffers.back().f32() + 1, shape);
  };
  const int M = 72, N = 40, K = 64;
  Tensor x = shifted({M, K}, false), w = shifted({N, K}, false), y = shifted({M, N}, true), dw = shifted({N, K}, false);
  course_->matmul(x, false, w, true, y, 1.0f, 0.0f);
  course_->matmul(y, true, x, false, dw, 1.0f, 1.0f);
  Tensor g = shifted({K}, false), rstd = shifted({M}, true), n = shifted({M, K}, true), dn = shifted({M, K}, true);
  course_->rmsnorm_forward(x, g, 1e-5f, n, rstd);
  Tensor dg = shifted({K}, false);
  course_->rmsnorm_backward_add(x, g, rstd, n, x, dn, dg);
  const AttentionShape s = AttentionShape::causal_self(2, 36, 2, 2, 64);
  Tensor q = shifted({72, 128}, false), k = shifted({72, 128}, false), v = shifted({72, 128}, false);
  Tensor o = shifted({72, 128}, true), lse = shifted({2, 2, 36}, true), dq = shifted({72, 128}, true);
  Tensor dk = shifted({72, 128}, false), dv = shifted({72, 128}, false);
  course_->attention_forward(s, q, k, v, o, lse);
  course_->attention_backward(s, q, k, v, o, lse, o, dq, dk, dv);
  expect_row("matmul", 2);
  expect_row("rmsnorm", 1);
  expect_row("rmsnorm backward", 1);
  expect_row("attention", 1);
  expect_row("attention backward", 1);
}

// Activations stored in bf16 (k2c/model/ops.h), with fp32 weights and residual stream as in the
// model: a bf16 operand already in a contract's layout reaches the module as it is, a bf16 result
// goes straight into the model's tensor, and transposes, slices and 09's layout read bf16. GEMMs:
// {2048, 768, 768} (one slice forward, the weight gradient in slices, both operands transposed
// from bf16), {33, 17, 40}, and K 13 (Part A, its fp32 product rounded into the bf16 output); then
// Linear layers that share a bf16 input (their weight gradients on 10; Bf16LinearsOn05Alone runs
// them on 05), RMSNorm (fp32 in, bf16 out; a bf16 dy), RoPE in place and attention on bf16 (GQA; not causal
// with more keys than queries).
TEST_F(CourseKernels, Bf16Activations) {
  int gemms = 0;
  for (const auto& [M, N, K] : {std::tuple{2048, 768, 768}, std::tuple{33, 17, 40}, std::tuple{33, 17, 13}}) {
    Tensor x = random16({M, K}), w = random({N, K}), dy = random16({M, N});
    Tensor y = poisoned16({M, N}), dx = poisoned16({M, K}), dw = random({N, K});
    course_->matmul(x, false, w, true, y, 1.0f, 0.0f);
    course_->matmul(dy, false, w, false, dx, 1.0f, 0.0f);
    course_->matmul(dy, true, x, false, dw, 1.0f, 1.0f);
    course_->matmul(x, false, w, true, y, 0.5f, 0.25f);
    gemms += 4;
  }
  bf16_shared_linears();
  expect_row("matmul", gemms + 2);
  for (const auto& [rows, cols] : {std::pair{37, 100}, std::pair{1000, 768}}) {
    Tensor x = random({rows, cols}), g = random({cols}), dy = random16({rows, cols}), res = random({rows, cols});
    Tensor y = poisoned16({rows, cols}), rstd = side_->poisoned({rows}), dx = side_->poisoned({rows, cols});
    Tensor dg = random({cols});
    course_->rmsnorm_forward(x, g, 1e-5f, y, rstd);
    course_->rmsnorm_backward_add(x, g, rstd, dy, res, dx, dg);
  }
  expect_row("rmsnorm", 2);
  expect_row("rmsnorm backward", 2);
  Tensor pos = side_->upload_ids({0, 1, 2, 3, 4, 5, 6});
  Tensor r = random16({3 * 7, 2 * 64});
  course_->rope(r, pos, 2, 64, 10000.0f, false);
  course_->rope(r, pos, 2, 64, 10000.0f, true);
  expect_row("rope", 2);
  for (const AttentionShape& s : {AttentionShape::causal_self(2, 100, 4, 2, 64), AttentionShape{2, 40, 70, 4, 1, 64, false, 0, 0}}) {
    const std::int64_t qr = std::int64_t{s.batch} * s.q_len, kr = std::int64_t{s.batch} * s.kv_len;
    Tensor q = random16({qr, s.q_heads * s.head_dim}), k = random16({kr, s.kv_heads * s.head_dim}),
           v = random16({kr, s.kv_heads * s.head_dim}), dout = random16({qr, s.q_heads * s.head_dim});
    Tensor o = poisoned16({qr, s.q_heads * s.head_dim}), lse = side_->poisoned({s.batch, s.q_heads, s.q_len});
    // dK and dV add into what is there: small, so that bf16's rounding of the sum stays below the gradient's.
    Tensor dq = poisoned16({qr, s.q_heads * s.head_dim}), dk = random16({kr, s.kv_heads * s.head_dim}, 0.05f),
           dv = random16({kr, s.kv_heads * s.head_dim}, 0.05f);
    course_->attention_forward(s, q, k, v, o, lse);
    course_->attention_backward(s, q, k, v, o, lse, dout, dq, dk, dv);
    // Written instead (the library's Attention): 09 writes straight into these bf16 tensors.
    Tensor dk_written = poisoned16(dk.shape()), dv_written = poisoned16(dv.shape());
    course_->attention_backward_overwrite(s, q, k, v, o, lse, dout, dq, dk_written, dv_written);
  }
  expect_row("attention", 2);
  expect_row("attention backward", 4);
}

// RMSNorm on a bf16 residual stream (--residual bf16): x and dx in bf16, dx written straight by 07
// where nothing is added (the final norm), else 07's result plus a residual gradient in bf16 or, as
// a pipeline stage receives it, fp32. Odd sizes take the passes' one-element forms.
TEST_F(CourseKernels, Bf16ResidualStream) {
  for (const auto& [rows, cols] : {std::pair{37, 100}, std::pair{1000, 768}}) {
    Tensor x = random16({rows, cols}), g = random({cols}), dy = random16({rows, cols});
    Tensor res16 = random16({rows, cols}), res32 = random({rows, cols});
    Tensor y = poisoned16({rows, cols}), rstd = side_->poisoned({rows}), dg = random({cols});
    course_->rmsnorm_forward(x, g, 1e-5f, y, rstd);
    Tensor dx = poisoned16({rows, cols});
    course_->rmsnorm_backward(x, g, rstd, dy, dx, dg);
    dx = poisoned16({rows, cols});
    course_->rmsnorm_backward_add(x, g, rstd, dy, res16, dx, dg);
    dx = poisoned16({rows, cols});
    course_->rmsnorm_backward_add(x, g, rstd, dy, res32, dx, dg);
  }
  expect_row("rmsnorm", 2);
  expect_row("rmsnorm backward", 6);
}

// The Linear layers of Bf16Activations with their weight gradients on 05 alone: its transposes
// read bf16.
TEST_F(CourseKernels, Bf16LinearsOn05Alone) {
  use(false);
  bf16_shared_linears();
  expect_row("matmul", 2);
}

// A part that faults in its probe (here 05's Part A reading and writing unmapped addresses) ends
// the program with the part's name, not at some later call. Run in a child process (the fault
// ends this one's CUDA context), started afresh rather than forked, as CUDA requires.
TEST(CourseKernelsProbe, AFaultingPartEndsTheRunByName) {
  if (!model::cuda_device_present()) GTEST_SKIP() << "needs a CUDA device";
  if (std::string(K2C_IMPL_NAME) != "solutions")  // a stub's Part A throws instead of faulting
    GTEST_SKIP() << "faults the reference's Part A; this build runs " << K2C_IMPL_NAME;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        using bf16 = k2c::tensor_core_matmul::bf16;
        auto* nowhere = reinterpret_cast<bf16*>(std::uintptr_t{1} << 46);  // aligned, never mapped
        try {
          probe_part(true, "a faulting test part", [&] {
            k2c::tensor_core_matmul::matmul(256, 256, 256, nowhere, nowhere, nowhere,
                                            static_cast<cudaStream_t>(model::cuda_ops_stream()));
          });
        } catch (const std::runtime_error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::exit(3);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(3), "a faulting test part faulted on the GPU in a one-call probe");
}

}  // namespace
}  // namespace k2c::capstone
