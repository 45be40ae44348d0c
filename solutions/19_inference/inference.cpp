// solutions/19_inference/inference.cpp — module 19, the reference, parts A–D (contract:
// assignments/19_inference/inference.h; lecture: lectures/19_inference.md; parts E–F are in
// serving.cpp).
//
// Everything here is bookkeeping on the host and a handful of library operations per step. The
// one idea that carries all four parts: a gather is a change of layout. The cache keeps rows
// where they were written (a page never moves); decode attention gathers the rows of each part
// of each sequence into the order one batched attention call wants; MLA's per-head vectors are
// assembled from pieces by one gather over a stack of them. On the CPU backend a gather copies
// bits, so every equality the tests ask for survives it.
//
// Napkin math for decode, which is what serving spends its time on: a decode step reads every
// cached key and value once (2·layers·kv_heads·head_dim·4 bytes per cached token) and does 4·Hq·hd
// FLOPs per token and layer with them, one multiply-add per byte or so: far below any GPU's
// ridge point, so its time is the cache's bytes over memory bandwidth. Version 1 of decode
// attention calls the library's attention once per sequence. This version adds two ideas:
//   - split along the cache: parts of split_tokens keys, all sequences' parts in one call, the
//     partial results merged by their log-sum-exp (a softmax over the parts), so that 4 sequences
//     of 32k tokens are 4·32k/S independent pieces of work instead of 4;
//   - GQA packing: the G = Hq/Hkv query heads that read one key-value head become the G query
//     rows of one problem with a single head, so a kernel that tiles queries reads each key and
//     value once per group instead of once per query head.
// The gather that lays the parts out costs one extra read and write of the cache; part G's kernel
// (decode_kernel.cu) reads the pages in place instead (lecture, section 4).
#include "inference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace k2c::inference {

using model::AttentionShape;
using model::Category;
using model::DType;
using model::Shape;

namespace {

// ---------------------------------------------------------------------------------------------
// helpers

std::string str(std::int64_t v) { return std::to_string(v); }

Tensor upload_i32(Context& ctx, const std::vector<std::int32_t>& host) {
  Tensor t = ctx.tensor({static_cast<std::int64_t>(host.size())}, Category::activations, DType::i32);
  if (!host.empty()) ctx.ops.upload(t, host.data());
  return t;
}

std::vector<std::int32_t> download_i32(Context& ctx, const Tensor& t) {
  std::vector<std::int32_t> host(static_cast<std::size_t>(t.numel()));
  if (!host.empty()) ctx.ops.download(host.data(), t);
  return host;
}

// An index into a pool or a gather source: those are i32 on every backend.
std::int32_t idx(std::int64_t i) { return static_cast<std::int32_t>(i); }

// A mutable view of rows [begin, begin + count) of a matrix (ops want their outputs as lvalues).
Tensor rows_of(const Tensor& t, std::int64_t begin, std::int64_t count) { return t.rows(begin, count); }

// The greedy next token of each row of logits: the largest, the lower id on a tie (top_k's order).
std::vector<std::int32_t> argmax_rows(Context& ctx, const Tensor& logits) {
  const std::int64_t n = logits.dim(0);
  Tensor id = ctx.tensor({n, 1}, Category::activations, DType::i32), val = ctx.tensor({n, 1});
  ctx.ops.top_k(logits, 1, id, val);
  return download_i32(ctx, id);
}

}  // namespace

// =============================================================================================
// Part A: the paged KV cache
//
// The free list is a min-heap of page numbers, so pages go out lowest first: two runs of the same
// schedule lay their sequences out the same way, which makes a failing test reproducible. Pages
// are taken when the length crosses into them (extend), not at create(): create() only reserves
// their number, so that a request admitted once can always grow to its full length (no
// preemption needed), while pages that hold nothing yet stay out of the tables.

PagedKvCache::PagedKvCache(Context& ctx, const CacheConfig& c) : config_(c) {
  auto bad = [](const std::string& field, std::int64_t v) {
    throw std::invalid_argument("CacheConfig: " + field + " " + str(v) + " (must be >= 1)");
  };
  if (c.layers < 1) bad("layers", c.layers);
  if (c.kv_heads < 1) bad("kv_heads", c.kv_heads);
  if (c.head_dim < 1) bad("head_dim", c.head_dim);
  if (c.page_size < 1) bad("page_size", c.page_size);
  if (c.pages < 1) bad("pages", c.pages);
  const std::int64_t rows = static_cast<std::int64_t>(c.pages) * c.page_size;
  // Gathers name rows (and rows of one head, kv_heads per slot) with i32 indices.
  if (rows * c.kv_heads > std::numeric_limits<std::int32_t>::max())
    throw std::invalid_argument("CacheConfig: " + str(rows) + " slots of " + str(c.kv_heads) +
                                " heads are more rows than i32 indices reach");
  const std::int64_t cols = static_cast<std::int64_t>(c.kv_heads) * c.head_dim;
  for (int l = 0; l < c.layers; ++l) {
    keys_.push_back(ctx.tensor({rows, cols}));
    if (!c.shared_values) values_.push_back(ctx.tensor({rows, cols}));
  }
  free_list_.resize(static_cast<std::size_t>(c.pages));
  std::iota(free_list_.begin(), free_list_.end(), 0);
  std::make_heap(free_list_.begin(), free_list_.end(), std::greater<>());
}

