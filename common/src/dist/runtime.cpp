// runtime.cpp — see k2c/dist/runtime.h.
#include "k2c/dist/runtime.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "k2c/core/check.h"
#include "mpi_communicator.h"
#if K2C_HAS_NCCL
#include <cuda_runtime_api.h>

#include "nccl_communicator.h"
#endif

namespace k2c::dist {

static int ranks_on_this_node() {
  MPI_Comm node;
  K2C_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int n = 1;
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  return n;
}

bool nccl_available() {
#if K2C_HAS_NCCL
  // Every rank needs a GPU of its own: as many GPUs on each node as ranks there.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  int ok = devices >= ranks_on_this_node() ? 1 : 0, all = 0;
  K2C_MPI_CHECK(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  return all == 1;
#else
  return false;
#endif
}

Backend choose_backend() {
  const char* env = std::getenv("K2C_BACKEND");
  const std::string want = env ? env : "";
  if (want == "mpi") return Backend::mpi;
  if (want == "nccl") {
    if (!nccl_available())
      throw std::runtime_error(
          "K2C_BACKEND=nccl, but NCCL needs one GPU per rank (and a build with NCCL)");
    return Backend::nccl;
  }
  K2C_CHECK(want.empty(), "K2C_BACKEND must be 'mpi' or 'nccl', got '" << want << "'");
  return nccl_available() ? Backend::nccl : Backend::mpi;
}

std::unique_ptr<Communicator> make_world(Backend b, int local_rank) {
  if (b == Backend::mpi) return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false);
#if K2C_HAS_NCCL
  return make_nccl_world(MPI_COMM_WORLD, local_rank);
#else
  (void)local_rank;
  throw std::runtime_error("this build has no NCCL backend");
#endif
}

Runtime::Runtime(int* argc, char*** argv) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) K2C_MPI_CHECK(MPI_Init(argc, argv));
  // Errors come back as codes (K2C_MPI_CHECK turns them into exceptions with the call and
  // place) instead of MPI's default of aborting on the spot.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm node;
  K2C_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  MPI_Comm_rank(node, &local_rank_);
  MPI_Comm_free(&node);
  world_ = make_world(choose_backend(), local_rank_);
}

Runtime::~Runtime() {
  world_.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void abort_job(const std::string& message) {
  int rank = -1, initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "rank %d: %s\n", rank, message.c_str());
  std::fflush(nullptr);
  if (initialised) MPI_Abort(MPI_COMM_WORLD, 1);  // mpirun ends every rank
  std::_Exit(1);
}

int run(int argc, char** argv, const std::function<void(Communicator&)>& body) {
  std::unique_ptr<Runtime> rt;  // outlives the catch: abort while MPI is still up, not finalised
  try {
    rt = std::make_unique<Runtime>(&argc, &argv);
    body(rt->world());
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
  rt.reset();
  return 0;
}

}  // namespace k2c::dist
