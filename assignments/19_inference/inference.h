// assignments/19_inference/inference.h — the contract of module 19 (do not edit).
//
// Serving the course's model: generating text one token at a time for many requests at once.
// Training (modules 12–18) pushes a whole sequence through the model in one pass; generation
// cannot, because token t + 1 is chosen from the logits of token t. Two kinds of step do the work:
//
//   prefill   a request's prompt in one pass, as in training: it fills the request's KV cache
//             (every layer's keys and values of every prompt token) and gives the first token
//   decode    one new token for each running request: its query attends to the whole cache,
//             and its own key and value are appended to it
//
// and a serving system decides which requests run in which step. The parts, in order:
//
//   A  PagedKvCache        the cache in fixed-size pages, a page table per sequence
//   B  decode_attention    one query per sequence over its cache, split along the cache, the
//                          parts merged by their log-sum-exp (lecture 09's online softmax)
//   C  Engine              prefill and decode steps of the model library's dense transformer
//   D  Mla                 multi-head latent attention: a small latent cached per token, the
//                          up-projections folded into the query and output projections
//   E  serve               continuous batching of a trace of requests; time to first token,
//                          time per output token, throughput
//   F  serve_disaggregated prefill on rank 0, decode on rank 1, the cache sent between them
//
// Parts A–D are written in inference.cpp, E–F in serving.cpp.
//
// Rules of the course's model library apply (common/model/README.md): every computation on a
// tensor goes through ctx.ops (the CPU backend on the MPI runs, the GPU backend on NCCL), never
// through element reads or writes of your own. The host handles integers (page tables, lengths,
// tokens, index lists it uploads with ops.upload) and the few numbers it downloads (the chosen
// tokens). All tensors are fp32 and row-major; activations are [rows, features].
//
// Determinism. On the CPU backend every operation gives the same bits for the same inputs, and
// each row of a matmul, a norm or an attention is computed alone. Serving relies on it: what a
// request generates must not depend on which other requests shared its steps, on the page
// size, or on which rank ran its prefill. The tests ask for those equalities bit for bit.
//
// Tests: autograder/19_inference/test_inference.cpp. Lecture: lectures/19_inference.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/core/random.h"
#include "k2c/dist/communicator.h"
#include "k2c/model/params.h"
#include "k2c/model/transformer.h"

namespace k2c::inference {

using dist::Communicator;
using model::Context;
using model::ModelConfig;
using model::ParamId;
using model::ParamList;
using model::Tensor;

// ---- given: small helpers the stubs, the solutions and the tests share

// Pages of `page_size` tokens that `tokens` tokens occupy.
inline std::int64_t pages_for(std::int64_t tokens, int page_size) {
  return tokens <= 0 ? 0 : (tokens + page_size - 1) / page_size;
}

// The parameter registered under `name`, or std::invalid_argument naming it.
inline ParamId find_param(const ParamList& params, const std::string& name) {
  for (ParamId id = 0; id < params.size(); ++id)
    if (params.info(id).name == name) return id;
  throw std::invalid_argument("no parameter named '" + name + "' (is the model's ParamList the one given?)");
}

// The p-th percentile of `values` (0 < p <= 100) by the nearest-rank rule: the smallest value
// that at least p% of the values do not exceed. NaN for an empty list.
inline double percentile(std::vector<double> values, double p) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(values.begin(), values.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(values.size()));
  const std::size_t i = static_cast<std::size_t>(std::clamp(rank, 1.0, static_cast<double>(values.size())));
  return values[i - 1];
}

