// datagen.cpp — k2c_datagen: the token shards of Part II, written from a seed.
//
//   k2c_datagen markov  --vocab V --tokens N --seed S --out DIR [--branching K] [--order 1]
//                       [--val-fraction F]
//       DIR/markov_train.bin, DIR/markov_val.bin, and DIR/markov.json with the chain's exact
//       entropy rate: the lowest loss per token any model can reach on this data.
//   k2c_datagen grammar --sentences N --seed S --out DIR [--val-fraction F]
//       DIR/grammar_train.bin, DIR/grammar_val.bin, DIR/grammar_vocab.txt (line i = token i).
//
// The last F of the tokens (or sentences) go to the validation shard: for the Markov source they
// continue the same stationary run as the training tokens, so both have the same loss floor.
// The sources live in k2c_model (k2c/model/data.h); this program only chooses sizes, reports
// progress and writes files. `make data` runs it with the course's sizes and seeds.
//
// Exit status: 0 when everything was written, 2 for bad arguments, 1 for other failures (an
// output folder that cannot be written).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "k2c/model/data.h"

namespace fs = std::filesystem;
using namespace k2c::model;

namespace {

// Bad arguments that CLI11's own checks cannot see (they relate two options).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A line on stderr at most once a second while work goes on, so only runs long enough to wait on
// print any (the course's sizes take well under a second); lines rather than a carriage-return
// bar, so a log of `make data` stays readable. The summary line reports completion.
class Progress {
 public:
  Progress(std::string what, std::uint64_t total, std::string unit)
      : what_(std::move(what)), total_(total), unit_(std::move(unit)) {}
  void advance(std::uint64_t n) {
    done_ += n;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::seconds(1) || done_ == total_) return;
    last_ = now;
    std::cerr << what_ << ": " << done_ * 100 / total_ << "% (" << done_ << " / " << total_ << " "
              << unit_ << ")\n";
  }

