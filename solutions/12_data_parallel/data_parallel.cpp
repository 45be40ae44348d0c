// solutions/12_data_parallel/data_parallel.cpp — reference solution of module 12
// (contract: data_parallel.h).
//
// Data parallelism in three pieces, each one a refinement of the one before.
//
//   1. Same start. Replicas that start from different values never agree again, however well
//      their gradients are averaged, so rank 0's values go everywhere first: one broadcast of the
//      whole flat value buffer (frozen parameters too: they take part in forward).
//   2. Same gradient. After backward, rank r holds the mean gradient over its own tokens; the
//      average over ranks is the mean over the global batch. One all-reduce per parameter does it,
//      correctly and slowly: a 136M-parameter model in 75 tensors issues 75 collectives per
//      step, each paying the start-up cost α, and none starts before backward has finished, so
//      the link idles during backward and the GPUs idle during the all-reduce.
//   3. Same gradient, sooner. Group the gradients into buckets of tens of MB (fewer, larger
//      collectives: less α) and start each bucket's all-reduce as soon as its last gradient is
//      final, while backward computes the layers below (the gradient-ready callback tells us
//      when). Only the last bucket's all-reduce is left exposed after backward ends.
//
// Buckets follow reverse registration order because backward runs the model back to front: the
// head's and the last block's gradients are final first, the embedding's last. Packing in that
// order makes the first bucket complete early in backward and each next one a little later.
// The gradient buffer is flat, in registration order, and frozen parameters have no slot in it,
// so consecutive trainable parameters are adjacent there: each bucket is one contiguous range
// and is all-reduced in place, with none of the copies into and out of a bucket buffer that a
// framework with scattered gradient tensors needs.
//
// Order of collectives. Every rank must start the same collectives in the same order. Buckets
// are started in the order they complete, which is not always bucket order (a block registers
// its two norms before its attention weights, but backward finishes the second norm first), yet
// the order is the same on every rank, because every rank runs the same backward over the same
// layers. (PyTorch's DDP launches strictly in bucket order, since autograd may finish gradients
// in a different order on different ranks; our hand-written backward cannot.)
//
// Accumulation. Backward adds into the gradients, so k micro-batches accumulate by themselves;
// only the last backward of the step must communicate. before_backward(false) turns the callback
// into a no-op: communicating after every micro-batch would give the same average (the
// all-reduce is linear) for k times the traffic.
//
// Averaging. ReduceOp::avg divides by the number of ranks inside the collective (NCCL's ncclAvg;
// a sum and a division on MPI), so no second pass over the gradients is needed. At 2 ranks the
// result is exactly (g0 + g1) / 2: one addition, commutative, then an exact halving, which is why
// 2 ranks can match one process bit for bit.
#include "data_parallel.h"

#include <stdexcept>
#include <string>

namespace k2c::data_parallel {
namespace {

// A gradient element is 4 bytes of fp32, whatever the backend.
constexpr std::size_t kGradBytes = sizeof(float);

float* grads_at(ParamList& params, std::int64_t element) {
  // Pointer arithmetic only: on NCCL this is device memory and must not be dereferenced here.
  return static_cast<float*>(params.flat_grads().raw()) + element;
}

}  // namespace

void broadcast_parameters(Communicator& comm, ParamList& params) {
  if (!params.materialized()) throw std::logic_error("broadcast_parameters: parameters not materialized");
  // One collective over the flat buffer rather than one per tensor: a single start-up cost, and
  // the frozen values come along for free.
  model::Tensor& values = params.flat_values();
  comm.broadcast(values.raw(), static_cast<std::size_t>(values.numel()), dist::DType::f32, 0);
}

void all_reduce_gradients(Communicator& comm, ParamList& params) {
  // trainable() is the registration order without the frozen parameters; a tied weight appears
  // once, with the sum of both uses' contributions already in its one gradient.
  for (ParamId id : params.trainable()) {
    model::Tensor& g = params.grad(id);
    comm.all_reduce(g.raw(), g.raw(), static_cast<std::size_t>(g.numel()), dist::DType::f32,
                    dist::ReduceOp::avg);
  }
}

std::vector<Bucket> plan_buckets(const ParamList& params, std::size_t bucket_bytes) {
  std::vector<Bucket> plan;
  std::size_t open_bytes = 0;
  for (ParamId id = params.size() - 1; id >= 0; --id) {
    const model::ParamInfo& p = params.info(id);
    if (p.frozen) continue;
    if (p.grad_offset < 0) throw std::logic_error("plan_buckets: parameters not materialized");
    const std::size_t bytes = static_cast<std::size_t>(p.shape.numel()) * kGradBytes;
    // Greedy and one pass: close the open bucket when this parameter would overflow it. A
    // parameter larger than a bucket therefore lands alone in a fresh one (it cannot join
    // anything), and the next parameter finds that bucket full and opens another.
    if (plan.empty() || open_bytes + bytes > bucket_bytes) {
      plan.push_back({p.grad_offset + p.shape.numel(), p.grad_offset + p.shape.numel(), {}});
      open_bytes = 0;
    }
    Bucket& b = plan.back();
    b.begin = p.grad_offset;  // walking down the buffer: each parameter extends the range below
    b.params.push_back(id);
    open_bytes += bytes;
  }
  return plan;
}

// ---------------------------------------------------------------------------------------------
// The bucketed DDP

struct DataParallel::State {
  Communicator& comm;
  ParamList& params;
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;         // parameter id -> its bucket (-1: frozen)
  std::vector<int> waiting;           // per bucket: gradients not yet final in this backward
  std::vector<dist::Ticket> tickets;  // per bucket: its started all-reduce
  std::vector<char> started;          // per bucket: started in this step, not yet waited on
  bool sync = true;

