// nccl_communicator.h — the NCCL backend's class (private to common/src/dist).
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

// The world's compute stream, shared by the world communicator and all its splits: whichever of
// them is destroyed last destroys the stream (a shared_ptr whose deleter is cudaStreamDestroy),
// so a split may outlive the world and the world may outlive its splits.
using SharedStream = std::shared_ptr<CUstream_st>;

class NcclCommunicator final : public Communicator {
 public:
  // `compute` is the world's compute stream; null makes a new one (the world communicator).
  NcclCommunicator(ncclComm_t comm, int device, SharedStream compute = nullptr);
  ~NcclCommunicator() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::nccl; }
  // The stream of local work, and of everything that is ordered with all calls before it: the
  // world's compute stream.
  cudaStream_t stream() const { return stream_; }
  void* compute_stream() override { return stream_; }

  void send(const void* buf, std::size_t count, DType t, int peer) override;
  void recv(void* buf, std::size_t count, DType t, int peer) override;
  Ticket start_send_recv(const void* send_buf, std::size_t send_count, int dst, void* recv_buf,
                         std::size_t recv_count, int src, DType t) override;
  void wait(Ticket ticket) override;
  Ticket start_all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) override;
  Ticket start_reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) override;
  Ticket start_all_gather(const void* send, void* recv, std::size_t count, DType t) override;
  Ticket start_all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                            const std::vector<std::size_t>& send_offsets, void* recv,
                            const std::vector<std::size_t>& recv_counts,
                            const std::vector<std::size_t>& recv_offsets, DType t) override;
  void* alloc(std::size_t bytes) override;
  void free(void* p) override;
  void* scratch(std::size_t bytes) override;
  void copy(void* dst, const void* src, std::size_t bytes) override;
  void reduce_local(void* out, const void* a, const void* b, std::size_t count, DType t,
                    ReduceOp op) override;
  void synchronize() override;

  // all_reduce, reduce_scatter, all_gather and all_to_all_v: Communicator's start + wait.
  void broadcast(void* buf, std::size_t count, DType t, int root) override;
  void reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, int root) override;
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) override;
  void barrier() override;
  std::unique_ptr<Communicator> split(int color, int key) override;
  void to_backend(void* dst, const void* host_src, std::size_t bytes) override;
  void to_host(void* host_dst, const void* src, std::size_t bytes) override;

 private:
  ncclComm_t comm_;
  int device_;
  int rank_ = 0, size_ = 1;
  void comm_after_local();  // the comm stream waits for the local work issued so far
  void local_after_comm();  // the local stream waits for the exchanges issued so far
  void drain();             // both streams idle, within the deadline; tickets stay open
  // The ticket of what was just queued on the comm stream (after comm_after_local): an event
  // recorded there, from the spares when there is one. Shared by every start_* call.
  Ticket open_ticket();
  SharedStream compute_;        // owns (with the other communicators of the world) stream_
  cudaStream_t stream_{};       // local work: copy, reduce_local, host transfers, send, recv, ...
  cudaStream_t comm_stream_{};  // started exchanges and collectives; this communicator's own
  // One event per direction suffices for the stream-to-stream waits: cudaStreamWaitEvent takes
  // the event's state when it is called, so re-recording it later changes nothing queued.
  cudaEvent_t local_mark_{}, comm_mark_{};
  // Each open ticket holds an event recorded after its exchange; a waited ticket's event goes
  // back to the spares: events are created while more tickets are open than ever before, and
  // reused after that (no allocation per call in steady state).
  std::map<std::uint64_t, cudaEvent_t> open_;
  std::vector<cudaEvent_t> spare_events_;
  std::uint64_t next_ticket_ = 1;
  bool aborted_ = false;
  void* scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
};

// Rank 0 makes the unique id, MPI broadcasts it, every rank joins on its local GPU.
std::unique_ptr<Communicator> make_nccl_world(MPI_Comm world, int local_rank);

}  // namespace k2c::dist
