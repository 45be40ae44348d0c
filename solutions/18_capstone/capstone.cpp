// solutions/18_capstone/capstone.cpp — reference solution of module 18 (contract: capstone.h).
//
// The capstone adds no algorithm; it decides where each one runs. A rank at grid coordinates
// (dp, pp, ep, tp) holds:
//
//   pipeline   blocks stage_blocks(L, pp, pp_coord) (module 15), the embedding on the first
//              stage, the final norm and head on the last; 15's train_step runs the schedule over
//              this stage, which is why the stage below derives from pipeline_stage::Stage
//   tensor     with tp > 1 every dense block is 14's ParallelBlock, the embedding 14's
//              VocabParallelEmbedding, the head a ColumnParallelLinear whose logits stay cut by
//              vocabulary into 14's vocab_parallel_cross_entropy; with tp = 1 the model
//              library's own layers, so that grid 1 is model::Trainer operation for operation
//   experts    with ep > 1, or a mixture of experts under tp > 1, every block's feed-forward is
//              17's ExpertParallelMoe (the rest of the block as model::Block builds it; under
//              tp > 1 its attention is 14's ParallelAttention over the tp group; at ep = 1 its ep
//              group is the rank alone, the MoE whole). The ep group is the ranks of one (dp, pp, tp)
//              place, so under tp × ep each tp rank runs its own ep group's MoE: tp rank t
//              exchanges tokens with the tp rank t of the other ep coordinates only. The tp ranks
//              of one ep group hold the same tokens (the activations are whole), the same expert
//              shard and the same router, and compute the same bits: the MoE is replicated over
//              tp, and nothing of it is reduced over tp
//   data       dp × ep data ranks read disjoint rows of each batch (the loader's dp_rank is the
//              data rank)
//
// Gradients, the part that is new here. A gradient must be summed over exactly the ranks that
// hold a copy of the same weight and saw different tokens:
//
//   ep = 1   every weight is copied over dp only: 12's DataParallel over the dp group, its
//            buckets started from the gradient-ready callback of the last micro-batch's backward
//            (before_backward(sync) is called by the stage, which is the only code that knows
//            when a backward starts under 15's schedule). Each rank's loss is the mean over its
//            own tokens, and DataParallel averages: the mean over the global batch.
//   ep > 1   dense weights (a tp rank's shard of them under tp) are copied over dp × ep, each
//            expert shard over dp only (and over tp, which computes it alike), so no single
//            group fits: the loss is scaled to the mean over the GLOBAL batch (1/D on top of the
//            schedule's scale) and gradients are summed, the dense ones over dp × ep, the MoE
//            layers' with 17's reduce_gradients (dense over dp × ep, experts over dp). 17's layer
//            weights its balance term by loss_scale × the group's tokens, which then is the
//            balance gradient of one ep group averaged over the dp replicas.
//
// Clipping needs the norm of the whole model's gradient, and every rank holds a different part
// of it: a weight counts on one rank only. After the reduction every dp replica holds the same
// gradients, so only dp coordinate 0 counts; a tp shard (Init::shard: a TP layer, the vocabulary
// cuts), replicated over ep, counts at ep = 0; an expert slice (Init::shard, cut over ep),
// replicated over tp, counts at tp = 0; a whole weight that tensor or expert parallelism
// replicates (norm gains, the router, the shared expert, attention under ep alone) counts at
// tp = ep = 0 only. Pipeline stages hold different weights and all count. The same rule picks
// the one rank that contributes each value to gather_values.
//
// Exactness. At grid 1 the stage runs model::Transformer's operations in its order, the norm is
// the same sum over the flat buffer, and AdamW the same call: the curve equals model::Trainer's
// bit for bit. Pipeline stages move fp32 exactly, so pp alone changes only the norm's order of
// summation. Elsewhere the gradients are sums over ranks in another order than one process's.
//
// ZeRO (zero_stage > 0). Module 13's Zero runs forward, backward, the reduce-scatters, AdamW on
// its shard and the gathers in one call on a model::Transformer, with its own hook on the layers,
// so it replaces the stage, DataParallel and the optimizer together; nothing of the pipeline or
// of tp and ep can run inside it, hence dp-only grids and one micro-batch. The loss enters at
// 1/(D·tokens), the mean over the global batch, because Zero sums where DataParallel averages;
// at 2 ranks g0/2 + g1/2 and (g0 + g1)/2 are the same bits (halving is exact), and Zero's AdamW
// per shard equals one AdamW over all, so zero_stage 0 and 1..3 give the same curve. Clipping is
// Zero's own (ZeroConfig::clip: the norm from the shards' sums of squares, in double), which
// agrees with clip_grad_norm's to about 1e-16. Checkpoints would need the AdamW shards, which
// Zero does not expose: refused.
#include "capstone.h"

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <string>

#include "data_parallel.h"
#include "expert_parallel.h"
#include "pipeline_parallel.h"
#include "tensor_parallel.h"
#include "zero.h"

namespace k2c::capstone {

namespace km = k2c::model;
namespace tp = k2c::tensor_parallel;
namespace xp = k2c::expert_parallel;
namespace pp = k2c::pipeline_parallel;
namespace ps = k2c::pipeline_stage;
using dist::Axis;
using km::Tensor;

namespace {

// ---------------------------------------------------------------------------------------------
// The grid: this rank's coordinates and its groups, each made with split() over the world.

class Grid {
 public:
  Grid(dist::Communicator& world, const dist::GridShape& shape) : world_(world), shape_(shape) {
    // k2c/dist/grid.h's layout: tp fastest, then cp, ep, pp, and dp slowest, so a tp group is a
    // run of neighbouring ranks (one node) and a dp group the most spread out.
    int r = world.rank();
    for (int a = 4; a >= 0; --a) {
      at_[static_cast<std::size_t>(a)] = r % extent(a);
      r /= extent(a);
    }
    // Every rank makes the same splits in the same order: split is a collective over the world.
    for (Axis a : {Axis::dp, Axis::pp, Axis::ep, Axis::tp}) groups_[static_cast<int>(a)] = split({a});
    dense_ = split({Axis::dp, Axis::ep});
  }
  const dist::GridShape& shape() const { return shape_; }
  int coord(Axis a) const { return at_[static_cast<std::size_t>(a)]; }
  dist::Communicator& world() const { return world_; }
  dist::Communicator& group(Axis a) const { return *groups_[static_cast<int>(a)]; }
  // dp × ep: the ranks that hold the same dense weights and saw different tokens.
  dist::Communicator& dense() const { return *dense_; }

