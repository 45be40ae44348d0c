// autograder/18_capstone/grid_plan.h — a grid's cost before the run: what each pipeline stage's
// rank holds and what it sends in one step, from the configuration alone (`k2c_capstone --plan`).
//
// Lecture 18 section 7 asks for one rank's memory and each group's bytes per step before a run.
// This is that sum, written out once: the model library's parameter list cut the way the
// contracts of modules 12 to 17 cut it, and the traffic those contracts fix exactly:
//   dp    DataParallel: the rank's trainable gradients, all-reduced once a step
//   dp+ep under ep > 1 the dense gradients summed over the data ranks ("ep" where dp = 1); the
//         experts' over dp
//   tp    per dense block and micro-batch two all-reduces of N·d fp32 forward and two backward;
//         under a mixture of experts, attention's one each way; the embedding's one forward; the
//         head's input gradient; the cross-entropy's three of N floats
//   pp    each micro-batch's activation to the next stage and its gradient to the one before
//   ep    per MoE layer and micro-batch: the counts (4·E), the forward's statistics (4·(2E + 1)),
//         and four exchanges of rows (dispatch, combine; the gradients out and back), each
//         4·d·N·k·(ep − 1)/ep bytes when routing spreads the tokens evenly (an estimate: the real
//         figure follows the router)
//   world the loss and the gradient norm, one f64 each (under ZeRO the loss only)
//   ZeRO  module 13's contract: a reduce-scatter and an all-gather of every padded unit (stage 3:
//         each layer's units gathered before its forward and again before its backward, but the
//         last layer's; a tied head's is the embedding's), and with clipping the norm's f64, on dp
// N is one micro-batch's tokens on one data rank. Bytes are counted as k2c/dist/counting.h counts
// them (a collective at the size it is quoted at; "send" is what this rank sends point to point),
// so a CountingCommunicator under a real run holds the same numbers (grid_plan_test.cpp checks
// that against the reference solution); wire_bytes() turns them into what crosses a rank's link,
// summed by purpose: "gradients" (the reductions above and ZeRO's gathers), "tp", "pp", "ep" (the
// MoE layers' exchanges) and "loss" (the loss and the norm).
//
// Memory is the training state: parameters and gradients 4 bytes an element, AdamW's two moments
// 8, as the ledger counts them between steps; and an estimate of the activations' peak in a
// step: what each micro-batch in flight keeps for its backward (the schedule: 1F1B keeps
// min(p − s, m) on stage s, GPipe all m), as the reference's layers keep it, plus the largest
// transient (the last stage's logits, or a block's gradients in backward).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "capstone.h"
#include "k2c/dist/counting.h"

namespace k2c::capstone {

// k2c_capstone's model presets: tiny, tiny-moe, dense-135m and moe-135m (dense-135m's trunk with
// 32 experts of width 512, top 4, and one shared expert: about the dense model's FLOPs per token).
// Throws std::invalid_argument for another name.
model::ModelConfig capstone_preset(const std::string& name);

// The most ranks a plan takes (so that every product of the grid's sizes fits an int).
inline constexpr std::int64_t kMaxPlanRanks = 1 << 20;

// group label -> operation -> bytes per step. A group's label is k2c/dist/grid.h's axes_label of
// the axes it spans: "dp", "tp", "pp", "ep", "dp+ep", or "self" for a group of one rank; and
// "world" for the whole grid.
using PlannedTraffic = std::map<std::string, std::map<std::string, std::uint64_t>>;

// One rank of a pipeline stage (every rank of a stage holds and sends the same amounts).
struct StagePlan {
  int stage = 0, first_block = 0, last_block = 0;  // blocks [first, last)
  std::int64_t values = 0, trainable = 0;           // parameter elements the rank holds, trains
  std::uint64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  std::uint64_t activation_bytes = 0;               // the estimated peak (see above)
  PlannedTraffic traffic;
  std::map<std::string, double> wire;  // purpose ("gradients", "tp", ...: see above) -> wire bytes a step
  // (group, operation) whose bytes are an estimate: ep's rows under even routing.
  std::set<std::pair<std::string, std::string>> estimated;
  std::uint64_t state_bytes() const { return param_bytes + grad_bytes + optimizer_bytes; }
};

struct GridPlan {
  CapstoneConfig config;
  std::int64_t tokens_per_micro_batch = 0;  // N: rows · T on one data rank
  std::vector<StagePlan> stages;            // one per pipeline stage
};

// Throws std::invalid_argument for a configuration GridTrainer would refuse (the same reasons,
// found without ranks) or a grid of more than kMaxPlanRanks ranks. The vocabulary must divide by
// tp: round_vocab_to_tp first, as k2c_capstone does.
GridPlan plan_grid(const CapstoneConfig& config);

// Rounds the model's vocabulary up to a multiple of the grid's tp (the extra ids are never targets),
// so that a vocabulary cut over tp divides.
void round_vocab_to_tp(CapstoneConfig& config);

// What crosses one rank's link for `bytes` of `op` counted on a group of n ranks: an all-reduce
// 2(n − 1)/n of its buffer (a ring), an all-gather or reduce-scatter (n − 1)/n, an all-to-all of
// a whole buffer (n − 1)/n; rows and point-to-point messages as counted (only what leaves).
double wire_bytes(const std::string& op, std::uint64_t bytes, int n);

// The plan as the tables k2c_capstone --plan prints.
std::string describe(const GridPlan& plan);

// Every grid of `ranks` ranks that fits base's model and batch (dp × tp × pp × ep, ep only for a
// mixture of experts), each planned, its vocabulary rounded to its tp; ordered by the wire bytes
// of its busiest stage's step. base's micro-batches where a data rank's rows split into them, else
// the most below that do; base's ZeRO stage on dp-only grids (with one micro-batch), none elsewhere.
std::vector<GridPlan> plan_grids(const CapstoneConfig& base, int ranks);

// One line a grid: memory (state + activations) and wire bytes a step by purpose, each figure its
// busiest stage's.
std::string describe_grids(const std::vector<GridPlan>& plans);

// The plans as JSON (k2c_capstone --plan --json FILE; tools/plot_grids.py draws them): per grid its
// memory, wire bytes by purpose, bubble, and each stage's figures and traffic ("group operation").
std::string plans_json(const std::vector<GridPlan>& plans);

// The busiest stage's memory (state + activations); the busiest stage's wire bytes a step for one
// purpose ("gradients", "tp", "pp", "ep", "loss"; "" for all of them together); the pipeline's
// idle share of an ideal step, (p − 1)/(m + p − 1) (lecture 15).
std::uint64_t peak_memory(const GridPlan& plan);
double wire_per_step(const GridPlan& plan, const std::string& purpose = "");
double bubble(const GridPlan& plan);

// A CountingCommunicator's counts as the plan states them: what the rank sent, by group and
// operation ("send" for point-to-point sends, blocking or in an exchange; receives, barriers and
// zero-byte entries left out).
PlannedTraffic sent_bytes(const dist::TrafficTable& counts);

// A step's counts beside stage `s`'s plan, one row per group and operation: what was sent, what
// the plan says, their ratio (k2c_capstone --traffic).
std::string compare_traffic(const GridPlan& plan, const StagePlan& s, const PlannedTraffic& sent);

}  // namespace k2c::capstone
