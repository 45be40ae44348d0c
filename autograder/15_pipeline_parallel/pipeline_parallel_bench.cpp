// autograder/15_pipeline_parallel/pipeline_parallel_bench.cpp — k2c_pipeline_parallel: the
// schedules side by side, their timeline, their memory, and what recomputation costs.
//
//   k2c run -np P build/<tree>/bin/k2c_pipeline_parallel [--model cpu|gpu] [-m M] [--rows R]
//                                                         [-w 2] [-n 5] [-o DIR] [--no-plot]
//
// P ranks are P stages of one pipeline. For each schedule (GPipe, 1F1B), without and with
// recomputation, on this run's backend (the CPU backend on MPI; on NCCL the model library's GPU
// backend, where the build has it), one line:
//   step        median over -n timed steps after -w untimed ones, each the slowest stage's time
//   one         one micro-batch's forward + backward on a stage alone, the slowest stage's
//   ideal       (M + P − 1) × one: every stage busy except the fill and drain of the pipeline
//   ideal/step  the module's performance figure (the graded test uses 1F1B without recompute)
//   idle        from the trace: 1 − (time inside passes, all stages) ÷ (P × the step's span),
//               next to the bubble (P − 1)/(M + P − 1) that equal stages would leave
//   act MiB     each stage's activation peak over one step (the ledger's activations)
// and one more step traced: every stage's passes, with the times of the device (the trace
// synchronises before each clock reading on NCCL), written to DIR/pipeline_trace.json, which
// tools/plot_pipeline.py draws as DIR/pipeline_timeline.svg (one row per stage, forward and
// backward boxes, the gaps between them the bubble). The benchmark runs the tool itself unless
// --no-plot (`tools/plot_pipeline.py TRACE --png FILE` also draws a PNG, where matplotlib is
// installed).
//
// Recomputation should cost about one more forward per micro-batch, a third of a forward and
// backward (backward is about twice a forward), and shrink each stage's peak to its inputs
// plus one micro-batch's working set.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "k2c/dist/bench.h"
#include "k2c/dist/runtime.h"
#include "k2c/dist/timing.h"
#include "k2c/model/backend.h"
#include "pipeline_harness.h"
#include "pipeline_parallel.h"

namespace kd = k2c::dist;
namespace km = k2c::model;
namespace pp = k2c::pipeline_parallel;
namespace ps = k2c::pipeline_stage;
namespace harness = k2c::pipeline_harness;

