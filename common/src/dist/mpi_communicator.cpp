// mpi_communicator.cpp — the MPI backend: host buffers, every call complete when it returns,
// except the started ones (start_send_recv, start_all_reduce, ...), whose requests are kept
// until wait() (or synchronize()) completes them. A blocking collective is its start + wait.
//
// Every operation is issued non-blocking and completed by polling with a deadline, so a peer
// that never answers ends the job with a message naming the operation rather than a hang.
//
// MPI has no bf16 and no average: bf16 moves as MPI_UINT16_T (2 bytes, never reduced by MPI's
// own ops), bf16 reductions use two operations defined here, and avg is a sum whose result is
// divided by the number of ranks on the host once it has arrived.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <thread>

#include "k2c/core/check.h"
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
    case DType::bf16: return MPI_UINT16_T;
  }
  return MPI_DATATYPE_NULL;
}

// MPI calls these with inout[i] = in[i] op inout[i]. The sum widens both to fp32, adds, and
// rounds once to nearest even: what a GPU does per step of a bf16 reduction. The max picks one
// of the two values, so no rounding is involved.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}
void bf16_max(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    if (!(bf16_to_float(a[i]) < bf16_to_float(b[i]))) b[i] = a[i];
}

MPI_Op make_op(MPI_User_function* f) {
  MPI_Op op = MPI_OP_NULL;
  // Commutative: a + b and b + a round alike, so MPI may combine in any order that suits it
  // (it always assumes associativity, which rounding breaks: results may differ with the
  // algorithm MPI picks, as they do between NCCL's ring and tree).
  K2C_MPI_CHECK(MPI_Op_create(f, 1, &op));
  return op;
}

// The MPI operation for a reduction; avg is a sum here, divided afterwards (finish_avg).
MPI_Op mpi_op(ReduceOp op, DType t) {
  if (t == DType::bf16) {
    // Made once per process on first use, when MPI is up, and never freed: MPI_Finalize releases
    // them with everything else, and a communicator being destroyed cannot know it was the last.
    static const MPI_Op sum = make_op(bf16_sum), max = make_op(bf16_max);
    return op == ReduceOp::max ? max : sum;
  }
  return op == ReduceOp::max ? MPI_MAX : MPI_SUM;
}

// out[i] /= n: the second half of avg. bf16 is widened, divided and rounded again, so an average
// of bf16 values is rounded twice (after the sum, after the division).
void divide_by(void* out_v, std::size_t count, DType t, int n) {
  switch (t) {
    case DType::f32:
      for (std::size_t i = 0; i < count; ++i) static_cast<float*>(out_v)[i] /= static_cast<float>(n);
      break;
    case DType::f64:
      for (std::size_t i = 0; i < count; ++i) static_cast<double*>(out_v)[i] /= n;
      break;
    case DType::bf16: {
      auto* out = static_cast<std::uint16_t*>(out_v);
      for (std::size_t i = 0; i < count; ++i) out[i] = float_to_bf16(bf16_to_float(out[i]) / static_cast<float>(n));
      break;
    }
    case DType::i32: break;  // refused before anything was issued (check_reduction)
  }
}

// What must run on the host once a reduction into `out` (count elements) has arrived.
std::function<void()> finish_avg(ReduceOp op, void* out, std::size_t count, DType t, int n) {
  if (op != ReduceOp::avg || out == nullptr) return nullptr;
  return [=] { divide_by(out, count, t, n); };
}

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

void reduce_into_bf16(void* out_v, const void* a_v, const void* b_v, std::size_t n, ReduceOp op) {
  auto* out = static_cast<std::uint16_t*>(out_v);
  const auto* a = static_cast<const std::uint16_t*>(a_v);
  const auto* b = static_cast<const std::uint16_t*>(b_v);
  for (std::size_t i = 0; i < n; ++i) {
    const float x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    out[i] = op == ReduceOp::sum ? float_to_bf16(x + y) : (x < y ? b[i] : a[i]);
  }
}

// complete()'s wait (see there): polls without pause for kSpin, then naps between polls.
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr int kDefaultNapUs = 100;

