// data.cpp — token shards, the loader, and the Markov and grammar sources (k2c/model/data.h).
//
// Every random choice here is a counter-based draw: a hash of (seed, stream, a, b) with the
// splitmix64 mixer of k2c/core/random.h. Nothing carries generator state from one draw to the next,
// so a batch, a transition row or a sentence depends only on its own coordinates, and the same
// seed gives the same data on every machine and standard library (std::*_distribution does not
// promise that).
#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "k2c/core/check.h"
#include "k2c/core/random.h"
#include "k2c/model/data.h"

namespace k2c::model {

namespace fs = std::filesystem;

namespace {

// One stream per use, so e.g. the loader's draws never line up with the sampler's for one seed.
enum class Stream : std::uint64_t {
  loader = 1,
  markov_successors = 2,
  markov_weights = 3,
  markov_sample = 4,
  grammar = 5,
};

std::uint64_t draw(std::uint64_t seed, Stream stream, std::uint64_t a, std::uint64_t b) {
  return mix64(mix64(mix64(mix64(seed) + static_cast<std::uint64_t>(stream)) + a) + b);
}

// Uniform in [0, 1) from the top 53 bits: every value is an exact double, and 1 is never drawn.
double unit(std::uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// ---------------------------------------------------------------------------------------------
// Shards: little-endian bytes on every host
// ---------------------------------------------------------------------------------------------

[[noreturn]] void shard_error(const fs::path& path, const std::string& problem) {
  throw std::runtime_error("token shard " + path.string() + ": " + problem);
}

void put_le(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

std::uint64_t get_le(const char* in, int bytes) {
  std::uint64_t value = 0;
  for (int i = 0; i < bytes; ++i)
    value |= static_cast<std::uint64_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  return value;
}

// Tokens go to and from disk as one block; only a big-endian host pays for swapping bytes.
void swap_if_big_endian(std::span<std::uint16_t> tokens) {
  if constexpr (std::endian::native == std::endian::big)
    for (std::uint16_t& t : tokens) t = static_cast<std::uint16_t>((t >> 8) | (t << 8));
}

void check_tokens(const fs::path& path, std::span<const std::uint16_t> tokens,
                  std::uint32_t vocab) {
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= vocab)
      shard_error(path, "token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                            " is >= vocab size " + std::to_string(vocab));
}

}  // namespace

void write_shard(const fs::path& path, std::span<const std::uint16_t> tokens, std::uint32_t vocab) {
  if (vocab == 0 || vocab > kMaxVocab)
    shard_error(path, "vocab size " + std::to_string(vocab) + " is not in [1, " +
                          std::to_string(kMaxVocab) + "] (tokens are uint16)");
  check_tokens(path, tokens, vocab);

  std::string header(kShardMagic, sizeof kShardMagic);
  put_le(header, kShardVersion, 4);
  put_le(header, vocab, 4);
  put_le(header, tokens.size(), 8);

  std::vector<std::uint16_t> body(tokens.begin(), tokens.end());
  swap_if_big_endian(body);

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    shard_error(path, std::string("cannot open for writing (") + std::strerror(errno) + ")");
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(body.data()),
            static_cast<std::streamsize>(body.size() * sizeof(std::uint16_t)));
  out.close();
  if (!out) shard_error(path, "write failed (disk full?)");
}

TokenShard read_shard(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) shard_error(path, "no such file");
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) shard_error(path, "cannot read its size (" + ec.message() + ")");
  std::ifstream in(path, std::ios::binary);
  if (!in) shard_error(path, std::string("cannot open (") + std::strerror(errno) + ")");

  char header[kShardHeaderBytes] = {};
  in.read(header, static_cast<std::streamsize>(std::min<std::uintmax_t>(size, sizeof header)));
  // The magic is checked before the header's length, so any file that is not a shard (a text
  // file, a checkpoint passed by mistake) is reported as that, however short it is.
  if (size < sizeof kShardMagic || std::memcmp(header, kShardMagic, sizeof kShardMagic) != 0)
    shard_error(path, "wrong magic: not a token shard (expected \"K2CTOKEN\")");
  if (size < kShardHeaderBytes)
    shard_error(path, "truncated header: " + std::to_string(size) + " bytes, the header is " +
                          std::to_string(kShardHeaderBytes));

