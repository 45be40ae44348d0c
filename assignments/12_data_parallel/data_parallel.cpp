// assignments/12_data_parallel/data_parallel.cpp — module 12: your implementation
// (contract: data_parallel.h). Read lectures/12_data_parallel.md first.
//
// Go in the order of the tasks: the broadcast and the naive all-reduce need a dozen lines and
// already make two ranks train like one process; the bucket plan is plain bookkeeping; the
// bucketed DataParallel puts the two together with the gradient-ready callback. Never touch a
// gradient element yourself: on NCCL they are device memory. Hand the communicator pointers into
// the flat buffers (Tensor::raw(), offsets in elements of 4 bytes).
#include "data_parallel.h"
#include "k2c/core/todo.h"

namespace k2c::data_parallel {

void broadcast_parameters(Communicator& comm, ParamList& params) {
  (void)comm, (void)params;
  K2C_TODO("broadcast_parameters: rank 0's flat value buffer to every rank");
}

void all_reduce_gradients(Communicator& comm, ParamList& params) {
  (void)comm, (void)params;
  K2C_TODO("all_reduce_gradients: one all_reduce (avg) per trainable parameter, in place");
}

std::vector<Bucket> plan_buckets(const ParamList& params, std::size_t bucket_bytes) {
  (void)params, (void)bucket_bytes;
  K2C_TODO("plan_buckets: trainable parameters, last registered first, packed greedily");
}

// Whatever the bucketed DDP needs to remember between calls: the plan, how many gradients each
// bucket still waits for, the tickets of the started all-reduces, whether this backward syncs.
struct DataParallel::State {};

DataParallel::DataParallel(Communicator& comm, ParamList& params, std::size_t bucket_bytes) {
  (void)comm, (void)params, (void)bucket_bytes;
  K2C_TODO("DataParallel: plan the buckets, install the gradient-ready callback");
}

DataParallel::~DataParallel() = default;

void DataParallel::before_backward(bool sync) {
  (void)sync;
  K2C_TODO("before_backward: reset the per-bucket counts, remember whether to synchronise");
}

void DataParallel::finish_gradients() {
  K2C_TODO("finish_gradients: wait on every bucket's ticket");
}

const std::vector<Bucket>& DataParallel::buckets() const {
  K2C_TODO("buckets: the plan made by the constructor");
}

}  // namespace k2c::data_parallel
