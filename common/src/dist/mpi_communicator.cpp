// mpi_communicator.cpp — the MPI backend: host buffers, every call complete when it returns,
// except start_send_recv, whose requests are kept until wait() (or synchronize()) completes them.
//
// Every operation is issued non-blocking and completed by polling with a deadline, so a peer
// that never answers ends the job with a message naming the operation rather than a hang.
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <thread>

#include "k2c/check.h"
#include "k2c/dist/communicator.h"
#include "k2c/dist/runtime.h"
#include "mpi_communicator.h"

namespace k2c::dist {
namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::sum ? MPI_SUM : MPI_MAX; }

int mpi_count(std::size_t count, const char* what) {
  K2C_CHECK(count <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
            what << ": " << count << " elements exceed MPI's int count");
  return static_cast<int>(count);
}

template <class T>
void reduce_into(void* out_v, const void* a_v, const void* b_v, std::size_t n, ReduceOp op) {
  T* out = static_cast<T*>(out_v);
  const T* a = static_cast<const T*>(a_v);
  const T* b = static_cast<const T*>(b_v);
  if (op == ReduceOp::sum)
    for (std::size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  else
    for (std::size_t i = 0; i < n; ++i) out[i] = a[i] < b[i] ? b[i] : a[i];
}

}  // namespace

double dist_timeout_s() {
  const char* s = std::getenv("K2C_DIST_TIMEOUT");
  const double v = s ? std::atof(s) : 0;
  return v > 0 ? v : 120.0;
}

std::string closed_ticket_message(Ticket ticket, std::uint64_t next_id) {
  if (ticket.id == 0 || ticket.id >= next_id)
    return "wait: ticket " + std::to_string(ticket.id) + " was never issued by this communicator";
  return "wait: ticket " + std::to_string(ticket.id) +
         " is no longer open: it was waited on before, or synchronize() closed it";
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
  K2C_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  K2C_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::~MpiCommunicator() {
  // An exchange nobody waited on still writes into its receive buffer: finish it before the
  // communicator (and, soon after, the buffers) go away. A destructor cannot throw, so an MPI
  // error here ends the job with its message rather than vanishing.
  try {
    synchronize();
  } catch (const std::exception& e) {
    abort_job(std::string("closing a communicator with open exchanges: ") + e.what());
  }
  if (owned_) MPI_Comm_free(&comm_);
}

void MpiCommunicator::complete(std::vector<MPI_Request>& reqs, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(dist_timeout_s());
  for (;;) {
    int done = 0;
    K2C_MPI_CHECK(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE));
    if (done) return;
    // A late message could still land in memory that is freed or reused after we give up, so
    // a timeout is not recoverable: the whole job ends, with the reason.
    if (std::chrono::steady_clock::now() > deadline)
      abort_job(std::string(what) + " did not complete within " +
                std::to_string(static_cast<int>(dist_timeout_s())) + " s (K2C_DIST_TIMEOUT)");
    std::this_thread::yield();
  }
}

void MpiCommunicator::send(const void* buf, std::size_t count, DType t, int peer) {
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Isend(buf, mpi_count(count, "send"), mpi_type(t), peer, 0, comm_, &r[0]));
  complete(r, "send");
}

void MpiCommunicator::recv(void* buf, std::size_t count, DType t, int peer) {
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Irecv(buf, mpi_count(count, "recv"), mpi_type(t), peer, 0, comm_, &r[0]));
  complete(r, "recv");
}

// Several exchanges may be open at once between the same pair of ranks with the same tag: MPI
// matches messages between two ranks in the order they were posted, so exchange k on one side
// meets exchange k on the other as long as every rank starts them in the same order.
Ticket MpiCommunicator::start_send_recv(const void* send_buf, std::size_t send_count, int dst, void* recv_buf,
                                        std::size_t recv_count, int src, DType t) {
  std::vector<MPI_Request> r(2, MPI_REQUEST_NULL);
  K2C_MPI_CHECK(MPI_Irecv(recv_buf, mpi_count(recv_count, "send_recv"), mpi_type(t), src, 0, comm_, &r[0]));
  K2C_MPI_CHECK(MPI_Isend(send_buf, mpi_count(send_count, "send_recv"), mpi_type(t), dst, 0, comm_, &r[1]));
  const Ticket ticket{next_ticket_++};
  open_.emplace(ticket.id, std::move(r));
  return ticket;
}

void MpiCommunicator::wait(Ticket ticket) {
  const auto it = open_.find(ticket.id);
  if (it == open_.end()) throw std::logic_error(closed_ticket_message(ticket, next_ticket_));
  std::vector<MPI_Request> r = std::move(it->second);
  open_.erase(it);
  complete(r, "send_recv");
}

