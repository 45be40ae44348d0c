// k2c/core/rubric.h — autograder/rubric.json: modules, tests, points and performance thresholds.
//
// The rubric is data, read at run time by the grader and by the tests themselves, so instructors
// retune points and thresholds without recompiling. Every threshold is a fraction of a ceiling
// measured in the same run (see k2c/reference/ceilings.h), never an absolute time.
//
// A malformed rubric throws RubricError whose message names the offending field, e.g.
//   rubric.json: modules[1].tests[3].perf.threshold: expected a number in (0, max_ratio]
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace k2c {

class RubricError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PerfSpec {
  std::string ceiling;     // the ceiling the ratio is taken against, e.g. "memcpy_d2d"
  std::string unit;        // unit of the achieved figure, e.g. "GB/s", "TFLOP/s"
  double threshold = 0;    // student bar: full points at ratio >= threshold
  double goal = 0;         // what the reference solution must reach (>= threshold)
  double max_ratio = 0;    // a ratio above this is physically impossible: the result is invalid
  std::string witness;     // "" or the grader's own run of the timed kernel (autograder/witness/specs.cu)

  // The bar code from the tree `impl` ("solutions" or "assignments") must clear: the reference
  // solutions are held to the goal, student code to the threshold. The one home of that rule:
  // the tests (k2c::testing::check_perf) and the grader (evaluate_module) both ask here, so the
  // verdict a test prints and the one the grader recomputes cannot drift apart.
  double required(std::string_view impl) const { return held_to_goal(impl) ? goal : threshold; }
  // What that bar is called in messages.
  static const char* required_name(std::string_view impl) {
    return held_to_goal(impl) ? "reference goal" : "student bar";
  }

 private:
  static bool held_to_goal(std::string_view impl) { return impl == "solutions"; }
};

struct TestSpec {
  std::string name;        // GoogleTest "Suite.Name"
  double points = 0;
  bool bonus = false;      // points on top of the module's total (an advanced, optional part)
  // Needs a CUDA device (its program skips it without one, or it runs on NCCL only): a report
  // in which it passed on a machine with no NVIDIA device was not written by the harness, and
  // voids the module. Which tests these are: autograder/selftest/device_flags_test.sh checks it.
  bool device = false;
  // Runs on the NCCL backend only (a distributed module's test that skips on MPI): a run of the
  // module on the MPI backend whose report says it passed was not written by the harness, and
  // voids the module, whatever devices the machine has. A "nccl" test is a "device" test too.
  bool nccl = false;
  std::optional<PerfSpec> perf;
  // A correctness test: "" or the kernel the grader checks again itself, at shapes it draws
  // (k2c_witness --shapes, autograder/witness/specs.cu), when the report says the test passed.
  std::string witness;
  // A distributed module's correctness test: "" or the check the grader runs again itself on the
  // module's ranks, with cases it draws (k2c_rank_witness, autograder/witness/rank_witness.cpp).
  std::string rank_witness;
  // The rank count of that check: 0 for the module's (three where the rubric runs three ranks,
  // else its largest MPI run up to four); else one of the module's MPI runs (a grid of 1 or 2).
  int rank_witness_ranks = 0;
};

// One launch of a distributed module's test program: `ranks` processes under mpirun, on a backend.
struct RunSpec {
  std::string backend;  // "mpi" or "nccl"
  int ranks = 1;
  std::string label() const { return backend + " x" + std::to_string(ranks); }
};

struct ModuleSpec {
  std::string id;          // "NN_snake_name", the same in lectures/, assignments/, solutions/
  std::string title;
  std::string kind;        // "gpu" (needs a CUDA toolkit to build), "cpu", or "mpi" (run under
                           // mpirun once per entry of `runs`)
  std::vector<RunSpec> runs;  // mpi modules only
  bool model = false;              // "build": links the model library (Part II's modules)
  std::vector<std::string> uses;   // "build": earlier modules whose implementations it links
  bool sm90a = false;              // "build": compiled for sm_90a where the build targets sm_90
                                   // (a Part B on wgmma and setmaxnreg)
  int timeout_s = 0;
  std::vector<std::string> files;  // student files, relative to the repository root
  std::vector<TestSpec> tests;

  double points() const;        // what full marks are: the tests that are not bonus
  double bonus_points() const;  // what the bonus tests add at most
  std::string number() const { return id.substr(0, 2); }
  const TestSpec* find_test(std::string_view name) const;
};

struct Rubric {
  int version = 0;
  std::size_t max_file_bytes = 0;  // submission intake: largest accepted student file
  std::vector<ModuleSpec> modules;

  // By full id ("01_naive_matmul") or by number ("01", "1").
  const ModuleSpec* find(std::string_view key) const;
};

Rubric parse_rubric(const std::string& text, const std::string& origin = "rubric.json");
Rubric load_rubric(const std::string& path);

}  // namespace k2c