std::int64_t PagedKvCache::bytes_per_token() const {
  return (config_.shared_values ? 1 : 2) * static_cast<std::int64_t>(config_.layers) * config_.kv_heads *
         config_.head_dim * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t PagedKvCache::bytes() const {
  return static_cast<std::int64_t>(config_.pages) * config_.page_size * bytes_per_token();
}

int PagedKvCache::create(std::int64_t max_tokens) {
  if (max_tokens < 1) throw std::invalid_argument("cache: a sequence of at most " + str(max_tokens) + " tokens");
  const std::int64_t need = pages_for(max_tokens, config_.page_size);
  if (need > free_pages())
    throw std::length_error("cache: a sequence of up to " + str(max_tokens) + " tokens needs " + str(need) +
                            " pages, " + str(free_pages()) + " are free");
  int id = 0;
  while (id < static_cast<int>(seqs_.size()) && seqs_[id].live) ++id;
  if (id == static_cast<int>(seqs_.size())) seqs_.emplace_back();
  seqs_[id] = Sequence{true, 0, max_tokens, {}};
  reserved_ += static_cast<int>(need);
  return id;
}

bool PagedKvCache::contains(int seq) const {
  return seq >= 0 && seq < static_cast<int>(seqs_.size()) && seqs_[seq].live;
}

namespace {
[[noreturn]] void unknown(int seq) { throw std::out_of_range("cache: no sequence " + std::to_string(seq)); }
}  // namespace

void PagedKvCache::extend(int seq, std::int64_t count) {
  if (!contains(seq)) unknown(seq);
  Sequence& s = seqs_[seq];
  if (count < 0) throw std::invalid_argument("cache: extend by " + str(count));
  if (s.length + count > s.max_tokens)
    throw std::length_error("cache: sequence " + str(seq) + " of " + str(s.length) + " tokens cannot grow by " +
                            str(count) + " past its " + str(s.max_tokens));
  s.length += count;
  while (static_cast<std::int64_t>(s.pages.size()) < pages_for(s.length, config_.page_size)) {
    std::pop_heap(free_list_.begin(), free_list_.end(), std::greater<>());
    s.pages.push_back(free_list_.back());
    free_list_.pop_back();
    --reserved_;  // a reserved page becomes a held one
  }
}

void PagedKvCache::release(int seq) {
  if (!contains(seq)) unknown(seq);
  Sequence& s = seqs_[seq];
  reserved_ -= static_cast<int>(pages_for(s.max_tokens, config_.page_size) - static_cast<std::int64_t>(s.pages.size()));
  for (int p : s.pages) {
    free_list_.push_back(p);
    std::push_heap(free_list_.begin(), free_list_.end(), std::greater<>());
  }
  s = Sequence{};
}

std::int64_t PagedKvCache::length(int seq) const {
  if (!contains(seq)) unknown(seq);
  return seqs_[seq].length;
}

std::int64_t PagedKvCache::capacity(int seq) const {
  if (!contains(seq)) unknown(seq);
  return seqs_[seq].max_tokens;
}

const std::vector<int>& PagedKvCache::page_table(int seq) const {
  if (!contains(seq)) unknown(seq);
  return seqs_[seq].pages;
}

std::int64_t PagedKvCache::slot(int seq, std::int64_t position) const {
  if (!contains(seq)) unknown(seq);
  const Sequence& s = seqs_[seq];
  if (position < 0 || position >= s.length)
    throw std::out_of_range("cache: position " + str(position) + " of sequence " + str(seq) + " of length " +
                            str(s.length));
  const int P = config_.page_size;
  return static_cast<std::int64_t>(s.pages[static_cast<std::size_t>(position / P)]) * P + position % P;
}

int PagedKvCache::free_pages() const { return static_cast<int>(free_list_.size()) - reserved_; }

int PagedKvCache::used_pages() const { return config_.pages - static_cast<int>(free_list_.size()); }

int PagedKvCache::sequences() const {
  return static_cast<int>(std::count_if(seqs_.begin(), seqs_.end(), [](const Sequence& s) { return s.live; }));
}

void PagedKvCache::write(Context& ctx, int layer, int seq, std::int64_t first, const Tensor& k, const Tensor& v) {
  if (layer < 0 || layer >= config_.layers)
    throw std::out_of_range("cache: layer " + str(layer) + " of " + str(config_.layers));
  if (!contains(seq)) unknown(seq);
  const std::int64_t cols = static_cast<std::int64_t>(config_.kv_heads) * config_.head_dim;
  if (k.rank() != 2 || k.dim(1) != cols || !(v.shape() == k.shape()))
    throw std::invalid_argument("cache: write of " + k.shape().str() + " and " + v.shape().str() +
                                ", rows of " + str(cols) + " expected");
  const std::int64_t count = k.dim(0), end = first + count;
  if (first < 0 || end > seqs_[seq].length)
    throw std::out_of_range("cache: write of positions [" + str(first) + ", " + str(end) + ") into sequence " +
                            str(seq) + " of length " + str(seqs_[seq].length) + " (extend it first)");
  // One copy per run of consecutive slots: a prompt costs about length / page_size copies.
  const int P = config_.page_size;
  for (std::int64_t t = first; t < end;) {
    const std::int64_t run = std::min<std::int64_t>(P - t % P, end - t), row = slot(seq, t);
    Tensor kd = rows_of(keys_[layer], row, run);
    ctx.ops.copy(kd, k.rows(t - first, run));
    if (!config_.shared_values) {
      Tensor vd = rows_of(values_[layer], row, run);
      ctx.ops.copy(vd, v.rows(t - first, run));
    }
    t += run;
  }
}

const Tensor& PagedKvCache::keys(int layer) const { return keys_.at(static_cast<std::size_t>(layer)); }

const Tensor& PagedKvCache::values(int layer) const {
  return config_.shared_values ? keys(layer) : values_.at(static_cast<std::size_t>(layer));
}

// =============================================================================================
// Part B: decode attention
//
// Layout of one call, for parts p = 0 .. P−1 (the full-length parts of every sequence first, then
// each sequence's shorter last part), G = Hq/Hkv:
//   qp  [P, Hq·hd]            row p: the query of part p's sequence; seen as [P·Hkv·G, hd], the
//                             G query heads of key-value head kh are G consecutive rows
//   kp  [Σ Hkv·len_p, hd]     part p's keys, head-major: for kh, its len_p rows in order
//   one attention of batch F·Hkv (F full parts), q_len G, kv_len S, one head: the full parts;
//   one of batch Hkv per shorter part. Output op [P, Hq·hd] and lse: entry p·Hq + h.
// Merge. The softmax of a sequence's part log-sum-exps (one row per (sequence, head), padded
// with −inf to the longest) gives exactly the weights exp(lse_j − lse); a scatter-add of the
// weighted part outputs into the zeroed o finishes it. A sequence with one part gets weight
// exp(0)/1 = 1 and o = 0 + 1·o_part: the part's bits.

void decode_attention(Context& ctx, const PagedKvCache& cache, int layer, const std::vector<int>& seqs,
                      const Tensor& q, Tensor& o, int split_tokens) {
  const CacheConfig& c = cache.config();
  const std::int64_t hd = c.head_dim, Hkv = c.kv_heads, B = static_cast<std::int64_t>(seqs.size());
  if (split_tokens < 1) throw std::invalid_argument("decode_attention: split_tokens " + str(split_tokens));
  if (layer < 0 || layer >= c.layers)
    throw std::invalid_argument("decode_attention: layer " + str(layer) + " of " + str(c.layers));
  if (q.rank() != 2 || q.dim(0) != B || q.dim(1) % (hd * Hkv) != 0)
    throw std::invalid_argument("decode_attention: q " + q.shape().str() + " for " + str(B) + " sequences and " +
                                str(Hkv) + " key-value heads of " + str(hd));
  o.expect(q.shape(), "decode_attention: o");
  if (B == 0) return;
  const std::int64_t Hq = q.dim(1) / hd, G = Hq / Hkv, S = split_tokens;

  struct Part {
    std::int64_t b, j, begin, len;
  };
  std::vector<Part> full, tail;
  std::vector<std::int64_t> parts_of(static_cast<std::size_t>(B));
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t L = cache.length(seqs[b]);
    if (L < 1) throw std::invalid_argument("decode_attention: sequence " + str(seqs[b]) + " is empty");
    parts_of[b] = (L + S - 1) / S;
    for (std::int64_t j = 0; j < parts_of[b]; ++j) {
      const Part p{b, j, j * S, std::min(S, L - j * S)};
      (p.len == S ? full : tail).push_back(p);
    }
  }
  std::vector<Part> parts = full;
  parts.insert(parts.end(), tail.begin(), tail.end());
  const std::int64_t P = static_cast<std::int64_t>(parts.size()), F = static_cast<std::int64_t>(full.size());

  // The gathers' index lists: the queries by part, the cache rows (slot·Hkv + kh: a pool seen as
  // one head per row) by part and head. The second has a row per cached token and head, millions
  // for long sequences, so it is built from the page tables directly.
  std::vector<std::int32_t> q_rows, kv_rows, slots;
  std::int64_t rows = 0;
  for (const Part& p : parts) rows += p.len * Hkv;
  kv_rows.reserve(static_cast<std::size_t>(rows));
  const std::int64_t page = c.page_size;
  for (const Part& p : parts) {
    q_rows.push_back(idx(p.b));
    const std::vector<int>& table = cache.page_table(seqs[p.b]);
    slots.resize(static_cast<std::size_t>(p.len));
    for (std::int64_t t = 0; t < p.len; ++t) {
      const std::int64_t pos = p.begin + t;
      slots[t] = idx(table[static_cast<std::size_t>(pos / page)] * page + pos % page);
    }
    for (std::int64_t kh = 0; kh < Hkv; ++kh)
      for (std::int32_t slot : slots) kv_rows.push_back(idx(slot * Hkv + kh));
  }
  const Tensor kv_index = upload_i32(ctx, kv_rows), q_index = upload_i32(ctx, q_rows);
  const std::int64_t R = static_cast<std::int64_t>(kv_rows.size()), pool_rows = cache.keys(layer).dim(0) * Hkv;
  Tensor kp = ctx.tensor({R, hd}), vp = ctx.tensor({R, hd}), qp = ctx.tensor({P, Hq * hd}), op = ctx.tensor({P, Hq * hd});
  ctx.ops.gather_rows(cache.keys(layer).reshaped({pool_rows, hd}), kv_index, kp);
  ctx.ops.gather_rows(cache.values(layer).reshaped({pool_rows, hd}), kv_index, vp);
  ctx.ops.gather_rows(q, q_index, qp);

  // Every part's lse, and one −inf after them that pads the merge's rows.
  Tensor lse = ctx.tensor({P * Hq + 1, 1});
  Tensor pad = rows_of(lse, P * Hq, 1);
  ctx.ops.fill(pad, -std::numeric_limits<float>::infinity());
  auto attend = [&](std::int64_t first, std::int64_t count, std::int64_t kv_row, std::int64_t len) {
    AttentionShape s;
    s.batch = static_cast<int>(count * Hkv);
    s.q_len = static_cast<int>(G);
    s.kv_len = static_cast<int>(len);
    s.q_heads = s.kv_heads = 1;
    s.head_dim = static_cast<int>(hd);
    s.causal = false;
    Tensor out = rows_of(op, first, count).reshaped({count * Hq, hd});
    Tensor l = rows_of(lse, first * Hq, count * Hq).reshaped({count * Hkv, 1, G});
    ctx.ops.attention_forward(s, qp.rows(first, count).reshaped({count * Hq, hd}),
                              kp.rows(kv_row, count * Hkv * len), vp.rows(kv_row, count * Hkv * len), out, l);
  };
  if (F > 0) attend(0, F, 0, S);
  std::int64_t kv_row = F * Hkv * S;
  for (std::int64_t i = F; i < P; ++i) {
    attend(i, 1, kv_row, parts[i].len);
    kv_row += Hkv * parts[i].len;
  }

  // Where part i of sequence b sits: its index in `parts`.
  std::int64_t n_max = 0;
  for (std::int64_t n : parts_of) n_max = std::max(n_max, n);
  std::vector<std::int64_t> part_at(static_cast<std::size_t>(B * n_max), -1);
  for (std::int64_t i = 0; i < P; ++i) part_at[parts[i].b * n_max + parts[i].j] = i;
  std::vector<std::int32_t> grid_rows, weight_rows, target_rows;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t j = 0; j < n_max; ++j) {
        const std::int64_t i = part_at[b * n_max + j];
        grid_rows.push_back(idx(i < 0 ? P * Hq : i * Hq + h));
      }
  for (const Part& p : parts)
    for (std::int64_t h = 0; h < Hq; ++h) {
      weight_rows.push_back(idx((p.b * Hq + h) * n_max + p.j));
      target_rows.push_back(idx(p.b * Hq + h));
    }
  Tensor grid = ctx.tensor({B * Hq, n_max}), weight = ctx.tensor({B * Hq, n_max}), scale = ctx.tensor({P * Hq, 1});
  Tensor grid_column = grid.reshaped({B * Hq * n_max, 1});
  ctx.ops.gather_rows(lse, upload_i32(ctx, grid_rows), grid_column);
  ctx.ops.softmax_rows(grid, weight);
  ctx.ops.gather_rows(weight.reshaped({B * Hq * n_max, 1}), upload_i32(ctx, weight_rows), scale);
  Tensor heads = o.reshaped({B * Hq, hd});
  ctx.ops.fill(heads, 0.0f);
  const Tensor scale_flat = scale.reshaped({P * Hq});
  ctx.ops.scatter_add_rows(op.reshaped({P * Hq, hd}), upload_i32(ctx, target_rows), &scale_flat, heads);
}

