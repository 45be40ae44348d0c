// k2c/testing/testing.h — what every module's GoogleTest program shares.
//
// - K2C_REQUIRE_GPU(): skip (reported as skipped, never as passed) when no CUDA device exists.
// - seed(): the run's seed (K2C_SEED, set by `k2c grade --seed`; fixed by default so plain
//   ctest runs are reproducible). Tests draw shapes and data from it.
// - K2C_EXPECT_IMPLEMENTED(call): the <Module>Contract.Implemented probe (see below).
// - expect_perf(achieved, ceiling): the one place a performance figure is judged. It records
//   the figure for the grader (GoogleTest properties in the JSON report) and fails the test
//   below the rubric's bar or above its physical limit.
// The test program's main (common/src/test_main.cpp) fills in the module id, the tree being
// tested and the rubric path, and aborts the process on a sticky CUDA error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "k2c/core/check.h"
#include "k2c/core/rubric.h"
#include "k2c/core/todo.h"

namespace k2c::testing {

struct Context {
  std::string module_id;  // "01_naive_matmul"
  std::string impl;       // "assignments" or "solutions"
  std::string rubric_path;
  std::uint64_t seed = 0;
};
const Context& context();
void set_context(Context c);
// The context of a test program: its module and tree, the rubric (K2C_RUBRIC, else the given
// default) and the seed (K2C_SEED, else a fixed one so plain ctest runs are reproducible).
Context context_from_env(const char* module_id, const char* impl, const char* default_rubric);

// Which module a test program tests, from which tree, and the rubric it reads unless K2C_RUBRIC
// names another. Each program gets its own small source defining it (k2c_add_module writes it),
// so that the main() they share is compiled once.
struct ProgramIdentity {
  const char* module_id;
  const char* impl;
  const char* default_rubric;
};
extern const ProgramIdentity kProgram;

inline std::uint64_t seed() { return context().seed; }
// A seed for one purpose inside one test, so tests and purposes draw independent data.
std::uint64_t seed_for(const std::string& purpose);

// A seed nobody can know before it is drawn (std::random_device, 64 bits), for inputs that code
// under test must not be able to make in advance from the run's seed (a speed test's inputs drawn
// just before each call); name it in a failure's message so the case can be replayed.
std::uint64_t unpredictable_seed();

// Bytes the process's heap holds now: glibc's count of what malloc, new and the aligned
// allocations have handed out and not taken back, over every arena and large mapped blocks. A
// test holds a ledger's figures against the heap's growth (module 13), since code under test
// can keep a tensor off the ledger it was given but not off the process's heap.
std::size_t heap_in_use();

// A rows × cols matrix shape, and `count` random ones with 1 to max_cols columns and at most about
// max_elements elements, drawn from `seed` (tests of row-wise kernels, modules 06 and 07).
struct RowShape {
  int rows, cols;
};
std::vector<RowShape> random_row_shapes(std::uint64_t seed, int count, int max_cols, int max_elements);

// A test program's main() starts with this: for --k2c_witness=NAME (the grader's own run of a
// timed kernel, k2c/testing/witness.h) it serves that run and returns the exit status; otherwise
// it returns -1 and the program goes on to its tests.
int serve_witness_if_asked(int argc, char** argv);

bool gpu_available();
std::string gpu_unavailable_reason();
// The device's name, "" when there is none.
std::string gpu_name();
bool sanitizing();  // K2C_SANITIZE=1: running under compute-sanitizer, timings meaningless

// The rubric entry of the running test; fails the test (and returns nullptr) when absent.
const TestSpec* current_test_spec();

// Records achieved / ceiling for the grader and returns failure when the ratio is below the
// bar (PerfSpec::required: the goal for the reference solutions, the threshold for student
// code) or above max_ratio. Units as in the rubric entry (the caller converts).
::testing::AssertionResult check_perf(double achieved, double ceiling, const std::string& detail = "");

}  // namespace k2c::testing

// Skips record their reason as the property k2c_skip too: older GoogleTest versions leave the
// GTEST_SKIP message out of the JSON report, and the grader shows the reason.
#define K2C_SKIP(reason)                                                 \
  do {                                                                   \
    const std::string k2c_why_ = (reason);                               \
    ::testing::Test::RecordProperty("k2c_skip", k2c_why_);               \
    GTEST_SKIP() << k2c_why_;                                            \
  } while (0)

#define K2C_REQUIRE_GPU()                                                                      \
  do {                                                                                         \
    if (!::k2c::testing::gpu_available())                                                      \
      K2C_SKIP("no CUDA device: " + ::k2c::testing::gpu_unavailable_reason());                 \
  } while (0)

// Performance tests skip under compute-sanitizer, which slows kernels by orders of magnitude.
#define K2C_REQUIRE_TIMING()                                                              \
  do {                                                                                    \
    K2C_REQUIRE_GPU();                                                                    \
    if (::k2c::testing::sanitizing()) K2C_SKIP("timing is skipped under compute-sanitizer"); \
  } while (0)

// For a module's <Module>Contract.Implemented test (SoftmaxContract.Implemented), which tells "not implemented yet" apart from
// "implemented" even on a machine without a GPU: `call` runs the student function (on dummy,
// never dereferenced pointers when there is no device). A stub throws k2c::NotImplemented and
// the test fails with the grader's marker; real code fails to reach a device and throws
// k2c::Error, which counts as implemented.
#define K2C_EXPECT_IMPLEMENTED(call)                                                  \
  do {                                                                                \
    try {                                                                             \
      call;                                                                           \
    } catch (const ::k2c::NotImplemented& e) {                                        \
      FAIL() << e.what();                                                             \
    } catch (const ::k2c::Error&) {                                                   \
      if (::k2c::testing::gpu_available()) throw;                                     \
    }                                                                                 \
  } while (0)

// A failure says only the verdict ("too slow: 512 TFLOP/s = 0.64 of ..., <detail>"): the grader
// shows a failed test's first lines, which EXPECT_TRUE would fill with the expression.
#define K2C_EXPECT_PERF(achieved, ceiling, detail)                                              \
  do {                                                                                          \
    const ::testing::AssertionResult k2c_perf_ =                                                \
        ::k2c::testing::check_perf((achieved), (ceiling), (detail));                            \
    if (!k2c_perf_) ADD_FAILURE() << k2c_perf_.message();                                       \
  } while (0)
