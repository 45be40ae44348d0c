// solutions/19_inference/serving.cpp — module 19, the reference, parts E–F (contract:
// assignments/19_inference/inference.h; lecture: lectures/19_inference.md, sections 7 and 8).
//
// Continuous batching is a loop over steps, each either one prefill of every request just
// admitted or one decode of every running request; requests join and leave between any two
// steps, so a long answer never holds a short one back the way a static batch that waits for
// its slowest member does. Admission reserves a request's whole context in the cache, so a
// running request can never be stopped for lack of room (the price: pages reserved for tokens
// not generated yet).
//
// Disaggregation runs the same loop split in two: rank 0 only prefills, rank 1 only decodes,
// and a prefilled request's cache travels in one send. The two ranks keep two clocks and move in
// rounds; in each round the rank whose next step comes first runs it. That ordering is what makes
// the simulated times honest: a decode step never starts before the prefills that could have
// joined it are known, and a prefill never admits against free pages the decode rank reported
// from its future. The real work (prefill, decode, send) happens in the same order as the
// clocks say, so outputs do not depend on timing at all.
#include "inference.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace k2c::inference {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// what both loops share

std::string str(std::int64_t v) { return std::to_string(v); }

// Tokens a request occupies in the cache: its prompt and every generated token but the last
// (which is returned, never fed back).
std::int64_t context_of(const Request& r) { return static_cast<std::int64_t>(r.prompt.size()) + r.output_len - 1; }

// Why a request cannot be served ("" if it can), checked when it arrives.
std::string rejection(const Request& r, const ModelConfig& m, const CacheConfig& cache) {
  const std::string who = "request " + std::to_string(r.id) + ": ";
  if (r.prompt.empty()) return who + "the prompt has 0 tokens (at least 1 is needed)";
  if (r.output_len < 1) return who + "output length " + str(r.output_len) + " (at least 1 token must be asked for)";
  for (std::int32_t t : r.prompt)
    if (t < 0 || t >= m.vocab) return who + "prompt token " + str(t) + " outside the vocabulary [0, " + str(m.vocab) + ")";
  const std::int64_t ctx = context_of(r);
  if (ctx > m.seq_len)
    return who + "a prompt of " + str(static_cast<std::int64_t>(r.prompt.size())) + " tokens and " + str(r.output_len) +
           " output tokens need a context of " + str(ctx) + ", the model's is " + str(m.seq_len);
  if (pages_for(ctx, cache.page_size) > cache.pages)
    return who + "a context of " + str(ctx) + " tokens needs " + str(pages_for(ctx, cache.page_size)) +
           " pages, the cache has " + str(cache.pages);
  return "";
}

// Trace positions by arrival (stable: equal arrivals keep trace order).
std::vector<std::size_t> arrival_order(const std::vector<Request>& trace) {
  std::vector<std::size_t> order(trace.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return trace[a].arrival_s < trace[b].arrival_s; });
  return order;
}

std::vector<RequestResult> blank_results(const std::vector<Request>& trace) {
  std::vector<RequestResult> results(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    results[i].id = trace[i].id;
    results[i].arrival_s = trace[i].arrival_s;
  }
  return results;
}

