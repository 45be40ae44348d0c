// dist_failure.cpp — a two-rank program that fails on purpose, for dist_failure_test.sh.
//   throw:     rank 1 throws between two ring steps while rank 0 waits in the second one.
//   hang:      rank 1 stops answering; rank 0's wait must end the job at K2C_DIST_TIMEOUT.
//   hang_open: the same, but rank 0 started the exchange without waiting on it: the
//              synchronize() that completes it must end the job at the deadline too.
// Either way the whole job must end, with the failing rank's message, well within the limit.
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "k2c/dist/runtime.h"

int main(int argc, char** argv) {
  const bool hang_open = argc > 1 && std::strcmp(argv[1], "hang_open") == 0;
  const bool hang = hang_open || (argc > 1 && std::strcmp(argv[1], "hang") == 0);
  return k2c::dist::run(argc, argv, [hang, hang_open](k2c::dist::Communicator& w) {
    using k2c::dist::DType;
    const int peer = 1 - w.rank();
    k2c::dist::Buffer a(w, 4096), b(w, 4096);
    w.send_recv(a.get(), 1024, peer, b.get(), 1024, peer, DType::f32);  // both ranks arrive here
    w.synchronize();
    if (w.rank() == 1) {
      if (!hang) throw std::runtime_error("planted failure in the middle of a ring");
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    if (hang_open)
      w.start_send_recv(a.get(), 1024, peer, b.get(), 1024, peer, DType::f32);  // never waited on
    else
      w.send_recv(a.get(), 1024, peer, b.get(), 1024, peer, DType::f32);  // rank 1 never comes
    w.synchronize();
  });
}
