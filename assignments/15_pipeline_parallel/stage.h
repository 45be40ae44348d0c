// assignments/15_pipeline_parallel/stage.h — the part of the transformer that one pipeline stage
// holds (course code: read it, do not edit it).
//
// A transformer is a sequence: embedding → blocks 0 .. L−1 → final RMSNorm → head → loss. A
// pipeline of p stages cuts it into p consecutive pieces, one per rank:
//
//   stage 0        embedding, blocks [first, last)
//   stage s        blocks [first, last)
//   stage p − 1    blocks [first, last), final norm, head, cross-entropy
//
// (one stage alone holds all of it). Between two neighbouring stages travels one tensor per
// micro-batch in each direction: forward, the activation [rows·T, d_model] that the next block
// reads; backward, its gradient, of the same shape. Nothing else crosses a stage boundary.
//
// A Stage registers the same parameters under the same names as model::Transformer does for the
// layers it holds ("embed.weight", "blocks.3.attn.wq.weight", "head.weight", ...), so it starts
// from exactly the values one process would have, and runs exactly the operations
// Transformer::train_step runs for them, in the same order. A pipeline is therefore bit-exact
// against the unsplit model on the CPU backend, as long as each stage runs the backward passes
// of the micro-batches in the order the unsplit model would (they add into the gradients).
//
// What a micro-batch leaves between its forward and its backward on a stage is a Saved value
// the caller owns: the pipeline schedule decides how many of them are alive at once, and that
// is exactly the activation memory the schedule costs. With `recompute`, forward keeps only the
// stage's input (what GPipe does) and backward runs the stage's forward again first: one extra
// forward for memory of one micro-batch's input per stage.
//
// The stage also keeps its own counts (live micro-batches, their peak, the passes it ran in
// order), so tests can hold a schedule against what actually ran.
//
// forward and backward are virtual so that another kind of stage can run under the same
// schedules: the capstone (module 18) derives a stage whose blocks are tensor- and
// expert-parallel. A derived stage registers its own layers (the protected constructor registers
// none), keeps what its micro-batches leave wherever it likes, and calls count_forward and
// count_backward so that the counts above stay true.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "k2c/model/block.h"
#include "k2c/model/layers.h"
#include "k2c/model/transformer.h"

namespace k2c::pipeline_stage {

using model::Context;
using model::ModelConfig;
using model::ParamList;
using model::Shape;
using model::Tensor;

// Blocks [first, last) of the model's blocks.
struct Span {
  int first = 0, last = 0;
  int size() const { return last - first; }
};

enum class Pass { forward, backward };

// One micro-batch as every stage sees it. Token tensors live in the backend's memory (upload
// them with ctx.ops.upload); the first stage reads ids, the last reads targets, and a stage in
// between may leave both empty. rows and row_offset are needed everywhere: row_offset is the
// micro-batch's first row in the step's whole batch, which dropout masks are keyed on, so a
// micro-batch draws the masks that the same rows would draw in one process.
struct MicroBatch {
  Tensor ids, targets;  // i32 [rows·T]
  int rows = 0;
  std::int64_t row_offset = 0;
  int index = 0;  // its place k in the step, 0 .. m − 1
};

class Stage {
 public:
  // What one micro-batch leaves on this stage between its forward and its backward.
  struct Saved {
    Tensor input;      // the previous stage's activation (the first block's input); empty on stage 0
    Tensor positions;  // i32 [T]
    Tensor x0;         // stage 0: the embedding's output
    std::vector<model::Block::Saved> blocks;
    model::RmsNorm::Saved final_norm;
    Tensor xf, dlogits;  // last stage: the final norm's output, the loss's gradient
    bool complete = false;  // false after a recomputing forward: backward runs forward again
    bool live = false;      // forward done, backward not yet
    int micro_batch = -1;
    float grad_scale = 1.0f;  // the loss scale forward used, for a recomputation
  };