// Runs fn and returns the step's duration: the timer's, or the wall time (each step ends by
// downloading its tokens, or by synchronize() in a transfer, so the work is done when fn returns).
template <class Fn>
double timed(const StepTimer& timer, const StepInfo& info, Fn&& fn) {
  if (timer) {
    fn();
    return timer(info);
  }
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void check_start(const Engine& engine, const ServeConfig& config, const char* who) {
  if (config.max_batch < 1) throw std::invalid_argument(std::string(who) + ": max_batch " + str(config.max_batch));
  if (engine.cache().sequences() != 0)
    throw std::logic_error(std::string(who) + ": the engine's cache still holds " + str(engine.cache().sequences()) +
                           " sequences");
}

// A request between its admission and its end.
struct Running {
  std::size_t index;  // in the trace
  int seq;            // in this rank's cache
  double ready = 0;   // part F: when its cache is on the decode rank
};

// One decode step of `running` on `engine`: each gets a token; those complete finish at `clock`
// (after the step) and leave, their sequences released.
double decode_step(Engine& engine, const std::vector<Request>& trace, std::vector<Running>& running,
                   std::vector<RequestResult>& results, const StepTimer& timer, double clock, int& peak_pages) {
  std::vector<int> seqs;
  std::vector<std::int32_t> last;
  StepInfo info{StepInfo::Kind::decode, static_cast<int>(running.size()), static_cast<std::int64_t>(running.size()), 0, 0};
  for (const Running& r : running) {
    seqs.push_back(r.seq);
    last.push_back(results[r.index].tokens.back());
    info.context += engine.cache().length(r.seq);
  }
  Step step;
  clock += timed(timer, info, [&] { step = engine.decode(seqs, last); });
  peak_pages = std::max(peak_pages, engine.cache().used_pages());
  std::vector<Running> still;
  for (std::size_t i = 0; i < running.size(); ++i) {
    RequestResult& res = results[running[i].index];
    res.tokens.push_back(step.tokens[i]);
    if (static_cast<int>(res.tokens.size()) == trace[running[i].index].output_len) {
      res.ok = true;
      res.finish_s = clock;
      engine.cache().release(running[i].seq);
    } else {
      still.push_back(running[i]);
    }
  }
  running = std::move(still);
  return clock;
}

// One prefill step of the `admitted` sequences' prompts on `engine`, its tokens left in `step`:
// returns the clock after it.
double prefill_step(Engine& engine, const std::vector<Request>& trace, const std::vector<Running>& admitted,
                    const StepTimer& timer, double clock, Step& step) {
  std::vector<int> seqs;
  std::vector<std::vector<std::int32_t>> prompts;
  StepInfo info{StepInfo::Kind::prefill, static_cast<int>(admitted.size()), 0, 0, 0};
  for (const Running& a : admitted) {
    seqs.push_back(a.seq);
    prompts.push_back(trace[a.index].prompt);
    info.tokens += static_cast<std::int64_t>(trace[a.index].prompt.size());
  }
  return clock + timed(timer, info, [&] { step = engine.prefill(seqs, prompts); });
}

}  // namespace

// =============================================================================================
// Part E: continuous batching

void summarize(ServeReport& report) {
  std::vector<double> ttft, tpot;
  double first = kNever, last = -kNever, tokens = 0;
  for (const RequestResult& r : report.results) {
    if (!r.ok) continue;
    ttft.push_back(r.first_token_s - r.arrival_s);
    const std::size_t n = r.tokens.size();
    if (n >= 2) tpot.push_back((r.finish_s - r.first_token_s) / static_cast<double>(n - 1));
    first = std::min(first, r.arrival_s);
    last = std::max(last, r.finish_s);
    tokens += static_cast<double>(n);
  }
  report.ttft_p50 = percentile(ttft, 50);
  report.ttft_p99 = percentile(ttft, 99);
  report.tpot_p50 = percentile(tpot, 50);
  report.tpot_p99 = percentile(tpot, 99);
  report.throughput = last > first ? tokens / (last - first) : 0.0;
}

