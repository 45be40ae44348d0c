// test_data.cpp — token shards, the loader, the Markov and grammar sources (k2c/model/data.h).
//
// Files go under ::testing::TempDir(), named after the test and the process, so tests that CTest
// runs in parallel (and two people's runs on one machine) never share a file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/model/data.h"

namespace fs = std::filesystem;
using namespace k2c::model;

namespace {

fs::path temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return fs::path(::testing::TempDir()) /
         ("k2c_data_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
          std::to_string(getpid()) + "_" + name);
}

// The message of the exception E that f throws; a test failure if it throws nothing.
template <typename E = std::runtime_error, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return "";
}

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

std::vector<std::uint16_t> counting_tokens(std::size_t n, std::uint16_t vocab) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>(i % vocab);
  return t;
}

// Overwrites bytes of a file in place: how the tests make a corrupt header.
void patch(const fs::path& path, std::streamoff offset, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(offset);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le32(std::uint32_t v) {
  std::string s;
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return s;
}

// ---------------------------------------------------------------------------------------------
// Shards
// ---------------------------------------------------------------------------------------------

TEST(Shard, RoundTrip) {
  const fs::path path = temp_path("a.bin");
  const std::vector<std::uint16_t> tokens = {0, 1, 2, 65535, 300, 7, 7, 0};
  write_shard(path, tokens, 65536);
  EXPECT_EQ(fs::file_size(path), kShardHeaderBytes + 2 * tokens.size());
  const TokenShard shard = read_shard(path);
  EXPECT_EQ(shard.vocab, 65536u);
  EXPECT_EQ(shard.tokens, tokens);
  fs::remove(path);
}

TEST(Shard, LayoutIsLittleEndian) {
  const fs::path path = temp_path("a.bin");
  write_shard(path, std::vector<std::uint16_t>{0x0102, 0x0003}, 300);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string expected = std::string("K2CTOKEN") + le32(1) + le32(300) + le32(2) + le32(0) +
                               std::string("\x02\x01\x03\x00", 4);
  EXPECT_EQ(bytes, expected);
  fs::remove(path);
}

TEST(Shard, EmptyShard) {
  const fs::path path = temp_path("a.bin");
  write_shard(path, {}, 10);
  const TokenShard shard = read_shard(path);
  EXPECT_EQ(shard.vocab, 10u);
  EXPECT_TRUE(shard.tokens.empty());
  fs::remove(path);
}

TEST(Shard, MissingFile) {
  const fs::path path = temp_path("missing.bin");
  const std::string e = error_of([&] { read_shard(path); });
  EXPECT_TRUE(contains(e, path.string()));
  EXPECT_TRUE(contains(e, "no such file"));
}

TEST(Shard, WrongMagic) {
  const fs::path path = temp_path("a.bin");
  std::ofstream(path) << "this is a text file, not a shard of tokens\n";
  std::string e = error_of([&] { read_shard(path); });
  EXPECT_TRUE(contains(e, path.string()));
  EXPECT_TRUE(contains(e, "wrong magic"));
  std::ofstream(path, std::ios::trunc) << "K2C";  // shorter than the magic itself
  EXPECT_TRUE(contains(error_of([&] { read_shard(path); }), "wrong magic"));
  fs::remove(path);
}

TEST(Shard, UnsupportedVersion) {
  const fs::path path = temp_path("a.bin");
  write_shard(path, counting_tokens(10, 10), 10);
  patch(path, 8, le32(2));
  const std::string e = error_of([&] { read_shard(path); });
  EXPECT_TRUE(contains(e, path.string()));
  EXPECT_TRUE(contains(e, "unsupported version 2"));
  fs::remove(path);
}

TEST(Shard, Truncated) {
  const fs::path path = temp_path("a.bin");
  write_shard(path, counting_tokens(10, 10), 10);
  fs::resize_file(path, kShardHeaderBytes + 2 * 7);  // 7 of the 10 tokens
  std::string e = error_of([&] { read_shard(path); });
  EXPECT_TRUE(contains(e, path.string()));
  EXPECT_TRUE(contains(e, "truncated"));
  EXPECT_TRUE(contains(e, "10 tokens"));
  fs::resize_file(path, 20);  // inside the header
  e = error_of([&] { read_shard(path); });
  EXPECT_TRUE(contains(e, "truncated header"));
  fs::remove(path);
}

TEST(Shard, TrailingBytes) {
  const fs::path path = temp_path("a.bin");
  write_shard(path, counting_tokens(10, 10), 10);
  std::ofstream(path, std::ios::app | std::ios::binary) << "xyz";
  EXPECT_TRUE(contains(error_of([&] { read_shard(path); }), "3 trailing bytes"));
  fs::remove(path);
}

TEST(Shard, TokenOutsideVocab) {
  const fs::path path = temp_path("a.bin");
  // On write: refused before anything is written.
  std::string e = error_of([&] { write_shard(path, std::vector<std::uint16_t>{1, 2, 9}, 5); });
  EXPECT_TRUE(contains(e, path.string()));
  EXPECT_TRUE(contains(e, "token 9 at position 2 is >= vocab size 5"));
  // On read: a header whose vocab is smaller than the data it describes.
  write_shard(path, counting_tokens(10, 10), 10);
  patch(path, 12, le32(6));
  e = error_of([&] { read_shard(path); });
  EXPECT_TRUE(contains(e, path.string()));
  EXPECT_TRUE(contains(e, "token 6 at position 6 is >= vocab size 6"));
  fs::remove(path);
}

TEST(Shard, VocabBeyondUint16) {
  const fs::path path = temp_path("a.bin");
  std::string e = error_of([&] { write_shard(path, std::vector<std::uint16_t>{1}, 65537); });
  EXPECT_TRUE(contains(e, path.string()));
  EXPECT_TRUE(contains(e, "vocab size 65537"));
  EXPECT_TRUE(contains(error_of([&] { write_shard(path, {}, 0); }), "vocab size 0"));
  EXPECT_FALSE(fs::exists(path));
}

// ---------------------------------------------------------------------------------------------
// TokenLoader
// ---------------------------------------------------------------------------------------------

std::vector<std::uint16_t> markov_tokens(std::size_t n, std::uint64_t seed = 3) {
  return MarkovSource(seed, 64, 4).sample(n);
}

TEST(Loader, Shapes) {
  TokenLoader loader(markov_tokens(1000), 64, {.seq_len = 16, .global_batch = 6, .seed = 1});
  const TokenBatch b = loader.next();
  EXPECT_EQ(b.step, 0);
  EXPECT_EQ(b.rows, 6);
  EXPECT_EQ(b.seq_len, 16);
  EXPECT_EQ(b.inputs.size(), 96u);
  EXPECT_EQ(b.targets.size(), 96u);
  EXPECT_EQ(loader.step(), 1);
  EXPECT_EQ(loader.vocab(), 64u);
  EXPECT_EQ(loader.num_tokens(), 1000u);
}

TEST(Loader, TargetsAreInputsShiftedByOne) {
  // Token i is i mod 1000, so a window is contiguous exactly when each token is one more than
  // the one before it (mod 1000), and the target of x must be x + 1.
  TokenLoader loader(counting_tokens(5000, 1000), 1000,
                     {.seq_len = 32, .global_batch = 8, .seed = 5});
  for (int s = 0; s < 20; ++s) {
    const TokenBatch b = loader.next();
    for (int r = 0; r < b.rows; ++r)
      for (int t = 0; t < b.seq_len; ++t) {
        const std::size_t at = static_cast<std::size_t>(r * b.seq_len + t);
        EXPECT_EQ(b.targets[at], (b.inputs[at] + 1) % 1000);
        if (t + 1 < b.seq_len) {
          EXPECT_EQ(b.inputs[at + 1], b.targets[at]);
        }
      }
  }
}

TEST(Loader, ExactlyOneWindowWhenDataIsSeqLenPlusOne) {
  const std::vector<std::uint16_t> tokens = {5, 4, 3, 2, 1};
  TokenLoader loader(tokens, 6, {.seq_len = 4, .global_batch = 2, .seed = 9});
  const TokenBatch b = loader.next();
  EXPECT_EQ(b.inputs, (std::vector<std::int32_t>{5, 4, 3, 2, 5, 4, 3, 2}));
  EXPECT_EQ(b.targets, (std::vector<std::int32_t>{4, 3, 2, 1, 4, 3, 2, 1}));
}

TEST(Loader, SameSeedSameBatchesDifferentSeedDifferent) {
  const std::vector<std::uint16_t> tokens = markov_tokens(20000);
  TokenLoader a(tokens, 64, {.seq_len = 16, .global_batch = 4, .seed = 11});
  TokenLoader b(tokens, 64, {.seq_len = 16, .global_batch = 4, .seed = 11});
  TokenLoader c(tokens, 64, {.seq_len = 16, .global_batch = 4, .seed = 12});
  bool any_difference = false;
  std::set<std::vector<std::int32_t>> distinct;
  for (int s = 0; s < 10; ++s) {
    const TokenBatch x = a.next(), y = b.next(), z = c.next();
    EXPECT_EQ(x.inputs, y.inputs);
    EXPECT_EQ(x.targets, y.targets);
    any_difference |= x.inputs != z.inputs;
    distinct.insert(x.inputs);
  }
  EXPECT_TRUE(any_difference);
  EXPECT_EQ(distinct.size(), 10u);  // and steps differ from one another
}

TEST(Loader, RankSlicesConcatenateToTheSingleProcessBatch) {
  const std::vector<std::uint16_t> tokens = markov_tokens(20000);
  const LoaderConfig single{.seq_len = 8, .global_batch = 12, .seed = 21};
  TokenLoader whole(tokens, 64, single);
  for (int dp : {2, 3, 4}) {
    for (std::int64_t step : {0, 1, 7, 1000}) {
      const TokenBatch reference = whole.batch_at(step);
      std::vector<std::int32_t> inputs, targets;
      for (int rank = 0; rank < dp; ++rank) {
        LoaderConfig c = single;
        c.dp_rank = rank;
        c.dp_size = dp;
        TokenLoader part(tokens, 64, c);
        part.seek(step);
        const TokenBatch b = part.next();
        EXPECT_EQ(b.rows, 12 / dp);
        inputs.insert(inputs.end(), b.inputs.begin(), b.inputs.end());
        targets.insert(targets.end(), b.targets.begin(), b.targets.end());
      }
      EXPECT_EQ(inputs, reference.inputs) << "dp " << dp << " step " << step;
      EXPECT_EQ(targets, reference.targets) << "dp " << dp << " step " << step;
    }
  }
}

TEST(Loader, SeekResumesTheSameBatches) {
  const std::vector<std::uint16_t> tokens = markov_tokens(20000);
  const LoaderConfig config{
      .seq_len = 16, .global_batch = 4, .dp_rank = 1, .dp_size = 2, .seed = 4};
  TokenLoader first(tokens, 64, config);
  std::vector<TokenBatch> run;
  for (int s = 0; s < 8; ++s) run.push_back(first.next());

  TokenLoader resumed(tokens, 64, config);  // a restart from a checkpoint taken after step 4
  resumed.seek(5);
  EXPECT_EQ(resumed.step(), 5);
  for (int s = 5; s < 8; ++s) {
    const TokenBatch b = resumed.next();
    EXPECT_EQ(b.step, s);
    EXPECT_EQ(b.inputs, run[static_cast<std::size_t>(s)].inputs);
    EXPECT_EQ(b.targets, run[static_cast<std::size_t>(s)].targets);
  }
  EXPECT_EQ(first.batch_at(2).inputs, run[2].inputs);  // batch_at leaves the cursor alone
  EXPECT_EQ(first.step(), 8);
  EXPECT_THROW(resumed.seek(-1), std::invalid_argument);
}

TEST(Loader, LimitStepsRefusesBatchesAhead) {
  const std::vector<std::uint16_t> tokens = markov_tokens(2000);
  const LoaderConfig config{.seq_len = 16, .global_batch = 4, .seed = 5};
  TokenLoader free(tokens, 64, config), limited(tokens, 64, config);
  auto last = std::make_shared<std::int64_t>(-1);
  limited.limit_steps(last);
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([&] { limited.batch_at(0); }), "before any step runs"));
  const TokenLoader copy = limited;  // a copy keeps the limit
  for (std::int64_t s = 0; s < 3; ++s) {
    *last = s;
    EXPECT_EQ(limited.next().inputs, free.batch_at(s).inputs);
    EXPECT_EQ(limited.batch_at(s / 2).inputs, free.batch_at(s / 2).inputs);  // steps before stay readable
    EXPECT_TRUE(contains(error_of<std::invalid_argument>([&] { limited.batch_at(s + 1); }),
                         "while step " + std::to_string(s) + " runs"));
    EXPECT_THROW(copy.batch_at(s + 1), std::invalid_argument);
  }
  EXPECT_THROW(limited.next(), std::invalid_argument);  // step 3 while step 2 runs
  EXPECT_EQ(limited.step(), 3);                          // and the cursor stays
  // The limit cannot be lifted or moved by the code it limits.
  TokenLoader lifted = limited;
  EXPECT_THROW(lifted.limit_steps(std::make_shared<std::int64_t>(100)), std::invalid_argument);
  EXPECT_THROW(lifted.limit_steps(nullptr), std::invalid_argument);
  EXPECT_THROW(free.limit_steps(nullptr), std::invalid_argument);
  EXPECT_THROW(lifted.batch_at(3), std::invalid_argument);
}

