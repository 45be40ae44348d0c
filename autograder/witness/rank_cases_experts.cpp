// autograder/witness/rank_cases_experts.cpp — k2c_rank_witness's cases of module 17's expert
// parallelism: the plan, the exchange of rows and back, and dispatch with combine.
//
// args: N tokens per rank, d, E experts (n·L), top_k, capacity C (−1: none). Every rank gets its
// routing: choices [N·k] (int32, distinct experts per token) and weights [N·k] (fp32), then
//   expert_plan              nothing more; answers the plan's numbers as
//                            int64 kept[E], begin[E + 1], dropped, from[n·L], offsets[L + 1],
//                            then int32 token[K], fp32 weight[K]
//   expert_exchange          its rows [K, d] in plan order; answers to_experts' expert rows
//                            [R, d], then from_experts' rows back [K, d]
//   expert_dispatch_combine  x [N, d] and y₀ [N, d]; answers dispatch's expert input [R, d], then
//                            combine's returned rows [K, d] (identity experts: expert_out is the
//                            expert input) and y [N, d] = y₀ + Σ weight·x[token] over kept rows
// The contract's rules (expert_parallel.h): a rank keeps, per expert, its first C assignments in
// token order; plan order is by expert, then token; the experts' input on rank r is grouped by
// local expert, then sending rank, then that rank's plan order.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "k2c/core/random.h"
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
      for (int e = 0; e < E; ++e)
        for (const auto& [t, v] : m.rows[e]) {
          w.back.insert(w.back.end(), x[r].begin() + std::int64_t{t} * d, x[r].begin() + std::int64_t{t + 1} * d);
          for (int j = 0; j < d; ++j) w.y[std::int64_t{t} * d + j] += static_cast<double>(v) * x[r][std::int64_t{t} * d + j];
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
          const std::size_t sizes[] = {8u * E, 8u * (E + 1), 8, 8u * n * L, 8u * (L + 1)};
          const char* names[] = {"kept", "begin", "dropped", "from", "offsets", "token or weight"};
          std::size_t at = 0, f = 0;
          for (; f < 5; at += sizes[f++])
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
        if (!(std::abs(g - w.y[i]) <= 1e-6 * std::abs(w.y[i]) + 1e-6 * w.top))
          return rank + ": combine: y[" + std::to_string(i / d) + "][" + std::to_string(i % d) + "]: got " +
                 std::to_string(g) + ", want " + std::to_string(w.y[i]) + " (y₀ + Σ weight·row over kept rows)";
      }
    }
    return "";
  };
  return c;
}

}  // namespace k2c::rank_witness