// =============================================================================================
// Part C: the engine
//
// A step is model::Block's forward on the step's rows, with attention replaced: a prefill
// attends each prompt to itself (the library's causal attention, one call per prompt: prompts
// differ in length), a decode attends each new token to its cache. Both write the keys and
// values they computed into the cache first. Only the rows whose next token is wanted pass the
// final norm and the head, which for a long prompt is most of a prefill's head GEMM saved.

namespace {

// The parameters of ids_, in this order: embed, final_norm, head, then per layer the nine below.
enum LayerWeight { kNorm1, kWq, kWk, kWv, kWo, kNorm2, kGate, kUp, kDown, kPerLayer };
constexpr int kGlobal = 3;

ParamId expect_param(const ParamList& params, const std::string& name, const Shape& shape) {
  const ParamId id = find_param(params, name);
  if (!(params.info(id).shape == shape))
    throw std::invalid_argument("engine: parameter '" + name + "' is " + params.info(id).shape.str() +
                                ", the model config says " + shape.str());
  return id;
}

// Writes the step's keys and values into the cache and computes the attention output o [N, d]
// from q [N, d] (RoPE applied), for one layer.
using Attend = std::function<void(int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o)>;

// x [N, d] through every block, in place; positions i32 [N] (one per row: the rows of a step
// belong to different sequences).
void run_blocks(Context& ctx, const ModelConfig& m, const std::vector<ParamId>& ids, Tensor& x,
                const Tensor& positions, const Attend& attend) {
  ParamList& w = ctx.params;
  const std::int64_t N = x.dim(0), d = m.d_model, hd = d / m.q_heads, kv = static_cast<std::int64_t>(m.kv_heads) * hd;
  model::Ops& ops = ctx.ops;
  Tensor rstd = ctx.tensor({N}), n = ctx.tensor({N, d}), q = ctx.tensor({N, d}), k = ctx.tensor({N, kv}),
         v = ctx.tensor({N, kv}), o = ctx.tensor({N, d}), a = ctx.tensor({N, d}), h = ctx.tensor({N, d}),
         gate = ctx.tensor({N, m.d_ff}), up = ctx.tensor({N, m.d_ff}), mlp = ctx.tensor({N, d});
  for (int l = 0; l < m.n_layers; ++l) {
    const ParamId* p = ids.data() + kGlobal + l * kPerLayer;
    ops.rmsnorm_forward(x, w.value(p[kNorm1]), m.norm_eps, n, rstd);
    ops.matmul(n, false, w.value(p[kWq]), true, q, 1.0f, 0.0f);
    ops.matmul(n, false, w.value(p[kWk]), true, k, 1.0f, 0.0f);
    ops.matmul(n, false, w.value(p[kWv]), true, v, 1.0f, 0.0f);
    ops.rope(q, positions, m.q_heads, static_cast<int>(hd), m.rope_theta, false);
    ops.rope(k, positions, m.kv_heads, static_cast<int>(hd), m.rope_theta, false);
    attend(l, q, k, v, o);
    ops.matmul(o, false, w.value(p[kWo]), true, a, 1.0f, 0.0f);
    ops.add(x, a, h);
    ops.rmsnorm_forward(h, w.value(p[kNorm2]), m.norm_eps, n, rstd);
    ops.matmul(n, false, w.value(p[kGate]), true, gate, 1.0f, 0.0f);
    ops.matmul(n, false, w.value(p[kUp]), true, up, 1.0f, 0.0f);
    ops.swiglu_forward(gate, up, gate);
    ops.matmul(gate, false, w.value(p[kDown]), true, mlp, 1.0f, 0.0f);
    ops.add(h, mlp, x);
  }
}

// Final norm and head on the rows of x that `last` names: the logits of the step.
Step finish(Context& ctx, const ModelConfig& m, const std::vector<ParamId>& ids, const Tensor& x,
            const std::vector<std::int32_t>& last) {
  const std::int64_t n = static_cast<std::int64_t>(last.size());
  Tensor rows = ctx.tensor({n, m.d_model}), normed = ctx.tensor({n, m.d_model}), rstd = ctx.tensor({n});
  ctx.ops.gather_rows(x, upload_i32(ctx, last), rows);
  ctx.ops.rmsnorm_forward(rows, ctx.params.value(ids[1]), m.norm_eps, normed, rstd);
  Step step;
  step.logits = ctx.tensor({n, m.vocab});
  ctx.ops.matmul(normed, false, ctx.params.value(ids[2]), true, step.logits, 1.0f, 0.0f);
  step.tokens = argmax_rows(ctx, step.logits);
  return step;
}

void check_tokens(const ModelConfig& m, const std::vector<std::int32_t>& tokens, const char* what) {
  for (std::int32_t t : tokens)
    if (t < 0 || t >= m.vocab)
      throw std::invalid_argument(std::string(what) + ": token " + std::to_string(t) + " outside [0, " +
                                  std::to_string(m.vocab) + ")");
}

}  // namespace

