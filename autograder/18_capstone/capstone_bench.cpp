// capstone_bench.cpp — k2c_capstone: train the course's transformer on a dp × tp × pp × ep grid.
// The command lines are kUsage's, below the includes (`k2c_capstone --help` prints them).
//
// --bucket-mib X sizes DataParallel's buckets (module 12; 1 MiB by default): on a data-parallel
// grid, how many all-reduces a step starts under backward.
//
// --zero N trains with module 13's ZeRO stage N instead of the capstone's own optimizer, on a
// dp-only grid (capstone.h says what it refuses), clipping inside ZeRO's step; --checkpoint is
// refused (ZeRO keeps its optimizer shards to itself).
//
// `k2c run` prints the plain mpirun command it starts; on several nodes, run that command with a
// host list (mpirun -H node1:8,node2:8 ...) or under srun: the grid puts each tp group on
// neighbouring ranks, so keep tp within a node. Without --data the run trains on a Markov chain
// made on the fly (vocabulary 256, 4 successors per token), whose entropy rate it prints: the
// floor of the loss.
//
// Rank 0 prints one progress line per step (step, loss, validation loss, learning rate,
// gradient norm, tokens/s, MFU when --peak-tflops gives the hardware's peak, or else on a GPU the
// model FLOP rate per GPU as a share of the cuBLAS rate measured at the start, peak memory of the
// rank's ledger), writes the CSV log that tools/plot_loss.py draws (several logs overlay on one
// figure) and a JSON summary, and at the end samples continuations of validation prompts from
// the model gathered onto one rank (words, with the grammar data's vocabulary).
//
// --time-ops runs one more step at the end with every operation timed alone (a GPU sync around
// each: the step runs slower than the others and is left out of their figures) and prints where
// its time went, course kernels with their conversions; the JSON has it as "ops_ms", and the host's
// share of each (the CPU's time to issue the operation's work) as "ops_host_ms". On a GPU a step
// before that one is timed as it runs, from events on the stream around each operation, nothing
// waiting: "ops_in_step_ms", with the time between operations ("(between operations)": the GPU
// waiting for the host, and on a grid of several ranks communication and its waits).
//
// --kernels course (the default) runs the model's GEMMs, RMSNorm, RoPE, attention and the experts'
// grouped GEMMs on the GPU with the course's own kernels, modules 05, 07, 08, 09 and 10 of the tree
// this program was built from (a build from assignments/ runs yours), each checked against the
// trusted backend at its first call at each shape and replaced by the trusted one where it is
// missing or disagrees; the run ends with the table of which kernel ran (k2c/model/course_ops.h).
// --kernels trusted runs the model library's own. The CPU backend (the MPI runs) always runs its
// own: the course's kernels are GPU kernels.
//
// --activations bf16 stores the activations between a layer's operations in bf16 (half the
// bytes; k2c/model/ops.h says where each operation rounds); weights, gradients and AdamW stay
// fp32, and so does the residual stream unless --residual says otherwise. In course mode the modules then take those activations with no
// conversion pass where their contracts' layout is the model's. --residual bf16 keeps the residual
// stream in bf16 as well (grids without tp or ep, no dropout; capstone.h): every pass over
// it moves half the bytes, and course mode's RMSNorm takes it with no conversion.
//
// --traffic counts every collective and message of each step, group by group, and prints rank 0's
// last training step beside the plan's figures (the JSON has both as "traffic_sent" and
// "traffic_planned"): where a capstone sends more than its modules' contracts say, it shows.
//
// --plan prints, without training and on one process whatever the grid, what each pipeline stage's
// rank would hold (parameters, gradients, AdamW state, the activations' estimated peak) and send in
// one step, group by group (grid_plan.h), and refuses with status 2 what the trainer would refuse.
// --plan-ranks N prints every grid of N ranks that the model and batch allow, one line each (memory, wire bytes a step
// by purpose, the bubble), the least traffic first. With --json FILE either writes its plans as
// JSON, which tools/plot_grids.py draws.
//
// Exit status: 0 after training, 2 for bad arguments (a grid that does not fit the ranks or the
// model included), 1 otherwise.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "capstone.h"
#include "grid_plan.h"
#include "k2c/dist/counting.h"
#include "k2c/dist/grid.h"
#include "k2c/dist/runtime.h"
#include "k2c/model/course_ops.h"
#include "k2c/model/data.h"
#include "k2c/model/timed_ops.h"
#include "k2c/model/train.h"
#if K2C_MODEL_CUDA
#include "k2c/reference/ceilings.h"
#include "k2c/model/cuda_ops.h"
#endif
#if K2C_COURSE_KERNELS
#include "course_kernels.h"
#endif