  TokenShard shard;
  const auto version = static_cast<std::uint32_t>(get_le(header + 8, 4));
  shard.vocab = static_cast<std::uint32_t>(get_le(header + 12, 4));
  const std::uint64_t count = get_le(header + 16, 8);
  if (version != kShardVersion)
    shard_error(path, "unsupported version " + std::to_string(version) + " (this reader knows " +
                          std::to_string(kShardVersion) + ")");
  if (shard.vocab == 0 || shard.vocab > kMaxVocab)
    shard_error(path, "vocab size " + std::to_string(shard.vocab) +
                          " in the header is not in [1, " + std::to_string(kMaxVocab) + "]");
  // Compared in tokens, not bytes, so a corrupt count near 2^64 cannot overflow the check.
  const std::uintmax_t body_bytes = size - kShardHeaderBytes;
  if (count > body_bytes / 2)
    shard_error(path, "truncated: the header says " + std::to_string(count) + " tokens (" +
                          std::to_string(count) + " x 2 bytes) but only " +
                          std::to_string(body_bytes) + " bytes follow it");
  if (body_bytes != 2 * count)
    shard_error(path, std::to_string(body_bytes - 2 * count) + " trailing bytes after the " +
                          std::to_string(count) + " tokens the header announces");

  shard.tokens.resize(count);
  in.read(reinterpret_cast<char*>(shard.tokens.data()),
          static_cast<std::streamsize>(count * sizeof(std::uint16_t)));
  if (!in) shard_error(path, "read failed after the header");
  swap_if_big_endian(shard.tokens);
  check_tokens(path, shard.tokens, shard.vocab);
  return shard;
}

// ---------------------------------------------------------------------------------------------
// TokenLoader
// ---------------------------------------------------------------------------------------------

TokenLoader::TokenLoader(const std::vector<fs::path>& shards, const LoaderConfig& config)
    : config_(config) {
  K2C_CHECK(!shards.empty(), "TokenLoader: no shard paths given");
  for (const fs::path& path : shards) {
    TokenShard shard = read_shard(path);
    if (vocab_ != 0 && shard.vocab != vocab_)
      shard_error(path, "vocab size " + std::to_string(shard.vocab) + " differs from " +
                            std::to_string(vocab_) + " in " + shards.front().string());
    vocab_ = shard.vocab;
    tokens_.insert(tokens_.end(), shard.tokens.begin(), shard.tokens.end());
  }
  validate();
}

TokenLoader::TokenLoader(std::vector<std::uint16_t> tokens, std::uint32_t vocab,
                         const LoaderConfig& config)
    : tokens_(std::move(tokens)), vocab_(vocab), config_(config) {
  K2C_CHECK(vocab >= 1 && vocab <= kMaxVocab,
            "TokenLoader: vocab size " << vocab << " is not in [1, " << kMaxVocab << "]");
  for (std::size_t i = 0; i < tokens_.size(); ++i)
    K2C_CHECK(tokens_[i] < vocab, "TokenLoader: token " << tokens_[i] << " at position " << i
                                                        << " is >= vocab size " << vocab);
  validate();
}

void TokenLoader::validate() const {
  const LoaderConfig& c = config_;
  K2C_CHECK(c.seq_len >= 1, "TokenLoader: seq_len must be >= 1, got " << c.seq_len);
  K2C_CHECK(c.global_batch >= 1, "TokenLoader: global_batch must be >= 1, got " << c.global_batch);
  K2C_CHECK(c.dp_size >= 1, "TokenLoader: dp_size must be >= 1, got " << c.dp_size);
  K2C_CHECK(c.dp_rank >= 0 && c.dp_rank < c.dp_size,
            "TokenLoader: dp_rank " << c.dp_rank << " is not in [0, " << c.dp_size << ")");
  K2C_CHECK(c.global_batch % c.dp_size == 0, "TokenLoader: global_batch "
                                                 << c.global_batch
                                                 << " is not divisible by dp_size " << c.dp_size);
  // A sequence needs T inputs and one more token for its last target.
  K2C_CHECK(
      tokens_.size() >= static_cast<std::size_t>(c.seq_len) + 1,
      "TokenLoader: " << tokens_.size() << " tokens, fewer than seq_len + 1 = " << c.seq_len + 1);
}

