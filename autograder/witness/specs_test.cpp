// specs_test.cpp — k2c_witness_specs_test: what of the witnesses (specs.h) needs no device, on the
// CPU. Every witness's launches fit the protocol's greeting (k2c/testing/witness.h). Module 09's
// backward check: the rows of dq, dk and dv an honest backward pass would write, made by the CPU
// reference from the inputs a launch's seed gives and the o and lse of a forward pass, pass it; one
// element moved by an eighth, the wrong D, or a dk without its dv, fail it.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "k2c/reference/reference.h"
#include "k2c/testing/witness.h"
#include "specs.h"

namespace ws = k2c::witness_specs;
namespace ref = k2c::ref;

namespace {

float round_bf16(double x) { return __bfloat162float(__float2bfloat16(static_cast<float>(x))); }

// One launch at a small shape: its inputs, the forward pass's rows, and every piece of the
// outputs the check takes, as bytes.
struct Launch {
  ws::Shape shape;
  std::uint64_t seed = 0;
  ws::AttentionRows rows;
  std::vector<ws::Range> ranges;
  std::vector<std::vector<char>> bytes;

  Launch(ws::Shape s, std::uint64_t seed_) : shape(std::move(s)), seed(seed_) {
    const int batch = int(shape[0]), heads = int(shape[1]), kv_heads = int(shape[2]), q_len = int(shape[3]),
              kv_len = int(shape[4]), d = int(shape[5]);
    const ref::AttentionShape a{batch, heads, kv_heads, q_len, kv_len, d, shape[6] != 0,
                                1.0f / std::sqrt(static_cast<float>(d))};
    const std::size_t nq = std::size_t(batch) * heads * q_len * d, nkv = std::size_t(batch) * kv_heads * kv_len * d;
    std::vector<float> q(nq), k(nkv), v(nkv), dout(nq);
    for (std::size_t i = 0; i < nq; ++i) q[i] = ws::attention_input(seed, 0, i), dout[i] = ws::attention_input(seed, 4, i);
    for (std::size_t i = 0; i < nkv; ++i) k[i] = ws::attention_input(seed, 1, i), v[i] = ws::attention_input(seed, 2, i);
    // The forward pass: o rounded to bf16 as the checker's is, lse in fp32, then D and e.
    const ref::AttentionForward f = ref::attention_forward(q, k, v, a);
    std::vector<float> o(nq);
    for (std::size_t i = 0; i < nq; ++i) o[i] = round_bf16(f.o[i]);
    for (double l : f.lse) rows.lse.push_back(static_cast<float>(l));
    for (std::size_t r = 0; r < rows.lse.size(); ++r) {
      double D = 0, e = 0;
      for (int c = 0; c < d; ++c) D += double(dout[r * d + c]) * o[r * d + c], e += std::abs(double(dout[r * d + c]) * o[r * d + c]);
      rows.D.push_back(D);
      rows.e.push_back(e);
    }
    auto piece = [&](std::uint32_t buffer, std::size_t row, const std::vector<double>& values) {
      std::vector<char> b(d * sizeof(__nv_bfloat16));
      for (int c = 0; c < d; ++c) {
        const __nv_bfloat16 x = __float2bfloat16(static_cast<float>(values[c]));
        std::memcpy(b.data() + c * sizeof x, &x, sizeof x);
      }
      ranges.push_back({buffer, row * b.size(), b.size()});
      bytes.push_back(std::move(b));
    };
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < q_len; ++i)
          piece(6, (std::size_t(b) * heads + h) * q_len + i,
                ref::attention_query_gradient_at(q, k, v, o, dout, rows.lse, a, b, h, i).dq);
    for (int b = 0; b < batch; ++b)
      for (int g = 0; g < kv_heads; ++g)
        for (int j = 0; j < kv_len; ++j) {
          const ref::AttentionRowGradient r = ref::attention_key_gradient_at(q, k, v, o, dout, rows.lse, a, b, g, j);
          const std::size_t row = (std::size_t(b) * kv_heads + g) * kv_len + j;
          piece(7, row, r.dk);
          piece(8, row, r.dv);
        }
  }

