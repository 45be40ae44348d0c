// test_course_ops.cpp — CourseOps (k2c/model/course_ops.h) on the CPU backend with kernels made
// here: a right kernel is used after its check, and a stub, a wrong kernel, a kernel that writes
// NaN, one that forgets to add into its output and one that throws are each caught at their first
// call, their outputs replaced by the trusted ones and never called again.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/core/todo.h"
#include "k2c/model/course_ops.h"
#include "k2c/model/data.h"
#include "k2c/model/testing.h"
#include "k2c/model/train.h"

namespace k2c::model {
namespace {

using testing::Side;

std::vector<float> random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

const CourseOps::Row& row(const std::vector<CourseOps::Row>& t, const std::string& op) {
  for (const auto& r : t)
    if (r.op == op) return r;
  throw std::logic_error("no row " + op);
}

// A matmul computed by the CPU backend and then nudged by `nudge` (relative): a course kernel that
// is right to within rounding when nudge is small, and wrong when not.
CourseKernels nudged_matmul(float nudge, int* calls) {
  CourseKernels k;
  k.matmul = [=](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
    ++*calls;
    cpu_ops().matmul(a, ta, b, tb, c, alpha, beta);
    cpu_ops().scale(c, 1.0f + nudge);
    return true;
  };
  k.names["matmul"] = "test matmul";
  return k;
}

TEST(CourseOps, ARightKernelIsCheckedOnceAtEachShapeThenUsed) {
  int calls = 0;
  CourseOps ops(cpu_ops(), nudged_matmul(1e-4f, &calls));
  Side s(ops);
  Tensor a = s.upload(random_values(6 * 5, 1), {6, 5}), b = s.upload(random_values(4 * 5, 2), {4, 5});
  Tensor c = s.poisoned({6, 4});
  for (int i = 0; i < 3; ++i) ops.matmul(a, false, b, true, c, 1.0f, 0.0f);
  Tensor c2 = s.poisoned({6, 6});
  ops.matmul(a, false, a, true, c2, 1.0f, 0.0f);
  const auto r = row(ops.table(), "matmul");
  EXPECT_EQ(calls, 4);  // one check per shape, then the kernel alone
  EXPECT_EQ(r.course_calls, 4);
  EXPECT_EQ(r.trusted_calls, 0);
  EXPECT_EQ(r.shapes_checked, 2);
  EXPECT_TRUE(r.fallback.empty());
  EXPECT_GT(r.worst_error, 0.0);
  EXPECT_LT(r.worst_error, 1e-3);
  // The result is the course kernel's (nudged), not the trusted one.
  Side t;
  Tensor ta = t.upload(random_values(30, 1), {6, 5}), tb = t.upload(random_values(20, 2), {4, 5}), tc = t.tensor({6, 4});
  cpu_ops().matmul(ta, false, tb, true, tc, 1.0f, 0.0f);
  const std::vector<float> got = s.download(c), want = t.download(tc);
  EXPECT_FLOAT_EQ(got[3], want[3] * (1.0f + 1e-4f));
  EXPECT_NE(ops.report().find("agreed at 2 shapes"), std::string::npos) << ops.report();
}

// A kernel that returns without writing its output is caught even where the output's buffer
// already holds the right answer (as it can when a step recomputes what it computed before): the
// checked call starts from NaN, not from the buffer's old contents.
TEST(CourseOps, AKernelThatWritesNothingIsCaughtWhateverTheBufferHeld) {
  int calls = 0;
  CourseKernels k;
  k.matmul = [&](const Tensor&, bool, const Tensor&, bool, Tensor&, float, float) { return ++calls > 0; };
  k.names["matmul"] = "test matmul";
  CourseOps ops(cpu_ops(), std::move(k));
  Side s(ops);
  Tensor a = s.upload(random_values(6 * 5, 1), {6, 5}), b = s.upload(random_values(4 * 5, 2), {4, 5});
  Tensor c = s.poisoned({6, 4});
  cpu_ops().matmul(a, false, b, true, c, 1.0f, 0.0f);  // the answer, already there
  ops.matmul(a, false, b, true, c, 1.0f, 0.0f);
  const auto r = row(ops.table(), "matmul");
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(r.shapes_checked, 0);
  EXPECT_NE(r.fallback.find("disagreed"), std::string::npos) << r.fallback;
  for (float x : s.download(c)) EXPECT_TRUE(std::isfinite(x));  // the trusted result stands
}

TEST(CourseOps, ChecksStopAfterTheirBudgetPerFamilyAndTheRestIsCounted) {
  int calls = 0;
  CourseOps ops(cpu_ops(), nudged_matmul(1e-4f, &calls), CourseOps::Rules{3e-2, 1e-2, 2});
  Side s(ops);
  Tensor b = s.upload(random_values(4 * 5, 2), {4, 5});
  // An expert's GEMM: a new row count each time, and rows 5 once more (unchecked shapes are not
  // remembered, so it counts again).
  for (int rows : {1, 2, 3, 4, 5, 5}) {
    Tensor a = s.upload(random_values(rows * 5, rows), {rows, 5}), c = s.poisoned({rows, 4});
    ops.matmul(a, false, b, true, c, 1.0f, 0.0f);
  }
  for (int cols = 6; cols <= 8; ++cols) {  // other families (another width): each checked
    Tensor a = s.upload(random_values(3 * cols, cols), {3, cols}), w = s.upload(random_values(4 * cols, 9), {4, cols});
    Tensor c = s.poisoned({3, 4});
    ops.matmul(a, false, w, true, c, 1.0f, 0.0f);
  }
  const auto r = row(ops.table(), "matmul");
  EXPECT_EQ(calls, 9);  // every call once: the checked ones too run the kernel once
  EXPECT_EQ(r.shapes_checked, 5);   // 2 of the first family, 3 families of one shape
  EXPECT_EQ(r.unchecked_calls, 4);  // the first family's rows 3, 4, 5 and 5
  EXPECT_EQ(r.course_calls, 9);
  EXPECT_EQ(r.trusted_calls, 0);
  EXPECT_NE(ops.report().find("then 4 more calls uncompared"), std::string::npos) << ops.report();
}

TEST(CourseOps, AfterTheBudgetAThrowOrADeclineStillLeavesTheTrustedResult) {
  // Right at 2 row counts, declines the third, throws at the fourth (half-written output); with
  // c += a·bᵀ (old contents kept for the fallback) and c = a·bᵀ (written whole: no copy kept).
  for (const float beta : {1.0f, 0.0f}) {
    SCOPED_TRACE(beta != 0.0f ? "c += a·bT" : "c = a·bT");
    int calls = 0;
    CourseKernels k;
    k.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) -> bool {
      ++calls;
      if (a.dim(0) == 3) return false;
      if (a.dim(0) == 4) {
        cpu_ops().fill(c, 7.0f);
        throw std::runtime_error("out of shared memory");
      }
      cpu_ops().matmul(a, ta, b, tb, c, alpha, beta);
      return true;
    };
    CourseOps ops(cpu_ops(), std::move(k), CourseOps::Rules{3e-2, 1e-2, 2});
    Side s(ops), t;
    const std::vector<float> bv = random_values(4 * 5, 2);
    Tensor b = s.upload(bv, {4, 5}), tb = t.upload(bv, {4, 5});
    for (int rows = 1; rows <= 5; ++rows) {
      const std::vector<float> av = random_values(rows * 5, rows), cv = random_values(rows * 4, 50 + rows);
      Tensor a = s.upload(av, {rows, 5}), c = s.upload(cv, {rows, 4});
      Tensor ta = t.upload(av, {rows, 5}), tc = t.upload(cv, {rows, 4});
      ops.matmul(a, false, b, true, c, 1.0f, beta);
      cpu_ops().matmul(ta, false, tb, true, tc, 1.0f, beta);
      const std::vector<float> got = s.download(c), want = t.download(tc);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << rows << " rows";
    }
    const auto r = row(ops.table(), "matmul");
    EXPECT_EQ(calls, 4);  // the throw ended the kernel: rows 5 ran trusted
    EXPECT_EQ(r.shapes_checked, 2);
    EXPECT_EQ(r.shapes_declined, 1);
    EXPECT_EQ(r.unchecked_calls, 0);
    EXPECT_NE(r.fallback.find("out of shared memory"), std::string::npos) << r.fallback;
  }
}

TEST(CourseOps, AThrowAtAShapeComputedBeforeEndsTheRunByName) {
  int calls = 0;
  CourseKernels k;
  k.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) -> bool {
    if (++calls == 3) throw std::runtime_error("illegal address");
    cpu_ops().matmul(a, ta, b, tb, c, alpha, beta);
    return true;
  };
  k.names["matmul"] = "test matmul";
  CourseOps ops(cpu_ops(), std::move(k));
  Side s(ops);
  Tensor a = s.upload(random_values(15, 1), {3, 5}), b = s.upload(random_values(20, 2), {4, 5}), c = s.tensor({3, 4});
  ops.matmul(a, false, b, true, c, 1.0f, 0.0f);
  ops.matmul(a, false, b, true, c, 1.0f, 0.0f);
  try {
    ops.matmul(a, false, b, true, c, 1.0f, 0.0f);
    ADD_FAILURE() << "no throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("course kernel test matmul threw at [3, 5] x [4, 5]T, a shape it had computed "
                                         "before: illegal address"),
              std::string::npos)
        << e.what();
  }
}