// =============================================================================================
// Part A: the paged KV cache
//
// One pool per layer for the keys and one for the values, each [pages·page_size, kv_heads·
// head_dim] fp32 from ctx.tensor (ledger category activations), allocated once by the
// constructor. Page p is rows [p·page_size, (p+1)·page_size) of every pool: a page holds the same
// token slots in every layer. Position t of sequence s lives in row
//     slot(s, t) = page_table(s)[t / page_size]·page_size + t % page_size
// of each pool. A sequence's pages need not be consecutive, and the cache never moves rows.
//
// Page accounting. create(max_tokens) RESERVES the pages a sequence will ever need
// (pages_for(max_tokens)), so that a request admitted once never runs out of room later; extend()
// takes pages off the free list only as the length crosses into a new page, lowest page number
// first; release() returns them all. At any time
//     free_pages() + used_pages() + reserved-but-unused pages = pages.
// With shared_values (MLA, part D) the values are the keys: one pool per layer, values(l) is
// keys(l), and a token costs half.
struct CacheConfig {
  int layers = 1;        // >= 1
  int kv_heads = 1;      // >= 1
  int head_dim = 1;      // >= 1
  int page_size = 16;    // tokens per page, >= 1
  int pages = 1;         // pages in the pool, >= 1
  bool shared_values = false;
};

class PagedKvCache {
 public:
  PagedKvCache() = default;
  // Allocates the pools (throws std::invalid_argument naming the field for a bad config).
  PagedKvCache(Context& ctx, const CacheConfig& config);
  PagedKvCache(PagedKvCache&&) noexcept = default;
  PagedKvCache& operator=(PagedKvCache&&) noexcept = default;

  const CacheConfig& config() const { return config_; }
  // Bytes one token takes in all the layers' pools: (shared_values ? 1 : 2)·layers·kv_heads·
  // head_dim·4.
  std::int64_t bytes_per_token() const;
  // Bytes of all the pools: pages·page_size·bytes_per_token(), which the ledger must show.
  std::int64_t bytes() const;

  // A new, empty sequence that may grow to max_tokens (>= 1) tokens: its pages are reserved now.
  // Returns its id (>= 0; a released id may be handed out again). Throws std::length_error, with
  // the pages needed and the pages free, when fewer than pages_for(max_tokens) are free; nothing
  // changes then.
  int create(std::int64_t max_tokens);
  // Length += count (>= 0): the new positions [old length, old length + count) get slots, pages
  // taken from the free list as needed. Their rows hold whatever was there: write() them. Throws
  // std::length_error past max_tokens (naming both), std::out_of_range for an unknown id; nothing
  // changes then.
  void extend(int seq, std::int64_t count);
  // The sequence's pages go back to the free list and its reservation ends; the id is unknown
  // afterwards.
  void release(int seq);

  bool contains(int seq) const;
  std::int64_t length(int seq) const;                  // throws std::out_of_range if unknown
  std::int64_t capacity(int seq) const;                // its max_tokens
  const std::vector<int>& page_table(int seq) const;   // pages_for(length) entries
  std::int64_t slot(int seq, std::int64_t position) const;  // position in [0, length)
  int free_pages() const;   // neither held nor reserved
  int used_pages() const;   // held by sequences
  int sequences() const;    // live sequences

  // Keys of positions [first, first + k.dim(0)) of sequence `seq` in layer `layer` = the rows of
  // k ([count, kv_heads·head_dim]), values likewise from v (ignored with shared_values: pass k
  // twice). The positions must be below length(seq): extend() first. Throws std::out_of_range
  // otherwise, std::invalid_argument for a shape that does not fit.
  void write(Context& ctx, int layer, int seq, std::int64_t first, const Tensor& k, const Tensor& v);
  const Tensor& keys(int layer) const;
  const Tensor& values(int layer) const;

 private:
  struct Sequence {
    bool live = false;
    std::int64_t length = 0, max_tokens = 0;
    std::vector<int> pages;
  };
  CacheConfig config_;
  std::vector<Tensor> keys_, values_;
  std::vector<Sequence> seqs_;  // indexed by id
  std::vector<int> free_list_;  // yours to keep in the order you like (lowest page first out)
  int reserved_ = 0;            // pages reserved by live sequences and not yet held
};

