// autograder/witness/rank_cases_layers.cpp — k2c_rank_witness's cases of module 14's
// tensor-parallel linear layers, vocabulary-parallel embedding and cross-entropy, and module 16's
// row collectives and ring attention.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "k2c/core/random.h"
#include "k2c/model/layers.h"
#include "k2c/model/testing.h"
#include "k2c/reference/reference.h"
#include "rank_cases.h"

namespace k2c::rank_witness {

// Module 14's linear layers. args: in, out, tokens (in and out divisible by the ranks); x, W and dy
// drawn whole, each rank given its part:
//   column_parallel_forward   x [tokens, in] and rows r·out/n.. of W [out, in]; answers its
//                             columns of y = x·Wᵀ.
//   column_parallel_backward  the same and its columns of dy [tokens, out]; answers dx [tokens, in]
//                             (f's backward summed it: the same bits on every rank), then its rows
//                             of dW = dyᵀ·x.
//   row_parallel_linear       columns r·in/n.. of x and of W, and dy whole; answers y (the same
//                             bits on every rank), then its columns of dx = dy·W, then its columns
//                             of dW.
// The references in double; fp32 sums of at most a few hundred terms in another order (and, by
// rows, across ranks): within 1e-4 of the larger of 1 and the tensor's largest |value|.

namespace {

// The first of the answer's floats [at, at + want.size()) further than 1e-4 of the larger of 1 and
// want's largest |value| from its reference: its index, or -1.
std::int64_t first_miss(const Bytes& got, std::size_t at, const std::vector<double>& want) {
  double top = 1;
  for (double v : want) top = std::max(top, std::abs(v));
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!(std::abs(float_at(got, at + i) - want[i]) <= 1e-4 * top)) return static_cast<std::int64_t>(i);
  return -1;
}

// "got G, want W" for element i.
std::string got_want(const Bytes& got, std::size_t at, const std::vector<double>& want, std::int64_t i) {
  return "got " + std::to_string(float_at(got, at + i)) + ", want " + std::to_string(want[i]);
}

}  // namespace

Case draw_linear(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool column = kind != "row_parallel_linear", backward = kind != "column_parallel_forward";
  // In turn: one token, a few, many; widths of a few elements per rank up to 32.
  const std::int64_t tokens = index % 3 == 0 ? 1 : index % 3 == 1 ? 2 + rng() % 15 : 64 + rng() % 129;
  const std::int64_t in = n * (1 + rng() % 32), out = n * (1 + rng() % 32);
  Case c;
  c.args[0] = in;
  c.args[1] = out;
  c.args[2] = tokens;
  c.what = kind + ", " + std::to_string(tokens) + " tokens, " + std::to_string(in) + " → " + std::to_string(out) +
           " on " + std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  std::vector<float> x(tokens * in), w(out * in), dy(tokens * out);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = k2c::uniform_at(seed, i, -1.0f, 1.0f);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = k2c::uniform_at(seed + 1, i, -0.5f, 0.5f);
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = k2c::uniform_at(seed + 2, i, -1.0f, 1.0f);
  std::vector<double> y(tokens * out, 0.0), dx(tokens * in, 0.0), dw(out * in, 0.0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t k = 0; k < in; ++k) {
        y[t * out + o] += double(x[t * in + k]) * w[o * in + k];
        dx[t * in + k] += double(dy[t * out + o]) * w[o * in + k];
        dw[o * in + k] += double(dy[t * out + o]) * x[t * in + k];
      }
  const std::int64_t lo = out / n, li = in / n;
  // Each rank's answer, as the references it is held to: named, in the answer's order.
  std::vector<std::vector<std::pair<std::string, std::vector<double>>>> want(n);
  for (int r = 0; r < n; ++r) {
    std::vector<float> mine;
    if (column) {
      mine = x;
      mine.insert(mine.end(), w.begin() + r * lo * in, w.begin() + (r + 1) * lo * in);
      if (backward) {
        const std::vector<float> d = column_slice(dy, out, r * lo, lo);
        mine.insert(mine.end(), d.begin(), d.end());
        want[r] = {{"dx", dx}, {"dW (its rows)", row_slice(dw, in, r * lo, lo)}};
      } else {
        want[r] = {{"y (its columns)", column_slice(y, out, r * lo, lo)}};
      }
    } else {
      mine = column_slice(x, in, r * li, li);
      const std::vector<float> wr = column_slice(w, in, r * li, li);
      mine.insert(mine.end(), wr.begin(), wr.end());
      mine.insert(mine.end(), dy.begin(), dy.end());
      want[r] = {{"y", y}, {"dx (its columns)", column_slice(dx, in, r * li, li)}, {"dW (its columns)", column_slice(dw, in, r * li, li)}};
    }
    std::size_t floats_out = 0;
    for (const auto& t : want[r]) floats_out += t.second.size();
    c.in.push_back(floats(mine));
    c.out_bytes.push_back(floats_out * sizeof(float));
  }
  // Where every rank holds the whole of the first tensor (y after g, dx after f), the same bits.
  const std::size_t whole = column && !backward ? 0 : want[0][0].second.size();
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      std::size_t at = 0;
      for (const auto& [name, ref] : want[r]) {
        if (const std::int64_t i = first_miss(got[r], at, ref); i >= 0)
          return "rank " + std::to_string(r) + ", " + name + ", element " + std::to_string(i) + ": " + got_want(got[r], at, ref, i);
        at += ref.size();
      }
      if (whole > 0 && std::memcmp(got[r].data(), got[0].data(), whole * sizeof(float)) != 0)
        return "rank " + std::to_string(r) + "'s " + want[r][0].first + " differs from rank 0's";
    }
    return "";
  };
  return c;
}