// Each faulty kernel: the first call's outputs are the trusted backend's bit for bit, the kernel is
// never called again, and the table says why.
void expect_caught(CourseKernels kernels, const std::string& reason, int* calls) {
  CourseOps ops(cpu_ops(), std::move(kernels));
  Side s(ops), t;
  const std::vector<float> av = random_values(7 * 3, 3), bv = random_values(3 * 5, 4), cv = random_values(35, 5);
  Tensor a = s.upload(av, {7, 3}), b = s.upload(bv, {3, 5}), c = s.upload(cv, {7, 5});
  Tensor ta = t.upload(av, {7, 3}), tb = t.upload(bv, {3, 5}), tc = t.upload(cv, {7, 5});
  for (int i = 0; i < 3; ++i) {  // c += a·b, as a weight gradient accumulates
    ops.matmul(a, false, b, false, c, 1.0f, 1.0f);
    cpu_ops().matmul(ta, false, tb, false, tc, 1.0f, 1.0f);
  }
  const std::vector<float> got = s.download(c), want = t.download(tc);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  EXPECT_EQ(*calls, 1);
  const auto r = row(ops.table(), "matmul");
  EXPECT_EQ(r.course_calls, 0);
  EXPECT_EQ(r.trusted_calls, 3);
  EXPECT_NE(r.fallback.find(reason), std::string::npos) << r.fallback;
  EXPECT_NE(ops.report().find(reason), std::string::npos);
}