  std::string check() const {
    std::vector<const char*> p;
    for (const auto& b : bytes) p.push_back(b.data());
    return ws::check_attention_backward(shape, seed, rows, ranges, p);
  }
  // The largest element of piece `at` times `factor`; returns its column.
  int scale(std::size_t at, float factor) {
    const int d = static_cast<int>(shape[5]);
    auto read = [&](int c) {
      __nv_bfloat16 x;
      std::memcpy(&x, bytes[at].data() + c * sizeof x, sizeof x);
      return __bfloat162float(x);
    };
    int top = 0;
    for (int c = 1; c < d; ++c)
      if (std::abs(read(c)) > std::abs(read(top))) top = c;
    const __nv_bfloat16 x = __float2bfloat16(read(top) * factor);
    std::memcpy(bytes[at].data() + top * sizeof x, &x, sizeof x);
    return top;
  }
};

}  // namespace

// The greeting holds kMaxBuffers buffer offsets and kMaxShape dimensions: a spec past either
// would be refused by the test program, an honest one included.
TEST(WitnessSpecs, EveryLaunchFitsTheGreeting) {
  std::mt19937_64 rng(1);
  ASSERT_GE(ws::all().size(), 14u);
  for (const ws::Witness& w : ws::all()) {
    std::vector<ws::Shape> shapes = {w.timed};
    for (int i = 0; i < 5; ++i) shapes.push_back(w.draw(rng));
    for (const ws::Shape& shape : shapes) {
      const ws::Spec spec = w.make(shape);
      EXPECT_GE(spec.buffers.size(), 1u) << w.name;
      EXPECT_LE(spec.buffers.size(), static_cast<std::size_t>(k2c::witness::kMaxBuffers)) << w.name;
      EXPECT_LE(spec.shape.size(), static_cast<std::size_t>(k2c::witness::kMaxShape)) << w.name;
      EXPECT_EQ(spec.name, w.name);
    }
  }
  EXPECT_NE(ws::find("attention_backward"), nullptr);
  EXPECT_EQ(ws::find("attention_backward_hopper")->make(ws::find("attention_backward_hopper")->timed).buffers.size(), 9u);
}

TEST(WitnessSpecs, AttentionBackwardCheckPassesHonestRows) {
  // Causal with fewer queries than keys and grouped heads; then more queries than keys (the first
  // queries see no key); then full attention at head_dim 128.
  for (const ws::Shape& s : {ws::Shape{2, 4, 2, 9, 13, 64, 1}, ws::Shape{1, 3, 1, 11, 5, 64, 1}, ws::Shape{1, 2, 2, 7, 7, 128, 0}}) {
    const Launch l(s, 0x5EED + s[3]);
    EXPECT_EQ(l.check(), "") << "shape " << s[1] << " heads, " << s[3] << " x " << s[4];
  }
}

TEST(WitnessSpecs, AttentionBackwardCheckFindsWrongRows) {
  const ws::Shape s{2, 4, 2, 9, 13, 64, 1};
  const std::size_t q_rows = 2 * 4 * 9;
  // The largest element of a row moved by an eighth: far past the bound (2^-8 of the terms).
  {
    Launch l(s, 7);
    const int c = l.scale(5, 1.125f);  // dq of query row 5
    EXPECT_EQ(l.check().rfind("dq[row 5][" + std::to_string(c) + "]", 0), 0u) << l.check();
  }
  {
    Launch l(s, 7);
    const int c = l.scale(q_rows + 2 * 20, 0.875f);  // dk of kv row 20
    EXPECT_EQ(l.check().rfind("dk[row 20][" + std::to_string(c) + "]", 0), 0u) << l.check();
  }
  {
    Launch l(s, 7);
    const int c = l.scale(q_rows + 2 * 20 + 1, -1.0f);  // its dv, sign flipped
    EXPECT_EQ(l.check().rfind("dv[row 20][" + std::to_string(c) + "]", 0), 0u) << l.check();
  }
  {
    Launch l(s, 7);  // the rows of a forward pass on other inputs
    for (double& D : l.rows.D) D += 0.1;
    EXPECT_NE(l.check(), "");
  }
  {
    Launch l(s, 7);
    l.ranges.pop_back();  // the last dk without its dv
    l.bytes.pop_back();
    EXPECT_EQ(l.check(), "a piece of dk without its dv");
  }
  Launch l(s, 7);
  l.rows.lse.pop_back();
  EXPECT_THROW(l.check(), std::invalid_argument);
}
