// reference_moe.cpp — the mixture-of-experts layer in double, the oracle of module 10 (see
// k2c/reference/reference.h): router, load-balancing loss, dispatch with capacity, SwiGLU experts,
// combine.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "k2c/reference/reference.h"

namespace k2c::ref {
namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("moe reference: ") + what);
}

// Indices 0..n-1 ordered by descending key, ties by ascending index: the deterministic top-k.
std::vector<int> ranked(const std::vector<double>& key) {
  std::vector<int> order(key.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
  return order;
}

std::vector<double> softmax(std::span<const float> z) {
  double m = -INFINITY, sum = 0;
  for (float v : z) m = std::max(m, static_cast<double>(v));
  std::vector<double> p(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) sum += (p[i] = std::exp(z[i] - m));
  for (double& v : p) v /= sum;
  return p;
}

}  // namespace

Routing route(std::span<const float> logits, std::span<const float> bias, int tokens,
              const RouterConfig& c) {
  const int E = c.experts;
  require(E >= 1 && c.top_k >= 1 && c.groups >= 1 && E % c.groups == 0 && c.top_groups >= 1 &&
              c.top_groups <= c.groups && c.top_k <= E / c.groups * c.top_groups,
          "bad router configuration");
  require(tokens >= 0 && logits.size() == static_cast<std::size_t>(tokens) * E, "logits must be tokens × experts");
  require(bias.empty() || bias.size() == static_cast<std::size_t>(E), "bias must have one entry per expert");
  const int per_group = E / c.groups;
  Routing r;
  r.expert.reserve(static_cast<std::size_t>(tokens) * c.top_k);
  r.weight.reserve(static_cast<std::size_t>(tokens) * c.top_k);
  r.scores.reserve(logits.size());
  for (int t = 0; t < tokens; ++t) {
    const std::span<const float> z = logits.subspan(static_cast<std::size_t>(t) * E, E);
    std::vector<double> s(E);
    if (c.score == RouterScore::softmax) {
      s = softmax(z);
    } else {
      for (int e = 0; e < E; ++e) s[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(z[e])));
    }
    std::vector<double> key(E);
    for (int e = 0; e < E; ++e) key[e] = s[e] + (bias.empty() ? 0.0 : bias[e]);
    // Groups: scored by their two best keys; experts of groups outside the best top_groups drop out.
    if (c.groups > 1) {
      std::vector<double> group_score(c.groups);
      for (int g = 0; g < c.groups; ++g) {
        std::vector<double> mine(key.begin() + g * per_group, key.begin() + (g + 1) * per_group);
        std::sort(mine.rbegin(), mine.rend());
        group_score[g] = mine[0] + (per_group > 1 ? mine[1] : 0.0);
      }
      const std::vector<int> best = ranked(group_score);
      std::vector<bool> eligible(c.groups, false);
      for (int i = 0; i < c.top_groups; ++i) eligible[best[i]] = true;
      for (int e = 0; e < E; ++e)
        if (!eligible[e / per_group]) key[e] = -INFINITY;
    }
    const std::vector<int> order = ranked(key);
    double chosen_sum = 0;
    for (int j = 0; j < c.top_k; ++j) chosen_sum += s[order[j]];
    const bool normalize = c.normalize || c.score == RouterScore::sigmoid;
    for (int j = 0; j < c.top_k; ++j) {
      r.expert.push_back(order[j]);
      r.weight.push_back((normalize ? s[order[j]] / chosen_sum : s[order[j]]) * c.route_scale);
    }
    r.scores.insert(r.scores.end(), s.begin(), s.end());
  }
  return r;
}

