// assignments/12_data_parallel/data_parallel.h — the contract of module 12 (do not edit).
//
// Data parallelism: every rank holds a whole replica of the model, reads its own rows of each
// global batch, and after backward the replicas agree on the gradient averaged over all ranks,
// so that one optimizer step on every rank keeps them identical. The model, its loss and
// backward, the optimizer and the data are the model library's (k2c/model/); what you write is
// only how the gradients travel:
//
//   broadcast_parameters   rank 0's initial values everywhere, before the first step
//   all_reduce_gradients   naive DDP: one blocking all-reduce per parameter after backward
//   plan_buckets           parameters packed into buckets, last registered first
//   DataParallel           bucketed DDP: each bucket's all-reduce started from the gradient-ready
//                          callback as soon as its last gradient is final, while backward goes
//                          on; gradient accumulation over micro-batches without synchronising
//                          until the last one
//
// Gradients live in one flat fp32 buffer (ParamList::flat_grads()), trainable parameters in
// registration order, frozen ones left out; parameter p's gradient is the range
// [info(p).grad_offset, grad_offset + numel) of it. A bucket is a contiguous range of that
// buffer, so it is reduced where it lies, with no packing copy.
//
// The caller scales each rank's loss so that the gradient a rank accumulates over a step is the
// mean over its own tokens; the average over the ranks (ReduceOp::avg) is then the mean over the
// global batch, what one process that saw all of it would compute.
//
// Every rank makes the same calls in the same order with the same arguments, as every collective
// requires. Buffers are the model library's tensors, which live where the communicator's
// collectives expect them (host memory on MPI, device memory on NCCL): pass their raw()
// pointers to the communicator and never read or write gradient elements yourself.
//
// Tests: autograder/12_data_parallel/test_data_parallel.cpp. Lecture: lectures/12_data_parallel.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "k2c/dist/communicator.h"
#include "k2c/model/params.h"

namespace k2c::data_parallel {

using dist::Communicator;
using model::ParamId;
using model::ParamList;

// Every rank's parameter values, frozen ones included, become rank 0's. Ranks may have been
// initialised differently (another seed); afterwards the replicas are bit-identical. Collective:
// every rank calls it.
void broadcast_parameters(Communicator& comm, ParamList& params);

// Naive DDP, after a backward: each trainable parameter's gradient becomes its average over the
// ranks, with one blocking all-reduce (ReduceOp::avg) per trainable parameter, in registration
// order. Frozen parameters have no gradient and are skipped; a tied parameter is one parameter
// with one gradient, reduced once.
void all_reduce_gradients(Communicator& comm, ParamList& params);

// A bucket: a contiguous range [begin, end) of the flat gradient buffer (elements) and the
// trainable parameters whose gradients make it up, in the order they were packed.
struct Bucket {
  std::int64_t begin = 0, end = 0;
  std::vector<ParamId> params;
};

// The bucket plan for `bucket_bytes` (fp32 gradient bytes per bucket). Walk the trainable
// parameters from the last registered to the first (backward produces gradients in roughly that
// order) and pack greedily: a parameter joins the open bucket if the bucket's gradient bytes stay
// within bucket_bytes; otherwise that bucket is closed and the parameter opens the next one. So
// every bucket holds at most bucket_bytes, except a bucket holding a single parameter larger than
// that, and bucket 0 ends at the end of the gradient buffer. Every trainable parameter is in
// exactly one bucket, frozen parameters in none; no bucket is empty. Needs materialized params.
std::vector<Bucket> plan_buckets(const ParamList& params, std::size_t bucket_bytes);

// Bucketed DDP with overlap and gradient accumulation. One step of k micro-batches (k >= 1):
//
//   params.zero_grads(ops);
//   for (int m = 0; m < k; ++m) {
//     ddp.before_backward(m == k - 1);         // synchronise on the last micro-batch only
//     model.train_step(ctx, ids[m], targets[m], rows, grad_scale);
//   }
//   ddp.finish_gradients();                    // every rank: the averaged gradients
//   optimizer.step(lr);
//
// The constructor plans the buckets (plan_buckets) and installs the gradient-ready callback
// (ParamList::on_grad_ready), which it owns from then on; the destructor removes it. One
// DataParallel per ParamList at a time.
class DataParallel {
 public:
  DataParallel(Communicator& comm, ParamList& params, std::size_t bucket_bytes);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Before each backward. sync = true (the step's last or only micro-batch): during this
  // backward, each bucket's all-reduce (ReduceOp::avg, in place on its range of the flat
  // gradient buffer, through start_all_reduce) is started from the callback as soon as every
  // parameter of the bucket has reported its gradient final, while backward goes on with the
  // layers below. sync = false (a micro-batch before the last): gradients only accumulate
  // locally, and nothing is communicated. Exactly one all-reduce per bucket per synchronised
  // backward, at every rank count (1 included: the tests count them).
  void before_backward(bool sync);

  // After the synchronised backward: waits on every bucket's all-reduce. On return each trainable
  // gradient holds the average over the ranks of what they accumulated, bit-identical on every
  // rank, and the next step may begin.
  void finish_gradients();

  // The plan the constructor made.
  const std::vector<Bucket>& buckets() const;

 private:
  struct State;  // yours: define it in data_parallel.cpp
  std::unique_ptr<State> state_;
};

}  // namespace k2c::data_parallel
