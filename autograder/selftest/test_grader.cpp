// test_grader.cpp — the project's own tests of the k2c grader. CPU only.
//
// Verdicts:   evaluate_module on hand-made exits and reports (no processes involved), and how
//             the table shows them.
// End to end: `k2c grade` on autograder/selftest/fake_course, whose modules crash, hang, exit
//             early, miss a test, claim an impossible figure, print 50 MiB, hit a sticky device
//             error, are stubs, or do not compile; each must cost its own module only.
// Intake:     a submission with a symlink (of the file or of a folder on its way), an unlisted
//             file and an oversized file; the staging folder lies outside the course tree.
// Hostile:    `k2c grade --submission` on the fake course's modules 79 and 90-99 (submission_rubric.json)
//             with submissions that link to the solutions, include them, dlopen a library,
//             rewrite the rubric, call cuBLAS, or hang: each earns no more than honest work.
// Trust:      the parts those verdicts rest on, each alone: dependency records of both CMake
//             generators, the include policy, the ELF reader, the course fingerprint, runs that
//             stop at the first fault, link errors and failing ranks named.
// CLI:        a malformed rubric and an unknown module are clear errors (exit status 2).
// docs/SECURITY.md maps each attack and fault to what stops it and to the test here that proves it.
#include <arpa/inet.h>
#include <grp.h>
#include <pwd.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "grade.h"
#include "intake.h"
#include "k2c/core/rubric.h"
#include "k2c/core/todo.h"
#include "process.h"
#include "run_log.h"

namespace fs = std::filesystem;
using nlohmann::json;
using k2c::grader::evaluate_module;
using k2c::grader::ProcessResult;

namespace {

const fs::path kFake = fs::path(K2C_SELFTEST_DIR) / "fake_course";
const fs::path kTmp = K2C_SELFTEST_TMP;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

k2c::ModuleSpec two_test_module() {
  return k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "50_demo", "title": "demo", "kind": "gpu", "timeout_s": 9, "files": [],
     "tests": [{"name": "A.Correct", "points": 6},
               {"name": "APerf.Rate", "points": 4, "perf": {"ceiling": "copy", "unit": "GB/s",
                 "threshold": 0.5, "goal": 0.9, "max_ratio": 1.1}}]}]})").modules[0];
}

std::string gtest_report(const std::string& correct_result, const std::string& perf_fields,
                         const std::string& failure = "") {
  const std::string failures = failure.empty() ? "" : R"(, "failures": [{"failure": ")" + failure + R"(", "type": ""}])";
  return R"({"k2c_gpu": "Fake GPU", "testsuites": [
    {"name": "A", "testsuite": [{"name": "Correct", "status": "RUN", "result": ")" + correct_result + "\"" + failures + R"(}]},
    {"name": "APerf", "testsuite": [{"name": "Rate", "status": "RUN", "result": "COMPLETED")" + perf_fields + "}]}]}";
}

ProcessResult exited(int code) {
  ProcessResult r;
  r.started = true;
  r.exit_code = code;
  return r;
}

}  // namespace

// ------------------------------------------------------------------------------- verdicts ---

TEST(Verdict, FullMarks) {
  const auto m = evaluate_module(two_test_module(), exited(0),
                                 gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")"),
                                 "solutions", 9);
  EXPECT_EQ(m.status, "ok");
  EXPECT_EQ(m.points, 10);
  ASSERT_TRUE(m.tests[1].perf);
  EXPECT_DOUBLE_EQ(m.tests[1].perf->ratio, 0.95);
  EXPECT_DOUBLE_EQ(m.tests[1].perf->required, 0.9);  // the goal, for the solutions
}

TEST(Verdict, BarDependsOnTree) {
  const std::string report = gtest_report("COMPLETED", R"(, "k2c_achieved": "60", "k2c_ceiling": "100")");
  EXPECT_EQ(evaluate_module(two_test_module(), exited(0), report, "assignments", 9).points, 10);
  // The grader re-checks the figure itself: 0.6 is below the solutions' goal of 0.9.
  const auto m = evaluate_module(two_test_module(), exited(0), report, "solutions", 9);
  EXPECT_EQ(m.points, 6);
  EXPECT_EQ(m.status, "partial");
}

// GoogleTest's JSON report escapes "³" (UTF-8 C2 B3) as two code points, \u00c2\u00b3: the
// message the student reads is the one the test printed, and code points past 255 stay as they are.
TEST(Verdict, FailureMessagesKeepTheirCharacters) {
  const auto m = evaluate_module(two_test_module(), exited(0),
                                 gtest_report("COMPLETED", "", R"(too slow at 8192\u00c2\u00b3 \u00e2\u0089\u00a4 0.3)"),
                                 "assignments", 9);
  ASSERT_EQ(m.tests.size(), 2u);
  EXPECT_NE(m.tests[0].message.find("too slow at 8192\u00b3 \u2264 0.3"), std::string::npos) << m.tests[0].message;
  const auto kept = evaluate_module(two_test_module(), exited(0), gtest_report("COMPLETED", "", R"(8192\u00b3 \u2264)"),
                                    "assignments", 9);
  EXPECT_NE(kept.tests[0].message.find("8192\u00b3 \u2264"), std::string::npos) << kept.tests[0].message;
}

TEST(Verdict, ImpossibleFigureVoidsModule) {
  const auto m = evaluate_module(two_test_module(), exited(0),
                                 gtest_report("COMPLETED", R"(, "k2c_achieved": "300", "k2c_ceiling": "100")"),
                                 "assignments", 9);
  EXPECT_EQ(m.status, "invalid");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.detail.find("impossible"), std::string::npos);
}

// A report that claims a GPU module's speed on a machine with no NVIDIA device was written by
// something other than the harness (the code under test, say, from a static destructor): void.
TEST(Verdict, GpuFiguresWithoutAGpuVoidTheModule) {
  const std::string report = gtest_report("COMPLETED", R"(, "k2c_achieved": "80", "k2c_ceiling": "100")");
  const auto forged = evaluate_module(two_test_module(), exited(0), report, "assignments", 9, /*gpu_here=*/false);
  EXPECT_EQ(forged.status, "invalid");
  EXPECT_EQ(forged.points, 0);
  EXPECT_NE(forged.detail.find("APerf.Rate: performance figures of a GPU run, on a machine with no NVIDIA device"),
            std::string::npos) << forged.detail;
  EXPECT_EQ(evaluate_module(two_test_module(), exited(0), report, "assignments", 9, true).points, 10);
  // Skipped for want of a GPU, as the harness reports it there: nothing to void.
  const auto honest = evaluate_module(two_test_module(), exited(0), gtest_report("COMPLETED", ""), "assignments", 9, false);
  EXPECT_NE(honest.status, "invalid");
  // So does an MPI module's (its figures come from its NCCL run); a CPU module's are measured
  // without a GPU.
  k2c::ModuleSpec mpi = two_test_module();
  mpi.kind = "mpi";
  EXPECT_EQ(evaluate_module(mpi, exited(0), report, "assignments", 9, false).status, "invalid");
  k2c::ModuleSpec cpu = two_test_module();
  cpu.kind = "cpu";
  EXPECT_EQ(evaluate_module(cpu, exited(0), report, "assignments", 9, false).points, 10);
}

// A correctness test that needs a device ("device": true) reported passed on a machine with none:
// the harness skips it there, so the report was forged, figures or not. A test without the flag
// (an argument check, which runs anywhere) passes as ever.
TEST(Verdict, DeviceTestsPassedWithoutAGpuVoidTheModule) {
  k2c::ModuleSpec spec = two_test_module();
  spec.tests[0].device = true;
  const std::string report = gtest_report("COMPLETED", "");  // the performance test without figures
  const auto forged = evaluate_module(spec, exited(0), report, "assignments", 9, /*gpu_here=*/false);
  EXPECT_EQ(forged.status, "invalid");
  EXPECT_EQ(forged.points, 0);
  EXPECT_NE(forged.detail.find("A.Correct: reported passed on a machine with no NVIDIA device"), std::string::npos)
      << forged.detail;
  EXPECT_EQ(evaluate_module(spec, exited(0), report, "assignments", 9, true).points, 6);
  EXPECT_EQ(evaluate_module(two_test_module(), exited(0), report, "assignments", 9, false).points, 6);
  std::string skipped = report;
  skipped.replace(skipped.find("\"COMPLETED\""), 11, "\"SKIPPED\"");
  EXPECT_NE(evaluate_module(spec, exited(0), skipped, "assignments", 9, false).status, "invalid");
}

// A test that runs on NCCL only ("nccl": true) reported passed by a run on the MPI backend, where
// the harness skips it: forged, whatever devices the machine has. On an NCCL run it stands.
TEST(Verdict, NcclTestsPassedInAnMpiRunVoidTheModule) {
  k2c::ModuleSpec spec = two_test_module();
  spec.kind = "mpi";
  spec.tests[0].device = spec.tests[0].nccl = true;
  const std::string report = gtest_report("COMPLETED", "");
  const auto forged = evaluate_module(spec, exited(0), report, "assignments", 9, /*gpu_here=*/true, /*nccl_run=*/false);
  EXPECT_EQ(forged.status, "invalid");
  EXPECT_NE(forged.detail.find("A.Correct: reported passed by a run on the MPI backend"), std::string::npos)
      << forged.detail;
  EXPECT_EQ(evaluate_module(spec, exited(0), report, "assignments", 9, true, true).points, 6);
  const std::string rubric = R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "50_demo", "title": "demo", "kind": "mpi", "timeout_s": 9, "files": [], "runs": [{"ranks": 1, "backend": "mpi"}],
     "tests": [{"name": "A.Correct", "points": 6, "device": true, "nccl": true}]}]})";
  EXPECT_TRUE(k2c::parse_rubric(rubric).modules[0].tests[0].nccl);
  std::string without_device = rubric;
  without_device.erase(without_device.find(R"("device": true, )"), 16);
  EXPECT_THROW(k2c::parse_rubric(without_device), std::exception) << "\"nccl\" without \"device\"";
}

TEST(Verdict, PerfTestWithoutFiguresEarnsNothing) {
  const auto m = evaluate_module(two_test_module(), exited(0), gtest_report("COMPLETED", ""), "assignments", 9);
  EXPECT_EQ(m.points, 6);
  EXPECT_EQ(m.tests[1].status, "failed");
}

TEST(Verdict, NotImplemented) {
  // The stub's K2C_TODO, compiled from a staging copy: the detail says where to start, from
  // assignments/ on.
  const std::string todo = std::string(k2c::kNotImplementedMarker) +
                           " write it (/tmp/k2c-0/b/staged/assignments/01_naive_matmul/naive_matmul.cu:42)";
  const auto m = evaluate_module(two_test_module(), exited(1),
                                 gtest_report("COMPLETED", R"(, "failures": [{"failure": ")" + todo + R"("}])", todo),
                                 "assignments", 9);
  EXPECT_EQ(m.status, "not implemented yet");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.detail.find("start at assignments/01_naive_matmul/naive_matmul.cu:42"), std::string::npos) << m.detail;
}

TEST(Verdict, SkippedWithoutDevice) {
  std::string report = gtest_report("SKIPPED", "");
  report.replace(report.find("\"COMPLETED\""), 11, "\"SKIPPED\"");
  report.insert(1, R"("k2c_gpu_reason": "no NVIDIA driver", )");
  const auto m = evaluate_module(two_test_module(), exited(0), report, "assignments", 9);
  EXPECT_EQ(m.status, "skipped");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.tests[0].message.find("no NVIDIA driver"), std::string::npos);
}

// A bonus test adds to the points but not to max_points; left unwritten (or unable to run
// here) it does not make the module partial.
TEST(Verdict, BonusPoints) {
  const auto spec = k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "50_demo", "title": "demo", "kind": "gpu", "timeout_s": 9, "files": [],
     "tests": [{"name": "A.Correct", "points": 6},
               {"name": "APerf.Rate", "points": 4, "bonus": true}]}]})").modules[0];
  EXPECT_EQ(spec.points(), 6);
  EXPECT_EQ(spec.bonus_points(), 4);
  const auto full = evaluate_module(spec, exited(0), gtest_report("COMPLETED", ""), "assignments", 9);
  EXPECT_EQ(full.status, "ok");
  EXPECT_EQ(full.points, 10);
  EXPECT_EQ(full.max_points, 6);
  const std::string marker = k2c::kNotImplementedMarker;
  std::string stub = gtest_report("COMPLETED", R"(, "failures": [{"failure": ")" + marker + R"( part B"}])");
  const auto without = evaluate_module(spec, exited(1), stub, "assignments", 9);
  EXPECT_EQ(without.status, "ok");
  EXPECT_EQ(without.points, 6);
  EXPECT_THROW(k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "50_demo", "title": "demo", "kind": "gpu", "timeout_s": 9, "files": [],
     "tests": [{"name": "A.Correct", "points": 6, "bonus": "yes"}]}]})"), k2c::RubricError);
}

// The bonus tests run in a process of their own: one that hangs fails the bonus tests only.
TEST(Verdict, BonusRunThatHangsCostsOnlyTheBonus) {
  const auto spec = k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "50_demo", "title": "demo", "kind": "gpu", "timeout_s": 9, "files": [],
     "tests": [{"name": "A.Correct", "points": 6},
               {"name": "APerf.Rate", "points": 4, "bonus": true}]}]})").modules[0];
  const auto main = k2c::grader::main_part(spec), bonus = k2c::grader::bonus_part(spec);
  ASSERT_EQ(main.tests.size(), 1u);
  ASSERT_EQ(bonus.tests.size(), 1u);
  const std::string report = R"({"testsuites": [{"name": "A", "testsuite": [{"name": "Correct", "status": "RUN", "result": "COMPLETED"}]},
    {"name": "APerf", "testsuite": [{"name": "Rate", "status": "RUN", "result": "COMPLETED"}]}]})";
  const auto main_out = evaluate_module(main, exited(0), report, "assignments", 9);
  ProcessResult hang = exited(-1);
  hang.timed_out = true;
  const auto bonus_out = evaluate_module(bonus, hang, "", "assignments", 9);
  EXPECT_EQ(bonus_out.status, "timed out");
  const auto m = k2c::grader::merge_bonus(spec, main_out, bonus_out);
  EXPECT_EQ(m.points, 6);
  EXPECT_EQ(m.max_points, 6);
  ASSERT_EQ(m.tests.size(), 2u);
  EXPECT_EQ(m.tests[0].status, "passed");
  EXPECT_EQ(m.tests[1].status, "failed");
  EXPECT_NE(m.tests[1].message.find("timed out"), std::string::npos);
  // Both runs fine: the bonus adds its points.
  const auto both = k2c::grader::merge_bonus(spec, main_out, evaluate_module(bonus, exited(0), report, "assignments", 9));
  EXPECT_EQ(both.points, 10);
  EXPECT_EQ(both.status, "ok");
}

TEST(Verdict, ProcessFailures) {
  const k2c::ModuleSpec spec = two_test_module();
  const std::string good = gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")");
  ProcessResult hang = exited(-1);
  hang.timed_out = true;
  EXPECT_EQ(evaluate_module(spec, hang, "", "assignments", 9).status, "timed out");
  ProcessResult segv = exited(-1);
  segv.signal = 11;
  EXPECT_EQ(evaluate_module(spec, segv, good, "assignments", 9).status, "crashed");
  EXPECT_EQ(evaluate_module(spec, exited(0), "", "assignments", 9).status, "no report");
  EXPECT_EQ(evaluate_module(spec, exited(0), "{not json", "assignments", 9).status, "no report");
  EXPECT_EQ(evaluate_module(spec, exited(86), good, "assignments", 9).status, "crashed");
  ProcessResult sticky = exited(3);
  sticky.output = "K2C_FATAL: sticky CUDA error after A.Correct: illegal address\n";
  const auto m = evaluate_module(spec, sticky, "", "assignments", 9);
  EXPECT_EQ(m.status, "crashed");
  EXPECT_NE(m.detail.find("illegal address"), std::string::npos);
}

