// k2c/dist/runtime.h — starting and stopping a distributed program.
//
//   int main(int argc, char** argv) {
//     return k2c::dist::run(argc, argv, [](k2c::dist::Communicator& world) { ... });
//   }
//
// run() initialises MPI, picks the backend (K2C_BACKEND=nccl|mpi; default: NCCL when every
// rank sees a GPU and the build has NCCL), binds rank r to GPU (node-local rank mod GPUs), builds
// the world communicator (for NCCL: rank 0 makes the unique id, MPI broadcasts it,
// ncclCommInitRank), and calls the body. If the body throws on any rank, that rank prints
// "rank r: <message>" and aborts the whole job (MPI_Abort), so no rank is left waiting.
// NCCL_NVLS_ENABLE=0 is set before NCCL starts (NVLink multicast stays off).
#pragma once

#include <functional>
#include <memory>

#include "k2c/dist/communicator.h"

namespace k2c::dist {

// Backend from K2C_BACKEND, else the default for this machine (needs MPI initialised).
Backend choose_backend();
bool nccl_available();  // the build has NCCL and every rank sees a GPU

// MPI up, world communicator built; MPI down on destruction.
class Runtime {
 public:
  Runtime(int* argc, char*** argv);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  Communicator& world() { return *world_; }
  int local_rank() const { return local_rank_; }

 private:
  std::unique_ptr<Communicator> world_;
  int local_rank_ = 0;
};

// Builds a communicator over all ranks on the given backend (MPI must be initialised).
std::unique_ptr<Communicator> make_world(Backend b, int local_rank);

int run(int argc, char** argv, const std::function<void(Communicator&)>& body);

// Ends the whole job from one rank with a message: what run() does on an exception.
[[noreturn]] void abort_job(const std::string& message);

}  // namespace k2c::dist