ServeReport serve(Engine& engine, const std::vector<Request>& trace, const ServeConfig& config) {
  check_start(engine, config, "serve");
  PagedKvCache& cache = engine.cache();
  ServeReport report;
  report.results = blank_results(trace);
  const std::vector<std::size_t> order = arrival_order(trace);
  std::size_t next = 0;  // in `order`: the first request not yet arrived
  std::deque<std::size_t> waiting;
  std::vector<Running> running;
  double clock = 0;
  for (;;) {
    for (; next < order.size() && trace[order[next]].arrival_s <= clock; ++next) {
      const std::string why = rejection(trace[order[next]], engine.model(), cache.config());
      if (why.empty()) waiting.push_back(order[next]);
      else report.results[order[next]].error = why;
    }
    std::vector<Running> admitted;
    while (!waiting.empty() && static_cast<int>(running.size() + admitted.size()) < config.max_batch &&
           pages_for(context_of(trace[waiting.front()]), cache.config().page_size) <= cache.free_pages()) {
      admitted.push_back({waiting.front(), cache.create(context_of(trace[waiting.front()]))});
      waiting.pop_front();
    }
    if (!admitted.empty()) {
      Step step;
      clock = prefill_step(engine, trace, admitted, config.timer, clock, step);
      ++report.prefill_steps;
      report.peak_pages = std::max(report.peak_pages, cache.used_pages());
      for (std::size_t i = 0; i < admitted.size(); ++i) {
        RequestResult& res = report.results[admitted[i].index];
        res.tokens = {step.tokens[i]};
        res.first_token_s = clock;
        if (trace[admitted[i].index].output_len == 1) {
          res.ok = true;
          res.finish_s = clock;
          cache.release(admitted[i].seq);
        } else {
          running.push_back(admitted[i]);
        }
      }
    } else if (!running.empty()) {
      clock = decode_step(engine, trace, running, report.results, config.timer, clock, report.peak_pages);
      ++report.decode_steps;
    } else if (next < order.size()) {
      clock = std::max(clock, trace[order[next]].arrival_s);
    } else {
      // Nothing runs and nothing will arrive: a waiting request would fit an empty cache (it was
      // checked at arrival), so none can be left.
      if (!waiting.empty()) throw std::logic_error("serve: requests left waiting with the cache empty");
      break;
    }
  }
  summarize(report);
  return report;
}

// =============================================================================================
// Part F: prefill/decode disaggregation
//
// A round: rank 1 broadcasts (its clock, its next step's time, its free pages); rank 0, now
// knowing both ranks' next steps, broadcasts the decision (who acts, or the end) with its own
// clock; the chosen rank runs one step. After a prefill step rank 0 sends, for the requests that
// go on decoding, a header (trace positions and first tokens), each request's cache (one send of
// prompt·bytes_per_token bytes: every layer's keys, then values, gathered in position order) and
// a trailer (the times their caches are ready on rank 1). Everything small travels as f64 in
// communicator memory (device memory on NCCL, where a collective cannot read the host).

