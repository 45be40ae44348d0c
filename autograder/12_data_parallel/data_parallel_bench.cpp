// autograder/12_data_parallel/data_parallel_bench.cpp — k2c_data_parallel: the step time of
// data-parallel training against the bucket size, next to the same step without communication.
//
//   k2c run -np N build/solutions/bin/k2c_data_parallel [--model tiny|perf|135m] [--rows R]
//       [-b 1M,10M,100M,1000M] [-n 10] [-w 3] [--csv out.csv] [-o out.json]
//   k2c run -np N build/solutions/bin/k2c_data_parallel --model perf --ledger [--no-step]
//
// Each rank trains a replica of the model on its R sequences per step with AdamW (by default 4 for
// the perf model, as in the performance test, and 1 for the others) and
// times whole steps (zero gradients, forward, backward, synchronisation, optimizer) with
// time_step: the median over -n repeats after -w warm-ups of the slowest rank's time. Rows:
//   no_sync    the same step with no communication at all: the ceiling
//   naive      all_reduce_gradients after backward, one all-reduce per parameter
//   bucketed   DataParallel with each bucket size of -b (K/M/G suffixes, binary), overlapped
// and for each the number of buckets (all-reduces per step), tokens per second per rank, and the
// ratio to no_sync, which is what the module's performance test grades (lecture section 9).
// Models: `tiny` is the CPU tests' model (about 90 k parameters, the default on the MPI backend,
// where the bucket sizes default to 4K,16K,64K,256K,1M so that they split it), `perf` the GPU
// performance test's (136 M parameters, the default on NCCL), `135m` ModelConfig::dense_135m.
//
// --ledger prints the memory ledger of rank 0 instead of timing: parameters, gradients and AdamW
// state after set-up, then the peak of each category over one DDP step (--no-step leaves that out,
// for models too large to step on a CPU), with the figures the lecture derives from them: 6N
// FLOPs per token, the bytes each rank's all-reduce moves, and their ratio.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data_parallel.h"
#include "k2c/dist/bench.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"
#include "k2c/model/backend.h"
#include "k2c/model/optim.h"
#include "replica.h"

namespace dp = k2c::data_parallel;
namespace kd = k2c::dist;
namespace km = k2c::model;
using k2c::ddp_harness::Replica;

