// autograder/witness/rank_cases_training.cpp — k2c_rank_witness's cases whose reference is the
// model library's: module 13's ZeRO steps, 14's parallel MLP, attention and blocks, 15's pipeline
// schedules, 16's blocks and 18's grids. The checker's reference is the unsplit model (or layer) in this process, on the library's CPU
// backend (compiled into the checker: no student code, and no library a test program could have
// replaced).
//
// The model, in args[4 .. 11] for all: vocab, d_model, n_layers, q_heads, kv_heads, d_ff,
// seq_len, tied head (0/1); args[12] the seed its parameters are drawn from.
//
// AdamW's epsilon. Where ranks add gradients in another order than one process, an element's
// gradient differs in its last bits, and AdamW divides its step by |g| + ε: at the default ε of
// 1e-8, an element whose gradient is near ε takes a good part of a learning rate from a rounding
// difference, which no tolerance that still catches a wrong reduction absorbs (random small models
// showed single elements off by 9e-5 after three steps). The checks that step an optimizer over such
// sums (ZeRO, the capstone) therefore train with ε = kEps = 1e-3, where a step moves by at most
// lr/ε times a gradient's difference: every tolerance below then held with ten times less, over
// 35 rounds or more of every check. Every rank is sent ε.
//
// parallel_attention (module 14)
//   args: 0 d_model, 1 q_heads, 2 kv_heads (both multiples of the ranks), 3 batch B, 4 T, 12 the
//   weights' seed. As parallel_mlp, with tensor_parallel::ParallelAttention "attn" (positions
//   0 .. T − 1): y, dx, then the gradients of attn.wq, wk, wv (this rank's heads' rows) and wo
//   (their columns). Reference: model::Attention whole.
//
// parallel_block (module 14), tensor_parallel_block and sequence_parallel_block (module 16)
//   args and input as k2c/model/dist_testing.h's witness_blocks reads them: one or two dense
//   blocks (heads and d_ff multiples of the ranks), this rank's rows of x and dy (all of them, or
//   its 1/n under sequence parallelism, T then a multiple of n), and the parameters to answer by
//   name. Module 16's checks run residual dropout 0.1 at a drawn row offset, seed and step: its
//   masks are keyed on rows' places in the global batch, so each rank's must be one process's.
//   The answer is the rank's rows of y and dx, then per block the gradients of norm1 and norm2
//   (whole) and of the attention's and MLP's weights as module 14 cuts them. Reference:
//   model::Block whole, judged as parallel_mlp (y and dx compared across ranks only where every
//   rank holds all rows).
//
// parallel_mlp (module 14)
//   args: 0 d_model, 1 d_ff (a multiple of the ranks), 2 tokens N, 12 the weights' seed. Every
//   rank gets x [N, d] then dy [N, d]; it builds tensor_parallel::ParallelMlp "mlp" over all the
//   ranks, materializes its parameters from the seed (its slices of the weights one process would
//   make), runs forward and backward, and answers y and dx [N, d] (whole), then the gradients of
//   "mlp.gate.weight", "mlp.up.weight" and "mlp.down.weight" as it holds them: rows r·F/n.. of
//   gate and up [F, d], columns r·F/n.. of down [d, F]. Reference: model::Mlp whole, in fp32; sums
//   cut over ranks add in another order, so each tensor within 1e-5 of its largest |value| plus
//   1e-4 relative; y and dx the same bits on every rank.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include "k2c/core/random.h"
#include "k2c/model/block.h"
#include "k2c/model/data.h"
#include "k2c/model/layers.h"
#include "k2c/model/ops.h"
#include "k2c/model/optim.h"
#include "k2c/model/params.h"
#include "k2c/model/testing.h"
#include "k2c/model/train.h"
#include "k2c/testing/compare.h"
#include "k2c/model/transformer.h"
#include "k2c/model/work_counter.h"
#include "pipeline_harness.h"  // the contract's split of blocks over stages
#include "rank_cases.h"
#include "stage.h"             // the layers a stage holds (course code)

