// assignments/17_expert_parallel/expert_parallel.cpp — module 17: your implementation
// (contract: expert_parallel.h). Read lectures/17_expert_parallel.md first.
//
// Work in the order of the points table: the plan (capacity, the counts exchange), the two
// exchanges to_experts and from_experts, the forward pair dispatch and combine, then the layer:
// its constructor (shards with Init::shard), forward (route as model::Moe::route does, plan, the
// group's load, dispatch, the local experts, combine) and backward (the same in reverse, with the
// router's gradient), and last reduce_gradients. common/model/src/moe.cpp is the single-process
// layer you are compared against: its route, forward and backward show every step you need,
// minus the communication.
#include "expert_parallel.h"
#include "k2c/core/todo.h"

namespace k2c::expert_parallel {

Plan plan_exchange(Communicator& ep, Context& ctx, const Routing& routing, const std::vector<float>& weights,
                   std::int64_t capacity) {
  (void)ep, (void)ctx, (void)routing, (void)weights, (void)capacity;
  K2C_TODO("plan_exchange: capacity per expert, rows in plan order, one all_to_all of the counts, offsets");
}

void to_experts(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& rows, Tensor& expert_rows,
                const std::function<void()>& meanwhile) {
  (void)ep, (void)ctx, (void)plan, (void)rows, (void)expert_rows, (void)meanwhile;
  K2C_TODO("to_experts: start the all_to_all_v of other ranks' rows, copy your own, meanwhile, wait");
}

void from_experts(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& expert_rows, Tensor& rows,
                  const std::function<void()>& meanwhile) {
  (void)ep, (void)ctx, (void)plan, (void)expert_rows, (void)rows, (void)meanwhile;
  K2C_TODO("from_experts: the reverse of to_experts");
}

void dispatch(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& x, Tensor& expert_in,
              const std::function<void()>& meanwhile) {
  (void)ep, (void)ctx, (void)plan, (void)x, (void)expert_in, (void)meanwhile;
  K2C_TODO("dispatch: x's rows in plan order (gather_rows), then to the experts");
}

void combine(Communicator& ep, Context& ctx, const Plan& plan, const Tensor& expert_out, Tensor& returned, Tensor& y,
             const std::function<void()>& meanwhile) {
  (void)ep, (void)ctx, (void)plan, (void)expert_out, (void)returned, (void)y, (void)meanwhile;
  K2C_TODO("combine: the experts' rows back into returned, then y += weight·row (scatter_add_rows)");
}

ExpertParallelMoe::ExpertParallelMoe(Communicator& ep, ParamList& params, const std::string& name,
                                     const MoeConfig& config, double capacity_factor) {
  (void)ep, (void)params, (void)name, (void)config, (void)capacity_factor;
  K2C_TODO("ExpertParallelMoe: check E % n, router whole, expert shards [r·L, (r+1)·L) with Init::shard, shared");
}

void ExpertParallelMoe::forward(Context& ctx, const Tensor& x, Tensor& y, Saved& saved) const {
  (void)ctx, (void)x, (void)y, (void)saved;
  K2C_TODO("ExpertParallelMoe::forward: route, plan, the group's load, dispatch, local experts, combine");
}

void ExpertParallelMoe::backward(Context& ctx, const Tensor& x, Saved& saved, const Tensor& dy, Tensor& dx) const {
  (void)ctx, (void)x, (void)saved, (void)dy, (void)dx;
  K2C_TODO("ExpertParallelMoe::backward: combine's backward, to the experts, their backward, back, router");
}

void reduce_gradients(Communicator& dense, Communicator& expert_dp, Context& ctx, const ExpertParallelMoe& moe) {
  (void)dense, (void)expert_dp, (void)ctx, (void)moe;
  K2C_TODO("reduce_gradients: all-reduce the dense gradients over dp x ep, the experts' over dp");
}

}  // namespace k2c::expert_parallel
