// solutions/15_pipeline_parallel/pipeline_parallel.cpp — reference solution of module 15
// (contract: pipeline_parallel.h).
//
// A pipeline is a relay. Stage s can run micro-batch k forward only after stage s − 1 has, and
// backward only after stage s + 1 has. With one micro-batch, only one stage works at a time and
// the others wait: p stages, p times the memory, no speed-up at all. Cut the batch into m
// micro-batches and the stages overlap: while stage 1 runs micro-batch 0, stage 0 already runs
// micro-batch 1. What remains idle is the fill at the start and the drain at the end, the
// bubble: with t_f and t_b a micro-batch's forward and backward on one stage,
//
//   step ≈ (m + p − 1) · (t_f + t_b),   busy m · (t_f + t_b),   idle fraction (p − 1) / (m + p − 1).
//
// Both schedules here have that same bubble. They differ in memory. GPipe runs every forward
// before any backward, so each stage holds the activations of all m micro-batches at its peak.
// 1F1B (PipeDream-flush) starts the backward of the oldest micro-batch as soon as the last stage
// can, and from then on each stage alternates one forward with one backward: stage s never has
// more than p − s micro-batches in flight, whatever m is, so m can grow (shrinking the bubble)
// without growing the memory.
//
// The schedule of stage s of p, 1F1B:
//   warm-up    w = min(p − s − 1, m) forwards: the micro-batches that must be in flight before
//              the first gradient can come back from the last stage;
//   steady     m − w rounds of one forward then one backward (the oldest in flight);
//   cool-down  the w backwards left.
// The last stage has w = 0: it runs F0 B0 F1 B1 ... The first has w = p − 1.
//
// Communication. Each stage talks only to its two neighbours, one tensor per message, all of the
// same shape [rows·T, d_model]. On MPI a send of a large message waits until the peer posts the
// matching receive, and on NCCL a send holds the stream until the peer's receive starts, so two
// neighbours that both send first wait for each other forever. GPipe's order never has both
// neighbours send at once (forwards go down the pipeline, then backwards go up). In 1F1B's
// steady state they would: stage s has an output to send to s + 1 just when s + 1 has a gradient
// to send back. So each of those is one exchange with the same peer both ways
// (start_send_recv: receive posted, send posted, both completed together):
//   stage s, after F(k):   send output(k) to s + 1   | receive the gradient of the oldest from s + 1
//   stage s, after B(j):   send dinput(j) to s − 1   | receive the input of F(k + 1) from s − 1
// and the two sides pair up: what s sends with its k-th "forward" exchange, s + 1 receives in its
// k-th "backward" exchange. The counts work out: stage s + 1 warms up with one forward fewer than
// s, so its one extra single receive before the steady state meets the single send of s's last
// warm-up forward, and its single send after the steady state meets s's first cool-down receive.
//
// Exactness. A stage's gradients add up micro-batch by micro-batch, and float addition does not
// associate, so every stage runs the backwards in order 0, 1, ..., m − 1: the unsplit model's
// order, hence its bits. Both schedules here do (1F1B's oldest-first rule gives that order for
// free). The forward passes see bit-identical inputs (the messages copy fp32 exactly), run the
// same operations, and draw the same dropout masks (Stage keys them on the micro-batch's rows).
//
// Loss. Each micro-batch's loss is a mean over its tokens; the step's loss is the mean over the m
// micro-batches, so the cross-entropy's gradient scale is 1 / (m · tokens): without the 1/m the
// gradient would be m times too large, and the learning rate would silently depend on m.
#include "pipeline_parallel.h"

#include <algorithm>
#include <deque>
#include <stdexcept>
#include <string>

