// mpi_communicator.h — the MPI backend's class (private to common/src/dist).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

double dist_timeout_s();  // K2C_DIST_TIMEOUT, default 120 s
// The message of a wait() on a ticket that is not open: shared by both backends.
std::string closed_ticket_message(Ticket ticket, std::uint64_t next_id);
// Throws std::invalid_argument for a reduction no backend offers (avg of integers), naming the
// collective: both backends check the same way, before anything is issued. (common.cpp)
void check_reduction(DType t, ReduceOp op, const char* what);

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned);
  ~MpiCommunicator() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::mpi; }
  MPI_Comm comm() const { return comm_; }

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
  void* compute_stream() override { return nullptr; }
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
  // A started operation: its requests and what must happen once they complete.
  struct Pending {
    Pending(const char* name, std::size_t request_count)
        : what(name), requests(request_count, MPI_REQUEST_NULL) {}
    const char* what;                   // names the operation when it misses the deadline
    std::vector<MPI_Request> requests;  // completed ones become MPI_REQUEST_NULL
    std::vector<int> arguments;         // counts and displacements MPI_Ialltoallv reads until done
    std::function<void()> finish;       // host work on the result (avg's division); run once
  };
  Ticket open_ticket(Pending p);
  void complete(std::vector<MPI_Request>& reqs, const char* what);
  void complete(Pending& p);     // requests done, then finish (cleared, so it never runs twice)
  void complete_open_tickets();  // completes every open operation; the tickets stay open
  MPI_Comm comm_;
  // Started exchanges and collectives not yet waited on, by ticket id. Completing an entry a
  // second time costs nothing, so free() may complete them and wait() close them later.
  std::map<std::uint64_t, Pending> open_;
  std::uint64_t next_ticket_ = 1;
  bool owned_;
  std::vector<char> scratch_;
  int rank_ = 0, size_ = 1;
};

}  // namespace k2c::dist
