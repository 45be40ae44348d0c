// test_grader.cpp — the project's own tests of the k2c grader. CPU only.
//
// Verdicts:   evaluate_module on hand-made exits and reports (no processes involved).
// End to end: `k2c grade` on autograder/selftest/fake_course, whose modules crash, hang, exit
//             early, miss a test, claim an impossible figure, print 50 MiB, hit a sticky device
//             error, are stubs, or do not compile; each must cost its own module only.
// Intake:     a submission with a symlink, an unlisted file and an oversized file.
// CLI:        a malformed rubric and an unknown module are clear errors (exit status 2).
#include <filesystem>
#include <fstream>
#include <map>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "grade.h"
#include "intake.h"
#include "k2c/rubric.h"
#include "k2c/todo.h"
#include "process.h"

namespace fs = std::filesystem;
using nlohmann::json;
using k2c::grader::evaluate_module;
using k2c::grader::ProcessResult;

namespace {

const fs::path kFake = fs::path(K2C_SELFTEST_DIR) / "fake_course";
const fs::path kTmp = K2C_SELFTEST_TMP;

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

TEST(Verdict, ImpossibleFigureVoidsModule) {
  const auto m = evaluate_module(two_test_module(), exited(0),
                                 gtest_report("COMPLETED", R"(, "k2c_achieved": "300", "k2c_ceiling": "100")"),
                                 "assignments", 9);
  EXPECT_EQ(m.status, "invalid");
  EXPECT_EQ(m.points, 0);
  EXPECT_NE(m.detail.find("impossible"), std::string::npos);
}

TEST(Verdict, PerfTestWithoutFiguresEarnsNothing) {
  const auto m = evaluate_module(two_test_module(), exited(0), gtest_report("COMPLETED", ""), "assignments", 9);
  EXPECT_EQ(m.points, 6);
  EXPECT_EQ(m.tests[1].status, "failed");
}

TEST(Verdict, NotImplemented) {
  const std::string marker = k2c::kNotImplementedMarker;
  const auto m = evaluate_module(two_test_module(), exited(1),
                                 gtest_report("COMPLETED", R"(, "failures": [{"failure": ")" + marker + R"( write it"}])",
                                              marker + " write it"),
                                 "assignments", 9);
  EXPECT_EQ(m.status, "not implemented yet");
  EXPECT_EQ(m.points, 0);
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

TEST(Process, ReportsExitCodeSignalAndMissingProgram) {
  EXPECT_EQ(k2c::grader::run_process({"sh", "-c", "exit 7"}, {}).exit_code, 7);
  EXPECT_EQ(k2c::grader::run_process({"sh", "-c", "kill -SEGV $$"}, {}).signal, 11);
  const auto missing = k2c::grader::run_process({"/nonexistent/program"}, {});
  EXPECT_EQ(missing.exit_code, 127);
  EXPECT_NE(missing.output.find("cannot execute"), std::string::npos);
}

// ---------------------------------------------------------------------------- end to end ---

// One test, because CTest runs every test in its own process and grading the fake course means
// building it: the checks below share that one grading run.
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
  // 50 MiB printed, a bounded slice kept.
  EXPECT_LT(module("86_noisy")["log"].get<std::string>().size(), 100'000u);

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
  auto in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "stage").string());
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
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "stage").string());
  EXPECT_NE(in.problem_for(*mods[0]).find("symbolic link"), std::string::npos);
  // ... and so is a file over the rubric's size limit (1000 bytes in the fake rubric).
  fs::remove(sub / "ok.cpp");
  std::ofstream(sub / "ok.cpp") << std::string(5000, 'x');
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "stage").string());
  EXPECT_NE(in.problem_for(*mods[0]).find("more than 1000"), std::string::npos);
  // A missing file is no problem: the stub is graded.
  fs::remove(sub / "ok.cpp");
  in = k2c::grader::take_submission(rubric, mods, sub.string(), root.string(), (kTmp / "stage").string());
  EXPECT_EQ(in.problem_for(*mods[0]), "");
  EXPECT_EQ(in.files[0].source, "");
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
