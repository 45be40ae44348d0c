// k2c/dist/counting.h — CountingCommunicator: a Communicator that counts the calls and bytes of
// the communication going through it, so a test can hold an algorithm's traffic against the
// lectures' formulas (tensor parallelism's two all-reduces per block, an all-to-all's tokens·d).
//
//   CountingCommunicator world(testing::world(), "world");
//   ProcessGrid grid(world, {.dp = 2, .tp = 2});   // groups count as "dp", "tp", "dp+cp", ...
//   run_step(grid);
//   EXPECT_EQ(world.count("tp", "all_reduce").calls, 4 * layers);
//
// It wraps any backend and forwards every call unchanged, recording each communication call in
// a ledger under (label, operation). A split() of a counting communicator is a counting one too
// that records into the same ledger under its own label, so the traffic of every group of a
// grid ends up in one place. Each rank keeps its own ledger (what this rank did); nothing is
// exchanged to keep it.
//
// Code that makes its groups with plain split() (a student's grid) gets labels "world/split",
// "world/split/split", which do not say which group is which. name_groups(f) fixes that: from
// then on a plain split() asks its new group's members for their world ranks (one all_gather of
// an int over the new group, not counted) and labels the group f(those ranks, ascending).
//
// Bytes are the S of lecture 11's table (the size a collective is quoted at, which its bus-
// bandwidth factor turns into per-rank traffic), on the calling rank; es = dtype_size(t) and
// n = size() of the communicator called:
//   all_reduce      count·es          the buffer
//   reduce_scatter  count·n·es        the full input (count is each rank's block)
//   all_gather      count·n·es        the full output (count is each rank's block)
//   broadcast       count·es          the buffer
//   reduce          count·es          the buffer
//   all_to_all      count·n·es        one rank's buffer
//   all_to_all_v    Σ send_counts·es  all this rank sends, the block to itself included
//   send, recv      count·es          the message
//   send_recv       send_count·es     what this rank sends (it receives its peer's send)
//   barrier         0
// A started collective (start_all_reduce, ...) is counted under its collective's name, and also
// in `started`: calls - started were blocking. send_recv always counts as started, because the
// blocking send_recv is start_send_recv + wait. Not counted: local work (alloc, copy,
// reduce_local, ...), wait, synchronize, split and host transfers (wait and synchronize have a
// count of their own, waits()).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

struct Traffic {
  std::uint64_t calls = 0;    // every call, blocking or started
  std::uint64_t started = 0;  // of which through start_* (see above)
  std::uint64_t bytes = 0;    // as defined above, summed over the calls
};
// label -> operation -> traffic.
using TrafficTable = std::map<std::string, std::map<std::string, Traffic>>;
// A group's label from its members' world ranks (ascending).
using GroupNamer = std::function<std::string(const std::vector<int>& world_ranks)>;

class CountingCommunicator final : public Communicator {
 public:
  // Counts what goes through `inner`, under `label`, in a new ledger. `inner` must outlive this.
  CountingCommunicator(Communicator& inner, std::string label);
  // The same, owning `inner`.
  CountingCommunicator(std::unique_ptr<Communicator> inner, std::string label);

  // A split that counts into this communicator's ledger under `label` (a collective call, as
  // split() is). split(color, key) labels it "<this label>/split", or by name_groups' namer.
  std::unique_ptr<CountingCommunicator> split(int color, int key, std::string label);
  std::unique_ptr<Communicator> split(int color, int key) override;
  // Call on the world (before any split) on every rank alike: plain splits of it and of its
  // splits are then labelled namer(members), see the top. The world's own label stays.
  void name_groups(GroupNamer namer);

  const std::string& label() const { return label_; }