namespace k2c::rank_witness {

namespace {

namespace km = k2c::model;

constexpr float kEps = 1e-3f;

// A small model in turn: tiny (one head of 2 or 4, a handful of tokens), small with odd sizes,
// and the tests' size. `min_layers`: the pipeline needs a block per stage.
km::ModelConfig draw_model(int index, int min_layers, std::mt19937_64& rng) {
  km::ModelConfig c;
  const int shape = index % 3;
  c.kv_heads = 1 + static_cast<int>(rng() % 2);
  c.q_heads = c.kv_heads * (shape == 0 ? 1 : 1 + static_cast<int>(rng() % 2));
  const int head = shape == 0 ? 2 : 2 * (1 + static_cast<int>(rng() % (shape == 1 ? 4 : 8)));
  c.d_model = c.q_heads * head;
  c.vocab = shape == 0 ? 3 + static_cast<int>(rng() % 5) : shape == 1 ? 5 + static_cast<int>(rng() % 60) : 200 + static_cast<int>(rng() % 57);
  c.n_layers = min_layers + static_cast<int>(rng() % (shape == 0 ? 1 : 3));
  c.d_ff = shape == 0 ? 1 + static_cast<std::int64_t>(rng() % 3) : 3 + static_cast<std::int64_t>(rng() % (shape == 1 ? 30 : 120));
  c.seq_len = shape == 0 ? 1 + static_cast<int>(rng() % 3) : shape == 1 ? 3 + static_cast<int>(rng() % 9) : 16 + static_cast<int>(rng() % 17);
  c.check();
  return c;
}

std::string count(std::int64_t n, const std::string& thing) {
  return std::to_string(n) + " " + thing + (n == 1 ? "" : thing.back() == 'h' ? "es" : "s");
}

std::string describe(const km::ModelConfig& m) {
  return "d " + std::to_string(m.d_model) + ", " + count(m.n_layers, "block") + ", " + std::to_string(m.q_heads) +
         "/" + std::to_string(m.kv_heads) + " heads, ff " + std::to_string(m.d_ff) + ", vocab " + std::to_string(m.vocab) +
         ", T " + std::to_string(m.seq_len) + (m.tied_head ? ", tied head" : "");
}

std::vector<std::int32_t> tokens(std::size_t count, int vocab, std::uint64_t seed) {
  std::vector<std::int32_t> t(count);
  for (std::size_t i = 0; i < count; ++i) t[i] = static_cast<std::int32_t>(k2c::mix64(seed + i) % static_cast<std::uint64_t>(vocab));
  return t;
}

km::Tensor upload(km::Ops& ops, km::MemoryLedger& ledger, const std::vector<std::int32_t>& v) {
  km::Tensor t(ops.memory(), ledger, km::Category::activations, {static_cast<std::int64_t>(v.size())}, km::DType::i32);
  if (!v.empty()) ops.upload(t, v.data());
  return t;
}

km::Tensor upload_floats(km::Ops& ops, km::MemoryLedger& ledger, const std::vector<float>& v, km::Shape shape) {
  km::Tensor t(ops.memory(), ledger, km::Category::activations, shape, km::DType::f32);
  if (!v.empty()) ops.upload(t, v.data());
  return t;
}

std::vector<float> host(km::Ops& ops, const km::Tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  if (!v.empty()) ops.download(v.data(), t);
  return v;
}

template <class T>
void append(Bytes& b, const T* v, std::size_t count) {
  const std::size_t at = b.size();
  b.resize(at + count * sizeof(T));
  if (count) std::memcpy(b.data() + at, v, count * sizeof(T));
}

double double_at(const Bytes& b, std::size_t i) {
  double v;
  std::memcpy(&v, b.data() + i * sizeof(double), sizeof v);
  return v;
}

// A layer check's x and dy (count values each, in [-1, 1], from `data`), sent to every rank one
// after the other.
std::pair<std::vector<float>, std::vector<float>> send_x_dy(Case& c, int n, std::int64_t count, std::uint64_t data) {
  std::vector<float> x(count), dy(count);
  for (std::int64_t i = 0; i < count; ++i) x[i] = k2c::uniform_at(data, i, -1.0f, 1.0f), dy[i] = k2c::uniform_at(data + 1, i, -1.0f, 1.0f);
  Bytes in;
  append(in, x.data(), x.size());
  append(in, dy.data(), dy.size());
  c.in.assign(n, in);
  return {x, dy};
}

}  // namespace

Case draw_zero(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int stage = kind == "zero_stage1" ? 1 : kind == "zero_stage2" ? 2 : kind == "zero_stage3" ? 3 : 1 + static_cast<int>(rng() % 3);
  const bool prefetch = rng() % 2, clipping = kind == "zero_clipping";
  km::ModelConfig m = draw_model(index, 1, rng);
  // Uneven shards: units of a few elements (some smaller than the ranks), a head tied or not.
  if (kind == "zero_uneven_tied") {
    m.vocab = 3 + static_cast<int>(rng() % 6), m.d_model = 2, m.q_heads = m.kv_heads = 1, m.d_ff = 1 + rng() % 3;
    m.tied_head = rng() % 2 == 0 || index == 0;
  }
  const int steps = 2, rows = 1 + static_cast<int>(rng() % 2);
  const std::uint64_t seed = rng();
  // A clip well under any gradient norm of these models at their first steps, so it always acts;
  // in millionths, as the rank reads it.
  const std::int64_t clip_millionths = clipping ? 1000 * (1 + static_cast<std::int64_t>(rng() % 9)) : 0;
  const double clip = static_cast<double>(clip_millionths) / 1e6;
  Case c;
  c.args[0] = stage, c.args[1] = prefetch, c.args[2] = clip_millionths, c.args[3] = steps;
  c.args[13] = rows, c.args[14] = std::bit_cast<std::int32_t>(kEps);
  put_model(c, m, seed);
  c.what = kind + ", stage " + std::to_string(stage) + (stage == 3 ? (prefetch ? " with prefetch" : " without prefetch") : "") +
           (clipping ? ", clip " + std::to_string(clip) : "") + ", " + count(steps, "step") + " of " +
           count(rows, "row") + " per rank, " + describe(m) + " on " + std::to_string(n) + " ranks";
  const std::size_t per = static_cast<std::size_t>(rows) * m.seq_len;
  const std::uint64_t data = rng();
  std::vector<std::vector<std::vector<std::int32_t>>> ids(steps), targets(steps);  // [step][rank]
  c.in.resize(n);
  for (int s = 0; s < steps; ++s)
    for (int r = 0; r < n; ++r) {
      ids[s].push_back(tokens(per, m.vocab, data + 1000003u * (2 * (s * n + r))));
      targets[s].push_back(tokens(per, m.vocab, data + 1000003u * (2 * (s * n + r) + 1)));
      append(c.in[r], ids[s][r].data(), per);
      append(c.in[r], targets[s][r].data(), per);
    }

  // The reference, one process.
  km::Ops& ops = km::cpu_ops();
  km::MemoryLedger ledger, activations;
  km::ParamList params;
  km::Transformer model(params, m);
  km::Context ctx{ops, activations, params};
  params.materialize(ops, ledger, static_cast<std::uint64_t>(c.args[12]));
  km::AdamW adam(params, ops, ledger, {.eps = kEps});
  std::vector<std::vector<double>> loss(steps, std::vector<double>(n));
  std::vector<double> norm(steps);  // with clipping: the whole gradient's norm before each step's clip
  const float scale = 1.0f / static_cast<float>(n * per);
  for (int s = 0; s < steps; ++s) {
    params.zero_grads(ops);
    for (int r = 0; r < n; ++r)
      loss[s][r] = model.train_step(ctx, upload(ops, activations, ids[s][r]), upload(ops, activations, targets[s][r]), rows, scale);
    if (clipping) norm[s] = km::clip_grad_norm(params, ops, clip);
    adam.step(1e-2f);
  }
  const std::vector<float> values = host(ops, params.flat_values());
  const int norms = clipping ? steps : 0;  // the answer: losses, then grad_norm() per step with clipping, then values
  for (int r = 0; r < n; ++r) c.out_bytes.push_back((steps + norms) * sizeof(double) + values.size() * sizeof(float));

  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      for (int s = 0; s < steps; ++s) {
        const double g = double_at(got[r], s), w = loss[s][r];
        if (!(std::abs(g - w) <= 1e-5 * std::abs(w) + 1e-9))
          return rank + ": the loss of step " + std::to_string(s) + " is " + std::to_string(g) + ", one process's " + std::to_string(w);
      }
      for (int s = 0; s < norms; ++s) {  // summed in another order (shards, then ranks): the test's 1e-6
        const double g = double_at(got[r], steps + s), w = norm[s];
        if (!(std::abs(g - w) <= 1e-6 * w))
          return rank + ": grad_norm() at step " + std::to_string(s) + " is " + std::to_string(g) + ", one process's " + std::to_string(w);
      }
      const std::size_t at = (steps + norms) * sizeof(double);
      for (std::size_t i = 0; i < values.size(); ++i) {
        float g;
        std::memcpy(&g, got[r].data() + at + i * sizeof(float), sizeof g);
        if (!(std::abs(g - values[i]) <= 1e-6f + 1e-4f * std::abs(values[i])))
          return rank + ": after " + std::to_string(steps) + " steps, parameter element " + std::to_string(i) + " is " +
                 std::to_string(g) + ", data parallelism's " + std::to_string(values[i]);
      }
      if (got[r] != got[0] && std::memcmp(got[r].data() + at, got[0].data() + at, values.size() * sizeof(float)) != 0)
        return rank + "'s parameters differ from rank 0's";
    }
    return "";
  };
  return c;
}

