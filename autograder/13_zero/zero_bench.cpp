// autograder/13_zero/zero_bench.cpp — k2c_zero: the step time and the memory of data parallelism
// and of ZeRO's stages, side by side.
//
//   k2c run -np N build/<tree>/bin/k2c_zero [--model tiny|deep|gpu] [-w 2] [-n 5] [-o out.json]
//
// Each configuration — DDP (one all-reduce per unit, started as soon as the unit's backward is
// done), ZeRO stages 1, 2 and 3, and stage 3 without prefetch — trains the same model on the
// same rows on this run's backend (the CPU backend on MPI; on NCCL the model library's GPU
// backend, where the build has it). One line per configuration:
//   step(ms)   median over -n timed steps after -w untimed ones, each the slowest rank's time
//   params, grads, optim, comm   peak bytes per rank of each category of the training state over
//              one step (the engine's ledger: activations are kept apart), MiB
//   ideal      the bytes per rank the stage cannot do without: 16Ψ, 8Ψ + 8E, 4Ψ + 12E, 16E
//              (Ψ parameters, E this rank's shard), MiB
//   eff        ideal ÷ the peak of all categories together
//   sent/rank  bytes one step's collectives send from each rank: the counted size (what
//              k2c/dist/counting.h counts) × (n − 1)/n, MiB
// Rank 0's figures are printed; shards differ by at most one block per unit between ranks.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "k2c/dist/bench.h"
#include "k2c/dist/counting.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"
#include "k2c/model/backend.h"
#include "zero_reference.h"

namespace kd = k2c::dist;
namespace km = k2c::model;
using namespace k2c::zero::reference;