 private:
  std::string what_;
  std::uint64_t total_, done_ = 0;
  std::string unit_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// Splits a count into training and validation parts, each non-empty.
std::pair<std::uint64_t, std::uint64_t> split(std::uint64_t total, double val_fraction,
                                              const std::string& unit) {
  const auto val =
      static_cast<std::uint64_t>(std::llround(static_cast<double>(total) * val_fraction));
  if (val == 0 || val >= total) {
    std::ostringstream os;
    os << total << " " << unit << " with --val-fraction " << val_fraction
       << " leave an empty training or validation shard";
    throw UsageError(os.str());
  }
  return {total - val, val};
}

void write_json(const fs::path& path, const nlohmann::json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

struct MarkovArgs {
  int vocab = 256;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 0;
  std::string out;
  int order = 1;
  int branching = 8;
  double val_fraction = 0.1;
};

int run_markov(const MarkovArgs& a) {
  if (a.order != 1)
    throw UsageError("--order " + std::to_string(a.order) +
                     ": only first-order chains are implemented");
  if (a.branching > a.vocab)
    throw UsageError("--branching " + std::to_string(a.branching) + " is larger than --vocab " +
                     std::to_string(a.vocab));
  // Drawn in blocks so that progress can be reported between them.
  constexpr std::uint64_t kBlock = 1 << 18;
  const auto [train_tokens, val_tokens] = split(a.tokens, a.val_fraction, "tokens");
  const fs::path dir = a.out;
  fs::create_directories(dir);

  MarkovSource source(a.seed, a.vocab, a.branching);
  Progress progress("markov", a.tokens, "tokens");
  auto sample = [&](std::uint64_t n) {
    std::vector<std::uint16_t> tokens;
    tokens.reserve(n);
    for (std::uint64_t done = 0; done < n;) {
      const std::uint64_t block = std::min(kBlock, n - done);
      const std::vector<std::uint16_t> part = source.sample(block);
      tokens.insert(tokens.end(), part.begin(), part.end());
      done += block;
      progress.advance(block);
    }
    return tokens;
  };
  const fs::path train = dir / "markov_train.bin", val = dir / "markov_val.bin";
  write_shard(train, sample(train_tokens), static_cast<std::uint32_t>(a.vocab));
  write_shard(val, sample(val_tokens), static_cast<std::uint32_t>(a.vocab));

  const double h = source.entropy_rate();
  write_json(dir / "markov.json", {{"source", "markov"},
                                   {"order", a.order},
                                   {"vocab", a.vocab},
                                   {"branching", a.branching},
                                   {"seed", a.seed},
                                   {"train", train.filename().string()},
                                   {"train_tokens", train_tokens},
                                   {"val", val.filename().string()},
                                   {"val_tokens", val_tokens},
                                   {"entropy_rate_nats", h},
                                   {"entropy_rate_bits", h / std::log(2.0)},
                                   {"uniform_nats", std::log(static_cast<double>(a.vocab))}});
  std::cout << "markov: wrote " << train.string() << " (" << train_tokens << " tokens), "
            << val.string() << " (" << val_tokens << "), " << (dir / "markov.json").string()
            << " (entropy rate " << h << " nats/token; uniform " << std::log(a.vocab) << ")\n";
  return 0;
}

struct GrammarArgs {
  std::uint64_t sentences = 0;
  std::uint64_t seed = 0;
  std::string out;
  double val_fraction = 0.1;
};

int run_grammar(const GrammarArgs& a) {
  constexpr std::uint64_t kBlock = 1 << 16;  // sentences per progress report
  const auto [train_sentences, val_sentences] = split(a.sentences, a.val_fraction, "sentences");
  const fs::path dir = a.out;
  fs::create_directories(dir);

  GrammarSource source(a.seed);
  Progress progress("grammar", a.sentences, "sentences");
  auto sample = [&](std::uint64_t n) {
    std::vector<std::uint16_t> tokens;
    for (std::uint64_t done = 0; done < n;) {
      const std::uint64_t block = std::min(kBlock, n - done);
      const std::vector<std::uint16_t> part = source.sample(block);
      tokens.insert(tokens.end(), part.begin(), part.end());
      done += block;
      progress.advance(block);
    }
    return tokens;
  };
  const auto vocab = static_cast<std::uint32_t>(source.vocab().size());
  const fs::path train = dir / "grammar_train.bin", val = dir / "grammar_val.bin",
                 words = dir / "grammar_vocab.txt";
  const std::vector<std::uint16_t> train_tokens = sample(train_sentences);
  write_shard(train, train_tokens, vocab);
  const std::vector<std::uint16_t> val_tokens = sample(val_sentences);
  write_shard(val, val_tokens, vocab);
  write_vocab(words, source.vocab());
  std::cout << "grammar: wrote " << train.string() << " (" << train_sentences << " sentences, "
            << train_tokens.size() << " tokens), " << val.string() << " (" << val_sentences << ", "
            << val_tokens.size() << "), " << words.string() << " (" << vocab << " words)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("k2c_datagen: token shards for Part II (Markov source, grammar of sentences)");
  app.require_subcommand(1);

  MarkovArgs markov;
  auto* markov_cmd =
      app.add_subcommand("markov", "a first-order Markov chain with a known entropy rate");
  markov_cmd->add_option("--vocab", markov.vocab, "vocabulary size")
      ->check(CLI::Range(2, 65536))
      ->capture_default_str();
  markov_cmd->add_option("--tokens", markov.tokens, "tokens in all (training + validation)")
      ->required();
  markov_cmd->add_option("--seed", markov.seed, "seed of the chain and the sample")->required();
  markov_cmd->add_option("--out", markov.out, "output folder")->required();
  markov_cmd->add_option("--order", markov.order, "order of the chain (1)")->capture_default_str();
  markov_cmd->add_option("--branching", markov.branching, "successors per token")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  markov_cmd
      ->add_option("--val-fraction", markov.val_fraction,
                   "share of the tokens in the validation shard")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();

  GrammarArgs grammar;
  auto* grammar_cmd =
      app.add_subcommand("grammar", "simple English sentences, word-level vocabulary");
  grammar_cmd
      ->add_option("--sentences", grammar.sentences, "sentences in all (training + validation)")
      ->required();
  grammar_cmd->add_option("--seed", grammar.seed, "seed of the sentences")->required();
  grammar_cmd->add_option("--out", grammar.out, "output folder")->required();
  grammar_cmd
      ->add_option("--val-fraction", grammar.val_fraction,
                   "share of the sentences in the validation shard")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // app.exit prints the message (or the help, whose code is 0); every real error is a usage
    // error here, so it is reported as 2 whatever CLI11's own code for it is.
    return app.exit(e) == 0 ? 0 : 2;
  }

  try {
    return *markov_cmd ? run_markov(markov) : run_grammar(grammar);
  } catch (const UsageError& e) {
    std::cerr << "k2c_datagen: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "k2c_datagen: " << e.what() << "\n";
    return 1;
  }
}
