// grade.h — the grading engine behind `k2c grade`.
//
// For each selected module: build its test program (a compile error is that module's failure,
// with the compiler's first errors), run it as a child process with a time limit, read its
// GoogleTest JSON report, and award the rubric's points. Everything that can go wrong in a
// module — crash, hang, sticky CUDA error, early exit, missing tests, an impossible figure —
// costs that module its points and nothing else, and at most one time limit. evaluate_module
// is a pure function of the child's exit and report, so it is tested without any GPU.
//
// What a submission could do to the grader itself is kept out too (docs/SECURITY.md): its
// files are staged outside the course tree and their headers checked after the build, its
// library is read for run-time loading, each test run gets a private copy of the rubric, and
// the course tree is fingerprinted before grading and after every module.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "k2c/core/rubric.h"
#include "process.h"

namespace k2c::grader {

struct GradeReport;

struct GradeOptions {
  std::string root;           // course sources
  std::string build_dir;      // default: <root>/build/<impl>
  std::string impl = "assignments";
  std::string rubric_path;    // default: <root>/autograder/rubric.json
  std::string reference_dir;  // default: <root>/autograder/reference
  std::vector<std::string> modules;  // ids or numbers; empty: all
  std::uint64_t seed = 0;
  double timeout_s = 0;       // > 0 overrides the rubric's per-module limit
  bool sanitize = false;
  bool build_only = false;    // build what grading runs (checkers, test programs), run nothing
  std::string submission_dir;
  std::string generator;      // CMake generator for a first configure ("" = CMake's default)
  // The user that test programs (code under test) run as when the grader runs as root: "" for
  // the default, nobody; "self" to keep root. Ignored when the grader is not root.
  std::string run_as;
  int jobs = 0;
  // > 0: seconds from the start of grading after which no further module begins; the modules
  // left are reported "not graded" (0 points) and the results written, before a platform's own
  // time limit stops the grader with nothing reported.
  double deadline_s = 0;
  // Called with the report so far after each module is graded (not after one that rewrote the
  // course tree): k2c grade writes its result files there, so that a grader stopped later (a
  // platform's time limit) leaves the modules it finished.
  std::function<void(const GradeReport&)> after_module;
};

struct PerfOutcome {
  double achieved = 0, ceiling = 0, ratio = 0, required = 0;
  std::optional<double> reference_ratio;  // the reference solution's ratio on this GPU
  std::string unit, ceiling_name;
  // The grader's own run of the timed kernel (k2c_witness): its best rate in `unit`, or why the
  // test was not witnessed (a machine where the check cannot run).
  std::optional<double> witnessed;
  std::string not_witnessed;
  // The ceiling the witness measured itself, where it measures this test's (same name).
  std::optional<double> witnessed_ceiling;
};

struct TestOutcome {
  std::string name;
  double points = 0, max_points = 0;
  bool bonus = false;   // its points come on top of the module's max_points
  std::string status;   // passed | failed | not implemented | skipped | did not run | not run
                        // | withheld (a performance test's points, see withhold_performance)
  std::string message;  // first lines of the failure, or the skip reason
  std::optional<PerfOutcome> perf;
  // A correctness test the rubric has the grader check again itself (k2c_witness --shapes): what
  // that check found, "" when there was none.
  std::string rechecked;
};

struct ModuleOutcome {
  std::string id, title;
  std::string status;   // ok | partial | failed | not implemented yet | skipped | build failed
                        // | crashed | timed out | no report | incomplete | invalid | refused
  std::string detail;   // one-line reason for a status that costs the module its points
  double points = 0, max_points = 0;
  std::vector<TestOutcome> tests;
  std::string log;      // captured output (bounded), for the JSON report
  double seconds = 0;
};

struct GradeReport {
  std::string impl;
  std::uint64_t seed = 0;
  std::string gpu = "none";
  std::string gpu_reason;
  std::string cuda_runtime;
  std::string reference_file;  // the reference timings shown, "" if none matches the GPU
  std::string runner;          // who ran the code under test, and why that user
  std::string temp_folders;    // whether its runs had /tmp, /var/tmp and /dev/shm of their own, or why not
  std::string processes;       // whether its runs had processes of their own (PID and IPC namespaces), or why not
  std::string network;         // whether its runs had a network of their own (loopback alone), or why not
  bool sanitize = false;
  std::vector<ModuleOutcome> modules;
  std::map<std::string, std::pair<double, std::string>> ceilings;  // name -> (value, unit)
  double points() const;
  double max_points() const;
};

// Grades the selected modules; progress goes to `progress`. Throws on errors of the grader's
// own input (bad rubric, unknown module, unusable submission directory).
GradeReport grade(const GradeOptions& options, std::ostream& progress);

// The verdict for one module from its child's exit and its GoogleTest JSON (empty if absent).
// gpu_here is the grader's own finding (nvidia_device_present): without a device, a report of a
// GPU or MPI module that carries performance figures (all measured on a GPU) cannot have come from
// the course's harness, and voids the module; so does a pass of a test that needs a device
// ("device"). nccl_run: the run was on the NCCL backend (false: an MPI run of a distributed
// module, whose report cannot pass a test that runs on NCCL only, "nccl").
ModuleOutcome evaluate_module(const ModuleSpec& module, const ProcessResult& run,
                              const std::string& gtest_json, const std::string& impl,
                              double timeout_s, bool gpu_here = true, bool nccl_run = true);

// Whether this machine has an NVIDIA device node (/dev/nvidia0, ..., or WSL's /dev/dxg), read by
// the grader itself: code under test, run as another user, cannot add one.
bool nvidia_device_present();

// A distributed module's verdict from its runs (label, verdict of that run), in rubric order:
// a run that crashed, hung or lost its report voids the module; a test fails if it failed in any
// run and passes if it passed in one and was skipped (e.g. no GPUs for the NCCL run) elsewhere.
ModuleOutcome combine_runs(const ModuleSpec& spec,
                           const std::vector<std::pair<std::string, ModuleOutcome>>& runs);

// A module with bonus tests runs them in a second process, so that an attempted bonus part that
// hangs or crashes costs only the bonus. The two specs split the rubric's tests; merge_bonus
// puts the verdicts back together in rubric order: a failed main run decides the module, a
// failed bonus run fails the bonus tests (naming why) and keeps the main run's points.
ModuleSpec main_part(const ModuleSpec& spec);
ModuleSpec bonus_part(const ModuleSpec& spec);
ModuleOutcome merge_bonus(const ModuleSpec& spec, const ModuleOutcome& main, const ModuleOutcome& bonus);

// Whether a run's verdict voids its module (crashed, timed out, no report, incomplete, invalid).
bool voids_module(const ModuleOutcome& m);

// A module's runs (the rank counts and backends of a distributed module; the main and bonus
// runs of a module with bonus tests), launched in order until one voids the module. The rest
// are not launched — their verdicts could not change the module's — and come back with status
// "not run" naming the run that failed, so a faulty submission costs one time limit, not one
// per run.
std::vector<std::pair<std::string, ModuleOutcome>> run_until_void(
    const std::vector<std::string>& labels, const std::function<ModuleOutcome(std::size_t)>& launch);

// The reason of a failed build: the undefined symbols of a failed link on the first line (the
// mark of a call into a library the module does not link), then the compiler's first errors.
std::string build_failure_detail(const std::string& log);

// Performance tests that passed lose their points, with `reason` (status "withheld"), and the
// module says why; correctness points stay. For an implementation whose speed may be borrowed.
void withhold_performance(ModuleOutcome& m, const ModuleSpec& spec, const std::string& reason);

// What the grader's own run of a timed kernel saw: k2c_witness's verdict file (see
// autograder/witness/witness.cu). fault: "" when it judged the kernel (rate in unit), "grader"
// when it could not set the run up, "submission" when the test program's part failed.
struct WitnessVerdict {
  std::string fault, problem, unit;
  double rate = 0;
  // The ceiling the checker measured with the course's own code before the test program started
  // (0: it measured none), in `unit`, under the rubric's name for it.
  double ceiling = 0;
  std::string ceiling_name;
  int shapes = 0;      // a correctness run (--shapes): the shapes it checked
  std::string output;  // the end of what the test program printed, when it was at fault
};
// The earlier modules whose implementations module `m` links (the rubric's build "uses", and
// theirs in turn), each once, nearest first.
std::vector<const ModuleSpec*> used_modules(const Rubric& rubric, const ModuleSpec& m);
// `selected` and every module they use: what a grading takes from a submission (the capstone is
// built with the student's own data, tensor, pipeline and expert parallelism, not the stubs).
std::vector<const ModuleSpec*> with_used_modules(const Rubric& rubric, const std::vector<const ModuleSpec*>& selected);
// Where the headers that module m's implementation compiles from may lie, in the staging tree
// `staged`: the harness's public headers, and the folders of m and of every module it uses
// (whose contract headers the capstone includes), under assignments/ and under `impl`.
std::vector<std::string> readable_include_dirs(const Rubric& rubric, const ModuleSpec& m, const std::string& staged,
                                               const std::string& impl);

// What keeps the runner from compiling a submission's files, which it does only where it can
// read the staged tree and run the compilers: the first folder of the tree at `root` (or on the
// way to it) that others may not search, or file they may not read; the first compiler of the
// build tree's cache (C++, CUDA, CUDA's host compiler) they may not run. "" where there is none.
std::string hidden_from_others(const std::filesystem::path& root);
std::string compilers_out_of_reach(const std::filesystem::path& build);

WitnessVerdict read_witness_verdict(const std::string& json_text);

// How much faster than the witness a test's own figure may be: the witness times whole windows on
// the host's clock (the socket's round trip, launch gaps) where the test times each launch with
// events, so an honest figure is at or a little above the witness's; a forged one is far above.
inline constexpr double kWitnessSlack = 0.15;

// Applies the verdict on test `test` of module m: wrong outputs, a failed run, a reported figure
// faster than kWitnessSlack over the witness, or a reported ceiling more than kWitnessSlack below
// the one the witness measured (where it measured the test's) void the module ("invalid"); a
// grader-side failure only notes that the figure was not witnessed.
void apply_witness(ModuleOutcome& m, const std::string& test, const WitnessVerdict& v);

// How many shapes the grader draws to check a correctness test again (k2c_witness --shapes).
inline constexpr int kRecheckShapes = 3;

// Applies the verdict of a correctness run on test `test`: wrong outputs or a failed run fail the
// test (with the shape and the first wrong element), as a test that drew that shape would have;
// a grader-side failure only notes that the test was not checked again.
void apply_recheck(ModuleOutcome& m, const std::string& test, const WitnessVerdict& v);

// Reference ratios: <dir>/*.json whose "gpu" equals the device name. Empty object if none.
nlohmann::json find_reference(const std::string& dir, const std::string& gpu, std::string* file);

// The line `k2c grade` prints as a module ends: its status, the first line of its detail when it
// is not ok, and its points. It names no skipped test (the detail counts them, and the table
// names each once).
std::string progress_line(const std::string& tag, const ModuleOutcome& m);

void print_table(const GradeReport& report, std::ostream& out);
nlohmann::json to_json(const GradeReport& report);
nlohmann::json to_gradescope(const GradeReport& report);
nlohmann::json to_reference(const GradeReport& report, const std::string& toolkit);

}  // namespace k2c::grader