// Module 14's vocabulary-parallel embedding. args: V (divisible by the ranks), D, N ids, 12 the
// seed. Rank r gets the ids int32 [N] (both edges of every rank's shard, both ends of the
// vocabulary, repeats), its rows r·V/n.. of the table [V/n, D], and dout [N, D]. It builds the layer
// "tok", materializes it from the seed and keeps those values, then replaces them by its rows of the
// table; it answers the lookup [N, D] (every row the table's, to the bit, the same on every rank),
// its shard's gradient [V/n, D] (the sum of the dout rows of its ids, in fp32), then the values it
// materialized [V/n, D]: rows r·V/n.. of a model::Embedding "tok" materialized from the same seed,
// to the bit (the shard registered with Init::shard as the contract says).

Case draw_embedding(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int shape = index % 3;
  const std::int64_t V = n * (shape == 0 ? 1 : 1 + static_cast<std::int64_t>(rng() % (shape == 1 ? 5 : 40)));
  const std::int64_t D = shape == 0 ? 1 : 1 + static_cast<std::int64_t>(rng() % (shape == 1 ? 9 : 64));
  const std::uint64_t seed = rng();
  std::vector<std::int32_t> ids;
  for (int q = 0; q < n; ++q)
    ids.insert(ids.end(), {static_cast<std::int32_t>(q * V / n), static_cast<std::int32_t>((q + 1) * V / n - 1)});
  const std::int64_t extra = shape == 0 ? 0 : shape == 1 ? 1 + static_cast<std::int64_t>(rng() % 8) : 50 + static_cast<std::int64_t>(rng() % 150);
  for (std::int64_t i = 0; i < extra; ++i) ids.push_back(static_cast<std::int32_t>(k2c::mix64(seed + 3 + i) % static_cast<std::uint64_t>(V)));
  std::shuffle(ids.begin(), ids.end(), rng);
  const std::int64_t N = static_cast<std::int64_t>(ids.size()), rows = V / n;
  Case c;
  c.args[0] = V, c.args[1] = D, c.args[2] = N, c.args[12] = static_cast<std::int64_t>(rng() >> 1);
  c.what = kind + ", " + std::to_string(N) + " ids of " + std::to_string(V) + ", D " + std::to_string(D) + " on " +
           std::to_string(n) + " ranks";
  // The whole layer's values from the seed: each rank's registered shard must be its block of them.
  k2c::model::testing::Side whole_side;
  const k2c::model::Embedding whole(whole_side.params, "tok", V, D);
  whole_side.materialize(static_cast<std::uint64_t>(c.args[12]));
  const std::vector<float> initial = whole_side.download(whole_side.params.value(whole.weight()));
  std::vector<float> table(V * D), dout(N * D);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = k2c::uniform_at(seed, i, -1.0f, 1.0f);
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = k2c::uniform_at(seed + 1, i, -1.0f, 1.0f);
  std::vector<float> lookup;
  std::vector<double> grad(V * D, 0.0);
  for (std::int64_t t = 0; t < N; ++t) {
    lookup.insert(lookup.end(), table.begin() + ids[t] * D, table.begin() + (ids[t] + 1) * D);
    for (std::int64_t j = 0; j < D; ++j) grad[ids[t] * D + j] += dout[t * D + j];
  }
  for (int r = 0; r < n; ++r) {
    Bytes in(ids.size() * sizeof(std::int32_t));
    std::memcpy(in.data(), ids.data(), in.size());
    const Bytes shard = floats({table.begin() + r * rows * D, table.begin() + (r + 1) * rows * D}), d = floats(dout);
    in.insert(in.end(), shard.begin(), shard.end());
    in.insert(in.end(), d.begin(), d.end());
    c.in.push_back(std::move(in));
    c.out_bytes.push_back((N + 2 * rows) * D * sizeof(float));
  }
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      for (std::int64_t i = 0; i < N * D; ++i)
        if (std::memcmp(got[r].data() + i * sizeof(float), &lookup[i], sizeof(float)) != 0)
          return rank + ": the lookup of id " + std::to_string(ids[i / D]) + " (row " + std::to_string(i / D) + "), column " +
                 std::to_string(i % D) + ": got " + std::to_string(float_at(got[r], i)) + ", the table's " +
                 std::to_string(lookup[i]) + " (one rank's row plus zeros: exact)";
      for (std::int64_t i = 0; i < rows * D; ++i) {
        // A sum of at most N values of at most 1: fp32's rounding in any order stays far below 1e-5·N.
        const double want = grad[r * rows * D + i], g = float_at(got[r], N * D + i);
        if (!(std::abs(g - want) <= 1e-6 * static_cast<double>(N) + 1e-6 * std::abs(want)))
          return rank + ": the gradient of id " + std::to_string(r * rows + i / D) + ", column " + std::to_string(i % D) +
                 ": got " + std::to_string(g) + ", the sum of its dout rows " + std::to_string(want);
      }
      const std::size_t at = static_cast<std::size_t>((N + rows) * D) * sizeof(float);
      for (std::int64_t i = 0; i < rows * D; ++i)
        if (std::memcmp(got[r].data() + at + i * sizeof(float), &initial[r * rows * D + i], sizeof(float)) != 0)
          return rank + ": the materialized value of row " + std::to_string(r * rows + i / D) + ", column " +
                 std::to_string(i % D) + " is not the whole embedding's from the same seed (registered with " +
                 "Init::shard as rows " + std::to_string(r * rows) + ".. of [" + std::to_string(V) + ", " + std::to_string(D) + "]?)";
    }
    return "";
  };
  return c;
}

