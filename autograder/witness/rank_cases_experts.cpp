// autograder/witness/rank_cases_experts.cpp — k2c_rank_witness's cases of module 17's expert
// parallelism: the plan, the exchange of rows and back, dispatch with combine, and the whole layer.
//
// args: N tokens per rank, d, E experts (n·L), top_k, capacity C (−1: none). Every rank gets its
// routing: choices [N·k] (int32, distinct experts per token) and weights [N·k] (fp32), then
//   expert_plan              nothing more; answers the plan's numbers as
//                            int64 kept[E], begin[E + 1], dropped, from[n·L], offsets[L + 1],
//                            ranks, rank, experts, local_experts, top_k, tokens, capacity,
//                            then int32 token[K], fp32 weight[K]
//   expert_exchange          its rows [K, d] in plan order; answers to_experts' expert rows
//                            [R, d], then from_experts' rows back [K, d]
//   expert_dispatch_combine  x [N, d] and y₀ [N, d]; answers dispatch's expert input [R, d], then
//                            combine's returned rows [K, d] (identity experts: expert_out is the
//                            expert input) and y [N, d] = y₀ + Σ weight·x[token] over kept rows
// The contract's rules (expert_parallel.h): a rank keeps, per expert, its first C assignments in
// token order; plan order is by expert, then token; the experts' input on rank r is grouped by
// local expert, then sending rank, then that rank's plan order.
//
// expert_layer, expert_layer_top_one, expert_layer_skewed, expert_layer_capacity: the whole layer
// (ExpertParallelMoe "moe" over all the ranks), forward, backward and reduce_gradients.
//   args: 0 N tokens per rank, 1 d, 2 E (n·L), 3 top_k, 4 d_expert, 5 shared experts, 6 the
//   balance coefficient, 7 ctx.loss_scale (both the float's bits), 8 the capacity factor (the
//   double's bits; 0: none), 12 the weights' seed. Input: the rank's x [N, d], dy [N, d], the
//   router's weight [E, d] (the checker's: every token's top k + 1 logits at least 1e-3 apart, so
//   fp32 and double pick the same experts), then the names of the parameters to answer, one per
//   line. The answer: the balance term (double), the rank's and the group's dropped assignments
//   (int64), ctx.aux_loss after forward (double: the balance term, added to 0), then from Saved the
//   group's tokens, the plan's capacity and the group's assignments per expert before the capacity
//   (int64, 2 + E), y and dx [N, d], then the gradients named as the rank holds them after
//   reduce_gradients: the router and the shared expert whole, its experts' slices of the rest.
//   Skewed: tokens lie near one direction the router's rows point along or against, so expert 0
//   takes most rows and the last rank's experts none (that rank receives no row at all).
//   Reference: model::Moe over every rank's tokens in one process; with a capacity, the double
//   oracle of k2c/reference (per sending rank, as capacity is), no balance term.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <stdexcept>

#include "k2c/core/random.h"
#include "k2c/model/moe.h"
#include "k2c/model/testing.h"
#include "k2c/reference/reference.h"
#include "rank_cases.h"

namespace k2c::rank_witness {

namespace {

struct Kept {
  std::vector<std::vector<std::pair<std::int32_t, float>>> rows;  // [E]: (token, weight), token order
  std::int64_t dropped = 0;
  std::int64_t total() const {
    std::int64_t k = 0;
    for (const auto& e : rows) k += static_cast<std::int64_t>(e.size());
    return k;
  }
};

Kept kept_of(const std::vector<std::int32_t>& expert, const std::vector<float>& weight, int N, int k, int E,
             std::int64_t C) {
  Kept out;
  out.rows.resize(E);
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = expert[t * k + j];
      if (C >= 0 && static_cast<std::int64_t>(out.rows[e].size()) >= C) {
        ++out.dropped;
        continue;
      }
      out.rows[e].emplace_back(t, weight[t * k + j]);
    }
  return out;
}

template <class T>
void append(Bytes& b, const T* v, std::size_t count) {
  const std::size_t at = b.size();
  b.resize(at + count * sizeof(T));
  if (count) std::memcpy(b.data() + at, v, count * sizeof(T));
}

// The first element where `got` (from byte `at`) and `want` differ in bits; -1 when none.
std::int64_t first_difference(const Bytes& got, std::size_t at, const std::vector<float>& want) {
  for (std::size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(got.data() + at + 4 * i, &want[i], 4) != 0) return static_cast<std::int64_t>(i);
  return -1;
}

}  // namespace