namespace k2c::pipeline_parallel {

Span stage_blocks(int n_layers, int stages, int stage) {
  if (stages < 1 || stage < 0 || stage >= stages)
    throw std::invalid_argument("stage_blocks: stage " + std::to_string(stage) + " of " + std::to_string(stages));
  // A stage with no block would only pass tensors along: one more hop of latency and one more
  // stage in the bubble for no work. Refuse it rather than build it.
  if (n_layers < stages)
    throw std::invalid_argument("stage_blocks: " + std::to_string(stages) + " stages for " +
                                std::to_string(n_layers) + " blocks; every stage needs at least one block");
  // dist::block_of is exactly this split: the first n % p pieces one longer.
  const dist::Block b = dist::block_of(static_cast<std::size_t>(n_layers), stages, stage);
  return {static_cast<int>(b.offset), static_cast<int>(b.offset + b.size)};
}

namespace {

// One stage's side of a step: the schedule's steps as small verbs over the stage, its two
// neighbours and the trace.
class Runner {
 public:
  Runner(PointToPoint& p2p, Stage& stage, Context& ctx, const std::vector<MicroBatch>& mbs, const StepOptions& opt,
         Trace* trace)
      : p2p_(p2p), stage_(stage), ctx_(ctx), mbs_(mbs), opt_(opt), trace_(trace), m_(static_cast<int>(mbs.size())) {
    prev_ = stage.is_first() ? -1 : p2p.rank() - 1;
    next_ = stage.is_last() ? -1 : p2p.rank() + 1;
  }

  // ---- receiving and sending, each a no-op where there is no neighbour

  // The activation for micro-batch k, from the stage before.
  model::Tensor recv_forward(int k) {
    if (prev_ < 0) return {};
    model::Tensor in = buffer(k);
    p2p_.recv(in.raw(), count(in), dist::DType::f32, prev_);
    return in;
  }
  void send_forward(const model::Tensor& out) {
    if (next_ >= 0) p2p_.send(out.raw(), count(out), dist::DType::f32, next_);
  }
  // The gradient of micro-batch k's output, from the stage after.
  model::Tensor recv_backward(int k) {
    if (next_ < 0) return {};
    model::Tensor g = buffer(k);
    p2p_.recv(g.raw(), count(g), dist::DType::f32, next_);
    return g;
  }
  void send_backward(const model::Tensor& din) {
    if (prev_ >= 0) p2p_.send(din.raw(), count(din), dist::DType::f32, prev_);
  }
  // Steady state, after F(k): output k forward, the gradient of micro-batch j back, one exchange.
  model::Tensor send_forward_recv_backward(const model::Tensor& out, int j) {
    if (next_ < 0) return {};
    model::Tensor g = buffer(j);
    p2p_.wait(p2p_.start_send_recv(out.raw(), count(out), next_, g.raw(), count(g), next_, dist::DType::f32));
    return g;
  }
  // Steady state, after B(j): its input's gradient back, the activation of micro-batch k forward.
  model::Tensor send_backward_recv_forward(const model::Tensor& din, int k) {
    if (prev_ < 0) return {};
    model::Tensor in = buffer(k);
    p2p_.wait(p2p_.start_send_recv(din.raw(), count(din), prev_, in.raw(), count(in), prev_, dist::DType::f32));
    return in;
  }

  // ---- the two passes

  // Forward of micro-batch k on `input`; returns the output to send on (empty on the last stage).
  model::Tensor forward(int k, model::Tensor input) {
    const MicroBatch& mb = mbs_[static_cast<std::size_t>(k)];
    const std::int64_t tokens = static_cast<std::int64_t>(mb.rows) * stage_.config().seq_len;
    const float scale = 1.0f / static_cast<float>(m_ * tokens);
    model::Tensor out;
    // The Saved of micro-batch k lives until its backward: the deque's length is exactly the
    // number of micro-batches this stage holds activations for.
    saved_.emplace_back();
    const double t0 = clock();
    const double loss = stage_.forward(ctx_, mb, std::move(input), scale, opt_.recompute, saved_.back(), out);
    record(Pass::forward, k, t0);
    if (stage_.is_last()) loss_ += loss / static_cast<double>(tokens);
    return out;
  }

  // Backward of micro-batch j, the oldest in flight; returns its input's gradient (empty on the
  // first stage).
  model::Tensor backward(int j, const model::Tensor& dout) {
    const MicroBatch& mb = mbs_[static_cast<std::size_t>(j)];
    model::Tensor din;
    const double t0 = clock();
    stage_.backward(ctx_, mb, saved_.front(), dout, din);
    record(Pass::backward, j, t0);
    saved_.pop_front();
    return din;
  }