TEST(Verdict, CombinedRunsOfADistributedModule) {
  const k2c::ModuleSpec spec = two_test_module();
  const std::string good = gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")");
  std::string skipped = gtest_report("SKIPPED", "");
  skipped.replace(skipped.find("\"COMPLETED\""), 11, "\"SKIPPED\"");
  const auto ok = evaluate_module(spec, exited(0), good, "solutions", 9);
  const auto skip = evaluate_module(spec, exited(0), skipped, "solutions", 9);
  // Passed on one run, skipped on another (no GPUs for the NCCL run): full points.
  auto m = k2c::grader::combine_runs(spec, {{"mpi x2", ok}, {"nccl x2", skip}});
  EXPECT_EQ(m.status, "ok");
  EXPECT_EQ(m.points, 10);
  // Failed on one run: that test earns nothing, whatever the others say.
  const auto bad = evaluate_module(spec, exited(1), gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")", "wrong sum"), "solutions", 9);
  m = k2c::grader::combine_runs(spec, {{"mpi x1", ok}, {"mpi x3", bad}});
  EXPECT_EQ(m.points, 4);
  EXPECT_NE(m.tests[0].message.find("mpi x3"), std::string::npos);
  // A crash in any run voids the module, named.
  ProcessResult segv = exited(-1);
  segv.signal = 11;
  m = k2c::grader::combine_runs(spec, {{"mpi x1", ok}, {"mpi x4", evaluate_module(spec, segv, "", "solutions", 9)}});
  EXPECT_EQ(m.status, "crashed");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.detail.find("mpi x4"), std::string::npos);
}

// The human report (the progress line and the table) names each skipped test once, whether the
// module ran once or on several ranks' runs: a performance test in its column, the others in
// one list; the reasons stay in the detail, and the JSON keeps every test with its reason.
TEST(Verdict, EachSkippedTestIsNamedOnce) {
  const auto spec = k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "50_demo", "title": "demo", "kind": "mpi", "timeout_s": 9, "files": [],
     "runs": [{"backend": "mpi", "ranks": 2}, {"backend": "nccl", "ranks": 2}],
     "tests": [{"name": "A.Correct", "points": 6}, {"name": "A.OnGpus", "points": 2},
               {"name": "APerf.Rate", "points": 4, "perf": {"ceiling": "copy", "unit": "GB/s",
                 "threshold": 0.5, "goal": 0.9, "max_ratio": 1.1}}]}]})").modules[0];
  const std::string report = R"({"testsuites": [{"name": "A", "testsuite": [
    {"name": "Correct", "status": "RUN", "result": "COMPLETED"},
    {"name": "OnGpus", "status": "RUN", "result": "SKIPPED", "k2c_skip": "needs 2 GPUs"}]},
    {"name": "APerf", "testsuite": [
    {"name": "Rate", "status": "RUN", "result": "SKIPPED", "k2c_skip": "timed on NCCL only"}]}]})";
  const auto once = evaluate_module(spec, exited(0), report, "solutions", 9);
  const auto combined = k2c::grader::combine_runs(spec, {{"mpi x2", once}, {"nccl x2", once}});
  for (const auto& m : {once, combined}) {
    EXPECT_EQ(m.status, "partial");
    k2c::grader::GradeReport r;
    r.modules.push_back(m);
    std::ostringstream table;
    k2c::grader::print_table(r, table);
    const std::string human = k2c::grader::progress_line("[1/1] 50_demo", m) + "\n" + table.str();
    for (const std::string name : {"A.OnGpus", "APerf.Rate"}) {
      std::size_t count = 0;
      for (auto at = human.find(name); at != std::string::npos; at = human.find(name, at + 1)) ++count;
      EXPECT_EQ(count, 1u) << name << " in:\n" << human;
    }
    EXPECT_NE(human.find("needs 2 GPUs"), std::string::npos) << human;
    EXPECT_NE(human.find("timed on NCCL only"), std::string::npos) << human;
    const json tests = k2c::grader::to_json(r)["modules"][0]["tests"];
    ASSERT_EQ(tests.size(), 3u);
    EXPECT_EQ(tests[1]["status"], "skipped");
    EXPECT_EQ(tests[1]["message"], "needs 2 GPUs");
    EXPECT_EQ(tests[2]["status"], "skipped");
    EXPECT_EQ(tests[2]["message"], "timed on NCCL only");
  }
}

// A run that voids the module ends its runs: the rest are not launched (a hang would cost one
// time limit each) and are named as not run.
TEST(Verdict, RunsStopAtTheFirstFault) {
  const k2c::ModuleSpec spec = two_test_module();
  const std::string good = gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")");
  ProcessResult hang = exited(-1);
  hang.timed_out = true;
  int launched = 0;
  const auto runs = k2c::grader::run_until_void({"mpi x1", "mpi x2", "nccl x2"}, [&](std::size_t i) {
    ++launched;
    return i == 0 ? evaluate_module(spec, hang, "", "solutions", 9) : evaluate_module(spec, exited(0), good, "solutions", 9);
  });
  EXPECT_EQ(launched, 1);
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[2].second.status, "not run");
  const auto m = k2c::grader::combine_runs(spec, runs);
  EXPECT_EQ(m.status, "timed out");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.detail.find("not run: mpi x2, nccl x2 (after the mpi x1 run timed out)"), std::string::npos) << m.detail;
  // Runs that go well are all launched.
  launched = 0;
  k2c::grader::run_until_void({"a", "b"}, [&](std::size_t) {
    ++launched;
    return evaluate_module(spec, exited(0), good, "solutions", 9);
  });
  EXPECT_EQ(launched, 2);

  // A main run that crashes spares the bonus run; its tests are listed as not run.
  const auto bonus_spec = k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "50_demo", "title": "demo", "kind": "gpu", "timeout_s": 9, "files": [],
     "tests": [{"name": "A.Correct", "points": 6}, {"name": "APerf.Rate", "points": 4, "bonus": true}]}]})").modules[0];
  ProcessResult segv = exited(-1);
  segv.signal = 11;
  launched = 0;
  const auto parts = k2c::grader::run_until_void({"main", "bonus"}, [&](std::size_t) {
    ++launched;
    return evaluate_module(k2c::grader::main_part(bonus_spec), segv, "", "assignments", 9);
  });
  EXPECT_EQ(launched, 1);
  const auto merged = k2c::grader::merge_bonus(bonus_spec, parts[0].second, parts[1].second);
  EXPECT_EQ(merged.status, "crashed");
  ASSERT_EQ(merged.tests.size(), 1u);
  EXPECT_EQ(merged.tests[0].status, "not run");
  EXPECT_NE(merged.detail.find("bonus tests not run (the main run crashed)"), std::string::npos) << merged.detail;
}

// The one line a failed link shows names what could not be found: usually a library the module
// does not link.
TEST(Verdict, LinkErrorNamesTheUndefinedSymbol) {
  const std::string gnu =
      "FAILED: lib/libk2c_impl_01_naive_matmul.so\n"
      "/usr/bin/ld: CMakeFiles/k2c_impl_01.dir/naive_matmul.cu.o: in function `k2c::naive_matmul::sgemm(int)':\n"
      "tmpxft_0001_naive_matmul.cudafe1.cpp:(.text+0x4a): undefined reference to `cublasSgemm_v2'\n"
      "/usr/bin/ld: naive_matmul.cu:(.text+0x9c): undefined reference to `cublasSgemm_v2'\n"
      "/usr/bin/ld: naive_matmul.cu:(.text+0xa0): undefined reference to `cublasCreate_v2'\n"
      "collect2: error: ld returned 1 exit status\n";
  const std::string detail = k2c::grader::build_failure_detail(gnu);
  EXPECT_EQ(detail.substr(0, detail.find('\n')), "link failed: undefined symbols cublasSgemm_v2, cublasCreate_v2");
  EXPECT_NE(detail.find("collect2: error"), std::string::npos);
  const std::string lld = "ld.lld: error: undefined symbol: cublasLtMatmul\n>>> referenced by x.cu\n";
  EXPECT_EQ(k2c::grader::build_failure_detail(lld).substr(0, 47), "link failed: undefined symbol cublasLtMatmul\nld");
  // A compile error keeps the compiler's own words.
  EXPECT_EQ(k2c::grader::build_failure_detail("x.cu(3): error: identifier \"y\" is undefined\n"),
            "x.cu(3): error: identifier \"y\" is undefined");
}

// A distributed failure names the rank and its message, from the job's log.
TEST(Verdict, DistributedFailureNamesTheRank) {
  const k2c::ModuleSpec spec = two_test_module();
  // A rank threw: the runtime printed "rank r: message" and aborted the job, before any report.
  ProcessResult aborted = exited(1);
  aborted.output = "[ RUN      ] A.Correct\nrank 2: all_reduce: 7 elements, expected 8\n"
                   "--------------------------------------------------------------------------\n"
                   "MPI_ABORT was invoked on rank 2 in communicator MPI_COMM_WORLD\n";
  const auto m = evaluate_module(spec, aborted, "", "solutions", 9);
  EXPECT_EQ(m.status, "no report");
  EXPECT_NE(m.detail.find("; rank 2: all_reduce: 7 elements, expected 8"), std::string::npos) << m.detail;
  EXPECT_EQ(m.detail.find("-----"), std::string::npos) << m.detail;
  // An assertion failed on rank 3: rank 0's report only says "failed on another rank", and so
  // does rank 1's echo; the test's message names rank 3 and what it saw.
  ProcessResult failed = exited(1);
  failed.output = "rank 1: /src/test_x.cpp:40: Failed\nfailed on another rank (see that rank's output)\n\n"
                  "rank 3: /src/test_x.cpp:52: Expected equality of these values:\n  got\n    Which is: 5\n"
                  "  want\n    Which is: 6\n[  FAILED  ] A.Correct (3 ms)\n";
  const auto f = evaluate_module(spec, failed,
                                 gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")",
                                              "Failed\\nfailed on another rank (see that rank's output)"),
                                 "solutions", 9);
  EXPECT_EQ(f.tests[0].status, "failed");
  EXPECT_NE(f.tests[0].message.find("rank 3: /src/test_x.cpp:52: Expected equality of these values: / got / Which is: 5 / want"),
            std::string::npos) << f.tests[0].message;
}

TEST(Verdict, WithheldPerformanceKeepsCorrectness) {
  const k2c::ModuleSpec spec = two_test_module();
  auto m = evaluate_module(spec, exited(0), gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")"),
                           "assignments", 9);
  ASSERT_EQ(m.points, 10);
  k2c::grader::withhold_performance(m, spec, "the implementation loads libraries at run time (dlopen)");
  EXPECT_EQ(m.points, 6);
  EXPECT_EQ(m.status, "partial");
  EXPECT_EQ(m.tests[0].status, "passed");
  EXPECT_EQ(m.tests[1].status, "withheld");
  EXPECT_NE(m.detail.find("performance points withheld: the implementation loads libraries at run time (dlopen)"),
            std::string::npos) << m.detail;
}

// The grader's own run of a timed kernel (k2c_witness) judges the report of the test program, which
// holds the student's code: outputs it found wrong, a run that failed once the test program had
// started, or a reported figure faster than the witness saw (beyond kWitnessSlack) void the module;
// a witness that could not be set up on this machine leaves the figure as it was, noted.
TEST(Verdict, TheWitnessJudgesTheReport) {
  using k2c::grader::apply_witness;
  using k2c::grader::read_witness_verdict;
  const k2c::ModuleSpec spec = two_test_module();
  const auto reported = [&] {  // 95 GB/s of a 100 GB/s ceiling: 10 points
    return evaluate_module(spec, exited(0), gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")"),
                           "assignments", 9);
  };

  auto m = reported();
  apply_witness(m, "APerf.Rate", read_witness_verdict(R"({"fault": "", "unit": "GB/s", "rate": 90})"));
  EXPECT_EQ(m.points, 10) << m.detail;
  ASSERT_TRUE(m.tests[1].perf->witnessed.has_value());
  EXPECT_EQ(*m.tests[1].perf->witnessed, 90);

  m = reported();  // 95 against 60 seen: forged
  apply_witness(m, "APerf.Rate", read_witness_verdict(R"({"fault": "", "unit": "GB/s", "rate": 60})"));
  EXPECT_EQ(m.status, "invalid");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.detail.find("APerf.Rate: the report says 95 GB/s, the grader's own run of the same kernel reached at most 60"),
            std::string::npos) << m.detail;

  m = reported();  // right at the slack: still honest
  apply_witness(m, "APerf.Rate", read_witness_verdict(R"({"fault": "", "unit": "GB/s", "rate": 83})"));
  EXPECT_EQ(m.points, 10) << m.detail;

  m = reported();
  apply_witness(m, "APerf.Rate",
                read_witness_verdict(R"({"fault": "submission", "problem": "window 1, launch 3 of 16: row 7: bad"})"));
  EXPECT_EQ(m.status, "invalid");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.detail.find("own run of the timed kernel failed: window 1, launch 3 of 16: row 7"), std::string::npos);

  for (const std::string grader_side : {R"({"fault": "grader", "problem": "cuMemCreate failed, CUDA driver error 801"})",
                                        R"({"fault": "", "unit": "TFLOP/s", "rate": 500})", "", "{not json"}) {
    m = reported();
    apply_witness(m, "APerf.Rate", read_witness_verdict(grader_side));
    EXPECT_EQ(m.points, 10) << grader_side;
    EXPECT_FALSE(m.tests[1].perf->witnessed.has_value());
    EXPECT_FALSE(m.tests[1].perf->not_witnessed.empty()) << grader_side;
  }
  // A rate that is not a number is no verdict either.
  EXPECT_EQ(read_witness_verdict(R"({"fault": "", "unit": "GB/s", "rate": 0})").fault, "grader");

  // The ceiling: an honest rate over a lowered ceiling is as forged as a raised rate.
  m = reported();  // 100 reported, 110 measured by the grader: within the slack
  apply_witness(m, "APerf.Rate",
                read_witness_verdict(R"({"fault": "", "unit": "GB/s", "rate": 90, "ceiling": 110, "ceiling_name": "copy"})"));
  EXPECT_EQ(m.points, 10) << m.detail;
  ASSERT_TRUE(m.tests[1].perf->witnessed_ceiling.has_value());
  EXPECT_EQ(*m.tests[1].perf->witnessed_ceiling, 110);
  // 100 reported, 200 measured (the report halved it, or the test's GPU had slowed down): the
  // ratio is taken against the grader's ceiling, 95 / 200, below the bar of 0.5.
  m = reported();
  apply_witness(m, "APerf.Rate",
                read_witness_verdict(R"({"fault": "", "unit": "GB/s", "rate": 90, "ceiling": 200, "ceiling_name": "copy"})"));
  EXPECT_EQ(m.status, "partial");
  EXPECT_EQ(m.points, 6);
  EXPECT_EQ(m.tests[1].status, "failed");
  EXPECT_DOUBLE_EQ(m.tests[1].perf->ratio, 0.475);
  EXPECT_NE(m.tests[1].message.find("below the bar, taken against the grader's own measurement of copy, 200 GB/s "
                                    "(the report's: 100)"), std::string::npos) << m.tests[1].message;
  m = reported();  // 100 reported, 150 measured: 95 / 150 still clears the bar, at its own ratio
  apply_witness(m, "APerf.Rate",
                read_witness_verdict(R"({"fault": "", "unit": "GB/s", "rate": 90, "ceiling": 150, "ceiling_name": "copy"})"));
  EXPECT_EQ(m.points, 10);
  EXPECT_NEAR(m.tests[1].perf->ratio, 95.0 / 150, 1e-12);
  EXPECT_EQ(m.tests[1].perf->ceiling, 150);
  // Another ceiling than the test's, or none that is a number, is no measurement of it.
  for (const std::string other : {R"({"fault": "", "unit": "GB/s", "rate": 90, "ceiling": 200, "ceiling_name": "fma"})",
                                   R"({"fault": "", "unit": "GB/s", "rate": 90, "ceiling": "200", "ceiling_name": "copy"})",
                                   R"({"fault": "", "unit": "GB/s", "rate": 90, "ceiling": 200})"}) {
    m = reported();
    apply_witness(m, "APerf.Rate", read_witness_verdict(other));
    EXPECT_EQ(m.points, 10) << other;
    EXPECT_FALSE(m.tests[1].perf->witnessed_ceiling.has_value()) << other;
  }
}

