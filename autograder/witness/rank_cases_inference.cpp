// autograder/witness/rank_cases_inference.cpp — k2c_rank_witness's cases of module 19: split-KV
// decode attention over a paged cache, the engine's decode steps against a recomputation, and MLA
// in both forms.
// Module 19's work is one process's; every rank gets the same case and must answer it alone.
//
// decode_attention
//   args: 0 kv_heads, 1 head_dim, 2 q_heads, 3 page_size, 4 pages, 5 split_tokens, 6 S sequences,
//   7 B queries, 8 filler tokens F, 9 layers L, 10 the layer read, 11 where the writes cut a
//   sequence (per mille of its length). Input: the lengths int64 [S], the queries' sequences int32
//   [B] (indices into the S, repeats allowed), then per sequence its keys and values [length,
//   kv_heads·head_dim] one after the other, then q [B, q_heads·head_dim]. The rank makes a cache
//   of L layers ({L, kv_heads, head_dim, page_size, pages}); before each sequence it creates and
//   extends a filler of F tokens (created for at least one), released at the end, so that the
//   sequences' pages are scattered over the pool. It writes each sequence's keys and values into
//   the layer read in two calls, the positions from the cut on first (at that offset), then those
//   before it, and then decoys (keys −v, values −k) into every other layer: a write that ignores
//   its offset or its layer, or a read of another layer, answers wrong. It runs decode_attention
//   over the queries' sequences on the layer read and answers o [B, q_heads·head_dim]. Reference:
//   each query's attention over its sequence in double (query head h reads key-value head
//   h / (q_heads/kv_heads)).
//
// engine_decode
//   args: 0 pages, 1 page_size, 2 split_tokens, 3 R requests, 4 .. 11 the model (as the training
//   checks: vocab, d_model, n_layers, q_heads, kv_heads, d_ff, seq_len, tied head), 12 the weights'
//   seed, 13 init_std (the float's bits; large, so that attention decides the logits). Input: per
//   request its prompt length and its decode steps (int32 pairs), then each request's fed tokens
//   int32 [prompt + steps − 1]. The rank builds model::Transformer over its parameters,
//   materializes them, makes an Engine, creates each request's sequence, prefills the prompts
//   together, then decodes the requests still running one step at a time with the checker's next
//   token (teacher forcing, so no greedy choice is involved). The answer: the logits rows in the
//   order they came, [R] of the prefill, then per decode step those of the running requests in
//   request order, all NaN where a step's greedy tokens are not a largest logit of their rows. Reference: model::Transformer::forward over each request's fed tokens in this
//   process; to the bit where split_tokens ≥ seq_len (the contract: the same operations in the
//   same order), else each row within 1e-5 of its largest |logit| plus 1e-4 relative.
//
// mla_decode
//   args: 0 d_model, 1 heads, 2 nope_dim, 3 rope_dim, 4 latent_dim, 5 value_dim, 6 T, 7 T0 (1 .. T−1),
//   8 pages, 9 page_size, 10 split_tokens, 12 the seed the rank materializes from (its values are
//   then replaced), 13 T2, 14 T02 (1 .. T2−1), 15 1 when the second sequence's row comes first.
//   Input: the weights wq_nope, wq_rope, w_dkv, w_kr, w_uk, w_uv, wo (as inference.h registers
//   them, about 0.5 in size), then x [T, d], then a second sequence x2 [T2, d]. The rank builds Mla
//   "attn", replaces its weights, runs forward over x, prefills the first T0 tokens of x and the
//   first T02 of x2 into a cache of cache_config(pages, page_size), absorbs, and decodes the rest
//   one token at a time, both sequences in one call while both have tokens left (in the order of
//   arg 15), then the longer alone. The answer: forward's y [T, d], prefill's [T0, d] (forward's
//   rows to the bit, as the contract says), then x's decoded rows [T − T0, d] and x2's
//   [T2 − T02, d]. Reference: k2c::ref::mla_forward, the equations in double; forward and decode
//   within 1e-4 of the largest |y| plus 1e-4 relative (module 19's test's).
//
// cache_pages
//   args: 0 page_size, 1 pages, 2 operations. Input: the operations, int64 triples (0 create with
//   max_tokens, 1 extend by tokens, 2 release; the sequence as the checker numbers them; the
//   count). The rank runs them on a cache of one layer ({1, 1, 1, page_size, pages}), catching
//   std::length_error and std::out_of_range, and answers one int64 record per operation: the
//   outcome, free_pages(), used_pages(), sequences(), the sequence's length (−1 once released, or
//   never made) and its page table padded with −1 to `pages` entries. Reference: the contract's
//   bookkeeping simulated here (reservations at create, the lowest free page first at extend,
//   refusals that change nothing).
//
// serve_batched, serve_disaggregated
//   args: 0 pages, 1 page_size, 2 split_tokens, 3 R requests, 4 .. 11 the model, 12 the weights'
//   seed, 13 init_std (the float's bits), 14 max_batch. Input: per request its prompt length and
//   output length (int32), its arrival time (double; some together, some while others decode),
//   then its prompt. The rank builds model::Transformer and an Engine as engine_decode does and
//   serves the trace (ids 0 .. R−1) with serve, or serve_disaggregated over the world's two
//   ranks, under the serving tests' cost model; the answer, per request: ok (int32 1/0), how many
//   tokens it made (int32: its output length, no more) and its tokens (int32 [output length]). Reference: each request's greedy continuation alone, the whole
//   model over the sequence so far at every step, drawn again until no step has a near tie.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "k2c/core/random.h"
#include "k2c/model/testing.h"
#include "k2c/model/transformer.h"
#include "k2c/reference/reference.h"
#include "rank_cases.h"

