// k2c/dist/communicator.h — one communication interface, two backends.
//
// Ranks are processes started by mpirun. A Communicator connects a group of them and offers the
// collectives of torch.distributed / NCCL on one of two backends chosen at run time:
//   Backend::nccl  buffers are device pointers; work is queued on two streams, the world's
//                  compute stream for local work and the communicator's own for exchanges
//                  (see PointToPoint and compute_stream())
//   Backend::mpi   buffers are host pointers; calls complete before they return, except a
//                  started exchange or collective, which completes in wait()
// so the same algorithm runs on CPU ranks (a laptop, CI) and on GPUs. Buffers always come from
// the communicator's own alloc(), which knows which kind of memory its backend needs.
//
// PointToPoint is the part of the interface that hand-written collectives (module 11) may use:
// send / recv, the deadlock-free exchange of a ring step (blocking, or started now and waited
// for later), and local element-wise work. Communicator adds the library collectives, four of
// which can also be started now and waited for later (the gradient all-reduce of DDP running
// under the backward pass), sub-communicators, and the world's compute stream.
//
// Every call that waits on other ranks waits at most K2C_DIST_TIMEOUT seconds (default 120) and
// then ends the whole job with a message naming the operation, instead of hanging: a message
// that arrives after we gave up could land in freed memory, so there is nothing to recover.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/core/bf16.h"  // bf16_to_float, float_to_bf16: bf16 collectives on MPI

namespace k2c::dist {

// The host bf16 conversions of k2c/core/bf16.h, also under this namespace's name.
using k2c::bf16_to_float;
using k2c::float_to_bf16;

enum class Backend { mpi, nccl };
// bf16 is bfloat16 (fp32's sign and 8-bit exponent, 7 mantissa bits), held as 2 bytes; on the
// host it is std::uint16_t and the two functions below convert it.
enum class DType { f32, f64, i32, bf16 };
// avg is sum divided by the number of ranks, for the floating-point types only (an integer
// average would have to round, and every backend would round differently): reductions of i32
// with avg throw std::invalid_argument. It is a property of the collective as a whole, not of
// two elements, so reduce_local refuses it too.
enum class ReduceOp { sum, max, avg };

// Inline (like block_of below) so that a student library using them links nothing else.
inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
  }
  return 4;
}
std::string to_string(Backend b);
std::string to_string(DType t);
std::string to_string(ReduceOp op);

// Block b of n when `count` elements are split as evenly as possible: the first count % n blocks
// hold one element more. Used wherever a buffer is cut into one piece per rank.
struct Block {
  std::size_t offset, size;
};
inline Block block_of(std::size_t count, int n, int b) {
  const std::size_t base = count / n, extra = count % n, ub = static_cast<std::size_t>(b);
  return {ub * base + (ub < extra ? ub : extra), base + (ub < extra ? 1 : 0)};
}

// The handle of an exchange started by start_send_recv, or of a collective started by one of
// Communicator's start_* calls. A plain value: copy it freely, but wait() on it once. Ids count
// up from 1 per communicator; 0 is never issued.
struct Ticket {
  std::uint64_t id = 0;
};

class PointToPoint {
 public:
  virtual ~PointToPoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;

  // Sends `count` elements to `peer` / receives them from `peer`. A send must meet a recv of the
  // same count and type on the peer. Two ranks that both send first may deadlock (large
  // messages are not buffered): use send_recv for exchanges. Like the library collectives,
  // send and recv are ordered after everything issued before them, exchanges included.
  virtual void send(const void* buf, std::size_t count, DType t, int peer) = 0;
  virtual void recv(void* buf, std::size_t count, DType t, int peer) = 0;