// =============================================================================================
// Part B: decode attention
//
// o [B, Hq·hd] (row b) = softmax(q_b·Kᵀ/sqrt(hd))·V for q [B, Hq·hd] (row b: the one new query
// of sequence seqs[b], RoPE applied) over positions [0, length(seqs[b])) of layer `layer`'s
// cache, hd = the cache's head_dim, Hq = q.dim(1)/hd a multiple of kv_heads: query head h reads
// key-value head h / (Hq/kv_heads), as the library's attention does. No mask: every cached
// position is visible to the new query (it is the latest).
//
// Split along the cache. Sequence b's positions are cut into parts of split_tokens (the last may
// be shorter): [0, S), [S, 2S), ... Each part's attention gives an output and the log-sum-exp of
// its scores; the parts of a sequence are merged into its row of o by those log-sum-exps:
//     weight_j = exp(lse_j − lse), lse = log Σ_j exp(lse_j),  o = Σ_j weight_j·o_j
// Parts of all sequences are computed together, so that a few long sequences still give the
// device many independent pieces of work. What must hold (tests):
//   - o agrees with the library's attention_forward of each query over its keys and values laid
//     out contiguously, within fp32 rounding (the merge adds in another order);
//   - with split_tokens >= a sequence's length, its row is that attention_forward's, bit for bit
//     on the CPU backend (a merge of one part leaves the part unchanged);
//   - the result does not depend on the page size or on where the pages are: bit for bit.
// o is overwritten (the tests poison it with NaN first). seqs may repeat a sequence; an empty
// seqs does nothing. Throws std::invalid_argument (naming the values) for split_tokens < 1, a
// sequence of length 0, or shapes that do not fit.
void decode_attention(Context& ctx, const PagedKvCache& cache, int layer, const std::vector<int>& seqs,
                      const Tensor& q, Tensor& o, int split_tokens);

// =============================================================================================
// Part C: the engine
//
// Prefill and decode steps of the dense transformer of k2c/model/transformer.h, whose parameters
// ctx.params holds (a model::Transformer built from `model` and materialized), with a paged KV
// cache of its own (layers n_layers, kv_heads, head_dim = d_model/q_heads). The parameters, by
// name (find_param), for block i:
//   embed.weight [V, d]; blocks.i.norm1.weight [d]; blocks.i.attn.wq.weight [d, d];
//   blocks.i.attn.wk.weight and .wv.weight [kv_heads·hd, d]; blocks.i.attn.wo.weight [d, d];
//   blocks.i.norm2.weight [d]; blocks.i.mlp.gate.weight and .up.weight [d_ff, d];
//   blocks.i.mlp.down.weight [d, d_ff]; final_norm.weight [d]; head.weight [V, d], or with
//   tied_head the embedding's.
// Each step runs the layers as model::Block does (pre-norm attention and SwiGLU, no dropout)
// on the step's rows only: a prefill on every prompt token, a decode on one token per sequence.
// Logits are those of the rows whose next token is wanted; the next token is the largest logit
// (the lower id on a tie), as Ops::top_k orders them.
//
// What must hold (tests): a request's logits at every step equal, within fp32 rounding, those of
// model::Transformer::forward over its whole token sequence recomputed from scratch; bit for bit
// when split_tokens is at least the sequence's length (the same operations in the same order).
struct Step {
  Tensor logits;                       // [n, vocab], n = the step's sequences
  std::vector<std::int32_t> tokens;    // [n]: the greedy next token of each
};

class Engine {
 public:
  // Throws std::invalid_argument for a model with experts (only dense blocks are served), for
  // pages or page_size < 1, split_tokens < 1, or a parameter missing from ctx.params. ctx must
  // outlive the engine.
  Engine(Context& ctx, const ModelConfig& model, int pages, int page_size, int split_tokens);

  const ModelConfig& model() const { return model_; }
  Context& context() { return *ctx_; }
  PagedKvCache& cache() { return cache_; }
  const PagedKvCache& cache() const { return cache_; }
  int split_tokens() const { return split_tokens_; }

