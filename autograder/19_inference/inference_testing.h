// autograder/19_inference/inference_testing.h — what the tests of module 19 share: host data and
// its comparisons, the served model (a Side of k2c/model/testing.h), the cache filled from
// seeds, attention in double on the host, the engine driven to completion, and the fixture.
// Included by test_inference.cpp (parts A–D) and test_inference_serving.cpp (E, F and speed).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "inference.h"
#include "k2c/core/random.h"
#include "k2c/dist/testing.h"
#include "k2c/model/testing.h"
#include "k2c/model/transformer.h"
#include "k2c/model/work_counter.h"
#include "k2c/reference/reference.h"
#include "k2c/testing/compare.h"
#include "k2c/testing/testing.h"

namespace k2c::inference_testing {

namespace kd = k2c::dist;
namespace km = k2c::model;
namespace inf = k2c::inference;
using k2c::dist::testing::world;
using k2c::model::testing::Side;  // a backend (the CPU one unless told), ledger, parameters, context

// ---------------------------------------------------------------------------------------------
// host data, comparisons

using k2c::dist::testing::Host;         // k2c/dist/testing.h, as random_host: inputs from the
using k2c::dist::testing::random_host;  // run's seed, the same on every rank
using Ids = std::vector<std::int32_t>;
constexpr std::uint64_t kWeightSeed = 19;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline std::vector<double> widen(const Host& v) { return std::vector<double>(v.begin(), v.end()); }

inline double largest(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// got within atol + rtol·|want| everywhere (NaN fails), with the compare report on failure.
inline void expect_near(const Host& got, const std::vector<double>& want, double atol, double rtol, const std::string& what) {
  const k2c::CompareReport r = k2c::compare(got, want, {atol, rtol, 1e30});
  EXPECT_TRUE(r.ok) << what << ": " << r.summary();
}

// Exactly equal (the "bit for bit" of the contract; NaN never equals).
inline void expect_bits(const Host& got, const Host& want, const std::string& what) { expect_near(got, widen(want), 0, 0, what); }

// The served model: small, with grouped-query heads (2 query heads per key-value head).
inline km::ModelConfig serving_model() {
  km::ModelConfig m;
  m.vocab = 61;
  m.d_model = 32;
  m.n_layers = 2;
  m.q_heads = 4;
  m.kv_heads = 2;
  m.d_ff = 40;
  m.seq_len = 40;
  m.init_std = 0.3f;  // logits far enough apart that a greedy choice is rarely a near tie
  return m;
}

// A model's parameters, materialized from the test's weight seed, and an engine over them.
struct Served : Side {
  km::ModelConfig model;
  km::Transformer transformer;
  explicit Served(const km::ModelConfig& m, km::Ops& ops = km::cpu_ops()) : Side(ops), model(m), transformer(params, m) {
    materialize(kWeightSeed);
    // The blocks' matrices start at std 0.02, which leaves the residual stream to the embedding
    // and makes the next token almost a function of the current one. At std 0.3 attention
    // decides: a wrong key or value anywhere in the cache changes what is generated.
    for (km::ParamId id = 0; id < params.size(); ++id)
      if (params.info(id).name.rfind("blocks.", 0) == 0 && params.info(id).shape.rank == 2)
        ctx.ops.scale(params.value(id), 15.0f);
  }
  // Logits [seq_len, vocab] of the model over `tokens` (padded: causal, so the pad changes nothing
  // before it).
  Host recompute(Ids tokens) {
    tokens.resize(static_cast<std::size_t>(model.seq_len), 0);
    km::Transformer::Saved saved;
    transformer.forward(ctx, upload_ids(tokens), 1, false, saved);
    return download(saved.logits);
  }
};

inline Host row_of(const Host& m, std::int64_t cols, std::int64_t r) {
  return Host(m.begin() + r * cols, m.begin() + (r + 1) * cols);
}

// Fills every position of a sequence in every layer with random keys and values, returns them as
// host [length, kv_heads·head_dim] per layer: K then V.
struct Stored {
  std::vector<Host> k, v;  // per layer
};
inline Stored fill_sequence(Side& s, inf::PagedKvCache& cache, int seq, const std::string& tag) {
  const inf::CacheConfig& c = cache.config();
  const std::int64_t L = cache.length(seq), cols = static_cast<std::int64_t>(c.kv_heads) * c.head_dim;
  Stored out;
  for (int l = 0; l < c.layers; ++l) {
    out.k.push_back(random_host(L * cols, tag + "/k" + std::to_string(l)));
    out.v.push_back(c.shared_values ? out.k.back() : random_host(L * cols, tag + "/v" + std::to_string(l)));
    const km::Tensor k = s.upload(out.k.back(), {L, cols}), v = s.upload(out.v.back(), {L, cols});
    cache.write(s.ctx, l, seq, 0, k, v);
  }
  return out;
}

inline Host to_float(const std::vector<double>& v) { return Host(v.begin(), v.end()); }

// Rows [tokens, heads·hd] (the library's layout) as [heads][tokens][hd] (the reference's).
inline Host heads_major(const Host& x, std::int64_t tokens, int heads, int hd) {
  Host out(x.size());
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      std::copy_n(x.begin() + (t * heads + h) * hd, hd, out.begin() + (h * tokens + t) * hd);
  return out;
}

// The attention of one query (Hq heads of hd) over L keys and values (rows [L, Hkv·hd]): the
// course's double-precision reference (k2c/reference/reference.h).
inline std::vector<double> attend_host(const Host& q, const Host& k, const Host& v, std::int64_t L, int Hq, int Hkv, int hd) {
  const k2c::ref::AttentionShape shape{1, Hq, Hkv, 1, static_cast<int>(L), hd, false, 1.0 / std::sqrt(double(hd))};
  return k2c::ref::attention_forward(q, heads_major(k, L, Hkv, hd), heads_major(v, L, Hkv, hd), shape).o;
}

// The cache's invariants: tables as long as the lengths say, pages distinct and in range, and
// free + used + reserved-unused = all pages.
inline void expect_consistent(const inf::PagedKvCache& cache, const std::vector<int>& live, const std::string& when) {
  const inf::CacheConfig& c = cache.config();
  std::set<int> seen;
  std::int64_t used = 0, reserved = 0;
  for (int s : live) {
    ASSERT_TRUE(cache.contains(s)) << when << ": sequence " << s << " is gone";
    const std::vector<int>& table = cache.page_table(s);
    EXPECT_EQ(static_cast<std::int64_t>(table.size()), inf::pages_for(cache.length(s), c.page_size))
        << when << ": sequence " << s << " of length " << cache.length(s);
    for (int p : table) {
      EXPECT_TRUE(p >= 0 && p < c.pages) << when << ": page " << p;
      EXPECT_TRUE(seen.insert(p).second) << when << ": page " << p << " held twice";
    }
    for (std::int64_t t = 0; t < cache.length(s); ++t)
      ASSERT_EQ(cache.slot(s, t), std::int64_t{table[t / c.page_size]} * c.page_size + t % c.page_size)
          << when << ": slot of position " << t << " of sequence " << s;
    used += static_cast<std::int64_t>(table.size());
    reserved += inf::pages_for(cache.capacity(s), c.page_size) - static_cast<std::int64_t>(table.size());
  }
  EXPECT_EQ(cache.used_pages(), used) << when;
  EXPECT_EQ(cache.sequences(), static_cast<int>(live.size())) << when;
  EXPECT_EQ(cache.free_pages() + used + reserved, c.pages) << when << ": free + used + reserved";
}

// ---------------------------------------------------------------------------------------------
// fixtures

// Correctness runs on the CPU backend, whose tensors are host memory: the MPI runs'.
class Inference : public kd::testing::CpuModelTest {};


// ---------------------------------------------------------------------------------------------
// the engine, driven

// What the engine generated: per request, its tokens and the logits of every step.
struct Generated {
  std::vector<Ids> tokens;
  std::vector<std::vector<Host>> logits;
};

// Room the work checks leave: the reference engine's decode calls, and MLA's absorbed decode
// (test_inference.cpp), do exactly their allowance's work without it (0.8 of it with); its
// prefills stay under prefill_allowance's.
inline constexpr double kWorkSlack = 1.25;

// The products a model does for one token (one row through every block and the head: 2 FLOPs a
// weight), without attention.
inline double token_flops(const km::ModelConfig& m) {
  const double hd = static_cast<double>(m.d_model) / m.q_heads, kv = m.kv_heads * hd;
  const double block = 2.0 * m.d_model * m.d_model + 2.0 * kv * m.d_model + 3.0 * m.d_ff * m.d_model;
  return 2.0 * (m.n_layers * block + static_cast<double>(m.vocab) * m.d_model);
}

// The products one decode call may do: for each of its sequences, the matrices once and attention
// of one query over its cached positions (4·d a position and layer), with kWorkSlack of room.
// Recomputing the sequence instead, as a decode without its cache would, does the matrices once
// per position.
inline double decode_allowance(const km::ModelConfig& m, const std::vector<std::int64_t>& lengths) {
  double allowed = 0;
  for (std::int64_t length : lengths)
    allowed += token_flops(m) + 4.0 * m.n_layers * m.d_model * static_cast<double>(length);
  return kWorkSlack * allowed;
}

// The products a prefill of `length` tokens may do, in parts of any size: the matrices once a
// token, attention of each query over at most every position (4·d a pair and layer), kWorkSlack of
// room.
inline double prefill_allowance(const km::ModelConfig& m, std::int64_t length) {
  const double n = static_cast<double>(length);
  return kWorkSlack * (n * token_flops(m) + 4.0 * m.n_layers * m.d_model * n * n);
}

// One decode call's products, as the WorkCounter under the engine's backend counted them, and its
// sequences' lengths after it.
struct DecodeCall {
  double flops = 0;
  std::vector<std::int64_t> lengths;
};

// Prompts prefilled together, then decode steps of every request not yet done, until request i
// has outputs[i] tokens. With `counter` (the engine's backend, counting) each decode call's work
// goes to `calls`.
inline Generated generate(inf::Engine& engine, Side& s, const std::vector<Ids>& prompts, const std::vector<int>& outputs,
                          const km::WorkCounter* counter = nullptr, std::vector<DecodeCall>* calls = nullptr) {
  const std::size_t n = prompts.size();
  const std::int64_t V = engine.model().vocab;
  Generated g;
  g.tokens.resize(n);
  g.logits.resize(n);
  std::vector<int> seqs;
  for (std::size_t i = 0; i < n; ++i) seqs.push_back(engine.cache().create(std::int64_t(prompts[i].size()) + outputs[i] - 1));
  inf::Step step = engine.prefill(seqs, prompts);
  std::vector<std::size_t> who(n);
  for (std::size_t i = 0; i < n; ++i) who[i] = i;
  for (;;) {
    const Host logits = s.download(step.logits);
    for (std::size_t k = 0; k < who.size(); ++k) {
      g.tokens[who[k]].push_back(step.tokens[k]);
      g.logits[who[k]].push_back(row_of(logits, V, static_cast<std::int64_t>(k)));
    }
    std::vector<int> active;
    Ids last;
    who.clear();
    for (std::size_t i = 0; i < n; ++i)
      if (static_cast<int>(g.tokens[i].size()) < outputs[i]) {
        active.push_back(seqs[i]);
        last.push_back(g.tokens[i].back());
        who.push_back(i);
      }
    if (active.empty()) break;
    const double before = counter ? counter->flops() : 0.0;
    step = engine.decode(active, last);
    if (counter && calls) {
      DecodeCall c{counter->flops() - before, {}};
      for (int seq : active) c.lengths.push_back(engine.cache().length(seq));
      calls->push_back(std::move(c));
    }
  }
  for (int seq : seqs) engine.cache().release(seq);
  return g;
}

inline Ids random_prompt(std::size_t length, int vocab, const std::string& purpose) {
  const std::uint64_t seed = k2c::testing::seed_for(purpose);
  Ids p(length);
  for (std::size_t i = 0; i < length; ++i)
    p[i] = std::min(vocab - 1, static_cast<int>(k2c::uniform_at(seed, i, 0.0f, 1.0f) * static_cast<float>(vocab)));
  return p;
}


}  // namespace k2c::inference_testing