namespace {

enum Decision { kPrefill = 0, kDecode = 1, kDone = 2, kStuck = 3 };

// A few doubles through the communicator: the root's `values` reach every rank.
std::vector<double> broadcast(Communicator& comm, std::vector<double> values, int root) {
  dist::Buffer buf(comm, values.size() * sizeof(double));
  if (comm.rank() == root) comm.to_backend(buf.get(), values.data(), buf.bytes());
  comm.broadcast(buf.get(), values.size(), dist::DType::f64, root);
  comm.to_host(values.data(), buf.get(), buf.bytes());
  return values;
}

void send_doubles(Communicator& comm, const std::vector<double>& values, int peer) {
  dist::Buffer buf(comm, values.size() * sizeof(double));
  comm.to_backend(buf.get(), values.data(), buf.bytes());
  comm.send(buf.get(), values.size(), dist::DType::f64, peer);
}

std::vector<double> recv_doubles(Communicator& comm, std::size_t count, int peer) {
  std::vector<double> values(count);
  dist::Buffer buf(comm, count * sizeof(double));
  comm.recv(buf.get(), count, dist::DType::f64, peer);
  comm.to_host(values.data(), buf.get(), buf.bytes());
  return values;
}

// The cache rows of a sequence's first `tokens` positions, as one [2·layers·tokens, row] tensor:
// layer 0's keys, layer 0's values, layer 1's keys, ...
Tensor pack_cache(Context& ctx, const PagedKvCache& cache, int seq, std::int64_t tokens) {
  const CacheConfig& c = cache.config();
  const std::int64_t row = static_cast<std::int64_t>(c.kv_heads) * c.head_dim;
  std::vector<std::int32_t> slots(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) slots[t] = static_cast<std::int32_t>(cache.slot(seq, t));
  Tensor index = ctx.tensor({tokens}, model::Category::activations, model::DType::i32);
  ctx.ops.upload(index, slots.data());
  Tensor packed = ctx.tensor({2 * c.layers * tokens, row}, model::Category::comm);
  for (int l = 0; l < c.layers; ++l) {
    Tensor k = packed.rows(2 * l * tokens, tokens), v = packed.rows((2 * l + 1) * tokens, tokens);
    ctx.ops.gather_rows(cache.keys(l), index, k);
    ctx.ops.gather_rows(cache.values(l), index, v);
  }
  return packed;
}

void unpack_cache(Context& ctx, PagedKvCache& cache, int seq, std::int64_t tokens, const Tensor& packed) {
  for (int l = 0; l < cache.config().layers; ++l)
    cache.write(ctx, l, seq, 0, packed.rows(2 * l * tokens, tokens), packed.rows((2 * l + 1) * tokens, tokens));
}

// Rank 0's state: the requests it has yet to prefill, in arrival order (rejected ones dropped).
struct PrefillSide {
  std::vector<std::size_t> queue;  // trace positions
  std::size_t head = 0;            // the first not yet prefilled
  double clock = 0;
  bool waited = false;  // the head did not fit rank 1's free pages last round
};

// Rank 1's state.
struct DecodeSide {
  std::vector<Running> pending;  // caches received, not yet decoding (oldest first)
  std::vector<Running> running;
  double clock = 0;
  double next() const {
    if (!running.empty()) return clock;
    double t = kNever;
    for (const Running& p : pending) t = std::min(t, p.ready);
    return std::max(clock, t);
  }
};

}  // namespace