  // Sequence seqs[i], created in cache() and empty, is extended by its prompt prompts[i] (>= 1
  // tokens), whose keys and values fill its cache. Returns the logits at each prompt's last
  // position and the next tokens. Throws std::invalid_argument for mismatched sizes, an empty
  // prompt, a token outside [0, vocab), or a sequence that is not empty; std::length_error past
  // a sequence's capacity. Nothing changes in the cache if it throws before computing.
  Step prefill(const std::vector<int>& seqs, const std::vector<std::vector<std::int32_t>>& prompts);
  // Token tokens[i] is appended to sequence seqs[i] (position length(seqs[i]), which becomes one
  // longer). Returns the logits after it and the next tokens. Distinct sequences; throws as
  // prefill does.
  Step decode(const std::vector<int>& seqs, const std::vector<std::int32_t>& tokens);

 private:
  Context* ctx_ = nullptr;
  ModelConfig model_;
  PagedKvCache cache_;
  int split_tokens_ = 1;
  std::vector<ParamId> ids_;  // yours: the parameters, looked up once
};

// =============================================================================================
// Part D: multi-head latent attention (MLA)
//
// H heads; for token x (d numbers) at position t:
//   c    = W_dkv·x              the latent, dc numbers, cached ...
//   kr   = RoPE_t(W_kr·x)       ... with this rotated key of dr numbers, shared by all heads
//   q_h  = [W_qn,h·x ; RoPE_t(W_qr,h·x)]        dn + dr numbers per head
//   k_h  = [W_uk,h·c ; kr],   v_h = W_uv,h·c    keys dn + dr, values dv per head
//   y    = W_o·[o_1; ...; o_H],  o_h = softmax_causal(q_h·k_hᵀ/sqrt(dn + dr))·v_h
// RoPE rotates pairs (i, i + dr/2) as Ops::rope does (positions t, theta rope_theta). Parameters,
// registered by the constructor in this order under `name`.*, Init normal with std 0.02:
//   wq_nope [H·dn, d], wq_rope [H·dr, d], w_dkv [dc, d], w_kr [dr, d], w_uk [H·dn, dc],
//   w_uv [H·dv, dc], wo [d, H·dv]           (head h owns rows [h·dn, (h+1)·dn) of wq_nope, ...)
//
// forward is the training form: per-head keys and values up-projected from the latent, causal
// attention over one sequence. decode is the absorbed form: since q_h·(W_uk,h·c) =
// (W_uk,hᵀ·q_h)·c, the key up-projection folds into the query, and since W_o,h·(W_uv,h·Σ p·c) =
// (W_o,h·W_uv,h)·Σ p·c, the value up-projection folds into the output; attention then runs on
// the cached [c ; kr] itself, one key-value head of dc + dr numbers shared by every query head,
// keys and values alike. absorb() computes the folded weights once.
//
// What must hold (tests): prefill's output equals forward's; each decode row equals the row of
// forward over the whole sequence, within fp32 rounding; the cache holds (dc + dr)·4 bytes per
// token and layer.
struct MlaConfig {
  int d_model = 0, heads = 1;
  int nope_dim = 0;    // dn: the per-head part of queries and keys without position
  int rope_dim = 0;    // dr: the rotated part, even
  int latent_dim = 0;  // dc
  int value_dim = 0;   // dv, at most dn + dr
  float rope_theta = 10000.0f;
};

class Mla {
 public:
  Mla() = default;
  // Registers the parameters; throws std::invalid_argument naming the field for a bad config
  // (sizes < 1, odd rope_dim, value_dim > nope_dim + rope_dim), before registering anything.
  Mla(ParamList& params, const std::string& name, const MlaConfig& config);
  const MlaConfig& config() const { return config_; }

  // y [T, d] for one sequence x [T, d] at positions 0 .. T−1, in the training form.
  void forward(Context& ctx, const Tensor& x, Tensor& y) const;

  // The latent cache for this layer: one layer, one key-value head of dc + dr, shared values.
  CacheConfig cache_config(int pages, int page_size) const;
  // forward on x [T, d] (the prompt of sequence seq, created in `cache` and empty), which is also
  // extended by T and given the latent entries [c ; kr] of every position.
  void prefill(Context& ctx, PagedKvCache& cache, int seq, const Tensor& x, Tensor& y) const;

