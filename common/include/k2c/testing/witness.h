// k2c/testing/witness.h — the grader's own run of a timed kernel: wire format and the test
// program's side.
//
// A test program holds the student's code, so everything it reports (a test that passed, the
// figure a performance test measured) is something that code could have written itself. For a
// performance test the rubric marks with "witness", the grader therefore asks for a second run it
// judges itself, through `k2c_witness` (autograder/witness/), a program with no student code:
//
//   1. k2c_witness allocates the inputs and outputs of several independent launches ("sets") in
//      its own process, starts the test program as `k2c_test_NN --k2c_witness=NAME` with one end
//      of a socket on fd 3, and lends it the allocation (k2c/device/shared_memory.h: its file
//      descriptor travels with the greeting).
//   2. The test program maps the allocation and answers Ready; for each window the checker
//      fills every set's inputs from a seed drawn then, poisons the outputs, and sends Go; the
//      test program runs the kernel once per set (the function registered under NAME with
//      K2C_WITNESS) and answers Done.
//   3. The checker stops its clock only once its own read of outputs at positions it draws
//      after Done has completed, so work still running when Done came is on the clock; it then
//      compares what it read with its CPU reference. A skipped launch leaves poison behind. What
//      a window takes besides the work is measured beforehand with a server of the checker's own.
//
// The grader compares the figure of the test program's report with the rate the checker saw:
// a report faster than the checker's own clock allows, or outputs that are wrong, void the
// module. The structs below travel over the socket; the checker trusts none of what comes back
// beyond its arrival time and checks every field it reads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k2c::witness {

inline constexpr std::uint32_t kMagic = 0x5743324Bu;  // "K2CW"
inline constexpr int kMaxBuffers = 12, kMaxSets = 32, kMaxShape = 8;
// The socket's end in the test program.
inline constexpr int kChannelFd = 3;

struct Hello {  // checker -> test program, once
  std::uint32_t magic = kMagic;
  std::uint32_t buffers = 0, sets = 0;
  char name[64] = {};
  std::uint64_t bytes = 0;  // the lent allocation's size; its descriptor comes with this greeting
  std::int64_t shape[kMaxShape] = {};
  std::uint64_t offset[kMaxSets][kMaxBuffers] = {};  // bytes from the allocation's start
};

enum class Command : std::uint32_t { go = 1, end = 2 };
struct Order {  // checker -> test program
  std::uint32_t magic = kMagic;
  Command command = Command::end;
  std::uint32_t window = 0;
};

enum class Status : std::uint32_t { ready = 1, done = 2, failed = 3 };
struct Reply {  // test program -> checker
  std::uint32_t magic = kMagic;
  Status status = Status::failed;
  std::uint32_t window = 0;
  char message[244] = {};
};

}  // namespace k2c::witness

namespace k2c::testing {

// One launch as the checker laid it out: the set's buffers in the order of its spec, and the shape.
struct WitnessLaunch {
  std::vector<void*> buffers;
  std::vector<std::int64_t> shape;
  template <class T>
  T* at(std::size_t i) const {
    return static_cast<T*>(buffers.at(i));
  }
  int dim(std::size_t i) const { return static_cast<int>(shape.at(i)); }
};
using WitnessFn = void (*)(const WitnessLaunch&);

// Registers `fn` under `name` (static initialisation, through K2C_WITNESS); returns true.
bool register_witness(const char* name, WitnessFn fn);
// The test program's side of the protocol above (main() calls it for --k2c_witness=NAME);
// returns the process's exit status.
int serve_witness(const std::string& name);

}  // namespace k2c::testing

// K2C_WITNESS(softmax_fast) { sm::softmax(..., w.at<bf16>(0), w.at<bf16>(1), w.dim(0), w.dim(1)); }
// defines what one launch of the witness `softmax_fast` runs, on the checker's buffers `w`.
#define K2C_WITNESS(name)                                                                        \
  static void k2c_witness_##name(const ::k2c::testing::WitnessLaunch& w);                        \
  [[maybe_unused]] static const bool k2c_witness_registered_##name =                             \
      ::k2c::testing::register_witness(#name, k2c_witness_##name);                               \
  static void k2c_witness_##name(const ::k2c::testing::WitnessLaunch& w)
