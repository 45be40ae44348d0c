// train.cpp — k2c_train: train the course's decoder-only transformer in one process.
//
//   k2c_train --data datasets/markov [--config tiny|FILE] [--steps N] [--batch B] [--lr X]
//             [--seed S] [--log run.csv [--plot loss.png]] [--checkpoint ckpt.bin [--resume]] [--samples N]
//             [--dropout P] [--checkpoint-activations] [--set key=value ...]
//
// --data names a folder written by k2c_datagen (`make data`): its *_train.bin and *_val.bin
// shards, and *_vocab.txt when the data is words, so the samples at the end can be read. A
// config FILE holds `key = value` lines with the same keys as --set (d_model, n_layers, q_heads,
// kv_heads, d_ff, seq_len, vocab, rope_theta, tied_head, experts, top_k, shared_experts, d_expert,
// steps, batch, lr, min_lr, warmup, clip (0: none), weight_decay, dropout, seed, eval_every,
// eval_batches, checkpoint_every);
// `#` starts a comment.
//
// The CPU backend trains the tiny configuration in seconds to minutes. Plot the log with
// tools/plot_loss.py (several logs overlay on one figure).
//
// Exit status: 0 after training, 2 for bad arguments or data that does not fit, 1 otherwise.
#include <CLI/CLI.hpp>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>

#include "k2c/model/data.h"
#include "k2c/model/train.h"
#if K2C_MODEL_CUDA
#include "k2c/model/cuda_ops.h"
#endif

namespace fs = std::filesystem;
using namespace k2c::model;