BalanceLoss balance_loss(std::span<const float> logits, const Routing& routing, int tokens,
                         int experts, int top_k, double alpha) {
  require(tokens >= 1 && experts >= 1 && top_k >= 1 &&
              logits.size() == static_cast<std::size_t>(tokens) * experts &&
              routing.expert.size() == static_cast<std::size_t>(tokens) * top_k,
          "balance loss: sizes do not match");
  std::vector<double> count(experts, 0.0);
  for (int e : routing.expert) count[e] += 1;
  const double c = alpha * experts / (static_cast<double>(top_k) * tokens * tokens);
  BalanceLoss out;
  out.dlogits.resize(logits.size());
  for (int t = 0; t < tokens; ++t) {
    const std::vector<double> p = softmax(logits.subspan(static_cast<std::size_t>(t) * experts, experts));
    // dL/dp_i = c · count_i; through the softmax: dz_j = p_j (g_j − Σ_i p_i g_i).
    double dot = 0;
    for (int i = 0; i < experts; ++i) {
      out.loss += c * count[i] * p[i];
      dot += p[i] * c * count[i];
    }
    for (int j = 0; j < experts; ++j)
      out.dlogits[static_cast<std::size_t>(t) * experts + j] = p[j] * (c * count[j] - dot);
  }
  return out;
}

Dispatch dispatch(const Routing& routing, int tokens, int experts, int top_k, int capacity) {
  require(tokens >= 0 && experts >= 1 && top_k >= 1 &&
              routing.expert.size() == static_cast<std::size_t>(tokens) * top_k,
          "dispatch: sizes do not match");
  Dispatch d;
  d.counts.assign(experts, 0);
  d.slot.assign(routing.expert.size(), -1);
  // Kept assignments per expert, in token order (then choice order).
  std::vector<std::vector<int>> kept(experts);
  for (std::size_t a = 0; a < routing.expert.size(); ++a) {
    const int e = routing.expert[a];
    require(e >= 0 && e < experts, "dispatch: expert index out of range");
    if (capacity >= 0 && static_cast<int>(kept[e].size()) >= capacity) {
      ++d.dropped;
      continue;
    }
    kept[e].push_back(static_cast<int>(a));
  }
  d.offsets.assign(experts + 1, 0);
  for (int e = 0; e < experts; ++e) {
    d.counts[e] = static_cast<int>(kept[e].size());
    d.offsets[e + 1] = d.offsets[e] + d.counts[e];
    for (int i = 0; i < d.counts[e]; ++i) {
      d.slot[kept[e][i]] = d.offsets[e] + i;
      d.source.push_back(kept[e][i] / top_k);
    }
  }
  return d;
}

std::vector<double> permute(std::span<const float> x, int hidden, const Dispatch& d) {
  std::vector<double> rows(d.source.size() * static_cast<std::size_t>(hidden));
  for (std::size_t i = 0; i < d.source.size(); ++i)
    for (int c = 0; c < hidden; ++c)
      rows[i * hidden + c] = x[static_cast<std::size_t>(d.source[i]) * hidden + c];
  return rows;
}

std::vector<double> combine(std::span<const double> rows, int tokens, int hidden, int top_k,
                            const Dispatch& d, const Routing& routing) {
  std::vector<double> out(static_cast<std::size_t>(tokens) * hidden, 0.0);
  for (int t = 0; t < tokens; ++t)
    for (int j = 0; j < top_k; ++j) {
      const std::size_t a = static_cast<std::size_t>(t) * top_k + j;
      if (d.slot[a] < 0) continue;  // dropped: contributes nothing
      for (int c = 0; c < hidden; ++c)
        out[static_cast<std::size_t>(t) * hidden + c] += routing.weight[a] * rows[static_cast<std::size_t>(d.slot[a]) * hidden + c];
    }
  return out;
}

