// assignments/18_capstone/capstone.h — the contract of module 18 (do not edit).
//
// The capstone trains the course's decoder-only transformer (k2c/model/transformer.h: RMSNorm,
// RoPE, GQA attention, SwiGLU or a mixture of experts with a shared expert, untied head, AdamW,
// cosine schedule, gradient clipping) on a grid of ranks dp × tp × pp × ep, any axis 1. Nothing
// in it is a new algorithm: every axis is a module you wrote.
//
//   dp   module 12   data parallelism: DataParallel's buckets, over the dp group
//   tp   module 14   ParallelBlock, VocabParallelEmbedding, a ColumnParallelLinear head and
//                    vocab_parallel_cross_entropy, over the tp group
//   pp   module 15   stage_blocks and train_step's 1F1B (or GPipe) schedule, over the pp group
//   ep   module 17   ExpertParallelMoe in every block and reduce_gradients, over the ep group
//   ZeRO module 13   with zero_stage > 0 on a dp-only grid, Zero steps the model (see ZeRO below)
//
// What you write is the composition: the process grid and its groups, one pipeline stage whose
// blocks hold the parallel layers of this rank's place in the grid, the group over which each
// parameter's gradient is reduced, a clipping norm that counts every weight of the model exactly
// once, the checkpoint of a rank's part of the state, and on a dp-only grid the hand-over of the
// step to module 13's ZeRO. The course's program around it
// (autograder/18_capstone/capstone_bench.cpp, `k2c_capstone`) parses flags, prints the progress
// line, writes the logs, samples and times.
//
// The grid. World rank r is laid out as k2c/dist/grid.h says (tp fastest, then ep, pp, dp):
// tp groups are neighbours, on one node. Your library links no more than the model library and
// headers, so it makes the groups itself, each with one world.split(). Ranks that see different tokens are the "data ranks": the
// D = dp·ep ranks of one (pp, tp) place; data rank d = dp_coord·ep + ep_coord reads rows
// [d·B/D, (d+1)·B/D) of each global batch of B sequences (model::TokenLoader with dp_rank d and
// dp_size D), and cuts them into `micro_batches` micro-batches for the pipeline.
//
// Which sizes must divide: B by D·micro_batches; n_layers by nothing, but pp <= n_layers; q_heads,
// kv_heads, d_ff and vocab by tp; experts by ep. ep > 1 needs a mixture of experts, and tp or
// ep > 1 no dropout. The constructor refuses anything else with std::invalid_argument naming the
// values.
//
// tp × ep. A block of a mixture of experts under tp > 1 is module 14's ParallelAttention over the
// tp group (its norms whole) around module 17's ExpertParallelMoe over the ep group (module 14's
// block has no experts): the ep group is formed across the tp groups, the ep ranks of one
// (dp, pp, tp) place, so tp rank t trades tokens with tp rank t of the other ep coordinates only;
// at ep = 1 it is the rank alone, which holds every expert. The tp ranks of one ep group hold the
// same tokens, the same expert shard and the same router: the MoE is replicated over tp and
// computes the same bits there, so its gradients are reduced as under ep alone and not over tp.
//
// Results. On the CPU backend a grid trains the same model on the same tokens as one process
// (model::Trainer): at grid 1 the same operations in the same order, so the same bits; on other
// grids sums are taken in another order (gradients over ranks, row-parallel products, the norm),
// so the loss curves agree within the tolerance the tests state, and every rank holding a copy
// of a value holds the same bits. With zero_stage > 0, at dp 1 and 2 and without clipping, the
// same bits as zero_stage 0 on the same grid: Zero sums gradients scaled to the global batch where
// DataParallel averages the data ranks' means, and at 2 ranks both are (g0 + g1) / 2 exactly.
// With clipping, Zero's norm adds the shards' sums of squares in another order, so the curves
// agree within the tests' tolerance. On the GPU backend (a NCCL world, one GPU a rank) the same
// code trains: every collective then moves backend memory (dist::Buffer, device pointers), never
// a host variable, which MPI takes and NCCL does not. The speed test runs grid 1 there.
//
// Activations. config.train.activations (f32 or bf16; anything else refused) becomes the
// Context's `activations`: the library's layers then store theirs in that dtype, and where tp = 1
// the stage's final norm output, the logits and their gradients are in it too, as in
// model::Transformer, so that grid 1 stays bit for bit. Module 14's layers keep fp32.
//
// The residual stream. config.train.residual (f32 or bf16) becomes the Context's `residual`: the
// library's blocks then keep the stream between them (and its gradient) in that dtype, and so
// must the stage's tensors that model::Transformer makes with ctx.residual_stream(): the
// embedding's output, and the gradients the stage passes down its blocks. The stages still send
// fp32 to each other, and under ZeRO the model::Transformer keeps it as the library does. bf16
// runs where tp = ep = 1, with no dropout (model::check_residual): the constructor refuses it
// elsewhere with std::invalid_argument, before it makes any group.
//
// ZeRO. zero_stage 1, 2 or 3 hands each step to module 13's zero::Zero (k2c::zero, zero.h: the
// AdamW state sharded over the dp group, then the gradients too, then the parameters too), run on
// a model::Transformer of the rank's own over the dp group. Zero owns the whole step of one
// Transformer on one data-parallel communicator, so it runs where tp = pp = ep = 1 (any dp) with
// one micro-batch. Zero reduces the gradients and updates the weights inside one call, so no
// code outside it sees the reduced gradient before the update: clipping is Zero's own
// (ZeroConfig::clip = config.train.clip). The constructor refuses, with std::invalid_argument
// naming the value, a zero_stage outside 0..3, any grid with tp, pp or ep > 1, and
// micro_batches > 1. Under ZeRO, step() records Zero::grad_norm() as grad_norm, or -1 when clip
// is 0 (Zero then does not measure it); evaluate() and
// gather_values() work in every stage (to evaluate, stage 3 gathers the weights to the host and
// puts one layer at a time in the backend's memory); save() and load() throw std::runtime_error,
// since Zero keeps its shards of the AdamW state to itself and a checkpoint could not hold them.
//
// Tests: autograder/18_capstone/test_capstone.cpp, test_capstone_zero.cpp and, on one GPU,
// test_capstone_perf.cpp. Lecture: lectures/18_capstone.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/dist/communicator.h"
#include "k2c/dist/grid.h"
#include "k2c/model/data.h"
#include "k2c/model/train.h"