namespace {

// The tests' model with 8 blocks: a pass stands out on the timeline from the messages around it,
// and a whole run stays within a minute on a laptop.
km::ModelConfig cpu_model() {
  km::ModelConfig c = harness::test_model();
  c.n_layers = 8;
  return c;
}

struct Run {
  std::string schedule;
  bool recompute = false;
  double step_ms = 0, one_ms = 0, ideal_ms = 0, idle = 0;
  std::vector<double> peak_mib;  // per stage
  std::vector<double> events;    // per event: stage, pass (0 F, 1 B), micro-batch, start, end
};

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Every rank's values of one double, on rank 0 (elsewhere empty).
std::vector<double> gather(double v, int ranks, int rank) {
  std::vector<double> all(rank == 0 ? static_cast<std::size_t>(ranks) : 0);
  MPI_Gather(&v, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return all;
}

// Every rank's events on rank 0, as rows of 5 doubles.
std::vector<double> gather_events(const pp::Trace& t, int stage, int ranks) {
  std::vector<double> mine;
  for (const pp::Event& e : t.events)
    mine.insert(mine.end(), {static_cast<double>(stage), e.pass == ps::Pass::forward ? 0.0 : 1.0,
                             static_cast<double>(e.micro_batch), e.start_ms, e.end_ms});
  int n = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<std::size_t>(ranks)), offsets(static_cast<std::size_t>(ranks));
  MPI_Gather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < ranks; ++r) offsets[static_cast<std::size_t>(r)] = total, total += counts[static_cast<std::size_t>(r)];
  std::vector<double> all(static_cast<std::size_t>(total));
  MPI_Gatherv(mine.data(), n, MPI_DOUBLE, all.data(), counts.data(), offsets.data(), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return all;
}

// 1 − busy ÷ (stages × span), over the events of one step.
double idle_fraction(const std::vector<double>& ev, int stages) {
  if (ev.empty()) return 0;
  double first = ev[3], last = ev[4], busy = 0;
  for (std::size_t i = 0; i < ev.size(); i += 5) {
    first = std::min(first, ev[i + 3]);
    last = std::max(last, ev[i + 4]);
    busy += ev[i + 4] - ev[i + 3];
  }
  return last > first ? 1.0 - busy / (stages * (last - first)) : 0;
}

void write_json(const std::string& path, const std::vector<Run>& runs, int stages, int m, int rows,
                const std::string& backend, const std::string& model) {
  std::ofstream f(path);
  f << "{\"stages\": " << stages << ", \"micro_batches\": " << m << ", \"rows\": " << rows << ", \"backend\": \""
    << backend << "\", \"model\": \"" << model << "\",\n \"bubble\": "
    << static_cast<double>(stages - 1) / (m + stages - 1) << ",\n \"runs\": [";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    f << (i ? ",\n  " : "\n  ") << "{\"schedule\": \"" << r.schedule << "\", \"recompute\": "
      << (r.recompute ? "true" : "false") << ", \"step_ms\": " << r.step_ms << ", \"one_micro_batch_ms\": " << r.one_ms
      << ", \"ideal_ms\": " << r.ideal_ms << ", \"idle\": " << r.idle << ", \"peak_activation_mib\": [";
    for (std::size_t s = 0; s < r.peak_mib.size(); ++s) f << (s ? ", " : "") << r.peak_mib[s];
    f << "],\n   \"events\": [";
    for (std::size_t e = 0; e < r.events.size(); e += 5)
      f << (e ? ",\n    " : "\n    ") << "{\"stage\": " << r.events[e] << ", \"pass\": \""
        << (r.events[e + 1] == 0 ? "F" : "B") << "\", \"micro_batch\": " << r.events[e + 2]
        << ", \"start_ms\": " << r.events[e + 3] << ", \"end_ms\": " << r.events[e + 4] << "}";
    f << "]}";
  }
  f << "\n]}\n";
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name, out_dir = ".";
  int m = 0, rows = 0, warmup = 2, repeats = 5;
  bool plot = true;
  const kd::FlagSetters flags{{"--model", [&](const std::string& v) { model_name = v; }},
                              {"-m", [&](const std::string& v) { m = std::stoi(v); }},
                              {"--rows", [&](const std::string& v) { rows = std::stoi(v); }},
                              {"-w", [&](const std::string& v) { warmup = std::stoi(v); }},
                              {"-n", [&](const std::string& v) { repeats = std::stoi(v); }},
                              {"-o", [&](const std::string& v) { out_dir = v; }}};
  if (!kd::parse_flags(argc, argv, flags, "[--model cpu|gpu] [-m M] [--rows R] [-w 2] [-n 5] [-o DIR] [--no-plot]",
                       {{"--no-plot", [&] { plot = false; }}}))
    return 2;
  return kd::run(argc, argv, [&](kd::Communicator& w) {
    const int s = w.rank(), p = w.size();
    if (model_name.empty()) model_name = w.backend() == kd::Backend::nccl ? "gpu" : "cpu";
    if (model_name != "cpu" && model_name != "gpu") throw std::runtime_error("--model is cpu or gpu, not " + model_name);
    km::Ops* ops = &km::backend_for(model_name == "gpu", w.compute_stream());  // messages ordered against its kernels
    // The messages are the model's tensors: device memory for NCCL, host memory for MPI.
    if ((model_name == "gpu") != (w.backend() == kd::Backend::nccl))
      throw std::runtime_error("--model " + model_name + " runs on the " + (model_name == "gpu" ? "nccl" : "mpi") +
                               " backend (k2c run --backend ...), this run uses " + kd::to_string(w.backend()));
    const km::ModelConfig c = model_name == "gpu" ? harness::gpu_model() : cpu_model();
    if (m <= 0) m = 4 * p;
    if (rows <= 0) rows = model_name == "gpu" ? harness::kGpuRows : 2;

    km::MemoryLedger ledger, data;
    km::ParamList params;
    km::Context ctx{*ops, ledger, params};
    // The student's split, this time: the benchmark runs the whole of the module's code.
    ps::Stage stage(params, c, pp::stage_blocks(c.n_layers, p, s), s, p);
    params.materialize(*ops, ledger, 1);
    const std::vector<ps::MicroBatch> mbs = harness::synthetic_micro_batches(*ops, data, c, m, rows);
    const float scale = 1.0f / static_cast<float>(m * rows * c.seq_len);
    kd::PointToPointView p2p(w);
    const kd::TimeStepOptions opt{.warmup = warmup, .repeats = repeats};
    if (s == 0)
      std::printf("# k2c_pipeline_parallel: %d stages, %d micro-batches of %d rows, backend %s\n# model %s\n"
                  "# bubble (p - 1)/(m + p - 1) = %.3f\n# %-6s %-9s %9s %9s %9s %10s %6s  %s\n",
                  p, m, rows, kd::to_string(w.backend()).c_str(), c.describe().c_str(),
                  static_cast<double>(p - 1) / (m + p - 1), "sched", "recompute", "step(ms)", "one(ms)", "ideal(ms)",
                  "ideal/step", "idle", "act MiB per stage");

    std::vector<Run> runs;
    for (pp::Schedule schedule : {pp::Schedule::gpipe, pp::Schedule::one_f_one_b}) {
      for (bool recompute : {false, true}) {
        Run run;
        run.schedule = schedule == pp::Schedule::gpipe ? "gpipe" : "1f1b";
        run.recompute = recompute;
        const pp::StepOptions so{schedule, recompute};
        run.one_ms = kd::time_step(w, [&] { harness::run_alone(stage, ctx, mbs[0], scale, recompute); }, opt).median_ms;
        run.step_ms = kd::time_step(w, [&] { pp::train_step(p2p, stage, ctx, mbs, so, nullptr); }, opt).median_ms;
        run.ideal_ms = (m + p - 1) * run.one_ms;

        // One more step, traced, from one origin for all ranks (rank 0's clock: one host's ranks
        // share it), with its activation peak.
        std::int64_t origin = std::chrono::steady_clock::now().time_since_epoch().count();
        MPI_Bcast(&origin, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
        pp::Trace trace;
        trace.origin = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(origin));
        trace.synchronize = w.backend() == kd::Backend::nccl;
        w.synchronize();
        w.barrier();
        ledger.reset_peaks();
        const std::size_t base = ledger.current(km::Category::activations);
        pp::train_step(p2p, stage, ctx, mbs, so, &trace);
        w.synchronize();
        run.peak_mib = gather(mib(ledger.peak(km::Category::activations) - base), p, s);
        run.events = gather_events(trace, s, p);
        run.idle = idle_fraction(run.events, p);
        if (s == 0) {
          std::printf("  %-6s %-9s %9.2f %9.3f %9.2f %10.3f %6.3f ", run.schedule.c_str(), recompute ? "yes" : "no",
                      run.step_ms, run.one_ms, run.ideal_ms, run.ideal_ms / run.step_ms, run.idle);
          for (double v : run.peak_mib) std::printf(" %.2f", v);
          std::printf("\n");
        }
        runs.push_back(std::move(run));
      }
    }
    if (s != 0) return;
    for (std::size_t i = 0; i + 1 < runs.size(); i += 2)
      std::printf("# %s: recomputation costs %.2fx the step (one extra forward of three passes: ~1.33x); "
                  "stage 0's activation peak %.2f -> %.2f MiB\n",
                  runs[i].schedule.c_str(), runs[i + 1].step_ms / runs[i].step_ms, runs[i].peak_mib[0],
                  runs[i + 1].peak_mib[0]);
    std::filesystem::create_directories(out_dir);
    const std::string json = (std::filesystem::path(out_dir) / "pipeline_trace.json").string();
    write_json(json, runs, p, m, rows, kd::to_string(w.backend()), c.describe());
    std::printf("# wrote %s\n", json.c_str());
    // The drawing is tools/plot_pipeline.py's, found from this source file's place in the tree.
    const std::filesystem::path tool =
        std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "tools" / "plot_pipeline.py";
    const std::string svg = (std::filesystem::path(out_dir) / "pipeline_timeline.svg").string();
    const std::string cmd = "python3 '" + tool.string() + "' '" + json + "' -o '" + svg + "'";
    if (plot && std::filesystem::exists(tool)) {
      if (std::system(cmd.c_str()) != 0) std::printf("# the timeline was not drawn; by hand: %s\n", cmd.c_str());
    } else {
      std::printf("# draw the timeline: %s\n", cmd.c_str());
    }
  });
}