  double loss() const { return stage_.is_last() ? loss_ / static_cast<double>(m_) : 0.0; }
  int micro_batches() const { return m_; }

 private:
  model::Tensor buffer(int k) {
    return ctx_.tensor(stage_.activation_shape(mbs_[static_cast<std::size_t>(k)].rows));
  }
  static std::size_t count(const model::Tensor& t) { return static_cast<std::size_t>(t.numel()); }

  double clock() {
    if (!trace_) return 0;
    if (trace_->synchronize) p2p_.synchronize();
    return trace_->now_ms();
  }
  void record(Pass pass, int k, double t0) {
    if (!trace_) return;
    const double t1 = clock();
    trace_->events.push_back({pass, k, t0, t1});
  }

  PointToPoint& p2p_;
  Stage& stage_;
  Context& ctx_;
  const std::vector<MicroBatch>& mbs_;
  const StepOptions& opt_;
  Trace* trace_;
  int m_;
  int prev_ = -1, next_ = -1;
  std::deque<Stage::Saved> saved_;
  double loss_ = 0;
};

// GPipe: fill the pipeline with every micro-batch, then drain it. Stage s holds all m.
void gpipe(Runner& r) {
  const int m = r.micro_batches();
  for (int k = 0; k < m; ++k) r.send_forward(r.forward(k, r.recv_forward(k)));
  for (int k = 0; k < m; ++k) r.send_backward(r.backward(k, r.recv_backward(k)));
}

// 1F1B: warm-up, steady state, cool-down (see the top of the file). Stage s holds at most
// w + 1 = p − s micro-batches: the warm-up's w, and one more between each steady forward and
// the backward that follows it.
void one_f_one_b(Runner& r, int stage, int stages) {
  const int m = r.micro_batches();
  const int warmup = std::min(stages - stage - 1, m);
  const int steady = m - warmup;
  for (int k = 0; k < warmup; ++k) r.send_forward(r.forward(k, r.recv_forward(k)));
  model::Tensor input = steady > 0 ? r.recv_forward(warmup) : model::Tensor();
  for (int i = 0; i < steady; ++i) {
    const int k = warmup + i;  // this round's forward
    const int j = i;           // and the oldest micro-batch in flight, whose backward follows
    const model::Tensor out = r.forward(k, std::move(input));
    const model::Tensor dout = r.send_forward_recv_backward(out, j);
    const model::Tensor din = r.backward(j, dout);
    if (i + 1 < steady)
      input = r.send_backward_recv_forward(din, k + 1);
    else
      r.send_backward(din);  // no forward left to receive for
  }
  for (int j = steady; j < m; ++j) r.send_backward(r.backward(j, r.recv_backward(j)));
}

}  // namespace

double train_step(PointToPoint& p2p, Stage& stage, Context& ctx, const std::vector<MicroBatch>& micro_batches,
                  const StepOptions& options, Trace* trace) {
  if (micro_batches.empty()) throw std::invalid_argument("train_step: no micro-batches");
  for (std::size_t k = 0; k < micro_batches.size(); ++k)
    if (micro_batches[k].index != static_cast<int>(k))
      throw std::invalid_argument("train_step: micro-batch " + std::to_string(k) + " has index " +
                                  std::to_string(micro_batches[k].index));
  const int s = p2p.rank(), p = p2p.size();
  if (stage.is_first() != (s == 0) || stage.is_last() != (s == p - 1))
    throw std::invalid_argument("train_step: rank " + std::to_string(s) + " of " + std::to_string(p) +
                                " holds a stage built as " + (stage.is_first() ? "first" : "not first") + " and " +
                                (stage.is_last() ? "last" : "not last"));
  Runner r(p2p, stage, ctx, micro_batches, options, trace);
  if (options.schedule == Schedule::gpipe)
    gpipe(r);
  else
    one_f_one_b(r, s, p);
  return r.loss();
}

}  // namespace k2c::pipeline_parallel