Engine::Engine(Context& ctx, const ModelConfig& model, int pages, int page_size, int split_tokens)
    : ctx_(&ctx), model_(model), split_tokens_(split_tokens) {
  model.check();
  if (model.experts > 0)
    throw std::invalid_argument("engine: serves dense models only; this one has " + str(model.experts) + " experts");
  if (split_tokens < 1) throw std::invalid_argument("engine: split_tokens " + str(split_tokens));
  const std::int64_t d = model.d_model, hd = d / model.q_heads, kv = model.kv_heads * hd;
  ids_.push_back(expect_param(ctx.params, "embed.weight", {model.vocab, d}));
  ids_.push_back(expect_param(ctx.params, "final_norm.weight", {d}));
  ids_.push_back(model.tied_head ? ids_[0] : expect_param(ctx.params, "head.weight", {model.vocab, d}));
  for (int l = 0; l < model.n_layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    const std::pair<const char*, Shape> layer[kPerLayer] = {
        {"norm1.weight", {d}},         {"attn.wq.weight", {d, d}},  {"attn.wk.weight", {kv, d}},
        {"attn.wv.weight", {kv, d}},   {"attn.wo.weight", {d, d}},  {"norm2.weight", {d}},
        {"mlp.gate.weight", {model.d_ff, d}}, {"mlp.up.weight", {model.d_ff, d}}, {"mlp.down.weight", {d, model.d_ff}}};
    for (const auto& [name, shape] : layer) ids_.push_back(expect_param(ctx.params, b + name, shape));
  }
  cache_ = PagedKvCache(ctx, {model.n_layers, model.kv_heads, static_cast<int>(hd), page_size, pages, false});
}