std::vector<double> swiglu(std::span<const double> x, int rows, int hidden, int ffn,
                           std::span<const float> w1, std::span<const float> w3,
                           std::span<const float> w2) {
  std::vector<double> y(static_cast<std::size_t>(rows) * hidden, 0.0), h(ffn);
  for (int r = 0; r < rows; ++r) {
    const double* xr = &x[static_cast<std::size_t>(r) * hidden];
    for (int f = 0; f < ffn; ++f) {
      double a = 0, b = 0;
      for (int c = 0; c < hidden; ++c) {
        a += xr[c] * w1[static_cast<std::size_t>(f) * hidden + c];
        b += xr[c] * w3[static_cast<std::size_t>(f) * hidden + c];
      }
      h[f] = a / (1.0 + std::exp(-a)) * b;  // silu(a) · b
    }
    for (int c = 0; c < hidden; ++c) {
      double acc = 0;
      for (int f = 0; f < ffn; ++f) acc += h[f] * w2[static_cast<std::size_t>(c) * ffn + f];
      y[static_cast<std::size_t>(r) * hidden + c] = acc;
    }
  }
  return y;
}

MoeForward moe_forward(std::span<const float> x, int tokens, const MoeLayer& m) {
  const int E = m.router.experts, H = m.hidden;
  require(x.size() == static_cast<std::size_t>(tokens) * H, "x must be tokens × hidden");
  const std::size_t expert_w = static_cast<std::size_t>(m.ffn) * H, shared_w = static_cast<std::size_t>(m.shared_ffn) * H;
  require(m.w_router.size() == static_cast<std::size_t>(E) * H && m.w1.size() == E * expert_w &&
              m.w3.size() == E * expert_w && m.w2.size() == E * expert_w &&
              m.shared_w1.size() == m.shared * shared_w && m.shared_w3.size() == m.shared * shared_w &&
              m.shared_w2.size() == m.shared * shared_w,
          "weights do not match the layer's sizes");
  // Router logits z = x W_routerᵀ, in double, stored as float like the kernels' fp32 logits.
  std::vector<float> logits(static_cast<std::size_t>(tokens) * E);
  for (int t = 0; t < tokens; ++t)
    for (int e = 0; e < E; ++e) {
      double acc = 0;
      for (int c = 0; c < H; ++c)
        acc += static_cast<double>(x[static_cast<std::size_t>(t) * H + c]) * m.w_router[static_cast<std::size_t>(e) * H + c];
      logits[static_cast<std::size_t>(t) * E + e] = static_cast<float>(acc);
    }
  MoeForward f;
  f.routing = route(logits, m.bias, tokens, m.router);
  f.dispatch = dispatch(f.routing, tokens, E, m.router.top_k, m.capacity);
  const std::vector<double> rows = permute(x, H, f.dispatch);
  std::vector<double> expert_out(rows.size());
  for (int e = 0; e < E; ++e) {
    const int n = f.dispatch.counts[e];
    if (n == 0) continue;
    const std::size_t at = static_cast<std::size_t>(f.dispatch.offsets[e]) * H;
    const std::vector<double> ye =
        swiglu(std::span(rows).subspan(at, static_cast<std::size_t>(n) * H), n, H, m.ffn,
               m.w1.subspan(e * expert_w, expert_w), m.w3.subspan(e * expert_w, expert_w),
               m.w2.subspan(e * expert_w, expert_w));
    std::copy(ye.begin(), ye.end(), expert_out.begin() + static_cast<std::ptrdiff_t>(at));
  }
  f.y = combine(expert_out, tokens, H, m.router.top_k, f.dispatch, f.routing);
  const std::vector<double> xd(x.begin(), x.end());
  for (int sidx = 0; sidx < m.shared; ++sidx) {
    const std::vector<double> ys =
        swiglu(xd, tokens, H, m.shared_ffn, m.shared_w1.subspan(sidx * shared_w, shared_w),
               m.shared_w3.subspan(sidx * shared_w, shared_w), m.shared_w2.subspan(sidx * shared_w, shared_w));
    for (std::size_t i = 0; i < ys.size(); ++i) f.y[i] += ys[i];
  }
  return f;
}