TEST(Verdict, TheGradersOwnCheckJudgesACorrectnessTest) {
  using k2c::grader::apply_recheck;
  using k2c::grader::read_witness_verdict;
  const k2c::ModuleSpec spec = two_test_module();
  const auto reported = [&] {  // everything passed: 10 points
    return evaluate_module(spec, exited(0), gtest_report("COMPLETED", R"(, "k2c_achieved": "95", "k2c_ceiling": "100")"),
                           "assignments", 9);
  };

  auto m = reported();
  apply_recheck(m, "A.Correct", read_witness_verdict(R"({"fault": "", "shapes": [[3, 7], [1, 1], [200, 33]]})"));
  EXPECT_EQ(m.points, 10);
  EXPECT_EQ(m.tests[0].rechecked, "checked again at 3 shapes the grader drew");

  m = reported();  // wrong at a shape the grader drew: the test fails, the rest stands
  apply_recheck(m, "A.Correct",
                read_witness_verdict(R"({"fault": "submission", "problem": "at shape [5,9]: window 1, launch 1 of 1: row 3: bad"})"));
  EXPECT_EQ(m.tests[0].status, "failed");
  EXPECT_EQ(m.tests[0].points, 0);
  EXPECT_EQ(m.points, 4);
  EXPECT_EQ(m.status, "partial");
  EXPECT_NE(m.tests[0].message.find("the grader's own run at shapes it drew: at shape [5,9]"), std::string::npos)
      << m.tests[0].message;

  for (const std::string grader_side : {R"({"fault": "grader", "problem": "no CUDA device"})", R"({"fault": ""})", ""}) {
    m = reported();
    apply_recheck(m, "A.Correct", read_witness_verdict(grader_side));
    EXPECT_EQ(m.points, 10) << grader_side;
    EXPECT_EQ(m.tests[0].rechecked.rfind("not checked again: ", 0), 0u) << grader_side;
  }
}

TEST(Rubric, ACorrectnessWitnessIsATestsOwnAndNotAPerformanceTests) {
  const auto parse = [](const std::string& test) {
    return k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
      {"id": "50_demo", "title": "demo", "kind": "gpu", "timeout_s": 9, "files": [], "tests": [)" + test + "]}]}");
  };
  EXPECT_EQ(parse(R"({"name": "A.Correct", "points": 6, "witness": "softmax_fast"})").modules[0].tests[0].witness,
            "softmax_fast");
  EXPECT_THROW(parse(R"({"name": "A.Correct", "points": 6, "witness": 3})"), k2c::RubricError);
  EXPECT_THROW(parse(R"({"name": "APerf.Rate", "points": 4, "witness": "copy", "perf": {"ceiling": "copy", "unit": "GB/s",
                 "threshold": 0.5, "goal": 0.9, "max_ratio": 1.1}})"),
               k2c::RubricError);
}

TEST(Rubric, ARankWitnessBelongsToADistributedCorrectnessTest) {
  const auto parse = [](const std::string& kind, const std::string& test) {
    const std::string runs = kind == "mpi" ? R"("runs": [{"backend": "mpi", "ranks": 2}], )" : "";
    return k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
      {"id": "50_demo", "title": "demo", "kind": ")" + kind + R"(", )" + runs +
                             R"("timeout_s": 9, "files": [], "tests": [)" + test + "]}]}");
  };
  EXPECT_EQ(parse("mpi", R"({"name": "A.Correct", "points": 6, "rank_witness": "all_gather"})").modules[0].tests[0].rank_witness,
            "all_gather");
  EXPECT_THROW(parse("gpu", R"({"name": "A.Correct", "points": 6, "rank_witness": "all_gather"})"), k2c::RubricError);
  EXPECT_THROW(parse("mpi", R"({"name": "A.Correct", "points": 6, "rank_witness": "all_gather", "witness": "copy"})"),
               k2c::RubricError);
  EXPECT_THROW(parse("mpi", R"({"name": "APerf.Rate", "points": 4, "rank_witness": "all_gather", "perf": {"ceiling": "copy",
                 "unit": "GB/s", "threshold": 0.5, "goal": 0.9, "max_ratio": 1.1}})"),
               k2c::RubricError);  // Its own rank count must be one the module runs at.
  EXPECT_EQ(parse("mpi", R"({"name": "A.Correct", "points": 6, "rank_witness": "grid", "rank_witness_ranks": 2})")
                .modules[0].tests[0].rank_witness_ranks,
            2);
  EXPECT_THROW(parse("mpi", R"({"name": "A.Correct", "points": 6, "rank_witness": "grid", "rank_witness_ranks": 3})"),
               k2c::RubricError);
  EXPECT_THROW(parse("mpi", R"({"name": "A.Correct", "points": 6, "rank_witness_ranks": 2})"), k2c::RubricError);
  EXPECT_THROW(parse("mpi", R"({"name": "A.Correct", "points": 6, "rank_witness": "grid", "rank_witness_ranks": 1.5})"),
               k2c::RubricError);
}

// ---------------------------------------------------------------------------- processes ---

TEST(Process, TimeoutKillsTheGroupAndOutputIsBounded) {
  const auto r = k2c::grader::run_process({"sh", "-c", "sleep 30 & yes | head -c 5000000; sleep 30"},
                                          {.timeout_s = 2, .keep_head = 100, .keep_tail = 100});
  EXPECT_TRUE(r.timed_out);
  EXPECT_LT(r.seconds, 10);
  EXPECT_EQ(r.output_bytes, 5000000u);
  EXPECT_LT(r.output.size(), 400u);
  EXPECT_NE(r.output.find("bytes omitted"), std::string::npos);
}

// What a program prints ends in JSON reports, whose writer throws on malformed UTF-8: bytes that
// are not UTF-8, and a character that the capture's head cuts in two, become U+FFFD.
TEST(Process, OutputIsUtf8Text) {
  const auto r = k2c::grader::run_process({"printf", "a\\377\\300\\257 \\303\\251 \\342\\211"}, {});
  EXPECT_EQ(r.output, "a\uFFFD\uFFFD\uFFFD \u00e9 \uFFFD\uFFFD");
  const auto cut = k2c::grader::run_process({"printf", "\\302\\263\\302\\263\\302\\263"},
                                            {.keep_head = 3, .keep_tail = 1});
  EXPECT_EQ(cut.output_bytes, 6u);
  EXPECT_NO_THROW(nlohmann::json(cut.output).dump()) << cut.output;
  // Messages and logs shortened for a report are cut between characters.
  EXPECT_EQ(k2c::grader::utf8_head("a\u00b3\u00b3", 4), "a\u00b3");
  EXPECT_EQ(k2c::grader::utf8_tail("\u00b3\u00b3a", 4), "\u00b3a");
  EXPECT_EQ(k2c::grader::utf8_head("\u2264", 2), "");
  // A surrogate and a code point past U+10FFFF, which JSON's writer refuses too.
  EXPECT_EQ(k2c::grader::valid_utf8("\xed\xa0\x80|\xf4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD|\uFFFD\uFFFD\uFFFD\uFFFD");
}

// Code under test runs in a session of its own, with no controlling terminal: a program that kept
// the grader's terminal could push keystrokes into the shell that started the grader (TIOCSTI).
// /proc/self/stat's fields 6 and 7: the session and the terminal.
TEST(Process, RunsInASessionOfItsOwnWithoutATerminal) {
  const auto r = k2c::grader::run_process({"sh", "-c", "cut -d' ' -f6,7 /proc/self/stat"}, {});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream in(r.output);
  long session = 0, terminal = -1;
  ASSERT_TRUE(in >> session >> terminal) << r.output;
  EXPECT_NE(session, static_cast<long>(getsid(0))) << "the child is in the grader's session";
  EXPECT_EQ(terminal, 0) << "the child has a controlling terminal";
}

TEST(Process, ReportsExitCodeSignalAndMissingProgram) {
  EXPECT_EQ(k2c::grader::run_process({"sh", "-c", "exit 7"}, {}).exit_code, 7);
  EXPECT_EQ(k2c::grader::run_process({"sh", "-c", "kill -SEGV $$"}, {}).signal, 11);
  const auto missing = k2c::grader::run_process({"/nonexistent/program"}, {});
  EXPECT_EQ(missing.exit_code, 127);
  EXPECT_NE(missing.output.find("cannot execute"), std::string::npos);
}

// Processes in /proc of user `uid` (-1: any) whose parent is `parent` (-1: any) and whose
// environment holds `entry` (empty: any): the live ones, or with `dead` the zombies only (killed,
// not yet reaped by whoever adopted them).
int count_processes(int uid, int parent, const std::string& entry, bool dead = false) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    std::ifstream status(e.path() / "status");
    std::string line;
    int owner = -1, up = -1;
    bool zombie = false;
    while (std::getline(status, line)) {
      if (line.rfind("Uid:", 0) == 0) owner = std::stoi(line.substr(4));
      if (line.rfind("PPid:", 0) == 0) up = std::stoi(line.substr(5));
      if (line.rfind("State:", 0) == 0) zombie = line.find('Z') != std::string::npos;
    }
    if (owner < 0 || (uid >= 0 && owner != uid) || (parent >= 0 && up != parent) || zombie != dead) continue;
    bool marked = entry.empty();
    std::ifstream environ(e.path() / "environ", std::ios::binary);
    for (std::string var; !marked && std::getline(environ, var, '\0');) marked = var == entry;
    n += marked;
  }
  return n;
}

// As root, a child can be handed to another user before it runs anything, and what a run leaves
// behind detached from its group is killed afterwards, by its mark: another run's processes of
// the same user are left alone.
TEST(Process, RunsAsAnotherUserAndLeavesNothingBehind) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  const passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no user nobody here";
  const int uid = static_cast<int>(nobody->pw_uid), gid = static_cast<int>(nobody->pw_gid);
  const auto id = k2c::grader::run_process({"sh", "-c", "id -u; id -g; id -G"}, {.uid = uid, .gid = gid});
  if (id.exit_code == 125) GTEST_SKIP() << "this root cannot switch users: " << id.output;  // no CAP_SETUID
  EXPECT_EQ(id.exit_code, 0) << id.output;
  EXPECT_EQ(id.output, std::to_string(uid) + "\n" + std::to_string(gid) + "\n" + std::to_string(gid) + "\n");
  // Stragglers in sessions of their own, out of reach of the group kill: one from another run of
  // the same user (another grader's: not adopted by this process), then two from "our" run, one of
  // which wiped its environment and with it the run's mark (found because this process adopted it).
  const std::string ours = "selftest-ours-" + std::to_string(getpid()), theirs = "selftest-theirs-" + std::to_string(getpid());
  // The shell waits a moment before it exits: the group kill at its end must find the sleeper
  // already in its own session.
  auto straggle = [&](const std::string& mark, const char* command) {
    const auto stray = k2c::grader::run_process({"sh", "-c", command}, {.env = {{"K2C_RUN", mark}}, .uid = uid, .gid = gid});
    EXPECT_EQ(stray.exit_code, 0) << stray.output;
  };
  straggle(theirs, "setsid sleep 300 > /dev/null 2>&1 & sleep 1; echo started");
  k2c::grader::adopt_orphans();
  straggle(ours, "setsid sleep 300 > /dev/null 2>&1 & sleep 1; echo started");
  straggle(ours, "setsid env -i sleep 301 > /dev/null 2>&1 & sleep 1; echo started");
  auto adopted = [&] { return count_processes(uid, getpid(), ""); };  // the user's, below this process
  auto sleepers = [&](const std::string& mark) { return count_processes(uid, -1, "K2C_RUN=" + mark); };
  for (int i = 0; i < 100 && (sleepers(ours) == 0 || sleepers(theirs) == 0 || adopted() < 2); ++i) usleep(20000);
  EXPECT_EQ(sleepers(ours), 1);
  EXPECT_EQ(adopted(), 2);  // the marked sleeper and the one without a mark
  EXPECT_EQ(k2c::grader::kill_run_leftovers(uid, ours), 2);
  for (int i = 0; i < 100 && (sleepers(ours) > 0 || adopted() > 0); ++i) usleep(20000);
  EXPECT_EQ(sleepers(ours), 0);
  EXPECT_EQ(adopted(), 0) << "a leftover without the run's mark survived";
  EXPECT_GT(sleepers(theirs), 0) << "another run's process was killed";
  EXPECT_EQ(k2c::grader::kill_run_leftovers(0, theirs), 0) << "root's processes are never a run's leftovers";
  k2c::grader::kill_run_leftovers(uid, theirs);

  // A chain of 16 processes, each started by the one before with its environment wiped (no mark),
  // the first in a session of its own: all of them below this process, all killed in one call.
  const fs::path chain = kTmp / "leftover_chain.sh";
  write(chain, "#!/bin/sh\n[ \"$1\" -gt 0 ] && env -i /bin/sh \"$0\" $(($1 - 1)) &\nexec sleep 3017\n");
  fs::permissions(chain, fs::perms::owner_all | fs::perms::group_read | fs::perms::others_read, fs::perm_options::replace);
  auto links = [&] {  // live processes of uid running `sleep 3017`
    int n = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc", ec)) {
      struct stat st {};
      std::ifstream cmdline(e.path() / "cmdline", std::ios::binary);
      const std::string args{std::istreambuf_iterator<char>(cmdline), std::istreambuf_iterator<char>()};
      n += stat(e.path().c_str(), &st) == 0 && static_cast<int>(st.st_uid) == uid && args == std::string("sleep\0" "3017\0", 11);
    }
    return n;
  };
  straggle(ours, ("setsid /bin/sh " + chain.string() + " 15 > /dev/null 2>&1 & sleep 1; echo started").c_str());
  for (int i = 0; i < 200 && links() < 16; ++i) usleep(20000);
  EXPECT_EQ(links(), 16);
  EXPECT_EQ(k2c::grader::kill_run_leftovers(uid, ours), 16);
  for (int i = 0; i < 100 && links() > 0; ++i) usleep(20000);
  EXPECT_EQ(links(), 0) << "part of a chain of leftovers without the run's mark survived";

  // A leftover whose first thread has exited shows as a zombie while its other thread runs: it is
  // killed all the same.
  const fs::path half = kTmp / "half_zombie";
  write(half.string() + ".cpp", "#include <pthread.h>\n#include <unistd.h>\n"
                                "void* nap(void*) { sleep(300); return nullptr; }\n"
                                "int main() { pthread_t t; pthread_create(&t, nullptr, nap, nullptr); pthread_exit(nullptr); }\n");
  const ProcessResult built = k2c::grader::run_process({"c++", "-pthread", "-o", half.string(), half.string() + ".cpp"}, {});
  ASSERT_EQ(built.exit_code, 0) << built.output;
  auto halves = [&] {  // processes of uid running it with a thread left (its command line is gone)
    int n = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc", ec)) {
      struct stat st {};
      std::ifstream comm(e.path() / "comm");
      std::string first;
      std::getline(comm, first);
      int tasks = 0;
      for (auto t = fs::directory_iterator(e.path() / "task", ec); !ec && t != fs::directory_iterator(); t.increment(ec)) ++tasks;
      ec.clear();
      n += stat(e.path().c_str(), &st) == 0 && static_cast<int>(st.st_uid) == uid && first == "half_zombie" && tasks > 1;
    }
    return n;
  };
  const int others = halves();  // left by an earlier run of this test that failed, say
  straggle(ours, ("setsid env -i " + half.string() + " > /dev/null 2>&1 & sleep 1; echo started").c_str());
  for (int i = 0; i < 100 && halves() == others; ++i) usleep(20000);
  ASSERT_EQ(halves(), others + 1);
  EXPECT_EQ(k2c::grader::kill_run_leftovers(uid, ours), 1);
  for (int i = 0; i < 100 && halves() > others; ++i) usleep(20000);
  EXPECT_EQ(halves(), others) << "a leftover that looks like a zombie survived";
}