Step Engine::prefill(const std::vector<int>& seqs, const std::vector<std::vector<std::int32_t>>& prompts) {
  Context& ctx = *ctx_;
  if (seqs.size() != prompts.size())
    throw std::invalid_argument("prefill: " + str(static_cast<std::int64_t>(seqs.size())) + " sequences, " +
                                str(static_cast<std::int64_t>(prompts.size())) + " prompts");
  std::vector<std::int32_t> ids, positions, last;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const std::int64_t T = static_cast<std::int64_t>(prompts[i].size());
    if (T < 1) throw std::invalid_argument("prefill: prompt " + str(static_cast<std::int64_t>(i)) + " is empty");
    check_tokens(model_, prompts[i], "prefill");
    if (cache_.length(seqs[i]) != 0)
      throw std::invalid_argument("prefill: sequence " + str(seqs[i]) + " already holds " +
                                  str(cache_.length(seqs[i])) + " tokens");
    if (T > cache_.capacity(seqs[i]))
      throw std::length_error("prefill: a prompt of " + str(T) + " tokens in sequence " + str(seqs[i]) +
                              " of capacity " + str(cache_.capacity(seqs[i])));
    ids.insert(ids.end(), prompts[i].begin(), prompts[i].end());
    for (std::int64_t t = 0; t < T; ++t) positions.push_back(idx(t));
    last.push_back(idx(static_cast<std::int64_t>(ids.size()) - 1));
  }
  for (std::size_t i = 0; i < seqs.size(); ++i) cache_.extend(seqs[i], static_cast<std::int64_t>(prompts[i].size()));
  if (seqs.empty()) return {ctx.tensor({0, model_.vocab}), {}};

  const std::int64_t rows = static_cast<std::int64_t>(ids.size());
  Tensor x = ctx.tensor({rows, model_.d_model});
  ctx.ops.embedding_forward(upload_i32(ctx, ids), ctx.params.value(ids_[0]), x);
  const int hd = model_.d_model / model_.q_heads;
  Attend attend = [&](int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o) {
    std::int64_t row = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const std::int64_t T = static_cast<std::int64_t>(prompts[i].size());
      cache_.write(ctx, layer, seqs[i], 0, k.rows(row, T), v.rows(row, T));
      AttentionShape s{1, static_cast<int>(T), static_cast<int>(T), model_.q_heads, model_.kv_heads, hd, true, 0, 0};
      Tensor out = rows_of(o, row, T), lse = ctx.tensor({1, model_.q_heads, T});
      ctx.ops.attention_forward(s, q.rows(row, T), k.rows(row, T), v.rows(row, T), out, lse);
      row += T;
    }
  };
  run_blocks(ctx, model_, ids_, x, upload_i32(ctx, positions), attend);
  return finish(ctx, model_, ids_, x, last);
}