namespace k2c::rank_witness {

namespace {

template <class T>
void append(Bytes& b, const T* v, std::size_t count) {
  const std::size_t at = b.size();
  b.resize(at + count * sizeof(T));
  if (count) std::memcpy(b.data() + at, v, count * sizeof(T));
}

std::int64_t pages_for(std::int64_t tokens, int page_size) { return (tokens + page_size - 1) / page_size; }

// The logits [seq_len, vocab] of the whole model over `tokens`, padded to its length (causal, so
// the pad changes nothing before it): the recomputation the engine's steps are held against.
std::vector<float> recompute(k2c::model::testing::Side& s, const k2c::model::Transformer& transformer,
                             const k2c::model::ModelConfig& m, std::vector<std::int32_t> tokens) {
  tokens.resize(static_cast<std::size_t>(m.seq_len), 0);
  k2c::model::Transformer::Saved saved;
  transformer.forward(s.ctx, s.upload_ids(tokens), 1, false, saved);
  return s.download(saved.logits);
}

}  // namespace

Case draw_decode_attention(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int shape = index % 3;
  const int kv = 1 + static_cast<int>(rng() % 2), group = shape == 0 ? 1 : 1 + static_cast<int>(rng() % 4);
  const int hd = shape == 0 ? 1 : shape == 1 ? 2 + static_cast<int>(rng() % 7) : 16 + static_cast<int>(rng() % 49);
  const int hq = kv * group, S = shape == 0 ? 1 : 1 + static_cast<int>(rng() % 3);
  const int page_size = 1 + static_cast<int>(rng() % (shape == 2 ? 16 : 4));
  const int F = static_cast<int>(rng() % 5);
  std::vector<std::int64_t> length(S);
  for (int s = 0; s < S; ++s)
    length[s] = shape == 0 ? 1 : shape == 1 ? 1 + static_cast<std::int64_t>(rng() % 12) : 20 + static_cast<std::int64_t>(rng() % 180);
  const int B = S + static_cast<int>(rng() % 3);  // every sequence once, then repeats
  std::vector<std::int32_t> seqs(B);
  for (int b = 0; b < B; ++b) seqs[b] = b < S ? b : static_cast<std::int32_t>(rng() % S);
  std::shuffle(seqs.begin(), seqs.end(), rng);
  std::int64_t pages = 0;
  // A filler reserves room for at least one token (create's max_tokens >= 1), even when F = 0.
  for (int s = 0; s < S; ++s) pages += pages_for(length[s], page_size) + pages_for(std::max(F, 1), page_size);
  pages += static_cast<std::int64_t>(rng() % 3);
  const std::int64_t longest = *std::max_element(length.begin(), length.end());
  const int split = static_cast<int>(rng() % 2 ? longest : 1 + static_cast<std::int64_t>(rng() % longest));
  // Past the tiniest shape, two or three layers, mostly the last one read (so that a read of layer
  // 0 meets decoys); a cut anywhere, the ends included (one call then writes the whole sequence).
  const int layers = shape == 0 ? 1 : 2 + static_cast<int>(rng() % 2);
  const int layer = rng() % 3 ? layers - 1 : static_cast<int>(rng() % layers);
  const int cut = static_cast<int>(rng() % 1001);
  Case c;
  const std::int64_t args[] = {kv, hd, hq, page_size, pages, split, S, B, F, layers, layer, cut};
  std::copy(std::begin(args), std::end(args), c.args);
  c.what = kind + ", " + std::to_string(B) + (B == 1 ? " query" : " queries") + " over " + std::to_string(S) +
           (S == 1 ? " sequence" : " sequences") + " up to " +
           std::to_string(longest) + " tokens, " + std::to_string(hq) + "/" + std::to_string(kv) + " heads of " +
           std::to_string(hd) + ", pages of " + std::to_string(page_size) + ", parts of " + std::to_string(split) +
           ", layer " + std::to_string(layer) + " of " + std::to_string(layers) + ", written in two parts cut at " +
           std::to_string(cut / 10) + "." + std::to_string(cut % 10) + "%";

  const std::uint64_t data = rng();
  const std::int64_t row = std::int64_t{kv} * hd;
  std::vector<std::vector<float>> K(S), V(S);
  Bytes in;
  append(in, length.data(), length.size());
  append(in, seqs.data(), seqs.size());
  for (int s = 0; s < S; ++s) {
    for (std::int64_t i = 0; i < length[s] * row; ++i) {
      K[s].push_back(k2c::uniform_at(data + 2 * s, i, -1.0f, 1.0f));
      V[s].push_back(k2c::uniform_at(data + 2 * s + 1, i, -1.0f, 1.0f));
    }
    append(in, K[s].data(), K[s].size());
    append(in, V[s].data(), V[s].size());
  }
  std::vector<float> q(static_cast<std::size_t>(B) * hq * hd);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = k2c::uniform_at(data + 99, i, -2.0f, 2.0f);
  append(in, q.data(), q.size());
  c.in.assign(n, in);

  std::vector<float> o(q.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int b = 0; b < B; ++b) {
    const int s = seqs[b];
    for (int h = 0; h < hq; ++h) {
      const int g = h / group;
      const float* qv = q.data() + (std::size_t(b) * hq + h) * hd;
      std::vector<double> p(static_cast<std::size_t>(length[s]));
      double top = -1e300, sum = 0;
      for (std::int64_t t = 0; t < length[s]; ++t) {
        double dot = 0;
        for (int j = 0; j < hd; ++j) dot += double(qv[j]) * K[s][t * row + g * hd + j];
        p[t] = dot * scale;
        top = std::max(top, p[t]);
      }
      for (double& v : p) sum += (v = std::exp(v - top));
      for (int j = 0; j < hd; ++j) {
        double acc = 0;
        for (std::int64_t t = 0; t < length[s]; ++t) acc += p[t] * V[s][t * row + g * hd + j];
        o[(std::size_t(b) * hq + h) * hd + j] = static_cast<float>(acc / sum);
      }
    }
  }
  std::vector<Tensors> want(n, Tensors{{"o", o}});
  c.out_bytes.assign(n, o.size() * sizeof(float));
  c.check = judge_layer(want, 0, "the attention in double's");
  return c;
}

Case draw_engine(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  namespace km = k2c::model;
  const int shape = index % 3;
  km::ModelConfig m;
  m.kv_heads = 1 + static_cast<int>(rng() % 2);
  m.q_heads = m.kv_heads * (shape == 0 ? 1 : 1 + static_cast<int>(rng() % 2));
  m.d_model = m.q_heads * (shape == 0 ? 2 : 2 * (1 + static_cast<int>(rng() % (shape == 1 ? 3 : 8))));
  m.vocab = shape == 0 ? 3 + static_cast<int>(rng() % 4) : 5 + static_cast<int>(rng() % (shape == 1 ? 30 : 200));
  m.n_layers = 1 + static_cast<int>(rng() % 2);
  m.d_ff = 1 + static_cast<std::int64_t>(rng() % (shape == 0 ? 3 : 40));
  m.seq_len = shape == 0 ? 2 + static_cast<int>(rng() % 3) : shape == 1 ? 4 + static_cast<int>(rng() % 8) : 16 + static_cast<int>(rng() % 25);
  m.init_std = 0.3f;
  m.check();
  const int R = shape == 0 ? 1 : 1 + static_cast<int>(rng() % 3);
  std::vector<std::int32_t> prompt(R), steps(R);
  for (int r = 0; r < R; ++r) {
    prompt[r] = 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(m.seq_len - 1));
    steps[r] = 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(m.seq_len - prompt[r]));
  }
  const int page_size = 1 + static_cast<int>(rng() % 5);
  std::int64_t pages = 0;
  for (int r = 0; r < R; ++r) pages += pages_for(prompt[r] + steps[r] - 1, page_size);
  pages += static_cast<std::int64_t>(rng() % 3);
  const int split = rng() % 2 ? m.seq_len : 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(m.seq_len));
  const std::uint64_t seed = rng() >> 1, data = rng();
  Case c;
  c.args[0] = pages, c.args[1] = page_size, c.args[2] = split, c.args[3] = R;
  put_model(c, m, seed << 1), c.args[13] = std::bit_cast<std::int32_t>(m.init_std);
  c.what = kind + ", " + std::to_string(R) + " request(s), vocab " + std::to_string(m.vocab) + ", d " + std::to_string(m.d_model) +
           ", " + std::to_string(m.n_layers) + " block(s), " + std::to_string(m.q_heads) + "/" + std::to_string(m.kv_heads) +
           " heads, T " + std::to_string(m.seq_len) + ", pages of " + std::to_string(page_size) + ", parts of " + std::to_string(split);

  std::vector<std::vector<std::int32_t>> fed(R);
  Bytes in;
  for (int r = 0; r < R; ++r) {
    append(in, &prompt[r], 1);
    append(in, &steps[r], 1);
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < prompt[r] + steps[r] - 1; ++i)
      fed[r].push_back(static_cast<std::int32_t>(k2c::mix64(data + 1000 * r + i) % static_cast<std::uint64_t>(m.vocab)));
    append(in, fed[r].data(), fed[r].size());
  }
  c.in.assign(n, in);

  // The reference: the whole model over each request's fed tokens, rows in the order the engine
  // gives them.
  km::testing::Side ref;
  const km::Transformer transformer(ref.params, m);
  ref.materialize(seed);
  std::vector<std::vector<float>> logits(R);
  for (int r = 0; r < R; ++r) logits[r] = recompute(ref, transformer, m, fed[r]);
  Tensors rows;
  const int longest = *std::max_element(steps.begin(), steps.end());
  for (int j = 0; j < longest; ++j)
    for (int r = 0; r < R; ++r) {
      if (j >= steps[r]) continue;
      const std::size_t pos = static_cast<std::size_t>(prompt[r] - 1 + j), V = static_cast<std::size_t>(m.vocab);
      rows.push_back({"request " + std::to_string(r) + (j == 0 ? ", prefill" : ", decode step " + std::to_string(j)) + ": logits",
                      {logits[r].begin() + pos * V, logits[r].begin() + (pos + 1) * V}});
    }
  std::size_t bytes = 0;
  for (const auto& t : rows) bytes += t.second.size() * sizeof(float);
  c.out_bytes.assign(n, bytes);
  const bool bits = split >= m.seq_len;
  const auto close = judge_layer(std::vector<Tensors>(n, rows), 0, "the recomputation's");
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    if (!bits) return close(got);
    for (int r = 0; r < n; ++r) {
      std::size_t at = 0;
      for (const auto& [name, w] : rows) {
        for (std::size_t i = 0; i < w.size(); ++i)
          if (std::memcmp(got[r].data() + (at + i) * sizeof(float), &w[i], sizeof(float)) != 0)
            return "rank " + std::to_string(r) + ": " + name + ", id " + std::to_string(i) + ": got " +
                   std::to_string(float_at(got[r], at + i)) + ", the recomputation's " + std::to_string(w[i]) +
                   " (one part over the whole context: bit for bit)";
        at += w.size();
      }
    }
    return "";
  };
  return c;
}