// Code under test is the out-of-memory killer's first choice and its account holds at most
// kMaxProcesses processes; it cannot raise the limit once it runs as another user, nor (where the
// grader holds CAP_SYS_RESOURCE) lower its standing.
TEST(Process, CodeUnderTestIsTheFirstToGoAndItsProcessesAreBounded) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  const passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no user nobody here";
  const int uid = static_cast<int>(nobody->pw_uid), gid = static_cast<int>(nobody->pw_gid);
  const ProcessResult r = k2c::grader::run_process(
      {"bash", "-c", "cat /proc/self/oom_score_adj; ulimit -u; ulimit -H -u; (echo 0 > /proc/self/oom_score_adj) 2>/dev/null || echo kept; "
                     "ulimit -u 100000 2>/dev/null || echo bounded"},
      {.uid = uid, .gid = gid});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::string n = std::to_string(k2c::grader::kMaxProcesses);
  EXPECT_NE(r.output.find("1000\n" + n + "\n" + n + "\n"), std::string::npos) << r.output;
  // The floor a privileged write sets (oom_score_adj_min) needs CAP_SYS_RESOURCE; a root without it
  // (some containers) leaves the run free to go back down to 0, never below.
  std::ifstream status("/proc/self/status");
  std::string line;
  unsigned long long caps = 0;
  while (std::getline(status, line))
    if (line.rfind("CapEff:", 0) == 0) caps = std::stoull(line.substr(7), nullptr, 16);
  if (caps & (1ull << 24)) EXPECT_NE(r.output.find("kept"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bounded"), std::string::npos) << r.output;
  // The grader's own runs (builds, its tools) are left as they were: as this process stands.
  std::ifstream mine("/proc/self/oom_score_adj");
  std::string standing;
  std::getline(mine, standing);
  const ProcessResult own = k2c::grader::run_process({"cat", "/proc/self/oom_score_adj"}, {});
  EXPECT_EQ(own.output, standing + "\n") << "a run as the grader's own user changed its standing";
}

// With private_tmp, a run as another user has /tmp, /var/tmp and /dev/shm of its own: what it
// writes there is gone when it ends, another entry of the machine's /tmp is out of its sight, and
// what its working directory and command line name there is where it was. The same run without
// it leaves its files behind and sees the neighbour, so the check can fail.
TEST(Process, PrivateTemporaryFoldersVanishWithTheRun) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  const passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no user nobody here";
  if (const std::string problem = k2c::grader::private_tmp_problem(); !problem.empty())
    GTEST_SKIP() << "this machine cannot: " << problem;
  const int uid = static_cast<int>(nobody->pw_uid), gid = static_cast<int>(nobody->pw_gid);
  const std::string tag = std::to_string(getpid());
  const fs::path run = "/tmp/k2c-selftest-run-" + tag, named = "/tmp/k2c-selftest-named-" + tag,
                 neighbour = "/tmp/k2c-selftest-neighbour-" + tag;
  const std::vector<fs::path> left = {"/tmp/k2c-selftest-left-" + tag, "/var/tmp/k2c-selftest-left-" + tag,
                                      "/dev/shm/k2c-selftest-left-" + tag};
  fs::create_directories(run);
  ASSERT_EQ(chown(run.c_str(), static_cast<uid_t>(uid), static_cast<gid_t>(gid)), 0);
  write(run / "input", "from the run folder\n");
  write(named, "named on the command line\n");
  write(neighbour, "another run's\n");
  std::string script = "cat input \"$1\"; [ -e " + neighbour.string() + " ] && echo saw the neighbour; df -k /tmp | tail -n 1";
  for (const fs::path& p : left)
    if (fs::exists(p.parent_path())) script += "; touch " + p.string() + " && echo wrote " + p.string();
  auto attempt = [&](bool private_tmp) {
    return k2c::grader::run_process({"sh", "-c", script, "sh", named.string()},
                                    {.cwd = run.string(), .uid = uid, .gid = gid, .private_tmp = private_tmp});
  };
  // Two ways the machine's /tmp could have been let in whole: a variable of the grader's naming the
  // folder itself, and a planted /tmp/nvidia-mps (the one entry kept unnamed) that links elsewhere.
  setenv("K2C_SELFTEST_NAMES_TMP", "/tmp", 1);
  const bool planted = !fs::exists(fs::symlink_status("/tmp/nvidia-mps"));
  if (planted) fs::create_directory_symlink(neighbour.parent_path(), "/tmp/nvidia-mps");
  const ProcessResult mine = attempt(true);
  unsetenv("K2C_SELFTEST_NAMES_TMP");
  if (planted) fs::remove("/tmp/nvidia-mps");
  EXPECT_EQ(mine.exit_code, 0) << mine.output;
  EXPECT_NE(mine.output.find("from the run folder"), std::string::npos) << mine.output;
  EXPECT_NE(mine.output.find("named on the command line"), std::string::npos) << mine.output;
  EXPECT_EQ(mine.output.find("saw the neighbour"), std::string::npos) << mine.output;
  EXPECT_NE(mine.output.find(" 1048576 "), std::string::npos) << "the private /tmp is not 1 GiB:\n" << mine.output;
  for (const fs::path& p : left)
    if (fs::exists(p.parent_path())) {
      EXPECT_NE(mine.output.find("wrote " + p.string()), std::string::npos) << mine.output;
      EXPECT_FALSE(fs::exists(p)) << p << " outlived the run";
    }
  const ProcessResult shared = attempt(false);
  EXPECT_EQ(shared.exit_code, 0) << shared.output;
  EXPECT_NE(shared.output.find("saw the neighbour"), std::string::npos) << shared.output;
  EXPECT_TRUE(fs::exists(left[0])) << shared.output;
  for (const fs::path& p : left) fs::remove(p);
  fs::remove_all(run);
  fs::remove(named);
  fs::remove(neighbour);
}

// With private_pids too, a run's processes are its own: the run is the second process of a PID
// namespace (the first is the grader's); a process and a shared-memory segment of the same account
// outside it are out of its sight, and its signal does not reach that process; what it leaves
// running in a session of its own ends with it, and the segment it makes never lands in the
// machine's table; its exit code and the signal that ended it come through as without; a run that
// a time limit stops leaves nothing running and, once the grader has cleaned up, nothing to reap.
// The same run without it sees the segment, kills the neighbour and leaves its sleeper and segment
// behind, so the checks can fail.
TEST(Process, PrivateProcessesEndWithTheRun) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  const passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no user nobody here";
  if (const std::string problem = k2c::grader::private_pids_problem(); !problem.empty())
    GTEST_SKIP() << "this machine cannot: " << problem;
  if (k2c::grader::run_process({"sh", "-c", "command -v ipcmk"}, {}).exit_code != 0) GTEST_SKIP() << "no ipcmk here";
  const int uid = static_cast<int>(nobody->pw_uid), gid = static_cast<int>(nobody->pw_gid);
  const std::string tag = std::to_string(getpid());
  k2c::grader::adopt_orphans();  // the shared run's sleeper stays below this process, to be killed
  auto run = [&](const std::string& body, bool pids, double timeout_s = 60) {
    return k2c::grader::run_process({"sh", "-c", body}, {.env = {{"K2C_SELFTEST_PIDS", tag}},
                                                         .timeout_s = timeout_s, .uid = uid, .gid = gid,
                                                         .private_tmp = true, .private_pids = pids});
  };
  auto sleepers = [&] { return count_processes(uid, -1, "K2C_SELFTEST_PIDS=" + tag); };  // what the runs left
  auto dead_children = [] { return count_processes(-1, getpid(), "", true); };
  // Segments of a size of this test's own, so that other users of the account do not count.
  const std::string size = std::to_string(4096 * (1 + getpid() % 509));
  auto segments = [&] {  // the account's segments of that size on the machine
    std::ifstream table("/proc/sysvipc/shm");
    std::string line;
    std::getline(table, line);  // the header
    int count = 0;
    while (std::getline(table, line)) {
      std::istringstream fields(line);
      std::string key, id, perms, bytes, field;
      fields >> key >> id >> perms >> bytes;
      for (int i = 0; i < 4; ++i) fields >> field;  // cpid lpid nattch uid
      count += bytes == size && field == std::to_string(uid);
    }
    return count;
  };
  std::vector<int> made;  // the segments that runs without the namespaces leave, removed at the end
  auto made_in = [&](const std::string& output) {
    for (std::size_t at = output.find("made segment "); at != std::string::npos; at = output.find("made segment ", at + 1))
      made.push_back(std::stoi(output.substr(at + 13)));
  };
  const std::string make_segment = "ipcmk -M " + size + " | sed 's/.*: /made segment /'";
  made_in(run(make_segment, false).output);  // a neighbour's segment
  EXPECT_EQ(made.size(), 1u);
  const pid_t neighbour = fork();  // another run's process of the same account
  if (neighbour == 0) {
    if (setgroups(0, nullptr) == 0 && setgid(static_cast<gid_t>(gid)) == 0 && setuid(static_cast<uid_t>(uid)) == 0)
      execlp("sleep", "sleep", "60", nullptr);
    _exit(127);
  }
  ASSERT_GT(neighbour, 0);
  const std::string n = std::to_string(neighbour);
  const std::string script = "echo pid $$; [ -e /proc/" + n + " ] && echo saw the neighbour; kill -TERM " + n +
                             " 2>/dev/null && echo signalled the neighbour; setsid sleep 300 > /dev/null 2>&1 & sleep 1; "
                             "echo left one; echo segments in sight: $(($(grep -c . /proc/sysvipc/shm) - 1)); " + make_segment;
  const int segments_before = segments();
  const ProcessResult mine = run(script, true);
  EXPECT_EQ(mine.exit_code, 0) << mine.output;
  EXPECT_NE(mine.output.find("pid 2\n"), std::string::npos) << mine.output;
  EXPECT_NE(mine.output.find("left one"), std::string::npos) << mine.output;
  EXPECT_EQ(mine.output.find("saw the neighbour"), std::string::npos) << mine.output;
  EXPECT_EQ(mine.output.find("signalled the neighbour"), std::string::npos) << mine.output;
  EXPECT_NE(mine.output.find("segments in sight: 0\n"), std::string::npos) << mine.output;
  EXPECT_NE(mine.output.find("made segment "), std::string::npos) << mine.output;
  EXPECT_EQ(segments(), segments_before) << "the run's segment landed in the machine's table";
  for (int i = 0; i < 100 && sleepers() > 0; ++i) usleep(20000);
  EXPECT_EQ(sleepers(), 0) << "what the run left running outlived it";
  EXPECT_EQ(waitpid(neighbour, nullptr, WNOHANG), 0) << "the neighbour did not survive the run";
  EXPECT_EQ(run("exit 3", true).exit_code, 3);
  EXPECT_EQ(run("kill -SEGV $$", true).signal, SIGSEGV);

  const int before = sleepers();
  const ProcessResult shared = run(script, false);
  made_in(shared.output);
  EXPECT_EQ(shared.exit_code, 0) << shared.output;
  EXPECT_NE(shared.output.find("saw the neighbour"), std::string::npos) << shared.output;
  EXPECT_NE(shared.output.find("signalled the neighbour"), std::string::npos) << shared.output;
  EXPECT_EQ(shared.output.find("segments in sight: 0\n"), std::string::npos) << shared.output;
  EXPECT_EQ(sleepers(), before + 1) << shared.output;
  EXPECT_EQ(made.size(), 2u) << shared.output;
  for (const int id : made) shmctl(id, IPC_RMID, nullptr);
  k2c::grader::kill_run_leftovers(uid, "");  // the sleeper is below this process
  kill(neighbour, SIGKILL);
  waitpid(neighbour, nullptr, 0);

  // Stopped by its time limit: the kill of the group takes the keeper, and its child (the
  // namespace's first process, root's) comes to this process as the orphans' adopter; run_process
  // reaps it once the namespace, sleeper included, is down.
  const int dead_before = dead_children();
  const ProcessResult late = run("setsid sleep 300 & echo started; sleep 300", true, 1);
  EXPECT_TRUE(late.timed_out) << late.output;
  EXPECT_NE(late.output.find("started"), std::string::npos) << late.output;
  EXPECT_EQ(sleepers(), 0) << "a run stopped by its time limit left a process behind";
  EXPECT_EQ(dead_children(), dead_before) << "a run's remains were left unreaped";
}