// Module 16's row collectives. args: M rows per rank, d columns. Rank r gets its shard [M, d]
// and its partial [n·M, d]; it answers all_gather_rows' whole [n·M, d] (rank q's shard at rows
// q·M, to the bit) followed by reduce_scatter_rows' shard [M, d] (rows r·M of the sum), then its
// partial as the reduce left it (its input: unchanged, to the bit).

Case draw_rows(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  // In turn: one row of one column, a few, many.
  const std::int64_t M = index % 3 == 0 ? 1 : index % 3 == 1 ? 2 + rng() % 9 : 100 + rng() % 200;
  const std::int64_t d = index % 3 == 0 ? 1 : 1 + rng() % 64;
  Case c;
  c.args[0] = M;
  c.args[1] = d;
  c.what = kind + ", " + std::to_string(M) + " rows of " + std::to_string(d) + " per rank on " + std::to_string(n) +
           " ranks";
  const std::uint64_t seed = rng();
  std::vector<std::vector<float>> shard(n), partial(n);
  std::vector<double> sum(n * M * d, 0.0);
  for (int r = 0; r < n; ++r) {
    for (std::int64_t i = 0; i < M * d; ++i) shard[r].push_back(k2c::uniform_at(seed + 2 * r, i, -1.0f, 1.0f));
    for (std::int64_t i = 0; i < n * M * d; ++i) {
      partial[r].push_back(k2c::uniform_at(seed + 2 * r + 1, i, -1.0f, 1.0f));
      sum[i] += partial[r][i];
    }
    std::vector<float> in = shard[r];
    in.insert(in.end(), partial[r].begin(), partial[r].end());
    c.in.push_back(floats(in));
    c.out_bytes.push_back((2 * n + 1) * M * d * sizeof(float));
  }
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      if (std::memcmp(got[r].data() + (n + 1) * M * d * sizeof(float), partial[r].data(), n * M * d * sizeof(float)) != 0)
        return "rank " + std::to_string(r) + ": reduce_scatter_rows changed its input (the partial sums)";
      for (int q = 0; q < n; ++q)
        if (std::memcmp(got[r].data() + q * M * d * sizeof(float), shard[q].data(), M * d * sizeof(float)) != 0)
          return "rank " + std::to_string(r) + ": all_gather_rows: rows " + std::to_string(q * M) + ".. are not rank " +
                 std::to_string(q) + "'s shard";
      for (std::int64_t i = 0; i < M * d; ++i) {
        const double g = float_at(got[r], n * M * d + i), want = sum[r * M * d + i];
        if (!(std::abs(g - want) <= 1e-5))  // fp32 sums of a few values in [-1, 1]
          return "rank " + std::to_string(r) + ": reduce_scatter_rows: row " + std::to_string(i / d) + ", column " +
                 std::to_string(i % d) + ": got " + std::to_string(g) + ", want " + std::to_string(want);
      }
    }
    return "";
  };
  return c;
}

