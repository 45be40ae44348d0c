// autograder/17_expert_parallel/expert_parallel_bench.cpp — k2c_expert_parallel: the expert-
// parallel exchange against the library's all-to-all, as the batch grows and as the load skews.
//
//   mpirun -np N k2c_expert_parallel [-t 1024,4096,16384] [-d 4096] [-k 2] [-e 4] [-z 0] [-c 0]
//                                    [-n 10] [-w 3] [-o out.json]
//   (or: k2c run -np N build/solutions/bin/k2c_expert_parallel ...)
//
// For each token count t (per rank): a routing of t tokens to their top k of E = e·N experts,
// each token's experts drawn with probability proportional to 1/(expert + 1)^z (z = 0: uniform;
// z = 1: expert 0 about three times expert 3's load at E = 8), a capacity factor c (0: none),
// the module's plan, and in one run:
//   T_ep   dispatch + combine (expert_parallel.h) with identity experts
//   T_lib  the library's all_to_all_v moving the same rows out and back
// It prints the bytes that cross the busiest rank's links in both directions, both times, both
// bus bandwidths (those bytes ÷ time; lecture 11's factor (n−1)/n is already in them, since a
// rank's own rows never travel), their ratio (the module's speed test grades it at t 8192, d
// 4096, k 2, e 4), the busiest rank's received rows over the mean (the imbalance a skewed router
// costs: every rank waits for that one) and the share of assignments the capacity dropped.
// Times are the median of -n repeats after -w warm-ups, each the slowest rank's
// (k2c/dist/timing.h).
//
// On the NCCL backend the rows are device memory moved by the model library's GPU kernels; on MPI
// they are host memory and the defaults shrink to sizes a CPU finishes.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "expert_parallel.h"
#include "k2c/core/random.h"
#include "k2c/dist/bench.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"
#include "k2c/model/backend.h"

namespace kd = k2c::dist;
namespace km = k2c::model;
namespace xp = k2c::expert_parallel;

namespace {

struct Options {
  std::vector<std::int64_t> tokens;
  std::int64_t d = 0;
  int top_k = 2, experts_per_rank = 4;
  double skew = 0, capacity_factor = 0;
  int repeats = 10, warmup = 3;
  std::string json;
};

// k distinct experts per token, expert e drawn with weight 1/(e + 1)^skew, from this rank's seed.
std::vector<std::int32_t> draw_choices(std::int64_t tokens, int k, int experts, double skew, int rank) {
  std::vector<double> weight(experts);
  for (int e = 0; e < experts; ++e) weight[e] = 1.0 / std::pow(e + 1.0, skew);
  std::vector<std::int32_t> choice;
  choice.reserve(static_cast<std::size_t>(tokens) * k);
  const std::uint64_t seed = 0x6578706572747321ull + static_cast<std::uint64_t>(rank);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<bool> taken(experts, false);
    for (int j = 0; j < k; ++j) {
      double total = 0;
      for (int e = 0; e < experts; ++e) total += taken[e] ? 0.0 : weight[e];
      double u = k2c::uniform_at(seed, static_cast<std::uint64_t>(t * k + j), 0.0f, 1.0f) * total;
      int pick = -1;
      for (int e = 0; e < experts && pick < 0; ++e)
        if (!taken[e] && (u -= weight[e]) <= 0) pick = e;
      for (int e = experts - 1; pick < 0; --e)
        if (!taken[e]) pick = e;
      taken[pick] = true;
      choice.push_back(pick);
    }
  }
  return choice;
}

struct Row {
  std::int64_t tokens;
  long long link_bytes;      // the busiest rank's, both directions
  double ep_ms, lib_ms;
  double imbalance;          // max over ranks of received rows ÷ their mean
  double dropped;            // share of the group's assignments
  double ep_gbs() const { return link_bytes / (ep_ms * 1e6); }
  double lib_gbs() const { return link_bytes / (lib_ms * 1e6); }
};