// With private_net, a run's network is its own, loopback alone and up: a port and an abstract Unix
// socket that a neighbour on the machine listens on are out of its reach and sight, it has no other
// interface, and its own loopback answers (a refused connection, not an unreachable network: its
// ranks bootstrap over it). The same run without it reaches the port, sees the socket and the
// machine's interfaces, so the checks can fail. Independent of private_pids (both off here).
TEST(Process, PrivateNetworkHoldsLoopbackAlone) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  const passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no user nobody here";
  if (const std::string problem = k2c::grader::private_net_problem(); !problem.empty())
    GTEST_SKIP() << "this machine cannot: " << problem;
  if (k2c::grader::run_process({"sh", "-c", "command -v bash"}, {}).exit_code != 0) GTEST_SKIP() << "no bash here";
  // The neighbour: this process, listening on a loopback port and on an abstract socket.
  struct Closed {
    int fd;
    ~Closed() { if (fd >= 0) close(fd); }
  };
  const Closed port_fd{socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t at_size = sizeof at;
  ASSERT_TRUE(port_fd.fd >= 0 && bind(port_fd.fd, reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0 &&
              listen(port_fd.fd, 4) == 0 && getsockname(port_fd.fd, reinterpret_cast<sockaddr*>(&at), &at_size) == 0)
      << std::strerror(errno);
  const std::string port = std::to_string(ntohs(at.sin_port));
  const std::string name = "k2c-selftest-net-" + std::to_string(getpid());
  const Closed unix_fd{socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  sockaddr_un abstract{};
  abstract.sun_family = AF_UNIX;
  std::memcpy(abstract.sun_path + 1, name.data(), name.size());  // a leading NUL: the abstract namespace
  ASSERT_TRUE(unix_fd.fd >= 0 &&
              bind(unix_fd.fd, reinterpret_cast<const sockaddr*>(&abstract),
                   static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())) == 0 &&
              listen(unix_fd.fd, 4) == 0)
      << std::strerror(errno);
  const std::string script = "true 3<>/dev/tcp/127.0.0.1/" + port + " && echo reached the neighbour; grep -q '@" + name +
                             "' /proc/net/unix && echo saw the socket; echo interfaces: $(grep -c : /proc/net/dev); exit 0";
  auto run = [&](bool net) {
    return k2c::grader::run_process({"bash", "-c", script},
                                    {.timeout_s = 60, .uid = static_cast<int>(nobody->pw_uid), .gid = static_cast<int>(nobody->pw_gid),
                                     .private_tmp = true, .private_net = net});
  };
  const ProcessResult mine = run(true);
  EXPECT_EQ(mine.exit_code, 0) << mine.output;
  EXPECT_EQ(mine.output.find("reached the neighbour"), std::string::npos) << mine.output;
  EXPECT_EQ(mine.output.find("saw the socket"), std::string::npos) << mine.output;
  EXPECT_NE(mine.output.find("Connection refused"), std::string::npos) << "its loopback is not up: " << mine.output;
  EXPECT_NE(mine.output.find("interfaces: 1\n"), std::string::npos) << mine.output;
  const ProcessResult shared = run(false);
  EXPECT_EQ(shared.exit_code, 0) << shared.output;
  EXPECT_NE(shared.output.find("reached the neighbour"), std::string::npos) << shared.output;
  EXPECT_NE(shared.output.find("saw the socket"), std::string::npos) << shared.output;
}

// A file only root may read, for the tests of what a submission's build reads.
fs::path root_only_secret() {
  const fs::path secret = kTmp / "root_only_secret.txt";
  std::ofstream(secret) << "K2C-ROOT-ONLY-SECRET\n";
  fs::permissions(secret, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::replace);
  return secret;
}

// `k2c compile-as`, the build's launcher for a submission's files: the compile runs as the other
// user, so a file only root may read is not read (and no message quotes it), while a plain compile
// leaves its object where the build expects it.
// What a build leaves running is killed whoever it runs as: a process of this user in a session of
// its own, adopted once its shell has ended (as Ninja's shells leave a compile-as behind).
TEST(Process, KillsWhatABuildLeftBehindWhateverItsUser) {
  k2c::grader::adopt_orphans();
  const ProcessResult left = k2c::grader::run_process({"sh", "-c", "setsid sleep 300 > /dev/null 2>&1 & echo $!; sleep 1"}, {});
  ASSERT_EQ(left.exit_code, 0) << left.output;
  const pid_t pid = static_cast<pid_t>(std::stol(left.output));
  ASSERT_EQ(kill(pid, 0), 0) << "the sleeper outlives its shell";
  EXPECT_GE(k2c::grader::kill_descendants(), 1);
  EXPECT_NE(kill(pid, 0), 0) << "killed and reaped";
  EXPECT_EQ(k2c::grader::kill_descendants(), 0) << "nothing left";
}

TEST(Process, CompilesAsAnotherUserWhoCannotReadRootsFiles) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  const passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no user nobody here";
  const std::string uid = std::to_string(nobody->pw_uid), gid = std::to_string(nobody->pw_gid);
  const fs::path dir = kTmp / "compile_as", secret = root_only_secret();
  fs::remove_all(dir);
  fs::create_directories(dir);
  write(dir / "plain.cpp", "int k2c_answer() { return 42; }\n");
  write(dir / "reads.cpp", "#include \"" + secret.string() + "\"\n");
  auto compile = [&](const std::string& source) {
    return k2c::grader::run_process({K2C_BIN, "compile-as", uid, gid, "--", "c++", "-MD", "-MF",
                                     (dir / (source + ".d")).string(), "-c", (dir / source).string(), "-o",
                                     (dir / (source + ".o")).string()},
                                    {.timeout_s = 120});
  };
  const ProcessResult plain = compile("plain.cpp");
  if (plain.output.find("cannot hand") != std::string::npos) GTEST_SKIP() << "this root cannot change owners: " << plain.output;
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  struct stat st {};
  ASSERT_EQ(stat((dir / "plain.cpp.o").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 0u) << "the object is the grader's, out of the user's reach";
  EXPECT_NE(slurp(dir / "plain.cpp.d").find("plain.cpp"), std::string::npos);
  const ProcessResult reads = compile("reads.cpp");
  EXPECT_NE(reads.exit_code, 0);
  EXPECT_NE(reads.output.find("Permission denied"), std::string::npos) << reads.output;
  EXPECT_EQ(reads.output.find("K2C-ROOT-ONLY-SECRET"), std::string::npos) << reads.output;
  EXPECT_FALSE(fs::exists(dir / "reads.cpp.o"));
  // A "compiler" that writes a linker script where the object goes (one that would pull another
  // file into the library at the grader's link): refused, and nothing reaches the build tree.
  const ProcessResult script = k2c::grader::run_process(
      {K2C_BIN, "compile-as", uid, gid, "--", "sh", "-c", "printf 'INPUT(/etc/shadow)\\n' > \"$2\"", "sh", "-o",
       (dir / "script.o").string()},
      {.timeout_s = 60});
  EXPECT_NE(script.exit_code, 0);
  EXPECT_NE(script.output.find("is not an object file"), std::string::npos) << script.output;
  EXPECT_FALSE(fs::exists(dir / "script.o"));
  // In the grading's scratch folder (as every build's environment names it): a compile leaves
  // nothing there; one killed with its build leaves its folder, which the grader clears after the
  // build.
  const fs::path scratch = dir / "compile-scratch";
  const auto env = k2c::grader::compile_scratch_env(scratch);
  ASSERT_EQ(env.size(), 1u);
  struct stat sst {};
  ASSERT_EQ(stat(scratch.c_str(), &sst), 0);
  EXPECT_EQ(sst.st_mode & 07777, 0711u) << "searchable by the user, listable by the grader only";
  const ProcessResult kept = k2c::grader::run_process(
      {K2C_BIN, "compile-as", uid, gid, "--", "c++", "-c", (dir / "plain.cpp").string(), "-o", (dir / "again.o").string()},
      {.env = env, .timeout_s = 120});
  EXPECT_EQ(kept.exit_code, 0) << kept.output;
  EXPECT_TRUE(fs::is_empty(scratch));
  const ProcessResult killed = k2c::grader::run_process(
      {K2C_BIN, "compile-as", uid, gid, "--", "sh", "-c", "sleep 2", "sh", "-o", (dir / "never.o").string()}, {.env = env, .timeout_s = 1});
  EXPECT_TRUE(killed.timed_out);
  EXPECT_FALSE(fs::is_empty(scratch)) << "a compile-as killed mid-way cannot clean up";
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // its compiler's end (the grader kills it)
  EXPECT_EQ(k2c::grader::clear_compile_scratch(scratch), 1);
  EXPECT_TRUE(fs::is_empty(scratch));
  // Only a folder compile_as would use is cleared: not one reached through a link (nor one another
  // user could write, which compile_as passes over for /tmp, as it does a folder that is missing).
  const fs::path victim = dir / "victim", link = dir / "link-scratch";
  fs::create_directories(victim);
  write(victim / "keep", "x");
  fs::create_directory_symlink(victim, link);
  EXPECT_EQ(k2c::grader::clear_compile_scratch(link), 0);
  EXPECT_TRUE(fs::exists(victim / "keep"));
  const fs::path open_to_all = dir / "open-to-all";
  fs::create_directories(open_to_all);
  fs::permissions(open_to_all, fs::perms::all, fs::perm_options::replace);
  for (const std::string& named : {open_to_all.string(), std::string("/nonexistent/k2c"), link.string()}) {
    const ProcessResult elsewhere = k2c::grader::run_process(
        {K2C_BIN, "compile-as", uid, gid, "--", "c++", "-c", (dir / "plain.cpp").string(), "-o", (dir / "else.o").string()},
        {.env = {{k2c::grader::kCompileScratch, named}}, .timeout_s = 120});
    EXPECT_EQ(elsewhere.exit_code, 0) << named << ": " << elsewhere.output;
  }
  EXPECT_TRUE(fs::is_empty(open_to_all));
  EXPECT_EQ(k2c::grader::clear_compile_scratch(open_to_all), 0);
  // Without a user to run as, or without an output to redirect, it refuses.
  EXPECT_NE(k2c::grader::run_process({K2C_BIN, "compile-as", "0", "0", "--", "true", "-o", "x"}, {}).exit_code, 0);
  EXPECT_NE(k2c::grader::run_process({K2C_BIN, "compile-as", uid, gid, "--", "true"}, {}).exit_code, 0);
}

// ---------------------------------------------------------------------------- end to end ---

// One test, because CTest runs every test in its own process and grading the fake course means
// building it: the checks below share that one grading run.
// --deadline: once grading has run that long no further module begins; the rest are reported
// "not graded" with 0 points, and grading ends normally with its results written.
TEST(FakeCourse, ModulesPastTheDeadlineAreNotGraded) {
  const fs::path build = kTmp / "fake_build_deadline";
  fs::remove_all(build);
  const ProcessResult run = k2c::grader::run_process(
      {K2C_BIN, "--root", kFake.string(), "grade", "--rubric", (kFake / "rubric.json").string(), "--build-dir",
       build.string(), "--seed", "1", "--modules", "80", "--deadline", "0.001", "--json",
       (kTmp / "deadline_report.json").string()},
      {.timeout_s = 600});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::ifstream in(kTmp / "deadline_report.json");
  ASSERT_TRUE(in) << run.output;
  const json report = json::parse(in);
  ASSERT_EQ(report["modules"].size(), 1u);
  EXPECT_EQ(report["modules"][0]["status"], "not graded");
  EXPECT_EQ(report["modules"][0]["points"], 0);
  EXPECT_NE(report["modules"][0]["detail"].get<std::string>().find("--deadline"), std::string::npos);
  EXPECT_FALSE(report.contains("unfinished"));
}

TEST(FakeCourse, EachMisbehaviourCostsOnlyItsModule) {
  const fs::path build = kTmp / "fake_build";
  fs::remove_all(build);
  const ProcessResult run = k2c::grader::run_process(
      {K2C_BIN, "--root", kFake.string(), "grade", "--rubric", (kFake / "rubric.json").string(),
       "--build-dir", build.string(), "--seed", "1", "--json", (kTmp / "fake_report.json").string(),
       "--gradescope", (kTmp / "fake_results.json").string()},
      {.timeout_s = 900});
  std::ifstream in(kTmp / "fake_report.json");
  ASSERT_TRUE(in) << "k2c grade wrote no report: " << run.output;
  const json report = json::parse(in);
  auto module = [&](const std::string& id) -> const json& {
    for (const json& m : report["modules"])
      if (m["id"] == id) return m;
    throw std::runtime_error("no module " + id + " in the report");
  };

  // Grading completes, prints the table and exits 0 whatever the score.
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("80_ok"), std::string::npos);
  EXPECT_NE(run.output.find("total"), std::string::npos);
  EXPECT_EQ(report["modules"].size(), 10u);
  // The results are rewritten after every module (a grader stopped later leaves the modules it
  // finished, marked unfinished); the last write is the whole run, and no partial file is left.
  EXPECT_FALSE(report.contains("unfinished"));
  EXPECT_FALSE(fs::exists(kTmp / "fake_report.json.part"));
  EXPECT_FALSE(fs::exists(kTmp / "fake_results.json.part"));
  {
    std::ifstream gs(kTmp / "fake_results.json");
    const json results = json::parse(gs);
    EXPECT_EQ(results["output"].get<std::string>().find("still running"), std::string::npos);
  }

  const std::map<std::string, std::pair<std::string, double>> expected = {
      {"80_ok", {"ok", 10}},           {"81_crash", {"crashed", 0}},
      {"82_hang", {"timed out", 0}},   {"83_exit0", {"no report", 0}},
      {"84_missing", {"incomplete", 0}}, {"85_impossible", {"invalid", 0}},
      {"86_noisy", {"ok", 10}},        {"87_sticky", {"crashed", 0}},
      {"88_notimpl", {"not implemented yet", 0}}, {"89_broken", {"build failed", 0}}};
  for (const auto& [id, want] : expected) {
    const json& m = module(id);
    EXPECT_EQ(m["status"], want.first) << id << ": " << m["detail"];
    EXPECT_EQ(m["points"], want.second) << id;
  }
  EXPECT_EQ(report["points"], 20);
  EXPECT_EQ(report["max_points"], 100);

  // Reasons are specific.
  EXPECT_NE(module("89_broken")["detail"].get<std::string>().find("undeclared_identifier"), std::string::npos);
  EXPECT_NE(module("87_sticky")["detail"].get<std::string>().find("illegal memory access"), std::string::npos);
  EXPECT_NE(module("84_missing")["detail"].get<std::string>().find("Fake.Extra"), std::string::npos);
  EXPECT_NE(module("81_crash")["detail"].get<std::string>().find("signal 11"), std::string::npos);
  // 50 MiB printed, a bounded slice kept, as UTF-8 (the report was written): the stray bytes are
  // U+FFFD, the characters kept.
  const std::string noisy = module("86_noisy")["log"].get<std::string>();
  EXPECT_LT(noisy.size(), 100'000u);
  EXPECT_NE(noisy.find("\uFFFD\u00b3\u00b3"), std::string::npos);

  // Gradescope's results add up to the same score.
  std::ifstream gs_in(kTmp / "fake_results.json");
  ASSERT_TRUE(gs_in);
  const json gs = json::parse(gs_in);
  double sum = 0, max = 0;
  for (const json& t : gs["tests"]) {
    sum += t["score"].get<double>();
    max += t["max_score"].get<double>();
  }
  EXPECT_EQ(gs["score"], 20);
  EXPECT_EQ(sum, 20);
  EXPECT_EQ(max, 100);
}

// -------------------------------------------------------------------------------- intake ---
// Each test stages into a folder of its own: CTest runs them side by side (-j), and a shared
// stage folder removed by one while the other fills it fails both.

TEST(Intake, TakesOnlyListedRegularFiles) {
  const fs::path root = kTmp / "intake_course", sub = kTmp / "intake_submission";
  fs::remove_all(root);
  fs::remove_all(sub);
  fs::create_directories(root / "assignments/80_ok");
  fs::create_directories(root / "autograder");
  std::ofstream(root / "assignments/80_ok/ok.cpp") << "stub";
  std::ofstream(root / "assignments/80_ok/other.cpp") << "stub";
  std::ofstream(root / "autograder/test.cpp") << "the real test";
  fs::create_directories(sub / "autograder");
  std::ofstream(sub / "ok.cpp") << "student work";                    // listed, flat upload
  std::ofstream(sub / "autograder/test.cpp") << "a forged test";      // not listed
  std::ofstream(sub / "CMakeLists.txt") << "forged";                  // not listed

  k2c::Rubric rubric = k2c::load_rubric((kFake / "rubric.json").string());
  const std::vector<const k2c::ModuleSpec*> mods = {rubric.find("80")};
  auto in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "intake_stage").string());
  ASSERT_EQ(in.files.size(), 1u);
  EXPECT_EQ(in.files[0].problem, "");
  EXPECT_EQ(in.problem_for(*mods[0]), "");
  std::ifstream staged(fs::path(in.staged_root) / "assignments/80_ok/ok.cpp");
  std::string text((std::istreambuf_iterator<char>(staged)), {});
  EXPECT_EQ(text, "student work");
  std::ifstream test(fs::path(in.staged_root) / "autograder/test.cpp");
  std::string test_text((std::istreambuf_iterator<char>(test)), {});
  EXPECT_EQ(test_text, "the real test");
  EXPECT_FALSE(fs::exists(fs::path(in.staged_root) / "CMakeLists.txt"));
  EXPECT_EQ(in.ignored.size(), 2u);

  // A symlink is refused (it could point at the tests or at /etc/passwd) ...
  fs::remove(sub / "ok.cpp");
  fs::create_symlink(root / "autograder/test.cpp", sub / "ok.cpp");
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "intake_stage").string());
  EXPECT_NE(in.problem_for(*mods[0]).find("symbolic link"), std::string::npos);
  // ... and so is a file over the rubric's size limit (1000 bytes in the fake rubric).
  fs::remove(sub / "ok.cpp");
  std::ofstream(sub / "ok.cpp") << std::string(5000, 'x');
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "intake_stage").string());
  EXPECT_NE(in.problem_for(*mods[0]).find("more than 1000"), std::string::npos);
  // A missing file is no problem: the stub is graded.
  fs::remove(sub / "ok.cpp");
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "intake_stage").string());
  EXPECT_EQ(in.problem_for(*mods[0]), "");
  EXPECT_EQ(in.files[0].source, "");
}

// A folder on the way that is a link is refused as surely as a linked file: the file below it
// is a regular file, but where the link leads is decided on the grader's machine.
TEST(Intake, RefusesAnyPathThroughASymbolicLink) {
  const fs::path root = kTmp / "link_course", sub = kTmp / "link_submission", solutions = kTmp / "link_solutions";
  fs::remove_all(root);
  fs::remove_all(sub);
  fs::remove_all(solutions);
  write(root / "assignments/80_ok/ok.cpp", "stub");
  write(solutions / "80_ok/ok.cpp", "the reference");
  fs::create_directories(sub / "assignments");
  fs::create_directory_symlink(solutions / "80_ok", sub / "assignments/80_ok");  // -> the reference's folder

  k2c::Rubric rubric = k2c::load_rubric((kFake / "rubric.json").string());
  const std::vector<const k2c::ModuleSpec*> mods = {rubric.find("80")};
  auto in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "link_stage").string());
  const std::string problem = in.problem_for(*mods[0]);
  EXPECT_NE(problem.find("assignments/80_ok is a symbolic link"), std::string::npos) << problem;
  EXPECT_NE(problem.find((solutions / "80_ok").string()), std::string::npos) << problem;  // and where to
  EXPECT_EQ(slurp(fs::path(in.staged_root) / "assignments/80_ok/ok.cpp"), "stub");

  // The submission's root may itself be reached through a link (an upload folder mounted
  // elsewhere): only what lies below it must be link-free.
  fs::remove_all(sub);
  write(sub / "assignments/80_ok/ok.cpp", "student work");
  fs::remove(kTmp / "link_to_submission");
  fs::create_directory_symlink(sub, kTmp / "link_to_submission");
  in = k2c::grader::take_submission(rubric, mods, (kTmp / "link_to_submission").string(), root.string(),
                                    (kTmp / "link_stage").string());
  EXPECT_EQ(in.problem_for(*mods[0]), "");
  EXPECT_EQ(slurp(fs::path(in.staged_root) / "assignments/80_ok/ok.cpp"), "student work");
}

// What a submission holds beyond the rubric's files is listed, never followed: a link that loops
// or leads nowhere is a name like any other (resolving it threw, and the whole grade with it, no
// report written), and a submission of thousands of stray files lists the first 200.
TEST(Intake, ListsStrayEntriesWithoutFollowingThem) {
  const fs::path root = kTmp / "stray_course", sub = kTmp / "stray_submission";
  fs::remove_all(root);
  fs::remove_all(sub);
  write(root / "assignments/80_ok/ok.cpp", "stub");
  write(sub / "ok.cpp", "student work");
  fs::create_symlink("loop", sub / "loop");               // ELOOP for anything that resolves it
  fs::create_symlink("nowhere/at/all", sub / "dangling");

  k2c::Rubric rubric = k2c::load_rubric((kFake / "rubric.json").string());
  const std::vector<const k2c::ModuleSpec*> mods = {rubric.find("80")};
  const std::string stage = (kTmp / "stray_stage").string();
  k2c::grader::Intake in;
  ASSERT_NO_THROW(in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), stage));
  EXPECT_EQ(in.problem_for(*mods[0]), "");
  EXPECT_EQ(slurp(fs::path(in.staged_root) / "assignments/80_ok/ok.cpp"), "student work");
  EXPECT_EQ(std::set<std::string>(in.ignored.begin(), in.ignored.end()), (std::set<std::string>{"loop", "dangling"}));

  for (int i = 0; i < 250; ++i) write(sub / "junk" / ("f" + std::to_string(i)), "x");
  ASSERT_NO_THROW(in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), stage));
  ASSERT_EQ(in.ignored.size(), 201u);  // 200 names and the count of the rest
  EXPECT_EQ(in.ignored.back(), "... and 52 more");  // 252 stray entries: the links and 250 files
}