 private:
  int extent(int a) const {  // Axis order: dp, pp, ep, cp, tp
    const int e[5] = {shape_.dp, shape_.pp, shape_.ep, shape_.cp, shape_.tp};
    return e[a];
  }
  // The ranks that share every coordinate outside `axes`, ordered by world rank (the layout's
  // order: in dp × ep, rank dp·ep_extent + ep, the data rank).
  std::unique_ptr<dist::Communicator> split(std::initializer_list<Axis> axes) {
    int color = 0;
    for (int a = 0; a < 5; ++a) {
      bool inside = false;
      for (Axis x : axes) inside = inside || static_cast<int>(x) == a;
      if (!inside) color = color * extent(a) + at_[static_cast<std::size_t>(a)];
    }
    return world_.split(color, world_.rank());
  }
  dist::Communicator& world_;
  dist::GridShape shape_;
  dist::GridCoords at_{};
  std::unique_ptr<dist::Communicator> groups_[5], dense_;
};

// ---------------------------------------------------------------------------------------------
// One block of this rank: the model library's, module 14's, or the library's attention around
// module 17's mixture of experts.

enum class BlockKind { plain, tensor, expert };

struct BlockState {
  km::Block::Saved plain;        // plain: Block keeps its output in plain.out
  tp::ParallelBlock::Saved tensor;
  struct {
    Tensor n1, h, n2, attn_out, mlp_out;
    km::RmsNorm::Saved norm1, norm2;
    km::Attention::Saved attn;
    xp::ExpertParallelMoe::Saved moe;
  } expert;
  Tensor out;                    // tensor and expert kinds
  const Tensor& output() const { return out.empty() ? plain.out : out; }
};

class GridBlock {
 public:
  GridBlock(BlockKind kind, Grid& grid, km::ParamList& params, const km::BlockConfig& c, int index)
      : kind_(kind), tensor_attn_(grid.shape().tp > 1) {
    const std::string name = "blocks." + std::to_string(index);
    switch (kind) {
      case BlockKind::plain: plain_ = km::Block(params, name, c, index); break;
      case BlockKind::tensor: tensor_ = tp::ParallelBlock(grid.group(Axis::tp), params, name, c); break;
      case BlockKind::expert:
        // model::Block's registration order and names, so the flat layout is the unsplit one's.
        norm1_ = km::RmsNorm(params, name + ".norm1", c.attention.d_model, c.norm_eps);
        norm2_ = km::RmsNorm(params, name + ".norm2", c.attention.d_model, c.norm_eps);
        if (tensor_attn_) tp_attn_ = tp::ParallelAttention(grid.group(Axis::tp), params, name + ".attn", c.attention);
        else attn_ = km::Attention(params, name + ".attn", c.attention);
        moe_ = xp::ExpertParallelMoe(grid.group(Axis::ep), params, name + ".moe", c.moe);
        break;
    }
  }

  void forward(km::Context& ctx, const Tensor& x, const Tensor& positions, int rows, BlockState& s) const {
    switch (kind_) {
      case BlockKind::plain: plain_.forward(ctx, x, positions, rows, false, s.plain); return;
      case BlockKind::tensor:
        s.out = ctx.tensor(x.shape());
        tensor_.forward(ctx, x, positions, rows, s.out, s.tensor);
        return;
      case BlockKind::expert: {
        auto& e = s.expert;
        for (Tensor* t : {&e.h, &e.n2, &e.mlp_out, &s.out}) *t = ctx.tensor(x.shape());
        // As model::Block makes them (the MoE's input n2 and output stay fp32); 14's attention
        // sums its partial outputs over tp in fp32, so under tp its output is fp32 too.
        e.n1 = ctx.activation(x.shape());
        e.attn_out = tensor_attn_ ? ctx.tensor(x.shape()) : ctx.activation(x.shape());
        norm1_.forward(ctx, x, e.n1, e.norm1);
        if (tensor_attn_) tp_attn_.forward(ctx, e.n1, positions, rows, e.attn_out, e.attn);
        else attn_.forward(ctx, e.n1, positions, rows, e.attn_out, e.attn);
        ctx.ops.add(x, e.attn_out, e.h);
        norm2_.forward(ctx, e.h, e.n2, e.norm2);
        moe_.forward(ctx, e.n2, e.mlp_out, e.moe);
        ctx.ops.add(e.h, e.mlp_out, s.out);
        return;
      }
    }
  }

  // dx = the gradient of x; parameters' gradients added.
  void backward(km::Context& ctx, const Tensor& x, const Tensor& positions, int rows, BlockState& s,
                const Tensor& dout, Tensor& dx) const {
    switch (kind_) {
      case BlockKind::plain: plain_.backward(ctx, x, positions, rows, s.plain, dout, dx); return;
      case BlockKind::tensor: tensor_.backward(ctx, x, positions, rows, s.tensor, dout, dx); return;
      case BlockKind::expert: {
        // model::Block::backward without dropout, in its order.
        auto& e = s.expert;
        Tensor dn = ctx.tensor(x.shape()), dh = ctx.tensor(x.shape());
        moe_.backward(ctx, e.n2, e.moe, dout, dn);
        norm2_.backward(ctx, e.h, e.norm2, dn, dh);
        ctx.ops.accumulate(dh, dout, 1.0f);
        if (tensor_attn_) tp_attn_.backward(ctx, e.n1, positions, rows, e.attn, dh, dn);
        else attn_.backward(ctx, e.n1, positions, rows, e.attn, dh, dn);
        norm1_.backward(ctx, x, e.norm1, dn, dx);
        ctx.ops.accumulate(dx, dh, 1.0f);
        return;
      }
    }
  }