Case draw_pipeline(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool one_f_one_b = kind == "pipeline_1f1b" || (kind != "pipeline_gpipe" && rng() % 2);
  const bool recompute = kind == "pipeline_recompute";
  const int m = kind == "pipeline_few_micro_batches" ? 1 + static_cast<int>(rng() % std::max(1, n - 1))
                : index % 3 == 0                      ? 1 + static_cast<int>(rng() % 2)
                                                      : n + static_cast<int>(rng() % (2 * n));
  const int rows = 1 + static_cast<int>(rng() % 2);
  const km::ModelConfig model_config = draw_model(index, n, rng);
  const std::uint64_t seed = rng(), data = rng();
  const std::int64_t dropout_seed = static_cast<std::int64_t>(rng() >> 1), step = static_cast<std::int64_t>(rng() % 1000);
  const std::int64_t dropout_millionths = index % 3 == 0 ? 0 : 100000;
  const float dropout = static_cast<float>(dropout_millionths) / 1e6f;  // as the rank reads it
  Case c;
  c.args[0] = one_f_one_b, c.args[1] = recompute, c.args[2] = m, c.args[3] = rows;
  put_model(c, model_config, seed);
  c.args[13] = dropout_seed, c.args[14] = step, c.args[15] = dropout_millionths;
  c.what = kind + ", " + (one_f_one_b ? "1F1B" : "GPipe") + (recompute ? " with recomputation" : "") + ", " +
           count(m, "micro-batch") + " of " + count(rows, "row") + ", dropout " +
           (dropout > 0 ? "0.1" : "off") + ", " + describe(model_config) + " on " + std::to_string(n) + " stages";

  const std::size_t per = static_cast<std::size_t>(rows) * model_config.seq_len;
  std::vector<std::vector<std::int32_t>> ids, targets;
  Bytes in;
  for (int k = 0; k < m; ++k) {
    ids.push_back(tokens(per, model_config.vocab, data + 1000003u * (2 * k)));
    targets.push_back(tokens(per, model_config.vocab, data + 1000003u * (2 * k + 1)));
    append(in, ids[k].data(), per);
    append(in, targets[k].data(), per);
  }
  c.in.assign(n, in);

  // The reference: the unsplit model, the micro-batches one after the other.
  km::Ops& ops = km::cpu_ops();
  km::MemoryLedger ledger;
  km::ParamList params;
  km::Transformer model(params, model_config);
  km::Context ctx{ops, ledger, params};
  params.materialize(ops, ledger, static_cast<std::uint64_t>(c.args[12]));
  ctx.dropout = dropout;
  ctx.seed = static_cast<std::uint64_t>(dropout_seed);
  ctx.step = static_cast<std::uint64_t>(step);
  params.zero_grads(ops);
  double loss = 0;
  for (int k = 0; k < m; ++k) {
    ctx.row_offset = static_cast<std::int64_t>(k) * rows;
    loss += model.train_step(ctx, upload(ops, ledger, ids[k]), upload(ops, ledger, targets[k]), rows,
                             1.0f / static_cast<float>(m * per)) /
            static_cast<double>(per);
  }
  loss /= m;
  std::map<std::string, std::vector<float>> grads;
  for (km::ParamId id = 0; id < params.size(); ++id) grads[params.info(id).name] = host(ops, params.grad(id));

  // Each stage's answer: its loss, then the gradients of the parameters its Stage registers.
  std::vector<Bytes> want(n);
  for (int s = 0; s < n; ++s) {
    km::ParamList stage_params;
    const pipeline_stage::Stage stage(stage_params, model_config, k2c::pipeline_harness::split(model_config.n_layers, n, s), s, n);
    const double l = s == n - 1 ? loss : 0.0;
    append(want[s], &l, 1);
    for (km::ParamId id = 0; id < stage_params.size(); ++id) {
      const std::vector<float>& g = grads.at(stage_params.info(id).name);
      append(want[s], g.data(), g.size());
    }
    c.out_bytes.push_back(want[s].size());
  }

  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int s = 0; s < n; ++s) {
      if (std::memcmp(got[s].data(), want[s].data(), sizeof(double)) != 0)
        return "stage " + std::to_string(s) + ": the step's loss is " + std::to_string(double_at(got[s], 0)) + ", not " +
               std::to_string(double_at(want[s], 0)) + (s == n - 1 ? " (the unsplit model's)" : " (only the last stage has one)");
      for (std::size_t i = sizeof(double); i < want[s].size(); i += sizeof(float))
        if (std::memcmp(got[s].data() + i, want[s].data() + i, sizeof(float)) != 0)
          return "stage " + std::to_string(s) + ": gradient element " + std::to_string((i - sizeof(double)) / sizeof(float)) +
                 " of the stage's parameters differs from the unsplit model's (bit for bit: same operations, same order)";
    }
    return "";
  };
  return c;
}

