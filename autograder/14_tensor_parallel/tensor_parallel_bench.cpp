// autograder/14_tensor_parallel/tensor_parallel_bench.cpp — k2c_tensor_parallel: how the scaling of
// a tensor-parallel MLP grows with the model's width.
//
//   mpirun -np N k2c_tensor_parallel [-d 1024,2048,4096,8192] [-t 8192] [-f 3.5] [-n 10] [-w 3] [-o out.json]
//   (or: k2c run -np N build/solutions/bin/k2c_tensor_parallel ...)
//
// For each width d: a SwiGLU MLP with d_ff = f·d (rounded to a multiple of 64·N), forward and
// backward over t tokens, timed three ways in one run:
//   T1   the model library's unsharded MLP, each rank alone on its own device (no communication)
//   TN   the module's ParallelMlp over all N ranks (tensor_parallel.h)
//   Tar  one all-reduce of the t·d fp32 activations alone, as the MLP runs two per step
// and prints T1, TN, the scaling T1 / (N·TN) (1 is perfect), Tar, and the compute-to-communication
// ratio (T1/N) / (2·Tar): the time each rank computes against the time its two all-reduces take
// when nothing hides them. Lecture 14, section 4, predicts that ratio to grow linearly with d:
// compute per rank is 18·t·d·d_ff/N FLOPs, traffic 2·t·d·4 bytes. Times are the median of -n
// repeats after -w warm-ups, each the slowest rank's (k2c/dist/timing.h).
//
// On the NCCL backend the layers run on the model library's GPU backend (bf16 GEMMs, fp32
// accumulation); on MPI on its CPU backend, where the defaults shrink to widths a CPU finishes.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "k2c/core/random.h"
#include "k2c/dist/bench.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"
#include "k2c/model/backend.h"
#include "k2c/model/layers.h"
#include "tensor_parallel.h"
#include "uniform_weights.h"

namespace kd = k2c::dist;
namespace km = k2c::model;