  const xp::ExpertParallelMoe* moe() const { return kind_ == BlockKind::expert ? &moe_ : nullptr; }

 private:
  BlockKind kind_;
  bool tensor_attn_;  // expert kind under tp > 1: 14's attention
  km::Block plain_;
  tp::ParallelBlock tensor_;
  km::RmsNorm norm1_, norm2_;
  km::Attention attn_;
  tp::ParallelAttention tp_attn_;
  xp::ExpertParallelMoe moe_;
};

// ---------------------------------------------------------------------------------------------
// This rank's pipeline stage, run by module 15's schedule.

class GridStage final : public ps::Stage {
 public:
  GridStage(Grid& grid, km::ParamList& params, const km::ModelConfig& config, ps::Span span,
            BlockKind kind)
      : Stage(config, span, grid.coord(Axis::pp), grid.shape().pp), grid_(grid),
        tensor_(grid.shape().tp > 1) {
    if (config.tied_head && (grid.shape().pp > 1 || tensor_))
      throw std::invalid_argument("capstone: a tied head needs pp = tp = 1 (grid " + grid_name(grid.shape()) + ")");
    const km::Init emb{km::Init::normal, config.init_std};
    if (is_first()) {
      if (tensor_)
        vembed_ = tp::VocabParallelEmbedding(grid.group(Axis::tp), params, "embed", config.vocab, config.d_model, emb);
      else
        embed_ = km::Embedding(params, "embed", config.vocab, config.d_model, emb);
    }
    km::BlockConfig bc;
    bc.attention = {config.d_model, config.q_heads, config.kv_heads, config.rope_theta};
    bc.d_ff = config.d_ff;
    bc.norm_eps = config.norm_eps;
    bc.moe = {config.d_model, config.experts, config.top_k, config.d_expert, config.shared_experts, true,
              config.balance_coef};
    for (int i = span.first; i < span.last; ++i) blocks_.emplace_back(kind, grid, params, bc, i);
    if (is_last()) {
      final_norm_ = km::RmsNorm(params, "final_norm", config.d_model, config.norm_eps);
      if (tensor_)
        head_tp_ = tp::ColumnParallelLinear(grid.group(Axis::tp), params, "head", config.d_model, config.vocab, emb);
      else
        head_ = config.tied_head ? km::Linear::tied(params, embed_.weight())
                                 : km::Linear(params, "head", config.d_model, config.vocab, emb);
    }
  }

  // Set by the trainer before each step.
  data_parallel::DataParallel* ddp = nullptr;  // ep = 1, dp > 1
  int micro_batches = 1;
  float scale_factor = 1.0f;                   // ep > 1: 1/D, the mean over the global batch

  const std::vector<GridBlock>& blocks() const { return blocks_; }

  double forward(km::Context& ctx, const ps::MicroBatch& mb, Tensor input, float grad_scale, bool /*recompute*/,
                 Saved& saved, Tensor& output) override {
    State& s = states_[mb.index];
    s = State();
    s.input = std::move(input);
    s.grad_scale = grad_scale * scale_factor;
    const Scope scope(ctx, mb, s.grad_scale);
    const km::Shape shape = activation_shape(mb.rows);
    const std::int64_t T = config().seq_len;
    s.positions = ctx.tensor({T}, km::Category::activations, km::DType::i32);
    std::vector<std::int32_t> pos(static_cast<std::size_t>(T));
    std::iota(pos.begin(), pos.end(), 0);
    ctx.ops.upload(s.positions, pos.data());
    if (is_first()) {
      s.x0 = ctx.residual_stream(shape);
      if (tensor_) vembed_.forward(ctx, mb.ids, s.x0, s.vembed);
      else embed_.forward(ctx, mb.ids, s.x0);
    } else {
      s.input.expect(shape, "capstone stage: received activation");
    }
    s.blocks.resize(blocks_.size());
    for (std::size_t i = 0; i < blocks_.size(); ++i)
      blocks_[i].forward(ctx, block_input(s, static_cast<int>(i)), s.positions, mb.rows, s.blocks[i]);
    const Tensor& top = block_input(s, static_cast<int>(blocks_.size()));
    double loss = 0;
    if (is_last()) {
      // Under tp the head's logits go to 14's cross-entropy, which takes fp32.
      s.xf = tensor_ ? ctx.tensor(shape) : ctx.activation(shape);
      final_norm_.forward(ctx, top, s.xf, s.final_norm);
      const std::int64_t cols = tensor_ ? head_tp_.local_out() : config().vocab;
      Tensor logits = tensor_ ? ctx.tensor({shape[0], cols}) : ctx.activation({shape[0], cols});
      if (tensor_) head_tp_.forward(ctx, s.xf, logits);
      else head_.forward(ctx, s.xf, logits);
      s.dlogits = ctx.tensor(logits.shape(), km::Category::activations, logits.dtype());
      loss = tensor_ ? tp::vocab_parallel_cross_entropy(grid_.group(Axis::tp), ctx, logits, mb.targets, s.grad_scale,
                                                        s.dlogits)
                     : ctx.ops.cross_entropy(logits, mb.targets, s.grad_scale, s.dlogits);
    } else {
      output = ctx.tensor(shape);
      ctx.ops.copy(output, top);
    }
    saved.live = true;
    saved.micro_batch = mb.index;
    count_forward(mb.index);
    return loss;
  }