namespace k2c::capstone {

// ---- given: the grid flag

// "dp2,tp2,pp2,ep2", in any order, any axis left out meaning 1; "1" (or "") is one rank. Also
// accepts "x" between axes ("dp2xtp2"). Throws std::invalid_argument naming what it could not
// read: an unknown axis, one given twice, a size that is not a whole number from 1 to 99999, or a
// separator with no axis after it.
inline dist::GridShape parse_grid(const std::string& text) {
  dist::GridShape g;
  if (text.empty() || text == "1") return g;
  const auto bad = [&](const std::string& why) { return std::invalid_argument("grid '" + text + "': " + why); };
  std::string seen;
  for (std::size_t i = 0;;) {
    const std::string axis = text.substr(i, 2);
    int* size = axis == "dp" ? &g.dp : axis == "tp" ? &g.tp : axis == "pp" ? &g.pp : axis == "ep" ? &g.ep : nullptr;
    if (!size) throw bad("'" + axis + "' is not an axis (dp, tp, pp or ep; ',' or 'x' between them)");
    if (seen.find(axis) != std::string::npos) throw bad("'" + axis + "' is given twice");
    seen += axis;
    i += 2;
    std::size_t end = i;
    while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
    if (end == i || end - i > 5 || std::stoi(text.substr(i, end - i)) < 1)
      throw bad("'" + axis + "' needs a size from 1 to 99999");
    *size = std::stoi(text.substr(i, end - i));
    i = end;
    if (i == text.size()) return g;
    if (text[i] != ',' && text[i] != 'x') throw bad("'" + text.substr(i, 1) + "' after " + axis + ": ',' or 'x' separates axes");
    if (++i == text.size()) throw bad("it ends with a separator");
  }
}

inline std::string grid_name(const dist::GridShape& g) {
  std::string s;
  auto add = [&](const char* axis, int n) {
    if (n > 1) s += (s.empty() ? "" : ",") + std::string(axis) + std::to_string(n);
  };
  add("dp", g.dp), add("tp", g.tp), add("pp", g.pp), add("ep", g.ep);
  return s.empty() ? "1" : s;
}

// ---- the run

struct CapstoneConfig {
  model::TrainConfig train;      // model, steps, global batch, learning rate, clip, AdamW, seed, activations
  dist::GridShape grid;          // cp must stay 1
  int micro_batches = 1;         // per step and data rank, for the pipeline
  bool one_f_one_b = true;       // the pipeline schedule; false: GPipe
  std::size_t bucket_bytes = 1u << 20;  // DataParallel's buckets
  int zero_stage = 0;            // 0: AdamW over every parameter; 1, 2, 3: module 13's Zero (above)
};

// Makes the data rank's loader: `validation` false for training batches, true for held-out
// ones; the loader's config must be {seq_len, global batch, data_rank, data_ranks, any seed}.
// Read a step's training batch in step(): the speed test's training loaders refuse a batch
// before its step runs (TokenLoader::limit_steps).
using LoaderFactory = std::function<model::TokenLoader(bool validation, int data_rank, int data_ranks)>;

// The trainer of one rank. Every call is collective over the world: every rank makes it.
class GridTrainer {
 public:
  // Builds the grid over `world` (its size must be config.grid.total()), this rank's stage and
  // its parameters, initialised from config.train.seed so that each rank starts from exactly its
  // part of the weights one process would make, and the optimizer over them. `ops` computes:
  // every product and optimizer step of this rank goes through it, and the tests count them there
  // to see that the grid splits the work (k2c/model/work_counter.h).
  GridTrainer(dist::Communicator& world, model::Ops& ops, const CapstoneConfig& config, const LoaderFactory& data);
  ~GridTrainer();
  GridTrainer(const GridTrainer&) = delete;
  GridTrainer& operator=(const GridTrainer&) = delete;

