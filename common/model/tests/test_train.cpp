// test_train.cpp — the single-process trainer: it learns (a tiny model on Markov data reaches the
// chain's entropy floor), it resumes bit-exactly from a checkpoint, and it refuses checkpoints
// and data that do not fit the model.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include <gtest/gtest.h>

#include "k2c/model/train.h"

namespace k2c::model {
namespace {

namespace fs = std::filesystem;

TrainConfig markov_config() {
  TrainConfig c;
  c.model.vocab = 32, c.model.d_model = 32, c.model.n_layers = 1, c.model.q_heads = 2, c.model.kv_heads = 1;
  c.model.d_ff = 64, c.model.seq_len = 16;
  c.batch = 16, c.steps = 300, c.lr = 1e-2f, c.min_lr = 1e-3f, c.warmup = 10;
  c.adamw.weight_decay = 0.0f;
  c.eval_every = 0, c.eval_batches = 32;
  return c;
}

TokenLoader loader_over(MarkovSource& source, std::size_t n, const TrainConfig& c, std::uint64_t seed) {
  return TokenLoader(source.sample(n), static_cast<std::uint32_t>(source.vocab()),
                     {c.model.seq_len, c.batch, 0, 1, seed});
}

// The chain's own loss on exactly the validation tokens the model is evaluated on: the floor
// for that sample, free of the sampling noise a comparison with the entropy rate would carry.
double floor_on(const TokenLoader& val, const MarkovSource& source, int batches) {
  const TransitionMatrix P = source.transition_matrix();
  double total = 0, n = 0;
  for (int i = 0; i < batches; ++i) {
    const TokenBatch b = val.batch_at(i);
    for (std::size_t t = 0; t < b.targets.size(); ++t, ++n) total -= std::log(P[b.inputs[t]][b.targets[t]]);
  }
  return total / n;
}

// Also with the activations stored in bf16, and then the residual stream too: rounding them must
// not keep the model off the floor.
TEST(Train, TinyModelReachesTheMarkovEntropyFloor) {
  for (const auto& [activations, residual] : {std::pair{DType::f32, DType::f32}, std::pair{DType::bf16, DType::f32},
                                              std::pair{DType::bf16, DType::bf16}}) {
    SCOPED_TRACE("activations " + to_string(activations) + ", residual stream " + to_string(residual));
    TrainConfig c = markov_config();
    c.activations = activations;
    c.residual = residual;
    MarkovSource source(11, c.model.vocab, 4);
    TokenLoader train = loader_over(source, 200000, c, 1), val = loader_over(source, 50000, c, 2);
    const double floor = floor_on(val, source, c.eval_batches);
    Trainer trainer(c, cpu_ops(), std::move(train), std::move(val));
    const double before = trainer.evaluate(c.eval_batches);
    std::ostringstream progress;
    trainer.run(progress, 50);
    const double after = trainer.evaluate(c.eval_batches);
    std::printf("entropy rate %.4f nats, floor on the validation tokens %.4f, loss %.4f -> %.6f\n",
                source.entropy_rate(), floor, before, after);
    EXPECT_NEAR(before, std::log(c.model.vocab), 0.1) << "an untrained model predicts about uniformly";
    EXPECT_LT(after - floor, 0.05) << progress.str();
    EXPECT_GT(after - floor, -0.02) << "no model beats the chain that made the data";
    EXPECT_NE(progress.str().find("step"), std::string::npos);
  }
}

TEST(Train, ResumeFromACheckpointIsBitExact) {
  TrainConfig c = markov_config();
  c.steps = 12, c.model.n_layers = 2, c.dropout = 0.1f;
  const fs::path dir = fs::path(::testing::TempDir()) / "k2c_train_resume";
  fs::create_directories(dir);
  MarkovSource source(3, c.model.vocab, 4);
  const std::vector<std::uint16_t> tokens = source.sample(20000);
  auto make = [&](const TrainConfig& cfg) {
    return Trainer(cfg, cpu_ops(), TokenLoader(tokens, 32, {cfg.model.seq_len, cfg.batch, 0, 1, 5}),
                   TokenLoader(tokens, 32, {cfg.model.seq_len, cfg.batch, 0, 1, 6}));
  };
  std::ostringstream sink;
  // One run of 12 steps, against 7 steps, a checkpoint, and a new process-like trainer that
  // loads it and runs the other 5.
  Trainer whole = make(c);
  whole.run(sink, 0);
  TrainConfig first = c;
  first.checkpoint_path = dir / "ckpt.bin";
  Trainer a = make(first);
  for (int i = 0; i < 7; ++i) a.step();
  a.save(first.checkpoint_path);
  Trainer b = make(c);
  b.load(first.checkpoint_path);
  EXPECT_EQ(b.steps_done(), 7);
  b.run(sink, 0);
  Tensor &x = whole.params().flat_values(), &y = b.params().flat_values();
  ASSERT_EQ(x.bytes(), y.bytes());
  EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.bytes()), 0) << "the resumed run drifted from the whole run";