TokenBatch TokenLoader::batch_at(std::int64_t step) const {
  K2C_CHECK(step >= 0, "TokenLoader: step must be >= 0, got " << step);
  K2C_CHECK(!last_ || step <= *last_,
            "TokenLoader: batch " << step << " asked for "
                                  << (*last_ < 0 ? std::string("before any step runs")
                                                 : "while step " + std::to_string(*last_) + " runs")
                                  << ": batches are read one step at a time, each in its step");
  const int rows = local_batch();
  const auto T = static_cast<std::size_t>(config_.seq_len);
  // Starts s with s + T < size: the target of the last input is still inside the data.
  const std::uint64_t starts = tokens_.size() - T;

  TokenBatch batch;
  batch.step = step;
  batch.rows = rows;
  batch.seq_len = config_.seq_len;
  batch.inputs.resize(static_cast<std::size_t>(rows) * T);
  batch.targets.resize(batch.inputs.size());
  for (int r = 0; r < rows; ++r) {
    // The draw is keyed by the row's index in the global batch, not in this rank's slice: that
    // is what makes rank r's rows the same as rows r·B/dp.. of a single process.
    const auto global_row = static_cast<std::uint64_t>(config_.dp_rank) * rows + r;
    // Modulo bias is at most starts / 2^64: below 1e-9 for any corpus that fits in memory.
    const std::uint64_t start =
        draw(config_.seed, Stream::loader, static_cast<std::uint64_t>(step), global_row) % starts;
    const std::uint16_t* src = tokens_.data() + start;
    std::int32_t* in = batch.inputs.data() + static_cast<std::size_t>(r) * T;
    std::int32_t* tgt = batch.targets.data() + static_cast<std::size_t>(r) * T;
    for (std::size_t t = 0; t < T; ++t) {
      in[t] = src[t];
      tgt[t] = src[t + 1];
    }
  }
  return batch;
}

TokenBatch TokenLoader::next() {
  TokenBatch b = batch_at(step_);  // a refused step leaves the cursor where it was
  ++step_;
  return b;
}

void TokenLoader::limit_steps(std::shared_ptr<const std::int64_t> last) {
  K2C_CHECK(last != nullptr, "TokenLoader::limit_steps: no step to limit to");
  K2C_CHECK(last_ == nullptr, "TokenLoader::limit_steps: this loader's step limit is set already and stays");
  last_ = std::move(last);
}

void TokenLoader::seek(std::int64_t step) {
  K2C_CHECK(step >= 0, "TokenLoader::seek: step must be >= 0, got " << step);
  step_ = step;
}

// ---------------------------------------------------------------------------------------------
// Markov chains: stationary distribution and entropy rate
// ---------------------------------------------------------------------------------------------