// The next submission graded in the same build folder is staged over the last one: only the
// files whose bytes differ are written (an unchanged one keeps its time stamp, so the build
// recompiles only the student's files), and anything else found there, a link above all, goes.
TEST(Intake, RestagingRewritesOnlyWhatDiffers) {
  const fs::path root = kTmp / "restage_course", sub = kTmp / "restage_submission", stage = kTmp / "restage_stage";
  const fs::path outside = kTmp / "restage_outside.txt";
  for (const fs::path& p : {root, sub, stage}) fs::remove_all(p);
  write(root / "assignments/80_ok/ok.cpp", "stub");
  write(root / "autograder/test.cpp", "the real test");
  write(root / "CMakeLists.txt", "project()");
  write(outside, "not the grader's to write");
  write(sub / "ok.cpp", "work 1");
  k2c::Rubric rubric = k2c::load_rubric((kFake / "rubric.json").string());
  const std::vector<const k2c::ModuleSpec*> mods = {rubric.find("80")};
  auto in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), stage.string());
  EXPECT_EQ(slurp(stage / "assignments/80_ok/ok.cpp"), "work 1");

  // Every staged file dated an hour back, so that a rewrite shows; then what a previous grading
  // could have left: a stray file, a link beside the tests, and the test itself made a link.
  const auto old_time = fs::file_time_type::clock::now() - std::chrono::hours(1);
  for (const char* f : {"assignments/80_ok/ok.cpp", "autograder/test.cpp", "CMakeLists.txt"})
    fs::last_write_time(stage / f, old_time);
  write(stage / "stray.txt", "left over");
  fs::create_symlink(root / "autograder/test.cpp", stage / "autograder/evil.cpp");
  fs::remove(stage / "CMakeLists.txt");
  fs::create_symlink(outside, stage / "CMakeLists.txt");

  write(sub / "ok.cpp", "work 2");
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), stage.string());
  EXPECT_EQ(slurp(stage / "assignments/80_ok/ok.cpp"), "work 2");
  EXPECT_GT(fs::last_write_time(stage / "assignments/80_ok/ok.cpp"), old_time);
  EXPECT_EQ(fs::last_write_time(stage / "autograder/test.cpp"), old_time);  // unchanged: not rewritten
  EXPECT_FALSE(fs::exists(fs::symlink_status(stage / "stray.txt")));
  EXPECT_FALSE(fs::exists(fs::symlink_status(stage / "autograder/evil.cpp")));
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(stage / "CMakeLists.txt")));
  EXPECT_EQ(slurp(stage / "CMakeLists.txt"), "project()");
  EXPECT_EQ(slurp(outside), "not the grader's to write");
  EXPECT_FALSE(fs::exists(fs::symlink_status(stage.string() + ".taken")));  // the taken bytes' folder, gone

  // The next submission without the file: the stub is back.
  fs::remove(sub / "ok.cpp");
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), stage.string());
  EXPECT_EQ(slurp(stage / "assignments/80_ok/ok.cpp"), "stub");
  EXPECT_EQ(fs::last_write_time(stage / "autograder/test.cpp"), old_time);

  // A stage folder that is itself a link is replaced by a folder, not written through.
  const fs::path elsewhere = kTmp / "restage_elsewhere";
  fs::remove_all(elsewhere);
  fs::create_directories(elsewhere);
  fs::remove_all(stage);
  fs::create_directory_symlink(elsewhere, stage);
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), stage.string());
  EXPECT_TRUE(fs::is_directory(fs::symlink_status(stage)));
  EXPECT_TRUE(fs::is_empty(elsewhere));
}

// Staged inside the course, `#include "../../solutions/..."` would reach the reference: the
// staging folder lies outside the course tree whatever the build folder.
TEST(Intake, StagesOutsideTheCourseTree) {
  const fs::path course = kTmp / "stage_course";
  fs::create_directories(course / "build");
  const std::string inside = k2c::grader::staging_dir(course.string(), (course / "build/gradescope").string());
  EXPECT_FALSE(k2c::grader::is_within(inside, course.string())) << inside;
  // The same build folder gets the same staging folder (its CMake cache names the sources).
  EXPECT_EQ(inside, k2c::grader::staging_dir(course.string(), (course / "build/gradescope").string()));
  EXPECT_NE(inside, k2c::grader::staging_dir(course.string(), (course / "build/other").string()));
  EXPECT_TRUE(fs::is_directory(fs::path(inside).parent_path().parent_path()));
  // Others may pass through it (the runner compiles the staged files), not list or write it.
  EXPECT_EQ(fs::status(fs::path(inside).parent_path().parent_path()).permissions() & fs::perms::all,
            fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  // A build folder outside the course keeps its staging folder beside it.
  EXPECT_EQ(k2c::grader::staging_dir(course.string(), (kTmp / "elsewhere").string()), (kTmp / "elsewhere/staged").string());
}

// ------------------------------------------------------------------------------- hostile ---

namespace {

// A copy of the fake course for hostile code to do its worst in. The harness header its stubs
// include goes into the copy's common/include: the repository's own lies outside the staging
// tree, out of a submission's reach, as it should.
fs::path fake_course_copy(const std::string& name) {
  const fs::path root = kTmp / name;
  fs::remove_all(root);
  fs::copy(kFake, root, fs::copy_options::recursive);
  fs::create_directories(root / "common/include/k2c/core");
  fs::copy_file(fs::path(K2C_SELFTEST_DIR) / "../../common/include/k2c/core/todo.h",
                root / "common/include/k2c/core/todo.h");
  return root;
}

// Implementations of the fake contract (common/include/fake_gemm.h), honest and otherwise.
const std::string kHonest = "#include \"fake_gemm.h\"\nint k2c::gemm::answer() { return 42; }\n";

// Right, and refers weakly to MPI's all-reduce: --no-undefined lets a weak reference through, and
// at run time it binds to MPI wherever the test program has loaded it (module 11's does). Here
// nothing defines it, so the answer is the honest one: only the grader's reading of the library
// can refuse it.
const std::string kWeak = R"(#include "fake_gemm.h"
extern "C" int MPI_Allreduce(const void*, void*, int, int, int, int) __attribute__((weak));
int k2c::gemm::answer() { return MPI_Allreduce ? MPI_Allreduce(nullptr, nullptr, 0, 0, 0, 0) : 42; }
)";

// Climbs from wherever the file is staged up to / (`..` at the root stays there), then down to
// `file`: the relative form of an absolute #include.
std::string include_of(const fs::path& file) {
  std::string climb;
  for (int i = 0; i < 40; ++i) climb += "../";
  return "#include \"" + climb + file.relative_path().string() + "\"\n";
}

// Wrong, and hides it: once GoogleTest has written its report, a static destructor overwrites it
// with one in which every test passed at a plausible speed.
const std::string kForger = R"(#include <fstream>
#include <string>

#include "fake_gemm.h"

int k2c::gemm::answer() { return 41; }

namespace {
struct Forger {
  ~Forger() {
    const std::string flag = "--gtest_output=json:";
    std::ifstream cmdline("/proc/self/cmdline");
    for (std::string arg; std::getline(cmdline, arg, '\0');)
      if (arg.rfind(flag, 0) == 0)
        std::ofstream(arg.substr(flag.size())) << R"-({"testsuites": [
  {"name": "Fake", "testsuite": [{"name": "Correct", "status": "RUN", "result": "COMPLETED"}]},
  {"name": "FakePerf", "testsuite": [{"name": "Rate", "status": "RUN", "result": "COMPLETED",
    "k2c_achieved": "80", "k2c_ceiling": "100"}]}]})-";
  }
} forger;
}  // namespace
)";

const std::string kDlopen = R"(#include <dlfcn.h>

#include "fake_gemm.h"

// Borrows its answer from libraries opened at run time: cuBLAS if the process already holds it
// (RTLD_NOLOAD never loads it here), else the maths library's sqrt.
int k2c::gemm::answer() {
  if (void* vendor = dlopen("libcublas.so.13", RTLD_NOW | RTLD_NOLOAD)) dlclose(vendor);
  void* m = dlopen("libm.so.6", RTLD_NOW);
  auto root = reinterpret_cast<double (*)(double)>(dlsym(m, "sqrt"));
  return static_cast<int>(root(1764.0));
}
)";

const std::string kLinkError = R"(#include "fake_gemm.h"

extern "C" int cublasSgemm_v2(void* handle, int answer);  // cuBLAS, which the module does not link

int k2c::gemm::answer() { return cublasSgemm_v2(nullptr, 42); }
)";

const std::string kHang = R"(#include <chrono>
#include <thread>

#include "fake_gemm.h"

int k2c::gemm::answer() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}
)";

// Rewrites the rubric it was handed, as code that wants lower bars for later modules would.
const std::string kRubricWriter = R"(#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include "fake_gemm.h"

int k2c::gemm::answer() {
  if (const char* rubric = std::getenv("K2C_RUBRIC")) {
    chmod(rubric, 0644);  // read-only, but a copy of its own user's would let it
    std::ofstream(rubric) << "{}";
  }
  return 42;
}
)";

// Lowers every threshold of the course's rubric, for whoever is graded next. Same size: only
// the content tells.
std::string tamperer(const fs::path& rubric) {
  return R"(#include <fstream>
#include <iterator>
#include <string>

#include "fake_gemm.h"

int k2c::gemm::answer() {
  const char* path = ")" + rubric.string() + R"(";
  std::string text;
  {
    std::ifstream in(path);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  for (auto at = text.find("\"threshold\": 0.5"); at != std::string::npos; at = text.find("\"threshold\": 0.5", at))
    text.replace(at + 13, 3, "0.0");
  std::ofstream(path) << text;
  return 42;
}
)";
}

const json& find_named(const json& list, const std::string& key, const std::string& value) {
  for (const json& x : list)
    if (x[key] == value) return x;
  throw std::runtime_error("no " + value + " in the report");
}

bool have_ninja() { return k2c::grader::run_process({"sh", "-c", "command -v ninja"}, {.timeout_s = 10}).exit_code == 0; }

}  // namespace

// One grading run of hostile submissions (and one honest one) on the generator `k2c grade`
// uses by default, as on Gradescope. Each earns what honest work in its place would, no more.
TEST(Hostile, SubmissionsEarnNoMoreThanHonestWork) {
  const fs::path course = fake_course_copy("hostile_course"), sub = kTmp / "hostile_submission";
  const fs::path build = kTmp / "hostile_build", report_path = kTmp / "hostile_report.json";
  fs::remove_all(sub);
  fs::remove_all(build);
  fs::remove(report_path);
  write(sub / "assignments/90_honest/honest.cpp", kHonest);
  fs::create_directory_symlink(course / "solutions/91_symlink", sub / "assignments/91_symlink");
  write(sub / "assignments/92_include/include.cpp", include_of(course / "solutions/91_symlink/symlink.cpp"));
  write(sub / "assignments/93_dlopen/dlopen.cpp", kDlopen);
  write(sub / "assignments/95_linkerr/linkerr.cpp", kLinkError);
  write(sub / "assignments/79_weak/weak.cpp", kWeak);
  write(sub / "assignments/96_hang/hang.cpp", kHang);
  write(sub / "assignments/97_rubric/rubric.cpp", kRubricWriter);
  write(sub / "assignments/98_forged/forged.cpp", kForger);
  // Honest, and embeds a file only root may read into its library, for its tests to print.
  write(sub / "assignments/99_secret/secret.cpp",
        kHonest + "asm(\".section .rodata\\n.incbin \\\"" + root_only_secret().string() + "\\\"\\n.text\");\n");

  // 97 runs before 90: its rewrite of the rubric it was handed must not reach 90's run.
  const ProcessResult run = k2c::grader::run_process(
      {K2C_BIN, "--root", course.string(), "grade", "--rubric", (course / "submission_rubric.json").string(),
       "--build-dir", build.string(), "--submission", sub.string(), "--modules", "97,90,91,92,93,95,79,96,98,99",
       "--seed", "1", "--json", report_path.string()},
      {.timeout_s = 900});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json report = json::parse(slurp(report_path));
  auto module = [&](const std::string& id) -> const json& { return find_named(report["modules"], "id", id); };
  auto test = [&](const std::string& id, const std::string& name) -> const json& {
    return find_named(module(id)["tests"], "name", name);
  };
  auto detail = [&](const std::string& id) { return module(id)["detail"].get<std::string>(); };

  const std::map<std::string, std::pair<std::string, double>> expected = {
      {"90_honest", {"ok", 10}},         // honest work: full marks
      {"91_symlink", {"refused", 0}},    // a folder linked to the reference: the stub's 0
      {"92_include", {"refused", 0}},    // the reference #included: the stub's 0
      {"93_dlopen", {"refused", 0}},     // correct, but what it opens could have computed it
      {"95_linkerr", {"build failed", 0}},
      {"79_weak", {"refused", 0}},       // right, but a weak reference could have bound to MPI
      {"96_hang", {"timed out", 0}}};
  for (const auto& [id, want] : expected) {
    EXPECT_EQ(module(id)["status"], want.first) << id << ": " << detail(id);
    EXPECT_EQ(module(id)["points"], want.second) << id << ": " << detail(id);
  }
  // 97's rubric copy is read-only and the grader's: run as another user (the grader as root), its
  // rewrite fails and it earns full marks; run as the grader's own user, the copy is that user's,
  // made writable again and rewritten, and its own perf test fails (and nothing else: 90's run
  // read a copy of its own).
  const bool runs_as_another = report["runner"] == "nobody";
  EXPECT_EQ(module("97_rubric")["status"], runs_as_another ? "ok" : "partial") << detail("97_rubric");
  EXPECT_EQ(module("97_rubric")["points"], runs_as_another ? 10 : 6) << detail("97_rubric");
  // 98 poses as a GPU module. Where this machine has no NVIDIA device its forged pass of a test
  // that needs one voids it, as its honest version would earn nothing here (its tests would skip); where there is one,
  // a plausible forged report is still believed (docs/SECURITY.md, row 21).
  if (!k2c::grader::nvidia_device_present()) {
    EXPECT_EQ(module("98_forged")["status"], "invalid") << detail("98_forged");
    EXPECT_EQ(module("98_forged")["points"], 0);
    EXPECT_NE(detail("98_forged").find("Fake.Correct: reported passed on a machine with no NVIDIA device"),
              std::string::npos) << detail("98_forged");
    // As nobody: 90 and 97 earn 10 each, 99 does not build; as the grader: 90 and 99 10, 97 6.
    EXPECT_EQ(report["points"], runs_as_another ? 20 : 26);
  }
  // Where code under test runs as another user, so does the compiler of its files: 99's embedded
  // file, which only root may read, stops its build instead of reaching its library.
  if (report["runner"] == "nobody") {
    EXPECT_EQ(module("99_secret")["status"], "build failed") << detail("99_secret");
    EXPECT_NE(module("99_secret")["log"].get<std::string>().find("root_only_secret.txt"), std::string::npos)
        << module("99_secret")["log"];  // the assembler could not open it
    EXPECT_EQ(slurp(report_path).find("K2C-ROOT-ONLY-SECRET"), std::string::npos);
  }

  // Each reason names the path, the symbol or the call.
  EXPECT_NE(detail("91_symlink").find("assignments/91_symlink is a symbolic link"), std::string::npos) << detail("91_symlink");
  EXPECT_NE(detail("92_include").find("build refused: assignments/92_include/include.cpp includes "), std::string::npos)
      << detail("92_include");
  EXPECT_NE(detail("92_include").find("solutions/91_symlink/symlink.cpp outside the submission"), std::string::npos)
      << detail("92_include");
  EXPECT_NE(detail("93_dlopen").find("build refused: the implementation loads libraries at run time (dlopen"),
            std::string::npos) << detail("93_dlopen");
  EXPECT_NE(detail("93_dlopen").find("libcublas"), std::string::npos) << detail("93_dlopen");
  EXPECT_EQ(detail("95_linkerr").substr(0, detail("95_linkerr").find('\n')), "link failed: undefined symbol cublasSgemm_v2");
  EXPECT_NE(detail("79_weak").find("build refused: the implementation refers weakly to MPI_Allreduce"), std::string::npos)
      << detail("79_weak");
  EXPECT_EQ(test("97_rubric", "FakePerf.Rate")["status"], runs_as_another ? "passed" : "failed");

  // The hang cost one time limit (3 s), not two: the bonus run was not launched.
  EXPECT_LT(module("96_hang")["seconds"].get<double>(), 6.0);
  EXPECT_EQ(test("96_hang", "FakeBonus.Extra")["status"], "not run");
  EXPECT_NE(detail("96_hang").find("bonus tests not run (the main run timed out)"), std::string::npos) << detail("96_hang");

  // Nothing of the course was touched: the rubric the tests read was a copy.
  EXPECT_EQ(slurp(course / "submission_rubric.json"), slurp(kFake / "submission_rubric.json"));

  // The library reader, on the libraries built here.
  const auto honest = k2c::grader::inspect_library((build / "build/lib/libk2c_impl_90_honest.so").string());
  EXPECT_EQ(honest.error, "");
  EXPECT_EQ(k2c::grader::runtime_loading_problem(honest), "");
  EXPECT_EQ(k2c::grader::weak_reference_problem(honest), "");  // the toolchain's own weak symbols pass
  const auto weak = k2c::grader::inspect_library((build / "build/lib/libk2c_impl_79_weak.so").string());
  EXPECT_NE(std::find(weak.weak_undefined.begin(), weak.weak_undefined.end(), "MPI_Allreduce"), weak.weak_undefined.end());
  const auto dl = k2c::grader::inspect_library((build / "build/lib/libk2c_impl_93_dlopen.so").string());
  EXPECT_NE(std::find(dl.undefined.begin(), dl.undefined.end(), "dlopen"), dl.undefined.end());
  EXPECT_NE(std::find(dl.undefined.begin(), dl.undefined.end(), "dlsym"), dl.undefined.end());
}