TEST(Loader, ReadsShardsInOrder) {
  const std::vector<std::uint16_t> tokens = markov_tokens(3000);
  const fs::path a = temp_path("a.bin"), b = temp_path("b.bin");
  write_shard(a, std::span(tokens).first(1000), 64);
  write_shard(b, std::span(tokens).subspan(1000), 64);
  const LoaderConfig config{.seq_len = 16, .global_batch = 4, .seed = 8};
  TokenLoader from_files({a, b}, config);
  TokenLoader from_memory(tokens, 64, config);
  EXPECT_EQ(from_files.num_tokens(), 3000u);
  for (int s = 0; s < 5; ++s) EXPECT_EQ(from_files.next().inputs, from_memory.next().inputs);

  write_shard(b, std::span(tokens).subspan(1000), 65);
  EXPECT_TRUE(contains(error_of([&] { TokenLoader({a, b}, config); }), "differs from 64"));
  EXPECT_TRUE(contains(error_of([&] {
                         TokenLoader({a, temp_path("none.bin")}, config);
                       }),
                       "no such file"));
  fs::remove(a);
  fs::remove(b);
}

TEST(Loader, InvalidArguments) {
  const std::vector<std::uint16_t> tokens = markov_tokens(100);
  auto make = [&](LoaderConfig c) { TokenLoader(tokens, 64, c); };
  EXPECT_TRUE(contains(error_of<std::invalid_argument>([&] {
                         make({.seq_len = 8, .global_batch = 10, .dp_rank = 0, .dp_size = 4});
                       }),
                       "not divisible"));
  EXPECT_TRUE(
      contains(error_of<std::invalid_argument>([&] { make({.seq_len = 100, .global_batch = 2}); }),
               "fewer than seq_len + 1"));
  EXPECT_NO_THROW(make({.seq_len = 99, .global_batch = 2}));
  EXPECT_THROW(make({.seq_len = 0, .global_batch = 2}), std::invalid_argument);
  EXPECT_THROW(make({.seq_len = 8, .global_batch = 0}), std::invalid_argument);
  EXPECT_THROW(make({.seq_len = 8, .global_batch = 4, .dp_rank = 2, .dp_size = 2}),
               std::invalid_argument);
  EXPECT_THROW(make({.seq_len = 8, .global_batch = 4, .dp_rank = -1, .dp_size = 2}),
               std::invalid_argument);
  EXPECT_THROW(make({.seq_len = 8, .global_batch = 4, .dp_size = 0}), std::invalid_argument);
  EXPECT_THROW(TokenLoader(tokens, 10, {.seq_len = 8, .global_batch = 4}), std::invalid_argument);
  EXPECT_THROW(TokenLoader(std::vector<std::uint16_t>{}, 10, {.seq_len = 1, .global_batch = 1}),
               std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Markov entropy rate and source
// ---------------------------------------------------------------------------------------------

double binary_entropy(double p) { return -p * std::log(p) - (1 - p) * std::log(1 - p); }

TEST(Markov, TwoStateChain) {
  // P = [[1-a, a], [b, 1-b]]: π = (b, a) / (a + b), H = π0 h(a) + π1 h(b).
  const double a = 0.1, b = 0.3;
  const TransitionMatrix p = {{1 - a, a}, {b, 1 - b}};
  const std::vector<double> pi = stationary_distribution(p);
  EXPECT_NEAR(pi[0], b / (a + b), 1e-12);
  EXPECT_NEAR(pi[1], a / (a + b), 1e-12);
  const double expected = b / (a + b) * binary_entropy(a) + a / (a + b) * binary_entropy(b);
  EXPECT_NEAR(markov_entropy_rate(p), expected, 1e-12);
}

TEST(Markov, UniformChainIsLogV) {
  for (int V : {2, 5, 256}) {
    const TransitionMatrix p(static_cast<std::size_t>(V),
                             std::vector<double>(static_cast<std::size_t>(V), 1.0 / V));
    EXPECT_NEAR(markov_entropy_rate(p), std::log(V), 1e-12) << "V = " << V;
  }
}

TEST(Markov, PeriodicChainConverges) {
  // A deterministic cycle: π is uniform, and nothing is uncertain, so H = 0. Plain π ← π P would
  // oscillate here; the lazy iteration converges.
  const TransitionMatrix p = {{0, 1, 0}, {0, 0, 1}, {1, 0, 0}};
  for (double x : stationary_distribution(p)) EXPECT_NEAR(x, 1.0 / 3, 1e-12);
  EXPECT_EQ(markov_entropy_rate(p), 0.0);
}

TEST(Markov, RejectsMatricesThatAreNotStochastic) {
  EXPECT_THROW(markov_entropy_rate({}), std::invalid_argument);
  EXPECT_THROW(markov_entropy_rate({{0.5, 0.5}, {1.0}}), std::invalid_argument);
  EXPECT_THROW(markov_entropy_rate({{0.5, 0.6}, {0.5, 0.5}}), std::invalid_argument);
  EXPECT_THROW(markov_entropy_rate({{1.5, -0.5}, {0.5, 0.5}}), std::invalid_argument);
}

TEST(Markov, SourceStructure) {
  const int V = 50, K = 5;
  MarkovSource source(17, V, K);
  const TransitionMatrix p = source.transition_matrix();
  ASSERT_EQ(p.size(), static_cast<std::size_t>(V));
  for (int i = 0; i < V; ++i) {
    const auto& row = p[static_cast<std::size_t>(i)];
    EXPECT_EQ(std::count_if(row.begin(), row.end(), [](double x) { return x > 0; }), K);
    EXPECT_NEAR(std::accumulate(row.begin(), row.end(), 0.0), 1.0, 1e-12);
    EXPECT_GT(row[static_cast<std::size_t>((i + 1) % V)],
              0.0);  // the cycle that keeps it irreducible
  }
  EXPECT_NEAR(source.entropy_rate(), markov_entropy_rate(p), 1e-12);
  EXPECT_GT(source.entropy_rate(), 0.0);
  EXPECT_LT(source.entropy_rate(), std::log(K));
  // Same seed, same chain; another seed, another chain.
  EXPECT_EQ(MarkovSource(17, V, K).transition_matrix(), p);
  EXPECT_NE(MarkovSource(18, V, K).transition_matrix(), p);
  EXPECT_THROW(MarkovSource(1, 1, 1), std::invalid_argument);
  EXPECT_THROW(MarkovSource(1, 10, 11), std::invalid_argument);
  EXPECT_THROW(MarkovSource(1, 10, 0), std::invalid_argument);
}

TEST(Markov, SamplesContinueOneStream) {
  MarkovSource once(5, 40, 3), twice(5, 40, 3);
  const std::vector<std::uint16_t> all = once.sample(1000);
  std::vector<std::uint16_t> parts = twice.sample(300);
  const std::vector<std::uint16_t> rest = twice.sample(700);
  parts.insert(parts.end(), rest.begin(), rest.end());
  EXPECT_EQ(parts, all);
  for (std::uint16_t t : all) EXPECT_LT(t, 40);
}

TEST(Markov, EmpiricalLossOfTheTrueModelMatchesTheEntropyRate) {
  // The per-token negative log-likelihood of a long sample under the true P averages to H.
  // With 200k tokens its standard error is about 0.002 nats, so 0.015 is a wide margin.
  const int V = 32;
  MarkovSource source(99, V, 4);
  const TransitionMatrix p = source.transition_matrix();
  const std::vector<std::uint16_t> x = source.sample(200'001);
  double nll = 0.0;
  for (std::size_t t = 0; t + 1 < x.size(); ++t) nll -= std::log(p[x[t]][x[t + 1]]);
  nll /= static_cast<double>(x.size() - 1);
  EXPECT_NEAR(nll, source.entropy_rate(), 0.015);

  // And the tokens are distributed as π.
  std::vector<double> freq(static_cast<std::size_t>(V), 0.0);
  for (std::uint16_t t : x) freq[t] += 1.0 / static_cast<double>(x.size());
  for (int i = 0; i < V; ++i)
    EXPECT_NEAR(freq[static_cast<std::size_t>(i)], source.stationary()[static_cast<std::size_t>(i)],
                0.01);
}

// ---------------------------------------------------------------------------------------------
// Grammar
// ---------------------------------------------------------------------------------------------

TEST(Grammar, DeterministicFromSeed) {
  GrammarSource a(7), b(7), c(8);
  const std::vector<std::uint16_t> x = a.sample(200);
  EXPECT_EQ(x, b.sample(200));
  EXPECT_NE(x, c.sample(200));
  // sample continues sentence by sentence: sentence(i) is a function of (seed, i) alone.
  GrammarSource d(7);
  std::vector<std::uint16_t> by_index;
  for (std::uint64_t i = 0; i < 200; ++i) {
    const std::vector<std::uint16_t> s = d.sentence(i);
    by_index.insert(by_index.end(), s.begin(), s.end());
  }
  EXPECT_EQ(by_index, x);
}

TEST(Grammar, TokensAreInTheVocabAndSentencesEndWell) {
  GrammarSource source(3);
  const std::vector<std::string>& vocab = source.vocab();
  ASSERT_GT(vocab.size(), 50u);
  EXPECT_EQ(vocab[kEndOfSentence], "<eos>");
  EXPECT_EQ(vocab[kPeriod], ".");
  EXPECT_EQ(std::set<std::string>(vocab.begin(), vocab.end()).size(),
            vocab.size());  // no duplicates
  for (std::uint64_t i = 0; i < 1000; ++i) {
    const std::vector<std::uint16_t> s = source.sentence(i);
    ASSERT_GE(s.size(), 5u);  // det noun verb . <eos> at the least
    EXPECT_EQ(s[s.size() - 2], kPeriod);
    EXPECT_EQ(s.back(), kEndOfSentence);
    for (std::size_t k = 0; k < s.size(); ++k) {
      ASSERT_LT(s[k], vocab.size());
      if (k + 2 < s.size()) {
        EXPECT_NE(s[k], kEndOfSentence);
      }
      if (vocab[s[k]] == "a") {  // "an" before a vowel
        EXPECT_EQ(std::string("aeiou").find(vocab[s[k + 1]][0]), std::string::npos);
      }
    }
  }
}

TEST(Grammar, DecodeGivesWords) {
  GrammarSource source(3);
  const std::vector<std::string>& vocab = source.vocab();
  auto token = [&](const std::string& w) {
    return static_cast<std::uint16_t>(std::find(vocab.begin(), vocab.end(), w) - vocab.begin());
  };
  const std::vector<std::uint16_t> tokens = {
      token("the"), token("dog"),  token("runs"),  kPeriod, kEndOfSentence,
      token("two"), token("cats"), token("sleep"), kPeriod, kEndOfSentence};
  EXPECT_EQ(decode(tokens, vocab), "the dog runs.\ntwo cats sleep.\n");
  const std::vector<std::int32_t> wide(tokens.begin(), tokens.end());
  EXPECT_EQ(decode(wide, vocab), decode(tokens, vocab));

  const std::string text = decode(source.sample(20), vocab);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 20);
  EXPECT_EQ(text.find("<eos>"), std::string::npos);

  // Samples: words, ids past the vocabulary marked, plain ids without a vocabulary.
  const std::vector<std::int32_t> prompt = {token("the"), token("dog")};
  const std::vector<std::int32_t> more = {token("runs"), static_cast<std::int32_t>(vocab.size()) + 3, kPeriod};
  EXPECT_EQ(sample_text(prompt, more, vocab),
            "the dog | runs <" + std::to_string(vocab.size() + 3) + ">.");
  EXPECT_EQ(sample_text(prompt, more, {}), std::to_string(prompt[0]) + " " + std::to_string(prompt[1]) + " | " +
                                              std::to_string(more[0]) + " " + std::to_string(more[1]) + " " +
                                              std::to_string(more[2]));

  EXPECT_THROW(decode(std::vector<std::int32_t>{-1}, vocab), std::invalid_argument);
  EXPECT_THROW(decode(std::vector<std::uint16_t>{static_cast<std::uint16_t>(vocab.size())}, vocab),
               std::invalid_argument);
}

TEST(Grammar, VocabFileRoundTrip) {
  const fs::path path = temp_path("vocab.txt");
  const GrammarSource source(1);
  write_vocab(path, source.vocab());
  EXPECT_EQ(read_vocab(path), source.vocab());
  EXPECT_THROW(write_vocab(path, {"a", "two words\n"}), std::runtime_error);
  fs::remove(path);
  EXPECT_TRUE(contains(error_of([&] { read_vocab(path); }), path.string()));
}

}  // namespace