Case draw_mla(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int shape = index % 3;
  k2c::ref::MlaShape m;
  m.heads = 1 + static_cast<int>(rng() % (shape == 0 ? 1 : 3));
  m.d_model = shape == 0 ? 2 : 4 + static_cast<int>(rng() % (shape == 1 ? 12 : 40));
  m.nope_dim = 1 + static_cast<int>(rng() % (shape == 0 ? 2 : 12));
  m.rope_dim = 2 * (1 + static_cast<int>(rng() % (shape == 0 ? 1 : 4)));
  m.latent_dim = 1 + static_cast<int>(rng() % (shape == 0 ? 2 : 20));
  m.value_dim = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(m.nope_dim + m.rope_dim));
  const int T = shape == 0 ? 2 : shape == 1 ? 3 + static_cast<int>(rng() % 8) : 16 + static_cast<int>(rng() % 25);
  const int T0 = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(T - 1));
  // The second sequence decodes beside the first, batched in one call (the test's form).
  const int T2 = 2 + static_cast<int>(rng() % static_cast<std::uint64_t>(T + 4));
  const int T02 = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(T2 - 1));
  const int page_size = 1 + static_cast<int>(rng() % 5);
  const std::int64_t pages = pages_for(T, page_size) + pages_for(T2, page_size) + static_cast<std::int64_t>(rng() % 3);
  const int split = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(std::max(T, T2)));
  Case c;
  const std::int64_t args[] = {m.d_model, m.heads, m.nope_dim, m.rope_dim, m.latent_dim, m.value_dim, T, T0, pages, page_size, split};
  std::copy(std::begin(args), std::end(args), c.args);
  c.args[12] = static_cast<std::int64_t>(rng() >> 1);
  c.args[13] = T2, c.args[14] = T02, c.args[15] = static_cast<std::int64_t>(rng() % 2);
  c.what = kind + ", d " + std::to_string(m.d_model) + ", " + std::to_string(m.heads) + " head(s) of " + std::to_string(m.nope_dim) +
           " + " + std::to_string(m.rope_dim) + ", latent " + std::to_string(m.latent_dim) + ", values " + std::to_string(m.value_dim) +
           ", " + std::to_string(T) + " tokens (" + std::to_string(T0) + " prefilled), pages of " + std::to_string(page_size) +
           ", parts of " + std::to_string(split) + ", beside a sequence of " + std::to_string(T2) + " (" + std::to_string(T02) +
           " prefilled)";

  // Weights of about 0.5 (not the init's 0.02): scores of a few units, a softmax far from uniform.
  const int H = m.heads, d = m.d_model;
  const std::int64_t sizes[] = {std::int64_t{H} * m.nope_dim * d, std::int64_t{H} * m.rope_dim * d, std::int64_t{m.latent_dim} * d,
                                std::int64_t{m.rope_dim} * d, std::int64_t{H} * m.nope_dim * m.latent_dim,
                                std::int64_t{H} * m.value_dim * m.latent_dim, std::int64_t{d} * H * m.value_dim};
  const std::uint64_t data = rng();
  std::vector<std::vector<float>> w(7);
  Bytes in;
  for (int i = 0; i < 7; ++i) {
    for (std::int64_t j = 0; j < sizes[i]; ++j) w[i].push_back(k2c::uniform_at(data + i, j, -0.8f, 0.8f));
    append(in, w[i].data(), w[i].size());
  }
  std::vector<float> x(static_cast<std::size_t>(T) * d), x2(static_cast<std::size_t>(T2) * d);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = k2c::uniform_at(data + 7, i, -1.0f, 1.0f);
  for (std::size_t i = 0; i < x2.size(); ++i) x2[i] = k2c::uniform_at(data + 8, i, -1.0f, 1.0f);
  append(in, x.data(), x.size());
  append(in, x2.data(), x2.size());
  c.in.assign(n, in);

  const std::vector<double> y = k2c::ref::mla_forward(x, T, m, {w[0], w[1], w[2], w[3], w[4], w[5], w[6]});
  const std::vector<double> y2 = k2c::ref::mla_forward(x2, T2, m, {w[0], w[1], w[2], w[3], w[4], w[5], w[6]});
  const std::vector<float> yf(y.begin(), y.end());
  const std::size_t rows0 = std::size_t(T0) * d;
  const Tensors want = {{"forward's y", yf},
                        {"decode's rows (positions " + std::to_string(T0) + " on)", {yf.begin() + rows0, yf.end()}},
                        {"the second sequence's decoded rows (positions " + std::to_string(T02) + " on)",
                         {y2.begin() + std::ptrdiff_t(T02) * d, y2.end()}}};
  c.out_bytes.assign(n, (2 * yf.size() + std::size_t(T2 - T02) * d) * sizeof(float));
  // The answer: forward's y [T, d], prefill's [T0, d] (forward's rows, to the bit), decode's
  // [T − T0, d], the second sequence's decode [T2 − T02, d].
  const auto close = judge_layer(std::vector<Tensors>(n, want), 0, "the equations'", 1e-4);
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    std::vector<Bytes> judged;
    for (int r = 0; r < n; ++r) {
      if (std::memcmp(got[r].data() + yf.size() * sizeof(float), got[r].data(), rows0 * sizeof(float)) != 0)
        return "rank " + std::to_string(r) + ": prefill's output differs from forward's first " + std::to_string(T0) +
               " rows (the same computation: bit for bit)";
      Bytes b(got[r].begin(), got[r].begin() + yf.size() * sizeof(float));
      b.insert(b.end(), got[r].begin() + (yf.size() + rows0) * sizeof(float), got[r].end());
      judged.push_back(std::move(b));
    }
    return close(judged);
  };
  return c;
}