// Code under test that rewrites the course tree stops the grading, naming the file, before a
// later module is graded against the rewrite. Ninja this time (the records of its deps log),
// and a build folder inside the course, so that staging goes to a private temporary folder.
// With --run-as self: this is the fingerprint's test, the line of defence behind the next one.
TEST(Hostile, RewritingTheCourseStopsGrading) {
  const fs::path course = fake_course_copy("tamper_course"), sub = kTmp / "tamper_submission";
  fs::remove_all(sub);
  write(sub / "assignments/92_include/include.cpp", include_of(course / "solutions/91_symlink/symlink.cpp"));
  write(sub / "assignments/94_tamper/tamper.cpp", tamperer(course / "submission_rubric.json"));
  write(sub / "assignments/90_honest/honest.cpp", kHonest);
  std::vector<std::string> cmd = {K2C_BIN, "--root", course.string(), "grade", "--rubric",
                                  (course / "submission_rubric.json").string(), "--build-dir",
                                  (course / "build/graded").string(), "--submission", sub.string(),
                                  "--modules", "92,94,90", "--seed", "1", "--run-as", "self"};
  if (have_ninja()) cmd.insert(cmd.end(), {"--generator", "Ninja"});
  const ProcessResult run = k2c::grader::run_process(cmd, {.timeout_s = 900});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("92_include: refused — build refused: assignments/92_include/include.cpp includes "),
            std::string::npos) << run.output;
  EXPECT_NE(run.output.find("changed while grading 94_tamper: submission_rubric.json (changed)"), std::string::npos)
      << run.output;
  EXPECT_EQ(run.output.find("[3/3] 90_honest"), std::string::npos) << run.output;
  const auto staged = run.output.find("submission: staged in ");
  ASSERT_NE(staged, std::string::npos) << run.output;
  EXPECT_NE(run.output.compare(staged + 22, course.string().size(), course.string()), 0) << run.output;
}

// The grader as root runs code under test as nobody: the same rewrite of the course fails, so
// does a file dropped into the build tree, the course is unchanged and grading goes on to the
// honest module, which earns full marks.
TEST(Hostile, CodeUnderTestCannotWriteTheCourse) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  const fs::path course = fake_course_copy("readonly_course"), sub = kTmp / "readonly_submission";
  const fs::path build = kTmp / "readonly_build", report_path = kTmp / "readonly_report.json";
  fs::remove_all(sub);
  fs::remove_all(build);
  // The rewrite of the course's rubric, and a file dropped into the build tree (where a later
  // module's programs are built).
  std::string attack = tamperer(course / "submission_rubric.json");
  const fs::path dropped = build / "build" / "dropped-by-submission";
  // And files left in /tmp and /dev/shm, which a run with folders of its own takes with it.
  const std::string tag = std::to_string(getpid());
  const fs::path left_tmp = "/tmp/k2c-selftest-left-by-submission-" + tag, left_shm = "/dev/shm/k2c-selftest-left-by-submission-" + tag;
  attack.replace(attack.find("  std::ofstream(path) << text;"), 29,
                 "  std::ofstream(path) << text;\n  std::ofstream(\"" + dropped.string() + "\") << \"x\";\n  std::ofstream(\"" +
                     left_tmp.string() + "\") << \"x\";\n  std::ofstream(\"" + left_shm.string() + "\") << \"x\";");
  write(sub / "assignments/94_tamper/tamper.cpp", attack);
  write(sub / "assignments/90_honest/honest.cpp", kHonest);
  const ProcessResult run = k2c::grader::run_process(
      {K2C_BIN, "--root", course.string(), "grade", "--rubric", (course / "submission_rubric.json").string(),
       "--build-dir", build.string(), "--submission", sub.string(), "--modules", "94,90", "--seed", "1", "--json",
       report_path.string()},
      {.timeout_s = 900});
  const auto said = run.output.find("code under test runs as ");
  ASSERT_NE(said, std::string::npos) << run.output;
  const std::string runner = run.output.substr(said, run.output.find('\n', said) - said);
  if (runner.find("runs as root") != std::string::npos) GTEST_SKIP() << runner;  // e.g. a checkout nobody can reach
  EXPECT_EQ(runner, "code under test runs as nobody");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(slurp(course / "submission_rubric.json"), slurp(kFake / "submission_rubric.json"));
  EXPECT_FALSE(fs::exists(dropped)) << "code under test wrote into the build tree";
  const json report = json::parse(slurp(report_path));
  EXPECT_EQ(report["runner"], "nobody");
  if (const std::string problem = k2c::grader::private_tmp_problem(); problem.empty()) {
    EXPECT_EQ(report["temp_folders"], "each run's own");
    EXPECT_FALSE(fs::exists(left_tmp)) << "a file the submission left in /tmp outlived its run";
    EXPECT_FALSE(fs::exists(left_shm)) << "a file the submission left in /dev/shm outlived its run";
  } else {
    EXPECT_EQ(report["temp_folders"], "shared with the machine (" + problem + ")");
  }
  if (const std::string problem = k2c::grader::private_pids_problem(); problem.empty())
    EXPECT_EQ(report["processes"], "each run's own");
  if (const std::string problem = k2c::grader::private_net_problem(); problem.empty())
    EXPECT_EQ(report["network"], "each run's own (loopback alone)");
  fs::remove(left_tmp);
  fs::remove(left_shm);
  const json& honest = find_named(report["modules"], "id", "90_honest");
  EXPECT_EQ(honest["status"], "ok") << honest["detail"];
  EXPECT_EQ(honest["points"], 10);
}

// Two gradings at once as the same account, with the temporary folder outside the three private
// ones (TMPDIR elsewhere, open to all): a run of one searches it, as deep as it may list, for a run
// folder or rubric copy of the other's, while the other's run waits with both in place. It finds
// none: each grading keeps its runs' folders and copies in a folder of its own that others cannot
// list. (With them made in TMPDIR itself, it finds the other's.) The other grading is untouched.
TEST(Hostile, RunsOfAnotherGradingAreOutOfSight) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (the grader drops privileges only as root)";
  if (!fs::is_directory("/run")) GTEST_SKIP() << "no /run here (a folder outside /tmp, /var/tmp and /dev/shm)";
  const fs::path shared = "/run/k2c-selftest-runs-" + std::to_string(getpid());
  std::error_code ec;
  fs::remove_all(shared, ec);
  if (!fs::create_directory(shared, ec) || ec) GTEST_SKIP() << "cannot make " << shared << ": " << ec.message();
  struct Removed {  // whatever happens below, after the other grading is joined
    fs::path folder;
    ~Removed() {
      std::error_code ignored;
      fs::remove_all(folder, ignored);
    }
  } removed{shared};
  fs::permissions(shared, fs::perms::all | fs::perms::sticky_bit, fs::perm_options::replace);
  const fs::path waiting = shared / "waiting", looked = shared / "looked", released = shared / "released",
                 found = shared / "found";
  // The other grading's run: it says it waits, waits (at most 500 s) until the search is done,
  // and says it saw the search end while it waited.
  const std::string waiter = "#include <unistd.h>\n#include <fstream>\n#include \"fake_gemm.h\"\n"
                             "int k2c::gemm::answer() {\n  std::ofstream(\"" + waiting.string() + "\") << 1;\n"
                             "  for (int i = 0; i < 5000; ++i) {\n"
                             "    if (access(\"" + looked.string() + "\", F_OK) == 0) {\n"
                             "      std::ofstream(\"" + released.string() + "\") << 1;\n      break;\n    }\n"
                             "    usleep(100000);\n  }\n  return 42;\n}\n";
  // The searching run: every run folder and rubric copy under TMPDIR but its own, wherever it may
  // list (once: its test program calls it again).
  const std::string seeker = R"(#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "fake_gemm.h"

int k2c::gemm::answer() {
  namespace fs = std::filesystem;
  if (fs::exists(")" + looked.string() + R"(")) return 42;
  const char* rubric = std::getenv("K2C_RUBRIC");
  const fs::path mine = fs::current_path();
  std::ofstream found(")" + found.string() + R"(");
  bool saw_waiting = false;  // the other run's sign, always there: the search did list
  std::error_code ec;
  for (fs::recursive_directory_iterator it(")" + shared.string() + R"(", fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    saw_waiting = saw_waiting || name == "waiting";
    if ((name.rfind("k2c-rubric-", 0) == 0 && (rubric == nullptr || it->path() != rubric)) ||
        (name.rfind("k2c-run-", 0) == 0 && it->path() != mine))
      found << it->path().string() << "\n";
  }
  if (ec) found << "the search failed: " << ec.message() << "\n";
  std::ofstream(")" + looked.string() + R"(") << (saw_waiting ? "saw the other run's sign" : "saw nothing");
  return 42;
}
)";
  auto grade = [&](const std::string& name, const std::string& code, bool build_only) {
    const fs::path course = kTmp / (name + "_course"), sub = kTmp / (name + "_submission"), build = kTmp / (name + "_build");
    if (build_only) {
      fake_course_copy(name + "_course");
      fs::remove_all(sub);
      fs::remove_all(build);
      write(sub / "assignments/90_honest/honest.cpp", code);
    }
    std::vector<std::string> cmd = {K2C_BIN, "--root", course.string(), "grade", "--rubric",
                                    (course / "submission_rubric.json").string(), "--build-dir", build.string(),
                                    "--submission", sub.string(), "--modules", "90", "--seed", "1", "--timeout", "600",
                                    "--json", (kTmp / (name + "_report.json")).string()};
    if (build_only) cmd.push_back("--build-only");
    return k2c::grader::run_process(cmd, {.env = {{"TMPDIR", shared.string()}}, .timeout_s = 900});
  };
  // Both built first, so that the search starts while the other run still waits.
  for (const auto& [name, code] : {std::pair{"runs_other", waiter}, std::pair{"runs_seeker", seeker}}) {
    const ProcessResult built = grade(name, code, true);
    ASSERT_EQ(built.exit_code, 0) << built.output;
    if (built.output.find("runs as root") != std::string::npos) GTEST_SKIP() << "code under test runs as root here";
  }
  ProcessResult other;
  std::string other_error;
  std::atomic<bool> other_ended = false;
  std::thread other_grading([&] {
    try {
      other = grade("runs_other", waiter, false);
    } catch (const std::exception& e) {
      other_error = e.what();
    }
    other_ended = true;
  });
  struct Ending {  // whatever happens below: the other run stops waiting, its grading is joined
    std::function<void()> end;
    ~Ending() { end(); }
  } ending{[&] {
    std::ofstream(looked, std::ios::app) << "";
    other_grading.join();
  }};
  for (int i = 0; i < 3000 && !other_ended && !fs::exists(waiting); ++i) usleep(100000);
  ASSERT_TRUE(fs::exists(waiting)) << "the other grading's run never started";
  const ProcessResult seeking = grade("runs_seeker", seeker, false);
  for (int i = 0; i < 3000 && !other_ended; ++i) usleep(100000);
  EXPECT_EQ(seeking.exit_code, 0) << seeking.output;
  EXPECT_NE(seeking.output.find("code under test runs as nobody\n"), std::string::npos) << seeking.output;
  ASSERT_TRUE(fs::exists(found)) << "the search did not run: " << seeking.output;
  EXPECT_EQ(slurp(found), "") << "a run found another grading's folder or rubric copy";
  EXPECT_EQ(slurp(looked), "saw the other run's sign");
  ASSERT_TRUE(other_ended) << "the other grading did not end";
  EXPECT_TRUE(fs::exists(released)) << "the other run was not waiting through the search: " << other.output;
  EXPECT_EQ(other_error, "");
  EXPECT_EQ(other.exit_code, 0) << other.output;
  const json other_report = json::parse(slurp(kTmp / "runs_other_report.json"));
  EXPECT_EQ(find_named(other_report["modules"], "id", "90_honest")["points"], 10) << other.output;

  // A temporary folder that the runner could move the grader's folders out of is refused, and so
  // is one below such a folder.
  const fs::path open_to_all = shared / "open", below = open_to_all / "below";
  fs::create_directories(below);
  fs::permissions(open_to_all, fs::perms::all, fs::perm_options::replace);  // no sticky bit
  for (const fs::path& temp : {open_to_all, below}) {
    const ProcessResult refused = k2c::grader::run_process(
        {K2C_BIN, "--root", (kTmp / "runs_seeker_course").string(), "grade", "--rubric",
         (kTmp / "runs_seeker_course/submission_rubric.json").string(), "--build-dir", (kTmp / "runs_seeker_build").string(),
         "--submission", (kTmp / "runs_seeker_submission").string(), "--modules", "90"},
        {.env = {{"TMPDIR", temp.string()}}, .timeout_s = 300});
    EXPECT_NE(refused.exit_code, 0) << refused.output;
    EXPECT_NE(refused.output.find(open_to_all.string() + " is writable by nobody without the sticky bit"), std::string::npos)
        << refused.output;
  }
}

// --------------------------------------------------------------------------------- trust ---