  void backward(km::Context& ctx, const ps::MicroBatch& mb, Saved& saved, const Tensor& dout,
                Tensor& dinput) override {
    auto it = states_.find(mb.index);
    if (it == states_.end())
      throw std::logic_error("capstone stage: backward of micro-batch " + std::to_string(mb.index) + " without its forward");
    State& s = it->second;
    // Only the stage knows when a backward begins under 15's schedule: the buckets of the last
    // micro-batch's backward are the ones that reduce.
    if (ddp) ddp->before_backward(mb.index == micro_batches - 1);
    const Scope scope(ctx, mb, s.grad_scale);
    km::BackwardPass pass(ctx.params);
    const km::Shape shape = activation_shape(mb.rows);
    Tensor a, b;
    const Tensor* grad = &dout;
    if (is_last()) {
      Tensor dxf = ctx.tensor(shape, km::Category::activations, s.xf.dtype());
      if (tensor_) head_tp_.backward(ctx, s.xf, s.dlogits, &dxf);
      else head_.backward(ctx, s.xf, s.dlogits, &dxf);
      s.dlogits = Tensor();
      a = ctx.residual_stream(shape);
      final_norm_.backward(ctx, block_input(s, static_cast<int>(blocks_.size())), s.final_norm, dxf, a);
      grad = &a;
    } else {
      dout.expect(shape, "capstone stage: received gradient");
    }
    for (int i = static_cast<int>(blocks_.size()); i-- > 0;) {
      Tensor& into = grad == &a ? b : a;
      if (into.empty()) into = ctx.residual_stream(shape);
      blocks_[static_cast<std::size_t>(i)].backward(ctx, block_input(s, i), s.positions, mb.rows,
                                                    s.blocks[static_cast<std::size_t>(i)], *grad, into);
      grad = &into;
    }
    if (is_first()) {
      if (tensor_) vembed_.backward(ctx, s.vembed, *grad);
      else embed_.backward(ctx, mb.ids, *grad);
      dinput = Tensor();
    } else if (grad == &dout) {
      dinput = ctx.tensor(shape);
      ctx.ops.copy(dinput, dout);
    } else if (grad->dtype() == km::DType::f32) {
      dinput = std::move(grad == &a ? a : b);
    } else {  // the stages send fp32, as the forward's output does
      dinput = ctx.tensor(shape);
      ctx.ops.copy(dinput, *grad);
    }
    pass.finish();
    states_.erase(it);
    saved = Saved();
    count_backward(mb.index);
  }

  // An evaluation's forward leaves state that no backward will collect.
  void discard(int micro_batch) {
    if (states_.erase(micro_batch)) count_backward(micro_batch);
  }

 private:
  struct State {
    Tensor input, positions, x0, xf, dlogits;
    tp::VocabParallelEmbedding::Saved vembed;
    std::vector<BlockState> blocks;
    km::RmsNorm::Saved final_norm;
    float grad_scale = 1.0f;
  };
  // Row offset (dropout masks) and loss scale (MoE balance) of the micro-batch, for one call.
  struct Scope {
    km::Context& ctx;
    std::int64_t row_offset;
    float loss_scale;
    Scope(km::Context& c, const ps::MicroBatch& mb, float scale)
        : ctx(c), row_offset(c.row_offset), loss_scale(c.loss_scale) {
      ctx.row_offset = mb.row_offset;
      ctx.loss_scale = scale;
    }
    ~Scope() {
      ctx.row_offset = row_offset;
      ctx.loss_scale = loss_scale;
    }
  };
  // The input of local block i (i = blocks: the stage's top).
  const Tensor& block_input(const State& s, int i) const {
    if (i > 0) return s.blocks[static_cast<std::size_t>(i - 1)].output();
    return is_first() ? s.x0 : s.input;
  }

  Grid& grid_;
  bool tensor_;
  km::Embedding embed_;
  tp::VocabParallelEmbedding vembed_;
  std::vector<GridBlock> blocks_;
  km::RmsNorm final_norm_;
  km::Linear head_;
  tp::ColumnParallelLinear head_tp_;
  std::map<int, State> states_;
};

// The checkpoint of one rank's part: what must match for its numbers to mean anything here.
constexpr char kMagic[8] = {'K', '2', 'C', 'G', 'R', 'I', 'D', '1'};
struct Header {
  char magic[8];
  std::int32_t dp, tp, pp, ep, rank, step, adam_steps, n_layers, d_model, vocab;
  std::int64_t values, trainable;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The trainer

struct GridTrainer::Impl {
  Impl(dist::Communicator& world, km::Ops& ops, const CapstoneConfig& c)
      : config(c), ops(ops), grid(world, c.grid), p2p(grid.group(Axis::pp)), ctx{ops, ledger, params} {}

  CapstoneConfig config;
  km::Ops& ops;
  Grid grid;
  dist::PointToPointView p2p;
  km::MemoryLedger ledger;
  km::ParamList params;
  km::Context ctx;
  std::unique_ptr<GridStage> stage;
  std::unique_ptr<data_parallel::DataParallel> ddp;
  std::unique_ptr<km::AdamW> adamw;
  // zero_stage > 0 instead of the three above. Zero refers to the model, so it is declared after
  // it and goes first.
  std::unique_ptr<km::Transformer> model;
  std::unique_ptr<zero::Zero> zero;
  std::optional<km::TokenLoader> train, val;
  std::vector<char> counted;  // per parameter: this rank is the one that counts it (see the top)
  bool counts_all = true;
  int data_rank = 0, data_ranks = 1, step = 0;

  int coord(Axis a) const { return grid.coord(a); }

  // Rows [k·rows/m, (k+1)·rows/m) of a data rank's batch, in the backend's memory.
  std::vector<ps::MicroBatch> micro_batches(const km::TokenBatch& b, int m) {
    std::vector<ps::MicroBatch> batches;
    batches.reserve(static_cast<std::size_t>(m));
    const int rows = b.rows / m, T = b.seq_len;
    const std::int64_t first_row = static_cast<std::int64_t>(data_rank) * b.rows;
    for (int k = 0; k < m; ++k) {
      ps::MicroBatch& micro = batches.emplace_back();
      const std::int64_t n = static_cast<std::int64_t>(rows) * T;
      micro.ids = ctx.tensor({n}, km::Category::activations, km::DType::i32);
      micro.targets = ctx.tensor({n}, km::Category::activations, km::DType::i32);
      ops.upload(micro.ids, b.inputs.data() + k * n);
      ops.upload(micro.targets, b.targets.data() + k * n);
      micro.rows = rows;
      micro.row_offset = first_row + static_cast<std::int64_t>(k) * rows;
      micro.index = k;
    }
    return batches;
  }