namespace {

struct Options {
  std::vector<std::int64_t> widths;
  std::int64_t tokens = 0;
  double ff = 3.5;
  int repeats = 10, warmup = 3;
  std::string json;
};

struct Row {
  std::int64_t d, d_ff;
  double t1_ms, tn_ms, allreduce_ms;
  double scaling() const { return t1_ms / (tn_ms * ranks); }
  double compute_to_comm() const { return (t1_ms / ranks) / (2 * allreduce_ms); }
  int ranks;
};

// One width: both MLPs built and timed, then freed before the next.
Row measure(kd::Communicator& w, km::Ops& ops, std::int64_t d, std::int64_t d_ff, const Options& o) {
  const std::int64_t N = o.tokens;
  km::MemoryLedger ledger;
  km::ParamList whole_params, par_params;
  km::Context one{ops, ledger, whole_params}, par{ops, ledger, par_params};
  km::Mlp whole(whole_params, "mlp", d, d_ff);
  k2c::tensor_parallel::ParallelMlp mine(w, par_params, "mlp", d, d_ff);
  whole_params.materialize(ops, ledger, 1, {.values = false, .grads = true});
  par_params.materialize(ops, ledger, 1, {.values = false, .grads = true});
  const std::vector<km::Tensor> w1 = k2c::tp_harness::bind_uniform_weights(whole_params, ops, ledger),
                                wn = k2c::tp_harness::bind_uniform_weights(par_params, ops, ledger);

  std::vector<float> host(static_cast<std::size_t>(N * d));
  k2c::fill_uniform(host, 3);
  km::Tensor x = one.tensor({N, d}), dy = one.tensor({N, d}), y = one.tensor({N, d}), dx = one.tensor({N, d});
  ops.upload(x, host.data());
  k2c::fill_uniform(host, 4);
  ops.upload(dy, host.data());

  const kd::TimeStepOptions opt{.warmup = o.warmup, .repeats = o.repeats};
  Row row{d, d_ff, 0, 0, 0, w.size()};
  row.t1_ms = kd::time_step(w, [&] {
    km::Mlp::Saved s;
    whole_params.begin_backward();
    whole.forward(one, x, y, s);
    whole.backward(one, x, s, dy, dx);
    whole_params.end_backward();
  }, opt).median_ms;
  row.tn_ms = kd::time_step(w, [&] {
    k2c::tensor_parallel::ParallelMlp::Saved s;
    par_params.begin_backward();
    mine.forward(par, x, y, s);
    mine.backward(par, x, s, dy, dx);
    par_params.end_backward();
  }, opt).median_ms;
  row.allreduce_ms = kd::time_step(w, [&] {
    w.all_reduce(y.raw(), y.raw(), static_cast<std::size_t>(N * d), kd::DType::f32, kd::ReduceOp::sum);
  }, opt).median_ms;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string widths;
  const kd::FlagSetters flags{
      {"-d", [&](const std::string& v) { widths = v; }},
      {"-t", [&](const std::string& v) { o.tokens = std::stoll(v); }},
      {"-f", [&](const std::string& v) { o.ff = std::stod(v); }},
      {"-n", [&](const std::string& v) { o.repeats = std::stoi(v); }},
      {"-w", [&](const std::string& v) { o.warmup = std::stoi(v); }},
      {"-o", [&](const std::string& v) { o.json = v; }}};
  if (!kd::parse_flags(argc, argv, flags, "[-d w1,w2,...] [-t tokens] [-f d_ff/d] [-n repeats] [-w warmups] [-o out.json]"))
    return 2;
  return kd::run(argc, argv, [&](kd::Communicator& w) {
    const bool gpu = w.backend() == kd::Backend::nccl;
    km::Ops* ops = &km::backend_for(gpu, w.compute_stream(), km::GpuMath::bf16);
    if (widths.empty()) widths = gpu ? "1024,2048,4096,8192" : "32,64,128,256";
    if (o.tokens == 0) o.tokens = gpu ? 8192 : 64;
    o.widths = kd::parse_counts(widths);
    const int n = w.size();
    if (w.rank() == 0)
      std::printf("# k2c_tensor_parallel: SwiGLU MLP forward + backward, %lld tokens, %d rank(s), %s backend, %s\n"
                  "# %6s %7s %10s %10s %8s %13s %13s\n",
                  static_cast<long long>(o.tokens), n, kd::to_string(w.backend()).c_str(), ops->name().c_str(), "d",
                  "d_ff", "T1 ms", "TN ms", "scaling", "allreduce ms", "compute/comm");
    std::vector<Row> rows;
    for (std::int64_t d : o.widths) {
      const std::int64_t unit = 64 * n;
      const std::int64_t d_ff = std::max<std::int64_t>(unit, (static_cast<std::int64_t>(o.ff * d) + unit / 2) / unit * unit);
      rows.push_back(measure(w, *ops, d, d_ff, o));
      const Row& r = rows.back();
      if (w.rank() == 0)
        std::printf("  %6lld %7lld %10.3f %10.3f %8.3f %13.3f %13.2f\n", static_cast<long long>(r.d),
                    static_cast<long long>(r.d_ff), r.t1_ms, r.tn_ms, r.scaling(), r.allreduce_ms, r.compute_to_comm());
    }
    if (w.rank() == 0 && !o.json.empty()) {
      std::vector<kd::JsonFields> out(rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        out[i].add("d", r.d).add("d_ff", r.d_ff).add("t1_ms", r.t1_ms).add("tn_ms", r.tn_ms).add("scaling", r.scaling())
            .add("allreduce_ms", r.allreduce_ms).add("compute_to_comm", r.compute_to_comm());
      }
      kd::write_sweep_json(o.json, kd::run_fields(w, ops->name()).add("tokens", o.tokens), out);
    }
  });
}