Step Engine::decode(const std::vector<int>& seqs, const std::vector<std::int32_t>& tokens) {
  Context& ctx = *ctx_;
  if (seqs.size() != tokens.size())
    throw std::invalid_argument("decode: " + str(static_cast<std::int64_t>(seqs.size())) + " sequences, " +
                                str(static_cast<std::int64_t>(tokens.size())) + " tokens");
  check_tokens(model_, tokens, "decode");
  std::vector<std::int32_t> positions, last;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    if (std::find(seqs.begin(), seqs.begin() + static_cast<std::ptrdiff_t>(i), seqs[i]) != seqs.begin() + static_cast<std::ptrdiff_t>(i))
      throw std::invalid_argument("decode: sequence " + str(seqs[i]) + " twice in one step");
    const std::int64_t L = cache_.length(seqs[i]);
    if (L + 1 > cache_.capacity(seqs[i]))
      throw std::length_error("decode: sequence " + str(seqs[i]) + " is full (" + str(L) + " tokens)");
    positions.push_back(idx(L));
    last.push_back(idx(static_cast<std::int64_t>(i)));
  }
  for (int s : seqs) cache_.extend(s, 1);
  if (seqs.empty()) return {ctx.tensor({0, model_.vocab}), {}};

  const std::int64_t B = static_cast<std::int64_t>(seqs.size());
  Tensor x = ctx.tensor({B, model_.d_model});
  ctx.ops.embedding_forward(upload_i32(ctx, tokens), ctx.params.value(ids_[0]), x);
  Attend attend = [&](int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o) {
    for (std::int64_t b = 0; b < B; ++b) cache_.write(ctx, layer, seqs[b], positions[b], k.rows(b, 1), v.rows(b, 1));
    decode_attention(ctx, cache_, layer, seqs, q, o, split_tokens_);
  };
  run_blocks(ctx, model_, ids_, x, upload_i32(ctx, positions), attend);
  return finish(ctx, model_, ids_, x, last);
}

// =============================================================================================
// Part D: multi-head latent attention
//
// Assembling per-head vectors. The library's attention wants each head's query, key and value
// as one contiguous block of a row, but MLA computes them in pieces (the latent part and the
// rotated part, and in the training form a key part shared by every head). Concatenating columns
// is a gather of rows: cut every piece into units of u numbers (u divides every width), stack the
// pieces' units as rows of one matrix, and gather the units in the order of the output row. It
// moves bits, so the training form's keys are exactly W_uk,h·c next to exactly kr.

namespace {

// A piece of each output head: `width` numbers per head per token from `t`, which holds one
// block per head (per_head) or one block all heads share. A null `t` is zeros (value padding).
struct Piece {
  const Tensor* t;
  std::int64_t width;
  bool per_head;
};

// out [T, H·Σ width] = for each token and head, the pieces side by side.
void assemble(Context& ctx, std::int64_t T, std::int64_t H, const std::vector<Piece>& pieces, Tensor& out) {
  std::int64_t u = 0, total = 0;
  for (const Piece& p : pieces) {
    u = std::gcd(u, p.width);
    total += p.width;
  }
  out.expect({T, H * total}, "mla: assembled heads");
  // The stack: each tensor piece's units, then one unit of zeros.
  std::vector<std::int64_t> first(pieces.size());
  std::int64_t units = 0;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    first[i] = units;
    if (pieces[i].t) units += pieces[i].t->numel() / u;
  }
  Tensor stack = ctx.tensor({units + 1, u});
  for (std::size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].t) {
      Tensor dst = rows_of(stack, first[i], pieces[i].t->numel() / u);
      ctx.ops.copy(dst, pieces[i].t->reshaped({pieces[i].t->numel() / u, u}));
    }
  Tensor zero = rows_of(stack, units, 1);
  ctx.ops.fill(zero, 0.0f);
  std::vector<std::int32_t> order;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        const Piece& p = pieces[i];
        const std::int64_t n = p.width / u, row0 = (t * (p.per_head ? H : 1) + (p.per_head ? h : 0)) * n;
        for (std::int64_t k = 0; k < n; ++k) order.push_back(idx(p.t ? first[i] + row0 + k : units));
      }
  Tensor flat = out.reshaped({T * H * total / u, u});
  ctx.ops.gather_rows(stack, upload_i32(ctx, order), flat);
}

// out [T, H·keep] = the first `keep` numbers of every head of in [T, H·width].
void first_of_heads(Context& ctx, const Tensor& in, std::int64_t H, std::int64_t width, std::int64_t keep, Tensor& out) {
  const std::int64_t T = in.dim(0), u = std::gcd(width, keep);
  std::vector<std::int32_t> order;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t k = 0; k < keep / u; ++k) order.push_back(idx((t * H + h) * (width / u) + k));
  Tensor flat = out.reshaped({T * H * keep / u, u});
  ctx.ops.gather_rows(in.reshaped({T * H * width / u, u}), upload_i32(ctx, order), flat);
}

// The latent entries [c ; kr] of x [T, d] at `positions`: [T, dc + dr].
Tensor latent(Context& ctx, const MlaConfig& c, ParamId w_dkv, ParamId w_kr, const Tensor& x, const Tensor& positions) {
  const std::int64_t T = x.dim(0);
  Tensor lat = ctx.tensor({T, c.latent_dim}), kr = ctx.tensor({T, c.rope_dim}), out = ctx.tensor({T, c.latent_dim + c.rope_dim});
  ctx.ops.matmul(x, false, ctx.params.value(w_dkv), true, lat, 1.0f, 0.0f);
  ctx.ops.matmul(x, false, ctx.params.value(w_kr), true, kr, 1.0f, 0.0f);
  ctx.ops.rope(kr, positions, 1, c.rope_dim, c.rope_theta, false);
  assemble(ctx, T, 1, {{&lat, c.latent_dim, false}, {&kr, c.rope_dim, false}}, out);
  return out;
}

