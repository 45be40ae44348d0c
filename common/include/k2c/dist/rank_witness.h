// k2c/dist/rank_witness.h — the grader's own check of a distributed module's correctness test:
// wire format and the test program's side.
//
// A distributed test program holds the student's code on every rank, so the report it writes (a
// test that passed) is something that code could have written itself. For a correctness test the
// rubric marks with "witness", the grader therefore asks for a second run it judges itself,
// through `k2c_rank_witness` (autograder/witness/rank_witness.cpp), a program with no student code:
//
//   1. The checker listens on a Unix socket in the run's private folder and starts the test
//      program on N ranks as `mpirun ... k2c_test_NN --k2c_rank_witness=NAME`, the socket's path in
//      K2C_RANK_WITNESS. Every rank connects and says which rank of how many it is.
//   2. For each case the checker draws (sizes, types, operations, inputs from a seed drawn then),
//      it sends every rank a Job with that rank's input; the ranks run the function registered
//      under NAME with K2C_RANK_WITNESS (the module's code on the world communicator) and send
//      back their outputs.
//   3. The checker compares every byte it got with its own reference. A wrong, missing or late
//      output fails the test, whatever the report said.
//
// The structs below travel over the socket; the checker trusts none of what comes back and checks
// every field it reads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k2c::dist::witness {

inline constexpr std::uint32_t kMagic = 0x5752324Bu;  // "K2RW"
inline constexpr int kArgs = 16;
// Inputs and outputs of one case, per rank: the checker refuses to send or take more.
inline constexpr std::uint64_t kMaxBytes = std::uint64_t{64} << 20;

struct Hello {  // rank -> checker, once per connection
  std::uint32_t magic = kMagic;
  std::int32_t rank = -1, size = 0;
  char name[64] = {};
};

enum class Command : std::uint32_t { run = 1, end = 2 };
struct Job {  // checker -> rank, followed by in_bytes of input
  std::uint32_t magic = kMagic;
  Command command = Command::end;
  std::uint32_t index = 0;  // the case
  std::int64_t args[kArgs] = {};
  std::uint64_t in_bytes = 0, out_bytes = 0;  // out_bytes: what the checker expects back
};

enum class Status : std::uint32_t { done = 1, failed = 2 };
struct Result {  // rank -> checker, followed by out_bytes of output when done
  std::uint32_t magic = kMagic;
  Status status = Status::failed;
  std::uint32_t index = 0;
  std::uint64_t out_bytes = 0;
  char message[240] = {};
};

}  // namespace k2c::dist::witness

namespace k2c::dist::testing {

// One case as a rank sees it: the checker's arguments, this rank's input, and the output to fill
// (sized as the checker expects; a function that cannot fill it throws).
struct RankCase {
  std::int64_t args[witness::kArgs] = {};
  std::vector<unsigned char> in, out;
};
using RankWitnessFn = void (*)(RankCase&);

// Registers `fn` under `name` (static initialisation, through K2C_RANK_WITNESS); returns true.
bool register_rank_witness(const char* name, RankWitnessFn fn);
// For --k2c_rank_witness=NAME on the command line: serves the checker on this rank (after MPI is
// up) and returns the process's exit status; -1 when the flag is absent.
int serve_rank_witness_if_asked(int argc, char** argv);

}  // namespace k2c::dist::testing

// K2C_RANK_WITNESS(all_gather) { ... c.in ... c.out ... } defines what one case of the witness
// `all_gather` runs on this rank.
#define K2C_RANK_WITNESS(name)                                                                    \
  static void k2c_rank_witness_##name(::k2c::dist::testing::RankCase& c);                         \
  [[maybe_unused]] static const bool k2c_rank_witness_registered_##name =                         \
      ::k2c::dist::testing::register_rank_witness(#name, k2c_rank_witness_##name);                \
  static void k2c_rank_witness_##name(::k2c::dist::testing::RankCase& c)