namespace {

km::ModelConfig model_named(const std::string& name) {
  if (name == "tiny") return k2c::ddp_harness::test_model();
  if (name == "perf") return k2c::ddp_harness::perf_model();
  if (name == "135m") return km::ModelConfig::dense_135m();
  throw std::invalid_argument("--model must be tiny, perf or 135m, got '" + name + "'");
}

struct Row {
  std::string variant;
  std::size_t bucket_bytes = 0;
  std::size_t buckets = 0;
  double ms = 0, tokens_per_s = 0, ratio = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string model_name, sizes_arg, csv, json;
  int rows_per_rank = 0, repeats = 10, warmup = 3;  // rows 0: the model's default
  bool ledger = false, step_for_ledger = true;
  const kd::FlagSetters flags{{"--model", [&](const std::string& v) { model_name = v; }},
                              {"--rows", [&](const std::string& v) { rows_per_rank = std::stoi(v); }},
                              {"-b", [&](const std::string& v) { sizes_arg = v; }},
                              {"-n", [&](const std::string& v) { repeats = std::stoi(v); }},
                              {"-w", [&](const std::string& v) { warmup = std::stoi(v); }},
                              {"--csv", [&](const std::string& v) { csv = v; }},
                              {"-o", [&](const std::string& v) { json = v; }}};
  const kd::FlagSwitches switches{{"--ledger", [&] { ledger = true; }}, {"--no-step", [&] { step_for_ledger = false; }}};
  if (!kd::parse_flags(argc, argv, flags,
                       "[--model tiny|perf|135m] [--rows R] [-b 1M,10M,100M,1000M] [-n 10] [-w 3] [--csv out.csv] "
                       "[-o out.json] [--ledger [--no-step]]",
                       switches))
    return 2;
  return kd::run(argc, argv, [&](kd::Communicator& w) {
    const bool gpu = w.backend() == kd::Backend::nccl;
    const int n = w.size(), rank = w.rank();
    const std::string name = model_name.empty() ? (gpu ? "perf" : "tiny") : model_name;
    const km::ModelConfig config = model_named(name);
    if (rows_per_rank < 1) rows_per_rank = name == "perf" ? k2c::ddp_harness::perf_rows() : 1;
    const std::vector<std::size_t> sizes =
        kd::parse_sizes(sizes_arg.empty() ? (gpu ? "1M,10M,100M,1000M" : "4K,16K,64K,256K,1M") : sizes_arg);

    // The model's operations: the CPU backend on MPI; on NCCL the GPU backend, issuing its work
    // to the communicator's compute stream so that a started all-reduce is ordered after the
    // gradients it reads.
    km::Ops* ops = &km::backend_for(gpu, w.compute_stream());

    const std::uint64_t seed = 7;
    const int rows = rows_per_rank * n;
    const std::vector<std::uint16_t> data = km::MarkovSource(seed, config.vocab, 8).sample(1 << 20);
    const km::TokenBatch mine = k2c::ddp_harness::slice_of(data, config, rows, rank, n, 0, 1, 0, seed);
    const float scale = 1.0f / static_cast<float>(rows_per_rank * config.seq_len);
    const double tokens = static_cast<double>(rows_per_rank) * config.seq_len;  // per rank per step

    Replica ddp_replica(*ops, config, seed + static_cast<std::uint64_t>(rank));
    dp::broadcast_parameters(w, ddp_replica.params);
    km::AdamW ddp_opt(ddp_replica.params, *ops, ddp_replica.ledger);

    if (ledger) {
      const km::MemoryLedger& l = ddp_replica.ledger;
      const double N = static_cast<double>(ddp_replica.params.numel());
      const double grad_bytes = 4.0 * static_cast<double>(ddp_replica.params.trainable_numel());
      if (rank == 0) {
        std::printf("# %s\n# %d rank(s), backend %s, %d sequence(s) of %d tokens per rank per step\n",
                    config.describe().c_str(), n, kd::to_string(w.backend()).c_str(), rows_per_rank, config.seq_len);
        std::printf("parameters                 %.0f (N)\n", N);
        std::printf("after set-up, per rank:\n%s", l.report().c_str());
        std::printf("bytes per parameter        %.1f (params + grads + AdamW m and v)\n",
                    static_cast<double>(l.current_total()) / N);
        std::printf("training FLOPs per token   %.4g (6N = %.4g, plus attention)\n", config.train_flops_per_token(),
                    6 * N);
        std::printf("FLOPs per rank per step    %.4g\n", config.train_flops_per_token() * tokens);
        std::printf("all-reduce S per step      %.0f bytes (fp32 gradients)\n", grad_bytes);
        std::printf("ring bytes sent per rank   %.0f (2(n-1)/n S)\n", 2.0 * (n - 1) / n * grad_bytes);
        if (n > 1)
          std::printf("FLOPs per byte sent        %.4g\n",
                      config.train_flops_per_token() * tokens / (2.0 * (n - 1) / n * grad_bytes));
      }
      if (step_for_ledger) {
        dp::DataParallel ddp(w, ddp_replica.params, std::size_t{25} << 20);
        ddp_replica.ledger.reset_peaks();
        ddp_replica.params.zero_grads(*ops);
        ddp.before_backward(true);
        ddp_replica.backward(mine, scale);
        ddp.finish_gradients();
        ddp_opt.step(1e-3f);
        w.synchronize();
        if (rank == 0) std::printf("peaks over one DDP step, per rank:\n%s", l.report().c_str());
      }
      return;
    }

    Replica solo(*ops, config, seed + static_cast<std::uint64_t>(rank));
    km::AdamW solo_opt(solo.params, *ops, solo.ledger);
    const kd::TimeStepOptions timing{.warmup = warmup, .repeats = repeats};
    std::vector<Row> table;
    auto record = [&](Row row) {
      row.tokens_per_s = tokens / (row.ms * 1e-3);
      row.ratio = table.empty() ? 1.0 : table.front().ms / row.ms;  // no_sync is measured first
      table.push_back(row);
      if (rank == 0)
        std::printf("  %-9s %14zu %8zu %12.3f %14.0f %8.3f\n", row.variant.c_str(), row.bucket_bytes, row.buckets,
                    row.ms, row.tokens_per_s, row.ratio);
    };
    if (rank == 0)
      std::printf("# k2c_data_parallel: %s\n# %d rank(s), backend %s, %d sequence(s) per rank per step, AdamW, "
                  "median of %d after %d warm-ups\n# %-9s %14s %8s %12s %14s %8s\n",
                  config.describe().c_str(), n, kd::to_string(w.backend()).c_str(), rows_per_rank, repeats, warmup,
                  "variant", "bucket_bytes", "buckets", "step_ms", "tokens/s/rank", "ratio");

    record({"no_sync", 0, 0, kd::time_step(w, [&] {
              solo.params.zero_grads(*ops);
              solo.backward(mine, scale);
              solo_opt.step(1e-4f);
            }, timing).median_ms});
    record({"naive", 0, ddp_replica.params.trainable().size(), kd::time_step(w, [&] {
              ddp_replica.params.zero_grads(*ops);
              ddp_replica.backward(mine, scale);
              dp::all_reduce_gradients(w, ddp_replica.params);
              ddp_opt.step(1e-4f);
            }, timing).median_ms});
    for (std::size_t bytes : sizes) {
      dp::DataParallel ddp(w, ddp_replica.params, bytes);
      const double ms = kd::time_step(w, [&] {
                          ddp_replica.params.zero_grads(*ops);
                          ddp.before_backward(true);
                          ddp_replica.backward(mine, scale);
                          ddp.finish_gradients();
                          ddp_opt.step(1e-4f);
                        }, timing).median_ms;
      record({"bucketed", bytes, ddp.buckets().size(), ms});
    }

    if (rank != 0) return;
    if (!csv.empty()) {
      std::ofstream f(csv);
      f << "backend,ranks,model,parameters,rows_per_rank,variant,bucket_bytes,buckets,step_ms,tokens_per_s,ratio\n";
      for (const Row& r : table)
        f << kd::to_string(w.backend()) << ',' << n << ",\"" << config.describe() << "\"," << ddp_replica.params.numel()
          << ',' << rows_per_rank << ',' << r.variant << ',' << r.bucket_bytes << ',' << r.buckets << ',' << r.ms << ','
          << r.tokens_per_s << ',' << r.ratio << '\n';
      std::printf("# wrote %s\n", csv.c_str());
    }
    if (!json.empty()) {
      std::ofstream f(json);
      f << "{\"ranks\": " << n << ", \"backend\": \"" << kd::to_string(w.backend()) << "\", \"model\": \""
        << config.describe() << "\", \"parameters\": " << ddp_replica.params.numel() << ", \"rows_per_rank\": "
        << rows_per_rank << ", \"results\": [";
      for (std::size_t i = 0; i < table.size(); ++i)
        f << (i ? ",\n  " : "\n  ") << "{\"variant\": \"" << table[i].variant << "\", \"bucket_bytes\": "
          << table[i].bucket_bytes << ", \"buckets\": " << table[i].buckets << ", \"step_ms\": " << table[i].ms
          << ", \"tokens_per_s\": " << table[i].tokens_per_s << ", \"ratio\": " << table[i].ratio << "}";
      f << "\n]}\n";
      std::printf("# wrote %s\n", json.c_str());
    }
  });
}