ServeReport serve_disaggregated(Communicator& comm, Engine& engine, const std::vector<Request>& trace,
                                const ServeConfig& config) {
  if (comm.size() != 2)
    throw std::invalid_argument("serve_disaggregated: needs 2 ranks (prefill, decode); the communicator has " +
                                str(comm.size()));
  check_start(engine, config, "serve_disaggregated");
  Context& ctx = engine.context();
  PagedKvCache& cache = engine.cache();
  const bool prefiller = comm.rank() == 0;
  const int B = config.max_batch;
  const std::int64_t token_bytes = cache.bytes_per_token();
  ServeReport report;
  report.results = blank_results(trace);

  // Both ranks reject the same requests: the decode rank's cache must hold a whole context, the
  // prefill rank's a prompt. Each learns the other's cache size first.
  const CacheConfig mine = cache.config();
  const std::vector<double> theirs0 = broadcast(comm, {double(mine.pages), double(mine.page_size)}, 0);
  const std::vector<double> theirs1 = broadcast(comm, {double(mine.pages), double(mine.page_size)}, 1);
  CacheConfig decode_cache = mine;
  decode_cache.pages = static_cast<int>(theirs1[0]);
  decode_cache.page_size = static_cast<int>(theirs1[1]);
  const int prefill_pages = static_cast<int>(theirs0[0]), prefill_page_size = static_cast<int>(theirs0[1]);
  PrefillSide P;
  for (std::size_t i : arrival_order(trace)) {
    std::string why = rejection(trace[i], engine.model(), decode_cache);
    if (why.empty() && pages_for(static_cast<std::int64_t>(trace[i].prompt.size()), prefill_page_size) > prefill_pages)
      why = "request " + std::to_string(trace[i].id) + ": a prompt of " + str(static_cast<std::int64_t>(trace[i].prompt.size())) +
            " tokens does not fit the prefill rank's cache of " + str(prefill_pages) + " pages";
    if (why.empty()) P.queue.push_back(i);
    else report.results[i].error = why;
  }
  DecodeSide D;

  for (;;) {
    const std::vector<double> d = broadcast(comm, {D.clock, D.next(), double(cache.free_pages())}, 1);
    const double clock1 = d[0], next1 = d[1];
    const int free1 = static_cast<int>(d[2]);
    std::vector<double> decision(2, 0.0);
    if (prefiller) {
      double next0 = kNever;
      if (P.head < P.queue.size()) {
        const Request& r = trace[P.queue[P.head]];
        if (pages_for(context_of(r), decode_cache.page_size) <= free1) {
          if (P.waited) P.clock = std::max(P.clock, clock1);  // idle until rank 1 freed the pages
          P.waited = false;
          next0 = std::max(P.clock, r.arrival_s);
        } else {
          P.waited = true;
        }
      }
      Decision what = kStuck;
      if (next0 < kNever && next0 <= next1) what = kPrefill;  // a tie goes to the prefill, as in serve()
      else if (next1 < kNever) what = kDecode;
      else if (P.head == P.queue.size()) what = kDone;
      decision = {double(what), next0};
    }
    decision = broadcast(comm, decision, 0);
    const Decision what = static_cast<Decision>(static_cast<int>(decision[0]));
    if (what == kDone) break;
    if (what == kStuck) throw std::logic_error("serve_disaggregated: rank 0 waits for pages that rank 1 never frees");

    if (what == kPrefill && prefiller) {
      // Admit as serve() does, against rank 1's free pages as well as our own.
      P.clock = decision[1];
      std::vector<Running> admitted;
      int promised = 0;
      while (P.head < P.queue.size() && static_cast<int>(admitted.size()) < B) {
        const Request& r = trace[P.queue[P.head]];
        const int need = static_cast<int>(pages_for(context_of(r), decode_cache.page_size));
        if (r.arrival_s > P.clock || promised + need > free1 ||
            pages_for(static_cast<std::int64_t>(r.prompt.size()), mine.page_size) > cache.free_pages())
          break;
        admitted.push_back({P.queue[P.head], cache.create(static_cast<std::int64_t>(r.prompt.size()))});
        promised += need;
        ++P.head;
      }
      Step step;
      P.clock = prefill_step(engine, trace, admitted, config.timer, P.clock, step);
      ++report.prefill_steps;
      std::vector<double> header(static_cast<std::size_t>(1 + 2 * B), 0.0), ready;
      std::vector<Running> go;
      for (std::size_t i = 0; i < admitted.size(); ++i) {
        RequestResult& res = report.results[admitted[i].index];
        res.tokens = {step.tokens[i]};
        res.first_token_s = P.clock;
        if (trace[admitted[i].index].output_len == 1) {
          res.ok = true;
          res.finish_s = P.clock;
          cache.release(admitted[i].seq);
        } else {
          header[1 + 2 * go.size()] = double(admitted[i].index);
          header[2 + 2 * go.size()] = double(step.tokens[i]);
          go.push_back(admitted[i]);
        }
      }
      header[0] = double(go.size());
      send_doubles(comm, header, 1);
      for (const Running& g : go) {
        const std::int64_t T = static_cast<std::int64_t>(trace[g.index].prompt.size());
        const Tensor packed = pack_cache(ctx, cache, g.seq, T);
        const StepInfo send{StepInfo::Kind::transfer, 1, T, 0, T * token_bytes};
        P.clock += timed(config.timer, send, [&] {
          comm.send(packed.raw(), static_cast<std::size_t>(packed.numel()), dist::DType::f32, 1);
          comm.synchronize();
        });
        ready.push_back(P.clock);
        report.kv_bytes_sent += T * token_bytes;
        cache.release(g.seq);
      }
      if (!go.empty()) send_doubles(comm, ready, 1);
    } else if (what == kPrefill) {
      const std::vector<double> header = recv_doubles(comm, static_cast<std::size_t>(1 + 2 * B), 0);
      const std::size_t count = static_cast<std::size_t>(header[0]);
      const std::size_t first = D.pending.size();
      for (std::size_t i = 0; i < count; ++i) {
        const std::size_t index = static_cast<std::size_t>(header[1 + 2 * i]);
        const Request& r = trace[index];
        const std::int64_t T = static_cast<std::int64_t>(r.prompt.size());
        const int seq = cache.create(context_of(r));
        cache.extend(seq, T);
        Tensor packed = ctx.tensor({2 * cache.config().layers * T, static_cast<std::int64_t>(mine.kv_heads) * mine.head_dim},
                                   model::Category::comm);
        comm.recv(packed.raw(), static_cast<std::size_t>(packed.numel()), dist::DType::f32, 0);
        unpack_cache(ctx, cache, seq, T, packed);
        report.results[index].tokens = {static_cast<std::int32_t>(header[2 + 2 * i])};
        report.kv_bytes_sent += T * token_bytes;
        D.pending.push_back({index, seq, 0});
      }
      if (count > 0) {
        const std::vector<double> ready = recv_doubles(comm, count, 0);
        for (std::size_t i = 0; i < count; ++i) D.pending[first + i].ready = ready[i];
      }
      report.peak_pages = std::max(report.peak_pages, cache.used_pages());
    } else if (what == kDecode && !prefiller) {
      D.clock = next1;
      std::vector<Running> later;
      for (const Running& p : D.pending)
        (p.ready <= D.clock && static_cast<int>(D.running.size()) < B ? D.running : later).push_back(p);
      D.pending = std::move(later);
      D.clock = decode_step(engine, trace, D.running, report.results, config.timer, D.clock, report.peak_pages);
      ++report.decode_steps;
    }
  }

  // Each rank knows half of every result: rank 0 the first tokens and their times (and the whole
  // of a one-token request), rank 1 the rest. Two broadcasts make both reports whole.
  const std::size_t n = trace.size();
  std::vector<double> from0(1 + 3 * n, 0.0), from1(2 + n, 0.0);
  from0[0] = report.prefill_steps;
  for (std::size_t i = 0; i < n; ++i) {
    const RequestResult& res = report.results[i];
    from0[1 + 3 * i] = res.first_token_s;
    from0[2 + 3 * i] = res.finish_s;
    from0[3 + 3 * i] = res.tokens.empty() ? -1.0 : double(res.tokens[0]);
  }
  from0 = broadcast(comm, from0, 0);
  from1[0] = report.decode_steps;
  from1[1] = report.peak_pages;
  for (std::size_t i = 0; i < n; ++i) {
    from1[2 + i] = report.results[i].finish_s;
    if (report.results[i].error.empty() && trace[i].output_len >= 2)
      for (std::size_t t = 1; t < static_cast<std::size_t>(trace[i].output_len); ++t)
        from1.push_back(prefiller ? 0.0 : double(report.results[i].tokens.at(t)));
  }
  from1 = broadcast(comm, from1, 1);
  report.prefill_steps = static_cast<int>(from0[0]);
  report.decode_steps = static_cast<int>(from1[0]);
  report.peak_pages = static_cast<int>(from1[1]);
  std::size_t at = 2 + n;
  for (std::size_t i = 0; i < n; ++i) {
    RequestResult& res = report.results[i];
    if (!res.error.empty()) continue;
    res.ok = true;
    res.first_token_s = from0[1 + 3 * i];
    res.tokens = {static_cast<std::int32_t>(from0[3 + 3 * i])};
    if (trace[i].output_len == 1) {
      res.finish_s = from0[2 + 3 * i];
      continue;
    }
    res.finish_s = from1[2 + i];
    for (int t = 1; t < trace[i].output_len; ++t) res.tokens.push_back(static_cast<std::int32_t>(from1[at++]));
  }
  summarize(report);
  return report;
}

}  // namespace k2c::inference