Case draw_capstone(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  // How closely a grid must follow one process: to the bit where it runs the same operations in
  // the same order (one rank; pipeline stages of one micro-batch for the loss), else within the
  // tolerances below.
  enum class Match { bits, loss_bits, tolerance };
  struct Grid {
    const char* kind;
    int dp, tp, pp, ep, micro_batches;
    bool moe, balanced;
    Match match;
  };
  static const Grid grids[] = {{"capstone_one_rank", 1, 1, 1, 1, 1, false, false, Match::bits},
                               {"capstone_one_rank_moe", 1, 1, 1, 1, 1, true, true, Match::bits},
                               {"capstone_dp2", 2, 1, 1, 1, 1, false, false, Match::tolerance},
                               {"capstone_tp2", 1, 2, 1, 1, 1, false, false, Match::tolerance},
                               {"capstone_pp2", 1, 1, 2, 1, 1, false, false, Match::loss_bits},
                               {"capstone_pp2_micro_batches", 1, 1, 2, 1, 4, false, false, Match::tolerance},
                               // With ep alone the ep group is every data rank: one process's balance term.
                               {"capstone_ep2", 1, 1, 1, 2, 1, true, true, Match::tolerance},
                               {"capstone_dp2_tp2", 2, 2, 1, 1, 1, false, false, Match::tolerance},
                               {"capstone_dp2_pp2", 2, 1, 2, 1, 2, false, false, Match::tolerance},
                               {"capstone_tp2_pp2", 1, 2, 2, 1, 2, false, false, Match::tolerance},
                               // Under dp × ep each ep group balances its own tokens: no balance term.
                               {"capstone_dp2_ep2", 2, 1, 1, 2, 1, true, false, Match::tolerance},
                               {"capstone_tp2_ep2", 1, 2, 1, 2, 1, true, true, Match::tolerance},
                               {"capstone_dp2_tp2_pp2", 2, 2, 2, 1, 2, false, false, Match::tolerance},
                               {"capstone_tp2_pp2_ep2", 1, 2, 2, 2, 1, true, true, Match::tolerance}};
  const Grid* g = nullptr;
  for (const Grid& candidate : grids)
    if (kind == candidate.kind) g = &candidate;
  if (g == nullptr || n != g->dp * g->tp * g->pp * g->ep)
    throw std::invalid_argument(kind + " needs " + std::to_string(g ? g->dp * g->tp * g->pp * g->ep : 0) + " ranks, not " +
                                std::to_string(n));
  // A model every axis can cut: heads, d_ff and vocabulary even, at least two blocks; in turn
  // tiny, small and the tests' size.
  const int shape = index % 3;
  km::TrainConfig t;
  km::ModelConfig& m = t.model;
  m.kv_heads = 2;
  m.q_heads = 2 * (1 + static_cast<int>(rng() % 2));
  m.d_model = m.q_heads * (shape == 0 ? 2 : 2 * (1 + static_cast<int>(rng() % (shape == 1 ? 4 : 8))));
  m.vocab = 2 * (shape == 0 ? 2 + static_cast<int>(rng() % 3) : shape == 1 ? 4 + static_cast<int>(rng() % 30) : 100 + static_cast<int>(rng() % 30));
  m.n_layers = 2 + static_cast<int>(rng() % 2);
  m.d_ff = 2 * (shape == 0 ? 1 : 2 + static_cast<std::int64_t>(rng() % (shape == 1 ? 12 : 60)));
  m.seq_len = shape == 0 ? 1 + static_cast<int>(rng() % 3) : shape == 1 ? 3 + static_cast<int>(rng() % 9) : 16 + static_cast<int>(rng() % 17);
  if (g->moe) {
    m.experts = g->ep * (1 + static_cast<int>(rng() % 3));
    m.top_k = 1 + static_cast<int>(rng() % std::min(2, m.experts));
    m.d_expert = 2 + static_cast<std::int64_t>(rng() % (shape == 0 ? 3 : 30));
    m.shared_experts = static_cast<int>(rng() % 2);
    m.balance_coef = g->balanced ? 0.01f : 0.0f;
  }
  m.check();
  const int data_ranks = g->dp * g->ep;
  t.steps = 3;
  t.batch = data_ranks * g->micro_batches * (1 + static_cast<int>(rng() % 2));
  t.lr = 3e-3f, t.min_lr = 3e-4f, t.warmup = 1, t.clip = shape == 0 ? 0.0f : 0.5f;
  t.eval_every = 0;
  t.adamw.eps = kEps;
  t.seed = rng() >> 1;

  Case c;
  c.args[0] = g->dp, c.args[1] = g->tp, c.args[2] = g->pp, c.args[3] = g->ep;
  put_model(c, m, t.seed << 1);
  c.args[13] = g->micro_batches, c.args[14] = t.steps, c.args[15] = t.batch;
  c.what = kind + ", " + count(t.steps, "step") + " of " + count(t.batch, "sequence") + ", " + describe(m) +
           (g->moe ? ", " + std::to_string(m.experts) + " experts of " + std::to_string(m.d_expert) + ", top " +
                         std::to_string(m.top_k) + (m.shared_experts ? " and a shared one" : "")
                   : std::string()) +
           (t.clip > 0 ? ", clip 0.5" : ", no clip") + ", " + count(g->micro_batches, "micro-batch");
  const std::size_t stream = 64 * static_cast<std::size_t>(m.seq_len) + 64;
  std::vector<std::uint16_t> tokens(stream);
  const std::uint64_t data = rng();
  for (std::size_t i = 0; i < stream; ++i) tokens[i] = static_cast<std::uint16_t>(k2c::mix64(data + i) % static_cast<std::uint64_t>(m.vocab));
  const std::int64_t fields[] = {m.experts,
                                 m.top_k,
                                 m.d_expert,
                                 m.shared_experts,
                                 std::bit_cast<std::int32_t>(m.balance_coef),
                                 std::bit_cast<std::int32_t>(t.lr),
                                 std::bit_cast<std::int32_t>(t.min_lr),
                                 std::bit_cast<std::int32_t>(t.clip),
                                 std::bit_cast<std::int32_t>(t.adamw.eps),
                                 t.warmup,
                                 static_cast<std::int64_t>(stream)};
  Bytes in;
  append(in, fields, std::size(fields));
  append(in, tokens.data(), tokens.size());
  c.in.assign(n, in);

  // The reference: one process, the library's trainer, on the same tokens.
  const auto loader = [&](bool validation) {
    return km::TokenLoader(tokens, static_cast<std::uint32_t>(m.vocab),
                           {m.seq_len, t.batch, 0, 1, validation ? 102u : 101u});
  };
  km::WorkCounter counter(km::cpu_ops());
  km::Trainer trainer(t, counter, loader(false), loader(true));
  std::vector<km::StepRecord> records;
  for (int s = 0; s < t.steps; ++s) records.push_back(trainer.step());
  std::vector<double> values(static_cast<std::size_t>(trainer.params().numel()));
  {
    const std::vector<float> v = host(km::cpu_ops(), trainer.params().flat_values());
    values.assign(v.begin(), v.end());
  }
  // After the steps' records and the parameters, each rank's count of its steps' work (products'
  // FLOPs and parameter elements stepped, k2c/model/work_counter.h), held to the grid's split of
  // one process's.
  const std::size_t head = 3 * sizeof(double) * t.steps, work = head + values.size() * sizeof(float);
  c.out_bytes.assign(n, work + 2 * sizeof(double));
  const double one_flops = counter.flops(), one_stepped = static_cast<double>(counter.stepped());

  const Match match = g->match;
  c.check = [=](const std::vector<Bytes>& got) -> std::string {
    for (int r = 0; r < n; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      for (int s = 0; s < static_cast<int>(records.size()); ++s) {
        const double loss = double_at(got[r], 3 * s), norm = double_at(got[r], 3 * s + 1), lr = double_at(got[r], 3 * s + 2);
        const km::StepRecord& w = records[s];
        const std::string step = rank + ", step " + std::to_string(s) + ": ";
        const bool loss_bits = match != Match::tolerance, norm_bits = match == Match::bits;
        if (loss_bits ? std::memcmp(&loss, &w.loss, sizeof loss) != 0 : !(std::abs(loss - w.loss) <= 2e-6 * std::max(1.0, w.loss)))
          return step + "loss " + std::to_string(loss) + ", one process's " + std::to_string(w.loss) + (loss_bits ? " (bit for bit)" : "");
        if (norm_bits ? std::memcmp(&norm, &w.grad_norm, sizeof norm) != 0 : !(std::abs(norm - w.grad_norm) <= 5e-6 * w.grad_norm))
          return step + "gradient norm " + std::to_string(norm) + ", one process's " + std::to_string(w.grad_norm) +
                 (norm_bits ? " (bit for bit)" : "");
        if (lr != w.lr) return step + "learning rate " + std::to_string(lr) + ", the schedule's " + std::to_string(w.lr);
        if (std::memcmp(got[r].data() + 24 * s, got[0].data() + 24 * s, 16) != 0)
          return step + "loss or norm not the same bits as rank 0's";
      }
      std::vector<float> v(values.size());
      if (!v.empty()) std::memcpy(v.data(), got[r].data() + head, v.size() * sizeof(float));
      if (match == Match::bits) {
        for (std::size_t i = 0; i < v.size(); ++i)
          if (!(static_cast<double>(v[i]) == values[i]))
            return rank + ": parameter " + std::to_string(i) + " after " + count(static_cast<int>(records.size()), "step") +
                   " is " + std::to_string(v[i]) + ", one process's " + std::to_string(values[i]) + " (bit for bit)";
        continue;
      }
      const k2c::CompareReport rep = k2c::compare(v, values, {5e-5, 1e-4, 5e-6});
      if (!rep.ok) return rank + ": the parameters after " + count(static_cast<int>(records.size()), "step") + ": " + rep.summary();
    }
    std::vector<double> flops(n), stepped(n);
    for (int r = 0; r < n; ++r) {
      std::memcpy(&flops[r], got[r].data() + work, sizeof(double));
      std::memcpy(&stepped[r], got[r].data() + work + sizeof(double), sizeof(double));
    }
    return km::work_split_problem(g->dp, g->tp, g->pp, g->ep, flops, stepped, one_flops, one_stepped);
  };
  return c;
}

