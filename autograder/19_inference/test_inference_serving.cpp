// autograder/19_inference/test_inference_serving.cpp — tests of module 19 (contract: inference.h),
// parts E and F: continuous batching against a schedule simulated here under the same cost model,
// and prefill/decode disaggregation on 2 ranks against co-located serving, bit for bit; then the
// speed test of decode attention on the GPU backend (NCCL). The references and tolerances are
// those listed at the top of test_inference.cpp.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "inference_testing.h"
#include "k2c/dist/counting.h"
#include "k2c/model/backend.h"
#include "step_cost.h"

using namespace k2c::inference_testing;  // the shared helpers and the fixture

// =============================================================================================
// Part E: continuous batching

namespace {

// The schedules run under step_cost (step_cost.h, which k2c_inference --cost shares).
inf::ServeConfig cost_config(int max_batch) { return {max_batch, step_cost}; }

// The schedule the contract describes, simulated on the host for a trace of valid requests:
// first-token and finish times per request, and the step counts.
struct Schedule {
  std::vector<double> first, finish;
  int prefills = 0, decodes = 0;
};
Schedule simulate(const std::vector<inf::Request>& trace, int pages, int page_size, int max_batch) {
  const std::size_t n = trace.size();
  Schedule out;
  out.first.assign(n, kNaN);
  out.finish.assign(n, kNaN);
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return trace[a].arrival_s < trace[b].arrival_s; });
  auto context = [&](std::size_t i) { return std::int64_t(trace[i].prompt.size()) + trace[i].output_len - 1; };
  struct Live {
    std::size_t i;
    std::int64_t length;
    int produced;
  };
  std::deque<std::size_t> waiting;
  std::vector<Live> running;
  std::size_t next = 0;
  int free = pages;
  double clock = 0;
  for (;;) {
    for (; next < n && trace[order[next]].arrival_s <= clock; ++next) waiting.push_back(order[next]);
    std::vector<std::size_t> admitted;
    while (!waiting.empty() && int(running.size() + admitted.size()) < max_batch &&
           inf::pages_for(context(waiting.front()), page_size) <= free) {
      free -= static_cast<int>(inf::pages_for(context(waiting.front()), page_size));
      admitted.push_back(waiting.front());
      waiting.pop_front();
    }
    if (!admitted.empty()) {
      inf::StepInfo s{inf::StepInfo::Kind::prefill, int(admitted.size()), 0, 0, 0};
      for (std::size_t i : admitted) s.tokens += std::int64_t(trace[i].prompt.size());
      clock += step_cost(s);
      ++out.prefills;
      for (std::size_t i : admitted) {
        out.first[i] = clock;
        if (trace[i].output_len == 1) {
          out.finish[i] = clock;
          free += static_cast<int>(inf::pages_for(context(i), page_size));
        } else {
          running.push_back({i, std::int64_t(trace[i].prompt.size()), 1});
        }
      }
    } else if (!running.empty()) {
      inf::StepInfo s{inf::StepInfo::Kind::decode, int(running.size()), std::int64_t(running.size()), 0, 0};
      for (const Live& r : running) s.context += r.length;
      clock += step_cost(s);
      ++out.decodes;
      std::vector<Live> still;
      for (Live r : running) {
        ++r.length;
        if (++r.produced == trace[r.i].output_len) {
          out.finish[r.i] = clock;
          free += static_cast<int>(inf::pages_for(context(r.i), page_size));
        } else {
          still.push_back(r);
        }
      }
      running = still;
    } else if (next < n) {
      clock = std::max(trace[order[next]].arrival_s, clock);
    } else {
      break;
    }
  }
  return out;
}

std::vector<inf::Request> trace_of(int count, double rate, int max_output, const km::ModelConfig& m, std::uint64_t seed) {
  inf::TraceConfig c;
  c.count = count;
  c.rate = rate;
  c.min_prompt = 2;
  c.max_prompt = 18;
  c.min_output = 1;
  c.max_output = max_output;
  c.vocab = m.vocab;
  c.seed = seed;
  return inf::make_trace(c);
}