// K2C_MPI_NAP_US: a whole number of microseconds up to a second; anything else keeps the default.
int nap_cap_us() {
  const char* s = std::getenv("K2C_MPI_NAP_US");
  if (s == nullptr) return kDefaultNapUs;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  return end != s && *end == '\0' && v >= 0 && v <= 1'000'000 ? static_cast<int>(v) : kDefaultNapUs;
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
  // A rank that polls keeps a core busy. Ranks often outnumber cores (four ranks on a laptop or a
  // CI machine of two), and then the waiting ranks take the cores that the rank they wait for
  // needs to catch up. So after a short spin the wait naps between polls, each nap twice the
  // last up to a cap (K2C_MPI_NAP_US, microseconds, default 100; 0 polls without pause
  // throughout). Module 18's tests at 4 ranks, on two cores that another test shares, took 53 s
  // polling and 22 s napping; with the cores to themselves, a message then waits up to a nap to be
  // noticed, and they took about a tenth longer.
  using clock = std::chrono::steady_clock;
  static const auto max_nap = std::chrono::microseconds(nap_cap_us());
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration<double>(dist_timeout_s());
  auto nap = std::chrono::microseconds(0);
  for (;;) {
    int done = 0;
    K2C_MPI_CHECK(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE));
    if (done) return;
    // A late message could still land in memory that is freed or reused after we give up, so
    // a timeout is not recoverable: the whole job ends, with the reason.
    if (clock::now() > deadline)
      abort_job(std::string(what) + " did not complete within " +
                std::to_string(static_cast<int>(dist_timeout_s())) + " s (K2C_DIST_TIMEOUT)");
    if (max_nap.count() == 0 || clock::now() - start < kSpin) {
      std::this_thread::yield();
    } else {
      nap = std::min(max_nap, std::max(std::chrono::microseconds(1), 2 * nap));
      std::this_thread::sleep_for(nap);
    }
  }
}

void MpiCommunicator::complete(Pending& p) {
  complete(p.requests, p.what);
  // Run at the first completion, wherever it happens (wait, synchronize, free, a growing
  // scratch): free() completes operations before releasing memory that may be their result,
  // so the result must be final by then, not at a later wait on a buffer already gone.
  if (p.finish) {
    const std::function<void()> finish = std::move(p.finish);
    p.finish = nullptr;
    finish();
  }
}

Ticket MpiCommunicator::open_ticket(Pending p) {
  const Ticket ticket{next_ticket_++};
  open_.emplace(ticket.id, std::move(p));
  return ticket;
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
  Pending p("send_recv", 2);
  K2C_MPI_CHECK(MPI_Irecv(recv_buf, mpi_count(recv_count, "send_recv"), mpi_type(t), src, 0, comm_, &p.requests[0]));
  K2C_MPI_CHECK(MPI_Isend(send_buf, mpi_count(send_count, "send_recv"), mpi_type(t), dst, 0, comm_, &p.requests[1]));
  return open_ticket(std::move(p));
}

void MpiCommunicator::wait(Ticket ticket) {
  const auto it = open_.find(ticket.id);
  if (it == open_.end()) throw std::logic_error(closed_ticket_message(ticket, next_ticket_));
  Pending p = std::move(it->second);
  open_.erase(it);
  complete(p);
}

void MpiCommunicator::complete_open_tickets() {
  for (auto& [id, p] : open_) complete(p);
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
  K2C_CHECK(op != ReduceOp::avg, "reduce_local: avg is not an operation on two elements (sum, then scale)");
  switch (t) {
    case DType::f32: reduce_into<float>(out, a, b, count, op); break;
    case DType::f64: reduce_into<double>(out, a, b, count, op); break;
    case DType::i32: reduce_into<int>(out, a, b, count, op); break;
    case DType::bf16: reduce_into_bf16(out, a, b, count, op); break;
  }
}

// ------------------------------------------------------------------- started collectives -----
// MPI matches the collectives of a communicator by the order they are called in, blocking and
// non-blocking alike: every rank must start them in the same order (the interface's rule), and
// they may complete in any order after that.

Ticket MpiCommunicator::start_all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
  detail::count_library_collective();
  check_reduction(t, op, "all_reduce");
  Pending p("all_reduce", 1);
  K2C_MPI_CHECK(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, mpi_count(count, "all_reduce"),
                               mpi_type(t), mpi_op(op, t), comm_, &p.requests[0]));
  p.finish = finish_avg(op, recv, count, t, size_);
  return open_ticket(std::move(p));
}

