// assignments/15_pipeline_parallel/pipeline_parallel.h — the contract of module 15 (do not edit).
//
// Pipeline parallelism: the transformer's blocks are cut into p consecutive stages, one per rank
// of the pipeline group, the embedding on the first and the head with the loss on the last
// (stage.h holds the layers of one stage and is course code). A step's batch is cut into m
// micro-batches; each one flows forward through the stages, its activation sent from each stage
// to the next, and back again, the gradient of that activation sent the other way. What you write
// is how the stages share the blocks and in what order each stage runs its forward and backward
// passes and exchanges tensors with its neighbours: the schedule.
//
//   stage_blocks   which blocks stage s of p holds
//   train_step     one step's forward and backward passes over m micro-batches, on one stage,
//                  in one of two schedules:
//     gpipe         all forwards, then all backwards (GPipe): simple, m micro-batches alive
//     one_f_one_b   1F1B: a few forwards to fill the pipeline, then one forward and one
//                   backward in turn, then the remaining backwards: at most p − s alive
//
// Communication is point to point only, between neighbouring stages of the group: p2p.rank() is
// this stage, p2p.size() the number of stages, and the neighbours are rank − 1 and rank + 1.
// Activations and gradients are model tensors in the backend's memory (host memory on MPI,
// device memory on NCCL); send their raw() pointers, as fp32, never touch their elements.
//
// Tests: autograder/15_pipeline_parallel/test_pipeline_parallel.cpp.
// Lecture: lectures/15_pipeline_parallel.md.
#pragma once

#include <chrono>
#include <vector>

#include "k2c/dist/communicator.h"
#include "stage.h"

namespace k2c::pipeline_parallel {

using dist::PointToPoint;
using model::Context;
using pipeline_stage::MicroBatch;
using pipeline_stage::Pass;
using pipeline_stage::Span;
using pipeline_stage::Stage;

// The blocks [first, last) that stage `stage` of `stages` holds, out of `n_layers`: consecutive
// runs in stage order covering all of them, as even as possible, the first n_layers % stages
// stages one block longer (10 blocks on 4 stages: 3, 3, 2, 2). Every stage must hold at least one
// block: more stages than blocks throws std::invalid_argument naming both counts, and so do
// stages < 1 or stage outside [0, stages).
Span stage_blocks(int n_layers, int stages, int stage);

enum class Schedule { gpipe, one_f_one_b };

// One forward or backward pass of a micro-batch on this stage, in milliseconds since the trace's
// origin.
struct Event {
  Pass pass = Pass::forward;
  int micro_batch = 0;
  double start_ms = 0, end_ms = 0;
};

// What train_step records, if asked: one Event per pass, appended in the order the passes ran,
// start_ms read just before calling Stage::forward or Stage::backward and end_ms just after it
// returns (communication is outside the box). On NCCL those calls return once the work is
// queued; with `synchronize` set, call p2p.synchronize() before reading each clock, so the times
// are those of the device (slower, but a picture of what really happened).
struct Trace {
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
  bool synchronize = false;
  std::vector<Event> events;
  double now_ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - origin).count();
  }
};

struct StepOptions {
  Schedule schedule = Schedule::one_f_one_b;
  bool recompute = false;  // passed to every Stage::forward: keep only each micro-batch's input
};

// One training step's forward and backward passes on this stage, over the step's micro-batches
// (m = micro_batches.size() >= 1, micro_batches[k].index == k; every stage is given the same list).
// The gradients of the stage's parameters accumulate what the unsplit model would accumulate
// over the same micro-batches (call ctx.params.zero_grads before, the optimizer after).
//
// Loss. The step's loss is the mean of the micro-batches' mean losses. Pass every Stage::forward
// grad_scale = 1.0f / static_cast<float>(m * tokens_k), with tokens_k = rows_k · seq_len (the
// gradient of that mean), and return, on the last stage, the sum over k = 0, 1, ..., m − 1 in
// that order of (loss_k / tokens_k), divided by m, in double (loss_k: what forward returned).
// Other stages return 0.
//
// Order. Each stage runs the backward passes in micro-batch order 0, 1, ..., m − 1, as the
// unsplit model would (they add into the gradients, and float addition is not associative), and
// the forward passes in the same order. Stage s of p runs:
//   gpipe        F0 F1 ... F(m−1), then B0 B1 ... B(m−1)
//   one_f_one_b  w = min(p − s − 1, m) forwards F0 .. F(w−1) (warm-up); then, while forwards
//                remain, F(k) followed by the backward of the oldest micro-batch in flight
//                (steady state); then the remaining backwards (cool-down)
// Every forward but the first stage's starts with the activation received from stage s − 1; every
// forward but the last stage's ends by sending its output to stage s + 1; backward mirrors it
// (receive the gradient from s + 1 unless last, send the input's gradient to s − 1 unless first).
// In 1F1B's steady state, sending an output forward and receiving a gradient from the next stage
// are one exchange (start_send_recv with the same peer both ways), and so are sending a gradient
// back and receiving the next activation from the previous stage: two stages that would otherwise
// both send first can then never wait on each other.
//
// `trace`, if not null, receives one Event per pass (see Trace). Throws std::invalid_argument for
// an empty micro-batch list, or one whose indices are not 0 .. m − 1, or a group whose size or
// rank does not match the stage (first and last).
double train_step(PointToPoint& p2p, Stage& stage, Context& ctx, const std::vector<MicroBatch>& micro_batches,
                  const StepOptions& options, Trace* trace = nullptr);

}  // namespace k2c::pipeline_parallel