  // The layers of stage `stage` of `stages` that hold `blocks`: the embedding on the first, the
  // final norm and head on the last. Registers their parameters in `params` (materialize it
  // afterwards, with the seed one process would use). A head tied to the embedding works only
  // where one stage holds both (stages == 1): across stages the two copies would need their
  // gradients summed between the first and the last stage, which this course leaves out.
  Stage(ParamList& params, const ModelConfig& config, Span blocks, int stage, int stages)
      : Stage(config, blocks, stage, stages) {
    if (config.tied_head && stages > 1)
      throw std::invalid_argument("pipeline: a head tied to the embedding needs both on one stage (" +
                                  std::to_string(stages) + " stages); set tied_head = false");
    const model::Init emb{model::Init::normal, config.init_std};
    if (first_) embed_ = model::Embedding(params, "embed", config.vocab, config.d_model, emb);
    model::BlockConfig bc;
    bc.attention = {config.d_model, config.q_heads, config.kv_heads, config.rope_theta};
    bc.d_ff = config.d_ff;
    bc.norm_eps = config.norm_eps;
    bc.moe = {config.d_model, config.experts, config.top_k, config.d_expert, config.shared_experts, true,
              config.balance_coef};
    // Global block indices: names and dropout masks are those of the unsplit model.
    for (int i = blocks.first; i < blocks.last; ++i) blocks_.emplace_back(params, "blocks." + std::to_string(i), bc, i);
    if (last_) {
      final_norm_ = model::RmsNorm(params, "final_norm", config.d_model, config.norm_eps);
      head_ = config.tied_head ? model::Linear::tied(params, embed_.weight())
                               : model::Linear(params, "head", config.d_model, config.vocab, emb);
    }
  }

  virtual ~Stage() = default;

  bool is_first() const { return first_; }
  bool is_last() const { return last_; }
  Span blocks() const { return span_; }
  const ModelConfig& config() const { return config_; }
  // What crosses a stage boundary for a micro-batch of `rows` sequences, either way: fp32.
  Shape activation_shape(int rows) const {
    return {static_cast<std::int64_t>(rows) * config_.seq_len, config_.d_model};
  }

  // Forward of micro-batch `mb`. `input` is the activation the previous stage sent (moved in and
  // kept in `saved`); the first stage takes an empty tensor and reads mb.ids. On every stage but
  // the last, `output` receives this stage's result, to send on. The last stage computes the
  // cross-entropy with gradient scale `grad_scale` and returns the summed loss of the micro-batch's
  // tokens (without an MoE balance term, as Transformer::train_step); other stages return 0.
  virtual double forward(Context& ctx, const MicroBatch& mb, Tensor input, float grad_scale, bool recompute,
                         Saved& saved, Tensor& output) {
    if (saved.live)
      throw std::logic_error("pipeline stage: forward of micro-batch " + std::to_string(mb.index) +
                             " into a Saved still holding micro-batch " + std::to_string(saved.micro_batch));
    check_rows(mb);
    if (first_) {
      mb.ids.expect({rows_of(mb)}, "pipeline stage 0: micro-batch ids", model::DType::i32);
    } else {
      input.expect(activation_shape(mb.rows), "pipeline stage: received activation");
    }
    saved = Saved();
    saved.input = std::move(input);
    saved.micro_batch = mb.index;
    saved.positions = ctx.tensor({config_.seq_len}, model::Category::activations, model::DType::i32);
    std::vector<std::int32_t> pos(static_cast<std::size_t>(config_.seq_len));
    for (std::size_t t = 0; t < pos.size(); ++t) pos[t] = static_cast<std::int32_t>(t);
    ctx.ops.upload(saved.positions, pos.data());

    const Scope scope(ctx, mb, grad_scale);
    const double loss = run_forward(ctx, mb, grad_scale, recompute, saved, &output);
    saved.live = true;
    count_forward(mb.index);
    return loss;
  }