TEST(CourseOps, AWrongKernelFallsBackToTheTrustedOne) {
  int calls = 0;
  expect_caught(nudged_matmul(0.05f, &calls), "disagreed at [7, 3] x [3, 5] +=", &calls);
}

TEST(CourseOps, AStubFallsBackAsNotImplemented) {
  int calls = 0;
  CourseKernels k;
  k.matmul = [&](const Tensor&, bool, const Tensor&, bool, Tensor&, float, float) -> bool {
    ++calls;
    K2C_TODO("matmul");
  };
  expect_caught(std::move(k), "not implemented", &calls);
}

TEST(CourseOps, NaNAThrowAndAForgottenSumAreCaught) {
  int calls = 0;
  CourseKernels nan;
  nan.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
    ++calls;
    cpu_ops().matmul(a, ta, b, tb, c, alpha, beta);
    c.f32()[c.numel() - 1] = std::numeric_limits<float>::quiet_NaN();  // only the last element
    return true;
  };
  expect_caught(std::move(nan), "is nan where", &calls);

  calls = 0;
  CourseKernels overwrite;  // c = a·b where the operation asks for c += a·b
  overwrite.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float) {
    ++calls;
    cpu_ops().matmul(a, ta, b, tb, c, alpha, 0.0f);
    return true;
  };
  expect_caught(std::move(overwrite), "disagreed", &calls);

  calls = 0;
  CourseKernels throws;
  throws.matmul = [&](const Tensor&, bool, const Tensor&, bool, Tensor& c, float, float) -> bool {
    ++calls;
    cpu_ops().fill(c, 7.0f);  // half-written, then a fault
    throw std::invalid_argument("K must be a multiple of 8");
  };
  expect_caught(std::move(throws), "threw at [7, 3] x [3, 5] +=: K must be a multiple of 8", &calls);
}

TEST(CourseOps, ADeclinedShapeRunsTrustedAndOthersStillUseTheKernel) {
  int calls = 0;
  CourseKernels k;
  k.rope = [&](Tensor& x, const Tensor& pos, int heads, int hd, float theta, bool inverse) {
    if (hd != 4) return false;  // takes head_dim 4 only
    ++calls;
    cpu_ops().rope(x, pos, heads, hd, theta, inverse);
    return true;
  };
  k.names["rope"] = "test rope";
  CourseOps ops(cpu_ops(), std::move(k));
  Side s(ops);
  Tensor pos = s.upload_ids({0, 1, 2});
  Tensor x4 = s.upload(random_values(2 * 3 * 8, 6), {6, 8}), x2 = s.upload(random_values(6 * 8, 7), {6, 8});
  ops.rope(x4, pos, 2, 4, 10000.0f, false);
  ops.rope(x2, pos, 4, 2, 10000.0f, false);
  ops.rope(x2, pos, 4, 2, 10000.0f, false);
  ops.rope(x4, pos, 2, 4, 10000.0f, true);
  const auto r = row(ops.table(), "rope");
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(r.course_calls, 2);
  EXPECT_EQ(r.trusted_calls, 2);
  EXPECT_EQ(r.shapes_declined, 1);
  EXPECT_TRUE(r.fallback.empty());
  EXPECT_NE(ops.report().find("declined 1 shape it does not take"), std::string::npos) << ops.report();
  // rope then its inverse gives x back: the in-place input was restored for the kernel's check.
  const std::vector<float> back = s.download(x4), x = random_values(48, 6);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 1e-5) << i;
}

