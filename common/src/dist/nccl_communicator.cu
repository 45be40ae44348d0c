// nccl_communicator.cu — the NCCL backend: device buffers, work queued on the communicator's
// two streams, completion (and its time limit) checked in synchronize().
//
// Two streams, so that a reduction can run while the next chunk is on the wire. Local work
// (copy, reduce_local, host transfers) goes on `stream_`, the world's compute stream, which
// every split() of the world shares; started exchanges and collectives go on `comm_stream_`,
// one per communicator. The rules of communicator.h become events between them:
//   start_*          comm stream waits for the local work so far, then the operation, then an
//                    event of its own (the ticket);
//   wait(ticket)     local stream waits for that event;
//   blocking all_reduce, reduce_scatter, all_gather, all_to_all_v
//                    start + wait: ordered after everything before them (the comm stream runs
//                    in issue order), everything after them waits for them;
//   everything else that talks to other ranks (broadcast, reduce, all_to_all, send, recv)
//                    goes on the local stream after it waited for the comm stream: ordered
//                    after everything.
// Every NCCL operation of a communicator is therefore ordered after the one issued before it,
// so the GPU runs them in the order every rank issued them, as NCCL requires.
//
// The compute stream is shared so that the groups of a process grid need no synchronize()
// between them: a tensor-parallel all-reduce, then a data-parallel one, then a model kernel
// launched on compute_stream() run in that order. The price is that operations of different
// groups are serialised on it in issue order, which is safe because every rank issues them in
// the same program order (a rank that issued group A's collective before group B's while a
// member of both issued them the other way round would deadlock, as with any NCCL program).
//
// NCCL reports a peer that never arrives by never completing: cudaStreamSynchronize would wait
// for ever. synchronize() therefore polls the stream and ncclCommGetAsyncError against a
// deadline, and on expiry aborts the communicator and ends the job with the reason.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <stdexcept>
#include <thread>

#include "k2c/core/check.h"
#include "k2c/dist/runtime.h"
#include "mpi_communicator.h"
#include "nccl_communicator.h"

namespace k2c::dist {
namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::bf16: return ncclBfloat16;
  }
  return ncclFloat32;
}
ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::avg: return ncclAvg;
  }
  return ncclSum;
}

// Element arithmetic per type: bf16 is combined in fp32 and rounded back to nearest even, as
// the MPI backend's host loop and NCCL's own bf16 reductions do.
template <class T>
struct Arith {
  __device__ static T widen(T x) { return x; }
  __device__ static T narrow(T x) { return x; }
};
template <>
struct Arith<__nv_bfloat16> {
  __device__ static float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }
};

// One element per thread over a grid that covers the array (module 00's lesson for streams).
template <class T>
__global__ void reduce_kernel(T* out, const T* a, const T* b, std::size_t n, bool sum) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const auto x = Arith<T>::widen(a[i]), y = Arith<T>::widen(b[i]);
    out[i] = Arith<T>::narrow(sum ? x + y : (x < y ? y : x));
  }
}

template <class T>
void launch_reduce(void* out, const void* a, const void* b, std::size_t n, ReduceOp op, cudaStream_t s) {
  const std::size_t blocks = std::min<std::size_t>((n + 255) / 256, std::size_t{1} << 20);
  reduce_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, s>>>(
      static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, op == ReduceOp::sum);
  K2C_CUDA_CHECK_LAUNCH();
}

}  // namespace

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int device, SharedStream compute)
    : comm_(comm), device_(device), compute_(std::move(compute)) {
  K2C_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
  K2C_NCCL_CHECK(ncclCommCount(comm_, &size_));
  K2C_CUDA_CHECK(cudaSetDevice(device_));
  if (!compute_) {
    cudaStream_t s = nullptr;
    K2C_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    compute_ = SharedStream(s, [](cudaStream_t dead) { cudaStreamDestroy(dead); });
  }
  stream_ = compute_.get();
  // The comm stream gets the highest priority: when a reduction's thousands of blocks are
  // queued, the block scheduler places the transfer kernel's blocks first as SMs free up, so
  // the link is not left idle behind a kernel that could wait.
  int least = 0, greatest = 0;
  K2C_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  K2C_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, greatest));
  K2C_CUDA_CHECK(cudaEventCreateWithFlags(&local_mark_, cudaEventDisableTiming));
  K2C_CUDA_CHECK(cudaEventCreateWithFlags(&comm_mark_, cudaEventDisableTiming));
}