  // One step of a ring: send to `dst` and receive from `src` at the same time, in two halves.
  //
  // start_send_recv starts the exchange and returns a ticket at once. The exchange is ordered
  // after all local work issued before it (it sends what that work wrote, and receives into
  // memory that work no longer reads) and after every exchange already waited on. Local work
  // issued later, and other exchanges started later, may run alongside it: that is the point,
  // the reduction of one chunk overlapping the transfer of the next. So until wait(ticket),
  // leave its buffers alone, as with MPI_Isend / MPI_Irecv: no local work that reads recv_buf
  // or writes either buffer, and no other exchange that sends from recv_buf or receives into
  // either buffer (to forward what an exchange received, wait on it first).
  //
  // wait(ticket) orders all calls issued after it after the exchange: they may read the
  // received data and overwrite the sent buffer. On MPI it returns when the exchange is
  // complete; on NCCL it only queues the dependency (no host wait). Wait on each ticket exactly
  // once: a second wait, or a ticket this communicator never issued, throws std::logic_error.
  // synchronize() completes the exchanges nobody waited on and closes their tickets.
  // Every rank must start the same exchanges in the same order, as with send_recv.
  virtual Ticket start_send_recv(const void* send_buf, std::size_t send_count, int dst, void* recv_buf,
                                 std::size_t recv_count, int src, DType t) = 0;
  virtual void wait(Ticket ticket) = 0;
  // The blocking exchange: start, then wait.
  void send_recv(const void* send_buf, std::size_t send_count, int dst, void* recv_buf,
                 std::size_t recv_count, int src, DType t) {
    wait(start_send_recv(send_buf, send_count, dst, recv_buf, recv_count, src, t));
  }

  // Local work on this backend's memory (device kernels for NCCL, host loops for MPI), ordered
  // among itself and after the communication calls as the rules above say. On NCCL, local work
  // and exchanges run on two streams; the library collectives, send, recv, barrier and split
  // are ordered after everything issued before them, and everything issued after them waits
  // for them.
  virtual void* alloc(std::size_t bytes) = 0;
  // Waits for every exchange still in flight first (it may use the memory); tickets stay open.
  virtual void free(void* p) = 0;
  // A work buffer owned by the communicator, at least `bytes` long, reused from call to call
  // (grown when too small, never shrunk): an algorithm that needs temporary space every call
  // takes it from here instead of paying for an allocation each time (cudaMalloc of hundreds
  // of MiB costs as much as moving them). Valid until the next scratch() call; contents undefined.
  // Growing it frees the old buffer, so it waits as free() does.
  virtual void* scratch(std::size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  // out[i] = op(a[i], b[i]) for i < count; out may be a or b. bf16 is widened to fp32, combined
  // and rounded to nearest even. avg is refused (std::invalid_argument): it is not a function
  // of two elements.
  virtual void reduce_local(void* out, const void* a, const void* b, std::size_t count, DType t,
                            ReduceOp op) = 0;
  // Waits until every call issued so far has completed, on both streams for NCCL (with the
  // K2C_DIST_TIMEOUT deadline), and closes every ticket not yet waited on. On NCCL the local
  // stream is the world's compute stream, so this also waits for work other communicators of
  // the world queued there.
  virtual void synchronize() = 0;
};

class Communicator : public PointToPoint {
 public:
  // Library collectives. Counts are elements. reduce_scatter: every rank gives count·size()
  // elements and receives block rank() of `count`; all_gather: every rank gives `count` and
  // receives count·size(), rank r's part at offset r·count. Every rank calls each collective
  // with the same count, type and op (and root); send may equal recv (in place) for all_reduce.
  // The four that also come started (below) are, by default, exactly start + wait, so both
  // backends share one definition of them; a communicator that counts calls overrides them.
  virtual void all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
    wait(start_all_reduce(send, recv, count, t, op));
  }
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
    wait(start_reduce_scatter(send, recv, count, t, op));
  }
  virtual void all_gather(const void* send, void* recv, std::size_t count, DType t) {
    wait(start_all_gather(send, recv, count, t));
  }
  virtual void broadcast(void* buf, std::size_t count, DType t, int root) = 0;
  virtual void reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, int root) = 0;
  // all_to_all: `count` elements to and from every rank, ordered by rank. all_to_all_v: per-peer
  // counts and offsets (elements) on both sides; every rank must know what it will receive.
  virtual void all_to_all(const void* send, void* recv, std::size_t count, DType t) = 0;
  virtual void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                            const std::vector<std::size_t>& send_offsets, void* recv,
                            const std::vector<std::size_t>& recv_counts,
                            const std::vector<std::size_t>& recv_offsets, DType t) {
    wait(start_all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, t));
  }

  // The same four collectives, started now and completed by wait(ticket), under the rules of
  // start_send_recv: the collective is ordered after the local work issued before it and after
  // everything already waited on; until its wait, leave its buffers alone (no local work or
  // other operation that writes the send buffer or touches the receive buffer); wait on each
  // ticket once; synchronize() completes and closes the ones nobody waited on. Every rank must
  // start the same collectives on a communicator in the same order, counting the blocking ones
  // too (MPI matches collectives by order, and NCCL runs them in issue order on every rank).
  // The counts and offsets of all_to_all_v are copied: the vectors may go before the wait.
  // The blocking form of each is exactly start + wait.
  virtual Ticket start_all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) = 0;
  virtual Ticket start_reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) = 0;
  virtual Ticket start_all_gather(const void* send, void* recv, std::size_t count, DType t) = 0;
  virtual Ticket start_all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                                    const std::vector<std::size_t>& send_offsets, void* recv,
                                    const std::vector<std::size_t>& recv_counts,
                                    const std::vector<std::size_t>& recv_offsets, DType t) = 0;

  virtual void barrier() = 0;
  // Ranks with the same color form a new communicator, ordered by key (then by rank). A split
  // shares its parent's compute stream (below) and may outlive the parent.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // The stream of local work as a cudaStream_t (nullptr on MPI), one per world: every split()
  // of a world, and every split of those, queues its local work on it and makes it wait for each
  // blocking operation, so work in a tensor-parallel group, in a data-parallel group and the
  // model's own kernels launched here run in the order they were issued, with no synchronize()
  // between them. Started exchanges and collectives run on a stream of their communicator's own
  // until their wait. void*, so a library can take it without including CUDA's headers.
  virtual void* compute_stream() = 0;

  // Host <-> backend memory, for tests and set-up code.
  virtual void to_backend(void* dst, const void* host_src, std::size_t bytes) = 0;
  virtual void to_host(void* host_dst, const void* src, std::size_t bytes) = 0;
};

