// autograder/witness/rank_cases.cpp — which drawer makes the cases of which check.
#include "rank_cases.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>

namespace k2c::rank_witness {

Drawer find_drawer(const std::string& name) {
  struct Entry {
    Drawer draw;
    std::initializer_list<const char*> names;
  };
  static const Entry table[] = {
      {draw_collectives, {"all_reduce_sum", "all_reduce_max", "reduce_scatter", "all_gather", "all_reduce_in_place"}},
      {draw_parameters, {"broadcast_parameters", "all_reduce_gradients", "all_reduce_buckets", "accumulate_buckets"}},
      {draw_linear, {"column_parallel_forward", "column_parallel_backward", "row_parallel_linear"}},
      {draw_mlp, {"parallel_mlp"}},
      {draw_attention, {"parallel_attention"}},
      {draw_block, {"parallel_block", "tensor_parallel_block", "sequence_parallel_block"}},
      {draw_embedding, {"vocab_parallel_embedding"}},
      {draw_cross_entropy, {"vocab_parallel_cross_entropy"}},
      {draw_rows, {"row_collectives"}},
      {draw_ring, {"ring_attention_causal", "ring_attention_full"}},
      {draw_zero, {"zero_stage1", "zero_stage2", "zero_stage3", "zero_uneven_tied", "zero_clipping"}},
      {draw_pipeline, {"pipeline_gpipe", "pipeline_1f1b", "pipeline_few_micro_batches", "pipeline_recompute"}},
      {draw_experts, {"expert_plan", "expert_exchange", "expert_dispatch_combine"}},
      {draw_expert_layer, {"expert_layer", "expert_layer_top_one", "expert_layer_skewed", "expert_layer_capacity"}},
      {draw_decode_attention, {"decode_attention"}},
      {draw_engine, {"engine_decode"}},
      {draw_mla, {"mla_decode"}},
      {draw_serving, {"serve_batched", "serve_disaggregated"}},
      {draw_cache_pages, {"cache_pages"}},
      {draw_capstone, {"capstone_one_rank", "capstone_one_rank_moe", "capstone_dp2", "capstone_tp2", "capstone_pp2",
                       "capstone_pp2_micro_batches", "capstone_ep2", "capstone_dp2_tp2", "capstone_dp2_pp2", "capstone_tp2_pp2", "capstone_dp2_ep2", "capstone_tp2_ep2",
                       "capstone_dp2_tp2_pp2", "capstone_tp2_pp2_ep2"}},
  };
  for (const Entry& e : table)
    for (const char* n : e.names)
      if (name == n) return e.draw;
  return nullptr;
}

std::function<std::string(const std::vector<Bytes>&)> judge_layer(const std::vector<Tensors>& want, std::size_t whole,
                                                                  const std::string& reference, double of_largest,
                                                                  double floor) {
  return [=](const std::vector<Bytes>& got) -> std::string {
    for (std::size_t r = 0; r < want.size(); ++r) {
      double largest = 0;  // over all the rank's tensors
      for (const auto& t : want[r])
        for (float v : t.second) largest = std::max(largest, static_cast<double>(std::abs(v)));
      std::size_t at = 0;
      for (const auto& [name, w] : want[r]) {
        double top = 1e-3 * largest;
        for (float v : w) top = std::max(top, static_cast<double>(std::abs(v)));
        for (std::size_t i = 0; i < w.size(); ++i) {
          const double g = float_at(got[r], at + i);
          if (!(std::abs(g - w[i]) <= std::max(of_largest * top, floor * largest) + 1e-4 * std::abs(w[i])))
            return "rank " + std::to_string(r) + ": " + name + ", element " + std::to_string(i) + ": got " + std::to_string(g) +
                   ", " + reference + " " + std::to_string(w[i]);
        }
        at += w.size();
      }
      if (whole > 0 && std::memcmp(got[r].data(), got[0].data(), 2 * whole * sizeof(float)) != 0)
        return "rank " + std::to_string(r) + "'s y or dx differs from rank 0's";
    }
    return "";
  };
}


void put_model(Case& c, const k2c::model::ModelConfig& m, std::uint64_t seed) {
  const std::int64_t v[] = {m.vocab, m.d_model, m.n_layers, m.q_heads, m.kv_heads, m.d_ff, m.seq_len, m.tied_head};
  std::copy(std::begin(v), std::end(v), c.args + 4);
  c.args[12] = static_cast<std::int64_t>(seed >> 1);
}

Bytes floats(const std::vector<float>& v) {
  Bytes b(v.size() * sizeof(float));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

float float_at(const Bytes& b, std::size_t i) {
  float v;
  std::memcpy(&v, b.data() + i * sizeof(float), sizeof v);
  return v;
}

}  // namespace k2c::rank_witness