  // The ledger shared with every split of the communicator it came from.
  const TrafficTable& counts() const { return *ledger_; }
  Traffic count(const std::string& label, const std::string& op) const;  // zeros if never called
  Traffic total(const std::string& op) const;                            // summed over labels
  // Calls of every (label, operation) not in `allowed`: what a test holds to zero when an
  // algorithm may communicate only through the allowed ones.
  std::uint64_t calls_except(const std::set<std::pair<std::string, std::string>>& allowed) const;
  // One line per (label, operation), ordered by both: "rank 0  tp  all_reduce  calls 4 ..."
  std::string report() const;
  void reset();  // empties the whole shared ledger, waits included
  // Waits since the ledger was made or reset, on this communicator and every split sharing its
  // ledger: calls of wait() and synchronize(), and of free() or a growing scratch() while
  // exchanges were open (they may complete them). What a test of overlap holds to zero while the
  // work that should run under the communication goes on (a collective started and waited for at
  // once overlaps nothing).
  std::uint64_t waits() const { return waits_->calls; }
  // The bytes (as counted above) of the started operations those waits completed: how far a
  // pipeline of started exchanges has been drained.
  std::uint64_t waited_bytes() const { return waits_->bytes; }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Backend backend() const override { return inner_.backend(); }

  void send(const void* buf, std::size_t count, DType t, int peer) override;
  void recv(void* buf, std::size_t count, DType t, int peer) override;
  Ticket start_send_recv(const void* send_buf, std::size_t send_count, int dst, void* recv_buf,
                         std::size_t recv_count, int src, DType t) override;
  void wait(Ticket ticket) override;
  void* alloc(std::size_t bytes) override { return inner_.alloc(bytes); }
  // Freeing, or a scratch buffer larger than any before, may complete every open exchange first
  // (the MPI backend does): counted as a wait for all of them, as synchronize() is.
  void free(void* p) override;
  void* scratch(std::size_t bytes) override;
  void copy(void* dst, const void* src, std::size_t bytes) override { inner_.copy(dst, src, bytes); }
  void reduce_local(void* out, const void* a, const void* b, std::size_t count, DType t,
                    ReduceOp op) override {
    inner_.reduce_local(out, a, b, count, t, op);
  }
  void synchronize() override;

  void all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) override;
  void all_gather(const void* send, void* recv, std::size_t count, DType t) override;
  void broadcast(void* buf, std::size_t count, DType t, int root) override;
  void reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, int root) override;
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) override;
  void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                    const std::vector<std::size_t>& send_offsets, void* recv,
                    const std::vector<std::size_t>& recv_counts,
                    const std::vector<std::size_t>& recv_offsets, DType t) override;
  Ticket start_all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) override;
  Ticket start_reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) override;
  Ticket start_all_gather(const void* send, void* recv, std::size_t count, DType t) override;
  Ticket start_all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                            const std::vector<std::size_t>& send_offsets, void* recv,
                            const std::vector<std::size_t>& recv_counts,
                            const std::vector<std::size_t>& recv_offsets, DType t) override;
  void barrier() override;
  void* compute_stream() override { return inner_.compute_stream(); }
  void to_backend(void* dst, const void* host_src, std::size_t bytes) override {
    inner_.to_backend(dst, host_src, bytes);
  }
  void to_host(void* host_dst, const void* src, std::size_t bytes) override { inner_.to_host(host_dst, src, bytes); }

 private:
  struct Waits {
    std::uint64_t calls = 0, bytes = 0;
  };
  CountingCommunicator(std::unique_ptr<Communicator> inner, std::string label, std::shared_ptr<TrafficTable> ledger,
                       std::shared_ptr<Waits> waits, std::shared_ptr<GroupNamer> namer, int world_rank);
  void record(const char* op, std::uint64_t bytes, bool started);
  Ticket remember(Ticket ticket, std::uint64_t bytes);  // a started operation's bytes, for wait()
  void drained();  // a call that may complete every open exchange: one wait for all of them
  std::unique_ptr<Communicator> owned_;  // set when this wraps a split (or was given ownership)
  Communicator& inner_;
  std::string label_;
  std::shared_ptr<TrafficTable> ledger_;
  std::shared_ptr<GroupNamer> namer_;  // shared with every split; empty: "<label>/split"
  int world_rank_;                     // this process's rank in the first counting communicator
  bool root_ = true;                   // made by a public constructor, not by split()
  std::shared_ptr<Waits> waits_;                          // shared with every split, as the ledger
  std::map<std::uint64_t, std::uint64_t> started_bytes_;  // ticket id -> bytes, until waited for
  std::size_t scratch_bytes_ = 0;                         // the largest scratch() asked for
};

}  // namespace k2c::dist