Row measure(kd::Communicator& w, km::Ops& ops, std::int64_t tokens, const Options& o) {
  const int n = w.size(), E = o.experts_per_rank * n, k = o.top_k, L = o.experts_per_rank;
  const std::int64_t d = o.d;
  km::MemoryLedger ledger;
  km::ParamList params;
  km::Context ctx{ops, ledger, params};
  const std::vector<std::int32_t> choice = draw_choices(tokens, k, E, o.skew, w.rank());
  const km::Routing routing = km::Routing::plan(choice, static_cast<int>(tokens), k, E);
  const xp::Plan p = xp::plan_exchange(w, ctx, routing, std::vector<float>(choice.size(), 1.0f / k),
                                       xp::expert_capacity(o.capacity_factor, tokens, k, E));

  std::vector<float> host(static_cast<std::size_t>(tokens * d));
  k2c::fill_uniform(host, 7);
  km::Tensor x = ctx.tensor({tokens, d}), in = ctx.tensor({p.expert_rows(), d}), back = ctx.tensor({p.rows(), d}),
             y = ctx.tensor({tokens, d}), lib_in = ctx.tensor({p.expert_rows(), d});
  ops.upload(x, host.data());
  ops.fill(y, 0.0f);

  // The same rows through the library: rank q's experts are consecutive, so this rank's rows for
  // q are one block in plan order; arrivals are laid out by sender.
  const std::size_t dd = static_cast<std::size_t>(d);
  std::vector<std::size_t> sc(n, 0), so(n, 0), rc(n, 0), ro(n, 0);
  std::size_t at = 0;
  for (int q = 0; q < n; ++q) {
    so[q] = static_cast<std::size_t>(p.begin[q * L]) * dd;
    ro[q] = at;
    if (q == w.rank()) continue;
    sc[q] = static_cast<std::size_t>(p.begin[(q + 1) * L] - p.begin[q * L]) * dd;
    for (int l = 0; l < L; ++l) rc[q] += static_cast<std::size_t>(p.from[q * L + l]) * dd;
    at += rc[q];
  }

  const kd::TimeStepOptions opt{.warmup = o.warmup, .repeats = o.repeats};
  Row row{tokens, 0, 0, 0, 0, 0};
  row.ep_ms = kd::time_step(w, [&] {
    xp::dispatch(w, ctx, p, x, in);
    xp::combine(w, ctx, p, in, back, y);
  }, opt).median_ms;
  row.lib_ms = kd::time_step(w, [&] {
    w.all_to_all_v(back.raw(), sc, so, lib_in.raw(), rc, ro, kd::DType::f32);
    w.all_to_all_v(lib_in.raw(), rc, ro, back.raw(), sc, so, kd::DType::f32);
  }, opt).median_ms;

  // The group's figures, the same on every rank (host numbers: MPI directly).
  long long link = 4LL * d * (p.rows_out() + p.rows_in()), received = p.expert_rows(), most = 0, all = 0;
  long long dropped[2] = {p.dropped, static_cast<long long>(tokens) * k}, dropped_all[2] = {0, 0};
  MPI_Allreduce(&link, &row.link_bytes, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&received, &most, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&received, &all, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(dropped, dropped_all, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  row.imbalance = all > 0 ? static_cast<double>(most) * n / static_cast<double>(all) : 1.0;
  row.dropped = static_cast<double>(dropped_all[0]) / static_cast<double>(dropped_all[1]);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string tokens;
  const kd::FlagSetters flags{
      {"-t", [&](const std::string& v) { tokens = v; }},
      {"-d", [&](const std::string& v) { o.d = std::stoll(v); }},
      {"-k", [&](const std::string& v) { o.top_k = std::stoi(v); }},
      {"-e", [&](const std::string& v) { o.experts_per_rank = std::stoi(v); }},
      {"-z", [&](const std::string& v) { o.skew = std::stod(v); }},
      {"-c", [&](const std::string& v) { o.capacity_factor = std::stod(v); }},
      {"-n", [&](const std::string& v) { o.repeats = std::stoi(v); }},
      {"-w", [&](const std::string& v) { o.warmup = std::stoi(v); }},
      {"-o", [&](const std::string& v) { o.json = v; }}};
  if (!kd::parse_flags(argc, argv, flags,
                       "[-t t1,t2,...] [-d hidden] [-k top_k] [-e experts per rank] [-z skew] [-c capacity factor] "
                       "[-n repeats] [-w warmups] [-o out.json]"))
    return 2;
  return kd::run(argc, argv, [&](kd::Communicator& w) {
    const bool gpu = w.backend() == kd::Backend::nccl;
    km::Ops* ops = &km::backend_for(gpu, w.compute_stream(), km::GpuMath::bf16);
    if (tokens.empty()) tokens = gpu ? "1024,4096,16384" : "256,1024,4096";
    if (o.d == 0) o.d = gpu ? 4096 : 256;
    if (o.top_k < 1 || o.top_k > o.experts_per_rank * w.size())
      throw std::invalid_argument("top " + std::to_string(o.top_k) + " of " +
                                  std::to_string(o.experts_per_rank * w.size()) + " experts");
    o.tokens = kd::parse_counts(tokens);
    const int n = w.size();
    if (w.rank() == 0)
      std::printf("# k2c_expert_parallel: dispatch + combine, d %lld, top %d of %d experts (%d per rank), skew %.2f, "
                  "capacity factor %.2f, %d rank(s), %s backend, %s\n"
                  "# %7s %11s %9s %9s %10s %10s %6s %9s %8s\n",
                  static_cast<long long>(o.d), o.top_k, o.experts_per_rank * n, o.experts_per_rank, o.skew,
                  o.capacity_factor, n, kd::to_string(w.backend()).c_str(), ops->name().c_str(), "tokens",
                  "link MiB", "T_ep ms", "T_lib ms", "ep GB/s", "lib GB/s", "ratio", "max/mean", "dropped");
    std::vector<Row> rows;
    for (std::int64_t t : o.tokens) {
      rows.push_back(measure(w, *ops, t, o));
      const Row& r = rows.back();
      if (w.rank() == 0)
        std::printf("  %7lld %11.2f %9.3f %9.3f %10.2f %10.2f %6.3f %9.3f %7.2f%%\n", static_cast<long long>(r.tokens),
                    r.link_bytes / 1048576.0, r.ep_ms, r.lib_ms, r.ep_gbs(), r.lib_gbs(), r.lib_ms / r.ep_ms,
                    r.imbalance, 100 * r.dropped);
    }
    if (w.rank() == 0 && !o.json.empty()) {
      std::vector<kd::JsonFields> out(rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        out[i].add("tokens", r.tokens).add("link_bytes", r.link_bytes).add("ep_ms", r.ep_ms).add("lib_ms", r.lib_ms)
            .add("ep_gbs", r.ep_gbs()).add("lib_gbs", r.lib_gbs()).add("ratio", r.lib_ms / r.ep_ms)
            .add("imbalance", r.imbalance).add("dropped", r.dropped);
      }
      kd::write_sweep_json(o.json,
                           kd::run_fields(w, ops->name()).add("d", o.d).add("top_k", o.top_k)
                               .add("experts", o.experts_per_rank * n).add("skew", o.skew)
                               .add("capacity_factor", o.capacity_factor),
                           out);
    }
  });
}