void MpiCommunicator::complete_open_tickets() {
  for (auto& [id, r] : open_) complete(r, "send_recv");
}

void MpiCommunicator::synchronize() {
  complete_open_tickets();
  open_.clear();
}

void* MpiCommunicator::alloc(std::size_t bytes) {
  void* p = std::malloc(bytes ? bytes : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
// An open exchange may still receive into, or send from, the memory being released.
void MpiCommunicator::free(void* p) {
  complete_open_tickets();
  std::free(p);
}
void* MpiCommunicator::scratch(std::size_t bytes) {
  if (scratch_.size() < bytes) {
    complete_open_tickets();  // resizing moves the buffer
    scratch_.resize(bytes);
  }
  return scratch_.data();
}
void MpiCommunicator::copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
}

void MpiCommunicator::reduce_local(void* out, const void* a, const void* b, std::size_t count, DType t,
                                   ReduceOp op) {
  switch (t) {
    case DType::f32: reduce_into<float>(out, a, b, count, op); break;
    case DType::f64: reduce_into<double>(out, a, b, count, op); break;
    case DType::i32: reduce_into<int>(out, a, b, count, op); break;
  }
}

void MpiCommunicator::all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, mpi_count(count, "all_reduce"),
                               mpi_type(t), mpi_op(op), comm_, &r[0]));
  complete(r, "all_reduce");
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, mpi_count(count, "reduce_scatter"), mpi_type(t),
                                          mpi_op(op), comm_, &r[0]));
  complete(r, "reduce_scatter");
}

void MpiCommunicator::all_gather(const void* send, void* recv, std::size_t count, DType t) {
  std::vector<MPI_Request> r(1);
  const int n = mpi_count(count, "all_gather");
  K2C_MPI_CHECK(MPI_Iallgather(send, n, mpi_type(t), recv, n, mpi_type(t), comm_, &r[0]));
  complete(r, "all_gather");
}

void MpiCommunicator::broadcast(void* buf, std::size_t count, DType t, int root) {
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Ibcast(buf, mpi_count(count, "broadcast"), mpi_type(t), root, comm_, &r[0]));
  complete(r, "broadcast");
}

void MpiCommunicator::reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, int root) {
  std::vector<MPI_Request> r(1);
  const bool in_place = rank_ == root && send == recv;
  K2C_MPI_CHECK(MPI_Ireduce(in_place ? MPI_IN_PLACE : send, recv, mpi_count(count, "reduce"), mpi_type(t),
                            mpi_op(op), root, comm_, &r[0]));
  complete(r, "reduce");
}

void MpiCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType t) {
  std::vector<MPI_Request> r(1);
  const int n = mpi_count(count, "all_to_all");
  K2C_MPI_CHECK(MPI_Ialltoall(send, n, mpi_type(t), recv, n, mpi_type(t), comm_, &r[0]));
  complete(r, "all_to_all");
}

void MpiCommunicator::all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                                   const std::vector<std::size_t>& send_offsets, void* recv,
                                   const std::vector<std::size_t>& recv_counts,
                                   const std::vector<std::size_t>& recv_offsets, DType t) {
  const std::size_t n = static_cast<std::size_t>(size_);
  K2C_CHECK(send_counts.size() == n && send_offsets.size() == n && recv_counts.size() == n &&
                recv_offsets.size() == n,
            "all_to_all_v: counts and offsets need one entry per rank (" << n << ")");
  std::vector<int> sc(n), so(n), rc(n), ro(n);
  for (std::size_t i = 0; i < n; ++i) {
    sc[i] = mpi_count(send_counts[i], "all_to_all_v");
    so[i] = mpi_count(send_offsets[i], "all_to_all_v");
    rc[i] = mpi_count(recv_counts[i], "all_to_all_v");
    ro[i] = mpi_count(recv_offsets[i], "all_to_all_v");
  }
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Ialltoallv(send, sc.data(), so.data(), mpi_type(t), recv, rc.data(), ro.data(),
                               mpi_type(t), comm_, &r[0]));
  complete(r, "all_to_all_v");
}

void MpiCommunicator::barrier() {
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Ibarrier(comm_, &r[0]));
  complete(r, "barrier");
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  MPI_Comm sub;
  K2C_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
  return std::make_unique<MpiCommunicator>(sub, true);
}

void MpiCommunicator::to_backend(void* dst, const void* host_src, std::size_t bytes) { copy(dst, host_src, bytes); }
void MpiCommunicator::to_host(void* host_dst, const void* src, std::size_t bytes) { copy(host_dst, src, bytes); }

}  // namespace k2c::dist