  // Computes the folded weights (after the parameters are materialized; again if they change).
  // Their memory comes from ctx and lives as long as this Mla.
  void absorb(Context& ctx);
  // The absorbed form: x [B, d], row b the next token of sequence seqs[b] (distinct), which is
  // extended by one and given the token's latent entry; y [B, d] its output. Throws
  // std::logic_error before absorb().
  void decode(Context& ctx, PagedKvCache& cache, const std::vector<int>& seqs, const Tensor& x, Tensor& y,
              int split_tokens) const;

 private:
  MlaConfig config_;
  ParamId wq_nope_ = -1, wq_rope_ = -1, w_dkv_ = -1, w_kr_ = -1, w_uk_ = -1, w_uv_ = -1, wo_ = -1;
  std::vector<Tensor> folded_;  // yours: what absorb() makes
};

// =============================================================================================
// Part E: continuous batching
//
// A request arrives at arrival_s with a prompt and wants output_len tokens (the first from its
// prefill, the rest from decode steps). Time is virtual: a run's clock starts at 0, each step
// advances it by the step's duration (measured, or given by a timer: a cost model makes a run
// reproducible), and when nothing can run the clock jumps to the next arrival.
struct Request {
  int id = 0;
  double arrival_s = 0;
  std::vector<std::int32_t> prompt;
  int output_len = 1;
};

// A trace: `count` requests, ids 0 .. count−1, Poisson arrivals at `rate` per second (exponential
// gaps; rate <= 0: all at time 0), prompt and output lengths uniform in [min, max], prompt tokens
// uniform in [0, vocab), all drawn from `seed` (k2c/core/random.h).
struct TraceConfig {
  int count = 8;
  double rate = 0;
  int min_prompt = 4, max_prompt = 16;
  int min_output = 1, max_output = 8;
  int vocab = 256;
  std::uint64_t seed = 1;
};

inline std::vector<Request> make_trace(const TraceConfig& c) {
  std::vector<Request> trace(static_cast<std::size_t>(std::max(0, c.count)));
  double t = 0;
  auto draw = [&](std::uint64_t i, int lo, int hi) {  // uniform integer in [lo, hi]
    const float u = uniform_at(c.seed, i, 0.0f, 1.0f);
    return lo + std::min(hi - lo, static_cast<int>(u * static_cast<float>(hi - lo + 1)));
  };
  for (int r = 0; r < c.count; ++r) {
    const std::uint64_t base = static_cast<std::uint64_t>(r) << 32;
    if (c.rate > 0 && r > 0) t += -std::log(1.0 - uniform_at(c.seed, base, 0.0f, 1.0f)) / c.rate;
    Request& q = trace[static_cast<std::size_t>(r)];
    q.id = r;
    q.arrival_s = t;
    q.output_len = draw(base + 1, c.min_output, c.max_output);
    q.prompt.resize(static_cast<std::size_t>(draw(base + 2, c.min_prompt, c.max_prompt)));
    for (std::size_t i = 0; i < q.prompt.size(); ++i) q.prompt[i] = draw(base + 3 + i, 0, c.vocab - 1);
  }
  return trace;
}

// What a step did, for a timer: a prefill (sequences prompts, `tokens` prompt tokens), a decode
// (sequences rows, `tokens` = sequences, `context` = their cached tokens attended to), or a
// transfer of `bytes` cache bytes between ranks (part F).
struct StepInfo {
  enum class Kind { prefill, decode, transfer };
  Kind kind = Kind::prefill;
  int sequences = 0;
  std::int64_t tokens = 0, context = 0, bytes = 0;
};
// A step's duration in seconds. Empty: the step's measured wall time (the backend synchronized).
using StepTimer = std::function<double(const StepInfo&)>;

struct ServeConfig {
  int max_batch = 8;  // sequences in the cache at once (prefilling or decoding), >= 1
  StepTimer timer;
};

