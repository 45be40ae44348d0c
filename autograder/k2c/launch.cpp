// launch.cpp — see launch.h.
#include "launch.h"

#include <unistd.h>

#include <cstdlib>
#include <stdexcept>

namespace k2c::grader {

namespace {
// Quotes a word for a POSIX shell only where it needs it, so the printed line stays readable.
std::string shell_word(const std::string& w) {
  if (!w.empty() && w.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,+@%") ==
                        std::string::npos)
    return w;
  std::string q = "'";
  for (char c : w) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}
}  // namespace

std::string mpirun_program() {
  // The mpirun of the MPI the course was built against (CMake's find), so that ranks and library
  // agree; K2C_MPIRUN overrides it; plain `mpirun` from PATH otherwise.
  if (const char* e = std::getenv("K2C_MPIRUN"); e && *e) return e;
#ifdef K2C_MPIEXEC
  return K2C_MPIEXEC;
#else
  return "mpirun";
#endif
}

std::string Launch::display() const {
  std::string s;
  for (const auto& [k, v] : env) s += k + "=" + shell_word(v) + " ";
  for (std::size_t i = 0; i < argv.size(); ++i) s += (i ? " " : "") + shell_word(argv[i]);
  return s;
}

Launch mpirun_prefix(const LaunchOptions& o) {
  if (o.ranks < 1) throw std::invalid_argument("run: -np must be at least 1, got " + std::to_string(o.ranks));
  if (!o.backend.empty() && o.backend != "mpi" && o.backend != "nccl")
    throw std::invalid_argument("run: --backend must be mpi or nccl, got '" + o.backend + "'");
  Launch l;
  l.argv = {mpirun_program(), "-np", std::to_string(o.ranks)};
  // Open MPI counts a slot per physical core of the cores this process may use, which is hard to
  // know from here (hyperthreads, cpusets); a laptop or CI that tries 4 ranks on 2 cores needs the
  // flag, and on one node it costs nothing. Across nodes, the host list gives the slots instead.
  l.argv.push_back("--oversubscribe");
  if (geteuid() == 0) l.argv.push_back("--allow-run-as-root");  // containers and CI run as root
  // -x exports a setting to every rank, on every node: the form that works beyond one machine.
  l.argv.insert(l.argv.end(), {"-x", "NCCL_NVLS_ENABLE=0"});  // NVLink multicast stays off
  if (!o.backend.empty()) l.argv.insert(l.argv.end(), {"-x", "K2C_BACKEND=" + o.backend});
  if (o.dist_timeout_s > 0) l.argv.insert(l.argv.end(), {"-x", "K2C_DIST_TIMEOUT=" + std::to_string(o.dist_timeout_s)});
  // Open MPI's shared-memory transport copies between processes with a system call that many
  // containers refuse; without it, it falls back to copying through a shared segment. This is
  // read by mpirun itself, so it goes in the environment, not after -x.
  if (o.backend == "mpi") l.env.emplace_back("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
  return l;
}

Launch mpirun_command(const LaunchOptions& o, const std::vector<std::string>& program_and_args) {
  if (program_and_args.empty() || program_and_args[0].empty()) throw std::invalid_argument("run: no program given");
  Launch l = mpirun_prefix(o);
  l.argv.insert(l.argv.end(), program_and_args.begin(), program_and_args.end());
  return l;
}

}  // namespace k2c::grader
