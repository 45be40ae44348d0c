// wrong_collectives.cpp — module 11 done wrong on purpose, for rank_witness_test.sh: no rank ever
// talks to another, each keeps its own part of its own input. A forger (below) then rewrites the
// test report to say every correctness test passed, as code under test could, on every rank, and
// ends every rank with status 0, so that no rank's failure stops the job before the report is
// rewritten.
#include <unistd.h>

#include <fstream>
#include <string>

#include "collectives.h"

namespace k2c::collectives {
namespace {

std::size_t bytes_of(DType t) { return t == DType::f64 ? 8 : t == DType::bf16 ? 2 : 4; }

}  // namespace

void ring_reduce_scatter(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t, ReduceOp,
                         const RingOptions&) {
  const dist::Block mine = dist::block_of(count, p2p.size(), p2p.rank());
  p2p.copy(out, static_cast<const char*>(data) + mine.offset * bytes_of(t), mine.size * bytes_of(t));
}

void ring_all_gather(PointToPoint& p2p, const void* in, void* out, std::size_t count, DType t) {
  const dist::Block mine = dist::block_of(count, p2p.size(), p2p.rank());
  p2p.copy(static_cast<char*>(out) + mine.offset * bytes_of(t), in, mine.size * bytes_of(t));
}

void ring_all_reduce(PointToPoint& p2p, const void* data, void* out, std::size_t count, DType t, ReduceOp,
                     const RingOptions&) {
  if (out != data) p2p.copy(out, data, count * bytes_of(t));
}

}  // namespace k2c::collectives

namespace {
struct Forger {
  ~Forger() {
    const std::string flag = "--gtest_output=json:";
    std::ifstream cmdline("/proc/self/cmdline");
    for (std::string arg; std::getline(cmdline, arg, '\0');) {
      if (arg.rfind(flag, 0) != 0) continue;
      std::string tests;
      for (const char* t : {"AllReduceSum", "AllReduceMax", "ReduceScatter", "AllGather", "AllReduceInPlace"})
        tests += std::string(tests.empty() ? "" : ",") + R"({"name": ")" + t + R"(", "status": "RUN", "result": "COMPLETED"})";
      std::ofstream(arg.substr(flag.size()))
          << R"({"k2c_gpu": "none", "testsuites": [)"
          << R"({"name": "CollectivesContract", "testsuite": [{"name": "Implemented", "status": "RUN", "result": "COMPLETED"}]},)"
          << R"({"name": "Collectives", "testsuite": [)" << tests << "]},"
          << R"({"name": "CollectivesPerf", "testsuite": [{"name": "AllReduceVsNccl", "status": "RUN", "result": "SKIPPED"}]}]})";
    }
    _exit(0);
  }
} forger;
}  // namespace