TEST(CourseOps, AttentionBackwardMustAddIntoDkAndDv) {
  // A backward that writes dk and dv instead of adding into them (a ring sums several chunks).
  int calls = 0;
  CourseKernels k;
  k.attention_backward = [&](const AttentionShape& sh, const Tensor& q, const Tensor& kk, const Tensor& v,
                             const Tensor& o, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                             Tensor& dv, bool) {
    ++calls;
    cpu_ops().fill(dk, 0.0f);
    cpu_ops().fill(dv, 0.0f);
    cpu_ops().attention_backward(sh, q, kk, v, o, lse, dout, dq, dk, dv);
    return true;
  };
  CourseOps ops(cpu_ops(), std::move(k));
  Side s(ops);
  const AttentionShape sh = AttentionShape::causal_self(1, 5, 2, 1, 4);
  Tensor q = s.upload(random_values(5 * 8, 8), {5, 8}), kk = s.upload(random_values(20, 9), {5, 4}),
         v = s.upload(random_values(20, 10), {5, 4}), dout = s.upload(random_values(40, 11), {5, 8});
  Tensor o = s.tensor({5, 8}), lse = s.tensor({1, 2, 5}), dq = s.tensor({5, 8});
  Tensor dk = s.upload(random_values(20, 12), {5, 4}), dv = s.upload(random_values(20, 13), {5, 4});
  ops.attention_forward(sh, q, kk, v, o, lse);
  ops.attention_backward(sh, q, kk, v, o, lse, dout, dq, dk, dv);
  const auto r = row(ops.table(), "attention backward");
  EXPECT_EQ(calls, 1);
  EXPECT_NE(r.fallback.find("(output 2)"), std::string::npos) << r.fallback;
  EXPECT_EQ(row(ops.table(), "attention").trusted_calls, 1);  // no forward kernel: trusted
  EXPECT_NE(ops.report().find("no course kernel for this operation"), std::string::npos);
}

TEST(CourseOps, AWrongFirstChoiceGivesWayToTheSecondWhichIsCheckedAnew) {
  // A "Hopper part" right at one shape and 5 % off at another, then a "Part A" that is right at
  // the second shape and wrong at the first: the switch happens at the second shape's call, and
  // the first shape, agreed by the other kernel, is compared again for the new one and caught.
  bool hopper = true;
  int hopper_calls = 0, part_a_calls = 0;
  CourseKernels k;
  k.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
    ++(hopper ? hopper_calls : part_a_calls);
    cpu_ops().matmul(a, ta, b, tb, c, alpha, beta);
    if (hopper == (c.dim(1) == 6)) cpu_ops().scale(c, 1.05f);  // Hopper: wrong at 6 columns; Part A: at 4
    return true;
  };
  k.names["matmul"] = "hopper";
  k.second_choice["matmul"] = [&] {
    if (!hopper) return std::string();
    hopper = false;
    return std::string("part A");
  };
  CourseOps ops(cpu_ops(), std::move(k));
  Side s(ops), t;
  const std::vector<float> av = random_values(30, 50), b4 = random_values(20, 51), b6 = random_values(30, 52);
  Tensor a = s.upload(av, {6, 5}), w4 = s.upload(b4, {4, 5}), w6 = s.upload(b6, {6, 5});
  Tensor c4 = s.poisoned({6, 4}), c6 = s.poisoned({6, 6});
  ops.matmul(a, false, w4, true, c4, 1.0f, 0.0f);  // Hopper agrees
  ops.matmul(a, false, w6, true, c6, 1.0f, 0.0f);  // Hopper disagrees: Part A takes the call and agrees
  auto r = row(ops.table(), "matmul");
  EXPECT_EQ(r.kernel, "part A");
  EXPECT_TRUE(r.fallback.empty()) << r.fallback;
  EXPECT_NE(r.replaced.find("hopper, which disagreed at [6, 5] x [6, 5]"), std::string::npos) << r.replaced;
  EXPECT_EQ(r.shapes_checked, 1);
  EXPECT_EQ(part_a_calls, 1);
  Tensor want6 = t.poisoned({6, 6});
  cpu_ops().matmul(t.upload(av, {6, 5}), false, t.upload(b6, {6, 5}), true, want6, 1.0f, 0.0f);
  const std::vector<float> got6 = s.download(c6), exp6 = t.download(want6);
  for (std::size_t i = 0; i < got6.size(); ++i) EXPECT_NEAR(got6[i], exp6[i], 1e-5) << i;
  ops.matmul(a, false, w4, true, c4, 1.0f, 0.0f);  // checked again, for Part A: caught
  r = row(ops.table(), "matmul");
  EXPECT_EQ(part_a_calls, 2);
  EXPECT_NE(r.fallback.find("disagreed at [6, 5] x [4, 5]"), std::string::npos) << r.fallback;
  EXPECT_NE(ops.report().find("in place of hopper, which disagreed"), std::string::npos) << ops.report();
  Tensor want4 = t.poisoned({6, 4});
  cpu_ops().matmul(t.upload(av, {6, 5}), false, t.upload(b4, {4, 5}), true, want4, 1.0f, 0.0f);
  const std::vector<float> got4 = s.download(c4), exp4 = t.download(want4);
  EXPECT_EQ(std::memcmp(got4.data(), exp4.data(), got4.size() * sizeof(float)), 0);
}