// Module 16's ring attention, forward and backward. args: batch B, seq_len T (2·n·C), q_heads H,
// kv_heads Hkv, head_dim hd. Rank r gets its rows of q, k, v and dout in the contract's local order
// (its chunks r and 2n − 1 − r, chunk-major, then sequence, then token) and answers o, dq, dk and
// dv for the same rows, then lse [2·B, H, C] (its chunk j of sequence b at [j·B + b]). The
// reference in double: o and lse within 1e-4 of the larger of 1 and their largest |value| (o
// averages values in [-1, 1]), the gradients likewise (fp32 sums over at most a few dozen keys or
// queries, and dk, dv summed over the group's query heads and the ring).

Case draw_ring(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool causal = kind == "ring_attention_causal";
  // The large case always has two sequences and two groups of query heads sharing a kv head.
  const bool large = index % 3 == 2;
  const int B = large ? 2 : 1 + static_cast<int>(rng() % 2), kv_heads = large ? 2 : 1 + static_cast<int>(rng() % 2);
  const int heads = kv_heads * (large ? 2 + static_cast<int>(rng() % 2) : 1 + static_cast<int>(rng() % 3));
  const int hd = 4 * (1 + static_cast<int>(rng() % 4));
  // In turn: chunks of one token, a few, more.
  const std::int64_t C = index % 3 == 0 ? 1 : index % 3 == 1 ? 2 + rng() % 3 : 5 + rng() % 4, T = 2 * n * C;
  Case c;
  c.args[0] = B;
  c.args[1] = T;
  c.args[2] = heads;
  c.args[3] = kv_heads;
  c.args[4] = hd;
  c.what = kind + ", " + std::to_string(B) + " × " + std::to_string(T) + " tokens, " + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + " heads of " + std::to_string(hd) + " on " + std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  const std::int64_t qw = heads * hd, kw = kv_heads * hd;
  std::vector<float> q(B * T * qw), k(B * T * kw), v(B * T * kw), dout(B * T * qw);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = k2c::uniform_at(seed, i, -2.0f, 2.0f);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = k2c::uniform_at(seed + 1, i, -2.0f, 2.0f);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = k2c::uniform_at(seed + 2, i, -1.0f, 1.0f);
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = k2c::uniform_at(seed + 3, i, -1.0f, 1.0f);
  // The course's reference in double (k2c/reference/reference.h), in its layout [b][head][t][d].
  auto heads_first = [&](const std::vector<float>& m, int hs) {
    std::vector<float> out(m.size());
    for (int b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t)
        for (int h = 0; h < hs; ++h)
          for (int d = 0; d < hd; ++d) out[((b * hs + h) * T + t) * hd + d] = m[(b * T + t) * hs * hd + h * hd + d];
    return out;
  };
  auto tokens_first = [&](const std::vector<double>& m, int hs) {
    std::vector<double> out(m.size());
    for (int b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t)
        for (int h = 0; h < hs; ++h)
          for (int d = 0; d < hd; ++d) out[(b * T + t) * hs * hd + h * hd + d] = m[((b * hs + h) * T + t) * hd + d];
    return out;
  };
  const k2c::ref::AttentionShape shape{B, heads, kv_heads, static_cast<int>(T), static_cast<int>(T), hd, causal,
                                       1.0 / std::sqrt(double(hd))};
  const std::vector<float> qh = heads_first(q, heads), kh = heads_first(k, kv_heads), vh = heads_first(v, kv_heads);
  const k2c::ref::AttentionForward f = k2c::ref::attention_forward(qh, kh, vh, shape);
  const k2c::ref::AttentionBackward g = k2c::ref::attention_backward(qh, kh, vh, heads_first(dout, heads), shape);
  const std::vector<double> o = tokens_first(f.o, heads), dq = tokens_first(g.dq, heads), dk = tokens_first(g.dk, kv_heads),
                            dv = tokens_first(g.dv, kv_heads);
  const std::vector<double>& lse = f.lse;  // [b][h][t], natural log
  // Each rank's rows of the whole, in local order, and its answer's references.
  std::vector<std::vector<std::pair<std::string, std::vector<double>>>> want(n);
  std::vector<std::vector<std::int64_t>> rows(n);
  for (int r = 0; r < n; ++r) {
    for (const std::int64_t chunk : {std::int64_t{r}, std::int64_t{2 * n - 1 - r}})
      for (int b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < C; ++t) rows[r].push_back(b * T + chunk * C + t);
    std::vector<float> mine;
    for (const auto& [data, width] : {std::pair{&q, qw}, std::pair{&k, kw}, std::pair{&v, kw}, std::pair{&dout, qw}})
      for (const std::int64_t row : rows[r]) mine.insert(mine.end(), data->begin() + row * width, data->begin() + (row + 1) * width);
    c.in.push_back(floats(mine));
    for (const auto& [name, data, width] :
         {std::tuple{"o", &o, qw}, std::tuple{"dq", &dq, qw}, std::tuple{"dk", &dk, kw}, std::tuple{"dv", &dv, kw}}) {
      std::vector<double> part;
      for (const std::int64_t row : rows[r]) part.insert(part.end(), data->begin() + row * width, data->begin() + (row + 1) * width);
      want[r].emplace_back(name, std::move(part));
    }
    std::vector<double> mine_lse;  // [j·B + b][h][t] of the rank's chunks j
    for (const std::int64_t chunk : {std::int64_t{r}, std::int64_t{2 * n - 1 - r}})
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < heads; ++h)
          for (std::int64_t t = 0; t < C; ++t) mine_lse.push_back(lse[(static_cast<std::size_t>(b) * heads + h) * T + chunk * C + t]);
    want[r].emplace_back("lse", std::move(mine_lse));
    c.out_bytes.push_back((rows[r].size() * 2 * (qw + kw) + 2 * B * heads * C) * sizeof(float));
  }
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      std::size_t at = 0;
      for (const auto& [name, ref] : want[r]) {
        if (const std::int64_t i = first_miss(got[r], at, ref); i >= 0) {
          if (name == "lse") {  // [j·B + b][h][t]
            const std::int64_t t = i % C, h = i / C % heads, jb = i / (C * heads);
            return "rank " + std::to_string(r) + ", lse of local chunk " + std::to_string(jb / B) + " of sequence " +
                   std::to_string(jb % B) + ", head " + std::to_string(h) + ", token " + std::to_string(t) + " of the chunk: " +
                   got_want(got[r], at, ref, i);
          }
          const std::int64_t width = static_cast<std::int64_t>(ref.size() / rows[r].size()), row = rows[r][i / width];
          return "rank " + std::to_string(r) + ", " + name + " of token " + std::to_string(row % T) + " of sequence " +
                 std::to_string(row / T) + ", element " + std::to_string(i % width) + ": " + got_want(got[r], at, ref, i);
        }
        at += ref.size();
      }
    }
    return "";
  };
  return c;
}