Tensor iota_positions(Context& ctx, std::int64_t count) {
  std::vector<std::int32_t> first_positions(static_cast<std::size_t>(count));
  std::iota(first_positions.begin(), first_positions.end(), 0);
  return upload_i32(ctx, first_positions);
}

enum Folded { kQLatent, kQRope, kOut, kFolded };

}  // namespace

Mla::Mla(ParamList& params, const std::string& name, const MlaConfig& c) : config_(c) {
  auto bad = [&](const std::string& what) { throw std::invalid_argument("mla '" + name + "': " + what); };
  if (c.d_model < 1 || c.heads < 1 || c.nope_dim < 1 || c.rope_dim < 1 || c.latent_dim < 1 || c.value_dim < 1)
    bad("sizes must be >= 1 (d_model " + str(c.d_model) + ", heads " + str(c.heads) + ", nope_dim " + str(c.nope_dim) +
        ", rope_dim " + str(c.rope_dim) + ", latent_dim " + str(c.latent_dim) + ", value_dim " + str(c.value_dim) + ")");
  if (c.rope_dim % 2) bad("rope_dim " + str(c.rope_dim) + " must be even (RoPE rotates pairs)");
  if (c.value_dim > c.nope_dim + c.rope_dim)
    bad("value_dim " + str(c.value_dim) + " is more than nope_dim + rope_dim = " + str(c.nope_dim + c.rope_dim));
  const std::int64_t d = c.d_model, H = c.heads;
  wq_nope_ = params.add(name + ".wq_nope", {H * c.nope_dim, d}, {});
  wq_rope_ = params.add(name + ".wq_rope", {H * c.rope_dim, d}, {});
  w_dkv_ = params.add(name + ".w_dkv", {c.latent_dim, d}, {});
  w_kr_ = params.add(name + ".w_kr", {c.rope_dim, d}, {});
  w_uk_ = params.add(name + ".w_uk", {H * c.nope_dim, c.latent_dim}, {});
  w_uv_ = params.add(name + ".w_uv", {H * c.value_dim, c.latent_dim}, {});
  wo_ = params.add(name + ".wo", {d, H * c.value_dim}, {});
}

CacheConfig Mla::cache_config(int pages, int page_size) const {
  return {1, 1, config_.latent_dim + config_.rope_dim, page_size, pages, true};
}

void Mla::forward(Context& ctx, const Tensor& x, Tensor& y) const {
  const MlaConfig& c = config_;
  const std::int64_t T = x.dim(0), H = c.heads, dn = c.nope_dim, dr = c.rope_dim, dv = c.value_dim, dqk = dn + dr;
  x.expect({T, c.d_model}, "mla: x");
  y.expect({T, c.d_model}, "mla: y");
  if (T == 0) return;
  model::Ops& ops = ctx.ops;
  ParamList& w = ctx.params;
  const Tensor positions = iota_positions(ctx, T);
  Tensor qn = ctx.tensor({T, H * dn}), qr = ctx.tensor({T, H * dr}), lat = ctx.tensor({T, c.latent_dim}),
         kr = ctx.tensor({T, dr}), kn = ctx.tensor({T, H * dn}), v = ctx.tensor({T, H * dv});
  ops.matmul(x, false, w.value(wq_nope_), true, qn, 1.0f, 0.0f);
  ops.matmul(x, false, w.value(wq_rope_), true, qr, 1.0f, 0.0f);
  ops.rope(qr, positions, c.heads, c.rope_dim, c.rope_theta, false);
  ops.matmul(x, false, w.value(w_dkv_), true, lat, 1.0f, 0.0f);
  ops.matmul(x, false, w.value(w_kr_), true, kr, 1.0f, 0.0f);
  ops.rope(kr, positions, 1, c.rope_dim, c.rope_theta, false);
  ops.matmul(lat, false, w.value(w_uk_), true, kn, 1.0f, 0.0f);  // the per-head keys, from the latent
  ops.matmul(lat, false, w.value(w_uv_), true, v, 1.0f, 0.0f);   // and values
  Tensor Q = ctx.tensor({T, H * dqk}), K = ctx.tensor({T, H * dqk}), V = ctx.tensor({T, H * dqk}),
         O = ctx.tensor({T, H * dqk}), lse = ctx.tensor({1, c.heads, T}), Ov = ctx.tensor({T, H * dv});
  assemble(ctx, T, H, {{&qn, dn, true}, {&qr, dr, true}}, Q);
  assemble(ctx, T, H, {{&kn, dn, true}, {&kr, dr, false}}, K);
  assemble(ctx, T, H, {{&v, dv, true}, {nullptr, dqk - dv, true}}, V);  // values padded to the head width
  const AttentionShape s{1, static_cast<int>(T), static_cast<int>(T), c.heads, c.heads, static_cast<int>(dqk), true, 0, 0};
  ops.attention_forward(s, Q, K, V, O, lse);
  first_of_heads(ctx, O, H, dqk, dv, Ov);
  ops.matmul(Ov, false, w.value(wo_), true, y, 1.0f, 0.0f);
}

void Mla::prefill(Context& ctx, PagedKvCache& cache, int seq, const Tensor& x, Tensor& y) const {
  const CacheConfig want = cache_config(1, 1), got = cache.config();
  if (got.layers != 1 || got.kv_heads != 1 || got.head_dim != want.head_dim || !got.shared_values)
    throw std::invalid_argument("mla: the cache is not this layer's latent cache (Mla::cache_config)");
  if (cache.length(seq) != 0) throw std::invalid_argument("mla: prefill into sequence " + str(seq) + ", not empty");
  const std::int64_t T = x.dim(0);
  cache.extend(seq, T);  // throws past the capacity before any work
  forward(ctx, x, y);
  const Tensor entries = latent(ctx, config_, w_dkv_, w_kr_, x, iota_positions(ctx, T));
  cache.write(ctx, 0, seq, 0, entries, entries);
}

