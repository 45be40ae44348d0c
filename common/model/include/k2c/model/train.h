// k2c/model/train.h — a single-process training loop over the model library.
//
// What `k2c_train` runs and what the tests train with: AdamW with a cosine schedule and
// gradient clipping over batches from a TokenLoader, an evaluation on held-out data now and
// then, a progress line, a CSV log, checkpoints that a run resumes from (bit-exact on the CPU
// backend: the loader is stateless per step, so a resumed run sees the same batches), and a few
// sampled continuations at the end. The distributed modules build their own loops from the same
// parts; this one is the single-process baseline their loss curves are compared with.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "k2c/model/data.h"
#include "k2c/model/optim.h"
#include "k2c/model/transformer.h"

namespace k2c::model {

struct TrainConfig {
  ModelConfig model = ModelConfig::tiny();
  int steps = 100, batch = 8;           // sequences per step
  float lr = 3e-3f, min_lr = 3e-4f;
  int warmup = 10;
  float clip = 1.0f;
  AdamWConfig adamw{};
  float dropout = 0.0f;
  bool checkpoint_activations = false;
  DType activations = DType::f32;         // between a layer's operations (Context::activations)
  DType residual = DType::f32;            // the residual stream (Context::residual); bf16 needs dropout 0
  std::uint64_t seed = 1;
  int eval_every = 50, eval_batches = 8;  // eval_every 0: only at the end
  int checkpoint_every = 0;               // 0: only at the end (when a path is set)
  std::filesystem::path checkpoint_path;  // empty: no checkpoints
  std::filesystem::path log_path;         // CSV, one row per step (and per evaluation)
  double peak_flops = 0;                  // the backend's peak for MFU; 0: MFU not shown
};

struct StepRecord {
  int step = 0;
  double loss = 0, val_loss = -1, lr = 0, grad_norm = 0, tokens_per_s = 0, mfu = 0, seconds = 0;
};

class Trainer {
 public:
  // train and val give the batches (their seq_len must equal the model's, their global batch
  // config.batch). The parameters are initialised from config.seed.
  Trainer(const TrainConfig& config, Ops& ops, TokenLoader train, TokenLoader val);
  // Its members refer to each other (the context to the ledger and parameters): it stays put.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Loads a checkpoint written by save(): parameters, optimizer state and the step count.
  // Throws std::runtime_error naming the file for a missing, truncated or foreign file, or one
  // written for another model shape.
  void load(const std::filesystem::path& path);
  void save(const std::filesystem::path& path) const;

  // Trains up to config.steps (from where a loaded checkpoint left off), printing a progress
  // line to `out` every `print_every` steps. Returns every step's record.
  std::vector<StepRecord> run(std::ostream& out, int print_every = 10);
  // One optimizer step (forward, backward, clip, AdamW); returns its record.
  StepRecord step();
  // Mean loss per token over `batches` validation batches (the same ones every time).
  double evaluate(int batches);
  // Continues `prompt` by `tokens` tokens sampled at `temperature` (0: greedy), from `seed`.
  std::vector<std::int32_t> sample(std::vector<std::int32_t> prompt, int tokens, float temperature,
                                   std::uint64_t seed);

  int steps_done() const { return step_; }
  ParamList& params() { return params_; }
  MemoryLedger& ledger() { return ledger_; }
  const Transformer& model() const { return *model_; }

 private:
  TrainConfig config_;
  Ops& ops_;
  TokenLoader train_, val_;
  MemoryLedger ledger_;
  ParamList params_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<AdamW> optimizer_;
  Context ctx_;
  int step_ = 0;
};

}  // namespace k2c::model
