// autograder/witness/rank_cases.h — the cases k2c_rank_witness draws. For each check a rubric
// test can name (its "rank_witness" key), a drawer makes one case: the arguments every rank is
// sent, each rank's input, how many bytes each rank must answer, and the judge of the answers,
// computed here from the course's own references before any rank starts.
//
// Every drawer takes the case's index: index % 3 picks, in turn, a tiny case (one element, one
// token, one row: the edges), a small one with tails (sizes the ranks do not divide), and a larger
// one. Inputs come from seeds drawn then, so a test program cannot know them in advance.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "k2c/dist/rank_witness.h"
#include "k2c/model/transformer.h"

namespace k2c::rank_witness {

using Bytes = std::vector<unsigned char>;

struct Case {
  std::string what;  // for the verdict: what the case was
  std::int64_t args[dist::witness::kArgs] = {};
  std::vector<Bytes> in;               // per rank
  std::vector<std::size_t> out_bytes;  // per rank
  std::function<std::string(const std::vector<Bytes>&)> check;  // "" when right, else the first miss
};

using Drawer = Case (*)(const std::string& kind, int ranks, int index, std::mt19937_64& rng);
// The drawer of check `name`; nullptr for a name no drawer knows.
Drawer find_drawer(const std::string& name);

// The judge of a layer's answers (want: each rank's tensors in order, named, the first two its y
// and dx): each tensor within 1e-5 of its largest |value| plus 1e-4 relative, the first element
// out of it named (a tensor far smaller than the rank's others, such as a gradient that is zero
// but for rounding, within 1e-8 of the rank's largest |value|); where every rank answers the whole y and dx (`whole` floats each, > 0), those
// must be the same bits on every rank. `of_largest` replaces the 1e-5 where a check's contract
// allows more (module 19's absorbed MLA reorders every product: 1e-4, as its test). `floor`: at
// least this much of the rank's largest |value| is allowed everywhere, for answers held against an
// oracle in double: a float value that cancels to near zero from terms of that size carries their
// rounding (float's epsilon, 1.2e-7, times their size), which the 1e-8 above does not cover.
using Tensors = std::vector<std::pair<std::string, std::vector<float>>>;
std::function<std::string(const std::vector<Bytes>&)> judge_layer(const std::vector<Tensors>& want, std::size_t whole,
                                                                  const std::string& reference, double of_largest = 1e-5,
                                                                  double floor = 0);

// A model in args[4 .. 11] (vocab, d_model, n_layers, q_heads, kv_heads, d_ff, seq_len, tied
// head: what k2c/model/dist_testing.h's witness_model reads) and seed >> 1 in args[12], the seed
// the rank materializes it from (non-negative: the rank reads it back as int64).
void put_model(Case& c, const k2c::model::ModelConfig& m, std::uint64_t seed);

// Rows [first, first + count) of a row-major [rows, cols] matrix, or its columns.
template <class T>
std::vector<T> row_slice(const std::vector<T>& m, std::int64_t cols, std::int64_t first, std::int64_t count) {
  return {m.begin() + first * cols, m.begin() + (first + count) * cols};
}
template <class T>
std::vector<T> column_slice(const std::vector<T>& m, std::int64_t cols, std::int64_t first, std::int64_t count) {
  std::vector<T> out;
  for (std::size_t row = 0; row < m.size() / static_cast<std::size_t>(cols); ++row)
    out.insert(out.end(), m.begin() + row * cols + first, m.begin() + row * cols + first + count);
  return out;
}

// fp32 values as bytes, and back.
Bytes floats(const std::vector<float>& v);
float float_at(const Bytes& b, std::size_t i);

// The drawers, by module (the comment above each says its arguments and what a rank answers).
Case draw_collectives(const std::string& kind, int ranks, int index, std::mt19937_64& rng);  // 11
Case draw_parameters(const std::string& kind, int ranks, int index, std::mt19937_64& rng);   // 12
Case draw_zero(const std::string& kind, int ranks, int index, std::mt19937_64& rng);         // 13
Case draw_linear(const std::string& kind, int ranks, int index, std::mt19937_64& rng);       // 14
Case draw_embedding(const std::string& kind, int ranks, int index, std::mt19937_64& rng);    // 14
Case draw_cross_entropy(const std::string& kind, int ranks, int index, std::mt19937_64& rng);  // 14
Case draw_attention(const std::string& kind, int ranks, int index, std::mt19937_64& rng);    // 14
Case draw_mlp(const std::string& kind, int ranks, int index, std::mt19937_64& rng);          // 14
Case draw_block(const std::string& kind, int ranks, int index, std::mt19937_64& rng);         // 14, 16
Case draw_pipeline(const std::string& kind, int ranks, int index, std::mt19937_64& rng);     // 15
Case draw_rows(const std::string& kind, int ranks, int index, std::mt19937_64& rng);         // 16
Case draw_ring(const std::string& kind, int ranks, int index, std::mt19937_64& rng);         // 16
Case draw_experts(const std::string& kind, int ranks, int index, std::mt19937_64& rng);      // 17
Case draw_expert_layer(const std::string& kind, int ranks, int index, std::mt19937_64& rng);  // 17
Case draw_decode_attention(const std::string& kind, int ranks, int index, std::mt19937_64& rng);  // 19
Case draw_engine(const std::string& kind, int ranks, int index, std::mt19937_64& rng);       // 19
Case draw_mla(const std::string& kind, int ranks, int index, std::mt19937_64& rng);          // 19
Case draw_serving(const std::string& kind, int ranks, int index, std::mt19937_64& rng);      // 19
Case draw_cache_pages(const std::string& kind, int ranks, int index, std::mt19937_64& rng);  // 19
Case draw_capstone(const std::string& kind, int ranks, int index, std::mt19937_64& rng);     // 18

}  // namespace k2c::rank_witness