namespace {

// The chain as lists of nonzero entries: the generator's rows have `branching` of them, so the
// power iteration costs V·K per step instead of V², and works for a 65536-token vocabulary.
struct Entry {
  std::size_t to;
  double p;
};
using SparseChain = std::vector<std::vector<Entry>>;

SparseChain sparse_chain(const TransitionMatrix& transition) {
  const std::size_t V = transition.size();
  K2C_CHECK(V >= 1, "transition matrix is empty");
  SparseChain chain(V);
  for (std::size_t i = 0; i < V; ++i) {
    K2C_CHECK(transition[i].size() == V, "transition matrix is not square: row "
                                             << i << " has " << transition[i].size()
                                             << " entries, there are " << V << " rows");
    double sum = 0.0;
    for (std::size_t j = 0; j < V; ++j) {
      const double p = transition[i][j];
      K2C_CHECK(p >= 0.0 && std::isfinite(p), "transition matrix entry ("
                                                  << i << ", " << j << ") = " << p
                                                  << " is not a probability");
      sum += p;
      if (p > 0.0) chain[i].push_back({j, p});
    }
    K2C_CHECK(std::abs(sum - 1.0) <= 1e-9,
              "transition matrix row " << i << " sums to " << sum << ", not 1");
  }
  return chain;
}

std::vector<double> stationary_of(const SparseChain& chain) {
  const std::size_t V = chain.size();
  std::vector<double> pi(V, 1.0 / static_cast<double>(V));
  std::vector<double> next(V);
  // Iterating π ← π (I + P) / 2, the "lazy" chain, instead of π ← π P: it has the same
  // stationary distribution but no periodicity, so it converges even for a chain that cycles
  // (P = [[0, 1], [1, 0]] would swap the two entries of π forever).
  constexpr int kMaxIterations = 1'000'000;
  constexpr double kTolerance = 1e-14;  // L1 change per step; near double rounding for V ≤ 65536
  for (int iteration = 0; iteration < kMaxIterations; ++iteration) {
    for (std::size_t j = 0; j < V; ++j) next[j] = 0.5 * pi[j];
    for (std::size_t i = 0; i < V; ++i)
      for (const Entry& e : chain[i]) next[e.to] += 0.5 * pi[i] * e.p;
    double sum = 0.0;
    for (double x : next) sum += x;
    double change = 0.0;
    for (std::size_t j = 0; j < V; ++j) {
      next[j] /= sum;  // rows sum to 1 only within rounding; keep π a distribution
      change += std::abs(next[j] - pi[j]);
    }
    pi.swap(next);
    if (change < kTolerance) return pi;
  }
  throw std::runtime_error("stationary distribution: power iteration did not converge in " +
                           std::to_string(kMaxIterations) +
                           " steps (a chain that mixes very slowly)");
}

double entropy_rate_of(const SparseChain& chain, const std::vector<double>& pi) {
  double h = 0.0;
  for (std::size_t i = 0; i < chain.size(); ++i) {
    double row = 0.0;
    for (const Entry& e : chain[i])
      if (e.p > 0.0) row -= e.p * std::log(e.p);  // 0 ln 0 = 0
    h += pi[i] * row;
  }
  return h;
}

}  // namespace

std::vector<double> stationary_distribution(const TransitionMatrix& transition) {
  return stationary_of(sparse_chain(transition));
}

double markov_entropy_rate(const TransitionMatrix& transition) {
  const SparseChain chain = sparse_chain(transition);
  return entropy_rate_of(chain, stationary_of(chain));
}

// ---------------------------------------------------------------------------------------------
// MarkovSource
// ---------------------------------------------------------------------------------------------

