// k2c/model/data.h — token data for Part II: shards on disk, a deterministic data-parallel
// loader, and the two seeded sources the shards are made from.
//
//   token shards     write_shard / read_shard: a 24-byte header, then uint16 tokens
//   TokenLoader      batch of step s = f(seed, s); rank r reads rows [r·B/dp, (r+1)·B/dp)
//   Markov source    MarkovSource, markov_entropy_rate: a chain whose loss floor is known exactly
//   grammar source   GrammarSource, decode, write_vocab / read_vocab: readable English sentences
//
// Everything here is CPU code with no dependency on the rest of the model library, so a test
// can make a few thousand tokens in a temp folder without running the generator program.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace k2c::model {

// ---------------------------------------------------------------------------------------------
// Token shards
//
// Layout, all little-endian:
//   offset  0  char[8]   magic "K2CTOKEN"
//   offset  8  uint32    version (1)
//   offset 12  uint32    vocab size V (1..65536): every token is < V
//   offset 16  uint64    token count N
//   offset 24  uint16[N] tokens
// uint16 halves the bytes of int32 and covers every vocabulary this course trains (a GPT-2
// tokenizer's 50257 included). The file must hold exactly N tokens: a short file is a truncated
// copy and a long one is not what the header describes, so both are errors.
// ---------------------------------------------------------------------------------------------

inline constexpr char kShardMagic[8] = {'K', '2', 'C', 'T', 'O', 'K', 'E', 'N'};
inline constexpr std::uint32_t kShardVersion = 1;
inline constexpr std::size_t kShardHeaderBytes = 24;
inline constexpr std::uint32_t kMaxVocab = 65536;  // what a uint16 token can name

struct TokenShard {
  std::uint32_t vocab = 0;
  std::vector<std::uint16_t> tokens;
};

// Both throw std::runtime_error whose message names the file and the problem: a vocab of 0 or
// above kMaxVocab, a token >= vocab (with its position), a file that cannot be opened or written,
// a wrong magic, an unsupported version, a truncated header or body, trailing bytes.
void write_shard(const std::filesystem::path& path, std::span<const std::uint16_t> tokens,
                 std::uint32_t vocab);
TokenShard read_shard(const std::filesystem::path& path);

// ---------------------------------------------------------------------------------------------
// TokenLoader
//
// Each global batch is B sequences of T + 1 consecutive tokens, whose start positions are drawn
// with a counter-based hash of (seed, step, row) — no generator state — so:
//   - step s's batch is the same whatever came before it: seek(s) resumes a run exactly;
//   - data-parallel rank r of dp returns rows [r·B/dp, (r+1)·B/dp) of the single-process batch,
//     so the union over ranks is the same data whatever the layout, and loss curves of different
//     parallel layouts can be compared step by step.
// Sampling is with replacement over every valid start, shards concatenated in the order given
// (a sequence may span the seam between two shards; both are streams of the same source).
// ---------------------------------------------------------------------------------------------

struct LoaderConfig {
  int seq_len = 0;       // T: tokens a model sees per sequence
  int global_batch = 0;  // B: sequences per step over all data-parallel ranks
  int dp_rank = 0;
  int dp_size = 1;
  std::uint64_t seed = 0;
};

// One rank's batch. inputs and targets are rows × seq_len, row-major, int32 (what embedding and
// cross-entropy kernels index with); targets[r][t] is the token that follows inputs[r][t].
struct TokenBatch {
  std::int64_t step = 0;
  int rows = 0;  // B / dp_size
  int seq_len = 0;
  std::vector<std::int32_t> inputs;
  std::vector<std::int32_t> targets;
};

class TokenLoader {
 public:
  // Reads every shard into memory (they must share one vocab). Shard problems throw
  // std::runtime_error (see read_shard); bad configurations throw std::invalid_argument:
  // seq_len < 1, global_batch < 1, dp_size < 1, dp_rank outside [0, dp_size), global_batch not
  // divisible by dp_size, fewer than seq_len + 1 tokens in all.
  TokenLoader(const std::vector<std::filesystem::path>& shards, const LoaderConfig& config);
  // The same over tokens already in memory (tests, or data made on the fly); every token < vocab.
  TokenLoader(std::vector<std::uint16_t> tokens, std::uint32_t vocab, const LoaderConfig& config);

  TokenBatch next();                             // batch_at(step()), then advances step()
  TokenBatch batch_at(std::int64_t step) const;  // any step, without moving the cursor
  std::int64_t step() const { return step_; }    // the step next() returns
  void seek(std::int64_t step);                  // next() returns this step (>= 0)

  // For timed tests: from now on, and in every copy made after, batch_at (and next) throw
  // std::invalid_argument for a step past *last, which the caller moves as it runs each step, so
  // code timed one step at a time cannot read batches ahead and train them off the clock. Once
  // set, the limit stays: a second call (or a null `last`) throws std::invalid_argument.
  void limit_steps(std::shared_ptr<const std::int64_t> last);

  const LoaderConfig& config() const { return config_; }
  int local_batch() const { return config_.global_batch / config_.dp_size; }
  std::uint32_t vocab() const { return vocab_; }
  std::size_t num_tokens() const { return tokens_.size(); }

 private:
  void validate() const;

  std::vector<std::uint16_t> tokens_;
  std::uint32_t vocab_ = 0;
  LoaderConfig config_;
  std::int64_t step_ = 0;
  std::shared_ptr<const std::int64_t> last_;  // limit_steps; empty: no limit
};