Case draw_serving(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  namespace km = k2c::model;
  const int shape = index % 3;
  // Draw until every request's greedy continuation is clear of near ties (the best logit ahead of
  // the second by 1e-3 of the largest |logit|): an engine that adds in another order must pick the
  // same tokens.
  for (int attempt = 0; attempt < 50; ++attempt) {
    km::ModelConfig m;
    m.kv_heads = 1 + static_cast<int>(rng() % 2);
    m.q_heads = m.kv_heads * (1 + static_cast<int>(rng() % 2));
    m.d_model = m.q_heads * 2 * (1 + static_cast<int>(rng() % 4));
    m.vocab = 5 + static_cast<int>(rng() % (shape == 2 ? 60 : 20));
    m.n_layers = 1 + static_cast<int>(rng() % 2);
    m.d_ff = 2 + static_cast<std::int64_t>(rng() % 30);
    m.seq_len = shape == 0 ? 4 : 8 + static_cast<int>(rng() % 17);
    m.init_std = 0.3f;
    m.check();
    const int R = shape == 0 ? 1 : 2 + static_cast<int>(rng() % (shape == 1 ? 3 : 6));
    std::vector<int> prompt(R), output(R);
    std::vector<double> arrival(R);
    double t = 0;
    for (int r = 0; r < R; ++r) {
      prompt[r] = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(m.seq_len / 2));
      output[r] = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(m.seq_len - prompt[r]));
      arrival[r] = t;
      t += (rng() % 3) * 0.01;  // some together, some while others decode (the cost model's steps are ~0.01 s)
    }
    const int page_size = 1 + static_cast<int>(rng() % 4), max_batch = 1 + static_cast<int>(rng() % 4);
    std::int64_t biggest = 0;
    for (int r = 0; r < R; ++r) biggest = std::max(biggest, pages_for(prompt[r] + output[r] - 1, page_size));
    const std::int64_t pages = biggest + static_cast<std::int64_t>(rng() % 6);
    const int split = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(m.seq_len));
    const std::uint64_t seed = rng() >> 1, data = rng();
    std::vector<std::vector<std::int32_t>> prompts(R);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < prompt[r]; ++i)
        prompts[r].push_back(static_cast<std::int32_t>(k2c::mix64(data + 1000 * r + i) % static_cast<std::uint64_t>(m.vocab)));

    // Greedy generation, one process, each step the whole model over the sequence so far.
    km::testing::Side ref;
    const km::Transformer transformer(ref.params, m);
    ref.materialize(seed);
    std::vector<std::vector<std::int32_t>> tokens(R);
    bool clear = true;
    for (int r = 0; r < R && clear; ++r) {
      std::vector<std::int32_t> seq = prompts[r];
      for (int j = 0; j < output[r] && clear; ++j) {
        const std::vector<float> all = recompute(ref, transformer, m, seq);
        const float* row = all.data() + (seq.size() - 1) * static_cast<std::size_t>(m.vocab);
        int best = 0;
        float top = 0;
        for (int v = 0; v < m.vocab; ++v) {
          if (row[v] > row[best]) best = v;
          top = std::max(top, std::abs(row[v]));
        }
        for (int v = 0; v < m.vocab; ++v)
          if (v != best && row[best] - row[v] < 1e-3f * top) clear = false;
        tokens[r].push_back(best);
        seq.push_back(best);
      }
    }
    if (!clear) continue;

    Case c;
    c.args[0] = pages, c.args[1] = page_size, c.args[2] = split, c.args[3] = R;
    put_model(c, m, seed << 1), c.args[13] = std::bit_cast<std::int32_t>(m.init_std), c.args[14] = max_batch;
    c.what = kind + ", " + std::to_string(R) + " request(s), batches of up to " + std::to_string(max_batch) + ", " +
             std::to_string(pages) + " pages of " + std::to_string(page_size) + ", parts of " + std::to_string(split) +
             ", vocab " + std::to_string(m.vocab) + ", T " + std::to_string(m.seq_len);
    Bytes in;
    std::size_t answer = 0;
    for (int r = 0; r < R; ++r) {
      const std::int32_t head[] = {prompt[r], output[r]};
      append(in, head, 2);
      append(in, &arrival[r], 1);
      append(in, prompts[r].data(), prompts[r].size());
      answer += (2 + static_cast<std::size_t>(output[r])) * sizeof(std::int32_t);
    }
    c.in.assign(n, in);
    c.out_bytes.assign(n, answer);
    c.check = [=](const std::vector<Bytes>& got) -> std::string {
      for (int q = 0; q < n; ++q) {
        std::size_t at = 0;
        for (int r = 0; r < R; ++r) {
          std::int32_t ok;
          std::memcpy(&ok, got[q].data() + at, sizeof ok);
          at += sizeof ok;
          const std::string who = "rank " + std::to_string(q) + ", request " + std::to_string(r);
          if (ok != 1) return who + ": not served (every request fits the model and the cache)";
          std::int32_t count;
          std::memcpy(&count, got[q].data() + at, sizeof count);
          at += sizeof count;
          if (count != output[r])
            return who + ": " + std::to_string(count) + " tokens, not the " + std::to_string(output[r]) + " it asked for";
          for (int j = 0; j < output[r]; ++j, at += sizeof(std::int32_t)) {
            std::int32_t tok;
            std::memcpy(&tok, got[q].data() + at, sizeof tok);
            if (tok != tokens[r][j])
              return who + ", token " + std::to_string(j) + ": " + std::to_string(tok) + ", the greedy continuation's " +
                     std::to_string(tokens[r][j]) + " (one request alone, whole recomputation)";
          }
        }
      }
      return "";
    };
    return c;
  }
  throw std::runtime_error("no model and trace clear of near ties in 50 draws");
}