Case draw_experts(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int which = kind == "expert_plan" ? 0 : kind == "expert_exchange" ? 1 : 2;
  const int L = 1 + static_cast<int>(rng() % 4), E = n * L;
  // In turn: one token of one number, a few tokens, a few hundred.
  const int shape = index % 3;
  const int N = shape == 0 ? 1 : shape == 1 ? 2 + static_cast<int>(rng() % 16) : 100 + static_cast<int>(rng() % 200);
  const int d = shape == 0 ? 1 : shape == 1 ? 1 + static_cast<int>(rng() % 9) : 8 + static_cast<int>(rng() % 57);
  const int k = shape == 0 ? 1 : 1 + static_cast<int>(rng() % std::min(E, 4));
  // Skewed loads: experts weighted 1/(e + 1) after a shuffle, some never chosen (when E leaves room).
  std::vector<int> order(E);
  for (int e = 0; e < E; ++e) order[e] = e;
  std::shuffle(order.begin(), order.end(), rng);
  const int usable = std::max(k, E - static_cast<int>(rng() % (E / 2 + 1)));
  // Capacity: none half the time, else the contract's rule with a factor of 0.3 to 1.3.
  const std::int64_t C = rng() % 2 ? -1
                                   : static_cast<std::int64_t>(std::ceil((0.3 + (rng() % 1000) / 1000.0) *
                                                                          static_cast<double>(N) * k / E));
  Case c;
  c.args[0] = N, c.args[1] = d, c.args[2] = E, c.args[3] = k, c.args[4] = C;
  c.what = kind + ", " + std::to_string(N) + " tokens of " + std::to_string(d) + ", top " + std::to_string(k) +
           " of " + std::to_string(E) + " experts (" + std::to_string(usable) + " chosen), capacity " +
           (C < 0 ? std::string("none") : std::to_string(C)) + " on " + std::to_string(n) + " ranks";

  std::vector<std::vector<std::int32_t>> expert(n);
  std::vector<std::vector<float>> weight(n), rows(n), x(n), y0(n);
  std::vector<Kept> kept;
  const std::uint64_t seed = rng();
  for (int s = 0; s < n; ++s) {
    std::mt19937_64 pick(k2c::mix64(seed + 7 * s));
    for (int t = 0; t < N; ++t) {
      std::vector<bool> taken(E, false);
      for (int j = 0; j < k; ++j) {
        double total = 0;
        for (int i = 0; i < usable; ++i) total += taken[order[i]] ? 0.0 : 1.0 / (i + 1);
        double v = std::uniform_real_distribution<double>(0, total)(pick);
        int e = -1;
        for (int i = 0; i < usable; ++i) {
          if (taken[order[i]]) continue;
          e = order[i];
          if ((v -= 1.0 / (i + 1)) < 0) break;
        }
        taken[e] = true;
        expert[s].push_back(e);
        weight[s].push_back(k2c::uniform_at(seed + 7 * s + 1, t * k + j, 0.05f, 1.0f));
      }
    }
    kept.push_back(kept_of(expert[s], weight[s], N, k, E, C));
    const std::int64_t K = kept[s].total();
    for (std::int64_t i = 0; i < K * d; ++i) rows[s].push_back(k2c::uniform_at(seed + 7 * s + 2, i, -1.0f, 1.0f));
    for (std::int64_t i = 0; i < std::int64_t{N} * d; ++i) {
      x[s].push_back(k2c::uniform_at(seed + 7 * s + 3, i, -1.0f, 1.0f));
      y0[s].push_back(k2c::uniform_at(seed + 7 * s + 4, i, -1.0f, 1.0f));
    }
    Bytes in;
    append(in, expert[s].data(), expert[s].size());
    append(in, weight[s].data(), weight[s].size());
    if (which == 1) append(in, rows[s].data(), rows[s].size());
    if (which == 2) append(in, x[s].data(), x[s].size()), append(in, y0[s].data(), y0[s].size());
    c.in.push_back(std::move(in));
  }

  // Each rank's right answer: the plan's numbers, and the rows its experts receive, from each
  // sender its rows (row_of: sender, place in the sender's plan order, token) for that expert.
  auto expert_rows = [&](int r, auto row_of) {
    std::vector<float> out;
    for (int l = 0; l < L; ++l)
      for (int s = 0; s < n; ++s) {
        std::int64_t at = 0;
        for (int e = 0; e < r * L + l; ++e) at += static_cast<std::int64_t>(kept[s].rows[e].size());
        for (const auto& [t, w] : kept[s].rows[r * L + l]) {
          const float* row = row_of(s, at++, t);
          out.insert(out.end(), row, row + d);
        }
      }
    return out;
  };
  struct Want {
    Bytes plan;                                  // expert_plan: the whole answer
    std::vector<float> there, back, y_rows;      // the exchanged rows
    std::vector<double> y;                       // combine's y, in double
    std::vector<double> terms;                   // Σ of its terms' |values| (y₀ and each weight·row)
    double top = 0;                              // the largest |y|
  };
  std::vector<Want> want(n);
  for (int r = 0; r < n; ++r) {
    Want& w = want[r];
    const Kept& m = kept[r];
    if (which == 0) {
      std::vector<std::int64_t> counts(E), begin(E + 1, 0), from(n * L), offsets(L + 1, 0);
      std::vector<std::int32_t> token;
      std::vector<float> wt;
      for (int e = 0; e < E; ++e) {
        counts[e] = static_cast<std::int64_t>(m.rows[e].size());
        begin[e + 1] = begin[e] + counts[e];
        for (const auto& [t, v] : m.rows[e]) token.push_back(t), wt.push_back(v);
      }
      for (int s = 0; s < n; ++s)
        for (int l = 0; l < L; ++l) from[s * L + l] = static_cast<std::int64_t>(kept[s].rows[r * L + l].size());
      for (int l = 0; l < L; ++l) {
        offsets[l + 1] = offsets[l];
        for (int s = 0; s < n; ++s) offsets[l + 1] += from[s * L + l];
      }
      append(w.plan, counts.data(), counts.size());
      append(w.plan, begin.data(), begin.size());
      append(w.plan, &m.dropped, 1);
      append(w.plan, from.data(), from.size());
      append(w.plan, offsets.data(), offsets.size());
      const std::int64_t scalars[] = {n, r, E, L, k, N, C};
      append(w.plan, scalars, std::size(scalars));
      append(w.plan, token.data(), token.size());
      append(w.plan, wt.data(), wt.size());
      c.out_bytes.push_back(w.plan.size());
      continue;
    }
    if (which == 1) {
      w.there = expert_rows(r, [&](int s, std::int64_t at, int) { return rows[s].data() + at * d; });
      w.back = rows[r];
    } else {
      w.there = expert_rows(r, [&](int s, std::int64_t, int t) { return x[s].data() + std::int64_t{t} * d; });
      w.y.assign(y0[r].begin(), y0[r].end());
      for (float v : y0[r]) w.terms.push_back(std::abs(static_cast<double>(v)));
      for (int e = 0; e < E; ++e)
        for (const auto& [t, v] : m.rows[e]) {
          w.back.insert(w.back.end(), x[r].begin() + std::int64_t{t} * d, x[r].begin() + std::int64_t{t + 1} * d);
          for (int j = 0; j < d; ++j) {
            const double term = static_cast<double>(v) * x[r][std::int64_t{t} * d + j];
            w.y[std::int64_t{t} * d + j] += term;
            w.terms[std::int64_t{t} * d + j] += std::abs(term);
          }
        }
      for (double v : w.y) w.top = std::max(w.top, std::abs(v));
    }
    c.out_bytes.push_back(4 * (w.there.size() + w.back.size() + w.y.size()));
  }

  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    const char* first = which == 1 ? "to_experts" : "dispatch";
    const char* second = which == 1 ? "from_experts" : "combine's returned rows";
    for (int r = 0; r < n; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      const Want& w = want[r];
      if (which == 0) {
        if (got[r] != w.plan) {
          // Say which field: the layout above, in bytes.
          const std::size_t sizes[] = {8u * E, 8u * (E + 1), 8, 8u * n * L, 8u * (L + 1), 8 * 7};
          const char* names[] = {"kept", "begin", "dropped", "from", "offsets",
                                 "ranks, rank, experts, local_experts, top_k, tokens or capacity", "token or weight"};
          std::size_t at = 0, f = 0;
          for (; f < std::size(sizes); at += sizes[f++])
            if (std::memcmp(got[r].data() + at, w.plan.data() + at, sizes[f]) != 0) break;
          return rank + ": the plan's " + names[f] + " differ from the contract's";
        }
        continue;
      }
      if (const std::int64_t i = first_difference(got[r], 0, w.there); i >= 0)
        return rank + ": " + first + ": expert row " + std::to_string(i / d) + ", column " + std::to_string(i % d) +
               ": got " + std::to_string(float_at(got[r], i)) + ", want " + std::to_string(w.there[i]) +
               " (rows grouped by local expert, then sending rank, then its plan order)";
      if (const std::int64_t i = first_difference(got[r], 4 * w.there.size(), w.back); i >= 0)
        return rank + ": " + second + ": row " + std::to_string(i / d) + " of the plan order, column " +
               std::to_string(i % d) + ": not the row that left from there";
      const std::size_t y_at = w.there.size() + w.back.size();
      for (std::size_t i = 0; i < w.y.size(); ++i) {
        const double g = float_at(got[r], y_at + i);
        // fp32 sums of a few terms: rounding of the order of float's epsilon times the terms' size,
        // however much of them cancels in y (a y near zero from terms near 1 carries their rounding).
        if (!(std::abs(g - w.y[i]) <= 1e-6 * w.terms[i] + 1e-6 * w.top))
          return rank + ": combine: y[" + std::to_string(i / d) + "][" + std::to_string(i % d) + "]: got " +
                 std::to_string(g) + ", want " + std::to_string(w.y[i]) + " (y₀ + Σ weight·row over kept rows)";
      }
    }
    return "";
  };
  return c;
}