namespace {

struct Row {
  std::string name;
  double step_ms = 0;
  std::size_t params = 0, grads = 0, optimizer = 0, comm = 0, peak = 0, ideal = 0;
  double sent = 0;
};

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Bytes one step sent from this rank through `c`: each collective's counted size times its bus
// factor (lecture 11, section 3.3): 2(n − 1)/n for an all-reduce, (n − 1)/n for a reduce-scatter
// or an all-gather (the only collectives these steps use).
double sent_per_rank(const kd::CountingCommunicator& c) {
  const double n = c.size();
  double sent = 0;
  for (const auto& [label, ops] : c.counts())
    for (const auto& [op, t] : ops) sent += static_cast<double>(t.bytes) * (op == "all_reduce" ? 2 : 1) * (n - 1) / n;
  return sent;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name = "deep", out_json;
  int warmup = 2, repeats = 5;
  const kd::FlagSetters flags{{"--model", [&](const std::string& v) { model_name = v; }},
                              {"-w", [&](const std::string& v) { warmup = std::stoi(v); }},
                              {"-n", [&](const std::string& v) { repeats = std::stoi(v); }},
                              {"-o", [&](const std::string& v) { out_json = v; }}};
  if (!kd::parse_flags(argc, argv, flags, "[--model tiny|deep|gpu] [-w 2] [-n 5] [-o out.json]")) return 2;
  return kd::run(argc, argv, [&](kd::Communicator& w) {
    const km::ModelConfig c = model_name == "tiny" ? tiny_model() : model_name == "gpu" ? gpu_model() : deep_model();
    if (model_name != "tiny" && model_name != "deep" && model_name != "gpu")
      throw std::invalid_argument("--model " + model_name + ": tiny, deep or gpu");
    km::Ops* ops = &km::backend_for(w.backend() == kd::Backend::nccl, w.compute_stream());
    const int n = w.size(), r = w.rank();
    // Four sequences per rank: the tiny and deep models' step stays well under a second on a CPU.
    const int rows = model_name == "gpu" ? 8 : 4, global = rows * n;
    const std::vector<std::uint16_t> tokens = km::MarkovSource(13, std::min(c.vocab, 256), 4).sample(200000);
    const km::TokenLoader loader(tokens, static_cast<std::uint32_t>(c.vocab), {c.seq_len, global, r, n, 29});
    km::MemoryLedger data;
    const Batch batch = make_batch(*ops, data, loader.batch_at(0), global);
    const Units units = units_of(c, n, r);
    const kd::TimeStepOptions timing{.warmup = warmup, .repeats = repeats};
    if (r == 0)
      std::printf("# k2c_zero: %s on %d ranks, backend %s (%s); %d rows per rank; %d steps timed after %d\n"
                  "# Ψ = %lld parameters in %zu units; this rank's shard E = %lld\n"
                  "# %-16s %10s %9s %9s %9s %9s %9s %6s %10s\n",
                  c.describe().c_str(), n, kd::to_string(w.backend()).c_str(), ops->name().c_str(), rows, repeats,
                  warmup, static_cast<long long>(units.params()), units.size.size(),
                  static_cast<long long>(units.shard()), "config", "step(ms)", "params", "grads", "optim", "comm",
                  "ideal", "eff", "sent/rank");

    std::vector<Row> table;
    auto record = [&](Row row, km::MemoryLedger& ledger) {
      row.params = ledger.peak(km::Category::params);
      row.grads = ledger.peak(km::Category::grads);
      row.optimizer = ledger.peak(km::Category::optimizer);
      row.comm = ledger.peak(km::Category::comm);
      row.peak = ledger.peak_total();
      if (r == 0)
        std::printf("  %-16s %10.2f %9.3f %9.3f %9.3f %9.3f %9.3f %6.3f %10.3f\n", row.name.c_str(), row.step_ms,
                    mib(row.params), mib(row.grads), mib(row.optimizer), mib(row.comm), mib(row.ideal),
                    static_cast<double>(row.ideal) / static_cast<double>(row.peak), row.sent / (1 << 20));
      table.push_back(row);
    };

    {
      kd::CountingCommunicator counting(w, "dp");
      Ddp ddp(counting, c, *ops, 5);
      Row row{"ddp"};
      row.step_ms = kd::time_step(w, [&] { ddp.step(batch, 1e-4f); }, timing).median_ms;
      counting.reset();
      ddp.ledger().reset_peaks();
      ddp.step(batch, 1e-4f);
      row.sent = sent_per_rank(counting);
      row.ideal = static_cast<std::size_t>(16 * units.params());
      record(row, ddp.ledger());
    }
    const struct {
      const char* name;
      k2c::zero::ZeroConfig config;
    } stages[] = {{"zero1", {.stage = 1}}, {"zero2", {.stage = 2}}, {"zero3", {.stage = 3}},
                  {"zero3-noprefetch", {.stage = 3, .prefetch = false}}};
    for (const auto& s : stages) {
      kd::CountingCommunicator counting(w, "dp");
      ZeroRank z(counting, c, *ops, 5, s.config);
      Row row{s.name};
      row.step_ms = kd::time_step(w, [&] { z.step(batch, 1e-4f); }, timing).median_ms;
      counting.reset();
      z.ledger.reset_peaks();
      z.step(batch, 1e-4f);
      row.sent = sent_per_rank(counting);
      row.ideal = static_cast<std::size_t>(units.ideal_bytes(s.config.stage));
      record(row, z.ledger);
    }

    if (r == 0 && !out_json.empty()) {
      std::ofstream f(out_json);
      f << "{\n  \"model\": \"" << c.describe() << "\",\n  \"ranks\": " << n << ",\n  \"backend\": \""
        << kd::to_string(w.backend()) << "\",\n  \"rows\": [\n";
      for (std::size_t i = 0; i < table.size(); ++i) {
        const Row& t = table[i];
        f << "    {\"config\": \"" << t.name << "\", \"step_ms\": " << t.step_ms << ", \"params\": " << t.params
          << ", \"grads\": " << t.grads << ", \"optimizer\": " << t.optimizer << ", \"comm\": " << t.comm
          << ", \"peak\": " << t.peak << ", \"ideal\": " << t.ideal << ", \"sent_per_rank\": " << t.sent << "}"
          << (i + 1 < table.size() ? "," : "") << "\n";
      }
      f << "  ]\n}\n";
    }
  });
}