TEST(CourseOps, AThrowAlsoGivesWayToTheSecondChoiceButNotToItself) {
  // A first choice that throws is replaced as a disagreeing one is; a second choice that names the
  // kernel it would replace is refused (no endless retry), and the trusted backend takes over.
  for (const bool names_itself : {false, true}) {
    int calls = 0;
    bool first = true;
    CourseKernels k = nudged_matmul(1e-4f, &calls);
    auto right = k.matmul;
    k.matmul = [&, right](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
      if (first) throw std::runtime_error("Hopper part: illegal box");
      return right(a, ta, b, tb, c, alpha, beta);
    };
    k.second_choice["matmul"] = [&] {
      first = false;
      return std::string(names_itself ? "test matmul" : "part A");
    };
    CourseOps ops(cpu_ops(), std::move(k));
    Side s(ops);
    Tensor a = s.upload(random_values(30, 70), {6, 5}), b = s.upload(random_values(20, 71), {4, 5});
    Tensor c = s.poisoned({6, 4});
    ops.matmul(a, false, b, true, c, 1.0f, 0.0f);
    const auto r = row(ops.table(), "matmul");
    if (names_itself) {
      EXPECT_NE(r.fallback.find("threw at"), std::string::npos) << r.fallback;
      EXPECT_EQ(r.trusted_calls, 1);
      EXPECT_EQ(calls, 0);
    } else {
      EXPECT_TRUE(r.fallback.empty()) << r.fallback;
      EXPECT_EQ(r.kernel, "part A");
      EXPECT_NE(r.replaced.find("test matmul, which threw at [6, 5] x [4, 5]"), std::string::npos) << r.replaced;
      EXPECT_EQ(calls, 1);
    }
    Tensor want = s.poisoned({6, 4});
    cpu_ops().matmul(a, false, b, true, want, 1.0f, 0.0f);
    const std::vector<float> got = s.download(c), expected = s.download(want);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-3) << i;
  }
}

TEST(CourseOps, ALogSumExpOffByAConstantIsCaught) {
  // A forward whose log-sum-exp is 0.05 too large (the backward would scale every attention weight
  // by e^-0.05): within the relative rules at log-sum-exps of about 10, caught by the absolute one.
  auto biased = [](int* calls) {
    CourseKernels k;
    k.attention_forward = [calls](const AttentionShape& sh, const Tensor& q, const Tensor& kk, const Tensor& v, Tensor& o,
                                  Tensor& lse) {
      ++*calls;
      cpu_ops().attention_forward(sh, q, kk, v, o, lse);
      for (std::int64_t i = 0; i < lse.numel(); ++i) lse.f32()[i] += 0.05f;  // host memory: the CPU backend
      return true;
    };
    return k;
  };
  const AttentionShape sh = AttentionShape::causal_self(1, 48, 2, 2, 8);
  std::vector<float> qv = random_values(48 * 16, 60);
  for (float& x : qv) x *= 4.0f;  // scores of about ±10: log-sum-exps of about 10
  for (const bool relative_only : {true, false}) {
    int calls = 0;
    CourseOps::Rules rules;
    if (relative_only) rules.log_error = 1e9;
    CourseOps ops(cpu_ops(), biased(&calls), rules);
    Side s(ops);
    Tensor q = s.upload(qv, {48, 16}), kk = s.upload(random_values(48 * 16, 61), {48, 16}),
           v = s.upload(random_values(48 * 16, 62), {48, 16});
    Tensor o = s.poisoned({48, 16}), lse = s.poisoned({1, 2, 48});
    ops.attention_forward(sh, q, kk, v, o, lse);
    const auto r = row(ops.table(), "attention");
    EXPECT_EQ(calls, 1);
    if (relative_only) {
      EXPECT_TRUE(r.fallback.empty()) << r.fallback;
    } else {
      EXPECT_NE(r.fallback.find("(output 2)"), std::string::npos) << r.fallback;
      EXPECT_NE(r.fallback.find("a logarithm: error 0.05"), std::string::npos) << r.fallback;
    }
  }
}

// A grouped matmul computed by the CPU backend, then damaged by `damage` (offsets, output).
auto damaged_grouped_matmul(int* calls, std::function<void(std::span<const std::int64_t>, Tensor&)> damage) {
  return [=](const Tensor& a, std::span<const std::int64_t> offsets, int first, const Tensor& w, bool tw, Tensor& c) {
    ++*calls;
    cpu_ops().grouped_matmul(a, offsets, first, w, tw, c);
    damage(offsets, c);
    return true;
  };
}

