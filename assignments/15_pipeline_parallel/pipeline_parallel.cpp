// assignments/15_pipeline_parallel/pipeline_parallel.cpp — module 15: your implementation
// (contract: pipeline_parallel.h). Read lectures/15_pipeline_parallel.md first.
//
// Draw the schedule before you write it: a grid with one row per stage and one column per time
// slot, F(k) and B(k) boxes in it, for p = 3 stages and m = 4 micro-batches. For every box ask
// what the stage must have received first and what it sends afterwards; the arrows between
// neighbouring rows are your send, recv and start_send_recv calls, in that order.
#include "pipeline_parallel.h"
#include "k2c/core/todo.h"

namespace k2c::pipeline_parallel {

Span stage_blocks(int n_layers, int stages, int stage) {
  (void)n_layers, (void)stages, (void)stage;
  K2C_TODO("stage_blocks: consecutive runs of blocks, the first n_layers % stages one longer");
}

double train_step(PointToPoint& p2p, Stage& stage, Context& ctx, const std::vector<MicroBatch>& micro_batches,
                  const StepOptions& options, Trace* trace) {
  (void)p2p, (void)stage, (void)ctx, (void)micro_batches, (void)options, (void)trace;
  K2C_TODO("train_step: GPipe (all forwards, then all backwards) and 1F1B (warm-up, one forward "
           "and one backward in turn, cool-down)");
}

}  // namespace k2c::pipeline_parallel
