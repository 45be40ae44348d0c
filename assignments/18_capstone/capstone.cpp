// assignments/18_capstone/capstone.cpp — module 18: your implementation (contract: capstone.h).
// Read lectures/18_capstone.md first, and the handout (README.md) for the order to work in.
//
// You have written every piece already; here they meet. Include the contracts of your modules
// ("data_parallel.h", "zero.h", "tensor_parallel.h", "pipeline_parallel.h" with its "stage.h",
// "expert_parallel.h"): this library links your own implementations of 12, 13, 14, 15 and 17. A
// plan that works:
//   - Impl holds your grid (coordinates from the world rank in k2c/dist/grid.h's layout, and the
//     groups, each one world.split()), the ledger, the ParamList, a Context, your stage, the
//     optimizer, the two loaders and the step count.
//   - Your stage derives from pipeline_stage::Stage (stage.h: its protected constructor registers
//     nothing; forward and backward are virtual) so that module 15's train_step can run it. It
//     registers the layers of its span under model::Transformer's names: the library's where an
//     axis is 1, module 14's or 17's where it is not. Call count_forward / count_backward.
//   - config.train.activations goes into the Context (capstone.h, Activations); with bf16, make
//     the tensors of the stage that model::Transformer makes with ctx.activation() the same way.
//     config.train.residual likewise, for the ones made with ctx.residual_stream() (capstone.h,
//     The residual stream).
//   - Which group reduces which gradient is the heart of the module: write it down for dp, tp,
//     pp and ep before you code it (lecture, section 4).
//   - Checkpoints: one file per rank, with a header that refuses another grid or model.
//   - ZeRO last, once dp 2 works (zero_stage > 0): a model::Transformer over your ParamList and
//     your module 13's zero::Zero over the dp group take the place of the stage, DataParallel and
//     AdamW. Zero sums where DataParallel averages: scale the loss to the global batch. Stage 3
//     keeps no whole weight, and evaluate must still run. Refuse first what Zero cannot run.
#include "capstone.h"
#include "k2c/core/todo.h"

namespace k2c::capstone {

struct GridTrainer::Impl {};

GridTrainer::GridTrainer(dist::Communicator& world, model::Ops& ops, const CapstoneConfig& config,
                         const LoaderFactory& data) {
  (void)world, (void)ops, (void)config, (void)data;
  if (config.zero_stage != 0)
    K2C_TODO("GridTrainer with zero_stage: refuse what Zero cannot run (capstone.h, ZeRO), then a "
             "model::Transformer and module 13's zero::Zero over the dp group instead of the stage and AdamW");
  if (config.grid.tp > 1 && config.grid.ep > 1)
    K2C_TODO("GridTrainer on tp x ep: 14's ParallelAttention over tp around 17's ExpertParallelMoe over the ep "
             "group of this tp coordinate (capstone.h, tp x ep), and a norm that counts expert slices at tp 0");
  K2C_TODO("GridTrainer: the grid and its groups, this rank's stage and parameters, the optimizer, the loaders");
}

GridTrainer::~GridTrainer() = default;

model::StepRecord GridTrainer::step() {
  K2C_TODO("step: 15's schedule over your stage, gradients over their groups, the grid-wide norm, AdamW");
}

double GridTrainer::evaluate(int batches) {
  (void)batches;
  K2C_TODO("evaluate: forward only through the pipeline, the loss averaged over the data ranks");
}

std::vector<float> GridTrainer::gather_values() {
  K2C_TODO("gather_values: every weight from the one rank that holds it, in the unsplit layout");
}

void GridTrainer::save(const std::filesystem::path& path) {
  (void)path;
  K2C_TODO("save: this rank's parameters, AdamW moments and steps, behind a header");
}

void GridTrainer::load(const std::filesystem::path& path) {
  (void)path;
  K2C_TODO("load: the same, refusing a file of another grid, rank or model");
}

int GridTrainer::steps_done() const { K2C_TODO("steps_done"); }
dist::GridCoords GridTrainer::coords() const { K2C_TODO("coords"); }
model::MemoryLedger& GridTrainer::ledger() { K2C_TODO("ledger"); }

}  // namespace k2c::capstone
