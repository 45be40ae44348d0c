// dist_tickets.cpp — the non-blocking exchange, start_send_recv / wait (run by CTest under
// mpirun -np 2 and -np 3 on the MPI backend; it runs unchanged on NCCL):
//   ring       a started exchange, once waited on, holds the left neighbour's data; so does the
//              blocking send_recv; through the Communicator and through a PointToPointView;
//   in flight  four exchanges open at once between the same ranks, waited in reverse order:
//              each receives its own message (matched in the order they were started);
//   closing    synchronize() completes an exchange nobody waited on and closes its ticket;
//   misuse     a second wait, ticket 0 and a ticket never issued throw std::logic_error;
//   scratch    growing scratch() while an exchange receives into it leaves the ticket open and,
//              on MPI, the data received before the buffer moved;
//   empty      an exchange of zero elements.
// Messages are 256 KiB, beyond the eager limit of Open MPI's shared-memory transport, so a
// send does not complete before its receive is posted and matched.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "k2c/dist/runtime.h"

namespace kd = k2c::dist;

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("ticket check failed: " + what);
}

// Rank r's message m: different for every rank, message and element.
std::vector<int> message(int r, int m, std::size_t count) {
  std::vector<int> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = r * 1000000 + m * 100000 + static_cast<int>(i % 100000);
  return v;
}

void expect_message(kd::Communicator& w, const void* buf, int from, int m, std::size_t count,
                    const std::string& what) {
  std::vector<int> got(count);
  w.to_host(got.data(), buf, count * sizeof(int));
  require(got == message(from, m, count), what + ": not message " + std::to_string(m) + " of rank " +
                                              std::to_string(from));
}

void expect_refused(kd::PointToPoint& p2p, kd::Ticket t, const std::string& says, const std::string& what) {
  try {
    p2p.wait(t);
  } catch (const std::logic_error& e) {
    require(std::string(e.what()).find(says) != std::string::npos,
            what + ": the message does not say '" + says + "': " + e.what());
    return;
  }
  require(false, what + ": the wait was accepted");
}

}  // namespace

int main(int argc, char** argv) {
  return kd::run(argc, argv, [](kd::Communicator& w) {
    const int n = w.size(), r = w.rank(), right = (r + 1) % n, left = (r + n - 1) % n;
    constexpr std::size_t count = std::size_t{1} << 16, bytes = count * sizeof(int);
    constexpr int messages = 4;
    const auto i32 = kd::DType::i32;
    std::vector<std::unique_ptr<kd::Buffer>> send, recv;
    const std::vector<int> zeros(count, 0);
    for (int m = 0; m < messages; ++m) {
      send.push_back(std::make_unique<kd::Buffer>(w, bytes));
      recv.push_back(std::make_unique<kd::Buffer>(w, bytes));
      w.to_backend(send[m]->get(), message(r, m, count).data(), bytes);
    }
    auto clear = [&] {
      for (auto& b : recv) w.to_backend(b->get(), zeros.data(), bytes);
    };
    kd::PointToPointView p2p(w);

    // ring
    const kd::Ticket first = w.start_send_recv(send[0]->get(), count, right, recv[0]->get(), count, left, i32);
    w.wait(first);
    expect_message(w, recv[0]->get(), left, 0, count, "start_send_recv + wait");
    p2p.send_recv(send[1]->get(), count, right, recv[1]->get(), count, left, i32);
    expect_message(w, recv[1]->get(), left, 1, count, "send_recv through a view");

    // in flight
    clear();
    std::vector<kd::Ticket> open;
    for (int m = 0; m < messages; ++m)
      open.push_back(p2p.start_send_recv(send[m]->get(), count, right, recv[m]->get(), count, left, i32));
    for (int m = 1; m < messages; ++m) require(open[m].id != open[m - 1].id, "two open tickets share an id");
    for (int m = messages - 1; m >= 0; --m) p2p.wait(open[m]);
    for (int m = 0; m < messages; ++m) expect_message(w, recv[m]->get(), left, m, count, "four exchanges in flight");
    expect_refused(p2p, open[0], "no longer open", "a second wait");

    // closing
    clear();
    const kd::Ticket unwaited = p2p.start_send_recv(send[2]->get(), count, right, recv[2]->get(), count, left, i32);
    p2p.synchronize();
    expect_message(w, recv[2]->get(), left, 2, count, "an exchange completed by synchronize()");
    expect_refused(p2p, unwaited, "no longer open", "a wait after synchronize()");

    // misuse
    expect_refused(p2p, kd::Ticket{}, "never issued", "ticket 0");
    expect_refused(p2p, kd::Ticket{std::uint64_t{1} << 40}, "never issued", "a ticket never issued");

    // scratch
    void* small = p2p.scratch(bytes);
    const kd::Ticket into_scratch = p2p.start_send_recv(send[3]->get(), count, right, small, count, left, i32);
    void* big = p2p.scratch(64 * bytes);  // grows: the old buffer is released
    p2p.wait(into_scratch);               // still open
    if (w.backend() == kd::Backend::mpi)  // host memory keeps its contents when it grows
      expect_message(w, big, left, 3, count, "data received into scratch() before it grew");

    // empty
    p2p.wait(p2p.start_send_recv(send[0]->get(), 0, right, recv[0]->get(), 0, left, i32));
    p2p.synchronize();
    w.barrier();
    if (r == 0) std::printf("tickets: start_send_recv / wait on %d ranks OK\n", n);
  });
}