void expect_same_outputs(const inf::ServeReport& got, const inf::ServeReport& want, bool times, const std::string& what) {
  ASSERT_EQ(got.results.size(), want.results.size()) << what;
  for (std::size_t i = 0; i < got.results.size(); ++i) {
    const inf::RequestResult &g = got.results[i], &w = want.results[i];
    EXPECT_EQ(g.id, w.id) << what;
    EXPECT_EQ(g.ok, w.ok) << what << ": request " << g.id << (g.ok ? "" : ": " + g.error);
    EXPECT_EQ(g.tokens, w.tokens) << what << ": request " << g.id << "'s tokens";
    if (times) {
      EXPECT_NEAR(g.first_token_s, w.first_token_s, 1e-9) << what << ": request " << g.id;
      EXPECT_NEAR(g.finish_s, w.finish_s, 1e-9) << what << ": request " << g.id;
    }
  }
}

// Every request of a trace of valid requests served, and its tokens the model's greedy choices:
// the serving tests compare reports with each other, and two reports of a serve() that never ran
// the engine would agree. Each request's prompt and tokens (but the last) are recomputed in one
// forward pass of the library's model; a token must be that pass's largest logit wherever the
// largest is clearly the largest (as DecodeMatchesRecompute holds it).
void expect_greedy(Served& s, const std::vector<inf::Request>& trace, const inf::ServeReport& r, const std::string& what) {
  ASSERT_EQ(r.results.size(), trace.size()) << what << ": one result per request";
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const inf::Request& q = trace[i];
    const inf::RequestResult& res = r.results[i];
    const std::string at = what + ": request " + std::to_string(q.id);
    ASSERT_EQ(res.id, q.id) << at << ": results in trace order";
    ASSERT_TRUE(res.ok) << at << " was not served: " << res.error;
    ASSERT_EQ(static_cast<int>(res.tokens.size()), q.output_len) << at << "'s token count";
    Ids fed = q.prompt;
    fed.insert(fed.end(), res.tokens.begin(), res.tokens.end() - 1);
    const Host logits = s.recompute(fed);
    for (int j = 0; j < q.output_len; ++j) {
      const Host row = row_of(logits, s.model.vocab, static_cast<std::int64_t>(q.prompt.size()) - 1 + j);
      Host sorted = row;
      std::sort(sorted.rbegin(), sorted.rend());
      const auto best = std::max_element(row.begin(), row.end()) - row.begin();
      if (sorted[0] - sorted[1] > 1e-3 * largest(widen(row)) && res.tokens[static_cast<std::size_t>(j)] != best) {
        ADD_FAILURE() << at << ", token " << j << ": " << res.tokens[static_cast<std::size_t>(j)]
                      << ", not the largest logit's " << best;
        break;  // the later tokens follow from this one
      }
    }
  }
}

}  // namespace

TEST_F(Inference, BatchingMatchesOneAtATime) {
  const km::ModelConfig m = serving_model();
  Served s(m);
  inf::Engine engine(s.ctx, m, 40, 4, 6);
  const std::vector<inf::Request> trace = trace_of(10, 50.0, 9, m, k2c::testing::seed_for("trace"));
  const inf::ServeReport batched = inf::serve(engine, trace, cost_config(4));
  EXPECT_GT(batched.decode_steps, 0);
  expect_greedy(s, trace, batched, "batched");
  for (std::size_t i = 0; i < trace.size(); ++i) {
    inf::Request alone = trace[i];
    alone.arrival_s = 0;
    const inf::ServeReport one = inf::serve(engine, {alone}, cost_config(1));
    ASSERT_EQ(one.results.size(), 1u);
    ASSERT_TRUE(batched.results[i].ok) << "request " << trace[i].id << ": " << batched.results[i].error;
    EXPECT_EQ(batched.results[i].tokens, one.results[0].tokens)
        << "request " << trace[i].id << " generated other tokens in company than alone";
    EXPECT_EQ(static_cast<int>(one.results[0].tokens.size()), trace[i].output_len);
  }
}