MarkovSource::MarkovSource(std::uint64_t seed, int vocab, int branching)
    : seed_(seed), vocab_(vocab), branching_(branching) {
  K2C_CHECK(vocab >= 2 && static_cast<std::uint32_t>(vocab) <= kMaxVocab,
            "MarkovSource: vocab " << vocab << " is not in [2, " << kMaxVocab << "]");
  K2C_CHECK(branching >= 1 && branching <= vocab,
            "MarkovSource: branching " << branching << " is not in [1, vocab = " << vocab << "]");
  const auto V = static_cast<std::uint64_t>(vocab);
  const auto K = static_cast<std::uint64_t>(branching);

  rows_.resize(V);
  SparseChain chain(V);
  for (std::uint64_t i = 0; i < V; ++i) {
    // K distinct successors by a partial Fisher–Yates shuffle of 0..V-1 that stores only the
    // slots it has touched: O(K) per row whatever V is. Slot 0 is swapped with i + 1 first, so
    // the cycle 0 → 1 → … → V-1 → 0 is in every chain and the chain is irreducible.
    std::unordered_map<std::uint64_t, std::uint64_t> moved;
    auto at = [&](std::uint64_t slot) {
      const auto it = moved.find(slot);
      return it == moved.end() ? slot : it->second;
    };
    auto swap_slots = [&](std::uint64_t a, std::uint64_t b) {
      const std::uint64_t va = at(a), vb = at(b);
      moved[a] = vb;
      moved[b] = va;
    };
    swap_slots(0, (i + 1) % V);
    for (std::uint64_t k = 1; k < K; ++k)
      swap_slots(k, k + draw(seed, Stream::markov_successors, i, k) % (V - k));

    // Exponential(1) weights, normalized: a Dirichlet(1, …, 1) row, uniform over the simplex.
    std::vector<double> weight(K);
    double total = 0.0;
    for (std::uint64_t k = 0; k < K; ++k) {
      weight[k] = -std::log1p(-unit(draw(seed, Stream::markov_weights, i, k)));
      total += weight[k];
    }
    double cumulative = 0.0;
    for (std::uint64_t k = 0; k < K; ++k) {
      const double p = weight[k] / total;
      cumulative += p;
      rows_[i].push_back({static_cast<std::uint16_t>(at(k)), p, cumulative});
      chain[i].push_back({at(k), p});
    }
    rows_[i].back().cumulative = 1.0;  // a draw u < 1 always lands in some successor
  }
  stationary_ = stationary_of(chain);
  entropy_rate_ = entropy_rate_of(chain, stationary_);
}

TransitionMatrix MarkovSource::transition_matrix() const {
  TransitionMatrix p(static_cast<std::size_t>(vocab_),
                     std::vector<double>(static_cast<std::size_t>(vocab_), 0.0));
  for (std::size_t i = 0; i < rows_.size(); ++i)
    for (const Successor& s : rows_[i]) p[i][s.token] = s.probability;
  return p;
}

