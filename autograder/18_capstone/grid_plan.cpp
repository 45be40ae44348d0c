// grid_plan.cpp — see grid_plan.h.
#include "grid_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "k2c/dist/grid.h"
#include "k2c/model/transformer.h"

namespace k2c::capstone {

namespace km = k2c::model;
using dist::Axis;

namespace {

// What the wire bytes are for (StagePlan::wire), in the tables' order.
constexpr const char* kPurposes[] = {"gradients", "tp", "pp", "ep", "loss"};

// The label of the group along `axes` (k2c/dist/grid.h's axes_label: the axes with more than one
// rank, or "self"), as a CountingCommunicator named by group_label records it.
std::string label_of(const dist::GridShape& g, std::initializer_list<Axis> axes) {
  unsigned mask = 0;
  for (Axis a : axes) mask |= 1u << static_cast<int>(a);
  return dist::axes_label(g, mask);
}

// Ranks in the group a label names.
int ranks_of(const dist::GridShape& g, const std::string& label) {
  if (label == "world") return g.total();
  int n = 1;
  for (int a = 0; a < 5; ++a)
    if (label.find(dist::to_string(static_cast<Axis>(a))) != std::string::npos) n *= g.extent(static_cast<Axis>(a));
  return n;
}

// Bytes in the unit that reads best: "16 B", "1.5 KiB", "129.0 MiB", "3.1 GiB".
std::string size_of(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char text[32];
  std::snprintf(text, sizeof text, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return text;
}

// Adds `bytes` of `op` on the group `label` to a stage's traffic (nothing for 0 bytes), and what
// they put on the rank's links to the wire bytes of `purpose`.
void add_traffic(StagePlan& s, const dist::GridShape& g, const std::string& label, const std::string& op,
                 std::uint64_t bytes, const std::string& purpose) {
  if (bytes == 0) return;
  s.traffic[label][op] += bytes;
  s.wire[purpose] += wire_bytes(op, bytes, ranks_of(g, label));
}

bool has(const std::string& name, const char* part) { return name.find(part) != std::string::npos; }

// The block index of "blocks.<i>.…", or -1.
int block_of_name(const std::string& name) {
  if (name.rfind("blocks.", 0) != 0) return -1;
  return std::stoi(name.substr(7));
}

// How many ranks one parameter is cut over, by the contracts of 14 (tp) and 17 (ep). Under tp a
// dense block's projections, the embedding and the head are cut; a mixture of experts is whole on
// every tp rank (only its attention is 14's); expert weights are cut over ep.
std::int64_t cut_of(const std::string& name, const dist::GridShape& g, bool moe) {
  if (has(name, ".moe.")) return has(name, ".moe.experts.") ? g.ep : 1;
  if (g.tp == 1) return 1;
  if (name == "embed.weight" || name == "head.weight") return g.tp;
  if (has(name, ".attn.w")) return g.tp;
  if (!moe && has(name, ".mlp.")) return g.tp;
  return 1;
}

void refuse(bool bad, const std::string& why) {
  if (bad) throw std::invalid_argument("plan: " + why);
}

void check(const CapstoneConfig& c) {
  const dist::GridShape& g = c.grid;
  const km::ModelConfig& m = c.train.model;
  m.check();
  const std::string grid = grid_name(g);
  refuse(g.dp < 1 || g.tp < 1 || g.pp < 1 || g.ep < 1 || g.cp != 1, "grid " + grid + ": every axis >= 1, and no cp");
  const std::int64_t ranks = std::int64_t{g.dp} * g.tp * g.pp * g.ep, D = std::int64_t{g.dp} * g.ep;
  refuse(ranks > kMaxPlanRanks, "grid " + grid + " has " + std::to_string(ranks) + " ranks; the plan takes at most " +
                                    std::to_string(kMaxPlanRanks));
  refuse(c.train.batch < 1 || c.micro_batches < 1 || c.train.batch % (D * c.micro_batches) != 0,
         "batch " + std::to_string(c.train.batch) + " must split into " + std::to_string(D) + " data ranks x " +
             std::to_string(c.micro_batches) + " micro-batches");
  refuse(c.train.activations != km::DType::f32 && c.train.activations != km::DType::bf16,
         "activations are f32 or bf16, not " + km::to_string(c.train.activations));
  refuse(c.train.residual != km::DType::f32 && c.train.residual != km::DType::bf16,
         "the residual stream is f32 or bf16, not " + km::to_string(c.train.residual));
  refuse(c.train.residual == km::DType::bf16 && (g.tp > 1 || g.ep > 1 || c.train.dropout > 0),
         "a bf16 residual stream needs tp = ep = 1 and no dropout (grid " + grid + ")");
  refuse(g.ep > 1 && m.experts == 0, "ep " + std::to_string(g.ep) + " needs a mixture of experts");
  refuse(g.ep > 1 && m.experts % g.ep != 0,
         std::to_string(m.experts) + " experts do not split over ep " + std::to_string(g.ep));
  refuse((g.tp > 1 || g.ep > 1) && c.train.dropout > 0, "dropout needs tp = ep = 1 (grid " + grid + ")");
  refuse(g.pp > m.n_layers, std::to_string(g.pp) + " stages for " + std::to_string(m.n_layers) + " blocks");
  refuse(m.q_heads % g.tp || m.kv_heads % g.tp || m.d_ff % g.tp || m.vocab % g.tp,
         "tp " + std::to_string(g.tp) + " must divide the heads (" + std::to_string(m.q_heads) + ", " +
             std::to_string(m.kv_heads) + " kv), d_ff " + std::to_string(m.d_ff) + " and the vocabulary " +
             std::to_string(m.vocab));
  refuse(m.tied_head && (g.pp > 1 || g.tp > 1), "a tied head needs pp = tp = 1 (grid " + grid + ")");
  refuse(c.zero_stage < 0 || c.zero_stage > 3, "zero_stage " + std::to_string(c.zero_stage) + " (0: off; 1, 2 or 3)");
  refuse(c.zero_stage > 0 && (g.tp > 1 || g.pp > 1 || g.ep > 1 || c.micro_batches != 1),
         "ZeRO runs on dp-only grids with one micro-batch (grid " + grid + ")");
}

// Module 13's step on a dp-only grid: the units are the Transformer's layers, each padded to a
// multiple of the dp ranks; rank 0's shard is the first block of each. Stages 2 and 3 keep, beside
// the shard, room for two units (the contract's bound: one filling while one is reduced, or one
// running while the next is gathered), which the reference keeps allocated between steps at the
// largest unit's size; with a tied head, a third gradient bucket (below).
void plan_zero(const CapstoneConfig& c, const km::ParamList& whole, const km::Transformer& model, StagePlan& s) {
  const int n = c.grid.dp;
  const int layers = model.layer_count();
  std::vector<std::uint64_t> padded_unit(static_cast<std::size_t>(layers), 0);  // n·B, 0 for a layer of none
  std::uint64_t all = 0, padded = 0, shard = 0, real = 0, largest = 0;
  for (int l = 0; l < layers; ++l) {
    const km::Transformer::LayerParams p = model.layer_params(l);
    std::uint64_t S = 0;
    for (km::ParamId id = p.first; id < p.last; ++id) S += static_cast<std::uint64_t>(whole.info(id).shape.numel());
    if (S == 0) continue;
    const std::uint64_t B = dist::block_of(S, n, 0).size;
    padded_unit[static_cast<std::size_t>(l)] = n * B;
    all += S;
    padded += n * B;
    shard += B;
    real += std::min(B, S);
    largest = std::max(largest, n * B);
  }
  // Stage 3 gathers the units each layer uses (a tied head the embedding's) before its forward,
  // and again before its backward, but for the last layer's, kept from one to the other.
  std::uint64_t gathered = 0;
  for (int l = 0; l < layers; ++l)
    for (int u : model.layer_uses(l)) gathered += (l == layers - 1 ? 1 : 2) * padded_unit[static_cast<std::size_t>(u)];
  // The rank's shard and its two units' room; a tied head's gradient bucket, filled first by the
  // head and last by the embedding, stays for the whole backward: a third.
  const std::uint64_t values = c.zero_stage == 3 ? shard + 2 * largest : all;
  const std::uint64_t grads = c.zero_stage == 1 ? all : shard + (c.train.model.tied_head ? 3 : 2) * largest;
  s.values = static_cast<std::int64_t>(values);
  s.trainable = static_cast<std::int64_t>(real);
  s.param_bytes = 4 * values;
  s.grad_bytes = 4 * grads;
  s.optimizer_bytes = 8 * real;
  // On one rank too: Zero calls its collectives on a group of one (counted, moving nothing).
  const std::string dp = label_of(c.grid, {Axis::dp});
  add_traffic(s, c.grid, dp, "reduce_scatter", 4 * padded, "gradients");
  add_traffic(s, c.grid, dp, "all_gather", 4 * (c.zero_stage == 3 ? gathered : padded), "gradients");
  if (c.train.clip > 0) add_traffic(s, c.grid, dp, "all_reduce", 8, "loss");
}

// The activations' peak on one rank of a stage, in bytes: an estimate of what the ledger's
// activations category reaches in a step (grid_plan_test.cpp holds it to 15 %). Each micro-batch
// in flight keeps what its backward will read, as the reference's layers keep it (a = the bytes of
// the run's activation dtype, r those of its residual stream, which module 14's and 17's layers
// keep in fp32 as they keep their activations; expert rows as
// if the router spread the tokens evenly); on top of that comes the largest transient: the
// logits at the end of the last stage's forward, or the gradients a block's backward makes.
std::uint64_t activation_peak(const CapstoneConfig& c, const StagePlan& s, std::int64_t tokens) {
  const dist::GridShape& g = c.grid;
  const km::ModelConfig& m = c.train.model;
  const double N = static_cast<double>(tokens), d = m.d_model, t = g.tp, H = m.q_heads;
  const double kv = static_cast<double>(m.kv_heads) * (m.d_model / m.q_heads), F = static_cast<double>(m.d_ff);
  const double a = c.train.activations == km::DType::bf16 ? 2 : 4, V = m.vocab;
  const double r = c.train.residual == km::DType::bf16 ? 2 : 4;  // refused under tp and ep
  const double E = m.experts, k = m.top_k, de = static_cast<double>(m.d_expert), dsh = de * m.shared_experts;
  const bool moe = m.experts > 0, tensor = g.tp > 1, expert_kind = g.ep > 1 || (tensor && moe);
  const bool first = s.stage == 0, last = s.stage == g.pp - 1;
  const int blocks = s.last_block - s.first_block;
  const int stages = g.pp, m_b = c.micro_batches;
  const int in_flight = c.zero_stage > 0 ? 1
                        : c.one_f_one_b  ? std::min(stages - s.stage, m_b)
                                         : m_b;
  // Attention's saved tensors and its backward's gradients: the library's (a) or 14's (fp32, cut).
  const bool tp_attention = tensor;
  const double attn_b = tp_attention ? 4 : a, cut = tp_attention ? t : 1;
  const double attn_saved = N * ((2 * d + 2 * kv) / cut * attn_b + 4 * H / cut);
  const double attn_grads = N * (2 * d + 2 * kv) / cut * attn_b;
  // A mixture of experts: the router's probabilities, the routing (5 numbers per assignment in the
  // library's layer, 2 in 17's plan), the rows (gate, up and h in the activation dtype, the output
  // fp32; the input gathered in the activation dtype by the library's layer, fp32 from 17's
  // exchange with a rounded copy under bf16, and 17 keeps the rows returned), the shared expert's
  // activations (and 17 its output; the library's layer writes it into its own output).
  const double R = N * k;
  const double rows = expert_kind ? R * ((12 + (a < 4 ? a : 0)) * d + 3 * a * de) : R * ((a + 4) * d + 3 * a * de);
  const double moe_saved = N * 4 * E + R * 4 * (expert_kind ? 2 : 5) + rows + N * (3 * dsh * a + (expert_kind ? 4 * d : 0));
  // The experts' backward: dh, dg and du in the activation dtype; the output gradient's rows (the
  // library's layer writes them in the activation dtype; 17 receives fp32 rows, rounds a copy under
  // bf16, and keeps its own copy from before its exchange); fp32 rows of R × d for the input
  // gradient and its second part.
  const double expert_grads =
      R * (3 * a * de + (expert_kind ? 16 * d + (a < 4 ? a * d : 0) : 8 * d + a * d));
  double block_saved = 0, block_grads = 0;
  if (expert_kind) {  // the capstone's own block around 17's layer
    block_saved = N * (d * a + 16 * d + (tensor ? 4 : a) * d + 8) + attn_saved + moe_saved;
    block_grads = N * 8 * d + std::max(attn_grads, expert_grads);
  } else if (tensor) {  // 14's block
    block_saved = N * (24 * d + 8) + attn_saved + N * 3 * F / t * 4;
    block_grads = N * 8 * d + std::max(attn_grads, N * 3 * F / t * 4);
  } else {  // the library's block (k2c/model/block.h)
    // The MoE's input and output stay fp32, and with dropout both branches' outputs do; dropout's
    // backward adds a mask's worth of gradient. h and out, and dh, in the residual dtype (the MoE
    // layer takes an fp32 copy of a bf16 output gradient).
    const bool dropout = c.train.dropout > 0;
    const double n2 = moe ? 4 : a, attn_out = dropout ? 4 : a, mlp_out = moe || dropout ? 4 : a;
    block_saved =
        N * ((a + n2 + attn_out + mlp_out) * d + 2 * r * d + 8) + attn_saved + (moe ? moe_saved : N * 3 * F * a);
    block_grads = N * (r * d + n2 * d + (dropout ? 4 * d : 0)) +
                  std::max(attn_grads, moe ? expert_grads + (r < 4 ? N * 4 * d : 0) : N * 3 * F * a);
  }
  const double head_b = tensor ? 4 : a, Vr = V / t;
  double saved = blocks * block_saved + 4.0 * m.seq_len;  // and the positions (i32)
  if (first) saved += N * r * d + (tensor ? N * 8 : 0);  // the embedding's output (and 14's ids and mask)
  else saved += N * 4 * d;                               // the activation received
  if (last) saved += N * (head_b * d + 4 + head_b * Vr);  // the final norm's output and rstd, dlogits
  const double ids = static_cast<double>(m_b) * 2 * N * 4;  // every micro-batch's ids and targets
  const double logits = last ? N * head_b * Vr : 0;
  const double grads = N * 2 * r * d + block_grads;  // the block's input and output gradients, and its own
  return static_cast<std::uint64_t>(ids + in_flight * saved + std::max(logits, grads));
}

}  // namespace

km::ModelConfig capstone_preset(const std::string& name) {
  const bool big = name == "dense-135m" || name == "moe-135m";
  if (!big && name != "tiny" && name != "tiny-moe")
    throw std::invalid_argument("--config " + name + ": one of tiny, tiny-moe, dense-135m, moe-135m");
  km::ModelConfig m = big ? km::ModelConfig::dense_135m() : km::ModelConfig::tiny();
  if (name == "tiny-moe" || name == "moe-135m") {
    m.experts = big ? 32 : 4;
    m.top_k = big ? 4 : 2;
    m.shared_experts = 1;
    m.d_expert = big ? 512 : 32;
  }
  return m;
}

void round_vocab_to_tp(CapstoneConfig& c) {
  const int tp = std::max(1, c.grid.tp);
  c.train.model.vocab = (c.train.model.vocab + tp - 1) / tp * tp;
}

GridPlan plan_grid(const CapstoneConfig& c) {
  check(c);
  const dist::GridShape& g = c.grid;
  const km::ModelConfig& m = c.train.model;
  GridPlan plan;
  plan.config = c;
  const int D = g.dp * g.ep;
  const std::int64_t N = static_cast<std::int64_t>(c.train.batch / D / c.micro_batches) * m.seq_len;
  plan.tokens_per_micro_batch = N;
  const std::uint64_t mb = static_cast<std::uint64_t>(c.micro_batches);
  const std::uint64_t act = 4 * static_cast<std::uint64_t>(N) * static_cast<std::uint64_t>(m.d_model);  // N·d fp32
  const bool moe = m.experts > 0;
  // The expert kind of block (17's layer): under ep, or a mixture of experts under tp.
  const bool expert_blocks = g.ep > 1 || (g.tp > 1 && moe);

  km::ParamList whole;
  const km::Transformer model(whole, m);
  for (int stage = 0; stage < g.pp; ++stage) {
    StagePlan& s = plan.stages.emplace_back();
    const dist::Block span = dist::block_of(static_cast<std::size_t>(m.n_layers), g.pp, stage);
    s.stage = stage;
    s.first_block = static_cast<int>(span.offset);
    s.last_block = static_cast<int>(span.offset + span.size);
    // The loss over the world; without ZeRO the gradient norm too (ZeRO's is over dp, above).
    if (g.total() > 1) add_traffic(s, g, "world", "all_reduce", c.zero_stage > 0 ? 8 : 16, "loss");
    s.activation_bytes = activation_peak(c, s, N);
    if (c.zero_stage > 0) {
      plan_zero(c, whole, model, s);
      continue;
    }
    const bool first = stage == 0, last = stage == g.pp - 1;
    std::int64_t dense = 0, experts = 0;  // trainable elements: reduced over the data ranks, over dp
    for (km::ParamId param = 0, count = whole.size(); param < count; ++param) {
      const km::ParamInfo& p = whole.info(param);
      const int block = block_of_name(p.name);
      const bool here = block >= 0 ? block >= s.first_block && block < s.last_block
                                   : (p.name.rfind("embed.", 0) == 0 ? first : last);
      if (!here) continue;
      const std::int64_t n = p.shape.numel() / cut_of(p.name, g, moe);
      s.values += n;
      if (p.frozen) continue;
      s.trainable += n;
      (has(p.name, ".moe.experts.") ? experts : dense) += n;
    }
    s.param_bytes = 4 * static_cast<std::uint64_t>(s.values);
    s.grad_bytes = 4 * static_cast<std::uint64_t>(s.trainable);
    s.optimizer_bytes = 8 * static_cast<std::uint64_t>(s.trainable);

    // Gradients (once a step, after the last micro-batch): DataParallel's buckets over dp; under
    // ep the dense ones over the data ranks (dp × ep) and the experts' over dp.
    if (g.ep > 1) {
      add_traffic(s, g, label_of(g, {Axis::dp, Axis::ep}), "all_reduce", 4 * static_cast<std::uint64_t>(dense),
                  "gradients");
      if (g.dp > 1) add_traffic(s, g, "dp", "all_reduce", 4 * static_cast<std::uint64_t>(experts), "gradients");
    } else if (g.dp > 1) {
      add_traffic(s, g, "dp", "all_reduce", 4 * static_cast<std::uint64_t>(s.trainable), "gradients");
    }
    const std::uint64_t blocks = static_cast<std::uint64_t>(s.last_block - s.first_block);
    // Tensor parallelism, per micro-batch: the embedding's rows, each block's g and f (one each
    // way around a mixture of experts: only attention is 14's), the head's input gradient, and
    // the cross-entropy's three reductions of one float a token.
    if (g.tp > 1) {
      std::uint64_t tp = mb * blocks * (moe ? 2 : 4) * act;
      if (first) tp += mb * act;
      if (last) tp += mb * (act + 3 * 4 * static_cast<std::uint64_t>(N));
      add_traffic(s, g, "tp", "all_reduce", tp, "tp");
    }
    // The pipeline: each micro-batch's activation forward, its gradient back.
    if (g.pp > 1) add_traffic(s, g, "pp", "send", mb * ((last ? 0 : act) + (first ? 0 : act)), "pp");
    // Experts, per MoE layer and micro-batch: the counts, the routing statistics, four exchanges
    // of rows (on a group of one rank under tp alone, where no row leaves).
    if (expert_blocks) {
      const std::string ep = label_of(g, {Axis::ep});
      const std::uint64_t E = static_cast<std::uint64_t>(m.experts);
      add_traffic(s, g, ep, "all_to_all", mb * blocks * 4 * E, "ep");
      add_traffic(s, g, ep, "all_reduce", mb * blocks * 4 * (2 * E + 1), "ep");
      const double away = static_cast<double>(N) * m.top_k * (g.ep - 1) / g.ep;
      add_traffic(s, g, ep, "all_to_all_v", mb * blocks * 4 * static_cast<std::uint64_t>(4.0 * m.d_model * away + 0.5),
                  "ep");
      if (g.ep > 1) s.estimated.insert({ep, "all_to_all_v"});
    }
  }
  return plan;
}

double wire_bytes(const std::string& op, std::uint64_t bytes, int n) {
  const double b = static_cast<double>(bytes), f = n > 1 ? static_cast<double>(n - 1) / n : 0.0;
  if (op == "all_reduce") return 2 * f * b;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return f * b;
  return n > 1 ? b : 0.0;  // rows to other ranks, messages sent
}

std::string describe(const GridPlan& plan) {
  const CapstoneConfig& c = plan.config;
  const km::ModelConfig& m = c.train.model;
  std::ostringstream os;
  char line[256];
  os << "plan: " << m.describe() << "\n";
  std::snprintf(line, sizeof line,
                "grid %s on %d ranks, batch %d x %d tokens, %d micro-batch%s (%s), %s activations%s: %lld tokens a "
                "micro-batch on each data rank%s\n",
                grid_name(c.grid).c_str(), c.grid.total(), c.train.batch, m.seq_len, c.micro_batches,
                c.micro_batches == 1 ? "" : "es", c.one_f_one_b ? "1F1B" : "GPipe",
                c.train.activations == km::DType::bf16 ? "bf16" : "f32",
                c.train.residual == km::DType::bf16 ? " (bf16 residual stream)" : "",
                static_cast<long long>(plan.tokens_per_micro_batch),
                c.zero_stage > 0 ? (", ZeRO stage " + std::to_string(c.zero_stage)).c_str() : "");
  os << line;
  os << "memory of one rank (parameters and gradients 4 bytes an element, AdamW 8; under ZeRO, dp rank 0's):\n";
  std::snprintf(line, sizeof line, "  %-6s %-8s %14s %12s %12s %12s %12s %14s\n", "stage", "blocks", "elements",
                "params", "gradients", "AdamW", "state", "activations~");
  os << line;
  for (const StagePlan& s : plan.stages) {
    const std::string blocks = std::to_string(s.first_block) + "-" + std::to_string(s.last_block - 1);
    std::snprintf(line, sizeof line, "  %-6d %-8s %14lld %12s %12s %12s %12s %14s\n", s.stage, blocks.c_str(),
                  static_cast<long long>(s.values), size_of(s.param_bytes).c_str(), size_of(s.grad_bytes).c_str(),
                  size_of(s.optimizer_bytes).c_str(), size_of(s.state_bytes()).c_str(),
                  size_of(s.activation_bytes).c_str());
    os << line;
  }
  os << "  activations~: their peak in a step, estimated from what each layer keeps for backward\n";
  os << "traffic of one rank in one step (quoted: as k2c/dist/counting.h counts; wire: what leaves the rank):\n";
  std::snprintf(line, sizeof line, "  %-6s %-8s %-6s %-15s %13s %12s\n", "stage", "group", "ranks", "operation",
                "quoted", "wire");
  os << line;
  bool estimates = false;
  for (const StagePlan& s : plan.stages) {
    double wire = 0;
    for (const auto& [group, ops] : s.traffic)
      for (const auto& [op, bytes] : ops) {
        const int n = ranks_of(c.grid, group);
        const bool guess = s.estimated.count({group, op}) > 0;
        estimates = estimates || guess;
        wire += wire_bytes(op, bytes, n);
        std::snprintf(line, sizeof line, "  %-6d %-8s %-6d %-15s %12s%1s %12s\n", s.stage, group.c_str(), n,
                      op.c_str(), size_of(static_cast<double>(bytes)).c_str(), guess ? "~" : "",
                      size_of(wire_bytes(op, bytes, n)).c_str());
        os << line;
      }
    std::snprintf(line, sizeof line, "  %-6d %-8s %-6s %-15s %13s %12s\n", s.stage, "(total)", "", "", "",
                  size_of(wire).c_str());
    os << line;
  }
  if (estimates) os << "  ~ rows to other ranks as if the router spread the tokens evenly\n";
  return os.str();
}

std::uint64_t peak_memory(const GridPlan& plan) {
  std::uint64_t most = 0;
  for (const StagePlan& s : plan.stages) most = std::max(most, s.state_bytes() + s.activation_bytes);
  return most;
}

double wire_per_step(const GridPlan& plan, const std::string& purpose) {
  double most = 0;
  for (const StagePlan& s : plan.stages) {
    double sum = 0;
    for (const auto& [what, bytes] : s.wire)
      if (purpose.empty() || what == purpose) sum += bytes;
    most = std::max(most, sum);
  }
  return most;
}

double bubble(const GridPlan& plan) {
  const int p = plan.config.grid.pp, m = plan.config.micro_batches;
  return static_cast<double>(p - 1) / (m + p - 1);
}

std::string plans_json(const std::vector<GridPlan>& plans) {
  nlohmann::json grids = nlohmann::json::array();
  for (const GridPlan& p : plans) {
    const CapstoneConfig& c = p.config;
    nlohmann::json stages = nlohmann::json::array();
    for (const StagePlan& s : p.stages) {
      nlohmann::json traffic = nlohmann::json::object(), estimated = nlohmann::json::array();
      for (const auto& [group, ops] : s.traffic)
        for (const auto& [op, bytes] : ops) traffic[group + " " + op] = bytes;
      for (const auto& [group, op] : s.estimated) estimated.push_back(group + " " + op);
      stages.push_back({{"stage", s.stage}, {"blocks", {s.first_block, s.last_block}}, {"values", s.values},
                        {"param_bytes", s.param_bytes}, {"grad_bytes", s.grad_bytes},
                        {"optimizer_bytes", s.optimizer_bytes}, {"activation_bytes", s.activation_bytes},
                        {"traffic", traffic}, {"estimated", estimated}});
    }
    nlohmann::json wire = nlohmann::json::object();
    for (const char* purpose : kPurposes) wire[purpose] = wire_per_step(p, purpose);
    wire["all"] = wire_per_step(p);
    grids.push_back({{"grid", grid_name(c.grid)}, {"ranks", c.grid.total()}, {"zero_stage", c.zero_stage},
                     {"micro_batches", c.micro_batches}, {"tokens_per_micro_batch", p.tokens_per_micro_batch},
                     {"memory_bytes", peak_memory(p)}, {"wire_bytes", wire}, {"bubble", bubble(p)},
                     {"stages", stages}});
  }
  nlohmann::json out = {{"grids", grids}};
  if (!plans.empty()) {
    const CapstoneConfig& c = plans.front().config;
    out["model"] = c.train.model.describe();
    out["batch"] = c.train.batch;
    out["seq_len"] = c.train.model.seq_len;
    out["activations"] = c.train.activations == km::DType::bf16 ? "bf16" : "f32";
    out["residual"] = c.train.residual == km::DType::bf16 ? "bf16" : "f32";
  }
  return out.dump(2) + "\n";
}

std::vector<GridPlan> plan_grids(const CapstoneConfig& base, int ranks) {
  std::vector<GridPlan> plans;
  const bool moe = base.train.model.experts > 0;
  for (int tp = 1; tp <= ranks; ++tp)
    for (int pp = 1; tp * pp <= ranks; ++pp)
      for (int ep = 1; tp * pp * ep <= ranks; ++ep) {
        if (ranks % (tp * pp * ep) || (ep > 1 && !moe)) continue;
        CapstoneConfig c = base;
        c.grid = {.dp = ranks / (tp * pp * ep), .pp = pp, .ep = ep, .cp = 1, .tp = tp};
        if (c.grid.dp != ranks) c.zero_stage = 0;  // ZeRO only where the grid is dp alone
        round_vocab_to_tp(c);
        // base's micro-batches, or as many as a data rank's rows split into (ZeRO takes one).
        const int rows = c.train.batch % (c.grid.dp * ep) ? 0 : c.train.batch / (c.grid.dp * ep);
        while (c.micro_batches > 1 && (rows % c.micro_batches || c.zero_stage > 0)) --c.micro_batches;
        try {
          plans.push_back(plan_grid(c));
        } catch (const std::invalid_argument&) {  // does not fit: left out
        }
      }
  std::stable_sort(plans.begin(), plans.end(),
                   [](const GridPlan& a, const GridPlan& b) { return wire_per_step(a) < wire_per_step(b); });
  return plans;
}

std::string describe_grids(const std::vector<GridPlan>& plans) {
  std::ostringstream os;
  char line[256];
  if (plans.empty()) return "no grid of these ranks fits this model and batch\n";
  const CapstoneConfig& c = plans.front().config;
  os << "grids of " << c.grid.total() << " ranks for " << c.train.model.describe() << ", batch " << c.train.batch
     << " x " << c.train.model.seq_len << ", " << (c.train.activations == km::DType::bf16 ? "bf16" : "f32")
     << " activations" << (c.train.residual == km::DType::bf16 ? " (bf16 residual stream)" : "") << ", "
     << (c.one_f_one_b ? "1F1B" : "GPipe") << "\n";
  os << "m: micro-batches a step (as asked, fewer where a data rank's rows do not split into them); memory\n"
        "(state + activations~) and wire bytes a step by purpose, each figure its busiest stage's:\n";
  std::snprintf(line, sizeof line, "  %-16s %3s %11s %11s %11s %11s %11s %11s %7s\n", "grid", "m", "memory",
                "gradients", "tp", "pp", "ep", "total", "bubble");
  os << line;
  for (const GridPlan& p : plans) {
    std::string name = grid_name(p.config.grid);
    if (p.config.zero_stage > 0) name += " zero" + std::to_string(p.config.zero_stage);
    std::snprintf(line, sizeof line, "  %-16s %3d %11s %11s %11s %11s %11s %11s %6.0f%%\n", name.c_str(),
                  p.config.micro_batches, size_of(static_cast<double>(peak_memory(p))).c_str(),
                  size_of(wire_per_step(p, "gradients")).c_str(), size_of(wire_per_step(p, "tp")).c_str(),
                  size_of(wire_per_step(p, "pp")).c_str(), size_of(wire_per_step(p, "ep")).c_str(),
                  size_of(wire_per_step(p)).c_str(), 100.0 * bubble(p));
    os << line;
  }
  os << "  gradients: DataParallel's all-reduces can hide under backward, and most of ZeRO's traffic\n"
        "  under its passes; under ep the gradients are reduced after backward. tp's, pp's and ep's bytes\n"
        "  are on the path of every token; bubble: the pipeline's idle share of a step\n";
  return os.str();
}

PlannedTraffic sent_bytes(const dist::TrafficTable& counts) {
  PlannedTraffic sent;
  for (const auto& [group, ops] : counts)
    for (const auto& [op, t] : ops)
      if (op != "recv" && op != "barrier" && t.bytes > 0) sent[group][op == "send_recv" ? "send" : op] += t.bytes;
  return sent;
}

std::string compare_traffic(const GridPlan& plan, const StagePlan& s, const PlannedTraffic& sent) {
  std::map<std::pair<std::string, std::string>, std::pair<std::uint64_t, std::uint64_t>> rows;  // sent, planned
  for (const auto& [group, ops] : sent)
    for (const auto& [op, bytes] : ops) rows[{group, op}].first = bytes;
  for (const auto& [group, ops] : s.traffic)
    for (const auto& [op, bytes] : ops)
      if (bytes > 0) rows[{group, op}].second = bytes;
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "  %-8s %-6s %-15s %12s %13s %8s\n", "group", "ranks", "operation", "sent",
                "planned", "ratio");
  os << line;
  for (const auto& [key, v] : rows) {
    const bool guess = s.estimated.count(key) > 0;
    char ratio[16] = "-";
    if (v.second > 0) std::snprintf(ratio, sizeof ratio, "%.3f", static_cast<double>(v.first) / v.second);
    std::snprintf(line, sizeof line, "  %-8s %-6d %-15s %12s %12s%1s %8s\n", key.first.c_str(),
                  ranks_of(plan.config.grid, key.first), key.second.c_str(), size_of(static_cast<double>(v.first)).c_str(),
                  size_of(static_cast<double>(v.second)).c_str(), guess ? "~" : "", ratio);
    os << line;
  }
  return os.str();
}

}  // namespace k2c::capstone