TEST_F(Inference, BatchingMetricsUnderCostModel) {
  const km::ModelConfig m = serving_model();
  Served s(m);
  // Small enough that requests wait for pages as well as for batch slots.
  const int pages = 14, page = 4;
  inf::Engine engine(s.ctx, m, pages, page, 5);
  for (int max_batch : {1, 3, 8}) {
    SCOPED_TRACE("max_batch " + std::to_string(max_batch));
    const std::vector<inf::Request> trace = trace_of(12, 40.0, 10, m, k2c::testing::seed_for("trace"));
    const inf::ServeReport r = inf::serve(engine, trace, cost_config(max_batch));
    const Schedule want = simulate(trace, pages, page, max_batch);
    expect_greedy(s, trace, r, "max_batch " + std::to_string(max_batch));
    EXPECT_EQ(r.prefill_steps, want.prefills);
    EXPECT_EQ(r.decode_steps, want.decodes);
    std::vector<double> ttft, tpot;
    double first = 1e300, last = -1e300, tokens = 0;
    for (std::size_t i = 0; i < trace.size(); ++i) {
      const inf::RequestResult& res = r.results[i];
      ASSERT_TRUE(res.ok) << res.error;
      EXPECT_EQ(static_cast<int>(res.tokens.size()), trace[i].output_len);
      EXPECT_NEAR(res.first_token_s, want.first[i], 1e-9) << "request " << trace[i].id << "'s first token";
      EXPECT_NEAR(res.finish_s, want.finish[i], 1e-9) << "request " << trace[i].id << "'s end";
      EXPECT_DOUBLE_EQ(res.arrival_s, trace[i].arrival_s);
      ttft.push_back(want.first[i] - trace[i].arrival_s);
      if (trace[i].output_len >= 2) tpot.push_back((want.finish[i] - want.first[i]) / (trace[i].output_len - 1));
      first = std::min(first, trace[i].arrival_s);
      last = std::max(last, want.finish[i]);
      tokens += trace[i].output_len;
    }
    EXPECT_NEAR(r.ttft_p50, inf::percentile(ttft, 50), 1e-9);
    EXPECT_NEAR(r.ttft_p99, inf::percentile(ttft, 99), 1e-9);
    EXPECT_NEAR(r.tpot_p50, inf::percentile(tpot, 50), 1e-9);
    EXPECT_NEAR(r.tpot_p99, inf::percentile(tpot, 99), 1e-9);
    EXPECT_NEAR(r.throughput, tokens / (last - first), 1e-6 * r.throughput);
    EXPECT_GE(r.peak_pages, 1);
    EXPECT_LE(r.peak_pages, pages);
  }
}