std::vector<std::uint16_t> MarkovSource::sample(std::size_t n) {
  std::vector<std::uint16_t> out(n);
  for (std::size_t t = 0; t < n; ++t, ++position_) {
    const double u = unit(draw(seed_, Stream::markov_sample, position_, 0));
    if (position_ == 0) {
      // Start from π, so every token of the run, the first included, is distributed as in the
      // stationary chain and the entropy rate is the exact expected loss at every position.
      double cumulative = 0.0;
      current_ = static_cast<std::uint16_t>(vocab_ - 1);
      for (int j = 0; j < vocab_; ++j) {
        cumulative += stationary_[static_cast<std::size_t>(j)];
        if (u < cumulative) {
          current_ = static_cast<std::uint16_t>(j);
          break;
        }
      }
    } else {
      const std::vector<Successor>& row = rows_[current_];
      current_ = std::find_if(row.begin(), row.end(), [u](const Successor& s) {
                   return u < s.cumulative;
                 })->token;
    }
    out[t] = current_;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// GrammarSource
// ---------------------------------------------------------------------------------------------

std::uint16_t GrammarSource::word(const std::string& w) {
  const auto it = std::find(words_.begin(), words_.end(), w);
  if (it != words_.end()) return static_cast<std::uint16_t>(it - words_.begin());
  words_.push_back(w);
  return static_cast<std::uint16_t>(words_.size() - 1);
}

GrammarSource::GrammarSource(std::uint64_t seed) : seed_(seed) {
  // The two special tokens first, at the ids data.h promises.
  word("<eos>");
  word(".");
  auto list = [&](std::initializer_list<const char*> ws) {
    std::vector<std::uint16_t> ids;
    for (const char* w : ws) ids.push_back(word(w));
    return ids;
  };
  auto pairs = [&](std::initializer_list<std::pair<const char*, const char*>> ws) {
    std::vector<Pair> ids;
    for (const auto& [singular, plural] : ws) ids.push_back({word(singular), word(plural)});
    return ids;
  };
  det_singular_ = list({"a", "the", "one", "every", "this", "that", "my"});
  det_plural_ = list({"the", "some", "many", "two", "three", "these", "those", "my"});
  adjectives_ = list({"big", "small", "old", "young", "happy", "sad", "quiet", "loud", "red",
                      "green", "brown", "clever", "lazy", "tall", "hungry", "tired"});
  animals_ = pairs({{"dog", "dogs"}, {"cat", "cats"}, {"bird", "birds"}, {"horse", "horses"},
                    {"fox", "foxes"}, {"child", "children"}, {"girl", "girls"}, {"boy", "boys"},
                    {"teacher", "teachers"}, {"farmer", "farmers"}, {"mouse", "mice"}});
  things_ = pairs({{"ball", "balls"}, {"book", "books"}, {"apple", "apples"}, {"box", "boxes"},
                   {"cake", "cakes"}, {"hat", "hats"}, {"letter", "letters"}, {"egg", "eggs"}});
  places_ = pairs({{"house", "houses"}, {"garden", "gardens"}, {"river", "rivers"},
                   {"park", "parks"}, {"hill", "hills"}, {"road", "roads"}, {"tree", "trees"},
                   {"table", "tables"}, {"kitchen", "kitchens"}, {"forest", "forests"}});
  verbs_intransitive_ = pairs({{"runs", "run"}, {"sleeps", "sleep"}, {"sings", "sing"},
                               {"jumps", "jump"}, {"waits", "wait"}, {"laughs", "laugh"},
                               {"walks", "walk"}, {"swims", "swim"}});
  verbs_transitive_ = pairs({{"sees", "see"}, {"likes", "like"}, {"finds", "find"},
                             {"chases", "chase"}, {"watches", "watch"}, {"carries", "carry"},
                             {"wants", "want"}, {"holds", "hold"}});
  prepositions_ = list({"in", "on", "near", "under", "behind", "beside", "across"});
  adverbs_ = list({"quickly", "slowly", "quietly", "happily", "today", "again"});
  and_ = word("and");
  a_ = word("a");
  an_ = word("an");  // replaces "a" before a vowel (see sentence())
}

std::vector<std::uint16_t> GrammarSource::sentence(std::uint64_t index) const {
  std::uint64_t choice = 0;  // the b of each draw: the choices of one sentence, in order
  auto pick = [&](std::size_t n) {
    return static_cast<std::size_t>(draw(seed_, Stream::grammar, index, choice++) % n);
  };
  auto chance = [&](double p) { return unit(draw(seed_, Stream::grammar, index, choice++)) < p; };

  std::vector<std::uint16_t> out;
  auto noun_phrase = [&](const std::vector<Pair>& nouns, bool plural) {
    const std::vector<std::uint16_t>& dets = plural ? det_plural_ : det_singular_;
    const std::size_t det_at = out.size();
    out.push_back(dets[pick(dets.size())]);
    if (chance(0.35)) out.push_back(adjectives_[pick(adjectives_.size())]);
    const Pair& noun = nouns[pick(nouns.size())];
    out.push_back(plural ? noun.plural : noun.singular);
    if (out[det_at] == a_ && std::strchr("aeiou", words_[out[det_at + 1]][0]) != nullptr)
      out[det_at] = an_;
  };
  auto verb = [&](const std::vector<Pair>& verbs, bool plural) {
    const Pair& v = verbs[pick(verbs.size())];
    out.push_back(plural ? v.plural : v.singular);
  };
  auto object = [&] { noun_phrase(chance(0.5) ? animals_ : things_, chance(0.4)); };
  auto place = [&] {
    out.push_back(prepositions_[pick(prepositions_.size())]);
    noun_phrase(places_, chance(0.3));
  };

  // Subjects are animals and people, the nouns that can run or see; the verb agrees with them.
  const bool plural = chance(0.4);
  noun_phrase(animals_, plural);
  // Pattern weights out of 14: the plain forms most often, the compound one rarely.
  const std::size_t p = pick(14);
  if (p < 3) {  // the dog runs .
    verb(verbs_intransitive_, plural);
  } else if (p < 5) {  // the dog runs quickly .
    verb(verbs_intransitive_, plural);
    out.push_back(adverbs_[pick(adverbs_.size())]);
  } else if (p < 8) {  // the dog runs in the garden .
    verb(verbs_intransitive_, plural);
    place();
  } else if (p < 11) {  // the dog sees a ball .
    verb(verbs_transitive_, plural);
    object();
  } else if (p < 13) {  // the dog sees a ball near the river .
    verb(verbs_transitive_, plural);
    object();
    place();
  } else {  // the dogs run and jump .
    verb(verbs_intransitive_, plural);
    out.push_back(and_);
    verb(verbs_intransitive_, plural);
  }
  out.push_back(kPeriod);
  out.push_back(kEndOfSentence);
  return out;
}

std::vector<std::uint16_t> GrammarSource::sample(std::size_t sentences) {
  std::vector<std::uint16_t> out;
  for (std::size_t s = 0; s < sentences; ++s) {
    const std::vector<std::uint16_t> one = sentence(next_sentence_++);
    out.insert(out.end(), one.begin(), one.end());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Text: decode and vocabulary files
// ---------------------------------------------------------------------------------------------

namespace {

template <typename Token>
std::string decode_tokens(std::span<const Token> tokens, const std::vector<std::string>& vocab) {
  std::string text;
  bool line_start = true;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const auto t = static_cast<std::int64_t>(tokens[i]);
    K2C_CHECK(t >= 0 && static_cast<std::uint64_t>(t) < vocab.size(),
              "decode: token " << t << " at position " << i << " is outside the vocab of "
                               << vocab.size() << " words");
    const std::string& w = vocab[static_cast<std::size_t>(t)];
    if (w == "<eos>") {
      text += '\n';
      line_start = true;
      continue;
    }
    if (!line_start && w != ".") text += ' ';
    text += w;
    line_start = false;
  }
  return text;
}

}  // namespace

std::string decode(std::span<const std::uint16_t> tokens, const std::vector<std::string>& vocab) {
  return decode_tokens(tokens, vocab);
}

std::string decode(std::span<const std::int32_t> tokens, const std::vector<std::string>& vocab) {
  return decode_tokens(tokens, vocab);
}

std::string sample_text(std::span<const std::int32_t> prompt, std::span<const std::int32_t> continuation,
                        const std::vector<std::string>& vocab) {
  // The vocabulary, extended with a name for every id past its end that the sample holds.
  std::vector<std::string> words = vocab;
  const bool plain = vocab.empty();
  for (auto ids : {prompt, continuation})
    for (const std::int32_t id : ids)
      while (id >= 0 && static_cast<std::size_t>(id) >= words.size())
        words.push_back(plain ? std::to_string(words.size()) : "<" + std::to_string(words.size()) + ">");
  return decode_tokens(prompt, words) + " | " + decode_tokens(continuation, words);
}

void write_vocab(const fs::path& path, const std::vector<std::string>& words) {
  std::ofstream out(path, std::ios::trunc);
  if (!out)
    throw std::runtime_error("vocab file " + path.string() + ": cannot open for writing (" +
                             std::strerror(errno) + ")");
  for (std::size_t i = 0; i < words.size(); ++i) {
    if (words[i].empty() || words[i].find_first_of("\r\n") != std::string::npos)
      throw std::runtime_error("vocab file " + path.string() + ": word " + std::to_string(i) +
                               " is empty or holds a line break");
    out << words[i] << '\n';
  }
  out.close();
  if (!out) throw std::runtime_error("vocab file " + path.string() + ": write failed");
}

std::vector<std::string> read_vocab(const fs::path& path) {
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error("vocab file " + path.string() + ": cannot open (" +
                             std::strerror(errno) + ")");
  std::vector<std::string> words;
  for (std::string line; std::getline(in, line);) words.push_back(line);
  return words;
}

fs::path shard_in(const fs::path& dir, const std::string& kind) {
  if (!fs::is_directory(dir))
    throw std::invalid_argument("--data " + dir.string() + ": not a folder (run `make data` first)");
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.size() > kind.size() + 5 && name.ends_with("_" + kind + ".bin")) return e.path();
  }
  throw std::invalid_argument("--data " + dir.string() + ": no *_" + kind + ".bin shard there (run `make data` first)");
}

}  // namespace k2c::model