  // Backward of micro-batch `mb`, whose forward left `saved`. `dout` is the gradient of this
  // stage's output that the next stage sent; the last stage passes an empty tensor (its backward
  // starts from the loss it kept). Adds into the parameters' gradients (their gradient-ready
  // callbacks fire), writes the gradient of this stage's input to `dinput` (left empty on the
  // first stage) and releases everything `saved` held.
  virtual void backward(Context& ctx, const MicroBatch& mb, Saved& saved, const Tensor& dout, Tensor& dinput) {
    if (!saved.live || saved.micro_batch != mb.index)
      throw std::logic_error("pipeline stage: backward of micro-batch " + std::to_string(mb.index) +
                             " without its forward (the Saved holds " +
                             (saved.live ? "micro-batch " + std::to_string(saved.micro_batch) : std::string("nothing")) +
                             ")");
    if (!last_) dout.expect(activation_shape(mb.rows), "pipeline stage: received gradient");
    const Scope scope(ctx, mb, saved.grad_scale);
    if (!saved.complete) {
      // GPipe's recomputation: everything but the input was dropped; run the stage again, the
      // same operations on the same input with the same dropout keys, so the same bits.
      const double aux = ctx.aux_loss;
      run_forward(ctx, mb, saved.grad_scale, false, saved, nullptr);
      ctx.aux_loss = aux;
    }
    model::BackwardPass pass(ctx.params);  // cancelled if anything below throws

    const Shape shape = activation_shape(mb.rows);
    const Tensor* grad = &dout;  // gradient of the current layer's output
    Tensor a, b;
    if (last_) {
      Tensor dxf = ctx.tensor(shape);
      head_.backward(ctx, saved.xf, saved.dlogits, &dxf);
      saved.dlogits = Tensor();
      a = ctx.tensor(shape);
      final_norm_.backward(ctx, block_output(saved, span_.size() - 1), saved.final_norm, dxf, a);
      saved.xf = Tensor();
      grad = &a;
    }
    for (int i = span_.size(); i-- > 0;) {
      Tensor& into = grad == &a ? b : a;
      if (into.empty()) into = ctx.tensor(shape);
      blocks_[static_cast<std::size_t>(i)].backward(ctx, block_output(saved, i - 1), saved.positions, mb.rows,
                                                    saved.blocks[static_cast<std::size_t>(i)], *grad, into);
      saved.blocks[static_cast<std::size_t>(i)].out = Tensor();  // the block below no longer needs it
      grad = &into;
    }
    if (first_) {
      embed_.backward(ctx, mb.ids, *grad);
      dinput = Tensor();
    } else if (grad == &dout) {  // a stage without blocks passes the gradient straight back
      dinput = ctx.tensor(shape);
      ctx.ops.copy(dinput, dout);
    } else {
      dinput = std::move(grad == &a ? a : b);
    }
    pass.finish();
    saved = Saved();
    count_backward(mb.index);
  }

  // ---- what ran, for tests and benchmarks
  struct Ran {
    Pass pass;
    int micro_batch;
  };
  int live() const { return live_; }            // micro-batches forwarded and not yet backwarded
  int peak_live() const { return peak_live_; }  // the most at once since reset_counts()
  const std::vector<Ran>& log() const { return log_; }
  void reset_counts() {
    peak_live_ = live_;
    log_.clear();
  }

 protected:
  // For a derived stage: checks the place and the span as the public constructor does, and
  // registers no layer.
  Stage(const ModelConfig& config, Span blocks, int stage, int stages)
      : config_(config), span_(blocks), first_(stage == 0), last_(stage == stages - 1) {
    config.check();
    if (stages < 1 || stage < 0 || stage >= stages)
      throw std::invalid_argument("pipeline stage " + std::to_string(stage) + " of " + std::to_string(stages));
    if (blocks.first < 0 || blocks.last > config.n_layers || blocks.first > blocks.last)
      throw std::invalid_argument("pipeline stage " + std::to_string(stage) + ": blocks [" +
                                  std::to_string(blocks.first) + ", " + std::to_string(blocks.last) +
                                  ") outside the model's " + std::to_string(config.n_layers));
  }
  // The counts of the top of the file: a forward of micro-batch k has left its activations
  // here; a backward has released them.
  void count_forward(int k) {
    ++live_;
    peak_live_ = std::max(peak_live_, live_);
    log_.push_back({Pass::forward, k});
  }
  void count_backward(int k) {
    --live_;
    log_.push_back({Pass::backward, k});
  }