namespace {

// Where one FFN's weight gradients go: the sums, and the sums of their terms' magnitudes.
struct FfnGrads {
  double *dw1, *dw3, *dw2, *mag1, *mag3, *mag2;
};

// Backward of one SwiGLU row: x (hidden), upstream dy (hidden) scaled by `scale`; accumulates the
// weights' gradients (and their terms' magnitudes) and returns dx. a = W1 x, b = W3 x,
// h = silu(a) · b, y = W2 h.
std::vector<double> swiglu_row_backward(const double* x, const double* dy, double scale, int hidden,
                                        int ffn, std::span<const float> w1, std::span<const float> w3,
                                        std::span<const float> w2, const FfnGrads& g) {
  std::vector<double> dx(hidden, 0.0);
  for (int f = 0; f < ffn; ++f) {
    double a = 0, b = 0, dh = 0, dh_mag = 0;
    for (int c = 0; c < hidden; ++c) {
      a += x[c] * w1[static_cast<std::size_t>(f) * hidden + c];
      b += x[c] * w3[static_cast<std::size_t>(f) * hidden + c];
      dh += scale * dy[c] * w2[static_cast<std::size_t>(c) * ffn + f];
      dh_mag += std::abs(scale * dy[c] * w2[static_cast<std::size_t>(c) * ffn + f]);
    }
    const double sig = 1.0 / (1.0 + std::exp(-a)), silu = a * sig;
    for (int c = 0; c < hidden; ++c) {
      const double term = scale * dy[c] * silu * b;
      g.dw2[static_cast<std::size_t>(c) * ffn + f] += term;
      g.mag2[static_cast<std::size_t>(c) * ffn + f] += std::abs(term);
    }
    const double dsilu = sig * (1.0 + a * (1.0 - sig));  // silu'
    const double da = dh * b * dsilu, db = dh * silu;
    // da and db inherit dh's error, which scales with dh's own terms (dh_mag), not with dh.
    const double da_mag = dh_mag * std::abs(b * dsilu), db_mag = dh_mag * std::abs(silu);
    for (int c = 0; c < hidden; ++c) {
      const std::size_t i = static_cast<std::size_t>(f) * hidden + c;
      g.dw1[i] += da * x[c];
      g.dw3[i] += db * x[c];
      g.mag1[i] += da_mag * std::abs(x[c]);
      g.mag3[i] += db_mag * std::abs(x[c]);
      dx[c] += da * w1[static_cast<std::size_t>(f) * hidden + c] + db * w3[static_cast<std::size_t>(f) * hidden + c];
    }
  }
  return dx;
}

double dot(const double* a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

MoeBackward moe_backward(std::span<const float> x, int tokens, const MoeLayer& m, std::span<const float> dy) {
  const int E = m.router.experts, H = m.hidden, k = m.router.top_k;
  require(dy.size() == x.size(), "dy must be shaped like x");
  const MoeForward f = moe_forward(x, tokens, m);  // routing, dispatch (and argument checks)
  const std::size_t expert_w = static_cast<std::size_t>(m.ffn) * H, shared_w = static_cast<std::size_t>(m.shared_ffn) * H;
  MoeBackward g;
  g.dx.assign(x.size(), 0.0);
  g.dw_router.assign(m.w_router.size(), 0.0);
  g.dw1.assign(m.w1.size(), 0.0);
  g.dw3.assign(m.w3.size(), 0.0);
  g.dw2.assign(m.w2.size(), 0.0);
  g.dshared_w1.assign(m.shared_w1.size(), 0.0);
  g.dshared_w3.assign(m.shared_w3.size(), 0.0);
  g.dshared_w2.assign(m.shared_w2.size(), 0.0);
  g.dw1_mag = g.dw1, g.dw3_mag = g.dw3, g.dw2_mag = g.dw2;  // zeros of the same sizes
  g.dshared_w1_mag = g.dshared_w1, g.dshared_w3_mag = g.dshared_w3, g.dshared_w2_mag = g.dshared_w2;
  const bool normalize = m.router.normalize || m.router.score == RouterScore::sigmoid;
  for (int t = 0; t < tokens; ++t) {
    const std::vector<double> xt(x.begin() + static_cast<std::ptrdiff_t>(t) * H, x.begin() + static_cast<std::ptrdiff_t>(t + 1) * H);
    const std::vector<double> dyt(dy.begin() + static_cast<std::ptrdiff_t>(t) * H, dy.begin() + static_cast<std::ptrdiff_t>(t + 1) * H);
    auto add_dx = [&](const std::vector<double>& d) {
      for (int c = 0; c < H; ++c) g.dx[static_cast<std::size_t>(t) * H + c] += d[c];
    };
    // Shared experts: upstream dy as it is.
    for (int si = 0; si < m.shared; ++si)
      add_dx(swiglu_row_backward(xt.data(), dyt.data(), 1.0, H, m.shared_ffn, m.shared_w1.subspan(si * shared_w, shared_w),
                                 m.shared_w3.subspan(si * shared_w, shared_w), m.shared_w2.subspan(si * shared_w, shared_w),
                                 {&g.dshared_w1[si * shared_w], &g.dshared_w3[si * shared_w], &g.dshared_w2[si * shared_w],
                                  &g.dshared_w1_mag[si * shared_w], &g.dshared_w3_mag[si * shared_w],
                                  &g.dshared_w2_mag[si * shared_w]}));
    // Routed experts: upstream w_j · dy, and dw_j = dy · FFN_e(x) for every kept choice.
    const double* s = &f.routing.scores[static_cast<std::size_t>(t) * E];
    std::vector<double> dw(k, 0.0);
    for (int j = 0; j < k; ++j) {
      const std::size_t a = static_cast<std::size_t>(t) * k + j;
      if (f.dispatch.slot[a] < 0) continue;  // dropped: no output, no gradient
      const int e = f.routing.expert[a];
      const auto w1e = m.w1.subspan(e * expert_w, expert_w), w3e = m.w3.subspan(e * expert_w, expert_w),
                 w2e = m.w2.subspan(e * expert_w, expert_w);
      dw[j] = dot(dyt.data(), swiglu(xt, 1, H, m.ffn, w1e, w3e, w2e));
      add_dx(swiglu_row_backward(xt.data(), dyt.data(), f.routing.weight[a], H, m.ffn, w1e, w3e, w2e,
                                 {&g.dw1[e * expert_w], &g.dw3[e * expert_w], &g.dw2[e * expert_w],
                                  &g.dw1_mag[e * expert_w], &g.dw3_mag[e * expert_w], &g.dw2_mag[e * expert_w]}));
    }
    // Weights → scores: w_j = R · s_ej / S, with S the chosen scores' sum when normalising (else 1).
    std::vector<double> ds(E, 0.0);
    double S = 1;
    if (normalize) {
      S = 0;
      for (int j = 0; j < k; ++j) S += s[f.routing.expert[static_cast<std::size_t>(t) * k + j]];
    }
    double mix = 0;  // Σ_j dw_j · w_j / R, the part every chosen score shares when normalising
    for (int j = 0; j < k; ++j) mix += dw[j] * s[f.routing.expert[static_cast<std::size_t>(t) * k + j]] / S;
    for (int j = 0; j < k; ++j) {
      const int e = f.routing.expert[static_cast<std::size_t>(t) * k + j];
      ds[e] += m.router.route_scale / S * (dw[j] - (normalize ? mix : 0.0));
    }
    // Scores → logits → router weights and x.
    std::vector<double> dz(E);
    if (m.router.score == RouterScore::softmax) {
      double sds = 0;
      for (int e = 0; e < E; ++e) sds += s[e] * ds[e];
      for (int e = 0; e < E; ++e) dz[e] = s[e] * (ds[e] - sds);
    } else {
      for (int e = 0; e < E; ++e) dz[e] = ds[e] * s[e] * (1.0 - s[e]);
    }
    for (int e = 0; e < E; ++e)
      for (int c = 0; c < H; ++c) {
        g.dw_router[static_cast<std::size_t>(e) * H + c] += dz[e] * xt[c];
        g.dx[static_cast<std::size_t>(t) * H + c] += dz[e] * m.w_router[static_cast<std::size_t>(e) * H + c];
      }
  }
  return g;
}

}  // namespace k2c::ref