TEST_F(Inference, BadRequestsRejected) {
  const km::ModelConfig m = serving_model();
  Served s(m);
  inf::Engine engine(s.ctx, m, 9, 4, 5);  // 36 tokens of cache: a context of 37 to 40 fits the model, not the cache
  const std::vector<inf::Request> good = trace_of(6, 30.0, 6, m, k2c::testing::seed_for("trace"));
  std::vector<inf::Request> mixed = good;
  auto bad = [&](int id, double at, Ids prompt, int output) { mixed.push_back({id, at, std::move(prompt), output}); };
  const double mid = good[2].arrival_s;
  bad(100, mid, {}, 3);                                                  // no prompt
  bad(101, mid, random_prompt(5, m.vocab, "p101"), 0);                   // nothing to generate
  bad(102, 0.0, random_prompt(m.seq_len, m.vocab, "p102"), 2);           // longer than the context
  bad(103, good[4].arrival_s, {1, 2, m.vocab, 3}, 2);                    // a token the model does not have
  bad(104, mid, random_prompt(30, m.vocab, "p104"), 8);                  // 37 tokens: 10 pages of 9
  std::stable_sort(mixed.begin(), mixed.end(), [](auto& a, auto& b) { return a.arrival_s < b.arrival_s; });
  const inf::ServeReport with = inf::serve(engine, mixed, cost_config(3));
  const inf::ServeReport without = inf::serve(engine, good, cost_config(3));
  inf::ServeReport kept;
  for (const inf::RequestResult& r : with.results) {
    if (r.id < 100) {
      kept.results.push_back(r);
      continue;
    }
    EXPECT_FALSE(r.ok) << "request " << r.id << " should have been rejected";
    EXPECT_TRUE(r.tokens.empty()) << "request " << r.id;
    EXPECT_NE(r.error.find("request " + std::to_string(r.id)), std::string::npos)
        << "the error should name the request: '" << r.error << "'";
    EXPECT_NE(r.error.find_first_of("0123456789", r.error.find(std::to_string(r.id)) + 3), std::string::npos)
        << "the error should name the offending values: '" << r.error << "'";
  }
  expect_greedy(s, good, without, "the good requests alone");
  expect_same_outputs(kept, without, true, "the good requests with bad ones among them");
  EXPECT_EQ(engine.cache().used_pages(), 0);

  // The engine itself refuses what it cannot run, before touching the cache.
  const int seq = engine.cache().create(8);
  EXPECT_THROW(engine.prefill({seq}, {Ids{}}), std::invalid_argument);
  EXPECT_THROW(engine.prefill({seq}, {Ids{1, -1}}), std::invalid_argument);
  EXPECT_THROW(engine.prefill({seq}, {Ids(9, 1)}), std::length_error);
  EXPECT_EQ(engine.cache().length(seq), 0);
  engine.prefill({seq}, {Ids{1, 2, 3}});
  EXPECT_THROW(engine.decode({seq}, {m.vocab}), std::invalid_argument);
  EXPECT_THROW(engine.decode({seq, seq}, {1, 2}), std::invalid_argument);
  EXPECT_EQ(engine.cache().length(seq), 3);
  engine.cache().release(seq);
  km::ModelConfig moe = m;
  moe.experts = 4;
  moe.d_expert = 16;
  EXPECT_THROW(inf::Engine(s.ctx, moe, 9, 4, 5), std::invalid_argument) << "a model with experts";
}

TEST_F(Inference, PagesReturnedAfterTrace) {
  const km::ModelConfig m = serving_model();
  Served s(m);
  const int pages = 10;
  inf::Engine engine(s.ctx, m, pages, 4, 3);
  std::vector<inf::Request> trace = trace_of(10, 0.0, 9, m, k2c::testing::seed_for("trace"));  // all at once
  const inf::ServeReport first = inf::serve(engine, trace, cost_config(6));
  expect_greedy(s, trace, first, "ten requests at once");
  EXPECT_EQ(engine.cache().used_pages(), 0);
  EXPECT_EQ(engine.cache().free_pages(), pages);
  EXPECT_EQ(engine.cache().sequences(), 0);
  EXPECT_GE(first.peak_pages, 1);
  EXPECT_LE(first.peak_pages, pages);
  const inf::ServeReport again = inf::serve(engine, trace, cost_config(6));
  expect_same_outputs(again, first, true, "the same trace served twice");
  EXPECT_EQ(engine.cache().free_pages(), pages);
}

// =============================================================================================
// Part F: disaggregation (2 ranks)