Case draw_mlp(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int shape = index % 3;
  const std::int64_t d = shape == 0 ? 1 : shape == 1 ? 3 + static_cast<std::int64_t>(rng() % 18) : 32 + static_cast<std::int64_t>(rng() % 33);
  const std::int64_t F = n * (shape == 0 ? 1 : shape == 1 ? 1 + static_cast<std::int64_t>(rng() % 8) : 8 + static_cast<std::int64_t>(rng() % 25));
  const std::int64_t N = shape == 0 ? 1 : shape == 1 ? 2 + static_cast<std::int64_t>(rng() % 16) : 64 + static_cast<std::int64_t>(rng() % 97);
  const std::uint64_t seed = rng() >> 1, data = rng();
  Case c;
  c.args[0] = d, c.args[1] = F, c.args[2] = N, c.args[12] = static_cast<std::int64_t>(seed);
  c.what = kind + ", " + count(N, "token") + ", d " + std::to_string(d) + ", d_ff " + std::to_string(F) + " on " +
           std::to_string(n) + " ranks";
  const auto [x, dy] = send_x_dy(c, n, N * d, data);

  // The reference: the whole MLP, one process.
  km::testing::Side ref;
  const km::Mlp mlp(ref.params, "mlp", d, F);
  ref.materialize(seed);
  km::Tensor xt = ref.upload(x, {N, d}), dyt = ref.upload(dy, {N, d}), y = ref.tensor({N, d}), dx = ref.tensor({N, d});
  km::Mlp::Saved saved;
  mlp.forward(ref.ctx, xt, y, saved);
  ref.params.zero_grads(ref.ops());
  ref.params.begin_backward();
  mlp.backward(ref.ctx, xt, saved, dyt, dx);
  ref.params.end_backward();
  const std::vector<float> gate = ref.grad("mlp.gate.weight"), up = ref.grad("mlp.up.weight"), down = ref.grad("mlp.down.weight");
  // Each rank's answer, tensor by tensor: name, values.
  std::vector<Tensors> want(n);
  const std::int64_t L = F / n;
  for (int r = 0; r < n; ++r) {
    want[r] = {{"y", ref.download(y)},
               {"dx", ref.download(dx)},
               {"mlp.gate.weight gradient", row_slice(gate, d, r * L, L)},
               {"mlp.up.weight gradient", row_slice(up, d, r * L, L)},
               {"mlp.down.weight gradient", column_slice(down, F, r * L, L)}};
    std::size_t bytes = 0;
    for (const auto& t : want[r]) bytes += t.second.size() * sizeof(float);
    c.out_bytes.push_back(bytes);
  }
  c.check = judge_layer(want, static_cast<std::size_t>(N * d), "the whole MLP's");
  return c;
}

