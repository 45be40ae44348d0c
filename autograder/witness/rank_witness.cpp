// k2c_rank_witness — the grader's own check of a distributed module's correctness test, in a
// process that holds no student code. The protocol is in common/include/k2c/dist/rank_witness.h.
//
//   k2c_rank_witness NAME --out VERDICT.json --ranks N [--cases C] [--seed S] [--timeout S] [--cwd DIR]
//                    [--env K=V]... [--uid U --gid G [--private-tmp [--private-pids] [--private-net]]] -- mpirun ... PROGRAM --k2c_rank_witness=NAME
//
// It listens on DIR/rank_witness.sock, starts the command with the socket's path in
// K2C_RANK_WITNESS (the command exports it to the ranks), draws C cases of the witness NAME, sends
// each rank its input, and compares every output byte with its own reference. The verdict, written
// to VERDICT.json in every outcome, is {"fault": "" | "submission" | "grader", "problem": ...,
// "shapes": [what each case was]}: "submission" when the test program's ranks did something wrong
// (a wrong, missing or late output, a rank that never came), "grader" when the check itself could
// not be set up.
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "k2c/core/fd_io.h"
#include "k2c/dist/rank_witness.h"
#include "process.h"
#include "rank_cases.h"
#include "verdict_file.h"

namespace {

namespace wr = k2c::dist::witness;
namespace rw = k2c::rank_witness;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using rw::Bytes;
using Deadline = std::chrono::time_point<Clock, std::chrono::duration<double>>;

// Time limits within the test program's own (--timeout): for the ranks to start and reach the
// checker (MPI's start-up included), and for each case. The largest case is a few hundred thousand
// elements, which a ring moves in milliseconds and even element-by-element messages in seconds;
// a rank that hangs costs a submission this much, not a module's whole time limit per check.
constexpr double kStartSeconds = 120, kCaseSeconds = 30;

struct Args {
  std::string name, out, cwd;
  int ranks = 0, cases = 3, uid = -1, gid = -1;
  bool private_tmp = false;  // the ranks with temporary folders of their own (process.h)
  bool private_pids = false;  // and processes of their own (process.h)
  bool private_net = false;   // and a network of their own (process.h)
  std::uint64_t seed = 0;  // 0: drawn afresh (the grader's way); else a verdict's seed, to replay its cases
  double timeout_s = 300;
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<std::string> program;
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) throw std::invalid_argument("usage: k2c_rank_witness NAME --out FILE --ranks N [options] -- COMMAND");
  a.name = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      a.program.assign(argv + i + 1, argv + argc);
      break;
    }
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--out") a.out = value();
    else if (arg == "--ranks") a.ranks = std::stoi(value());
    else if (arg == "--cases") a.cases = std::stoi(value());
    else if (arg == "--seed") a.seed = std::stoull(value());
    else if (arg == "--timeout") a.timeout_s = std::stod(value());
    else if (arg == "--cwd") a.cwd = value();
    else if (arg == "--uid") a.uid = std::stoi(value());
    else if (arg == "--gid") a.gid = std::stoi(value());
    else if (arg == "--private-tmp") a.private_tmp = true;
    else if (arg == "--private-pids") a.private_pids = true;
    else if (arg == "--private-net") a.private_net = true;
    else if (arg == "--env") {
      const std::string kv = value();
      const auto eq = kv.find('=');
      if (eq == std::string::npos) throw std::invalid_argument("--env " + kv + ": expected K=V");
      a.env.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    } else throw std::invalid_argument("unknown option " + arg);
  }
  if (a.out.empty() || a.program.empty()) throw std::invalid_argument("--out and a command after -- are required");
  if (a.ranks < 1 || a.ranks > 64) throw std::invalid_argument("--ranks must be 1 to 64");
  if (a.cases < 1 || a.cases > 16) throw std::invalid_argument("--cases must be 1 to 16");
  if (!(a.timeout_s > 0)) throw std::invalid_argument("--timeout must be positive");
  if (a.private_pids && !a.private_tmp) throw std::invalid_argument("--private-pids needs --private-tmp");
  if (a.private_net && !a.private_tmp) throw std::invalid_argument("--private-net needs --private-tmp");
  return a;
}

json verdict(const std::string& fault, const std::string& problem) {
  return {{"fault", fault}, {"problem", problem}};
}

using k2c::witness_io::write_verdict;

// ---- the channel -----------------------------------------------------------------------------