Ticket MpiCommunicator::start_reduce_scatter(const void* send, void* recv, std::size_t count, DType t,
                                             ReduceOp op) {
  detail::count_library_collective();
  check_reduction(t, op, "reduce_scatter");
  Pending p("reduce_scatter", 1);
  K2C_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, mpi_count(count, "reduce_scatter"), mpi_type(t),
                                          mpi_op(op, t), comm_, &p.requests[0]));
  p.finish = finish_avg(op, recv, count, t, size_);
  return open_ticket(std::move(p));
}

Ticket MpiCommunicator::start_all_gather(const void* send, void* recv, std::size_t count, DType t) {
  detail::count_library_collective();
  Pending p("all_gather", 1);
  const int n = mpi_count(count, "all_gather");
  K2C_MPI_CHECK(MPI_Iallgather(send, n, mpi_type(t), recv, n, mpi_type(t), comm_, &p.requests[0]));
  return open_ticket(std::move(p));
}

Ticket MpiCommunicator::start_all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                                           const std::vector<std::size_t>& send_offsets, void* recv,
                                           const std::vector<std::size_t>& recv_counts,
                                           const std::vector<std::size_t>& recv_offsets, DType t) {
  detail::count_library_collective();
  const std::size_t n = static_cast<std::size_t>(size_);
  K2C_CHECK(send_counts.size() == n && send_offsets.size() == n && recv_counts.size() == n &&
                recv_offsets.size() == n,
            "all_to_all_v: counts and offsets need one entry per rank (" << n << ")");
  // MPI reads the count and displacement arrays until the operation completes, so they live in
  // the pending entry (one vector: sc, so, rc, ro), not on this function's stack.
  Pending p("all_to_all_v", 1);
  p.arguments.resize(4 * n);
  int* sc = p.arguments.data();
  int* so = sc + n;
  int* rc = so + n;
  int* ro = rc + n;
  for (std::size_t i = 0; i < n; ++i) {
    sc[i] = mpi_count(send_counts[i], "all_to_all_v");
    so[i] = mpi_count(send_offsets[i], "all_to_all_v");
    rc[i] = mpi_count(recv_counts[i], "all_to_all_v");
    ro[i] = mpi_count(recv_offsets[i], "all_to_all_v");
  }
  K2C_MPI_CHECK(MPI_Ialltoallv(send, sc, so, mpi_type(t), recv, rc, ro, mpi_type(t), comm_, &p.requests[0]));
  // Moving the entry into the map moves the vector's storage, not the ints: the pointers hold.
  return open_ticket(std::move(p));
}

// ----------------------------------------------------------------- blocking collectives -----

void MpiCommunicator::broadcast(void* buf, std::size_t count, DType t, int root) {
  detail::count_library_collective();
  std::vector<MPI_Request> r(1);
  K2C_MPI_CHECK(MPI_Ibcast(buf, mpi_count(count, "broadcast"), mpi_type(t), root, comm_, &r[0]));
  complete(r, "broadcast");
}

void MpiCommunicator::reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, int root) {
  detail::count_library_collective();
  check_reduction(t, op, "reduce");
  std::vector<MPI_Request> r(1);
  const bool in_place = rank_ == root && send == recv;
  K2C_MPI_CHECK(MPI_Ireduce(in_place ? MPI_IN_PLACE : send, recv, mpi_count(count, "reduce"), mpi_type(t),
                            mpi_op(op, t), root, comm_, &r[0]));
  complete(r, "reduce");
  if (rank_ == root && op == ReduceOp::avg) divide_by(recv, count, t, size_);
}

void MpiCommunicator::all_to_all(const void* send, void* recv, std::size_t count, DType t) {
  detail::count_library_collective();
  std::vector<MPI_Request> r(1);
  const int n = mpi_count(count, "all_to_all");
  K2C_MPI_CHECK(MPI_Ialltoall(send, n, mpi_type(t), recv, n, mpi_type(t), comm_, &r[0]));
  complete(r, "all_to_all");
}

void MpiCommunicator::barrier() {
  detail::count_library_collective();
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