TEST(CourseOps, GroupedGemmsAreCheckedLikeTheOthers) {
  // A grouped GEMM that loses the last group's last row: caught at the first call, the trusted
  // result stands.
  int calls = 0;
  CourseKernels k;
  k.grouped_matmul = damaged_grouped_matmul(&calls, [](std::span<const std::int64_t>, Tensor& c) {
    Tensor last = c.rows(c.dim(0) - 1, 1);
    cpu_ops().fill(last, 0.0f);
  });
  k.grouped_weight_grad = [&](const Tensor& dy, const Tensor& x, std::span<const std::int64_t> offsets, int first,
                              Tensor& dw) {
    cpu_ops().grouped_weight_grad(dy, x, offsets, first, dw);
    return true;
  };
  CourseOps ops(cpu_ops(), std::move(k));
  Side s(ops), t;
  const std::vector<std::int64_t> offsets{0, 3, 3, 7};  // three groups, the middle one empty
  const std::vector<float> av = random_values(7 * 5, 20), wv = random_values(4 * 6 * 5, 21), dyv = random_values(42, 22);
  Tensor a = s.upload(av, {7, 5}), w = s.upload(wv, {4, 6, 5}), c = s.poisoned({7, 6}), dy = s.upload(dyv, {7, 6});
  Tensor dw = s.upload(wv, {4, 6, 5});
  ops.grouped_matmul(a, offsets, 1, w, true, c);
  ops.grouped_weight_grad(dy, a, offsets, 1, dw);
  Tensor ta = t.upload(av, {7, 5}), tw = t.upload(wv, {4, 6, 5}), tc = t.poisoned({7, 6});
  cpu_ops().grouped_matmul(ta, offsets, 1, tw, true, tc);
  const std::vector<float> got = s.download(c), want = t.download(tc);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  const auto r = row(ops.table(), "grouped matmul");
  EXPECT_EQ(calls, 1);
  EXPECT_NE(r.fallback.find("disagreed at [7, 5] x [4, 6, 5], 3 groups from 1, split "), std::string::npos) << r.fallback;
  EXPECT_NE(r.fallback.find(" T (output 1)"), std::string::npos) << r.fallback;
  const auto g = row(ops.table(), "grouped weight grad");
  EXPECT_TRUE(g.fallback.empty()) << g.fallback;
  EXPECT_EQ(g.course_calls, 1);
}

TEST(CourseOps, AGroupedCallIsCheckedAtEachNewSplitOfItsRows) {
  // A grouped GEMM that skips the group after an empty one: right while no group is empty, so it
  // agrees at the first split, and is caught at the first call whose rows split differently
  // (same shapes, same total rows: what a MoE's routing does from one step to the next).
  int calls = 0;
  CourseKernels k;
  k.grouped_matmul = damaged_grouped_matmul(&calls, [](std::span<const std::int64_t> offsets, Tensor& c) {
    for (std::size_t g = 1; g + 1 < offsets.size(); ++g)
      if (offsets[g] == offsets[g - 1] && offsets[g + 1] > offsets[g]) {
        Tensor skipped = c.rows(offsets[g], offsets[g + 1] - offsets[g]);
        cpu_ops().fill(skipped, 0.0f);
      }
  });
  CourseOps ops(cpu_ops(), std::move(k));
  Side s(ops);
  Tensor a = s.upload(random_values(7 * 5, 40), {7, 5}), w = s.upload(random_values(4 * 6 * 5, 41), {4, 6, 5});
  Tensor c = s.poisoned({7, 6});
  ops.grouped_matmul(a, std::vector<std::int64_t>{0, 3, 5, 7}, 1, w, true, c);
  ops.grouped_matmul(a, std::vector<std::int64_t>{0, 3, 5, 7}, 1, w, true, c);  // the same split: not checked again
  EXPECT_EQ(row(ops.table(), "grouped matmul").shapes_checked, 1);
  ops.grouped_matmul(a, std::vector<std::int64_t>{0, 3, 3, 7}, 1, w, true, c);
  const auto r = row(ops.table(), "grouped matmul");
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(r.course_calls, 2);
  EXPECT_NE(r.fallback.find("disagreed at [7, 5] x [4, 6, 5], 3 groups from 1, split "), std::string::npos) << r.fallback;
  Tensor want = s.poisoned({7, 6});
  cpu_ops().grouped_matmul(a, std::vector<std::int64_t>{0, 3, 3, 7}, 1, w, true, want);
  const std::vector<float> got = s.download(c), expected = s.download(want);
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0);
}

TEST(CourseOps, WithoutAGroupedKernelTheGroupsGoThroughTheCourseGemm) {
  int calls = 0;
  CourseOps ops(cpu_ops(), nudged_matmul(1e-4f, &calls));
  Side s(ops);
  const std::vector<std::int64_t> offsets{0, 3, 3, 7};  // the middle group empty
  Tensor a = s.upload(random_values(7 * 5, 30), {7, 5}), w = s.upload(random_values(4 * 6 * 5, 31), {4, 6, 5});
  Tensor c = s.poisoned({7, 6}), dw = s.upload(random_values(4 * 6 * 5, 32), {4, 6, 5});
  ops.grouped_matmul(a, offsets, 1, w, true, c);
  ops.grouped_weight_grad(c, a, offsets, 1, dw);
  EXPECT_EQ(calls, 4);  // two non-empty groups, two operations
  EXPECT_EQ(row(ops.table(), "matmul").course_calls, 4);
  EXPECT_EQ(row(ops.table(), "grouped matmul").trusted_calls, 0);
  EXPECT_NE(ops.report().find("one matmul per group, through the matmul row"), std::string::npos) << ops.report();
}