NcclCommunicator::~NcclCommunicator() {
  if (scratch_) free(scratch_);
  if (!aborted_) {
    // Exchanges nobody waited on finish here, before their buffers can go away.
    cudaStreamSynchronize(comm_stream_);
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
  }
  for (auto& [id, e] : open_) cudaEventDestroy(e);
  for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
  cudaEventDestroy(local_mark_);
  cudaEventDestroy(comm_mark_);
  cudaStreamDestroy(comm_stream_);
  // stream_ is not ours alone: compute_ destroys it with the last communicator of the world.
}

void NcclCommunicator::comm_after_local() {
  K2C_CUDA_CHECK(cudaEventRecord(local_mark_, stream_));
  K2C_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, local_mark_, 0));
}
void NcclCommunicator::local_after_comm() {
  K2C_CUDA_CHECK(cudaEventRecord(comm_mark_, comm_stream_));
  K2C_CUDA_CHECK(cudaStreamWaitEvent(stream_, comm_mark_, 0));
}

void NcclCommunicator::synchronize() {
  drain();
  for (auto& [id, e] : open_) spare_events_.push_back(e);
  open_.clear();
}

void NcclCommunicator::drain() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(dist_timeout_s());
  for (;;) {
    // Done when both streams are idle; nothing new is queued while this thread polls.
    const cudaError_t qc = cudaStreamQuery(comm_stream_);
    const cudaError_t ql = cudaStreamQuery(stream_);
    if (qc == cudaSuccess && ql == cudaSuccess) return;
    if (qc != cudaSuccess && qc != cudaErrorNotReady) K2C_CUDA_CHECK(qc);
    if (ql != cudaSuccess && ql != cudaErrorNotReady) K2C_CUDA_CHECK(ql);
    ncclResult_t async = ncclSuccess;
    K2C_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess) {
      ncclCommAbort(comm_);
      aborted_ = true;
      K2C_NCCL_CHECK(async);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(comm_);
      aborted_ = true;
      abort_job("NCCL work did not complete within " +
                std::to_string(static_cast<int>(dist_timeout_s())) + " s (K2C_DIST_TIMEOUT)");
    }
    std::this_thread::yield();
  }
}

void NcclCommunicator::send(const void* buf, std::size_t count, DType t, int peer) {
  local_after_comm();
  K2C_NCCL_CHECK(ncclSend(buf, count, nccl_type(t), peer, comm_, stream_));
}
void NcclCommunicator::recv(void* buf, std::size_t count, DType t, int peer) {
  local_after_comm();
  K2C_NCCL_CHECK(ncclRecv(buf, count, nccl_type(t), peer, comm_, stream_));
}

Ticket NcclCommunicator::start_send_recv(const void* send_buf, std::size_t send_count, int dst, void* recv_buf,
                                         std::size_t recv_count, int src, DType t) {
  // Local work issued so far may have produced send_buf or still read recv_buf: wait for it.
  comm_after_local();
  // One group: both directions progress together, so two ranks exchanging cannot deadlock.
  // Empty blocks (count < ranks) are skipped on both sides alike: block sizes are agreed.
  K2C_NCCL_CHECK(ncclGroupStart());
  if (send_count) K2C_NCCL_CHECK(ncclSend(send_buf, send_count, nccl_type(t), dst, comm_, comm_stream_));
  if (recv_count) K2C_NCCL_CHECK(ncclRecv(recv_buf, recv_count, nccl_type(t), src, comm_, comm_stream_));
  K2C_NCCL_CHECK(ncclGroupEnd());
  return open_ticket();
}