namespace fs = std::filesystem;
namespace kc = k2c::capstone;
namespace km = k2c::model;

namespace {

// A JSON string (the fallback reasons quote messages that may hold any character).
std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') q += '\\', q += ch;
    else if (static_cast<unsigned char>(ch) < 0x20) q += ' ';
    else q += ch;
  }
  return q + "\"";
}

constexpr const char* kUsage = R"(usage:
  k2c run -np 8 build/<tree>/bin/k2c_capstone [--grid dp2,tp2,pp2] [--data datasets/grammar]
          [--config tiny|tiny-moe|dense-135m|moe-135m] [--steps N] [--batch B]
          [--micro-batches M] [--gpipe] [--lr X] [--clip C] [--seed S] [--eval-every K]
          [--zero 1|2|3] [--log run.csv] [--json run.json] [--checkpoint ckpt.bin [--resume]]
          [--samples N] [--peak-tflops P] [--kernels course|trusted]
          [--activations f32|bf16] [--residual f32|bf16] [--time-ops] [--traffic] [--bucket-mib X]
  k2c_capstone --plan --grid dp2,tp2,pp2 [--config ...] [--data DIR] [--batch B] [--micro-batches M]
               [--gpipe] [--activations f32|bf16] [--residual f32|bf16] [--zero N] [--json plan.json]
  k2c_capstone --plan-ranks 8 [the same flags but --grid]