namespace {

// A hash of a report's tokens and times, the same on every rank or not.
bool same_on_both(const inf::ServeReport& r) {
  std::uint64_t h = 1469598103934665603ull;
  auto add = [&](const void* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  };
  for (const inf::RequestResult& x : r.results) {
    add(x.tokens.data(), x.tokens.size() * sizeof(std::int32_t));
    add(&x.first_token_s, sizeof(double));
    add(&x.finish_s, sizeof(double));
    add(&x.ok, sizeof(bool));
  }
  add(&r.kv_bytes_sent, sizeof(r.kv_bytes_sent));
  std::uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

}  // namespace

TEST_F(Inference, DisaggregatedMatchesColocated) {
  if (world().size() != 2) K2C_SKIP("disaggregation runs on exactly 2 ranks (this run has " + std::to_string(world().size()) + ")");
  const km::ModelConfig m = serving_model();
  km::WorkCounter counter(km::cpu_ops());
  Served s(m, counter);
  inf::Engine engine(s.ctx, m, 24, 4, 6);
  const std::vector<inf::Request> trace = trace_of(12, 30.0, 8, m, k2c::testing::seed_for("trace"));
  const inf::ServeReport together = inf::serve(engine, trace, cost_config(4));
  expect_greedy(s, trace, together, "co-located");
  const double before = counter.flops();
  const inf::ServeReport apart = inf::serve_disaggregated(world(), engine, trace, cost_config(4));
  expect_same_outputs(apart, together, false, "disaggregated against co-located");
  // Each rank's share of the work (k2c/model/work_counter.h counts the products that reach the
  // engine's backend): rank 0 prefills every prompt and decodes nothing, rank 1 decodes from the
  // caches it receives and prefills nothing. Both ranks serving everything would match the tokens.
  {
    double prefills = 0, decodes = 0, decoded_tokens = 0, prompt_tokens = 0;
    for (const inf::Request& r : trace) {
      const std::int64_t prompt = static_cast<std::int64_t>(r.prompt.size());
      prefills += prefill_allowance(m, prompt);
      prompt_tokens += static_cast<double>(prompt);
      for (int j = 1; j < r.output_len; ++j) decodes += decode_allowance(m, {prompt + j});
      decoded_tokens += std::max(r.output_len - 1, 0);
    }
    const double did = counter.flops() - before;
    if (world().rank() == 0) {
      EXPECT_LE(did, prefills) << "rank 0 did " << did << " FLOPs of products, past what prefilling every prompt takes";
      EXPECT_GE(did, 0.5 * prompt_tokens * token_flops(m)) << "rank 0 did " << did << " FLOPs: too few to prefill the prompts";
    } else {
      EXPECT_LE(did, decodes) << "rank 1 did " << did << " FLOPs of products, past what decoding from the received "
                              << "caches takes: does it prefill too?";
      EXPECT_GE(did, 0.5 * decoded_tokens * token_flops(m)) << "rank 1 did " << did << " FLOPs: too few to decode";
    }
  }
  EXPECT_TRUE(same_on_both(apart)) << "the two ranks' reports differ";
  std::int64_t kv = 0;
  const std::int64_t per_token = engine.cache().bytes_per_token();
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const inf::RequestResult& r = apart.results[i];
    ASSERT_TRUE(r.ok) << r.error;
    const double prefill = step_cost({inf::StepInfo::Kind::prefill, 1, std::int64_t(trace[i].prompt.size()), 0, 0});
    EXPECT_GE(r.first_token_s, trace[i].arrival_s + prefill - 1e-9) << "request " << r.id << ": a first token before its prefill";
    if (trace[i].output_len >= 2) {
      const std::int64_t bytes = std::int64_t(trace[i].prompt.size()) * per_token;
      kv += bytes;
      const double transfer = step_cost({inf::StepInfo::Kind::transfer, 1, 0, 0, bytes});
      const double decode = step_cost({inf::StepInfo::Kind::decode, 1, 1, 0, 0});
      EXPECT_GE(r.finish_s, r.first_token_s + transfer + (trace[i].output_len - 1) * decode - 1e-9)
          << "request " << r.id << ": decoded faster than its transfer and steps allow";
    }
  }
  EXPECT_EQ(apart.kv_bytes_sent, kv) << "cache bytes sent: the prompt's tokens of every request that goes on decoding";
  EXPECT_GT(apart.prefill_steps, 0);
  EXPECT_GT(apart.decode_steps, 0);
  EXPECT_EQ(engine.cache().used_pages(), 0);
  EXPECT_EQ(engine.cache().sequences(), 0);
}