Case draw_cache_pages(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  // The contract's allocator, simulated: pages held by sequences, the lowest free one taken first
  // at extend; a sequence reserves pages_for(max_tokens) at create; free = neither held nor
  // reserved.
  const int shape = index % 3;
  const int page_size = 1 + static_cast<int>(rng() % 4), pages = 1 + static_cast<int>(rng() % (shape == 0 ? 2 : shape == 1 ? 8 : 40));
  const int ops = shape == 0 ? 6 : shape == 1 ? 20 : 80, max_tokens_cap = page_size * pages + 2;
  struct Seq {
    bool live = false;
    std::int64_t length = 0, max_tokens = 0;
    std::vector<std::int64_t> table;
  };
  std::vector<Seq> seqs;
  std::vector<bool> held(static_cast<std::size_t>(pages), false);
  auto reserved = [&] {
    std::int64_t r = 0;
    for (const Seq& q : seqs)
      if (q.live) r += pages_for(q.max_tokens, page_size) - static_cast<std::int64_t>(q.table.size());
    return r;
  };
  auto free_pages = [&] { return static_cast<std::int64_t>(std::count(held.begin(), held.end(), false)) - reserved(); };
  // Per operation: kind (0 create, 1 extend, 2 release), the sequence (the checker's index), the
  // count (max_tokens or tokens). Per answer record: status (0 done, 1 length_error, 2
  // out_of_range), free_pages, used_pages, sequences, the sequence's length (−1 once released or
  // never made), then its page table padded with −1 to `pages` entries.
  std::vector<std::int64_t> op_list, want;
  for (int i = 0; i < ops; ++i) {
    const int live = static_cast<int>(std::count_if(seqs.begin(), seqs.end(), [](const Seq& q) { return q.live; }));
    const int what = live == 0 ? 0 : static_cast<int>(rng() % 5) == 0 ? 2 : static_cast<int>(rng() % 3) == 0 ? 0 : 1;
    std::int64_t target = 0, count = 0, status = 0;
    if (what == 0) {
      count = 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(max_tokens_cap));
      target = static_cast<std::int64_t>(seqs.size());
      if (pages_for(count, page_size) > free_pages()) {
        status = 1;  // refused: nothing changes, and the index stays unused
        seqs.push_back({});
      } else {
        seqs.push_back({true, 0, count, {}});
      }
    } else {
      std::vector<int> alive;
      for (int q = 0; q < static_cast<int>(seqs.size()); ++q)
        if (seqs[q].live) alive.push_back(q);
      target = alive[rng() % alive.size()];
      Seq& q = seqs[static_cast<std::size_t>(target)];
      if (what == 2) {
        for (std::int64_t p : q.table) held[static_cast<std::size_t>(p)] = false;
        q = Seq{};
      } else {
        count = static_cast<std::int64_t>(rng() % 6);
        if (q.length + count > q.max_tokens) {
          status = 1;
        } else {
          q.length += count;
          while (static_cast<std::int64_t>(q.table.size()) < pages_for(q.length, page_size)) {
            const auto lowest = std::find(held.begin(), held.end(), false);
            held[static_cast<std::size_t>(lowest - held.begin())] = true;
            q.table.push_back(lowest - held.begin());
          }
        }
      }
    }
    op_list.insert(op_list.end(), {what, target, count});
    const Seq& q = seqs[static_cast<std::size_t>(target)];
    std::int64_t used = static_cast<std::int64_t>(std::count(held.begin(), held.end(), true)), live_now = 0;
    for (const Seq& x : seqs) live_now += x.live;
    want.insert(want.end(), {status, free_pages(), used, live_now, q.live ? q.length : -1});
    for (int p = 0; p < pages; ++p) want.push_back(q.live && p < static_cast<int>(q.table.size()) ? q.table[p] : -1);
  }
  Case c;
  c.args[0] = page_size, c.args[1] = pages, c.args[2] = ops;
  c.what = kind + ", " + std::to_string(ops) + " operations on " + std::to_string(pages) + " pages of " + std::to_string(page_size);
  Bytes in;
  append(in, op_list.data(), op_list.size());
  c.in.assign(n, in);
  c.out_bytes.assign(n, want.size() * sizeof(std::int64_t));
  const std::size_t record = 5 + static_cast<std::size_t>(pages);
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    static const char* const fields[] = {"the outcome (0 done, 1 std::length_error, 2 std::out_of_range)", "free_pages()",
                                         "used_pages()", "sequences()", "the sequence's length"};
    static const char* const verbs[] = {"create", "extend", "release"};
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < want.size(); ++i) {
        std::int64_t g;
        std::memcpy(&g, got[r].data() + i * sizeof g, sizeof g);
        if (g == want[i]) continue;
        const std::size_t op = i / record, field = i % record;
        return "rank " + std::to_string(r) + ", operation " + std::to_string(op) + " (" + verbs[op_list[3 * op]] +
               " of sequence " + std::to_string(op_list[3 * op + 1]) + ", " + std::to_string(op_list[3 * op + 2]) + "): " +
               (field < 5 ? std::string(fields[field]) : "page table entry " + std::to_string(field - 5)) + " is " +
               std::to_string(g) + ", the contract's " + std::to_string(want[i]) + " (the lowest free page first)";
      }
    return "";
  };
  return c;
}

}  // namespace k2c::rank_witness