  // Sums a host value over the world (every rank gets it).
  double world_sum(double v) {
    dist::Communicator& w = grid.world();
    if (w.size() == 1) return v;
    dist::Buffer buf(w, sizeof(double));
    w.to_backend(buf.get(), &v, sizeof v);
    w.all_reduce(buf.get(), buf.get(), 1, dist::DType::f64, dist::ReduceOp::sum);
    w.to_host(&v, buf.get(), sizeof v);
    return v;
  }

  // The loss only the last stage's tp rank 0 of each data rank knows, averaged over data ranks.
  double data_mean(double local) {
    const bool holder = (!stage || stage->is_last()) && coord(Axis::tp) == 0;
    return world_sum(holder ? local : 0.0) / data_ranks;
  }

  // ep > 1: dense gradients summed over dp × ep, the MoE layers' by module 17.
  void reduce_expert_grid() {
    dist::Communicator& dense = grid.dense();
    std::vector<char> moe_param(static_cast<std::size_t>(params.size()), 0);
    for (const GridBlock& b : stage->blocks())
      if (const xp::ExpertParallelMoe* moe = b.moe()) {
        for (km::ParamId id : moe->dense_params()) moe_param[static_cast<std::size_t>(id)] = 1;
        for (km::ParamId id : moe->expert_params()) moe_param[static_cast<std::size_t>(id)] = 1;
      }
    for (km::ParamId id : params.trainable()) {
      if (moe_param[static_cast<std::size_t>(id)]) continue;
      Tensor& g = params.grad(id);
      dense.all_reduce(g.raw(), g.raw(), static_cast<std::size_t>(g.numel()), dist::DType::f32, dist::ReduceOp::sum);
    }
    for (const GridBlock& b : stage->blocks())
      if (const xp::ExpertParallelMoe* moe = b.moe()) xp::reduce_gradients(dense, grid.group(Axis::dp), ctx, *moe);
  }

  // The whole model's gradient norm: each weight counted on one rank (see the top).
  double grad_norm() {
    double local = 0;
    if (coord(Axis::dp) == 0) {
      if (counts_all) {
        local = params.trainable_numel() ? ops.sum_squares(params.flat_grads()) : 0.0;
      } else {
        for (km::ParamId id : params.trainable())
          if (counted[static_cast<std::size_t>(id)]) local += ops.sum_squares(params.grad(id));
      }
    }
    return std::sqrt(world_sum(local));
  }

  // ---- ZeRO: Zero steps a Transformer on this data rank's rows.

  km::StepRecord zero_step() {
    const km::TrainConfig& c = config.train;
    const std::vector<ps::MicroBatch> mbs = micro_batches(train->batch_at(step), 1);
    const ps::MicroBatch& mb = mbs[0];
    ctx.step = static_cast<std::uint64_t>(step);
    ctx.row_offset = mb.row_offset;  // dropout masks: this rank's rows of the global batch
    const std::int64_t tokens = static_cast<std::int64_t>(mb.rows) * c.model.seq_len;
    km::StepRecord r;
    r.step = step;
    r.lr = km::cosine_lr(step, c.warmup, c.steps, c.lr, c.min_lr);
    const float scale = 1.0f / static_cast<float>(static_cast<std::int64_t>(data_ranks) * tokens);
    const double sum = zero->step(ctx, mb.ids, mb.targets, mb.rows, scale, static_cast<float>(r.lr));
    r.loss = data_mean(sum / static_cast<double>(tokens));  // module 15's order: a mean, then over ranks
    r.grad_norm = c.clip > 0 ? zero->grad_norm() : -1;  // Zero measures it only to clip
    return r;
  }