TEST_F(Inference, DisaggregationTransferBytes) {
  const km::ModelConfig m = serving_model();
  Served s(m);
  inf::Engine engine(s.ctx, m, 24, 4, 6);
  const std::vector<inf::Request> trace = trace_of(9, 20.0, 6, m, k2c::testing::seed_for("trace"));
  if (world().size() != 2) {
    EXPECT_THROW(inf::serve_disaggregated(world(), engine, trace, cost_config(4)), std::invalid_argument)
        << "serve_disaggregated on " << world().size() << " rank(s)";
    return;
  }
  kd::CountingCommunicator counting(world(), "world");
  const int max_batch = 3;
  const inf::ServeReport r = inf::serve_disaggregated(counting, engine, trace, cost_config(max_batch));
  expect_greedy(s, trace, r, "disaggregated");  // every request served: none left out of the bytes below
  std::int64_t kv = 0, decoded = 0;
  for (std::size_t i = 0; i < trace.size(); ++i)
    if (trace[i].output_len >= 2) {
      kv += std::int64_t(trace[i].prompt.size()) * engine.cache().bytes_per_token();
      ++decoded;
    }
  EXPECT_EQ(r.kv_bytes_sent, kv);
  // Besides the caches only small messages travel: headers and clocks, a few numbers per request
  // and per step.
  const std::int64_t small = 16 * (4 + 2 * max_batch) * (r.prefill_steps + r.decode_steps) + 64 * std::int64_t(trace.size());
  const std::int64_t sent = static_cast<std::int64_t>(counting.total("send").bytes);
  if (world().rank() == 0) {
    EXPECT_GE(sent, kv) << "rank 0 sent fewer bytes than the caches hold";
    EXPECT_LE(sent, kv + small) << "rank 0 sent more than the caches and small messages";
    EXPECT_GE(static_cast<std::int64_t>(counting.total("send").calls), decoded) << "one send per cache at least";
    RecordProperty("kv_bytes_per_request", std::to_string(double(kv) / double(std::max<std::int64_t>(decoded, 1))));
  } else {
    EXPECT_LE(sent, small) << "rank 1 sends no cache";
  }
}

// =============================================================================================
// speed: NCCL, one GPU per rank

namespace {
constexpr int kPerfBatch = 32, kPerfHeads = 32, kPerfKvHeads = 8, kPerfHeadDim = 128, kPerfPage = 256, kPerfSplit = 2048;
constexpr std::int64_t kPerfLength = 8192;
}  // namespace

using InferencePerf = kd::testing::DistTest;