// One Linear layer's backward goes to the compound kernel as a list of one where the adapter has
// it (dy converted once for both products), else to two plain matmul calls.
TEST(CourseOps, OneLinearBackwardIsACompoundCallOfOne) {
  for (const bool compound : {true, false}) {
    SCOPED_TRACE(compound ? "with the compound kernel" : "without it");
    int plain = 0, backward = 0;
    CourseKernels k;
    k.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float al, float be) {
      ++plain;
      cpu_ops().matmul(a, ta, b, tb, c, al, be);
      return true;
    };
    if (compound)
      k.shared_linear_backward = [&](const Tensor& x, std::span<const Tensor* const> ws,
                                     std::span<const Tensor* const> dys, std::span<Tensor* const> dws, Tensor* dx) {
        ++backward;
        cpu_ops().shared_linear_backward(x, ws, dys, dws, dx);
        return true;
      };
    k.names["matmul"] = "test matmul";
    CourseOps ops(cpu_ops(), std::move(k));
    Side s(ops), t;
    const std::vector<float> xv = random_values(6 * 5, 1), wv = random_values(4 * 5, 2), dyv = random_values(6 * 4, 3),
                             old = random_values(4 * 5, 4);
    Tensor x = s.upload(xv, {6, 5}), w = s.upload(wv, {4, 5}), dy = s.upload(dyv, {6, 4});
    Tensor dw = s.upload(old, {4, 5}), dx = s.poisoned({6, 5});
    ops.linear_backward(x, w, dy, &dw, &dx);
    Tensor tx = t.upload(xv, {6, 5}), tw = t.upload(wv, {4, 5}), tdy = t.upload(dyv, {6, 4});
    Tensor tdw = t.upload(old, {4, 5}), tdx = t.tensor({6, 5});
    cpu_ops().matmul(tdy, true, tx, false, tdw, 1.0f, 1.0f);
    cpu_ops().matmul(tdy, false, tw, false, tdx, 1.0f, 0.0f);
    EXPECT_EQ(s.download(dw), t.download(tdw));
    EXPECT_EQ(s.download(dx), t.download(tdx));
    EXPECT_EQ(backward, compound ? 1 : 0);
    EXPECT_EQ(plain, compound ? 0 : 2);
    EXPECT_EQ(row(ops.table(), "matmul").shapes_checked, compound ? 1 : 2);
  }
}

// Linear layers that share an input go to the compound kernels as one call, checked as one shape
// of the matmul row; a compound kernel that is wrong for one of its outputs (dx, or a weight
// gradient) is caught there, its outputs replaced by the trusted ones, and the trusted backend
// takes over the matmul row (the plain products included).
TEST(CourseOps, SharedInputLinearsAreOneCheckedCall) {
  enum class Wrong { nothing, dx, dw };
  for (const Wrong wrong : {Wrong::nothing, Wrong::dx, Wrong::dw}) {
    SCOPED_TRACE(wrong == Wrong::nothing ? "right" : wrong == Wrong::dx ? "dx 10 % off" : "dW 10 % off");
    int forward = 0, backward = 0, plain = 0;
    CourseKernels k;
    k.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float al, float be) {
      ++plain;
      cpu_ops().matmul(a, ta, b, tb, c, al, be);
      return true;
    };
    k.shared_linear_forward = [&](const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) {
      ++forward;
      cpu_ops().shared_linear_forward(x, ws, ys);
      return true;
    };
    k.shared_linear_backward = [&](const Tensor& x, std::span<const Tensor* const> ws,
                                   std::span<const Tensor* const> dys, std::span<Tensor* const> dws, Tensor* dx) {
      ++backward;
      cpu_ops().shared_linear_backward(x, ws, dys, dws, dx);
      if (wrong == Wrong::dx) cpu_ops().scale(*dx, 1.1f);
      if (wrong == Wrong::dw) cpu_ops().scale(*dws[0], 1.1f);
      return true;
    };
    k.names["matmul"] = "test matmul";
    CourseOps ops(cpu_ops(), std::move(k));
    Side s(ops), t;
    const std::vector<float> xv = random_values(6 * 5, 1), w0v = random_values(4 * 5, 2), w1v = random_values(3 * 5, 3),
                             dy0v = random_values(6 * 4, 4), dy1v = random_values(6 * 3, 5), old = random_values(4 * 5, 6);
    Tensor x = s.upload(xv, {6, 5}), w0 = s.upload(w0v, {4, 5}), w1 = s.upload(w1v, {3, 5});
    Tensor dy0 = s.upload(dy0v, {6, 4}), dy1 = s.upload(dy1v, {6, 3});
    const Tensor* ws[] = {&w0, &w1};
    const Tensor* dys[] = {&dy0, &dy1};
    // The trusted results, computed apart: y1 = x·W1ᵀ, dW0 = old + dy0ᵀ·x, dx = dy0·W0 + dy1·W1.
    Tensor tx = t.upload(xv, {6, 5}), tw0 = t.upload(w0v, {4, 5}), tw1 = t.upload(w1v, {3, 5});
    Tensor tdy0 = t.upload(dy0v, {6, 4}), tdy1 = t.upload(dy1v, {6, 3});
    Tensor ty1 = t.tensor({6, 3}), tdw0 = t.upload(old, {4, 5}), tdx = t.tensor({6, 5});
    cpu_ops().matmul(tx, false, tw1, true, ty1, 1.0f, 0.0f);
    cpu_ops().matmul(tdy0, true, tx, false, tdw0, 1.0f, 1.0f);
    cpu_ops().matmul(tdy0, false, tw0, false, tdx, 1.0f, 0.0f);
    cpu_ops().matmul(tdy1, false, tw1, false, tdx, 1.0f, 1.0f);
    for (int step = 0; step < 2; ++step) {
      Tensor y0 = s.poisoned({6, 4}), y1 = s.poisoned({6, 3}), dw0 = s.upload(old, {4, 5}), dx = s.poisoned({6, 5});
      Tensor* ys[] = {&y0, &y1};
      Tensor* dws[] = {&dw0, nullptr};
      ops.shared_linear_forward(x, ws, ys);
      ops.shared_linear_backward(x, ws, dys, dws, &dx);
      // Whatever ran, the results are the trusted ones (the same CPU sums: to the bit).
      EXPECT_EQ(s.download(y1), t.download(ty1)) << "step " << step;
      EXPECT_EQ(s.download(dw0), t.download(tdw0)) << "step " << step;
      EXPECT_EQ(s.download(dx), t.download(tdx)) << "step " << step;
    }
    const auto r = row(ops.table(), "matmul");
    EXPECT_EQ(plain, 0);
    // Checked once, then alone; or, after the backward's failure, the trusted backend's.
    EXPECT_EQ(forward, wrong == Wrong::nothing ? 2 : 1);
    EXPECT_EQ(backward, wrong == Wrong::nothing ? 2 : 1);
    if (wrong == Wrong::nothing) {
      EXPECT_EQ(r.shapes_checked, 2);
      EXPECT_TRUE(r.fallback.empty()) << r.fallback;
    } else {
      EXPECT_NE(r.fallback.find("disagreed"), std::string::npos) << r.fallback;
      // The failed call's trusted result; after it the compound calls go straight to the trusted
      // backend's fused forms, not counted in the row.
      EXPECT_EQ(r.trusted_calls, 1);
    }
  }
}