  // Stages 1 and 2 keep every weight, so evaluation is the Transformer's. Stage 3 keeps a shard,
  // and Zero binds the layers only inside its step: gather every weight to the host once, and bind
  // each layer's to a copy in the backend's memory for the length of its forward only.
  double zero_evaluate(int batches) {
    std::vector<float> host;
    std::vector<Tensor> held;
    // However the evaluation ends: the caller's hook back, and no weight left bound to a copy
    // that is gone (a later read then names the parameter instead of reading freed memory).
    struct Restore {
      km::Context& ctx;
      std::function<void(int, km::LayerEvent)> saved;
      bool unbind;
      ~Restore() {
        ctx.on_layer = std::move(saved);
        if (unbind)
          for (km::ParamId id = 0; id < ctx.params.size(); ++id) ctx.params.bind_value(id, nullptr);
      }
    } restore{ctx, std::move(ctx.on_layer), config.zero_stage == 3};
    if (config.zero_stage == 3) {
      host = zero->gather_values();
      ctx.on_layer = [&](int l, km::LayerEvent e) {
        if (e != km::LayerEvent::before_forward && e != km::LayerEvent::after_forward) return;
        for (int used : model->layer_uses(l)) {  // a tied head uses the embedding's weight
          const auto [first, last] = model->layer_params(used);
          if (first == last) continue;
          if (e == km::LayerEvent::after_forward) {
            for (km::ParamId id = first; id < last; ++id) params.bind_value(id, nullptr);
            continue;
          }
          const std::int64_t begin = params.info(first).offset;
          const std::int64_t end = params.info(last - 1).offset + params.info(last - 1).shape.numel();
          Tensor& copy = held.emplace_back(ops.memory(), ledger, km::Category::params, km::Shape{end - begin});
          ops.upload(copy, host.data() + begin);
          for (km::ParamId id = first; id < last; ++id)
            params.bind_value(id, copy.f32() + (params.info(id).offset - begin));
        }
        if (e == km::LayerEvent::after_forward) held.clear();
      };
    }
    double total = 0;
    for (int i = 0; i < batches; ++i) {
      const std::vector<ps::MicroBatch> mbs = micro_batches(val->batch_at(i), 1);
      total += model->evaluate(ctx, mbs[0].ids, mbs[0].targets, mbs[0].rows);
    }
    const double tokens = static_cast<double>(config.train.batch) * config.train.model.seq_len * batches;
    return data_mean(total) * data_ranks / tokens;
  }
};

GridTrainer::GridTrainer(dist::Communicator& world, km::Ops& ops, const CapstoneConfig& config,
                         const LoaderFactory& data) {
  const dist::GridShape& g = config.grid;
  const km::ModelConfig& m = config.train.model;
  m.check();
  if (g.cp != 1) throw std::invalid_argument("capstone: cp " + std::to_string(g.cp) + " is not part of the capstone's grid");
  if (g.total() != world.size())
    throw std::invalid_argument("capstone: grid " + grid_name(g) + " has " + std::to_string(g.total()) +
                                " ranks, the world " + std::to_string(world.size()));
  const int D = g.dp * g.ep;
  if (config.micro_batches < 1 || config.train.batch % (D * config.micro_batches) != 0)
    throw std::invalid_argument("capstone: batch " + std::to_string(config.train.batch) + " must split into " +
                                std::to_string(D) + " data ranks x " + std::to_string(config.micro_batches) +
                                " micro-batches");
  if (g.ep > 1 && m.experts == 0)
    throw std::invalid_argument("capstone: ep " + std::to_string(g.ep) + " needs a mixture of experts (experts > 0)");
  if ((g.tp > 1 || g.ep > 1) && config.train.dropout > 0)
    throw std::invalid_argument("capstone: dropout " + std::to_string(config.train.dropout) +
                                " needs tp = ep = 1 (grid " + grid_name(g) + ")");
  // ZeRO: what module 13's Zero cannot run, refused here, before any group is made.
  const int zs = config.zero_stage;
  if (zs < 0 || zs > 3)
    throw std::invalid_argument("capstone: zero_stage " + std::to_string(zs) + " (0: off; 1, 2 or 3)");
  if (zs > 0 && (g.tp > 1 || g.pp > 1 || g.ep > 1))
    throw std::invalid_argument("capstone: zero_stage " + std::to_string(zs) + " on grid " + grid_name(g) +
                                ": ZeRO under tp, pp or ep is not supported here (module 13's Zero runs "
                                "the whole step of one Transformer over the dp group); use a dp-only grid "
                                "or zero_stage 0");
  if (zs > 0 && config.micro_batches != 1)
    throw std::invalid_argument("capstone: zero_stage " + std::to_string(zs) + " with " +
                                std::to_string(config.micro_batches) +
                                " micro-batches: Zero steps one batch per call; use micro_batches 1");
  // A bf16 residual stream: the library's blocks keep it (Zero's Transformer too, which runs with
  // this Context), 14's and 17's layers keep fp32, and the stages send fp32 between them.
  km::check_residual(config.train.residual, config.train.dropout, "capstone");
  if (config.train.residual != km::DType::f32 && (g.tp > 1 || g.ep > 1))
    throw std::invalid_argument("capstone: a " + km::to_string(config.train.residual) +
                                " residual stream runs where tp = ep = 1 (grid " + grid_name(g) + ")");

  impl_ = std::make_unique<Impl>(world, ops, config);
  Impl& s = *impl_;
  s.data_ranks = D;
  s.data_rank = s.coord(Axis::dp) * g.ep + s.coord(Axis::ep);
  s.ctx.dropout = config.train.dropout;
  s.ctx.seed = config.train.seed;
  if (config.train.activations != km::DType::f32 && config.train.activations != km::DType::bf16)
    throw std::invalid_argument("capstone: activations are f32 or bf16, not " + km::to_string(config.train.activations));
  s.ctx.activations = config.train.activations;  // the library's layers (tp = 1); 14's keep their own
  s.ctx.residual = config.train.residual;

  if (zs > 0) {
    // Zero materializes the parameters itself, with the flat buffers its stage keeps.
    s.model = std::make_unique<km::Transformer>(s.params, m);
    zero::ZeroConfig zc;
    zc.stage = zs;
    zc.adamw = config.train.adamw;
    zc.clip = config.train.clip;
    s.zero = std::make_unique<zero::Zero>(s.grid.group(Axis::dp), *s.model, s.params, ops, s.ledger,
                                          config.train.seed, zc);
  } else {
    const ps::Span span = pp::stage_blocks(m.n_layers, g.pp, s.coord(Axis::pp));
    // Module 14's block has no experts: a mixture of experts under tp is the expert kind, its ep
    // group a single rank where ep = 1.
    const bool experts_here = g.ep > 1 || (g.tp > 1 && m.experts > 0);
    const BlockKind kind = experts_here ? BlockKind::expert : g.tp > 1 ? BlockKind::tensor : BlockKind::plain;
    s.stage = std::make_unique<GridStage>(s.grid, s.params, m, span, kind);
    s.params.materialize(ops, s.ledger, config.train.seed);
    // Which rank counts each weight (see the top): expert slices are cut over ep, every other
    // shard over tp.
    std::vector<char> expert_slice(static_cast<std::size_t>(s.params.size()), 0);
    for (const GridBlock& b : s.stage->blocks())
      if (const xp::ExpertParallelMoe* moe = b.moe())
        for (km::ParamId id : moe->expert_params()) expert_slice[static_cast<std::size_t>(id)] = 1;
    const bool tp0 = s.coord(Axis::tp) == 0, ep0 = s.coord(Axis::ep) == 0;
    s.counted.assign(static_cast<std::size_t>(s.params.size()), 0);
    for (km::ParamId id = 0; id < s.params.size(); ++id) {
      const bool shard = s.params.info(id).init.shard.has_value();
      const bool here = !shard ? tp0 && ep0 : expert_slice[static_cast<std::size_t>(id)] ? tp0 : ep0;
      s.counted[static_cast<std::size_t>(id)] = here;
      if (!here) s.counts_all = false;
    }
    if (g.ep > 1) {
      s.stage->scale_factor = 1.0f / static_cast<float>(D);
    } else if (g.dp > 1) {
      s.ddp = std::make_unique<data_parallel::DataParallel>(s.grid.group(Axis::dp), s.params, config.bucket_bytes);
      s.stage->ddp = s.ddp.get();
    }
    s.stage->micro_batches = config.micro_batches;
    s.adamw = std::make_unique<km::AdamW>(s.params, ops, s.ledger, config.train.adamw);
  }
  s.train.emplace(data(false, s.data_rank, D));
  s.val.emplace(data(true, s.data_rank, D));
  for (const km::TokenLoader* l : {&*s.train, &*s.val})
    if (l->config().seq_len != m.seq_len || l->config().global_batch != config.train.batch ||
        l->config().dp_rank != s.data_rank || l->config().dp_size != D)
      throw std::invalid_argument("capstone: the loader factory made a loader for T " +
                                  std::to_string(l->config().seq_len) + ", batch " +
                                  std::to_string(l->config().global_batch) + ", rank " +
                                  std::to_string(l->config().dp_rank) + " of " + std::to_string(l->config().dp_size) +
                                  "; this rank needs T " + std::to_string(m.seq_len) + ", batch " +
                                  std::to_string(config.train.batch) + ", rank " + std::to_string(s.data_rank) +
                                  " of " + std::to_string(D));
}

GridTrainer::~GridTrainer() = default;

km::StepRecord GridTrainer::step() {
  Impl& s = *impl_;
  const km::TrainConfig& c = s.config.train;
  const auto start = std::chrono::steady_clock::now();
  if (s.zero) {
    km::StepRecord r = s.zero_step();
    ++s.step;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    r.tokens_per_s = static_cast<double>(c.batch) * c.model.seq_len / r.seconds;
    return r;
  }
  const km::TokenBatch batch = s.train->batch_at(s.step);
  const std::vector<ps::MicroBatch> mbs = s.micro_batches(batch, s.config.micro_batches);
  s.params.zero_grads(s.ops);
  s.ctx.step = static_cast<std::uint64_t>(s.step);
  pp::StepOptions options;
  options.schedule = s.config.one_f_one_b ? pp::Schedule::one_f_one_b : pp::Schedule::gpipe;
  const double loss = pp::train_step(s.p2p, *s.stage, s.ctx, mbs, options);
  if (s.ddp) s.ddp->finish_gradients();
  if (s.config.grid.ep > 1) s.reduce_expert_grid();

  km::StepRecord r;
  r.step = s.step;
  r.loss = s.data_mean(loss);
  r.grad_norm = s.grad_norm();
  if (c.clip > 0 && r.grad_norm > c.clip) s.ops.scale(s.params.flat_grads(), static_cast<float>(c.clip / r.grad_norm));
  r.lr = km::cosine_lr(s.step, c.warmup, c.steps, c.lr, c.min_lr);
  s.adamw->step(static_cast<float>(r.lr));
  ++s.step;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.tokens_per_s = static_cast<double>(c.batch) * c.model.seq_len / r.seconds;
  return r;
}

double GridTrainer::evaluate(int batches) {
  Impl& s = *impl_;
  if (s.zero) return s.zero_evaluate(batches);
  const int prev = s.stage->is_first() ? -1 : s.p2p.rank() - 1, next = s.stage->is_last() ? -1 : s.p2p.rank() + 1;
  double total = 0;
  const float dropout = s.ctx.dropout;
  s.ctx.dropout = 0.0f;
  for (int i = 0; i < batches; ++i) {
    std::vector<ps::MicroBatch> mbs = s.micro_batches(s.val->batch_at(i), 1);
    Tensor input, output;
    if (prev >= 0) {
      input = s.ctx.tensor(s.stage->activation_shape(mbs[0].rows));
      s.p2p.recv(input.raw(), static_cast<std::size_t>(input.numel()), dist::DType::f32, prev);
    }
    ps::Stage::Saved saved;
    total += s.stage->forward(s.ctx, mbs[0], std::move(input), 0.0f, false, saved, output);
    if (next >= 0) s.p2p.send(output.raw(), static_cast<std::size_t>(output.numel()), dist::DType::f32, next);
    s.stage->discard(0);
  }
  s.ctx.dropout = dropout;
  const double tokens = static_cast<double>(s.config.train.batch) * s.config.train.model.seq_len * batches;
  return s.data_mean(total) * s.data_ranks / tokens;
}

std::vector<float> GridTrainer::gather_values() {
  Impl& s = *impl_;
  // Zero's flat order is its Transformer's, the unsplit layout itself.
  if (s.zero) return s.zero->gather_values();
  // The unsplit model's layout: registration order, each parameter's elements contiguous.
  km::ParamList whole;
  const km::Transformer reference(whole, s.config.train.model);
  std::map<std::string, std::int64_t> offset;
  std::int64_t n = 0;
  for (km::ParamId id = 0; id < whole.size(); ++id) {
    offset[whole.info(id).name] = n;
    n += whole.info(id).shape.numel();
  }
  std::vector<float> out(static_cast<std::size_t>(n), 0.0f);
  if (s.coord(Axis::dp) == 0) {
    for (km::ParamId id = 0; id < s.params.size(); ++id) {
      if (!s.counted[static_cast<std::size_t>(id)]) continue;
      const km::ParamInfo& info = s.params.info(id);
      std::vector<float> host(static_cast<std::size_t>(info.shape.numel()));
      s.ops.download(host.data(), s.params.value(id));
      const std::int64_t base = offset.at(info.name);
      if (!info.init.shard) {
        std::copy(host.begin(), host.end(), out.begin() + base);
        continue;
      }
      // Element (i0, i1, ...) of the block is (offset0 + i0, offset1 + i1, ...) of the whole.
      const km::ShardOf& sh = *info.init.shard;
      const int rank = info.shape.rank;
      std::array<std::int64_t, 4> idx{};
      for (std::int64_t e = 0; e < info.shape.numel(); ++e) {
        std::int64_t rem = e, flat = 0;
        for (int d = rank; d-- > 0;) {
          idx[d] = rem % info.shape[d];
          rem /= info.shape[d];
        }
        for (int d = 0; d < rank; ++d) flat = flat * sh.full[d] + sh.offset[d] + idx[d];
        out[static_cast<std::size_t>(base + flat)] = host[static_cast<std::size_t>(e)];
      }
    }
  }
  // Every element has exactly one contributor: a sum with zeros is exact.
  dist::Communicator& w = s.grid.world();
  if (w.size() > 1) {
    dist::Buffer buf(w, out.size() * sizeof(float));
    w.to_backend(buf.get(), out.data(), out.size() * sizeof(float));
    w.all_reduce(buf.get(), buf.get(), out.size(), dist::DType::f32, dist::ReduceOp::sum);
    w.to_host(out.data(), buf.get(), out.size() * sizeof(float));
  }
  return out;
}

namespace {
std::filesystem::path rank_file(const std::filesystem::path& path, const dist::Communicator& w) {
  return w.size() == 1 ? path : std::filesystem::path(path.string() + ".rank" + std::to_string(w.rank()));
}

// Zero keeps its AdamW shards to itself (zero.h reads and restores none), so a checkpoint under
// it would lose the optimizer state: refused on every rank alike, before any file is touched.
void refuse_zero_checkpoint(const CapstoneConfig& c, const char* what, const std::filesystem::path& path) {
  if (c.zero_stage > 0)
    throw std::runtime_error(std::string("capstone: cannot ") + what + " the checkpoint " + path.string() +
                             " under zero_stage " + std::to_string(c.zero_stage) +
                             ": module 13's Zero does not expose its shards of the AdamW state; "
                             "train with zero_stage 0 to checkpoint");
}
}  // namespace

void GridTrainer::save(const std::filesystem::path& path) {
  Impl& s = *impl_;
  refuse_zero_checkpoint(s.config, "write", path);
  const std::filesystem::path file = rank_file(path, s.grid.world()), tmp = file.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write the checkpoint " + tmp.string());
    Header h;
    std::memset(&h, 0, sizeof h);
    std::memcpy(h.magic, kMagic, 8);
    const dist::GridShape& g = s.config.grid;
    const km::ModelConfig& m = s.config.train.model;
    h.dp = g.dp, h.tp = g.tp, h.pp = g.pp, h.ep = g.ep, h.rank = s.grid.world().rank();
    h.step = s.step, h.adam_steps = s.adamw->steps(), h.n_layers = m.n_layers, h.d_model = m.d_model, h.vocab = m.vocab;
    h.values = s.params.numel(), h.trainable = s.params.trainable_numel();
    f.write(reinterpret_cast<const char*>(&h), sizeof h);
    for (Tensor* t : {&s.params.flat_values(), &s.adamw->first_moment(), &s.adamw->second_moment()}) {
      std::vector<char> host(t->bytes());
      s.ops.download(host.data(), *t);
      f.write(host.data(), static_cast<std::streamsize>(host.size()));
    }
    if (!f) throw std::runtime_error("error writing the checkpoint " + tmp.string());
  }
  std::filesystem::rename(tmp, file);
  s.grid.world().barrier();  // a checkpoint is whole only once every rank's part is in place
}

void GridTrainer::load(const std::filesystem::path& path) {
  Impl& s = *impl_;
  refuse_zero_checkpoint(s.config, "load", path);
  const std::filesystem::path file = rank_file(path, s.grid.world());
  std::ifstream f(file, std::ios::binary);
  if (!f) throw std::runtime_error("checkpoint " + file.string() + ": cannot open");
  Header h{};
  f.read(reinterpret_cast<char*>(&h), sizeof h);
  if (!f || std::memcmp(h.magic, kMagic, 8) != 0)
    throw std::runtime_error("checkpoint " + file.string() + ": not a k2c grid checkpoint");
  const dist::GridShape& g = s.config.grid;
  const km::ModelConfig& m = s.config.train.model;
  if (h.dp != g.dp || h.tp != g.tp || h.pp != g.pp || h.ep != g.ep || h.rank != s.grid.world().rank())
    throw std::runtime_error("checkpoint " + file.string() + " was written by rank " + std::to_string(h.rank) +
                             " of grid " + grid_name({h.dp, h.pp, h.ep, 1, h.tp}) + "; this is rank " +
                             std::to_string(s.grid.world().rank()) + " of " + grid_name(g));
  if (h.n_layers != m.n_layers || h.d_model != m.d_model || h.vocab != m.vocab || h.values != s.params.numel() ||
      h.trainable != s.params.trainable_numel())
    throw std::runtime_error("checkpoint " + file.string() + " was written for another model; this run has " +
                             m.describe());
  for (Tensor* t : {&s.params.flat_values(), &s.adamw->first_moment(), &s.adamw->second_moment()}) {
    std::vector<char> host(t->bytes());
    f.read(host.data(), static_cast<std::streamsize>(host.size()));
    if (!f) throw std::runtime_error("checkpoint " + file.string() + ": truncated");
    s.ops.upload(*t, host.data());
  }
  s.step = h.step;
  s.adamw->set_steps(h.adam_steps);
}

int GridTrainer::steps_done() const { return impl_->step; }
dist::GridCoords GridTrainer::coords() const {
  dist::GridCoords c{};
  for (int a = 0; a < 5; ++a) c[static_cast<std::size_t>(a)] = impl_->grid.coord(static_cast<Axis>(a));
  return c;
}
km::MemoryLedger& GridTrainer::ledger() { return impl_->ledger; }

}  // namespace k2c::capstone