Case draw_attention(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const int shape = index % 3;
  km::AttentionConfig a;
  a.kv_heads = n * (shape == 2 ? 1 + static_cast<int>(rng() % 2) : 1);
  a.q_heads = a.kv_heads * (shape == 0 ? 1 : 1 + static_cast<int>(rng() % 3));
  const int hd = shape == 0 ? 2 : 2 * (1 + static_cast<int>(rng() % (shape == 1 ? 3 : 8)));
  a.d_model = a.q_heads * hd;
  const int B = shape == 0 ? 1 : 1 + static_cast<int>(rng() % 2);
  const int T = shape == 0 ? 1 : shape == 1 ? 2 + static_cast<int>(rng() % 8) : 16 + static_cast<int>(rng() % 33);
  const std::int64_t N = std::int64_t{B} * T, d = a.d_model;
  const std::uint64_t seed = rng() >> 1, data = rng();
  Case c;
  c.args[0] = d, c.args[1] = a.q_heads, c.args[2] = a.kv_heads, c.args[3] = B, c.args[4] = T;
  c.args[12] = static_cast<std::int64_t>(seed);
  c.what = kind + ", " + std::to_string(B) + " × " + count(T, "token") + ", " + std::to_string(a.q_heads) + "/" +
           std::to_string(a.kv_heads) + " heads of " + std::to_string(hd) + " on " + std::to_string(n) + " ranks";
  const auto [x, dy] = send_x_dy(c, n, N * d, data);

  // The reference: the whole attention layer, one process.
  km::testing::Side ref;
  const km::Attention attention(ref.params, "attn", a);
  ref.materialize(seed);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T));
  for (int t = 0; t < T; ++t) pos[t] = t;
  km::Tensor xt = ref.upload(x, {N, d}), dyt = ref.upload(dy, {N, d}), positions = ref.upload_ids(pos);
  km::Tensor y = ref.tensor({N, d}), dx = ref.tensor({N, d});
  km::Attention::Saved saved;
  attention.forward(ref.ctx, xt, positions, B, y, saved);
  ref.params.zero_grads(ref.ops());
  ref.params.begin_backward();
  attention.backward(ref.ctx, xt, positions, B, saved, dyt, dx);
  ref.params.end_backward();
  std::map<std::string, std::vector<float>> grads;
  for (km::ParamId id = 0; id < ref.params.size(); ++id) grads[ref.params.info(id).name] = ref.download(ref.params.grad(id));
  // Rank r's heads: q heads [r·H/n, ..), key-value heads [r·Hkv/n, ..); wq, wk, wv rows of theirs,
  // wo its columns.
  const std::int64_t q_rows = std::int64_t{a.q_heads} / n * hd, kv_rows = std::int64_t{a.kv_heads} / n * hd;
  std::vector<Tensors> want(n);
  for (int r = 0; r < n; ++r) {
    want[r] = {{"y", ref.download(y)},
               {"dx", ref.download(dx)},
               {"attn.wq.weight gradient", row_slice(grads.at("attn.wq.weight"), d, r * q_rows, q_rows)},
               {"attn.wk.weight gradient", row_slice(grads.at("attn.wk.weight"), d, r * kv_rows, kv_rows)},
               {"attn.wv.weight gradient", row_slice(grads.at("attn.wv.weight"), d, r * kv_rows, kv_rows)},
               {"attn.wo.weight gradient", column_slice(grads.at("attn.wo.weight"), std::int64_t{a.q_heads} * hd, r * q_rows, q_rows)}};
    std::size_t bytes = 0;
    for (const auto& t : want[r]) bytes += t.second.size() * sizeof(float);
    c.out_bytes.push_back(bytes);
  }
  c.check = judge_layer(want, static_cast<std::size_t>(N * d), "the whole attention's");
  return c;
}