// Decode reads every cached key and value once: B·L·2·Hkv·hd·4 bytes (fp32 tensors of the GPU
// backend) for 4·B·L·Hq·hd FLOPs, about 0.5 FLOP per byte, so its floor is the cache's bytes at
// memory bandwidth, and the device copy (bytes read plus written per second) is the ceiling.
TEST_F(InferencePerf, DecodeAttentionVsCopy) {
  K2C_REQUIRE_NCCL();
  if (k2c::testing::sanitizing()) K2C_SKIP("timing is skipped under compute-sanitizer");
  km::Ops* gpu = km::backend_if_built(true, world().compute_stream(), km::GpuMath::bf16);
  if (!gpu) K2C_SKIP("built without the model library's GPU backend (k2c_model_cuda)");
  Side s(*gpu);
  const int B = kPerfBatch, Hq = kPerfHeads, Hkv = kPerfKvHeads, hd = kPerfHeadDim;
  const std::int64_t L = kPerfLength, cols = std::int64_t{Hkv} * hd;
  inf::PagedKvCache cache(s.ctx, {1, Hkv, hd, kPerfPage, static_cast<int>(B * L / kPerfPage), false});
  std::vector<int> seqs;
  for (int b = 0; b < B; ++b) seqs.push_back(cache.create(L));
  for (std::int64_t t = 0; t < L; t += kPerfPage)
    for (int seq : seqs) cache.extend(seq, kPerfPage);  // pages of the sequences interleave
  // The pools hold a random block of rows, repeated: pool row r is block row r % block_rows.
  const std::int64_t block_rows = 4096, pool_rows = cache.keys(0).dim(0);
  const Host kb = random_host(block_rows * cols, "k"), vb = random_host(block_rows * cols, "v");
  const km::Tensor kt = s.upload(kb, {block_rows, cols}), vt = s.upload(vb, {block_rows, cols});
  for (std::int64_t r = 0; r < pool_rows; r += block_rows) {
    km::Tensor kd = cache.keys(0).rows(r, block_rows), vd = cache.values(0).rows(r, block_rows);
    s.ctx.ops.copy(kd, kt);
    s.ctx.ops.copy(vd, vt);
  }
  Host q = random_host(std::int64_t{B} * Hq * hd, "q");
  for (float& x : q) x *= 3.0f;
  const km::Tensor qt = s.upload(q, {B, Hq * hd});
  km::Tensor o = s.poisoned({B, Hq * hd});
  const kd::TimeStepOptions opt{.warmup = 2, .repeats = 10};
  const double t_decode =
      kd::time_step(world(), [&] { inf::decode_attention(s.ctx, cache, 0, seqs, qt, o, kPerfSplit); }, opt).median_ms;
  km::Tensor from = s.tensor({pool_rows, cols}), to = s.tensor({pool_rows, cols});
  s.ctx.ops.copy(from, cache.keys(0));
  const double t_copy = kd::time_step(world(), [&] { s.ctx.ops.copy(to, from); }, opt).median_ms;

  // The timed output, at sequences drawn after timing, against double precision on the host.
  const Host got = s.download(o);
  std::mt19937_64 fresh(std::random_device{}());
  std::size_t wrong = 0;
  for (int check = 0; check < 3; ++check) {
    const int b = static_cast<int>(fresh() % B);
    Host k(static_cast<std::size_t>(L * cols)), v(k.size());
    for (std::int64_t t = 0; t < L; ++t) {
      const std::int64_t r = cache.slot(seqs[b], t) % block_rows;
      std::copy(kb.begin() + r * cols, kb.begin() + (r + 1) * cols, k.begin() + t * cols);
      std::copy(vb.begin() + r * cols, vb.begin() + (r + 1) * cols, v.begin() + t * cols);
    }
    const std::vector<double> want = attend_host(row_of(q, Hq * hd, b), k, v, L, Hq, Hkv, hd);
    double ss = 0;
    for (double w : want) ss += w * w;
    const double rms = std::sqrt(ss / double(want.size()));
    for (std::size_t i = 0; i < want.size(); ++i)
      wrong += !(std::abs(got[b * Hq * hd + i] - want[i]) <= 2e-2 * rms + 1e-3 * std::abs(want[i]));
  }
  EXPECT_EQ(wrong, 0u) << "the timed decode attention disagrees with the double-precision oracle";
  const double cache_bytes = 2.0 * double(B) * double(L) * double(cols) * 4.0;
  const double read_rate = cache_bytes / (t_decode * 1e6), copy_rate = 2.0 * double(from.bytes()) / (t_copy * 1e6);  // GB/s
  if (world().rank() == 0) {
    K2C_EXPECT_PERF(read_rate, copy_rate,
                    "decode attention over " + std::to_string(B) + " sequences of " + std::to_string(L) + " tokens, " +
                        std::to_string(Hq) + "/" + std::to_string(Hkv) + " heads of " + std::to_string(hd) + ": " +
                        std::to_string(t_decode) + " ms, cache read at " + std::to_string(read_rate) +
                        " GB/s; device copy " + std::to_string(copy_rate) + " GB/s");
  }
}

#if !K2C_CUDA_PARTS
// Part G (decode_kernel.cu) and its tests (test_inference_kernel.cu) are built only where the CUDA
// toolkit is. Without it its tests still appear, skipped with the reason, so the rest of the
// module is graded as usual rather than as a run whose report lacks tests.
#define K2C_PART_G_ABSENT() K2C_SKIP("part G is built only where the CUDA toolkit is; this build has none")
TEST(InferenceKernel, MatchesAttention) { K2C_PART_G_ABSENT(); }
TEST(InferenceKernel, RejectsBadShapes) { K2C_PART_G_ABSENT(); }
TEST_F(InferencePerf, DecodeKernelVsCopy) { K2C_PART_G_ABSENT(); }
TEST_F(InferencePerf, DecodeKernelOneLongSequence) { K2C_PART_G_ABSENT(); }
#endif