// How many collectives the communication library has been asked for in this process: both
// backends count every one they start (blocking or not, barriers included) on any communicator.
// A hand-written collective must start none: module 11's tests and the grader's checks of them
// read this count before and after each call.
std::uint64_t library_collectives();
namespace detail {
void count_library_collective();  // called by the backends, once per collective they start
}

// A PointToPoint that forwards to a Communicator and exposes nothing else: what hand-written
// collectives receive. The Communicator itself is one pointer away for code that goes looking
// (it holds a reference), so this is not where the library collectives are kept from them:
// library_collectives() is how a test sees that one was used.
class PointToPointView final : public PointToPoint {
 public:
  explicit PointToPointView(Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  Backend backend() const override { return c_.backend(); }
  void send(const void* buf, std::size_t count, DType t, int peer) override { c_.send(buf, count, t, peer); }
  void recv(void* buf, std::size_t count, DType t, int peer) override { c_.recv(buf, count, t, peer); }
  Ticket start_send_recv(const void* sb, std::size_t sc, int dst, void* rb, std::size_t rc, int src,
                         DType t) override {
    return c_.start_send_recv(sb, sc, dst, rb, rc, src, t);
  }
  void wait(Ticket ticket) override { c_.wait(ticket); }
  void* alloc(std::size_t bytes) override { return c_.alloc(bytes); }
  void free(void* p) override { c_.free(p); }
  void* scratch(std::size_t bytes) override { return c_.scratch(bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) override { c_.copy(dst, src, bytes); }
  void reduce_local(void* out, const void* a, const void* b, std::size_t count, DType t, ReduceOp op) override {
    c_.reduce_local(out, a, b, count, t, op);
  }
  void synchronize() override { c_.synchronize(); }

 private:
  Communicator& c_;
};

// A buffer in a communicator's memory, freed with it.
class Buffer {
 public:
  Buffer(PointToPoint& c, std::size_t bytes) : c_(&c), p_(bytes ? c.alloc(bytes) : nullptr), bytes_(bytes) {}
  ~Buffer() {
    if (p_) c_->free(p_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return p_; }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }
  std::size_t bytes() const { return bytes_; }

 private:
  PointToPoint* c_;
  void* p_;
  std::size_t bytes_;
};

}  // namespace k2c::dist