  // One optimizer step: the pipeline schedule over this data rank's micro-batches, the gradients
  // reduced over their groups, clipped to config.train.clip by the norm of the whole model's
  // gradient, AdamW at cosine_lr. The record's loss (the mean over the global batch, without
  // the MoE balance term), grad_norm (before clipping) and lr are the same on every rank;
  // seconds, tokens_per_s (global tokens) are this rank's; mfu is left 0. Under ZeRO with clip 0,
  // grad_norm is -1.
  model::StepRecord step();
  // Mean loss per token over the first `batches` validation batches, on every rank.
  double evaluate(int batches);

  // The parameters as one process would hold them: model::Transformer's flat layout, on every
  // rank.
  std::vector<float> gather_values();

  // Checkpoints: each rank writes (reads) its part of the state (parameters, AdamW moments and
  // steps, the step count) to `path` on one rank, to path + ".rank<r>" on more. load throws
  // std::runtime_error for a missing or foreign file, or one written on another grid. Both throw
  // std::runtime_error under ZeRO (zero_stage > 0), before touching any file.
  void save(const std::filesystem::path& path);
  void load(const std::filesystem::path& path);

  int steps_done() const;
  // This rank's place in the grid, indexed by dist::Axis (k2c/dist/grid.h's layout).
  dist::GridCoords coords() const;
  model::MemoryLedger& ledger();

 private:
  struct Impl;  // yours: define it in capstone.cpp
  std::unique_ptr<Impl> impl_;
};

}  // namespace k2c::capstone