// The outcome of one request. ok = false: rejected at arrival with `error` naming the request
// and the offending values; it never touched the engine. Times are on the run's clock.
struct RequestResult {
  int id = 0;
  bool ok = false;
  std::string error;
  std::vector<std::int32_t> tokens;  // output_len generated tokens
  double arrival_s = 0, first_token_s = 0, finish_s = 0;
};

// results in trace order; over the ok requests:
//   TTFT = first_token_s − arrival_s; TPOT = (finish_s − first_token_s)/(output_len − 1), only
//   for output_len >= 2; percentile() of each at 50 and 99 (NaN without any);
//   throughput = generated tokens / (last finish − first arrival) (0 if that span is 0).
struct ServeReport {
  std::vector<RequestResult> results;
  double ttft_p50 = 0, ttft_p99 = 0, tpot_p50 = 0, tpot_p99 = 0, throughput = 0;
  int prefill_steps = 0, decode_steps = 0;
  int peak_pages = 0;                 // the most pages in use at once (on the decode rank in part F)
  std::int64_t kv_bytes_sent = 0;     // part F: cache bytes sent from prefill to decode
};

// Fills the figures above from report.results.
void summarize(ServeReport& report);

// Serves `trace` on `engine` (its cache empty and all pages free at the start and again at the
// end). The schedule, one step at a time:
//   1. Requests are looked at in trace order once arrived (arrival_s <= clock). A bad one is
//      rejected then: no prompt, output_len < 1, a token outside [0, vocab), a context
//      (prompt + output_len − 1 tokens, the last token is never fed back) longer than the model's
//      seq_len, or more pages than the whole cache. It never blocks the others.
//   2. Admission, first come first served: while fewer than max_batch sequences are in the cache
//      and the oldest waiting request's context fits in the free pages, it is admitted (its
//      sequence created with that context as max_tokens). A request that does not fit waits, and
//      so does everyone behind it.
//   3. If any request was admitted, the step is ONE prefill of all of them together: each gets
//      its first token at the step's end. Otherwise, if any sequence is decoding, the step is one
//      decode of all of them. Otherwise the clock jumps to the next arrival.
//   4. A request that has all its tokens after a step finishes at the step's end and its
//      sequence is released (a request of output_len 1 finishes at its prefill).
// The clock advances by config.timer of each step (a prefill's StepInfo: sequences, prompt
// tokens; a decode's: sequences, tokens = sequences, context = their lengths before the step).
ServeReport serve(Engine& engine, const std::vector<Request>& trace, const ServeConfig& config);

// =============================================================================================
// Part F: prefill/decode disaggregation
//
// The same trace on two ranks of `comm` (size 2, else std::invalid_argument before
// communicating): rank 0 prefills, rank 1 decodes, each with an engine of the same model (its own
// cache). A prefilled request's cache (length = prompt, every layer's keys and values) travels to
// rank 1 in ONE send of prompt·bytes_per_token bytes (f32), and rank 1 continues it in a
// sequence of its own cache. Both ranks call this with the same trace and config and both return
// the same report (results, figures, kv_bytes_sent: the sum of those sends).
//
// Each rank has its own clock. Rank 0 runs steps 1–3 of serve() with prefill steps only, admitting
// a request only if its context also fits in the pages rank 1 reported free (and no request with
// output_len 1 is sent: it finishes at its prefill). Each send takes timer({transfer, bytes}) on
// rank 0's clock; the request is ready on rank 1 at rank 0's clock after it. Rank 1 admits ready
// requests, oldest first, up to max_batch, and runs decode steps. The two advance in rounds: in
// each, the ranks exchange their clocks, the time of their next step (infinite: none possible)
// and rank 1's free pages, and the rank whose next step comes first runs it (rank 0 on a tie),
// so that neither acts on news from the other's future. Outputs equal serve()'s bit for bit on
// the CPU backend: the same operations on the same rows.
ServeReport serve_disaggregated(Communicator& comm, Engine& engine, const std::vector<Request>& trace,
                                const ServeConfig& config);

}  // namespace k2c::inference