  State(Communicator& c, ParamList& p, std::size_t bucket_bytes)
      : comm(c), params(p), buckets(plan_buckets(p, bucket_bytes)) {
    bucket_of.assign(static_cast<std::size_t>(p.size()), -1);
    for (std::size_t b = 0; b < buckets.size(); ++b)
      for (ParamId id : buckets[b].params) bucket_of[static_cast<std::size_t>(id)] = static_cast<int>(b);
    waiting.assign(buckets.size(), 0);
    tickets.assign(buckets.size(), dist::Ticket{});
    started.assign(buckets.size(), 0);
  }

  // The gradient-ready callback: runs inside backward, on the host, right after the layer that
  // used `id` last has issued the work that adds its contribution. start_all_reduce is ordered
  // after that work (the communicator's rule for started collectives), so the all-reduce reads
  // the final gradient even though the GPU may not have computed it yet when we get here.
  void on_ready(ParamId id) {
    if (!sync) return;  // a micro-batch before the last: the gradients keep accumulating
    const int b = bucket_of.at(static_cast<std::size_t>(id));
    if (b < 0) return;  // frozen parameters never fire; this is only a guard
    int& left = waiting[static_cast<std::size_t>(b)];
    if (left <= 0 || started[static_cast<std::size_t>(b)])
      throw std::logic_error("DataParallel: bucket " + std::to_string(b) +
                             " heard from more gradients than it holds (call before_backward before each backward)");
    if (--left > 0) return;
    // Every gradient of the bucket is final: reduce its range in place, and leave it open. The
    // backward of the layers below runs meanwhile; finish_gradients() waits.
    const Bucket& bucket = buckets[static_cast<std::size_t>(b)];
    float* range = grads_at(params, bucket.begin);
    tickets[static_cast<std::size_t>(b)] =
        comm.start_all_reduce(range, range, static_cast<std::size_t>(bucket.end - bucket.begin),
                              dist::DType::f32, dist::ReduceOp::avg);
    started[static_cast<std::size_t>(b)] = 1;
  }
};

DataParallel::DataParallel(Communicator& comm, ParamList& params, std::size_t bucket_bytes)
    : state_(std::make_unique<State>(comm, params, bucket_bytes)) {
  // The callback captures the state's address, which the unique_ptr keeps fixed for the object's
  // whole life; the destructor takes the callback away before the state goes.
  State* s = state_.get();
  params.on_grad_ready([s](ParamId id) { s->on_ready(id); });
}

DataParallel::~DataParallel() {
  // Nobody must call into a state that is gone. All-reduces left open (a step abandoned by an
  // exception) are not waited on here: the other ranks may never join them. The communicator's
  // synchronize() closes them.
  if (state_) state_->params.on_grad_ready(nullptr);
}

void DataParallel::before_backward(bool sync) {
  State& s = *state_;
  for (char open : s.started)
    if (open)
      throw std::logic_error("DataParallel: before_backward with all-reduces still open (call finish_gradients)");
  s.sync = sync;
  // Each bucket waits for each of its parameters once per backward: the library fires the
  // callback once per parameter, after a tied weight's last use.
  for (std::size_t b = 0; b < s.buckets.size(); ++b) s.waiting[b] = static_cast<int>(s.buckets[b].params.size());
}

void DataParallel::finish_gradients() {
  State& s = *state_;
  // Wait on everything that was started before complaining about what was not, so that no ticket
  // is left open on this rank whatever happens.
  int missing = -1;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    if (!s.started[b]) {
      if (missing < 0) missing = static_cast<int>(b);
      continue;
    }
    // On MPI this is where the reduction completes; on NCCL it only orders the work issued next
    // (the optimizer) after the collective, without a host wait.
    s.comm.wait(s.tickets[b]);
    s.started[b] = 0;
  }
  if (missing >= 0)
    throw std::logic_error("DataParallel: the all-reduce of bucket " + std::to_string(missing) +
                           " was never started (no synchronised backward, or a gradient never reported final)");
}

const std::vector<Bucket>& DataParallel::buckets() const { return state_->buckets; }

}  // namespace k2c::data_parallel