One GPU: k2c run -np 1 --backend nccl build/<tree>/bin/k2c_capstone --config dense-135m ...
(<tree>: solutions or assignments.) Without --grid the grid is 1; without --data the run trains
on a Markov chain made on the fly. The flags that need more than their name are explained at the
top of autograder/18_capstone/capstone_bench.cpp.
)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The presets (grid_plan.h), an unknown name a usage error.
km::ModelConfig preset(const std::string& name) {
  try {
    return kc::capstone_preset(name);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

struct Options {
  std::string grid = "1", data, config = "tiny", log, json, checkpoint, kernels = "course", activations = "f32",
              residual = "f32";
  int steps = 100, batch = 8, micro_batches = 1, eval_every = 25, samples = 3, zero = 0, plan_ranks = 0;
  double lr = 3e-3, clip = 1.0, peak_tflops = 0, bucket_mib = 1;
  std::uint64_t seed = 1;
  bool resume = false, gpipe = false, time_ops = false, plan = false, traffic = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    auto number = [&]() {
      const std::string v = value();
      try {
        std::size_t used = 0;
        const double d = std::stod(v, &used);
        if (used == v.size() && std::isfinite(d)) return d;
      } catch (...) {
      }
      throw UsageError(a + ": '" + v + "' is not a number");
    };
    // A count or a seed: a whole number in [lo, hi] (a cast would wrap 1e10 or truncate 2.7).
    auto whole = [&](double lo, double hi) {
      const double d = number();
      if (d != std::floor(d) || d < lo || d > hi) {
        char range[64];
        std::snprintf(range, sizeof range, "a whole number from %.0f to %.0f", lo, hi);
        throw UsageError(a + ": " + range);
      }
      return d;
    };
    auto positive = [&]() {
      const double d = number();
      if (!(d > 0)) throw UsageError(a + ": a number above 0");
      return d;
    };
    if (a == "--grid") o.grid = value();
    else if (a == "--data") o.data = value();
    else if (a == "--config") o.config = value();
    else if (a == "--log") o.log = value();
    else if (a == "--json") o.json = value();
    else if (a == "--checkpoint") o.checkpoint = value();
    else if (a == "--kernels") o.kernels = value();
    else if (a == "--activations") o.activations = value();
    else if (a == "--residual") o.residual = value();
    else if (a == "--steps") o.steps = static_cast<int>(whole(1, 1e9));
    else if (a == "--batch") o.batch = static_cast<int>(whole(1, 1e6));
    else if (a == "--micro-batches") o.micro_batches = static_cast<int>(whole(1, 1e6));
    else if (a == "--eval-every") o.eval_every = static_cast<int>(whole(0, 1e9));
    else if (a == "--samples") o.samples = static_cast<int>(whole(0, 1000));
    else if (a == "--lr") o.lr = positive();
    else if (a == "--clip") o.clip = number();
    else if (a == "--zero") o.zero = static_cast<int>(whole(0, 3));
    else if (a == "--peak-tflops") {
      o.peak_tflops = number();  // 0: no MFU printed
      if (o.peak_tflops < 0) throw UsageError("--peak-tflops: 0 or more");
    }
    else if (a == "--bucket-mib") o.bucket_mib = number();
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(whole(0, 9007199254740992.0));
    else if (a == "--resume") o.resume = true;
    else if (a == "--gpipe") o.gpipe = true;
    else if (a == "--time-ops") o.time_ops = true;
    else if (a == "--plan") o.plan = true;
    else if (a == "--plan-ranks") {
      const double n = number();
      if (n < 1 || n > 65536 || n != static_cast<int>(n)) throw UsageError("--plan-ranks: a whole number from 1 to 65536");
      o.plan_ranks = static_cast<int>(n), o.plan = true;
    }
    else if (a == "--traffic") o.traffic = true;
    else throw UsageError("unknown argument '" + a + "' (k2c_capstone --help lists them)");
  }
  if (o.kernels != "course" && o.kernels != "trusted")
    throw UsageError("--kernels " + o.kernels + ": course or trusted");
  if (o.activations != "f32" && o.activations != "bf16")
    throw UsageError("--activations " + o.activations + ": f32 or bf16");
  if (o.residual != "f32" && o.residual != "bf16") throw UsageError("--residual " + o.residual + ": f32 or bf16");
  if (o.resume && o.checkpoint.empty()) throw UsageError("--resume needs --checkpoint FILE");
  if (o.zero < 0 || o.zero > 3) throw UsageError("--zero " + std::to_string(o.zero) + ": 1, 2 or 3 (0: off)");
  // One rank's checkpoint is the file itself, several ranks' are FILE.rank<r> (capstone.h).
  if (o.resume && !std::ifstream(o.checkpoint) && !std::ifstream(o.checkpoint + ".rank0"))
    throw UsageError("--resume: cannot read the checkpoint " + o.checkpoint + " (nor " + o.checkpoint + ".rank0)");
  if (!o.json.empty() && !o.plan) {
    // The summary is written after the last step, to FILE.part renamed into place: a folder that
    // cannot take it is said now. Each rank tries a name of its own (they all parse the flags).
    std::error_code ec;
    const std::string probe = o.json + ".probe" + std::to_string(getpid());
    if (fs::is_directory(o.json, ec) || !std::ofstream(probe)) throw UsageError("--json " + o.json + ": cannot write there");
    fs::remove(probe, ec);
  }
  if (o.zero > 0 && !o.checkpoint.empty())
    throw UsageError("--checkpoint with --zero " + std::to_string(o.zero) +
                     ": module 13's Zero does not expose its optimizer shards; drop one of the two");
  if (o.steps < 1 || o.batch < 1 || o.micro_batches < 1)
    throw UsageError("--steps, --batch and --micro-batches must be at least 1");
  if (o.bucket_mib < 1.0 / 1024 || o.bucket_mib > 4096)
    throw UsageError("--bucket-mib: from 1/1024 (1 KiB) to 4096");
  // What can be checked before the ranks start is checked here, so that a typo ends the run once,
  // with status 2, instead of on every rank.
  preset(o.config);
  try {
    kc::parse_grid(o.grid);
    if (!o.data.empty()) km::shard_in(o.data, "train"), km::shard_in(o.data, "val");
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  return o;
}

// The run's configuration from the flags; the vocabulary grows to the data's (data_vocab 0: the
// preset's) and rounds up to a multiple of tp, so that a vocabulary cut over tp divides (the
// extra ids are never targets).
kc::CapstoneConfig make_config(const Options& o, std::uint32_t data_vocab) {
  kc::CapstoneConfig config;
  km::TrainConfig& c = config.train;
  c.model = preset(o.config);
  c.steps = o.steps, c.batch = o.batch, c.lr = static_cast<float>(o.lr), c.min_lr = c.lr / 10;
  c.clip = static_cast<float>(o.clip), c.seed = o.seed;
  c.activations = o.activations == "bf16" ? km::DType::bf16 : km::DType::f32;
  c.residual = o.residual == "bf16" ? km::DType::bf16 : km::DType::f32;
  config.grid = kc::parse_grid(o.grid);
  config.micro_batches = o.micro_batches;
  config.one_f_one_b = !o.gpipe;
  config.zero_stage = o.zero;
  config.bucket_bytes = static_cast<std::size_t>(o.bucket_mib * 1048576.0);
  if (data_vocab > static_cast<std::uint32_t>(c.model.vocab)) c.model.vocab = static_cast<int>(data_vocab);
  kc::round_vocab_to_tp(config);
  return config;
}

// The vocabulary of a k2c_datagen folder's training shard.
std::uint32_t data_vocab_of(const std::string& folder) { return km::read_shard(km::shard_in(folder, "train")).vocab; }

// --plan: the grid's training state and traffic a step, from the flags alone (no ranks needed);
// with --plan-ranks N, every grid of N ranks, one line each.
int plan(const Options& o) {
  try {
    const kc::CapstoneConfig config = make_config(o, o.data.empty() ? 0 : data_vocab_of(o.data));
    const std::vector<kc::GridPlan> plans =
        o.plan_ranks > 0 ? kc::plan_grids(config, o.plan_ranks) : std::vector<kc::GridPlan>{kc::plan_grid(config)};
    std::cout << (o.plan_ranks > 0 ? kc::describe_grids(plans) : kc::describe(plans.front()));
    if (!o.json.empty()) {
      std::ofstream j(o.json);
      j << kc::plans_json(plans);
      if (!j) throw std::runtime_error("cannot write " + o.json);
      std::cout << "plan: " << o.json << "  (plot: python3 tools/plot_grids.py " << o.json << ")\n";
    }
  } catch (const std::invalid_argument& e) {
    std::cerr << "k2c_capstone: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {  // a data folder or an output file that cannot be read or written
    std::cerr << "k2c_capstone: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

int run(k2c::dist::Communicator& world, const Options& o) {
  const bool root = world.rank() == 0;
  // The data: a k2c_datagen folder, or a Markov chain made here (the same on every rank).
  std::vector<std::uint16_t> train_tokens, val_tokens;
  std::optional<fs::path> train_shard, val_shard;
  std::vector<std::string> vocab;
  std::uint32_t data_vocab = 0;
  if (!o.data.empty()) {
    train_shard = km::shard_in(o.data, "train");
    val_shard = km::shard_in(o.data, "val");
    for (const auto& e : fs::directory_iterator(o.data))
      if (e.path().filename().string().ends_with("_vocab.txt")) vocab = km::read_vocab(e.path());
    data_vocab = data_vocab_of(o.data);
  } else {
    const int markov_vocab = preset(o.config).vocab;
    km::MarkovSource source(o.seed, markov_vocab, 4);
    train_tokens = source.sample(400000);
    val_tokens = source.sample(50000);
    data_vocab = static_cast<std::uint32_t>(markov_vocab);
    if (root) std::printf("data: a Markov chain of %d tokens, entropy rate (the loss floor) %.4f nats\n",
                          markov_vocab, source.entropy_rate());
  }
  kc::CapstoneConfig config = make_config(o, data_vocab);
  km::TrainConfig& c = config.train;
  auto loader = [&](bool validation, int rank, int ranks) {
    const km::LoaderConfig lc{c.model.seq_len, c.batch, rank, ranks, c.seed + (validation ? 1 : 0)};
    if (train_shard) return km::TokenLoader({validation ? *val_shard : *train_shard}, lc);
    return km::TokenLoader(validation ? val_tokens : train_tokens, data_vocab, lc);
  };

  // The model's operations: the CPU backend on MPI; on NCCL the GPU backend (bf16 tensor cores),
  // on the communicator's compute stream so that collectives are ordered after what they read.
  // There, the ceiling of the ratio: cuBLAS's bf16 GEMM rate, measured here before training.
  km::Ops* ops = &km::cpu_ops();
  double cublas = 0;
  std::unique_ptr<km::CourseOps> course;
  std::string kernels = "trusted (the CPU backend; the course's kernels are GPU kernels)";
  if (world.backend() == k2c::dist::Backend::nccl) {
#if K2C_MODEL_CUDA
    km::cuda_ops_use_stream(world.compute_stream());
    ops = &km::cuda_ops();
    kernels = "trusted (the model library's)";
    if (o.kernels == "course") {
#if K2C_COURSE_KERNELS
      course = std::make_unique<km::CourseOps>(*ops, kc::course_kernels());
      ops = course.get();
      kernels = "course (modules 05, 07, 08, 09 and 10, each checked against the trusted backend at its first call at each shape)";
#else
      kernels = "trusted: this build has no course kernels (it needs modules 05 to 10 built with CUDA)";
#endif
    }
    cublas = k2c::bf16_gemm_rate(8192);
    if (root) std::printf("cuBLAS bf16 GEMM on this GPU (this run): %.1f TFLOP/s\n", cublas / 1e12);
#else
    throw std::runtime_error("the NCCL backend needs the model's GPU backend (k2c_model_cuda), not built here");
#endif
  }
  // --time-ops: a timer around everything (the course kernels' conversions included), which times
  // only when told to, so the training steps run untouched. On a GPU a second one, switched off
  // until its step, times the operations inside a step that runs as usual (marks on the stream).
  bool timing = false;
  std::unique_ptr<km::TimedOps> timed, timed_in_step;
  std::unique_ptr<km::QueueMarks> marks;
  if (o.time_ops) {
    const bool cuda = world.backend() == k2c::dist::Backend::nccl;
    timed = std::make_unique<km::TimedOps>(*ops, [&timing, cuda] {
#if K2C_MODEL_CUDA
      if (timing && cuda) km::cuda_ops_synchronize();
#else
      (void)timing, (void)cuda;
#endif
    });
    ops = timed.get();
#if K2C_MODEL_CUDA
    if (cuda) {
      marks = km::cuda_queue_marks();
      timed_in_step = std::make_unique<km::TimedOps>(*timed, *marks);
      timed_in_step->enable(false);
      ops = timed_in_step.get();
    }
#endif
  }
  // A grid that does not fit the ranks or the model: every rank finds the same reason (the checks
  // read only the configuration and the world's size), so each returns 2 and rank 0 says why.
  // --traffic: the trainer talks through a counter whose groups are named by their axes; the last
  // training step's counts are set beside the plan's at the end.
  std::optional<k2c::dist::CountingCommunicator> counting;
  if (o.traffic) {
    counting.emplace(world, "world");
    counting->name_groups([g = config.grid](const std::vector<int>& r) { return k2c::dist::group_label(g, r); });
  }
  k2c::dist::TrafficTable last_traffic;
  std::optional<kc::GridTrainer> built;
  try {
    if (counting) built.emplace(*counting, *ops, config, loader);
    else built.emplace(world, *ops, config, loader);
  } catch (const std::invalid_argument& e) {
    if (root) std::cerr << "k2c_capstone: " << e.what() << "\n";
    return 2;
  }
  kc::GridTrainer& trainer = *built;
  if (o.resume) trainer.load(o.checkpoint);
  if (root) {
    std::printf("model: %s\ngrid: %s on %d ranks, %d micro-batches (%s), batch %d x %d tokens\n",
                c.model.describe().c_str(), kc::grid_name(config.grid).c_str(), world.size(), o.micro_batches,
                o.gpipe ? "GPipe" : "1F1B", c.batch, c.model.seq_len);
    std::string optimizer = "AdamW";
    if (o.zero > 0) optimizer += " under ZeRO stage " + std::to_string(o.zero) + " over dp " + std::to_string(config.grid.dp);
    if (o.clip > 0) std::printf("optimizer: %s, clipping at gradient norm %g\n", optimizer.c_str(), o.clip);
    else std::printf("optimizer: %s, no clipping\n", optimizer.c_str());
    std::printf("kernels: %s\n", kernels.c_str());
    if (c.activations == km::DType::bf16 || c.residual == km::DType::bf16)
      std::printf("activations: %s between operations, residual stream %s (weights, gradients and AdamW in fp32)\n",
                  o.activations.c_str(), o.residual.c_str());
    if (o.resume) std::printf("resumed from %s at step %d\n", o.checkpoint.c_str(), trainer.steps_done());
  }
  std::ofstream log;
  if (root && !o.log.empty()) {
    const bool fresh = !o.resume || !fs::exists(o.log);
    log.open(o.log, fresh ? std::ios::trunc : std::ios::app);
    if (!log) throw std::runtime_error("cannot write the log " + o.log);
    if (fresh) log << "step,loss,val_loss,lr,grad_norm,tokens_per_s,mfu,seconds\n";
  }
  std::vector<km::StepRecord> records;
  const double flops_per_token = c.model.train_flops_per_token();
  while (trainer.steps_done() < c.steps) {
    if (counting) counting->reset();
    km::StepRecord r = trainer.step();
    if (counting) last_traffic = counting->counts();
    const bool last = trainer.steps_done() == c.steps;
    if ((o.eval_every > 0 && trainer.steps_done() % o.eval_every == 0) || last) r.val_loss = trainer.evaluate(8);
    // MFU: model FLOPs of the step over the time, against the peak of every GPU of the grid.
    if (o.peak_tflops > 0) r.mfu = r.tokens_per_s * flops_per_token / (o.peak_tflops * 1e12 * world.size());
    records.push_back(r);
    if (!root) continue;
    char val[32] = "", mfu[32] = "", norm[32] = "|g|     -";  // a norm of -1: not measured (ZeRO)
    if (r.val_loss >= 0) std::snprintf(val, sizeof val, "  val %.4f", r.val_loss);
    if (o.peak_tflops > 0)
      std::snprintf(mfu, sizeof mfu, "  MFU %.1f%%", 100 * r.mfu);
    else if (cublas > 0)
      std::snprintf(mfu, sizeof mfu, "  %.3f of cuBLAS", r.tokens_per_s * flops_per_token / world.size() / cublas);
    if (r.grad_norm >= 0) std::snprintf(norm, sizeof norm, "|g| %.3f", r.grad_norm);
    std::printf("step %5d/%d  loss %.4f%s  lr %.2e  %s  %.0f tok/s%s  mem %.1f MiB\n", r.step + 1, c.steps, r.loss,
                val, r.lr, norm, r.tokens_per_s, mfu, trainer.ledger().peak_total() / 1048576.0);
    std::fflush(stdout);
    if (log) {
      log << r.step << ',' << r.loss << ',';
      if (r.val_loss >= 0) log << r.val_loss;
      log << ',' << r.lr << ',';
      if (r.grad_norm >= 0) log << r.grad_norm;
      log << ',' << r.tokens_per_s << ',' << r.mfu << ',' << r.seconds << '\n';
    }
  }
  if (!o.checkpoint.empty()) trainer.save(o.checkpoint);
  const std::vector<float> values = trainer.gather_values();
  // --time-ops: steps past the run (after the checkpoint and the gathered weights, so neither
  // sees them): on a GPU one timed inside the step, then one with each operation alone.
  std::vector<std::pair<std::string, double>> ops_ms, ops_host_ms, ops_in_step_ms;
  if (timed_in_step) {
    // Two steps: the first makes the marks' events and the table's entries, so that the second,
    // the one kept, pays for neither; the timer below stays out of both.
    timed->enable(false);
    timed_in_step->enable(true);
    for (int pass = 0; pass < 2; ++pass) {
      timed_in_step->reset();
      trainer.step();
    }
    timed_in_step->enable(false);
    timed->enable(true);
    for (const auto& [name, e] : timed_in_step->entries()) ops_in_step_ms.emplace_back(name, e.seconds * 1e3);
    ops_in_step_ms.emplace_back("(between operations)", timed_in_step->between_seconds() * 1e3);
    if (root)
      std::cout << "where one more step's GPU time went (rank 0, the time between marks on the stream around each "
                   "operation in a step run as usual):\n"
                << timed_in_step->report() << "between operations (the GPU waiting for the host; on a grid of several "
                   "ranks also communication and its waits): "
                << timed_in_step->between_seconds() * 1e3 << " ms\n";
  }
  if (timed) {
    timed->reset();
    timing = true;
    trainer.step();
    timing = false;
    for (const auto& [name, e] : timed->entries()) {
      ops_ms.emplace_back(name, e.seconds * 1e3);
      ops_host_ms.emplace_back(name, e.host_seconds * 1e3);
    }
    if (root) std::cout << "where one more step's time went (rank 0, each operation timed alone):\n" << timed->report();
  }
  if (!root) return 0;
  // The steady rate: the median step after the first two (allocation, warm-up).
  double median_tps = 0;
  if (records.size() > 2) {
    std::vector<double> tps;
    for (std::size_t i = 2; i < records.size(); ++i) tps.push_back(records[i].tokens_per_s);
    std::nth_element(tps.begin(), tps.begin() + static_cast<std::ptrdiff_t>(tps.size() / 2), tps.end());
    median_tps = tps[tps.size() / 2];
    const double model_rate = median_tps * flops_per_token / world.size();  // per GPU
    std::printf("median %.0f tokens/s, model FLOP rate %.1f TFLOP/s per rank", median_tps, model_rate / 1e12);
    if (cublas > 0) std::printf(", %.3f of cuBLAS bf16 (%.1f TFLOP/s in this run)", model_rate / cublas, cublas / 1e12);
    std::printf("\n");
  }
  std::cout << "memory of rank 0 (peak over the run):\n" << trainer.ledger().report();
  const kc::PlannedTraffic sent = kc::sent_bytes(last_traffic);
  std::optional<kc::GridPlan> planned;
  if (counting) {
    planned = kc::plan_grid(config);
    std::cout << "traffic of rank 0 in the last step, beside the plan (~: an even spread of routed rows):\n"
              << kc::compare_traffic(*planned, planned->stages.front(), sent);
  }
  if (course) std::cout << "kernels of rank 0 (calls over the run):\n" << course->report();
  if (!o.log.empty()) std::printf("log: %s  (plot: python3 tools/plot_loss.py %s)\n", o.log.c_str(), o.log.c_str());
  if (!o.json.empty()) {
    const std::string part = o.json + ".part";  // renamed into place once whole
    std::ofstream j(part);
    j << "{\n  \"grid\": \"" << kc::grid_name(config.grid) << "\", \"ranks\": " << world.size()
      << ", \"model\": \"" << c.model.describe() << "\", \"micro_batches\": " << o.micro_batches
      << ", \"zero_stage\": " << o.zero << ", \"bucket_bytes\": " << config.bucket_bytes
      << ", \"activations\": \"" << o.activations << "\", \"residual\": \"" << o.residual
      << "\",\n  \"kernels\": {";  // course mode's table, by operation
    if (course) {
      const auto rows = course->table();
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto& r = rows[i];
        j << (i ? ",\n    " : "\n    ") << quoted(r.op) << ": {\"kernel\": " << quoted(r.kernel)
          << ", \"course_calls\": " << r.course_calls << ", \"trusted_calls\": " << r.trusted_calls
          << ", \"shapes_checked\": " << r.shapes_checked << ", \"unchecked_calls\": " << r.unchecked_calls
          << ", \"shapes_declined\": " << r.shapes_declined << ", \"worst_error\": " << r.worst_error
          << ", \"fallback\": " << quoted(r.fallback) << ", \"replaced\": " << quoted(r.replaced) << "}";
      }
    }
    for (const auto& [key, table] : {std::pair{"ops_ms", &ops_ms}, std::pair{"ops_host_ms", &ops_host_ms},
                                     std::pair{"ops_in_step_ms", &ops_in_step_ms}}) {
      j << "},\n  " << quoted(key) << ": {";
      for (std::size_t i = 0; i < table->size(); ++i)
        j << (i ? ", " : "") << quoted((*table)[i].first) << ": " << (*table)[i].second;
    }
    // --traffic: rank 0's last step and its plan, "group operation": bytes.
    if (planned)
      for (const auto& [key, table] :
           {std::pair{"traffic_sent", sent}, std::pair{"traffic_planned", planned->stages.front().traffic}}) {
        j << "},\n  " << quoted(key) << ": {";
        bool first = true;
        for (const auto& [group, by_op] : table)
          for (const auto& [op, bytes] : by_op) {
            j << (first ? "" : ", ") << quoted(group + " " + op) << ": " << bytes;
            first = false;
          }
      }
    j << "},\n  \"steps\": [";
    for (std::size_t i = 0; i < records.size(); ++i)
      j << (i ? ",\n    " : "\n    ") << "{\"step\": " << records[i].step << ", \"loss\": " << records[i].loss
        << ", \"val_loss\": " << records[i].val_loss << ", \"grad_norm\": " << records[i].grad_norm
        << ", \"tokens_per_s\": " << records[i].tokens_per_s << ", \"mfu\": " << records[i].mfu << "}";
    j << "\n  ],\n  \"median_tokens_per_s\": " << median_tps << ", \"model_tflops_per_rank\": "
      << median_tps * flops_per_token / world.size() / 1e12 << ", \"cublas_bf16_tflops\": " << cublas / 1e12
      << ", \"ratio\": " << (cublas > 0 ? median_tps * flops_per_token / world.size() / cublas : 0)
      << ",\n  \"peak_memory_bytes_rank0\": " << trainer.ledger().peak_total() << "\n}\n";
    j.close();
    std::error_code ec;
    if (!j) throw std::runtime_error("cannot write " + part);
    fs::rename(part, o.json, ec);
    if (ec) throw std::runtime_error("cannot write " + o.json + ": " + ec.message());
  }
  // Samples: the gathered weights in a one-process trainer on this rank.
  if (o.samples > 0) {
    km::Trainer one(c, km::cpu_ops(), loader(false, 0, 1), loader(true, 0, 1));
    km::cpu_ops().upload(one.params().flat_values(), values.data());
    for (int i = 0; i < o.samples; ++i) {
      const km::TokenBatch b = loader(true, 0, 1).batch_at(100 + i);
      const std::vector<std::int32_t> prompt(b.inputs.begin(), b.inputs.begin() + std::min(8, c.model.seq_len));
      const std::vector<std::int32_t> out = one.sample(prompt, 2 * c.model.seq_len, 0.8f, c.seed + i);
      std::cout << "sample " << i + 1 << ": "
                << km::sample_text(prompt, std::span<const std::int32_t>(out).subspan(prompt.size()), vocab) << "\n";
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "-h" || std::string(argv[i]) == "--help") {
      std::cout << kUsage;
      return 0;
    }
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "k2c_capstone: " << e.what() << "\n";
    return 2;
  }
  if (o.plan) return plan(o);
  int status = 0;
  const int rc = k2c::dist::run(argc, argv, [&](k2c::dist::Communicator& world) { status = run(world, o); });
  return rc ? rc : status;
}