// The folded weights, for the scale 1/sqrt(dc + dr) that attention over the cached entries uses
// instead of the model's 1/sqrt(dn + dr): both query parts are multiplied by s = sqrt((dc + dr) /
// (dn + dr)).
//   kQLatent [H·dc, d]        head h: s·W_uk,hᵀ·W_qn,h, so the query's latent part is x·(it)ᵀ
//   kQRope   [H·dr, d]        s·wq_rope (RoPE is linear: rotating s·q is s times rotating q)
//   kOut     [H·(dc + dr), d] head h's rows: W_uv,hᵀ·W_o,hᵀ, then dr rows of zeros, so that
//                             y = o·kOut reads the latent part of each head's output and ignores
//                             the rotated part that attending to [c ; kr] also averages.
// W_o,hᵀ is rows h·dv .. of W_oᵀ; the library has no transpose, but I·W_oᵀ is one (exact in fp32).
void Mla::absorb(Context& ctx) {
  const MlaConfig& c = config_;
  const std::int64_t H = c.heads, d = c.d_model, dn = c.nope_dim, dr = c.rope_dim, dc = c.latent_dim, dv = c.value_dim;
  model::Ops& ops = ctx.ops;
  ParamList& w = ctx.params;
  const float s = std::sqrt(static_cast<float>(dc + dr) / static_cast<float>(dn + dr));
  folded_.clear();
  folded_.push_back(ctx.tensor({H * dc, d}, Category::params));
  folded_.push_back(ctx.tensor({H * dr, d}, Category::params));
  folded_.push_back(ctx.tensor({H * (dc + dr), d}, Category::params));
  for (std::int64_t h = 0; h < H; ++h) {
    Tensor qh = rows_of(folded_[kQLatent], h * dc, dc);
    ops.matmul(w.value(w_uk_).rows(h * dn, dn), true, w.value(wq_nope_).rows(h * dn, dn), false, qh, s, 0.0f);
  }
  ops.copy(folded_[kQRope], w.value(wq_rope_));
  ops.scale(folded_[kQRope], s);
  std::vector<float> eye(static_cast<std::size_t>(H * dv * H * dv), 0.0f);
  for (std::int64_t i = 0; i < H * dv; ++i) eye[static_cast<std::size_t>(i * H * dv + i)] = 1.0f;
  Tensor identity = ctx.tensor({H * dv, H * dv}), wo_t = ctx.tensor({H * dv, d});
  ops.upload(identity, eye.data());
  ops.matmul(identity, false, w.value(wo_), true, wo_t, 1.0f, 0.0f);
  ops.fill(folded_[kOut], 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    Tensor oh = rows_of(folded_[kOut], h * (dc + dr), dc);
    ops.matmul(w.value(w_uv_).rows(h * dv, dv), true, wo_t.rows(h * dv, dv), false, oh, 1.0f, 0.0f);
  }
}

void Mla::decode(Context& ctx, PagedKvCache& cache, const std::vector<int>& seqs, const Tensor& x, Tensor& y,
                 int split_tokens) const {
  if (folded_.size() != kFolded) throw std::logic_error("mla: decode before absorb()");
  const MlaConfig& c = config_;
  const std::int64_t B = static_cast<std::int64_t>(seqs.size()), H = c.heads, dc = c.latent_dim, dr = c.rope_dim;
  x.expect({B, c.d_model}, "mla: x");
  y.expect({B, c.d_model}, "mla: y");
  if (cache.config().head_dim != dc + dr || !cache.config().shared_values)
    throw std::invalid_argument("mla: the cache is not this layer's latent cache (Mla::cache_config)");
  std::vector<std::int32_t> positions;
  for (std::int64_t b = 0; b < B; ++b) {
    if (std::count(seqs.begin(), seqs.end(), seqs[b]) > 1)
      throw std::invalid_argument("mla: sequence " + str(seqs[b]) + " twice in one step");
    if (cache.length(seqs[b]) + 1 > cache.capacity(seqs[b]))
      throw std::length_error("mla: sequence " + str(seqs[b]) + " is full");
    positions.push_back(idx(cache.length(seqs[b])));
  }
  if (B == 0) return;
  for (int s : seqs) cache.extend(s, 1);
  const Tensor pos = upload_i32(ctx, positions);
  const Tensor entries = latent(ctx, c, w_dkv_, w_kr_, x, pos);
  for (std::int64_t b = 0; b < B; ++b) cache.write(ctx, 0, seqs[b], positions[b], entries.rows(b, 1), entries.rows(b, 1));

  Tensor qc = ctx.tensor({B, H * dc}), qr = ctx.tensor({B, H * dr}), q = ctx.tensor({B, H * (dc + dr)}),
         o = ctx.tensor({B, H * (dc + dr)});
  ctx.ops.matmul(x, false, folded_[kQLatent], true, qc, 1.0f, 0.0f);
  ctx.ops.matmul(x, false, folded_[kQRope], true, qr, 1.0f, 0.0f);
  ctx.ops.rope(qr, pos, c.heads, c.rope_dim, c.rope_theta, false);
  assemble(ctx, B, H, {{&qc, dc, true}, {&qr, dr, true}}, q);
  decode_attention(ctx, cache, 0, seqs, q, o, split_tokens);
  ctx.ops.matmul(o, false, folded_[kOut], false, y, 1.0f, 0.0f);
}

}  // namespace k2c::inference