Case draw_block(const std::string& kind, int n, int index, std::mt19937_64& rng) {
  const bool sequence_parallel = kind == "sequence_parallel_block", dropout_on = kind != "parallel_block";
  const int shape = index % 3;
  km::BlockConfig config;
  km::AttentionConfig& a = config.attention;
  a.kv_heads = n * (shape == 2 ? 1 + static_cast<int>(rng() % 2) : 1);
  a.q_heads = a.kv_heads * (shape == 0 ? 1 : 1 + static_cast<int>(rng() % 2));
  const int hd = shape == 0 ? 2 : 2 * (1 + static_cast<int>(rng() % (shape == 1 ? 3 : 6)));
  a.d_model = a.q_heads * hd;
  config.d_ff = n * (shape == 0 ? 1 : 1 + static_cast<std::int64_t>(rng() % (shape == 1 ? 6 : 20)));
  // Sequence parallelism cuts batch·T rows into n equal blocks: T a multiple of n there.
  const int step_t = sequence_parallel ? n : 1;
  const int B = shape == 0 ? 1 : 1 + static_cast<int>(rng() % 2);
  const int T = step_t * (shape == 0 ? 1 : shape == 1 ? 1 + static_cast<int>(rng() % 5) : 4 + static_cast<int>(rng() % 6));
  const int blocks = shape == 0 ? 1 : 1 + static_cast<int>(rng() % 2);
  const std::int64_t N = std::int64_t{B} * T, d = a.d_model, M = sequence_parallel ? N / n : N;
  const float dropout = dropout_on ? 0.1f : 0.0f;
  const std::int64_t row_offset = static_cast<std::int64_t>(rng() % 64), seed = static_cast<std::int64_t>(rng() >> 1),
                     step = static_cast<std::int64_t>(rng() % 1000);
  const std::uint64_t weights = rng() >> 1, data = rng();
  Case c;
  const std::int64_t args[] = {d, a.q_heads, a.kv_heads, B, T, config.d_ff, blocks, std::bit_cast<std::int32_t>(dropout),
                               row_offset, seed, step, sequence_parallel, static_cast<std::int64_t>(weights)};
  std::copy(std::begin(args), std::end(args), c.args);
  c.what = kind + ", " + count(blocks, "block") + ", " + std::to_string(B) + " × " + count(T, "token") + ", " +
           std::to_string(a.q_heads) + "/" + std::to_string(a.kv_heads) + " heads of " + std::to_string(hd) + ", d_ff " +
           std::to_string(config.d_ff) + (dropout_on ? ", dropout 0.1" : "") + " on " + std::to_string(n) + " ranks";

  // The reference: the library's blocks whole, one process, the same dropout masks (keyed on the
  // rows' places in the global batch).
  std::vector<float> x(static_cast<std::size_t>(N * d)), dy(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = k2c::uniform_at(data, i, -1.0f, 1.0f), dy[i] = k2c::uniform_at(data + 1, i, -1.0f, 1.0f);
  km::testing::Side ref;
  km::Context& ctx = ref.ctx;
  ctx.dropout = dropout, ctx.row_offset = row_offset, ctx.seed = static_cast<std::uint64_t>(seed), ctx.step = static_cast<std::uint64_t>(step);
  std::vector<km::Block> whole;
  for (int b = 0; b < blocks; ++b) whole.emplace_back(ref.params, "blocks." + std::to_string(b), config, b);
  ref.materialize(weights);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T));
  for (int t = 0; t < T; ++t) pos[t] = t;
  const km::Tensor positions = ref.upload_ids(pos);
  std::vector<km::Tensor> acts;
  std::vector<km::Block::Saved> saved(static_cast<std::size_t>(blocks));
  acts.push_back(ref.upload(x, {N, d}));
  for (int b = 0; b < blocks; ++b) {
    whole[b].forward(ctx, acts[b], positions, B, false, saved[b]);
    acts.push_back(ref.tensor({N, d}));
    ref.ops().copy(acts[b + 1], saved[b].out);
  }
  km::Tensor grad = ref.upload(dy, {N, d});
  ref.params.zero_grads(ref.ops());
  ref.params.begin_backward();
  for (int b = blocks - 1; b >= 0; --b) {
    km::Tensor dx = ref.tensor({N, d});
    whole[b].backward(ctx, acts[b], positions, B, saved[b], grad, dx);
    grad = std::move(dx);
  }
  ref.params.end_backward();
  std::map<std::string, std::vector<float>> grads;
  for (km::ParamId id = 0; id < ref.params.size(); ++id) grads[ref.params.info(id).name] = ref.download(ref.params.grad(id));
  const std::vector<float> y = ref.download(acts.back()), dx = ref.download(grad);

  // Each rank's answer: its rows of y and dx, then per block the norms' gradients whole and the
  // attention's and MLP's as module 14 cuts them (this rank's heads, its slice of d_ff).
  const std::int64_t q_rows = std::int64_t{a.q_heads} / n * hd, kv_rows = std::int64_t{a.kv_heads} / n * hd,
                     L = config.d_ff / n;
  std::string names;
  std::vector<Tensors> want(n);
  for (int r = 0; r < n; ++r) {
    const std::int64_t first = sequence_parallel ? r * M : 0;
    want[r] = {{"y (rows " + std::to_string(first) + ".." + std::to_string(first + M) + ")", row_slice(y, d, first, M)},
               {"dx (rows " + std::to_string(first) + ".." + std::to_string(first + M) + ")", row_slice(dx, d, first, M)}};
    for (int b = 0; b < blocks; ++b) {
      const std::string p = "blocks." + std::to_string(b) + ".";
      const std::pair<std::string, std::vector<float>> tensors[] = {
          {p + "norm1.weight", grads.at(p + "norm1.weight")},
          {p + "attn.wq.weight", row_slice(grads.at(p + "attn.wq.weight"), d, r * q_rows, q_rows)},
          {p + "attn.wk.weight", row_slice(grads.at(p + "attn.wk.weight"), d, r * kv_rows, kv_rows)},
          {p + "attn.wv.weight", row_slice(grads.at(p + "attn.wv.weight"), d, r * kv_rows, kv_rows)},
          {p + "attn.wo.weight", column_slice(grads.at(p + "attn.wo.weight"), std::int64_t{a.q_heads} * hd, r * q_rows, q_rows)},
          {p + "norm2.weight", grads.at(p + "norm2.weight")},
          {p + "mlp.gate.weight", row_slice(grads.at(p + "mlp.gate.weight"), d, r * L, L)},
          {p + "mlp.up.weight", row_slice(grads.at(p + "mlp.up.weight"), d, r * L, L)},
          {p + "mlp.down.weight", column_slice(grads.at(p + "mlp.down.weight"), config.d_ff, r * L, L)}};
      for (const auto& [name, values] : tensors) {
        want[r].push_back({name + " gradient", values});
        if (r == 0) names += name + "\n";
      }
    }
    std::size_t bytes = 0;
    for (const auto& t : want[r]) bytes += t.second.size() * sizeof(float);
    c.out_bytes.push_back(bytes);
  }
  c.in.resize(n);
  for (int r = 0; r < n; ++r) {
    const std::int64_t first = sequence_parallel ? r * M : 0;
    const std::vector<float> xr = row_slice(x, d, first, M), dyr = row_slice(dy, d, first, M);
    append(c.in[r], xr.data(), xr.size());
    append(c.in[r], dyr.data(), dyr.size());
    append(c.in[r], names.data(), names.size());
  }
  c.check = judge_layer(want, sequence_parallel ? 0 : static_cast<std::size_t>(N * d), "the whole blocks'");
  return c;
}

}  // namespace k2c::rank_witness