// Reads exactly n bytes from fd before the deadline; "" or why not.
std::string receive(int fd, void* data, std::size_t n, Deadline deadline, const std::atomic<bool>& child_done) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (Clock::now() >= deadline) return "no answer in time";
    pollfd pf{fd, POLLIN, 0};
    const int ready = poll(&pf, 1, 20);
    if (ready > 0) {
      const ssize_t got = recv(fd, p, n, 0);
      if (got <= 0) return "the rank closed its connection";
      p += got;
      n -= static_cast<std::size_t>(got);
    } else if (child_done.load()) {
      return "the test program ended";
    }
  }
  return "";
}

// The listening socket, in a folder of its own that this process makes and owns (0711: the test
// program's user may reach the socket but neither list nor change the folder), so nothing the test
// program's user does can stand in its way or turn the socket's path into a link: the run folder
// is that user's, and a process it left behind could be waiting there. -1 and `why` when it cannot
// be made; `folder` is then "" or the folder to remove.
int listen_privately(int ranks, std::string& folder, std::string& path, std::string& why) {
  char templ[] = "/tmp/k2c-rank-witness-XXXXXX";
  if (mkdtemp(templ) == nullptr) {
    why = std::string("cannot make the checker's socket folder: ") + std::strerror(errno);
    return -1;
  }
  folder = templ;
  path = folder + "/socket";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());  // 35 bytes, well inside sun_path
  // A chmod by path is safe here: no one else can write in the folder.
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (chmod(templ, 0711) != 0 || fd < 0 || bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(fd, ranks) != 0 || chmod(path.c_str(), 0666) != 0) {
    why = "cannot listen at " + path + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// A rank's connection, its sends bounded in time: a rank that stops reading (its buffer full with
// a large case) must cost a case's time, not hold the checker until the grader kills it.
void bound_sends(int fd) {
  timeval limit{static_cast<time_t>(kCaseSeconds), 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
}

int run(const Args& a) {
  const rw::Drawer draw = rw::find_drawer(a.name);
  if (draw == nullptr) {
    write_verdict(a.out, verdict("grader", "k2c_rank_witness has no witness named '" + a.name + "'"));
    return 0;
  }
  std::random_device entropy;
  const std::uint64_t seed = a.seed != 0 ? a.seed : ((static_cast<std::uint64_t>(entropy()) << 32) ^ entropy()) | 1;
  std::mt19937_64 rng(seed);
  // Every case drawn, and its reference computed, before any rank starts.
  std::vector<rw::Case> cases;
  try {
    for (int k = 0; k < a.cases; ++k) cases.push_back(draw(a.name, a.ranks, k, rng));
  } catch (const std::exception& e) {
    write_verdict(a.out, verdict("grader", "k2c_rank_witness could not draw a case of '" + a.name + "': " + e.what()));
    return 0;
  }
  std::string folder, path, why;
  const int listener = listen_privately(a.ranks, folder, path, why);
  if (listener < 0) {
    if (!folder.empty()) rmdir(folder.c_str());
    write_verdict(a.out, verdict("grader", why));
    return 0;
  }

  // ---- from here on the test program runs: what goes wrong is the submission's ---------------
  write_verdict(a.out, verdict("submission", "the check ended before it could judge the test program"));
  std::atomic<bool> child_done{false};
  std::atomic<int> child_pid{0};
  k2c::grader::ProcessResult child;
  auto env = a.env;
  env.emplace_back("K2C_RANK_WITNESS", path);
  std::thread runner([&] {
    child = k2c::grader::run_process(a.program, {.env = env,
                                                 .cwd = a.cwd,
                                                 .timeout_s = a.timeout_s,
                                                 .uid = a.uid,
                                                 .gid = a.gid,
                                                 .on_start = [&](int pid) { child_pid = pid; },
                                                 .private_tmp = a.private_tmp,
                                                 .private_pids = a.private_pids,
                                                 .private_net = a.private_net});
    child_done = true;
  });
  std::vector<int> rank_fd(a.ranks, -1);
  auto finish = [&](const std::string& fault, const std::string& problem) {
    for (int fd : rank_fd)
      if (fd >= 0) {  // a courtesy: a rank that does not take it is killed below anyway
        wr::Job end;
        (void)!send(fd, &end, sizeof end, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    for (int i = 0; i < 100 && !child_done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (const int pid = child_pid.load(); pid > 0 && !child_done.load()) kill(-pid, SIGKILL);
    runner.join();
    for (int fd : rank_fd)
      if (fd >= 0) close(fd);
    close(listener);
    unlink(path.c_str());
    rmdir(folder.c_str());
    json v = verdict(fault, problem);
    v["seed"] = std::to_string(seed);  // a string: JSON readers round integers above 2^53
    if (!fault.empty()) v["output"] = k2c::grader::utf8_tail(child.output, 4000);
    json shapes = json::array();
    for (const rw::Case& c : cases) shapes.push_back(c.what);
    if (fault.empty()) v["shapes"] = shapes;
    write_verdict(a.out, v);
    return 0;
  };

  // Every rank connects and says who it is.
  const Deadline start_deadline = Clock::now() + std::chrono::duration<double>(std::min(a.timeout_s, kStartSeconds));
  for (int connected = 0; connected < a.ranks;) {
    if (Clock::now() >= start_deadline) return finish("submission", "only " + std::to_string(connected) + " of " +
                                                                        std::to_string(a.ranks) + " ranks reached the checker in time");
    pollfd pf{listener, POLLIN, 0};
    if (poll(&pf, 1, 20) <= 0) {
      if (child_done.load())
        return finish("submission", "the test program ended (" + k2c::grader::describe_exit(child, a.timeout_s) +
                                        ") before every rank reached the checker");
      continue;
    }
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    bound_sends(fd);
    wr::Hello hello;
    if (const std::string late = receive(fd, &hello, sizeof hello, start_deadline, child_done); !late.empty()) {
      close(fd);
      return finish("submission", "a rank connected but did not say who it is: " + late);
    }
    hello.name[sizeof hello.name - 1] = '\0';
    if (hello.magic != wr::kMagic || hello.size != a.ranks || hello.rank < 0 || hello.rank >= a.ranks ||
        rank_fd[hello.rank] >= 0 || a.name != hello.name) {
      close(fd);
      return finish("submission", "a connection that is not one of the " + std::to_string(a.ranks) +
                                      " ranks of this check (rank " + std::to_string(hello.rank) + " of " +
                                      std::to_string(hello.size) + ", witness '" + hello.name + "')");
    }
    rank_fd[hello.rank] = fd;
    ++connected;
  }

  for (std::size_t k = 0; k < cases.size(); ++k) {
    const rw::Case& c = cases[k];
    const std::string label = "case " + std::to_string(k + 1) + " (" + c.what + ")";
    // Every rank gets its job before any answer is read: the ranks run the collective together.
    for (int r = 0; r < a.ranks; ++r) {
      wr::Job job;
      job.command = wr::Command::run;
      job.index = static_cast<std::uint32_t>(k);
      std::memcpy(job.args, c.args, sizeof job.args);
      job.in_bytes = c.in[r].size();
      job.out_bytes = c.out_bytes[r];
      if (!k2c::send_fully(rank_fd[r], &job, sizeof job) || !k2c::send_fully(rank_fd[r], c.in[r].data(), c.in[r].size()))
        return finish("submission", label + ": rank " + std::to_string(r) + " stopped taking input");
    }
    const Deadline deadline = Clock::now() + std::chrono::duration<double>(std::min(a.timeout_s, kCaseSeconds));
    std::vector<Bytes> got(a.ranks);
    for (int r = 0; r < a.ranks; ++r) {
      const std::string rank = label + ": rank " + std::to_string(r);
      wr::Result res;
      if (const std::string late = receive(rank_fd[r], &res, sizeof res, deadline, child_done); !late.empty())
        return finish("submission", rank + ": " + late);
      res.message[sizeof res.message - 1] = '\0';
      if (res.magic != wr::kMagic || res.index != k) return finish("submission", rank + " sent something that is not its result");
      if (res.status != wr::Status::done) return finish("submission", rank + " failed: " + res.message);
      if (res.out_bytes != c.out_bytes[r])
        return finish("submission", rank + " sent " + std::to_string(res.out_bytes) + " bytes, not " +
                                        std::to_string(c.out_bytes[r]));
      got[r].resize(res.out_bytes);
      if (const std::string late = receive(rank_fd[r], got[r].data(), got[r].size(), deadline, child_done); !late.empty())
        return finish("submission", rank + ": " + late);
    }
    if (const std::string wrong = c.check(got); !wrong.empty()) return finish("submission", label + ": " + wrong);
  }
  return finish("", "");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k2c_rank_witness: %s\n", e.what());
    return 2;
  }
}