// A whole training run whose kernels are the CPU backend's own (the compound GEMMs of Linear layers
// that share an input included): the loss is the trusted run's to the bit.
TEST(CourseOps, TrainingThroughCourseKernelsThatAreTheTrustedOnesChangesNoBit) {
  TrainConfig c;
  c.model = ModelConfig::tiny();
  c.steps = 3, c.batch = 2;
  MarkovSource source(5, c.model.vocab, 4);
  const std::vector<std::uint16_t> tokens = source.sample(20000);
  const auto v = static_cast<std::uint32_t>(c.model.vocab);
  Ops& cpu = cpu_ops();
  CourseKernels k;
  k.matmul = [&](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& cc, float al, float be) {
    cpu.matmul(a, ta, b, tb, cc, al, be);
    return true;
  };
  k.shared_linear_forward = [&](const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> ys) {
    cpu.shared_linear_forward(x, ws, ys);
    return true;
  };
  k.shared_linear_backward = [&](const Tensor& x, std::span<const Tensor* const> ws, std::span<const Tensor* const> dys,
                                 std::span<Tensor* const> dws, Tensor* dx) {
    cpu.shared_linear_backward(x, ws, dys, dws, dx);
    return true;
  };
  k.rmsnorm_forward = [&](const Tensor& x, const Tensor& g, float eps, Tensor& y, Tensor& r) {
    cpu.rmsnorm_forward(x, g, eps, y, r);
    return true;
  };
  k.rmsnorm_backward = [&](const Tensor& x, const Tensor& g, const Tensor& r, const Tensor& dy, const Tensor* res,
                           Tensor& dx, Tensor& dg) {
    if (res) cpu.rmsnorm_backward_add(x, g, r, dy, *res, dx, dg);
    else cpu.rmsnorm_backward(x, g, r, dy, dx, dg);
    return true;
  };
  k.attention_forward = [&](const AttentionShape& s, const Tensor& q, const Tensor& kk, const Tensor& vv, Tensor& o,
                            Tensor& lse) {
    cpu.attention_forward(s, q, kk, vv, o, lse);
    return true;
  };
  CourseOps course(cpu, std::move(k));
  auto make = [&](Ops& ops) {
    return Trainer(c, ops, TokenLoader(tokens, v, {c.model.seq_len, c.batch, 0, 1, 5}),
                   TokenLoader(tokens, v, {c.model.seq_len, c.batch, 0, 1, 6}));
  };
  Trainer trusted = make(cpu), through = make(course);
  for (int i = 0; i < c.steps; ++i) {
    const double want = trusted.step().loss, got = through.step().loss;
    EXPECT_EQ(got, want) << "step " << i;
  }
  for (const auto& r : course.table()) {
    if (r.op == "rope" || r.op == "attention backward" || r.op.starts_with("grouped")) continue;  // no kernel given
    EXPECT_GT(r.course_calls, 0) << r.op;
    EXPECT_EQ(r.trusted_calls, 0) << r.op;
    EXPECT_TRUE(r.fallback.empty()) << r.op << ": " << r.fallback;
  }
}

}  // namespace
}  // namespace k2c::model