namespace {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One `key = value` setting applied to the run's configuration.
void apply(TrainConfig& c, const std::string& key, const std::string& value) {
  auto number = [&]() {
    std::size_t used = 0;
    double v = 0;
    try {
      v = std::stod(value, &used);
    } catch (...) {
      used = 0;
    }
    if (used == 0 || used != value.size()) throw UsageError("setting " + key + ": '" + value + "' is not a number");
    return v;
  };
  auto integer = [&]() { return static_cast<int>(number()); };
  ModelConfig& m = c.model;
  const std::map<std::string, std::function<void()>> keys = {
      {"vocab", [&] { m.vocab = integer(); }},         {"d_model", [&] { m.d_model = integer(); }},
      {"n_layers", [&] { m.n_layers = integer(); }},   {"q_heads", [&] { m.q_heads = integer(); }},
      {"kv_heads", [&] { m.kv_heads = integer(); }},   {"d_ff", [&] { m.d_ff = integer(); }},
      {"seq_len", [&] { m.seq_len = integer(); }},     {"rope_theta", [&] { m.rope_theta = static_cast<float>(number()); }},
      {"tied_head", [&] { m.tied_head = integer() != 0; }},
      {"experts", [&] { m.experts = integer(); }},     {"top_k", [&] { m.top_k = integer(); }},
      {"shared_experts", [&] { m.shared_experts = integer(); }}, {"d_expert", [&] { m.d_expert = integer(); }},
      {"steps", [&] { c.steps = integer(); }},         {"batch", [&] { c.batch = integer(); }},
      {"lr", [&] { c.lr = static_cast<float>(number()); }},
      {"min_lr", [&] { c.min_lr = static_cast<float>(number()); }},
      {"warmup", [&] { c.warmup = integer(); }},       {"clip", [&] { c.clip = static_cast<float>(number()); }},
      {"weight_decay", [&] { c.adamw.weight_decay = static_cast<float>(number()); }},
      {"dropout", [&] { c.dropout = static_cast<float>(number()); }},
      {"seed", [&] { c.seed = static_cast<std::uint64_t>(number()); }},
      {"eval_every", [&] { c.eval_every = integer(); }}, {"eval_batches", [&] { c.eval_batches = integer(); }},
      {"checkpoint_every", [&] { c.checkpoint_every = integer(); }},
  };
  const auto it = keys.find(key);
  if (it == keys.end()) throw UsageError("unknown setting '" + key + "'");
  it->second();
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

void apply_line(TrainConfig& c, const std::string& line, const std::string& where) {
  const std::string text = trim(line.substr(0, line.find('#')));
  if (text.empty()) return;
  const auto eq = text.find('=');
  if (eq == std::string::npos) throw UsageError(where + ": expected key = value, got '" + text + "'");
  try {
    apply(c, trim(text.substr(0, eq)), trim(text.substr(eq + 1)));
  } catch (const UsageError& e) {
    throw UsageError(where + ": " + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"k2c_train — train the course's transformer in one process"};
  std::string data_dir, config_name = "tiny", backend = "cpu", log_path, checkpoint, plot_path;
  std::vector<std::string> settings;
  int steps = -1, batch = -1, samples = 3;
  double lr = -1;
  std::uint64_t seed = 0;
  bool resume = false, checkpoint_activations = false;
  float dropout = -1;
  app.add_option("--data", data_dir, "folder of token shards from k2c_datagen (make data)")->required();
  app.add_option("--config", config_name, "tiny, or a file of key = value lines");
  app.add_option("--set", settings, "key=value, applied after the config (repeatable)");
  app.add_option("--steps", steps, "optimizer steps");
  app.add_option("--batch", batch, "sequences per step");
  app.add_option("--lr", lr, "peak learning rate");
  auto* seed_opt = app.add_option("--seed", seed, "initialisation, data order and dropout seed");
  app.add_option("--dropout", dropout, "residual dropout probability");
  app.add_flag("--checkpoint-activations", checkpoint_activations, "recompute each block's forward in backward");
  app.add_option("--backend", backend, "cpu, or gpu (first version: fp32, plain kernels)")->check(CLI::IsMember({"cpu", "gpu"}));
  app.add_option("--log", log_path, "CSV log, one row per step");
  app.add_option("--plot", plot_path, "draw the loss curve into this PNG at the end (needs --log and matplotlib)");
  app.add_option("--checkpoint", checkpoint, "checkpoint file, written at the end (and every --set checkpoint_every)");
  app.add_flag("--resume", resume, "continue from --checkpoint");
  app.add_option("--samples", samples, "sampled continuations printed at the end");
  CLI11_PARSE(app, argc, argv);

  try {
    TrainConfig c;
    c.eval_every = 50;
    if (config_name != "tiny") {
      std::ifstream f(config_name);
      if (!f) throw UsageError("--config " + config_name + ": no such preset or file (presets: tiny)");
      std::string line;
      for (int n = 1; std::getline(f, line); ++n) apply_line(c, line, config_name + ":" + std::to_string(n));
    }
    for (const std::string& s : settings) apply_line(c, s, "--set " + s);
    if (steps >= 0) c.steps = steps;
    if (batch > 0) c.batch = batch;
    if (lr > 0) c.lr = static_cast<float>(lr);
    if (*seed_opt) c.seed = seed;
    if (dropout >= 0) c.dropout = dropout;
    c.checkpoint_activations = checkpoint_activations;
    c.log_path = log_path;
    c.checkpoint_path = checkpoint;
    if (resume && checkpoint.empty()) throw UsageError("--resume needs --checkpoint FILE");
    if (!plot_path.empty() && log_path.empty()) throw UsageError("--plot needs --log FILE (the curve is drawn from it)");
#if K2C_MODEL_CUDA
    if (backend == "gpu" && !cuda_device_present()) throw UsageError("--backend gpu: no CUDA device is visible");
    Ops& ops = backend == "gpu" ? cuda_ops() : cpu_ops();
#else
    if (backend == "gpu") throw UsageError("--backend gpu: this build has no CUDA toolkit (the CPU backend only)");
    Ops& ops = cpu_ops();
#endif

    const fs::path dir = data_dir;
    const fs::path train_shard = shard_in(dir, "train"), val_shard = shard_in(dir, "val");
    std::vector<std::string> vocab;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().ends_with("_vocab.txt")) vocab = read_vocab(e.path());
    const TokenShard probe = read_shard(train_shard);
    if (probe.vocab > static_cast<std::uint32_t>(c.model.vocab)) {
      std::cout << "model vocab " << c.model.vocab << " -> " << probe.vocab << " (the data's)\n";
      c.model.vocab = static_cast<int>(probe.vocab);
    }
    c.model.check();
    TokenLoader train({train_shard}, {c.model.seq_len, c.batch, 0, 1, c.seed});
    TokenLoader val({val_shard}, {c.model.seq_len, c.batch, 0, 1, c.seed + 1});
    Trainer trainer(c, ops, std::move(train), std::move(val));
    if (resume) {
      trainer.load(checkpoint);
      std::cout << "resumed from " << checkpoint << " at step " << trainer.steps_done() << "\n";
    }
    trainer.run(std::cout, 10);
    std::cout << "memory (peak over the run):\n" << trainer.ledger().report();
    if (!log_path.empty()) std::cout << "log: " << log_path << "  (plot: python3 tools/plot_loss.py " << log_path << ")\n";
    if (!plot_path.empty()) {
      // The course's plotting script, with the data's loss floor when the data has one.
      // A python3 with matplotlib: the first on PATH, else the system's (as the Makefile does).
      std::string cmd = "py=python3; $py -c 'import matplotlib' 2>/dev/null || py=/usr/bin/python3; $py '" K2C_SOURCE_DIR
                        "/tools/plot_loss.py' '" + log_path + "' --png '" + plot_path + "'";
      for (const auto& e : fs::directory_iterator(dir))
        if (e.path().filename() == "markov.json") cmd += " --floor '" + e.path().string() + "'";
      if (std::system(cmd.c_str()) != 0) std::cout << "plot: not drawn (tools/plot_loss.py needs python3 with matplotlib)\n";
    }
    if (!checkpoint.empty()) std::cout << "checkpoint: " << checkpoint << "\n";
    for (int i = 0; i < samples; ++i) {
      const TokenBatch b = TokenLoader({val_shard}, {c.model.seq_len, 1, 0, 1, c.seed + 100 + i}).next();
      const std::vector<std::int32_t> prompt(b.inputs.begin(), b.inputs.begin() + std::min(8, c.model.seq_len));
      const auto out = trainer.sample(prompt, 2 * c.model.seq_len, 0.8f, c.seed + i);
      std::cout << "sample " << i + 1 << ": "
                << sample_text(prompt, std::span<const std::int32_t>(out).subspan(prompt.size()), vocab) << "\n";
    }
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "k2c_train: " << e.what() << "\n";
    return 2;
  } catch (const std::invalid_argument& e) {
    std::cerr << "k2c_train: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "k2c_train: " << e.what() << "\n";
    return 1;
  }
}