  // A checkpoint of another model shape, a truncated one and a foreign file are refused by name.
  TrainConfig other = c;
  other.model.d_model = 16;
  Trainer wrong = make(other);
  EXPECT_THROW(
      try { wrong.load(first.checkpoint_path); } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("another model"), std::string::npos) << e.what();
        throw;
      },
      std::runtime_error);
  fs::resize_file(first.checkpoint_path, fs::file_size(first.checkpoint_path) - 4);
  EXPECT_THROW(b.load(first.checkpoint_path), std::runtime_error);
  std::ofstream(dir / "junk.bin") << "not a checkpoint at all, but long enough to read a header from.....";
  EXPECT_THROW(b.load(dir / "junk.bin"), std::runtime_error);
  EXPECT_THROW(b.load(dir / "missing.bin"), std::runtime_error);
}

TEST(Train, DataThatDoesNotFitTheModelIsRefused) {
  TrainConfig c = markov_config();
  MarkovSource source(3, 64, 4);  // 64 tokens, the model has 32
  const std::vector<std::uint16_t> tokens = source.sample(5000);
  EXPECT_THROW(Trainer(c, cpu_ops(), TokenLoader(tokens, 64, {c.model.seq_len, c.batch, 0, 1, 1}),
                       TokenLoader(tokens, 64, {c.model.seq_len, c.batch, 0, 1, 2})),
               std::invalid_argument);
  EXPECT_THROW(Trainer(c, cpu_ops(), TokenLoader(tokens, 64, {c.model.seq_len + 1, c.batch, 0, 1, 1}),
                       TokenLoader(tokens, 64, {c.model.seq_len, c.batch, 0, 1, 2})),
               std::invalid_argument);
}

// A residual stream the run cannot keep: not a float type, or bf16 under dropout (fp32 only).
TEST(Train, AResidualStreamItCannotKeepIsRefused) {
  MarkovSource source(3, 32, 4);
  const std::vector<std::uint16_t> tokens = source.sample(5000);
  for (const auto& [residual, dropout] : {std::pair{DType::i32, 0.0f}, std::pair{DType::bf16, 0.1f}}) {
    TrainConfig c = markov_config();
    c.residual = residual, c.dropout = dropout;
    EXPECT_THROW(Trainer(c, cpu_ops(), TokenLoader(tokens, 32, {c.model.seq_len, c.batch, 0, 1, 1}),
                         TokenLoader(tokens, 32, {c.model.seq_len, c.batch, 0, 1, 2})),
                 std::invalid_argument)
        << to_string(residual) << " with dropout " << dropout;
  }
}

TEST(Train, SamplingIsDeterministicAndStaysInTheVocab) {
  TrainConfig c = markov_config();
  c.steps = 5;
  MarkovSource source(3, 32, 4);
  const std::vector<std::uint16_t> tokens = source.sample(5000);
  Trainer t(c, cpu_ops(), TokenLoader(tokens, 32, {c.model.seq_len, c.batch, 0, 1, 1}),
            TokenLoader(tokens, 32, {c.model.seq_len, c.batch, 0, 1, 2}));
  std::ostringstream sink;
  t.run(sink, 0);
  const auto a = t.sample({1, 2, 3}, 40, 1.0f, 7), b = t.sample({1, 2, 3}, 40, 1.0f, 7);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 43u);
  for (std::int32_t x : a) EXPECT_TRUE(x >= 0 && x < 32);
  EXPECT_THROW(t.sample({}, 3, 1.0f, 1), std::invalid_argument);
}

}  // namespace
}  // namespace k2c::model
