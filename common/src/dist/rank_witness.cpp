// rank_witness.cpp — a rank's side of the grader's own check (k2c/dist/rank_witness.h).
#include "k2c/dist/rank_witness.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <string>

#include "k2c/core/fd_io.h"
#include "k2c/dist/testing.h"

namespace k2c::dist::testing {
namespace {

namespace wr = witness;

std::map<std::string, RankWitnessFn>& registry() {
  static std::map<std::string, RankWitnessFn> r;
  return r;
}

bool send_result(int fd, std::uint32_t index, const std::string& problem, const std::vector<unsigned char>& out) {
  wr::Result r;
  r.index = index;
  r.status = problem.empty() ? wr::Status::done : wr::Status::failed;
  r.out_bytes = problem.empty() ? out.size() : 0;
  std::snprintf(r.message, sizeof r.message, "%s", problem.c_str());
  return k2c::write_fully(fd, &r, sizeof r) && (!problem.empty() || k2c::write_fully(fd, out.data(), out.size()));
}

int connect_to(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) return -1;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Serves the checker's cases with `fn` until it says end; the exit status.
int serve(int fd, RankWitnessFn fn) {
  for (;;) {
    wr::Job job;
    if (!k2c::read_fully(fd, &job, sizeof job) || job.magic != wr::kMagic) return 1;
    if (job.command == wr::Command::end) return 0;
    if (job.in_bytes > wr::kMaxBytes || job.out_bytes > wr::kMaxBytes) return 1;
    RankCase c;
    std::memcpy(c.args, job.args, sizeof c.args);
    c.in.resize(job.in_bytes);
    if (!k2c::read_fully(fd, c.in.data(), c.in.size())) return 1;
    c.out.assign(job.out_bytes, 0xFF);  // poisoned: what the function leaves unwritten stays wrong
    std::string problem;
    try {
      fn(c);
      if (c.out.size() != job.out_bytes) problem = "the output changed size";
    } catch (const std::exception& e) {
      problem = e.what();
      if (problem.empty()) problem = "an exception without a message";
    }
    if (!send_result(fd, job.index, problem, c.out)) return 1;
  }
}

}  // namespace

bool register_rank_witness(const char* name, RankWitnessFn fn) {
  registry()[name] = fn;
  return true;
}

int serve_rank_witness_if_asked(int argc, char** argv) {
  const std::string flag = "--k2c_rank_witness=";
  std::string name;
  for (int i = 1; i < argc; ++i)
    if (std::string arg = argv[i]; arg.rfind(flag, 0) == 0) name = arg.substr(flag.size());
  if (name.empty()) return -1;
  const char* path = std::getenv("K2C_RANK_WITNESS");
  const int fd = path ? connect_to(path) : -1;
  if (fd < 0) {
    std::fprintf(stderr, "rank witness: cannot reach the checker at %s: %s\n", path ? path : "(K2C_RANK_WITNESS unset)",
                 std::strerror(errno));
    return 2;
  }
  wr::Hello hello;
  hello.rank = world().rank();
  hello.size = world().size();
  std::snprintf(hello.name, sizeof hello.name, "%s", name.c_str());
  if (!k2c::write_fully(fd, &hello, sizeof hello)) return 1;
  const auto it = registry().find(name);
  if (it == registry().end()) {
    send_result(fd, 0, "this test program has no rank witness '" + name + "'", {});
    close(fd);
    return 2;
  }
  const int status = serve(fd, it->second);
  close(fd);
  return status;
}

}  // namespace k2c::dist::testing