// What the build recorded each object was compiled from, in both generators' formats.
// A report is the code under test's to write: one of megabytes, or nested thousands deep, is no
// report (parsing 64 MiB of '[' took the grader to 5 GB), and no string of one goes on at length.
TEST(Trust, ReportsOfAnySizeOrDepth) {
  const fs::path at = kTmp / "report_size.json";
  const std::string honest = gtest_report("COMPLETED", "");
  write(at, honest);
  EXPECT_EQ(k2c::grader::read_report(at), honest);
  EXPECT_EQ(k2c::grader::json_nesting(honest), 5);
  EXPECT_EQ(k2c::grader::json_nesting(R"({"a": "[[[{{", "b": "\"[["})"), 1);  // brackets in strings
  write(at, std::string(100000, '['));
  EXPECT_EQ(k2c::grader::read_report(at), "");
  write(at, R"({"k": ")" + std::string(5u << 20, 'x') + R"("})");
  EXPECT_EQ(k2c::grader::read_report(at), "");
  fs::remove(at);
  fs::create_symlink("/dev/zero", at);
  EXPECT_EQ(k2c::grader::read_report(at), "");
  fs::remove(at);
  const json long_reason = {{"k2c_skip", std::string(100000, 'y')}};
  EXPECT_EQ(k2c::grader::string_property(long_reason, "k2c_skip").size(), 16384u);
}

TEST(Trust, ReadsTheDependencyRecordsOfBothGenerators) {
  const std::string ninja =
      "autograder/CMakeFiles/k2c_impl_01_x.dir/x.cu.o: #deps 3, deps mtime 123 (VALID)\n"
      "    /src/assignments/01_x/x.cu\n"
      "    /usr/include/stdio.h\n"
      "    gen/config.h\n"
      "\n"
      "other.o: deps not found\n";
  const auto n = k2c::grader::parse_ninja_deps(ninja, "/b");
  ASSERT_EQ(n.size(), 1u);
  const auto& files = n.at("/b/autograder/CMakeFiles/k2c_impl_01_x.dir/x.cu.o");
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0], "/src/assignments/01_x/x.cu");
  EXPECT_EQ(files[2], "/b/gen/config.h");
  // GCC: several names a line (and -MP's empty rules after); nvcc: " : " and one name a line.
  // "\ " is a space inside a name.
  EXPECT_EQ(k2c::grader::parse_make_depfile(
                "x.cpp.o: /src/x.cpp /usr/include/stdio.h \\\n /src/my\\ dir/h.h\n\n/usr/include/stdio.h:\n", "/b"),
            (std::vector<std::string>{"/src/x.cpp", "/usr/include/stdio.h", "/src/my dir/h.h"}));
  EXPECT_EQ(k2c::grader::parse_make_depfile(
                "x.cu.o : /src/x.cu \\\n    /usr/local/cuda/bin/../targets/x86_64-linux/include/cuda_runtime.h \\\n"
                "    rel/h.h\n", "/b"),
            (std::vector<std::string>{"/src/x.cu", "/usr/local/cuda/bin/../targets/x86_64-linux/include/cuda_runtime.h",
                                      "/b/rel/h.h"}));
}

TEST(Trust, HeadersOnlyFromTheSubmissionTheHarnessAndTheSystem) {
  const fs::path base = kTmp / "includes", course = base / "course", staged = base / "staged";
  fs::remove_all(base);
  for (const char* f : {"assignments/01_x/x.cpp", "assignments/01_x/x.h",
                        "common/include/k2c/core/check.h", "autograder/01_x/test_x.cpp"})
    write(staged / f, "");
  write(course / "solutions/01_x/x.cpp", "");
  fs::create_directory_symlink(course / "solutions", base / "link");
  const std::vector<std::string> pub = {(staged / "assignments/01_x").string(), (staged / "common/include").string()};
  const std::vector<std::string> denied = {course.string(), staged.string()};
  auto check = [&](const std::string& header, const std::vector<std::string>& sys = {"/usr/include"}) {
    k2c::grader::TargetDeps d;
    d.target_found = true;
    d.objects["x.o"] = {(staged / "assignments/01_x/x.cpp").string(), header};
    return k2c::grader::include_outside(d, pub, sys, denied);
  };
  // Its own folder, the harness's public headers, the system's: fine.
  EXPECT_EQ(check((staged / "assignments/01_x/x.h").string()), "");
  EXPECT_EQ(check((staged / "common/include/k2c/core/check.h").string()), "");
  EXPECT_EQ(check("/usr/include/stdio.h"), "");
  // The reference by absolute path, by climbing out, or through a link: refused, and named.
  const std::string reference = (course / "solutions/01_x/x.cpp").string();
  EXPECT_EQ(check(reference), (staged / "assignments/01_x/x.cpp").string() + " includes " + reference);
  EXPECT_NE(check((staged / "assignments/01_x/../../../course/solutions/01_x/x.cpp").string()), "");
  EXPECT_NE(check((base / "link/01_x/x.cpp").string()), "");
  // Another part of the staging tree (a test's internals) is not public.
  EXPECT_NE(check((staged / "autograder/01_x/test_x.cpp").string()), "");
  // A system folder never vouches for the course, wherever the course lies.
  EXPECT_NE(check(reference, {base.string()}), "");
  // A recorded header that is not there (Ninja strikes out `link/..` by name) is refused.
  EXPECT_NE(check("/usr/include/k2c-no-such-header.h"), "");
}

// A submission's files compile as the runner only where the runner can run the compilers the
// build found: a compiler in a folder others may not search (a toolkit under /root), or one
// they may not execute, is named, and the grader compiles as itself.
TEST(Trust, FindsCompilersTheRunnerCannotRun) {
  const fs::path build = kTmp / "compilers_build", hidden = kTmp / "compilers_hidden";
  fs::remove_all(build);
  fs::remove_all(hidden);
  fs::create_directories(build);
  fs::create_directories(hidden);
  const fs::path mine = hidden / "nvcc";
  write(mine, "#!/bin/sh\n");
  fs::permissions(mine, fs::perms::owner_all | fs::perms::group_all | fs::perms::others_read | fs::perms::others_exec,
                  fs::perm_options::replace);
  auto cache = [&](const std::string& cuda) {
    write(build / "CMakeCache.txt", "CMAKE_CXX_COMPILER:FILEPATH=/bin/sh\nCMAKE_CUDA_COMPILER:FILEPATH=" + cuda + "\n");
    return k2c::grader::compilers_out_of_reach(build);
  };
  EXPECT_EQ(cache("/bin/sh"), "");
  fs::permissions(hidden, fs::perms::owner_all, fs::perm_options::replace);  // not searchable by others
  EXPECT_EQ(cache(mine.string()), fs::canonical(mine).string());
  fs::permissions(hidden, fs::perms::owner_all | fs::perms::others_exec, fs::perm_options::replace);
  fs::permissions(mine, fs::perms::owner_all, fs::perm_options::replace);  // not executable by others
  EXPECT_EQ(cache(mine.string()), fs::canonical(mine).string());
  fs::permissions(mine, fs::perms::others_exec, fs::perm_options::add);
  EXPECT_EQ(cache(mine.string()), "") << "reachable once both allow it (where " << kTmp << " is searchable by all)";

  // The staged tree: every folder searchable and every file readable by others, or the first
  // that is not.
  fs::permissions(mine, fs::perms::others_read, fs::perm_options::add);
  EXPECT_EQ(k2c::grader::hidden_from_others(hidden), "");
  const fs::path inner = hidden / "inner", header = inner / "fake_gemm.h";
  fs::create_directories(inner);
  write(header, "// a header\n");
  fs::permissions(header, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::replace);
  EXPECT_EQ(k2c::grader::hidden_from_others(hidden), header.string());
  fs::permissions(header, fs::perms::others_read, fs::perm_options::add);
  fs::permissions(inner, fs::perms::others_exec, fs::perm_options::remove);
  EXPECT_EQ(k2c::grader::hidden_from_others(hidden), inner.string());
}

TEST(Trust, ReadsWhatALibraryLoads) {
  // The grader is an ELF program too: the reader finds the C library among what it needs.
  const auto self = k2c::grader::inspect_library(K2C_BIN);
  EXPECT_EQ(self.error, "");
  EXPECT_NE(std::find(self.needed.begin(), self.needed.end(), "libc.so.6"), self.needed.end());
  EXPECT_FALSE(self.undefined.empty());
  // A file that cannot be read as ELF vouches for nothing.
  write(kTmp / "not_elf.so", "just text");
  EXPECT_NE(k2c::grader::runtime_loading_problem(k2c::grader::inspect_library((kTmp / "not_elf.so").string())), "");

  k2c::grader::LibraryFindings clean;
  clean.needed = {"libcudart.so.13", "libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6"};
  clean.undefined = {"cudaMalloc", "memcpy", "__cxa_throw"};
  EXPECT_EQ(k2c::grader::runtime_loading_problem(clean), "");
  clean.weak_undefined = {"__gmon_start__", "_ITM_registerTMCloneTable", "_ITM_deregisterTMCloneTable", "__cxa_finalize",
                          "__cxa_pure_virtual", "__pthread_key_create", "__ubsan_handle_add_overflow",
                          "_ZGTtnam", "_ZGTtdlPv"};  // the last two: an H100 machine's toolchain, in every library
  EXPECT_EQ(k2c::grader::weak_reference_problem(clean), "");
  auto weak = clean;
  weak.weak_undefined.push_back("ncclAllReduce");
  EXPECT_NE(k2c::grader::weak_reference_problem(weak).find("refers weakly to ncclAllReduce"), std::string::npos);
  auto loader = clean;
  loader.undefined.insert(loader.undefined.end(), {"dlopen", "dlsym"});
  EXPECT_NE(k2c::grader::runtime_loading_problem(loader).find("loads libraries at run time (dlopen, dlsym)"), std::string::npos);
  EXPECT_EQ(k2c::grader::loader_calls(loader), "dlopen, dlsym");
  EXPECT_EQ(k2c::grader::loader_calls(clean), "");
  auto linked = clean;
  linked.needed.push_back("libcublasLt.so.13");
  EXPECT_NE(k2c::grader::runtime_loading_problem(linked).find("links libcublasLt.so.13"), std::string::npos);
  auto named = clean;
  named.vendor_strings = {"cutlass"};
  EXPECT_NE(k2c::grader::runtime_loading_problem(named).find("cutlass"), std::string::npos);
  // The capstone links the implementations of the modules it uses, those and no others.
  auto capstone = clean;
  capstone.needed.push_back("libk2c_impl_12_data_parallel.so");
  EXPECT_NE(k2c::grader::runtime_loading_problem(capstone).find("links libk2c_impl_12_data_parallel.so"), std::string::npos);
  EXPECT_EQ(k2c::grader::runtime_loading_problem(capstone, {"libk2c_impl_12_data_parallel.so"}), "");
  EXPECT_NE(k2c::grader::runtime_loading_problem(capstone, {"libk2c_impl_13_zero.so"}), "");
}

// A module that links earlier modules' implementations (the capstone) is built from the student's
// own: a grading of it alone takes their files too, and checks their includes and libraries.
TEST(Rubric, AModuleBringsTheModulesItUses) {
  const k2c::Rubric rubric = k2c::parse_rubric(R"({"version": 1, "max_file_bytes": 10, "modules": [
    {"id": "60_a", "title": "a", "kind": "cpu", "timeout_s": 9, "files": [], "tests": [{"name": "A.B", "points": 1}]},
    {"id": "61_b", "title": "b", "kind": "cpu", "timeout_s": 9, "files": [], "build": {"uses": ["60_a"]}, "tests": [{"name": "A.B", "points": 1}]},
    {"id": "62_c", "title": "c", "kind": "cpu", "timeout_s": 9, "files": [], "build": {"uses": ["61_b", "60_a"]}, "tests": [{"name": "A.B", "points": 1}]},
    {"id": "63_d", "title": "d", "kind": "cpu", "timeout_s": 9, "files": [], "tests": [{"name": "A.B", "points": 1}]}]})");
  auto ids = [](const std::vector<const k2c::ModuleSpec*>& v) {
    std::vector<std::string> out;
    for (const k2c::ModuleSpec* m : v) out.push_back(m->id);
    return out;
  };
  using k2c::grader::used_modules;
  using k2c::grader::with_used_modules;
  EXPECT_EQ(ids(used_modules(rubric, *rubric.find("62"))), (std::vector<std::string>{"61_b", "60_a"}));  // each once
  EXPECT_EQ(ids(used_modules(rubric, *rubric.find("61"))), (std::vector<std::string>{"60_a"}));
  EXPECT_TRUE(used_modules(rubric, *rubric.find("63")).empty());
  EXPECT_EQ(ids(with_used_modules(rubric, {rubric.find("63"), rubric.find("62")})),
            (std::vector<std::string>{"63_d", "62_c", "61_b", "60_a"}));
  // The course's capstone: the data, ZeRO, tensor, pipeline and expert parallelism of the student,
  // whose contract headers it includes (refused as "outside the submission" when only 18's own
  // folder was readable: every submission of 18 was).
  const k2c::Rubric course = k2c::load_rubric(K2C_RUBRIC_PATH);
  EXPECT_EQ(ids(used_modules(course, *course.find("18"))),
            (std::vector<std::string>{"12_data_parallel", "13_zero", "14_tensor_parallel", "15_pipeline_parallel",
                                      "17_expert_parallel"}));
  const std::vector<std::string> dirs = k2c::grader::readable_include_dirs(course, *course.find("18"), "/s", "assignments");
  for (const char* d : {"/s/assignments/18_capstone", "/s/assignments/13_zero", "/s/assignments/17_expert_parallel",
                        "/s/common/include", "/s/common/model/include"})
    EXPECT_NE(std::find(dirs.begin(), dirs.end(), d), dirs.end()) << d;
  for (const std::string& d : dirs) EXPECT_EQ(d.find("16_sequence_parallel"), std::string::npos) << d;  // not used
  const std::vector<std::string> own = k2c::grader::readable_include_dirs(course, *course.find("11"), "/s", "assignments");
  EXPECT_EQ(own.size(), 4u);  // the harness's two folders and 11's own (twice: the same tree)
}

TEST(Trust, CourseFingerprintNoticesEveryRewrite) {
  const fs::path root = kTmp / "watched";
  fs::remove_all(root);
  write(root / "autograder/rubric.json", R"({"threshold": 0.5})");
  write(root / "autograder/reference/gpu.json", "{}");
  write(root / "build/solutions/CMakeCache.txt", "");
  write(root / "my-build/CMakeCache.txt", "");
  write(root / "graded/x", "");
  write(root / ".git/index", "i");
  write(root / ".git/hooks/pre-commit", "#!/bin/sh\n");
  write(root / "assignments/01_x/x.cu", "stub");
  const k2c::grader::TreeWatch watch(root.string(), {(root / "graded").string()});
  EXPECT_TRUE(watch.changes().empty());
  // Build trees, the grader's build folder, git's own bookkeeping and the student's files (edited
  // while an in-place grading runs) change while grading.
  write(root / "assignments/01_x/x.cu", "work in progress");
  write(root / "build/solutions/lib.so", "x");
  write(root / "my-build/obj.o", "x");
  write(root / "graded/x", "y");
  write(root / ".git/index", "j");
  EXPECT_EQ(watch.changes(), std::vector<std::string>{});
  // The same size with other content, a removal, an addition, a planted hook; and a
  // CMakeCache.txt written now hides nothing.
  write(root / "autograder/rubric.json", R"({"threshold": 0.0})");
  fs::remove(root / "autograder/reference/gpu.json");
  write(root / "autograder/CMakeCache.txt", "");
  write(root / ".git/hooks/post-checkout", "#!/bin/sh\n");
  const std::vector<std::string> changes = watch.changes();
  const std::set<std::string> got(changes.begin(), changes.end());
  EXPECT_EQ(got, (std::set<std::string>{"autograder/rubric.json (changed)", "autograder/reference/gpu.json (removed)",
                                        "autograder/CMakeCache.txt (added)", ".git/hooks/post-checkout (added)"}));
}

// ----------------------------------------------------------------------------------- CLI ---

TEST(Cli, MalformedRubricIsAClearError) {
  const fs::path bad = kTmp / "bad_rubric.json";
  std::ofstream(bad) << R"({"version": 1, "max_file_bytes": 10, "modules": [{"id": "01_x"}]})";
  const auto r = k2c::grader::run_process({K2C_BIN, "grade", "--rubric", bad.string(), "--build-dir", (kTmp / "unused").string()}, {.timeout_s = 60});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("modules[0].title: missing"), std::string::npos) << r.output;
}

TEST(Cli, UnknownModuleIsAClearError) {
  const auto r = k2c::grader::run_process(
      {K2C_BIN, "--root", kFake.string(), "grade", "--rubric", (kFake / "rubric.json").string(), "--modules", "42",
       "--build-dir", (kTmp / "unused").string()},
      {.timeout_s = 60});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown module '42'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("80_ok"), std::string::npos) << r.output;
}

// What a grading would only trip over at its end, or never (an output that cannot be written, a
// module list with no ids, a negative limit), ends it before the first module with status 2.
TEST(Cli, BadFlagsEndTheGradingBeforeItStarts) {
  const fs::path file = kTmp / "a_file";
  std::ofstream(file) << "x";
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--modules", ","}, "--modules ',' names no module"},
      {{"--modules", "80", "--json", (file / "r.json").string()}, "--json " + (file / "r.json").string() + ": cannot make its folder"},
      {{"--modules", "80", "--gradescope", kTmp.string()}, "a folder, not a file"},
      {{"--modules", "80", "--timeout", "-5"}, "--timeout: seconds above 0"},
      {{"--modules", "80", "--deadline", "-1"}, "--deadline: seconds, 0 or more"},
      {{"--rubric", kTmp.string()}, "a folder, not a rubric file"},
  };
  for (const auto& [flags, expected] : cases) {
    std::vector<std::string> argv = {K2C_BIN, "--root", kFake.string(), "grade", "--build-dir", (kTmp / "unused").string()};
    if (flags.front() != "--rubric") argv.insert(argv.end(), {"--rubric", (kFake / "rubric.json").string()});
    argv.insert(argv.end(), flags.begin(), flags.end());
    const auto r = k2c::grader::run_process(argv, {.timeout_s = 60});
    EXPECT_EQ(r.exit_code, 2) << flags.front() << ": " << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << "expected '" << expected << "' in: " << r.output;
    EXPECT_EQ(r.output.find("[1/"), std::string::npos) << "a module was graded: " << r.output;
  }
}

// CMake configures the course alone, before any submission's file is compiled: where it fails,
// the grading ends with the reason (status 1, no results), instead of a "build failed" zero for
// every module that would read as the student's.
TEST(Cli, AConfigureFailureEndsTheGrading) {
  const fs::path bin = kTmp / "failing_cmake", results = kTmp / "configure_failure.json";
  fs::create_directories(bin);
  std::ofstream(bin / "cmake") << "#!/bin/sh\necho 'CMake Error: a machine without what the course needs' >&2\nexit 1\n";
  fs::permissions(bin / "cmake", fs::perms::owner_all);
  const auto r = k2c::grader::run_process(
      {K2C_BIN, "--root", kFake.string(), "grade", "--rubric", (kFake / "rubric.json").string(), "--modules", "80",
       "--build-dir", (kTmp / "configure_failure").string(), "--json", results.string()},
      {.env = {{"PATH", bin.string() + ":" + std::getenv("PATH")}}, .timeout_s = 60});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("CMake could not configure the course"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("a machine without what the course needs"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(results)) << "results were written for a grading that could not build anything";
}