Case draw_expert_layer(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  namespace km = k2c::model;
  const bool skewed = kind == "expert_layer_skewed" || kind == "expert_layer_capacity";
  const bool capacity = kind == "expert_layer_capacity";
  const int shape = index % 3;
  const int L = 1 + static_cast<int>(rng() % 2), E = n * L;
  // Skewed routing leaves the last rank's L experts out: top k of the other E − L.
  const int k_max = std::min(3, skewed ? E - L : E);
  const int k = kind == "expert_layer_top_one" || shape == 0 ? 1 : 1 + static_cast<int>(rng() % k_max);
  const int N = shape == 0 ? 1 : shape == 1 ? 2 + static_cast<int>(rng() % 7) : 24 + static_cast<int>(rng() % 41);
  const int d = shape == 0 ? 2 : shape == 1 ? 2 + static_cast<int>(rng() % 7) : 8 + static_cast<int>(rng() % 17);
  km::MoeConfig cfg;
  cfg.d_model = d, cfg.experts = E, cfg.top_k = k;
  cfg.d_expert = shape == 0 ? 1 : 1 + static_cast<std::int64_t>(rng() % (shape == 1 ? 6 : 24));
  cfg.shared_experts = static_cast<int>(rng() % 2);
  cfg.balance_coef = capacity ? 0.0f : 0.01f;
  const float scale = capacity ? 1.0f : 1.0f / static_cast<float>(n * N);
  const double factor = capacity ? 0.3 + (rng() % 800) / 1000.0 : 0.0;
  const std::uint64_t weights = rng() >> 1, data = rng();
  Case c;
  const std::int64_t args[] = {N, d, E, k, cfg.d_expert, cfg.shared_experts, std::bit_cast<std::int32_t>(cfg.balance_coef),
                               std::bit_cast<std::int32_t>(scale), std::bit_cast<std::int64_t>(factor)};
  std::copy(std::begin(args), std::end(args), c.args);
  c.args[12] = static_cast<std::int64_t>(weights);
  // The capacity as the contract computes it (capacity() in expert_parallel.h), per rank's N tokens.
  const std::int64_t T = std::int64_t{n} * N,
                     C = factor > 0 ? static_cast<std::int64_t>(std::ceil(factor * static_cast<double>(N * k) / E)) : -1;
  c.what = kind + ", " + std::to_string(N) + (N == 1 ? " token" : " tokens") + " of " + std::to_string(d) + " per rank, top " + std::to_string(k) +
           " of " + std::to_string(E) + " experts of " + std::to_string(cfg.d_expert) +
           (cfg.shared_experts ? " and a shared one" : "") + (capacity ? ", capacity " + std::to_string(C) : "") + " on " +
           std::to_string(n) + " ranks";

  // The router and the tokens. Skewed: a direction u, router rows a_e·u + noise (a_0 = 2, the last
  // rank's −2, the rest in [−1, 1]), tokens s·u + noise with s in [1, 3].
  std::vector<double> u(d);
  for (int j = 0; j < d; ++j) u[j] = (k2c::mix64(data + 5 + j) % 2 ? 1.0 : -1.0) / std::sqrt(static_cast<double>(d));
  std::vector<float> router(static_cast<std::size_t>(E) * d);
  for (int e = 0; e < E; ++e) {
    const double a = e == 0 ? 2.0 : e >= E - L ? -2.0 : k2c::uniform_at(data + 2, e, -1.0f, 1.0f);
    for (int j = 0; j < d; ++j)
      router[std::size_t(e) * d + j] = skewed ? static_cast<float>(a * u[j]) + k2c::uniform_at(data + 3, e * d + j, -0.05f, 0.05f)
                                              : k2c::uniform_at(data + 3, e * d + j, -1.0f, 1.0f);
  }
  std::vector<float> x(static_cast<std::size_t>(T) * d), dy(x.size());
  std::vector<std::int64_t> counts(E, 0);  // the group's assignments per expert, before the capacity
  for (std::int64_t t = 0; t < T; ++t) {
    // Draw the token again until its top k + 1 logits are clear of each other.
    for (std::uint64_t attempt = 0;; ++attempt) {
      if (attempt == 1000) throw std::runtime_error("no token with clear routing margins in 1000 draws");
      const std::uint64_t key = k2c::mix64(data + 17 * static_cast<std::uint64_t>(t) + (attempt << 32));
      const double s = 1.0 + 2.0 * k2c::uniform_at(key, 0, 0.0f, 1.0f);
      for (int j = 0; j < d; ++j)
        x[t * d + j] = skewed ? static_cast<float>(s * u[j]) + k2c::uniform_at(key, 1 + j, -0.3f, 0.3f) : k2c::uniform_at(key, 1 + j, -1.0f, 1.0f);
      std::vector<std::pair<double, int>> logit(E);
      for (int e = 0; e < E; ++e) {
        logit[e] = {0.0, e};
        for (int j = 0; j < d; ++j) logit[e].first += static_cast<double>(x[t * d + j]) * router[std::size_t(e) * d + j];
      }
      std::sort(logit.begin(), logit.end(), std::greater<>());
      bool clear = true;
      for (int j = 0; j + 1 < E && j < k; ++j) clear = clear && logit[j].first - logit[j + 1].first >= 1e-3;
      if (clear) {
        for (int j = 0; j < k; ++j) ++counts[logit[j].second];
        break;
      }
    }
    for (int j = 0; j < d; ++j) dy[t * d + j] = k2c::uniform_at(data + 1, t * d + j, -1.0f, 1.0f);
  }

  // The reference's parameters: the whole layer's, from the seed, the router replaced.
  km::testing::Side ref;
  const km::Moe whole(ref.params, "moe", cfg);
  ref.materialize(weights);
  ref.ops().upload(ref.params.value(ref.find("moe.router.weight")), router.data());
  std::vector<std::string> names = {"moe.router.weight", "moe.experts.gate.weight", "moe.experts.up.weight",
                                    "moe.experts.down.weight"};
  if (cfg.shared_experts) names.insert(names.end(), {"moe.shared.gate.weight", "moe.shared.up.weight", "moe.shared.down.weight"});

  std::vector<float> y, dx;
  std::map<std::string, std::vector<float>> grads;
  double balance = 0;
  std::vector<std::int64_t> dropped(n, 0);
  if (!capacity) {
    ref.ctx.loss_scale = scale;
    km::Tensor xt = ref.upload(x, {T, d}), dyt = ref.upload(dy, {T, d}), yt = ref.tensor({T, d}), dxt = ref.tensor({T, d});
    km::Moe::Saved saved;
    whole.forward(ref.ctx, xt, yt, saved);
    ref.params.zero_grads(ref.ops());
    ref.params.begin_backward();
    whole.backward(ref.ctx, xt, saved, dyt, dxt);
    ref.params.end_backward();
    y = ref.download(yt), dx = ref.download(dxt), balance = saved.balance_loss;
    for (const std::string& name : names) grads[name] = ref.grad(name);
  } else {
    // The oracle, once per sending rank (its capacity counts its own assignments), gradients summed.
    k2c::ref::MoeLayer layer;
    layer.hidden = d, layer.ffn = static_cast<int>(cfg.d_expert), layer.shared_ffn = static_cast<int>(cfg.d_expert);
    layer.shared = cfg.shared_experts, layer.router.experts = E, layer.router.top_k = k, layer.router.normalize = true;
    layer.capacity = static_cast<int>(C);
    // The oracle reads the weights through spans: they live here.
    std::map<std::string, std::vector<float>> held;
    for (const std::string& name : names) held[name] = ref.value(name);
    layer.w_router = held["moe.router.weight"];
    layer.w1 = held["moe.experts.gate.weight"], layer.w3 = held["moe.experts.up.weight"], layer.w2 = held["moe.experts.down.weight"];
    if (cfg.shared_experts)  // one shared expert: the Mlp's [F, d], [F, d], [d, F] are the oracle's stacks
      layer.shared_w1 = held["moe.shared.gate.weight"], layer.shared_w3 = held["moe.shared.up.weight"],
      layer.shared_w2 = held["moe.shared.down.weight"];
    std::map<std::string, std::vector<double>> sums;
    for (int q = 0; q < n; ++q) {
      const std::span<const float> xq(x.data() + std::size_t(q) * N * d, std::size_t(N) * d),
          dyq(dy.data() + std::size_t(q) * N * d, std::size_t(N) * d);
      const k2c::ref::MoeForward f = k2c::ref::moe_forward(xq, N, layer);
      const k2c::ref::MoeBackward b = k2c::ref::moe_backward(xq, N, layer, dyq);
      y.insert(y.end(), f.y.begin(), f.y.end()), dx.insert(dx.end(), b.dx.begin(), b.dx.end());
      dropped[q] = f.dispatch.dropped;
      const std::pair<const char*, const std::vector<double>*> parts[] = {
          {"moe.router.weight", &b.dw_router}, {"moe.experts.gate.weight", &b.dw1}, {"moe.experts.up.weight", &b.dw3},
          {"moe.experts.down.weight", &b.dw2}, {"moe.shared.gate.weight", &b.dshared_w1},
          {"moe.shared.up.weight", &b.dshared_w3}, {"moe.shared.down.weight", &b.dshared_w2}};
      for (const auto& [name, v] : parts) {
        std::vector<double>& sum = sums[name];
        if (sum.empty()) sum.assign(v->size(), 0.0);
        for (std::size_t i = 0; i < v->size(); ++i) sum[i] += (*v)[i];
      }
    }
    for (const std::string& name : names) grads[name].assign(sums[name].begin(), sums[name].end());
  }
  std::int64_t group_dropped = 0;
  for (std::int64_t v : dropped) group_dropped += v;

  std::string listed;
  for (const std::string& name : names) listed += name + "\n";
  std::vector<Tensors> want(n);
  for (int r = 0; r < n; ++r) {
    const std::size_t rows = std::size_t(N) * d, first = std::size_t(r) * rows;
    want[r] = {{"y (this rank's tokens)", {y.begin() + first, y.begin() + first + rows}},
               {"dx (this rank's tokens)", {dx.begin() + first, dx.begin() + first + rows}}};
    for (const std::string& name : names) {
      const std::vector<float>& g = grads.at(name);
      const bool expert = name.find(".experts.") != std::string::npos;
      const std::size_t slice = expert ? g.size() / n : g.size(), at = expert ? r * slice : 0;
      want[r].push_back({name + " gradient" + (expert ? " (this rank's experts)" : ""), {g.begin() + at, g.begin() + at + slice}});
    }
    std::size_t bytes = 2 * sizeof(double) + (4 + E) * sizeof(std::int64_t);
    for (const auto& t : want[r]) bytes += t.second.size() * sizeof(float);
    c.out_bytes.push_back(bytes);
    Bytes in;
    append(in, x.data() + first, rows);
    append(in, dy.data() + first, rows);
    append(in, router.data(), router.size());
    append(in, listed.data(), listed.size());
    c.in.push_back(std::move(in));
  }
  // Against the double oracle (capacity), values that cancel to near zero carry the float layer's
  // rounding: a floor of 1e-6 of the rank's largest value (8 float epsilons). A reference run drew
  // a case whose y element differed from the oracle's by more than the 1e-8 floor, both printing
  // as -0.000000.
  const auto tensors = capacity ? judge_layer(want, 0, "the double oracle's", 1e-5, 1e-6)
                                : judge_layer(want, 0, "one process's");
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    const std::size_t head = 2 * sizeof(double) + (4 + E) * sizeof(std::int64_t);
    std::vector<Bytes> rest;
    for (int r = 0; r < n; ++r) {
      const std::string rank = "rank " + std::to_string(r) + ": ";
      double b, aux;
      std::int64_t mine, group;
      std::memcpy(&b, got[r].data(), sizeof b);
      std::memcpy(&mine, got[r].data() + 8, sizeof mine);
      std::memcpy(&group, got[r].data() + 16, sizeof group);
      std::memcpy(&aux, got[r].data() + 24, sizeof aux);
      if (!(std::abs(b - balance) <= 1e-5 * std::abs(balance) + 1e-12))
        return rank + "the balance term is " + std::to_string(b) + ", one process's " + std::to_string(balance);
      if (!(std::abs(aux - b) <= 1e-12))  // forward adds the term to a context whose aux_loss was 0
        return rank + "forward left ctx.aux_loss at " + std::to_string(aux) + ", not the balance term " + std::to_string(b);
      if (std::memcmp(got[r].data(), got[0].data(), sizeof b) != 0) return rank + "the balance term differs from rank 0's";
      if (mine != dropped[r] || group != group_dropped)
        return rank + std::to_string(mine) + " dropped here and " + std::to_string(group) + " in the group, not " +
               std::to_string(dropped[r]) + " and " + std::to_string(group_dropped) + " (capacity " + std::to_string(C) + ")";
      std::vector<std::int64_t> saved(2 + E);
      std::memcpy(saved.data(), got[r].data() + 32, saved.size() * sizeof(std::int64_t));
      if (saved[0] != T) return rank + "Saved's group_tokens is " + std::to_string(saved[0]) + ", not " + std::to_string(T);
      if (saved[1] != C)
        return rank + "the plan's capacity is " + std::to_string(saved[1]) + ", the contract's " + std::to_string(C) +
               (C < 0 ? " (none)" : "");
      for (int e = 0; e < E; ++e)
        if (saved[2 + e] != counts[e])
          return rank + "Saved's counts[" + std::to_string(e) + "] is " + std::to_string(saved[2 + e]) + ", the group's " +
                 std::to_string(counts[e]) + " assignments to that expert (before the capacity)";
      rest.emplace_back(got[r].begin() + head, got[r].end());
    }
    return tensors(rest);
  };
  return c;
}

}  // namespace k2c::rank_witness