// Module 14's vocabulary-parallel cross-entropy. args: N rows, V (a multiple of the ranks),
// grad_scale (float bits). Rank r gets its columns [r·V/n, (r+1)·V/n) of the logits [N, V], then
// the targets (int32 [N], global ids, −1 for an ignored row), and answers the loss (double: the
// sum over counted rows) and dlogits [N, V/n] = grad_scale·(softmax − onehot) on its columns.
// Some rows are shifted by +100, beyond what exp can take in fp32 without the row maximum taken
// out first. Reference in double: the loss within 1e-5 relative (fp32 rows of at most a few
// hundred terms), dlogits within 1e-6·grad_scale + 1e-5 relative; the loss the same bits on every rank.
Case draw_cross_entropy(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int shape = index % 3;
  const std::int64_t N = shape == 0 ? 1 : shape == 1 ? 2 + static_cast<std::int64_t>(rng() % 16) : 64 + static_cast<std::int64_t>(rng() % 129);
  const std::int64_t V = n * (shape == 0 ? 1 : shape == 1 ? 1 + static_cast<std::int64_t>(rng() % 9) : 20 + static_cast<std::int64_t>(rng() % 80));
  const float scale = 1.0f / static_cast<float>(N + static_cast<std::int64_t>(rng() % 7));
  Case c;
  c.args[0] = N, c.args[1] = V, c.args[2] = std::bit_cast<std::int32_t>(scale);
  c.what = kind + ", " + std::to_string(N) + " row" + (N == 1 ? "" : "s") + " of " + std::to_string(V) + " logits on " +
           std::to_string(n) + " ranks";
  const std::uint64_t seed = rng();
  std::vector<float> logits(N * V);
  std::vector<std::int32_t> targets(N);
  for (std::int64_t i = 0; i < N; ++i) {
    const float shift = shape != 0 && rng() % 4 == 0 ? 100.0f : 0.0f;
    for (std::int64_t v = 0; v < V; ++v) logits[i * V + v] = shift + k2c::uniform_at(seed, i * V + v, -4.0f, 4.0f);
    // A few rows ignored (not the only row of the tiny case).
    targets[i] = shape != 0 && rng() % 8 == 0 ? -1 : static_cast<std::int32_t>(rng() % V);
  }
  const std::int64_t L = V / n;
  for (int r = 0; r < n; ++r) {
    std::vector<float> mine;
    for (std::int64_t i = 0; i < N; ++i) mine.insert(mine.end(), logits.begin() + i * V + r * L, logits.begin() + i * V + (r + 1) * L);
    Bytes in = floats(mine);
    const std::size_t at = in.size();
    in.resize(at + targets.size() * sizeof(std::int32_t));
    std::memcpy(in.data() + at, targets.data(), targets.size() * sizeof(std::int32_t));
    c.in.push_back(std::move(in));
    c.out_bytes.push_back(sizeof(double) + N * L * sizeof(float));
  }
  double loss = 0;
  std::vector<double> grad(N * V, 0.0);
  for (std::int64_t i = 0; i < N; ++i) {
    if (targets[i] < 0) continue;
    double top = -1e300, sum = 0;
    for (std::int64_t v = 0; v < V; ++v) top = std::max(top, double{logits[i * V + v]});
    for (std::int64_t v = 0; v < V; ++v) sum += std::exp(logits[i * V + v] - top);
    loss += top + std::log(sum) - logits[i * V + targets[i]];
    for (std::int64_t v = 0; v < V; ++v)
      grad[i * V + v] = scale * (std::exp(logits[i * V + v] - top) / sum - (v == targets[i] ? 1.0 : 0.0));
  }
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      double l;
      std::memcpy(&l, got[r].data(), sizeof l);
      if (!(std::abs(l - loss) <= 1e-5 * std::max(1.0, std::abs(loss))))
        return rank + ": the loss is " + std::to_string(l) + ", not " + std::to_string(loss);
      if (std::memcmp(got[r].data(), got[0].data(), sizeof l) != 0) return rank + "'s loss is not rank 0's to the bit";
      for (std::int64_t i = 0; i < N; ++i)
        for (std::int64_t j = 0; j < L; ++j) {
          float g;
          std::memcpy(&g, got[r].data() + sizeof l + (i * L + j) * sizeof(float), sizeof g);
          const double w = grad[i * V + r * L + j];
          if (!(std::abs(g - w) <= 1e-6 * scale + 1e-5 * std::abs(w)))
            return rank + ": dlogits of row " + std::to_string(i) + ", column " + std::to_string(r * L + j) + ": got " +
                   std::to_string(g) + ", want " + std::to_string(w);
        }
    }
    return "";
  };
  return c;
}

}  // namespace k2c::rank_witness
