// launch.h — the one way the course starts ranks: a plain `mpirun` command line.
//
// `k2c run`, `k2c collectives`, the grader and CTest all build their command here, and `k2c run`
// prints it before it runs, so what a user sees is the command they would type on a cluster:
// `mpirun -H node1:8,node2:8 ...` or `srun --mpi=pmix ...` with the same program and the same
// -x settings. Nothing sits between mpirun and the program: the runtime (k2c/dist/runtime.h)
// finds node-local ranks and bootstraps NCCL over MPI by itself.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace k2c::grader {

struct LaunchOptions {
  int ranks = 1;
  std::string backend;      // "mpi" or "nccl"; empty: the runtime's default for the machine
  int dist_timeout_s = 0;   // K2C_DIST_TIMEOUT for the ranks; 0: the runtime's default
};

// The mpirun to use: $K2C_MPIRUN, else the one CMake found when k2c was built, else `mpirun`.
std::string mpirun_program();

struct Launch {
  std::vector<std::string> argv;                            // mpirun and its arguments
  std::vector<std::pair<std::string, std::string>> env;     // set in the launcher's environment
  std::string display() const;                              // the command as a shell line
};

// mpirun -np N --oversubscribe [--allow-run-as-root as root]
//   -x NCCL_NVLS_ENABLE=0 [-x K2C_BACKEND=...] [-x K2C_DIST_TIMEOUT=...]
// without the program (the grader appends its own). Throws std::invalid_argument for ranks < 1
// or an unknown backend.
Launch mpirun_prefix(const LaunchOptions& options);
// The same followed by PROGRAM ARGS...; throws std::invalid_argument for an empty program.
Launch mpirun_command(const LaunchOptions& options, const std::vector<std::string>& program_and_args);

}  // namespace k2c::grader