Ticket NcclCommunicator::open_ticket() {
  cudaEvent_t done = nullptr;
  if (spare_events_.empty()) {
    K2C_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  } else {
    done = spare_events_.back();
    spare_events_.pop_back();
  }
  K2C_CUDA_CHECK(cudaEventRecord(done, comm_stream_));
  const Ticket ticket{next_ticket_++};
  open_.emplace(ticket.id, done);
  return ticket;
}

void NcclCommunicator::wait(Ticket ticket) {
  const auto it = open_.find(ticket.id);
  if (it == open_.end()) throw std::logic_error(closed_ticket_message(ticket, next_ticket_));
  // The wait is queued with the event's current record, so the event is free for reuse at once.
  K2C_CUDA_CHECK(cudaStreamWaitEvent(stream_, it->second, 0));
  spare_events_.push_back(it->second);
  open_.erase(it);
}

void* NcclCommunicator::alloc(std::size_t bytes) {
  void* p = nullptr;
  K2C_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}
void NcclCommunicator::free(void* p) {
  // The memory may still be in use by queued work on either stream.
  cudaStreamSynchronize(comm_stream_);
  cudaStreamSynchronize(stream_);
  cudaFree(p);
}
void* NcclCommunicator::scratch(std::size_t bytes) {
  if (bytes > scratch_bytes_) {
    if (scratch_) free(scratch_);  // waits for queued work that may still use it
    scratch_ = alloc(bytes);
    scratch_bytes_ = bytes;
  }
  return scratch_;
}

void NcclCommunicator::copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes) K2C_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}
void NcclCommunicator::reduce_local(void* out, const void* a, const void* b, std::size_t count, DType t,
                                    ReduceOp op) {
  K2C_CHECK(op != ReduceOp::avg, "reduce_local: avg is not an operation on two elements (sum, then scale)");
  if (count == 0) return;
  switch (t) {
    case DType::f32: launch_reduce<float>(out, a, b, count, op, stream_); break;
    case DType::f64: launch_reduce<double>(out, a, b, count, op, stream_); break;
    case DType::i32: launch_reduce<int>(out, a, b, count, op, stream_); break;
    case DType::bf16: launch_reduce<__nv_bfloat16>(out, a, b, count, op, stream_); break;
  }
}

// Started collectives: after the local work so far, on the comm stream, with a ticket. NCCL
// enqueues a collective on a stream; it does not care which, as long as every rank issues the
// communicator's operations in the same order.
Ticket NcclCommunicator::start_all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
  detail::count_library_collective();
  check_reduction(t, op, "all_reduce");
  comm_after_local();
  K2C_NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(t), nccl_op(op), comm_, comm_stream_));
  return open_ticket();
}
Ticket NcclCommunicator::start_reduce_scatter(const void* send, void* recv, std::size_t count, DType t,
                                              ReduceOp op) {
  detail::count_library_collective();
  check_reduction(t, op, "reduce_scatter");
  comm_after_local();
  K2C_NCCL_CHECK(ncclReduceScatter(send, recv, count, nccl_type(t), nccl_op(op), comm_, comm_stream_));
  return open_ticket();
}
Ticket NcclCommunicator::start_all_gather(const void* send, void* recv, std::size_t count, DType t) {
  detail::count_library_collective();
  comm_after_local();
  K2C_NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(t), comm_, comm_stream_));
  return open_ticket();
}
Ticket NcclCommunicator::start_all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                                            const std::vector<std::size_t>& send_offsets, void* recv,
                                            const std::vector<std::size_t>& recv_counts,
                                            const std::vector<std::size_t>& recv_offsets, DType t) {
  detail::count_library_collective();
  const std::size_t n = static_cast<std::size_t>(size_), es = dtype_size(t);
  K2C_CHECK(send_counts.size() == n && send_offsets.size() == n && recv_counts.size() == n &&
                recv_offsets.size() == n,
            "all_to_all_v: counts and offsets need one entry per rank (" << n << ")");
  comm_after_local();
  // One group: every send and receive progresses together, so no pair waits on another. The
  // counts are read here, at enqueue time: the vectors may go as soon as this returns.
  K2C_NCCL_CHECK(ncclGroupStart());
  for (int p = 0; p < size_; ++p) {
    if (send_counts[p])
      K2C_NCCL_CHECK(ncclSend(static_cast<const char*>(send) + send_offsets[p] * es, send_counts[p],
                              nccl_type(t), p, comm_, comm_stream_));
    if (recv_counts[p])
      K2C_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + recv_offsets[p] * es, recv_counts[p],
                              nccl_type(t), p, comm_, comm_stream_));
  }
  K2C_NCCL_CHECK(ncclGroupEnd());
  return open_ticket();
}