 private:
  // Sets the context to the micro-batch's for the length of a call: dropout masks keyed on its
  // rows, the loss's scale for auxiliary terms.
  struct Scope {
    Context& ctx;
    std::int64_t row_offset;
    float loss_scale;
    Scope(Context& c, const MicroBatch& mb, float scale) : ctx(c), row_offset(c.row_offset), loss_scale(c.loss_scale) {
      ctx.row_offset = mb.row_offset;
      ctx.loss_scale = scale;
    }
    ~Scope() {
      ctx.row_offset = row_offset;
      ctx.loss_scale = loss_scale;
    }
  };

  std::int64_t rows_of(const MicroBatch& mb) const { return static_cast<std::int64_t>(mb.rows) * config_.seq_len; }
  void check_rows(const MicroBatch& mb) const {
    if (mb.rows < 1) throw std::invalid_argument("pipeline stage: micro-batch " + std::to_string(mb.index) + " has no rows");
    if (last_) mb.targets.expect({rows_of(mb)}, "pipeline stage: micro-batch targets", model::DType::i32);
  }

  // The input of block i + 1 of this stage: block i's output, or for i = −1 the stage's input.
  const Tensor& block_output(const Saved& s, int i) const {
    if (i >= 0) return s.blocks[static_cast<std::size_t>(i)].out;
    return first_ ? s.x0 : s.input;
  }

  // Embedding (first stage), blocks, and on the last stage norm, head and loss. With `recompute`
  // only the input survives: each block is run checkpointed (it keeps only its output) and the
  // output of the block before is dropped as soon as the next one has read it. `output`: where
  // the stage's result goes (a recomputation in backward passes nullptr: nobody needs it again).
  double run_forward(Context& ctx, const MicroBatch& mb, float grad_scale, bool recompute, Saved& s, Tensor* output) {
    const Shape shape = activation_shape(mb.rows);
    s.grad_scale = grad_scale;
    if (first_) {
      s.x0 = ctx.tensor(shape);
      embed_.forward(ctx, mb.ids, s.x0);
    }
    s.blocks.clear();
    s.blocks.resize(blocks_.size());
    for (int i = 0; i < span_.size(); ++i) {
      blocks_[static_cast<std::size_t>(i)].forward(ctx, block_output(s, i - 1), s.positions, mb.rows, recompute,
                                                   s.blocks[static_cast<std::size_t>(i)]);
      if (recompute) {
        if (i > 0) s.blocks[static_cast<std::size_t>(i - 1)].out = Tensor();
        else if (first_) s.x0 = Tensor();
      }
    }
    double loss = 0;
    const Tensor& top = block_output(s, span_.size() - 1);
    if (last_) {
      s.xf = ctx.tensor(shape);
      final_norm_.forward(ctx, top, s.xf, s.final_norm);
      Tensor logits = ctx.tensor({shape[0], config_.vocab});
      head_.forward(ctx, s.xf, logits);
      s.dlogits = ctx.tensor(logits.shape());
      loss = ctx.ops.cross_entropy(logits, mb.targets, grad_scale, s.dlogits);
    } else if (output) {
      *output = ctx.tensor(shape);
      ctx.ops.copy(*output, top);  // sent away and freed by the schedule; the Saved keeps its own
    }
    s.complete = !recompute;
    if (recompute) {  // keep only the stage's input (and the positions)
      s.x0 = Tensor();
      s.blocks.clear();
      s.final_norm = {};
      s.xf = Tensor();
      s.dlogits = Tensor();
    }
    return loss;
  }

  ModelConfig config_;
  Span span_;
  bool first_ = false, last_ = false;
  model::Embedding embed_;
  std::vector<model::Block> blocks_;
  model::RmsNorm final_norm_;
  model::Linear head_;
  int live_ = 0, peak_live_ = 0;
  std::vector<Ran> log_;
};

}  // namespace k2c::pipeline_stage