// ---------------------------------------------------------------------------------------------
// Markov source
//
// For a stationary first-order chain with transition matrix P and stationary distribution π,
// the entropy rate H = −Σ_i π_i Σ_j P_ij ln P_ij is the expected loss per token of the best
// possible predictor, which knows P. A model trained on the chain's tokens approaches H from
// above and, in expectation, never goes below it: the loss has an exact floor to be checked
// against (every target the loader makes has the token before it in its context).
// ---------------------------------------------------------------------------------------------

// Row-major and square: transition[i][j] = P(next token = j | current token = i).
using TransitionMatrix = std::vector<std::vector<double>>;

// π with π P = π, by power iteration in double precision. Throws std::invalid_argument for a
// matrix that is empty, not square, has a negative entry or a row not summing to 1 (within
// 1e-9). For a chain with several closed classes (not irreducible) it returns the stationary
// distribution reached from the uniform start.
std::vector<double> stationary_distribution(const TransitionMatrix& transition);
// H in nats per token (the unit of a cross-entropy loss with natural log).
double markov_entropy_rate(const TransitionMatrix& transition);

// A chain over `vocab` tokens where each row puts all its mass on `branching` distinct
// successors with random (Dirichlet(1)) weights, all drawn from the seed: entropy rate at most
// ln(branching), far below ln(vocab), so a small model learns it. One successor of token i is
// always i + 1 (mod vocab), so every token is reachable from every other and π is unique.
class MarkovSource {
 public:
  // vocab in [2, kMaxVocab], branching in [1, vocab]; std::invalid_argument otherwise.
  MarkovSource(std::uint64_t seed, int vocab, int branching);

  // The next n tokens of one long stationary run (its first token is drawn from π): calls
  // continue where the last one ended, so sample(a) then sample(b) is one stream of a + b tokens.
  std::vector<std::uint16_t> sample(std::size_t n);

  int vocab() const { return vocab_; }
  int branching() const { return branching_; }
  std::uint64_t seed() const { return seed_; }
  TransitionMatrix transition_matrix() const;  // dense, vocab² doubles
  const std::vector<double>& stationary() const { return stationary_; }
  double entropy_rate() const { return entropy_rate_; }

 private:
  struct Successor {
    std::uint16_t token;
    double probability;
    double cumulative;  // sum of probabilities up to and including this one
  };

  std::uint64_t seed_;
  int vocab_;
  int branching_;
  std::vector<std::vector<Successor>> rows_;  // sparse: branching entries per token
  std::vector<double> stationary_;
  double entropy_rate_ = 0.0;
  std::uint64_t position_ = 0;  // tokens sampled so far
  std::uint16_t current_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Grammar source
//
// Simple English sentences with a word-level vocabulary: "two lazy foxes chase an egg near the
// river ." followed by an end-of-sentence token. Subjects are animals or people, verbs agree with
// them in number, only transitive verbs take an object, and "a" becomes "an" before a vowel: a
// model has real structure to learn, and its samples can be read. Sentence i is a function of
// (seed, i) alone.
// ---------------------------------------------------------------------------------------------

inline constexpr std::uint16_t kEndOfSentence = 0;  // vocab word "<eos>"
inline constexpr std::uint16_t kPeriod = 1;         // vocab word "."

class GrammarSource {
 public:
  explicit GrammarSource(std::uint64_t seed);

  const std::vector<std::string>& vocab() const { return words_; }  // token i = words_[i]
  std::vector<std::uint16_t> sentence(std::uint64_t index) const;   // ends with ".", "<eos>"
  // The next n sentences, concatenated: calls continue where the last one ended.
  std::vector<std::uint16_t> sample(std::size_t sentences);

 private:
  std::uint16_t word(const std::string& w);  // the token of w, added to the vocab if new

  std::uint64_t seed_;
  std::uint64_t next_sentence_ = 0;
  std::vector<std::string> words_;
  // Word classes, as tokens. Nouns and verbs come as {singular, plural} pairs; a verb's
  // "singular" is its third-person form ("runs"), its "plural" the base form ("run").
  struct Pair {
    std::uint16_t singular, plural;
  };
  std::vector<std::uint16_t> det_singular_, det_plural_, adjectives_, prepositions_, adverbs_;
  std::vector<Pair> animals_, things_, places_, verbs_intransitive_, verbs_transitive_;
  std::uint16_t and_ = 0, a_ = 0, an_ = 0;
};

// Text for tokens: words joined by spaces, except that "." attaches to the word before it and
// "<eos>" ends the line. Throws std::invalid_argument for a token outside the vocab.
std::string decode(std::span<const std::uint16_t> tokens, const std::vector<std::string>& vocab);
std::string decode(std::span<const std::int32_t> tokens, const std::vector<std::string>& vocab);
// A sampled continuation as one line: the prompt, " | ", then what the model wrote. With a
// vocabulary, as words (decode), where an id past its end, which a model whose vocabulary is
// larger than its data's may sample, is written <id>; without one (vocab empty), as ids.
std::string sample_text(std::span<const std::int32_t> prompt, std::span<const std::int32_t> continuation,
                        const std::vector<std::string>& vocab);

// One word per line, line i = token i. Throw std::runtime_error naming the file on I/O errors
// (and, on write, for a word that is empty or holds a line break).
void write_vocab(const std::filesystem::path& path, const std::vector<std::string>& words);
std::vector<std::string> read_vocab(const std::filesystem::path& path);

// The one shard of `kind` ("train" or "val": a file *_<kind>.bin) in a k2c_datagen folder, for the
// trainers' --data. Throws std::invalid_argument naming the folder when it is not one or holds no
// such shard (the way out: `make data`).
std::filesystem::path shard_in(const std::filesystem::path& dir, const std::string& kind);

}  // namespace k2c::model