void NcclCommunicator::broadcast(void* buf, std::size_t count, DType t, int root) {
  detail::count_library_collective();
  local_after_comm();
  K2C_NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(t), root, comm_, stream_));
}
void NcclCommunicator::reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, int root) {
  detail::count_library_collective();
  check_reduction(t, op, "reduce");
  local_after_comm();
  K2C_NCCL_CHECK(ncclReduce(send, recv, count, nccl_type(t), nccl_op(op), root, comm_, stream_));
}
void NcclCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType t) {
  detail::count_library_collective();
  const std::size_t bytes = count * dtype_size(t);
  local_after_comm();
  K2C_NCCL_CHECK(ncclGroupStart());
  for (int p = 0; p < size_; ++p) {
    K2C_NCCL_CHECK(ncclSend(static_cast<const char*>(send) + p * bytes, count, nccl_type(t), p, comm_, stream_));
    K2C_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + p * bytes, count, nccl_type(t), p, comm_, stream_));
  }
  K2C_NCCL_CHECK(ncclGroupEnd());
}
void NcclCommunicator::barrier() {
  detail::count_library_collective();
  Buffer one(*this, sizeof(int));
  K2C_CUDA_CHECK(cudaMemsetAsync(one.get(), 0, sizeof(int), stream_));
  all_reduce(one.get(), one.get(), 1, DType::i32, ReduceOp::sum);
  drain();  // open tickets stay open: only synchronize() and wait() close them
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  ncclComm_t sub = nullptr;
  K2C_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
  // The split shares the world's compute stream and makes its own comm stream.
  return std::make_unique<NcclCommunicator>(sub, device_, compute_);
}

// Set-up code: ordered after everything, exchanges included, and complete on return.
void NcclCommunicator::to_backend(void* dst, const void* host_src, std::size_t bytes) {
  local_after_comm();
  if (bytes) K2C_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  drain();
}
void NcclCommunicator::to_host(void* host_dst, const void* src, std::size_t bytes) {
  local_after_comm();
  if (bytes) K2C_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  drain();
}

std::unique_ptr<Communicator> make_nccl_world(MPI_Comm world, int local_rank) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off on shared machines
  int devices = 0;
  K2C_CUDA_CHECK(cudaGetDeviceCount(&devices));
  const int device = local_rank % devices;
  K2C_CUDA_CHECK(cudaSetDevice(device));
  int rank = 0, size = 1;
  K2C_MPI_CHECK(MPI_Comm_rank(world, &rank));
  K2C_MPI_CHECK(MPI_Comm_size(world, &size));
  ncclUniqueId id;
  if (rank == 0) K2C_NCCL_CHECK(ncclGetUniqueId(&id));
  K2C_MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, world));
  ncclComm_t comm = nullptr;
  K2C_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
  return std::make_unique<NcclCommunicator>(comm, device);
}

}  // namespace k2c::dist
